"""qarray.save / qarray.load of .safetensors files (qarray/io/safetensors.py):
codes packed by rows, bfloat16 and float8 checkpoints, other tools' files, errors."""

import importlib.util
import json
import math
import re

import numpy as np
import pytest

import qarray
from qarray import QArray

from _reference import assert_same, checkpoint, write_safetensors


needs_safetensors = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                       reason="safetensors is not installed (pip install safetensors)")


@needs_safetensors
def test_safetensors_round_trip_exact(tmp_path, rng):
    want = checkpoint(rng)
    path = tmp_path / "m.safetensors"
    qarray.save(path, want)
    assert_same(qarray.load(path), want, plain=True)
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
