"""The 16-byte vector path of the CUDA elementwise kernels, host-run: aligned
per-tensor data moves in vectors, misaligned starts and tails element by element."""

import numpy as np
import pytest

import qarray
from _reference import make_rq, numpy_and_host
from qarray._params import Quant


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("n", [1, 5, 4099])
def test_aligned_and_misaligned(host, rng, offset, n):
    base = (rng.standard_normal(n + 8) * 30).astype(np.float32)
    x = base[offset : offset + n]
    s, z = np.asarray(np.float32(0.25)), np.asarray(np.int32(3))
    want, got = numpy_and_host(host, lambda b: b.quantize(x, Quant(s, z, qarray.qint8)))
    np.testing.assert_array_equal(got, want)
    qb = rng.integers(-128, 128, n + 8).astype(np.int8)[offset : offset + n]
    for ft in (np.float32, np.float64):
        want, got = numpy_and_host(host, lambda b: b.dequantize(qb, s, z, None, None, ft))
        np.testing.assert_array_equal(got, want)
    q64 = rng.integers(-(2**40), 2**40, n + 8)[offset : offset + n]
    rq = make_rq(0, 1, np.float64(2.0**-33) * 3, qarray.qint16)
    want, got = numpy_and_host(host, lambda b: b.requantize(q64, rq))
    np.testing.assert_array_equal(got, want)


# rows whose length is a multiple of every vector width N (16 / element size): the
# vector path of every layout; and the same layouts one element short (element by element)
ROW_LAYOUTS = [((3, 32), 1, None), ((4, 3, 32), 1, None), ((64, 48), 0, None), ((5, 64), 1, 16), ((2, 4, 32), 1, 2),
               ((3, 31), 1, None), ((4, 3, 31), 1, None), ((5, 63), 1, 16), ((2, 4, 31), 1, 2)]


@pytest.mark.parametrize("shape,axis,block_size", ROW_LAYOUTS)
@pytest.mark.parametrize("offset", [0, 1])
def test_per_axis_and_blocked_rows(host, rng, shape, axis, block_size, offset):
    """Per-axis and blocked layouts run as rows of contiguous elements (one slot a
    row, a slot per column, or slots along the row): quantize, dequantize and
    requantize equal NumPy's, aligned (vectors) or not (element by element)."""
    from qarray._params import param_shape

    ps = param_shape(shape, axis, block_size)
    n = int(np.prod(shape))
    x = (rng.standard_normal(n + 16) * 40).astype(np.float32)[offset : offset + n].reshape(shape)
    scale = rng.uniform(0.05, 0.5, ps).astype(np.float32)
    zp = rng.integers(-20, 20, ps).astype(np.int32)
    for d in (qarray.qint8, qarray.quint16, qarray.qint32):
        z = np.clip(zp, d.qmin, d.qmax).astype(np.int32)
        want, got = numpy_and_host(host, lambda b: b.quantize(x, Quant(scale, z, d, axis, block_size)))
        np.testing.assert_array_equal(got, want)
        for ft in (np.float16, np.float32, np.float64):
            w, g = numpy_and_host(host, lambda b: b.dequantize(want, scale, z, axis, block_size, ft))
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    q = rng.integers(-(2**20), 2**20, n + 16).astype(np.int32)[offset : offset + n].reshape(shape)
    rq = make_rq(rng.integers(-5, 5, ps), np.full(ps, 3), rng.uniform(1e-3, 0.1, ps), qarray.qint8, axis, block_size, 0)
    want, got = numpy_and_host(host, lambda b: b.requantize(q, rq))
    np.testing.assert_array_equal(got, want)
