import json
import re
import zipfile

import numpy as np
import pytest

import qarray
from qarray import QArray


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
    for name, q in arrays.items():
        r = back[name]
        assert (r.dtype, r.shape, r.axis, r.block_size) == (q.dtype, q.shape, q.axis, q.block_size)
        np.testing.assert_array_equal(r.int_repr(), q.int_repr())
        np.testing.assert_array_equal(r.scale, q.scale)
        np.testing.assert_array_equal(r.zero_point, q.zero_point)


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
    with pytest.raises(TypeError, match="dict of name -> QArray"):
        qarray.save(tmp_path / "x.npz", [arrays["t"]])
    with pytest.raises(ValueError, match="without '.' or '/'"):
        qarray.save(tmp_path / "x.npz", {"a.b": arrays["t"]})
    with pytest.raises(TypeError, match="'w' is a ndarray, not a QArray"):
        qarray.save(tmp_path / "x.npz", {"w": np.zeros(3)})


def test_not_an_npz(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros(3))
    with pytest.raises(ValueError, match="holds a single array, not an .npz archive"):
        qarray.load(path)
    path.write_bytes(b"hello world, not numpy")
    with pytest.raises(ValueError, match="not a readable qarray file"):
        qarray.load(path)
