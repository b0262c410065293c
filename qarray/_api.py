"""quantize, dequantize, requantize, quantize_dynamic, choose_qparams, unpack."""

from __future__ import annotations

import functools
import math
import operator

import numpy as np

from . import _formats, _philox
from . import backends as _backends
from .backends import on_data_device, user_array
from ._config import resolve
from ._dtypes import QDType, qdtype, quint8
from ._fixed_point import plan
from ._blocks import FORMATS
from ._params import Quant, check_params, check_scale, expand, float_values, kept, param_shape, to_host
from . import _qarray
from ._qarray import QArray, float_dtype
from .backends._base import nan_error

__all__ = ["quantize", "dequantize", "requantize", "quantize_dynamic", "quantize_mx", "quantize_nvfp4",
           "choose_qparams", "unpack"]


_FLOATS = frozenset(map(np.dtype, ("float16", "float32", "float64")))


def _float_input(x, what):
    if type(x) is np.ndarray and x.dtype in _FLOATS:  # the common call, as user_array would return it
        return x, _backends.for_array(x)
    x, b = user_array(x, what)
    x = float_values(x)
    if x.dtype.kind != "f" or x.dtype.itemsize > 8:
        raise TypeError(
            f"{what} takes float16, float32 or float64 input, got {x.dtype}; "
            "convert it (e.g. x.astype(numpy.float32)), or use QArray.from_int for integers"
        )
    return x, b


@on_data_device
def quantize(x, scale=None, zero_point=0, dtype="qint8", axis=None, block_size=None, saturate=None,
             reciprocal=False, rounding=None, seed=None, importance=None) -> QArray:
    """Quantize float data: ``q = clamp(round_half_even(x / scale) + zero_point, qmin, qmax)``.

    The division is IEEE float32 for float16/float32 input, float64 for float64
    input (ONNX QuantizeLinear, bit for bit). ``axis`` gives per-axis
    parameters, ``axis`` plus ``block_size`` blocked ones (the last block may be
    short). +-inf saturate; NaN raises ValueError.

    ``reciprocal=True`` gives PyTorch's codes instead (``quantize_per_tensor``,
    ``quantize_per_channel``, its observers' ``quantize``): ``x`` times the
    float32 reciprocal ``float32(1 / scale)``, rounded to float32, then rounded
    half to even, for float32 input (float16 and bfloat16 widened; PyTorch
    takes no float64) and integer formats. The two differ where ``x / scale``
    is at or next to a tie: at ``+-127.5`` on symmetric ranges, every channel's
    extreme value (README, Quirks).

    ``rounding="stochastic"`` (with ``seed=``, an int in ``[0, 2**64)``) rounds
    ``x / scale`` down or up, up with probability its fraction, so that the
    expected code is exact (quantized gradients): the random bits of each
    element are Philox4x32-10's (``qarray._philox``) of its flat index in the
    array, keyed by the seed, so the same seed gives the same codes on every
    backend and every Dask chunking. Integer formats; the default
    ``"half_even"`` is the rounding described above.

    >>> quantize(numpy.array([0.014, 0.015, 9.0], numpy.float32), 0.01, 0, "qint8").int_repr()
    array([  1,   2, 127], dtype=int8)

    A block format (``dtype="Q4_K"``: GGUF's types, case-insensitive) picks its
    own parameters, block by block along the last axis, whose length must be a
    multiple of its block: the bytes of its reference quantizer (gguf-py's, or
    ggml's ``ggml_quantize_chunk`` for the K-quants and IQ4_NL/IQ4_XS), from the
    values rounded to float32.

    ``importance`` (Q2_K .. Q6_K, IQ4_NL, IQ4_XS) is llama.cpp's importance
    matrix of the tensor: one value >= 0 per column (``x.shape[-1]`` of them,
    float32, shared by every row), the mean square of the activations that
    column multiplies (``observers.ImportanceMatrix`` collects it). The bytes
    are then ggml's importance-weighted ones, ``ggml_quantize_chunk`` with the
    matrix, as ``llama-quantize --imatrix`` writes them.
    """
    x, b = _float_input(x, "quantize")
    d = qdtype(dtype)
    if importance is not None and not (d.kind == "block" and d.layout.takes_importance):
        takes = [n for n, f in FORMATS.items() if f.takes_importance]
        raise TypeError(f"quantize: importance= (llama.cpp's imatrix) is taken by {', '.join(takes[:-1])} and "
                        f"{takes[-1]}, whose ggml quantizers weight by it; {d.name} has no such quantizer: drop "
                        "importance, or pick one of those")
    if d.kind == "block":
        given = dict(scale=scale, zero_point=zero_point or None, axis=axis, block_size=block_size, saturate=saturate,
                     reciprocal=reciprocal or None, rounding=rounding, seed=seed)
        return _quantize_blocks(x, b, d, [k for k, v in given.items() if v is not None], importance)
    if scale is None:
        raise TypeError(f"quantize: {d.name} needs a scale (block formats such as Q4_K choose their own)")
    s, z, axis, block_size = check_params(scale, zero_point, d, x.shape, axis, block_size)
    key = _stochastic(rounding, seed, reciprocal, "quantize")
    if d.kind == "float":  # ONNX's cast to a floating format (qarray._formats); zero_point is 0
        if key is not None:
            raise TypeError(f"quantize: rounding='stochastic' is for integer formats; {d.name} rounds to nearest even")
        if reciprocal:
            raise TypeError(f"quantize: reciprocal=True is PyTorch's arithmetic for integer formats; {d.name} is a "
                            "floating format")
        data = b.quantize_float(x, s, d, axis, block_size, _formats.check_saturate(saturate))
        return QArray._new(data, s, z, d, axis, block_size, b)
    if saturate is not None:
        raise TypeError(f"quantize: saturate= is for floating formats; {d.name} is an integer format, which always "
                        "saturates")
    if key is not None:
        return QArray._new(b.quantize_stochastic(x, Quant(s, z, d, axis, block_size), key), s, z, d, axis, block_size,
                           b)
    if reciprocal:  # PyTorch's (fbgemm's) x * (1 / scale), rounded to float32; then divided by 1, exactly
        if x.dtype == np.float64:
            raise TypeError("quantize: reciprocal=True is PyTorch's float32 arithmetic, and PyTorch takes no float64: "
                            "pass x.astype(numpy.float32), or divide (reciprocal=False)")
        inv = expand(np.float32(1) / s, x.shape, axis, block_size)
        x, s1 = x.astype(np.float32, copy=False) * b.asarray(inv), np.ones_like(s)
        return QArray._new(b.quantize(x, Quant(s1, z, d, axis, block_size)), s, z, d, axis, block_size, b)
    return QArray._new(b.quantize(x, Quant(s, z, d, axis, block_size)), s, z, d, axis, block_size, b)


