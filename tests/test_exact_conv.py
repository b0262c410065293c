"""conv2d (qarray/ops/conv.py) against the exact rational reference of
tests/_reference.py: exact window sums (Python ints) requantized once; groups,
stride, padding, dilation, per-channel weights, bias, ReLU, every rounding, on
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
@exact_settings(25)
@given(data=st.data())
def test_conv2d(dx, dw, dout, kernels, data):
    """conv2d: groups, stride, padding (the input's zero point), dilation,
    per-channel weights, bias, ReLU, every rounding."""
    check_path(kernels)
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
    wq = weight_of(w.astype(qw.storage), s_w, zw, dw, per_channel, 0)
    acc = _ref_conv(x, zx, w, zw, stride, padding, dilation, groups)
    acc = acc + np.asarray(bias_ints(bias, s_x, s_w), object).reshape(-1, 1, 1) if bias is not None else acc
    for rule in RULES:
        got = qa.conv2d(xq, wq, bias, stride, padding, dilation, groups, scale=s_out, zero_point=zo, dtype=dout,
                        relu=relu, **rounding_kw(rule))
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), ref_acc_out(acc, s_x, s_w, (s_out, zo), qo, rule, relu, 1),
                                      err_msg=rule)
