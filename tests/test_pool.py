"""qarray/ops/pool.py against exact int64 / Fraction references. The main test of
each op runs on every backend (the ``backend`` fixture); the CUDA backend has no
pooling kernel (its arrays run the array-library code), so only ``sum``'s
requantize checks that a kernel ran there."""

import math
from fractions import Fraction

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray._fixed_point import quantize_multiplier
from qarray.ops import pool as P
from _reference import rand_q, round_rational


def geometry(H, k, s, p, d=1):
    return (H + 2 * p - d * (k - 1) - 1) // s + 1


def ref_max_pool(x, k, s, p, dil, fill):
    N, C, H, W = x.shape
    OH, OW = geometry(H, k, s, p, dil), geometry(W, k, s, p, dil)
    out = np.empty((N, C, OH, OW), np.int64)
    for n in range(N):
        for c in range(C):
            for i in range(OH):
                for j in range(OW):
                    best = fill
                    for a in range(k):
                        for b in range(k):
                            h, w = i * s - p + a * dil, j * s - p + b * dil
                            if 0 <= h < H and 0 <= w < W:
                                best = max(best, int(x[n, c, h, w]))
                    out[n, c, i, j] = best
    return out


def finish_ref(total, count, s_in, z_out, s_out, d, rounding="half_even"):
    """zp_out + R(mean * m / 2**sh): the mean exactly, the scale ratio as requantize's (m, sh)."""
    m, sh = quantize_multiplier(np.float64(np.float32(s_in)) / np.float64(np.float32(s_out)))
    v = round_rational(Fraction(total, count) * Fraction(int(m), 2 ** int(sh)), rounding) + z_out
    d = qarray.qdtype(d)
    return min(max(v, d.qmin), d.qmax)


def ref_avg_pool(x, zp, k, s, p, include_pad, s_in, s_out, z_out, d, rounding="half_even"):
    N, C, H, W = x.shape
    OH, OW = geometry(H, k, s, p), geometry(W, k, s, p)
    out = np.empty((N, C, OH, OW), np.int64)
    for n in range(N):
        for c in range(C):
            for i in range(OH):
                for j in range(OW):
                    total = count = 0
                    for a in range(k):
                        for b in range(k):
                            h, w = i * s - p + a, j * s - p + b
                            if 0 <= h < H and 0 <= w < W:
                                total += int(x[n, c, h, w]) - zp
                                count += 1
                    out[n, c, i, j] = finish_ref(total, k * k if include_pad else count, s_in, z_out, s_out, d, rounding)
    return out


POOLS = [(2, None, 0, 1), (3, 1, 1, 1), (3, 2, 1, 2), (2, 1, 1, 1), (1, 2, 0, 1), ((3, 3), (2, 2), (1, 1), (1, 1))]


@pytest.mark.parametrize("k,s,p,dil", POOLS)
@pytest.mark.parametrize("d", ["qint8", "quint8", "qint4"])
def test_max_pool2d(backend, rng, k, s, p, dil, d):
    q = rand_q(rng, (2, 3, 7, 6), d, 0.1, 1)
    got = backend.run(P.max_pool2d, q, k, s, p, dil)
    kk, ss, pp, dd = (v[0] if isinstance(v, tuple) else v for v in (k, s, p, dil))
    want = ref_max_pool(q.int_repr(), kk, ss or kk, pp, dd, q.dtype.qmin)
    np.testing.assert_array_equal(got.int_repr(), want)
    assert got.dtype is q.dtype and float(got.scale) == float(q.scale) and int(got.zero_point) == 1


def test_max_pool2d_chw_and_per_channel(rng):
    scales = np.array([0.1, 0.2, 0.3], np.float32)
    q = QArray.from_int(rng.integers(-128, 128, size=(3, 5, 5)), scales, [0, 1, -1], "qint8", axis=0)
    got = P.max_pool2d(q, 2, 1)
    assert got.shape == (3, 4, 4) and got.axis == 0
    np.testing.assert_array_equal(got.scale, scales)
    want = ref_max_pool(q.int_repr()[None], 2, 1, 0, 1, -128)[0]
    np.testing.assert_array_equal(got.int_repr(), want)
    q4 = QArray.from_int(rng.integers(-128, 128, size=(2, 3, 4, 4)), scales, 0, "qint8", axis=1)
    assert P.max_pool2d(q4, 2).axis == 1


