"""Numba kernels behind ``NumpyBackend``'s elementwise primitives.

Imported only when a primitive first runs on a large enough array with Numba
installed. Each kernel sees its input as ``(outer, n, inner)``
(``qarray._params.view3``) and its parameters as
``(outer or 1, blocks, inner or 1)`` (``compact``), with ``bidx[l]`` the block
of position ``l`` along the axis; per-tensor data is viewed as
``(1, rows, cols)`` with one parameter slot. That one layout covers per-tensor,
per-axis and blocked parameters. Inner loops run over contiguous memory with
only arithmetic in them, so LLVM vectorizes them.

The integer arithmetic of requantize is ``qarray._fixed_point.rescale``
compiled as it stands: the same source as the generic NumPy and CuPy code.
One requantize kernel is compiled per rounding (the rounding is a closure
constant, so its branches fold away; Numba's cache keys include it).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .._fixed_point import ROUNDINGS
from .._fixed_point import rescale as _rescale_py

_rescale = njit(inline="always")(_rescale_py)


@njit(inline="always")
def _q(v, s, z, lo, hi):
    return min(max(np.rint(v / s) + z, lo), hi)


# fastmath "reassoc" only lets the sum of ``v - v`` (0, or NaN for NaN and inf
# input) vectorize; it allows no other change of the arithmetic.
@njit(parallel=True, cache=True, fastmath={"reassoc"})
def quantize(x, s, z, bidx, lo, hi, out):
    """``out = clamp(rint(x / s) + z, lo, hi)``; returns NaN if ``x`` had NaN or inf."""
    o_n, n, i_n = x.shape
    pos = np.int64(s.shape[0] > 1)
    bad = x.dtype.type(0)
    if i_n == 1:  # parameters change along the contiguous axis
        per_axis = s.shape[1] == n
        for o in prange(o_n):
            po = np.int64(o) * pos
            acc = x.dtype.type(0)
            if per_axis:
                for l in range(n):
                    v = x[o, l, 0]
                    acc += v - v
                    out[o, l, 0] = _q(v, s[po, l, 0], z[po, l, 0], lo, hi)
            else:
                for l in range(n):
                    v = x[o, l, 0]
                    acc += v - v
                    out[o, l, 0] = _q(v, s[po, bidx[l], 0], z[po, bidx[l], 0], lo, hi)
            bad += acc
    else:
        pis = s.shape[2] > 1
        for r in prange(o_n * n):
            o = np.int64(r) // n
            l = np.int64(r) - o * n
            po = o * pos
            b = bidx[l]
            acc = x.dtype.type(0)
            if pis:
                for i in range(i_n):
                    v = x[o, l, i]
                    acc += v - v
                    out[o, l, i] = _q(v, s[po, b, i], z[po, b, i], lo, hi)
            else:
                sr = s[po, b, 0]
                zr = z[po, b, 0]
                for i in range(i_n):
                    v = x[o, l, i]
                    acc += v - v
                    out[o, l, i] = _q(v, sr, zr, lo, hi)
            bad += acc
    return bad


@njit(parallel=True, cache=True)
def dequantize(q, s, z, bidx, out):
    """``out = float(q - z) * s`` in ``out``'s float type (one rounding)."""
    o_n, n, i_n = q.shape
    pos = np.int64(s.shape[0] > 1)
    if i_n == 1:
        per_axis = s.shape[1] == n
        for o in prange(o_n):
            po = np.int64(o) * pos
            if per_axis:
                for l in range(n):
                    out[o, l, 0] = q[o, l, 0] - z[po, l, 0]
                    out[o, l, 0] *= s[po, l, 0]
            else:
                for l in range(n):
                    out[o, l, 0] = q[o, l, 0] - z[po, bidx[l], 0]
                    out[o, l, 0] *= s[po, bidx[l], 0]
    else:
        pis = s.shape[2] > 1
        for r in prange(o_n * n):
            o = np.int64(r) // n
            l = np.int64(r) - o * n
            po = o * pos
            b = bidx[l]
            if pis:
                for i in range(i_n):
                    out[o, l, i] = q[o, l, i] - z[po, b, i]
                    out[o, l, i] *= s[po, b, i]
            else:
                sr = s[po, b, 0]
                zr = z[po, b, 0]
                for i in range(i_n):
                    out[o, l, i] = q[o, l, i] - zr
                    out[o, l, i] *= sr


def _make_requantize(code):
    """The requantize kernel for one rounding code (``-1``: float mode)."""

    @njit(inline="always")
    def rq(qv, zi, zo, m, sh, f, lo, hi):
        d = np.int64(qv) - zi
        if code < 0:
            v = np.int64(np.rint(np.float64(d) * f))
        else:
            v = _rescale(d, m, sh, code)
        return min(max(v + zo, lo), hi)

    @njit(parallel=True, cache=True)
    def requantize(q, zi, zo, m, sh, f, bidx, lo, hi, out):
        o_n, n, i_n = q.shape
        pos = np.int64(zi.shape[0] > 1)
        if i_n == 1:
            per_axis = zi.shape[1] == n
            for o in prange(o_n):
                po = np.int64(o) * pos
                if per_axis:
                    for l in range(n):
                        out[o, l, 0] = rq(q[o, l, 0], zi[po, l, 0], zo[po, l, 0], m[po, l, 0],
                                          sh[po, l, 0], f[po, l, 0], lo, hi)
                else:
                    for l in range(n):
                        b = bidx[l]
                        out[o, l, 0] = rq(q[o, l, 0], zi[po, b, 0], zo[po, b, 0], m[po, b, 0],
                                          sh[po, b, 0], f[po, b, 0], lo, hi)
        else:
            pis = zi.shape[2] > 1
            for r in prange(o_n * n):
                o = np.int64(r) // n
                l = np.int64(r) - o * n
                po = o * pos
                b = bidx[l]
                if pis:
                    for i in range(i_n):
                        out[o, l, i] = rq(q[o, l, i], zi[po, b, i], zo[po, b, i], m[po, b, i],
                                          sh[po, b, i], f[po, b, i], lo, hi)
                else:
                    zir, zor, mr = zi[po, b, 0], zo[po, b, 0], m[po, b, 0]
                    shr, fr = sh[po, b, 0], f[po, b, 0]
                    for i in range(i_n):
                        out[o, l, i] = rq(q[o, l, i], zir, zor, mr, shr, fr, lo, hi)

    return requantize


requantize = {code: _make_requantize(code) for code in (-1, *ROUNDINGS.values())}
