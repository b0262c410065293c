"""conv2d: exact integer convolution as im2col plus the integer GEMM of ``linear``
(``groups == 1``), or one direct pass for grouped and depthwise conv;
conv_transpose2d: conv2d of the input spread out by the stride;
conv2d_weight_grad: conv2d of the input and the gradient, batch and channels swapped.

``conv2d(x, w)`` with no output parameters is ONNX ConvInteger (the exact qint32
accumulator, scale ``x.scale * w.scale``); with ``scale``, ``zero_point`` and
``dtype`` it is QLinearConv, requantized through :func:`finish` like every op.
The input is padded with its own zero point, so padding adds exactly 0.
"""

from __future__ import annotations

import numpy as np

from .. import backends as _backends
from ..backends import on_data_device, per_sample
from .._params import Gemm, to_host
from .._qarray import QArray
from ._output import finish, output_plan
from .linear import PackedWeight, _bias_ints, _check_operand

__all__ = ["conv2d", "conv2d_weight_grad", "conv_transpose2d"]


def _pair(op, name, v, least):
    """``v`` (an int or a pair of ints) as a pair, each ``>= least``."""
    pair = (v, v) if isinstance(v, (int, np.integer)) else tuple(v) if isinstance(v, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(p, (int, np.integer)) and not isinstance(p, bool)
                                                 for p in pair):
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    if min(pair) < least:
        raise ValueError(f"{op}: {name} must be >= {least}, got {v!r}")
    return tuple(int(p) for p in pair)


def check_conv_args(op, w_shape, stride, padding, dilation, groups):
    """Validated ``(stride, padding, dilation, groups)`` for weights of shape ``w_shape``."""
    stride = _pair(op, "stride", stride, 1)
    padding = _pair(op, "padding", padding, 0)
    dilation = _pair(op, "dilation", dilation, 1)
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    if w_shape[0] % groups:
        raise ValueError(f"{op}: groups={groups} does not divide the {w_shape[0]} output channels of w")
    if min(w_shape) < 1:
        raise ValueError(f"{op}: w has an empty dimension: {w_shape}")
    return stride, padding, dilation, int(groups)


def pack_conv_weight(op, w: QArray, groups: int, keep=False):
    """``w`` prepared for :func:`conv_packed`: a :class:`PackedWeight` of
    ``(kh * kw * C, O)`` (``w`` channels-last, flattened and transposed) for the
    GEMM when ``groups == 1``; ``w`` itself for grouped conv, which reads the codes."""
    _check_operand(op, "w", w, weight=True)
    if w.ndim != 4:
        raise ValueError(f"{op}: w must have shape (out_channels, in_channels / groups, kh, kw), got {w.shape}")
    if w.axis not in (None, 0):
        raise ValueError(f"{op}: per-channel weights must have their parameters along axis 0 "
                         f"(output channels), got axis {w.axis}")
    if groups > 1:
        return w
    return PackedWeight(w.transpose(0, 2, 3, 1).reshape(w.shape[0], -1).T, 1, keep)  # rows (p, q, c) as im2col's


