"""qarray.requantize and the backends' requantize primitive against the exact
rational reference of tests/_reference.py (the contract of DESIGN.md
"Numerics" in Python integers and Fractions; issue 8, "Done when"), and that
reference itself against vectors published outside this project.

Every test runs on both CPU paths (the ``kernels`` fixture; conftest sends even
tiny arrays through Numba, checked by ``check_path``). External vectors are
marked with where they come from.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from _reference import (RULES, rounding_kw, ref_multiplier, ref_gemmlowp, ref_scale, ref_out, f32_ratio,
                        expand, ref_int64, exact_settings, check_path, paths, scales, zero_points, draw_code,
                        int64_cases)

pytestmark = pytest.mark.usefixtures("one_thread")


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


# -- requantize ------------------------------------------------------------------
REQ_CASES = [("qint2", "qint8"), ("qint4", "qint2"), ("qint8", "qint4"), ("quint2", "quint8"), ("quint4", "quint2"),
             ("quint8", "quint4"), ("qint16", "qint16"), ("quint16", "qint16"), ("qint32", "qint32"),
             ("qint32", "quint8")]


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
@exact_settings(50)
@given(data=st.data())
def test_requantize(d_in, d_out, kernels, data):
    """qarray.requantize: per-tensor and per-axis in and out, every rounding."""
    check_path(kernels)
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
        call = lambda: qa.requantize(x, *_params(pout, pout[2]), d_out, axis=pout[2], **rounding_kw(rule))  # noqa: E731
        if not ok:
            with pytest.raises(ValueError, match="leaves float32's range"):
                call()
            continue
        got = call()
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=rule)


# -- the backend primitive on int64 accumulators ----------------------------------
PRIM_OUT = ["qint32", "qint8", "quint16"]


@pytest.mark.parametrize(**paths("d_out", PRIM_OUT, ["qint32"]))
@exact_settings(80)
@given(data=st.data())
def test_requantize_primitive_int64(d_out, kernels, data):
    """The backend's requantize on int64 accumulators up to +-2**62 and +-(2**63 - 1),
    multipliers 2**-100 to 2**40, per-tensor and per-axis, through ``plan``."""
    from qarray._fixed_point import plan
    from qarray.backends import get

    check_path(kernels)
    qo = qdtype(d_out)
    d, axis, M, zo = data.draw(int64_cases(qo))
    for rule in RULES:
        mode, rounding = ("float", "half_even") if rule == "float" else ("fixed", rule)
        rq = plan([M if axis is not None else M[0]], np.float32(1.0), 0, zo if axis is not None else zo[0], qo,
                  mode, rounding, axis=axis)
        got = get("numpy").requantize(d, rq)
        assert got.dtype == qo.storage
        np.testing.assert_array_equal(got, ref_int64(d, axis, M, zo, qo, rule), err_msg=rule)


# -- the narrow path: |d| < 2**31 and shifts >= 32, one 64-bit product -------------
NARROW_D = [-(2**31), -(2**31) + 1, -3 * 2**30 // 2, -(2**30), -6, -2, -1, 0, 1, 2, 6, 2**30, 3 * 2**29, 2**31 - 1]
# shifts 32 (M = 1/4: ties at d = +-2, +-6), 61 and 62 (ties at d = +-2**30, -2**31),
# 63 and beyond (capped at 63; everything rounds to 0), m at 2**31 - 1 and 2**30
NARROW_M = [0.25, 0.75 * 2.0**-2, (2**31 - 1) * 2.0**-63, 2.0**-31, 2.0**-32, 2.0**-33, 2.0**-34, 2.0**-60,
            2.0**-100]


@pytest.mark.parametrize(**paths("d_out", ["qint32", "qint8"], ["qint32"]))
@pytest.mark.parametrize("M", NARROW_M, ids=str)
def test_requantize_narrow_path_at_the_extremes(d_out, M, kernels):
    """int32 accumulators with zero point 0 take ``rescale(narrow=True)`` (one
    64-bit product, rounded at once): int32's ends, ties of every rule and
    shifts from 32 to 94, against the exact reference, output zero points at
    both ends of qint8."""
    from qarray._fixed_point import plan
    from qarray.backends import get

    check_path(kernels)
    qo = qdtype(d_out)
    d = np.array(NARROW_D, np.int32)
    for zo in ([0, qo.qmin, qo.qmax] if qo.bits == 8 else [0]):
        for rule in ("half_even", "half_away", "half_up"):  # tflite and float keep their own paths
            rq = plan([M], np.float32(1.0), 0, zo, qo, "fixed", rule)
            assert rq.narrow(np.int32), "the case must take the narrow path"
            got = get("numpy").requantize(d, rq)
            want = ref_int64(d.astype(np.int64), None, np.array([M]), np.array([zo]), qo, rule)
            np.testing.assert_array_equal(got, want, err_msg=f"{rule} zo={zo}")
