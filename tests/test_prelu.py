"""prelu against the exact rational reference of tests/_reference.py (``ref_out``: the
fixed-point contract written with Fractions, or ONNX's float mode).

Per element with ``d = q - z_in``: ``d >= 0`` is requantized with ``M = s_in / s_out``,
``d < 0`` with ``M = s_in * |alpha| / s_out`` applied to ``-d`` when alpha < 0 (so
the result is ``R(d * alpha * s_in / s_out)`` up to the tie rule's mirror), and
alpha == 0 gives the output zero point. Multipliers are the float64 quotients of
the float32 values, formed here with Fractions (correctly rounded by ``float``).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import qarray
from qarray import QArray, qdtype

from _reference import RULES, all_codes, expand, f32_ratio, ref_out, rounding_kw

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny arrays: one thread (conftest.py)


def reference(q, alpha, axis, s_out, z_out, dout, rule):
    dout = qdtype(dout)
    s_in = float(np.float32(q.scale))
    z_in = int(q.zero_point)
    a = np.asarray(alpha, np.float32)
    a = np.broadcast_to(a.reshape(()) if a.size == 1 else a, (q.shape[axis],) if a.size > 1 else ())
    al = expand(a, q.shape, axis if a.ndim else None)
    codes = q.int_repr().astype(np.int64)
    so = float(np.float32(s_out))
    out = np.empty(codes.shape, np.int64)
    for idx in np.ndindex(codes.shape):
        d = int(codes[idx]) - z_in
        if d >= 0:
            M, f, dd = float(Fraction(s_in) / Fraction(so)), f32_ratio(num=[s_in], den=so), d
        else:
            av = float(al[idx])
            if av == 0:
                out[idx] = z_out
                continue
            M = float(Fraction(s_in) * Fraction(abs(av)) / Fraction(so))
            f = f32_ratio(num=[s_in, abs(av)], den=so)
            dd = -d if av < 0 else d
        out[idx] = ref_out(dd, M, f, z_out, dout.qmin, dout.qmax, rule)
    return out


def check(q, alpha, axis=1, rule="half_even", **out):
    got = qarray.prelu(q, alpha, axis=axis, **out, **rounding_kw(rule))
    if out:
        d, s, z = qdtype(out.get("dtype", q.dtype)), out["scale"], out.get("zero_point", 0)
    else:
        d, s, z = q.dtype, float(q.scale), int(q.zero_point)
    assert got.dtype is d and float(got.scale) == np.float32(s) and int(got.zero_point) == z
    np.testing.assert_array_equal(got.int_repr().astype(np.int64), reference(q, alpha, axis, s, z, d, rule))
    return got


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("alpha", [0.25, -0.5, 0.0, 1.75, -3.0, 1e-6])
@pytest.mark.parametrize("din,s_in,z_in", [("qint8", 0.05, 0), ("quint8", 0.04, 255), ("quint8", 0.04, 0),
                                           ("qint8", 0.1, -128), ("qint4", 0.5, 7), ("qint16", 0.001, -7)])
def test_scalar_alpha_every_code(kernels, rule, alpha, din, s_in, z_in):
    d = qdtype(din)
    if d.bits == 16:
        q = QArray.from_int(np.r_[d.qmin:d.qmin + 50, -50:50, d.qmax - 50:d.qmax + 1], s_in, z_in, d)
    else:
        q = all_codes(d, s_in, z_in)
    check(q, alpha, rule=rule)  # output = input params
    check(q, alpha, rule=rule, scale=0.03, zero_point=-5, dtype="qint8")  # saturates at both ends
    check(q, alpha, rule=rule, scale=0.011, zero_point=200, dtype="quint8")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_per_channel_alpha(kernels, rng, rule, axis):
    shape = (3, 4, 5)
    q = QArray.from_int(rng.integers(-128, 128, shape), 0.07, 3, "qint8")
    alpha = np.linspace(-1.5, 2.0, shape[axis]).astype(np.float32)
    alpha[0] = 0.0
    check(q, alpha, axis=axis % 3, rule=rule)
    check(q, alpha, axis=axis % 3, rule=rule, scale=0.02, zero_point=10, dtype="quint8")


def test_one_element_alpha_is_a_scalar(kernels, rng):
    q = QArray.from_int(rng.integers(-128, 128, (2, 3, 4)), 0.07, 3, "qint8")
    a = qarray.prelu(q, np.array([-0.3]), axis=2)
    np.testing.assert_array_equal(a.int_repr(), qarray.prelu(q, -0.3).int_repr())


def test_per_axis_input(kernels, rng):
    q = QArray.from_int(rng.integers(0, 256, (4, 6)), np.linspace(0.01, 0.05, 6), np.arange(6) * 40, "quint8",
                        axis=1)
    alpha = np.linspace(-1, 1, 6)
    got = qarray.prelu(q, alpha, axis=1, scale=0.02, zero_point=0, dtype="qint8")
    s_in, z_in = np.asarray(q.scale, np.float64), np.asarray(q.zero_point)
    # per column: the per-tensor op on that column
    for c in range(6):
        col = QArray.from_int(q.int_repr()[:, c], float(s_in[c]), int(z_in[c]), "quint8")
        want = qarray.prelu(col, float(alpha[c]), scale=0.02, zero_point=0, dtype="qint8")
        np.testing.assert_array_equal(got.int_repr()[:, c], want.int_repr())


def test_large_input_both_paths_agree(rng):
    pytest.importorskip("numba")
    q = QArray.from_int(rng.integers(-128, 128, (8, 64, 70)), 0.05, -3, "qint8")
    alpha = rng.uniform(-2, 2, 64)
    with qarray.config.using(numba=True):
        a = qarray.prelu(q, alpha)
    with qarray.config.using(numba=False):
        b = qarray.prelu(q, alpha)
    np.testing.assert_array_equal(a.int_repr(), b.int_repr())


def test_against_torch(kernels, rng):
    torch = pytest.importorskip("torch")
    q = QArray.from_int(rng.integers(-128, 128, (2, 5, 7)), 0.05, 4, "qint8")
    w = np.array([0.25, -0.5, 0.0, 1.5, 0.01], np.float32)
    got = qarray.prelu(q, w, scale=0.04, zero_point=-2, dtype="qint8")
    y = torch.nn.functional.prelu(torch.from_numpy(q.dequantize()), torch.from_numpy(w)).numpy()
    want = np.clip(np.rint(y / np.float32(0.04)) - 2, -128, 127)
    assert np.abs(got.int_repr().astype(np.int64) - want).max() <= 1


def _q():
    return QArray.from_int(np.zeros((2, 3), np.int8), 0.1, 0, "qint8")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: qarray.prelu(np.zeros(3), 0.1), TypeError, "prelu: q must be a QArray"),
    (lambda: qarray.prelu(_q(), np.array([0.1, np.nan, 0.2])), ValueError, "prelu: alpha must be finite"),
    (lambda: qarray.prelu(_q(), float("inf")), ValueError, "prelu: alpha must be finite"),
    (lambda: qarray.prelu(_q(), np.ones(4)), ValueError, "prelu: alpha has 4 slopes but the input has 3 channels"),
    (lambda: qarray.prelu(_q(), np.ones((3, 1))), ValueError, "prelu: alpha must be a scalar or 1-D"),
    (lambda: qarray.prelu(_q(), "x"), TypeError, "prelu: alpha must be a float"),
    (lambda: qarray.prelu(_q(), np.ones(3), axis=2), ValueError, "prelu: axis 2 is out of range"),
    (lambda: qarray.prelu(QArray.from_int(np.zeros((2, 3), np.int8), [0.1, 0.2], 0, "qint8", axis=0), 0.1),
     ValueError, "per-axis input needs output scale="),
    (lambda: qarray.prelu(QArray.from_int(np.zeros((2, 3), np.int8), [0.1, 0.2], 0, "qint8", axis=0), np.ones(3),
                          scale=0.1), ValueError, "per-axis along axis 0 but alpha is per-channel along axis 1"),
    (lambda: qarray.prelu(_q(), 0.1, zero_point=3), ValueError, "prelu: pass the output scale="),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
