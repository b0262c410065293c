"""quantize by the reciprocal (``qarray.backends.cpu.quantize``: ``_q_mul``, ``_q_run``):
every code, straight-through mask and fake_quantize value is the division's,
``clamp(rint(x / s) + z)`` with NumPy's true division, bit for bit, at and
next to every rounding boundary, for scales whose reciprocal is inexact, tiny
and huge scales, NaN, inf and -0.0, each target width and parameter layout,
and the streamed path."""

import numpy as np
import pytest

import qarray
from qarray import qdtype
from qarray._params import expand, param_shape

pytest.importorskip("numba")

# (scales are float32) inexact reciprocals (3, 0.1, 1/3, 7e-3, ...), powers of
# two, tiny and huge scales: subnormal with a normal reciprocal (1e-38), with one
# beyond the range (1e-39, 1e-45), and reciprocals subnormal (1e38, 3e38): there
# float32 input takes the division alone
SCALES = [3.0, 0.1, 1 / 3, 7e-3, 0.0173, 123.456, 1.0, 0.25, 2.0 ** -20, 1024.0, 1e-30, 1e-38, 1e-39,
          1e-45, 3e37, 1e38, 3e38]


def codes(x, scale, zp, dtype, axis=None, block_size=None):
    """The definition, in NumPy: ``rint(x / scale)`` in ``x``'s float type (true
    division), ``+ zp``, clamped; and the mask (inside before the clamp)."""
    d = qdtype(dtype)
    s = expand(np.asarray(scale, np.float32).astype(x.dtype), x.shape, axis, block_size)
    z = expand(np.asarray(zp, np.float64), x.shape, axis, block_size)
    with np.errstate(all="ignore"):
        w = np.rint(x / s).astype(np.float64) + z
    return np.clip(w, d.qmin, d.qmax).astype(np.int64), (w >= d.qmin) & (w <= d.qmax)


def near_boundaries(halves, scale, ft, ulps=2):
    """``fl(h * scale)`` for each half-integer ``h`` and its neighbours up to
    ``ulps`` away: quotients on, just below and just above each tie."""
    with np.errstate(over="ignore"):
        base = (np.asarray(halves, np.float64) * np.float64(np.float32(scale))).astype(ft)
    out, up, down = [base], base, base
    for _ in range(ulps):
        up, down = np.nextafter(up, ft(np.inf)), np.nextafter(down, ft(-np.inf))
        out += [up, down]
    return np.concatenate(out)


def check(x, scale, zp, dtype, axis=None, block_size=None):
    """quantize and fake_quantize (with its mask) are the definition's, bit for bit."""
    want, inside = codes(x, scale, zp, dtype, axis, block_size)
    np.testing.assert_array_equal(qarray.quantize(x, scale, zp, dtype, axis, block_size).int_repr(), want)
    values, mask = qarray.fake_quantize(x, scale, zp, dtype, axis, block_size, return_mask=True)
    s = expand(np.asarray(scale, np.float32).astype(x.dtype), x.shape, axis, block_size)
    z = expand(np.asarray(zp, np.int64), x.shape, axis, block_size)
    with np.errstate(over="ignore", invalid="ignore"):
        np.testing.assert_array_equal(values, (want - z).astype(x.dtype) * s)
    np.testing.assert_array_equal(mask, inside)


@pytest.fixture(params=["avx512bw", "off"])
def lines(request, monkeypatch):
    """Per-tensor float32 to 8-bit codes by AVX-512's blocks of 64
    (``quantize.quantize_lines``; skipped without AVX-512 BW), or with it
    forced off by quantize's kernel (``_q_runs``)."""
    from qarray.backends.cpu import isa

    if request.param != "off" and not isa.usable(request.param)[0]:
        pytest.skip("the CPU has no AVX-512 BW")
    monkeypatch.setattr(isa, "OFF", {"avx512bw"} if request.param == "off" else set())
    return request.param


@pytest.mark.parametrize("ft", [np.float32, np.float64])
@pytest.mark.parametrize("dtype,zp", [("qint8", 0), ("qint8", -7), ("quint8", 128), ("qint4", 3), ("quint4", 0),
                                      ("qint16", 5), ("quint16", 0), ("qint32", 0)])
