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

import functools
import hashlib
import inspect

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .gemm import _ISAS
from .isa import best, usable
from .llvm import _SOURCE as _LLVM, _aligned, _fn, _loadu, _row_of, _splat, _tiles_begin, _tiles_end, _wide, aligned_copy
from .pool import kernel, parallel
from .quantize import block_codes, block_values

# the calls the kernels take (NumpyBackend's @_fast_path): any with rows of x and of w
ACCEPTS = {"block_linear": lambda x, raw, *args, **kwargs: x.shape[0] > 0 and raw.shape[0] > 0,
           "block_linear_q8": lambda xraw, raw, fmt, bias=None, packed=None, act="Q8_0":
               xraw.shape[0] > 0 and raw.shape[0] > 0 and (act == "Q8_0" or packed is not None or packable(fmt))}

LANES = 64  # weight rows a task: the sums of 8 512-bit vectors (16 256-bit ones), enough independent
# chains of adds to hide their latency (8 lanes ran 3.5x slower: each lane one add a k, in order)
KC = 128  # k a pass over the rows of x: the rows' chunk, side by side (KC, LANES), 32 KB, stays in L1
PRECISION = {"float32": 0, "float16": 1, "bfloat16": 2}


@intrinsic
def _bits(typingctx, y):
    """float32 ``y``'s bits, as an int32."""
    return types.int32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(32))


@intrinsic
def _float(typingctx, u):
    """int32 ``u``'s bits, as a float32."""
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@intrinsic
def _half(typingctx, v):
    """float32 ``v`` rounded to float16 (to nearest even, as NumPy's ``astype``), its bits as a uint16."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _magnitude32(typingctx, bits, b):
    """The largest ``bits[b, j] & 0x7FFFFFFF`` of row ``b`` of int32 ``bits`` (32 a row: Q8_0's blocks),
    as one vector reduction: Numba's loop, unrolled, was a chain of 32 scalar compares (2 cycles a
    value: 128 x 256 activations to Q8_0 in 22.7 us, now 9.3). Q8_K's 256 a row vectorize as a loop."""
    vtype = ir.VectorType(ir.IntType(32), 32)

    def codegen(context, builder, sig, args):
        row = _loadu(builder, _row_of(builder, context.make_array(sig.args[0])(context, builder, args[0]), args[1]),
                     vtype)
        row = builder.and_(row, ir.Constant(vtype, [0x7FFFFFFF] * 32))
        return builder.call(_fn(builder, "llvm.vector.reduce.umax.v32i32", vtype.element, [vtype]), [row])

    return types.int32(bits, b), codegen


@intrinsic
def _f64(typingctx, v):
    """A packed scale as float64: a float32's value, or a float16's from its bits (uint16: ``_compact``)."""
    def codegen(context, builder, sig, args):
        x = builder.bitcast(args[0], ir.HalfType()) if sig.args[0] == types.uint16 else args[0]
        return builder.fpext(x, ir.DoubleType())

    return types.float64(v), codegen


def _scales(builder, ptr, dtype):
    """16 packed scales at ``ptr`` as float64 lanes: float32 ones, or float16 ones kept as their bits
    (``dtype`` uint16, the array's: ``_compact``)."""
    half = dtype == types.uint16
    return builder.fpext(_loadu(builder, ptr, ir.VectorType(ir.HalfType() if half else ir.FloatType(), 16)),
                         ir.VectorType(ir.DoubleType(), 16))


def _compact(p):
    """Packed scales ``p`` (float32) as float16 bits (uint16) where each is a float16 exactly (Q4_0's and
    Q8_0's ``d``, GPTQ's scales...): fewer bytes for M = 1 to read (Q8_0: 1.125 -> 1.0625 a weight, as
    ggml's); else ``p``."""
    with np.errstate(over="ignore"):  # (beyond float16's range: kept as float32)
        h = p.astype(np.float16)
    return h.view(np.uint16) if (h.astype(np.float32).view(np.int32) == p.view(np.int32)).all() else p


@njit(inline="always")
def rounded(y, precision):
    """float32 ``y`` rounded to float16 (``precision`` 1) or bfloat16 (2), to nearest even, as
    float32 (``qarray._blocks.rounded``); 0: ``y``. NaN stays as it is: float16 -> float32 would clear
    its payload's low 13 bits, which are already 0 in every NaN a decoder meets (a float16 scale's, or
    IEEE's default NaN). On the bits of ``|y|``: the dropped mantissa bits (16 for bfloat16, 13 for
    float16's normals) rounded away to nearest even, a carry moving into the exponent (to inf past the
    largest value); float16's subnormals, below 2^-14, are multiples of 2^-24: ``rint(|y| * 2^24)``."""
    y = np.float32(y)
    if precision == 0 or y != y:
        return y
    u = _bits(y)
    a = np.int64(u) & 0x7FFFFFFF
    if a >= 0x7F800000:  # inf
        return y
    if precision == 2:
        a = (a + 0x7FFF + ((a >> 16) & 1)) & 0x7FFF0000
    elif a < 0x38800000:  # |y| < 2^-14
        a = np.int64(_bits(np.float32(np.rint(abs(y) * np.float32(2.0**24)) * np.float32(2.0**-24))))
    else:
        a = (a + 0x0FFF + ((a >> 13) & 1)) & 0x7FFFE000
        if a > 0x477FE000:  # past 65504
            a = 0x7F800000
    return _float(np.int32(a | (np.int64(u) & -0x80000000)))


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
                          ).hexdigest() + _LLVM  # (and llvm.py's intrinsics, which the packed kernels inline)
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


# -- Q8_0 activations against packed weights: VNNI dots on 16 weight rows side by side ---------------
#
# ``pack_q8`` lays a weight's integer values out once as groups of ``ROWS`` rows: each row's values
# made unsigned, ``u = value - vmin`` (``vmin`` the format's smallest value), 4 consecutive k of the
# 16 rows in one 64-byte line: byte ``4 l + b`` of line ``j`` is row ``l``'s ``u`` at ``k = 4 j +
# b``, the operand of one ``vpdpbusd`` against 4 bytes of ``x`` broadcast. Formats of 16 codes or
# fewer keep their codes, two to a byte (line ``j``: ``k = 8 j + b`` in the low nibbles, ``8 j + 4 +
# b`` in the high ones), and a table ``lut[code] = u``, applied by ``vpshufb``; formats of up to 64
# codes with ``u = code`` (Q5_*, Q6_K) keep the low 4 bits so and bits 4 and 5 in a plane of their own
# (6 bits a code, where a byte takes 8: M = 1 reads the weights once, at the memory's speed). Per piece of ``P`` k,
# ``isum = sum(u * qx) + shift * xsum`` with ``shift = vmin - zero``: ``sum(qx * (value - zero))``
# exactly, the contract's integer.

ROWS = 16  # weight rows of a group: the int32 lanes of one 512-bit vpdpbusd
AHEAD = 4096  # bytes of a group's lines prefetched ahead at M = 1: past the 4 KB page the hardware's
# streamer stops at (4096 x 14336, one thread, alternating with none: Q8_0 2.41-2.51 -> 2.38-2.39 ms,
# Q4_0 1.30-1.38 -> 1.29-1.31; Q6_K and int4 groups of 128 the same within the noise)


