"""Every op that requantizes, against an exact rational reference (issue 8, "Done when").

The reference below is written from the contract in DESIGN.md ("Numerics") with
Python integers and ``fractions.Fraction``; it calls none of qarray's arithmetic
(no ``rescale``, ``quantize_multiplier`` or ``plan``). Only the test inputs are
built with qarray (``QArray.from_int``, and ``plan`` / ``make_rq`` to hand a
``Requant`` to a backend primitive, which is what is under test there).

The contract, per element, with ``d`` the exact integer (centred code, product,
accumulator or mean) and ``M`` the float64 multiplier of the op:

* fixed mode: ``M = f * 2**e`` (``math.frexp``), ``m = floor(f * 2**31 + 1/2)``,
  carried to ``2**30`` (``e + 1``) at ``2**31``, ``s = 31 - e``, capped
  (``s > 94``: ``m = 0``; ``s < -3``: ``s = -3``); then ``R(d * m / 2**s)`` with
  the tie rule, ``+ zp_out``, clamped.
* ``rounding="tflite"``: TFLite's caps (``s > 62``: ``m = 0``; ``s < 1``:
  ``s = 1``, ``m = 2**31 - 1``) and gemmlowp's double rounding on int32
  (``SaturatingRoundingDoublingHighMul`` then ``RoundingDivideByPOT``); wider
  integers saturate to int32 first (``rescale``'s docstring), so tflite results
  of accumulators beyond 2**31 are pinned as gemmlowp's, not the exact ones.
* ``mode="float"``: ``rint(float64(d) * float32 multiplier + zp_out)`` in float64,
  clamped (means: ``rint(float64(sum) / count * multiplier + zp_out)``).
* add/sub: each operand ``R((q - zp) * s_q / common)`` onto
  ``common = 2 * max(s_a, s_b) / 2**shift`` (shift 20 / 15 / 28 for 8- / 16- /
  32-bit inputs), never clamped; the exact sum then requantized once with
  ``common / s_out``. mode="float": dequantize, float32 op, quantize.
* averages: ``R(sum / count * m / 2**s)`` exactly, ``(m, s)`` from the non-TFLite
  decomposition (``tflite`` rounds ties away from zero, as TFLite's average pool).

Every test runs on both CPU paths (the ``kernels`` fixture; conftest sends even
tiny arrays through Numba, checked by ``_check_path``). External vectors are
marked with where they come from.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from cuda_host.harness import host, host_lib  # noqa: F401 (fixtures)
from test_cuda import make_rq
from _reference import numpy_and_host, round_rational

DTYPES = ["qint2", "quint2", "qint4", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"]
RULES = ["half_even", "half_away", "half_up", "tflite", "float"]
CODES = {"half_even": 0, "half_away": 1, "half_up": 2, "tflite": 3, "float": None}
HALF = Fraction(1, 2)
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


def _settings(n):
    # the kernels fixture selects one CPU path for the whole test; nothing in it
    # needs resetting between examples
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread: on these tiny arrays handing parts to threads costs more than
    it saves on a busy machine; one thread runs the same compiled kernels."""
    from qarray.backends import _gemm

    n = _gemm.THREADS[0]
    qa.set_num_threads(1)
    yield
    qa.set_num_threads(n)


def _check_path(kernels):
    """The Numba kernels really run under kernels="numba" (and not otherwise)."""
    from qarray.backends import get

    assert (get("numpy")._fast(np.zeros(1, np.int8)) is not None) == (kernels == "numba")


def _kw(rule):
    return {"mode": "float"} if rule == "float" else {"mode": "fixed", "rounding": rule}


# -- the reference -------------------------------------------------------------
def ref_multiplier(M, tflite=False):
    """``(m, s)`` with ``M ~= m / 2**s``, from the definition (TFLite QuantizeMultiplier)."""
    f, e = math.frexp(M)
    m = math.floor(Fraction(f) * 2**31 + HALF)  # round half away (std::round)
    if m == 2**31:
        m, e = 2**30, e + 1
    s = 31 - e
    if tflite:
        if s > 62:
            m, s = 0, 62
        if s < 1:
            m, s = 2**31 - 1, 1
    else:
        if s > 94:
            m, s = 0, 94
        s = max(s, -3)
    return m, s


def ref_gemmlowp(x: int, m: int, s: int) -> int:
    """TFLite's MultiplyByQuantizedMultiplier(x, m, 31 - s): gemmlowp's
    SaturatingRoundingDoublingHighMul then RoundingDivideByPOT, with the input
    saturated to int32 after the left shift (a port of tests/test_requantize.py
    ref_tflite, itself written from the C source)."""
    e = 31 - s
    left, right = max(e, 0), max(-e, 0)
    a = min(max(x * 2**left, I32[0]), I32[1])
    ab = a * m
    num = ab + ((1 << 30) if ab >= 0 else 1 - (1 << 30))
    high = abs(num) // 2**31 * (1 if num >= 0 else -1)  # C division truncates toward zero
    mask = (1 << right) - 1
    return (high >> right) + ((high & mask) > (mask >> 1) + (high < 0))


def ref_scale(d: int, M: float, rule: str) -> int:
    """``R(d * M)`` in fixed mode (unclamped)."""
    if rule == "tflite":
        return ref_gemmlowp(d, *ref_multiplier(M, tflite=True))
    m, s = ref_multiplier(M)
    return round_rational(Fraction(d * m) / Fraction(2) ** s, rule)


def ref_out(d: int, M: float, f, zo: int, lo: int, hi: int, rule: str) -> int:
    """One output integer: fixed (multiplier ``M``) or float (float32 multiplier ``f``)."""
    if rule == "float":
        v = np.rint(np.float64(d) * np.float64(f) + np.float64(zo))
    else:
        v = ref_scale(d, M, rule) + zo
    return int(min(max(v, lo), hi))


def ref_mean(acc: int, count: int, M: float, f, zo: int, lo: int, hi: int, rule: str) -> int:
    """An average: the exact mean ``acc / count`` requantized once."""
    if rule == "float":
        v = np.rint(np.float64(acc) / np.float64(count) * np.float64(f) + np.float64(zo))
    else:
        m, s = ref_multiplier(M)
        v = round_rational(Fraction(acc * m, count) / Fraction(2) ** s, "half_away" if rule == "tflite" else rule) + zo
    return int(min(max(v, lo), hi))


def f32_ratio(*, num=(), den=1.0):
    """The float-mode multiplier: float32 product of ``num`` over float32 ``den``
    (ONNX's ``a_scale * b_scale / y_scale``), or None where it leaves float32."""
    with np.errstate(all="ignore"):
        v = np.float32(1)
        for x in num:
            v = np.float32(v * np.float32(x))
        v = np.float32(v / np.float32(den))
    return float(v) if np.isfinite(v) and v > 0 else None


def expand(p, shape, axis):
    p = np.asarray(p)
    if axis is None or p.ndim == 0:
        return np.broadcast_to(p, shape)
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to(p.reshape(view), shape)


