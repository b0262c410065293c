"""GPTQ: qarray.gptq against a torch port of AutoGPTQ's fasterquant, one 4096 x 4096 layer, 512 tokens.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_gptq.py [OUTDIR] [--quick]

Two parts, each timed in one run with its peers (each contender called in turn,
three times after a warm-up; medians and mins):

- the Hessian of 512 float32 calibration tokens: qarray's exact ``Hessian.update``
  (sliced float64 products summed as integers) and its ``exact=False`` (one float32
  product into a float64 sum), against GPTQModel's accumulation
  (``H.addmm_(x.T, x)`` in float32, torch) and one float32 ``x.T @ x`` in NumPy
  (the floor: one product);
- the quantization (4 bits, groups of 128, symmetric, blocks of 128, no act-order)
  from that Hessian: ``GPTQ.quantize`` against the torch port of ``fasterquant``
  in ``tests/test_gptq.py`` run in float32 (AutoGPTQ's own arithmetic, CPU) and in
  float64 with float16 scales (what qarray computes). The share of codes each
  run shares with qarray's, and GPTQ's objective ``tr((W - Q) H (W - Q)^T)``
  of qarray's result and of the float32 run's, are reported too.

Results go to OUTDIR/bench_gptq.{json,txt} (default benchmarks/results).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _timing import cpu, options, torch, write  # noqa: E402  (peers, after OMP_WAIT_POLICY)
from qarray import gptq  # noqa: E402

LINES: list[str] = []
ROWS: list[dict] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def timed(rounds, **fns):
    """{name: (median s, min s, last result)}: a warm-up each, then ``rounds`` rounds of one call each, in
    turn."""
    out = {k: [None, []] for k in fns}
    for k, f in fns.items():
        out[k][0] = f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            out[k][0] = f()
            out[k][1].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v), r) for k, (r, v) in out.items()}


def report(part, t, ref):
    for name, (med, mn, _) in t.items():
        rmed = t[ref][0]
        ROWS.append(dict(part=part, who=name, s=round(med, 4), min_s=round(mn, 4), ref=ref,
                         ratio=round(med / rmed, 3)))
        say(f"{part:<10} {name:<44} {med:8.3f} s ({mn:8.3f})   {med / rmed:7.2f}x {ref}")


def layer(k, n):
    """The benchmark's layer: ``n`` float32 calibration tokens of ``k`` correlated inputs and a float32
    ``(k, k)`` weight, seed 0."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, k // 8)) @ rng.standard_normal((k // 8, k)) * 0.1
         + rng.standard_normal((n, k))).astype(np.float32)
    return x, (rng.standard_normal((k, k)) * 0.02).astype(np.float32)


def main(outdir, quick):
    k, n, rounds = (512, 128, 1) if quick else (4096, 512, 3)
    x, w = layer(k, n)
    say(f"qarray.gptq on {platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}"
        + (f", torch {torch.__version__}" if torch is not None else ", no torch") + f"; {k} x {k} weight, {n} tokens")

    fns = {"qarray Hessian.update (exact)": lambda: gptq.Hessian(k).update(x),
           "qarray Hessian.update (exact=False)": lambda: gptq.Hessian(k, exact=False).update(x),
           "numpy x.T @ x float32 (one product)": lambda: x.T @ x}
    if torch is not None:
        tx = torch.from_numpy(x)

        def addmm():
            h = torch.zeros((k, k), dtype=torch.float32)
            return h.addmm_(tx.T, tx, beta=0.0, alpha=2.0 / n)
        fns["torch H.addmm_ float32 (GPTQModel)"] = addmm
    t = timed(rounds, **fns)
    report("hessian", t, "qarray Hessian.update (exact)")
    h = t["qarray Hessian.update (exact)"][2].hessian()

    g = gptq.GPTQ(w, bits=4, group_size=128, sym=True)
    fns = {"qarray GPTQ.quantize (float64, f16 scales)": lambda: g.quantize(hessian=h)}
    if torch is not None:
        from test_gptq import RefQuantizer, ref_fasterquant

        def port(dtype, store):
            def run():
                return ref_fasterquant(torch.from_numpy(w.astype(dtype)), torch.from_numpy(h.astype(dtype)),
                                       RefQuantizer(4, True, store=store), 128, 0.01, 128)
            return run
        fns["torch fasterquant float32 (AutoGPTQ's)"] = port(np.float32, lambda s: s)
        fns["torch fasterquant float64, f16 scales"] = port(
            np.float64, lambda s: s.to(torch.float32).to(torch.float16).to(torch.float64))
    t = timed(rounds, **fns)
    report("quantize", t, "qarray GPTQ.quantize (float64, f16 scales)")
    if torch is not None:
        from qarray.io.hf import from_qarray

        ours = from_qarray(t["qarray GPTQ.quantize (float64, f16 scales)"][2]).codes.astype(np.int64) - 8
        for name in ("torch fasterquant float32 (AutoGPTQ's)", "torch fasterquant float64, f16 scales"):
            q, scale, zero, g_idx, _ = t[name][2]
            theirs = np.rint(q.double().numpy() / scale.double().numpy()[:, g_idx.numpy()]).astype(np.int64)
            share = float((ours == theirs).mean())
            ROWS.append(dict(part="codes", who=name, same_codes=share))
            say(f"codes      {name:<44} {100 * share:8.3f} % the same as qarray's")

        def loss(q):  # GPTQ's objective, sum over rows of (w - q) H (w - q)^T
            e = w.astype(np.float64) - q
            return float(np.einsum("ij,ij->", e @ h, e))
        ref = loss(t["qarray GPTQ.quantize (float64, f16 scales)"][2].dequantize().astype(np.float64))
        other = loss(t["torch fasterquant float32 (AutoGPTQ's)"][2][0].double().numpy())
        ROWS.append(dict(part="loss", qarray=ref, torch_float32=other))
        say(f"loss       tr((W - Q) H (W - Q)^T): qarray {ref:.6g}, torch float32 port {other:.6g} "
            f"({other / ref:.4f}x)")
    say(f"{datetime.date.today()}, {cpu()}")
    write(outdir, "bench_gptq", LINES, rows=ROWS, cpu=cpu(), k=k, n=n)


if __name__ == "__main__":
    a = options(__doc__)
    main(a.outdir, a.quick)
