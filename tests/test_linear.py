import dataclasses

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray._fixed_point import plan
from qarray._params import Gemm, kept
from qarray.ops import linear, matmul

from _reference import rand_q

ACTS = ["quint8", "qint8", "qint4", "quint4", "qint2"]
WEIGHTS = ["qint8", "quint8", "qint4", "quint4"]


def ref_acc(a, b):
    """int64 reference of sum_k (a - za)(b - zb), b per-tensor or per-column."""
    from qarray._params import expand

    A = a.int_repr().astype(np.int64) - np.int64(a.zero_point)
    zb = expand(b.zero_point.astype(np.int64), b.shape, b.axis, None)
    return A @ (b.int_repr().astype(np.int64) - zb)


@pytest.mark.parametrize("adt", ACTS)
@pytest.mark.parametrize("wdt", WEIGHTS)
@pytest.mark.parametrize("per_channel", [False, True])
def test_matmul_exact_every_dtype_pair(adt, wdt, per_channel, rng, backend):
    a = rand_q(rng, (7, 33), adt)
    b = rand_q(rng, (33, 5), wdt, axis=1 if per_channel else None)
    r = backend.run(matmul, a, b)
    # 7 rows: the CUDA backend's gemv (4-bit weights packed two to a byte), never the float32 fallback
    assert backend.ran(f"gemv{4 if qarray.qdtype(wdt).bits <= 4 else 8}_16"), backend.launched
    assert r.dtype is qarray.qint32
    np.testing.assert_array_equal(r.int_repr(), ref_acc(a, b))
    want_scale = np.float32(a.scale) * b.scale.astype(np.float32)
    np.testing.assert_array_equal(r.scale, want_scale)
    assert r.axis == (1 if per_channel else None)


@pytest.mark.parametrize("k", [1, 7, 1000, 1025, 4097, 16384])
def test_matmul_exact_long_k(k, rng):
    a = rand_q(rng, (3, k), "quint8")
    b = rand_q(rng, (k, 2), "qint8", axis=1)
    np.testing.assert_array_equal(matmul(a, b).int_repr(), ref_acc(a, b))


def test_matmul_extreme_values_do_not_wrap():
    # every product at its largest: 16384 * 255 * 255 > 2**30 needs int64 inside
    k = 16384
    a = QArray.from_int(np.full((1, k), 255), 1.0, 0, "quint8")
    b = QArray.from_int(np.full((k, 1), 0), 1.0, 127, "quint8")  # w - zw = -127
    acc = matmul(a, b)
    assert acc.int_repr().tolist() == [[-255 * 127 * k]]
    a2 = QArray.from_int(np.full((1, 40000), 255), 1.0, 0, "quint8")
    b2 = QArray.from_int(np.full((40000, 1), 255), 1.0, 0, "quint8")
    with pytest.raises(ValueError, match="beyond qint32; pass output scale="):
        matmul(a2, b2)
    r = matmul(a2, b2, scale=1e4, zero_point=0, dtype="qint32")
    assert r.int_repr().tolist() == [[round(255 * 255 * 40000 / 1e4)]]


def test_matmul_batched(rng, backend):
    a = rand_q(rng, (2, 3, 4, 9), "qint8")
    b = rand_q(rng, (9, 6), "qint8")
    np.testing.assert_array_equal(backend.run(matmul, a, b).int_repr(), ref_acc(a, b))
    assert backend.ran("gemm_epilogue_int32_int32"), backend.launched  # 24 rows: cuBLAS's int8 GEMM, our epilogue
    bb = rand_q(rng, (3, 9, 6), "quint8")  # batched weights: the generic GEMM
    if backend.name == "dask":  # Dask takes 2-D weights only (test_dask.py pins the error)
        with pytest.raises(TypeError, match="takes 2-D weights"):
            backend.run(matmul, a, bb)
    else:
        np.testing.assert_array_equal(backend.run(matmul, a, bb).int_repr(), ref_acc(a, bb))


@pytest.mark.parametrize("mode", ["fixed", "float"])
@pytest.mark.parametrize("rounding", ["half_even", "half_away", "tflite"])
def test_requantized_output_equals_requantizing_the_accumulator(mode, rounding, rng, backend):
    a = rand_q(rng, (5, 40), "quint8")
    b = rand_q(rng, (40, 6), "qint8", axis=1)
    r = backend.run(matmul, a, b, scale=0.02, zero_point=5, dtype="qint8", mode=mode, rounding=rounding)
    assert backend.ran("gemv8_16"), backend.launched  # requantized in gemv's epilogue
    acc = QArray.from_int(ref_acc(a, b), np.float32(a.scale) * b.scale, 0, "qint32", axis=1)
    want = qarray.requantize(acc, 0.02, 5, "qint8", mode=mode, rounding=rounding)
    np.testing.assert_array_equal(r.int_repr(), want.int_repr())
    assert (r.axis, r.dtype, float(r.scale), int(r.zero_point)) == (None, qarray.qint8, float(np.float32(0.02)), 5)


