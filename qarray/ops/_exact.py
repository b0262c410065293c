"""The exact matmul of floating-format operands (float8/float6/float4, MX,
NVFP4), alone or mixed with integer ones: ``matmul`` and ``linear`` come here
when either operand has a floating kind.

Every element of those formats is an integer multiple of the format's smallest
subnormal, every scale a float32, float16, bfloat16 or 8-bit float, and every
integer operand's ``q - zero_point`` has at most 17 bits: so each operand value
``element * scale (* global_scale)`` is a float64 exactly (at most 33
significant bits, magnitudes between 2**-300 and 2**300), and each output is
the exact rational ``sum_k a[m, k] * b[k, n]``. It is computed exactly, then
rounded once.

1. ``_operand``: the float64 values, and per row along K (per column of ``b``)
   the bits it spans: ``|v| < 2**top`` and every nonzero ``v`` a multiple of
   ``2**low`` (``low`` from the format's unit and the scales of the K-groups
   that hold a nonzero element: cheap, no pass over bits of the elements).
2. Fast path: when ``span(a row) + span(b column) + ceil(log2 K) <= 53`` for
   all of them, every product and every partial sum, in any order, is a
   multiple of ``2**(low_a + low_b)`` below ``2**(low_a + low_b + 53)``: the
   float64 BLAS matmul is exact.
3. Otherwise ``_split_matmul`` (Ozaki's splitting): each row is cut into
   slices of ``beta`` bits on a grid of its own, ``beta = (53 - ceil(log2 K)) // 2``,
   so every slice product is an exact float64 matmul of integers; the int64
   results are combined into Python integers (any width: E8M0 scales 2**-127
   and 2**127 in one row, e5m2 sums beyond 2**64).
4. Rounding once: the exact value (plus ``bias``, through ``relu``, over the
   output scale) becomes a float64 rounded to odd (``_round_to_odd``: float64
   arithmetic where that is exact, else Python integers), from which rounding
   to float32, to any narrower format or to integers below 2**51 is the
   correct rounding of the exact value (53 >= 24 + 2 bits; larger integers clamp).

Operands or scales holding NaN or inf give the output entries they reach what
IEEE float64 arithmetic gives (``numpy.einsum`` of the float64 values); an
integer output (or a format without NaN) refuses them. CuPy operands run here
on the host (correct, not fast).
"""

from __future__ import annotations

import math

import numpy as np

from .. import _formats
from .._config import resolve
from .._params import Layout, expand, to_host
from .._qarray import QArray
from ._output import output_params, wants_output

_NONE = np.int64(1 << 40)  # the "lowest bit" of a row with no nonzero element
_TIE_UP = {  # rounding= for integer outputs: whether a tie x = floor(x) + 1/2 rounds up
    "half_even": lambda fl: np.fmod(fl, 2) != 0,
    "half_away": lambda fl: fl >= 0,
    "half_up": lambda fl: np.ones(fl.shape, bool),
}
_TIE_UP["tflite"] = _TIE_UP["half_away"]  # TFLite's two roundings are half away from zero; exactly, that is one


def takes(*operands) -> bool:
    """Whether matmul/linear run here: some operand is a floating-format QArray."""
    return any(isinstance(q, QArray) and q.dtype.kind == "float" for q in operands)


def check_types(op, *named):
    for name, q in named:
        if not isinstance(q, QArray):
            raise TypeError(f"{op}: {name} must be a QArray, got {type(q).__name__}; quantize it first")


def _v2(x):
    """The exponent of the lowest set bit of finite nonzero float64 ``x``."""
    m, e = np.frexp(x)
    mi = np.abs((m * 2.0**53).astype(np.int64))
    return e - 53 + np.frexp((mi & -mi).astype(np.float64))[1] - 1


