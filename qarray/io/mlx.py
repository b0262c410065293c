"""MLX checkpoints (mlx-lm's: ``config.json`` ``"quantization": {"group_size", "bits",
"mode"}``, with per-module overrides keyed by the module's path): the affine mode,
and the mxfp4 and nvfp4 modes (``P.weight`` uint32 of e2m1 codes, the first lowest,
``P.scales`` a byte a group: E8M0 over 32, E4M3 over 16; no tensor scale).

A linear ``P`` stores ``P.weight`` (uint32 ``[N, K * bits / 32]``: element ``i`` of a
row at bit ``i * bits`` of its little-endian words), ``P.scales`` and ``P.biases``
(``[N, K / group]``, the model's float type). MLX dequantizes ``scales * q + biases``
in that type, rounding after the multiply and after the add: the grouped format
``uint{bits}_g{G}_{type}_bias``. Scales may be negative (MLX picks the edge of larger
magnitude as its reference).
"""

from __future__ import annotations

import numpy as np

from .hf import Grouped, Layer, from_qarray, pack_words, scale_type, stored, to_qarray, unpack_words


def _spec(config: dict, module: str):
    q = config.get("quantization") or config.get("quantization_config") or {}
    own = q.get(module)
    if own is False:
        return None
    own = own if isinstance(own, dict) else q
    mode = own.get("mode", "affine")
    if mode not in _FP4 and mode != "affine":
        raise ValueError(f"{module}: MLX mode {mode!r}: qarray reads affine, mxfp4 and nvfp4")
    return mode, int(own.get("bits", 4)), int(own.get("group_size", _FP4.get(mode, (64,))[0]))


_FP4 = {"mxfp4": (32, "e8m0"), "nvfp4": (16, "e4m3")}  # group, scale type: no biases


def read(tensors, config: dict) -> dict:
    """``{name: hf.Layer}`` of the quantized linears among ``tensors`` (``hf.Tensors``)."""
    out = {}
    for p in sorted(n[: -len(".scales")] for n in tensors.names() if n.endswith(".scales")):
        spec = _spec(config, p)
        if spec is None:
            continue
        mode, bits, group = spec
        if f"{p}.weight" not in tensors or mode == "affine" and f"{p}.biases" not in tensors:
            raise ValueError(f"{p}: an MLX affine layer has weight, scales and biases; this one lacks "
                             + ("weight" if f"{p}.weight" not in tensors else "biases"))
        s, b = tensors[f"{p}.scales"], tensors[f"{p}.biases"] if mode == "affine" else None
        (n, groups), w = s.shape, (tensors.dtype(f"{p}.weight"), tensors.shape(f"{p}.weight"))
        k = groups * group
        if mode in _FP4 and (group != _FP4[mode][0] or s.dtype != np.uint8) or w != (np.uint32, (n, k * bits // 32)) \
                or b is not None and b.shape != s.shape:
            raise ValueError(f"{p}: weight {w[0]} {list(w[1])} with scales {s.dtype} {list(s.shape)} is not MLX's {mode} "
                             f"of {bits}-bit codes in groups of {group} (bits, group_size and mode of config.json)")
        tensors.used.update(f"{p}.{x}" for x in ("weight", "scales", "biases"))

        def make(rows, p=p, bits=bits, k=k, s=s, b=b, mode=mode):
            codes = unpack_words(tensors.read(f"{p}.weight", rows), bits, k)
            if mode in _FP4:  # e2m1 codes, 8 a word (the first lowest), a scale byte a group
                return to_qarray("e2m1", Grouped(codes, s[rows]), _FP4[mode][1], p)
            return to_qarray(f"uint{bits}", Grouped(codes, s[rows], bias=b[rows]), scale_type(s.dtype), p)
        out[f"{p}.weight"] = Layer(n, make)
    return out


def write(weights: dict) -> tuple:
    """mlx-lm's tensors and quantization config for ``{name: QArray}`` of ``uint{bits}_g{G}_{type}_bias``
    formats (affine), ``e2m1_g32_e8m0`` (mxfp4) or ``e2m1_g16_e4m3`` (nvfp4, no tensor scale): a
    per-module entry where one differs from the first."""
    tensors, qc = {}, {}
    modes = {f"g{g}_{t}": m for m, (g, t) in _FP4.items()}
    for name, q in weights.items():
        g = from_qarray(q, name)
        f = q.dtype.layout
        mode = "affine" if g.bias is not None and f.name.startswith("uint") else \
            modes.get(f.name.split("_", 1)[-1]) if f.name.startswith("e2m1") else None
        if mode is None or q.columns is not None:
            raise ValueError(f"{name}: MLX holds unsigned codes with a scale and a bias per group, mxfp4 "
                             f"(e2m1_g32_e8m0) or nvfp4 (e2m1_g16_e4m3); {f.name} is not one (convert with "
                             "--requantize)")
        p = name[: -len(".weight")] if name.endswith(".weight") else name
        spec = {"group_size": f.block, "bits": f.bits, "mode": mode}
        if not qc:
            qc.update(spec)
        elif spec != {k: qc[k] for k in spec}:
            qc[p] = spec
        tensors[f"{p}.weight"] = pack_words(g.codes, f.bits).view(np.uint32)
        if mode == "affine":
            tensors[f"{p}.scales"], tensors[f"{p}.biases"] = stored(g.scale, f.precision), stored(g.bias, f.precision)
        else:
            tensors[f"{p}.scales"] = np.ascontiguousarray(g.scale.astype(np.uint8))
    return tensors, qc
