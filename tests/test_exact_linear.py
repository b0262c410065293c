"""linear and matmul (qarray/ops/linear.py) against the exact rational
reference of tests/_reference.py: exact accumulators (Python ints) requantized
once, per-tensor and per-channel weights, float bias, ReLU, every rounding, on
both CPU paths (``kernels``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from _reference import (RULES, rounding_kw, bias_ints, ref_acc_out, exact_settings, check_path, paths, scales,
                        zero_points, draw_code, weight_params, weight_of, MM_CASES)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(**paths("dx,dw,dout", MM_CASES, []))
@exact_settings(40)
@given(data=st.data())
def test_linear_and_matmul(dx, dw, dout, kernels, data):
    """linear (w per-tensor or per-channel along axis 0, float bias or none, ReLU)
    and matmul (b per-channel along its last axis) on extreme codes."""
    check_path(kernels)
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
    wq = weight_of(w.astype(qw.storage), s_w, zw, dw, per_channel, 0)
    bq = weight_of(np.ascontiguousarray(w.T).astype(qw.storage), s_w, zw, dw, per_channel, 1)
    acc = (x.astype(object) - zx) @ (w.astype(object) - zw.astype(np.int64)[:, None]).T  # Python ints
    acc_b = acc + bias_ints(bias, s_x, s_w)
    for rule in RULES:
        kw = dict(scale=s_out, zero_point=zo, dtype=dout, relu=relu, **rounding_kw(rule))
        want = ref_acc_out(acc_b, s_x, s_w, (s_out, zo), qo, rule, relu, 1)
        got = qa.linear(xq if not one_d else xq.reshape(-1), wq, bias, **kw)
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want[0] if one_d else want, err_msg=f"linear {rule}")
        want = ref_acc_out(acc, s_x, s_w, (s_out, zo), qo, rule, relu, 1)
        np.testing.assert_array_equal(qa.matmul(xq, bq, **kw).int_repr(), want, err_msg=f"matmul {rule}")


def test_a_bias_beyond_int32_keeps_int64_sums(kernels):
    """A bias whose integers with the products pass int32 (the layer keeps
    int32 sums only where |products| + |bias| fit): exact, requantized to qint32
    without clamping, through nn.Linear and linear; as the accumulator alone,
    the ValueError that names the reach."""
    check_path(kernels)
    k = 8
    xc = np.full((2, k), 255, np.uint8)
    xc[1] = 0
    x = QArray.from_int(xc, 1.0, 0, "quint8")
    codes = np.array([[127] * k, [-128] * k, [127] * k, [-128] * k], np.int8)
    w = QArray.from_int(codes, 1.0, 0, "qint8")
    bias = np.array([2**31 - 256, -(2**31) + 256, 2**30, -(2**30)], np.float32)  # exact in float32
    acc = xc.astype(object) @ codes.astype(object).T + bias_ints(bias, 1.0, 1.0)
    assert acc.max() > 2**31 and acc.min() < -(2**31)  # beyond int32 both ways
    s_out = np.float32(4.0)
    for rule in RULES:
        want = ref_acc_out(acc, np.float32(1), np.ones(4, np.float32), (s_out, 0), qdtype("qint32"), rule, False, 1)
        kw = dict(scale=s_out, zero_point=0, dtype="qint32", **rounding_kw(rule))
        np.testing.assert_array_equal(qa.linear(x, w, bias, **kw).int_repr(), want, err_msg=rule)
        layer = qa.nn.Linear(w, bias)
        for _ in range(2):  # the layer's kept bias integers the second time
            np.testing.assert_array_equal(layer(x, **kw).int_repr(), want, err_msg=rule)
    with pytest.raises(ValueError, match="beyond qint32"):
        qa.linear(x, w, bias)


def test_linear_long_k_extreme_codes(kernels):
    """K = 2**18 products of extreme codes: accumulators near 2**34, per-channel
    weights, an output scale that makes row 0's accumulators exact ties."""
    check_path(kernels)
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
            got = qa.linear(x, w, scale=s_out, zero_point=zo, dtype=dout, **rounding_kw(rule)).int_repr()
            want = ref_acc_out(acc, np.float32(1.0), s_w, (s_out, zo), qo, rule, False, 1)
            np.testing.assert_array_equal(got, want, err_msg=f"{rule} {dout} {zo}")
            if dout == "qint16" and zo == 0:
                assert list(got[0, :2]) == ties[rule], rule


