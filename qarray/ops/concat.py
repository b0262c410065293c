"""cat and stack: join as they are when the parameters agree, else requantize
each input integer-only to the output parameters and join (the TVM way: no
float in the middle, and never PyTorch's silent clamp to the first input's scale).
"""

from __future__ import annotations

import numpy as np

from .. import _protocols
from .. import backends as _backends
from ..backends import on_data_device
from .._api import requantize
from .._params import normalize_axis, to_host
from .._qarray import QArray
from ._output import output_params, wants_output

__all__ = ["cat", "stack"]


def _inputs(op, qs) -> list:
    """``qs`` as a non-empty list of QArrays, else the error that says so."""
    qs = list(qs)
    if not qs:
        raise ValueError(f"{op} needs at least one QArray")
    for i, q in enumerate(qs):
        if not isinstance(q, QArray):
            raise TypeError(f"{op}: input {i} is a {type(q).__name__}, not a QArray")
    return qs


def _same(p, r) -> bool:
    p, r = to_host(p), to_host(r)
    return p.shape == r.shape and bool(np.all(p == r))


def _joined_params(qs, axis):
    """The parameters of the plain join, or None when the inputs' do not agree."""
    first = qs[0]
    if any((q.axis, q.block_size) != (first.axis, first.block_size) for q in qs):
        return None
    k, block = first.axis, first.block_size
    along = k is not None and (block is not None or k == axis)
    if not along:  # one set of parameters for all
        ok = all(_same(q.scale, first.scale) and _same(q.zero_point, first.zero_point) for q in qs)
        return (first.scale, first.zero_point) if ok else None
    if k == axis and block is not None and any(q.shape[k] % block for q in qs[:-1]):
        return None  # a short block in the middle
    pax = 0 if block is None else axis
    return (np.concatenate([q.scale for q in qs], axis=pax), np.concatenate([q.zero_point for q in qs], axis=pax))


@on_data_device(integer_only=True)
def cat(qs, axis=0, *, scale=None, zero_point=None, dtype=None, mode=None, rounding=None) -> QArray:
    """Concatenate QArrays along ``axis``.

    Inputs with one dtype and agreeing parameters (identical, or per-axis /
    blocked parameters that concatenate along ``axis``) join as they are.
    Otherwise pass the output ``scale``, ``zero_point`` and ``dtype``: each input
    is requantized to them (integer-only by default) and then joined.

    >>> a = qarray.quantize(numpy.array([1.0]), 0.1, 0, "qint8")
    >>> b = qarray.quantize(numpy.array([2.0]), 0.2, 0, "qint8")
    >>> cat([a, b], scale=0.1, zero_point=0, dtype="qint8").int_repr()
    array([10, 20], dtype=int8)
    """
    qs = _inputs("cat", qs)
    backend = _backends.common(*[q.data for q in qs])
    first = qs[0]
    if any(q.ndim != first.ndim for q in qs):
        raise ValueError(f"cat: inputs have different numbers of dimensions: {[q.ndim for q in qs]}")
    axis = normalize_axis(axis, first.ndim)
    for q in qs:
        if q.shape[:axis] + q.shape[axis + 1 :] != first.shape[:axis] + first.shape[axis + 1 :]:
            raise ValueError(f"cat: shapes {first.shape} and {q.shape} differ off axis {axis}")
    xp = backend.xp
    if not wants_output(scale, zero_point, dtype):
        dtypes = sorted({q.dtype.name for q in qs})
        if len(dtypes) > 1:
            raise TypeError(
                f"cat: inputs have dtypes {', '.join(dtypes)}; pass dtype= (with scale= and "
                "zero_point=) to requantize them to one output"
            )
        params = _joined_params(qs, axis)
        if params is None:
            raise ValueError(
                "cat: inputs have different scales or zero points; pass the output scale= and "
                "zero_point= (and dtype=) and each input is requantized to them"
            )
        data = xp.concatenate([q.data for q in qs], axis=axis)
        return QArray._new(data, params[0], params[1], first.dtype, first.axis, first.block_size, backend)
    d, s, z = output_params("cat", scale, zero_point, dtype, first.dtype)
    def kept(q):  # already in the output's parameters
        return q.dtype is d and q.axis is None and _same(q.scale, s) and _same(q.zero_point, z)

    if not backend.writable:  # Dask: each input requantized, then joined
        parts = [q.data if kept(q) else requantize(q, s, z, d, mode=mode, rounding=rounding).data for q in qs]
        return QArray._new(xp.concatenate(parts, axis=axis), s, z, d, None, None, backend)
    shape = list(first.shape)
    shape[axis] = sum(q.shape[axis] for q in qs)
    out = xp.empty(tuple(shape), d.storage)
    offset = 0
    for q in qs:  # each input goes straight into its slice of the result
        part = out[(slice(None),) * axis + (slice(offset, offset + q.shape[axis]),)]
        offset += q.shape[axis]
        if kept(q):
            part[...] = q.data
        else:
            requantize(q, s, z, d, mode=mode, rounding=rounding, out=part)
    return QArray._new(out, s, z, d, None, None, backend)


@on_data_device(integer_only=True)
def stack(qs, axis=0, **out) -> QArray:
    """Join QArrays along a new ``axis``; parameter rules as :func:`cat`."""
    qs = _inputs("stack", qs)
    if any(q.shape != qs[0].shape for q in qs):
        raise ValueError(f"stack: inputs must have one shape, got {sorted({q.shape for q in qs})}")
    axis = normalize_axis(axis, qs[0].ndim + 1)
    key = (slice(None),) * axis + (None,)
    return cat([q[key] for q in qs], axis, **out)


_protocols.JOIN_OPS.update(concatenate=cat, stack=stack)  # numpy.concatenate / numpy.stack of QArrays
