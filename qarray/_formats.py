"""Floating-point element formats: the table, ``finfo``, ONNX's QuantizeLinear /
DequantizeLinear arithmetic for them, and the OCP Microscaling (MX v1.0) and
NVFP4 block scalings, on NumPy arrays (the reference the backends follow).

The element types are ml_dtypes' (an optional dependency: extra ``formats``);
this module imports it on first use and names the extra when it is missing.
``mxint8`` is MXINT8's element: an int8 code ``c`` meaning ``c * 2**-6``
(stored as int8; the OCP spec's "8-bit two's complement with an implicit scale").

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
    FloatFormat("mxint8", 8, False, False, ()),
)}
MXINT8_UNIT = 2.0**-6  # the value of mxint8 code 1
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
    """The NumPy dtype that holds a format: ml_dtypes' (int8 for mxint8)."""
    f = fmt(spec)
    return np.dtype(np.int8) if f.name == "mxint8" else np.dtype(getattr(ml_dtypes(), f.name))


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
    if f.name == "mxint8":  # codes -127..127 times 2**-6 (the spec's range, symmetric as microxcaling has it)
        return FInfo(f.name, 127 * MXINT8_UNIT, MXINT8_UNIT, MXINT8_UNIT, MXINT8_UNIT)
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
    and may be float32, float16, bfloat16 or an 8-bit scale format."""
    f = fmt(spec)
    saturate = check_saturate(saturate)
    x = np.asarray(x)
    s = np.asarray(scale)
    if s.dtype != np.float32:
        s = s.astype(np.float32)  # float16, bfloat16 and the 8-bit scales widen exactly
    with np.errstate(over="ignore"):  # beyond float32: inf, then as inf
        v = (x if x.dtype == np.float64 else x.astype(np.float32, copy=False)) / s  # float64 input: one rounding
    if not f.has_nan and np.isnan(v).any():
        raise nan_error(f)
    if not f.has_nan:  # ONNX adds the zero point, +0.0, for float4/float6: -0 becomes +0 (its reference does;
        v = v + np.float32(0)  # for float8 it adds nothing, so -0 stays -0 there)
    return cast(v, f, saturate)


def nan_error(spec) -> ValueError:
    return ValueError(f"cannot quantize NaN to {fmt(spec).name}, which holds no NaN; replace it first "
                      "(e.g. numpy.nan_to_num)")


def cast(v, spec, saturate: bool = True) -> np.ndarray:
    """Float values ``v`` rounded to the nearest value of the format, ties to even;
    ``saturate`` sends what lies beyond the largest value (inf too) to +-max, else
    to inf or NaN as the format has them (float6, float4 and mxint8 always saturate)."""
    f = fmt(spec)
    if saturate or not (f.has_inf or f.has_nan):
        top = np.asarray(finfo(f).max, v.dtype)
        v = np.clip(v, -top, top)  # NaN stays NaN; beyond the range (inf too): +-max
    if f.name == "mxint8":
        return np.rint(v * np.asarray(1 / MXINT8_UNIT, v.dtype)).astype(np.int8)
    if v.dtype == np.float64:
        v = round_to_odd32(v)
    return v.astype(dtype(f))


def round_to_odd32(v: np.ndarray) -> np.ndarray:
    """float64 ``v`` as float32, rounded to odd: an inexact result is the float32
    next to ``v`` toward zero with its last bit set (beyond float32's range: its
    largest value). Rounding that to a format of at most 21 significand bits and
    within float32's exponent range rounds as if from ``v`` itself, once (Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
    rounding to odd", 2008). ml_dtypes casts float64 through float32 by rounding
    to nearest, twice (0.6.0 for float8, 0.7.0 still for float4:
    0.2500000000002274 -> 0), so qarray never hands it a float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = v.astype(np.float32)
        inexact = (t.astype(np.float64) != v) & ~np.isnan(v)
    if not inexact.any():
        return t
    bits = t.view(np.uint32)
    away = np.abs(t.astype(np.float64)) > np.abs(v)  # rounded (or overflowed) away from zero: one step back
    bits = np.where(inexact, (bits - away.astype(np.uint32)) | np.uint32(1), bits)
    return bits.view(np.float32)


def values(codes, spec, out=np.float32) -> np.ndarray:
    """The values of format codes, exactly, as ``out`` (float32 or float64)."""
    v = np.asarray(codes).astype(out)
    return v * np.asarray(MXINT8_UNIT, out) if fmt(spec).name == "mxint8" else v


