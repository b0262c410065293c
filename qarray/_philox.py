"""Philox4x32-10, the counter-based generator of stochastic rounding.

Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3"
(SC'11), as Random123, cuRAND and TensorFlow compute it: a 128-bit counter and
a 64-bit key, ten rounds of two 32 x 32 -> 64-bit products. qarray keys it by
the seed and counts by the element's flat C-order index in the whole array,
so an element's random bits depend on (seed, index) alone: the same on NumPy,
Numba, CUDA and every Dask chunking.

Only operators on unsigned 64-bit values holding 32-bit words, so the same
source runs on NumPy or CuPy arrays and, compiled by Numba, inside the CPU
kernels (as ``_fixed_point.rescale`` does).
"""

from __future__ import annotations

import numpy as np

from ._params import int_in

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)
_TWO32 = 4294967296.0


def _round(c, k0, k1, r):
    """Round ``r`` (0..9): two products, their halves crossed and keyed by the
    key bumped ``r`` times."""
    p0, p1 = _M0 * c[0], _M1 * c[2]
    k0, k1 = (k0 + np.uint64(r) * _W0) & _MASK, (k1 + np.uint64(r) * _W1) & _MASK
    return (p1 >> _32) ^ c[1] ^ k0, p1 & _MASK, (p0 >> _32) ^ c[3] ^ k1, p0 & _MASK


def philox4x32(c0, c1, c2, c3, k0, k1):
    """The four 32-bit words of Philox4x32-10 of counter ``(c0, c1, c2, c3)``
    under key ``(k0, k1)``, each a uint64 below 2**32. The ten rounds are
    written out: a loop kept Numba's kernels from vectorizing over elements."""
    c = (c0, c1, c2, c3)
    c = _round(_round(_round(_round(_round(c, k0, k1, 0), k0, k1, 1), k0, k1, 2), k0, k1, 3), k0, k1, 4)
    return _round(_round(_round(_round(_round(c, k0, k1, 5), k0, k1, 6), k0, k1, 7), k0, k1, 8), k0, k1, 9)


def bits(index, k0, k1):
    """The random word of the element at flat ``index`` (uint64): Philox word 0
    of counter ``(index mod 2**32, index >> 32, 0, 0)``."""
    zero = index & np.uint64(0)
    return philox4x32(index & _MASK, index >> _32, zero, zero, k0, k1)[0]


def round_stochastic(t, f, r):
    """``t`` rounded down or up, up with probability ``frac(t)`` given the random
    32-bit word ``r`` and ``f = floor(t)`` (the caller's floor: ``xp.floor``,
    Numba's ``np.floor``): ``f + (r < (t - f) * 2**32)``. ``t - f`` is exact in
    ``t``'s float type, its scaling by 2**32 too, and ``r * 1.0`` (below 2**32)
    in float64, so the comparison is exact and the probability is ``frac(t)``
    to the 2**-32 (exactly, where ``frac(t)`` is a multiple of 2**-32: every
    float32 ``t`` of magnitude 2**-8 or more). Infinities stay as they are."""
    return f + (r * 1.0 < (t - f) * _TWO32)


def key(seed):
    """``(k0, k1)``, the Philox key of ``seed`` (an int in ``[0, 2**64)``); TypeError
    or ValueError naming what to pass otherwise."""
    if seed is None:
        raise TypeError("rounding='stochastic' needs a seed: pass seed=<int> (the same seed gives the same codes)")
    seed = int_in(seed, "seed", 0, 2**64)
    return np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
