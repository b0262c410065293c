"""HQQ (half-quadratic quantization, Badri & Shaji, 2023): each group's zero point fitted to the
weights alone, no calibration data, as the ``hqq`` package does it
(``hqq.core.quantize.Quantizer.quantize(..., optimize=True)``, whose solver is
``hqq.core.optimize.optimize_weights_proximal_legacy``), in NumPy.

>>> rng = numpy.random.default_rng(0)
>>> w = rng.standard_t(4, (64, 256)).astype(numpy.float32) * 0.02   # (out_features, in_features)
>>> q = quantize(w, bits=4, group_size=64)
>>> q.dtype, q.shape
(uint4_g64_f16_bias, (64, 256))

The method, as hqq runs it (float32 throughout, hqq's arithmetic on the CPU):

- Groups (``axis=1``, ``HQQLinear``'s default and ``quantize``'s): ``group_size`` consecutive
  values of the row-major weight, that is of a row (``in_features`` must be a multiple of
  ``group_size`` here; hqq also lets a group straddle rows). ``axis=0`` (hqq's
  ``Quantizer.quantize`` default) groups ``W.reshape(group_size, -1)`` down its columns, values
  ``numel / group_size`` apart: :func:`optimize_weights_proximal` takes that layout, ``quantize``
  does not (no grouped format of the weight's shape holds it).
- A group's start: ``inv = (2^bits - 1) / (max - min)``, as torch computes it (``1 / (max - min)``
  rounded, then times ``2^bits - 1``), 1 where ``|max - min| <= 1e-4``, at most ``2e4``; ``zero =
  -min * inv``, rounded when ``round_zero`` (hqq's ``BaseQuantizeConfig`` sets it
  for 4 bits, and so does ``quantize`` by default).
- Then ``iters`` (20) steps of the proximal solver, the scale held: ``Wq = clamp(rint(W * inv +
  zero), 0, 2^bits - 1)``, ``Wr = (Wq - zero) / inv``, ``We = shrink(W - Wr)`` with ``shrink(x) =
  sign(x) * max(|x| - |x|^(p - 1) / beta, 0)`` (``lp_norm`` p = 0.7, ``beta`` = 10), ``zero =
  mean(Wq - (W - We) * inv)`` over the group. A step's error is ``mean |W - Wr|`` over the whole
  tensor; the loop stops at the first step whose error is not below the best so far, keeping that
  step's new zero (hqq does not undo it), and the codes are ``clamp(rint(W * inv + zero))`` with the
  last zero. hqq's ``kappa`` is not read by this solver (beta stays 10), so there is no such argument.

Where qarray differs from hqq, on purpose:

- A step's error is summed in float64 and rounded to float32 (hqq's is torch's float32 mean, summed
  in its own order): the stopping decisions are hqq's unless two steps' errors lie within a float32
  step of each other, where either may stop one step before the other.
- The result is a QArray of a grouped format (``qarray._grouped``) with a float bias, MLX's layout:
  ``uint{bits}_g{group}_f16_bias`` by default (``dtype=`` also takes ``_bf16_bias`` and
  ``_f32_bias``). hqq's ``(Wq - zero) * scale`` becomes ``scale * Wq + bias``, ``scale = 1 / inv``
  and ``bias = -scale * zero``, both stored in the format's float type (the scale rounded first,
  the bias computed from the rounded scale in float32, then rounded). The codes are hqq's, chosen
  with its float32 parameters. So ``q.dequantize()`` is ``fl(fl(s16 * Wq) + b16)`` (each step
  rounded to float16) where hqq's optimizer scored ``(Wq - zero) / inv`` in float32 (and hqq's
  ``HQQLinear`` computes ``(Wq - zero16) * scale16`` in float16). The float16 scale (relative
  error up to 2^-11) and bias (up to 2^-12 of ``|bias|``, which reaches ``2^(bits-1)`` steps) add
  to ``||W - dequant||``: measured on heavy-tailed weights, under 0.01% at 2-6 bits, 1.2% at 8
  bits (hqq's float16 dequantization: 0.6%). With ``_f32_bias`` the scale is hqq's bit for bit and
  only ``-scale * zero`` and ``scale * Wq + bias`` are rounded (float32): the error is hqq's.
- The input may be float16, bfloat16, float32 or float64 (hqq works on ``W.float()``: float32);
  CuPy and Dask weights are brought to the host.
"""

