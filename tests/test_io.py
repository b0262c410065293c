import importlib.util
import io
import json
import math
import re
import zipfile

import numpy as np
import pytest

import qarray
from qarray import QArray

from _reference import assert_same, write_safetensors


needs_safetensors = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                       reason="safetensors is not installed (pip install safetensors)")


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


# -- plain arrays beside QArrays (version 2) ------------------------------------------

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


# -- issue 12: names with "/", file objects, a path without .npz, safetensors ---------


def _checkpoint(rng):
    w = qarray.quantize(rng.standard_normal((6, 8)).astype(np.float32), np.linspace(0.01, 0.1, 6).astype(np.float32),
                        np.arange(-3, 3).astype(np.int32), "qint4", axis=0)
    blocked = qarray.quantize(rng.standard_normal((4, 10)).astype(np.float32), 0.05, 0, "quint8", axis=1, block_size=4)
    return {"encoder/fc1.weight": w, "encoder/fc1.bias": rng.standard_normal(6).astype(np.float32),
            "head.w": blocked, "steps": np.arange(3, dtype=np.int64), "q32": qarray.QArray.from_int(
                np.array([-(2**31), 2**31 - 1]), 1e-3, -7, "qint32")}


def _check_checkpoint(got, want):
    assert_same(got, want, plain=True)


def test_names_with_slashes_file_objects_and_paths_without_npz(tmp_path, rng):
    want = _checkpoint(rng)
    qarray.save(tmp_path / "model", want)  # numpy adds .npz
    assert (tmp_path / "model.npz").exists() and not (tmp_path / "model").exists()
    _check_checkpoint(qarray.load(tmp_path / "model"), want)
    _check_checkpoint(qarray.load(str(tmp_path / "model.npz")), want)
    for other in ("model.pt", "model.zarr", "model.NPZ"):  # NumPy would write other.npz, silently
        with pytest.raises(ValueError, match=rf"^save: {re.escape(str(tmp_path / other))} is neither \.npz nor "
                                             r"\.safetensors; name it so \(a path without a suffix gets \.npz\), or "
                                             r"write a \.zarr store with qarray\.zarr\.to_zarr$"):
            qarray.save(tmp_path / other, want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]
    buf = io.BytesIO()
    qarray.save(buf, want)
    buf.seek(0)
    _check_checkpoint(qarray.load(buf), want)
    with pytest.raises(ValueError, match=r"<file object> is not a readable qarray file"):
        qarray.load(io.BytesIO(b"not a zip at all, long enough for the end record"))


