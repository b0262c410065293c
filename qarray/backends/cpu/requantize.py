"""requantize's kernels, and the integer arithmetic every kernel with a
requantize in it inlines (``_rq``: the epilogues of the GEMM and conv, binary).

The integer arithmetic is ``qarray._fixed_point.rescale`` compiled as it
stands: the same source as the generic NumPy and CuPy code. One requantize
kernel is compiled per rounding code (a closure constant, so its branches fold
away; Numba's cache key includes it).

Each kernel sees its input as ``(outer, n, inner)`` and its parameters as
``(outer or 1, blocks, inner or 1)``, with ``bidx[l]`` the block of position
``l`` along the axis (``qarray._params.Layout``, one of its ``pieces``:
per-tensor data is viewed as ``(1, rows, cols)`` with one parameter slot).
That one layout covers per-tensor, per-axis and blocked parameters; its helpers
(``_span``, ``_outer``, ``_first``) serve quantize's kernels too. Inner loops
run over contiguous memory with only arithmetic in them, so LLVM vectorizes
them.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ... import _fixed_point, _philox
from ..._fixed_point import FLOAT, IDENTITY, ROUNDINGS
from .llvm import _SOURCE as _LLVM
from .llvm import _fence, _store_line
from .pool import always, kernel, source

# The calls of NumpyBackend's primitives these kernels take (``numpy._fast_path``): all but a Dask
# chunk's stochastic rounding (``index``: its elements numbered in the whole array)
ACCEPTS = {"requantize": always, "requantize_stochastic": lambda q, rq, key, index=None: index is None}


register_jitable(inline="always")(_fixed_point.wide)  # what rescale calls, compiled where a kernel calls it
# rescale is called, not inlined into Numba's IR: the rounding code and narrow
# reach it as literals (closure constants), so each (code, narrow) compiles
# without the other branches, once a process, and LLVM inlines it into the
# kernel's loops (the same instructions). Inlined at the IR level, Numba copied
# its branches' IR into every call site of every specialization: half of each
# requantize, conv or epilogue compile (requantize int32 -> int8: 12 s -> 5 s).
_rescale = njit(_fixed_point.rescale)
_rescale_stochastic = njit(inline="always")(_fixed_point.rescale_stochastic)
for _f in (_philox._round, _philox.philox4x32):  # what _philox.bits calls, compiled where a kernel calls it
    register_jitable(inline="always")(_f)
_bits = njit(inline="always")(_philox.bits)
_round_stochastic = njit(inline="always")(_philox.round_stochastic)
# in the closure of every kernel that inlines these helpers, here and in the other
# kernel modules (``pool.source``): _fixed_point.py, _philox.py, this file and llvm.py
_SOURCE = source(_fixed_point, _philox, sys.modules[__name__]) + _LLVM


@njit(inline="always")
def _first(key):
    """The flat index of a kernel's first element: ``key[2]`` of a stochastic
    rounding's ``(k0, k1, first)`` (unused without one)."""
    if key is None:
        return np.uint64(0)
    return key[2]


@njit(inline="always")
def _span(a, o, l0, l1):
    """``a[o, l0:l1, 0]`` of ``(outer, n, 1)`` data as a C-contiguous 1-D view,
    indexed from 0: an index that starts at ``l0``, or a 2-D view, leaves Numba
    checking every index for wraparound, and the loop no longer vectorizes."""
    return a.reshape(a.shape[0], a.shape[1])[o, l0:l1]


@njit(inline="always")
def _outer(n, start, stop):
    """The outer indices ``o`` whose rows ``o * n + l`` meet ``start..stop``."""
    if n == 0:
        return 0, 0
    return start // n, (stop + n - 1) // n