def _quantize_blocks(x, b, d, given, importance=None):
    """quantize's block formats: the format's quantizer on the host, block by block."""
    f = d.layout
    if given:
        raise TypeError(f"quantize: {d.name} chooses its own parameters, block by block; drop {', '.join(given)}")
    if f.quantize is None:
        raise TypeError(f"quantize: {d.name} is read only here (its lattice codebook needs llama.cpp's importance "
                        "search); pick another format, e.g. IQ4_XS or Q4_K")
    if x.ndim == 0 or x.shape[-1] % f.block:
        raise ValueError(f"quantize: {d.name} quantizes blocks of {f.block} values along the last axis, whose "
                         f"length {x.shape[-1] if x.ndim else 'of a 0-d array'} is not a multiple of {f.block}; pad "
                         "or choose a format with smaller blocks")
    g = None
    if f.tensor_scale is not None:  # NVFP4's tensor scale, from the largest magnitude (1 where it is 0)
        amax = float(to_host(b.xp.abs(x).max())) if x.size else 0.0
        g = f.quantize.tensor_scale(amax or 1.0) if np.isfinite(amax) else np.float32(1)
    if importance is not None:
        importance = _importance(importance, x.shape[-1])
    return QArray._blocks(b.map_rows(functools.partial(_block_bytes, f=f, g=g, importance=importance), x,
                                     f.nbytes / f.block, np.uint8), d, b, None, g)


