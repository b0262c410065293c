"""Quantized-op benchmark: matmul/linear, conv2d, cat and LUT against float and peers.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_ops.py [OUTDIR] [--quick]

Every row is measured side by side in one run (warm-up once, then the contenders
take turns in blocks of calls; median and min in ms) and reported as ratios to
references measured in the same run: float32 numpy.matmul, and the fastest of
the int8 peers installed, PyTorch's quantized.linear on its fbgemm and oneDNN
engines (oneDNN runs on the AMX tiles where the CPU has them) and onnxruntime's
MatMulInteger, for linear (large shapes, and M = 1 and 16 against 4096x4096
weights: int8 and packed 4-bit), with qarray on onnxruntime's MLAS engine
beside its own kernels; each qarray GEMM row also as a share of the machine's
peak rate (``PEAK``); the fastest of torch's quantized.conv2d engines and
float32 conv2d for conv2d (dense and depthwise); numpy.concatenate for cat,
numpy.take for the LUT ops; training's backward products (linear's gradients,
conv_transpose2d, conv2d_weight_grad) against float32 and fbgemm. Targets are
ratios of medians; nothing is asserted. Results go to
OUTDIR/bench_ops.{json,txt} (default benchmarks/results), with the CPU's model
and flags; each JSON row has the ``op`` and its ``shape`` apart. ``--quick``:
small shapes and 3 repeats.
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
from _timing import TensorProto, cpu, helper, options, ort, timeit, torch, write  # noqa: E402  (peers, after OMP_WAIT_POLICY)
import numpy as np  # noqa: E402  (after _timing: OpenBLAS reads its settings as it loads)
import qarray  # noqa: E402
from qarray import nn  # noqa: E402
from qarray.ops import cat, conv2d, log_softmax, matmul, sigmoid, softmax  # noqa: E402


THREADS = 2
REPEATS = 9
LINES: list[str] = []
ROWS: list[dict] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def report(op, shape, t, ref, target=None, who=None):
    """One row per contender (``who``, default all) against ``ref`` for ``op`` on
    ``shape``; ``target`` (a ratio of medians) applies to the qarray rows."""
    for name in who or [n for n in t if n != ref]:
        if name not in t or name == ref or ref not in t:
            continue
        (med, mn), (rmed, rmn) = t[name], t[ref]
        ratio, ratio_min = med / rmed, mn / rmn
        met = None if target is None or not name.startswith("qarray") else ratio <= target
        ROWS.append(dict(op=op, shape=shape, who=name, ms=med, min_ms=mn, ref=ref, ref_ms=rmed, ratio=round(ratio, 3),
                         ratio_min=round(ratio_min, 3), target=target if met is not None else None, met=met))
        flag = "" if met is None else ("yes" if met else "no")
        tgt = f"<={target}" if met is not None else ""
        say(f"{op + ' ' + shape:<42} {name:<34} {med:9.2f} ({mn:8.2f})  vs {ref:<32} {rmed:9.2f} ({rmn:8.2f})"
            f"  {ratio:6.3f} {ratio_min:6.3f} {tgt:>6} {flag}")


def ort_matmul_integer(a, b):
    g = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "za"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, a.shape),
         helper.make_tensor_value_info("b", TensorProto.INT8, b.shape)],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [helper.make_tensor("za", TensorProto.UINT8, [], [128])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = THREADS, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: s.run(None, {"a": a, "b": b})


def torch_qx(x, scale, zp):
    return torch.quantize_per_tensor(torch.from_numpy(x.astype(np.float32) * scale - zp * scale), scale, zp, torch.quint8)


def torch_qw(qw, axis=0):
    return torch.quantize_per_channel(torch.from_numpy(qw.dequantize()), torch.from_numpy(qw.scale.astype(np.float64)),
                                      torch.zeros(qw.shape[axis], dtype=torch.int64), axis, torch.qint8)


def torch_engines():
    """torch's quantized engines here: fbgemm, and oneDNN (AMX tiles where the CPU has them)."""
    return [e for e in ("fbgemm", "onednn") if torch is not None and e in torch.backends.quantized.supported_engines]


def on_engine(name, prepack, run):
    """``run(prepack())`` as a call on torch's quantized engine ``name`` (set on every
    call: packed weights are the engine's own)."""
    torch.backends.quantized.engine = name
    packed = prepack()

    def call():
        torch.backends.quantized.engine = name
        return run(packed)

    return call