def conv_packed(op, x: QArray, packed, w_shape, bias, stride, padding, dilation, groups,
                scale, zero_point, dtype, relu, mode, rounding) -> QArray:
    """:func:`conv2d` on weights prepared by :func:`pack_conv_weight`."""
    _check_operand(op, "x", x, weight=False)
    key = None if groups > 1 else packed.call_key(op, x, bias, scale, zero_point, dtype, mode, rounding, relu,
                                                  x.ndim == 4, stride, padding, dilation)
    hit = None if key is None else packed.kept_call(key, bias, x.data)  # (the checks below passed on its first call)
    if hit is not None:
        return hit
    if x.ndim != 4:
        raise ValueError(f"{op}: x must have shape (N, C, H, W), got {x.shape}")
    b = _backends.common(x.data, packed.packed.colsum if groups == 1 else packed.data)
    xp = b.xp
    n, c, h, wd = x.shape
    o, cg, kh, kw = w_shape
    if c % groups:
        raise ValueError(f"{op}: groups={groups} does not divide the {c} input channels of x")
    if cg * groups != c:
        raise ValueError(f"{op}: x has {c} channels but w expects {cg} x groups={groups} = {cg * groups}")
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1  # the dilated kernel's extent
    if eh > h + 2 * ph or ew > wd + 2 * pw:
        raise ValueError(f"{op}: the (dilated) kernel {eh}x{ew} is larger than the padded input "
                         f"{h + 2 * ph}x{wd + 2 * pw}")
    oh, ow = (h + 2 * ph - eh) // sh + 1, (wd + 2 * pw - ew) // sw + 1
    za = int(to_host(x.zero_point))
    factors = [to_host(x.scale), to_host(packed.scale)]
    ints = None if bias is None else _bias_ints(op, b, bias, factors, o, mode, rounding)

    def nchw(out):  # (N*OH*OW, O), channels last: rq's channel axis is 1 too
        return out.reshape(n, oh, ow, o).transpose(0, 3, 1, 2)

    if key is not None:  # the call's work kept (PackedWeight.call_key)
        rq, d, s_out, z_out = output_plan(op, factors, 1, scale, zero_point, dtype, x.dtype, *key[-1], relu)
        run = packed.conv(x, kh, kw, ints, rq, stride, padding, dilation)
        return packed.keep_call(key, bias, lambda codes: nchw(run(codes)), x.data, s_out, z_out, d)

    def acc(rq):
        if groups == 1:  # channels-last patches into the GEMM, requantized (rq) in its epilogue
            if x.dtype.bits <= 8:
                return nchw(packed.conv(x, kh, kw, ints, rq, stride, padding, dilation)(x.data))
            # 16-bit codes: run's two 8-bit products of the patches
            cols = b.im2col(x.data.transpose(0, 2, 3, 1), kh, kw, stride, padding, dilation, za)
            return nchw(packed.run(op, QArray._new(cols, x.scale, x.zero_point, x.dtype, None, None, b), ints, rq))
        zw = to_host(packed.zero_point).astype(np.int64).reshape(-1, 1, 1, 1)
        return b.conv_grouped(x.data, packed.data.astype(xp.int32) - b.param(zw),
                              Gemm(za, bias=ints, rq=rq, groups=groups, stride=stride, dilation=dilation,
                                   padding=padding))

    return finish(op, b, acc, factors, 1, scale, zero_point, dtype,
                  default_dtype=x.dtype, mode=mode, rounding=rounding, relu=relu)


