"""``qarray inspect FILE``: what a .npz, .npy, .safetensors or .gguf file, a
.zarr store or a Hugging Face checkpoint directory holds."""

from __future__ import annotations

import qarray
from .._params import to_host
from ..io import checkpoint, gguf
from ._files import _read, _read_gguf, _scheme, _stored_bytes
from ._shared import CliError, _need, _one_line, _shape, _table


def inspect(args) -> int:
    _need("rich", "pip install 'qarray[cli]'")
    if args.file.suffix.lower() == ".gguf":
        return _inspect_gguf(args.file)
    if checkpoint.is_checkpoint(args.file):
        return _inspect_checkpoint(args.file)
    quantized, arrays = _read(args.file)
    if not quantized:
        _table(str(args.file), ["name", "shape", "dtype", "bytes"],
               [(n, _shape(a), str(a.dtype), a.nbytes) for n, a in arrays.items()], left=3)
        return 0
    rows = []
    for name, q in arrays.items():
        if not isinstance(q, qarray.QArray):  # a NumPy array, or a Zarr store's dask array
            rows.append((name, _shape(q), str(q.dtype), "plain array", "", "", q.nbytes))
            continue
        s = to_host(q.scale)
        z = "" if q.zero_point is None else _span(to_host(q.zero_point), "{}")  # a block format's: in its blocks
        rows.append((name, _shape(q), q.dtype.name, _scheme(q), _span(s, "{:.6g}"), z, _stored_bytes(q, args.file)))
    _table(f"{args.file} (qarray file)", ["name", "shape", "dtype", "scheme", "scale", "zero point", "stored bytes"],
           rows, left=4)
    return 0


def _span(a, fmt) -> str:
    lo, hi = a.min(), a.max()
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)} .. {fmt.format(hi)}"


def _inspect_gguf(path) -> int:
    """A GGUF file's tensors (ggml type, shape, bits per weight, bytes) and metadata."""
    tensors, meta = _read_gguf(path)
    _table(f"{path} (GGUF metadata)", ["key", "type", "value"], [(k, *_meta_value(v)) for k, v in meta.items()], left=3)
    rows = [(n, _shape(t), gguf.type_name(t), f"{gguf.bits_per_weight(t):g}", t.nbytes) for n, t in tensors.items()]
    total = sum(r[-1] for r in rows)
    count = sum(t.size for t in tensors.values())
    _table(f"{path} (GGUF tensors)", ["name", "shape", "ggml type", "bits per weight", "bytes"], rows, left=3,
           caption=f"{len(rows)} tensors, {count} values in {total} bytes"
           + (f" ({8 * total / count:.3g} bits per value)" if count else ""))
    return 0


def _inspect_checkpoint(path) -> int:
    """A checkpoint directory's convention and tensors: each quantized weight's grouped format, shape
    and bits per weight (read lazily where Dask is there: only the probes of each layer)."""
    config = checkpoint.read_json(path / "config.json", "config")
    method, qc = checkpoint.quant_method(config)
    try:
        tensors = qarray.load(path, chunks="auto" if _has_dask() else None)
    except ValueError as e:
        raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None
    rows = []
    for name, t in tensors.items():
        if isinstance(t, qarray.QArray):
            f = t.dtype.layout
            extra = ("act-order " if t.columns is not None else "") + \
                ("" if t.global_scale is None else f"tensor scale {float(t.global_scale):.6g}")
            rows.append((name, _shape(t), t.dtype.name, f"{f.bits_per_weight:g}", extra.strip(), t.nbytes))
        else:
            rows.append((name, _shape(t), str(t.dtype), "", "", t.nbytes))
    _table(f"{path} ({method or 'not quantized'} checkpoint)", ["name", "shape", "dtype", "bits per weight", "",
                                                                "bytes"], rows, left=5,
           caption=f"{sum(isinstance(t, qarray.QArray) for t in tensors.values())} quantized of {len(rows)} tensors"
           + (f"; quantization_config {dict((k, v) for k, v in qc.items() if not isinstance(v, dict))}" if qc else ""))
    return 0


def _has_dask() -> bool:
    try:
        import dask.array  # noqa: F401
    except ImportError:
        return False
    return True


def _meta_value(v):
    """``(GGUF type, the value shown in a line)``: long arrays by their first items."""
    if isinstance(v, str):
        return "string", v if len(v) <= 60 else v[:57] + "..."
    if isinstance(v, list):
        return f"string[{len(v)}]", ", ".join(v[:5]) + (", ..." if len(v) > 5 else "")
    if getattr(v, "ndim", 0):
        return f"{v.dtype}[{v.size}]", ", ".join(map(str, v[:5].tolist())) + (", ..." if v.size > 5 else "")
    return ("bool" if v.dtype == bool else str(v.dtype)), str(v)
