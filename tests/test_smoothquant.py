"""qarray.smoothquant against SmoothQuant's own code (mit-han-lab/smoothquant 43ded6c,
smoothquant/smooth.py: ``smooth_ln_fcs``, ``smooth_ln_fcs_llama_like``), ported literally to torch
here, and against a NumPy transcription of its arithmetic with correctly rounded powers."""

import doctest
import io
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest

import qarray
from qarray import observers, smoothquant
from qarray.smoothquant import AbsMax, smooth, smooth_scales

torch = pytest.importorskip("torch")
nn = torch.nn


# -- SmoothQuant, ported literally ------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.weight = nn.Parameter(g)


@torch.no_grad()
def smooth_ln_fcs(ln, fcs, act_scales, alpha=0.5):
    """smooth.py's smooth_ln_fcs (LayerNorm: weight and bias) and smooth_ln_fcs_llama_like (RMSNorm:
    weight only), one body: they differ only in the bias line."""
    if not isinstance(fcs, list):
        fcs = [fcs]
    for fc in fcs:
        assert isinstance(fc, nn.Linear)
        assert ln.weight.numel() == fc.in_features == act_scales.numel()
    device, dtype = fcs[0].weight.device, fcs[0].weight.dtype
    act_scales = act_scales.to(device=device, dtype=dtype)
    weight_scales = torch.cat([fc.weight.abs().max(dim=0, keepdim=True)[0] for fc in fcs], dim=0)
    weight_scales = weight_scales.max(dim=0)[0].clamp(min=1e-5)
    scales = (act_scales.pow(alpha) / weight_scales.pow(1 - alpha)).clamp(min=1e-5).to(device).to(dtype)
    ln.weight.div_(scales)
    if isinstance(ln, nn.LayerNorm):
        ln.bias.div_(scales)
    for fc in fcs:
        fc.weight.mul_(scales.view(1, -1))
    return scales


def get_act_scales_stat(batches):
    """get_act_scales' stat_tensor: the running max of each channel's |x|, float32."""
    act = None
    for x in batches:
        t = torch.from_numpy(x)
        coming = torch.max(t.view(-1, t.shape[-1]).abs().detach(), dim=0)[0].float()
        act = coming if act is None else torch.max(act, coming)
    return act.numpy()


def _linears(ws, dtype):
    out = []
    for w in ws:
        fc = nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
        with torch.no_grad():
            fc.weight.copy_(torch.from_numpy(w))
        out.append(fc)
    return out


