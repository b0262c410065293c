"""What a call costs on small inputs, against PyTorch in the same run: the
per-op overhead users of small shapes pay on every call (token-by-token
decoding, M = 1 inference, per-sample pipelines).

    python benchmarks/bench_overhead.py [OUTDIR] [--quick]

Each row times qarray's call and PyTorch's equivalent alternately, call by
call (no warm-up block between them: what ran just before is part of the
cost), and reports the median time per call and its spread (the 25th to 75th
percentile) over the calls; both use 2 threads. Then the same Python path on
the CuPy backend, on the tests' stand-in CuPy with every launch stubbed
(``bench_gpu_host.py``), against that stand-in's floor (one allocation and one
launch). No OMP_WAIT_POLICY is set: PyTorch's OpenMP threads behave as they do
for users.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", message=".*deprecated.*")  # torch's quantized dtypes
try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
_POLICY = os.environ.get("OMP_WAIT_POLICY")
import bench_gpu_host  # noqa: E402  (its _timing sets OMP_WAIT_POLICY=PASSIVE: not here, see above)
from _timing import cpu  # noqa: E402  (already imported by bench_gpu_host)
import qarray as qa  # noqa: E402

if _POLICY is None:
    os.environ.pop("OMP_WAIT_POLICY", None)

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2


def rows():
    """``{name: (qarray call, torch call or None)}``: ``bench_gpu_host.host_ops``
    on NumPy arrays, and PyTorch's equivalent on the same values."""
    ours = bench_gpu_host.host_ops(np, qa)
    theirs = dict.fromkeys(ours)
    if torch is not None:
        x, acc, w, bias = bench_gpu_host.host_inputs()
        layer = qa.nn.Linear.from_float(w, bias)  # its weight parameters, for torch's weights
        tx = torch.from_numpy(x)
        ta = torch.quantize_per_tensor(tx, 0.05, 3, torch.qint8)
        tb = torch.quantize_per_tensor(tx, 0.04, -2, torch.qint8)
        t32 = torch.quantize_per_tensor(torch.from_numpy(acc.astype(np.float32) * np.float32(1e-4)), 1e-4, 0,
                                        torch.qint32)
        tl = torch.ao.nn.quantized.Linear(64, 64, dtype=torch.qint8)
        ws = np.asarray(layer.weight.scale, np.float64).reshape(-1)  # qarray's weight parameters, per channel
        tw = torch.quantize_per_channel(torch.from_numpy(w), torch.from_numpy(ws), torch.zeros(ws.size, dtype=torch.long),
                                        0, torch.qint8)
        tl.set_weight_bias(tw, torch.from_numpy(bias))
        tl.scale, tl.zero_point = 0.2, 1
        tu = torch.quantize_per_tensor(tx, 0.05, 131, torch.quint8)  # fbgemm's Linear takes quint8 activations
        peers = [lambda: torch.quantize_per_tensor(tx, 0.05, 3, torch.qint8), lambda: ta.dequantize(),
                 lambda: torch.quantize_per_tensor(t32.dequantize(), 0.05, 0, torch.qint8),
                 lambda: torch.ops.quantized.add(ta, tb, 0.2, 1), lambda: tl(tu), lambda: tl(tu[:1])]
        theirs = dict(zip(ours, peers))  # host_ops' order: quantize, dequantize, requantize, add, Linear M=16, M=1
    return {k: (ours[k], theirs[k]) for k in ours}


def alternate(f, g, calls):
    """Per-call times in us of ``f`` and ``g`` called alternately ``calls`` times each."""
    tf, tg = [], []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        t1 = time.perf_counter()
        if g is not None:
            g()
        t2 = time.perf_counter()
        tf.append((t1 - t) * 1e6)
        tg.append((t2 - t1) * 1e6)
    return tf, (tg if g is not None else None)


def stats(v):
    q = statistics.quantiles(v, n=4)
    return dict(median=statistics.median(v), p25=q[0], p75=q[2])


