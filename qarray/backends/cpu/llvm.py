"""LLVM IR for what Numba's loops cannot emit: they have no vector types, store
hints, byte permutes or dot-product instructions. Only that is written here;
the arithmetic around it stays in Numba, in the kernel modules.

Each helper runs only where :mod:`.isa` says the CPU has it, and each has a
portable twin in plain Numba that gives the same results:

=====================================  ===================  ==============================================
helper                                 gate (``isa``)       portable twin
=====================================  ===================  ==============================================
:func:`_wide` (512-bit vectors)        none needed          ignored by LLVM on other targets
:func:`_store_line`, :func:`_fence`    ``sse2`` (x86-64)    ``quantize.quantize`` / ``requantize.requantize``
:func:`_quantize_line`,                ``avx512bw``         ``quantize.quantize`` / ``quantize_lines``' sse2 kernel
:func:`_stream_line`
:func:`_lookup_sum`,                   ``avx512vbmi``       ``softmax._row_sum`` / ``_lookup_row``'s loops
:func:`_lookup_store`
:func:`_make_dot` (packed 4-bit)       ``avx512vnni``       the int8 GEMM on unpacked codes
:func:`_pause` (the pool's polls)      x86-64               none: an empty loop
=====================================  ===================  ==============================================

The int8 GEMM's blocks (AMX tiles, VNNI rows) are written in ``gemm``, beside
the panel layout they read.

:func:`_int32` (int32 arithmetic that wraps, as Numba's widening to int64
does not) is plain IR for every target: it needs no gate and no twin.
"""

from __future__ import annotations

import math
import platform
import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .pool import source


