"""NumPy backend: the generic primitives, with Numba kernels for the hot ones.

With Numba installed (extra ``fast``) and ``qarray.config.numba`` true,
quantize, dequantize and requantize run as fused loops split among threads
(``qarray.backends.cpu``: ``cpu.quantize.quantize`` and so on, one module a
kernel family); otherwise the generic NumPy code runs. Both give the same
integers and the same float bits.
"""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np

from .. import _formats
from .._blocks import rounded
from .._config import THREADS, config
from .._fixed_point import NO_REQUANT
from .._params import Layout, kept
from . import _gemm
from ._base import BINARY_OPS, Backend, contiguous, nan_error

# Below this many elements the generic NumPy code runs until Numba's kernels are
# loaded (by a call on a larger array, or after _WARM small calls): a one-off
# small call never imports Numba, whose start-up is about half a second even
# with a warm cache, and a process that keeps calling pays it once and then
# gets the kernels (13 us instead of 24 for quantize 16x64).
_SMALL = 1 << 14
_WARM = 64
_small_calls = [0]
_COLS = 4096  # data with one parameter is seen as rows of this many elements, shared out to the threads


def _cpu():
    """``qarray.backends.cpu``, the kernels, or None without Numba (imported
    once, on first use)."""
    global _kernels
    if _kernels is False:
        try:
            from . import cpu
        except ImportError:
            cpu = None
        _kernels = cpu
    return _kernels


_kernels = False


def _streams(cpu, x, out):
    """Whether ``out``'s codes go out by ``cpu.llvm``'s streamed stores
    (``quantize_lines``, ``requantize_stream``): a large C-contiguous ``x``, a
    C-contiguous 8-bit ``out`` at a 64-byte boundary, x86-64 (``isa``'s sse2)."""
    return (x.size >= cpu.quantize.STREAM and out.itemsize == 1 and x.flags.c_contiguous
            and out.flags.c_contiguous and out.ctypes.data % 64 == 0 and cpu.isa.usable("sse2")[0])


def _lines(cpu, x, out, mul):
    """Per-tensor quantize's kernel on blocks of 64 values (``cpu.quantize.quantize_lines``)
    for float32 ``x`` into ``out``, or None: by AVX-512 where the CPU has it, the
    quotients multiplied (``mul``, ``_bounds``) and ``x`` and 8-bit ``out``
    C-contiguous; streamed where ``_streams`` says so."""
    fits = mul and out.itemsize == 1 and x.flags.c_contiguous and out.flags.c_contiguous
    isa = "avx512bw" if fits and cpu.isa.usable("avx512bw")[0] else "sse2"
    return cpu.quantize.quantize_lines.get((isa, _streams(cpu, x, out)))


_PAGE = 1 << 21  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


def _aligned_empty(shape, dtype):
    """``np.empty(shape, dtype)`` for a kernel's output; from 4 MiB on, starting
    at a 2 MiB boundary. NumPy asks for transparent huge pages from 4 MiB
    (``madvise``), but a mapping that starts mid-page takes 4 KiB pages up to
    the first boundary: a 16 MiB array faulted ~2 MiB in 4 KiB pages, and
    16 such chunks took 1.5x as long to fill as one array of their size."""
    n = math.prod(shape)
    if n < 1 << 19:  # below 4 MiB whatever the dtype (8 bytes at most)
        return np.empty(shape, dtype)
    dtype = np.dtype(dtype)
    size = n * dtype.itemsize
    if size < 1 << 22:
        return np.empty(shape, dtype)
    raw = np.empty(size + _PAGE, np.uint8)
    start = -raw.ctypes.data % _PAGE
    return raw[start:start + size].view(dtype).reshape(shape)


@kept
def _pieces(shape, axis, block_size):
    """``Layout(shape, axis, block_size).pieces(_COLS)``, each piece as ``(slice,
    data dims, parameter shape, bidx, rows, row length)``: what ``_run`` passes
    (shapes and layouts repeat call after call)."""
    return [(sl, lay.dims, lay.pshape, lay.bidx(), lay.outer * lay.n, max(lay.inner, 1))
            for sl, lay in Layout(shape, axis, block_size).pieces(_COLS)]


def _column(p, n):
    """``p`` (a scalar or an ``(n,)`` array) as the ``(n,)`` column a kernel
    takes: C-contiguous and writable whatever ``p`` was. Numba compiles a
    kernel once per read-only / writable combination of its arguments (the
    same code each time, several seconds each for conv_grouped), so the
    columns are always the writable kind."""
    p = np.asarray(p)
    if p.shape == (n,) and p.flags.c_contiguous and p.flags.writeable:
        return p
    return np.array(np.broadcast_to(p, (n,)))  # a copy: writable


