"""A stand-in for CuPy made of NumPy, for running tests/test_gpu.py without a GPU
(see tests/test_gpu_dryrun.py). Arrays are ``ndarray``, a NumPy subclass with
CuPy's ``get()``, ``device`` and ``__cuda_array_interface__``; every NumPy
function is here, returning such arrays. ``gpu_dryrun.py`` registers a
``HostCupyBackend`` for them, so the kernels run through the host harness.
"""

import time
import types

import numpy as _np

__version__ = "0+fake"


class ndarray(_np.ndarray):
    @property
    def __cuda_array_interface__(self):
        return {}

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    def get(self):
        return _np.asarray(self).copy()


def _wrap(x):
    if isinstance(x, _np.ndarray) and not isinstance(x, ndarray):
        return x.view(ndarray)
    if isinstance(x, (tuple, list)):
        return type(x)(_wrap(v) for v in x)
    return x


def __getattr__(name):
    obj = getattr(_np, name)
    if callable(obj) and not isinstance(obj, type):
        return lambda *a, **k: _wrap(obj(*a, **k))
    return obj


class _Random:
    _rng = _np.random.default_rng(0)

    def rand(self, *shape, dtype=_np.float64):
        return _wrap(self._rng.random(shape).astype(dtype))

    def standard_normal(self, n, dtype=_np.float64):
        return _wrap(self._rng.standard_normal(n).astype(dtype))

    def randint(self, lo, hi, n, dtype=_np.int64):
        return _wrap(self._rng.integers(lo, hi, n).astype(dtype))


class _Device:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _Event:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


random = _Random()
lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
    as_strided=lambda *a, **k: _wrap(_np.lib.stride_tricks.as_strided(*a, **k))))
cuda = types.SimpleNamespace(
    Device=_Device, Event=_Event, get_elapsed_time=lambda a, b: 1000 * (b.t - a.t),
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": b"host harness"}))
