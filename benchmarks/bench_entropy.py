"""Entropy calibration of every weight of a ResNet-18, per channel, against ONNX Runtime.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_entropy.py [OUTDIR] [--quick]

The weights have torchvision resnet18's shapes (no torchvision needed): random
normal, Kaiming scale; the 41 one-dimensional tensors (batch-norm weights and
biases, the fc bias) per tensor, as the CLI keeps them, the rest per channel
(axis 0). ``Histogram(dtype, method="entropy", axis=0).update(w).qparams()`` for
each, qint8 symmetric and quint8 asymmetric: the total wall and CPU time. The
peer: ONNX Runtime's ``HistogramCollector`` ("entropy", 2048 bins, 128 quantized
bins: the size of qarray's two search views) collecting and searching one histogram, timed on a few
rows, against qarray's time per histogram in the same run. Results go to
OUTDIR/bench_entropy.{json,txt} (default benchmarks/results).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import options, ort, write  # noqa: E402
from qarray.observers import Histogram  # noqa: E402

LINES: list[str] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def resnet18_shapes():
    """The parameter shapes of torchvision's resnet18, in its order."""
    shapes, bn = [(64, 3, 7, 7)], [64]
    cin = 64
    for cout in (64, 128, 256, 512):
        for block in range(2):
            first = block == 0 and cout != 64
            shapes += [(cout, cin if block == 0 else cout, 3, 3), (cout, cout, 3, 3)]
            bn += [cout, cout]
            if first:
                shapes.append((cout, cin, 1, 1))
                bn.append(cout)
        cin = cout
    return shapes + [(1000, 512)], [(c,) for c in bn for _ in ("weight", "bias")] + [(1000,)]


def tensors(quick):
    rng = np.random.default_rng(0)
    weights, ones = resnet18_shapes()
    if quick:
        weights, ones = weights[:3], ones[:4]
    w = [(rng.standard_normal(s) * np.sqrt(2 / np.prod(s[1:]))).astype(np.float32) for s in weights]
    return w + [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in ones]


def calibrate(ts, dtype, symmetric):
    for t in ts:
        Histogram(dtype, method="entropy", symmetric=symmetric, axis=0 if t.ndim > 1 else None).update(t).qparams()


def ort_entropy(row):
    from onnxruntime.quantization.calibrate import HistogramCollector

    c = HistogramCollector("entropy", True, 2048, 128, 99.99, "same")
    with contextlib.redirect_stdout(io.StringIO()):
        c.collect({"x": [row]})
        c.compute_collection_result()


def main(outdir, quick):
    ts = tensors(quick)
    histograms = sum(t.shape[0] if t.ndim > 1 else 1 for t in ts)
    info = dict(platform=platform.platform(), cpu_count=os.cpu_count(), python=platform.python_version(),
                numpy=np.__version__, onnxruntime=getattr(ort, "__version__", None), tensors=len(ts),
                histograms=histograms, values=sum(t.size for t in ts), load=os.getloadavg()[0],
                date=datetime.datetime.now().isoformat(timespec="seconds"))
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    rows = []
    for dtype, symmetric in (("qint8", True), ("quint8", False)):
        wall, cpu = time.perf_counter(), time.process_time()
        calibrate(ts, dtype, symmetric)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rows.append(dict(who=f"qarray {dtype} symmetric={symmetric}", wall_s=round(wall, 3), cpu_s=round(cpu, 3),
                         ms_per_histogram=round(1e3 * wall / histograms, 3)))
        say(f"qarray Histogram entropy {dtype:6} symmetric={symmetric!s:5}: {wall:7.2f} s wall, {cpu:7.2f} s CPU "
            f"for {len(ts)} tensors, {histograms} histograms ({1e3 * wall / histograms:.2f} ms each)")
    if ort is not None:
        sample = [t.reshape(t.shape[0], -1)[0] for t in ts if t.ndim > 1][:: 4 if not quick else 1]
        wall = time.perf_counter()
        for r in sample:
            ort_entropy(r)
        each = (time.perf_counter() - wall) / len(sample)
        rows.append(dict(who="onnxruntime HistogramCollector entropy", ms_per_histogram=round(1e3 * each, 3),
                         sample=len(sample)))
        say(f"onnxruntime HistogramCollector entropy (2048 bins, one row): {1e3 * each:.1f} ms per histogram "
            f"({len(sample)} rows timed); the same {histograms} histograms: about {each * histograms:.0f} s")
        for r in rows[:-1]:
            r["ratio_to_onnxruntime"] = round(r["ms_per_histogram"] / (1e3 * each), 4)
            say(f"  {r['who']}: {r['ratio_to_onnxruntime']:.4f} of onnxruntime's time per histogram")
    write(outdir, "bench_entropy", LINES, machine=info, rows=rows)


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
