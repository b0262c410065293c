"""qarray's importance-matrix quantization against ``llama-quantize --imatrix``: the same bytes?

Needs llama.cpp's ``llama-quantize`` and ``llama-imatrix``, built from llama-cpp-python's PyPI
source package in the build directory ``check_lm_gguf.py`` describes (about 2 minutes more on 2
cores once libllama is built):

    cmake --build /tmp/ggml-perf --target llama-quantize llama-imatrix -j2

Run from the repository root:

    python benchmarks/check_lm_imatrix.py [OUTDIR] [--bin /tmp/ggml-perf/bin]

For the lm example's model (``qarray.examples.lm``, trained and cached on first use):

1. its float32 GGUF (``lm.write_gguf``) and an imatrix file (``qarray.io.imatrix.save``) of
   ``observers.ImportanceMatrix`` collectors over the example's calibration inputs (each linear
   layer's inputs on 64 windows of 128 bytes of the training text, ``lm.calibration``: 8192 tokens);
2. ``llama-quantize --imatrix FILE --pure IN OUT TYPE 1`` for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and
   IQ4_XS (``--pure``: every 2-d weight in TYPE, token_embd and output too; no row here needs a
   fallback type: rows of 256 and 512);
3. every tensor of its output, read with ``qarray.io.gguf``, against qarray's: ``qa.quantize(w, TYPE,
   importance=...)`` of the same float32 weight with the collector's ``result()`` (the importance
   qarray computes), and with ``qarray.io.imatrix.load(FILE)`` (what llama-quantize divides out of
   the file's float32 sums); token_embd and output have no imatrix entry (llama-imatrix skips them
   without ``--process-output``) and are quantized without one by both; the norms stay F32;
   and ``qarray quantize IN -o OUT --dtype TYPE --imatrix FILE`` (the CLI) against llama-quantize's
   whole file: every tensor's type and bytes;
4. the other way: ``llama-imatrix`` on the same 64 windows' text writes its own imatrix (GGUF and
   legacy .dat); ``llama-quantize --imatrix`` of each to Q4_K against ``qa.quantize`` with
   ``qarray.io.imatrix.load`` of the same file.

Results go to OUTDIR/check_lm_imatrix.{json,txt} (default benchmarks/results); exit status 1 if any
tensor's bytes differ.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import cpu, options, write  # noqa: E402
import numpy as np  # noqa: E402
import qarray as qa  # noqa: E402
from qarray import cli  # noqa: E402
from qarray.examples import _llama, lm  # noqa: E402
from qarray.io import gguf, imatrix  # noqa: E402
from qarray.observers import ImportanceMatrix  # noqa: E402

TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
LINES, ROWS = [], []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def run(cmd):
    """``cmd``'s output; it must succeed."""
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def compare(out, weights, dtype, importances):
    """Each tensor of llama-quantize's ``out`` against qarray's quantization of ``weights[name]`` with
    each of ``importances`` (``{label: {name: importance}}``; a name missing: no importance):
    ``{label: [(name, type, identical bytes, blocks that differ, blocks)]}``."""
    tensors = gguf.load(out)
    assert sorted(tensors) == sorted(weights), (sorted(tensors), sorted(weights))
    res = {label: [] for label in importances}
    for name, t in tensors.items():
        w = weights[name]
        for label, imp in importances.items():
            if not isinstance(t, qa.QArray):  # left float32 (the norms)
                same = gguf.type_name(t) == "F32" and w.ndim == 1 and np.array_equal(t, w)
                res[label].append((name, gguf.type_name(t), bool(same), int(not same), 1))
                continue
            mine = qa.quantize(w, dtype=dtype, importance=imp.get(name))
            a = np.asarray(t.data).reshape(w.shape[0], -1, mine.dtype.layout.nbytes)
            b = np.asarray(mine.data).reshape(a.shape)
            differ = int((a != b).any(axis=2).sum())
            same = differ == 0 and t.dtype.name == dtype
            res[label].append((name, t.dtype.name, same, differ, a.shape[0] * a.shape[1]))
    return res


