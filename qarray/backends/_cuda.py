"""How the CuPy backend's CUDA kernels are named, compiled and launched: the
plumbing under ``cupy.py``'s ``CupyBackend``, which decides what runs.

The kernels live in ``cuda/*.cu``, one ``extern "C"`` name per specialisation,
pasted from a base and the dtypes' names (``quantize_##IN##_##OUT``):
``kernel_name("quantize", x.dtype, qd.storage)`` is ``"quantize_float32_int8"``.
Each file is compiled whole, its headers inlined (``kernel_source``), with
``NVRTC_OPTIONS``; ``compile_ptx`` runs CuPy's own compile path without a device.
``launch_config`` gives the grid of an elementwise kernel, ``plan`` and
``requant_args`` the arguments of the ``Layout`` and requantizing kernels, and
``format_args`` those of a floating format; the constants are the kernels' own
codes (``OUT_KINDS``, ``FORMAT_*``) and cuBLAS's. CuPy is imported
only inside ``compile_ptx``: ``import qarray`` needs NumPy alone.
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path

import numpy as np

from .. import _formats
from .._params import Layout, array_key

CUDA_DIR = Path(__file__).parent / "cuda"
BLOCK = 256
STORAGE = {"int8", "uint8", "int16", "uint16", "int32"}  # the kernels of ops.cu
FLOATS = ("float16", "float32", "float64")
# QA_FMT_* in cuda/formats.cu: inf and NaN (e5m2), NaN only (e4m3fn), one NaN and no -0 (the fnuz formats), neither
FORMAT_IEEE, FORMAT_FN, FORMAT_FNUZ, FORMAT_FINITE = range(4)
# mxint8's element for the converter: sign and magnitude E1M6 with bias 1, whose values are n * 2**-6,
# n = 0..127 (rint(v * 64) saturating); formats.cu turns a negative code into the int8 -n
MXINT8_FORMAT = tuple(np.int32(v) for v in (1, 6, 1, FORMAT_FINITE))
OUT_KINDS = {"int64": 0, "int8": 1, "uint8": 2, "int16": 3, "uint16": 4, "int32": 5}  # common.cuh qa_store
NVRTC_OPTIONS = ("-std=c++17",)  # CuPy adds -ftz=true: see cuda/common.cuh
# cuBLAS's integer GEMM (library_types.h, cublas_api.h): int8 inputs, int32
# output and compute, on the tensor cores; pointers 4-byte aligned, m, k and
# the leading dimensions multiples of 4.
CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I = 3, 10, 72
CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_GEMM_DEFAULT = 0, 1, -1
KPAD = 32  # packed weights' K is a multiple of this: cuBLAS's 4, and gemv's 16 bytes of 4-bit codes
GEMV_ROWS = (1, 4, 16)  # M up to 16 runs gemv (gemm.cu), compiled for these row counts
GEMV_COLS = 4  # columns a warp of gemv computes (gemm.cu)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.M)


@functools.lru_cache(maxsize=None)
def _name(dtype) -> str:
    """``dtype.name``, looked up once per dtype (NumPy works it out at each read;
    kernel names take it on every launch)."""
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=None)
def kernel_name(base: str, *dtypes) -> str:
    """The name of kernel ``base`` specialised for ``dtypes``, as the ``.cu`` files
    paste it (``quantize_##IN##_##OUT``): ``base`` and each dtype's name joined
    by ``_``, e.g. ``kernel_name("requantize_rows", np.int32, np.int8)`` is
    ``"requantize_rows_int32_int8"``; worked out once per base and dtypes."""
    return "_".join((base, *map(_name, dtypes)))


def kernel_source(name: str) -> str:
    """The text of ``cuda/<name>`` with its ``#include "x.cuh"`` headers inlined,
    recursively, each once: CuPy's compile cache is keyed by the code it is
    given, so an edited header must change that code."""
    seen = set()

    def inline(match):
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _INCLUDE.sub(inline, (CUDA_DIR / header).read_text())

    return _INCLUDE.sub(inline, (CUDA_DIR / name).read_text())


class _Compiled(Exception):
    """Raised inside CuPy's compile path once NVRTC has produced the PTX."""


def compile_ptx(name: str, arch: str = "90") -> tuple:
    """``(options, ptx)``: ``cuda/<name>`` compiled the way ``RawModule`` compiles it,
    through CuPy's own path (``cupy.cuda.compiler``, NVRTC, ``NVRTC_OPTIONS`` plus
    whatever CuPy adds, e.g. ``-ftz=true``), for ``compute_<arch>``, stopped where
    CuPy would load the module onto a device: no GPU needed.

    RuntimeError, saying why, when CuPy, its compiler hooks or NVRTC are missing;
    a source NVRTC rejects raises CuPy's ``CompileException``. CuPy's compiler is
    patched while this runs: do not compile kernels in other threads meanwhile.
    """
    try:
        import cupy
        from cupy.cuda import compiler
    except ImportError as e:
        raise RuntimeError(f"CuPy is not installed ({e})") from None
    hooks = ("_compile_module_with_cache", "_compile_using_nvrtc_no_warning", "_get_arch_for_options_for_nvrtc")
    if not all(hasattr(compiler, h) for h in hooks):
        raise RuntimeError(f"CuPy {cupy.__version__} compiles differently from what qarray knows")
    try:
        compiler._get_nvrtc_version()
    except Exception as e:  # CuPy without the NVRTC library: CuPy raises various types
        raise RuntimeError(f"NVRTC is not available: {e}") from None
    real = compiler._compile_using_nvrtc_no_warning

    def spy(source, options, arch, *args, **kwargs):
        out = real(source, options, arch, *args, **kwargs)[0]
        raise _Compiled(options, out.decode() if isinstance(out, bytes) else out)

    saved = {h: getattr(compiler, h) for h in hooks[1:]}
    env = os.environ.get("CUPY_CACHE_IN_MEMORY")
    os.environ["CUPY_CACHE_IN_MEMORY"] = "1"  # not CuPy's on-disk cache: it would skip NVRTC
    # CuPy asks the current device for its architecture: there may be none
    compiler._get_arch_for_options_for_nvrtc = lambda arch=None: (f"-arch=compute_{arch}", "ptx")
    compiler._compile_using_nvrtc_no_warning = spy
    try:
        compiler._compile_module_with_cache(kernel_source(name), NVRTC_OPTIONS, arch=arch)
    except _Compiled as done:
        return done.args
    finally:
        for h, f in saved.items():
            setattr(compiler, h, f)
        if env is None:
            del os.environ["CUPY_CACHE_IN_MEMORY"]
        else:
            os.environ["CUPY_CACHE_IN_MEMORY"] = env
    raise RuntimeError(f"CuPy {cupy.__version__} did not compile {name} through NVRTC")


def launch_config(total: int, max_grid: int):
    """``(grid, block)`` for ``total`` elements: a thread each, at most ``max_grid``
    blocks (grid-stride loops cover the rest)."""
    return (max(1, min(-(-total // BLOCK), max_grid)),), (BLOCK,)


def _rows(a):
    """``(row, stride, span)`` in elements when ``a`` is rows of ``row`` contiguous
    elements ``stride`` apart in C order (a slice along an inner axis of a
    C-contiguous array), spanning ``span`` elements; else None."""
    dims = [(n, st // a.itemsize) for n, st in zip(a.shape, a.strides) if n != 1]
    if any(st % a.itemsize for st in a.strides):
        return None
    row = 1
    while dims and dims[-1][1] == row:
        row *= dims.pop()[0]
    if not dims or dims[-1][1] < row:
        return None
    stride = expect = dims[-1][1]
    for n, st in reversed(dims):
        if st != expect:
            return None
        expect *= n
    return row, stride, (expect // stride - 1) * stride + row


def _period(shape, full):
    """``p`` such that an operand of ``shape`` broadcast to ``full`` has element
    ``[idx % p]`` at flat index ``idx`` (it equals the trailing dims of ``full``
    after leading 1s), else None."""
    s = (1,) * (len(full) - len(shape)) + tuple(shape)
    k = len(full)
    while k and s[k - 1] == full[k - 1]:
        k -= 1
    return math.prod(s) if all(n == 1 for n in s[:k]) else None


def plan(backend, shape, axis, block_size, *params):
    """``(total, layout, compact params)`` for the kernels' ``Layout``: ``layout``
    the arguments every layout kernel takes after its parameters (``bidx``, then
    ``total`` and ``qarray._params.Layout``'s ``ints`` as int64: ``LAYOUT_ARGS``),
    each host parameter as its ``pshape``, flattened, the arrays as
    ``backend.param`` keeps them on the device; the whole plan kept per device,
    shape and parameters: a repeated call copies nothing and works nothing out
    again."""
    params = [np.asarray(p) for p in params]
    key = ("plan", backend._device_id(), tuple(shape), axis, block_size, *map(array_key, params))

    def make():
        lay = Layout(shape, axis, block_size)
        ps = [backend.param(lay.compact(p).reshape(-1)) for p in params]
        return lay.size, (backend.param(lay.bidx()), *(np.int64(v) for v in (lay.size, *lay.ints))), ps

    return backend.kept(key, make)


def format_args(qd) -> tuple:
    """The floating format ``qd`` as cuda/formats.cu's ``FORMAT_ARGS``: exponent and
    mantissa bits, bias and kind, from ml_dtypes' numbers (``qarray._formats``)."""

    f = _formats.fmt(qd)
    i = _formats.ml_dtypes().finfo(_formats.dtype(f))
    kind = FORMAT_IEEE if f.has_inf else FORMAT_FINITE if not f.has_nan else (
        FORMAT_FNUZ if f.name.endswith("fnuz") else FORMAT_FN)
    return np.int32(i.nexp), np.int32(i.nmant), np.int32(1 - i.minexp), np.int32(kind)


def requant_args(backend, shape, rq):
    """``(total, args)``: what every requantizing kernel takes after its data,
    ``REQUANT_PARAMS`` to ``REQUANT_BOUNDS`` (``cuda/common.cuh``); kept per
    plan (``_fixed_point.plan`` returns the same record for the same
    parameters; the entry holds it, so its id stays its own)."""
    def make():
        total, layout, ps = plan(backend, shape, rq.axis, rq.block_size, *rq.params)
        return rq, total, (*ps, *layout, np.int64(rq.lo), np.int64(rq.hi),
                           np.int32(rq.rounding))

    return backend.kept(("requant", backend._device_id(), id(rq), tuple(shape)), make)[1:]
