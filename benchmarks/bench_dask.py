"""Dask benchmark: the overhead of the Dask backend, and strong scaling on a cluster.

Targets (issue 16):
- quantize + dequantize of 2**26 float32 values in 16 chunks on the threaded
  scheduler with one thread (``persist()``): <= 1.5x the in-memory call;
- out of core: ``qarray quantize BIG.safetensors -o OUT.zarr --per-channel 0``
  on a 6 GiB float32 file (one 4 GiB tensor among others, made here) allocates
  at most 256 MiB more (peak ``RssAnon``, polled) than on a tiny file;
- int8 ``nn.Linear`` (per-channel qint8 weights 1024x1024, qint8 out) over a
  65536x1024 batch in 16 chunks (scattered evenly over the workers), on a
  LocalCluster of 2 worker processes against 1, each held to one thread
  (Numba, BLAS, the GEMM engine): >= 1.5x
  (the client and scheduler share this machine's two cores); float32 BLAS
  through Dask on the same clusters is measured beside it.

Usage: ``PYTHONPATH=. python benchmarks/bench_dask.py [OUTDIR] [--quick]``
(``--quick``: small sizes, a check that everything runs).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"  # every pool, here and in the workers (they inherit it), one thread

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import options, timeit, write  # noqa: E402

import bench_ops  # noqa: E402
from bench_ops import report, say  # noqa: E402

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import distributed  # noqa: E402

import qarray  # noqa: E402


def bench_overhead(n, repeats):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dx = da.from_array(x, chunks=n // 16)
    fns = {
        "qarray dask quantize+dequantize": lambda: qarray.quantize(dx, 0.02, 3, "qint8").dequantize().persist(
            scheduler="threads", num_workers=1),
        "qarray in memory quantize+dequantize": lambda: qarray.quantize(x, 0.02, 3, "qint8").dequantize(),
    }
    t = timeit(repeats, **fns)
    report("dask overhead", f"{n} in 16 chunks, 1 thread", t, "qarray in memory quantize+dequantize", 1.5,
           ["qarray dask quantize+dequantize"])


def _cluster_time(workers, fn, repeats):
    """Median and min ms of what ``fn(client)`` times (it returns seconds) on a
    LocalCluster of ``workers`` one-thread processes, after one untimed run."""
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        client.run(qarray.set_num_threads, 1)  # the GEMM engine's own pool too (ORT ignores OMP_NUM_THREADS)
        fn(client)
        times = [fn(client) * 1e3 for _ in range(repeats)]
    return statistics.median(times), min(times)


def bench_scaling(rows, repeats):
    rng = np.random.default_rng(1)
    w = qarray.quantize_dynamic(rng.standard_normal((1024, 1024)).astype(np.float32), "qint8", symmetric=True, axis=0)
    wf = w.dequantize()
    layer = qarray.nn.Linear(w)  # weights packed once; the workers get codes and pack them once each

    def timed(make, run):
        def fn(client):
            x = make(client)
            distributed.wait(x.data if isinstance(x, qarray.QArray) else x)
            time.sleep(0.5)  # the workers release the float chunks first, outside the timing
            t0 = time.perf_counter()
            y = run(x)
            distributed.wait(y.data if isinstance(y, qarray.QArray) else y)
            return time.perf_counter() - t0
        return fn

    parts = [np.random.default_rng(i).standard_normal((rows // 16, 1024), dtype=np.float32) for i in range(16)]

    def floats(client):
        """The batch, its 16 chunks scattered evenly over the workers (round robin):
        tasks run where their chunk is, and generating it on the cluster placed
        10 chunks on one worker and 6 on the other in most runs, which caps the
        speedup at 1.6 whatever the compute."""
        futures = client.scatter(parts)
        return da.concatenate([da.from_delayed(f, p.shape, p.dtype) for f, p in zip(futures, parts)])

    contenders = {
        "qarray nn.Linear int8 (qint8 out)": timed(lambda c: qarray.quantize(floats(c), 0.02, 0, "qint8").persist(),
                                                   lambda q: layer(q, scale=0.5, zero_point=0, dtype="qint8").persist()),
        "numpy float32 x @ w.T": timed(lambda c: floats(c).persist(), lambda x: (x @ wf.T).persist()),
    }
    for who, fn in contenders.items():
        (m1, n1), (m2, n2) = _cluster_time(1, fn, repeats), _cluster_time(2, fn, repeats)
        target = 1.5 if who.startswith("qarray") else None
        met = None if target is None else m1 / m2 >= target
        bench_ops.ROWS.append(dict(op="dask strong scaling", shape=f"{rows}x1024 @ 1024x1024, 16 chunks", who=who,
                                   ms_1_worker=m1, min_ms_1_worker=n1, ms_2_workers=m2, min_ms_2_workers=n2,
                                   speedup=round(m1 / m2, 3), speedup_of_mins=round(n1 / n2, 3), target=target, met=met))
        say(f"dask strong scaling {rows}x1024 {who:<32} 1 worker {m1:9.1f} ({n1:8.1f})  2 workers {m2:9.1f} "
            f"({n2:8.1f})  speedup {m1 / m2:5.2f} ({n1 / n2:5.2f})" + ("" if target is None else
                                                                         f"  >={target} {'yes' if met else 'no'}"))


def _write_safetensors(path, tensors, seed):
    """A float32 .safetensors file of ``{name: shape}``: random dask arrays streamed
    into the file by ``qarray.save`` (never whole in memory)."""
    rng = da.random.default_rng(seed)
    qarray.save(path, {name: rng.standard_normal(shape, chunks="64MiB", dtype=np.float32)
                       for name, shape in tensors.items()})


def _peak_rss_anon(argv):
    """The peak ``RssAnon`` (bytes) of a command, polled every 10 ms, and its exit status."""
    import subprocess

    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.01)
    err = p.stderr.read().decode()
    if p.returncode:
        raise RuntimeError(f"{argv} failed: {err[-2000:]}")
    return peak


def bench_out_of_core(tmp, gib):
    """Peak RssAnon of the CLI on a ``gib`` GiB file against a tiny one."""
    import shutil

    cols = 4096
    big_rows = int(gib * 2**30 * 2 / 3) // (4 * cols)  # the big tensor: two thirds of the file
    rest_rows = int(gib * 2**30 / 3) // (4 * cols)
    files = {"tiny": {"w": (64, 64), "b": (64,)},
             "big": {"big": (big_rows, cols), "w2": (rest_rows // 2, cols), "w3": (rest_rows - rest_rows // 2, cols),
                     "b": (cols,)}}
    peaks, took = {}, {}
    qarray_cmd = [sys.executable, "-m", "qarray"]
    for key, tensors in files.items():
        src, out = tmp / f"{key}.safetensors", tmp / f"{key}.zarr"
        _write_safetensors(src, tensors, 3)
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        peaks[key] = _peak_rss_anon(qarray_cmd + ["quantize", str(src), "-o", str(out), "--per-channel", "0"])
        took[key] = time.perf_counter() - t0
        size = src.stat().st_size
        src.unlink()
        shutil.rmtree(out, ignore_errors=True)
        files[key] = size
    extra = (peaks["big"] - peaks["tiny"]) / 2**20
    met = extra <= 256
    bench_ops.ROWS.append(dict(op="out of core", file_bytes=files["big"], peak_rss_anon_big=peaks["big"],
                               peak_rss_anon_tiny=peaks["tiny"], extra_mib=round(extra, 1), seconds=round(took["big"], 1),
                               target="<= 256 MiB more", met=met))
    say(f"out of core: qarray quantize {files['big'] / 2**30:.2f} GiB .safetensors -> .zarr, per channel: peak RssAnon "
        f"{peaks['big'] / 2**20:.0f} MiB vs {peaks['tiny'] / 2**20:.0f} MiB on a tiny file: +{extra:.0f} MiB "
        f"(target <= 256: {'yes' if met else 'no'}), {took['big']:.1f} s")


def main(outdir: Path, quick: bool):
    info = dict(platform=platform.platform(), cpu_count=os.cpu_count(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                python=platform.python_version(), numpy=np.__version__, dask=dask.__version__,
                distributed=distributed.__version__, quick=quick)
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    say("times: median (min) ms; ratios of medians and of mins to the reference; targets judged on the medians")
    qarray.set_num_threads(1)
    bench_overhead(1 << (20 if quick else 26), 3 if quick else 9)
    bench_scaling(4096 if quick else 65536, 2 if quick else 9)
    import tempfile

    with tempfile.TemporaryDirectory(dir=os.environ.get("QARRAY_BENCH_TMP")) as tmp:
        bench_out_of_core(Path(tmp), 0.0625 if quick else 6)
    write(outdir, "bench_dask", bench_ops.LINES, machine=info, rows=bench_ops.ROWS)


if __name__ == "__main__":
    args = options(__doc__)
    main(args.outdir, args.quick)