def _fn(builder, name, ret, args):
    """The LLVM function (an intrinsic) ``name``, declared in ``builder``'s module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def _wide(typingctx):
    """Let LLVM vectorize the calling kernel's loops 512 bits wide (AVX-512;
    none elsewhere): it stops at 256 on Intel's server cores by default
    (``prefer-256-bit``). quantize's loop on 16 lanes a step: 1.45x the speed
    on 8 (2^16 float32 -> qint8 in L2, Emerald Rapids)."""
    def codegen(context, builder, sig, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')  # llvmlite knows no such name
        return context.get_dummy_value()

    return types.void(), codegen


def _int32(op):
    """``a op b`` (``add``, ``sub``, ``mul``) for int32 ``a``, ``b``, wrapping in
    int32: Numba widens int32 arithmetic to int64, and LLVM then vectorized it
    8 lanes a vector (``vpmullq``) instead of 16."""
    @intrinsic
    def f(typingctx, a, b):
        if a == b == types.int32:
            return types.int32(a, b), lambda context, builder, sig, args: getattr(builder, op)(*args)
        return None

    return f


_add32, _sub32, _mul32 = _int32("add"), _int32("sub"), _int32("mul")

_V64 = ir.VectorType(ir.IntType(8), 64)
_V8Q = ir.VectorType(ir.IntType(64), 8)
_V16 = ir.VectorType(ir.IntType(32), 16)


def _splat(builder, value, vtype):
    """``value`` in every lane of a ``vtype``."""
    v = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vtype, None),
                                  ir.Constant(ir.VectorType(ir.IntType(32), vtype.count), None))


def _row_of(builder, array, index):
    """The bytes of row ``index`` of a 2-D array (``context.make_array``'s struct), by its stride."""
    return builder.gep(builder.bitcast(array.data, ir.IntType(8).as_pointer()),
                       [builder.mul(index, builder.extract_value(array.strides, 0))])


def _loadu(builder, ptr, vtype):
    """A ``vtype`` loaded from ``ptr`` (any pointer), unaligned."""
    return builder.load(builder.bitcast(ptr, vtype.as_pointer()), align=1)


# -- streamed stores: quantize.quantize_lines, requantize.requantize_stream -------------------
@intrinsic
def _store_line(typingctx, out, offset, line, at):
    """``out[offset:offset + 64] = line[at:at + 64]`` (64 bytes) by a non-temporal
    store: ``out`` 8-bit, ``offset`` at a 64-byte boundary. The caller fences
    (``_fence``) before another thread reads ``out``."""
    def codegen(context, builder, sig, args):
        src = builder.gep(context.make_array(sig.args[2])(context, builder, args[2]).data, [args[3]])
        dst = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        value = builder.load(builder.bitcast(src, _V64.as_pointer()), align=1)
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        builder.store(value, builder.bitcast(dst, _V64.as_pointer()), align=64).set_metadata("nontemporal", hint)
        return context.get_dummy_value()

    return types.void(out, offset, line, at), codegen


_F16 = ir.VectorType(ir.FloatType(), 16)
_W32 = ir.VectorType(ir.IntType(16), 32)
# the dwords of two rounds of packs (``vpackssdw``, ``vpacksswb``: per 128-bit lane, four of each
# source's values in turn) put back in the order of their sources: dword 4m + k from 4k + m
_UNPACK = ir.Constant(ir.VectorType(ir.IntType(32), 16), [4 * (d % 4) + d // 4 for d in range(16)])


def _make_quantize_line(nontemporal):
    """The 8-bit codes of the 64 float32 values ``x[j:j + 64]``, ``quantize._q_mul``'s,
    stored at ``out[at:at + 64]`` (with ``nontemporal``: at a 64-byte boundary,
    by a non-temporal store), unless a value flags; returns whether one did
    (then nothing is stored).
    ``vcvtps2dq`` rounds each ``v * rl`` and ``v * rh`` to an integer, to nearest,
    ties to even, as ``rint``; it gives ``-2**31`` for NaN and beyond the int32
    range, which flags, as do two roundings that differ. The rest is exact on
    what did not flag: ``n = rint(v * rl)`` saturated to int16, plus ``z``
    (int32 ``z``, ``lo``, ``hi`` within int16; saturating), clamped to ``[lo,
    hi]``, is ``clamp(n + z, lo, hi)`` (n + z past either bound stays past it),
    and packing to ``out``'s bytes (signed or unsigned saturation, by its
    dtype) is exact inside ``[lo, hi]``. Per 16 values this is 10 vector
    instructions where the portable loop took 15 (two ``vrndscaleps`` of two
    each, the clamp in float32, ``vpmovdb``)."""

    @intrinsic
    def _quantize_line(typingctx, x, j, rl, rh, z, lo, hi, out, at):
        def codegen(context, builder, sig, args):
            i16, i32 = ir.IntType(16), ir.IntType(32)
            v16 = _V16
            xp = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
            xp = builder.bitcast(xp, _F16.as_pointer())
            cvt = _fn(builder, "llvm.x86.avx512.mask.cvtps2dq.512", v16, [_F16, v16, i16, i32])
            r = [_splat(builder, args[k], _F16) for k in (2, 3)]
            ones, nearest = ir.Constant(i16, -1), ir.Constant(i32, 8)  # {rn-sae}: whatever MXCSR says
            diff, low, n = ir.Constant(v16, None), ir.Constant(v16, [2 ** 31 - 1] * 16), []
            smin32 = _fn(builder, "llvm.smin.v16i32", v16, [v16, v16])
            for q in range(4):
                v = builder.load(builder.gep(xp, [ir.Constant(i32, q)]), align=4)
                na, nb = (builder.call(cvt, [builder.fmul(v, rk), ir.Constant(v16, None), ones, nearest]) for rk in r)
                diff, low = builder.or_(diff, builder.xor(na, nb)), builder.call(smin32, [low, na])
                n.append(na)
            flag = builder.or_(builder.icmp_signed("!=", diff, ir.Constant(v16, None)),
                               builder.icmp_signed("==", low, ir.Constant(v16, [-2 ** 31] * 16)))
            flag = builder.icmp_unsigned("!=", builder.bitcast(flag, i16), ir.Constant(i16, 0))
            with builder.if_then(builder.not_(flag), likely=True):
                pack = _fn(builder, "llvm.x86.avx512.packssdw.512", _W32, [v16, v16])
                bounds = [_splat(builder, builder.trunc(args[k], i16), _W32) for k in (4, 5, 6)]
                words = []
                for a, b in ((n[0], n[1]), (n[2], n[3])):
                    w = builder.call(_fn(builder, "llvm.sadd.sat.v32i16", _W32, [_W32, _W32]),
                                     [builder.call(pack, [a, b]), bounds[0]])
                    w = builder.call(_fn(builder, "llvm.smax.v32i16", _W32, [_W32, _W32]), [w, bounds[1]])
                    words.append(builder.call(_fn(builder, "llvm.smin.v32i16", _W32, [_W32, _W32]), [w, bounds[2]]))
                name = "packsswb" if sig.args[7].dtype.signed else "packuswb"
                codes = builder.call(_fn(builder, f"llvm.x86.avx512.{name}.512", _V64, [_W32, _W32]), words)
                codes = builder.shuffle_vector(builder.bitcast(codes, v16), ir.Constant(v16, None), _UNPACK)
                dst = builder.gep(context.make_array(sig.args[7])(context, builder, args[7]).data, [args[8]])
                store = builder.store(codes, builder.bitcast(dst, v16.as_pointer()), align=64 if nontemporal else 1)
                if nontemporal:
                    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(i32, 1)]))
            return flag

        return types.boolean(x, j, rl, rh, z, lo, hi, out, at), codegen

    return _quantize_line


