"""qarray.nn: layers equal the ops on the same quantized weights, bit for bit."""

import numpy as np
import pytest

import qarray
from qarray import qint32
from qarray.nn import Conv2d, DynamicLinear, Linear
from qarray.ops.conv import conv2d
from qarray.ops.linear import linear


def _qx(rng, shape, dtype="quint8"):
    return qarray.quantize_dynamic(rng.normal(size=shape).astype(np.float32), dtype)


@pytest.mark.parametrize("weight_dtype", ["qint8", "quint8", "qint4"])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("x_dtype", ["quint8", "qint8"])
def test_linear_equals_ops_linear(weight_dtype, per_channel, x_dtype, kernels, rng):
    w = rng.normal(size=(5, 7)).astype(np.float32)
    b = rng.normal(size=5).astype(np.float32)
    layer = Linear.from_float(w, b, weight_dtype=weight_dtype, per_channel=per_channel)
    want_w = qarray.quantize_dynamic(w, weight_dtype, symmetric=True, axis=0 if per_channel else None)
    np.testing.assert_array_equal(layer.weight.int_repr(), want_w.int_repr())
    np.testing.assert_array_equal(layer.weight.scale, want_w.scale)
    assert layer.weight.axis == (0 if per_channel else None)
    for shape in [(3, 7), (2, 3, 7), (7,)]:
        qx = _qx(rng, shape, x_dtype)
        acc = layer(qx)
        assert acc.dtype is qint32
        np.testing.assert_array_equal(acc.int_repr(), linear(qx, layer.weight, layer.bias).int_repr())
        kw = dict(scale=0.05, zero_point=3, dtype="qint8", relu=True)
        np.testing.assert_array_equal(layer(qx, **kw).int_repr(),
                                      linear(qx, layer.weight, layer.bias, **kw).int_repr())


def test_linear_calibrate_sets_and_uses_output_params(kernels, rng):
    w = rng.normal(size=(4, 6)).astype(np.float32)
    b = rng.normal(size=4).astype(np.float32)
    layer = Linear.from_float(w, b)
    assert layer.scale is None and layer.zero_point is None and layer.dtype is None
    qx = _qx(rng, (8, 6))
    assert layer.calibrate(qx) is layer
    ref = qx.dequantize() @ layer.weight.dequantize().T + b
    s, z = qarray.choose_qparams(ref.min(), ref.max(), "quint8")
    assert layer.dtype is qarray.quint8 and layer.scale == s and layer.zero_point == z
    out = layer(qx)
    np.testing.assert_array_equal(
        out.int_repr(), linear(qx, layer.weight, b, scale=s, zero_point=z, dtype="quint8").int_repr())
    np.testing.assert_allclose(out.dequantize(), ref, atol=float(s) * 1.01)
    per_call = layer(qx, scale=0.1, dtype="qint8")  # per-call parameters replace the layer's three
    assert per_call.dtype is qarray.qint8 and per_call.scale == np.float32(0.1) and per_call.zero_point == 0
    # each call widens the range; float input works too; relu keeps the non-negative part
    layer.calibrate(ref[:, :1].repeat(6, axis=1) * 0 + 100.0)
    assert layer.scale > s
    relu_layer = Linear.from_float(w, b).calibrate(qx.dequantize(), dtype="qint8", relu=True)
    assert relu_layer.dtype is qarray.qint8
    assert relu_layer.zero_point == qarray.choose_qparams(0.0, max(ref.max(), 0), "qint8")[1]


@pytest.mark.parametrize("groups, per_channel, weight_dtype", [(1, True, "qint8"), (2, False, "quint8"),
                                                               (4, True, "qint4")])
