"""pytest plugin: the fake CuPy of ``fake_cupy/`` on the path and a
``HostCupyBackend`` registered as the "cupy" backend for its arrays, so that
tests/test_gpu.py runs its GPU tests through the host-run kernels.

    python -m pytest -p cuda_host.gpu_dryrun -m gpu tests/test_gpu.py
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fake_cupy"))
import cupy  # noqa: E402  (the fake)

import qarray.backends as qb  # noqa: E402

from .harness import HostCupyBackend, build  # noqa: E402

assert cupy.__version__ == "0+fake", cupy.__file__


@pytest.fixture(autouse=True, scope="session")
def fake_device(tmp_path_factory):
    backend = HostCupyBackend(build(tmp_path_factory.mktemp("cuda_host") / "kernels.so"))
    backend.name, backend._xp = "cupy", cupy
    backend.array_types = lambda: (cupy.ndarray,)
    qb.register(backend)
    qb._by_type[cupy.ndarray] = backend  # before the NumPy backend, which would take any ndarray subclass
    yield backend
    assert backend.launches, "no kernel ran"
