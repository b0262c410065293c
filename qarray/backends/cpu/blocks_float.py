"""``linear`` on block-format weights packed once, for float activations: the float contract of
:mod:`qarray.ops.block_linear`, bit for bit, at the memory's pace for M = 1.

``PackedFloat`` lays a weight ``(N, K)`` of a format whose value table has at most 16 entries
(NF4, FP4, the int4 / uint4 groups of GPTQ, AWQ and MLX, Q4_0, Q4_1, IQ4_NL, IQ4_XS, MXFP4, NVFP4,
Q4_K, ...) out once as groups of ``ROWS`` = 16 weight rows: for each pair of k (``2 j``, ``2 j +
1``), 16 bytes, byte ``l`` row ``l``'s code at ``2 j`` in its low nibble and at ``2 j + 1`` in its
high one; beside them each sub-block's scale, zero point and offset as float32 ``(groups,
sub-blocks, 16)`` (``BlockFormat.parameters``: the tensor scale, two levels' ``d * sc``, all in).

A call decodes a k's 16 weights once for up to ``RM`` rows of x, in float32 lanes, each
operation rounded as ``BlockFormat.decode`` rounds it (``v = value[code]``; ``v - zero``;
``scale * v`` rounded to the format's precision; ``+ offset`` rounded again; float16's rounding
is the hardware's conversion, IEEE's round to nearest even; bfloat16's the bit trick of
``blocks.rounded``; a NaN kept as it is), widens them to float64 and adds ``x[m, k] * w`` to each
output by a fused multiply-add (the product of two float32 values is exact in float64, so it
rounds as the add alone would), k after k: each output's sum runs in increasing k, its 16
outputs side by side in the lanes, never split. So the bits are those of ``linear_float`` (the
generic decoder and sums), whatever the instruction set or thread count.

- :func:`_make_fdot`: the sums in LLVM IR on 16 lanes (AVX-512's ``vpermps`` looks the codes up;
  on AVX2, two 8-entry ``vpermps`` and a blend), one intrinsic a row count, named as module
  globals (Numba's cache keeps a kernel whose globals they are);
- :func:`_fdot_portable`: the same in plain Numba loops (``blocks.rounded``), for other CPUs.
"""

from __future__ import annotations

import functools
import hashlib
import inspect

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks import PRECISION, _store, rounded
from .gemm import _ISAS
from .isa import best, usable
from .llvm import _SOURCE as _LLVM, _fn, _loadu, _row_of
from .pool import kernel, parallel

ROWS = 16  # weight rows of a group: 16 float32 lanes
RM = 8  # rows of x a call takes, each k's weights decoded once for them
# the helpers the kernels inline from blocks.py (Numba's cache sees this file's timestamp only)
_SOURCE = hashlib.sha256("".join(inspect.getsource(f.py_func) for f in (rounded, _store)).encode()).hexdigest() + _LLVM


def float_packable(fmt, columns=None) -> bool:
    """Whether :class:`PackedFloat` takes ``fmt``: a value table of at most 16 entries (codes of at most
    4 bits), no factor, sub-blocks of an even length, and no act-order ``columns``."""
    return (columns is None and fmt.plan is not None and fmt.values is not None and len(fmt.values) <= 16
            and fmt.fields["q"].bits <= 4 and fmt.factor is None and fmt.sub % 2 == 0 and fmt.block % 2 == 0)


