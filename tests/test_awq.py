"""qarray.awq against AutoAWQ's algorithm, ported literally to torch here (AutoAWQ 0.2.9,
casper-hansen/AutoAWQ 88e4c76: awq/quantize/quantizer.py ``pseudo_quantize_tensor``,
``_search_best_scale``, ``_compute_best_scale``, ``_compute_loss``, ``_compute_best_clip``;
awq/quantize/scale.py ``apply_clip``, ``scale_ln_fcs``, ``scale_fc_fc``), float32 on the CPU
(AutoAWQ itself needs CUDA)."""

import doctest
from fractions import Fraction

import numpy as np
import pytest

import qarray
from qarray import awq

torch = pytest.importorskip("torch")
nn = torch.nn


# -- AutoAWQ, ported literally ---------------------------------------------------------------------------

class AwqPort:
    def __init__(self, w_bit=4, group_size=128, zero_point=True, duo_scaling=True, max_chunk_memory=1024 * 1024 * 1024):
        self.w_bit, self.group_size, self.zero_point = w_bit, group_size, zero_point
        self.duo_scaling, self.max_chunk_memory = duo_scaling, max_chunk_memory

    def pseudo_quantize_tensor(self, w):
        org_w_shape = w.shape
        if self.group_size > 0:
            assert org_w_shape[-1] % self.group_size == 0
            w = w.reshape(-1, self.group_size)
        assert w.dim() == 2
        assert torch.isnan(w).sum() == 0
        if self.zero_point:
            max_val = w.amax(dim=1, keepdim=True)
            min_val = w.amin(dim=1, keepdim=True)
            max_int = 2 ** self.w_bit - 1
            min_int = 0
            scales = (max_val - min_val).clamp(min=1e-5) / max_int
            zeros = (-torch.round(min_val / scales)).clamp_(min_int, max_int)
            w = (torch.clamp(torch.round(w / scales) + zeros, min_int, max_int) - zeros) * scales
            zeros = zeros.view(org_w_shape[0], -1)
        else:
            max_val = w.abs().amax(dim=1, keepdim=True)
            max_val = max_val.clamp(min=1e-5)
            max_int = 2 ** (self.w_bit - 1) - 1
            min_int = -(2 ** (self.w_bit - 1))
            scales = max_val / max_int
            zeros = None
            w = torch.clamp(torch.round(w / scales), min_int, max_int) * scales
        assert torch.isnan(scales).sum() == 0
        assert torch.isnan(w).sum() == 0
        scales = scales.view(org_w_shape[0], -1)
        w = w.reshape(org_w_shape)
        return w, scales, zeros

    @torch.no_grad()
    def search_best_scale(self, layers, inp, module2inspect=None):
        if module2inspect is None:
            assert len(layers) == 1
            module2inspect = layers[0]
        weight = torch.cat([_m.weight for _m in layers], dim=0)
        org_shape = weight.shape
        weight = weight.view(-1, self.group_size)
        w_scale = weight.abs() / (weight.abs().amax(dim=1, keepdim=True) + 1e-6)
        w_scale = w_scale.view(org_shape)
        w_mean = w_scale.mean(0)
        inp_flat = inp.cpu().abs().view(-1, inp.shape[-1])
        num_elements = inp_flat.size(0)
        num_channels = inp_flat.size(1)
        element_size_bytes = inp_flat.element_size() * 2
        chunk_size = int(self.max_chunk_memory // (element_size_bytes * num_channels))
        chunk_size = min(chunk_size, num_elements)
        x_sum = torch.zeros(num_channels, dtype=torch.float32, device=inp.device)
        for i in range(0, num_elements, chunk_size):
            end = min(i + chunk_size, num_elements)
            chunk_sum = inp_flat[i:end].to(torch.float32).sum(dim=0)
            x_sum += chunk_sum.to(inp.device)
        x_mean = (x_sum / num_elements).to(inp.dtype)
        fp16_output = module2inspect(inp)
        fp16_output = fp16_output.clip(torch.finfo(fp16_output.dtype).min, torch.finfo(fp16_output.dtype).max)
        return self.compute_best_scale(inp, w_mean, x_mean, module2inspect, layers, fp16_output), x_mean

    def compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output):
        n_grid = 20
        history = []
        best_ratio = -1
        best_scales = None
        best_error = float("inf")
        # (AutoAWQ runs this on a GPU, where .cpu() copies; on the CPU it would alias the weights that
        # mul_ changes below, and every grid point after the first would start from W * s_0)
        org_sd = {k: v.cpu().clone() for k, v in module2inspect.state_dict().items()}
        device = x.device
        x_mean = x_mean.view(-1).to(device)
        w_mean = w_mean.view(-1).to(device)
        for ratio in range(n_grid):
            ratio = ratio / n_grid
            if self.duo_scaling:
                scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
            else:
                scales = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
            scales = scales / (scales.max() * scales.min()).sqrt()
            scales_view = scales.view(1, -1).to(device)
            scales[torch.isinf(scales)] = 1
            scales[torch.isnan(scales)] = 1
            for fc in linears2scale:
                fc.weight.mul_(scales_view)
                fc.weight.data = self.pseudo_quantize_tensor(fc.weight.data)[0] / scales_view
            int_w_output = module2inspect(x)
            int_w_output = int_w_output.clip(torch.finfo(int_w_output.dtype).min, torch.finfo(int_w_output.dtype).max)
            loss = self.compute_loss(fp16_output, int_w_output, device)
            history.append(loss)
            if loss < best_error:
                best_error = loss
                best_ratio = ratio
                best_scales = scales.clone()
            module2inspect.load_state_dict(org_sd)
        assert best_ratio != -1
        assert torch.isnan(best_scales).sum() == 0, best_scales
        return best_scales.detach().cpu(), best_ratio, history

    @torch.no_grad()
    def compute_loss(self, fp16_output, int_w_output, device):
        loss = 0.0
        fp16_output_flat = fp16_output.view(-1)
        int_w_output_flat = int_w_output.view(-1)
        num_elements = fp16_output_flat.size(0)
        element_size_bytes = fp16_output.element_size()
        chunk_size = self.max_chunk_memory // (element_size_bytes * 2)
        chunk_size = min(chunk_size, num_elements)
        fp16_chunks = torch.split(fp16_output_flat, chunk_size)
        int_w_chunks = torch.split(int_w_output_flat, chunk_size)
        for fp16_chunk, int_w_chunk in zip(fp16_chunks, int_w_chunks):
            chunk_loss = (fp16_chunk.to(device) - int_w_chunk.to(device)).float().pow(2).sum().item()
            loss += chunk_loss
        loss /= num_elements
        return loss

    @torch.no_grad()
    def compute_best_clip(self, w, input_feat, n_grid=20, max_shrink=0.5, n_sample_token=512):
        assert w.dim() == 2
        org_w_shape = w.shape
        group_size = self.group_size if self.group_size > 0 else org_w_shape[1]
        input_feat = input_feat.view(-1, input_feat.shape[-1])
        input_feat = input_feat.reshape(1, input_feat.shape[0], -1, group_size)
        step_size = max(1, input_feat.shape[1] // n_sample_token)
        input_feat = input_feat[:, ::step_size]
        w = w.reshape(org_w_shape[0], 1, -1, group_size)
        oc_batch_size = 256 if org_w_shape[0] % 256 == 0 else 64
        assert org_w_shape[0] % oc_batch_size == 0
        w_all = w
        best_max_val_all = []
        for i_b in range(org_w_shape[0] // oc_batch_size):
            w = w_all[i_b * oc_batch_size: (i_b + 1) * oc_batch_size]
            org_max_val = w.abs().amax(dim=-1, keepdim=True)
            best_max_val = org_max_val.clone()
            min_errs = torch.ones_like(org_max_val) * 1e9
            input_feat = input_feat.to(w.device)
            org_out = (input_feat * w).sum(dim=-1)
            for i_s in range(int(max_shrink * n_grid)):
                max_val = org_max_val * (1 - i_s / n_grid)
                min_val = -max_val
                cur_w = torch.clamp(w, min_val, max_val)
                q_w = self.pseudo_quantize_tensor(cur_w)[0]
                cur_out = (input_feat * q_w).sum(dim=-1)
                err = (cur_out - org_out).pow(2).mean(dim=1).view(min_errs.shape)
                cur_best_idx = err < min_errs
                min_errs[cur_best_idx] = err[cur_best_idx]
                best_max_val[cur_best_idx] = max_val[cur_best_idx]
            best_max_val_all.append(best_max_val)
        best_max_val = torch.cat(best_max_val_all, dim=0)
        return best_max_val.squeeze(1)


@torch.no_grad()
def apply_clip(layer, max_val):
    org_shape = layer.weight.shape
    layer.weight.data = layer.weight.data.reshape(*max_val.shape[:2], -1)
    layer.weight.data = torch.clamp(layer.weight.data, -max_val, max_val)
    layer.weight.data = layer.weight.data.reshape(org_shape)


class Concat(nn.Module):
    """The layers' outputs side by side: module2inspect for layers scored together."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return torch.cat([m(x) for m in self.layers], dim=-1)


class MLP(nn.Module):
    """llama's MLP, AutoAWQ's module2inspect for gate_proj and up_proj."""

    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _linear(w):
    m = nn.Linear(w.shape[1], w.shape[0], bias=False)
    m.weight.data = torch.from_numpy(w.copy())
    return m


def _data(seed=0, tokens=512, k=256, outs=(192,), outliers=4):
    """Activations with a few outlier channels (as LLMs' have) and weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    big = rng.choice(k, outliers, replace=False)
    x[:, big] *= np.float32(25)
    x *= rng.uniform(0.5, 2, k).astype(np.float32)
    ws = [(rng.standard_normal((o, k)) * 0.05).astype(np.float32) for o in outs]
    return x, ws


_FORMATS = {(4, 128, True): "uint4_g128_f32_zp", (3, 64, True): "uint3_g64_f32_zp", (4, 128, False): "int4_g128_f32",
            (4, 64, True): "uint4_g64_f32_zp"}


# -- the scale search against the port ---------------------------------------------------------------------

@pytest.mark.parametrize("duo", [False, True])
@pytest.mark.parametrize("bits,group,zp", [(4, 128, True), (3, 64, True), (4, 128, False)])
def test_search_scale_matches_autoawq(bits, group, zp, duo):
    x, ws = _data(seed=bits + 2 * duo, outs=(192, 64))
    port = AwqPort(bits, group, zp, duo)
    layers = [_linear(w) for w in ws]
    (scales_t, ratio_t, hist), x_mean_t = port.search_best_scale(layers, torch.from_numpy(x), Concat(layers))
    dtype = _FORMATS[bits, group, zp]
    # the search itself, on AutoAWQ's x_mean
    r = awq.search_scale(x, ws, dtype, duo_scaling=duo, x_mean=x_mean_t.numpy())
    assert r.alpha == ratio_t
    np.testing.assert_allclose(r.scales, scales_t.numpy(), rtol=1e-6, atol=0)
    np.testing.assert_allclose(r.losses, hist, rtol=2e-4)
    # with its own exact x_mean (within a float32 step of AutoAWQ's)
    np.testing.assert_allclose(awq.MeanAbs().update(x).result(), x_mean_t.numpy(), rtol=4e-7, atol=0)
    r2 = awq.search_scale(x, ws, dtype, duo_scaling=duo)
    assert r2.alpha == ratio_t
    np.testing.assert_allclose(r2.scales, scales_t.numpy(), rtol=2e-6, atol=0)


def test_search_scale_single_layer_and_module():
    """One layer (module2inspect = the layer), and gate/up scored on the whole MLP's output."""
    x, (w,) = _data(seed=5)
    port = AwqPort(4, 128, True, True)
    (scales_t, ratio_t, _), _ = port.search_best_scale([_linear(w)], torch.from_numpy(x))
    r = awq.search_scale(x, w, "uint4_g128_f32_zp", duo_scaling=True)
    assert r.alpha == ratio_t
    np.testing.assert_allclose(r.scales, scales_t.numpy(), rtol=2e-6)

    x, (gate, up) = _data(seed=6, outs=(384, 384))
    down = (np.random.default_rng(1).standard_normal((256, 384)) * 0.05).astype(np.float32)
    layers = [_linear(gate), _linear(up)]
    (scales_t, ratio_t, hist), _ = port.search_best_scale(layers, torch.from_numpy(x), MLP(*layers, _linear(down)))

    def mlp(x, ws):
        a, c = x @ ws[0].T, x @ ws[1].T
        return (a / (1 + np.exp(-a)) * c) @ down.T

    r = awq.search_scale(x, [gate, up], "uint4_g128_f32_zp", duo_scaling=True, forward=mlp)
    assert r.alpha == ratio_t
    np.testing.assert_allclose(r.scales, scales_t.numpy(), rtol=2e-6)
    np.testing.assert_allclose(r.losses, hist, rtol=2e-3)


@pytest.mark.parametrize("bits,group,zp", [(4, 128, True), (4, 64, True), (4, 128, False)])
def test_search_clip_matches_autoawq(bits, group, zp):
    x, (w,) = _data(seed=9, tokens=1100, outs=(128,))
    s = awq.search_scale(x, w, _FORMATS[bits, group, zp]).scales
    xs, wsc = x / s, w * s
    port = AwqPort(bits, group, zp)
    ref = port.compute_best_clip(torch.from_numpy(wsc), torch.from_numpy(xs)).numpy()[..., 0]
    got = awq.search_clip(xs, wsc, _FORMATS[bits, group, zp])
    assert got.shape == ref.shape == (128, 256 // group)
    assert (got == ref).mean() > 0.99  # (a near tie between two shrinks may go either way)
    assert (got < np.abs(wsc.reshape(128, -1, group)).max(-1)).any()  # some groups clipped


def test_quantize_matches_autoawq_pipeline():
    """scale search, apply_scale (weights times s, inputs over s), clip search, apply_clip, quantize."""
    x, (w,) = _data(seed=12, outs=(128,))
    port = AwqPort(4, 128, True, False)
    layer = _linear(w)
    (scales_t, _, _), _ = port.search_best_scale([layer], torch.from_numpy(x))
    layer.weight.data *= scales_t.view(1, -1)
    xs = torch.from_numpy(x) / scales_t.view(1, -1)
    apply_clip(layer, port.compute_best_clip(layer.weight.data, xs))
    ref, _, _ = port.pseudo_quantize_tensor(layer.weight.data)
    q, s = awq.quantize(x, w, "uint4_g128_f32_zp", clip=True)
    np.testing.assert_allclose(s, scales_t.numpy(), rtol=2e-6)
    got = q.dequantize()
    assert (np.abs(got - ref.numpy()) <= 1e-6 * np.abs(ref.numpy()).max()).mean() > 0.995


def test_quantize_weight_is_autoawqs_pseudo_quantize():
    x, (w,) = _data(seed=13, outs=(64,))
    port = AwqPort(4, 128, True)
    for clip in (None, np.abs(w).reshape(64, 2, 128).max(-1) * np.float32(0.7)):
        ref = w.copy()
        if clip is not None:
            layer = _linear(w)
            apply_clip(layer, torch.from_numpy(clip)[:, :, None])
            ref = layer.weight.data.numpy()
        want = port.pseudo_quantize_tensor(torch.from_numpy(ref))[0].numpy()
        got = awq.quantize_weight(w, "uint4_g128_f32_zp", clip=clip).dequantize()
        assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="one bound a group"):
        awq.quantize_weight(w, "uint4_g128_f32_zp", clip=np.ones((64, 3)))
    with pytest.raises(ValueError, match="negative"):
        awq.quantize_weight(w, "uint4_g128_f32_zp", clip=-np.ones((64, 2)))


# -- the property: below round to nearest on outlier channels --------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint4_g128_f16_zp", "uint3_g128_f16_zp", "int4_g128_f16", "Q4_0",
                                   "uint4_g64_f16_bias"])
def test_awq_beats_round_to_nearest(dtype):
    """On held-out activations with outlier channels, AWQ's output error is below round to nearest's
    (the format's ``qarray.quantize``) and below scale 1 (AutoAWQ's quantizer alone)."""
    x, (w,) = _data(seed=4, tokens=1536, outs=(256,))
    x, held = x[:512], x[512:]
    q, s = awq.quantize(x, w, dtype)
    ref = held @ w.T
    err_awq = np.linalg.norm(ref - (held / s) @ q.dequantize().T)
    err_rtn = np.linalg.norm(ref - held @ qarray.quantize(w, dtype=dtype).dequantize().T)
    q1, _ = awq.quantize(x, w, dtype, n_grid=1)  # alpha 0 alone: s = 1
    err_one = np.linalg.norm(ref - held @ q1.dequantize().T)
    assert err_awq < 0.9 * err_rtn and err_awq < 0.9 * err_one, (err_awq, err_rtn, err_one)


# -- the statistic ------------------------------------------------------------------------------------------

def test_mean_abs_merges_exactly():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1000, 24)) * np.exp(rng.uniform(-30, 30, 24))).astype(np.float32)
    x[5, 3] = np.float32(1e-45)  # a subnormal
    x[6, 4] = np.float32(3e38)
    x[:, 7] = 0
    whole = awq.MeanAbs().update(x)
    want = [_nearest32(sum(Fraction(float(abs(v))) for v in x[:, j]) / 1000) for j in range(24)]
    assert np.array_equal(whole.result(), np.array(want, np.float32))
    for order in (rng.permutation(1000), np.arange(1000)[::-1]):
        parts = np.array_split(x[order], 7)
        m = awq.MeanAbs()
        for p in parts[::-1]:
            m.merge(awq.MeanAbs().update(p.reshape(1, -1, 24)))
        assert m.count == 1000 and np.array_equal(m.sums, whole.sums)
        assert np.array_equal(m.result(), whole.result())
    back = awq.MeanAbs.from_state(dict(np.load(_roundtrip(whole.state_dict()))))
    assert np.array_equal(back.result(), whole.result()) and back.count == 1000


