import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray.ops import cat, stack
from _reference import q_of


def test_identical_params_join_as_they_are():
    a, b = q_of([[1, 2]], 0.1, 3, "qint8"), q_of([[5, 6]], 0.1, 3, "qint8")
    r = cat([a, b])
    np.testing.assert_array_equal(r.int_repr(), [[1, 2], [5, 6]])
    assert (float(r.scale), int(r.zero_point), r.dtype) == (float(np.float32(0.1)), 3, qarray.qint8)
    assert cat([a, b], axis=-1).shape == (1, 4)


def test_per_axis_params_concatenate_along_their_axis():
    a = q_of([[1, 2], [3, 4]], [0.1, 0.2], [0, 1], "qint8", axis=0)
    b = q_of([[5, 6]], [0.3], [2], "qint8", axis=0)
    r = cat([a, b])
    assert r.axis == 0
    np.testing.assert_array_equal(r.scale, np.float32([0.1, 0.2, 0.3]))
    np.testing.assert_array_equal(r.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    r1 = cat([a, a], axis=1)  # same per-axis params, joined across the other axis
    assert r1.shape == (2, 4) and r1.axis == 0
    with pytest.raises(ValueError, match="different scales or zero points"):
        cat([a, q_of([[1, 2], [3, 4]], [0.1, 0.5], [0, 1], "qint8", axis=0)], axis=1)


def test_blocked_params_concatenate():
    x = np.arange(24, dtype=np.float32).reshape(3, 8) / 10
    a = qarray.quantize_dynamic(x, "qint4", axis=1, block_size=4)
    r = cat([a, a], axis=0)
    assert r.scale.shape == (6, 2)
    np.testing.assert_array_equal(r.dequantize(), np.concatenate([a.dequantize()] * 2))
    r = cat([a, a], axis=1)
    assert r.scale.shape == (3, 4) and r.block_size == 4
    np.testing.assert_array_equal(r.dequantize(), np.concatenate([a.dequantize()] * 2, axis=1))


@pytest.mark.parametrize("mode", ["fixed", "float"])
def test_mixed_params_requantize_integer_only(mode, backend):
    a = q_of([100, -100, 7], 0.1, 0, "qint8")
    b = q_of([255, 0, 128], 0.05, 128, "quint8")
    r = backend.run(lambda *qs: cat(qs, scale=0.1, zero_point=0, dtype="qint8", mode=mode), a, b)
    want = np.concatenate([a.int_repr(), qarray.requantize(b, 0.1, 0, "qint8", mode=mode).int_repr()])
    np.testing.assert_array_equal(r.int_repr(), want)
    np.testing.assert_array_equal(r.int_repr(), [100, -100, 7, 64, -64, 0])
    assert backend.ran("requantize_uint8_int8"), backend.launched  # b into its slice, a copied as it is


def test_mixed_params_along_a_later_axis(backend, rng):
    """Each input is requantized into a strided slice of the output (the Numba
    kernel writes a contiguous result, copied in; the CUDA backend's
    requantize_rows kernel writes the slice in place)."""
    a = qarray.quantize(rng.standard_normal((3, 2, 5)).astype(np.float32), 0.02, 3, "qint8")
    b = qarray.quantize(rng.standard_normal((3, 4, 5)).astype(np.float32), 0.05, 128, "quint8")
    r = backend.run(lambda *qs: cat(qs, axis=1, scale=0.03, zero_point=-2, dtype="qint8"), a, b)
    want = np.concatenate([qarray.requantize(q, 0.03, -2, "qint8").int_repr() for q in (a, b)], axis=1)
    np.testing.assert_array_equal(r.int_repr(), want)
    assert backend.ran("requantize_rows_int8_int8") and backend.ran("requantize_rows_uint8_int8"), backend.launched


def test_no_silent_clamp():
    """PyTorch's cat requantizes every input to the first one's scale and clamps;
    qarray asks for the output parameters instead."""
    a = q_of([10], 0.01, 0, "qint8")
    b = q_of([100], 1.0, 0, "qint8")
    with pytest.raises(ValueError, match="different scales or zero points; pass the output scale="):
        cat([a, b])
    with pytest.raises(TypeError, match="inputs have dtypes qint8, quint8; pass dtype="):
        cat([a, q_of([1], 0.01, 0, "quint8")])


def test_stack(backend):
    a, b = q_of([1, 2], 0.1, 0, "qint8"), q_of([3, 4], 0.1, 0, "qint8")
    r = backend.run(lambda *qs: stack(qs, axis=1), a, b)
    np.testing.assert_array_equal(r.int_repr(), [[1, 3], [2, 4]])
    pa = q_of([[1, 2], [3, 4]], [0.1, 0.2], 0, "qint8", axis=1)
    r = backend.run(lambda *qs: stack(qs), pa, pa)
    assert r.axis == 2 and r.shape == (2, 2, 2)
    np.testing.assert_array_equal(r.int_repr(), [[[1, 2], [3, 4]]] * 2)
    c = q_of([5, -6], 0.2, 1, "qint8")  # mixed parameters: each requantized, then joined
    r = backend.run(lambda *qs: stack(qs, axis=1, scale=0.1, zero_point=0, dtype="qint8"), a, c)
    np.testing.assert_array_equal(r.int_repr(), [[1, 8], [2, -14]])  # (5 - 1) * 2, (-6 - 1) * 2
    assert backend.ran("requantize_rows_int8_int8"), backend.launched
    with pytest.raises(ValueError, match="must have one shape"):
        stack([a, q_of([1], 0.1, 0, "qint8")])


def test_errors():
    a = q_of([[1, 2]], 0.1, 0, "qint8")
    with pytest.raises(ValueError, match="at least one"):
        cat([])
    with pytest.raises(TypeError, match="input 1 is a ndarray, not a QArray"):
        cat([a, np.ones((1, 2))])
    with pytest.raises(ValueError, match=r"shapes \(1, 2\) and \(1, 3\) differ off axis 0"):
        cat([a, q_of([[1, 2, 3]], 0.1, 0, "qint8")])
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        cat([a, a], axis=2)
