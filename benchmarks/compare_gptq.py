"""GPTQ: qarray.gptq against llm-compressor's GPTQ, layer by layer, on the lm example's model.

Run from the repository root (llm-compressor installed beside qarray; it is no
requirement of qarray's):

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 PYTHONPATH=. python benchmarks/compare_gptq.py [OUTDIR] [--quick]

The original is called directly, as its ``GPTQModifier`` calls it: each layer a
``torch.nn.Linear`` holding the lm example's weight; its Hessian accumulated by
``llmcompressor.modifiers.gptq.helpers.accumulate_hessian`` from the lm example's
``calibration`` activations (64 windows of 128 bytes, fed as the 4 batches of 16
windows the forward passes make, ``H / num_samples`` as ``prepare_batch`` does);
its scales and zero points from the weight observer that ``GPTQModifier`` attaches
(``memoryless_minmax``, on the weight before GPTQ); then ``quantize_weight``
(float32, ``GPTQ_PRECISION``). Same settings both sides: damping 0.01, blocks of
128, groups of 128, the same symmetry; act-order off (``actorder=None``) or on
(``actorder="weight"``, the only one llm-compressor 0.14 keeps; it is its default).

llm-compressor takes every group's scale from the weight before any update (what
GPTQ calls static groups). qarray does that with ``static_groups=True``: the
"qarray static" column, the same algorithm; qarray's default (the "qarray
default" column) takes a group's scale when its first column comes up, from the
weight as updated so far (AutoGPTQ's and GPTQModel's default). Two diagnostic
columns tell arithmetic from method: qarray static with float32 scales
(``int4_g128_f32``; qarray's GPTQ formats store float16 scales), and
llm-compressor's own code run in float64 (its ``GPTQ_PRECISION`` patched, its
observer on the float64 weight, qarray's exact float64 Hessian).

Reported:

- per layer and setting, ``||W X^T - Q X^T||_F`` (X: the layer's 8192 calibration
  rows; float64) for each, and the ratio to llm-compressor's (target: <= 1.01);
  the share of codes qarray static shares with llm-compressor;
- the held-out perplexity of the whole model (every linear layer quantized from
  the same calibration activations of the float32 model, as the lm example does:
  not sequential), for each;
- the CPU time of each, Hessian and quantization, per layer and in total (4 bits,
  symmetric, act-order off and on), interleaved rounds (contenders in turn, the
  order rotated each round), medians with min and max, with one thread and with
  two (``torch.set_num_threads`` and NumPy's BLAS threads alike; the two-thread
  runs in a child process started with ``OMP_NUM_THREADS=2``); and both at the
  4096 x 4096, 512-token shape of ``benchmarks/bench_gptq.py``; the timings also
  for qarray static with ``Hessian(exact=False)`` ("qarray static inexact":
  GPTQModel's one float32 product a batch, summed in float64).

Results go to OUTDIR/compare_gptq.{json,txt} (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import RESULTS, cpu, torch, write  # noqa: E402  (pools wait passively, before torch loads)
import bench_gptq  # noqa: E402  (its layer: the 4096 x 4096 shape)

warnings.filterwarnings("ignore")
from loguru import logger  # noqa: E402  (llm-compressor's logger: its CPU warning, its info lines)

logger.remove()
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.modifiers.gptq import gptq_quantize as _lc_gq  # noqa: E402
from llmcompressor.modifiers.gptq import helpers as _lc_helpers  # noqa: E402
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight  # noqa: E402
from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from qarray import gptq  # noqa: E402
from qarray.examples import _llama, lm  # noqa: E402

GROUP, BLOCK, DAMP = 128, 128, 0.01
LINES: list[str] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def set_threads(n):
    """torch's and NumPy's BLAS threads to ``n``; what each reports after."""
    torch.set_num_threads(n)
    threadpool_limits(n)
    blas = [(d["internal_api"], d["num_threads"]) for d in threadpool_info() if d["user_api"] == "blas"]
    return dict(torch=torch.get_num_threads(), blas=blas)


def versions():
    out = {k: metadata.version(k) for k in ("llmcompressor", "compressed-tensors", "torch", "transformers", "numpy")}
    out["python"] = platform.python_version()
    out["qarray/gptq.py sha256"] = hashlib.sha256((ROOT / "qarray" / "gptq.py").read_bytes()).hexdigest()[:16]
    try:
        out["git HEAD"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "qarray/gptq.py"],
                               capture_output=True, text=True).stdout.strip()
        out["qarray/gptq.py"] = "modified in the work tree" if dirty else "as committed"
    except OSError:
        pass
    return out


# -- the two GPTQs ------------------------------------------------------------------------------------

def qargs(bits, sym, act):
    return QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=GROUP,
                            actorder="weight" if act else None)


def linear(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = torch.from_numpy(np.array(w, np.float32))
    lin.requires_grad_(False)
    return lin


def lc_hessian(lin, batches):
    """llm-compressor's Hessian, as its forward hook accumulates it and ``prepare_batch`` normalizes it."""
    h = make_empty_hessian(lin)
    n = torch.zeros(())
    for b in batches:
        h, n = accumulate_hessian(b, lin, h, n)
    return h / n