def _nearest32(f):
    """The float32 nearest the Fraction ``f >= 0``, ties to even (by comparing exact midpoints)."""
    lo = np.float32(float(f))  # within a float32 step
    cands = [np.nextafter(lo, np.float32(0)), lo, np.nextafter(lo, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - f), int(np.array(c).view(np.uint32)) & 1))


def _roundtrip(state):
    import io
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    return buf


def test_mean_abs_dask():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((999, 40)).astype(np.float32) * 3
    m = awq.MeanAbs().update(da.from_array(x, chunks=(100, 16)))
    assert np.array_equal(m.sums, awq.MeanAbs().update(x).sums) and m.count == 999


def test_mean_abs_inputs():
    m = awq.MeanAbs().update(np.array([[1, 2]], np.int32))
    np.testing.assert_array_equal(m.result(), [1, 2])
    m.update(np.array([[1.0, 2.0]], np.float16))
    with pytest.raises(ValueError, match="columns"):
        m.update(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="NaN or inf"):
        awq.MeanAbs().update(np.array([[np.nan, 1.0]], np.float32))
    with pytest.raises(ValueError, match="no activations"):
        awq.MeanAbs().result()
    with pytest.raises(ValueError, match="MeanAbs.merge: the other is a MinMax"):
        m.merge(qarray.observers.MinMax())
    with pytest.raises(ValueError, match="columns"):
        m.merge(awq.MeanAbs().update(np.ones((1, 3), np.float32)))
    with pytest.raises(ValueError, match="not what state_dict writes"):
        awq.MeanAbs.from_state({"kind": np.array("awq_mean_abs"), "sums": -np.ones((2, 12), np.int64),
                                "count": np.array(3)})
    with pytest.raises(ValueError, match="kind"):
        awq.MeanAbs.from_state({"kind": np.array("minmax")})
    with pytest.raises(TypeError, match="real"):
        awq.MeanAbs().update(np.array(["a"]))
    with pytest.raises(ValueError, match="shape"):
        awq.MeanAbs().update(np.zeros((0, 4), np.float32))