def same_file(theirs, model, imx, dtype, tmp):
    """``qarray quantize MODEL -o OUT --dtype DTYPE --imatrix IMX`` (the CLI, in this process) against
    llama-quantize's file ``theirs``: every tensor's type and bytes (the embedding and output head
    too, which both quantize without an importance). True if all are identical."""
    out = tmp / f"qarray-{dtype}.gguf"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["quantize", str(model), "-o", str(out), "--dtype", dtype, "--imatrix", str(imx)])
    a, b = gguf.load(theirs), gguf.load(out)
    same = [k for k in a if k in b and gguf.type_name(a[k]) == gguf.type_name(b[k]) and np.array_equal(
        np.asarray(a[k].data if isinstance(a[k], qa.QArray) else a[k]),
        np.asarray(b[k].data if isinstance(b[k], qa.QArray) else b[k]))]
    ok = rc == 0 and sorted(a) == sorted(b) and len(same) == len(a)
    say(f"  qarray quantize --dtype {dtype} --imatrix (the CLI): {len(same)} of {len(a)} tensors of llama-quantize's "
        f"file identical (type and bytes)")
    ROWS.append(dict(check=f"{dtype} qarray quantize --imatrix against llama-quantize's file", identical=len(same),
                     tensors=len(a)))
    return ok


def report(title, res, judged=None):
    """Say and keep ``res`` (:func:`compare`'s); True if every tensor of the ``judged`` labels (all:
    None) is identical."""
    ok = True
    for label, rows in res.items():
        quantized = [r for r in rows if r[1] != "F32"]
        same = sum(r[2] for r in quantized)
        say(f"  {title}, qarray with {label}: {same} of {len(quantized)} quantized tensors identical"
            f" ({', '.join(sorted({r[1] for r in quantized}))}); F32 tensors unchanged: "
            f"{all(r[2] for r in rows if r[1] == 'F32')}")
        for name, typ, identical, differ, blocks in rows:
            if not identical:
                say(f"    {name:<28} {typ:<6} {differ} of {blocks} blocks differ")
        if judged is None or label in judged:
            ok &= all(r[2] for r in rows)
        ROWS.append(dict(check=title, importance=label, judged=judged is None or label in judged,
                         tensors=[dict(name=r[0], type=r[1], identical=r[2], blocks_differ=r[3], blocks=r[4])
                                  for r in rows]))
    return ok


def differ(imp, tokens):
    """Say how many columns of llama-quantize's importance (``imatrix.load``: the file's float32 sums
    over the counts, divided in float32) differ from the collectors' ``result()``."""
    a, b = imp["imatrix.load(FILE)"], imp["result()"]
    n = sum(int((a[k].view(np.int32) != b[k].view(np.int32)).sum()) for k in a)
    say(f"llama-quantize's importance (imatrix.load: in_sum2 / counts) against the collectors' result(), {tokens} "
        f"tokens: {n} of {sum(v.size for v in a.values())} columns differ, by at most "
        f"{max(int(np.abs(a[k].view(np.int32) - b[k].view(np.int32)).max()) for k in a)} ulp")


