"""qarray against the ONNX reference implementation, bit for bit.

Each test builds a one-node ONNX model (QuantizeLinear, DequantizeLinear or
DynamicQuantizeLinear), runs it with ``onnx.reference.ReferenceEvaluator`` and
compares its output with qarray's: the numeric contract of DESIGN.md
("Numerics") is meant to equal these operators exactly.

Notes on the reference (onnx >= 1.20, opset 25):

- ``y_scale`` may have a different type than ``x``, and "the type of y_scale
  determines the precision of the division". We always give ONNX a float32
  scale, so float16 input is divided in float32 on both sides, exactly as the
  contract says. (With a float16 ``y_scale`` ONNX would divide in float16 and
  round the quotient to 11 bits before ``rint``: a different operation.)
- float64 ``x`` is outside the opset-25 schema (T1 has no double), but the
  reference evaluates it with NumPy promotion, i.e. float64 division by the
  float32 scale: the contract for float64 input.
- The reference casts ``rint(x / scale)`` to int32 before adding the zero
  point and clipping, so inputs stay finite and within int32 after division.

Scales come from SCALES: 0.0625, 0.375 and 0.75 have few significant bits, so
``x = (k + 0.5) * scale`` is exact (also in float16 for small k) and
``x / scale`` is an exact rounding tie; 0.375 and 0.75 still make general
division inexact; 0.1 and 0.3 are not exact in binary at all. All scales are
<= 0.75, so that float16 input (max 65504) can saturate 16-bit types.
"""

import numpy as np
import pytest

import qarray

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from _reference import run_onnx  # noqa: E402

OPSET = 25  # the first opset with int2/uint2 (block_size since 21)
if onnx.defs.onnx_opset_version() < OPSET:
    pytest.skip(f"onnx {onnx.__version__} has no opset {OPSET}", allow_module_level=True)

ONNX_TYPE = {
    "qint2": TensorProto.INT2, "quint2": TensorProto.UINT2,
    "qint4": TensorProto.INT4, "quint4": TensorProto.UINT4,
    "qint8": TensorProto.INT8, "quint8": TensorProto.UINT8,
    "qint16": TensorProto.INT16, "quint16": TensorProto.UINT16,
    "qint32": TensorProto.INT32,
}
QUANT_DTYPES = [name for name in ONNX_TYPE if name != "qint32"]  # ONNX quantizes to <= 16 bits
SCALES = np.array([0.0625, 0.375, 0.75, 0.1, 0.3], np.float32)
EXACT_TIE_SCALES = SCALES[:3]
# id -> (shape, axis, block_size)
LAYOUTS = {
    "tensor": ((3, 10), None, None),
    "axis0": ((3, 10), 0, None),
    "axis1": ((2, 5, 4), 1, None),
    "axis-1": ((2, 3, 10), -1, None),
    "block4": ((3, 8), 1, 4),
    "block4-short": ((3, 10), 1, 4),
    "block3-axis0-short": ((10, 3), 0, 3),
}


def onnx_ints(a, name):
    """``a`` as the NumPy (or ml_dtypes) type ONNX uses for ``name``."""
    return np.asarray(a).astype(helper.tensor_dtype_to_np_dtype(ONNX_TYPE[name]))