def lc_quantize(lin, h, args):
    """llm-compressor's observer (``memoryless_minmax``, on the weight) and ``quantize_weight``, on the
    stacked copies ``prepare_batch`` makes: ``(fake-quantized weight, scale, zero point)``."""
    obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    obs(lin.weight)
    qp = obs.get_qparams()
    weights = torch.stack([lin.weight])
    hessians = torch.stack([h])
    q, _, fallback = quantize_weight(weights, hessians, qp["scale"][None], qp["zero_point"][None], None, args,
                                     BLOCK, DAMP)
    if bool(fallback.any()):
        raise RuntimeError("llm-compressor fell back to round to nearest (Cholesky failed)")
    return q[0], qp["scale"], qp["zero_point"]


@contextlib.contextmanager
def lc_precision(dtype):
    old = _lc_gq.GPTQ_PRECISION, _lc_helpers.GPTQ_PRECISION
    _lc_gq.GPTQ_PRECISION = _lc_helpers.GPTQ_PRECISION = dtype
    try:
        yield
    finally:
        _lc_gq.GPTQ_PRECISION, _lc_helpers.GPTQ_PRECISION = old


def qa_hessian(k, batches, exact=True):
    h = gptq.Hessian(k, exact)
    for b in batches:
        h.update(b)
    return h.hessian()


def qa_quantize(w, h, bits, sym, act, static, dtype=None):
    return gptq.GPTQ(w, bits=None if dtype else bits, group_size=GROUP, sym=None if dtype else sym,
                     act_order=act, static_groups=static, damp_percent=DAMP, block_size=BLOCK,
                     dtype=dtype).quantize(hessian=h)


# -- accuracy -----------------------------------------------------------------------------------------

def settings(quick):
    bits = (4,) if quick else (4, 3)
    return [(b, s, a) for b in bits for s in (True, False) for a in (False, True)]


def label(bits, sym, act):
    return f"{bits}-bit g{GROUP} {'sym' if sym else 'asym'} act-order {'on' if act else 'off'}"


CONTENDERS = ["llm-compressor", "qarray static", "qarray default", "qarray static f32 scales", "llm-compressor f64"]


