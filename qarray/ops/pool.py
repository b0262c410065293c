"""Pooling and reductions on the integers: max_pool2d, avg_pool2d,
adaptive_avg_pool2d, mean and sum.

Pools take NCHW (4-D) or CHW (3-D) input. ``max_pool2d`` compares the integers
themselves (dequantization is monotone), so its output keeps the input's
parameters. The averages sum ``q - zero_point`` exactly in int64 and round the
exact rational mean once: the output integer is
``clamp(R(sum / count * m, s) + zero_point_out)``, ``(m, s)`` being the
fixed-point form of ``scale_in / scale_out`` that :func:`qarray.requantize`
uses, with the tie rule ``rounding``. So with the default output parameters
(the input's) the result is ``zero_point + round_half_even(sum / count)``
exactly, and with others it is the requantize of the exact mean, with no
double rounding. ``rounding="tflite"`` rounds ties away from zero, as TFLite's
average pool does; ``mode="float"`` computes
``rint(float64(sum) / count * float32(scale_in / scale_out) + zero_point_out)``.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from ..backends import on_data_device, per_sample
from .._config import resolve
from .._fixed_point import plan, rescale_mean
from .._params import normalize_axis, to_host
from .._qarray import QArray
from ._output import finish, output_params_of

__all__ = ["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "mean", "sum"]

def _check(op, q, per_axis=False):
    """Validate a pooling input; returns the data as 4-D and whether it was 3-D."""
    if not isinstance(q, QArray):
        raise TypeError(f"{op}: the input must be a QArray, got {type(q).__name__}; quantize it first")
    if q.ndim not in (3, 4):
        raise ValueError(f"{op}: expected a 4-D (N, C, H, W) or 3-D (C, H, W) input, got {q.ndim}-D shape {q.shape}")
    _check_params(op, q, q.ndim - 3 if per_axis else None)
    return (q.data if q.ndim == 4 else q.data[None]), q.ndim == 3


def _check_params(op, q, axis_ok=None):
    if q.block_size is not None or (q.axis is not None and q.axis != axis_ok):
        where = "the channel axis" if axis_ok is not None else "per-tensor"
        raise ValueError(
            f"{op}: input parameters must be {where}, got {q.qscheme} along axis {q.axis}; "
            "requantize it per-tensor first"
        )


def _pair(op, name, v, lo):
    vals = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    if len(vals) != 2:
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    try:
        vals = tuple(operator.index(x) for x in vals)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}") from None
    if min(vals) < lo:
        raise ValueError(f"{op}: {name} must be >= {lo}, got {v!r}")
    return vals


def _geometry(op, shape, kernel_size, stride, padding, dilation=1):
    """``(kernel, stride, padding, dilation, (OH, OW))`` of a pool over NCHW ``shape``, validated."""
    k = _pair(op, "kernel_size", kernel_size, 1)
    s = k if stride is None else _pair(op, "stride", stride, 1)
    p = _pair(op, "padding", padding, 0)
    d = _pair(op, "dilation", dilation, 1)
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"{op}: padding {p} must be at most half the kernel size {k}")
    ext = tuple(d[i] * (k[i] - 1) + 1 for i in range(2))
    padded = (shape[2] + 2 * p[0], shape[3] + 2 * p[1])
    if ext[0] > padded[0] or ext[1] > padded[1]:
        raise ValueError(
            f"{op}: the kernel (extent {ext} with dilation) is larger than the padded input {padded}"
        )
    return k, s, p, d, tuple((padded[i] - ext[i]) // s[i] + 1 for i in range(2))


def _window_max(op, xp, x, pad_value, kernel_size, stride, padding, dilation=1):
    """``(N, C, OH, OW)``: the largest of each window of ``x`` padded with
    ``pad_value``, tap by tap over strided slices (no strided views: any array
    library has slices)."""
    k, s, p, d, (oh, ow) = _geometry(op, x.shape, kernel_size, stride, padding, dilation)
    if p != (0, 0):
        x = xp.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])), constant_values=pad_value)
    out = None
    for a in range(k[0]):
        for b in range(k[1]):
            tap = x[:, :, a * d[0]: a * d[0] + (oh - 1) * s[0] + 1: s[0], b * d[1]: b * d[1] + (ow - 1) * s[1] + 1: s[1]]
            out = tap if out is None else xp.maximum(out, tap)
    return out


def _inside(length, k, s, p, out):
    """For each output along one axis: how many taps of its window ``o * s + a - p``
    (``0 <= a < k``) lie inside ``[0, length)`` (the divisor without the padding)."""
    o = np.arange(out)[:, None] * s + np.arange(k)[None, :] - p
    return ((o >= 0) & (o < length)).sum(axis=1).astype(np.int64)


def _mean_output(op, q, scale, zero_point, dtype, mode, rounding):
    """``(d, rnd, make)`` for a mean of ``q``: the output QDType, ``rnd(acc, count)``
    the output integers of the means ``acc / count`` (int64 sums of
    ``q - zero_point``) and ``make(data)`` the QArray."""
    b, xp = q._backend, q._backend.xp
    d, s_out, z_out = output_params_of(op, q, scale, zero_point, dtype)
    mode, rounding = resolve(mode, rounding)
    # TFLite's average pool divides with ties away from 0 (its rounding, for a mean)
    rq = plan((to_host(q.scale),), s_out, 0, z_out, d, mode, "half_away" if rounding == "tflite" else rounding)
    z, f = int(rq.zp_out), float(rq.f)
    if mode == "fixed":
        m, sh = int(rq.m), int(rq.shift)
        if sh < 1:
            raise ValueError(
                f"{op}: scale_in / scale_out = {float(to_host(q.scale)) / float(s_out):g} is too large for an "
                "exact average (it must be below 2**30); choose a larger output scale or mode='float'"
            )

        def rnd(acc, count):
            return xp.clip(rescale_mean(acc, count, m, sh, rq.rounding) + z, rq.lo, rq.hi).astype(d.storage)
    else:  # as the requantize primitive: round after adding the zero point, clamp in float
        def rnd(acc, count):
            return xp.clip(xp.rint(acc.astype(xp.float64) / count * f + z), rq.lo, rq.hi).astype(d.storage)

    def make(data):
        return QArray._new(data, s_out, z_out, d, None, None, b)

    return d, rnd, make


def _finish_mean(op, q, acc, count, scale, zero_point, dtype, mode, rounding) -> QArray:
    """The mean ``acc / count`` (int64 sums of ``q - zero_point``) as a QArray."""
    _, rnd, make = _mean_output(op, q, scale, zero_point, dtype, mode, rounding)
    return make(rnd(acc, count))


@on_data_device(integer_only=True)
@per_sample
def max_pool2d(q: QArray, kernel_size, stride=None, padding=0, dilation=1) -> QArray:
    """2-D max pooling on the integers; the output keeps the input's parameters.

    ``q`` is NCHW or CHW, per-tensor or per-channel (along C). ``stride``
    defaults to ``kernel_size``; padding (at most half the kernel, as in
    PyTorch) is never selected. Equals PyTorch's ``max_pool2d`` on the
    dequantized values.

    >>> q = QArray.from_int(numpy.arange(16).reshape(1, 1, 4, 4), 0.1, 0, "qint8")
    >>> max_pool2d(q, 2).int_repr()
    array([[[[ 5,  7],
             [13, 15]]]], dtype=int8)
    """
    x, three = _check("max_pool2d", q, per_axis=True)
    xp = q._backend.xp
    out = _window_max("max_pool2d", xp, x, q.dtype.qmin, kernel_size, stride, padding, dilation)
    return QArray._new(out[0] if three else out, q.scale, q.zero_point, q.dtype, q.axis, None, q._backend)


@on_data_device(integer_only=True)
@per_sample
def avg_pool2d(q: QArray, kernel_size, stride=None, padding=0, *, count_include_pad=True,
               scale=None, zero_point=None, dtype=None, mode=None, rounding=None) -> QArray:
    """2-D average pooling: exact integer window sums, one rounding.

    ``q`` is NCHW or CHW, per-tensor. Padding is real 0 (the zero point); with
    ``count_include_pad`` it counts in the divisor, as in PyTorch. Output
    parameters default to the input's (then the result is exactly
    ``zero_point + round_half_even(sum(q - zero_point) / count)``); with others
    see the module notes.

    >>> q = QArray.from_int(numpy.array([[[[1, 2], [2, 2]]]]), 0.1, 0, "qint8")
    >>> avg_pool2d(q, 2).int_repr()   # 7 / 4 = 1.75
    array([[[[2]]]], dtype=int8)
    """
    x, three = _check("avg_pool2d", q)
    b, xp = q._backend, q._backend.xp
    k, s, p, _, (oh, ow) = _geometry("avg_pool2d", x.shape, kernel_size, stride, padding)
    d, rnd, make = _mean_output("avg_pool2d", q, scale, zero_point, dtype, mode, rounding)
    n, c, h, w = x.shape
    inside = b.asarray(_inside(h, k[0], s[0], p[0], oh))[:, None] * b.asarray(_inside(w, k[1], s[1], p[1], ow))[None, :]
    zp = int(to_host(q.zero_point))
    planes, fill = x.reshape(n * c, h, w), x.dtype.type(zp)
    # A piece of about ``chunk`` outputs at a time (int64 temporaries): its input rows padded
    # with the zero point, real 0, so that each tap of the windows is one strided slice and
    # sum(x - zp) over a window is sum(piece) - zp * kh * kw, padding or not. Written into
    # one output where the backend's arrays take it, else the pieces joined.
    rows = max(1, b.chunk // max(ow, 1))
    step = max(1, rows // max(oh, 1))  # planes per piece, when whole planes fit
    out = xp.empty((n * c, oh, ow), d.storage) if b.writable else None
    runs = []  # immutable arrays: the pieces, rows joined within each run of planes
    for c0 in range(0, n * c, step):
        pieces = []
        for r0 in range(0, oh, rows):
            r1 = min(r0 + rows, oh)
            top, bottom = r0 * s[0] - p[0], (r1 - 1) * s[0] + k[0] - p[0]  # its input rows, padding included
            piece = xp.pad(planes[c0:c0 + step, max(top, 0):min(bottom, h)],
                           ((0, 0), (max(-top, 0), max(bottom - h, 0)), (p[1], p[1])), constant_values=fill)
            acc = -zp * k[0] * k[1]
            for ta in range(k[0]):
                for tb in range(k[1]):
                    acc = acc + piece[:, ta: (r1 - r0 - 1) * s[0] + ta + 1: s[0],
                                      tb: (ow - 1) * s[1] + tb + 1: s[1]].astype(xp.int64)
            means = rnd(acc, k[0] * k[1] if count_include_pad else inside[r0:r1])
            if out is not None:
                out[c0:c0 + step, r0:r1] = means
            else:
                pieces.append(means)
        if pieces:
            runs.append(xp.concatenate(pieces, axis=1))
    if out is None:  # (zero samples: Dask's probe of an op's output)
        out = xp.concatenate(runs, axis=0) if runs else xp.empty((0, oh, ow), d.storage)
    res = make(out.reshape(n, c, oh, ow))
    return res[0] if three else res


@on_data_device(integer_only=True)
@per_sample
def adaptive_avg_pool2d(q: QArray, output_size, *, scale=None, zero_point=None, dtype=None,
                        mode=None, rounding=None) -> QArray:
    """2-D average pooling to ``output_size`` (an int, or a pair whose None entries
    keep that input size), with PyTorch's windows ``[floor(i * H / OH),
    ceil((i + 1) * H / OH))``. Each window's exact sum is divided by its own
    count and rounded once, as in :func:`avg_pool2d`.

    >>> q = QArray.from_int(numpy.array([[[1, 2, 4]]]), 0.5, 0, "qint8")
    >>> adaptive_avg_pool2d(q, (1, 2)).int_repr()   # windows [1, 2] and [2, 4]
    array([[[2, 3]]], dtype=int8)
    """
    x, three = _check("adaptive_avg_pool2d", q)
    b, xp = q._backend, q._backend.xp
    size = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    if len(size) != 2:
        raise ValueError(f"adaptive_avg_pool2d: output_size must be an int or a pair, got {output_size!r}")
    size = tuple(x.shape[2 + i] if n is None else n for i, n in enumerate(size))
    oh, ow = _pair("adaptive_avg_pool2d", "output_size", size, 1)
    n, c, h, w = x.shape
    integral = xp.pad(x.cumsum(axis=2, dtype=xp.int64).cumsum(axis=3), ((0, 0), (0, 0), (1, 0), (1, 0)))

    def edges(length, out):
        i = np.arange(out)
        return b.asarray(i * length // out), b.asarray(-(-(i + 1) * length // out))

    h0, h1 = edges(h, oh)
    w0, w1 = edges(w, ow)
    h0, h1 = h0[:, None], h1[:, None]
    sums = integral[:, :, h1, w1] - integral[:, :, h0, w1] - integral[:, :, h1, w0] + integral[:, :, h0, w0]
    count = (h1 - h0) * (w1 - w0)
    sums = sums - int(to_host(q.zero_point)) * count  # the sums of q - zero_point
    out = _finish_mean("adaptive_avg_pool2d", q, sums, count, scale, zero_point, dtype, mode, rounding)
    return out[0] if three else out


def _reduce(op, q, axis, keepdims):
    if not isinstance(q, QArray):
        raise TypeError(f"{op}: the input must be a QArray, got {type(q).__name__}; quantize it first")
    _check_params(op, q)
    if axis is None:
        axes = tuple(range(q.ndim))
    else:
        axes = tuple(normalize_axis(a, q.ndim) for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
        if len(set(axes)) != len(axes):
            raise ValueError(f"{op}: repeated axis in {axis!r}")
    xp = q._backend.xp
    # summed in int64 as they are (no int64 copy), the zero point taken off once
    acc = xp.sum(q.data, axis=axes, dtype=xp.int64, keepdims=keepdims)
    count = math.prod(q.shape[a] for a in axes)
    zp = int(to_host(q.zero_point))
    return xp.asarray(acc - zp * count if zp else acc), count


@on_data_device(integer_only=True)
def mean(q: QArray, axis=None, keepdims=False, *, scale=None, zero_point=None, dtype=None,
         mode=None, rounding=None) -> QArray:
    """Mean over ``axis`` (None: all), rounded once from the exact integer sum.

    Per-tensor input. Output parameters default to the input's: the result is
    then ``zero_point + round_half_even(sum(q - zero_point) / count)``.

    >>> q = QArray.from_int(numpy.array([[1, 2], [3, 5]]), 0.1, 0, "qint8")
    >>> mean(q, axis=1).int_repr()   # 1.5 -> 2, 4 -> 4
    array([2, 4], dtype=int8)
    """
    acc, count = _reduce("mean", q, axis, keepdims)
    if count == 0:
        raise ValueError(f"mean: the reduction over axis {axis!r} of shape {q.shape} has no elements")
    return _finish_mean("mean", q, acc, count, scale, zero_point, dtype, mode, rounding)


@on_data_device(integer_only=True)
def sum(q: QArray, axis=None, keepdims=False, *, scale=None, zero_point=None, dtype=None,
        mode=None, rounding=None) -> QArray:
    """Sum over ``axis`` (None: all) of a per-tensor input.

    With no output parameters: the exact qint32 accumulator ``sum(q - zero_point)``
    at scale ``q.scale``, zero point 0 (ValueError if it does not fit in int32).
    With them: that sum requantized (``mode=``, ``rounding=``).

    >>> q = QArray.from_int(numpy.array([1, 2, 3]), 0.5, 1, "quint8")
    >>> sum(q).int_repr(), sum(q).scale
    (array(3, dtype=int32), array(0.5, dtype=float32))
    """
    acc, _ = _reduce("sum", q, axis, keepdims)
    return finish("sum", q._backend, acc, [to_host(q.scale)], None, scale, zero_point, dtype,
                  default_dtype=q.dtype, mode=mode, rounding=rounding)
