"""The ``qarray`` command's parser and ``main`` (qarray/cli/__init__.py), in
process through ``main([...])``: help, usage errors as one line, missing
optional packages; ``python -m qarray``; ``import qarray`` imports no CLI.
Each command's tests: tests/test_cli_<command>.py."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qarray
from qarray import cli

from _reference import fails, rows, run

pytest.importorskip("rich")
pytestmark = pytest.mark.usefixtures("wide_tables")
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["info", "quantize", "convert", "inspect", "examples", "run", "bench"]


def choices(*names):
    """argparse's list of choices, as a pattern: quoted or bare, as Python versions differ."""
    return ", ".join(f"'?{n}'?" for n in names)


# -- the parser ----------------------------------------------------------------


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS])
def test_help(capsys, command):
    rc, out, err = run(capsys, *command, "--help")
    assert (rc, err) == (0, "")
    assert out.startswith(f"usage: qarray{' ' + command[0] if command else ''}")


def test_version(capsys):
    assert run(capsys, "--version") == (0, f"qarray {qarray.__version__}\n", "")


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "the following arguments are required: COMMAND (see 'qarray --help')"),
        (["frobnicate"], re.compile(r"argument COMMAND: invalid choice: 'frobnicate' \(choose from "
                                    + choices(*COMMANDS) + r"\) \(see 'qarray --help'\)")),
        (["quantize", "m.npz"], "the following arguments are required: -o/--output (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--dtype", "int3"],
         "argument --dtype: unknown quantized dtype 'int3'; use one of qint2, quint2, qint4, quint4, qint8, quint8, "
         "qint16, quint16, qint32 (or int8, uint4, quint4x2, ...), or a floating format: float8_e4m3fn, "
         "float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz, float6_e2m3fn, float6_e3m2fn, float4_e2m1fn, mxint8; "
         "or a block format (GGUF's types, case-insensitive): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_K, Q2_K, Q3_K, "
         "Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, "
         "IQ1_M (and grouped ones such as int4_g128_f16) (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--block-size", "0"],
         "argument --block-size: expected a positive integer, got '0' (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--per-channel", "x"],
         "argument --per-channel: invalid int value: 'x' (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--observer", "median"],
         re.compile(r"argument --observer: invalid choice: 'median' \(choose from " + choices(*cli.OBSERVERS)
                    + r"\) \(see 'qarray quantize --help'\)")),
        (["quantize", "m.npz", "-o", "q.npz", "--block-size", "32", "--observer", "mse"],
         "--block-size takes --observer minmax only, got mse (the other observers give per-tensor or per-channel "
         "parameters)"),
        (["quantize", "m.npz", "-o", "q.npy"], "the output must be a .npz, .safetensors or .gguf file or a .zarr store, got q.npy"),
        (["quantize", "m.npz", "-o", "q.npz", "--plot", "p.svg"], "--plot writes a .png file, got p.svg"),
        (["quantize", "m.txt", "-o", "q.npz"], "m.txt: expected a .npz, .npy, .safetensors or .gguf file or a .zarr store"),
        (["inspect"], "the following arguments are required: FILE (see 'qarray inspect --help')"),
        (["inspect", "m.pt"], "m.pt: expected a .npz, .npy, .safetensors or .gguf file or a .zarr store"),
        (["examples", "extra"], "unrecognized arguments: extra (see 'qarray --help')"),
        (["run"], "run needs the NAME of an example; the examples are " + ", ".join(
            importlib.import_module("qarray.examples").NAMES)),
        (["run", "digits", "--bogus"], "unrecognized arguments: --bogus (see 'qarray --help')"),
        (["run", "digits", "--backend", "torch"], re.compile(
            r"argument --backend: invalid choice: 'torch' \(choose from " + choices("numpy", "cupy")
            + r"\) \(see 'qarray run --help'\)")),
        (["run", "nope", "--quick"], "unknown example 'nope'; the examples are " + ", ".join(
            importlib.import_module("qarray.examples").NAMES)),
        (["bench", "core", "fast"], "unknown benchmark 'fast'; the benchmarks are core, ops, gpu"),
        (["bench", "-o", "b.txt"], "the output must be a .json file, got b.txt"),
    ],
)
def test_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert fails(capsys, 2, message, *argv) == ""
    assert os.listdir(tmp_path) == []


def test_missing_optional_packages(capsys, tmp_path, monkeypatch, weights):
    _, path = weights
    out = tmp_path / "q.npz"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    fails(capsys, 1, "this needs matplotlib: pip install matplotlib", "quantize", path, "-o", out, "--plot",
          tmp_path / "p.png")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    (tmp_path / "m.safetensors").write_bytes(b"")
    fails(capsys, 1, "this needs safetensors: pip install safetensors", "inspect", tmp_path / "m.safetensors")
    monkeypatch.setitem(sys.modules, "rich", None)
    for argv in (["info"], ["quantize", path, "-o", out], ["inspect", path], ["examples"], ["bench", "core"]):
        fails(capsys, 1, "this needs rich: pip install 'qarray[cli]'", *argv)
    assert not out.exists()


# -- python -m qarray, and import qarray ---------------------------------------


def _python(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def test_python_m_qarray():
    """``python -m qarray`` in a process of its own. Its ``info`` compiles no kernel: every kernel
    file's NVRTC build is test_cuda_nvrtc's, and ``info --compile``'s use of compile_ptx for each file
    test_cli_info's (compiling them all again here took two minutes of CI's twenty)."""
    r = _python("-m", "qarray", "--help")
    assert (r.returncode, r.stderr) == (0, "") and r.stdout.startswith("usage: qarray")
    r = _python("-m", "qarray", "info")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    table = {row[0]: row[1] for row in rows(r.stdout)}
    assert table["qarray"] == qarray.__version__
    assert table["CUDA kernels"] == "not compiled here ('qarray info --compile' compiles them with CuPy's NVRTC)"
    r = _python("-m", "qarray", "inspect", "nothing.npz")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", "qarray: error: nothing.npz: no such file\n")


def test_import_qarray_imports_no_cli():
    r = _python("-c", "import sys, qarray; print(sorted(m for m in ('rich', 'qarray.cli', 'matplotlib', "
                "'safetensors', 'qarray.examples') if m in sys.modules))")
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr
