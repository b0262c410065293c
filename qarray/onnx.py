"""QArray parameters as ONNX QDQ initializers, and a small QDQ model.

:func:`qdq_params` gives what ``QuantizeLinear`` / ``DequantizeLinear`` take
for a QArray (opset 21: per-tensor, per-axis and blocked; 4, 8 and 16 bits);
:func:`export_qdq` writes a model ``x -> QuantizeLinear -> codes ->
DequantizeLinear -> values`` with a QArray's parameters, which onnxruntime runs
with the same integers as ``qarray.quantize``. Needs the ``onnx`` package
(extra ``examples``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._qarray import QArray

OPSET = 21  # blocked quantization and 4-bit types
_ELEM = {"qint4": "INT4", "quint4": "UINT4", "qint8": "INT8", "quint8": "UINT8", "qint16": "INT16",
         "quint16": "UINT16"}


class QDQParams(NamedTuple):
    """``QuantizeLinear`` / ``DequantizeLinear`` inputs and attributes: ``scale``
    (float32), ``zero_point`` (the quantized type's values, as integers of its
    storage), ``axis`` and ``block_size`` (None where the op takes none),
    ``elem_type`` (``onnx.TensorProto`` name of the quantized type)."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None
    block_size: int | None
    elem_type: str


def qdq_params(q: QArray) -> QDQParams:
    """The QDQ initializers of ``q``'s parameters. TypeError for dtypes that
    ``QuantizeLinear`` does not produce (2-bit types; qint32)."""
    if not isinstance(q, QArray):
        raise TypeError(f"qdq_params takes a QArray, got {type(q).__name__}")
    if q.dtype.name not in _ELEM:
        raise TypeError(f"qdq_params: ONNX QuantizeLinear (opset {OPSET}) has no {q.dtype.name} output; "
                        f"it takes {', '.join(_ELEM)}")
    return QDQParams(np.asarray(q.scale, np.float32), np.asarray(q.zero_point).astype(q.dtype.storage), q.axis,
                     q.block_size, _ELEM[q.dtype.name])


def export_qdq(q: QArray, path=None, input_name: str = "x"):
    """An ONNX model with ``q``'s parameters: input ``x`` (float32, ``q.shape``),
    outputs ``codes`` (``QuantizeLinear``, the quantized type) and ``values``
    (``DequantizeLinear`` of them, float32). Written to ``path`` when given;
    returned as an ``onnx.ModelProto``."""
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        raise ImportError("export_qdq needs the onnx package: pip install onnx (or qarray[examples])") from None
    p = qdq_params(q)
    elem = getattr(TensorProto, p.elem_type)
    attrs = {} if p.axis is None else {"axis": p.axis}
    if p.block_size is not None:
        attrs["block_size"] = p.block_size
    zp = helper.make_tensor("zero_point", elem, p.zero_point.shape, p.zero_point.reshape(-1).tolist())
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", [input_name, "scale", "zero_point"], ["codes"], **attrs),
         helper.make_node("DequantizeLinear", ["codes", "scale", "zero_point"], ["values"], **attrs)],
        "qarray_qdq",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, list(q.shape))],
        [helper.make_tensor_value_info("codes", elem, list(q.shape)),
         helper.make_tensor_value_info("values", TensorProto.FLOAT, list(q.shape))],
        [numpy_helper.from_array(p.scale, "scale"), zp],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="qarray")
    model.ir_version = 10  # opset 21's IR version, which onnxruntime 1.18+ reads
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, str(path))
    return model
