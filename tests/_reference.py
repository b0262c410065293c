"""Helpers the test modules share, one definition each (test modules import from
here, never from each other; fixtures live in conftest.py):

* exact references: the rounding of an exact rational, and the contract of
  every requantizing op written with Python integers and ``Fraction``;
* hypothesis strategies and plumbing for the exact-reference suites
  (``tests/test_exact_*.py``, ``tests/test_cuda_exact.py``);
* test data and builders: QArrays of given or random codes, ``Requant``s,
  format boundaries, torchao's MX vectors, a hand-written safetensors file, a
  checkpoint for ``qarray.save``;
* comparisons: ``assert_same`` (bit for bit, any backend) and one computation
  on the NumPy backend and the host-run CUDA backend (``numpy_and_host``);
* ``run_onnx``: one ONNX node through ONNX's reference evaluator;
* the ``qarray`` command in process (``run``, ``fails``, ``rows``: tests/test_cli*.py).

The exact reference (``ref_multiplier`` to ``ref_acc_out``) is written from the
contract in DESIGN.md ("Numerics"); it calls none of qarray's arithmetic (no
``rescale``, ``quantize_multiplier`` or ``plan``; ``ref_fixed`` is the exception,
for tests of the ops above ``quantize_multiplier``, which is tested on its own).
The contract, per element, with ``d`` the exact integer (centred code, product,
accumulator or mean) and ``M`` the float64 multiplier of the op:

* fixed mode: ``M = f * 2**e`` (``math.frexp``), ``m = floor(f * 2**31 + 1/2)``,
  carried to ``2**30`` (``e + 1``) at ``2**31``, ``s = 31 - e``, capped
  (``s > 94``: ``m = 0``; ``s < -3``: ``s = -3``); then ``R(d * m / 2**s)`` with
  the tie rule, ``+ zp_out``, clamped.
* ``rounding="tflite"``: TFLite's caps (``s > 62``: ``m = 0``; ``s < 1``:
  ``s = 1``, ``m = 2**31 - 1``) and gemmlowp's double rounding on int32
  (``SaturatingRoundingDoublingHighMul`` then ``RoundingDivideByPOT``); wider
  integers saturate to int32 first (``rescale``'s docstring), so tflite results
  of accumulators beyond 2**31 are pinned as gemmlowp's, not the exact ones.
* ``mode="float"``: ``rint(float64(d) * float32 multiplier + zp_out)`` in float64,
  clamped (means: ``rint(float64(sum) / count * multiplier + zp_out)``).
* add/sub: each operand ``R((q - zp) * s_q / common)`` onto
  ``common = 2 * max(s_a, s_b) / 2**shift`` (shift 20 / 15 / 28 for 8- / 16- /
  32-bit inputs), never clamped; the exact sum then requantized once with
  ``common / s_out``. mode="float": dequantize, float32 op, quantize.
* averages: ``R(sum / count * m / 2**s)`` exactly, ``(m, s)`` from the non-TFLite
  decomposition (``tflite`` rounds ties away from zero, as TFLite's average pool).
"""

from __future__ import annotations

import functools
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import qarray
from qarray import QArray, qdtype
from qarray import _formats as F
from qarray._fixed_point import FLOAT, Requant, quantize_multiplier

DATA = Path(__file__).parent / "data"


def round_rational(v: Fraction, rounding: str = "half_even") -> int:
    """The integer nearest the exact rational ``v``, ties by ``rounding``
    (``half_even``, ``half_away`` from zero, ``half_up``)."""
    fl = math.floor(v)
    r = v - fl
    if r != Fraction(1, 2):
        return fl + (r > Fraction(1, 2))
    return {"half_even": fl + fl % 2, "half_up": fl + 1, "half_away": fl + (v > 0)}[rounding]


def ref_fixed(d: int, M: float, rounding: str = "half_even") -> int:
    """``R(d * m / 2**s)`` with ``(m, s)`` qarray's fixed-point form of ``M``,
    in Python integers (``quantize_multiplier`` is tested on its own)."""
    m, s = (int(v) for v in quantize_multiplier(M))
    return round_rational(Fraction(d * m, 2**s), rounding)


