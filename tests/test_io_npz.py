"""qarray.save / qarray.load of .npz files (qarray/io/npz.py): the layout,
plain arrays beside QArrays, damaged files, names and the meta's versions
(qarray/io/_schema.py)."""

import io
import json
import re
import zipfile

import numpy as np
import pytest

import qarray
from qarray import QArray

from _reference import assert_same, checkpoint


@pytest.fixture
def arrays(rng):
    x = rng.standard_normal((3, 10)).astype(np.float32)
    return {
        "t": qarray.quantize(x, 0.05, 3, "quint8"),
        "a": qarray.quantize(x, np.linspace(0.01, 0.03, 3, dtype=np.float32), [0, 1, -1], "qint8", axis=0),
        "b": qarray.quantize_dynamic(x, "qint4", axis=1, block_size=4),
        "u2": QArray.from_int(np.array([0, 3, 2, 1, 3]), 0.5, 1, "quint2"),
        "i32": QArray.from_int(np.array([-(2**31), 2**31 - 1]), 1e-3, 0, "qint32"),
        "s": qarray.quantize(np.float32(0.5), 0.1, 0, "qint16"),
    }


def test_round_trip(tmp_path, arrays):
    path = tmp_path / "w.npz"
    qarray.save(path, arrays)
    back = qarray.load(path)
    assert set(back) == set(arrays)
    assert_same(back, arrays)


def test_empty_file_round_trip(tmp_path):
    qarray.save(tmp_path / "e.npz", {})
    assert qarray.load(tmp_path / "e.npz") == {}


def test_sub_byte_is_stored_packed(tmp_path, arrays):
    path = tmp_path / "w.npz"
    qarray.save(path, {"b": arrays["b"]})
    with np.load(path) as f:
        assert f["b.data"].dtype == np.uint8 and f["b.data"].size == 15  # 30 values, 2 per byte


def _rewrite(src, dst, change):
    with np.load(src) as f:
        fields = {k: f[k] for k in f.files}
    change(fields)
    np.savez(dst, **fields)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda f: f.pop("b.scale"), "field b.scale is missing"),
        (lambda f: f.update({"b.data": f["b.data"][:-1]}), re.escape("field b.data is invalid: holds uint8 of shape (14,), expected uint8 of shape (15,) (30 qint4 values)")),
        (lambda f: f.update({"b.data": f["b.data"].astype(np.int8)}), re.escape("field b.data is invalid: holds int8 of shape (15,), expected uint8 of shape (15,)")),
        (lambda f: f.update({"b.scale": -f["b.scale"]}), r"field b.scale/zero_point/meta is invalid: scale must be finite and > 0"),
        (lambda f: f.update({"b.zero_point": f["b.zero_point"] + 100}), "outside the range"),
        (lambda f: f.update({"b.meta": np.array("{not json")}), "field b.meta is invalid: not JSON"),
        (lambda f: f.update({"b.meta": np.array(json.dumps({"format": "qarray-1", "dtype": "int3", "shape": [3, 10], "axis": 1, "block_size": 4}))}),
         "field b.meta is invalid: dtype: unknown quantized dtype 'int3'"),
        (lambda f: f.update({"b.meta": np.array(json.dumps({"format": "qarray-1", "dtype": "qint4", "shape": [3, -10], "axis": 1, "block_size": 4}))}),
         "shape must be a list of non-negative integers"),
        (lambda f: f.update({"b.meta": np.array(json.dumps({"format": "other", "dtype": "qint4"}))}), "field b.meta is invalid: format is not 'qarray'"),
        (lambda f: f.update({"b.weird": np.zeros(1)}), r"unexpected member 'b\.weird\.npy'"),
        (lambda f: f.update({"t.data": np.array([1, 2], np.uint8)}), re.escape("field t.data is invalid: holds uint8 of shape (2,), expected uint8 of shape (30,) (30 quint8 values)")),
    ],
)
def test_damaged_field(tmp_path, arrays, change, message):
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    qarray.save(good, {"b": arrays["b"], "t": arrays["t"]})
    _rewrite(good, bad, change)
    with pytest.raises(ValueError, match=message):
        qarray.load(bad)


def test_truncated_file(tmp_path, arrays):
    path = tmp_path / "w.npz"
    qarray.save(path, arrays)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable qarray file"):
        qarray.load(path)


def test_pickle_is_refused(tmp_path, arrays):
    good, bad = tmp_path / "good.npz", tmp_path / "evil.npz"
    qarray.save(good, {"b": arrays["b"]})
    obj = np.empty(1, dtype=object)
    obj[0] = {"payload": 1}
    _rewrite(good, bad, lambda f: f.update({"b.data": obj}))  # np.savez pickles it
    with pytest.raises(ValueError, match=re.escape("field b.data is invalid: holds object of shape (1,), expected uint8")):
        qarray.load(bad)