class _Operand:
    """An operand's values as float64 ``v`` (exact; NaN or inf where it holds
    them), ``fv`` (its non-finite values 0) and, per row along ``kaxis`` (kept
    as a size-1 axis), ``top``: every value is below ``2**top``."""

    def __init__(self, op, name, q, kaxis):
        if q.dtype.kind == "int" and q.dtype.bits > 16:
            raise TypeError(f"{op}: {name} has dtype {q.dtype.name}; integer operands of floating-format matmuls "
                            "have 2 to 16 bits (qint8, quint8, ...); requantize it first")
        data = to_host(q.data)
        s = to_host(q.scale).astype(np.float64)
        if q.global_scale is not None:  # NVFP4: element * block scale * tensor scale, exact in float64
            s = s * np.float64(to_host(q.global_scale))
        if q.dtype.kind == "float":  # a table of the 256 bit patterns' values (those not of the format go unused)
            f = _formats.fmt(q.dtype.name)
            table = _formats.values(np.arange(256, dtype=np.uint8).view(_formats.dtype(f)), f, np.float64)
            v = table.take(data.view(np.uint8))
            self.unit = int(np.frexp(_formats.finfo(f).smallest_subnormal)[1]) - 1  # every element's multiple
        else:
            v = data.astype(np.float64) - expand(to_host(q.zero_point), q.shape, q.axis, q.block_size)
            self.unit = 0
        _scale_in_place(v, s, q.axis, q.block_size)
        amax = _amax(v, kaxis)  # NaN or inf where a row holds them
        fv = v
        if not np.isfinite(amax).all():  # exact arithmetic on the finite values (IEEE's for the rest: einsum)
            fv = np.where(np.isfinite(v), v, 0)
            amax = _amax(fv, kaxis)
        self.v, self.fv, self.q, self.kaxis, self.amax = v, fv, q, kaxis, amax
        self.top = np.frexp(amax)[1]
        self.s = np.where(np.isfinite(s), s, 1)  # NaN block scales: their elements hold nothing finite

    def span(self, skip_empty):
        """The most bits a row spans: ``top - low`` with every nonzero value a multiple of
        ``2**low``, from the scales of its K-groups (``skip_empty``: only those holding a nonzero)."""
        q, kaxis, s = self.q, self.kaxis, self.s
        if q.axis == kaxis:  # the scale varies along K: groups of block_size (per-axis: 1) elements
            starts = np.arange(0, q.shape[kaxis], q.block_size or 1)
            nonzero = np.logical_or.reduceat(self.fv != 0, starts, axis=kaxis) if skip_empty else True
            s = s if q.block_size else expand(s, q.shape, q.axis, None)
        else:
            nonzero = True
            s = expand(s, q.shape, q.axis, q.block_size)
            s = s.take([0], axis=kaxis) if np.ndim(s) == q.ndim else s
        low = np.where(nonzero, _v2(s), _NONE)
        low = self.unit + low.reshape(low.shape if low.ndim == q.ndim else (1,) * q.ndim).min(
            axis=kaxis, keepdims=True, initial=_NONE)
        return int(np.where(self.amax > 0, self.top - low, 0).max(initial=0))


def _scale_in_place(v, s, axis, block_size):
    """``v *= s`` expanded to ``v``'s elements; whole blocks without repeating ``s``."""
    if block_size is not None and v.shape[axis] % block_size == 0:
        lay = Layout(v.shape, axis, block_size)
        v.reshape(lay.outer, lay.blocks, block_size, lay.inner).__imul__(s.reshape(lay.pouter, lay.blocks, 1, lay.pinner))
    else:
        v *= expand(s, v.shape, axis, block_size)


def _amax(v, axis):
    """The largest ``|v|`` along ``axis`` (kept), 0 where it is empty."""
    if not v.shape[axis]:
        return np.zeros(v.shape[:axis] + (1,) + v.shape[axis + 1:])
    return np.maximum(v.max(axis=axis, keepdims=True), -v.min(axis=axis, keepdims=True))


