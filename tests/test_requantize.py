import threading
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qarray
from qarray import QArray, qdtype
from qarray._fixed_point import quantize_multiplier
from _reference import ref_fixed, ref_scale, round_rational

ROUNDINGS = ["half_even", "half_away", "half_up"]


def test_quantize_multiplier():
    m, s = quantize_multiplier(0.3)
    assert (int(m), int(s)) == (1288490189, 32)
    for M in [1.0, 0.5, 2.0**-20, 0.999999999, 1234.5, 2.0**29]:
        m, s = (int(v) for v in quantize_multiplier(M))
        assert 2**30 <= m < 2**31
        assert abs(Fraction(m, 2**s) - Fraction(M)) <= Fraction(1, 2 ** (s + 1))
    # far below TFLite's 2**-32 the multiplier is kept ...
    for M in [2.0**-33, 2.0**-63, 2.0**-64]:
        m, s = (int(v) for v in quantize_multiplier(M))
        assert Fraction(m, 2**s) == Fraction(M)
    # ... until every |d * m| < 2**94 rounds to 0 (an exact zero), and up to 2**34,
    # beyond which every d != 0 saturates every output (a capped shift)
    assert [int(v) for v in quantize_multiplier(2.0**-64 * 0.75)] == [0, 94]
    assert [int(v) for v in quantize_multiplier(2.0**-64)] == [2**30, 94]
    assert [int(v) for v in quantize_multiplier(2.0**33)] == [2**30, -3]
    assert [int(v) for v in quantize_multiplier(2.0**40)] == [2**30, -3]
    # tflite=True: TFLite's QuantizeMultiplier caps (0 below 2**-32, 2**31 - 1 with shift 30 from 2**30)
    assert [int(v) for v in quantize_multiplier(2.0**-33, tflite=True)] == [0, 62]
    assert [int(v) for v in quantize_multiplier(2.0**-32, tflite=True)] == [2**30, 62]
    assert [int(v) for v in quantize_multiplier(2.0**30, tflite=True)] == [2**31 - 1, 1]
    with pytest.raises(ValueError, match="must be finite and > 0"):
        quantize_multiplier(0.0)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_ties(rounding, kernels):
    q = QArray.from_int(np.arange(-7, 8), 1.0, 0, "qint32")
    r = qarray.requantize(q, 2.0, 0, "qint8", rounding=rounding)
    # -3.5 -3 -2.5 -2 -1.5 -1 -0.5 0 0.5 1 1.5 2 2.5 3 3.5
    want = {"half_even": [-4, -3, -2, -2, -2, -1, 0, 0, 0, 1, 2, 2, 2, 3, 4],
            "half_away": [-4, -3, -3, -2, -2, -1, -1, 0, 1, 1, 2, 2, 3, 3, 4],
            "half_up": [-3, -3, -2, -2, -1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4]}[rounding]
    np.testing.assert_array_equal(r.int_repr(), want)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=30),
    st.floats(1e-7, 1e4),
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from(ROUNDINGS),
    st.sampled_from(["qint8", "quint8", "qint16", "qint32", "qint4"]),
)
def test_fixed_matches_exact_rational(ints, M, zp_in, rounding, dtype):
    d = qdtype(dtype)
    s_in = np.float32(0.001)
    s_out = np.float32(float(s_in) / M)
    M = float(s_in) / float(s_out)
    zp_out = d.qmin + (d.qmax - d.qmin) // 2
    q = QArray.from_int(np.array(ints, np.int32), s_in, zp_in, "qint32")
    want = [min(max(ref_fixed(v - zp_in, M, rounding) + zp_out, d.qmin), d.qmax) for v in ints]
    for numba in (True, False):
        with qarray.config.using(numba=numba):
            r = qarray.requantize(q, s_out, zp_out, dtype, rounding=rounding)
            np.testing.assert_array_equal(r.int_repr(), want)
            assert r.data.dtype == d.storage


