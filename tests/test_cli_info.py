"""``qarray info`` (qarray/cli/info.py), in process through ``main([...])``."""

import importlib
import importlib.util
import sys

import numpy as np
import pytest

import qarray

from _reference import rows, run

pytest.importorskip("rich")
pytestmark = pytest.mark.usefixtures("wide_tables")


def test_info(capsys, monkeypatch):
    from qarray.backends import _cuda

    compiled = []
    monkeypatch.setattr(_cuda, "compile_ptx", lambda name, arch: compiled.append((name, arch)))
    rc, text, err = run(capsys, "info")  # compiles nothing unless asked: it took 27 s with NVRTC installed
    assert (rc, err, compiled) == (0, "", [])
    assert {r[0]: r[1] for r in rows(text)}["CUDA kernels"] == ("not compiled here ('qarray info --compile' "
                                                                 "compiles them with CuPy's NVRTC)")
    rc, text, err = run(capsys, "info", "--compile")
    assert (rc, err) == (0, "")
    table = {r[0]: r[1] for r in rows(text)}
    assert table["qarray"] == qarray.__version__ and table["NumPy"] == np.__version__
    assert table["backends"] == ", ".join(qarray.backends.available())
    assert table["CPU int8 GEMM"] == qarray.backends.gemm_engine()
    for label, module in (("Numba", "numba"), ("onnxruntime", "onnxruntime"), ("CuPy", "cupy")):
        try:
            assert table[label] == importlib.import_module(module).__version__
        except ImportError:
            assert table[label] == "not installed"
    if "cupy" not in qarray.backends.available():
        assert table["GPU"].startswith("none: ")
    names = sorted(p.name for p in _cuda.CUDA_DIR.glob("*.cu"))
    assert compiled == [(n, "90" if "cupy" not in qarray.backends.available() else compiled[0][1]) for n in names]
    if importlib.util.find_spec("cupy"):  # the NVRTC version comes from CuPy
        assert table["CUDA kernels"].startswith(f"compile: {len(names)} files ({', '.join(names)}), NVRTC ")
    else:
        assert table["CUDA kernels"] == "not available: ModuleNotFoundError: No module named 'cupy'"


def test_info_never_crashes(capsys, monkeypatch):
    from qarray.backends import _cuda

    def broken(*args):
        raise RuntimeError("probe failed\nwith a long log")
    monkeypatch.setattr(qarray.backends, "gemm_engine", broken)
    monkeypatch.setattr(qarray.backends, "available", broken)
    monkeypatch.setattr(_cuda, "compile_ptx", broken)
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    rc, text, err = run(capsys, "info", "--compile")
    assert (rc, err) == (0, "")
    table = {r[0]: r[1] for r in rows(text)}
    assert table["CPU int8 GEMM"] == table["backends"] == "not available: RuntimeError: probe failed"
    assert table["Numba"] == table["CuPy"] == "not installed"
    assert table["GPU"] == "none: the cupy backend needs CuPy: pip install 'qarray[cuda12]' or 'qarray[cuda13]'"
    assert table["CUDA kernels"] == "not available: RuntimeError: probe failed"