def dequantize(q, scale, spec, out=np.float32) -> np.ndarray:
    """``element * scale`` in float32 (float64 when asked): DequantizeLinear."""
    ft = np.dtype(out)
    return values(q, spec, ft) * np.asarray(scale).astype(ft)


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


# -- OCP Microscaling (MX v1.0) ------------------------------------------------
class MXFormat(NamedTuple):
    """An MX format: its element format, the exponent of the element's largest
    power of two (``emax_elem`` in the spec) and its mantissa bits (for "even")."""

    name: str
    element: str
    emax: int
    mbits: int


MX_FORMATS = {m.name: m for m in (
    MXFormat("mxfp8_e4m3", "float8_e4m3fn", 8, 3),
    MXFormat("mxfp8_e5m2", "float8_e5m2", 15, 2),
    MXFormat("mxfp6_e2m3", "float6_e2m3fn", 2, 3),
    MXFormat("mxfp6_e3m2", "float6_e3m2fn", 4, 2),
    MXFormat("mxfp4", "float4_e2m1fn", 2, 1),
    MXFormat("mxint8", "mxint8", 0, 6),
)}
SCALE_ROUNDINGS = ("floor", "ceil", "even", "rceil")
E8M0_NAN = 0xFF  # the E8M0 NaN pattern; 2**e is stored as e + 127 (e in [-127, 127])


def mx_exponents(amax, mx: MXFormat, rounding: str) -> np.ndarray:
    """The shared exponent of each block from its largest magnitude ``amax``
    (float32 or float64): E8M0 bit patterns (uint8), ``E8M0_NAN`` where ``amax``
    is NaN or inf. Every rule is exact on the value of ``amax``:

    - ``floor`` (the spec): ``floor(log2(amax)) - emax``;
    - ``ceil``: ``ceil(log2(amax)) - emax``;
    - ``even``: ``floor(log2(amax rounded half up to mbits mantissa bits)) - emax``;
    - ``rceil`` (NVIDIA, cuBLAS): ``ceil(log2(amax / max))``, the division in
      ``amax``'s precision (for float32 it is NVIDIA's; no MX format's largest
      value lets the rounded and the exact quotient straddle a power of two).

    clamped to [-127, 127]; an all-zero block gets -127, the smallest scale.
    """
    a = np.asarray(amax)
    top = finfo(mx.element).max
    with np.errstate(divide="ignore", invalid="ignore"):
        v = a / a.dtype.type(top) if rounding == "rceil" else a
        m, e = np.frexp(v)  # v = m * 2**e, m in [0.5, 1): floor(log2 v) = e - 1
    e = e.astype(np.int64) - 1
    if rounding in ("ceil", "rceil"):
        e = e + (m > 0.5)  # not a power of two: one up
    elif rounding == "even":
        e = e + (m >= 1 - 2.0 ** -(mx.mbits + 2))  # rounds up to the next power of two
    if rounding != "rceil":
        e = e - mx.emax
    e = np.where(v == 0, -127, np.clip(e, -127, 127))
    return np.where(np.isfinite(a), e + 127, E8M0_NAN).astype(np.uint8)


class Codes(NamedTuple):
    """A format's rounding on float32 bits (``backends.cpu.quantize._fcode`` and the CUDA
    kernels): mantissa bits, smallest normal exponent, the largest finite magnitude
    code, the code beyond it, the NaN code (bit 8 set: no sign), the sign bit, and
    the zeros rule (0 signed, 1 exact -0 to +0, 2 unsigned)."""

    m: int
    emin: int
    maxc: int
    ovf: int
    nanc: int
    sign_at: int
    zeros: int


def codes(spec, saturate=True, onnx_zero=True) -> Codes:
    """The :class:`Codes` of a float format; ``onnx_zero``: ONNX's +0 zero point for
    float4/float6 (``quantize``), else (MX, NVFP4) -0 keeps its sign."""
    f = fmt(spec)
    d, i = dtype(f), ml_dtypes().finfo(dtype(f))
    bits = lambda v: int(np.array(v, np.float32).astype(d).view(np.uint8))  # noqa: E731
    fnuz = f.name.endswith("fnuz")
    maxc = bits(i.max)
    nanc = (0x180 if fnuz else bits(np.nan)) if f.has_nan else maxc
    ovf = maxc if saturate or not (f.has_inf or f.has_nan) else 0x180 if fnuz else bits(np.inf)
    zeros = 2 if fnuz else 1 if onnx_zero and not f.has_nan else 0
    return Codes(int(i.nmant), int(i.minexp), maxc, ovf, nanc, f.bits - 1, zeros)
