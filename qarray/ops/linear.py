"""matmul and linear: exact integer products.

``matmul(a, b)`` with no output parameters is ONNX MatMulInteger (the exact
qint32 accumulator, scale ``a.scale * b.scale``); with ``scale``,
``zero_point`` and ``dtype`` it is QLinearMatMul (requantized, ``mode=`` and
``rounding=`` as everywhere). Activations are per-tensor; weights per-tensor or
per-channel along their output axis. Weights of 2, 4 or 8 bits and activations
of 2, 4, 8 or 16 bits (TFLite's 16x8 mode), signed or not, in any mix.

From an op to the arithmetic: :class:`PackedWeight` (the weights as the
backend packs them: :meth:`Backend.pack_weight`) -> :meth:`Backend.int_matmul`
of the activations, those weights and one plan, a ``qarray._params.Gemm``
(zero points, bias, the output ``Requant``, accumulator dtype): ``raw_matmul``,
the products of codes (on the CPU onnxruntime's int8 kernels,
``qarray.backends._gemm``, or exact float32 BLAS chunks), then
``gemm_epilogue``: zero-point terms, bias and requantize in one pass.
Floating-format operands (float8/float6/float4, MX, NVFP4, alone or mixed with
integer ones) go to :mod:`qarray.ops._exact`: the exact rational product,
rounded once.
"""

from __future__ import annotations

import numpy as np

from .. import backends as _backends
from ..backends import block_error, on_data_device
from .._dtypes import qint8, qint32, quint8
from .._config import resolve
from .._params import Gemm, kept, to_host
from .._qarray import QArray
from . import _exact
from ._output import finish, output_plan, wants_output
from .block_linear import block_linear

__all__ = ["matmul", "linear", "PackedWeight"]


def _check_operand(op, name, q, *, weight):
    if not isinstance(q, QArray):
        raise TypeError(f"{op}: {name} must be a QArray, got {type(q).__name__}; quantize it first")
    if q.dtype.kind == "block":
        raise block_error(op, q)
    if q.dtype.bits > (8 if weight else 16):
        what = "weights of 2, 4 or 8 bits" if weight else "inputs of 2, 4, 8 or 16 bits"
        raise TypeError(
            f"{op}: {name} has dtype {q.dtype.name}; matmul, linear and conv2d take {what} "
            "(qint8, quint8, qint4, ...; activations also qint16, quint16); requantize it first"
        )
    if q.block_size is not None:
        raise ValueError(f"{op}: {name} has blocked parameters; requantize it per-tensor or per-channel")
    if not weight and q.axis is not None:
        raise ValueError(f"{op}: {name} must have per-tensor parameters, got per-axis along axis {q.axis}")


def _bytes(a: QArray):
    """A 16-bit input's codes as ``(hi, lo)`` 8-bit codes, ``a = 256 * hi + lo``."""
    hi = (a.data >> 8).astype(np.int8 if a.dtype.signed else np.uint8)
    return (hi, qint8 if a.dtype.signed else quint8), ((a.data & 0xFF).astype(np.uint8), quint8)


