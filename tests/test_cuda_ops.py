"""The kernels of qarray/backends/cuda/ops.cu (clip, pack/unpack, binary, strided
requantize), host-run through the harness of tests/cuda_host, against the NumPy
backend bit for bit."""

import numpy as np
import pytest
from cuda_host.harness import HOST_GRID

import qarray
from qarray import QArray, qdtype
from qarray._fixed_point import Binary, identity
from qarray.backends import _cuda
from _reference import assert_same, make_rq, numpy_and_host

TAIL = _cuda.BLOCK * HOST_GRID * 64 + 77  # more than one grid covers
INT_DTYPES = ["qint2", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"]


def _codes(rng, dtype, shape):
    d = qdtype(dtype)
    return rng.integers(d.qmin, d.qmax, shape, endpoint=True).astype(d.storage)


def _views(x):
    """``x`` itself, a misaligned view and a non-contiguous one (same ndim)."""
    return [x, x[1:], x[::2]] if x.ndim == 1 else [x, x[1:], x[:, ::2]]


def _last_kernel(host, prefix):
    assert host.launches and host.launches[-1][0].startswith(prefix), host.launches[-1:]


# -- clip (relu / clamp) ---------------------------------------------------------
@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("shape", [(37,), (3, 5, 7), (0, 4), (9, 6)])
def test_clip(host, dtype, shape, rng):
    d = qdtype(dtype)
    for x in _views(_codes(rng, dtype, shape)):
        lo, hi = sorted(int(v) for v in rng.integers(d.qmin, d.qmax, 2, endpoint=True))
        for bounds in ((lo, hi), (np.asarray(lo, d.storage), np.asarray(hi, d.storage)), (d.qmin, hi)):
            want, got = numpy_and_host(host, lambda b: b.clip(x, *bounds))
            assert_same(got, want)
            if x.size:
                _last_kernel(host, f"clip_{d.storage.name}")


def test_clip_per_axis_bounds_and_tail(host, rng):
    x = _codes(rng, "qint8", (6, 7))
    lo, hi = rng.integers(-100, 0, (6, 1)).astype(np.int8), rng.integers(0, 100, (1, 7)).astype(np.int8)
    want, got = numpy_and_host(host, lambda b: b.clip(x, lo, hi))  # the generic path
    assert_same(got, want)
    x = _codes(rng, "quint8", TAIL)
    want, got = numpy_and_host(host, lambda b: b.clip(x, 3, 200))
    assert_same(got, want)
    assert host.launches[-1] == ("clip_uint8", HOST_GRID, _cuda.BLOCK)


@pytest.mark.parametrize("fn", [qarray.relu, qarray.relu6, lambda q: qarray.clamp(q, -0.3, None),
                                lambda q: qarray.hardtanh(q, -0.5, 0.25)])
def test_relu_clamp_ops(host, fn, rng):
    x = rng.standard_normal((5, 11)).astype(np.float32)
    q = qarray.quantize(x, 0.02, 7, "qint8")
    h = QArray._new(q.data, q.scale, q.zero_point, q.dtype, None, None, host)
    assert_same(fn(h).int_repr(), fn(q).int_repr())
    _last_kernel(host, "clip_int8")


# -- pack / unpack -------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["qint2", "quint2", "qint4", "quint4"])
@pytest.mark.parametrize("n", [0, 1, 3, 5, 37, 2 * _cuda.BLOCK + 1])
def test_pack_unpack(host, dtype, n, rng):
    d = qdtype(dtype)
    for x in _views(_codes(rng, dtype, (n + 4,))):
        packed, got = numpy_and_host(host, lambda b: b.pack(x, d.bits))
        assert_same(got, packed)
        for count in (x.size, max(x.size - 1, 0), x.size + 3):
            want, got = numpy_and_host(host, lambda b: b.unpack(packed, d.bits, d.signed, count))
            assert_same(got, want)
        np.testing.assert_array_equal(host.unpack(packed, d.bits, d.signed, x.size), x)


def test_pack_unpack_2d_and_tail(host, rng):
    x = _codes(rng, "qint4", (7, 9))[:, 1:]  # non-contiguous, 2-D
    want, got = numpy_and_host(host, lambda b: b.pack(x, 4))
    assert_same(got, want)
    x = _codes(rng, "quint2", 4 * TAIL - 1)
    want, got = numpy_and_host(host, lambda b: b.pack(x, 2))
    assert_same(got, want)
    assert host.launches[-1] == ("pack_bits", HOST_GRID, _cuda.BLOCK)
    back = host.unpack(got, 2, False, x.size)
    assert host.launches[-1] == ("unpack_bits", HOST_GRID, _cuda.BLOCK)
    assert_same(back, x)


# -- binary (add / sub / mul) ------------------------------------------------------
SHAPES = [((37,), (37,)), ((3, 5, 7), ()), ((), (4, 6)), ((6, 5), (5,)), ((5,), (2, 3, 5)), ((1, 5), (6, 5)),
          ((3, 1), (3, 4)),  # not a trailing broadcast: the generic path
          ((0, 3), (3,))]
PAIRS = [("qint8", "quint8"), ("quint4", "qint16"), ("quint16", "qint32"), ("qint32", "qint32")]


def _binary_cases(rng, pair, sa, sb):
    a, b = _codes(rng, pair[0], sa), _codes(rng, pair[1], sb)
    za, zb = (int(rng.integers(qdtype(t).qmin, qdtype(t).qmax, endpoint=True)) for t in pair)
    return a, za, b, zb


@pytest.mark.parametrize("sa,sb", SHAPES)
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_binary_exact(host, op, pair, sa, sb, rng):
    a, za, b, zb = _binary_cases(rng, pair, sa, sb)
    want, got = numpy_and_host(host, lambda bk: bk.binary(a, b, Binary(op, identity(za), identity(zb))))
    assert_same(got, want)
    if want.size and sb != (3, 4):
        _last_kernel(host, f"binary_{a.dtype.name}_{b.dtype.name}")


@pytest.mark.parametrize("sa,sb", SHAPES[:5])
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
def test_binary_rescaled(host, pair, sa, sb, rounding, rng):
    a, za, b, zb = _binary_cases(rng, pair, sa, sb)
    # one multiplier near 2**19 (add's largest), one with exact ties
    ra, rb = (make_rq(z, 0, m, None, rounding=rounding) for z, m in ((za, rng.uniform(1, 2.0**27)), (zb, 0.5)))
    for op in ("add", "sub"):
        want, got = numpy_and_host(host, lambda bk: bk.binary(a, b, Binary(op, ra, rb)))
        assert_same(got, want)


def test_binary_views_and_tail(host, rng):
    a, za, b, zb = _binary_cases(rng, ("qint8", "quint8"), (9, 8), (9, 8))
    for x in _views(a):
        for y in (b[: x.shape[0], : x.shape[1]], b[-x.shape[0]:, -x.shape[1]:][::-1]):
            want, got = numpy_and_host(host, lambda bk: bk.binary(x, y, Binary("mul", identity(za), identity(zb))))
            assert_same(got, want)
    a, za, b, zb = _binary_cases(rng, ("qint16", "qint8"), (TAIL,), ())
    want, got = numpy_and_host(host, lambda bk: bk.binary(a, b, Binary("sub", identity(za), identity(zb))))
    assert_same(got, want)
    assert host.launches[-1] == ("binary_int16_int8", HOST_GRID, _cuda.BLOCK)


def _requant(rng, shape, out, rounding, relu, axis=None):
    """A Requant for binary: random parameters, per tensor or along ``axis``."""
    d = qdtype(out)
    n = () if axis is None else (shape[axis],)
    zo = rng.integers(d.qmin, d.qmax, n, endpoint=True).astype(np.int32)
    mult = rng.choice([0.5, 0.25, 2.0**-7, 3e-3], n) * rng.choice([1.0, 1.0 + 2.0**-20], n)  # ties and not
    return make_rq(rng.integers(-3, 3, n), zo, mult, d, axis, None, rounding,
                   floor=int(zo) if relu and axis is None else None)


@pytest.mark.parametrize("sa,sb", SHAPES)
@pytest.mark.parametrize("out", ["qint8", "quint8", "qint4", "qint16", "quint16", "qint32"])
@pytest.mark.parametrize("rounding,relu", [(0, False), (1, True), (2, False), (3, True), (None, True)])
def test_binary_requantized_in_one_kernel(host, sa, sb, out, rounding, relu, rng):
    a, za, b, zb = _binary_cases(rng, ("qint8", "quint8"), sa, sb)
    shape = np.broadcast_shapes(sa, sb)
    for op in ("add", "mul"):
        requant = _requant(rng, shape, out, rounding, relu)
        want, got = numpy_and_host(host, lambda bk: bk.binary(a, b, Binary(op, identity(za), identity(zb), requant)))
        assert_same(got, want)
        if want.size and sb != (3, 4):
            assert [n for n, *_ in host.launches][-1:] == ["binary_int8_uint8"]
    if relu:  # the floor is the output zero point: real 0
        assert (want.astype(np.int64) >= int(requant.zp_out)).all()


@pytest.mark.parametrize("axis", [0, 1])
def test_binary_requantized_per_axis_and_rescaled(host, axis, rng):
    a, za, b, zb = _binary_cases(rng, ("quint16", "qint8"), (6, 5), (5,))
    ra, rb = (make_rq(z, 0, m, None, rounding=1) for z, m in ((za, rng.uniform(1, 2.0**27)), (zb, 0.5)))
    for rounding in (0, 3, None):
        requant = _requant(rng, (6, 5), "qint8", rounding, False, axis)
        want, got = numpy_and_host(host, lambda bk: bk.binary(a, b, Binary("sub", ra, rb, requant)))
        assert_same(got, want)
        assert host.launches[-1][0] == "binary_uint16_int8"


@pytest.mark.parametrize("op", [qarray.add, qarray.sub, qarray.mul])
@pytest.mark.parametrize("out", [{}, {"scale": 0.05, "zero_point": 3, "dtype": "qint8"},
                                 {"scale": 0.01, "zero_point": 128, "dtype": "quint8", "relu": True},
                                 {"scale": 0.02, "zero_point": 0, "dtype": "qint8", "rounding": "tflite"}])
def test_binary_ops(host, on_host, op, out, rng):
    x, y = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    a = qarray.quantize(x, 0.03, -5, "qint8")
    b = qarray.quantize(y, 0.03 if not out else 0.07, 120, "quint8")
    assert_same(on_host(lambda: op(a, b, **out)).int_repr(), op(a, b, **out).int_repr())
    assert [name for name, *_ in host.launches] == ["binary_int8_uint8"]  # requantize and ReLU fused


# -- requantize into strided slices (cat) ------------------------------------------
def _requantize_args(rng, q, src, dst, axis=None, rounding=0):
    s, d = qdtype(src), qdtype(dst)
    ps = () if axis is None else (q.shape[axis],)
    zi = rng.integers(s.qmin, min(s.qmax, s.qmin + 50), ps, endpoint=True).astype(np.int32)
    zo = np.full(ps, (d.qmin + d.qmax) // 2, np.int32)
    return (make_rq(zi, zo, rng.uniform(1e-3, 2.0, ps), d, axis, None, rounding),)


@pytest.mark.parametrize("src,dst", [("qint32", "qint8"), ("quint8", "qint4"), ("qint16", "quint16")])
@pytest.mark.parametrize("rounding", [0, 3, None])
@pytest.mark.parametrize("shape,key", [((4, 9), np.s_[:, 2:5]), ((3, 4, 5), np.s_[:, 1:3]), ((3, 4, 5), np.s_[:, :, 1:4]),
                                       ((3, 4, 5), np.s_[1:, 1:3, :]), ((2, 6), np.s_[1:]), ((4, 6), np.s_[:, ::2]),
                                       ((5, 1, 6), np.s_[:, :, 2:]), ((4, 9), np.s_[:, 3:3])])
def test_requantize_into_slices(host, src, dst, rounding, shape, key, rng):
    d = qdtype(dst)
    base = np.zeros(shape, d.storage)
    part_shape = base[key].shape
    for q in (_codes(rng, src, part_shape), _codes(rng, src, part_shape[::-1]).T):
        for axis in (None, len(part_shape) - 1):
            args = _requantize_args(rng, q, src, dst, axis, rounding)
            want = host.requantize(q, *args)
            ref = np.full(shape, 7, d.storage)
            ref[key] = want
            got = np.full(shape, 7, d.storage)
            view = got[key]
            r = host.requantize(q, *args, out=view)
            if view.size and not view.flags.c_contiguous and view.strides[-1] == view.itemsize:
                _last_kernel(host, "requantize_rows_")
            np.testing.assert_array_equal(got, ref)
            np.testing.assert_array_equal(r, want)
            w, _ = numpy_and_host(host, lambda b: b.requantize(q, *args))
            np.testing.assert_array_equal(w, want)


def test_strided_requantize_is_one_kernel_and_tail(host, rng):
    q = _codes(rng, "qint32", (TAIL // 5 + 1, 5))
    out = np.zeros((q.shape[0], 8), np.int8)
    args = _requantize_args(rng, q, "qint32", "qint8")
    host.requantize(q, *args, out=out[:, 2:7])
    assert host.launches[-1] == ("requantize_rows_int32_int8", HOST_GRID, _cuda.BLOCK)
    np.testing.assert_array_equal(out[:, 2:7], qarray.backends.get("numpy").requantize(q, *args))
    assert not out[:, :2].any() and not out[:, 7:].any()


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_cat_through_the_host_backend(host, on_host, axis, rng):
    shapes = [[3, 4, 5], [3, 4, 5], [3, 4, 5]]
    shapes[1][axis], shapes[2][axis] = 2, 1
    xs = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    k = axis % 3
    qs = [qarray.quantize(xs[0], 0.02, 3, "qint8"),
          qarray.quantize(xs[1], rng.uniform(0.01, 0.05, xs[1].shape[k]), 0, "quint8", axis=k),
          qarray.quantize(xs[2], 0.025, -2, "qint8")]  # already the output's: copied
    kw = {"scale": 0.025, "zero_point": -2, "dtype": "qint8"}
    hs = [QArray._new(q.data, q.scale, q.zero_point, q.dtype, q.axis, q.block_size, host) for q in qs]
    assert_same(on_host(lambda: qarray.cat(hs, axis, **kw)).int_repr(), qarray.cat(qs, axis, **kw).int_repr())
    rows = any(name.startswith("requantize_rows_") for name, *_ in host.launches)
    assert rows == (axis % 3 > 0), host.launches


@pytest.mark.parametrize("fn", ["quantize", "dequantize", "requantize", "relu", "add", "clamp"])
def test_zero_d_keeps_its_shape(fn, on_host):
    """CuPy's ascontiguousarray makes a 0-d array 1-d, as NumPy's does: quantize
    gave shape (1,) for a 0-d input, and relu/clamp, whose bounds are quantized
    0-d arrays, fell back to the generic code."""
    x = np.array(0.37, np.float32)
    q = QArray.from_int(np.array(5, np.int8), 0.1, 1, "qint8")
    ops = {"quantize": lambda: qarray.quantize(x, 0.1, 0, "qint8"),
           "dequantize": lambda: q.dequantize(),
           "requantize": lambda: qarray.requantize(q, 0.2, 0, "qint8"),
           "relu": lambda: qarray.relu(q),
           "add": lambda: qarray.add(q, q, scale=0.2, zero_point=0, dtype="qint8"),
           "clamp": lambda: qarray.clamp(q, -0.2, 0.3)}
    r = on_host(ops[fn])
    assert np.shape(r.data if isinstance(r, QArray) else r) == ()