def test_every_boundary(ft, dtype, zp, lines):
    """Each half-integer boundary of the codes' range, 2 ulp either side, over the scales."""
    d = qdtype(dtype)
    lo, hi = max(d.qmin, -600), min(d.qmax, 600)
    halves = np.arange(lo - zp - 3, hi - zp + 3) + 0.5
    halves = np.concatenate([halves, -halves])
    for scale in SCALES:
        check(near_boundaries(halves, scale, ft), scale, zp, dtype)


@pytest.mark.parametrize("ft", [np.float32, np.float64])
def test_qint32_far_quotients(ft):
    """qint32: quotients from 2**20 to beyond 2**32, where float32's ulp reaches 0.5 and more."""
    halves = np.concatenate([2.0 ** e + np.arange(-8, 8) / 2 for e in range(20, 34)])
    halves = np.concatenate([halves, -halves])
    for scale in (3.0, 0.1, 1 / 3, 7e-3, 1.0, 2.0 ** -10):
        check(near_boundaries(halves, scale, ft), scale, 0, "qint32")
        check(near_boundaries(halves, scale, ft), scale, -1000, "qint32")


@pytest.mark.parametrize("ft", [np.float32, np.float64])
@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint4", "qint16", "qint32"])
def test_special_values(ft, dtype, lines):
    """NaN raises; inf saturates; -0.0, subnormals and overflowing quotients as the division gives them."""
    tiny = np.finfo(ft).smallest_subnormal
    x = np.array([np.inf, -np.inf, -0.0, 0.0, tiny, -tiny, np.finfo(ft).max, -np.finfo(ft).max, 0.5, -0.5, 1.5, 2.5],
                 ft)
    for scale in SCALES:
        check(x, scale, 0, dtype)
        bad = x.copy()
        bad[3] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            qarray.quantize(bad, scale, 0, dtype)


@pytest.mark.parametrize("ft", [np.float32, np.float64])
@pytest.mark.parametrize("axis,block_size", [(0, None), (1, None), (1, 32), (0, 3)])
def test_per_channel_and_blocked(ft, axis, block_size):
    """Each channel or block its own scale from SCALES' finite ones, its values at its boundaries."""
    shape = (12, 2048)
    pshape = param_shape(shape, axis, block_size)
    usable = [s for s in SCALES if s * 200 < float(np.finfo(ft).max)]
    scale = np.resize(np.array(usable, np.float32), pshape)
    zp = np.resize(np.array([0, -3, 5], np.int64), pshape)
    s = expand(scale.astype(ft), shape, axis, block_size)
    halves = np.broadcast_to((np.arange(shape[0] * shape[1]) % 280 - 140 + 0.5).reshape(shape), shape)
    step = np.random.default_rng(1).integers(-2, 3, shape)
    x = (halves * np.broadcast_to(s, shape).astype(np.float64)).astype(ft)
    for _ in range(2):  # up to 2 ulp either side
        x = np.where(step > 0, np.nextafter(x, ft(np.inf)), np.where(step < 0, np.nextafter(x, ft(-np.inf)), x))
        step = step - np.sign(step)
    check(x, scale, zp, "qint8", axis, block_size)
    check(x, scale, np.abs(zp), "quint8", axis, block_size)


@pytest.mark.parametrize("ft,n", [(np.float32, 3 << 20), (np.float64, 1 << 20)])
def test_random_values(ft, n, rng, lines):
    """Random values across the codes' range and beyond, per tensor, several scales."""
    x = (rng.standard_normal(n) * rng.choice([0.3, 3.0, 40.0], n)).astype(ft)
    for scale in (0.1, 1 / 3, 7e-3, 0.0173):
        check(x, scale, 3, "qint8")
    check(x.reshape(-1, 1024), np.linspace(0.01, 0.5, 1024).astype(ft), 0, "qint8", axis=1)