def test_relu_and_bias(rng):
    x = rand_q(rng, (4, 16), "quint8")
    w = rand_q(rng, (3, 16), "qint8", axis=0)
    bias = np.array([0.5, -20.0, 3.0], np.float32)
    acc_scale = np.float32(x.scale) * w.scale
    acc = ref_acc(x, w.T) + np.rint(bias / acc_scale).astype(np.int64)
    r = linear(x, w, bias, scale=0.1, zero_point=10, dtype="quint8", relu=True)
    want = qarray.requantize(QArray.from_int(acc, acc_scale, 0, "qint32", axis=1), 0.1, 10, "quint8")
    np.testing.assert_array_equal(r.int_repr(), np.maximum(want.int_repr(), 10))
    qb = QArray.from_int(np.rint(bias / acc_scale).astype(np.int64), acc_scale, 0, "qint32", axis=0)
    np.testing.assert_array_equal(linear(x, w, qb).int_repr(), acc)
    # a qint32 bias at another scale is requantized to the accumulator's first
    qb2 = qarray.quantize(bias, 0.01, 0, "qint32")
    r2 = linear(x, w, qb2)
    want_b = qb2.requantize(acc_scale, 0, "qint32", axis=0).int_repr()
    np.testing.assert_array_equal(r2.int_repr(), ref_acc(x, w.T) + want_b)


def test_linear_1d_and_matches_matmul(rng):
    x = rand_q(rng, (16,), "qint8")
    w = rand_q(rng, (3, 16), "qint4")
    r = linear(x, w)
    assert r.shape == (3,)
    np.testing.assert_array_equal(r.int_repr(), ref_acc(x.reshape(1, 16), w.T)[0])


def test_errors(rng):
    a = rand_q(rng, (2, 3), "qint8")
    b = rand_q(rng, (4, 5), "qint8")
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) and \(4, 5\) do not align: 3 != 4"):
        matmul(a, b)
    with pytest.raises(TypeError, match="b must be a QArray, got ndarray"):
        matmul(a, np.ones((3, 2)))
    with pytest.raises(TypeError, match=r"b has dtype qint16; matmul, linear and conv2d take weights of 2, 4 or 8 bits"):
        matmul(a, QArray.from_int(np.ones((3, 2), np.int16), 1.0, 0, "qint16"))
    with pytest.raises(TypeError, match=r"a has dtype qint32; matmul, linear and conv2d take inputs of 2, 4, 8 or 16 bits"):
        matmul(QArray.from_int(np.ones((2, 3), np.int32), 1.0, 0, "qint32"), b)
    with pytest.raises(ValueError, match="a's per-channel parameters lie along axis 1; they must lie along its rows"):
        matmul(rand_q(rng, (2, 3), "qint8", axis=1), rand_q(rng, (3, 2), "qint8"))
    w = rand_q(rng, (3, 4), "qint8", axis=1)
    with pytest.raises(ValueError, match="per-channel weights must have their parameters along axis 0"):
        linear(rand_q(rng, (2, 4), "qint8"), w)
    with pytest.raises(ValueError, match="b's per-channel parameters lie along axis 0; they must lie along its columns"):
        matmul(rand_q(rng, (2, 3), "qint8"), rand_q(rng, (3, 4), "qint8", axis=0))
    with pytest.raises(ValueError, match=r"bias must be a float array of shape \(3,\)"):
        linear(rand_q(rng, (2, 4), "qint8"), rand_q(rng, (3, 4), "qint8"), np.ones(2))
    with pytest.raises(ValueError, match="pass the output scale="):
        matmul(a, rand_q(rng, (3, 2), "qint8"), dtype="qint8")


def test_empty_k_gives_zeros(kernels):
    """As NumPy: a sum over nothing is 0; then bias and output params as usual."""
    a = QArray.from_int(np.zeros((2, 0), np.int8), 0.5, 3, "quint8")
    w = QArray.from_int(np.zeros((0, 3), np.int8), [1.0, 2.0, 3.0], [1, 0, -1], "qint8", axis=1)
    r = matmul(a, w)
    assert r.dtype is qarray.qint32 and r.shape == (2, 3)
    np.testing.assert_array_equal(r.int_repr(), np.zeros((2, 3)))
    np.testing.assert_array_equal(r.scale, [0.5, 1.0, 1.5])
    bias = np.array([1.0, 2.0, -3.0], np.float32)
    np.testing.assert_array_equal(matmul(a, w, bias=bias).int_repr(), [[2, 2, -2]] * 2)  # bias / (0.5 * w.scale)
    r = matmul(a, w, bias=bias, scale=0.5, zero_point=5, dtype="quint8")
    np.testing.assert_array_equal(r.int_repr(), [[7, 9, 0]] * 2)  # 1/0.5 + 5, 2/0.5 + 5, -3/0.5 + 5 -> 0
    assert matmul(a.reshape(1, 2, 0), w).shape == (1, 2, 3)
    w2 = QArray.from_int(np.zeros((3, 0), np.int8), 1.0, 0, "qint8")
    np.testing.assert_array_equal(linear(a, w2, scale=1.0, zero_point=-7, dtype="qint8").int_repr(), [[-7] * 3] * 2)


