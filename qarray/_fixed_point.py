"""Integer-only requantization: the multiplier, the 128-bit rounding shift, and
``Requant``, the one record that carries a requantize from an op to a kernel.

A real multiplier ``M = scale_in / scale_out`` becomes an integer ``m`` in
``[2**30, 2**31)`` and a right shift ``s`` so that ``M ~= m / 2**s`` (TFLite's
QuantizeMultiplier, TVM's GetFixedPointMultiplierShift). Then

    q_out = clamp(R((q - zp_in) * m, s) + zp_out, qmin, qmax)

where ``R(v, s)`` divides by ``2**s`` and breaks ties by the chosen rounding.
The product ``(q - zp_in) * m`` needs up to 94 bits (int64 accumulators times a
31-bit multiplier), so it is formed exactly as ``h * 2**32 + l`` from two
64-bit products. Worked example: ``M = 0.3`` gives ``frexp = (0.6, -1)``,
``m = round(0.6 * 2**31) = 1288490189``, ``s = 32``; ``q - zp_in = 5`` gives
``5 * 1288490189 / 2**32 = 1.50000000...`` which ``half_even`` rounds to 2.

``rescale`` uses only operators, so the same source runs on NumPy or CuPy
arrays and, compiled by Numba, inside the CPU kernels; ``cuda/common.cuh``
ports it line for line. One definition of the arithmetic for every backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ._dtypes import QDType
from ._params import by_identity, kept

HALF_EVEN, HALF_AWAY, HALF_UP, TFLITE = 0, 1, 2, 3
FLOAT = -1  # mode="float": rint(float64(d) * f + zp_out)
IDENTITY = -2  # no scaling: d + zp_out (an operand that is only centred)
ROUNDINGS = {"half_even": HALF_EVEN, "half_away": HALF_AWAY, "half_up": HALF_UP, "tflite": TFLITE}

# The shift range. Beyond SHIFT_MAX every |d * m| < 2**94 rounds to 0, so
# m = 0 is exact there; below SHIFT_MIN (M >= 2**34) every d != 0 lands beyond
# 2**33, outside any output after its zero point is added, so capping the
# shift keeps every saturated result.
SHIFT_MIN, SHIFT_MAX = -3, 94

_ONE = np.int64(1)
_M31 = np.int64(2**31 - 1)
_M32 = np.int64(2**32 - 1)
_I32_MIN = np.int64(-(2**31))
_I32_MAX = np.int64(2**31 - 1)


def quantize_multiplier(multiplier, tflite=False):
    """Split positive float64 multipliers into ``(m, s)``, both int64 arrays.

    ``m`` is in ``[2**30, 2**31)`` and ``s`` in ``[SHIFT_MIN, SHIFT_MAX]``; every
    multiplier of two float32 scales is represented (``m = 0`` only where all
    products round to 0). ``tflite=True`` applies TFLite's QuantizeMultiplier
    caps instead: below 2**-32 the multiplier is 0, from 2**30 on it is
    ``(2**31 - 1) / 2**1``.

    >>> quantize_multiplier(0.3)
    (array(1288490189), array(32))
    """
    M = np.asarray(multiplier, dtype=np.float64)
    if not np.all(np.isfinite(M) & (M > 0)):
        raise ValueError(f"the requantize multiplier scale_in / scale_out must be finite and > 0, got {M}")
    f, e = np.frexp(M)
    m = np.floor(f * 2.0**31 + 0.5).astype(np.int64)  # round half away, as std::round
    carry = m == 2**31
    m = np.where(carry, np.int64(2**30), m)
    s = 31 - (e.astype(np.int64) + carry)
    if tflite:
        m = np.where(s > 62, np.int64(0), np.where(s < 1, np.int64(2**31 - 1), m))
        return m, np.asarray(np.clip(s, 1, 62))
    m = np.where(s > SHIFT_MAX, np.int64(0), m)
    return m, np.asarray(np.clip(s, SHIFT_MIN, SHIFT_MAX))


def float_multiplier(scale_in, scale_out):
    """``float32(scale_in) / float32(scale_out)`` for ``mode="float"`` (ONNX order);
    ValueError when it leaves float32's range."""
    with np.errstate(over="ignore", under="ignore"):
        M = np.asarray(scale_in, np.float32) / np.asarray(scale_out, np.float32)
    if not np.all(np.isfinite(M) & (M > 0)):
        raise ValueError(
            "the requantize multiplier scale_in / scale_out leaves float32's range; "
            "choose an output scale closer to the input's or mode='fixed'"
        )
    return M


