"""The Dask backend and Zarr storage: every result bit for bit the in-memory
(NumPy backend) one, whatever the chunking (chunks of 1, of block_size +- 1,
the parameter axis split across chunks), on the threaded scheduler and on a
real two-process ``dask.distributed.LocalCluster``; the exact int64 K-split
matmul at the dtypes' extremes against an int64 reference; lazy graphs; Zarr
round trips for every dtype and scheme; damaged stores."""

import json

import os
import re

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

import qarray  # noqa: E402
from qarray._params import param_shape  # noqa: E402
from qarray.zarr import from_zarr, to_zarr  # noqa: E402

from _reference import assert_same  # noqa: E402

X = np.random.default_rng(7).standard_normal((19, 23)).astype(np.float32) * 3
CHUNKS = [(1, 1), (4, 5), (6, 4), (19, 23), ((3, 16), (2, 9, 12))]
LAYOUTS = [dict(), dict(axis=0), dict(axis=1), dict(axis=1, block_size=4), dict(axis=0, block_size=5)]


@pytest.fixture(scope="module")
def cluster():
    """A real cluster: two worker processes of one thread each."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster, set_as_default=False) as c:
        yield c


@pytest.fixture
def client(cluster):
    """The cluster's client as the scheduler of this test's graphs (the other
    tests run on the threaded scheduler)."""
    with dask.config.set(scheduler=cluster):
        yield cluster


def _params(kw, seed=0):
    rng = np.random.default_rng(seed)
    shape = param_shape(X.shape, kw.get("axis"), kw.get("block_size"))
    return rng.uniform(0.01, 0.05, shape).astype(np.float32), rng.integers(-20, 20, shape).astype(np.int32)


def _same(got, want):
    """``got`` (a Dask QArray or array) computed is ``want`` bit for bit (``assert_same``)."""
    if isinstance(want, qarray.QArray):
        assert isinstance(got.data, da.Array), type(got.data)
        c = got.compute()
        assert c.backend == "numpy", c.backend
    else:
        assert isinstance(got, da.Array), type(got)
        c = got.compute()
    assert_same(c, want)


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("kw", LAYOUTS)
def test_quantize_dequantize_requantize_as_numpy(chunks, kw):
    s, z = _params(kw)
    dx = da.from_array(X, chunks=chunks)
    for dt in ("qint8", "quint4", "qint16"):
        zz = np.clip(z, qarray.qdtype(dt).qmin, qarray.qdtype(dt).qmax)
        q, dq = qarray.quantize(X, s, zz, dt, **kw), qarray.quantize(dx, s, zz, dt, **kw)
        _same(dq, q)
        _same(dq.dequantize(), q.dequantize())
        _same(dq.dequantize("float64"), q.dequantize("float64"))
        _same(dq.requantize(0.07, 3, "qint4"), q.requantize(0.07, 3, "qint4"))
        _same(qarray.quantize_dynamic(dx, dt, **kw), qarray.quantize_dynamic(X, dt, **kw))
    for f in ("float8_e4m3fn", "float4_e2m1fn"):
        _same(qarray.quantize(dx, s, 0, f, **kw), qarray.quantize(X, s, 0, f, **kw))
        _same(qarray.quantize(dx, s, 0, f, **kw).dequantize(), qarray.quantize(X, s, 0, f, **kw).dequantize())


def test_blocked_chunks_are_aligned_to_whole_blocks():
    """Chunks of block_size +- 1 along the blocked axis are rechunked to whole blocks."""
    from qarray.backends.dask import DaskBackend

    for c in (3, 4, 5, 1):
        x = DaskBackend.aligned(da.from_array(X, chunks=(19, c)), 1, 4)
        assert all(n % 4 == 0 for n in x.chunks[1][:-1]), x.chunks
    s, z = _params(dict(axis=1, block_size=4))
    for c in (3, 5):
        _same(qarray.quantize(da.from_array(X, chunks=(7, c)), s, z, "qint8", axis=1, block_size=4),
              qarray.quantize(X, s, z, "qint8", axis=1, block_size=4))


@pytest.mark.parametrize("chunks", [(1, 1), (5, 6), ((3, 16), (2, 9, 12))])
def test_ops_as_numpy(chunks):
    dx, dy = da.from_array(X, chunks=chunks), da.from_array(X[::-1] * 0.5, chunks=(7, 3))  # chunks that differ
    q, r = qarray.quantize(X, 0.03, 2, "qint8"), qarray.quantize(X[::-1] * 0.5, 0.02, -3, "qint8")
    dq, dr = qarray.quantize(dx, 0.03, 2, "qint8"), qarray.quantize(dy, 0.02, -3, "qint8")
    out = dict(scale=0.05, zero_point=1, dtype="qint8")
    for op in (qarray.add, qarray.sub, qarray.mul):
        _same(op(dq, dr, **out), op(q, r, **out))
        _same(op(dq, r, **out), op(q, r, **out))  # an in-memory operand joins as one chunk
    _same(qarray.relu(dq), qarray.relu(q))
    _same(qarray.clamp(dq, -0.5, 0.25), qarray.clamp(q, -0.5, 0.25))
    _same(qarray.sigmoid(dq), qarray.sigmoid(q))
    _same(qarray.tanh(dq), qarray.tanh(q))
    pc, dpc = qarray.quantize(X, 0.03, 2, "qint8", axis=1), qarray.quantize(dx, 0.03, 2, "qint8", axis=1)
    _same(qarray.sigmoid(dpc), qarray.sigmoid(pc))  # one table per channel, sliced per chunk
    _same(qarray.clamp(dpc, -0.5, 0.25), qarray.clamp(pc, -0.5, 0.25))
    for axis in (0, 1):
        _same(qarray.softmax(dq, axis, scale=1 / 256, zero_point=-128), qarray.softmax(q, axis, scale=1 / 256, zero_point=-128))
        _same(qarray.log_softmax(dq, axis), qarray.log_softmax(q, axis))
    for axis in (0, 1):
        _same(qarray.cat([dq, dr], axis=axis, scale=0.03, zero_point=0), qarray.cat([q, r], axis=axis, scale=0.03, zero_point=0))
        _same(qarray.cat([dq, dq], axis=axis), qarray.cat([q, q], axis=axis))
        _same(qarray.mean(dq, axis=axis, **out), qarray.mean(q, axis=axis, **out))
        _same(qarray.sum(dq, axis=axis, **out), qarray.sum(q, axis=axis, **out))
    for kw in ({}, out):  # over every axis: a 0-d result, which dask computes to a NumPy scalar
        _same(qarray.sum(dq, **kw), qarray.sum(q, **kw))
        _same(qarray.mean(dq, **out), qarray.mean(q, **out))
    _same(dq.transpose(), q.transpose())
    _same(dq[3:17, ::3], q[3:17, ::3])


@pytest.mark.parametrize("k_chunk", [1, 7, 23])
def test_linear_and_matmul_with_k_split(k_chunk):
    rng = np.random.default_rng(3)
    w = qarray.quantize(rng.standard_normal((11, 23)).astype(np.float32), rng.uniform(0.01, 0.03, 11).astype(np.float32),
                        0, "qint8", axis=0)
    q = qarray.quantize(X, 0.03, 5, "quint8")
    dq = qarray.quantize(da.from_array(X, chunks=(4, k_chunk)), 0.03, 5, "quint8")
    bias = rng.standard_normal(11).astype(np.float32)
    out = dict(scale=0.2, zero_point=-4, dtype="qint8")
    _same(qarray.linear(dq, w, bias, **out), qarray.linear(q, w, bias, **out))
    _same(qarray.linear(dq, w, relu=True, **out), qarray.linear(q, w, relu=True, **out))
    _same(qarray.matmul(dq, w.T, **out), qarray.matmul(q, w.T, **out))
    _same(qarray.matmul(dq, w.T), qarray.matmul(q, w.T))  # the exact qint32 accumulator


@pytest.mark.parametrize("dt,za,wt,zw", [("quint8", 0, "qint8", 127), ("qint8", 127, "qint8", -128),
                                         ("quint8", 255, "quint8", 0), ("qint4", -8, "quint4", 15),
                                         ("qint16", -32768, "qint8", 127), ("qint16", 32767, "quint8", 0)])
def test_k_split_sums_are_exact_at_the_extremes(dt, za, wt, zw):
    """Codes at qmin/qmax with zero points at the other end, so every product is
    the largest there is (qint16: sums beyond 2**32); K split into chunks of 1,
    7 and 999: the requantized result against int64 sums rounded by Fraction."""
    from fractions import Fraction

    a_d, w_d = qarray.qdtype(dt), qarray.qdtype(wt)
    for k, kc in ((40, 1), (2000, 7), (2000, 999)):
        a = np.full((3, k), a_d.qmax if za <= 0 else a_d.qmin)
        a[1] = a_d.qmin if za <= 0 else a_d.qmax
        a[2, ::3] = a_d.qmin
        w = np.full((k, 2), w_d.qmin if zw > 0 else w_d.qmax)
        want = (a.astype(np.int64) - za) @ (w.astype(np.int64) - zw)
        wq = qarray.QArray.from_int(w, 1.0, zw, wt)
        aq = qarray.QArray.from_int(da.from_array(a.astype(a_d.storage), chunks=(2, kc)), 1.0, za, dt)
        got = qarray.matmul(aq, wq, scale=float(1 << 20), dtype="qint32", rounding="half_even").compute()
        exact = np.array([[round(Fraction(int(v), 1 << 20)) for v in row] for row in want])
        np.testing.assert_array_equal(got.int_repr(), exact)
        if k == 2000 and dt == "qint16":
            assert np.abs(want).max() > 2**32
        if np.abs(want).max() < 2**31:
            np.testing.assert_array_equal(qarray.matmul(aq, wq).compute().int_repr(), want)


def test_compute_persist_and_the_collection_protocol():
    dq = qarray.quantize(da.from_array(X, chunks=5), 0.02, 0, "qint8", axis=1, block_size=None)
    q = qarray.quantize(X, 0.02, 0, "qint8", axis=1)
    a, b = dask.compute(dq, dq.dequantize())
    assert isinstance(a, qarray.QArray) and a.backend == "numpy"
    np.testing.assert_array_equal(a.int_repr(), q.int_repr())
    np.testing.assert_array_equal(b, q.dequantize())
    p = dq.persist()
    assert p.backend == "dask" and isinstance(p.data, da.Array)
    _same(p, q)
    assert q.compute() is q and q.persist() is q  # in memory already
    assert dask.base.tokenize(dq) == dask.base.tokenize(dq) != dask.base.tokenize(dq.requantize(0.5, 0))
    np.testing.assert_array_equal(dq.to("numpy").int_repr(), q.int_repr())
    _same(q.to("dask"), q)


def test_ops_stay_lazy():
    """Building a graph computes nothing; quantize_dynamic computes its min/max once."""
    import dask.threaded

    calls = []

    def counting(dsk, keys, **kw):
        calls.append(keys)
        return dask.threaded.get(dsk, keys, **kw)

    dx = da.from_array(X, chunks=6)
    w = qarray.quantize(X[:7], 0.05, 0, "qint8")
    with dask.config.set(scheduler=counting):
        dq = qarray.quantize(dx, 0.03, 0, "qint8", axis=1, block_size=4)
        r = qarray.quantize(dx, 0.03, 0, "qint8")
        for y in (dq.dequantize(), r.requantize(0.1, 0), qarray.add(r, r, scale=0.1), qarray.relu(r),
                  qarray.sigmoid(r), qarray.cat([r, r], scale=0.1, zero_point=0),
                  qarray.linear(r, w, scale=1.0, zero_point=0, dtype="qint8"), qarray.sum(r), qarray.sum(r, axis=1),
                  qarray.sum(r, axis=0, scale=0.5, zero_point=0), qarray.mean(r, axis=1),
                  qarray.quantize(da.ones((2, 64), np.float32, chunks=1), dtype="Q8_0").dequantize()):
            assert isinstance(getattr(y, "data", y), da.Array)
        assert calls == []
        qarray.quantize_dynamic(dx, "qint8", axis=1, block_size=4)
        assert len(calls) == 1


def test_a_sum_beyond_int32_raises_when_computed():
    """The qint32 range check of a sum without output parameters runs in the graph, chunk by chunk."""
    big = qarray.quantize(da.full((40000, 600), 100.0, np.float32, chunks=(10000, 600)), 1.0, 0, "qint8")
    s = qarray.sum(big)  # 2.4e9: beyond int32
    with pytest.raises(ValueError, match="sum: the exact result reaches 2400000000, beyond qint32"):
        s.compute()
    assert int(qarray.sum(big[:100]).compute().int_repr()) == 100 * 600 * 100


def test_on_a_local_cluster(client):
    """The same bit-for-bit results from two worker processes."""
    s, z = _params(dict(axis=1, block_size=4))
    z = np.clip(z, -8, 7)
    dx = da.from_array(X, chunks=(5, 3))
    _same(qarray.quantize(dx, s, z, "qint4", axis=1, block_size=4), qarray.quantize(X, s, z, "qint4", axis=1, block_size=4))
    _same(qarray.quantize_dynamic(dx, "quint8", axis=0), qarray.quantize_dynamic(X, "quint8", axis=0))
    w = qarray.quantize_dynamic(X[:9], "qint8", symmetric=True, axis=0)
    q, dq = qarray.quantize(X, 0.03, 0, "qint8"), qarray.quantize(dx, 0.03, 0, "qint8")
    _same(qarray.linear(dq, w, scale=0.5, zero_point=0), qarray.linear(q, w, scale=0.5, zero_point=0))
    _same(qarray.sigmoid(dq), qarray.sigmoid(q))
    # layers keep their weights packed for the CPU engine, with onnxruntime
    # sessions that do not pickle: the workers get codes and pack them there
    lin = qarray.nn.Linear(w)
    _same(lin(dq, scale=0.5, zero_point=0), lin(q, scale=0.5, zero_point=0))
    rng = np.random.default_rng(3)
    conv = qarray.nn.Conv2d.from_float(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), padding=1)
    xc = rng.standard_normal((5, 4, 7, 6)).astype(np.float32)
    qc, dqc = (qarray.quantize(v, 0.03, 5, "quint8") for v in (xc, da.from_array(xc, chunks=(2, 4, 7, 6))))
    _same(conv(dqc, scale=0.4, zero_point=2, dtype="quint8"), conv(qc, scale=0.4, zero_point=2, dtype="quint8"))
    assert client.run(lambda: 1)  # the workers answered: the graph ran there


def test_errors():
    dq = qarray.quantize(da.from_array(X, chunks=5), 0.02, 0, "qint8")
    with pytest.raises(TypeError, match=r"matmul/linear with Dask data takes 2-D weights \(K, N\), got shape "):
        qarray.matmul(dq, qarray.quantize(da.from_array(X[None], chunks=5), 0.02, 0, "qint8"))
    bad = da.from_array(np.float32([1, np.nan, 2]), chunks=1)
    q = qarray.quantize(bad, 0.1, 0, "qint8")  # lazy: the data is seen at compute
    with pytest.raises(ValueError, match="NaN"):
        q.compute()


# -- Zarr ---------------------------------------------------------------------------
ALL = ["qint8", "quint8", "qint4", "quint4", "qint2", "quint2", "qint16", "quint16", "qint32",
       "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]


@pytest.mark.parametrize("dt", ALL)
@pytest.mark.parametrize("kw", [dict(), dict(axis=1), dict(axis=0, block_size=5), dict(axis=1, block_size=4)])
def test_zarr_round_trip_is_exact(tmp_path, dt, kw):
    q = qarray.quantize_dynamic(X, dt, **kw) if dt != "qint32" else qarray.quantize(X, 1e-6, 7, dt, **kw)
    dq = qarray.QArray.from_int(da.from_array(q.int_repr(), chunks=(4, 3)), q.scale, q.zero_point, dt, q.axis,
                                q.block_size) if q.dtype.kind != "float" else qarray.quantize_dynamic(
                                    da.from_array(X, chunks=(4, 3)), dt, **kw)
    for i, src in enumerate((q, dq)):
        path = tmp_path / f"s{i}.zarr"
        to_zarr(src, path)
        r = from_zarr(path)
        assert isinstance(r.data, da.Array)
        _same(r, q)
    to_zarr(q, tmp_path / "c.zarr", chunks=(19, 23))
    _same(from_zarr(tmp_path / "c.zarr"), q)


def test_zarr_mx_nvfp4_and_0d(tmp_path):
    for q in (qarray.quantize_mx(X[:, :16], "mxfp4"), qarray.quantize_nvfp4(X[:, :16]),
              qarray.quantize(np.float32(0.5), 0.1, -3, "qint8")):
        to_zarr(q, tmp_path / "m")
        r = from_zarr(tmp_path / "m").compute()
        np.testing.assert_array_equal(r.dequantize(), q.dequantize())
        assert r.global_scale == q.global_scale and r.scale.dtype == q.scale.dtype
        with pytest.raises(ValueError, match="already holds data; pass overwrite=True"):
            to_zarr(q, tmp_path / "m")
        to_zarr(q, tmp_path / "m", overwrite=True)
        import shutil

        shutil.rmtree(tmp_path / "m")


def test_zarr_writes_from_a_cluster(client, tmp_path):
    dq = qarray.quantize(da.from_array(X, chunks=(3, 8)), 0.02, 0, "qint4")
    to_zarr(dq, tmp_path / "w.zarr")
    _same(from_zarr(tmp_path / "w.zarr"), qarray.quantize(X, 0.02, 0, "qint4"))


def test_damaged_and_foreign_stores(tmp_path):
    q = qarray.quantize(X, 0.02, 0, "qint4", axis=1)
    good = tmp_path / "g.zarr"
    to_zarr(q, good)

    def damaged(change):
        import shutil

        path = tmp_path / "d.zarr"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(good, path)
        change(zarr.open_group(path, mode="r+"))
        return path

    with pytest.raises(ValueError, match="holds no Zarr group"):
        from_zarr(tmp_path / "nothing")
    foreign = zarr.open_group(tmp_path / "f.zarr", mode="w")
    foreign.create_array("codes", shape=(2,), dtype="u1")
    with pytest.raises(ValueError, match="attribute 'qarray' is missing"):
        from_zarr(tmp_path / "f.zarr")
    meta = json.loads(zarr.open_group(good).attrs["qarray"])
    for change, match in [
        (lambda g: g.attrs.update(qarray="{not json"), r"field zarr.meta is invalid: not JSON"),
        (lambda g: g.attrs.update(qarray=json.dumps({**meta, "version": 9})), r"field zarr.meta is invalid: version 9"),
        (lambda g: g.attrs.update(qarray=json.dumps({**meta, "dtype": "qint3"})), r"field zarr.meta is invalid: dtype"),
        (lambda g: g.attrs.update(qarray=json.dumps({**meta, "shape": [20, 23]})), r"field zarr.codes is invalid"),
        (lambda g: g.attrs.update(qarray=json.dumps({**meta, "shape": [19, 24]})), r"field zarr.scale is invalid: scale has shape \(23,\)"),
        (lambda g: g.attrs.update(qarray=7), r"field zarr.meta is invalid: expected a JSON string"),
        (lambda g: g.__delitem__("scale"), r"field zarr.scale is invalid: missing"),
        (lambda g: g.create_array("zero_point", shape=(3,), dtype="i4", overwrite=True), r"field zarr.scale is invalid"),
        (lambda g: g.create_array("scale", shape=(23,), dtype="f8", overwrite=True),
         r"field zarr.scale is invalid: dtype float64, expected float32"),
        (lambda g: g.create_array("codes", shape=(19, 12), dtype="i1", overwrite=True),
         r"field zarr.codes is invalid: int8 \(19, 12\), expected uint8 \(19, 12\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            from_zarr(damaged(change))


@pytest.mark.parametrize("chunks", [(1, 1), (4, 5), ((3, 16), (2, 9, 12))])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_observers_on_dask_data_equal_the_in_memory_ones(chunks, axis):
    """update(dask_x): per-chunk statistics combined in a tree; the parameters
    (MinMax exactly) and the histogram counts (bin for bin) as for the array in memory."""
    from qarray import observers

    y = X * np.float32(7)
    for make in (lambda: observers.MinMax("qint8", axis=axis),
                 lambda: observers.MovingAverageMinMax("quint8", axis=axis),
                 lambda: observers.Histogram("quint8", method="percentile", bins=64, axis=axis),
                 lambda: observers.Histogram("qint8", method="mse", bins=128, symmetric=True, axis=axis)):
        mem, lazy = make(), make()
        for batch in (X, y):
            mem.update(batch)
            lazy.update(da.from_array(batch, chunks=chunks))
        for a, b in zip(lazy.qparams(), mem.qparams()):
            np.testing.assert_array_equal(a, b)
        if hasattr(mem, "counts"):
            np.testing.assert_array_equal(lazy.counts, mem.counts)
            np.testing.assert_array_equal(lazy.exponent, mem.exponent)


@pytest.mark.parametrize("chunks", [(1, 1), (4, 5), ((3, 16), (2, 9, 12))])
def test_importance_matrix_on_dask_data_equals_the_in_memory_one(chunks):
    """update(dask_x): each chunk of rows squared and summed exactly, the sums added in a tree (the
    columns split across chunks are joined first): the sums, count and result of the array in memory."""
    from qarray import observers

    mem, lazy = observers.ImportanceMatrix(), observers.ImportanceMatrix()
    for batch in (X, X * np.float32(1e-21)):
        mem.update(batch)
        lazy.update(da.from_array(batch, chunks=chunks))
    mem.update(X.reshape(19, 1, 23))
    lazy.update(da.from_array(X.reshape(19, 1, 23), chunks=(chunks[0], 1, chunks[1])))
    assert lazy.count == mem.count == 57
    np.testing.assert_array_equal(lazy.sums, mem.sums)
    np.testing.assert_array_equal(lazy.result(), mem.result())


def test_observer_on_a_local_cluster(client):
    from qarray import observers

    mem, lazy = observers.Histogram("quint8", bins=256, axis=1), observers.Histogram("quint8", bins=256, axis=1)
    mem.update(X)
    lazy.update(da.from_array(X, chunks=(4, 6)))
    np.testing.assert_array_equal(lazy.counts, mem.counts)


@pytest.mark.parametrize("batch_chunk", [1, 2, 5])
def test_conv2d_over_batch_chunks(batch_chunk):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 4, 9, 8)).astype(np.float32)
    w = qarray.quantize(rng.standard_normal((6, 2, 3, 3)).astype(np.float32), rng.uniform(0.01, 0.03, 6).astype(np.float32),
                        0, "qint8", axis=0)
    q = qarray.quantize(x, 0.03, 4, "quint8")
    dq = qarray.quantize(da.from_array(x, chunks=(batch_chunk, 3, 4, 5)), 0.03, 4, "quint8")
    for kw in (dict(padding=1, groups=2, scale=0.2, zero_point=3, dtype="quint8", relu=True),
               dict(stride=2, groups=2, bias=rng.standard_normal(6).astype(np.float32)), dict(dilation=2, groups=2)):
        _same(qarray.conv2d(dq, w, **kw), qarray.conv2d(q, w, **kw))
    for c in (q, qarray.quantize(x, np.float32([0.03, 0.02, 0.05, 0.04]), 4, "quint8", axis=1)):  # per-channel too
        dc = qarray.QArray._new(da.from_array(c.data, chunks=(batch_chunk, 3, 4, 5)), c.scale, c.zero_point, c.dtype, c.axis)
        _same(qarray.max_pool2d(dc, 3, stride=2, padding=1), qarray.max_pool2d(c, 3, stride=2, padding=1))
        _same(qarray.max_pool2d(dc[0], 2), qarray.max_pool2d(c[0], 2))  # CHW
    _same(qarray.avg_pool2d(dq, 2, padding=1, count_include_pad=False), qarray.avg_pool2d(q, 2, padding=1, count_include_pad=False))
    _same(qarray.avg_pool2d(dq[0], 3, scale=0.05, zero_point=1), qarray.avg_pool2d(q[0], 3, scale=0.05, zero_point=1))
    _same(qarray.adaptive_avg_pool2d(dq, (2, None)), qarray.adaptive_avg_pool2d(q, (2, None)))


@pytest.mark.parametrize("extra", [[], ["--per-channel", "0"], ["--observer", "mse"],
                                   ["--block-size", "16", "--dtype", "qint4"], ["--scheduler", "processes"]])
def test_cli_quantize_to_zarr_equals_the_in_memory_file(tmp_path, capsys, extra):
    """``qarray quantize IN.safetensors -o OUT.zarr`` (read lazily, written tensor by
    tensor) writes what ``-o OUT.npz`` writes, and shows the same table."""
    from safetensors.numpy import save_file

    from qarray import cli

    rng = np.random.default_rng(0)
    arrays = {"fc1.weight": rng.standard_normal((300, 70)).astype(np.float32),
              "fc1.bias": rng.standard_normal(300).astype(np.float32) * 0.1,
              "steps": np.arange(5, dtype=np.int64), "enc/w": rng.standard_normal((4, 3, 5)).astype(np.float32)}
    save_file(arrays, tmp_path / "m.safetensors")
    assert cli.main(["quantize", str(tmp_path / "m.safetensors"), "-o", str(tmp_path / "m.zarr"), *extra]) == 0
    lazy = capsys.readouterr().out
    if "--scheduler" not in extra:
        assert cli.main(["quantize", str(tmp_path / "m.safetensors"), "-o", str(tmp_path / "m.npz"), *extra]) == 0
        table = capsys.readouterr().out
        # the same rows; "bytes after" aside: a store packs 4-bit codes by rows (a row of 5 in 3 bytes)
        rows = [sorted(line.rsplit("│", 2)[0] for line in out.splitlines() if "│" in line) for out in (lazy, table)]
        assert rows[0] == rows[1] and len(rows[0]) >= 4
    else:
        assert cli.main(["quantize", str(tmp_path / "m.safetensors"), "-o", str(tmp_path / "m.npz")]) == 0
    for name, want in qarray.load(tmp_path / "m.npz").items():
        if isinstance(want, qarray.QArray):
            _same(from_zarr(tmp_path / "m.zarr" / name), want)
        else:
            np.testing.assert_array_equal(zarr.open_group(tmp_path / "m.zarr")[name][...], want)
    # the store as a whole: qarray.load (lazy), qarray inspect, from_zarr on a passed-through array
    whole = qarray.load(tmp_path / "m.zarr")
    assert whole.keys() == qarray.load(tmp_path / "m.npz").keys()
    for name, want in qarray.load(tmp_path / "m.npz").items():
        got = whole[name]
        if isinstance(want, qarray.QArray):
            assert got.backend == "dask"
            _same(got, want)
        else:
            assert isinstance(got, da.Array)
            np.testing.assert_array_equal(got.compute(), want)
    assert cli.main(["inspect", str(tmp_path / "m.zarr")]) == 0
    listed = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "│" in line}
    assert set(listed) == set(whole) and "plain array" in listed["steps"]
    with pytest.raises(ValueError, match=r"holds a Zarr array, not a QArray \(an array passed through as it was\): "
                                         r"read it with dask\.array\.from_zarr, or all of a store with qarray\.load"):
        from_zarr(tmp_path / "m.zarr" / "steps")
    # a run that succeeds replaces an existing store (written beside it, then renamed into place)
    assert cli.main(["quantize", str(tmp_path / "m.safetensors"), "-o", str(tmp_path / "m.zarr"), "--dtype",
                     "quint8"]) == 0
    capsys.readouterr()
    assert from_zarr(tmp_path / "m.zarr" / "fc1.weight").dtype == qarray.quint8
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    assert cli.main(["quantize", str(tmp_path / "m.safetensors"), "-o", str(tmp_path / "q.safetensors"), *extra]) == 0
    assert_same(qarray.load(tmp_path / "q.safetensors"), qarray.load(tmp_path / "m.npz"))


def test_a_damaged_zarr_chunk_is_a_value_error_naming_the_array(tmp_path, rng):
    """A truncated chunk file: ValueError naming the store and the array when the
    chunk is read (zarr's own codec error was a RuntimeError), for a QArray's codes
    and for a plain array of a store."""
    from qarray.zarr import from_zarr

    q = qarray.quantize(rng.standard_normal((64, 64)).astype(np.float32), 0.02, 0, "qint8")
    qarray.to_zarr(q, tmp_path / "q.zarr", chunks=(32, 32))
    assert qarray.from_zarr is from_zarr  # at the top level too
    _same(qarray.from_zarr(tmp_path / "q.zarr"), q)
    chunk = sorted(p for p in (tmp_path / "q.zarr" / "codes").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'q.zarr'))}: array 'codes' cannot be read: "):
        from_zarr(tmp_path / "q.zarr").compute()
    z = zarr.open_group(tmp_path / "s.zarr", mode="w")
    z.create_array("plain", shape=(64,), chunks=(16,), dtype=np.int64)[...] = np.arange(64)
    chunk = sorted(p for p in (tmp_path / "s.zarr" / "plain").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    chunk.write_bytes(chunk.read_bytes()[:5])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 's.zarr'))}: array 'plain' cannot be read: "):
        qarray.load(tmp_path / "s.zarr")["plain"].compute()


def test_weights_read_lazily_from_a_store_are_taken(tmp_path, rng):
    """Weights read with from_zarr are Dask QArrays: matmul and linear take them
    (read once, when packed: they refused with "compute the weights first"), with
    Dask or in-memory activations, bit for bit the in-memory result."""
    x = rng.standard_normal((40, 24)).astype(np.float32)
    w = qarray.quantize(rng.standard_normal((12, 24)).astype(np.float32), np.linspace(0.01, 0.03, 12, dtype=np.float32),
                        0, "qint8", axis=0)
    qarray.to_zarr(w, tmp_path / "w.zarr")
    lazy_w = qarray.from_zarr(tmp_path / "w.zarr")
    q = qarray.quantize(x, 0.05, 3, "quint8")
    dq = qarray.quantize(da.from_array(x, chunks=(16, 24)), 0.05, 3, "quint8")
    out = dict(scale=0.2, zero_point=1, dtype="qint8")
    want = qarray.linear(q, w, **out)
    _same(qarray.linear(dq, lazy_w, **out), want)
    got = qarray.linear(q, lazy_w, **out)  # in-memory activations: the weights are read, the result in memory
    got = got.compute() if got.backend == "dask" else got
    np.testing.assert_array_equal(got.int_repr(), want.int_repr())
    _same(qarray.matmul(dq, lazy_w.T), qarray.matmul(q, w.T))