def test_bias_that_does_not_fit_names_the_channels(rng):
    x = rand_q(rng, (2, 4), "quint8", scale=0.01)
    w = QArray.from_int(rng.integers(-5, 5, (3, 4)), [0.1, 1e-12, 0.2], 0, "qint8", axis=0)
    with pytest.raises(ValueError, match=r"linear: bias / \(input scale \* weight scale\) does not fit in int32 for "
                                         r"output channel\(s\) \[1\] \(channel 1: bias 1\.0, input scale \* weight scale 1e-14\)"):
        linear(x, w, np.array([1.0, 1.0, 1.0], np.float32))
    w5 = QArray.from_int(rng.integers(-5, 5, (5, 4)), 1e-12, 0, "qint8")
    with pytest.raises(ValueError, match=r"output channel\(s\) \[0, 1, 2\] and 2 more"):
        linear(x, w5, np.ones(5, np.float32))


def test_a_gemm_plan_is_frozen_and_kept_by_identity():
    """``Gemm``, as ``Requant``, is an immutable record taken whole by the
    backends: its fields cannot be set, it hashes, and ``kept`` keys it by
    identity (the entry holds it): two plans of the same fields are two keys."""
    gp = Gemm(3, np.arange(4), None, None, np.int32, qarray.qint8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        gp.za = 4
    twin = dataclasses.replace(gp)
    assert hash(gp) == hash(gp) and twin != gp and len({gp, twin}) == 2
    calls = []
    count = kept(lambda g: calls.append(g) or len(calls))
    assert count(gp) == count(gp) == 1 and count(twin) == 2


def _primitives(backend):
    """The ``Backend`` the ``backend`` fixture's ops run on."""
    return backend.host or qarray.backends.get("dask" if backend.name == "dask" else "numpy")


@pytest.mark.parametrize("gemm", ["auto", "blas"])
def test_gemm_primitives_write_into_out(gemm, rng, backend):
    """int_matmul and conv_grouped take their inputs, one ``Gemm`` and ``out=``:
    the result is written into ``out`` (returned itself; a strided view is
    filled, what lies around it untouched), the integers of the call without
    it. Dask, whose arrays cannot be written, refuses ``out=``: TypeError.
    (``gemm="blas"``: the NumPy backend's generic int_matmul and its Numba epilogue.)"""
    b = _primitives(backend)
    rq = plan([np.float32(0.05), np.float32(0.02)], np.float32(0.3), np.int64(0), np.int32(-3), qarray.qint8, "fixed",
              "half_even")
    a, xpad = rng.integers(0, 256, (40, 64)).astype(np.uint8), rng.integers(0, 256, (2, 6, 7, 9)).astype(np.uint8)
    wc = rng.integers(-100, 100, (12, 3, 3, 2)).astype(np.int32)
    with qarray.config.using(gemm=gemm):
        pw = b.pack_weight(rng.integers(-128, 128, (64, 33)).astype(np.int8), qarray.qint8)
        if backend.name == "dask":
            a, xpad = b.xp.from_array(a, chunks=(16, 64)), b.xp.from_array(xpad, chunks=(1, 6, 7, 9))
        cases = [(lambda gp, out=None: b.int_matmul(a, pw, gp, out=out),
                  Gemm(3, np.arange(33) % 5, rng.integers(-999, 999, 33), r, np.int32, qarray.quint8))
                 for r in (None, rq)]
        cases += [(lambda gp, out=None: b.conv_grouped(xpad, wc, gp, out=out),
                   Gemm(3, bias=rng.integers(-999, 999, 12), rq=r, groups=2, stride=(2, 1), dilation=(1, 2)))
                  for r in (None, rq)]
        for call, gp in cases:
            want = backend.get(call(gp))
            if backend.name == "dask":
                with pytest.raises(TypeError, match="out= is not supported for dask arrays"):
                    call(gp, out=np.empty(want.shape, want.dtype))
                continue
            out = np.empty(want.shape, want.dtype)
            assert call(gp, out=out) is out
            np.testing.assert_array_equal(out, want)
            around = np.full(want.shape[:-1] + (want.shape[-1] + 2,), 7, want.dtype)
            assert call(gp, out=around[..., 1:-1]).base is around
            np.testing.assert_array_equal(around[..., 1:-1], want)
            assert (around[..., [0, -1]] == 7).all()
