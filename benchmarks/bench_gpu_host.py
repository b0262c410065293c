"""The CuPy backend's host path, measured without a GPU: what each op costs in
Python before and between its kernel launches, on small inputs where nothing
else counts.

    python benchmarks/bench_gpu_host.py [OUTDIR] [--quick]

Runs the real ``CupyBackend`` on the tests' stand-in CuPy (NumPy arrays that
refuse host conversion; ``tests/cuda_host/fake_cupy``) with every kernel launch
and cuBLAS call stubbed to do nothing, so a call's time is the Python it runs
plus the stand-in's own array calls. Per op: the median time per call over
blocks of calls (and the spread), its kernel launches, device allocations and
host <-> device copies per call. The peer, measured in the same run: the floor
of any op on this stand-in, one output allocation and one stubbed launch. The
same ops on a GPU (``HOST_OPS``) are timed with ``cupyx.profiler.benchmark`` in
``bench_gpu.py``, whose target is 40 us of host time per call, no sync.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import numpy as np  # noqa: E402
from _timing import options  # noqa: E402


def host_inputs():
    """The small inputs (host arrays): 16x64 float32 activations, 16x64 int32
    accumulator codes, 64x64 float32 weights and their bias."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    acc = rng.integers(-(2**20), 2**20, (16, 64)).astype(np.int32)
    return x, acc, rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)


def host_ops(cupy, qarray):
    """``{name: call}`` on ``host_inputs()`` moved by ``cupy.asarray`` (NumPy's
    for the CPU): the calls whose host time the GPU issue measured, for the
    GPU benchmarks and bench_overhead.py."""
    x, acc, w, bias = (cupy.asarray(a) for a in host_inputs())
    q = qarray.quantize(x, 0.05, 3, "qint8")
    q2 = qarray.quantize(x, 0.04, -2, "qint8")
    q32 = qarray.QArray.from_int(acc, 1e-4, 0, "qint32")
    # parameters given, not chosen from the data: with launches stubbed (bench_gpu_host's stand-in) a
    # device result is whatever the new memory held, and from_float's range could come out inf
    layer = qarray.nn.Linear(qarray.quantize(w, np.full(64, 0.02, np.float32), 0, "qint8", axis=0), bias)
    out = dict(scale=0.2, zero_point=1, dtype="qint8")
    return {
        "quantize 16x64 float32 -> qint8": lambda: qarray.quantize(x, 0.05, 3, "qint8"),
        "dequantize 16x64 qint8": lambda: q.dequantize(),
        "requantize 16x64 qint32 -> qint8": lambda: q32.requantize(0.05, 0, "qint8"),
        "add 16x64 + 16x64 -> qint8": lambda: qarray.add(q, q2, **out),
        "nn.Linear M=16 64->64 -> qint8": lambda: layer(q, **out),
        "nn.Linear M=1 64->64 -> qint8": lambda: layer(q[:1], **out),
    }


def _stand_in():
    """The stand-in CuPy, the real CupyBackend registered for it, launches stubbed;
    returns ``(cupy, qarray, launches)``, ``launches`` counting the stubbed calls."""
    sys.path.insert(0, str(ROOT / "tests" / "cuda_host" / "fake_cupy"))
    import cupy

    import qarray
    import qarray.backends as qb
    from qarray.backends.cupy import CupyBackend

    launches = [0]

    class Function:
        ptr = 0

    class Kernel:  # cupy.RawKernel as the backend calls it
        kernel = Function()

        def __call__(self, grid, block, args, *, shared_mem=0):
            launches[0] += 1

    class Module:
        def __init__(self, *, code, options):
            pass

        def get_function(self, name):
            return Kernel()

    def gemm(*args):
        launches[0] += 1

    cupy.RawModule = Module
    cupy.cuda.cublas = types.SimpleNamespace(gemmEx=gemm)
    cupy.cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 0)
    qb.register(CupyBackend())
    return cupy, qarray, launches


def per_call_us(fn, calls, blocks=7):
    """Median and spread (min, max) of the time per call, in us, over ``blocks``."""
    for _ in range(max(10, calls // 20)):
        fn()
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times), min(times), max(times)


def main(outdir: Path, quick: bool):
    cupy, qarray, launches = _stand_in()
    calls = 50 if quick else 1000
    lines, rows = [], []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    say(f"CupyBackend on the stand-in CuPy, launches stubbed; {calls} calls a block, median of 7 (spread)")
    kernel = cupy.RawModule(code="", options=()).get_function("floor")
    floor, lo, hi = per_call_us(lambda: kernel((1,), (256,), (cupy.empty((16, 64), np.int8),)), calls)
    say(f"{'floor: one allocation + one stubbed launch':<40} {floor:7.1f} us ({lo:.1f}-{hi:.1f})")
    for name, fn in host_ops(cupy, qarray).items():
        fn()  # the first call may copy parameters over, once
        cupy.transfers.update(h2d=0, d2h=0)
        cupy.allocations[0], launches[0] = 0, 0
        fn()
        counts = dict(launches=launches[0], allocations=cupy.allocations[0], copies=sum(cupy.transfers.values()))
        us, lo, hi = per_call_us(fn, calls)
        rows.append(dict(op=name, us=us, spread=[lo, hi], floor_us=floor, ratio=us / floor, **counts))
        say(f"{name:<40} {us:7.1f} us ({lo:.1f}-{hi:.1f})  {us / floor:5.1f}x floor  "
            f"launches {counts['launches']}, allocations {counts['allocations']}, host<->device copies {counts['copies']}")
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "bench_gpu_host.txt").write_text("\n".join(lines) + "\n")
    (outdir / "bench_gpu_host.json").write_text(json.dumps(dict(floor_us=floor, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
