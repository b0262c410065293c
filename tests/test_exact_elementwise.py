"""add, sub and mul (qarray/ops/elementwise.py) against the exact rational
reference of tests/_reference.py: add/sub's two-step contract, mul's exact
products rounded once, broadcasting, a fused ReLU, every rounding, on both CPU
paths (``kernels``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from _reference import (RULES, rounding_kw, ref_scale, ref_out, exact_settings, check_path, paths, MANTISSAS,
                        scales, zero_points, draw_code)

pytestmark = pytest.mark.usefixtures("one_thread")


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
# on Numba too: 8-bit operands, and qint32 ones into a qint32 output (cpu.elementwise.binary's widest case)
@pytest.mark.parametrize(**paths("da,db,dout", BIN_CASES, [("qint8", "quint8", "qint8"), ("qint32", "qint8", "qint32")]))
@exact_settings(25)
@given(data=st.data())
def test_add_sub_mul(op, da, db, dout, kernels, data):
    """add/sub (two-step contract) and mul (exact products, one rounding), with
    broadcasting, a fused ReLU, zero points at both ends, every rounding."""
    check_path(kernels)
    a, b, o = qdtype(da), qdtype(db), qdtype(dout)
    qa_, qb_, pa, pb, pout, relu = data.draw(binary_cases(da, db, dout, op))
    x = QArray.from_int(qa_.astype(a.storage), *pa, da)
    y = QArray.from_int(qb_.astype(b.storage), *pb, db)
    fn = getattr(qa, op)
    for rule in RULES:
        if rule == "tflite" and op != "mul" and 32 in (a.bits, b.bits):
            continue  # operands clamped to int32: see test_add_tflite_qint32_operands_are_not_clamped
        call = lambda: fn(x, y, scale=pout[0], zero_point=pout[1], dtype=dout, relu=relu, **rounding_kw(rule))  # noqa: E731
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
