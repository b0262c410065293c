"""AWQ (activation-aware weight quantization, Lin et al., 2023): each input channel of a linear
layer scaled by ``s`` before its weight is quantized, ``s`` searched on calibration activations,
as AutoAWQ's ``AwqQuantizer`` does it (``_search_best_scale``, ``_compute_best_scale``,
``_compute_best_clip``, ``scale_ln_fcs``, ``scale_fc_fc``; casper-hansen/AutoAWQ 88e4c76), in NumPy.

>>> rng = numpy.random.default_rng(0)
>>> x = rng.standard_normal((256, 128)).astype(numpy.float32)    # calibration inputs (tokens, in_features)
>>> x[:, :4] *= 30                                               # a few outlier channels
>>> w = rng.standard_normal((64, 128)).astype(numpy.float32)     # (out_features, in_features)
>>> q, s = quantize(x, w, dtype="uint4_g64_f16_zp")
>>> q.dtype, q.shape, s.shape                                    # q holds w * s; fold 1 / s into x's producer
(uint4_g64_f16_zp, (64, 128), (128,))

What it does, step by step as AutoAWQ:

- ``x_mean``: each input channel's mean ``|x|`` over the calibration tokens (:class:`MeanAbs`,
  exact and mergeable across batches, processes and Dask chunks).
- For ``alpha = i / n_grid``, ``i = 0 .. n_grid - 1`` (20): ``s = max(x_mean^alpha, 1e-4)``
  (``duo_scaling``: ``max(x_mean^alpha / (w_mean^(1 - alpha) + 1e-4), 1e-4)``, ``w_mean`` each
  channel's mean of ``|W|`` over its group's largest ``|W|``, AutoAWQ's default), normalized as
  ``s / sqrt(max(s) * min(s))`` (inf and NaN set to 1); each weight ``W`` (out, in) quantized as
  ``Q(W * s) / s``; the loss ``mean((f(x, W) - f(x, Q(W s) / s))^2)``, ``f`` the layers' outputs
  side by side (several layers that take the same input, q/k/v or gate/up, share one search, as
  in AutoAWQ) or a block's ``forward`` of your own (AutoAWQ's ``module2inspect``: the attention
  or the MLP). The ``alpha`` of the least loss wins (the first, on ties).
- Optionally (``clip=True``, AutoAWQ's ``apply_clip``, which it skips for q and k): per output row
  and group, the largest ``|W s|`` shrunk by ``1 - i / n_grid`` for ``i < max_shrink * n_grid`` (10
  steps), each candidate scored by the group's part of the outputs on up to ``n_sample_token``
  (512) evenly spaced tokens of ``x / s``; the weight is clamped to the best.
- The QArray is of ``W * s`` (clamped); the caller divides the previous operation's output by
  ``s``: :func:`fold_rmsnorm` (a norm's weight, AutoAWQ's ``scale_ln_fcs``) and
  :func:`fold_linear` (a linear's output rows, ``scale_fc_fc``: ``v_proj`` before ``o_proj``,
  ``up_proj`` before ``down_proj``). :func:`quantize` does one group of layers; a whole model goes
  as AutoAWQ's: every search on the float layers, then the folds, then :func:`search_clip` and
  :func:`quantize_weight` on the folded weights (``v_proj``'s rows divided by ``o_proj``'s scales
  before it is quantized).

``Q`` is the format's quantizer. For AWQ's own formats it is AutoAWQ's ``pseudo_quantize_tensor``:
``uint{b}_g{G}_{f16|bf16|f32}_zp`` (``zero_point=True``: ``scale = max(max - min, 1e-5) / (2^b -
1)``, ``zero = clamp(-rint(min / scale), 0, 2^b - 1)``, ``q = clamp(rint(w / scale) + zero)``; the
range is not widened to hold 0, unlike GPTQ's round to nearest that ``qarray.quantize`` gives these
formats) and ``int{b}_g{G}_{...}`` (``zero_point=False``: ``scale = max(|w|, 1e-5) / (2^(b-1) -
1)``). The scale is rounded to the format's float type before the zero point and the codes are
chosen, and the values are the format's (``scale * (q - zero)`` rounded to float16 for ``_f16``): so
the search scores exactly what the QArray holds (with ``_f32`` formats, AutoAWQ's float32
arithmetic itself). Any other block format with a quantizer (``"Q4_K"``, ``"Q4_0"``, MLX's
``uint4_g64_f16_bias``, ``nf4_g64_f32``, ...) is quantized by :func:`qarray.quantize`, its own
round to nearest.

Where qarray differs from AutoAWQ: it computes in float32 (AutoAWQ in the model's float16 on a
GPU); ``x_mean`` is the float32 nearest the exact mean (AutoAWQ sums in float32 in chunks), so its
last bit may differ; losses are summed in float64, and the layers' own output differences formed as
``x @ (W - Q(W s) / s)^T``, a few thousand tokens at a time (AutoAWQ subtracts the two outputs).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _blocks
from ._api import quantize as _quantize
from ._dtypes import qdtype
from ._grouped import _GROUPED, _stored
from ._params import float_values, is_lazy, refuse_nonfinite, to_host
from ._qarray import QArray
from .observers import ColumnSums, _carried

__all__ = ["MeanAbs", "ScaleSearch", "search_scale", "search_clip", "quantize", "quantize_weight", "fold_rmsnorm",
           "fold_linear"]


# -- the statistic: each channel's mean |x|, exactly -------------------------------------------------

_LIMBS = 12  # 32-bit limbs of a column's sum of |x| * 2^149: |x| < 2^128, counts < 2^63
_PASS = 1 << 18  # values read at a time; a float64 count of one pass stays below 2^53 (rows < 2^21)


def _abs_sums(rows):
    """Each column's sum of ``|x|`` over float32 ``rows`` (n, K), exactly: int64 ``(K, _LIMBS)``, limb
    ``i`` bits ``32 i ..`` of ``sum |x| * 2^149`` (the smallest float32 subnormal is 2^-149), each
    below 2^32. A float32 ``|x|`` is ``m * 2^(e - 150)`` (``e`` its exponent field, 1 for
    subnormals, ``m`` its 24-bit significand), so ``|x| * 2^149 = m * 2^(e - 1)``: ``m`` goes into two
    limbs at bit ``e - 1``, added by ``bincount`` in float64 (exact integers)."""
    rows = to_host(rows)
    with np.errstate(over="ignore"):
        rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, k = rows.shape
    acc = np.zeros(k * _LIMBS, np.int64)
    base = np.arange(k, dtype=np.int64) * _LIMBS
    step = max(1, min(_PASS // max(k, 1), 1 << 21))
    for i in range(0, n, step):
        bits = rows[i:i + step].view(np.uint32) & np.uint32(0x7FFFFFFF)
        e = bits >> np.uint32(23)
        if (e == 255).any():
            raise ValueError("MeanAbs.update: the batch holds NaN or inf (as float32); observe finite activations only")
        m = ((bits & np.uint32(0x7FFFFF)) | np.where(e > 0, np.uint32(0x800000), np.uint32(0))).astype(np.uint64)
        p = np.maximum(e, 1).astype(np.int64) - 1
        limb = (base + (p >> 5)).ravel()
        off = (p & 31).astype(np.uint64).ravel()
        m = m.ravel()
        mask = np.uint64(0xFFFFFFFF)
        for j, piece in enumerate(((m << off) & mask, (m << off) >> np.uint64(32))):
            acc += np.bincount(limb + j, piece.astype(np.float64), minlength=k * _LIMBS).astype(np.int64)
        acc = _carried(acc.reshape(k, _LIMBS)).ravel()
    return acc.reshape(k, _LIMBS)


class MeanAbs(ColumnSums):
    """Each input channel's mean ``|x|`` over calibration activations: AWQ's ``x_mean``, collected
    exactly.

    ``update(x)`` takes activations ``(..., K)``, one row of ``K`` a token (NumPy, CuPy or Dask;
    read as float32, as the model's float16, bfloat16 or float32 values are exactly; NaN and inf
    raise ValueError). ``result()`` is float32 ``(K,)``, the nearest float32 of the exact ``sum /
    count``. The sums are exact integers (``|x| * 2^149``, in 32-bit limbs), so :meth:`merge` of
    collectors that saw any split of the tokens (chunks, processes, in any order) gives the bits of
    one collector that saw them all. ``state_dict()`` / :meth:`from_state`: plain arrays.

    >>> m = MeanAbs().update(numpy.array([[1.0, -0.5], [-2.0, 0.0]], numpy.float32))
    >>> m.merge(MeanAbs().update(numpy.array([[3.0, 0.25]], numpy.float32))).result()
    array([2.  , 0.25], dtype=float32)
    """

    kind, _LIMBS, _SHIFT = "awq_mean_abs", _LIMBS, 149
    _sums = staticmethod(_abs_sums)


# -- the format's quantizer, as the search sees it --------------------------------------------------------

class _Quantizer:
    """``fake(w)``: float32 values of ``w`` (rows, K) quantized; ``qarray(w)``: the QArray."""

    def __init__(self, dtype, k):
        name = dtype if isinstance(dtype, str) else qdtype(dtype).name
        fmt = _blocks.get(name)
        if fmt is None:
            raise ValueError(f"awq: dtype {name!r} is not a block format; AWQ's are uint4_g128_f16_zp (AutoAWQ's "
                             "default: 4 bits, groups of 128, zero points), int4_g128_f16, or any GGUF / grouped "
                             "format with a quantizer (Q4_K, uint4_g64_f16_bias, ...)")
        if fmt.quantize is None:
            raise ValueError(f"awq: {fmt.name} is read only here (no quantizer); pick another format")
        if fmt.tensor_scale is not None:
            raise ValueError(f"awq: {fmt.name} has a tensor-wide scale, which a per-channel search would move; pick a "
                             "format without one")
        if k % fmt.block:
            raise ValueError(f"awq: {fmt.name} takes groups of {fmt.block} input channels, which do not divide "
                             f"in_features {k}")
        self.fmt, self.group = fmt, fmt.block
        m = _GROUPED.fullmatch(fmt.name.lower())
        self.awq = None
        if m is not None and m.group(1)[0] in "iu" and m.group(2) and m.group(4) in ("f16", "bf16", "f32") \
                and m.group(5) in (None, "_zp") and (m.group(1)[0] == "i") == (m.group(5) is None):
            self.awq = (int(m.group(2)), m.group(5) == "_zp", m.group(4))

    def _fields(self, g):
        """AutoAWQ's pseudo_quantize_tensor on groups ``g`` (n, G): the format's fields."""
        bits, zero_point, stype = self.awq
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if zero_point:
                top = np.float32((1 << bits) - 1)
                hi, lo = g.max(axis=1, keepdims=True), g.min(axis=1, keepdims=True)
                s = _stored(np.maximum(hi - lo, np.float32(1e-5)) / top, stype)
                sf = s.astype(np.float32)
                z = np.clip(-np.rint(lo / sf), 0, top)
                q = np.clip(np.rint(g / sf) + z, 0, top)
                return {"d": s, "z": z.astype(np.uint8), "q": q.astype(np.uint8)}
            half = 1 << (bits - 1)
            amax = np.maximum(np.abs(g).max(axis=1, keepdims=True), np.float32(1e-5))
            s = _stored(amax / np.float32(half - 1), stype)
            q = np.clip(np.rint(g / s.astype(np.float32)), -half, half - 1) + half
            return {"d": s, "q": q.astype(np.uint8)}

    def _check(self, f):
        s = np.asarray(f["d"], np.float32)
        if not np.isfinite(s).all():
            raise ValueError(f"awq: a group's scale overflows {self.fmt.name}'s parameters (weights times the "
                             "scales beyond its range); use a format with float32 scales")

    def fake(self, w):
        if self.awq is None:
            return np.asarray(_quantize(w, dtype=self.fmt.name).dequantize(), np.float32)
        f = self._fields(w.reshape(-1, self.group))
        if not np.isfinite(np.asarray(f["d"], np.float32)).all():
            return None  # (a candidate the format cannot hold: scored as infinitely bad)
        return self.fmt.decode(self.fmt.pack(f)).reshape(w.shape)

    def qarray(self, w) -> QArray:
        if self.awq is None:
            return _quantize(w, dtype=self.fmt.name)
        f = self._fields(w.reshape(-1, self.group))
        self._check(f)
        raw = self.fmt.pack(f)
        return QArray.from_blocks(raw.reshape(w.shape[0], -1), self.fmt.name)


# -- checks ----------------------------------------------------------------------------------------------

_KEPT = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _floats(a, what, ndim=None, who="awq", keep=False):
    """``a`` as finite float32 on the host (``keep``: float16 and float64 as they are too; messages
    begin with ``who``)."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        a = np.asarray(a)
    a = float_values(a)
    if np.dtype(a.dtype).kind not in "fiu":
        raise TypeError(f"{who}: {what} must be a float array, got dtype {a.dtype}")
    if is_lazy(a):
        a = a.compute()
    a = np.asarray(to_host(a))
    kept = keep and a.dtype in _KEPT
    with np.errstate(over="ignore"):
        a = a.astype(a.dtype if kept else np.float32)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{who}: {what} must be {ndim}-d, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{who}: {what} is empty (shape {a.shape})")
    refuse_nonfinite(a, f"{who}: {what}", as_float32=not kept)
    return a


