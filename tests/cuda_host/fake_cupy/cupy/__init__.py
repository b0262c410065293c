"""A stand-in for CuPy made of NumPy, for running tests/test_gpu.py without a GPU
(see tests/test_gpu_dryrun.py).

``ndarray`` holds a NumPy array but, like CuPy's, is no NumPy array: NumPy
refuses to convert it (``numpy.asarray``, ``__array__``: CuPy's TypeError), and
NumPy functions, ufuncs and operators take it only with no NumPy array mixed in
(CuPy's ``TypeError: Unsupported type``); the ``cupy.*`` functions refuse NumPy
arrays too, except ``asarray`` and ``array``, which copy host data over. So code
that needs a host value must ask for one (``.get()``), as on a GPU.

It has only what every supported CuPy has (``../../cupy_api.json``, read off real
CuPy 13 and 14; ``tests/test_cupy_api.py`` checks both): another name raises
CuPy's AttributeError, another keyword Python's TypeError. With
``QA_FAKE_CUPY_LOG=file`` it is lenient instead and writes the names it was asked
for to ``file``, for ``cupy_api.py names file`` (adding a name to the list).

Two devices: ``cuda.Device(i)`` makes device ``i`` current; an array remembers
the device it was made on (a view, its base's), and work that reads or writes an
array of another device raises CuPy's no-peer-access ValueError. ``gpu_dryrun.py``
supplies ``RawModule``, whose kernels run through the host harness.
"""

import atexit
import functools
import importlib.util
import os
import time
import types
from pathlib import Path

import numpy as _np

__version__ = "0+fake"
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")
_current = [0]  # the current device
# Copies between host and device, as CuPy would make them: host data into a
# device array (asarray / array, a host index array), and device values read on
# the host (get, asnumpy, int / float / bool / item / tolist of an array).
transfers = {"h2d": 0, "d2h": 0}
allocations = [0]  # new device arrays (not views) made since the count was last reset


def _api():
    spec = importlib.util.spec_from_file_location("_cupy_api", Path(__file__).parents[2] / "cupy_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.allowed()


_LOG = os.environ.get("QA_FAKE_CUPY_LOG")
_ASKED = set()
_API = None if _LOG else _api()  # {dotted name: keywords or None}
if _LOG:
    atexit.register(lambda: Path(_LOG).open("a").write("".join(f"{n}\n" for n in sorted(_ASKED))))


def _has(name, owner, attr):
    """``name`` (``cupy.x``, ``cupy.ndarray.x``) is in every supported CuPy, else
    CuPy's AttributeError."""
    _ASKED.add(name)
    if _API is not None and name not in _API:
        raise AttributeError(f"{owner} has no attribute '{attr}'")


def _keywords(name, f):
    """``f`` taking only the keywords CuPy's ``name`` takes."""
    params = None if _API is None else _API[name]
    if params is None or "**" in params:
        return f

    @functools.wraps(f)
    def checked(*args, **kwargs):
        for k in kwargs:
            if k not in params:
                raise TypeError(f"{name.rsplit('.', 1)[-1]}() got an unexpected keyword argument '{k}'")
        return f(*args, **kwargs)

    return checked


def _to_host():
    transfers["d2h"] += 1


def _check_devices(arrays):
    """CuPy's error for work on the current device that touches another's memory."""
    for a in arrays:
        if a._dev != _current[0]:
            raise ValueError(f"The device where the array resides ({a._dev}) is different from the current "
                             f"device ({_current[0]}). Peer access is unavailable between these devices.")


def _unwrap(x, found, host_ok=False):
    """``x`` with the NumPy arrays behind our arrays (collected in ``found``);
    a NumPy array is refused unless ``host_ok``."""
    if isinstance(x, ndarray):
        found.append(x)
        return x._a
    if isinstance(x, _np.ndarray) and not host_ok:
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (tuple, list)):
        return type(x)(_unwrap(v, found, host_ok) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, found, host_ok) for k, v in x.items()}
    return x


