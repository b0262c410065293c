"""Dask arrays of CuPy chunks (what dask-cuda schedules) against the NumPy
backend in memory, bit for bit: every op of tests/test_dask.py, with chunk
boundaries at awkward places, on the threaded scheduler (one process: the
chunks' device is the current one).

Runs only where CuPy, a CUDA device and Dask are there (``pytest -m gpu``); in
CI it runs on the host harness (tests/test_gpu_dryrun.py).
"""

import numpy as np
import pytest

import qarray

from _reference import assert_same, device_cupy

pytestmark = pytest.mark.gpu
cupy = device_cupy()
da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

X = np.random.default_rng(7).standard_normal((19, 23)).astype(np.float32) * 3
CHUNKS = [(1, 9), ((3, 16), (2, 9, 12))]


@pytest.fixture(autouse=True)
def threads():
    with dask.config.set(scheduler="threads"):
        yield


def on_gpu(a, chunks):
    """Host array ``a`` as a dask array of CuPy chunks."""
    return da.from_array(cupy.asarray(a), chunks=chunks, asarray=False)


def same(got, want):
    """``got`` (CuPy chunks), computed, is ``want`` (NumPy, in memory) bit for
    bit (``assert_same``)."""
    if isinstance(want, qarray.QArray):
        assert got.backend == "dask" and isinstance(got.data._meta, cupy.ndarray), (got.backend, type(got.data))
        c = got.compute()
        assert c.backend == "cupy" and isinstance(c.data, cupy.ndarray), c.backend
    else:
        assert isinstance(got._meta, cupy.ndarray), type(got._meta)
        c = got.compute()
        assert isinstance(c, cupy.ndarray), type(c)
    assert_same(c, want)


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("kw", [dict(), dict(axis=1), dict(axis=0, block_size=5)])
def test_quantize_dequantize_requantize(chunks, kw):
    from qarray._params import param_shape

    rng = np.random.default_rng(0)
    shape = param_shape(X.shape, kw.get("axis"), kw.get("block_size"))
    s, z = rng.uniform(0.01, 0.05, shape).astype(np.float32), rng.integers(-8, 8, shape).astype(np.int32)
    dx = on_gpu(X, chunks)
    for dt in ("qint8", "quint4", "qint16"):
        zz = np.clip(z, qarray.qdtype(dt).qmin, qarray.qdtype(dt).qmax)
        q, dq = qarray.quantize(X, s, zz, dt, **kw), qarray.quantize(dx, s, zz, dt, **kw)
        same(dq, q)
        same(dq.dequantize(), q.dequantize())
        same(dq.requantize(0.07, 3, "qint4"), q.requantize(0.07, 3, "qint4"))
        same(qarray.quantize_dynamic(dx, dt, **kw), qarray.quantize_dynamic(X, dt, **kw))
    same(qarray.quantize(dx, s, 0, "float8_e4m3fn", **kw), qarray.quantize(X, s, 0, "float8_e4m3fn", **kw))
    same(qarray.quantize(dx, s, 0, "float8_e4m3fn", **kw).dequantize(),
         qarray.quantize(X, s, 0, "float8_e4m3fn", **kw).dequantize())


