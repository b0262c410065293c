"""ONNX's own node tests for QuantizeLinear / DequantizeLinear with floating
formats (onnx.backend.test.case.node: test_quantizelinear_e4m3fn, _e5m2,
_float4e2m1; test_dequantizelinear_e4m3fn, _e4m3fn_float16, _e4m3fn_zero_point,
_e5m2, _float4e2m1), their inputs and expected outputs taken as ONNX wrote
them, run through qarray bit for bit."""

import warnings

import numpy as np
import pytest

import qarray
from qarray import QArray

pytest.importorskip("ml_dtypes")
onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

FLOAT_TYPES = {17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2", 20: "float8_e5m2fnuz", 23: "float4_e2m1fn"}


def _cases():
    import onnx.backend.test.case.node as nodes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = nodes.collect_testcases(None)
    out = []
    for c in cases:
        node = c.model.graph.node[0]
        types = [i.type.tensor_type.elem_type for i in c.model.graph.input] + \
                [o.type.tensor_type.elem_type for o in c.model.graph.output]
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and any(t in FLOAT_TYPES for t in types):
            out.append(c)
    return out


CASES = _cases()


def _array(a):
    return numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else np.asarray(a)


def test_the_cases_are_there():
    assert sorted(c.name for c in CASES) == sorted([
        "test_quantizelinear_e4m3fn", "test_quantizelinear_e5m2", "test_quantizelinear_float4e2m1",
        "test_dequantizelinear_e4m3fn", "test_dequantizelinear_e4m3fn_float16", "test_dequantizelinear_e4m3fn_zero_point",
        "test_dequantizelinear_e5m2", "test_dequantizelinear_float4e2m1"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_onnx_node_case(case):
    node = case.model.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    for inputs, outputs in case.data_sets:
        inputs, (want,) = [_array(a) for a in inputs], [_array(a) for a in outputs]
        x, scale = inputs[0], inputs[1]
        if len(inputs) > 2:
            assert not np.any(inputs[2].astype(np.float32)), "a nonzero floating zero point"
        axis = attrs.get("axis", 1) if scale.ndim else None
        saturate = bool(attrs.get("saturate", 1))
        if node.op_type == "QuantizeLinear":
            fmt = FLOAT_TYPES[case.model.graph.output[0].type.tensor_type.elem_type]
            q = qarray.quantize(x, scale.astype(np.float32), 0, fmt, axis=axis, saturate=saturate)
            np.testing.assert_array_equal(q.int_repr(), want.view(np.uint8))
        else:
            fmt = FLOAT_TYPES[case.model.graph.input[0].type.tensor_type.elem_type]
            q = QArray.from_int(x, scale.astype(np.float32), 0, fmt, axis=axis)
            got = q.dequantize(want.dtype)  # float16 scales give float16 output, as ONNX's
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
