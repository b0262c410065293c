"""Codes packed row by row, as a ``.safetensors`` file (version 4) and a Zarr
store hold QArrays below 8 bits: each row along the last axis packed as
``QArray.pack`` packs and padded to whole bytes (uint8), a 0-d QArray as one
row; 8 bits and wider as they are stored."""

from __future__ import annotations

import math

import numpy as np

from .._api import packed_layout, unpack
from .._params import to_host
from .._qarray import QArray


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