def with_mlas(make):
    """A qarray layer built and called on onnxruntime's MLAS engine (the one
    qarray used before its own kernels), or None without onnxruntime."""
    from qarray.backends import _gemm

    if not _gemm.status("u8s8")[0]:
        return None
    with qarray.config.using(gemm="u8s8"):
        layer = make()

    def call(*args, **kwargs):
        with qarray.config.using(gemm="u8s8"):
            return layer(*args, **kwargs)

    return call


# multiply-adds a cycle a core of each instruction set of qarray's GEMM:
# tdpbusd, 16 x 16 x 64 in 16 cycles; vpdpbusd, 64 (32) a cycle on two ports; vpmaddwd, 16 on two
PEAK = {"amx": 1024, "avx512vnni": 128, "avxvnni": 64, "avx2": 32}


def peak_share(op, shape, t, who, macs):
    """``who``'s multiply-adds a second as a fraction of the machine's peak
    (``PEAK`` of the instruction set in use, times the clock /proc/cpuinfo
    reports, times the threads)."""
    from qarray.backends.cpu import isa

    mhz, rate = cpu()["cpu_mhz"], PEAK.get(isa.best())
    if who not in t or not mhz or rate is None:
        return
    share = macs / (t[who][0] * 1e-3) / (rate * mhz * 1e6 * THREADS)
    say(f"{op + ' ' + shape:<42} {who:<34} {share:6.1%} of {isa.best()}'s peak ({rate} MAC/cycle x {mhz:.0f} MHz"
        f" x {THREADS} cores)")
    ROWS.append(dict(op=op, shape=shape, who=who, peak_share=round(share, 4), isa=isa.best()))


def linear_peers(fns, label, x, qx, wf, weight):
    """Add to ``fns`` qarray's int8-out ``nn.Linear`` of float weights ``wf`` on
    MLAS (``"qarray on MLAS, " + label``) and the int8 peers of ``x @
    weight.T`` (``x`` uint8 codes, ``qx`` them as a QArray; ``weight``: the
    layer's qint8 weights); return the peers' names."""
    mlas = with_mlas(lambda: nn.Linear.from_float(wf))
    if mlas is not None:
        fns["qarray on MLAS, " + label] = lambda: mlas(qx, scale=0.5, zero_point=0, dtype="qint8")
    peers = []
    tx = torch_qx(x, 0.02, 128) if torch is not None else None
    for e in torch_engines():
        peers.append(f"torch quantized.linear ({e})")
        fns[peers[-1]] = on_engine(e, lambda: torch.ops.quantized.linear_prepack(torch_qw(weight), None),
                                   lambda p: torch.ops.quantized.linear(tx, p, 0.5, 0))
    if ort is not None:
        peers.append("onnxruntime MatMulInteger")
        fns[peers[-1]] = ort_matmul_integer(x, weight.int_repr().T.copy())
    return peers


def best_peer(t, names):
    """The fastest (median) of ``names`` measured in ``t``."""
    return min((n for n in names if n in t), key=lambda n: t[n][0], default=None)


def bench_linear(rng, m, k, n):
    """quint8 and qint8 activations, qint8 per-channel weights, qint8 output."""
    x = rng.integers(0, 256, (m, k), dtype=np.uint8)
    wf = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    layer = nn.Linear.from_float(wf)
    qx = qarray.QArray.from_int(x, 0.02, 128, "quint8")
    qxs = qarray.QArray.from_int((x.astype(np.int16) - 128).astype(np.int8), 0.02, 0, "qint8")
    w_int = layer.weight.int_repr()
    xf, wt = x.astype(np.float32), w_int.astype(np.float32).T.copy()
    fns = {
        "numpy float32 matmul": lambda: xf @ wt,
        "qarray nn.Linear quint8 (int8 out)": lambda: layer(qx, scale=0.5, zero_point=0, dtype="qint8"),
        "qarray nn.Linear qint8 (int8 out)": lambda: layer(qxs, scale=0.5, zero_point=0, dtype="qint8"),
        "qarray nn.Linear quint8 (acc)": lambda: layer(qx),
        "qarray matmul (packs w per call)": lambda: matmul(qx, layer.weight.T),
    }
    peers = linear_peers(fns, "quint8 (int8 out)", x, qx, wf, layer.weight)
    t = timeit(REPEATS, **fns)
    op, shape = "linear", f"{m}x{k}x{n}"
    int8_out = ["qarray nn.Linear quint8 (int8 out)", "qarray nn.Linear qint8 (int8 out)"]
    report(op, shape, t, "numpy float32 matmul", 0.35, list(fns)[1:6])
    report(op, shape, t, best_peer(t, peers), 1.0, int8_out)
    report(op, shape, t, "qarray on MLAS, quint8 (int8 out)", 1.0, int8_out[:1])
    for p in peers:  # against each of the others too
        if p != best_peer(t, peers):
            report(op, shape, t, p, None, int8_out[:1])
    peak_share(op, shape, t, int8_out[0], m * k * n)