@pytest.mark.parametrize("k,s,p,dil", POOLS)
def test_max_pool2d_matches_torch(rng, k, s, p, dil):
    torch = pytest.importorskip("torch")
    q = rand_q(rng, (2, 3, 7, 6), "quint8", 0.07, 100)
    ours = P.max_pool2d(q, k, s, p, dil).dequantize()
    theirs = torch.nn.functional.max_pool2d(torch.from_numpy(q.dequantize()), k, s, p, dil).numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("k,s,p", [(2, None, 0), (3, 1, 1), (3, 2, 1), (2, 1, 1), (4, 3, 2)])
@pytest.mark.parametrize("include_pad", [True, False])
@pytest.mark.parametrize("d,zp", [("qint8", 3), ("quint8", 128), ("qint4", -2)])
def test_avg_pool2d_default_params_exact(backend, rng, k, s, p, include_pad, d, zp):
    q = rand_q(rng, (2, 2, 7, 6), d, 0.1, zp)
    got = backend.run(P.avg_pool2d, q, k, s, p, count_include_pad=include_pad)
    assert got.dtype is q.dtype and float(got.scale) == float(q.scale) and int(got.zero_point) == zp
    want = ref_avg_pool(q.int_repr(), zp, k, s or k, p, include_pad, 0.1, 0.1, zp, d)
    np.testing.assert_array_equal(got.int_repr(), want)


def test_avg_pool2d_ties_round_half_even():
    # 2x2 windows with sums 2, 6, -2, -6: means 0.5, 1.5, -0.5, -1.5, all ties
    x = np.array([[1, 1, 3, 3, 0, -1, -3, -3], [0, 0, 0, 0, 0, -1, 0, 0]])[None, None]
    q = QArray.from_int(x, 1.0, 0, "qint8")
    np.testing.assert_array_equal(P.avg_pool2d(q, 2).int_repr().ravel(), [0, 2, 0, -2])
    np.testing.assert_array_equal(P.avg_pool2d(q, 2, rounding="half_away").int_repr().ravel(), [1, 2, -1, -2])
    np.testing.assert_array_equal(P.avg_pool2d(q, 2, rounding="tflite").int_repr().ravel(), [1, 2, -1, -2])
    np.testing.assert_array_equal(P.avg_pool2d(q, 2, rounding="half_up").int_repr().ravel(), [1, 2, 0, -1])


@pytest.mark.parametrize("rounding", ["half_even", "half_away", "half_up"])
@pytest.mark.parametrize("s_out,z_out,dout", [(0.03, -5, "qint8"), (0.1, 0, "qint16"), (0.37, 200, "quint8"), (0.05, 0, "quint4")])
def test_avg_pool2d_other_output_params(backend, rng, rounding, s_out, z_out, dout):
    q = rand_q(rng, (2, 2, 6, 6), "quint8", 0.1, 120)
    got = backend.run(P.avg_pool2d, q, 3, 1, 1, scale=s_out, zero_point=z_out, dtype=dout, rounding=rounding)
    assert got.dtype is qarray.qdtype(dout) and float(got.scale) == np.float32(s_out)
    want = ref_avg_pool(q.int_repr(), 120, 3, 1, 1, True, 0.1, s_out, z_out, dout, rounding)
    np.testing.assert_array_equal(got.int_repr(), want)


