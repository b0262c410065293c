"""``linear`` on block-format weights (GGUF's Q4_0 ... Q6_K, the grouped formats): the two
contracts of :mod:`qarray.ops.block_linear`, compiled.

A task is a group of ``LANES`` weight rows ``n``. Its rows are decoded once, block by block
(``_numba.block_values`` / ``block_codes``, the decoder of ``dequantize``), into rows ``(LANES,
K)`` in the columns' logical order (act-order's ``columns`` put back); then, ``KC`` k at a time,
the chunk is laid side by side (``(KC, LANES)``) and each output row ``m`` sums over ``k`` in
increasing order, the ``LANES`` outputs side by side: ``acc[0:LANES] += x[m, k] * w[k,
0:LANES]`` is one vector operation that adds, in each lane, that output's next term, so LLVM
vectorizes it without changing any output's order of summation. No output is split between
tasks, so the result depends neither on the thread count nor on the instruction set: each
float64 product of two float32 values is exact, so a fused multiply-add rounds exactly as the
add alone would.

- :func:`linear_float`: float activations (float64 ``x``) against ``w.dequantize()`` decoded in
  the kernel: ``scale * (value - zero)`` rounded to the format's precision, times its factor,
  plus its offset, as ``BlockFormat.decode`` rounds them;
- :func:`linear_dense`: the same sums against weights already decoded (the IQ lattices, whose
  decoders are NumPy's);
- :func:`linear_q8`: ``Q8_0`` activations against integer weight values: exact integer sums per
  piece (an activation block met by a weight sub-block), each scaled in float64.
"""

from __future__ import annotations

import hashlib
import inspect
import math

import numpy as np
from numba import njit

from .._numba import block_codes, block_values, kernel

LANES = 64  # weight rows a task: the sums of 8 512-bit vectors (16 256-bit ones), enough independent
# chains of adds to hide their latency (8 lanes ran 3.5x slower: each lane one add a k, in order)
KC = 128  # k a pass over the rows of x: the rows' chunk, side by side (KC, LANES), 32 KB, stays in L1
PRECISION = {"float32": 0, "float16": 1, "bfloat16": 2}


@njit(inline="always")
def rounded(y, precision):
    """float32 ``y`` rounded to float16 (``precision`` 1) or bfloat16 (2), to nearest even, as
    float32 (``qarray._blocks.rounded``); 0: ``y``. NaN stays as it is: float16 -> float32 would clear
    its payload's low 13 bits, which are already 0 in every NaN a decoder meets (a float16 scale's, or
    IEEE's default NaN). Computed in float64 by the exponent: the quantum is ``2^(e - p)`` for ``y``
    in ``[2^(e-1), 2^e)``, no smaller than the subnormals'."""
    if precision == 0 or y != y or y == 0 or abs(y) == np.inf:
        return y
    a = abs(np.float64(y))
    e = math.frexp(a)[1]
    q = max(e - 11, -24) if precision == 1 else max(e - 8, -133)
    r = math.ldexp(np.rint(math.ldexp(a, -q)), q)
    if r > (65504.0 if precision == 1 else 3.3895313892515355e38):
        r = np.inf
    return np.float32(-r if y < 0 else r)


def _rounding_decoder(source):
    """:func:`_decode_rounded`, ``source`` (``_HELPERS``) in its closure, as the kernels have it (``_make``)."""

    @kernel
    def _decode_rounded(raw, b, segments, values, scale, offset, zero, has_offset, has_zero, precision, factor,
                        has_factor, code, out):
        """Block ``b``'s values into ``out`` as ``BlockFormat.decode`` rounds them: each operation to the
        format's precision (a call of its own, which keeps ``block_values``' loops small)."""
        _ = source  # in the cache key, as the kernels' (_make)
        block_codes(raw, b, segments, code)
        sub = code.shape[0] // scale.shape[1]
        for e in range(code.shape[0]):
            j = e // sub
            v = values[code[e]] - zero[b, j] if has_zero else values[code[e]]
            t = rounded(scale[b, j] * v, precision)
            if has_factor:
                t = rounded(t * factor, precision)
            if has_offset:
                t = rounded(t + offset[b, j], precision)
            out[e] = t

    return _decode_rounded