def _means(count, m, sh):
    """Sums whose means over ``count`` lie on, beside and far from every tie of
    ``R(mean * m / 2**sh)``, up to the largest mean of 32-bit values."""
    big = 2**32 - 1
    out = {big * count, -big * count, big * count + count - 1, -big * count - count + 1, 0, 1, -1, count - 1}
    for k in (0, 1, 2, 3, 1000, 2**20):  # the sums whose exact result is k + 1/2, and one off
        t = Fraction(2 * k + 1, 2) * Fraction(2**sh, m) * count if m else Fraction(0)
        if t.denominator == 1:
            out |= {int(t) + e for e in (-1, 0, 1)} | {-int(t) + e for e in (-1, 0, 1)}
    return sorted(v for v in out if abs(Fraction(v, count)) < 2**32)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 9, 49, 2**20 + 7])
@pytest.mark.parametrize("M", [2.0**-40, 2.0**-33, 1 / 49, 0.3, 0.5, 1.0, 3.0, 2.0**29 * 1.5])
def test_rescale_mean_at_ties_and_extremes(count, M):
    """The mean's rounding (``_fixed_point.rescale_mean``, what avg_pool2d,
    adaptive_avg_pool2d and mean use) against Fractions, every tie rule:
    sums on the ties (M = 0.5 and 1.0 reach them), one off, and means of
    +-(2**32 - 1), where ``I`` passes 2**62."""
    from qarray._fixed_point import ROUNDINGS as CODES, rescale_mean

    m, sh = (int(v) for v in quantize_multiplier(M))
    acc = _means(count, m, sh)
    for rounding in ROUNDINGS:
        got = rescale_mean(np.array(acc, np.int64), count, m, sh, CODES[rounding])
        want = [round_rational(Fraction(t, count) * Fraction(m, 2**sh), rounding) for t in acc]
        # beyond 2**60 the result is saturated there (outside every output)
        want = [max(min(w, 2**60), -(2**60)) for w in want]
        assert [max(min(g, 2**60), -(2**60)) for g in got.tolist()] == want, rounding


@settings(max_examples=300, deadline=None)
@given(st.integers(-(2**32) + 1, 2**32 - 1), st.integers(0, 2**40), st.integers(1, 5000),
       st.floats(1e-12, 1e6), st.sampled_from(ROUNDINGS))
def test_rescale_mean_is_exact(mean, rem, count, M, rounding):
    from qarray._fixed_point import ROUNDINGS as CODES, rescale_mean

    acc = mean * count + rem % count  # |acc / count| < 2**32
    m, sh = (int(v) for v in quantize_multiplier(M))
    got = rescale_mean(np.array([acc, -acc], np.int64), np.array([count, count]), m, sh, CODES[rounding])
    want = [round_rational(Fraction(t, count) * Fraction(m, 2**sh), rounding) for t in (acc, -acc)]
    assert got.tolist() == want


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=30), st.floats(1e-6, 300.0))
def test_tflite_matches_gemmlowp(ints, M):
    s_out = np.float32(1.0)
    s_in = np.float32(M)
    M = float(s_in)
    q = QArray.from_int(np.array(ints, np.int32), s_in, 0, "qint32")
    # gemmlowp / TFLite MultiplyByQuantizedMultiplier (M from 1e-6 to 300: inside TFLite's caps)
    want = [min(max(ref_scale(v, M, "tflite"), -(2**31)), 2**31 - 1) for v in ints]
    for numba in (True, False):
        with qarray.config.using(numba=numba):
            r = qarray.requantize(q, s_out, 0, "qint32", rounding="tflite")
            np.testing.assert_array_equal(r.int_repr(), want)


def test_tflite_known_values(kernels):
    # gemmlowp rounds the high-mul half away from zero for positive and toward
    # zero for negative ties (-4.5 -> -4 after the nudge); 0.5 = 2**30 / 2**31.
    q = QArray.from_int(np.array([-9, -3, 3, 9], np.int32), 0.5, 0, "qint32")
    np.testing.assert_array_equal(qarray.requantize(q, 1.0, 0, "qint32", rounding="tflite").int_repr(), [-4, -1, 2, 5])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-128, 127), min_size=1, max_size=30), st.floats(0.0009765625, 1.0, width=32),
       st.floats(0.0009765625, 1.0, width=32), st.integers(-128, 127), st.integers(0, 255))
