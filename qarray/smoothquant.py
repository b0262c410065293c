"""SmoothQuant (Xiao et al., 2022): for int8 weights and int8 activations (W8A8), each input channel
``j`` of the linear layers after a norm divided by ``s_j`` in the activations and multiplied by it in
the weights, so that the activations' outlier channels give part of their range to the weights, as
mit-han-lab/smoothquant's ``smooth_ln_fcs`` / ``smooth_ln_fcs_llama_like`` (``smoothquant/smooth.py``,
43ded6c) does it, in NumPy.

>>> import qarray
>>> rng = numpy.random.default_rng(0)
>>> x = rng.standard_normal((512, 64)).astype(numpy.float32)    # the norm's input (tokens, channels)
>>> x[:, :3] *= 40                                              # a few outlier channels, as in LLMs
>>> g = numpy.ones(64, numpy.float32)                           # the norm's weight
>>> w = (rng.standard_normal((32, 64)) * 0.1).astype(numpy.float32)   # the linear after it (out, in)
>>> act = AbsMax().update(x[:256]).merge(AbsMax().update(x[256:]))  # calibration, in any split
>>> g2, w2, s, _ = smooth(g, w, act, alpha=0.5)                 # g2 = g / s, w2 = w * s
>>> def w8a8(x, w):                                             # int8 per-tensor x, int8 per-channel w
...     xq = qarray.quantize(x, numpy.abs(x).max() / 127, 0, "qint8")
...     wq = qarray.quantize(w, numpy.abs(w).max(axis=1) / 127, 0, "qint8", axis=0)
...     return qarray.linear(xq, wq).dequantize()              # exact int32 products, then their scale
>>> ref = (x * g) @ w.T
>>> plain = numpy.linalg.norm(w8a8(x * g, w) - ref)
>>> smoothed = numpy.linalg.norm(w8a8(x * g2, w2) - ref)
>>> bool(smoothed < 0.5 * plain)
True

What it computes, step by step as the original:

- ``act_absmax``: each input channel's largest ``|x|`` over the calibration tokens (the original's
  ``act_scales``, from ``get_act_scales``): :class:`AbsMax`, an observer of :mod:`qarray.observers`
  (``update`` batch by batch, ``merge``, ``state_dict`` / ``from_state``). A maximum is exact, so any
  split of the tokens over batches, processes or Dask chunks, merged in any order, gives the same bits.
- :func:`smooth_scales`: ``s_j = max(act_absmax_j ^ alpha / max(max_i |W[i, j]|, 1e-5) ^ (1 - alpha),
  1e-5)``, the column maxima over every weight that takes the same input (q, k and v; gate and up;
  OPT's fc1), computed in the weights' float type (float16, float32 or float64; the others
  float32): ``act_absmax`` rounded to it, the clamps' ``1e-5`` and the exponents too, as torch's
  ``pow(tensor, scalar)`` takes them.
- :func:`smooth`: the scales folded in: the norm's weight (and a LayerNorm's bias) divided by ``s``
  (``qarray.awq``'s fold, AutoAWQ's ``scale_ln_fcs``), each following linear's columns multiplied by
  ``s``. The float function is unchanged (up to float rounding; exactly where ``s`` is a power of
  two). For a linear layer feeding another directly (v_proj before o_proj), ``awq.fold_linear``
  divides its output rows instead.

The int8 part is qarray's own: ``qarray.quantize(w2, scale, 0, "qint8", axis=0)`` (per output
channel: the original's ``quantize_weight_per_channel_absmax``, ``scale = max |row| / 127``) and
``qarray.linear`` on int8 activations: per tensor as above, or per token (the original's default):
each row's codes ``qarray.quantize(x, scale_rows, 0, "qint8", axis=0)`` taken as a per-tensor
QArray of scale 1 (``QArray.from_int``), the exact int32 product ``qarray.linear(codes, wq)``,
then times each row's scale (``qarray/examples/lm.py``'s W8A8 rows).

Where qarray differs from the original: ``x ** alpha`` other than ``alpha`` in {0, 0.5, 1} is rounded
once from float64's power (torch's CPU ``pow``, SLEEF's, is off by an ulp on a few per cent of
float32 values; on this machine torch 2.13's float32 ``sqrt`` too, where NumPy's is IEEE's): float16
scales are the original's bit for bit (its float32 arithmetic rounded to float16), float32 ones
may differ from torch's in the last bit; weights of different float types are refused (torch would
promote them); the ``1e-5`` floors and ``alpha`` are checked (the original takes any ``alpha``, and
gives infinite scales where float16 overflows: here a ValueError).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .awq import _fold_norm, _per_channel, _pow, _weights
from .observers import MinMax

__all__ = ["AbsMax", "Smoothed", "smooth_scales", "smooth"]

_WHO = "smoothquant"


class AbsMax(MinMax):
    """Each input channel's largest ``|x|`` over calibration activations: SmoothQuant's
    ``act_scales``, a :class:`~qarray.observers.MinMax` along the last axis.

    ``update(x)`` takes activations ``(..., K)``, one row of ``K`` a token (NumPy, CuPy or Dask,
    float or integer; NaN and inf raise ValueError). ``result()`` is float32 ``(K,)``, ``max(-min,
    max)`` of each channel (inf where a float64 value passes float32's range). ``merge``,
    ``state_dict`` and :meth:`Observer.from_state <qarray.observers.Observer.from_state>` as every
    observer's; the range is exact, so any split of the tokens gives the same bits.

    >>> a = AbsMax().update(numpy.array([[1.0, -0.5], [-2.0, 0.25]], numpy.float32))
    >>> a.merge(AbsMax().update(numpy.array([[0.5, -3.0]], numpy.float32))).result()
    array([2., 3.], dtype=float32)
    """

    kind = "absmax"

    def __init__(self):
        super().__init__("qint8", symmetric=True, axis=-1)

    def result(self) -> np.ndarray:
        """Each channel's largest ``|x|``, float32 ``(K,)``."""
        if self.lo is None:
            raise ValueError("AbsMax: no activations observed yet; call update(x) first")
        with np.errstate(over="ignore"):
            return np.maximum(-self.lo, self.hi).astype(np.float32)

    def _settings(self) -> dict:
        return {}

    @classmethod
    def _defaults(cls) -> dict:
        return {}

    def __repr__(self):
        return f"AbsMax({'no data' if self.lo is None else f'{self.lo.shape[0]} channels'})"


def _alpha(alpha) -> float:
    if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise TypeError(f"smoothquant: alpha must be a number in [0, 1], got {alpha!r}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothquant: alpha must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def _inputs(act_absmax, weights, alpha):
    """The checked ``(act_absmax float32 (K,), weights (list, one float type), whether one weight, alpha)``."""
    alpha = _alpha(alpha)
    act = _per_channel(act_absmax, AbsMax, "act_absmax", "max |x|", who=_WHO)
    ws, single = _weights(weights, act.shape[0], _WHO, keep=True, of="act_absmax")
    types = sorted({w.dtype.name for w in ws})
    if len(types) > 1:
        raise TypeError(f"smoothquant: the weights have different float types ({', '.join(types)}); cast them to one")
    return act, ws, single, alpha


def _scales(act, ws, alpha):
    """``smooth_ln_fcs``' arithmetic, in the weights' float type."""
    t = ws[0].dtype.type
    floor = t(1e-5)
    with np.errstate(over="ignore"):
        a = act.astype(t)  # act_scales.to(dtype)
    w_max = np.maximum(np.max([np.abs(w).max(axis=0) for w in ws], axis=0), floor)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        s = np.maximum(_pow(a, alpha) / _pow(w_max, 1 - alpha), floor)
    bad = ~np.isfinite(s)
    if bad.any():
        raise ValueError(f"smoothquant: {int(bad.sum())} scale(s) overflow {np.dtype(t).name} (the first at channel "
                         f"{int(np.argmax(bad))}: act_absmax {act[np.argmax(bad)]!r}); compute them from float32 "
                         "weights")
    return s


def smooth_scales(act_absmax, weights, alpha=0.5) -> np.ndarray:
    """SmoothQuant's per-input-channel scales ``s`` (``smooth_ln_fcs``), in the weights' float type.

    ``act_absmax``: each input channel's largest ``|x|`` (an :class:`AbsMax`, or a float array of
    ``K``, read as float32 as the original keeps it), finite and >= 0. ``weights``: one ``(out, K)``
    weight or a list of weights that take the same input, finite, of one float type. ``alpha`` in
    [0, 1]: the share of the activations' range moved into the weights (0.5 the original's default;
    it uses 0.8 to 0.85 for Llama-like models).

    >>> smooth_scales(numpy.array([16.0, 1.0], numpy.float32), numpy.array([[1.0, -4.0]], numpy.float32))
    array([4. , 0.5], dtype=float32)
    """
    act, ws, _, alpha = _inputs(act_absmax, weights, alpha)
    return _scales(act, ws, alpha)


class Smoothed(NamedTuple):
    """:func:`smooth`'s result: the norm's new weight, the new weight (or list of them) of the linear
    layers after it, the scales ``s``, and the norm's new bias (None without one)."""
    norm: np.ndarray
    weights: np.ndarray | list
    scales: np.ndarray
    bias: np.ndarray | None = None


def smooth(g, weights, act_absmax, alpha=0.5, *, bias=None, offset=0.0) -> Smoothed:
    """SmoothQuant for a norm and the linear layers after it (``smooth_ln_fcs``): the scales of
    :func:`smooth_scales`, the norm's weight ``g`` (``(K,)``; RMSNorm or LayerNorm) and
    ``bias`` (a LayerNorm's) divided by them, each weight's columns multiplied by them. ``offset=1``
    for norms of weight ``1 + g`` (Gemma's): ``(g + 1) / s - 1``. The weights come back in their
    float type, the norm's weight and bias in theirs.

    >>> g2, w2, s, _ = smooth(numpy.ones(2, numpy.float32), numpy.array([[1.0, -4.0]], numpy.float32),
    ...                       numpy.array([16.0, 1.0], numpy.float32))
    >>> g2, w2
    (array([0.25, 2.  ], dtype=float32), array([[ 4., -2.]], dtype=float32))
    """
    act, ws, single, alpha = _inputs(act_absmax, weights, alpha)
    s = _scales(act, ws, alpha)
    folded = _fold_norm(g, s, bias, offset, _WHO)
    norm, new_bias = folded if bias is not None else (folded, None)
    scaled = [w * s for w in ws]
    return Smoothed(norm, scaled[0] if single else scaled, s, new_bias)