def test_conv2d_equals_ops_conv2d(groups, per_channel, weight_dtype, kernels, rng):
    w = rng.normal(size=(8, 4 // groups, 3, 3)).astype(np.float32)
    b = rng.normal(size=8).astype(np.float32)
    args = dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=groups)
    layer = Conv2d.from_float(w, b, **args, weight_dtype=weight_dtype, per_channel=per_channel)
    assert layer.stride == (2, 1) and layer.padding == (1, 1) and layer.dilation == (1, 2)
    qx = _qx(rng, (2, 4, 9, 8))
    np.testing.assert_array_equal(layer(qx).int_repr(), conv2d(qx, layer.weight, b, **args).int_repr())
    kw = dict(scale=0.1, zero_point=-5, dtype="qint8", relu=True, rounding="half_away")
    np.testing.assert_array_equal(layer(qx, **kw).int_repr(), conv2d(qx, layer.weight, b, **args, **kw).int_repr())
    layer.calibrate(qx)
    out = layer(qx)
    np.testing.assert_array_equal(out.int_repr(), conv2d(qx, layer.weight, b, **args, scale=layer.scale,
                                                         zero_point=layer.zero_point, dtype=layer.dtype).int_repr())
    # the calibration reference is the float convolution: the output is within half a
    # step of it (plus the bias's rounding), clamped to the calibrated range
    acc = conv2d(qx, layer.weight, **args)
    s, z, d = float(layer.scale), int(layer.zero_point), layer.dtype
    ref = np.clip(acc.dequantize() + b[:, None, None], (d.qmin - z) * s, (d.qmax - z) * s)
    np.testing.assert_allclose(out.dequantize(), ref, atol=0.5 * s + 0.5 * float(np.max(acc.scale)) + 1e-5)


def test_conv2d_reference_matches_torch(rng):
    torch = pytest.importorskip("torch")
    w = rng.normal(size=(6, 2, 3, 2)).astype(np.float32)
    b = rng.normal(size=6).astype(np.float32)
    layer = Conv2d.from_float(w, b, stride=2, padding=(1, 2), dilation=2, groups=3)
    x = rng.normal(size=(2, 6, 9, 7)).astype(np.float32)
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(layer.weight.dequantize()),
                                      torch.from_numpy(b), 2, (1, 2), 2, 3).numpy()
    np.testing.assert_allclose(layer._reference(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_channel", [True, False])
def test_dynamic_linear_int8(per_channel, kernels, rng):
    w = rng.normal(size=(6, 40)).astype(np.float32)
    b = rng.normal(size=6).astype(np.float32)
    layer = DynamicLinear.from_float(w, b, per_channel=per_channel)
    x = rng.normal(size=(5, 40)).astype(np.float32)
    y = layer(x)
    assert y.dtype == np.float32 and y.shape == (5, 6)
    # exactly its own formula
    qx = qarray.quantize_dynamic(x, "quint8")
    qw = layer.weight
    zw = np.asarray(qw.zero_point, np.int64)
    acc = (qx.data.astype(np.int64) - int(qx.zero_point)) @ (qw.data.astype(np.int64) - zw[..., None]).T
    want = acc.astype(np.float32) * (np.float32(qx.scale) * np.asarray(qw.scale, np.float32)) + b
    np.testing.assert_array_equal(y, want)
    # and close to float
    np.testing.assert_allclose(y, x @ w.T + b, atol=0.15)
    np.testing.assert_array_equal(layer(x[0]), layer(x[:1])[0])  # 1-d input
    np.testing.assert_array_equal(layer(x[None])[0], y)


def test_dynamic_linear_float16(rng):
    w = rng.normal(size=(3, 8)).astype(np.float32)
    layer = DynamicLinear.from_float(w, None, weight_dtype="float16")
    assert layer.weight.dtype == np.float16
    x = rng.normal(size=(4, 8)).astype(np.float32)
    y = layer(x)
    np.testing.assert_array_equal(y, x @ w.astype(np.float16).astype(np.float32).T)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-2, atol=1e-2)
    assert layer(x.astype(np.float64)).dtype == np.float32


def test_reprs(rng):
    lin = Linear.from_float(rng.normal(size=(3, 4)).astype(np.float32))
    assert repr(lin) == "Linear(in_features=4, out_features=3, weight_dtype=qint8, per_channel, bias=False)"
    lin.scale, lin.zero_point, lin.dtype = np.float32(0.5), 2, "quint8"
    assert repr(lin).endswith("scale=0.5, zero_point=2, dtype=quint8)")
    conv = Conv2d.from_float(rng.normal(size=(4, 1, 3, 3)).astype(np.float32), np.zeros(4, np.float32),
                             padding=1, groups=2, per_channel=False)
    assert repr(conv) == ("Conv2d(2, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), "
                          "groups=2, weight_dtype=qint8, per_tensor, bias=True)")
    dyn = DynamicLinear.from_float(rng.normal(size=(3, 4)).astype(np.float32), weight_dtype="float16")
    assert repr(dyn) == "DynamicLinear(in_features=4, out_features=3, weight_dtype=float16, bias=False)"


def _errors():
    rng = np.random.default_rng(0)
    w2 = rng.normal(size=(3, 4)).astype(np.float32)
    w4 = rng.normal(size=(4, 2, 3, 3)).astype(np.float32)
    lin, dyn = Linear.from_float(w2), DynamicLinear.from_float(w2)
    conv = Conv2d.from_float(w4, groups=2)
    qx = qarray.quantize_dynamic(rng.normal(size=(2, 4)).astype(np.float32))
    return [
        (lambda: Linear.from_float(w4), ValueError, "2-d float array"),
        (lambda: Linear.from_float(w2.astype(np.int32)), ValueError, "float array"),
        (lambda: Linear.from_float(w2, np.ones(4, np.float32)), ValueError, r"shape \(3,\)"),
        (lambda: Linear.from_float(w2, weight_dtype="qint16"), TypeError, "qint16"),
        (lambda: lin(np.ones((2, 4), np.float32)), TypeError, "x must be a QArray"),
        (lambda: lin(qx[:, :3]), ValueError, "do not align"),
        (lambda: lin(qx, zero_point=1), ValueError, "pass the output scale="),
        (lambda: Conv2d.from_float(w4, groups=3), ValueError, "does not divide the 4 output"),
        (lambda: Conv2d.from_float(w2), ValueError, "4-d float array"),
        (lambda: conv(qarray.quantize_dynamic(np.ones((1, 3, 5, 5), np.float32))), ValueError, "does not divide"),
        (lambda: conv(qarray.quantize_dynamic(np.ones((1, 2, 5, 5), np.float32))), ValueError, "x has 2 channels"),
        (lambda: conv(qx), ValueError, r"x must have shape \(N, C, H, W\)"),
        (lambda: dyn(qx), TypeError, "float input"),
        (lambda: dyn(np.ones((2, 5), np.float32)), ValueError, r"shape \(\.\.\., 4\)"),
        (lambda: dyn(np.ones((2, 4), np.int32)), ValueError, "must be float"),
        (lambda: dyn(np.ma.array(np.ones((2, 4), np.float32), mask=np.eye(2, 4))), TypeError,
         r"^DynamicLinear does not take masked arrays .* fill the masked values first, e\.g\. x\.filled\(0\)"),
        (lambda: Linear.from_float(np.ma.array(w2)), TypeError, r"^Linear\.from_float does not take masked arrays"),
    ]


@pytest.mark.parametrize("case", range(len(_errors())))
def test_errors(case):
    call, exc, match = _errors()[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("weight_dtype", ["qint8", "qint4"])
def test_dead_unit_gets_a_floored_scale_and_works(weight_dtype, kernels, rng):
    """A trained model's dead unit (max |w| ~ 3e-13) with an ordinary bias: its
    weight scale is floored at 1/256 of the largest channel's, so the bias fits."""
    w = rng.normal(size=(4, 16)).astype(np.float32)
    w[2] = 3e-13
    b = np.array([0.5, -1.0, -3.0, 2.0], np.float32)
    layer = Linear.from_float(w, b, weight_dtype=weight_dtype)
    plain = qarray.quantize_dynamic(w, weight_dtype, symmetric=True, axis=0)
    s = layer.weight.scale
    assert s[2] == s.max() / np.float32(256) and s[2] > 1000 * plain.scale[2]
    np.testing.assert_array_equal(np.delete(s, 2), np.delete(plain.scale, 2))  # the others as before
    np.testing.assert_array_equal(np.delete(layer.weight.int_repr(), 2, 0), np.delete(plain.int_repr(), 2, 0))
    assert not layer.weight.int_repr()[2].any()
    qx = _qx(rng, (3, 16))
    acc_scale = np.float32(qx.scale) * s
    want = (qx.int_repr().astype(np.int64) - int(qx.zero_point)) @ layer.weight.int_repr().astype(np.int64).T \
        + np.rint(b / acc_scale).astype(np.int64)
    np.testing.assert_array_equal(layer(qx).int_repr(), want)
    np.testing.assert_array_equal(linear(qx, layer.weight, b).int_repr(), want)
    y = layer.calibrate(qx)(qx).dequantize()
    np.testing.assert_allclose(y[:, 2], -3.0, atol=float(layer.scale))
    per_tensor = Linear.from_float(w, b, weight_dtype=weight_dtype, per_channel=False)
    assert per_tensor.weight.scale == plain.scale.max()


def test_linear_keeps_a_calls_work_for_that_call_alone(kernels, rng, monkeypatch):
    """A call that requantizes 2-D 8-bit codes keeps its work (``PackedWeight.matmul``):
    the next call with the same parameters but other codes reuses it, and a call
    that differs in anything else (the input's parameters, the rows, the output's,
    ReLU, the default tie rule, the engine's settings, the instruction set, the
    bias) gets work of its own. Every result equals ``ops.linear``'s, which keeps
    nothing."""
    layer = Linear.from_float(rng.normal(size=(40, 64)).astype(np.float32), rng.normal(size=40).astype(np.float32))
    calls = layer._packed._calls
    x = _qx(rng, (33, 64))
    out = dict(scale=0.05, zero_point=3, dtype="qint8")

    def check(x, new, **kw):
        before = len(calls)
        got, want = layer(x, **kw), linear(x, layer.weight, layer.bias, **kw)
        np.testing.assert_array_equal(got.int_repr(), want.int_repr())
        assert got.dtype is want.dtype
        np.testing.assert_array_equal([got.scale, got.zero_point], [want.scale, want.zero_point])
        assert len(calls) == before + new, kw

    check(x, 1, **out)
    same = qarray.QArray.from_int(rng.integers(0, 256, (33, 64)).astype(np.uint8), x.scale, x.zero_point, x.dtype)
    check(same, 0, **out)  # other codes, the same parameters: kept
    check(_qx(rng, (33, 64)), 1, **out)  # the input's scale and zero point
    check(qarray.QArray.from_int(same.int_repr()[:5], x.scale, x.zero_point, x.dtype), 1, **out)  # rows
    check(x, 1, **{**out, "scale": 0.07})
    check(x, 1, **out, relu=True)
    check(x, 0, **out, relu=True)
    with qarray.config.using(rounding="half_up"):
        check(x, 1, **out)
    with qarray.config.using(gemm="blas"):
        check(x, 1, **out)
    check(_qx(rng, (3, 2, 64)), 0, **out)  # 3-D codes: run as they come
    check(x, 0)  # the qint32 accumulator: as it comes
    if kernels == "numba":
        from qarray.backends.cpu import isa

        monkeypatch.setattr(isa, "OFF", set(isa.ORDER[:isa.ORDER.index(isa.best()) + 1]))
        check(x, 1, **out)
    layer.bias = rng.normal(size=40).astype(np.float32)
    check(x, 1, **out)


@pytest.mark.parametrize("c", [3, 64])  # im2col into the GEMM; the implicit GEMM (C a multiple of 64)
def test_conv2d_keeps_a_calls_work_for_that_call_alone(c, kernels, rng):
    """nn.Conv2d (groups 1) keeps a call's work as nn.Linear does: kept for other
    codes with the same parameters, made again for other images, parameters,
    output, ReLU, tie rule or settings; every result equals ``ops.conv2d``'s."""
    layer = Conv2d.from_float(rng.normal(size=(8, c, 3, 3)).astype(np.float32), rng.normal(size=8).astype(np.float32),
                              padding=1)
    calls = layer._packed._calls
    x = _qx(rng, (2, c, 9, 10))
    out = dict(scale=0.05, zero_point=-3, dtype="qint8")

    def check(x, new, **kw):
        before = len(calls)
        got, want = layer(x, **kw), conv2d(x, layer.weight, layer.bias, padding=1, **kw)
        np.testing.assert_array_equal(got.int_repr(), want.int_repr())
        assert got.dtype is want.dtype and got.shape == want.shape
        assert len(calls) == before + new, kw

    check(x, 1, **out)
    same = qarray.QArray.from_int(rng.integers(0, 256, x.shape).astype(np.uint8), x.scale, x.zero_point, x.dtype)
    check(same, 0, **out)
    check(_qx(rng, (2, c, 9, 10)), 1, **out)  # the input's parameters
    check(qarray.QArray.from_int(same.int_repr()[:1], x.scale, x.zero_point, x.dtype), 1, **out)  # images
    check(x, 1, **out, relu=True)
    with qarray.config.using(rounding="half_up"):
        check(x, 1, **out)
    with qarray.config.using(numba=kernels != "numba"):
        check(x, 1, **out)
    check(x, 0)  # the qint32 accumulator: as it comes