def test_save_errors(tmp_path, arrays):
    path = tmp_path / "x.npz"
    with pytest.raises(TypeError, match="dict of name -> QArray or numpy.ndarray, got list"):
        qarray.save(path, [arrays["t"]])
    for name in ("/a", "", 3, "a\0b"):
        with pytest.raises(ValueError, match="names must be non-empty strings, not starting with '/', got"):
            qarray.save(path, {name: arrays["t"]})
    with pytest.raises(TypeError, match=r"'w' is a builtins\.list, not a QArray or numpy\.ndarray"):
        qarray.save(path, {"w": [1.0, 2.0]})
    with pytest.raises(TypeError, match=r"'m' is a numpy\.ma\.MaskedArray, not a QArray or numpy\.ndarray"):
        qarray.save(path, {"m": np.ma.masked_array([1, 2], [0, 1])})
    for bad in (np.array(["x"]), np.array([None]), np.zeros(2, "i4,i4"), np.array(["2020"], "M8[D]")):
        with pytest.raises(TypeError, match=f"'s' has dtype {re.escape(str(bad.dtype))}; plain arrays must be numeric or bool"):
            qarray.save(path, {"s": bad})
    assert not path.exists()


# -- plain arrays beside QArrays (version 2) -----------------------------------

PLAIN_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"]


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
def test_plain_round_trip_every_dtype(tmp_path, rng, dtype):
    if dtype.kind == "b":
        a = rng.integers(0, 2, (3, 5)).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, (3, 5), dtype=dtype, endpoint=True)
        a[0, :2] = info.min, info.max
    else:
        a = (rng.standard_normal((3, 5)) * 1e3).astype(dtype)
        a[0, :3] = np.nan, np.inf, -0.0
    shapes = {"m": a, "zero_d": np.array(a[1, 1]), "empty": a[:0], "empty2": np.zeros((2, 0, 3), dtype),
              "f": np.asfortranarray(a), "swapped": a.astype(dtype.newbyteorder())}
    path = tmp_path / "p.npz"
    qarray.save(path, shapes)
    back = qarray.load(path)
    assert sorted(back) == sorted(shapes)
    for name, want in shapes.items():
        got = back[name]
        assert type(got) is np.ndarray and got.flags.writeable
        assert (got.dtype.str, got.shape) == (want.dtype.str, want.shape)
        assert got.tobytes() == want.tobytes()  # every bit: NaN payloads, -0.0, byte order


def test_plain_and_qarrays_together(tmp_path, arrays):
    ints = np.arange(6, dtype=np.int64).reshape(2, 3)
    saved = {**arrays, "layer.0.ints": ints, "layer.0.weight": arrays["a"]}  # dots, as safetensors names them
    qarray.save(tmp_path / "w.npz", saved)
    back = qarray.load(tmp_path / "w.npz")
    assert sorted(back) == sorted(saved)
    assert back["layer.0.ints"].dtype == np.int64 and np.array_equal(back["layer.0.ints"], ints)
    np.testing.assert_array_equal(back["layer.0.weight"].int_repr(), arrays["a"].int_repr())
    with np.load(tmp_path / "w.npz") as f:
        assert json.loads(str(f["layer.0.ints.meta"])) == {
            "format": "qarray", "version": 2, "kind": "ndarray", "dtype": "<i8", "shape": [2, 3]}


def test_version_1_files_still_load(tmp_path, arrays):
    path = tmp_path / "w.npz"
    qarray.save(path, {"t": arrays["t"]})
    with np.load(path) as f:
        fields = {k: f[k] for k in f.files}
    fields["t.meta"] = np.array(json.dumps({**json.loads(str(fields["t.meta"])), "version": 1}))
    np.savez(path, **fields)
    np.testing.assert_array_equal(qarray.load(path)["t"].int_repr(), arrays["t"].int_repr())


