"""The lm example (qarray/examples/lm.py) and its model (qarray/examples/_llama.py): the gradients
against finite differences, training, the cache and the perplexity table."""

from pathlib import Path

import numpy as np
import pytest

import qarray as qa
from qarray import awq, smoothquant
from qarray.examples import _llama, lm

TINY = _llama.config(vocab=11, dim=8, layers=2, heads=2, hidden=12, ctx=6)


def test_gradients_match_finite_differences():
    """Every weight's gradient (the backward pass written out: RMSNorm, rotary positions, causal
    attention, SwiGLU, cross-entropy) against central differences, float64, at 5 entries a weight;
    weights scaled up and norms away from 1 so that no term is negligible."""
    p = _llama.init(TINY, seed=1, dtype=np.float64)
    rng = np.random.default_rng(2)
    for k in p:
        p[k] = p[k] + rng.standard_normal(p[k].shape) * 0.3 if k.endswith("norm") else p[k] * 20
    x, y = rng.integers(0, 11, (3, 6)), rng.integers(0, 11, (3, 6))
    _, g = _llama.loss_and_grads(p, TINY, x, y)
    for k in p:
        flat = p[k].reshape(-1)
        for j in rng.choice(flat.size, min(5, flat.size), replace=False):
            old = flat[j]
            flat[j] = old + 1e-6
            up, _ = _llama.loss_and_grads(p, TINY, x, y)
            flat[j] = old - 1e-6
            down, _ = _llama.loss_and_grads(p, TINY, x, y)
            flat[j] = old
            num, ana = (up - down) / 2e-6, g[k].reshape(-1)[j]
            assert abs(num - ana) <= 1e-6 * (abs(num) + abs(ana)) + 1e-10, (k, j, num, ana)


def test_attention_is_causal():
    """A later byte changes no earlier position's logits."""
    p = _llama.init(TINY, seed=3, dtype=np.float64)
    x = np.random.default_rng(4).integers(0, 11, (2, 6))
    y = x.copy()
    y[:, 4] = (y[:, 4] + 1) % 11
    a, b = _llama.forward(p, TINY, x), _llama.forward(p, TINY, y)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_rope_turns_adjacent_pairs():
    """Position t turns pair (x[2i], x[2i+1]) by t * 10000 ** (-2i / head_dim) (llama.cpp's NORM rope),
    and the gradient's rotation undoes it."""
    cos, sin = _llama.rope_tables(5, 4, np.float64)
    x = np.random.default_rng(5).standard_normal((5, 4))
    y = _llama._rope(x, cos, sin)
    t, i = 3, 1
    angle = t * 10000.0 ** (-2 * i / 4)
    np.testing.assert_allclose(y[t, 2:4], [x[t, 2] * np.cos(angle) - x[t, 3] * np.sin(angle),
                                           x[t, 2] * np.sin(angle) + x[t, 3] * np.cos(angle)], rtol=1e-12)
    np.testing.assert_allclose(_llama._rope(y, cos, sin, -1), x, rtol=1e-12, atol=1e-15)


def test_training_learns_the_text():
    """40 Adam steps on pydoc_data.topics take a tiny model well below the uniform 5.55 nats a byte."""
    cfg = _llama.config(dim=32, layers=1, heads=2, hidden=64, ctx=32)
    p = _llama.init(cfg, seed=0)
    losses = _llama.train(p, cfg, lm.text()[0], 40, batch=8, lr=1e-2)
    assert losses[0] > 5.0 and np.mean(losses[-5:]) < 3.5


def test_config_refuses_odd_heads():
    with pytest.raises(ValueError, match="dim 10 must split into 4 heads of an even size"):
        _llama.config(dim=10, heads=4)


