"""CUDA kernels without a GPU: nvcc compiles each source for sm_75, and for sm_90
(sm_80) where a branch of that source or its headers tells it from sm_75 (from
both), with warnings as errors, and a
host build runs them, launched exactly as CupyBackend launches them, against the
NumPy backend bit for bit."""

import operator
import re
import shutil
import subprocess
import types

import numpy as np
import pytest

import qarray
from qarray import QArray, qdtype
from qarray.backends import _cuda, cupy as cuda_backend
from qarray._params import Quant
from qarray.backends._cuda import CUDA_DIR

from cuda_host.harness import HOST_GRID, SOURCES
from _reference import LAYOUTS, make_rq, numpy_and_host


ARCHS = [75, 80, 90]  # the oldest the kernels support, ..., the newest
_ARCH_TEST = re.compile(r"__CUDA_ARCH__\s*(>=|<=|==|!=|>|<)\s*(\d+)\b")
_ARCH_DEFINED = re.compile(r"#\s*if(?:n?def)?\s+(?:!\s*)?(?:defined\s*\(\s*)?__CUDA_ARCH__\b(?!\s*[<>=!])")
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}


def nvcc_archs(texts=None, newest_where_it_differs=False):
    """The architectures nvcc compiles for: the oldest and the newest of ``ARCHS``,
    and each other that takes a different side of some ``__CUDA_ARCH__`` comparison
    in the sources than both (sm_80 took sm_75's every branch: the same code, built
    for a newer, less restrictive target). With ``newest_where_it_differs`` (one
    source's text), the oldest, and each other only where it takes a different
    side than the oldest. Every arch when a ``__CUDA_ARCH__`` is read some other way."""
    texts = texts if texts is not None else [f.read_text() for f in sorted(CUDA_DIR.glob("*.cu*"))]
    uses = sum(t.count("__CUDA_ARCH__") for t in texts)
    tests = {(op, int(v)) for t in texts for op, v in _ARCH_TEST.findall(t)}
    if uses != sum(len(_ARCH_TEST.findall(t)) + len(_ARCH_DEFINED.findall(t)) for t in texts):
        return [f"sm_{a}" for a in ARCHS]
    kept = {}
    for arch in (ARCHS[0], *ARCHS[1:]) if newest_where_it_differs else (ARCHS[0], ARCHS[-1], *ARCHS[1:-1]):
        kept.setdefault(tuple(_OPS[op](arch * 10, v) for op, v in sorted(tests)), arch)
    return [f"sm_{a}" for a in sorted(kept.values())]


def test_nvcc_archs_take_every_branch():
    assert nvcc_archs(["#ifdef __CUDA_ARCH__\n#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890"]) == ["sm_75", "sm_90"]
    assert nvcc_archs(["#if __CUDA_ARCH__ >= 800\n#endif"]) == ["sm_75", "sm_90"]
    assert nvcc_archs(["#if __CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 900"]) == ["sm_75", "sm_80", "sm_90"]
    assert nvcc_archs(["#ifndef __CUDA_ARCH__", "#if __CUDA_ARCH__ > 750"]) == ["sm_75", "sm_90"]
    assert nvcc_archs(["#if __CUDA_ARCH__ >= QA_ARCH"]) == ["sm_75", "sm_80", "sm_90"]  # read some other way: all
    # one source at a time: the newer archs only where a comparison tells them from sm_75
    assert nvcc_archs(["#ifdef __CUDA_ARCH__\nint k;\n#endif"], newest_where_it_differs=True) == ["sm_75"]
    for text, archs in (("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890", ["sm_75", "sm_90"]),
                        ("#if __CUDA_ARCH__ >= 800", ["sm_75", "sm_80"]),
                        ("#if __CUDA_ARCH__ >= QA_ARCH", ["sm_75", "sm_80", "sm_90"])):
        assert nvcc_archs([text], newest_where_it_differs=True) == archs, text


# Each source on its own (headers inlined, as RawModule gets it): where nothing in
# it compares __CUDA_ARCH__, sm_90 compiled sm_75's code for a less restrictive
# target (the same limits or larger), as sm_80 did (e1ce077); NVRTC compiles every
# source for arch 90 the way CuPy does (test_cuda_nvrtc). formats.cu's >= 890
# branch keeps its sm_90 build
_BUILDS = [(source, arch) for source in SOURCES
           for arch in nvcc_archs([_cuda.kernel_source(source.name)], newest_where_it_differs=True)]


