"""compressed-tensors checkpoints (``quant_method`` ``"compressed-tensors"``: vLLM's and
llm-compressor's), read into QArrays of the grouped formats and written back.

A linear ``P`` stores, by format:

- ``pack-quantized``: ``P.weight_packed`` (int32 ``[N, words]``: the signed codes plus
  ``2^(bits-1)``, packed along the input axis), ``P.weight_shape``, ``P.weight_scale``
  and, asymmetric, ``P.weight_zero_point`` (packed the same way along the output axis).
  From compressed-tensors 0.18 the words are a dense bit stream; before, ``32 // bits``
  codes a word. They are the same for 2, 4 and 8 bits; for 3, 5, 6 and 7 bits the word
  count tells them apart where the input axis is a multiple of 32 (dense: ``K * bits /
  32`` words; per word: more); a row the two would store in as many words, with codes
  that would differ, is ambiguous and raises.
- ``int-quantized`` / ``naive-quantized``: ``P.weight`` int8 (the signed codes).
- ``float-quantized``: ``P.weight`` float8_e4m3fn, scales per tensor, channel or block.

Scales are per tensor ``[1]``, channel ``[N, 1]``, group ``[N, K / group]`` or block
``[N / rows, K / columns]``; the values are ``(q - zero) * scale`` in the scales' dtype
(``(q - zero)`` is exact there), the grouped formats ``int{bits}_g{G}_{type}``,
``uint{bits}_g{G}_{type}_zp`` and ``e4m3_g{G}_{type}``. A scale shared by several rows
(per tensor, per block) is kept in each row's groups.
"""

from __future__ import annotations

import re

import numpy as np

from .. import _formats
from .hf import Grouped, Layer, act_order, from_qarray, g_idx_of, nibbles, pack_words, scale_type, stored, to_qarray, \
    unpack_words, words_for


def _args_for(qc: dict, module: str) -> dict:
    """The ``weights`` quantization args of the config group whose targets match ``module``."""
    found = []
    for group in (qc.get("config_groups") or {}).values():
        for t in group.get("targets", []):
            if t in ("Linear", module) or t.startswith("re:") and re.match(t[3:], module) or module.endswith("." + t):
                found.append(group)
                break
    if not found:
        raise ValueError(f"{module}: no config group of quantization_config targets it")
    if len({repr(g.get("weights")) for g in found}) > 1:
        raise ValueError(f"{module}: config groups {found} all target it, with different weights args")
    return dict(found[0].get("weights") or {}, format=found[0].get("format") or qc.get("format"))


