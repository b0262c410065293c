"""add, sub, mul (and scalar forms) with NumPy broadcasting; relu and clamps.

Integer-only by default (``mode="fixed"``): ``mul`` forms the exact products
``(a - za) * (b - zb)`` at scale ``a.scale * b.scale`` and requantizes them once;
``add`` / ``sub`` first rescale each input exactly-rounded onto a common fine
scale ``2 * max(a.scale, b.scale) / 2**shift`` (TFLite's scheme: ``shift`` 20
for 8-bit inputs, 15 for 16-bit, 28 for 32-bit, int64 operands never
clamped), add exactly, and requantize once. ``mode="float"`` is the ONNX way:
dequantize, compute in float32, quantize. The relu family keeps the input's parameters and works on the
integers directly (exact); pass output parameters to requantize as well.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .. import backends as _backends
from ..backends import on_data_device
from .._api import quantize, requantize
from .._config import resolve
from .._dtypes import qint8
from .._fixed_point import Binary, identity, plan
from .._params import expand, kept, to_host
from .._qarray import QArray
from ._output import finish, output_params, output_plan, wants_output

__all__ = ["add", "sub", "mul", "add_scalar", "mul_scalar", "prelu", "relu", "relu6", "clamp", "hardtanh"]


def _operands(op, a, b):
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QArray):
            raise TypeError(f"{op}: {name} must be a QArray, got {type(q).__name__} (add_scalar and mul_scalar take numbers)")
        if q.axis is not None:
            raise ValueError(f"{op}: {name} has per-axis parameters; {op} takes per-tensor inputs (requantize first)")
    backend = _backends.common(a.data, b.data)
    if a.shape == b.shape:
        return backend, a.shape
    try:
        shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None
    return backend, shape


def _zp(q: QArray) -> int:
    return int(to_host(q.zero_point))


def _float_op(op, a, b, ufunc, scale, zero_point, dtype, relu):
    d, s, z = output_params(op, scale, zero_point, dtype, a.dtype)
    with np.errstate(over="ignore"):  # beyond float32: inf, which quantize saturates
        y = ufunc(a.dequantize(), b.dequantize())
    out = quantize(y, s, z, d)
    return relu_(out) if relu else out


def _left_shift(a, b) -> int:
    """Bits of headroom on add's common scale, from the wider input: TFLite's 20
    for 8-bit inputs and 15 for 16-bit; 28 for 32-bit inputs (int64 operands
    below 2**59). The operands are never clamped."""
    return {8: 20, 16: 15, 32: 28}[max(8, a.bits, b.bits)]


def _add(op, a, b, sign, scale, zero_point, dtype, relu, mode, rounding):
    backend, _ = _operands(op, a, b)
    xp = backend.xp
    mode, rounding = resolve(mode, rounding)
    s_a, s_b = to_host(a.scale), to_host(b.scale)
    if not wants_output(scale, zero_point, dtype):
        if s_a != s_b:
            raise ValueError(
                f"{op}: inputs have scales {s_a} and {s_b}; pass the output "
                "scale= (with zero_point= and dtype=), or give both inputs one scale for the exact qint32 result"
            )
        acc = backend.binary(a.data, b.data, Binary(op, identity(_zp(a)), identity(_zp(b))))
        return finish(op, backend, acc, [s_a], None, None, None, None, default_dtype=a.dtype, relu=relu)
    if mode == "float":
        return _float_op(op, a, b, xp.add if sign > 0 else xp.subtract, scale, zero_point, dtype, relu)
    if rounding == "tflite" and max(a.dtype.bits, b.dtype.bits) > 16:
        # TFLite's add shifts its operands left in int32: 32-bit ones would saturate
        raise ValueError(
            f"{op}: rounding='tflite' follows TFLite's add, which takes inputs of 16 bits or less; "
            f"got {a.dtype.name} and {b.dtype.name}: use another rounding (e.g. 'half_away')"
        )
    ra, rb, rq, d, s_out, z_out = _add_plans(op, a.dtype, s_a, a.zero_point, b.dtype, s_b, b.zero_point, scale,
                                             zero_point, dtype, mode, rounding, relu)
    return QArray._new(backend.binary(a.data, b.data, Binary(op, ra, rb, rq)), s_out, z_out, d)


@kept
def _add_plans(op, da, s_a, z_a, db, s_b, z_b, scale, zero_point, dtype, mode, rounding, relu):
    """Each input onto the common scale ``2 * max / 2**shift`` (exact in
    float64), rounded once, and the exact int64 sum requantized once to the
    output (``finish``'s output plan): the three ``Requant`` and the output
    parameters, kept (they repeat call after call)."""
    common = 2.0 * max(np.float64(s_a), np.float64(s_b)) / 2.0 ** _left_shift(da, db)
    ra, rb = (plan([s], common, int(z), 0, None, mode, rounding) for s, z in ((s_a, z_a), (s_b, z_b)))
    return ra, rb, *output_plan(op, [np.float64(common)], None, scale, zero_point, dtype, da, mode, rounding, relu)


@on_data_device(integer_only=True)
def add(a: QArray, b: QArray, *, scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """Quantized ``a + b`` with broadcasting; inputs may differ in parameters and dtype.

    Without output parameters the inputs must share a scale and the result is
    the exact qint32 sum. ``relu=True`` fuses a ReLU.

    >>> a = qarray.quantize(numpy.array([1.0, 2.0]), 0.1, 0, "qint8")
    >>> b = qarray.quantize(numpy.array([0.5, -3.0]), 0.05, 100, "quint8")
    >>> add(a, b, scale=0.1, zero_point=0, dtype="qint8").dequantize()
    array([ 1.5, -1. ], dtype=float32)
    """
    return _add("add", a, b, 1, scale, zero_point, dtype, relu, mode, rounding)


@on_data_device(integer_only=True)
def sub(a: QArray, b: QArray, *, scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """Quantized ``a - b``; as :func:`add`."""
    return _add("sub", a, b, -1, scale, zero_point, dtype, relu, mode, rounding)


@on_data_device(integer_only=True)
def mul(a: QArray, b: QArray, *, scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """Quantized ``a * b`` with broadcasting: the exact products ``(a - za) * (b - zb)``
    at scale ``a.scale * b.scale``, requantized once to the output parameters (or
    returned as the qint32 accumulator when none are given)."""
    backend, _ = _operands("mul", a, b)
    mode, rounding = resolve(mode, rounding)
    if mode == "float" and wants_output(scale, zero_point, dtype):
        return _float_op("mul", a, b, backend.xp.multiply, scale, zero_point, dtype, relu)
    _check_product(a, b)
    ra, rb = identity(_zp(a)), identity(_zp(b))

    def acc(rq):
        return backend.binary(a.data, b.data, Binary("mul", ra, rb, rq))

    return finish("mul", backend, acc, [to_host(a.scale), to_host(b.scale)], None, scale, zero_point, dtype,
                  default_dtype=a.dtype, mode=mode, rounding=rounding, relu=relu)


def _check_product(a: QArray, b: QArray) -> None:
    """ValueError unless every product ``(a - za) * (b - zb)`` fits in int64:
    from the dtypes and zero points, else (two 32-bit inputs) from the data."""
    def reach(q, data):
        z = _zp(q)
        if data:
            if q.size == 0:
                return 0
            lo, hi = (int(v) for v in to_host(q._backend.xp.stack([q.data.min(), q.data.max()])))
        else:
            lo, hi = q.dtype.qmin, q.dtype.qmax
        return max(z - lo, hi - z)

    if reach(a, False) * reach(b, False) < 2**63:
        return
    worst = reach(a, True) * reach(b, True)
    if worst >= 2**63:
        raise ValueError(
            f"mul: the exact products of these {a.dtype.name} and {b.dtype.name} inputs reach "
            f"{worst}, beyond int64; requantize one input to 16 bits first"
        )


def _constant(q: QArray, value, op):
    v = float(value)
    if not np.isfinite(v):
        raise ValueError(f"{op}: the scalar must be finite, got {value!r}")
    b = q._backend
    return QArray.from_int(b.asarray(np.int8(1 if v >= 0 else -1)), abs(v), 0, qint8) if v else None


@on_data_device(integer_only=True)
def add_scalar(q: QArray, value, *, scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """``q + value``; output parameters default to the input's."""
    if not isinstance(q, QArray):
        raise TypeError(f"add_scalar: q must be a QArray, got {type(q).__name__}")
    if not wants_output(scale, zero_point, dtype):
        scale, zero_point, dtype = q.scale, q.zero_point, q.dtype
    c = _constant(q, value, "add_scalar")
    if c is None:
        out = requantize(q, scale, zero_point, dtype, mode=mode, rounding=rounding)
        return relu_(out) if relu else out
    return add(q, c, scale=scale, zero_point=zero_point, dtype=dtype, relu=relu, mode=mode, rounding=rounding)


@on_data_device(integer_only=True)
def mul_scalar(q: QArray, value, *, scale=None, zero_point=None, dtype=None, relu=False, mode=None, rounding=None) -> QArray:
    """``q * value``. Without output parameters this is exact and changes only the
    parameters (scale ``|value| * q.scale``; a negative value mirrors the codes),
    as PyTorch's quantized ``mul_scalar`` does."""
    if not isinstance(q, QArray):
        raise TypeError(f"mul_scalar: q must be a QArray, got {type(q).__name__}")
    if q.axis is not None:
        raise ValueError("mul_scalar takes per-tensor inputs (requantize first)")
    if wants_output(scale, zero_point, dtype):
        c = _constant(q, value, "mul_scalar")
        if c is None:
            c = QArray.from_int(q._backend.asarray(np.int8(0)), 1.0, 0, qint8)
        return mul(q, c, scale=scale, zero_point=zero_point, dtype=dtype, relu=relu, mode=mode, rounding=rounding)
    v = float(value)
    if v == 0 or not np.isfinite(v):
        raise ValueError(f"mul_scalar: without output parameters the scalar must be finite and nonzero, got {value!r}")
    d, zp = q.dtype, int(to_host(q.zero_point))
    data, z = (q.data, zp) if v > 0 else ((d.qmin + d.qmax - q.data.astype(np.int64)).astype(d.storage), d.qmin + d.qmax - zp)
    out = QArray.from_int(data, np.float32(abs(v)) * to_host(q.scale), z, d)
    return relu_(out) if relu else out


def _alpha(q: QArray, alpha, axis):
    """prelu's slope as float32 host values: ``(alpha, axis)``, ``alpha`` 0-d
    (``axis`` None) or of length ``q.shape[axis]``."""
    if isinstance(alpha, QArray):
        raise TypeError("prelu: alpha must be a float or a 1-D float array, got a QArray; dequantize it first")
    a = np.asarray(to_host(alpha))
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"prelu: alpha must be a float or a 1-D float array, got dtype {a.dtype}")
    if a.ndim > 1:
        raise ValueError(f"prelu: alpha must be a scalar or 1-D (one slope per channel), got shape {a.shape}")
    with np.errstate(over="ignore"):  # beyond float32: inf, refused below
        a = a.astype(np.float32)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"prelu: alpha must be finite, got {alpha!r}")
    if a.size == 1:  # one slope for every channel (as PyTorch's num_parameters=1)
        return a.reshape(()), None
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"prelu: axis must be an integer, got {type(axis).__name__}")
    if not -q.ndim <= axis < q.ndim:
        raise ValueError(f"prelu: axis {axis} is out of range for an input of {q.ndim} dimension(s)")
    axis = int(axis) % q.ndim
    if a.size != q.shape[axis]:
        raise ValueError(
            f"prelu: alpha has {a.size} slopes but the input has {q.shape[axis]} channels along axis {axis}; "
            "pass one slope per channel (or a scalar)"
        )
    return a, axis


