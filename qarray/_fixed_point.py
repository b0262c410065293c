"""Integer-only requantization: multiplier decomposition and rounding shifts.

A real multiplier ``M = scale_in / scale_out`` becomes an integer ``m`` in
``[2**30, 2**31)`` and a right shift ``s`` so that ``M ~= m / 2**s`` (TFLite's
QuantizeMultiplier, TVM's GetFixedPointMultiplierShift). Then

    q_out = clamp(R((q - zp_in) * m, s) + zp_out, qmin, qmax)

computed exactly in int64, where ``R(v, s)`` divides by ``2**s`` and breaks ties
by the chosen rounding. Worked example: ``M = 0.3`` gives ``frexp = (0.6, -1)``,
``m = round(0.6 * 2**31) = 1288490189``, ``s = 32``; ``q - zp_in = 5`` gives
``5 * 1288490189 / 2**32 = 1.50000000...`` which ``half_even`` rounds to 2.

The element functions below use only operators and NumPy ufuncs, so the same
source runs on NumPy or CuPy arrays and, compiled by Numba, inside the CPU
kernels: one definition of the arithmetic for every backend.
"""

from __future__ import annotations

import numpy as np

HALF_EVEN, HALF_AWAY, HALF_UP, TFLITE = 0, 1, 2, 3
ROUNDINGS = {"half_even": HALF_EVEN, "half_away": HALF_AWAY, "half_up": HALF_UP, "tflite": TFLITE}

_ONE = np.int64(1)
_I32_MIN = np.int64(-(2**31))
_I32_MAX = np.int64(2**31 - 1)
_MAX_MULTIPLIER = 2.0**30


def quantize_multiplier(multiplier):
    """Split positive float64 multipliers into ``(m, s)``, both int64 arrays.

    ``m`` is in ``[2**30, 2**31)`` and ``s`` in ``[1, 62]``. A multiplier below
    2**-32 becomes ``m = 0`` (everything rounds to 0), as in TFLite's
    QuantizeMultiplier; only a qint32 input with a zero point far from its
    values could tell the difference.

    >>> quantize_multiplier(0.3)
    (array(1288490189), array(32))
    """
    M = np.asarray(multiplier, dtype=np.float64)
    if np.any(M >= _MAX_MULTIPLIER):
        raise ValueError(
            f"the requantize multiplier scale_in / scale_out = {float(np.max(M)):g} is too "
            "large for fixed-point arithmetic (it must be < 2**30); use a larger output "
            "scale or mode='float'"
        )
    f, e = np.frexp(M)
    m = np.floor(f * 2.0**31 + 0.5).astype(np.int64)  # round half away, as std::round
    carry = m == 2**31
    m = np.where(carry, np.int64(2**30), m)
    s = 31 - (e.astype(np.int64) + carry)
    m = np.where(s > 62, np.int64(0), m)
    return m, np.asarray(np.minimum(s, 62))


def float_multiplier(scale_in, scale_out):
    """``float32(scale_in) / float32(scale_out)`` for ``mode="float"`` (ONNX order);
    ValueError when it leaves float32's range."""
    with np.errstate(over="ignore", under="ignore"):
        M = np.asarray(scale_in, np.float32) / np.asarray(scale_out, np.float32)
    if not np.all(np.isfinite(M) & (M > 0)):
        raise ValueError(
            "the requantize multiplier scale_in / scale_out leaves float32's range; "
            "choose an output scale closer to the input's"
        )
    return M


def rescale(d, m, s, rounding):
    """``d * m / 2**s`` rounded to an integer (int64 in, int64 out).

    ``rounding`` is one of the codes ``HALF_EVEN``, ``HALF_AWAY``, ``HALF_UP``
    (ties of ``R(d * m, s)``) or ``TFLITE``: gemmlowp's
    SaturatingRoundingDoublingHighMul then RoundingDivideByPOT, with ``d`` taken
    to int32 after TFLite's left shift (for multipliers >= 1), saturating where
    TFLite's int32 arithmetic would overflow. One self-contained function, so
    Numba can compile it as it stands.
    """
    if rounding == TFLITE:
        # (bool * int) stands in for max/min: it works on arrays and scalars and,
        # unlike NumPy ufunc calls, lets Numba hoist and vectorize.
        e = 31 - s
        a = d << (e * (e > 0))
        a = a + (_I32_MIN - a) * (a < _I32_MIN)
        a = a - (a - _I32_MAX) * (a > _I32_MAX)
        ab = a * m
        y = ab + (_ONE << 30) - (ab < 0) * ((_ONE << 31) - 1)
        x = (y + (y < 0) * ((_ONE << 31) - 1)) >> 31  # C division, toward zero
        rs = -e * (e < 0)
        mask = (_ONE << rs) - 1
        return (x >> rs) + ((x & mask) > ((mask >> 1) + (x < 0)))
    # floor q and remainder r; the carry (0 or 1) comes from adding the tie
    # rule's threshold to r. No compares, so it vectorizes; with s <= 62 and
    # |v| < 2**63 nothing overflows.
    v = d * m
    half = _ONE << (s - 1)
    q = v >> s
    r = v & (half + (half - 1))
    if rounding == HALF_UP:
        return q + ((r + half) >> s)
    if rounding == HALF_AWAY:  # v >> 63 is -1 for negative v: ties go down there
        return q + ((r + half + (v >> 63)) >> s)
    return q + ((r + half - 1 + (q & 1)) >> s)