def bench_small_m(rng, m, k=4096, n=4096):
    """A decoder's token-by-token shape: the weights dominate."""
    x = rng.integers(0, 256, (m, k), dtype=np.uint8)
    wf = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    lin8 = nn.Linear.from_float(wf)
    lin4 = nn.Linear.from_float(wf, weight_dtype="qint4")
    qx = qarray.QArray.from_int(x, 0.02, 128, "quint8")
    xf, wt = x.astype(np.float32), wf.T.copy()
    fns = {
        "numpy float32 matmul": lambda: xf @ wt,
        "qarray nn.Linear int8 w (int8 out)": lambda: lin8(qx, scale=0.5, zero_point=0, dtype="qint8"),
        "qarray nn.Linear packed 4-bit w": lambda: lin4(qx, scale=0.5, zero_point=0, dtype="qint8"),
    }
    peers = linear_peers(fns, "int8 w (int8 out)", x, qx, wf, lin8.weight)
    t = timeit(REPEATS, **fns)
    op, shape = "linear small M", f"{m}x{k}x{n}"
    report(op, shape, t, "numpy float32 matmul", None, peers)
    report(op, shape, t, "numpy float32 matmul", 0.5, ["qarray nn.Linear int8 w (int8 out)"])
    report(op, shape, t, "numpy float32 matmul", 0.35, ["qarray nn.Linear packed 4-bit w"])
    report(op, shape, t, best_peer(t, peers), 1.0, ["qarray nn.Linear int8 w (int8 out)"])
    report(op, shape, t, "qarray on MLAS, int8 w (int8 out)", 1.0, ["qarray nn.Linear int8 w (int8 out)"])
    peak_share(op, shape, t, "qarray nn.Linear int8 w (int8 out)", m * k * n)


def im2col_f32(x, kh, kw, pad):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))  # N C OH OW kh kw
    n, c, oh, ow = win.shape[:4]
    return win.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, c * kh * kw), oh, ow