def test_table_and_cache(tmp_path, monkeypatch):
    """The table on a small model (a row per bit width and method family): float32, then each row's
    exact bits a weight and perplexities by each method (round to nearest: 8 bits within 1% of
    float32, 2 bits worse than 8; the importance matrix where ggml's quantizers take one, HQQ on the
    float-bias groups, AWQ on its own zero-point groups, GPTQ on every format, '-' elsewhere); the second run reads the
    cached weights and gives the same numbers."""
    monkeypatch.setenv("QARRAY_CACHE", str(tmp_path))
    cfg = _llama.config(dim=256, layers=1, heads=4, hidden=256, ctx=32)
    formats = [("Q8_0", 8), ("uint4_g128_f16_zp", 4), ("uint4_g64_f16_bias", 4), ("Q2_K", 2)]
    logs = []
    first = lm.run(cfg=cfg, steps=30, windows=4, calib_windows=8, formats=formats, log=logs.append)
    assert first["trained_s"] > 0 and logs and len(list(tmp_path.glob("lm-*.npz"))) == 1
    assert first["methods"] == ["round to nearest", "GPTQ", "AWQ", "HQQ", "imatrix", "SmoothQuant"]
    ppl = {fmt: p["round to nearest"] for fmt, _, _, p in first["rows"]}
    assert abs(ppl["Q8_0"] / first["float32"] - 1) < 0.01
    assert ppl["Q2_K"] > ppl["Q8_0"]
    filled = {m: {fmt for fmt, _, _, p in first["rows"] if p[m] is not None} for m in first["methods"][1:]}
    w8a8 = {"W8A8 per-token", "W8A8 per-tensor"}
    assert filled == {"imatrix": {"Q2_K"}, "HQQ": {"uint4_g64_f16_bias"}, "AWQ": {"uint4_g128_f16_zp"},
                      "GPTQ": {fmt for fmt, _ in formats}, "SmoothQuant": w8a8}
    assert [(fmt, bits) for fmt, bits, _, _ in first["rows"][-2:]] == [("W8A8 per-token", 8), ("W8A8 per-tensor", 8)]
    for fmt, _, bpw, p in first["rows"][-2:]:  # 8 bits and a float32 scale a row of 256 inputs
        assert bpw == 8 + 32 / 256 and all(abs(p[m] / first["float32"] - 1) < 0.02 for m in ("round to nearest",
                                                                                         "SmoothQuant"))
    check_files(first["files"], tmp_path, cfg, formats)
    again = lm.run(cfg=cfg, steps=30, windows=4, calib_windows=8, formats=formats[:1], w8a8_rows=[],
                   log=logs.append)
    assert again["trained_s"] == 0 and again["float32"] == first["float32"] and again["rows"] == first["rows"][:1]


def check_files(files, cache, cfg, formats):
    """The files the run writes beside the cached weights: the float32 GGUF (the weights themselves),
    llama.cpp's imatrix file of the calibration inputs (its importance is ImportanceMatrix's, 256
    tokens) and the Q4_K GGUF quantized with that importance (ggml's weighted search: not round to
    nearest's bytes)."""
    from qarray.io import gguf, imatrix

    (weights,) = cache.glob("lm-*.npz")
    stem = weights.with_suffix("")
    assert files == [Path(f"{stem}.gguf"), Path(f"{stem}.imatrix.gguf"), Path(f"{stem}-Q4_K.gguf")]
    with np.load(weights) as f:
        p = {k: f[k] for k in f.files}
    calib = lm.calibration(p, cfg, windows=8)
    f32, _ = gguf.read(files[0])
    assert np.array_equal(f32["blk.0.ffn_down.weight"], p["0.w2"]) and np.array_equal(f32["output_norm.weight"],
                                                                                      p["norm"])
    imp = imatrix.load(files[1])
    want = qa.observers.ImportanceMatrix().update(calib["0.wq"]).result()
    assert np.array_equal(imp["blk.0.attn_q.weight"], want)
    q4, meta = gguf.read(files[2])
    assert meta["general.architecture"] == "llama"
    got = q4["blk.0.attn_q.weight"]
    assert np.array_equal(got.data, qa.quantize(p["0.wq"], dtype="Q4_K", importance=want).data)
    assert not np.array_equal(got.data, qa.quantize(p["0.wq"], dtype="Q4_K").data)


