"""Numba kernels behind ``NumpyBackend``'s elementwise primitives.

Imported only when a primitive first runs on a large enough array with Numba
installed. Each kernel sees its input as ``(outer, n, inner)`` and its
parameters as ``(outer or 1, blocks, inner or 1)``, with ``bidx[l]`` the block
of position ``l`` along the axis (``qarray._params.Layout``, one of its
``pieces``: per-tensor data is viewed as ``(1, rows, cols)`` with one
parameter slot). That one layout covers per-tensor, per-axis and blocked
parameters. Inner loops run over contiguous memory with
only arithmetic in them, so LLVM vectorizes them.

Every kernel is compiled serial and ``nogil`` and takes a range of tasks
``start, stop`` (rows ``(o, l)`` of the ``(outer, n, inner)`` view, flattened)
as its last two arguments; :func:`parallel` splits the tasks among threads.
Numba's ``parallel=True`` would do the same, but compiles each ``prange``
loop as one more function: 5x the compile time (7.5 s against 1.4 s for one
requantize specialization), which every user pays at the first call with a
new dtype.

The integer arithmetic of requantize is ``qarray._fixed_point.rescale``
compiled as it stands: the same source as the generic NumPy and CuPy code.
One requantize kernel is compiled per rounding code (a closure constant, so
its branches fold away; Numba's cache key includes it).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload, register_jitable

from .. import _fixed_point, _philox
from .._config import THREADS
from .._fixed_point import FLOAT, IDENTITY, ROUNDINGS

# error_model="numpy": no check for division by zero, which would keep loops
# from vectorizing (Numba's prange bodies compile with it too)
_KERNEL = dict(nogil=True, cache=True, error_model="numpy")
kernel = njit(**_KERNEL)
_pool: list = [0, None, []]  # [threads, ThreadPoolExecutor of threads - 1, their native thread ids]
# a forked child has none of the parent's pool threads: it starts its own
os.register_at_fork(after_in_child=lambda: _pool.__setitem__(slice(None), [0, None, []]))


# Elements worth handing to another thread: waking a sleeping pool thread and
# waiting for it costs ~50 us on the 2-core machine, where quantize float32 ->
# int8 runs ~16 elements a ns; 2 threads beat 1 from ~2M elements (0.14 ms).
GRAIN = 1 << 20
# the time of an element, in quantize's: a second thread gets GRAIN // COST elements
SOFTMAX_COST = 16  # gathers and a division a distance
BINARY_COST = 4  # three requantizes
STOCHASTIC_COST = 16  # ten Philox rounds
PARTS = 4  # parts a thread, claimed in turn: a thread that wakes late takes fewer


try:
    import ctypes

    _libc = ctypes.CDLL(None)
except OSError:  # no C library to ask (not Linux)
    _libc = None


def _cpu_of_caller():
    """The CPU the calling thread runs on (Linux's ``sched_getcpu``), or None."""
    try:
        return _libc.sched_getcpu()
    except AttributeError:  # no C library, or one without sched_getcpu
        return None


def _away_from_caller():
    """Keep the pool threads off the caller's CPU for this call. Woken on the
    waker's CPU (Linux wakes a thread where its waker runs), a pool thread
    preempted the calling thread, which then waited a scheduler slice (~2-3 ms)
    while another library's OpenMP threads still spun on the other core after
    their own call (torch, onnxruntime, OpenBLAS): quantize 2^24 right after a
    torch call took 1.9x its time alone, 1.1-1.2x with this."""
    here = _cpu_of_caller()
    if here is None or not hasattr(os, "sched_setaffinity"):
        return
    others = os.sched_getaffinity(0) - {here}
    for tid in _pool[2] if others else ():
        try:
            os.sched_setaffinity(tid, others)
        except OSError:  # a thread that has ended, a set the system refuses: nothing to win
            pass


def parallel(k, tasks, *args, grain=1, parts=PARTS):
    """``k(*args, start, stop)`` over ``range(tasks)`` on up to
    ``qarray.set_num_threads`` threads (at most ``NUMBA_NUM_THREADS``), each
    thread's share at least ``grain`` tasks. The tasks are cut into ``parts``
    contiguous parts a thread, and each thread, the calling one first, claims
    the next unclaimed part until none is left: a pool thread that wakes late
    (its core busy with another library's spinning threads) takes fewer parts
    instead of holding up the call. Returns the parts' results, in order."""
    if tasks < 2 * grain or THREADS[0] < 2:  # small calls: no more than this on their way to the kernel
        return [k(*args, 0, tasks)]
    n = min(THREADS[0], tasks // max(grain, 1), numba.config.NUMBA_NUM_THREADS)
    if n < 2:
        return [k(*args, 0, tasks)]
    if _pool[0] < n:
        tids = []  # each thread's id, as it starts (on the first calls)
        _pool[:] = n, ThreadPoolExecutor(n - 1, thread_name_prefix="qarray",
                                         initializer=lambda: tids.append(threading.get_native_id())), tids
    _away_from_caller()
    parts = min(tasks, n * parts)
    cut = [tasks * i // parts for i in range(parts + 1)]
    results = [None] * parts
    claim = itertools.count()  # next() is atomic under the GIL

    def work():
        i = next(claim)
        while i < parts:
            results[i] = k(*args, cut[i], cut[i + 1])
            i = next(claim)

    rest = [_pool[1].submit(work) for _ in range(n - 1)]
    work()
    for f in rest:
        f.result()
    return results

register_jitable(inline="always")(_fixed_point.wide)  # what rescale calls, compiled where a kernel calls it
# rescale is called, not inlined into Numba's IR: the rounding code and narrow
# reach it as literals (closure constants), so each (code, narrow) compiles
# without the other branches, once a process, and LLVM inlines it into the
# kernel's loops (the same instructions). Inlined at the IR level, Numba copied
# its branches' IR into every call site of every specialization: half of each
# requantize, conv or epilogue compile (requantize int32 -> int8: 12 s -> 5 s).
_rescale = njit(_fixed_point.rescale)
_rescale_stochastic = njit(inline="always")(_fixed_point.rescale_stochastic)
for _f in (_philox._round, _philox.philox4x32):  # what _philox.bits calls, compiled where a kernel calls it
    register_jitable(inline="always")(_f)
_bits = njit(inline="always")(_philox.bits)
_round_stochastic = njit(inline="always")(_philox.round_stochastic)
# Numba's cache sees only this file's timestamp, not _fixed_point.py's or
# _philox.py's; closure values are part of its cache key (globals are not), so
# the kernels that use them carry this one.
_SOURCE = "".join(hashlib.sha256(inspect.getsource(m).encode()).hexdigest() for m in (_fixed_point, _philox))


@njit(inline="always")
def _first(key):
    """The flat index of a kernel's first element: ``key[2]`` of a stochastic
    rounding's ``(k0, k1, first)`` (unused without one)."""
    if key is None:
        return np.uint64(0)
    return key[2]


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


@functools.lru_cache(maxsize=64)
def multiplies(dtype, lo, hi):
    """Whether quantize multiplies (``_q_mul``) for ``dtype`` input and the
    clamp ``[lo, hi]``: not where values flag too often (see above)."""
    return bool(2 * np.finfo(dtype).eps * (float(hi) - float(lo)) <= 2 ** -12)


@njit(inline="always")
def _q_mul(v, rl, rh, z, lo, hi):
    """``_q``'s code and ``w`` by ``v * rl``, and whether they might not be the
    division's (``rint(v * rh)`` differs, or NaN: see above)."""
    n = np.rint(v * rl)
    w = n + z
    return min(max(w, lo), hi), w, np.rint(v * rh) != n


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
def _row_or_none(a, o, l):
    if a is None:
        return None
    return a[o, l]


@njit(inline="always")
def _q_row(x, s, z, rl, rh, o, l, po, b, lo, hi, mul, key, base, out, mask, fake):
    """Quantize row ``x[o, l, :]`` (``_q_runs``), its elements' flat indices from ``base``."""
    m = _row_or_none(mask, o, l)
    if s.shape[2] > 1:  # blocked along an outer axis: parameter i for element i
        return _q_runs(x[o, l], s[po, b], z[po, b], rl[po, b], rh[po, b], None, lo, hi, mul, key, base, out[o, l],
                       m, fake)
    return _q_runs(x[o, l], s[po, b, 0], z[po, b, 0], rl[po, b, 0], rh[po, b, 0], None, lo, hi, mul, key, base,
                   out[o, l], m, fake)


@njit(inline="always")
def _span(a, o, l0, l1):
    """``a[o, l0:l1, 0]`` of ``(outer, n, 1)`` data as a C-contiguous 1-D view,
    indexed from 0: an index that starts at ``l0``, or a 2-D view, leaves Numba
    checking every index for wraparound, and the loop no longer vectorizes."""
    return a.reshape(a.shape[0], a.shape[1])[o, l0:l1]


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
def _outer(n, start, stop):
    """The outer indices ``o`` whose rows ``o * n + l`` meet ``start..stop``."""
    if n == 0:
        return 0, 0
    return start // n, (stop + n - 1) // n


def _make_quantize(source):
    """quantize's kernel, ``source`` (``_SOURCE``) in its closure: the cache key."""

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
                bad += _q_row(x, s, z, rl, rh, o, t - o * n, np.int64(o) * pos, bidx[t - o * n], lo, hi, mul, key,
                              first + np.uint64(t) * np.uint64(i_n), out, mask, fake)
        return bad

    return quantize


quantize = _make_quantize(_SOURCE)


# -- vector code in LLVM IR, as ``_numba_gemm``'s VNNI dot is written: only what
# Numba's loops do not emit (they have no vector types, store hints or byte
# permutes); the arithmetic stays in Numba
_V64 = ir.VectorType(ir.IntType(8), 64)
_V8Q = ir.VectorType(ir.IntType(64), 8)


def _splat(builder, value, vtype):
    """``value`` in every lane of a ``vtype``."""
    v = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vtype, None),
                                  ir.Constant(ir.VectorType(ir.IntType(32), vtype.count), None))


# Large per-tensor quantize and requantize to 8-bit codes (``NumpyBackend``, from
# ``STREAM`` elements, x86-64): each 64 codes computed as the kernels above
# compute them, then stored as one cache line by a non-temporal store, which
# neither reads the line first (16 of the 96 MB that 2^24 float32 values move)
# nor evicts the input as it streams in. 2^24 float32 -> qint8, interleaved with
# torch's quantize_per_tensor (which stores through the cache): 1.19x -> 1.10x
# its time (bench_overhead.py); requantize int32 -> int8 likewise.
STREAM = 1 << 22


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


@intrinsic
def _fence(typingctx):
    """``sfence``: the non-temporal stores before it are visible before any store after it."""
    def codegen(context, builder, sig, args):
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.x86.sse.sfence"), [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(**_KERNEL, fastmath={"reassoc"})  # reassoc: quantize's sum of x - x vectorizes (NaN check)
def quantize_stream(x, s, z, rl, rh, lo, hi, mul, out, start, stop):
    """quantize's kernel for flat float32 ``x`` and 8-bit ``out`` (at a 64-byte
    boundary) with one scale, zero point and reciprocals (float32; ``mul`` as
    quantize's): blocks of 64 elements ``start..stop``, computed ``RUN`` at a
    time (``_q_run``), each stored by ``_store_line`` (a short last block as
    usual). Returns NaN if ``x`` had NaN or inf, as quantize's kernel does."""
    _wide()
    run = np.empty(RUN, out.dtype)
    bad = x.dtype.type(0)
    full = min(stop, x.size // 64)
    for b0 in range(start, full, RUN // 64):
        b1 = min(b0 + RUN // 64, full)
        j0 = np.uint64(b0 * 64)
        bad += _q_run(x, s, z, rl, rh, None, j0, np.uint64(b1 * 64), lo, hi, mul, None, j0, run, None, None, j0)
        for b in range(b0, b1):
            _store_line(out, np.int64(b * 64), run, np.int64((b - b0) * 64))
    _fence()
    t0, t1 = np.uint64(max(start, full) * 64), np.uint64(min(stop * 64, x.size))
    return bad + _q_run(x, s, z, rl, rh, None, t0, t1, lo, hi, mul, None, t0, out, None, None, np.uint64(0))


def _make_requantize_stream(code, narrow):
    """requantize's kernel for flat integer ``q`` and 8-bit ``out`` (at a 64-byte
    boundary) with one ``Requant`` (its int64 and float64 scalars), blocks as
    ``quantize_stream``'s; one per rounding code and width, as ``_make_requantize``."""
    source = _SOURCE

    @kernel
    def requantize_stream(q, zi, zo, m, sh, f, lo, hi, out, start, stop):
        _ = source
        line = np.empty(64, out.dtype)
        full = min(stop, q.size // 64)
        for b in range(start, full):
            qs = q[b * 64:b * 64 + 64]
            for j in range(64):
                line[j] = _rq(np.int64(qs[j]) - zi, zo, m, sh, f, lo, hi, code, narrow)
            _store_line(out, np.int64(b * 64), line, np.int64(0))
        _fence()
        for i in range(max(start, full) * 64, min(stop * 64, q.size)):
            out[i] = _rq(np.int64(q[i]) - zi, zo, m, sh, f, lo, hi, code, narrow)

    return requantize_stream


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


@kernel
def dequantize(q, s, z, bidx, out, start, stop):
    """``out = float(q - z) * s`` in ``out``'s float type (one rounding)."""
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


@kernel
def lut(u, table, out, start, stop):
    """``out[i] = table[u[i]]`` (flat, ``u`` unsigned so every index is in range)."""
    ur, orow = u[start:stop], out[start:stop]  # indexed from 0 (see _span)
    for i in range(stop - start):
        orow[i] = table[ur[i]]


def _make_rq(rescale):
    """``_rq`` with ``rescale`` (``_fixed_point.rescale`` compiled one way or the other)."""

    @njit(inline="always")
    def rq(d, zo, m, sh, f, lo, hi, code, narrow):
        """One requantized value from ``d = q - zp_in`` (``qarray._fixed_point.Requant``)."""
        if code == FLOAT:  # clamp in float64: a huge product must not overflow int64
            return np.int64(min(max(np.rint(np.float64(d) * f + zo), lo), hi))
        if code == IDENTITY:
            return min(max(d + zo, lo), hi)
        if narrow:  # d fits in int32: saying so lets LLVM use a 32 x 32 -> 64-bit multiply
            d = np.int64(np.int32(d))
        return min(max(rescale(d, m, sh, code, narrow) + zo, lo), hi)

    return rq


_rq = _make_rq(_rescale)
# binary's operands: their narrow flags are run-time values there, not literals, and
# its kernel keeps rescale inlined into Numba's IR (the machine code it had)
_rq_inlined = _make_rq(njit(inline="always")(_fixed_point.rescale))


@njit(inline="always")
def _rq_at(d, zo, m, sh, f, lo, hi, code, narrow, key, index):
    """``_rq``, or with ``key`` (Philox's ``(k0, k1, ...)``, not None) ``d * m / 2**sh``
    rounded stochastically by the random word of flat ``index``
    (``_fixed_point.rescale_stochastic``), plus ``zo``, clamped."""
    if key is None:
        return _rq(d, zo, m, sh, f, lo, hi, code, narrow)
    return min(max(_rescale_stochastic(d, m, sh, np.int64(_bits(index, key[0], key[1]))) + zo, lo), hi)


@njit(inline="always")
def _rq_row(q, p, o, l, po, b, lo, hi, code, narrow, key, base, out):
    zi, zo, m, sh, f = p
    if zi.shape[2] > 1:
        for i in range(q.shape[2]):
            out[o, l, i] = _rq_at(np.int64(q[o, l, i]) - zi[po, b, i], zo[po, b, i], m[po, b, i],
                                  sh[po, b, i], f[po, b, i], lo, hi, code, narrow, key, base + np.uint64(i))
    else:
        zir, zor, mr, shr, fr = zi[po, b, 0], zo[po, b, 0], m[po, b, 0], sh[po, b, 0], f[po, b, 0]
        for i in range(q.shape[2]):
            out[o, l, i] = _rq_at(np.int64(q[o, l, i]) - zir, zor, mr, shr, fr, lo, hi, code, narrow, key,
                                  base + np.uint64(i))


@njit(inline="always")
def _rq_col(q, p, o, po, bidx, l0, l1, lo, hi, code, narrow, key, base, out):
    zi, zo, m, sh, f = p
    qr, orow = _span(q, o, l0, l1), _span(out, o, l0, l1)
    if zi.shape[1] == q.shape[1]:  # per-axis: parameter l for element l, contiguous (vectorizes)
        zir, zor, mr, shr, fr = _span(zi, po, l0, l1), _span(zo, po, l0, l1), _span(m, po, l0, l1), \
            _span(sh, po, l0, l1), _span(f, po, l0, l1)
        for j in range(l1 - l0):
            orow[j] = _rq_at(np.int64(qr[j]) - zir[j], zor[j], mr[j], shr[j], fr[j], lo, hi, code, narrow, key,
                             base + np.uint64(j))
    else:
        br = bidx[l0:l1]
        for j in range(l1 - l0):
            b = br[j]
            orow[j] = _rq_at(np.int64(qr[j]) - zi[po, b, 0], zo[po, b, 0], m[po, b, 0],
                             sh[po, b, 0], f[po, b, 0], lo, hi, code, narrow, key, base + np.uint64(j))


def _make_requantize(code, narrow):
    """The requantize kernel for one rounding code and operand width
    (``narrow``: ``Requant.narrow``); closure constants, so the branches on
    them fold away. The closure holds plain values only: Numba's
    cache key includes it, and a function in it would change the key in every
    process (a cache that never hits)."""
    source = _SOURCE

    @kernel
    def requantize(q, zi, zo, m, sh, f, bidx, lo, hi, key, out, start, stop):
        """``out = clamp(R((q - zi) * m / 2**sh) + zo, lo, hi)`` (``Requant``);
        with ``key`` (as quantize's) rounding stochastically."""
        _ = source  # in the cache key: a changed _fixed_point.py or _philox.py recompiles
        first = _first(key)
        o_n, n, i_n = q.shape
        pos = np.int64(zi.shape[0] > 1)
        p = (zi, zo, m, sh, f)
        if i_n == 1:
            o0, o1 = _outer(n, start, stop)
            for o in range(o0, o1):
                l0, l1 = max(start - o * n, 0), min(stop - o * n, n)
                _rq_col(q, p, o, np.int64(o) * pos, bidx, l0, l1, lo, hi, code, narrow, key,
                        first + np.uint64(o * n + l0), out)
        else:
            for t in range(start, stop):
                o = t // n
                _rq_row(q, p, o, t - o * n, np.int64(o) * pos, bidx[t - o * n], lo, hi, code, narrow, key,
                        first + np.uint64(t) * np.uint64(i_n), out)

    return requantize


requantize = {(code, narrow): _make_requantize(code, narrow)
              for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}
requantize_stream = {(code, narrow): _make_requantize_stream(code, narrow)
                     for code in (FLOAT, IDENTITY, *ROUNDINGS.values()) for narrow in (False, True)}


BINARY_RUN = 4096  # elements a task of binary
_I64_MIN, _I64_MAX = np.int64(np.iinfo(np.int64).min), np.int64(np.iinfo(np.int64).max)


def _make_binary(op, ca, cb, code):
    """``Backend.binary`` in one pass for op code ``op`` (0 add, 1 sub, 2 mul)
    and the rounding codes of the operands' and the result's ``Requant``
    (closure constants, as in ``_make_requantize``: the branches on them fold
    away and the loop vectorizes, 4-8x faster than with the codes as
    arguments), for operands of one shape (flat) and per-tensor Requants: each
    operand taken to int64 by its Requant (``na``/``nb`` their ``narrow``), the
    op, and the result requantized; what the generic code does in three
    requantizes and two int64 temporaries. Tasks are runs of ``BINARY_RUN``
    elements."""
    source = _SOURCE

    @kernel
    def binary(a, b, p, fp, out, start, stop):
        """``p``: int64 ``za, ma, sa, na, zb, mb, sb, nb, zo, m, sh, lo, hi``;
        ``fp``: float64 ``fa, fb, f`` (two arrays: one Numba dispatch of 16
        scalars cost ~1 us, a fifth of a small add)."""
        _ = source
        za, ma, sa, na, zb, mb, sb, nb, zo, m, sh, lo, hi = (p[0], p[1], p[2], p[3] != 0, p[4], p[5], p[6],
                                                             p[7] != 0, p[8], p[9], p[10], p[11], p[12])
        fa, fb, f = fp[0], fp[1], fp[2]
        e0, e1 = start * BINARY_RUN, min(stop * BINARY_RUN, a.shape[0])
        ar, br, orow = a[e0:e1], b[e0:e1], out[e0:e1]  # indexed from 0 (see _span)
        for i in range(e1 - e0):
            x = _rq_inlined(np.int64(ar[i]) - za, 0, ma, sa, fa, _I64_MIN, _I64_MAX, ca, na)
            y = _rq_inlined(np.int64(br[i]) - zb, 0, mb, sb, fb, _I64_MIN, _I64_MAX, cb, nb)
            v = x + y if op == 0 else (x - y if op == 1 else x * y)
            orow[i] = _rq_inlined(v, zo, m, sh, f, lo, hi, code, False)

    return binary


@functools.cache
def binary(op, ca, cb, code):
    """The kernel of :func:`_make_binary` for these (int) codes, made once each."""
    return _make_binary(op, ca, cb, code)


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


# Rows of 8-bit codes, where the CPU has AVX-512 VBMI (``planes`` not None:
# ``NumpyBackend.softmax``): 64 table lookups at a time by byte permutes (LLVM
# gathers a byte at a time from a loop of loads). A 256-entry byte table is four 64-byte registers: ``vpermi2b`` looks up 128
# entries by an index's low 7 bits, two of them and its top bit select.
def _row_bytes(context, builder, ty, arg, r):
    """Row ``r`` of a 2-D C-contiguous byte array as a ``<64 x i8>*``."""
    a = context.make_array(ty)(context, builder, arg)
    row = builder.gep(a.data, [builder.mul(r, builder.extract_value(a.strides, 0))])
    return builder.bitcast(row, _V64.as_pointer())


def _lookup(builder, table, index):
    """``table[index]`` for 64 byte indices, ``table`` four ``<64 x i8>``."""
    permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V64, [_V64] * 3),
                                             "llvm.x86.avx512.vpermi2var.qi.512")
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
        sad = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8Q, [_V64, _V64]),
                                             "llvm.x86.avx512.psad.bw.512")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8Q, None)) for _ in range(4)]
        with cgutils.for_range(builder, args[4]) as loop:
            index = builder.sub(mv, builder.load(builder.gep(row, [loop.index]), align=1))
            for acc, t in zip(accs, tables):
                part = builder.call(sad, [_lookup(builder, t, index), ir.Constant(_V64, None)])
                builder.store(builder.add(builder.load(acc), part), acc)
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), [_V8Q]),
                                                "llvm.vector.reduce.add.v8i64")
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


