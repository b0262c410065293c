"""GPTQ and AWQ checkpoints (``quant_method`` ``"gptq"`` / ``"awq"``): each linear ``P`` as
``P.qweight``, ``P.qzeros``, ``P.scales`` (and GPTQ's ``P.g_idx``), read into QArrays of
the grouped formats and written back (GPTQ).

GPTQ packs the codes along the input axis (``qweight`` ``[K * bits / 32, N]``, densely:
3-bit codes cross words) and the zero points along the output axis (``qzeros``
``[G, N * bits / 32]``); its ``checkpoint_format`` ``"gptq"`` (v1, and a config
without one) stores ``zero - 1``, read back as GPTQModel reads it: 1 added to
each 32-bit word's fields at once (``+ 0x11111111`` for 4 bits: a carry crosses
fields, undoing the borrow its writer left where a zero point is 0), field by
field for 3 bits; ``"gptq_v2"`` stores the zero itself. AWQ's GEMM packs eight 4-bit
codes a word along the output axis in the order 0, 2, 4, 6, 1, 3, 5, 7
(``qweight`` ``[K, N / 8]``), its GEMV along the input axis in order
(``qweight`` ``[N, K / 8]``, zeros ``[N, ZW]`` and scales ``[N, 8 ZW]`` padded).
Both dequantize as ``scale * (q - zero)``, in the scales' float16: the grouped
formats ``uint{bits}_g{G}_f16_zp`` (``int{bits}_g{G}_f16`` where every zero is
``2^(bits-1)``, GPTQ's symmetric case, which is GGUF's Q4_0 for 4 bits and
group 32).
"""

from __future__ import annotations

import numpy as np

from .hf import Grouped, Layer, act_order, from_qarray, g_idx_of, pack_words, scale_type, to_qarray, \
    unpack_words, words_for

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def _grouped(codes, scale, zero, bits, sym, columns=None, name="weight"):
    """The QArray of GPTQ's or AWQ's codes (N, K), scales and zeros (N, G): the symmetric format where
    every zero of the weight is the middle code (``sym``)."""
    if sym:
        return to_qarray(f"int{bits}", Grouped(codes, scale, columns=columns), scale_type(scale.dtype), name)
    return to_qarray(f"uint{bits}", Grouped(codes, scale, zero, columns=columns), scale_type(scale.dtype), name)


def _check_bits(bits, allowed, what):
    if bits not in allowed:
        raise ValueError(f"{what}: bits {bits} is not one of {sorted(allowed)}")


