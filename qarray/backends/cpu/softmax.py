"""softmax's and log_softmax's kernels: rows of ``(rows, n)`` 8- or 16-bit
codes, the axis last (``Backend.softmax``), by a table of ``exp`` over the
distances from each row's maximum."""

from __future__ import annotations

import numpy as np
from numba import njit

from .llvm import _SOURCE, _lookup_store, _lookup_sum
from .pool import kernel

# The calls of NumpyBackend's softmax these kernels take (``numpy._fast_path``): all but no rows
ACCEPTS = {"softmax": lambda x, sm, out=None: x.size > 0}


# -- softmax: rows of (rows, n), the axis last (Backend.softmax) -------------------
@njit(inline="always")
def _row_range(x, r):
    m = x[r, 0]
    mn = x[r, 0]
    for i in range(x.shape[1]):
        m = max(m, x[r, i])
        mn = min(mn, x[r, i])
    return np.int64(m), np.int64(mn)


@njit(inline="always")
def _dist(m, v):
    """``m - v`` (``m`` the row's maximum) as an unsigned index: Numba then leaves
    out its wraparound of negative indices, which kept the gathers slow
    (softmax 1048x1000 int8, one thread: 0.83 -> 0.60 ms)."""
    return np.uint64(m - np.int64(v))


@njit(inline="always")
def _row_sum(x, r, m, table, planes):
    acc = np.int64(0)
    i0 = 0
    if planes is not None:  # pruned as Numba compiles for None: no VBMI code
        i0 = x.shape[1] // 64 * 64
        acc = _lookup_sum(x, np.int64(r), m, planes, np.int64(i0 // 64))
    for i in range(i0, x.shape[1]):
        acc += table[_dist(m, x[r, i])]
    return acc


@njit(inline="always")
def _lookup_row(x, r, m, otab, out, planes):
    """``out[r, i] = otab[m - x[r, i]]`` for the whole row."""
    i0 = 0
    if planes is not None:
        i0 = x.shape[1] // 64 * 64
        _lookup_store(x, np.int64(r), m, otab, out, np.int64(i0 // 64))
    for i in range(i0, x.shape[1]):
        out[r, i] = otab[_dist(m, x[r, i])]


@njit(inline="always")
def _scratch(table, planes, dtype):
    """``softmax``'s table of output codes: 256 entries for the VBMI loads."""
    if planes is None:
        return np.empty(table.size, dtype)
    return np.empty(256, dtype)


@njit(inline="always")
def _sm_value(j, table, rv, s_in, s_out, z_out, lo, hi, log):
    """One output code for distance ``j``: ``rv`` is ``float64(S) * s_out``
    (softmax) or ``log(S / 2**30)`` (log_softmax); the generic formulas."""
    if log:
        v = np.rint((np.float64(j) * -s_in - rv) / s_out)
    else:
        v = np.rint(np.float64(table[j]) / rv)
    return np.int64(min(max(v + z_out, lo), hi))


@njit(inline="always")
def _softmax_row(x, r, n, table, planes, logs, s_in, s_out, z_out, lo, hi, log, otab, out):
    """Row ``r`` of ``softmax``; ``otab`` is scratch (``_scratch``)."""
    m, mn = _row_range(x, r)
    if log:
        rv = logs[r]
    else:
        rv = np.float64(_row_sum(x, r, m, table, planes)) * s_out
    width = m - mn + 1
    if width <= n:
        for j in range(width):  # no branch: LLVM vectorizes the divisions
            otab[j] = _sm_value(j, table, rv, s_in, s_out, z_out, lo, hi, log)
        _lookup_row(x, r, m, otab, out, planes)
    else:
        for i in range(n):
            out[r, i] = _sm_value(_dist(m, x[r, i]), table, rv, s_in, s_out, z_out, lo, hi, log)


def _make(source):
    """softmax's kernels, ``source`` (``llvm._SOURCE``: the lookups they inline) in their closures."""

    @kernel
    def softmax_sums(x, table, planes, sums, start, stop):
        """``sums[r] = sum_i table[max(x[r]) - x[r, i]]`` (exact int64), rows ``start..stop``."""
        _ = source
        for r in range(start, stop):
            m, _ = _row_range(x, r)
            sums[r] = _row_sum(x, r, m, table, planes)

    @kernel
    def softmax(x, table, planes, logs, s_in, s_out, z_out, lo, hi, log, out, start, stop):
        """Softmax (``log`` False; ``logs`` unused) or log_softmax (``logs[r] =
        log(S_r / 2**30)``, from ``softmax_sums`` and NumPy) of rows
        ``start..stop`` of ``x``. A row longer than its range of distances fills a
        table of its outputs first: the same formula per distance, fewer divisions.
        ``planes``: None, or (8-bit codes in and out, a CPU with AVX-512 VBMI)
        the table's byte planes, and the lookups run 64 at a time."""
        _ = source
        otab = _scratch(table, planes, out.dtype)  # scratch, one per call
        for r in range(start, stop):
            _softmax_row(x, r, x.shape[1], table, planes, logs, s_in, s_out, z_out, lo, hi, log, otab, out)

    return softmax_sums, softmax


softmax_sums, softmax = _make(_SOURCE)