@kept
def _columns(rq, n):
    """``rq``'s output parameters (zp_out, m, shift, f) as ``(n,)`` columns, the
    GEMM epilogue's: kept per plan (plans repeat call after call)."""
    return tuple(_column(p, n) for p in rq.params[1:])


@kept
def _param(p, dtype, pshape, f=None):
    """Parameter array ``p`` as the kernels take it: ``dtype``, ``pshape``,
    C-contiguous and writable (one Numba signature), and ``f`` of that if given
    (quantize's reciprocals); kept (``check_params``' arrays are the same objects
    call after call)."""
    c = np.array(p, dtype).reshape(pshape)
    return c if f is None else f(c)


@kept
def _scalars(scale, zero_point, dtype, ct):
    """A per-tensor quantize's ``s, z, rl, rh`` as ``cpu.quantize.quantize_lines``
    takes them (``_param``'s, and the reciprocals'), in one lookup: a 16x64
    quantize took three and four reshapes, 15.2 -> 9.5 us a call."""
    s = _param(scale, dtype, (1,))
    rl, rh = _cpu().quantize.reciprocals(s)
    return s[0], _param(zero_point, ct, (1,))[0], rl[0], rh[0]


def _viewed(a, dims, sl=slice(None)):
    """``a[sl].reshape(dims)``, or None for None (an output a kernel may skip)."""
    return None if a is None else a[sl].reshape(dims)


@kept
def _bounds(qd, dtype):
    """quantize's clamp type and bounds (<= 16-bit results clamp exactly in
    float32; qint32 and float64 input need float64), and whether it multiplies
    by the reciprocal (``cpu.quantize.multiplies``: worked out here, in this one
    lookup a call, which was 1 us of a 16x64 quantize's 10)."""
    ct = np.float64 if (dtype == np.float64 or qd.bits > 16) else np.float32
    lo, hi = ct(qd.qmin), ct(qd.qmax)
    return ct, lo, hi, _cpu().quantize.multiplies(dtype, lo, hi)


@kept
def _plan_params(rq, pshape):
    """``rq``'s parameters as the kernels take them (``_param``), kept per plan."""
    return [np.array(p).reshape(pshape) for p in rq.params]


@kept
def _binary_args(op, ra, rb, rq, a_dtype, b_dtype):
    """``cpu.elementwise.binary``'s kernel and its parameter arrays for these plans (kept: plans repeat)."""
    ints = [ra.zp_in, ra.m, ra.shift, ra.narrow(a_dtype), rb.zp_in, rb.m, rb.shift, rb.narrow(b_dtype), rq.zp_out,
            rq.m, rq.shift, rq.lo, rq.hi]
    kernel = _cpu().elementwise.binary(BINARY_OPS[op], ra.rounding, rb.rounding, rq.rounding)
    return kernel, (np.array([int(v) for v in ints], np.int64), np.array([float(ra.f), float(rb.f), float(rq.f)]))


def _family(cpu, name):
    """Kernel module ``cpu.<name>``, imported on first use (``gemm`` and ``blocks`` compile LLVM IR)."""
    module = getattr(cpu, name, None)
    return module if module is not None else importlib.import_module(f"{cpu.__name__}.{name}")


def _fast_path(family):
    """A primitive's Numba path: the method runs, with the kernels (``qarray.backends.cpu``) as its
    first argument, where Numba runs for the input (``_fast``) and ``cpu.<family>.ACCEPTS[name]``,
    beside the kernels, takes the call (its plan, layout, dtypes); ``Backend``'s generic method
    otherwise."""
    def wrap(method):
        name, generic = method.__name__, getattr(Backend, method.__name__)

        @functools.wraps(method)
        def primitive(self, x, *args, **kwargs):
            cpu = self._fast(x)
            if cpu is None or not _family(cpu, family).ACCEPTS[name](x, *args, **kwargs):
                return generic(self, x, *args, **kwargs)
            return method(self, cpu, x, *args, **kwargs)

        return primitive

    return wrap