def _importance(w, columns):
    """quantize's ``importance``, checked: float32 on the host, ``(columns,)``, finite, >= 0."""
    w = float_values(np.asarray(to_host(w)))
    if w.dtype.kind not in "fiu":
        raise TypeError(f"quantize: importance takes real numbers (an importance matrix), got dtype {w.dtype}")
    if w.shape != (columns,):
        raise ValueError(f"quantize: importance holds one value per column of x, shape ({columns},) here (llama.cpp's "
                         f"imatrix of the tensor: one entry per input column), got shape {w.shape}")
    with np.errstate(over="ignore"):
        w32 = w.astype(np.float32)
    for bad, what in ((~np.isfinite(w), "NaN or infinite value(s)"),
                      (~np.isfinite(w32), "value(s) beyond float32's range"), (w < 0, "negative value(s)")):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"quantize: importance holds {int(bad.sum())} {what} (the first, {w[i].item()!r}, at "
                             f"column {i}); an importance matrix is a mean of squares, finite float32 values >= 0: "
                             "collect it again (observers.ImportanceMatrix) or set those columns to 0")
    return w32


_BLOCK_CHUNK = 1 << 15  # values quantized at a time by a block format's quantizer


def _block_bytes(x, f, g=None, importance=None):
    """The bytes of ``f`` for host values ``x`` (rows along the last axis); ``importance`` one value a column."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = x.reshape(-1, f.block)
    out = np.empty((len(blocks), f.nbytes), np.uint8)
    fill = _backends.get("numpy").q8_quantizer(f.name) if f.name in ("Q8_0", "Q8_K") else None
    # (activations, call after call: the kernels' scales say whether x is finite, a pass over x less)
    if fill is None or not fill(blocks, out):
        bad = ~np.isfinite(x)
        if bad.any():
            raise ValueError(f"quantize: {int(bad.sum())} value(s) are NaN or infinite (the first at flat index "
                             f"{int(np.flatnonzero(bad)[0])}); {f.name} holds finite values only")
    if fill is not None:
        return out.reshape(*x.shape[:-1], x.shape[-1] // f.block * f.nbytes)
    step = max(1, _BLOCK_CHUNK // f.block)  # a chunk's temporaries stay in cache (2x on Q8_0 at 2^24 values)
    per_row = x.shape[-1] // f.block
    for i in range(0, len(blocks), step):
        part = blocks[i:i + step]
        if importance is not None:  # each block's entries: its columns' importance
            fields = f.quantize(part, importance.reshape(per_row, f.block)[np.arange(i, i + len(part)) % per_row])
        else:
            fields = f.quantize(part) if g is None else f.quantize(part, g)
        out[i:i + step] = f.pack(fields)
    return out.reshape(*x.shape[:-1], x.shape[-1] // f.block * f.nbytes)


def _stochastic(rounding, seed, reciprocal, what):
    """The Philox key for ``rounding="stochastic"``, None for the default rounding;
    clear errors for anything else."""
    if rounding in (None, "half_even"):
        if seed is not None:
            raise TypeError(f"{what}: seed= is for rounding='stochastic'")
        return None
    if rounding != "stochastic":
        raise ValueError(f"{what}: rounding must be 'half_even' or 'stochastic', got {rounding!r}")
    if reciprocal:
        raise TypeError(f"{what}: reciprocal=True is PyTorch's round to nearest; stochastic rounding divides")
    return _philox.key(seed)


@on_data_device
def fake_quantize(x, scale, zero_point=0, dtype="qint8", axis=None, block_size=None, return_mask=False,
                  rounding=None, seed=None, out=None):
    """``quantize(x, ...).dequantize(x.dtype)`` bit for bit, in one pass: float in,
    float out of ``x``'s dtype (float16 and ml_dtypes' bfloat16/float8 input:
    the float32 result rounded once more, as ``dequantize`` rounds float16).

    On the CPU (Numba) and CUDA, integer formats go through quantize's kernel,
    which writes the dequantized value instead of the code: no integer array in
    between. Floating formats (float8, float6, float4 at a given scale) are
    ``quantize`` then ``dequantize``.

    ``return_mask=True`` also returns the straight-through estimator's mask
    (bool, ``x``'s shape), as PyTorch's ``fake_quantize_per_tensor_affine``
    backward uses it: True where ``rint(x / scale) + zero_point`` lies inside
    ``[qmin, qmax]`` before the clamp (False for +-inf); for a floating format,
    where ``|x / scale|`` is at most its largest value. PyTorch multiplies by
    ``1 / scale`` where qarray divides: the two differ where ``x / scale`` is
    at or next to a tie (README, Quirks).

    ``rounding="stochastic"`` with ``seed=`` rounds as :func:`quantize` does
    (integer formats; the mask then says where the stochastically rounded
    value was inside). ``out``, as in NumPy, is an array (``x``'s dtype,
    shape and backend) to write the values into: a buffer kept from step to
    step spares a new output's page faults (on 2^24 float32, about a third of
    the call).

    >>> fake_quantize(numpy.array([0.014, 0.015, 9.0], numpy.float32), 0.01, 0, "qint8", return_mask=True)
    (array([0.01, 0.02, 1.27], dtype=float32), array([ True,  True, False]))
    """
    want = getattr(x, "dtype", None)
    x, b = _float_input(x, "fake_quantize")
    d = qdtype(dtype)
    s, z, axis, block_size = check_params(scale, zero_point, d, x.shape, axis, block_size)
    ft = x.dtype.type
    if out is not None:
        _check_out(out, b, x.shape, np.dtype(want if want is not None else ft), "fake_quantize", " (x's)")
    key = _stochastic(rounding, seed, False, "fake_quantize")
    if d.kind == "float":
        if key is not None:
            raise TypeError(f"fake_quantize: rounding='stochastic' is for integer formats; {d.name} rounds to "
                            "nearest even")
        codes = b.quantize_float(x, s, d, axis, block_size, _formats.check_saturate(None))
        values = b.dequantize_float(codes, s, d, axis, block_size, ft)
        inside = None
        if return_mask:
            with np.errstate(over="ignore", invalid="ignore"):
                ratio = x.astype(np.float32, copy=False) / b.asarray(expand(s, x.shape, axis, block_size))
            inside = b.xp.abs(ratio) <= np.float32(d.qmax)
    else:
        direct = out if out is not None and out.dtype == ft else None  # written by the kernel itself
        values, inside = b.fake_quantize(x, Quant(s, z, d, axis, block_size), ft, return_mask, key, out=direct)
    if want is not None and values.dtype != want:
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as dequantize rounds it
            values = values.astype(want)
    if out is not None and values is not out:
        out[...] = values
        values = out
    return (values, inside) if return_mask else values


def _check_out(out, b, shape, dtype, what, which=""):
    """ValueError unless ``out`` is a writeable ``b`` array of ``shape`` and
    ``dtype`` (``which`` says whose dtype that is)."""
    if _backends.for_array(out) is not b or out.shape != shape or out.dtype != dtype:
        raise ValueError(
            f"{what}: out must be a {b.name} array of shape {shape} and dtype {dtype}{which}, got "
            f"{type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}"
        )
    if not getattr(getattr(out, "flags", None), "writeable", True):  # (dask arrays have no flags)
        raise ValueError(f"{what}: out is read-only; pass a writeable array (or out=None for a new one)")


@on_data_device
def dequantize(q: QArray, dtype="float32"):
    """Real values ``(q - zero_point) * scale``, computed in float32 (float64 when
    ``dtype`` is float64); float16 is the float32 result rounded once."""
    if not isinstance(q, QArray):
        raise TypeError(f"dequantize takes a QArray, got {type(q).__name__}")
    ft = float_dtype(dtype)
    if q.dtype.kind == "block":  # scale * (value - zero) + offset, as the format's reference computes it
        y = q._backend.dequantize_blocks(q.data, q.dtype.layout, ft, q.global_scale)
        return y if q.columns is None else y[..., np.argsort(q.columns)]  # stored column i holds columns[i]
    if q.dtype.kind == "float":  # element * scale in float32 (float64 on request)
        if q.global_scale is None:
            return q._backend.dequantize_float(q.data, q.scale, q.dtype, q.axis, q.block_size, ft)
        # NVFP4: element * block scale is exact in float32 (2 + 4 significant bits);
        # times the tensor scale it rounds once (float64: exactly)
        wide = np.float64 if ft == np.float64 else np.float32
        v = q._backend.dequantize_float(q.data, q.scale, q.dtype, q.axis, q.block_size, wide)
        with np.errstate(over="ignore"):
            return (v * wide(q.global_scale)).astype(ft, copy=False)
    return q._backend.dequantize(q.data, q.scale, q.zero_point, q.axis, q.block_size, ft)


@kept
def _requantize_plan(s_in, z_in, shape, axis_in, block_in, scale, zero_point, d, axis, block_size, mode, rounding):
    """requantize's checked output parameters and its ``Requant``, on the
    parameter layout that covers both the input's and the output's; kept, as
    all of it repeats call after call."""
    s_out, z_out, axis, block_size = check_params(scale, zero_point, d, shape, axis, block_size)
    if axis_in is None or axis is None or (axis, block_size) == (axis_in, block_in):
        lax, lblock = (axis, block_size) if axis_in is None else (axis_in, block_in)
    else:
        raise ValueError(
            f"cannot requantize from parameters on axis {axis_in} (block_size={block_in}) to "
            f"parameters on axis {axis} (block_size={block_size}); requantize to per-tensor "
            "parameters first or keep the same axis"
        )
    want = param_shape(shape, lax, lblock)

    def host(p):
        return p if p.shape == want else np.broadcast_to(p, want)

    rq = plan([host(s_in)], host(s_out), host(z_in), host(z_out), d, mode, rounding, axis=lax, block_size=lblock)
    return rq, s_out, z_out, axis, block_size


@on_data_device
def requantize(q: QArray, scale, zero_point=0, dtype=None, axis=None, block_size=None, *,
               mode=None, rounding=None, out=None, seed=None) -> QArray:
    """The values of ``q`` at new parameters and dtype, without going through float.

    ``mode="fixed"`` (default): ``M = scale_in / scale_out`` becomes an integer
    multiplier and shift, and ``clamp(R((q - zp_in) * m, s) + zp_out)`` is exact in
    int64; ``rounding`` breaks ties ("half_even", "half_away", "half_up") or
    reproduces gemmlowp ("tflite"). ``mode="float"``: ONNX's
    ``rint(float64(q - zp_in) * float32(scale_in / scale_out) + zp_out)``.
    Defaults come from ``qarray.config``. ``rounding="stochastic"`` (with
    ``seed=``) rounds the exact quotient down or up, up with probability its
    fraction, the random bits drawn as :func:`quantize`'s (``mode="fixed"``).
    ``dtype`` defaults to ``q.dtype``.
    ``out``, as in NumPy, is an array (``dtype``'s storage, ``q``'s shape, ``q``'s
    backend) to write the integers into; the result's ``data`` is then ``out``.

    >>> q = QArray.from_int(numpy.array([5, 7]), 1.0, 0, "qint32")
    >>> requantize(q, 2.0, 0, "qint8").int_repr()   # 2.5 -> 2, 3.5 -> 4
    array([2, 4], dtype=int8)
    """
    if not isinstance(q, QArray):
        raise TypeError(f"requantize takes a QArray, got {type(q).__name__}")
    d = q.dtype if dtype is None else qdtype(dtype)
    if "float" in (q.dtype.kind, d.kind):  # through the real values: dequantize, then quantize
        if mode is not None or rounding is not None or out is not None or seed is not None:
            raise TypeError("requantize to or from a floating format dequantizes to float32 and quantizes again: "
                            "mode=, rounding=, out= and seed= do not apply")
        return quantize(dequantize(q), scale, zero_point, d, axis, block_size)
    key = None
    if rounding == "stochastic":
        if mode not in (None, "fixed"):
            raise TypeError("requantize: rounding='stochastic' rounds the exact fixed-point quotient; "
                            f"pass mode='fixed' (or leave mode out), not {mode!r}")
        key, mode, rounding = _philox.key(seed), "fixed", "half_even"  # the plan's multiplier and shift
    elif seed is not None:
        raise TypeError("requantize: seed= is for rounding='stochastic'")
    mode, rounding = resolve(mode, rounding)
    rq, s_out, z_out, axis, block_size = _requantize_plan(q.scale, q.zero_point, q.shape, q.axis, q.block_size,
                                                          scale, zero_point, d, axis, block_size, mode, rounding)
    b = q._backend
    if out is not None:
        _check_out(out, b, q.shape, d.storage, "requantize", f" (the storage of {d.name})")
    if key is None:
        data = b.requantize(q.data, rq, out)
    else:
        data = b.requantize_stochastic(q.data, rq, key)
        if out is not None:
            out[...] = data
            data = out
    return QArray._new(data, s_out, z_out, d, axis, block_size, b)


def choose_qparams(min_val, max_val, dtype="quint8", symmetric=False):
    """Scale and zero point that map ``[min_val, max_val]`` (widened to hold 0) onto
    ``dtype``, computed in float32 as ONNX DynamicQuantizeLinear does.

    Asymmetric: ``scale = (max - min) / (qmax - qmin)``,
    ``zero_point = rint(clamp(qmin - min / scale))``. Symmetric:
    ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)``, zero point 0 (signed)
    or the middle code (unsigned). An empty range gives scale ``1 / (qmax - qmin)``;
    a range so small that the scale would round to 0 gets the smallest float32 above 0.
    Works elementwise on arrays (per-axis and blocked ranges).

    >>> choose_qparams(-1.0, 3.0, "quint8")
    (np.float32(0.015686275), np.int32(64))
    """
    d = qdtype(dtype)
    lo, hi = (np.asarray(to_host(v)) for v in (min_val, max_val))
    for name, v in (("min_val", lo), ("max_val", hi)):
        if v.dtype.kind not in "fiu":
            raise TypeError(f"choose_qparams: {name} must be real (float or integer), got dtype {v.dtype}")
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise ValueError("choose_qparams needs finite min_val and max_val (got NaN or inf)")
    if (lo > hi).any():
        raise ValueError(f"choose_qparams needs min_val <= max_val, got {lo} > {hi}")
    return _qparams(lo, hi, d, symmetric, "choose_qparams: the range")


def _qparams(min_val, max_val, d: QDType, symmetric, what):
    """choose_qparams on checked (finite, ordered) bounds; ``what`` starts the
    error message for a range too wide for float32. Floating formats are
    symmetric by nature (zero point 0): their scale is always the symmetric one."""
    symmetric = symmetric or d.kind == "float"
    with np.errstate(over="ignore"):  # beyond float32: inf, reported below
        lo, hi = np.asarray(min_val, np.float32), np.asarray(max_val, np.float32)
    lo = np.minimum(np.float32(0), lo)
    hi = np.maximum(np.float32(0), hi)
    qmin, qmax = np.float32(d.qmin), np.float32(d.qmax)
    tiny = np.float32(1e-45)  # the smallest float32 above 0 (ONNX can give subnormal scales)
    with np.errstate(over="ignore"):  # max - min beyond float32: reported below
        if symmetric:
            amax = np.maximum(-lo, hi)
            scale = np.where(amax == 0, np.float32(1), amax) / np.float32((d.qmax - d.qmin) / 2)
        else:
            scale = np.where(hi == lo, np.float32(1), hi - lo) / (qmax - qmin)
    if not np.isfinite(scale).all():
        i = np.unravel_index(int(np.argmax(~np.isfinite(scale))), scale.shape)
        a, b, fa, fb = (np.broadcast_to(v, scale.shape)[i] for v in (min_val, max_val, lo, hi))
        hint = ", or use symmetric=True" if not symmetric and np.isfinite(fa) and np.isfinite(fb) else ""
        raise ValueError(f"{what} [{a!s}, {b!s}] is too wide for float32 scales "
                         f"((max - min) / {d.qmax - d.qmin} overflows float32); clip it{hint}")
    scale = np.maximum(scale, tiny).astype(np.float32)
    if symmetric:
        zp = np.full(scale.shape, 0 if d.signed else (d.qmin + d.qmax + 1) // 2, np.int32)
    else:
        zp = np.rint(np.clip(qmin - lo / scale, qmin, qmax)).astype(np.int32)
    return scale, zp


@on_data_device
def quantize_dynamic(x, dtype=quint8, symmetric=False, axis=None, block_size=None, reciprocal=False) -> QArray:
    """Quantize with parameters from the data's own range (per tensor, axis or block).

    The asymmetric range always includes 0, as in ONNX DynamicQuantizeLinear,
    whose results this equals bit for bit for quint8. A floating format takes
    ``scale = amax / its largest value`` (float32; the "current scaling" of
    Transformer Engine and torchao; ``symmetric`` does not apply), an all-zero
    slice scale 1. ``reciprocal`` as :func:`quantize` takes it.
    """
    x, b = _float_input(x, "quantize_dynamic")
    d = qdtype(dtype)
    # the checks (and so the errors) of quantize, before the data is looked at
    _, _, axis, block_size = check_params(1.0, 0, d, x.shape, axis, block_size)
    if x.size == 0:
        raise ValueError("quantize_dynamic needs a non-empty array to choose parameters from")
    lo, hi = (to_host(v) for v in b.minmax(x, axis, block_size))
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        if bool(b.xp.isnan(x).any()):
            raise nan_error(x)
        raise ValueError("quantize_dynamic needs finite input to choose parameters; x has inf")
    if d.kind == "float":
        amax = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float32)
        scale = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(d.qmax), np.float32(2.0**-149)))
        return quantize(x, scale.astype(np.float32), 0, d, axis, block_size, reciprocal=reciprocal)
    scale, zp = _qparams(lo, hi, d, symmetric, "quantize_dynamic: the data's range")
    return quantize(x, scale, zp, d, axis, block_size, reciprocal=reciprocal)


def _block_input(x, what, axis, block_size):
    """Checked float input of the MX and NVFP4 quantizers: float16 widened to
    float32 (float64 stays), the axis normalised."""
    x, b = _float_input(x, what)
    if x.ndim == 0:
        raise ValueError(f"{what} takes an array of at least one dimension (blocks run along an axis)")
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    _, _, axis, block_size = check_params(1.0, 0, qdtype("qint8"), x.shape, axis, block_size)
    return x, b, axis, block_size


@on_data_device
def quantize_mx(x, fmt, axis=-1, block_size=32, scale_rounding="floor") -> QArray:
    """OCP Microscaling (MX v1.0): one power-of-two scale per ``block_size``
    elements along ``axis``, stored as E8M0 (``q.scale.dtype`` is
    ``float8_e8m0fnu``); ``fmt`` is ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e2m3``,
    ``mxfp6_e3m2``, ``mxfp4`` or ``mxint8``.

    The scale of a block is ``2**e``: ``scale_rounding="floor"`` is the spec's
    ``floor(log2(amax)) - emax_elem``; ``"ceil"``, ``"even"`` and ``"rceil"``
    (``ceil(log2(amax / max_elem))``, NVIDIA's and cuBLAS's) as torchao's
    ``ScaleCalculationMode`` defines them, computed exactly
    (``qarray._formats.mx_exponents``). Elements are ``x / 2**e`` rounded to the
    nearest element value, ties to even, saturating to the element's largest;
    a block holding NaN or inf gets the NaN scale (0xFF, the spec's rule; its
    elements are 0), an all-zero block the smallest scale 2**-127. The last block
    may be short. ``dequantize`` gives ``element * 2**e`` (exact unless it
    overflows float32). The arithmetic: :meth:`Backend.quantize_mx`.

    >>> q = quantize_mx(numpy.array([[1.0, -3.0, 0.375, 6.0]], numpy.float32), "mxfp4", block_size=4)
    >>> q.dequantize(), q.scale.astype(numpy.float32)
    (array([[ 1. , -3. ,  0.5,  6. ]], dtype=float32), array([[1.]], dtype=float32))
    """
    if fmt not in _formats.MX_FORMATS:
        raise ValueError(f"quantize_mx: fmt must be one of {', '.join(_formats.MX_FORMATS)}, got {fmt!r}")
    if scale_rounding not in _formats.SCALE_ROUNDINGS:
        raise ValueError(f"quantize_mx: scale_rounding must be one of {', '.join(_formats.SCALE_ROUNDINGS)}, "
                         f"got {scale_rounding!r}")
    mx = _formats.MX_FORMATS[fmt]
    x, b, axis, block_size = _block_input(x, "quantize_mx", axis, block_size)
    codes, bits = b.quantize_mx(x, mx, axis, block_size, scale_rounding)
    return QArray._new(codes, bits.view(_formats.dtype("float8_e8m0fnu")), np.zeros(bits.shape, np.int32),
                       qdtype(mx.element), axis, block_size, b)


@on_data_device
def quantize_nvfp4(x, axis=-1, global_scale=None) -> QArray:
    """NVIDIA's NVFP4: float4_e2m1fn elements in blocks of 16 along ``axis``, one
    float8_e4m3fn scale per block and one float32 tensor scale (``q.global_scale``),
    as NVIDIA and torchao's ``NVFP4Tensor`` define them.

    ``global_scale`` defaults to ``amax / (448 * 6)`` over the finite values (1
    where that is 0). In float32, as torchao: ``s = e4m3(clamp(amax_block / 6 /
    global_scale, 2**-6, 448))``, elements ``e2m1(clamp(x * ((1 / global_scale) / s),
    -6, 6))`` rounding to nearest even. A block holding inf (and no NaN) follows
    the same rule, as torchao's ``nvfp4_quantize``: its scale clamps to 448 (code
    0x7e), inf and -inf saturate to +-6 (codes 0x7 and 0xf), its finite elements
    round as ``x * ((1 / global_scale) / 448)``. A block holding NaN gets a NaN
    scale (0x7f; its elements 0), as MX does. The default ``global_scale`` skips
    inf (torchao's ``per_tensor_amax_to_scale`` of an inf amax would be inf).
    ``dequantize`` is ``float32(element * s) * global_scale``, one rounding. The
    arithmetic: :meth:`Backend.quantize_nvfp4`.
    """
    x, b, axis, block_size = _block_input(x, "quantize_nvfp4", axis, 16)
    x = x.astype(np.float32, copy=False)
    gs = None
    if global_scale is not None:
        if np.shape(to_host(global_scale)) != ():
            raise ValueError(f"quantize_nvfp4: global_scale must be one number, got shape {np.shape(to_host(global_scale))}")
        gs = check_scale(global_scale)
    codes, bits, gs = b.quantize_nvfp4(x, axis, block_size, gs)
    return QArray._new(codes, bits.view(_formats.dtype("float8_e4m3fn")), np.zeros(bits.shape, np.int32),
                       qdtype("float4_e2m1fn"), axis, block_size, b, gs)


def packed_layout(d: QDType, count: int):
    """How ``QArray.pack()`` stores ``count`` values of ``d``: ``(NumPy dtype, number of items)``."""
    if d.bits == 6:  # float6: four in three bytes
        return np.dtype(np.uint8), -(-count // 4) * 3
    if d.packed:
        return np.dtype(np.uint8), -(-count * d.bits // 8)
    return d.bits_dtype, count


def _shape(op, shape) -> tuple:
    """``shape`` (an integer or a sequence of them) as a tuple of non-negative ints."""
    dims = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    try:
        dims = tuple(operator.index(n) for n in dims)
    except TypeError:
        raise TypeError(f"{op}: shape must hold integers, got {shape!r}") from None
    if any(n < 0 for n in dims):
        raise ValueError(f"{op}: shape must hold non-negative integers, got {shape!r}")
    return dims


@on_data_device
def unpack(packed, dtype, shape):
    """Integers from ``QArray.pack()`` bytes: ``dtype``'s storage, reshaped to ``shape``.

    >>> q = QArray.from_int(numpy.array([1, -2, 3]), 1.0, 0, "qint4")
    >>> unpack(q.pack(), "qint4", (3,))
    array([ 1, -2,  3], dtype=int8)
    """
    d: QDType = qdtype(dtype)
    if isinstance(packed, (bytes, bytearray)):
        packed = np.frombuffer(bytes(packed), np.uint8)
    packed, b = user_array(packed, "unpack")
    shape = _shape("unpack", shape)
    count = math.prod(shape)  # a Python int: no int64 wrap-around for huge shapes
    want_dtype, items = packed_layout(d, count)
    if packed.dtype != want_dtype:
        raise TypeError(f"unpack: {d.name} data comes as {want_dtype.name}, got {packed.dtype}")
    if packed.size != items:
        raise ValueError(f"unpack: {count} {d.name} values need {items} items, got {packed.size}")
    if d.bits == 6:  # float6: four in three bytes
        codes = _formats.unpack6(to_host(packed), count)
    elif d.packed:  # a floating format's bit patterns are unsigned
        codes = b.unpack(packed.reshape(-1), d.bits, d.signed and d.kind == "int", count)
    else:
        codes = packed.reshape(-1).copy()
    return codes.reshape(shape).view(d.storage)


_qarray.API.update(dequantize=dequantize, requantize=requantize)  # QArray.dequantize / .requantize
