"""ONNX's own node tests for its quantization operators, run through qarray bit
for bit: every case that ``onnx.backend.test.case.node`` has for
QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul and
QLinearConv (39 in onnx 1.20: integer types of 2 to 32 bits, per tensor,
axis and block, float8 and float4, float16 scales), with the inputs and
expected outputs as ONNX wrote them."""

import warnings

import numpy as np
import pytest

import qarray
from qarray import QArray

pytest.importorskip("ml_dtypes")
onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearMatMul", "QLinearConv")
QTYPES = {"uint8": "quint8", "int8": "qint8", "uint16": "quint16", "int16": "qint16", "int32": "qint32",
          "uint4": "quint4", "int4": "qint4", "uint2": "quint2", "int2": "qint2", "float8_e4m3fn": "float8_e4m3fn",
          "float8_e5m2": "float8_e5m2", "float4_e2m1fn": "float4_e2m1fn"}


def _cases():
    import onnx.backend.test.case.node as nodes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [c for c in nodes.collect_testcases(None) if c.model.graph.node[0].op_type in OPS]


CASES = _cases()


def _array(a):
    return numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else np.asarray(a)


def _codes(a):
    """Integer codes of an ONNX integer tensor (ml_dtypes int4/int2 included) as int64."""
    return a.astype(np.int64)


def _zero(zp, scale):
    return np.zeros(np.shape(scale), np.int32) if zp is None else _codes(zp).reshape(np.shape(scale)).astype(np.int32)


def _same_codes(q, want):
    if q.dtype.kind == "float":
        np.testing.assert_array_equal(q.int_repr(), want.view(np.uint8))
    else:
        np.testing.assert_array_equal(q.int_repr().astype(np.int64), _codes(want))


def test_every_case_is_collected():
    counts = {op: sum(c.model.graph.node[0].op_type == op for c in CASES) for op in OPS}
    assert counts == {"QuantizeLinear": 13, "DequantizeLinear": 14, "DynamicQuantizeLinear": 3, "QLinearMatMul": 8,
                      "QLinearConv": 1}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_onnx_node_case(case):
    node = case.model.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    for inputs, outputs in case.data_sets:
        ins, outs = [_array(a) for a in inputs], [_array(a) for a in outputs]
        run = {"QuantizeLinear": _quantize, "DequantizeLinear": _dequantize, "DynamicQuantizeLinear": _dynamic,
               "QLinearMatMul": _qlinearmatmul, "QLinearConv": _qlinearconv}[node.op_type]
        run(case, attrs, ins, outs)


def _layout(scale, attrs):
    if np.ndim(scale) == 0:
        return None, None
    return attrs.get("axis", 1), attrs.get("block_size") or None


def _quantize(case, attrs, ins, outs):
    x, scale, zp = ins[0], ins[1], ins[2] if len(ins) > 2 else None
    (want,) = outs
    axis, block = _layout(scale, attrs)
    d = QTYPES[want.dtype.name]
    zpv = 0 if qarray.qdtype(d).kind == "float" else _zero(zp, scale)
    kw = {"saturate": bool(attrs.get("saturate", 1))} if qarray.qdtype(d).kind == "float" else {}
    q = qarray.quantize(x, scale, zpv, d, axis=axis, block_size=block, **kw)
    _same_codes(q, want)


def _dequantize(case, attrs, ins, outs):
    x, scale, zp = ins[0], ins[1], ins[2] if len(ins) > 2 else None
    (want,) = outs
    axis, block = _layout(scale, attrs)
    d = qarray.qdtype(QTYPES[x.dtype.name])
    if d.kind == "float":
        assert zp is None or not np.any(zp.astype(np.float32))
        q = QArray.from_int(x, scale.astype(np.float32), 0, d, axis, block)
    else:
        q = QArray.from_int(_codes(x), scale.astype(np.float32), _zero(zp, scale), d, axis, block)
    got = q.dequantize(want.dtype)  # a float16 scale gives float16, as ONNX's
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _dynamic(case, attrs, ins, outs):
    (x,) = ins
    y, scale, zp = outs
    q = qarray.quantize_dynamic(x, "quint8")
    np.testing.assert_array_equal(q.int_repr(), y)
    assert q.scale == scale and q.zero_point == zp


def _scalar(v, dtype):
    return np.asarray(v).reshape(-1)[0].astype(dtype) if np.size(v) == 1 else np.asarray(v).astype(dtype)


def _qlinearmatmul(case, attrs, ins, outs):
    a, sa, za, b, sb, zb, sy, zy = ins
    (want,) = outs
    d = QTYPES[want.dtype.name]
    qa_ = QArray.from_int(a, _scalar(sa, np.float32), _scalar(za, np.int32), QTYPES[a.dtype.name])
    qb_ = QArray.from_int(b, _scalar(sb, np.float32), _scalar(zb, np.int32), QTYPES[b.dtype.name])
    got = qarray.matmul(qa_, qb_, scale=_scalar(sy, np.float32), zero_point=int(_scalar(zy, np.int64)), dtype=d)
    np.testing.assert_array_equal(got.int_repr(), want)


def _qlinearconv(case, attrs, ins, outs):
    x, sx, zx, w, sw, zw, sy, zy = ins
    (want,) = outs
    qx = QArray.from_int(x, _scalar(sx, np.float32), _scalar(zx, np.int32), QTYPES[x.dtype.name])
    axis = 0 if np.size(sw) > 1 else None
    qw = QArray.from_int(w, _scalar(sw, np.float32), _scalar(zw, np.int32), QTYPES[w.dtype.name], axis)
    got = qarray.conv2d(qx, qw, scale=_scalar(sy, np.float32), zero_point=int(_scalar(zy, np.int64)),
                        dtype=QTYPES[want.dtype.name])
    np.testing.assert_array_equal(got.int_repr(), want)