def accuracy(params, calib, names, quick):
    """Per setting and layer, each contender's ``||(W - Q) X^T||_F``; the quantized weights, for the
    perplexities."""
    rows, weights = [], {}
    for bits, sym, act in settings(quick):
        args = qargs(bits, sym, act)
        f32 = f"{'int' if sym else 'uint'}{bits}_g{GROUP}_f32{'' if sym else '_zp'}"
        key = label(bits, sym, act)
        weights[key] = {c: {} for c in CONTENDERS[:3]}
        say(f"\n{key}: ||W X - Q X||_F per layer (X the 8192 calibration rows, float64), ratio to llm-compressor's")
        say(f"{'layer':<6} {'shape':>9} {'||WX||':>8} {'llm-comp.':>10} {'qa static':>10} {'ratio':>7} "
            f"{'qa default':>10} {'ratio':>7} | {'f32 sc.':>7} {'lc f64':>7} {'same codes':>10}")
        for name in names:
            w, x = params[name], calib[name]
            x64 = x.astype(np.float64)
            ref = np.linalg.norm(w.astype(np.float64) @ x64.T)

            def err(q):
                return float(np.linalg.norm((w.astype(np.float64) - q) @ x64.T))
            lin = linear(w)
            h32 = lc_hessian(lin, [torch.from_numpy(b) for b in batches(x, True)])
            q_lc, scale, zero = lc_quantize(lin, h32, args)
            h64 = qa_hessian(w.shape[1], batches(x, False))
            got = {"llm-compressor": q_lc.double().numpy(),
                   "qarray static": qa_quantize(w, h64, bits, sym, act, True).dequantize().astype(np.float64),
                   "qarray default": qa_quantize(w, h64, bits, sym, act, False).dequantize().astype(np.float64),
                   "qarray static f32 scales": qa_quantize(w, h64, bits, sym, act, True,
                                                           dtype=f32).dequantize().astype(np.float64)}
            with lc_precision(torch.float64):
                lin64 = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
                lin64.weight.data = torch.from_numpy(w.astype(np.float64))
                lin64.requires_grad_(False)
                got["llm-compressor f64"] = lc_quantize(lin64, torch.from_numpy(h64), qargs(bits, sym, act))[0].numpy()
            e = {c: err(q) for c, q in got.items()}
            # codes in llm-compressor's grid (static groups: both take the scales from the same weight)
            s = scale.double().numpy()[:, np.arange(w.shape[1]) // GROUP]
            z = 0 if sym else zero.double().numpy()[:, np.arange(w.shape[1]) // GROUP]
            same = float((np.rint(got["qarray static"] / s + z) == np.rint(got["llm-compressor"] / s + z)).mean())
            for c in CONTENDERS[:3]:
                weights[key][c][name] = got[c].astype(np.float32)
            base = e["llm-compressor"]
            rows.append(dict(setting=key, bits=bits, sym=sym, act_order=act, layer=name, shape=list(w.shape),
                             norm_wx=float(ref), err={c: e[c] for c in CONTENDERS},
                             ratio={c: e[c] / base for c in CONTENDERS[1:]}, same_codes_static=same))
            say(f"{name:<6} {w.shape[0]:>4}x{w.shape[1]:<4} {ref:8.2f} {base:10.4f} {e['qarray static']:10.4f} "
                f"{e['qarray static'] / base:7.4f} {e['qarray default']:10.4f} {e['qarray default'] / base:7.4f} | "
                f"{e['qarray static f32 scales'] / base:7.4f} {e['llm-compressor f64'] / base:7.4f} "
                f"{100 * same:9.2f}%")
        sub = [r for r in rows if r["setting"] == key]
        for c in CONTENDERS[1:]:
            v = [r["ratio"][c] for r in sub]
            say(f"  {c:<26} ratio: max {max(v):.4f}, median {statistics.median(v):.4f}, min {min(v):.4f}; "
                f"layers above 1.01: {sum(r > 1.01 for r in v)} of {len(v)}")
    return rows, weights


def perplexities(params, weights, quick):
    held = lm.text()[1]
    windows = 96 if quick else None
    out = {"float32": float(np.exp(_llama.nll(params, lm.CONFIG, held, windows=windows)))}
    say(f"\nheld-out perplexity ({'96 windows' if quick else 'all 364 windows'} of 128 bytes; every linear layer "
        "quantized from the float32 model's calibration activations, the same for all)")
    say(f"float32 {out['float32']:.4f}")
    say(f"{'setting':<34} {'llm-compressor':>14} {'qarray static':>22} {'qarray default':>22}")
    rows = []
    for key, per in weights.items():
        ppl = {}
        for c, ws in per.items():
            p = dict(params)
            p.update(ws)
            ppl[c] = float(np.exp(_llama.nll(p, lm.CONFIG, held, windows=windows)))
        base = ppl["llm-compressor"]
        rows.append(dict(setting=key, ppl=ppl, gap={c: ppl[c] / base - 1 for c in ppl}))
        say(f"{key:<34} {base:14.4f} {ppl['qarray static']:12.4f} ({100 * (ppl['qarray static'] / base - 1):+6.2f}%)"
            f" {ppl['qarray default']:12.4f} ({100 * (ppl['qarray default'] / base - 1):+6.2f}%)")
    out["rows"] = rows
    return out


# -- timing -------------------------------------------------------------------------------------------

def batches(x, for_torch):
    """The layer's calibration rows as the 4 forward passes of 16 windows gave them: ``(16, 128, k)``
    for llm-compressor's hook (it counts sequences), ``(2048, k)`` for qarray."""
    k = x.shape[-1]
    parts = np.split(x, 4)
    return [p.reshape(16, -1, k) for p in parts] if for_torch else parts


def timed_rounds(rounds, jobs):
    """``jobs``: {(item, contender): (hessian(), quantize(h))}; each round runs every item's contenders
    in turn (the order rotated by one each round): {(item, contender): {"hessian": [s], "quantize": [s],
    "last": the last quantization}}."""
    items = list(dict.fromkeys(i for i, _ in jobs))
    names = list(dict.fromkeys(c for _, c in jobs))
    out = {j: {"hessian": [], "quantize": []} for j in jobs}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for item in items:
            for c in order:
                hess, quant = jobs[(item, c)]
                t0 = time.perf_counter()
                h = hess()
                t1 = time.perf_counter()
                last = quant(h)
                t2 = time.perf_counter()
                out[(item, c)]["last"] = last
                out[(item, c)]["hessian"].append(t1 - t0)
                out[(item, c)]["quantize"].append(t2 - t1)
    return out


def stats(v):
    return dict(median=statistics.median(v), min=min(v), max=max(v), n=len(v))


# qarray's timed contenders: (name, static_groups, exact Hessian); exact=False is GPTQModel's float32
# product a batch summed in float64 (not bit for bit mergeable), for speed
QARRAY_TIMED = (("qarray static", True, True), ("qarray default", False, True),
                ("qarray static inexact", True, False))


def layer_timing(params, calib, names, quick, threads):
    rounds = 2 if quick else 7
    res = {}
    for act in (False, True):
        args = qargs(4, True, act)
        jobs = {}
        for name in names:
            w, x = params[name], calib[name]
            lin = linear(w)
            tb, nb = [torch.from_numpy(b) for b in batches(x, True)], batches(x, False)
            jobs[(name, "llm-compressor")] = (lambda lin=lin, tb=tb: lc_hessian(lin, tb),
                                              lambda h, lin=lin, args=args: lc_quantize(lin, h, args))
            for c, static, exact in QARRAY_TIMED:
                jobs[(name, c)] = (lambda k=w.shape[1], nb=nb, exact=exact: qa_hessian(k, nb, exact),
                                   lambda h, w=w, static=static, act=act: qa_quantize(w, h, 4, True, act, static))
        timed_rounds(1, jobs)  # warm-up
        t = timed_rounds(rounds, jobs)
        contenders = list(dict.fromkeys(c for _, c in jobs))
        per_layer = {f"{n}|{c}": {p: stats(t[(n, c)][p]) for p in ("hessian", "quantize")} for n, c in jobs}
        totals = {}
        for c in contenders:
            tot = {p: [sum(t[(n, c)][p][r] for n in names) for r in range(rounds)] for p in ("hessian", "quantize")}
            tot["both"] = [a + b for a, b in zip(tot["hessian"], tot["quantize"])]
            totals[c] = {p: stats(v) for p, v in tot.items()}
        res[f"4-bit g{GROUP} sym act-order {'on' if act else 'off'}"] = dict(per_layer=per_layer, totals=totals,
                                                                             rounds=rounds)
    return res


def big_timing(quick, threads):
    """bench_gptq's shape: a 4096 x 4096 weight, 512 tokens (its inputs), 4 bits, g128, sym, no act-order."""
    k, n, rounds = (512, 128, 2) if quick else (4096, 512, 3)
    x, w = bench_gptq.layer(k, n)
    args = qargs(4, True, False)
    lin = linear(w)
    tx = torch.from_numpy(x)[None]  # one sequence of 512 tokens
    jobs = {("big", "llm-compressor"): (lambda: lc_hessian(lin, [tx]), lambda h: lc_quantize(lin, h, args))}
    for c, static, exact in QARRAY_TIMED:
        jobs[("big", c)] = (lambda exact=exact: qa_hessian(k, [x], exact),
                            lambda h, static=static: qa_quantize(w, h, 4, True, False, static))
    t = timed_rounds(rounds, jobs)
    out = {}
    for _, c in jobs:
        r = t[("big", c)]
        out[c] = {p: stats(v) for p, v in (("hessian", r["hessian"]), ("quantize", r["quantize"]),
                                           ("both", [a + b for a, b in zip(r["hessian"], r["quantize"])]))}
    # the error of each there too (X: the 512 rows), from the timed runs' last results
    x64 = x.astype(np.float64)
    errs = {"llm-compressor": float(np.linalg.norm((w - t[("big", "llm-compressor")]["last"][0].double().numpy())
                                                   @ x64.T))}
    for c, _, _ in QARRAY_TIMED:
        q = t[("big", c)]["last"].dequantize().astype(np.float64)
        errs[c] = float(np.linalg.norm((w - q) @ x64.T))
    return dict(k=k, tokens=n, rounds=rounds, times=out, err=errs)


def timing_part(params, calib, names, quick, threads):
    """The timings with ``threads`` threads, and the 1-minute load average before, between and after
    (other processes on the machine show there)."""
    got = set_threads(threads)
    load = [os.getloadavg()[0]]
    layers = layer_timing(params, calib, names, quick, threads)
    load.append(os.getloadavg()[0])
    big = big_timing(quick, threads)
    load.append(os.getloadavg()[0])
    return dict(threads=threads, reported=got, load_avg_1m=load, layers=layers, big=big)


def show_timing(tp):
    th = tp["threads"]
    say(f"\nCPU time, {th} thread{'s' if th > 1 else ''} (torch.set_num_threads {tp['reported']['torch']}, "
        f"NumPy's BLAS {tp['reported']['blas']}); seconds, median [min, max]; 1-minute load average before, "
        f"between and after: {', '.join(f'{v:.2f}' for v in tp['load_avg_1m'])}")
    for setting, r in tp["layers"].items():
        say(f"{setting}, every layer of the lm model, {r['rounds']} interleaved rounds:")
        say(f"  {'layer':<6} {'contender':<16} {'hessian':>26} {'quantize':>26}")
        for key, v in r["per_layer"].items():
            name, c = key.split("|")
            say(f"  {name:<6} {c:<22} " + " ".join(
                f"{v[p]['median'] * 1e3:8.2f} ms [{v[p]['min'] * 1e3:6.2f}, {v[p]['max'] * 1e3:6.2f}]"
                for p in ("hessian", "quantize")))
        base = r["totals"]["llm-compressor"]["both"]["median"]
        for c, v in r["totals"].items():
            say(f"  total  {c:<22} hessian {v['hessian']['median']:.3f} s, quantize {v['quantize']['median']:.3f} s, "
                f"both {v['both']['median']:.3f} s [{v['both']['min']:.3f}, {v['both']['max']:.3f}] "
                f"({v['both']['median'] / base:.2f}x llm-compressor's)")
    b = tp["big"]
    say(f"{b['k']} x {b['k']} weight, {b['tokens']} tokens (bench_gptq's), 4-bit g128 sym, act-order off, "
        f"{b['rounds']} interleaved rounds:")
    base = b["times"]["llm-compressor"]["both"]["median"]
    for c, v in b["times"].items():
        say(f"  {c:<22} hessian {v['hessian']['median']:7.3f} s [{v['hessian']['min']:.3f}, {v['hessian']['max']:.3f}]"
            f", quantize {v['quantize']['median']:7.3f} s [{v['quantize']['min']:.3f}, {v['quantize']['max']:.3f}], "
            f"both {v['both']['median']:7.3f} s ({v['both']['median'] / base:.2f}x llm-compressor's); "
            f"||WX - QX||_F {b['err'][c]:.4f} ({b['err'][c] / b['err']['llm-compressor']:.4f}x)")


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("outdir", nargs="?", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="a few layers, the 4-bit rows, small sizes: a check")
    p.add_argument("--timing-only", type=int, default=0, metavar="THREADS", help=argparse.SUPPRESS)
    p.add_argument("--json-to", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()

    params, _ = lm.model(log=lambda s: None)
    calib = lm.calibration(params, lm.CONFIG)
    names = [n for n in calib if n.split(".")[-1] in _llama.LINEARS]
    if a.quick:
        names = names[:3] + names[-1:]
    if a.timing_only:  # the child: timing with more threads
        a.json_to.write_text(json.dumps(timing_part(params, calib, names, a.quick, a.timing_only)))
        return

    set_threads(1)
    v = versions()
    info = cpu()
    say(f"qarray.gptq against llm-compressor's GPTQ on the lm example's model ({len(names)} linear layers)")
    say("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    say(f"llm-compressor: float32 (GPTQ_PRECISION), float32 scales (the weight's dtype), scales from its weight "
        f"observer 'memoryless_minmax' before GPTQ; qarray: float64, float16 scales (GPTQ's formats) unless said; "
        f"both: damping {DAMP}, blocks of {BLOCK}, groups of {GROUP}")
    rows, weights = accuracy(params, calib, names, a.quick)
    ppl = perplexities(params, weights, a.quick)
    t1 = timing_part(params, calib, names, a.quick, 1)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "t2.json"
        env = dict(os.environ, OMP_NUM_THREADS="2", NUMBA_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2",
                   PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, __file__, "--timing-only", "2", "--json-to", str(out)]
                       + (["--quick"] if a.quick else []), env=env, check=True)
        t2 = json.loads(out.read_text())
    show_timing(t1)
    show_timing(t2)
    info["load_avg_1m_end"] = os.getloadavg()[0]
    say(f"\n{datetime.date.today()}, {info}")
    say("command: OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 PYTHONPATH=. python benchmarks/compare_gptq.py"
        + (" --quick" if a.quick else ""))
    write(a.outdir, "compare_gptq", LINES, versions=v, cpu=info, layers=rows, perplexity=ppl, timing=[t1, t2])


if __name__ == "__main__":
    main()
