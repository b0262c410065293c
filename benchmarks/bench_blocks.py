"""Block-format linear: qarray against ggml's own kernels, onnxruntime's MatMulNBits and the memory floor.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_blocks.py [OUTDIR] [--quick] [--ggml PATH]

PATH (or the environment variable QARRAY_GGML_OPS): llama.cpp's ``test-backend-ops``, built from
llama-cpp-python's PyPI source package (``cmake -DLLAMA_BUILD_TESTS=ON ... && make test-backend-ops``,
Release, GGML_NATIVE); without it, ggml's rows are skipped. The rows, on as many threads as
``test-backend-ops`` gives ggml's CPU backend (half the cores):

- ggml's ``perf -o MUL_MAT -b CPU`` shapes: weights 4096 x 14336 (N x K) of Q8_0, Q4_0, Q4_K, Q6_K
  and IQ4_XS, float32 activations of M = 1, 8 and 512 rows. ggml quantizes the activations to its
  8-bit blocks and runs integer block dot products; qarray's row is the same work:
  ``BlockLinear(w)(qarray.quantize(x, dtype=ACT))``, the quantization of ``x`` in the timed call, ``ACT``
  ggml's own choice (its ``vec_dot_type``): Q8_K for the K-quants and IQ4_XS, Q8_0 otherwise.
  ggml runs as one process a row and a round (its us/run), alternating with qarray's calls, three
  rounds; medians with min-max, ratio qarray / ggml;
- M = 512 against qarray's own int8 GEMM at the same shape (``nn.Linear``, per-channel qint8
  weights, quint8 activations, int8 out);
- onnxruntime's ``MatMulNBits`` (4-bit, blocks of 32 and 128, ``accuracy_level`` 4: int8
  activations, its fastest) against ``BlockLinear`` on the same codes and scales (``int4_g32_f32``,
  ``int4_g128_f32``), Q8_0 activations, M = 1 and 8;
- MLX (``uint4_g64_f16_bias``), GPTQ (``int4_g128_f16``) and NF4 (``nf4_g64_f32``) at M = 1 against
  the memory floor: the weights' bytes over the read bandwidth measured in the same run (a 1 GiB
  buffer, larger than the last-level cache, summed on as many threads); float activations, and
  Q8_0 ones where the format takes them.

Results go to OUTDIR/bench_blocks.{json,txt} (default benchmarks/results). ``--quick``: small shapes,
a check that everything runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import RESULTS, cpu, helper, ort, write  # noqa: E402  (pools wait passively)
import numba  # noqa: E402
import numpy as np  # noqa: E402
import qarray as qa  # noqa: E402
import qarray.nn as qnn  # noqa: E402
from qarray._config import THREADS  # noqa: E402
from qarray.backends.cpu import isa  # noqa: E402

TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_XS"]
LINES, ROWS = [], []


def act(w):
    """The activations' format for weights ``w``, as ggml picks it: Q8_K where the format takes it."""
    return "Q8_K" if qa.ops.block_linear.q8k_supported(w.dtype.layout) is None else "Q8_0"


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def row(name, ours, peer, peer_name, **extra):
    """A result row: medians (ms) and their min-max, the ratio of medians."""
    r = dict(row=name, qarray_ms=statistics.median(ours), qarray_range=[min(ours), max(ours)],
             peer=peer_name, peer_ms=statistics.median(peer), peer_range=[min(peer), max(peer)], **extra)
    r["ratio"] = r["qarray_ms"] / r["peer_ms"]
    ROWS.append(r)
    say(f"{name:<34} qarray {r['qarray_ms']:8.2f} ms ({min(ours):.2f}-{max(ours):.2f})  {peer_name} "
        f"{r['peer_ms']:8.2f} ms ({min(peer):.2f}-{max(peer):.2f})  ratio {r['ratio']:.2f}"
        + "".join(f"  {k} {v}" for k, v in extra.items()))


