"""QArrays and plain arrays in an ``.npz`` file: no pickle, every field checked.

Layout: each an uncompressed ``.npy`` member of the zip archive that ``numpy.savez``
writes. For a QArray called NAME: ``NAME.data`` (``QArray.pack()`` bytes),
``NAME.scale``, ``NAME.zero_point`` and ``NAME.meta``, a JSON string
``{"format": "qarray", "version": 2, "dtype": "qint4", "shape": [3, 10], "axis": 1,
"block_size": 4}``. For a plain array (numeric or bool): ``NAME.array`` and
``NAME.meta`` saying ``{"format": "qarray", "version": 2, "kind": "ndarray",
"dtype": "<i4", "shape": [3]}`` (``numpy.dtype.str``). Names may hold dots and
slashes (``fc1.weight``, ``encoder/layer0``). The meta and its versions:
:mod:`qarray.io._schema`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
import zipfile

import numpy as np

from .._api import packed_layout, unpack
from .._params import check_params, param_shape, to_host
from .._qarray import QArray
from ._schema import (FORMAT, VERSION, _ARRAY_KINDS, _READ_ERRORS, _check_name, _stored, bad_field, block_rows, columns_of,
                      meta_of, parse_meta, scale_bits)

_FIELDS = ("data", "scale", "zero_point", "meta")
_ARRAY_FIELDS = ("array", "meta")
_BLOCK_FIELDS = ("data", "meta")  # a block format's (version 5): its bytes hold its parameters
_MEMBER = re.compile(r"(.+)\.(data|scale|zero_point|array|meta)\.npy")
_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def save(path, arrays: dict) -> None:
    """Write ``{name: QArray or numpy.ndarray}`` (checked by ``qarray.save``) to
    the ``.npz`` file ``path``: a path (NumPy adding ``.npz`` where it is
    missing) or a binary file object."""
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
        if q.dtype.kind == "block":
            out[f"{name}.data"] = to_host(q.data)
            out[f"{name}.meta"] = np.array(json.dumps(meta))
            continue
        out[f"{name}.data"] = to_host(q.pack())
        out[f"{name}.scale"] = scale_bits(q)
        out[f"{name}.zero_point"] = to_host(q.zero_point)
        out[f"{name}.meta"] = np.array(json.dumps(meta))
    np.savez(path, **out)


def load(path) -> dict:
    """``{name: QArray or numpy.ndarray}`` of the ``.npz`` file ``path``: a path
    (``NAME`` finds the ``NAME.npz`` that ``save("NAME", ...)`` wrote) or a
    binary file object."""
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
        want = (_ARRAY_FIELDS if "array" in fields else
                _BLOCK_FIELDS if "scale" not in fields and "zero_point" not in fields else _FIELDS)
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
    if dtype.kind == "block":  # its bytes, as QArray.data holds them
        raw = _read(path, zf, fields["data"], f"{name}.data", _exactly(np.dtype(np.uint8), block_rows(dtype, shape)))
        return QArray._blocks(raw.copy(), dtype, None, *columns_of(str(text[()])))
    if "scale" not in fields and not plain:
        raise ValueError(f"{path}: field {name}.scale is missing")
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