def test_avg_pool2d_float_mode(rng):
    q = rand_q(rng, (1, 2, 6, 6), "qint8", 0.1, 0)
    got = P.avg_pool2d(q, 3, scale=0.03, zero_point=-3, mode="float")
    x = q.int_repr().astype(np.float64)
    sums = x.reshape(1, 2, 2, 3, 2, 3).sum(axis=(3, 5))
    want = np.clip(np.rint(sums / 9 * np.float64(np.float32(0.1) / np.float32(0.03)) - 3), -128, 127)
    np.testing.assert_array_equal(got.int_repr(), want)


def test_avg_pool2d_close_to_torch(rng):
    torch = pytest.importorskip("torch")
    q = rand_q(rng, (2, 3, 9, 8), "quint8", 0.05, 128)
    for include_pad in (True, False):
        ours = P.avg_pool2d(q, 3, 2, 1, count_include_pad=include_pad).dequantize(np.float64)
        x = torch.from_numpy(q.dequantize(np.float64))
        theirs = torch.nn.functional.avg_pool2d(x, 3, 2, 1, count_include_pad=include_pad).numpy()
        assert np.abs(ours - theirs).max() <= 0.05 / 2 + 1e-9


def ref_adaptive(x, zp, OH, OW, s_in, s_out, z_out, d):
    N, C, H, W = x.shape
    out = np.empty((N, C, OH, OW), np.int64)
    for i in range(OH):
        h0, h1 = (i * H) // OH, -(-((i + 1) * H) // OH)
        for j in range(OW):
            w0, w1 = (j * W) // OW, -(-((j + 1) * W) // OW)
            for n in range(N):
                for c in range(C):
                    total = int((x[n, c, h0:h1, w0:w1].astype(np.int64) - zp).sum())
                    out[n, c, i, j] = finish_ref(total, (h1 - h0) * (w1 - w0), s_in, z_out, s_out, d)
    return out


@pytest.mark.parametrize("size", [1, 3, (2, 5), (4, None), (9, 7)])
def test_adaptive_avg_pool2d(backend, rng, size):
    q = rand_q(rng, (2, 3, 7, 5), "qint8", 0.1, -4)
    got = backend.run(P.adaptive_avg_pool2d, q, size)
    oh, ow = size if isinstance(size, tuple) else (size, size)
    ow = 5 if ow is None else ow
    assert got.shape == (2, 3, oh, ow)
    np.testing.assert_array_equal(got.int_repr(), ref_adaptive(q.int_repr(), -4, oh, ow, 0.1, 0.1, -4, "qint8"))
    other = backend.run(P.adaptive_avg_pool2d, q, size, scale=0.02, zero_point=3, dtype="qint16")
    np.testing.assert_array_equal(other.int_repr(), ref_adaptive(q.int_repr(), -4, oh, ow, 0.1, 0.02, 3, "qint16"))


def test_adaptive_avg_pool2d_windows_match_torch(rng):
    torch = pytest.importorskip("torch")
    q = rand_q(rng, (1, 2, 11, 7), "qint8", 1.0, 0)
    got = P.adaptive_avg_pool2d(q, (4, 3)).int_repr()
    exact = torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(q.int_repr().astype(np.float64)), (4, 3)).numpy()
    assert np.abs(got - exact).max() <= 0.5 + 1e-9
    chw = P.adaptive_avg_pool2d(q[0], (4, 3))
    np.testing.assert_array_equal(chw.int_repr(), got[0])


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_mean_and_sum(backend, rng, axis, keepdims):
    q = rand_q(rng, (4, 3, 5), "quint8", 0.2, 77)
    x = q.int_repr().astype(np.int64) - 77
    total = x.sum(axis=axis, keepdims=keepdims)
    count = x.size // total.size
    m = backend.run(P.mean, q, axis, keepdims)
    want = np.vectorize(lambda t: 77 + round_rational(Fraction(int(t), count)))(total)
    np.testing.assert_array_equal(m.int_repr(), want)
    assert m.shape == np.shape(total) and m.dtype is qarray.quint8
    s = backend.run(P.sum, q, axis, keepdims)
    assert s.dtype is qarray.qint32 and float(s.scale) == np.float32(0.2) and int(s.zero_point) == 0
    np.testing.assert_array_equal(s.int_repr(), total)
    m2 = backend.run(P.mean, q, axis, keepdims, scale=0.05, zero_point=-3, dtype="qint8", rounding="half_away")
    want2 = np.vectorize(lambda t: finish_ref(int(t), count, 0.2, -3, 0.05, "qint8", "half_away"))(total)
    np.testing.assert_array_equal(m2.int_repr(), want2)
    s2 = backend.run(P.sum, q, axis, keepdims, scale=1.0, dtype="qint16")
    np.testing.assert_array_equal(s2.int_repr(), np.vectorize(lambda t: finish_ref(int(t), 1, 0.2, 0, 1.0, "qint16"))(total))
    assert backend.ran("requantize_int64_int16"), backend.launched  # the sum's requantize: the kernel


