"""qarray's matmul and conv2d against the ONNX reference implementation, bit for bit.

Each test builds a one-node ONNX model (MatMulInteger, QLinearMatMul,
ConvInteger or QLinearConv), runs it with ``onnx.reference.ReferenceEvaluator``
and compares its integer output with qarray's:

- no output parameters: the exact qint32 accumulator (MatMulInteger, ConvInteger);
- ``scale``, ``zero_point``, ``dtype`` and ``mode="float"``: the requantized
  result, which DESIGN.md ("Numerics") defines as the ONNX computation
  ``rint(float64(acc) * float32(a_scale * b_scale / y_scale) + y_zp)``.

Notes on the reference: QLinearConv clips before ``np.round`` (half to even,
like ``rint``); clipping to integer bounds first changes nothing. Its int32
bias ``B`` is at scale ``x_scale * w_scale``; qarray takes it as a qint32
QArray at exactly that float32 scale, so it uses the integers unchanged.

Scale kinds: "random" scales are arbitrary float32 and values span the whole
range; "pow2" makes every scale a power of two, so the multiplier is one too,
and keeps values and zero points near the middle of the range, so that
accumulators are small and ``acc * multiplier`` hits exact ties (where rint
differs from rounding half away). The output scale is chosen
from the exact accumulator so that results spread over the output range and
some saturate.
"""

import numpy as np
import pytest

import qarray

onnx = pytest.importorskip("onnx")
from onnx import TensorProto  # noqa: E402

from _reference import run_onnx  # noqa: E402

OPSET = 21  # QLinearMatMul-21; MatMulInteger, ConvInteger and QLinearConv are opset 10
if onnx.defs.onnx_opset_version() < OPSET:
    pytest.skip(f"onnx {onnx.__version__} has no opset {OPSET}", allow_module_level=True)

NP_TYPE = {"quint8": np.uint8, "qint8": np.int8}
ONNX_TYPE = {"quint8": TensorProto.UINT8, "qint8": TensorProto.INT8}
PAIRS = [(a, b) for a in NP_TYPE for b in NP_TYPE]
# (input, weight, output) dtypes for the requantizing ops
TRIPLES = [("quint8", "qint8", "quint8"), ("qint8", "qint8", "qint8"),
           ("quint8", "quint8", "qint8"), ("qint8", "quint8", "quint8")]
SCALE_KINDS = ["pow2", "random"]

MM_SHAPES = [(1, 7, 33), (5, 300, 3), (4, 16, 1), (3, 1, 5), (8, 64, 17)]
# id -> (x shape NCHW, w shape (O, C/g, kh, kw), stride, padding, dilation, groups)
CONV_CASES = {
    "plain": ((1, 3, 7, 7), (4, 3, 3, 3), 1, 0, 1, 1),
    "stride2-pad1": ((2, 3, 9, 8), (5, 3, 3, 3), 2, 1, 1, 1),
    "dilation2": ((1, 2, 10, 11), (3, 2, 3, 3), 1, 1, 2, 1),
    "groups2": ((1, 4, 8, 8), (6, 2, 3, 3), 2, 1, 1, 2),
    "depthwise": ((2, 5, 6, 7), (5, 1, 3, 3), 1, 1, 1, 5),
    "1x1-wide": ((1, 7, 5, 3), (33, 7, 1, 1), 1, 0, 1, 1),
    "rect-kernel": ((1, 3, 6, 9), (4, 3, 2, 5), 1, 1, 1, 1),
    "deep": ((1, 32, 5, 5), (4, 32, 3, 3), 1, 1, 1, 1),
    "all": ((1, 4, 11, 10), (4, 2, 3, 3), 2, 1, 2, 2),
}


