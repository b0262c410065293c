"""The generic backend: every primitive written once against ``self.xp``.

Any array library with a NumPy-like namespace (and slice assignment: the
elementwise primitives work in pieces written into one output) works through
this class as it stands; ``NumpyBackend`` and ``CupyBackend`` override only
what they can do faster. Primitives take arrays of their own backend and parameters in their
stored shape (see ``qarray._params``); ops validate and resolve everything
before they call one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import numpy as np

from .. import _formats, _philox
from .._dtypes import qdtype
from .._fixed_point import FLOAT, IDENTITY, rescale, rescale_stochastic
from .._params import Gemm, Layout, Quant, expand, kept, to_host


class FloatWeight(NamedTuple):
    """:meth:`Backend.pack_weight`'s weights: float32 ``codes - shift``, their
    int64 column sums, and the code width."""

    w: object
    shift: int
    colsum: object
    bits: int


NO_DEVICE = contextlib.nullcontext()  # Backend.on's "nothing to enter"


def _column_terms(xp, k, za, zw, shift, colsum, bias):
    """:meth:`Backend.int_matmul`'s terms for ``a' = a + off`` (``za`` is
    ``za + off``) and ``w' = w - shift``: the host ``zw - shift``, the
    per-column ``K * za * zw - za * colsum(w') + bias`` and whether any
    ``zw - shift`` is nonzero (the row sums are needed)."""
    zw = np.asarray(zw, np.int64) - shift
    c = (k * za) * xp.asarray(zw) - za * colsum
    return zw, c if bias is None else c + bias, bool(np.any(zw))


# kept for NumPy weights: a layer's terms repeat call after call
_host_column_terms = kept(functools.partial(_column_terms, np))


def nan_error(x) -> ValueError:
    """The error quantize raises for NaN input: how many, and where the first is."""
    mask = to_host(x != x)
    count = int(mask.sum())
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))
    return ValueError(
        f"cannot quantize NaN: the input has {count} NaN value(s), the first at index "
        f"{first}; replace them (e.g. numpy.nan_to_num) before quantizing"
    )


BINARY_OPS = {"add": 0, "sub": 1, "mul": 2}  # the binary kernels' op codes (cpu.elementwise.binary, cuda/ops.cu)


def contiguous(a):
    """C-contiguous ``a``, 0-d kept 0-d (NumPy's and CuPy's ``ascontiguousarray``
    make it 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


class Backend:
    """Quantization primitives over an array namespace ``xp``.

    The contract between ops and backends. Ops validate their arguments, work
    out parameters and plans on the host, and reach arrays only through these
    methods and ``xp``; a backend never sees an invalid argument.

    Required of a new backend (``tests/test_backends.py``'s ``ToyBackend`` is
    the whole of one):

    ===================  ========================================================
    ``name``             what ``qarray.backends.get`` and ``QArray.to`` take
    ``module``           the array library's top-level module, looked up in
                         ``sys.modules`` only (never imported by the registry)
    ``xp``               a NumPy-like namespace: ``asarray``, ``empty``, ``zeros``,
                         ``rint``, ``clip``, ``where``, ``stack``, ``pad``, ``cumsum``,
                         reductions, dtype casts, slicing and reshape
    ``to_host(a)``       a NumPy array of ``a`` (the default: ``numpy.asarray``,
                         CuPy's ``get``)
    ===================  ========================================================

    Capability flags:

    - ``writable`` (True): arrays take slice assignment, so the generic code
      writes results in pieces into one output (bounded temporaries) and honours
      ``out=``. False (Dask, JAX): every primitive returns new arrays, whole,
      and an ``out=`` given raises TypeError (``_no_out``).
    - ``float_bits`` (False): floating-format codes are stored as their uint8
      bit patterns (CuPy, Dask) rather than as ml_dtypes' element types.

    Everything else is optional, each with its generic implementation here
    written once against ``xp``: the elementwise primitives (``quantize``,
    ``quantize_stochastic``, ``fake_quantize``, ``dequantize``, ``requantize``,
    ``requantize_stochastic``, ``binary``, ``clip``, ``lut``, ``minmax``,
    ``softmax``), the floating formats (``quantize_float``, ``dequantize_float``,
    ``quantize_mx``, ``quantize_nvfp4``, ``block_amax``, ``float_storage``), the
    integer GEMM (``pack_weight``, ``raw_matmul``, ``int_matmul``,
    ``gemm_epilogue``), convolution (``im2col``, ``conv_grouped``), bit packing
    (``pack``, ``unpack``), the block formats' host codecs (``map_rows``,
    ``dequantize_blocks``), a range check (``within``) and the hooks ``on``
    (the current device),
    ``over_batches`` (ops on independent samples: Dask runs them per chunk),
    ``empty`` (a kernel's output: NumPy aligns large ones to huge pages),
    ``of``, ``check_together``, ``param``, ``check_nan`` and ``array_types``.
    NumPy overrides the hot ones with Numba kernels, CuPy with CUDA kernels,
    Dask maps them over chunks; each override gives the generic result bit for
    bit.
    """

    name = "generic"
    module = "numpy"
    writable = True  # ops may write results into slices of an array (out=); not Dask's
    float_bits = False  # floating-format codes stored as uint8 bits (float_storage)

    def __init__(self, xp=None):
        self._xp = xp

    @property
    def xp(self):
        """The array namespace the generic primitives use."""
        return self._xp

    def empty(self, shape, dtype):
        """A new uninitialised array for a primitive's output."""
        return self.xp.empty(shape, dtype)

    def _into(self, out, fill, shape, dtype):
        """``fill(target)``, the result of a primitive with ``out=``: ``target``
        is ``out`` itself where it is C-contiguous, else a new array, returned
        or, for a strided ``out`` (cat's slice along an inner axis), copied in.
        ``fill`` returns the filled array."""
        direct = out is not None and out.flags.c_contiguous
        target = fill(out if direct else self.empty(shape, dtype))
        if out is None or direct:
            return target
        out[...] = target
        return out

    def __repr__(self):
        return f"<qarray backend {self.name!r}>"

    def array_types(self) -> tuple:
        return (self.xp.ndarray,)

    def of(self, x) -> "Backend":
        """The backend of array ``x``, one of this backend's types: itself (the
        Dask backend answers the one of ``x``'s chunk type)."""
        return self

    def check_together(self, arrays) -> None:
        """Raise TypeError if ``arrays`` (all of this backend) cannot meet in one op."""

    def on(self, x):
        """A context manager that makes ``x``'s device the current one (nothing to
        do where there is one device: ``NO_DEVICE``, which ``on_data_device``
        skips): ops run inside it."""
        return NO_DEVICE

    def within(self, a, lo, hi, message):
        """``a`` if its integers lie in ``[lo, hi]``, else ValueError(``message.format(the value beyond)``):
        here at once; the Dask backend checks each chunk as it is computed (the graph stays lazy)."""
        if a.size:
            least, most = (int(v) for v in self.to_host(self.xp.stack([a.min(), a.max()])))
            if least < lo or most > hi:
                raise ValueError(message.format(most if most > hi else least))
        return a

    def map_rows(self, fn, x, ratio, dtype):
        """``fn`` (host rows to host rows, along the last axis) on ``x``, whose last axis of ``n``
        becomes ``n * ratio`` long (``dtype``): the block formats' codecs (qarray._blocks), which run
        on the host; here on all of ``x`` at once, a copy there and back for a device's arrays. The Dask
        backend runs it on each chunk of rows."""
        return self.asarray(fn(self.to_host(x)))

    def dequantize_blocks(self, raw, fmt, dtype, g=None):
        """float values (``dtype``) of block-format bytes ``raw`` (rows of blocks along the last axis):
        ``fmt.decode`` on the host (``map_rows``); ``g`` the tensor's scale, where the format has one."""
        def decode(r):
            v = fmt.decode(np.ascontiguousarray(r).reshape(-1, fmt.nbytes), g)
            return v.reshape(*r.shape[:-1], r.shape[-1] // fmt.nbytes * fmt.block).astype(dtype, copy=False)

        return self.map_rows(decode, raw, fmt.block / fmt.nbytes, dtype)

    def block_linear(self, x, raw, fmt, g=None, columns=None, bias=None, packed=None):
        """float32 ``(M, N)``: ``float32(sum_k x[m, k] * w[n, k] (+ bias[n]))`` summed in float64 in
        increasing ``k`` (``qarray.ops.block_linear``'s float contract), ``w`` the values of
        block-format rows ``raw`` ``(N, row bytes)`` as ``dequantize`` gives them (``g`` the tensor's
        scale, ``columns`` act-order's column order or None); ``x`` float64 ``(M, K)``, ``bias``
        float64 ``(N,)`` or None; ``packed``: :meth:`pack_blocks_float`'s, which a backend with a packed
        path runs on (here: unused). One step a ``k``, over all outputs at once."""
        w = self.dequantize_blocks(raw, fmt, np.float32, g)
        if columns is not None:
            w = w[:, self.param(np.argsort(columns))]
        w = w.astype(np.float64)
        acc = self.xp.zeros((x.shape[0], w.shape[0]), np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN go through, as IEEE has them
            for k in range(x.shape[1]):
                acc += x[:, k:k + 1] * w[:, k]
            if bias is not None:
                acc += bias
            return acc.astype(np.float32)

    def q8_parts(self, xraw, act="Q8_0"):
        """Q8_0 rows ``xraw`` (uint8 ``(M, K // 32 * 34)``) as their scales, float64 ``(M, K // 32)``,
        and codes, int8 ``(M, K)``; Q8_K rows (``act``; ``(M, K // 256 * 292)``) likewise, a scale
        each 256."""
        size, block, head, dtype = (292, 256, 4, np.float32) if act == "Q8_K" else (34, 32, 2, np.float16)
        m, nb = xraw.shape[0], xraw.shape[1] // size
        blocks = xraw.reshape(m, nb, size)
        dx = blocks[:, :, :head].copy().view(dtype).reshape(m, nb).astype(np.float64)
        return dx, blocks[:, :, head:head + block].copy().view(np.int8).reshape(m, nb * block)

    def pack_blocks(self, raw, fmt):
        """Block-format rows ``raw`` of format ``fmt`` (one that takes Q8_0 activations) prepared once
        for :meth:`block_linear_q8`'s ``packed``, or None where this backend has no packed path (here)."""
        return None

    def pack_blocks_float(self, raw, fmt, g=None):
        """Block-format rows ``raw`` of format ``fmt`` (``g``: the tensor's scale; in stored column order)
        prepared once for :meth:`block_linear`'s ``packed`` (float activations), or None where this
        backend has no packed path for them (here)."""
        return None

    def block_linear_q8(self, xraw, raw, fmt, bias=None, packed=None, act="Q8_0"):
        """float32 ``(M, N)`` of Q8_0 activations (rows of blocks ``xraw``: :meth:`q8_parts`) against
        block-format rows ``raw`` of integer values
        (``qarray.ops.block_linear``'s Q8_0 contract): per piece of ``min(sub, 32)`` k, ``dx * s *
        isum + dx * o * xsum`` in float64, summed in order; Q8_K activations (``act``): its Q8_K
        contract, the sub-scales folded into integer sums a block. The weights' integers and
        parameters are read on the host (``BlockFormat.unpack``, ``parameters``, ``levels``);
        ``packed``: :meth:`pack_blocks`'s."""
        xp = self.xp
        dx, qx = self.q8_parts(xraw, act)
        blocks = np.ascontiguousarray(self.to_host(raw)).reshape(-1, fmt.nbytes)
        n, k_len = raw.shape[0], qx.shape[1]
        s, o, z = fmt.parameters(blocks)
        v = fmt.values.astype(np.int64)[fmt.fields["q"].unpack(blocks)].reshape(len(blocks), -1, fmt.sub)
        if z is not None:
            v = v - z.astype(np.int64)[:, :, None]
        v = self.asarray(v.reshape(n, k_len))
        q = qx.astype(np.int64)
        acc = xp.zeros((qx.shape[0], n), np.float64)
        # a float step: one piece of min(sub, 32) k (Q8_0), or a block whose pieces' integer sums are
        # weighted by their sub-scales sc and m (Q8_K); d and dm an entry each span k
        if act == "Q8_K":
            d, sc, dm, mn = fmt.levels(blocks)
            step, piece, span, xblock = fmt.block, fmt.sub, fmt.block, 256
        else:
            d, sc, dm, mn = s, None, o, None
            step = piece = min(fmt.sub, 32)
            span, xblock = fmt.sub, 32
        d, sc, dm, mn = (None if a is None else self.asarray(a.reshape(n, -1)) for a in (d, sc, dm, mn))
        d, dm = d.astype(np.float64), None if dm is None else dm.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            for k0 in range(0, k_len, step):
                big, small = (xp.zeros((qx.shape[0], n), np.int64) for _ in range(2))
                for p0 in range(k0, k0 + step, piece):
                    part = slice(p0, p0 + piece)
                    isum, xsum = q[:, part] @ v[:, part].T, q[:, part].sum(axis=1, keepdims=True)
                    big += isum if sc is None else isum * sc[:, p0 // piece]
                    small += xsum if mn is None else xsum * mn[:, p0 // piece]
                c, j = dx[:, k0 // xblock, None], k0 // span
                term = c * d[:, j] * big.astype(np.float64)
                if dm is not None:
                    term = term + c * dm[:, j] * small.astype(np.float64)
                acc += term
            if bias is not None:
                acc += bias
            return acc.astype(np.float32)

    def over_batches(self, op, x, *args, **kwargs):
        """``op(x, *args, **kwargs)`` for an op whose samples (``x``'s first axis)
        are independent (``per_sample``: conv2d, pooling): here all at once; the
        Dask backend runs it on each chunk of samples."""
        return op(x, *args, **kwargs)

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def param(self, a):
        """Host array ``a`` (quantization parameters and what ops derive from them:
        per-axis thresholds, weight zero points, a bias) as this backend's array.
        Ops pass the same few values on every call: the CuPy backend keeps one
        device copy of each (no copy per call)."""
        return self.asarray(a)

    def to_host(self, a) -> np.ndarray:
        return to_host(a)

    def check_nan(self) -> None:
        """Raise the NaN error of an earlier quantize call on this thread that
        this backend reported late (CuPy: at the next host read, not to wait for
        the device at each call); nothing where every call raises at once."""

    # -- elementwise primitives ------------------------------------------
    # Elements per pass of the generic elementwise code (and of the chunked
    # ops, avg_pool2d): its temporaries, up to about a dozen int64 arrays in
    # requantize, stay a few MB whatever the size (and in the CPU caches).
    chunk = 1 << 16

    def _chunked(self, fn, a, out, layout, params):
        """``out = fn(a, *params)``, elementwise, ``chunk`` elements at a time.

        ``a`` and ``out`` have the shape ``layout`` describes (``out`` C-contiguous);
        ``params`` are parameter arrays (``qarray._params.param_shape``). ``fn``
        gets a 2-D piece of ``a`` (rows of ``Layout.pieces``, cut by
        ``Layout.chunks``) and each parameter sliced to broadcast against it,
        and returns that piece of the result.
        """
        xp = self.xp
        if not self.writable:  # immutable arrays (JAX): the whole array in one piece, parameters broadcast
            lay, ps = layout, []
            for p in params:
                p3 = self.asarray(p).reshape(lay.pouter, lay.blocks, lay.pinner)
                ps.append(xp.repeat(p3, lay.step, axis=1)[:, :lay.n] if lay.step > 1 else p3)
            return fn(a.reshape(lay.outer, lay.n, lay.inner), *ps).reshape(a.shape)
        af, of = a.reshape(-1), out.reshape(-1)
        for sl, lay in layout.pieces():
            rows = (lay.outer * lay.n, lay.inner)
            a2, out2 = af[sl].reshape(rows), of[sl].reshape(rows)
            p2 = [self.asarray(p).reshape(lay.pouter * lay.blocks, lay.pinner) for p in params]
            seen = None
            for r, c, prow in lay.chunks(self.chunk):
                pc = c if lay.pinner > 1 else slice(None)
                if seen is None or seen[0] is not prow or seen[1] != pc:  # else the same parameters again
                    pr = xp.asarray(prow)
                    seen = prow, pc, [p[pr, pc] for p in p2]
                out2[r, c] = fn(a2[r, c], *seen[2])
        return out

    def quantize(self, x, qp: Quant, out=None):
        """``clamp(rint(x / scale) + zero_point)`` in ``qd``'s storage dtype (the
        plan ``qp``), written into ``out`` when given (that dtype, ``x``'s shape)."""
        xp, qd = self.xp, qp.qd

        def fn(c, s, z):
            if bool(xp.isnan(c).any()):
                raise nan_error(x)
            return xp.clip(self._rounded(c, s, z), qd.qmin, qd.qmax).astype(qd.storage)

        lay = Layout(x.shape, qp.axis, qp.block_size)
        return self._into(out, lambda t: self._chunked(fn, x, t, lay, self._quantize_params(x, qp)), x.shape,
                          qd.storage)

    def _quantize_params(self, x, qp):
        ft = self.xp.float64 if x.dtype == self.xp.float64 else self.xp.float32
        return qp.scale.astype(ft), qp.zero_point.astype(self.xp.float64)

    def _rounded(self, c, s, z):
        """``rint(c / s) + z`` before the clamp, in float64 (``s`` in ``c``'s float type)."""
        xp = self.xp
        with np.errstate(over="ignore", invalid="ignore"):  # x / scale beyond the float range is inf, which saturates
            return xp.rint(c.astype(s.dtype, copy=False) / s).astype(xp.float64) + z

    def quantize_stochastic(self, x, qp: Quant, key, index=None):
        """:meth:`quantize` rounding ``x / scale`` down or up, up with probability
        its fraction (``qarray._philox.round_stochastic``), the random word of each
        element Philox4x32-10's of its flat index in the whole array under
        ``key``. ``index``: those indices (uint64, ``x``'s shape), default ``x``'s
        own C-order ones (a Dask chunk passes its place in the whole). Here in
        whole-array operations."""
        w = self._rounded_stochastic(x, qp, key, index)
        return self.xp.clip(w, qp.qd.qmin, qp.qd.qmax).astype(qp.qd.storage)

    def _rounded_stochastic(self, x, qp, key, index):
        """:meth:`quantize_stochastic`'s values before the clamp (float64 for
        float64 input, else float32 or float64 as ``_quantize_params`` gives)."""
        xp = self.xp
        if bool(xp.isnan(x).any()):
            raise nan_error(x)
        s, z = (self.asarray(expand(p, x.shape, qp.axis, qp.block_size)) for p in self._quantize_params(x, qp))
        index = self._index(x.shape, index)
        with np.errstate(over="ignore", invalid="ignore"):  # x / scale beyond the float range is inf, which saturates
            t = x.astype(s.dtype, copy=False) / s
            return _philox.round_stochastic(t, xp.floor(t), _philox.bits(index, *key)) + z

    def fake_quantize(self, x, qp: Quant, dtype, mask=False, key=None, index=None, out=None):
        """``(values, inside)``: :meth:`quantize`'s codes (``key``:
        :meth:`quantize_stochastic`'s, ``index`` as there) dequantized to
        ``dtype`` as :meth:`dequantize` computes them, written into ``out``
        when given (``dtype``, ``x``'s shape), and (``mask`` True, else None)
        whether the rounded ``x / scale + zero_point`` was inside ``[qmin,
        qmax]`` before the clamp (the straight-through estimator's mask; False
        for inf). Here the primitives and a pass of their own for the mask;
        backends that can do it in one pass over ``x``."""
        inside, qd = None, qp.qd
        if key is None:
            q = self.quantize(x, qp)
        else:  # the values before the clamp once: the codes and the mask both come from them
            w = self._rounded_stochastic(x, qp, key, index)
            q = self.xp.clip(w, qd.qmin, qd.qmax).astype(qd.storage)
            if mask:
                inside = (w >= qd.qmin) & (w <= qd.qmax)
        values = self.dequantize(q, qp.scale, qp.zero_point, qp.axis, qp.block_size, dtype)
        if mask and key is None:
            def fn(c, s, z):
                w = self._rounded(c, s, z)
                return (w >= qd.qmin) & (w <= qd.qmax)

            inside = self._chunked(fn, x, self.empty(x.shape, self.xp.bool_), Layout(x.shape, qp.axis, qp.block_size),
                                   self._quantize_params(x, qp))
        if out is not None:  # last: out may be x
            out[...] = values
            values = out
        return values, inside

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        """``(q - zero_point) * scale`` in float32, or float64 when ``dtype`` is float64."""
        xp = self.xp
        ft = xp.float64 if dtype == np.float64 else xp.float32

        def fn(c, s, z):
            return ((c.astype(xp.int64) - z).astype(ft) * s).astype(dtype, copy=False)

        out = self.empty(q.shape, dtype)
        params = (scale.astype(ft), zero_point.astype(xp.int64))
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, as IEEE rounds it
            return self._chunked(fn, q, out, Layout(q.shape, axis, block_size), params)

    def quantize_float(self, x, scale, qd, axis, block_size, saturate, *, mx=False, multiply=False):
        """``x / scale`` (``x * scale`` with ``multiply``) cast to the floating format
        ``qd`` (ONNX's QuantizeLinear, ``qarray._formats.quantize``), in ``qd``'s
        storage. ``mx``: the elements of an MX or NVFP4 block (-0 keeps its sign;
        NaN is allowed, its code left for the caller to overwrite). The reference
        runs on the host; a backend with kernels overrides it (CuPy: the bit
        patterns as uint8)."""
        xh, s = to_host(x), expand(scale, x.shape, axis, block_size)
        if not mx and not multiply:
            codes = _formats.quantize(xh, s, qd, saturate)
        else:
            ft = np.float64 if xh.dtype == np.float64 else np.float32
            with np.errstate(invalid="ignore", over="ignore"):
                v = xh.astype(ft, copy=False) * s.astype(ft) if multiply else xh.astype(ft, copy=False) / s.astype(ft)
            codes = _formats.cast(np.where(np.isnan(v), 0, v) if mx else v, qd, saturate)
        return self.asarray(codes.view(np.uint8)).view(self.float_storage(qd))

    def quantize_mx(self, x, mx, axis, block_size, rounding):
        """MX blocks of ``x`` (float32 or float64): ``(codes, bits)``, the element
        codes in this backend's storage (0 in a block whose scale is NaN) and the
        E8M0 scale bits (uint8, host). The reference: block max (``minmax``), the
        exponent (``qarray._formats.mx_exponents``), then ``x / 2**e`` (exact)
        rounded by :meth:`quantize_float` with MX's signed zeros."""
        bits = _formats.mx_exponents(self.block_amax(x, axis, block_size), mx, rounding)
        scale = bits.view(_formats.dtype("float8_e8m0fnu")).astype(np.float32)  # 2**e, NaN for NaN blocks
        codes = self.quantize_float(x, scale, qdtype(mx.element), axis, block_size, True, mx=True)
        return self._zero_blocks(codes, bits == _formats.E8M0_NAN, axis, block_size), bits

    def quantize_nvfp4(self, x, axis, block_size, gs):
        """NVFP4 blocks of float32 ``x`` with tensor scale ``gs``: ``(codes, bits, gs)``,
        the float4 codes (0 in a block with NaN), the float8_e4m3fn block-scale
        bits (uint8, host), in float32 as torchao computes them, and the tensor
        scale (``gs``, or where it is None :meth:`nvfp4_global_scale`). A block
        with inf but no NaN is torchao's ``nvfp4_quantize``: its scale clamps to
        448 (0x7e), inf saturates to +-6, its finite elements scale as any."""
        amax = self.block_amax(x, axis, block_size)
        nan = np.isnan(amax)  # inf: clamped to 448 below, as torchao's clamp(scale, E4M3_EPS, F8E4M3_MAX)
        gs = self.nvfp4_global_scale(x, amax) if gs is None else gs
        with np.errstate(over="ignore", invalid="ignore"):
            s = np.clip(amax / np.float32(6) / gs, np.float32(2.0**-6), np.float32(448)).astype(_formats.dtype("float8_e4m3fn"))
            recip = (np.float32(1) / gs) / s.astype(np.float32)
        s[nan] = np.float32("nan")
        codes = self.quantize_float(x, recip, qdtype("float4_e2m1fn"), axis, block_size, True, mx=True, multiply=True)
        return self._zero_blocks(codes, nan, axis, block_size), s.view(np.uint8), gs

    def block_amax(self, x, axis, block_size):
        """``max(|x|)`` of each block (host, the parameters' shape), NaN where a block has NaN."""
        lo, hi = (to_host(v) for v in self.minmax(x, axis, block_size))
        return np.maximum(-lo, hi)

    def nvfp4_global_scale(self, x, amax):
        """NVFP4's default tensor scale, ``amax / (448 * 6)`` over the finite values
        of ``x`` (1 where that is 0), from the block maxima ``amax`` (host; all of
        ``x`` is read again only where a block holds NaN or inf). torchao's
        ``per_tensor_amax_to_scale`` of an inf amax is inf, which gives the inf blocks
        a NaN scale and every finite element 0; the finite amax keeps the tensor
        usable (an inf element then dequantizes to about +-the largest finite
        magnitude, ``6 * 448 * gs``)."""
        xp = self.xp
        if np.isfinite(amax).all():
            top = np.float32(amax.max(initial=0))  # host
        else:  # CuPy's reductions take no initial=: an empty selection is asked for first
            finite = xp.abs(x[xp.isfinite(x)])
            top = np.float32(to_host(finite.max()) if finite.size else 0)
        return np.asarray(top / np.float32(448 * 6) if top > 0 else np.float32(1), np.float32)

    def _zero_blocks(self, codes, nan, axis, block_size):
        """``codes`` with 0 in the blocks where ``nan`` (host, the parameters' shape)."""
        if nan.any():
                codes[self.asarray(expand(nan, codes.shape, axis, block_size))] = 0
        return codes

    def dequantize_float(self, q, scale, qd, axis, block_size, dtype):
        """``element * scale`` of floating-format codes in float32 (float64 when
        ``dtype`` is float64), as ``dtype``."""
        wide = np.float64 if dtype == np.float64 else np.float32
        codes = to_host(q).view(qd.storage)
        with np.errstate(over="ignore"):
            v = _formats.dequantize(codes, expand(scale, q.shape, axis, block_size), qd, wide)
        return self.asarray(v.astype(dtype, copy=False))

    def float_storage(self, qd):
        """How this backend stores floating-format codes: the ml_dtypes dtype
        (NumPy), or with ``float_bits`` their uint8 bit patterns (CuPy has no
        ml_dtypes dtypes; distributed's serialization does not know them); mxint8's
        int8 codes stay int8. ml_dtypes gives float8_e5m2 the kind "f", the other
        formats "V": every storage but an integer one becomes bits."""
        return qd.storage if not self.float_bits or qd.storage.kind in "iu" else np.dtype(np.uint8)

    def requantize(self, q, rq, out=None):
        """``rq`` (a ``qarray._fixed_point.Requant``) applied to every element of
        ``q``: ``clamp(R((q - zp_in) * M) + zp_out, lo, hi)`` in ``rq``'s output
        dtype, written into ``out`` when given (that dtype, ``q``'s shape)."""
        xp = self.xp

        narrow = rq.narrow(q.dtype)

        def fn(c, zi, zo, m, s, f):
            d = c.astype(xp.int64) - zi
            if rq.rounding == FLOAT:  # clamped in float64: a huge product must not overflow int64
                v = xp.clip(xp.rint(d.astype(xp.float64) * f + zo), rq.lo, rq.hi)
            else:
                v = d if rq.rounding == IDENTITY else rescale(d, m, s, rq.rounding, narrow)
                v = xp.clip(v + zo, rq.lo, rq.hi)
            return v.astype(rq.out_dtype, copy=False)

        lay = Layout(q.shape, rq.axis, rq.block_size)
        return self._into(out, lambda t: self._chunked(fn, q, t, lay, rq.params), q.shape, rq.out_dtype)

    def requantize_stochastic(self, q, rq, key, index=None):
        """:meth:`requantize` by ``rq``'s multiplier and shift (fixed point; its
        tie rule unused) rounding down or up, up with probability the
        fraction of the exact quotient (``qarray._fixed_point.rescale_stochastic``),
        the random word of each element drawn as :meth:`quantize_stochastic`
        draws it. Here in whole-array operations."""
        xp = self.xp
        zi, zo, m, s = (self.asarray(expand(p, q.shape, rq.axis, rq.block_size)) for p in rq.params[:4])
        r = _philox.bits(self._index(q.shape, index), *key).astype(xp.int64)
        v = rescale_stochastic(q.astype(xp.int64) - zi, m, s, r)
        return xp.clip(v + zo, rq.lo, rq.hi).astype(rq.out_dtype)

    def _index(self, shape, index):
        """Each element's flat C-order index (uint64, ``shape``), or ``index`` given."""
        xp = self.xp
        return xp.arange(int(np.prod(shape)), dtype=xp.uint64).reshape(shape) if index is None else index

    def clip(self, q, lo, hi):
        """``min(max(q, lo), hi)`` in ``q``'s dtype; ``lo``/``hi`` broadcast against ``q``."""
        return self.xp.clip(q, lo, hi).astype(q.dtype, copy=False)

    def binary(self, a, b, bp, out=None):
        """``x op y`` with broadcasting by the plan ``bp`` (a
        ``qarray._fixed_point.Binary``), ``op`` being "add", "sub" or "mul": ``x``
        and ``y`` are the operands taken by the per-tensor Requants ``bp.ra`` and
        ``bp.rb`` to int64 (centred, and for add rescaled onto a common scale),
        exact; then ``bp.rq`` applied when given (one pass on the GPU), else the
        int64 result; written into ``out`` when given. The op makes sure nothing
        overflows int64.
        """
        x, y = self.requantize(a, bp.ra), self.requantize(b, bp.rb)
        return self._result(x * y if bp.op == "mul" else (x + y if bp.op == "add" else x - y), bp.rq, out)

    def _result(self, acc, rq, out):
        """``acc`` requantized by ``rq`` (None: as it is), written into ``out``
        when given."""
        self._no_out(out)
        if rq is not None:
            return self.requantize(acc, rq, out)
        if out is None:
            return acc
        out[...] = acc
        return out

    def _no_out(self, out):
        """Raise TypeError for an ``out=`` given where arrays cannot be written
        (``writable`` False)."""
        if out is not None and not self.writable:
            raise TypeError(f"out= is not supported for {self.name} arrays (they are immutable); drop out=")

    def minmax(self, x, axis, block_size):
        """Minimum and maximum of ``x`` per parameter slot (shapes as the params)."""
        xp = self.xp
        if axis is None:
            return xp.min(x), xp.max(x)
        lay = Layout(x.shape, axis, block_size)
        x3 = x.reshape(lay.dims)
        if block_size is None:
            return x3.min(axis=(0, 2)), x3.max(axis=(0, 2))
        # whole blocks as a 4-D view, then the short last block: nothing copied
        n, full = lay.n, lay.n // block_size * block_size
        lo, hi = [], []
        if full:
            x4 = x3[:, :full].reshape(lay.outer, full // block_size, block_size, lay.inner)
            lo.append(x4.min(axis=2))
            hi.append(x4.max(axis=2))
        if full < n:
            lo.append(x3[:, full:].min(axis=1, keepdims=True))
            hi.append(x3[:, full:].max(axis=1, keepdims=True))
        want = x.shape[:axis] + (lay.blocks,) + x.shape[axis + 1 :]
        return tuple((v[0] if len(v) == 1 else xp.concatenate(v, axis=1)).reshape(want) for v in (lo, hi))

    def lut(self, q, table, axis=None):
        """``table[u]`` for every element, ``u`` being ``q``'s storage seen as unsigned.

        ``table`` covers the storage's whole unsigned range (``T`` = 256 or 65536
        entries): shape ``(T,)``, or ``(C, T)`` with one row per index along
        ``axis`` (per-axis input), looked up at the flat index ``c * T + u``.
        """
        xp = self.xp
        u = q.view(np.dtype(f"u{q.dtype.itemsize}"))
        if axis is None:
            return xp.take(table, u)
        c = xp.arange(q.shape[axis], dtype=xp.int64) * table.shape[1]
        c = c.reshape((1,) * axis + (-1,) + (1,) * (q.ndim - axis - 1))
        return xp.take(table.reshape(-1), c + u)

    def softmax(self, x, sm, out=None):
        """Quantized softmax or log_softmax of the rows of ``x`` by the plan ``sm``
        (a ``qarray._fixed_point.Softmax``), written into ``out`` when given
        (``sm``'s output dtype, ``x``'s shape).

        ``x`` is 2-D integer ``(rows, n)``, the softmax axis last; ``j = rowmax - x``
        indexes ``sm.table``. With ``S`` the exact int64 row sum of ``T[j]``:
        softmax is ``rint(T[j] / (S * s_out)) + z_out``, log_softmax
        ``rint((-s_in * j - log(S / 2**30)) / s_out) + z_out``, float64
        throughout, clamped to the output dtype's range. The log runs on the host
        in NumPy (one per row), so every backend takes the same value.
        """
        xp = self.xp
        rows, n = x.shape
        lo, hi, out_dtype = sm.qd.qmin, sm.qd.qmax, sm.out_dtype
        if rows * n == 0:
            return self.empty((rows, n), out_dtype) if out is None else out
        if out is None and self.writable:
            out = self.empty((rows, n), out_dtype)
        t = self.asarray(sm.table)
        step = max(1, self.chunk // n)
        pieces = []  # rows of about ``chunk`` elements at a time: into out, or joined (immutable arrays)
        for r in range(0, rows, step):
            c = x[r : r + step].astype(xp.int64)
            j = c.max(axis=1, keepdims=True) - c
            tj = xp.take(t, j)
            S = tj.sum(axis=1, keepdims=True)
            if sm.log:
                logs = self.asarray(np.log(to_host(S).astype(np.float64) / 2.0**30))
                v = xp.rint((j.astype(xp.float64) * -float(sm.s_in) - logs) / float(sm.s_out))
            else:
                v = xp.rint(tj.astype(xp.float64) / (S.astype(xp.float64) * float(sm.s_out)))
            piece = xp.clip(v + float(sm.z_out), lo, hi).astype(out_dtype)
            if out is not None:
                out[r : r + step] = piece
            else:
                pieces.append(piece)
        return out if out is not None else xp.concatenate(pieces)

    # -- integer matmul ------------------------------------------------------
    def pack_weight(self, codes, qd, keep=False):
        """Weight codes ``(..., K, N)`` of QDType ``qd`` prepared for
        :meth:`int_matmul`: here float32 ``codes - shift``, centred so that every
        value is at most ``2**(bits - 1)`` in size. ``keep``: the weights will
        be used many times (an ``nn`` layer); backends may pack harder."""
        shift = 0 if qd.signed else 1 << (qd.bits - 1)
        centred = codes.astype(self.xp.int32) - shift
        return FloatWeight(centred.astype(self.xp.float32), shift, centred.sum(axis=-2, dtype=self.xp.int64), qd.bits)

    def raw_matmul(self, a, qd, pw, acc_dtype):
        """``(raw, off)``: ``raw = (a + off) @ (codes - pw.shift)`` exactly, for ``a``
        of QDType ``qd`` and ``pw`` from :meth:`pack_weight`.

        Here through float32 matmul: with ``off`` centring ``a`` as the weights
        are, products are at most ``2**(bits_a - 1) * 2**(bits_w - 1)``, so
        chunks of ``kc`` of them stay below ``2**24`` and every float32 partial
        sum is exact; the chunks are summed as ``acc_dtype`` integers (the
        caller picks int32 only where the sum fits).
        """
        xp = self.xp
        off = 0 if qd.signed else -(1 << (qd.bits - 1))
        kc = max(1, (1 << 24) >> (qd.bits + pw.bits - 2))
        af = xp.add(a, xp.float32(off), dtype=xp.float32)  # one pass
        raw = None
        for k0 in range(0, max(a.shape[-1], 1), kc):  # K = 0: one empty product, zeros as in NumPy
            part = xp.matmul(af[..., k0 : k0 + kc], pw.w[..., k0 : k0 + kc, :]).astype(acc_dtype)
            raw = part if raw is None else raw + part
        return raw, off

    def int_matmul(self, a, pw, gp: Gemm, out=None):
        """``sum_k (a - za) * (w - zw) + bias`` exactly by the plan ``gp`` (a
        ``qarray._params.Gemm``: ``za``, ``zw``, ``bias``): in
        ``gp.acc_dtype`` when ``gp.rq`` is None, else requantized by ``gp.rq``;
        written into ``out`` when given (that dtype, ``(..., M, N)``).

        ``a`` holds codes of QDType ``gp.qd`` (8 bits or less), ``(..., M, K)``;
        ``pw`` the weights from :meth:`pack_weight`. With ``a' = a + off`` and
        ``w' = w - shift`` as :meth:`raw_matmul` computes ``a' @ w'``, the
        zero-point terms are ``- za' * colsum(w') - zw' * rowsum(a') + K * za' * zw'``.
        """
        raw, off = self.raw_matmul(a, gp.qd, pw, gp.acc_dtype)
        return self.gemm_epilogue(raw, *self._gemm_terms(a, off, pw, gp, raw.shape), gp, out)

    def int_matmul_plan(self, a, pw, gp: Gemm):
        """:meth:`int_matmul` by the plan ``gp`` made ready for codes of ``a``'s
        shape and dtype: ``run(codes)``, for a caller to keep while
        :meth:`plan_state` stays the same (a layer called again and again:
        ``PackedWeight.matmul``). Here each run is a call of :meth:`int_matmul`."""
        return lambda codes: self.int_matmul(codes, pw, gp)

    def plan_state(self):
        """What the functions of :meth:`int_matmul_plan` were made for: where it
        changes (a setting, an instruction set turned off), they are made again."""
        return ()

    def _gemm_terms(self, a, off, pw, gp, shape):
        """:meth:`int_matmul`'s ``(rowsum, c, zw)`` for :meth:`gemm_epilogue`, with
        ``a' = a + off``, and ``c`` broadcast to the batch of a result of ``shape``."""
        k = a.shape[-1]
        return self._terms(k, off, pw, gp, shape, lambda: a.sum(axis=-1, dtype=self.xp.int64) + k * off)

    def _terms(self, k, off, pw, gp, shape, rowsum):
        """:meth:`_gemm_terms` for rows of ``k`` codes ``a'``, ``rowsum()`` their
        sums, asked for only where a weight's ``zw'`` is nonzero."""
        xp = self.xp
        terms = _host_column_terms if isinstance(pw.colsum, np.ndarray) else functools.partial(_column_terms, xp)
        zw, c, rows = terms(k, int(gp.za) + off, gp.zw, pw.shift, pw.colsum, gp.bias)
        want = shape[:-2] + shape[-1:]
        return rowsum() if rows else None, c if c.shape == want else xp.broadcast_to(c, want), zw

    def gemm_epilogue(self, raw, rowsum, c, zw, gp: Gemm, out=None):
        """``raw + c - zw * rowsum`` (int64 arithmetic; the products ``raw`` and
        :meth:`int_matmul`'s terms: ``c`` per column, ``rowsum`` per row or None,
        ``zw`` the weights' zero points less their packing's shift) in
        ``gp.acc_dtype``, or requantized by ``gp.rq``; written into ``out`` when given."""
        xp = self.xp
        acc = raw.astype(xp.int64) + c[..., None, :]
        if rowsum is not None:
            acc -= rowsum[..., :, None] * xp.asarray(zw)
        return self._result(acc.astype(gp.acc_dtype) if gp.rq is None else acc, gp.rq, out)

    # -- convolution ----------------------------------------------------------
    def conv_gemm(self, x, kh, kw, pw, gp: Gemm, out=None):
        """conv2d (groups 1) as one integer product: :meth:`int_matmul` by the
        plan ``gp`` of the patches of ``x`` (:meth:`im2col` by ``gp``'s stride,
        padding and dilation, padded with ``gp.za``; ``x`` the channels-last
        codes ``(N, H, W, C)``) and the weights ``pw`` (:meth:`pack_weight`'s,
        ``(kh * kw * C, O)``, rows ``(p, q, c)``): ``(N*OH*OW, O)``. A backend
        may multiply the patches without copying them out first."""
        cols = self.im2col(x, kh, kw, gp.stride, gp.padding, gp.dilation, gp.za)
        return self.int_matmul(cols, pw, gp, out)

    def conv_gemm_plan(self, x, kh, kw, pw, gp: Gemm):
        """:meth:`conv_gemm` made ready for codes of ``x``'s shape and dtype, as
        :meth:`int_matmul_plan`: here each run is a call of :meth:`conv_gemm`."""
        return lambda codes: self.conv_gemm(codes, kh, kw, pw, gp)

    def im2col(self, x, kh, kw, stride, padding, dilation, za):
        """``(N*OH*OW, kh*kw*C)``: row ``(n, i, j)``, column ``(p, q, c)`` holds
        ``xpad[n, i*sh + p*dh, j*sw + q*dw, c]``, ``xpad`` the channels-last
        codes ``x`` ``(N, H, W, C)`` padded by ``padding`` with ``za``."""
        (sh, sw), (dh, dw) = stride, dilation
        xpad = self._pad(x, padding, za, channels_last=True)
        n, hp, wp, c = xpad.shape
        oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
        taps = [xpad[:, p * dh: p * dh + (oh - 1) * sh + 1: sh, q * dw: q * dw + (ow - 1) * sw + 1: sw, :]
                for p in range(kh) for q in range(kw)]  # slices only: any array library has them
        return self.xp.stack(taps, axis=3).reshape(n * oh * ow, kh * kw * c)

    def conv_grouped(self, x, wc, gp: Gemm, out=None):
        """Grouped conv2d by the plan ``gp`` (a ``qarray._params.Gemm``:
        ``za``, ``bias``, ``groups``, ``stride``, ``dilation``, ``padding``): the
        exact sums ``sum (xpad - za) * wc`` over the taps of each output
        channel's group, ``xpad`` the codes ``x`` ``(N, C, H, W)`` padded with
        ``za``, plus ``bias`` (int64 ``(O,)`` or None), as integers ``(N, O,
        OH, OW)`` (``gp.rq`` None) or requantized by ``gp.rq``; written into
        ``out`` when given. ``wc`` holds centred weights ``(O, C / groups, kh,
        kw)``; output channel ``o`` reads the input channels of group ``o // (O
        / groups)``. Here one int64 contraction per tap, never one GEMM per group."""
        xpad = self._pad(x, gp.padding, gp.za)
        xp, groups = self.xp, gp.groups
        n, c, hp, wp = xpad.shape
        o, cg, kh, kw = wc.shape
        (sh, sw), (dh, dw) = gp.stride, gp.dilation
        oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
        xg = (xpad.astype(xp.int64) - gp.za).reshape(n, groups, cg, hp, wp)
        wg = wc.astype(xp.int64).reshape(groups, o // groups, cg, kh, kw)
        acc = xp.zeros((n, groups, o // groups, oh, ow), xp.int64)
        for p in range(kh):
            for q in range(kw):
                tap = xg[..., p * dh : p * dh + (oh - 1) * sh + 1 : sh, q * dw : q * dw + (ow - 1) * sw + 1 : sw]
                acc += xp.einsum("ngchw,goc->ngohw", tap, wg[..., p, q])
        acc = acc.reshape(n, o, oh, ow)
        if gp.bias is not None:
            acc += gp.bias[:, None, None]
        return self._result(acc, gp.rq, out)

    def _pad(self, x, padding, za, channels_last=False):
        """Codes ``x`` ``(N, C, H, W)`` (``(N, H, W, C)`` where ``channels_last``)
        padded by ``padding`` ``(ph, pw)`` with ``za``."""
        (ph, pw), none = padding, (0, 0)
        pads = (none, (ph, ph), (pw, pw), none) if channels_last else (none, none, (ph, ph), (pw, pw))
        return self.xp.pad(x, pads, constant_values=x.dtype.type(za))

    # -- sub-byte packing ---------------------------------------------------
    def pack(self, q, bits):
        """Flattened ``q`` packed ``8 // bits`` to a byte, first element in the low bits."""
        xp = self.xp
        per = 8 // bits
        flat = q.reshape(-1).astype(xp.uint8) & ((1 << bits) - 1)
        pad = -flat.size % per
        if pad:
            flat = xp.concatenate([flat, xp.zeros(pad, xp.uint8)])
        lanes = flat.reshape(-1, per)
        out = xp.zeros(lanes.shape[0], xp.uint8)
        for j in range(per):
            out |= lanes[:, j] << (bits * j)
        return out

    def unpack(self, packed, bits, signed, count):
        """The first ``count`` values of ``packed``, sign-extended when ``signed``."""
        xp = self.xp
        shifts = xp.arange(0, 8, bits, dtype=xp.uint8)
        vals = ((packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]
        if not signed:
            return vals.astype(xp.uint8)
        sign = 1 << (bits - 1)
        return ((vals.astype(xp.int16) ^ sign) - sign).astype(xp.int8)
