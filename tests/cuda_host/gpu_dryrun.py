"""pytest plugin: the fake CuPy of ``fake_cupy/`` on the path and ``CupyBackend``
registered as the "cupy" backend for its arrays, its ``RawModule`` running the
kernels on the host build, so that tests/test_gpu.py runs its GPU tests through
the host-run kernels.

    python -m pytest -p cuda_host.gpu_dryrun -m gpu tests/test_gpu.py
"""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fake_cupy"))
import cupy  # noqa: E402  (the fake)

import qarray  # noqa: E402
import qarray.backends as qb  # noqa: E402
from qarray.backends.cupy import CupyBackend  # noqa: E402

from . import cublas_host  # noqa: E402
from .harness import HostCupyBackend, session_folder, shared_build  # noqa: E402

assert cupy.__version__ == "0+fake", cupy.__file__


class HostFunction:
    """``cupy.cuda.function.Function``: the compiled function's handle, which the
    occupancy calculator is given."""

    ptr = 0


class HostKernel:
    """``cupy.RawKernel`` as CuPy has it (``tests/test_cupy_api.py`` checks these
    names against CuPy's): called with ``(grid, block, args, shared_mem=)``, its
    function at ``.kernel``."""

    def __init__(self, module, name):
        self._module, self._name = module, name

    @property
    def kernel(self):
        return HostFunction()

    def __call__(self, grid, block, args, *, shared_mem=0):
        module, name = self._module, self._name
        assert cupy.cuda.Device().id == module.device, f"{name}: module of device {module.device} launched elsewhere"
        cupy._check_devices([a for a in args if isinstance(a, cupy.ndarray)])
        module.host.devices.append(module.device)
        module.host.run(name, grid, block, args, shared_mem)


class HostModule:
    """``cupy.RawModule`` for the current (fake) device, its kernels run by ``host``
    (a ``HostCupyBackend``, which checks every launch); each launch is recorded in
    ``host.devices``, and its arrays must be on that device, as on a GPU."""

    def __init__(self, host, code, options):
        self.host, self.device = host, cupy.cuda.Device().id

    def get_function(self, name):
        return HostKernel(self, name)


@pytest.fixture(autouse=True, scope="session")
def fake_device(tmp_path_factory):
    # The tests' NumPy references on the generic code, not Numba: the Numba specialisations
    # they would compile (the stochastic and streamed kernels of every dtype the GPU tests
    # take) cost minutes of a fresh run and hold the CUDA kernels to the same results; the
    # CPU suite holds the Numba kernels to the generic code bit for bit.
    qarray.config.numba = False
    host = HostCupyBackend(shared_build(session_folder(tmp_path_factory)))  # the parent session's build
    host.devices = []
    cupy.RawModule = lambda *, code, options: HostModule(host, code, options)  # as the backend calls it
    cupy.cuda.cublas = cublas_host  # gemmEx on the host, under cuBLAS's rules
    cupy.cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 0)
    backend = qb.register(CupyBackend())
    backend.host = host
    yield backend
    assert host.launches, "no kernel ran"
