"""NumPy backend: the generic primitives, with Numba kernels for the hot ones.

With Numba installed (extra ``fast``) and ``qarray.config.numba`` true,
quantize, dequantize and requantize run as fused parallel loops
(``qarray.backends._numba``); otherwise the generic NumPy code runs. Both give
the same integers and the same float bits.
"""

from __future__ import annotations

import math

import numpy as np

from .._config import config
from .._params import compact, view3
from ._base import Backend, nan_error

_SMALL = 1 << 15  # below this many elements the kernels run on one thread
_COLS = 4096  # per-tensor data is seen as rows of this many elements


def _numba_kernels():
    """The kernel module, or None without Numba (imported once, on first use)."""
    global _kernels
    if _kernels is False:
        try:
            from . import _numba as k
        except ImportError:
            k = None
        _kernels = k
    return _kernels


_kernels = False


def set_num_threads(n: int) -> None:
    if _numba_kernels() is not None:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


class _OneThread:
    """Run small inputs on the calling thread: the pool costs more than it saves."""

    def __init__(self, size):
        self.small = size < _SMALL

    def __enter__(self):
        if self.small:
            import numba

            self.saved = numba.get_num_threads()
            numba.set_num_threads(1)

    def __exit__(self, *exc):
        if self.small:
            import numba

            numba.set_num_threads(self.saved)


def _contiguous(a):
    """C-contiguous ``a`` (``np.ascontiguousarray`` would make 0-d arrays 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _layouts(shape, axis, block_size, *params):
    """``(view3 shape, compact params, bidx)`` pieces covering an array of ``shape``.

    Per-tensor data becomes ``(1, rows, _COLS)`` plus a short tail, so one
    kernel layout serves every granularity (see ``_numba``).
    """
    if axis is None:
        ps = [np.ascontiguousarray(p).reshape(1, 1, 1) for p in params]
        n = math.prod(shape)
        rows, tail = divmod(n, _COLS)
        out = []
        if rows:
            out.append((slice(0, rows * _COLS), (1, rows, _COLS), ps, np.zeros(rows, np.int64)))
        if tail:
            out.append((slice(rows * _COLS, n), (1, 1, tail), ps, np.zeros(1, np.int64)))
        return out
    ps = [np.ascontiguousarray(compact(p, shape, axis, block_size)) for p in params]
    bidx = np.arange(shape[axis], dtype=np.int64) // (block_size or 1)
    return [(slice(None), view3(shape, axis), ps, bidx)]


class NumpyBackend(Backend):
    name = "numpy"
    module = "numpy"

    def __init__(self):
        super().__init__(np)

    @staticmethod
    def _fast(*arrays):
        if not config.numba or _numba_kernels() is None:
            return None
        if any(a.size == 0 for a in arrays):
            return None
        return _kernels

    def quantize(self, x, scale, zero_point, qd, axis, block_size):
        k = self._fast(x)
        if k is None or x.dtype == np.float16:
            if k is not None:  # Numba has no float16 arithmetic: widen (exact) first
                return self.quantize(x.astype(np.float32), scale, zero_point, qd, axis, block_size)
            return super().quantize(x, scale, zero_point, qd, axis, block_size)
        x = _contiguous(x)
        # <= 16-bit results clamp exactly in float32; qint32 needs float64.
        ct = np.float64 if (x.dtype == np.float64 or qd.bits > 16) else np.float32
        out = np.empty(x.shape, qd.storage)
        xf, of = x.reshape(-1), out.reshape(-1)
        bad = 0.0
        with _OneThread(x.size):
            for sl, shape3, (s, z), bidx in _layouts(x.shape, axis, block_size, scale, zero_point):
                bad += k.quantize(xf[sl].reshape(shape3), s.astype(x.dtype), z.astype(ct), bidx,
                                  ct(qd.qmin), ct(qd.qmax), of[sl].reshape(shape3))
        if bad != bad and np.isnan(x).any():  # NaN or inf was seen; inf is fine
            raise nan_error(x)
        return out

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        k = self._fast(q)
        if k is None:
            return super().dequantize(q, scale, zero_point, axis, block_size, dtype)
        q = _contiguous(q)
        ft = np.float64 if dtype == np.float64 else np.float32
        out = np.empty(q.shape, ft)
        qf, of = q.reshape(-1), out.reshape(-1)
        with _OneThread(q.size):
            for sl, shape3, (s, z), bidx in _layouts(q.shape, axis, block_size, scale, zero_point):
                k.dequantize(qf[sl].reshape(shape3), s.astype(ft), z.astype(np.int64), bidx,
                             of[sl].reshape(shape3))
        return out.astype(dtype, copy=False)

    def requantize(self, q, zp_in, zp_out, mult, qd, axis, block_size, rounding):
        k = self._fast(q)
        if k is None:
            return super().requantize(q, zp_in, zp_out, mult, qd, axis, block_size, rounding)
        q = _contiguous(q)
        if rounding is None:
            f, m, s, code = mult, np.zeros(1, np.int64), np.ones(1, np.int64), -1
        else:
            (m, s), f, code = mult, np.zeros(1), rounding
        params = [np.broadcast_to(p, np.shape(zp_in)) for p in (zp_in, zp_out, m, s, f)]
        out = np.empty(q.shape, qd.storage)
        qf, of = q.reshape(-1), out.reshape(-1)
        with _OneThread(q.size):
            for sl, shape3, (zi, zo, mm, ss, ff), bidx in _layouts(q.shape, axis, block_size, *params):
                k.requantize(qf[sl].reshape(shape3), zi.astype(np.int64), zo.astype(np.int64),
                             mm.astype(np.int64), ss.astype(np.int64), ff.astype(np.float64), bidx,
                             np.int64(qd.qmin), np.int64(qd.qmax), code, of[sl].reshape(shape3))
        return out