def test_reference_against_published_vectors():
    """The reference itself, on vectors from outside this project."""
    # tensorflow/lite/kernels/internal/quantization_util_test.cc (QuantizeMultiplier*
    # tests): (quantized_multiplier, shift) with shift = 31 - s.
    for M, (m, shift) in [(0.75, (1610612736, 0)), (0.25, (1073741824, -1)), (0.5 - 5e-9, (2147483627, -1)),
                          (0.5 - 1e-10, (1073741824, 0)), (1 - 1e-9, (2147483646, 0)), (1 + 1e-11, (1073741824, 1)),
                          (1.25, (1342177280, 1)), (2 - 1e-9, (2147483647, 1)), (2 - 1e-11, (1073741824, 2)),
                          (2.0**-31, (1073741824, -30)), (2.0**-32, (1073741824, -31))]:
        assert ref_multiplier(M, tflite=True) == (m, 31 - shift)
        assert ref_multiplier(M) == (m, 31 - shift)
    for M in [0.99 * 2.0**-32, 2.0**-33]:  # QuantizeMultiplierUnderflow: 0
        assert ref_multiplier(M, tflite=True)[0] == 0
        assert ref_multiplier(M)[0] != 0  # qarray keeps them (DESIGN: no multiplier too small)
    # ... MultiplyByQuantizedMultiplierInt32 (identical in single- and double-rounding builds)
    for x, M, want in [(10000, 0.00097656, 10), (-10000, 0.00097656, -10), (-(2**31), 0.00001, -21475),
                       (2**31 - 1, 0.00001, 21475)]:
        assert ref_scale(x, M, "tflite") == want
    x = 2**31 - 1  # "maximum possible x and quantized_multiplier", shift -3
    assert ref_gemmlowp(x, 2**31 - 1, 34) == round(Fraction(x * (2**31 - 1), 2**34)) == -ref_gemmlowp(-x, 2**31 - 1, 34)
    # DESIGN.md / _fixed_point.py worked example: M = 0.3, d = 5 -> 1.5000000001 -> 2
    assert ref_multiplier(0.3) == (1288490189, 32) and ref_scale(5, 0.3, "half_even") == 2
    # gemmlowp's tie behaviour (tests/test_requantize.py test_tflite_known_values)
    assert [ref_scale(v, 0.5, "tflite") for v in (-9, -3, 3, 9)] == [-4, -1, 2, 5]
    assert [ref_scale(v, 0.5, r) for r in ("half_even", "half_away", "half_up") for v in (-5, -3, 3, 5)] == \
        [-2, -2, 2, 2, -3, -2, 2, 3, -2, -1, 2, 3]
    # the caps: beyond 2**94 nothing survives; above 2**34 the shift stops at -3
    assert ref_multiplier(2.0**-64 * 0.75) == (0, 94) and ref_multiplier(2.0**40) == (2**30, -3)
    assert ref_multiplier(2.0**30, tflite=True) == (2**31 - 1, 1)


# -- strategies ------------------------------------------------------------------
MANTISSAS = st.one_of(st.sampled_from([1.0, 1.5, 1.25, 1.75]), st.floats(1.0, 2.0, exclude_max=True))


@st.composite
def scales(draw, lo, hi):
    """A float32 scale ``mantissa * 2**e``; equal mantissas make power-of-2 ratios (ties)."""
    return np.float32(draw(MANTISSAS) * 2.0 ** draw(st.integers(lo, hi)))


