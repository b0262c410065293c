"""Hugging Face quantized checkpoints: a directory holding ``config.json``, whose
``quantization_config`` (MLX: ``quantization``) names the convention, and the
tensors in ``model.safetensors`` or in shards listed by
``model.safetensors.index.json``.

Each convention's module reads its tensors into QArrays of the grouped block
formats (``qarray._blocks.grouped``: one block a group, its scale and zero
point or bias, its codes), of the float weight's shape, and writes them back:
:mod:`qarray.io.gptq` (GPTQ, AWQ), :mod:`qarray.io.compressed_tensors`,
:mod:`qarray.io.mlx`, :mod:`qarray.io.bnb`. What they share lives here: the
directory and its shards, the codes packed in 32-bit words, and the groups
made blocks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, NamedTuple

import numpy as np

from .. import _formats, _grouped
from .._dtypes import qdtype
from .._qarray import QArray
from .safetensors import _StTensor, _stream_safetensors, st_read

INDEX = "model.safetensors.index.json"


def is_checkpoint(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, "config.json"))


def read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON {what}: {e}") from None


class Tensors:
    """The tensors of a checkpoint directory, read on demand: ``t[name]`` reads one, ``t.read(name,
    key)`` a slice of it, ``t.shape(name)`` and ``t.dtype(name)`` say what it is. ValueError for a
    shard the index names that is missing, and for a tensor it has none of."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.used = set()  # the names a convention has read into QArrays; the rest load as they are
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            where = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(where, dict):
                raise ValueError(f"{index}: no 'weight_map' of tensor names to shard files")
            shards = sorted(set(where.values()))
        else:
            single = os.path.join(self.path, "model.safetensors")
            files = [single] if os.path.isfile(single) else sorted(
                os.path.join(self.path, f) for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{self.path}: a checkpoint directory needs model.safetensors, or shards listed by "
                                 f"{INDEX}; found neither")
            where, shards = None, [os.path.basename(f) for f in files]  # (every tensor of each file)
        self._readers, self._files = {}, {}
        for shard in shards:
            file = os.path.join(self.path, shard)
            if not os.path.isfile(file):
                raise ValueError(f"{self.path}: the shard {shard} named by {INDEX} is missing")
            try:
                readers = st_read(file, key=None)
            except Exception as e:  # the safetensors package's own error types
                raise ValueError(f"{file}: not a readable safetensors file: {e}") from None
            for name in readers if where is None else [n for n, s in where.items() if s == shard]:
                if name not in readers:
                    raise ValueError(f"{file}: has no tensor {name!r}, which {INDEX} places there")
                self._readers[name], self._files[name] = readers[name], file

    def __contains__(self, name):
        return name in self._readers

    def names(self):
        return list(self._readers)

    def lazy(self, name):
        """Tensor ``name`` as a dask array read slice by slice from its shard's memory map."""
        import dask.array as da

        shape, dtype, read = self._readers[name]
        t = _StTensor(self._files[name], name, shape, dtype, read)
        return da.from_array(t, chunks="auto", asarray=False, meta=np.empty((0,) * len(shape), dtype))

    def shape(self, name):
        return self._readers[name][0]

    def dtype(self, name):
        return self._readers[name][1]

    def read(self, name, key=Ellipsis):
        if name not in self._readers:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        return self._readers[name][2](key)

    __getitem__ = read


class Layer(NamedTuple):
    """A quantized weight as a convention reads it: ``n`` rows, ``make(rows)`` the QArray of a slice of
    them (read from the files then), whose start and stop ``align`` divides (AWQ's GEMM packs 8 rows
    in a word): eagerly ``make(slice(0, n))``, lazily a chunk of rows each."""

    n: int
    make: Callable
    align: int = 1


