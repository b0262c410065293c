"""GPU benchmark: the CuPy backend's kernels against the device's copy bandwidth
and PyTorch's CUDA quantize/dequantize, measured in one run.

Run on a machine with a CUDA device and CuPy (PyTorch optional):

    PYTHONPATH=. python benchmarks/bench_gpu.py [OUTDIR] [--quick]

Times come from CUDA events (median of REPEATS after a warm-up). Bandwidth is
bytes read + bytes written per second; the reference is a device-to-device
copy of the same input measured in the same run (the faster of ``cupy.copyto``
into an allocated array and ``copy()``). Targets: quantize,
dequantize and requantize >= 85% of copy bandwidth per-tensor and per-axis
(issue 11; 80% in issue 4), LUT and cat >= 70%. Integer GEMM (issue 11): 8192^3
int8 -> int32 at least 70% of ``torch._int_mm`` (cuBLASLt); with the requantize
epilogue at most 10% slower than without; M = 16 against 8192x8192 weights at
least 70% of the bandwidth of reading the weights once (copy bandwidth), packed
4-bit at least 1.6x faster than int8. Dask with CuPy chunks (issue 16, where
dask imports): quantize + dequantize of 2^26 float32 values in 16 chunks, and
int8 ``nn.Linear`` (1024x1024 per-channel qint8 weights, qint8 out) over a
65536x1024 batch in 16 chunks, each on the threaded scheduler with one thread
(``persist()``) at most 1.5x the in-memory CuPy call (one device: no scaling).
``linear`` on block-format weights (issue 41, cuda/blocks.cu; no target yet):
Q4_0, Q8_0, Q4_K and int4_g128_f16 weights of 4096x4096 and 14336x4096 (out x
in) at M = 1, 16 (block_gemv; Q8_0 activations too) and 512 (dequantize-then-
GEMM, float64 sums), each against torch's float16 ``F.linear`` (cuBLAS) on the
same shapes and the bandwidth of reading the weights once.
Writes bench_gpu.{txt,json} to OUTDIR (default benchmarks/results); each JSON
row has the input ``shape``. ``--quick``: 2^24 elements and 2048^3, 3 repeats,
block-format linear on 512x1024 weights at M = 1, 16 and 64.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import cupy  # noqa: E402
import numpy as np  # noqa: E402
from _timing import options  # noqa: E402

import qarray  # noqa: E402

try:
    import torch

    if not torch.cuda.is_available():
        torch = None
except ImportError:
    torch = None

N = 1 << 28
G = 8192  # GEMM size
REPEATS = 10
LINES, ROWS = [], []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def gpu_ms(fn):
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def row(op, ms, nbytes, copy_gbs, target=None, peer=None, shape=None):
    gbs = nbytes / ms / 1e6
    frac = gbs / copy_gbs
    met = None if target is None else frac >= target
    ROWS.append(dict(op=op, shape=str(N) if shape is None else shape, ms=ms, gbs=gbs, fraction_of_copy=frac, target=target, met=met, peer=peer))
    extra = f"  torch {peer:.3f} ms ({ms / peer:.2f}x)" if peer else ""
    say(f"{op:<56} {ms:8.3f} ms {gbs:8.1f} GB/s {100 * frac:6.1f}% of copy"
        f"{'' if target is None else f'  target {int(100 * target)}%: ' + ('yes' if met else 'no')}{extra}")


def ratio_row(op, ms, ref_ms, target, shape, better="lower"):
    """A row that compares with a reference time: ``ms / ref_ms`` at most
    ``target`` (or, ``better="higher"``, ``ref_ms / ms`` at least ``target``)."""
    r = ms / ref_ms if better == "lower" else ref_ms / ms
    met = None if target is None else (r <= target if better == "lower" else r >= target)
    ROWS.append(dict(op=op, shape=shape, ms=ms, ref_ms=ref_ms, ratio=r, target=target, met=met))
    want = "" if target is None else f"  target {'<=' if better == 'lower' else '>='} {target}: {'yes' if met else 'no'}"
    say(f"{op:<56} {ms:8.3f} ms  reference {ref_ms:8.3f} ms  ratio {r:5.2f}{want}")


def gemm_rows(copy_gbs):
    """cuBLAS int8 GEMM through nn-style packed weights, and gemv for M = 16."""
    from qarray.ops.linear import PackedWeight

    rng = cupy.random
    xa = qarray.QArray.from_int(rng.randint(-128, 128, (G, G), dtype=cupy.int8), 0.01, 0, "qint8")
    wq = qarray.QArray.from_int(rng.randint(-128, 128, (G, G), dtype=cupy.int8), 0.01, 0, "qint8")
    packed = PackedWeight(wq.T, 1, keep=True)  # packed once, as nn.Linear does
    acc = gpu_ms(lambda: packed.matmul("bench", xa, None, None, None, None, None, None, False))
    req = gpu_ms(lambda: packed.matmul("bench", xa, None, 0.5, 0, "qint8", None, None, False))
    shape = f"{G}x{G}x{G}"
    if torch is not None:
        at, bt = torch.as_tensor(xa.data, device="cuda"), torch.as_tensor(wq.data, device="cuda").t()
        ratio_row("int8 GEMM -> int32 vs torch._int_mm", acc, gpu_ms(lambda: torch._int_mm(at, bt)), 0.7, shape,
                  better="higher")
    ratio_row("int8 GEMM -> qint8 (epilogue) vs -> int32", req, acc, 1.1, shape)
    x16 = qarray.QArray.from_int(rng.randint(-128, 128, (16, G), dtype=cupy.int8), 0.01, 0, "qint8")
    w_bytes = G * G
    for wd, lo, hi, nbytes in (("qint8", -128, 128, w_bytes), ("qint4", -8, 8, w_bytes // 2)):
        w = qarray.QArray.from_int(rng.randint(lo, hi, (G, G), dtype=cupy.int8), 0.01, 0, wd)
        pw = PackedWeight(w.T, 1, keep=True)
        ms = gpu_ms(lambda: pw.matmul("bench", x16, None, 0.5, 0, "qint8", None, None, False))
        gbs = nbytes / ms / 1e6
        ROWS.append(dict(op=f"gemv M=16 {wd} weights", shape=f"16x{G}x{G}", ms=ms, weight_gbs=gbs,
                         fraction_of_copy=gbs / copy_gbs, target=0.7 if wd == "qint8" else None))
        label = f"gemv M=16 {wd} weights"
        say(f"{label:<56} {ms:8.3f} ms {gbs:8.1f} GB/s of weights "
            f"{100 * gbs / copy_gbs:6.1f}% of copy" + ("  target 70%: " + ("yes" if gbs / copy_gbs >= 0.7 else "no")
                                                      if wd == "qint8" else ""))
        if wd == "qint8":
            int8_ms = ms
    ratio_row("gemv M=16: packed 4-bit vs int8 weights", ms, int8_ms, 1.6, f"16x{G}x{G}", better="higher")


def _block_weights(fmt_name, n, k):
    """A device QArray ``(n, k)`` of block format ``fmt_name``: random codes, float scales of either
    sign in [0.02, 2) (no inf or NaN: those would take the kernels' NaN paths), packed on the host."""
    from qarray import _blocks

    fmt = _blocks.get(fmt_name)
    rng = np.random.default_rng(0)
    fields = fmt.unpack(rng.integers(0, 256, (n * k // fmt.block, fmt.nbytes), dtype=np.uint8))
    for name, field in fmt.fields.items():
        if field.view == np.float16:
            shape = fields[name].shape
            fields[name] = (rng.uniform(0.02, 2, shape) * rng.choice([-1, 1], shape)).astype(np.float16)
    return qarray.QArray.from_blocks(cupy.asarray(fmt.pack(fields).reshape(n, -1)), fmt_name)


def block_rows(copy_gbs, quick):
    """linear on block-format weights: block_gemv (M <= 16) and dequantize-then-GEMM (M = 512) against
    torch's float16 linear (tensor cores) on the same shapes; Q8_0 activations at M <= 16."""
    shapes, ms_ = ([(512, 1024)], (1, 16, 64)) if quick else ([(4096, 4096), (14336, 4096)], (1, 16, 512))
    for fmt in ("Q4_0", "Q8_0", "Q4_K", "int4_g128_f16"):
        for n, k in shapes:
            w = _block_weights(fmt, n, k)
            wt = None if torch is None else torch.randn(n, k, dtype=torch.float16, device="cuda")
            for m in ms_:
                x = cupy.random.standard_normal((m, k), dtype=cupy.float32)
                xq = qarray.quantize(x, dtype="Q8_0") if m <= 16 else None
                shape = f"{m}x{k} . ({n}x{k})^T"
                for label, xa in ((f"linear {fmt} weights, float32 x, M={m}", x),
                                  (f"linear {fmt} weights, Q8_0 x, M={m}", xq)):
                    if xa is None:
                        continue
                    ms = gpu_ms(lambda: qarray.linear(xa, w))
                    gbs = w.data.nbytes / ms / 1e6
                    peer = None
                    if torch is not None:
                        xt = torch.as_tensor(x, device="cuda").half()
                        peer = gpu_ms(lambda: torch.nn.functional.linear(xt, wt))
                    ROWS.append(dict(op=label, shape=shape, ms=ms, weight_gbs=gbs, fraction_of_copy=gbs / copy_gbs,
                                     torch_f16_ms=peer, ratio=None if peer is None else ms / peer))
                    say(f"{label:<56} {ms:8.3f} ms {gbs:8.1f} GB/s of weights {100 * gbs / copy_gbs:6.1f}% of copy"
                        + ("" if peer is None else f"  torch float16 F.linear {peer:.3f} ms ({ms / peer:.2f}x)"))


def host_rows(quick):
    """Host time per call on small inputs (bench_gpu_host.py's ops), from
    ``cupyx.profiler.benchmark``'s CPU times: target 40 us, and no wait for the
    device (its GPU time is the kernels alone)."""
    from cupyx.profiler import benchmark

    from bench_gpu_host import host_ops

    for name, fn in host_ops(cupy, qarray).items():
        r = benchmark(fn, n_repeat=20 if quick else 500, n_warmup=10)
        cpu_us, gpu_us = 1e6 * float(np.median(r.cpu_times)), 1e6 * float(np.median(r.gpu_times[0]))
        spread = 1e6 * np.percentile(r.cpu_times, [10, 90])
        ROWS.append(dict(op=f"host time: {name}", host_us=cpu_us, host_us_p10_p90=spread.tolist(), gpu_us=gpu_us,
                         target=40, met=cpu_us <= 40))
        say(f"host time: {name:<46} {cpu_us:7.1f} us (p10-p90 {spread[0]:.1f}-{spread[1]:.1f}), "
            f"GPU {gpu_us:7.1f} us  target <= 40 us: {'yes' if cpu_us <= 40 else 'no'}")


def dask_rows(quick):
    """Dask arrays of CuPy chunks against the same calls on the in-memory arrays."""
    try:
        import dask.array as da
    except ImportError:
        say("dask: not installed here, Dask rows skipped")
        return
    n, rows = (1 << 22, 4096) if quick else (1 << 26, 65536)
    x = cupy.random.standard_normal(n, dtype=cupy.float32)
    dx = da.from_array(x, chunks=n // 16, asarray=False)
    persist = dict(scheduler="threads", num_workers=1)
    ratio_row("dask (CuPy chunks) quantize+dequantize vs in memory",
              gpu_ms(lambda: qarray.quantize(dx, 0.02, 3, "qint8").dequantize().persist(**persist)),
              gpu_ms(lambda: qarray.quantize(x, 0.02, 3, "qint8").dequantize()), 1.5, f"{n} in 16 chunks")
    # per-channel weights at given scales: no parameters from the data (on the stand-in, whose launches
    # are stubbed, a minmax would read an uninitialized array, sometimes inf)
    w = cupy.random.standard_normal((1024, 1024), dtype=cupy.float32)
    lin = qarray.nn.Linear(qarray.quantize(w, np.full(1024, 0.03, np.float32), 0, "qint8", axis=0))
    xa = cupy.random.standard_normal((rows, 1024), dtype=cupy.float32)
    a = qarray.quantize(xa, 0.05, 0, "qint8")
    a_chunks = qarray.quantize(da.from_array(xa, chunks=(rows // 16, 1024), asarray=False), 0.05, 0, "qint8").persist()
    ratio_row("dask (CuPy chunks) int8 nn.Linear -> qint8 vs in memory",
              gpu_ms(lambda: lin(a_chunks, scale=0.5, zero_point=0, dtype="qint8").persist(**persist)),
              gpu_ms(lambda: lin(a, scale=0.5, zero_point=0, dtype="qint8")), 1.5, f"{rows}x1024 @ 1024x1024 in 16 chunks")


def main(outdir: Path, quick: bool):
    global N, G, REPEATS
    if quick:
        N, G, REPEATS = 1 << 24, 2048, 3
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    say(f"device: {name}, cupy {cupy.__version__}, torch {getattr(torch, '__version__', None)}, elements {N}")
    x = cupy.random.standard_normal(N, dtype=cupy.float32)
    q = qarray.quantize(x, 0.01, 3, "qint8")
    q32 = qarray.QArray.from_int(cupy.random.randint(-(2**20), 2**20, N, dtype=cupy.int32), 1e-4, 0, "qint32")
    # the reference: the faster of CuPy's two copies of the same bytes into memory already
    # allocated (copyto, an elementwise kernel; copy(), cudaMemcpy), read + write. x.copy()
    # alone, cudaMemcpy, reached 1.63 TB/s on an H200 where copyto reached 3.98 TB/s, so
    # "% of copy" read 2.4x too kind against it
    dst = cupy.empty_like(x)
    copy_ms = min(gpu_ms(lambda: cupy.copyto(dst, x)), gpu_ms(lambda: x.copy()))
    del dst
    copy_gbs = 2 * x.nbytes / copy_ms / 1e6
    say(f"device-to-device copy of float32 (best of copyto, copy): {copy_ms:.3f} ms, {copy_gbs:.1f} GB/s")
    tq = td = None
    if torch is not None:
        xt = torch.as_tensor(x, device="cuda")
        qt = torch.quantize_per_tensor(xt, 0.01, 3, torch.qint8)
        tq = gpu_ms(lambda: torch.quantize_per_tensor(xt, 0.01, 3, torch.qint8))
        td = gpu_ms(lambda: qt.dequantize())
    row("quantize float32 -> qint8", gpu_ms(lambda: qarray.quantize(x, 0.01, 3, "qint8")), 5 * N, copy_gbs, 0.85, tq)
    row("dequantize qint8 -> float32", gpu_ms(lambda: q.dequantize()), 5 * N, copy_gbs, 0.85, td)
    # training's quantizers (no target yet): float32 in and out in one pass; Philox per element
    tf = None if torch is None else gpu_ms(lambda: torch.fake_quantize_per_tensor_affine(xt, 0.01, 3, -128, 127))
    row("fake_quantize float32 -> float32 (qint8 codes)", gpu_ms(lambda: qarray.fake_quantize(x, 0.01, 3, "qint8")),
        8 * N, copy_gbs, None, tf)
    fbuf = cupy.empty_like(x)
    row("fake_quantize float32 -> float32, out= (a kept buffer)",
        gpu_ms(lambda: qarray.fake_quantize(x, 0.01, 3, "qint8", out=fbuf)), 8 * N, copy_gbs, None, tf)
    row("fake_quantize, rounding='stochastic', return_mask",
        gpu_ms(lambda: qarray.fake_quantize(x, 0.01, 3, "qint8", rounding="stochastic", seed=1, return_mask=True)),
        9 * N, copy_gbs)
    del fbuf
    row("quantize float32 -> qint8, rounding='stochastic'",
        gpu_ms(lambda: qarray.quantize(x, 0.01, 3, "qint8", rounding="stochastic", seed=1)), 5 * N, copy_gbs)
    row("requantize qint32 -> qint8, rounding='stochastic'",
        gpu_ms(lambda: qarray.requantize(q32, 0.05, 0, "qint8", rounding="stochastic", seed=1)), 5 * N, copy_gbs)
    # per-axis: channels along the last axis (a slot per column) and the first (a slot per row)
    for axis, shape in ((1, (N // 4096, 4096)), (0, (4096, N // 4096))):
        xs = x.reshape(shape)
        s = np.linspace(0.005, 0.02, shape[axis]).astype(np.float32)
        qs = qarray.quantize(xs, s, 0, "qint8", axis=axis)
        q32s = qarray.QArray.from_int(q32.data.reshape(shape), s * 1e-2, 0, "qint32", axis=axis)
        tag = f"per-axis {axis} of {shape[0]}x{shape[1]}"
        row(f"quantize float32 -> qint8, {tag}", gpu_ms(lambda: qarray.quantize(xs, s, 0, "qint8", axis=axis)),
            5 * N, copy_gbs, 0.85)
        row(f"dequantize qint8 -> float32, {tag}", gpu_ms(lambda: qs.dequantize()), 5 * N, copy_gbs, 0.85)
        row(f"requantize qint32 -> qint8, {tag}",
            gpu_ms(lambda: qarray.requantize(q32s, s, 0, "qint8", axis=axis)), 5 * N, copy_gbs, 0.85)
    x16 = x.astype(cupy.float16)
    row("quantize float16 -> qint8", gpu_ms(lambda: qarray.quantize(x16, 0.01, 3, "qint8")), 3 * N, copy_gbs, 0.8)
    row("dequantize qint8 -> float16", gpu_ms(lambda: q.dequantize("float16")), 3 * N, copy_gbs, 0.8)
    for r in ("half_even", "tflite"):
        row(f"requantize qint32 -> qint8 ({r})", gpu_ms(lambda: qarray.requantize(q32, 0.05, 0, "qint8", rounding=r)),
            5 * N, copy_gbs, 0.85)
    row("requantize qint32 -> qint8 (float mode)", gpu_ms(lambda: qarray.requantize(q32, 0.05, 0, "qint8", mode="float")),
        5 * N, copy_gbs, 0.85)
    row("sigmoid (LUT) qint8 -> quint8", gpu_ms(lambda: qarray.sigmoid(q)), 2 * N, copy_gbs, 0.7)
    half = q[: N // 2]
    other = qarray.quantize(x[: N // 2], 0.02, 0, "qint8")
    row("cat 2 halves qint8, one requantized",
        gpu_ms(lambda: qarray.cat([half, other], scale=0.01, zero_point=3, dtype="qint8")), 2 * N, copy_gbs, 0.7,
        shape=f"2x{N // 2}")
    # add/mul: two int8 inputs, int8 output, requantize and ReLU in the same kernel (no target in the issue)
    row("add qint8 + qint8 -> qint8, relu (fused)",
        gpu_ms(lambda: qarray.add(half, other, scale=0.02, zero_point=0, dtype="qint8", relu=True)), 3 * N // 2, copy_gbs,
        shape=str(N // 2))
    row("mul qint8 * qint8 -> qint8 (fused)",
        gpu_ms(lambda: qarray.mul(half, other, scale=0.02, zero_point=0, dtype="qint8")), 3 * N // 2, copy_gbs,
        shape=str(N // 2))
    gemm_rows(copy_gbs)
    block_rows(copy_gbs, quick)
    host_rows(quick)
    dask_rows(quick)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "bench_gpu.txt").write_text("\n".join(LINES) + "\n")
    (outdir / "bench_gpu.json").write_text(json.dumps(dict(device=name, copy_gbs=copy_gbs, rows=ROWS), indent=1) + "\n")


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
