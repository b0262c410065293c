"""The CuPy backend and its stand-in use only what real CuPy has.

The stand-in (``tests/cuda_host/fake_cupy``) and the host harness replace CuPy in
every GPU test that runs without a GPU; once they had a ``RawKernel.ptr`` and took
``max(initial=)``, which CuPy lacks, and 1,000 tests passed while every launch
failed on a real GPU. ``tests/cuda_host/cupy_api.json`` is CuPy's API as read off
CuPy 13.0 and 14.2 (``cupy_api.py``); the stand-in offers only the names and
keywords of both. Here: that record against the CuPy installed (CI has real CuPy,
no GPU), the stand-in against the record, the backend's own CuPy names against
the record, and the backend's device plumbing (compile, occupancy, launch) run on
mocks specced from CuPy's own classes.
"""

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from cuda_host import cupy_api
from qarray.backends import _cuda, cupy as cuda_backend

TESTS = Path(__file__).parent


def _within(params, allowed):
    """Keywords ``params`` are all taken by a callable that takes ``allowed``."""
    return allowed is None or params is None or "**" in allowed or set(params) - {"*", "**"} <= set(allowed)


def test_the_oldest_and_newest_cupy_are_recorded():
    data = json.loads(cupy_api.FILE.read_text())
    majors = sorted({r.split()[1].split(".")[0] for r in data["releases"]})
    assert majors == ["13", "14"], data["releases"].keys()
    assert set(cupy_api.PLUMBING) <= set(data["names"])
    for release, names in data["releases"].items():
        assert set(names) <= set(data["names"]), release
        assert "cupy.RawKernel.ptr" not in names and "cupy.RawKernel.kernel" in names  # what broke every launch


def test_record_matches_the_installed_cupy():
    """The record of this CuPy's release equals what it has; a release not recorded
    (a newer one in CI) has at least every name and keyword the stand-in offers."""
    cupy = pytest.importorskip("cupy")
    if cupy.__version__ == "0+fake":
        pytest.skip("the stand-in is on the path")
    data = json.loads(cupy_api.FILE.read_text())
    here = cupy_api.surface(cupy, data["names"])
    release = f"cupy {cupy.__version__}"
    if release in data["releases"]:
        assert here == data["releases"][release]
    else:
        for name, params in cupy_api.allowed().items():
            assert name in here, f"CuPy {cupy.__version__} has no {name}"
            assert _within(params, here[name]), (name, params, here[name])


def test_names_missing_from_cupy_are_not_offered():
    allowed = cupy_api.allowed()
    for name in ("cupy.RawKernel.ptr", "cupy.ndarray.ctypes", "cupy.ndarray.to_dask_array"):
        assert name not in allowed
    assert "initial" not in allowed["cupy.ndarray.max"] and "initial" not in allowed["cupy.max"]
    assert "copy" not in allowed["cupy.ndarray.__array__"]