@on_data_device(integer_only=True)
def prelu(q: QArray, alpha, *, axis=1, scale=None, zero_point=None, dtype=None, mode=None, rounding=None) -> QArray:
    """Quantized PReLU: ``x`` for ``x >= 0``, ``alpha[c] * x`` below (PyTorch's ``nn.PReLU``).

    Parameters
    ----------
    q : QArray
        The input, per-tensor or per-axis (blocked parameters raise ValueError).
    alpha : float or 1-D float array
        The slope of the negative side, taken as float32 (PyTorch's weight): a
        scalar, or one per channel along ``axis`` (a 1-element array counts as a
        scalar, and ``axis`` is then ignored). Any finite value: 0, negative, > 1.
    axis : int
        The channel axis of a per-channel ``alpha`` (default 1, NCHW).
    scale, zero_point, dtype
        Output parameters; with none given, the input's (per-tensor input only:
        per-axis input needs them). Otherwise ``scale`` is needed,
        ``zero_point`` defaults to 0 and ``dtype`` to the input's.
    mode, rounding
        As :func:`qarray.requantize`. Both sides are requantizes: codes at or
        above the input zero point with multiplier ``s_in / s_out``, codes below
        it with ``s_in * |alpha[c]| / s_out`` (a negative slope requantizes the
        mirrored codes ``-(q - z_in)`` exactly); ``alpha = 0`` gives the output
        zero point.

    Examples
    --------
    >>> q = QArray.from_int(numpy.array([[-20, 10], [-20, 10]]), 0.1, 0, "qint8")
    >>> prelu(q, numpy.array([0.25, -0.5]), axis=0).int_repr()
    array([[-5, 10],
           [10, 10]], dtype=int8)
    """
    if not isinstance(q, QArray):
        raise TypeError(f"prelu: q must be a QArray, got {type(q).__name__}; quantize it first")
    if q.block_size is not None:
        raise ValueError("prelu: blocked parameters are not supported; requantize per-tensor or per-axis first")
    a, a_axis = _alpha(q, alpha, axis)
    if not wants_output(scale, zero_point, dtype):
        if q.axis is not None:
            raise ValueError(
                "prelu: the output is per-tensor, so per-axis input needs output scale=, zero_point= and dtype="
            )
        d, s_out, z_out = q.dtype, to_host(q.scale), to_host(q.zero_point)
    else:
        d, s_out, z_out = output_params("prelu", scale, zero_point, dtype, q.dtype)
    if q.axis is not None and a_axis is not None and q.axis != a_axis:
        raise ValueError(
            f"prelu: the input is per-axis along axis {q.axis} but alpha is per-channel along axis {a_axis}; "
            "requantize the input per-tensor (or along the slope's axis) first"
        )
    mode, rounding = resolve(mode, rounding)
    b = q._backend
    xp = b.xp
    s_in, z_in = to_host(q.scale).astype(np.float32), to_host(q.zero_point).astype(np.int64)
    # the positive side: an ordinary requantize to the output
    pos = b.requantize(q.data, plan([s_in], s_out, z_in, z_out, d, mode, rounding, axis=q.axis))
    # the negative side: slope |alpha| (1 where alpha is 0, whose multiplier is then
    # zeroed), codes mirrored where alpha < 0: (-q) - (-z_in) == -(q - z_in) exactly
    neg_axis = a_axis if a_axis is not None else q.axis
    zero, flip = a == 0, a < 0
    rq = plan([s_in, np.where(zero, np.float32(1), np.abs(a))], s_out, np.where(flip, -z_in, z_in), z_out, d,
              mode, rounding, axis=neg_axis)
    if zero.any():
        rq = dataclasses.replace(rq, m=np.where(zero, 0, rq.m), f=np.where(zero, 0.0, rq.f))
    codes = q.data
    if flip.any():
        wide = xp.int32 if q.dtype.bits <= 16 else xp.int64
        sign = expand(b.param(np.where(flip, -1, 1).astype(wide)), q.shape, a_axis, None)
        codes = q.data.astype(wide) * sign
    neg = b.requantize(codes, rq)
    z = expand(b.param(z_in.astype(q.dtype.storage)), q.shape, q.axis, None)
    data = xp.where(q.data >= z, pos, neg)
    return QArray._new(data, np.asarray(s_out, np.float32), np.asarray(z_out, np.int32), d, None, None, b)


