"""Helpers the test modules share (one definition each; test modules import
from here, not from each other): the rounding of an exact rational, QArrays of
given codes, every code of a dtype, and one computation on the NumPy backend
and on the host-run CUDA backend."""

import math
from fractions import Fraction

import numpy as np

import qarray
from qarray import QArray


def round_rational(v: Fraction, rounding: str = "half_even") -> int:
    """The integer nearest the exact rational ``v``, ties by ``rounding``
    (``half_even``, ``half_away`` from zero, ``half_up``)."""
    fl = math.floor(v)
    r = v - fl
    if r != Fraction(1, 2):
        return fl + (r > Fraction(1, 2))
    return {"half_even": fl + fl % 2, "half_up": fl + 1, "half_away": fl + (v > 0)}[rounding]


def ref_fixed(d: int, M: float, rounding: str = "half_even") -> int:
    """``R(d * m / 2**s)`` with ``(m, s)`` qarray's fixed-point form of ``M``,
    in Python integers (``quantize_multiplier`` is tested on its own)."""
    from qarray._fixed_point import quantize_multiplier

    m, s = (int(v) for v in quantize_multiplier(M))
    return round_rational(Fraction(d * m, 2**s), rounding)


def q_of(ints, scale, zp, dtype, **kw):
    """The QArray of codes ``ints``."""
    return QArray.from_int(np.asarray(ints), scale, zp, dtype, **kw)


def all_codes(d, scale, zp, shape=None):
    """Every code of dtype ``d``, qmin to qmax (reshaped to ``shape``)."""
    d = qarray.qdtype(d)
    c = np.arange(d.qmin, d.qmax + 1)
    return QArray.from_int(c if shape is None else c.reshape(shape), scale, zp, d)


def numpy_and_host(host, fn):
    """``fn(backend)`` on the NumPy backend's generic code and on the host-run
    CUDA backend ``host``: ``(want, got)``."""
    from qarray.backends import get

    with qarray.config.using(numba=False):
        want = fn(get("numpy"))
    return want, fn(host)