from __future__ import annotations

import numpy as np

from . import _blocks
from ._dtypes import qdtype
from ._grouped import _GROUPED, _stored
from ._params import float_values, refuse_nonfinite, to_host
from ._qarray import QArray

__all__ = ["quantize", "optimize_weights_proximal", "shrink_lp_op"]

_CHUNK = 1 << 15  # values a solver step works on at a time (its temporaries stay in cache)


def shrink_lp_op(x, beta, lp_norm):
    """hqq's shrinking operator, float32: ``sign(x) * max(|x| - |x|^(lp_norm - 1) / beta, 0)`` (its
    ``|x| - 1 / beta`` for ``lp_norm == 1``); 0 where ``x`` is 0."""
    x = np.asarray(x, np.float32)
    out = np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        if lp_norm == 1:
            out -= np.float32(1.0 / beta)
        else:
            t = np.power(out, np.float32(lp_norm - 1))
            t *= np.float32(1.0 / beta)
            out -= t
    np.maximum(out, np.float32(0), out=out)
    out *= np.sign(x)
    return out


def _step(w, inv, zero, qmax, beta, lp_norm, new_zero):
    """One solver step over groups along the last axis of float32 ``w`` (rows, group), ``inv`` and
    ``zero`` (rows, 1): writes the new zero into ``new_zero`` and returns the step's error sum (float64)."""
    rows = max(1, _CHUNK // w.shape[1])
    total = 0.0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for r in range(0, w.shape[0], rows):
            wf, s, z = w[r:r + rows], inv[r:r + rows], zero[r:r + rows]
            q = wf * s  # W_q = round(W_f * scale + zero).clamp(min, max)
            q += z
            np.rint(q, out=q)
            np.clip(q, np.float32(0), np.float32(qmax), out=q)
            e = q - z  # W_r = (W_q - zero) / scale
            e /= s
            np.subtract(wf, e, out=e)  # W_f - W_r
            a = np.abs(e)
            total += float(a.sum(dtype=np.float64))  # current_error's sum
            t = np.power(a, np.float32(lp_norm - 1))  # W_e = shrink_lp_op(W_f - W_r, beta, lp_norm)
            t *= np.float32(1.0 / beta)
            a -= t
            np.maximum(a, np.float32(0), out=a)
            a *= np.sign(e)
            np.subtract(wf, a, out=a)  # zero = mean(W_q - (W_f - W_e) * scale)
            a *= s
            q -= a
            new_zero[r:r + rows] = q.mean(axis=1, keepdims=True)
    return total


def _solve(w, inv, zero, qmax, lp_norm, beta, iters, verbose=False):
    """hqq's ``optimize_weights_proximal_legacy`` on groups along the last axis of float32 ``w``
    (rows, group): the codes (float32) and the final zero."""
    zero = zero.copy()
    new_zero = np.empty_like(zero)
    best = np.inf
    for i in range(iters):
        err = np.float32(_step(w, inv, zero, qmax, beta, lp_norm, new_zero) / w.size)  # (hqq's float32 mean)
        zero, new_zero = new_zero, zero  # (hqq takes the step's zero before it tests the error)
        if verbose:
            print(i, round(float(err), 6))
        if err < best:
            best = err
        else:
            break
    with np.errstate(invalid="ignore", over="ignore"):
        q = w * inv
        q += zero
        np.rint(q, out=q)
        np.clip(q, np.float32(0), np.float32(qmax), out=q)
    return q, zero


def _check_opt(lp_norm, beta, iters):
    for name, v in (("lp_norm", lp_norm), ("beta", beta)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not np.isfinite(v):
            raise TypeError(f"hqq: {name} must be a finite number, got {v!r}")
    if not 0 < lp_norm <= 1:
        raise ValueError(f"hqq: lp_norm must be in (0, 1] (the proximal solver's l_p norm), got {lp_norm}")
    if not beta > 0:
        raise ValueError(f"hqq: beta must be > 0, got {beta}")
    if isinstance(iters, (bool, np.bool_)) or not isinstance(iters, (int, np.integer)):
        raise TypeError(f"hqq: iters must be an integer, got {type(iters).__name__}")
    if iters < 0:
        raise ValueError(f"hqq: iters must be >= 0, got {iters}")


def _float32(w, what):
    """``w`` as finite float32 on the host."""
    if not hasattr(w, "dtype") or not hasattr(w, "shape"):
        w = np.asarray(w)
    w = float_values(w)
    if np.dtype(w.dtype).kind != "f":
        raise TypeError(f"hqq: {what} must be a float array (float16, bfloat16, float32, float64), got {w.dtype}")
    if hasattr(w, "compute") and not isinstance(w, np.ndarray):  # dask
        w = w.compute()
    with np.errstate(over="ignore"):
        w = np.asarray(to_host(w)).astype(np.float32)
    refuse_nonfinite(w, f"hqq: {what}", tail="; HQQ quantizes finite weights")
    return w


def optimize_weights_proximal(tensor, scale, zero, min_max, axis=0, *, lp_norm=0.7, beta=10.0, iters=20,
                              verbose=False):
    """hqq's ``optimize_weights_proximal`` (``_legacy``), its arguments and results in its layout:
    ``tensor`` the grouped weight, float, ``(n, group)`` with ``axis=1`` or ``(group, n)`` with
    ``axis=0``; ``scale`` hqq's *inverse* scale and ``zero`` (float), ``(n, 1)`` or ``(1, n)``;
    ``min_max`` ``[0, 2^bits - 1]``. Returns ``(W_q, scale, zero)``, float32, ``W_q`` the codes
    (as floats, ``tensor``'s shape) and ``scale`` the given inverse scale, unchanged."""
    _check_opt(lp_norm, beta, iters)
    if axis not in (0, 1) or isinstance(axis, (bool, np.bool_)):
        raise ValueError(f"hqq: axis must be 0 or 1, got {axis!r}")
    w = _float32(tensor, "tensor")
    inv, z = _float32(scale, "scale"), _float32(zero, "zero")
    if w.ndim != 2:
        raise ValueError(f"hqq: tensor must be the 2-d grouped weight, got shape {w.shape}")
    want = (w.shape[0], 1) if axis == 1 else (1, w.shape[1])
    for name, v in (("scale", inv), ("zero", z)):
        if v.shape != want:
            raise ValueError(f"hqq: {name} must have shape {want} for a tensor of shape {w.shape} and axis={axis}, "
                             f"got {v.shape}")
    lo, hi = min_max
    if lo != 0:
        raise ValueError(f"hqq: min_max must start at 0 (hqq's unsigned codes), got {list(min_max)}")
    if axis == 0:
        w, inv, z = np.ascontiguousarray(w.T), inv.T, z.T
    q, z = _solve(w, np.ascontiguousarray(inv), np.ascontiguousarray(z), hi, lp_norm, beta, iters, verbose)
    if axis == 0:
        return q.T, inv.T, z.T
    return q, inv, z


def _format(bits, group_size, dtype, k):
    """``(bits, group, format name)``."""
    if dtype is not None:
        name = dtype if isinstance(dtype, str) else qdtype(dtype).name
        fmt = _blocks.get(name)
        m = None if fmt is None else _GROUPED.fullmatch(fmt.name.lower())
        if m is None or not m.group(1).startswith("uint") or m.group(5) != "_bias":
            raise ValueError(f"hqq: dtype {name!r} is not a grouped format with a float bias; HQQ's float zero "
                             "points need one such as uint4_g64_f16_bias (or _bf16_bias, _f32_bias)")
        fb, fg = int(m.group(2)), int(m.group(3))
        for key, got, want in (("bits", bits, fb), ("group_size", group_size, fg)):
            if got is not None and got != want and not (key == "group_size" and got == -1 and fg == k):
                raise ValueError(f"hqq: {key}={got!r} disagrees with dtype {fmt.name} ({key} {want})")
        return fb, fg, fmt.name
    bits = 4 if bits is None else bits
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"hqq: bits must be an integer, got {bits!r}")
    if not 2 <= bits <= 8:
        raise ValueError(f"hqq: bits must be 2..8 (qarray's grouped formats; hqq's 1 and 1.58 bits have none), "
                         f"got {bits}")
    group = 64 if group_size is None else k if group_size == -1 else group_size
    if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)):
        raise TypeError(f"hqq: group_size must be an integer, got {group_size!r}")
    if group < 8 or group % 8:
        raise ValueError(f"hqq: group_size must be a positive multiple of 8 (as hqq's BaseQuantizeConfig and "
                         f"qarray's grouped formats require), got {group}")
    return int(bits), int(group), f"uint{bits}_g{group}_f16_bias"


