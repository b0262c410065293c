"""The CUDA requantize and binary kernels (common.cuh's qa_rescale, ops.cu),
host-run through tests/cuda_host, against the exact rational reference of
tests/_reference.py and the NumPy backend bit for bit: int64
accumulators up to +-(2**63 - 1), every rounding, per-axis parameters."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qarray
from qarray import qdtype
from qarray._fixed_point import Binary

from _reference import (DTYPES, RULES, CODES, ref_scale, ref_out, f32_ratio, expand, ref_int64,
                        exact_settings, check_path, zero_points, draw_code, multipliers, int64_cases, make_rq,
                        numpy_and_host)

pytestmark = pytest.mark.usefixtures("one_thread")
HAVE_NUMBA = importlib.util.find_spec("numba") is not None


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


def _same_on_numba(fn, ref, err_msg):
    """``fn(NumPy backend)`` on the Numba kernels (checked to be the path taken) is
    ``ref``; nothing without Numba. The tests here hold the host-run CUDA kernels and
    the generic NumPy code (``numpy_and_host``) to the exact reference, and the Numba
    kernels too where they are the ones test_exact_requantize compiles (int64
    accumulators into qint32, every rounding: ``paths``, there): a Numba
    specialisation costs seconds of compiling in a fresh run, and random dtypes
    would compile dozens. test_exact_requantize and test_exact_elementwise hold the
    Numba kernels to this reference, and test_requantize, test_elementwise and
    test_wide to the generic code over the dtypes."""
    from qarray.backends import get

    if not HAVE_NUMBA:
        return
    with qarray.config.using(numba=True):
        check_path("numba")
        np.testing.assert_array_equal(fn(get("numpy")), ref, err_msg=err_msg)


@pytest.mark.parametrize("M", [2.0**29, 0.75, 0.5, 2.0**-31 * 1.5, 2.0**-31, 2.0**-33, 2.0**-40], ids=str)
@pytest.mark.parametrize("qo", ["qint32", "qint8"])
def test_cuda_host_rescale_either_side_of_the_narrow_path(host, M, qo):
    """common.cuh's qa_rescale takes one 32 x 32 -> 64-bit product where |d| < 2**31
    and 1 <= shift <= 62, else the 94-bit one: d at -2**31 - 1, -2**31, 2**31 - 1,
    2**31, a shift of 1 (M = 2**29) and of 62 (M = 2**-31) and beyond, ties (M = 1/2
    with odd d; M = 2**-31 with d = +-2**31, +-3 * 2**30), every rounding: bit for
    bit the exact reference and the NumPy backend (generic code; Numba kernels too into qint32)."""
    qd = qdtype(qo)
    d = np.array([-(2**31) - 1, -(2**31), -(2**31) + 1, -3 * 2**30, -3, -1, 0, 1, 3, 3 * 2**30, 2**31 - 1, 2**31,
                  2**31 + 1, 2**40 + 1, -(2**62)], np.int64)
    for rule in RULES:
        rq = make_rq(0, 0, M, qd, None, rounding=CODES[rule])
        want, got = numpy_and_host(host, lambda b: b.requantize(d, rq))
        assert host.launches[-1][0] == f"requantize_int64_{qd.storage.name}"
        ref = ref_int64(d, None, np.float64(M), np.int64(0), qd, rule)
        np.testing.assert_array_equal(got, ref, err_msg=rule)
        np.testing.assert_array_equal(want, ref, err_msg=rule)
        if qo == "qint32":
            _same_on_numba(lambda b: b.requantize(d, rq), ref, rule)


@exact_settings(160)  # the examples of the two runs (kernels numba and generic) it was
@given(data=st.data())
def test_cuda_host_requantize_and_binary(host, data):
    """The CUDA requantize and binary kernels (host-run) on int64 accumulators up to
    +-2**62 and +-(2**63 - 1), every rounding, per-axis parameters: bit for bit the
    NumPy backend (generic code; Numba kernels too into qint32) and the exact reference."""
    from qarray._fixed_point import identity

    qo = qdtype(data.draw(st.sampled_from(["qint32", "qint8", "quint16", "quint2"])))
    d, axis, M, zo = data.draw(int64_cases(qo))
    for rule in RULES:
        rq = make_rq(0, zo if axis is not None else zo[0], M if axis is not None else M[0], qo, axis,
                     rounding=CODES[rule])
        want, got = numpy_and_host(host, lambda b: b.requantize(d, rq))
        assert host.launches[-1][0] == f"requantize_int64_{qo.storage.name}"
        ref = ref_int64(d, axis, M, zo, qo, rule)
        np.testing.assert_array_equal(want, ref, err_msg=rule)
        np.testing.assert_array_equal(got, ref, err_msg=rule)
        if qo.name == "qint32":
            _same_on_numba(lambda b: b.requantize(d, rq), ref, rule)
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
        fn = lambda bk: bk.binary(qa_.astype(a.storage), qb_.astype(b.storage), Binary(op, ra, rb, rq))  # noqa: E731
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
