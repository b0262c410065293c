"""save / load QArrays as ``.npz``: packed sub-byte data, no pickle, every field checked.

Layout: for each name, ``NAME.data`` (``QArray.pack()`` bytes), ``NAME.scale``,
``NAME.zero_point`` and ``NAME.meta`` (a JSON string: format, dtype, shape, axis,
block_size).
"""

from __future__ import annotations

import json
import zipfile
import zlib

import numpy as np

from ._api import unpack
from ._dtypes import qdtype
from ._params import check_params, to_host
from ._qarray import QArray

FORMAT = "qarray-1"
_FIELDS = ("data", "scale", "zero_point", "meta")


def save(path, arrays: dict) -> None:
    """Write ``{name: QArray}`` to ``path`` (an ``.npz`` file)."""
    if not isinstance(arrays, dict):
        raise TypeError(f"save takes a dict of name -> QArray, got {type(arrays).__name__}")
    out = {}
    for name, q in arrays.items():
        if not isinstance(name, str) or not name or "." in name or "/" in name:
            raise ValueError(f"save: names must be non-empty strings without '.' or '/', got {name!r}")
        if not isinstance(q, QArray):
            raise TypeError(f"save: {name!r} is a {type(q).__name__}, not a QArray")
        meta = {"format": FORMAT, "dtype": q.dtype.name, "shape": list(q.shape),
                "axis": q.axis, "block_size": q.block_size}
        out[f"{name}.data"] = to_host(q.pack())
        out[f"{name}.scale"] = to_host(q.scale)
        out[f"{name}.zero_point"] = to_host(q.zero_point)
        out[f"{name}.meta"] = np.array(json.dumps(meta))
    np.savez(path, **out)


def _bad(path, name, field, why) -> ValueError:
    return ValueError(f"{path}: field {name}.{field} is invalid: {why}")


def _read_meta(path, name, raw):
    if raw.dtype.kind != "U" or raw.ndim != 0:
        raise _bad(path, name, "meta", "expected a JSON string")
    try:
        meta = json.loads(str(raw))
    except ValueError as e:
        raise _bad(path, name, "meta", f"not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(path, name, "meta", f"format is not {FORMAT!r}")
    try:
        dtype = qdtype(meta.get("dtype"))
    except TypeError as e:
        raise _bad(path, name, "meta", f"dtype: {e}") from None
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _bad(path, name, "meta", f"shape must be a list of non-negative integers, got {shape!r}")
    for key in ("axis", "block_size"):
        v = meta.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise _bad(path, name, "meta", f"{key} must be an integer or null, got {v!r}")
    return dtype, tuple(shape), meta.get("axis"), meta.get("block_size")


def load(path) -> dict:
    """Read a file written by :func:`save`; ValueError naming the field if anything is off."""
    with open(path, "rb") as fh:  # ours to close, whatever np.load makes of it
        try:
            f = np.load(fh, allow_pickle=False)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable qarray file (truncated or not .npz): {e}") from None
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError(f"{path} is not a qarray file: it holds a single array, not an .npz archive")
        with f:
            raw = {}
            for key in f.files:
                try:
                    raw[key] = f[key]
                except ValueError as e:  # an object array: a pickle in disguise
                    raise ValueError(f"{path}: field {key} is invalid: {e}") from None
                except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as e:
                    raise ValueError(f"{path}: field {key} is unreadable (truncated file?): {e}") from None
    names = {}
    for key in raw:
        name, _, field = key.rpartition(".")
        if not name or field not in _FIELDS:
            raise ValueError(f"{path}: unexpected field {key!r}")
        names.setdefault(name, set()).add(field)
    result = {}
    for name, fields in names.items():
        missing = set(_FIELDS) - fields
        if missing:
            raise ValueError(f"{path}: field {name}.{sorted(missing)[0]} is missing")
        dtype, shape, axis, block_size = _read_meta(path, name, raw[f"{name}.meta"])
        try:
            s, z, axis, block_size = check_params(raw[f"{name}.scale"], raw[f"{name}.zero_point"],
                                                  dtype, shape, axis, block_size)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: field {name}.scale/zero_point/meta is invalid: {e}") from None
        try:
            data = unpack(raw[f"{name}.data"], dtype, shape)
        except (TypeError, ValueError) as e:
            raise _bad(path, name, "data", e) from None
        if not dtype.packed and data.size and (data.min() < dtype.qmin or data.max() > dtype.qmax):
            raise _bad(path, name, "data", f"values outside the range of {dtype.name}")
        result[name] = QArray._new(data, s, z, dtype, axis, block_size)
    return result
