"""A QArray inside NumPy code (qarray/_protocols.py, the README's table): each
row of the semantics, with exact values and exact error types."""

import numpy as np
import pytest

import qarray
from qarray import QArray


@pytest.fixture
def q():
    x = np.array([[0.5, -1.0, 0.25], [1.0, 2.0, -0.5]], np.float32)
    return qarray.quantize(x, 0.25, 2, "qint8")  # codes [[4, -2, 3], [6, 10, 0]]


@pytest.fixture
def qc():
    x = np.array([[0.5, -1.0, 0.25], [1.0, 2.0, -0.5]], np.float32)
    return qarray.quantize(x, np.array([0.25, 0.5, 0.125], np.float32), 0, "qint8", axis=1)


# -- conversions ---------------------------------------------------------------------
def test_asarray_always_an_ndarray(q):
    for v, want in ((q, q.dequantize()), (q[0, 0], np.float32(0.5)), (q[1], q.dequantize()[1])):
        a = np.asarray(v)
        assert type(a) is np.ndarray and a.dtype == np.float32
        np.testing.assert_array_equal(a, want)
    assert np.asarray(q[0, 0]).shape == ()
    assert np.asarray(q, np.float64).dtype == np.float64
    np.testing.assert_array_equal(q[0, 0], 0.5)  # np.testing on a 0-d QArray


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint8, bool])
def test_asarray_with_an_integer_dtype_points_to_int_repr(q, dtype):
    with pytest.raises(TypeError, match=r"use q.int_repr\(\) for the integer codes"):
        np.asarray(q, dtype)


def test_asarray_without_copy_is_refused(q):
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(q, copy=False)


def test_python_scalars_and_format(q):
    assert float(q[0, 0]) == 0.5 and type(float(q[0, 0])) is float
    assert int(q[1, 1]) == 2 and int(q[0, 1]) == -1 and int(q[0, 2]) == 0  # truncated, as int(numpy.float32)
    assert f"{q[0, 0]:.2f}" == "0.50" and f"{q[1, 1]:+.1e}" == "+2.0e+00"
    assert f"{q}" == str(q)
    assert q[0, 0].item() == 0.5
    with pytest.raises(TypeError, match="only length-1 arrays"):
        float(q)
    with pytest.raises(TypeError, match="only length-1 arrays"):
        int(q[0])
    with pytest.raises(TypeError, match="unsupported format string"):
        f"{q:.2f}"


def test_bool_as_numpy(q):
    assert bool(q[0, 0]) is True and bool(q[0, :1]) is True
    assert bool(qarray.quantize(np.zeros(1, np.float32), 0.1, 0, "qint8")) is False
    with pytest.raises(ValueError, match="more than one element is ambiguous"):
        bool(q)
    with pytest.raises(ValueError, match="empty array is ambiguous"):
        bool(q[:0])


# -- comparisons -----------------------------------------------------------------------
def test_equality_is_elementwise_on_values(q, qc):
    np.testing.assert_array_equal(q == q.copy(), np.ones((2, 3), bool))
    np.testing.assert_array_equal(q == qc, np.ones((2, 3), bool))  # other parameters, same real values
    np.testing.assert_array_equal(q != qc, np.zeros((2, 3), bool))
    np.testing.assert_array_equal(q == 0.5, [[True, False, False], [False, False, False]])
    np.testing.assert_array_equal(q > 0, [[True, False, True], [True, True, False]])
    np.testing.assert_array_equal(0 < q, q > 0)
    np.testing.assert_array_equal(np.greater_equal(q, qc), np.ones((2, 3), bool))
    with pytest.raises(TypeError, match="unhashable"):
        hash(q)


def test_comparisons_are_exact_not_float32(q):
    """Real values compare exactly: 0.1 (float64) is not the float32 0.1 a
    dequantize gives, and a scale whose product with the codes needs more than
    float32's 24 bits still compares right."""
    a = qarray.QArray.from_int(np.array([1]), np.float32(0.1), 0, "qint8")
    assert not bool(a == 0.1) and bool(a == float(np.float32(0.1)))
    s = np.float32(1 + 2**-23)
    b = qarray.QArray.from_int(np.array([2**15 - 1]), s, 0, "qint16")
    exact = (2**15 - 1) * float(s)  # exact in float64, not in float32
    assert bool(b == exact) and not bool(b == float(np.float32(exact)))


