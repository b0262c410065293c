"""matmul and linear of floating-format operands (float8/6/4, MX, NVFP4, and their
mix with integer ones): every result against an independent reference built with
``fractions.Fraction`` from each element's value (ml_dtypes' value of the code,
times its scale read by index, times the global scale), rounded once by integer
arithmetic here (not by the code under test)."""

import math
from fractions import Fraction

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray.ops import _exact

ml_dtypes = pytest.importorskip("ml_dtypes")

# (significand bits with the implicit one, smallest normal exponent, largest value) of each output format
FORMATS = {"float32": (24, -126, None), "float8_e4m3fn": (4, -6, 448), "float8_e5m2": (3, -14, 57344),
           "float4_e2m1fn": (2, 0, 6), "float6_e2m3fn": (4, 0, 7.5), "float6_e3m2fn": (3, -2, 28)}
E8M0 = ml_dtypes.float8_e8m0fnu


# -- the reference ---------------------------------------------------------------
def values(q):
    """The exact value of every element of ``q`` as a Fraction (object array)."""
    data = np.asarray(q.data)
    if q.dtype.kind == "float":
        el = data.astype(np.float64) if q.dtype.name != "mxint8" else data.astype(np.int64) / 64
    else:
        el = None
    scale = np.asarray(q.scale).astype(np.float64)
    zp = np.asarray(q.zero_point)
    out = np.empty(q.shape, object)
    for idx in np.ndindex(*q.shape):
        if q.axis is None:
            p = ()
        elif q.block_size is None:
            p = (idx[q.axis],)
        else:
            p = tuple(i // q.block_size if d == q.axis else i for d, i in enumerate(idx))
        e = Fraction(float(el[idx])) if el is not None else Fraction(int(data[idx]) - int(zp[p]))
        v = e * Fraction(float(scale[p]))
        out[idx] = v * Fraction(float(q.global_scale)) if q.global_scale is not None else v
    return out


def exact_matmul(a, b):
    return np.matmul(values(a), values(b))


def round_half_even(x: Fraction) -> int:
    return round(x)  # Fraction's round: half to even


def round_float(x: Fraction, fmt):
    """``x`` rounded to nearest even in ``fmt`` (float32: overflow to inf; the others saturate)."""
    p, emin, top = FORMATS[fmt]
    if x == 0:
        return 0.0
    e = math.floor(math.log2(abs(x)))
    e += (Fraction(2) ** (e + 1) <= abs(x)) - (Fraction(2) ** e > abs(x))  # exact floor(log2 |x|)
    ulp = Fraction(2) ** (max(e, emin) - p + 1)
    r = round_half_even(x / ulp) * ulp
    if top is None:
        return float(np.float32(float(r))) if abs(r) < 2**128 else math.copysign(math.inf, r)
    return float(max(-Fraction(top), min(Fraction(top), r)))


def rounded(exact, fmt, scale=1.0, zp=0):
    """The Fraction results rounded to ``fmt`` (a float format, or an integer QDType name)."""
    s = Fraction(float(np.float32(scale)))
    if fmt in FORMATS:
        return np.vectorize(lambda x: round_float(x / s, fmt), otypes=[np.float64])(exact)
    d = qarray.qdtype(fmt)
    return np.vectorize(lambda x: min(d.qmax, max(d.qmin, round_half_even(x / s) + zp)), otypes=[np.int64])(exact)


def _codes(q):
    """A QArray's codes as numbers: integers, or a float format's element values."""
    return np.asarray(q.int_repr() if q.dtype.kind == "int" else q.data.astype(np.float64), np.float64) \
        if q.dtype.name != "mxint8" else q.data.astype(np.float64) / 64


def check(a, b, fmt="float32", scale=None, zp=0, **kw):
    """matmul(a, b) against the Fraction reference, for output ``fmt``."""
    exact = exact_matmul(a, b)
    bias, relu = kw.get("bias"), kw.get("relu", False)
    if bias is not None:
        exact = exact + np.array([Fraction(float(v)) for v in bias], object)
    if relu:
        exact = np.vectorize(lambda x: max(x, Fraction(0)), otypes=[object])(exact)
    params = {} if fmt == "float32" and scale is None else {"scale": 1.0 if scale is None else scale, "dtype": fmt}
    if zp:
        params["zero_point"] = zp
    out = qarray.matmul(a, b, **params, **kw)
    want = rounded(exact, fmt, 1.0 if scale is None else scale, zp)
    np.testing.assert_array_equal(_codes(out) if isinstance(out, QArray) else out.astype(np.float64), want)
    return out


# -- operands --------------------------------------------------------------------
def floats(rng, shape, top):
    """Random values over many binades, with zeros, +-top and tiny ones."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 3, shape)) * top / 4
    flat = x.reshape(-1)
    flat[:: 7] = 0
    flat[1:: 11] = top
    flat[2:: 13] = -top
    return x.astype(np.float32)


def fp(rng, shape, fmt, scale=0.5, axis=None, block_size=None):
    """Random codes of a float format (every code but NaN/inf), with a given scale."""
    d = qarray.qdtype(fmt)
    bits = rng.integers(0, 1 << d.bits, shape).astype(np.uint8)
    vals = bits.view(d.storage).astype(np.float64)
    bits[~np.isfinite(vals)] = 0
    return QArray.from_int(bits, scale, 0, fmt, axis=axis, block_size=block_size)


def e8m0(exponents):
    return (np.asarray(exponents) + 127).astype(np.uint8).view(E8M0)


# -- random shapes, every layout, every output -----------------------------------
MX = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8"]


@pytest.mark.parametrize("fa", MX)
@pytest.mark.parametrize("fb", ["mxfp8_e4m3", "mxfp4", "mxint8"])
def test_mx_random_against_fraction(rng, fa, fb):
    k = 37  # blocks of 8 along K: a short last block
    a = qarray.quantize_mx(floats(rng, (3, k), 10), fa, axis=-1, block_size=8)
    b = qarray.quantize_mx(floats(rng, (k, 4), 10), fb, axis=0, block_size=8)
    check(a, b)
    check(a, b, "qint8", scale=0.37, zp=-5)
    check(a, b, "float8_e4m3fn", scale=0.05)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                 "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"])
def test_every_code_of_every_format(rng, fmt):
    """All codes (extremes, smallest subnormals) times per-axis float16 / bfloat16 scales."""
    a = fp(rng, (4, 64), fmt, scale=np.array([0.5, 3.0, 2.0**-10, 7.0], np.float16), axis=0)
    b = fp(rng, (64, 5), fmt, scale=np.array([1, 2, 3, 0.1, 2.0**-20], ml_dtypes.bfloat16), axis=1)
    for out in ("float32", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float6_e3m2fn"):
        check(a, b, out, scale=None if out == "float32" else 0.7)
    check(a, b, "qint32", scale=2.0**-12)
    check(a, b, "quint8", scale=1.5, zp=200)


def test_float8_with_nvfp4_and_batch_dims(rng):
    a = qarray.quantize(floats(rng, (2, 3, 40), 100), 0.25, 0, "float8_e5m2")
    b = qarray.quantize_nvfp4(floats(rng, (40, 6), 30), axis=0)
    assert b.global_scale is not None and b.block_size == 16
    check(a, b)
    check(a, b, "qint8", scale=4.0)
    b3 = qarray.quantize_nvfp4(floats(rng, (2, 40, 6), 30), axis=1)
    check(a, b3, "float8_e4m3fn", scale=3.0)


@pytest.mark.parametrize("zp", [-128, 127])
def test_mxfp8_with_qint8_zero_points_at_both_ends(rng, zp):
    a = qarray.quantize_mx(floats(rng, (5, 64), 3), "mxfp8_e4m3")
    b = QArray.from_int(rng.integers(-128, 128, (64, 3)), np.float32([0.01, 0.3, 7.0]), zp, "qint8", axis=1)
    check(a, b)
    check(a, b, "qint8", scale=0.1)
    u = QArray.from_int(rng.integers(0, 256, (5, 64)), 0.02, 255 if zp > 0 else 0, "quint8")
    check(u, qarray.quantize_mx(floats(rng, (64, 3), 3), "mxfp6_e2m3", axis=0), "quint8", scale=0.03, zp=17)


def test_linear_bias_relu_and_vector_input(rng):
    x = qarray.quantize_mx(floats(rng, (2, 3, 48), 5), "mxfp8_e4m3", block_size=16)
    w = qarray.quantize_mx(floats(rng, (7, 48), 5), "mxfp4", block_size=16)
    bias = (rng.standard_normal(7) * 100).astype(np.float32)
    exact = np.matmul(values(x), values(w).T) + np.array([Fraction(float(v)) for v in bias], object)
    for relu in (False, True):
        e = np.vectorize(lambda v: max(v, Fraction(0)) if relu else v, otypes=[object])(exact)
        out = qarray.linear(x, w, bias, relu=relu)
        np.testing.assert_array_equal(out, rounded(e, "float32"))
        q = qarray.linear(x, w, bias, relu=relu, scale=0.75, zero_point=3, dtype="qint8")
        np.testing.assert_array_equal(q.int_repr(), rounded(e, "qint8", 0.75, 3))
    v = qarray.linear(x[0, 0], w, bias)
    assert v.shape == (7,)
    np.testing.assert_array_equal(v, rounded(exact[0, 0], "float32"))


# -- exactness where float64 is not enough: the split path -----------------------
def test_e5m2_sum_beyond_2_64_breaks_a_float32_tie():
    """57344**2 * 4094 + 2**19 + 2**-32: the first two are a float32 tie; the
    last, 2**-75 of the sum, decides it (float64 BLAS would lose it)."""
    k = 4096
    a = np.full((1, k), 57344.0)
    b = np.full((k, 1), 57344.0)
    a[0, -2:], b[-2:, 0] = [2.0**10, 2.0**-16], [2.0**9, 2.0**-16]
    qa = qarray.quantize(a.astype(np.float32), 1.0, 0, "float8_e5m2")
    qb = qarray.quantize(b.astype(np.float32), 1.0, 0, "float8_e5m2")
    out = check(qa, qb)
    assert out[0, 0] == np.float32(200606 * 2.0**26 + 2.0**20)  # rounded up, not to even
    check(qa, qb, "float8_e5m2", scale=2.0**20)


def test_mx_scales_2_pow_minus_127_and_127_in_one_row():
    """Huge terms that cancel exactly, leaving the tiny ones: only an exact sum sees them."""
    # 448 * 2**127, 2**-9 * 2**127 | 1 * 2**-127, 1.5 * 2**-127 | -448 * 2**127, -2**-9 * 2**127
    codes = np.array([[0x7E, 0x01, 0x38, 0x3C, 0xFE, 0x81]], np.uint8)
    a = QArray.from_int(codes, e8m0([[127, -127, 127]]), 0, "float8_e4m3fn", axis=1, block_size=2)
    b = QArray.from_int(np.full((6, 2), 0x38, np.uint8), e8m0([[0, 0], [0, 0], [0, 0]]), 0, "float8_e4m3fn",
                        axis=0, block_size=2)
    assert exact_matmul(a, b)[0, 0] == Fraction(5, 2) * Fraction(2) ** -127
    check(a, b)
    check(a, b, "float8_e4m3fn", scale=2.0**-130)
    check(a, b, "qint32", scale=2.0**-140)
    big = QArray.from_int(codes, e8m0([[127, 127, -127]]), 0, "float8_e4m3fn", axis=1, block_size=2)
    assert np.isinf(check(big, b)).all()  # beyond float32: inf, as IEEE rounding gives
    check(big, b, "float8_e4m3fn", scale=1.0)  # saturates
    check(big, b, "qint8", scale=1.0)


def test_split_path_matches_fraction_on_random_wide_values(rng):
    """_split_matmul itself, on values whose rows span hundreds of bits."""
    a = rng.standard_normal((3, 9)) * np.exp2(rng.integers(-280, 280, (3, 9)))
    b = rng.standard_normal((9, 4)) * np.exp2(rng.integers(-280, 280, (9, 4)))
    a[0, 3] = b[5, 1] = 0
    top = lambda v, ax: np.frexp(np.abs(v).max(axis=ax, keepdims=True))[1]  # noqa: E731
    num, shift = _exact._split_matmul(a, top(a, 1), b, top(b, 0), 9)
    want = np.matmul(np.vectorize(Fraction, otypes=[object])(a), np.vectorize(Fraction, otypes=[object])(b))
    assert [[Fraction(int(n)) * Fraction(2) ** shift for n in row] for row in num] == want.tolist()


def test_fast_path_and_split_path_are_both_taken(rng, monkeypatch):
    calls = []
    real = _exact._split_matmul
    monkeypatch.setattr(_exact, "_split_matmul", lambda *args: calls.append(1) or real(*args))
    a = qarray.quantize_mx(floats(rng, (4, 256), 5), "mxfp8_e4m3")
    b = qarray.quantize_mx(floats(rng, (256, 4), 5), "mxfp8_e4m3", axis=0)
    check(a, b)
    assert not calls  # e4m3 spans 18 bits a row: float64 BLAS is exact
    wide = QArray.from_int(np.full((1, 4), 0x38, np.uint8), e8m0([[100, -100]]), 0, "float8_e4m3fn",
                           axis=1, block_size=2)
    check(wide, qarray.quantize_mx(floats(rng, (4, 3), 5), "mxfp8_e4m3", axis=0, block_size=2))
    assert calls


# -- ties, every output kind ------------------------------------------------------
@pytest.mark.parametrize("rounding,want", [("half_even", [2, 2, -2, 4, 0]), ("half_away", [3, 2, -3, 5, 1]),
                                           ("half_up", [3, 2, -2, 5, 1])])
def test_integer_ties(rounding, want):
    a = qarray.quantize(np.float32([[2.5], [2.25], [-2.5], [4.5], [0.5]]), 1.0, 0, "float8_e4m3fn")
    b = qarray.quantize(np.float32([[1.0]]), 1.0, 0, "float8_e4m3fn")
    out = qarray.matmul(a, b, scale=1.0, dtype="qint8", rounding=rounding)
    assert out.int_repr()[:, 0].tolist() == want


def test_float_output_ties():
    a = qarray.quantize(np.float32([[1.25], [2.5]]), 1.0, 0, "float8_e4m3fn")
    b = qarray.quantize(np.float32([[2.0]]), 1.0, 0, "float8_e4m3fn")
    f4 = qarray.matmul(a, b, scale=1.0, dtype="float4_e2m1fn")
    assert f4.data.astype(np.float64)[:, 0].tolist() == [2.0, 4.0]  # 2.5 and 5: ties to the even mantissa
    a = qarray.quantize(np.float32([[1.5]]), 1.0, 0, "float8_e4m3fn")
    b = qarray.quantize(np.float32([[0.875, 1.125]]), 1.0, 0, "float8_e4m3fn")
    e4 = qarray.matmul(a, b, scale=1.0, dtype="float8_e4m3fn")
    assert e4.data.astype(np.float64)[0].tolist() == [1.25, 1.75]  # 1.3125 and 1.6875: ties
    check(a, b, "float8_e4m3fn", scale=1.0)


def test_float32_output_with_a_scale_rounds_the_quotient_once(rng):
    a = qarray.quantize_mx(floats(rng, (4, 32), 5), "mxfp8_e4m3")
    b = qarray.quantize_mx(floats(rng, (32, 3), 5), "mxfp8_e4m3", axis=0)
    exact = exact_matmul(a, b) / Fraction(float(np.float32(0.3)))
    np.testing.assert_array_equal(qarray.matmul(a, b, scale=0.3, dtype="float32"), rounded(exact, "float32"))


# -- NaN and inf -------------------------------------------------------------------
def test_nan_and_inf_follow_ieee_float64():
    a = qarray.quantize(np.float32([[np.inf, 1, 2], [1, 2, 3], [np.nan, 0, 0], [-np.inf, 1, 1]]), 1.0, 0,
                        "float8_e5m2", saturate=False)
    b = qarray.quantize(np.float32([[1, 0], [2, 1], [3, 1]]), 1.0, 0, "float8_e5m2")
    out = qarray.matmul(a, b)
    assert out[0, 0] == np.inf and np.isnan(out[0, 1])  # inf * 0
    assert out[1].tolist() == [14.0, 5.0]
    assert np.isnan(out[2]).all() and out[3, 0] == -np.inf
    e4 = qarray.matmul(a, b, scale=1.0, dtype="float8_e4m3fn")
    assert np.isnan(e4.data.astype(np.float64)[2]).all() and e4.data.astype(np.float64)[0, 0] == 448
    with pytest.raises(ValueError, match=r"matmul: output element \(0, 0\) is inf .* which qint8 does not hold"):
        qarray.matmul(a, b, scale=1.0, dtype="qint8")
    with pytest.raises(ValueError, match=r"output element \(0, 1\) is nan .* float4_e2m1fn does not hold"):
        qarray.matmul(a, b, scale=1.0, dtype="float4_e2m1fn")


def test_mx_nan_block_scale():
    a = qarray.quantize_mx(np.float32([[1, np.nan, 2, 3], [1, 2, 3, 4]]), "mxfp8_e4m3", block_size=2)
    b = qarray.quantize_mx(np.ones((4, 2), np.float32), "mxfp8_e4m3", axis=0, block_size=2)
    out = qarray.matmul(a, b)
    assert np.isnan(out[0]).all() and out[1].tolist() == [10.0, 10.0]



def test_nvfp4_inf_block_is_finite_nan_block_is_nan():
    """An NVFP4 block holding inf has the finite scale 448 (torchao's clamp; inf is
    +-6 * 448 * gs): matmul through it is the exact finite sum; a NaN block's NaN
    scale still makes its row NaN."""
    x = np.float32([[np.inf, 1, -2, 3] + [0.5] * 12, [-np.inf, 7, 0, 0] + [1] * 12, [1, np.nan] + [2] * 14])
    a = qarray.quantize_nvfp4(x)
    b = qarray.quantize(np.linspace(-1, 1, 32, dtype=np.float32).reshape(16, 2), 0.125, 0, "float8_e4m3fn")
    assert a.scale.view(np.uint8).reshape(-1).tolist()[:2] == [0x7E, 0x7E]
    check(a[:2], b)
    check(a[:2], b, "qint8", scale=0.5)
    out = qarray.matmul(a, b)
    assert np.isfinite(out[:2]).all() and np.isnan(out[2]).all()

# -- errors --------------------------------------------------------------------------
def test_errors(rng):
    a = qarray.quantize_mx(floats(rng, (2, 8), 1), "mxfp8_e4m3", block_size=8)
    b = qarray.quantize_mx(floats(rng, (8, 2), 1), "mxfp8_e4m3", axis=0, block_size=8)
    with pytest.raises(TypeError, match="matmul: b must be a QArray, got ndarray; quantize it first"):
        qarray.matmul(a, np.ones((8, 2)))
    wide = QArray.from_int(np.ones((8, 2), np.int32), 1.0, 0, "qint32")
    with pytest.raises(TypeError, match="matmul: b has dtype qint32; integer operands of floating-format matmuls "
                                        r"have 2 to 16 bits \(qint8, quint8, ...\); requantize it first"):
        qarray.matmul(a, wide)
    with pytest.raises(ValueError, match=r"matmul: shapes \(2, 8\) and \(7, 2\) do not align: 8 != 7 \(K\)"):
        qarray.matmul(a, qarray.quantize_mx(floats(rng, (7, 2), 1), "mxfp8_e4m3", axis=0))
    with pytest.raises(ValueError, match=r"linear: with floating-format operands bias must be a float array of "
                                         r"shape \(2,\), got int64 \(2,\)"):
        qarray.linear(a, b.T, np.array([1, 2]))
    with pytest.raises(ValueError, match="matmul: a float32 output has no zero point"):
        qarray.matmul(a, b, dtype="float32", zero_point=3)
    with pytest.raises(ValueError, match=r"matmul: pass the output scale="):
        qarray.matmul(a, b, dtype="qint8")
    with pytest.raises(TypeError, match="add takes integer formats; float8_e4m3fn is a floating format"):
        qarray.add(a, a, 1.0, 0, "qint8")
