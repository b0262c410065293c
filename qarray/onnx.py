"""QArray parameters as ONNX QDQ initializers, and a small QDQ model.

:func:`qdq_params` gives what ``QuantizeLinear`` / ``DequantizeLinear`` take
for a QArray (opset 21: per-tensor, per-axis and blocked; 4, 8 and 16 bits);
:func:`export_qdq` writes a model ``x -> QuantizeLinear -> codes ->
DequantizeLinear -> values`` with a QArray's parameters, which onnxruntime runs
with the same integers as ``qarray.quantize``.

onnxruntime's ``com.microsoft.MatMulNBits`` (``Y = A @ dequant(B).T + bias``,
weights of 2, 4 or 8 bits in blocks along K): :func:`matmul_nbits_params`
gives its inputs for a QArray of weights ``[N, K]``, :func:`export_matmul_nbits`
writes a one-node model of that linear layer, and :func:`load_matmul_nbits`
reads a model's MatMulNBits weights back as QArrays whose ``dequantize`` is
onnxruntime's ``(q - zero_point) * scale`` in float32. Needs the ``onnx``
package (extra ``examples``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._api import unpack
from ._dtypes import qdtype
from ._params import expand, to_host
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


def _onnx(what):
    try:
        import onnx
    except ImportError:
        raise ImportError(f"{what} needs the onnx package: pip install onnx (or qarray[examples])") from None
    return onnx


def _model(onnx, graph, path, opsets):
    """``graph`` as a checked model of ``opsets`` (domain -> version), saved to ``path`` when given."""
    model = onnx.helper.make_model(graph, producer_name="qarray",
                                   opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = 10  # opset 21's IR version, which onnxruntime 1.18+ reads
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, str(path))
    return model


def export_qdq(q: QArray, path=None, input_name: str = "x"):
    """An ONNX model with ``q``'s parameters: input ``x`` (float32, ``q.shape``),
    outputs ``codes`` (``QuantizeLinear``, the quantized type) and ``values``
    (``DequantizeLinear`` of them, float32). Written to ``path`` when given;
    returned as an ``onnx.ModelProto``."""
    onnx = _onnx("export_qdq")
    from onnx import TensorProto, helper, numpy_helper
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
    return _model(onnx, graph, path, {"": OPSET})


# -- com.microsoft.MatMulNBits ---------------------------------------------------------------

class MatMulNBitsParams(NamedTuple):
    """``MatMulNBits``' weight inputs and attributes: ``B`` (uint8 ``[N, k_blocks,
    block_size * bits / 8]``, the lowest k in the lowest bits), ``scales`` (float32
    ``[N, k_blocks]``), ``zero_points`` (uint8 ``[N, ceil(k_blocks * bits / 8)]``
    packed as ``B``, or None for the default ``2**(bits - 1)``), ``K``, ``N``,
    ``bits`` and ``block_size``."""

    B: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    K: int
    N: int
    bits: int
    block_size: int


def _nbits_block(w: QArray, k: int) -> int:
    """The MatMulNBits block length for ``w``'s parameters along K: its own blocks, or where they hold
    along the whole of K, 128 (the smallest power of two >= 16 holding K where K is shorter)."""
    along_k = w.axis == 1 and w.block_size is not None  # one block where block_size is K
    if along_k and (w.block_size < k or _pow2(w.block_size)):
        if not _pow2(w.block_size):
            raise ValueError(f"matmul_nbits_params: block_size {w.block_size}; MatMulNBits takes blocks of a power "
                             "of two >= 16 along K: requantize with block_size=16, 32, 64, 128, ...")
        return w.block_size
    if along_k or w.block_size is None and w.axis in (None, 0):
        return min(128, max(16, 1 << (k - 1).bit_length()))
    raise ValueError(f"matmul_nbits_params: w has {w.qscheme} parameters along axis {w.axis}; MatMulNBits has "
                     "one scale per block of K (axis 1) and output row: quantize w [N, K] per-tensor, per-channel "
                     "along axis 0, or with axis=1 and a block_size")


def _pow2(n):
    return n >= 16 and n & (n - 1) == 0


def matmul_nbits_params(w: QArray) -> MatMulNBitsParams:
    """``MatMulNBits``' inputs for weights ``w`` of shape ``[N, K]`` (out, in):
    2, 4 or 8-bit integers, per-tensor, per-channel along axis 0, or in blocks
    along K (``axis=1``, ``block_size`` a power of two >= 16). Parameters that
    hold along the whole of K are written as blocks of 128 (of the smallest power
    of two >= 16 holding K where K is shorter).

    onnxruntime's codes are unsigned: ``quint2/4/8`` codes and zero points are
    written as they are; ``qint2/4/8`` ones plus ``2**(bits - 1)`` (``qint4``'s
    -8..7 as 0..15), which leaves every ``(q - zero_point) * scale`` as it was.
    The tail of a K that is not a whole number of blocks is padded with the
    zero point.

    >>> w = qarray.QArray.from_int(numpy.array([[1, -2] * 8]), 0.5, 0, "qint4", axis=1, block_size=16)
    >>> p = matmul_nbits_params(w)
    >>> p.B[0, 0, :2], p.scales, p.zero_points
    (array([105, 105], dtype=uint8), array([[0.5]], dtype=float32), None)
    """
    if not isinstance(w, QArray):
        raise TypeError(f"matmul_nbits_params takes a QArray, got {type(w).__name__}")
    d = w.dtype
    if d.kind != "int" or d.bits not in (2, 4, 8):
        raise TypeError(f"matmul_nbits_params: MatMulNBits takes 2, 4 or 8-bit integer codes, not {d.name}; "
                        "requantize or quantize to qint4, quint4, qint8, ... first")
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"matmul_nbits_params: w must be 2-D weights [N, K] (out_features, in_features), "
                         f"got shape {w.shape}")
    n, k = w.shape
    block = _nbits_block(w, k)
    blocks, per, offset = -(-k // block), 8 // d.bits, (1 << (d.bits - 1)) if d.signed else 0
    # each block's parameters: those of its first column
    scales, zp = (np.broadcast_to(expand(p, w.shape, w.axis, w.block_size), w.shape)[:, ::block]
                  for p in (w.scale, w.zero_point))
    zp = (zp + offset).astype(np.uint8)
    codes = np.empty((n, blocks * block), np.uint8)
    codes[:, :k] = to_host(w.int_repr()).astype(np.int16) + offset
    codes[:, k:] = zp[:, -1:]  # the tail reads as 0
    default = (zp == 1 << (d.bits - 1)).all()
    zero_points = None if default else _pack_rows(np.pad(zp, ((0, 0), (0, -blocks % per))), d.bits)
    return MatMulNBitsParams(_pack_rows(codes, d.bits).reshape(n, blocks, -1), scales.astype(np.float32),
                             zero_points, k, n, d.bits, block)


def _pack_rows(codes, bits):
    """Unsigned ``bits``-bit codes ``[n, m]`` packed ``8 // bits`` a byte, the first in the lowest bits,
    row by row (``m * bits`` a multiple of 8)."""
    return QArray.from_int(codes, 1.0, 0, f"quint{bits}").pack().reshape(len(codes), -1)


def export_matmul_nbits(w: QArray, bias=None, path=None, input_name: str = "A", accuracy_level: int = 0):
    """A model of the linear layer ``Y = A @ w.dequantize().T + bias`` as one
    ``com.microsoft.MatMulNBits`` node (onnxruntime's contrib op): input ``A``
    (float32 ``[M, K]``), output ``Y`` (float32 ``[M, N]``), the weights as
    :func:`matmul_nbits_params` writes them, ``bias`` float32 ``[N]`` or None.
    ``accuracy_level`` is the node's attribute (0: left out; 4 quantizes ``A``
    to int8). Written to ``path`` when given; returned as an ``onnx.ModelProto``."""
    onnx = _onnx("export_matmul_nbits")
    from onnx import TensorProto, helper, numpy_helper
    p = matmul_nbits_params(w)
    inits = [numpy_helper.from_array(p.B, "B"), numpy_helper.from_array(p.scales, "scales")]
    if p.zero_points is not None:
        inits.append(numpy_helper.from_array(p.zero_points, "zero_points"))
    if bias is not None:
        b = np.asarray(to_host(bias))
        if b.shape != (p.N,) or b.dtype.kind != "f":
            raise ValueError(f"export_matmul_nbits: bias must be float [N] = [{p.N}], got {b.dtype} {b.shape}")
        inits.append(numpy_helper.from_array(b.astype(np.float32), "bias"))
    names = [input_name, "B", "scales", "zero_points" if p.zero_points is not None else ""]
    names += ["", "bias"] if bias is not None else []
    attrs = {"accuracy_level": accuracy_level} if accuracy_level else {}
    node = helper.make_node("MatMulNBits", names, ["Y"], "matmul_nbits", domain="com.microsoft", K=p.K, N=p.N,
                            bits=p.bits, block_size=p.block_size, **attrs)
    graph = helper.make_graph([node], "qarray_matmul_nbits",
                              [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["M", p.K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", p.N])], inits)
    return _model(onnx, graph, path, {"": OPSET, "com.microsoft": 1})


def matmul_nbits_qarray(p: MatMulNBitsParams) -> QArray:
    """The weights ``[N, K]`` that MatMulNBits inputs ``p`` hold, as a ``quint2/4/8``
    QArray in blocks along K (``axis=1``) with onnxruntime's codes and zero
    points: its ``dequantize()`` is onnxruntime's ``(q - zero_point) * scale``
    in float32 (``dequantize("float16")`` its float16 weights, where the scales
    are float16). ``scales`` and ``zero_points`` may be 1-D or 2-D, as
    onnxruntime reads them. qarray's scales are positive: a block with a
    negative scale (onnxruntime's symmetric quantizer writes them) is held as
    ``-scale`` with codes ``2**bits - 1 - q`` and zero point ``2**bits - 1 -
    zero_point``, the same values; a block with scale 0 as scale 1 with every
    code at its zero point (zeros). Zeros may differ from onnxruntime's in sign."""
    return _qarray_of(p, "matmul_nbits_qarray")


def _qarray_of(p: MatMulNBitsParams, where: str) -> QArray:
    try:
        return _nbits_qarray(p)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def _nbits_qarray(p: MatMulNBitsParams) -> QArray:
    n, k, bits, block = p.N, p.K, p.bits, p.block_size
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits}; onnxruntime's MatMulNBits takes 2, 4 or 8")
    if not _pow2(block):
        raise ValueError(f"block_size={block}; onnxruntime's MatMulNBits takes a power of two >= 16")
    blocks, per, top, qd = -(-k // block), 8 // bits, (1 << bits) - 1, qdtype(f"quint{bits}")
    if p.B.dtype != np.uint8:
        raise TypeError(f"B is {p.B.dtype}; MatMulNBits codes are uint8")
    if p.zero_points is not None and p.zero_points.dtype != np.uint8:
        raise TypeError(f"zero_points are {p.zero_points.dtype}; qarray reads packed uint8 zero points (float ones "
                        "dequantize as q * scale - scale * zero_point, which no QArray holds)")
    if p.scales.dtype not in (np.float32, np.float16):
        raise TypeError(f"scales are {p.scales.dtype}; qarray reads float32 or float16 scales")
    shapes = {"B": (n, blocks, block // per), "scales": (n, blocks), "zero_points": (n, -(-blocks // per))}
    for name, shape in shapes.items():
        a = getattr(p, name)
        if a is not None and (a.shape != shape if name == "B" else a.size != np.prod(shape)):
            raise ValueError(f"{name} has shape {list(a.shape)}; K={k}, N={n}, bits={bits} and block_size={block} "
                             f"make it {list(shape)}")
    codes = unpack(p.B.reshape(-1), qd, (n, blocks * block))[:, :k]
    zp = (np.full((n, blocks), 1 << (bits - 1), np.uint8) if p.zero_points is None else
          unpack(p.zero_points.reshape(-1), qd, (n, shapes["zero_points"][1] * per))[:, :blocks])
    s = p.scales.reshape(n, blocks).astype(np.float32)

    def each(a):  # a block's value at each of its elements
        return np.broadcast_to(expand(a, (n, k), 1, block), (n, k))

    codes = np.where(each(s == 0), each(zp), np.where(each(s < 0), top - codes, codes))
    zp = np.where(s < 0, top - zp, zp)
    s = np.where(s == 0, np.float32(1), np.abs(s))
    return QArray.from_int(codes, s, zp.astype(np.int32), qd, axis=1, block_size=block)


def load_matmul_nbits(model) -> dict[str, QArray]:
    """The weights of every ``com.microsoft.MatMulNBits`` node of ``model`` (an
    ``onnx.ModelProto`` or a path) as QArrays ``[N, K]`` (:func:`matmul_nbits_qarray`),
    keyed by node name (the ``B`` input's name for a node without one). Reads
    the main graph's nodes, whose ``B``, ``scales`` and ``zero_points`` are
    initializers; the bias stays in the model. ValueError for a model without
    such nodes and for ``g_idx`` (act-order) inputs.

    >>> w = qarray.quantize(numpy.ones((2, 32), numpy.float32), 0.5, 0, "qint4", axis=1, block_size=32)
    >>> load_matmul_nbits(export_matmul_nbits(w))["matmul_nbits"].dequantize()[0, :3]
    array([1., 1., 1.], dtype=float32)
    """
    onnx = _onnx("load_matmul_nbits")
    from onnx import helper, numpy_helper
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        name, ins = node.name or node.input[1], list(node.input) + [""] * (6 - len(node.input))
        if ins[4]:
            raise ValueError(f"load_matmul_nbits: node {name!r} has a g_idx input (act-order); qarray reads "
                             "MatMulNBits weights without one")
        arrays = []
        for i in ins[1:4]:
            if i and i not in inits:
                raise ValueError(f"load_matmul_nbits: input {i!r} of node {name!r} is not an initializer of the "
                                 "graph")
            arrays.append(numpy_helper.to_array(inits[i]) if i else None)
        attrs = {"bits": 4} | {a.name: helper.get_attribute_value(a) for a in node.attribute}
        lacks = [a for a in ("K", "N", "block_size") if a not in attrs]
        if lacks:
            raise ValueError(f"load_matmul_nbits: node {name!r} lacks the attribute(s) {', '.join(lacks)}")
        attrs = {a: attrs[a] for a in ("K", "N", "bits", "block_size")}
        out[name] = _qarray_of(MatMulNBitsParams(*arrays, **attrs), f"load_matmul_nbits: node {name!r}")
    if not out:
        raise ValueError("load_matmul_nbits: the model's graph has no com.microsoft MatMulNBits node")
    return out