def test_wide_codes_compare_with_fractions():
    """32-bit codes beyond float64's exact products go through Fractions."""
    s = np.float32(1 + 2**-23)
    a = qarray.QArray.from_int(np.array([2**31 - 1, 5]), s, 0, "qint32")
    b = qarray.QArray.from_int(np.array([2**31 - 2, 4]), s, -1, "qint32")  # the same real values
    np.testing.assert_array_equal(a == b, [True, True])
    np.testing.assert_array_equal(a > qarray.QArray.from_int(np.array([2**31 - 2, 5]), s, 0, "qint32"), [True, False])


# -- arithmetic raises, naming the op ---------------------------------------------------------
@pytest.mark.parametrize("expr,op", [
    (lambda q: q + q, "qarray.add"), (lambda q: q + 1.0, "qarray.add"), (lambda q: 1.0 + q, "qarray.add"),
    (lambda q: q - q, "qarray.sub"), (lambda q: q * 2, "qarray.mul"), (lambda q: q @ q.T, "qarray.matmul"),
    (lambda q: -q, "qarray.mul_scalar"), (lambda q: abs(q), "qarray.relu"), (lambda q: q / 2, "dequantize first"),
    (lambda q: np.add(q, q), "qarray.add"), (lambda q: np.multiply(q, 2), "qarray.mul"),
    (lambda q: np.add(q, np.ones((2, 3))), "qarray.add"), (lambda q: np.negative(q), "qarray.mul_scalar"),
    (lambda q: np.dot(q, q.T), "qarray.matmul"), (lambda q: np.matmul(q, q.T), "qarray.matmul"),
    (lambda q: np.mean(q), "qarray.mean"), (lambda q: np.sum(q), "qarray.sum"),
    (lambda q: np.exp(q), r"numpy.exp\(q.dequantize\(\)"), (lambda q: np.maximum.reduce(q), "maximum.reduce"),
])
def test_arithmetic_raises_naming_the_op(q, expr, op):
    with pytest.raises(TypeError, match=op):
        expr(q)


def test_unary_plus_copies(q):
    p = +q
    assert p is not q and p.data is not q.data
    np.testing.assert_array_equal(p.int_repr(), q.int_repr())
    np.testing.assert_array_equal(np.positive(q).int_repr(), q.int_repr())


# -- functions that move or select elements ---------------------------------------------------
def test_structural_functions_keep_a_qarray(q, qc):
    codes = q.int_repr()
    for got, want in (
        (np.reshape(q, (3, 2)), codes.reshape(3, 2)), (np.transpose(q), codes.T), (np.moveaxis(q, 0, 1), codes.T),
        (np.swapaxes(q, 0, 1), codes.T), (np.squeeze(q[None]), codes), (np.expand_dims(q, 1), codes[:, None]),
        (np.ravel(q), codes.ravel()), (np.flip(q), codes[::-1, ::-1]), (np.take(q, [2, 0], axis=1), codes[:, [2, 0]]),
        (np.broadcast_to(q[0], (4, 3)), np.broadcast_to(codes[0], (4, 3))), (np.copy(q), codes),
        (np.concatenate([q, q]), np.concatenate([codes, codes])), (np.stack([q, q], 1), np.stack([codes, codes], 1)),
        (np.sort(q), np.sort(codes)), (np.min(q, axis=0), codes.min(0)), (np.max(q), codes.max()),
        (np.where(q > 0, q, q[::-1]), np.where(codes > 2, codes, codes[::-1])),
        (q.ravel(), codes.ravel()), (q.flatten(), codes.ravel()), (q.squeeze(), codes),
    ):
        assert isinstance(got, QArray) and got.scale == q.scale and got.zero_point == q.zero_point
        np.testing.assert_array_equal(got.int_repr(), want)
    assert np.argmax(q) == 4 and np.argmin(q) == 1
    np.testing.assert_array_equal(np.argsort(q, axis=1), np.argsort(codes, axis=1))
    assert np.shape(q) == (2, 3) and np.ndim(q) == 2 and np.size(q) == 6 and np.size(q, 1) == 3
    assert q.nbytes == 6 and q.copy().data is not q.data