class PackedWeight:
    """Weights ``(..., K, N)`` prepared once (:meth:`Backend.pack_weight`) for
    :meth:`Backend.int_matmul`, with their zero points and scales. ``nn`` layers
    keep one (``keep=True``: the backend may pack harder, e.g. into the CPU
    engine's own layout)."""

    __slots__ = ("backend", "packed", "zp", "scale", "dtype", "shape", "codes", "keep", "_other", "reach", "_calls")

    def __init__(self, w: QArray, axis, keep=False):
        """``w`` holds ``(..., K, N)`` weights; ``axis`` is where its per-channel
        parameters lie (must be the last, N) or None for per-tensor."""
        if w.axis is not None and w.axis != axis:
            raise ValueError(
                f"per-channel weights must have their parameters along the output-channel axis "
                f"({axis}), got axis {w.axis}"
            )
        self.backend, self.dtype, self.shape = w._backend, w.dtype, w.shape
        self.packed = self.backend.pack_weight(w.data, w.dtype, keep)
        self.zp = to_host(w.zero_point).astype(np.int64)
        self.zp.setflags(write=False)  # a kept key (int_matmul's column terms), as the bias integers are
        self.scale = to_host(w.scale)
        self.codes, self.keep, self._other = w.data, keep, None
        # the widest |w - zw|: whether int32 holds a call's sums (``run``)
        self.reach = int(np.max(np.maximum(self.zp - w.dtype.qmin, w.dtype.qmax - self.zp)))
        self._calls = {}  # matmul's kept calls

    def packed_for(self, b):
        """The weights packed by backend ``b`` (in-memory weights meeting Dask
        activations: the Dask backend packs them its way, once)."""
        if b is self.backend:
            return self.packed
        if self._other is None or self._other[0] is not b:
            self._other = (b, b.pack_weight(self.codes, self.dtype, self.keep))
        return self._other[1]

    def run(self, op, a: QArray, bias, rq, wide=False):
        """The exact ``(a - za) @ (w - zw) + bias`` (``bias`` int64 ``(N,)`` or
        None): int32, or int64 when ``wide`` or when int32 could overflow; or,
        with ``rq``, requantized in the same pass (``a`` per-tensor)."""
        b = _backends.common(a.data, self.packed.colsum)
        pw = self.packed_for(b)
        k_len = a.shape[-1]
        if k_len != self.shape[-2]:
            raise ValueError(f"{op}: shapes {a.shape} and {self.shape} do not align: {k_len} != {self.shape[-2]} (K)")
        za = int(to_host(a.zero_point))
        if a.dtype.bits > 8:  # a = 256 * hi + lo: two 8-bit products, combined in int64
            (hi, dh), (lo, dl) = _bytes(a)
            acc = 256 * b.int_matmul(hi, pw, Gemm(0, self.zp, acc_dtype=np.int64, qd=dh))
            acc += b.int_matmul(lo, pw, Gemm(0, self.zp, acc_dtype=np.int64, qd=dl))
            colsum = pw.colsum + k_len * (pw.shift - b.param(self.zp))  # sum_k (w - zw)
            acc -= za * colsum[..., None, :]
            if bias is not None:
                acc += bias
            return acc if rq is None else b.requantize(acc, rq)
        return b.int_matmul(a.data, pw, self._plan(a, k_len, bias, rq, wide))

    def _plan(self, a: QArray, k_len, bias, rq, wide=False, **conv) -> Gemm:
        """The ``Gemm`` of ``a``'s 8-bit codes (``k_len`` of them a row) times
        these weights; ``conv``: conv2d's stride, padding and dilation."""
        za = int(to_host(a.zero_point))
        # worst |(a - za) * (w - zw)| summed over K, plus a bias, must fit to use int32
        wa = max(za - a.dtype.qmin, a.dtype.qmax - za)
        wide = wide or k_len * wa * self.reach + _reach(bias) >= 2**31 - 2**30
        return Gemm(za, self.zp, bias, rq, np.int64 if wide else np.int32, a.dtype, **conv)

    def conv(self, x: QArray, kh, kw, bias, rq, stride, padding, dilation):
        """conv2d (groups 1) by these weights, rows ``(p, q, c)``, made ready for
        codes of ``x``'s (8-bit, NCHW): a function of such codes giving
        :meth:`run`'s on their patches, ``(N*OH*OW, O)``
        (:meth:`Backend.conv_gemm_plan`)."""
        b = _backends.common(x.data, self.packed.colsum)
        gp = self._plan(x, kh * kw * x.shape[1], bias, rq, stride=stride, padding=padding, dilation=dilation)
        run = b.conv_gemm_plan(x.data.transpose(0, 2, 3, 1), kh, kw, self.packed_for(b), gp)
        return lambda codes: run(codes.transpose(0, 2, 3, 1))

    def matmul(self, op, a: QArray, bias, scale, zero_point, dtype, mode, rounding, relu) -> QArray:
        """``a @ w + bias`` as ``op`` (``finish``'s output). A call that
        requantizes 2-D 8-bit NumPy codes keeps its work (:meth:`call_key`)."""
        b = self.backend
        key = self.call_key(op, a, bias, scale, zero_point, dtype, mode, rounding, relu,
                            a.ndim == 2 and len(self.shape) == 2 and a.shape[-1] == self.shape[0])
        hit = self.kept_call(key, bias, a.data)
        if hit is not None:
            return hit
        factors = [to_host(a.scale), self.scale]
        ints = None if bias is None else _bias_ints(op, b, bias, factors, self.shape[-1], mode, rounding)
        axis = max(a.ndim, len(self.shape)) - 1  # N, the output's last axis
        if key is None:
            return finish(op, b, lambda rq: self.run(op, a, ints, rq), factors, axis, scale, zero_point, dtype,
                          default_dtype=a.dtype, mode=mode, rounding=rounding, relu=relu)
        rq, d, s_out, z_out = output_plan(op, factors, axis, scale, zero_point, dtype, a.dtype, *key[-1], relu)
        run = b.int_matmul_plan(a.data, self.packed, self._plan(a, a.shape[-1], ints, rq))
        return self.keep_call(key, bias, run, a.data, s_out, z_out, d)

    def call_key(self, op, a, bias, scale, zero_point, dtype, mode, rounding, relu, aligned, *more):
        """The key of a call whose work is kept (:meth:`matmul`; conv2d's
        ``conv_packed``, ``more`` its stride, padding and dilation): everything
        the call depends on but the codes (the bias by identity, the entry
        holding it; the settings and instruction set the backend's function was
        made for: ``Backend.plan_state``), or None for a call that runs as it
        comes (an accumulator out, Dask or device codes, 16-bit or per-channel
        codes, output parameters that are arrays, operands that do not
        ``aligned``). After a kernel had evicted it from the caches,
        nn.Linear's Python path took ~120 us a call, 55-80 kept."""
        if (not aligned or type(a.data) is not np.ndarray or a.dtype.bits > 8 or a.axis is not None
                or self.backend.name != "numpy" or not wants_output(scale, zero_point, dtype)):
            return None
        key = (op, a.scale.item(), a.zero_point.item(), id(bias), a.dtype, a.data.dtype, a.data.shape, scale,
               zero_point, dtype, relu, *more, self.backend.plan_state(), resolve(mode, rounding))
        try:
            hash(key)
        except TypeError:  # an array among the output parameters
            return None
        return key

    def kept_call(self, key, bias, codes):
        """The output of the call ``key`` (:meth:`call_key`) on ``codes`` where
        its work is kept (:meth:`keep_call`), else None."""
        hit = None if key is None else self._calls.get(key)
        if hit is None or hit[1] is not bias:
            return None
        return QArray._new(hit[0](codes), *hit[2:], None, None)

    def keep_call(self, key, bias, run, codes, scale, zero_point, dtype):
        """Keep the call ``key``'s work, ``run(codes)`` its integers and the rest
        its output parameters, and return its output on ``codes``."""
        if len(self._calls) >= 64:  # (a process that sweeps shapes: kept from growing)
            self._calls.clear()
        self._calls[key] = run, bias, scale, zero_point, dtype
        return QArray._new(run(codes), scale, zero_point, dtype, None, None)


