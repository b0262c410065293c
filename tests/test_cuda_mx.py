"""MX and NVFP4 block kernels (cuda/formats.cu quantize_mx_*, quantize_nvfp4)
without a GPU: the host build, launched as CupyBackend launches it, against the
NumPy backend's quantize_mx / quantize_nvfp4 bit for bit, scales and codes: every
MX format and scale rounding, blocks along the last and the first axis (strided),
short last blocks, float32 and float64 input, torchao's vectors (NaN, inf, zero,
subnormal, tie and near-power-of-two blocks), NVFP4 with several global scales.
Outputs start as garbage: the kernels must write every code and scale."""

import numpy as np
import pytest

from qarray import _formats as F
from _reference import NVFP4_INF_CASES, mx_vectors, numpy_and_host

pytest.importorskip("ml_dtypes")

X = mx_vectors()["x"]  # (45, 128) float32
MX = list(F.MX_FORMATS.values())
ROUNDINGS = list(F.SCALE_ROUNDINGS)


class _Garbage:
    """NumPy, but ``empty`` fills with 0xA5: no kernel may rely on zeroed memory."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float):
        a = np.empty(shape, dtype)
        a.reshape(-1).view(np.uint8)[:] = 0xA5
        return a


@pytest.fixture
def dirty(host):
    host._xp = _Garbage()
    return host


def _edge_blocks(rng, mx, dtype):
    """(24, 40) data whose rows of blocks (8 along the last axis, 5 of them, none short:
    see the callers) are zero, subnormal, NaN, inf, ties between element values,
    amax just either side of powers of two and of the element's largest value
    (where floor, ceil, even and rceil part), and plain normal data."""
    top = F.finfo(mx.element).max
    tiny = np.finfo(dtype).smallest_subnormal
    x = (rng.standard_normal((24, 40)) * rng.choice([1e-3, 1, 300], (24, 1))).astype(dtype)
    x[0, :8] = 0
    x[0, 8:16] = -0.0
    x[1, :8] = tiny * np.arange(-4, 4)
    x[1, 8:16] = np.finfo(dtype).smallest_normal * np.array([1, -0.5, 0.75, 1, 0, 2, 3, -1])
    x[2, 3], x[2, 12], x[2, 21] = np.nan, np.inf, -np.inf
    for r, a in enumerate([1.0, 2.0**-100, 2.0**100, top, top * 2**-5, 6.0, 7.5, 1.984375], start=3):
        for k, m in enumerate([1.0, np.nextafter(dtype(1), dtype(2)), np.nextafter(dtype(1), dtype(0)),
                               1 - 2.0**-(mx.mbits + 2), 1 - 2.0**-(mx.mbits + 3)]):
            x[r, 8 * k] = dtype(a) * dtype(m) * (-1) ** k
    grid = np.unique(np.abs(F.values(np.arange(256, dtype=np.uint8).view(F.dtype(mx.element))
                                     if mx.element != "mxint8" else np.arange(128, dtype=np.int8), mx.element)))
    grid = grid[np.isfinite(grid)]
    ties = (grid[:-1] + grid[1:]) / 2
    x[11:13] = rng.choice(np.concatenate([ties, -ties, grid]), (2, 40))
    x[11:13, ::8] = top  # scale 1: the ties stay ties
    x[13, 30:] = np.finfo(dtype).max / 3  # float64: exponents clamped at 127
    return x


def _same_mx(host, x, mx, rounding, axis, block_size):
    axis %= x.ndim  # as the API passes it
    with np.errstate(invalid="ignore", over="ignore"):
        (wc, wb), (gc, gb) = numpy_and_host(host, lambda b: b.quantize_mx(x, mx, axis, block_size, rounding))
    assert gb.dtype == np.uint8 and gb.shape == wb.shape and gc.shape == wc.shape
    assert gc.dtype == (np.int8 if mx.name == "mxint8" else np.uint8)
    np.testing.assert_array_equal(gb, wb, err_msg=f"{mx.name} {rounding} scales")
    np.testing.assert_array_equal(gc.view(np.uint8), wc.view(np.uint8), err_msg=f"{mx.name} {rounding} codes")
    assert host.launches[-1][0] == f"quantize_mx_{x.dtype.name}"
    return wb


@pytest.mark.parametrize("mx", MX, ids=lambda m: m.name)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mx_edge_blocks(dirty, rng, mx, rounding, dtype):
    x = _edge_blocks(rng, mx, dtype)
    if dtype == np.float64:
        x[14, :3] = [1e300, -1e-310, 5e-324]  # beyond float32: clamped exponents, float64 subnormals
    bits = _same_mx(dirty, x, mx, rounding, -1, 8)
    assert (bits == F.E8M0_NAN).sum() == 3 and (bits == 0).any()
    assert (bits == 254).any() or dtype == np.float32  # float64: clamped at 2**127
    _same_mx(dirty, x, mx, rounding, -1, 32)  # a short last block (40 = 32 + 8)
    _same_mx(dirty, x, mx, rounding, 0, 5)  # blocks down the columns: strided, short last block (24 = 4 * 5 + 4)
    _same_mx(dirty, x.reshape(4, 6, 40), mx, rounding, 1, 4)  # a middle axis: outer and inner
    _same_mx(dirty, x[:1, :7], mx, rounding, -1, 32)  # one short block


@pytest.mark.parametrize("mx", MX, ids=lambda m: m.name)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mx_torchao_vectors(dirty, mx, rounding, axis, dtype):
    """torchao's vectors, along rows (blocks of 32) and down the columns (45 = 32 + 13)."""
    _same_mx(dirty, X.astype(dtype), mx, rounding, axis, 32)