def test_w8a8_linear_is_smoothquants_int8_on_the_integers():
    """``w8a8_linear``: the codes of SmoothQuant's fake quantization (``round(x / s)``, ``s = max(max|row|,
    1e-5) / 127``, per token or per tensor; the weights' per output channel), their products summed
    exactly (int64 here), times the weights' scales (float32) and then the tokens' scales, bit for bit;
    and SmoothQuant's float simulation within float32 rounding."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 5, 64)) * np.exp(rng.uniform(-2, 2, 64))).astype(np.float32)
    x[0, 1] = 0  # an all-zero token: scale floored at 1e-5 / 127
    w = (rng.standard_normal((24, 64)) * 0.05).astype(np.float32)
    ws = np.maximum(np.abs(w).max(axis=1), np.float32(1e-5)) / np.float32(127)
    wc = np.rint(w / ws[:, None]).astype(np.int64)
    wq = lm.int8_weight(w)
    assert np.array_equal(wq.int_repr(), wc) and np.array_equal(wq.scale, ws)
    x2 = x.reshape(-1, 64)
    for per_token in (True, False):
        s = np.maximum(np.abs(x2).max(axis=1 if per_token else None, keepdims=per_token), np.float32(1e-5)) \
            / np.float32(127)
        codes = np.rint(x2 / s).astype(np.int64)
        got = lm.w8a8_linear(x, wq, per_token)
        assert got.shape == (3, 5, 24) and got.dtype == np.float32
        acc = (codes @ wc.T).astype(np.float32)
        want = acc * ws * s if per_token else acc * (np.float32(s) * ws)
        assert np.array_equal(got.reshape(-1, 24), want)
        fake = (codes * s).astype(np.float32) @ (wc * ws[:, None]).astype(np.float32).T
        np.testing.assert_allclose(got.reshape(-1, 24), fake, rtol=0, atol=1e-5 * np.abs(fake).max())


def test_smoothed_model_keeps_the_function():
    """``smoothed``: SmoothQuant's llama pairs (attn_norm -> wq, wk, wv; ffn_norm -> w1, w3) folded; the
    float model's logits unchanged within float32 rounding, the norms and those weights changed, the rest
    untouched; the per-channel maxima are the calibration inputs'."""
    cfg = _llama.config(dim=32, layers=2, heads=2, hidden=64, ctx=16)
    p = _llama.init(cfg, seed=12)
    for k in p:  # norms away from 1 and an outlier channel, as trained models have
        p[k] = p[k] * np.float32(3) if k.endswith("norm") else p[k]
    p["emb"][:, 3] *= 40
    calib = lm.calibration(p, cfg, windows=4)
    s = lm.smoothed(p, cfg, calib)
    changed = {k for k in p if not np.array_equal(p[k], s[k])}
    assert changed == {f"{i}.{n}" for i in range(2) for n in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "w1", "w3")}
    x = np.arange(32).reshape(2, 16) * 5 % 256
    a, b = _llama.forward(p, cfg, x), _llama.forward(s, cfg, x)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    r = smoothquant.smooth(p["0.attn_norm"], [p["0.wq"], p["0.wk"], p["0.wv"]], np.abs(calib["0.wq"]).max(axis=0))
    assert np.array_equal(s["0.attn_norm"], r.norm) and np.array_equal(s["0.wv"], r.weights[2])


