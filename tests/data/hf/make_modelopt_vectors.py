"""Make tests/data/hf/modelopt_nvfp4: an NVFP4 checkpoint as NVIDIA ModelOpt quantizes and
dequantizes it (NVFP4QTensor, its reference path in Python).

Run once, in a venv with torch 2.13.0 (CPU) and ModelOpt without its dependencies:

    pip install torch==2.13.0 safetensors ml_dtypes
    pip install --no-deps nvidia-modelopt==0.47.0 && pip install omegaconf pulp
    python tests/data/hf/make_modelopt_vectors.py

Writes, beside this script, ``modelopt_nvfp4/``:

- ``config.json`` (``quantization_config``: quant_method modelopt, quant_algo NVFP4, group_size 16)
  and ``model.safetensors`` (``P.weight`` uint8 codes two a byte, ``P.weight_scale`` float8_e4m3fn,
  ``P.weight_scale_2`` float32: ``NVFP4QTensor.quantize``'s outputs);
- ``expected.safetensors``: ``NVFP4QTensor.dequantize(dtype=float32)`` of each weight, ``[N, K]``;
- ``quantized.npz``: the float32 input ``x`` of the first layer and what ModelOpt made of it
  (``weight_scale`` bytes, ``weight_scale_2``, ``codes`` one a byte).
"""

import json
import os

import ml_dtypes
import numpy as np
import torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modelopt_nvfp4")


def hard(rng, n, k):
    """Rows that reach every corner: zeros, -0.0, a tiny constant, ties of e2m1 (after the scale),
    a ramp both ways, a wide spread."""
    x = rng.normal(size=(n, k)).astype(np.float32) * 0.05
    x[0], x[1], x[2, ::2], x[5] = 0, 1e-4, -3, 7.0
    x[3] = np.linspace(-1, 2, k)
    x[4] = -x[3]
    x[6] = rng.normal(size=k) * 1e4
    x[7, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, 6, 0, -0.0, 0, 0, 0, 0]
    return x


def main():
    rng = np.random.default_rng(2026)
    os.makedirs(OUT, exist_ok=True)
    tensors, expected = {}, {}
    for name, (n, k) in {"model.layers.0.mlp.up_proj": (16, 256), "model.layers.0.mlp.down_proj": (8, 128)}.items():
        x = hard(rng, n, k)
        qt, ws, ws2 = NVFP4QTensor.quantize(torch.from_numpy(x.copy()), 16)
        packed = qt._quantized_data.numpy()
        tensors[f"{name}.weight"] = packed
        tensors[f"{name}.weight_scale"] = ws.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        tensors[f"{name}.weight_scale_2"] = ws2.numpy().astype(np.float32).reshape(())
        deq = qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2, block_sizes={-1: 16})
        expected[f"{name}.weight"] = deq.numpy()
        if name.endswith("up_proj"):
            np.savez(os.path.join(OUT, "quantized.npz"), x=x, weight_scale=ws.view(torch.uint8).numpy(),
                     weight_scale_2=np.float32(ws2.item()),
                     codes=np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k))
    save_file(tensors, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    save_file(expected, os.path.join(OUT, "expected.safetensors"))
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump({"model_type": "qarray-test", "quantization_config": {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "producer": {"name": "modelopt", "version": "0.47.0"}}}, f, indent=2)


if __name__ == "__main__":
    main()