def _bound(op, name, v):
    """A clamp bound as float32, or None; TypeError / ValueError that name it."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number or None, got {type(v).__name__}")
    try:
        with np.errstate(over="ignore"):  # beyond float32: +-inf, which clamps nothing away
            t = np.float32(v)
    except OverflowError:  # an int beyond float64
        t = np.float32(math.inf if v > 0 else -math.inf)
    if np.isnan(t):
        raise ValueError(f"{op}: {name} must not be NaN")
    return t


def _codes(q: QArray, t, default):
    """Real bound ``t`` as codes of ``q``'s own parameters (quantized the way quantize
    does), broadcastable against ``q``; ``default`` when ``t`` is None."""
    if t is None:
        return default
    # one element per parameter slot: per-axis slots are a vector, blocked ones blocks of 1
    axis, block = (None, None) if q.axis is None else (0, None) if q.block_size is None else (q.axis, 1)
    s = q.scale
    c = quantize(np.full(s.shape, t, np.float32), s, q.zero_point, q.dtype, axis=axis, block_size=block).data
    if q.axis is None:  # a host scalar: a kernel argument
        return c[()]
    return expand(q._backend.param(c), q.shape, q.axis, q.block_size)


def _clamp(op, q, lo, hi, names=("min", "max"), *, scale=None, zero_point=None, dtype=None, mode=None,
           rounding=None) -> QArray:
    """The relu family: bounds quantized with ``q``'s parameters, codes clipped."""
    if not isinstance(q, QArray):
        raise TypeError(f"{op}: q must be a QArray, got {type(q).__name__}")
    lo_t, hi_t = _bound(op, names[0], lo), _bound(op, names[1], hi)
    if lo_t is not None and hi_t is not None and lo > hi:
        raise ValueError(f"{op}: {names[0]} {lo} is greater than {names[1]} {hi}")
    data = q._backend.clip(q.data, _codes(q, lo_t, q.dtype.qmin), _codes(q, hi_t, q.dtype.qmax))
    out = q._with(data, axis=q.axis, block_size=q.block_size)
    if wants_output(scale, zero_point, dtype):
        return requantize(out, scale, 0 if zero_point is None else zero_point, dtype, mode=mode, rounding=rounding)
    return out


@on_data_device(integer_only=True)
def clamp(q: QArray, min=None, max=None, *, scale=None, zero_point=None, dtype=None, mode=None, rounding=None) -> QArray:
    """Clamp to real ``[min, max]`` (real numbers; either may be None). The bounds are
    quantized with ``q``'s parameters and the codes clipped: exact, parameters kept."""
    return _clamp("clamp", q, min, max, scale=scale, zero_point=zero_point, dtype=dtype, mode=mode, rounding=rounding)


@on_data_device(integer_only=True)
def relu(q: QArray, **out) -> QArray:
    """``max(q, 0)``: codes below the zero point become the zero point."""
    return _clamp("relu", q, 0.0, None, **out)


relu_ = relu


@on_data_device(integer_only=True)
def relu6(q: QArray, **out) -> QArray:
    """``min(max(q, 0), 6)``."""
    return _clamp("relu6", q, 0.0, 6.0, **out)


@on_data_device(integer_only=True)
def hardtanh(q: QArray, min_val=-1.0, max_val=1.0, **out) -> QArray:
    """``min(max(q, min_val), max_val)``."""
    return _clamp("hardtanh", q, min_val, max_val, ("min_val", "max_val"), **out)
