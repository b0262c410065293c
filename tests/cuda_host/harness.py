"""Host execution of the CUDA kernels: a g++ build of ``qarray/backends/cuda/*.cu``
against ``cuda_host.h`` and a ``CupyBackend`` whose ``_launch`` runs it on the CPU.

For every ``.cu`` file a generated C++ file includes the (lightly rewritten)
source and adds, for each ``extern "C"`` kernel found in its preprocessed text,
``launch_NAME(grid, block, shmem, void** args)`` and ``signature_NAME()``; the
kernels' own parameter types unpack ``args``. All files link into one library.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from qarray.backends._cuda import CUDA_DIR
from qarray.backends.cupy import CupyBackend

from . import cublas_host

HOST_HEADER = Path(__file__).parent / "cuda_host.h"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
CXX = ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden", "-U_FORTIFY_SOURCE", "-Wno-attributes"]

_KERNEL = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(')
# extern __shared__ T name[];  ->  the launch's dynamic shared memory buffer
_DYN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w\s:*]+?)\s*(\w+)\s*\[\s*\]\s*;")
# __shared__ T a[32], b;  ->  one qa_host::shared per name: garbage at every block's start
_SHARED = re.compile(r"(?<!extern )__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:]+(?:\s*\*)?)\s+([^;]+);")
_DECLARATOR = re.compile(r"^\s*(\w+)\s*((?:\[[^\]]+\]\s*)*)$")


def _rewrite_shared(match):
    decls = []
    for part in match.group(2).split(","):
        d = _DECLARATOR.match(part)
        if d is None:
            raise ValueError(f"the harness cannot rewrite this __shared__ declaration: {match.group(0)}")
        decls.append(f"auto& {d.group(1)} = qa_host::shared<{match.group(1)}{d.group(2).replace(' ', '')}>([] {{}});")
    return " ".join(decls)


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stderr}")
    return r.stdout


def kernel_names(source: Path, defines=()) -> list:
    """The ``extern "C"`` kernels of a ``.cu`` file, macros expanded."""
    pre = _run(["g++", "-std=c++17", "-E", "-P", *defines, "-include", str(HOST_HEADER), "-x", "c++", str(source)])
    return sorted(set(_KERNEL.findall(pre)))


def _translation_unit(source: Path, work: Path, defines) -> Path:
    """The generated C++ file for one ``.cu`` file (its rewritten copy is in ``work``)."""
    names = kernel_names(work / source.name, defines)
    tu = work / f"{source.stem}_host.cpp"
    tu.write_text(f'#include "{source.name}"\n' + "".join(f"QA_HOST_LAUNCHER({n})\n" for n in names))
    return tu


def build(out: Path, sources=SOURCES, defines=()) -> ctypes.CDLL:
    """Compile ``sources`` for the host into the shared library ``out``."""
    work = out.parent / f"{out.stem}_src"
    work.mkdir(parents=True, exist_ok=True)
    for f in {*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cuh"), *map(Path, sources)}:  # rewritten copies
        text = _DYN_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(qa_host::dynamic_shared.data());", f.read_text())
        text = _SHARED.sub(_rewrite_shared, text)
        (work / f.name).write_text(text)
    tus = [_translation_unit(s, work, defines) for s in sources]

    def compile_one(tu):
        obj = tu.with_suffix(".o")
        _run([*CXX, *defines, "-include", str(HOST_HEADER), "-c", str(tu), "-o", str(obj)])
        return str(obj)

    with ThreadPoolExecutor() as pool:
        objs = list(pool.map(compile_one, tus))
    _run([*CXX, "-shared", *objs, "-o", str(out)])
    return ctypes.CDLL(str(out))


HOST_GRID = 8  # the host's "SMs x occupancy": small, so grid-stride loops run several rounds

_CTYPES = {np.dtype(np.int64): ctypes.c_longlong, np.dtype(np.int32): ctypes.c_int, np.dtype(np.uint32): ctypes.c_uint,
           np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
_CODES = {np.dtype(np.int64): "i8", np.dtype(np.int32): "i4", np.dtype(np.uint32): "u4", np.dtype(np.float32): "f4",
          np.dtype(np.float64): "f8"}


class HostCupyBackend(CupyBackend):
    """CupyBackend with NumPy arrays for device memory and the host build of the
    kernels for the GPU: everything else (plans, names, arguments, grid, shared
    memory) is the backend's own code."""

    def __init__(self, lib):
        super().__init__()
        self._xp = np
        self.lib = lib
        self.launches = []

    def on(self, x):  # NumPy arrays: one "device"
        return contextlib.nullcontext()

    def _device_id(self):
        return 0

    def _max_grid(self, source, name):
        return HOST_GRID

    @staticmethod
    def _ptr(a):
        return a.__array_interface__["data"][0]

    def _blas(self):
        return cublas_host, 0

    def _launch(self, source, name, grid, block, args, shared_mem=0):
        assert (CUDA_DIR / source).exists()
        self.run(name, grid, block, args, shared_mem)

    def run(self, name, grid, block, args, shared_mem=0):
        """Launch kernel ``name`` of the library, checking ``args`` against its parameters."""
        (grid,), (block,) = grid, block
        assert block % 32 == 0 and block <= 1024 and grid >= 1, (name, grid, block)
        self.launches.append((name, grid, block))
        want = getattr(self.lib, f"signature_{name}")
        want.restype = ctypes.c_char_p
        want = want().decode().split(",")[:-1]
        assert len(want) == len(args), f"{name}: takes {len(want)} arguments, got {len(args)}"
        storage = []
        for i, (a, code) in enumerate(zip(args, want)):
            face = a.__array_interface__ if isinstance(a, np.ndarray) else getattr(a, "__cuda_array_interface__", None)
            if face is not None:  # an array: NumPy's, or the fake CuPy's of gpu_dryrun
                assert face["strides"] is None, f"{name}: non-contiguous argument {i}"
                assert code == "p", f"{name}: argument {i} is a {code} scalar, got an array"
                storage.append(ctypes.c_void_p(face["data"][0]))
            else:
                dt = np.asarray(a).dtype
                assert _CODES.get(dt) == code, f"{name}: argument {i} must be {code}, got {dt}"
                storage.append(_CTYPES[dt](a))
        ptrs = (ctypes.c_void_p * max(len(storage), 1))(*[ctypes.addressof(s) for s in storage])
        fn = getattr(self.lib, f"launch_{name}")
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
        with _ONE_LAUNCH:
            fn(grid, block, shared_mem, ptrs)