def _data(seed, k=96, outs=(64, 32), tokens=300, dtype=np.float32, floors=True):
    """Activations with outlier channels (and, ``floors``, a dead one), weights with a large column
    (and, ``floors``, a tiny one, below the 1e-5 floor), a norm's weight and bias."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)) * np.exp(rng.uniform(-3, 1, k))
    x[:, rng.choice(k, 4, replace=False)] *= 60
    ws = [rng.standard_normal((o, k)) * 0.05 for o in outs]
    ws[0][:, 2] *= 40
    if floors:
        x[:, 1] = 0  # a dead channel: its scale is the floor's
        for w in ws:
            w[:, 3] *= 1e-6
    g = rng.uniform(0.5, 1.5, k)
    b = rng.standard_normal(k) * 0.1
    return x.astype(dtype), [w.astype(dtype) for w in ws], g.astype(dtype), b.astype(dtype)


# -- the scales ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.75, 0.85, 1.0])
@pytest.mark.parametrize("layernorm", [False, True])
def test_float16_is_the_originals_bit_for_bit(alpha, layernorm):
    """A float16 model, as SmoothQuant runs: the scales, the norm's weight and bias and the linears'
    weights are what smooth_ln_fcs(_llama_like) leaves, bit for bit."""
    x, ws, g, b = _data(seed=1, dtype=np.float16, floors=False)  # (floors: 1 / 1e-5 overflows float16)
    act = AbsMax().update(x).result()
    assert np.array_equal(act, get_act_scales_stat([x]))
    fcs = _linears(ws, torch.float16)
    if layernorm:
        ln = nn.LayerNorm(g.shape[0]).to(torch.float16)
        with torch.no_grad():
            ln.weight.copy_(torch.from_numpy(g))
            ln.bias.copy_(torch.from_numpy(b))
    else:
        ln = RMSNorm(torch.from_numpy(g.copy()))
    want = smooth_ln_fcs(ln, fcs, torch.from_numpy(act), alpha).numpy()
    got = smooth(g, ws, act, alpha, bias=b if layernorm else None)
    assert got.scales.dtype == np.float16 and np.array_equal(got.scales, want)
    assert np.array_equal(smooth_scales(act, ws, alpha), want)
    assert np.array_equal(got.norm, ln.weight.detach().numpy())
    if layernorm:
        assert np.array_equal(got.bias, ln.bias.detach().numpy())
    else:
        assert got.bias is None
    for w, fc in zip(got.weights, fcs):
        assert w.dtype == np.float16 and np.array_equal(w, fc.weight.detach().numpy())


def _pow_nearest(x, e, dtype):
    """The ``dtype`` value nearest ``x ** e`` (exact powers from 60-digit Decimals, then the nearest by
    comparing exact distances; ties to even): what a correctly rounded pow gives."""
    out = []
    with localcontext() as ctx:
        ctx.prec = 60
        for v in np.asarray(x, np.float64):
            p = Fraction(Decimal(float(v)) ** Decimal(float(e))) if v > 0 else Fraction(0 if e > 0 else 1)
            lo = dtype(float(p))
            cands = [np.nextafter(lo, dtype(0)), lo, np.nextafter(lo, dtype(np.inf))]
            out.append(min(cands, key=lambda c: (abs(Fraction(float(c)) - p), int(np.array(c).view(
                np.uint32 if dtype == np.float32 else np.uint64)) & 1)))
    return np.array(out, dtype)


def _transcribed(act, ws, alpha, dtype):
    """smooth_ln_fcs' arithmetic in NumPy, its order kept: act to the weights' type; the column maxima
    over every weight, floored at 1e-5; act ** alpha / w_max ** (1 - alpha), each power correctly
    rounded (the exponent rounded to the type, as torch takes a Python scalar), the quotient IEEE's;
    floored at 1e-5."""
    a = act.astype(dtype)
    w_max = np.concatenate([np.abs(w).max(axis=0, keepdims=True) for w in ws]).max(axis=0)
    w_max = np.maximum(w_max, dtype(1e-5))
    num = _pow_nearest(a, dtype(alpha), dtype) if alpha not in (0.0, 1.0) else (a ** 0 if alpha == 0 else a)
    den = _pow_nearest(w_max, dtype(1 - alpha), dtype) if alpha not in (0.0, 1.0) else \
        (w_max if alpha == 0 else w_max ** 0)
    return np.maximum(num / den, dtype(1e-5))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_float32_and_64_against_the_arithmetic_and_torch(dtype, alpha):
    """float32 weights: bit for bit the transcription with correctly rounded powers (float64: NumPy's
    float64 power, each within an ulp of them, so the quotient within two; its sqrt, bit for bit); torch's own (its CPU pow, and on
    this machine its float32 sqrt, are not correctly rounded) within two ulps. The dead channel and the
    tiny column hit the floors."""
    x, ws, _, _ = _data(seed=2)
    ws = [w.astype(dtype) for w in ws]
    act = AbsMax().update(x).result()
    got = smooth_scales(act, ws, alpha)
    assert got.dtype == dtype
    want = _transcribed(act, ws, alpha, dtype)
    if dtype == np.float32 or alpha in (0.0, 0.5, 1.0):
        assert np.array_equal(got, want)
    else:
        np.testing.assert_array_max_ulp(got, want, maxulp=2)
    assert got[1] == dtype(1e-5) or alpha == 0
    want = smooth_ln_fcs(RMSNorm(torch.ones(act.shape[0], dtype=torch.from_numpy(ws[0]).dtype)),
                         _linears(ws, torch.from_numpy(ws[0]).dtype), torch.from_numpy(act), alpha).numpy()
    np.testing.assert_array_max_ulp(got, want, maxulp=2)  # (each of its two powers within an ulp)


def test_scales_by_hand():
    """s = act^alpha / max|W[:, j]|^(1 - alpha) over every weight, the floors at 1e-5."""
    act = np.array([16.0, 1.0, 0.0, 4.0], np.float32)
    w1 = np.array([[1.0, -4.0, 2.0, 0.0]], np.float32)
    w2 = np.array([[-9.0, 1.0, 0.5, 0.0]], np.float32)
    s = smooth_scales(act, [w1, w2], 0.5)
    f = np.float32
    np.testing.assert_array_equal(s, [f(4) / f(3), f(1) / f(2), f(1e-5), f(2) / np.sqrt(f(1e-5))])
    np.testing.assert_array_equal(smooth_scales(act, w1, 1.0), [16, 1, f(1e-5), 4])
    np.testing.assert_array_equal(smooth_scales(act, w1, 0.0), [1, 1 / f(4), 1 / f(2), 1 / f(1e-5)])


# -- the fold ---------------------------------------------------------------------------------------------------

def _rms(x, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))


def _layernorm(x, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + np.float32(eps))


@pytest.mark.parametrize("layernorm", [False, True])
def test_the_fold_keeps_the_function(layernorm):
    """norm -> linears: the smoothed layers give the float outputs within float32 rounding."""
    x, ws, g, b = _data(seed=3)
    r = smooth(g, ws, AbsMax().update(x), 0.5, bias=b if layernorm else None)
    n = _layernorm(x) if layernorm else _rms(x)
    before, after = n * g, n * r.norm
    if layernorm:
        before, after = before + b, after + r.bias
    assert not np.allclose(r.norm, g)
    for w, w2 in zip(ws, r.weights):
        want = before.astype(np.float64) @ w.T.astype(np.float64)
        got = after @ w2.T
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_the_fold_is_exact_with_powers_of_two():
    """Scales that are powers of two (act = 4^k, each column's largest |W| = 1, alpha 0.5: s = 2^k):
    g / s, b / s and W * s are exact, and so are the outputs, bit for bit."""
    rng = np.random.default_rng(4)
    k = 64
    e = rng.integers(-6, 7, k).astype(np.float32)
    act = np.float32(4.0) ** e
    w = rng.uniform(-0.9, 0.9, (48, k)).astype(np.float32)
    w[rng.integers(0, 48, k), np.arange(k)] = rng.choice([-1.0, 1.0], k)
    g, b = rng.uniform(0.5, 1.5, k).astype(np.float32), rng.standard_normal(k).astype(np.float32)
    r = smooth(g, w, act, 0.5, bias=b)
    assert np.array_equal(r.scales, np.float32(2.0) ** e) and np.ptp(e) == 12
    n = _layernorm(rng.standard_normal((20, k)).astype(np.float32))
    assert np.array_equal((n * r.norm + r.bias) @ r.weights.T, (n * g + b) @ w.T)


def test_fold_offset_and_types():
    """Gemma's (1 + g) norms: (g + 1) / s - 1; the norm keeps its float type, the weights theirs."""
    x, ws, g, _ = _data(seed=5)
    r = smooth(g.astype(np.float64), ws, AbsMax().update(x), 0.5, offset=1.0)
    s = r.scales.astype(np.float64)
    assert r.norm.dtype == np.float64 and r.weights[0].dtype == np.float32
    np.testing.assert_array_equal(r.norm, (g.astype(np.float64) + 1) / s - 1)
    np.testing.assert_array_equal(r.weights[1], ws[1] * r.scales)
    single = smooth(g, ws[0], AbsMax().update(x))
    assert isinstance(single.weights, np.ndarray) and single.weights.shape == ws[0].shape


# -- the statistic ----------------------------------------------------------------------------------------------

def test_absmax_merges_exactly_in_any_split_and_order():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((1000, 24)) * np.exp(rng.uniform(-30, 30, 24))).astype(np.float32)
    x[5, 3] = np.float32(-1e-45)
    x[6, 4] = np.float32(-3e38)
    x[:, 7] = 0
    x[:, 8] = -np.abs(x[:, 8])  # the largest |x| on the negative side
    whole = AbsMax().update(x)
    assert np.array_equal(whole.result(), np.abs(x).max(axis=0))
    assert np.array_equal(whole.result(), get_act_scales_stat([x]))
    for order in (rng.permutation(1000), np.arange(1000)[::-1]):
        parts = np.array_split(x[order], 7)
        for merge_order in (range(7), rng.permutation(7)):
            m = AbsMax()
            for i in merge_order:
                m.merge(AbsMax().update(parts[i].reshape(1, -1, 24)))
            assert np.array_equal(m.result(), whole.result())
        streamed = AbsMax()
        for p in parts:
            streamed.update(p)
        assert np.array_equal(streamed.result(), whole.result())
    assert np.array_equal(AbsMax().update(x[0]).result(), np.abs(x[0]))  # one token, 1-d