def matmul(op, a, b, bias, scale, zero_point, dtype, relu, mode, rounding):
    """``a @ b`` exactly (``a`` ``(..., M, K)``, ``b`` ``(K, N)`` or ``(..., K, N)``),
    rounded once to the output (see the module doc)."""
    if op == "matmul":
        check_types(op, ("a", a), ("b", b))
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"{op} takes arrays of 2 or more dimensions, got shapes {a.shape} and {b.shape}")
    k = a.shape[-1]
    if k != b.shape[-2]:
        raise ValueError(f"{op}: shapes {a.shape} and {b.shape} do not align: {k} != {b.shape[-2]} (K)")
    n = b.shape[-1]
    if bias is not None:
        bias_h = to_host(bias) if not isinstance(bias, QArray) else None
        if bias_h is None or bias_h.dtype.kind != "f" or bias_h.shape != (n,):
            got = f"a {bias.dtype.name} QArray" if bias_h is None else f"{bias_h.dtype} {bias_h.shape}"
            raise ValueError(f"{op}: with floating-format operands bias must be a float array of shape ({n},), "
                             f"got {got}")
        bias = bias_h.astype(np.float64)
    mode, rounding = resolve(mode, rounding)  # validated; the exact path has one rounding, so mode does not apply
    target = _target(op, scale, zero_point, dtype, a.dtype)

    x = _Operand(op, "a" if op == "matmul" else "x", a, a.ndim - 1)
    y = _Operand(op, "b" if op == "matmul" else "w", b, b.ndim - 2)
    fast = any(x.span(skip) + y.span(skip) + (k - 1).bit_length() <= 53 for skip in (False, True))
    exact = x.fv @ y.fv if fast else _split_matmul(x.fv, x.top, y.fv, y.top, k)
    ieee = None
    if x.fv is not x.v or y.fv is not y.v:  # NaN or inf somewhere: IEEE float64 where they reach
        ieee = np.einsum("...mk,...kn->...mn", x.v, y.v, optimize=False)
    r = _round_to_odd(exact, bias, relu, target[1])
    if ieee is not None:
        bad = ~np.isfinite(ieee)
        if bias is not None:
            ieee = ieee + bias
        if relu:
            ieee = np.maximum(ieee, 0)
        r = np.where(bad, ieee / np.float64(target[1] or 1), r)
    return _finish(op, a._backend, r, target, rounding)


def _split_matmul(a, ta, b, tb, k):
    """The exact ``a @ b`` of finite float64 ``a``, ``b`` with rows of ``a``
    below ``2**ta`` and columns of ``b`` below ``2**tb``: ``(Python int array, shift)``."""
    beta = (53 - (k - 1).bit_length()) // 2  # k * (2**beta - 1)**2 < 2**53: every slice matmul is exact
    pa, pb = _slices(a, ta, beta), _slices(b, tb, beta)
    sums = {}
    for i, x in enumerate(pa, 1):
        for j, y in enumerate(pb, 1):
            c = (x @ y).astype(np.int64)  # integers below 2**53
            sums[i + j] = sums.get(i + j, 0) + c  # at most ~30 terms: below 2**58
    last = max(sums, default=2)
    num = sum((d.astype(object) << (last - s) * beta for s, d in sums.items()), np.zeros((), object))
    e = ta + tb - last * beta  # entry = num * 2**e
    shift = int(e.min(initial=0))
    return num * _pow2(e - shift), shift


def _pow2(e):
    """``2**e`` of non-negative int64 ``e`` as Python integers."""
    return np.left_shift(np.ones(e.shape, object), e.astype(object))


def _slices(v, top, beta):
    """``v`` as ``sum_i P_i * 2**(top - i * beta)`` with integers ``|P_i| < 2**beta`` (float64)."""
    out, i = [], 0
    while v.any():
        i += 1
        p = np.trunc(np.ldexp(v, -(top - i * beta)))
        v = v - np.ldexp(p, top - i * beta)
        out.append(p)
    return out


def _ints(x):
    """Finite float64 ``x`` as ``(Python int array n, shift)``, ``x = n * 2**shift``."""
    m, e = np.frexp(x)
    e = e.astype(np.int64) - 53
    shift = int(e.min(initial=0))
    return (m * 2.0**53).astype(np.int64).astype(object) * _pow2(e - shift), shift


