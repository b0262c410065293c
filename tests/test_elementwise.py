"""qarray/ops/elementwise.py: add, sub, mul, the scalar ops and the clip family
against exact references, each on every backend (the ``backend`` fixture:
Numba, generic NumPy, the host-run CUDA kernels, Dask)."""

import numpy as np
import pytest

import qarray
from qarray import QArray, qdtype
from qarray.ops import add, add_scalar, clamp, hardtanh, mul, mul_scalar, relu, relu6, sub
from _reference import q_of, ref_fixed


def ref_add(a, b, sign, s_out, z_out, dtype):
    s_a, s_b = float(np.float32(a.scale)), float(np.float32(b.scale))
    common = 2.0 * max(s_a, s_b) / 2.0**20
    d = qdtype(dtype)
    A, B = np.broadcast_arrays(a.int_repr().astype(np.int64) - int(a.zero_point), b.int_repr().astype(np.int64) - int(b.zero_point))
    out = []
    for x, y in zip(A.ravel(), B.ravel()):
        acc = ref_fixed(int(x), s_a / common, "half_even") + sign * ref_fixed(int(y), s_b / common, "half_even")
        v = ref_fixed(acc, float(np.float32(common)) / float(np.float32(s_out)), "half_even") + z_out
        out.append(min(max(v, d.qmin), d.qmax))
    return np.array(out).reshape(A.shape)


