"""MX (OCP Microscaling v1.0) and NVFP4: quantize_mx and quantize_nvfp4 bit for bit
against torchao's reference code (vectors in tests/data/mx_vectors.npz, made by
tests/data/make_mx_vectors.py from torchao 0.18.0) and against an independent
``fractions.Fraction`` reading of the rules; the blocks where torchao departs from
the OCP spec are tested on their own."""

import math
from fractions import Fraction

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import qarray  # noqa: E402
from qarray import _formats as F  # noqa: E402

from _reference import NVFP4_INF_CASES, mx_vectors  # noqa: E402

V = mx_vectors()
X = V["x"]
TORCHAO_FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4"]
MODES = list(F.SCALE_ROUNDINGS)


# -- an independent reading of the rules, in Fractions ----------------------------------
def _flog2(v: Fraction) -> int:
    """floor(log2(v)) for v > 0."""
    k = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** k > v:
        k -= 1
    while Fraction(2) ** (k + 1) <= v:
        k += 1
    return k


def ref_exponent(block, mx, mode):
    """The shared exponent of a block (None for NaN), from the OCP spec and torchao's
    ScaleCalculationMode definitions, computed on exact values."""
    if not np.isfinite(block).all():
        return None
    amax = max(Fraction(abs(float(v))) for v in block)
    top = Fraction(F.finfo(mx.element).max)
    if amax == 0:
        return -127
    if mode == "rceil":
        d = amax / top
        k = _flog2(d)
        e = k if d == Fraction(2) ** k else k + 1
    else:
        k = _flog2(amax)
        if mode == "ceil":
            k += amax != Fraction(2) ** k
        elif mode == "even":  # the mantissa rounded half up to mbits bits
            m = amax / Fraction(2) ** k
            k += math.floor(m * 2**mx.mbits + Fraction(1, 2)) == 2 ** (mx.mbits + 1)
        e = k - mx.emax
    return max(-127, min(127, e))


def _grid(element):
    """Every finite non-negative value of an element format and its code, sorted."""
    if element == "mxint8":
        return [(Fraction(c, 64), c) for c in range(128)]
    codes = np.arange(256 if F.fmt(element).bits == 8 else 1 << F.fmt(element).bits, dtype=np.uint8)
    vals = codes.view(F.dtype(element)).astype(np.float64)
    keep = np.isfinite(vals) & (vals >= 0) & ~np.signbit(vals)
    return sorted((Fraction(float(v)), int(c)) for v, c in zip(vals[keep], codes[keep]))


_GRIDS = {}


def ref_element(v: Fraction, element):
    """v rounded to the nearest element value, ties to the even code, saturating."""
    grid = _GRIDS.setdefault(element, _grid(element))
    a = abs(v)
    if a >= grid[-1][0]:
        return grid[-1][0] * (1 if v >= 0 else -1)
    lo = max(i for i, (g, _) in enumerate(grid) if g <= a)
    (g0, c0), (g1, c1) = grid[lo], grid[lo + 1]
    pick = g0 if a - g0 < g1 - a or (a - g0 == g1 - a and c0 % 2 == 0) else g1
    return pick if v >= 0 else -pick


def check_against_fractions(x, q, mx, mode, block=32):
    """Every scale and element of ``q`` (blocks along the last axis) as the rules say."""
    scale = q.scale.view(np.uint8)
    vals = F.values(q.data, mx.element, np.float64)
    for r in range(x.shape[0]):
        for b in range(scale.shape[1]):
            blk = x[r, b * block:(b + 1) * block]
            e = ref_exponent(blk, mx, mode)
            if e is None:
                assert scale[r, b] == F.E8M0_NAN
                assert not q.int_repr()[r, b * block:(b + 1) * block].any()
                continue
            assert scale[r, b] == e + 127, (r, b)
            for i, v in enumerate(blk):
                want = ref_element(Fraction(float(v)) / Fraction(2) ** e, mx.element)
                got = vals[r, b * block + i]
                assert Fraction(float(got)) == want, (r, b, i, float(v), float(got), want)
                if want == 0 and mx.element != "mxint8":  # the sign of zero is kept (torchao, ml_dtypes)
                    assert np.signbit(got) == np.signbit(v), (r, b, i)


