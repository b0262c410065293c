"""The one parameter layout (``qarray._params.Layout``) and what it buys: the
generic primitives and the pooling ops work in bounded pieces, with the same
bits as the Numba kernels and as one pass, and peak memory stays near input +
output (``benchmarks/bench_memory.py`` measures it at 2**26 elements)."""

import importlib.util
import tracemalloc

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray._params import Layout, expand, param_shape
from qarray.backends import Backend

HAVE_NUMBA = importlib.util.find_spec("numba") is not None

LAYOUTS = [((), None, None), ((5,), None, None), ((4097,), None, None), ((3, 4, 5), 1, None),
           ((6, 7), 1, None), ((6, 7), 0, 3), ((2, 9, 3), 1, 2), ((40, 129), 1, 32), ((4, 32), 1, 8),
           ((1, 9, 1), 2, None), ((7, 30, 9), 2, 4), ((3, 5), 1, 8)]


@pytest.fixture
def chunk(monkeypatch):
    """Set the generic code's piece size."""
    def set_chunk(n):
        monkeypatch.setattr(Backend, "chunk", n)
    return set_chunk


def test_layout_fields():
    lay = Layout((2, 5), 1, 2)  # the docstring's example
    assert (lay.dims, lay.pshape, lay.step) == ((2, 5, 1), (2, 3, 1), 2)
    np.testing.assert_array_equal(lay.bidx(), [0, 0, 1, 1, 2])
    assert lay.ints == (5, 1, 3, 1, 1) and lay.size == 10
    per_tensor = Layout((3, 4))
    assert per_tensor.dims == (1, 1, 12) and per_tensor.pshape == (1, 1, 1) and per_tensor.ints == (1, 12, 1, 1, 0)
    assert Layout((0, 4)).ints == (1, 1, 1, 1, 0)  # inner at least 1: the CUDA code divides by it
    per_axis = Layout((3, 4, 5), 1)
    assert per_axis.dims == (3, 4, 5) and per_axis.pshape == (1, 4, 1) and per_axis.ints == (4, 5, 4, 1, 0)
    assert Layout((3, 4, 5), 1, 3).pshape == (3, 2, 5) and Layout((3, 4, 5), 2, 2).pshape == (12, 3, 1)
    assert per_axis.compact(np.arange(4)).shape == (1, 4, 1)


@pytest.mark.parametrize("shape,axis,block_size", LAYOUTS)
@pytest.mark.parametrize("cols", [None, 4])
def test_layout_pieces_and_chunks_find_every_parameter(shape, axis, block_size, cols):
    """Every element, reached through ``pieces`` and then ``chunks``, finds the
    parameter that ``expand`` (the broadcasting helper) gives it."""
    params = np.arange(int(np.prod(param_shape(shape, axis, block_size), dtype=np.int64))).reshape(
        param_shape(shape, axis, block_size))
    want = np.broadcast_to(expand(params, shape, axis, block_size), shape).reshape(-1)
    got = np.full(want.size, -1)
    covered = 0
    for sl, lay in Layout(shape, axis, block_size).pieces(cols):
        piece = np.arange(want.size)[sl].reshape(lay.outer * lay.n, lay.inner)
        p2 = lay.compact(params).reshape(lay.pouter * lay.blocks, lay.pinner)
        b = lay.bidx()
        for o in range(lay.outer):  # the kernels' indexing: (o or 0, bidx[l], i or 0)
            for l in range(lay.n):
                for i in range(lay.inner):
                    pr = (o if lay.pouter > 1 else 0) * lay.blocks + b[l]
                    assert p2[pr, i if lay.pinner > 1 else 0] == want[piece[o * lay.n + l, i]]
        for limit in (1, 3, 8, 1 << 16):
            seen = np.zeros(piece.shape, int)
            for r, c, prow in lay.chunks(limit):
                block = piece[r, c]
                assert block.size <= limit
                seen[r, c] += 1
                pc = c if lay.pinner > 1 else slice(None)
                got[block] = np.broadcast_to(p2[prow, pc], block.shape)
            assert (seen == 1).all()
        covered += piece.size
    assert covered == want.size
    np.testing.assert_array_equal(got, want)


def _bits(a):
    return np.atleast_1d(a).view(np.uint8)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("shape,axis,block_size", LAYOUTS)
@pytest.mark.parametrize("size", [1, 7, 64])
def test_generic_pieces_match_the_kernels(shape, axis, block_size, size, chunk, rng):
    x = (rng.standard_normal(shape) * 40).astype(np.float32)
    ps = param_shape(shape, axis, block_size)
    s = rng.uniform(0.05, 0.5, ps).astype(np.float32)
    z = rng.integers(-20, 20, ps).astype(np.int32)
    s2 = (s * np.float32(2.7)).astype(np.float32)

    def run():
        q = qarray.quantize(x, s, z, "qint8", axis, block_size)
        q16 = qarray.quantize(x.astype(np.float16), s, z, "qint16", axis, block_size)
        q64 = qarray.quantize(x.astype(np.float64), s, z, "qint32", axis, block_size)
        out = [q.data, q16.data, q64.data] + [q.dequantize(t) for t in ("float16", "float32", "float64")]
        out += [qarray.requantize(q64, s2, z, "qint8", axis, block_size, rounding=r).data
                for r in ("half_even", "half_away", "half_up", "tflite")]
        out.append(qarray.requantize(q64, s2, z, "qint8", axis, block_size, mode="float").data)
        out.append(qarray.quantize_dynamic(x, "quint8", axis=axis, block_size=block_size).data)
        return out

    with qarray.config.using(numba=True):
        want = run()
    chunk(size)
    with qarray.config.using(numba=False):
        got = run()
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_generic_requantize_into_a_strided_out(chunk, rng):
    chunk(5)
    q = QArray.from_int(rng.integers(-1000, 1000, (6, 8)), 0.01, 3, "qint32")
    with qarray.config.using(numba=False):
        want = q.requantize(0.3, 1, "qint8").int_repr()
        buf = np.zeros((6, 16), np.int8)
        r = qarray.requantize(q, 0.3, 1, "qint8", out=buf[:, ::2])
    assert r.data.base is buf
    np.testing.assert_array_equal(buf[:, ::2], want)
    assert not buf[:, 1::2].any()


