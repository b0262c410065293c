"""NVIDIA ModelOpt NVFP4 checkpoints (``quant_method`` ``"modelopt"``, ``quant_algo``
``"NVFP4"``; TensorRT-LLM's and vLLM's).

A linear ``P`` stores ``P.weight`` (uint8 ``[N, K / 2]``: e2m1 codes, the even element
in the low nibble), ``P.weight_scale`` (float8_e4m3fn ``[N, K / 16]``) and
``P.weight_scale_2`` (float32, one a tensor: ``amax / (6 * 448)``). ModelOpt
dequantizes ``e2m1 * (float32(weight_scale) * weight_scale_2)`` in float32: the
grouped format ``e2m1_g16_e4m3_gmul`` with ``weight_scale_2`` its tensor scale.
"""

from __future__ import annotations

import numpy as np

from .hf import Grouped, Layer, nibbles, to_qarray


def read(tensors, qc: dict) -> dict:
    algo = str(qc.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise ValueError(f"ModelOpt quant_algo {qc.get('quant_algo')!r}: qarray reads NVFP4")
    group = int(qc.get("group_size", 16))
    if group != 16:
        raise ValueError(f"ModelOpt NVFP4 with group_size {group}: NVFP4's blocks are 16")
    out = {}
    for p in sorted(n[: -len(".weight_scale_2")] for n in tensors.names() if n.endswith(".weight_scale_2")):
        (dtype, (n, half)), scale = (tensors.dtype(f"{p}.weight"), tensors.shape(f"{p}.weight")), tensors[f"{p}.weight_scale"]
        if dtype != np.uint8 or scale.shape != (n, half // 8):
            raise ValueError(f"{p}: weight {dtype} {[n, half]} and weight_scale {list(scale.shape)} are not NVFP4's "
                             "codes and block scales")
        g = np.asarray(tensors[f"{p}.weight_scale_2"], np.float32).reshape(-1)[0]

        def make(rows, p=p, k=2 * half, scale=scale.view(np.uint8), g=g):
            codes = tensors.read(f"{p}.weight", rows)
            return to_qarray("e2m1", Grouped(nibbles(codes, len(codes), k), scale[rows]), "e4m3", p, ("_gmul", g))
        out[f"{p}.weight"] = Layer(n, make)
        tensors.used.update(f"{p}.{x}" for x in ("weight", "weight_scale", "weight_scale_2"))
    return out
