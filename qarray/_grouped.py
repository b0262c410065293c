"""The grouped block formats: one scale (and an integer zero point or a float bias)
per group of codes along the last axis, the layout of the Hugging Face
checkpoints (GPTQ, AWQ, compressed-tensors, MLX, bitsandbytes 4-bit) as block
formats (qarray._blocks), with their round-to-nearest quantizers.
"""

from __future__ import annotations

import re

import numpy as np

from ._blocks import FAMILIES, FORMATS, BlockFormat, Field, bits_at, register, rounded
from ._formats import ml_dtypes

# What the Hugging Face checkpoints store (GPTQ, AWQ, compressed-tensors, MLX, bitsandbytes, ModelOpt): a
# group of ``G`` codes along the last axis shares a scale, and an integer zero point or a float bias. Their
# files keep the codes and the parameters in separate arrays; a QArray keeps each group as one block: the
# scale, then the bias, the codes (in bit planes: see ``_planes``) and the zero point, padded to a whole
# byte. The name says it all:
# ``{codes}_g{G}_{scale type}[_zp | _bias | _gdiv | _gmul]``:
#
# - codes ``int{b}`` (2..8 bits): value ``code - 2^(b-1)``; ``uint{b}``: value ``code``; ``nf4`` and
#   ``fp4bnb``: bitsandbytes' code tables; ``e4m3``: float8 e4m3 values (compressed-tensors' FP8);
#   ``e2m1``: FP4 (MXFP4, NVFP4: bit 3 the sign);
# - scale type ``f16``, ``bf16`` or ``f32``, which is also the precision the values are computed in; for
#   ``e2m1``, ``e8m0`` (MX: 2^(s - 127)) or ``e4m3`` (NVFP4), values in float32;
# - ``_zp``: an integer zero point of ``b`` bits, ``scale * (value - zp)``; ``_bias``: a float bias of the
#   scale's type, ``scale * value + bias`` (MLX); ``_gdiv`` / ``_gmul``: NVFP4's tensor scale
#   (``QArray.global_scale``), by which each float32 block scale is divided (compressed-tensors'
#   ``weight_global_scale``) or multiplied (ModelOpt's ``weight_scale_2``) before the values; ``_scb``:
#   bitsandbytes' LLM.int8 (``int8_g{K}_f32_scb``), a row's absmax ``SCB`` as the scale, the product then
#   multiplied by float32(1 / 127): ``q * SCB * 7.874015718698502e-3``, two roundings.
_GROUPED = re.compile(r"(u?int([2-8])|nf4|fp4bnb|e4m3|e2m1)_g(\d+)_(f16|bf16|f32|e8m0|e4m3)(_zp|_bias|_gdiv|_gmul|_scb)?")
_SCALE = {"f16": (np.float16, "float16"), "bf16": ("bfloat16", "bfloat16"), "f32": (np.float32, "float32")}
E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6)
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def _fp4bnb():
    """bitsandbytes' FP4 table (``get_4bit_type("fp4")``): its values over their largest, in float32."""
    v = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3], np.float32)  # (its -0 is 0)
    return v / np.float32(12)


def _e4m3():
    """float8 e4m3fn's 256 values (0x7F and 0xFF are NaN)."""
    x = np.arange(256)
    e, m = (x >> 3) & 0xF, x & 7
    v = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7.0)) * np.where(x & 0x80, -1.0, 1.0)
    return np.where((x & 0x7F) == 0x7F, np.nan, v).astype(np.float32)