def test_absmax_state_round_trips():
    rng = np.random.default_rng(7)
    a = AbsMax().update(rng.standard_normal((50, 16)).astype(np.float32))
    buf = io.BytesIO()
    np.savez(buf, **a.state_dict())
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        back, generic = AbsMax.from_state(dict(f)), observers.Observer.from_state(dict(f))
    for b in (back, generic):
        assert type(b) is AbsMax and np.array_equal(b.result(), a.result())
    assert set(a.state_dict()) == {"kind", "lo", "hi"} and str(a.state_dict()["kind"]) == "absmax"
    assert AbsMax.from_state(AbsMax().state_dict()).lo is None
    assert repr(a) == "AbsMax(16 channels)" and repr(AbsMax()) == "AbsMax(no data)"
    with pytest.raises(ValueError, match=r"^AbsMax\.from_state: the state is a MinMax's$"):
        AbsMax.from_state(observers.MinMax().update(np.ones(3)).state_dict())
    with pytest.raises(ValueError, match=r"^Observer\.from_state: fields 'lo' and 'hi' must be finite"):
        AbsMax.from_state({**a.state_dict(), "hi": a.state_dict()["lo"] - 1})


def test_absmax_dask():
    da = pytest.importorskip("dask.array")
    x = np.random.default_rng(8).standard_normal((999, 40)).astype(np.float32) * 3
    got = AbsMax().update(da.from_array(x, chunks=(100, 16))).result()
    assert np.array_equal(got, AbsMax().update(x).result())