def main(outdir: Path, quick: bool):
    qa.set_num_threads(THREADS)
    if torch is not None:
        torch.set_num_threads(THREADS)
    calls = 200 if quick else 2000
    lines, out = [], []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    machine = cpu()
    say("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    say(f"per call, us: median (25th-75th percentile) of {calls} calls, qarray and torch alternating, "
        f"{THREADS} threads each" + ("" if torch is not None else "; torch not installed"))
    for name, (f, g) in rows().items():
        for _ in range(50):  # first calls: compiles, packs, plans
            f()
            if g is not None:
                g()
        tf, tg = alternate(f, g, calls)
        sf = stats(tf)
        row = dict(op=name, qarray=sf)
        text = f"{name:<36} qarray {sf['median']:8.1f} ({sf['p25']:.1f}-{sf['p75']:.1f})"
        if tg is not None:
            sg = stats(tg)
            row.update(torch=sg, ratio=sf["median"] / sg["median"])
            text += f"   torch {sg['median']:7.1f} ({sg['p25']:.1f}-{sg['p75']:.1f})   {row['ratio']:5.1f}x"
        say(text)
        out.append(row)

    threads = next_to_torch(9 if quick else 21, say) if torch is not None else None
    big = large(20 if quick else 100, say) if torch is not None else None

    cupy, qarray, _ = bench_gpu_host._stand_in()  # the CuPy backend's Python path, launches stubbed
    gcalls = 50 if quick else 1000
    kernel = cupy.RawModule(code="", options=()).get_function("floor")
    floor = bench_gpu_host.per_call_us(lambda: kernel((1,), (256,), (cupy.empty((16, 64), np.int8),)), gcalls)
    say(f"CuPy backend on the stand-in, launches stubbed ({gcalls} calls a block, median of 7 blocks (min-max)); "
        f"floor {floor[0]:.1f} us: one allocation + one launch")
    gpu = []
    for name, fn in bench_gpu_host.host_ops(cupy, qarray).items():
        us, lo, hi = bench_gpu_host.per_call_us(fn, gcalls)
        gpu.append(dict(op=name, us=us, spread=[lo, hi], floor_ratio=us / floor[0]))
        say(f"{name:<36} cupy path {us:7.1f} us ({lo:.1f}-{hi:.1f})  {us / floor[0]:5.1f}x floor")
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "bench_overhead.txt").write_text("\n".join(lines) + "\n")
    (outdir / "bench_overhead.json").write_text(json.dumps(dict(machine=machine, cpu=out, next_to_torch=threads, large=big,
                                                               cupy_stand_in=gpu, floor_us=floor[0]), indent=1) + "\n")


def next_to_torch(calls, say):
    """quantize 2^24 float32 -> qint8 right after torch's (each call alternating
    with ``torch.quantize_per_tensor``, no warm-up between them), then each alone
    (``calls`` in a row): how much qarray's kernels lose when another library's
    threads ran just before, the way they are used."""
    x = np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32)
    tx = torch.from_numpy(x)

    def f():
        qa.quantize(x, 0.05, 3, "qint8")

    def g():
        torch.quantize_per_tensor(tx, 0.05, 3, torch.qint8)

    f(), g()
    ms = {}
    ms["qarray after torch"], ms["torch after qarray"] = alternate(f, g, calls)
    ms["qarray alone"], _ = alternate(f, None, calls)
    ms["torch alone"], _ = alternate(g, None, calls)
    # the memory's floor: the same bytes moved with no arithmetic and no new output
    # (torch casting the float32 into a kept int8 tensor: 64 MB read, 16 MB written)
    kept = torch.empty(x.size, dtype=torch.int8)
    ms["floor after torch"], ms["torch after floor"] = alternate(lambda: kept.copy_(tx), g, calls)
    rows = {k: dict(median=statistics.median(v) / 1e3, lo=min(v) / 1e3, hi=max(v) / 1e3) for k, v in ms.items()}
    say(f"quantize 2^24 float32 -> qint8, ms: median (min-max) of {calls} calls")
    for k, r in rows.items():
        say(f"  {k:<20} {r['median']:7.2f} ({r['lo']:.2f}-{r['hi']:.2f})")
    med = {k: r["median"] for k, r in rows.items()}
    rows["ratios"] = dict(after_torch_over_alone=med["qarray after torch"] / med["qarray alone"],
                          qarray_over_torch_interleaved=med["qarray after torch"] / med["torch after qarray"],
                          qarray_over_torch_alone=med["qarray alone"] / med["torch alone"],
                          floor_over_torch_interleaved=med["floor after torch"] / med["torch after floor"])
    say("  qarray after torch / alone {after_torch_over_alone:.2f}x (target <= 1.15x); qarray / torch "
        "interleaved {qarray_over_torch_interleaved:.2f}x (target <= 0.9x), alone {qarray_over_torch_alone:.2f}x"
        .format(**rows["ratios"]))
    say("  floor / torch interleaved {floor_over_torch_interleaved:.2f}x: a cast into a kept int8 tensor, the least "
        "a pass over these bytes takes".format(**rows["ratios"]))
    return rows


