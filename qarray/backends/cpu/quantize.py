"""quantize's and dequantize's kernels: integer codes (``quantize``; per-tensor
8-bit codes 64 at a time, ``quantize_lines``), floating-format codes (``quantize_float``), dequantize,
the per-block min and max of a blocked ``quantize_dynamic``, and the block
formats' decoder (``block_decode``, whose helpers ``blocks``' linear kernels
inline).

The layout is requantize's (``requantize``'s docstring): ``(outer, n, inner)``
data, ``(outer or 1, blocks, inner or 1)`` parameters, ``bidx[l]`` the block of
position ``l``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..._params import kept
from .llvm import _fence, _quantize_line, _store_line, _stream_line, _wide
from .pool import _KERNEL, always, kernel
from .requantize import _SOURCE, _bits, _first, _outer, _round_stochastic, _span

# The calls of NumpyBackend's primitives these kernels take (``numpy._fast_path``), by primitive;
# Backend's generic code runs the others: a Dask chunk's elements numbered in the whole array
# (``index``), floating formats from float64 and mxint8, the reductions of per-tensor and per-axis
# minmax (NumPy's own), float16 blocks.
ACCEPTS = {
    "quantize": always,
    "quantize_stochastic": lambda x, qp, key, index=None: index is None,
    "fake_quantize": lambda x, qp, dtype, mask=False, key=None, index=None, out=None: index is None,
    "quantize_float": lambda x, scale, qd, axis, block_size, saturate, *, mx=False, multiply=False:
        x.dtype != np.float64 and qd.name != "mxint8",
    "dequantize": always,
    "minmax": lambda x, axis, block_size: block_size is not None and x.dtype != np.float16,
}


@njit(inline="always")
def _q(v, s, z, lo, hi, key, index):
    """``v``'s code ``clamp(rint(v / s) + z, lo, hi)`` and ``rint(v / s) + z``
    before the clamp (the straight-through mask's); with ``key`` (Philox's
    ``(k0, k1, ...)``, not None) ``v / s`` rounds stochastically instead, by
    the random word of flat ``index`` (``qarray._philox``)."""
    if key is None:
        w = np.rint(v / s) + z
    else:
        t = v / s
        w = _round_stochastic(t, np.floor(t), _bits(index, key[0], key[1])) + z
    return min(max(w, lo), hi), w


# Quantize by the reciprocal. The division of every value cost quantize's
# kernels as much as the rest of their loop. Instead, ``reciprocals`` gives
# ``rl <= 1/s <= rh``, the neighbours of ``fl(1/s)`` (which is within half an
# ulp of 1/s), and ``_q_mul`` computes ``n = rint(v * rl)`` and flags the value
# unless ``rint(v * rh) == n``. Rounding to float and rint are monotone, and
# q = v/s lies between v*rl and v*rh, so rint(Q) of the division's quotient
# Q = fl(v/s) lies between rint(fl(v*rl)) and rint(fl(v*rh)): where they are
# equal, rint(Q) is n (as a float: a zero of either sign gives the same
# ``n + z``), so the code, the straight-through mask and fake_quantize's value
# are the division's bit for bit. This holds for every v, with no error bound:
# ties, overflow to inf (monotone too), subnormals and -0.0 included. NaN (NaN
# input, 0 * inf) compares unequal: flagged. Each run of ``RUN`` values with a
# flagged one is computed again by the division (``_q_run``), which also
# sums v - v, the NaN check (NaN and inf are flagged). Where 1/s is not a
# normal number (s 0, subnormal with 1/s beyond the range, huge, inf, NaN)
# ``reciprocals`` gives NaN: every value of that scale is flagged.
#
# How close (it sets how often a value flags, not whether a code is right): y =
# fl(v fl(1/s)) is within (2u + u^2)|v/s| of v/s (u = 2**-24 float32, 2**-53
# float64; one rounding of 1/s, one of the product), under 2.0001 ulp(y) as u|y|
# < ulp(y); fl(v rl) and fl(v rh) are 2 ulp(fl(1/s)) |v|, 2u|y| to 4u|y|, apart,
# so a value flags with probability under 4u|y| (2.4e-7|y| in float32: 3e-5 at
# |y| = 127; 2% of runs of 4096 at |y| ~ 20). Where codes reach far (16 and 32
# bits from float32: up to 4u * 65535 = 1.6% of values, every run) ``multiplies``
# says no: the division alone. Stochastic rounding keeps the division: it
# compares Q's exact fraction with a random word.
RUN = 4096  # values a flag covers, computed twice if one flags (runs of 1024: 1.25x the time)


def reciprocals(s):
    """``[rl, rh]`` (``s``'s float type, stacked) with ``rl <= 1/s <= rh``: the
    neighbours of ``fl(1/s)``, or NaN where that is not a normal number."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        r = 1 / s
    r = np.where((np.abs(r) >= np.finfo(r.dtype).tiny) & (np.abs(r) <= np.finfo(r.dtype).max), r, np.nan)
    return np.stack([np.nextafter(r, -np.inf), np.nextafter(r, np.inf)]).astype(s.dtype)


def multiplies(dtype, lo, hi):
    """Whether quantize multiplies (``_q_mul``) for ``dtype`` input and the
    clamp ``[lo, hi]``: not where values flag too often (see above); asked once
    a dtype pair (``numpy._bounds``, kept)."""
    return bool(2 * np.finfo(dtype).eps * (float(hi) - float(lo)) <= 2 ** -12)


@njit(inline="always")
def _q_mul(v, rl, rh, z, lo, hi):
    """``_q``'s code and ``w`` by ``v * rl``, and whether they might not be the
    division's (``rint(v * rh)`` differs, or NaN: see above)."""
    n = np.rint(v * rl)
    w = n + z
    return min(max(w, lo), hi), w, np.rint(v * rh) != n


@njit(inline="always")
def _put(out, mask, k, c, w, z, s, lo, hi, fake):
    """Store code ``c`` at ``out[k]``, or (``fake`` not None) the code dequantized
    as ``dequantize`` computes it: ``c - z`` (exact: below 2**17 in float32,
    2**33 in float64) in ``out``'s float type, times ``s`` there; with ``mask``,
    whether the unclamped ``w`` was inside ``[lo, hi]`` (``_set``). ``fake`` None
    prunes its branch as Numba compiles."""
    if fake is None:
        out[k] = np.int32(c)  # through int32: LLVM's float -> int8 conversion of a vector is 2x slower
    else:
        out[k] = c - z
        out[k] *= s
    _set(mask, k, (w >= lo) & (w <= hi))


def _set(a, k, v):
    """``a[k] = v``, nothing for None (chosen by type: Numba's pruning of an
    ``is None`` branch does not reach through the kernels' nested inlined calls)."""


@overload(_set)
def _set_impl(a, k, v):
    if isinstance(a, types.NoneType):
        return lambda a, k, v: None

    def impl(a, k, v):
        a[k] = v

    return impl


def _at(a, idx, j):
    """Element ``j``'s parameter: ``a`` (a scalar), ``a[j]``, or ``a[idx[j]]``."""


@overload(_at)
def _at_impl(a, idx, j):
    if not isinstance(a, types.Array):
        return lambda a, idx, j: a
    if idx is None or isinstance(idx, types.NoneType):
        return lambda a, idx, j: a[j]
    return lambda a, idx, j: a[idx[j]]


@njit(inline="always")
def _q_run(x, s, z, rl, rh, idx, j0, j1, lo, hi, mul, key, base, out, mask, fake, shift):
    """Quantize ``x[j0:j1]`` into ``out[j0 - shift:j1 - shift]`` (and ``mask``'s)
    (``_q``, ``_put``), element ``j``'s scale, zero point and reciprocal ``_at(s,
    idx, j)`` and so on, its flat index ``base + j - j0``: by ``_q_mul``, then
    again by the division if it flagged an element (or with ``key``). The
    indices are unsigned (no wraparound test to keep the loops from
    vectorizing) and the arrays whole (a slice a run would cost a reference
    count, an atomic both threads contend for). Returns the sum of ``v - v``
    over the division's run (NaN flags NaN/inf), 0 after the multiply alone
    (which flags NaN and inf)."""
    if key is None and mul:
        unsure = False
        for j in range(j0, j1):
            c, w, u = _q_mul(x[j], _at(rl, idx, j), _at(rh, idx, j), _at(z, idx, j), lo, hi)
            unsure |= u
            _put(out, mask, j - shift, c, w, _at(z, idx, j), _at(s, idx, j), lo, hi, fake)
        if not unsure:
            return x.dtype.type(0)
    acc = x.dtype.type(0)
    for j in range(j0, j1):
        v = x[j]
        acc += v - v
        c, w = _q(v, _at(s, idx, j), _at(z, idx, j), lo, hi, key, base + (j - j0))
        _put(out, mask, j - shift, c, w, _at(z, idx, j), _at(s, idx, j), lo, hi, fake)
    return acc


@njit(inline="always")
def _q_runs(x, s, z, rl, rh, idx, lo, hi, mul, key, base, out, mask, fake):
    """``_q_run`` over 1-D ``x`` in runs of ``RUN`` elements (each flagged alone)."""
    acc = x.dtype.type(0)
    n = np.uint64(x.shape[0])
    for j0 in range(np.uint64(0), n, np.uint64(RUN)):
        acc += _q_run(x, s, z, rl, rh, idx, j0, min(j0 + np.uint64(RUN), n), lo, hi, mul, key, base + j0, out, mask,
                      fake, np.uint64(0))
    return acc


@njit(inline="always")
def _flat_or_none(a, i0, i1):
    if a is None:
        return None
    return a.reshape(-1)[i0:i1]


@njit(inline="always")
def _q_row(x, s, z, o, l, po, b, lo, hi, key, base, out, mask, fake):
    """Quantize row ``x[o, l, :]`` by the division (``_q``, ``_put``), its
    elements' flat indices from ``base``, the parameters ``[po, b, i]`` for
    element ``i`` where they have a third axis (blocked along an outer axis),
    else ``[po, b, 0]``; returns the sum of ``v - v`` (NaN flags NaN/inf).
    One loop, indexed, not sliced: rows are short (a block's 32 values where
    the blocks lie along the last axis), and where each row went through
    ``_q_runs`` (the multiply, then the division) Numba kept a reference count
    of each array a row, an atomic: 70% of the time (4096 x 4096 float32,
    blocks of 32 along the last axis: 8.5 -> 33 ms)."""
    step = np.int64(s.shape[2] > 1)
    acc = x.dtype.type(0)
    for i in range(x.shape[2]):
        k, v = i * step, x[o, l, i]
        acc += v - v
        c, w = _q(v, s[po, b, k], z[po, b, k], lo, hi, key, base + np.uint64(i))
        _put(out, mask, (o, l, i), c, w, z[po, b, k], s[po, b, k], lo, hi, fake)
    return acc


@njit(inline="always")
def _span_or_none(a, o, l0, l1):
    if a is None:
        return None
    return _span(a, o, l0, l1)


@njit(inline="always")
def _q_col(x, s, z, rl, rh, o, po, bidx, l0, l1, lo, hi, mul, key, base, out, mask, fake):
    """Quantize ``x[o, l0:l1, 0]`` whose parameters change along it (``_q_runs``),
    its elements' flat indices from ``base``."""
    xr, orow, mrow = _span(x, o, l0, l1), _span(out, o, l0, l1), _span_or_none(mask, o, l0, l1)
    if s.shape[1] == x.shape[1]:  # per-axis: parameter l for element l
        return _q_runs(xr, _span(s, po, l0, l1), _span(z, po, l0, l1), _span(rl, po, l0, l1),
                       _span(rh, po, l0, l1), None, lo, hi, mul, key, base, orow, mrow, fake)
    p = s.shape[0]  # blocked: parameter bidx[l] for element l
    return _q_runs(xr, s.reshape(p, s.shape[1])[po], z.reshape(p, s.shape[1])[po],
                   rl.reshape(p, s.shape[1])[po], rh.reshape(p, s.shape[1])[po],
                   bidx[l0:l1], lo, hi, mul, key, base, orow, mrow, fake)


@njit(inline="always")
def _dq_row(q, s, z, o, l, po, b, out):
    if s.shape[2] > 1:
        for i in range(q.shape[2]):
            out[o, l, i] = q[o, l, i] - z[po, b, i]
            out[o, l, i] *= s[po, b, i]
    else:
        sr = s[po, b, 0]
        zr = z[po, b, 0]
        for i in range(q.shape[2]):
            out[o, l, i] = q[o, l, i] - zr
            out[o, l, i] *= sr


@njit(inline="always")
def _dq_col(q, s, z, o, po, bidx, l0, l1, out):
    qr, orow = _span(q, o, l0, l1), _span(out, o, l0, l1)
    if s.shape[1] == q.shape[1]:
        sr, zr = _span(s, po, l0, l1), _span(z, po, l0, l1)
        for j in range(l1 - l0):
            orow[j] = qr[j] - zr[j]
            orow[j] *= sr[j]
    else:
        br = bidx[l0:l1]
        for j in range(l1 - l0):
            orow[j] = qr[j] - z[po, br[j], 0]
            orow[j] *= s[po, br[j], 0]


# Large per-tensor quantize and requantize to 8-bit codes (``NumpyBackend``, from
# ``STREAM`` elements, x86-64): each 64 codes computed as the kernels above
# compute them, then stored as one cache line by a non-temporal store, which
# neither reads the line first (16 of the 96 MB that 2^24 float32 values move)
# nor evicts the input as it streams in. 2^24 float32 -> qint8, interleaved with
# torch's quantize_per_tensor (which stores through the cache): 1.19x -> 1.10x
# its time (bench_overhead.py); requantize int32 -> int8 likewise.
STREAM = 1 << 22


def _make(source):
    """quantize's and dequantize's kernels, ``source`` (``_SOURCE``) in their closures: the cache key."""

    # fastmath "reassoc" only lets the sum of ``v - v`` (0, or NaN for NaN and inf
    # input) vectorize; it allows no other change of the arithmetic.
    @njit(**_KERNEL, fastmath={"reassoc"})
    def quantize(x, s, z, rl, rh, bidx, lo, hi, mul, fake, key, out, mask, start, stop):
        """``out = clamp(rint(x / s) + z, lo, hi)``, with ``mul`` (``multiplies``)
        by ``rl, rh = reciprocals(s)`` (``_q_run``) (with ``key``, ``(k0, k1,
        first)``: stochastic rounding, each element's random word Philox's of
        its flat index, ``first`` plus its C-order index in ``x``); with
        ``fake`` (not None) that code dequantized into float ``out``, and with
        ``mask`` whether each value was inside ``[lo, hi]`` before the clamp
        (``_q``). Returns NaN if ``x`` had NaN or inf."""
        _ = source
        _wide()
        first = _first(key)
        o_n, n, i_n = x.shape
        pos = np.int64(s.shape[0] > 1)
        bad = x.dtype.type(0)
        if s.size == 1:  # one scale (per-tensor): the tasks' rows are one run of memory
            a, b = start * i_n, stop * i_n
            return _q_runs(x.reshape(-1)[a:b], s[0, 0, 0], z[0, 0, 0], rl[0, 0, 0], rh[0, 0, 0], None, lo, hi, mul,
                           key, first + np.uint64(a), out.reshape(-1)[a:b], _flat_or_none(mask, a, b), fake)
        if i_n == 1:  # parameters change along the contiguous axis: runs along it
            o0, o1 = _outer(n, start, stop)
            for o in range(o0, o1):
                l0, l1 = max(start - o * n, 0), min(stop - o * n, n)
                bad += _q_col(x, s, z, rl, rh, o, np.int64(o) * pos, bidx, l0, l1, lo, hi, mul, key,
                              first + np.uint64(o * n + l0), out, mask, fake)
        else:
            for t in range(start, stop):
                o = t // n
                bad += _q_row(x, s, z, o, t - o * n, np.int64(o) * pos, bidx[t - o * n], lo, hi, key,
                              first + np.uint64(t) * np.uint64(i_n), out, mask, fake)
        return bad

    @kernel
    def dequantize(q, s, z, bidx, out, start, stop):
        """``out = float(q - z) * s`` in ``out``'s float type (one rounding)."""
        _ = source
        o_n, n, i_n = q.shape
        pos = np.int64(s.shape[0] > 1)
        if i_n == 1:
            o0, o1 = _outer(n, start, stop)
            for o in range(o0, o1):
                _dq_col(q, s, z, o, np.int64(o) * pos, bidx, max(start - o * n, 0), min(stop - o * n, n), out)
        else:
            for t in range(start, stop):
                o = t // n
                _dq_row(q, s, z, o, t - o * n, np.int64(o) * pos, bidx[t - o * n], out)

    return quantize, dequantize


quantize, dequantize = _make(_SOURCE)


def _make_lines(source, isa, nt):
    """quantize's kernel for flat float32 ``x`` and 8-bit ``out`` (at a 64-byte
    boundary with ``nt``) with one scale, zero point and reciprocals (float32;
    ``mul`` as quantize's), on blocks of 64 elements ``start..stop`` (a short
    last block as usual): with ``isa`` "avx512bw", each by ``_quantize_line``
    (``_stream_line`` with ``nt``), else ("sse2", ``nt`` only) by the portable
    loops; with ``nt`` the codes go out by non-temporal stores (``_stream_line``'s,
    ``_store_line``). Returns NaN if ``x`` had NaN or inf, as quantize's kernel
    does."""

    @njit(**_KERNEL, fastmath={"reassoc"})  # reassoc: the division's sum of x - x vectorizes (NaN check)
    def quantize_lines(x, s, z, rl, rh, lo, hi, mul, out, start, stop):
        """With "avx512bw", ``_quantize_line`` multiplies and stores each block;
        a block where a value flagged goes to the division (``_q_run``, into
        ``out`` directly). 2^24
        float32 -> qint8, 2 threads, alternating with torch's quantize_per_tensor
        (every pool passive): 1.12-1.17x -> 0.91-0.96x its time. Without ``nt``
        (below ``STREAM``), one thread: 2^18 values 53 -> 43 us, 2^16 26 -> 22 us;
        2^20 (L3 to L2) 0.23 ms either way.

        With "sse2" a run of ``RUN`` values is multiplied here, element by element
        (``_q_mul``, ``_put``), and goes to ``_q_run`` only where one flagged,
        then out by ``_store_line``: ``_q_run`` inlined for each run took a
        reference count of its arrays, an atomic that waits for the streamed
        stores before it to drain (2^24 float32, 2 threads: 2.8-3.2 -> 2.2-2.5
        ms)."""
        _ = source
        _wide()
        bad = x.dtype.type(0)
        full = min(stop, x.size // 64)
        if isa == "avx512bw":  # (chosen where quotients are multiplied: ``mul``)
            zi, loi, hii = np.int32(z), np.int32(lo), np.int32(hi)
            for b in range(start, full):
                j = np.uint64(b * 64)
                if nt:
                    flagged = _stream_line(x, j, rl, rh, zi, loi, hii, out, np.int64(j))
                else:
                    flagged = _quantize_line(x, j, rl, rh, zi, loi, hii, out, np.int64(j))
                if flagged:  # (rare: stored through the cache, streamed or not)
                    bad += _q_run(x, s, z, rl, rh, None, j, j + np.uint64(64), lo, hi, False, None, j, out, None, None,
                                  np.uint64(0))
        else:
            run = np.empty(RUN, out.dtype)
            for b0 in range(start, full, RUN // 64):
                b1 = min(b0 + RUN // 64, full)
                j0, j1 = np.uint64(b0 * 64), np.uint64(b1 * 64)
                unsure = not mul
                if mul:
                    for j in range(j0, j1):
                        c, w, u = _q_mul(x[j], rl, rh, z, lo, hi)
                        unsure |= u
                        _put(run, None, j - j0, c, w, z, s, lo, hi, None)
                if unsure:  # the division
                    bad += _q_run(x, s, z, rl, rh, None, j0, j1, lo, hi, False, None, j0, run, None, None, j0)
                for b in range(b0, b1):
                    _store_line(out, np.int64(b * 64), run, np.int64((b - b0) * 64))
        if nt:
            _fence()
        t0, t1 = np.uint64(max(start, full) * 64), np.uint64(min(stop * 64, x.size))
        return bad + _q_run(x, s, z, rl, rh, None, t0, t1, lo, hi, mul, None, t0, out, None, None, np.uint64(0))

    return quantize_lines


# by instruction set and whether the codes are streamed (non-temporal stores);
# without either, quantize's kernel
quantize_lines = {(isa, nt): _make_lines(_SOURCE, isa, nt)
                  for isa, nt in (("sse2", True), ("avx512bw", True), ("avx512bw", False))}


# -- floating formats: float32 -> format codes ------------------------------------------------
_I = np.int32  # Numba widens int32 arithmetic to int64; the casts keep it 8 lanes wide


@njit(inline="always")
def _fcode(v, f):
    """The format code of float32 ``v`` and whether ``v`` is NaN, rounding to
    nearest, ties to even, on the bits ``b`` of ``|v|``: in the format's normal
    range (``b >= top``) the mantissa rounds to ``m`` bits (``sh = 23 - m``; a
    carry moves into the exponent; ``k`` is half an ulp less the exponent bias);
    below it the float32 addition of ``magic = 2**(emin - m + 23)`` (bits
    ``magic_bits``) rounds to the subnormal step ``2**(emin - m)``. ``sat``: the
    largest finite value when saturating (``|v|`` is clamped to it first; NaN
    stays NaN), else 0. ``maxc`` is the largest finite magnitude code, ``ovf`` the
    code beyond it (inf or NaN), ``nanc`` the NaN code (bit 8 set: no sign, the
    fnuz formats; ``maxc`` for a format without NaN). ``zeros``: 0 every zero
    keeps its sign, 1 an exact -0 becomes +0 (ONNX's +0 zero point for
    float4/float6), 2 no zero has a sign (fnuz)."""
    top, k, sh, magic, magic_bits, sat, maxc, ovf, nanc, sign_at, zeros = f
    u = np.float32(v).view(_I)
    a = abs(v)
    if sat:
        a = np.float32(sat) if np.float32(sat) < a else a
    b = np.float32(a).view(_I)
    if b >= _I(top):
        c = _I(_I(b + _I(k) + _I(_I(b >> _I(sh)) & _I(1))) >> _I(sh))
    else:
        c = _I(np.float32(a + np.float32(magic)).view(_I) - _I(magic_bits))
    if not sat:
        c = _I(ovf) if c > _I(maxc) else c  # overflow and inf
    c = _I(nanc) if v != v else c
    sign = _I(_I(u >> _I(31 - sign_at)) & _I(1 << sign_at))
    if zeros == 1:
        sign = _I(0) if u == _I(-0x80000000) else sign
    elif zeros == 2:
        sign = _I(0) if (c == _I(0)) | (c >= _I(256)) else sign
        c = _I(c & _I(0xFF))
    return np.uint8(_I(c | sign)), v != v


@njit(inline="always")
def _frow(x, s, o, l, po, b, mul, f, out):
    """``out[o, l] = code(x[o, l] / s)`` (``x * s`` when ``mul``); returns the NaN
    count of a format without NaN (NaN is an error there), else 0."""
    xr, orow, sr = x[o, l], out[o, l], s[po, b]
    count = f[8] == f[6]  # nanc == maxc
    nans = 0
    if sr.size > 1:
        for i in range(xr.size):
            orow[i], nan = _fcode(xr[i] * sr[i] if mul else xr[i] / sr[i], f)
            nans += count and nan
    else:
        s0 = sr[0]
        for i in range(xr.size):
            orow[i], nan = _fcode(xr[i] * s0 if mul else xr[i] / s0, f)
            nans += count and nan
    return nans


def _make_quantize_float(mul, consts):
    """The kernel ``out = code(x / s)`` (``x * s`` when ``mul``) in float32 for one
    floating format: ``consts`` (:func:`_fcode`'s, from the format's
    ``qarray._formats.Codes``: see :func:`quantize_float`) are closure constants,
    so the shifts are immediate, the branches fold away and the loop vectorizes
    (1.5x faster than the same values as arguments). The closure holds plain
    numbers only (a function in it would change Numba's cache key in every
    process). Returns the number of NaN quotients."""

    @kernel
    def quantize_float(x, s, bidx, out, start, stop):
        o_n, n, i_n = x.shape
        pos = np.int64(s.shape[0] > 1)
        nans = 0
        for t in range(start, stop):
            o = t // n
            nans += _frow(x, s, o, t - o * n, np.int64(o) * pos, bidx[t - o * n], mul, consts, out)
        return nans

    return quantize_float


def quantize_float(codes, mul):
    """The kernel of :func:`_make_quantize_float` for ``codes`` (a
    ``qarray._formats.Codes``) and ``mul``, made once each (kept)."""
    return _float_kernel(*(int(v) for v in codes), bool(mul))


@kept
def _float_kernel(m, emin, maxc, ovf, nanc, sign_at, zeros, mul):
    e, frac = divmod(maxc, 1 << m)  # the largest finite value, for saturation
    sat = float(np.float32((1 + frac / 2.0**m) * 2.0 ** (emin + e - 1))) if ovf == maxc else 0.0
    magic = 2.0 ** (emin - m + 23)  # exact in float32
    top = (127 + emin) << 23  # the bits of 2**emin
    k = (1 << (22 - m)) - 1 - (((126 + emin) << m) << (23 - m))  # half an ulp, less the bias
    consts = (top, k, 23 - m, magic, int(np.float32(magic).view(np.uint32)), sat, maxc, ovf, nanc, sign_at, zeros)
    return _make_quantize_float(mul, consts)


@kernel
def block_minmax(x, step, lo, hi, start, stop):
    """``lo``, ``hi`` ``(outer, blocks, inner)``: the min and max of each block of
    ``step`` positions along ``x``'s middle axis (the last one short), for
    blocks ``t = o * blocks + b`` in ``start..stop``; NaN propagates, as in
    NumPy's min and max."""
    o_n, n, i_n = x.shape
    blocks = lo.shape[1]
    for t in range(start, stop):
        o = t // blocks
        b = t - o * blocks
        l0 = b * step
        for i in range(i_n):
            lo[o, b, i] = x[o, l0, i]
            hi[o, b, i] = x[o, l0, i]
        for l in range(l0 + 1, min(l0 + step, n)):
            for i in range(i_n):
                lo[o, b, i] = np.minimum(lo[o, b, i], x[o, l, i])
                hi[o, b, i] = np.maximum(hi[o, b, i], x[o, l, i])


# -- block formats (qarray._blocks): bytes -> float32, the decoder blocks.py's linear kernels inline -

@njit(inline="always")
def block_codes(raw, b, segments, code):
    """The codes of block ``b`` of ``raw`` (uint8 ``(blocks, nbytes)``) into ``code`` (int32, a block's
    length), read segment by segment (``Field.segments``: first value, count, first byte, byte stride,
    shift, mask, value shift): :func:`block_decode`'s and ``blocks``' decoders."""
    code[:] = 0
    for g in range(segments.shape[0]):
        v0, n, b0, st = segments[g, 0], segments[g, 1], segments[g, 2], segments[g, 3]
        sh, m, vs = segments[g, 4], segments[g, 5], segments[g, 6]
        if st == 1:  # a run of bytes (most segments): a loop LLVM vectorizes
            row, part = raw[b, b0:b0 + n], code[v0:v0 + n]
            for i in range(n):
                part[i] |= ((np.int32(row[i]) >> sh) & m) << vs
        else:
            for i in range(n):
                code[v0 + i] |= ((np.int32(raw[b, b0 + i * st]) >> sh) & m) << vs


@kernel
def block_decode(raw, out, segments, values, scale, offset, zero, has_offset, has_zero, start, stop):
    """``out[b, e] = scale[b, j] * (values[q] - zero[b, j]) + offset[b, j]`` for blocks ``start:stop``,
    the codes ``q`` read segment by segment (``Field.segments``: first value, count, first byte, byte
    stride, shift, mask, value shift); in float32 as the formats' references compute it: one rounding
    for the multiply and one for the add (none where there is no offset: -0.0 stays -0.0). The scales,
    offsets and zeros (``BlockFormat.parameters``) are exact; ``values[q] - zero`` is an exact integer."""
    code = np.empty(out.shape[1], np.int32)
    for b in range(start, stop):
        block_values(raw, b, segments, values, scale, offset, zero, has_offset, has_zero, code, out[b])


@njit(inline="always")
def block_values(raw, b, segments, values, scale, offset, zero, has_offset, has_zero, code, out):
    """Block ``b``'s values into ``out`` (float32, a block's length): :func:`block_decode`'s
    arithmetic, which ``cpu.blocks`` shares."""
    block, nsub = out.shape[0], scale.shape[1]
    sub = block // nsub
    block_codes(raw, b, segments, code)
    for j in range(nsub):
        s = scale[b, j]
        z = zero[b, j] if has_zero else np.float32(0)
        if has_offset:
            o = offset[b, j]
            for e in range(j * sub, j * sub + sub):
                out[e] = s * (values[code[e]] - z) + o
        elif has_zero:
            for e in range(j * sub, j * sub + sub):
                out[e] = s * (values[code[e]] - z)
        else:
            for e in range(j * sub, j * sub + sub):
                out[e] = s * values[code[e]]