def main():
    a = options(__doc__, quick=False, bin=Path("/tmp/ggml-perf/bin"))
    qa.set_num_threads(1)
    quantize, collect = a.bin / "llama-quantize", a.bin / "llama-imatrix"
    version = run([collect, "--version"]).strip().splitlines()  # (llama-quantize has no --version)
    info = cpu()
    say(f"check_lm_imatrix {datetime.date.today()}: {info['cpu']}; llama.cpp {'; '.join(version[-2:])} "
        "(llama-cpp-python 0.3.36's vendored source)")
    params, _ = lm.model()
    cfg = lm.CONFIG
    calib = lm.calibration(params, cfg)  # each linear's inputs, 64 windows of 128 bytes
    weights, collectors, names = {}, {}, {}
    for name, w in params.items():
        layer, _, short = name.rpartition(".")
        gname = lm.GGUF_NAMES[short].format(i=layer)
        weights[gname] = np.ascontiguousarray(w, np.float32)
        if short in _llama.LINEARS:
            collectors[gname] = ImportanceMatrix().update(calib[name])
            names[gname] = name
    tokens = sorted({m.count for m in collectors.values()})
    say(f"model: {len(weights)} tensors; imatrix: {len(collectors)} linear weights, {tokens} tokens each "
        "(lm.calibration: 64 windows of 128 bytes)")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, imx = tmp / "lm-F32.gguf", tmp / "lm.imatrix.gguf"
        lm.write_gguf(model, params, cfg)
        imatrix.save(imx, collectors, datasets=["pydoc_data.topics: lm.calibration's 64 windows"], chunk_size=128)
        from_file = imatrix.load(imx)
        imp = {"result()": {k: m.result() for k, m in collectors.items()}, "imatrix.load(FILE)": from_file}
        differ(imp, tokens)
        for dtype in TYPES:
            out = tmp / f"lm-{dtype}.gguf"
            cmd = [quantize, "--imatrix", imx, "--pure", model, out, dtype, 1]
            log = run(cmd)
            if dtype == TYPES[0]:
                say("$ " + " ".join(str(c) for c in cmd).replace(str(tmp) + "/", ""))
                say("  " + "; ".join(ln.strip() for ln in log.splitlines() if re.search(r"load_imatrix|imatrix entries",
                                                                                       ln)).replace(str(tmp) + "/", ""))
            ok &= report(f"{dtype} (--imatrix qarray's file)", compare(out, weights, dtype, imp))
            ok &= same_file(out, model, imx, dtype, tmp)
        # 63 windows, 8064 tokens (not a power of two): the file's float32 sums over the count can be
        # 1 ulp from result(); llama-quantize's bytes are those of load(FILE)'s importance (judged)
        part = {k: ImportanceMatrix().update(calib[n][:63 * cfg["ctx"]]) for k, n in names.items()}
        imx63 = tmp / "lm.imatrix-63.gguf"
        imatrix.save(imx63, part, datasets=["pydoc_data.topics: 63 of lm.calibration's windows"], chunk_size=128)
        imp = {"result()": {k: m.result() for k, m in part.items()}, "imatrix.load(FILE)": imatrix.load(imx63)}
        differ(imp, sorted({m.count for m in part.values()}))
        say("  (the file holds float32 sums: quantize with imatrix.load(FILE) for llama-quantize's bytes; result() is "
            "shown, not judged)")
        out = tmp / "lm-Q4_K-63.gguf"
        run([quantize, "--imatrix", imx63, "--pure", model, out, "Q4_K", 1])
        ok &= report("Q4_K (--imatrix qarray's file of 63 windows)", compare(out, weights, "Q4_K", imp),
                     judged={"imatrix.load(FILE)"})
        # the other way: llama-imatrix's own file (GGUF and legacy .dat) into qa.quantize
        data, t = lm.text()[0], cfg["ctx"]
        starts = np.linspace(0, len(data) - t - 1, 64).astype(np.int64)  # lm.calibration's windows
        text = tmp / "calibration.txt"
        text.write_bytes(data[starts[:, None] + np.arange(t)].tobytes())
        for fmt in ("gguf", "dat"):
            theirs = tmp / f"llama.imatrix.{fmt}"
            cmd = [collect, "-m", model, "-f", text, "-o", theirs, "--output-format", fmt, "-c", t, "-b", t, "-t", 1,
                   "--no-ppl"]
            run(cmd)
            say("$ " + " ".join(str(c) for c in cmd).replace(str(tmp) + "/", ""))
            ms, meta = imatrix.read(theirs, chunk_size=t)
            say(f"  llama-imatrix's {fmt}: {len(ms)} entries, {sorted({m.count for m in ms.values()})} tokens (its "
                f"tokenizer's, from the same bytes), {meta}".replace(str(tmp) + "/", ""))
            out = tmp / f"lm-Q4_K-llama-{fmt}.gguf"
            run([quantize, "--imatrix", theirs, "--pure", model, out, "Q4_K", 1])
            res = compare(out, weights, "Q4_K", {"imatrix.load(FILE)": imatrix.load(theirs)})
            ok &= report(f"Q4_K (--imatrix llama-imatrix's {fmt})", res)
    say(f"all identical: {ok}")
    write(a.outdir, "check_lm_imatrix", LINES, cpu=info, rows=ROWS)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
