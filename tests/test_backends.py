import subprocess
import sys

import numpy as np
import pytest

import qarray
from qarray import backends
from qarray.backends import Backend


class ToyArray:
    """A minimal foreign array type: wraps a NumPy array, forwards what the generic
    backend uses. Stands in for 'another array library'."""

    def __init__(self, a):
        self.a = np.asarray(a)

    dtype = property(lambda self: self.a.dtype)
    shape = property(lambda self: self.a.shape)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)

    def __getattr__(self, name):
        attr = getattr(self.a, name)
        return (lambda *a, **k: _wrap(attr(*_unwrap(a), **k), type(self))) if callable(attr) else attr

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        return _wrap(getattr(ufunc, method)(*_unwrap(inputs), **kw), type(self))

    for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "rshift", "lshift", "xor", "gt", "lt",
                "eq", "ne", "ge", "le"):
        exec(f"def __{_op}__(self, o): return _wrap(self.a.__{_op}__(_unwrap1(o)), type(self))")
        exec(f"def __r{_op}__(self, o): return _wrap(self.a.__r{_op}__(_unwrap1(o)), type(self))"
             if _op not in ("gt", "lt", "eq", "ne", "ge", "le") else "")

    def __getitem__(self, k):
        return _wrap(self.a[k], type(self))

    def __setitem__(self, k, v):
        self.a[k] = _unwrap1(v)

    def __neg__(self):
        return _wrap(-self.a, type(self))

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)


def _unwrap1(v):
    return v.a if isinstance(v, ToyArray) else v


def _unwrap(vs):
    return [_unwrap1(v) for v in vs]


def _wrap(v, kind=None):
    return (kind or ToyArray)(v) if isinstance(v, np.ndarray) else v


class ToyNamespace:
    ndarray = ToyArray

    def __getattr__(self, name):
        f = getattr(np, name)
        if not callable(f) or isinstance(f, type):
            return f
        return lambda *a, **k: _wrap(f(*[[_unwrap1(x) for x in v] if isinstance(v, list) else _unwrap1(v) for v in a],
                                       **k), self.ndarray)


class ToyBackend(Backend):
    name = "toy"
    module = __name__

    def __init__(self):
        super().__init__(ToyNamespace())

    def to_host(self, a):
        return np.asarray(a.a if isinstance(a, ToyArray) else a)


@pytest.fixture
def toy():
    b = backends.register(ToyBackend())
    yield b
    backends._by_name.pop("toy")
    for t in [t for t, v in backends._by_type.items() if v is b]:
        del backends._by_type[t]


class FrozenToyArray(ToyArray):
    """A ToyArray that cannot be written to, as JAX's arrays cannot."""

    def __setitem__(self, k, v):
        raise TypeError("FrozenToyArray does not support item assignment")


class FrozenToyNamespace(ToyNamespace):
    ndarray = FrozenToyArray


class FrozenToyBackend(ToyBackend):
    name = "frozen"
    writable = False  # the contract's flag: ops and primitives write into no array

    def __init__(self):
        Backend.__init__(self, FrozenToyNamespace())

    def asarray(self, a, dtype=None):
        return FrozenToyArray(np.asarray(a.a if isinstance(a, ToyArray) else a, dtype=dtype))


_X = np.random.default_rng(7).standard_normal((2, 3, 6, 6)).astype(np.float32)
_W = np.random.default_rng(8).standard_normal((4, 3, 3, 3)).astype(np.float32)
_M = np.random.default_rng(9).standard_normal((5, 8)).astype(np.float32)
_MW = np.random.default_rng(10).standard_normal((8, 3)).astype(np.float32)

