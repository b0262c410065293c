"""GGUF files, llama.cpp's: read from a memory map, header only; written so that
ggml's strict C reader (``gguf.cpp``) and gguf-py both accept them.

Layout (``ggml/include/gguf.h``): ``"GGUF"``, version (3; 2 is read too), the
tensor and key-value counts (uint64), the key-values (``key string, type
uint32, value``), the tensor infos (``name string, n_dims uint32, ne[n_dims]
uint64`` innermost first, ``type uint32, offset uint64``), zero padding to
``general.alignment`` (32 by default), then the tensors' data, each padded to
the alignment; a string is a uint64 length and UTF-8 bytes, little-endian
throughout.

A tensor of one of ggml's block types loads as a QArray of that block format
(:mod:`qarray._ggml`) holding the file's bytes; the plain types (F32, F16, F64,
I8..I64, BF16) load as ndarrays (BF16 as ml_dtypes' bfloat16). Either is a view
of the memory map: opening reads the header only. Metadata values keep their
GGUF type as NumPy scalars and arrays (``numpy.uint32(2)``, a float32 array),
strings as ``str`` and string arrays as lists, so that a file read and written
again keeps every key, value and type.

The reader checks what ggml's C reader checks, and says which field is wrong:
magic, version (1 and byte-swapped files refused), every count and length
against the bytes left, value and tensor types, at most 4 dimensions, rows of
whole blocks, names unique and under 64 bytes, and each tensor's offset equal
to the padded sum of those before it.

The ``gguf`` package (llama.cpp's gguf-py) is not used: it has no checks of this
kind (a damaged header gives IndexError or a huge allocation), and it would be
one more dependency for ~200 lines of format. The tests use it as the oracle.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile

import numpy as np

from .. import _blocks, _formats
from .._params import to_host
from .._qarray import QArray

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_NAME = 64  # GGML_MAX_NAME: names are shorter
MAX_DIMS = 4
STRING, ARRAY = 8, 9
VALUE_TYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_TYPE_OF = {np.dtype(v).str.lstrip("<|"): k for k, v in VALUE_TYPES.items()}
# the plain tensor types (ggml.h enum ggml_type); the block types are qarray._ggml's
PLAIN = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8", 30: "bfloat16"}
TYPE_NAMES = {0: "F32", 1: "F16", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16",
              **{f.ggml: f.name for f in _blocks.FORMATS.values() if f.ggml is not None}}


def _plain_dtype(type_id):
    code = PLAIN[type_id]
    return np.dtype(getattr(_formats.ml_dtypes(), code)) if code == "bfloat16" else np.dtype("<" + code)


class _Header:
    """A cursor over the file's bytes that checks every read against what is left."""

    def __init__(self, path, buf):
        self.path, self.buf, self.at = path, memoryview(buf), 0

    def fail(self, field, why):
        return ValueError(f"{os.fspath(self.path)}: GGUF {field}: {why}")

    def take(self, n, field):
        if n > len(self.buf) - self.at:
            raise self.fail(field, f"truncated: {n} bytes needed at offset {self.at}, the file has "
                                   f"{len(self.buf)}")
        b = self.buf[self.at:self.at + n]
        self.at += n
        return b

    def num(self, code, field):
        d = _SCALAR[code]
        if d.size > len(self.buf) - self.at:
            self.take(d.size, field)  # the truncation error
        v = d.unpack_from(self.buf, self.at)[0]
        self.at += d.size
        return v

    def count(self, field, least):
        """A uint64 count of things at least ``least`` bytes each: no more than the bytes left hold."""
        n = self.num("u8", field)
        if n * least > len(self.buf) - self.at:
            raise self.fail(field, f"{n} would need at least {n * least} bytes, {len(self.buf) - self.at} are left")
        return n

    def string(self, field):
        raw = self.take(self.count(f"{field} length", 1), field)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(field, "not UTF-8") from None

    def strings(self, n, field):
        """``n`` strings: :meth:`string`'s checks in one loop (a tokenizer holds ~10^5 of them)."""
        buf, at, out, length = self.buf, self.at, [], _SCALAR["u8"].unpack_from
        try:
            for _ in range(n):
                if len(buf) - at < 8:
                    break
                k = length(buf, at)[0]
                if k > len(buf) - at - 8:
                    break
                out.append(str(buf[at + 8:at + 8 + k], "utf-8"))
                at += 8 + k
        except UnicodeDecodeError:
            self.at = at
            raise self.fail(field, f"string {len(out)} is not UTF-8") from None
        self.at = at
        if len(out) < n:  # the one cut short: the truncation error
            self.string(f"{field}[{len(out)}]")
        return out

    def value(self, type_id, field):
        if type_id in VALUE_TYPES:
            code = VALUE_TYPES[type_id]
            return np.dtype(code).type(self.num(code, field))
        if type_id == STRING:
            return self.string(field)
        if type_id == ARRAY:
            t = self.num("u4", f"{field} element type")
            if t == STRING:
                return self.strings(self.count(f"{field} count", 8), field)
            if t not in VALUE_TYPES:
                raise self.fail(field, f"array element type {t} is not one of GGUF's (nested arrays are refused, "
                                       "as ggml's reader refuses them)")
            d = np.dtype("<" + VALUE_TYPES[t])
            n = self.count(f"{field} count", d.itemsize)
            return np.frombuffer(self.take(n * d.itemsize, field), d).copy()
        raise self.fail(field, f"value type {type_id} is not one of GGUF's")