@pytest.mark.parametrize("source,arch", _BUILDS, ids=lambda v: getattr(v, "name", v))
def test_nvcc_compiles(source, arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    r = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-c", "-Werror", "all-warnings",
                        f"-I{CUDA_DIR}", str(source), "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_rawmodule_gets_every_header_inlined(tmp_path, monkeypatch):
    """CuPy's kernel cache is keyed by the code RawModule gets, not by the headers
    it includes: the headers go into that code (recursively, each once), so an
    edited header is a new key."""
    (tmp_path / "inner.cuh").write_text("#pragma once\nint inner;\n")
    (tmp_path / "outer.cuh").write_text('#pragma once\n#include "inner.cuh"\nint outer;\n')
    (tmp_path / "k.cu").write_text('#include "outer.cuh"\n  #include "inner.cuh"  // again\n#include <cuda_fp16.h>\nint k;\n')
    monkeypatch.setattr(_cuda, "CUDA_DIR", tmp_path)
    given = []

    class Module:
        def __init__(self, code, options):
            given.append((code, options))

        def get_function(self, name):
            return lambda grid, block, args, shared_mem=0: None

    def compile_k():
        backend = cuda_backend.CupyBackend()
        backend._xp = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: 0)))
        backend._launch("k.cu", "k", (1,), (32,), ())
        return given[-1]

    assert compile_k() == ("#pragma once\n#pragma once\nint inner;\n\nint outer;\n\n\n#include <cuda_fp16.h>\nint k;\n",
                           _cuda.NVRTC_OPTIONS)
    (tmp_path / "inner.cuh").write_text("#pragma once\nint inner2;\n")
    assert "int inner2;" in compile_k()[0]
    monkeypatch.undo()
    for source in SOURCES:  # the real kernels: common.cuh once, no include of ours left
        code = _cuda.kernel_source(source.name)
        assert '#include "' not in code and code.count("struct Layout {") == 1, source.name


