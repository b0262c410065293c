"""The lm example's GGUF in llama.cpp: its logits against qarray's forward pass, and llama-bench.

Needs llama.cpp built from llama-cpp-python's PyPI source package (too slow for CI: about 15
minutes on 2 cores), and llama-cpp-python's own Python bindings from the same package:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/ggml-perf -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF
    cmake --build /tmp/ggml-perf -j2 --target llama llama-bench
    pip install --target /tmp/lmt/pydeps diskcache jinja2   # what the bindings import

Run from the repository root:

    LLAMA_CPP_LIB_PATH=/tmp/ggml-perf/bin PYTHONPATH=.:/tmp/lcp/llama_cpp_python-0.3.36:/tmp/lmt/pydeps \\
        python benchmarks/check_lm_gguf.py [OUTDIR] [--bench /tmp/ggml-perf/bin/llama-bench]

For the example's model (``qarray.examples.lm``: trained and cached on first use), written by
``lm.write_gguf`` in float32 and with its linear layers in Q8_0 and Q4_K:

- llama.cpp loads each file; its logits for a held-out window of 128 bytes against qarray's forward
  pass of the same weights (``_llama.forward``; for the quantized files, on their dequantized
  values), with a float32 KV cache (llama.cpp's default, float16, rounds K and V: 5e-3 off where
  float32 is 1e-4). Float32: the two must agree within float32 error (the check fails otherwise). Q8_0 /
  Q4_K: llama.cpp also quantizes the activations (Q8_0 / Q8_K) where qarray's forward here does not,
  so the difference is reported, not judged;
- llama-bench's prompt processing (pp128) and generation (tg32) on one thread (``--repack 0``: its
  AMX repacking stops with SIGILL here, see ``_no_repack``), and qarray's prompt
  of 128 bytes through the same quantized weights (``qarray.nn.BlockLinear`` on the GGUF's QArrays,
  packed once as llama.cpp's loader packs them, with Q8_K / Q8_0 activations as ggml's, each call
  quantizing its x; the rest of the forward pass in NumPy), layer by layer, and the same layers for
  one token (M = 1, as generation runs them).

Results go to OUTDIR/check_lm_gguf.{json,txt} (default benchmarks/results).
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import cpu, options, write  # noqa: E402
import numpy as np  # noqa: E402
import qarray as qa  # noqa: E402
from qarray import nn as qnn  # noqa: E402
from qarray.examples import _llama, lm  # noqa: E402
from qarray.io import gguf  # noqa: E402

LINES, ROWS = [], []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def _no_repack():
    """llama.cpp's model parameters without its extra buffer types (weight repacking): on this machine
    its AMX repacked kernel stops the process with SIGILL (``tileloadd`` in ``tinygemm_kernel_amx``
    before any tile configuration, seen in gdb), with or without the tile permission asked first."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def llama_logits(path, tokens):
    """llama.cpp's logits for every position of ``tokens`` (one sequence, one thread)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(tokens), logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0)  # a float32 KV cache (its default, float16, rounds K and V)
    llm.eval([int(t) for t in tokens])
    return np.array(llm.scores[:len(tokens)], np.float64)


def packed_layers(params, tensors):
    """``{id of a linear weight in params: (its name, qarray.nn.BlockLinear of the GGUF's QArray)}``."""
    by_id = {}
    for name, w in params.items():
        layer, _, short = name.rpartition(".")
        if short in _llama.LINEARS:
            by_id[id(w)] = (name, qnn.BlockLinear(tensors[lm.GGUF_NAMES[short].format(i=layer)]))
    return by_id


def qarray_prompt(params, cfg, by_id, tokens, act):
    """qarray's forward pass of ``tokens`` with the GGUF's quantized linear weights (``by_id``:
    :func:`packed_layers`), each linear the layer of the activations quantized to ``act``:
    ``(seconds of the whole pass, {weight: seconds})``."""
    times = {}

    def linear(x, w):
        if id(w) not in by_id:
            return x @ w.T
        name, layer = by_id[id(w)]
        t = time.perf_counter()
        y = layer(qa.quantize(np.ascontiguousarray(x.reshape(-1, x.shape[-1]), np.float32), dtype=act))
        times[name] = times.get(name, 0.0) + time.perf_counter() - t
        return np.asarray(y).reshape(*x.shape[:-1], -1)

    t = time.perf_counter()
    _llama.forward(params, cfg, tokens[None], linear)
    return time.perf_counter() - t, times


def qarray_token(by_id, act, calls=51):
    """Each layer of ``by_id`` on one row of x (quantized to ``act`` in the call): ``{weight: median
    seconds}``."""
    rng = np.random.default_rng(0)
    times = {}
    for name, layer in by_id.values():
        x = rng.standard_normal((1, layer.in_features)).astype(np.float32)
        runs = []
        for _ in range(calls):
            t = time.perf_counter()
            layer(qa.quantize(x, dtype=act))
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs)
    return times


def llama_bench(bench, path):
    """llama-bench's pp128 and tg32 on one thread: ``{test: ms a token}`` (its mean t/s, inverted)."""
    out = subprocess.run([str(bench), "-m", str(path), "-p", "128", "-n", "32", "-t", "1", "-r", "5", "-o", "json",
                          "--repack", "0"],  # (_no_repack's SIGILL)
                         capture_output=True, text=True, check=True).stdout
    res = {}
    for r in json.loads(out):
        test = "pp128" if r["n_prompt"] else "tg32"
        res[test] = 1e3 / r["avg_ts"]
    return res


def main():
    a = options(__doc__, quick=False, bench=Path("/tmp/ggml-perf/bin/llama-bench"))
    qa.set_num_threads(1)
    _no_repack()
    info = cpu()
    say(f"check_lm_gguf {datetime.date.today()}: {info['cpu']}, 1 thread; flags {info['cpu_flags']}; "
        f"load {info['load_avg_1m']}")
    params, _ = lm.model()
    cfg = lm.CONFIG
    held = lm.text()[1]
    tokens = held[:cfg["ctx"]].astype(np.int64)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (None, "Q8_0", "Q4_K"):
            path = Path(tmp) / f"lm-{dtype or 'F32'}.gguf"
            lm.write_gguf(path, params, cfg, dtype)
            tensors = gguf.load(path)
            weights = params if dtype is None else lm.quantized(params, dtype)[0]
            want = _llama.forward({k: v.astype(np.float64) for k, v in weights.items()}, cfg, tokens[None])[0]
            got = llama_logits(path, tokens)
            diff = float(np.abs(got - want).max())
            scale = float(np.abs(want).max())
            row = dict(file=dtype or "F32", bytes=path.stat().st_size, max_abs_diff=diff, max_abs_logit=scale)
            judged = dtype is None
            if judged:
                row["agree"] = bool(diff <= 1e-4 * scale * np.sqrt(cfg["dim"]))
                ok &= row["agree"]
            say(f"{row['file']:<5} {row['bytes']:>9} bytes: llama.cpp's logits - qarray's forward (float64): max |diff| "
                f"{diff:.3g} of max |logit| {scale:.3g}" + (f"  agree: {row['agree']}" if judged else
                                                           "  (llama.cpp quantizes the activations too)"))
            if dtype is not None and a.bench.exists():
                bench = llama_bench(a.bench, path)
                act = "Q8_K" if dtype == "Q4_K" else "Q8_0"
                by_id = packed_layers(params, tensors)
                runs = [qarray_prompt(params, cfg, by_id, tokens, act) for _ in range(5)]
                total = statistics.median(r[0] for r in runs)
                layers = {k: statistics.median(r[1][k] for r in runs) for k in runs[0][1]}
                token = qarray_token(by_id, act)
                row.update(llama_bench_ms_a_token=bench, qarray_prompt_ms_a_token=1e3 * total / len(tokens),
                           qarray_linear_ms=1e3 * sum(layers.values()), qarray_layers_ms={k: 1e3 * v for k, v in layers.items()},
                           qarray_token_linear_ms=1e3 * sum(token.values()),
                           qarray_token_layers_ms={k: 1e3 * v for k, v in token.items()})
                say(f"      llama-bench: pp128 {bench['pp128']:.3f} ms a token, tg32 {bench['tg32']:.3f}; qarray's prompt "
                    f"of 128 (BlockLinear on {act} x, the rest NumPy): {1e3 * total / len(tokens):.3f} ms a token, its "
                    f"linear layers {1e3 * sum(layers.values()) / len(tokens):.3f}; its linear layers for one token "
                    f"(M = 1) {1e3 * sum(token.values()):.3f}")
                say(f"        {'layer':<10} {'128 tokens':>10} {'one token':>10} (ms)")
                for k, v in layers.items():
                    say(f"        {k:<10} {1e3 * v:10.3f} {1e3 * token[k]:10.3f}")
            ROWS.append(row)
    write(a.outdir, "check_lm_gguf", LINES, cpu=info, rows=ROWS)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
