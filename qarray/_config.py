"""Library-wide defaults: ``qarray.config`` and ``qarray.set_num_threads``."""

from __future__ import annotations

import contextlib

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

    >>> with qarray.config.using(rounding="half_away"):
    ...     r = qarray.requantize(q, 0.5, 0, "int8")
    """

    __slots__ = ("_mode", "_rounding", "numba")

    def __init__(self):
        self._mode = "fixed"
        self._rounding = "half_even"
        self.numba = True

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        self._mode = check_mode(value)

    @property
    def rounding(self):
        return self._rounding

    @rounding.setter
    def rounding(self, value):
        self._rounding = check_rounding(value)

    @contextlib.contextmanager
    def using(self, **settings):
        """Change settings inside a ``with`` block only."""
        for k in settings:
            if k not in ("mode", "rounding", "numba"):
                raise TypeError(f"qarray.config has no setting {k!r}")
        old = {k: getattr(self, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(self, k, v)
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)

    def __repr__(self):
        return f"Config(mode={self.mode!r}, rounding={self.rounding!r}, numba={self.numba})"


config = Config()


def resolve(mode, rounding):
    """Per-call ``mode`` / ``rounding`` or the defaults in ``config``."""
    mode = config.mode if mode is None else check_mode(mode)
    rounding = config.rounding if rounding is None else check_rounding(rounding)
    return mode, rounding


def set_num_threads(n: int) -> None:
    """Threads for the CPU kernels (Numba's thread pool); no-op without Numba."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_threads needs a positive integer, got {n!r}")
    from .backends import numpy as _np_backend

    _np_backend.set_num_threads(n)