def zero_points(qd):
    ends = [qd.qmin, qd.qmax, (qd.qmin + qd.qmax) // 2, min(max(0, qd.qmin), qd.qmax)]
    return st.one_of(st.sampled_from(ends), st.integers(qd.qmin, qd.qmax))


def tie_step(M):
    """``k`` such that ``d = u * 2**k`` with odd ``u`` makes ``d * m / 2**s`` a half
    integer (``m = m' * 2**z``, ``m'`` odd: ``d * m / 2**s = u * m' / 2``), or None."""
    m, s = ref_multiplier(M)
    if m == 0:
        return None
    k = s - ((m & -m).bit_length() - 1) - 1
    return k if k >= 0 else None


def draw_code(draw, lo, hi, zp, M=None, land=None):
    """One integer in ``[lo, hi]``: an end, the zero point's neighbourhood, an
    exact tie of ``(d = q - zp) * M``, a value that lands at ``land`` after
    scaling by ``M``, or anything."""
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return lo
    if kind == 1:
        return hi
    if kind == 2:
        return min(max(zp + draw(st.integers(-2, 2)), lo), hi)
    if kind in (3, 4) and M is not None:
        k = tie_step(M)
        if k is not None:
            ulo, uhi = -((zp - lo) // 2**k), (hi - zp) // 2**k
            if ulo <= uhi:
                u = draw(st.integers(ulo, uhi))
                u = u if u % 2 else (u + 1 if u + 1 <= uhi else u - 1)
                if ulo <= u <= uhi and u % 2:
                    return zp + u * 2**k
    if kind == 5 and M is not None and land is not None:
        y = draw(st.integers(*land))
        d = int(Fraction(y) / Fraction(M)) + draw(st.integers(-2, 2))
        return min(max(zp + d, lo), hi)
    return draw(st.integers(lo, hi))


# -- requantize ------------------------------------------------------------------
REQ_CASES = [("qint2", "qint8"), ("qint4", "qint2"), ("qint8", "qint4"), ("quint2", "quint8"), ("quint4", "quint2"),
             ("quint8", "quint4"), ("qint16", "qint16"), ("quint16", "qint16"), ("qint32", "qint32"),
             ("qint32", "quint8")]



def paths(names, cases, on_numba):
    """``cases`` on the generic path, and those in ``on_numba`` on the Numba
    kernels too, for ``pytest.mark.parametrize(names + ",kernels", ...,
    indirect=["kernels"])``. The arithmetic is one source (``rescale``) on both
    paths, and every Numba specialisation costs seconds of compiling in a fresh
    CI run, so the Numba leg takes one case where it takes any: the other test
    files (test_requantize, test_wide, test_memory, ...) hold the Numba kernels
    to the generic path bit for bit over every dtype."""
    rows = []
    for c in cases:
        c = c if isinstance(c, tuple) else (c,)
        for k in ("numba", "generic") if c in on_numba or c[0] in on_numba else ("generic",):
            rows.append(pytest.param(*c, k, id="-".join(map(str, (*c, k)))))
    return dict(argnames=names + ",kernels", argvalues=rows, indirect=["kernels"])


@st.composite
def requantize_cases(draw, d_in, d_out):
    qi, qo = qdtype(d_in), qdtype(d_out)
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    ax_in = draw(st.sampled_from([None, *range(len(shape))]))
    ax_out = draw(st.sampled_from([None, ax_in] if ax_in is not None else [None, *range(len(shape))]))
    n_in = 1 if ax_in is None else shape[ax_in]
    n_out = 1 if ax_out is None else shape[ax_out]
    s_in = [draw(scales(-40, 20)) for _ in range(n_in)]
    # log2 M from 2**-100 to 2**40, often where the input range maps onto the output's
    land = qo.bits - qi.bits
    k = [draw(st.one_of(st.integers(-100, 40), st.integers(land - 3, land + 3))) for _ in range(n_out)]
    s_out = [np.float32(s_in[i % n_in] / 2.0 ** k[i] * draw(st.sampled_from([1.0, 1.0, 1.5, 0.75]))) for i in range(n_out)]
    zi = [draw(zero_points(qi)) for _ in range(n_in)]
    zo = [draw(zero_points(qo)) for _ in range(n_out)]
    S_in, S_out = expand(np.array(s_in), shape, ax_in), expand(np.array(s_out), shape, ax_out)
    Zi, Zo = expand(np.array(zi), shape, ax_in), expand(np.array(zo), shape, ax_out)
    q = np.empty(shape, np.int64)
    for idx in np.ndindex(shape):
        M = float(S_in[idx]) / float(S_out[idx])
        q[idx] = draw_code(draw, qi.qmin, qi.qmax, int(Zi[idx]), M, (qo.qmin - int(Zo[idx]), qo.qmax - int(Zo[idx])))
    return q, (np.array(s_in), np.array(zi, np.int32), ax_in), (np.array(s_out), np.array(zo, np.int32), ax_out)


def _params(p, axis):
    s, z, _ = p
    return (s, z) if axis is not None else (s[0], z[0])


@pytest.mark.parametrize(**paths("d_in,d_out", REQ_CASES, [("qint32", "quint8")]))
@_settings(50)
@given(data=st.data())
def test_requantize(d_in, d_out, kernels, data):
    """qarray.requantize: per-tensor and per-axis in and out, every rounding."""
    _check_path(kernels)
    q, pin, pout = data.draw(requantize_cases(d_in, d_out))
    qi, qo = qdtype(d_in), qdtype(d_out)
    shape = q.shape
    S_in, Zi = expand(pin[0], shape, pin[2]), expand(pin[1], shape, pin[2])
    S_out, Zo = expand(pout[0], shape, pout[2]), expand(pout[1], shape, pout[2])
    x = QArray.from_int(q.astype(qi.storage), *_params(pin, pin[2]), d_in, axis=pin[2])
    for rule in RULES:
        want = np.empty(shape, np.int64)
        ok = True
        for idx in np.ndindex(shape):
            f = f32_ratio(num=[S_in[idx]], den=S_out[idx])
            ok = ok and (rule != "float" or f is not None)
            want[idx] = ref_out(int(q[idx]) - int(Zi[idx]), float(S_in[idx]) / float(S_out[idx]), f or 0,
                                int(Zo[idx]), qo.qmin, qo.qmax, rule)
        call = lambda: qa.requantize(x, *_params(pout, pout[2]), d_out, axis=pout[2], **_kw(rule))  # noqa: E731
        if not ok:
            with pytest.raises(ValueError, match="leaves float32's range"):
                call()
            continue
        got = call()
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=rule)


# -- the backend primitive on int64 accumulators ----------------------------------
PRIM_OUT = ["qint32", "qint8", "quint16"]
EXTREMES = [I64[1], -I64[1], I64[0] + 1, 2**62, -(2**62), 2**62 - 1, 2**40, -(2**40), 0]


@st.composite
def multipliers(draw, lo=-100, hi=40):
    """A float64 multiplier from ``2**lo`` to ``2**hi`` (log-uniform), often a power of 2."""
    mant = draw(st.one_of(st.sampled_from([1.0, 1.5, 1.0 + 2.0**-52]), st.floats(1.0, 2.0, exclude_max=True)))
    return mant * 2.0 ** draw(st.integers(lo, hi))


@st.composite
def int64_cases(draw, qo):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    axis = draw(st.sampled_from([None, *range(len(shape))]))
    n = 1 if axis is None else shape[axis]
    M = [draw(multipliers()) for _ in range(n)]
    zo = [draw(zero_points(qo)) for _ in range(n)]
    Mx, Zo = expand(np.array(M), shape, axis), expand(np.array(zo), shape, axis)
    d = np.empty(shape, np.int64)
    for idx in np.ndindex(shape):
        if draw(st.integers(0, 3)) == 0:
            d[idx] = draw(st.sampled_from(EXTREMES))
        else:  # up to +-2**62, ties and values that land inside the output
            d[idx] = draw_code(draw, -(2**62), 2**62, 0, float(Mx[idx]), (qo.qmin - int(Zo[idx]), qo.qmax - int(Zo[idx])))
    return d, axis, np.array(M), np.array(zo, np.int64)


def _ref_int64(d, axis, M, zo, qo, rule):
    Mx, Zo = expand(M, d.shape, axis), expand(zo, d.shape, axis)
    want = np.empty(d.shape, np.int64)
    for idx in np.ndindex(d.shape):
        want[idx] = ref_out(int(d[idx]), float(Mx[idx]), f32_ratio(num=[Mx[idx]]), int(Zo[idx]), qo.qmin, qo.qmax, rule)
    return want


@pytest.mark.parametrize(**paths("d_out", PRIM_OUT, ["qint32"]))
@_settings(80)
@given(data=st.data())
def test_requantize_primitive_int64(d_out, kernels, data):
    """The backend's requantize on int64 accumulators up to +-2**62 and +-(2**63 - 1),
    multipliers 2**-100 to 2**40, per-tensor and per-axis, through ``plan``."""
    from qarray._fixed_point import plan
    from qarray.backends import get

    _check_path(kernels)
    qo = qdtype(d_out)
    d, axis, M, zo = data.draw(int64_cases(qo))
    for rule in RULES:
        mode, rounding = ("float", "half_even") if rule == "float" else ("fixed", rule)
        rq = plan([M if axis is not None else M[0]], np.float32(1.0), 0, zo if axis is not None else zo[0], qo,
                  mode, rounding, axis=axis)
        got = get("numpy").requantize(d, rq)
        assert got.dtype == qo.storage
        np.testing.assert_array_equal(got, _ref_int64(d, axis, M, zo, qo, rule), err_msg=rule)


# -- add / sub / mul -----------------------------------------------------------------
BIN_CASES = [("qint2", "quint2", "qint8"), ("qint4", "quint4", "quint4"), ("qint8", "quint8", "qint8"),
             ("quint8", "qint16", "quint16"), ("quint16", "qint16", "qint16"), ("qint32", "qint8", "qint32"),
             ("qint32", "qint32", "quint8"), ("qint32", "quint16", "qint16")]


@st.composite
def binary_cases(draw, da, db, dout, op):
    a, b, o = qdtype(da), qdtype(db), qdtype(dout)
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    b_shape = draw(st.sampled_from([shape, shape[-1:], (1,)]))
    s_a = draw(scales(-30, 10))
    far = draw(st.integers(0, 4)) == 0  # scales far apart: one operand (nearly) vanishes
    s_b = np.float32(s_a * (draw(MANTISSAS) if draw(st.booleans()) else 1.0)
                     * 2.0 ** draw(st.integers(-70, 70) if far else st.integers(-6, 6)))
    if op == "mul":
        base, land = float(s_a) * float(s_b), a.bits + b.bits - o.bits
    else:
        base, land = max(float(s_a), float(s_b)), max(a.bits, b.bits) + 1 - o.bits
    s_out = base * 2.0 ** draw(st.one_of(st.integers(land - 3, land + 3), st.integers(-40, 40)))
    s_out = np.float32(min(max(s_out, 2.0**-120), 2.0**120) * draw(st.sampled_from([1.0, 1.0, 1.5, 0.75, 1.1])))
    za, zb, zo = draw(zero_points(a)), draw(zero_points(b)), draw(zero_points(o))
    common = 2.0 * max(float(s_a), float(s_b)) / 2.0 ** {8: 20, 16: 15, 32: 28}[max(8, a.bits, b.bits)]
    qa_ = np.array([draw_code(draw, a.qmin, a.qmax, za, float(s_a) / common if op != "mul" else None)
                    for _ in range(math.prod(shape))]).reshape(shape)
    qb_ = np.array([draw_code(draw, b.qmin, b.qmax, zb, float(s_b) / common if op != "mul" else None)
                    for _ in range(math.prod(b_shape))]).reshape(b_shape)
    return qa_, qb_, (s_a, za), (s_b, zb), (s_out, zo), draw(st.booleans())


def _dequant32(q, s, z):
    return (np.asarray(q, np.int64) - z).astype(np.float32) * np.float32(s)


def _ref_binary(op, qa_, qb_, pa, pb, pout, qa_d, qb_d, qo, rule, relu):
    """The op's contract, element by element (add/sub: two steps, each exact)."""
    (s_a, za), (s_b, zb), (s_out, zo) = pa, pb, pout
    lo = max(qo.qmin, zo) if relu else qo.qmin
    A, B = np.broadcast_arrays(np.asarray(qa_, np.int64), np.asarray(qb_, np.int64))
    if rule == "float":  # dequantize, the float32 op, quantize (float32 division, half even)
        with np.errstate(over="ignore"):
            fa, fb = _dequant32(A, s_a, za), _dequant32(B, s_b, zb)
            y = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op](fa, fb)
            r = np.rint(y / np.float32(s_out)).astype(np.float64) + zo
        return np.clip(r, lo, qo.qmax).astype(np.int64)
    want = np.empty(A.shape, np.int64)
    if op == "mul":
        M = float(s_a) * float(s_b) / float(s_out)
        for idx in np.ndindex(A.shape):
            want[idx] = ref_out((int(A[idx]) - za) * (int(B[idx]) - zb), M, 0, zo, lo, qo.qmax, rule)
        return want
    common = 2.0 * max(float(s_a), float(s_b)) / 2.0 ** {8: 20, 16: 15, 32: 28}[max(8, qa_d.bits, qb_d.bits)]
    sign = 1 if op == "add" else -1
    for idx in np.ndindex(A.shape):
        x = ref_scale(int(A[idx]) - za, float(s_a) / common, rule)
        y = ref_scale(int(B[idx]) - zb, float(s_b) / common, rule)
        want[idx] = ref_out(x + sign * y, common / float(s_out), 0, zo, lo, qo.qmax, rule)
    return want