def test_awq_folds_its_scales_into_the_layers_before():
    """AWQ as AutoAWQ runs a llama: one scale vector for q, k, v (folded into attn_norm), o (into v's
    rows), gate and up (ffn_norm), down (up's rows); the folded float model keeps the logits within
    float32 rounding, and AWQ's column is that model with its linear layers quantized (its norms are
    the folded ones: a model one can store, not a scale a layer divided back out)."""
    cfg = _llama.config(dim=128, layers=1, heads=2, hidden=128, ctx=16)
    p = _llama.init(cfg, seed=3)
    p["emb"][:, 5] *= 30  # an outlier channel, so the scales are not all 1
    calib = lm.calibration(p, cfg, windows=4)
    fmt = "uint4_g64_f16_zp"
    folded = lm.awq_folded(p, cfg, fmt, calib)
    assert {k for k in p if not np.array_equal(p[k], folded[k])} == {
        f"0.{n}" for n in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w1", "w3", "w2")}
    x = np.arange(32).reshape(2, 16) * 5 % 256
    a = _llama.forward(p, cfg, x)
    np.testing.assert_allclose(_llama.forward(folded, cfg, x), a, rtol=0, atol=1e-5 * np.abs(a).max())
    s = awq.search_scale(calib["0.wq"], [p["0.wq"], p["0.wk"], p["0.wv"]], fmt).scales
    assert np.array_equal(folded["0.attn_norm"], awq.fold_rmsnorm(p["0.attn_norm"], s))
    assert np.array_equal(folded["0.wq"], p["0.wq"] * s)
    weights, bpw = lm.quantized(p, fmt, lm.activation_aware, calib, cfg)
    assert bpw == 4 + 24 / 64 and np.array_equal(weights["0.ffn_norm"], folded["0.ffn_norm"])
    assert np.array_equal(weights["0.wq"], awq.quantize_weight(folded["0.wq"], fmt).dequantize())  # no clip for q
    x_folded = lm.calibration(folded, cfg, windows=4)["0.w2"]
    clip = awq.search_clip(x_folded, folded["0.w2"], fmt)
    assert np.array_equal(weights["0.w2"], awq.quantize_weight(folded["0.w2"], fmt, clip=clip).dequantize())
    assert lm.quantized(p, "Q4_K", lm.activation_aware, calib, cfg) == (None, None)


def test_bits_a_weight_of_every_row():
    """Each row's bits a weight: the format's bytes over its values (a block's bytes for GGUF; the
    groups' codes, float16 scale and uint8 zero, or two float16s, or a float32), and the methods that
    keep the format's size (AWQ's scales fold into the layer before: no bytes of their own)."""
    cfg = _llama.config(dim=256, layers=1, heads=4, hidden=256, ctx=32)
    p = _llama.init(cfg, seed=0)
    bpw = {fmt: lm.quantized(p, fmt)[1] for fmt, _ in lm.FORMATS}
    assert bpw == {"Q8_0": 34 * 8 / 32, "Q4_0": 18 * 8 / 32, "Q4_K": 144 * 8 / 256, "IQ4_XS": 136 * 8 / 256,
                   "uint4_g128_f16_zp": 4 + 24 / 128, "uint4_g64_f16_bias": 4 + 32 / 64, "nf4_g64_f32": 4 + 32 / 64,
                   "Q3_K": 110 * 8 / 256, "uint3_g128_f16_zp": 3 + 24 / 128, "uint3_g64_f16_bias": 3 + 32 / 64,
                   "Q2_K": 84 * 8 / 256, "uint2_g64_f16_zp": 2 + 24 / 64, "uint2_g64_f16_bias": 2 + 32 / 64}


def test_gguf_has_llama_cpp_names_types_and_shapes(tmp_path):
    """``write_gguf``: llama.cpp's keys with the types its loader demands (uint32 counts, float32 eps
    and rope base), the 256 byte tokens, the tensors under llama.cpp's names with its shapes (a
    ``(out, in)`` weight is ``ne = (in, out)``: qarray's reader gives ``(out, in)`` back), the linear
    layers in the asked type and the rest float32, and the same forward pass from the file's weights.
    (llama.cpp's own logits on such a file: benchmarks/check_lm_gguf.py, which needs its build.)"""
    from qarray.io import gguf

    cfg = _llama.config(dim=256, layers=2, heads=4, hidden=512, ctx=16)
    p = _llama.init(cfg, seed=7)
    lm.write_gguf(tmp_path / "m.gguf", p, cfg, "Q4_K")
    tensors, meta = gguf.read(tmp_path / "m.gguf")
    u32 = {"llama.context_length": 16, "llama.embedding_length": 256, "llama.block_count": 2,
           "llama.feed_forward_length": 512, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 4,
           "llama.rope.dimension_count": 64, "llama.vocab_size": 256}
    for k, v in u32.items():
        assert type(meta[k]) is np.uint32 and meta[k] == v, k
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "llama"
    assert type(meta["llama.attention.layer_norm_rms_epsilon"]) is np.float32
    assert meta["llama.rope.freq_base"] == np.float32(10000)
    assert list(meta["tokenizer.ggml.tokens"])[:2] == ["<0x00>", "<0x01>"] and len(meta["tokenizer.ggml.tokens"]) == 256
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v",
                                                          "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert tensors["blk.1.ffn_down.weight"].shape == (256, 512) and tensors["blk.1.ffn_gate.weight"].shape == (512, 256)
    assert gguf.type_name(tensors["blk.0.attn_q.weight"]) == "Q4_K" and gguf.type_name(tensors["token_embd.weight"]) == "F32"
    back = {}
    for name in p:
        layer, _, short = name.rpartition(".")
        t = tensors[lm.GGUF_NAMES[short].format(i=layer)]
        back[name] = np.asarray(t.dequantize() if hasattr(t, "dequantize") else t, np.float32)
    x = np.arange(16)[None] * 7 % 256
    np.testing.assert_array_equal(_llama.forward(back, cfg, x), _llama.forward(lm.quantized(p, "Q4_K")[0], cfg, x))
