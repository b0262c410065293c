"""The CPU kernels' threads and how a kernel is compiled.

Every kernel is compiled serial and ``nogil`` (:data:`kernel`) and takes a range
of tasks ``start, stop`` as its last two arguments; :func:`parallel` splits the
tasks among qarray's own threads. Numba's ``parallel=True`` would do the same,
but compiles each ``prange`` loop as one more function: 5x the compile time
(7.5 s against 1.4 s for one requantize specialization), which every user pays
at the first call with a new dtype.

Kernels are cached on disk (``cache=True``). Numba's cache key holds the
kernel's own file's timestamp and its closure's values, not its globals: a
kernel that inlines helpers of another module keeps :func:`source` of that
module in its closure (each kernel module's ``_SOURCE``), so a changed helper
compiles it again. The closure holds plain values only: a function in it would
change the key in every process (a cache that never hits).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import threading
import time

import numba
import numpy as np
from numba import njit

from ..._config import THREADS

# error_model="numpy": no check for division by zero, which would keep loops
# from vectorizing (Numba's prange bodies compile with it too)
_KERNEL = dict(nogil=True, cache=True, error_model="numpy")
kernel = njit(**_KERNEL)
_pool: list = [0, None, []]  # [threads, the _Pool of threads - 1, their native thread ids]
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
# Parts a thread, claimed in turn: a thread that wakes late takes fewer. Each part
# is a kernel call, and takes the GIL again as it ends: where the other thread
# holds it, a wait on a futex that cost tens of us on the 2-core VM. One part a
# thread (the caller takes the other's where it has not begun), against 4, with
# every pool passive, medians of 3 alternating rounds: nn.Linear 1 x 4096 x 4096
# 0.74 -> 0.64 ms, 16 x 4096 x 4096 0.77 -> 0.71, 256 x 4096 x 4096 3.02 -> 2.86,
# 1024^3 1.22 -> 1.26, ResNet's 3x3 conv 0.41 -> 0.37; quantize 2^22 0.97 -> 0.91,
# requantize 2^22 1.63 -> 1.53, dequantize 2^22 0.76 -> 0.67
PARTS = 1
# How long a pool thread polls for the next call after its part of one, and the
# caller for the pool threads' parts, before each sleeps (seconds). Waking a
# sleeping thread took ~45 us to hand it a call and ~100 us to hear it was done
# on the 2-core VM (a ThreadPoolExecutor: 93 us a round trip, the other vCPU
# halted), where 1 x 4096 x 4096 int8 takes 0.4 ms a thread: OpenMP's threads,
# torch's, spin as long or longer (GOMP_SPINCOUNT, KMP_BLOCKTIME). As theirs,
# the threads' polls for the next call stop with OMP_WAIT_POLICY=PASSIVE (the
# benchmarks set it for every contender). The caller's for the parts under way
# stay: they end with the call, and asleep it heard of the last part ~100 us late
# (2 threads, calls alternating in one process: conv 1.09 -> 1.01 ms, nn.Linear
# 1 x 4096 x 4096 0.70 -> 0.65, 1024^3 1.12 -> 1.06, quantize 2^22 0.97 -> 0.94).
SPIN = 300e-6


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


_kept_off: list = [None]  # the CPU the pool threads were last kept off (a syscall a thread to change)


def _away_from_caller():
    """Keep the pool threads off the caller's CPU for this call. Woken on the
    waker's CPU (Linux wakes a thread where its waker runs), a pool thread
    preempted the calling thread, which then waited a scheduler slice (~2-3 ms)
    while another library's OpenMP threads still spun on the other core after
    their own call (torch, onnxruntime, OpenBLAS): quantize 2^24 right after a
    torch call took 1.9x its time alone, 1.1-1.2x with this. Asked again only
    when the caller's CPU changes: 16-50 us a call on the 2-core VM."""
    here = _cpu_of_caller()
    if here is None or not hasattr(os, "sched_setaffinity") or _kept_off[0] == (here, len(_pool[2])):
        return
    others = os.sched_getaffinity(0) - {here}
    for tid in _pool[2] if others else ():
        try:
            os.sched_setaffinity(tid, others)
        except OSError:  # a thread that has ended, a set the system refuses: nothing to win
            pass
    _kept_off[0] = (here, len(_pool[2]))