@pytest.mark.parametrize("da_,db_", [("qint8", "quint8"), ("quint8", "qint8"), ("qint4", "qint8")])
def test_matmul_per_row_a(backend, da_, db_):
    """``a`` per row (a gradient per output channel in ``grad_w = grad_out.T @ x``)
    with ``b`` per tensor: the exact int64 products, extreme codes and every
    row's zero point at either end of its dtype; the result's scale per row.
    Requantized with K = 100000, where sums pass 2**32, against the exact
    reference, every rule."""
    qa_, qb = qdtype(da_), qdtype(db_)
    rng = np.random.default_rng(5)
    m, n = 4, 3
    za = np.array([qa_.qmin, qa_.qmax, 0, qa_.qmax])[:m] if qa_.signed else np.array([0, qa_.qmax, 0, 7])
    s_a = np.float32([0.5, 0.01, 3.0, 2.0**-9])
    s_b, zb = np.float32(0.05), (qb.qmin if qb.signed else qb.qmax)
    for k in (1000, 100000):
        far_a = np.where(za - qa_.qmin > qa_.qmax - za, qa_.qmin, qa_.qmax)  # each row's code farthest from its zero point
        far_b = qb.qmin if zb - qb.qmin > qb.qmax - zb else qb.qmax
        a = np.where(rng.random((m, k)) < 0.9, far_a[:, None], rng.choice([qa_.qmin, qa_.qmax], (m, k)))
        b = np.where(rng.random((k, n)) < 0.9, far_b, rng.choice([qb.qmin, qb.qmax], (k, n)))
        qa_rows = QArray.from_int(a.T.copy(), s_a, za, da_, axis=1).T  # a transposed view, as grad_out.T
        qbt = QArray.from_int(b, s_b, zb, db_)
        acc = (a - za[:, None]).astype(object) @ (b - zb).astype(object)
        if k == 1000:
            got = backend.run(qa.matmul, qa_rows, qbt)
            assert got.axis == 0
            np.testing.assert_array_equal(got.int_repr(), acc.astype(np.int64))
            np.testing.assert_array_equal(got.scale, s_a * s_b)
            continue
        assert np.abs(acc).max() > (2**32 if qa_.bits == 8 else 2**28)  # 4 bits: 15 * 255 * K
        for rule in RULES:
            s_out, zo = np.float32(float(np.abs(acc).max()) * 0.05 / 100), 3
            got = backend.run(qa.matmul, qa_rows, qbt, scale=s_out, zero_point=zo, dtype="qint8", **rounding_kw(rule))
            want = ref_acc_out(acc, s_b, s_a, (s_out, zo), qdtype("qint8"), rule, False, 0)
            np.testing.assert_array_equal(got.int_repr(), want, err_msg=rule)


def test_matmul_parameters_on_the_summed_axis_are_refused():
    a = QArray.from_int(np.ones((2, 3), np.int8), np.float32([1, 2, 3]), 0, "qint8", axis=1)
    b = QArray.from_int(np.ones((3, 2), np.int8), np.float32([1, 2, 3]), 0, "qint8", axis=0)
    a_rows = QArray.from_int(np.ones((2, 3), np.int8), np.float32([1, 2]), 0, "qint8", axis=0)
    b_cols = QArray.from_int(np.ones((3, 2), np.int8), np.float32([1, 2]), 0, "qint8", axis=1)
    a_t = QArray.from_int(np.ones((2, 3), np.int8), 1.0, 0, "qint8")
    with pytest.raises(ValueError, match=r"a's per-channel parameters lie along axis 1; they must lie along its "
                                         r"rows \(axis 0, M\) or a must be per-tensor"):
        qa.matmul(a, b_cols)
    with pytest.raises(ValueError, match=r"b's per-channel parameters lie along axis 0.*quantize the float weights "
                                         r"per input feature \(axis=1\)"):
        qa.matmul(a_t, b)
    with pytest.raises(ValueError, match="a has per-row parameters and b per-column ones"):
        qa.matmul(a_rows, b_cols)
    with pytest.raises(ValueError, match="a bias .* does not go with a per-row a"):
        qa.matmul(a_rows, QArray.from_int(np.ones((3, 2), np.int8), 1.0, 0, "qint8"), bias=np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="has dtype qint16"):
        qa.matmul(QArray.from_int(np.ones((2, 3), np.int16), np.float32([1, 2]), 0, "qint16", axis=0), a_t.T)