class Grouped(NamedTuple):
    """A weight of a grouped format, as a convention reads it: ``codes`` (N, K) unsigned, ``scale``
    (N, G) of the format's scale type (float32 holding bfloat16 values for bf16), ``zero`` (N, G)
    unsigned or None, ``bias`` (N, G) or None, and ``columns`` (act-order) or None."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    bias: np.ndarray | None = None
    columns: np.ndarray | None = None


def scale_type(dtype) -> str:
    """The grouped formats' name of a scale dtype: f16, bf16 or f32."""
    names = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
    if np.dtype(dtype).name not in names:
        raise ValueError(f"scales of {np.dtype(dtype)}: the grouped formats take float16, bfloat16 or float32 scales")
    return names[np.dtype(dtype).name]


def as_scale(a):
    """Scales as the grouped formats' fields take them: float16 or float32 (bfloat16 widened exactly)."""
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def nibbles(packed, n, k):
    """FP4 codes ``(n, k)`` from bytes two a code, the even element in the low nibble."""
    packed = np.asarray(packed).view(np.uint8).reshape(n, -1)
    if packed.shape[1] * 2 != k:
        raise ValueError(f"{packed.shape[1]} bytes a row do not hold {k} 4-bit codes")
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k)


def stored(v, precision):
    """Scales or biases as a checkpoint stores them: bfloat16 (ml_dtypes') for a bfloat16 format."""
    return np.ascontiguousarray(v.astype(_formats.ml_dtypes().bfloat16) if precision == "bfloat16" else v)