@kernel
def softmax_sums(x, table, planes, sums, start, stop):
    """``sums[r] = sum_i table[max(x[r]) - x[r, i]]`` (exact int64), rows ``start..stop``."""
    for r in range(start, stop):
        m, _ = _row_range(x, r)
        sums[r] = _row_sum(x, r, m, table, planes)


@njit(inline="always")
def _sm_value(j, table, rv, s_in, s_out, z_out, lo, hi, log):
    """One output code for distance ``j``: ``rv`` is ``float64(S) * s_out``
    (softmax) or ``log(S / 2**30)`` (log_softmax); the generic formulas."""
    if log:
        v = np.rint((np.float64(j) * -s_in - rv) / s_out)
    else:
        v = np.rint(np.float64(table[j]) / rv)
    return np.int64(min(max(v + z_out, lo), hi))


@kernel
def softmax(x, table, planes, logs, s_in, s_out, z_out, lo, hi, log, out, start, stop):
    """Softmax (``log`` False; ``logs`` unused) or log_softmax (``logs[r] =
    log(S_r / 2**30)``, from ``softmax_sums`` and NumPy) of rows
    ``start..stop`` of ``x``. A row longer than its range of distances fills a
    table of its outputs first: the same formula per distance, fewer divisions.
    ``planes``: None, or (8-bit codes in and out, a CPU with AVX-512 VBMI)
    the table's byte planes, and the lookups run 64 at a time."""
    otab = _scratch(table, planes, out.dtype)  # scratch, one per call
    for r in range(start, stop):
        _softmax_row(x, r, x.shape[1], table, planes, logs, s_in, s_out, z_out, lo, hi, log, otab, out)


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


