"""The meta JSON every format stores per QArray and per plain array, checked
field by field, and what the formats share: the scale as stored, names, the
errors a damaged file raises.

A QArray's meta: ``{"format": "qarray", "version": 2, "dtype": "qint4",
"shape": [3, 10], "axis": 1, "block_size": 4}``; a plain array's (numeric or
bool): ``{"format": "qarray", "version": 2, "kind": "ndarray", "dtype": "<i4",
"shape": [3]}`` (``numpy.dtype.str``).

Versions: ``save`` writes version 2, or version 3 for a QArray whose scale is
not float32 or that has a ``global_scale`` (the floating formats, MX, NVFP4):
its meta adds ``"scale_dtype"`` (``"float16"``, ``"bfloat16"``,
``"float8_e8m0fnu"``, ``"float8_e4m3fn"``; ``NAME.scale`` then holds the bit
patterns as uint16 / uint8) and ``"global_scale"`` (a number or null).
Version 4 is version 3 for a QArray below 8 bits in a ``.safetensors`` file:
its codes packed by rows (version 3 and before stored them one a byte, with the
QArray's shape, and still load). Version 5 is a QArray of a block format (GGUF's
``Q4_K`` and the like): ``{"format": "qarray", "version": 5, "dtype": "Q4_K",
"shape": [4, 512]}``, its data the format's own bytes (uint8, the QArray's
shape with the last axis in bytes: ``QArray.data``), with no scale or zero
point beside it (the blocks hold them). A QArray with act-order columns (``QArray.columns``: GPTQ's ``g_idx``) adds
``"columns"``, the list of them, and one with a tensor scale (NVFP4's
``global_scale``) adds ``"global_scale"``. ``load`` reads the versions in ``VERSIONS``.
Version 1 had QArrays only, names without dots; files written before the version
field existed say ``{"format": "qarray-1"}`` with no version and are read as version 1.
"""

from __future__ import annotations

import json
import struct
import tokenize
import warnings
import zipfile
import zlib

import numpy as np

from .._dtypes import qdtype
from .. import _formats
from .._params import KEPT_SCALES, check_scale, normalize_axis, normalize_block_size, to_host

FORMAT = "qarray"
VERSION = 2  # what save writes (3 where a QArray needs it)
VERSIONS = (1, 2, 3, 4, 5)  # what load reads
BLOCKS = 5  # the version of a block format's meta
_LEGACY_FORMAT = "qarray-1"  # version 1 before the version field: no "version" key
_KEYS = {"format", "version", "dtype", "shape", "axis", "block_size"}
_KEYS_3 = _KEYS | {"scale_dtype", "global_scale"}
_ARRAY_KEYS = {"format", "version", "kind", "dtype", "shape"}  # a plain array (version 2)
_BLOCK_KEYS = {"format", "version", "dtype", "shape"}  # a block format (version 5)
_ARRAY_KINDS = "biufc"  # bool, integers, floats, complex: what save takes as plain arrays
# What zipfile, numpy's npy header parser (tokenize, ast.literal_eval) and a damaged
# file can raise; warnings are made errors while reading, so they are here too.
_READ_ERRORS = (ValueError, TypeError, KeyError, IndexError, SyntaxError, RuntimeError, OverflowError,
                OSError, EOFError, struct.error, zipfile.BadZipFile, zlib.error, tokenize.TokenError, Warning)


def meta_of(q, rows=False) -> dict:
    """A QArray's ``NAME.meta`` (also its safetensors metadata entry: ``rows``
    where it holds codes below 8 bits packed row by row, version 4)."""
    if q.dtype.kind == "block":
        meta = {"format": FORMAT, "version": BLOCKS, "dtype": q.dtype.name, "shape": list(q.shape)}
        if q.columns is not None:
            meta["columns"] = [int(c) for c in q.columns]
        if q.global_scale is not None:  # float32 -> float64 -> JSON: exact
            meta["global_scale"] = float(q.global_scale)
        return meta
    meta = {"format": FORMAT, "version": VERSION, "dtype": q.dtype.name, "shape": list(q.shape), "axis": q.axis,
            "block_size": q.block_size}
    if rows or q.scale.dtype != np.float32 or q.global_scale is not None:
        gs = None if q.global_scale is None else float(q.global_scale)  # float32 -> float64 -> JSON: exact
        meta.update(version=4 if rows else 3, scale_dtype=q.scale.dtype.name, global_scale=gs)
    return meta


def columns_of(text):
    """``(columns, global_scale)`` of a block format's checked meta: its act-order columns
    (``QArray.columns``) and its tensor scale, each None where it has none."""
    meta = json.loads(text)
    columns, gs = meta.get("columns"), meta.get("global_scale")
    return None if columns is None else np.array(columns, np.int64), None if gs is None else check_scale(gs)


def block_rows(dtype, shape) -> tuple:
    """The shape of a block format's bytes for a QArray of ``shape``: the last axis in bytes."""
    return (*shape[:-1], shape[-1] // dtype.layout.block * dtype.layout.nbytes)


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


def _stored(scale_dtype) -> np.dtype:
    """How ``NAME.scale`` holds a scale of ``scale_dtype``: float32, else its bits."""
    return scale_dtype if scale_dtype == np.float32 else np.dtype(f"u{scale_dtype.itemsize}")


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
    if plain and meta.get("version") == BLOCKS:
        raise bad_field(path, name, "meta", f"version {BLOCKS} is a block format's, but {name}.array is there")
    want = (_ARRAY_KEYS if plain else _KEYS - {"version"} if legacy else _KEYS_3 if meta["version"] in (3, 4) else
            _BLOCK_KEYS if meta["version"] == BLOCKS else _KEYS)
    if not plain and meta.get("version") == BLOCKS:  # act-order columns, NVFP4's tensor scale, where there
        want = want | ({"columns", "global_scale"} & meta.keys())
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
    if (dtype.kind == "block") != (meta.get("version") == BLOCKS):
        raise bad_field(path, name, "meta", f"dtype {dtype.name} is {'a' if dtype.kind == 'block' else 'not a'} "
                                            f"block format, in a version {meta.get('version', 1)} meta")
    if dtype.kind == "block":
        f = dtype.layout
        if not shape or shape[-1] % f.block:
            raise bad_field(path, name, "meta", f"shape {shape} is not rows of whole {f.name} blocks ({f.block} "
                                                "values)")
        if "columns" in meta and sorted(meta["columns"]) != list(range(shape[-1])):
            raise bad_field(path, name, "meta", f"columns must be a permutation of the {shape[-1]} columns")
        if (f.tensor_scale is None) == ("global_scale" in meta):
            raise bad_field(path, name, "meta", f"{f.name} " + ("needs its tensor scale: global_scale is missing"
                                                                if f.tensor_scale else "has no global_scale"))
        if "global_scale" in meta:
            if type(meta["global_scale"]) not in (int, float):
                raise bad_field(path, name, "meta", f"global_scale must be a number, got {meta['global_scale']!r}")
            try:
                check_scale(meta["global_scale"])
            except ValueError as e:
                raise bad_field(path, name, "meta", f"global_scale: {e}") from None
        return dtype, tuple(shape), None, None, None, None
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


def _is_qarray_meta(text) -> bool:
    try:
        return json.loads(text).get("format") == FORMAT
    except (ValueError, AttributeError):
        return False
