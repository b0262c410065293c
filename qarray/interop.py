"""QArrays and other frameworks: PyTorch's quantized tensors and DLPack.

- :func:`from_torch` / :meth:`QArray.to_torch`: PyTorch quantized tensors
  (per-tensor and per-channel; quint8, qint8, qint32, quint4x2), both ways,
  exact in the integers and the parameters. PyTorch is optional: imported here,
  on first use.
- DLPack: ``quantize`` and ``QArray.from_int`` take any array with
  ``__dlpack__`` (PyTorch, JAX, ...) for their data (``backends.user_array``, no copy
  where the producer allows); ``q.data`` is a NumPy or CuPy array, which
  DLPack consumers take without a copy (``torch.from_dlpack(q.data)``). A
  QArray itself is codes plus parameters, not one tensor: ``__dlpack__`` says so.
"""

from __future__ import annotations

import numpy as np

from ._dtypes import qdtype
from ._qarray import QArray

# PyTorch's quantized dtypes by name, and ours for them
_FROM_TORCH = {"quint8": "quint8", "qint8": "qint8", "qint32": "qint32", "quint4x2": "quint4"}
_TO_TORCH = {v: k for k, v in _FROM_TORCH.items()}


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("PyTorch interop needs PyTorch: pip install torch") from None
    return torch


def from_torch(t) -> QArray:
    """A PyTorch quantized tensor (per-tensor or per-channel affine; quint8,
    qint8, qint32 or quint4x2) as a QArray: the same integers, scales and zero
    points. Scales must be float32 values (qarray's scales are float32; PyTorch
    keeps doubles): one that is not raises ValueError rather than round."""
    torch = _torch()
    if not isinstance(t, torch.Tensor) or not t.is_quantized:
        raise TypeError(f"from_torch takes a quantized torch.Tensor, got {type(t).__name__}"
                        f"{'' if not isinstance(t, torch.Tensor) else ' of dtype ' + str(t.dtype)}; "
                        "for float or integer tensors use qarray.quantize or QArray.from_int (they take DLPack arrays)")
    name = str(t.dtype).removeprefix("torch.")
    if name not in _FROM_TORCH:
        raise TypeError(f"from_torch: {t.dtype} is not supported (quint8, qint8, qint32, quint4x2 are)")
    d = qdtype(_FROM_TORCH[name])
    scheme = t.qscheme()
    if scheme == torch.per_tensor_affine:
        scale, zp, axis = np.float64(t.q_scale()), np.int64(t.q_zero_point()), None
    elif scheme == torch.per_channel_affine:
        scale = t.q_per_channel_scales().cpu().numpy().astype(np.float64)
        zp, axis = t.q_per_channel_zero_points().cpu().numpy(), int(t.q_per_channel_axis())
    else:
        raise TypeError(f"from_torch: {scheme} tensors are not supported (per_tensor_affine and per_channel_affine are)")
    s32 = np.asarray(scale, np.float32)
    if not np.array_equal(s32.astype(np.float64), scale):
        raise ValueError("from_torch: a scale is not a float32 value (qarray keeps float32 scales, as ONNX); "
                         "requantize the tensor with float32 scales first")
    codes = t.int_repr().cpu().numpy()
    if d.packed:  # quint4x2: two codes a byte, flattened
        from ._api import unpack

        codes = unpack(codes.reshape(-1), d, tuple(t.shape))
    return QArray.from_int(codes, s32, np.asarray(zp, np.int32), d, axis)


def to_torch(q: QArray):
    """``q`` as a PyTorch quantized tensor on the CPU (see :func:`from_torch` for the dtypes)."""
    torch = _torch()
    if q.dtype.name not in _TO_TORCH:
        raise TypeError(f"to_torch: PyTorch has no quantized dtype for {q.dtype.name} "
                        "(quint8, qint8, qint32 and quint4 map to quint8, qint8, qint32, quint4x2)")
    if q.block_size is not None:
        raise TypeError("to_torch: PyTorch has no blocked quantization; requantize per-tensor or per-channel first")
    q = q.get()  # PyTorch's quantized tensors live on the CPU
    codes = torch.from_numpy(np.ascontiguousarray(q.data))
    if q.dtype.packed:  # PyTorch makes quint4x2 by quantizing; the integers are checked below
        if q.axis is not None:
            raise TypeError("to_torch: PyTorch has no per-channel quint4x2")
        out = torch.quantize_per_tensor(torch.from_numpy(q.dequantize()), float(q.scale), int(q.zero_point),
                                        torch.quint4x2)
        if not np.array_equal(out.int_repr().numpy(), q.pack()):
            raise ValueError("to_torch: PyTorch's quint4x2 quantize did not reproduce the codes")  # never seen
        return out
    if q.axis is None:
        return torch._make_per_tensor_quantized_tensor(codes, float(q.scale), int(q.zero_point))
    return torch._make_per_channel_quantized_tensor(codes, torch.from_numpy(q.scale.astype(np.float64)),
                                                    torch.from_numpy(q.zero_point.astype(np.int64)), q.axis)
