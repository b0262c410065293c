"""Elementwise kernels on integer codes: ``lut`` (a table lookup) and ``binary``
(add, sub, mul of two quantized operands, requantized in the same pass)."""

from __future__ import annotations

import functools

import numpy as np

from .pool import kernel
from .requantize import _SOURCE, _rq_inlined

# The calls of NumpyBackend's primitives these kernels take (``numpy._fast_path``): ``lut`` on a
# whole table (not per-axis tables); ``binary`` of integer operands of one shape into a per-tensor
# requantized result (the others: Backend's requantizes, with broadcasting)
ACCEPTS = {
    "lut": lambda q, table, axis=None: axis is None,
    "binary": lambda a, b, bp, out=None: bp.rq is not None and a.shape == b.shape and bp.rq.axis is None
    and a.dtype.kind in "iu" and b.dtype.kind in "iu",
}


@kernel
def lut(u, table, out, start, stop):
    """``out[i] = table[u[i]]`` (flat, ``u`` unsigned so every index is in range)."""
    ur, orow = u[start:stop], out[start:stop]  # indexed from 0 (see _span)
    for i in range(stop - start):
        orow[i] = table[ur[i]]


BINARY_RUN = 4096  # elements a task of binary
_I64_MIN, _I64_MAX = np.int64(np.iinfo(np.int64).min), np.int64(np.iinfo(np.int64).max)


def _make_binary(op, ca, cb, code):
    """``Backend.binary`` in one pass for op code ``op`` (0 add, 1 sub, 2 mul)
    and the rounding codes of the operands' and the result's ``Requant``
    (closure constants, as in ``_make_requantize``: the branches on them fold
    away and the loop vectorizes, 4-8x faster than with the codes as
    arguments), for operands of one shape (flat) and per-tensor Requants: each
    operand taken to int64 by its Requant (``na``/``nb`` their ``narrow``), the
    op, and the result requantized; what the generic code does in three
    requantizes and two int64 temporaries. Tasks are runs of ``BINARY_RUN``
    elements."""
    source = _SOURCE

    @kernel
    def binary(a, b, p, fp, out, start, stop):
        """``p``: int64 ``za, ma, sa, na, zb, mb, sb, nb, zo, m, sh, lo, hi``;
        ``fp``: float64 ``fa, fb, f`` (two arrays: one Numba dispatch of 16
        scalars cost ~1 us, a fifth of a small add)."""
        _ = source
        za, ma, sa, na, zb, mb, sb, nb, zo, m, sh, lo, hi = (p[0], p[1], p[2], p[3] != 0, p[4], p[5], p[6],
                                                             p[7] != 0, p[8], p[9], p[10], p[11], p[12])
        fa, fb, f = fp[0], fp[1], fp[2]
        e0, e1 = start * BINARY_RUN, min(stop * BINARY_RUN, a.shape[0])
        ar, br, orow = a[e0:e1], b[e0:e1], out[e0:e1]  # indexed from 0 (see _span)
        for i in range(e1 - e0):
            x = _rq_inlined(np.int64(ar[i]) - za, 0, ma, sa, fa, _I64_MIN, _I64_MAX, ca, na)
            y = _rq_inlined(np.int64(br[i]) - zb, 0, mb, sb, fb, _I64_MIN, _I64_MAX, cb, nb)
            v = x + y if op == 0 else (x - y if op == 1 else x * y)
            orow[i] = _rq_inlined(v, zo, m, sh, f, lo, hi, code, False)

    return binary


@functools.cache
def binary(op, ca, cb, code):
    """The kernel of :func:`_make_binary` for these (int) codes, made once each."""
    return _make_binary(op, ca, cb, code)