# -- folding ---------------------------------------------------------------------------------------------------

def _block(rng, d=64, h=128, heads=4):
    p = {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in
         (("wq", (d, d)), ("wk", (d, d)), ("wv", (d, d)), ("wo", (d, d)), ("w1", (h, d)), ("w3", (h, d)),
          ("w2", (d, h)))}
    p["attn_norm"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
    p["ffn_norm"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
    return p


def _forward(p, x, heads=4):
    """A llama block (RMSNorm, attention, SwiGLU; no rope: folding does not touch it) in float64."""
    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5) * g
    t, d = x.shape
    hd = d // heads
    n1 = rms(x, p["attn_norm"])
    q, k, v = ((n1 @ p[w].T).reshape(t, heads, hd).transpose(1, 0, 2) for w in ("wq", "wk", "wv"))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    h = x + (a @ v).transpose(1, 0, 2).reshape(t, d) @ p["wo"].T
    n2 = rms(h, p["ffn_norm"])
    g, c = n2 @ p["w1"].T, n2 @ p["w3"].T
    return h + (g / (1 + np.exp(-g)) * c) @ p["w2"].T


def test_folded_block_gives_the_same_outputs():
    """AutoAWQ's llama pairing: attn_norm -> q, k, v; v -> o; ffn_norm -> gate, up; up -> down."""
    rng = np.random.default_rng(7)
    p = _block(rng)
    x = rng.standard_normal((16, 64))
    s_qkv, s_o, s_gu = (rng.uniform(0.05, 20, 64).astype(np.float32) for _ in range(3))
    s_down = rng.uniform(0.05, 20, 128).astype(np.float32)
    f = dict(p)
    f["attn_norm"] = awq.fold_rmsnorm(p["attn_norm"], s_qkv)
    f["wq"], f["wk"], f["wv"] = (p[w] * s_qkv for w in ("wq", "wk", "wv"))
    f["wv"] = awq.fold_linear(f["wv"], s_o)
    f["wo"] = p["wo"] * s_o
    f["ffn_norm"] = awq.fold_rmsnorm(p["ffn_norm"], s_gu)
    f["w1"] = p["w1"] * s_gu
    f["w3"] = awq.fold_linear(p["w3"] * s_gu, s_down)
    f["w2"] = p["w2"] * s_down
    want = _forward({k: v.astype(np.float64) for k, v in p.items()}, x)
    got = _forward({k: v.astype(np.float64) for k, v in f.items()}, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert not np.allclose(f["wv"], p["wv"] * s_qkv)


def test_fold_matches_autoawq_scale_ln_fcs_and_fc_fc():
    rng = np.random.default_rng(8)
    g, s = rng.uniform(0.5, 2, 32).astype(np.float32), rng.uniform(0.1, 10, 32).astype(np.float32)
    ln = torch.from_numpy(g.copy())
    ln.div_(torch.from_numpy(s))
    assert np.array_equal(awq.fold_rmsnorm(g, s), ln.numpy())
    gemma = torch.from_numpy(g.copy())
    gemma += 1
    gemma.div_(torch.from_numpy(s))
    gemma -= 1
    assert np.array_equal(awq.fold_rmsnorm(g, s, offset=1.0), gemma.numpy())
    b = rng.standard_normal(32).astype(np.float32)
    g2, b2 = awq.fold_rmsnorm(g, s, b)
    assert np.array_equal(b2, b / s)
    fc1 = nn.Linear(16, 96)
    w1, bias1 = fc1.weight.detach().numpy().copy(), fc1.bias.detach().numpy().copy()
    with torch.no_grad():
        fc1.weight[-32:].div_(torch.from_numpy(s).view(-1, 1))
    w2, b3 = awq.fold_linear(w1, s, bias1)
    assert np.array_equal(w2, fc1.weight.detach().numpy())
    assert np.array_equal(b3[:64], bias1[:64]) and np.array_equal(b3[64:], bias1[64:] / s)


def test_fold_keeps_the_float_type():
    """float64 norms, scales and weights fold in float64 (the scales are not rounded to float32 first),
    float16 in float16."""
    rng = np.random.default_rng(11)
    g, s, w = rng.uniform(0.5, 2, 8), rng.uniform(0.1, 10, 8), rng.standard_normal((12, 8))
    assert np.array_equal(awq.fold_rmsnorm(g, s), g / s) and awq.fold_rmsnorm(g, s).dtype == np.float64
    assert np.array_equal(awq.fold_linear(w, s)[-8:], w[-8:] / s[:, None])
    g16 = awq.fold_rmsnorm(g.astype(np.float16), s.astype(np.float16))
    assert g16.dtype == np.float16 and np.array_equal(g16, g.astype(np.float16) / s.astype(np.float16))


def test_awq_on_a_folded_layer_end_to_end():
    """quantize -> fold into the norm: the quantized block's output is close to the float one."""
    rng = np.random.default_rng(9)
    g = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    x, (w,) = _data(seed=10, outs=(128,))
    n = x * g
    q, s = awq.quantize(n, w, "uint4_g128_f16_zp")
    g2 = awq.fold_rmsnorm(g, s)
    out = (x * g2) @ q.dequantize().T
    ref = n @ w.T
    assert np.linalg.norm(out - ref) < 0.2 * np.linalg.norm(ref)


# -- arguments ------------------------------------------------------------------------------------------

def test_formats_and_results():
    x, ws = _data(seed=1, outs=(64, 32))
    qs, s = awq.quantize(x, ws, "uint4_g64_f16_zp", clip=[True, False])
    assert [q.dtype.name for q in qs] == ["uint4_g64_f16_zp"] * 2 and [q.shape for q in qs] == [(64, 256), (32, 256)]
    assert s.dtype == np.float32 and s.shape == (256,)
    r = awq.search_scale(x, ws, "uint4_g64_f16_zp")
    assert np.array_equal(r.scales, s) and r.losses.shape == (20,) and r.losses.min() == r.losses[round(r.alpha * 20)]
    # the f16 search scores what the QArray holds: Q(W s) is the QArray's dequantize
    f = qs[1].dequantize()
    q2 = awq._Quantizer("uint4_g64_f16_zp", 256).fake(ws[1] * s)
    assert np.array_equal(f, q2)
    # a block format of qarray.quantize's
    q, _ = awq.quantize(x, ws[0], "Q4_K")
    assert q.dtype.name == "Q4_K"
    # awq's own quantizer: the range not widened to hold 0 (GPTQ's round to nearest would)
    w = np.abs(ws[0]) + np.float32(0.5)
    a = awq._Quantizer("uint4_g64_f32_zp", 256).fake(w)
    port = AwqPort(4, 64, True).pseudo_quantize_tensor(torch.from_numpy(w))[0].numpy()
    assert np.array_equal(a, port)


@pytest.mark.parametrize("call,exc,match", [
    (lambda x, w: awq.search_scale(x, w, "uint4_g96_f16_zp"), ValueError, "do not divide"),
    (lambda x, w: awq.search_scale(x, w, "qint8"), ValueError, "not a block format"),
    (lambda x, w: awq.search_scale(x, w, "e2m1_g16_e4m3_gdiv"), ValueError, "tensor-wide"),
    (lambda x, w: awq.search_scale(x, w, "IQ2_XXS"), ValueError, "read only"),
    (lambda x, w: awq.search_scale(x, w[:, :128]), ValueError, "input features"),
    (lambda x, w: awq.search_scale(x, "w"), TypeError, "weights must be"),
    (lambda x, w: awq.search_scale(x, []), TypeError, "weights must be"),
    (lambda x, w: awq.search_scale(x, w[None]), ValueError, "2-d"),
    (lambda x, w: awq.search_scale(x, w, n_grid=0), ValueError, "n_grid"),
    (lambda x, w: awq.search_scale(x, w, n_grid=2.5), TypeError, "n_grid"),
    (lambda x, w: awq.search_scale(x, w, x_mean=np.ones(3)), ValueError, "x_mean"),
    (lambda x, w: awq.search_scale(x, w, x_mean=-np.ones(256)), ValueError, "negative"),
    (lambda x, w: awq.search_scale(x, w, forward=3), TypeError, "forward"),
    (lambda x, w: awq.search_scale(np.where(x > 3, np.nan, x), w), ValueError, "NaN"),
    (lambda x, w: awq.search_scale(x, np.where(w > 0.1, np.inf, w)), ValueError, "NaN or infinite"),
    (lambda x, w: awq.search_scale(x.astype(np.int8) > 0, w), TypeError, "float"),
    (lambda x, w: awq.quantize(x, w, clip="yes"), TypeError, "clip"),
    (lambda x, w: awq.quantize(x, [w, w], clip=[True]), TypeError, "clip"),
    (lambda x, w: awq.search_clip(x, w, max_shrink=1.5), ValueError, "max_shrink"),
    (lambda x, w: awq.fold_rmsnorm(np.ones(3), np.ones(4)), ValueError, "one scale a channel"),
    (lambda x, w: awq.fold_rmsnorm(np.ones(4), -np.ones(4)), ValueError, "> 0"),
    (lambda x, w: awq.fold_linear(np.ones((2, 4)), np.ones(4)), ValueError, "at least 4"),
    (lambda x, w: awq.fold_linear(np.ones((4, 4)), np.ones(4), np.ones(3)), ValueError, "bias"),
    (lambda x, w: awq.fold_rmsnorm(np.array([np.nan]), np.ones(1)), ValueError, "NaN"),
    (lambda x, w: awq.fold_rmsnorm(np.ones(4, np.float16), np.full(4, 1e-5)), ValueError,
     r"^awq: g / s overflows float16 at 4 value\(s\) \(the first: 0\); fold in a wider float type$"),
    (lambda x, w: awq.fold_linear(np.ones((3, 2), np.float16), np.array([1.0, 1e-5])), ValueError,
     r"^awq: w_prev / s overflows float16 at 2 value\(s\) \(the first: \(2, 0\)\); fold in a wider float type$"),
])
def test_bad_arguments(call, exc, match):
    x, (w,) = _data(seed=0, tokens=64, outs=(32,))
    with pytest.raises(exc, match=match):
        call(x, w)


def test_overflowing_scales_in_float16():
    """A grid point whose scaled weights overflow float16 scales is skipped; all of them: ValueError."""
    x, (w,) = _data(seed=0, tokens=64, outs=(32,))
    r = awq.search_scale(x, w * np.float32(3e4), "uint4_g128_f16_zp")
    assert np.isinf(r.losses).any() or np.isfinite(r.losses).all()
    with pytest.raises(ValueError, match="no grid point"):
        awq.search_scale(x, w * np.float32(1e7), "uint4_g128_f16_zp")


def test_docstring_examples():
    assert doctest.testmod(awq, extraglobs={"numpy": np}).failed == 0


def test_dask_inputs():
    da = pytest.importorskip("dask.array")
    x, (w,) = _data(seed=2, tokens=256, outs=(32,))
    q, s = awq.quantize(x, w, "uint4_g128_f16_zp")
    q2, s2 = awq.quantize(da.from_array(x, chunks=(64, 128)), da.from_array(w, chunks=(16, 256)), "uint4_g128_f16_zp")
    assert np.array_equal(s, s2) and np.array_equal(q.data, q2.data)
