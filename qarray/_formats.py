"""Floating-point element formats (issue 15, first part): the table, ``finfo``,
and ONNX's QuantizeLinear / DequantizeLinear arithmetic for them on NumPy arrays.

The element types are ml_dtypes' (an optional dependency: extra ``formats``);
this module imports it on first use and names the extra when it is missing.
Not yet wired into QDType / QArray: the functions here take and return plain
arrays, the reference that the QArray path will call.

ONNX's contract (QuantizeLinear-21..25, DequantizeLinear): ``x / scale``
computed in float32 (the scale's float16 or bfloat16 value widened exactly),
then cast to the format rounding to nearest, ties to even. ``saturate=True``
sends finite values beyond the largest and +-inf to +-max; ``saturate=False``
gives inf where the format has it, else NaN. NaN stays NaN where the format
holds it; float6 and float4 hold neither inf nor NaN: they always saturate and
refuse NaN input (ValueError, as the integer formats do). Dequantize is
``element * scale`` in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class FloatFormat(NamedTuple):
    """One element format: its ml_dtypes name, width, whether it holds inf and
    NaN, and the other libraries' spellings."""

    name: str
    bits: int
    has_inf: bool
    has_nan: bool
    aliases: tuple


FORMATS = {f.name: f for f in (
    FloatFormat("float8_e4m3fn", 8, False, True, ("float8e4m3fn", "torch.float8_e4m3fn", "e4m3fn")),
    FloatFormat("float8_e4m3fnuz", 8, False, True, ("float8e4m3fnuz", "torch.float8_e4m3fnuz", "e4m3fnuz")),
    FloatFormat("float8_e5m2", 8, True, True, ("float8e5m2", "torch.float8_e5m2", "e5m2")),
    FloatFormat("float8_e5m2fnuz", 8, False, True, ("float8e5m2fnuz", "torch.float8_e5m2fnuz", "e5m2fnuz")),
    FloatFormat("float6_e2m3fn", 6, False, False, ("float6e2m3fn", "e2m3fn")),
    FloatFormat("float6_e3m2fn", 6, False, False, ("float6e3m2fn", "e3m2fn")),
    FloatFormat("float4_e2m1fn", 4, False, False, ("float4e2m1", "float4_e2m1fn_x2", "torch.float4_e2m1fn_x2", "e2m1")),
    FloatFormat("float8_e8m0fnu", 8, False, True, ("float8e8m0", "torch.float8_e8m0fnu", "e8m0")),
)}
_SPELLINGS = {a: f for f in FORMATS.values() for a in (f.name, *f.aliases)}


def ml_dtypes():
    try:
        import ml_dtypes as m
    except ImportError:
        raise ImportError("floating-point formats need ml_dtypes: pip install 'qarray[formats]'") from None
    return m


def fmt(spec) -> FloatFormat:
    """The format ``spec`` names: ml_dtypes', ONNX's or PyTorch's spelling, or an ml_dtypes dtype."""
    if isinstance(spec, FloatFormat):
        return spec
    spec = getattr(spec, "name", spec) if not isinstance(spec, (str, np.dtype)) else spec  # a QDType
    key = spec if isinstance(spec, str) else getattr(np.dtype(spec), "name", str(spec))
    if key.lower() in _SPELLINGS:
        return _SPELLINGS[key.lower()]
    raise TypeError(f"unknown floating format {spec!r}; use one of {', '.join(FORMATS)}")


def dtype(spec) -> np.dtype:
    """The ml_dtypes NumPy dtype of a format."""
    return np.dtype(getattr(ml_dtypes(), fmt(spec).name))


class FInfo(NamedTuple):
    """``max``, ``smallest_normal``, ``smallest_subnormal`` and ``eps`` of a
    format (float values, ml_dtypes' numbers)."""

    dtype: str
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float


