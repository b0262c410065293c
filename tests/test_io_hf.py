"""Hugging Face checkpoints (qarray/io/hf.py, checkpoint.py and a module per convention)
against the conventions' own libraries, bit for bit: compressed-tensors 0.20, MLX 0.32
and bitsandbytes 0.50 run here (CI installs them); GPTQ and AWQ against the vectors
in tests/data/hf (made by their libraries: see its README)."""

import json
import os
import re

import numpy as np
import pytest

import qarray as qa
from qarray import _blocks
from qarray.io import hf
from qarray.io.hf import from_qarray, pack_words, unpack_words, write

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bitsandbytes asks the Hub for kernels it does not need on the CPU


def _hard(rng, n, k):
    """Rows that reach the codes' ends: zeros, a tiny constant, ties, a ramp both ways, a constant, a wide
    spread."""
    x = rng.normal(size=(n, k)).astype(np.float32) * 0.05
    x[0], x[1], x[2, ::2], x[5] = 0, 1e-4, -3, 7.0
    x[3] = np.linspace(-1, 2, k)
    x[4] = -x[3]
    x[6] = rng.normal(size=k) * 1e4
    return x


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


# -- packing in 32-bit words -----------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dense", [True, False])
def test_words_against_a_bit_stream(rng, bits, dense):
    """Element i at bit i * bits of the little-endian stream (dense), or 32 // bits a word (per word):
    against a loop over Python integers."""
    codes = rng.integers(0, 1 << bits, (3, 77)).astype(np.uint8)
    codes[0] = (1 << bits) - 1
    words = pack_words(codes, bits, dense)
    per = 32 // bits
    for r in range(3):
        stream = 0
        for i, c in enumerate(codes[r].tolist()):
            at = i * bits if dense else (i // per) * 32 + (i % per) * bits
            stream |= c << at
        want = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(words.shape[1])]
        assert words[r].view(np.uint32).tolist() == want
    assert np.array_equal(unpack_words(words, bits, 77, dense), codes)


# -- MLX -------------------------------------------------------------------------------------------

mx = None


def _mlx():
    global mx
    mx = pytest.importorskip("mlx.core")
    return mx