@pytest.mark.parametrize("chunks", [(19, 1), ((3, 16), (2, 9, 12))])
def test_ops(chunks):
    q, r = qarray.quantize(X, 0.03, 2, "qint8"), qarray.quantize(X[::-1] * 0.5, 0.02, -3, "qint8", axis=1)
    dq = qarray.quantize(on_gpu(X, chunks), 0.03, 2, "qint8")
    dr = qarray.quantize(on_gpu(X[::-1] * 0.5, (7, 3)), 0.02, -3, "qint8", axis=1)
    out = dict(scale=0.05, zero_point=1, dtype="qint8")
    t, dt = qarray.quantize(X[::-1] * 0.5, 0.02, -3, "qint8"), qarray.quantize(on_gpu(X[::-1] * 0.5, (7, 3)), 0.02, -3, "qint8")
    for op in (qarray.add, qarray.sub, qarray.mul):
        same(op(dq, dt, **out), op(q, t, **out))
        same(op(dq, t.to("cupy"), **out), op(q, t, **out))  # an in-memory CuPy operand joins as one chunk
    same(qarray.relu(dr), qarray.relu(r))
    same(qarray.clamp(dr, -0.5, 0.25), qarray.clamp(r, -0.5, 0.25))  # per-channel thresholds: device arrays
    same(qarray.leaky_relu(dr, 0.125, **out), qarray.leaky_relu(r, 0.125, **out))
    same(qarray.sigmoid(dr), qarray.sigmoid(r))  # one table per channel
    same(qarray.tanh(dq), qarray.tanh(q))
    for axis in (0, 1):
        same(qarray.cat([dq, dt], axis=axis, scale=0.03, zero_point=0), qarray.cat([q, t], axis=axis, scale=0.03, zero_point=0))
        same(qarray.mean(dq, axis=axis, **out), qarray.mean(q, axis=axis, **out))
        same(qarray.sum(dq, axis=axis, **out), qarray.sum(q, axis=axis, **out))
    same(qarray.softmax(dq, scale=1 / 256, zero_point=-128), qarray.softmax(q, scale=1 / 256, zero_point=-128))
    same(dq.transpose()[3:17, ::3], q.transpose()[3:17, ::3])


def test_backends_of_chunks_do_not_mix():
    dq = qarray.quantize(on_gpu(X, 5), 0.03, 2, "qint8")
    for other in (qarray.quantize(X, 0.03, 2, "qint8"), qarray.quantize(da.from_array(X, 5), 0.03, 2, "qint8")):
        with pytest.raises(TypeError, match=r"arrays of two backends \(dask of cupy chunks and (numpy|dask of numpy chunks)\)"):
            qarray.add(dq, other)
    with pytest.raises(TypeError, match=r"arrays of two backends \(dask of cupy chunks and numpy\)"):
        qarray.linear(dq, qarray.quantize(X[:5], 0.05, 0, "qint8"))  # weights on the host


@pytest.mark.parametrize("k_chunk", [7, 23])
def test_linear_and_matmul_with_k_split(k_chunk):
    rng = np.random.default_rng(3)
    w = qarray.QArray.from_int(rng.integers(0, 256, (11, 23)), rng.uniform(0.01, 0.03, 11), rng.integers(0, 256, 11),
                               "quint8", axis=0)  # weight zero points anywhere in the range
    q = qarray.quantize(X, 0.03, -5, "qint8")
    dq = qarray.quantize(on_gpu(X, (4, k_chunk)), 0.03, -5, "qint8")
    wg, bias = w.to("cupy"), rng.standard_normal(11).astype(np.float32)
    out = dict(scale=0.2, zero_point=-4, dtype="qint8")
    same(qarray.linear(dq, wg, bias, **out), qarray.linear(q, w, bias, **out))
    same(qarray.matmul(dq, wg.T, **out), qarray.matmul(q, w.T, **out))
    same(qarray.matmul(dq, wg.T), qarray.matmul(q, w.T))  # the exact qint32 accumulator
    same(qarray.linear(dq.requantize(0.03, 0, "qint16"), wg, bias), qarray.linear(q.requantize(0.03, 0, "qint16"), w, bias))


def test_k_split_sums_beyond_2_32_are_exact():
    """qint16 codes at qmin against a zero point at qmax: every product the largest,
    sums far beyond 2**32; K in chunks of 37 and 999: against int64 sums rounded by Fraction."""
    from fractions import Fraction

    a = np.full((3, 2000), -32768, np.int16)
    a[1, ::3] = 32767
    w = np.full((2000, 2), 127, np.int8)
    want = (a.astype(np.int64) - 32767) @ (w.astype(np.int64) + 128)
    assert np.abs(want).max() > 2**32
    exact = np.array([[round(Fraction(int(v), 1 << 20)) for v in row] for row in want])
    wq = qarray.QArray.from_int(cupy.asarray(w), 1.0, -128, "qint8")
    for kc in (37, 999):
        aq = qarray.QArray.from_int(on_gpu(a, (2, kc)), 1.0, 32767, "qint16")
        got = qarray.matmul(aq, wq, scale=float(1 << 20), dtype="qint32", rounding="half_even").compute()
        np.testing.assert_array_equal(cupy.asnumpy(got.data), exact)


