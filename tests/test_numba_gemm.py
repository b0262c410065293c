"""The packed 4-bit and conv kernels of qarray/backends/cpu/gemm.py, exact against int64 NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
from numpy.lib.stride_tricks import sliding_window_view  # noqa: E402

from qarray._fixed_point import IDENTITY  # noqa: E402
from qarray.backends.cpu.gemm import gemm_packed4, im2col, pack4  # noqa: E402
from qarray.backends.cpu.gemm import conv_grouped as _conv_grouped  # noqa: E402
from qarray.backends.cpu.pool import parallel  # noqa: E402


def conv_grouped(x, za, wc, groups, sh, sw, dh, dw, out, ph=0, pw=0):
    """The sums alone: the IDENTITY epilogue, no bias (the ops test the rest);
    tasks (n, o) split among threads as the backend runs it; ``x`` padded by
    the kernel, with ``za``."""
    z = np.zeros(wc.shape[0], np.int64)
    parallel(_conv_grouped[IDENTITY, False], out.shape[0] * out.shape[1], x, za, wc, groups, sh, sw, dh, dw, ph, pw,
             z, z, z, z, z.astype(np.float64), np.int64(-(2**63)), np.int64(2**63 - 1), out)


# ---------------------------------------------------------------- pack4 / gemm_packed4

def _pack4_slow(w):
    n, k = w.shape
    out = np.zeros((n, (k + 1) // 2), np.uint8)
    for r in range(n):
        for c in range(k):
            nib = int(w[r, c]) & 15
            out[r, c // 2] |= nib << (4 * (c % 2))
    return out


def _unpack4_slow(wp, k, signed):
    n = wp.shape[0]
    w = np.zeros((n, k), np.int64)
    for r in range(n):
        for c in range(k):
            nib = (int(wp[r, c // 2]) >> (4 * (c % 2))) & 15
            w[r, c] = nib - 16 if signed and nib >= 8 else nib
    return w


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("k", [1, 2, 7, 10])
def test_pack4_round_trip(signed, k):
    rng = np.random.default_rng(k)
    lo, hi = (-8, 8) if signed else (0, 16)
    w = rng.integers(lo, hi, (5, k)).astype(np.int8 if signed else np.uint8)
    wp = pack4(w)
    assert wp.dtype == np.uint8 and wp.flags.c_contiguous and wp.shape == (5, (k + 1) // 2)
    assert (wp == _pack4_slow(w)).all()
    assert (_unpack4_slow(wp, k, signed) == w).all()


def test_pack4_refuses_out_of_range():
    with pytest.raises(ValueError):
        pack4(np.array([[16]]))
    with pytest.raises(ValueError):
        pack4(np.array([[-9]]))


def _gemm(a, w, signed):
    """``gemm_packed4`` as its caller (``_gemm.Packed.raw``) drives it: K padded
    to a multiple of 128, activations split into even and odd k."""
    from qarray.backends import _gemm as engine

    if engine.packed4_kernel() is None:
        pytest.skip("no AVX-512 VNNI here: " + engine._state["packed4"][1])
    m, k = a.shape
    kp = max(128, -(-k // 128) * 128)
    ap = np.zeros((m, kp), np.uint8)
    ap[:, :k] = a
    out = np.full((m, w.shape[0]), 12345, np.int32)
    parallel(gemm_packed4, w.shape[0], np.ascontiguousarray(ap[:, 0::2]), np.ascontiguousarray(ap[:, 1::2]),
             pack4(np.pad(w, ((0, 0), (0, kp - k)))), signed, out)
    return out


def _gemm_ref(a, w):
    return a.astype(np.int64) @ w.astype(np.int64).T


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("m", [1, 3, 4, 16, 17])
@pytest.mark.parametrize("k", [1, 2, 9, 128, 131])
def test_gemm_packed4_random(signed, m, k):
    rng = np.random.default_rng(1000 * m + k)
    n = 13
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    lo, hi = (-8, 8) if signed else (0, 16)
    w = rng.integers(lo, hi, (n, k))
    assert (_gemm(a, w, signed) == _gemm_ref(a, w)).all()


@pytest.mark.parametrize("m", [1, 3, 16, 17])
def test_gemm_packed4_extremes(m):
    k, n = 4099, 7  # K not a multiple of 128: the padded tail
    a = np.full((m, k), 255, np.uint8)
    for wv, signed in [(-8, True), (7, True), (15, False), (0, False)]:
        w = np.full((n, k), wv)
        assert (_gemm(a, w, signed) == _gemm_ref(a, w)).all(), (wv, signed)
    rng = np.random.default_rng(m)
    a = rng.choice(np.array([0, 255], np.uint8), (m, k))
    w = rng.choice(np.array([-8, 7]), (n, k))
    assert (_gemm(a, w, True) == _gemm_ref(a, w)).all()


def test_gemm_packed4_largest_exact_k():
    """K * 255 * 15 just below 2**31: the int32 lanes hold the exact sum."""
    k = (2**31 - 1) // (255 * 15) // 128 * 128
    a = np.full((1, k), 255, np.uint8)
    w = np.full((2, k), 15)
    w[1] = 0
    got = _gemm(a, w, False)
    assert got[0, 0] == 255 * 15 * k > 2**30 and got[0, 1] == 0


# ---------------------------------------------------------------- conv_grouped

def _conv_ref(xpad, za, wc, groups, sh, sw, dh, dw):
    n, c, hp, wp = xpad.shape
    o, cg, kh, kw = wc.shape
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    win = sliding_window_view(xpad.astype(np.int64) - za, (eh, ew), axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    og = o // groups
    out = []
    for g in range(groups):
        xg = win[:, g * cg:(g + 1) * cg]  # N cg OH OW kh kw
        wg = wc[g * og:(g + 1) * og].astype(np.int64)  # og cg kh kw
        out.append(np.einsum("ncijpq,ocpq->noij", xg, wg))
    return np.concatenate(out, axis=1)


def _conv(x, za, wc, groups, sh=1, sw=1, dh=1, dw=1, ph=0, pw=0):
    """The kernel on ``x`` padded by ``ph, pw`` against the reference on
    ``x`` padded by NumPy."""
    xpad = _pad(x, za, ph, pw)
    n, c, hp, wp = xpad.shape
    o, cg, kh, kw = wc.shape
    oh = (hp - dh * (kh - 1) - 1) // sh + 1
    ow = (wp - dw * (kw - 1) - 1) // sw + 1
    out = np.full((n, o, oh, ow), -777, np.int32)
    conv_grouped(x, za, wc, groups, sh, sw, dh, dw, out, ph, pw)
    ref = _conv_ref(xpad, za, wc, groups, sh, sw, dh, dw)
    assert (out == ref).all()
    return out


def _pad(x, za, ph, pw):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=za)


CASES = [  # C, O, groups, kh, kw, sh, sw, dh, dw, pad
    (4, 4, 4, 3, 3, 1, 1, 1, 1, 1),     # depthwise 3x3
    (4, 4, 4, 3, 3, 2, 2, 1, 1, 1),     # depthwise stride 2
    (3, 6, 3, 3, 3, 1, 1, 1, 1, 1),     # channel multiplier 2
    (4, 8, 4, 5, 3, 1, 2, 2, 1, 2),     # multiplier, 5x3, mixed stride and dilation
    (4, 4, 4, 3, 3, 1, 1, 2, 2, 2),     # dilation 2
    (4, 6, 2, 3, 3, 2, 1, 1, 1, 1),     # groups=2
    (3, 5, 1, 3, 3, 1, 1, 1, 1, 1),     # groups=1
    (3, 5, 1, 1, 1, 1, 1, 1, 1, 0),     # 1x1
    (4, 4, 4, 7, 7, 3, 3, 1, 1, 3),     # 7x7, stride 3 (generic path)
    (6, 6, 3, 1, 7, 1, 2, 1, 1, 0),     # non-square
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_conv_grouped_random(case, dtype):
    c, o, groups, kh, kw, sh, sw, dh, dw, pad = case
    rng = np.random.default_rng(sum(case))
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (2, c, 9, 11), dtype=dtype)
    za = int(rng.integers(info.min, info.max + 1))
    wc = rng.integers(-255, 256, (o, c // groups, kh, kw)).astype(np.int16)
    _conv(x, za, wc, groups, sh, sw, dh, dw, pad, pad)


@pytest.mark.parametrize("ph,pw", [(2, 0), (0, 3), (1, 2)])
@pytest.mark.parametrize("s", [1, 2])
def test_conv_grouped_pads_rows_and_columns_apart(ph, pw, s):
    """Padding of its own along each axis, on both stride paths: the border
    codes are the zero point, the contribution 0, at the extremes of uint8."""
    rng = np.random.default_rng(ph * 10 + pw + s)
    x = rng.choice(np.array([0, 255], np.uint8), (1, 3, 7, 10))
    wc = rng.choice(np.array([-255, 255], np.int16), (3, 1, 3, 3))
    for za in (0, 255):
        _conv(x, za, wc, 3, s, s, 1, 1, ph, pw)


@pytest.mark.parametrize("case", CASES[:4] + CASES[6:7])
def test_conv_grouped_extremes(case):
    c, o, groups, kh, kw, sh, sw, dh, dw, pad = case
    shape = (1, c, 8, 37)
    for dtype, xv, za in [(np.uint8, 255, 0), (np.uint8, 0, 255), (np.uint8, 255, 255), (np.int8, -128, 127),
                          (np.int8, 127, -128)]:
        x = np.full(shape, xv, dtype)
        for wv in (-255, 255):
            wc = np.full((o, c // groups, kh, kw), wv, np.int16)
            out = _conv(x, za, wc, groups, sh, sw, dh, dw, pad, pad)
            assert np.abs(out).max() > 0 or xv == za
        # alternating extremes
        wc = np.where(np.arange(o * (c // groups) * kh * kw).reshape(o, c // groups, kh, kw) % 2, 255, -255)
        _conv(x, za, wc.astype(np.int32), groups, sh, sw, dh, dw, pad, pad)


def test_conv_grouped_wide_rows():
    """Rows long enough for the vector loops (and their tails) on both stride paths."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (1, 2, 5, 133), dtype=np.uint8)
    wc = rng.integers(-255, 256, (2, 1, 3, 3)).astype(np.int16)
    for s in (1, 2, 3):
        _conv(x, 17, wc, 2, s, s, 1, 1, 1, 1)