def wide(d, m, s):
    """``(h, l, t)`` with ``d * m / 2**s == (h * 2**32 + l) / 2**(t + 32)``, ``0 <= l <
    2**32`` and ``t >= 0``, exactly (:func:`rescale`'s arguments; ``|d|``
    saturated at ``2**(s + 30)`` where ``s < 32``, beyond every output)."""
    # A multiplier >= 1/2 (s < 32): saturate |d| at 2**(s + 30) (the result
    # passes 2**60 there), then shift d left so that the shift is 32 + t.
    lt = s < 32
    u = (32 - s) * lt
    t = s + u - 32
    # x * m = h * 2**32 + l with 0 <= l < 2**32; m & _M31 (== m) tells the
    # compiler that both products below are 32 x 32 bits
    m = m & _M31
    b = _ONE << ((s + 30) * lt)
    x = (d - (d - b) * ((d > b) & lt) - (d + b) * ((d < -b) & lt)) << u
    lo = (x & _M32) * m
    h, l = (x >> 32) * m + (lo >> 32), lo & _M32
    return h, l, t


def rescale_stochastic(d, m, s, r):
    """``d * m / 2**s`` rounded down or up, up when the random 32-bit word ``r``
    (int64) is below its fraction times ``2**32``: ``floor + (r * 2**(t + 32) <
    rem * 2**32)`` for the remainder ``rem`` below ``2**(t + 32)``, compared
    exactly as ``r < ceil(rem / 2**t)`` (``qarray._philox.round_stochastic``'s
    rule, on the exact quotient). Arguments as :func:`rescale`'s but for
    ``TFLITE``; the top of ``rem`` is ``y >> b`` with ``a = min(t, 32)``, ``b = t -
    a``, and what lies below it makes the ceiling."""
    h, l, t = wide(d, m, s)
    a = t - (t - 32) * (t > 32)
    b = t - a
    y = ((h & ((_ONE << t) - 1)) << (32 - a)) + (l >> a)
    below = ((l & ((_ONE << a) - 1)) | (y & ((_ONE << b) - 1))) != 0
    return (h >> t) + (r < (y >> b) + below)


def rescale(d, m, s, rounding, narrow=False):
    """``d * m / 2**s`` rounded to an integer, exactly (int64 in, int64 out).

    ``d`` is any int64, ``m`` in ``[0, 2**31)``, ``s`` in ``[SHIFT_MIN,
    SHIFT_MAX]`` (``quantize_multiplier``). ``rounding`` is ``HALF_EVEN``,
    ``HALF_AWAY`` or ``HALF_UP`` (ties of the exact quotient) or ``TFLITE``:
    gemmlowp's SaturatingRoundingDoublingHighMul then RoundingDivideByPOT, with
    ``d`` saturated to int32 after TFLite's left shift (``s`` in ``[1, 62]``).
    Results beyond ``2**60`` in magnitude are saturated there (they are outside
    every output range). ``narrow=True`` promises that ``d`` fits in int32 and
    ``s >= 32`` (``Requant.narrow``): then ``d * m`` fits in int64 and is
    rounded at once (a CPU fast path, ~25% faster in the GEMM epilogue; the
    result is the same). Numba compiles it as it stands (``wide`` registered
    with it); ``(bool * int)`` stands in for ``where``: it
    works on arrays and scalars and lets Numba hoist and vectorize.
    """
    if narrow and rounding != TFLITE:
        # |d * m| < 2**62 fits in int64: round it at once (a shift past 63
        # leaves 0 as 63 does, where every |v| < 2**62 rounds to 0)
        v = d * (m & _M31)
        s = s - (s - 63) * (s > 63)
        if rounding == HALF_UP:
            delta = 0
        elif rounding == HALF_AWAY:  # ties down below 0
            delta = (v < 0) * -1
        else:  # ties down when the floor is even
            delta = ((v >> s) & _ONE) - 1
        return (v + (_ONE << (s - 1)) + delta) >> s
    if rounding == TFLITE:
        e = 31 - s
        a = d + (_I32_MIN - d) * (d < _I32_MIN) - (d - _I32_MAX) * (d > _I32_MAX)
        a = a << (e * (e > 0))
        a = a + (_I32_MIN - a) * (a < _I32_MIN) - (a - _I32_MAX) * (a > _I32_MAX)
        ab = a * m
        y = ab + (_ONE << 30) - (ab < 0) * ((_ONE << 31) - 1)
        x = (y + (y < 0) * ((_ONE << 31) - 1)) >> 31  # C division, toward zero
        rs = -e * (e < 0)
        mask = (_ONE << rs) - 1
        return (x >> rs) + ((x & mask) > ((mask >> 1) + (x < 0)))
    h, l, t = wide(d, m, s)
    # floor((h * 2**32 + l + 2**(t + 31) + delta) / 2**(t + 32)), delta in
    # {-1, 0} the tie rule's: the half and delta go into the high word, the
    # low word gives only its borrow or carry
    # (compares and masks rather than shifts of negative values: cheaper in SIMD)
    p = _ONE << t
    if rounding == HALF_UP:
        delta = 0
    elif rounding == HALF_AWAY:  # ties down below 0
        delta = (h < 0) * -1
    else:  # ties down when the floor (bit t of h) is even
        delta = ((h & p) >> t) - 1
    half_hi, half_lo = p >> 1, (t == 0) * (_ONE << 31)
    return (h + half_hi + ((l + half_lo + delta) >> 32)) >> t