@needs_safetensors
def test_safetensors_round_trip_exact(tmp_path, rng):
    want = _checkpoint(rng)
    path = tmp_path / "m.safetensors"
    qarray.save(path, want)
    _check_checkpoint(qarray.load(path), want)
    from safetensors.numpy import load_file
    from safetensors import safe_open

    raw = load_file(str(path))  # plain tensors any safetensors reader sees
    np.testing.assert_array_equal(raw["head.w"], want["head.w"].int_repr())
    assert raw["encoder/fc1.weight"].dtype == np.uint8 and raw["encoder/fc1.weight"].shape == (6, 4)  # packed
    with safe_open(str(path), "np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "qarray"  # the file's label, where PyTorch's say "pt"
    assert json.loads(metadata["head.w"]) == {"format": "qarray", "version": 2, "dtype": "quint8", "shape": [4, 10],
                                              "axis": 1, "block_size": 4}
    assert json.loads(metadata["encoder/fc1.weight"]) == {
        "format": "qarray", "version": 4, "dtype": "qint4", "shape": [6, 8], "axis": 0, "block_size": None,
        "scale_dtype": "float32", "global_scale": None}


def _rows_reference(codes, bits):
    """Integer codes packed row by row with Python ints, independently of
    QArray.pack: ``8 // bits`` codes a byte, the first in the low bits (ONNX's
    and PyTorch's order), two's complement within ``bits``, rows padded with 0."""
    codes = np.asarray(codes).reshape(np.shape(codes) or (1,))
    per, mask = 8 // bits, (1 << bits) - 1
    out = []
    for row in codes.reshape(math.prod(codes.shape[:-1]), codes.shape[-1]).tolist():
        row = row + [0] * (-len(row) % per)
        out.append([sum((int(c) & mask) << (bits * j) for j, c in enumerate(row[i:i + per]))
                    for i in range(0, len(row), per)])
    return np.array(out, np.uint8).reshape(codes.shape[:-1] + (-(-codes.shape[-1] // per),))


@pytest.mark.parametrize("dtype", ["qint4", "quint4", "qint2", "quint2"])
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 7), (2, 3, 1), (4, 0), (2, 16)])
@needs_safetensors
def test_safetensors_holds_codes_below_8_bits_packed_by_rows(tmp_path, dtype, shape):
    """Codes below 8 bits take their packed size in a .safetensors file, not a
    byte each: the tensor NAME is uint8, each row along the last axis packed and
    padded to whole bytes, checked byte for byte against Python-int packing at
    qmin and qmax; the same file from a Dask QArray whose chunks split rows at
    odd places; read back exactly."""
    d = qarray.qdtype(dtype)
    n = math.prod(shape)
    codes = np.resize(np.array([d.qmin, d.qmax, d.qmin + 1, 0, d.qmax - 1], np.int64), n).reshape(shape)
    q = QArray.from_int(codes, 0.5, 0, dtype)
    path = tmp_path / "m.safetensors"
    qarray.save(path, {"w": q})
    raw = _st_tensors(path)["w"]
    want = _rows_reference(codes, d.bits)
    assert raw.dtype == np.uint8 and raw.shape == want.shape
    np.testing.assert_array_equal(raw, want)
    assert_same(qarray.load(path)["w"], q)
    if shape and shape[-1] > 3:
        pytest.importorskip("dask.array")
        import dask.array as da

        lazy = qarray.quantize(da.from_array(q.dequantize(), chunks=(1,) * (len(shape) - 1) + (3,)), 0.5, 0, dtype)
        qarray.save(tmp_path / "lazy.safetensors", {"w": lazy})
        got, want = _st_tensors(tmp_path / "lazy.safetensors"), _st_tensors(path)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
        assert_same(qarray.load(tmp_path / "lazy.safetensors")["w"], q)


def _st_tensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("dtype", ["float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "mxfp4", "nvfp4"])
@needs_safetensors
def test_safetensors_packs_small_float_formats_by_rows(tmp_path, rng, dtype):
    """float4 two a byte and float6 four in three bytes per row (each row as
    QArray.pack packs it), blocked formats with their scales; exact round trip."""
    pytest.importorskip("ml_dtypes")
    x = rng.standard_normal((3, 32)).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 1e9]
    if dtype == "mxfp4":
        q = qarray.quantize_mx(x, "mxfp4")
    elif dtype == "nvfp4":
        q = qarray.quantize_nvfp4(x)
    else:
        q = qarray.quantize(x, 0.25, 0, dtype)
    path = tmp_path / "m.safetensors"
    qarray.save(path, {"w": q})
    raw = _st_tensors(path)["w"]
    per_row = [QArray.from_int(q.int_repr()[i].view(q.data.dtype), 1.0, 0, q.dtype.name
                               if q.dtype.name not in ("mxfp4", "nvfp4") else "float4_e2m1fn").pack()
               for i in range(3)]
    np.testing.assert_array_equal(raw, np.stack(per_row))
    assert raw.nbytes == 3 * 32 * q.dtype.bits // 8
    back = qarray.load(path)["w"]
    assert (back.dtype, back.shape, back.axis, back.block_size) == (q.dtype, q.shape, q.axis, q.block_size)
    np.testing.assert_array_equal(back.int_repr(), q.int_repr())
    assert back.scale.dtype == q.scale.dtype and back.scale.tobytes() == q.scale.tobytes()
    assert back.global_scale == q.global_scale


@needs_safetensors
def test_safetensors_files_of_version_3_and_before_still_load(tmp_path):
    """qarray 0.x wrote qint4 codes one a byte with the QArray's shape (versions 2
    and 3): such files load unchanged; a version 4 tensor of the wrong packed
    shape is refused naming both."""
    from safetensors.numpy import save_file

    codes = np.array([[-8, 7, 0], [1, -1, 3]], np.int8)
    for version, extra in ((2, {}), (3, {"scale_dtype": "float32", "global_scale": None})):
        meta = {"format": "qarray", "version": version, "dtype": "qint4", "shape": [2, 3], "axis": None,
                "block_size": None, **extra}
        save_file({"w": codes, "w.scale": np.array(0.5, np.float32), "w.zero_point": np.array(0, np.int32)},
                  str(tmp_path / "old.safetensors"), metadata={"w": json.dumps(meta)})
        np.testing.assert_array_equal(qarray.load(tmp_path / "old.safetensors")["w"].int_repr(), codes)
    meta = {"format": "qarray", "version": 4, "dtype": "qint4", "shape": [2, 3], "axis": None, "block_size": None,
            "scale_dtype": "float32", "global_scale": None}
    save_file({"w": codes.view(np.uint8), "w.scale": np.array(0.5, np.float32), "w.zero_point": np.array(0, np.int32)},
              str(tmp_path / "bad.safetensors"), metadata={"w": json.dumps(meta)})
    with pytest.raises(ValueError, match=re.escape("tensor 'w' is uint8 [2, 3], but its metadata says qint4 [2, 3], "
                                                   "packed by rows: uint8 [2, 2]")):
        qarray.load(tmp_path / "bad.safetensors")


@needs_safetensors
def test_safetensors_refuses_a_qarray_called_format(tmp_path):
    q = QArray.from_int(np.array([1, 2]), 1.0, 0, "qint8")
    with pytest.raises(ValueError, match="cannot be called 'format': the file's metadata entry 'format' says 'qarray'"):
        qarray.save(tmp_path / "f.safetensors", {"format": q})
    qarray.save(tmp_path / "f.safetensors", {"format": np.arange(2)})  # a plain array has no metadata entry


@needs_safetensors
def test_safetensors_float_weights_from_other_tools_quantize(tmp_path, rng):
    from safetensors.numpy import save_file

    w = rng.standard_normal((5, 7)).astype(np.float32)
    save_file({"layer.weight": w}, str(tmp_path / "f.safetensors"), metadata={"source": "another tool"})
    got = qarray.load(tmp_path / "f.safetensors")
    np.testing.assert_array_equal(got["layer.weight"], w)
    q = qarray.quantize(got["layer.weight"], 0.02, 0, "qint8")
    np.testing.assert_array_equal(q.int_repr(), qarray.quantize(w, 0.02, 0, "qint8").int_repr())


@pytest.mark.parametrize("code,fmt", [("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")])
@needs_safetensors
def test_safetensors_checkpoint_floats_load_and_save(tmp_path, rng, code, fmt):
    """bfloat16 and float8 tensors of a checkpoint (PyTorch's BF16, F8_E4M3,
    F8_E5M2) load bit for bit, 0-d and empty ones too, quantize from their
    values, and save back under the same codes."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = getattr(ml_dtypes, fmt)
    w = rng.standard_normal((6, 9)).astype(t)
    tensors = {"w": (code, w), "s": (code, np.array(1.5, t)), "e": (code, np.zeros((0, 3), t)),
               "n": ("I64", np.arange(4))}
    write_safetensors(tmp_path / "m.safetensors", tensors)
    got = qarray.load(tmp_path / "m.safetensors")
    for name, (_, a) in tensors.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name].reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8))
    q = qarray.quantize(got["w"], 0.02, 0, "qint8")
    np.testing.assert_array_equal(q.int_repr(), qarray.quantize(w.astype(np.float32), 0.02, 0, "qint8").int_repr())
    qarray.save(tmp_path / "again.safetensors", {"w": got["w"], "q": q})
    with open(tmp_path / "again.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["w"]["dtype"] == code
    back = qarray.load(tmp_path / "again.safetensors")
    np.testing.assert_array_equal(back["w"].view(np.uint8), w.view(np.uint8))
    np.testing.assert_array_equal(back["q"].int_repr(), q.int_repr())


@needs_safetensors
def test_safetensors_errors(tmp_path, rng):
    from safetensors.numpy import save_file

    q = qarray.quantize(rng.standard_normal(4).astype(np.float32), 0.1, 0, "qint8")
    with pytest.raises(ValueError, match=r"tensor name 'w.scale' is used twice"):
        qarray.save(tmp_path / "a.safetensors", {"w": q, "w.scale": np.zeros(1, np.float32)})
    meta = json.dumps({"format": "qarray", "version": 2, "dtype": "qint8", "shape": [4], "axis": None, "block_size": None})
    save_file({"w": q.int_repr(), "w.scale": np.array(0.1, np.float32)}, str(tmp_path / "b.safetensors"),
              metadata={"w": meta})
    with pytest.raises(ValueError, match=r"QArray 'w' has no tensor 'w.zero_point'"):
        qarray.load(tmp_path / "b.safetensors")
    save_file({"w": q.int_repr().astype(np.int16), "w.scale": np.array(0.1, np.float32),
               "w.zero_point": np.array(0, np.int32)}, str(tmp_path / "c.safetensors"), metadata={"w": meta})
    with pytest.raises(ValueError, match=r"tensor 'w' is int16 \[4\], but its metadata says qint8"):
        qarray.load(tmp_path / "c.safetensors")
    save_file({"w": np.array([1, 2, 3, 200], np.int16).astype(np.int8), "w.scale": np.array(-0.1, np.float32),
               "w.zero_point": np.array(0, np.int32)}, str(tmp_path / "d.safetensors"), metadata={"w": meta})
    with pytest.raises(ValueError, match=r"QArray 'w' is invalid: .*scale"):
        qarray.load(tmp_path / "d.safetensors")
    (tmp_path / "e.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        qarray.load(tmp_path / "e.safetensors")
