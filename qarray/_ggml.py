"""ggml's block types (llama.cpp's GGUF files) as block formats (qarray._blocks).

Each type is its block's layout, read off ``ggml-common.h``'s ``block_*``
structs and ``ggml-quants.c``'s ``dequantize_row_*``, and its quantizer:
gguf-py's NumPy quantizers for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0 and
MXFP4 (ported here, the same bytes), ggml's own ``ggml_quantize_chunk`` for the
K-quants and IQ4_NL/IQ4_XS (``qarray._kquants``). The IQ1/IQ2/IQ3 lattice types
are read only: their codes index vectors of a codebook (``_iq_grids.npz``:
``iq2xxs_grid`` and the others of ``ggml-common.h``), decoded by the functions
beside their layouts.

Element ``e`` of a block is the ``e``-th value along the tensor's last axis
(ggml's ``ne[0]``); the ``place`` functions say where its bits are.
"""

from __future__ import annotations

import os

import numpy as np

from . import _kquants
from ._blocks import BlockFormat, Field, bits_at, register

QK_K = 256
F16 = np.float16
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 values, doubled


def _d(name="d", at=0, view=F16):
    return Field(name, 1, 8 * np.dtype(view).itemsize, bits_at(at, 8 * np.dtype(view).itemsize), view)