def test_the_stand_in_offers_only_what_cupy_has():
    """Every name the stand-in defines itself (and gpu_dryrun.py's RawModule,
    RawKernel, Function and cuBLAS) is in both CuPy releases, with parameters
    they take."""
    code = "import json; from cuda_host import cupy_api; print(json.dumps(cupy_api.stand_in_surface()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS / "cuda_host" / "fake_cupy"), str(TESTS), str(TESTS.parent)])}
    env.pop("QA_FAKE_CUPY_LOG", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    offered, allowed = json.loads(r.stdout), cupy_api.allowed()
    assert {"cupy.RawKernel.kernel", "cupy.cuda.function.Function.ptr", "cupy.cuda.cublas.gemmEx"} <= set(offered)
    extra = sorted(n for n in offered if n not in allowed)
    assert not extra, f"the stand-in has names CuPy 13 or 14 lacks: {extra}"
    wider = sorted(n for n, p in offered.items() if not _within(p, allowed[n]))
    assert not wider, f"the stand-in takes keywords CuPy does not: {[(n, offered[n], allowed[n]) for n in wider]}"


def test_the_strict_stand_in_refuses_what_cupy_lacks():
    code = """
import cupy
x = cupy.ones(3, cupy.float32)
for probe in (lambda: x.max(initial=0), lambda: cupy.max(x, initial=0), lambda: x.ctypes, lambda: cupy.fromfile,
              lambda: x.to_dask_array):
    try:
        probe()
    except (TypeError, AttributeError) as e:
        print(type(e).__name__, e)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS / "cuda_host" / "fake_cupy"), str(TESTS)])}
    env.pop("QA_FAKE_CUPY_LOG", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.splitlines() == [
        "TypeError max() got an unexpected keyword argument 'initial'",
        "TypeError max() got an unexpected keyword argument 'initial'",
        "AttributeError 'cupy.ndarray' object has no attribute 'ctypes'",
        "AttributeError module 'cupy' has no attribute 'fromfile'",
        "AttributeError 'cupy.ndarray' object has no attribute 'to_dask_array'",
    ], r.stdout + r.stderr


ROOTS = {"cupy": "cupy", "xp": "cupy", "self.xp": "cupy", "blas": "cupy.cuda.cublas"}


def _chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


# The modules of the CuPy backend that touch CuPy: the backend and its CUDA plumbing
BACKEND_MODULES = (cuda_backend, _cuda)


def test_the_backend_names_only_recorded_cupy():
    """Every ``cupy.*`` / ``xp.*`` chain in backends/cupy.py and backends/_cuda.py
    (and the cuBLAS calls) is in both releases, called with keywords and arity they
    take. compile_ptx's compiler hooks are private CuPy and checked by it at run
    time (hasattr)."""
    allowed = cupy_api.allowed()
    trees = {Path(m.__file__).name: ast.parse(inspect.getsource(m)) for m in BACKEND_MODULES}
    compile_ptx = [n for t in trees.values() for n in t.body if isinstance(n, ast.FunctionDef) and n.name == "compile_ptx"]
    assert len(compile_ptx) == 1
    skip = {id(n) for n in ast.walk(compile_ptx[0])}
    calls = {id(n.func): n for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.Call)}
    seen = set()
    for node, file in ((n, f) for f, t in trees.items() for n in ast.walk(t)):
        if not isinstance(node, ast.Attribute) or id(node) in skip:
            continue
        chain = _chain(node)
        root = chain and next((r for r in sorted(ROOTS, key=len, reverse=True) if chain.startswith(r + ".")), None)
        if root is None:
            continue
        name = ROOTS[root] + chain[len(root):]
        assert name in allowed, f"backends/{file} uses {name}, not in CuPy 13 and 14 (tests/cuda_host/cupy_api.json)"
        seen.add(name)
        call = calls.get(id(node))
        if call is None or allowed[name] is None:
            continue
        params, kws = allowed[name], [k.arg for k in call.keywords]
        assert _within(kws, params), (name, kws, params)
        if "*" not in params and "**" not in params and not any(isinstance(a, ast.Starred) for a in call.args):
            assert len(call.args) + len(kws) <= len(params), (name, len(call.args), params)
            assert name != "cupy.cuda.cublas.gemmEx" or len(call.args) == len(params)
    assert {"cupy.RawModule", "cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor",
            "cupy.cuda.cublas.gemmEx"} <= seen


def test_device_plumbing_on_cupy_s_own_classes():
    """What the host harness replaces: the module compiled with CuPy's keywords, the
    occupancy calculator given the kernel's function handle, the launch with
    ``shared_mem=``, on mocks specced from CuPy's RawModule, RawKernel, Function,
    runtime and driver (a name CuPy lacks raises AttributeError here)."""
    cupy = pytest.importorskip("cupy")
    kernel = mock.create_autospec(cupy.RawKernel, instance=True)
    kernel.kernel = mock.create_autospec(cupy.cuda.function.Function, instance=True)
    kernel.kernel.ptr = 0x1234
    module = mock.create_autospec(cupy.RawModule, instance=True)
    module.get_function.return_value = kernel
    occupancy = mock.create_autospec(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor, return_value=6)
    props = mock.create_autospec(cupy.cuda.runtime.getDeviceProperties, return_value={"multiProcessorCount": 132})
    current = mock.create_autospec(cupy.cuda.runtime.getDevice, return_value=0)
    backend = cuda_backend.CupyBackend()
    with mock.patch.object(cupy, "RawModule", mock.create_autospec(cupy.RawModule, return_value=module)) as raw, \
            mock.patch.object(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", occupancy), \
            mock.patch.object(cupy.cuda.runtime, "getDeviceProperties", props), \
            mock.patch.object(cupy.cuda.runtime, "getDevice", current):
        backend._xp = cupy
        assert backend._max_grid("ops.cu", "clip_int8") == 132 * 6
        backend._elementwise("clip_int8", 10**6, ("args",), "ops.cu")
    raw.assert_called_once_with(code=_cuda.kernel_source("ops.cu"), options=_cuda.NVRTC_OPTIONS)
    occupancy.assert_called_once_with(0x1234, _cuda.BLOCK, 0)
    props.assert_called_once_with(0)
    kernel.assert_called_once_with((132 * 6,), (_cuda.BLOCK,), ("args",), shared_mem=0)
    allowed = cupy_api.allowed()
    assert set(kernel.call_args.kwargs) <= set(allowed["cupy.RawKernel.__call__"])
    assert set(raw.call_args.kwargs) <= set(allowed["cupy.RawModule"])


def _specced(name):
    """A mock of CuPy's ``name`` that binds its calls to the recorded parameters
    (CuPy 13's and 14's, in order): a call CuPy would refuse raises TypeError."""
    params = cupy_api.allowed()[name]
    sig = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])

    def spec(*args, **kwargs):
        pass

    spec.__signature__ = sig
    return mock.create_autospec(spec)


def test_cublas_plumbing_on_cupy_s_own_signatures():
    """_gemm_raw's cuBLAS call: the handle from CuPy's get_cublas_handle, gemmEx
    bound to its recorded parameters (19, in CuPy's order), device pointers from
    ``__cuda_array_interface__`` on arrays specced from cupy.ndarray, host alpha
    and beta (cuBLAS's default pointer mode), cuBLAS's int8 T x N layout."""
    cupy = pytest.importorskip("cupy")

    def array(shape, ptr):
        a = mock.create_autospec(cupy.ndarray, instance=True)
        a.shape, a.__cuda_array_interface__ = shape, {"data": (ptr, False)}
        return a

    rows, npad, kpad = 17, 12, 96
    a8, w8, c = array((rows, kpad), 0x10000), array((npad, kpad), 0x20000), array((rows, npad), 0x30000)
    gemm = _specced("cupy.cuda.cublas.gemmEx")
    handle = mock.create_autospec(cupy.cuda.device.get_cublas_handle, return_value=0xABC)
    backend = cuda_backend.CupyBackend()
    # cupy.cuda imports cublas on first use, which needs libcublas: put the module in its place
    with mock.patch.dict(vars(cupy.cuda), {"cublas": mock.Mock(spec=["gemmEx"], gemmEx=gemm)}), \
            mock.patch.object(cupy.cuda.device, "get_cublas_handle", handle), \
            mock.patch.object(cupy, "empty", mock.Mock(return_value=c)):
        backend._xp = cupy
        pw = cuda_backend.DeviceWeight(w8, None, 0, None, 8)
        assert backend._gemm_raw(a8, pw) is c
    args = gemm.call_args.args
    assert len(args) == len(cupy_api.allowed()["cupy.cuda.cublas.gemmEx"]) == 19 and not gemm.call_args.kwargs
    assert args[:6] == (0xABC, _cuda.CUBLAS_OP_T, _cuda.CUBLAS_OP_N, npad, rows, kpad)
    assert args[7:10] == (0x20000, _cuda.CUDA_R_8I, kpad) and args[10:13] == (0x10000, _cuda.CUDA_R_8I, kpad)
    assert args[14:] == (0x30000, _cuda.CUDA_R_32I, npad, _cuda.CUBLAS_COMPUTE_32I,
                         _cuda.CUBLAS_GEMM_DEFAULT)
    import ctypes
    assert ctypes.c_int32.from_address(args[6]).value == 1 and ctypes.c_int32.from_address(args[13]).value == 0
