"""Layers with weights quantized and packed once: Linear, Conv2d, DynamicLinear.

``Linear`` and ``Conv2d`` take a quantized activation and compute exactly what
:func:`qarray.ops.linear.linear` / :func:`qarray.ops.conv.conv2d` compute on
``layer.weight``, without re-packing the weights per call. Their output
parameters are given per call (as in the ops: when a call gives any of
``scale``, ``zero_point``, ``dtype``, it gives them all, the missing ones
defaulting as in the ops) or, when it gives none, are ``layer.scale``,
``layer.zero_point`` and ``layer.dtype`` (None until set by hand or by
:meth:`calibrate`); with none anywhere the result is the exact qint32
accumulator. ``DynamicLinear`` is float in, float out.

>>> w = numpy.array([[0.5, -1.0], [0.25, 2.0]], numpy.float32)
>>> layer = Linear.from_float(w, numpy.zeros(2, numpy.float32))
>>> x = qarray.quantize(numpy.array([[1.0, 2.0]], numpy.float32), 0.05, 0, "quint8")
>>> _ = layer.calibrate(x)
>>> layer(x).dequantize().round(2)   # float reference: [[-1.5, 4.25]]
array([[-1.48,  4.24]], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from ._api import choose_qparams, quantize, quantize_dynamic
from ._dtypes import qdtype, qint8, quint8
from ._params import float_values, to_host
from ._qarray import QArray
from .backends import user_array
from .ops.block_linear import block_linear, q8_supported
from .ops.conv import check_conv_args, conv_packed, pack_conv_weight
from .ops.linear import PackedWeight, _check_operand

__all__ = ["Linear", "Conv2d", "DynamicLinear", "BlockLinear"]


def _float_weight(name, w, ndim):
    """``w`` as float32 on its own backend: CuPy weights make a layer on the GPU."""
    w = float_values(user_array(w, f"{name}.from_float")[0])  # bfloat16 checkpoints too
    if w.dtype.kind != "f" or w.ndim != ndim:
        raise ValueError(f"{name}.from_float: w must be a {ndim}-d float array, got {w.dtype} of shape {w.shape}")
    return w.astype(np.float32)


def _float_bias(name, b, n):
    if b is None:
        return None
    b = float_values(to_host(user_array(b, f"{name}.from_float")[0]))
    if b.dtype.kind != "f" or b.shape != (n,):
        raise ValueError(f"{name}.from_float: b must be a float array of shape ({n},), got {b.dtype} {b.shape}")
    return b.astype(np.float32)


def _is_float16(d) -> bool:
    try:
        return np.dtype(d) == np.float16
    except TypeError:  # a QDType or a name only qarray knows
        return False


# Per-channel weight scales are floored at this fraction of the largest channel's.
WEIGHT_SCALE_FLOOR = 2.0**-8


def _quantize_weight(w, weight_dtype, per_channel):
    """Symmetric quantization, per output channel (axis 0) or per tensor.

    Per channel, each channel's scale is at least ``WEIGHT_SCALE_FLOOR`` (1/256)
    times the largest channel's. Without a floor a dead unit (max |w| ~ 1e-13)
    gets a scale so small that its bias, at ``x.scale * w.scale``, overflows int32.
    The floor only touches channels more than 256 times smaller than the largest:
    their step is 1/256 of the largest channel's step, where per-tensor
    quantization would give them that step itself, so for 8-bit weights their
    error stays below 2**-16 of the largest channel's weight range, under one
    step of an 8- or 16-bit output. With the floor the bias of a dead unit fits
    whenever ``|b| < 2**23 * x.scale * (the largest channel's scale)``.
    """
    d = qdtype(weight_dtype)
    q = quantize_dynamic(w, d, symmetric=True, axis=0 if per_channel else None)
    if not per_channel:
        return q
    s = to_host(q.scale)
    floor = np.float32(s.max() * WEIGHT_SCALE_FLOOR)
    return q if (s >= floor).all() else quantize(w, np.maximum(s, floor), to_host(q.zero_point), d, axis=0)


class _Quantized:
    """Shared by Linear and Conv2d: weights, bias, output params and calibration.
    Subclasses define ``_reference(x)``, the float computation calibrate runs."""

    weight: QArray
    bias: np.ndarray | None

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias
        self.scale = self.zero_point = self.dtype = None
        self._range = None  # the float output range seen by calibrate, (min, max)
        self._observer = None  # calibrate(observer=...): the observer later calls feed

    def _float_bias(self):
        b = self.bias
        return to_host(b.dequantize()) if isinstance(b, QArray) else np.asarray(to_host(b), np.float32)

    def calibrate(self, x, dtype=None, relu=False, observer=None):
        """Set ``scale``, ``zero_point`` and ``dtype`` from the float output range.

        Runs the float reference on the host (``x`` dequantized when it is a
        QArray, the dequantized weights, the float bias) and maps the range seen
        so far (each call widens it) onto ``dtype``: the given one, else the
        layer's, else ``x.dtype`` for a QArray ``x``, else quint8. ``relu=True``
        keeps only the non-negative part of the range (the reference output is
        floored at 0 before it is observed). With an ``observer``
        (:mod:`qarray.observers`, kept on the layer for later calls) the
        reference output goes to ``observer.update`` and the parameters are its
        ``qparams()`` and ``dtype``. Returns ``self``.
        """
        y = self._reference(x.dequantize() if isinstance(x, QArray) else x)
        if relu:
            y = np.maximum(y, 0)
        if observer is not None:
            self._observer = observer
        if self._observer is not None:
            if dtype is not None and qdtype(dtype) != self._observer.dtype:
                raise ValueError(f"calibrate: dtype {qdtype(dtype).name} differs from the observer's "
                                 f"{self._observer.dtype.name}; make the observer with the dtype wanted")
            self._observer.update(y)
            self.dtype = self._observer.dtype
            self.scale, self.zero_point = self._observer.qparams()
            return self
        lo, hi = float(y.min()), float(y.max())
        if self._range is not None:
            lo, hi = min(lo, self._range[0]), max(hi, self._range[1])
        self._range = (lo, hi)
        d = dtype if dtype is not None else self.dtype if self.dtype is not None else \
            x.dtype if isinstance(x, QArray) else quint8
        self.dtype = qdtype(d)
        s, z = choose_qparams(lo, hi, self.dtype)
        self.scale, self.zero_point = s, z
        return self

    def _out(self, scale, zero_point, dtype):
        """The call's output parameters when it gives any, else the layer's."""
        if scale is None and zero_point is None and dtype is None:
            return self.scale, self.zero_point, self.dtype
        return scale, zero_point, dtype

    def _params_repr(self):
        w = self.weight
        s = f"weight_dtype={w.dtype.name}, {'per_channel' if w.axis is not None else 'per_tensor'}, " \
            f"bias={self.bias is not None}"
        if self.scale is not None:
            s += f", scale={float(self.scale)}, zero_point={int(self.zero_point)}, dtype={qdtype(self.dtype).name}"
        return s


class Linear(_Quantized):
    """Quantized ``x @ weight.T + bias`` with the weights packed once.

    Make one with :meth:`from_float`; call it on a per-tensor quantized ``x``
    of shape ``(..., in_features)``. Same results as
    ``qarray.ops.linear.linear(x, layer.weight, layer.bias, ...)``, bit for bit.
    """

    def __init__(self, weight: QArray, bias=None):
        _check_operand("Linear", "weight", weight, weight=True)
        if weight.ndim != 2 or weight.axis not in (None, 0):
            raise ValueError("Linear: weight must be (out_features, in_features), per-tensor or per-channel on axis 0")
        super().__init__(weight, bias)
        self.out_features, self.in_features = weight.shape
        self._packed = PackedWeight(weight.T, 1, keep=True)

    @classmethod
    def from_float(cls, w, b=None, weight_dtype=qint8, per_channel=True) -> "Linear":
        """Quantize float ``w`` ``(out, in)`` symmetrically (per output channel
        when ``per_channel``, each channel's scale at least ``WEIGHT_SCALE_FLOOR``
        = 1/256 of the largest, so dead units keep a usable bias) and keep float
        ``b`` ``(out,)``."""
        w = _float_weight("Linear", w, 2)
        return cls(_quantize_weight(w, weight_dtype, per_channel), _float_bias("Linear", b, w.shape[0]))

    def __call__(self, x: QArray, scale=None, zero_point=None, dtype=None, relu=False,
                 mode=None, rounding=None) -> QArray:
        _check_operand("Linear", "x", x, weight=False)
        if x.ndim < 1:
            raise ValueError("Linear: x must have at least one dimension")
        x2 = x if x.ndim > 1 else x.reshape(1, -1)
        out = self._packed.matmul("Linear", x2, self.bias, *self._out(scale, zero_point, dtype), mode, rounding, relu)
        return out if x.ndim > 1 else out.reshape(-1)

    def _reference(self, x):
        y = np.asarray(to_host(x), np.float32) @ to_host(self.weight.dequantize()).T
        return y if self.bias is None else y + self._float_bias()

    def __repr__(self):
        return f"Linear(in_features={self.in_features}, out_features={self.out_features}, {self._params_repr()})"


class Conv2d(_Quantized):
    """Quantized 2-D convolution (NCHW) with the weights packed once per group.

    Same results as ``qarray.ops.conv.conv2d(x, layer.weight, layer.bias,
    layer.stride, layer.padding, layer.dilation, layer.groups, ...)``, bit for bit.
    """

    def __init__(self, weight: QArray, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if not isinstance(weight, QArray) or weight.ndim != 4:
            raise ValueError("Conv2d: weight must be a QArray of shape (out_channels, in_channels / groups, kh, kw)")
        self.stride, self.padding, self.dilation, self.groups = check_conv_args(
            "Conv2d", weight.shape, stride, padding, dilation, groups)
        super().__init__(weight, bias)
        self._packed = pack_conv_weight("Conv2d", weight, self.groups, keep=True)

    @classmethod
    def from_float(cls, w, b=None, stride=1, padding=0, dilation=1, groups=1,
                   weight_dtype=qint8, per_channel=True) -> "Conv2d":
        """Quantize float ``w`` ``(O, C / groups, kh, kw)`` symmetrically (per output
        channel when ``per_channel``, each channel's scale at least
        ``WEIGHT_SCALE_FLOOR`` = 1/256 of the largest) and keep float ``b`` ``(O,)``."""
        w = _float_weight("Conv2d", w, 4)
        return cls(_quantize_weight(w, weight_dtype, per_channel), _float_bias("Conv2d", b, w.shape[0]),
                   stride, padding, dilation, groups)

    def __call__(self, x: QArray, scale=None, zero_point=None, dtype=None, relu=False,
                 mode=None, rounding=None) -> QArray:
        return conv_packed("Conv2d", x, self._packed, self.weight.shape, self.bias, self.stride, self.padding,
                           self.dilation, self.groups, *self._out(scale, zero_point, dtype), relu, mode, rounding)

    def _reference(self, x):
        x = np.asarray(to_host(x), np.float32)
        if x.ndim != 4:
            raise ValueError(f"Conv2d: x must have shape (N, C, H, W), got {x.shape}")
        w = to_host(self.weight.dequantize())
        (sh, sw), (ph, pw), (dh, dw), g = self.stride, self.padding, self.dilation, self.groups
        o, cg, kh, kw = w.shape
        xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
        win = np.lib.stride_tricks.sliding_window_view(xpad, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
        win = win[:, :, ::sh, ::sw, ::dh, ::dw]
        n, c, oh, ow = win.shape[:4]
        win = win.reshape(n, g, cg, oh, ow, kh, kw)
        y = np.einsum("ngchwij,gocij->ngohw", win, w.reshape(g, o // g, cg, kh, kw)).reshape(n, o, oh, ow)
        return y if self.bias is None else y + self._float_bias()[:, None, None]

    def __repr__(self):
        o, cg, kh, kw = self.weight.shape
        return (f"Conv2d({cg * self.groups}, {o}, kernel_size=({kh}, {kw}), stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, {self._params_repr()})")


class DynamicLinear:
    """Float ``x @ w.T + b`` with int8 or float16 weights, float32 out.

    ``weight_dtype="qint8"`` (or another quantized dtype): weights quantized
    symmetrically and packed once; each call quantizes ``x`` with
    ``quantize_dynamic(x, quint8)`` (per tensor, asymmetric), accumulates
    exactly in integers and returns ``float32(acc) * float32(x.scale * w.scale) + b``.
    ``weight_dtype="float16"``: weights stored as float16, computed in float32.

    >>> layer = DynamicLinear.from_float(numpy.eye(2, dtype=numpy.float32))
    >>> layer(numpy.array([[0.5, -1.0]], numpy.float32)).round(3)
    array([[ 0.498, -0.996]], dtype=float32)
    """

    def __init__(self, weight, bias=None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self._packed = PackedWeight(weight.T, 1, keep=True) if isinstance(weight, QArray) else None

    @classmethod
    def from_float(cls, w, b=None, weight_dtype="qint8", per_channel=True) -> "DynamicLinear":
        """Quantize (or cast to float16) float ``w`` ``(out, in)``; keep float ``b``.
        Per-channel scales are floored as in :meth:`Linear.from_float`."""
        w = _float_weight("DynamicLinear", w, 2)
        b = _float_bias("DynamicLinear", b, w.shape[0])
        if _is_float16(weight_dtype):
            return cls(w.astype(np.float16), b)
        return cls(_quantize_weight(w, weight_dtype, per_channel), b)

    def __call__(self, x):
        if isinstance(x, QArray):
            raise TypeError("DynamicLinear takes float input; use Linear for quantized input")
        x, backend = user_array(x, "DynamicLinear")
        x = float_values(x)
        xp = backend.xp
        if x.dtype.kind != "f" or x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"DynamicLinear: x must be float of shape (..., {self.in_features}), "
                             f"got {x.dtype} {x.shape}")
        x2 = x if x.ndim > 1 else x.reshape(1, -1)
        if self._packed is None:
            y = xp.matmul(x2.astype(xp.float32), self.weight.astype(xp.float32).T)
        else:
            qx = quantize_dynamic(x2, quint8)
            acc = self._packed.run("DynamicLinear", qx, None, None)
            s = np.float32(to_host(qx.scale)) * np.asarray(self._packed.scale, np.float32)
            y = acc.astype(xp.float32) * backend.param(s)
        if self.bias is not None:
            y = y + xp.asarray(self.bias)
        return y if x.ndim > 1 else y.reshape(-1)

    def __repr__(self):
        if self._packed is None:
            kind = "weight_dtype=float16"
        else:
            kind = f"weight_dtype={self.weight.dtype.name}, " \
                   f"{'per_channel' if self.weight.axis is not None else 'per_tensor'}"
        return (f"DynamicLinear(in_features={self.in_features}, out_features={self.out_features}, {kind}, "
                f"bias={self.bias is not None})")


class BlockLinear:
    """``x @ weight.T + bias`` for block-format weights (GGUF's Q4_0 ... Q6_K, IQ4_XS, the grouped
    formats such as ``int4_g128_f16``), packed once for Q8_0 activations: each call gives what
    ``qarray.linear(x, weight, bias, dtype=dtype)`` gives, bit for bit (the exact contracts of
    :mod:`qarray.ops.block_linear`), a float32 array (or ``dtype``'s). ``x`` is a float array, or
    Q8_0 activations, ``qarray.quantize(x, dtype="Q8_0")``, whose integer dot products run on the
    packed weights where the backend packs them (NumPy with Numba: 16 rows side by side for VNNI);
    float ``x`` against formats of 16 values or fewer runs on their 4-bit codes packed once too (16
    rows' codes a k, decoded in vector registers: ``qarray.backends.cpu.blocks_float``).

    >>> w = qarray.quantize(numpy.linspace(-1, 1, 4 * 64, dtype=numpy.float32).reshape(4, 64), dtype="Q4_0")
    >>> layer = BlockLinear(w)
    >>> x = qarray.quantize(numpy.ones((2, 64), numpy.float32), dtype="Q8_0")
    >>> bool((layer(x) == qarray.linear(x, w)).all())
    True
    """

    def __init__(self, weight: QArray, bias=None):
        if not isinstance(weight, QArray) or weight.dtype.kind != "block":
            raise TypeError(f"BlockLinear takes a block-format QArray weight (qarray.quantize(w, dtype='Q4_0'), "
                            f"a GGUF or Hugging Face checkpoint's), got {getattr(weight, 'dtype', type(weight))}; "
                            "for int8 weights use qarray.nn.Linear")
        if weight.ndim != 2:
            raise ValueError(f"BlockLinear: weight must be (out_features, in_features), got {weight.shape}")
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        fmt = weight.dtype.layout
        takes_q8 = q8_supported(fmt) is None and weight.columns is None
        self._packed = weight._backend.pack_blocks(weight.data, fmt) if takes_q8 else None
        self._packed_float = weight._backend.pack_blocks_float(weight.data, fmt, weight.global_scale) \
            if weight.columns is None else None

    def __call__(self, x, dtype=None):
        return block_linear(x, self.weight, self.bias, dtype, packed=self._packed, packed_float=self._packed_float)

    def __repr__(self):
        return (f"BlockLinear(in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight.dtype.name}, bias={self.bias is not None}, "
                f"packed={self._packed is not None})")