@on_data_device(integer_only=True)
@per_sample
def conv2d(x: QArray, w: QArray, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
           scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """Quantized 2-D convolution (cross-correlation, as in PyTorch and ONNX), NCHW.

    ``x`` is ``(N, C, H, W)``, per-tensor; ``w`` is ``(O, C / groups, kh, kw)``,
    per-tensor or per-channel along axis 0; each may be qint8, quint8, qint4,
    quint4, qint2 or quint2. ``stride``, ``padding`` and ``dilation`` are ints or
    pairs; ``groups == C`` is depthwise. Without output parameters the result is
    the exact qint32 accumulator with scale ``x.scale * w.scale`` (ONNX
    ConvInteger); with ``scale``, ``zero_point``, ``dtype`` (default ``x.dtype``)
    it is requantized (QLinearConv). ``bias`` is float (quantized to qint32 at
    the accumulator's scale) or a qint32 QArray; ``relu=True`` fuses ReLU.

    >>> x = QArray.from_int(numpy.arange(9).reshape(1, 1, 3, 3), 0.5, 0, "quint8")
    >>> w = QArray.from_int(numpy.ones((1, 1, 2, 2), numpy.int8), 0.25, 0, "qint8")
    >>> conv2d(x, w).int_repr()
    array([[[[ 8, 12],
             [20, 24]]]], dtype=int32)
    """
    if not isinstance(w, QArray) or w.ndim != 4:
        _check_operand("conv2d", "w", w, weight=True)
        raise ValueError(f"conv2d: w must have shape (out_channels, in_channels / groups, kh, kw), got {w.shape}")
    stride, padding, dilation, groups = check_conv_args("conv2d", w.shape, stride, padding, dilation, groups)
    _check_operand("conv2d", "x", x, weight=False)
    packed = pack_conv_weight("conv2d", w, groups)
    return conv_packed("conv2d", x, packed, w.shape, bias, stride, padding, dilation, groups,
                       scale, zero_point, dtype, relu, mode, rounding)


def _spread(xp, a, axis, step, fill):
    """``a`` with ``step - 1`` elements of value ``fill`` between neighbours along
    ``axis`` (no item assignment: backends with immutable arrays too)."""
    if step == 1 or a.shape[axis] == 0:
        return a
    pads = [(0, 0)] * (a.ndim + 1)
    pads[axis + 1] = (0, step - 1)  # each element followed by its gap, on an axis of its own
    both = xp.pad(a.reshape(a.shape[:axis + 1] + (1,) + a.shape[axis + 1:]), pads, constant_values=fill)
    merged = both.reshape(a.shape[:axis] + (a.shape[axis] * step,) + a.shape[axis + 1:])
    return merged[(slice(None),) * axis + (slice(0, (a.shape[axis] - 1) * step + 1),)]


def _edges(xp, a, axis, before, after, fill):
    """``a`` padded with ``fill`` (a negative count crops) before and after along ``axis``."""
    lo, hi = max(-before, 0), a.shape[axis] - max(-after, 0)
    a = a[(slice(None),) * axis + (slice(lo, hi),)]
    pads = [(0, 0)] * a.ndim
    pads[axis] = (max(before, 0), max(after, 0))
    return xp.pad(a, pads, constant_values=fill) if max(before, after) > 0 else a


@on_data_device(integer_only=True)
@per_sample
def conv_transpose2d(x: QArray, w: QArray, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """Quantized transposed 2-D convolution, NCHW, in PyTorch's argument order
    (``torch.nn.functional.conv_transpose2d``; ONNX ConvTranspose; what decoders
    and upsampling use, and conv2d's gradient with respect to its input).

    ``x`` is ``(N, C, H, W)``, per-tensor; ``w`` is ``(C, O / groups, kh, kw)``,
    per-tensor or per-channel along axis 1 (the output channels). The output is
    ``(N, O, (H - 1) * stride - 2 * padding + dilation * (kh - 1) +
    output_padding + 1, ...)``. Exactly :func:`conv2d` of ``x`` spread out by
    the stride (the gaps and the edges hold ``x``'s zero point, so they add
    exactly 0) with the flipped, transposed weights: the same engines, the
    same exact accumulator (no output parameters: qint32 at ``x.scale *
    w.scale``), bias and requantize.

    >>> x = QArray.from_int(numpy.array([[[[1, 2], [3, 4]]]]), 0.5, 0, "qint8")
    >>> w = QArray.from_int(numpy.ones((1, 1, 2, 2), numpy.int8), 0.25, 0, "qint8")
    >>> conv_transpose2d(x, w, stride=2).int_repr()[0, 0]
    array([[1, 1, 2, 2],
           [1, 1, 2, 2],
           [3, 3, 4, 4],
           [3, 3, 4, 4]], dtype=int32)
    """
    op = "conv_transpose2d"
    _check_operand(op, "x", x, weight=False)
    _check_operand(op, "w", w, weight=True)
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"{op}: x must be (N, C, H, W) and w (in_channels, out_channels / groups, kh, kw), "
                         f"got {x.shape} and {w.shape}")
    stride, padding, dilation, groups = check_conv_args(op, w.shape, stride, padding, dilation, groups)
    out_pad = _pair(op, "output_padding", output_padding, 0)
    if any(o >= max(s, d) for o, s, d in zip(out_pad, stride, dilation)):
        raise ValueError(f"{op}: output_padding must be smaller than stride or dilation, got {output_padding!r}")
    if w.axis not in (None, 1):
        raise ValueError(f"{op}: per-channel weights must have their parameters along axis 1 (output channels), "
                         f"got axis {w.axis}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"{op}: x has {x.shape[1]} channels but w has {w.shape[0]} input channels")
    b = _backends.common(x.data, w.data)
    xp = b.xp
    c, og, kh, kw = w.shape
    # w' (O, C / groups, kh, kw): group g's block transposed, the taps flipped
    wd = w.data.reshape(groups, c // groups, og, kh, kw).transpose(0, 2, 1, 3, 4).reshape(og * groups, c // groups,
                                                                                         kh, kw)[:, :, ::-1, ::-1]
    ws = w.scale if w.axis is None else np.tile(to_host(w.scale), groups)
    wz = w.zero_point if w.axis is None else np.tile(to_host(w.zero_point), groups)
    wt = QArray._new(xp.ascontiguousarray(wd), ws, wz, w.dtype, None if w.axis is None else 0, None, b)
    fill = x.data.dtype.type(int(to_host(x.zero_point)))
    data = x.data
    for axis, s, p, d, k, o in zip((2, 3), stride, padding, dilation, (kh, kw), out_pad):
        edge = d * (k - 1) - p
        data = _edges(xp, _spread(xp, data, axis, s, fill), axis, edge, edge + o, fill)
    xs = QArray._new(data, x.scale, x.zero_point, x.dtype, None, None, b)
    return conv2d(xs, wt, bias, 1, 0, dilation, groups, scale=scale, zero_point=zero_point, dtype=dtype,
                  relu=relu, mode=mode, rounding=rounding)


@on_data_device(integer_only=True)
def conv2d_weight_grad(x: QArray, weight_shape, grad_out: QArray, stride=1, padding=0, dilation=1, groups=1, *,
                       scale=None, zero_point=None, dtype=None, mode=None, rounding=None) -> QArray:
    """The gradient of :func:`conv2d` with respect to its weights, in
    ``torch.nn.grad.conv2d_weight``'s argument order: ``sum over n, oy, ox of
    (grad_out - zg)[n, o, oy, ox] * (x - zx)[n, c, oy * sh - ph + a * dh, ...]``,
    shape ``weight_shape`` ``(O, C / groups, kh, kw)``.

    ``x`` ``(N, C, H, W)`` and ``grad_out`` ``(N, O, OH, OW)`` are per-tensor;
    ``grad_out`` takes conv2d's weight dtypes (8 bits or fewer). Exactly
    :func:`conv2d` of ``x`` and ``grad_out`` with batch and channels swapped
    (stride and dilation trade places), group by group: the same engines and
    exact accumulator (qint32 at ``x.scale * grad_out.scale`` without output
    parameters, else requantized).

    >>> x = QArray.from_int(numpy.arange(9).reshape(1, 1, 3, 3), 0.5, 0, "quint8")
    >>> g = QArray.from_int(numpy.ones((1, 1, 2, 2), numpy.int8), 0.25, 0, "qint8")
    >>> conv2d_weight_grad(x, (1, 1, 2, 2), g).int_repr()[0, 0]
    array([[ 8, 12],
           [20, 24]], dtype=int32)
    """
    op = "conv2d_weight_grad"
    _check_operand(op, "x", x, weight=False)
    _check_operand(op, "grad_out", grad_out, weight=True)
    if grad_out.axis is not None:
        raise ValueError(f"{op}: grad_out must be per-tensor (requantize it first), got axis {grad_out.axis}")
    shape = tuple(int(v) for v in weight_shape) if isinstance(weight_shape, (tuple, list)) else ()
    if len(shape) != 4 or x.ndim != 4 or grad_out.ndim != 4:
        raise ValueError(f"{op}: x (N, C, H, W), weight_shape (O, C / groups, kh, kw) and grad_out (N, O, OH, OW) "
                         f"expected, got {x.shape}, {weight_shape!r} and {grad_out.shape}")
    stride, padding, dilation, groups = check_conv_args(op, shape, stride, padding, dilation, groups)
    o, cg, kh, kw = shape
    n, c, h, wd = x.shape
    oh, ow = ((size + 2 * p - d * (k - 1) - 1) // s + 1
              for size, p, d, k, s in zip((h, wd), padding, dilation, (kh, kw), stride))
    if c != cg * groups or grad_out.shape != (n, o, oh, ow):
        raise ValueError(f"{op}: for x {x.shape} and weights {shape} with groups={groups}, grad_out must be "
                         f"{(n, o, oh, ow)} (x needs {cg * groups} channels), got {grad_out.shape}")
    b = _backends.common(x.data, grad_out.data)
    og = o // groups
    parts = []
    for g in range(groups):  # channels of the group as the batch, the samples as channels
        xs = QArray._new(x.data[:, g * cg:(g + 1) * cg].transpose(1, 0, 2, 3), x.scale, x.zero_point, x.dtype,
                         None, None, b)
        gs = QArray._new(grad_out.data[:, g * og:(g + 1) * og].transpose(1, 0, 2, 3), grad_out.scale,
                         grad_out.zero_point, grad_out.dtype, None, None, b)
        r = conv2d(xs, gs, None, dilation, padding, stride, scale=scale, zero_point=zero_point, dtype=dtype,
                   mode=mode, rounding=rounding)  # (cg, og, >= kh, >= kw): the floor of OH leaves extra rows
        parts.append(r.data[:, :, :kh, :kw].transpose(1, 0, 2, 3))
    data = parts[0] if groups == 1 else b.xp.concatenate(parts, axis=0)
    return QArray._new(data, r.scale, r.zero_point, r.dtype, None, None, b)