# the codes stored through the cache, and non-temporally (the streamed quantize); two names, not a
# dict a kernel's closure holds: Numba's cache keys a closure by its values, which an intrinsic
# has no stable form of (a kernel compiled again in every process)
_quantize_line, _stream_line = _make_quantize_line(False), _make_quantize_line(True)


def _call(name):
    """An intrinsic ``f()`` that calls LLVM's ``void name()``."""
    @intrinsic
    def f(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(_fn(builder, name, ir.VoidType(), []), [])
            return context.get_dummy_value()

        return types.void(), codegen

    return f


@intrinsic
def _tiles_begin(typingctx, cfg):
    """``ldtilecfg``: the AMX tiles as the 64 bytes of ``cfg`` say (palette 1: each tile's bytes a row,
    then its rows; ``gemm._CONFIG``, ``blocks._AMX_CONFIG``)."""
    def codegen(context, builder, sig, args):
        p8 = ir.IntType(8).as_pointer()
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [p8]), [builder.bitcast(data, p8)])
        return context.get_dummy_value()

    return types.void(cfg), codegen


_tiles_end = _call("llvm.x86.tilerelease")  # the tile state back to its initial (unused) state


# -- the thread pool's polls (pool.parallel): a thread waits for a call, or for the others, without
# the GIL and without sleeping --------------------------------------------------------------------
@intrinsic
def _load_acquire(typingctx, a, i):
    """``a[i]`` (int64) by an atomic load, acquire order: read from memory at
    every poll (LLVM may hoist a plain load out of the loop), and what the
    writer stored before it is visible after it."""
    def codegen(context, builder, sig, args):
        ptr = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(a, i), codegen


@intrinsic
def _store_release(typingctx, a, i, v):
    """``a[i] = v`` (int64) by an atomic store, release order: what this thread
    stored before it (a kernel's results) is visible to a thread that reads it
    by :func:`_load_acquire`."""
    def codegen(context, builder, sig, args):
        ptr = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(a, i, v), codegen


@njit(nogil=True, cache=True)
def _publish(a, i, v):
    """``a[i] = v`` for :func:`_poll_change` and :func:`_poll_all` to see, after this thread's stores."""
    _store_release(a, i, v)


# ``pause``: a spinning core yields its pipeline (and its sibling hyperthread) between polls
_pause = _call("llvm.x86.sse2.pause") if platform.machine().lower() in ("x86_64", "amd64") else njit(lambda: None)


@njit(nogil=True, cache=True)
def _poll_change(state, seen, polls):
    """``state[0]`` once it is no longer ``seen``, or after ``polls`` polls."""
    for _ in range(polls):
        g = _load_acquire(state, 0)
        if g != seen:
            return g
        _pause()
    return _load_acquire(state, 0)


@njit(nogil=True, cache=True)
def _poll_all(done, g, polls):
    """Whether every ``done[i]`` reached ``g`` within ``polls`` polls."""
    for _ in range(polls):
        left = 0
        for i in range(done.size):
            left += _load_acquire(done, i) != g
        if left == 0:
            return True
        _pause()
    return False


@njit(inline="always")
def _aligned(a, n):
    """``n`` items of 1-d ``a`` from its first 64-byte boundary (``a`` 64 bytes longer): tile rows, and
    vectors, that never straddle two cache lines."""
    off = ((-a.ctypes.data) & 63) // a.itemsize
    return a[off:off + n]


