"""The floating formats' CUDA kernels (cuda/formats.cu) without a GPU: the host
build of the software converter, launched exactly as CupyBackend launches it,
against the NumPy backend (ml_dtypes) bit for bit, NaN included. Exhaustive
where it can be: every value of every format, every midpoint between
neighbours and the float32 / float64 numbers just either side of each, every
float16 input, every code for dequantize; then per tensor, axis and block.

(The hardware conversion of sm_89 and later, e4m3fn / e5m2 with saturation,
is compiled by test_cuda_kernels.py and run only by test_gpu.py on a device.)"""

import shutil
import subprocess

import numpy as np
import pytest

import qarray
from qarray import QArray, qdtype
from qarray import _formats as F
from qarray._params import param_shape
from qarray.backends import _cuda

from qarray.backends._cuda import CUDA_DIR
from cuda_host.harness import HOST_GRID
from _reference import LAYOUTS, float32_boundaries, float64_boundaries, numpy_and_host

pytest.importorskip("ml_dtypes")

FORMATS = [f for f in F.FORMATS if f not in ("float8_e8m0fnu", "mxint8")]  # e8m0 is a scale type; mxint8 int8 codes
FLOATS = [np.float16, np.float32, np.float64]


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _case(f, x):
    """``x`` without NaN for the formats that refuse it."""
    return x if F.fmt(f).has_nan else x[~np.isnan(x)]


def _same_quantize(host, x, scale, f, axis=None, block_size=None, saturate=True):
    d = qdtype(f)
    with np.errstate(invalid="ignore", over="ignore"):  # NumPy's signalling NaNs and overflows in the reference
        want, got = numpy_and_host(host, lambda b: b.quantize_float(x, np.asarray(scale), d, axis, block_size, saturate))
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, _bits(want), err_msg=f"{f} saturate={saturate} {x.dtype}")
    assert not x.size or host.launches[-1][0] == f"quantize_format_{x.dtype.name}"
    return got


HARDWARE = ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32")