def _planes(at, bits, group):
    """``place`` of ``group`` codes of ``bits`` bits from byte ``at // 8``, in planes of 4, 2 and 1 bits
    (7 = 4 + 2 + 1, 3 = 2 + 1, 8 one plane of bytes), each ggml's way: a plane of ``w``-bit parts is
    ``group * w / 8`` bytes, part ``i`` in byte ``i % bytes`` at bit ``w * (i // bytes)``. A plane is
    then ``8 / w`` runs of bytes (``Field.segments``): the packer, unpacker and decoder walk a few long
    runs, not a segment a code."""
    widths = [8] if bits == 8 else [w for w in (4, 2, 1) if bits & w]
    starts = np.cumsum([at] + [group * w for w in widths])

    def place(i):
        runs = []
        for w, start in zip(widths, starts):
            n = group * w // 8
            runs.append((int(start) + 8 * (i % n) + w * (i // n), w))
        return runs
    return place


def _e8m0():
    """2^(s - 127) for s = 0..254 (2^-127 a subnormal float32), NaN for 255."""
    s = np.arange(256, dtype=np.float64)
    return np.where(s == 255, np.nan, 2.0 ** (s - 127)).astype(np.float32)


def _fp4(name, group, stype, extra):
    """An FP4 format: a byte of scale (E8M0 or E4M3, by table) and ``group`` e2m1 codes."""
    table = _e8m0() if stype == "e8m0" else _e4m3()
    fields = [Field("d", 1, 8, bits_at(0, 8)), Field("q", group, 4, lambda i: [(8 + 4 * i, 4)])]
    tensor = {"_gdiv": "divide", "_gmul": "multiply"}.get(extra)
    quantize = _mx(table) if stype == "e8m0" else _nv(tensor)
    values = np.array(E2M1, np.float32)
    if extra == "_gmul":
        values[8] = 0  # ModelOpt's table (e2m1_values) has +0 at code 8, where the others have -0
    return register(BlockFormat(name, group, 1 + group // 2, fields, values=values, scale=(None, ("d", table)),
                                tensor_scale=tensor, quantize=quantize))


def grouped(name):
    """The grouped format ``name`` (see above), registered on first use; None if ``name`` is not one."""
    m = _GROUPED.fullmatch(name.lower())
    if m is None:
        return None
    name = m.group(0)
    if name.upper() in FORMATS:
        return FORMATS[name.upper()]
    codes, group, stype, extra = m.group(1), int(m.group(3)), m.group(4), m.group(5)
    bits = int(m.group(2)) if m.group(2) else 8 if codes == "e4m3" else 4
    if codes.startswith("int") and extra == "_zp" or codes in ("nf4", "fp4bnb", "e4m3") and extra \
            or (codes == "e2m1") != (stype in ("e8m0", "e4m3")) or extra in ("_gdiv", "_gmul") and stype != "e4m3" \
            or codes == "e2m1" and extra in ("_zp", "_bias") or extra == "_scb" and (codes, stype) != ("int8", "f32"):
        return None  # (an offset-binary code's zero point is uint's; the tables take a scale alone)
    if group < 1 or group % 8:
        return None
    if codes == "e2m1":
        return _fp4(name, group, stype, extra)
    c = np.arange(1 << bits)
    values = {"nf4": NF4, "fp4bnb": _fp4bnb(), "e4m3": _e4m3()}.get(codes, c - (1 << bits - 1) if codes[0] == "i" else c)
    view, precision = _SCALE[stype]
    sbits = 32 if stype == "f32" else 16
    fields = [Field("d", 1, sbits, bits_at(0, sbits), view)]
    at = sbits
    if extra == "_bias":
        fields.append(Field("m", 1, sbits, lambda i: [(sbits, sbits)], view))
        at += sbits
    fields.append(Field("q", group, bits, _planes(at, bits, group)))
    at += group * bits
    if extra == "_zp":
        fields.append(Field("z", 1, bits, bits_at(at // 8, bits) if at % 8 == 0 else lambda i, at=at: [(at, bits)]))
        at += bits
    quantize = (_table(values) if codes in ("nf4", "fp4bnb") else _float8(stype) if codes == "e4m3" else
                _llm_int8 if extra == "_scb" else
                _affine(bits, stype) if extra == "_bias" else _zero_point(bits, stype) if extra == "_zp" else
                _symmetric(bits, stype) if codes[0] == "i" else None)
    return register(BlockFormat(name, group, (at + 7) // 8, fields, values=values,
                                offset=(("m", None), 1) if extra == "_bias" else None,
                                zero="z" if extra == "_zp" else None, precision=precision, quantize=quantize,
                                factor=7.874015718698502e-3 if extra == "_scb" else None))


# -- round to nearest, in float32, parameters rounded to the scale type before the codes are chosen -----

def _stored(v, stype):
    """float32 ``v`` as a scale field of type ``stype`` holds it (float16; bfloat16 as float32)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16) if stype == "f16" else rounded(v.astype(np.float32), _SCALE[stype][1])


def _divide(x, s):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s == 0, np.float32(0), x / s.astype(np.float32)).astype(np.float32)


def _symmetric(bits, stype):
    """compressed-tensors' symmetric integers: ``scale = amax / ((2^b - 1) / 2)``, ``q = rint(x / scale)``
    clamped to the signed range, stored plus ``2^(b-1)``."""
    half = 1 << (bits - 1)

    def quantize(x):
        amax = np.abs(x).max(axis=-1, keepdims=True)
        s = _stored(amax / np.float32((2 * half - 1) / 2), stype)
        q = np.clip(np.rint(_divide(x, s)), -half, half - 1) + half
        return {"d": s, "q": q.astype(np.uint8)}
    return quantize


def _zero_point(bits, stype):
    """GPTQ's round to nearest (``Quantizer.find_params``): the range widened to hold 0 ([-1, 1] where
    it is all 0), ``scale = (max - min) / (2^b - 1)``, ``zero = rint(-min / scale)``, ``q = rint(x /
    scale) + zero`` clamped to ``[0, 2^b - 1]``."""
    top = (1 << bits) - 1

    def quantize(x):
        lo, hi = np.minimum(x.min(axis=-1, keepdims=True), 0), np.maximum(x.max(axis=-1, keepdims=True), 0)
        both = (lo == 0) & (hi == 0)
        lo, hi = np.where(both, np.float32(-1), lo), np.where(both, np.float32(1), hi)
        s = _stored((hi - lo) / np.float32(top), stype)
        z = np.clip(np.rint(_divide(-lo, s)), 0, top)
        q = np.clip(np.rint(_divide(x, s)) + z, 0, top)
        return {"d": s, "z": z.astype(np.uint8), "q": q.astype(np.uint8)}
    return quantize


def _affine(bits, stype):
    """MLX's affine quantizer (``mx.quantize``, float32): the edge of larger magnitude is the reference,
    ``scale = edge / rint(edge / s0)`` with ``s0 = max((max - min) / (2^b - 1), 1e-7)`` (negative where
    the edge is the maximum), ``bias = edge`` (0 where the edge rounds to code 0), ``q = rint((x - bias)
    / scale)`` clamped; scale and bias stored rounded to the scale type after the codes are chosen."""
    bins = np.float32((1 << bits) - 1)

    def quantize(x):
        lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
        s0 = np.maximum((hi - lo) / bins, np.float32(1e-7))
        low = np.abs(lo) > np.abs(hi)
        scale, edge = np.where(low, s0, -s0), np.where(low, lo, hi)
        q0 = np.rint(edge / scale)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(q0 != 0, edge / q0, scale).astype(np.float32)
        bias = np.where(q0 != 0, edge, np.float32(0)).astype(np.float32)
        q = np.clip(np.rint((x - bias) / scale), 0, bins)
        return {"d": _stored(scale, stype), "m": _stored(bias, stype), "q": q.astype(np.uint8)}
    return quantize


def _llm_int8(x):
    """bitsandbytes' LLM.int8 (``int8_vectorwise_quant``): ``SCB = max |row|``, ``q = rint(x * (127 /
    SCB))`` (a row of zeros: codes 0), stored plus 128."""
    scb = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x * (np.float32(127) / scb))
    return {"d": scb, "q": (np.nan_to_num(q, nan=0) + 128).astype(np.uint8)}


def _table(values):
    """bitsandbytes' 4-bit quantizer (its CPU ``quantize_4bit``): ``absmax`` per block, ``x * (1 /
    absmax)`` clamped to [-1, 1], the code of the nearest table value by its midpoints (a tie goes up)."""
    values = np.asarray(values, np.float32)
    order = np.argsort(values, kind="stable")
    mid = (values[order[:-1]] + values[order[1:]]) / np.float32(2)

    def quantize(x):
        amax = np.abs(x).max(axis=-1, keepdims=True)
        scaled = np.clip(x * (np.float32(1) / np.maximum(amax, np.float32(1e-38))), -1, 1)
        return {"d": amax.astype(np.float32), "q": order[np.searchsorted(mid, scaled, side="left")].astype(np.uint8)}
    return quantize


def _float8(stype):
    """compressed-tensors' FP8: ``scale = amax / 448``, ``x / scale`` clamped to +-448 and rounded to
    float8 e4m3 (nearest, ties to even)."""
    def quantize(x):
        s = _stored(np.abs(x).max(axis=-1, keepdims=True) / np.float32(448), stype)
        q = np.clip(_divide(x, s), -448, 448).astype(ml_dtypes().float8_e4m3fn)
        return {"d": s, "q": q.view(np.uint8)}
    return quantize


FAMILIES.append(grouped)


# -- FP4 ----------------------------------------------------------------------------------------------

def _nearest_first(v):
    """MLX's FP4 element: the first of E2M1's 16 values nearest ``v`` (ties toward zero, +0 for -0)."""
    return np.abs(v[..., None] - np.array(E2M1, np.float32)).argmin(axis=-1).astype(np.uint8)


def _nearest_even(v):
    """The e2m1 code of ``v`` rounded to nearest, ties to even (compressed-tensors' ``cast_to_fp4``,
    ModelOpt's ``_cast_fp4``: thresholds 0.25 <, 0.75 <=, 1.25 <, 1.75 <=, 2.5 <, 3.5 <=, 5 <), code 8 up
    for ``v < 0`` (a negative value that rounds to 0 is -0; -0.0 itself is 0)."""
    a = np.abs(v)
    m = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5))
    return (m + 8 * (v < 0)).astype(np.uint8)


def _mx(table):
    """MLX's mxfp4 (``mx.quantize(mode="mxfp4")``): the scale 2^ceil(log2(amax / 6)) (E8M0: the
    smallest power of two that puts amax within 6; a group of zeros 1), the elements
    :func:`_nearest_first` of ``x / scale``."""
    def quantize(x):
        m, e = np.frexp((np.abs(x).max(axis=-1, keepdims=True) / np.float32(6)).astype(np.float64))
        e = np.where(m == 0.5, e - 1, e)  # ceil(log2): m in [0.5, 1)
        byte = np.clip(np.where(m == 0, 127, e + 127), 0, 254).astype(np.uint8)  # (zeros: scale 1)
        return {"d": byte, "q": _nearest_first(x / table[byte])}
    return quantize


def _nv(tensor):
    """NVFP4, as each library picks it: E4M3 block scales from each block's ``amax`` and the float32
    elements of ``x`` over the block's scale, rounded to e2m1.

    - no tensor scale (MLX's ``mode="nvfp4"``): the scale ``e4m3(amax / 6)``, the elements
      :func:`_nearest_first`;
    - ``"divide"`` (compressed-tensors): the tensor scale ``g = 448 * 6 / amax`` of the whole tensor,
      block scales ``e4m3(g * (amax / 6))`` clamped to +-448 (0.125 where that is 0), the elements of
      ``x / (scale / g)`` :func:`_nearest_even`;
    - ``"multiply"`` (ModelOpt): ``g = amax / (6 * 448)``, block scales ``e4m3(amax / (6 * g))`` (1 where
      0) clamped to [2^-9, 448], the elements of ``x / (scale * g)`` :func:`_nearest_even`.
    """
    e4m3, f8 = _e4m3(), ml_dtypes().float8_e4m3fn

    def quantize(x, g=None):
        amax = np.abs(x).max(axis=-1, keepdims=True)
        if tensor is None:
            s = np.minimum(amax / np.float32(6), np.float32(448))
        elif tensor == "divide":
            s = np.clip(np.float32(g) * (amax / np.float32(6)), -448, 448)
        else:
            s = amax / (np.float32(6) * np.float32(g))
            s = np.clip(np.where(s == 0, np.float32(1), s), np.float32(2.0**-9), np.float32(448))
        d = s.astype(np.float32).astype(f8).view(np.uint8)
        if tensor == "divide":
            d = np.where(e4m3[d] == 0, np.float32(0.125).astype(f8).view(np.uint8), d)
        eff = e4m3[d] if tensor is None else e4m3[d] / np.float32(g) if tensor == "divide" else e4m3[d] * np.float32(g)
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(eff == 0, np.float32(0), x / eff)
        q = _nearest_first(v) if tensor is None else _nearest_even(v)
        return {"d": d, "q": q}

    if tensor is not None:  # the tensor's scale, from its largest magnitude
        quantize.tensor_scale = (lambda amax: np.float32(448 * 6) / np.float32(amax)) if tensor == "divide" else \
            (lambda amax: np.float32(amax) / np.float32(448 * 6))
    return quantize
