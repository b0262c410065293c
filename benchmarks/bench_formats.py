"""Floating-format benchmark: float8 quantize, MX and NVFP4, exact MXFP8 matmul.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_formats.py [OUTDIR] [--quick]

Rows are ratios of medians to peers measured in the same run (the timer and
report of bench_ops.py), against the targets of issue 15:

- ``quantize`` of 2**24 float32 values to float8_e4m3fn per tensor: <= 1.2x
  qarray's qint8 quantize, <= 0.5x ml_dtypes' ``astype``, <= 1.0x PyTorch's
  ``(x / s).to(torch.float8_e4m3fn)``;
- ``quantize_mx(..., "mxfp4")`` and ``quantize_nvfp4`` of a 4096x4096 float32
  matrix: <= 1.0x torchao's CPU reference (``to_mx``, ``nvfp4_quantize``; when
  torchao is installed), <= 2x qint4 blocked ``quantize_dynamic``;
- exact MXFP8 e4m3 matmul 1024x1024x1024: <= 2x float64 ``numpy.matmul``.

Results go to OUTDIR/bench_formats.{json,txt} (default benchmarks/results).
``--quick``: small sizes, 3 repeats.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import options, timeit, torch, write  # noqa: E402  (peers, after OMP_WAIT_POLICY)
import numpy as np  # noqa: E402  (after _timing: OpenBLAS reads its settings as it loads)
import bench_ops  # noqa: E402  (its say / report and their LINES / ROWS)
from bench_ops import report, say  # noqa: E402
import ml_dtypes  # noqa: E402
import qarray  # noqa: E402

try:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
except Exception:  # not installed, or without its compiled parts
    to_mx = None

REPEATS = 9


def bench_float8(rng, n):
    x = rng.standard_normal(n).astype(np.float32)
    s = np.float32(0.05)
    fns = {
        "qarray quantize float8_e4m3fn": lambda: qarray.quantize(x, s, 0, "float8_e4m3fn"),
        "qarray quantize qint8": lambda: qarray.quantize(x, s, 0, "qint8"),
        "ml_dtypes astype": lambda: (x / s).astype(ml_dtypes.float8_e4m3fn),
    }
    if torch is not None:
        xt = torch.from_numpy(x)
        fns["torch (x / s).to(float8_e4m3fn)"] = lambda: (xt / s).to(torch.float8_e4m3fn)
    t = timeit(REPEATS, **fns)
    ours, shape = ["qarray quantize float8_e4m3fn"], f"{n}"
    report("quantize float8", shape, t, "qarray quantize qint8", 1.2, ours)
    report("quantize float8", shape, t, "ml_dtypes astype", 0.5, ours)
    report("quantize float8", shape, t, "torch (x / s).to(float8_e4m3fn)", 1.0, ours)


def bench_blocks(rng, n):
    x = rng.standard_normal((n, n)).astype(np.float32)
    fns = {
        "qarray quantize_mx mxfp4": lambda: qarray.quantize_mx(x, "mxfp4"),
        "qarray quantize_nvfp4": lambda: qarray.quantize_nvfp4(x),
        "qarray quantize_dynamic qint4 block 32": lambda: qarray.quantize_dynamic(x, "qint4", axis=1, block_size=32),
    }
    if to_mx is not None:
        xt = torch.from_numpy(x)
        fns["torchao to_mx fp4 (floor)"] = lambda: to_mx(xt, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
        fns["torchao nvfp4_quantize"] = lambda: nvfp4_quantize(xt, 16, per_tensor_amax_to_scale(xt.abs().amax()))
    t = timeit(max(3, REPEATS // 3), **fns)
    shape = f"{n}x{n}"
    report("quantize_mx mxfp4", shape, t, "torchao to_mx fp4 (floor)", 1.0, ["qarray quantize_mx mxfp4"])
    report("quantize_nvfp4", shape, t, "torchao nvfp4_quantize", 1.0, ["qarray quantize_nvfp4"])
    for ours in ("qarray quantize_mx mxfp4", "qarray quantize_nvfp4"):
        report(ours[7:], shape, t, "qarray quantize_dynamic qint4 block 32", 2.0, [ours])


def bench_matmul(rng, n):
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    qa = qarray.quantize_mx(a, "mxfp8_e4m3")  # blocks along K
    qb = qarray.quantize_mx(b, "mxfp8_e4m3", axis=0)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    t = timeit(max(3, REPEATS // 3), **{
        "qarray exact matmul mxfp8 (float32 out)": lambda: qarray.matmul(qa, qb),
        "numpy float64 matmul": lambda: a64 @ b64,
    })
    report("matmul mxfp8_e4m3 exact", f"{n}x{n}x{n}", t, "numpy float64 matmul", 2.0)


def main(outdir: Path, quick: bool):
    global REPEATS
    REPEATS = 3 if quick else REPEATS
    rng = np.random.default_rng(0)
    info = dict(platform=platform.platform(), cpu_count=os.cpu_count(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                python=platform.python_version(), numpy=np.__version__, ml_dtypes=ml_dtypes.__version__,
                torch=getattr(torch, "__version__", None), torchao=to_mx is not None, quick=quick)
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    say("times: median (min) ms; ratios of medians and of mins to the reference; targets judged on the medians")
    bench_float8(rng, 1 << (16 if quick else 24))
    bench_blocks(rng, 256 if quick else 4096)
    bench_matmul(rng, 128 if quick else 1024)
    write(outdir, "bench_formats", bench_ops.LINES, machine=info, rows=bench_ops.ROWS)


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
