"""The QArray class: integer storage plus the parameters that give it meaning."""

from __future__ import annotations

import math
import operator

import numpy as np

from . import backends as _backends
from . import _protocols
from ._dtypes import qdtype
from ._formats import pack6
from ._params import check_params, check_scale, normalize_axis, to_host

_FLOATS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


_FLOAT_TYPES = {**{t: t for t in _FLOATS.values()}, **{np.dtype(t): t for t in _FLOATS.values()}, **_FLOATS}


def float_dtype(dtype):
    """NumPy float16/32/64 from any spelling; TypeError for anything else."""
    try:
        t = _FLOAT_TYPES.get(dtype)  # the usual spellings, without making a dtype
        if t is not None:
            return t
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d.name not in _FLOATS:
        raise TypeError(f"dequantize gives float16, float32 or float64, not {dtype!r}")
    return d.type


# qarray._api's dequantize and requantize, which register themselves here for
# the methods of those names (the same layer: an import in each call cost 0.4 us)
API: dict = {}


class QArray:
    """A quantized array: ``real = (data - zero_point) * scale``.

    Make one with :func:`qarray.quantize`, :func:`qarray.quantize_dynamic` or
    :meth:`QArray.from_int`.

    >>> q = qarray.quantize(numpy.array([0.5, -1.0], numpy.float32), 0.01, 0, "qint8")
    >>> q.int_repr()
    array([  50, -100], dtype=int8)
    """

    __slots__ = ("_data", "_scale", "_zero_point", "_axis", "_block_size", "_dtype", "_backend", "_global_scale",
                 "_columns")

    def __new__(cls, *args, **kwargs):
        raise TypeError(
            "QArray cannot be constructed directly; use qarray.quantize(x, scale, zero_point, dtype) "
            "for float data or QArray.from_int(ints, scale, zero_point, dtype) for integers"
        )

    @classmethod
    def _new(cls, data, scale, zero_point, dtype, axis=None, block_size=None, backend=None, global_scale=None,
             columns=None):
        self = object.__new__(cls)
        self._global_scale = global_scale  # NVFP4's float32 tensor scale over the block scales, or None
        self._columns = columns  # a block format's column order (GPTQ's act-order), or None: see ``columns``
        self._backend = backend if backend is not None else _backends.for_array(data)
        self._data = data
        self._scale = to_host(scale)  # host metadata whatever the data's device (a no-op for NumPy)
        self._zero_point = to_host(zero_point)
        self._dtype = dtype
        self._axis = axis
        self._block_size = block_size
        return self

    @classmethod
    def _blocks(cls, raw, dtype, backend=None, columns=None, global_scale=None):
        """A QArray of a block format (``dtype.kind == "block"``: GGUF's Q4_K and the like) holding
        ``raw``, the format's bytes: shape ``(..., n // block * nbytes)`` for ``n`` values along the
        last axis. Its scale, offset and codes are read from those bytes (qarray._blocks). ``columns``
        and ``global_scale`` (a float32 0-d tensor scale, for a format whose blocks' scales it divides or
        multiplies: NVFP4 in compressed-tensors and ModelOpt checkpoints): see the properties."""
        self = object.__new__(cls)
        self._backend = backend if backend is not None else _backends.for_array(raw)
        self._data, self._dtype, self._global_scale, self._columns = raw, dtype, global_scale, columns
        if (dtype.layout.tensor_scale is None) != (global_scale is None):
            raise ValueError(f"{dtype.name} " + ("takes no tensor scale" if global_scale is not None else
                                                 "needs its tensor scale (global_scale)"))
        self._scale = self._zero_point = None
        self._axis, self._block_size = raw.ndim - 1, dtype.layout.block
        return self

    @classmethod
    def from_blocks(cls, raw, dtype, global_scale=None) -> "QArray":
        """Wrap the bytes of a block format (``"Q4_K"``, GGUF's types), as a GGUF file or ggml
        holds them: uint8, shape ``(..., row_bytes)`` with ``row_bytes`` a multiple of the format's
        block bytes. Nothing is copied. ``global_scale``: the tensor's scale of a format that has one
        (``e2m1_g16_e4m3_gdiv``: NVFP4 as compressed-tensors stores it), a positive finite number.

        >>> raw = qarray.quantize(numpy.ones((2, 32), numpy.float32), dtype="Q8_0").data
        >>> QArray.from_blocks(raw, "q8_0").dequantize()[0, :4]
        array([1., 1., 1., 1.], dtype=float32)
        """
        d = qdtype(dtype)
        if d.kind != "block":
            raise TypeError(f"from_blocks takes a block format (Q4_0, Q4_K, ...), not {d.name}; use from_int")
        raw, b = _backends.user_array(raw, "from_blocks")
        if raw.dtype != np.uint8 or raw.ndim < 1:
            raise TypeError(f"from_blocks takes uint8 bytes of at least one dimension, got {raw.dtype} of shape "
                            f"{raw.shape}")
        if raw.shape[-1] % d.layout.nbytes:
            raise ValueError(f"from_blocks: a row of {raw.shape[-1]} bytes is not a whole number of {d.name} blocks "
                             f"({d.layout.nbytes} bytes each)")
        if global_scale is not None:
            global_scale = check_scale(global_scale)
        return cls._blocks(raw, d, b, None, global_scale)

    @classmethod
    def from_int(cls, ints, scale, zero_point=0, dtype="qint8", axis=None, block_size=None, *,
                 global_scale=None) -> "QArray":
        """Wrap integers already quantized. Values outside ``dtype``'s range raise.
        Floating-format codes come as their ml_dtypes array or uint8 bit patterns;
        ``global_scale`` (one float32 number, floating formats only) is NVFP4's
        tensor scale over the block scales.

        >>> QArray.from_int(numpy.array([1, -2]), 0.5, 0, "qint4").dequantize()
        array([ 0.5, -1. ], dtype=float32)
        """
        d = qdtype(dtype)
        ints, b = _backends.user_array(ints, "from_int")
        if global_scale is not None:
            if d.kind != "float":
                raise TypeError(f"from_int: global_scale= is for floating formats (NVFP4); {d.name} is an integer format")
            if np.shape(to_host(global_scale)) != ():
                raise ValueError(f"from_int: global_scale must be one number, got shape {np.shape(to_host(global_scale))}")
            global_scale = check_scale(global_scale)
        if d.kind == "float":
            return cls._from_codes(ints, b, scale, zero_point, d, axis, block_size, global_scale)
        if ints.dtype.kind not in "iu":
            raise TypeError(
                f"from_int takes integer data, got dtype {ints.dtype}; use qarray.quantize for floats"
            )
        s, z, axis, block_size = check_params(scale, zero_point, d, ints.shape, axis, block_size)
        if ints.size:
            lo, hi = (int(v) for v in b.to_host(b.xp.stack([ints.min(), ints.max()])))
            if lo < d.qmin or hi > d.qmax:
                raise ValueError(
                    f"from_int: values span [{lo}, {hi}], outside the range "
                    f"[{d.qmin}, {d.qmax}] of {d.name}"
                )
        return cls._new(ints.astype(d.storage), s, z, d, axis, block_size, b)

    # -- attributes -------------------------------------------------------
    data = property(lambda self: self._data, doc="The integer storage array.")
    @classmethod
    def _from_codes(cls, codes, b, scale, zero_point, d, axis, block_size, global_scale=None):
        """``from_int`` for a floating format: codes as its ml_dtypes array, or
        their bit patterns as uint8 (bits above the format's width must be 0)."""
        if codes.dtype == np.uint8:
            if codes.size and int(b.to_host(codes.max())) >> d.bits:
                raise ValueError(f"from_int: {d.name} has {d.bits}-bit patterns; a uint8 code above "
                                 f"{(1 << d.bits) - 1} is none of them")
            codes = codes.copy().view(b.float_storage(d))
        elif codes.dtype == d.storage:
            codes = b.asarray(codes.view(np.uint8)).view(b.float_storage(d))
        else:
            raise TypeError(f"from_int: {d.name} codes come as an ml_dtypes {d.storage} array or as uint8 bit "
                            f"patterns, got {codes.dtype}")
        s, z, axis, block_size = check_params(scale, zero_point, d, codes.shape, axis, block_size)
        return cls._new(codes, s, z, d, axis, block_size, b, global_scale)

    scale = property(lambda self: self._scale if self._scale is not None or self._dtype.kind != "block" else
                     self._block_params("scale"),
                     doc="float32 scale: 0-d, (shape[axis],) or blocked; a floating format keeps a float16, "
                     "bfloat16 or 8-bit (MX's E8M0, NVFP4's E4M3) scale dtype; a block format's (Q4_K) is "
                     "read from its bytes: one float32 per sub-block along the last axis.")
    offset = property(lambda self: self._block_params("offset") if self._dtype.kind == "block" else None,
                      doc="A block format's float32 offset per sub-block (``scale * value + offset``: Q4_1's "
                          "``m``, the K-quants' ``-dmin * m``), else None.")
    fields = property(lambda self: self._block_params("fields"),
                      doc="A block format's fields as its blocks hold them, each ``(..., blocks, count)``: "
                          "``d``, ``scales``, ``q``, ... (qarray._ggml names them as ggml does).")
    columns = property(lambda self: self._columns,
                       doc="A block format's column order, or None where the columns are in order: int64 "
                           "``(shape[-1],)``, the column of the values each stored column holds. GPTQ's act-order "
                           "(``g_idx``) groups columns that are not neighbours; they are stored group by group, and "
                           "``dequantize`` puts them back.")
    global_scale = property(lambda self: self._global_scale,
                            doc="A float32 0-d scale over the block scales (NVFP4's tensor scale), or None.")
    zero_point = property(lambda self: self._zero_point if self._dtype.kind != "block" else
                          self._block_params("zero_point"),
                          doc="int32 zero point, shaped like scale; a block format's integer zero point per "
                              "group (GPTQ's, AWQ's), read from its bytes, or None where it has none.")
    axis = property(lambda self: self._axis, doc="Parameter axis, or None for per-tensor.")
    block_size = property(lambda self: self._block_size, doc="Block length along axis, or None.")
    dtype = property(lambda self: self._dtype, doc="The QDType.")
    shape = property(lambda self: tuple(self._data.shape) if self._dtype.kind != "block" else self._block_shape())
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: int(self._data.size) if self._dtype.kind != "block" else math.prod(self.shape))

    def _block_shape(self):
        f, s = self._dtype.layout, self._data.shape
        return (*s[:-1], s[-1] // f.nbytes * f.block)

    def _block_params(self, what):
        """A block format's ``fields``, ``scale`` or ``offset``, read from its bytes on the host."""
        f = self._dtype.layout
        if f is None:
            raise AttributeError(f"{self._dtype.name} is not a block format: fields are for Q4_K and the like")
        raw = self._backend.to_host(self._data)
        lead = raw.shape[:-1]
        fields = f.unpack(np.ascontiguousarray(raw).reshape(-1, f.nbytes))
        if what == "fields":
            return {k: v.reshape(*lead, -1, v.shape[-1]) for k, v in fields.items()}
        if what == "zero_point":
            p = None if f.zero is None else fields[f.zero].astype(np.int32)
        else:
            p = f.scales(fields) if what == "scale" else f.offsets(fields)
        return None if p is None else p.reshape(*lead, -1)
    backend = property(lambda self: self._backend.name, doc="Name of the backend holding the data.")

    @property
    def qscheme(self) -> str:
        """``per_tensor_affine``, ``per_channel_affine`` or ``per_block_affine``."""
        if self._axis is None:
            return "per_tensor_affine"
        return "per_channel_affine" if self._block_size is None else "per_block_affine"

    def _with(self, data, scale=None, zero_point=None, axis=None, block_size=None):
        return QArray._new(
            data,
            self._scale if scale is None else scale,
            self._zero_point if zero_point is None else zero_point,
            self._dtype,
            axis,
            block_size,
            self._backend,
            self._global_scale,
        )

    # -- conversions --------------------------------------------------------
    def dequantize(self, dtype="float32"):
        """Real values ``(data - zero_point) * scale`` as float16/32/64."""
        return API["dequantize"](self, dtype)

    def requantize(self, scale, zero_point=0, dtype=None, axis=None, block_size=None, mode=None, rounding=None,
                   seed=None):
        """Same values at new parameters (see :func:`qarray.requantize`)."""
        return API["requantize"](self, scale, zero_point, dtype, axis, block_size, mode=mode, rounding=rounding,
                                 seed=seed)

    def int_repr(self):
        """A copy of the integer storage (one value per element, also for 2/4 bits);
        for a floating format, the elements' bit patterns as uint8; for mxint8, whose
        elements are two's-complement int8 (OCP MX), those int8."""
        if self._dtype.kind == "block":  # the codes "q", one per element
            q = self._block_params("fields").get("q")
            if q is None:
                raise TypeError(f"{self._dtype.name}'s codes index vectors of its codebook, not one value each: "
                                "q.fields has them as the blocks hold them")
            return self._backend.asarray(q.reshape(self.shape))
        want = np.dtype(np.int8) if self._dtype.name == "mxint8" else self._dtype.bits_dtype
        if self._data.dtype != want:  # (dask cannot view a 0-d array)
            return self._data.view(want).copy()
        return self._data.copy()

    def pack(self):
        """The flattened values in ONNX/PyTorch byte layout (uint8, first value in the
        low bits); 8 bits and wider come back as a copy of the storage. Floating
        formats give their bit patterns: float8 one a byte, float4 two a byte,
        float6 four in three bytes (torchao's MXFP6 layout, ``qarray._formats.pack6``)."""
        d = self._dtype
        if d.kind == "block":  # the format's own bytes
            return self._backend.xp.ascontiguousarray(self._data).reshape(-1).copy()
        codes = self._backend.xp.ascontiguousarray(self._data).reshape(-1)
        if codes.dtype != d.bits_dtype:
            codes = codes.view(d.bits_dtype)
        if d.bits == 6:  # float6: four in three bytes, torchao's MXFP6 layout
            return pack6(codes)
        return self._backend.pack(codes, d.bits) if d.packed else codes.copy()

    def to(self, backend: str) -> "QArray":
        """The same QArray on another backend ("numpy", "cupy", or "dask": one chunk
        of NumPy storage, which dask.array can rechunk)."""
        b = _backends.get(backend)
        if b is self._backend:
            return self

        def move(a):
            if self._dtype.kind == "float":  # bit patterns move; each backend views them its way
                return b.asarray(self._backend.to_host(a.view(np.uint8)).view(b.float_storage(self._dtype)))
            return b.asarray(self._backend.to_host(a))

        return QArray._new(move(self._data), self._scale, self._zero_point,
                           self._dtype, self._axis, self._block_size, b, self._global_scale, self._columns)

    def get(self) -> "QArray":
        """The same QArray with NumPy storage (a copy from the device for CuPy)."""
        return self.to("numpy")

    # -- Dask: a QArray whose data is a dask array is a Dask collection ------------
    def compute(self, **kwargs) -> "QArray":
        """The QArray with its dask data computed (NumPy or CuPy storage, as its
        chunks'): ``dask.compute(q)``;
        an in-memory QArray comes back as it is."""
        if self.__dask_graph__() is None:
            return self
        import dask

        return dask.compute(self, **kwargs)[0]

    def persist(self, **kwargs) -> "QArray":
        """The QArray with its dask data computed and kept in the cluster's memory
        (still dask-backed): ``dask.persist(q)``; an in-memory QArray as it is."""
        if self.__dask_graph__() is None:
            return self
        import dask

        return dask.persist(self, **kwargs)[0]

    def __dask_graph__(self):
        graph = getattr(self._data, "__dask_graph__", None)
        return graph() if graph is not None else None

    def __dask_keys__(self):
        return self._data.__dask_keys__()

    def __dask_layers__(self):
        return self._data.__dask_layers__()

    def __dask_tokenize__(self):
        from dask.base import tokenize

        return tokenize(self._data, self._scale, self._zero_point, self._dtype.name, self._axis, self._block_size,
                        self._global_scale, self._columns)

    __dask_optimize__ = property(lambda self: self._data.__dask_optimize__)
    __dask_scheduler__ = property(lambda self: self._data.__dask_scheduler__)

    def _params(self):
        return self._scale, self._zero_point, self._dtype, self._axis, self._block_size, self._global_scale, \
            self._columns

    def __dask_postcompute__(self):
        finish, args = self._data.__dask_postcompute__()
        return _computed, (finish, args, self._params())

    def __dask_postpersist__(self):
        rebuild, args = self._data.__dask_postpersist__()
        return _persisted, (rebuild, args, self._params(), self._backend)

    # -- ndarray-style methods (NumPy's protocols: qarray/_protocols.py) ------------
    nbytes = property(lambda self: int(self._data.nbytes), doc="Bytes of the codes as stored (one a byte below 8 bits).")

    def copy(self) -> "QArray":
        """A QArray with its own copy of the codes and parameters."""
        if self._dtype.kind == "block":
            return QArray._blocks(self._data.copy(), self._dtype, self._backend, self._columns,
                              self._global_scale)
        return QArray._new(self._data.copy(), self._scale.copy(), self._zero_point.copy(), self._dtype,
                           self._axis, self._block_size, self._backend, self._global_scale)

    def astype(self, dtype) -> "QArray":
        """The dequantized values as float16/32/64 (``dequantize(dtype)``). Another
        quantized or integer dtype needs parameters: TypeError pointing to
        ``requantize`` and ``int_repr``."""
        try:
            float_dtype(dtype)
        except TypeError:
            raise TypeError(
                f"astype({dtype!r}): a QArray converts to float16/32/64 (its dequantized values); for another "
                "quantized dtype use q.requantize(scale, zero_point, dtype), for the integer codes q.int_repr()"
            ) from None
        return self.dequantize(dtype)

    def to_torch(self):
        """A PyTorch quantized tensor with the same integers and parameters (``qarray.interop``)."""
        from .interop import to_torch

        return to_torch(self)

    def tolist(self):
        """The dequantized values as nested Python floats (``numpy.ndarray.tolist``)."""
        return self._backend.to_host(self.dequantize()).tolist()

    def item(self) -> float:
        """The one dequantized value of a size-1 QArray, as a Python float."""
        return float(self)

    def ravel(self) -> "QArray":
        return self.reshape(-1)

    def flatten(self) -> "QArray":
        return self.reshape(-1).copy()

    def squeeze(self, axis=None) -> "QArray":
        return _protocols.squeeze(self, axis)

    def __reduce__(self):
        return (_rebuild, (self._data, self._scale, self._zero_point, self._dtype.name,
                           self._axis, self._block_size, self._global_scale, self._columns))

    # -- shape --------------------------------------------------------------
    def __len__(self):
        if self.ndim == 0:  # also what torch.as_tensor(q) meets: it walks a QArray as a sequence
            raise TypeError("len() of a 0-d QArray; for its value use float(q) or q.item(), and for an array or "
                            "tensor convert the dequantized values: torch.as_tensor(q.dequantize()), or "
                            "q.to_torch() for a PyTorch quantized tensor")
        return self.shape[0]

    def __iter__(self):
        """The QArrays along axis 0; a 0-d QArray is not iterable (as NumPy's), so
        code that asks ``iter(x)`` (matplotlib) sees a scalar."""
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d QArray")
        return (self[i] for i in range(self.shape[0]))

    def reshape(self, *shape) -> "QArray":
        """Reshape; per-axis and blocked parameters need their axis kept whole.

        The axis is kept when the new shape has a dimension of the same length
        whose preceding dimensions hold the same number of elements.
        """
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        if self._dtype.kind == "block":
            return self._block_reshape(shape)
        data = self._data.reshape(shape)
        if self._axis is None:
            return self._with(data)
        old, new, k = self.shape, data.shape, self._axis
        before = math.prod(old[:k])
        for j in range(len(new)):
            if math.prod(new[:j]) == before and new[j] == old[k]:
                break
        else:
            raise ValueError(
                f"cannot reshape {old} to {new}: the parameter axis {k} (length {old[k]}) "
                "would not stay a whole dimension; dequantize or requantize per-tensor first"
            )
        scale, zp = self._scale, self._zero_point
        if self._block_size is not None:
            pshape = new[:j] + (scale.shape[k],) + new[j + 1 :]
            scale, zp = scale.reshape(pshape), zp.reshape(pshape)
        return self._with(data, scale, zp, j, self._block_size)

    def _block_reshape(self, shape):
        """A block format's reshape: the last axis, whose blocks the bytes hold, stays as it is."""
        n = self.shape[-1]
        shape = tuple(operator.index(k) for k in shape)
        if len(shape) and shape[-1] == -1 and shape.count(-1) == 1 and math.prod(shape[:-1]) and \
                self.size // math.prod(shape[:-1]) == n:
            shape = shape[:-1] + (n,)
        if not shape or shape[-1] != n:
            raise ValueError(f"cannot reshape {self.shape} to {shape}: {self._dtype.name} keeps its blocks along "
                             f"the last axis (length {n}), which must stay the last dimension; dequantize first")
        raw = self._data.reshape(shape[:-1] + (self._data.shape[-1],))
        return QArray._blocks(raw, self._dtype, self._backend, self._columns,
                              self._global_scale)

    def transpose(self, *axes) -> "QArray":
        """Permute dimensions (reversed when no axes are given); parameters follow."""
        if len(axes) == 1 and not isinstance(axes[0], int):
            axes = tuple(axes[0])
        axes = tuple(normalize_axis(a, self.ndim) for a in axes) if axes else tuple(range(self.ndim))[::-1]
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"transpose axes {axes} are not a permutation of {self.ndim} dimensions")
        if self._dtype.kind == "block":
            if self.ndim and axes[-1] != self.ndim - 1:
                raise ValueError(f"transpose {axes}: {self._dtype.name} keeps its blocks along the last axis, "
                                 "which must stay last; dequantize first")
            return QArray._blocks(self._data.transpose(axes), self._dtype, self._backend, self._columns,
                              self._global_scale)
        data = self._data.transpose(axes)
        if self._axis is None:
            return self._with(data)
        scale, zp = self._scale, self._zero_point
        if self._block_size is not None:
            scale, zp = scale.transpose(axes), zp.transpose(axes)
        return self._with(data, scale, zp, axes.index(self._axis), self._block_size)

    T = property(lambda self: self.transpose(), doc="Dimensions reversed.")

    def __getitem__(self, key) -> "QArray":
        """Basic indexing (ints, slices, ``...``, ``None``); parameters follow the slice.

        An integer index along a per-axis parameter axis leaves a per-tensor
        result; along a blocked axis, blocks must not be cut by a slice.
        """
        key = key if isinstance(key, tuple) else (key,)
        for c in key:
            if not (c is None or c is Ellipsis or isinstance(c, slice) or _is_int(c)):
                raise TypeError(
                    f"QArray supports basic indexing only (ints, slices, ..., None), got {type(c).__name__}"
                )
        used = sum(1 for c in key if c is not None and c is not Ellipsis)
        if used > self.ndim:
            raise IndexError(f"too many indices for a QArray of {self.ndim} dimension(s)")
        if sum(1 for c in key if c is Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        fill = (slice(None),) * (self.ndim - used)
        if Ellipsis in key:
            i = next(i for i, c in enumerate(key) if c is Ellipsis)
            key = key[:i] + fill + key[i + 1 :]
        else:
            key = key + fill
        if self._dtype.kind == "block":
            return self._block_item(key)
        data = self._data[key]
        if self._axis is None:
            return self._with(data)
        in_dim = out_dim = 0
        for pos, c in enumerate(key):
            if c is None:
                out_dim += 1
                continue
            if in_dim == self._axis:
                axis_pos, new_axis = pos, (out_dim if isinstance(c, slice) else None)
            out_dim += isinstance(c, slice)
            in_dim += 1
        c = key[axis_pos]
        n, B = self.shape[self._axis], self._block_size
        if B is None:
            pkey = c
        elif _is_int(c):
            pkey = operator.index(c) % n // B
        else:
            start, stop, step = c.indices(n)
            if B > 1 and stop > start and (step != 1 or start % B or (stop % B and stop != n)):
                raise ValueError(
                    f"the slice {start}:{stop}:{step} cuts the blocks of size {B} along axis "
                    f"{self._axis}; slice at multiples of {B} with step 1"
                )
            pkey = slice(start // B, max(start // B, -(-stop // B))) if B > 1 else c
        if B is None:
            scale, zp = self._scale[pkey], self._zero_point[pkey]
            block = None
        else:
            full = key[:axis_pos] + (pkey,) + key[axis_pos + 1 :]
            scale, zp = self._scale[full], self._zero_point[full]
            block = B
            if new_axis is None and data.ndim:  # scale now has data's shape: blocks of 1
                new_axis, block = 0, 1
        return self._with(data, scale, zp, new_axis, block if new_axis is not None else None)

    def _block_item(self, key):
        """A block format's basic indexing: any index on the leading axes; on the last, a slice of
        whole blocks (step 1), which the bytes' row is cut at."""
        last = max(i for i, c in enumerate(key) if c is not None)
        c, n, f = key[last], self.shape[-1], self._dtype.layout
        if any(k is None for k in key[last:]) or not isinstance(c, slice):
            raise IndexError(f"{self._dtype.name} keeps its values in blocks of {f.block} along the last axis: "
                             "index it with a slice of whole blocks (or dequantize first)")
        start, stop, step = c.indices(n)
        stop = max(start, stop)
        if step != 1 or start % f.block or stop % f.block:
            raise ValueError(f"the slice {start}:{stop}:{step} cuts the blocks of {f.block} values of "
                             f"{self._dtype.name} along the last axis; slice at multiples of {f.block} with step 1")
        if self._columns is not None and (start, stop) != (0, n):
            raise IndexError(f"the columns of this {self._dtype.name} QArray are stored out of order (GPTQ's "
                             "act-order, q.columns): its blocks are not column ranges; dequantize first")
        cut = slice(start // f.block * f.nbytes, stop // f.block * f.nbytes)
        return QArray._blocks(self._data[key[:last] + (cut,)], self._dtype, self._backend, self._columns,
                              self._global_scale)

    def _shown(self):
        """``(values, summarise)``: the dequantized values NumPy's printing shows.

        Below the print threshold, all of them. Above it NumPy shows ``edgeitems``
        from each end of every longer axis: only those are dequantized, plus one
        middle item per such axis (never printed) so the axis stays longer than
        ``2 * edgeitems`` and still gets its "...". Printed with summarising on,
        that array gives NumPy's text for the whole one.
        """
        opts = np.get_printoptions()
        e = opts["edgeitems"]
        if self.size <= opts["threshold"] or e < 1:
            return self._backend.to_host(self.dequantize()), False
        if self._columns is not None:  # act-order: the first axis's edge rows, every column (blocks are not
            k = self.shape[0]                # column ranges), then NumPy's edges of the other axes
            parts = [self[:e + 1], self[k - e:]] if self.ndim > 1 and k > 2 * e else [self]
            values = np.concatenate([self._backend.to_host(p.dequantize()) for p in parts])
            idx = [np.r_[0:e + 1, n - e:n] if n > 2 * e else np.arange(n) for n in values.shape]
            return values[np.ix_(*idx)], True
        if self._dtype.kind == "block":  # the edge rows, and the blocks holding each row's edge values
            B, n = self._dtype.layout.block, self.shape[-1]
            lead = tuple(np.r_[0:e + 1, k - e:k] if k > 2 * e else np.arange(k) for k in self.shape[:-1])
            cols = np.r_[0:e + 1, n - e:n] if n > 2 * e else np.arange(n)
            near = np.unique(cols // B)
            parts = [self[(..., slice(b * B, b * B + B))] for b in near]
            rows = [self._backend.to_host(p.dequantize())[np.ix_(*lead, np.arange(B))] if lead else
                    self._backend.to_host(p.dequantize()) for p in parts]
            values = np.concatenate(rows, axis=-1)
            at = {b: i for i, b in enumerate(near)}
            return values[..., [at[c // B] * B + c % B for c in cols]], True
        idx = [np.r_[0:e + 1, n - e:n] if n > 2 * e else np.arange(n) for n in self.shape]
        b = self._backend
        scale, zp, block = self._scale, self._zero_point, self._block_size
        if self._axis is not None:
            a = self._axis
            if block is None:  # per-axis: the parameters of the items taken
                scale, zp = scale[idx[a]], zp[idx[a]]
            else:  # blocked: one parameter per item taken along the axis
                pidx = np.ix_(*(i // block if k == a else i for k, i in enumerate(idx)))
                scale, zp, block = scale[pidx], zp[pidx], 1
        data = self._data[tuple(b.asarray(i) for i in np.ix_(*idx))]
        corners = QArray._new(data, scale, zp, self._dtype, self._axis, block, b, self._global_scale)
        return b.to_host(corners.dequantize()), True

    def __repr__(self):
        values, summarise = self._shown()
        head = "QArray("
        body = np.array2string(values, separator=", ", prefix=head, **({"threshold": 0} if summarise else {}))
        if self._dtype.kind == "block":
            f, pad = self._dtype.layout, " " * len(head)
            return (f"{head}{body},\n{pad}dtype={f.name}, shape={self.shape}, "
                    f"bits_per_weight={f.bits_per_weight:g}, backend={self._backend.name})")
        params = f"dtype={self._dtype.name}, scale={_show(self._backend, self._scale)}, " \
                 f"zero_point={_show(self._backend, self._zero_point)}"
        if self._axis is not None:
            params += f", axis={self._axis}"
        if self._block_size is not None:
            params += f", block_size={self._block_size}"
        if self._global_scale is not None:
            params += f", global_scale={self._global_scale[()]}"
        pad = " " * len(head)
        return f"{head}{body},\n{pad}{params},\n{pad}qscheme={self.qscheme}, backend={self._backend.name})"


def _is_int(c) -> bool:
    return not isinstance(c, bool) and isinstance(c, (int, np.integer))


def _show(backend, p) -> str:
    h = backend.to_host(p)
    if h.ndim == 0:
        return str(h[()])  # the float32 shortest repr: 0.02, not 0.019999999552965164
    if h.ndim == 1:
        return np.array2string(h, separator=", ", threshold=8)
    return f"<{h.dtype} array of shape {h.shape}>"


def _rebuild(data, scale, zero_point, dtype_name, axis, block_size, global_scale=None, columns=None):
    return QArray._new(data, scale, zero_point, qdtype(dtype_name), axis, block_size, global_scale=global_scale,
                       columns=columns)


__all__ = ["QArray"]


_protocols.install(QArray)  # the operators and NumPy's protocols, from one table


def _computed(results, finish, args, params):
    """Dask's post-compute step: the computed codes as an in-memory QArray."""
    scale, zero_point, dtype, axis, block_size, global_scale, columns = params
    data = finish(results, *args)
    if isinstance(data, np.generic):  # a 0-d result (qa.sum over every axis) computes to a NumPy scalar
        data = np.asarray(data)
    return QArray._new(data, scale, zero_point, dtype, axis, block_size, None, global_scale, columns)


def _persisted(dsk, rebuild, args, params, backend, rename=None):
    """Dask's post-persist step: the persisted codes, still a dask-backed QArray."""
    scale, zero_point, dtype, axis, block_size, global_scale, columns = params
    return QArray._new(rebuild(dsk, *args, rename=rename), scale, zero_point, dtype, axis, block_size, backend,
                       global_scale, columns)
