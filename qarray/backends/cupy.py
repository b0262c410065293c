"""CuPy backend: the generic primitives on the GPU, with our own CUDA kernels for
quantize, dequantize and requantize. CuPy is imported on first use only.

Kernel sources live in ``qarray/backends/cuda/`` and are compiled with
``cupy.RawModule`` once per device. ``plan`` and ``launch_config`` decide every
argument and the grid; the host-execution harness in the tests calls this same
class with NumPy arrays and a CPU build of the kernels, so it checks this launch
logic too.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .._params import compact, view3
from ._base import Backend, nan_error

CUDA_DIR = Path(__file__).parent / "cuda"
BLOCK = 256
MAX_BLOCKS = 1024  # grid-stride loops cover the rest


def launch_config(total: int):
    """``(grid, block)`` for ``total`` elements."""
    return (max(1, min(-(-total // BLOCK), MAX_BLOCKS)),), (BLOCK,)


def plan(xp, shape, axis, block_size, *params):
    """``(total, layout ints, bidx, compact params)`` for the kernels' ``Layout``.

    The data is seen as ``(outer, n, inner)``, the parameters as
    ``(outer or 1, blocks, inner or 1)``; ``bidx[l]`` is the block of position ``l``.
    """
    total = math.prod(shape)
    if axis is None:
        ps = [xp.ascontiguousarray(p.reshape(1)) for p in params]
        return total, (1, max(total, 1), 1, 1, 0), xp.zeros(1, xp.int64), ps
    o, n, i = view3(shape, axis)
    ps = [xp.ascontiguousarray(compact(p, shape, axis, block_size)) for p in params]
    p3 = ps[0].shape
    bidx = xp.arange(n, dtype=xp.int64) // (block_size or 1)
    ps = [p.reshape(-1) for p in ps]
    return total, (n, max(i, 1), p3[1], p3[2], int(p3[0] > 1)), bidx, ps


class CupyBackend(Backend):
    name = "cupy"
    module = "cupy"

    def __init__(self):
        super().__init__()
        self._modules = {}

    @property
    def xp(self):
        if self._xp is None:
            self._xp = self.check()
        return self._xp

    def check(self):
        """CuPy itself, or a clear error when it is missing or sees no GPU."""
        try:
            import cupy
        except ImportError:
            raise ImportError(
                "the cupy backend needs CuPy: pip install 'qarray[cuda12]' or 'qarray[cuda13]'"
            ) from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDA driver missing or broken
            raise RuntimeError(f"the cupy backend found no usable CUDA device: {e}") from None
        if count < 1:
            raise RuntimeError("the cupy backend found no CUDA device")
        return cupy

    def _launch(self, source, name, grid, block, args, shared_mem=0):
        """Launch kernel ``name`` of ``cuda/<source>`` (compiled once per device)."""
        cupy = self.xp
        key = (cupy.cuda.Device().id, source)
        if key not in self._modules:
            code = (CUDA_DIR / source).read_text()
            self._modules[key] = cupy.RawModule(code=code, options=("-std=c++17", f"-I{CUDA_DIR}"))
        self._modules[key].get_function(name)(grid, block, args, shared_mem=shared_mem)

    def _elementwise(self, name, total, args):
        """A grid-stride kernel of ``elementwise.cu`` over ``total`` elements."""
        grid, block = launch_config(total)
        self._launch("elementwise.cu", name, grid, block, args)

    @staticmethod
    def _layout_scalars(total, lay):
        return (np.int64(total), *(np.int64(v) for v in lay))

    def quantize(self, x, scale, zero_point, qd, axis, block_size):
        xp = self.xp
        if x.dtype == np.float16:  # the kernels take float32/float64: widen (exact)
            x = x.astype(np.float32)
        x = xp.ascontiguousarray(x)
        ct = np.float64 if (x.dtype == np.float64 or qd.bits > 16) else np.float32
        total, lay, bidx, (s, z) = plan(xp, x.shape, axis, block_size, scale.astype(x.dtype), zero_point.astype(np.int32))
        out = xp.empty(x.shape, qd.storage)
        nan = xp.zeros(1, np.int32)
        if total:
            self._elementwise(f"quantize_{x.dtype.name}_{qd.storage.name}", total,
                         (x, s, z, bidx, *self._layout_scalars(total, lay), ct(qd.qmin), ct(qd.qmax), out, nan))
        if int(nan[0]):
            raise nan_error(x)
        return out

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        xp = self.xp
        q = xp.ascontiguousarray(q)
        ft = np.float64 if dtype == np.float64 else np.float32
        total, lay, bidx, (s, z) = plan(xp, q.shape, axis, block_size, scale.astype(ft), zero_point.astype(np.int32))
        out = xp.empty(q.shape, ft)
        if total:
            self._elementwise(f"dequantize_{q.dtype.name}_{np.dtype(ft).name}", total,
                         (q, s, z, bidx, *self._layout_scalars(total, lay), out))
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, as IEEE rounds it
            return out.astype(dtype, copy=False)

    def requantize(self, q, zp_in, zp_out, mult, qd, axis, block_size, rounding, out=None):
        xp = self.xp
        q = xp.ascontiguousarray(q)
        if q.dtype.name not in ("int8", "uint8", "int16", "uint16", "int32", "int64"):
            return super().requantize(q, zp_in, zp_out, mult, qd, axis, block_size, rounding, out)
        shape = zp_in.shape
        if rounding is None:
            m, s, f, code = xp.zeros(shape, np.int64), xp.ones(shape, np.int64), mult, -1
        else:
            (m, s), f, code = mult, xp.zeros(shape, np.float64), rounding
        params = [xp.broadcast_to(xp.asarray(p).astype(dt), shape)
                  for p, dt in ((zp_in, np.int64), (zp_out, np.int64), (m, np.int64), (s, np.int64), (f, np.float64))]
        total, lay, bidx, ps = plan(xp, q.shape, axis, block_size, *params)
        target = xp.empty(q.shape, qd.storage)
        if total:
            self._elementwise(f"requantize_{q.dtype.name}_{qd.storage.name}", total,
                         (q, *ps, bidx, *self._layout_scalars(total, lay), np.int64(qd.qmin), np.int64(qd.qmax),
                          np.int32(code), target))
        if out is None:
            return target
        out[...] = target
        return out