def test_per_channel_parameters_follow(qc):
    codes, s = qc.int_repr(), qc.scale
    got = np.take(qc, [2, 0], axis=1)
    assert got.axis == 1
    np.testing.assert_array_equal(got.scale, s[[2, 0]])
    np.testing.assert_array_equal(got.int_repr(), codes[:, [2, 0]])
    got = np.moveaxis(qc, 1, 0)
    assert got.axis == 0
    np.testing.assert_array_equal(np.flip(qc, 1).scale, s[::-1])
    m = np.max(qc, axis=0)  # along another axis: each channel's codes share a scale
    assert m.axis == 0
    np.testing.assert_array_equal(m.int_repr(), codes.max(0))
    np.testing.assert_array_equal(np.broadcast_to(qc, (4, 2, 3)).int_repr(), np.broadcast_to(codes, (4, 2, 3)))
    assert np.broadcast_to(qc, (4, 2, 3)).axis == 2
    c = np.concatenate([qc, qc])  # per-axis parameters that agree join
    assert c.axis == 1 and c.shape == (4, 3)


@pytest.mark.parametrize("expr,match", [
    (lambda qc: np.max(qc), "per-channel or blocked"), (lambda qc: np.argmax(qc, axis=1), "per-channel or blocked"),
    (lambda qc: np.sort(qc, axis=1), "per-channel or blocked"), (lambda qc: np.take(qc, [[0]], axis=1), "1-D index"),
    (lambda qc: np.broadcast_to(qc[:, :1], (2, 3)), "stretch the parameter axis"),
])
def test_per_channel_refusals(qc, expr, match):
    with pytest.raises(TypeError, match=match):
        expr(qc)


def test_joins_and_where_with_other_parameters_name_the_op(q):
    r = q.requantize(0.5, 0, "qint8")
    with pytest.raises(TypeError, match=r"qarray.cat\(qs, axis, scale=\.\.\."):
        np.concatenate([q, r])
    with pytest.raises(TypeError, match=r"qarray.stack\(qs, axis, scale=\.\.\."):
        np.stack([q, r])
    with pytest.raises(TypeError, match="same parameters"):
        np.where(q > 0, q, r)


def test_exact_answers(q, qc):
    x = q.dequantize()
    assert np.array_equal(q, qc) and np.array_equal(q, x) and not np.array_equal(q, x + 1)
    assert not np.array_equal(q, x[0])  # shapes differ
    assert np.allclose(q, x) and not np.allclose(q, x + 1e-3)
    np.testing.assert_array_equal(np.isclose(q, qc), np.ones((2, 3), bool))


# -- methods and dtypes ----------------------------------------------------------------------
def test_astype_and_tolist(q):
    np.testing.assert_array_equal(q.astype(np.float64), q.dequantize("float64"))
    assert q.astype("float16").dtype == np.float16
    for bad in ("qint8", np.int8, "int32", qarray.quint8):
        with pytest.raises(TypeError, match=r"q.requantize\(scale, zero_point, dtype\)"):
            q.astype(bad)
    assert q.tolist() == [[0.5, -1.0, 0.25], [1.0, 2.0, -0.5]]
    assert q[0, 0].tolist() == 0.5


def test_qdtype_equals_its_name(q):
    assert q.dtype == "qint8" and q.dtype != "quint8" and q.dtype != "int8" and q.dtype == qarray.qint8
    assert q.dtype != 8 and {qarray.qint8: 1}["qint8" if False else qarray.qint8] == 1
    assert hash(qarray.qint8) == hash("qint8")


def test_device_qarrays_refuse_implicit_conversion(q):
    from qarray.backends import _base

    class Device(_base.Backend):
        name = "device"

    d = QArray._new(q.data, q.scale, q.zero_point, q.dtype, None, None, Device(np))
    with pytest.raises(TypeError, match=r"use .get\(\) first"):
        np.asarray(d)


def test_matplotlib_hist_takes_a_qarray():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = qarray.quantize(np.linspace(-1, 1, 50).astype(np.float32), 0.05, 0, "qint8")
    counts, edges, _ = plt.hist(q, bins=5)
    want, want_edges = np.histogram(q.dequantize(), bins=5)
    np.testing.assert_array_equal(counts, want)
    np.testing.assert_array_equal(edges, want_edges)
    plt.close("all")
