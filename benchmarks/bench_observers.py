"""Calibration observers: Histogram.update over 2^24 float32 values against peers.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_observers.py [OUTDIR] [--quick]

qarray's Histogram.update (per tensor, and per channel with 64 channels along
axis 1) against numpy.histogram on the same data and, when PyTorch is
installed, torch.ao.quantization.HistogramObserver (2048 bins, per tensor);
MinMax.update against numpy min + max; the range choice (qparams) of each
method once the histogram is full. Medians (and mins) of blocks of calls in one
run; ratios to the peers measured in the same run. Results go to
OUTDIR/bench_observers.{json,txt} (default benchmarks/results).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import options, timeit, torch, write  # noqa: E402  (peers, after OMP_WAIT_POLICY)
from qarray.observers import Histogram, MinMax, Observer  # noqa: E402

LINES: list[str] = []
ROWS: list[dict] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def report(op, t, ref):
    for name, (med, mn) in t.items():
        if name == ref:
            continue
        rmed, rmn = t[ref]
        ROWS.append(dict(op=op, who=name, ms=med, min_ms=mn, ref=ref, ref_ms=rmed, ratio=round(med / rmed, 3)))
        say(f"{op:<30} {name:<34} {med:9.2f} ({mn:8.2f})  vs {ref:<30} {rmed:9.2f} ({rmn:8.2f})  {med / rmed:6.3f}")


def main(outdir, quick):
    n, repeats = (1 << 20, 3) if quick else (1 << 24, 9)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    x64 = x.reshape(-1, 64)  # 64 channels along axis 1
    info = dict(platform=platform.platform(), cpu_count=os.cpu_count(), python=platform.python_version(),
                numpy=np.__version__, torch=getattr(torch, "__version__", None), values=n, repeats=repeats,
                date=datetime.datetime.now().isoformat(timespec="seconds"))
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    say("times: median (min) ms; ratio of medians")
    h = Histogram(bins=2048).update(x)
    edges = h.edges()[0]
    fns = {"qarray Histogram.update": lambda: Histogram(bins=2048).update(x),
           "qarray Histogram.update axis=1 (64)": lambda: Histogram(bins=2048, axis=1).update(x64),
           "qarray MinMax.update": lambda: MinMax().update(x),
           "numpy.histogram (same edges)": lambda: np.histogram(x, bins=edges),
           "numpy min + max": lambda: (x.min(), x.max())}
    if torch is not None:
        torch.set_num_threads(2)
        xt = torch.from_numpy(x)
        fns["torch HistogramObserver"] = lambda: torch.ao.quantization.HistogramObserver(bins=2048)(xt)
    t = timeit(repeats, **fns)
    op = f"update, {n} float32"
    report(op, {k: v for k, v in t.items() if k != "numpy min + max"}, "numpy.histogram (same edges)")
    if "torch HistogramObserver" in t:
        report(op, {k: t[k] for k in ("qarray Histogram.update", "torch HistogramObserver")},
               "torch HistogramObserver")
    report(op, {k: t[k] for k in ("qarray MinMax.update", "numpy min + max")}, "numpy min + max")
    def full(method, symmetric=False):  # the same counts, another method
        return Observer.from_state(dict(h.state_dict(), method=np.array(method), symmetric=np.array(symmetric)))
    fns = {f"qarray qparams {m}": full(m).qparams for m in ("percentile", "mse", "entropy")}
    fns["qarray qparams mse symmetric"] = full("mse", True).qparams
    fns["numpy.histogram (same edges)"] = lambda: np.histogram(x, bins=edges)
    report("qparams from 2048 bins", timeit(repeats, **fns), "numpy.histogram (same edges)")
    write(outdir, "bench_observers", LINES, machine=info, rows=ROWS)


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