class PackedQ8:
    """A block-format weight ``(N, K)`` packed for Q8_0 activations (the section's comment):
    ``codes`` uint8 ``(groups, lines, 64)``; ``planes``: 0 a code a byte, 1 two a byte (through
    ``lut`` uint8 ``(16,)``), 3 two a byte with ``u = code`` (no table: Q4_0, Q4_K, int4, ...), 2 their
    low 4 bits two a byte and bits 4, 5 in ``hi`` uint8 ``(groups, lines, 32)`` (formats of up to 64
    values with ``u = code``: Q5_*, Q6_K: 6 bits a code where bytes take 8); ``s``, ``o`` float32 (float16 bits, uint16, where
    each is a float16: ``_compact``) and ``shift`` int32 ``(groups, pieces, ROWS)`` (``o`` and
    ``shift`` ``(1, 1, ROWS)`` where the format has no offset / zero: ``shift`` then ``vmin``). A
    two-level scale (``has_sc``: the K-quants', IQ4_XS's) keeps ``s`` as its ``d``, ``(groups, blocks,
    ROWS)``, and ``sc`` int8 ``(groups, pieces, ROWS)``: the piece's scale is ``s[p // span] *
    sc[p]``; the offset likewise (``has_osc``, ``o`` and ``osc``). ``s``, ``o`` and ``shift`` keep
    an entry a sub-block (a block: two levels' d), ``spans`` the pieces an entry covers (16 bits each:
    s's, o's, the zero's). ``flags``: has_sc, has_o, has_osc, has_zero as bits 0..3."""

    __slots__ = ("n", "k", "block", "piece", "amx", "codes", "planes", "hi", "lut", "s", "sc", "has_sc", "o", "osc", "has_o", "has_osc", "shift",
                 "has_zero", "spans", "flags")

    def __init__(self, raw, fmt):
        blocks = np.ascontiguousarray(raw).reshape(-1, fmt.nbytes)
        self.n, self.k = raw.shape[0], raw.shape[1] // fmt.nbytes * fmt.block
        n, k = self.n, self.k
        self.piece = piece = min(fmt.sub, 32)
        self.block = fmt.block
        g = -(-n // ROWS)
        vmin = int(fmt.values.min())
        u_of = (fmt.values - vmin).astype(np.int64)
        codes = fmt.fields["q"].unpack(blocks).reshape(n, k)
        count = len(fmt.values)
        plain = (u_of == np.arange(count)).all()  # u = code: no table
        self.planes = (3 if plain else 1) if count <= 16 else 2 if count <= 64 and plain else 0
        self.lut = np.arange(16, dtype=np.uint8)
        if self.planes == 1:
            self.lut[:count] = u_of
        rows = np.zeros((g * ROWS, k), np.uint8)
        rows[:n] = codes if self.planes else u_of[codes]
        self.hi = np.zeros((1, 1, 32), np.uint8)
        if self.planes:  # (g, 16, k/8, lo|hi, 4) -> (g, k/8, 16, 4): bytes of lo | hi << 4 (their low 4 bits)
            r = rows.reshape(g, ROWS, k // 8, 2, 4).transpose(0, 2, 1, 3, 4)
            lines = (r[..., 0, :] & 15) | (r[..., 1, :] & 15) << 4
            if self.planes == 2:  # their bits 4, 5: h = lo's | hi's << 2 a byte, then bytes i and i + 32 in one
                h = ((r[..., 0, :] >> 4) | (r[..., 1, :] >> 4) << 2).reshape(g, k // 8, 2, 32)
                self.hi = np.ascontiguousarray(h[:, :, 0] | h[:, :, 1] << 4)
        else:
            lines = rows.reshape(g, ROWS, k // 4, 4).transpose(0, 2, 1, 3)
        self.codes = np.ascontiguousarray(lines).reshape(g, -1, 64)
        s, o, z = fmt.parameters(blocks)
        each = fmt.sub // piece  # pieces a sub-block

        def side(p, dtype, repeat=1):  # (n, entries) -> (g, entries * repeat, ROWS), each entry repeat times
            full = np.zeros((g * ROWS, p.size // n * repeat), dtype)
            full[:n] = np.repeat(p.reshape(n, -1), repeat, axis=1)
            return np.ascontiguousarray(full.reshape(g, ROWS, -1).transpose(0, 2, 1))

        levels = fmt.levels(blocks) or (None,) * 4
        self.has_o, self.has_zero = o is not None, z is not None
        dummy_f, dummy_i = np.zeros((1, 1, ROWS), np.float32), np.zeros((1, 1, ROWS), np.int8)
        spans = [each, each]  # pieces an entry of s, o: a sub-block's, or a block's (two levels' d)

        def parameter(p, spec, which, d, sc):
            two = spec and spec[1] is not None and _levels(d, sc, p)
            if not two:
                return side(p, np.float32), dummy_i, False
            spans[which] = fmt.block // piece
            return side(two[0], np.float32), side(two[1], np.int8, each), True

        self.s, self.sc, self.has_sc = parameter(s, fmt.scale, 0, *levels[:2])
        self.o, self.osc, self.has_osc = dummy_f, dummy_i, False
        if self.has_o:
            self.o, self.osc, self.has_osc = parameter(o, fmt.offset and fmt.offset[0], 1, *levels[2:])
        self.shift = side(vmin - z.astype(np.int64), np.int32) if self.has_zero else \
            np.full((1, 1, ROWS), vmin, np.int32)
        self.flags = self.has_sc | self.has_o << 1 | self.has_osc << 2 | self.has_zero << 3
        self.s, self.o = _compact(self.s), _compact(self.o)
        sc_range = (int(self.sc.min()), int(self.sc.max())) if self.has_sc else (1, 1)  # AMX's planes
        self.amx = amx_plan(int(self.shift.min()), int(self.shift.max()) + int(u_of.max()), *sc_range, self.has_o)
        self.spans = spans[0] | spans[1] << 16 | each << 32  # s's, o's, the zero's (a sub-block's)


def _levels(d, sc, p):
    """A two-level parameter ``p`` (float32 ``(blocks, subs)``: the K-quants' ``d * scales[j]``, ``-dmin *
    mins[j]``) as ``(d (blocks,) float32, sc (blocks, subs) int8)`` (``BlockFormat.levels``' ``d``, ``sc``;
    None: one level) where ``d * sc == p`` bit for bit (so its float64 product is ``p`` too: the float32
    one is exact), else None: 5 bytes a block and one a piece where ``p`` takes four a piece."""
    if d is None or sc.size and (sc.min() < -128 or sc.max() > 127):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        same = (d[:, None] * sc.astype(np.float32)).view(np.int32) == p.reshape(len(d), -1).view(np.int32)
    return (d, sc.astype(np.int8)) if same.all() else None


def packable(fmt) -> bool:
    """Whether :class:`PackedQ8` takes ``fmt`` (a format ``q8_supported`` takes): values no more than
    255 apart, and pieces of whole lines (``K`` a multiple of 8 is the format's block)."""
    v = fmt.values
    return v is not None and float(v.max() - v.min()) <= 255 and fmt.block % 8 == 0 and min(fmt.sub, 32) % 8 == 0


_P8 = ir.IntType(8).as_pointer()


def _make_dot(width, planes, count):
    """Mode 2 for rows ``m0 .. m0 + count`` of ``x`` against one group (the section's comment):
    ``acc[r, 0:16]`` = the float64 sum over the pieces, in order, of ``dx * s * isum (+ dx * o *
    xsum)``, ``isum`` summed by ``vpdpbusd`` on ``width`` int32 lanes (16: AVX-512 VNNI; 8: AVX-VNNI,
    two a line) and the sums kept in registers from piece to piece. ``codes`` are the group's lines,
    ``lines`` a piece's; ``planes``: ``PackedQ8.planes`` (``hi`` the group's high bits). Each line is loaded and decoded
    once for the ``count`` rows; one row sums in two chains (even and odd lines), for the adds'
    latency. The float64 operations are LLVM's plain ones, unfused: each rounds as the contract's."""
    i8, i32, i64, f64 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.DoubleType()
    vec, bytes_ = ir.VectorType(i32, width), ir.VectorType(i8, width * 4)
    lanes32, lanes64 = ir.VectorType(i32, ROWS), ir.VectorType(f64, ROWS)
    halves, per, nib = ROWS // width, 8 if planes else 4, planes > 0  # vectors a line; k a line
    chains = 2 if count == 1 else 1

    def fn(builder, name, ret, args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)

    def const(v):
        return ir.Constant(i64, v)

    def splat(builder, v, vtype):
        v = builder.insert_element(ir.Constant(vtype, None), v, ir.Constant(i32, 0))
        return builder.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(ir.VectorType(i32, ROWS), [0] * ROWS))

    @intrinsic
    def dot(typingctx, codes, lines, lut, x, m0, xsum, dx, s, sc, o, osc, shift, flags, spans, acc, hi):
        def codegen(context, builder, sig, args):
            arrays = {i: context.make_array(sig.args[i])(context, builder, args[i])
                      for i in (0, 2, 3, 5, 6, 7, 8, 9, 10, 11, 14, 15)}
            lines, m0, flags, spans = args[1], args[4], args[12], args[13]
            span = [builder.and_(builder.lshr(spans, const(16 * i)), const(0xFFFF)) for i in range(3)] + \
                [builder.and_(builder.lshr(spans, const(i)), const(0xFF)) for i in (48, 56)]  # step, x's block
            has_sc, has_o, has_osc, has_zero = (builder.icmp_signed("!=", builder.and_(flags, const(1 << i)), const(0))
                                                for i in range(4))

            row = lambda i, index: _row_of(builder, arrays[i], index)  # noqa: E731  (bytes of row index of array i)
            load = functools.partial(_loadu, builder)

            pieces = builder.extract_value(arrays[5].shape, 1)
            xrows = [row(3, builder.add(m0, const(r))) for r in range(count)]
            sums = [row(5, builder.add(m0, const(r))) for r in range(count)]  # xsum's rows
            scales = [row(6, builder.add(m0, const(r))) for r in range(count)]  # dx's rows
            vpdpbusd = fn(builder, f"llvm.x86.avx512.vpdpbusd.{width * 32}", vec, [vec] * 3)
            shuffle = fn(builder, "llvm.x86.avx512.pshuf.b.512" if width == 16 else "llvm.x86.avx2.pshuf.b", bytes_,
                         [bytes_, bytes_])
            table = builder.load(builder.bitcast(arrays[2].data, ir.VectorType(i8, 16).as_pointer()), align=1)
            table = builder.shuffle_vector(table, table, ir.Constant(ir.VectorType(i32, width * 4),
                                                                     [i % 16 for i in range(width * 4)]))
            accs = [[[cgutils.alloca_once(builder, vec) for _ in range(halves)] for _ in range(chains)]
                    for _ in range(count)]
            totals = [cgutils.alloca_once_value(builder, ir.Constant(lanes64, [0.0] * ROWS)) for _ in range(count)]
            c = builder.bitcast(arrays[0].data, _P8)
            shift0 = builder.load(builder.bitcast(arrays[11].data, i32.as_pointer()))
            sums_i = [cgutils.alloca_once(builder, lanes32) for _ in range(count)]  # a step's integers
            sums_o = [cgutils.alloca_once(builder, lanes32) for _ in range(count)]
            with cgutils.for_range(builder, builder.udiv(pieces, span[3])) as step:
                for r in range(count):
                    builder.store(ir.Constant(lanes32, [0] * ROWS), sums_i[r])
                    builder.store(ir.Constant(lanes32, [0] * ROWS), sums_o[r])
                p0 = builder.mul(step.index, span[3])
                with cgutils.for_range(builder, span[3]) as inner:
                    p = builder.add(p0, inner.index)
                    for a in (a for by_row in accs for by_chain in by_row for a in by_chain):
                        builder.store(ir.Constant(vec, [0] * width), a)
                    first = builder.mul(p, lines)
                    with cgutils.for_range(builder, builder.udiv(lines, const(2))) as loop:  # (an even count)
                        for parity in range(2):
                            t = builder.add(first, builder.add(builder.mul(loop.index, const(2)), const(parity)))
                            line = builder.gep(c, [builder.mul(t, const(64))])
                            if count == 1:  # one row of x reads each line once: ask L2 for the lines AHEAD on
                                builder.call(fn(builder, "llvm.prefetch.p0", ir.VoidType(), [_P8, i32, i32, i32]),
                                             [builder.gep(line, [const(AHEAD)]), ir.Constant(i32, 0), ir.Constant(i32, 2),
                                              ir.Constant(i32, 1)])  # read, L2, data
                            ops = []  # each half's operands: the line's bytes, or its low and high nibbles' u
                            if planes == 2:  # bits 4, 5: byte q's two pairs, in the low (q < 32) or high nibble
                                plane = load(row(15, t), ir.VectorType(i8, 32))
                                fours = [builder.and_(plane, ir.Constant(plane.type, [15] * 32)),
                                         builder.lshr(plane, ir.Constant(plane.type, [4] * 32))]
                                fours = [builder.shuffle_vector(fours[0], fours[1], ir.Constant(
                                    ir.VectorType(i32, 64), list(range(64))))] if halves == 1 else fours
                            for h in range(halves):
                                v = load(builder.gep(line, [const(h * width * 4)]), bytes_)
                                if not nib:
                                    ops.append([v])
                                    continue
                                pair = [builder.and_(v, ir.Constant(bytes_, [15] * width * 4)),
                                        builder.lshr(v, ir.Constant(bytes_, [4] * width * 4))]
                                if planes == 1:
                                    pair = [builder.call(shuffle, [table, o_]) for o_ in pair]
                                elif planes == 2:
                                    f = fours[h]
                                    pair = [builder.or_(pair[0], builder.shl(builder.and_(f, ir.Constant(bytes_, [3] * width * 4)),
                                                                            ir.Constant(bytes_, [4] * width * 4))),
                                            builder.or_(pair[1], builder.shl(builder.and_(f, ir.Constant(bytes_, [12] * width * 4)),
                                                                            ir.Constant(bytes_, [2] * width * 4)))]
                                ops.append(pair)
                            for r in range(count):
                                words = []
                                for j in range(2 if nib else 1):  # x's 4 bytes of each operand, broadcast
                                    xa = builder.gep(xrows[r], [builder.add(builder.mul(t, const(per)), const(4 * j))])
                                    w = builder.load(builder.bitcast(xa, i32.as_pointer()), align=1)
                                    words.append(builder.shuffle_vector(
                                        builder.insert_element(ir.Constant(vec, None), w, ir.Constant(i32, 0)),
                                        ir.Constant(vec, None), ir.Constant(vec, [0] * width)))
                                for h in range(halves):
                                    a = accs[r][parity % chains][h]
                                    acc = builder.load(a)
                                    for o_, w in zip(ops[h], words):
                                        acc = builder.call(vpdpbusd, [acc, builder.bitcast(o_, vec), w])
                                    builder.store(acc, a)
                    # the piece's integers: isum = dots + shift * xsum, times its sub-scale (1 for one level),
                    # added to the step's (exact in int32: 256 * 128 * 255 * 128 < 2^31)
                    def small(has, i):  # row p of int8 array argument i as int32, or ones
                        v = builder.sext(load(row(i, builder.select(has, p, const(0))), ir.VectorType(i8, ROWS)), lanes32)
                        return builder.select(has, v, ir.Constant(lanes32, [1] * ROWS))

                    scv, oscv = small(has_sc, 8), small(has_osc, 10)
                    hp = load(row(11, builder.select(has_zero, builder.udiv(p, span[2]), const(0))), lanes32)
                    for r in range(count):
                        halves_ = []
                        for h in range(halves):
                            v = builder.load(accs[r][0][h])
                            for k in range(1, chains):
                                v = builder.add(v, builder.load(accs[r][k][h]))
                            halves_.append(v)
                        isum = halves_[0] if halves == 1 else builder.shuffle_vector(
                            halves_[0], halves_[1], ir.Constant(ir.VectorType(i32, ROWS), list(range(ROWS))))
                        x1 = builder.load(builder.bitcast(builder.gep(sums[r], [builder.mul(p, const(4))]), i32.as_pointer()))
                        xs = splat(builder, x1, lanes32)
                        # without zero points every lane's shift is vmin: a scalar product (no vpmulld a row)
                        isum = builder.add(isum, builder.select(has_zero, builder.mul(hp, xs),
                                                                splat(builder, builder.mul(shift0, x1), lanes32)))
                        builder.store(builder.add(builder.load(sums_i[r]), builder.mul(scv, isum)), sums_i[r])
                        builder.store(builder.add(builder.load(sums_o[r]), builder.mul(oscv, xs)), sums_o[r])
                # the step's terms, float64: (dx * d) * S (+ (dx * dm) * M), d a step's scale (a sub-block's, or a block's d)
                sp = _scales(builder, row(7, builder.udiv(p0, span[0])), sig.args[7].dtype)
                op = _scales(builder, row(9, builder.select(has_o, builder.udiv(p0, span[1]), const(0))), sig.args[9].dtype)
                block = builder.udiv(p0, span[4])  # dx's block of the step
                for r in range(count):
                    d = builder.load(builder.bitcast(builder.gep(scales[r], [builder.mul(block, const(8))]),
                                                     f64.as_pointer()))
                    dv = splat(builder, d, lanes64)
                    term = builder.fmul(builder.fmul(dv, sp), builder.sitofp(builder.load(sums_i[r]), lanes64))
                    offset = builder.fmul(builder.fmul(dv, op), builder.sitofp(builder.load(sums_o[r]), lanes64))
                    term = builder.select(has_o, builder.fadd(term, offset), term)
                    builder.store(builder.fadd(builder.load(totals[r]), term), totals[r])
            for r in range(count):
                builder.store(builder.load(totals[r]), builder.bitcast(row(14, const(r)), lanes64.as_pointer()),
                              align=1)
            return context.get_dummy_value()

        return types.void(codes, lines, lut, x, m0, xsum, dx, s, sc, o, osc, shift, flags, spans, acc, hi), codegen

    return dot
RM = 8  # rows of x a call of the dots takes, each line decoded once for them
# [width 16, 8][planes 0 .. 3] for one row of x, then for RM rows
(_d16p0, _d16p1, _d16p2, _d16p3, _d8p0, _d8p1, _d8p2, _d8p3), \
    (_d16p0m, _d16p1m, _d16p2m, _d16p3m, _d8p0m, _d8p1m, _d8p2m, _d8p3m) = (
        [_make_dot(w, planes, count) for w in (16, 8) for planes in range(4)] for count in (1, RM))


@njit(inline="always")
def _dot_portable(codes, lines, planes, lut, x, m0, count, xsum, dx, s, sc, o, osc, shift, flags, spans, acc, hi):
    """:func:`_make_dot`'s sums in plain loops."""
    per = 8 if planes else 4
    has_sc, has_o, has_osc, has_zero = flags & 1, flags & 2, flags & 4, flags & 8
    group, xspan = (spans >> 48) & 0xFF, (spans >> 56) & 0xFF
    isum, big, small = np.empty(ROWS, np.int32), np.empty(ROWS, np.int32), np.empty(ROWS, np.int32)
    for r in range(count):
        m = m0 + r
        xr, a = x[m], acc[r]
        a[:] = 0
        for p0 in range(0, xsum.shape[1], group):
            big[:] = 0
            small[:] = 0
            for p in range(p0, p0 + group):
                isum[:] = 0
                for t in range(p * lines, p * lines + lines):
                    line = codes[t]
                    for l in range(ROWS):
                        for b in range(4):
                            c, q = np.int32(line[4 * l + b]), 4 * l + b
                            if planes == 0:
                                isum[l] += c * np.int32(xr[t * per + b])
                                continue
                            lo, up = np.int32(lut[c & 15]), np.int32(lut[c >> 4])
                            if planes == 2:  # bits 4, 5 from hi: byte q % 32, its low nibble for q < 32
                                f = (np.int32(hi[t, q % 32]) >> (4 if q >= 32 else 0)) & 15
                                lo, up = lo | (f & 3) << 4, up | (f >> 2) << 4
                            isum[l] += lo * np.int32(xr[t * per + b]) + up * np.int32(xr[t * per + 4 + b])
                xs = xsum[m, p]
                hp = shift[p // (spans >> 32 & 0xFFFF) if has_zero else 0]
                for l in range(ROWS):
                    big[l] += (np.int32(sc[p, l]) if has_sc else np.int32(1)) * (isum[l] + hp[l] * xs)
                    small[l] += (np.int32(osc[p, l]) if has_osc else np.int32(1)) * xs
            d = dx[m, p0 // xspan]
            sr, orow = s[p0 // (spans & 0xFFFF)], o[p0 // ((spans >> 16) & 0xFFFF) if has_o else 0]
            for l in range(ROWS):
                term = d * _f64(sr[l]) * np.float64(big[l])
                if has_o:
                    term += d * _f64(orow[l]) * np.float64(small[l])
                a[l] += term


@njit(inline="always")
def _dot(isa, planes, codes, lines, lut, x, m0, count, xsum, dx, s, sc, o, osc, shift, flags, spans, acc, hi):
    """The sums of instruction set ``isa`` (an index into ``gemm._ISAS``; AMX's are AVX-512 VNNI's) and
    ``planes`` (both the kernel's closure constants) for rows ``m0 .. m0 + count`` of ``x`` (``count`` 1
    or ``RM``), the intrinsics named as globals (``gemm._block``)."""
    a = (codes, lines, lut, x, m0, xsum, dx, s, sc, o, osc, shift, flags, spans, acc, hi)
    if isa >= 3:  # portable, and AVX2 without VNNI (its dots are the portable loops)
        _dot_portable(codes, lines, planes, lut, x, m0, count, xsum, dx, s, sc, o, osc, shift, flags, spans,
                      acc, hi)
    elif isa <= 1 and count == 1:
        _d16p0(*a) if planes == 0 else _d16p1(*a) if planes == 1 else _d16p2(*a) if planes == 2 else _d16p3(*a)
    elif isa <= 1:
        _d16p0m(*a) if planes == 0 else _d16p1m(*a) if planes == 1 else _d16p2m(*a) if planes == 2 else _d16p3m(*a)
    elif count == 1:
        _d8p0(*a) if planes == 0 else _d8p1(*a) if planes == 1 else _d8p2(*a) if planes == 2 else _d8p3(*a)
    else:
        _d8p0m(*a) if planes == 0 else _d8p1m(*a) if planes == 1 else _d8p2m(*a) if planes == 2 else _d8p3m(*a)


def _make_packed(isa, planes, flags, spans, lines):
    """The kernel of instruction set ``isa`` for a weight's ``planes``, ``flags`` and ``spans`` (those of
    ``PackedQ8``, ``spans`` with the step's bits) and ``lines`` a piece: constants of the code, so that
    LLVM drops the parts a format has not (its offsets, zero points, sub-scales) and divides by
    constants. With them read at run time, the selects and the divisions of each piece took 25-30% of
    M = 1 (int4, groups of 128, 4096 x 14336: 1.69 -> 1.19 ms, one thread)."""
    which, source = _ISAS.index(isa), _HELPERS

    @kernel
    def linear_packed(dx, qx, xsum, codes, hi, lut, s, sc, o, osc, shift, bias, has_bias, out, start, stop):
        """Mode 2 on groups ``start .. stop`` of :class:`PackedQ8`'s weights: ``dx`` float64 ``(M, K //
        32)``, ``qx`` int8 ``(M, K)``, ``xsum`` int32 ``(M, pieces)``; ``out`` float32 ``(M, N)``."""
        _ = source  # in the cache key: llvm.py's intrinsics
        m_len = qx.shape[0]
        n_len = out.shape[1]
        acc = np.empty((RM, ROWS), np.float64)
        for g in range(start, stop):
            n0 = g * ROWS
            scg, og, oscg = sc[g if flags & 1 else 0], o[g if flags & 2 else 0], osc[g if flags & 4 else 0]
            hg = shift[g if flags & 8 else 0]
            for m0 in range(0, m_len, RM):
                count = RM if m_len - m0 >= RM else 1
                for m1 in range(m0, min(m0 + RM, m_len), count):
                    _dot(which, planes, codes[g], lines, lut, qx, m1, count, xsum, dx, s[g], scg, og, oscg, hg, flags,
                         spans, acc, hi[g if planes == 2 else 0])
                    _store(acc[:count], bias, has_bias, out[m1:m1 + count], n0, min(ROWS, n_len - n0))

    return linear_packed


_packed_kernel = functools.cache(_make_packed)


# -- many rows of x on AMX: the tiles take a block of 16 rows of x against a group --------------------
#
# ``tdpbssd`` (signed bytes by signed bytes) multiplies tile A, 16 rows of x's codes (64 k, read
# where they lie), by tile B, 4 k of the 16 weight rows a row of 64 bytes (a packed line's layout).
# A Q8_K step is a block of 256 k, whose integers are ``big = sum_p sc_p * sum_k x * v`` (``v = u +
# shift``) and ``small = sum_p osc_p * xsum_p``. The sub-scales go into B: ``sc`` splits into digits of
# ``bits`` (the top one signed) and ``v`` into ``parts`` of 4 bits (the top one signed) where a
# product would not fit a byte, and each plane ``(part, digit)`` holds ``part(v) * digit(sc)``; then
# ``big = sum over planes of C_plane << shift_plane``, and ``small`` is one more plane, ``osc`` (ones
# without sub-scales): ``sum_k x * osc``. Every integer is the one the dots sum, so the float step and
# the bits are theirs, and the block's products stay in the tiles: no work a piece.
#
# Q8_0 activations have a float step a piece (32 k): there one plane, ``v`` itself (formats of one
# level whose ``v`` fits an int8: Q4_0, Q8_0, IQ4_NL, MXFP4, the int4 / uint4 groups), and a C tile a
# piece: ``tdpbssd`` of A's 32 bytes a row by B's 8 rows gives each piece's ``isum`` exactly.

AMX_ROWS = 32  # rows of x from which the AMX path runs (fewer: AVX-512 VNNI's, which decodes nothing);
# Q8_0 activations where ``amx_pieces``: with each call's float step run during the next call's tile
# products, AMX against AVX-512 VNNI at 4096 x 4096, one thread: 1.16-1.2x at 16 rows, 0.85-0.88x
# at 32, 0.6-0.8x at 128
AMX_GROUPS = 2  # groups a pass over x's rows takes, each block's planes decoded for them
AMX_TILES = 5  # planes a block at most: C tiles 0..4, A tile 5, B tiles 6 and 7 in turn
_STEPS = 256 // 64  # tile products of 64 k a Q8_K block


def amx_plan(vmin, vmax, smin, smax, small):
    """``(parts, digits, bits)`` with the fewest planes for values ``v`` in ``vmin .. vmax`` and
    sub-scales in ``smin .. smax``: every ``part(v) * digit(sc)`` in an int8, and no more than
    ``AMX_TILES`` planes with ``small``'s; None if there is no such split."""
    def ranges(lo, hi, width, count):  # each piece's range: the low ones unsigned, the top one lo >> ...
        return [(0, (1 << width) - 1)] * (count - 1) + [(lo >> width * (count - 1), hi >> width * (count - 1))]

    def fits(a, b):
        ends = [x * y for x in a for y in b]
        return -128 <= min(ends) and max(ends) <= 127

    best = None
    for parts in (1, 2):
        for bits in range(1, 9):
            for digits in range(1, 9):
                count = parts * digits
                if count + small <= AMX_TILES and bits * (digits - 1) < 8 and -128 <= vmin and vmax <= 127 and (best is None or count < best[0] * best[1]) and all(
                        fits(p, d) for p in ranges(vmin, vmax, 4, parts) for d in ranges(smin, smax, bits, digits)):
                    best = (parts, digits, bits)
    return best


def _vectors(context, builder, sig, args, which):
    """Pointers to the data of array arguments ``which``, as bytes."""
    p8 = ir.IntType(8).as_pointer()
    return [builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data, p8) for i in which]


def _row(builder, base, r, vtype):
    """Pointer to row ``r`` of ``vtype`` vectors (of int32 or float64) from ``base`` (bytes)."""
    size = vtype.count * (8 if isinstance(vtype.element, ir.DoubleType) else vtype.element.width // 8)
    return builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), r * size)]), vtype.as_pointer())


_I32X16, _F64X16, _I8X64, _I8X16 = (ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.DoubleType(), 16),
                                    ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.IntType(8), 16))


def _float_step(builder, tiles, c_, sh_, has_small, acc_, d_, s_, o_, dtypes):
    """The float step of a Q8_K block of 16 rows of x by a group from its planes ``c_`` (tiles x 16 x 16
    int32, bytes): ``big = sum of c[t] << shifts[t]`` over the planes but ``small``'s (the last, where
    ``has_small``), ``acc[r] += d[r] * s * big[r] (+ d[r] * o * small[r])``, ``s``, ``o`` 16 weight
    rows' float32 or float16 bits (``dtypes``: :func:`_scales`), ``d`` float64 (16 rows of x); unfused,
    left to right (the contract's roundings)."""
    i64 = ir.IntType(64)
    at = functools.partial(ir.Constant, i64)
    shp = builder.bitcast(sh_, i64.as_pointer())
    shv = [_splat(builder, builder.trunc(builder.load(builder.gep(shp, [at(t)])), ir.IntType(32)), _I32X16)
           for t in range(tiles)]
    sv, ov = _scales(builder, s_, dtypes[0]), _scales(builder, o_, dtypes[1])
    dp = builder.bitcast(d_, ir.DoubleType().as_pointer())
    for r in range(16):
        cs = [builder.load(_row(builder, c_, 16 * t + r, _I32X16), align=4) for t in range(tiles)]
        big = builder.shl(cs[0], shv[0])
        for t in range(1, tiles):
            term = builder.shl(cs[t], shv[t])
            if t == tiles - 1:  # small's plane where small
                term = builder.select(has_small, ir.Constant(_I32X16, [0] * 16), term)
            big = builder.add(big, term)
        dv = _splat(builder, builder.load(builder.gep(dp, [at(r)])), _F64X16)
        term = builder.fmul(builder.fmul(dv, sv), builder.sitofp(big, _F64X16))
        off = builder.fmul(builder.fmul(dv, ov), builder.sitofp(cs[-1], _F64X16))
        term = builder.select(has_small, builder.fadd(term, off), term)
        pa = _row(builder, acc_, r, _F64X16)
        builder.store(builder.fadd(builder.load(pa, align=8), term), pa, align=8)


def _tile_ops(builder):
    """The AMX intrinsics of a block's tile work (``tileloadd64``, ``tdpbssd``, ``tilestored64``,
    ``tilezero``), and the constants of a tile's number (int8) and of an offset (int64)."""
    p8, i8, i64 = ir.IntType(8).as_pointer(), ir.IntType(8), ir.IntType(64)
    return (_fn(builder, "llvm.x86.tileloadd64", ir.VoidType(), [i8, p8, i64]),
            _fn(builder, "llvm.x86.tdpbssd", ir.VoidType(), [i8] * 3),
            _fn(builder, "llvm.x86.tilestored64", ir.VoidType(), [i8, p8, i64]),
            _fn(builder, "llvm.x86.tilezero", ir.VoidType(), [i8]),
            functools.partial(ir.Constant, i8), functools.partial(ir.Constant, i64))


def _make_amx_block(tiles):
    @intrinsic
    def block(typingctx, a, a_at, a_stride, b, b_at, b_plane, c, cp, pending, shifts, small, acc, d, s, o):
        """A Q8_K block of 16 rows of x by a group on AMX, and the float step of the block before it
        (software pipelining: the vector units' float step runs while the tiles multiply). Its
        ``tiles`` planes: C (tiles ``0 .. tiles - 1``) = the sum over the block's 4 steps of 64 k of A
        (tile 5: 16 rows of ``a``'s bytes from byte ``a_at + 64 s``, ``a_stride`` apart) times B (tiles
        6, 7 in turn: ``b``'s bytes from ``b_at + plane * b_plane + 1024 s``, rows of 64) by
        ``tdpbssd``. Then, where ``pending``, :func:`_float_step` of the planes ``cp`` the call before
        stored into its ``acc``, ``d``, ``s``, ``o``; last, C stored to ``c`` (tiles x 16 x 16 int32),
        for the next call."""
        def codegen(context, builder, sig, args):
            a_, b_, c_, cp_, sh_, acc_, d_, s_, o_ = _vectors(context, builder, sig, args, (0, 3, 6, 7, 9, 11, 12, 13, 14))
            load, dot, store, zero, tile, at = _tile_ops(builder)
            for t in range(tiles):
                builder.call(zero, [tile(t)])
            for st in range(_STEPS):
                ta = tile(5)
                builder.call(load, [ta, builder.gep(a_, [builder.add(args[1], at(1024 * st))]), args[2]])
                for t in range(tiles):
                    bt = tile(6 + (st * tiles + t) % 2)
                    off = builder.add(builder.add(args[4], builder.mul(args[5], at(t))), at(1024 * st))
                    builder.call(load, [bt, builder.gep(b_, [off]), at(64)])
                    builder.call(dot, [tile(t), ta, bt])
            has_small = builder.icmp_signed("!=", args[10], ir.Constant(args[10].type, 0))
            with builder.if_then(builder.icmp_signed("!=", args[8], ir.Constant(args[8].type, 0))):
                _float_step(builder, tiles, cp_, sh_, has_small, acc_, d_, s_, o_, (sig.args[13].dtype, sig.args[14].dtype))
            for t in range(tiles):
                builder.call(store, [tile(t), builder.gep(c_, [at(1024 * t)]), at(64)])
            return context.get_dummy_value()

        return types.void(a, a_at, a_stride, b, b_at, b_plane, c, cp, pending, shifts, small, acc, d, s, o), codegen

    return block


_amx1, _amx2, _amx3, _amx4, _amx5 = (_make_amx_block(tiles) for tiles in range(1, AMX_TILES + 1))

# Q8_0 activations: the float step is a piece's (32 k), so a call takes half a block, 4 pieces, each
# its own C tile (0..3): A tiles 4, 5 (16 rows of x, 32 bytes), B tiles 6, 7 (8 rows of a plane, 32 k)
_PIECES = 4


def _piece_step(builder, cp_, acc, dx, xs, p0, m0, s, span_s, o, span_o, has_o, dtypes):
    """The float steps of the 4 pieces ``p0 ..`` of 16 rows of x (from ``m0``) by a group, from their C
    tiles ``cp_`` (bytes; 4 x 16 x 16 int32, ``isum``) into ``acc`` (bytes, 16 x 16 float64): ``acc[r]
    += dx * s * isum (+ dx * o * xsum)``, unfused, left to right (the Q8_0 contract); ``dx``, ``xs``
    ``(pieces, rows)`` float64 / int32 and ``s``, ``o`` ``(entries, 16)`` float32 or float16-bits arrays
    (``make_array`` structs; ``dtypes``: :func:`_scales`), an entry ``span_s`` / ``span_o`` pieces."""
    i64, f64 = ir.IntType(64), ir.DoubleType()
    for t in range(_PIECES):
        p = builder.add(p0, ir.Constant(i64, t))
        sv = _scales(builder, _row_of(builder, s, builder.udiv(p, span_s)), dtypes[0])
        ov = _scales(builder, _row_of(builder, o, builder.udiv(builder.select(has_o, p, ir.Constant(i64, 0)),
                                                               builder.select(has_o, span_o, ir.Constant(i64, 1)))), dtypes[1])
        dp = builder.gep(builder.bitcast(_row_of(builder, dx, p), f64.as_pointer()), [m0])
        xp = builder.gep(builder.bitcast(_row_of(builder, xs, p), ir.IntType(32).as_pointer()), [m0])
        for r in range(16):
            ci = builder.load(_row(builder, cp_, 16 * t + r, _I32X16), align=4)
            dv = _splat(builder, builder.load(builder.gep(dp, [ir.Constant(i64, r)])), _F64X16)
            term = builder.fmul(builder.fmul(dv, sv), builder.sitofp(ci, _F64X16))
            xv = _splat(builder, builder.sitofp(builder.load(builder.gep(xp, [ir.Constant(i64, r)])), f64), _F64X16)
            term = builder.select(has_o, builder.fadd(term, builder.fmul(builder.fmul(dv, ov), xv)), term)
            pa = _row(builder, acc, r, _F64X16)
            builder.store(builder.fadd(builder.load(pa, align=8), term), pa, align=8)


@intrinsic
def _amx_pieces(typingctx, a, a_at, b, b_at, c, cp, pending, acc, dx, xs, p0, m0, s, span_s, o, span_o, has_o):
    """Half a block (4 pieces of 32 k) of 16 rows of x by a group on AMX, Q8_0 activations: C tile ``t``
    = A (16 rows of ``a``'s bytes, 32 from byte ``a_at + 1024 (t // 2) + 32 (t % 2)``, rows 64 apart: x's
    tiled copy) times B (8 rows of 64 bytes of ``b`` from ``b_at + 512 t``: the plane ``v``), ``isum``
    exactly. Then, where ``pending``, the float steps of the call before (its planes ``cp``, its
    ``acc ...``: :func:`_piece_step`); last, C stored to ``c``: as :func:`_make_amx_block`'s block."""
    def codegen(context, builder, sig, args):
        a_, b_, c_, cp_ = _vectors(context, builder, sig, args, (0, 2, 4, 5))
        load, dot, store, zero, tile, at = _tile_ops(builder)
        for t in range(_PIECES):
            builder.call(zero, [tile(t)])
        for t in range(_PIECES):
            ta, tb = tile(4 + t % 2), tile(6 + t % 2)
            builder.call(load, [ta, builder.gep(a_, [builder.add(args[1], at(1024 * (t // 2) + 32 * (t % 2)))]), at(64)])
            builder.call(load, [tb, builder.gep(b_, [builder.add(args[3], at(512 * t))]), at(64)])
            builder.call(dot, [tile(t), ta, tb])
        with builder.if_then(builder.icmp_signed("!=", args[6], ir.Constant(args[6].type, 0))):
            arr = lambda i: context.make_array(sig.args[i])(context, builder, args[i])  # noqa: E731
            has_o = builder.icmp_signed("!=", args[16], ir.Constant(args[16].type, 0))
            _piece_step(builder, cp_, _vectors(context, builder, sig, args, (7,))[0], arr(8), arr(9), args[10], args[11],
                        arr(12), args[13], arr(14), args[15], has_o, (sig.args[12].dtype, sig.args[14].dtype))
        for t in range(_PIECES):
            builder.call(store, [tile(t), builder.gep(c_, [at(1024 * t)]), at(64)])
        return context.get_dummy_value()

    return types.void(a, a_at, b, b_at, c, cp, pending, acc, dx, xs, p0, m0, s, span_s, o, span_o, has_o), codegen

# ldtilecfg's 64 bytes: palette 1, tiles 0..7 16 rows of 64 bytes (C, A, B alike)
_AMX_CONFIG = np.zeros(64, np.uint8)
_AMX_CONFIG[0] = 1
_AMX_CONFIG[16:32].view(np.uint16)[:] = 64
_AMX_CONFIG[48:56] = 16
_PIECES_CONFIG = _AMX_CONFIG.copy()  # Q8_0's: A tiles 4, 5 of 32 bytes a row, B tiles 6, 7 of 8 rows
_PIECES_CONFIG[16:32].view(np.uint16)[4:6] = 32
_PIECES_CONFIG[54:56] = 8


@intrinsic
def _plane_row(typingctx, out, at, line, hrow, lut, kind, half, shift, sc, has_sc, part, dshift, mask):
    """Row ``r`` of a B plane (64 int8: the k ``4 r .. 4 r + 3`` of the 16 weight rows) to byte ``at`` of
    ``out``: ``part(v) * digit``. ``v = u + shift`` (``shift`` 16 int32, a weight row's each) from the
    packed row's ``line`` (64 bytes; ``kind`` :class:`PackedQ8`'s planes: 0 the codes, else nibble
    ``half`` of each byte, through ``lut`` (1), with bits 4, 5 from ``hrow``, 32 bytes (2)); ``part``
    0: v, 1: its low 4 bits, 2: the rest, shifted down; -1: the digits alone. ``digit = (sc >> dshift)
    & mask`` of each weight row (``sc`` 16 int8; ones where not ``has_sc``), each 4 times."""
    def codegen(context, builder, sig, args):
        out_, line_, hrow_, lut_, shift_, sc_ = _vectors(context, builder, sig, args, (0, 2, 3, 4, 7, 8))
        i8, i32 = ir.IntType(8), ir.IntType(32)
        i8x16, i8x32 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)

        def bytes_(v):
            return ir.Constant(_I8X64, [v] * 64)

        def eq(arg, v):
            return builder.icmp_signed("==", arg, ir.Constant(arg.type, v))

        def each4(v16):  # 16 lanes, each 4 times
            return builder.shuffle_vector(v16, ir.Constant(v16.type, None),
                                          ir.Constant(ir.VectorType(i32, 64), [q // 4 for q in range(64)]))

        raw = builder.load(builder.bitcast(line_, _I8X64.as_pointer()), align=1)
        nib = builder.and_(builder.lshr(raw, builder.select(eq(args[6], 1), bytes_(4), bytes_(0))), bytes_(15))
        table = builder.load(builder.bitcast(lut_, i8x16.as_pointer()), align=1)
        looked = builder.call(_fn(builder, "llvm.x86.avx512.pshuf.b.512", _I8X64, [_I8X64, _I8X64]),
                              [builder.shuffle_vector(table, ir.Constant(i8x16, None),
                                                      ir.Constant(ir.VectorType(i32, 64), [q % 16 for q in range(64)])), nib])
        h32 = builder.load(builder.bitcast(hrow_, i8x32.as_pointer()), align=1)
        h64 = builder.shuffle_vector(builder.and_(h32, ir.Constant(i8x32, [15] * 32)),
                                     builder.lshr(h32, ir.Constant(i8x32, [4] * 32)),
                                     ir.Constant(ir.VectorType(i32, 64), list(range(64))))
        top = builder.and_(builder.lshr(h64, builder.select(eq(args[6], 1), bytes_(2), bytes_(0))), bytes_(3))
        u = builder.select(eq(args[5], 0), raw, builder.select(eq(args[5], 1), looked, builder.select(
            eq(args[5], 2), builder.or_(nib, builder.shl(top, bytes_(4))), nib)))
        sh = each4(builder.trunc(builder.load(builder.bitcast(shift_, _I32X16.as_pointer()), align=1), _I8X16))
        v = builder.add(u, sh)
        s16 = builder.select(builder.icmp_signed("!=", args[9], ir.Constant(args[9].type, 0)),
                             builder.load(builder.bitcast(sc_, i8x16.as_pointer()), align=1), ir.Constant(i8x16, [1] * 16))
        dig = builder.and_(builder.ashr(each4(s16), _splat(builder, builder.trunc(args[11], i8), _I8X64)),
                           _splat(builder, builder.trunc(args[12], i8), _I8X64))
        pv = builder.select(eq(args[10], 1), builder.and_(v, bytes_(15)), v)
        pv = builder.select(eq(args[10], 2), builder.ashr(v, bytes_(4)), pv)
        res = builder.select(builder.icmp_signed("<", args[10], ir.Constant(args[10].type, 0)), dig, builder.mul(pv, dig))
        builder.store(res, builder.bitcast(builder.gep(out_, [args[1]]), _I8X64.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(out, at, line, hrow, lut, kind, half, shift, sc, has_sc, part, dshift, mask), codegen


@njit(inline="always")
def _amx_planes(codes, hi, lut, kind, shift, has_zero, spans, r0, sc, has_sc, osc, has_osc, piece, parts, digits,
                bits, small, out):
    """A block's B planes (``out``, bytes, 64 rows of 64 a plane) from its group's packed rows (B's rows
    from ``r0``): plane ``i * digits + t`` = part ``i`` of ``v = u + shift`` (all of it, or its low 4
    bits and the rest) times digit ``t`` of its piece's ``sc`` (the last digit signed; ones without
    sub-scales), plane ``parts * digits`` = ``osc`` where ``small``."""
    each = spans >> 32 & 0xFFFF
    for r in range(64):
        a = r0 + r
        p = 4 * a // piece
        line, hrow = codes[a if kind == 0 else a // 2], hi[a // 2 if kind == 2 else 0]
        sh, scr = shift[p // each if has_zero else 0], sc[p if has_sc else 0]
        for i in range(parts):
            for t in range(digits):
                _plane_row(out, ((i * digits + t) * 64 + r) * 64, line, hrow, lut, kind, a % 2, sh, scr, has_sc,
                           i + (parts > 1), bits * t, -1 if t == digits - 1 else (1 << bits) - 1)
        if small:
            _plane_row(out, ((parts * digits) * 64 + r) * 64, line, hrow, lut, kind, a % 2, sh,
                       osc[p if has_osc else 0], has_osc, -1, 0, -1)


@njit(inline="always")
def _amx_call(pieces, tiles, qx, a_at, b, b_at, c, cp, pending, shifts, small, acc, dx, xs, pb, pm, s, span_s, o,
              span_o, has_o):
    """One tile call of :func:`_make_amx`'s kernel (``pieces``, ``tiles``: its constants): the products of
    16 rows of x from byte ``a_at`` by the planes ``b`` (from ``b_at``) into ``c``, and the float step of
    the call before (``pending``; its planes ``cp``, rows ``pm``, block or first piece ``pb``, into
    ``acc``; ``s``, ``o`` its group's)."""
    if pieces:
        _amx_pieces(qx, a_at, b, b_at, c, cp, pending, acc, dx, xs, pb, pm, s, span_s, o, span_o, has_o)
        return
    args = (qx, a_at, np.int64(64), b, b_at, np.int64(64 * 64), c, cp, pending, shifts, small, acc, dx[pb, pm:pm + 16],
            s[pb], o[pb if has_o else 0])
    if tiles == 1:
        _amx1(*args)
    elif tiles == 2:
        _amx2(*args)
    elif tiles == 3:
        _amx3(*args)
    elif tiles == 4:
        _amx4(*args)
    else:
        _amx5(*args)


def _make_amx(planes, parts, digits, small, pieces=False):
    source, tiles = _HELPERS, parts * digits + small
    halves, ctiles, config = (2, _PIECES, _PIECES_CONFIG) if pieces else (1, tiles, _AMX_CONFIG)

    @kernel
    def linear_amx(dx, qx, xs, codes, hi, lut, s, sc, o, osc, shift, flags, spans, plan, shifts, bias, has_bias, out,
                   start, stop):
        """The Q8_K contract on groups ``start .. stop`` (:func:`linear_q8_packed`'s arguments; ``qx`` with
        rows padded to 16, ``dx`` transposed, ``(blocks, rows)``), 16 rows of x at a time on AMX, in
        ``tiles`` planes (``parts`` of v by ``digits`` of sc, then ``small``'s; ``plan``: the digits'
        bits, the piece; ``shifts`` the planes' weights: the kernel's constants, as a runtime split
        made the decoding 4x slower). A block's planes are decoded for ``AMX_GROUPS`` groups, then all rows of x run
        against them: the planes stay in L1, and x's rows are read once for the groups. Each call's
        float step runs in the next call, while its tiles multiply (``c`` two calls' planes): at M = 512,
        4096 x 14336, one thread, Q4_K 131-138 -> 123 ms, Q6_K 154-160 -> 144. ``pieces``: the Q8_0
        contract (``dx`` and ``xs``, x's piece sums, ``(pieces, rows)``), one plane ``v`` (formats of one
        level whose ``v`` fits an int8), half a block a call (:func:`_amx_pieces`)."""
        _ = source  # in the cache key: llvm.py's intrinsics
        m_len, k_len = qx.shape
        n_len = out.shape[1]
        bits, piece = plan[0], plan[1]
        has_sc, has_o, has_osc, has_zero = flags & 1, flags & 2, flags & 4, flags & 8
        b = _aligned(np.empty(2 * AMX_GROUPS * tiles * 4096 + 64, np.int8), 2 * AMX_GROUPS * tiles * 4096).reshape(
            2, AMX_GROUPS, -1)
        c = _aligned(np.empty(2 * ctiles * 256 + 16, np.int32), 2 * ctiles * 256).reshape(2, ctiles, 16, ROWS)
        acc = _aligned(np.empty(AMX_GROUPS * m_len * ROWS + 8, np.float64), AMX_GROUPS * m_len * ROWS).reshape(
            AMX_GROUPS, m_len, ROWS)
        _tiles_begin(config)
        _wide()
        span_s, span_o = np.int64(spans & 0xFFFF), np.int64(spans >> 16 & 0xFFFF)
        for g0 in range(start, stop, AMX_GROUPS):
            gs = min(AMX_GROUPS, stop - g0)
            acc[:] = 0
            pending, slot, pm, pi, pb = False, 0, 0, 0, 0  # the call whose float step is pending: its planes c[1 - slot]
            for blk in range(-1, k_len // 256):
                nxt = blk + 1  # the next block's planes, decoded a block ahead: a tile load of bytes
                if nxt < k_len // 256:  # just stored waits for them (2-5x at few rows of x)
                    for i in range(gs):
                        g = g0 + i
                        _amx_planes(codes[g], hi[g if planes == 2 else 0], lut, planes, shift[g if has_zero else 0],
                                    has_zero, spans, 64 * nxt, sc[g if has_sc else 0], has_sc, osc[g if has_osc else 0],
                                    has_osc, piece, parts, digits, bits, small, b[nxt % 2, i])
                if blk < 0:
                    continue
                for m0 in range(0, m_len, 16):
                    for i in range(gs):
                        for h in range(halves):  # (Q8_0's pieces: half a block a call)
                            _amx_call(pieces, tiles, qx, m0 * k_len + 4096 * blk + 2048 * h, b[blk % 2, i], 2048 * h,
                                      c[slot], c[1 - slot], pending, shifts, small, acc[pi, pm:pm + 16], dx, xs, pb, pm,
                                      s[g0 + pi], span_s, o[g0 + pi if has_o else 0], span_o, has_o)
                            pending, slot, pm, pi, pb = True, 1 - slot, m0, i, 8 * blk + 4 * h if pieces else blk
            if pending:  # the last call's float step: one call more, on the last call's operands (its products unused)
                at = 512 * pb if pieces else 4096 * pb  # (pieces: pb = 8 blk + 4 h)
                _amx_call(pieces, tiles, qx, pm * k_len + at, b[(pb // 8 if pieces else pb) % 2, pi],
                          512 * (pb % 8) if pieces else 0, c[slot], c[1 - slot], pending, shifts, small,
                          acc[pi, pm:pm + 16], dx, xs, pb, pm, s[g0 + pi], span_s, o[g0 + pi if has_o else 0], span_o,
                          has_o)
            for i in range(gs):
                n0 = (g0 + i) * ROWS
                for m0 in range(0, out.shape[0], 16):
                    rows = min(16, out.shape[0] - m0)
                    _store(acc[i, m0:m0 + rows], bias, has_bias, out[m0:m0 + rows], n0, min(ROWS, n_len - n0))
        _tiles_end()

    return linear_amx


_amx_kernel = functools.cache(_make_amx)


def amx_pieces(w: PackedQ8) -> bool:
    """Whether Q8_0 activations of ``AMX_ROWS`` rows or more run on AMX against ``w`` (where the CPU has
    it): pieces of 32, scales of one level, ``v`` in an int8 (one plane), and K a multiple of 256 (the
    kernel's blocks)."""
    return w.piece == 32 and not w.has_sc and w.amx is not None and w.amx[:2] == (1, 1) and w.k % 256 == 0


def linear_q8_packed(dx, qx, w: PackedQ8, bias, out, isa=None, threads=None, act="Q8_0"):
    """``out`` (M, N) = the Q8_0 contract of rows ``dx``, ``qx`` against packed ``w`` (or the Q8_K one,
    ``act``), on instruction set ``isa`` (``isa.usable``'s; the best by default), on the pool's threads
    or one. A step of the dots' float work is a piece (Q8_0) or a block (Q8_K: ``w``'s scales then
    hold a block's ``d``, as ``BlockFormat.levels`` gives it)."""
    isa = best() if isa is None else isa
    ok, why = usable(isa)
    if not ok:
        raise ValueError(f"block-format linear cannot run on {isa} here: {why}")
    m = qx.shape[0]
    xsum = np.empty((m, qx.shape[1] // w.piece), np.int32)
    _piece_sums(w.piece)(qx, xsum)
    group = w.block // w.piece if act == "Q8_K" else 1
    if act == "Q8_K" and ((w.spans & 0xFFFF) != group or w.has_o and (w.spans >> 16 & 0xFFFF) != group):
        raise ValueError("Q8_K activations take weights whose scales (and offsets) are a block's d times integers")
    step = group | (256 if act == "Q8_K" else 32) // w.piece << 8  # pieces a float step, a block of x
    spans = w.spans | step << 48
    args = (np.ascontiguousarray(dx), np.ascontiguousarray(qx), xsum, w.codes, w.hi, w.lut, w.s, w.sc, w.o, w.osc,
            w.shift, np.int64(w.flags), np.int64(spans), np.zeros(1) if bias is None else bias, bias is not None, out)
    groups = w.codes.shape[0]
    pieces = act == "Q8_0" and amx_pieces(w)
    if isa == "amx" and (act == "Q8_K" or pieces) and m >= AMX_ROWS and w.amx is not None:  # (rows padded to 16: zeros, whose results are not stored)
        pad, (parts, digits, bits) = -(-m // 16) * 16, w.amx
        dx, qx, xsum = (np.concatenate([a, np.zeros((pad - m, a.shape[1]), a.dtype)]) for a in args[:3])
        plan = np.array([bits, w.piece], np.int64)
        small = int(w.has_o and not pieces)  # (Q8_0: x's piece sums, xs, in the float step)
        shifts = np.array([4 * i + bits * t for i in range(parts) for t in range(digits)] + [0] * small, np.int64)
        kernel = _amx_kernel(w.planes, parts, digits, small, pieces)
        qx = aligned_copy(qx.reshape(pad // 16, 16, -1, 64).transpose(0, 2, 1, 3)).reshape(pad, -1)
        args = (np.ascontiguousarray(dx.T), qx, np.ascontiguousarray(xsum.T)) + args[3:13] + (plan, shifts) + args[13:]
    else:
        kernel = _packed_kernel(isa, w.planes, w.flags, spans, w.piece // (8 if w.planes else 4))
        args = args[:11] + args[13:]
    if threads == 1:
        kernel(*args, 0, groups)
    else:
        parallel(kernel, groups, *args, grain=max(1, (1 << 18) // (ROWS * w.k * (m + 4))))
    return out


@functools.cache
def _piece_sums(piece):
    """``sums(qx, out)``: ``out[m, p]`` = the sum of x's codes ``qx[m, p * piece:(p + 1) * piece]`` (int8 to
    int32), ``piece`` a constant of the code (LLVM vectorizes its loop): 1.5 us at K = 14336, where
    NumPy's ``sum(axis=2, dtype=int32)`` took 9 and a loop to a run-time ``piece`` 8."""
    @kernel
    def sums(qx, out):
        for m in range(qx.shape[0]):
            for p in range(out.shape[1]):
                t = np.int32(0)
                for j in range(piece):
                    t = np.int32(t + np.int32(qx[m, piece * p + j]))
                out[m, p] = t

    return sums


@kernel
def quantize_q8_0(x, bits, d, out, start, stop):
    """Q8_0 blocks ``start .. stop`` of float32 ``x`` (n, 32), as ggml's ``quantize_row_q8_0_ref`` (and
    ``qarray._ggml._q8_0``) compute them: ``d = max|x| / 127`` and ``id = 1 / d`` (0 where d is 0) in
    float32, ``codes = roundf(x * id)`` (the product in float32, halves away from zero); ``out`` (n, 34)
    the blocks' bytes: ``d`` as float16, then the codes; ``d`` (n,) also as float32 (NaN or inf where
    the block holds one: the caller's check). ``bits``: ``x`` viewed as int32, whose magnitudes (sign
    cleared) order as the values do: an integer max (``_magnitude32``)."""
    _wide()
    for b in range(start, stop):
        db = _float(_magnitude32(bits, b)) / np.float32(127)
        inv = np.float32(1) / db if db != 0 else np.float32(0)
        d[b] = db
        h = _half(db)
        out[b, 0], out[b, 1] = np.uint8(h & 0xFF), np.uint8(h >> 8)
        for j in range(32):  # roundf in float32: a - floor(a) is exact, so the half is found exactly
            v = x[b, j] * inv
            a = abs(v)
            f = np.floor(a)
            r = f + np.float32(1) if a - f >= np.float32(0.5) else f
            out[b, 2 + j] = np.uint8(np.int32(-r if v < 0 else r) & 0xFF)


@kernel
def quantize_q8_k(x, bits, d, out, start, stop):
    """Q8_K blocks ``start .. stop`` of float32 ``x`` (n, 256), as ggml's ``quantize_row_q8_K_ref`` (and
    ``qarray._ggml._q8_k``): ``max`` the first value of largest magnitude (found on ``bits``, ``x`` as
    int32, whose magnitudes order as the finite values do), ``iscale = -127 / max``, codes
    ``min(127, nearest_int(iscale * x))`` as ggml's ``nearest_int`` reads them off the float32 bits of
    ``iscale * x + 1.5 * 2^23`` (an int8 keeps the low byte), ``d = 1 / iscale``; ``out`` (n, 292) the
    blocks' bytes: ``d`` (float32), the codes, their sums over 16 (int16); ``d`` (n,) also (NaN or
    inf where the block holds one: the caller's check). An all-zero block is zeros."""
    for b in range(start, stop):
        row, top = x[b], np.int32(0)
        for j in range(256):
            top = max(top, bits[b, j] & np.int32(0x7FFFFFFF))
        codes = out[b, 4:260]
        if top == 0:
            d[b] = 0
            out[b, :] = 0
            continue
        j = 0
        while bits[b, j] & np.int32(0x7FFFFFFF) != top:
            j += 1
        iscale = np.float32(-127) / row[j]
        for j in range(256):
            v = (_bits(np.float32(np.float32(row[j] * iscale) + np.float32(12582912))) & 0x7FFFFF) - 0x400000
            codes[j] = np.uint8(min(v, 127) & 0xFF)
        for t in range(16):
            s = 0
            for j in range(16 * t, 16 * t + 16):
                s += np.int32(np.int8(codes[j]))
            out[b, 260 + 2 * t], out[b, 261 + 2 * t] = np.uint8(s & 0xFF), np.uint8(s >> 8 & 0xFF)
        d[b] = np.float32(1) / iscale
        u = _bits(d[b])
        for i in range(4):
            out[b, i] = np.uint8(u >> 8 * i & 0xFF)