def _mul_fits(qa_, qb_, a, b, za, zb):
    """mul's documented check: products within int64, from the dtypes or else the data."""
    def reach(lo, hi, z):
        return max(z - lo, hi - z)
    if reach(a.qmin, a.qmax, za) * reach(b.qmin, b.qmax, zb) < 2**63:
        return True
    return reach(int(qa_.min()), int(qa_.max()), za) * reach(int(qb_.min()), int(qb_.max()), zb) < 2**63


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@pytest.mark.parametrize(**paths("da,db,dout", BIN_CASES, [("qint8", "quint8", "qint8")]))
@_settings(25)
@given(data=st.data())
def test_add_sub_mul(op, da, db, dout, kernels, data):
    """add/sub (two-step contract) and mul (exact products, one rounding), with
    broadcasting, a fused ReLU, zero points at both ends, every rounding."""
    _check_path(kernels)
    a, b, o = qdtype(da), qdtype(db), qdtype(dout)
    qa_, qb_, pa, pb, pout, relu = data.draw(binary_cases(da, db, dout, op))
    x = QArray.from_int(qa_.astype(a.storage), *pa, da)
    y = QArray.from_int(qb_.astype(b.storage), *pb, db)
    fn = getattr(qa, op)
    for rule in RULES:
        if rule == "tflite" and op != "mul" and 32 in (a.bits, b.bits):
            continue  # operands clamped to int32: see test_add_tflite_qint32_operands_are_not_clamped
        call = lambda: fn(x, y, scale=pout[0], zero_point=pout[1], dtype=dout, relu=relu, **_kw(rule))  # noqa: E731
        if op == "mul" and rule != "float" and not _mul_fits(qa_, qb_, a, b, pa[1], pb[1]):
            with pytest.raises(ValueError, match="beyond int64"):
                call()
            continue
        # float mode: a float32 result beyond 3.4e38 is inf and saturates (the contract),
        # with no warning (filterwarnings=error would raise it)
        got = call()
        assert got.data.dtype == o.storage
        np.testing.assert_array_equal(got.int_repr(), _ref_binary(op, qa_, qb_, pa, pb, pout, a, b, o, rule, relu),
                                      err_msg=rule)


def test_add_tflite_qint32_operands_are_refused_not_clamped(kernels):
    q = QArray.from_int(np.array([2**31 - 1, 100000, -(2**31), 7, 8], np.int32), 1.0, 0, "qint32")
    zero = QArray.from_int(np.zeros(5, np.int32), 1.0, 0, "qint32")
    # TFLite's add shifts operands left in int32: for 32-bit inputs that clamped
    # them ([8, 8, -8, 7, 8]); now a clear error, and every other rounding is exact
    with pytest.raises(ValueError, match=r"add: rounding='tflite' follows TFLite's add, which takes inputs of "
                                         r"16 bits or less; got qint32 and qint32: use another rounding"):
        qa.add(q, zero, scale=1.0, zero_point=0, dtype="qint32", rounding="tflite")
    got = qa.add(q, zero, scale=1.0, zero_point=0, dtype="qint32", rounding="half_away").int_repr()
    np.testing.assert_array_equal(got, q.int_repr())


# -- cat -------------------------------------------------------------------------------
# (storage pairs shared with test_requantize: each new one is a Numba compile)
@pytest.mark.parametrize(**paths("d_ins,d_out", [(["qint2", "qint4", "qint8", "qint32"], "qint8"),
                                                (["quint2", "quint4", "quint8"], "quint8"),
                                                (["qint16", "quint16"], "qint16"), (["qint32", "qint32"], "qint32")],
                                 []))
@_settings(40)
@given(data=st.data())
def test_cat(d_ins, d_out, kernels, data):
    """cat requantizes each input (per-tensor or per-axis) to the output's parameters."""
    _check_path(kernels)
    qo = qdtype(d_out)
    ndim = data.draw(st.integers(1, 2))
    axis = data.draw(st.integers(0, ndim - 1))
    s_out, zo = data.draw(scales(-20, 10)), data.draw(zero_points(qo))
    parts, want = [], {r: [] for r in RULES}
    for name in d_ins:
        qi = qdtype(name)
        shape = [2] * ndim
        shape[axis] = data.draw(st.integers(1, 3))
        shape = tuple(shape)
        pax = data.draw(st.sampled_from([None, *range(ndim)]))
        n = 1 if pax is None else shape[pax]
        if name == d_out and pax is None and data.draw(st.booleans()):
            s_in, zi = [s_out], [zo]
        else:
            land = qo.bits - qi.bits
            s_in = [np.float32(s_out * 2.0 ** data.draw(st.one_of(st.integers(land - 3, land + 3), st.integers(-50, 30)))
                               * data.draw(st.sampled_from([1.0, 1.5, 1.3]))) for _ in range(n)]
            zi = [data.draw(zero_points(qi)) for _ in range(n)]
        # the same dtype and parameters: joined as it is, not requantized (with
        # rounding="tflite" that differs: M = 1 is 2**30 / 2**30, a left shift
        # by 1 that saturates |q - zp| >= 2**30 as gemmlowp does)
        same = name == d_out and pax is None and s_in[0] == s_out and zi[0] == zo
        S, Z = expand(np.array(s_in), shape, pax), expand(np.array(zi), shape, pax)
        q = np.empty(shape, np.int64)
        for idx in np.ndindex(shape):
            q[idx] = draw_code(data.draw, qi.qmin, qi.qmax, int(Z[idx]), float(S[idx]) / float(s_out),
                               (qo.qmin - zo, qo.qmax - zo))
        parts.append(QArray.from_int(q.astype(qi.storage), np.array(s_in) if pax is not None else s_in[0],
                                     np.array(zi, np.int32) if pax is not None else zi[0], name, axis=pax))
        for rule in RULES:
            w = np.empty(shape, np.int64)
            for idx in np.ndindex(shape):
                f = f32_ratio(num=[S[idx]], den=s_out)
                assert f is not None
                w[idx] = ref_out(int(q[idx]) - int(Z[idx]), float(S[idx]) / float(s_out), f, zo, qo.qmin, qo.qmax, rule)
            want[rule].append(q if same else w)
    for rule in RULES:
        got = qa.cat(parts, axis, scale=s_out, zero_point=zo, dtype=d_out, **_kw(rule))
        np.testing.assert_array_equal(got.int_repr(), np.concatenate(want[rule], axis), err_msg=rule)