_HELPERS = hashlib.sha256("".join(inspect.getsource(f.py_func) for f in (block_codes, block_values)).encode()
                          ).hexdigest()
_decode_rounded = _rounding_decoder(_HELPERS)


@njit(inline="always")
def _decode_rows(raw, n0, rows, nb, segments, values, scale, offset, zero, has_offset, has_zero, precision,
                 factor, has_factor, dest, w, code, tmp):
    """Weight rows ``n0 .. n0 + rows`` (blocks ``n * nb ..``) as ``w.dequantize()`` gives them, into
    ``w[l]`` (``dest``: each stored column's logical one, or empty where they are in order; ``tmp``
    a row). Formats computed in float32 take ``block_decode``'s loops (``_numba.block_values``);
    the others :func:`_decode_rounded`."""
    block = code.shape[0]
    plain = precision == 0 and not has_factor
    for l in range(rows):
        row = w[l] if dest.shape[0] == 0 else tmp
        for bk in range(nb):
            b = (n0 + l) * nb + bk
            out = row[bk * block:bk * block + block]
            if plain:
                block_values(raw, b, segments, values, scale, offset, zero, has_offset, has_zero, code, out)
            else:
                _decode_rounded(raw, b, segments, values, scale, offset, zero, has_offset, has_zero, precision,
                                factor, has_factor, code, out)
        if dest.shape[0]:
            for c in range(tmp.shape[0]):
                w[l, dest[c]] = tmp[c]
    w[rows:] = 0


@njit(inline="always")
def _chunk(w, k0, buf):
    """``buf[k - k0, l] = w[l, k]`` for ``k`` from ``k0`` to the chunk's end, ``k1``: ``KC`` k of the
    rows side by side. Returns ``k1``."""
    k1 = min(w.shape[1], k0 + KC)
    for k in range(k0, k1):
        b = buf[k - k0]
        for l in range(LANES):
            b[l] = w[l, k]
    return k1


@njit(inline="always")
def _store(acc, bias, has_bias, out, n0, rows):
    """``out[m, n0 + l] = float32(acc[m, l] + bias[n0 + l])``: the bias added last, in float64."""
    for m in range(acc.shape[0]):
        for l in range(rows):
            s = acc[m, l]
            if has_bias:
                s += bias[n0 + l]
            out[m, n0 + l] = np.float32(s)


@njit(inline="always")
def _sums(x, w, buf, acc, bias, has_bias, out, n0, rows):
    """``out[m, n0 + l] = float32(sum_k x[m, k] * w[l, k] (+ bias))``, summed in increasing ``k``,
    a chunk of ``KC`` k at a time."""
    m_len, k_len = x.shape
    acc[:] = 0
    for k0 in range(0, k_len, KC):
        k1 = _chunk(w, k0, buf)
        for m in range(m_len):
            a = acc[m]
            for k in range(k0, k1):
                xv = x[m, k]
                wk = buf[k - k0]
                for l in range(LANES):
                    a[l] += xv * np.float64(wk[l])
    _store(acc, bias, has_bias, out, n0, rows)


