"""bitsandbytes checkpoints (``quant_method`` ``"bitsandbytes"``): 4-bit NF4 and FP4,
with and without double quantization, and LLM.int8.

A linear ``P`` stores ``P.weight`` (uint8: the row-major weight's codes two a byte, the
first in the high nibble), ``P.weight.absmax`` (float32 per block of ``blocksize``
codes; uint8 codes of the nested table when double-quantized, with
``P.weight.nested_absmax``, ``P.weight.nested_quant_map`` and the JSON's
``nested_offset``), ``P.weight.quant_map`` (the 16 code values) and
``P.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``: JSON of blocksize, dtype
and shape). bitsandbytes dequantizes ``quant_map[code] * absmax`` in float32 and casts
it to the model's dtype (``q.dequantize(dtype)`` does the same); a double-quantized
absmax is ``nested_quant_map[c] * nested_absmax + nested_offset``, in float32, which
qarray works out once at reading: the QArray holds it as float32 (4 bytes a block
where the file has 1, plus the nested tables), in the grouped format
``nf4_g{blocksize}_f32`` (``fp4bnb_...``). Blocks run over the flattened weight;
qarray needs them within rows (the input axis a multiple of ``blocksize``).

LLM.int8 (``load_in_8bit``) stores ``P.weight`` (int8 ``[N, K]``), ``P.SCB`` (float32,
each row's absmax) and ``P.weight_format`` (0, "row"); bitsandbytes dequantizes
``q * SCB * 7.874015718698502e-3`` in float32, two roundings: the grouped format
``int8_g{K}_f32_scb``.
"""

from __future__ import annotations

import json

import numpy as np

from .. import _grouped
from .hf import Grouped, Layer, to_qarray

_TABLES = {"nf4": np.array(_grouped.NF4, np.float32), "fp4": _grouped._fp4bnb()}


def read(tensors, qc: dict) -> dict:
    """``{name: hf.Layer}`` of the quantized linears among ``tensors`` (``hf.Tensors``)."""
    out = {}
    for p in [n[: -len(".SCB")] for n in tensors.names() if n.endswith(".SCB")]:  # LLM.int8
        (dtype, shape), scb = (tensors.dtype(f"{p}.weight"), tensors.shape(f"{p}.weight")), tensors[f"{p}.SCB"]
        fmt = int(np.asarray(tensors[f"{p}.weight_format"]).reshape(-1)[0]) if f"{p}.weight_format" in tensors else 0
        if fmt != 0:
            raise ValueError(f"{p}.weight_format is {fmt}; bitsandbytes saves (and qarray reads) the row format, 0")
        if dtype != np.int8 or len(shape) != 2 or scb.shape != shape[:1] or scb.dtype != np.float32:
            raise ValueError(f"{p}: LLM.int8 holds an int8 weight [N, K] and float32 SCB [N]; got {dtype} "
                             f"{list(shape)} and {scb.dtype} {list(scb.shape)}")

        def make(rows, p=p, scb=scb):
            codes = (tensors.read(f"{p}.weight", rows).astype(np.int16) + 128).astype(np.uint8)
            return to_qarray("int8", Grouped(codes, scb[rows, None]), "f32", p, ("_scb", None))
        out[f"{p}.weight"] = Layer(shape[0], make)
        tensors.used.update({f"{p}.weight", f"{p}.SCB", f"{p}.weight_format"})
    for key in [n for n in tensors.names() if ".weight.quant_state.bitsandbytes__" in n]:
        p = key.split(".weight.quant_state.")[0]
        try:
            state = json.loads(bytes(tensors[key]).decode("utf-8"))
            kind, block, (n, k) = state["quant_type"], int(state["blocksize"]), state["shape"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{key}: not bitsandbytes' quant state JSON ({e})") from None
        if kind not in _TABLES:
            raise ValueError(f"{key}: quant_type {kind!r} is not nf4 or fp4")
        table = tensors[f"{p}.weight.quant_map"]
        if table.dtype != np.float32 or not np.array_equal(table.view(np.uint32), _TABLES[kind].view(np.uint32)):
            raise ValueError(f"{p}.weight.quant_map is not bitsandbytes' {kind} table")
        if k % block:
            raise ValueError(f"{p}: blocks of {block} straddle rows of {k}: qarray keeps a block within a row")
        dtype, shape = tensors.dtype(f"{p}.weight"), tensors.shape(f"{p}.weight")
        if dtype != np.uint8 or len(shape) > 2 or shape[0] != n * k // 2:
            raise ValueError(f"{p}.weight: {dtype} {list(shape)} does not hold {n} x {k} 4-bit codes")
        absmax = tensors[f"{p}.weight.absmax"]
        if absmax.dtype == np.uint8:  # double quantization, worked out in float32 as bitsandbytes does
            nested, nmap = tensors[f"{p}.weight.nested_absmax"], tensors[f"{p}.weight.nested_quant_map"]
            nb = int(state.get("nested_blocksize", 256))
            offset = np.float32(state["nested_offset"])
            absmax = nmap[absmax] * np.repeat(nested, nb)[: absmax.size] + offset
            tensors.used.update({f"{p}.weight.nested_absmax", f"{p}.weight.nested_quant_map"})
        if absmax.dtype != np.float32 or absmax.size != n * k // block:
            raise ValueError(f"{p}.weight.absmax: {absmax.dtype} of {absmax.size} values for {n * k // block} blocks")
        name, absmax = "nf4" if kind == "nf4" else "fp4bnb", absmax.reshape(n, -1)

        def make(rows, p=p, k=k, absmax=absmax, name=name):  # (rows of the flat bytes: k / 2 a row)
            packed = tensors.read(f"{p}.weight", slice(rows.start * k // 2, rows.stop * k // 2)).reshape(-1)
            codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(-1, k)
            return to_qarray(name, Grouped(codes, absmax[rows]), "f32", p)
        out[f"{p}.weight"] = Layer(n, make)
        tensors.used.update({key, f"{p}.weight", f"{p}.weight.absmax", f"{p}.weight.quant_map"})
    return out
