"""Quantization parameters: validation and the one broadcasting helper.

One affine model in the ONNX form, ``real = (q - zero_point) * scale``:

=============  ========================  ==========================================
granularity    axis / block_size         scale and zero_point shape
=============  ========================  ==========================================
per-tensor     ``None`` / ``None``       ``()``
per-axis       ``k`` / ``None``          ``(shape[k],)``
blocked        ``k`` / ``B``             ``shape`` with ``shape[k]`` -> ``ceil(shape[k] / B)``
=============  ========================  ==========================================

Example: ``x.shape == (2, 5)``, ``axis=1, block_size=2`` gives scale shape
``(2, 3)``; elements ``x[i, 4]`` use ``scale[i, 2]`` (the last block is short).
"""

from __future__ import annotations

import math
import operator

import numpy as np

from ._dtypes import QDType


def to_host(a):
    """A NumPy view of ``a`` (CuPy arrays are copied from the device)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__") and hasattr(a, "get"):
        return a.get()
    return np.asarray(a)


def user_array(x, what: str):
    """``x`` as an array a backend accepts, and that backend: the one place user
    data is normalised (quantize, quantize_dynamic, from_int, unpack, ``nn``);
    ``what`` names the caller in errors.

    Python numbers, lists and tuples become NumPy arrays; NumPy subclasses such as
    ``numpy.matrix`` become plain ndarrays (their own reshape and ``*`` rules
    would break the kernels); non-native byte order (``'>f4'``) is converted to
    native. Masked arrays are refused: their masked slots hold arbitrary values.
    """
    from . import backends as _backends

    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{what} does not take masked arrays (the masked slots hold arbitrary values); "
            "fill the masked values first, e.g. x.filled(0)"
        )
    if isinstance(x, (list, tuple, int, float, np.generic)) or (isinstance(x, np.ndarray) and type(x) is not np.ndarray):
        x = np.asarray(x)
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return x, _backends.for_array(x)


def normalize_axis(axis, ndim: int, what: str = "axis"):
    """``axis`` as a non-negative int (or None), with a clear error."""
    if axis is None:
        return None
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{what} must be an integer or None, got {type(axis).__name__}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array with {ndim} dimension(s)")
    return axis % ndim


def normalize_block_size(block_size, axis):
    if block_size is None:
        return None
    if axis is None:
        raise ValueError("block_size needs an axis: pass axis=k to quantize in blocks along axis k")
    try:
        block_size = operator.index(block_size)
    except TypeError:
        raise TypeError(f"block_size must be an integer, got {type(block_size).__name__}") from None
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return block_size


def param_shape(shape, axis, block_size) -> tuple:
    """The shape scale and zero_point must have for ``shape``, ``axis``, ``block_size``."""
    if axis is None:
        return ()
    if block_size is None:
        return (shape[axis],)
    return tuple(-(-n // block_size) if i == axis else n for i, n in enumerate(shape))


def _describe(axis, block_size) -> str:
    if axis is None:
        return "per-tensor (a scalar)"
    if block_size is None:
        return f"per-axis along axis {axis}"
    return f"blocked along axis {axis} with block_size={block_size}"


def _fit(a: np.ndarray, want: tuple, name: str, axis, block_size) -> np.ndarray:
    if a.shape == want:
        return a
    if a.size == 1:  # a scalar serves every granularity, as in ONNX
        return np.broadcast_to(a.reshape(()), want).copy()
    raise ValueError(
        f"{name} has shape {a.shape} but {_describe(axis, block_size)} needs shape {want}"
    )


def check_scale(scale, want=(), axis=None, block_size=None) -> np.ndarray:
    """``scale`` as float32 of shape ``want``: finite and > 0, else ValueError."""
    s = to_host(scale)
    if s.dtype.kind not in "fiu" or s.dtype == np.bool_:
        raise TypeError(f"scale must be a real number or array, got dtype {s.dtype}")
    s = _fit(s, want, "scale", axis, block_size)
    with np.errstate(over="ignore"):  # too large for float32: reported below
        s32 = s.astype(np.float32)
    bad = ~(np.isfinite(s32) & (s32 > 0))
    if bad.any():
        first = s.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
        raise ValueError(
            f"scale must be finite and > 0 in float32; got {first!r} "
            f"({int(bad.sum())} bad value(s))"
        )
    return s32


def check_zero_point(zero_point, dtype: QDType, want=(), axis=None, block_size=None) -> np.ndarray:
    """``zero_point`` as int32 of shape ``want``, inside ``dtype``'s range."""
    z = to_host(zero_point)
    if z.dtype.kind not in "iu":
        raise TypeError(
            f"zero_point must be an integer or integer array, got dtype {z.dtype}; "
            "round it first (e.g. int(round(zp)))"
        )
    z = _fit(z, want, "zero_point", axis, block_size)
    bad = (z < dtype.qmin) | (z > dtype.qmax)
    if bad.any():
        first = z.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
        raise ValueError(
            f"zero_point {int(first)} is outside the range [{dtype.qmin}, {dtype.qmax}] "
            f"of {dtype.name}"
        )
    return z.astype(np.int32)


def check_params(scale, zero_point, dtype: QDType, shape, axis, block_size):
    """Validate user parameters for an array of ``shape``.

    A ``block_size`` above ``shape[axis]`` means one block along the axis and
    comes back as ``shape[axis]`` (the same layout, no size taken from it).
    Returns ``(scale float32, zero_point int32, axis, block_size)`` on the host,
    with axis made non-negative.
    """
    axis = normalize_axis(axis, len(shape))
    block_size = normalize_block_size(block_size, axis)
    if block_size is not None:
        # a block longer than the axis is one block (ONNX: ceil(n / B) == 1); recording
        # it as shape[axis] keeps every later size computation bounded by the data
        block_size = min(block_size, max(shape[axis], 1))
    want = param_shape(shape, axis, block_size)
    return (
        check_scale(scale, want, axis, block_size),
        check_zero_point(zero_point, dtype, want, axis, block_size),
        axis,
        block_size,
    )


def view3(shape, axis) -> tuple:
    """``shape`` seen as ``(outer, shape[axis], inner)``."""
    return (math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))


def compact(p, shape, axis, block_size):
    """A parameter array as ``(outer or 1, blocks, inner or 1)``, to go with ``view3``."""
    if block_size is None:
        return p.reshape(1, -1, 1)
    o, _, i = view3(shape, axis)
    return p.reshape(o, -1, i)


def expand(p, shape, axis, block_size, xp):
    """The one broadcasting helper: a parameter array broadcastable against ``shape``.

    Per-tensor parameters are returned as they are; per-axis ones get size-1
    dimensions around ``axis``; blocked ones are repeated ``block_size`` times
    along ``axis`` and cut to ``shape[axis]`` (ONNX's short last block).
    """
    if axis is None:
        return p
    if block_size is None:
        return p.reshape((1,) * axis + (-1,) + (1,) * (len(shape) - axis - 1))
    p3 = compact(p, shape, axis, block_size)
    if block_size > 1:
        p3 = xp.repeat(p3, block_size, axis=1)[:, : shape[axis]]
    return p3.reshape(shape)