def finfo(spec) -> FInfo:
    """The numbers of a floating format (a QDType or any spelling ``fmt`` takes).

    >>> finfo("float8_e4m3fn").max
    448.0
    """
    f = fmt(spec)
    i = ml_dtypes().finfo(dtype(f))
    return FInfo(f.name, float(i.max), float(i.smallest_normal), float(i.smallest_subnormal), float(i.eps))


def check_saturate(saturate) -> bool:
    """``saturate=`` as a bool (None: the default, True)."""
    if saturate is None:
        return True
    if not isinstance(saturate, (bool, np.bool_)):
        raise TypeError(f"saturate must be True or False, got {saturate!r}")
    return bool(saturate)


def quantize(x, scale, spec, saturate: bool = True) -> np.ndarray:
    """``cast(x / scale)`` to format ``spec`` as ONNX QuantizeLinear does; ``scale``
    broadcasts against ``x`` (per tensor, axis or block: the caller expands it)
    and may be float32, float16 or bfloat16."""
    f = fmt(spec)
    saturate = check_saturate(saturate)
    x = np.asarray(x)
    s = np.asarray(scale)
    if s.dtype != np.float32:
        s = s.astype(np.float32)  # float16 and bfloat16 widen exactly
    v = (x if x.dtype == np.float64 else x.astype(np.float32, copy=False)) / s  # float64 input: one rounding
    if not f.has_nan and np.isnan(v).any():
        raise ValueError(f"cannot quantize NaN to {f.name}, which holds no NaN; replace it first "
                         "(e.g. numpy.nan_to_num)")
    if saturate or not (f.has_inf or f.has_nan):
        top = np.float32(finfo(f).max)
        v = np.clip(v, -top, top)  # NaN stays NaN; beyond the range (inf too): +-max
    if not f.has_nan:  # ONNX adds the zero point, +0.0, for float4/float6: -0 becomes +0 (its reference does;
        v = v + np.float32(0)  # for float8 it adds nothing, so -0 stays -0 there)
    return v.astype(dtype(f))


def dequantize(q, scale, out=np.float32) -> np.ndarray:
    """``element * scale`` in float32 (float64 when asked): DequantizeLinear."""
    ft = np.dtype(out)
    return q.astype(ft) * np.asarray(scale).astype(ft)


# float6 packing: four 6-bit patterns d0..d3 in three bytes, torchao's MXFP6 layout
# (pytorch/ao, torchao/prototype/mx_formats/kernels.py, pack_uint6_pytorch):
#   byte 0: d0[5:2] d1[5:2]    byte 1: d3[5:2] d2[5:2]    byte 2: d0[1:0] d1[1:0] d3[1:0] d2[1:0]
# (high bits first in each byte). A count that is not a multiple of 4 is padded with zeros.
def pack6(bits) -> np.ndarray:
    """6-bit patterns (uint8, flattened) packed four to three bytes."""
    d = np.asarray(bits, np.uint8).reshape(-1)
    d = np.concatenate([d, np.zeros(-d.size % 4, np.uint8)]).reshape(-1, 4)
    hi, lo = d >> 2, d & 3  # the top four and the bottom two bits of each value
    out = np.empty((d.shape[0], 3), np.uint8)
    out[:, 0] = (hi[:, 0] << 4) | hi[:, 1]
    out[:, 1] = (hi[:, 3] << 4) | hi[:, 2]
    out[:, 2] = (lo[:, 0] << 6) | (lo[:, 1] << 4) | (lo[:, 3] << 2) | lo[:, 2]
    return out.reshape(-1)


def unpack6(packed, count: int) -> np.ndarray:
    """The first ``count`` 6-bit patterns of :func:`pack6` bytes."""
    p = np.asarray(packed, np.uint8).reshape(-1, 3)
    a, b, c = p[:, 0], p[:, 1], p[:, 2]
    d = np.stack([((a >> 4) << 2) | (c >> 6), ((a & 15) << 2) | ((c >> 4) & 3),
                  ((b & 15) << 2) | (c & 3), ((b >> 4) << 2) | ((c >> 2) & 3)], axis=1)
    return d.reshape(-1)[:count].astype(np.uint8)
