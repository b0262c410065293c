"""Fixtures every test module may use (pytest finds them here: no test module
imports from another). Shared helpers that are not fixtures live in
``_reference.py``."""

import contextlib
import importlib.util

import numpy as np
import pytest

import qarray
from qarray import QArray

# the host-run CUDA backend (tests/cuda_host/harness.py): ``host_lib``, every
# kernel built once per session with g++ (skips without it), and ``host``, a
# fresh HostCupyBackend on it per test
from cuda_host.harness import host, host_lib  # noqa: F401 (fixtures)

HAVE_NUMBA = importlib.util.find_spec("numba") is not None


@pytest.fixture(autouse=True)
def kernels_for_small_arrays(monkeypatch):
    """Send even tiny test arrays through the Numba kernels when Numba is on
    (the library sends arrays below ``_SMALL`` elements to the generic code)."""
    from qarray.backends import numpy as np_backend

    monkeypatch.setattr(np_backend, "_SMALL", 0)


@pytest.fixture(params=["numba", "generic"])
def kernels(request):
    """Run a test on the Numba kernels and on the generic NumPy code."""
    if request.param == "numba" and not HAVE_NUMBA:
        pytest.skip("numba is not installed")
    with qarray.config.using(numba=request.param == "numba"):
        yield request.param


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="module")
def one_thread():
    """One thread for a module's tests: on tiny arrays handing parts to threads
    costs more than it saves on a busy machine; one thread runs the same
    compiled kernels. A module takes it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from qarray.backends import _gemm

    n = _gemm.THREADS[0]
    qarray.set_num_threads(1)
    yield
    qarray.set_num_threads(n)


@contextlib.contextmanager
def _routed_to(host, monkeypatch):
    """The registry maps every array to ``host``: its "device" arrays are NumPy's."""
    with monkeypatch.context() as m:
        m.setattr(qarray.backends, "for_array", lambda a: host)
        m.setattr(host, "check_together", lambda arrays: None)
        yield


@pytest.fixture
def on_host(host, monkeypatch):
    """``run(fn)``: call ``fn()`` with the registry mapping every array to ``host``."""
    def run(fn):
        with _routed_to(host, monkeypatch):
            return fn()
    return run


class OnBackend:
    """One backend for an op's test. ``put(q)`` moves a NumPy QArray there,
    ``get(r)`` brings a result (QArray or array) back to NumPy, checking that it
    was made there; ``run(fn, *args, **kwargs)`` calls ``fn`` with the QArrays
    among ``args`` put there (anything else as given) and gets its result back,
    so ``assert_same(backend.run(op, a, b), want)`` holds an op to the same
    reference on every backend. ``launched`` lists the kernels the host-run
    CUDA backend launched (empty elsewhere); ``ran(prefix)`` checks that the
    op ran its own kernel there, not a generic fallback."""

    def __init__(self, name, host=None, monkeypatch=None):
        self.name, self.host, self._monkeypatch = name, host, monkeypatch

    def __repr__(self):
        return f"OnBackend({self.name!r})"

    def put(self, q):
        if self.name == "cuda_host":
            return QArray._new(q.data, q.scale, q.zero_point, q.dtype, q.axis, q.block_size, self.host, q.global_scale)
        return q.to("dask") if self.name == "dask" else q

    def get(self, r):
        if self.name in ("numpy", "generic"):
            return r
        if isinstance(r, QArray):
            assert r.backend == {"cuda_host": "cupy", "dask": "dask"}[self.name], (self.name, r.backend)
            return r.compute() if self.name == "dask" else r.to("numpy")
        if self.name == "dask":
            import dask.array as da

            assert isinstance(r, da.Array), type(r)
            return r.compute()
        return self.host.to_host(r)

    def context(self):
        if self.name == "cuda_host":
            return _routed_to(self.host, self._monkeypatch)
        return contextlib.nullcontext()

    def run(self, fn, *args, **kwargs):
        with self.context():
            r = fn(*(self.put(a) if isinstance(a, QArray) else a for a in args), **kwargs)
        return self.get(r)

    @property
    def launched(self):
        return [name for name, *_ in self.host.launches] if self.host is not None else []

    def ran(self, prefix):
        """On the host-run CUDA backend: a kernel named ``prefix...`` ran (else True)."""
        return self.host is None or any(name.startswith(prefix) for name in self.launched)


@pytest.fixture(params=["numpy", "generic", "cuda_host", "dask"])
def backend(request, monkeypatch):
    """Run an op's test on every backend that runs here (an ``OnBackend``):
    "numpy" (the Numba kernels), "generic" (NumPy code, numba off), "cuda_host"
    (the CUDA kernels built for the host by tests/cuda_host: skips without g++)
    and "dask" (one chunk of NumPy storage: skips without Dask; test_dask.py
    holds the chunk boundaries)."""
    name = request.param
    if name == "numpy" and not HAVE_NUMBA:
        pytest.skip("numba is not installed")
    if name == "dask":
        pytest.importorskip("dask.array")
    host = request.getfixturevalue("host") if name == "cuda_host" else None
    with qarray.config.using(numba=name == "numpy") if name in ("numpy", "generic") else contextlib.nullcontext():
        yield OnBackend(name, host, monkeypatch)


@pytest.fixture
def wide_tables(monkeypatch):
    """rich wraps tables at COLUMNS when output is not a terminal: one row a line
    (the CLI's test modules take it: ``pytestmark = pytest.mark.usefixtures("wide_tables")``)."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture
def weights(rng, tmp_path):
    """A .npz of float and integer arrays, and its path (the CLI's tests)."""
    arrays = {
        "w": (rng.standard_normal((8, 40)) * 0.1).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float64),
        "steps": np.array([3, -7, 2**40], np.int64),
        "mask": np.array([True, False, True]),
        "codes": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    path = tmp_path / "model.npz"
    np.savez(path, **arrays)
    return arrays, path


@pytest.fixture(scope="session")
def ggml_vectors():
    """ggml's own bytes for hard inputs (tests/data/ggml/kquants.npz, made by make_vectors.py there):
    ``{T}_x`` float32 rows, ``{T}_bytes`` ggml_quantize_chunk's, ``{T}_deq`` its to_float's, for the
    K-quants and IQ4_NL/IQ4_XS."""
    from pathlib import Path

    with np.load(Path(__file__).parent / "data" / "ggml" / "kquants.npz") as z:
        return {k: z[k] for k in z.files}