def aligned_zeros(shape, dtype):
    """Zeros, C-contiguous at a 64-byte boundary (NumPy's large buffers start 16 bytes past a page)."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    buf = np.zeros(size + 64, np.uint8)
    return buf[-buf.ctypes.data % 64:][:size].view(dtype).reshape(shape)


def aligned_copy(a):
    """``a`` C-contiguous at a 64-byte boundary."""
    out = aligned_zeros(a.shape, a.dtype)
    out[...] = a
    return out


# sfence: the non-temporal stores before it are visible before any store after it
_fence = _call("llvm.x86.sse.sfence")


# -- VBMI: softmax's byte lookups ----------------------------------------------------------------
# Rows of 8-bit codes, where the CPU has AVX-512 VBMI (``planes`` not None:
# ``NumpyBackend.softmax``): 64 table lookups at a time by byte permutes (LLVM
# gathers a byte at a time from a loop of loads). A 256-entry byte table is
# four 64-byte registers: ``vpermi2b`` looks up 128 entries by an index's low
# 7 bits, two of them and its top bit select.
def _row_bytes(context, builder, ty, arg, r):
    """Row ``r`` of a 2-D C-contiguous byte array as a ``<64 x i8>*``."""
    a = context.make_array(ty)(context, builder, arg)
    row = builder.gep(a.data, [builder.mul(r, builder.extract_value(a.strides, 0))])
    return builder.bitcast(row, _V64.as_pointer())


def _lookup(builder, table, index):
    """``table[index]`` for 64 byte indices, ``table`` four ``<64 x i8>``."""
    permute = _fn(builder, "llvm.x86.avx512.vpermi2var.qi.512", _V64, [_V64] * 3)
    low = builder.call(permute, [table[0], index, table[1]])
    high = builder.call(permute, [table[2], index, table[3]])
    return builder.select(builder.icmp_signed("<", index, ir.Constant(_V64, None)), high, low)


def _table(context, builder, ty, arg, offset=0):
    """256 bytes of 1-D array ``arg`` from ``offset``, as four ``<64 x i8>``."""
    p = builder.bitcast(context.make_array(ty)(context, builder, arg).data, _V64.as_pointer())
    return [builder.load(builder.gep(p, [ir.Constant(ir.IntType(64), offset + q)]), align=1) for q in range(4)]


@intrinsic
def _lookup_sum(typingctx, x, r, m, planes, chunks):
    """``sum_i T[m - x[r, i]]`` over ``i < 64 * chunks``, exactly, from ``T``'s four
    byte planes (``planes``, flat ``(4 * 256,)`` uint8: ``T < 2**32``): each
    plane's looked-up bytes summed by ``vpsadbw`` into int64 lanes."""
    def codegen(context, builder, sig, args):
        row = _row_bytes(context, builder, sig.args[0], args[0], args[1])
        mv = _splat(builder, builder.trunc(args[2], ir.IntType(8)), _V64)
        tables = [_table(context, builder, sig.args[3], args[3], 4 * p) for p in range(4)]
        sad = _fn(builder, "llvm.x86.avx512.psad.bw.512", _V8Q, [_V64, _V64])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8Q, None)) for _ in range(4)]
        with cgutils.for_range(builder, args[4]) as loop:
            index = builder.sub(mv, builder.load(builder.gep(row, [loop.index]), align=1))
            for acc, t in zip(accs, tables):
                part = builder.call(sad, [_lookup(builder, t, index), ir.Constant(_V64, None)])
                builder.store(builder.add(builder.load(acc), part), acc)
        reduce = _fn(builder, "llvm.vector.reduce.add.v8i64", ir.IntType(64), [_V8Q])
        total = ir.Constant(ir.IntType(64), 0)
        for p, acc in enumerate(accs):
            total = builder.add(total, builder.shl(builder.call(reduce, [builder.load(acc)]),
                                                   ir.Constant(ir.IntType(64), 8 * p)))
        return total

    return types.int64(x, r, m, planes, chunks), codegen


@intrinsic
def _lookup_store(typingctx, x, r, m, otab, out, chunks):
    """``out[r, i] = otab[m - x[r, i]]`` for ``i < 64 * chunks`` (``otab``: 256
    bytes, ``out`` 8-bit)."""
    def codegen(context, builder, sig, args):
        row = _row_bytes(context, builder, sig.args[0], args[0], args[1])
        dst = _row_bytes(context, builder, sig.args[4], args[4], args[1])
        mv = _splat(builder, builder.trunc(args[2], ir.IntType(8)), _V64)
        table = _table(context, builder, sig.args[3], args[3])
        with cgutils.for_range(builder, args[5]) as loop:
            index = builder.sub(mv, builder.load(builder.gep(row, [loop.index]), align=1))
            builder.store(_lookup(builder, table, index), builder.gep(dst, [loop.index]), align=1)
        return context.get_dummy_value()

    return types.void(x, r, m, otab, out, chunks), codegen


# -- VNNI: gemm.gemm_packed4's dot products on packed 4-bit weights ----------------------------
# LLVM does not turn a plain int8 dot-product loop into ``vpdpbusd`` (u8 x s8,
# four products summed into int32 lanes, never saturating).


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
            vnni = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V16, [_V16] * 3)
            total = _fn(builder, "llvm.vector.reduce.add.v16i32", ir.IntType(32), [_V16])
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


_SOURCE = source(sys.modules[__name__])  # in the closures of the kernels that inline these
