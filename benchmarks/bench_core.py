"""Core-op benchmark: qarray quantize / dequantize / requantize against peers.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_core.py [OUTDIR] [--quick]

Times 2^24 float32 elements (2^20 and 3 repeats with ``--quick``), each op and its peer interleaved in one run (warm-up
once, then median and min of REPEATS calls), and prints qarray ms, peer ms, their
ratio and the target. Peers: PyTorch (quantize_per_tensor / quantize_per_channel /
dequantize, 2 threads) and onnxruntime (QuantizeLinear / DequantizeLinear), each
skipped when not installed; per-axis, blocked and requantize are measured against
qarray's own per-tensor quantize. Also: cold start in a fresh subprocess (run
twice, the first may compile the Numba cache) and the generic NumPy path.
Nothing is asserted. Results go to OUTDIR/bench_core.{json,txt} (default
benchmarks/results); each JSON row has the op's input ``shape``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import TensorProto, helper, options, ort, timeit, torch  # noqa: E402  (peers, after OMP_WAIT_POLICY)
import qarray  # noqa: E402


N = 1 << 24
SIDE = 4096  # N == SIDE * SIDE
REPEATS = 15
THREADS = 2
SCALE, ZP = 0.01, 3
LINES: list[str] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


ROWS: list[dict] = []


def row(op, ours, peer_name=None, peer=None, target=None, shape=None):
    """One table row; ``target`` is the largest acceptable ours/peer ratio (None: info only);
    ``shape`` of the input, default ``N`` elements."""
    ratio = ours[0] / peer[0] if peer else None
    met = None if target is None or ratio is None else ratio <= target
    ROWS.append(dict(op=op, shape=str(N) if shape is None else shape, qarray_ms=round(ours[0], 3), qarray_min_ms=round(ours[1], 3),
                     peer=peer_name, peer_ms=None if peer is None else round(peer[0], 3),
                     peer_min_ms=None if peer is None else round(peer[1], 3),
                     ratio=None if ratio is None else round(ratio, 3),
                     ratio_of_mins=round(ours[1] / peer[1], 3) if peer else None, target=target,
                     met=None if met is None else ("yes" if met else "no")))


def ort_session(op, in_type, out_type):
    """A one-node QuantizeLinear / DequantizeLinear model (scale SCALE, zero point ZP, int8)."""
    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [SCALE]),
             helper.make_tensor("z", TensorProto.INT8, [], [ZP])]
    node = helper.make_node(op, ["x", "s", "z"], ["y"])
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", in_type, [N])],
                              [helper.make_tensor_value_info("y", out_type, [N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = THREADS, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # see OMP_WAIT_POLICY
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


COLD = """
import time
t0 = time.perf_counter()
import numpy, qarray
t1 = time.perf_counter()
qarray.quantize(numpy.linspace(-1, 1, 1000, dtype=numpy.float32), 0.01, 3, "qint8")
t2 = time.perf_counter()
x = numpy.linspace(-1, 1, 1 << 24, dtype=numpy.float32)
t3 = time.perf_counter()
qarray.quantize(x, 0.01, 3, "qint8")  # large: the Numba kernels, so Numba's start-up
t4 = time.perf_counter()
print(t1 - t0, t2 - t1, t4 - t3)
"""


COLD_REQUANTIZE = """
import time
import numpy, qarray
q = qarray.QArray.from_int(numpy.arange(1 << 20, dtype=numpy.int32), 1e-4, 0, "qint32")
t0 = time.perf_counter()
qarray.requantize(q, 0.05, 0, "qint8")  # the first op with output parameters
print(time.perf_counter() - t0)
"""


def cold_start(rounds):
    """``[(import, first small quantize, first 2^24 quantize, first 2^20 requantize)]`` in ms,
    each from fresh subprocesses, ``rounds`` times (the first may fill Numba's cache)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = []
    for _ in range(rounds):
        times = []
        for script in (COLD, COLD_REQUANTIZE):
            r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                say(f"cold start subprocess failed:\n{r.stderr}")
                return []
            times += [float(v) * 1e3 for v in r.stdout.split()]
        out.append(tuple(times))
    return out


def main(outdir, quick):
    global N, SIDE, REPEATS
    if quick:
        N, SIDE, REPEATS = 1 << 20, 1 << 10, 3
    cold = cold_start(1 if quick else 2)  # before this process compiles anything
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(N) * 0.4).astype(np.float32)
    x2 = x.reshape(SIDE, SIDE)
    qarray.set_num_threads(THREADS)
    if torch is not None:
        torch.set_num_threads(THREADS)
        xt, xt2 = torch.from_numpy(x), torch.from_numpy(x2)

    # 1-2: per-tensor quantize / dequantize against torch and onnxruntime
    q = qarray.quantize(x, SCALE, ZP, "qint8")
    qfns = {"qarray": lambda: qarray.quantize(x, SCALE, ZP, "qint8")}
    dfns = {"qarray": lambda: q.dequantize()}
    if torch is not None:
        qt = torch.quantize_per_tensor(xt, SCALE, ZP, torch.qint8)
        qfns["torch"] = lambda: torch.quantize_per_tensor(xt, SCALE, ZP, torch.qint8)
        dfns["torch"] = lambda: qt.dequantize()
    if ort is not None:
        sq = ort_session("QuantizeLinear", TensorProto.FLOAT, TensorProto.INT8)
        sd = ort_session("DequantizeLinear", TensorProto.INT8, TensorProto.FLOAT)
        qi = q.int_repr()
        qfns["onnxruntime"] = lambda: sq.run(None, {"x": x})
        dfns["onnxruntime"] = lambda: sd.run(None, {"x": qi})
    tq, td = timeit(REPEATS, **qfns), timeit(REPEATS, **dfns)
    for op, t, target in (("quantize per-tensor", tq, 0.7), ("dequantize per-tensor", td, 0.5)):
        if len(t) == 1:
            row(op, t["qarray"])
        if "torch" in t:
            row(op, t["qarray"], "torch", t["torch"], target)
        if "onnxruntime" in t:
            row(op, t["qarray"], "onnxruntime", t["onnxruntime"])

    # 3: per-axis and blocked quantize against our per-tensor quantize (and torch per-channel)
    s0 = rng.uniform(0.005, 0.02, SIDE).astype(np.float32)
    z0 = np.full(SIDE, ZP, np.int32)
    sb = {b: rng.uniform(0.005, 0.02, (SIDE, SIDE // b)).astype(np.float32) for b in (32, 128)}
    zb = {b: np.full((SIDE, SIDE // b), ZP, np.int32) for b in (32, 128)}
    fns = {"per-tensor": lambda: qarray.quantize(x, SCALE, ZP, "qint8"),
           "axis=0": lambda: qarray.quantize(x2, s0, z0, "qint8", axis=0),
           "axis=1": lambda: qarray.quantize(x2, s0, z0, "qint8", axis=1),
           "axis=1 block 32": lambda: qarray.quantize(x2, sb[32], zb[32], "qint8", 1, 32),
           "axis=1 block 128": lambda: qarray.quantize(x2, sb[128], zb[128], "qint8", 1, 128)}
    if torch is not None:
        st, zt = torch.from_numpy(s0.astype(np.float64)), torch.from_numpy(z0.astype(np.int64))
        fns["torch axis=0"] = lambda: torch.quantize_per_channel(xt2, st, zt, 0, torch.qint8)
        fns["torch axis=1"] = lambda: torch.quantize_per_channel(xt2, st, zt, 1, torch.qint8)
    t = timeit(REPEATS, **fns)
    for k in ("axis=0", "axis=1", "axis=1 block 32", "axis=1 block 128"):
        row(f"quantize {k}", t[k], "qarray quantize per-tensor", t["per-tensor"], 1.3, f"{SIDE}x{SIDE}")
        if f"torch {k}" in t:
            row(f"quantize {k}", t[k], "torch quantize_per_channel", t[f"torch {k}"], shape=f"{SIDE}x{SIDE}")

    # 4: requantize int32 -> int8 against our per-tensor quantize
    ints = rng.integers(-(1 << 20), 1 << 20, N, dtype=np.int32)
    q32 = qarray.QArray.from_int(ints, 1e-4, 0, "qint32")
    q32_2 = qarray.QArray.from_int(ints.reshape(SIDE, SIDE), 1e-4, 0, "qint32")
    s_out = rng.uniform(0.03, 0.07, SIDE).astype(np.float32)
    fns = {"quantize": lambda: qarray.quantize(x, SCALE, ZP, "qint8")}
    for r in ("half_even", "half_away", "half_up", "tflite"):
        fns[f"fixed {r}"] = lambda r=r: qarray.requantize(q32, 0.05, 0, "qint8", rounding=r)
    fns["float"] = lambda: qarray.requantize(q32, 0.05, 0, "qint8", mode="float")
    fns["fixed half_even axis=0"] = lambda: qarray.requantize(q32_2, s_out, 0, "qint8", axis=0)
    fns["fixed half_even axis=1"] = lambda: qarray.requantize(q32_2, s_out, 0, "qint8", axis=1)
    fns["float axis=1"] = lambda: qarray.requantize(q32_2, s_out, 0, "qint8", axis=1, mode="float")
    t = timeit(REPEATS, **fns)
    for k in fns:
        if k != "quantize":
            row(f"requantize i32->i8 {k}", t[k], "qarray quantize per-tensor", t["quantize"], 1.5,
                f"{SIDE}x{SIDE}" if "axis" in k else None)

    # 5: fake quantize in one pass, against quantize (the target: no slower;
    # it moves 4x quantize's output bytes, so at equal bandwidth it takes ~2x) and torch's
    buf = np.empty_like(x)
    fns = {"quantize": lambda: qarray.quantize(x, SCALE, ZP, "qint8"),
           "fake": lambda: qarray.fake_quantize(x, SCALE, ZP, "qint8"),
           "fake + mask": lambda: qarray.fake_quantize(x, SCALE, ZP, "qint8", return_mask=True),
           "fake out=": lambda: qarray.fake_quantize(x, SCALE, ZP, "qint8", out=buf),
           "two passes": lambda: qarray.quantize(x, SCALE, ZP, "qint8").dequantize(),
           "stochastic": lambda: qarray.quantize(x, SCALE, ZP, "qint8", rounding="stochastic", seed=1),
           "requantize stochastic": lambda: qarray.requantize(q32, 0.05, 0, "qint8", rounding="stochastic", seed=1),
           "requantize": lambda: qarray.requantize(q32, 0.05, 0, "qint8")}
    if torch is not None:
        fns["torch"] = lambda: torch.fake_quantize_per_tensor_affine(xt, SCALE, ZP, -128, 127)
        fns["torch + mask"] = lambda: torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(xt, SCALE, ZP, -128, 127)
    t = timeit(REPEATS, **fns)
    row("fake_quantize", t["fake"], "qarray quantize per-tensor", t["quantize"], 1.0)
    row("fake_quantize", t["fake"], "qarray quantize + dequantize", t["two passes"])
    row("fake_quantize, return_mask", t["fake + mask"], "qarray quantize per-tensor", t["quantize"])
    row("fake_quantize, out= (a buffer kept)", t["fake out="], "qarray quantize per-tensor", t["quantize"], 1.0)
    row("quantize, rounding='stochastic'", t["stochastic"], "qarray quantize per-tensor", t["quantize"])
    row("requantize i32->i8, rounding='stochastic'", t["requantize stochastic"], "qarray requantize half_even",
        t["requantize"])
    if torch is not None:
        row("fake_quantize", t["fake"], "torch fake_quantize_per_tensor_affine", t["torch"])
        row("fake_quantize, return_mask", t["fake + mask"], "torch ..._affine_cachemask", t["torch + mask"])

    # 6: cold start (fresh subprocess, twice)
    for i, (imp, first, large, requant) in enumerate(cold):
        label = "warm cache" if i else "first run, may compile"
        row(f"cold: import qarray ({label})", (imp, imp), shape="")
        row(f"cold: first quantize, 1000 elements ({label})", (first, first), "0.3 s budget",
            (300.0, 300.0), 1.0 if i else None, "1000")
        row(f"cold: then first 2^24-element quantize ({label})", (large, large), "0.3 s budget",
            (300.0, 300.0), 1.0 if i else None, str(1 << 24))
        row(f"cold: first op 2^20-element requantize ({label})", (requant, requant), "0.5 s budget",
            (500.0, 500.0), 1.0 if i else None, str(1 << 20))

    # 7: the generic NumPy path, for reference
    def generic(f):
        def g():
            with qarray.config.using(numba=False):
                return f()
        return g
    t = timeit(REPEATS, gq=generic(qfns["qarray"]), gd=generic(dfns["qarray"]), q=qfns["qarray"], d=dfns["qarray"])
    row("quantize generic NumPy (numba=False)", t["gq"], "qarray numba", t["q"])
    row("dequantize generic NumPy (numba=False)", t["gd"], "qarray numba", t["d"])

    # agreement with the peers (torch multiplies by a float32 reciprocal: one-step differences)
    agree = {}
    ours = q.int_repr()
    if torch is not None:
        diff = np.abs(ours.astype(np.int16) - qt.int_repr().numpy().astype(np.int16))
        agree["torch quantize_per_tensor"] = dict(differ=int((diff > 0).sum()), max_step=int(diff.max()))
        same = torch._make_per_tensor_quantized_tensor(torch.from_numpy(ours), SCALE, ZP)
        deq = q.dequantize() != same.dequantize().numpy()
        agree["torch dequantize (same ints)"] = dict(differ=int(deq.sum()))
        fake, inside = qarray.fake_quantize(x, SCALE, ZP, "qint8", return_mask=True)
        tfake, tmask = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(xt, SCALE, ZP, -128, 127)
        agree["torch fake_quantize (its reciprocal's ties)"] = dict(differ=int((fake != tfake.numpy()).sum()),
                                                                   mask_differ=int((inside != tmask.numpy()).sum()))
    if ort is not None:
        agree["onnxruntime QuantizeLinear"] = dict(differ=int((sq.run(None, {"x": x})[0] != ours).sum()))
        agree["onnxruntime DequantizeLinear"] = dict(differ=int((sd.run(None, {"x": qi})[0] != q.dequantize()).sum()))

    report(agree, outdir, quick)


def report(agree, outdir, quick):
    vers = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("numba", "torch", "onnxruntime"):
        try:
            vers[name] = __import__(name).__version__
        except ImportError:
            vers[name] = None
    machine = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                   cpu_count=os.cpu_count(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                   elements=N, repeats=REPEATS, quick=quick, qarray_threads=THREADS,
                   torch_threads=torch.get_num_threads() if torch is not None else None, **vers)
    say("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    say(f"times: median (min) of {REPEATS} runs after one warm-up, in ms; ratio = qarray / peer median (and of mins); "
        "target: largest acceptable ratio")
    head = f"{'operation':<52} {'qarray ms':>17} {'peer':<27} {'peer ms':>17} {'ratio':>6} {'(mins)':>6} {'target':>7} {'met':>4}"
    say(head)
    say("-" * len(head))

    def ms(m, lo):
        return "" if m is None else f"{m:8.2f} ({lo:6.2f})"
    for r in ROWS:
        say(f"{r['op']:<52} {ms(r['qarray_ms'], r['qarray_min_ms']):>17} {r['peer'] or '':<27} "
            f"{ms(r['peer_ms'], r['peer_min_ms']):>17} {'' if r['ratio'] is None else r['ratio']:>6} "
            f"{'' if r['ratio_of_mins'] is None else r['ratio_of_mins']:>6} "
            f"{'' if r['target'] is None else '<=' + str(r['target']):>7} {r['met'] or '':>4}")
    say()
    say("agreement with peers (int8 per-tensor, differing elements of %d):" % N)
    for k, v in agree.items():
        say(f"  {k}: " + ", ".join(f"{a}={b}" for a, b in v.items()))
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "bench_core.json").write_text(json.dumps(dict(machine=machine, rows=ROWS, agreement=agree), indent=1) + "\n")
    (outdir / "bench_core.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