def _make(source):
    """The kernels, ``source`` (``_HELPERS``) in their closures: Numba's cache key (it sees this file's
    timestamp, not ``_numba.py``'s, whose decoders they inline)."""

    @kernel
    def linear_float(x, raw, segments, values, scale, offset, zero, has_offset, has_zero, precision, factor,
                     has_factor, dest, bias, has_bias, out, start, stop):
        """Mode 1 on tasks ``start .. stop``: ``x`` float64 ``(M, K)``; ``raw`` uint8 ``(N * nb, nbytes)``;
        ``scale``, ``offset``, ``zero`` float32 ``(N * nb, nsub)`` (``BlockFormat.parameters``); ``dest``
        int64 ``(K,)`` or ``(0,)``; ``bias`` float64 ``(N,)``; ``out`` float32 ``(M, N)``."""
        _ = source  # in the cache key: a changed _numba.block_codes / block_values recompiles
        m_len, k_len = x.shape
        n_len = out.shape[1]
        block = k_len // (raw.shape[0] // n_len)
        w = np.zeros((LANES, k_len), np.float32)
        buf = np.zeros((KC, LANES), np.float32)
        acc = np.zeros((m_len, LANES), np.float64)
        code = np.empty(block, np.int32)
        tmp = np.empty(k_len, np.float32)
        for t in range(start, stop):
            n0 = t * LANES
            rows = min(LANES, n_len - n0)
            _decode_rows(raw, n0, rows, k_len // block, segments, values, scale, offset, zero, has_offset, has_zero,
                         precision, factor, has_factor, dest, w, code, tmp)
            _sums(x, w, buf, acc, bias, has_bias, out, n0, rows)

    @kernel
    def linear_dense(x, wf, bias, has_bias, out, start, stop):
        """Mode 1 on decoded float32 weights ``wf`` ``(N, K)`` (logical order)."""
        _ = source  # in the cache key: a changed _numba.block_codes / block_values recompiles
        m_len, k_len = x.shape
        n_len = out.shape[1]
        w = np.zeros((LANES, k_len), np.float32)
        buf = np.zeros((KC, LANES), np.float32)
        acc = np.zeros((m_len, LANES), np.float64)
        for t in range(start, stop):
            n0 = t * LANES
            rows = min(LANES, n_len - n0)
            w[:rows] = wf[n0:n0 + rows]
            w[rows:] = 0
            _sums(x, w, buf, acc, bias, has_bias, out, n0, rows)

    @kernel
    def linear_q8(dx, qx, raw, segments, ivalues, scale, offset, zero, has_offset, has_zero, piece, bias, has_bias,
                  out, start, stop):
        """Mode 2 on tasks ``start .. stop``: ``dx`` float64 ``(M, K // 32)`` and ``qx`` int8 ``(M, K)``
        (Q8_0's scales and codes); ``ivalues`` int32 (the format's integer values); ``scale``, ``offset``
        float32, ``zero`` int32, ``(N * nb, nsub)``; ``piece``: the elements of a term (the smaller of
        32 and the weights' sub-block). ``term = dx * s * isum + dx * o * xsum`` in float64, summed over
        the pieces in order; ``isum`` and ``xsum`` in int32 (``32 * 128 * 2^15`` at most: exact)."""
        _ = source  # in the cache key: a changed _numba.block_codes / block_values recompiles
        m_len, k_len = qx.shape
        n_len = out.shape[1]
        nb = raw.shape[0] // n_len
        block = k_len // nb
        nsub = scale.shape[1]
        sub = block // nsub
        w = np.zeros((LANES, k_len), np.int32)
        buf = np.zeros((KC, LANES), np.int32)
        sbuf = np.zeros((nb * nsub, LANES), np.float64)
        obuf = np.zeros((nb * nsub, LANES), np.float64)
        code = np.empty(block, np.int32)
        isum = np.zeros(LANES, np.int32)
        acc = np.zeros((m_len, LANES), np.float64)
        for t in range(start, stop):
            n0 = t * LANES
            rows = min(LANES, n_len - n0)
            w[rows:] = 0
            sbuf[:] = 0
            obuf[:] = 0
            for l in range(rows):
                for bk in range(nb):
                    b = (n0 + l) * nb + bk
                    block_codes(raw, b, segments, code)
                    for j in range(nsub):
                        z = zero[b, j] if has_zero else np.int32(0)
                        sbuf[bk * nsub + j, l] = scale[b, j]
                        if has_offset:
                            obuf[bk * nsub + j, l] = offset[b, j]
                        for e in range(j * sub, j * sub + sub):
                            w[l, bk * block + e] = ivalues[code[e]] - z
            acc[:] = 0
            for c0 in range(0, k_len, KC):
                c1 = _chunk(w, c0, buf)
                for m in range(m_len):
                    a = acc[m]
                    for k0 in range(c0, c1, piece):
                        isum[:] = 0
                        xs = np.int32(0)
                        for k in range(k0, k0 + piece):
                            q = np.int32(qx[m, k])
                            xs += q
                            wk = buf[k - c0]
                            for l in range(LANES):
                                isum[l] += q * wk[l]
                        d = dx[m, k0 // 32]
                        j = k0 // sub
                        for l in range(LANES):
                            term = d * sbuf[j, l] * np.float64(isum[l])
                            if has_offset:
                                term += d * obuf[j, l] * np.float64(xs)
                            a[l] += term
            _store(acc, bias, has_bias, out, n0, rows)

    return linear_float, linear_dense, linear_q8


linear_float, linear_dense, linear_q8 = _make(_HELPERS)
