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
from concurrent.futures import ThreadPoolExecutor

import numba
from numba import njit

from ..._config import THREADS

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


def always(*args, **kwargs) -> bool:
    """An ``ACCEPTS`` entry for a kernel that takes every plan."""
    return True


def source(*modules) -> str:
    """The hashes of ``modules``' source, for the closure of a kernel that inlines their helpers."""
    return "".join(hashlib.sha256(inspect.getsource(m).encode()).hexdigest() for m in modules)