def test_absmax_inputs():
    a = AbsMax().update(np.array([[1, -2]], np.int32)).update(np.array([[-3.0, 0.5]], np.float16))
    np.testing.assert_array_equal(a.result(), [3, 2])
    assert a.result().dtype == np.float32
    with pytest.raises(ValueError, match=r"^AbsMax\.update: the batch has 3 channels along axis -1, "
                                         r"earlier batches had 2$"):
        a.update(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"^AbsMax\.update: the batch holds NaN or inf; observe finite values only$"):
        AbsMax().update(np.array([[np.nan, 1.0]], np.float32))
    with pytest.raises(ValueError, match=r"^AbsMax: no activations observed yet; call update\(x\) first$"):
        AbsMax().result()
    with pytest.raises(ValueError, match=r"^AbsMax\.merge: the other observer is a MinMax$"):
        a.merge(observers.MinMax())
    with pytest.raises(ValueError, match=r"^AbsMax\.merge: 2 channels here, 3 in the other$"):
        a.merge(AbsMax().update(np.ones((1, 3), np.float32)))
    with pytest.raises(TypeError, match=r"^AbsMax\.update: takes a real \(float or integer\) array, got dtype <U1$"):
        AbsMax().update(np.array(["a"]))


# -- what it is for: int8 activations with outlier channels ------------------------------------------------------

def _w8a8(x, w, per_token):
    """int8 x int8 through qarray: weights per output channel (scale max|row| / 127), activations per
    tensor or per token (each row's codes as a per-tensor QArray of scale 1, times its scale after the
    exact int32 products)."""
    wq = qarray.quantize(w, np.abs(w).max(axis=1) / np.float32(127), 0, "qint8", axis=0)
    amax = np.abs(x).max(axis=1 if per_token else None)
    sx = np.maximum(amax, np.float32(1e-5)) / np.float32(127)
    if not per_token:
        return np.asarray(qarray.linear(qarray.quantize(x, sx, 0, "qint8"), wq).dequantize())
    codes = qarray.quantize(x, sx, 0, "qint8", axis=0).int_repr()
    acc = qarray.linear(qarray.QArray.from_int(codes, 1.0, 0, "qint8"), wq)
    return np.asarray(acc.dequantize()) * sx[:, None]


@pytest.mark.parametrize("per_token", [False, True])
def test_smoothing_lowers_the_int8_error_on_outlier_channels(per_token):
    """Outlier channels (x60) force a coarse int8 step on every channel of a token (or of the tensor);
    smoothing (alpha 0.5) moves half of their range into the weights: the W8A8 output error drops
    below half of round to nearest's."""
    x, ws, g, _ = _data(seed=9, tokens=400)
    n = _rms(x) * g
    cal, test = n[:200], n[200:]
    r = smooth(g, ws, AbsMax().update(cal), 0.5)
    n2 = _rms(x[200:]) * r.norm
    for w, w2 in zip(ws, r.weights):
        ref = test.astype(np.float64) @ w.T.astype(np.float64)
        plain = np.linalg.norm(_w8a8(test, w, per_token) - ref)
        smoothed = np.linalg.norm(_w8a8(n2, w2, per_token) - ref)
        assert smoothed < 0.5 * plain, (plain, smoothed)


# -- arguments ---------------------------------------------------------------------------------------------------

_X, _WS, _G, _B = _data(seed=10, k=8, outs=(4, 3), tokens=20)
_ACT = np.abs(_X).max(axis=0)


