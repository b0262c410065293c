"""The CuPy backend on a real GPU against the NumPy backend, bit for bit.

Runs only where CuPy imports and a CUDA device answers (``pytest -m gpu``);
elsewhere every test here is skipped. The no-device error paths are tested in
test_backends.py, which runs everywhere.
"""

import numpy as np
import pytest

import qarray

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no device")
except Exception as e:  # no driver, no device
    pytest.skip(f"no CUDA device: {e}", allow_module_level=True)


def both(fn, *host_arrays):
    """``fn`` on NumPy arrays and on their CuPy copies; results back on the host."""
    want = fn(*host_arrays)
    got = fn(*[cupy.asarray(a) for a in host_arrays])
    return want, got


def ints(q):
    return qarray.backends.get(q.backend).to_host(q.data)


def test_seed_use_case():
    x = cupy.random.rand(10, dtype=cupy.float32)
    q = qarray.quantize(x, 0.01, 0, qarray.qint8)
    assert q.backend == "cupy" and isinstance(q.data, cupy.ndarray)
    text = repr(q)
    assert "backend=cupy" in text and "dtype=qint8" in text
    d = q.dequantize()
    assert isinstance(d, cupy.ndarray)
    np.testing.assert_array_equal(d.get(), qarray.quantize(x.get(), 0.01, 0, qarray.qint8).dequantize())


@pytest.mark.parametrize("dtype", ["qint2", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"])
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape,axis,block_size", [
    ((1,), None, None), (((1 << 20) + 3,), None, None), ((33, 65), 0, None), ((33, 65), 1, None), ((40, 129), 1, 32)])
def test_quantize_dequantize(dtype, in_dtype, shape, axis, block_size, rng):
    from qarray._params import param_shape

    d = qarray.qdtype(dtype)
    x = (rng.standard_normal(shape) * 50).astype(in_dtype)
    ps = param_shape(shape, axis, block_size)
    scale = rng.uniform(0.05, 0.5, ps).astype(np.float32)
    zp = rng.integers(d.qmin, min(d.qmax, d.qmin + 100), ps, endpoint=True)
    want, got = both(lambda a: qarray.quantize(a, scale, zp, dtype, axis=axis, block_size=block_size), x)
    np.testing.assert_array_equal(ints(got), ints(want))
    for ft in ("float16", "float32", "float64"):
        np.testing.assert_array_equal(got.dequantize(ft).get(), want.dequantize(ft))


@pytest.mark.parametrize("rounding", ["half_even", "half_away", "half_up", "tflite"])
@pytest.mark.parametrize("mode", ["fixed", "float"])
def test_requantize(rounding, mode, rng):
    q = qarray.QArray.from_int(rng.integers(-(2**24), 2**24, (257, 129)).astype(np.int32), 1e-4, 0, "qint32")
    want = qarray.requantize(q, 0.05, 3, "qint8", mode=mode, rounding=rounding)
    got = qarray.requantize(q.to("cupy"), 0.05, 3, "qint8", mode=mode, rounding=rounding)
    np.testing.assert_array_equal(ints(got), ints(want))


def test_ops_match(rng):
    a = qarray.quantize(rng.standard_normal((64, 96)).astype(np.float32), 0.02, 3, "quint8")
    b = qarray.quantize(rng.standard_normal((96, 32)).astype(np.float32), np.full(32, 0.01, np.float32), 0, "qint8", axis=1)
    ga, gb = a.to("cupy"), b.to("cupy")
    for f in (lambda x, y: qarray.matmul(x, y), lambda x, y: qarray.matmul(x, y, scale=0.1, zero_point=0, dtype="qint8"),
              lambda x, y: qarray.cat([x, x[:3]], scale=0.05, zero_point=0, dtype="qint8"),
              lambda x, y: qarray.add(x, x, scale=0.05, zero_point=0, dtype="qint8"),
              lambda x, y: qarray.sigmoid(x), lambda x, y: qarray.relu(x)):
        np.testing.assert_array_equal(ints(f(ga, gb)), ints(f(a, b)))


def test_quantize_dynamic_and_minmax(rng):
    x = rng.standard_normal((128, 33)).astype(np.float32)
    want = qarray.quantize_dynamic(x, "quint8", axis=1)
    got = qarray.quantize_dynamic(cupy.asarray(x), "quint8", axis=1)
    np.testing.assert_array_equal(ints(got), ints(want))
    np.testing.assert_array_equal(got.scale.get(), want.scale)


