"""NumPy backend: the generic primitives, with Numba kernels for the hot ones.

With Numba installed (extra ``fast``) and ``qarray.config.numba`` true,
quantize, dequantize and requantize run as fused parallel loops
(``qarray.backends._numba``); otherwise the generic NumPy code runs. Both give
the same integers and the same float bits.
"""

from __future__ import annotations

import numpy as np

from .._config import config
from .._params import Layout
from ._base import Backend, nan_error

# Below this many elements the generic NumPy code runs: it costs a few dozen
# microseconds there, and the first small call never imports Numba (whose
# start-up is about half a second even with a warm cache).
_SMALL = 1 << 14
_COLS = 4096  # data with one parameter is seen as rows of this many elements, shared out to the threads


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


def _contiguous(a):
    """C-contiguous ``a`` (``np.ascontiguousarray`` would make 0-d arrays 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


class NumpyBackend(Backend):
    name = "numpy"
    module = "numpy"

    def __init__(self):
        super().__init__(np)

    @staticmethod
    def _fast(a):
        """The kernel module when the Numba path should run for ``a``, else None."""
        if not config.numba or a.size < _SMALL:
            return None
        return _numba_kernels()

    @staticmethod
    def _run(kernel, a, out, axis, block_size, params, *args):
        """Run ``kernel(a3, *params3, bidx, *args, out3)`` over every piece of the
        layout (``Layout.pieces``: shapes that keep the kernels' inner loops fast)."""
        af, of = _contiguous(a).reshape(-1), out.reshape(-1)
        results = []
        for sl, lay in Layout(a.shape, axis, block_size).pieces(_COLS):
            ps = [np.ascontiguousarray(lay.compact(p)) for p in params]
            results.append(kernel(af[sl].reshape(lay.dims), *ps, lay.bidx(), *args, of[sl].reshape(lay.dims)))
        return results

    def quantize(self, x, scale, zero_point, qd, axis, block_size):
        k = self._fast(x)
        if k is None:
            return super().quantize(x, scale, zero_point, qd, axis, block_size)
        if x.dtype == np.float16:  # Numba has no float16 arithmetic: widen (exact) first
            x = x.astype(np.float32)
        # <= 16-bit results clamp exactly in float32; qint32 needs float64.
        ct = np.float64 if (x.dtype == np.float64 or qd.bits > 16) else np.float32
        out = np.empty(x.shape, qd.storage)
        params = (scale.astype(x.dtype), zero_point.astype(ct))
        bad = self._run(k.quantize, x, out, axis, block_size, params, ct(qd.qmin), ct(qd.qmax))
        if any(v != v for v in bad) and np.isnan(x).any():  # NaN or inf was seen; inf is fine
            raise nan_error(x)
        return out

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        k = self._fast(q)
        if k is None:
            return super().dequantize(q, scale, zero_point, axis, block_size, dtype)
        ft = np.float64 if dtype == np.float64 else np.float32
        out = np.empty(q.shape, ft)
        self._run(k.dequantize, q, out, axis, block_size, (scale.astype(ft), zero_point.astype(np.int64)))
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, as IEEE rounds it
            return out.astype(dtype, copy=False)

    def lut(self, q, table, axis=None):
        k = self._fast(q)
        if k is None or axis is not None:
            return super().lut(q, table, axis)
        u = _contiguous(q).view(np.dtype(f"u{q.dtype.itemsize}"))
        out = np.empty(q.shape, table.dtype)
        k.lut(u.reshape(-1), table, out.reshape(-1))
        return out

    def requantize(self, q, rq, out=None):
        k = self._fast(q)
        if k is None or (out is not None and not out.flags.c_contiguous):
            return super().requantize(q, rq, out)
        out = np.empty(q.shape, rq.out_dtype) if out is None else out
        kernel = k.requantize[rq.rounding, rq.narrow(q.dtype)]
        self._run(kernel, q, out, rq.axis, rq.block_size, rq.params, np.int64(rq.lo), np.int64(rq.hi))
        return out

    def softmax(self, x, table, s_in, s_out, z_out, lo, hi, log, out_dtype):
        k = self._fast(x)
        if k is None or x.size == 0:
            return super().softmax(x, table, s_in, s_out, z_out, lo, hi, log, out_dtype)
        x = _contiguous(x)
        logs = np.zeros(x.shape[0])
        if log:  # the log in NumPy, as the generic code takes it
            sums = np.empty(x.shape[0], np.int64)
            k.softmax_sums(x, table, sums)
            logs = np.log(sums.astype(np.float64) / 2.0**30)
        out = np.empty(x.shape, out_dtype)
        k.softmax(x, table, logs, np.float64(s_in), np.float64(s_out), np.float64(z_out),
                  np.float64(lo), np.float64(hi), bool(log), out)
        return out