def _same_nvfp4(host, x, axis, gs):
    axis %= x.ndim
    gs = None if gs is None else np.asarray(np.float32(gs))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        (wc, wb, wg), (gc, gb, gg) = numpy_and_host(host, lambda b: b.quantize_nvfp4(x, axis, 16, gs))
    assert wg.dtype == gg.dtype == np.float32 and wg == gg
    assert gb.dtype == np.uint8 and gc.dtype == np.uint8 and gb.shape == wb.shape
    np.testing.assert_array_equal(gb, wb.view(np.uint8), err_msg=f"gs={gs} scales")
    np.testing.assert_array_equal(gc, wc.view(np.uint8), err_msg=f"gs={gs} codes")
    assert host.launches[-1][0] == "quantize_nvfp4"
    return gb, gc


@pytest.mark.parametrize("gs", ["default", 1.0, 0.37, 3e-5, 1e30, 2.0**-149])
@pytest.mark.parametrize("axis", [-1, 0])
def test_nvfp4(dirty, rng, gs, axis):
    """Global scales: amax / (448 * 6) as the API computes it, 1, inexact ones,
    one that clamps every block scale at 448 and a tiny one at 2**-6, a subnormal
    one (1 / gs is inf)."""
    m = F.MX_FORMATS["mxfp4"]
    for x in (X, _edge_blocks(rng, m, np.float32), X[:, :37]):
        _same_nvfp4(dirty, x, axis, None if gs == "default" else gs)  # None: the backend's default scale


@pytest.mark.parametrize("case", list(NVFP4_INF_CASES))
def test_nvfp4_inf_blocks(dirty, case):
    """Blocks holding inf (tests/test_mx.py's cases, torchao's clamp to 448): the
    kernel's scales and codes are the NumPy backend's and the written-out ones,
    along the last axis, down the first (strided) and with a short last block."""
    rows, gs, g, want_scale, want = NVFP4_INF_CASES[case]
    x, want_scale, want = np.array(rows, np.float32), np.array(want_scale, np.uint8), np.array(want, np.uint8)
    gs = g if gs is None else gs  # the API's default scale (the backend's, computed on the host, in test_nvfp4)
    bits, codes = _same_nvfp4(dirty, x, -1, gs)
    np.testing.assert_array_equal(bits.reshape(-1), want_scale)
    np.testing.assert_array_equal(codes, want)
    bits, codes = _same_nvfp4(dirty, np.ascontiguousarray(x.T), 0, gs)
    np.testing.assert_array_equal(bits.reshape(-1), want_scale)
    np.testing.assert_array_equal(codes, want.T)
    _same_nvfp4(dirty, x[:, :11], -1, gs)  # a short block, its inf kept (among the first three elements)
    _same_nvfp4(dirty, x, -1, None)  # the backend's default tensor scale