class _Pool:
    """``threads`` threads that run one call's ``job`` at a time. A call is
    published by a number (``state[0]``); a pool thread polls it without the
    GIL for ``SPIN`` seconds after each call (:func:`llvm._poll_change`), then
    sleeps on ``cond``; each writes the number into its ``done`` slot when its
    share is done, which the caller polls the same way. Nothing is handed
    through a queue: a call to threads that are still polling makes no system
    call. Exceptions of the job are raised in the caller."""

    def __init__(self, threads, tids):
        from .llvm import _poll_all, _poll_change, _publish  # (llvm imports this module)

        self.poll_change, self.poll_all, self.publish = _poll_change, _poll_all, _publish
        self.state = np.zeros(1, np.int64)  # the number of the call
        self.done = np.zeros(threads, np.int64)  # each thread's last call done
        self.cond = threading.Condition()
        self.sleeping = self.waiting = 0
        self.job, self.helpers, self.errors = None, 0, []
        self.busy = threading.Lock()  # one call at a time: a second caller meanwhile runs alone
        _poll_all(self.done, 0, 1)  # compiled (or loaded from the cache) before a call waits on them
        _publish(self.done, 0, 0)
        _poll_change(self.state, 0, 1)
        t = time.perf_counter()
        _poll_change(self.state, 0, 20000)  # timed: polls for SPIN seconds
        self.finish_polls = max(int(SPIN * 20000 / max(time.perf_counter() - t, 1e-9)), 1)
        # the threads' polls for the next call; OMP_WAIT_POLICY=PASSIVE: one, then sleep. The
        # caller's for the threads' parts (``finish_polls``) are not idle: a part is under way
        passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
        self.polls = 1 if passive else self.finish_polls
        for i in range(threads):
            threading.Thread(target=self._serve, args=(i, tids), name=f"qarray-{i}", daemon=True).start()
        while len(tids) < threads:  # started, so _away_from_caller knows them all
            time.sleep(1e-4)

    def _serve(self, i, tids):
        tids.append(threading.get_native_id())
        seen = 0
        while seen >= 0:  # -1: stop (a larger pool replaced this one)
            g = self.poll_change(self.state, seen, self.polls)
            if g == seen:
                with self.cond:
                    self.sleeping += 1
                    while self.state[0] == seen:
                        self.cond.wait()
                    self.sleeping -= 1
                    g = int(self.state[0])
            seen = g
            if g < 0:
                return
            try:
                if i < self.helpers:  # (a pool larger than the call's thread count: the rest sit it out)
                    self.job()
            except BaseException as e:  # raised again by the caller
                self.errors.append(e)
            self.publish(self.done, i, g)
            if self.waiting:
                with self.cond:
                    self.cond.notify_all()

    def run(self, work, helpers):
        """``work()`` on this thread and the first ``helpers`` pool threads; returns once all are done."""
        self.job, self.helpers, self.errors = work, helpers, []
        g = int(self.state[0]) + 1
        self.publish(self.state, 0, g)  # the call, after its job
        if self.sleeping:
            with self.cond:
                self.cond.notify_all()
        try:
            work()
        finally:
            if not self.poll_all(self.done, g, self.finish_polls):
                with self.cond:
                    self.waiting += 1
                    while (self.done != g).any():
                        self.cond.wait()
                    self.waiting -= 1
        if self.errors:
            raise self.errors[0]

    def stop(self):
        """Let the threads end (once they are done with any call)."""
        with self.busy, self.cond:
            self.publish(self.state, 0, -1)
            self.cond.notify_all()


def parallel(k, tasks, *args, grain=1, parts=PARTS):
    """``k(*args, start, stop)`` over ``range(tasks)`` on up to
    ``qarray.set_num_threads`` threads (at most ``NUMBA_NUM_THREADS``), each
    thread's share at least ``grain`` tasks. The tasks are cut into ``parts``
    contiguous parts a thread, and each thread, the calling one first, claims
    the next unclaimed part until none is left: a pool thread that wakes late
    (its core busy with another library's spinning threads) takes fewer parts
    instead of holding up the call. Returns the parts' results, in order. A
    call made while another thread's call has the pool runs on the calling
    thread alone."""
    if tasks < 2 * grain or THREADS[0] < 2:  # small calls: no more than this on their way to the kernel
        return [k(*args, 0, tasks)]
    n = min(THREADS[0], tasks // max(grain, 1), numba.config.NUMBA_NUM_THREADS)
    if n < 2:
        return [k(*args, 0, tasks)]
    if _pool[0] < n:
        if _pool[1] is not None:
            _pool[1].stop()
        tids = []  # each thread's native id, as it starts
        _pool[:] = n, _Pool(n - 1, tids), tids
    pool = _pool[1]
    if not pool.busy.acquire(blocking=False):
        return [k(*args, 0, tasks)]
    try:
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

        pool.run(work, n - 1)
    finally:
        pool.busy.release()
    return results


def always(*args, **kwargs) -> bool:
    """An ``ACCEPTS`` entry for a kernel that takes every plan."""
    return True


def source(*modules) -> str:
    """The hashes of ``modules``' source, for the closure of a kernel that inlines their helpers."""
    return "".join(hashlib.sha256(inspect.getsource(m).encode()).hexdigest() for m in modules)
