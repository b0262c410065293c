import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qarray
from qarray import qdtype

from _reference import ref_bits, ref_philox

SMALL = ["qint2", "quint2", "qint4", "quint4", "qint8", "quint8"]
ALL = SMALL + ["qint16", "quint16", "qint32"]


def ref_rounded(x, scale, zp):
    """Independent reference of ``rint(x / scale) + zp`` before any clamp (Python
    ints, +-inf): float64 division rounded once to float32 is the correctly
    rounded float32 quotient; Python's round() is half-even."""
    out = []
    for v, s, z in zip(np.ravel(x), np.ravel(np.broadcast_to(scale, np.shape(x))), np.ravel(np.broadcast_to(zp, np.shape(x)))):
        if np.asarray(x).dtype == np.float64:
            t = float(v) / float(np.float32(s))
        else:
            t = float(np.float32(float(np.float32(v)) / float(np.float32(s))))
        out.append(round(t) + int(z) if math.isfinite(t) else math.copysign(math.inf, t))
    return np.array(out, dtype=object).reshape(np.shape(x))


def ref_quantize(x, scale, zp, dtype):
    d = qdtype(dtype)
    return np.array([min(max(r, d.qmin), d.qmax) for r in ref_rounded(x, scale, zp).ravel()],
                    np.int64).reshape(np.shape(x))


@pytest.mark.parametrize("dtype", SMALL + ["qint16", "quint16"])
def test_every_code_round_trips(dtype, kernels):
    d = qdtype(dtype)
    codes = np.arange(d.qmin, d.qmax + 1)
    zp = (d.qmin + d.qmax + 1) // 2 if not d.signed else 1 if d.bits > 2 else 0
    scale = 0.37
    x = ((codes - zp) * np.float64(np.float32(scale))).astype(np.float32)
    q = qarray.quantize(x, scale, zp, dtype)
    assert q.data.dtype == d.storage
    np.testing.assert_array_equal(q.int_repr(), codes)
    expect = (codes - zp).astype(np.float32) * np.float32(scale)
    np.testing.assert_array_equal(q.dequantize(), expect)
    assert q.dequantize().dtype == np.float32


@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
def test_ties_round_half_even(in_dtype, kernels):
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], in_dtype) * in_dtype(0.25)
    q = qarray.quantize(x, 0.25, 0, "qint8")
    np.testing.assert_array_equal(q.int_repr(), [0, 2, 2, 0, -2, -2, 4])


@pytest.mark.parametrize("dtype", ALL)
def test_saturation_and_inf(dtype, kernels):
    d = qdtype(dtype)
    x = np.array([np.inf, -np.inf, 1e30, -1e30, 0.0], np.float32)
    q = qarray.quantize(x, 1.0, 0 if d.signed else 1, dtype)
    np.testing.assert_array_equal(q.int_repr(), [d.qmax, d.qmin, d.qmax, d.qmin, 0 if d.signed else 1])


def test_qint32_extremes_are_exact(kernels):
    # 2**31 - 1 is not a float32: the clamp must not round through float32
    x = np.array([2.0**31, -(2.0**31), 2.0**31 - 128, 12345678.0], np.float32)
    q = qarray.quantize(x, 1.0, 0, "qint32")
    np.testing.assert_array_equal(q.int_repr(), [2**31 - 1, -(2**31), 2**31 - 128, 12345678])
    q = qarray.quantize(np.array([2.0**31 - 1, 2.0**40]), 1.0, -5, "qint32")  # float64 input
    np.testing.assert_array_equal(q.int_repr(), [2**31 - 6, 2**31 - 1])


@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
def test_nan_raises_with_count_and_index(in_dtype, kernels):
    x = np.zeros((3, 5000), in_dtype)
    x[1, 7] = x[2, 0] = np.nan
    with pytest.raises(ValueError, match=r"2 NaN value\(s\), the first at index \(1, 7\)"):
        qarray.quantize(x, 0.1, 0, "qint8")


def test_inf_alone_is_not_an_error(kernels):
    x = np.full(10000, np.inf, np.float32)
    assert (qarray.quantize(x, 0.1, 0, "quint8").int_repr() == 255).all()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=40),
    st.floats(0.0001220703125, 1024.0, width=32),
    st.sampled_from(ALL),
    st.sampled_from([np.float32, np.float64, np.float16]),
)
def test_matches_reference(values, scale, dtype, in_dtype):
    with np.errstate(over="ignore"):  # large values become float16 inf: saturate
        x = np.array(values, np.float32).astype(in_dtype)
    d = qdtype(dtype)
    zp = d.qmin + (d.qmax - d.qmin) // 3
    want = ref_quantize(x.astype(np.float32) if in_dtype == np.float16 else x, scale, zp, dtype)
    for numba in (True, False):
        with qarray.config.using(numba=numba):
            np.testing.assert_array_equal(qarray.quantize(x, scale, zp, dtype).int_repr(), want)