@pytest.mark.parametrize("call,exc,message", [
    (lambda: smooth_scales(_ACT, _WS, 1.5), ValueError, "smoothquant: alpha must be a number in [0, 1], got 1.5"),
    (lambda: smooth_scales(_ACT, _WS, -0.1), ValueError, "smoothquant: alpha must be a number in [0, 1], got -0.1"),
    (lambda: smooth_scales(_ACT, _WS, float("nan")), ValueError,
     "smoothquant: alpha must be a number in [0, 1], got nan"),
    (lambda: smooth_scales(_ACT, _WS, "0.5"), TypeError, "smoothquant: alpha must be a number in [0, 1], got '0.5'"),
    (lambda: smooth_scales(_ACT, _WS, True), TypeError, "smoothquant: alpha must be a number in [0, 1], got True"),
    (lambda: smooth_scales(_ACT[:5], _WS), ValueError,
     "smoothquant: weights[0] has 8 input features (shape (4, 8)), act_absmax has 5"),
    (lambda: smooth_scales(_ACT, _WS[0][:, :6]), ValueError,
     "smoothquant: the weight has 6 input features (shape (4, 6)), act_absmax has 8"),
    (lambda: smooth_scales(_ACT, _WS[0][None]), ValueError, "smoothquant: weights must be 2-d, got shape (1, 4, 8)"),
    (lambda: smooth_scales(_ACT, "w"), TypeError,
     "smoothquant: weights must be a 2-d weight (out_features, in_features) or a list of them that take the same "
     "input"),
    (lambda: smooth_scales(_ACT, [_WS[0], _WS[1].astype(np.float16)]), TypeError,
     "smoothquant: the weights have different float types (float16, float32); cast them to one"),
    (lambda: smooth_scales(-_ACT, _WS), ValueError,
     "smoothquant: act_absmax holds negative values; it is each channel's max |x|"),
    (lambda: smooth_scales(_ACT[None], _WS), ValueError, "smoothquant: act_absmax must be 1-d, got shape (1, 8)"),
    (lambda: smooth_scales(np.where(np.arange(8) == 2, np.nan, _ACT), _WS), ValueError,
     "smoothquant: act_absmax holds 1 NaN or infinite value(s) as float32 (the first at (2,))"),
    (lambda: smooth_scales(_ACT, [_WS[0], np.where(_WS[1] > 0.01, np.inf, _WS[1])]), ValueError,
     "smoothquant: weights[1] holds 10 NaN or infinite value(s) (the first at (0, 2))"),
    (lambda: smooth_scales(_ACT.astype(np.float64) * 1e300, _WS), ValueError,
     "smoothquant: act_absmax holds 7 NaN or infinite value(s) as float32 (the first at (0,))"),
    (lambda: smooth_scales(np.full(8, 7e4, np.float32), [w.astype(np.float16) for w in _WS], 1.0), ValueError,
     "smoothquant: 8 scale(s) overflow float16 (the first at channel 0: act_absmax np.float32(70000.0)); compute "
     "them from float32 weights"),
    (lambda: smooth_scales(np.array(["a"] * 8), _WS), TypeError,
     "smoothquant: act_absmax must be a float array, got dtype <U1"),
    (lambda: smooth(_G[:5], _WS, _ACT), ValueError,
     "smoothquant: g has shape (5,), the scales (8,): one scale a channel"),
    (lambda: smooth(_G, _WS, _ACT, bias=_B[:3]), ValueError, "smoothquant: bias has shape (3,), the scales (8,)"),
    (lambda: smooth(np.where(np.arange(8) == 1, np.inf, _G), _WS, _ACT), ValueError,
     "smoothquant: g holds 1 NaN or infinite value(s) (the first at (1,))"),
    (lambda: smooth(_G.astype(np.float16), _WS, _ACT), ValueError,  # the dead channel 1: s = 1e-5
     "smoothquant: g / s overflows float16 at 1 value(s) (the first: 1); fold in a wider float type"),
    (lambda: smooth(_G, _WS, _ACT, bias=np.ones(8, np.float16)), ValueError,
     "smoothquant: bias / s overflows float16 at 1 value(s) (the first: 1); fold in a wider float type"),
])
def test_bad_arguments(call, exc, message):
    with pytest.raises(exc) as e:
        call()
    assert str(e.value) == message


def test_a_collector_or_an_array():
    a = AbsMax().update(_X)
    assert np.array_equal(smooth_scales(a, _WS), smooth_scales(_ACT, _WS))
    assert np.array_equal(smooth_scales(_ACT.astype(np.float64), _WS, 0.25), smooth_scales(a, _WS, 0.25))


def test_docstring_examples():
    assert doctest.testmod(smoothquant, extraglobs={"numpy": np}).failed == 0