_SCALAR = {code: struct.Struct("<" + c) for code, c in
           {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "f4": "f", "?": "?", "u8": "Q",
            "i8": "q", "f8": "d"}.items()}  # VALUE_TYPES' codes, as struct reads them


def read(path, chunks=None):
    """``({name: QArray or ndarray}, {key: value})`` of the GGUF file ``path``, its tensors views of a
    read-only memory map (nothing of their data is read here). ValueError naming the file and the field
    for anything ggml's C reader would refuse.

    ``chunks`` (Dask's spelling: ``"auto"``, a number of bytes as ``"64MiB"``, rows per chunk) gives
    the tensors as Dask-backed QArrays and dask arrays over the same map instead, chunked along their
    leading axes (whole rows, so every chunk holds whole blocks): lazy, and computed chunk by chunk
    in parallel, from Dask's threads or a cluster's workers on the same file."""
    size = os.path.getsize(path)
    mm = np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)
    h = _Header(path, mm)
    if bytes(h.take(4, "magic")) != MAGIC:
        raise h.fail("magic", "the file does not start with 'GGUF'")
    version = h.num("u4", "version")
    if version & 0xFFFF == 0 and version:
        raise h.fail("version", f"{version:#x} is a byte-swapped (big-endian) file, which qarray does not read")
    if version not in (2, 3):
        raise h.fail("version", f"{version} is not read (GGUF versions 2 and 3 are; version 1 is obsolete)")
    n_tensors = h.count("tensor count", 8 + 4 + 8 + 4 + 8)
    n_kv = h.count("key-value count", 8 + 4)
    meta = {}
    for i in range(n_kv):
        key = h.string(f"key {i}")
        if key in meta:
            raise h.fail(f"key {key!r}", "appears twice")
        meta[key] = h.value(h.num("u4", f"{key!r} type"), f"value of {key!r}")
    alignment = meta.get("general.alignment", np.uint32(DEFAULT_ALIGNMENT))
    if type(alignment) is not np.uint32 or alignment == 0 or alignment & (alignment - 1):
        raise h.fail("general.alignment", f"must be a uint32 power of two, got {alignment!r}")
    alignment = int(alignment)
    infos, expected = {}, 0
    for i in range(n_tensors):
        name = h.string(f"tensor {i} name")
        field = f"tensor {name!r}"
        if len(name.encode()) >= MAX_NAME:
            raise h.fail(field, f"the name is {len(name.encode())} bytes, ggml's limit is {MAX_NAME - 1}")
        if name in infos:
            raise h.fail(field, "appears twice")
        n_dims = h.num("u4", f"{field} n_dims")
        if n_dims > MAX_DIMS:
            raise h.fail(f"{field} n_dims", f"{n_dims} dimensions, GGUF holds at most {MAX_DIMS}")
        ne = [h.num("u8", f"{field} ne") for _ in range(n_dims)]
        type_id = h.num("u4", f"{field} type")
        if type_id not in TYPE_NAMES:
            raise h.fail(f"{field} type", f"{type_id} is no ggml type qarray reads (removed and unknown ids are "
                                          "refused)")
        offset = h.num("u8", f"{field} offset")
        fmt = _blocks.get(TYPE_NAMES[type_id])
        block, per = (fmt.block, fmt.nbytes) if fmt is not None else (1, _plain_dtype(type_id).itemsize)
        if any(n >= 1 << 62 for n in ne) or math.prod(ne) >= 1 << 62:
            raise h.fail(f"{field} ne", f"{ne} is too large")
        if ne and ne[0] % block:
            raise h.fail(f"{field} ne", f"a row of {ne[0]} values is not a whole number of {TYPE_NAMES[type_id]} "
                                        f"blocks ({block} values)")
        nbytes = math.prod(ne) // block * per
        if offset != expected:
            raise h.fail(f"{field} offset", f"{offset}, where the tensors before it end at {expected} (each "
                                            f"padded to {alignment} bytes, in order)")
        expected = offset + -(-nbytes // alignment) * alignment
        infos[name] = (ne, type_id, offset, nbytes)
    start = -(-h.at // alignment) * alignment
    for name, (ne, type_id, offset, nbytes) in infos.items():
        if start + offset + nbytes > size:
            raise h.fail(f"tensor {name!r} offset", f"its {nbytes} bytes at {start + offset} run past the end "
                                                    f"of the file ({size} bytes)")
    tensors = {name: _tensor(mm, start + offset, nbytes, ne, type_id, chunks) for name, (ne, type_id, offset, nbytes)
               in infos.items()}
    return tensors, meta


def _tensor(mm, at, nbytes, ne, type_id, chunks):
    shape = tuple(reversed(ne))
    raw = mm[at:at + nbytes].view(np.ndarray)
    name = TYPE_NAMES[type_id]
    f = _blocks.get(name)
    a = raw.view(_plain_dtype(type_id)).reshape(shape) if f is None else \
        raw.reshape(shape[:-1] + (shape[-1] // f.block * f.nbytes,) if shape else (0,))
    if chunks is not None:  # whole rows a chunk: blocks run along the last axis
        try:
            import dask.array as da
        except ImportError:
            raise ImportError("read(chunks=...) gives Dask arrays: pip install 'qarray[dask]'") from None
        a = da.from_array(a, chunks=(chunks,) * (a.ndim - 1) + (-1,) if a.ndim > 1 else -1, asarray=False)
    return a if f is None else QArray.from_blocks(a, name)


def load(path, chunks=None) -> dict:
    """``{name: QArray or ndarray}`` of the GGUF file ``path`` (:func:`read` without the metadata)."""
    return read(path, chunks)[0]


def _encode(key, v) -> bytes:
    """A metadata value's type and bytes; the type from a NumPy scalar or array's dtype, else Python's:
    bool BOOL, int INT32 (INT64 beyond it), float FLOAT32, str STRING, a list of str an array of them."""
    if isinstance(v, str):
        return struct.pack("<I", STRING) + _string(v)
    if isinstance(v, (list, tuple)) and v and all(isinstance(s, str) for s in v):
        return struct.pack("<IIQ", ARRAY, STRING, len(v)) + b"".join(_string(s) for s in v)
    if isinstance(v, (np.generic, np.ndarray)):  # the type it says (numpy.float64 is a Python float too)
        a = np.asarray(v)
    elif isinstance(v, bool):
        a = np.asarray(v, np.bool_)
    elif isinstance(v, int):
        a = np.asarray(v, np.int32 if -2**31 <= v < 2**31 else np.int64)
    elif isinstance(v, float):
        a = np.asarray(v, np.float32)
    else:
        a = np.asarray(v)  # a list: int32 (int64 beyond it), float32, bool, as gguf-py types them
        if a.dtype.kind == "i" and a.size and a.min() >= -2**31 and a.max() < 2**31:
            a = a.astype(np.int32)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
    t = _TYPE_OF.get(a.dtype.str.lstrip("<|"))
    if t is None or a.ndim > 1 or (isinstance(v, (list, tuple)) and not v):
        raise TypeError(f"save: GGUF metadata {key!r} is {v!r}; GGUF holds numbers, bools, strings and flat arrays "
                        "of them (not empty lists: give a typed numpy array)")
    if a.ndim == 0:
        return struct.pack("<I", t) + a.astype(a.dtype.newbyteorder("<")).tobytes()
    return struct.pack("<IIQ", ARRAY, t, a.size) + a.astype(a.dtype.newbyteorder("<")).tobytes()


def _string(s) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _type_of(name, t):
    """``(ggml type id, the tensor's shape, its bytes as a host array or a function of them)``."""
    if isinstance(t, QArray):
        if t.dtype.kind != "block":
            raise TypeError(f"save: {name!r} is a {t.dtype.name} QArray; GGUF holds ggml's types: quantize it to "
                            "one (dtype='Q8_0', 'Q4_K', ...) or save its dequantized values")
        return t.dtype.layout.ggml, t.shape, t.data
    if not hasattr(t, "dtype") or not hasattr(t, "shape"):
        raise TypeError(f"save: {name!r} is a {type(t).__name__}, not a QArray or an array")
    code = "bfloat16" if t.dtype.name == "bfloat16" else np.dtype(t.dtype).str.lstrip("<|=")
    ids = {v: k for k, v in PLAIN.items()}
    if code not in ids:
        raise TypeError(f"save: {name!r} has dtype {t.dtype}; GGUF holds float32, float16, bfloat16, float64 and "
                        "int8..int64 arrays, and QArrays of ggml's types")
    return ids[code], tuple(t.shape), t


def save(path, tensors: dict, metadata=None) -> None:
    """Write ``{name: QArray of a ggml type, or array}`` and ``metadata`` (``{key: value}``, as
    :func:`read` gives it) to the GGUF file ``path``, staged beside it and renamed into place. Tensors
    go in the dict's order at ``general.alignment`` (default 32), as ggml's reader requires; data is
    written tensor by tensor (a memory map or a Dask array is read as it is written)."""
    metadata = dict(metadata or {})
    alignment = metadata.get("general.alignment", np.uint32(DEFAULT_ALIGNMENT))
    if not isinstance(alignment, (int, np.integer)) or alignment <= 0 or alignment & (alignment - 1) or \
            alignment >= 2**32:
        raise ValueError(f"save: general.alignment must be a power of two below 2**32, got {alignment!r}")
    if "general.alignment" in metadata:
        metadata["general.alignment"] = np.uint32(alignment)
    alignment = int(alignment)
    head = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, v in metadata.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"save: GGUF metadata keys are non-empty strings, got {key!r}")
        head += [_string(key), _encode(key, v)]
    parts, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or len(name.encode()) >= MAX_NAME:
            raise ValueError(f"save: GGUF tensor names are non-empty strings under {MAX_NAME} bytes (ggml's limit), "
                             f"got {name!r}")
        type_id, shape, data = _type_of(name, t)
        if not 1 <= len(shape) <= MAX_DIMS:
            raise ValueError(f"save: {name!r} has {len(shape)} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        nbytes = int(data.nbytes)
        head += [_string(name), struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape), type_id, offset)]
        parts.append(data)
        offset += -(-nbytes // alignment) * alignment
    header = b"".join(head)
    header += b"\0" * (-len(header) % alignment)
    folder = os.path.dirname(os.path.abspath(path))
    fd, staging = tempfile.mkstemp(prefix=".", suffix=".gguf-staging", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header)
            for data in parts:
                raw = np.ascontiguousarray(to_host(data.compute() if hasattr(data, "compute") else data))
                fh.write(memoryview(raw.view(np.uint8).reshape(-1)))
                fh.write(b"\0" * (-raw.nbytes % alignment))
        os.replace(staging, path)
    except BaseException:
        if os.path.exists(staging):
            os.remove(staging)
        raise


def type_name(t) -> str:
    """The ggml type name of a tensor :func:`read` gave (``"Q4_K"``, ``"F32"``, ``"BF16"``)."""
    if isinstance(t, QArray):
        return t.dtype.name
    ids = {v: k for k, v in PLAIN.items()}
    code = "bfloat16" if t.dtype.name == "bfloat16" else t.dtype.str.lstrip("<|=")
    return TYPE_NAMES[ids[code]]


def bits_per_weight(t) -> float:
    return t.dtype.layout.bits_per_weight if isinstance(t, QArray) else 8.0 * t.dtype.itemsize


__all__ = ["read", "load", "save", "type_name", "bits_per_weight"]
