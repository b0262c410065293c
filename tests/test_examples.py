"""The examples in qarray/examples: each runs in quick mode and its claim holds."""

import importlib
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qarray
from qarray.examples import NAMES

pytest.importorskip("rich")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[1]
HAVE_GPU = "cupy" in qarray.backends.available()


def example(name):
    return importlib.import_module(f"qarray.examples.{name}")


def run_main(name, monkeypatch, capsys, *args):
    """``main(["--quick", *args])`` of an example: its exit status, the result
    its ``run`` returned (None for quickstart, which has none) and its output."""
    module = example(name)
    results = []
    if hasattr(module, "run"):
        real = module.run
        monkeypatch.setattr(module, "run", lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    rc = module.main(["--quick", *args])
    return rc, results[0] if results else None, capsys.readouterr()


def _python(code):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_importing_qarray_or_an_example_imports_nothing_heavy():
    """``import qarray`` leaves qarray.examples alone, and the example modules
    import rich, scikit-learn and the rest only when they run."""
    heavy = ("qarray.examples", "rich", "sklearn", "cupy", "numba", "matplotlib", "safetensors")
    r = _python(f"import sys, qarray; print([m for m in {heavy!r} if m in sys.modules])")
    assert r.stdout.strip() == "[]", r.stderr
    r = _python(f"import sys, qarray.examples as e; [__import__('qarray.examples.' + n) for n in e.NAMES]; "
                f"print([m for m in {heavy[1:]!r} if m in sys.modules])")
    assert r.stdout.strip() == "[]", r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_each_example_has_a_description_and_main(name):
    module = example(name)
    first = module.__doc__.strip().splitlines()[0]
    assert 20 < len(first) < 120 and first.endswith("."), first
    assert list(inspect.signature(module.main).parameters) == ["argv"]


def test_digits_int8_per_channel_within_one_point_of_float(monkeypatch, capsys):
    rc, r, out = run_main("digits", monkeypatch, capsys)
    assert rc == 0
    v = r["variants"]
    assert list(v) == ["float32", "int8_per_tensor", "int8_per_channel", "int4_blocked"]
    assert v["float32"]["accuracy"] > 95
    assert abs(v["int8_per_channel"]["accuracy"] - v["float32"]["accuracy"]) <= 1.0
    assert v["int4_blocked"]["accuracy"] > 95
    # 64*128 + 128*64 + 64*10 = 17024 weights: float32 4 bytes each; int8 one byte
    # plus a float32 scale per tensor (3) or per output channel (202); int4 half a
    # byte plus a scale per block of 16 (1064 blocks)
    assert [v[k]["bytes"] for k in v] == [68096, 17024 + 12, 17024 + 4 * 202, 8512 + 4 * 1064]
    assert "weight-only" in v["int4_blocked"]["label"]
    row = next(line for line in out.out.splitlines() if "int8 per channel" in line)
    assert f"{v['int8_per_channel']['accuracy']:.2f}" in row and "17,832" in row


def test_train_int8_within_two_points_of_float(monkeypatch, capsys):
    """The MLP trained from scratch with integer matmuls forward and backward
    (stochastically rounded gradients) within 2 points (9 of 450 test images) of
    the one trained in float32 from the same start; both reported with their time."""
    rc, r, out = run_main("train", monkeypatch, capsys)
    assert rc == 0
    v = r["variants"]
    assert list(v) == ["float32", "int8"]
    assert v["float32"]["accuracy"] > 95
    assert abs(v["int8"]["accuracy"] - v["float32"]["accuracy"]) <= 2.0
    assert all(x["s_per_epoch"] > 0 for x in v.values())
    row = next(line for line in out.out.splitlines() if "stochastic rounding" in line)
    assert f"{v['int8']['accuracy']:.2f}" in row


def test_train_int8_gradients_follow_the_float_ones():
    """One step's int8 gradients: the same for the same step (the seeds come from
    it), other roundings for another step, and each within a few percent of the
    float32 gradient (relative Frobenius error)."""
    pytest.importorskip("sklearn")
    from qarray.examples import digits, train

    x_train, _, y_train, _ = train._common.load_digits()
    params, xb, yb = digits.init(), x_train[:64], y_train[:64]
    g1, g2, g3 = (train._int8_grads(params, xb, yb, step) for step in (5, 5, 6))
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(g1[0], g3[0])
    for a, f in zip(g1, digits._grads(params, xb, yb)):
        assert np.linalg.norm(a - f) <= 0.1 * np.linalg.norm(f)


def test_lstm_quantized_within_two_points_of_float(monkeypatch, capsys):
    """Quantized (8-bit gates, qint32 cell) within 2 points (9 of 450 test
    images) of float: over 9 trainings (3 splits x 3 seeds) in quick mode the
    drop was at most 0.44 points, so 2 leaves room for other machines' BLAS."""
    rc, r, out = run_main("lstm", monkeypatch, capsys)
    assert rc == 0
    assert r["float_accuracy"] > 90
    assert r["float_accuracy"] - r["quantized_accuracy"] <= 2.0
    row = next(line for line in out.out.splitlines() if "quantized" in line)
    assert f"{r['quantized_accuracy']:.2f}" in row


def test_concat_integer_way_agrees_with_the_float_way(monkeypatch, capsys):
    rc, r, out = run_main("concat", monkeypatch, capsys)
    assert rc == 0
    assert r["shape"] == (256, 3, 8, 8) and r["size"] == 256 * 3 * 64
    assert r["max_code_diff"] <= 1
    assert [d for _, d, _ in r["integer_steps"]] == ["uint8", "int8", "uint8", "uint8"]
    assert [str(d) for _, d, _ in r["float_steps"]] == ["float32"] * 4 + ["uint8"]
    assert len({(s, z) for _, s, z in r["inputs"]}) == 3  # three different sets of parameters
    assert "max code difference" in out.out


def test_cuda_checks_the_gpu_or_says_there_is_none(monkeypatch, capsys):
    rc, r, out = run_main("cuda", monkeypatch, capsys)
    assert rc == 0
    if HAVE_GPU:
        assert len(r["checks"]) == 8 and all(c["equal"] for c in r["checks"]), r["checks"]
    else:
        assert r["checks"] == [] and r["device"] is None
        assert out.out.startswith("cuda: no GPU here, nothing to check (") and out.out.count("\n") == 1


def test_quickstart(monkeypatch, capsys):
    rc, _, out = run_main("quickstart", monkeypatch, capsys)
    assert rc == 0
    lines = out.out.splitlines()
    error = next(line for line in lines if line.startswith("max error:"))
    assert 0 < float(error.split()[2]) <= 0.01  # scale / 2
    assert "half_away: [124 125 126 130 131 132]" in lines
    assert lines[-1].endswith("same codes: True")


def test_quickstart_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "qarray.examples.quickstart"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "same codes: True" in r.stdout


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is here: --backend cupy runs")
@pytest.mark.parametrize("name", [n for n in NAMES if n != "cuda"])
def test_backend_cupy_without_a_gpu_is_one_line_and_exit_1(name, capsys):
    assert example(name).main(["--quick", "--backend", "cupy"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"qarray.examples.{name}: --backend cupy: the cupy backend ")
    assert out.err.count("\n") == 1


@pytest.mark.parametrize("name", ["digits", "cuda"])
def test_a_missing_package_is_one_line_naming_the_extra(name, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "rich" else real(m, *a))
    assert example(name).main(["--quick"]) == 1
    err = capsys.readouterr().err
    assert err == f"qarray.examples.{name} needs rich: pip install 'qarray[examples]'\n"


def test_an_unknown_backend_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        example("concat").main(["--backend", "tpu"])
    assert e.value.code == 2
    assert "argument --backend: invalid choice: 'tpu' (choose from" in capsys.readouterr().err