def _per_row(scale, n, k, args, name):
    """Scales ``[N, G]`` from a per-tensor, channel, group or block scale tensor."""
    s = np.asarray(scale)
    if s.size == 1:
        return np.broadcast_to(s.reshape(1, 1), (n, 1))
    if s.ndim == 1:
        s = s.reshape(-1, 1)
    if args.get("strategy") == "block":
        rows, cols = args.get("block_structure") or [128, 128]
        if s.shape != (-(-n // rows), -(-k // cols)) or k % cols:
            raise ValueError(f"{name}: block scales {list(s.shape)} do not fit a {n} x {k} weight in blocks of "
                             f"{rows} x {cols} (qarray needs whole column blocks)")
        return np.repeat(s, rows, axis=0)[:n]
    if s.shape[0] != n or k % s.shape[1]:
        raise ValueError(f"{name}: weight_scale {list(s.shape)} does not fit a {n} x {k} weight")
    return s


def _packing(words, bits, k, name):
    """Whether ``weight_packed`` rows of ``words`` words hold ``k`` codes densely (else per word), told
    apart by the word count."""
    dense, per_word = words_for(k, bits, True), words_for(k, bits, False)
    if words not in (dense, per_word):
        raise ValueError(f"{name}: {words} words a row hold neither the dense nor the per-word packing of "
                         f"{k} {bits}-bit codes ({dense} or {per_word} words): does num_bits match the data?")
    if dense == per_word and 32 % bits and k > 32 // bits:  # as many words both ways, but not the same bits
        raise ValueError(f"{name}: {k} {bits}-bit codes take {dense} words packed densely (compressed-tensors 0.18 "
                         "and later) and per word (before): the file does not say which, so it cannot be read")
    return words == dense


def read(tensors, qc: dict) -> dict:
    """``{name: hf.Layer}`` of the quantized linears among ``tensors`` (``hf.Tensors``): the scales and
    zero points read now, the codes by rows when the layer is made."""
    out = {}
    for p in sorted({n.rsplit(".", 1)[0] for n in tensors.names() if n.endswith(".weight_scale")}):
        args = _args_for(qc, p)
        fmt, bits, kind = args["format"], int(args.get("num_bits", 8)), args.get("type", "int")
        scale, half = tensors[f"{p}.weight_scale"], 1 << (bits - 1)
        zp = tensors[f"{p}.weight_zero_point"] if f"{p}.weight_zero_point" in tensors else None
        tensors.used.update(f"{p}.{x}" for x in ("weight", "weight_packed", "weight_shape", "weight_scale",
                                                  "weight_zero_point", "weight_g_idx", "weight_global_scale"))
        if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):  # e2m1 codes, two a byte (the even low)
            n, k = tensors.shape(f"{p}.weight_packed")[0], tensors.shape(f"{p}.weight_packed")[1] * 2
            mx = fmt == "mxfp4-pack-quantized"
            gs = None if mx else ("_gdiv", tensors[f"{p}.weight_global_scale"].reshape(-1)[0])

            def make(rows, p=p, k=k, scale=scale.view(np.uint8), mx=mx, gs=gs):
                codes = tensors.read(f"{p}.weight_packed", rows)
                codes = nibbles(codes, len(codes), k)
                return to_qarray("e2m1", Grouped(codes, scale[rows]), "e8m0" if mx else "e4m3", p, gs)
            out[f"{p}.weight"] = Layer(n, make)
            continue
        dense = None
        if f"{p}.weight_packed" in tensors:
            if fmt != "pack-quantized" or kind != "int":
                raise ValueError(f"{p}: format {fmt!r} ({kind}) of packed weights: qarray reads pack-quantized "
                                 "integers, nvfp4-pack-quantized and mxfp4-pack-quantized")
            n, k = (int(v) for v in tensors[f"{p}.weight_shape"])
            dense = _packing(tensors.shape(f"{p}.weight_packed")[-1], bits, k, p)
            if zp is not None:  # packed along the output axis, as the codes are (one version wrote both)
                if zp.shape[0] != words_for(n, bits, dense):
                    raise ValueError(f"{p}.weight_zero_point: {zp.shape[0]} words do not hold {n} {bits}-bit zero "
                                     "points packed as the weight is")
                zp = unpack_words(np.ascontiguousarray(zp.T), bits, n, dense).T
        else:
            n, k = tensors.shape(f"{p}.weight")
            dtype = tensors.dtype(f"{p}.weight")
            if kind == "float" and dtype.name != "float8_e4m3fn":
                raise ValueError(f"{p}: float-quantized weights are float8_e4m3fn, got {dtype}")
            if kind != "float" and (dtype != np.int8 or fmt not in ("int-quantized", "naive-quantized")):
                raise ValueError(f"{p}: {fmt} weight of {dtype}: qarray reads int8 codes")
            if zp is not None:
                zp = np.asarray(zp).astype(np.int16) + half
        s = _per_row(scale, n, k, args, p)
        columns = None
        if f"{p}.weight_g_idx" in tensors:
            columns = act_order(tensors[f"{p}.weight_g_idx"], k // s.shape[1], f"{p}.weight_g_idx")
        z = None
        if kind != "float" and zp is not None and np.any(zp.reshape(-1) != half):
            z = np.broadcast_to(np.asarray(zp).reshape(-1, 1) if np.size(zp) == 1 else zp, s.shape)
            if np.any(z < 0) or np.any(z >= 2 * half):
                raise ValueError(f"{p}: zero points out of the {bits}-bit range")
            z = z.astype(np.uint8)
        name = "e4m3" if kind == "float" else f"uint{bits}" if z is not None else f"int{bits}"

        def make(rows, p=p, k=k, s=s, z=z, dense=dense, columns=columns, name=name, bits=bits, half=half):
            if dense is not None:
                codes = unpack_words(tensors.read(f"{p}.weight_packed", rows), bits, k, dense)
            else:
                codes = tensors.read(f"{p}.weight", rows).view(np.int8 if name != "e4m3" else np.uint8)
                if name != "e4m3":
                    if codes.min(initial=0) < -half or codes.max(initial=0) >= half:
                        raise ValueError(f"{p}: codes in [{codes.min()}, {codes.max()}] do not fit num_bits {bits}")
                    codes = (codes.astype(np.int16) + half).astype(np.uint8)
            return to_qarray(name, Grouped(codes, s[rows], None if z is None else z[rows], columns=columns),
                             scale_type(s.dtype), p)
        out[f"{p}.weight"] = Layer(n, make)
    return out


_FP4_WRITTEN = {  # grouped format's tail -> format, weights args (as the presets NVFP4 and MXFP4 dump)
    "g16_e4m3_gdiv": ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                                                   "strategy": "tensor_group", "dynamic": False,
                                                   "scale_dtype": "torch.float8_e4m3fn"}),
    "g32_e8m0": ("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                              "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}),
}