_FLOAT_KERNELS = {}


def quantize_float(codes, mul):
    """The kernel of :func:`_make_quantize_float` for ``codes`` (a
    ``qarray._formats.Codes``) and ``mul``, made once each."""
    m, emin, maxc, ovf, nanc, sign_at, zeros = (int(v) for v in codes)
    e, frac = divmod(maxc, 1 << m)  # the largest finite value, for saturation
    sat = float(np.float32((1 + frac / 2.0**m) * 2.0 ** (emin + e - 1))) if ovf == maxc else 0.0
    magic = 2.0 ** (emin - m + 23)  # exact in float32
    top = (127 + emin) << 23  # the bits of 2**emin
    k = (1 << (22 - m)) - 1 - (((126 + emin) << m) << (23 - m))  # half an ulp, less the bias
    consts = (top, k, 23 - m, magic, int(np.float32(magic).view(np.uint32)), sat, maxc, ovf, nanc, sign_at, zeros)
    key = (bool(mul), consts)
    if key not in _FLOAT_KERNELS:
        _FLOAT_KERNELS[key] = _make_quantize_float(*key)
    return _FLOAT_KERNELS[key]


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


# -- block formats (qarray._blocks): bytes -> float32 ----------------------------------------------

@njit(inline="always")
def block_codes(raw, b, segments, code):
    """The codes of block ``b`` of ``raw`` (uint8 ``(blocks, nbytes)``) into ``code`` (int32, a block's
    length), read segment by segment (``Field.segments``: first value, count, first byte, byte stride,
    shift, mask, value shift): :func:`block_decode`'s and ``cpu.blocks``' decoders."""
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
