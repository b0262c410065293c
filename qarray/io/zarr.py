"""QArrays in chunked Zarr stores (the ``dask`` extra: zarr and dask).

A store holds one QArray as a Zarr group: the array ``codes``, the arrays
``scale`` and ``zero_point`` (as ``qarray.save`` writes them: a float16,
bfloat16 or 8-bit scale as its bit patterns) and the attribute ``qarray``, the
meta JSON of ``qarray.io._schema`` (format, version, dtype, shape, axis, block_size;
version 3's scale_dtype and global_scale). ``codes`` has the QArray's shape
except along its last axis, where each row is packed as ``QArray.pack`` packs
(2- and 4-bit codes and float4 two or four to a byte, float6 four in three
bytes); its chunks along that axis hold whole bytes of codes (a multiple of 4,
or of 8 // bits, codes), so every chunk is written whole by one task and
writes from many workers never share a chunk. A 0-d QArray is stored as shape
``(1,)``. A block format (GGUF's ``Q4_K`` and the like) stores its bytes as
``codes`` (``QArray.data``: chunks of whole blocks along the last axis) and
no ``scale`` or ``zero_point``: its blocks hold them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from .. import backends as _backends
from .._api import packed_layout
from .._params import check_params, to_host
from .._qarray import QArray
from ._rows import packed_rows, packed_rows_layout, row_group, unpack_rows
from ._schema import bad_field, block_rows, columns_of, meta_of, parse_meta, scale_bits, scale_dtype

__all__ = ["to_zarr", "from_zarr", "load_store"]


def _unpack_rows(d, n_last, per_chunk, chunk, block_info=None):
    """The codes of a chunk of packed rows (dask's ``block_info`` says which):
    ``per_chunk`` codes per full chunk along the last axis, ``n_last`` in all."""
    start = block_info[0]["chunk-location"][-1] * per_chunk
    return unpack_rows(d, min(n_last - start, per_chunk), chunk).view(_backends.get("dask").float_storage(d))


def to_zarr(q: QArray, store, overwrite=False, chunks=None) -> None:
    """Write ``q`` (in memory or Dask-backed) to the Zarr ``store`` (a path, or
    any store ``zarr.open_group`` takes). A Dask QArray is written chunk by chunk
    by its scheduler (each Zarr chunk by one task); ``chunks`` (elements per
    chunk along each axis; default: the dask chunks, or dask's "auto") sets the
    stored chunking. ``overwrite=False`` refuses a store that holds a group."""
    import dask.array as da
    import zarr

    if not isinstance(q, QArray):
        raise TypeError(f"to_zarr takes a QArray, got {type(q).__name__}")
    d = q.dtype
    data = q.data if q.ndim else q.data.reshape(1)
    x = data if isinstance(data, da.Array) else da.from_array(to_host(data), chunks="auto" if chunks is None else chunks)
    if chunks is not None or not isinstance(data, da.Array):
        x = x.rechunk(chunks or x.chunksize)
    g = d.layout.nbytes if d.kind == "block" else row_group(d)  # a block's bytes, or a byte's codes
    step = [max(c[0], 1) for c in x.chunks]
    step[-1] = max(g, -(-step[-1] // g) * g)
    # regular chunks, whole bytes (whole blocks) along the last axis
    packed = x.rechunk(tuple(step)) if d.kind == "block" else packed_rows(d, x.rechunk(tuple(step)))
    try:
        grp = zarr.open_group(store, mode="w" if overwrite else "w-")
    except (FileExistsError, zarr.errors.ContainsGroupError, zarr.errors.ContainsArrayError) as e:
        raise ValueError(f"to_zarr: {store} already holds data; pass overwrite=True to replace it ({e})") from None
    codes = grp.create_array("codes", shape=packed.shape, chunks=tuple(step[:-1]) + (packed.chunks[-1][0],),
                             dtype=packed.dtype, fill_value=0)
    for name, a in (() if d.kind == "block" else (("scale", scale_bits(q)), ("zero_point", to_host(q.zero_point)))):
        arr = grp.create_array(name, shape=a.shape, dtype=a.dtype)
        arr[...] = a
    grp.attrs["qarray"] = json.dumps(meta_of(q))
    da.store(packed, codes, lock=False)


def from_zarr(store) -> QArray:
    """The QArray in a Zarr ``store`` written by :func:`to_zarr`, Dask-backed and
    lazy (its chunks are the store's). A damaged or foreign store raises
    ValueError naming the field."""
    import dask.array as da
    import zarr

    try:
        grp = zarr.open_group(store, mode="r")
    except zarr.errors.ContainsArrayError:
        raise ValueError(f"from_zarr: {store} holds a Zarr array, not a QArray (an array passed through as it "
                         "was): read it with dask.array.from_zarr, or all of a store with qarray.load") from None
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError) as e:
        raise ValueError(f"from_zarr: {store} holds no Zarr group ({e})") from None
    if "qarray" not in grp.attrs:
        raise ValueError(f"from_zarr: {store}: attribute 'qarray' is missing: not a store written by qarray.to_zarr")
    text = grp.attrs["qarray"]
    if not isinstance(text, str):
        raise bad_field(store, "zarr", "meta", f"expected a JSON string, got {type(text).__name__}")
    d, shape, axis, block_size, sd, gs = parse_meta(store, "zarr", text)
    arrays = {}
    for name in ("codes",) if d.kind == "block" else ("codes", "scale", "zero_point"):
        try:
            arrays[name] = grp[name]
        except KeyError:
            raise bad_field(store, "zarr", name, "missing") from None
        if not isinstance(arrays[name], zarr.Array):
            raise bad_field(store, "zarr", name, "not an array")
    if d.kind == "block":
        return _blocks_of(store, arrays["codes"], d, shape, *columns_of(text))
    stored = shape or (1,)
    g = row_group(d)
    want_dtype, want_shape = packed_rows_layout(d, shape)
    codes = arrays["codes"]
    if codes.dtype != want_dtype or tuple(codes.shape) != want_shape:
        raise bad_field(store, "zarr", "codes", f"{codes.dtype} {tuple(codes.shape)}, expected {want_dtype} {want_shape} "
                   f"for {d.name} of shape {shape}")
    per_chunk = codes.chunks[-1]
    if g > 1 and per_chunk % packed_layout(d, g)[1]:
        raise bad_field(store, "zarr", "codes", f"chunks of {per_chunk} bytes along the last axis split packed codes")
    bits_dtype = np.float32 if sd == np.float32 else np.dtype(f"u{sd.itemsize}")
    scale, zp = np.asarray(arrays["scale"][...]), np.asarray(arrays["zero_point"][...])
    if scale.dtype != bits_dtype:
        raise bad_field(store, "zarr", "scale", f"dtype {scale.dtype}, expected {np.dtype(bits_dtype)}")
    if sd != np.float32:
        scale = scale.view(scale_dtype(sd.name))
    try:
        s, z, axis, block_size = check_params(scale, zp, d, shape, axis, block_size)
    except (TypeError, ValueError) as e:
        raise bad_field(store, "zarr", "scale", e) from None
    if np.shape(scale) != np.shape(s) or np.shape(zp) != np.shape(z):
        raise bad_field(store, "zarr", "scale", f"shapes {np.shape(scale)}, {np.shape(zp)}, expected {np.shape(s)}")
    x = da.from_array(_Chunks(codes, store, "codes"), chunks=codes.chunks, asarray=False,
                      meta=np.empty((0,) * codes.ndim, codes.dtype))
    if g > 1:
        n_codes = per_chunk // packed_layout(d, g)[1] * g  # codes in a full chunk
        chunks = x.chunks[:-1] + (tuple(min(n_codes, stored[-1] - i * n_codes) for i in range(len(x.chunks[-1]))),)
        bits = _backends.get("dask").float_storage(d)
        x = x.map_blocks(functools.partial(_unpack_rows, d, stored[-1], n_codes), chunks=chunks, dtype=bits,
                         meta=np.empty((0,) * x.ndim, bits))
    if not shape:
        x = x.reshape(())
    b = _backends.get("dask")
    return QArray._new(x, s, z, d, axis, block_size, b, gs)


def _blocks_of(store, codes, d, shape, columns, global_scale) -> QArray:
    """A block format's QArray from its stored bytes, lazily."""
    import dask.array as da

    want = block_rows(d, shape)
    if codes.dtype != np.uint8 or tuple(codes.shape) != want:
        raise bad_field(store, "zarr", "codes", f"{codes.dtype} {tuple(codes.shape)}, expected uint8 {want} for "
                                                f"{d.name} of shape {shape}")
    if codes.chunks[-1] % d.layout.nbytes:
        raise bad_field(store, "zarr", "codes", f"chunks of {codes.chunks[-1]} bytes along the last axis split "
                                                f"{d.name}'s blocks of {d.layout.nbytes}")
    x = da.from_array(_Chunks(codes, store, "codes"), chunks=codes.chunks, asarray=False,
                      meta=np.empty((0,) * codes.ndim, codes.dtype))
    return QArray._blocks(x, d, _backends.get("dask"), columns, global_scale)


class _Chunks:
    """A stored array, read chunk by chunk for dask: a chunk that cannot be read
    (truncated, damaged) raises ValueError naming the store and the array, not
    the codec's own error (zarr's "Zstd decompression error")."""

    def __init__(self, array, store, name):
        self.array, self.store, self.name = array, store, name
        self.shape, self.dtype, self.ndim = tuple(array.shape), array.dtype, array.ndim

    def __getitem__(self, key):
        try:
            return self.array[key]
        except Exception as e:  # the codecs raise RuntimeError, ValueError, ...
            raise ValueError(f"{self.store}: array {self.name!r} cannot be read: "
                             f"{type(e).__name__}: {e}") from None


def load_store(store) -> dict:
    """``{name: QArray or dask array}`` of a Zarr store (a directory) as ``qarray
    quantize -o OUT.zarr`` writes it: a group per QArray (by :func:`to_zarr`), an
    array per tensor passed through, names with ``/`` as nested groups; all lazy.
    A store that is one QArray or one array gives ``{"": it}``. ValueError for a
    directory that holds no Zarr store."""
    import dask.array as da
    import zarr

    root = Path(store)
    if not (root / "zarr.json").is_file():
        raise ValueError(f"{store} holds no Zarr store (no zarr.json: qarray reads Zarr version 3 stores)")
    out = {}

    def walk(path, prefix):
        meta = path / "zarr.json"
        node = json.loads(meta.read_text()) if meta.is_file() else {}  # none: a group made implicitly
        if node.get("node_type") == "array":
            a = zarr.open_array(path, mode="r")
            out[prefix] = da.from_array(_Chunks(a, store, prefix), chunks=a.chunks, asarray=False,
                                        meta=np.empty((0,) * a.ndim, a.dtype))
        elif "qarray" in node.get("attributes", {}):
            out[prefix] = from_zarr(path)
        else:
            for child in sorted(p for p in path.iterdir() if p.is_dir()):
                walk(child, f"{prefix}/{child.name}" if prefix else child.name)

    try:
        walk(root, "")
    except (json.JSONDecodeError, OSError) as e:  # a zarr.json that is not JSON, an unreadable directory
        raise ValueError(f"{store}: cannot read the store: {type(e).__name__}: {e}") from None
    return out