def test_conv2d_and_pooling_over_batch_chunks():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 4, 9, 8)).astype(np.float32)
    w = qarray.quantize(rng.standard_normal((6, 2, 3, 3)).astype(np.float32), rng.uniform(0.01, 0.03, 6).astype(np.float32),
                        0, "qint8", axis=0)
    q = qarray.quantize(x, 0.03, 4, "quint8")
    dq = qarray.quantize(on_gpu(x, (2, 3, 4, 5)), 0.03, 4, "quint8")
    for kw in (dict(padding=1, groups=2, scale=0.2, zero_point=3, dtype="quint8", relu=True),
               dict(stride=2, bias=rng.standard_normal(6).astype(np.float32), groups=2)):
        same(qarray.conv2d(dq, w.to("cupy"), **kw), qarray.conv2d(q, w, **kw))
    same(qarray.max_pool2d(dq, 3, stride=2, padding=1), qarray.max_pool2d(q, 3, stride=2, padding=1))
    same(qarray.avg_pool2d(dq, 2), qarray.avg_pool2d(q, 2))
    same(qarray.adaptive_avg_pool2d(dq, (2, 3)), qarray.adaptive_avg_pool2d(q, (2, 3)))


def test_observers():
    from qarray import observers

    for make in (lambda: observers.MinMax("qint8", axis=1),
                 lambda: observers.Histogram("quint8", method="mse", bins=64, axis=1),
                 lambda: observers.Histogram("qint8", bins=128, symmetric=True)):
        mem, lazy = make(), make()
        for batch in (X, X * np.float32(7)):
            mem.update(batch)
            lazy.update(on_gpu(batch, (4, 5)))
        for a, b in zip(lazy.qparams(), mem.qparams()):
            np.testing.assert_array_equal(a, b)
        if hasattr(mem, "counts"):
            np.testing.assert_array_equal(lazy.counts, mem.counts)
    mem, lazy, device = observers.ImportanceMatrix(), observers.ImportanceMatrix(), observers.ImportanceMatrix()
    for batch in (X, X * np.float32(7)):
        mem.update(batch)
        lazy.update(on_gpu(batch, (4, 5)))
        device.update(cupy.asarray(batch))
    np.testing.assert_array_equal(lazy.sums, mem.sums)
    np.testing.assert_array_equal(device.result(), mem.result())


def test_zarr_and_safetensors_from_device_chunks(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("zarr")
    from qarray.zarr import from_zarr, to_zarr

    q = qarray.quantize(X, 0.02, 0, "qint4", axis=1, block_size=4)
    dq = qarray.quantize(on_gpu(X, (5, 8)), 0.02, 0, "qint4", axis=1, block_size=4)
    to_zarr(dq, tmp_path / "q.zarr")
    back = from_zarr(tmp_path / "q.zarr").compute()
    np.testing.assert_array_equal(back.int_repr(), q.int_repr())
    qarray.save(tmp_path / "q.safetensors", {"q": dq})
    np.testing.assert_array_equal(qarray.load(tmp_path / "q.safetensors")["q"].int_repr(), q.int_repr())


@pytest.mark.parametrize("dtype", ["qint8", "float4_e2m1fn"])
def test_nan_in_a_cupy_chunk_raises_at_compute(dtype):
    """quantize on CuPy reports NaN at the next host read of the thread that ran
    it; a Dask chunk's task asks for it itself, so compute() raises, as with NumPy
    chunks, whichever scheduler thread ran the chunk."""
    if dtype.startswith("float"):
        pytest.importorskip("ml_dtypes")
    x = np.arange(12, dtype=np.float32)
    x[7] = np.nan
    q = qarray.quantize(on_gpu(x, 4), 0.5, 0, dtype)
    with pytest.raises(ValueError, match="NaN"):
        q.compute()
    qarray.quantize(on_gpu(np.ones(12, np.float32), 4), 0.5, 0, dtype).compute().get()  # nothing left pending
