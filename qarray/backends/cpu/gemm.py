"""The int8 GEMM: ``a @ w`` for unsigned 8-bit activations and signed 8-bit
weights, with the exact epilogue fused into each block's store.

The weights are packed once (:func:`pack`) into panels of 16 columns; within
a panel, each step of 64 k holds 16 rows of 64 bytes, row ``k4`` holding, for
each of the 16 columns, its 4 weights ``k = 4 k4 .. 4 k4 + 3``. That is the
layout of an AMX B tile, and each row is one AVX-512 VNNI operand (two for
AVX-VNNI's 256 bits, four for AVX2's, widened), so every instruction set reads
the same bytes.

The activations are read in blocks of 32 rows and steps of 64 k, row ``r`` of
step ``k`` at ``offs[k] + r * stride`` from its block: where they are, when
their rows allow it (:func:`_in_place`), else copied by :func:`pack_rows` into
a scratch of that layout; conv2d's patches from the padded images themselves
(:func:`conv`, an implicit GEMM: ``offs`` the taps').

The result is computed in blocks of 32 rows by 32 columns, one task each
(column blocks outer, so consecutive tasks share their weights). A block's
products are summed in int32 over at most ``KMAX`` k (``255 * 128 * KMAX <
2**31``: exact, as every instruction here adds without saturating), then in
int64 over longer K, and the epilogue (``requantize._rq``: zero-point terms, bias,
requantize by any rounding, clamp to the output dtype) writes the block from
that scratch, 4 KB the thread keeps in its cache: an int8-out layer writes
its int32 products nowhere.
The epilogue's rounding to nearest of 8-bit outputs is made in float32, 16
lanes a vector, and checked: a lane too near a tie for float32's error makes
its row again in exact int64 (``_store_near``).

A block's products, by instruction set (``isa.best``; each gives the same
integers, which the tests check with each turned off in turn):

- ``amx``: four 16 x 16 int32 tiles, each step two A tiles (16 rows x 64 k)
  and two B tiles, four ``tdpbusd``;
- ``avx512vnni`` / ``avxvnni``: rows of ``vpdpbusd`` on 512 / 256 bits, each
  row's 4 bytes of ``a`` broadcast against a row of the panel;
- ``avx2`` (no VNNI): the same rows, both operands widened to int16 and
  multiplied by ``vpmaddwd`` (exact; ``vpmaddubsw`` saturates u8 x s8 pairs);
- ``portable``: the same sums in plain Numba loops.

The other integer kernels of matmul and conv2d follow it:

- :func:`gemm_epilogue`: the same epilogue over another engine's int32
  products (MLAS, float32 BLAS);
- :func:`gemm_packed4`: small M against 4-bit weights packed two to a byte
  (:func:`pack4`), by ``llvm._make_dot``'s ``vpdpbusd``;
- :func:`conv_grouped` (direct grouped and depthwise conv2d, its epilogue
  fused) and :func:`im2col` (patches as GEMM rows) for 8-bit codes.

Each computes exact integers: accumulation is in int32 with wrap-around (two's
complement) arithmetic, so each result is exact whenever the true sum fits in
int32; each docstring gives the bound the caller must guarantee.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..._fixed_point import FLOAT, HALF_EVEN, HALF_UP, IDENTITY, ROUNDINGS, SHIFT_MAX, SHIFT_MIN

from .._gemm import SMALL_WORK, Packed  # SMALL_WORK: products from which a call wakes the pool
from .isa import best, usable
from .llvm import (_add32, _aligned, _dot1_s, _dot1_u, _dot4_s, _dot4_u, _fn, _mul32, _splat, _sub32, _tiles_begin,
                   _tiles_end, _wide, aligned_zeros)
from .pool import kernel, parallel
from .requantize import _SOURCE, _rq


def _conv_sums_fit(x, wc, gp, out=None):
    """Whether :func:`conv_grouped` takes the call: 8-bit codes whose int32 sums cannot wrap."""
    if x.dtype.itemsize != 1:
        return False
    za, wmax = gp.za, int(np.abs(wc).max(initial=0))
    xmax = max(abs(255 - za), abs(za)) if x.dtype == np.uint8 else max(abs(127 - za), abs(-128 - za))
    return math.prod(wc.shape[1:]) * wmax * xmax < 2**31


def _implicit(x, kh, kw, pw, gp, out=None):
    """Whether :func:`conv` takes the call: 8-bit codes, qarray's own kernels
    (2-D panels), stride 1, channels a multiple of 64 (the tiles' rows C
    bytes apart, spread over L1's sets as :func:`_in_place` asks), and padded
    pixels few enough: the product's rows at most ``WASTE`` times the outputs."""
    if x.dtype.itemsize != 1 or not isinstance(pw, Packed) or pw.panels is None or len(pw.panels) != 1:
        return False
    n, h, w, c = x.shape
    (ph, pw_), (dh, dw) = gp.padding, gp.dilation
    oh, ow = h + 2 * ph - dh * (kh - 1), w + 2 * pw_ - dw * (kw - 1)
    return (tuple(gp.stride) == (1, 1) and c % BK == 0 and 0 < c and math.gcd(c // BK, 64) <= 4 and n > 0
            and oh > 0 and ow > 0
            and n * (h + 2 * ph) * (w + 2 * pw_) <= WASTE * n * oh * ow)


# the calls the NumPy backend's GEMM primitives pass to these kernels (qarray.backends.numpy._fast_path)
ACCEPTS = {
    "int_matmul": lambda a, pw, gp, out=None: isinstance(pw, Packed) and (a.size > 0 and pw.fused(a) or pw.by_rows(a)),
    "gemm_epilogue": lambda raw, rowsum, c, zw, gp, out=None: raw.ndim == 2,
    "im2col": lambda x, kh, kw, stride, padding, dilation, za: x.dtype.itemsize == 1,
    "conv_gemm": _implicit,
    "conv_grouped": _conv_sums_fit,
}

BM = BN = 32  # a block's rows and columns
BK = 64  # k a step
KMAX = (2**31 - 1) // (255 * 128) // BK * BK  # k summed in int32: 65,792
WASTE = 1.35  # conv's implicit GEMM: its product's rows (padded pixels) per output kept, at most
# accumulators a vector of a row alone sums into, k4 by k4 in turn (``rows_from``): 1 x 4096 x 256
# from L2 (one thread, the kernel alone) took 13 us on 4, 17.5 on 1 (``vpdpbusd``'s latency a k4)
CHAINS = 4

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_P8 = _I8.as_pointer()


def pack(w, sums=None):
    """Signed 8-bit weights ``(K, N)`` as panels of 16 columns, ``(ceil(N / 32) * 2,
    ceil(K / 64) * 1024)`` int8, zero-padded (the module's docstring), by
    :func:`pack_panels` on the pool's threads; with ``sums`` (int64 ``(N,)``),
    the weights' column sums there too (``Packed.colsum``: NumPy's ``sum(axis=0,
    dtype=int64)`` of a layer's transposed weights took 5 ms at 4096 x 4096)."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.int8:
        raise TypeError(f"pack takes (K, N) int8 weights, got {w.dtype} {w.shape}")
    k, n = w.shape
    kp, n_p = -(-k // BK) * BK, -(-n // BN) * BN
    out = aligned_zeros((n_p // 16, kp // 4 * 16), np.uint32)  # (a tile's rows, each in one cache line)
    sums = np.empty(n, np.int64) if sums is None else sums
    parallel(pack_panels, n_p // 16, w, out, sums, grain=-(-PACK_GRAIN // max(16 * kp, 1)))
    return out.view(np.int8).reshape(n_p // 16, kp * 16)


@kernel
def pack_panels(w, out, sums, start, stop):
    """Panels ``start .. stop`` of :func:`pack` into ``out`` (uint32, zeroed): its
    word ``16 * k4 + c`` of panel ``p`` holds ``w[4 * k4 + b, 16 * p + c]`` in
    byte ``b`` (from the lowest), for ``w`` (K, N) int8 as it lies; each
    column's sum into ``sums``. Where its rows are contiguous, 16 columns of 4
    rows are read at a time (vectors); else (a layer's (N, K) weights,
    transposed) each column's 4 bytes at once. 4096 x 4096 weights, one
    thread: 109 ms -> 8.8 (5.7 transposed) (NumPy's transposes, a byte at a
    time and then by int32)."""
    k_len, n_len = w.shape
    k4s = k_len // 4
    for p in range(start, stop):
        j0 = 16 * p
        cols = max(min(16, n_len - j0), 0)
        row = out[p]
        acc = np.zeros(16, np.int64)
        if w.strides[1] == 1 and cols == 16:
            for k4 in range(k4s):
                r0, r1, r2, r3 = w[4 * k4, j0:j0 + 16], w[4 * k4 + 1, j0:j0 + 16], w[4 * k4 + 2, j0:j0 + 16], \
                    w[4 * k4 + 3, j0:j0 + 16]
                for c in range(16):
                    row[16 * k4 + c] = _word(r0[c], r1[c], r2[c], r3[c])
                    acc[c] += np.int64(r0[c]) + np.int64(r1[c]) + np.int64(r2[c]) + np.int64(r3[c])
        else:
            for c in range(cols):
                j, total = j0 + c, 0
                for k4 in range(k4s):
                    b0, b1, b2, b3 = w[4 * k4, j], w[4 * k4 + 1, j], w[4 * k4 + 2, j], w[4 * k4 + 3, j]
                    row[16 * k4 + c] = _word(b0, b1, b2, b3)
                    total += np.int64(b0) + np.int64(b1) + np.int64(b2) + np.int64(b3)
                acc[c] = total
        for c in range(cols):  # the last k4, short (K % 4 rows)
            v = np.uint32(0)
            for b in range(k_len - 4 * k4s):
                v |= np.uint32(np.uint8(w[4 * k4s + b, j0 + c])) << np.uint32(8 * b)
                acc[c] += w[4 * k4s + b, j0 + c]
            if k_len > 4 * k4s:
                row[16 * k4s + c] = v
            sums[j0 + c] = acc[c]


@njit(inline="always")
def _word(b0, b1, b2, b3):
    """Four int8 as the bytes of a uint32, ``b0`` lowest."""
    return (np.uint32(np.uint8(b0)) | np.uint32(np.uint8(b1)) << np.uint32(8) | np.uint32(np.uint8(b2)) << np.uint32(16)
            | np.uint32(np.uint8(b3)) << np.uint32(24))


def _at(builder, base, offset):
    return builder.gep(base, [offset])


def _operands(context, builder, sig, args):
    """The block intrinsics' arguments as ``(a, offs, rs, rows, the first
    panel, the panel stride, k0, k1, c, keep)``: ``a``, the panel and ``c``
    pointers to bytes, ``offs`` to int64, ``keep`` an i1."""
    a, offs, rs, rows, b, p0, k0, k1, c, keep = args
    a_, o_, b_, c_ = (context.make_array(sig.args[i])(context, builder, x) for i, x in ((0, a), (1, offs), (4, b),
                                                                                         (8, c)))
    bstride = builder.extract_value(b_.strides, 0)
    panel = _at(builder, builder.bitcast(b_.data, _P8), builder.mul(p0, bstride))
    keep = builder.icmp_signed("!=", keep, ir.Constant(keep.type, 0))
    return (builder.bitcast(a_.data, _P8), builder.bitcast(o_.data, _I64.as_pointer()), rs, rows, panel, bstride,
            k0, k1, builder.bitcast(c_.data, _P8), keep)


def _signature(a, offs, rs, rows, b, p0, k0, k1, c, keep):
    return types.void(a, offs, rs, rows, b, p0, k0, k1, c, keep)


def _step(builder, a, offs, k):
    """Where step ``k`` of a block's rows begins: ``a + offs[k]``."""
    return _at(builder, a, builder.load(_at(builder, offs, k)))


def _const(v):
    return ir.Constant(_I64, v)



def _config():
    cfg = np.zeros(64, np.uint8)  # palette 1; bytes per row of tiles 0..7 (u16), then their rows (u8)
    cfg[0] = 1
    cfg[16:32].view(np.uint16)[:] = 64
    cfg[48:56] = 16
    return cfg


_CONFIG = _config()


def _amx_steps(builder, a, offs, rs, panel, bstride, k0, k1, c, keep, halves):
    """The tiles of :func:`_block_amx` for ``halves`` (1 or 2) A tiles of 16 rows."""
    load = _fn(builder, "llvm.x86.tileloadd64", ir.VoidType(), [_I8, _P8, _I64])
    dot = _fn(builder, "llvm.x86.tdpbusd", ir.VoidType(), [_I8, _I8, _I8])
    tile = functools.partial(ir.Constant, _I8)
    pairs = [(ta, tb) for ta in range(4, 4 + halves) for tb in (6, 7)]  # C tile 2 * (ta - 4) + (tb - 6)
    offsets = (0, 64, 16 * 128, 16 * 128 + 64)[:len(pairs)]  # bytes of C tile t's (row, column): (0|16, 0|16)
    with builder.if_else(keep) as (then, otherwise):
        with then:
            for t, offset in enumerate(offsets):
                builder.call(load, [tile(t), _at(builder, c, _const(offset)), _const(BN * 4)])
        with otherwise:
            for t in range(len(pairs)):
                builder.call(_fn(builder, "llvm.x86.tilezero", ir.VoidType(), [_I8]), [tile(t)])
    with cgutils.for_range_slice(builder, k0, k1, _const(1)) as (k, _):
        a0 = _step(builder, a, offs, k)
        b0 = _at(builder, panel, builder.mul(k, _const(1024)))
        for h in range(halves):
            builder.call(load, [tile(4 + h), _at(builder, a0, builder.mul(rs, _const(16 * h))), rs])
        for line in range(32):  # the B tiles' lines two steps on: B comes from L2 (A's chunk stays in L1)
            ahead = builder.add(_const(2048 + line % 16 * 64), builder.mul(bstride, _const(line // 16)))
            ahead = _at(builder, b0, ahead)
            builder.call(_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [_P8, _I32, _I32, _I32]),
                         [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])  # read, L1
        builder.call(load, [tile(6), b0, _const(64)])
        builder.call(load, [tile(7), _at(builder, b0, bstride), _const(64)])
        for t, (ta, tb) in enumerate(pairs):
            builder.call(dot, [tile(t), tile(ta), tile(tb)])
    store = _fn(builder, "llvm.x86.tilestored64", ir.VoidType(), [_I8, _P8, _I64])
    for t, offset in enumerate(offsets):
        builder.call(store, [tile(t), _at(builder, c, _const(offset)), _const(BN * 4)])


@intrinsic
def _block_amx(typingctx, a, offs, rs, rows, b, p0, k0, k1, c, keep):
    """``c`` (32 x 32 int32, row-major) = ``a`` (a block of 32 rows, its row
    ``r`` of step ``k`` at byte ``offs[k] + r * rs``: :func:`run`'s) times
    panels ``p0, p0 + 1`` over steps ``k0 .. k1``, plus ``c`` where ``keep``
    (its rows from ``rows`` on: undefined): C tiles 0..3, A tiles 4, 5, B
    tiles 6, 7; 16 rows (C tiles 0, 1 and A tile 4) where ``rows <= 16``."""
    def codegen(context, builder, sig, args):
        a, offs, rs, rows, panel, bstride, k0, k1, c, keep = _operands(context, builder, sig, args)
        with builder.if_else(builder.icmp_signed(">", rows, _const(16))) as (two, one):
            for halves, branch in ((2, two), (1, one)):
                with branch:
                    _amx_steps(builder, a, offs, rs, panel, bstride, k0, k1, c, keep, halves)
        return context.get_dummy_value()

    return _signature(a, offs, rs, rows, b, p0, k0, k1, c, keep), codegen


def _make_block_vnni(width, rows_at_once, widen=False):
    """The block of :func:`_block_amx` on vectors of ``width`` columns (16:
    AVX-512 VNNI, 8: AVX-VNNI, 4: AVX2), each an accumulator: ``vpdpbusd``
    (u8 x s8, four products a int32 lane), or, ``widen`` (AVX2, no VNNI), the
    bytes widened to int16 (``a`` by zero, ``w`` by sign: ``vpmovzxbw``,
    ``vpmovsxbw``) and ``vpmaddwd`` + ``vpaddd``: two int32 lanes a column,
    each two products (``|255 * -128 * 2| < 2**31``: exact, where
    ``vpmaddubsw``'s int16 pair sums saturate), the pair summed as the block
    is stored. ``rows_at_once`` rows at a time while that many are left
    (``rows_at_once * 32 / width`` accumulators, as many as the registers hold
    beside the panel's ``32 / width`` vectors and a broadcast; AVX2's 16
    registers, 8 accumulators a row: one), then one at a time. Reads only rows
    below ``rows``."""
    lanes = 2 * width if widen else width  # int32 lanes of an accumulator
    vec, cvec = ir.VectorType(_I32, lanes), ir.VectorType(_I32, width)
    # a's 4 bytes (one k4 of a row) as the CPU multiplies them; broadcast ``width`` times
    word, bcast = (ir.IntType(64), ir.VectorType(ir.IntType(64), width)) if widen else (_I32, cvec)
    operand = ir.VectorType(ir.IntType(16), 4 * width) if widen else cvec
    per_row = BN // width  # vectors in a row of the block
    name = "llvm.x86.avx2.pmadd.wd" if widen else f"llvm.x86.avx512.vpdpbusd.{width * 32}"
    if widen:  # shuffles: a column's sum into lane 2j, its pair of lanes out of 2j and 2j + 1
        spread = ir.Constant(vec, [j // 2 if j % 2 == 0 else width for j in range(lanes)])
        evens, odds = (ir.Constant(cvec, list(range(j, lanes, 2))) for j in (0, 1))

    def at(builder, c, first, r, v):
        """Where vector ``v`` of block row ``first + r`` lies in ``c``."""
        off = builder.add(builder.mul(builder.add(first, _const(r)), _const(BN * 4)), _const(v * width * 4))
        return builder.bitcast(_at(builder, c, off), cvec.as_pointer())

    def dot(builder, acc, av, wv):
        if widen:  # the empty asm keeps LLVM from fusing the two into AVX-VNNI's vpdpwssd where it may
            pairs = builder.call(_fn(builder, name, vec, [operand] * 2), [av, wv])
            return builder.add(acc, builder.asm(ir.FunctionType(vec, [vec]), "", "=x,0", [pairs], False))
        return builder.call(_fn(builder, name, vec, [vec] * 3), [acc, av, wv])

    def rows_from(builder, a, offs, rs, panel, bstride, k0, k1, c, keep, first, count):
        """Block rows ``first .. first + count - 1`` (``count`` a constant), step
        by step, the 16 k4 of a step in turn. One row alone sums ``CHAINS`` k4
        apart into accumulators of their own, added together as it is stored:
        one accumulator a vector waited on each ``vpdpbusd``'s latency (5
        cycles) every k4."""
        chains = CHAINS if count == 1 else 1
        accs = [[[cgutils.alloca_once(builder, vec) for _ in range(chains)] for _ in range(per_row)]
                for _ in range(count)]
        for r in range(count):
            for v in range(per_row):
                kept = builder.load(at(builder, c, first, r, v), align=1)
                if widen:  # a column's sum in the first lane of its pair
                    kept = builder.shuffle_vector(kept, ir.Constant(cvec, None), spread)
                builder.store(builder.select(keep, kept, ir.Constant(vec, None)), accs[r][v][0])
                for ch in range(1, chains):
                    builder.store(ir.Constant(vec, None), accs[r][v][ch])
        with cgutils.for_range_slice(builder, k0, k1, _const(1)) as (k, _):
            step = _step(builder, a, offs, k)
            with cgutils.for_range_slice(builder, _const(0), _const(16), _const(chains)) as (j_, _):
                for ch in range(chains):  # (16 k4 a step: CHAINS divides it)
                    j = builder.add(j_, _const(ch))
                    k4 = builder.add(builder.mul(k, _const(16)), j)
                    wv = []
                    for v in range(per_row):  # panel v * width // 16, from byte (v * width % 16) * 4 of its row k4
                        p = _at(builder, panel, builder.add(builder.mul(bstride, _const(v * width // 16)),
                                                            builder.add(builder.mul(k4, _const(64)),
                                                                        _const(v * width % 16 * 4))))
                        bytes_ = builder.load(builder.bitcast(p, ir.VectorType(_I8, 4 * width).as_pointer()), align=1)
                        wv.append(builder.sext(bytes_, operand) if widen else builder.bitcast(bytes_, operand))
                    for r in range(count):
                        # a's step k, row first + r, byte j * 4
                        pa = _at(builder, step, builder.add(builder.mul(builder.add(first, _const(r)), rs),
                                                            builder.mul(j, _const(4))))
                        if widen:
                            four = builder.load(builder.bitcast(pa, ir.VectorType(_I8, 4).as_pointer()), align=1)
                            four = builder.bitcast(builder.zext(four, ir.VectorType(ir.IntType(16), 4)), word)
                        else:
                            four = builder.load(builder.bitcast(pa, word.as_pointer()), align=1)
                        av = builder.bitcast(_splat(builder, four, bcast), operand)
                        for v in range(per_row):
                            builder.store(dot(builder, builder.load(accs[r][v][ch]), av, wv[v]), accs[r][v][ch])
        for r in range(count):
            for v in range(per_row):
                acc = builder.load(accs[r][v][0])
                for ch in range(1, chains):  # int32 addition wraps: any order gives the same sum
                    acc = builder.add(acc, builder.load(accs[r][v][ch]))
                if widen:  # each column's two lanes summed
                    acc = builder.add(*(builder.shuffle_vector(acc, acc, s) for s in (evens, odds)))
                builder.store(acc, at(builder, c, first, r, v), align=1)

    @intrinsic
    def block(typingctx, a, offs, rs, rows, b, p0, k0, k1, c, keep):
        def codegen(context, builder, sig, args):
            a, offs, rs, rows, panel, bstride, k0, k1, c, keep = _operands(context, builder, sig, args)
            full = builder.mul(builder.sdiv(rows, _const(rows_at_once)), _const(rows_at_once))
            for begin, end, step in ((_const(0), full, rows_at_once), (full, rows, 1)):
                with cgutils.for_range_slice(builder, begin, end, _const(step)) as (first, _):
                    rows_from(builder, a, offs, rs, panel, bstride, k0, k1, c, keep, first, step)
            return context.get_dummy_value()

        return _signature(a, offs, rs, rows, b, p0, k0, k1, c, keep), codegen

    return block


@njit(inline="always")
def _block_portable(a, offs, rs, rows, b, p0, k0, k1, c, keep):
    """The block of :func:`_block_amx` in plain loops."""
    for r in range(rows):
        for h in range(2):
            brow = b[p0 + h]
            crow = c[r * BN + h * 16:]
            if not keep:
                crow[:16] = 0
            for k4 in range(k0 * 16, k1 * 16):
                a4 = a[offs[k4 // 16] + r * rs + k4 % 16 * 4:]
                w = brow[k4 * 64:]
                for j in range(16):
                    s = np.int32(0)
                    for i in range(4):
                        s += np.int32(a4[i]) * np.int32(w[j * 4 + i])
                    crow[j] += s


_block_vnni512, _block_vnni256, _block_avx2 = _make_block_vnni(16, 8), _make_block_vnni(8, 2), _make_block_vnni(4, 1, True)
# the kernels' indices (blocks.py reads them too: a new one goes last)
_ISAS = ("amx", "avx512vnni", "avxvnni", "portable", "avx2")


@njit(inline="always")
def _block(isa, a, offs, rs, rows, b, p0, k0, k1, c, keep):
    """The block of instruction set ``isa`` (its index in ``_ISAS``: a closure
    constant of the kernel, so the other branches fold away). The kernels name
    the intrinsics here, as globals: in a kernel's closure, an intrinsic is
    pickled into Numba's cache key with an id of its own each process, and the
    kernel compiled again every time. AMX's blocks of ``SMALL_ROWS`` rows or
    fewer run on AVX-512 VNNI (every CPU with AMX has it): a tile's 16 rows
    cost the same whatever is in them."""
    if isa == 0 and rows > SMALL_ROWS:
        _block_amx(a, offs, rs, rows, b, p0, k0, k1, c, keep)
    elif isa <= 1:
        _block_vnni512(a, offs, rs, rows, b, p0, k0, k1, c, keep)
    elif isa == 2:
        _block_vnni256(a, offs, rs, rows, b, p0, k0, k1, c, keep)
    elif isa == 4:
        _block_avx2(a, offs, rs, rows, b, p0, k0, k1, c, keep)
    else:
        _block_portable(a, offs, rs, rows, b, p0, k0, k1, c, keep)


SMALL_ROWS = 8
# column blocks a task, and steps of 64 k a block takes at a time (its C
# tiles stored and loaded again between): 32 rows by 512 k of a, 16 KB, stay
# in L1 across the task's columns (STEPS 32's 64 KB did not fit a 48 KB L1).
# On the AMX machine, 2 threads, layer calls in processes alternating, 256 x
# 4096 x 4096 took 2.09-2.27 ms against 2.33-2.50 at STEPS 32; STEPS 4 and 16,
# and GROUP 16, were slower; 1024^3 (16 steps) did not change. GROUP 8 took
# 0.79x and 0.87x GROUP 4's time (1024^3, 256x4096x4096, one thread)
GROUP = 8
STEPS = 8


@kernel
def pack_rows(a, flip, out, start, stop):
    """``a`` (M, K) uint8 XOR ``flip`` (0, or 0x80: signed codes made unsigned,
    ``a + 128``) as ``out`` (ceil(M / 32), steps, 32, 64): for each block of 32
    rows, each step's 32 rows of 64 k one after the other, zero beyond K (an A
    tile of 16 rows is 1 KB in a row, where rows K bytes apart could share one
    set of the L1 cache). Rows beyond M are left as they are: a tile's rows
    there make only rows of C that no store reads (zeroing them cost M = 1
    more than its GEMM at K = 65,536). Step by step, each written in order
    (rows by rows: 15-20% slower). Tasks: blocks of rows."""
    mlen, klen = a.shape
    steps, full = out.shape[1], klen // BK
    for mb in range(start, stop):
        rows = min(BM, mlen - mb * BM)
        for s in range(full):
            step = out[mb, s]
            for r in range(rows):
                d, src = step[r], a[mb * BM + r, s * BK:]
                for i in range(BK):  # a constant count: one vector
                    d[i] = src[i] ^ flip
        if full < steps:
            step = out[mb, full]
            for r in range(rows):
                d, src = step[r], a[mb * BM + r, full * BK:]
                for i in range(BK):
                    d[i] = src[i] ^ flip if i < klen - full * BK else 0


@njit(inline="always")
def _store(blk, m0, rows, n0, cols, rowsum, c, zw, zo, m, sh, f, lo, hi, out, rows_to, code, narrow, near, fast):
    """The epilogue of one block: ``out[r, n0 + j] = R(blk[i, j] + c[n] - zw[n]
    * rowsum[m0 + i])`` for ``i < rows``, ``j < cols`` (:func:`gemm_epilogue`'s),
    ``r = m0 + i``, or ``rows_to[m0 + i]`` where that is not None (none where
    it is -1: :func:`conv`'s; two divisions a row there took a tenth of the
    kernel's time).
    Every array is sliced and indexed from 0 (``requantize._span``: an index from
    ``n0`` keeps Numba checking for wraparound, and the loop from vectorizing).
    Where ``fast`` (:func:`_near_columns` made ``near``, the block's columns'
    float32 terms), each row is made in float32 first (:func:`_store_near`)
    and again exactly only where a lane lies too near a tie (a lane in ~4,000
    for int8, at most 1 in 1,000): 1024x64x1024 int8 out, one thread, took
    0.64 ms against 0.90 in int64 (``vpmullq``, 8 lanes)."""
    c, zw, zo, m, sh, f = c[n0:], zw[n0:], zo[n0:], m[n0:], sh[n0:], f[n0:]
    for i in range(rows):
        r = m0 + i if rows_to is None else rows_to[m0 + i]  # (None: pruned as rowsum's term)
        if r < 0:
            continue
        rs = _row_term(rowsum, m0 + i)
        orow = out[r, n0:]
        brow = blk[i * BN:]
        if fast and _store_near(brow, np.int32(rs), near, cols, orow):
            continue
        for j in range(cols):
            d = np.int64(brow[j]) + c[j] - zw[j] * rs
            orow[j] = _rq(d, zo[j], m[j], sh[j], f[j], lo, hi, code, narrow)


# the float32 rows of a narrow epilogue that rounds to nearest (``_store_near``)
NEAR_EPS = 2.0**-20  # over 3 roundings' relative error (2**-24 each): the margin kept from a tie
NEAR_LIMIT = 1 << 9  # |out - zo| at most this: 8-bit and narrower outputs
_POW2 = 2.0 ** -np.arange(SHIFT_MIN, SHIFT_MAX + 1)  # 2**-sh, exact


@njit(inline="always")
def _near_columns(near, c, zw, zo, m, sh, cols, lo, hi):
    """Fill ``near`` (2 x 4 * BN int32) for a block's ``cols`` columns (``c``
    .. ``sh`` sliced from the block's first column):
    ``near[0]``: ``c``, ``zw``, ``zo`` wrapped to int32 (``narrow``: every total
    fits, so int32's wrap-around gives it exactly); ``near[1]`` as float32: the
    scale ``m / 2**sh`` (rounded), ``lo - zo``, ``hi - zo`` (the clamp before
    rounding: exact integers) and ``1/2 - max(|lo - zo|, |hi - zo|) * NEAR_EPS``.
    False (``near`` unused) where some clamp passes ``NEAR_LIMIT``."""
    ci, cf = near[0], near[1].view(np.float32)
    for j in range(cols):
        ylo, yhi = lo - zo[j], hi - zo[j]
        lim = max(abs(ylo), abs(yhi))
        if lim > NEAR_LIMIT:
            return False
        ci[j], ci[BN + j], ci[2 * BN + j] = np.int32(c[j]), np.int32(zw[j]), np.int32(zo[j])
        cf[j] = np.float32(np.float64(m[j]) * _POW2[sh[j] - SHIFT_MIN])
        cf[BN + j], cf[2 * BN + j], cf[3 * BN + j] = np.float32(ylo), np.float32(yhi), np.float32(0.5 - lim * NEAR_EPS)
    return True


@njit(inline="always")
def _store_near(brow, rs, near, cols, orow):
    """One row of :func:`_store` in float32: ``y = float32(d) * scale`` (``d``
    in int32, exact), clamped to ``[lo - zo, hi - zo]``, rounded by ``rint``.
    Three roundings put ``y`` within ``3.1 * 2**-24 * |y|`` of the exact ``d *
    m / 2**sh``, so ``rint(y)`` is its rounding, whatever the tie rule,
    wherever ``y`` lies more than ``|y| * NEAR_EPS`` from a tie; a clamped
    ``y`` is an integer, and the exact value clamps to the same end (it lies
    past the end less half). Returns False, the row's stores to be made again
    exactly, where some lane's ``|y - rint(y)|`` passes its column's margin."""
    ci, cf = near[0], near[1].view(np.float32)
    c, zw, zo = ci[:BN], ci[BN:2 * BN], ci[2 * BN:]
    scale, ylo, yhi, tol = cf[:BN], cf[BN:2 * BN], cf[2 * BN:3 * BN], cf[3 * BN:]
    bad = False
    for j in range(cols):
        d = _sub32(_add32(np.int32(brow[j]), c[j]), _mul32(zw[j], rs))
        y = min(max(np.float32(d) * scale[j], ylo[j]), yhi[j])
        r = np.rint(y)
        bad |= abs(y - r) >= tol[j]
        orow[j] = _add32(np.int32(r), zo[j])
    return not bad


def _make_gemm(isa, code, narrow):
    """The GEMM kernel of instruction set ``isa`` with the epilogue of one
    rounding code (closure constants: their branches fold away, and they are
    in Numba's cache key)."""
    which, amx, wide, source = _ISAS.index(isa), isa == "amx", isa in ("amx", "avx512vnni"), _SOURCE
    rounds_near = narrow and HALF_EVEN <= code <= HALF_UP  # where _store_near may run (_near_columns says)

    @kernel
    def gemm(a, sa, offs, rows_to, panels, rowsum, c, zw, zo, m, sh, f, lo, hi, cfg, out, start, stop):
        """``out = R(a @ w + c - zw * rowsum)`` on tasks ``start .. stop``, each
        ``GROUP`` blocks of 32 columns by 32 rows (``tasks``): ``a`` the
        activations' bytes, row ``r`` of step ``k`` (64 k) of block ``mb`` at
        ``mb * sa[0] + offs[k] + r * sa[1]`` (:func:`run`'s, :func:`conv`'s);
        the product's rows those of ``out``, or as many as ``rows_to`` (not
        None: where each goes, ``_store``); ``panels`` :func:`pack`'s;
        ``rowsum`` (one a product row) int64 or None; ``c``, ``zw``, ``zo``,
        ``m``, ``sh``, ``f``: (N,) columns; ``out`` (rows kept, N).

        A task's rows of ``a`` are read ``STEPS`` steps at a time, from the
        cache, for each of its ``GROUP`` column blocks in turn; tasks of the same
        columns follow each other, so their weights stay in the cache too."""
        _ = source
        mlen, nlen = out.shape[0] if rows_to is None else rows_to.size, out.shape[1]
        steps = panels.shape[1] // 1024
        chunk = KMAX // BK
        mblocks = (mlen + BM - 1) // BM
        nblocks = (nlen + BN - 1) // BN
        part = _aligned(np.empty(GROUP * BM * BN + 16, np.int32), GROUP * BM * BN)
        total = np.empty(GROUP * BM * BN, np.int64)
        part[:] = 0  # K = 0: no step writes it
        # the float32 terms of the task's column blocks (``_near_columns``), made
        # once for the tasks of a column group, not for each block (a 1024^3
        # int8-out epilogue, one thread, in a harness: 0.335 -> 0.30 ms)
        near = np.empty((GROUP, 2, 4 * BN), np.int32)
        fast = np.zeros(GROUP, np.bool_)
        near_of = -1
        if amx:
            _tiles_begin(cfg)
        if wide:
            _wide()
        for t in range(start, stop):
            g, mb = t // mblocks, t % mblocks
            nb0, nb1 = g * GROUP, min(g * GROUP + GROUP, nblocks)
            m0 = mb * BM
            rows = min(BM, mlen - m0)
            rows_of_a = a[mb * sa[0]:]
            if rounds_near and g != near_of:
                near_of = g
                for nb in range(nb0, nb1):
                    n0 = nb * BN
                    fast[nb - nb0] = _near_columns(near[nb - nb0], c[n0:], zw[n0:], zo[n0:], m[n0:], sh[n0:],
                                                   min(BN, nlen - n0), lo, hi)
            for k0 in range(0, steps, chunk):  # int32 holds KMAX k at most: longer K adds up in int64
                k1 = min(k0 + chunk, steps)
                for s0 in range(k0, k1, STEPS):
                    s1 = min(s0 + STEPS, k1)
                    for nb in range(nb0, nb1):
                        blk = part[(nb - nb0) * BM * BN:]
                        _block(which, rows_of_a, offs, sa[1], rows, panels, 2 * nb, s0, s1, blk, np.int64(s0 > k0))
                if steps > chunk:
                    for i in range((nb1 - nb0) * BM * BN):
                        total[i] = part[i] + (total[i] if k0 else 0)
            for nb in range(nb0, nb1):
                n0, i = nb * BN, nb - nb0
                cols = min(BN, nlen - n0)
                if steps > chunk:
                    _store(total[i * BM * BN:], m0, rows, n0, cols, rowsum, c, zw, zo, m, sh, f, lo, hi, out,
                           rows_to, code, narrow, near[i], rounds_near and fast[i])
                else:
                    _store(part[i * BM * BN:], m0, rows, n0, cols, rowsum, c, zw, zo, m, sh, f, lo, hi, out,
                           rows_to, code, narrow, near[i], rounds_near and fast[i])
        if amx:
            _tiles_end()

    return gemm


def gemm(isa, code, narrow):
    """The kernel of :func:`_make_gemm`, made once a process (compiled at first
    call). Raises ValueError where ``isa`` cannot run (AMX instructions before
    Linux grants the tile state, which ``isa.usable`` asks for, would end the
    process)."""
    if code not in (FLOAT, IDENTITY, *ROUNDINGS.values()):
        raise ValueError(f"unknown rounding code {code}")
    ok, why = usable(isa)
    if not ok:
        raise ValueError(f"the int8 GEMM cannot run on {isa} here: {why}")
    return _kernel(isa, code, narrow)


_kernel = functools.cache(_make_gemm)


def tasks(m, n):
    """``gemm``'s task count for an ``(m, n)`` result: blocks of 32 rows by
    ``GROUP`` blocks of 32 columns."""
    return -(-m // BM) * -(-n // (BN * GROUP))


_kept = threading.local()


def _scratch(shape):
    """A uint8 array of ``shape``, this thread's from one call to the next: a
    new one each call was memory the kernel faulted in page by page (1 MB of
    activations: up to 1.5 ms more, on and off as malloc's threshold moved)."""
    size = math.prod(shape)
    buf = getattr(_kept, "buf", None)
    if buf is None or buf.size < size:
        buf = _kept.buf = aligned_zeros((max(size, 1 << 16),), np.uint8)  # (tile rows in one cache line)
    return buf[:size].reshape(shape)


def run(isa, code, narrow, a, signed, panels, rowsum, columns, lo, hi, out, threads=None):
    """``out = R(a' @ w + c - zw * rowsum)`` (``gemm``'s kernel): ``a`` (M, K)
    8-bit codes, ``a' = a + 128`` where ``signed``, else ``a``; ``panels``
    :func:`pack`'s of ``w``; ``columns`` the (N,) ``c, zw, zo, m, sh, f``;
    ``lo, hi`` the clamp; on the pool's threads, or one (``threads=1``)."""
    (mlen, klen), steps = a.shape, -(-a.shape[1] // BK)
    rows = np.ascontiguousarray(a).view(np.uint8)
    if _in_place(rows, signed):  # the tiles' rows read where they are
        bytes_, sa, offs = rows.reshape(-1), (BM * klen, klen), _offsets(steps, BK)
    else:
        packed = _scratch((-(-mlen // BM), steps, BM, BK))
        bytes_, sa, offs = packed.reshape(-1), (packed.strides[0], BK), _offsets(steps, BM * BK)
        flip = np.uint8(0x80 if signed else 0)
        if threads == 1:
            pack_rows(rows, flip, packed, 0, len(packed))
        else:
            parallel(pack_rows, len(packed), rows, flip, packed, grain=-(-PACK_GRAIN // (BM * max(klen, 1))))
    return _launch(gemm(isa, code, narrow), bytes_, sa, offs, None, panels, rowsum, columns,
                   lo, hi, out, threads)


# bytes of activations a thread packs, at least: waking the pool costs the caller
# ~30 us on the 2-core VM (a futex wake of a halted vCPU), and the thread comes
# ~40 us later; 1 MB (1024 x 1024, 256 x 4096) took 84 us on the caller alone, 141
# on two threads (2-thread calls from 4 MB)
PACK_GRAIN = 1 << 21


def _launch(kernel, bytes_, sa, offs, rows_to, panels, rowsum, columns, lo, hi, out, threads=None):
    """``kernel`` (:func:`gemm`'s) on every task of a product of ``out``'s rows, or ``rows_to``'s."""
    args = (bytes_, sa, offs, rows_to, panels, rowsum, *columns, np.int64(lo), np.int64(hi), _CONFIG, out)
    work = tasks(out.shape[0] if rows_to is None else rows_to.size, out.shape[1])
    if threads == 1:
        kernel(*args, 0, work)
    else:
        parallel(kernel, work, *args, grain=-(-SMALL_WORK // (BM * BN * GROUP * max(len(offs) * BK, 1))))
    return out


@functools.lru_cache(maxsize=64)
def _offsets(steps, stride):
    """``offs`` for steps ``stride`` bytes apart."""
    return np.arange(steps, dtype=np.int64) * stride


def conv(isa, code, narrow, x, kh, kw, padding, dilation, za, signed, panels, rowsum, columns, lo, hi, out):
    """conv2d (stride 1, groups 1) as one product of ``gemm``'s kernel, with no
    im2col (an implicit GEMM): ``out`` (N*OH*OW, O) ``= R(patches @ w + c - zw
    * rowsum)``, the patches :func:`im2col`'s of ``x``, (N, H, W, C)
    channels-last 8-bit codes (any strides; ``a + 128`` where ``signed``)
    padded with ``za``; ``panels`` :func:`pack`'s of the weights, rows ``(p,
    q, c)``; ``rowsum``: whether the epilogue has the row term (the patches'
    sums, made here).

    The images are copied once, padded, into rows of C codes, a row a padded
    pixel: image ``i``'s pixel ``(y, x)`` is row ``v = (i * Hp + y) * Wp +
    x``. Stride 1, the patch of output pixel ``(y, x)`` starts at row ``v``,
    its tap ``(p, q)`` at row ``v + p * dh * Wp + q * dw``: product row
    ``v``'s step ``(tap, 64 channels)`` lies at a fixed offset from row ``v``
    (``offs``), rows C bytes apart, as the kernel reads them. The product has
    rows at the padded pixels too, which no output keeps (``rows_to`` drops
    them): ``(Hp * Wp) / (OH * OW)`` times the work (``WASTE``), and no copy
    of K bytes a row."""
    n, h, w, c = x.shape
    (ph, pw), (dh, dw) = padding, dilation
    hp, wp = h + 2 * ph, w + 2 * pw
    rows, taps, offs, rows_to = _geometry(n, hp, wp, c, kh, kw, dh, dw)
    xpad = _scratch((max(n * hp * wp, -(-rows // BM) * BM + taps[-1] + 1), c))  # the last tiles' rows, read
    image = xpad[:n * hp * wp].reshape(n, hp, wp, c)
    for edge in (image[:, :ph], image[:, ph + h:], image[:, ph:ph + h, :pw], image[:, ph:ph + h, pw + w:]):
        edge[...] = (za + 128 * signed) & 0xFF
    xpad[n * hp * wp:] = 0  # (read by rows that no output keeps)
    inner, codes = image[:, ph:ph + h, pw:pw + w], x.view(np.uint8)  # NumPy's strided copy: 2x a Numba loop's
    np.bitwise_xor(codes, np.uint8(0x80), out=inner) if signed else np.copyto(inner, codes)
    sums = None
    if rowsum:  # each padded pixel's sum over C, summed over the taps of each row's patch
        pixels = xpad.sum(axis=1, dtype=np.int64)
        sums = sum(pixels[t:t + rows] for t in taps)
    return _launch(gemm(isa, code, narrow), xpad.reshape(-1), (BM * c, c), offs, rows_to, panels, sums, columns, lo,
                   hi, out)


@functools.lru_cache(maxsize=64)
def _geometry(n, hp, wp, c, kh, kw, dh, dw):
    """:func:`conv`'s product on ``n`` padded images ``hp x wp`` of ``c``
    channels: its rows (to the last output pixel's), each tap's offset in rows,
    each step's in bytes (``offs``), and ``rows_to``: product row ``v``, padded
    pixel ``(i, y, x)``, goes to output row ``(i * oh + y) * ow + x`` where ``y
    < oh`` and ``x < ow``, elsewhere nowhere (-1)."""
    oh, ow = hp - dh * (kh - 1), wp - dw * (kw - 1)
    rows = (n - 1) * hp * wp + (oh - 1) * wp + ow
    taps = [p * dh * wp + q * dw for p in range(kh) for q in range(kw)]
    offs = np.array([t * c + k for t in taps for k in range(0, c, BK)], np.int64)
    i, at = np.divmod(np.arange(rows), hp * wp)
    y, x = np.divmod(at, wp)
    return rows, taps, offs, np.where((y < oh) & (x < ow), (i * oh + y) * ow + x, -1).astype(np.int64)


def _in_place(rows, signed):
    """Whether the kernel reads ``rows`` (M, K) as they are: unsigned (nothing to
    flip), whole blocks of 32 rows and steps of 64 k (nothing to pad), writable
    (one Numba signature with the scratch), and rows ``K`` bytes apart that
    spread over 16 or more of L1's 64 sets (``gcd(K / 64, 64) <= 4``: a
    tile's rows 4096 bytes apart would all fall in one). Conv2d's im2col rows,
    3136 x 576, skip a 1.8 MB copy."""
    m, k = rows.shape
    return (not signed and m % BM == 0 and k % BK == 0 and k > 0 and rows.flags.writeable
            and math.gcd(k // BK, 64) <= 4)


# -- the epilogue alone, on another engine's products ---------------------------------------------
@njit(inline="always")
def _row_term(rowsum, r):
    if rowsum is None:  # pruned as Numba compiles for None: the term folds away
        return np.int64(0)
    return rowsum[r]


def _make_gemm_epilogue(code, narrow):
    """The integer GEMM's epilogue for one rounding code: zero-point terms, bias
    and requantize (or none: ``IDENTITY``) in one pass over the accumulator.
    ``narrow``: every total fits in int32 (``Requant.narrow``)."""
    source = _SOURCE

    @kernel
    def gemm_epilogue(raw, rowsum, c, zw, zo, m, sh, f, lo, hi, out, start, stop):
        """``out[r, n] = R(raw[r, n] + c[n] - zw[n] * rowsum[r])`` (``R``: the
        requantize of ``Requant`` with zp_in 0, per-column parameters), rows
        ``start..stop``; ``rowsum`` None: no row term (compiled without it)."""
        _ = source
        for r in range(start, stop):
            rs = _row_term(rowsum, r)
            for n in range(raw.shape[1]):
                d = np.int64(raw[r, n]) + c[n] - zw[n] * rs
                out[r, n] = _rq(d, zo[n], m[n], sh[n], f[n], lo, hi, code, narrow)

    return gemm_epilogue


gemm_epilogue = {(code, narrow): _make_gemm_epilogue(code, narrow)
                 for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}


# -- small M on packed 4-bit weights -------------------------------------------------------------
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


def _make_gemm_packed4(source):
    """:func:`gemm_packed4`, ``source`` (``_SOURCE``: llvm.py's dots) in its closure."""

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
        _ = source
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

    return gemm_packed4


gemm_packed4 = _make_gemm_packed4(_SOURCE)


# -- conv2d: direct grouped and depthwise, and im2col ----------------------------------------------
def _make_conv_grouped(code, narrow):
    """``conv_grouped`` with its epilogue for one rounding code (closure
    constants, as ``requantize.requantize``; ``narrow``: ``Requant.narrow``).
    The kernel's body is written here rather than inlined from a helper:
    Numba deep-copies an ``inline="always"`` function's IR block by block for
    every specialization, which for a body this size took half of each
    compile (10.5 s -> 6.4 s a specialization)."""
    source = _SOURCE

    @kernel
    def conv_grouped(x, za, wc, groups, sh, sw, dh, dw, ph, pw, bias, zo, m, shift, f, lo, hi, out, start, stop):
        """Direct grouped conv2d (depthwise included) on 8-bit codes, with its
        epilogue: bias and requantize (``requantize._rq``, per output channel).

        - ``x``: (N, C, H, W) uint8 or int8; rows (last axis) contiguous for
          speed, any strides work.
        - ``za``: int, the input zero point: the padding's codes (so padding
          contributes exactly 0).
        - ``wc``: (O, C // groups, kh, kw) int16 or int32: centred weights
          ``w - zw[o]``.
        - ``groups``: C and O are multiples of it; output channel ``o`` reads input
          channels ``g * cg .. g * cg + cg - 1``, ``cg = C // groups``,
          ``g = o // (O // groups)`` (depthwise: groups == C, O a multiple of C).
        - ``sh, sw, dh, dw, ph, pw``: strides and dilations (>= 1), padding (>= 0).
        - ``bias``, ``zo``, ``m``, ``shift``, ``f``: per output channel (length O),
          ``lo``, ``hi``: the clamp (``Requant``; ``IDENTITY`` for the sums).
        - ``out``: (N, O, OH, OW) with ``OH = (H + 2*ph - dh*(kh-1) - 1)//sh + 1``
          (same for W), written whole with ``R(acc + bias[o])``, ``R`` the
          requantize of ``code``, where, ``xpad`` being ``x`` padded with ``za``::

              acc[n, o, i, j] = sum_{c', p, q} (xpad[n, g*cg + c', i*sh + p*dh, j*sw + q*dw] - za)
                                               * wc[o, c', p, q]

        Exactness: the accumulation wraps in int32, so the result is exact when
        the true sum fits in int32; e.g. with |x - za| <= 255 and |wc| <= 255
        (centred 8-bit weights) that holds for cg * kh * kw <= 33_025 taps.

        Scheme: one task per (n, o), ``t = n * O + o`` in ``start..stop``. Each
        input channel is padded into a thread-local plane ``(Hp, Wp)`` (in L1:
        no padded copy of the whole input, which cost a depthwise 3x3 on
        256 x 56 x 56 a fifth of its time), then its taps add ``wc * x`` into an
        int32 plane of the sums. Strides 1: each tap over the whole padded plane
        at once, seen flat with its row stride ``Wp``: output ``(i, j)`` is
        element ``i * Wp + j``, one loop of ``(OH - 1) * Wp + OW`` elements a tap
        (the columns ``j >= OW`` in between are computed and dropped; every read
        stays inside the plane), 2.7x faster than a loop per output row of 56
        (depthwise 3x3 on 56x56). Other strides: each tap along each output row
        (stride 2 as a compile-time constant). Then the epilogue writes ``out``.
        """
        _ = source  # in the cache key (see pool.source)
        N, C, H, W = x.shape
        O, cg, kh, kw = wc.shape
        Hp, Wp = H + 2 * ph, W + 2 * pw
        OH = out.shape[2]
        OW = out.shape[3]
        if groups < 1 or C % groups or O % groups or cg * groups != C:
            raise ValueError("conv_grouped: C and O must be multiples of groups, wc.shape[1] == C // groups")
        if out.shape[0] != N or out.shape[1] != O:
            raise ValueError("conv_grouped: out must be (N, O, OH, OW)")
        if OH != (Hp - dh * (kh - 1) - 1) // sh + 1 or OW != (Wp - dw * (kw - 1) - 1) // sw + 1:
            raise ValueError("conv_grouped: out's OH, OW do not match the input, kernel, stride and dilation")
        og = O // groups
        ones = sh == 1 and sw == 1
        step = Wp if ones else OW  # the sums' row stride
        flat = max((OH - 1) * step + OW, 0)
        plane = np.empty(flat, np.int32)
        xl = np.empty(Hp * Wp, x.dtype)
        for t in range(start, stop):
            n = t // O
            o = t % O
            c0 = (o // og) * cg
            wsum = np.int64(0)
            for c in range(cg):
                for p in range(kh):
                    for q in range(kw):
                        wsum += np.int64(wc[o, c, p, q])
            plane[:] = np.int32(-np.int64(za) * wsum)  # wraps like the sum does
            for c in range(cg):
                xl[:] = za
                for r in range(H):
                    row, src = xl[(r + ph) * Wp + pw:], x[n, c0 + c, r]
                    for j in range(W):
                        row[j] = src[j]
                for p in range(kh):
                    for q in range(kw):
                        wv = np.int32(wc[o, c, p, q])
                        if ones:
                            xr = xl[p * dh * Wp + q * dw:]  # indexed from 0 (see requantize._span)
                            for e in range(flat):
                                plane[e] += np.int32(xr[e]) * wv
                            continue
                        for i in range(OH):
                            # Sliced rows indexed from 0 by the loop counter: with
                            # xl[off + j] Numba's negative-index wraparound
                            # turns every load into a scalar gather.
                            xr, prow = xl[(i * sh + p * dh) * Wp + q * dw:], plane[i * OW:]
                            if sw == 1:
                                for j in range(OW):
                                    prow[j] += np.int32(xr[j]) * wv
                            elif sw == 2:  # a constant stride: vectorized as interleaved loads
                                for j in range(OW):
                                    prow[j] += np.int32(xr[2 * j]) * wv
                            else:
                                for j in range(OW):
                                    prow[j] += np.int32(xr[j * sw]) * wv
            b, z, mo, so, fo = bias[o], zo[o], m[o], shift[o], f[o]
            for i in range(OH):
                orow, prow = out[n, o, i], plane[i * step:]
                for j in range(OW):
                    orow[j] = _rq(np.int64(prow[j]) + b, z, mo, so, fo, lo, hi, code, narrow)

    return conv_grouped


conv_grouped = {(code, narrow): _make_conv_grouped(code, narrow)
                for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}


@kernel
def im2col(x, kh, kw, sh, sw, dh, dw, ph, pw, za, out, start, stop):
    """Patches of a channels-last image, padded with ``za``, as GEMM rows.

    - ``x``: (N, H, W, C), C-contiguous.
    - ``kh, kw, sh, sw, dh, dw``: kernel size, strides, dilations (>= 1);
      ``ph, pw``: padding (>= 0), its codes ``za``.
    - ``out``: (N*OH*OW, kh*kw*C), same dtype, C-contiguous, written whole,
      with ``OH = (H + 2*ph - dh*(kh-1) - 1)//sh + 1`` (same for W):
      ``out[(n*OH + i)*OW + j, (p*kw + q)*C + c] = xpad[n, i*sh + p*dh, j*sw + q*dw, c]``,
      ``xpad`` being ``x`` padded.

    Channels last, every tap is one contiguous run of C codes, copied as a
    vector (channels-first patches are single bytes scattered over the row),
    or ``za`` where the tap lies in the padding (no padded copy of the input
    is made). A copy: no arithmetic, no overflow. One task per (n, i), ``t = n
    * OH + i`` in ``start..stop``.
    """
    N, H, W, C = x.shape
    OH = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    OW = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
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
                r = i * sh + p * dh - ph
                for q in range(kw):
                    col = j * sw + q * dw - pw
                    dst = row[(p * kw + q) * C:]  # sliced views indexed from 0 (see conv_grouped)
                    if 0 <= r < H and 0 <= col < W:
                        src = x[n, r, col]
                        for c in range(C):
                            dst[c] = src[c]
                    else:
                        for c in range(C):
                            dst[c] = za