class NumpyBackend(Backend):
    name = "numpy"
    module = "numpy"

    def __init__(self):
        super().__init__(np)

    empty = staticmethod(_aligned_empty)

    @staticmethod
    def _fast(a):
        """The kernels (``qarray.backends.cpu``) when the Numba path should run for
        ``a``, else None (``_fast_path``: then ``ACCEPTS`` decides)."""
        if not config.numba:
            return None
        if a.size < _SMALL and _kernels is False:  # not loaded yet
            _small_calls[0] += 1
            if _small_calls[0] < _WARM:
                return None
        return _cpu()

    @staticmethod
    def _run(kernel, a, out, axis, block_size, params, *args, mask=False, key=False):
        """Run ``kernel(a3, *params3, bidx, *args, out3, start, stop)`` over every
        piece of the layout (``Layout.pieces``: shapes that keep the kernels'
        inner loops fast), its rows split among threads; returns every part's
        result. ``params(pshape)`` gives the parameter arrays of a piece.
        ``mask`` (quantize's kernel): None or a second output like ``out``,
        passed after it. ``key`` (quantize's and requantize's kernels): None,
        or stochastic rounding's Philox key ``(k0, k1)``, passed after
        ``args`` with the piece's first flat index as ``(k0, k1, first)``
        (each element's random word is its flat index's)."""
        cpu = _cpu()
        pieces = _pieces(a.shape, axis, block_size)
        cost = 1 if key is None or key is False else cpu.pool.STOCHASTIC_COST
        if len(pieces) == 1:  # the common call: the whole array, one view
            _, dims, pshape, bidx, rows, inner = pieces[0]
            outs = (out.reshape(dims),) if mask is False else (out.reshape(dims), _viewed(mask, dims))
            if key is not False:
                args = (*args, key if key is None else (*key, np.uint64(0)))
            return cpu.pool.parallel(kernel, rows, contiguous(a).reshape(dims), *params(pshape), bidx, *args, *outs,
                                     grain=cpu.pool.GRAIN // (cost * inner))
        af, of = a.ravel(), out.reshape(-1)  # ravel: a view of C-contiguous data, else a copy
        mf = _viewed(mask, -1) if mask is not False else False
        results = []
        for sl, dims, pshape, bidx, rows, inner in pieces:  # the tasks: rows (o, l) of the (outer, n, inner) view
            outs = (of[sl].reshape(dims),) if mf is False else (of[sl].reshape(dims), _viewed(mf, dims, sl))
            extra = () if key is False else (key if key is None else (*key, np.uint64(sl.start or 0)),)
            results += cpu.pool.parallel(kernel, rows, af[sl].reshape(dims), *params(pshape), bidx, *args, *extra,
                                         *outs, grain=cpu.pool.GRAIN // (cost * inner))
        return results

    @_fast_path("quantize")
    def quantize(self, cpu, x, qp, out=None):
        return self._into(out, lambda t: self._quantize(cpu, x, qp, t, False, None), x.shape, qp.qd.storage)

    @_fast_path("quantize")
    def quantize_stochastic(self, cpu, x, qp, key, index=None):
        return self._quantize(cpu, x, qp, self.empty(x.shape, qp.qd.storage), False, None, key)

    @_fast_path("quantize")
    def fake_quantize(self, cpu, x, qp, dtype, mask=False, key=None, index=None, out=None):
        inside = self.empty(x.shape, np.bool_) if mask else None
        ft = np.float64 if dtype == np.float64 else np.float32
        # out itself where the kernel can write it: a new 64 MB output costs as much
        # as the pass (page faults); an out overlapping x would leave LLVM's loops
        # scalar (2x slower than a new array), as would a strided one
        direct = out is not None and out.dtype == ft and out.flags.c_contiguous and not np.may_share_memory(out, x)
        values = self._quantize(cpu, x, qp, out if direct else self.empty(x.shape, ft), True, inside, key)
        if direct:
            return out, inside
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, as dequantize rounds it
            if out is not None:
                out[...] = values
                return out, inside
            return values if values.dtype == dtype else values.astype(dtype), inside

    def _quantize(self, cpu, x, qp, out, fake, mask, key=None):
        """quantize's kernel into C-contiguous ``out``: the codes, or (``fake``)
        the codes dequantized into float ``out``, and ``mask`` (None or bool)
        filled; ``key``: stochastic rounding's Philox key."""
        if x.dtype == np.float16:  # Numba has no float16 arithmetic: widen (exact) first
            x = x.astype(np.float32)
        scale, zero_point, axis = qp.scale, qp.zero_point, qp.axis
        ct, lo, hi, mul = _bounds(qp.qd, x.dtype)  # mul: by 1 / scale, checked (cpu.quantize._q_mul)

        def params(pshape):
            return (_param(scale, x.dtype, pshape), _param(zero_point, ct, pshape),
                    *_param(scale, x.dtype, pshape, cpu.quantize.reciprocals))

        lines = None
        if axis is None and x.dtype == np.float32 and mask is None and key is None:
            lines = _lines(cpu, x, out, mul)
        if lines is not None:
            s, z, rl, rh = _scalars(scale, zero_point, x.dtype, ct)
            parts = cpu.pool.parallel(lines, -(-x.size // 64), x.reshape(-1), s, z, rl, rh, lo, hi, mul,
                                      out.reshape(-1), grain=cpu.pool.GRAIN // 64)
        else:
            parts = self._run(cpu.quantize.quantize, x, out, axis, qp.block_size, params, lo, hi, mul,
                              True if fake else None, mask=mask, key=key)
        bad = sum(parts)
        if bad != bad and np.isnan(x).any():  # NaN or inf was seen; inf is fine
            raise nan_error(x)
        return out

    @_fast_path("quantize")
    def quantize_float(self, cpu, x, scale, qd, axis, block_size, saturate, *, mx=False, multiply=False):
        if x.dtype == np.float16:  # Numba has no float16 arithmetic: widen (exact) first
            x = x.astype(np.float32)
        out = self.empty(x.shape, np.uint8)
        kernel = cpu.quantize.quantize_float(_formats.codes(qd, saturate, onnx_zero=not mx), multiply)
        nans = self._run(kernel, x, out, axis, block_size, lambda pshape: (_param(scale, np.float32, pshape),))
        if any(nans) and not (mx or _formats.fmt(qd).has_nan):
            raise _formats.nan_error(qd)
        return out.view(qd.storage)

    @_fast_path("quantize")
    def dequantize(self, cpu, q, scale, zero_point, axis, block_size, dtype):
        ft = np.float64 if dtype == np.float64 else np.float32
        out = self.empty(q.shape, ft)

        def params(pshape):
            return _param(scale, ft, pshape), _param(zero_point, np.int64, pshape)

        self._run(cpu.quantize.dequantize, q, out, axis, block_size, params)
        if out.dtype == dtype:
            return out
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, as IEEE rounds it
            return out.astype(dtype)

    def dequantize_blocks(self, raw, fmt, dtype, g=None):
        cpu, plan = self._fast(raw), fmt.plan
        if cpu is None or plan is None or fmt.offset is not None and (fmt.precision != "float32"
                                                                      or fmt.factor is not None):
            return super().dequantize_blocks(raw, fmt, dtype, g)  # (the multiply rounds before the add: NumPy)
        blocks = contiguous(raw).reshape(-1, fmt.nbytes)
        scale, offset, zero = fmt.parameters(blocks, g)
        out = self.empty((len(blocks), fmt.block), np.float32)
        cpu.pool.parallel(cpu.quantize.block_decode, len(blocks), blocks, out, *plan, scale,
                          scale if offset is None else offset, scale if zero is None else zero, offset is not None,
                          zero is not None, grain=cpu.pool.GRAIN // fmt.block)
        out = rounded(out, fmt.precision)
        if fmt.factor is not None:  # (a second rounding, as the format's reference has it)
            out = rounded(out * fmt.factor, fmt.precision)
        out = out.reshape(*raw.shape[:-1], raw.shape[-1] // fmt.nbytes * fmt.block)
        with np.errstate(over="ignore"):
            return out if dtype == np.float32 else out.astype(dtype)

    @_fast_path("blocks")
    def block_linear(self, cpu, x, raw, fmt, g=None, columns=None, bias=None, packed=None):
        blocks = _family(cpu, "blocks")
        n, k_len = raw.shape[0], x.shape[1]
        out = np.empty((x.shape[0], n), np.float32)
        if packed is not None:
            return _family(cpu, "blocks_float").linear_float_packed(np.ascontiguousarray(x), packed, bias, out)
        b = np.zeros(1) if bias is None else bias
        tasks, grain = -(-n // blocks.LANES), max(1, cpu.pool.GRAIN // (blocks.LANES * k_len * (x.shape[0] + 8)))
        x = np.ascontiguousarray(x)
        if fmt.plan is None:  # (the IQ lattices: NumPy's decoders, then the same sums)
            w = self.dequantize_blocks(raw, fmt, np.float32, g)
            w = np.ascontiguousarray(w if columns is None else w[:, np.argsort(columns)])
            cpu.pool.parallel(blocks.linear_dense, tasks, x, w, b, bias is not None, out, grain=grain)
            return out
        dest = np.zeros(0, np.int64)
        if columns is not None:  # stored column i is dequantize's column dest[i]
            dest = np.empty(k_len, np.int64)
            dest[np.argsort(columns)] = np.arange(k_len)
        blk = contiguous(raw).reshape(-1, fmt.nbytes)
        scale, offset, zero = fmt.parameters(blk, g)
        factor = np.float32(1) if fmt.factor is None else fmt.factor
        cpu.pool.parallel(blocks.linear_float, tasks, x, blk, *fmt.plan, scale, scale if offset is None else offset,
                          scale if zero is None else zero, offset is not None, zero is not None,
                          blocks.PRECISION[fmt.precision], factor, fmt.factor is not None, dest, b, bias is not None,
                          out, grain=grain)
        return out

    def q8_quantizer(self, name):
        """``fill(x, out)``: float32 blocks ``x`` (n, 32 or 256) as the bytes ``out`` of Q8_0 or Q8_K
        (``name``) with ggml's rounding (``_ggml._q8_0``, ``_q8_k``) on the Numba kernels, and whether
        every block was finite (its float32 scale is); None without Numba."""
        if not config.numba or _cpu() is None:
            return None
        cpu = _cpu()
        blocks = _family(cpu, "blocks")
        kernel = blocks.quantize_q8_0 if name == "Q8_0" else blocks.quantize_q8_k

        def fill(x, out):
            d = np.empty(len(x), np.float32)
            cpu.pool.parallel(kernel, len(x), x, x.view(np.int32), d, out, grain=cpu.pool.GRAIN // x.shape[1])
            return bool(np.isfinite(d).all())

        return fill

    def pack_blocks(self, raw, fmt):
        blocks = _family(_cpu(), "blocks") if config.numba and _cpu() is not None else None
        return blocks.PackedQ8(contiguous(raw), fmt) if blocks is not None and blocks.packable(fmt) else None

    def pack_blocks_float(self, raw, fmt, g=None):
        cpu = _cpu() if config.numba else None
        packing = _family(cpu, "blocks_float") if cpu is not None else None
        return packing.PackedFloat(contiguous(raw), fmt, g) if packing is not None and packing.float_packable(fmt) \
            else None

    @_fast_path("blocks")
    def block_linear_q8(self, cpu, xraw, raw, fmt, bias=None, packed=None, act="Q8_0"):
        blocks = _family(cpu, "blocks")
        dx, qx = self.q8_parts(xraw, act)
        n, k_len = raw.shape[0], qx.shape[1]
        out = np.empty((qx.shape[0], n), np.float32)
        if act == "Q8_K" and packed is None:  # (the Q8_K contract runs on packed weights only)
            packed = blocks.PackedQ8(contiguous(raw), fmt)
        if packed is not None:
            return blocks.linear_q8_packed(dx, qx, packed, bias, out, act=act)
        blk = contiguous(raw).reshape(-1, fmt.nbytes)
        scale, offset, zero = fmt.parameters(blk)
        segments, values = fmt.plan
        cpu.pool.parallel(blocks.linear_q8, -(-n // blocks.LANES), np.ascontiguousarray(dx), np.ascontiguousarray(qx),
                          blk, segments, values.astype(np.int32), scale, scale if offset is None else offset,
                          (scale if zero is None else zero).astype(np.int32), offset is not None, zero is not None,
                          min(fmt.sub, 32), np.zeros(1) if bias is None else bias, bias is not None, out,
                          grain=max(1, cpu.pool.GRAIN // (blocks.LANES * k_len * (qx.shape[0] + 8))))
        return out

    @_fast_path("quantize")
    def minmax(self, cpu, x, axis, block_size):
        lay = Layout(x.shape, axis, block_size)
        lo, hi = (np.empty((lay.outer, lay.blocks, lay.inner), x.dtype) for _ in range(2))
        cpu.pool.parallel(cpu.quantize.block_minmax, lay.outer * lay.blocks, contiguous(x).reshape(lay.dims),
                          block_size, lo, hi)
        want = x.shape[:axis] + (lay.blocks,) + x.shape[axis + 1:]
        return lo.reshape(want), hi.reshape(want)

    @_fast_path("elementwise")
    def lut(self, cpu, q, table, axis=None):
        u = contiguous(q).view(np.dtype(f"u{q.dtype.itemsize}"))
        out = self.empty(q.shape, table.dtype)
        cpu.pool.parallel(cpu.elementwise.lut, u.size, u.reshape(-1), table, out.reshape(-1), grain=cpu.pool.GRAIN)
        return out

    @_fast_path("requantize")
    def requantize(self, cpu, q, rq, out=None):
        # a strided out (cat's slice along axis > 0) gets a contiguous result copied
        # in: 12x faster than the generic code's int64 passes (cat of 3 x 86K codes on axis 1)
        narrow = rq.narrow(q.dtype)

        def fill(target):
            if _streams(cpu, q, target) and rq.axis is None:
                zi, zo, m, sh, f = (p.reshape(-1)[0] for p in rq.params)
                cpu.pool.parallel(cpu.requantize.requantize_stream[rq.rounding, narrow], -(-q.size // 64),
                                  q.reshape(-1), np.int64(zi), np.int64(zo), np.int64(m), np.int64(sh), np.float64(f),
                                  np.int64(rq.lo), np.int64(rq.hi), target.reshape(-1), grain=cpu.pool.GRAIN // 64)
                return target
            self._run(cpu.requantize.requantize[rq.rounding, narrow], q, target, rq.axis, rq.block_size,
                      functools.partial(_plan_params, rq), np.int64(rq.lo), np.int64(rq.hi), key=None)
            return target

        return self._into(out, fill, q.shape, rq.out_dtype)

    @_fast_path("requantize")
    def requantize_stochastic(self, cpu, q, rq, key, index=None):
        out = self.empty(q.shape, rq.out_dtype)
        self._run(cpu.requantize.requantize[rq.rounding, False], q, out, rq.axis, rq.block_size,
                  functools.partial(_plan_params, rq), np.int64(rq.lo), np.int64(rq.hi), key=key)
        return out

    @_fast_path("elementwise")
    def binary(self, cpu, a, b, bp, out=None):
        kernel, args = _binary_args(bp.op, bp.ra, bp.rb, bp.rq, a.dtype, b.dtype)

        def fill(target):
            cpu.pool.parallel(kernel, -(-a.size // cpu.elementwise.BINARY_RUN), a.ravel(), b.ravel(), *args,
                              target.reshape(-1),
                              grain=cpu.pool.GRAIN // (cpu.pool.BINARY_COST * cpu.elementwise.BINARY_RUN))
            return target

        return self._into(out, fill, a.shape, bp.rq.out_dtype)

    # -- integer matmul: the int8 engine (``_gemm``) and a fused Numba epilogue --
    def pack_weight(self, codes, qd, keep=False):
        # Small weights of a one-off matmul skip the engine: its first use costs ~0.5 s
        # (import, self-check). Layers (``keep``) take it whatever their size: float32
        # BLAS leaves OpenBLAS threads spinning after each call, and the Numba
        # epilogue that follows then runs ~20x slower (7 ms instead of 0.3 ms for a
        # 256x64x128 layer on 2 cores); the engine's threads sleep after a call.
        if (codes.size < _SMALL and not keep) or 0 in codes.shape or _gemm.engine(config.gemm) == "blas":
            return super().pack_weight(codes, qd, keep)
        name = _gemm.engine(config.gemm)
        return _gemm.Packed(name, codes, qd, keep, numba=config.numba and _cpu() is not None)

    def raw_matmul(self, a, qd, pw, acc_dtype):
        if not isinstance(pw, _gemm.Packed):
            return super().raw_matmul(a, qd, pw, acc_dtype)
        au, off = _gemm.to_unsigned(a, qd.signed)
        if au.size == 0:  # M = 0 or batch 0 (K = 0 and N = 0 never pack)
            return np.zeros(np.broadcast_shapes(a.shape[:-1], pw.w.shape[:-2] + (1,)) + pw.w.shape[-1:], np.int32), off
        return pw.raw(np.ascontiguousarray(au)), off

    @_fast_path("gemm")
    def int_matmul(self, cpu, a, pw, gp, out=None):
        shape = (a.shape[0], pw.w.shape[1])
        if pw.fused(a):  # qarray's own kernels: the epilogue in each block's store
            return self._fused(cpu, a, pw, gp)(a, out)
        pw.single()  # made here, before the threads ask for them

        def products(start, stop):  # each thread maps its own rows to unsigned codes too
            return pw.raw(np.ascontiguousarray(_gemm.to_unsigned(a[start:stop], gp.qd.signed)[0]), threads=1)

        off = _gemm.to_unsigned(a[:0], gp.qd.signed)[1]  # what mapping adds (no rows mapped here)
        return self._epilogue(cpu, products, shape, *self._gemm_terms(a, off, pw, gp, shape), gp, out)

    def int_matmul_plan(self, a, pw, gp):
        cpu = self._fast(a)
        if cpu is not None and cpu.gemm.ACCEPTS["int_matmul"](a, pw, gp) and pw.fused(a):
            return self._fused(cpu, a, pw, gp)
        return super().int_matmul_plan(a, pw, gp)

    def plan_state(self):
        cpu = _cpu()
        return config.numba, config.gemm, cpu is not None and cpu.gemm.best()

    def _own_epilogue(self, cpu, k, pw, gp, shape):
        """What qarray's own kernels take for a product of rows of ``k`` codes
        into ``shape`` by ``gp``: whether it has the row term (the caller sums
        the rows), the epilogue's columns, its ``Requant``, the output dtype,
        the instruction set and ``narrow``."""
        rows, c, zw = self._terms(k, 128 * gp.qd.signed, pw, gp, shape, lambda: True)
        return (rows, *self._epilogue_plan(shape, c, zw, gp), cpu.gemm.best(), self._narrow(gp))

    def _fused(self, cpu, a, pw, gp):
        """:meth:`int_matmul` on qarray's own kernels, the epilogue in each
        block's store: ``run(codes, out=None)`` for codes of ``a``'s shape."""
        (m, k), signed = a.shape, gp.qd.signed
        shape = (m, pw.w.shape[1])
        rows, columns, rq, dtype, isa, narrow = self._own_epilogue(cpu, k, pw, gp, shape)

        def run(codes, out=None):
            rowsum = codes.sum(axis=-1, dtype=np.int64) + k * 128 * signed if rows else None
            return self._into(out, lambda target: cpu.gemm.run(isa, rq.rounding, narrow, codes, signed, pw.panels[0],
                                                               rowsum, columns, rq.lo, rq.hi, target), shape, dtype)

        return run

    @_fast_path("gemm")
    def conv_gemm(self, cpu, x, kh, kw, pw, gp, out=None):
        return self._fused_conv(cpu, x, kh, kw, pw, gp)(x, out)

    def conv_gemm_plan(self, x, kh, kw, pw, gp):
        cpu = self._fast(x)
        if cpu is not None and cpu.gemm.ACCEPTS["conv_gemm"](x, kh, kw, pw, gp):
            return self._fused_conv(cpu, x, kh, kw, pw, gp)
        return super().conv_gemm_plan(x, kh, kw, pw, gp)

    def _fused_conv(self, cpu, x, kh, kw, pw, gp):
        """:meth:`conv_gemm` by ``cpu.gemm.conv`` (no im2col; it sums the
        patches' rows): ``run(codes, out=None)`` for channels-last codes of
        ``x``'s shape."""
        n, h, w, c = x.shape
        (ph, pwd), (dh, dw) = gp.padding, gp.dilation
        shape = (n * (h + 2 * ph - dh * (kh - 1)) * (w + 2 * pwd - dw * (kw - 1)), pw.w.shape[1])
        rows, columns, rq, dtype, isa, narrow = self._own_epilogue(cpu, kh * kw * c, pw, gp, shape)

        def run(codes, out=None):
            return self._into(out, lambda target: cpu.gemm.conv(isa, rq.rounding, narrow, codes, kh, kw, gp.padding,
                                                                gp.dilation, gp.za, gp.qd.signed, pw.panels[0], rows,
                                                                columns, rq.lo, rq.hi, target), shape, dtype)

        return run

    @_fast_path("gemm")
    def gemm_epilogue(self, cpu, raw, rowsum, c, zw, gp, out=None):
        return self._epilogue(cpu, contiguous(raw), raw.shape, rowsum, c, zw, gp, out)

    def _epilogue(self, cpu, raw, shape, rowsum, c, zw, gp, out):
        """``gemm_epilogue`` on Numba. ``raw`` is the products, or (``int_matmul``)
        ``raw(start, stop)`` gives those of rows ``start..stop``: each thread then
        computes its share of rows and their epilogue while they are in its
        cache, instead of the engine's threads computing all of them and the
        pool's threads reading them back (``_gemm.BY_ROWS``)."""
        m, n = shape
        cols, rq, dtype = self._epilogue_plan(shape, c, zw, gp)
        kernel, ends = _gemm.own().gemm_epilogue[rq.rounding, self._narrow(gp)], (np.int64(rq.lo), np.int64(rq.hi))

        def fill(target):
            if not callable(raw):
                cpu.pool.parallel(kernel, m, raw, rowsum, *cols, *ends, target, grain=cpu.pool.GRAIN // max(n, 1))
                return target

            def rows(start, stop):
                part = None if rowsum is None else rowsum[start:stop]
                kernel(raw(start, stop), part, *cols, *ends, target[start:stop], 0, stop - start)

            cpu.pool.parallel(rows, m, grain=-(-m // THREADS[0]), parts=1)
            return target

        return self._into(out, fill, shape, dtype)

    @staticmethod
    def _narrow(gp):
        """Whether every total of the epilogue fits in int32 (``Requant.narrow``)."""
        return gp.acc_dtype == np.int32 and gp.rq is not None and gp.rq.narrow(np.int32)

    @staticmethod
    def _epilogue_plan(shape, c, zw, gp):
        """The epilogue's (N,) columns ``c, zw, zo, m, sh, f``, its ``Requant``
        (``NO_REQUANT`` for None) and its output dtype."""
        rq = NO_REQUANT if gp.rq is None else gp.rq
        dtype = gp.acc_dtype if rq.qd is None else rq.out_dtype
        return [_column(c, shape[1]), _column(zw, shape[1]), *_columns(rq, shape[1])], rq, dtype

    # -- convolution: Numba im2col and direct grouped conv for 8-bit codes ----
    @_fast_path("gemm")
    def im2col(self, cpu, x, kh, kw, stride, padding, dilation, za):
        (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
        n, h, w, c = x.shape
        oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        out = self.empty((n * oh * ow, c * kh * kw), x.dtype)
        cpu.pool.parallel(cpu.gemm.im2col, n * oh, contiguous(x), kh, kw, sh, sw, dh, dw, ph, pw, np.int64(za), out)
        return out

    @_fast_path("gemm")
    def conv_grouped(self, cpu, x, wc, gp, out=None):
        (sh, sw), (dh, dw), (ph, pw) = gp.stride, gp.dilation, gp.padding
        n, _, h, w = x.shape
        hp, wp = h + 2 * ph, w + 2 * pw
        o, _, kh, kw = wc.shape
        narrow = gp.bias is None and gp.rq is not None and gp.rq.narrow(np.int32)
        dtype = (np.int32 if gp.bias is None else np.int64) if gp.rq is None else gp.rq.out_dtype
        rq = NO_REQUANT if gp.rq is None else gp.rq
        cols = [_column(0 if gp.bias is None else gp.bias, o), *_columns(rq, o)]
        x = contiguous(x)

        def fill(target):
            cpu.pool.parallel(cpu.gemm.conv_grouped[rq.rounding, narrow], n * o, x, np.int64(gp.za),
                              contiguous(wc), gp.groups, sh, sw, dh, dw, ph, pw, *cols, np.int64(rq.lo),
                              np.int64(rq.hi), target)
            return target

        shape = (n, o, (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1)
        return self._into(out, fill, shape, dtype)

    @_fast_path("softmax")
    def softmax(self, cpu, x, sm, out=None):
        x, table = contiguous(x), sm.table
        logs = np.zeros(x.shape[0])
        grain = cpu.pool.GRAIN // (cpu.pool.SOFTMAX_COST * max(x.shape[1], 1))  # rows worth another thread
        planes = None  # the table's bytes for the VBMI lookups (cpu.llvm's)
        if x.dtype.itemsize == 1 and sm.out_dtype.itemsize == 1 and cpu.isa.usable("avx512vbmi")[0]:
            planes = np.zeros((4, 256), np.uint8)
            planes[:, :table.size] = table >> np.array([[0], [8], [16], [24]]) & 255
            planes = planes.reshape(-1)
        if sm.log:  # the log in NumPy, as the generic code takes it
            sums = np.empty(x.shape[0], np.int64)
            cpu.pool.parallel(cpu.softmax.softmax_sums, len(x), x, table, planes, sums, grain=grain)
            logs = np.log(sums.astype(np.float64) / 2.0**30)

        def fill(target):
            cpu.pool.parallel(cpu.softmax.softmax, len(x), x, table, planes, logs, np.float64(sm.s_in),
                              np.float64(sm.s_out), np.float64(sm.z_out), np.float64(sm.qd.qmin),
                              np.float64(sm.qd.qmax), bool(sm.log), target, grain=grain)
            return target

        return self._into(out, fill, x.shape, sm.out_dtype)
