"""``qarray convert`` (qarray/cli/convert.py), in process: checkpoints carried between GGUF,
GPTQ, compressed-tensors and MLX code for code, the tensors that cannot be and say why, and
``--requantize``'s SQNR table."""

import json

import numpy as np
import pytest

import qarray as qa
from qarray.io import gguf
from qarray.io.hf import from_qarray

from _reference import fails, rows, run

pytest.importorskip("rich")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("wide_tables")


def _x(rng, n=8, k=256):
    x = rng.normal(size=(n, k)).astype(np.float32)
    x[0], x[1, ::2] = 0, -3
    return x


def test_gptq_to_gguf_to_mlx(rng, tmp_path, capsys):
    """GPTQ's symmetric 4-bit groups of 32 become Q4_0 with the same codes and float16 scales, and
    back; its asymmetric ones Q5_0 (the 5-bit codes hold code - zero); MLX's groups of 64 have no GPTQ
    form, and the error names the tensor and says why, writing nothing."""
    x = _x(rng)
    sym = qa.quantize(x, dtype="int4_g32_f16")
    qa.save(tmp_path / "gptq", {"model.l.weight": sym, "model.norm": np.ones(8, np.float32)}, format="gptq")
    rc, out, err = run(capsys, "convert", tmp_path / "gptq", "-o", tmp_path / "m.gguf")
    assert rc == 0, err
    assert rows(out)[0] == ["model.l.weight", "8x256", "int4_g32_f16", "Q4_0", "exact"]
    t, _ = gguf.read(tmp_path / "m.gguf")
    q40 = t["model.l.weight"]
    assert q40.dtype.name == "Q4_0" and np.array_equal(t["model.norm"], np.ones(8, np.float32))
    assert np.array_equal(q40.fields["d"].reshape(8, -1), from_qarray(sym).scale)
    assert np.array_equal(q40.int_repr(), from_qarray(sym).codes)
    rc, out, err = run(capsys, "convert", tmp_path / "m.gguf", "-o", tmp_path / "back", "--to", "gptq")
    assert rc == 0, err
    back = qa.load(tmp_path / "back")["model.l.weight"]
    assert back.dtype == sym.dtype and np.array_equal(back.data, sym.data)
    asym = qa.quantize(x, dtype="uint4_g32_f16_zp")  # code - zero in [-15, 15]: Q5_0's code - 16, exactly
    qa.save(tmp_path / "asym", {"model.l.weight": asym}, format="gptq")
    rc, out, err = run(capsys, "convert", tmp_path / "asym", "-o", tmp_path / "5.gguf")
    assert rc == 0 and rows(out)[0][3:] == ["Q5_0", "exact"], err
    q50 = gguf.read(tmp_path / "5.gguf")[0]["model.l.weight"]
    g = from_qarray(asym)
    assert np.array_equal(q50.int_repr().astype(int) - 16, g.codes.astype(int) - np.repeat(g.zero, 32, axis=1))
    qa.save(tmp_path / "b64", {"model.l.weight": qa.quantize(x, dtype="uint4_g64_bf16_bias")}, format="mlx")
    fails(capsys, 1, "model.l.weight: uint4_g64_bf16_bias has no exact gptq form (the offsets (biases) have nowhere "
          "to go); --requantize DTYPE quantizes it again from its values", "convert", tmp_path / "b64", "-o",
          tmp_path / "a", "--to", "gptq")
    assert not (tmp_path / "a").exists()


def test_mlx_to_q4_1_and_requantize(rng, tmp_path, capsys):
    """MLX's 4-bit groups of 32 with float16 scales are Q4_1; its 64-groups are not, and --requantize
    quantizes them again, printing the SQNR against MLX's values."""
    x = _x(rng)
    a, b = qa.quantize(x, dtype="uint4_g32_f16_bias"), qa.quantize(x, dtype="uint4_g64_f16_bias")
    qa.save(tmp_path / "mlx", {"a.weight": a, "b.weight": b}, format="mlx")
    cfg = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine",
                                   "b": {"group_size": 64, "bits": 4, "mode": "affine"}}
    rc, out, err = run(capsys, "convert", tmp_path / "mlx", "-o", tmp_path / "m.gguf", "--requantize", "Q4_K")
    assert rc == 0, err
    got = {r[0]: r for r in rows(out)}
    assert got["a.weight"][2:] == ["uint4_g32_f16_bias", "Q4_1", "exact"]
    t, _ = gguf.read(tmp_path / "m.gguf")
    want = qa.quantize(b.dequantize(), dtype="Q4_K")
    assert np.array_equal(t["b.weight"].data, want.data)
    y = b.dequantize().astype(np.float64)
    e = y - want.dequantize()
    assert got["b.weight"][2:] == ["uint4_g64_f16_bias", "Q4_K", f"{10 * np.log10(np.sum(y**2) / np.sum(e**2)):.2f} dB"]
    assert np.array_equal(t["a.weight"].fields["m"].reshape(8, -1), from_qarray(a).bias)


def test_usage_errors(tmp_path, capsys):
    fails(capsys, 2, "a directory output needs --to compressed-tensors, mlx or gptq (or name OUT.gguf)",
          "convert", tmp_path, "-o", tmp_path / "out")
    fails(capsys, 2, "--requantize int4_g32_f16: a GGUF type with a quantizer (Q4_K, Q8_0, ...) for a .gguf output",
          "convert", tmp_path, "-o", tmp_path / "o.gguf", "--requantize", "int4_g32_f16")
    fails(capsys, 2, f"{tmp_path / 'x.npz'}: expected a .gguf file or a checkpoint directory (config.json and "
          ".safetensors)", "convert", tmp_path / "x.npz", "-o", tmp_path / "o.gguf")


def test_inspect_checkpoint(rng, tmp_path, capsys):
    """qarray inspect DIR: each quantized weight's grouped format, shape and bits per weight."""
    q = qa.QArray._blocks(qa.quantize(_x(rng), dtype="uint4_g32_f16_zp").data, qa.qdtype("uint4_g32_f16_zp"), None,
                          rng.permutation(256))
    qa.save(tmp_path / "c", {"l.weight": q, "norm": np.ones(4, np.float32)}, format="gptq")
    rc, out, err = run(capsys, "inspect", tmp_path / "c")
    assert rc == 0, err
    assert rows(out)[:2] == [["l.weight", "8x256", "uint4_g32_f16_zp", "4.75", "act-order", "1216"],
                             ["norm", "4", "float32", "", "", "16"]]
