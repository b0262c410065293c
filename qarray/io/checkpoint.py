"""Hugging Face checkpoint directories: ``load`` reads one by its convention
(``quantization_config``'s ``quant_method``; MLX's ``quantization``), ``save`` writes
compressed-tensors, MLX or GPTQ (:mod:`qarray.io.hf` and one module per convention)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from .. import backends
from .._qarray import QArray
from . import bnb, compressed_tensors, gptq, mlx, modelopt
from .hf import Tensors, is_checkpoint, read_json, write  # noqa: F401

READERS = {"gptq": lambda t, qc, config: gptq.read(t, qc),
           "awq": lambda t, qc, config: gptq.read_awq(t, qc),
           "compressed-tensors": lambda t, qc, config: compressed_tensors.read(t, qc),
           "bitsandbytes": lambda t, qc, config: bnb.read(t, qc),
           "modelopt": lambda t, qc, config: modelopt.read(t, qc),
           "mlx": lambda t, qc, config: mlx.read(t, config)}
WRITERS = {"compressed-tensors": compressed_tensors.write, "mlx": mlx.write, "gptq": gptq.write}
_SHAPES = {"q_proj": ("heads", "hidden_size"), "k_proj": ("kv", "hidden_size"), "v_proj": ("kv", "hidden_size"),
           "o_proj": ("hidden_size", "heads"), "gate_proj": ("intermediate_size", "hidden_size"),
           "up_proj": ("intermediate_size", "hidden_size"), "down_proj": ("hidden_size", "intermediate_size")}


def tokenize_path(path, st) -> str:
    """A name for a checkpoint's dask tasks: its path and config.json's size and time."""
    return hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def quant_method(config):
    """``(quant_method, its config)`` of a checkpoint's config.json, or ``(None, None)``."""
    if "quantization" in config:  # mlx-lm's (which mirrors it as quantization_config, without a quant_method)
        return "mlx", config["quantization"]
    if "quantization_config" in config:
        return config["quantization_config"].get("quant_method"), config["quantization_config"]
    return None, None


def _check_shapes(path, config, weights):
    """A weight whose shape disagrees with config.json's sizes raises (Llama-style module names)."""
    heads, hd = config.get("num_attention_heads"), config.get("head_dim")
    if heads and not hd and config.get("hidden_size"):
        hd = config["hidden_size"] // heads
    sizes = dict(config, heads=heads and hd and heads * hd,
                 kv=hd and (config.get("num_key_value_heads") or heads) * hd)
    for name, q in weights.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        want = _SHAPES.get(module)
        if want and all(sizes.get(w) for w in want):
            shape = tuple(int(sizes[w]) for w in want)
            if tuple(q.shape) != shape:
                raise ValueError(f"{path}: {name} is {list(q.shape)}, but config.json's "
                                 f"{' and '.join(want)} make it {list(shape)}")


def load(path, chunks=None) -> dict:
    """``{name: QArray or numpy.ndarray}`` of the checkpoint directory ``path``: its quantized
    weights as QArrays of the float weight's shape, every other tensor as it is stored. With
    ``chunks`` (rows, or ``"auto"``: about 64 MiB of bytes a chunk), Dask-backed QArrays and dask
    arrays instead, each chunk read from the files (and its groups made blocks) as Dask computes it."""
    config = read_json(os.path.join(path, "config.json"), "config")
    method, qc = quant_method(config)
    tensors = Tensors(path)
    if method is None:
        layers = {}
    elif method not in READERS:
        raise ValueError(f"{path}: quant_method {method!r}; qarray reads {', '.join(READERS)}")
    else:
        layers = READERS[method](tensors, qc, config)
    rest = [name for name in tensors.names() if name not in tensors.used]
    if chunks is None:
        out = {name: layer.make(slice(0, layer.n)) for name, layer in layers.items()}
        _check_shapes(path, config, out)
        return dict(out, **{name: tensors[name] for name in rest})
    out = {name: _lazy(path, name, layer, chunks) for name, layer in layers.items()}
    _check_shapes(path, config, out)
    return dict(out, **{name: tensors.lazy(name) for name in rest})


def _lazy(path, name, layer, chunks):
    """A Dask-backed QArray of ``layer``, chunks of whole rows (``layer.align`` divides each)."""
    import dask.array as da

    probe = layer.make(slice(0, min(layer.n, layer.align)))  # its format, row bytes and parameters
    row = probe.data.shape[-1]
    if chunks == "auto":
        step = max(1, (64 << 20) // max(row, 1))
    elif isinstance(chunks, int) and not isinstance(chunks, bool) and chunks > 0:
        step = chunks
    else:
        raise ValueError(f"load: chunks must be a positive number of rows or 'auto', got {chunks!r}")
    step = max(layer.align, step // layer.align * layer.align)
    sizes = tuple(min(step, layer.n - a) for a in range(0, layer.n, step)) or (0,)

    def part(block_info=None):
        a, b = block_info[None]["array-location"][0]
        return np.ascontiguousarray(layer.make(slice(a, b)).data)

    st = os.stat(os.path.join(path, "config.json"))
    x = da.map_blocks(part, chunks=(sizes, (row,)), dtype=np.uint8, meta=np.empty((0, 0), np.uint8),
                      name=f"qarray-checkpoint-{tokenize_path(path, st)}-{name}")
    return QArray._blocks(x, probe.dtype, backends.get("dask"), probe.columns, probe.global_scale)


def save(path, arrays: dict, format: str, config=None) -> None:
    """The checkpoint directory ``path`` in ``format`` (compressed-tensors, mlx, gptq): the QArrays as that
    convention's tensors, plain arrays as they are."""
    if format not in WRITERS:
        raise ValueError(f"save: format {format!r}; qarray writes {', '.join(WRITERS)}")
    weights = {k: v for k, v in arrays.items() if hasattr(v, "dtype") and getattr(v.dtype, "kind", "") == "block"}
    tensors, qc = WRITERS[format](weights)
    plain = {k: v for k, v in arrays.items() if k not in weights}
    clash = set(tensors) & set(plain)
    if clash:
        raise ValueError(f"save: {sorted(clash)[0]!r} is both a plain array and a {format} tensor of a QArray")
    tensors.update(plain)
    if format == "mlx":
        write(path, tensors, qc, "quantization", dict(config or {}, quantization_config=qc))
    else:
        write(path, tensors, qc, config=config)