# Every public op, written once against an array constructor A (each operand goes through it)
OPS = {
    "quantize": lambda A: qarray.quantize(A(_X), 0.05, 3, "qint8"),
    "quantize per channel": lambda A: qarray.quantize(A(_M), np.linspace(0.01, 0.05, 5, dtype=np.float32), 0, "qint8",
                                                      axis=0),
    "quantize blocked": lambda A: qarray.quantize_dynamic(A(_M), "qint4", axis=1, block_size=3),
    "dequantize": lambda A: qarray.quantize(A(_M), 0.05, 3, "qint8").dequantize(),
    "requantize": lambda A: qarray.requantize(qarray.quantize(A(_X), 0.05, 3, "qint8"), 0.1, 0, "quint8"),
    "add": lambda A: qarray.add(qarray.quantize(A(_M), 0.05, 3, "qint8"), qarray.quantize(A(_M), 0.04, -2, "qint8"),
                                scale=0.1, zero_point=0, dtype="qint8"),
    "mul": lambda A: qarray.mul(qarray.quantize(A(_M), 0.05, 3, "qint8"), qarray.quantize(A(_M), 0.04, -2, "qint8"),
                                scale=0.1, zero_point=0, dtype="qint8"),
    "relu": lambda A: qarray.relu(qarray.quantize(A(_M), 0.05, 3, "qint8")),
    "cat": lambda A: qarray.cat([qarray.quantize(A(_M), 0.05, 3, "qint8"), qarray.quantize(A(_M), 0.04, -2, "qint8")],
                                axis=0, scale=0.1, zero_point=0, dtype="qint8"),
    "sigmoid": lambda A: qarray.sigmoid(qarray.quantize(A(_M), 0.05, 3, "qint8")),
    "softmax": lambda A: qarray.softmax(qarray.quantize(A(_M), 0.05, 3, "qint8"), axis=-1),
    "sum": lambda A: qarray.sum(qarray.quantize(A(_M), 0.05, 3, "qint8"), axis=1),
    "mean": lambda A: qarray.mean(qarray.quantize(A(_M), 0.05, 3, "qint8"), axis=1),
    "matmul": lambda A: qarray.matmul(qarray.quantize(A(_M), 0.05, 3, "quint8"), qarray.quantize(A(_MW), 0.02, 0, "qint8"),
                                      scale=0.1, zero_point=0, dtype="qint8"),
    "linear": lambda A: qarray.linear(qarray.quantize(A(_M), 0.05, 3, "quint8"),
                                      qarray.quantize(A(_MW.T.copy()), 0.02, 0, "qint8")),
    "conv2d": lambda A: qarray.conv2d(qarray.quantize(A(_X), 0.05, 3, "quint8"), qarray.quantize(A(_W), 0.02, 0, "qint8"),
                                      padding=1, stride=(1, 2)),
    "conv2d groups": lambda A: qarray.conv2d(qarray.quantize(A(np.concatenate([_X, _X[:, :1]], 1)), 0.05, 3, "quint8"),
                                             qarray.quantize(A(_W[:, :2]), 0.02, 0, "qint8"), padding=1, groups=2),
    "max_pool2d": lambda A: qarray.max_pool2d(qarray.quantize(A(_X), 0.05, 3, "qint8"), 2),
    "avg_pool2d": lambda A: qarray.avg_pool2d(qarray.quantize(A(_X), 0.05, 3, "qint8"), 3, stride=1, padding=1),
    "adaptive_avg_pool2d": lambda A: qarray.adaptive_avg_pool2d(qarray.quantize(A(_X), 0.05, 3, "qint8"), (2, 3)),
}
@pytest.mark.parametrize("frozen", [False, True], ids=["toy", "frozen"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_runs_through_the_backend_contract(name, frozen):
    """A new NumPy-like backend is one class (``ToyBackend``: a namespace and
    ``to_host``): every op runs on its arrays and gives NumPy's codes and
    parameters bit for bit; with ``writable = False`` (immutable arrays, as JAX
    has) too: no op writes into an array it did not make writable."""
    b = backends.register(FrozenToyBackend() if frozen else ToyBackend())
    kind = FrozenToyArray if frozen else ToyArray
    try:
        want, got = OPS[name](lambda a: a), OPS[name](kind)
    finally:
        backends._by_name.pop(b.name)
        for t in [t for t, v in backends._by_type.items() if v is b]:
            del backends._by_type[t]
    if isinstance(want, qarray.QArray):
        assert got.backend == b.name and isinstance(got.data, ToyArray)
        assert (got.dtype, got.axis, got.block_size) == (want.dtype, want.axis, want.block_size)
        np.testing.assert_array_equal(b.to_host(got.data), want.data)
        np.testing.assert_array_equal(got.scale, want.scale)
        np.testing.assert_array_equal(got.zero_point, want.zero_point)
    else:
        assert isinstance(got, ToyArray)
        np.testing.assert_array_equal(b.to_host(got), want)


def test_toy_backend_quantize_dequantize(toy):
    x = ToyArray(np.array([0.5, -1.0, 0.26, 3.0], np.float32))
    q = qarray.quantize(x, 0.1, 2, "qint8")
    assert q.backend == "toy" and isinstance(q.data, ToyArray)
    np.testing.assert_array_equal(toy.to_host(q.data), [7, -8, 5, 32])
    d = q.dequantize()
    assert isinstance(d, ToyArray)
    np.testing.assert_array_equal(d.a, qarray.quantize(x.a, 0.1, 2, "qint8").dequantize())
    r = qarray.requantize(q, 0.2, 0, "qint4")
    np.testing.assert_array_equal(toy.to_host(r.data), [2, -5, 2, 7])
    assert backends.for_array(x) is toy
    assert "toy" in backends.available()


def test_toy_backend_in_pieces(toy, monkeypatch):
    """The generic code writes its pieces into the output: a namespace with slice
    assignment is all it needs, at any size."""
    monkeypatch.setattr(Backend, "chunk", 3)
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6)
    scale = np.linspace(0.01, 0.05, 4 * 2, dtype=np.float32).reshape(4, 2)
    q = qarray.quantize(ToyArray(x), scale, 1, "qint8", axis=1, block_size=3)
    want = qarray.quantize(x, scale, 1, "qint8", axis=1, block_size=3)
    np.testing.assert_array_equal(toy.to_host(q.data), want.int_repr())
    np.testing.assert_array_equal(q.dequantize().a, want.dequantize())
    np.testing.assert_array_equal(toy.to_host(q.requantize(0.1, 0, "qint4").data), want.requantize(0.1, 0, "qint4").int_repr())


def test_unknown_array_type():
    with pytest.raises(TypeError, match=r"no qarray backend handles arrays of type builtins.dict"):
        qarray.quantize({"a": 1}, 0.1)


def test_mixed_backends(toy):
    a = ToyArray(np.zeros(3))
    with pytest.raises(TypeError, match=r"arrays of two backends \(numpy and toy\) can not be combined"):
        backends.common(np.zeros(3), a)


def test_get_and_register_errors():
    assert backends.get("numpy").name == "numpy"
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        backends.get("tpu")
    with pytest.raises(TypeError, match="register\\(\\) takes a qarray.backends.Backend"):
        backends.register(object())


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_does_not_import_cupy_or_numba():
    out = _run(
        "import sys, numpy, qarray\n"
        "q = qarray.quantize(numpy.ones(100, numpy.float32), 0.1)\n"
        "print('cupy' in sys.modules, 'numba' in sys.modules, qarray.backends.available()[0])"
    )
    assert out == "False False numpy"


def test_no_cupy_error_in_subprocess():
    out = _run(
        "import sys; sys.modules['cupy'] = None\n"
        "import qarray\n"
        "try:\n    qarray.backends.get('cupy').xp\nexcept ImportError as e:\n    print(e)\n"
        "print(qarray.backends.available())"
    )
    assert out == "the cupy backend needs CuPy: pip install 'qarray[cuda12]' or 'qarray[cuda13]'\n['numpy']"


def test_set_num_threads():
    qarray.set_num_threads(1)
    qarray.set_num_threads(2)
    with pytest.raises(ValueError, match="positive integer"):
        qarray.set_num_threads(0)


def test_ops_refuse_arrays_of_two_backends(toy):
    n = qarray.quantize(np.ones((2, 2), np.float32), 0.1, 0, "qint8")
    t = qarray.quantize(ToyArray(np.ones((2, 2), np.float32)), 0.1, 0, "qint8")
    for op in (lambda: qarray.add(n, t, scale=0.1), lambda: qarray.cat([n, t]), lambda: qarray.mul(n, t)):
        with pytest.raises(TypeError, match=r"arrays of two backends \(numpy and toy\) can not be combined"):
            op()


def test_cupy_without_a_device_errors_clearly(monkeypatch):
    """CuPy installed but no GPU (or no driver): a clear RuntimeError, not a crash."""
    import types

    from qarray.backends.cupy import CupyBackend

    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(RuntimeError, match="the cupy backend found no usable CUDA device: cudaErrorNoDevice"):
        CupyBackend().xp
    fake.cuda.runtime.getDeviceCount = lambda: 0
    with pytest.raises(RuntimeError, match="the cupy backend found no CUDA device"):
        CupyBackend().xp


def test_cupy_imported_without_a_device_leaves_other_arrays_alone(monkeypatch, toy):
    """With CuPy imported on a machine with no GPU, arrays of other backends are
    still recognised (the registry asks CuPy for its array type, not for a device)."""
    import types

    def no_device():
        raise RuntimeError("cudaErrorInsufficientDriver")

    class FakeCupyArray:
        pass

    fake = types.SimpleNamespace(ndarray=FakeCupyArray,
                                 cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(backends, "_by_type", {})
    monkeypatch.delitem(backends._by_name, "cupy", raising=False)
    assert backends.for_array(ToyArray(np.zeros(3))).name == "toy"
    assert backends.for_array(FakeCupyArray()).name == "cupy"
    assert backends.available() == ["numpy", "toy"]


@pytest.fixture
def threads():
    """``qarray.set_num_threads`` for one test, restored after it."""
    before = qarray._config.THREADS[0]
    yield qarray.set_num_threads
    qarray.set_num_threads(before)


def test_kernel_tasks_are_cut_into_parts_that_threads_claim(threads):
    """PARTS contiguous parts a thread, each task in exactly one, results in
    order whoever ran them; a share below ``grain`` tasks stays on one thread;
    never more parts than tasks."""
    k = pytest.importorskip("qarray.backends.cpu.pool")
    import numba

    parts = []
    threads(3)
    got = k.parallel(lambda tag, start, stop: parts.append((start, stop)) or (tag, start), 100, "part")
    n = min(3, numba.config.NUMBA_NUM_THREADS)
    p = n * k.PARTS if n > 1 else 1
    cut = [100 * i // p for i in range(p + 1)]
    assert sorted(parts) == list(zip(cut, cut[1:])) and got == [("part", c) for c in cut[:-1]]
    parts.clear()
    k.parallel(lambda start, stop: parts.append((start, stop)), 100, grain=60)  # 100 // 60: one thread
    assert parts == [(0, 100)]
    parts.clear()
    threads(8)
    k.parallel(lambda start, stop: parts.append((start, stop)), 2)
    assert sorted(parts) == ([(0, 1), (1, 2)] if numba.config.NUMBA_NUM_THREADS > 1 else [(0, 2)])


def test_pool_raises_a_parts_error_and_serves_the_next_call(threads):
    """A part that raises, on the calling thread or a pool thread, raises in the
    caller once every thread is done with the call; the pool then serves the
    next call as before, whether its threads still poll or have gone to sleep."""
    k = pytest.importorskip("qarray.backends.cpu.pool")
    import time

    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two threads")
    threads(2)
    k.parallel(lambda start, stop: None, 8)  # the pool, started
    for bad in (0, 7):  # the caller's first part; a part the pool thread claims as the caller waits in it
        ran = []

        def part(start, stop):
            if start == 0:
                time.sleep(0.01)  # (a part a pool thread has time to claim)
            ran.append(start)
            if start == bad:
                raise ZeroDivisionError(f"part {start}")

        with pytest.raises(ZeroDivisionError, match=f"part {bad}"):
            k.parallel(part, 8, parts=4)
        assert sorted(ran) == list(range(8))
        time.sleep(2 * k.SPIN if bad else 0)  # the pool thread asleep, then still polling
        assert k.parallel(lambda start, stop: (start, stop), 8, parts=4) == [(i, i + 1) for i in range(8)]


def test_a_call_takes_no_more_threads_than_it_is_given(threads, monkeypatch):
    """A pool started for 3 threads, then ``set_num_threads(2)``: the parts run
    on 2 threads, the caller's and one of the pool's."""
    k = pytest.importorskip("qarray.backends.cpu.pool")
    import threading
    import time

    import numba

    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 3)
    ran = set()

    def part(start, stop):
        ran.add(threading.get_native_id())
        time.sleep(0.002)  # (every thread has time to claim a part)

    threads(3)
    k.parallel(part, 24, parts=4)  # (parts enough that a thread that wakes late still finds one)
    assert len(ran) == 3 and k._pool[0] == 3
    ran.clear()
    threads(2)
    k.parallel(part, 24, parts=4)
    assert len(ran) == 2 and threading.get_native_id() in ran


def test_a_passive_wait_policy_polls_once(monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE, as OpenMP's threads: the pool's threads poll
    once for the next call, then sleep; unset, for SPIN seconds. The caller
    polls for the parts under way for SPIN seconds either way."""
    k = pytest.importorskip("qarray.backends.cpu.pool")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    passive = k._Pool(1, [])
    monkeypatch.delenv("OMP_WAIT_POLICY")
    active = k._Pool(1, [])
    try:
        assert passive.polls == 1 and active.polls > 100 and passive.finish_polls > 100
        for pool in (passive, active):
            pool.busy.acquire()
            pool.run(lambda: None, 1)
            pool.busy.release()
    finally:
        passive.stop(), active.stop()


def test_a_call_while_the_pool_is_busy_runs_on_its_own_thread(threads):
    """Two threads call at once (Dask's threaded scheduler does): one has the
    pool, the other runs its tasks alone; both get every part's result."""
    k = pytest.importorskip("qarray.backends.cpu.pool")
    import threading
    import time

    threads(2)
    got, started = {}, threading.Event()

    def slow(tag, start, stop):
        started.set()
        time.sleep(0.02)
        return tag, start, stop

    t = threading.Thread(target=lambda: got.__setitem__("a", k.parallel(slow, 4, "a", parts=2)))
    t.start()
    started.wait()
    got["b"] = k.parallel(slow, 4, "b")
    t.join()
    assert got["b"] == [("b", 0, 4)]  # alone: one part
    assert [(s, e) for _, s, e in got["a"]] == [(i, i + 1) for i in range(4)] and {x for x, _, _ in got["a"]} == {"a"}


def test_pool_threads_keep_off_the_callers_cpu(threads, monkeypatch):
    """Linux wakes a thread on its waker's CPU, where it preempted the caller
    while another library's threads spun on the other core: before each call
    the pool threads are kept to the process's other CPUs."""
    import os

    k = pytest.importorskip("qarray.backends.cpu.pool")
    import numba

    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(allowed) < 2 or numba.config.NUMBA_NUM_THREADS < 2 or k._cpu_of_caller() is None:
        pytest.skip("needs Linux and two CPUs")
    threads(2)
    for _ in range(3):  # the first calls start the pool's thread
        k.parallel(lambda start, stop: None, 2)
    for here in sorted(allowed)[:2]:
        monkeypatch.setattr(k, "_cpu_of_caller", lambda: here)  # the caller runs on CPU `here`
        k.parallel(lambda start, stop: None, 2)
        assert k._pool[2] and all(os.sched_getaffinity(t) == allowed - {here} for t in k._pool[2])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parts_that_split_a_row_give_the_same_codes(threads, n):
    """Per-axis parameters along the last axis: the kernels' tasks are runs along
    a row, and parts start and end inside rows; every split gives the generic
    code's integers (odd lengths: the vector loops' tails too)."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, 7001)).astype(np.float32) * 4
    scale = rng.uniform(0.01, 0.1, 7001).astype(np.float32)
    zp = rng.integers(-128, 128, 7001)
    threads(n)
    with qarray.config.using(numba=False):
        want = qarray.quantize(x, scale, zp, "qint8", axis=1)
        want_r = qarray.requantize(want, scale * 3, 0, "quint8", axis=1, rounding="tflite")
        want_f = want.dequantize()
    got = qarray.quantize(x, scale, zp, "qint8", axis=1)
    np.testing.assert_array_equal(got.int_repr(), want.int_repr())
    np.testing.assert_array_equal(qarray.requantize(got, scale * 3, 0, "quint8", axis=1, rounding="tflite").int_repr(),
                                  want_r.int_repr())
    assert got.dequantize().tobytes() == want_f.tobytes()


def test_large_kernel_outputs_start_on_a_huge_page():
    """From 4 MiB on, kernel outputs start at a 2 MiB boundary (so transparent
    huge pages cover them whole); smaller ones are plain arrays."""
    pytest.importorskip("numba")
    x = np.linspace(-1, 1, 1 << 22, dtype=np.float32)
    q = qarray.quantize(x, 0.01, 0, "qint8")
    assert q.data.ctypes.data % (1 << 21) == 0 and q.data.shape == x.shape and q.data.dtype == np.int8
    f = q.dequantize()
    assert f.ctypes.data % (1 << 21) == 0 and f.flags.c_contiguous and f.dtype == np.float32
    np.testing.assert_array_equal(f, (np.clip(np.rint(x / np.float32(0.01)), -128, 127) * np.float32(0.01)))
    assert qarray.quantize(x[:1 << 16], 0.01, 0, "qint8").data.base is None


def _quantize_in_child(x, queue):
    queue.put(qarray.quantize(x, 0.01, 0, "quint8").int_repr())


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_a_forked_process_runs_the_kernels(threads):
    """A child forked after the kernels ran has none of the parent's pool threads;
    it must start its own, not wait forever on the parent's."""
    import multiprocessing

    pytest.importorskip("numba")
    threads(2)
    x = np.linspace(0, 2.5, 1 << 20, dtype=np.float32)
    want = qarray.quantize(x, 0.01, 0, "quint8").int_repr()  # the pool is up in the parent
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_quantize_in_child, args=(x, queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
    np.testing.assert_array_equal(got, want)
