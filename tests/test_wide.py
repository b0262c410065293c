"""The silent wrong results of issue 8, each pinned with its exact answer:
wide add/sub operands, accumulators beyond 2**32, qint32 products, tiny and
huge multipliers. Expected values come from Python integers or Fractions."""

from fractions import Fraction

import numpy as np
import pytest

import qarray as qa
from qarray import QArray
from _reference import round_rational


def test_add_of_qint16_does_not_saturate(kernels):
    a = QArray.from_int(np.array([32767, 1000, -32768], np.int16), 1.0, 0, "qint16")
    zero = QArray.from_int(np.zeros(3, np.int16), 1.0, 0, "qint16")
    for op in (qa.add, qa.sub):
        got = op(a, zero, scale=1.0, zero_point=0, dtype="qint16").int_repr()
        np.testing.assert_array_equal(got, [32767, 1000, -32768])


def test_add_of_qint32_does_not_saturate(kernels):
    a = QArray.from_int(np.array([5000, 2**31 - 1, -(2**31), 123456789], np.int32), 1.0, 0, "qint32")
    zero = QArray.from_int(np.zeros(4, np.int32), 1.0, 0, "qint32")
    got = qa.add(a, zero, scale=1.0, zero_point=0, dtype="qint32").int_repr()
    np.testing.assert_array_equal(got, [5000, 2**31 - 1, -(2**31), 123456789])
    # zero points at both ends: centred values of nearly 2**32
    a = QArray.from_int(np.array([2**31 - 1, -(2**31)], np.int32), 1.0, -(2**31), "qint32")
    b = QArray.from_int(np.array([-(2**31), 2**31 - 1], np.int32), 1.0, 2**31 - 1, "qint32")
    got = qa.add(a, b, scale=2.0, zero_point=-(2**31), dtype="qint32").int_repr()
    # (2**32 - 1) + (-(2**32 - 1)) = 0 and 0 + 0 = 0, at scale 2 plus the zero point
    np.testing.assert_array_equal(got, [-(2**31), -(2**31)])


def test_sum_beyond_2_32_requantizes_exactly(kernels):
    q = QArray.from_int(np.full(2**26, 127, np.int8), 1.0, 0, "qint8")
    # 127 * 2**26 = 8522825728 at scale 1 into scale 2**26 * 1.27: exactly 100
    got = qa.sum(q, scale=np.float32(2**26 * 1.27), zero_point=0, dtype="qint8").int_repr()
    want = round_rational(Fraction(127 * 2**26) / Fraction(float(np.float32(2**26 * 1.27))))
    assert int(got) == want == 100
    big = QArray.from_int(np.full(8, 2**31 - 1, np.int32), 1.0, 0, "qint32")
    got = qa.sum(big, scale=16.0, zero_point=0, dtype="qint32").int_repr()
    assert int(got) == round_rational(Fraction(8 * (2**31 - 1), 16)) == 2**30  # was 0
    got = qa.sum(big, scale=2.0, zero_point=0, dtype="qint32").int_repr()
    assert int(got) == 2**31 - 1  # 4 * (2**31 - 1) saturates
    got = qa.sum(big, scale=2.0**28, zero_point=0, dtype="qint8").int_repr()
    assert int(got) == round_rational(Fraction(8 * (2**31 - 1), 2**28)) == 64


def test_linear_with_k_300000(kernels):
    k = 300_000
    x = QArray.from_int(np.full((1, k), 255, np.uint8), 1.0, 0, "quint8")
    w = QArray.from_int(np.full((1, k), -128, np.int8), 1.0, 0, "qint8")
    got = qa.linear(x, w, scale=1e8, zero_point=0, dtype="qint8").int_repr()
    want = round_rational(Fraction(255 * -128 * k) / Fraction(float(np.float32(1e8))))
    assert int(got[0, 0]) == want == -98


def test_mul_of_qint32_is_exact_or_raises():
    a = QArray.from_int(np.array([2**31 - 1], np.int32), 1.0, -(2**31), "qint32")
    with pytest.raises(ValueError, match=r"mul: the exact products of these qint32 and qint32 inputs reach "
                                         r"18446744065119617025, beyond int64; requantize one input to 16 bits first"):
        qa.mul(a, a, scale=2.0**40, zero_point=0, dtype="qint32")
    # the same dtypes with values whose products fit are exact
    b = QArray.from_int(np.array([-(2**31) + 3, 2**31 - 1], np.int32), 1.0, -(2**31), "qint32")
    c = QArray.from_int(np.array([2**30, -5], np.int32), 1.0, 0, "qint32")
    got = qa.mul(b, c, scale=2.0**30, zero_point=0, dtype="qint32").int_repr()
    want = [round_rational(Fraction(3 * 2**30, 2**30)), round_rational(Fraction((2**32 - 1) * -5, 2**30))]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ratio", [2.0**-33, 2.0**-40, 2.0**-60, 3 * 2.0**-65, 2.0**-100])
def test_multipliers_below_2_minus_32_are_kept(ratio, kernels):
    """TFLite's cap made these 0; with 128-bit products they are exact."""
    d = np.array([2**40, -(2**40) - 2**39, 2**62, -(2**62), 12345, 2**63 - 1, -(2**63)], np.int64)
    acc = QArray.from_int(np.zeros(d.size, np.int32), 1.0, 0, "qint32")
    # through the backend primitive: the accumulators of sum / linear are int64
    from qarray._fixed_point import plan

    rq = plan([np.float64(ratio)], np.float32(1.0), 0, 0, qa.qint32, "fixed", "half_even")
    got = acc._backend.requantize(d, rq)
    want = [min(max(round_rational(int(v) * Fraction(ratio)), -(2**31)), 2**31 - 1) for v in d]
    np.testing.assert_array_equal(got, want)
    assert any(want) == (ratio > 2.0**-90)