def _activations(x):
    x = _floats(x, "x")
    if x.ndim < 1:
        raise ValueError("awq: x must be activations of shape (..., in_features), one row a token")
    return x.reshape(-1, x.shape[-1])


def _weights(weights, k, who="awq", keep=False, of="x"):
    """``(list of (out, K) weights, whether one was given)``, float32 (``keep``: see :func:`_floats`);
    ``of`` names what holds the ``k`` input channels."""
    single = hasattr(weights, "shape") and hasattr(weights, "dtype")
    ws = [weights] if single else list(weights) if isinstance(weights, (list, tuple)) else None
    if not ws:
        raise TypeError(f"{who}: weights must be a 2-d weight (out_features, in_features) or a list of them that "
                        "take the same input")
    out = []
    for i, w in enumerate(ws):
        w = _floats(w, "weights" if single else f"weights[{i}]", ndim=2, who=who, keep=keep)
        if w.shape[1] != k:
            raise ValueError(f"{who}: {'the weight' if single else f'weights[{i}]'} has {w.shape[1]} input features "
                             f"(shape {w.shape}), {of} has {k}")
        out.append(w)
    return out, single


def _positive_int(v, name, lo=1):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"awq: {name} must be an integer, got {v!r}")
    if v < lo:
        raise ValueError(f"awq: {name} must be >= {lo}, got {v}")
    return int(v)