@pytest.mark.parametrize("op,sign", [(add, 1), (sub, -1)])
@pytest.mark.parametrize("dtypes", [("qint8", "qint8"), ("quint8", "qint8"), ("qint4", "quint8"), ("qint16", "qint8")])
def test_add_sub_fixed(op, sign, dtypes, rng, backend):
    da, db = (qdtype(t) for t in dtypes)
    a = q_of(rng.integers(da.qmin, da.qmax + 1, (3, 4)), 0.037, (da.qmin + da.qmax) // 2, da)
    b = q_of(rng.integers(db.qmin, db.qmax + 1, (4,)), 0.011, db.qmin + 3, db)
    r = backend.run(op, a, b, scale=0.05, zero_point=-3, dtype="qint8")
    np.testing.assert_array_equal(r.int_repr(), ref_add(a, b, sign, 0.05, -3, "qint8"))
    assert r.shape == (3, 4)
    assert backend.ran("binary_"), backend.launched


def test_add_is_close_to_float_and_relu(rng, backend):
    a = qarray.quantize(rng.standard_normal(1000).astype(np.float32), 0.02, 0, "qint8")
    b = qarray.quantize(rng.standard_normal(1000).astype(np.float32), 0.03, 128, "quint8")
    r = backend.run(add, a, b, scale=0.04, zero_point=0, dtype="qint8")
    exact = qarray.quantize(a.dequantize("float64") + b.dequantize("float64"), 0.04, 0, "qint8")
    assert np.abs(r.int_repr().astype(int) - exact.int_repr()).max() <= 1
    rr = backend.run(add, a, b, scale=0.04, zero_point=0, dtype="qint8", relu=True)
    np.testing.assert_array_equal(rr.int_repr(), np.maximum(r.int_repr(), 0))


def test_add_float_mode_is_dequantize_add_quantize(rng, backend):
    a = qarray.quantize(rng.standard_normal(100).astype(np.float32), 0.02, 3, "qint8")
    b = qarray.quantize(rng.standard_normal(100).astype(np.float32), 0.03, 128, "quint8")
    r = backend.run(add, a, b, scale=0.04, zero_point=1, dtype="qint8", mode="float")
    want = qarray.quantize(a.dequantize() + b.dequantize(), 0.04, 1, "qint8")
    np.testing.assert_array_equal(r.int_repr(), want.int_repr())


def test_add_without_output_params(backend):
    a, b = q_of([1, 2], 0.5, 1, "qint8"), q_of([[3], [4]], 0.5, -1, "qint8")
    r = backend.run(add, a, b)
    assert r.dtype is qarray.qint32 and r.shape == (2, 2)
    np.testing.assert_array_equal(r.int_repr(), [[4, 5], [5, 6]])
    with pytest.raises(ValueError, match="inputs have scales 0.5 and 0.25; pass the output scale="):
        backend.run(add, a, q_of([1], 0.25, 0, "qint8"))


@pytest.mark.parametrize("mode", ["fixed", "float"])
def test_mul(mode, rng, backend):
    a = q_of(rng.integers(0, 256, (5, 1)), 0.02, 100, "quint8")
    b = q_of(rng.integers(-128, 128, (1, 6)), 0.03, -5, "qint8")
    prod = (a.int_repr().astype(np.int64) - 100) * (b.int_repr().astype(np.int64) + 5)
    acc = backend.run(mul, a, b)
    np.testing.assert_array_equal(acc.int_repr(), prod)
    assert acc.scale == np.float32(0.02) * np.float32(0.03)
    c = q_of(rng.integers(0, 256, (5, 6)), 0.02, 100, "quint8")  # b repeats along c: the CUDA kernel's case
    want = (c.int_repr().astype(np.int64) - 100) * (b.int_repr().astype(np.int64) + 5)
    np.testing.assert_array_equal(backend.run(mul, c, b).int_repr(), want)
    assert backend.ran("binary_uint8_int8"), backend.launched
    r = backend.run(mul, a, b, scale=0.5, zero_point=0, dtype="qint8", mode=mode)
    if mode == "fixed":
        want = [min(max(ref_fixed(int(p), float(np.float32(0.02)) * float(np.float32(0.03)) / float(np.float32(0.5)), "half_even"), -128), 127) for p in prod.ravel()]
    else:
        want = qarray.quantize(a.dequantize() * b.dequantize(), 0.5, 0, "qint8").int_repr()
    np.testing.assert_array_equal(r.int_repr().ravel(), np.ravel(want))


def test_scalars(backend):
    a = q_of([-10, 0, 7], 0.1, 2, "qint8")
    np.testing.assert_array_equal(backend.run(add_scalar, a, 0.3).int_repr(), [-7, 3, 10])
    np.testing.assert_array_equal(backend.run(add_scalar, a, 0.0).int_repr(), a.int_repr())
    m = backend.run(mul_scalar, a, -2.0)
    assert m.scale == np.float32(0.2) and int(m.zero_point) == -128 + 127 - 2
    np.testing.assert_allclose(m.dequantize(), -2 * a.dequantize(), rtol=1e-6)
    np.testing.assert_array_equal(backend.run(mul_scalar, a, 3.0, scale=0.1, zero_point=0, dtype="qint8").int_repr(),
                                  [-36, -6, 15])
    with pytest.raises(ValueError, match="finite and nonzero"):
        backend.run(mul_scalar, a, 0.0)
    with pytest.raises(ValueError, match="must be finite"):
        backend.run(add_scalar, a, np.inf)


def test_relu_family(backend):
    a = q_of([-128, -3, 2, 3, 40, 127], 0.25, 2, "qint8")
    np.testing.assert_array_equal(backend.run(relu, a).int_repr(), [2, 2, 2, 3, 40, 127])
    np.testing.assert_array_equal(backend.run(relu6, a).int_repr(), [2, 2, 2, 3, 26, 26])
    np.testing.assert_array_equal(backend.run(hardtanh, a).int_repr(), [-2, -2, 2, 3, 6, 6])
    np.testing.assert_array_equal(backend.run(clamp, a, max=0.5).int_repr(), [-128, -3, 2, 3, 4, 4])
    assert backend.ran("clip_int8"), backend.launched  # per-tensor bounds: the clip kernel
    r = backend.run(relu, a, scale=0.5, zero_point=0, dtype="quint8")
    assert r.dtype is qarray.quint8 and r.int_repr().tolist() == [0, 0, 0, 0, 19, 62]
    pa = QArray.from_int(np.array([[-5, 5], [-5, 5]]), [0.5, 1.0], [0, -2], "qint8", axis=0)
    np.testing.assert_array_equal(backend.run(relu, pa).int_repr(), [[0, 5], [-2, 5]])
    with pytest.raises(ValueError, match="min 2 is greater than max 1"):
        backend.run(clamp, a, 2, 1)


def test_errors():
    a = q_of([1, 2, 3], 0.1, 0, "qint8")
    with pytest.raises(ValueError, match=r"shapes \(3,\) and \(2,\) do not broadcast"):
        add(a, q_of([1, 2], 0.1, 0, "qint8"), scale=0.1, zero_point=0, dtype="qint8")
    with pytest.raises(TypeError, match="b must be a QArray, got float"):
        add(a, 1.0)
    with pytest.raises(ValueError, match="per-axis parameters"):
        mul(QArray.from_int(np.ones((2, 2), int), [1.0, 2.0], 0, "qint8", axis=0), a[:2])


def _slot_index(shape, axis, block_size):
    """For each element, its parameter's index (a tuple into the scale array)."""
    idx = np.indices(shape)
    if block_size is None:
        return (idx[axis],)
    idx[axis] //= block_size
    return tuple(idx)


@pytest.mark.parametrize("axis,block_size", [(0, None), (1, None), (2, None), (-1, None), (1, 2), (2, 3), (0, 1)])
def test_clamp_per_axis_and_blocked(axis, block_size, rng, backend):
    shape = (3, 4, 5)
    ax = axis % 3
    pshape = (shape[ax],) if block_size is None else \
        tuple(-(-n // block_size) if i == ax else n for i, n in enumerate(shape))
    scale = rng.uniform(0.01, 0.1, pshape).astype(np.float32)
    zp = rng.integers(-20, 20, pshape)
    codes = rng.integers(-128, 128, shape)
    q = QArray.from_int(codes, scale, zp, "qint8", axis=axis, block_size=block_size)
    where = _slot_index(shape, ax, block_size)
    s, z = scale[where], zp[where]

    def bound(v):  # quantize's rule, in float32, per element
        return np.clip(np.rint(np.float32(v) / s) + z, -128, 127)

    np.testing.assert_array_equal(backend.run(clamp, q, -0.3, 0.5).int_repr(), np.clip(codes, bound(-0.3), bound(0.5)))
    np.testing.assert_array_equal(backend.run(relu, q).int_repr(), np.maximum(codes, z))
    np.testing.assert_array_equal(backend.run(hardtanh, q, -1.0, 0.25).int_repr(),
                                  np.clip(codes, bound(-1.0), bound(0.25)))
    r = backend.run(relu6, q)
    np.testing.assert_array_equal(r.int_repr(), np.clip(codes, z, bound(6.0)))
    assert (r.axis, r.block_size) == (q.axis, q.block_size)


@pytest.mark.parametrize(
    "call,exc,message",
    [(lambda q: clamp(q, [0.1, 0.2]), TypeError, "clamp: min must be a real number or None, got list"),
     (lambda q: clamp(q, "low"), TypeError, "clamp: min must be a real number or None, got str"),
     (lambda q: clamp(q, None, np.array([1.0])), TypeError, "clamp: max must be a real number or None, got ndarray"),
     (lambda q: clamp(q, True), TypeError, "clamp: min must be a real number or None, got bool"),
     (lambda q: clamp(q, float("nan")), ValueError, "clamp: min must not be NaN"),
     (lambda q: hardtanh(q, [1.0]), TypeError, "hardtanh: min_val must be a real number or None, got list"),
     (lambda q: hardtanh(q, max_val="1"), TypeError, "hardtanh: max_val must be a real number or None, got str"),
     (lambda q: hardtanh(q, 2, 1), ValueError, "hardtanh: min_val 2 is greater than max_val 1"),
     (lambda q: relu6(np.ones(3)), TypeError, "relu6: q must be a QArray, got ndarray")],
)
def test_clamp_bounds_checked(call, exc, message):
    with pytest.raises(exc, match=message):
        call(q_of([1, 2, 3], 0.1, 0, "qint8"))


def test_clamp_bounds_beyond_float(backend):
    a = q_of([-128, 0, 127], 0.1, 0, "qint8")
    np.testing.assert_array_equal(backend.run(clamp, a, -(10**400), 10**400).int_repr(), [-128, 0, 127])
    np.testing.assert_array_equal(backend.run(clamp, a, np.float64(1e300)).int_repr(), [127, 127, 127])
