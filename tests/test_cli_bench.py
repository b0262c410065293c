"""``qarray bench`` (qarray/cli/bench.py), in process through ``main([...])``."""

import json
from pathlib import Path

import pytest

from qarray.cli import bench

from _reference import fails, rows, run

pytest.importorskip("rich")
pytestmark = pytest.mark.usefixtures("wide_tables")
ROOT = Path(__file__).resolve().parents[1]


def test_bench_without_benchmarks(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_benchmarks_dir", lambda: tmp_path / "benchmarks")
    fails(capsys, 1, f"no benchmarks at {tmp_path / 'benchmarks'}: 'qarray bench' runs from a source checkout "
          "(git clone, then pip install -e .), not from an installed wheel", "bench", "--quick")


FAKE = """
import json, sys
from pathlib import Path
out, quick = Path(sys.argv[1]), sys.argv[2:] == ["--quick"]
if {fail}:
    print("partial output")
    print("Traceback ...\\nValueError: boom", file=sys.stderr)
    sys.exit(3)
(out / "bench_core.json").write_text(json.dumps(dict(machine=dict(quick=quick), rows=[
    dict(op="quantize per-tensor", shape="1048576", peer="torch", ratio=0.5, target=0.7, met="yes"),
    dict(op="cold: import qarray", shape="", peer=None, ratio=None, target=None, met=None),
    dict(op="quantize axis=0", shape="1024x1024", peer="torch quantize_per_channel", ratio=2.25, target=None, met=None),
])))
"""


def test_bench_table_and_json(capsys, tmp_path, monkeypatch):
    """A stand-in bench_core.py: the arguments it gets, the table and the combined JSON."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_core.py").write_text(FAKE.format(fail=False))
    monkeypatch.setattr(bench, "_benchmarks_dir", lambda: tmp_path / "benchmarks")
    monkeypatch.chdir(tmp_path)
    rc, text, err = run(capsys, "bench", "--quick", "core")
    assert (rc, err) == (0, "")
    assert rows(text) == [["quantize per-tensor", "1048576", "qarray vs torch", "0.500", "<= 0.7", "yes"],
                          ["quantize axis=0", "1024x1024", "qarray vs torch quantize_per_channel", "2.250", "", ""]]
    combined = json.loads((tmp_path / "qarray-bench.json").read_text())
    assert combined["quick"] is True and combined["results"]["bench_core"]["machine"] == {"quick": True}
    (tmp_path / "benchmarks" / "bench_core.py").write_text(FAKE.format(fail=True))
    fails(capsys, 1, "bench_core.py failed (exit status 3): ValueError: boom", "bench", "core", "-o", "other.json")
    assert not (tmp_path / "other.json").exists()


def test_bench_rows_of_each_benchmark():
    ops = [dict(op="linear", shape="8x8x8", who="qarray nn.Linear", ref="numpy float32 matmul", ratio=0.25,
                target=0.35, met=True)]
    gpu = [dict(op="quantize float32 -> qint8", shape="16777216", fraction_of_copy=0.912, target=0.8, met=True),
           dict(op="add", shape="8388608", fraction_of_copy=0.5, target=None, met=None)]
    assert list(bench._ratios("bench_ops", ops)) == [
        ("linear", "8x8x8", "qarray nn.Linear vs numpy float32 matmul", "0.250", "<= 0.35", "yes")]
    assert list(bench._ratios("bench_gpu", gpu)) == [
        ("quantize float32 -> qint8", "16777216", "qarray vs device copy", "0.912", ">= 0.8", "yes"),
        ("add", "8388608", "qarray vs device copy", "0.500", "", "")]


def test_bench_quick_core_real_run(capsys, tmp_path):
    """SLOW (5-25 s, the benchmark's own subprocesses): a real `qarray bench --quick core`."""
    out = tmp_path / "bench.json"
    committed = {p.name: p.read_bytes() for p in (ROOT / "benchmarks" / "results").iterdir()}
    rc, text, err = run(capsys, "bench", "--quick", "core", "-o", out)
    assert (rc, err) == (0, "")
    result = json.loads(out.read_text())["results"]["bench_core"]
    assert result["machine"]["quick"] is True and result["machine"]["elements"] == 1 << 20
    got = rows(text)
    assert got[0][:3] == ["quantize per-tensor", str(1 << 20), "qarray vs " + result["rows"][0]["peer"]]
    assert len(got) == sum(r["ratio"] is not None for r in result["rows"])
    assert {p.name: p.read_bytes() for p in (ROOT / "benchmarks" / "results").iterdir()} == committed