def test_non_contiguous_and_misaligned(rng):
    x = rng.standard_normal((64, 65)).astype(np.float32)
    gx = cupy.asarray(x)
    for view in (lambda a: a[:, ::2], lambda a: a.reshape(-1)[1:], lambda a: a.T):
        want = qarray.quantize(view(x), 0.1, 0, "qint8")
        got = qarray.quantize(view(gx), 0.1, 0, "qint8")
        np.testing.assert_array_equal(ints(got), ints(want))


def test_nan_on_device_is_the_cpu_error():
    x = cupy.zeros((3, 4), cupy.float32)
    x[2, 1] = cupy.nan
    with pytest.raises(ValueError, match=r"1 NaN value\(s\), the first at index \(2, 1\)"):
        qarray.quantize(x, 0.1, 0, "qint8")


def test_numpy_and_cupy_in_one_op():
    a = qarray.quantize(np.ones(4, np.float32), 0.1, 0, "qint8")
    with pytest.raises(TypeError, match=r"arrays of two backends \(numpy and cupy\) can not be combined"):
        qarray.cat([a, a.to("cupy")])


def test_two_devices():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    with cupy.cuda.Device(0):
        a = qarray.quantize(cupy.ones(4, cupy.float32), 0.1, 0, "qint8")
    with cupy.cuda.Device(1):
        b = qarray.quantize(cupy.ones(4, cupy.float32), 0.1, 0, "qint8")
    with pytest.raises(TypeError, match="CuPy arrays on two devices"):
        qarray.cat([a, b])


def test_float32_subnormals_are_kept(rng):
    """CuPy compiles with -ftz=true; the kernels must still keep subnormals as NumPy does."""
    tiny = np.float32(2.0**-149)
    x = np.array([tiny, 3 * tiny, -5 * tiny, 2.0**-127, 0.0, 1e-39, -1e-38, 1.0], np.float32)
    for scale in (2.0**-149, 2.0**-140, 2.0**-126):  # subnormal, subnormal, the smallest normal
        want, got = both(lambda a: qarray.quantize(a, scale, 1, "qint16"), x)
        np.testing.assert_array_equal(ints(got), ints(want))
        np.testing.assert_array_equal(got.dequantize().get().view(np.uint32), want.dequantize().view(np.uint32))
    want, got = both(lambda a: qarray.quantize_dynamic(a, "quint8"), x[:6])
    np.testing.assert_array_equal(got.scale.get(), want.scale)
    np.testing.assert_array_equal(ints(got), ints(want))


@pytest.mark.parametrize("op", [qarray.add, qarray.sub, qarray.mul])
@pytest.mark.parametrize("shapes", [((300, 257), (300, 257)), ((300, 257), (257,)), ((5, 1, 7), (5, 3, 7))])
@pytest.mark.parametrize("relu", [False, True])
def test_binary_ops_fused(op, shapes, relu, rng):
    a = qarray.quantize(rng.standard_normal(shapes[0]).astype(np.float32), 0.03, -5, "qint8")
    b = qarray.quantize(rng.standard_normal(shapes[1]).astype(np.float32), 0.07, 120, "quint8")
    out = dict(scale=0.05, zero_point=-3, dtype="qint8", relu=relu)
    np.testing.assert_array_equal(ints(op(a.to("cupy"), b.to("cupy"), **out)), ints(op(a, b, **out)))


def test_lut_per_axis_and_float16(rng):
    x = rng.standard_normal((64, 129)).astype(np.float16)
    q = qarray.quantize(x, rng.uniform(0.01, 0.1, 64).astype(np.float32), 3, "qint8", axis=0)
    out = dict(scale=0.01, zero_point=0, dtype="qint8")
    np.testing.assert_array_equal(ints(qarray.gelu(q.to("cupy"), **out)), ints(qarray.gelu(q, **out)))
    np.testing.assert_array_equal(q.to("cupy").dequantize("float16").get().view(np.uint16),
                                  q.dequantize("float16").view(np.uint16))


def test_beyond_2_31_elements():
    """64-bit indices: the last elements of a 2**31 + 5 element array."""
    n = 2**31 + 5
    x = cupy.ones(n, cupy.float16)
    x[-3:] = cupy.asarray([2.0, -3.0, 0.25], cupy.float16)
    q = qarray.quantize(x, 0.25, 1, "qint8")
    np.testing.assert_array_equal(q.data[-4:].get(), [5, 9, -11, 2])
    r = qarray.requantize(q, 0.5, 0, "qint8")
    np.testing.assert_array_equal(r.data[-4:].get(), [2, 4, -6, 0])
    del x, q, r
