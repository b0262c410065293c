"""Helpers the test modules share (one definition each; test modules import
from here, not from each other): QArrays of given codes, every code of a dtype,
and one computation on the NumPy backend and on the host-run CUDA backend."""

import numpy as np

import qarray
from qarray import QArray


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