def rand_ints(rng, name, shape, narrow=False):
    """Random values of ``name`` over its whole range, both ends included, or
    (``narrow``) within 6 of the middle of the range."""
    d = qarray.qdtype(name)
    if narrow:
        return ((d.qmin + d.qmax) // 2 + rng.integers(-6, 6, shape, endpoint=True)).astype(NP_TYPE[name])
    v = rng.integers(d.qmin, d.qmax, shape, endpoint=True)
    v.reshape(-1)[: min(2, v.size)] = [d.qmin, d.qmax][: min(2, v.size)]
    return v.astype(NP_TYPE[name])


def rand_zp(rng, name, shape=(), narrow=False):
    d = qarray.qdtype(name)
    lo, hi = ((d.qmin + d.qmax) // 2 - 3, (d.qmin + d.qmax) // 2 + 3) if narrow else (d.qmin, d.qmax)
    return np.asarray(rng.integers(lo, hi, shape, endpoint=True)).astype(NP_TYPE[name])


def out_zp(rng, name):
    d = qarray.qdtype(name)
    return np.asarray((d.qmin + d.qmax) // 2 + rng.integers(-30, 30)).astype(NP_TYPE[name])


def rand_scales(rng, kind, shape=()):
    if kind == "pow2":
        return np.asarray(2.0 ** -rng.integers(2, 7, shape), np.float32)
    return np.asarray(rng.uniform(1e-3, 5e-2, shape), np.float32)


def out_scale(kind, a_scale, b_scale, acc):
    """An output scale that maps ``max|acc|`` to about 150 steps."""
    s = float(a_scale) * float(np.max(b_scale)) * max(int(np.abs(acc).max()), 1) / 150
    return np.float32(2.0 ** np.floor(np.log2(s)) if kind == "pow2" else s)


def wrap(ints, scale, zp, name, axis=None):
    return qarray.QArray.from_int(ints, scale, zp.astype(np.int32), name, axis=axis)


def check_requantized(got, want, name):
    d = qarray.qdtype(name)
    assert want.dtype == NP_TYPE[name] and got.dtype == d.storage
    np.testing.assert_array_equal(got, want)
    assert np.ptp(want.astype(np.int32)) > 0  # not all one value


# -- matmul ------------------------------------------------------------------

def mm_case(shape, a_name, b_name, per_column, kind="random"):
    rng = np.random.default_rng(0)
    m, k, n = shape
    nw = kind == "pow2"
    a, b = rand_ints(rng, a_name, (m, k), nw), rand_ints(rng, b_name, (k, n), nw)
    pshape = (n,) if per_column else ()
    za, zb = rand_zp(rng, a_name, (), nw), rand_zp(rng, b_name, pshape, nw)
    sa, sb = rand_scales(rng, kind), rand_scales(rng, kind, pshape)
    acc = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)
    return rng, a, b, za, zb, sa, sb, acc


@pytest.mark.parametrize("per_column", [False, True], ids=["tensor", "column"])
@pytest.mark.parametrize("a_name, b_name", PAIRS)
@pytest.mark.parametrize("shape", MM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_integer(shape, a_name, b_name, per_column, kernels):
    _, a, b, za, zb, sa, sb, acc = mm_case(shape, a_name, b_name, per_column)
    (want,) = run_onnx("MatMulInteger", {"a": a, "b": b, "a_zero_point": za, "b_zero_point": zb},
                       [TensorProto.INT32], OPSET)
    got = qarray.matmul(wrap(a, sa, za, a_name), wrap(b, sb, zb, b_name, 1 if per_column else None))
    assert got.dtype.name == "qint32" and want.dtype == np.int32
    np.testing.assert_array_equal(got.int_repr(), want)
    np.testing.assert_array_equal(want, acc)


@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("per_column", [False, True], ids=["tensor", "column"])
@pytest.mark.parametrize("a_name, b_name, y_name", TRIPLES)
@pytest.mark.parametrize("shape", MM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qlinear_matmul(shape, a_name, b_name, y_name, per_column, kind, kernels):
    rng, a, b, za, zb, sa, sb, acc = mm_case(shape, a_name, b_name, per_column, kind)
    sy, zy = out_scale(kind, sa, sb, acc), out_zp(rng, y_name)
    (want,) = run_onnx("QLinearMatMul", {"a": a, "a_scale": sa, "a_zero_point": za,
                                         "b": b, "b_scale": sb, "b_zero_point": zb,
                                         "y_scale": sy, "y_zero_point": zy}, [ONNX_TYPE[y_name]], OPSET)
    got = qarray.matmul(wrap(a, sa, za, a_name), wrap(b, sb, zb, b_name, 1 if per_column else None),
                        scale=sy, zero_point=int(zy), dtype=y_name, mode="float")
    check_requantized(got.int_repr(), want, y_name)
    assert got.scale == sy and got.zero_point == int(zy)


# -- conv2d ------------------------------------------------------------------

def conv_case(case, x_name, w_name, per_channel, kind="random"):
    rng = np.random.default_rng(0)
    x_shape, w_shape, stride, pad, dil, groups = CONV_CASES[case]
    nw = kind == "pow2"
    x, w = rand_ints(rng, x_name, x_shape, nw), rand_ints(rng, w_name, w_shape, nw)
    pshape = (w_shape[0],) if per_channel else ()
    zx, zw = rand_zp(rng, x_name, (), nw), rand_zp(rng, w_name, pshape, nw)
    sx, sw = rand_scales(rng, kind), rand_scales(rng, kind, pshape)
    attrs = dict(kernel_shape=list(w_shape[2:]), strides=[stride] * 2, pads=[pad] * 4,
                 dilations=[dil] * 2, group=groups)
    kwargs = dict(stride=stride, padding=pad, dilation=dil, groups=groups)
    return rng, x, w, zx, zw, sx, sw, attrs, kwargs


@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("x_name, w_name", PAIRS)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_integer(case, x_name, w_name, per_channel, kernels):
    _, x, w, zx, zw, sx, sw, attrs, kwargs = conv_case(case, x_name, w_name, per_channel)
    (want,) = run_onnx("ConvInteger", {"x": x, "w": w, "x_zero_point": zx, "w_zero_point": zw},
                       [TensorProto.INT32], OPSET, **attrs)
    got = qarray.conv2d(wrap(x, sx, zx, x_name), wrap(w, sw, zw, w_name, 0 if per_channel else None),
                        **kwargs)
    assert got.dtype.name == "qint32" and want.dtype == np.int32
    np.testing.assert_array_equal(got.int_repr(), want)


@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("x_name, w_name, y_name", TRIPLES)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_qlinear_conv(case, x_name, w_name, y_name, per_channel, bias, kind, kernels):
    rng, x, w, zx, zw, sx, sw, attrs, kwargs = conv_case(case, x_name, w_name, per_channel, kind)
    qx, qw = wrap(x, sx, zx, x_name), wrap(w, sw, zw, w_name, 0 if per_channel else None)
    acc = qarray.conv2d(qx, qw, **kwargs).int_repr()  # exact, checked by test_conv_integer
    o = w.shape[0]
    b_ints = rng.integers(-np.abs(acc).max(), np.abs(acc).max(), o, endpoint=True).astype(np.int32)
    acc = acc.astype(np.int64) + b_ints.reshape(-1, 1, 1) * bias
    sy, zy = out_scale(kind, sx, sw, acc), out_zp(rng, y_name)
    inputs = {"x": x, "x_scale": sx, "x_zero_point": zx, "w": w, "w_scale": sw,
              "w_zero_point": zw, "y_scale": sy, "y_zero_point": zy}
    qbias = None
    if bias:
        inputs["B"] = b_ints
        qbias = qarray.QArray.from_int(b_ints, np.float32(sx) * sw, 0, "qint32",
                                       axis=0 if per_channel else None)
    (want,) = run_onnx("QLinearConv", inputs, [ONNX_TYPE[y_name]], OPSET, **attrs)
    got = qarray.conv2d(qx, qw, qbias, **kwargs, scale=sy, zero_point=int(zy), dtype=y_name, mode="float")
    check_requantized(got.int_repr(), want, y_name)