def _x_mean(x_mean, x, k):
    if x_mean is None:
        return MeanAbs().update(x).result()
    return _per_channel(x_mean, MeanAbs, "x_mean", "mean |x|", k)


def _per_channel(v, collector, what, meaning, k=None, who="awq"):
    """A statistic of each input channel: ``v`` a ``collector`` (its ``result()``) or a float array,
    as finite float32 ``(k,)`` (any length for None), none negative."""
    if isinstance(v, collector):
        v = v.result()
    m = _floats(v, what, ndim=1, who=who)
    if k is not None and m.shape != (k,):
        raise ValueError(f"{who}: {what} holds one value per input channel, ({k},) here; got shape {m.shape}")
    if (m < 0).any():
        raise ValueError(f"{who}: {what} holds negative values; it is each channel's {meaning}")
    return m


def _pow(x, e):
    """``x ** e`` (``e`` a Python float) in ``x``'s float type as torch's ``pow`` with a scalar exponent
    takes it: its shortcuts for 0, 1 and 0.5 (IEEE sqrt), else the exponent rounded to that type and
    the power rounded once from float64's (NumPy's own float32 power is off by an ulp or more on a
    fifth of the values here; torch's, SLEEF's, on a few per cent)."""
    if e == 0:
        return np.ones_like(x)
    if e == 1:
        return x.copy()
    if e == 0.5:
        return np.sqrt(x)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return np.power(x.astype(np.float64), np.float64(x.dtype.type(e))).astype(x.dtype)