# -- torchao's vectors -------------------------------------------------------------------
def _block_has_inf(x, block=32):
    return np.isinf(x).reshape(x.shape[0], -1, block).any(-1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", TORCHAO_FORMATS)
def test_mx_equals_torchao(fmt, mode):
    """Scales and elements bit for bit as torchao's ``to_mx`` gives them, except in
    the blocks where torchao departs from the spec (each checked below): a block
    with inf (torchao: a finite scale; the spec: NaN), a block whose scale is
    2**-127 (torchao divides by 2**-126, or for RCEIL multiplies by 1), and for
    RCEIL an amax/max just above a power of two (torchao's float32 log2 rounds it
    down). NaN blocks: same NaN scale; their elements are unspecified (qarray: 0)."""
    q = qarray.quantize_mx(X, fmt, scale_rounding=mode)
    s, ts = q.scale.view(np.uint8), V[f"{fmt}.{mode}.scale"]
    inf = _block_has_inf(X)
    amax = np.abs(X).reshape(X.shape[0], -1, 32).max(-1)
    quirk = np.zeros_like(inf)
    if mode == "rceil":  # a float32 log2 of amax / max (NVIDIA's quotient) that rounds to an integer below
        ok = np.isfinite(amax) & (amax > 0)
        d = np.where(ok, amax, 1) / np.float32(F.finfo(F.MX_FORMATS[fmt].element).max)
        m, k = np.frexp(d)
        quirk = (np.ceil(np.log2(d)) != k - (m == 0.5)) & ok
        assert quirk.any() or fmt in ("mxfp4", "mxfp6_e2m3")  # the vectors hold the quirk's blocks
    assert np.array_equal(s[~inf & ~quirk], ts[~inf & ~quirk])
    assert (s[inf] == F.E8M0_NAN).all() and (ts[inf] != F.E8M0_NAN).all()  # the spec's NaN; torchao's finite
    assert (s[quirk] == ts[quirk] + 1).all()
    e, te = q.int_repr().reshape(X.shape[0], -1, 32), V[f"{fmt}.{mode}.elements"].reshape(X.shape[0], -1, 32)
    same = (s == ts) & (s != 0) & (s != F.E8M0_NAN)
    assert same.sum() > 100
    np.testing.assert_array_equal(e[same], te[same])


@pytest.mark.parametrize("fmt", TORCHAO_FORMATS)
def test_torchao_departures_follow_the_spec(fmt):
    """The blocks torchao gets otherwise (inf, 2**-127 scales, RCEIL's rounded log2)
    are what the rules say, by the Fraction reading; each departure is present."""
    mx = F.MX_FORMATS[fmt]
    for mode in MODES:
        s, ts = qarray.quantize_mx(X, fmt, scale_rounding=mode).scale.view(np.uint8), V[f"{fmt}.{mode}.scale"]
        assert ((s == 0) & (ts == 0)).any()  # all-zero and tiny blocks: the smallest scale
        rows = np.flatnonzero(((s != ts) | (s == 0)).any(axis=1))
        assert len(rows)
        check_against_fractions(X[rows], qarray.quantize_mx(X[rows], fmt, scale_rounding=mode), mx, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", list(F.MX_FORMATS))
def test_mx_equals_fraction_reference(fmt, mode, rng):
    """Every scale and element of random blocks at many magnitudes, ties, zeros and
    subnormals, by the Fraction reading of the rules (mxint8 too, which torchao lacks)."""
    mx = F.MX_FORMATS[fmt]
    rows = rng.choice(X.shape[0], 8, replace=False)
    x = np.concatenate([X[rows, :64], (rng.standard_normal((2, 64)) * 2.0 ** rng.integers(-130, 120, (2, 1)))])
    x = x.astype(np.float32)
    check_against_fractions(x, qarray.quantize_mx(x, fmt, scale_rounding=mode), mx, mode)


def test_mx_float64_and_float16_input(rng):
    """float64 input is scaled and rounded once in float64 (no float32 step);
    float16 is widened exactly."""
    mx = F.MX_FORMATS["mxfp8_e4m3"]
    x = rng.standard_normal((3, 64)) * 10
    x[0, 1] = 1 + 2.0**-4 + 2.0**-40  # just above a tie of e4m3 at 2**0: float32 would make it the tie
    for mode in MODES:
        check_against_fractions(x, qarray.quantize_mx(x, "mxfp8_e4m3", scale_rounding=mode), mx, mode)
    h = x.astype(np.float16)
    q = qarray.quantize_mx(h, "mxfp4")
    np.testing.assert_array_equal(q.int_repr(), qarray.quantize_mx(h.astype(np.float32), "mxfp4").int_repr())


def test_nvfp4_equals_torchao():
    """NVFP4 (two-level scaling, per_tensor_amax_to_scale) bit for bit with torchao's
    ``nvfp4_quantize`` on every finite row of the vectors."""
    x = X[V["nvfp4.rows"]]
    q = qarray.quantize_nvfp4(x)
    assert q.global_scale.dtype == np.float32 and q.global_scale == V["nvfp4.global_scale"]
    assert q.scale.dtype == F.dtype("float8_e4m3fn") and q.dtype == "float4_e2m1fn" and q.block_size == 16
    np.testing.assert_array_equal(q.scale.view(np.uint8), V["nvfp4.scale"])
    np.testing.assert_array_equal(q.int_repr(), V["nvfp4.elements"])


def test_nvfp4_dequantize_rounds_once(rng):
    """float32(element * block_scale) * global_scale: the product is exact, so one
    rounding of the exact value; torchao rounds global * block first (twice), which
    differs for some scales."""
    x = (rng.standard_normal((64, 64)) * 2.0 ** rng.integers(-8, 8, (64, 4)).repeat(16, axis=1)).astype(np.float32)
    differs = False
    for gs in rng.uniform(1e-3, 1, 12).astype(np.float32):
        q = qarray.quantize_nvfp4(x, global_scale=gs)
        e = F.values(q.data, "float4_e2m1fn", np.float64)
        s = np.repeat(q.scale.astype(np.float64), 16, axis=1)
        exact = [Fraction(float(a)) * Fraction(float(b)) * Fraction(float(gs)) for a, b in zip(e.flat, s.flat)]
        exact64 = np.array([float(v) for v in exact])  # exact: 2 + 4 + 24 significant bits
        assert all(Fraction(v) == w for v, w in zip(exact64, exact))
        np.testing.assert_array_equal(q.dequantize().reshape(-1), exact64.astype(np.float32))
        np.testing.assert_array_equal(q.dequantize("float64").reshape(-1), exact64)
        twice = e.astype(np.float32) * (gs * s.astype(np.float32))
        differs |= bool((twice.reshape(-1) != exact64.astype(np.float32)).any())
    assert differs


def test_nvfp4_rules():
    x = np.zeros((2, 32), np.float32)
    q = qarray.quantize_nvfp4(x)
    assert q.global_scale == 1 and (q.scale.astype(np.float32) == 2.0**-6).all() and not q.dequantize().any()
    x = np.arange(64, dtype=np.float32).reshape(2, 32)
    x[0, 3], x[1, 20] = np.nan, -np.inf
    q = qarray.quantize_nvfp4(x)
    sc = q.scale.astype(np.float32)
    assert np.isnan(sc[0, 0]) and np.isfinite(sc[0, 1]) and np.isfinite(sc[1, 0])
    assert sc[1, 1] == 448  # inf (no NaN): torchao's clamp, not NaN
    assert not q.int_repr()[0, :16].any() and q.int_repr()[1, 20] == 0xF  # -inf: -6
    assert q.global_scale == np.float32(np.float32(63) / np.float32(2688))  # the finite values' amax
    d = q.dequantize()
    assert np.isnan(d[0, :16]).all() and np.isfinite(d[0, 16:]).all() and np.isfinite(d[1]).all()
    assert d[1, 20] == -63  # -6 * 448 * 63 / 2688: the largest finite magnitude
    y = np.ones((3, 20), np.float32)  # a short last block, along axis 0 as well
    q = qarray.quantize_nvfp4(y, axis=0)
    assert q.scale.shape == (1, 20) and q.axis == 0
    np.testing.assert_array_equal(qarray.quantize_nvfp4(y).scale.shape, (3, 2))


# -- NVFP4 blocks holding inf -------------------------------------------------------
def ref_nvfp4(x, gs):
    """``(scale codes, element codes)`` of float32 ``x``, one block of 16 a row, by
    torchao's ``nvfp4_quantize`` (torchao/prototype/mx_formats/nvfp4_tensor.py, two
    level scaling): the block scale ``e4m3(clamp(amax / 6 / gs, E4M3_EPS = 2**-6,
    F8E4M3_MAX = 448))``, so an inf amax clamps to 448; the elements ``x * ((1 / gs)
    / scale)`` in float32 (torchao's reciprocal), ``clamp(-6, 6)`` (inf: +-6), then
    ``f32_to_f4_unpacked``: nearest, ties to even, the sign bit kept. A NaN block:
    torchao's NaN scale 0x7f, qarray's elements 0 (torchao's are unspecified)."""
    e4m3 = dict((v, c) for v, c in _grid("float8_e4m3fn"))
    e2m1 = dict((v, c) for v, c in _grid("float4_e2m1fn"))
    scales, codes = [], []
    for blk in np.asarray(x, np.float32):
        amax = np.abs(blk).max()
        if np.isnan(amax):
            scales.append(0x7F)
            codes.append([0] * len(blk))
            continue
        with np.errstate(over="ignore"):
            s = np.float32(amax) / np.float32(6) / np.float32(gs)
        s = ref_element(Fraction(min(max(float(s), 2.0**-6), 448.0)), "float8_e4m3fn")  # inf -> 448
        scales.append(e4m3[s])
        r = np.float32(np.float32(1) / np.float32(gs)) / np.float32(float(s))
        with np.errstate(over="ignore"):
            v = np.clip(blk * r, np.float32(-6), np.float32(6))
        codes.append([e2m1[abs(ref_element(Fraction(float(a)), "float4_e2m1fn"))] | (8 * bool(np.signbit(a)))
                      for a in v])
    return np.array(scales, np.uint8), np.array(codes, np.uint8)


@pytest.mark.parametrize("case", list(NVFP4_INF_CASES))
def test_nvfp4_inf_blocks(case):
    """A block holding inf (no NaN) saturates as torchao's nvfp4_quantize does: scale
    448 (0x7e), not the NaN 0x7f; inf -> +-6 (0x7, 0xf), the finite elements scaled
    by 448 * gs as any block's. Expected codes written out, checked against the
    reference reading of torchao's rule too; NaN and all-zero blocks as before."""
    rows, gs, g, want_scale, want = NVFP4_INF_CASES[case]
    x, g = np.array(rows, np.float32), np.float32(g)
    q = qarray.quantize_nvfp4(x, global_scale=gs)
    assert q.global_scale == g
    rs, rc = ref_nvfp4(x, g)
    np.testing.assert_array_equal(rs, want_scale)
    np.testing.assert_array_equal(rc, want)
    np.testing.assert_array_equal(q.scale.view(np.uint8).reshape(-1), want_scale)
    np.testing.assert_array_equal(q.data.view(np.uint8), np.array(want, np.uint8))
    d, nan = q.dequantize(), np.isnan(x).any(1)
    assert np.isfinite(d[~nan]).all() and np.isnan(d[nan]).all()
    inf = np.isinf(x) & ~nan[:, None]  # dequantizes to +-6 * 448 * gs
    np.testing.assert_array_equal(d[inf], np.sign(x[inf]) * np.float32(6 * 448) * g)


def test_mx_rules_at_the_corners():
    """The spec's NaN scale for NaN or inf, the smallest scale for all zeros, the
    spec's element saturation (FLOOR can overflow the element), a short last block."""
    x = np.zeros((4, 40), np.float32)
    x[1, 0], x[2, 5] = np.nan, -np.inf
    x[3] = 500.0  # floor: 2**(8 - 8) = 1: 500 saturates to 448 in e4m3
    q = qarray.quantize_mx(x, "mxfp8_e4m3")
    assert q.scale.shape == (4, 2) and q.block_size == 32
    np.testing.assert_array_equal(q.scale.view(np.uint8), [[0, 0], [255, 0], [255, 0], [127, 127]])
    d = q.dequantize()
    assert np.isnan(d[1, :32]).all() and (d[1, 32:] == 0).all() and (d[3] == 448).all()
    assert (d[0] == 0).all()
    assert q.scale.astype(np.float32)[0, 0] == np.float32(2.0**-127)
    q = qarray.quantize_mx(x[3:], "mxfp8_e4m3", scale_rounding="rceil")  # 500 / 448 -> 2**1: 250 -> 256
    np.testing.assert_array_equal(q.dequantize(), np.full((1, 40), 512, np.float32))


def test_mx_dequantize_is_exact_and_other_axes(rng):
    x = (rng.standard_normal((40, 6)) * 2.0 ** rng.integers(-100, 100, (40, 1))).astype(np.float32)
    for fmt in F.MX_FORMATS:
        q = qarray.quantize_mx(x, fmt, axis=0, block_size=16)
        assert q.axis == 0 and q.scale.shape == (3, 6) and q.scale.dtype == F.dtype("float8_e8m0fnu")
        e = F.values(q.data, q.dtype, np.float64) * np.repeat(q.scale.astype(np.float64), 16, axis=0)[:40]
        np.testing.assert_array_equal(q.dequantize("float64"), e)
        np.testing.assert_array_equal(q.dequantize(), e.astype(np.float32))
        t = qarray.quantize_mx(np.ascontiguousarray(x.T), fmt, block_size=16)
        np.testing.assert_array_equal(t.int_repr(), q.int_repr().T)


def test_mx_spec_table():
    """The element formats' numbers in the OCP MX v1.0 spec (section 5.3, tables 2-4):
    largest normal, smallest normal, smallest subnormal, and emax."""
    table = {"mxfp8_e4m3": (448, 2.0**-6, 2.0**-9, 8), "mxfp8_e5m2": (57344, 2.0**-14, 2.0**-16, 15),
             "mxfp6_e2m3": (7.5, 1, 0.125, 2), "mxfp6_e3m2": (28, 0.25, 0.0625, 4), "mxfp4": (6, 1, 0.5, 2),
             "mxint8": (127 / 64, 1 / 64, 1 / 64, 0)}
    for fmt, (top, normal, sub, emax) in table.items():
        i = F.finfo(F.MX_FORMATS[fmt].element)
        assert (i.max, i.smallest_normal, i.smallest_subnormal, F.MX_FORMATS[fmt].emax) == (top, normal, sub, emax)
        assert emax == math.floor(math.log2(top))


def test_mx_qarray_path(tmp_path):
    x = np.linspace(-3, 3, 96, dtype=np.float32).reshape(3, 32)
    q = qarray.quantize_mx(x, "mxfp6_e3m2")
    assert q.dtype == "float6_e3m2fn" and q.qscheme == "per_block_affine"
    r = qarray.load(qarray.save(tmp_path / "mx.npz", {"q": q}) or tmp_path / "mx.npz")["q"]
    assert r.scale.dtype == q.scale.dtype and np.array_equal(r.int_repr(), q.int_repr())
    w = qarray.QArray.from_int(q.int_repr(), q.scale, 0, q.dtype, axis=1, block_size=32)
    np.testing.assert_array_equal(w.dequantize(), q.dequantize())
    assert len(q.pack()) == 96 * 6 // 8


def test_errors():
    x = np.ones((2, 32), np.float32)
    with pytest.raises(ValueError, match="quantize_mx: fmt must be one of mxfp8_e4m3, .*got 'mxfp3'"):
        qarray.quantize_mx(x, "mxfp3")
    with pytest.raises(ValueError, match="scale_rounding must be one of floor, ceil, even, rceil, got 'up'"):
        qarray.quantize_mx(x, "mxfp4", scale_rounding="up")
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        qarray.quantize_mx(x, "mxfp4", block_size=0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        qarray.quantize_mx(x, "mxfp4", axis=2)
    with pytest.raises(TypeError, match="quantize_mx takes float16, float32 or float64 input, got int64"):
        qarray.quantize_mx(np.ones((2, 3), np.int64), "mxfp4")
    with pytest.raises(ValueError, match="takes an array of at least one dimension"):
        qarray.quantize_nvfp4(np.float32(1))
    for bad in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            qarray.quantize_nvfp4(x, global_scale=bad)
    with pytest.raises(ValueError, match=r"global_scale must be one number, got shape \(2,\)"):
        qarray.quantize_nvfp4(x, global_scale=np.ones(2, np.float32))
    e8 = np.full((2, 1), np.nan, np.float32).astype(F.dtype("float8_e8m0fnu"))
    with pytest.raises(ValueError, match="scale must be finite and > 0"):  # NaN block scales: floating formats only
        qarray.QArray.from_int(np.ones((2, 32), np.int8), e8, 0, "qint8", axis=1, block_size=32)


def test_from_int_takes_a_global_scale():
    """An NVFP4 tensor from elsewhere (codes, e4m3 block scales, tensor scale) wraps
    with from_int and dequantizes as quantize_nvfp4's own."""
    x = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    q = qarray.quantize_nvfp4(x)
    w = qarray.QArray.from_int(q.int_repr(), q.scale, 0, "float4_e2m1fn", axis=1, block_size=16, global_scale=q.global_scale)
    assert w.global_scale == q.global_scale and w.scale.dtype == q.scale.dtype
    np.testing.assert_array_equal(w.dequantize(), q.dequantize())
    with pytest.raises(TypeError, match="from_int: global_scale= is for floating formats"):
        qarray.QArray.from_int(np.ones(3, np.int8), 1.0, 0, "qint8", global_scale=1.0)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        qarray.QArray.from_int(q.int_repr(), q.scale, 0, "float4_e2m1fn", axis=1, block_size=16, global_scale=0.0)


def test_mxint8_int_repr_is_its_int8_elements():
    """mxint8's elements are two's-complement int8 (OCP MX 1.0, section 6.4):
    int_repr gives int8 (it gave their uint8 bit patterns), -x gives the negated
    codes, and from_int takes them back."""
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    q = qarray.quantize_mx(x, "mxint8")
    codes = q.int_repr()
    assert codes.dtype == np.int8 and codes.min() < 0 and codes.max() > 0
    np.testing.assert_array_equal(qarray.quantize_mx(-x, "mxint8").int_repr(), -codes)
    np.testing.assert_array_equal(codes[0, 0], -64)  # -1 = -64 * 2**-6 at block scale 2**0
    back = qarray.QArray.from_int(codes, q.scale, 0, q.dtype, axis=1, block_size=32)
    np.testing.assert_array_equal(back.dequantize(), q.dequantize())
