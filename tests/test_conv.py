"""conv2d: the exact accumulator against an int64 direct-loop reference (and torch),
requantized outputs against requantizing that accumulator, and the errors."""

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qarray
from qarray import QArray, qint32
from qarray.ops.conv import conv2d

X_DTYPES = ["quint8", "qint8", "qint4", "quint4"]
W_DTYPES = ["qint8", "quint8", "qint4"]
PAIRS = list(itertools.product(X_DTYPES, W_DTYPES))

# (N, C, H, W), (O, kh, kw), stride, padding, dilation, groups, per_channel
CONFIGS = [
    ((2, 3, 7, 5), (4, 3, 2), 1, 0, 1, 1, False),
    ((1, 4, 9, 8), (6, 3, 3), 2, 1, 1, 2, True),
    ((2, 5, 6, 7), (5, 3, 3), (1, 2), (2, 1), (2, 1), 5, True),  # depthwise
    ((1, 6, 11, 9), (4, 2, 3), 3, (0, 2), (1, 3), 2, False),
    ((3, 2, 4, 4), (3, 1, 1), 1, 0, 1, 1, True),  # 1x1
    ((1, 3, 5, 5), (6, 5, 5), 1, 2, 1, 3, True),  # depthwise, multiplier 2, kernel = padded input - 4
]
# scales whose products are exact in float32, so that the fixed-point multiplier
# of conv2d (float64 product) and of requantize (float32 scale) agree
X_SCALES = [0.5, 0.375, 0.1875]
W_SCALES = [0.25, 0.3125, 0.75, 0.140625]


def _pair(v):
    return (v, v) if isinstance(v, int) else v