def _w_mean(ws, group):
    """AutoAWQ's ``w_mean``: the weights side by side, ``|W|`` over its group's largest (+ 1e-6), the
    mean over the rows: float32 ``(K,)``."""
    w = np.concatenate(ws, axis=0)
    g = np.abs(w).reshape(-1, group)
    return (g / (g.max(axis=1, keepdims=True) + np.float32(1e-6))).reshape(w.shape).mean(axis=0)


_ROWS = 1 << 12  # tokens whose outputs are formed at a time by the default loss


def _forward(x, ws, forward):
    out = np.asarray(to_host(forward(x, ws)), np.float32)
    f32 = np.finfo(np.float32)
    return np.clip(out, f32.min, f32.max)


def _loss(x, ws, fakes, forward, ref):
    """AutoAWQ's ``_compute_loss``: the mean of the squared differences of the outputs (float64
    sums). The layers' own outputs (no ``forward``) as ``x @ (W - W')^T``, a few thousand tokens at a
    time: the same differences as ``x @ W^T - x @ W'^T`` (float32 rounding apart), without holding
    every token's outputs."""
    with np.errstate(over="ignore", invalid="ignore"):
        if forward is not None:
            d = (ref - _forward(x, fakes, forward)).astype(np.float64).ravel()
            return float(d @ d) / d.size
        total = 0.0
        diffs = [(w - f).T for w, f in zip(ws, fakes)]
        for r in range(0, x.shape[0], _ROWS):
            for dw in diffs:
                d = (x[r:r + _ROWS] @ dw).astype(np.float64).ravel()
                total += float(d @ d)
        return total / (x.shape[0] * sum(w.shape[0] for w in ws))


