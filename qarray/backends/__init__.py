"""The backend registry: which backend handles which array type.

Rule: never import an array library the user has not imported. ``for_array``
looks only at libraries already in ``sys.modules``, so ``import qarray`` never
imports CuPy, and NumPy users never pay for it.

Two dicts: name -> backend and array type -> backend (filled as types are met).
The backend found for a type has the last word on each array (``Backend.of``):
the Dask backend answers the one of the array's chunk type (NumPy or CuPy).

>>> import qarray.backends as qb
>>> qb.for_array(numpy.zeros(3)).name
'numpy'
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from ._base import NO_DEVICE, Backend

__all__ = ["Backend", "register", "get", "for_array", "available", "on_data_device", "gemm_engine", "user_array"]

_by_name: dict = {}
_by_type: dict = {}
# Built-in backends are made on first use: name -> (module, class name, the
# array library whose import makes them candidates).
_lazy = {"numpy": ("qarray.backends.numpy", "NumpyBackend", "numpy"),
         "cupy": ("qarray.backends.cupy", "CupyBackend", "cupy"),
         "dask": ("qarray.backends.dask", "DaskBackend", "dask.array")}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; its arrays are then recognised by ``for_array``."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register() takes a qarray.backends.Backend, got {type(backend).__name__}")
    _by_name[backend.name] = backend
    for t in list(_by_type):
        if _by_type[t].name == backend.name:
            del _by_type[t]
    return backend


def get(name: str) -> Backend:
    """The backend called ``name`` ("numpy", "cupy" or a registered one)."""
    if name not in _by_name:
        if name not in _lazy:
            raise ValueError(f"unknown backend {name!r}; available: {sorted(set(_by_name) | set(_lazy))}")
        module, cls, _ = _lazy[name]
        __import__(module)
        register(getattr(sys.modules[module], cls)())
    return _by_name[name]


def _candidates():
    for name in list(_lazy) + [n for n in _by_name if n not in _lazy]:
        b = _by_name.get(name)
        module = b.module if b is not None else _lazy[name][2]
        if module in sys.modules:
            yield b if b is not None else get(name)


def for_array(x) -> Backend:
    """The backend of array ``x``; TypeError naming the type when none handles it."""
    t = type(x)
    b = _by_type.get(t)
    if b is not None:
        return b.of(x)
    for b in _candidates():
        if issubclass(t, b.array_types()):
            _by_type[t] = b
            return b.of(x)
    raise TypeError(
        f"no qarray backend handles arrays of type {t.__module__}.{t.__qualname__}; "
        "pass a NumPy or CuPy array, or register a backend for it"
    )


def handles(x) -> bool:
    """Whether a registered backend takes arrays of ``x``'s type as they are."""
    try:
        for_array(x)
    except TypeError:
        return False
    return True


def common(*arrays) -> Backend:
    """The one backend of all ``arrays``; TypeError naming both when they differ.
    Dask arrays take in-memory arrays of their chunks' type along (each joins as
    one chunk)."""
    if arrays and all(type(a) is np.ndarray for a in arrays):  # the common call: one backend for all
        found = for_array(arrays[0])
        found.check_together(arrays)
        return found
    found = None
    for a in arrays:
        b = for_array(a)
        if found is not None and b is not found:
            lazy, other = (b, found) if b.name == "dask" else (found, b)
            if lazy.name == "dask" and other.name == lazy.inner:
                b = found = lazy
        if found is not None and b is not found:
            names = [f"dask of {c.inner} chunks" if c.name == "dask" else c.name for c in (found, b)]
            raise TypeError(
                f"arrays of two backends ({names[0]} and {names[1]}) can not be combined; "
                "move them to one with QArray.to(...)"
            )
        found = b
    if found is not None:
        found.check_together(arrays)
    return found


def available() -> list:
    """Names of the backends usable now (CuPy only where it imports and a GPU answers)."""
    names = ["numpy"]
    try:
        get("cupy").check()
        names.append("cupy")
    except (ImportError, RuntimeError):
        pass
    names += [n for n in _by_name if n not in names and n not in _lazy]
    return names


def user_array(x, what: str):
    """``x`` as an array a backend accepts, and that backend: the one place user
    data is normalised (quantize, quantize_dynamic, from_int, unpack, ``nn``);
    ``what`` names the caller in errors.

    Python numbers, lists and tuples become NumPy arrays; other DLPack arrays
    (PyTorch, JAX) NumPy or CuPy arrays; NumPy subclasses such as
    ``numpy.matrix`` become plain ndarrays (their own reshape and ``*`` rules
    would break the kernels); non-native byte order (``'>f4'``) is converted to
    native. Masked arrays are refused: their masked slots hold arbitrary values.
    """
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{what} does not take masked arrays (the masked slots hold arbitrary values); "
            "fill the masked values first, e.g. x.filled(0)"
        )
    if isinstance(x, (list, tuple, int, float, np.generic)) or (isinstance(x, np.ndarray) and type(x) is not np.ndarray):
        x = np.asarray(x)
    elif not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__") and not handles(x):
        x = from_dlpack(x, what)  # PyTorch, JAX, ...: NumPy (CPU) or CuPy (CUDA), no copy where allowed
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return x, for_array(x)


