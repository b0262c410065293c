"""``qarray info``: versions, backends, the CPU GEMM engine, GPUs, CUDA kernels."""

from __future__ import annotations

import importlib

import numpy as np

import qarray
from ..backends import _cuda
from ._shared import _gpus, _need, _one_line, _table


def info(args) -> int:
    _need("rich", "pip install 'qarray[cli]'")
    from rich.console import Console

    rows = [("qarray", qarray.__version__), ("NumPy", np.__version__)]
    status = "probing" + (" (compiling the CUDA kernels takes tens of seconds)" if args.compile else "")
    with Console(stderr=True).status(status):
        rows += [(label, _version(module)) for label, module in
                 (("Numba", "numba"), ("onnxruntime", "onnxruntime"), ("CuPy", "cupy"))]
        rows.append(("backends", _probe(lambda: ", ".join(qarray.backends.available()))))
        rows.append(("CPU int8 GEMM", _probe(qarray.backends.gemm_engine)))
        gpus = _gpus()
        rows += gpus
        rows.append(("CUDA kernels", _probe(lambda: _kernels(gpus[0][2] or "90")) if args.compile else
                     "not compiled here ('qarray info --compile' compiles them with CuPy's NVRTC)"))
    _table("qarray info", ["", "found"], [r[:2] for r in rows], left=2)
    return 0


def _probe(fn) -> str:
    try:
        return fn()
    except Exception as e:
        return f"not available: {_one_line(e)}"


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ModuleNotFoundError as e:
        if e.name == module:
            return "not installed"
        return f"broken: {_one_line(e)}"
    except Exception as e:
        return f"broken: {_one_line(e)}"


def _kernels(arch: str) -> str:
    """Compile every kernel file with CuPy's NVRTC for ``compute_<arch>``."""
    names = sorted(p.name for p in _cuda.CUDA_DIR.glob("*.cu"))
    for name in names:
        _cuda.compile_ptx(name, arch)
    import cupy

    major, minor = cupy.cuda.nvrtc.getVersion()
    return f"compile: {len(names)} files ({', '.join(names)}), NVRTC {major}.{minor}, compute_{arch}"