@kept
def _reach(bias) -> int:
    """The largest ``|bias|`` (0 for none): with the products' bound, whether
    int32 holds the sums. A device bias counts as too large (int64 sums)."""
    if bias is None:
        return 0
    return int(np.abs(bias).max(initial=0)) if isinstance(bias, np.ndarray) else 2**62


def _bias_ints(op, b, bias, factors, n, mode, rounding):
    """The bias as int64 at the accumulator's scale ``a.scale * w.scale``."""
    if isinstance(bias, QArray):
        acc_scale = _acc_scale(*factors, n)
        if bias.dtype is not qint32 or bias.shape != (n,):
            raise ValueError(f"{op}: a quantized bias must be qint32 of shape ({n},), got {bias.dtype.name} {bias.shape}")
        if bias.axis is None and np.all(to_host(bias.scale) == acc_scale) and not np.any(to_host(bias.zero_point)):
            return bias.data.astype(np.int64)
        axis = 0 if acc_scale.ndim and np.ptp(acc_scale) else None
        target = acc_scale if axis is not None else acc_scale[0]
        return bias.requantize(target, 0, qint32, axis=axis, mode=mode, rounding=rounding).data.astype(np.int64)
    return b.param(_float_bias_ints(op, np.asarray(to_host(bias)), *factors, n))


def _acc_scale(s_a, s_w, n):
    """The accumulator's float32 scale per output channel, ``(n,)``."""
    return np.broadcast_to(np.float32(s_a) * np.asarray(s_w, np.float32), (n,))