def test_float_mode_is_onnx(ints, s_in, s_out, zp_in, zp_out):
    q = QArray.from_int(np.array(ints, np.int8), s_in, zp_in, "qint8")
    mult = np.float32(s_in) / np.float32(s_out)
    want = np.clip(np.rint((np.array(ints, np.float64) - zp_in) * np.float64(mult) + zp_out), 0, 255)
    for numba in (True, False):
        with qarray.config.using(numba=numba):
            r = qarray.requantize(q, s_out, zp_out, "quint8", mode="float")
            np.testing.assert_array_equal(r.int_repr(), want)


@pytest.mark.parametrize("case", ["axis_to_tensor", "tensor_to_axis", "axis_to_axis", "blocked_to_tensor", "blocked_to_blocked"])
@pytest.mark.parametrize("mode", ["fixed", "float"])
def test_per_axis(case, mode, rng, kernels):
    x = rng.standard_normal((5, 6, 7)).astype(np.float32)
    s_axis = rng.uniform(0.01, 0.1, 6).astype(np.float32)
    z_axis = rng.integers(-10, 10, 6)
    blocked = case.startswith("blocked")
    if case in ("axis_to_tensor", "axis_to_axis"):
        q = qarray.quantize(x, s_axis, z_axis, "qint16", axis=1)
    elif blocked:
        q = qarray.quantize_dynamic(x, "qint16", axis=2, block_size=3)
    else:
        q = qarray.quantize(x, 0.03, 2, "qint16")
    if case in ("tensor_to_axis", "axis_to_axis"):
        out = dict(scale=s_axis * 3, zero_point=z_axis, axis=1)
    elif case == "blocked_to_blocked":
        out = dict(scale=q.scale * 2, zero_point=np.zeros(q.scale.shape, np.int32), axis=2, block_size=3)
    else:
        out = dict(scale=0.05, zero_point=-3)
    r = qarray.requantize(q, dtype="qint8", mode=mode, rounding="half_even", **out)
    # reference: every element on its own, per-tensor in and out
    from qarray._params import expand
    si = np.broadcast_to(expand(q.scale, q.shape, q.axis, q.block_size), q.shape)
    zi = np.broadcast_to(expand(q.zero_point, q.shape, q.axis, q.block_size), q.shape)
    so = np.broadcast_to(expand(r.scale, r.shape, r.axis, r.block_size), r.shape)
    zo = np.broadcast_to(expand(r.zero_point, r.shape, r.axis, r.block_size), r.shape)
    if mode == "fixed":
        want = [min(max(ref_fixed(int(v) - int(a), float(b) / float(c), "half_even") + int(z), -128), 127)
                for v, a, b, c, z in zip(q.int_repr().ravel(), zi.ravel(), si.ravel(), so.ravel(), zo.ravel())]
    else:
        mult = si.astype(np.float32) / so.astype(np.float32)
        want = np.clip(np.rint((q.int_repr() - zi.astype(np.float64)) * mult.astype(np.float64) + zo), -128, 127)
    np.testing.assert_array_equal(r.int_repr().ravel(), np.ravel(want))
    assert (r.axis, r.block_size) == (out.get("axis"), out.get("block_size"))


def test_defaults_from_config():
    q = QArray.from_int(np.array([1, 3, -1]), 1.0, 0, "qint8")
    assert qarray.requantize(q, 2.0).int_repr().tolist() == [0, 2, 0]
    with qarray.config.using(rounding="half_away"):
        assert qarray.requantize(q, 2.0).int_repr().tolist() == [1, 2, -1]
    with qarray.config.using(mode="float"):
        assert qarray.requantize(q, 2.0).int_repr().tolist() == [0, 2, 0]
    assert q.requantize(2.0, rounding="half_up").int_repr().tolist() == [1, 2, 0]
    assert qarray.config.rounding == "half_even" and qarray.config.mode == "fixed"