def quantize(w, bits=None, group_size=None, axis=1, dtype=None, *, optimize=True, round_zero=None, iters=20,
             lp_norm=0.7, beta=10.0) -> QArray:
    """HQQ's quantization of weight ``w`` (``(..., in_features)``, groups along the last axis) as a
    QArray of a grouped format with a float bias (see the module's docstring).

    ``bits`` (2-8, default 4) and ``group_size`` (a multiple of 8 that divides the last axis, default
    64; -1 for the whole row) as hqq's ``BaseQuantizeConfig(nbits, group_size)``; ``dtype``: the
    format, default ``uint{bits}_g{group_size}_f16_bias``, or any ``uint*_g*_{f16|bf16|f32}_bias``
    (which then sets bits and group size). ``optimize=False``: hqq's start alone (min-max round to
    nearest with a float zero). ``round_zero``: round the starting zero (default: for 4 bits, as
    ``BaseQuantizeConfig``). ``iters``, ``lp_norm``, ``beta``: the solver's (hqq's defaults).
    ``axis`` must be 1 (see :func:`optimize_weights_proximal` for hqq's ``axis=0``)."""
    if axis != 1 or isinstance(axis, (bool, np.bool_)):
        raise ValueError(f"hqq.quantize: axis must be 1 (groups along the last axis, HQQLinear's default), got "
                         f"{axis!r}: hqq's axis=0 groups values numel / group_size apart, which no grouped format "
                         "of the weight's shape holds; hqq.optimize_weights_proximal takes that layout")
    _check_opt(lp_norm, beta, iters)
    w = _float32(w, "w")
    if w.ndim == 0 or w.size == 0:
        raise ValueError(f"hqq.quantize: w must have at least one dimension and values, got shape {w.shape}")
    k = w.shape[-1]
    bits, group, name = _format(bits, group_size, dtype, k)
    if k % group:
        raise ValueError(f"hqq.quantize: group_size {group} does not divide the last axis ({k} values); pad it or "
                         "pick a group size that divides it")
    stype = name.rsplit("_", 2)[-2]
    qmax = (1 << bits) - 1
    g = w.reshape(-1, group)
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        denom = hi - lo
        inv = (np.float32(1) / denom) * np.float32(qmax)  # torch's max_v / denom: reciprocal(denom) * max_v
        inv = np.where(np.abs(denom) <= np.float32(1e-4), np.float32(1), inv)
        inv = np.minimum(inv, np.float32(2e4)).astype(np.float32)
        zero = (-lo * inv).astype(np.float32)
    if (bits == 4) if round_zero is None else round_zero:
        zero = np.rint(zero)
    if optimize:
        q, zero = _solve(g, inv, zero, qmax, lp_norm, beta, iters)
    else:
        with np.errstate(over="ignore"):
            q = np.clip(np.rint(g * inv + zero), 0, qmax)
    scale = np.float32(1) / inv
    d = _stored(scale, stype)
    with np.errstate(over="ignore", invalid="ignore"):
        bias = _stored(-(d.astype(np.float32) * zero), stype)
    for what, v in (("scale", d), ("bias", bias)):
        if not np.isfinite(np.asarray(v, np.float32)).all():
            raise ValueError(f"hqq.quantize: a group's {what} overflows {name}'s {stype} parameters (weights "
                             f"beyond its range); use dtype=uint{bits}_g{group}_f32_bias")
    fmt = _blocks.get(name)
    raw = fmt.pack({"d": d, "m": bias, "q": q.astype(np.uint8)})
    return QArray.from_blocks(raw.reshape(*w.shape[:-1], k // group * fmt.nbytes), name)