@kept
def _float_bias_ints(op, bias_h, s_a, s_w, n):
    """A float bias as int64 at the accumulator's scale; kept (read-only): a
    layer's bias and its input scale repeat call after call."""
    if bias_h.dtype.kind != "f" or bias_h.shape != (n,):
        raise ValueError(f"{op}: bias must be a float array of shape ({n},) or a qint32 QArray, got {bias_h.dtype} {bias_h.shape}")
    acc_scale = _acc_scale(s_a, s_w, n)
    with np.errstate(over="ignore"):
        q = np.rint(bias_h.astype(np.float32) / acc_scale)
    bad = np.flatnonzero(~(np.abs(q) < 2**31))
    if bad.size:
        c = bad[0]
        more = f" and {bad.size - 3} more" if bad.size > 3 else ""
        raise ValueError(
            f"{op}: bias / (input scale * weight scale) does not fit in int32 for output channel(s) "
            f"{bad[:3].tolist()}{more} (channel {c}: bias {bias_h[c]!s}, input scale * weight scale "
            f"{acc_scale[c]!s}); quantize x, or that channel's weights, with a larger scale"
        )
    ints = q.astype(np.int64)
    ints.setflags(write=False)
    return ints


@on_data_device
def matmul(a: QArray, b: QArray, *, bias=None, scale=None, zero_point=None, dtype=None,
           relu=False, mode=None, rounding=None) -> QArray:
    """Quantized ``a @ b``: exact integer products, then the qint32 accumulator or
    (with ``scale``, ``zero_point``, ``dtype``) the requantized result.

    ``a`` (``(..., M, K)``, per-tensor) and ``b`` (``(K, N)`` or ``(..., K, N)``,
    per-tensor or per-channel along its last axis) may each be qint8, quint8,
    qint4, quint4, qint2 or quint2 (``a`` also 16 bits). ``a`` may instead
    have per-row parameters (along M, at most 8 bits) with ``b`` per-tensor, as
    a gradient quantized per output channel meets activations in
    ``grad_w = matmul(grad_out.T, x)``; the result's parameters then lie along
    its rows. ``dtype`` defaults to ``a.dtype``.

    >>> a = QArray.from_int(numpy.array([[1, 2]]), 0.5, 0, "quint8")
    >>> w = QArray.from_int(numpy.array([[3], [-4]]), 0.25, 0, "qint8")
    >>> matmul(a, w).int_repr(), matmul(a, w).scale
    (array([[-5]], dtype=int32), array(0.125, dtype=float32))

    When either operand has a floating format (float8, float6, float4, MX,
    NVFP4; the other may be an integer format of up to 16 bits), any layout of
    parameters, the product is computed exactly and rounded once (``bias``, a
    float array of N, added exactly and ``relu`` applied before): with no
    output parameters, or ``dtype="float32"`` (``scale`` optional), to a
    float32 array, correctly rounded; with ``scale`` (``zero_point``,
    ``dtype``, which defaults to ``a.dtype``) to that QArray: an integer format
    by ``rounding=`` (``mode`` does not apply), a floating one to nearest even,
    saturating. NaN/inf operand values or NaN block scales give their outputs
    IEEE float64's answer (an integer output refuses them).
    """
    for q in (a, b):
        if isinstance(q, QArray) and q.dtype.kind == "block":
            raise block_error("matmul", q)
    if _exact.takes(a, b):
        return _exact.matmul("matmul", a, b, bias, scale, zero_point, dtype, relu, mode, rounding)
    if isinstance(a, QArray) and a.axis is not None and a.block_size is None:
        return _matmul_rows(a, b, bias, scale, zero_point, dtype, relu, mode, rounding)
    _check_operand("matmul", "a", a, weight=False)
    _check_operand("matmul", "b", b, weight=True)
    _check_ndim(a, b)
    if b.axis is not None and b.axis != b.ndim - 1:
        raise ValueError(
            f"matmul: b's per-channel parameters lie along axis {b.axis}; they must lie along its columns (axis "
            f"{b.ndim - 1}, N) or b must be per-tensor: parameters along K, the summed axis, cannot be taken out "
            "of an exact integer sum. For a linear layer's input gradient grad_out @ w, quantize the float "
            "weights per input feature (axis=1) or per tensor for the backward pass"
        )
    packed = PackedWeight(b, b.ndim - 1)
    return packed.matmul("matmul", a, bias, scale, zero_point, dtype, mode, rounding, relu)