def test_sum_overflow_and_mean_ties():
    big = QArray.from_int(np.array([2**31 - 1, 1]), 1.0, 0, "qint32")
    with pytest.raises(ValueError, match="beyond qint32"):
        P.sum(big)
    assert int(P.mean(big).int_repr()) == 2**30
    q = QArray.from_int(np.array([[1, 2], [-1, -2], [3, 4]]), 1.0, 0, "qint8")
    np.testing.assert_array_equal(P.mean(q, axis=1).int_repr(), [2, -2, 4])  # 1.5, -1.5, 3.5


def test_errors(rng):
    q = rand_q(rng, (1, 2, 4, 4))
    with pytest.raises(ValueError, match="4-D"):
        P.max_pool2d(rand_q(rng, (4, 4)), 2)
    with pytest.raises(ValueError, match="4-D"):
        P.avg_pool2d(rand_q(rng, (1, 1, 1, 4, 4)), 2)
    with pytest.raises(ValueError, match="larger than the padded input"):
        P.max_pool2d(q, 5)
    with pytest.raises(ValueError, match="larger than the padded input"):
        P.max_pool2d(q, 3, dilation=2)
    with pytest.raises(ValueError, match="padding must be >= 0"):
        P.avg_pool2d(q, 2, padding=-1)
    with pytest.raises(ValueError, match="at most half the kernel"):
        P.max_pool2d(q, 2, padding=2)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        P.max_pool2d(q, 2, stride=0)
    with pytest.raises(ValueError, match="kernel_size must be >= 1"):
        P.avg_pool2d(q, 0)
    with pytest.raises(TypeError, match="kernel_size must be an int"):
        P.max_pool2d(q, 1.5)
    with pytest.raises(ValueError, match="pair"):
        P.max_pool2d(q, (1, 2, 3))
    with pytest.raises(TypeError, match="must be a QArray"):
        P.max_pool2d(np.zeros((1, 1, 4, 4), np.int8), 2)
    with pytest.raises(TypeError, match="must be a QArray"):
        P.mean(np.zeros(3))
    per_ch = QArray.from_int(np.zeros((1, 2, 4, 4), np.int8), [0.1, 0.2], 0, "qint8", axis=1)
    with pytest.raises(ValueError, match="per-tensor"):
        P.avg_pool2d(per_ch, 2)
    with pytest.raises(ValueError, match="per-tensor"):
        P.sum(per_ch)
    with pytest.raises(ValueError, match="channel axis"):
        P.max_pool2d(QArray.from_int(np.zeros((1, 2, 4, 4), np.int8), [0.1] * 4, 0, "qint8", axis=3), 2)
    with pytest.raises(ValueError, match="output_size must be >= 1"):
        P.adaptive_avg_pool2d(q, 0)
    with pytest.raises(ValueError, match="no elements"):
        P.mean(QArray.from_int(np.zeros((0, 3), np.int8), 0.1, 0, "qint8"), axis=0)
    with pytest.raises(ValueError, match="repeated axis"):
        P.mean(q, axis=(1, 1))
    with pytest.raises(ValueError, match="output scale="):
        P.mean(q, dtype="qint16")
