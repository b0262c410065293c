"""QArrays and plain arrays in a ``.safetensors`` file (the ``safetensors``
package, optional: it checks and lists a file; qarray reads the tensors' bytes,
and writes Dask, bfloat16 and float8 tensors, itself).

For a QArray NAME the tensors ``NAME`` (its codes: 8 bits and wider as
``int_repr()`` gives them, with the QArray's shape; below 8 bits packed row by
row, as ``qarray.zarr`` stores them: uint8, each row along the last axis packed
as ``QArray.pack`` packs and padded to whole bytes, a 0-d QArray as one row),
``NAME.scale`` and ``NAME.zero_point``, and the header's metadata entry NAME
holding the meta JSON of :mod:`qarray.io._schema`; a plain array is the tensor
NAME alone. A file holding QArrays says ``"format": "qarray"`` in its metadata
(where PyTorch's files say ``"pt"``). Float weights saved by other tools load
as ndarrays, ready for ``qarray.quantize``.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from .. import _formats
from .._params import is_lazy, is_small_float, to_host
from .._qarray import QArray
from ._rows import pack_rows, packed_rows, packed_rows_layout, row_group, unpack_rows
from ._schema import FORMAT, _check_name, _is_qarray_meta, _stored, block_rows, columns_of, meta_of, parse_meta, scale_bits


def save(path, arrays: dict) -> None:
    """Write ``{name: QArray, numpy.ndarray or dask array}`` (checked by ``qarray.save``)
    to the ``.safetensors`` file ``path``."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ImportError("saving .safetensors needs the safetensors package: pip install safetensors") from None
    tensors, metadata = {}, {}
    for name, q in arrays.items():
        _check_name(name)
        if type(q) is np.ndarray or is_lazy(q) and not isinstance(q, QArray):
            if q.dtype.kind not in "biuf" and not is_small_float(q.dtype):
                raise TypeError(f"save: {name!r} has dtype {q.dtype}; safetensors holds bool, integer and float "
                                "arrays (bfloat16 and float8 too)")
            parts = {name: q}
        elif isinstance(q, QArray):
            if name == "format":
                raise ValueError("save: a QArray in a .safetensors file cannot be called 'format': the file's "
                                 "metadata entry 'format' says 'qarray' (as PyTorch's files say 'pt'); rename it")
            rows = row_group(q.dtype) > 1 and q.dtype.kind != "block"
            if q.dtype.kind == "block":  # the format's bytes (version 5): they hold the parameters
                parts = {name: q.data if is_lazy(q) else to_host(q.data)}
            else:
                codes = q.int_repr() if is_lazy(q) else to_host(q.int_repr())
                if rows and is_lazy(q):  # whole bytes of codes in each chunk along a row
                    x = q.data.reshape(q.shape or (1,))
                    step = -(-x.chunksize[-1] // row_group(q.dtype)) * row_group(q.dtype) or 1
                    codes = packed_rows(q.dtype, x.rechunk({x.ndim - 1: step}))
                elif rows:
                    codes = pack_rows(q.dtype, q.data)
                parts = {name: codes, f"{name}.scale": scale_bits(q), f"{name}.zero_point": np.asarray(q.zero_point)}
            metadata[name] = json.dumps(meta_of(q, rows))
        else:
            raise TypeError(f"save: {name!r} is a {type(q).__module__}.{type(q).__qualname__}, not a QArray or numpy.ndarray")
        for key, a in parts.items():
            if key in tensors:
                raise ValueError(f"save: the tensor name {key!r} is used twice (a QArray {name!r} stores "
                                 f"{name}, {name}.scale and {name}.zero_point)")
            tensors[key] = a if is_lazy(a) else np.require(a, requirements="C")  # (0-d stays 0-d)
    if metadata:
        metadata["format"] = FORMAT  # the file's label, where PyTorch's say "pt"
    if any(is_lazy(a) or is_small_float(a.dtype) for a in tensors.values()):  # the package writes neither
        _stream_safetensors(path, tensors, metadata)
    else:
        save_file(tensors, str(path), metadata=metadata)


_ST_CODES = {"f2": "F16", "f4": "F32", "f8": "F64", "i1": "I8", "u1": "U8", "i2": "I16", "u2": "U16", "i4": "I32",
             "u4": "U32", "i8": "I64", "u8": "U64", "b1": "BOOL"}
# safetensors' codes of ml_dtypes' floating types, which checkpoints hold (bfloat16 most of all): the
# safetensors package reads BF16 into NumPy only once ml_dtypes is imported and F8 not at all, so
# qarray reads these tensors' bytes itself (st_read)
_ST_SMALL = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


def st_code(dtype) -> str:
    """safetensors' code of ``dtype``."""
    dtype = np.dtype(dtype)
    small = {v: k for k, v in _ST_SMALL.items()}
    return small[dtype.name] if dtype.name in small else _ST_CODES[f"{dtype.kind}{dtype.itemsize}"]


def st_dtype(code: str) -> np.dtype:
    """The NumPy dtype of safetensors' dtype ``code`` (ml_dtypes' for BF16 and F8);
    ValueError for a code qarray does not read (F4 and F6, packed)."""
    if code in _ST_SMALL:
        return np.dtype(getattr(_formats.ml_dtypes(), _ST_SMALL[code]))
    kinds = {v: k for k, v in _ST_CODES.items()}
    if code not in kinds:
        raise ValueError(f"safetensors dtype {code} is not one qarray reads")
    return np.dtype(kinds[code].replace("b1", "?"))


def st_read(path, key=Ellipsis) -> dict:
    """``{name: array}`` of a .safetensors file, every dtype of ``st_dtype``:
    the file checked and listed by the safetensors package, each tensor's bytes
    read from their place in it. ``key`` indexes each tensor (a slice of it
    read through a memory map), for one tensor: ``{name: (shape, dtype, read)}``
    with ``read(key)`` when ``key`` is None."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    start = 8 + size

    def reader(name, shape, dtype):
        def read(k=Ellipsis):
            if math.prod(shape) == 0:
                return np.empty(shape, dtype)[k]
            m = np.memmap(path, dtype=dtype, mode="r", offset=start + header[name]["data_offsets"][0],
                          shape=shape or (1,))
            return np.array(m[k] if shape else m.reshape(())[k])
        return read

    dtypes = {k: st_dtype(code) for k, (_, code) in found.items()}
    readers = {k: (shape, dtypes[k], reader(k, shape, dtypes[k])) for k, (shape, _) in found.items()}
    if key is None:
        return readers
    return {k: read(key) for k, (shape, dtype, read) in readers.items()}


class _StTensor:
    """A tensor of a .safetensors file, read slice by slice from its memory map
    (``st_read``'s reader), for ``dask.array.from_array``."""

    def __init__(self, path, name, shape, dtype, read):
        self.path, self.name, self.shape, self.dtype, self.read = str(path), name, tuple(shape), np.dtype(dtype), read
        self.ndim = len(self.shape)

    def __dask_tokenize__(self):  # else dask may read the whole tensor to name it
        st = os.stat(self.path)
        return self.path, st.st_size, st.st_mtime_ns, self.name, self.shape, self.dtype.str

    def __getitem__(self, key):
        return self.read(key)


def st_lazy(path) -> dict:
    """``{name: dask array}`` of a .safetensors file's tensors (every dtype of
    ``st_dtype``), each read slice by slice from its memory map as dask computes it."""
    import dask.array as da

    lazy = {name: _StTensor(path, name, shape, dtype, read) for name, (shape, dtype, read) in st_read(path, key=None).items()}
    return {name: da.from_array(t, chunks="auto", asarray=False, meta=np.empty((0,) * t.ndim, t.dtype))
            for name, t in lazy.items()}  # meta given: dask would read an empty slice, which reads it all


def _stream_safetensors(path, tensors, metadata):
    """The safetensors layout (an 8-byte header length, the JSON header, the data
    in header order) written with dask arrays computed chunk by chunk into a
    memory map of their place in the file: memory stays bounded whatever their size (NumPy arrays
    are written as they are: Dask is needed only for dask arrays)."""
    header, offset = {}, 0
    for key in sorted(tensors):
        a = tensors[key]
        n = a.dtype.itemsize * math.prod(a.shape)
        header[key] = {"dtype": st_code(a.dtype), "shape": list(a.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    for key in sorted(tensors):
        a, (start, stop) = tensors[key], header[key]["data_offsets"]
        if stop > start:
            place = _Place(str(path), a.dtype, 8 + len(text) + start, tuple(a.shape))
            if is_lazy(a):
                import dask.array as da

                da.store(a, place, lock=False)
            else:
                place[...] = a


class _Place:
    """A tensor's bytes in a file, written through a memory map opened where the
    write runs (a worker process too: a memmap itself would travel as a copy)."""

    def __init__(self, path, dtype, offset, shape):
        self.path, self.dtype, self.offset, self.shape = path, dtype, offset, shape

    def __setitem__(self, key, value):
        m = np.memmap(self.path, dtype=self.dtype, mode="r+", offset=self.offset, shape=self.shape)
        m[key] = to_host(value)  # a device chunk is written from the host
        m.flush()


def load(path) -> dict:
    """``{name: QArray or numpy.ndarray}`` of the ``.safetensors`` file ``path``."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ImportError("reading .safetensors needs the safetensors package: pip install safetensors") from None
    try:
        with safe_open(str(path), "np") as f:
            metadata = f.metadata() or {}
        tensors = st_read(path)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    out = {}
    for name, text in metadata.items():
        if not _is_qarray_meta(text):
            continue  # other tools' metadata
        d, shape, axis, block_size, sd, gs = parse_meta(path, name, text)
        if d.kind == "block":  # the format's bytes
            raw = tensors.pop(name, None)
            if raw is None or raw.dtype != np.uint8 or raw.shape != block_rows(d, shape):
                raise ValueError(f"{path}: QArray {name!r} needs a uint8 tensor of shape {list(block_rows(d, shape))} "
                                 f"(its {d.name} bytes), got " + ("none" if raw is None else
                                                                  f"{raw.dtype} {list(raw.shape)}"))
            out[name] = QArray._blocks(raw, d, None, *columns_of(text))
            continue
        missing = [k for k in (name, f"{name}.scale", f"{name}.zero_point") if k not in tensors]
        if missing:
            raise ValueError(f"{path}: QArray {name!r} has no tensor {missing[0]!r}")
        data, scale, zp = tensors.pop(name), tensors.pop(f"{name}.scale"), tensors.pop(f"{name}.zero_point")
        if json.loads(text)["version"] == 4:  # codes below 8 bits packed row by row
            want = packed_rows_layout(d, shape)
            if (data.dtype, data.shape) != want:
                raise ValueError(f"{path}: tensor {name!r} is {data.dtype} {list(data.shape)}, but its metadata "
                                 f"says {d.name} {list(shape)}, packed by rows: {want[0]} {list(want[1])}")
            data = unpack_rows(d, (shape or (1,))[-1], data).reshape(shape)
        if data.dtype == d.bits_dtype != d.storage and data.shape == shape:  # bit patterns (int_repr)
            data = data.view(d.storage)
        if data.dtype != d.storage or data.shape != shape:
            raise ValueError(f"{path}: tensor {name!r} is {data.dtype} {list(data.shape)}, but its metadata says "
                             f"{d.name} (stored as {d.storage}) {list(shape)}")
        if scale.dtype != _stored(sd) or zp.dtype != np.int32:
            raise ValueError(f"{path}: {name}.scale / {name}.zero_point must be {_stored(sd)} / int32, got "
                             f"{scale.dtype} / {zp.dtype}")
        try:
            out[name] = QArray.from_int(data, scale.view(sd), zp, d, axis, block_size, global_scale=gs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: QArray {name!r} is invalid: {e}") from None
    out.update(tensors)
    return out