def _plain_meta(**changes):
    meta = {"format": "qarray", "version": 2, "kind": "ndarray", "dtype": "<i2", "shape": [3]}
    meta.update(changes)
    return np.array(json.dumps({k: v for k, v in meta.items() if v is not ...}))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda f: f.update({"p.array": np.zeros(3, np.int32)}),
         re.escape("field p.array is invalid: holds int32 of shape (3,), expected int16 of shape (3,)")),
        (lambda f: f.update({"p.array": np.zeros(4, np.int16)}),
         re.escape("field p.array is invalid: holds int16 of shape (4,), expected int16 of shape (3,)")),
        (lambda f: f.update({"p.meta": _plain_meta(shape=[1, 3])}),
         re.escape("field p.array is invalid: holds int16 of shape (3,), expected int16 of shape (1, 3)")),
        (lambda f: f.update({"p.meta": _plain_meta(dtype="<u2")}),
         re.escape("field p.array is invalid: holds int16 of shape (3,), expected uint16 of shape (3,)")),
        (lambda f: f.update({"p.meta": _plain_meta(dtype="O")}), "field p.meta is invalid: dtype 'O' is not numeric or bool"),
        (lambda f: f.update({"p.meta": _plain_meta(dtype="int17")}),
         "field p.meta is invalid: dtype 'int17' is not a NumPy dtype"),
        (lambda f: f.update({"p.meta": _plain_meta(dtype=4)}), "field p.meta is invalid: dtype must be a string, got 4"),
        (lambda f: f.update({"p.meta": _plain_meta(shape=[-3])}), "field p.meta is invalid: shape must be a list of non-negative integers, got \\[-3\\]"),
        (lambda f: f.update({"p.meta": _plain_meta(kind="qarray")}), "field p.meta is invalid: kind must be 'ndarray' beside p.array, got 'qarray'"),
        (lambda f: f.update({"p.meta": _plain_meta(kind=...)}), re.escape(
            "field p.meta is invalid: keys are ['dtype', 'format', 'shape', 'version'], expected ['dtype', 'format', 'kind', 'shape', 'version']")),
        (lambda f: f.update({"p.meta": _plain_meta(version=1)}), "field p.meta is invalid: version 1 has no plain arrays"),
        (lambda f: f.update({"p.meta": _plain_meta(format="qarray-1", version=...)}), "field p.meta is invalid: version 1 has no plain arrays, but p.array is there"),
        (lambda f: f.update({"p.meta": f["t.meta"]}), re.escape(
            "field p.meta is invalid: keys are ['axis', 'block_size', 'dtype', 'format', 'shape', 'version'], "
            "expected ['dtype', 'format', 'kind', 'shape', 'version']")),
        (lambda f: f.update({"t.meta": _plain_meta()}), re.escape(
            "field t.meta is invalid: keys are ['dtype', 'format', 'kind', 'shape', 'version'], expected")),
        (lambda f: f.pop("p.meta"), "field p.meta is missing"),
        (lambda f: f.update({"p.scale": np.float32(1)}),
         r"unexpected member 'p\.scale\.npy' beside p\.array \(a plain array has only p\.array and p\.meta\)"),
        (lambda f: f.update({"t.array": np.zeros(3, np.int16)}), r"unexpected member 't\.data\.npy' beside t\.array"),
        (lambda f: f.update({"p.array": np.array([1, 2, 3], np.uint8).view(bool),
                             "p.meta": _plain_meta(dtype="|b1")}),
         "field p.array is invalid: a bool array holds bytes other than 0 and 1"),
    ],
)
def test_damaged_plain_array(tmp_path, arrays, change, message):
    path = tmp_path / "w.npz"
    qarray.save(path, {"t": arrays["t"], "p": np.array([1, -2, 3], np.int16)})
    _rewrite(path, path, change)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        qarray.load(path)


def test_damaged_plain_array_data(tmp_path):
    path = tmp_path / "w.npz"
    qarray.save(path, {"p": np.arange(1000, dtype=np.float64)})
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("p.array.npy")
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + 500] ^= 0x10  # a byte of p.array's data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(f"{path}: field p.array is unreadable: BadZipFile: Bad CRC-32")):
        qarray.load(path)
    path.write_bytes(bytes(data[: info.header_offset + 30 + len(info.filename) + 500]))  # truncated there
    with pytest.raises(ValueError, match=re.escape(f"{path} is not a readable qarray file: no zip end record")):
        qarray.load(path)


# -- issue 12: names with "/", file objects, a path without .npz ---------------


def test_names_with_slashes_file_objects_and_paths_without_npz(tmp_path, rng):
    want = checkpoint(rng)
    qarray.save(tmp_path / "model", want)  # numpy adds .npz
    assert (tmp_path / "model.npz").exists() and not (tmp_path / "model").exists()
    assert_same(qarray.load(tmp_path / "model"), want, plain=True)
    assert_same(qarray.load(str(tmp_path / "model.npz")), want, plain=True)
    for other in ("model.pt", "model.zarr", "model.NPZ"):  # NumPy would write other.npz, silently
        with pytest.raises(ValueError, match=rf"^save: {re.escape(str(tmp_path / other))} is neither \.npz, "
                                             r"\.safetensors nor \.gguf; name it so \(a path without a suffix gets \.npz\), or "
                                             r"write a \.zarr store with qarray\.zarr\.to_zarr$"):
            qarray.save(tmp_path / other, want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]
    buf = io.BytesIO()
    qarray.save(buf, want)
    buf.seek(0)
    assert_same(qarray.load(buf), want, plain=True)
    with pytest.raises(ValueError, match=r"<file object> is not a readable qarray file"):
        qarray.load(io.BytesIO(b"not a zip at all, long enough for the end record"))