# -- matmul / linear / conv2d ---------------------------------------------------------------
MM_CASES = [("qint2", "quint4", "qint8"), ("quint2", "qint8", "quint8"), ("qint4", "qint4", "qint16"),
            ("quint4", "quint2", "qint32"), ("qint8", "qint2", "quint4"), ("quint8", "qint8", "qint16")]


def _bias_ints(bias, s_x, s_w):
    """linear/conv2d's float bias: ``rint(float32(bias) / (float32(s_x) * float32(s_w)))``."""
    if bias is None:
        return 0
    with np.errstate(all="ignore"):
        return np.rint(np.float32(bias) / (np.float32(s_x) * np.float32(s_w))).astype(np.int64)


def _ref_acc_out(acc, s_x, s_w, pout, qo, rule, relu, axis):
    """Requantize exact accumulators ``acc`` (object ints), output channel along ``axis``."""
    s_out, zo = pout
    lo = max(qo.qmin, zo) if relu else qo.qmin
    want = np.empty(acc.shape, np.int64)
    for idx in np.ndindex(acc.shape):
        sw = s_w[idx[axis]]
        want[idx] = ref_out(int(acc[idx]), float(s_x) * float(sw) / float(s_out),
                            f32_ratio(num=[s_x, sw], den=s_out) or 0, zo, lo, qo.qmax, rule)
    return want


@st.composite
def weight_params(draw, qw, n, per_channel):
    s_w = [draw(scales(-12, 2)) for _ in range(n if per_channel else 1)]
    zw = [draw(zero_points(qw)) for _ in range(n if per_channel else 1)]
    return np.array(s_w * (1 if per_channel else n)), np.array(zw * (1 if per_channel else n), np.int32)


def _weight(codes, s_w, zw, name, per_channel, axis):
    if per_channel:
        return QArray.from_int(codes, s_w, zw, name, axis=axis)
    return QArray.from_int(codes, s_w[0], zw[0], name)


@pytest.mark.parametrize(**paths("dx,dw,dout", MM_CASES, []))
@_settings(40)
@given(data=st.data())
def test_linear_and_matmul(dx, dw, dout, kernels, data):
    """linear (w per-tensor or per-channel along axis 0, float bias or none, ReLU)
    and matmul (b per-channel along its last axis) on extreme codes."""
    _check_path(kernels)
    qx, qw, qo = qdtype(dx), qdtype(dw), qdtype(dout)
    n, k, o = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 40)), data.draw(st.integers(1, 4))
    per_channel = data.draw(st.booleans())
    s_x, zx = data.draw(scales(-12, 2)), data.draw(zero_points(qx))
    s_w, zw = data.draw(weight_params(qw, o, per_channel))
    x = np.array([[draw_code(data.draw, qx.qmin, qx.qmax, zx) for _ in range(k)] for _ in range(n)])
    w = np.array([[draw_code(data.draw, qw.qmin, qw.qmax, int(zw[j])) for _ in range(k)] for j in range(o)])
    land = qx.bits + qw.bits + k.bit_length() - 1 - qo.bits
    s_out = np.float32(float(s_x) * float(s_w[0]) * 2.0 ** data.draw(st.one_of(st.integers(land - 3, land + 2),
                                                                                 st.integers(-20, 30)))
                       * data.draw(st.sampled_from([1.0, 1.0, 1.5, 0.7])))
    zo = data.draw(zero_points(qo))
    relu = data.draw(st.booleans())
    one_d = n == 1 and data.draw(st.booleans())  # linear of a vector
    bias = None
    if data.draw(st.booleans()):
        acc_scale = np.float32(s_x) * np.float32(s_w)
        bias = (np.array([data.draw(st.integers(-(2**20), 2**20)) for _ in range(o)]) * acc_scale
                * np.float32(data.draw(st.sampled_from([1.0, 0.5, 1.25, 1.0000001])))).astype(np.float32)
    xq = QArray.from_int(x.astype(qx.storage), s_x, zx, dx)
    wq = _weight(w.astype(qw.storage), s_w, zw, dw, per_channel, 0)
    bq = _weight(np.ascontiguousarray(w.T).astype(qw.storage), s_w, zw, dw, per_channel, 1)
    acc = (x.astype(object) - zx) @ (w.astype(object) - zw.astype(np.int64)[:, None]).T  # Python ints
    acc_b = acc + _bias_ints(bias, s_x, s_w)
    for rule in RULES:
        kw = dict(scale=s_out, zero_point=zo, dtype=dout, relu=relu, **_kw(rule))
        want = _ref_acc_out(acc_b, s_x, s_w, (s_out, zo), qo, rule, relu, 1)
        got = qa.linear(xq if not one_d else xq.reshape(-1), wq, bias, **kw)
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want[0] if one_d else want, err_msg=f"linear {rule}")
        want = _ref_acc_out(acc, s_x, s_w, (s_out, zo), qo, rule, relu, 1)
        np.testing.assert_array_equal(qa.matmul(xq, bq, **kw).int_repr(), want, err_msg=f"matmul {rule}")


def test_linear_long_k_extreme_codes(kernels):
    """K = 2**18 products of extreme codes: accumulators near 2**34, per-channel
    weights, an output scale that makes row 0's accumulators exact ties."""
    _check_path(kernels)
    k = 2**18
    xc = np.full((2, k), 255, np.uint8)
    xc[1, ::2] = 0  # row 1: half the codes at the other end
    x = QArray.from_int(xc, 1.0, 0, "quint8")
    codes = np.empty((4, k), np.int8)
    codes[0], codes[1], codes[2], codes[3] = -128, 127, -128, 127
    codes[3, 1::3] = -128
    s_w = np.array([1.0, 1.0, 0.5, 2.0**-10], np.float32)
    zw = np.array([127, -128, -128, 0], np.int32)
    w = QArray.from_int(codes, s_w, zw, "qint8", axis=0)
    acc = xc.astype(object) @ (codes.astype(object) - zw.astype(np.int64)[:, None]).T
    assert acc[0, 0] == -255 * 255 * k and max(abs(int(v)) for v in acc.flat) > 2**33.9
    s_out = np.float32(2.0**19)  # -255 * 255 * 2**18 / 2**19 = -32512.5, a tie inside qint16
    ties = {"half_even": [-32512, 32512], "half_away": [-32513, 32513], "half_up": [-32512, 32513],
            "float": [-32512, 32512],  # rint: half even
            "tflite": [-4096, 4096]}  # gemmlowp saturates the accumulator to int32 first
    for rule in RULES:
        for dout, zo in [("qint16", 0), ("qint16", -32768), ("qint32", 2**31 - 1), ("quint8", 0)]:
            qo = qdtype(dout)
            got = qa.linear(x, w, scale=s_out, zero_point=zo, dtype=dout, **_kw(rule)).int_repr()
            want = _ref_acc_out(acc, np.float32(1.0), s_w, (s_out, zo), qo, rule, False, 1)
            np.testing.assert_array_equal(got, want, err_msg=f"{rule} {dout} {zo}")
            if dout == "qint16" and zo == 0:
                assert list(got[0, :2]) == ties[rule], rule