def test_conv_grouped_refuses_bad_shapes():
    x = np.zeros((1, 4, 5, 5), np.uint8)
    with pytest.raises(ValueError):
        conv_grouped(x, 0, np.zeros((4, 2, 3, 3), np.int16), 4, 1, 1, 1, 1, np.zeros((1, 4, 3, 3), np.int32))
    with pytest.raises(ValueError):
        conv_grouped(x, 0, np.zeros((4, 1, 3, 3), np.int16), 4, 1, 1, 1, 1, np.zeros((1, 4, 4, 3), np.int32))


# ---------------------------------------------------------------- im2col

def _im2col_numpy(xpad, kh, kw, sh, sw, dh, dw):
    """Channels-first patches (columns (c, p, q)) reordered to (p, q, c)."""
    n, c = xpad.shape[:2]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    v = sliding_window_view(xpad, (eh, ew), axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    oh, ow = v.shape[2:4]
    cols = v.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, c, kh, kw)
    return cols.transpose(0, 2, 3, 1).reshape(n * oh * ow, kh * kw * c)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shape, k, s, d, pad", [
    ((1, 3, 7, 7), (3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 4, 9, 11), (3, 3), (2, 2), (1, 1), (0, 0)),
    ((2, 2, 10, 9), (3, 2), (1, 2), (2, 1), (2, 0)),
    ((1, 5, 6, 8), (1, 1), (1, 1), (1, 1), (0, 3)),
    ((1, 2, 12, 12), (5, 3), (3, 1), (2, 2), (3, 2)),
    ((1, 1, 7, 7), (7, 7), (1, 1), (1, 1), (3, 3)),
])
def test_im2col_matches_numpy(dtype, shape, k, s, d, pad):
    """The kernel pads as it copies (with the zero point, at both ends of the
    dtype); the reference pads with NumPy first."""
    rng = np.random.default_rng(sum(shape))
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, shape, dtype=dtype)
    nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    for za in (info.min, info.max):
        ref = _im2col_numpy(_pad(x, za, *pad), *k, *s, *d)
        out = np.empty(ref.shape, dtype)
        oh = (shape[2] + 2 * pad[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
        parallel(im2col, shape[0] * oh, nhwc, *k, *s, *d, *pad, za, out)  # tasks (n, i) split among threads
        assert out.dtype == ref.dtype and (out == ref).all()
        from qarray.backends._base import Backend

        assert (Backend(np).im2col(nhwc, *k, s, pad, d, za) == ref).all()  # the generic code, as CuPy runs it
