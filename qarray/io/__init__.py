"""save / load QArrays (and plain NumPy arrays beside them): packed sub-byte
data, no pickle, every field checked.

The path says the format: an ``.npz`` file (:mod:`qarray.io.npz`; a path
without a suffix gets ``.npz``, as NumPy names it), a ``.safetensors`` file
(:mod:`qarray.io.safetensors`), a ``.gguf`` file (:mod:`qarray.io.gguf`:
llama.cpp's format, for GGUF's block types), or, for ``load``, a directory: a
Zarr store, read lazily (:mod:`qarray.io.zarr`, as ``qarray.zarr``). npz,
safetensors and Zarr store the same meta JSON per QArray, checked field by
field on reading, in the versions of :mod:`qarray.io._schema` (``load`` reads
those in ``VERSIONS``); GGUF stores what llama.cpp reads.
"""

from __future__ import annotations

import os

from . import checkpoint, gguf, imatrix, npz, safetensors
# the names other modules took from qarray.io when it was one module
from ._rows import pack_rows, packed_rows, packed_rows_layout, row_group, unpack_rows  # noqa: F401
from ._schema import (FORMAT, VERSION, VERSIONS, _is_qarray_meta, bad_field, meta_of, parse_meta,  # noqa: F401
                      scale_bits, scale_dtype)
from .npz import _MEMBER  # noqa: F401
from .safetensors import st_code, st_dtype, st_lazy, st_read  # noqa: F401
from .zarr import load_store


def _suffix(path) -> str:
    return os.path.splitext(os.fspath(path))[1] if isinstance(path, (str, os.PathLike)) else ""


def _safetensors(path) -> bool:
    return _suffix(path) == ".safetensors"


def save(path, arrays: dict, metadata=None, format=None) -> None:
    """Write ``{name: QArray or numpy.ndarray}`` to ``path``: an ``.npz`` file (a
    path, NumPy adding ``.npz`` where it is missing, or a binary file object),
    a ``.safetensors`` file, or a ``.gguf`` file (QArrays of GGUF's types and
    float or integer arrays, with ``metadata``: :mod:`qarray.io.gguf`); or, with
    ``format="compressed-tensors"``, ``"mlx"`` or ``"gptq"``, a Hugging Face
    checkpoint directory in that convention (:mod:`qarray.io.checkpoint`), its
    QArrays of the grouped formats as the convention's tensors.

    Plain arrays must be numeric or bool (``load`` gives them back as ndarrays,
    dtype and shape unchanged); names are non-empty strings, not starting with
    ``/`` (they may hold ``.`` and ``/``).
    """
    if not isinstance(arrays, dict):
        raise TypeError(f"save takes a dict of name -> QArray or numpy.ndarray, got {type(arrays).__name__}")
    if format is not None:
        if metadata is not None:
            raise TypeError("save: metadata is for GGUF files; a checkpoint directory takes format= alone")
        return checkpoint.save(path, arrays, format)
    suffix = _suffix(path)
    if suffix not in ("", ".npz", ".safetensors", ".gguf"):  # NumPy would write PATH.npz: a file of another name
        raise ValueError(f"save: {os.fspath(path)} is neither .npz, .safetensors nor .gguf; name it so (a path "
                         "without a suffix gets .npz), or write a .zarr store with qarray.zarr.to_zarr")
    if suffix == ".gguf":
        return gguf.save(path, arrays, metadata)
    if metadata is not None:
        raise TypeError(f"save: metadata is for GGUF files; {os.fspath(path)} is not one")
    if _safetensors(path):
        return safetensors.save(path, arrays)
    npz.save(path, arrays)


def load(path, chunks=None) -> dict:
    """Read a file written by :func:`save` as ``{name: QArray or numpy.ndarray}``:
    a path (``NAME`` finds the ``NAME.npz`` that ``save("NAME", ...)`` wrote), a
    binary file object, or a ``.safetensors`` file; or a Zarr store (a directory,
    as ``qarray quantize -o OUT.zarr`` writes it), lazily: Dask-backed QArrays and
    dask arrays (``qarray.zarr.load_store``); or a ``.gguf`` file, from a memory
    map (:func:`qarray.io.gguf.read` gives its metadata too), or with ``chunks``
    (``"auto"``, ``"64MiB"``, rows) as Dask-backed QArrays and arrays over it; or a
    Hugging Face checkpoint directory (``config.json`` beside ``.safetensors``
    shards: GPTQ, AWQ, bitsandbytes 4-bit, compressed-tensors, MLX), its quantized
    weights as QArrays of the float weight's shape (:mod:`qarray.io.checkpoint`); with
    ``chunks`` (rows, or ``"auto"``) lazily, chunks of rows read as Dask computes them.

    Anything off raises ValueError naming the file and the member or field
    (``NAME.meta``, ``NAME.data``, ...): a damaged, truncated or extended archive,
    a member missing, doubled or unexpected, an npy header or a value that does not
    fit. Every size is checked against the npy headers and the archive before data is
    read, so memory use stays within the file's size; nothing is unpickled. The
    format versions read are those in ``VERSIONS`` (see the module docstring).
    """
    if _safetensors(path):
        return safetensors.load(path)
    if _suffix(path) == ".gguf":
        return gguf.load(path, chunks)
    if checkpoint.is_checkpoint(path):  # a Hugging Face checkpoint directory
        return checkpoint.load(path, chunks)
    if chunks is not None:
        raise TypeError("load: chunks= is for GGUF files and checkpoint directories (a .zarr store is read in its "
                        "own chunks)")
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):  # a Zarr store: lazy, chunk by chunk
        try:
            import zarr  # noqa: F401
            import dask  # noqa: F401
        except ImportError:
            raise ImportError(f"reading the Zarr store {os.fspath(path)} needs zarr and dask: "
                              "pip install 'qarray[dask]'") from None
        return load_store(path)
    return npz.load(path)
