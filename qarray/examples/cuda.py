"""CUDA: quantize, dequantize and linear on the GPU (CuPy backend), checked bit for bit against NumPy.

The same float32 data goes through the NumPy backend and, as CuPy arrays,
through the CuPy backend (qarray's CUDA kernels): quantize per tensor (qint8),
per channel (quint8) and in 4-bit blocks; dequantize each back to float32;
``linear`` with int8 per-channel weights as the exact qint32 accumulator and
requantized to quint8 with a bias and a fused ReLU. Codes must be equal and
floats equal to the bit; the table gives the median time of each side (the
first CUDA call compiles the kernels, CuPy then caches them on disk). Without
CuPy or a GPU it says so in one line and returns 0. ``--backend`` is accepted
for uniformity: this example always runs both.

Run: ``python -m qarray.examples.cuda [--quick]``
"""

from __future__ import annotations

import numpy as np

import qarray as qa
from qarray._params import to_host

from . import _common

NAME = "cuda"


def _bits(a):
    """What must match: the codes of a QArray, the bits of a float array."""
    a = to_host(a.int_repr() if isinstance(a, qa.QArray) else a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def run(quick: bool = False) -> dict:
    """``{"device": name or None, "reason": why not (or None), "checks":
    [{"name", "shape", "equal", "numpy_ms", "cupy_ms"}]}``; no checks without a GPU."""
    problem = _common.gpu_problem()
    if problem is not None:
        return {"device": None, "reason": problem, "checks": []}
    import cupy

    rng = np.random.default_rng(0)
    m, k, n = (64, 256, 128) if quick else (1024, 1024, 1024)
    x = (3 * rng.standard_normal((m * 16, k))).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    channel_scales = rng.uniform(0.01, 0.05, k).astype(np.float32)
    quantize = {
        "quantize qint8 per tensor": lambda xp: qa.quantize(xp.asarray(x), 0.03, 3, "qint8"),
        "quantize quint8 per channel": lambda xp: qa.quantize(xp.asarray(x), xp.asarray(channel_scales), 128,
                                                              "quint8", axis=1),
        "quantize qint4 blocks of 32": lambda xp: qa.quantize_dynamic(xp.asarray(x), "qint4", axis=1, block_size=32),
    }
    steps = {}
    for name, make in quantize.items():
        made = {lib: make(lib) for lib in (np, cupy)}
        steps[name] = make
        steps["de" + name] = lambda xp, made=made: made[xp].dequantize()

    def layers(xp):
        qx = qa.quantize(xp.asarray(x[:m]), 0.05, 128, "quint8")
        return qx, qa.nn.Linear.from_float(xp.asarray(w), bias)

    lin = {lib: layers(lib) for lib in (np, cupy)}
    steps["linear -> qint32 accumulator"] = lambda xp: lin[xp][1](lin[xp][0])
    steps["linear -> quint8, bias, ReLU"] = lambda xp: lin[xp][1](lin[xp][0], 0.1, 0, "quint8", relu=True)
    checks = []
    repeats = 3 if quick else 20
    for name, step in steps.items():
        want, got = step(np), step(cupy)
        checks.append({"name": name, "shape": tuple(got.shape), "equal": bool(np.array_equal(_bits(want), _bits(got))),
                       "numpy_ms": _common.median_ms(lambda: step(np), repeats),
                       "cupy_ms": _common.median_ms(lambda: step(cupy), repeats, cupy)})
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return {"device": device.decode() if isinstance(device, bytes) else str(device), "reason": None, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    args = _common.parse_args(NAME, __doc__, argv)
    if _common.missing(NAME, ("rich",)):
        return 1
    r = run(args.quick)
    if r["device"] is None:
        print(f"cuda: no GPU here, nothing to check ({r['reason']})")
        return 0
    _common.print_table(
        f"cuda: CuPy backend vs NumPy backend on {r['device']}",
        ("step", "shape", "bit for bit", "numpy ms", "cupy ms"),
        [(c["name"], "x".join(map(str, c["shape"])), "yes" if c["equal"] else "NO",
          f"{c['numpy_ms']:.3f}", f"{c['cupy_ms']:.3f}") for c in r["checks"]])
    return 0 if all(c["equal"] for c in r["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