def _mx_numpy(a):
    ml = pytest.importorskip("ml_dtypes")
    return np.array(a.view(mx.uint16)).view(ml.bfloat16) if a.dtype == mx.bfloat16 else np.array(a)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_mlx_read_quantize_write(rng, tmp_path, bits, group, dtype):
    """mx.quantize's files load as MLX dequantizes them (scales * q, rounded, + biases, rounded, in the
    model's type); qa.quantize picks MLX's codes, scales and biases; qa.save(format="mlx") writes what
    mx.dequantize reads back to the same values."""
    _mlx()
    t = getattr(mx, dtype)
    x = mx.array(_hard(rng, 8, 256)).astype(t)
    wq, s, b = mx.quantize(x, group_size=group, bits=bits)
    ref = np.array(mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32))
    write(tmp_path / "in", {"l.weight": _mx_numpy(wq), "l.scales": _mx_numpy(s), "l.biases": _mx_numpy(b)},
          {"group_size": group, "bits": bits, "mode": "affine"}, "quantization")
    q = qa.load(tmp_path / "in")["l.weight"]
    st = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[dtype]
    assert q.dtype.name == f"uint{bits}_g{group}_{st}_bias" and q.shape == (8, 256)
    assert np.array_equal(_bits(q.dequantize()), _bits(ref))
    mine = qa.quantize(np.array(x.astype(mx.float32)), dtype=q.dtype.name)
    assert np.array_equal(mine.data, q.data)
    qa.save(tmp_path / "out", {"l.weight": mine}, format="mlx")
    back = mx.load(str(tmp_path / "out" / "model.safetensors"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert cfg == {"group_size": group, "bits": bits, "mode": "affine"}
    again = mx.dequantize(back["l.weight"], back["l.scales"], back["l.biases"], group_size=group, bits=bits)
    assert np.array_equal(_bits(np.array(again.astype(mx.float32))), _bits(ref))


# -- compressed-tensors ----------------------------------------------------------------------------

def _ct():
    pytest.importorskip("compressed_tensors")
    torch = pytest.importorskip("torch")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return torch, BaseCompressor, QuantizationArgs, QuantizationScheme


def _torch_numpy(t):
    torch = pytest.importorskip("torch")
    ml = pytest.importorskip("ml_dtypes")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml.float8_e4m3fn)
    return t.numpy()


def _ct_checkpoint(path, fmt, args, n=48, k=256, dtype="float16", seed=0):
    """A one-layer checkpoint ``l`` compressed by compressed-tensors from chosen parameters and codes
    at both ends, and the library's own decompression of it."""
    torch, BaseCompressor, QuantizationArgs, QuantizationScheme = _ct()
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    a = QuantizationArgs(**args)
    groups = {"tensor": 1, "channel": 1, "group": k // (args.get("group_size") or k), "block": None}[a.strategy]
    if a.strategy == "block":
        rows, cols = args["block_structure"]
        scale = torch.rand(-(-n // rows), k // cols, generator=g) * 0.01 + 1e-3
    else:
        scale = torch.rand(1 if a.strategy == "tensor" else n, groups, generator=g) * 0.01 + 1e-3
        scale = scale.reshape(1) if a.strategy == "tensor" else scale
    scale[(0,) * scale.ndim] = 6e-5  # near float16's smallest normal
    w = torch.randn(n, k, generator=g) * 0.05
    w[1] = 1e3  # saturates: the top code
    w[2] = -1e3
    sd = {"weight": w.to(dt), "weight_scale": scale.to(dt)}
    if not a.symmetric:
        lo, hi = -(1 << a.num_bits - 1), (1 << a.num_bits - 1) - 1
        zp = torch.randint(lo, hi + 1, scale.shape, generator=g).to(torch.int8)
        zp.view(-1)[0], zp.view(-1)[-1] = lo, hi
        sd["weight_zero_point"] = zp
    scheme = QuantizationScheme(targets=["Linear"], weights=a)
    comp = BaseCompressor.get_value_from_registry(fmt)
    c = comp.compress(dict(sd), scheme)
    ref = comp.decompress({key: v.clone() for key, v in c.items()}, scheme)["weight"]
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": a.model_dump(), "format": fmt}}}
    write(path, {f"l.{key}": _torch_numpy(v) for key, v in c.items() if v is not None}, qc)
    return ref.float().numpy()


CT_PACKED = [dict(num_bits=b, type="int", symmetric=sym, strategy=s, group_size=gs)
             for b in (2, 3, 4, 5, 6, 7, 8) for sym in (True, False)
             for s, gs in (("group", 32), ("group", 128), ("channel", None))]


@pytest.mark.parametrize("args", CT_PACKED, ids=lambda a: f"{a['num_bits']}b-{'sym' if a['symmetric'] else 'asym'}-"
                         f"{a['strategy']}{a['group_size'] or ''}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ct_pack_quantized(tmp_path, args, dtype):
    """pack-quantized (0.20's dense packing), every bit width, symmetric and not, groups and channels:
    the values compressed-tensors decompresses, in the scales' type."""
    ref = _ct_checkpoint(tmp_path, "pack-quantized", args, dtype=dtype)
    q = qa.load(tmp_path)["l.weight"]
    assert q.shape == (48, 256)
    assert np.array_equal(_bits(q.dequantize()), _bits(ref))


@pytest.mark.parametrize("fmt", ["int-quantized", "naive-quantized"])
@pytest.mark.parametrize("sym", [True, False])
def test_ct_int8(tmp_path, fmt, sym):
    ref = _ct_checkpoint(tmp_path, fmt, dict(num_bits=8, type="int", symmetric=sym, strategy="channel"),
                         dtype="bfloat16")
    q = qa.load(tmp_path)["l.weight"]
    assert q.dtype.name == ("int8_g256_bf16" if sym else "uint8_g256_bf16_zp")
    assert np.array_equal(_bits(q.dequantize()), _bits(ref))


@pytest.mark.parametrize("args", [dict(strategy="tensor"), dict(strategy="channel"),
                                  dict(strategy="block", block_structure=[16, 128])], ids=lambda a: a["strategy"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ct_fp8(tmp_path, args, dtype):
    """float-quantized: float8 e4m3 codes times a tensor, channel or block scale, in the scales' type."""
    ref = _ct_checkpoint(tmp_path, "float-quantized", dict(num_bits=8, type="float", symmetric=True, **args),
                         dtype=dtype)
    q = qa.load(tmp_path)["l.weight"]
    assert q.dtype.name.startswith("e4m3_g")
    assert np.array_equal(_bits(q.dequantize()), _bits(ref))


def _ct_decompress(path):
    """compressed-tensors' own decompression of a checkpoint qarray wrote: each config group's args
    parsed by the library, each layer's tensors through its format's compressor."""
    torch, BaseCompressor, QuantizationArgs, QuantizationScheme = _ct()
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    sd = load_file(str(path / "model.safetensors"))
    out = {}
    for group in cfg["config_groups"].values():
        args = QuantizationArgs(**group["weights"])
        comp = BaseCompressor.get_value_from_registry(group["format"])
        for t in group["targets"]:
            p = re.fullmatch(r"re:\^(.*)\$", t).group(1).replace("\\", "")
            own = {k[len(p) + 1:]: v for k, v in sd.items() if k.startswith(p + ".")}
            out[p + ".weight"] = comp.decompress(own, QuantizationScheme(targets=[t], weights=args))["weight"]
    return out


def test_ct_write(rng, tmp_path):
    """qa.save(format="compressed-tensors"): int4 groups, int8 channels, 3-bit zero points, FP8: what
    compressed-tensors decompresses is qarray's values, and the directory loads back byte for byte."""
    x = _hard(rng, 48, 256)
    tensors = {"a.weight": qa.quantize(x, dtype="int4_g128_f16"), "b.weight": qa.quantize(x[:32], dtype="uint4_g32_bf16_zp"),
               "c.weight": qa.quantize(x, dtype="e4m3_g256_bf16"), "d.weight": qa.quantize(x[:, :128], dtype="int8_g128_f16"),
               "e.weight": qa.quantize(x, dtype="uint3_g128_f16_zp"), "norm": np.ones(4, np.float32)}
    qa.save(tmp_path / "ct", tensors, format="compressed-tensors")
    ref = _ct_decompress(tmp_path / "ct")
    back = qa.load(tmp_path / "ct")
    for name, q in tensors.items():
        if isinstance(q, np.ndarray):
            assert np.array_equal(back[name], q)
            continue
        assert np.array_equal(_bits(ref[name].float().numpy()), _bits(q.dequantize())), name
        assert back[name].dtype == q.dtype and np.array_equal(back[name].data, q.data)


def test_ct_legacy_and_dense_packing(tmp_path):
    """3-bit rows of 256 take 24 words packed densely and 26 per word (before 0.18): both read; where
    the two take as many words and differ, it is an error that says so."""
    codes = np.arange(256 * 4, dtype=np.uint8).reshape(4, 256) % 8
    scale = np.full((4, 2), 0.5, np.float16)
    for dense in (True, False):
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": {"num_bits": 3, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": 128}}}}
        write(tmp_path / str(dense), {"l.weight_packed": pack_words(codes, 3, dense),
                                      "l.weight_shape": np.array([4, 256]), "l.weight_scale": scale}, qc)
        q = qa.load(tmp_path / str(dense))["l.weight"]
        assert np.array_equal(from_qarray(q).codes, codes)
    write(tmp_path / "odd", {"l.weight_packed": pack_words(codes[:, :11], 3, True),
                             "l.weight_shape": np.array([4, 11]), "l.weight_scale": scale[:, :1]}, qc)
    with pytest.raises(ValueError, match=r"l: 11 3-bit codes take 2 words packed densely \(compressed-tensors 0.18 "
                       r"and later\) and per word \(before\): the file does not say which, so it cannot be read"):
        qa.load(tmp_path / "odd")


# -- bitsandbytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("block", [64, 128])
def test_bnb_4bit(rng, tmp_path, kind, double, block):
    """Linear4bit's state dict loads as bitsandbytes dequantizes it (float32, then the model's type);
    qa.quantize gives its codes and absmax."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    F = pytest.importorskip("bitsandbytes.functional")
    x = _hard(rng, 16, 256)
    w = torch.from_numpy(x).to(torch.bfloat16)
    p = bnb.nn.Params4bit(w, requires_grad=False, quant_type=kind, compress_statistics=double, blocksize=block)
    lin = bnb.nn.Linear4bit(256, 16, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double,
                            quant_type=kind)
    lin.weight = p
    lin = lin.to("cpu")
    ref = F.dequantize_4bit(lin.weight.data, lin.weight.quant_state).float().numpy()
    write(tmp_path, {f"l.{k}": _torch_numpy(v) for k, v in lin.state_dict().items()},
          {"quant_method": "bitsandbytes", "load_in_4bit": True})
    q = qa.load(tmp_path)["l.weight"]
    assert q.dtype.name == f"{'nf4' if kind == 'nf4' else 'fp4bnb'}_g{block}_f32"
    ml = pytest.importorskip("ml_dtypes")
    assert np.array_equal(q.dequantize().astype(ml.bfloat16).astype(np.float32), ref)
    packed, state = F.quantize_4bit(torch.from_numpy(x), blocksize=block, quant_type=kind)
    mine = from_qarray(qa.quantize(x, dtype=q.dtype.name))
    b = packed.numpy().reshape(-1)
    assert np.array_equal(np.stack([b >> 4, b & 15], -1).reshape(16, 256), mine.codes)
    assert np.array_equal(state.absmax.numpy(), mine.scale.reshape(-1))


# -- GPTQ and AWQ: the libraries' vectors (tests/data/hf) ------------------------------------------

HF_DATA = os.path.join(os.path.dirname(__file__), "data", "hf")
CASES = sorted(d for d in os.listdir(HF_DATA) if os.path.isfile(os.path.join(HF_DATA, d, "config.json"))) \
    if os.path.isdir(HF_DATA) else []


@pytest.mark.parametrize("case", CASES)
def test_library_vectors(case):
    """Each checkpoint made by GPTQModel, AutoGPTQ, AutoAWQ or compressed-tensors 0.17 loads to the values
    its library dequantizes, bit for bit."""
    st = pytest.importorskip("safetensors.numpy")
    path = os.path.join(HF_DATA, case)
    loaded = qa.load(path)
    want = st.load_file(os.path.join(path, "expected.safetensors"))
    assert want
    for name, ref in want.items():
        assert np.array_equal(_bits(loaded[name].dequantize()), _bits(ref.astype(np.float32))), name


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("zero0", [False, True])
def test_gptq_write_read(rng, tmp_path, bits, zero0):
    """qa.save(format="gptq") and back: the same codes, zero points, scales and act-order columns. It
    writes v1 (stored zero - 1, what transformers reads by default) unless a zero point is 0, which v1
    cannot hold: then gptq_v2."""
    x = _hard(rng, 32, 256)
    x[:, 32:64] = -np.abs(x[:, 32:64])  # negatives: the top zero point
    if zero0:
        x[:, :32] = np.abs(x[:, :32])  # a group of positives gets zero point 0
    else:
        x[:, ::32] = -np.abs(x).max(axis=1, keepdims=True)  # every group reaches as far below 0 as above
    q = qa.quantize(x, dtype=f"uint{bits}_g32_f16_zp")
    z = from_qarray(q).zero
    assert np.any(z == 0) == zero0 and np.any(z == (1 << bits) - 1)
    columns = rng.permutation(256)
    q = qa.QArray._blocks(q.data, q.dtype, None, columns)
    qa.save(tmp_path, {"l.weight": q}, format="gptq")
    back = qa.load(tmp_path)["l.weight"]
    assert back.dtype == q.dtype and np.array_equal(hf.g_idx_of(back, 32), hf.g_idx_of(q, 32))
    assert np.array_equal(_bits(back.dequantize()), _bits(q.dequantize()))
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] and cfg["bits"] == bits and cfg["checkpoint_format"] == ("gptq_v2" if zero0 else "gptq")
    assert repr(back).startswith("QArray(")


def test_gptq_act_order_values(rng, tmp_path):
    """desc_act: W[k, n] = scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n]), against that formula in
    float16 (the integer difference exact, one rounding of the product)."""
    k, n, group, bits = 128, 16, 32, 4
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    codes[0], codes[1] = 0, 15
    zeros = rng.integers(0, 16, (k // group, n)).astype(np.uint8)
    zeros[0, 0], zeros[-1, -1] = 0, 15
    scales = (rng.random((k // group, n)) * 0.1).astype(np.float16)
    scales[0, 0] = np.float16(6e-8)
    g_idx = rng.permutation(np.arange(k) // group).astype(np.int32)
    write(tmp_path, {"l.qweight": pack_words(codes.T, bits).T.copy(), "l.qzeros": pack_words(zeros, bits),
                     "l.scales": scales, "l.g_idx": g_idx},
          {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": True, "sym": False,
           "checkpoint_format": "gptq_v2"})
    q = qa.load(tmp_path)["l.weight"]
    want = (scales[g_idx].astype(np.float32) * (codes.astype(np.float32) - zeros[g_idx])).astype(np.float16)
    assert np.array_equal(q.dequantize(), want.T.astype(np.float32))
    assert q.columns is not None
    with pytest.raises(IndexError, match=r"stored out of order \(GPTQ's act-order, q.columns\)"):
        q[:, :32]
    assert np.array_equal(q[3:5].dequantize(), q.dequantize()[3:5])


# -- convert ---------------------------------------------------------------------------------------

def test_convert_exact(rng):
    """GPTQ's symmetric 4-bit groups of 32 are Q4_0 and back, byte for byte; MLX's 4-bit groups of 32
    with float16 scales are Q4_1; what has no such form says so."""
    x = _hard(rng, 8, 64)
    q40 = qa.quantize(x, dtype="Q4_0")
    raw = np.asarray(q40.data).reshape(-1, 18)
    g = _blocks.convert(raw, _blocks.get("Q4_0"), _blocks.get("int4_g32_f16"))
    assert np.array_equal(_blocks.convert(g, _blocks.get("int4_g32_f16"), _blocks.get("Q4_0")), raw)
    z = _blocks.convert(g, _blocks.get("int4_g32_f16"), _blocks.get("uint4_g32_f16_zp"))
    assert np.all(_blocks.get("uint4_g32_f16_zp").unpack(z)["z"] == 8)
    assert np.array_equal(_blocks.convert(z, _blocks.get("uint4_g32_f16_zp"), _blocks.get("Q4_0")), raw)
    q41 = np.asarray(qa.quantize(x, dtype="Q4_1").data).reshape(-1, 20)
    m = _blocks.convert(q41, _blocks.get("Q4_1"), _blocks.get("uint4_g32_f16_bias"))
    assert np.array_equal(_blocks.convert(m, _blocks.get("uint4_g32_f16_bias"), _blocks.get("Q4_1")), q41)
    for src, dst, why in [("Q4_1", "Q4_0", "the offsets \\(biases\\) have nowhere to go"),
                          ("Q4_0", "int4_g32_bf16", "field 'd' is bfloat16; got float32 values that are not bfloat16"),
                          ("Q4_0", "int4_g64_f16", "blocks of 32 and 64 values"),
                          ("Q4_K", "Q4_0", "only one-level formats")]:
        data = np.asarray(qa.quantize(_hard(rng, 8, 256)[:, :64 if src != "Q4_K" else 256], dtype=src).data).reshape(-1, _blocks.get(src).nbytes)
        with pytest.raises(ValueError, match=f"{src} -> {dst}: {why}"):
            _blocks.convert(data, _blocks.get(src), _blocks.get(dst))
    asym = np.asarray(qa.quantize(x, dtype="uint4_g32_f16_zp").data).reshape(-1, 19)
    with pytest.raises(ValueError, match=r"uint4_g32_f16_zp -> Q4_0: a value of -?\d+ \(code - zero\) is not one"):
        _blocks.convert(asym, _blocks.get("uint4_g32_f16_zp"), _blocks.get("Q4_0"))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".zarr"])
def test_grouped_in_qarray_files(rng, tmp_path, suffix):
    """A grouped QArray, act-order columns and all, through qarray's own files: the same bytes, columns
    and values; columns that are not a permutation are refused."""
    q = qa.quantize(_hard(rng, 8, 128), dtype="uint3_g32_bf16_zp")
    q = qa.QArray._blocks(q.data, q.dtype, None, rng.permutation(128))
    nv = qa.quantize(_hard(rng, 8, 128), dtype="e2m1_g16_e4m3_gdiv")  # a tensor scale
    path = tmp_path / f"w{suffix}"
    if suffix == ".zarr":
        pytest.importorskip("zarr")
        pytest.importorskip("dask")
        qa.zarr.to_zarr(q, path)
        qa.zarr.to_zarr(nv, tmp_path / "nv.zarr")
        back, back_nv = qa.zarr.from_zarr(path).compute(), qa.zarr.from_zarr(tmp_path / "nv.zarr").compute()
    else:
        pytest.importorskip("safetensors")
        qa.save(path, {"w": q, "nv": nv})
        back, back_nv = qa.load(path)["w"], qa.load(path)["nv"]
    assert back.dtype == q.dtype and np.array_equal(back.data, q.data) and np.array_equal(back.columns, q.columns)
    assert np.array_equal(back.dequantize(), q.dequantize())
    assert back_nv.global_scale == nv.global_scale and np.array_equal(back_nv.dequantize(), nv.dequantize())


def test_columns_meta_checked():
    from qarray.io._schema import parse_meta

    meta = json.dumps({"format": "qarray", "version": 5, "dtype": "int4_g32_f16", "shape": [2, 64],
                       "columns": list(range(63)) + [0]})
    with pytest.raises(ValueError, match="columns must be a permutation of the 64 columns"):
        parse_meta("f.npz", "w", meta)
    meta = json.dumps({"format": "qarray", "version": 5, "dtype": "e2m1_g16_e4m3_gdiv", "shape": [2, 64]})
    with pytest.raises(ValueError, match="e2m1_g16_e4m3_gdiv needs its tensor scale: global_scale is missing"):
        parse_meta("f.npz", "w", meta)
    meta = json.dumps({"format": "qarray", "version": 5, "dtype": "int4_g32_f16", "shape": [2, 64],
                       "global_scale": 2.0})
    with pytest.raises(ValueError, match="int4_g32_f16 has no global_scale"):
        parse_meta("f.npz", "w", meta)


def test_checkpoint_errors(rng, tmp_path):
    """A missing shard, a weight whose shape disagrees with config.json, and bits that do not match the
    data each give a ValueError that says so."""
    q = qa.quantize(_hard(rng, 32, 128), dtype="int4_g32_f16")
    qa.save(tmp_path / "c", {"model.layers.0.mlp.up_proj.weight": q}, format="gptq")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps(dict(cfg, hidden_size=128, intermediate_size=48)))
    with pytest.raises(ValueError, match=r"c: model.layers.0.mlp.up_proj.weight is \[32, 128\], but config.json's "
                       r"intermediate_size and hidden_size make it \[48, 128\]"):
        qa.load(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(json.dumps(dict(cfg, quantization_config=dict(
        cfg["quantization_config"], bits=8))))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: qweight \[16, 32\] and scales \[4, 32\] do not "
                       r"hold 8-bit codes of one weight \(bits 8 in the config\)|scales has 4 groups"):
        qa.load(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    os.rename(tmp_path / "c" / "model.safetensors", tmp_path / "c" / "model-00001-of-00002.safetensors")
    (tmp_path / "c" / hf.INDEX).write_text(json.dumps({"weight_map": {
        "model.layers.0.mlp.up_proj.qweight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.scales": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="the shard model-00002-of-00002.safetensors named by "
                       "model.safetensors.index.json is missing"):
        qa.load(tmp_path / "c")
    (tmp_path / "c" / hf.INDEX).write_text(json.dumps({"weight_map": {
        name: "model-00001-of-00002.safetensors" for name in ("model.layers.0.mlp.up_proj.qweight",
                                                              "model.layers.0.mlp.up_proj.qzeros",
                                                              "model.layers.0.mlp.up_proj.scales",
                                                              "model.layers.0.mlp.up_proj.g_idx")}}))
    assert np.array_equal(qa.load(tmp_path / "c")["model.layers.0.mlp.up_proj.weight"].data, q.data)
    (tmp_path / "c" / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "hqq"})))
    with pytest.raises(ValueError, match="quant_method 'hqq'; qarray reads gptq, awq, compressed-tensors, "
                       "bitsandbytes, modelopt, mlx"):
        qa.load(tmp_path / "c")


def test_bnb_blocks_across_rows(tmp_path):
    state = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "float16", "shape": [4, 96]}).encode()
    write(tmp_path, {"l.weight": np.zeros((192, 1), np.uint8), "l.weight.absmax": np.ones(6, np.float32),
                     "l.weight.quant_map": np.array(qa._grouped.NF4, np.float32),
                     "l.weight.quant_state.bitsandbytes__nf4": np.frombuffer(state, np.uint8)},
          {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="l: blocks of 64 straddle rows of 96: qarray keeps a block within a row"):
        qa.load(tmp_path)


# -- FP4: MXFP4 and NVFP4 --------------------------------------------------------------------------

@pytest.mark.parametrize("mode,name", [("mxfp4", "e2m1_g32_e8m0"), ("nvfp4", "e2m1_g16_e4m3")])
def test_mlx_fp4(rng, tmp_path, mode, name):
    """MLX's mxfp4 and nvfp4 modes: read as mx.dequantize computes them, quantized with mx.quantize's
    codes and scale bytes, written back for mx.dequantize."""
    _mlx()
    x = _hard(rng, 8, 256)
    x[7, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, 6, 0, -0.0, 0, 0, 0, 0]  # the ties
    wq, s = mx.quantize(mx.array(x), mode=mode)
    ref = np.array(mx.dequantize(wq, s, mode=mode, dtype=mx.float32))
    group = 32 if mode == "mxfp4" else 16
    write(tmp_path / "in", {"l.weight": np.array(wq), "l.scales": np.array(s)},
          {"mode": mode, "group_size": group, "bits": 4}, "quantization")
    q = qa.load(tmp_path / "in")["l.weight"]
    assert q.dtype.name == name and np.array_equal(_bits(q.dequantize()), _bits(ref))
    mine = qa.quantize(x, dtype=name)
    assert np.array_equal(mine.data, q.data)
    qa.save(tmp_path / "out", {"l.weight": mine}, format="mlx")
    back = mx.load(str(tmp_path / "out" / "model.safetensors"))
    again = mx.dequantize(back["l.weight"], back["l.scales"], mode=mode, dtype=mx.float32)
    assert np.array_equal(_bits(np.array(again)), _bits(ref))


@pytest.mark.parametrize("preset,name", [("NVFP4", "e2m1_g16_e4m3_gdiv"), ("MXFP4", "e2m1_g32_e8m0")])
def test_ct_fp4(rng, tmp_path, preset, name):
    """compressed-tensors' nvfp4- and mxfp4-pack-quantized: read as its decompressor computes them
    (float32, returned as bfloat16); NVFP4's tensor scale, block scales and codes as its quantizer picks
    them (generate_gparam, calculate_qparams with the preset's E4M3 scales, compress)."""
    torch, BaseCompressor, QuantizationArgs, QuantizationScheme = _ct()
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    ml = pytest.importorskip("ml_dtypes")
    x = _hard(rng, 8, 256)
    x[7, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, 6, 0, -0.0, 0, 0, 0, 0]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    a, w = scheme.weights, torch.from_numpy(x)
    group = a.group_size
    blocks = w.reshape(8, -1, group)
    gs = generate_gparam(w.min(), w.max()) if preset == "NVFP4" else None
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), a, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale}
    if gs is not None:
        sd["weight_global_scale"] = gs.reshape(1)
    fmt = f"{preset.lower()}-pack-quantized"
    comp = BaseCompressor.get_value_from_registry(fmt)
    c = comp.compress(dict(sd), scheme)
    ref = comp.decompress({k: v.clone() for k, v in c.items()}, scheme)["weight"].float().numpy()
    qc = {"quant_method": "compressed-tensors", "format": fmt,
          "config_groups": {"g": {"targets": ["Linear"], "weights": a.model_dump(), "format": fmt}}}
    write(tmp_path, {f"l.{k}": _torch_numpy(v) for k, v in c.items()}, qc)
    q = qa.load(tmp_path)["l.weight"]
    assert q.dtype.name == name
    assert np.array_equal(_bits(q.dequantize().astype(ml.bfloat16).astype(np.float32)), _bits(ref))
    if preset == "NVFP4":  # (MXFP4's scale rule is MLX's here: compressed-tensors' differs)
        mine = qa.quantize(x, dtype=name)
        assert mine.global_scale == np.float32(gs.item()) and np.array_equal(mine.data, q.data)


