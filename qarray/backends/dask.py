"""The Dask backend: QArrays whose data is a ``dask.array.Array`` of NumPy
chunks, or of CuPy chunks (dask-cuda).

Nothing here does arithmetic. Each primitive maps the chunks' own backend's
primitive over the chunks (``map_blocks``), each chunk with its slice of the
parameters, so a Dask result is bit for bit the in-memory one whatever the
chunking. There is one ``DaskBackend`` per chunk backend (``inner``): the
registry hands out the one of an array's chunk type (``_meta``), so the small
arrays that ops derive from parameters (``param``, ``asarray``) are of that
type too. Results stay lazy until ``compute()`` (or ``persist()``); errors
that need the data (NaN where a format has none) are raised then.

Blocked parameters need chunks that hold whole blocks along the blocked axis:
:meth:`DaskBackend.aligned` rechunks that axis to a multiple of ``block_size``
when it is not one already (the last chunk may be short).
"""

from __future__ import annotations

import dataclasses
import functools

import dask
import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array

from .._params import to_host
from ._base import Backend

_by_inner: dict = {}  # chunk backend name -> its DaskBackend, but NumPy's: the registered "dask" one


def chunk_params(params, loc, axis, block_size):
    """``params`` (host arrays of ``qarray._params.param_shape``; 0-d ones serve
    every chunk) sliced to the chunk at ``loc``, ``[(start, stop)]`` per axis
    (``block_info``'s ``array-location``)."""
    if axis is None:
        return params
    if block_size is None:
        key = slice(*loc[axis])
    else:
        key = tuple(slice(a // block_size, -(-b // block_size)) if i == axis else slice(a, b)
                    for i, (a, b) in enumerate(loc))
    return tuple(p if np.ndim(p) == 0 else p[key] for p in params)


def _on_chunk(fn, inner, params, *chunks):
    """``fn(backend, *chunks, *params)`` for one chunk (and the matching chunks of
    further arrays); the inner backend is looked up by name on the worker (a
    backend object holds a module)."""
    from . import get

    return fn(get(inner), *chunks, *params)


def _on_chunk_sliced(fn, inner, axis, block_size, params, *chunks, block_info=None):
    """:func:`_on_chunk` with ``params`` sliced to the chunk (``block_info``: where it is)."""
    return _on_chunk(fn, inner, chunk_params(params, block_info[0]["array-location"], axis, block_size), *chunks)


_REQUANT_FIELDS = ("zp_in", "zp_out", "m", "shift", "f")  # Requant.params, in order


def _flat_index(x):
    """Each element's flat C-order index in the whole of ``x`` (uint64), chunked
    as ``x``: the sum of per-axis ranges times the strides, made lazily chunk by
    chunk (stochastic rounding's random words are the indices')."""
    strides = np.cumprod((x.shape[1:] + (1,))[::-1])[::-1]
    index = sum(da.arange(n, dtype=np.uint64, chunks=c).reshape((1,) * d + (n,) + (1,) * (x.ndim - d - 1))
                * np.uint64(st) for d, (n, c, st) in enumerate(zip(x.shape, x.chunks, strides)))
    return da.broadcast_to(index, x.shape) if x.ndim else da.zeros((), np.uint64)


def _chunk_minmax(inner, axis, block_size, chunk):
    from . import get

    b = get(inner)
    return b.xp.stack(b.minmax(chunk, axis, block_size))


class DaskWeight:
    """In-memory weight codes ``(K, N)`` for Dask activations: packed by the
    chunks' backend per range of K, once each (the whole K, or each K chunk of
    activations whose K is split across chunks)."""

    def __init__(self, backend, codes, qd, keep):
        self.backend, self.codes, self.qd, self.keep, self._parts = backend, codes, qd, keep, {}
        whole = self.part(0, codes.shape[-2])
        self.shift, self.colsum = whole.shift, whole.colsum  # the chunks' backend's arrays

    def part(self, k0, k1):
        """The chunks' backend's packing of rows ``k0:k1``."""
        if (k0, k1) not in self._parts:
            codes = self.backend.xp.ascontiguousarray(self.codes[k0:k1])
            self._parts[k0, k1] = self.backend.pack_weight(codes, self.qd, self.keep)
        return self._parts[k0, k1]


def _on_batch(op, like, args, kwargs, chunk):
    """``op`` on one chunk of samples, as an in-memory QArray with ``like``'s parameters."""
    x = type(like)._new(chunk, like.scale, like.zero_point, like.dtype, like.axis, like.block_size)
    return op(x, *args, **kwargs).data


def _chunk_matmul(inner, gp, chunk, pw):
    from . import get

    return get(inner).int_matmul(chunk, pw, gp)


class DaskBackend(Backend):
    """The primitives of the chunks' backend (``inner``, its name), mapped over a
    dask array's chunks."""

    name = "dask"
    module = "dask.array"
    writable = False
    float_bits = True  # distributed's serialization does not know ml_dtypes' dtypes

    def __init__(self, inner="numpy"):
        super().__init__(da)
        self.inner = inner

    def __repr__(self):
        return f"<qarray backend 'dask' of {self.inner} chunks>"

    def array_types(self) -> tuple:
        return (da.Array,)

    def of(self, x):
        """The Dask backend of ``x``'s chunk type: one per chunk backend."""
        from . import for_array

        inner = for_array(x._meta).name
        if inner == self.inner:
            return self
        if inner not in _by_inner:
            _by_inner[inner] = DaskBackend(inner)
        return _by_inner[inner]

    def _chunks_backend(self):
        from . import get

        return get(self.inner)

    def param(self, a):
        return self._chunks_backend().param(a)  # small arrays broadcast against the chunks as they are

    def asarray(self, a, dtype=None):
        a = a if isinstance(a, da.Array) else da.from_array(self._chunks_backend().asarray(a))
        return a if dtype is None else a.astype(dtype)

    def to_host(self, a) -> np.ndarray:
        return to_host(a.compute() if isinstance(a, da.Array) else a)

    @staticmethod
    def aligned(x, axis, block_size):
        """``x`` with chunks along ``axis`` of whole blocks (the last may be short):
        as it is when they are, else rechunked to the multiple of ``block_size``
        nearest its first chunk."""
        if block_size is None:
            return x
        sizes = x.chunks[axis]
        if all(c % block_size == 0 for c in sizes[:-1]):
            return x
        step = max(block_size, round(sizes[0] / block_size) * block_size)
        return x.rechunk({axis: step})

    def map_chunks(self, fn, x, axis, block_size, params, dtype, *others):
        """``fn(inner_backend, chunk, *other_chunks, *params_of_chunk)`` over ``x``'s
        chunks (``others``: arrays of ``x``'s shape, taken in the same chunks),
        each returning that chunk's result (same shape, ``dtype``); lazy."""
        x = self.aligned(da.asarray(x), axis, block_size)  # an in-memory operand joins as one chunk
        others = [o.rechunk(x.chunks) for o in others]
        params = tuple(to_host(p) for p in params)  # sliced per chunk on the host; primitives take host params
        # per tensor, no block_info: dask builds it as one more input per chunk, ~0.5 ms a chunk
        per_chunk = (functools.partial(_on_chunk, fn, self.inner, params) if axis is None else
                     functools.partial(_on_chunk_sliced, fn, self.inner, axis, block_size, params))
        return x.map_blocks(per_chunk, *others, dtype=dtype, meta=meta_from_array(x, x.ndim, dtype))

    def within(self, a, lo, hi, message):
        check = functools.partial(_on_chunk, lambda b, c: b.within(c, lo, hi, message), self.inner, ())
        return a.map_blocks(check, dtype=a.dtype, meta=meta_from_array(a, a.ndim, a.dtype))

    def map_rows(self, fn, x, ratio, dtype):
        x = da.asarray(x)
        x = x.rechunk({x.ndim - 1: -1})  # whole rows: the blocks run along the last axis
        inner = self._chunks_backend()
        chunks = x.chunks[:-1] + ((round(x.shape[-1] * ratio),),)
        return x.map_blocks(functools.partial(inner.map_rows, fn, ratio=ratio, dtype=dtype), dtype=dtype,
                            chunks=chunks, meta=meta_from_array(x, x.ndim, dtype))

    def dequantize_blocks(self, raw, fmt, dtype, g=None):
        inner = self._chunks_backend()
        raw = self.aligned(da.asarray(raw), raw.ndim - 1, fmt.nbytes)  # whole blocks in each chunk
        chunks = raw.chunks[:-1] + (tuple(c // fmt.nbytes * fmt.block for c in raw.chunks[-1]),)
        return raw.map_blocks(functools.partial(inner.dequantize_blocks, fmt=fmt, dtype=dtype, g=g), dtype=dtype,
                              chunks=chunks, meta=meta_from_array(raw, raw.ndim, dtype))

    def block_linear(self, x, raw, fmt, g=None, columns=None, bias=None, packed=None):  # (None: Dask packs nothing)
        """The chunks' backend's on each chunk of rows of ``x`` (whole rows), with all the weights."""
        inner = self._chunks_backend()
        return self._over_rows(lambda c, r: inner.block_linear(c, r, fmt, g, columns, bias), x, raw)

    def block_linear_q8(self, xraw, raw, fmt, bias=None, packed=None, act="Q8_0"):  # (None: Dask packs nothing)
        inner = self._chunks_backend()
        return self._over_rows(lambda c, r: inner.block_linear_q8(c, r, fmt, bias, act=act), xraw, raw)

    @staticmethod
    def _over_rows(fn, x, raw):
        """``fn(rows of x, raw)`` (float32 ``(rows, N)``) on each chunk of rows of ``x``; ``raw`` one chunk."""
        x = da.asarray(x).rechunk({1: -1})
        raw = da.asarray(raw).rechunk(-1)
        return da.blockwise(fn, "mn", x, "mk", raw, "nb", concatenate=True, dtype=np.float32,
                            adjust_chunks={"n": raw.shape[0]}, meta=meta_from_array(x, 2, np.float32))

    # -- the primitives: the inner backend's, chunk by chunk ----------------
    # quantize's NaN error is raised at compute(): a chunk backend that reports it
    # late (CuPy) is asked in the chunk's own task and thread (a flag read a chunk)
    def quantize(self, x, qp, out=None):
        self._no_out(out)
        return self.map_chunks(lambda b, c, s, z: _checked(b, b.quantize(c, _chunk_quant(qp, s, z))),
                               x, qp.axis, qp.block_size, (qp.scale, qp.zero_point), qp.qd.storage)

    def quantize_stochastic(self, x, qp, key, index=None):
        # each chunk with its elements' flat indices in the whole array: the sum of
        # per-axis ranges times the strides, chunked as x is (made lazily, chunk by chunk)
        x = da.asarray(x)
        return self.map_chunks(
            lambda b, c, i, s, z: _checked(b, b.quantize_stochastic(c, _chunk_quant(qp, s, z), key, i)),
            x, qp.axis, qp.block_size, (qp.scale, qp.zero_point), qp.qd.storage,
            _flat_index(x) if index is None else index)

    def fake_quantize(self, x, qp, dtype, mask=False, key=None, index=None, out=None):
        # one task a chunk for the values; the mask (on request) is a second one,
        # which runs the chunk's fused kernel again: dask's blocks have one output
        self._no_out(out)
        x = da.asarray(x)
        if key is not None and index is None:
            index = _flat_index(x)

        def part(i):  # chunk, then its indices (stochastic rounding), then scale and zero point
            def fn(b, c, *rest):
                ix, (s, z) = (rest[0], rest[1:]) if key is not None else (None, rest)
                return _checked(b, b.fake_quantize(c, _chunk_quant(qp, s, z), dtype, i == 1, key, ix)[i])
            return fn

        others = () if key is None else (index,)
        params = (qp.scale, qp.zero_point)
        values = self.map_chunks(part(0), x, qp.axis, qp.block_size, params, np.dtype(dtype), *others)
        return values, (self.map_chunks(part(1), x, qp.axis, qp.block_size, params, np.dtype(bool), *others)
                        if mask else None)

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        return self.map_chunks(lambda b, c, s, z: b.dequantize(c, s, z, axis, block_size, dtype),
                               q, axis, block_size, (scale, zero_point), np.dtype(dtype))

    def quantize_float(self, x, scale, qd, axis, block_size, saturate, *, mx=False, multiply=False):
        bits = self.float_storage(qd)
        return self.map_chunks(lambda b, c, s: _checked(b, b.quantize_float(c, s, qd, axis, block_size, saturate,
                                                                            mx=mx, multiply=multiply).view(bits)),
                               x, axis, block_size, (scale,), bits)

    def dequantize_float(self, q, scale, qd, axis, block_size, dtype):
        return self.map_chunks(lambda b, c, s: b.dequantize_float(c, s, qd, axis, block_size, dtype),
                               q, axis, block_size, (scale,), np.dtype(dtype))

    def requantize(self, q, rq, out=None):
        self._no_out(out)

        def fn(b, c, *params):
            return b.requantize(c, dataclasses.replace(rq, **dict(zip(_REQUANT_FIELDS, params))))

        return self.map_chunks(fn, q, rq.axis, rq.block_size, rq.params, rq.out_dtype)

    def requantize_stochastic(self, q, rq, key, index=None):
        def fn(b, c, i, *params):
            return b.requantize_stochastic(c, dataclasses.replace(rq, **dict(zip(_REQUANT_FIELDS, params))), key, i)

        q = da.asarray(q)
        return self.map_chunks(fn, q, rq.axis, rq.block_size, rq.params, rq.out_dtype,
                               _flat_index(q) if index is None else index)

    def lut(self, q, table, axis=None):
        return self.map_chunks(lambda b, c, t: b.lut(c, b.param(t), axis), q, axis, None, (table,), table.dtype)

    def softmax(self, x, sm, out=None):
        self._no_out(out)
        x = x.rechunk({1: -1})  # whole rows in each chunk
        return self.map_chunks(lambda b, c: b.softmax(c, sm), x, None, None, (), sm.out_dtype)

    def minmax(self, x, axis, block_size):
        """Computed (host arrays: every caller needs the values), in one pass over
        the data: per block, the inner backend's minmax of each chunk."""
        import dask

        if block_size is None:  # dask's reductions, in a tree
            return tuple(to_host(v) for v in dask.compute(*super().minmax(x, axis, block_size)))
        x = self.aligned(x, axis, block_size)
        chunks = tuple(tuple(-(-c // block_size) for c in cs) if i == axis else cs for i, cs in enumerate(x.chunks))
        both = x.map_blocks(functools.partial(_chunk_minmax, self.inner, axis, block_size), chunks=((2,),) + chunks,
                            new_axis=0, dtype=x.dtype, meta=meta_from_array(x, x.ndim + 1))
        both = to_host(both.compute())
        return both[0], both[1]

    # -- integer matmul: row chunks, K split into exact int64 partial sums ----
    def pack_weight(self, codes, qd, keep=False):
        if codes.ndim != 2:
            raise TypeError(f"matmul/linear with Dask data takes 2-D weights (K, N), got shape {codes.shape}")
        if isinstance(codes, da.Array):  # weights read lazily (from_zarr): read once here, as packing reads them all
            codes = codes.compute()
        inner = self._chunks_backend()
        return DaskWeight(inner, inner.asarray(codes), qd, keep)

    def int_matmul(self, a, pw, gp, out=None):
        """The inner backend's ``int_matmul`` on each chunk of rows. Where K is split
        across chunks, each K chunk gives the exact int64 partial sum of
        ``(a - za) * (w - zw)`` over its K (the zero-point terms are sums over K
        too), the partials add up in a tree, then the bias and one requantize."""
        self._no_out(out)
        a = da.asarray(a)
        n = pw.codes.shape[-1]
        out_chunks = a.chunks[:-1] + ((n,),)
        ks = np.cumsum((0,) + a.chunks[-1])

        def product(k, gp_):
            part = a[..., ks[k]:ks[k + 1]]
            weights = dask.delayed(pw.part(ks[k], ks[k + 1]))  # one node of the graph, sent once to each worker
            fn = functools.partial(_chunk_matmul, self.inner, gp_)
            out = gp_.rq.out_dtype if gp_.rq is not None else np.dtype(gp_.acc_dtype)
            return part.map_blocks(fn, weights, chunks=out_chunks, dtype=out, meta=meta_from_array(a, a.ndim, out))

        if len(ks) == 2:  # K whole in every chunk: one fused call per chunk of rows
            return product(0, gp)
        sums = dataclasses.replace(gp, bias=None, rq=None, acc_dtype=np.int64)
        parts = da.stack([product(k, sums) for k in range(len(ks) - 1)])
        acc = parts.sum(axis=0, dtype=np.int64)  # exact int64 sums, in dask's tree
        acc = acc if gp.bias is None else acc + self.param(to_host(gp.bias).astype(np.int64))
        return acc.astype(gp.acc_dtype) if gp.rq is None else self.requantize(acc, gp.rq)

    # -- whole ops over chunks of samples ------------------------------------
    def over_batches(self, op, x, *args, **kwargs):
        """``op(x, *args, **kwargs)`` (an op on NCHW samples: conv2d, pooling) run on
        each chunk of ``x``'s first axis, the other axes whole in each chunk; other
        Dask QArrays among the arguments (a conv weight) are read once, whole. The
        output's parameters and sample shape come from ``op`` on zero samples."""
        QArray = type(x)  # (the backends sit below the QArray class: they take it from its objects)
        args = tuple(a.compute() if isinstance(a, QArray) and a._backend is self else a for a in args)
        data = x.data.rechunk({i: -1 for i in range(1, x.ndim)})
        like = QArray._new(self._chunks_backend().xp.zeros((0,) + x.shape[1:], data.dtype), x.scale, x.zero_point,
                           x.dtype, x.axis, x.block_size)
        probe = op(like, *args, **kwargs)
        out = data.map_blocks(functools.partial(_on_batch, op, like, args, kwargs), chunks=(data.chunks[0],) + probe.shape[1:],
                              dtype=probe.data.dtype, meta=probe.data)
        return QArray._new(out, probe.scale, probe.zero_point, probe.dtype, probe.axis, probe.block_size, self,
                           probe.global_scale)


def _chunk_quant(qp, scale, zero_point):
    """A chunk's ``Quant``: ``qp`` with the chunk's slices of its parameters."""
    return dataclasses.replace(qp, scale=scale, zero_point=zero_point)


def _checked(backend, result):
    """``result``, once ``backend`` has raised any NaN error it reports late."""
    backend.check_nan()
    return result