def _make_requantize_stream(code, narrow):
    """requantize's kernel for flat integer ``q`` and 8-bit ``out`` (at a 64-byte
    boundary) with one ``Requant`` (its int64 and float64 scalars), blocks as
    ``quantize_lines``'; one per rounding code and width, as ``_make_requantize``."""
    source = _SOURCE

    @kernel
    def requantize_stream(q, zi, zo, m, sh, f, lo, hi, out, start, stop):
        _ = source
        line = np.empty(64, out.dtype)
        full = min(stop, q.size // 64)
        for b in range(start, full):
            qs = q[b * 64:b * 64 + 64]
            for j in range(64):
                line[j] = _rq(np.int64(qs[j]) - zi, zo, m, sh, f, lo, hi, code, narrow)
            _store_line(out, np.int64(b * 64), line, np.int64(0))
        _fence()
        for i in range(max(start, full) * 64, min(stop * 64, q.size)):
            out[i] = _rq(np.int64(q[i]) - zi, zo, m, sh, f, lo, hi, code, narrow)

    return requantize_stream


def _make_rq(rescale):
    """``_rq`` with ``rescale`` (``_fixed_point.rescale`` compiled one way or the other)."""

    @njit(inline="always")
    def rq(d, zo, m, sh, f, lo, hi, code, narrow):
        """One requantized value from ``d = q - zp_in`` (``qarray._fixed_point.Requant``)."""
        if code == FLOAT:  # clamp in float64: a huge product must not overflow int64
            return np.int64(min(max(np.rint(np.float64(d) * f + zo), lo), hi))
        if code == IDENTITY:
            return min(max(d + zo, lo), hi)
        if narrow:  # d fits in int32: saying so lets LLVM use a 32 x 32 -> 64-bit multiply
            d = np.int64(np.int32(d))
        return min(max(rescale(d, m, sh, code, narrow) + zo, lo), hi)

    return rq


_rq = _make_rq(_rescale)
# binary's operands: their narrow flags are run-time values there, not literals, and
# its kernel keeps rescale inlined into Numba's IR (the machine code it had)
_rq_inlined = _make_rq(njit(inline="always")(_fixed_point.rescale))


@njit(inline="always")
def _rq_at(d, zo, m, sh, f, lo, hi, code, narrow, key, index):
    """``_rq``, or with ``key`` (Philox's ``(k0, k1, ...)``, not None) ``d * m / 2**sh``
    rounded stochastically by the random word of flat ``index``
    (``_fixed_point.rescale_stochastic``), plus ``zo``, clamped."""
    if key is None:
        return _rq(d, zo, m, sh, f, lo, hi, code, narrow)
    return min(max(_rescale_stochastic(d, m, sh, np.int64(_bits(index, key[0], key[1]))) + zo, lo), hi)


@njit(inline="always")
def _rq_row(q, p, o, l, po, b, lo, hi, code, narrow, key, base, out):
    zi, zo, m, sh, f = p
    if zi.shape[2] > 1:
        for i in range(q.shape[2]):
            out[o, l, i] = _rq_at(np.int64(q[o, l, i]) - zi[po, b, i], zo[po, b, i], m[po, b, i],
                                  sh[po, b, i], f[po, b, i], lo, hi, code, narrow, key, base + np.uint64(i))
    else:
        zir, zor, mr, shr, fr = zi[po, b, 0], zo[po, b, 0], m[po, b, 0], sh[po, b, 0], f[po, b, 0]
        for i in range(q.shape[2]):
            out[o, l, i] = _rq_at(np.int64(q[o, l, i]) - zir, zor, mr, shr, fr, lo, hi, code, narrow, key,
                                  base + np.uint64(i))


@njit(inline="always")
def _rq_col(q, p, o, po, bidx, l0, l1, lo, hi, code, narrow, key, base, out):
    zi, zo, m, sh, f = p
    qr, orow = _span(q, o, l0, l1), _span(out, o, l0, l1)
    if zi.shape[1] == q.shape[1]:  # per-axis: parameter l for element l, contiguous (vectorizes)
        zir, zor, mr, shr, fr = _span(zi, po, l0, l1), _span(zo, po, l0, l1), _span(m, po, l0, l1), \
            _span(sh, po, l0, l1), _span(f, po, l0, l1)
        for j in range(l1 - l0):
            orow[j] = _rq_at(np.int64(qr[j]) - zir[j], zor[j], mr[j], shr[j], fr[j], lo, hi, code, narrow, key,
                             base + np.uint64(j))
    else:
        br = bidx[l0:l1]
        for j in range(l1 - l0):
            b = br[j]
            orow[j] = _rq_at(np.int64(qr[j]) - zi[po, b, 0], zo[po, b, 0], m[po, b, 0],
                             sh[po, b, 0], f[po, b, 0], lo, hi, code, narrow, key, base + np.uint64(j))


def _make_requantize(code, narrow):
    """The requantize kernel for one rounding code and operand width
    (``narrow``: ``Requant.narrow``); closure constants, so the branches on
    them fold away. The closure holds plain values only: Numba's
    cache key includes it, and a function in it would change the key in every
    process (a cache that never hits)."""
    source = _SOURCE

    @kernel
    def requantize(q, zi, zo, m, sh, f, bidx, lo, hi, key, out, start, stop):
        """``out = clamp(R((q - zi) * m / 2**sh) + zo, lo, hi)`` (``Requant``);
        with ``key`` (as quantize's) rounding stochastically."""
        _ = source  # in the cache key: a changed _fixed_point.py or _philox.py recompiles
        first = _first(key)
        o_n, n, i_n = q.shape
        pos = np.int64(zi.shape[0] > 1)
        p = (zi, zo, m, sh, f)
        if i_n == 1:
            o0, o1 = _outer(n, start, stop)
            for o in range(o0, o1):
                l0, l1 = max(start - o * n, 0), min(stop - o * n, n)
                _rq_col(q, p, o, np.int64(o) * pos, bidx, l0, l1, lo, hi, code, narrow, key,
                        first + np.uint64(o * n + l0), out)
        else:
            for t in range(start, stop):
                o = t // n
                _rq_row(q, p, o, t - o * n, np.int64(o) * pos, bidx[t - o * n], lo, hi, code, narrow, key,
                        first + np.uint64(t) * np.uint64(i_n), out)

    return requantize


requantize = {(code, narrow): _make_requantize(code, narrow)
              for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}
requantize_stream = {(code, narrow): _make_requantize_stream(code, narrow)
                     for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}