class PackedFloat:
    """A block-format weight ``(N, K)`` packed for float activations (the module's docstring):
    ``codes`` uint8 ``(groups, K // 2, 16)``; ``table`` float32 ``(16,)`` (the value table, zeros
    after it); ``s``, ``z``, ``o`` float32 ``(groups, K // sub, 16)`` (``z``, ``o`` ``(1, 1, 16)``
    zeros where the format has no zero point / offset); ``variant``: the precision (0 float32, 1
    float16, 2 bfloat16) | has_zero << 2 | has_offset << 3."""

    __slots__ = ("n", "k", "sub", "codes", "table", "s", "z", "o", "variant")

    def __init__(self, raw, fmt, g=None):
        blocks = np.ascontiguousarray(raw).reshape(-1, fmt.nbytes)
        self.n, self.k = raw.shape[0], raw.shape[1] // fmt.nbytes * fmt.block
        n, k = self.n, self.k
        self.sub = fmt.sub
        groups = -(-n // ROWS)
        rows = np.zeros((groups * ROWS, k), np.uint8)
        rows[:n] = fmt.fields["q"].unpack(blocks).reshape(n, k)
        r = rows.reshape(groups, ROWS, k // 2, 2)
        self.codes = np.ascontiguousarray(((r[..., 0] & 15) | (r[..., 1] & 15) << 4).transpose(0, 2, 1))
        self.table = np.zeros(16, np.float32)
        self.table[:len(fmt.values)] = fmt.values
        s, o, z = fmt.parameters(blocks, g)

        def side(p):  # (n * blocks, subs) -> (groups, K // sub, ROWS)
            full = np.zeros((groups * ROWS, k // fmt.sub), np.float32)
            full[:n] = p.reshape(n, -1)
            return np.ascontiguousarray(full.reshape(groups, ROWS, -1).transpose(0, 2, 1))

        dummy = np.zeros((1, 1, ROWS), np.float32)
        self.s = side(s)
        self.z = dummy if z is None else side(z)
        self.o = dummy if o is None else side(o)
        self.variant = PRECISION[fmt.precision] | (z is not None) << 2 | (o is not None) << 3


# -- the sums in LLVM IR -------------------------------------------------------------------------------

_F32X16, _F64X16 = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.DoubleType(), 16)
_I32X16, _I8X16 = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.IntType(8), 16)


def _make_fdot(width, count):
    """The float contract for rows ``m0 .. m0 + count`` of ``x`` (float64 ``(M, K)``) against one group:
    ``acc[r, 0:16]`` = the float64 sums, k in increasing order, of ``x[m0 + r, k] * w[l, k]``, ``w``
    decoded from the group's ``codes`` (``(K // 2, 16)``), ``table``, and its sub-blocks' ``s``, ``z``,
    ``o`` (``(K // sub, 16)``; ``sub2``: k pairs a sub-block); ``variant``: ``PackedFloat.variant``,
    each of the 12 a loop of its own (no test in the loop). ``width``: 16 (AVX-512: ``vpermps`` on
    16 lanes) or 8 (AVX2: two 8-entry ``vpermps``, blended on the code's bit 3). The float32 decode
    is LLVM's plain operations, unfused, each rounded as ``BlockFormat.decode`` rounds; the float64
    sums are ``llvm.fma`` (exact products: the add's rounding)."""
    i8, i32, i64, f64 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.DoubleType()
    p8 = i8.as_pointer()

    def const(v):
        return ir.Constant(i64, v)

    def splat(builder, v, vtype):
        v = builder.insert_element(ir.Constant(vtype, None), v, ir.Constant(i32, 0))
        return builder.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(_I32X16, [0] * 16))

    def lookup(builder, table, c):
        if width == 16:
            perm = _fn(builder, "llvm.x86.avx512.permvar.sf.512", _F32X16, [_F32X16, _I32X16])
            return builder.call(perm, [table, c])
        f8, i8x8 = ir.VectorType(ir.FloatType(), 8), ir.VectorType(i32, 8)
        perm = _fn(builder, "llvm.x86.avx2.permps", f8, [f8, i8x8])
        lo_t = builder.shuffle_vector(table, table, ir.Constant(i8x8, list(range(8))))
        hi_t = builder.shuffle_vector(table, table, ir.Constant(i8x8, list(range(8, 16))))
        halves = []
        for h in range(2):
            ch = builder.shuffle_vector(c, c, ir.Constant(i8x8, list(range(8 * h, 8 * h + 8))))
            top = builder.icmp_unsigned("!=", builder.and_(ch, ir.Constant(i8x8, [8] * 8)), ir.Constant(i8x8, [0] * 8))
            halves.append(builder.select(top, builder.call(perm, [hi_t, ch]), builder.call(perm, [lo_t, ch])))
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_I32X16, list(range(16))))

    def round_to(builder, t, precision):
        if precision == 0:
            return t
        if precision == 1:  # IEEE's float16, to nearest even (vcvtps2ph), back to float32. A NaN comes back
            # as it went (its payload's low 13 bits are 0 in every NaN here: a float16 scale's, offset's,
            # or the default NaN of inf * 0), so no select keeps it: 30% of the decode's vector operations
            return builder.fpext(builder.fptrunc(t, ir.VectorType(ir.HalfType(), 16)), _F32X16)
        u = builder.bitcast(t, _I32X16)  # bfloat16: blocks.rounded's bits
        odd = builder.and_(builder.lshr(u, ir.Constant(_I32X16, [16] * 16)), ir.Constant(_I32X16, [1] * 16))
        u = builder.add(builder.add(u, ir.Constant(_I32X16, [0x7FFF] * 16)), odd)
        r = builder.bitcast(builder.and_(u, ir.Constant(_I32X16, [-0x10000] * 16)), _F32X16)
        return builder.select(builder.fcmp_unordered("uno", t, t), t, r)  # a NaN as it is

    @intrinsic
    def fdot(typingctx, codes, table, s, z, o, x, m0, variant, sub2, acc):
        def codegen(context, builder, sig, args):
            arr = {i: context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 5, 9)}
            m0, variant, sub2 = args[6], args[7], args[8]

            row = lambda i, index: _row_of(builder, arr[i], index)  # noqa: E731  (bytes of row index of array i)
            load = functools.partial(_loadu, builder)

            pairs = builder.extract_value(arr[0].shape, 0)
            tab = load(builder.bitcast(arr[1].data, p8), _F32X16)
            xrows = [builder.bitcast(row(5, builder.add(m0, const(r))), f64.as_pointer()) for r in range(count)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_F64X16, [0.0] * 16)) for _ in range(count)]
            fma = _fn(builder, "llvm.fma.v16f64", _F64X16, [_F64X16] * 3)
            codes = builder.bitcast(arr[0].data, p8)
            for v in range(12):
                precision, has_zero, has_offset = v & 3, v >> 2 & 1, v >> 3 & 1
                if precision == 3:
                    continue
                with builder.if_then(builder.icmp_signed("==", variant, const(v))):
                    with cgutils.for_range(builder, builder.udiv(pairs, sub2)) as sb:
                        sv = load(row(2, sb.index), _F32X16)
                        zv = load(row(3, sb.index), _F32X16) if has_zero else None
                        ov = load(row(4, sb.index), _F32X16) if has_offset else None
                        with cgutils.for_range(builder, sub2) as inner:
                            j = builder.add(builder.mul(sb.index, sub2), inner.index)
                            idx = builder.zext(load(builder.gep(codes, [builder.mul(j, const(16))]), _I8X16), _I32X16)
                            for h in range(2):
                                c = idx if h == 0 else builder.lshr(idx, ir.Constant(_I32X16, [4] * 16))
                                c = builder.and_(c, ir.Constant(_I32X16, [15] * 16))
                                w = lookup(builder, tab, c)
                                if has_zero:
                                    w = builder.fsub(w, zv)
                                w = round_to(builder, builder.fmul(sv, w), precision)
                                if has_offset:
                                    w = round_to(builder, builder.fadd(w, ov), precision)
                                wd = builder.fpext(w, _F64X16)
                                k = builder.add(builder.mul(j, const(2)), const(h))
                                for r in range(count):
                                    xv = splat(builder, builder.load(builder.gep(xrows[r], [k])), _F64X16)
                                    builder.store(builder.call(fma, [xv, wd, builder.load(accs[r])]), accs[r])
            for r in range(count):
                builder.store(builder.load(accs[r]), builder.bitcast(row(9, const(r)), _F64X16.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(codes, table, s, z, o, x, m0, variant, sub2, acc), codegen

    return fdot


# [width 16, 8] for one row of x, then for RM rows
(_f16, _f8), (_f16m, _f8m) = ([_make_fdot(w, count) for w in (16, 8)] for count in (1, RM))


@njit(inline="always")
def _fdot_portable(codes, table, s, z, o, x, m0, count, variant, sub2, acc):
    """:func:`_make_fdot`'s sums in plain loops (``blocks.rounded`` for the precisions)."""
    precision, has_zero, has_offset = variant & 3, variant & 4, variant & 8
    w = np.empty(ROWS, np.float32)
    acc[:count] = 0
    for j in range(codes.shape[0]):
        line = codes[j]
        sb = j // sub2
        for h in range(2):
            for l in range(ROWS):
                v = table[(np.int32(line[l]) >> (4 * h)) & 15]
                if has_zero:
                    v = v - z[sb, l]
                t = rounded(s[sb, l] * v, precision)
                if has_offset:
                    t = rounded(t + o[sb, l], precision)
                w[l] = t
            k = 2 * j + h
            for r in range(count):
                xv, a = x[m0 + r, k], acc[r]
                for l in range(ROWS):
                    a[l] += xv * np.float64(w[l])


@njit(inline="always")
def _fdot(isa, codes, table, s, z, o, x, m0, count, variant, sub2, acc):
    """The sums of instruction set ``isa`` (an index into ``gemm._ISAS``: AMX and AVX-512 VNNI take the
    16-lane IR, AVX-VNNI and AVX2 the 8-lane one, portable the loops) for rows ``m0 .. m0 + count``
    (``count`` 1 or ``RM``)."""
    if isa == 3:
        _fdot_portable(codes, table, s, z, o, x, m0, count, variant, sub2, acc)
    elif isa <= 1 and count == 1:
        _f16(codes, table, s, z, o, x, m0, variant, sub2, acc)
    elif isa <= 1:
        _f16m(codes, table, s, z, o, x, m0, variant, sub2, acc)
    elif count == 1:
        _f8(codes, table, s, z, o, x, m0, variant, sub2, acc)
    else:
        _f8m(codes, table, s, z, o, x, m0, variant, sub2, acc)


def _make_kernel(isa):
    which = _ISAS.index(isa)
    source = _SOURCE

    @kernel
    def linear_float_packed(x, codes, table, s, z, o, variant, sub2, bias, has_bias, out, start, stop):
        """The float contract on groups ``start .. stop`` of :class:`PackedFloat`'s weights: ``x`` float64
        ``(M, K)``, ``bias`` float64 ``(N,)``, ``out`` float32 ``(M, N)``."""
        _ = source  # in the cache key: a changed blocks.rounded / _store or llvm.py recompiles
        m_len = x.shape[0]
        n_len = out.shape[1]
        acc = np.empty((RM, ROWS), np.float64)
        for g in range(start, stop):
            n0 = g * ROWS
            zg, og = z[g if variant & 4 else 0], o[g if variant & 8 else 0]
            for m0 in range(0, m_len, RM):
                count = RM if m_len - m0 >= RM else 1
                for m1 in range(m0, min(m0 + RM, m_len), count):
                    _fdot(which, codes[g], table, s[g], zg, og, x, m1, count, variant, sub2, acc)
                    _store(acc[:count], bias, has_bias, out[m1:m1 + count], n0, min(ROWS, n_len - n0))

    return linear_float_packed


_kernel = functools.cache(_make_kernel)


def linear_float_packed(x, w: PackedFloat, bias, out, isa=None, threads=None):
    """``out`` (M, N) = the float contract of float64 rows ``x`` (M, K) against packed ``w`` (``bias``
    float64 (N,) or None), on instruction set ``isa`` (``isa.usable``'s; the best by default), on the
    pool's threads or one."""
    isa = best() if isa is None else isa
    ok, why = usable(isa)
    if not ok:
        raise ValueError(f"block-format linear cannot run on {isa} here: {why}")
    x = np.ascontiguousarray(x, np.float64)
    args = (x, w.codes, w.table, w.s, w.z, w.o, np.int64(w.variant), np.int64(w.sub // 2),
            np.zeros(1) if bias is None else bias, bias is not None, out)
    groups = w.codes.shape[0]
    kernel_ = _kernel(isa)
    if threads == 1:
        kernel_(*args, 0, groups)
    else:
        parallel(kernel_, groups, *args, grain=max(1, (1 << 18) // (ROWS * w.k * (x.shape[0] + 4))))
    return out
