"""Library-wide defaults: ``qarray.config`` and ``qarray.set_num_threads``."""

from __future__ import annotations

import contextlib
import contextvars
import os

import numpy as np

from ._fixed_point import ROUNDINGS

MODES = ("fixed", "float")


def check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_rounding(rounding):
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {tuple(ROUNDINGS)}, got {rounding!r}")
    return rounding


def check_numba(value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"numba must be True or False, got {value!r}")
    return bool(value)


GEMMS = ("auto", "qarray", "u8s8", "u8u8", "blas")


def check_gemm(value):
    if value not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {value!r}")
    return value


_CHECKS = {"mode": check_mode, "rounding": check_rounding, "numba": check_numba, "gemm": check_gemm}

# The settings of the ``using`` blocks active in this context (thread, asyncio
# task): a tuple of ``(key, settings)`` layers, innermost last, never mutated;
# ``key`` is a fresh object per block. New threads start with none.
_layers: contextvars.ContextVar = contextvars.ContextVar("qarray_config_layers", default=())


def _setting(name):
    def get(self):
        for _, settings in reversed(_layers.get()):
            if name in settings:
                return settings[name]
        return self._defaults[name]

    def set(self, value):
        value = _CHECKS[name](value)
        layers = _layers.get()
        for i in range(len(layers) - 1, -1, -1):
            key, settings = layers[i]
            if name in settings:  # inside a block that sets it: change it there, until the block ends
                _layers.set(layers[:i] + ((key, {**settings, name: value}),) + layers[i + 1 :])
                return
        self._defaults[name] = value  # else the default of every context that does not override it

    return property(get, set)


class Config:
    """Defaults for every op that requantizes, plus the CPU fast-path switch.

    Attributes
    ----------
    mode : {"fixed", "float"}
        Requantize integer-only (default) or the ONNX float way.
    rounding : {"half_even", "half_away", "half_up", "tflite"}
        Tie rule of fixed-point requantize.
    numba : bool
        Use the Numba kernels of the NumPy backend when Numba is installed.
        ``False`` runs the generic NumPy code (same results, slower).
    gemm : {"auto", "qarray", "u8s8", "u8u8", "blas"}
        The CPU engine of integer matmul, linear and conv2d (NumPy arrays):
        qarray's own kernels (``qarray``: AMX, AVX-512 VNNI, AVX-VNNI or
        portable loops, by the CPU; extra ``fast``), onnxruntime's MLAS int8
        kernels (``u8s8``, ``u8u8``; extra ``fast``) or float32 BLAS in exact
        chunks. "auto" (default) takes the first that is exact on this CPU
        (``qarray.backends.gemm_engine()`` says which and why); forcing one
        that is not raises ValueError when it would run.
        ``nn`` layers pack their weights for the engine in use when built.

    Assigning an attribute sets the default for every thread; ``using(...)``
    overrides settings in the current context only (thread or asyncio task, as
    NumPy's ``errstate``), so other threads keep seeing the defaults. Blocks may
    nest or even overlap: leaving one removes exactly its own settings. Assigning
    inside a ``using`` block that sets the same attribute changes it until the
    block ends.

    >>> with qarray.config.using(rounding="half_away"):
    ...     r = qarray.requantize(q, 0.5, 0, "int8")
    """

    __slots__ = ("_defaults",)

    mode = _setting("mode")
    rounding = _setting("rounding")
    numba = _setting("numba")
    gemm = _setting("gemm")

    def __init__(self):
        self._defaults = {"mode": "fixed", "rounding": "half_even", "numba": True, "gemm": "auto"}

    @contextlib.contextmanager
    def using(self, **settings):
        """Change settings inside a ``with`` block only, in this thread (context) only."""
        for k in settings:
            if k not in _CHECKS:
                raise TypeError(f"qarray.config has no setting {k!r}")
        key = object()
        _layers.set(_layers.get() + ((key, {k: _CHECKS[k](v) for k, v in settings.items()}),))
        try:
            yield self
        finally:  # this block's layer only: overlapping blocks may end in any order
            _layers.set(tuple(layer for layer in _layers.get() if layer[0] is not key))

    def __repr__(self):
        return f"Config(mode={self.mode!r}, rounding={self.rounding!r}, numba={self.numba}, gemm={self.gemm!r})"


config = Config()


def resolve(mode, rounding):
    """Per-call ``mode`` / ``rounding`` or the defaults in ``config``."""
    mode = config.mode if mode is None else check_mode(mode)
    rounding = config.rounding if rounding is None else check_rounding(rounding)
    return mode, rounding


THREADS = [os.cpu_count() or 1]  # what set_num_threads set: read by cpu.pool.parallel and the GEMM engine


def set_num_threads(n: int) -> None:
    """Threads for the CPU kernels (the Numba kernels' parts, at most
    ``NUMBA_NUM_THREADS``) and for the int8 GEMM engine's new sessions."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_threads needs a positive integer, got {n!r}")
    THREADS[0] = n