def bench_conv(rng, c, groups, hw=56):
    x = rng.integers(0, 256, (1, c, hw, hw), dtype=np.uint8)
    wf32 = (rng.standard_normal((c, c // groups, 3, 3)) * 0.05).astype(np.float32)
    layer = nn.Conv2d.from_float(wf32, padding=1, groups=groups)
    qx = qarray.QArray.from_int(x, 0.02, 128, "quint8")
    xf = x.astype(np.float32)
    wmat = layer.weight.int_repr().reshape(c, -1).astype(np.float32).T.copy()

    def float_im2col():
        cols, oh, ow = im2col_f32(xf, 3, 3, 1)
        return (cols @ wmat).reshape(1, oh, ow, c)

    fns = {
        "qarray conv2d (acc)": lambda: conv2d(qx, layer.weight, padding=1, groups=groups),
        "qarray conv2d (int8 out)": lambda: conv2d(qx, layer.weight, padding=1, groups=groups,
                                                   scale=0.5, zero_point=0, dtype="qint8"),
        "qarray nn.Conv2d (int8 out)": lambda: layer(qx, scale=0.5, zero_point=0, dtype="qint8"),
    }
    if groups == 1:
        fns["numpy float32 im2col+matmul"] = float_im2col
    peers = []
    if torch is not None:
        tx = torch_qx(x, 0.02, 128)
        for e in torch_engines():
            peers.append(f"torch quantized.conv2d ({e})")
            fns[peers[-1]] = on_engine(e, lambda: torch.ops.quantized.conv2d_prepack(
                torch_qw(layer.weight), None, [1, 1], [1, 1], [1, 1], groups), lambda p: torch.ops.quantized.conv2d(
                tx, p, 0.5, 0))
        tf, twf = torch.from_numpy(xf), torch.from_numpy(wf32)
        fns["torch float32 conv2d"] = lambda: torch.nn.functional.conv2d(tf, twf, padding=1, groups=groups)
    t = timeit(REPEATS, **fns)
    op, shape = "conv2d 3x3 pad 1" + (f" groups={groups}" if groups > 1 else ""), f"1x{c}x{hw}x{hw}"
    qrows = list(fns)[:3]
    if groups == 1:
        report(op, shape, t, "numpy float32 im2col+matmul", None, qrows)
    # torch's conv2d takes its weights prepacked (conv2d_prepack): the target is
    # nn.Conv2d's, which packs once too; the functional calls pack on every call
    best = best_peer(t, peers)
    report(op, shape, t, best, None, qrows[:2])
    report(op, shape, t, best, 1.0 if groups == 1 else 1.5, qrows[2:])
    for p in peers:
        if p != best:
            report(op, shape, t, p, None, qrows[2:])
    report(op, shape, t, "torch float32 conv2d", None, qrows)


def bench_grads(rng, b=256, k=1024, n=1024, c=64, hw=28, batch=8):
    """Training's backward products against float32 (no targets yet): a linear
    layer's grad_w = grad_out.T @ x (grad_out per output channel: a per-row
    operand) and grad_x = grad_out @ w (w per input feature); conv_transpose2d
    (stride 2, conv2d's input gradient and a decoder's upsampling) against
    torch's fbgemm and float32 ones; conv2d_weight_grad against
    torch.nn.grad.conv2d_weight."""
    x, g, w = (rng.standard_normal(s).astype(np.float32) for s in ((b, k), (b, n), (n, k)))
    qx = qarray.quantize(x, np.abs(x).max() / 127, 0, "qint8")
    qg = qarray.quantize(g, np.abs(g).max(0) / 127, 0, "qint8", axis=1)
    qgt = qarray.quantize(g, np.abs(g).max() / 127, 0, "qint8")
    qw = qarray.quantize(w, np.abs(w).max(0) / 127, 0, "qint8", axis=1)
    for op, fns in (("linear grad_w = grad_out.T @ x", {"qarray matmul (acc)": lambda: matmul(qg.T, qx),
                                                        "numpy float32 matmul": lambda: g.T @ x}),
                    ("linear grad_x = grad_out @ w", {"qarray matmul (acc)": lambda: matmul(qgt, qw),
                                                      "numpy float32 matmul": lambda: g @ w})):
        report(op, f"{b}x{n}, {b}x{k}, {n}x{k}", timeit(REPEATS, **fns), "numpy float32 matmul")
    xi = rng.integers(0, 256, (1, c, hw, hw), dtype=np.uint8)
    wt = (rng.standard_normal((c, c // 2, 3, 3)) * 0.05).astype(np.float32)
    qxi = qarray.QArray.from_int(xi, 0.02, 128, "quint8")
    qwt = qarray.quantize(wt, np.abs(wt).max() / 127, 0, "qint8")
    kw = dict(stride=2, padding=1, output_padding=1)
    fns = {"qarray conv_transpose2d (acc)": lambda: qarray.conv_transpose2d(qxi, qwt, **kw),
           "qarray conv_transpose2d (int8 out)": lambda: qarray.conv_transpose2d(qxi, qwt, **kw, scale=0.5,
                                                                                 zero_point=0, dtype="qint8")}
    if torch is not None:
        tx = torch_qx(xi, 0.02, 128)
        tw = torch.quantize_per_tensor(torch.from_numpy(qwt.dequantize()), float(qwt.scale), 0, torch.qint8)
        fns["torch quantized.conv_transpose2d (fbgemm)"] = on_engine(
            "fbgemm", lambda: torch.ops.quantized.conv_transpose2d_prepack(tw, None, [2, 2], [1, 1], [1, 1], [1, 1], 1),
            lambda p: torch.ops.quantized.conv_transpose2d(tx, p, 0.5, 0))
        tf, twf = torch.from_numpy(xi.astype(np.float32)), torch.from_numpy(wt)
        fns["torch float32 conv_transpose2d"] = lambda: torch.nn.functional.conv_transpose2d(tf, twf, **kw)
    t = timeit(REPEATS, **fns)
    shape = f"1x{c}x{hw}x{hw}, 3x3 stride 2"
    for ref in ("torch quantized.conv_transpose2d (fbgemm)", "torch float32 conv_transpose2d"):
        report("conv_transpose2d", shape, t, ref, None, list(fns)[:2])
    xb = rng.integers(0, 256, (batch, c, hw, hw), dtype=np.uint8)
    gb = rng.standard_normal((batch, c, hw, hw)).astype(np.float32)
    qxb = qarray.QArray.from_int(xb, 0.02, 128, "quint8")
    qgb = qarray.quantize(gb, np.abs(gb).max() / 127, 0, "qint8")
    fns = {"qarray conv2d_weight_grad (acc)": lambda: qarray.conv2d_weight_grad(qxb, (c, c, 3, 3), qgb, padding=1)}
    if torch is not None:
        txb, tgb = torch.from_numpy(xb.astype(np.float32)), torch.from_numpy(gb)
        fns["torch float32 conv2d_weight"] = lambda: torch.nn.grad.conv2d_weight(txb, (c, c, 3, 3), tgb, padding=1)
    report("conv2d_weight_grad", f"{batch}x{c}x{hw}x{hw}, 3x3 pad 1", timeit(REPEATS, **fns),
           "torch float32 conv2d_weight")


def bench_cat_lut(rng, n=1 << 23):
    a = qarray.quantize((rng.standard_normal(n) * 0.5).astype(np.float32), 0.01, 0, "qint8")
    b = qarray.quantize((rng.standard_normal(n) * 0.5).astype(np.float32), 0.02, 3, "qint8")
    da, db = a.int_repr(), b.int_repr()
    report("cat int8, b requantized", f"2x{n}", timeit(REPEATS, **{
        "numpy.concatenate": lambda: np.concatenate([da, db]),
        "qarray cat (requantize b)": lambda: cat([a, b], scale=0.01, zero_point=0, dtype="qint8"),
        "qarray cat (same params)": lambda: cat([a, a]),
    }), "numpy.concatenate", 2.0)
    q = qarray.quantize((rng.standard_normal(2 * n) * 2).astype(np.float32), 0.05, 0, "qint8")
    table = np.arange(256, dtype=np.uint8)
    u = q.int_repr().view(np.uint8)
    fns = {"numpy.take": lambda: np.take(table, u), "qarray sigmoid": lambda: sigmoid(q)}
    if torch is not None:
        tq = torch.quantize_per_tensor(torch.from_numpy(q.dequantize()), 0.05, 0, torch.qint8)
        fns["torch quantized sigmoid"] = lambda: torch.sigmoid(tq)
    report("sigmoid int8 -> uint8", str(2 * n), timeit(REPEATS, **fns), "numpy.take", 2.0)


def bench_softmax(rng, rows=1048):
    """softmax over ``rows`` rows of 1000 qint8 values, default (TFLite) output,
    against PyTorch's float32 softmax of the dequantized values."""
    q = qarray.quantize((rng.standard_normal((rows, 1000)) * 2).astype(np.float32), 0.05, 0, "qint8")
    fns = {"qarray softmax": lambda: softmax(q), "qarray log_softmax": lambda: log_softmax(q)}
    if torch is None:
        say("softmax: torch is not installed, no reference row")
        return
    x = torch.from_numpy(q.dequantize())
    fns["torch float32 softmax"] = lambda: torch.softmax(x, -1)
    tq = torch.quantize_per_tensor(x, 0.05, 0, torch.qint8)
    try:  # quantized softmax takes quint8 in PyTorch's CPU kernels
        tq8 = torch.quantize_per_tensor(x, 0.05, 128, torch.quint8)
        torch.ops.quantized.softmax(tq8, -1, 1 / 256, 0)
        fns["torch quantized softmax (quint8)"] = lambda: torch.ops.quantized.softmax(tq8, -1, 1 / 256, 0)
    except (AttributeError, RuntimeError):
        pass
    del tq
    report("softmax int8, rows", f"{rows}x1000", timeit(REPEATS, **fns), "torch float32 softmax", 1.0)


def main(outdir, quick):
    global REPEATS
    if quick:
        REPEATS = 3
    rng = np.random.default_rng(0)
    qarray.set_num_threads(THREADS)
    if torch is not None:
        torch.set_num_threads(THREADS)
        torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else torch.backends.quantized.engine
    info = dict(platform=platform.platform(), **cpu(), cpu_count=os.cpu_count(),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                python=platform.python_version(), numpy=np.__version__, threads=THREADS,
                torch=getattr(torch, "__version__", None), onnxruntime=getattr(ort, "__version__", None),
                quick=quick)
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    say("times: median (min) ms; ratios of medians and of mins to the reference; targets judged on the medians")
    say(f"qarray int8 GEMM engine: {qarray.backends.gemm_engine()}")
    if quick:
        bench_linear(rng, 128, 256, 256)
        bench_small_m(rng, 1, 512, 512)
        bench_conv(rng, 16, 1, 28)
        bench_conv(rng, 32, 32, 28)
        bench_cat_lut(rng, 1 << 18)
        bench_softmax(rng, 64)
        bench_grads(rng, 32, 128, 128, 16, 12, 2)
    else:
        bench_linear(rng, 1024, 1024, 1024)
        bench_linear(rng, 256, 4096, 4096)
        bench_small_m(rng, 1)
        bench_small_m(rng, 16)
        bench_conv(rng, 64, 1)
        bench_conv(rng, 256, 256)
        bench_cat_lut(rng)
        bench_softmax(rng)
        bench_grads(rng)
    write(outdir, "bench_ops", LINES, machine=info, rows=ROWS)


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