# One launch at a time: the host build's block, thread and shared-memory state is
# process-wide. So does a GPU for launches from several host threads (Dask's
# threaded scheduler): CuPy puts them all on the one default stream, in order.
_ONE_LAUNCH = threading.Lock()
_BUILT = {}


SHARED_BUILDS = "QA_HOST_BUILDS"  # a folder where the processes of one test session share the build


def session_folder(tmp_path_factory) -> Path:
    """The folder every process of this test session shares: ``QA_HOST_BUILDS``
    where a parent session set it (the GPU dry run's pytest), else the xdist
    workers' common base, or this process's own temporary base."""
    if os.environ.get(SHARED_BUILDS):
        return Path(os.environ[SHARED_BUILDS])
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_build(folder: Path) -> ctypes.CDLL:
    """``build()`` of every kernel, compiled once in ``folder`` for all the
    processes that share it (each xdist worker, the GPU dry run's pytest): the
    first compiles under a file lock, the others wait for it and load its
    library. A build is named by a hash of all it reads, so none is stale."""
    key = hashlib.sha256(" ".join(CXX).encode())
    for f in sorted([*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cuh"), HOST_HEADER, Path(__file__)]):
        key.update(f.name.encode() + b"\0" + f.read_bytes())
    here = folder / f"cuda_host_{key.hexdigest()[:16]}"
    here.mkdir(parents=True, exist_ok=True)
    lib = here / "kernels.so"
    with open(here / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not lib.exists():
            build(here / "build" / "kernels.so")
            os.replace(here / "build" / "kernels.so", lib)  # whole or not at all
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="session")
def host_lib(tmp_path_factory):
    """All kernels, built once per test session (for every module that imports this)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    if "all" not in _BUILT:
        _BUILT["all"] = shared_build(session_folder(tmp_path_factory))
    return _BUILT["all"]


@pytest.fixture
def host(host_lib):
    return HostCupyBackend(host_lib)