def _round_to_odd(exact, bias, relu, scale):
    """``(exact + bias)``, through relu, over ``scale`` (None: 1), rounded to odd
    in float64. ``exact``: exact float64 values, or ``(Python ints, shift)``."""
    if not isinstance(exact, tuple):
        h, lo = exact, 0
        if bias is not None:  # TwoSum: h + lo is the exact sum
            h = exact + bias
            t = h - exact
            lo = (exact - (h - t)) + (bias - t)
        pow2 = scale is None or np.frexp(np.float32(scale))[0] == 0.5
        if pow2 and np.isfinite(h).all():
            if relu:
                h, lo = np.maximum(h, 0), np.where(h > 0, lo, 0)
            r = h
            if bias is not None:
                odd = (np.ascontiguousarray(h).view(np.int64) & 1).astype(bool)
                r = np.where((lo == 0) | odd, h, np.nextafter(h, np.copysign(np.inf, lo)))
            if scale is None:
                return r
            q = r / np.float64(scale)
            if not np.any((q != 0) & (np.abs(q) < 2.0**-1000)):  # no float64 subnormal: the division was exact
                return q
        exact = _ints(exact)
    num, shift = exact
    if bias is not None:
        bn, bs = _ints(np.broadcast_to(bias, num.shape))
        lo = min(shift, bs)
        num, shift = num * 2 ** (shift - lo) + bn * 2 ** (bs - lo), lo
    if relu:
        num = np.where(num > 0, num, 0)
    p, d = (1, 1) if scale is None else float(scale).as_integer_ratio()  # scale = p / d
    top, bottom = d << max(shift, 0), p << max(-shift, 0)  # value = num * top / bottom
    x, side = np.frompyfunc(lambda v: _quotient(v * top, bottom), 1, 2)(num)
    x, side = x.astype(np.float64), side.astype(np.int64)
    odd = (x.view(np.int64) & 1).astype(bool)
    return np.where((side == 0) | odd, x, np.nextafter(x, np.copysign(np.inf, side)))


def _quotient(a, b):
    """``a / b`` (Python ints, ``b > 0``) rounded to nearest, and the side (-1, 0, 1) the exact value lies on."""
    try:
        x = a / b
    except OverflowError:
        return math.copysign(math.inf, a), 0
    xn, xd = x.as_integer_ratio()
    c = a * xd - xn * b
    return x, (c > 0) - (c < 0)


def _target(op, scale, zero_point, dtype, default_dtype):
    """``(kind, scale or None, zero_point, QDType or None)``: kind "float32"
    (no output parameters, or ``dtype="float32"`` with an optional scale) or the QDType's kind."""
    if dtype in ("float32", np.float32) or not wants_output(scale, zero_point, dtype):
        if zero_point is not None and np.any(to_host(zero_point)):
            raise ValueError(f"{op}: a float32 output has no zero point, got zero_point={zero_point!r}")
        return "float32", None if scale is None else output_params(op, scale, None, None, "qint8")[1], 0, None
    d, s, z = output_params(op, scale, zero_point, dtype, default_dtype)
    return d.kind, s, z, d


def _finish(op, backend, r, target, rounding):
    """The float64 rounded-to-odd ``r`` rounded once to the output."""
    kind, _, zp, d = target
    if kind == "float32":
        with np.errstate(over="ignore"):  # beyond float32: +-inf, as IEEE rounding gives
            return backend.asarray(r.astype(np.float32))
    if kind == "int":
        bad = ~np.isfinite(r)
    else:  # formats with NaN keep it; infinities saturate, as quantize's
        bad = np.isnan(r) & (not _formats.FORMATS[d.name].has_nan)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise ValueError(f"{op}: output element {i} is {r[i]} (a NaN or infinite operand value, or a NaN block "
                         f"scale, reaches it), which {d.name} does not hold; use a float32 or float8 output")
    if kind == "float":
        codes = _formats.cast(r, d, True)
        return QArray._new(backend.asarray(codes.view(np.uint8)).view(backend.float_storage(d)),
                           target[1], zp, d, None, None, backend)
    fl = np.floor(r)
    frac = r - fl
    q = fl + ((frac > 0.5) | ((frac == 0.5) & _TIE_UP[rounding](fl)))
    q = np.clip(q + zp, d.qmin, d.qmax).astype(d.storage)
    return QArray._new(backend.asarray(q), target[1], zp, d, None, None, backend)