def _ref_conv(x, zx, w, zw, stride, padding, dilation, groups):
    """Exact ``sum (x - zx) * (w - zw)`` over each window, in Python ints (NCHW, OIHW)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    xp = np.full((n, c, h + 2 * ph, wd + 2 * pw), zx, object)
    xp[:, :, ph:ph + h, pw:pw + wd] = x.astype(object)
    xp = xp - zx
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    wc = w.astype(object) - zw.astype(np.int64)[:, None, None, None]
    og = o // groups
    out = np.zeros((n, o, oh, ow), object)
    for b in range(n):
        for oc in range(o):
            g = oc // og
            for i in range(oh):
                for j in range(ow):
                    win = xp[b, g * cg:(g + 1) * cg, i * sh: i * sh + dh * (kh - 1) + 1: dh,
                             j * sw: j * sw + dw * (kw - 1) + 1: dw]
                    out[b, oc, i, j] = int((win * wc[oc]).sum())
    return out


@pytest.mark.parametrize(**paths("dx,dw,dout", MM_CASES, []))
@_settings(25)
@given(data=st.data())
def test_conv2d(dx, dw, dout, kernels, data):
    """conv2d: groups, stride, padding (the input's zero point), dilation,
    per-channel weights, bias, ReLU, every rounding."""
    _check_path(kernels)
    qx, qw, qo = qdtype(dx), qdtype(dw), qdtype(dout)
    groups = data.draw(st.sampled_from([1, 1, 2]))
    cg, og = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    c, o = cg * groups, og * groups
    kh, kw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    stride = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)))
    dilation = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)))
    padding = (data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1)))
    h = data.draw(st.integers(max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]), 5))
    wd = data.draw(st.integers(max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]), 5))
    n = data.draw(st.integers(1, 2))
    per_channel = data.draw(st.booleans())
    s_x, zx = data.draw(scales(-12, 2)), data.draw(zero_points(qx))
    s_w, zw = data.draw(weight_params(qw, o, per_channel))
    x = np.array([draw_code(data.draw, qx.qmin, qx.qmax, zx) for _ in range(n * c * h * wd)]).reshape(n, c, h, wd)
    w = np.array([draw_code(data.draw, qw.qmin, qw.qmax, int(zw[j])) for j in range(o) for _ in range(cg * kh * kw)])
    w = w.reshape(o, cg, kh, kw)
    land = qx.bits + qw.bits + (cg * kh * kw).bit_length() - 1 - qo.bits
    s_out = np.float32(float(s_x) * float(s_w[0]) * 2.0 ** data.draw(st.one_of(st.integers(land - 3, land + 2),
                                                                                 st.integers(-20, 30)))
                       * data.draw(st.sampled_from([1.0, 1.0, 1.5, 0.7])))
    zo, relu = data.draw(zero_points(qo)), data.draw(st.booleans())
    bias = None
    if data.draw(st.booleans()):
        bias = (np.array([data.draw(st.integers(-5000, 5000)) for _ in range(o)])
                * np.float32(s_x) * np.float32(s_w) * np.float32(1.5)).astype(np.float32)
    xq = QArray.from_int(x.astype(qx.storage), s_x, zx, dx)
    wq = _weight(w.astype(qw.storage), s_w, zw, dw, per_channel, 0)
    acc = _ref_conv(x, zx, w, zw, stride, padding, dilation, groups)
    acc = acc + np.asarray(_bias_ints(bias, s_x, s_w), object).reshape(-1, 1, 1) if bias is not None else acc
    for rule in RULES:
        got = qa.conv2d(xq, wq, bias, stride, padding, dilation, groups, scale=s_out, zero_point=zo, dtype=dout,
                        relu=relu, **_kw(rule))
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), _ref_acc_out(acc, s_x, s_w, (s_out, zo), qo, rule, relu, 1),
                                      err_msg=rule)


# -- sum, mean, avg_pool2d, adaptive_avg_pool2d -------------------------------------------
@st.composite
def reduce_cases(draw, name, ndim_lo=1, ndim_hi=3):
    qi = qdtype(name)
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim_lo, max_size=ndim_hi)))
    zi = draw(zero_points(qi))
    s_in = draw(scales(-20, 20))
    q = np.array([draw_code(draw, qi.qmin, qi.qmax, zi) for _ in range(math.prod(shape))]).reshape(shape)
    if draw(st.integers(0, 2)) == 0:  # many values at one end: sums of qint32 codes reach 2**40
        q = np.broadcast_to(q, (draw(st.sampled_from([64, 256])),) + shape)
        q = np.ascontiguousarray(q)
        q.reshape(-1)[: q.size // 2] = qi.qmax if qi.qmax - zi >= zi - qi.qmin else qi.qmin  # the far end
    return q, s_in, zi


def _out_params(draw, qi, qo, s_in, width):
    """Output parameters that land inside (and sometimes far off)."""
    land = width - qo.bits
    s_out = np.float32(float(s_in) * 2.0 ** draw(st.one_of(st.integers(land - 3, land + 2), st.integers(-28, 40)))
                       * draw(st.sampled_from([1.0, 1.0, 1.5, 0.75, 1.1])))
    return s_out, draw(zero_points(qo))


@pytest.mark.parametrize(**paths("name,dout", list(zip(DTYPES, ["qint8", "quint8", "qint16", "qint32", "qint32",
                                                                "quint16", "qint8", "qint32", "qint32"])),
                                 [("qint32", "qint32")]))
@_settings(25)
@given(data=st.data())
def test_sum_and_mean(name, dout, kernels, data):
    """sum (the exact accumulator requantized) and mean (the exact mean rounded
    once) over any axes; accumulators up to 2**40 (qint32 codes at one end)."""
    _check_path(kernels)
    qi, qo = qdtype(name), qdtype(dout)
    q, s_in, zi = data.draw(reduce_cases(name))
    axes = data.draw(st.sampled_from([None, 0, -1, (0, -1)] if q.ndim > 1 else [None, 0]))
    keepdims = data.draw(st.booleans())
    red = tuple(range(q.ndim)) if axes is None else tuple(a % q.ndim for a in (axes if isinstance(axes, tuple) else (axes,)))
    count = math.prod(q.shape[a] for a in red)
    acc = (q.astype(object) - zi).sum(axis=red, keepdims=keepdims)
    acc = np.asarray(acc, object)
    x = QArray.from_int(q.astype(qi.storage), s_in, zi, name)
    s_out, zo = _out_params(data.draw, qi, qo, s_in, qi.bits + count.bit_length())
    sm, zm = _out_params(data.draw, qi, qo, s_in, qi.bits)
    default_mean = data.draw(st.booleans())
    for rule in RULES:
        want = np.empty(acc.shape, np.int64)
        for idx in np.ndindex(acc.shape):
            want[idx] = ref_out(int(acc[idx]), float(s_in) / float(s_out), f32_ratio(num=[s_in], den=s_out),
                                zo, qo.qmin, qo.qmax, rule)
        got = qa.sum(x, axes, keepdims, scale=s_out, zero_point=zo, dtype=dout, **_kw(rule))
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=f"sum {rule}")
        # mean: the input's parameters by default, else others
        m_s, m_z, m_d = (s_in, zi, qi) if default_mean else (sm, zm, qo)
        M = float(s_in) / float(m_s)
        if rule != "float" and ref_multiplier(M)[1] < 1:
            with pytest.raises(ValueError, match="too large for an exact average"):
                qa.mean(x, axes, keepdims, scale=m_s, zero_point=m_z, dtype=m_d.name, **_kw(rule))
            continue
        want = np.empty(acc.shape, np.int64)
        for idx in np.ndindex(acc.shape):
            want[idx] = ref_mean(int(acc[idx]), count, M, f32_ratio(num=[s_in], den=m_s), m_z, m_d.qmin, m_d.qmax, rule)
        kw = {} if default_mean else dict(scale=m_s, zero_point=m_z, dtype=m_d.name)
        got = qa.mean(x, axes, keepdims, **kw, **_kw(rule))
        assert got.data.dtype == m_d.storage and got.dtype is m_d
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=f"mean {rule}")


@st.composite
def mean_near_ties(draw):
    """``count`` qint32 codes whose sum ``acc`` has ``acc * m = (2j + 1) * count *
    2**(s - 1) + t`` with ``|t| < count``: the exact mean times ``m / 2**s`` is a
    half (t = 0) or misses one by less than the last bit, where only the
    remainder of the division by ``count`` decides. ``m`` odd and prime to
    ``count``, so ``j`` exists for every ``t`` (a modular inverse)."""
    count = draw(st.sampled_from([2, 3, 5, 6, 7, 9]))
    s_in = draw(scales(-10, 10))
    s_out = np.float32(float(s_in) / draw(st.floats(0.25, 1.0, exclude_max=True)))
    M = float(s_in) / float(s_out)
    m, s = ref_multiplier(M)
    assume(m % 2 == 1 and math.gcd(m, count) == 1 and 1 <= s <= 32)
    t = draw(st.integers(-(count - 1), count - 1))
    c = count * 2 ** (s - 1)
    r = (-t * pow(c, -1, m)) % m
    r = r if r % 2 else r + m  # odd, the same residue (m is odd)
    assert (r * c + t) % m == 0
    sign = draw(st.sampled_from([1, -1]))
    acc = sign * ((r * c + t) // m)
    zi = I32[0] if sign > 0 else I32[1]  # the far end: |q - zp| up to 2**32 - 1
    parts = [abs(acc) // count] * count
    parts[0] += abs(acc) - sum(parts)
    d = [sign * v for v in parts]
    assume(max(parts) < 2**32)  # |q - zp| of a qint32 code reaches 2**32 - 1 at most
    return np.array([zi + v for v in d], np.int64), s_in, s_out, zi, acc, sign * t


@_settings(100)
@given(data=st.data())
def test_mean_near_ties(kernels, data):
    """mean / avg_pool2d / adaptive_avg_pool2d where the exact mean sits on, or
    within the last bit of, a half: the rounding must see the remainder of the
    division by the count."""
    _check_path(kernels)
    q, s_in, s_out, zi, acc, t = data.draw(mean_near_ties())
    count = q.size
    x = QArray.from_int(q.astype(np.int32).reshape(1, 1, 1, count), s_in, zi, "qint32")
    M = float(s_in) / float(s_out)
    m, s = ref_multiplier(M)
    v = Fraction(acc * m, count * 2**s)
    assert (v - math.floor(v) - HALF) * count * 2**s == t  # on a half, or off it by t / count of the last bit
    for rule in RULES:
        want = ref_mean(acc, count, M, f32_ratio(num=[s_in], den=s_out), 0, *I32, rule)
        kw = dict(scale=s_out, zero_point=0, dtype="qint32", **_kw(rule))
        assert int(qa.mean(x, **kw).int_repr()) == want, rule
        assert int(qa.avg_pool2d(x, (1, count), **kw).int_repr()[0, 0, 0, 0]) == want, rule
        assert int(qa.adaptive_avg_pool2d(x, 1, **kw).int_repr()[0, 0, 0, 0]) == want, rule


def _ref_pool(q, zi, windows, out_shape):
    """``(sums, counts)`` of ``q - zi`` over each window ``(h0, h1, w0, w1, count)``."""
    n, c = q.shape[:2]
    sums = np.empty((n, c) + out_shape, object)
    counts = np.empty(out_shape, object)
    d = q.astype(object) - zi
    for (i, j), (h0, h1, w0, w1, cnt) in windows.items():
        counts[i, j] = cnt
        for b in range(n):
            for ch in range(c):
                sums[b, ch, i, j] = int(d[b, ch, max(h0, 0):h1, max(w0, 0):w1].sum())
    return sums, counts


@pytest.mark.parametrize(**paths("name", DTYPES, []))
@_settings(25)
@given(data=st.data())
def test_avg_pools(name, kernels, data):
    """avg_pool2d (padding, count_include_pad, stride) and adaptive_avg_pool2d:
    each window's exact mean rounded once, default or given output parameters."""
    _check_path(kernels)
    qi = qdtype(name)
    n, c, h, w = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)),
                  data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5)))
    zi, s_in = data.draw(zero_points(qi)), data.draw(scales(-20, 20))
    q = np.array([draw_code(data.draw, qi.qmin, qi.qmax, zi) for _ in range(n * c * h * w)]).reshape(n, c, h, w)
    x = QArray.from_int(q.astype(qi.storage), s_in, zi, name)
    three = data.draw(st.booleans()) and n == 1
    xin = QArray.from_int(q[0].astype(qi.storage), s_in, zi, name) if three else x
    # avg_pool2d windows
    kh, kw = data.draw(st.integers(1, h)), data.draw(st.integers(1, w))
    ph, pw = data.draw(st.integers(0, kh // 2)), data.draw(st.integers(0, kw // 2))
    sh, sw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    include = data.draw(st.booleans())
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    win = {}
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * sh - ph, j * sw - pw
            real = (min(h0 + kh, h) - max(h0, 0)) * (min(w0 + kw, w) - max(w0, 0))
            win[i, j] = (h0, h0 + kh, w0, w0 + kw, kh * kw if include else real)
    pooled = _ref_pool(q, zi, win, (oh, ow))
    # adaptive windows: [floor(i * H / OH), ceil((i + 1) * H / OH))
    ah, aw = data.draw(st.integers(1, h + 1)), data.draw(st.integers(1, w + 1))
    awin = {(i, j): (i * h // ah, -(-(i + 1) * h // ah), j * w // aw, -(-(j + 1) * w // aw),
                     (-(-(i + 1) * h // ah) - i * h // ah) * (-(-(j + 1) * w // aw) - j * w // aw))
            for i in range(ah) for j in range(aw)}
    adaptive = _ref_pool(q, zi, awin, (ah, aw))
    default = data.draw(st.booleans())
    qo = qi if default else qdtype(data.draw(st.sampled_from(DTYPES)))
    s_out, zo = (s_in, zi) if default else _out_params(data.draw, qi, qo, s_in, qi.bits)
    kw_out = {} if default else dict(scale=s_out, zero_point=zo, dtype=qo.name)
    M = float(s_in) / float(s_out)
    for rule in RULES:
        calls = [(lambda: qa.avg_pool2d(xin, (kh, kw), (sh, sw), (ph, pw), count_include_pad=include,
                                        **kw_out, **_kw(rule)), pooled),
                 (lambda: qa.adaptive_avg_pool2d(xin, (ah, aw), **kw_out, **_kw(rule)), adaptive)]
        for call, (sums, counts) in calls:
            if rule != "float" and ref_multiplier(M)[1] < 1:
                with pytest.raises(ValueError, match="too large for an exact average"):
                    call()
                continue
            want = np.empty(sums.shape, np.int64)
            for idx in np.ndindex(sums.shape):
                want[idx] = ref_mean(sums[idx], counts[idx[2:]], M, f32_ratio(num=[s_in], den=s_out), zo,
                                     qo.qmin, qo.qmax, rule)
            got = call()
            assert got.data.dtype == qo.storage
            np.testing.assert_array_equal(got.int_repr(), want[0] if three else want, err_msg=rule)


# -- the CUDA kernels, run on the host ------------------------------------------------------
@st.composite
def host_binary_cases(draw):
    da, db = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    a, b = qdtype(da), qdtype(db)
    op = draw(st.sampled_from(["add", "sub", "mul"]))
    if op == "mul" and a.bits + b.bits > 48:  # the op keeps products within int64
        db, b = "qint16", qdtype("qint16")
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    b_shape = draw(st.sampled_from([shape, shape[1:], (1,)]))
    za, zb = draw(zero_points(a)), draw(zero_points(b))
    shift = {8: 20, 16: 15, 32: 28}[max(8, a.bits, b.bits)]
    # add's operand multipliers: s_q / common = (s_q / s_max) * 2**(shift - 1)
    Ma = draw(multipliers(-60, 0)) / 2 * 2.0 ** (shift - 1) if op != "mul" else None
    Mb = draw(multipliers(-60, 0)) / 2 * 2.0 ** (shift - 1) if op != "mul" else None
    qa_ = np.array([draw_code(draw, a.qmin, a.qmax, za, Ma) for _ in range(math.prod(shape))]).reshape(shape)
    qb_ = np.array([draw_code(draw, b.qmin, b.qmax, zb, Mb) for _ in range(math.prod(b_shape))]).reshape(b_shape)
    return op, (da, qa_, za, Ma), (db, qb_, zb, Mb)


@pytest.mark.parametrize("M", [2.0**29, 0.75, 0.5, 2.0**-31 * 1.5, 2.0**-31, 2.0**-33, 2.0**-40], ids=str)
@pytest.mark.parametrize("qo", ["qint32", "qint8"])
def test_cuda_host_rescale_either_side_of_the_narrow_path(host, kernels, M, qo):
    """common.cuh's qa_rescale takes one 32 x 32 -> 64-bit product where |d| < 2**31
    and 1 <= shift <= 62, else the 94-bit one: d at -2**31 - 1, -2**31, 2**31 - 1,
    2**31, a shift of 1 (M = 2**29) and of 62 (M = 2**-31) and beyond, ties (M = 1/2
    with odd d; M = 2**-31 with d = +-2**31, +-3 * 2**30), every rounding: bit for
    bit the exact reference and the NumPy backend."""
    _check_path(kernels)
    qd = qdtype(qo)
    d = np.array([-(2**31) - 1, -(2**31), -(2**31) + 1, -3 * 2**30, -3, -1, 0, 1, 3, 3 * 2**30, 2**31 - 1, 2**31,
                  2**31 + 1, 2**40 + 1, -(2**62)], np.int64)
    for rule in RULES:
        rq = make_rq(0, 0, M, qd, None, rounding=CODES[rule])
        want, got = numpy_and_host(host, lambda b: b.requantize(d, rq))
        assert host.launches[-1][0] == f"requantize_int64_{qd.storage.name}"
        ref = _ref_int64(d, None, np.float64(M), np.int64(0), qd, rule)
        np.testing.assert_array_equal(got, ref, err_msg=rule)
        np.testing.assert_array_equal(want, ref, err_msg=rule)


@_settings(80)
@given(data=st.data())
def test_cuda_host_requantize_and_binary(host, kernels, data):
    """The CUDA requantize and binary kernels (host-run) on int64 accumulators up to
    +-2**62 and +-(2**63 - 1), every rounding, per-axis parameters: bit for bit the
    NumPy backend (both CPU paths) and the exact reference."""
    from qarray._fixed_point import identity
    from qarray.backends import get

    _check_path(kernels)
    qo = qdtype(data.draw(st.sampled_from(["qint32", "qint8", "quint16", "quint2"])))
    d, axis, M, zo = data.draw(int64_cases(qo))
    for rule in RULES:
        rq = make_rq(0, zo if axis is not None else zo[0], M if axis is not None else M[0], qo, axis,
                     rounding=CODES[rule])
        want, got = numpy_and_host(host, lambda b: b.requantize(d, rq))
        assert host.launches[-1][0] == f"requantize_int64_{qo.storage.name}"
        ref = _ref_int64(d, axis, M, zo, qo, rule)
        np.testing.assert_array_equal(want, ref, err_msg=rule)
        np.testing.assert_array_equal(got, ref, err_msg=rule)
        np.testing.assert_array_equal(get("numpy").requantize(d, rq), ref, err_msg=rule)
    # binary: operands onto add's common scale (or centred, for mul), the exact
    # result requantized in the same pass, output parameters per axis
    op, (da, qa_, za, Ma), (db, qb_, zb, Mb) = data.draw(host_binary_cases())
    a, b = qdtype(da), qdtype(db)
    A, B = np.broadcast_arrays(qa_, qb_)
    shape = A.shape
    axis = data.draw(st.sampled_from([None, 0, 1]))
    n = 1 if axis is None else shape[axis]
    Mo = np.array([data.draw(multipliers(-70, 0)) for _ in range(n)])
    zo = np.array([data.draw(zero_points(qo)) for _ in range(n)], np.int64)
    Mx, Zo = expand(Mo, shape, axis), expand(zo, shape, axis)
    for rule in RULES:
        code = CODES[rule]
        if op == "mul":
            ra, rb = identity(za), identity(zb)
        else:  # the operands of float mode's sum are not an op's (add goes through float32 there)
            ra = make_rq(za, 0, Ma, None, rounding=code if code is not None else 0)
            rb = make_rq(zb, 0, Mb, None, rounding=code if code is not None else 0)
        rq = make_rq(0, zo if axis is not None else zo[0], Mo if axis is not None else Mo[0], qo, axis, rounding=code)
        fn = lambda bk: bk.binary(op, qa_.astype(a.storage), qb_.astype(b.storage), ra, rb, rq)  # noqa: E731
        want, got = numpy_and_host(host, fn)
        assert host.launches[-1][0] == f"binary_{a.storage.name}_{b.storage.name}"
        ref = np.empty(shape, np.int64)
        op_rule = rule if rule != "float" else "half_even"
        for idx in np.ndindex(shape):
            x, y = int(A[idx]) - za, int(B[idx]) - zb
            if op != "mul":
                x, y = ref_scale(x, Ma, op_rule), ref_scale(y, Mb, op_rule)
            v = x * y if op == "mul" else (x + y if op == "add" else x - y)
            ref[idx] = ref_out(v, float(Mx[idx]), f32_ratio(num=[Mx[idx]]), int(Zo[idx]), qo.qmin, qo.qmax, rule)
        np.testing.assert_array_equal(want, ref, err_msg=f"{op} {rule}")
        np.testing.assert_array_equal(got, ref, err_msg=f"{op} {rule}")
        np.testing.assert_array_equal(fn(get("numpy")), ref, err_msg=f"{op} {rule}")
