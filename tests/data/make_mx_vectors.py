"""Writes tests/data/mx_vectors.npz: MX and NVFP4 outputs of torchao's reference
code (pure PyTorch on the CPU), the independent reference of tests/test_mx.py.

Source: torchao 0.18.0 (pytorch/ao), torchao/prototype/mx_formats/mx_tensor.py
``to_mx`` (every element dtype x ScaleCalculationMode FLOOR/CEIL/EVEN/RCEIL, the
eager RCEIL fallback) and nvfp4_tensor.py ``nvfp4_quantize`` with
``per_tensor_amax_to_scale``; torch 2.13.0 CPU. Run with torchao installed:

    python tests/data/make_mx_vectors.py

The inputs hold normal, subnormal, zero, tie, NaN and inf values. Each row is 128
values, blocks of 32 (MX) or 16 (NVFP4) along it. Stored: the inputs, the E8M0
scale bits and element bits torchao gives (fp4 unpacked, one code a byte) and,
per row, what the test may compare (see ``departures`` below: the blocks where
torchao departs from the OCP spec on purpose or by accident).
"""

import numpy as np
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

ELEMS = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e2m3": "fp6_e2m3",
         "mxfp6_e3m2": "fp6_e3m2", "mxfp4": torch.float4_e2m1fn_x2}
MAXES = {"mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0, "mxfp6_e2m3": 7.5, "mxfp6_e3m2": 28.0, "mxfp4": 6.0}
MODES = {"floor": ScaleCalculationMode.FLOOR, "ceil": ScaleCalculationMode.CEIL,
         "even": ScaleCalculationMode.EVEN, "rceil": ScaleCalculationMode.RCEIL}


def inputs(rng):
    rows = []
    for mag in (1e-3, 0.3, 1.0, 7.0, 1e3, 1e20, 1e37):  # random blocks at many magnitudes
        for _ in range(3):
            rows.append(rng.standard_normal(128) * mag * np.exp2(rng.integers(-3, 4, 128) * (rng.random(128) < .3)))
    # ties: block amax a power of two times 1.5 or 1.75, elements at grid midpoints of every format
    for top in (1.5, 1.75, 1.0, 1.875):
        for p in (-20, 0, 7):
            r = rng.choice(np.arange(-64, 65) / 16.0, 128) * 2.0**p
            r[::32] = top * 2.0**(p + 2)
            rows.append(r)
    # amax just above / at a power of two times each format's max (RCEIL and CEIL edges)
    for m in MAXES.values():
        r = rng.uniform(-1, 1, 128) * m
        r[0], r[32], r[64], r[96] = m, np.nextafter(np.float32(m), np.float32(np.inf)), m * 2, -m / 2
        rows.append(r)
    r = rng.standard_normal(128)  # subnormal float32 values inside normal blocks
    r[1::2] = rng.uniform(-1, 1, 64) * 1e-39
    rows.append(r)
    x = np.array(rows, np.float32)
    special = np.array(rng.standard_normal((6, 128)), np.float32)
    special[0, :32] = 0  # an all-zero block
    special[0, 32:64] = -0.0
    special[1, 5] = np.nan  # NaN, +inf, -inf blocks
    special[1, 40] = np.inf
    special[1, 70] = -np.inf
    special[2, :32] = rng.uniform(-1, 1, 32) * 1e-40  # an all-subnormal block (scale 2**-127)
    special[3, :] = np.float32(3.3e38) * rng.uniform(-1, 1, 128)  # near float32's largest
    special[4, :] = 2.0**-120 * rng.uniform(-1, 1, 128)
    special[5, 32:64] = np.float32(2.0**-100)
    return np.concatenate([x, special]).astype(np.float32)


def main():
    rng = np.random.default_rng(20261204)
    x = inputs(rng)
    out = {"x": x}
    xt = torch.from_numpy(x)
    for fmt, elem in ELEMS.items():
        for mode, m in MODES.items():
            scale, data = to_mx(xt, elem, 32, m)
            bits = data.view(torch.uint8)
            if fmt == "mxfp4":
                bits = unpack_uint4(bits)
            out[f"{fmt}.{mode}.scale"] = scale.view(torch.uint8).numpy().reshape(x.shape[0], -1)
            out[f"{fmt}.{mode}.elements"] = bits.numpy().reshape(x.shape)
    finite = np.isfinite(x).all(axis=1)
    xf = torch.from_numpy(x[finite])
    gs = per_tensor_amax_to_scale(xf.abs().amax())
    s, data = nvfp4_quantize(xf, 16, gs)
    out["nvfp4.rows"] = np.flatnonzero(finite)
    out["nvfp4.global_scale"] = gs.numpy().astype(np.float32)
    out["nvfp4.scale"] = s.view(torch.uint8).numpy().reshape(len(xf), -1)
    out["nvfp4.elements"] = unpack_uint4(data.view(torch.uint8)).numpy().reshape(xf.shape)
    np.savez_compressed(__file__.replace("make_mx_vectors.py", "mx_vectors.npz"), **out)


if __name__ == "__main__":
    main()