def param_shape(shape, axis, block_size):
    if axis is None:
        return ()
    if block_size is None:
        return (shape[axis],)
    return tuple(-(-n // block_size) if i == axis % len(shape) else n for i, n in enumerate(shape))


def broadcast_param(p, shape, axis, block_size):
    """A scale or zero point repeated to ``shape`` (the short last block cut)."""
    if axis is None:
        return np.broadcast_to(p, shape)
    if block_size is None:
        dims = [1] * len(shape)
        dims[axis] = -1
        return np.broadcast_to(p.reshape(dims), shape)
    return np.repeat(p, block_size, axis=axis).take(range(shape[axis]), axis=axis)


def quantize_case(name, x_dtype, layout, rng):
    """``(x, scale, zero_point)`` for a quantize test.

    Targets ``x / scale + zero_point`` are integers and half-integers over
    ``[qmin - 3, qmax + 3]``, plus random reals, exact ties next to the zero
    point and two values far beyond each end (saturation).
    """
    d = qarray.qdtype(name)
    shape, axis, block_size = LAYOUTS[layout]
    pshape = param_shape(shape, axis, block_size)
    scale = np.asarray(rng.choice(SCALES, pshape) if pshape else SCALES[1])
    zp = np.asarray(rng.integers(d.qmin, d.qmax, pshape, endpoint=True), np.int32)
    s_full = broadcast_param(scale, shape, axis, block_size).astype(np.float64).reshape(-1)
    z_full = broadcast_param(zp, shape, axis, block_size).reshape(-1)
    q = rng.integers(d.qmin - 3, d.qmax + 3, s_full.size, endpoint=True).astype(np.float64)
    q += rng.choice([0.0, 0.5, -0.5, 0.0], q.size)  # half-integers: ties where scale allows
    q += rng.uniform(-0.02, 0.02, q.size) * (q % 3 == 0)  # some just off an integer or a tie
    span = d.qmax - d.qmin + 1
    q[:2] = [d.qmin - 2 * span, d.qmax + 2 * span]
    # exact ties next to the zero point, where the scale makes them exact
    exact = np.flatnonzero(np.isin(s_full, EXACT_TIE_SCALES))
    q[exact[2:8]] = z_full[exact[2:8]] + np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5])[: exact[2:8].size]
    big = np.finfo(x_dtype).max
    x = np.clip((q - z_full) * s_full, -big, big).astype(x_dtype).reshape(shape)
    return x, scale, zp


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("x_dtype", [np.float32, np.float16, np.float64], ids=lambda t: t.__name__)
@pytest.mark.parametrize("name", QUANT_DTYPES)
def test_quantize_linear(name, x_dtype, layout, kernels):
    rng = np.random.default_rng(0)
    x, scale, zp = quantize_case(name, x_dtype, layout, rng)
    _, axis, block_size = LAYOUTS[layout]
    (want,) = run_onnx("QuantizeLinear", {"x": x, "scale": scale, "zp": onnx_ints(zp, name)},
                       [ONNX_TYPE[name]], OPSET, axis=axis, block_size=block_size)

    q = qarray.quantize(x, scale, zp, name, axis=axis, block_size=block_size)
    got = q.int_repr()
    d = qarray.qdtype(name)
    assert got.dtype == d.storage
    np.testing.assert_array_equal(got, want.astype(d.storage))
    # the data is worth comparing: both ends saturate and exact ties occur
    assert d.qmin in got and d.qmax in got
    t = x.astype(np.float64) / broadcast_param(scale, x.shape, axis, block_size)
    assert (np.abs(t - np.trunc(t)) == 0.5).any()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16], ids=lambda t: t.__name__)
@pytest.mark.parametrize("name", QUANT_DTYPES + ["qint32"])
def test_dequantize_linear(name, out_dtype, layout, kernels):
    rng = np.random.default_rng(0)
    d = qarray.qdtype(name)
    shape, axis, block_size = LAYOUTS[layout]
    pshape = param_shape(shape, axis, block_size)
    ints = rng.integers(d.qmin, d.qmax, shape, endpoint=True)
    ints.reshape(-1)[:2] = [d.qmin, d.qmax]
    # float16 results stay finite (|value| <= 60000): overflow would only warn
    top = 4.0 if out_dtype == np.float32 else min(4.0, 60000 / (d.qmax - d.qmin))
    scale = np.asarray(rng.uniform(1e-3, 1.0, pshape) * top, np.float32)
    if name == "qint32":  # ONNX requires a zero zero point for int32
        zp = np.zeros(pshape, np.int32)
    else:
        zp = np.asarray(rng.integers(d.qmin, d.qmax, pshape, endpoint=True), np.int32)
    out_type = helper.np_dtype_to_tensor_dtype(np.dtype(out_dtype))
    (want,) = run_onnx("DequantizeLinear",
                       {"x": onnx_ints(ints, name), "scale": scale, "zp": onnx_ints(zp, name)},
                       [out_type], OPSET, axis=axis, block_size=block_size, output_dtype=out_type)

    q = qarray.QArray.from_int(ints, scale, zp, name, axis=axis, block_size=block_size)
    got = qarray.dequantize(q, out_dtype)
    assert want.dtype == out_dtype and got.dtype == out_dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(q.dequantize(np.dtype(out_dtype).name), want)


DYNAMIC_INPUTS = {
    "normal": lambda rng: rng.standard_normal((4, 8)),
    "positive": lambda rng: rng.uniform(0.5, 3.0, (3, 10)),
    "negative": lambda rng: rng.uniform(-3.0, -0.5, (3, 10)),
    "zeros": lambda rng: np.zeros((2, 5)),
    "constant": lambda rng: np.full((2, 5), 7.25),
    "wide": lambda rng: rng.uniform(-1e4, 3e4, (5, 7)),
    "one-element": lambda rng: np.array([-0.3]),
    "subnormal": lambda rng: rng.uniform(-1e-39, 1e-39, (3, 4)),
}


@pytest.mark.parametrize("case", list(DYNAMIC_INPUTS))
def test_dynamic_quantize_linear(case, kernels):
    x = DYNAMIC_INPUTS[case](np.random.default_rng(0)).astype(np.float32)
    want, want_scale, want_zp = run_onnx(
        "DynamicQuantizeLinear", {"x": x},
        [TensorProto.UINT8, TensorProto.FLOAT, TensorProto.UINT8], OPSET)

    q = qarray.quantize_dynamic(x, "quint8")
    assert q.int_repr().dtype == np.uint8
    assert q.scale.dtype == np.float32 and q.zero_point.dtype == np.int32
    np.testing.assert_array_equal(q.int_repr(), want)
    np.testing.assert_array_equal(q.scale, want_scale)
    np.testing.assert_array_equal(q.zero_point, want_zp.astype(np.int32))