@pytest.mark.parametrize(
    "shape,axis,block_size",
    [((6, 7), 0, None), ((6, 7), 1, None), ((6, 7), -1, None), ((2, 3, 5), 1, None),
     ((5,), 0, None), ((6, 10), 1, 4), ((10, 6), 0, 3), ((2, 9, 3), 1, 2), ((4, 33), 1, 32),
     ((3, 5), 1, 8), ((8,), 0, 1)],
)
def test_per_axis_and_blocked_match_reference(shape, axis, block_size, rng, kernels):
    from qarray._params import expand, param_shape

    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    ax = axis % len(shape)
    pshape = param_shape(shape, ax, block_size)
    scale = rng.uniform(0.01, 0.1, pshape).astype(np.float32)
    zp = rng.integers(-20, 20, pshape).astype(np.int32)
    q = qarray.quantize(x, scale, zp, "qint8", axis=axis, block_size=block_size)
    # a block longer than the axis is recorded as the axis length (one block, the same layout)
    assert q.axis == ax and q.block_size == (None if block_size is None else min(block_size, shape[ax]))
    s_full = np.broadcast_to(expand(scale, shape, ax, block_size), shape)
    z_full = np.broadcast_to(expand(zp, shape, ax, block_size), shape)
    np.testing.assert_array_equal(q.int_repr(), ref_quantize(x, s_full, z_full, "qint8"))
    want = ((q.int_repr().astype(np.int64) - z_full).astype(np.float32) * s_full)
    np.testing.assert_array_equal(q.dequantize(), want)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "shape,axis,block_size",
    [((1,), None, None), ((4097,), None, None), ((3 * 4096 + 5,), None, None), ((0, 3), None, None),
     ((33, 65), 0, None), ((33, 65), 1, None), ((7, 300, 9), 2, 64), ((40, 129), 1, 32)],
)
def test_numba_and_generic_agree(dtype, in_dtype, shape, axis, block_size, rng):
    """The Numba kernels and the generic NumPy code give the same bits."""
    from qarray._params import param_shape

    if not __import__("importlib").util.find_spec("numba"):
        pytest.skip("numba is not installed")
    d = qdtype(dtype)
    x = (rng.standard_normal(shape) * 40).astype(in_dtype)
    pshape = param_shape(shape, None if axis is None else axis % len(shape), block_size)
    scale = rng.uniform(0.05, 0.5, pshape).astype(np.float32)
    zp = rng.integers(d.qmin, min(d.qmax, d.qmin + 200), pshape, endpoint=True)
    results = {}
    for numba in (True, False):
        with qarray.config.using(numba=numba):
            q = qarray.quantize(x, scale, zp, dtype, axis=axis, block_size=block_size)
            results[numba] = (q.int_repr(), [q.dequantize(t) for t in ("float16", "float32", "float64")])
    np.testing.assert_array_equal(results[True][0], results[False][0])
    for a, b in zip(results[True][1], results[False][1]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_dequantize_dtypes(kernels):
    q = qarray.QArray.from_int(np.array([-3, 0, 100], np.int8), 0.1, 1, "qint8")
    np.testing.assert_array_equal(q.dequantize("float64"), np.array([-4, -1, 99]) * np.float64(np.float32(0.1)))
    np.testing.assert_array_equal(q.dequantize("float16"), (np.array([-4, -1, 99], np.float32) * np.float32(0.1)).astype(np.float16))
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        q.dequantize("int8")


def test_quantize_dynamic_asymmetric_includes_zero(kernels):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    q = qarray.quantize_dynamic(x)  # quint8, range widened to [0, 3]
    assert q.dtype is qarray.quint8
    assert q.scale.item() == np.float32(3.0) / np.float32(255)
    assert q.zero_point.item() == 0
    assert q.int_repr()[-1] == 255


@pytest.mark.parametrize("dtype,zp", [("qint8", 0), ("quint8", 128), ("qint4", 0)])
def test_quantize_dynamic_symmetric(dtype, zp, kernels):
    x = np.array([-2.0, 0.5, 1.0], np.float32)
    q = qarray.quantize_dynamic(x, dtype, symmetric=True)
    d = qdtype(dtype)
    assert q.zero_point.item() == zp
    assert q.scale.item() == np.float32(2.0) / np.float32((d.qmax - d.qmin) / 2)


def test_quantize_dynamic_per_axis_and_blocked(rng, kernels):
    x = rng.standard_normal((4, 10)).astype(np.float32)
    q = qarray.quantize_dynamic(x, "qint8", axis=0)
    assert q.scale.shape == (4,)
    lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    np.testing.assert_array_equal(q.scale, (hi - lo) / np.float32(255))
    qb = qarray.quantize_dynamic(x, "qint4", axis=1, block_size=4)
    assert qb.scale.shape == (4, 3)
    np.testing.assert_array_equal(qb.scale[:, 2], (np.maximum(x[:, 8:].max(1), 0) - np.minimum(x[:, 8:].min(1), 0)) / np.float32(15))


def test_quantize_dynamic_bad_input():
    with pytest.raises(ValueError, match="1 NaN value"):
        qarray.quantize_dynamic(np.array([1.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="finite input"):
        qarray.quantize_dynamic(np.array([1.0, np.inf], np.float32))
    with pytest.raises(ValueError, match="non-empty"):
        qarray.quantize_dynamic(np.zeros(0, np.float32))


def test_choose_qparams():
    s, z = qarray.choose_qparams(-1.0, 3.0, "quint8")
    assert s == np.float32(4.0) / np.float32(255) and z == 64
    s, z = qarray.choose_qparams(0.0, 0.0, "quint8")  # empty range: ONNX's 1 / 255
    assert s == np.float32(1) / np.float32(255) and z == 0
    with pytest.raises(ValueError, match="min_val <= max_val"):
        qarray.choose_qparams(2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        qarray.choose_qparams(np.nan, 1.0)


@pytest.mark.parametrize(
    "scale,message",
    [(0.0, "finite and > 0"), (-1.0, "finite and > 0"), (np.nan, "finite and > 0"),
     (np.inf, "finite and > 0"), (1e-50, "finite and > 0"), (1e50, "finite and > 0")],
)
def test_bad_scale(scale, message):
    with pytest.raises(ValueError, match=message):
        qarray.quantize(np.zeros(3, np.float32), scale, 0, "qint8")


def test_bad_scale_types_and_shapes():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="scale must be a real number"):
        qarray.quantize(x, 1j, 0)
    with pytest.raises(ValueError, match=r"scale has shape \(2,\) but per-axis along axis 1 needs shape \(3,\)"):
        qarray.quantize(x, [0.1, 0.2], 0, axis=1)
    with pytest.raises(ValueError, match=r"zero_point has shape \(2,\) but per-tensor"):
        qarray.quantize(x, 0.1, [1, 2])
    with pytest.raises(ValueError, match=r"blocked along axis 1 with block_size=2 needs shape \(2, 2\)"):
        qarray.quantize(x, np.ones((2, 3)), 0, axis=1, block_size=2)


@pytest.mark.parametrize(
    "zp,dtype,exc,message",
    [(128, "qint8", ValueError, r"zero_point 128 is outside the range \[-128, 127\] of qint8"),
     (-1, "quint4", ValueError, r"outside the range \[0, 15\] of quint4"),
     (1.5, "qint8", TypeError, "zero_point must be an integer"),
     (1.0, "qint8", TypeError, "zero_point must be an integer")],
)
def test_bad_zero_point(zp, dtype, exc, message):
    with pytest.raises(exc, match=message):
        qarray.quantize(np.zeros(3, np.float32), 0.1, zp, dtype)


def test_bad_axis_and_block_size():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="axis=2 is out of range for an array with 2 dimension"):
        qarray.quantize(x, 0.1, 0, axis=2)
    with pytest.raises(ValueError, match="axis=-3 is out of range"):
        qarray.quantize(x, 0.1, 0, axis=-3)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        qarray.quantize(x, 0.1, 0, axis=1, block_size=0)
    with pytest.raises(ValueError, match="block_size needs an axis"):
        qarray.quantize(x, 0.1, 0, block_size=2)
    with pytest.raises(TypeError, match="axis must be an integer"):
        qarray.quantize(x, 0.1, 0, axis=1.0)


@pytest.mark.parametrize("x", [np.arange(3), np.ones(3, np.complex64), np.ones(3, bool)])
def test_non_float_input(x):
    with pytest.raises(TypeError, match="quantize takes float16, float32 or float64 input"):
        qarray.quantize(x, 0.1, 0)


def test_list_and_scalar_input():
    assert qarray.quantize([0.1, 0.2], 0.1).int_repr().tolist() == [1, 2]
    assert qarray.quantize(0.3, 0.1).shape == ()
    assert qarray.quantize(0.3, 0.1).int_repr().tolist() == 3
    assert math.isclose(float(qarray.quantize(0.3, 0.1).dequantize()), 0.3, rel_tol=1e-6)


# -- user arrays reach the kernels in a form they take --------------------------
# (above 16384 elements, so the NumPy backend's Numba path runs even without conftest)

@pytest.mark.parametrize("order", [">", "<"])
def test_non_native_byte_order(order, kernels):
    x = (np.arange(20000) * 0.25).astype(order + "f4")
    want = np.rint(np.arange(20000) * 0.5).astype(np.int64)  # x / 0.5, ties to even
    np.testing.assert_array_equal(qarray.quantize(x, 0.5, 0, "qint16").int_repr(), want)
    q = qarray.quantize_dynamic(x, "quint16")
    s = np.float32(4999.75) / np.float32(65535)
    np.testing.assert_array_equal(q.int_repr(), ref_quantize(x.astype(np.float32), s, 0, "quint16"))


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_matrix_becomes_an_ndarray(kernels):
    m = np.matrix((np.arange(20000, dtype=np.float32) * 0.25).reshape(200, 100))
    q = qarray.quantize(m, 0.5, 0, "qint16")
    assert type(q.data) is np.ndarray and q.shape == (200, 100)
    np.testing.assert_array_equal(q.int_repr().ravel(), np.rint(np.arange(20000) * 0.5))
    assert qarray.quantize_dynamic(m, "qint8", axis=0).shape == (200, 100)


@pytest.mark.parametrize("fn", [lambda x: qarray.quantize(x, 0.1), qarray.quantize_dynamic])
def test_masked_arrays_refused(fn):
    x = np.ma.array([1.0, np.nan], mask=[False, True], dtype=np.float32)
    with pytest.raises(TypeError, match=r"does not take masked arrays .* fill the masked values first, e\.g\. x\.filled\(0\)"):
        fn(x)


@pytest.mark.parametrize("block_size", [8, 9, 2**40, 2**64])
def test_block_size_beyond_the_axis_is_one_block(block_size, kernels):
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    scale = np.array([[0.5], [1.0], [2.0], [4.0]], np.float32)
    q = qarray.quantize(x, scale, 0, "qint8", axis=1, block_size=block_size)
    assert q.block_size == 8 and q.scale.shape == (4, 1)
    np.testing.assert_array_equal(q.int_repr(), ref_quantize(x, np.broadcast_to(scale, (4, 8)), 0, "qint8"))
    qd = qarray.quantize_dynamic(x, "qint8", symmetric=True, axis=1, block_size=block_size)
    np.testing.assert_array_equal(qd.scale.ravel(), x.max(axis=1) / np.float32(127.5))
    r = qarray.requantize(q, 1.0, 0, "qint16", axis=1, block_size=block_size)  # q's own layout
    np.testing.assert_array_equal(r.int_repr(), np.rint(q.dequantize()))  # the real values at scale 1


def test_choose_qparams_refuses_complex_and_too_wide_ranges():
    with pytest.raises(TypeError, match=r"choose_qparams: min_val must be real \(float or integer\), got dtype complex128"):
        qarray.choose_qparams(-1 + 1j, 3.0)
    with pytest.raises(TypeError, match="choose_qparams: max_val must be real"):
        qarray.choose_qparams(-1.0, np.array([3j]))
    with pytest.raises(ValueError, match=r"choose_qparams: the range \[-3e\+38, 3e\+38\] is too wide for float32 "
                                         r"scales .*; clip it, or use symmetric=True"):
        qarray.choose_qparams(-3e38, 3e38)
    with pytest.raises(ValueError, match=r"the range \[-1e\+300, 1\.0\] is too wide for float32 scales .*; clip it$"):
        qarray.choose_qparams(-1e300, 1.0)
    s, z = qarray.choose_qparams(-3e38, 3e38, "qint8", symmetric=True)
    assert s == np.float32(3e38) / np.float32(127.5) and z == 0


def test_quantize_dynamic_too_wide_a_range_names_the_data():
    x = np.array([-3e38, 0.0, 3e38], np.float32)
    with pytest.raises(ValueError, match=r"^quantize_dynamic: the data's range \[-3e\+38, 3e\+38\] is too wide for float32 scales"):
        qarray.quantize_dynamic(x)
    with pytest.raises(ValueError, match=r"^quantize_dynamic: the data's range \[-1e\+300, 1\.0\] is too wide"):
        qarray.quantize_dynamic(np.array([-1e300, 1.0]))
    q = qarray.quantize_dynamic(x, "qint8", symmetric=True)  # the symmetric scale fits
    np.testing.assert_array_equal(q.int_repr(), [-128, 0, 127])


@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint16"])
def test_checkpoint_floats_are_quantized_as_float16_is(fmt, dtype):
    """bfloat16 and float8 input (what checkpoints hold): every finite value of
    the type, rounded once from its value as float16 is (x / scale in IEEE
    float32): against NumPy's own float32 division, per tensor and per axis; the
    same through quantize_dynamic and an observer."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = np.dtype(getattr(ml_dtypes, fmt))
    x = np.arange(1 << (8 * t.itemsize), dtype=f"u{t.itemsize}").view(t)
    x32 = x.astype(np.float32)
    x, x32 = x[np.isfinite(x32)], x32[np.isfinite(x32)]
    assert np.array_equal(x32.astype(t).view(f"u{t.itemsize}"), x.view(f"u{t.itemsize}"))  # float32 holds each value
    d = qarray.qdtype(dtype)
    for scale, zp in ((0.37, d.qmin + 3), (2.0**-7, 0), (1e-30, d.qmax)):
        with np.errstate(over="ignore"):  # beyond float32: inf, which saturates
            want = np.clip(np.rint(x32 / np.float32(scale)) + zp, d.qmin, d.qmax)
        np.testing.assert_array_equal(qarray.quantize(x, scale, zp, dtype).int_repr(), want)
    small = x[np.abs(x32) < 1e4]  # a range whose scale float32 holds, for the observers too
    rows = small[: len(small) // 4 * 4].reshape(4, -1)
    scales = np.float32([0.5, 0.01, 3.0, 1e-3])
    with np.errstate(over="ignore"):
        want = np.clip(np.rint(rows.astype(np.float32) / scales[:, None]), d.qmin, d.qmax)
    np.testing.assert_array_equal(qarray.quantize(rows, scales, 0, dtype, axis=0).int_repr(), want)
    for q, r in ((qarray.quantize_dynamic(rows, dtype, axis=0), qarray.quantize_dynamic(rows.astype(np.float32), dtype, axis=0)),
                 (qarray.observers.MinMax(dtype).update(rows).quantize(rows),
                  qarray.observers.MinMax(dtype).update(rows.astype(np.float32)).quantize(rows.astype(np.float32)))):
        np.testing.assert_array_equal(q.scale, r.scale)
        np.testing.assert_array_equal(q.int_repr(), r.int_repr())


def _f32(r):
    """The Fraction ``r`` rounded to the nearest float32, ties to even (normal
    range): the reference's float32 arithmetic, apart from NumPy's."""
    if r == 0:
        return r
    a = abs(r)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**e <= a < 2**(e + 1) after the step below
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (e - 23)
    n, rem = divmod(a / ulp, 1)
    n += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2)
    return (n * ulp) * (1 if r > 0 else -1)


def _torch_codes(x, scale, zero_point, d, axis):
    """PyTorch's rule (fbgemm's ``Quantize``, non-legacy), worked out in Fractions:
    ``clamp(rint(f32(x * f32(1 / scale))) + zero_point)``, per element."""
    x = np.asarray(x, np.float32)
    s = np.broadcast_to(np.asarray(scale, np.float32).reshape((-1,) + (1,) * (x.ndim - 1 - (axis or 0)))
                        if axis is not None else np.float32(scale), x.shape)
    z = np.broadcast_to(np.asarray(zero_point).reshape((-1,) + (1,) * (x.ndim - 1 - (axis or 0)))
                        if axis is not None else zero_point, x.shape)
    out = np.empty(x.shape, np.int64)
    for i in np.ndindex(x.shape):
        y = _f32(Fraction(float(x[i])) * _f32(1 / Fraction(float(s[i]))))
        n, rem = divmod(y, 1)
        n += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2)
        out[i] = min(max(int(n) + int(z[i]), d.qmin), d.qmax)
    return out


def _ties(rng, scales, codes):
    """float32 values at and one or two ulps beside ``(k + 1/2) * scale`` for each
    scale (a row) and code k: where dividing and multiplying by the reciprocal part."""
    rows = []
    for s in scales:
        centre = np.array([(k + 0.5) * np.float64(s) for k in codes], np.float32)
        rows.append(np.concatenate([centre, *(np.nextafter(centre, sign * np.float32(np.inf)) for sign in (1, -1)),
                                    np.nextafter(np.nextafter(centre, np.float32(np.inf)), np.float32(np.inf))]))
    return np.stack(rows)


@pytest.mark.parametrize("dtype,zero_point", [("qint8", 0), ("qint8", -128), ("qint8", 127), ("quint8", 0),
                                              ("quint8", 255), ("quint8", 128), ("qint4", -8), ("qint16", 5)])
def test_reciprocal_gives_pytorchs_codes_at_ties(rng, dtype, zero_point):
    """``reciprocal=True`` is PyTorch's ``quantize_per_tensor`` / ``per_channel``:
    x times float32(1 / scale), rounded to float32, then half to even, checked
    against that rule in Fractions on values at and beside every tie of the
    range (qmin and qmax included, zero points at both ends), per tensor and per
    channel; the division (ONNX's) gives other codes on these values."""
    d = qarray.qdtype(dtype)
    scales = np.concatenate([[1 / 127.5, 0.00392157, 0.1], rng.uniform(1e-4, 1, 5)]).astype(np.float32)
    x = _ties(rng, scales, range(d.qmin - zero_point - 2, min(d.qmax - zero_point + 2, d.qmin - zero_point + 300)))
    for s in scales[:3]:  # per tensor, one scale: the values of its row
        row = x[list(scales).index(s)]
        got = np.asarray(qarray.quantize(row, s, zero_point, dtype, reciprocal=True).int_repr())
        np.testing.assert_array_equal(got, _torch_codes(row, s, zero_point, d, None))
    zp = np.full(len(scales), zero_point, np.int32)
    got = qarray.quantize(x, scales, zp, dtype, axis=0, reciprocal=True)
    want = _torch_codes(x, scales, zp, d, 0)
    np.testing.assert_array_equal(np.asarray(got.int_repr()), want)
    assert got.scale.tobytes() == scales.tobytes()  # the scale kept, not the 1 it divided by
    assert (np.asarray(qarray.quantize(x, scales, zp, dtype, axis=0).int_repr()) != want).sum() > 10


def test_reciprocal_equals_torch(rng):
    """The same, against PyTorch itself where it is installed: random data and
    symmetric per-channel ranges (each channel's extreme at +-127.5, where
    resnet18's weights differ), qint8 / quint8 / qint32."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((64, 300)).astype(np.float32)
    x[:, 0] *= 3  # an extreme per row
    s = (np.abs(x).max(axis=1) / np.float32(127.5)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch's deprecation of its quantized dtypes
        t = torch.quantize_per_channel(torch.from_numpy(x), torch.from_numpy(s.astype(np.float64)),
                                       torch.zeros(64, dtype=torch.int64), 0, torch.qint8).int_repr().numpy()
        got = np.asarray(qarray.quantize(x, s, 0, "qint8", axis=0, reciprocal=True).int_repr())
        np.testing.assert_array_equal(got, t)
        assert (np.asarray(qarray.quantize(x, s, 0, "qint8", axis=0).int_repr()) != t).any()
        for dtype, tdt, zp in (("qint8", torch.qint8, -3), ("quint8", torch.quint8, 128), ("qint32", torch.qint32, 0)):
            for scale in (0.00392157, 1 / 127.5, 3e-5):
                t = torch.quantize_per_tensor(torch.from_numpy(x), scale, zp, tdt).int_repr().numpy()
                got = np.asarray(qarray.quantize(x, scale, zp, dtype, reciprocal=True).int_repr())
                np.testing.assert_array_equal(got, t)


def test_reciprocal_errors(rng):
    x = rng.standard_normal(4)
    with pytest.raises(TypeError, match=r"reciprocal=True is PyTorch's float32 arithmetic, and PyTorch takes no "
                                        r"float64: pass x.astype\(numpy.float32\)"):
        qarray.quantize(x, 0.1, 0, "qint8", reciprocal=True)
    with pytest.raises(ValueError, match="NaN"):
        qarray.quantize(np.array([np.nan], np.float32), 0.1, 0, "qint8", reciprocal=True)
    pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="reciprocal=True is PyTorch's arithmetic for integer formats; float8_e4m3fn"):
        qarray.quantize(x.astype(np.float32), 0.1, 0, "float8_e4m3fn", reciprocal=True)


def test_quotients_beyond_the_float_range_saturate_quietly(kernels):
    """x / scale past float32's range (1.0 / 2**-149) is inf and saturates to qmax
    (-inf to qmin) on both CPU paths, without NumPy's overflow warning (an error
    under this suite's filterwarnings; the generic path raised it)."""
    x = np.array([1.0, -1.0, 2.0**-149, 0.0], np.float32)
    got = qarray.quantize(x, 2.0**-149, 1, "qint16").int_repr()
    np.testing.assert_array_equal(got, [32767, -32768, 2, 1])


# -- fake_quantize: quantize then dequantize, fused --------------------------------
def _input_on(backend, x):
    """``x`` as the backend's float input (Dask: chunks of 4 rows; elsewhere as it is)."""
    if backend.name != "dask":
        return x
    import dask.array as da

    return da.from_array(x, chunks=(4,) + x.shape[1:])


def _bits(a):
    """Float values as their bit patterns: equal means equal to the bit (signed zeros too)."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def ref_inside(x, scale, zp, dtype):
    """Independent reference of the straight-through mask: ``ref_rounded`` inside ``[qmin, qmax]``."""
    d = qdtype(dtype)
    return np.array([d.qmin <= r <= d.qmax for r in ref_rounded(x, scale, zp).ravel()]).reshape(np.shape(x))


LAYOUTS = [dict(), dict(axis=0), dict(axis=1), dict(axis=1, block_size=3)]


def _fq_case(rng, dtype, in_dtype, layout):
    """Data at every code's edge (qmin/qmax codes, just beyond, ties, +-inf) and
    random values, with zero points at both ends of the dtype."""
    d = qdtype(dtype)
    shape = (8, 7)
    pshape = {(): (), (0,): (8,), (1,): (7,)}.get(tuple(layout.values()), (8, 3))
    scale = rng.choice(np.float32([0.25, 0.37, 1.5, 3.0]), pshape).astype(np.float32)
    zp = rng.choice([d.qmin, d.qmax, (d.qmin + d.qmax) // 2], pshape)
    from qarray._params import expand

    axis, block = layout.get("axis"), layout.get("block_size")
    S, Z = expand(scale, shape, axis, block), expand(zp, shape, axis, block)
    codes = rng.choice([d.qmin, d.qmax, d.qmin - 1, d.qmax + 1, 0], shape) + rng.choice([0, 0.5, -0.5, 0.49, 7.3], shape)
    with np.errstate(over="ignore"):  # float16 holds no qint16 extremes at these scales: inf, saturated
        x = ((codes - Z) * S.astype(np.float64)).astype(in_dtype)
    x[0, :3] = [np.inf, -np.inf, 0]
    return x, scale, zp


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("dtype", ALL)
def test_fake_quantize_is_quantize_then_dequantize(backend, dtype, in_dtype, layout, rng):
    """Bit for bit ``quantize(x).dequantize(x.dtype)`` on every backend (the fused
    kernels on Numba and CUDA), every dtype's extreme codes with zero points at
    both ends, per tensor, per axis and blocked; the mask against an independent
    reference."""
    x, scale, zp = _fq_case(rng, dtype, in_dtype, layout)
    want = qarray.quantize(x, scale, zp, dtype, **layout).dequantize(in_dtype)
    with backend.context():
        got, inside = qarray.fake_quantize(_input_on(backend, x), scale, zp, dtype, **layout, return_mask=True)
        plain = qarray.fake_quantize(_input_on(backend, x), scale, zp, dtype, **layout)
    got, inside, plain = (backend.get(a) for a in (got, inside, plain))
    assert got.dtype == plain.dtype == in_dtype and inside.dtype == np.bool_
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(plain), _bits(want))
    from qarray._params import expand

    S = expand(scale, x.shape, layout.get("axis"), layout.get("block_size"))
    Z = expand(zp, x.shape, layout.get("axis"), layout.get("block_size"))
    np.testing.assert_array_equal(inside, ref_inside(x, S, Z, dtype))
    # on CUDA the fused kernels alone: no codes in between
    assert backend.ran("fake_quantize") and {n.split("_float")[0] for n in backend.launched} <= {
        "fake_quantize", "quantize_mask"}


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_fake_quantize_floating_formats(dtype, rng, kernels):
    """A floating format: quantize then dequantize at the given scale, bit for
    bit; the mask says where ``|x / scale|`` is at most the format's largest value."""
    pytest.importorskip("ml_dtypes")
    d = qdtype(dtype)
    x = (rng.standard_normal((6, 40)) * 2 * d.qmax).astype(np.float32)
    x[0, :4] = [d.qmax, -d.qmax, np.nextafter(np.float32(d.qmax), np.float32(np.inf)), np.inf]
    scale = rng.uniform(0.5, 2, 6).astype(np.float32)
    got, inside = qarray.fake_quantize(x, scale, 0, dtype, axis=0, return_mask=True)
    want = qarray.quantize(x, scale, 0, dtype, axis=0).dequantize()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    ratio = x.astype(np.float64) / scale[:, None].astype(np.float64)  # exact enough away from the edge
    edge = np.abs(np.abs(ratio) - d.qmax) < 1e-6 * d.qmax
    np.testing.assert_array_equal(inside[~edge], (np.abs(ratio) <= d.qmax)[~edge])
    assert inside[0, 0] and inside[0, 1] and not inside[0, 3]


def test_fake_quantize_input_types_and_errors(kernels):
    x = np.zeros((3, 5000), np.float32)
    x[1, 7] = np.nan
    with pytest.raises(ValueError, match=r"1 NaN value\(s\), the first at index \(1, 7\)"):
        qarray.fake_quantize(x, 0.1)
    with pytest.raises(TypeError, match="fake_quantize takes float16, float32 or float64 input, got int32"):
        qarray.fake_quantize(np.arange(4, dtype=np.int32), 0.1)
    with pytest.raises(ValueError, match="scale"):
        qarray.fake_quantize(np.ones(4, np.float32), -1.0)
    y = qarray.fake_quantize([0.26, -0.3], 0.25)  # a list: float64, as quantize takes it
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, [0.25, -0.25])


def test_fake_quantize_bfloat16_keeps_its_dtype(rng, kernels):
    """ml_dtypes' bfloat16 in, bfloat16 out: the float32 result rounded once more."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = rng.standard_normal(300).astype(ml_dtypes.bfloat16)
    got, inside = qarray.fake_quantize(x, 0.02, 3, "qint8", return_mask=True)
    assert got.dtype == ml_dtypes.bfloat16
    want = qarray.quantize(x.astype(np.float32), 0.02, 3, "qint8").dequantize().astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(inside, ref_inside(x.astype(np.float32), np.float32(0.02), 3, "qint8"))


def test_fake_quantize_against_torch(rng, kernels):
    """PyTorch's fake_quantize_per_tensor_affine multiplies by 1 / scale: equal to
    ``quantize(reciprocal=True).dequantize()`` everywhere, and to qarray's own
    (division) everywhere but where the two roundings of ``x / scale`` differ,
    which are at or next to ties (``_ties``: each tie of the range and its
    neighbours; random data has none)."""
    torch = pytest.importorskip("torch")
    s = np.float32(1 / 127.5)
    ties = _ties(rng, np.array([s]), range(-131, 130))[0]
    x = np.concatenate([rng.standard_normal(100000).astype(np.float32), ties])
    for zp, lo, hi in ((0, -128, 127), (-128, -128, 127)):
        tout, tmask = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(torch.from_numpy(x), float(s), zp, lo, hi)
        got, inside = qarray.fake_quantize(x, s, zp, "qint8", return_mask=True)
        recip = qarray.quantize(x, s, zp, "qint8", reciprocal=True).dequantize()
        np.testing.assert_array_equal(_bits(tout.numpy()), _bits(recip))
        differ = got != tout.numpy()
        codes, tcodes = qarray.quantize(x, s, zp, "qint8"), qarray.quantize(x, s, zp, "qint8", reciprocal=True)
        np.testing.assert_array_equal(differ, codes.int_repr() != tcodes.int_repr())
        assert not differ[:100000].any() and differ[100000:].any()
        np.testing.assert_array_equal(inside[~differ], tmask.numpy()[~differ])


# -- stochastic rounding: Philox4x32-10 keyed by the seed, counted by element index --------
# Random123's kat_vectors for Philox4x32-10 (also TensorFlow's philox tests):
# (counter, key, output)
PHILOX_KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
              ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
              ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
               (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    from qarray import _philox

    assert ref_philox(counter, key) == want
    got = _philox.philox4x32(*(np.uint64(v) for v in counter), *(np.uint64(v) for v in key))
    assert tuple(int(v) for v in got) == want


def ref_stochastic(x, scale, zp, dtype, seed, clamp=True):
    """Independent reference: ``ref_rounded``'s quotient, its floor plus one where
    the element's Philox word (counter: flat index) is below frac * 2**32, in
    Fractions; then the zero point and (``clamp``) the clamp."""
    d = qdtype(dtype)
    out = []
    flat = zip(np.ravel(x), np.ravel(np.broadcast_to(scale, np.shape(x))), np.ravel(np.broadcast_to(zp, np.shape(x))))
    for i, (v, s, z) in enumerate(flat):
        if np.asarray(x).dtype == np.float64:
            t = float(v) / float(np.float32(s))
        else:
            t = float(np.float32(float(np.float32(v)) / float(np.float32(s))))
        if math.isfinite(t):
            f = math.floor(t)
            r = ref_bits(i, seed)
            q = f + (r < (Fraction(t) - f) * 2**32) + int(z)
        else:
            q = math.copysign(math.inf, t)
        out.append(min(max(q, d.qmin), d.qmax) if clamp else q)
    return np.array(out, np.float64 if not clamp else np.int64).reshape(np.shape(x))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("dtype", ["qint2", "quint4", "qint8", "quint8", "qint16", "qint32"])
def test_stochastic_rounding_is_the_reference(backend, dtype, in_dtype, layout, rng):
    """The same seed gives the same codes on every backend (the Numba and CUDA
    kernels, the generic code, Dask in chunks of 4 rows) and the independent
    reference's, at every dtype's extreme codes with zero points at both ends."""
    x, scale, zp = _fq_case(rng, dtype, in_dtype, layout)
    x[1] = rng.standard_normal(x.shape[1]) * 3  # fractions of every size
    seed = 2**63 + 12345
    with backend.context():
        got = backend.get(qarray.quantize(_input_on(backend, x), scale, zp, dtype, **layout, rounding="stochastic",
                                          seed=seed))
    from qarray._params import expand

    S = expand(scale, x.shape, layout.get("axis"), layout.get("block_size"))
    Z = expand(zp, x.shape, layout.get("axis"), layout.get("block_size"))
    np.testing.assert_array_equal(got.int_repr(), ref_stochastic(x, S, Z, dtype, seed))
    assert backend.ran("quantize_stochastic")


def test_stochastic_rounding_is_unbiased(kernels):
    """10^6 values: only the floor or the ceiling of x / scale; the mean of the
    rounding error within 5 standard deviations of 0 (each value's error has
    variance frac * (1 - frac)); seeds 1 and 2 differ, the same seed repeats."""
    x = np.random.default_rng(5).uniform(-40, 40, 10**6).astype(np.float32)
    t = (x / np.float32(0.37)).astype(np.float64)  # the float32 quotient that is rounded, within qint8
    q = qarray.quantize(x, 0.37, 0, "qint8", rounding="stochastic", seed=1).int_repr().astype(np.float64)
    assert np.all((q == np.floor(t)) | (q == np.ceil(t)))
    frac = t - np.floor(t)
    sigma = math.sqrt(np.sum(frac * (1 - frac))) / x.size
    assert abs(np.mean(q - t)) < 5 * sigma
    nearest = qarray.quantize(x, 0.37, 0, "qint8").int_repr().astype(np.float64)
    assert abs(np.mean(nearest - t)) < 5 * sigma
    other = qarray.quantize(x, 0.37, 0, "qint8", rounding="stochastic", seed=2).int_repr()
    assert 0.2 < np.mean(other != q) < 0.5
    again = qarray.quantize(x, 0.37, 0, "qint8", rounding="stochastic", seed=1).int_repr()
    np.testing.assert_array_equal(again, q)


def test_stochastic_rounding_errors():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="rounding='stochastic' needs a seed"):
        qarray.quantize(x, 0.1, rounding="stochastic")
    with pytest.raises(TypeError, match="seed must be an integer, got float"):
        qarray.quantize(x, 0.1, rounding="stochastic", seed=1.5)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\), got -1"):
        qarray.quantize(x, 0.1, rounding="stochastic", seed=-1)
    with pytest.raises(ValueError, match="rounding must be 'half_even' or 'stochastic', got 'half_up'"):
        qarray.quantize(x, 0.1, rounding="half_up")
    with pytest.raises(TypeError, match="seed= is for rounding='stochastic'"):
        qarray.quantize(x, 0.1, seed=3)
    with pytest.raises(TypeError, match="stochastic rounding divides"):
        qarray.quantize(x, 0.1, rounding="stochastic", seed=3, reciprocal=True)
    pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="rounding='stochastic' is for integer formats"):
        qarray.quantize(x, 0.1, 0, "float8_e4m3fn", rounding="stochastic", seed=3)
    with pytest.raises(TypeError, match="seed= is for rounding='stochastic'"):
        qarray.quantize(x, 0.1, 0, "float8_e4m3fn", seed=3)


def test_fake_quantize_stochastic(backend, rng):
    """fake_quantize's stochastic rounding is quantize's, dequantized, on every
    backend; its mask says where the stochastically rounded value (the
    independent reference's, before the clamp) lay inside the dtype."""
    from qarray._params import expand

    for dtype in ("qint8", "quint4"):
        x, scale, zp = _fq_case(rng, dtype, np.float32, dict(axis=0))
        x[1] = rng.standard_normal(x.shape[1])
        want = qarray.quantize(x, scale, zp, dtype, axis=0, rounding="stochastic", seed=9).dequantize()
        with backend.context():
            got, mask = qarray.fake_quantize(_input_on(backend, x), scale, zp, dtype, axis=0, rounding="stochastic",
                                             seed=9, return_mask=True)
            got, mask = backend.get(got), backend.get(mask)
        np.testing.assert_array_equal(_bits(got), _bits(want))
        d = qdtype(dtype)
        w = ref_stochastic(x, expand(scale, x.shape, 0, None), expand(zp, x.shape, 0, None), dtype, 9, clamp=False)
        np.testing.assert_array_equal(mask, (w >= d.qmin) & (w <= d.qmax))
        assert 0 < mask.sum() < mask.size  # both sides are met
    assert backend.ran("fake_quantize_stochastic")


def test_fake_quantize_out(backend, rng):
    """``out=``: the values written into it and it returned, as a new array would
    hold them, for a separate buffer, ``x`` itself, a strided slice and float16;
    stochastic rounding and the mask too. Dask's arrays are immutable: TypeError."""
    x, scale, zp = _fq_case(rng, "qint8", np.float32, dict(axis=1))
    want, inside = qarray.fake_quantize(x, scale, zp, "qint8", axis=1, return_mask=True)
    if backend.name == "dask":
        with pytest.raises(TypeError, match="out= is not supported for dask arrays"):
            qarray.fake_quantize(_input_on(backend, x), scale, zp, "qint8", axis=1, out=_input_on(backend, x))
        return
    put = backend.host.asarray if backend.host is not None else np.asarray
    with backend.context():
        xd = put(x)
        for out in (put(np.full_like(x, 7.0)), xd.copy(), put(np.zeros((8, 14), np.float32))[:, ::2]):
            r = qarray.fake_quantize(xd, scale, zp, "qint8", axis=1, out=out)
            assert r is out
            np.testing.assert_array_equal(_bits(backend.get(out)), _bits(want))
        inplace = xd.copy()
        r, m = qarray.fake_quantize(inplace, scale, zp, "qint8", axis=1, out=inplace, return_mask=True)
        assert r is inplace
        np.testing.assert_array_equal(_bits(backend.get(inplace)), _bits(want))
        np.testing.assert_array_equal(backend.get(m), inside)
        h = put(np.empty(x.shape, np.float16))
        x16 = put(x.astype(np.float16))
        assert qarray.fake_quantize(x16, scale, zp, "qint8", axis=1, out=h) is h
        np.testing.assert_array_equal(_bits(backend.get(h)), _bits(qarray.fake_quantize(x.astype(np.float16), scale,
                                                                                          zp, "qint8", axis=1)))
        s = put(np.empty_like(x))
        qarray.fake_quantize(xd, scale, zp, "qint8", axis=1, rounding="stochastic", seed=3, out=s)
        np.testing.assert_array_equal(_bits(backend.get(s)), _bits(qarray.fake_quantize(
            x, scale, zp, "qint8", axis=1, rounding="stochastic", seed=3)))


def test_fake_quantize_out_errors():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"fake_quantize: out must be a numpy array of shape \(2, 3\) and dtype "
                                         r"float32 \(x's\), got ndarray \(2, 3\) float64"):
        qarray.fake_quantize(x, 0.1, out=np.empty((2, 3)))
    with pytest.raises(ValueError, match=r"out must be a numpy array of shape \(2, 3\).*got ndarray \(3, 2\)"):
        qarray.fake_quantize(x, 0.1, out=np.empty((3, 2), np.float32))
    ro = np.empty((2, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="fake_quantize: out is read-only"):
        qarray.fake_quantize(x, 0.1, out=ro)
    with pytest.raises(TypeError, match="no qarray backend handles arrays of type builtins.list"):
        qarray.fake_quantize(x, 0.1, out=[0.0] * 6)


@pytest.mark.parametrize("shape,axis,block_size", [((3, 100003), None, None), ((3, 100003), 1, None),
                                                   ((3, 100003), 1, 1000), ((300, 2001), 0, None)])
def test_stochastic_rounding_kernel_pieces(shape, axis, block_size):
    """Large arrays: the Numba kernel runs over several pieces (per tensor: rows of
    4096 and a short last one) and threads, each element still numbered by its
    flat index: the generic whole-array code's codes."""
    pytest.importorskip("numba")
    from qarray._params import param_shape

    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32) * 20
    scale = rng.uniform(0.05, 0.5, param_shape(shape, axis, block_size)).astype(np.float32)
    got = qarray.quantize(x, scale, 0, "qint8", axis, block_size, rounding="stochastic", seed=11)
    with qarray.config.using(numba=False):
        want = qarray.quantize(x, scale, 0, "qint8", axis, block_size, rounding="stochastic", seed=11)
    np.testing.assert_array_equal(got.int_repr(), want.int_repr())


def test_per_tensor_codes_by_blocks_of_64(rng, monkeypatch):
    """Below ``STREAM``, per-tensor float32 to 8-bit codes go by AVX-512's blocks
    of 64 stored through the cache (``quantize_lines["avx512bw", False]``) where
    ``x`` and ``out`` are C-contiguous, at any alignment; the others (float64,
    16-bit codes, a strided ``x``, per-channel) by quantize's kernel. Codes as
    the definition's (a float64 reference), with a short last block."""
    pytest.importorskip("numba")
    from qarray.backends import numpy as nb

    k, isa = nb._cpu().quantize, nb._cpu().isa
    if not isa.usable("avx512bw")[0]:
        pytest.skip("the CPU has no AVX-512 BW")
    ran, which = [], ("avx512bw", False)
    real = k.quantize_lines[which]
    monkeypatch.setitem(k.quantize_lines, which, lambda *a: ran.append(a[-2:]) or real(*a))
    x = (rng.standard_normal(64 * 50 + 13) * 9).astype(np.float32)
    for dtype, zp, data, axis, takes in [("qint8", -3, x, None, True), ("quint8", 255, x[1:], None, True),
                                         ("qint8", 0, x[::2], None, False), ("qint16", 0, x, None, False),
                                         ("qint8", 0, x.astype(np.float64), None, False),
                                         ("qint8", 0, x[:3200].reshape(50, 64), 0, False)]:
        d = qdtype(dtype)
        ran.clear()
        got = qarray.quantize(data, 0.07, zp, dtype, axis=axis)
        t = (data.astype(np.float64) / np.float64(np.asarray(0.07, data.dtype))).astype(data.dtype)
        want = np.clip(np.rint(t.astype(np.float64)) + zp, d.qmin, d.qmax).astype(np.int64)
        np.testing.assert_array_equal(got.int_repr(), want)
        assert bool(ran) == takes and (not takes or sum(b - a for a, b in ran) == -(-data.size // 64))


@pytest.mark.parametrize("dtype,zp", [("qint8", 0), ("qint8", -128), ("qint8", 127), ("quint8", 0), ("quint8", 255),
                                      ("qint4", -8), ("quint2", 3)])
@pytest.mark.parametrize("lines", [True, False])
def test_large_arrays_stream_their_codes(dtype, zp, lines, rng, monkeypatch):
    """From ``STREAM`` float32 elements, per-tensor quantize to 8-bit storage
    writes 64 codes a step with non-temporal stores (``cpu.quantize.quantize_lines``,
    LLVM IR; ``lines``: its AVX-512 blocks, ``llvm._quantize_line``, else the
    portable loops, forced): the codes of the definition (a float64 reference:
    the float32 quotient correctly rounded, then half to even) at ties, at both
    clamps, for +-inf, -0.0 and subnormals, over sizes that leave a short last
    block, on one thread and two; NaN in a full block or in the short one raises."""
    pytest.importorskip("numba")
    from qarray.backends import numpy as nb

    k, isa = nb._cpu().quantize, nb._cpu().isa
    if lines and not isa.usable("avx512bw")[0]:
        pytest.skip("the CPU has no AVX-512 BW")
    monkeypatch.setattr(isa, "OFF", set() if lines else {"avx512bw"})
    ran, which = [], ("avx512bw" if lines else "sse2", True)
    real = k.quantize_lines[which]
    monkeypatch.setitem(k.quantize_lines, which, lambda *a: ran.append(a[-2:]) or real(*a))
    d = qdtype(dtype)
    for n, scale, threads in ((k.STREAM, 0.25, 2), (k.STREAM + 37, 0.0173, 2), (k.STREAM + 64 * 5 + 1, 0.25, 1)):
        x = (rng.standard_normal(n) * 40 * scale).astype(np.float32)
        ties = (np.arange(-300, 300) + 0.5) * np.float32(0.25)  # exact halves of the 0.25 grid
        special = np.array([np.inf, -np.inf, -0.0, 1e-45, -1e-45, 3e38, -3e38, d.qmax * 1.0, d.qmin * 1.0], np.float32)
        x[:ties.size], x[ties.size:ties.size + special.size] = ties, special
        x[-special.size:] = special  # the short last block too
        with np.errstate(over="ignore", invalid="ignore"):  # 3e38 / 0.0173: inf in float32, as IEEE divides
            t = (x.astype(np.float64) / np.float64(np.float32(scale))).astype(np.float32)  # correctly rounded
            want = np.clip(np.rint(t.astype(np.float64)) + zp, d.qmin, d.qmax).astype(np.int64)
        qarray.set_num_threads(threads)
        try:
            ran.clear()
            got = qarray.quantize(x, scale, zp, dtype)
        finally:
            qarray.set_num_threads(2)
        assert ran and sum(stop - start for start, stop in ran) == -(-n // 64)  # every block, streamed
        np.testing.assert_array_equal(got.int_repr(), want)
        for at in (5, n - 1):
            bad = x.copy()
            bad[at] = np.nan
            with pytest.raises(ValueError, match=rf"1 NaN value\(s\), the first at index \({at},\)"):
                qarray.quantize(bad, scale, zp, dtype)
