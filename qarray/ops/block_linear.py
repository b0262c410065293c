"""``linear`` with block-format weights (GGUF's Q4_0 ... Q6_K, IQ4_NL, the grouped formats
``int4_g128_f16``, ``nf4_g64_f32``, NVFP4, ...): two modes, each with one exact numeric contract
that every backend, thread count and instruction set follows bit for bit.

``w`` is a block QArray ``(N, K)`` (blocks along K, its last axis); ``bias`` an optional float
array ``(N,)``; the result has shape ``(..., N)``.

**Float activations** (``x`` a float32, float16 or bfloat16 array ``(..., K)``)::

    w_f = w.dequantize()                      # float32, bit for bit (global_scale, columns and all)
    acc = 0.0                                 # float64, for each output (m, n)
    for k in 0 .. K-1:  acc += float64(x[m, k]) * float64(w_f[n, k])   # each product exact
    acc += float64(bias[n])                   # if given
    y[m, n] = float32(acc)                    # one rounding; then to x's dtype if asked

The sum runs in increasing k, one rounding per add (a fused multiply-add gives the same bits:
the products are exact); work is split across n and m only, never across k.

**Q8_0 activations** (``x = qarray.quantize(x, dtype="Q8_0")``, ggml's integer dot products)
against a format whose values are integers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, NVFP4,
TQ2_0, the K-quants Q2_K ... Q6_K, IQ4_XS; grouped ``int*`` / ``uint*`` formats) with sub-blocks
of ``sub`` elements where ``sub`` divides 32 or 32 divides ``sub``. K is cut into pieces, each
inside one activation block (scale ``dx``, codes ``qx``) and one weight sub-block (scale ``s``,
offset ``o`` or 0, integer values ``v = value[code] - zero``): ``min(sub, 32)`` elements. Per
output::

    isum = sum qx * v,  xsum = sum qx                      # exact integers
    term = float64(dx) * float64(s) * isum + float64(dx) * float64(o) * xsum   # left to right
    acc = 0.0; acc += term for each piece in increasing k; acc += float64(bias[n])
    y[m, n] = float32(acc)

``s`` and ``o`` are the stored parameters as ``BlockFormat.parameters`` gives them (float32,
exact: ``d * sc`` of the K-quants, a float16 or bfloat16 scale widened), so a format's
``precision`` does not enter: this mode is the exact product of the stored numbers, summed in
float64, not of ``w.dequantize()``'s values rounded to float16 or bfloat16. ggml sums the same
terms in float32; this is at least as accurate. Formats whose values are not integers (NF4, FP4
codebooks, e4m3, the IQ lattices, LLM.int8's ``_scb``), whose sub-blocks do not meet Q8_0's 32,
or with act-order ``columns`` raise TypeError: use float activations for them.

**Q8_K activations** (``x = qarray.quantize(x, dtype="Q8_K")``: ggml's activations for the
K-quants, one float32 scale ``dx`` and 256 int8 codes a block) against a format of blocks of 256
whose scale is a float ``d`` a block times integer sub-scales ``sc[j]`` (and its offset, if any, a
float ``dm`` times integers ``m[j]``), or ``d`` alone over the block: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_XS, TQ2_0. The sub-scales go into the integer sums, and the float work is done once a block
(``BlockFormat.levels`` gives ``d, sc, dm, m``). Per output and block ``b``, in increasing ``b``::

    S = sum_j sc[j] * sum_{k in sub-block j} qx * v,   M = sum_j m[j] * sum_{k in j} qx   # exact
    term = float64(dx) * float64(d) * S + float64(dx) * float64(dm) * M                   # left to right
    acc += term;  then acc += float64(bias[n]);  y[m, n] = float32(acc)

ggml computes the same sums (its ``bsums`` are the ``sum qx`` of 16 codes) in float32.

``matmul(x, w)`` with a block-format ``w`` raises TypeError: block formats hold ``(N, K)``
weights with blocks along K; use ``linear(x, w)``.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import backends as _backends
from .._formats import ml_dtypes
from .._params import to_host
from .._qarray import QArray

__all__ = ["block_linear", "q8_supported", "q8k_supported"]

_KEYWORDS = ("scale", "zero_point", "mode", "rounding")


def _takes(d) -> bool:
    """Whether ``d`` is float32, float16 or (ml_dtypes') bfloat16: the activations and results this op
    takes (told without importing ml_dtypes, a second's import)."""
    return d in (np.float32, np.float16) or d.name == "bfloat16"


def _out_dtype(dtype, x_dtype):
    """The result's dtype: float32 (None, ``"float32"``), ``x``'s (``"like"``), or float16 /
    bfloat16 named."""
    if dtype is None:
        return np.dtype(np.float32)
    if isinstance(dtype, str) and dtype == "like":
        if x_dtype is None:
            raise TypeError("linear: dtype='like' takes x's float dtype; x is a Q8_0 QArray: name float32, "
                            "float16 or bfloat16")
        return x_dtype
    try:
        d = np.dtype(ml_dtypes().bfloat16 if isinstance(dtype, str) and dtype == "bfloat16" else dtype)
    except (TypeError, ImportError):
        d = None
    if d is None or not _takes(d):
        raise TypeError(f"linear with block-format weights gives float32 (the default), float16 or bfloat16 "
                        f"(dtype='like': x's), not {dtype!r}")
    return d


@functools.cache  # (formats are made once, then kept: a layer's call asked again each time, 6 us of 39)
def q8_supported(fmt) -> str | None:
    """Why block format ``fmt`` cannot take Q8_0 activations, or None where it can."""
    if fmt.elements is not None or fmt.values is None:
        return f"{fmt.name}'s values come from a lattice codebook, not integers"
    v = fmt.values
    if not np.all(np.isfinite(v)) or np.any(v != np.rint(v)) or np.abs(v).max() > 2**15:
        return f"{fmt.name}'s values are not integers"
    if fmt.factor is not None or fmt.tensor_scale is not None:
        return f"{fmt.name} has a second scale factor"
    if 32 % fmt.sub and fmt.sub % 32:
        return f"{fmt.name}'s sub-blocks of {fmt.sub} elements do not meet Q8_0's blocks of 32"
    return None


@functools.cache
def q8k_supported(fmt) -> str | None:
    """Why block format ``fmt`` cannot take Q8_K activations, or None where it can."""
    why = q8_supported(fmt)
    if why is not None:
        return why
    if fmt.block != 256:
        return f"{fmt.name}'s blocks of {fmt.block} elements do not meet Q8_K's blocks of 256"
    if fmt.zero is not None:
        return f"{fmt.name} has zero points"
    if not fmt.leveled:
        return f"{fmt.name}'s scales are not a float a block times integer sub-scales"
    return None


ACTIVATIONS = {"Q8_0": q8_supported, "Q8_K": q8k_supported}  # integer activation formats: why a weight cannot


def _bias(b, bias, n):
    if bias is None:
        return None
    h = np.asarray(to_host(bias))
    if h.dtype.kind != "f" and not _takes(h.dtype) or h.shape != (n,):
        raise ValueError(f"linear: bias must be a float array of shape ({n},), got {h.dtype} {h.shape}")
    return b.param(h.astype(np.float64))


def block_linear(x, w: QArray, bias=None, dtype=None, packed=None, packed_float=None, **given):
    """``linear(x, w, bias, dtype=...)`` for a block-format ``w`` (the module's docstring); ``packed``:
    ``w`` as its backend's ``pack_blocks`` prepared it (:class:`qarray.nn.BlockLinear`), for Q8_0 ``x``;
    ``packed_float``: as its ``pack_blocks_float`` did, for float ``x``."""
    used = [k for k in _KEYWORDS if given.get(k) is not None] + (["relu"] if given.get("relu") else [])
    if used:
        raise TypeError(f"linear with block-format weights ({w.dtype.name}) gives a float array; "
                        f"{', '.join(used)} do not apply (quantize the result if you need a QArray)")
    fmt = w.dtype.layout
    if w.ndim != 2:
        raise ValueError(f"linear: w must have shape (out_features, in_features), got {w.shape}")
    n, k_len = w.shape
    if isinstance(x, QArray):
        if x.dtype.kind != "block" or x.dtype.name.upper() not in ACTIVATIONS:
            raise TypeError(f"linear with {w.dtype.name} weights takes float activations (float32, float16, "
                            f"bfloat16 arrays) or Q8_0 / Q8_K ones (qarray.quantize(x, dtype='Q8_0')), not "
                            f"{x.dtype.name}; dequantize x or quantize it to Q8_0")
        return _q8(x, w, fmt, bias, dtype, n, k_len, packed)
    x, b = _backends.user_array(x, "linear")
    if not _takes(x.dtype):
        raise TypeError(f"linear with block-format weights ({w.dtype.name}) takes float32, float16 or bfloat16 "
                        f"activations (or Q8_0 ones), got {x.dtype}; cast x (x.astype(numpy.float32))")
    out_dtype = _out_dtype(dtype, x.dtype)
    if x.ndim < 1 or x.shape[-1] != k_len:
        raise ValueError(f"linear: x of shape {x.shape} does not meet w of shape {w.shape}: x's last axis must be "
                         f"{k_len} (in_features)")
    b = _backends.common(x, w.data)
    lead = x.shape[:-1]
    x2 = b.asarray(x).reshape(-1, k_len).astype(np.float64)
    cols = None if w.columns is None else np.asarray(to_host(w.columns))
    packed_float = packed_float if cols is None and b is w._backend else None
    y = b.block_linear(x2, w.data, fmt, w.global_scale, cols, _bias(b, bias, n), packed_float)
    return _finish(y, lead, n, out_dtype)


def _finish(y, lead, n, out_dtype):
    y = y.reshape(*lead, n)
    if out_dtype != np.float32:
        with np.errstate(over="ignore"):
            y = y.astype(out_dtype)
    return y


def _q8(xq, w, fmt, bias, dtype, n, k_len, packed=None):
    act = xq.dtype.name.upper()
    why = ACTIVATIONS[act](fmt)
    if why is None and w.columns is not None:
        why = "w's columns are stored in act-order (w.columns), so its blocks do not meet x's"
    if why is not None:
        takes = ("integer values whose sub-blocks meet Q8_0's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, "
                 "MXFP4, NVFP4, TQ2_0, Q2_K..Q6_K, IQ4_XS, int*/uint*_g32/64/128...)") if act == "Q8_0" else \
            "blocks of 256 integer values with integer sub-scales (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, TQ2_0)"
        other = " or Q8_0 activations" if act == "Q8_K" and q8_supported(fmt) is None and w.columns is None else ""
        raise TypeError(f"linear: {act} activations take weights of {takes}; {why}: pass float activations "
                        f"(x.dequantize(), or the float x itself){other} instead")
    out_dtype = _out_dtype(dtype, None)
    if xq.shape[-1] != k_len:
        raise ValueError(f"linear: x of shape {xq.shape} does not meet w of shape {w.shape}: x's last axis must be "
                         f"{k_len} (in_features)")
    b = _backends.common(xq.data, w.data)
    lead = xq.shape[:-1]
    y = b.block_linear_q8(xq.data.reshape(-1, xq.data.shape[-1]), w.data, fmt, _bias(b, bias, n), packed, act)
    return _finish(y, lead, n, out_dtype)