def ggml_us(ops, type_name, m, n, k):
    """ggml's us/run for MUL_MAT of ``type_name`` weights (``m`` x ``k``, ggml's names) by ``n`` float32
    activation rows: one ``test-backend-ops perf`` process."""
    want = f"type_a={type_name.lower().replace('_k', '_K')},type_b=f32,m={m},n={n},k={k},"  # (ggml_type_name)
    out = subprocess.run([str(ops), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", want], capture_output=True,
                         text=True, check=True).stdout
    found = re.findall(r"MUL_MAT\((type_a=[^)]*)\):\s+\d+ runs -\s+([\d.]+) us/run", out)
    found = [us for vars_, us in found if vars_.startswith(want) and "bs=[1,1]" in vars_ and "nr=[1,1]" in vars_]
    if not found:
        raise RuntimeError(f"test-backend-ops printed no {want} row:\n{out[-2000:]}")
    return float(found[0])


def calls_ms(fn, repeats, settle=0.5):
    """Per-call ms of ``fn`` over ``repeats`` calls after a warm-up: untimed calls for ``settle`` seconds
    (at least one). Right after ggml's process, qarray's M = 1 calls ran 1.5x slower for a few hundred
    ms (Q4_0: 7.3 ms median against 5.0 alone and 6.4 a second later, on a noisy day)."""
    end = time.perf_counter() + settle
    fn()
    while time.perf_counter() < end:
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def against_ggml(ops, n_len, k_len, ms, repeats, rng):
    say(f"-- ggml's MUL_MAT perf shapes: weights {n_len} x {k_len}, float32 activations quantized in the call "
        f"(qarray: to Q8_K for the K-quants and IQ4_XS, to Q8_0 otherwise, as ggml)")
    for name in TYPES:
        w = qa.quantize(rng.standard_normal((n_len, k_len)).astype(np.float32), dtype=name)
        layer, a = qnn.BlockLinear(w), act(w)
        for m in ms:
            x = rng.standard_normal((m, k_len)).astype(np.float32)
            ours, theirs = [], []
            for _ in range(3):  # rounds: ggml's process, then qarray's calls
                theirs.append(ggml_us(ops, name, n_len, m, k_len) / 1e3)
                ours += calls_ms(lambda: layer(qa.quantize(x, dtype=a)), repeats if m < 512 else 2)
            row(f"{name} M={m}", ours, theirs, "ggml")


def against_int8(n_len, k_len, m, repeats, rng):
    say(f"-- M = {m}: block formats against qarray's own int8 GEMM (nn.Linear, int8 out), {n_len} x {k_len}")
    w = rng.standard_normal((n_len, k_len)).astype(np.float32)
    x = rng.standard_normal((m, k_len)).astype(np.float32)
    lin = qnn.Linear.from_float(w)
    xq = qa.quantize(x, 0.05, 128, "quint8")
    lin.calibrate(xq, dtype="qint8")
    int8 = calls_ms(lambda: lin(xq), repeats)
    for name in TYPES:
        wq = qa.quantize(w, dtype=name)
        layer, a = qnn.BlockLinear(wq), act(wq)
        row(f"{name} M={m} vs int8 GEMM", calls_ms(lambda: layer(qa.quantize(x, dtype=a)), repeats), int8,
            "qarray int8 nn.Linear", x=a)


def matmul_nbits(n_len, k_len, ms, repeats, rng):
    from qarray.onnx import export_matmul_nbits

    say(f"-- onnxruntime MatMulNBits (4-bit, accuracy_level 4) against BlockLinear on the same codes and scales, "
        f"{n_len} x {k_len}")
    w = rng.standard_normal((n_len, k_len)).astype(np.float32)
    for block in (32, 128):
        q = qa.quantize(w, dtype=f"int4_g{block}_f32")
        codes = q.dtype.layout.values[q.fields["q"]].astype(np.int8).reshape(n_len, k_len)
        same = qa.QArray.from_int(codes, q.scale.reshape(n_len, -1), 0, "qint4", axis=1, block_size=block)
        assert (same.dequantize() == q.dequantize()).all()
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = THREADS[0], 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(export_matmul_nbits(same, accuracy_level=4).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        layer = qnn.BlockLinear(q)
        for m in ms:
            x = rng.standard_normal((m, k_len)).astype(np.float32)
            got = sess.run(None, {"A": x})[0]
            assert np.allclose(got, layer(x), rtol=0.05, atol=0.05 * np.abs(got).max())  # the same layer
            ours, theirs = [], []
            for _ in range(3):  # rounds, each function's calls in a block
                theirs += calls_ms(lambda: sess.run(None, {"A": x}), repeats)
                ours += calls_ms(lambda: layer(qa.quantize(x, dtype="Q8_0")), repeats)
            row(f"int4_g{block} M={m}", ours, theirs, "ort MatMulNBits")


@numba.njit(parallel=True)
def _read(buf):
    """Sum of ``buf`` (uint64), read once: the read bandwidth (a plain reduction, which vectorizes;
    one with an index modulo 8 did not, and read at 3 GB/s)."""
    total = np.uint64(0)
    for i in numba.prange(len(buf)):
        total += buf[i]
    return total


def memory_floor(n_len, k_len, repeats, rng, size):
    say(f"-- M = 1 against the memory floor: weights' bytes / read bandwidth ({size >> 20} MiB summed on "
        f"{THREADS[0]} threads), {n_len} x {k_len}")
    buf = np.ones(size // 8, np.uint64)
    numba.set_num_threads(THREADS[0])
    x = rng.standard_normal((1, k_len)).astype(np.float32)
    w = rng.standard_normal((n_len, k_len)).astype(np.float32)
    for name in ("uint4_g64_f16_bias", "int4_g128_f16", "nf4_g64_f32"):
        q = qa.quantize(w, dtype=name)
        layer = qnn.BlockLinear(q)
        modes = {"float x": lambda: layer(x)}
        if layer._packed is not None:
            modes["Q8_0 x"] = lambda: layer(qa.quantize(x, dtype="Q8_0"))
        for mode, fn in modes.items():
            ours, floor = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                _read(buf)
                floor.append(q.data.nbytes / (size / (time.perf_counter() - t0)) * 1e3)
                ours += calls_ms(fn, repeats)
            row(f"{name} M=1 {mode}", ours, floor, "memory floor", weight_MB=round(q.data.nbytes / 1e6, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("outdir", nargs="?", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ggml", type=Path, default=os.environ.get("QARRAY_GGML_OPS"))
    p.add_argument("--only", choices=("floor",), help="that section alone, to OUTDIR/bench_blocks_floor.*")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    threads = max(1, (os.cpu_count() or 2) // 2)  # test-backend-ops': half the cores
    qa.set_num_threads(threads)
    info = cpu()
    say(f"bench_blocks {datetime.date.today()}: {info['cpu']}, {os.cpu_count()} cores, {threads} thread(s), "
        f"instruction set {isa.best()}; flags {info['cpu_flags']}; {info['cpu_mhz']} MHz; load {info['load_avg_1m']}")
    n_len, k_len, ms = (256, 1024, (1, 8)) if a.quick else (4096, 14336, (1, 8, 512))
    repeats = 3 if a.quick else 15
    if a.only == "floor":
        memory_floor(n_len, k_len, repeats, rng, (64 if a.quick else 1024) << 20)
        write(a.outdir, "bench_blocks_floor", LINES, cpu=info, threads=threads, rows=ROWS)
        return
    if a.ggml is not None and a.ggml.exists() and not a.quick:  # (ggml's perf shapes only)
        against_ggml(a.ggml, n_len, k_len, ms, repeats, rng)
    else:
        say("-- ggml: no test-backend-ops (--ggml PATH or QARRAY_GGML_OPS): rows skipped")
    against_int8(n_len, k_len, 64 if a.quick else 512, 2 if a.quick else 5, rng)
    if ort is not None and helper is not None:
        matmul_nbits(n_len, k_len, ms[:2], repeats, rng)
    memory_floor(n_len, k_len, repeats, rng, (64 if a.quick else 1024) << 20)
    write(a.outdir, "bench_blocks", LINES, cpu=info, threads=threads, rows=ROWS)


if __name__ == "__main__":
    main()