def to_qarray(codes_name, g: Grouped, stype, name="weight", tensor_scale=None) -> QArray:
    """The QArray of format ``{codes_name}_g{G}_{stype}[_zp|_bias]`` holding ``g``; ``tensor_scale``
    ``("_gdiv" or "_gmul", value)`` for NVFP4's, whose blocks' scales (``g.scale``) are E4M3 bytes
    (``("_scb", None)``: LLM.int8's name, which has none)."""
    n, k = g.codes.shape
    groups = g.scale.shape[1]
    if groups == 0 or k % groups:
        raise ValueError(f"{name}: {k} columns do not split into {groups} groups")
    extra = "_zp" if g.zero is not None else "_bias" if g.bias is not None else tensor_scale[0] if tensor_scale else ""
    d = qdtype(f"{codes_name}_g{k // groups}_{stype}{extra}")
    f = d.layout
    codes = g.codes if g.columns is None else g.codes[:, g.columns]
    fields = {"d": as_scale(g.scale).reshape(-1, 1), "q": codes.reshape(n * groups, k // groups)}
    if g.zero is not None:
        fields["z"] = g.zero.reshape(-1, 1)
    if g.bias is not None:
        fields["m"] = as_scale(g.bias).reshape(-1, 1)
    try:
        raw = f.pack(fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: {e}") from None
    gs = None if tensor_scale is None or tensor_scale[1] is None else np.float32(tensor_scale[1])
    if gs is not None and not (np.isfinite(gs) and gs > 0):
        raise ValueError(f"{name}: the tensor scale {gs} is not a positive finite number")
    return QArray._blocks(raw.reshape(n, groups * f.nbytes), d, None, g.columns, gs)


def from_qarray(q: QArray, name="weight") -> Grouped:
    """The codes and parameters of a 2-d QArray of a grouped format (the inverse of :func:`to_qarray`);
    the codes in column order."""
    f = q.dtype.layout
    if q.dtype.kind != "block" or _grouped.grouped(f.name) is None or q.ndim != 2:
        raise TypeError(f"{name}: a 2-d QArray of a grouped format (int4_g128_f16, ...) is needed, got "
                        f"{q.dtype.name} of shape {q.shape}")
    n = q.shape[0]
    fields = f.unpack(np.ascontiguousarray(q._backend.to_host(q.data)).reshape(-1, f.nbytes))
    codes = fields["q"].reshape(n, -1)
    if q.columns is not None:
        codes = codes[:, np.argsort(q.columns)]
    get = lambda k: None if k not in fields else fields[k].reshape(n, -1)  # noqa: E731
    return Grouped(codes, get("d"), get("z"), get("m"), q.columns)


# -- codes in 32-bit words ---------------------------------------------------------------------------
# Element i of a row at bit i * bits of the row's little-endian stream of words ("dense": MLX, GPTQ,
# compressed-tensors from 0.18), or 32 // bits elements a word at bits j * bits, the top bits unused
# ("per word": compressed-tensors before 0.18). The two are the same for 1, 2, 4 and 8 bits.

def words_for(count, bits, dense=True) -> int:
    return -(-count * bits // 32) if dense else -(-count // (32 // bits))


def unpack_words(words, bits, count, dense=True):
    """Codes (uint8, ``(..., count)``) from 32-bit words ``(..., W)`` along the last axis."""
    w = np.ascontiguousarray(words).view(np.uint32)
    if dense and 32 % bits == 0 or not dense:
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits)
        codes = (w[..., :, None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(*w.shape[:-1], -1)[..., :count].astype(np.uint8)
    bitstream = np.unpackbits(w.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    bitstream = bitstream[..., :count * bits].reshape(*w.shape[:-1], count, bits)
    return (bitstream << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint16).astype(np.uint8)


def pack_words(codes, bits, dense=True):
    """32-bit words (int32, ``(..., W)``) holding ``codes`` ``(..., count)`` (the inverse of
    :func:`unpack_words`; padding bits are 0)."""
    codes = np.asarray(codes, np.uint32)
    count = codes.shape[-1]
    n = words_for(count, bits, dense)
    if dense and 32 % bits == 0 or not dense:
        per = 32 // bits
        full = np.zeros((*codes.shape[:-1], n * per), np.uint32)
        full[..., :count] = codes
        full = full.reshape(*codes.shape[:-1], n, per) << (np.arange(per, dtype=np.uint32) * bits)
        return np.bitwise_or.reduce(full, axis=-1).view(np.int32)
    bitstream = ((codes[..., None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    bitstream = bitstream.reshape(*codes.shape[:-1], count * bits)
    pad = np.zeros((*codes.shape[:-1], n * 32 - count * bits), np.uint8)
    packed = np.packbits(np.concatenate([bitstream, pad], axis=-1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32)


def act_order(g_idx, group, name):
    """The stored column order (``QArray.columns``) of act-order group indices ``g_idx``, or None
    where the columns are in order. ValueError unless each group holds ``group`` columns."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    k = len(g_idx)
    columns = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[columns], np.arange(k) // group):
        raise ValueError(f"{name}: g_idx does not give each group {group} columns (groups 0, 1, ... of {group} "
                         "columns each, in any order, is what act-order writes)")
    return None if np.array_equal(columns, np.arange(k)) else columns


def g_idx_of(q: QArray, group):
    """The act-order group index of each column (``g_idx``) of ``q``: ``columns // group`` in order."""
    k = q.shape[-1]
    g = np.arange(k, dtype=np.int32) // group
    if q.columns is None:
        return g
    out = np.empty(k, np.int32)
    out[q.columns] = g
    return out


# -- writing a directory ---------------------------------------------------------------------------

def write(path, tensors: dict, quantization_config: dict, key="quantization_config", config=None) -> None:
    """The checkpoint directory ``path``: ``model.safetensors`` with ``tensors`` (metadata ``format:
    pt``, as transformers writes) and ``config.json`` holding ``config`` (or ``{}``) with the
    quantization config under ``key``; staged beside ``path`` and renamed into place."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save: {path} exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    staging = tempfile.mkdtemp(prefix=".qarray-", dir=parent)
    try:
        _stream_safetensors(os.path.join(staging, "model.safetensors"),
                            {k: np.ascontiguousarray(v) for k, v in tensors.items()}, {"format": "pt"})
        cfg = dict(config or {})
        cfg[key] = quantization_config
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        if os.path.isdir(path):
            old = tempfile.mkdtemp(prefix=".qarray-old-", dir=parent)
            os.rename(path, os.path.join(old, "x"))
            os.rename(staging, path)
            shutil.rmtree(old)
        else:
            os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
