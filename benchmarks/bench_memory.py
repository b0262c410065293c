"""Memory benchmark: peak traced memory of the core ops against input + output.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_memory.py

For each op, on both CPU paths (the Numba kernels, and the generic NumPy code
under ``qarray.config.using(numba=False)``), at 2**26 elements: tracemalloc's
peak while the op runs, the input included (it is allocated while tracing;
NumPy reports its array allocations to tracemalloc), divided by the input's
plus the output's bytes. The target is at most 1.5. Inputs: float32 for
quantize and quantize_dynamic, int32 for requantize (to qint8), int8 for the
rest; avg_pool2d on (1, 64, 1024, 1024) with kernel 2; per-axis, blocked and
repr on a square matrix (repr's output is its text). Each op runs once on a
small array first (Numba's compile cache is loaded then, not while tracing).
Nothing is asserted. Results go to benchmarks/results/bench_memory.{json,txt}.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _timing  # noqa: E402,F401  (OMP_WAIT_POLICY before any thread pool starts)
import qarray  # noqa: E402
from qarray import QArray  # noqa: E402

N = 1 << 26
POOL_SHAPE = (1, 64, 1024, 1024)  # N elements
SMALL = 1 << 16  # the warm-up size: above the Numba path's threshold
TARGET = 1.5
SCALE, ZP = 0.01, 3
RESULTS = ROOT / "benchmarks" / "results"


def nbytes(v):
    if isinstance(v, str):
        return len(v)
    return (v.data if isinstance(v, QArray) else v).nbytes


def int8_input(n):
    return QArray.from_int(np.resize(np.arange(-128, 128, dtype=np.int8), n), SCALE, ZP, "qint8")


def float_input(n):
    return np.resize(np.arange(-1000, 1000, dtype=np.float32) * np.float32(0.013), n)


def pool_input(n):
    side = math.isqrt(n // POOL_SHAPE[1])
    return int8_input(POOL_SHAPE[1] * side * side).reshape(1, POOL_SHAPE[1], side, side)


def square(make):
    """``make`` with its n elements as a square matrix."""
    return lambda n: make(n).reshape(math.isqrt(n), -1)


# name -> (make the input of n elements, the op)
OPS = {
    "quantize f32->qint8": (float_input, lambda x: qarray.quantize(x, SCALE, ZP, "qint8")),
    "quantize per-axis (axis 1)": (square(float_input),
                                   lambda x: qarray.quantize(x, np.full(x.shape[1], SCALE), ZP, "qint8", axis=1)),
    "quantize blocked (axis 1, 32)": (square(float_input), lambda x: qarray.quantize(
        x, np.full((x.shape[0], x.shape[1] // 32), SCALE), ZP, "qint8", axis=1, block_size=32)),
    "dequantize qint8->f32": (int8_input, lambda q: q.dequantize()),
    "requantize qint32->qint8": (
        lambda n: QArray.from_int(np.arange(n, dtype=np.int32) - np.int32(n // 2), 1e-4, 0, "qint32"),
        lambda q: q.requantize(0.05, 1, "qint8")),
    "quantize_dynamic f32->quint8": (float_input, lambda x: qarray.quantize_dynamic(x, "quint8")),
    "sum qint8": (int8_input, lambda q: qarray.sum(q)),
    "mean qint8": (int8_input, lambda q: qarray.mean(q)),
    "avg_pool2d qint8 k=2": (pool_input, lambda q: qarray.avg_pool2d(q, 2)),
    "repr qint8 (square)": (lambda n: int8_input(n).reshape(math.isqrt(n), -1), repr),
}


def measure(make, op):
    """``(input bytes, output bytes, peak traced bytes, seconds)`` of one call."""
    gc.collect()
    tracemalloc.start()
    try:
        x = make(N)
        in_bytes = nbytes(x)
        tracemalloc.reset_peak()
        t0 = time.perf_counter()
        y = op(x)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return in_bytes, nbytes(y), peak, seconds


def main():
    lines, rows = [], []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    try:
        import numba
        numba_version = numba.__version__
    except ImportError:
        numba_version = None
    machine = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                   cpu_count=os.cpu_count(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                   elements=N, python=platform.python_version(), numpy=np.__version__, numba=numba_version)
    say("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    say("ratio = peak traced memory (tracemalloc, input included) / (input + output bytes); target <= 1.5")
    head = f"{'operation':<30} {'path':<8} {'input MB':>9} {'output MB':>9} {'peak MB':>9} {'ratio':>6} {'met':>4} {'seconds':>8}"
    say(head)
    say("-" * len(head))
    paths = [("numba", True), ("generic", False)] if numba_version else [("generic", False)]
    for name, (make, op) in OPS.items():
        for path, use_numba in paths:
            with qarray.config.using(numba=use_numba):
                op(make(SMALL))  # warm-up: imports, Numba's cache
                in_b, out_b, peak, seconds = measure(make, op)
            ratio = peak / (in_b + out_b)
            met = "yes" if ratio <= TARGET else "no"
            rows.append(dict(op=name, path=path, input_bytes=in_b, output_bytes=out_b, peak_bytes=peak,
                             ratio=round(ratio, 3), target=TARGET, met=met, seconds=round(seconds, 3)))
            mb = 1 << 20
            say(f"{name:<30} {path:<8} {in_b / mb:9.1f} {out_b / mb:9.1f} {peak / mb:9.1f} {ratio:6.2f} {met:>4} {seconds:8.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_memory.json").write_text(json.dumps(dict(machine=machine, rows=rows), indent=1) + "\n")
    (RESULTS / "bench_memory.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