_CAP62 = (_ONE << 62) - 1


def rescale_mean(acc, count, m, s, rounding):
    """``R(acc / count * m / 2**s)`` exactly, by :func:`rescale`'s tie rules
    (``HALF_EVEN``, ``HALF_AWAY``, ``HALF_UP``): the rounding of a mean.
    ``acc`` int64, ``count`` a positive integer (scalar or array),
    ``|acc / count| < 2**32`` (any mean of 32-bit values), ``m`` and ``s``
    Python ints from ``quantize_multiplier`` with ``s >= 1``.

    With ``acc = count * Q + R`` and ``R * m = count * Q2 + F``, the value is
    ``X / 2**s`` with ``X = I + F / count``, ``I = Q * m + Q2`` (nothing
    overflows). Rounding ``X / 2**s`` needs only ``floor(X / 2**(s - 1))``
    (``I >> (s - 1)``, as ``F / count < 1``) and whether anything is left below
    it (a sticky bit): ``rescale`` of ``J = 2 * (I >> (s - 1)) + sticky`` by
    ``2**30 / 2**32`` rounds ``J / 4`` the same way, ties only where nothing is
    left. For ``s == 1``, ``|I|`` is capped below ``2**62`` (the result is
    beyond ``2**60`` there, outside every output).
    """
    if s > 63:  # |I| < 2**63: every value rounds to 0
        m, s = 0, 63
    q = acc // count
    t = (acc - q * count) * m
    q2 = t // count
    i = q * m + q2
    if s == 1:  # 2 * I must fit in int64
        i = i - (i - _CAP62) * (i > _CAP62) - (i + _CAP62) * (i < -_CAP62)
    sticky = ((i & ((_ONE << (s - 1)) - 1)) != 0) | (t - q2 * count > 0)
    return rescale(2 * (i >> (s - 1)) + sticky, _ONE << 30, 32, rounding)


@by_identity
@dataclass(frozen=True, eq=False)
class Requant:
    """One requantize, resolved once by an op and taken whole by a backend:

        out = clamp(R((q - zp_in) * M) + zp_out, lo, hi)   in qd's storage

    ``zp_in``, ``zp_out``, ``m``, ``shift`` (int64) and ``f`` (float64) are host
    arrays of one parameter shape: ``()`` per tensor, else the parameter shape
    of ``axis`` / ``block_size`` (``qarray._params.param_shape``). ``rounding``
    is a code: ``HALF_EVEN``/``HALF_AWAY``/``HALF_UP``/``TFLITE`` use
    ``(m, shift)``; ``FLOAT`` computes ``rint(float64(d) * f + zp_out)``;
    ``IDENTITY`` scales nothing. ``lo > qd.qmin`` is a fused ReLU. ``qd`` None
    means an int64 intermediate (the operands of add), never clamped.
    """

    zp_in: np.ndarray
    zp_out: np.ndarray
    m: np.ndarray
    shift: np.ndarray
    f: np.ndarray
    rounding: int
    qd: QDType | None
    lo: int
    hi: int
    axis: int | None = None
    block_size: int | None = None

    @property
    def params(self) -> tuple:
        """The per-slot parameters, in the order every kernel takes them."""
        return self.zp_in, self.zp_out, self.m, self.shift, self.f

    def narrow(self, dtype) -> bool:
        """Whether ``rescale(..., narrow=True)`` holds for inputs of ``dtype``:
        ``q - zp_in`` fits in int32 (inputs of 16 bits or less, or 32 bits with
        zero points 0, as accumulators) and every shift is >= 32."""
        size = np.dtype(dtype).itemsize
        return (size <= 2 or (size == 4 and self._zp_in_zero)) and self._shifts_32

    @functools.cached_property
    def _zp_in_zero(self) -> bool:
        return not self.zp_in.any()

    @functools.cached_property
    def _shifts_32(self) -> bool:
        return bool((self.shift >= 32).all())

    @functools.cached_property
    def out_dtype(self) -> np.dtype:
        return np.dtype(np.int64) if self.qd is None else np.dtype(self.qd.storage)