def test_errors():
    q = qarray.quantize(np.ones((2, 3), np.float32), [0.1, 0.2], 0, "qint8", axis=0)
    with pytest.raises(ValueError, match="cannot requantize from parameters on axis 0 .* to parameters on axis 1"):
        qarray.requantize(q, [0.1, 0.2, 0.3], 0, axis=1)
    with pytest.raises(ValueError, match=r"zero_point 200 is outside the range \[-128, 127\] of qint8"):
        qarray.requantize(q, 0.1, 200, "qint8")
    # a huge multiplier (1e11) is no error: it saturates
    np.testing.assert_array_equal(qarray.requantize(q, 1e-12, 0, "qint32").int_repr(), np.full((2, 3), 2**31 - 1))
    with pytest.raises(ValueError, match="rounding must be one of"):
        qarray.requantize(q, 0.1, rounding="nearest")
    with pytest.raises(ValueError, match="mode must be one of"):
        qarray.requantize(q, 0.1, mode="exact")
    with pytest.raises(TypeError, match="requantize takes a QArray, got ndarray"):
        qarray.requantize(np.ones(3), 0.1)
    with pytest.raises(ValueError, match="rounding must be one of"):
        qarray.config.rounding = "up"
    with pytest.raises(TypeError, match="no setting 'speed'"):
        with qarray.config.using(speed=1):
            pass


@pytest.mark.parametrize("M", [2.0**29, 2.0**30, 2.0**31, 2.0**32, 2.0**33, 2.0**40, 2.0**90])
def test_multipliers_beyond_2_30_are_exact(M, kernels):
    """Codes -1, 0, 1 at scale M into qint32 at scale 1 and zero point -2**31 (or
    2**31 - 1): in range while M <= 2**32, saturated beyond, never an error."""
    q = QArray.from_int(np.array([-1, 0, 1, 2], np.int32), np.float32(M), 0, "qint32")
    for zp in (-(2**31), 2**31 - 1):
        got = qarray.requantize(q, 1.0, zp, "qint32").int_repr().tolist()
        assert got == [min(max(v * int(M) + zp, -(2**31)), 2**31 - 1) for v in (-1, 0, 1, 2)]


