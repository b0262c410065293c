"""Numba CPU kernels for int8 inference: small-M GEMM on packed 4-bit weights,
direct grouped / depthwise conv2d, and im2col for 8-bit codes.

Every kernel computes exact integers and writes into an ``out`` array the
caller allocates; none applies zero points of the weights, scales or
requantization (the caller does, on the int32 result). Accumulation is in
int32 with wrap-around (two's complement) arithmetic, so each result is exact
whenever the true sum fits in int32; each docstring gives the bound the caller
must guarantee.

Compilation follows ``_numba.py``: serial ``nogil`` kernels (``_numba.kernel``)
over a range of tasks ``start, stop``, split among threads by
``_numba.parallel``; ``_numba``'s helpers inlined (``_rq``), closures over plain
values only (see docs/architecture.md), no fastmath (integer code). Inner loops run over contiguous memory with only
arithmetic in them so that LLVM vectorizes them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .._fixed_point import FLOAT, IDENTITY, ROUNDINGS
from ._numba import _SOURCE, _rq, kernel, parallel  # noqa: F401 (parallel: for callers)

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


# -- small-M GEMM on packed 4-bit weights: AVX-512 VNNI through an LLVM intrinsic --
# LLVM does not turn a plain int8 dot-product loop into ``vpdpbusd`` (u8 x s8,
# four products summed into int32 lanes, never saturating); Numba has no vector
# types, so the loop body is written in LLVM IR. Compiled (at first call) only
# where the CPU has AVX-512 VNNI (``qarray.backends._gemm.packed4_kernel``).
_V64 = ir.VectorType(ir.IntType(8), 64)
_V16 = ir.VectorType(ir.IntType(32), 16)


def _make_dot(rows, signed):
    """An intrinsic ``dot(ae, ao, m0, wrow, chunks, res)``: for ``r < rows``,
    ``res[r] = sum_j ae[m0 + r, j] * lo(wrow[j]) + ao[m0 + r, j] * hi(wrow[j])``
    over ``j < 64 * chunks``, ``lo``/``hi`` the byte's nibbles (two's
    complement when ``signed``): 64 bytes of weights, 128 products, per step."""

    @intrinsic
    def dot(typingctx, ae, ao, m0, wrow, chunks, res):
        def codegen(context, builder, sig, args):
            ae_, ao_, w_, res_ = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3, 5))
            m0, chunks = args[2], args[4]
            vnni = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                                  "llvm.x86.avx512.vpdpbusd.512")
            total = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_V16]),
                                                   "llvm.vector.reduce.add.v16i32")
            stride = builder.extract_value(ae_.strides, 0)
            ptrs = []
            for r in range(rows):
                off = builder.mul(builder.add(m0, ir.Constant(m0.type, r)), stride)
                ptrs.append([builder.bitcast(builder.gep(x.data, [off]), _V64.as_pointer()) for x in (ae_, ao_)])
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16, None)) for _ in range(rows)]
            wp = builder.bitcast(w_.data, _V64.as_pointer())
            low, four, eight = (ir.Constant(_V64, [v] * 64) for v in (15, 4, 8))
            with cgutils.for_range(builder, chunks) as loop:
                wv = builder.load(builder.gep(wp, [loop.index]), align=1)
                nibbles = [builder.and_(wv, low), builder.and_(builder.lshr(wv, four), low)]
                if signed:  # (x ^ 8) - 8 sign-extends a nibble
                    nibbles = [builder.sub(builder.xor(v, eight), eight) for v in nibbles]
                nibbles = [builder.bitcast(v, _V16) for v in nibbles]
                for r in range(rows):
                    acc = builder.load(accs[r])
                    for p, v in zip(ptrs[r], nibbles):
                        act = builder.bitcast(builder.load(builder.gep(p, [loop.index]), align=1), _V16)
                        acc = builder.call(vnni, [acc, act, v])
                    builder.store(acc, accs[r])
            for r in range(rows):
                builder.store(builder.call(total, [builder.load(accs[r])]),
                              builder.gep(res_.data, [ir.Constant(ir.IntType(32), r)]))
            return context.get_dummy_value()

        return types.void(ae, ao, m0, wrow, chunks, res), codegen

    return dot


_dot4_s, _dot4_u, _dot1_s, _dot1_u = (_make_dot(r, s) for r in (4, 1) for s in (True, False))


@kernel
def gemm_packed4(ae, ao, wp, signed, out, start, stop):
    """``out[m, n] = sum_k a[m, k] * w[n, k]`` for M activation rows (a
    decoder's token-by-token shape) against 4-bit weights packed two to a byte.

    - ``ae``, ``ao``: (M, Kp // 2) uint8, C-contiguous: the activation codes
      (unsigned) at even and at odd k, zero-padded to ``Kp``, a multiple of 128.
    - ``wp``: (N, Kp // 2) uint8, C-contiguous, :func:`pack4` of the weights
      zero-padded to ``Kp``; ``signed``: its nibbles are -8..7, else 0..15.
    - ``out``: (M, N) int32.

    Each weight row is read once per block of 4 activation rows, 64 bytes at a
    time, its nibbles split with two ANDs and a shift, and multiplied into
    int32 lanes by ``vpdpbusd`` (no saturation). Exact for
    ``Kp * 255 * 15 < 2**31`` (K up to 561,000). Tasks: weight rows.
    """
    m_len, kh = ae.shape
    chunks = kh // 64
    r = np.empty(4, np.int32)
    for n in range(start, stop):
        row = wp[n]
        m0 = 0
        while m0 + 4 <= m_len:
            if signed:
                _dot4_s(ae, ao, m0, row, chunks, r)
            else:
                _dot4_u(ae, ao, m0, row, chunks, r)
            for i in range(4):
                out[m0 + i, n] = r[i]
            m0 += 4
        while m0 < m_len:
            if signed:
                _dot1_s(ae, ao, m0, row, chunks, r)
            else:
                _dot1_u(ae, ao, m0, row, chunks, r)
            out[m0, n] = r[0]
            m0 += 1


def _make_conv_grouped(code, narrow):
    """``conv_grouped`` with its epilogue for one rounding code (closure
    constants, as ``_numba.requantize``; ``narrow``: ``Requant.narrow``).
    The kernel's body is written here rather than inlined from a helper:
    Numba deep-copies an ``inline="always"`` function's IR block by block for
    every specialization, which for a body this size took half of each
    compile (10.5 s -> 6.4 s a specialization)."""
    source = _SOURCE

    @kernel
    def conv_grouped(xpad, xflat, za, wc, groups, sh, sw, dh, dw, bias, zo, m, shift, f, lo, hi, out, start, stop):
        """Direct grouped conv2d (depthwise included) on padded 8-bit codes, with
        its epilogue: bias and requantize (``_numba._rq``, per output channel).

        - ``xpad``: (N, C, Hp, Wp) uint8 or int8, the input already padded with
          its zero point ``za`` (so padding contributes exactly 0). Rows (last
          axis) must be contiguous for speed; any strides work.
        - ``xflat``: the same codes as (N, C, Hp * Wp), C-contiguous (a view of a
          C-contiguous ``xpad``): strides 1 read its planes flat.
        - ``za``: int, the input zero point.
        - ``wc``: (O, C // groups, kh, kw) int16 or int32: centred weights
          ``w - zw[o]``.
        - ``groups``: C and O are multiples of it; output channel ``o`` reads input
          channels ``g * cg .. g * cg + cg - 1``, ``cg = C // groups``,
          ``g = o // (O // groups)`` (depthwise: groups == C, O a multiple of C).
        - ``sh, sw, dh, dw``: strides and dilations, >= 1.
        - ``bias``, ``zo``, ``m``, ``shift``, ``f``: per output channel (length O),
          ``lo``, ``hi``: the clamp (``Requant``; ``IDENTITY`` for the sums).
        - ``out``: (N, O, OH, OW) with ``OH = (Hp - dh*(kh-1) - 1)//sh + 1``
          (same for W), written whole with ``R(acc + bias[o])``, ``R`` the
          requantize of ``code``, where::

              acc[n, o, i, j] = sum_{c', p, q} (xpad[n, g*cg + c', i*sh + p*dh, j*sw + q*dw] - za)
                                               * wc[o, c', p, q]

        Exactness: the accumulation wraps in int32, so the result is exact when
        the true sum fits in int32; e.g. with |x - za| <= 255 and |wc| <= 255
        (centred 8-bit weights) that holds for cg * kh * kw <= 33_025 taps.

        Scheme: one task per (n, o), ``t = n * O + o`` in ``start..stop``. Strides
        1: each tap adds ``wc * x`` over the whole input plane at once, seen flat
        with its row stride ``Wp``: output ``(i, j)`` is element ``i * Wp + j`` of
        a thread-local int32 plane that starts at ``-za * sum(wc[o])``, one loop
        of ``(OH - 1) * Wp + OW`` elements a tap (the columns ``j >= OW`` in
        between are computed and dropped; every read stays inside the plane),
        2.7x faster than a loop per output row of 56 (depthwise 3x3 on 56x56).
        Other strides: for each output row, each tap adds ``wc * x`` along the
        input row (stride 2 as a compile-time constant) into an int32 row. Then the
        epilogue writes ``out``.
        """
        _ = source  # in the cache key (see _numba._make_requantize)
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
        acc = np.empty(OW, np.int32)
        flat = max((OH - 1) * Wp + OW, 0) if sh == 1 and sw == 1 else 0
        plane = np.empty(flat, np.int32)
        for t in range(start, stop):
            n = t // O
            o = t % O
            c0 = (o // og) * cg
            wsum = np.int64(0)
            for c in range(cg):
                for p in range(kh):
                    for q in range(kw):
                        wsum += np.int64(wc[o, c, p, q])
            base = np.int32(-np.int64(za) * wsum)  # wraps like the sum does
            b, z, mo, so, fo = bias[o], zo[o], m[o], shift[o], f[o]
            if sh == 1 and sw == 1:
                plane[:] = base
                for c in range(cg):
                    for p in range(kh):
                        for q in range(kw):
                            wv = np.int32(wc[o, c, p, q])
                            xr = xflat[n, c0 + c, p * dh * Wp + q * dw:]  # indexed from 0 (see _numba._span)
                            for e in range(flat):
                                plane[e] += np.int32(xr[e]) * wv
                for i in range(OH):
                    orow, prow = out[n, o, i], plane[i * Wp:]
                    for j in range(OW):
                        orow[j] = _rq(np.int64(prow[j]) + b, z, mo, so, fo, lo, hi, code, narrow)
                continue
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
                    orow[j] = _rq(np.int64(acc[j]) + b, z, mo, so, fo, lo, hi, code, narrow)

    return conv_grouped


conv_grouped = {(code, narrow): _make_conv_grouped(code, narrow)
                for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}


@kernel
def im2col(xpad, kh, kw, sh, sw, dh, dw, out, start, stop):
    """Patches of a padded channels-last image as GEMM rows.

    - ``xpad``: (N, Hp, Wp, C), C-contiguous, padded by the caller.
    - ``kh, kw, sh, sw, dh, dw``: kernel size, strides, dilations (>= 1).
    - ``out``: (N*OH*OW, kh*kw*C), same dtype, C-contiguous, written whole,
      with ``OH = (Hp - dh*(kh-1) - 1)//sh + 1`` (same for W):
      ``out[(n*OH + i)*OW + j, (p*kw + q)*C + c] = xpad[n, i*sh + p*dh, j*sw + q*dw, c]``.

    Channels last, every tap is one contiguous run of C codes, copied as a
    vector (channels-first patches are single bytes scattered over the row).
    A copy: no arithmetic, no overflow. One task per (n, i), ``t = n * OH + i``
    in ``start..stop``.
    """
    N, Hp, Wp, C = xpad.shape
    OH = (Hp - dh * (kh - 1) - 1) // sh + 1
    OW = (Wp - dw * (kw - 1) - 1) // sw + 1
    if OH < 0 or OW < 0:
        raise ValueError("im2col: kernel larger than the padded input")
    if out.shape[0] != N * OH * OW or out.shape[1] != C * kh * kw:
        raise ValueError("im2col: out must be (N*OH*OW, kh*kw*C)")
    for t in range(start, stop):
        n = t // OH
        i = t % OH
        for j in range(OW):
            row = out[t * OW + j]
            for p in range(kh):
                line = xpad[n, i * sh + p * dh]
                for q in range(kw):
                    # sliced views indexed from 0 (see conv_grouped)
                    src = line[j * sw + q * dw]
                    dst = row[(p * kw + q) * C:]
                    for c in range(C):
                        dst[c] = src[c]