@pytest.mark.parametrize("arch,hardware", [("sm_80", False), ("sm_89", True), ("sm_100", True)])
def test_nvcc_compiles_the_hardware_path_from_sm_89(arch, hardware, tmp_path):
    """sm_75/80/90 are compiled with every source (test_cuda_kernels.py); here
    the PTX has the hardware fp8 conversion exactly from sm_89 on."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    ptx = tmp_path / "formats.ptx"
    r = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-ptx", "-Werror", "all-warnings", f"-I{CUDA_DIR}",
                        str(CUDA_DIR / "formats.cu"), "-o", str(ptx)], capture_output=True, text=True)
    if r.returncode and "Unsupported gpu architecture" in r.stderr:
        pytest.skip(f"this nvcc has no {arch}")
    assert r.returncode == 0, r.stderr
    assert all((op in ptx.read_text()) == hardware for op in HARDWARE)


def test_nvrtc_compiles_the_hardware_path():
    """As CuPy compiles it for compute_90 (test_cuda_nvrtc.py checks the rest)."""
    pytest.importorskip("cupy")
    try:
        options, ptx = _cuda.compile_ptx("formats.cu", "90")
    except RuntimeError as e:
        pytest.skip(str(e))
    assert all(op in ptx for op in HARDWARE)


def test_format_parameters():
    """The converter's numbers for each format, from ml_dtypes: exponent and
    mantissa bits, bias, kind."""
    got = {f: tuple(int(v) for v in _cuda.format_args(qdtype(f))) for f in FORMATS}
    assert got == {"float8_e4m3fn": (4, 3, 7, 1), "float8_e4m3fnuz": (4, 3, 8, 2), "float8_e5m2": (5, 2, 15, 0),
                   "float8_e5m2fnuz": (5, 2, 16, 2), "float6_e2m3fn": (2, 3, 1, 3), "float6_e3m2fn": (3, 2, 3, 3),
                   "float4_e2m1fn": (2, 1, 1, 3)}


@pytest.mark.parametrize("f", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.25, 0.1, 2.0**-130])
def test_every_float32_boundary(host, f, saturate, scale):
    """Scale 1 and 0.25 put every value, midpoint and neighbour exactly where it
    decides; 0.1 rounds in the division; 2**-130 makes float32 subnormal inputs."""
    x = float32_boundaries(f)
    _same_quantize(host, _case(f, (x * np.float32(scale)).astype(np.float32)), np.float32(scale), f, saturate=saturate)


@pytest.mark.parametrize("f", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_every_float64_boundary_is_rounded_once(host, f, saturate):
    x = _case(f, float64_boundaries(f))
    got = _same_quantize(host, x, np.float32(1.0), f, saturate=saturate)
    with np.errstate(over="ignore"):
        through32 = _bits(F.quantize(x.astype(np.float32), np.float32(1), f, saturate))
    assert (got != through32).sum() > 10  # the hairs that float32 would have rounded onto the midpoints


@pytest.mark.parametrize("f", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-20])
def test_every_float16(host, f, saturate, scale):
    x = _case(f, np.arange(1 << 16, dtype=np.uint16).view(np.float16))
    _same_quantize(host, x, np.float32(scale), f, saturate=saturate)


@pytest.mark.parametrize("f", FORMATS)
@pytest.mark.parametrize("out", FLOATS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-140, 3e38, 1e4])
def test_dequantize_every_code(host, f, out, scale):
    """Every code, times scales that give exact, rounded, float32 subnormal and
    overflowing (float32, float16) results; NaN codes as NumPy gives them."""
    d = qdtype(f)
    codes = np.arange(1 << d.bits, dtype=np.uint8)
    s = np.asarray(np.float32(scale))
    with np.errstate(over="ignore"):
        want, got = numpy_and_host(host, lambda b: b.dequantize_float(codes, s, d, None, None, out))
    assert got.dtype == want.dtype == out
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert host.launches[-1][0] == f"dequantize_format_{np.dtype(out).name}"


def _data(rng, f, shape, dtype):
    """Normal data over the format's range, led by zeros, the largest value, beyond
    it, a tie below the smallest subnormal, infinities and (where the format has
    them) NaNs of both signs."""
    top = F.finfo(f).max
    specials = [0.0, -0.0, top, -top * 1.1, top * 4, F.finfo(f).smallest_subnormal / 2, np.inf, -np.inf]
    specials += [np.nan, -np.nan] if F.fmt(f).has_nan else []
    with np.errstate(over="ignore"):  # float16 holds no 4 * 57344
        x = (rng.standard_normal(shape) * top / 2).astype(dtype)
        flat = x.reshape(-1)
        k = min(flat.size, len(specials))
        flat[:k] = np.array(specials[:k]).astype(dtype)
    return x


ROWS = LAYOUTS + [((4, 3, 32), 1, None), ((5, 64), 1, 16), ((64, 48), 0, None), ((3, 4099), None, None),
                  ((5, 63), 1, 16), ((2, 4, 31), 1, 2)]


@pytest.mark.parametrize("shape,axis,block_size", ROWS)
@pytest.mark.parametrize("f", FORMATS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_per_tensor_axis_and_block(host, rng, shape, axis, block_size, f, dtype):
    """Each slot its own scale; aligned rows go through the vector path, the
    others element by element (and an offset start, misaligned)."""
    n = int(np.prod(shape))
    base = _data(rng, f, (n + 1,), dtype)
    ps = param_shape(shape, axis, block_size)
    scale = rng.choice(np.array([1.0, 0.5, 0.375, 0.1, 3.0], np.float32), ps).astype(np.float32)
    for x in (base[:n].reshape(shape), base[1:].reshape(shape)):
        for saturate in (True, False):
            q = _same_quantize(host, x, scale, f, axis, block_size, saturate)
        for out in FLOATS:
            with np.errstate(over="ignore"):
                want, got = numpy_and_host(host, lambda b: b.dequantize_float(q, scale, qdtype(f), axis, block_size, out))
            np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("f", ["float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_into_a_format_without_nan_is_the_cpu_error(host, f, dtype):
    x = np.ones((3, 4), dtype)
    x[1, 2] = np.nan
    errors = []
    for b, check in ((qarray.backends.get("numpy"), lambda: None), (host, host.check_nan)):
        with pytest.raises(ValueError, match=f"cannot quantize NaN to {f}") as e:
            b.quantize_float(x, np.float32(0.5), qdtype(f), None, None, True)
            check()  # the device's error comes at the next host read (or check_nan), without a wait in quantize
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert any(name == f"quantize_format_{np.dtype(dtype).name}" for name, _, _ in host.launches)


@pytest.mark.parametrize("f", FORMATS)
@pytest.mark.parametrize("shape,axis,block_size", [((6, 40), None, None), ((6, 40), 0, None), ((6, 40), 1, 16)])
def test_qarray_api_through_the_host_backend(host, rng, f, shape, axis, block_size):
    """quantize / dequantize / int_repr of a QArray whose backend runs the host
    build of the kernels, against the NumPy QArray."""
    x = _data(rng, f, shape, np.float32)
    s = rng.uniform(0.2, 2.0, param_shape(shape, axis, block_size)).astype(np.float32)
    for saturate in (True, False):
        q = qarray.quantize(x, s, 0, f, axis=axis, block_size=block_size, saturate=saturate)
        data = host.quantize_float(x, q.scale, q.dtype, q.axis, q.block_size, saturate)
        hq = QArray._new(data, q.scale, q.zero_point, q.dtype, q.axis, q.block_size, host)
        np.testing.assert_array_equal(_bits(hq.int_repr()), _bits(q.int_repr()))
        for ft in ("float16", "float32", "float64"):
            with np.errstate(over="ignore"):
                np.testing.assert_array_equal(_bits(hq.dequantize(ft)), _bits(q.dequantize(ft)))
        assert host.launches[-1][0] == "dequantize_format_float64"


def test_non_contiguous_and_beyond_one_grid(host, rng):
    """A strided view, and more elements than one grid covers with an odd tail."""
    n = _cuda.BLOCK * HOST_GRID * 64 + 77
    x = _data(rng, "float8_e4m3fn", (n,), np.float32)
    _same_quantize(host, x, np.float32(0.3), "float8_e4m3fn")
    _same_quantize(host, x.reshape(-1, 1)[: n - 1].reshape(-1, 2)[:, ::-2], np.float32(0.3), "float8_e5m2")
    q = _bits(F.quantize(x, np.float32(0.3), "float8_e4m3fn"))[::3]
    want, got = numpy_and_host(host, lambda b: b.dequantize_float(q, np.float32(0.3), qdtype("float8_e4m3fn"),
                                                                   None, None, np.float32))
    np.testing.assert_array_equal(_bits(got), _bits(want))