# -- the searches ------------------------------------------------------------------------------------------

class ScaleSearch(NamedTuple):
    """:func:`search_scale`'s result: ``scales`` float32 ``(in_features,)``, the chosen ``alpha`` and
    the ``losses`` of every grid point (``n_grid``, float64; inf where a point's weights overflowed
    the format)."""
    scales: np.ndarray
    alpha: float
    losses: np.ndarray


def search_scale(x, weights, dtype="uint4_g128_f16_zp", *, n_grid=20, duo_scaling=False, x_mean=None,
                 forward=None) -> ScaleSearch:
    """AutoAWQ's ``_search_best_scale``: the per-input-channel scales of the layers ``weights`` (one
    ``(out_features, in_features)`` weight, or a list of weights that take the same input ``x``) for
    format ``dtype`` (see the module's docstring).

    ``x``: the calibration activations the losses are scored on, ``(..., in_features)``. ``x_mean``:
    the channels' mean ``|x|`` (a :class:`MeanAbs` or a float array), when collected over more data
    than ``x``; by default from ``x``. ``forward(x, weights) -> outputs``: the block the layers feed
    (AutoAWQ's ``module2inspect``), called with the float weights for the reference and with each
    grid point's quantized ones; by default the layers' outputs side by side. ``duo_scaling``:
    AutoAWQ's default (``True`` there), ``s = x_mean^alpha / w_mean^(1 - alpha)``; ``False`` (here)
    is the paper's and llm-awq's ``s = x_mean^alpha``."""
    x = _activations(x)
    k = x.shape[1]
    ws, _ = _weights(weights, k)
    n_grid = _positive_int(n_grid, "n_grid")
    quant = _Quantizer(dtype, k)
    x_mean = _x_mean(x_mean, x, k)
    if forward is not None and not callable(forward):
        raise TypeError(f"awq: forward must be a function forward(x, weights) -> outputs, got {type(forward).__name__}")
    w_mean = _w_mean(ws, quant.group) if duo_scaling else None
    ref = None if forward is None else _forward(x, ws, forward)
    losses = np.full(n_grid, np.inf)
    best, best_scales = -1, None
    for i in range(n_grid):
        ratio = i / n_grid
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            if duo_scaling:
                s = np.maximum(_pow(x_mean, ratio) / (_pow(w_mean, 1 - ratio) + np.float32(1e-4)), np.float32(1e-4))
            else:
                s = np.maximum(_pow(x_mean, ratio), np.float32(1e-4))
            s = s / np.sqrt(s.max() * s.min())
        s[~np.isfinite(s)] = 1
        s = s.astype(np.float32)
        fakes = []
        for w in ws:
            f = quant.fake(w * s)
            if f is None:
                break
            fakes.append(f / s)
        if len(fakes) < len(ws):
            continue
        losses[i] = _loss(x, ws, fakes, forward, ref)
        if losses[i] < (losses[best] if best >= 0 else np.inf):
            best, best_scales = i, s
    if best < 0:
        raise ValueError(f"awq: no grid point gives finite losses in {quant.fmt.name} (the outputs or the scaled "
                         "weights overflow); check the activations and weights, or use a format with float32 scales")
    return ScaleSearch(best_scales, best / n_grid, losses)