# -- the exact reference of the requantizing ops ------------------------------------
DTYPES = ["qint2", "quint2", "qint4", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"]
RULES = ["half_even", "half_away", "half_up", "tflite", "float"]
CODES = {"half_even": 0, "half_away": 1, "half_up": 2, "tflite": 3, "float": None}  # Requant's rounding codes
HALF = Fraction(1, 2)
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


def rounding_kw(rule):
    """An op's keywords for ``rule`` (one of RULES)."""
    return {"mode": "float"} if rule == "float" else {"mode": "fixed", "rounding": rule}


def ref_multiplier(M, tflite=False):
    """``(m, s)`` with ``M ~= m / 2**s``, from the definition (TFLite QuantizeMultiplier)."""
    f, e = math.frexp(M)
    m = math.floor(Fraction(f) * 2**31 + HALF)  # round half away (std::round)
    if m == 2**31:
        m, e = 2**30, e + 1
    s = 31 - e
    if tflite:
        if s > 62:
            m, s = 0, 62
        if s < 1:
            m, s = 2**31 - 1, 1
    else:
        if s > 94:
            m, s = 0, 94
        s = max(s, -3)
    return m, s


def ref_gemmlowp(x: int, m: int, s: int) -> int:
    """TFLite's MultiplyByQuantizedMultiplier(x, m, 31 - s): gemmlowp's
    SaturatingRoundingDoublingHighMul then RoundingDivideByPOT, with the input
    saturated to int32 after the left shift (a port of tests/test_requantize.py
    ref_tflite, itself written from the C source)."""
    e = 31 - s
    left, right = max(e, 0), max(-e, 0)
    a = min(max(x * 2**left, I32[0]), I32[1])
    ab = a * m
    num = ab + ((1 << 30) if ab >= 0 else 1 - (1 << 30))
    high = abs(num) // 2**31 * (1 if num >= 0 else -1)  # C division truncates toward zero
    mask = (1 << right) - 1
    return (high >> right) + ((high & mask) > (mask >> 1) + (high < 0))


def ref_scale(d: int, M: float, rule: str) -> int:
    """``R(d * M)`` in fixed mode (unclamped)."""
    if rule == "tflite":
        return ref_gemmlowp(d, *ref_multiplier(M, tflite=True))
    m, s = ref_multiplier(M)
    return round_rational(Fraction(d * m) / Fraction(2) ** s, rule)


def ref_out(d: int, M: float, f, zo: int, lo: int, hi: int, rule: str) -> int:
    """One output integer: fixed (multiplier ``M``) or float (float32 multiplier ``f``)."""
    if rule == "float":
        v = np.rint(np.float64(d) * np.float64(f) + np.float64(zo))
    else:
        v = ref_scale(d, M, rule) + zo
    return int(min(max(v, lo), hi))


def ref_mean(acc: int, count: int, M: float, f, zo: int, lo: int, hi: int, rule: str) -> int:
    """An average: the exact mean ``acc / count`` requantized once."""
    if rule == "float":
        v = np.rint(np.float64(acc) / np.float64(count) * np.float64(f) + np.float64(zo))
    else:
        m, s = ref_multiplier(M)
        v = round_rational(Fraction(acc * m, count) / Fraction(2) ** s, "half_away" if rule == "tflite" else rule) + zo
    return int(min(max(v, lo), hi))


def f32_ratio(*, num=(), den=1.0):
    """The float-mode multiplier: float32 product of ``num`` over float32 ``den``
    (ONNX's ``a_scale * b_scale / y_scale``), or None where it leaves float32."""
    with np.errstate(all="ignore"):
        v = np.float32(1)
        for x in num:
            v = np.float32(v * np.float32(x))
        v = np.float32(v / np.float32(den))
    return float(v) if np.isfinite(v) and v > 0 else None


def expand(p, shape, axis):
    p = np.asarray(p)
    if axis is None or p.ndim == 0:
        return np.broadcast_to(p, shape)
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to(p.reshape(view), shape)


def ref_int64(d, axis, M, zo, qo, rule):
    Mx, Zo = expand(M, d.shape, axis), expand(zo, d.shape, axis)
    want = np.empty(d.shape, np.int64)
    for idx in np.ndindex(d.shape):
        want[idx] = ref_out(int(d[idx]), float(Mx[idx]), f32_ratio(num=[Mx[idx]]), int(Zo[idx]), qo.qmin, qo.qmax, rule)
    return want


def bias_ints(bias, s_x, s_w):
    """linear/conv2d's float bias: ``rint(float32(bias) / (float32(s_x) * float32(s_w)))``."""
    if bias is None:
        return 0
    with np.errstate(all="ignore"):
        return np.rint(np.float32(bias) / (np.float32(s_x) * np.float32(s_w))).astype(np.int64)


def ref_acc_out(acc, s_x, s_w, pout, qo, rule, relu, axis):
    """Requantize exact accumulators ``acc`` (object ints), output channel along ``axis``."""
    s_out, zo = pout
    lo = max(qo.qmin, zo) if relu else qo.qmin
    want = np.empty(acc.shape, np.int64)
    for idx in np.ndindex(acc.shape):
        sw = s_w[idx[axis]]
        want[idx] = ref_out(int(acc[idx]), float(s_x) * float(sw) / float(s_out),
                            f32_ratio(num=[s_x, sw], den=s_out) or 0, zo, lo, qo.qmax, rule)
    return want


# -- hypothesis strategies and plumbing of the exact-reference suites -------------------
def exact_settings(n):
    """``n`` examples, no deadline. The ``kernels`` fixture selects one CPU path for
    the whole test; nothing in it needs resetting between examples."""
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


def check_path(kernels):
    """The Numba kernels really run under kernels="numba" (and not otherwise)."""
    from qarray.backends import get

    assert (get("numpy")._fast(np.zeros(1, np.int8)) is not None) == (kernels == "numba")


def paths(names, cases, on_numba):
    """``cases`` on the generic path, and those in ``on_numba`` on the Numba
    kernels too, for ``pytest.mark.parametrize(names + ",kernels", ...,
    indirect=["kernels"])``. The arithmetic is one source (``rescale``) on both
    paths, and every Numba specialisation costs seconds of compiling in a fresh
    CI run, so the Numba leg takes one case where it takes any: the other test
    files (test_requantize, test_wide, test_memory, ...) hold the Numba kernels
    to the generic path bit for bit over every dtype."""
    rows = []
    for c in cases:
        c = c if isinstance(c, tuple) else (c,)
        for k in ("numba", "generic") if c in on_numba or c[0] in on_numba else ("generic",):
            rows.append(pytest.param(*c, k, id="-".join(map(str, (*c, k)))))
    return dict(argnames=names + ",kernels", argvalues=rows, indirect=["kernels"])


MANTISSAS = st.one_of(st.sampled_from([1.0, 1.5, 1.25, 1.75]), st.floats(1.0, 2.0, exclude_max=True))


@st.composite
def scales(draw, lo, hi):
    """A float32 scale ``mantissa * 2**e``; equal mantissas make power-of-2 ratios (ties)."""
    return np.float32(draw(MANTISSAS) * 2.0 ** draw(st.integers(lo, hi)))


def zero_points(qd):
    ends = [qd.qmin, qd.qmax, (qd.qmin + qd.qmax) // 2, min(max(0, qd.qmin), qd.qmax)]
    return st.one_of(st.sampled_from(ends), st.integers(qd.qmin, qd.qmax))


def tie_step(M):
    """``k`` such that ``d = u * 2**k`` with odd ``u`` makes ``d * m / 2**s`` a half
    integer (``m = m' * 2**z``, ``m'`` odd: ``d * m / 2**s = u * m' / 2``), or None."""
    m, s = ref_multiplier(M)
    if m == 0:
        return None
    k = s - ((m & -m).bit_length() - 1) - 1
    return k if k >= 0 else None


def draw_code(draw, lo, hi, zp, M=None, land=None):
    """One integer in ``[lo, hi]``: an end, the zero point's neighbourhood, an
    exact tie of ``(d = q - zp) * M``, a value that lands at ``land`` after
    scaling by ``M``, or anything."""
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return lo
    if kind == 1:
        return hi
    if kind == 2:
        return min(max(zp + draw(st.integers(-2, 2)), lo), hi)
    if kind in (3, 4) and M is not None:
        k = tie_step(M)
        if k is not None:
            ulo, uhi = -((zp - lo) // 2**k), (hi - zp) // 2**k
            if ulo <= uhi:
                u = draw(st.integers(ulo, uhi))
                u = u if u % 2 else (u + 1 if u + 1 <= uhi else u - 1)
                if ulo <= u <= uhi and u % 2:
                    return zp + u * 2**k
    if kind == 5 and M is not None and land is not None:
        y = draw(st.integers(*land))
        d = int(Fraction(y) / Fraction(M)) + draw(st.integers(-2, 2))
        return min(max(zp + d, lo), hi)
    return draw(st.integers(lo, hi))


@st.composite
def multipliers(draw, lo=-100, hi=40):
    """A float64 multiplier from ``2**lo`` to ``2**hi`` (log-uniform), often a power of 2."""
    mant = draw(st.one_of(st.sampled_from([1.0, 1.5, 1.0 + 2.0**-52]), st.floats(1.0, 2.0, exclude_max=True)))
    return mant * 2.0 ** draw(st.integers(lo, hi))


EXTREMES = [I64[1], -I64[1], I64[0] + 1, 2**62, -(2**62), 2**62 - 1, 2**40, -(2**40), 0]  # int64 accumulators


@st.composite
def int64_cases(draw, qo):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    axis = draw(st.sampled_from([None, *range(len(shape))]))
    n = 1 if axis is None else shape[axis]
    M = [draw(multipliers()) for _ in range(n)]
    zo = [draw(zero_points(qo)) for _ in range(n)]
    Mx, Zo = expand(np.array(M), shape, axis), expand(np.array(zo), shape, axis)
    d = np.empty(shape, np.int64)
    for idx in np.ndindex(shape):
        if draw(st.integers(0, 3)) == 0:
            d[idx] = draw(st.sampled_from(EXTREMES))
        else:  # up to +-2**62, ties and values that land inside the output
            d[idx] = draw_code(draw, -(2**62), 2**62, 0, float(Mx[idx]), (qo.qmin - int(Zo[idx]), qo.qmax - int(Zo[idx])))
    return d, axis, np.array(M), np.array(zo, np.int64)


@st.composite
def weight_params(draw, qw, n, per_channel):
    s_w = [draw(scales(-12, 2)) for _ in range(n if per_channel else 1)]
    zw = [draw(zero_points(qw)) for _ in range(n if per_channel else 1)]
    return np.array(s_w * (1 if per_channel else n)), np.array(zw * (1 if per_channel else n), np.int32)


def weight_of(codes, s_w, zw, name, per_channel, axis):
    if per_channel:
        return QArray.from_int(codes, s_w, zw, name, axis=axis)
    return QArray.from_int(codes, s_w[0], zw[0], name)


MM_CASES = [("qint2", "quint4", "qint8"), ("quint2", "qint8", "quint8"), ("qint4", "qint4", "qint16"),
            ("quint4", "quint2", "qint32"), ("qint8", "qint2", "quint4"), ("quint8", "qint8", "qint16")]


# -- QArrays, Requants and test data -----------------------------------------------
def q_of(ints, scale, zp, dtype, **kw):
    """The QArray of codes ``ints``."""
    return QArray.from_int(np.asarray(ints), scale, zp, dtype, **kw)


def all_codes(d, scale, zp, shape=None):
    """Every code of dtype ``d``, qmin to qmax (reshaped to ``shape``)."""
    d = qarray.qdtype(d)
    c = np.arange(d.qmin, d.qmax + 1)
    return QArray.from_int(c if shape is None else c.reshape(shape), scale, zp, d)


def rand_q(rng, shape, dtype="qint8", scale=0.05, zp=None, axis=None):
    """A QArray of random codes of ``dtype``, both ends included: per tensor
    with ``scale`` and ``zp`` (by default a third of the way up the range), or
    along ``axis`` with random scales and zero points."""
    d = qdtype(dtype)
    ints = rng.integers(d.qmin, d.qmax + 1, shape)
    if axis is None:
        return QArray.from_int(ints, scale, (d.qmin + d.qmax) // 3 if zp is None else zp, d)
    n = shape[axis]
    zp = rng.integers(d.qmin, d.qmax + 1, n)
    return QArray.from_int(ints, rng.uniform(0.01, 0.1, n).astype(np.float32), zp, d, axis=axis)


def make_rq(zi, zo, M, d, axis=None, block_size=None, rounding=0, floor=None):
    """A ``Requant`` from the real multiplier(s) ``M`` (float32 in float mode,
    ``rounding=None``), as the ops build them, for calling primitives directly."""
    shape = np.shape(M)
    zeros = np.zeros(shape, np.int64)
    if rounding is None:
        m, s, f, code = zeros, zeros, np.asarray(M, np.float32).astype(np.float64), FLOAT
    else:
        (m, s), f, code = quantize_multiplier(M, tflite=rounding == 3), np.zeros(shape), rounding
    lo, hi = (-(2**63), 2**63 - 1) if d is None else (d.qmin, d.qmax)
    return Requant(*(np.broadcast_to(np.asarray(v, dt), shape).copy()
                     for v, dt in ((zi, np.int64), (zo, np.int64), (m, np.int64), (s, np.int64), (f, np.float64))),
                   code, d, lo if floor is None else max(lo, floor), hi, axis, block_size)


LAYOUTS = [((37,), None, None), ((3, 5, 7), None, None), ((6, 7), 0, None), ((6, 7), 1, None),
           ((2, 5, 3), 1, None), ((3, 10), 1, 4), ((10, 3), 0, 3), ((2, 9, 3), 1, 2), ((0, 4), None, None)]


@functools.cache
def mx_vectors():
    """torchao's MX / NVFP4 vectors (tests/data/mx_vectors.npz, written by
    tests/data/make_mx_vectors.py from torchao 0.18.0): name -> array."""
    with np.load(DATA / "mx_vectors.npz") as f:
        return {k: f[k] for k in f.files}


INF, E = np.float32(np.inf), 0x7E  # E: e4m3 448
NVFP4_INF_CASES = {  # name: (rows of 16, global_scale= (None: the default), the tensor scale it gives,
    #                        scale codes, element codes), worked by hand
    # gs 1: scale 448, x / 448: 224 -> 0.5, 672 -> 1.5, 100 -> 0.22 -> 0, 5000 and 1e30 -> 6, 300 -> 0.67 -> 0.5,
    # -600 -> -1.34 -> -1.5, 1000 -> 2.23 -> 2, 2000 -> 4.46 -> 4, -3000 -> -6.7 -> -6; -0 keeps its sign
    "+inf, gs=1": ([[INF, 224, 672, -1344, 0, -0.0, 100, 2688, 5000, 1e30, 300, -600, 1000, 2000, -3000, 50]], 1.0, 1.0,
                   [E], [[7, 1, 3, 0xD, 0, 8, 0, 7, 7, 7, 1, 0xB, 4, 6, 0xF, 0]]),
    "-inf, gs=1": ([[1, 2, -INF, 448, -896, 1792, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], 1.0, 1.0,
                   [E], [[0, 0, 0xF, 2, 0xC, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]),
    # gs 0.5: scale still 448 (inf / 6 / 0.5), x / 224
    "inf mixed, gs=0.5": ([[-INF, INF, 112, -224, 336, 672, 2000, 60, 0, 0, 0, 0, 0, 0, 0, 0]], 0.5, 0.5,
                          [E], [[0xF, 7, 1, 0xA, 3, 5, 7, 1, 0, 0, 0, 0, 0, 0, 0, 0]]),
    # the default gs: the finite amax 672 / 2688 = 0.25; rows: finite at 448 (x / 112), inf (x / 112: 500 -> 4),
    # finite amax 6 -> 6 / 6 / 0.25 = 4 (0x48, x / 1), NaN with inf (unchanged: NaN scale, codes 0), zeros (2**-6)
    "inf mixed, default gs": ([[672, -336, 168, 56, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                               [INF, -INF, 112, -224, 336, 672, 500, 60, 0, 0, 0, 0, 0, 0, 0, 0],
                               [6, 3, -1.5, 1, 0.5, 0.25, 0.75, 5, 0, 0, 0, 0, 0, 0, 0, 0],
                               [1, INF, np.nan, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                               [0] * 16], None, 0.25,
                              [E, E, 0x48, 0x7F, 0x08],
                              [[7, 0xD, 3, 1] + [0] * 12,
                               [7, 0xF, 2, 0xC, 5, 7, 6, 1] + [0] * 8,
                               [7, 5, 0xB, 2, 1, 0, 2, 6] + [0] * 8,
                               [0] * 16, [0] * 16]),
    # no finite value: the default gs is 1, inf -> 6 at scale 448
    "only inf, default gs": ([[INF, -INF] + [0] * 14], None, 1.0, [E], [[7, 0xF] + [0] * 14]),
}


# the floating formats' boundaries: every value, every midpoint, and numbers a hair either side
def _values(f):
    """The non-negative finite values of floating format ``f``, ascending, as float64."""
    v = np.arange(1 << qdtype(f).bits, dtype=np.uint8).view(F.dtype(f)).astype(np.float64)
    v = np.unique(v[np.isfinite(v)])
    return v[v >= 0]


def _points(f):
    """Every value of ``f``, every midpoint between neighbours, the midpoint past
    the largest value (towards the next one the exponent would give) and
    those beyond: the places where rounding, saturation and overflow decide."""
    v = _values(f)
    grid = np.append(v, 2 * v[-1] - v[-2])
    return np.concatenate([v, (grid[:-1] + grid[1:]) / 2, grid[-1:], [2 * v[-1], 1e30]])


def _signed(x):
    return np.concatenate([x, -x])


def float32_boundaries(f):
    p = _points(f).astype(np.float32)  # exact: one digit more than the format's
    near = [np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0))]
    tiny = np.float32(2.0**-149)
    specials = np.array([0, tiny, 3 * tiny, 2.0**-126, np.finfo(np.float32).max, np.inf, np.nan], np.float32)
    return _signed(np.concatenate([p, *near, specials]))


def float64_boundaries(f):
    """float64 inputs a hair from each point: float32 would round them onto it
    (a tie, or the point itself), a single rounding from float64 must not."""
    p = _points(f)
    hair = p * 2.0**-40
    near = [p + hair, p - hair, np.nextafter(p, np.inf), np.nextafter(p, 0)]
    specials = np.array([0, 5e-324, 1e-300, 2.0**-149 * 0.75, 1e300, np.inf, np.nan])
    return _signed(np.concatenate([p, *near, specials]))


def write_safetensors(path, tensors):
    """A .safetensors file of ``{name: (dtype code, array)}`` laid out by the format's
    spec (8-byte header length, JSON header, data): what PyTorch writes for bfloat16
    and float8 tensors, which the safetensors package's NumPy side cannot write."""
    header, blobs, offset = {}, [], 0
    for name, (code, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def checkpoint(rng):
    """A checkpoint for qarray.save: QArrays (qint4 per channel, quint8 in blocks, qint32 at its
    extremes) and plain arrays, names with "/" and "." (tests/test_io_*.py)."""
    w = qarray.quantize(rng.standard_normal((6, 8)).astype(np.float32), np.linspace(0.01, 0.1, 6).astype(np.float32),
                        np.arange(-3, 3).astype(np.int32), "qint4", axis=0)
    blocked = qarray.quantize(rng.standard_normal((4, 10)).astype(np.float32), 0.05, 0, "quint8", axis=1, block_size=4)
    return {"encoder/fc1.weight": w, "encoder/fc1.bias": rng.standard_normal(6).astype(np.float32),
            "head.w": blocked, "steps": np.arange(3, dtype=np.int64), "q32": qarray.QArray.from_int(
                np.array([-(2**31), 2**31 - 1]), 1e-3, -7, "qint32")}


# -- comparisons ------------------------------------------------------------------------
def host_array(a) -> np.ndarray:
    """Array ``a`` of any backend (NumPy, CuPy, Dask, ...) or NumPy scalar as a NumPy array."""
    if isinstance(a, (np.ndarray, np.generic)):
        return np.asarray(a)
    return qarray.backends.for_array(a).to_host(a)


def _same_array(got, want, err_msg, plain=False):
    if plain:
        assert type(got) is np.ndarray, (err_msg, type(got))
    got, want = host_array(got), host_array(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (err_msg, got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(got, want, err_msg=err_msg)
    if got.dtype.kind not in "biuO":  # floats: every bit (NaN payloads, -0.0)
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8), err_msg=err_msg)


def assert_same(got, want, err_msg="", plain=False):
    """``got`` is ``want`` bit for bit. Arrays: dtype, shape and every bit.
    QArrays: dtype, shape, axis, block size, codes, scale, zero point and global
    scale (their dtypes too). Dicts of those: the same names, each the same.
    ``got`` may live on any backend (its data are brought to the host), unless
    ``plain``: then its arrays must be plain NumPy arrays (what a loader returns)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (err_msg, sorted(got), sorted(want))
        for name, w in want.items():
            assert_same(got[name], w, f"{err_msg} {name}".strip(), plain)
        return
    if isinstance(want, QArray):
        assert isinstance(got, QArray), (err_msg, type(got))
        assert (got.dtype, got.shape, got.axis, got.block_size) == (want.dtype, want.shape, want.axis, want.block_size), \
            (err_msg, got, want)
        _same_array(got.scale, want.scale, f"{err_msg} scale")
        _same_array(got.zero_point, want.zero_point, f"{err_msg} zero point")
        assert (got.global_scale is None) == (want.global_scale is None), err_msg
        if want.global_scale is not None:
            _same_array(np.asarray(got.global_scale), np.asarray(want.global_scale), f"{err_msg} global scale")
        got, want = got.int_repr(), want.int_repr()
    else:
        assert not isinstance(got, QArray), (err_msg, "a QArray where an array was expected")
    _same_array(got, want, err_msg, plain)


def numpy_and_host(host, fn):
    """``fn(backend)`` on the NumPy backend's generic code and on the host-run
    CUDA backend ``host``: ``(want, got)``."""
    from qarray.backends import get

    with qarray.config.using(numba=False):
        want = fn(get("numpy"))
    return want, fn(host)


def device_cupy():
    """CuPy, where it imports and a CUDA device answers; elsewhere the calling
    module (this is called at its import) is skipped: the GPU tests' device check."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as e:  # no driver, no device
        pytest.skip(f"no CUDA device: {e}", allow_module_level=True)
    return cupy


def run_onnx(op, inputs, out_types, opset, **attrs):
    """Run one ``op`` node of ONNX opset ``opset`` on ``inputs`` (name -> array)
    with ONNX's reference evaluator: the list of its outputs, of ONNX types
    ``out_types``. Attributes given as None are left out."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in inputs.items()]
    outs = [helper.make_tensor_value_info(f"out{i}", t, None) for i, t in enumerate(out_types)]
    node = helper.make_node(op, list(inputs), [o.name for o in outs],
                            **{k: v for k, v in attrs.items() if v is not None})
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(helper.make_graph([node], op, ins, outs), opset_imports=opsets,
                              ir_version=helper.find_min_ir_version_for(opsets))
    return ReferenceEvaluator(model).run(None, inputs)


def ref_philox(c, k):
    """Philox4x32-10 in Python ints (Salmon et al., SC'11), independent of qarray's."""
    c, (k0, k1) = list(c), k
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return tuple(c)


def ref_bits(i, seed):
    """Stochastic rounding's random word of the element at flat index ``i``:
    Philox word 0 of counter ``(i mod 2**32, i >> 32, 0, 0)`` under the seed's key."""
    return ref_philox((i & 0xFFFFFFFF, i >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))[0]


# -- the qarray command (tests/test_cli*.py) -----------------------------------------


def run(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``main(argv)``."""
    from qarray import cli  # loaded by the tests of the CLI only

    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def fails(capsys, status, message, *argv):
    """``main(argv)`` returns ``status`` after exactly one line on stderr, ``qarray: error: message``
    (``message`` a string, or a compiled pattern for text that varies with the Python version)."""
    rc, out, err = run(capsys, *argv)
    if isinstance(message, re.Pattern):
        assert rc == status and re.fullmatch(f"qarray: error: {message.pattern}\n", err), err
    else:
        assert (rc, err) == (status, f"qarray: error: {message}\n")
    return out


def rows(out):
    """The body rows of the rich tables in ``out``, as lists of cell texts."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]


def force_isa(monkeypatch, name):
    """The CPU kernels on instruction set ``name``, the ones above it turned off (skips where this CPU
    lacks it): the ``only`` fixtures of test_cpu_gemm and test_block_linear."""
    from qarray.backends.cpu import isa

    ok, why = isa.usable(name)
    if not ok:
        pytest.skip(f"{name}: {why}")
    monkeypatch.setattr(isa, "OFF", set(isa.ORDER[:isa.ORDER.index(name)]))
    assert isa.best() == name
    return name


def same_on_threads(call):
    """``call()`` on one thread and on two (the pool's, each taking some tasks where the caller set
    ``pool.GRAIN`` low): asserts the same bits, returns the result."""
    import qarray as qa
    from qarray._config import THREADS

    n = THREADS[0]
    try:
        qa.set_num_threads(1)
        one = call()
        qa.set_num_threads(2)
        assert_same(call(), one)
    finally:
        qa.set_num_threads(n)
    return one