def _split4(at, half=16):
    """4-bit codes, ``half`` a run: byte ``at + i % half`` holds ``i`` low and ``i + half`` high."""
    return lambda i: [(8 * (at + i // (2 * half) * half + i % half) + 4 * (i % (2 * half) // half), 4)]


def _lanes(at, bits, lane=32):
    """2-bit (or 4-bit) codes in lanes of ``lane`` bytes: ggml's K-quant ``qs``. Element ``e`` sits in
    byte ``at + lane * (e // (lane * 8 // bits)) + e % lane``, at bit ``bits * (e // lane % (8 // bits))``."""
    per = 8 // bits
    return lambda e: [(8 * (at + lane * (e // (lane * per)) + e % lane) + bits * (e // lane % per), bits)]


def _signed(bits):
    """The value of each stored code when the code is a two's-complement integer of ``bits`` bits."""
    c = np.arange(1 << bits)
    return np.where(c >= 1 << (bits - 1), c - (1 << bits), c)


def _e8m0_half():
    """ggml_e8m0_to_fp32_half: 2^(x - 128) as float32 (x < 2: the subnormals 2^-128, 2^-127)."""
    x = np.arange(256, dtype=np.uint32)
    return np.where(x < 2, np.uint32(0x00200000) << x, (x - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


def _ue4m3_half():
    """ggml_ue4m3_to_fp32 times 0.5 (the kvalues' doubling), as gguf-py decodes it."""
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    v = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7)) * 0.5
    return np.where((x == 0) | (x == 0x7F), 0.0, v).astype(np.float32)


def _roundf(v):
    """C's roundf: half away from zero (gguf-py's np_roundf)."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def _inverse(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _amax_signed(x):
    """ggml's ``max``: the value of largest magnitude, the first one on ties."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)


# -- the legacy 32-element types (quantize_row_*_ref, as gguf-py computes them) ------------------


def _q_sym(x, nmax):
    """Q4_0 / Q5_0: d = max / -nmax, q = min(2 nmax - 1, trunc(x / d + nmax + 0.5))."""
    d = (_amax_signed(x) / np.float32(-nmax)).astype(np.float32)
    q = np.trunc(x * _inverse(d) + np.float32(nmax + 0.5)).astype(np.float32)
    return {"d": d.astype(F16), "q": np.clip(q, 0, 2 * nmax - 1).astype(np.uint8)}


def _q_affine(x, nmax):
    """Q4_1 / Q5_1: d = (max - min) / nmax, m = min, q = trunc((x - min) / d + 0.5)."""
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = ((hi - lo) / np.float32(nmax)).astype(np.float32)
    q = np.trunc((x - lo) * _inverse(d) + np.float32(0.5)).astype(np.float32)
    return {"d": d.astype(F16), "m": lo.astype(F16), "q": np.clip(q, 0, nmax).astype(np.uint8)}


def _q8_0(x):
    d = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _roundf(x * _inverse(d)).astype(np.int8)
    return {"d": d.astype(F16), "q": q.view(np.uint8)}


def _q8_k(x):
    """ggml's ``quantize_row_q8_K_ref`` (the activations of its K-quant dot products): ``iscale = -127 /
    max`` (``max`` the value of largest magnitude, the first on ties), codes ``min(127, nearest_int(iscale
    * x))`` stored in an int8, ``d = 1 / iscale``, ``bsums`` the codes' sums over 16; an all-zero block
    is zeros (ggml leaves its bsums unwritten). ``nearest_int`` is ggml's: the float32 product plus
    ``1.5 * 2^23``, whose low 23 bits less ``2^22`` are the product to nearest even; a block of float32
    subnormals, whose ``iscale`` overflows to -inf, gets its codes from the bits of inf and NaN as ggml
    does (0)."""
    mx = _amax_signed(x)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127) / mx).astype(np.float32)
        bits = ((x * iscale).astype(np.float32) + np.float32(12582912)).view(np.int32)
        d = np.where(mx == 0, np.float32(0), _inverse(iscale)).astype(np.float32)
    q = (np.minimum((bits & 0x7FFFFF) - 0x400000, 127) & 0xFF).astype(np.uint8)
    return {"d": d, "q": q, "bsums": q.view(np.int8).reshape(len(q), -1, 16).sum(axis=2, dtype=np.int16)}


def _trits(x):
    """TQ1_0 / TQ2_0: d = max|x|, t = roundf(x / d) + 1 in {0, 1, 2}."""
    d = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32)
    return d.astype(F16), (_roundf(x * _inverse(d)).astype(np.int8) + 1).astype(np.uint8)


def _tq2_0(x):
    d, t = _trits(x)
    return {"d": d, "q": t}


# TQ1_0 keeps five trits a byte (four in qh), ``byte = ceil(v * 256 / 243)`` of their base-3 number
# ``v``: qs[0:32] byte m holds elements m + 32 n, qs[32:48] byte m holds 160 + m + 16 n, qh[j] holds
# 240 + j + 4 n. Trit n reads back as ((byte * 3^n) mod 256) * 3 >> 8.
_TQ1_GROUPS = (("qs", 0, 32, 5, 0), ("qs", 32, 16, 5, 160), ("qh", 0, 4, 4, 240))


def _tq1_0(x):
    d, t = _trits(x)
    out = {"d": d}
    for name, at, width, n, first in _TQ1_GROUPS:
        part = t[:, first:first + width * n].reshape(len(t), n, width).astype(np.uint16)
        v = sum(part[:, k] * 3 ** (n - 1 - k) for k in range(n)) * 3 ** (5 - n)
        out.setdefault(name, np.zeros((len(t), 48 if name == "qs" else 4), np.uint8))[:, at:at + width] = \
            (v * 256 + 242) // 243
    return out


def _tq1_0_elements(f):
    parts = []
    for name, at, width, n, _ in _TQ1_GROUPS:
        b = f[name][:, at:at + width].astype(np.uint16)
        parts.append(np.concatenate([(((b * 3 ** k) & 0xFF) * 3) >> 8 for k in range(n)], axis=1))
    return np.concatenate(parts, axis=1).astype(np.float32) - 1


def _mxfp4(x):
    """quantize_row_mxfp4_ref as gguf-py computes it: e = floor(log2(max|x|)) - 2 + 127, then the
    nearest of the 16 values (the first on ties)."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    d = _E8M0_HALF[e]
    err = np.abs(d[:, :, None] * np.asarray(KVALUES_MXFP4, np.float32) - x[:, :, None])
    return {"e": e, "q": err.argmin(axis=-1).astype(np.uint8)}


_E8M0_HALF = _e8m0_half()


# -- the IQ lattice types (read only): dequantize_row_iq* as gguf-py computes them ------------------

_GRIDS = {}


def grid(name):
    """An IQ codebook (``_iq_grids.npz``, the tables of ggml-common.h), loaded on first use."""
    if not _GRIDS:
        with np.load(os.path.join(os.path.dirname(__file__), "_iq_grids.npz")) as z:
            _GRIDS.update({k: z[k] for k in z.files})
    return _GRIDS[name]


def _bits(v, n, step=1):
    """The ``n`` fields of ``step`` bits of each value of ``v``, lowest first, on a new last axis."""
    return (v[..., None] >> (np.arange(n, dtype=v.dtype) * step).astype(v.dtype)) & ((1 << step) - 1)


def _sign(bits):
    return np.where(bits == 0, np.float32(1), np.float32(-1))


def _ksigns(idx):
    """The eight signs of each 7-bit sign index (ksigns_iq2xs)."""
    return _sign(_bits(grid("ksigns")[idx], 8))


def _vectors(name, idx, signs, n):
    g = grid(name)[idx].astype(np.float32)
    return (g * signs).reshape(len(idx), n)


def _iq2_xxs(f):
    w = f["qs"].reshape(len(f["qs"]), -1, 2)  # per 32 elements: 4 grid bytes, then 4 x 7 sign bits + scale
    return _vectors("iq2xxs", w[..., 0].copy().view(np.uint8).reshape(len(w), 8, 4), _ksigns(_bits(w[..., 1], 4, 7)),
                    QK_K)


def _iq2_xxs_scale(f):
    w = f["qs"].reshape(len(f["qs"]), -1, 2)
    return f["d"].astype(np.float32) * ((np.float32(0.5) + (w[..., 1] >> 28).astype(np.float32)) * np.float32(0.25))


def _iq2_xs(f):
    q = f["qs"]
    return _vectors("iq2xs", q & 511, _ksigns(q >> 9), QK_K)


def _half_scales(f, name="scales"):
    return _bits(f[name], 2, 4).reshape(len(f[name]), -1).astype(np.float32)


def _iq2_scale(f):
    return f["d"].astype(np.float32) * ((np.float32(0.5) + _half_scales(f)) * np.float32(0.25))


def _iq2_s(f):
    idx = f["qs"].astype(np.uint16) | (_bits(f["qh"], 4, 2).reshape(len(f["qh"]), -1).astype(np.uint16) << 8)
    return _vectors("iq2s", idx, _sign(_bits(f["signs"], 8)).reshape(len(idx), -1, 8), QK_K)


def _iq3_xxs(f):
    return _vectors("iq3xxs", f["qs"], _ksigns(_bits(f["scales"], 4, 7)).reshape(len(f["qs"]), -1, 4), QK_K)


def _iq3_xxs_scale(f):
    return f["d"].astype(np.float32) * ((np.float32(0.5) + (f["scales"] >> 28).astype(np.float32)) * np.float32(0.5))


def _iq3_s(f):
    idx = f["qs"].astype(np.uint16) | (_bits(f["qh"], 8).reshape(len(f["qh"]), -1).astype(np.uint16) << 8)
    return _vectors("iq3s", idx, _sign(_bits(f["signs"], 8)).reshape(len(idx), -1, 4), QK_K)


def _iq3_s_scale(f):
    return f["d"].astype(np.float32) * (1 + 2 * _half_scales(f))


def _iq1(f, qh_idx, delta_sign):
    """IQ1_S / IQ1_M: grid values in {-1, 0, 1} plus a delta of +-1/8."""
    idx = f["qs"].astype(np.uint16) | (qh_idx.astype(np.uint16) << 8)
    delta = np.where(delta_sign == 0, np.float32(0.125), np.float32(-0.125))
    g = grid("iq1s")[idx].astype(np.float32)  # (n, 32 groups of 8)
    return (g + delta.reshape(len(idx), -1, 1)).reshape(len(idx), QK_K)


def _iq1_s(f):
    qh = f["qh"]
    return _iq1(f, _bits(qh, 4, 3).reshape(len(qh), -1), np.repeat(qh & 0x8000, 4, axis=1))


def _iq1_s_scale(f):
    return f["d"].astype(np.float32) * (2 * ((f["qh"] >> 12) & 7) + 1).astype(np.float32)


def _iq1_m(f):
    qh = _bits(f["qh"], 2, 4).reshape(len(f["qh"]), -1)
    return _iq1(f, qh & 7, qh & 8)


def _iq1_m_scale(f):
    s = f["scales"].reshape(len(f["scales"]), 4)
    d = ((s >> 12) << np.array([0, 4, 8, 12], np.uint16)).astype(np.uint16)
    d = (d[:, 0] | d[:, 1] | d[:, 2] | d[:, 3]).view(F16).astype(np.float32)
    return d[:, None] * (2 * _bits(s, 4, 3).reshape(len(s), -1) + 1).astype(np.float32)


# -- the table -----------------------------------------------------------------------------------

def _type(name, ggml, block, nbytes, fields, **kw):
    return register(BlockFormat(name, block, nbytes, fields, ggml=ggml, **kw))


_INT = np.arange(256)
_type("Q4_0", 2, 32, 18, [_d(), Field("q", 32, 4, _split4(2))], values=_INT[:16] - 8, quantize=lambda x: _q_sym(x, 8))
_type("Q4_1", 3, 32, 20, [_d(), _d("m", 2), Field("q", 32, 4, _split4(4))], values=_INT[:16],
      offset=(("m", None), 1), quantize=lambda x: _q_affine(x, 15))
_type("Q5_0", 6, 32, 22, [_d(), Field("q", 32, 5, lambda i: _split4(6)(i) + [(16 + i, 1)])], values=_INT[:32] - 16,
      quantize=lambda x: _q_sym(x, 16))
_type("Q5_1", 7, 32, 24, [_d(), _d("m", 2), Field("q", 32, 5, lambda i: _split4(8)(i) + [(32 + i, 1)])],
      values=_INT[:32], offset=(("m", None), 1), quantize=lambda x: _q_affine(x, 31))
_type("Q8_0", 8, 32, 34, [_d(), Field("q", 32, 8, bits_at(2, 8))], values=_signed(8), quantize=_q8_0)

_type("Q8_K", 15, QK_K, 292, [_d("d", 0, np.float32), Field("q", QK_K, 8, bits_at(4, 8)),
                             Field("bsums", 16, 16, bits_at(260, 16), np.int16)], values=_signed(8), quantize=_q8_k)

_6BIT = _INT[:64]
_type("Q2_K", 10, QK_K, 84,
      [Field("scales", 16, 4, lambda j: [(8 * j, 4)]), Field("mins", 16, 4, lambda j: [(8 * j + 4, 4)]),
       Field("q", QK_K, 2, _lanes(16, 2)), _d("d", 80), _d("dmin", 82)],
      sub=16, values=_INT[:4], scale=("d", ("scales", _INT[:16])), offset=(("dmin", ("mins", _INT[:16])), -1),
      quantize=_kquants.quantize_q2_k)
_type("Q3_K", 11, QK_K, 110,
      [Field("q", QK_K, 3, lambda e: _lanes(32, 2)(e) + [(8 * (e % 32) + e // 32, 1)]),
       Field("scales", 16, 6, lambda j: [(8 * (96 + j % 8) + 4 * (j // 8), 4), (8 * (104 + j % 4) + 2 * (j // 4), 2)]),
       _d("d", 108)],
      sub=16, values=_INT[:8] - 4, scale=("d", ("scales", _6BIT - 32)), quantize=_kquants.quantize_q3_k)


def _k_scales(at):
    """Q4_K / Q5_K's 6-bit scales and mins, eight of each in 12 bytes (get_scale_min_k4)."""
    b = 8 * at
    scale = lambda j: [(b + 8 * j, 6)] if j < 4 else [(b + 8 * (j + 4), 4), (b + 8 * (j - 4) + 6, 2)]
    mins = lambda j: [(b + 8 * (j + 4), 6)] if j < 4 else [(b + 8 * (j + 4) + 4, 4), (b + 8 * j + 6, 2)]
    return [Field("scales", 8, 6, scale), Field("mins", 8, 6, mins)]


_K = dict(sub=32, scale=("d", ("scales", _6BIT)), offset=(("dmin", ("mins", _6BIT)), -1))
_type("Q4_K", 12, QK_K, 144, [_d(), _d("dmin", 2), *_k_scales(4), Field("q", QK_K, 4, _lanes(16, 4))],
      values=_INT[:16], quantize=_kquants.quantize_q4_k, **_K)
_type("Q5_K", 13, QK_K, 176,
      [_d(), _d("dmin", 2), *_k_scales(4), Field("q", QK_K, 5, lambda e: _lanes(48, 4)(e) + [(128 + 8 * (e % 32) + e // 32, 1)])],
      values=_INT[:32], quantize=_kquants.quantize_q5_k, **_K)
_type("Q6_K", 14, QK_K, 210,
      [Field("q", QK_K, 6, lambda e: [(8 * (64 * (e // 128) + e % 64) + 4 * (e % 128 // 64), 4),
                                       (8 * (128 + 32 * (e // 128) + e % 32) + 2 * (e % 128 // 32), 2)]),
       Field("scales", 16, 8, bits_at(192, 8)), _d("d", 208)],
      sub=16, values=_6BIT - 32, scale=("d", ("scales", _signed(8))), quantize=_kquants.quantize_q6_k)

_type("IQ4_NL", 20, 32, 18, [_d(), Field("q", 32, 4, _split4(2))], values=KVALUES_IQ4NL,
      quantize=_kquants.quantize_iq4_nl)
_type("IQ4_XS", 23, QK_K, 136,
      [_d(), Field("scales", 8, 6, lambda j: [(8 * (4 + j // 2) + 4 * (j % 2), 4), (16 + 2 * j, 2)]),
       Field("q", QK_K, 4, lambda e: [(8 * (8 + 16 * (e // 32) + e % 16) + 4 * (e % 32 // 16), 4)])],
      sub=32, values=KVALUES_IQ4NL, scale=("d", ("scales", _6BIT - 32)), quantize=_kquants.quantize_iq4_xs)

_type("TQ1_0", 34, QK_K, 54, [Field("qs", 48, 8, bits_at(0, 8)), Field("qh", 4, 8, bits_at(48, 8)), _d("d", 52)],
      bits=2, elements=_tq1_0_elements, quantize=_tq1_0)
_type("TQ2_0", 35, QK_K, 66, [Field("q", QK_K, 2, _lanes(0, 2)), _d("d", 64)], values=_INT[:4] - 1, quantize=_tq2_0)
_type("MXFP4", 39, 32, 17, [Field("e", 1, 8, bits_at(0, 8)), Field("q", 32, 4, _split4(1))], values=KVALUES_MXFP4,
      scale=(None, ("e", _E8M0_HALF)), quantize=_mxfp4)
_type("NVFP4", 40, 64, 36, [Field("d", 4, 8, bits_at(0, 8)),
                            Field("q", 64, 4, lambda e: [(8 * (4 + 8 * (e // 16) + e % 8) + 4 * (e % 16 // 8), 4)])],
      sub=16, values=KVALUES_MXFP4, scale=(None, ("d", _ue4m3_half())))

_type("IQ2_XXS", 16, QK_K, 66, [_d(), Field("qs", 16, 32, bits_at(2, 32))], bits=2, sub=32,
      elements=_iq2_xxs, scale=_iq2_xxs_scale)
_type("IQ2_XS", 17, QK_K, 74, [_d(), Field("qs", 32, 16, bits_at(2, 16)), Field("scales", 8, 8, bits_at(66, 8))],
      bits=2, sub=16, elements=_iq2_xs, scale=_iq2_scale)
_type("IQ3_XXS", 18, QK_K, 98, [_d(), Field("qs", 64, 8, bits_at(2, 8)), Field("scales", 8, 32, bits_at(66, 32))],
      bits=3, sub=32, elements=_iq3_xxs, scale=_iq3_xxs_scale)
_type("IQ1_S", 19, QK_K, 50, [_d(), Field("qs", 32, 8, bits_at(2, 8)), Field("qh", 8, 16, bits_at(34, 16))],
      bits=1, sub=32, elements=_iq1_s, scale=_iq1_s_scale)
_type("IQ3_S", 21, QK_K, 110, [_d(), Field("qs", 64, 8, bits_at(2, 8)), Field("qh", 8, 8, bits_at(66, 8)),
                               Field("signs", 32, 8, bits_at(74, 8)), Field("scales", 4, 8, bits_at(106, 8))],
      bits=3, sub=32, elements=_iq3_s, scale=_iq3_s_scale)
_type("IQ2_S", 22, QK_K, 82, [_d(), Field("qs", 32, 8, bits_at(2, 8)), Field("signs", 32, 8, bits_at(34, 8)),
                              Field("qh", 8, 8, bits_at(66, 8)), Field("scales", 8, 8, bits_at(74, 8))],
      bits=2, sub=16, elements=_iq2_s, scale=_iq2_scale)
_type("IQ1_M", 29, QK_K, 56, [Field("qs", 32, 8, bits_at(0, 8)), Field("qh", 16, 8, bits_at(32, 8)),
                              Field("scales", 4, 16, bits_at(48, 16))],
      bits=1, sub=16, elements=_iq1_m, scale=_iq1_m_scale)