def search_clip(x, w, dtype="uint4_g128_f16_zp", *, n_grid=20, max_shrink=0.5, n_sample_token=512) -> np.ndarray:
    """AutoAWQ's ``_compute_best_clip``: the largest magnitude to keep in each group of weight ``w``
    (``(out_features, in_features)``, already scaled: ``W * s``), searched on its inputs ``x`` (``x /
    s``): float32 ``(out_features, in_features // group)``. Clamp with ``numpy.clip(w, -m, m)`` per
    group (:func:`quantize` does)."""
    x = _activations(x)
    k = x.shape[1]
    (w,), _ = _weights(w, k)
    n_grid = _positive_int(n_grid, "n_grid")
    n_sample_token = _positive_int(n_sample_token, "n_sample_token")
    if isinstance(max_shrink, (bool, np.bool_)) or not isinstance(max_shrink, (int, float, np.integer, np.floating)) \
            or not 0 <= max_shrink < 1:
        raise ValueError(f"awq: max_shrink must be a number in [0, 1), got {max_shrink!r}")
    quant = _Quantizer(dtype, k)
    g = quant.group
    x = x[::max(1, x.shape[0] // n_sample_token)]
    xg = np.ascontiguousarray(x.reshape(x.shape[0], -1, g).transpose(1, 0, 2))  # (groups, tokens, g)
    co = w.shape[0]
    best = np.empty((co, k // g), np.float32)
    rows = max(1, min(co, (1 << 22) // max(1, x.shape[0] * (k // g))))  # output rows at a time
    for r in range(0, co, rows):
        wb = w[r:r + rows].reshape(-1, k // g, g)  # (rows, groups, g)
        org_max = np.abs(wb).max(axis=-1, keepdims=True)
        org_out = xg @ wb.transpose(1, 2, 0)  # (groups, tokens, rows)
        best_max, min_err = org_max.copy(), np.full(org_max.shape, 1e9, np.float32)
        for i_s in range(int(max_shrink * n_grid)):
            max_val = org_max * np.float32(1 - i_s / n_grid)
            q = quant.fake(np.clip(wb, -max_val, max_val).reshape(-1, k))
            if q is None:
                continue
            cur = xg @ q.reshape(-1, k // g, g).transpose(1, 2, 0)
            d = cur - org_out
            err = (d * d).mean(axis=1).T[..., None]  # (rows, groups, 1)
            better = err < min_err
            min_err[better] = err[better]
            best_max[better] = max_val[better]
        best[r:r + rows] = best_max[..., 0]
    return best


def _clip_to(w, max_val, g):
    m = max_val[..., None]
    return np.clip(w.reshape(w.shape[0], -1, g), -m, m).reshape(w.shape)


def quantize_weight(w, dtype="uint4_g128_f16_zp", *, clip=None) -> QArray:
    """The QArray of weight ``w`` (``(out_features, in_features)``, already scaled and folded) by
    the format's AWQ quantizer (see the module's docstring: AutoAWQ's ``pseudo_quantize_tensor`` for
    AWQ's formats); ``clip``: :func:`search_clip`'s result, each group clamped to it first
    (AutoAWQ's ``apply_clip``). For a whole model, as AutoAWQ: every :func:`search_scale` of a layer
    on its float inputs, then the folds (:func:`fold_rmsnorm`, :func:`fold_linear`) and ``W * s``,
    then :func:`search_clip` on ``x / s``, then this."""
    w = _floats(w, "w", ndim=2)
    quant = _Quantizer(dtype, w.shape[1])
    if clip is not None:
        m = _floats(clip, "clip", ndim=2)
        if m.shape != (w.shape[0], w.shape[1] // quant.group):
            raise ValueError(f"awq: clip holds one bound a group, shape {(w.shape[0], w.shape[1] // quant.group)} "
                             f"here; got {m.shape}")
        if (m < 0).any():
            raise ValueError("awq: clip holds negative bounds")
        w = _clip_to(w, m, quant.group)
    return quant.qarray(w)


def quantize(x, weights, dtype="uint4_g128_f16_zp", *, n_grid=20, duo_scaling=False, clip=False, x_mean=None,
             forward=None):
    """AWQ for the layers ``weights`` that take input ``x`` (see :func:`search_scale`): the scales'
    search, then (``clip``: True, False, or one of them a weight) the clipping search on ``x / s``,
    then the format's quantization of each ``W * s``. Returns ``(q, s)``: the QArray (a list of them
    for a list of weights) of ``W * s``, and ``s``, float32 ``(in_features,)``, which the caller
    divides out of ``x`` upstream (:func:`fold_rmsnorm`, :func:`fold_linear`)."""
    xs = _activations(x)
    k = xs.shape[1]
    ws, single = _weights(weights, k)
    clips = [clip] * len(ws) if isinstance(clip, (bool, np.bool_)) else \
        list(clip) if isinstance(clip, (list, tuple)) else None
    if clips is None or len(clips) != len(ws) or not all(isinstance(c, (bool, np.bool_)) for c in clips):
        raise TypeError(f"awq: clip must be True, False or a list of one bool a weight ({len(ws)}), got {clip!r}")
    _Quantizer(dtype, k)
    s = search_scale(xs, ws, dtype, n_grid=n_grid, duo_scaling=duo_scaling, x_mean=x_mean, forward=forward).scales
    xs = xs / s if any(clips) else None
    out = [quantize_weight(w * s, dtype, clip=search_clip(xs, w * s, dtype) if c else None) for w, c in zip(ws, clips)]
    return (out[0] if single else out), s


# -- folding the scales upstream ---------------------------------------------------------------------------

def _scales(s, who="awq"):
    s = _floats(s, "s", ndim=1, who=who, keep=True)
    if (s <= 0).any():
        raise ValueError(f"{who}: the scales s must be > 0")
    return s


def fold_rmsnorm(g, s, bias=None, *, offset=0.0):
    """A norm's weight ``g`` (``(in_features,)``) divided by the scales ``s``, so the norm's output is
    ``x / s``: AutoAWQ's ``scale_ln_fcs`` (RMSNorm or LayerNorm; a LayerNorm's ``bias`` too, and
    ``offset=1`` for Gemma's ``(1 + g)`` norms: ``(g + 1) / s - 1``). Returns the new ``g`` (and the
    new bias, if given), in ``g``'s float type."""
    return _fold_norm(g, s, bias, offset)


def _fold_norm(g, s, bias, offset, who="awq"):
    g = _floats(g, "g", who=who, keep=True)
    s = _scales(s, who)
    if g.shape != s.shape:
        raise ValueError(f"{who}: g has shape {g.shape}, the scales {s.shape}: one scale a channel")
    s = s.astype(g.dtype)
    with np.errstate(over="ignore"):
        out = _finite((g + g.dtype.type(offset)) / s - g.dtype.type(offset) if offset else g / s, "g / s", who)
    if bias is None:
        return out
    b = _floats(bias, "bias", who=who, keep=True)
    if b.shape != s.shape:
        raise ValueError(f"{who}: bias has shape {b.shape}, the scales {s.shape}")
    with np.errstate(over="ignore"):
        return out, _finite(b / s.astype(b.dtype), "bias / s", who)


def _finite(a, what, who):
    """``a``, a fold's result, or ValueError where it overflowed its float type."""
    bad = ~np.isfinite(a)
    if bad.any():
        first = np.unravel_index(np.argmax(bad), a.shape)
        raise ValueError(f"{who}: {what} overflows {a.dtype} at {int(bad.sum())} value(s) (the first: "
                         f"{first[0] if a.ndim == 1 else tuple(int(i) for i in first)}); fold in a wider float type")
    return a


def fold_linear(w_prev, s, bias=None):
    """The linear layer before the scaled ones (``(out_features, in)``), its last ``len(s)`` output
    rows (and bias entries) divided by ``s``: AutoAWQ's ``scale_fc_fc`` (``v_proj`` before
    ``o_proj``, ``up_proj`` before ``down_proj``; the last rows, as for a fused qkv). Returns the new
    weight (and bias, if given), in its float type."""
    w = _floats(w_prev, "w_prev", keep=True)
    s = _scales(s)
    if w.ndim != 2 or w.shape[0] < len(s):
        raise ValueError(f"awq: w_prev must be a 2-d weight with at least {len(s)} output rows (one a scale), got "
                         f"shape {w.shape}")
    out = w.copy()
    with np.errstate(over="ignore"):
        out[-len(s):] /= s.astype(w.dtype)[:, None]
    out = _finite(out, "w_prev / s", "awq")
    if bias is None:
        return out
    b = _floats(bias, "bias", keep=True)
    if b.shape != (w.shape[0],):
        raise ValueError(f"awq: bias has shape {b.shape}, w_prev {w.shape[0]} output rows")
    b = b.copy()
    with np.errstate(over="ignore"):
        b[-len(s):] /= s.astype(b.dtype)
    return out, _finite(b, "bias / s", "awq")
