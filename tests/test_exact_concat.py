"""cat (qarray/ops/concat.py) against the exact rational reference of
tests/_reference.py: each input requantized to the output's parameters, per
tensor or per axis, every rounding, on both CPU paths (``kernels``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from _reference import (RULES, rounding_kw, ref_out, f32_ratio, expand, exact_settings, check_path, paths,
                        scales, zero_points, draw_code)

pytestmark = pytest.mark.usefixtures("one_thread")


# (storage pairs shared with test_exact_requantize: each new one is a Numba compile)
@pytest.mark.parametrize(**paths("d_ins,d_out", [(["qint2", "qint4", "qint8", "qint32"], "qint8"),
                                                (["quint2", "quint4", "quint8"], "quint8"),
                                                (["qint16", "quint16"], "qint16"), (["qint32", "qint32"], "qint32")],
                                 []))
@exact_settings(40)
@given(data=st.data())
def test_cat(d_ins, d_out, kernels, data):
    """cat requantizes each input (per-tensor or per-axis) to the output's parameters."""
    check_path(kernels)
    qo = qdtype(d_out)
    ndim = data.draw(st.integers(1, 2))
    axis = data.draw(st.integers(0, ndim - 1))
    s_out, zo = data.draw(scales(-20, 10)), data.draw(zero_points(qo))
    parts, want = [], {r: [] for r in RULES}
    for name in d_ins:
        qi = qdtype(name)
        shape = [2] * ndim
        shape[axis] = data.draw(st.integers(1, 3))
        shape = tuple(shape)
        pax = data.draw(st.sampled_from([None, *range(ndim)]))
        n = 1 if pax is None else shape[pax]
        if name == d_out and pax is None and data.draw(st.booleans()):
            s_in, zi = [s_out], [zo]
        else:
            land = qo.bits - qi.bits
            s_in = [np.float32(s_out * 2.0 ** data.draw(st.one_of(st.integers(land - 3, land + 3), st.integers(-50, 30)))
                               * data.draw(st.sampled_from([1.0, 1.5, 1.3]))) for _ in range(n)]
            zi = [data.draw(zero_points(qi)) for _ in range(n)]
        # the same dtype and parameters: joined as it is, not requantized (with
        # rounding="tflite" that differs: M = 1 is 2**30 / 2**30, a left shift
        # by 1 that saturates |q - zp| >= 2**30 as gemmlowp does)
        same = name == d_out and pax is None and s_in[0] == s_out and zi[0] == zo
        S, Z = expand(np.array(s_in), shape, pax), expand(np.array(zi), shape, pax)
        q = np.empty(shape, np.int64)
        for idx in np.ndindex(shape):
            q[idx] = draw_code(data.draw, qi.qmin, qi.qmax, int(Z[idx]), float(S[idx]) / float(s_out),
                               (qo.qmin - zo, qo.qmax - zo))
        parts.append(QArray.from_int(q.astype(qi.storage), np.array(s_in) if pax is not None else s_in[0],
                                     np.array(zi, np.int32) if pax is not None else zi[0], name, axis=pax))
        for rule in RULES:
            w = np.empty(shape, np.int64)
            for idx in np.ndindex(shape):
                f = f32_ratio(num=[S[idx]], den=s_out)
                assert f is not None
                w[idx] = ref_out(int(q[idx]) - int(Z[idx]), float(S[idx]) / float(s_out), f, zo, qo.qmin, qo.qmax, rule)
            want[rule].append(q if same else w)
    for rule in RULES:
        got = qa.cat(parts, axis, scale=s_out, zero_point=zo, dtype=d_out, **rounding_kw(rule))
        np.testing.assert_array_equal(got.int_repr(), np.concatenate(want[rule], axis), err_msg=rule)
