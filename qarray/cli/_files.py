"""The files that ``quantize`` and ``inspect`` read (.npz, .npy, .safetensors,
a .zarr store): their arrays, whether qarray.save wrote them, and what a QArray
takes in them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

import qarray
from .. import io
from .._api import packed_layout
from ._shared import CliError, _need, _one_line


_MAGIC = {".npz": (b"PK\x03\x04", b"PK\x05\x06"), ".npy": (b"\x93NUMPY",)}


def _read(path: Path) -> tuple[bool, dict]:
    """``(written by qarray.save, {name: array or QArray})`` from a .npz, .npy or
    .safetensors file; CliError (status 1) when it cannot be read."""
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".npy", ".safetensors", ".zarr", ".gguf"):
        raise CliError(f"{path}: expected a .npz, .npy, .safetensors or .gguf file or a .zarr store", 2)
    if suffix == ".zarr":  # a store as quantize writes it: lazy QArrays and arrays
        if not path.is_dir():
            raise CliError(f"{path}: {'a file, not a Zarr store' if path.exists() else 'no such store'}")
        _need("zarr", "pip install 'qarray[dask]'")
        try:
            arrays = qarray.load(path)
        except ValueError as e:
            raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None
        return any(isinstance(a, qarray.QArray) for a in arrays.values()), arrays
    if not path.is_file():
        raise CliError(f"{path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")
    if suffix == ".safetensors":
        _need("safetensors", "pip install safetensors")
    if suffix == ".gguf":
        tensors, _ = _read_gguf(path)
        return any(isinstance(t, qarray.QArray) for t in tensors.values()), tensors
    try:
        if suffix == ".safetensors":  # bfloat16 and float8 tensors too, which the safetensors package cannot read
            return (True, qarray.load(path)) if _written_by_qarray(path) else (False, io.st_read(path))
        with open(path, "rb") as fh:  # not numpy's own: it leaves it open when the zip is damaged
            if not fh.read(6).startswith(_MAGIC[suffix]):
                raise CliError(f"{path} is not a {suffix} file: it does not start as one")
            fh.seek(0)
            if suffix == ".npy":
                return False, {path.stem: np.load(fh, allow_pickle=False)}
            with np.load(fh, allow_pickle=False) as f:
                names = f.files
                if not (names and all(io._MEMBER.fullmatch(n + ".npy") for n in names)
                        and any(n.endswith(".meta") for n in names)):
                    arrays = {}
                    for name in names:
                        try:
                            arrays[name] = f[name]
                        except Exception as e:
                            raise CliError(f"{path}: cannot read array {name!r}: {_one_line(e)}") from None
                    return False, arrays
        return True, qarray.load(path)  # its ValueErrors name the file
    except CliError:
        raise
    except ValueError as e:
        raise CliError(str(e) if str(e).startswith(str(path)) else f"{path}: cannot read it: {_one_line(e)}") from None
    except Exception as e:  # numpy, zipfile and safetensors raise many types
        raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None


def _read_gguf(path: Path):
    """``(tensors, metadata)`` of a GGUF file (qarray.io.gguf.read); CliError when it cannot be read."""
    if not path.is_file():
        raise CliError(f"{path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")
    try:
        return io.gguf.read(path)
    except ValueError as e:  # it names the file and the field
        raise CliError(_one_line(e).removeprefix("ValueError: ")) from None
    except ImportError as e:  # BF16 tensors need ml_dtypes
        raise CliError(f"{path}: {e}") from None


def _already(path: Path) -> CliError:
    return CliError(f"{path} is already quantized (written by qarray.save); see what it holds with 'qarray inspect'")


def _written_by_qarray(path: Path) -> bool:
    """Whether the .safetensors file ``path`` holds QArrays (qarray.save's metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return any(io._is_qarray_meta(text) for text in (f.metadata() or {}).values())


def _scheme(q) -> str:
    if q.dtype.kind == "block":
        return f"{q.dtype.name} blocks of {q.block_size} along the last axis"
    if q.axis is None:
        return "per-tensor"
    if q.block_size is None:
        return f"per-channel axis {q.axis}"
    short = q.shape[q.axis] % q.block_size
    return f"blocks of {q.block_size} along axis {q.axis}" + (f" (last {short})" if short else "")


def _stored_bytes(q, path: Path) -> int:
    """What the file or store ``path`` holds of ``q``: packed data (all of it in a
    .npz; row by row in a .safetensors file or a .zarr store), scale and zero point."""
    if q.dtype.kind == "block":  # the format's bytes, parameters inside
        return q.nbytes
    if path.suffix.lower() in (".safetensors", ".zarr"):
        dtype, shape = io.packed_rows_layout(q.dtype, q.shape)
        data = dtype.itemsize * math.prod(shape)
    else:
        dtype, items = packed_layout(q.dtype, q.size)
        data = dtype.itemsize * items
    return data + int(q.scale.nbytes) + int(q.zero_point.nbytes)