@pytest.mark.parametrize("shape,axis,block_size", LAYOUTS)
@pytest.mark.parametrize("dtype", ["qint2", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"])
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
def test_quantize_dequantize(host, shape, axis, block_size, dtype, in_dtype, rng):
    from qarray._params import param_shape

    d = qdtype(dtype)
    x = (rng.standard_normal(shape) * 60).astype(in_dtype)
    if x.size:
        x.reshape(-1)[0] = np.inf
        x.reshape(-1)[-1] = 0.125  # a tie at scale 0.25
    ps = param_shape(shape, axis, block_size)
    scale = np.where(rng.random(ps) < 0.5, 0.25, rng.uniform(0.05, 0.5, ps)).astype(np.float32)
    zp = rng.integers(d.qmin, min(d.qmax, d.qmin + 100), ps, endpoint=True).astype(np.int32)
    want, got = numpy_and_host(host, lambda b: b.quantize(x, Quant(scale, zp, d, axis, block_size)))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    for ft in (np.float16, np.float32, np.float64):
        w, g = numpy_and_host(host, lambda b: b.dequantize(want, scale, zp, axis, block_size, ft))
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("shape,axis,block_size", LAYOUTS)
@pytest.mark.parametrize("src,dst", [("qint32", "qint8"), ("quint8", "qint4"), ("qint16", "quint16"), ("qint8", "qint32")])
@pytest.mark.parametrize("rounding", [0, 1, 2, 3, None])
def test_requantize(host, shape, axis, block_size, src, dst, rounding, rng):
    from qarray._params import param_shape

    s, d = qdtype(src), qdtype(dst)
    q = rng.integers(s.qmin, s.qmax, shape, endpoint=True).astype(s.storage)
    ps = param_shape(shape, axis, block_size)
    zi = rng.integers(s.qmin, min(s.qmax, s.qmin + 50), ps, endpoint=True).astype(np.int32)
    zo = np.full(ps, (d.qmin + d.qmax) // 2, np.int32)
    # half the slots get multipliers that make exact ties (x.5) common
    M = np.where(rng.random(ps) < 0.5, rng.choice([0.5, 0.25, 1.5, 0.125], ps), rng.uniform(1e-4, 3.0, ps))
    rq = make_rq(zi, zo, M, d, axis, block_size, rounding)
    want, got = numpy_and_host(host, lambda b: b.requantize(q, rq))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_grid_stride_tail_and_launch(host, rng):
    """More elements than one grid covers: the grid-stride loop's tail runs."""
    n = _cuda.BLOCK * HOST_GRID * 64 + 77
    x = rng.standard_normal(n).astype(np.float32)
    s, z = np.float32(0.03), np.int32(5)
    want, got = numpy_and_host(host, lambda b: b.quantize(x, Quant(np.asarray(s), np.asarray(z), qarray.qint8)))
    np.testing.assert_array_equal(got, want)
    assert host.launches[-1] == ("quantize_float32_int8", HOST_GRID, _cuda.BLOCK)


def test_nan_is_the_cpu_error_at_the_next_host_read(host):
    """quantize does not wait for the device to learn of NaN: the kernel sets a
    flag, and the next host read (or check_nan) raises the CPU's error for the
    first noted input that has NaN, once; inputs are noted weakly (a pending
    check keeps no array alive)."""
    x = np.zeros((2, 3), np.float32)
    x[1, 2] = np.nan
    s, z = np.asarray(np.float32(0.1)), np.asarray(np.int32(0))
    host.quantize(np.ones(5, np.float32), Quant(s, z, qarray.qint8))
    host.quantize(x, Quant(s, z, qarray.qint8))  # returns: nothing read yet
    host.quantize(x[:1], Quant(s, z, qarray.qint8))
    with pytest.raises(ValueError, match=r"^cannot quantize NaN: the input has 1 NaN value\(s\), the first at index \(1, 2\);"):
        host.to_host(np.zeros(1))
    host.check_nan()  # reported once; the flag is clear again
    host.quantize(np.ones(3, np.float32), Quant(s, z, qarray.qint8))
    np.testing.assert_array_equal(host.to_host(np.arange(2)), [0, 1])
    for _ in range(host.PENDING + 1):
        host.quantize(np.ones(3, np.float32), Quant(s, z, qarray.qint8))
    host.quantize(x, Quant(s, z, qarray.qint8))
    with pytest.raises(ValueError, match=r"1 NaN value\(s\), the first at index \(1, 2\)"):
        host.check_nan()
    host.quantize(x.copy(), Quant(s, z, qarray.qint8))  # only weakly noted: gone by the check
    with pytest.raises(ValueError, match=r"^cannot quantize NaN: a quantize call on this thread since the last host "
                                         r"read had NaN input, no longer held \(so where is not known\)"):
        host.check_nan()
    host.check_nan()


def test_non_contiguous_input_is_handled(host, rng):
    x = rng.standard_normal((8, 6)).astype(np.float32)[:, ::2]
    qp = Quant(np.asarray(np.float32(0.1)), np.asarray(np.int32(0)), qarray.qint8)
    want, got = numpy_and_host(host, lambda b: b.quantize(x, qp))
    np.testing.assert_array_equal(got, want)


def test_qarray_api_through_the_host_backend(host, rng):
    """The public API with the CUDA backend's primitives (host-run)."""
    x = rng.standard_normal((4, 8)).astype(np.float32)
    q = qarray.quantize(x, 0.02, 3, "qint8")
    data = host.quantize(x, Quant(q.scale, q.zero_point, q.dtype))
    np.testing.assert_array_equal(data, q.int_repr())
    r = QArray._new(data, q.scale, q.zero_point, q.dtype, None, None, host)
    np.testing.assert_array_equal(r.dequantize(), q.dequantize())


def test_float16_in_and_out_without_widening(host, rng):
    """float16 goes straight into quantize and out of dequantize (no extra pass):
    subnormal halves, infinities, -0, and float32 results that round to a half
    subnormal, overflow to inf or sit on a rounding tie, all as NumPy gives them."""
    tiny = np.float16(2.0**-24)  # the smallest subnormal half
    specials = np.array([tiny, -tiny, 3 * tiny, np.float16(6.1e-5), -0.0, np.inf, -np.inf, 65504, 0.5], np.float16)
    x = np.concatenate([specials, (rng.standard_normal(1000) * 30).astype(np.float16)])
    for scale in (2.0**-25, 2.0**-24 * 3, 0.1, 0.25):
        for dtype in ("qint8", "quint4", "qint16", "qint32"):
            qp = Quant(np.float32(scale), np.int32(1), qdtype(dtype))
            want, got = numpy_and_host(host, lambda b: b.quantize(x, qp))
            np.testing.assert_array_equal(got, want)
            assert host.launches[-1][0] == f"quantize_float16_{qdtype(dtype).storage.name}"
    q = np.arange(-32768, 32768, dtype=np.int16)
    seen = []
    for scale in (2.0**-30, 2.0**-24 / 3, 1.0 + 2.0**-11, 3.0):  # subnormal, inexact, ties, overflow
        want, got = numpy_and_host(host, lambda b: b.dequantize(q, np.float32(scale), np.int32(5), None, None, np.float16))
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        assert host.launches[-1][0] == "dequantize_int16_float16"
        seen.append(want)
    seen = np.concatenate(seen)
    assert np.isinf(seen).any() and ((seen.view(np.uint16) & 0x7C00) == 0).sum() > 1000  # overflow, subnormals
