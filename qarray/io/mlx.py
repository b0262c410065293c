"""MLX checkpoints (mlx-lm's: ``config.json`` ``"quantization": {"group_size", "bits",
"mode"}``, with per-module overrides keyed by the module's path), affine mode.

A linear ``P`` stores ``P.weight`` (uint32 ``[N, K * bits / 32]``: element ``i`` of a
row at bit ``i * bits`` of its little-endian words), ``P.scales`` and ``P.biases``
(``[N, K / group]``, the model's float type). MLX dequantizes ``scales * q + biases``
in that type, rounding after the multiply and after the add: the grouped format
``uint{bits}_g{G}_{type}_bias``. Scales may be negative (MLX picks the edge of larger
magnitude as its reference).
"""

from __future__ import annotations

import numpy as np

from .hf import Grouped, from_qarray, pack_words, scale_type, stored, to_qarray, unpack_words


def _spec(config: dict, module: str):
    q = config.get("quantization") or config.get("quantization_config") or {}
    own = q.get(module)
    if own is False:
        return None
    own = own if isinstance(own, dict) else q
    if own.get("mode", "affine") != "affine":
        raise ValueError(f"{module}: MLX mode {own.get('mode')!r}: qarray reads the affine mode")
    return int(own.get("bits", 4)), int(own.get("group_size", 64))


def read(tensors, config: dict) -> dict:
    out = {}
    for p in sorted(n[: -len(".scales")] for n in tensors.names() if n.endswith(".scales")):
        if f"{p}.biases" not in tensors or f"{p}.weight" not in tensors:
            raise ValueError(f"{p}: an MLX affine layer has weight, scales and biases; this one lacks "
                             + ("biases" if f"{p}.biases" not in tensors else "weight"))
        spec = _spec(config, p)
        if spec is None:
            continue
        bits, group = spec
        w, s, b = tensors[f"{p}.weight"], tensors[f"{p}.scales"], tensors[f"{p}.biases"]
        n, groups = s.shape
        k = groups * group
        if w.dtype != np.uint32 or w.shape != (n, k * bits // 32) or b.shape != s.shape:
            raise ValueError(f"{p}: weight {w.dtype} {list(w.shape)} with scales {list(s.shape)} is not {bits}-bit "
                             f"codes in groups of {group} (bits and group_size of config.json)")
        codes = unpack_words(w, bits, k)
        out[f"{p}.weight"] = to_qarray(f"uint{bits}", Grouped(codes, s, bias=b), scale_type(s.dtype), p)
        tensors.used.update(f"{p}.{x}" for x in ("weight", "scales", "biases"))
    return out


def write(weights: dict) -> tuple:
    """mlx-lm's tensors and quantization config for ``{name: QArray}`` of ``uint{bits}_g{G}_{type}_bias``
    formats (MLX's own: a per-module entry where one differs from the first)."""
    tensors, qc = {}, {}
    for name, q in weights.items():
        g = from_qarray(q, name)
        f = q.dtype.layout
        if g.bias is None or not f.name.startswith("uint") or q.columns is not None:
            raise ValueError(f"{name}: MLX holds unsigned codes with a scale and a bias per group; {f.name} is not "
                             "one (convert with --requantize)")
        p = name[: -len(".weight")] if name.endswith(".weight") else name
        spec = {"group_size": f.block, "bits": f.bits, "mode": "affine"}
        if not qc:
            qc.update(spec)
        elif spec != {k: qc[k] for k in spec}:
            qc[p] = spec
        tensors[f"{p}.weight"] = pack_words(g.codes, f.bits).view(np.uint32)
        tensors[f"{p}.scales"], tensors[f"{p}.biases"] = stored(g.scale, f.precision), stored(g.bias, f.precision)
    return tensors, qc
