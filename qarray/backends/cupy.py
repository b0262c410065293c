"""CuPy backend: the generic primitives on the GPU, with our own CUDA kernels for
quantize, dequantize (integer and floating formats) and requantize. CuPy is
imported on first use only.

``CupyBackend`` decides what runs: which kernel, on which arguments, or the
generic code where no kernel fits. How a kernel is named, compiled and launched
(kernel names, sources, the grid, the argument plans, the kernels' codes) is
``_cuda.py``; the backend's ``_function``, ``_launch``, ``_max_grid`` and
``_elementwise`` compile each source with ``cupy.RawModule`` once per device and
launch at most ``_max_grid`` blocks (the device's SMs times the kernel's
occupancy). Each primitive here runs with its data's device current, whichever
device is the caller's; the host-execution harness in the tests calls this same
class with NumPy arrays and a CPU build of the kernels, so it checks this launch
logic too.
"""

from __future__ import annotations

import math
import threading
import weakref

from typing import NamedTuple

import numpy as np

from .. import _formats
from .._dtypes import qdtype
from .._fixed_point import NO_REQUANT
from .._params import Layout, array_key, param_shape, to_host
from ._base import BINARY_OPS, Backend, contiguous, nan_error
from ._cuda import (BLOCK, BLOCK_GEMM_TILE, BLOCK_GEMV_COLS, BLOCK_GEMV_ROWS, CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT,
                    CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_8I, CUDA_R_32I, FLOATS, GEMV_COLS, GEMV_ROWS, KPAD, MXINT8_FORMAT,
                    NVRTC_OPTIONS, OUT_KINDS, PLAN_GROUP, PLAN_INTEGERS, STORAGE, _name, _period, _rows, block_plan,
                    format_args, kernel_name, kernel_source, launch_config, plan, requant_args)
from ._cuda import compile_ptx  # noqa: F401 (qarray.backends.cupy.compile_ptx, as CHANGELOG.md names it)

