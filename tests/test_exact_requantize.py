"""qarray.requantize and the backends' requantize primitive against the exact
rational reference of tests/_reference.py (the contract of DESIGN.md
"Numerics" in Python integers and Fractions; issue 8, "Done when"), and that
reference itself against vectors published outside this project.

Every test runs on both CPU paths (the ``kernels`` fixture; conftest sends even
tiny arrays through Numba, checked by ``check_path``). External vectors are
marked with where they come from.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qarray as qa
from qarray import QArray, qdtype

from _reference import (RULES, rounding_kw, ref_bits, ref_multiplier, ref_gemmlowp, ref_scale, ref_out, f32_ratio,
                        expand, ref_int64, exact_settings, check_path, paths, scales, zero_points, draw_code,
                        int64_cases)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_reference_against_published_vectors():
    """The reference itself, on vectors from outside this project."""
    # tensorflow/lite/kernels/internal/quantization_util_test.cc (QuantizeMultiplier*
    # tests): (quantized_multiplier, shift) with shift = 31 - s.
    for M, (m, shift) in [(0.75, (1610612736, 0)), (0.25, (1073741824, -1)), (0.5 - 5e-9, (2147483627, -1)),
                          (0.5 - 1e-10, (1073741824, 0)), (1 - 1e-9, (2147483646, 0)), (1 + 1e-11, (1073741824, 1)),
                          (1.25, (1342177280, 1)), (2 - 1e-9, (2147483647, 1)), (2 - 1e-11, (1073741824, 2)),
                          (2.0**-31, (1073741824, -30)), (2.0**-32, (1073741824, -31))]:
        assert ref_multiplier(M, tflite=True) == (m, 31 - shift)
        assert ref_multiplier(M) == (m, 31 - shift)
    for M in [0.99 * 2.0**-32, 2.0**-33]:  # QuantizeMultiplierUnderflow: 0
        assert ref_multiplier(M, tflite=True)[0] == 0
        assert ref_multiplier(M)[0] != 0  # qarray keeps them (DESIGN: no multiplier too small)
    # ... MultiplyByQuantizedMultiplierInt32 (identical in single- and double-rounding builds)
    for x, M, want in [(10000, 0.00097656, 10), (-10000, 0.00097656, -10), (-(2**31), 0.00001, -21475),
                       (2**31 - 1, 0.00001, 21475)]:
        assert ref_scale(x, M, "tflite") == want
    x = 2**31 - 1  # "maximum possible x and quantized_multiplier", shift -3
    assert ref_gemmlowp(x, 2**31 - 1, 34) == round(Fraction(x * (2**31 - 1), 2**34)) == -ref_gemmlowp(-x, 2**31 - 1, 34)
    # DESIGN.md / _fixed_point.py worked example: M = 0.3, d = 5 -> 1.5000000001 -> 2
    assert ref_multiplier(0.3) == (1288490189, 32) and ref_scale(5, 0.3, "half_even") == 2
    # gemmlowp's tie behaviour (tests/test_requantize.py test_tflite_known_values)
    assert [ref_scale(v, 0.5, "tflite") for v in (-9, -3, 3, 9)] == [-4, -1, 2, 5]
    assert [ref_scale(v, 0.5, r) for r in ("half_even", "half_away", "half_up") for v in (-5, -3, 3, 5)] == \
        [-2, -2, 2, 2, -3, -2, 2, 3, -2, -1, 2, 3]
    # the caps: beyond 2**94 nothing survives; above 2**34 the shift stops at -3
    assert ref_multiplier(2.0**-64 * 0.75) == (0, 94) and ref_multiplier(2.0**40) == (2**30, -3)
    assert ref_multiplier(2.0**30, tflite=True) == (2**31 - 1, 1)


# -- requantize ------------------------------------------------------------------
REQ_CASES = [("qint2", "qint8"), ("qint4", "qint2"), ("qint8", "qint4"), ("quint2", "quint8"), ("quint4", "quint2"),
             ("quint8", "quint4"), ("qint16", "qint16"), ("quint16", "qint16"), ("qint32", "qint32"),
             ("qint32", "quint8")]


@st.composite
def requantize_cases(draw, d_in, d_out):
    qi, qo = qdtype(d_in), qdtype(d_out)
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    ax_in = draw(st.sampled_from([None, *range(len(shape))]))
    ax_out = draw(st.sampled_from([None, ax_in] if ax_in is not None else [None, *range(len(shape))]))
    n_in = 1 if ax_in is None else shape[ax_in]
    n_out = 1 if ax_out is None else shape[ax_out]
    s_in = [draw(scales(-40, 20)) for _ in range(n_in)]
    # log2 M from 2**-100 to 2**40, often where the input range maps onto the output's
    land = qo.bits - qi.bits
    k = [draw(st.one_of(st.integers(-100, 40), st.integers(land - 3, land + 3))) for _ in range(n_out)]
    s_out = [np.float32(s_in[i % n_in] / 2.0 ** k[i] * draw(st.sampled_from([1.0, 1.0, 1.5, 0.75]))) for i in range(n_out)]
    zi = [draw(zero_points(qi)) for _ in range(n_in)]
    zo = [draw(zero_points(qo)) for _ in range(n_out)]
    S_in, S_out = expand(np.array(s_in), shape, ax_in), expand(np.array(s_out), shape, ax_out)
    Zi, Zo = expand(np.array(zi), shape, ax_in), expand(np.array(zo), shape, ax_out)
    q = np.empty(shape, np.int64)
    for idx in np.ndindex(shape):
        M = float(S_in[idx]) / float(S_out[idx])
        q[idx] = draw_code(draw, qi.qmin, qi.qmax, int(Zi[idx]), M, (qo.qmin - int(Zo[idx]), qo.qmax - int(Zo[idx])))
    return q, (np.array(s_in), np.array(zi, np.int32), ax_in), (np.array(s_out), np.array(zo, np.int32), ax_out)


def _params(p, axis):
    s, z, _ = p
    return (s, z) if axis is not None else (s[0], z[0])


@pytest.mark.parametrize(**paths("d_in,d_out", REQ_CASES, [("qint32", "quint8")]))
@exact_settings(50)
@given(data=st.data())
def test_requantize(d_in, d_out, kernels, data):
    """qarray.requantize: per-tensor and per-axis in and out, every rounding."""
    check_path(kernels)
    q, pin, pout = data.draw(requantize_cases(d_in, d_out))
    qi, qo = qdtype(d_in), qdtype(d_out)
    shape = q.shape
    S_in, Zi = expand(pin[0], shape, pin[2]), expand(pin[1], shape, pin[2])
    S_out, Zo = expand(pout[0], shape, pout[2]), expand(pout[1], shape, pout[2])
    x = QArray.from_int(q.astype(qi.storage), *_params(pin, pin[2]), d_in, axis=pin[2])
    for rule in RULES:
        want = np.empty(shape, np.int64)
        ok = True
        for idx in np.ndindex(shape):
            f = f32_ratio(num=[S_in[idx]], den=S_out[idx])
            ok = ok and (rule != "float" or f is not None)
            want[idx] = ref_out(int(q[idx]) - int(Zi[idx]), float(S_in[idx]) / float(S_out[idx]), f or 0,
                                int(Zo[idx]), qo.qmin, qo.qmax, rule)
        call = lambda: qa.requantize(x, *_params(pout, pout[2]), d_out, axis=pout[2], **rounding_kw(rule))  # noqa: E731
        if not ok:
            with pytest.raises(ValueError, match="leaves float32's range"):
                call()
            continue
        got = call()
        assert got.data.dtype == qo.storage
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=rule)


# -- the backend primitive on int64 accumulators ----------------------------------
PRIM_OUT = ["qint32", "qint8", "quint16"]


@pytest.mark.parametrize(**paths("d_out", PRIM_OUT, ["qint32"]))
@exact_settings(80)
@given(data=st.data())
def test_requantize_primitive_int64(d_out, kernels, data):
    """The backend's requantize on int64 accumulators up to +-2**62 and +-(2**63 - 1),
    multipliers 2**-100 to 2**40, per-tensor and per-axis, through ``plan``."""
    from qarray._fixed_point import plan
    from qarray.backends import get

    check_path(kernels)
    qo = qdtype(d_out)
    d, axis, M, zo = data.draw(int64_cases(qo))
    for rule in RULES:
        mode, rounding = ("float", "half_even") if rule == "float" else ("fixed", rule)
        rq = plan([M if axis is not None else M[0]], np.float32(1.0), 0, zo if axis is not None else zo[0], qo,
                  mode, rounding, axis=axis)
        got = get("numpy").requantize(d, rq)
        assert got.dtype == qo.storage
        np.testing.assert_array_equal(got, ref_int64(d, axis, M, zo, qo, rule), err_msg=rule)


# -- the narrow path: |d| < 2**31 and shifts >= 32, one 64-bit product -------------
NARROW_D = [-(2**31), -(2**31) + 1, -3 * 2**30 // 2, -(2**30), -6, -2, -1, 0, 1, 2, 6, 2**30, 3 * 2**29, 2**31 - 1]
# shifts 32 (M = 1/4: ties at d = +-2, +-6), 61 and 62 (ties at d = +-2**30, -2**31),
# 63 and beyond (capped at 63; everything rounds to 0), m at 2**31 - 1 and 2**30
NARROW_M = [0.25, 0.75 * 2.0**-2, (2**31 - 1) * 2.0**-63, 2.0**-31, 2.0**-32, 2.0**-33, 2.0**-34, 2.0**-60,
            2.0**-100]


@pytest.mark.parametrize(**paths("d_out", ["qint32", "qint8"], ["qint32"]))
@pytest.mark.parametrize("M", NARROW_M, ids=str)
def test_requantize_narrow_path_at_the_extremes(d_out, M, kernels):
    """int32 accumulators with zero point 0 take ``rescale(narrow=True)`` (one
    64-bit product, rounded at once): int32's ends, ties of every rule and
    shifts from 32 to 94, against the exact reference, output zero points at
    both ends of qint8."""
    from qarray._fixed_point import plan
    from qarray.backends import get

    check_path(kernels)
    qo = qdtype(d_out)
    d = np.array(NARROW_D, np.int32)
    for zo in ([0, qo.qmin, qo.qmax] if qo.bits == 8 else [0]):
        for rule in ("half_even", "half_away", "half_up"):  # tflite and float keep their own paths
            rq = plan([M], np.float32(1.0), 0, zo, qo, "fixed", rule)
            assert rq.narrow(np.int32), "the case must take the narrow path"
            got = get("numpy").requantize(d, rq)
            want = ref_int64(d.astype(np.int64), None, np.array([M]), np.array([zo]), qo, rule)
            np.testing.assert_array_equal(got, want, err_msg=f"{rule} zo={zo}")


# -- stochastic rounding: the exact quotient rounded down or up ------------------
# multipliers with shifts below 32 (M >= 1/2), at 32 and up to 94, and m at both ends
STOCHASTIC_M = [0.37, 1.0, 3.75, 2.0**-10 * 0.6, (2**31 - 1) * 2.0**-62, 2.0**-31, 2.0**-40 * 0.77, 2.0**-70]


def ref_stochastic_requantize(codes, zi, M, zo, qo, seed):
    """Independent reference: ``(q - zi) * m / 2**s`` (``ref_multiplier``) in
    Fractions, its floor plus one where the element's Philox word (counter:
    flat index) is below its fraction times 2**32; then ``zo`` and the clamp."""
    out = []
    for i, (q, z, mm, o) in enumerate(zip(*(np.broadcast_to(v, codes.shape).ravel() for v in (codes, zi, M, zo)))):
        m, s = ref_multiplier(float(mm))
        v = Fraction((int(q) - int(z)) * m, 2**s) if s >= 0 else Fraction((int(q) - int(z)) * m * 2**-s)
        f = v.numerator // v.denominator
        out.append(min(max(f + (ref_bits(i, seed) < (v - f) * 2**32) + int(o), qo.qmin), qo.qmax))
    return np.array(out, np.int64).reshape(codes.shape)


@pytest.mark.parametrize("d_in,d_out", [("qint32", "qint8"), ("qint8", "quint8"), ("quint16", "qint16"),
                                        ("qint32", "qint32")])
@pytest.mark.parametrize("layout", [None, 0, 1])
def test_requantize_stochastic_is_the_reference(backend, d_in, d_out, layout):
    """``rounding="stochastic"`` on every backend (Numba, generic, host-run CUDA,
    Dask) equals the independent reference: input codes at both ends of their
    dtype with input zero points at both ends, shifts from below 32 to beyond
    64, output zero points at both ends."""
    qi, qo = qdtype(d_in), qdtype(d_out)
    rng = np.random.default_rng(7)
    shape = (len(STOCHASTIC_M), 9)
    codes = rng.integers(qi.qmin, qi.qmax, shape, endpoint=True)
    codes[:, :4] = [qi.qmin, qi.qmax, qi.qmin + 1, 0]
    seed = 2**64 - 5
    for zi in (qi.qmin, qi.qmax, 0) if qi.bits < 32 else (0,):
        s_in = np.float32(1.0)
        M = np.array(STOCHASTIC_M).reshape(-1, 1) if layout == 0 else (
            np.resize(STOCHASTIC_M, shape[1]) if layout == 1 else np.full(1, 0.37))
        s_out = (np.float64(s_in) / M).astype(np.float32)
        M = np.float64(s_in) / s_out.astype(np.float64)  # the float32 scales' exact ratio
        zo = np.resize([qo.qmin, qo.qmax, 0], s_out.size).reshape(s_out.shape)
        q = QArray.from_int(codes.astype(qi.storage), s_in, zi, d_in)
        kw = dict(axis=layout) if layout is not None else {}
        so, zz = (s_out.ravel(), zo.ravel()) if layout is not None else (s_out[0], zo[0])
        got = backend.run(qa.requantize, q, so, zz, d_out, **kw, rounding="stochastic", seed=seed)
        want = ref_stochastic_requantize(codes, zi, M if layout is not None else M[0], zo if layout is not None
                                         else zo[0], qo, seed)
        np.testing.assert_array_equal(got.int_repr(), want, err_msg=f"zi={zi}")
        assert backend.ran("requantize_stochastic")


def test_requantize_stochastic_is_unbiased(kernels):
    """10^6 int32 accumulators to qint8: only the floor or the ceiling of the exact
    quotient; the mean error within 5 standard deviations of 0; the same seed
    repeats, another differs; the Dask chunks (uneven) give the same codes."""
    d = np.random.default_rng(4).integers(-40_000, 40_000, 10**6).astype(np.int32)
    q = QArray.from_int(d, 1.0, 0, "qint32")
    s_out = np.float32(317.3)
    t = d / np.float64(s_out)
    got = qa.requantize(q, s_out, 0, "qint8", rounding="stochastic", seed=1).int_repr().astype(np.float64)
    assert np.all((got == np.floor(t)) | (got == np.ceil(t)))
    frac = t - np.floor(t)
    assert abs(np.mean(got - t)) < 5 * np.sqrt(np.sum(frac * (1 - frac))) / d.size
    again = qa.requantize(q, s_out, 0, "qint8", rounding="stochastic", seed=1).int_repr()
    np.testing.assert_array_equal(again, got)
    other = qa.requantize(q, s_out, 0, "qint8", rounding="stochastic", seed=2).int_repr()
    assert 0.2 < np.mean(other != got) < 0.5
    da = pytest.importorskip("dask.array")
    qd = QArray.from_int(da.from_array(d.reshape(1000, 1000), chunks=(333, 170)), 1.0, 0, "qint32")
    chunked = qa.requantize(qd, s_out, 0, "qint8", rounding="stochastic", seed=1).compute().int_repr()
    np.testing.assert_array_equal(chunked.ravel(), got)


@pytest.mark.parametrize("shape,axis,block_size", [((3, 100003), None, None), ((3, 100003), 1, None),
                                                   ((3, 100003), 1, 1000), ((300, 2001), 0, None)])
def test_requantize_stochastic_kernel_pieces(shape, axis, block_size):
    """Large arrays: the Numba kernel over several pieces and threads numbers each
    element by its flat index, as the generic whole-array code does."""
    pytest.importorskip("numba")
    from qarray._params import param_shape

    rng = np.random.default_rng(3)
    q = QArray.from_int(rng.integers(-2**31, 2**31, shape).astype(np.int32), 1.0, 0, "qint32")
    scale = rng.uniform(1e6, 1e8, param_shape(shape, axis, block_size)).astype(np.float32)
    got = qa.requantize(q, scale, 0, "qint8", axis, block_size, rounding="stochastic", seed=11)
    with qa.config.using(numba=False):
        want = qa.requantize(q, scale, 0, "qint8", axis, block_size, rounding="stochastic", seed=11)
    np.testing.assert_array_equal(got.int_repr(), want.int_repr())


def test_requantize_stochastic_errors():
    q = QArray.from_int(np.arange(4, dtype=np.int32), 1.0, 0, "qint32")
    with pytest.raises(TypeError, match="rounding='stochastic' needs a seed"):
        qa.requantize(q, 3.0, 0, "qint8", rounding="stochastic")
    with pytest.raises(TypeError, match="requantize: seed= is for rounding='stochastic'"):
        qa.requantize(q, 3.0, 0, "qint8", seed=1)
    with pytest.raises(TypeError, match="rounds the exact fixed-point quotient; pass mode='fixed'"):
        qa.requantize(q, 3.0, 0, "qint8", mode="float", rounding="stochastic", seed=1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        qa.requantize(q, 3.0, 0, "qint8", rounding="stochastic", seed=2**64)
    pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="mode=, rounding=, out= and seed= do not apply"):
        qa.requantize(q, 3.0, 0, "float8_e4m3fn", rounding="stochastic", seed=1)
    out = np.empty(4, np.int8)  # out= takes the stochastic codes too
    r = q.requantize(3.0, 0, "qint8", rounding="stochastic", seed=1)
    assert qa.requantize(q, 3.0, 0, "qint8", rounding="stochastic", seed=1, out=out).data is out
    np.testing.assert_array_equal(out, r.int_repr())


def test_requantize_stochastic_at_the_threshold(backend):
    """Each value is placed at its own random word's threshold: ``frac * 2**32``
    exactly ``r`` (stays down: up needs ``r < frac * 2**32``), ``r + 1`` (up), and
    ``r`` plus a part below the word's resolution, carried in the low word
    (``t <= 32``) or the high word's low bits (``t > 32``), which only the
    sticky bit rounds up; positive and negative, on int64 accumulators through
    the backend primitive. Random data meets these cases with probability
    about 2**-32 each."""
    from qarray._fixed_point import plan
    from qarray._philox import key
    from qarray.backends import get

    seed, n = 77, 64
    r = np.array([ref_bits(i, seed) for i in range(n)], np.int64)
    cases = [  # (M, d, up): v = d * M with frac(v) * 2**32 = r + e
        (2.0**-32, r, 0), (2.0**-32, r + 1, 1),  # t = 30
        (2.0**-33, 2 * r + 1, 1), (2.0**-33, 2 * r, 0),  # t = 31: r + 1/2 goes up
        (2.0**-40, 256 * r + 1, 1), (2.0**-40, 256 * r + 4, 1), (2.0**-40, 256 * r, 0),  # t = 38
    ]
    if backend.name == "cuda_host":
        b, put, take = backend.host, (lambda a: a), backend.host.to_host
    elif backend.name == "dask":
        da = pytest.importorskip("dask.array")
        b, put, take = get("dask"), (lambda a: da.from_array(a, chunks=7)), (lambda a: a.compute())
    else:
        b, put, take = get("numpy"), (lambda a: a), (lambda a: a)
    for M, d, up in cases:
        rq = plan([np.float64(M)], np.float32(1.0), 0, 0, qdtype("qint32"), "fixed", "half_even")
        unit = int(round(1 / M))
        for s in (1, -1):  # negative values: d - unit has the same fraction, floor one lower
            acc = d if s == 1 else d - unit
            got = take(b.requantize_stochastic(put(acc.astype(np.int64)), rq, key(seed)))
            np.testing.assert_array_equal(got, np.full(n, up - (s == -1)), err_msg=f"M={M} up={up} sign={s}")
    assert backend.ran("requantize_stochastic")


@pytest.mark.parametrize("d_in,z_in", [("qint32", 5), ("qint32", 0), ("qint8", -128), ("quint8", 255)])
def test_large_per_tensor_requantize_streams_its_codes(d_in, z_in, monkeypatch):
    """From ``STREAM`` elements, per-tensor requantize to 8-bit codes writes 64
    codes a step with non-temporal stores (``cpu.requantize.requantize_stream``, the
    arithmetic of ``_rq``): the exact reference's codes at every rule, at both
    output zero points, for input codes at both ends, on two threads, in the
    first block, around the threads' split, at random places and in the short
    last block (the reference is evaluated there: it runs per element). The
    outputs cover the 8-bit range, with exact ties at the power-of-two
    multipliers, not only the clamps."""
    pytest.importorskip("numba")
    from qarray.backends import numpy as nb

    k = nb._cpu().requantize
    ran = []
    for key, fn in list(k.requantize_stream.items()):
        monkeypatch.setitem(k.requantize_stream, key, lambda *a, fn=fn: ran.append(a[-2:]) or fn(*a))
    qi = qdtype(d_in)
    rng = np.random.default_rng(7)
    n = nb._cpu().quantize.STREAM + 37
    codes = rng.integers(qi.qmin, qi.qmax + 1, n, dtype=np.int64)
    if qi.bits == 32:  # most near the zero point: outputs over the whole 8-bit range, not only clamped
        near = rng.random(n) < 0.7
        codes[near] = z_in + rng.integers(-(2**21), 2**21, int(near.sum()))
    ends = np.array([qi.qmin, qi.qmax, z_in, z_in + 1, z_in - 1, 0]).clip(qi.qmin, qi.qmax)
    for at in (0, n // 2 - 3, n - 6):
        codes[at:at + ends.size] = ends
    look = np.unique(np.concatenate([np.arange(128), np.arange(n // 2 - 64, n // 2 + 64), np.arange(n - 100, n),
                                     rng.integers(0, n, 300)]))
    s_in = np.float32(1e-4)
    x = QArray.from_int(codes.astype(qi.storage), s_in, z_in, d_in)
    qa.set_num_threads(2)
    try:
        for rule in RULES:
            # multipliers s_in / s_out: powers of two give exact ties (every rule's own case)
            wide, spread = qi.bits == 32, []
            for d_out, mult, z_out in (("qint8", 2.0**-13 if wide else 0.5, -128), ("qint8", 1 / 7700 if wide else 1.37, 127),
                                       ("quint8", 2.0**-12 if wide else 0.33, 0), ("quint8", 1 / 30 if wide else 2.5, 255)):
                qo, s_out = qdtype(d_out), np.float32(s_in / mult)
                ran.clear()
                got = x.requantize(s_out, z_out, d_out, **rounding_kw(rule)).int_repr()
                assert ran and sum(stop - start for start, stop in ran) == -(-n // 64), rule  # every block
                f = f32_ratio(num=[s_in], den=s_out)
                want = [ref_out(int(codes[i]) - z_in, float(s_in) / float(s_out), f or 0, z_out, qo.qmin, qo.qmax,
                                rule) for i in look]
                np.testing.assert_array_equal(got[look], want, err_msg=f"{rule} {d_out} {z_out}")
                spread.append(len(set(want)))
            assert sorted(spread)[-2] > 50, (rule, spread)  # not only clamps (a zero point at an end: one side)
    finally:
        qa.set_num_threads(1)
