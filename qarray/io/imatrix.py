"""llama.cpp's importance-matrix files (``llama-imatrix -o FILE``, ``llama-quantize --imatrix FILE``):
read into :class:`qarray.observers.ImportanceMatrix` collectors or the importance values
``qarray.quantize(..., importance=)`` takes, and written from collectors.

Two formats, as llama.cpp's ``common/imatrix-loader.cpp`` reads them (a file that starts with
``GGUF`` is the first, any other the second):

- GGUF (``llama-imatrix``'s default): metadata ``general.type = "imatrix"``, ``imatrix.datasets``
  (strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (uint32; ``llama-quantize`` refuses a
  file without all three), and two F32 tensors for each weight, in name order: ``NAME.in_sum2``, each
  column's sum of squared activations, ``(K,)`` (``(experts, K)`` for a weight of experts), and
  ``NAME.counts``, the tokens summed, ``(1,)`` (``(experts, 1)``). ``llama-quantize`` passes
  ``in_sum2 / counts`` to ggml, divided in float32 (an expert of count 0: ones).
- legacy ``.dat`` (``--output-format dat``; all int32 and float32, little-endian): the number of
  entries, then each entry's name (length, bytes), ``ncall`` (the chunks it saw), the number of
  values and the values, ``sum / count * ncall``; then, optionally, the chunk count and a dataset
  name (length, bytes). ``llama-quantize`` divides the values by ``ncall`` in float32. Experts are
  not marked: an entry of experts is one run of ``experts * K`` values.

:func:`load` gives those importance values, bit for bit as ``llama-quantize`` computes them; so
``quantize(w, dtype, importance=load(FILE)[NAME])`` gives its bytes for that weight. :func:`read`
gives the statistics as collectors, each float32 sum taken exactly, which ``merge`` with more
calibration data; their ``result()`` equals :func:`load`'s values (float32 division is the correctly
rounded quotient, as ``result()`` is, for counts below 2**24). :func:`save` writes collectors; a
file holds float32 sums, so each column's sum is rounded once to float32 there, and the importance
``llama-quantize`` divides out of it can be 1 ulp from the collector's ``result()`` (about a quarter of
the columns, none when the count is a power of two): :func:`load` of the written file gives what it
uses.

>>> m = qa.observers.ImportanceMatrix().update(numpy.ones((4, 256), numpy.float32))
>>> save(path, {"blk.0.ffn_up.weight": m}, datasets=["calibration.txt"], chunk_size=4)
>>> load(path)["blk.0.ffn_up.weight"][:3]
array([1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

import os
import struct

import numpy as np

from ..observers import ImportanceMatrix
from . import gguf

SUMS, COUNTS = ".in_sum2", ".counts"
FORMATS = ("gguf", "dat")


class _Legacy(gguf._Header):
    """GGUF's checked cursor over a legacy ``.dat`` file's bytes."""

    def fail(self, field, why):
        return ValueError(f"{os.fspath(self.path)}: imatrix .dat {field}: {why}")


def _gguf_entries(path):
    tensors, meta = gguf.read(path)
    pairs = {}
    for name, t in tensors.items():
        for suffix, i in ((SUMS, 0), (COUNTS, 1)):
            if name.endswith(suffix):  # other tensors are skipped, as llama.cpp skips them
                pairs.setdefault(name[:-len(suffix)], [None, None])[i] = (name, t)
    if not pairs:
        raise ValueError(f"{os.fspath(path)}: an imatrix GGUF file holds NAME{SUMS} and NAME{COUNTS} tensors; "
                         "this one has none")
    entries = {}
    for name, (sums, counts) in sorted(pairs.items()):
        if sums is None or counts is None:
            raise ValueError(f"{os.fspath(path)}: imatrix entry {name!r} has {'no' if sums is None else 'a'} "
                             f"{SUMS} and {'no' if counts is None else 'a'} {COUNTS} tensor; it needs both")
        for tname, t in (sums, counts):
            if gguf.type_name(t) != "F32":
                raise ValueError(f"{os.fspath(path)}: imatrix tensor {tname!r} is {gguf.type_name(t)}; sums and "
                                 "counts are F32")
        c = np.asarray(counts[1]).ravel()
        s = np.asarray(sums[1]).ravel()
        if c.size == 0 or s.size % c.size or s.size == 0:
            raise ValueError(f"{os.fspath(path)}: imatrix entry {name!r} has {s.size} sums for {c.size} counts; "
                             "the sums are one run of K per count (per expert)")
        if not (np.isfinite(c) & (c >= 0) & (c == np.round(c))).all():
            raise ValueError(f"{os.fspath(path)}: imatrix tensor {counts[0]!r} holds {c.tolist()[:8]}; counts are "
                             "whole numbers of tokens >= 0")
        entries[name] = (s.reshape(c.size, -1), c.astype(np.int64))
    return entries, meta


def _dat_entries(path):
    size = os.path.getsize(path)
    h = _Legacy(path, np.memmap(path, np.uint8, "r") if size else b"")
    n = h.num("i4", "entry count")
    if n < 1:
        raise h.fail("entry count", f"{n}; a file holds at least one entry")
    entries = {}
    for i in range(n):
        length = h.num("i4", f"entry {i} name length")
        if length < 0:
            raise h.fail(f"entry {i} name length", f"{length} is negative")
        try:
            name = str(h.take(length, f"entry {i} name"), "utf-8")
        except UnicodeDecodeError:
            raise h.fail(f"entry {i} name", "not UTF-8") from None
        ncall = h.num("i4", f"entry {name!r} ncall")
        nval = h.num("i4", f"entry {name!r} value count")
        if nval < 1:
            raise h.fail(f"entry {name!r} value count", f"{nval}; an entry holds at least one value")
        values = np.frombuffer(h.take(4 * nval, f"entry {name!r} values"), "<f4").astype(np.float32)
        entries[name] = (values[None], np.array([ncall], np.int64))
    meta = {}
    if h.at < size:  # the trailer is optional, each part of it too, as llama.cpp reads it
        meta["imatrix.chunk_count"] = np.int32(h.num("i4", "chunk count"))
        if size - h.at >= 4:
            length = h.num("i4", "dataset name length")
            if length > 0:
                meta["imatrix.datasets"] = [str(h.take(length, "dataset name"), "utf-8", "replace")]
    return entries, meta


def _entries(path):
    """``({name: (sums float32 (experts, K), counts int64 (experts,))}, metadata, legacy)``."""
    with open(path, "rb") as f:
        legacy = f.read(4) != gguf.MAGIC
    entries, meta = (_dat_entries if legacy else _gguf_entries)(path)
    return entries, meta, legacy


def load(path) -> dict:
    """``{weight name: float32 importance}`` of the imatrix file ``path``, the values ``llama-quantize
    --imatrix`` passes to ggml, bit for bit: GGUF ``in_sum2 / counts`` (``(K,)``, or ``(experts, K)``;
    an expert of count 0 gets ones), ``.dat`` values ``/ ncall`` (``(K,)``: a legacy entry of experts is
    its ``experts * K`` values in a row), each divided in float32. ValueError naming the file and the
    entry for a damaged file, or non-finite values (``llama-quantize`` stops on them too)."""
    entries, _, legacy = _entries(path)
    out = {}
    for name, (sums, counts) in entries.items():
        n = counts.astype(np.float32)[:, None]
        if legacy:
            v = sums / n if counts[0] > 0 else sums
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                v = np.where(n > 0, sums / np.where(n > 0, n, 1), np.float32(1))
        v = v.astype(np.float32).reshape(-1 if legacy or len(counts) == 1 else v.shape)
        if not np.isfinite(v).all():
            raise ValueError(f"{os.fspath(path)}: imatrix entry {name!r} holds non-finite values (llama-quantize "
                             "refuses them too)")
        out[name] = v
    return out


def read(path, chunk_size=512):
    """``({weight name: ImportanceMatrix, or a list of them, one per expert}, {key: value})`` of the
    imatrix file ``path``: each collector holds the file's float32 sums exactly and its token count
    (an expert of count 0: an empty collector), so its ``result()`` is :func:`load`'s value and it
    merges with collectors of more tokens. The metadata: GGUF's keys as :func:`qarray.io.gguf.read`
    gives them; for a ``.dat`` file ``imatrix.chunk_count`` and ``imatrix.datasets`` where its
    trailer has them.

    A ``.dat`` file holds each entry's mean times ``ncall``, its chunks; ``chunk_size`` (the tokens a
    chunk, ``llama-imatrix -c``'s context, 512 by default) turns that back into sums and counts of
    tokens, as ``llama-imatrix --in-file`` does (its ``result()`` does not depend on it). Its
    sums must be sums of squares: finite and >= 0."""
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)) \
            or not 0 < chunk_size < 1 << 29:
        raise ValueError(f"read: chunk_size is the tokens a chunk, an integer in [1, 2**29), got {chunk_size!r}")
    entries, meta, legacy = _entries(path)
    out = {}
    for name, (sums, counts) in entries.items():
        scale = int(chunk_size) if legacy else 1
        experts = []
        for s, c in zip(sums, counts):
            if c <= 0 and legacy:
                raise ValueError(f"{os.fspath(path)}: imatrix .dat entry {name!r} has ncall {int(c)}; a "
                                 "collector needs tokens (load gives llama-quantize's values for it)")
            if c <= 0:
                if np.any(s != 0):
                    raise ValueError(f"{os.fspath(path)}: imatrix entry {name!r} has nonzero sums over 0 tokens")
                experts.append(ImportanceMatrix())
                continue
            try:
                experts.append(ImportanceMatrix.from_sums(s.astype(np.float64) * scale, int(c) * scale))
            except ValueError as e:
                raise ValueError(f"{os.fspath(path)}: imatrix entry {name!r}: {e}") from None
        out[name] = experts[0] if len(experts) == 1 else experts
    return out, meta


def _experts(name, m):
    """``(sums float32 (experts, K), counts (experts,), single)`` of a collector or a list of them."""
    single = isinstance(m, ImportanceMatrix)
    ms = [m] if single else list(m) if isinstance(m, (list, tuple)) else None
    if not ms or not all(isinstance(e, ImportanceMatrix) for e in ms):
        raise TypeError(f"save: {name!r} is a {type(m).__name__}; give an ImportanceMatrix, or a list of them "
                        "(one per expert)")
    k = {e.columns for e in ms} - {None}
    if not k:
        raise ValueError(f"save: {name!r}: no activations observed yet (an imatrix entry needs its columns)")
    if len(k) > 1:
        raise ValueError(f"save: {name!r}: the experts' collectors have {sorted(k)} columns; one K for all")
    k = k.pop()
    sums = np.stack([e.totals() if e.columns else np.zeros(k, np.float32) for e in ms])
    if not np.isfinite(sums).all():
        raise ValueError(f"save: {name!r}: a column's sum passes float32's range, which the file holds")
    return sums, np.array([e.count for e in ms], np.int64), single


def save(path, matrices: dict, *, datasets=("qarray",), chunk_size=512, format="gguf") -> None:
    """Write ``{weight name: ImportanceMatrix, or a list of them, one per expert}`` to the imatrix file
    ``path`` for ``llama-quantize --imatrix`` (and ``llama-imatrix --in-file``), entries in name order as
    ``llama-imatrix`` writes them. The names are the GGUF model's tensors (``blk.0.attn_q.weight``).

    ``format="gguf"``: each column's sum rounded to float32 (:meth:`ImportanceMatrix.totals`) and the
    token counts; ``datasets`` (strings: what the statistics were collected on) and ``chunk_size``
    (tokens a chunk) go to the metadata, with the chunk count, the most tokens of an entry over
    ``chunk_size``, as ``llama-imatrix`` counts it. ``format="dat"``: the legacy file, each value
    the float32 sum over the count times ``ncall`` (the entry's chunks, rounded up), in float32 as
    ``llama-imatrix`` computes it, and the last of ``datasets``. A file ``llama-imatrix`` wrote,
    :func:`read` and written again with its metadata and chunk size, has the same bytes (each format
    is tested so on one of its files)."""
    if format not in FORMATS:
        raise ValueError(f"save: format is one of {', '.join(FORMATS)}, got {format!r}")
    if not isinstance(matrices, dict) or not matrices:
        raise TypeError("save: takes a non-empty dict of weight name -> ImportanceMatrix (or a list per expert)")
    if isinstance(datasets, str) or not all(isinstance(d, str) for d in datasets) or not datasets:
        raise TypeError(f"save: datasets is a non-empty list of strings, got {datasets!r}")
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)) \
            or not 0 < chunk_size < 1 << 31:
        raise ValueError(f"save: chunk_size is the tokens a chunk, an integer in [1, 2**31), got {chunk_size!r}")
    for name in matrices:
        if not isinstance(name, str) or not name:
            raise TypeError(f"save: the weight names are non-empty strings, got {name!r}")
    entries = {name: _experts(name, matrices[name]) for name in sorted(matrices)}
    chunks = max(int(c.max()) for _, c, _ in entries.values()) // int(chunk_size)
    if format == "gguf":
        tensors = {}
        for name, (sums, counts, single) in entries.items():
            tensors[name + SUMS] = sums[0] if single else sums
            tensors[name + COUNTS] = counts.astype(np.float32).reshape((1,) if single else (-1, 1))
        meta = {"general.type": "imatrix", "imatrix.datasets": list(datasets),
                "imatrix.chunk_count": np.uint32(chunks), "imatrix.chunk_size": np.uint32(chunk_size)}
        return gguf.save(path, tensors, meta)
    out = [struct.pack("<i", len(entries))]
    for name, (sums, counts, _) in entries.items():
        ncall = -(-int(counts.max()) // int(chunk_size))
        with np.errstate(divide="ignore", invalid="ignore"):  # an expert of no tokens: 1, as llama-imatrix
            mean = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1).astype(np.float32)[:, None], 1)
        values = (mean.astype(np.float32) * np.float32(ncall)).astype("<f4")
        raw = name.encode()
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, values.size), values.tobytes()]
    dataset = datasets[-1].encode()
    out += [struct.pack("<ii", chunks, len(dataset)), dataset]
    with open(path, "wb") as f:
        f.write(b"".join(out))


__all__ = ["load", "read", "save"]
