"""The 16-byte vector path of the CUDA elementwise kernels, host-run: aligned
per-tensor data moves in vectors, misaligned starts and tails element by element."""

import numpy as np
import pytest
from test_cuda import _numpy_and_host, host, host_lib, make_rq  # noqa: F401  (fixtures)

import qarray


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("n", [1, 5, 4099])
def test_aligned_and_misaligned(host, rng, offset, n):  # noqa: F811
    base = (rng.standard_normal(n + 8) * 30).astype(np.float32)
    x = base[offset : offset + n]
    s, z = np.asarray(np.float32(0.25)), np.asarray(np.int32(3))
    want, got = _numpy_and_host(host, lambda b: b.quantize(x, s, z, qarray.qint8, None, None))
    np.testing.assert_array_equal(got, want)
    qb = rng.integers(-128, 128, n + 8).astype(np.int8)[offset : offset + n]
    for ft in (np.float32, np.float64):
        want, got = _numpy_and_host(host, lambda b: b.dequantize(qb, s, z, None, None, ft))
        np.testing.assert_array_equal(got, want)
    q64 = rng.integers(-(2**40), 2**40, n + 8)[offset : offset + n]
    rq = make_rq(0, 1, np.float64(2.0**-33) * 3, qarray.qint16)
    want, got = _numpy_and_host(host, lambda b: b.requantize(q64, rq))
    np.testing.assert_array_equal(got, want)