def test_generic_nan_error_from_a_later_piece(chunk):
    chunk(4)
    x = np.zeros(50, np.float32)
    x[[37, 41]] = np.nan
    with qarray.config.using(numba=False), pytest.raises(ValueError, match=r"2 NaN value\(s\), the first at index \(37,\)"):
        qarray.quantize(x, 0.1)


@pytest.mark.parametrize("k,s,p,include_pad", [(2, None, 0, True), (3, 1, 1, True), (3, 2, 1, False), (4, 3, 2, False),
                                               ((2, 3), (1, 2), (1, 1), True)])
@pytest.mark.parametrize("size", [1, 5, 40])
def test_avg_pool2d_in_pieces(k, s, p, include_pad, size, chunk, rng):
    q = QArray.from_int(rng.integers(0, 256, (2, 3, 9, 7)), 0.1, 117, "quint8")
    kw = dict(count_include_pad=include_pad)
    want = [qarray.avg_pool2d(q, k, s, p, **kw), qarray.avg_pool2d(q, k, s, p, scale=0.03, zero_point=-4, dtype="qint8", **kw),
            qarray.avg_pool2d(q, k, s, p, scale=0.03, mode="float", **kw)]
    chunk(size)
    got = [qarray.avg_pool2d(q, k, s, p, **kw), qarray.avg_pool2d(q, k, s, p, scale=0.03, zero_point=-4, dtype="qint8", **kw),
           qarray.avg_pool2d(q, k, s, p, scale=0.03, mode="float", **kw)]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a.int_repr(), b.int_repr())


def _peak_ratio(make, op):
    """Peak traced memory during ``op(make())``, the input included, over input + output bytes."""
    tracemalloc.start()
    try:
        x = make()
        tracemalloc.reset_peak()
        y = op(x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    nbytes = [(v.data if isinstance(v, QArray) else v).nbytes for v in (x, y)]
    return peak / sum(nbytes)


N = 1 << 20


def _ints(n=N, dtype="qint8"):
    return QArray.from_int(np.resize(np.arange(-100, 100, dtype=np.int32), n), 0.01, 3, dtype)


def _floats(n=N):
    return np.resize(np.arange(-1000, 1000, dtype=np.float32) * np.float32(0.013), n)


MEMORY_CASES = {
    "quantize": (_floats, lambda x: qarray.quantize(x, 0.01, 3)),
    "quantize per-axis": (lambda: _floats().reshape(1024, -1), lambda x: qarray.quantize(x, np.full(1024, 0.01), 0, axis=1)),
    "quantize blocked": (lambda: _floats().reshape(1024, -1), lambda x: qarray.quantize(x, np.full((1024, 32), 0.01), 0, axis=1, block_size=32)),
    "dequantize": (_ints, lambda q: q.dequantize()),
    "requantize": (lambda: _ints(dtype="qint32"), lambda q: q.requantize(0.05, 1, "qint8")),
    "quantize_dynamic": (_floats, lambda x: qarray.quantize_dynamic(x)),
    "quantize_dynamic blocked": (lambda: _floats().reshape(1024, -1), lambda x: qarray.quantize_dynamic(x, axis=0, block_size=100)),
    "sum": (_ints, qarray.sum),
    "mean": (_ints, qarray.mean),
    "avg_pool2d": (lambda: _ints().reshape(1, 16, 256, 256), lambda q: qarray.avg_pool2d(q, 2)),
}


@pytest.mark.parametrize("path", ["numba", "generic"])
@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_peak_memory_stays_near_input_plus_output(case, path, chunk, monkeypatch):
    """At most 1.5x (input + output): the generic code and the ops hold no full-size temporaries."""
    if path == "numba" and not HAVE_NUMBA:
        pytest.skip("numba is not installed")
    from qarray.backends import numpy as np_backend

    monkeypatch.setattr(np_backend, "_SMALL", 1 << 14)  # the library's threshold: big arrays take the kernels
    chunk(1 << 12)  # pieces small against N, so the bound holds at this size
    make, op = MEMORY_CASES[case]
    with qarray.config.using(numba=path == "numba"):
        op(make())  # warm-up (Numba's cache, imports)
        assert _peak_ratio(make, op) <= 1.5


@pytest.mark.parametrize("shape,axis,block_size", [((0, 4), 1, 2), ((4, 0), 0, 2), ((3, 0, 2), 2, 1), ((0,), None, None)])
def test_empty_arrays_with_any_parameters(shape, axis, block_size, kernels):
    ps = param_shape(shape, axis, block_size)
    q = qarray.quantize(np.zeros(shape, np.float32), np.ones(ps, np.float32), 0, "qint8", axis, block_size)
    assert q.shape == shape and q.dequantize().shape == shape
    assert qarray.requantize(q, np.full(ps, 0.5, np.float32), 0, "qint4", axis, block_size).shape == shape