@pytest.mark.parametrize("src", ["qint2", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"])
@pytest.mark.parametrize("dst", ["qint2", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"])
def test_any_dtype_to_any_dtype(src, dst, kernels):
    s, d = qdtype(src), qdtype(dst)
    codes = np.linspace(s.qmin, s.qmax, 50).round().astype(np.int64)
    q = QArray.from_int(codes, 0.5, (s.qmin + s.qmax) // 2, src)
    zp = (d.qmin + d.qmax) // 2
    r = qarray.requantize(q, 0.75, zp, dst)
    want = [min(max(ref_fixed(int(c) - (s.qmin + s.qmax) // 2, 0.5 / 0.75, "half_even") + zp, d.qmin), d.qmax) for c in codes]
    np.testing.assert_array_equal(r.int_repr(), want)
    assert r.dtype is d


def test_float_mode_rounds_after_the_zero_point(kernels):
    """As ONNX QLinearMatMul: rint(0.5 + 1) = 2, where rint(0.5) + 1 would be 1."""
    q = QArray.from_int(np.array([1, 3, 10**9]), 1.0, 0, "qint32")
    r = qarray.requantize(q, 2.0, 1, "qint8", mode="float")
    np.testing.assert_array_equal(r.int_repr(), [2, 2, 127])
    big = QArray.from_int(np.array([2**31 - 1, -(2**31), 0]), 1e20, 0, "qint32")
    np.testing.assert_array_equal(qarray.requantize(big, 1e-15, 0, "qint32", mode="float").int_repr(), [2**31 - 1, -(2**31), 0])
    with pytest.raises(ValueError, match="leaves float32's range"):
        qarray.requantize(big, 1e-30, 0, "qint8", mode="float")


def test_out(kernels):
    q = QArray.from_int(np.arange(-4, 4).reshape(2, 4), 1.0, 0, "qint8")
    out = np.zeros((2, 8), np.int8)
    r = qarray.requantize(q, 2.0, 1, out=out[:, 2:6])  # a non-contiguous view
    assert np.shares_memory(r.data, out)
    # -2 -1.5 -1 -0.5 | 0 0.5 1 1.5, half-even, + 1
    np.testing.assert_array_equal(out[:, 2:6], [[-1, -1, 0, 1], [1, 1, 2, 3]])
    assert not out[:, :2].any() and not out[:, 6:].any()
    full = np.empty((2, 4), np.int8)
    assert qarray.requantize(q, 2.0, 1, out=full).data is full
    with pytest.raises(ValueError, match=r"out must be a numpy array of shape \(2, 4\) and dtype int8"):
        qarray.requantize(q, 2.0, 1, out=np.empty((2, 4), np.int16))


def test_read_only_out_refused(kernels):
    q = QArray.from_int(np.arange(20000) % 100, 1.0, 0, "qint8")
    out = np.empty(20000, np.int8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"requantize: out is read-only; pass a writeable array"):
        qarray.requantize(q, 2.0, 0, out=out)


def test_zero_d_keeps_its_shape(kernels):
    q = QArray.from_int(np.int32(5), 1.0, 0, "qint32")
    r = qarray.requantize(q, 2.0, 1, "qint8")
    assert r.shape == () and r.int_repr().shape == () and int(r.int_repr()) == 3  # 2.5 -> 2, + 1
    out = np.empty((), np.int8)
    assert qarray.requantize(q, 2.0, 0, "qint8", out=out).data is out and int(out) == 2


# -- qarray.config is context-local -----------------------------------------------

TIE = QArray.from_int(np.array([5]), 1.0, 0, "qint32")  # 2.5 at scale 2: half_even 2, half_away 3


def _tie():
    return int(qarray.requantize(TIE, 2.0, 0, "qint8").int_repr()[0])


def test_config_using_is_local_to_its_thread():
    entered, done = threading.Event(), threading.Event()
    inside, seen = [], []

    def a():
        with qarray.config.using(rounding="half_away"):
            inside.append(_tie())
            entered.set()
            done.wait(60)  # stays inside while b runs
            inside.append(qarray.config.rounding)

    def b():
        entered.wait(60)
        seen.extend(_tie() for _ in range(300))  # one thread runs kernels at a time
        done.set()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(), tb.start()
    tb.join(), ta.join()
    assert inside == [3, "half_away"]
    assert seen == [2] * 300
    assert qarray.config.rounding == "half_even"


def test_config_overlapping_blocks_restore():
    def block(**settings):
        with qarray.config.using(**settings):
            yield
            yield qarray.config.rounding

    g1, g2 = block(rounding="half_away"), block(rounding="half_up", mode="float")
    next(g1), next(g2)  # g1 enters, then g2: interleaved, not nested
    assert (qarray.config.rounding, qarray.config.mode) == ("half_up", "float")
    assert next(g1) == "half_up"
    next(g1, None)  # g1 leaves first: g2's settings stay, g1's are gone
    assert (qarray.config.rounding, qarray.config.mode) == ("half_up", "float")
    next(g2), next(g2, None)
    assert (qarray.config.rounding, qarray.config.mode) == ("half_even", "fixed")
    with qarray.config.using(rounding="half_away"):
        with qarray.config.using(rounding="tflite"):
            assert qarray.config.rounding == "tflite"
        assert qarray.config.rounding == "half_away"
    assert qarray.config.rounding == "half_even"


def test_config_assignment_sets_the_default_for_every_thread():
    seen = []
    try:
        qarray.config.rounding = "half_away"
        t = threading.Thread(target=lambda: seen.append(_tie()))
        t.start(), t.join()
        assert seen == [3]
        with qarray.config.using(rounding="half_up"):
            qarray.config.rounding = "tflite"  # inside a block that sets it: until the block ends
            assert qarray.config.rounding == "tflite"
            qarray.config.mode = "fixed"  # a setting the block leaves alone: the default
        assert qarray.config.rounding == "half_away"
    finally:
        qarray.config.rounding = "half_even"
    assert _tie() == 2
    with pytest.raises(TypeError, match="numba must be True or False, got 'no'"):
        qarray.config.numba = "no"
    with pytest.raises(TypeError, match="numba must be True or False, got 1"):
        with qarray.config.using(numba=1):
            pass
    assert qarray.config.numba is True