_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13  # DLPack's device types


def from_dlpack(x, what: str):
    """A DLPack-capable array ``x`` as a NumPy array (CPU memory) or a CuPy array
    (CUDA memory), without a copy where ``x``'s library allows one."""
    device = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else _KDL_CPU
    if device in (_KDL_CPU, _KDL_CUDA_HOST):
        take = np.from_dlpack
    elif device in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        try:
            import cupy
        except ImportError:
            raise TypeError(f"{what}: {type(x).__name__} lives on a CUDA device; install CuPy "
                            "(pip install 'qarray[cuda13]') or move it to the CPU first") from None
        take = cupy.from_dlpack
    else:
        raise TypeError(f"{what}: {type(x).__name__} lives on DLPack device type {device}, which qarray does not "
                        "take; move it to the CPU or a CUDA device first")
    try:
        return take(x)
    except (BufferError, RuntimeError, TypeError) as e:
        raise TypeError(f"{what}: could not take the {type(x).__module__}.{type(x).__qualname__} through DLPack "
                        f"({e}); pass a NumPy or CuPy array (for a PyTorch tensor: t.detach(), and "
                        "qarray.from_torch for a quantized one)") from None


def gemm_engine() -> str:
    """The CPU engine that integer matmul, linear and conv2d use on NumPy arrays
    now (``qarray.config.gemm``), and why: e.g. ``"u8s8: onnxruntime 1.32.0
    MLAS u8s8: CPU has avx512vnni; self-check passed"``."""
    from .._config import config
    from . import _gemm

    name = _gemm.engine(config.gemm)
    return f"{name}: {_gemm.status(name)[1]}"


_PLAIN = frozenset((int, float, str, bool, type(None)))  # the arguments that are never QArrays, told cheaply


_BLOCK_OPS = frozenset(("dequantize", "linear", "matmul"))  # the ops that take a block format (Q4_K): linear
# as weights (float or Q8_0 activations: qarray.ops.block_linear); matmul to say so


def block_error(op: str, q):
    """The TypeError of an op that does not take block formats (Q4_K) yet."""
    return TypeError(f"{op} does not take block formats yet; {q.dtype.name} is one: dequantize it "
                     "(q.dequantize()), or quantize the values to an integer format first; for x @ w.T with block-format "
                     "weights w (out_features, in_features) use qarray.linear(x, w)")


def on_data_device(op=None, *, integer_only=False):
    """Run ``op`` on the device of its first argument's data (a QArray, an array,
    or a sequence of QArrays): CuPy allocates and launches on the current
    device, which need not be the data's. Every public op is wrapped in it,
    as ``@on_data_device`` or, for an op that takes integer formats only
    (floating ones are refused with a TypeError naming the fix),
    ``@on_data_device(integer_only=True)``."""
    if op is None:
        return functools.partial(on_data_device, integer_only=integer_only)

    @functools.wraps(op)
    def on_device(first, *args, **kwargs):
        x = first[0] if isinstance(first, (list, tuple)) and first else first
        if integer_only:
            for q in (*(first if isinstance(first, (list, tuple)) else (first,)), *args, *kwargs.values()):
                # a QArray's QDType (``_dtype``) of a floating format
                kind = getattr(getattr(q, "_dtype", None), "kind", None) if type(q) not in _PLAIN else None
                if kind == "block":
                    raise block_error(op.__name__, q)
                if kind == "float":
                    raise TypeError(f"{op.__name__} takes integer formats; {q.dtype.name} is a floating format: "
                                    "dequantize it (q.dequantize()) or requantize it to an integer format first")
        b = getattr(x, "_backend", None)  # a QArray's
        if b is not None:
            if x._dtype.kind == "block" and op.__name__ not in _BLOCK_OPS:
                raise block_error(op.__name__, x)
            if b is _by_name.get("numpy"):
                return op(first, *args, **kwargs)  # the common call: NumPy's, on no device
            x = x.data
        elif type(x) is np.ndarray and _by_type.get(np.ndarray) is _by_name.get("numpy"):
            return op(first, *args, **kwargs)
        else:
            try:
                b = for_array(x)
            except TypeError:  # numbers and lists: NumPy's, on no device
                b = None
        device = NO_DEVICE if b is None else b.on(x)
        if device is NO_DEVICE:
            return op(first, *args, **kwargs)
        with device:
            return op(first, *args, **kwargs)

    return on_device


def per_sample(op):
    """Mark ``op`` as one on samples along its first argument's first axis, each
    independent of the others (conv2d, pooling): the QArray's backend runs it
    (:meth:`Backend.over_batches`: here at once; Dask chunk by chunk)."""

    @functools.wraps(op)
    def run(x, *args, **kwargs):
        if not hasattr(x, "_backend"):  # not a QArray: the op says so
            return op(x, *args, **kwargs)
        return x._backend.over_batches(op, x, *args, **kwargs)

    return run