def _check_ndim(a, b):
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul takes arrays of 2 or more dimensions, got shapes {a.shape} and {b.shape}")


def _matmul_rows(a, b, bias, scale, zero_point, dtype, relu, mode, rounding):
    """``a @ b`` with ``a`` per row (parameters along M, e.g. a gradient
    ``grad_out.T`` quantized per output channel): ``(b^T @ a^T)^T``, the same
    exact integers, with ``a^T`` as the per-column weights the engines take.
    The result's parameters lie along its rows."""
    if not isinstance(b, QArray):
        _check_operand("matmul", "b", b, weight=False)  # its TypeError
    _check_ndim(a, b)
    if a.axis != a.ndim - 2:
        raise ValueError(
            f"matmul: a's per-channel parameters lie along axis {a.axis}; they must lie along its rows (axis "
            f"{a.ndim - 2}, M) or a must be per-tensor: parameters along K, the summed axis, cannot be taken out "
            "of an exact integer sum (requantize a per-tensor first)"
        )
    if b.axis is not None:
        raise ValueError(
            "matmul: a has per-row parameters and b per-column ones: the product's scale would change along both "
            "axes, which no QArray layout holds; quantize one of them per tensor"
        )
    if bias is not None:
        raise ValueError("matmul: a bias (per column) does not go with a per-row a; add it to the result")
    _check_operand("matmul", "a (per row, taken as the weights of b^T @ a^T)", a, weight=True)
    _check_operand("matmul", "b", b, weight=False)
    packed = PackedWeight(np.swapaxes(a, -1, -2), a.ndim - 1)
    out = packed.matmul("matmul", np.swapaxes(b, -1, -2), None, scale, zero_point,
                        a.dtype if dtype is None and scale is not None else dtype, mode, rounding, relu)
    return np.swapaxes(out, -1, -2)


@on_data_device
def linear(x: QArray, w: QArray, bias=None, *, scale=None, zero_point=None, dtype=None,
           relu=False, mode=None, rounding=None) -> QArray:
    """Quantized ``x @ w.T + bias``, with ``w`` of shape ``(out, in)`` per-tensor or
    per-channel along axis 0. ``bias`` is float (quantized to qint32 at scale
    ``x.scale * w.scale``) or a qint32 QArray. Output rules as :func:`matmul`,
    floating formats too (then ``w`` may have any layout, e.g. MX blocks along in_features).

    A block-format ``w`` (Q4_0, Q4_K, int4_g128_f16, ...) takes float activations ``x`` (float32,
    float16, bfloat16) or Q8_0 ones and gives a float32 array (``dtype="like"``: x's dtype; or
    ``"float16"``, ``"bfloat16"``), by the exact contracts of :mod:`qarray.ops.block_linear`."""
    if isinstance(w, QArray) and w.dtype.kind == "block":
        return block_linear(x, w, bias, dtype, scale=scale, zero_point=zero_point, mode=mode, rounding=rounding,
                            relu=relu)
    if isinstance(x, QArray) and x.dtype.kind == "block":  # (block activations meet block weights only)
        raise block_error("linear", x)
    exact = _exact.takes(x, w)
    if exact:
        _exact.check_types("linear", ("x", x), ("w", w))
    else:
        _check_operand("linear", "x", x, weight=False)
        _check_operand("linear", "w", w, weight=True)
    if w.ndim != 2:
        raise ValueError(f"linear: w must have shape (out_features, in_features), got {w.shape}")
    if not exact and w.axis not in (None, 0):
        raise ValueError(f"linear: per-channel weights must have their parameters along axis 0 (output features), got axis {w.axis}")
    if x.ndim < 1:
        raise ValueError("linear: x must have at least one dimension")
    x2 = x if x.ndim > 1 else x.reshape(1, -1)
    if exact:
        out = _exact.matmul("linear", x2, w.T, bias, scale, zero_point, dtype, relu, mode, rounding)
    else:
        out = PackedWeight(w.T, 1).matmul("linear", x2, bias, scale, zero_point, dtype, mode, rounding, relu)
    return out if x.ndim > 1 else out.reshape(-1)