def read(tensors, qc: dict) -> dict:
    """``{name: hf.Layer}`` of the GPTQ linears among ``tensors`` (``hf.Tensors``), under config ``qc``."""
    bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    _check_bits(bits, {2, 3, 4, 8}, "GPTQ")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r}: qarray reads 'gptq' (v1) and 'gptq_v2'")
    maxq = (1 << bits) - 1
    out = {}
    for p in [n[: -len(".qweight")] for n in tensors.names() if n.endswith(".qweight")]:
        (words, n), scales = tensors.shape(f"{p}.qweight"), tensors.shape(f"{p}.scales")
        k = words * 32 // bits
        if words != words_for(k, bits) or len(scales) != 2 or scales[1] != n:
            raise ValueError(f"{p}: qweight {[words, n]} and scales {list(scales)} do not hold {bits}-bit codes of "
                             f"one weight (bits {bits} in the config)")
        g = k if group == -1 else group
        if scales[0] != -(-k // g):
            raise ValueError(f"{p}: scales has {scales[0]} groups; {k} columns in groups of {g} make {-(-k // g)}")
        qzeros = tensors[f"{p}.qzeros"]  # (small: a word per group and 32 / bits outputs)
        if fmt == "gptq" and 32 % bits == 0:  # v1: GPTQModel adds 1 to every field of a whole word at once
            qzeros = (qzeros.view(np.uint32) + np.uint32(sum(1 << (bits * j) for j in range(32 // bits))))
        zeros = unpack_words(qzeros, bits, n).T
        if fmt == "gptq" and 32 % bits:  # (3 bits: field by field)
            zeros = (zeros.astype(np.int32) + 1) & maxq
        columns = None if f"{p}.g_idx" not in tensors else act_order(tensors[f"{p}.g_idx"], g, f"{p}.g_idx")
        sym = bool(np.all(zeros == 1 << (bits - 1)))

        def make(rows, p=p, k=k, zeros=zeros, columns=columns, sym=sym):
            codes = unpack_words(tensors.read(f"{p}.qweight", (slice(None), rows)).T, bits, k)
            scale = tensors.read(f"{p}.scales", (slice(None), rows)).T
            return _grouped(codes, scale, zeros[rows], bits, sym, columns, p)
        out[f"{p}.weight"] = Layer(n, make)
        tensors.used.update(f"{p}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx"))
    return out


def read_awq(tensors, qc: dict) -> dict:
    """``{name: hf.Layer}`` of the AWQ linears (GEMM or GEMV packing) among ``tensors``."""
    bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    _check_bits(bits, {4}, "AWQ")
    if version not in ("gemm", "gemv"):
        raise ValueError(f"AWQ version {version!r}: qarray reads 'gemm' and 'gemv'")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ with zero_point false: its GEMM and GEMV checkpoints store zero points; this one "
                         "has none to read")
    order = np.argsort(AWQ_ORDER)
    out = {}
    for p in [n[: -len(".qweight")] for n in tensors.names() if n.endswith(".qweight")]:
        (a, b), qzeros = tensors.shape(f"{p}.qweight"), tensors[f"{p}.qzeros"]
        if version == "gemm":  # qweight [K, N/8], nibble i of word c: column 8c + ORDER[i]
            k, n = a, b * 8
            zeros = unpack_words(qzeros, 4, n).reshape(-1, n // 8, 8)[..., order].reshape(-1, n).T
            scales = (n, tensors.shape(f"{p}.scales")[0])
        else:  # GEMV: qweight [N, K/8] in order; zeros and scales padded to whole words of groups
            n, k = a, b * 8
            zeros = unpack_words(qzeros, 4, -(-k // group))
            scales = (tensors.shape(f"{p}.scales")[0], -(-k // group))
        if scales != (n, -(-k // group)) or zeros.shape != scales:
            raise ValueError(f"{p}: scales {list(tensors.shape(f'{p}.scales'))} and qzeros {list(qzeros.shape)} do "
                             f"not fit a {n} x {k} weight in groups of {group} ({version})")
        sym = bool(np.all(zeros == 1 << (bits - 1)))

        def make(rows, p=p, k=k, n=n, zeros=zeros, sym=sym):
            if version == "gemm":
                words = tensors.read(f"{p}.qweight", (slice(None), slice(rows.start // 8, rows.stop // 8)))
                codes = unpack_words(words, 4, 8 * words.shape[1]).reshape(k, -1, 8)[..., order].reshape(k, -1).T
                scale = tensors.read(f"{p}.scales", (slice(None), rows)).T
            else:
                codes = unpack_words(tensors.read(f"{p}.qweight", rows), 4, k)
                scale = tensors.read(f"{p}.scales", rows)[:, : -(-k // group)]
            return _grouped(codes, scale, zeros[rows], bits, sym, None, p)
        out[f"{p}.weight"] = Layer(n, make, 8 if version == "gemm" else 1)
        tensors.used.update(f"{p}.{s}" for s in ("qweight", "qzeros", "scales"))
    return out


def write(weights: dict) -> tuple:
    """GPTQ's tensors and ``quantization_config`` for ``{name: QArray}`` (``P.weight`` -> ``P.qweight``
    ...): every QArray of one grouped integer format with float16 scales. ``checkpoint_format`` is
    ``"gptq"`` (v1, stored zero - 1: what transformers and AutoGPTQ read by default) where every zero
    point is at least 1, else ``"gptq_v2"``: v1 has no sound form of a zero point of 0."""
    v1 = all(q.dtype.layout.zero is None or np.all(from_qarray(q, n).zero > 0) for n, q in weights.items())
    checkpoint_format = "gptq" if v1 else "gptq_v2"
    tensors, spec = {}, None
    for name, q in weights.items():
        g = from_qarray(q, name)
        f = q.dtype.layout
        if g.bias is not None or f.values is None or f.name[:1] not in "iu" or g.scale.dtype != np.float16:
            raise ValueError(f"{name}: GPTQ holds integer codes with float16 scales and zero points; {f.name} is not "
                             "one (convert with --requantize, or write compressed-tensors)")
        bits, group = f.bits, f.block
        this = (bits, group)
        if spec not in (None, this):
            raise ValueError(f"{name}: GPTQ keeps one bits and group_size per checkpoint; {name} has {this}, others "
                             f"{spec}")
        spec = this
        zero = g.zero if g.zero is not None else np.full(g.scale.shape, 1 << (bits - 1), np.uint8)
        if checkpoint_format == "gptq":
            zero = zero - 1
        p = name[: -len(".weight")] if name.endswith(".weight") else name
        tensors[f"{p}.qweight"] = np.ascontiguousarray(pack_words(g.codes, bits).T)
        tensors[f"{p}.qzeros"] = pack_words(zero.T.copy(), bits)
        tensors[f"{p}.scales"] = np.ascontiguousarray(g.scale.T)
        tensors[f"{p}.g_idx"] = g_idx_of(q, group)
    if spec is None:
        raise ValueError("save: no quantized weights to write as GPTQ")
    desc_act = any(q.columns is not None for q in weights.values())
    sym = all(q.dtype.layout.zero is None for q in weights.values())
    qc = {"quant_method": "gptq", "bits": spec[0], "group_size": spec[1], "desc_act": desc_act, "sym": sym,
          "checkpoint_format": checkpoint_format, "pack_dtype": "int32"}
    return tensors, qc
