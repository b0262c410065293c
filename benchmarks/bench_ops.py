"""Quantized-op benchmark: matmul/linear, conv2d, cat and LUT against float and peers.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_ops.py

Every row is measured side by side in one run (warm-up once, then the contenders
take turns in blocks of calls; median and min in ms) and reported as a ratio to
the row's reference: float32 numpy.matmul for linear, float32 im2col + matmul
for conv2d, numpy.concatenate for cat, numpy.take for the LUT ops. PyTorch
(fbgemm quantized linear/conv, float conv) and onnxruntime (MatMulInteger) are
reported when installed. Nothing is asserted. Results go to
benchmarks/results/bench_ops.{json,txt}.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import TensorProto, helper, ort, timeit, torch  # noqa: E402  (peers, after OMP_WAIT_POLICY)
import qarray  # noqa: E402
from qarray import nn  # noqa: E402
from qarray.ops import cat, conv2d, log_softmax, matmul, sigmoid, softmax  # noqa: E402


THREADS = 2
REPEATS = 9
RESULTS = ROOT / "benchmarks" / "results"
LINES: list[str] = []
ROWS: list[dict] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def report(op, t, ref, target=None):
    """One row per contender against ``ref``; ``target`` applies to the qarray rows."""
    for name, (med, mn) in t.items():
        if name == ref:
            continue
        ratio, ratio_min = med / t[ref][0], mn / t[ref][1]
        met = None if target is None or not name.startswith("qarray") else ratio_min <= target
        ROWS.append(dict(op=op, who=name, ms=med, min_ms=mn, ref=ref, ref_ms=t[ref][0], ratio=round(ratio, 3),
                         ratio_min=round(ratio_min, 3), target=target if met is not None else None, met=met))
        flag = "" if met is None else ("yes" if met else "no")
        tgt = f"<={target}" if met is not None else ""
        say(f"{op:<34} {name:<30} {med:9.2f} ({mn:8.2f})  vs {ref:<24} {t[ref][0]:9.2f} ({t[ref][1]:8.2f})"
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


def bench_linear(rng, m, k, n):
    x = rng.integers(0, 256, (m, k), dtype=np.uint8)
    wf32 = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    layer = nn.Linear.from_float(wf32)
    qx = qarray.QArray.from_int(x, 0.02, 128, "quint8")
    w_int = layer.weight.int_repr()
    xf, wt = x.astype(np.float32), w_int.astype(np.float32).T.copy()
    qw = layer.weight
    fns = {
        "numpy float32 matmul": lambda: xf @ wt,
        "qarray nn.Linear (acc)": lambda: layer(qx),
        "qarray nn.Linear (int8 out)": lambda: layer(qx, scale=0.5, zero_point=0, dtype="qint8"),
        "qarray matmul (packs w)": lambda: matmul(qx, qw.T),
    }
    if torch is not None:
        tx = torch.quantize_per_tensor(torch.from_numpy(x.astype(np.float32) * 0.02 - 2.56), 0.02, 128, torch.quint8)
        tw = torch.quantize_per_channel(torch.from_numpy(qw.dequantize()), torch.from_numpy(qw.scale.astype(np.float64)),
                                        torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(tw, None)
        fns["torch quantized.linear (fbgemm)"] = lambda: torch.ops.quantized.linear(tx, packed, 0.5, 0)
    if ort is not None:
        fns["onnxruntime MatMulInteger"] = ort_matmul_integer(x, w_int.T.copy())
    report(f"linear {m}x{k}x{n}", timeit(REPEATS, **fns), "numpy float32 matmul", 1.2)


def im2col_f32(x, kh, kw, pad):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))  # N C OH OW kh kw
    n, c, oh, ow = win.shape[:4]
    return win.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, c * kh * kw), oh, ow


def bench_conv(rng):
    x = rng.integers(0, 256, (1, 64, 56, 56), dtype=np.uint8)
    wf32 = (rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32)
    layer = nn.Conv2d.from_float(wf32, padding=1)
    qx = qarray.QArray.from_int(x, 0.02, 128, "quint8")
    xf = x.astype(np.float32)
    wmat = layer.weight.int_repr().reshape(64, -1).astype(np.float32).T.copy()

    def float_im2col():
        cols, oh, ow = im2col_f32(xf, 3, 3, 1)
        return (cols @ wmat).reshape(1, oh, ow, 64)

    fns = {
        "numpy float32 im2col+matmul": float_im2col,
        "qarray conv2d": lambda: conv2d(qx, layer.weight, padding=1),
        "qarray conv2d (int8 out)": lambda: conv2d(qx, layer.weight, padding=1, scale=0.5, zero_point=0, dtype="qint8"),
        "qarray nn.Conv2d (int8 out)": lambda: layer(qx, scale=0.5, zero_point=0, dtype="qint8"),
    }
    if torch is not None:
        tx = torch.quantize_per_tensor(torch.from_numpy(xf * 0.02 - 2.56), 0.02, 128, torch.quint8)
        qw = layer.weight
        tw = torch.quantize_per_channel(torch.from_numpy(qw.dequantize()), torch.from_numpy(qw.scale.astype(np.float64)),
                                        torch.zeros(64, dtype=torch.int64), 0, torch.qint8)
        packed = torch.ops.quantized.conv2d_prepack(tw, None, [1, 1], [1, 1], [1, 1], 1)
        fns["torch quantized.conv2d (fbgemm)"] = lambda: torch.ops.quantized.conv2d(tx, packed, 0.5, 0)
        tf, twf = torch.from_numpy(xf), torch.from_numpy(wf32)
        fns["torch float32 conv2d"] = lambda: torch.nn.functional.conv2d(tf, twf, padding=1)
    report("conv2d 1x64x56x56, 64x3x3, pad 1", timeit(REPEATS, **fns), "numpy float32 im2col+matmul", 1.5)


def bench_cat_lut(rng):
    n = 1 << 23
    a = qarray.quantize((rng.standard_normal(n) * 0.5).astype(np.float32), 0.01, 0, "qint8")
    b = qarray.quantize((rng.standard_normal(n) * 0.5).astype(np.float32), 0.02, 3, "qint8")
    da, db = a.int_repr(), b.int_repr()
    report("cat 2x2^23 int8, b requantized", timeit(REPEATS, **{
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
    report("sigmoid 2^24 int8 -> uint8", timeit(REPEATS, **fns), "numpy.take", 2.0)


def bench_softmax(rng):
    """softmax over 2**20 qint8 values in rows of 1000, default (TFLite) output,
    against PyTorch's float32 softmax of the dequantized values."""
    q = qarray.quantize((rng.standard_normal((1048, 1000)) * 2).astype(np.float32), 0.05, 0, "qint8")
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
    report("softmax 1048x1000 int8, rows", timeit(REPEATS, **fns), "torch float32 softmax", 1.0)


def main():
    rng = np.random.default_rng(0)
    qarray.set_num_threads(THREADS)
    if torch is not None:
        torch.set_num_threads(THREADS)
        torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else torch.backends.quantized.engine
    info = dict(platform=platform.platform(), cpu_count=os.cpu_count(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                python=platform.python_version(), numpy=np.__version__, threads=THREADS,
                torch=getattr(torch, "__version__", None), onnxruntime=getattr(ort, "__version__", None))
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    say("times: median (min) ms; ratios of medians and of mins to the reference; targets judged on the mins")
    bench_linear(rng, 1024, 1024, 1024)
    bench_linear(rng, 256, 4096, 4096)
    bench_conv(rng)
    bench_cat_lut(rng)
    bench_softmax(rng)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_ops.txt").write_text("\n".join(LINES) + "\n")
    (RESULTS / "bench_ops.json").write_text(json.dumps(dict(machine=info, rows=ROWS), indent=1) + "\n")


if __name__ == "__main__":
    main()