MODELOPT = os.path.join(HF_DATA, "modelopt_nvfp4")


def test_modelopt_nvfp4_quantize():
    """ModelOpt's NVFP4QTensor.quantize, recorded (tests/data/hf/modelopt_nvfp4/quantized.npz): the
    tensor scale, block scales and codes of qa.quantize(x, dtype="e2m1_g16_e4m3_gmul")."""
    v = np.load(os.path.join(MODELOPT, "quantized.npz"))
    q = qa.quantize(v["x"], dtype="e2m1_g16_e4m3_gmul")
    g = from_qarray(q)
    assert q.global_scale == v["weight_scale_2"] and np.array_equal(g.scale, v["weight_scale"])
    assert np.array_equal(g.codes, v["codes"])


def test_bnb_llm_int8(rng, tmp_path):
    """LLM.int8 (Linear8bitLt's state dict): q * SCB * float32(1/127), two float32 roundings, as
    int8_vectorwise_dequant computes it; quantized as int8_vectorwise_quant does."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    F = pytest.importorskip("bitsandbytes.functional")
    x = _hard(rng, 16, 256)
    x[1] = 1e-30
    lin = bnb.nn.Linear8bitLt(256, 16, bias=False, has_fp16_weights=False)
    lin.weight = bnb.nn.Int8Params(torch.from_numpy(x.copy()), requires_grad=False, has_fp16_weights=False)
    sd = lin.to("cpu").state_dict()
    ref = F.int8_vectorwise_dequant(sd["weight"], sd["SCB"]).numpy()
    write(tmp_path, {f"l.{k}": v.numpy() for k, v in sd.items()}, {"quant_method": "bitsandbytes", "load_in_8bit": True})
    q = qa.load(tmp_path)["l.weight"]
    assert q.dtype.name == "int8_g256_f32_scb" and np.array_equal(_bits(q.dequantize()), _bits(ref))
    codes, scb, _ = F.int8_vectorwise_quant(torch.from_numpy(x))
    mine = from_qarray(qa.quantize(x, dtype="int8_g256_f32_scb"))
    assert np.array_equal(mine.codes.astype(int) - 128, codes.numpy()) and np.array_equal(mine.scale[:, 0], scb.numpy())


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith(("gptq_v2_b3", "gptq_v1_b4_asym_g32_descact",
                                                                    "awq_gemm_g32", "awq_gemv_g32", "ct_b5",
                                                                    "modelopt"))])
def test_lazy_checkpoint(case, monkeypatch):
    """qa.load(directory, chunks=rows): Dask-backed QArrays whose chunks are rows read when computed
    (nothing of the codes read before), the same bytes, columns and tensor scale as the eager load."""
    pytest.importorskip("dask")
    path = os.path.join(HF_DATA, case)
    eager = qa.load(path)
    reads = []
    real = hf.Tensors.read
    monkeypatch.setattr(hf.Tensors, "read", lambda self, name, key=Ellipsis: reads.append(name) or real(self, name, key))
    lazy = qa.load(path, chunks=8)
    code_reads = lambda: sum(n.endswith((".qweight", ".weight_packed", ".weight")) for n in reads)  # noqa: E731
    layers = [q for q in eager.values() if isinstance(q, qa.QArray)]
    assert code_reads() == len(layers)  # one probe a layer (its format and row bytes), no more
    for name, q in eager.items():
        z = lazy[name]
        if not isinstance(q, qa.QArray):
            assert np.array_equal(np.asarray(z), q)
            continue
        assert z.backend == "dask" and len(z.data.chunks[0]) == -(-q.shape[0] // 8) and max(z.data.chunks[0]) <= 8
        before = code_reads()
        got = z.compute()
        assert code_reads() - before == len(z.data.chunks[0])  # a read of the codes a chunk
        assert got.dtype == q.dtype and np.array_equal(got.data, q.data)
        assert (got.columns is None) == (q.columns is None) and (q.columns is None or np.array_equal(got.columns, q.columns))
        assert got.global_scale == q.global_scale
        assert np.array_equal(_bits(z.dequantize().compute()), _bits(q.dequantize()))


def test_lazy_chunks_checked():
    pytest.importorskip("dask")
    with pytest.raises(ValueError, match="load: chunks must be a positive number of rows or 'auto', got 0"):
        qa.load(os.path.join(HF_DATA, "modelopt_nvfp4"), chunks=0)


def test_checkpoint_written_in_place_or_not_at_all(rng, tmp_path):
    """qa.save(directory, format=...) stages beside it: a save that fails leaves the old directory as
    it was; one that succeeds replaces it whole."""
    q = qa.quantize(_hard(rng, 8, 64), dtype="int4_g32_f16")
    qa.save(tmp_path / "c", {"a.weight": q}, format="gptq")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="b.weight: GPTQ holds integer codes with float16 scales"):
        qa.save(tmp_path / "c", {"a.weight": q, "b.weight": qa.quantize(_hard(rng, 8, 64), dtype="uint4_g32_bf16_bias")},
                format="gptq")
    assert sorted(os.listdir(tmp_path)) == before and np.array_equal(qa.load(tmp_path / "c")["a.weight"].data, q.data)
    (tmp_path / "c" / "stale.txt").write_text("old")
    qa.save(tmp_path / "c", {"a.weight": q}, format="compressed-tensors")
    assert sorted(os.listdir(tmp_path / "c")) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("qarray_gptq")])
def test_gptq_written_by_qarray(case, tmp_path):
    """The checkpoints in tests/data/hf/qarray_gptq_* were written by qa.save(format="gptq"), and their
    expected.safetensors is GPTQModel's dequantization of them (test_library_vectors: qarray's values);
    qarray writes the same tensors again from what it loads."""
    st = pytest.importorskip("safetensors.numpy")
    path = os.path.join(HF_DATA, case)
    qa.save(tmp_path / "again", {k: v for k, v in qa.load(path).items()}, format="gptq")
    want, got = st.load_file(os.path.join(path, "model.safetensors")), st.load_file(str(tmp_path / "again" /
                                                                                          "model.safetensors"))
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    with open(os.path.join(path, "config.json")) as f:
        assert cfg == json.load(f)["quantization_config"]