def make_operands(rng, pair, cfg, exact_scales=True):
    (n, c, h, wd), (o, kh, kw), stride, padding, dilation, groups, per_channel = cfg
    xd, wdt = (qarray.qdtype(d) for d in pair)
    xs = rng.choice(X_SCALES) if exact_scales else rng.uniform(0.001, 0.1)
    x = QArray.from_int(rng.integers(xd.qmin, xd.qmax + 1, (n, c, h, wd)), xs,
                        int(rng.integers(xd.qmin, xd.qmax + 1)), xd)
    wshape = (o, c // groups, kh, kw)
    ints = rng.integers(wdt.qmin, wdt.qmax + 1, wshape)
    if per_channel:
        ws = rng.choice(W_SCALES, o) if exact_scales else rng.uniform(0.001, 0.1, o)
        w = QArray.from_int(ints, ws, rng.integers(wdt.qmin, wdt.qmax + 1, o), wdt, axis=0)
    else:
        ws = rng.choice(W_SCALES) if exact_scales else rng.uniform(0.001, 0.1)
        w = QArray.from_int(ints, ws, int(rng.integers(wdt.qmin, wdt.qmax + 1)), wdt)
    return x, w, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def reference_acc(x, w, stride=1, padding=0, dilation=1, groups=1):
    """sum over (c, i, j) of (x - zx) * (w - zw), by direct loops over the kernel, in int64."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    xi = x.data.astype(np.int64) - int(x.zero_point)
    zw = np.asarray(w.zero_point, np.int64)
    wi = w.data.astype(np.int64) - (zw.reshape(-1, 1, 1, 1) if w.axis is not None else zw)
    xi = np.pad(xi, ((0, 0), (0, 0), (ph, ph), (pw, pw)))  # (x - zx) padded with 0
    n, _, h, wd = xi.shape
    o, cg, kh, kw = wi.shape
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (wd - dw * (kw - 1) - 1) // sw + 1
    og = o // groups
    out = np.zeros((n, o, oh, ow), np.int64)
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xi[:, g * cg:(g + 1) * cg, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                           j * dw:j * dw + sw * (ow - 1) + 1:sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, wi[g * og:(g + 1) * og, :, i, j])
    return out


def acc_scale(x, w):
    return np.float32(x.scale) * np.asarray(w.scale, np.float32)


def ran_conv_kernels(backend, groups, since=0):
    """On the host-run CUDA backend: the launches from ``since`` on include
    conv2d's own kernels, im2col into the GEMM (cuBLAS, then our epilogue: every
    CONFIGS entry of groups 1 has over 16 rows) or the direct grouped kernel,
    never the generic fallback. True on the other backends."""
    new = backend.launched[since:]
    want = ("im2col_", "gemm_epilogue_") if groups == 1 else ("conv_grouped_",)
    return backend.name != "cuda_host" or all(any(n.startswith(p) for n in new) for p in want)


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_accumulator_is_exact(pair, cfg, backend):
    rng = np.random.default_rng(100 * PAIRS.index(pair) + CONFIGS.index(cfg))
    x, w, kw = make_operands(rng, pair, cfg)
    out = backend.run(conv2d, x, w, **kw)
    assert ran_conv_kernels(backend, kw["groups"]), backend.launched
    ref = reference_acc(x, w, **kw)
    assert out.dtype is qint32 and out.data.dtype == np.int32
    np.testing.assert_array_equal(out.int_repr(), ref)
    np.testing.assert_array_equal(out.scale, acc_scale(x, w))
    assert not np.any(out.zero_point)
    assert out.axis == (1 if w.axis is not None else None)
    since = len(backend.launched)
    relu = backend.run(conv2d, x, w, **kw, relu=True)
    np.testing.assert_array_equal(relu.int_repr(), np.maximum(ref, 0))
    assert ran_conv_kernels(backend, kw["groups"], since), backend.launched[since:]


@pytest.mark.parametrize("mode", ["fixed", "float"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_requantized_equals_requantizing_the_accumulator(pair, cfg, mode, backend):
    rng = np.random.default_rng(10_000 + 100 * PAIRS.index(pair) + CONFIGS.index(cfg))
    x, w, kw = make_operands(rng, pair, cfg, exact_scales=mode == "fixed")
    o = w.shape[0]
    s_acc = acc_scale(x, w)
    ref = reference_acc(x, w, **kw)
    per_channel = w.axis is not None
    for bias_kind, relu in (("float", False), ("qint32", True), (None, True)):
        bias, bias_ints = None, 0
        if bias_kind == "float":
            bias = rng.normal(0, 2, o).astype(np.float32)
            bias_ints = np.rint(bias / np.broadcast_to(s_acc, (o,))).astype(np.int64)
        elif bias_kind == "qint32":
            bias_ints = rng.integers(-500, 500, o)
            bias = QArray.from_int(bias_ints, s_acc, 0, qint32, axis=0 if per_channel else None)
        total = ref + np.reshape(bias_ints, (1, -1, 1, 1))
        out_d = qarray.qdtype(rng.choice(["quint8", "qint8", "qint4"]))
        real = total * np.reshape(s_acc, (1, -1, 1, 1) if per_channel else ())
        s_out = np.float32(max(np.ptp(real), 1e-3) / (out_d.qmax - out_d.qmin) * 0.8)
        z_out = int(rng.integers(out_d.qmin, out_d.qmax + 1))
        since = len(backend.launched)
        out = backend.run(conv2d, x, w, bias, **kw, scale=s_out, zero_point=z_out, dtype=out_d, relu=relu, mode=mode)
        # requantized in the kernels' epilogue, every bias kind
        assert ran_conv_kernels(backend, kw["groups"], since), backend.launched[since:]
        acc_q = QArray.from_int(total, s_acc, 0, qint32, axis=1 if per_channel else None)
        want = acc_q.requantize(s_out, z_out, out_d, mode=mode).int_repr()
        if relu:
            want = np.maximum(want, z_out)
        assert out.dtype is out_d and out.axis is None
        assert out.scale == s_out and out.zero_point == z_out
        np.testing.assert_array_equal(out.int_repr(), want, err_msg=f"{mode} {bias_kind}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_matches_torch(cfg):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    for pair in PAIRS:
        x, w, kw = make_operands(rng, pair, cfg)
        xi = torch.from_numpy(x.data.astype(np.float64) - float(x.zero_point))
        zw = np.asarray(w.zero_point, np.float64)
        wi = torch.from_numpy(w.data.astype(np.float64) - (zw.reshape(-1, 1, 1, 1) if w.axis is not None else zw))
        want = torch.nn.functional.conv2d(xi, wi, None, _pair(kw["stride"]), _pair(kw["padding"]),
                                          _pair(kw["dilation"]), kw["groups"]).numpy()
        np.testing.assert_array_equal(conv2d(x, w, **kw).int_repr(), want)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_shapes_property(data):
    d = data.draw
    groups = d(st.integers(1, 3))
    c, o = groups * d(st.integers(1, 3)), groups * d(st.integers(1, 3))
    kh, kw, dh, dw = d(st.integers(1, 3)), d(st.integers(1, 3)), d(st.integers(1, 2)), d(st.integers(1, 2))
    ph, pw = d(st.integers(0, 2)), d(st.integers(0, 2))
    h = d(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 8))
    wd = d(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 8))
    stride = (d(st.integers(1, 3)), d(st.integers(1, 3)))
    cfg = ((d(st.integers(1, 2)), c, h, wd), (o, kh, kw), stride, (ph, pw), (dh, dw), groups, d(st.booleans()))
    pair = d(st.sampled_from(PAIRS))
    x, w, kwargs = make_operands(np.random.default_rng(d(st.integers(0, 2**32 - 1))), pair, cfg)
    np.testing.assert_array_equal(conv2d(x, w, **kwargs).int_repr(), reference_acc(x, w, **kwargs))


def test_1x1_conv_equals_linear(kernels):
    rng = np.random.default_rng(3)
    x, w, _ = make_operands(rng, ("quint8", "qint8"), CONFIGS[4])
    bias = rng.normal(size=w.shape[0]).astype(np.float32)
    out = conv2d(x, w, bias, scale=0.7, zero_point=100, dtype="quint8")
    n, c, h, wd = x.shape
    lin = qarray.ops.linear(x.transpose(0, 2, 3, 1).reshape(-1, c), w.reshape(w.shape[0], c), bias,
                            scale=0.7, zero_point=100, dtype="quint8")
    np.testing.assert_array_equal(out.int_repr(), lin.int_repr().reshape(n, h, wd, -1).transpose(0, 3, 1, 2))


def test_defaults_and_wide_accumulator(kernels):
    x = QArray.from_int(np.full((1, 64, 6, 6), 255), 0.5, 0, "quint8")
    w = QArray.from_int(np.full((2, 64, 5, 5), -128), 0.25, 0, "qint8")
    ref = reference_acc(x, w, padding=2)
    out = conv2d(x, w, padding=2)
    np.testing.assert_array_equal(out.int_repr(), ref)
    q = conv2d(x, w, padding=2, scale=1e4)  # dtype defaults to x.dtype, zero point to 0
    assert q.dtype is x.dtype and q.zero_point == 0
    assert conv2d(x, w, padding=(2, 2), stride=[2, 1]).shape == (1, 2, 3, 6)


def test_empty_batch():
    x = QArray.from_int(np.zeros((0, 2, 5, 5), np.uint8), 0.5, 3, "quint8")
    w = QArray.from_int(np.ones((4, 2, 3, 3), np.int8), 0.5, 0, "qint8")
    assert conv2d(x, w).shape == (0, 4, 3, 3)


def _x(shape=(1, 4, 6, 6), dtype="quint8", **kw):
    return QArray.from_int(np.ones(shape, np.int64), 0.5, 0, dtype, **kw)


def _w(shape=(4, 4, 3, 3), dtype="qint8", **kw):
    return QArray.from_int(np.ones(shape, np.int64), 0.5, 0, dtype, **kw)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: conv2d(_x(), _w((3, 2, 3, 3)), groups=2), ValueError, "does not divide the 3 output"),
    (lambda: conv2d(_x((1, 5, 6, 6)), _w((4, 2, 3, 3)), groups=2), ValueError, "does not divide the 5 input"),
    (lambda: conv2d(_x(), _w((4, 3, 3, 3))), ValueError, "x has 4 channels but w expects 3"),
    (lambda: conv2d(_x(), _w(), padding=-1), ValueError, "padding must be >= 0"),
    (lambda: conv2d(_x(), _w(), stride=0), ValueError, "stride must be >= 1"),
    (lambda: conv2d(_x(), _w(), dilation=(1, 0)), ValueError, "dilation must be >= 1"),
    (lambda: conv2d(_x(), _w(), stride=(1, 2, 3)), TypeError, "stride must be an int or a pair"),
    (lambda: conv2d(_x(), _w(), padding=1.5), TypeError, "padding must be an int or a pair"),
    (lambda: conv2d(_x(), _w(), groups=0), ValueError, "groups must be a positive int"),
    (lambda: conv2d(_x((1, 4, 2, 6)), _w()), ValueError, "larger than the padded input"),
    (lambda: conv2d(_x((1, 4, 6, 6)), _w(), dilation=3), ValueError, "larger than the padded input"),
    (lambda: conv2d(_x((4, 6, 6)), _w()), ValueError, r"x must have shape \(N, C, H, W\)"),
    (lambda: conv2d(_x(), _w((4, 4, 3))), ValueError, "w must have shape"),
    (lambda: conv2d(_x(), _w(axis=1)), ValueError, "along axis 0"),
    (lambda: conv2d(_x(axis=1), _w()), ValueError, "must have per-tensor parameters"),
    (lambda: conv2d(_x(dtype="qint32"), _w()), TypeError, "x has dtype qint32; .* inputs of 2, 4, 8 or 16 bits"),
    (lambda: conv2d(_x(), _w(dtype="qint16")), TypeError, "w has dtype qint16; .* weights of 2, 4 or 8 bits"),
    (lambda: conv2d(_x(), _w(dtype="qint32")), TypeError, "qint32"),
    (lambda: conv2d(np.ones((1, 4, 6, 6)), _w()), TypeError, "x must be a QArray"),
    (lambda: conv2d(_x(), np.ones((4, 4, 3, 3))), TypeError, "w must be a QArray"),
    (lambda: conv2d(_x(), _w(), np.ones(3, np.float32)), ValueError, r"bias must be a float array of shape \(4,\)"),
    (lambda: conv2d(_x(), _w(), np.ones(4, np.int64)), ValueError, "bias must be a float array"),
    (lambda: conv2d(_x(), _w(), zero_point=3), ValueError, "pass the output scale="),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_docstring_examples():
    import qarray.nn
    import qarray.ops.conv

    for module in (qarray.ops.conv, qarray.nn):
        result = doctest.testmod(module, extraglobs={"numpy": np, "qarray": qarray, "QArray": QArray},
                                 optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0 and result.attempted > 0, module.__name__


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("pair", [("quint8", "qint8"), ("qint8", "quint8"), ("qint16", "qint8"), ("quint16", "qint4")],
                         ids="-".join)
def test_extreme_codes_and_zero_points(pair, cfg, kernels):
    """Codes only at qmin/qmax, zero points at both ends: the largest products
    every path (im2col + GEMM engine, direct grouped kernel, int64 fallback) meets;
    16-bit inputs included (TFLite's 16x8 mode)."""
    rng = np.random.default_rng(7)
    (n, c, h, wd), (o, kh, kw), stride, padding, dilation, groups, per_channel = cfg
    xd, wdt = (qarray.qdtype(d) for d in pair)
    for zx, zw in [(xd.qmin, wdt.qmax), (xd.qmax, wdt.qmin)]:
        xc = rng.choice([xd.qmin, xd.qmax], (n, c, h, wd))
        wc = rng.choice([wdt.qmin, wdt.qmax], (o, c // groups, kh, kw))
        x = QArray.from_int(xc, 0.5, zx, xd)
        w = (QArray.from_int(wc, np.full(o, 0.25, np.float32), np.full(o, zw), wdt, axis=0) if per_channel
             else QArray.from_int(wc, 0.25, zw, wdt))
        kw_ = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        ref = reference_acc(x, w, **kw_)
        if np.abs(ref).max() < 2**31:
            np.testing.assert_array_equal(conv2d(x, w, **kw_).int_repr(), ref)
        shift = 4 if xd.bits == 8 else 15  # real value ref / 8; output code ref / 2**shift, half up, clamped
        out = conv2d(x, w, **kw_, scale=2.0 ** (shift - 3), zero_point=0, dtype="qint16", rounding="half_up")
        want = np.clip(np.floor(ref / 2.0**shift + 0.5), -32768, 32767)
        assert np.abs(want).max() > 8  # rounding at work, far from 0
        np.testing.assert_array_equal(out.int_repr(), want.astype(np.int64))


# -- conv_transpose2d: conv2d of the input spread out by the stride --------------------
# (N, C, H, W), (O / groups, kh, kw), stride, padding, output_padding, dilation, groups, per_channel
T_CONFIGS = [
    ((2, 3, 4, 5), (2, 3, 3), 1, 0, 0, 1, 1, False),
    ((1, 4, 5, 4), (3, 3, 2), 2, 1, 1, 1, 1, True),
    ((2, 4, 3, 5), (2, 2, 3), (2, 3), (0, 1), (1, 2), (2, 1), 2, True),
    ((1, 6, 4, 4), (1, 3, 3), 2, 1, 0, 1, 6, True),  # depthwise
    ((2, 2, 10, 9), (2, 2, 2), 1, 3, 0, 2, 1, False),  # padding beyond the kernel: the edges are cropped
]


def reference_transpose_acc(x, w, stride, padding, output_padding, dilation, groups):
    """``out[n, g*Og + j, y, x] += (x - zx)[n, c, iy, ix] * (w - zw)[c, j, a, b]`` at
    ``y = iy*sh - ph + a*dh``: the scatter that defines the transposed conv, in int64."""
    (sh, sw), (ph, pw), (oph, opw), (dh, dw) = (_pair(v) for v in (stride, padding, output_padding, dilation))
    xi = x.data.astype(np.int64) - int(x.zero_point)
    zw = np.asarray(w.zero_point, np.int64)
    wi = w.data.astype(np.int64) - (zw.reshape(1, -1, 1, 1) if w.axis is not None else zw)
    n, c, h, wd = xi.shape
    _, og, kh, kw = wi.shape
    oh, ow = (h - 1) * sh - 2 * ph + dh * (kh - 1) + oph + 1, (wd - 1) * sw - 2 * pw + dw * (kw - 1) + opw + 1
    out = np.zeros((n, og * groups, oh, ow), np.int64)
    cg = c // groups
    for ci in range(c):
        g = ci // cg
        for a in range(kh):
            for b in range(kw):
                for iy in range(h):
                    y = iy * sh - ph + a * dh
                    xs = np.arange(wd) * sw - pw + b * dw
                    ok = (xs >= 0) & (xs < ow)
                    if 0 <= y < oh and ok.any():
                        out[:, g * og:(g + 1) * og, y, xs[ok]] += (xi[:, ci, iy, ok][:, None, :]
                                                                   * wi[ci, :, a, b][None, :, None])
    return out


def make_transpose_operands(rng, pair, cfg):
    (n, c, h, wd), (og, kh, kw), stride, padding, out_pad, dilation, groups, per_channel = cfg
    xd, wdt = (qarray.qdtype(d) for d in pair)
    x = QArray.from_int(rng.choice([xd.qmin, xd.qmax, (xd.qmin + xd.qmax) // 2], (n, c, h, wd)),
                        rng.choice(X_SCALES), int(rng.choice([xd.qmin, xd.qmax])), xd)
    ints = rng.choice([wdt.qmin, wdt.qmax, 0, 1], (c, og, kh, kw))
    if per_channel:
        w = QArray.from_int(ints, rng.choice(W_SCALES, og), rng.choice([wdt.qmin, wdt.qmax], og), wdt, axis=1)
    else:
        w = QArray.from_int(ints, rng.choice(W_SCALES), int(rng.choice([wdt.qmin, wdt.qmax])), wdt)
    return x, w, dict(stride=stride, padding=padding, output_padding=out_pad, dilation=dilation, groups=groups)


@pytest.mark.parametrize("cfg", T_CONFIGS, ids=range(len(T_CONFIGS)))
@pytest.mark.parametrize("pair", [("quint8", "qint8"), ("qint8", "quint8"), ("qint4", "qint8")], ids="-".join)
def test_conv_transpose2d_accumulator_is_exact(pair, cfg, backend):
    """The exact accumulator against the scatter reference on every backend, with
    codes and zero points at both ends of both dtypes, per-channel weights along
    axis 1, groups and depthwise; requantized, it is the accumulator requantized."""
    from qarray.ops.conv import conv_transpose2d

    rng = np.random.default_rng(T_CONFIGS.index(cfg))
    x, w, kw = make_transpose_operands(rng, pair, cfg)
    out = backend.run(conv_transpose2d, x, w, **kw)
    ref = reference_transpose_acc(x, w, **kw)
    assert out.dtype is qint32 and out.axis == (1 if w.axis is not None else None)
    np.testing.assert_array_equal(out.int_repr(), ref)
    assert ran_conv_kernels(backend, kw["groups"]), backend.launched
    s_acc = np.float32(x.scale) * np.tile(np.asarray(w.scale, np.float32), kw["groups"] if w.axis is not None else 1)
    np.testing.assert_array_equal(out.scale, s_acc if w.axis is not None else s_acc[0])
    got = backend.run(conv_transpose2d, x, w, **kw, scale=0.5, zero_point=3, dtype="qint8")
    want = QArray.from_int(ref, out.scale, 0, qint32, axis=out.axis).requantize(0.5, 3, "qint8").int_repr()
    np.testing.assert_array_equal(got.int_repr(), want)


def test_conv_transpose2d_matches_torch(rng):
    """PyTorch's float64 conv_transpose2d on the integer values (exact at these sizes)."""
    torch = pytest.importorskip("torch")
    from qarray.ops.conv import conv_transpose2d

    for cfg in T_CONFIGS:
        x, w, kw = make_transpose_operands(rng, ("quint8", "qint8"), cfg)
        zw = np.asarray(w.zero_point, np.int64).reshape(1, -1, 1, 1) if w.axis is not None else int(w.zero_point)
        want = torch.nn.functional.conv_transpose2d(
            torch.tensor(x.int_repr().astype(np.float64) - int(x.zero_point)),
            torch.tensor(w.int_repr().astype(np.float64) - zw), **kw).numpy()
        np.testing.assert_array_equal(conv_transpose2d(x, w, **kw).int_repr(), want)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(output_padding=2, stride=2), ValueError, "output_padding must be smaller than stride or dilation"),
    (dict(stride=0), ValueError, "stride must be >= 1"),
    (dict(groups=3), ValueError, "groups=3 does not divide"),
])
def test_conv_transpose2d_errors(kwargs, exc, match):
    from qarray.ops.conv import conv_transpose2d

    x = QArray.from_int(np.zeros((1, 4, 3, 3), np.int64), 0.5, 0, "qint8")
    w = QArray.from_int(np.zeros((4, 2, 2, 2), np.int64), 0.5, 0, "qint8")
    with pytest.raises(exc, match=match):
        conv_transpose2d(x, w, **kwargs)
    with pytest.raises(ValueError, match="x has 3 channels but w has 4 input channels"):
        conv_transpose2d(QArray.from_int(np.zeros((1, 3, 3, 3), np.int64), 0.5, 0, "qint8"), w)
    wc = QArray.from_int(np.zeros((4, 2, 2, 2), np.int64), np.full(4, 0.5, np.float32), 0, "qint8", axis=0)
    with pytest.raises(ValueError, match="parameters along axis 1"):
        conv_transpose2d(x, wc)


# -- conv2d_weight_grad: conv2d of x and grad_out with batch and channels swapped -------
# (N, C, H, W), (O, kh, kw), stride, padding, dilation, groups
G_CONFIGS = [
    ((2, 3, 6, 5), (4, 3, 2), 1, 0, 1, 1),
    ((3, 4, 9, 8), (6, 3, 3), 2, 1, 1, 2),
    ((2, 4, 9, 9), (4, 3, 2), (2, 3), (1, 0), (2, 1), 4),  # depthwise; OH's floor leaves rows over
    ((4, 2, 7, 7), (3, 2, 2), 3, 2, 2, 1),
]


def reference_weight_grad(x, w_shape, g, stride, padding, dilation, groups):
    """``dw[o, c, a, b] = sum (g - zg)[n, o, oy, ox] * (x - zx)[n, group c, oy*sh - ph + a*dh, ...]`` in int64."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    xi = np.pad(x.data.astype(np.int64) - int(x.zero_point), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    gi = g.data.astype(np.int64) - int(g.zero_point)
    o, cg, kh, kw = w_shape
    _, _, oh, ow = gi.shape
    og = o // groups
    out = np.zeros(w_shape, np.int64)
    for oc in range(o):
        grp = oc // og
        for a in range(kh):
            for b in range(kw):
                patch = xi[:, grp * cg:(grp + 1) * cg, a * dh:a * dh + sh * (oh - 1) + 1:sh,
                           b * dw:b * dw + sw * (ow - 1) + 1:sw]
                out[oc, :, a, b] = np.einsum("nchw,nhw->c", patch, gi[:, oc])
    return out


def make_grad_operands(rng, cfg):
    (n, c, h, wd), (o, kh, kw), stride, padding, dilation, groups = cfg
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    x = QArray.from_int(rng.choice([0, 255, 128], (n, c, h, wd)), 0.375, int(rng.choice([0, 255])), "quint8")
    g = QArray.from_int(rng.choice([-128, 127, 0, 1], (n, o, oh, ow)), 0.25, int(rng.choice([-128, 127])), "qint8")
    return x, (o, c // groups, kh, kw), g, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


@pytest.mark.parametrize("cfg", G_CONFIGS, ids=range(len(G_CONFIGS)))
def test_conv2d_weight_grad_is_exact(cfg, backend):
    """Against the int64 definition on every backend, codes and zero points at both
    ends; requantized, the accumulator requantized."""
    from qarray.ops.conv import conv2d_weight_grad

    x, ws, g, kw = make_grad_operands(np.random.default_rng(G_CONFIGS.index(cfg)), cfg)
    out = backend.run(conv2d_weight_grad, x, ws, g, **kw)
    ref = reference_weight_grad(x, ws, g, **kw)
    assert out.shape == ws and out.dtype is qint32 and out.scale == np.float32(0.375 * 0.25)
    np.testing.assert_array_equal(out.int_repr(), ref)
    got = backend.run(conv2d_weight_grad, x, ws, g, **kw, scale=64.0, zero_point=-3, dtype="qint8")
    want = QArray.from_int(ref, out.scale, 0, qint32).requantize(64.0, -3, "qint8").int_repr()
    np.testing.assert_array_equal(got.int_repr(), want)


def test_conv2d_weight_grad_matches_torch(rng):
    """``torch.nn.grad.conv2d_weight`` in float64 on the integer values (exact at these sizes)."""
    torch = pytest.importorskip("torch")
    from qarray.ops.conv import conv2d_weight_grad

    for cfg in G_CONFIGS:
        x, ws, g, kw = make_grad_operands(rng, cfg)
        want = torch.nn.grad.conv2d_weight(torch.tensor(x.int_repr() - float(x.zero_point)), ws,
                                           torch.tensor(g.int_repr() - float(g.zero_point)), **kw).numpy()
        np.testing.assert_array_equal(conv2d_weight_grad(x, ws, g, **kw).int_repr(), want)


def test_conv2d_weight_grad_errors():
    from qarray.ops.conv import conv2d_weight_grad

    x = QArray.from_int(np.zeros((2, 4, 5, 5), np.int64), 0.5, 0, "qint8")
    g = QArray.from_int(np.zeros((2, 6, 3, 3), np.int64), 0.5, 0, "qint8")
    with pytest.raises(ValueError, match=r"grad_out must be \(2, 6, 4, 4\)"):
        conv2d_weight_grad(x, (6, 4, 2, 2), g)
    with pytest.raises(ValueError, match="groups=4 does not divide the 6 output channels"):
        conv2d_weight_grad(x, (6, 1, 3, 3), g, groups=4)
    with pytest.raises(ValueError, match="weight_shape"):
        conv2d_weight_grad(x, (6, 4, 3), g)