@by_identity
@dataclass(frozen=True, eq=False)
class Binary:
    """One add, sub or mul (``op``) of two quantized operands, resolved once by
    ``qarray.ops.elementwise`` and taken whole by a backend: each operand taken
    to int64 by its per-tensor ``Requant`` (``ra``, ``rb``: centred, for add and
    sub rescaled onto a common scale), the op, exact in int64, then ``rq``
    applied, or (None) the int64 result."""

    op: str
    ra: Requant
    rb: Requant
    rq: Requant | None = None

    @property
    def out_dtype(self) -> np.dtype:
        return np.dtype(np.int64) if self.rq is None else self.rq.out_dtype


@by_identity
@dataclass(frozen=True, eq=False)
class Softmax:
    """One softmax or log_softmax of rows, resolved once by ``qarray.ops.softmax``
    (its docstring has the arithmetic) and taken whole by a backend: ``table``
    the int64 host table ``T[j] = round(2**30 * exp(-s_in * j))`` over every
    distance ``j`` from a row's maximum, ``s_in`` and ``s_out`` the scales (float32
    values, taken as float64), ``z_out`` the output zero point, ``qd`` the output
    dtype (its range the clamp), ``log`` for log_softmax."""

    table: np.ndarray
    s_in: float
    s_out: float
    z_out: int
    qd: QDType
    log: bool

    @property
    def out_dtype(self) -> np.dtype:
        return np.dtype(self.qd.storage)


_I64 = np.iinfo(np.int64)


def product(factors, dtype):
    """``factors[0] * factors[1] * ...``, each step in ``dtype`` (float32 for the
    scale of a product, as ONNX computes ``a_scale * b_scale``)."""
    p = dtype(1)
    for f in factors:
        p = p * np.asarray(f, dtype)
    return p


@kept
def plan(factors, scale_out, zp_in, zp_out, qd, mode, rounding, *, axis=None, block_size=None, relu=False):
    """The ``Requant`` taking integers whose real value is ``q * prod(factors)``
    (``zp_in`` subtracted first) to ``(scale_out, zp_out, qd)``; the same
    (read-only) record for the same parameters, kept from an earlier call
    (``qarray._params.kept``: working out the multipliers took most of a small
    call's host time).

    ``factors`` are host arrays (float32 scales, or float64 where a power of 2
    scales one) broadcastable to one parameter shape (``a.scale * b.scale``
    for matmul); ``mode`` and ``rounding`` are the
    resolved names. In fixed mode the multiplier is their float64 product over
    ``scale_out``; in float mode it is computed in float32, as ONNX's
    ``a_scale * b_scale / y_scale``. ``qd`` None gives an unclamped int64 result.
    """
    rq = _plan(factors, scale_out, zp_in, zp_out, qd, mode, rounding, axis, block_size, relu)
    for a in rq.params:
        a.setflags(write=False)
    return rq


def _plan(factors, scale_out, zp_in, zp_out, qd, mode, rounding, axis, block_size, relu):
    shape = np.broadcast_shapes(*(np.shape(v) for v in (*factors, scale_out, zp_in, zp_out)))
    zeros = np.zeros(shape, np.int64)
    if mode == "fixed":  # float32 scales convert to float64 exactly
        code = ROUNDINGS[rounding]
        M = product(factors, np.float64) / np.asarray(scale_out, np.float64)
        m, s = quantize_multiplier(M, tflite=code == TFLITE)
        fm = np.zeros(shape)
    else:
        m, s, code = zeros, zeros, FLOAT
        fm = float_multiplier(product(factors, np.float32), scale_out).astype(np.float64)
    lo, hi = (_I64.min, _I64.max) if qd is None else (qd.qmin, qd.qmax)
    if relu:  # ReLU clamps at real 0, the output zero point: one per op
        z = np.unique(np.asarray(zp_out))
        if z.size != 1:
            raise ValueError("a fused ReLU needs one output zero point")
        lo = max(lo, int(z[0]))
    return Requant(*(np.broadcast_to(np.asarray(v, dt), shape).copy()
                     for v, dt in ((zp_in, np.int64), (zp_out, np.int64), (m, np.int64), (s, np.int64), (fm, np.float64))),
                   code, qd, int(lo), int(hi), axis, block_size)


def identity(zp_in) -> Requant:
    """The operand ``q - zp_in`` as it is (int64, nothing scaled or clamped)."""
    z = np.asarray(zp_in, np.int64)
    zero = np.zeros(z.shape, np.int64)
    return Requant(z, zero, zero, zero, np.zeros(z.shape), IDENTITY, None, int(_I64.min), int(_I64.max))


NO_REQUANT = identity(0)  # the accumulator as it is: one record, so what backends keep per plan is kept once
