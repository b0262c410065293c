"""The int8 GEMM: ``a @ w`` for unsigned 8-bit activations and signed 8-bit
weights, with the exact epilogue fused into each block's store.

The weights are packed once (:func:`pack`) into panels of 16 columns; within
a panel, each step of 64 k holds 16 rows of 64 bytes, row ``k4`` holding, for
each of the 16 columns, its 4 weights ``k = 4 k4 .. 4 k4 + 3``. That is the
layout of an AMX B tile, and each row is one AVX-512 VNNI operand (two for
AVX-VNNI's 256 bits), so every instruction set reads the same bytes.

The result is computed in blocks of 32 rows by 32 columns, one task each
(column blocks outer, so consecutive tasks share their weights). A block's
products are summed in int32 over at most ``KMAX`` k (``255 * 128 * KMAX <
2**31``: exact, as every instruction here adds without saturating), then in
int64 over longer K, and the epilogue (``_numba._rq``: zero-point terms, bias,
requantize by any rounding, clamp to the output dtype) writes the block from
that scratch, 4 KB the thread keeps in its cache: an int8-out layer writes
its int32 products nowhere.

A block's products, by instruction set (``isa.best``; each gives the same
integers, which the tests check with each turned off in turn):

- ``amx``: four 16 x 16 int32 tiles, each step two A tiles (16 rows x 64 k)
  and two B tiles, four ``tdpbusd``;
- ``avx512vnni`` / ``avxvnni``: rows of ``vpdpbusd`` on 512 / 256 bits, each
  row's 4 bytes of ``a`` broadcast against a row of the panel;
- ``portable``: the same sums in plain Numba loops.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..._fixed_point import FLOAT, IDENTITY, ROUNDINGS

from .._gemm import SMALL_WORK  # products from which a call wakes the pool
from .._numba import _SOURCE, _row_term, _rq, _wide, kernel, parallel
from .isa import best, usable

BM = BN = 32  # a block's rows and columns
BK = 64  # k a step
KMAX = (2**31 - 1) // (255 * 128) // BK * BK  # k summed in int32: 65,792

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_P8 = _I8.as_pointer()


def pack(w):
    """Signed 8-bit weights ``(K, N)`` as panels of 16 columns, ``(ceil(N / 32) * 2,
    ceil(K / 64) * 1024)`` int8, zero-padded (the module's docstring)."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.int8:
        raise TypeError(f"pack takes (K, N) int8 weights, got {w.dtype} {w.shape}")
    k, n = w.shape
    kp, n_p = -(-k // BK) * BK, -(-n // BN) * BN
    rows = np.zeros((n_p, kp), np.int8)  # w.T, padded: a column's 4 weights of a k4 are one int32
    rows[:n, :k] = w.T
    # (panel, column, k4) -> (panel, k4, column), moving int32s: 4 bytes at once
    # (the bytes one at a time took 150 ms on 4096 x 4096 weights)
    panels = rows.view(np.int32).reshape(n_p // 16, 16, kp // 4).transpose(0, 2, 1)
    return np.ascontiguousarray(panels).view(np.int8).reshape(n_p // 16, kp * 16)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _at(builder, base, offset):
    return builder.gep(base, [offset])


def _operands(context, builder, sig, args):
    """The block intrinsics' arguments as ``(a, rows, the first panel, the
    panel stride, k0, k1, c, keep)``: pointers to bytes, ``keep`` an i1."""
    a, rows, b, p0, k0, k1, c, keep = args
    a_, b_, c_ = (context.make_array(sig.args[i])(context, builder, x) for i, x in ((0, a), (2, b), (6, c)))
    bstride = builder.extract_value(b_.strides, 0)
    panel = _at(builder, builder.bitcast(b_.data, _P8), builder.mul(p0, bstride))
    keep = builder.icmp_signed("!=", keep, ir.Constant(keep.type, 0))
    return builder.bitcast(a_.data, _P8), rows, panel, bstride, k0, k1, builder.bitcast(c_.data, _P8), keep


def _signature(a, rows, b, p0, k0, k1, c, keep):
    return types.void(a, rows, b, p0, k0, k1, c, keep)


def _const(v):
    return ir.Constant(_I64, v)


@intrinsic
def _tiles_begin(typingctx, cfg):
    """``ldtilecfg``: eight tiles of 16 rows x 64 bytes (``_CONFIG``)."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [_P8]), [builder.bitcast(data, _P8)])
        return context.get_dummy_value()

    return types.void(cfg), codegen


@intrinsic
def _tiles_end(typingctx):
    """``tilerelease``: the tile state back to its initial (unused) state."""
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.tilerelease", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


def _config():
    cfg = np.zeros(64, np.uint8)  # palette 1; bytes per row of tiles 0..7 (u16), then their rows (u8)
    cfg[0] = 1
    cfg[16:32].view(np.uint16)[:] = 64
    cfg[48:56] = 16
    return cfg


_CONFIG = _config()


def _amx_steps(builder, a, panel, bstride, k0, k1, c, keep, halves):
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
        a0 = _at(builder, a, builder.mul(k, _const(BM * BK)))
        b0 = _at(builder, panel, builder.mul(k, _const(1024)))
        for h in range(halves):
            builder.call(load, [tile(4 + h), _at(builder, a0, _const(16 * h * BK)), _const(BK)])
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
def _block_amx(typingctx, a, rows, b, p0, k0, k1, c, keep):
    """``c`` (32 x 32 int32, row-major) = ``a`` (:func:`_pack_rows`'s) times
    panels ``p0, p0 + 1`` over steps ``k0 .. k1``, plus ``c`` where ``keep``
    (its rows from ``rows`` on: undefined): C tiles 0..3, A tiles 4, 5, B
    tiles 6, 7; 16 rows (C tiles 0, 1 and A tile 4) where ``rows <= 16``."""
    def codegen(context, builder, sig, args):
        a, rows, panel, bstride, k0, k1, c, keep = _operands(context, builder, sig, args)
        with builder.if_else(builder.icmp_signed(">", rows, _const(16))) as (two, one):
            for halves, branch in ((2, two), (1, one)):
                with branch:
                    _amx_steps(builder, a, panel, bstride, k0, k1, c, keep, halves)
        return context.get_dummy_value()

    return _signature(a, rows, b, p0, k0, k1, c, keep), codegen


def _make_block_vnni(width, rows_at_once):
    """The block of :func:`_block_amx` by ``vpdpbusd`` on ``width`` int32 lanes
    (16: AVX-512 VNNI, 8: AVX-VNNI): ``rows_at_once`` rows at a time while
    that many are left (``rows_at_once * 32 / width`` accumulators, as many as
    the registers hold beside the panel's ``32 / width`` vectors and a
    broadcast), then one at a time. Reads only rows below ``rows``."""
    vec = ir.VectorType(_I32, width)
    per_row = BN // width  # vectors in a row of the block
    name = f"llvm.x86.avx512.vpdpbusd.{width * 32}"

    def at(builder, c, first, r, v):
        """Where vector ``v`` of block row ``first + r`` lies in ``c``."""
        off = builder.add(builder.mul(builder.add(first, _const(r)), _const(BN * 4)), _const(v * width * 4))
        return builder.bitcast(_at(builder, c, off), vec.as_pointer())

    def rows_from(builder, a, panel, bstride, k0, k1, c, keep, first, count):
        """Block rows ``first .. first + count - 1`` (``count`` a constant)."""
        dot = _fn(builder, name, vec, [vec] * 3)
        accs = [[cgutils.alloca_once(builder, vec) for _ in range(per_row)] for _ in range(count)]
        for r in range(count):
            for v in range(per_row):
                kept = builder.load(at(builder, c, first, r, v), align=1)
                builder.store(builder.select(keep, kept, ir.Constant(vec, None)), accs[r][v])
        with cgutils.for_range_slice(builder, builder.mul(k0, _const(16)), builder.mul(k1, _const(16)),
                                     _const(1)) as (k4, _):
            wv = []
            for v in range(per_row):  # panel v * width // 16, from byte (v * width % 16) * 4 of its row k4
                p = _at(builder, panel, builder.add(builder.mul(bstride, _const(v * width // 16)),
                                                    builder.add(builder.mul(k4, _const(64)),
                                                                _const(v * width % 16 * 4))))
                wv.append(builder.load(builder.bitcast(p, vec.as_pointer()), align=1))
            for r in range(count):
                # a[k4 // 16, first + r, k4 % 16 * 4]
                pa = _at(builder, a, builder.add(builder.mul(builder.lshr(k4, _const(4)), _const(BM * BK)),
                                                 builder.add(builder.mul(builder.add(first, _const(r)), _const(BK)),
                                                             builder.mul(builder.and_(k4, _const(15)), _const(4)))))
                word = builder.load(builder.bitcast(pa, _I32.as_pointer()), align=1)
                av = builder.insert_element(ir.Constant(vec, None), word, ir.Constant(_I32, 0))
                av = builder.shuffle_vector(av, ir.Constant(vec, None), ir.Constant(vec, None))
                for v in range(per_row):
                    builder.store(builder.call(dot, [builder.load(accs[r][v]), av, wv[v]]), accs[r][v])
        for r in range(count):
            for v in range(per_row):
                builder.store(builder.load(accs[r][v]), at(builder, c, first, r, v), align=1)

    @intrinsic
    def block(typingctx, a, rows, b, p0, k0, k1, c, keep):
        def codegen(context, builder, sig, args):
            a, rows, panel, bstride, k0, k1, c, keep = _operands(context, builder, sig, args)
            full = builder.mul(builder.sdiv(rows, _const(rows_at_once)), _const(rows_at_once))
            for begin, end, step in ((_const(0), full, rows_at_once), (full, rows, 1)):
                with cgutils.for_range_slice(builder, begin, end, _const(step)) as (first, _):
                    rows_from(builder, a, panel, bstride, k0, k1, c, keep, first, step)
            return context.get_dummy_value()

        return _signature(a, rows, b, p0, k0, k1, c, keep), codegen

    return block


@njit(inline="always")
def _block_portable(a, rows, b, p0, k0, k1, c, keep):
    """The block of :func:`_block_amx` in plain loops."""
    for r in range(rows):
        for h in range(2):
            brow = b[p0 + h]
            crow = c[r * BN + h * 16:]
            if not keep:
                crow[:16] = 0
            for k4 in range(k0 * 16, k1 * 16):
                a4 = a[k4 // 16, r, k4 % 16 * 4:]
                w = brow[k4 * 64:]
                for j in range(16):
                    s = np.int32(0)
                    for i in range(4):
                        s += np.int32(a4[i]) * np.int32(w[j * 4 + i])
                    crow[j] += s


_block_vnni512, _block_vnni256 = _make_block_vnni(16, 8), _make_block_vnni(8, 2)
_ISAS = ("amx", "avx512vnni", "avxvnni", "portable")


@njit(inline="always")
def _block(isa, a, rows, b, p0, k0, k1, c, keep):
    """The block of instruction set ``isa`` (its index in ``_ISAS``: a closure
    constant of the kernel, so the other branches fold away). The kernels name
    the intrinsics here, as globals: in a kernel's closure, an intrinsic is
    pickled into Numba's cache key with an id of its own each process, and the
    kernel compiled again every time. AMX's blocks of ``SMALL_ROWS`` rows or
    fewer run on AVX-512 VNNI (every CPU with AMX has it): a tile's 16 rows
    cost the same whatever is in them."""
    if isa == 0 and rows > SMALL_ROWS:
        _block_amx(a, rows, b, p0, k0, k1, c, keep)
    elif isa <= 1:
        _block_vnni512(a, rows, b, p0, k0, k1, c, keep)
    elif isa == 2:
        _block_vnni256(a, rows, b, p0, k0, k1, c, keep)
    else:
        _block_portable(a, rows, b, p0, k0, k1, c, keep)


SMALL_ROWS = 8
# column blocks a task, and steps of 64 k a block takes at a time (its C
# tiles stored and loaded again between): 32 rows by 2048 k of a, 64 KB, stay
# in L2 across the task's columns. On one thread of the AMX machine (min of 27
# calls, A/B in one process), 1024^3 and 256x4096x4096 took 0.79x and 0.87x
# the time of GROUP 4, STEPS 8 (0.81-0.83x GROUP 4, STEPS 64 or GROUP 2, STEPS 128)
GROUP = 8
STEPS = 32


@kernel
def pack_rows(a, flip, out, start, stop):
    """``a`` (M, K) uint8 XOR ``flip`` (0, or 0x80: signed codes made unsigned,
    ``a + 128``) as ``out`` (ceil(M / 32), steps, 32, 64): for each block of 32
    rows, each step's 32 rows of 64 k one after the other, zero beyond M and
    K (an A tile of 16 rows is 1 KB in a row, where rows K bytes apart could
    share one set of the L1 cache). Tasks: blocks of rows."""
    mlen, klen = a.shape
    steps, full = out.shape[1], klen // BK
    for mb in range(start, stop):
        for r in range(BM):
            if mb * BM + r >= mlen:
                out[mb, :, r] = 0
                continue
            row = a[mb * BM + r]
            for s in range(full):
                d, src = out[mb, s, r], row[s * BK:]
                for i in range(BK):  # a constant count: one vector
                    d[i] = src[i] ^ flip
            if full < steps:
                d, src = out[mb, full, r], row[full * BK:]
                for i in range(BK):
                    d[i] = src[i] ^ flip if i < klen - full * BK else 0


@njit(inline="always")
def _store(blk, m0, rows, n0, cols, rowsum, c, zw, zo, m, sh, f, lo, hi, out, code, narrow):
    """The epilogue of one block: ``out[m0 + i, n0 + j] = R(blk[i, j] + c[n] -
    zw[n] * rowsum[m])`` for ``i < rows``, ``j < cols`` (``_numba.gemm_epilogue``'s).
    Every array is sliced and indexed from 0 (``_numba._span``: an index from
    ``n0`` keeps Numba checking for wraparound, and the loop from vectorizing)."""
    c, zw, zo, m, sh, f = c[n0:], zw[n0:], zo[n0:], m[n0:], sh[n0:], f[n0:]
    for i in range(rows):
        rs = _row_term(rowsum, m0 + i)
        orow = out[m0 + i, n0:]
        brow = blk[i * BN:]
        for j in range(cols):
            d = np.int64(brow[j]) + c[j] - zw[j] * rs
            orow[j] = _rq(d, zo[j], m[j], sh[j], f[j], lo, hi, code, narrow)


def _make_gemm(isa, code, narrow):
    """The GEMM kernel of instruction set ``isa`` with the epilogue of one
    rounding code (closure constants: their branches fold away, and they are
    in Numba's cache key)."""
    which, amx, wide, source = _ISAS.index(isa), isa == "amx", isa in ("amx", "avx512vnni"), _SOURCE

    @kernel
    def gemm(a, panels, rowsum, c, zw, zo, m, sh, f, lo, hi, cfg, out, start, stop):
        """``out = R(a @ w + c - zw * rowsum)`` on tasks ``start .. stop``, each
        ``GROUP`` blocks of 32 columns by 32 rows (``tasks``): ``a`` the
        activations as :func:`pack_rows` packs them; ``panels``
        :func:`pack`'s; ``rowsum`` (M,) int64 or None; ``c``, ``zw``, ``zo``,
        ``m``, ``sh``, ``f``: (N,) columns; ``out`` (M, N).

        A task's rows of ``a`` are read ``STEPS`` steps at a time, from the
        cache, for each of its ``GROUP`` column blocks in turn; tasks of the same
        columns follow each other, so their weights stay in the cache too."""
        _ = source
        mlen, nlen = out.shape
        steps = a.shape[1]
        chunk = KMAX // BK
        mblocks = (mlen + BM - 1) // BM
        nblocks = (nlen + BN - 1) // BN
        part = np.empty(GROUP * BM * BN, np.int32)
        total = np.empty(GROUP * BM * BN, np.int64)
        part[:] = 0  # K = 0: no step writes it
        if amx:
            _tiles_begin(cfg)
        if wide:
            _wide()
        for t in range(start, stop):
            g, mb = t // mblocks, t % mblocks
            nb0, nb1 = g * GROUP, min(g * GROUP + GROUP, nblocks)
            m0 = mb * BM
            rows = min(BM, mlen - m0)
            rows_of_a = a[mb]
            for k0 in range(0, steps, chunk):  # int32 holds KMAX k at most: longer K adds up in int64
                k1 = min(k0 + chunk, steps)
                for s0 in range(k0, k1, STEPS):
                    s1 = min(s0 + STEPS, k1)
                    for nb in range(nb0, nb1):
                        blk = part[(nb - nb0) * BM * BN:]
                        _block(which, rows_of_a, rows, panels, 2 * nb, s0, s1, blk, np.int64(s0 > k0))
                if steps > chunk:
                    for i in range((nb1 - nb0) * BM * BN):
                        total[i] = part[i] + (total[i] if k0 else 0)
            for nb in range(nb0, nb1):
                n0 = nb * BN
                cols = min(BN, nlen - n0)
                if steps > chunk:
                    _store(total[(nb - nb0) * BM * BN:], m0, rows, n0, cols, rowsum, c, zw, zo, m, sh, f, lo, hi, out,
                           code, narrow)
                else:
                    _store(part[(nb - nb0) * BM * BN:], m0, rows, n0, cols, rowsum, c, zw, zo, m, sh, f, lo, hi, out,
                           code, narrow)
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
    size = int(np.prod(shape))
    buf = getattr(_kept, "buf", None)
    if buf is None or buf.size < size:
        buf = _kept.buf = np.empty(max(size, 1 << 16), np.uint8)
    return buf[:size].reshape(shape)


def run(isa, code, narrow, a, signed, panels, rowsum, columns, lo, hi, out, threads=None):
    """``out = R(a' @ w + c - zw * rowsum)`` (``gemm``'s kernel): ``a`` (M, K)
    8-bit codes, ``a' = a + 128`` where ``signed``, else ``a``; ``panels``
    :func:`pack`'s of ``w``; ``columns`` the (N,) ``c, zw, zo, m, sh, f``;
    ``lo, hi`` the clamp; on the pool's threads, or one (``threads=1``)."""
    (mlen, klen), nlen = a.shape, out.shape[1]
    packed = _scratch((-(-mlen // BM), -(-klen // BK), BM, BK))
    rows = np.ascontiguousarray(a).view(np.uint8)
    flip = np.uint8(0x80 if signed else 0)
    kernel = gemm(isa, code, narrow)
    args = (packed, panels, rowsum, *columns, np.int64(lo), np.int64(hi), _CONFIG, out)
    if threads == 1:
        pack_rows(rows, flip, packed, 0, len(packed))
        kernel(*args, 0, tasks(mlen, nlen))
    else:
        parallel(pack_rows, len(packed), rows, flip, packed, grain=-(-(1 << 18) // (BM * max(klen, 1))))
        parallel(kernel, tasks(mlen, nlen), *args, grain=-(-SMALL_WORK // (BM * BN * GROUP * max(klen, 1))))
    return out
