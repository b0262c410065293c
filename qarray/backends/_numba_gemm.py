"""Numba CPU kernels for int8 inference: small-M GEMM on packed 4-bit weights,
direct grouped / depthwise conv2d, and im2col for 8-bit codes.

Every kernel computes exact integers and writes into an ``out`` array the
caller allocates; none applies zero points of the weights, scales or
requantization (the caller does, on the int32 result). Accumulation is in
int32 with wrap-around (two's complement) arithmetic, so each result is exact
whenever the true sum fits in int32; each docstring gives the bound the caller
must guarantee.

Compilation follows ``_numba.py``: ``@njit(parallel=True, cache=True)``, helpers
``@njit(inline="always")``, closures over plain values only (see DEVELOPERS.md),
no fastmath (integer code). Inner loops run over contiguous memory with only
arithmetic in them so that LLVM vectorizes them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# Rows of packed weights one parallel task handles in ``gemm_packed4``.
_GEMM_ROWS = 8


def pack4(w):
    """Pack 4-bit weight codes two to a byte.

    ``w``: (N, K) integer array (int8, uint8 or wider) with codes in -8..7
    (signed nibbles) or 0..15 (unsigned nibbles); values outside -8..15 raise
    ValueError. Returns the (N, (K + 1) // 2) C-contiguous uint8 array whose
    byte ``j`` of row ``n`` holds ``w[n, 2j]`` in its low nibble and
    ``w[n, 2j + 1]`` in its high nibble (two's complement for negative codes);
    for odd K the last high nibble is 0. This is the layout of ``gemm_packed4``.
    """
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype.kind not in "iu":
        raise ValueError("pack4 takes a 2-D integer array")
    if w.size and (w.min() < -8 or w.max() > 15):
        raise ValueError("pack4: codes must lie in -8..15")
    n, k = w.shape
    u = (w.astype(np.int16) & 15).astype(np.uint8)
    if k % 2:
        u = np.concatenate([u, np.zeros((n, 1), np.uint8)], axis=1)
    return np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4))


@njit(inline="always")
def _nibble(x, signed):
    """A nibble (0..15, any integer type) as int16: -8..7 if ``signed``."""
    x = np.int16(x)
    if signed:
        x = np.int16((x ^ 8) - 8)
    return x


@njit(parallel=True, cache=True)
def gemm_packed4(a, wp, signed, out):
    """``out[m, n] = sum_k a[m, k] * w[n, k]`` with 4-bit weights packed two to a byte.

    - ``a``: (M, K) uint8, C-contiguous: activation codes (already unsigned).
      Any M works; the kernel is built for decoder shapes, M <= 16.
    - ``wp``: (N, (K + 1) // 2) uint8, C-contiguous, the layout of ``pack4``:
      ``w[n, 2j]`` in the low nibble of ``wp[n, j]``, ``w[n, 2j + 1]`` in its
      high nibble. For odd K the last high nibble is ignored (whatever it holds).
    - ``signed``: nibbles are two's complement (-8..7) if True, else 0..15.
    - ``out``: (M, N) int32, written whole: raw code products, no zero points.

    Exactness: each product is at most 255 * 15 = 3825 in magnitude, so int32
    is exact for K <= (2**31 - 1) // 3825 = 561_432 (the caller guarantees it;
    in fact the result is exact whenever the true sum fits in int32, since the
    accumulation wraps).

    Scheme: ``a`` is first split once into int16 rows of its even and odd
    columns (``ae``, ``ao``), so that byte ``j`` of a weight row meets
    ``ae[m, j]`` (low nibble) and ``ao[m, j]`` (high nibble) without any
    shuffle. Parallel tasks take blocks of ``_GEMM_ROWS`` weight rows; every
    packed byte is read once. For M <= 2 the nibbles are unpacked inside the
    dot product; for larger M each row is unpacked once into two thread-local
    int16 buffers (2 * K bytes, L1-resident) that the M dot products reuse.
    The dot products are int16 x int16 -> int32 sums of pairs, which LLVM
    compiles to ``vpmaddwd``.
    """
    M, K = a.shape
    N, Kh = wp.shape
    if Kh != (K + 1) // 2:
        raise ValueError("gemm_packed4: wp must have (K + 1) // 2 columns")
    if out.shape[0] != M or out.shape[1] != N:
        raise ValueError("gemm_packed4: out must be (M, N)")
    ae = np.zeros((M, Kh), np.int16)
    ao = np.zeros((M, Kh), np.int16)  # column Kh - 1 stays 0 for odd K
    for m in range(M):
        for j in range(K // 2):
            ae[m, j] = a[m, 2 * j]
            ao[m, j] = a[m, 2 * j + 1]
        if K % 2:
            ae[m, Kh - 1] = a[m, K - 1]
    nblk = (N + _GEMM_ROWS - 1) // _GEMM_ROWS
    for b in prange(nblk):
        lo = np.empty(Kh, np.int16)
        hi = np.empty(Kh, np.int16)
        for n in range(b * _GEMM_ROWS, min(N, (b + 1) * _GEMM_ROWS)):
            row = wp[n]
            if M <= 2:
                for m in range(M):
                    x = ae[m]
                    y = ao[m]
                    acc = np.int32(0)
                    for j in range(Kh):
                        v = row[j]
                        acc += np.int32(x[j]) * np.int32(_nibble(v & 15, signed)) + np.int32(
                            y[j]
                        ) * np.int32(_nibble(v >> 4, signed))
                    out[m, n] = acc
            else:
                for j in range(Kh):
                    v = row[j]
                    lo[j] = _nibble(v & 15, signed)
                    hi[j] = _nibble(v >> 4, signed)
                for m in range(M):
                    x = ae[m]
                    y = ao[m]
                    acc = np.int32(0)
                    for j in range(Kh):
                        acc += np.int32(x[j]) * np.int32(lo[j]) + np.int32(y[j]) * np.int32(hi[j])
                    out[m, n] = acc


@njit(parallel=True, cache=True)
def conv_grouped(xpad, za, wc, groups, sh, sw, dh, dw, out):
    """Direct grouped conv2d (depthwise included) on padded 8-bit codes.

    - ``xpad``: (N, C, Hp, Wp) uint8 or int8, the input already padded with
      its zero point ``za`` (so padding contributes exactly 0). Rows (last
      axis) must be contiguous for speed; any strides work.
    - ``za``: int, the input zero point.
    - ``wc``: (O, C // groups, kh, kw) int16 or int32: centred weights
      ``w - zw[o]``.
    - ``groups``: C and O are multiples of it; output channel ``o`` reads input
      channels ``g * cg .. g * cg + cg - 1``, ``cg = C // groups``,
      ``g = o // (O // groups)`` (depthwise: groups == C, O a multiple of C).
    - ``sh, sw, dh, dw``: strides and dilations, >= 1.
    - ``out``: (N, O, OH, OW) int32 with ``OH = (Hp - dh*(kh-1) - 1)//sh + 1``
      (same for W), written whole::

          out[n, o, i, j] = sum_{c', p, q} (xpad[n, g*cg + c', i*sh + p*dh, j*sw + q*dw] - za)
                                           * wc[o, c', p, q]

    Exactness: the accumulation wraps in int32, so the result is exact when
    the true sum fits in int32; e.g. with |x - za| <= 255 and |wc| <= 255
    (centred 8-bit weights) that holds for cg * kh * kw <= 33_025 taps.

    Scheme: one parallel task per (n, o); for each output row, each tap adds
    ``wc * x`` along the input row (contiguous for sw == 1, stride 2 as a
    compile-time constant for sw == 2) into a thread-local int32 row that
    starts at ``-za * sum(wc[o])`` and is then copied to ``out``.
    """
    N, C, Hp, Wp = xpad.shape
    O, cg, kh, kw = wc.shape
    OH = out.shape[2]
    OW = out.shape[3]
    if groups < 1 or C % groups or O % groups or cg * groups != C:
        raise ValueError("conv_grouped: C and O must be multiples of groups, wc.shape[1] == C // groups")
    if out.shape[0] != N or out.shape[1] != O:
        raise ValueError("conv_grouped: out must be (N, O, OH, OW)")
    if OH != (Hp - dh * (kh - 1) - 1) // sh + 1 or OW != (Wp - dw * (kw - 1) - 1) // sw + 1:
        raise ValueError("conv_grouped: out's OH, OW do not match the input, kernel, stride and dilation")
    og = O // groups
    for t in prange(N * O):
        n = t // O
        o = t % O
        c0 = (o // og) * cg
        acc = np.empty(OW, np.int32)
        wsum = np.int64(0)
        for c in range(cg):
            for p in range(kh):
                for q in range(kw):
                    wsum += np.int64(wc[o, c, p, q])
        base = np.int32(-np.int64(za) * wsum)  # wraps like the sum does
        for i in range(OH):
            for j in range(OW):
                acc[j] = base
            for c in range(cg):
                for p in range(kh):
                    r = i * sh + p * dh
                    for q in range(kw):
                        wv = np.int32(wc[o, c, p, q])
                        # Sliced rows indexed from 0 by the loop counter: with
                        # xpad[..., off + j] Numba's negative-index wraparound
                        # turns every load into a scalar gather.
                        if sw == 1:
                            xr = xpad[n, c0 + c, r, q * dw:]
                            for j in range(OW):
                                acc[j] += np.int32(xr[j]) * wv
                        elif sw == 2:  # a constant stride: vectorized as interleaved loads
                            xr = xpad[n, c0 + c, r, q * dw:]
                            for j in range(OW):
                                acc[j] += np.int32(xr[2 * j]) * wv
                        else:
                            xr = xpad[n, c0 + c, r, q * dw :: sw]
                            for j in range(OW):
                                acc[j] += np.int32(xr[j]) * wv
            orow = out[n, o, i]
            for j in range(OW):
                orow[j] = acc[j]


@njit(parallel=True, cache=True)
def im2col(xpad, kh, kw, sh, sw, dh, dw, out):
    """Patches of a padded 8-bit image as GEMM rows.

    - ``xpad``: (N, C, Hp, Wp) uint8 or int8 (padded by the caller).
    - ``kh, kw, sh, sw, dh, dw``: kernel size, strides, dilations (>= 1).
    - ``out``: (N*OH*OW, C*kh*kw), same dtype, C-contiguous, written whole,
      with ``OH = (Hp - dh*(kh-1) - 1)//sh + 1`` (same for W):
      ``out[(n*OH + i)*OW + j, (c*kh + p)*kw + q] = xpad[n, c, i*sh + p*dh, j*sw + q*dw]``,
      i.e. ``sliding_window_view(xpad, (eh, ew), axis=(2, 3))[:, :, ::sh, ::sw,
      ::dh, ::dw].transpose(0, 2, 3, 1, 4, 5).reshape(N*OH*OW, C*kh*kw)`` with
      ``eh = dh*(kh-1) + 1``, ``ew = dw*(kw-1) + 1``.

    A copy: no arithmetic, no overflow. One parallel task per (n, i).
    """
    N, C, Hp, Wp = xpad.shape
    OH = (Hp - dh * (kh - 1) - 1) // sh + 1
    OW = (Wp - dw * (kw - 1) - 1) // sw + 1
    if OH < 0 or OW < 0:
        raise ValueError("im2col: kernel larger than the padded input")
    if out.shape[0] != N * OH * OW or out.shape[1] != C * kh * kw:
        raise ValueError("im2col: out must be (N*OH*OW, C*kh*kw)")
    for t in prange(N * OH):
        n = t // OH
        i = t % OH
        r0 = t * OW
        for c in range(C):
            for p in range(kh):
                r = i * sh + p * dh
                for q in range(kw):
                    # Sliced views indexed from 0 (see conv_grouped): output
                    # column (c, p, q) of rows r0 .. r0 + OW - 1.
                    src = xpad[n, c, r, q * dw :: sw]
                    dst = out[r0 : r0 + OW, (c * kh + p) * kw + q]
                    for j in range(OW):
                        dst[j] = src[j]
