"""``qarray bench``: the benchmarks of a source checkout, each in its own
process, and one table of their ratios to the peers timed in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import qarray
from ._shared import CliError, _gpus, _need, _table


BENCHMARKS = {"core": "bench_core.py", "ops": "bench_ops.py", "gpu": "bench_gpu.py"}


def _benchmarks_dir() -> Path:
    return Path(qarray.__file__).resolve().parents[1] / "benchmarks"


def bench(args) -> int:
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise CliError(f"unknown benchmark {unknown[0]!r}; the benchmarks are {', '.join(BENCHMARKS)}", 2)
    if args.output.suffix.lower() != ".json":
        raise CliError(f"the output must be a .json file, got {args.output}", 2)
    root = _benchmarks_dir()
    if not (root / BENCHMARKS["core"]).is_file():
        raise CliError(f"no benchmarks at {root}: 'qarray bench' runs from a source checkout "
                       "(git clone, then pip install -e .), not from an installed wheel")
    _need("rich", "pip install 'qarray[cli]'")
    names = args.names or list(BENCHMARKS)
    if "gpu" in names:
        _, why, arch = _gpus()[0]
        if arch is None and args.names:
            raise CliError(f"the gpu benchmark needs a GPU ({why})")
        if arch is None:
            names.remove("gpu")
    from rich.console import Console

    results = {}
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            script = root / BENCHMARKS[name]
            with Console(stderr=True).status(f"running {script.name}{' --quick' if args.quick else ''}"):
                r = subprocess.run([sys.executable, str(script), out] + ["--quick"] * args.quick,
                                   capture_output=True, text=True)
            if r.returncode:
                last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
                raise CliError(f"{script.name} failed (exit status {r.returncode}): {last}")
            results[script.stem] = json.loads((Path(out) / f"{script.stem}.json").read_text())
    try:
        args.output.write_text(json.dumps({"quick": args.quick, "results": results}, indent=1) + "\n")
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    rows = [row for stem, result in results.items() for row in _ratios(stem, result["rows"])]
    _table("qarray bench" + (" --quick" if args.quick else ""), ["op", "shape", "qarray vs peer", "ratio", "target",
                                                                 "met"], rows,
           caption=f"ratio: time / the peer's time (gpu: bandwidth / a device copy's); all results in {args.output}"
           + ("; --quick: small sizes, not a measurement" if args.quick else ""), left=3)
    return 0


def _ratios(stem: str, rows):
    """The table rows of one benchmark's JSON rows: ``(op, shape, who vs whom,
    ratio, target, met)``, for the rows that have a ratio."""
    met = {True: "yes", False: "no", None: "", "yes": "yes", "no": "no"}
    for r in rows:
        if stem == "bench_gpu":
            who, ratio, target = "qarray vs device copy", r["fraction_of_copy"], r["target"] and f">= {r['target']}"
        elif stem == "bench_ops":
            who, ratio, target = f"{r['who']} vs {r['ref']}", r["ratio"], r["target"] and f"<= {r['target']}"
        else:
            who, ratio, target = f"qarray vs {r['peer']}", r["ratio"], r["target"] and f"<= {r['target']}"
        if ratio is not None:
            yield r["op"], r["shape"], who, f"{ratio:.3f}", target or "", met[r["met"]]
