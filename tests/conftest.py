import importlib.util

import numpy as np
import pytest

import qarray

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
