"""The one way an op turns an exact integer result into its output.

Every op that makes new values computes them exactly as integers ``acc`` whose
real value is ``acc * prod(factors)`` (for matmul ``a.scale * b.scale``), then
calls :func:`finish`: with no output parameters the result is the qint32
accumulator (ONNX MatMulInteger / ConvInteger); with them it is requantized
through the backend's one requantize primitive (``mode=``, ``rounding=``).
"""

from __future__ import annotations

import functools

import numpy as np

from .. import backends as _backends
from .._config import resolve
from .._dtypes import qdtype, qint32
from .._fixed_point import plan, product
from .._params import check_scale, check_zero_point, kept, to_host
from .._qarray import QArray

_I32 = np.iinfo(np.int32)


def wants_output(scale, zero_point, dtype) -> bool:
    return not (scale is None and zero_point is None and dtype is None)


def output_params(op, scale, zero_point, dtype, default_dtype, default=None):
    """``(QDType, scale float32, zero_point int32)`` of a per-tensor output.

    ``default`` is ``(dtype, scale, zero_point)`` to use when none of the three
    is given (an op's natural output, e.g. sigmoid's quint8 at 1/256); when any
    is given, ``scale`` is required, ``zero_point`` defaults to 0 and ``dtype``
    to ``default_dtype``.
    """
    if default is not None and not wants_output(scale, zero_point, dtype):
        dtype, scale, zero_point = default
    if scale is None:
        alt = "or none of the three for the exact qint32 accumulator" if default is None else "zero_point= defaults to 0"
        raise ValueError(f"{op}: pass the output scale= (with zero_point= and dtype=), {alt}")
    d = qdtype(default_dtype if dtype is None else dtype)
    return d, check_scale(scale), check_zero_point(0 if zero_point is None else zero_point, d)


def output_params_of(op, q, scale, zero_point, dtype, default=None):
    """:func:`output_params` of an op on ``q`` whose natural output is ``default``
    (a triple) or, where that is None, ``q``'s own parameters (the LUT ops, the
    means); the output is per-tensor, so a per-axis ``q`` needs them given."""
    if default is None:
        if q.axis is not None and not wants_output(scale, zero_point, dtype):
            raise ValueError(
                f"{op}: the output is per-tensor, so per-axis input needs output scale=, "
                "zero_point= and dtype="
            )
        default = (q.dtype, q.scale, q.zero_point)
    return output_params(op, scale, zero_point, dtype, default[0], default)


def finish(op, backend, acc, factors, axis, scale, zero_point, dtype, *, default_dtype,
           mode=None, rounding=None, relu=False) -> QArray:
    """Return ``acc`` (exact integers, real value ``acc * prod(factors)``) as a QArray.

    ``factors`` are host float32 arrays, each a scalar or of length
    ``acc.shape[axis]`` (per-channel weights). ``relu`` clamps at real 0 (at the
    output zero point), fused into the requantize as in PyTorch's ``linear_relu``.
    ``acc`` may also be a function ``acc(rq)`` that returns the integers
    (``rq=None``) or computes and requantizes them in one pass, ``rq`` being
    the op's ``Requant`` (the binary ops).
    """
    if not callable(acc):
        acc = functools.partial(_requantized, backend, acc)
    if not wants_output(scale, zero_point, dtype):
        factors, axis, want = _factor_layout(factors, axis)
        acc = acc(None)
        backend = _backends.for_array(acc)  # the data's (Dask activations meeting in-memory weights: Dask)
        xp = backend.xp
        if relu:
            acc = xp.maximum(acc, 0)
        if acc.dtype != np.int32:
            acc = backend.within(acc, _I32.min, _I32.max, f"{op}: the exact result reaches {{}}, beyond qint32; "
                                 "pass output scale=, zero_point= and dtype= to requantize it instead")
        s = check_scale(np.broadcast_to(product(factors, np.float32), want), want, axis)
        return QArray._new(acc.astype(np.int32, copy=False), s, np.zeros(want, np.int32), qint32, axis, None)
    rq, d, s_out, z_out = output_plan(op, factors, axis, scale, zero_point, dtype, default_dtype,
                                       *resolve(mode, rounding), relu)
    return QArray._new(acc(rq), s_out, z_out, d, None, None)  # the backend of the data (Dask takes NumPy along)


def _factor_layout(factors, axis):
    """``factors`` as host arrays, the axis of the per-channel ones (None when
    all are scalars) and their parameter shape (``acc.shape[axis]``)."""
    factors = [np.asarray(to_host(f)) for f in factors]
    if all(f.ndim == 0 for f in factors):
        axis = None
    return factors, axis, () if axis is None else next(f.shape for f in factors if f.ndim)


@kept
def output_plan(op, factors, axis, scale, zero_point, dtype, default_dtype, mode, rounding, relu):
    """``finish``'s ``Requant`` and checked output ``(dtype, scale, zero_point)``;
    kept, as they repeat call after call."""
    factors, axis, want = _factor_layout(factors, axis)
    d, s_out, z_out = output_params(op, scale, zero_point, dtype, default_dtype)
    for a in (s_out, z_out):
        a.setflags(write=False)
    rq = plan(factors, s_out, np.zeros(want, np.int64), z_out, d, mode, rounding, axis=axis, relu=relu)
    return rq, d, s_out, z_out


def _requantized(backend, acc, rq):
    return acc if rq is None else backend.requantize(acc, rq)
