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


# -- block formats (cuda/blocks.cu): a format's description as the decoder reads it ------------------

BLOCK_GEMV_COLS, BLOCK_GEMV_ROWS = 32, 16  # block_gemv(_q8)'s outputs n and rows m a block (GV_N, GV_M)
BLOCK_GEMM_TILE = 64  # block_gemm's outputs a block: BLOCK_GEMM_TILE x BLOCK_GEMM_TILE (GM_T)
BLOCK_PLAN_HEADER = 37  # ints before the runs: cuda/blocks.cu QaPlan reads them in this order
PLAN_GROUP, PLAN_INTEGERS = 7, 36  # where the header holds the elements a thread decodes, the integer values
_PRECISIONS = {"float32": 0, "float16": 1, "bfloat16": 2}


def _field_kind(f):
    """How a field's bits read in cuda/blocks.cu: 0 unsigned, 1 float16, 2 bfloat16, 3 float32; None else."""
    if f.bf16:
        return 2
    if f.view.kind == "u":
        return 0
    return {np.dtype(np.float16): 1, np.dtype(np.float32): 3}.get(f.view)


def _runs(f):
    """Field ``f``'s bits, value by value: ``(R, runs)``, ``runs[i * R + r]`` the ``r``-th run of value ``i``
    from its segments (``Field.segments``), packed ``byte << 12 | value shift << 7 | width << 3 | shift``;
    a value with fewer runs ends in zeros (width 0)."""
    per = [[] for _ in range(f.count)]
    for v0, n, b0, st, sh, m, vs in f.segments.tolist():
        for i in range(n):
            per[v0 + i].append((b0 + i * st) << 12 | vs << 7 | int(m).bit_length() << 3 | sh)
    r = max(map(len, per))
    return r, [c for p in per for c in p + [0] * (r - len(p))]


@functools.lru_cache(maxsize=None)
def block_plan(fmt):
    """Block format ``fmt`` as cuda/blocks.cu's decoder reads it: ``(ints, floats)``, int32 and float32
    host arrays, or None for a format it does not read (the IQ lattices and TQ1_0, whose values come from
    functions: NumPy decodes them). ``ints``: ``BLOCK_PLAN_HEADER`` ints (block, bytes a block, elements a
    sub-block, precision, tensor scale 0 / 1 divide / 2 multiply, offset sign 0 / 1 / -1, a factor or not,
    elements a thread decodes at once; then for each of the codes, the scale's float field and table field,
    the offset's and the zero point ``(runs at, runs a value, values a block, kind)``, absent: zeros; then
    the floats' offsets of the value table, the scale's and the offset's tables and the factor, and where
    the integer values start in ``ints`` (-1: the values are not all integers)), then the runs
    (:func:`_runs`) and the integer values; ``floats``: the tables."""
    if fmt.plan is None or callable(fmt.scale) or fmt.elements is not None:
        return None
    nsub = fmt.block // fmt.sub
    ints, floats = [0] * BLOCK_PLAN_HEADER, []

    def table(t):
        floats.extend(np.asarray(t, np.float32).tolist())
        return len(floats) - len(t)

    def field(slot, name, counts):
        if name is None:
            return True
        f = fmt.fields[name]
        kind, (r, runs) = _field_kind(f), _runs(f)
        if kind is None or f.count not in counts:
            return False
        ints[8 + 4 * slot:12 + 4 * slot] = [len(ints), r, f.count, kind]
        ints.extend(runs)
        return True

    def product(slot, spec, at):
        base, sub = spec
        if sub is not None and len(sub[1]) < 1 << fmt.fields[sub[0]].bits:
            return False
        if sub is not None:
            ints[at] = table(sub[1])
        return field(slot, base, (1, nsub)) and field(slot + 1, sub and sub[0], (1, nsub))

    values = fmt.values
    offset = fmt.offset or ((None, None), 0)
    ints[:8] = [fmt.block, fmt.nbytes, fmt.sub, _PRECISIONS[fmt.precision],
                {None: 0, "divide": 1, "multiply": 2}[fmt.tensor_scale], offset[1], fmt.factor is not None,
                min(8, fmt.sub & -fmt.sub)]  # (PLAN_GROUP)
    ints[32], ints[35] = table(values), table([0 if fmt.factor is None else fmt.factor])
    if len(values) < 1 << fmt.fields["q"].bits or not (
            field(0, "q", (fmt.block,)) and product(1, fmt.scale, 33)
            and (fmt.offset is None or product(3, fmt.offset[0], 34)) and field(5, fmt.zero, (1, nsub))):
        return None
    integer = np.all(np.isfinite(values)) and np.all(values == np.rint(values)) and np.abs(values).max() < 2**30
    ints[PLAN_INTEGERS] = len(ints) if integer else -1
    if integer:
        ints.extend(values.astype(np.int64).tolist())
    return np.array(ints, np.int32), np.array(floats, np.float32)
