"""sum, mean, avg_pool2d and adaptive_avg_pool2d (qarray/ops/pool.py) against
the exact rational reference of tests/_reference.py: the exact accumulator
requantized (sum), the exact mean rounded once (the others), means on and
within the last bit of a tie, on both CPU paths (``kernels``)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from _reference import (DTYPES, RULES, HALF, I32, rounding_kw, ref_multiplier, ref_out, ref_mean, f32_ratio,
                        exact_settings, check_path, paths, scales, zero_points, draw_code)

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def reduce_cases(draw, name, ndim_lo=1, ndim_hi=3):
    qi = qdtype(name)
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim_lo, max_size=ndim_hi)))
    zi = draw(zero_points(qi))
    s_in = draw(scales(-20, 20))
    q = np.array([draw_code(draw, qi.qmin, qi.qmax, zi) for _ in range(math.prod(shape))]).reshape(shape)
    if draw(st.integers(0, 2)) == 0:  # many values at one end: sums of qint32 codes reach 2**40
        q = np.broadcast_to(q, (draw(st.sampled_from([64, 256])),) + shape)
        q = np.ascontiguousarray(q)
        q.reshape(-1)[: q.size // 2] = qi.qmax if qi.qmax - zi >= zi - qi.qmin else qi.qmin  # the far end
    return q, s_in, zi


def _out_params(draw, qi, qo, s_in, width):
    """Output parameters that land inside (and sometimes far off)."""
    land = width - qo.bits
    s_out = np.float32(float(s_in) * 2.0 ** draw(st.one_of(st.integers(land - 3, land + 2), st.integers(-28, 40)))
                       * draw(st.sampled_from([1.0, 1.0, 1.5, 0.75, 1.1])))
    return s_out, draw(zero_points(qo))


@pytest.mark.parametrize(**paths("name,dout", list(zip(DTYPES, ["qint8", "quint8", "qint16", "qint32", "qint32",
                                                                "quint16", "qint8", "qint32", "qint32"])),
                                 [("qint32", "qint32")]))
@exact_settings(25)
@given(data=st.data())
def test_sum_and_mean(name, dout, kernels, data):
    """sum (the exact accumulator requantized) and mean (the exact mean rounded
    once) over any axes; accumulators up to 2**40 (qint32 codes at one end)."""
    check_path(kernels)
    qi, qo = qdtype(name), qdtype(dout)
    q, s_in, zi = data.draw(reduce_cases(name))
    axes = data.draw(st.sampled_from([None, 0, -1, (0, -1)] if q.ndim > 1 else [None, 0]))
    keepdims = data.draw(st.booleans())
    red = tuple(range(q.ndim)) if axes is None else tuple(a % q.ndim for a in (axes if isinstance(axes, tuple) else (axes,)))
    count = math.prod(q.shape[a] for a in red)
    acc = (q.astype(object) - zi).sum(axis=red, keepdims=keepdims)
    acc = np.asarray(acc, object)
    x = QArray.from_int(q.astype(qi.storage), s_in, zi, name)
    s_out, zo = _out_params(data.draw, qi, qo, s_in, qi.bits + count.bit_length())
    sm, zm = _out_params(data.draw, qi, qo, s_in, qi.bits)
    default_mean = data.draw(st.booleans())
    for rule in RULES:
        want = np.empty(acc.shape, np.int64)
        for idx in np.ndindex(acc.shape):
            want[idx] = ref_out(int(acc[idx]), float(s_in) / float(s_out), f32_ratio(num=[s_in], den=s_out),
                                zo, qo.qmin, qo.qmax, rule)
        got = qa.sum(x, axes, keepdims, scale=s_out, zero_point=zo, dtype=dout, **rounding_kw(rule))
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=f"sum {rule}")
        # mean: the input's parameters by default, else others
        m_s, m_z, m_d = (s_in, zi, qi) if default_mean else (sm, zm, qo)
        M = float(s_in) / float(m_s)
        if rule != "float" and ref_multiplier(M)[1] < 1:
            with pytest.raises(ValueError, match="too large for an exact average"):
                qa.mean(x, axes, keepdims, scale=m_s, zero_point=m_z, dtype=m_d.name, **rounding_kw(rule))
            continue
        want = np.empty(acc.shape, np.int64)
        for idx in np.ndindex(acc.shape):
            want[idx] = ref_mean(int(acc[idx]), count, M, f32_ratio(num=[s_in], den=m_s), m_z, m_d.qmin, m_d.qmax, rule)
        kw = {} if default_mean else dict(scale=m_s, zero_point=m_z, dtype=m_d.name)
        got = qa.mean(x, axes, keepdims, **kw, **rounding_kw(rule))
        assert got.data.dtype == m_d.storage and got.dtype is m_d
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=f"mean {rule}")


@st.composite
def mean_near_ties(draw):
    """``count`` qint32 codes whose sum ``acc`` has ``acc * m = (2j + 1) * count *
    2**(s - 1) + t`` with ``|t| < count``: the exact mean times ``m / 2**s`` is a
    half (t = 0) or misses one by less than the last bit, where only the
    remainder of the division by ``count`` decides. ``m`` odd and prime to
    ``count``, so ``j`` exists for every ``t`` (a modular inverse)."""
    count = draw(st.sampled_from([2, 3, 5, 6, 7, 9]))
    s_in = draw(scales(-10, 10))
    s_out = np.float32(float(s_in) / draw(st.floats(0.25, 1.0, exclude_max=True)))
    M = float(s_in) / float(s_out)
    m, s = ref_multiplier(M)
    assume(m % 2 == 1 and math.gcd(m, count) == 1 and 1 <= s <= 32)
    t = draw(st.integers(-(count - 1), count - 1))
    c = count * 2 ** (s - 1)
    r = (-t * pow(c, -1, m)) % m
    r = r if r % 2 else r + m  # odd, the same residue (m is odd)
    assert (r * c + t) % m == 0
    sign = draw(st.sampled_from([1, -1]))
    acc = sign * ((r * c + t) // m)
    zi = I32[0] if sign > 0 else I32[1]  # the far end: |q - zp| up to 2**32 - 1
    parts = [abs(acc) // count] * count
    parts[0] += abs(acc) - sum(parts)
    d = [sign * v for v in parts]
    assume(max(parts) < 2**32)  # |q - zp| of a qint32 code reaches 2**32 - 1 at most
    return np.array([zi + v for v in d], np.int64), s_in, s_out, zi, acc, sign * t


@exact_settings(100)
@given(data=st.data())
def test_mean_near_ties(kernels, data):
    """mean / avg_pool2d / adaptive_avg_pool2d where the exact mean sits on, or
    within the last bit of, a half: the rounding must see the remainder of the
    division by the count."""
    check_path(kernels)
    q, s_in, s_out, zi, acc, t = data.draw(mean_near_ties())
    count = q.size
    x = QArray.from_int(q.astype(np.int32).reshape(1, 1, 1, count), s_in, zi, "qint32")
    M = float(s_in) / float(s_out)
    m, s = ref_multiplier(M)
    v = Fraction(acc * m, count * 2**s)
    assert (v - math.floor(v) - HALF) * count * 2**s == t  # on a half, or off it by t / count of the last bit
    for rule in RULES:
        want = ref_mean(acc, count, M, f32_ratio(num=[s_in], den=s_out), 0, *I32, rule)
        kw = dict(scale=s_out, zero_point=0, dtype="qint32", **rounding_kw(rule))
        assert int(qa.mean(x, **kw).int_repr()) == want, rule
        assert int(qa.avg_pool2d(x, (1, count), **kw).int_repr()[0, 0, 0, 0]) == want, rule
        assert int(qa.adaptive_avg_pool2d(x, 1, **kw).int_repr()[0, 0, 0, 0]) == want, rule


def _ref_pool(q, zi, windows, out_shape):
    """``(sums, counts)`` of ``q - zi`` over each window ``(h0, h1, w0, w1, count)``."""
    n, c = q.shape[:2]
    sums = np.empty((n, c) + out_shape, object)
    counts = np.empty(out_shape, object)
    d = q.astype(object) - zi
    for (i, j), (h0, h1, w0, w1, cnt) in windows.items():
        counts[i, j] = cnt
        for b in range(n):
            for ch in range(c):
                sums[b, ch, i, j] = int(d[b, ch, max(h0, 0):h1, max(w0, 0):w1].sum())
    return sums, counts


@pytest.mark.parametrize(**paths("name", DTYPES, []))
@exact_settings(25)
@given(data=st.data())
def test_avg_pools(name, kernels, data):
    """avg_pool2d (padding, count_include_pad, stride) and adaptive_avg_pool2d:
    each window's exact mean rounded once, default or given output parameters."""
    check_path(kernels)
    qi = qdtype(name)
    n, c, h, w = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)),
                  data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5)))
    zi, s_in = data.draw(zero_points(qi)), data.draw(scales(-20, 20))
    q = np.array([draw_code(data.draw, qi.qmin, qi.qmax, zi) for _ in range(n * c * h * w)]).reshape(n, c, h, w)
    x = QArray.from_int(q.astype(qi.storage), s_in, zi, name)
    three = data.draw(st.booleans()) and n == 1
    xin = QArray.from_int(q[0].astype(qi.storage), s_in, zi, name) if three else x
    # avg_pool2d windows
    kh, kw = data.draw(st.integers(1, h)), data.draw(st.integers(1, w))
    ph, pw = data.draw(st.integers(0, kh // 2)), data.draw(st.integers(0, kw // 2))
    sh, sw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    include = data.draw(st.booleans())
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    win = {}
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * sh - ph, j * sw - pw
            real = (min(h0 + kh, h) - max(h0, 0)) * (min(w0 + kw, w) - max(w0, 0))
            win[i, j] = (h0, h0 + kh, w0, w0 + kw, kh * kw if include else real)
    pooled = _ref_pool(q, zi, win, (oh, ow))
    # adaptive windows: [floor(i * H / OH), ceil((i + 1) * H / OH))
    ah, aw = data.draw(st.integers(1, h + 1)), data.draw(st.integers(1, w + 1))
    awin = {(i, j): (i * h // ah, -(-(i + 1) * h // ah), j * w // aw, -(-(j + 1) * w // aw),
                     (-(-(i + 1) * h // ah) - i * h // ah) * (-(-(j + 1) * w // aw) - j * w // aw))
            for i in range(ah) for j in range(aw)}
    adaptive = _ref_pool(q, zi, awin, (ah, aw))
    default = data.draw(st.booleans())
    qo = qi if default else qdtype(data.draw(st.sampled_from(DTYPES)))
    s_out, zo = (s_in, zi) if default else _out_params(data.draw, qi, qo, s_in, qi.bits)
    kw_out = {} if default else dict(scale=s_out, zero_point=zo, dtype=qo.name)
    M = float(s_in) / float(s_out)
    for rule in RULES:
        calls = [(lambda: qa.avg_pool2d(xin, (kh, kw), (sh, sw), (ph, pw), count_include_pad=include,
                                        **kw_out, **rounding_kw(rule)), pooled),
                 (lambda: qa.adaptive_avg_pool2d(xin, (ah, aw), **kw_out, **rounding_kw(rule)), adaptive)]
        for call, (sums, counts) in calls:
            if rule != "float" and ref_multiplier(M)[1] < 1:
                with pytest.raises(ValueError, match="too large for an exact average"):
                    call()
                continue
            want = np.empty(sums.shape, np.int64)
            for idx in np.ndindex(sums.shape):
                want[idx] = ref_mean(sums[idx], counts[idx[2:]], M, f32_ratio(num=[s_in], den=s_out), zo,
                                     qo.qmin, qo.qmax, rule)
            got = call()
            assert got.data.dtype == qo.storage
            np.testing.assert_array_equal(got.int_repr(), want[0] if three else want, err_msg=rule)
