"""save / load QArrays (and plain NumPy arrays beside them) as ``.npz``: packed
sub-byte data, no pickle, every field checked.

Layout: each an uncompressed ``.npy`` member of the zip archive that ``numpy.savez``
writes. For a QArray called NAME: ``NAME.data`` (``QArray.pack()`` bytes),
``NAME.scale``, ``NAME.zero_point`` and ``NAME.meta``, a JSON string
``{"format": "qarray", "version": 2, "dtype": "qint4", "shape": [3, 10], "axis": 1,
"block_size": 4}``. For a plain array (numeric or bool): ``NAME.array`` and
``NAME.meta`` saying ``{"format": "qarray", "version": 2, "kind": "ndarray",
"dtype": "<i4", "shape": [3]}`` (``numpy.dtype.str``). Names may hold dots and
slashes (``fc1.weight``, ``encoder/layer0``).

A path ending in ``.safetensors`` is a safetensors file instead (the
``safetensors`` package, optional): for a QArray NAME the tensors ``NAME``
(its codes: 8 bits and wider as ``int_repr()`` gives them, with the QArray's
shape; below 8 bits packed row by row, as ``qarray.zarr`` stores them: uint8,
each row along the last axis packed as ``QArray.pack`` packs and padded to
whole bytes, a 0-d QArray as one row), ``NAME.scale`` and ``NAME.zero_point``,
and the header's metadata entry NAME holding the meta JSON above; a plain array
is the tensor NAME alone. A file holding QArrays says ``"format": "qarray"`` in
its metadata (where PyTorch's files say ``"pt"``). Float weights saved by other
tools load as ndarrays, ready for ``qarray.quantize``.

Versions: ``save`` writes version 2, or version 3 for a QArray whose scale is
not float32 or that has a ``global_scale`` (the floating formats, MX, NVFP4):
its meta adds ``"scale_dtype"`` (``"float16"``, ``"bfloat16"``,
``"float8_e8m0fnu"``, ``"float8_e4m3fn"``; ``NAME.scale`` then holds the bit
patterns as uint16 / uint8) and ``"global_scale"`` (a number or null).
Version 4 is version 3 for a QArray below 8 bits in a ``.safetensors`` file:
its codes packed by rows (version 3 and before stored them one a byte, with the
QArray's shape, and still load). ``load`` reads the versions in ``VERSIONS``.
Version 1 had QArrays only, names without dots; files written before the version
field existed say ``{"format": "qarray-1"}`` with no version and are read as version 1.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tokenize
import warnings
import zipfile
import zlib

import numpy as np

from ._api import packed_layout, unpack
from ._dtypes import qdtype
from . import _formats
from ._params import (KEPT_SCALES, check_params, check_scale, is_lazy, is_small_float, normalize_axis,
                      normalize_block_size, param_shape, to_host)
from ._qarray import QArray

FORMAT = "qarray"
VERSION = 2  # what save writes (3 where a QArray needs it)
VERSIONS = (1, 2, 3, 4)  # what load reads
_LEGACY_FORMAT = "qarray-1"  # version 1 before the version field: no "version" key
_KEYS = {"format", "version", "dtype", "shape", "axis", "block_size"}
_KEYS_3 = _KEYS | {"scale_dtype", "global_scale"}
_ARRAY_KEYS = {"format", "version", "kind", "dtype", "shape"}  # a plain array (version 2)
_FIELDS = ("data", "scale", "zero_point", "meta")
_ARRAY_FIELDS = ("array", "meta")
_ARRAY_KINDS = "biufc"  # bool, integers, floats, complex: what save takes as plain arrays
_MEMBER = re.compile(r"(.+)\.(data|scale|zero_point|array|meta)\.npy")
_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
# What zipfile, numpy's npy header parser (tokenize, ast.literal_eval) and a damaged
# file can raise; warnings are made errors while reading, so they are here too.
_READ_ERRORS = (ValueError, TypeError, KeyError, IndexError, SyntaxError, RuntimeError, OverflowError,
                OSError, EOFError, struct.error, zipfile.BadZipFile, zlib.error, tokenize.TokenError, Warning)


def _safetensors(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and str(path).endswith(".safetensors")


def save(path, arrays: dict) -> None:
    """Write ``{name: QArray or numpy.ndarray}`` to ``path``: an ``.npz`` file (a
    path, NumPy adding ``.npz`` where it is missing, or a binary file object),
    or a ``.safetensors`` file.

    Plain arrays must be numeric or bool (``load`` gives them back as ndarrays,
    dtype and shape unchanged); names are non-empty strings, not starting with
    ``/`` (they may hold ``.`` and ``/``).
    """
    if not isinstance(arrays, dict):
        raise TypeError(f"save takes a dict of name -> QArray or numpy.ndarray, got {type(arrays).__name__}")
    suffix = os.path.splitext(os.fspath(path))[1] if isinstance(path, (str, os.PathLike)) else ""
    if suffix not in ("", ".npz", ".safetensors"):  # NumPy would write PATH.npz: a file of another name
        raise ValueError(f"save: {os.fspath(path)} is neither .npz nor .safetensors; name it so (a path without a "
                         "suffix gets .npz), or write a .zarr store with qarray.zarr.to_zarr")
    if _safetensors(path):
        return _save_safetensors(path, arrays)
    out = {}
    for name, q in arrays.items():
        _check_name(name)
        if type(q) is np.ndarray:
            if q.dtype.kind not in _ARRAY_KINDS:
                raise TypeError(f"save: {name!r} has dtype {q.dtype}; plain arrays must be numeric or bool")
            out[f"{name}.array"] = q
            out[f"{name}.meta"] = np.array(json.dumps({"format": FORMAT, "version": VERSION, "kind": "ndarray",
                                                       "dtype": q.dtype.str, "shape": list(q.shape)}))
            continue
        if not isinstance(q, QArray):
            raise TypeError(f"save: {name!r} is a {type(q).__module__}.{type(q).__qualname__}, "
                            "not a QArray or numpy.ndarray")
        meta = meta_of(q)
        out[f"{name}.data"] = to_host(q.pack())
        out[f"{name}.scale"] = scale_bits(q)
        out[f"{name}.zero_point"] = to_host(q.zero_point)
        out[f"{name}.meta"] = np.array(json.dumps(meta))
    np.savez(path, **out)


def meta_of(q, rows=False) -> dict:
    """A QArray's ``NAME.meta`` (also its safetensors metadata entry: ``rows``
    where it holds codes below 8 bits packed row by row, version 4)."""
    meta = {"format": FORMAT, "version": VERSION, "dtype": q.dtype.name, "shape": list(q.shape), "axis": q.axis,
            "block_size": q.block_size}
    if rows or q.scale.dtype != np.float32 or q.global_scale is not None:
        gs = None if q.global_scale is None else float(q.global_scale)  # float32 -> float64 -> JSON: exact
        meta.update(version=4 if rows else 3, scale_dtype=q.scale.dtype.name, global_scale=gs)
    return meta


def scale_bits(q) -> np.ndarray:
    """The scale as stored: float32, or the bit patterns of another scale dtype."""
    s = to_host(q.scale)
    s = s if s.flags.c_contiguous else s.copy()  # (ascontiguousarray would make a 0-d scale 1-d)
    return s if s.dtype == np.float32 else s.view(f"u{s.dtype.itemsize}")


def scale_dtype(name) -> np.dtype:
    return np.dtype(np.float16) if name == "float16" else np.dtype(getattr(_formats.ml_dtypes(), name))


def _check_name(name):
    if not isinstance(name, str) or not name or name.startswith("/") or "\0" in name:
        raise ValueError(f"save: names must be non-empty strings, not starting with '/', got {name!r}")


def row_group(d) -> int:
    """Codes per whole number of packed bytes along a row (1: codes stored as they are)."""
    return 4 if d.bits == 6 else 8 // d.bits if d.bits < 8 else 1


def packed_rows_layout(d, shape) -> tuple:
    """``(dtype, shape)`` of ``shape``'s codes of ``d`` packed row by row (a 0-d
    QArray as shape ``(1,)``): each row along the last axis packed as
    ``QArray.pack`` packs, padded to whole bytes; 8 bits and wider as stored."""
    stored = tuple(shape) or (1,)
    if row_group(d) == 1:
        return d.bits_dtype, stored
    return np.dtype(np.uint8), stored[:-1] + (packed_layout(d, stored[-1])[1],)


def pack_rows(d, chunk) -> np.ndarray:
    """Each row of ``chunk`` (codes in storage, on the host or a device) packed as
    ``QArray.pack`` packs it; the row padded with zero codes to whole bytes."""
    g = row_group(d)
    chunk = to_host(chunk)  # device chunks are written from the host
    chunk = chunk.reshape(chunk.shape or (1,))
    pad = -chunk.shape[-1] % g
    bits = chunk.view(d.bits_dtype)
    if pad:
        bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (pad,), bits.dtype)], axis=-1)
    q = QArray._new(np.ascontiguousarray(bits).view(d.storage), np.float32(1), np.int32(0), d)
    return q.pack().reshape(packed_rows_layout(d, bits.shape)[1])


def unpack_rows(d, count, chunk) -> np.ndarray:
    """The codes (``d``'s storage) of packed rows (:func:`pack_rows`) of ``count`` codes each."""
    rows = chunk.shape[:-1]
    padded = -(-count // row_group(d)) * row_group(d)
    codes = unpack(np.ascontiguousarray(chunk).reshape(-1), d, (math.prod(rows), padded))
    return codes[:, :count].reshape(rows + (count,))


def packed_rows(d, x):
    """The Dask array of ``x``'s codes packed row by row, chunk by chunk: ``x``'s
    chunks along the last axis (but its last) hold whole bytes of codes."""
    dtype = packed_rows_layout(d, ())[0]
    chunks = x.chunks[:-1] + (tuple(packed_rows_layout(d, (c,))[1][0] for c in x.chunks[-1]),)
    return x.map_blocks(lambda c: pack_rows(d, c), chunks=chunks, dtype=dtype, meta=np.empty((0,) * x.ndim, dtype))


def load(path) -> dict:
    """Read a file written by :func:`save` as ``{name: QArray or numpy.ndarray}``:
    a path (``NAME`` finds the ``NAME.npz`` that ``save("NAME", ...)`` wrote), a
    binary file object, or a ``.safetensors`` file; or a Zarr store (a directory,
    as ``qarray quantize -o OUT.zarr`` writes it), lazily: Dask-backed QArrays and
    dask arrays (``qarray.zarr.load_store``).

    Anything off raises ValueError naming the file and the member or field
    (``NAME.meta``, ``NAME.data``, ...): a damaged, truncated or extended archive,
    a member missing, doubled or unexpected, an npy header or a value that does not
    fit. Every size is checked against the npy headers and the archive before data is
    read, so memory use stays within the file's size; nothing is unpickled. The
    format versions read are those in ``VERSIONS`` (see the module docstring).
    """
    if _safetensors(path):
        return _load_safetensors(path)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):  # a Zarr store: lazy, chunk by chunk
        try:
            from .zarr import load_store
            import zarr  # noqa: F401
            import dask  # noqa: F401
        except ImportError:
            raise ImportError(f"reading the Zarr store {os.fspath(path)} needs zarr and dask: "
                              "pip install 'qarray[dask]'") from None
        return load_store(path)
    if hasattr(path, "read"):
        return _load_zip("<file object>", path)
    if not os.path.exists(path) and os.path.exists(f"{os.fspath(path)}.npz"):
        path = f"{os.fspath(path)}.npz"  # as numpy.savez named it
    with open(path, "rb") as fh:
        return _load_zip(path, fh)


def _load_zip(path, fh) -> dict:
    """Every array of the archive in ``fh`` (``path`` names it in errors)."""
    with _open(path, fh) as zf:
        members = _members(path, fh, zf)
        return {name: _load_one(path, zf, name, fields) for name, fields in members.items()}


def _save_safetensors(path, arrays):
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
            rows = row_group(q.dtype) > 1
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
    (``io.st_read``'s reader), for ``dask.array.from_array``."""

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
    memory map of their place in the file: memory stays bounded whatever their size."""
    import dask.array as da

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


def _load_safetensors(path) -> dict:
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


def _is_qarray_meta(text) -> bool:
    try:
        return json.loads(text).get("format") == FORMAT
    except (ValueError, AttributeError):
        return False


def _open(path, fh) -> zipfile.ZipFile:
    """The archive in ``fh``. Its end record must close the file with no comment, as
    ``numpy.savez`` writes it: otherwise (a damaged comment length, bytes appended)
    zipfile searches backwards for an end record and may take a stale one."""
    head = fh.read(6)
    size = fh.seek(0, 2)
    fh.seek(max(size - 22, 0))
    tail = fh.read(22)
    if head == b"\x93NUMPY":
        raise ValueError(f"{path} is not a qarray file: it holds a single array, not an .npz archive")
    if len(tail) < 22 or tail[:4] != b"PK\x05\x06" or tail[20:] != b"\0\0":
        raise ValueError(f"{path} is not a readable qarray file: no zip end record (with an empty comment) "
                         "closes it; it is truncated, extended, damaged or not .npz")
    try:
        return zipfile.ZipFile(fh)
    except _READ_ERRORS as e:
        raise ValueError(f"{path} is not a readable qarray file: {type(e).__name__}: {e}") from None


def _members(path, fh, zf) -> dict:
    """``{name: {field: ZipInfo}}``: every member lying where the directory says, a
    plainly stored ``NAME.FIELD.npy``, there once, and all the fields of each name
    (four for a QArray, ``array`` and ``meta`` for a plain array)."""
    _check_layout(path, fh, zf.infolist())
    members = {}
    for info in zf.infolist():
        m = _MEMBER.fullmatch(info.filename)
        if m is None:
            raise ValueError(f"{path}: unexpected member {info.filename!r}")
        fields = members.setdefault(m[1], {})
        if m[2] in fields:
            raise ValueError(f"{path}: member {info.filename!r} appears twice")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x9 or info.file_size != info.compress_size:
            raise ValueError(f"{path}: member {info.filename!r} is compressed, encrypted, streamed or "
                             "has inconsistent sizes; qarray.save stores members plainly")
        fields[m[2]] = info
    for name, fields in members.items():
        want = _ARRAY_FIELDS if "array" in fields else _FIELDS
        extra = [f for f in fields if f not in want]
        if extra:
            raise ValueError(f"{path}: unexpected member {fields[extra[0]].filename!r} "
                             f"beside {name}.array (a plain array has only {name}.array and {name}.meta)")
        missing = [f for f in want if f not in fields]
        if missing:
            raise ValueError(f"{path}: field {name}.{missing[0]} is missing")
    return members


def _check_layout(path, fh, infos) -> None:
    """The members' local headers must lie back to back from byte 0, each where the
    directory puts it, with the directory right after them: no member is hidden from
    the directory zipfile read (a damaged end record can make it read a shorter one)."""
    at = {info.header_offset: info for info in infos}
    size = fh.seek(0, 2)
    pos = found = 0
    while pos in at:
        fh.seek(min(pos, size))  # past the end (sizes can claim 2**64): reads nothing
        local = fh.read(30)
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            break
        name_len, extra_len = struct.unpack("<HH", local[26:])
        pos += 30 + name_len + extra_len + at[pos].compress_size
        found += 1
    fh.seek(min(pos, size))
    if found != len(infos) or fh.read(4) != (b"PK\x01\x02" if infos else b"PK\x05\x06"):
        raise ValueError(f"{path} is not a readable qarray file: its zip directory does not match "
                         f"the members in it (at byte {pos})")


def _load_one(path, zf, name, fields):
    text = _read(path, zf, fields["meta"], f"{name}.meta",
                 lambda dtype, shape: None if dtype.kind == "U" and shape == () else "expected a JSON string")
    plain = "array" in fields
    dtype, shape, axis, block_size, sd, gs = parse_meta(path, name, str(text[()]), plain)
    if plain:
        a = _read(path, zf, fields["array"], f"{name}.array", _exactly(dtype, shape))
        if dtype.kind == "b" and a.size and a.view(np.uint8).max() > 1:
            raise bad_field(path, name, "array", "a bool array holds bytes other than 0 and 1")
        return a.copy()  # writable, as numpy.load gives it
    count = math.prod(shape)
    pshape = param_shape(shape, axis, block_size)
    scale = _read(path, zf, fields["scale"], f"{name}.scale", _exactly(_stored(sd), pshape)).view(sd)
    zero_point = _read(path, zf, fields["zero_point"], f"{name}.zero_point", _exactly(np.dtype(np.int32), pshape))
    try:
        s, z, _, _ = check_params(scale, zero_point, dtype, shape, axis, block_size)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: field {name}.scale/zero_point/meta is invalid: {e}") from None
    storage, items = packed_layout(dtype, count)
    packed = _read(path, zf, fields["data"], f"{name}.data",
                   _exactly(storage, (items,), f" ({count} {dtype.name} values)"))
    try:
        data = unpack(packed, dtype, shape)
    except (TypeError, ValueError) as e:
        raise bad_field(path, name, "data", e) from None
    if dtype.kind == "int" and not dtype.packed and data.size and (data.min() < dtype.qmin or data.max() > dtype.qmax):
        raise bad_field(path, name, "data", f"values outside the range of {dtype.name}")
    return QArray._new(data, s, z, dtype, axis, block_size, global_scale=gs)


def _stored(scale_dtype) -> np.dtype:
    """How ``NAME.scale`` holds a scale of ``scale_dtype``: float32, else its bits."""
    return scale_dtype if scale_dtype == np.float32 else np.dtype(f"u{scale_dtype.itemsize}")


def _exactly(dtype, shape, what=""):
    """A header check for :func:`_read`: exactly ``dtype`` and ``shape``."""
    def check(d, s):
        if d != dtype or s != shape:
            return f"holds {d} of shape {s}, expected {dtype} of shape {shape}{what}"
    return check


def _read(path, zf, info, key, check) -> np.ndarray:
    """The array in member ``info`` (field ``key``). ``check(dtype, shape)`` sees its npy
    header before any data is read and says what is wrong with it, or returns None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's header repairs, zipfile's doubts
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in _HEADERS:
                    raise ValueError(f"npy format version {version} is not one qarray reads")
                shape, fortran, dtype = _HEADERS[version](f)
                why = check(dtype, shape)
                if why is None:
                    nbytes, left = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
                    if left != nbytes:
                        why = f"holds {left} bytes of data, its header ({dtype}, shape {shape}) says {nbytes}"
                    else:  # reading to the end checks the CRC
                        a = np.frombuffer(f.read(), dtype)
                        a = a.reshape(shape[::-1]).T if fortran else a.reshape(shape)
    except _READ_ERRORS as e:
        raise ValueError(f"{path}: field {key} is unreadable: {type(e).__name__}: {e}") from None
    if why is not None:
        raise ValueError(f"{path}: field {key} is invalid: {why}")
    return a


def bad_field(path, name, field, why) -> ValueError:
    return ValueError(f"{path}: field {name}.{field} is invalid: {why}")


def _unique_keys(pairs) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen.add(key)
    return dict(pairs)


def parse_meta(path, name, text, plain=False):
    """``(dtype, shape, axis, block_size)`` from ``NAME.meta``: a QDType, or for a
    plain array (``plain``) a NumPy dtype with axis and block_size None."""
    try:
        meta = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:
        raise bad_field(path, name, "meta", f"not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise bad_field(path, name, "meta", "expected a JSON object")
    legacy = meta.get("format") == _LEGACY_FORMAT and "version" not in meta  # version 1
    if not legacy:
        reads = f"this qarray reads version {', '.join(map(str, VERSIONS))}"
        if meta.get("format") != FORMAT:
            raise bad_field(path, name, "meta", f"format is not {FORMAT!r}")
        if "version" not in meta:
            raise bad_field(path, name, "meta", f"version is missing; {reads}")
        if type(meta["version"]) is not int or meta["version"] not in VERSIONS:
            raise bad_field(path, name, "meta", f"version {meta['version']!r} is unknown; {reads}")
    if plain and (legacy or meta.get("version") == 1):
        raise bad_field(path, name, "meta", f"version 1 has no plain arrays, but {name}.array is there")
    want = _ARRAY_KEYS if plain else _KEYS - {"version"} if legacy else _KEYS_3 if meta["version"] in (3, 4) else _KEYS
    if meta.keys() != want:
        raise bad_field(path, name, "meta", f"keys are {sorted(meta)}, expected {sorted(want)}")
    if plain and meta["kind"] != "ndarray":
        raise bad_field(path, name, "meta", f"kind must be 'ndarray' beside {name}.array, got {meta['kind']!r}")
    if not isinstance(meta["dtype"], str):
        raise bad_field(path, name, "meta", f"dtype must be a string, got {meta['dtype']!r}")
    shape = meta["shape"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad_field(path, name, "meta", f"shape must be a list of non-negative integers, got {shape!r}")
    if plain:
        return _plain_dtype(path, name, meta["dtype"]), tuple(shape), None, None, None, None
    try:
        dtype = qdtype(meta["dtype"])
    except TypeError as e:
        raise bad_field(path, name, "meta", f"dtype: {e}") from None
    for key in ("axis", "block_size"):
        v = meta[key]
        if v is not None and type(v) is not int:
            raise bad_field(path, name, "meta", f"{key} must be an integer or null, got {v!r}")
    try:
        axis = normalize_axis(meta["axis"], len(shape))
        block_size = normalize_block_size(meta["block_size"], axis)
    except ValueError as e:
        raise bad_field(path, name, "meta", e) from None
    sd, gs = np.dtype(np.float32), None
    if meta.get("version") in (3, 4):
        if meta["scale_dtype"] not in KEPT_SCALES or dtype.kind != "float" and meta["scale_dtype"] != "float32":
            raise bad_field(path, name, "meta", f"scale_dtype must be one of {', '.join(KEPT_SCALES)} (float32 for "
                       f"integer formats), got {meta['scale_dtype']!r}")
        sd = scale_dtype(meta["scale_dtype"]) if meta["scale_dtype"] != "float32" else sd
        if meta["global_scale"] is not None:
            if type(meta["global_scale"]) not in (int, float):
                raise bad_field(path, name, "meta", f"global_scale must be a number or null, got {meta['global_scale']!r}")
            try:
                gs = check_scale(meta["global_scale"])
            except ValueError as e:
                raise bad_field(path, name, "meta", f"global_scale: {e}") from None
    return dtype, tuple(shape), axis, block_size, sd, gs


def _plain_dtype(path, name, text) -> np.dtype:
    """The NumPy dtype that a plain array's meta names: numeric or bool only."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's deprecated spellings
            dtype = np.dtype(text)
    except _READ_ERRORS as e:
        raise bad_field(path, name, "meta", f"dtype {text!r} is not a NumPy dtype ({e})") from None
    if dtype.kind not in _ARRAY_KINDS:
        raise bad_field(path, name, "meta", f"dtype {text!r} is not numeric or bool")
    return dtype
