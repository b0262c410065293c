"""Fixtures every test module may use (pytest finds them here: no test module
imports from another). Shared helpers that are not fixtures live in
``_reference.py``."""

import importlib.util

import numpy as np
import pytest

import qarray

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


@pytest.fixture
def on_host(host, monkeypatch):
    """``run(fn)``: call ``fn()`` with the registry mapping every array to ``host``."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(qarray.backends, "for_array", lambda a: host)
            m.setattr(host, "check_together", lambda arrays: None)
            return fn()
    return run