def _wrap(r, inputs):
    """NumPy results as our arrays (scalars as 0-d arrays, as CuPy returns them):
    a view stays on its base's device; new memory is on the current device, and
    made there from inputs that must be there too."""
    if isinstance(r, (tuple, list)):
        return type(r)(_wrap(v, inputs) for v in r)
    if not isinstance(r, (_np.ndarray, _np.generic)):
        return r
    for a in inputs:
        if r is a._a:
            return a
    r = _np.asarray(r)
    base = next((a for a in inputs if _np.may_share_memory(r, a._a)), None)
    if base is not None:
        return ndarray._of(r, base._dev)
    _check_devices(inputs)
    allocations[0] += 1
    return ndarray._of(r, _current[0])


def _apply(fn, args, kwargs, found=()):
    """NumPy's ``fn`` on our arrays (and on ``found``, e.g. a method's own array)."""
    found = list(found)
    args, kwargs = _unwrap(args, found), _unwrap(kwargs, found)
    return _wrap(fn(*args, **kwargs), found)


def _numpy_function(f):
    return functools.wraps(f)(lambda *args, **kwargs: _apply(f, args, kwargs))


class ndarray:
    """An array on a (fake) device: NumPy array ``_a`` on device ``_dev``."""

    __slots__ = ("_a", "_dev", "__weakref__")  # CuPy's arrays take weak references

    def __init__(self, shape, dtype=float):
        self._a, self._dev = _np.empty(shape, dtype), _current[0]
        allocations[0] += 1

    @classmethod
    def _of(cls, a, dev):
        self = object.__new__(cls)
        self._a, self._dev = a, dev
        return self

    @property
    def device(self):
        return _Device(self._dev)

    # CuPy's plain attributes are C properties: read directly, not through __getattr__
    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)

    @property
    def __cuda_array_interface__(self):
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.__array_interface__["data"][0], False),
                "strides": None if a.flags.c_contiguous else a.strides, "version": 3}

    def get(self):
        _to_host()
        return self._a.copy()

    def item(self):
        _to_host()
        return self._a.item()

    def tolist(self):
        _to_host()
        return self._a.tolist()

    def copy(self, order="C"):  # from any device to the current one, as CuPy's
        allocations[0] += 1
        return ndarray._of(self._a.copy(order), _current[0])

    def __array__(self, dtype=None):  # as CuPy's: no copy=
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _has(f"cupy.{ufunc.__name__}", "module 'cupy'", ufunc.__name__)  # CuPy: NotImplemented, then NumPy's TypeError
        if "out" in kwargs:  # in place: a kernel on the current device
            _check_devices([a for a in (*inputs, *kwargs["out"]) if isinstance(a, ndarray)])
        return _apply(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        _has(f"cupy.{func.__name__}", "module 'cupy'", func.__name__)
        return _keywords(f"cupy.{func.__name__}", lambda *a, **k: _apply(func, a, k))(*args, **kwargs)

    def __getattr__(self, name):  # NumPy's attributes and methods where CuPy's ndarray has them
        if name.startswith("__") or name in ("ctypes", "data"):
            raise AttributeError(f"'cupy.ndarray' object has no attribute '{name}'")
        _has(f"cupy.ndarray.{name}", "'cupy.ndarray' object", name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr, [self])
        return _keywords(f"cupy.ndarray.{name}", lambda *args, **kwargs: _apply(attr, args, kwargs, [self]))

    def __getitem__(self, key):
        found = [self]
        key = key if isinstance(key, tuple) else (key,)
        transfers["h2d"] += sum(isinstance(k, (_np.ndarray, list)) for k in key)  # host index arrays are copied over
        key = _unwrap(key, found, host_ok=True)
        if not any(k is Ellipsis for k in key):
            key += (Ellipsis,)  # a 0-d view, not a NumPy scalar
        return _wrap(self._a[key], found)

    def __setitem__(self, key, value):
        if not isinstance(value, ndarray) and _np.ndim(value):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        found = [self]
        key, value = _unwrap(key, found, host_ok=True), _unwrap(value, found, host_ok=True)
        _check_devices(found)
        self._a[key] = value

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __bool__(self):
        _to_host()
        return bool(self._a)

    def __int__(self):
        _to_host()
        return int(self._a)

    def __index__(self):
        _to_host()
        return int(self._a)

    def __float__(self):
        _to_host()
        return float(self._a)

    def __repr__(self):
        return repr(self._a)


def _operators():
    binary = dict(add=_np.add, sub=_np.subtract, mul=_np.multiply, truediv=_np.true_divide,
                  floordiv=_np.floor_divide, mod=_np.remainder, pow=_np.power, matmul=_np.matmul,
                  lshift=_np.left_shift, rshift=_np.right_shift, and_=_np.bitwise_and, or_=_np.bitwise_or,
                  xor=_np.bitwise_xor)
    for name, f in binary.items():
        name = name.rstrip("_")
        setattr(ndarray, f"__{name}__", lambda self, other, f=f: f(self, other))
        setattr(ndarray, f"__r{name}__", lambda self, other, f=f: f(other, self))
        setattr(ndarray, f"__i{name}__", lambda self, other, f=f: f(self, other, out=(self,)))
    compare = dict(eq=_np.equal, ne=_np.not_equal, lt=_np.less, le=_np.less_equal, gt=_np.greater,
                   ge=_np.greater_equal)
    for name, f in compare.items():
        setattr(ndarray, f"__{name}__", lambda self, other, f=f: f(self, other))
    for name, f in dict(neg=_np.negative, pos=_np.positive, abs=_np.absolute, invert=_np.invert).items():
        setattr(ndarray, f"__{name}__", lambda self, f=f: f(self))


_operators()
ndarray.__hash__ = None


def asarray(a, dtype=None, order=None):
    """``a`` on the current device: host data copied over, another device's array too."""
    if isinstance(a, ndarray) and a._dev == _current[0]:
        return a if dtype is None or _np.dtype(dtype) == a.dtype else a.astype(dtype)
    return array(a, dtype, order=order)


def array(obj, dtype=None, copy=True, order="K"):  # always a copy here
    if not isinstance(obj, ndarray):
        transfers["h2d"] += 1
    allocations[0] += 1
    return ndarray._of(_np.array(_unwrap(obj, [], host_ok=True), dtype, order=order), _current[0])


def asnumpy(a):
    return a.get() if isinstance(a, ndarray) else _np.asarray(a)  # get() counts the copy


_MADE = {}  # NumPy's functions wrapped once, as CuPy's are made once (not in globals: they would hide builtins)


def __getattr__(name):  # NumPy's other names where CuPy has them; functions refuse NumPy arrays
    if name in _MADE:
        return _MADE[name]
    _has(f"cupy.{name}", "module 'cupy'", name)
    obj = getattr(_np, name)
    obj = _MADE[name] = _keywords(f"cupy.{name}", _numpy_function(obj)) if callable(obj) and not isinstance(obj, type) else obj
    return obj


class _Random:
    _rng = _np.random.default_rng(0)

    def rand(self, *shape, dtype=_np.float64):
        return array(self._rng.random(shape).astype(dtype))

    def standard_normal(self, size=None, dtype=_np.float64):
        return array(self._rng.standard_normal(size).astype(dtype))

    def randint(self, low, high=None, size=None, dtype=_np.int64):
        return array(self._rng.integers(low, high, size).astype(dtype))


class _Device:
    """``with Device(i):`` makes device ``i`` current; ``Device()`` is the current one."""

    def __init__(self, device=None):
        self.id = _current[0] if device is None else int(device)
        self._before = []

    def __enter__(self):
        self._before.append(_current[0])
        _current[0] = self.id
        return self

    def __exit__(self, *exc):
        _current[0] = self._before.pop()
        return False

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def synchronize(self):
        pass


class _Event:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


random = _Random()
def _as_strided(x, shape=None, strides=None):
    return _apply(_np.lib.stride_tricks.as_strided, (x, shape, strides), {})


lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
    as_strided=_as_strided,
    sliding_window_view=_numpy_function(_np.lib.stride_tricks.sliding_window_view)))
cuda = types.SimpleNamespace(
    Device=_Device, Event=_Event, get_elapsed_time=lambda start_event, end_event: 1000 * (end_event.t - start_event.t),
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 2, getDevice=lambda: _current[0], getDeviceProperties=lambda device: {
        "name": b"host harness", "multiProcessorCount": 2}),
    driver=types.SimpleNamespace(occupancyMaxActiveBlocksPerMultiprocessor=lambda func, blockSize, dynamicSMemSize: 4))