EACH = 64  # min/max segments up to this long take one thread each, longer ones a block
K_INT32 = (2**31 // 2**14) // KPAD * KPAD - KPAD  # values of K whose int8 x int8 sums always fit int32


class DeviceWeight(NamedTuple):
    """:meth:`CupyBackend.pack_weight`'s weights ``(K, N)`` on the device: ``w8``
    the int8 ``w' = codes - shift`` transposed to ``(N, K)`` and zero-padded to
    ``(npad, kpad)`` (cuBLAS's "T" operand; gemv's columns), ``w4`` the same
    codes of 4 bits or less as offset nibbles two to a byte (``gemm.cu`` gemv)
    or None, and, as :class:`qarray.backends._base.FloatWeight`, ``shift``,
    the int64 column sums of ``w'`` and the code width."""

    w8: object
    w4: object
    shift: int
    colsum: object
    bits: int


_REQUANT_INPUTS = ("int8", "uint8", "int16", "uint16", "int32", "int64")  # elementwise.cu's requantize kernels


def _overlap(p, q, nbytes):
    """Whether ``nbytes`` at device address ``p`` and ``nbytes`` at ``q`` meet."""
    return p < q + nbytes and q < p + nbytes


class CupyBackend(Backend):
    name = "cupy"
    module = "cupy"
    float_bits = True  # CuPy has no ml_dtypes dtypes
    chunk = 1 << 22  # larger pieces for the generic code: fewer kernel launches

    def __init__(self):
        super().__init__()
        self._modules = {}
        self._consts = {}
        self._grids = {}
        self._flags = {}

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

    def array_types(self) -> tuple:
        import cupy  # asked only once CuPy is imported; a CPU-only machine may have it

        return (cupy.ndarray,)

    def check_together(self, arrays) -> None:
        devices = sorted({a.device.id for a in arrays})
        if len(devices) > 1:
            raise TypeError(
                f"CuPy arrays on two devices ({devices[0]} and {devices[1]}) can not be combined; "
                "copy them to one device first (cupy.asarray under `with cupy.cuda.Device(i):`)"
            )

    def on(self, x):
        """``x``'s device, to enter around a primitive or an op: CuPy allocates and
        launches on the current device, which need not be the data's."""
        return x.device

    def _device_id(self) -> int:
        return self.xp.cuda.runtime.getDevice()

    def kept(self, key, make):
        """``make()``, once per ``key`` (which names the device where it matters) and
        kept: parameters, layouts and launch arguments that ops pass on every call."""
        v = self._consts.get(key)
        if v is None:
            if len(self._consts) >= 4096:  # a bound, not an LRU: parameters repeat or they do not
                self._consts.clear()
            v = self._consts[key] = make()
        return v

    def param(self, a):
        """Host array ``a`` as a C-contiguous device array on the current device,
        copied there once and kept (parameters and layouts that ops pass on every
        call); treat it as read-only."""
        a = np.ascontiguousarray(a)
        return self.kept((self._device_id(), *array_key(a)), lambda: self.xp.asarray(a))

    @staticmethod
    def _ptr(a) -> int:
        """The device address of ``a``'s first element."""
        return a.__cuda_array_interface__["data"][0]

    def _blas(self):
        """``(cublas module, handle)`` of the current device."""
        cupy = self.xp
        return cupy.cuda.cublas, cupy.cuda.device.get_cublas_handle()

    def _function(self, source, name):
        """Kernel ``name`` of ``cuda/<source>``, compiled once per device."""
        key = (self._device_id(), source)
        if key not in self._modules:
            self._modules[key] = self.xp.RawModule(code=kernel_source(source), options=NVRTC_OPTIONS)
        return self._modules[key].get_function(name)

    def _launch(self, source, name, grid, block, args, shared_mem=0):
        """Launch kernel ``name`` of ``cuda/<source>``."""
        self._function(source, name)(grid, block, args, shared_mem=shared_mem)

    def _max_grid(self, source, name):
        """Blocks of ``BLOCK`` threads that fill the current device once: its SM
        count times how many blocks of this kernel one SM holds (the driver's
        occupancy calculator, given the compiled function's handle: the
        ``RawKernel``'s ``kernel.ptr``); kept per device and kernel."""
        key = (self._device_id(), source, name)
        if key not in self._grids:
            cupy = self.xp
            sms = cupy.cuda.runtime.getDeviceProperties(key[0])["multiProcessorCount"]
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                self._function(source, name).kernel.ptr, BLOCK, 0)
            self._grids[key] = max(1, sms * per_sm)
        return self._grids[key]

    def _elementwise(self, name, total, args, source="elementwise.cu"):
        """A grid-stride kernel of ``cuda/<source>`` over ``total`` elements."""
        grid, block = launch_config(total, self._max_grid(source, name))
        self._launch(source, name, grid, block, args)

    # NaN input is reported without waiting for the device: quantize kernels set a
    # device flag (one per device and thread, reset only when read) and the call
    # notes its input (a weak reference: a pending check never keeps an array
    # alive); the next host read through this backend (``to_host``: QArray.get,
    # .to("numpy"), repr) or ``check_nan()`` reads the flag, which waits for the
    # device anyway, and raises the error the CPU raises at once for the first
    # noted input still alive that has NaN.
    PENDING = 64  # inputs noted; past this the oldest is let go

    def _nan_flag(self, x, error):
        """The device int32 that quantize kernels set to 1 on NaN input; ``error(x)``
        is the error should ``x`` hold NaN."""
        key = (self._device_id(), threading.get_ident())
        if key not in self._flags:
            self._flags[key] = (self.xp.zeros(1, np.int32), [])
        flag, pending = self._flags[key]
        pending.append((weakref.ref(x), error))
        del pending[: -self.PENDING]
        return flag

    def check_nan(self):
        """Raise the NaN error of a quantize call on this thread since the last
        check (ValueError, as the CPU raises it at the call); this reads one
        device flag per device used, so it waits for the device. (Dask reads it
        in each chunk's task, so that CuPy chunks raise at compute().)"""
        for key, (flag, pending) in list(self._flags.items()):
            if key[1] != threading.get_ident() or not pending:
                continue
            with self.on(flag):
                seen = int(to_host(flag)[0])
                noted = list(pending)
                pending.clear()
                if not seen:
                    continue
                flag.fill(0)
            for ref, error in noted:
                x = ref()
                if x is not None:
                    with self.on(x):
                        if bool(self.xp.isnan(x).any()):
                            raise error(x)
            raise ValueError("cannot quantize NaN: a quantize call on this thread since the last host read had NaN "
                             "input, no longer held (so where is not known); replace NaN (e.g. nan_to_num) before "
                             "quantizing, or call check_nan() after each quantize to find it")

    def to_host(self, a):
        self.check_nan()
        return super().to_host(a)

    def quantize(self, x, qp, out=None):
        return self._quantize_with("quantize", x, qp, out)

    def quantize_stochastic(self, x, qp, key, index=None):
        if index is not None:  # a Dask chunk's elements, numbered in the whole array
            return super().quantize_stochastic(x, qp, key, index)
        return self._quantize_with("quantize_stochastic", x, qp, None, tuple(np.uint32(k) for k in key))

    def _quantize_with(self, base, x, qp, out, extra=()):
        """Codes from kernel ``base`` (into ``out`` when given): quantize's
        arguments, then ``extra``, the output and the NaN flag."""
        with self.on(x):
            x = contiguous(x)
            total, args = self._quantize_args(x, qp)

            def fill(target):
                if total:
                    self._elementwise(kernel_name(base, x.dtype, qp.qd.storage), total,
                                      (*args, *extra, target, self._nan_flag(x, nan_error)))
                return target

            return self._into(out, fill, x.shape, qp.qd.storage)

    def _quantize_args(self, x, qp):
        """``(total, args)``: the elements and the leading arguments of the quantize
        kernels (``x``, scale, zero point, layout, bounds)."""
        qd = qp.qd
        ft = np.float64 if x.dtype == np.float64 else np.float32  # float16 is computed in float32, as on the CPU
        ct = np.float64 if (ft == np.float64 or qd.bits > 16) else np.float32
        s, z = np.asarray(qp.scale, ft), np.asarray(qp.zero_point, np.int32)
        total, layout, (s, z) = plan(self, x.shape, qp.axis, qp.block_size, s, z)
        return total, (x, s, z, *layout, ct(qd.qmin), ct(qd.qmax))

    def fake_quantize(self, x, qp, dtype, mask=False, key=None, index=None, out=None):
        if dtype != x.dtype or index is not None:  # the kernels give the input's float type; a Dask chunk's index
            return super().fake_quantize(x, qp, dtype, mask, key, index, out)
        xp, qd = self.xp, qp.qd
        with self.on(x):
            x = contiguous(x)
            total, args = self._quantize_args(x, qp)
            # out itself unless it overlaps x other than exactly (each thread reads
            # its element before writing it; a shifted overlap would race)
            direct = out is not None and out.flags.c_contiguous and (
                self._ptr(out) == self._ptr(x) or not _overlap(self._ptr(out), self._ptr(x), out.nbytes))
            values = out if direct else xp.empty(x.shape, x.dtype)
            inside = xp.empty(x.shape, np.bool_) if mask else None
            if total and key is not None:  # values and mask in one pass (a grid-stride loop)
                self._elementwise(kernel_name("fake_quantize_stochastic", x.dtype, qd.storage), total,
                                  (*args, *(np.uint32(k) for k in key), values,
                                   xp.empty(1, np.bool_) if inside is None else inside, np.int32(mask),
                                   self._nan_flag(x, nan_error)))
            elif total:
                if mask:  # a pass of its own (the vector map has one output), first: out may be x
                    self._elementwise(kernel_name("quantize_mask", x.dtype, qd.storage), total, (*args, inside))
                self._elementwise(kernel_name("fake_quantize", x.dtype, qd.storage), total,
                                  (*args, values, self._nan_flag(x, nan_error)))
            if out is not None and not direct:
                out[...] = values
            return (values if out is None else out), inside

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        xp = self.xp
        with self.on(q):
            q = contiguous(q)
            ft = np.float64 if dtype == np.float64 else np.float32  # float16: a float32 result, rounded once more
            s, z = np.asarray(scale, ft), np.asarray(zero_point, np.int32)
            total, layout, (s, z) = plan(self, q.shape, axis, block_size, s, z)
            out = xp.empty(q.shape, dtype)
            if total:
                self._elementwise(kernel_name("dequantize", q.dtype, dtype), total,
                                  (q, s, z, *layout, out))
            return out

    def quantize_float(self, x, scale, qd, axis, block_size, saturate, *, mx=False, multiply=False):
        xp = self.xp
        with self.on(x):
            if _name(x.dtype) not in FLOATS or mx or multiply or qd.name == "mxint8":  # only the generic MX / NVFP4 path: the host
                return super().quantize_float(x, scale, qd, axis, block_size, saturate, mx=mx, multiply=multiply)
            x = contiguous(x)
            ft = np.float64 if x.dtype == np.float64 else np.float32  # float16 is divided in float32, as on the CPU
            s = np.asarray(scale).astype(np.float32).astype(ft)  # float16 and bfloat16 scales widen exactly
            total, layout, (s,) = plan(self, x.shape, axis, block_size, s)
            out = xp.empty(x.shape, np.uint8)
            fmt = format_args(qd)
            if total:  # the flag is set only for a format without NaN (float6, float4): their error
                nan = self._nan_flag(x, lambda _: _formats.nan_error(qd))
                self._elementwise(kernel_name("quantize_format", x.dtype), total,
                                  (x, s, *layout, *fmt, np.int32(bool(saturate)), out, nan),
                                  "formats.cu")
            return out

    def dequantize_float(self, q, scale, qd, axis, block_size, dtype):
        xp = self.xp
        with self.on(q):
            if _name(dtype) not in FLOATS or q.dtype != np.uint8:
                return super().dequantize_float(q, scale, qd, axis, block_size, dtype)
            q = contiguous(q)
            ft = np.float64 if dtype == np.float64 else np.float32  # float16: a float32 result, rounded once more
            total, layout, (s,) = plan(self, q.shape, axis, block_size, np.asarray(scale).astype(ft))
            out = xp.empty(q.shape, dtype)
            if total:
                self._elementwise(kernel_name("dequantize_format", dtype), total,
                                  (q, s, *layout, *format_args(qd), out), "formats.cu")
            return out

    def quantize_mx(self, x, mx, axis, block_size, rounding):
        if _name(x.dtype) not in ("float32", "float64"):
            return super().quantize_mx(x, mx, axis, block_size, rounding)
        qd, ft = qdtype(mx.element), x.dtype.type
        fmt = MXINT8_FORMAT if mx.name == "mxint8" else format_args(qd)
        codes, bits = self._blocks(kernel_name("quantize_mx", x.dtype), x, axis, block_size,
                                   (*fmt, np.int32(mx.name == "mxint8"), np.int32(mx.emax), np.int32(mx.mbits),
                                    np.int32(_formats.SCALE_ROUNDINGS.index(rounding)), ft(_formats.finfo(qd).max)))
        return codes.view(self.float_storage(qd)), bits

    def quantize_nvfp4(self, x, axis, block_size, gs):
        if x.dtype != np.float32:
            return super().quantize_nvfp4(x, axis, block_size, gs)
        if gs is None:  # the default tensor scale: a pass for the block maxima first
            gs = self.nvfp4_global_scale(x, self.block_amax(x, axis, block_size))
        return (*self._blocks("quantize_nvfp4", x, axis, block_size, (np.float32(gs),)), gs)

    def _blocks(self, name, x, axis, block_size, args):
        """``(codes, bits)`` of an MX or NVFP4 kernel of formats.cu, a thread per block
        of ``x`` along ``axis``: the element codes as uint8 on the device, the scale
        bits as uint8 on the host in the parameters' shape."""
        xp = self.xp
        with self.on(x):
            x = contiguous(x)
            lay = Layout(x.shape, axis, block_size)
            cols = lay.outer * lay.blocks * lay.inner
            codes, bits = xp.empty(x.shape, np.uint8), xp.empty(cols, np.uint8)
            if cols:
                self._elementwise(name, cols, (x, *(np.int64(v) for v in (cols, lay.n, lay.inner, lay.blocks, block_size)),
                                               *args, codes, bits), "formats.cu")
            return codes, self.to_host(bits).reshape(param_shape(x.shape, axis, block_size))

    def requantize(self, q, rq, out=None):
        xp = self.xp
        with self.on(q):
            q = contiguous(q)
            if _name(q.dtype) not in _REQUANT_INPUTS or rq.qd is None:
                return super().requantize(q, rq, out)
            total, args = requant_args(self, q.shape, rq)
            rows = None if out is None or out.flags.c_contiguous or not total else _rows(out)
            if rows is not None:  # a strided slice (cat along an inner axis): written in place
                row, stride, span = rows
                dest = xp.lib.stride_tricks.as_strided(out, shape=(span,), strides=(out.itemsize,))
                self._elementwise(kernel_name("requantize_rows", q.dtype, rq.qd.storage), total, (q, *args, np.int64(row), np.int64(stride), dest), "ops.cu")
                return out

            def fill(target):
                if total:
                    self._elementwise(kernel_name("requantize", q.dtype, rq.qd.storage), total, (q, *args, target))
                return target

            return self._into(out, fill, q.shape, rq.qd.storage)

    def requantize_stochastic(self, q, rq, key, index=None):
        with self.on(q):
            if index is not None or _name(q.dtype) not in _REQUANT_INPUTS or rq.qd is None:  # index: a Dask chunk's
                return super().requantize_stochastic(q, rq, key, index)
            q = contiguous(q)
            total, args = requant_args(self, q.shape, rq)
            out = self.xp.empty(q.shape, rq.qd.storage)
            if total:
                self._elementwise(kernel_name("requantize_stochastic", q.dtype, rq.qd.storage), total,
                                  (q, *args, *(np.uint32(k) for k in key), out))
            return out

    def clip(self, q, lo, hi):
        with self.on(q):
            if np.ndim(lo) or np.ndim(hi) or _name(q.dtype) not in STORAGE:
                return super().clip(q, lo, hi)
            q = contiguous(q)
            out = self.xp.empty_like(q)
            if q.size:
                self._elementwise(kernel_name("clip", q.dtype), q.size, (q, np.int64(int(lo)), np.int64(int(hi)), np.int64(q.size), out), "ops.cu")
            return out

    def binary(self, a, b, bp, out=None):
        xp, rq = self.xp, bp.rq
        with self.on(a):
            shape = a.shape if a.shape == b.shape else np.broadcast_shapes(a.shape, b.shape)
            pa, pb = _period(a.shape, shape), _period(b.shape, shape)
            out_dtype = bp.out_dtype
            if pa is None or pb is None or not {_name(a.dtype), _name(b.dtype)} <= STORAGE or _name(out_dtype) not in OUT_KINDS:
                return super().binary(a, b, bp, out)
            # without rq the kernel stores the int64 result and reads no parameters: any will do
            total, args = requant_args(self, shape, bp.ra if rq is None else rq)

            def fill(target):
                if total:
                    operands = [(xp.ascontiguousarray(x), np.int64(p),
                                 *(np.int64(int(v)) for v in (r.zp_in, r.m, r.shift)), np.int32(r.rounding))
                                for x, p, r in ((a, pa, bp.ra), (b, pb, bp.rb))]
                    kind = np.int32(OUT_KINDS[_name(out_dtype)] if rq is not None else 0)
                    self._elementwise(kernel_name("binary", a.dtype, b.dtype), total,
                                      (*operands[0], *operands[1], np.int32(BINARY_OPS[bp.op]), *args, kind, target),
                                      "ops.cu")
                return target

            return self._into(out, fill, shape, out_dtype)

    def pack(self, q, bits):
        xp = self.xp
        with self.on(q):
            if _name(q.dtype) not in ("int8", "uint8"):
                return super().pack(q, bits)
            flat = xp.ascontiguousarray(q).reshape(-1).view(np.uint8)
            out = xp.empty(-(-flat.size // (8 // bits)), np.uint8)
            if out.size:
                self._elementwise("pack_bits", out.size, (flat, np.int64(flat.size), np.int32(bits), np.int64(out.size), out), "ops.cu")
            return out

    def unpack(self, packed, bits, signed, count):
        xp = self.xp
        with self.on(packed):
            if packed.dtype != np.uint8:
                return super().unpack(packed, bits, signed, count)
            packed = xp.ascontiguousarray(packed).reshape(-1)
            n = len(range(packed.size * (8 // bits))[:count])  # as the generic slice [:count]
            out = xp.empty(n, np.int8 if signed else np.uint8)
            if n:
                self._elementwise("unpack_bits", n, (packed, np.int32(bits), np.int32(bool(signed)), np.int64(n), out), "ops.cu")
            return out

    def lut(self, q, table, axis=None):
        xp = self.xp
        with self.on(q):
            n_table = 1 << (8 * q.dtype.itemsize)
            rows = 1 if axis is None else q.shape[axis]
            if q.dtype.itemsize > 2 or table.shape != ((n_table,) if axis is None else (rows, n_table)) \
                    or table.dtype.itemsize not in (1, 2, 4, 8):
                return super().lut(q, table, axis)
            q = contiguous(q)
            out = xp.empty(q.shape, table.dtype)
            if q.size:  # the table bits are copied: index and values as unsigned of their widths
                u, v = (np.dtype(f"u{a.dtype.itemsize}") for a in (q, table))
                total, layout, _ = plan(self, q.shape, axis, None, np.zeros(param_shape(q.shape, axis, None), np.int8))
                self._elementwise(kernel_name("lut", u, v), total,
                                  (q.view(u), xp.ascontiguousarray(xp.asarray(table)).view(v), *layout, out.view(v)),
                                  "lut.cu")
            return out

    def _minmax_segments(self, x, rows, seg):
        """Min and max of each ``seg``-long segment of the rows of ``x`` (``rows``
        of them): a block a segment, or a thread a segment up to ``EACH`` values."""
        length = x.size // rows
        nseg = -(-length // seg)
        lo, hi = (self.xp.empty(rows * nseg, x.dtype) for _ in range(2))
        args = (x, np.int64(rows), np.int64(length), np.int64(seg), np.int64(nseg), lo, hi)
        if seg <= EACH:
            self._elementwise(kernel_name("minmax_each", x.dtype), rows * nseg, args, "reduce.cu")
        else:
            name = kernel_name("minmax", x.dtype)
            self._launch("reduce.cu", name, (max(1, min(rows * nseg, self._max_grid("reduce.cu", name))),), (BLOCK,),
                         args)
        return lo, hi

    def _minmax_rows(self, x, rows):
        """Min and max of each row of ``x`` (``rows`` of them): each row cut into
        enough segments to fill the device, then one more pass over the
        segments' mins and maxes, both at once as ``2 * rows`` rows."""
        length = x.size // rows
        want = -(-self._max_grid("reduce.cu", kernel_name("minmax", x.dtype)) // rows)  # segments a row
        seg = max(-(-length // want), BLOCK * 16)
        lo, hi = self._minmax_segments(x, rows, seg)
        if lo.size == rows:
            return lo, hi
        lo, hi = self._minmax_segments(self.xp.concatenate([lo, hi]), 2 * rows, lo.size // rows)
        return lo[:rows], hi[rows:]

    def minmax(self, x, axis, block_size):
        xp = self.xp
        with self.on(x):
            if x.dtype not in (np.float16, np.float32, np.float64) or x.size == 0:
                return super().minmax(x, axis, block_size)
            dtype = x.dtype
            x = x.astype(np.float32) if dtype == np.float16 else x  # exact; the result is one of the values
            if axis is None:  # per-tensor: one row
                lo, hi = self._minmax_rows(xp.ascontiguousarray(x).reshape(-1), 1)
                return lo.reshape(()).astype(dtype), hi.reshape(()).astype(dtype)
            o, n, i = Layout(x.shape, axis).dims
            if block_size is None:  # one row per index along axis
                rows = xp.ascontiguousarray(x.reshape(o, n, i).transpose(1, 0, 2))
                lo, hi = self._minmax_rows(rows, n)
                return lo.astype(dtype), hi.astype(dtype)
            rows = xp.ascontiguousarray(x.reshape(o, n, i).transpose(0, 2, 1))  # (o, i, n): blocks along n
            lo, hi = self._minmax_segments(rows, o * i, block_size)
            want = x.shape[:axis] + (-1,) + x.shape[axis + 1 :]
            return tuple(a.reshape(o, i, -1).transpose(0, 2, 1).reshape(want).astype(dtype) for a in (lo, hi))

    # -- integer GEMM: cuBLAS int8 on the tensor cores, or gemv for M <= 16, then
    # our epilogue (cuda/gemm.cu) --------------------------------------------------
    def pack_weight(self, codes, qd, keep=False):
        if codes.ndim != 2 or 0 in codes.shape:
            return super().pack_weight(codes, qd, keep)
        xp = self.xp
        with self.on(codes):
            k, n = codes.shape
            kpad, npad = -(-k // KPAD) * KPAD, -(-n // 4) * 4
            shift = 0 if qd.signed else 1 << (qd.bits - 1)
            centred = codes.astype(xp.int16) - shift  # every bit width: -128..127
            w8 = xp.zeros((npad, kpad), xp.int8)
            w8[:n, :k] = centred.T
            w4 = None
            if qd.bits <= 4:  # word j of 16 bytes: k = 8j..8j+3 low nibbles, 8j+4..8j+7 high, each w' + 8
                u = (w8.astype(xp.int16) + 8).astype(xp.uint8).reshape(npad, kpad // 8, 2, 4)
                w4 = xp.ascontiguousarray((u[:, :, 0] | (u[:, :, 1] << 4)).reshape(npad, kpad // 2))
            return DeviceWeight(w8, w4, shift, centred.sum(axis=0, dtype=xp.int64), qd.bits)

    def _gemm_raw(self, a8, pw):
        """``a8 @ pw.w8.T`` exactly, ``(rows, npad)``: one cuBLAS int8 GEMM to int32
        per ``K_INT32`` values of K (where no int32 sum can wrap), the parts summed
        in int64."""
        xp = self.xp
        rows, kpad = a8.shape
        npad = pw.w8.shape[0]
        blas, handle = self._blas()
        one, zero = np.ones(1, np.int32), np.zeros(1, np.int32)  # alpha, beta: host values
        parts = []
        for k0 in range(0, kpad, K_INT32):
            kk = min(K_INT32, kpad - k0)
            c = xp.empty((rows, npad), xp.int32)
            # column-major: C (npad x rows) = W' (kpad x npad, "T") x A' (kpad x rows, "N")
            blas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, npad, rows, kk, one.ctypes.data,
                        self._ptr(pw.w8) + k0, CUDA_R_8I, kpad, self._ptr(a8) + k0, CUDA_R_8I, kpad,
                        zero.ctypes.data, self._ptr(c), CUDA_R_32I, npad, CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT)
            parts.append(c)
        if len(parts) == 1:
            return parts[0]
        total = parts[0].astype(xp.int64)
        for p in parts[1:]:
            total += p
        return total

    def int_matmul(self, a, pw, gp, out=None):
        rq = gp.rq
        if not isinstance(pw, DeviceWeight) or a.dtype.itemsize != 1 or (
                rq is not None and (rq.block_size is not None or rq.f.size not in (1, pw.colsum.size))):
            return super().int_matmul(a, pw, gp, out)
        with self.on(a):
            return self._into(out, lambda target: self._int_matmul(a, pw, gp, target), a.shape[:-1] + (pw.colsum.size,),
                              gp.acc_dtype if rq is None else rq.out_dtype)

    def _int_matmul(self, a, pw, gp, out):
        """:meth:`int_matmul` into ``out`` (C-contiguous): our gemv kernels for
        small M, else cuBLAS's int8 GEMM and our epilogue."""
        xp, qd, rq, bias = self.xp, gp.qd, gp.rq, gp.bias
        n, k = pw.colsum.size, a.shape[-1]
        rows = math.prod(a.shape[:-1])
        npad, kpad = pw.w8.shape
        if out.size == 0:
            return out
        off = 0 if qd.signed else -(1 << (qd.bits - 1))
        a = xp.ascontiguousarray(a)
        if off == 0 and k == kpad and self._ptr(a) % 16 == 0:  # int8 rows as cuBLAS and gemv read them
            a8 = a.reshape(rows, kpad)
        else:
            a8 = xp.empty((rows, kpad), xp.int8)  # a' = a + off, padded: what cuBLAS and gemv read
            self._elementwise(kernel_name("to_s8", a.dtype), a8.size,
                              (a, np.int64(rows), np.int64(k), np.int64(kpad), np.int32(off), a8), "gemm.cu")
        za, zw = int(gp.za) + off, np.asarray(gp.zw, np.int64).reshape(-1) - pw.shift
        gemv = rows <= GEMV_ROWS[-1] and kpad <= K_INT32 * 32  # each lane sums at most K_INT32 products
        use_w4 = gemv and pw.w4 is not None
        zero = self.param(np.zeros(1, np.int64))
        rowsum = a8.sum(axis=1, dtype=xp.int64) if (np.any(zw) or use_w4) else zero
        rq = NO_REQUANT if rq is None else rq
        zo, m, sh, f = self.kept(("epilogue", self._device_id(), id(rq)),  # the entry holds rq: its id stays its own
                                 lambda: (rq, *(self.param(p.reshape(-1)) for p in rq.params[1:])))[1:]
        terms = (zero if bias is None else xp.ascontiguousarray(bias),
                 np.int64(bias is not None), pw.colsum, self.param(zw), np.int64(zw.size > 1), rowsum,
                 np.int64(rowsum.size > 1), np.int64(za), np.int64(k * za))
        outq = (zo, m, sh, f, np.int64(f.size > 1), np.int64(rq.lo), np.int64(rq.hi), np.int32(rq.rounding))
        name = _name(out.dtype)
        if gemv:
            mt = next(r for r in GEMV_ROWS if r >= rows)
            bits, w = (4, pw.w4) if use_w4 else (8, pw.w8)
            kernel = f"gemv{bits}_{mt}"
            grid, block = launch_config(-(-n // GEMV_COLS) * 32, self._max_grid("gemm.cu", kernel))
            self._launch("gemm.cu", kernel, grid, block,
                         (a8, np.int64(rows), np.int64(kpad), w, np.int64(n), *terms, *outq,
                          np.int32(OUT_KINDS[name]), out))
        else:
            raw = self._gemm_raw(a8, pw)
            self._elementwise(kernel_name("gemm_epilogue", raw.dtype, out.dtype), rows * n,
                              (raw, np.int64(npad), np.int64(rows), np.int64(n), *terms, *outq, out), "gemm.cu")
        return out

    # -- convolution: im2col into the GEMM, grouped conv direct -------------------
    def im2col(self, x, kh, kw, stride, padding, dilation, za):
        if x.dtype.itemsize != 1:
            return super().im2col(x, kh, kw, stride, padding, dilation, za)
        xp = self.xp
        with self.on(x):
            (sh, sw), (dh, dw) = stride, dilation
            xpad = self._pad(x, padding, za, channels_last=True)
            n, hp, wp, c = xpad.shape
            oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
            out = xp.empty((n * oh * ow, kh * kw * c), xpad.dtype)
            if out.size:
                total = n * oh * ow * kh * kw
                self._elementwise(kernel_name("im2col", xpad.dtype), total,
                                  (xp.ascontiguousarray(xpad), *(np.int64(v) for v in (hp, wp, c, oh, ow, kh, kw, sh, sw, dh, dw, total)),
                                   out), "gemm.cu")
            return out

    def conv_grouped(self, x, wc, gp, out=None):
        rq, bias = gp.rq, gp.bias
        if _name(x.dtype) not in ("int8", "uint8", "int16", "uint16") or (
                rq is not None and (rq.block_size is not None or rq.f.size not in (1, wc.shape[0]))):
            return super().conv_grouped(x, wc, gp, out)
        xp = self.xp
        with self.on(x):
            xpad = self._pad(x, gp.padding, gp.za)
            (sh, sw), (dh, dw) = gp.stride, gp.dilation
            n, c, hp, wp = xpad.shape
            o, cg, kh, kw = wc.shape
            oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
            dtype = np.int64 if rq is None else rq.out_dtype
            rq = NO_REQUANT if rq is None else rq

            def fill(target):
                if target.size:
                    zo, m, s, f = (self.param(p.reshape(-1)) for p in rq.params[1:])
                    b = self.param(np.zeros(1, np.int64)) if bias is None else xp.ascontiguousarray(bias)
                    self._elementwise(
                        kernel_name("conv_grouped", xpad.dtype, target.dtype), target.size,
                        (xp.ascontiguousarray(xpad), np.int64(gp.za),
                         xp.ascontiguousarray(wc.astype(xp.int32, copy=False)),
                         *(np.int64(v) for v in (c, hp, wp, o, cg, kh, kw, oh, ow, sh, sw, dh, dw)), b,
                         np.int64(bias is not None), zo, m, s, f, np.int64(f.size > 1), np.int64(rq.lo),
                         np.int64(rq.hi), np.int32(rq.rounding), np.int64(target.size), target), "gemm.cu")
                return target

            return self._into(out, fill, (n, o, oh, ow), dtype)

    # -- block formats (cuda/blocks.cu): linear and dequantize from the blocks' bytes on the device;
    # the formats whose values come from functions (IQ lattices, TQ1_0) take the generic code ------------
    def _block_plan(self, fmt, g):
        """``fmt``'s plan (``_cuda.block_plan``) on the current device, or None where the generic code
        runs: a format the kernels do not read, or one that needs a tensor scale not given (its error)."""
        if block_plan(fmt) is None or fmt.tensor_scale is not None and g is None:
            return None
        return self.kept(("block plan", self._device_id(), fmt), lambda: tuple(map(self.xp.asarray, block_plan(fmt))))

    def _decode_blocks(self, raw, fmt, plan, g, dest, out):
        """``out`` (rows of ``row_len``, C-contiguous) = the values of the rows of blocks ``raw``, stored
        element ``p`` of a row at ``dest[p]`` where ``dest`` (act-order's columns) is given."""
        none = dest is None
        self._elementwise(kernel_name("block_decode", out.dtype), out.size // block_plan(fmt)[0][PLAN_GROUP],
                          (raw, *plan, np.float32(0 if g is None else g), np.int64(out.size), np.int64(out.shape[-1]),
                           self.param(np.zeros(1, np.int64)) if none else dest, np.int32(not none), out), "blocks.cu")
        return out

    def dequantize_blocks(self, raw, fmt, dtype, g=None):
        plan = self._block_plan(fmt, g)
        if plan is None or _name(dtype) not in FLOATS or raw.dtype != np.uint8 or not raw.size:
            return super().dequantize_blocks(raw, fmt, dtype, g)
        with self.on(raw):
            raw = contiguous(raw)
            out = self.xp.empty((*raw.shape[:-1], raw.shape[-1] // fmt.nbytes * fmt.block), dtype)
            return self._decode_blocks(raw, fmt, plan, g, None, out)

    def _bias_args(self, bias):
        """The kernels' ``bias, has_bias``."""
        if bias is None:
            return self.param(np.zeros(1)), np.int32(0)
        return self.xp.ascontiguousarray(bias), np.int32(1)

    def block_linear(self, x, raw, fmt, g=None, columns=None, bias=None, packed=None):  # (packed: None here)
        """M <= 16: ``block_gemv``, the weights decoded in the kernel; larger M: dequantize-then-GEMM,
        the weights decoded to float32 once (``block_decode``, act-order's columns put in order) and
        ``block_gemm``'s float64 sums. Both sum each output in increasing k by fused multiply-adds
        (cuda/blocks.cu): ``x``'s values are float32 ones (the op's cast), whose products with the
        weights are exact in float64."""
        plan = self._block_plan(fmt, g)
        if plan is None or x.dtype != np.float64 or 0 in x.shape or not raw.shape[0]:
            return super().block_linear(x, raw, fmt, g, columns, bias)
        xp = self.xp
        with self.on(x):
            (m, k), n = x.shape, raw.shape[0]
            x, raw = xp.ascontiguousarray(x), contiguous(raw)
            out = xp.empty((m, n), np.float32)
            if m <= BLOCK_GEMV_ROWS:
                perm = self.param(np.zeros(1, np.int64) if columns is None else np.argsort(columns))
                self._launch("blocks.cu", "block_gemv", (-(-n // BLOCK_GEMV_COLS),), (BLOCK,),
                             (x, np.int64(m), np.int64(k), raw, np.int64(n), *plan, np.float32(0 if g is None else g),
                              perm, np.int32(columns is not None), *self._bias_args(bias), out))
                return out
            dest = None if columns is None else self.param(np.asarray(columns, np.int64))
            w = self._decode_blocks(raw, fmt, plan, g, dest, xp.empty((n, k), np.float32))
            tiles = -(-m // BLOCK_GEMM_TILE) * -(-n // BLOCK_GEMM_TILE)
            self._launch("blocks.cu", "block_gemm", (tiles,), (BLOCK,),
                         (x, np.int64(m), np.int64(k), w, np.int64(n), *self._bias_args(bias), out))
            return out

    def block_linear_q8(self, xraw, raw, fmt, bias=None, packed=None, act="Q8_0"):
        plan = self._block_plan(fmt, None)  # (pack_blocks gives None here: the kernel reads the blocks as stored)
        if act != "Q8_0" or plan is None or block_plan(fmt)[0][PLAN_INTEGERS] < 0 or fmt.sub < 8 or 0 in xraw.shape or not raw.shape[0]:
            return super().block_linear_q8(xraw, raw, fmt, bias, packed, act)
        with self.on(xraw):
            m, k, n = xraw.shape[0], xraw.shape[1] // 34 * 32, raw.shape[0]
            out = self.xp.empty((m, n), np.float32)
            tiles = -(-m // BLOCK_GEMV_ROWS) * -(-n // BLOCK_GEMV_COLS)
            self._launch("blocks.cu", "block_gemv_q8", (tiles,), (BLOCK,),
                         (contiguous(xraw), np.int64(m), np.int64(k), contiguous(raw), np.int64(n), *plan,
                          *self._bias_args(bias), out))
            return out
