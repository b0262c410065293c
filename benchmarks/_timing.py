"""What the benchmarks share: the command line (``[OUTDIR] [--quick]``), the import
order that keeps thread pools from spinning, the optional peers (torch,
onnxruntime), and the block-interleaved timer."""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

# Pool threads that spin after a parallel call steal the two cores from whatever
# runs next: make every pool wait passively, for all contenders alike. OpenMP's
# (torch's, and Numba's when its threading layer is OpenMP), and OpenBLAS's
# (NumPy's float32 matmul, the reference of the GEMM rows): its threads yield in
# a loop for 2**28 cycles (~0.1 s) after a call, and whatever ran next on two
# cores ran on one (nn.Linear 1024^3 right after it: 2.3 ms, against 1.3;
# torch's fbgemm likewise); 2**4 cycles here. Set before NumPy and torch load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# The optional peers, None where not installed.
warnings.filterwarnings("ignore", message=".*deprecated.*")  # torch's quantized dtypes
try:
    import torch
except ImportError:
    torch = None
try:
    import onnxruntime as ort
    from onnx import TensorProto, helper
except ImportError:
    ort = TensorProto = helper = None


RESULTS = Path(__file__).resolve().parent / "results"  # the committed results


def cpu() -> dict:
    """The CPU the figures depend on: its model, its vector and matrix flags,
    its clock (MHz, as /proc/cpuinfo reports it) and the 1-minute load."""
    import platform

    model, flags, mhz = platform.processor() or platform.machine(), [], None
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name"))
        flags = sorted(f for f in next(ln for ln in info if ln.startswith("flags")).split(":", 1)[1].split()
                       if f.startswith(("avx", "sse4", "fma", "f16c", "amx")))
        mhz = float(next(ln.split(":", 1)[1] for ln in info if ln.startswith("cpu MHz")))
    except (OSError, StopIteration, ValueError):
        pass
    return dict(cpu=model, cpu_flags=" ".join(flags), cpu_mhz=mhz, load_avg_1m=os.getloadavg()[0])


def options(doc: str, quick: bool = True, **paths: Path) -> argparse.Namespace:
    """``outdir`` (default ``benchmarks/results``) and ``quick`` from the command line.
    ``--quick`` runs small sizes and few repeats: a check that everything runs (and
    what ``qarray bench --quick`` shows), not a measurement to commit. ``paths``:
    ``--NAME PATH`` options with their defaults (a peer's build: ``bin=Path(...)``)."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("outdir", nargs="?", type=Path, default=RESULTS,
                   help="where the .json and .txt results go (default: benchmarks/results)")
    if quick:
        p.add_argument("--quick", action="store_true", help="small sizes, few repeats: seconds, not a measurement")
    for name, default in paths.items():
        p.add_argument(f"--{name}", type=Path, default=default, help=f"default: {default}")
    return p.parse_args()


def timeit(repeats, **fns):
    """{name: (median ms, min ms)}: after one warm-up each, the functions take
    turns in blocks of consecutive calls (three rounds), each block after
    untimed calls for at least 30 ms. Blocks and the untimed calls because what
    ran before would otherwise tax whichever function runs next: a peer's thread
    pool that spins after a call, or a single-threaded peer after which the idle
    core needs about 15 ms to come back to speed (measured: a parallel kernel's
    first three calls 2x slow after ml_dtypes' astype)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(3):
        for k, f in fns.items():
            warm = time.perf_counter() + 0.03
            f()
            while time.perf_counter() < warm:
                f()
            for _ in range(max(1, repeats // 3)):
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def write(outdir: Path, name: str, lines: list, **data) -> None:
    """``outdir/name.txt`` (the printed lines) and ``outdir/name.json`` (``data``)."""
    import json

    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{name}.txt").write_text("\n".join(lines) + "\n")
    (outdir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