def write(weights: dict) -> tuple:
    """compressed-tensors' tensors and ``quantization_config`` for ``{name: QArray}``: grouped integer
    formats as ``pack-quantized`` (dense packing, compressed-tensors 0.18 and later), ``e4m3`` ones as
    ``float-quantized``, NVFP4 (``e2m1_g16_e4m3_gdiv``) as ``nvfp4-pack-quantized`` and MXFP4
    (``e2m1_g32_e8m0``) as ``mxfp4-pack-quantized``; one config group per distinct quantization."""
    tensors, groups = {}, {}
    for name, q in weights.items():
        g = from_qarray(q, name)
        f = q.dtype.layout
        p = name[: -len(".weight")] if name.endswith(".weight") else name
        n, k = q.shape
        group = "channel" if f.block == k else "group"
        fp4 = _FP4_WRITTEN.get(f.name.split("_", 1)[-1] if f.name.startswith("e2m1") else None)
        if fp4 is not None:  # e2m1 codes two a byte, the even one low
            fmt, args = fp4[0], dict(fp4[1])
            tensors[f"{p}.weight_packed"] = (g.codes[:, 0::2] | g.codes[:, 1::2] << 4).astype(np.uint8)
            tensors[f"{p}.weight_scale"] = g.scale.view(np.uint8) if fmt.startswith("mx") else \
                g.scale.view(_formats.ml_dtypes().float8_e4m3fn)
            if q.global_scale is not None:
                tensors[f"{p}.weight_global_scale"] = np.array([q.global_scale], np.float32)
            groups.setdefault((fmt, repr(args)), (fmt, args, []))[2].append(p)
            continue
        if g.bias is not None or f.name[:1] not in "iue" or f.name.startswith("e2m1"):
            raise ValueError(f"{name}: compressed-tensors holds integer codes (with zero points), float8, NVFP4 "
                             f"(e2m1_g16_e4m3_gdiv) or MXFP4 (e2m1_g32_e8m0); {f.name} is not one (convert with "
                             "--requantize)")
        if f.name.startswith("e4m3"):
            if group != "channel":
                raise ValueError(f"{name}: float-quantized weights have one scale a row (or a tensor, or a block); "
                                 f"{f.name} groups {f.block} of {k} columns")
            args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
            tensors[f"{p}.weight"] = g.codes.view(_formats.ml_dtypes().float8_e4m3fn)
            fmt = "float-quantized"
        else:
            bits = f.bits
            args = {"num_bits": bits, "type": "int", "symmetric": g.zero is None, "strategy": group,
                    "group_size": None if group == "channel" else f.block}
            tensors[f"{p}.weight_packed"] = pack_words(g.codes, bits)
            tensors[f"{p}.weight_shape"] = np.array([n, k], np.int64)
            if g.zero is not None:
                tensors[f"{p}.weight_zero_point"] = np.ascontiguousarray(pack_words(g.zero.T.copy(), bits).T)
            if q.columns is not None:
                tensors[f"{p}.weight_g_idx"] = g_idx_of(q, f.block)
                args["actorder"] = "group"
            fmt = "pack-quantized"
        tensors[f"{p}.weight_scale"] = stored(g.scale, f.precision)
        groups.setdefault((fmt, repr(args)), (fmt, args, []))[2].append(p)
    config_groups = {f"group_{i}": {"targets": [f"re:^{re.escape(p)}$" for p in ps], "weights": dict(args),
                                    "format": fmt, "input_activations": None, "output_activations": None}
                     for i, (fmt, args, ps) in enumerate(groups.values())}
    formats = {fmt for fmt, _, _ in groups.values()}
    qc = {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
          "quantization_status": "compressed", "config_groups": config_groups, "ignore": []}
    return tensors, qc