def test_streamed(rng):
    """From ``STREAM`` float32 values, per-tensor 8-bit codes are streamed
    (``quantize_lines``): its runs by the multiply, a short last block too."""
    from qarray.backends import numpy as nb

    k = nb._cpu().quantize
    n = k.STREAM + 64 * 3 + 17
    halves = np.arange(-140, 140) + 0.5
    for scale in (3.0, 0.1, 7e-3):
        x = (rng.standard_normal(n) * 60 * scale).astype(np.float32)
        edge = near_boundaries(halves, scale, np.float32)
        x[:edge.size], x[-edge.size:] = edge, edge[::-1]
        want, _ = codes(x, scale, 3, "qint8")
        np.testing.assert_array_equal(qarray.quantize(x, scale, 3, "qint8").int_repr(), want)
        x[n // 2] = np.inf
        x[-1] = -np.inf
        want, _ = codes(x, scale, 3, "qint8")
        np.testing.assert_array_equal(qarray.quantize(x, scale, 3, "qint8").int_repr(), want)


@pytest.mark.parametrize("isa,nt", [("avx512bw", True), ("avx512bw", False), ("sse2", True)])
@pytest.mark.parametrize("dtype,zp", [("qint8", -128), ("qint8", 127), ("qint8", -5), ("quint8", 0),
                                      ("quint8", 255), ("qint4", 7), ("quint2", 0)])
def test_line_kernels(rng, isa, nt, dtype, zp):
    """``quantize_lines``' kernels called directly (on fewer values than ``STREAM``;
    without ``nt``, into ``out`` one byte past a 64-byte boundary), every
    scale, zero points at both ends: each half-integer boundary of the
    codes' range 2 ulp either side (blocks that flag: the division), quotients
    at the ends of int32 (rounding to 2**31 - 128 and -2**31 + 128, the
    farthest float32 ``vcvtps2dq`` takes, and to +-2**31 and beyond, which it
    gives as -2**31: flagged), inf, -0.0, subnormals, float32's largest, and
    random blocks that do not flag, split into two calls at a block boundary
    and a short last block. NaN comes back as a NaN sum (the caller raises)."""
    from qarray.backends import numpy as nb
    from qarray.backends.cpu import llvm

    if not nb._cpu().isa.usable(isa)[0]:
        pytest.skip(f"the CPU has no {isa}")
    k = nb._cpu().quantize
    kernel = k.quantize_lines[isa, nt]
    d = qdtype(dtype)
    lo, hi = np.float32(d.qmin), np.float32(d.qmax)
    mul = k.multiplies(np.float32, lo, hi)
    assert mul
    halves = np.arange(d.qmin - zp - 3, d.qmax - zp + 3) + 0.5
    halves = np.concatenate([halves, -halves])
    far = np.array([2.0 ** 31 - 128, 2.0 ** 31, 2.0 ** 31 + 256, 3e9, 1e30])
    tiny, big = np.finfo(np.float32).smallest_subnormal, np.finfo(np.float32).max
    for scale in SCALES:
        s = np.float32(scale)
        with np.errstate(over="ignore"):  # (huge scales: inf)
            ends = (np.concatenate([far, -far, far - 1, -far + 1]) * np.float64(s)).astype(np.float32)
            clean = (rng.standard_normal(64 * 40) * 30 * np.float64(s)).astype(np.float32)  # few blocks flag
        parts = [near_boundaries(halves, scale, np.float32), ends,
                 np.array([np.inf, -np.inf, -0.0, 0.0, tiny, -tiny, big, -big], np.float32)]
        x = np.concatenate([clean[:64 * 20], *parts, clean[64 * 20:], clean[:37]])
        n = x.size
        out = llvm.aligned_copy(np.zeros(n + 64, d.storage))[0 if nt else 1:][:n]
        rl, rh = k.reciprocals(np.array([s]))[:, 0]
        blocks = -(-n // 64)
        bad = sum(kernel(x, s, np.float32(zp), rl, rh, lo, hi, mul, out, a, b)
                  for a, b in ((0, 13), (13, blocks)))
        want, _ = codes(x, scale, zp, dtype)
        np.testing.assert_array_equal(out, want)
        assert bad != bad  # inf: a NaN sum, as quantize's kernel gives
        x[70] = np.nan
        assert np.isnan(kernel(x[:128], s, np.float32(zp), rl, rh, lo, hi, mul, out, 0, 2))


def test_reciprocals_bracket_the_reciprocal():
    """``rl <= 1/s <= rh`` exactly, and NaN (the division alone) where ``fl(1/s)`` is not a normal number."""
    from fractions import Fraction

    from qarray.backends.cpu import quantize as k

    for ft in (np.float32, np.float64):
        s = np.array([3, 0.1, 1 / 3, 7e-3, 1, 0.5, 1e-30, np.finfo(ft).tiny / 2, 1e20, 3e37], ft)
        rl, rh = k.reciprocals(s)
        for si, a, b in zip(s, rl, rh):
            assert Fraction(float(a)) <= 1 / Fraction(float(si)) <= Fraction(float(b))
        bad = np.array([0, np.finfo(ft).max, np.inf, np.nan, np.finfo(ft).smallest_subnormal], ft)
        assert np.isnan(k.reciprocals(bad)).all()