def large(calls, say):
    """quantize and fake_quantize of 2^22 and 2^24 float32 values (qint8, one
    scale) alternating with torch's ``quantize_per_tensor`` and
    ``fake_quantize_per_tensor_affine``, and requantize of as many int32
    accumulators to qint8 with torch's (the small row's: ``dequantize`` then
    ``quantize_per_tensor``, torch having no requantize of its own): the
    kernels' own speed, where a call's overhead no longer counts. The ratio is
    each call's time over the torch call's right after it."""
    say(f"large inputs, ms: median (25th-75th percentile) of {calls} calls alternating; ratio: of each pair")
    rows = []
    for bits in (22, 24):
        x = np.random.default_rng(0).standard_normal(1 << bits).astype(np.float32)
        tx = torch.from_numpy(x)
        pairs = {f"quantize 2^{bits} float32 -> qint8": (lambda: qa.quantize(x, 0.05, 3, "qint8"),
                                                         lambda: torch.quantize_per_tensor(tx, 0.05, 3, torch.qint8)),
                 f"fake_quantize 2^{bits} float32 qint8": (
                     lambda: qa.fake_quantize(x, 0.05, 3, "qint8"),
                     lambda: torch.fake_quantize_per_tensor_affine(tx, 0.05, 3, -128, 127))}
        acc = np.random.default_rng(1).integers(-2**20, 2**20, 1 << bits).astype(np.int32)
        qacc = qa.QArray.from_int(acc, 1e-4, 0, "qint32")
        tacc = torch.quantize_per_tensor(torch.from_numpy(acc.astype(np.float32) * np.float32(1e-4)), 1e-4, 0,
                                         torch.qint32)
        pairs[f"requantize 2^{bits} qint32 -> qint8"] = (lambda: qa.requantize(qacc, 0.05, 3, "qint8"),
                                                         lambda: torch.quantize_per_tensor(tacc.dequantize(), 0.05,
                                                                                           3, torch.qint8))
        for name, (f, g) in pairs.items():
            f(), g()
            tf, tg = alternate(f, g, calls)
            row = dict(op=name, qarray=stats([t / 1e3 for t in tf]), torch=stats([t / 1e3 for t in tg]),
                       ratio=stats([a / b for a, b in zip(tf, tg)]))
            rows.append(row)
            say(f"{name:<36} qarray {row['qarray']['median']:6.2f} ({row['qarray']['p25']:.2f}-"
                f"{row['qarray']['p75']:.2f})   torch {row['torch']['median']:6.2f} ({row['torch']['p25']:.2f}-"
                f"{row['torch']['p75']:.2f})   {row['ratio']['median']:.2f}x ({row['ratio']['p25']:.2f}-"
                f"{row['ratio']['p75']:.2f})")
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("outdir", nargs="?", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    main(args.outdir, args.quick)
