"""``qarray convert IN -o OUT``: a quantized checkpoint in another format.

IN is a GGUF file or a Hugging Face checkpoint directory (GPTQ, AWQ, ModelOpt,
bitsandbytes, compressed-tensors, MLX); OUT a ``.gguf`` file, or a
directory written as ``--to compressed-tensors``, ``mlx`` or ``gptq``. Each
quantized tensor goes into the first of the output's formats that holds its
codes and parameters exactly (``qarray._blocks.convert``): GPTQ's symmetric
4-bit groups of 32 become GGUF's Q4_0 and MLX's 4-bit groups of 32 with
float16 scales Q4_1, code for code; each library then computes the values in
its own precision. A tensor that no output format holds exactly is an error
naming it and saying why, unless ``--requantize DTYPE`` asks to quantize such
tensors again from their values (a lossy step: the table shows each one's
SQNR against the input's values). Tensor names and every other tensor are kept
as they are; a GGUF input's metadata goes to a GGUF output, a directory's
``config.json`` (less its quantization config) to a directory.
"""

from __future__ import annotations


import numpy as np

import qarray
from .. import _blocks
from ..io import checkpoint, gguf
from ._shared import CliError, _need, _one_line, _shape, _table

TARGETS = ("compressed-tensors", "mlx", "gptq")


def candidates(target, src) -> list:
    """The formats of ``target`` (``"gguf"`` or a checkpoint convention) that might hold ``src``'s codes
    and parameters, in the order tried."""
    b, g = src.bits, src.block
    types = ("f16", "bf16", "f32")
    names = {"gguf": [f.name for f in _blocks.FORMATS.values() if f.ggml is not None],
             "gptq": [f"int{b}_g{g}_f16", f"uint{b}_g{g}_f16_zp"],
             "compressed-tensors": [n for t in types for n in (f"int{b}_g{g}_{t}", f"uint{b}_g{g}_{t}_zp",
                                                                f"e4m3_g{g}_{t}")] + ["e2m1_g16_e4m3_gdiv",
                                                                                      "e2m1_g32_e8m0"],
             "mlx": [f"uint{b}_g{g}_{t}_bias" for t in types] + ["e2m1_g32_e8m0", "e2m1_g16_e4m3"]}[target]
    return [f for f in map(_blocks.get, names) if f is not None]


def carry_over(q, target):
    """``q`` as a QArray of the first format of ``target`` that holds it exactly, or ValueError with each
    reason."""
    src = q.dtype.layout
    raw = np.ascontiguousarray(q._backend.to_host(q.data)).reshape(-1, src.nbytes)
    why = []
    for dst in candidates(target, src):
        if dst is src:
            return q
        try:
            out = _blocks.convert(raw, src, dst)
        except ValueError as e:
            why.append(str(e))
            continue
        return qarray.QArray._blocks(out.reshape(*q.shape[:-1], -1), qarray.qdtype(dst.name), None, q.columns)
    reason = "; ".join(dict.fromkeys(w.split(": ", 1)[-1] for w in why)) or "no format of the same block size"
    raise ValueError(f"{src.name} has no exact {target} form ({reason})")


def _sqnr(x, y) -> float:
    noise = float(np.sum((x.astype(np.float64) - y) ** 2))
    signal = float(np.sum(x.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise) if signal else float("-inf")


def convert(args) -> int:
    out_gguf = args.output.suffix.lower() == ".gguf"
    target = "gguf" if out_gguf else args.to
    if target is None:
        raise CliError("a directory output needs --to compressed-tensors, mlx or gptq (or name OUT.gguf)", 2)
    if out_gguf and args.to is not None:
        raise CliError(f"--to {args.to} writes a directory; {args.output} is a .gguf file", 2)
    if args.requantize is not None:
        d = _blocks.get(args.requantize)
        if d is None or d.quantize is None or (d.ggml is not None) != out_gguf:
            raise CliError(f"--requantize {args.requantize}: " + (
                "a GGUF type with a quantizer (Q4_K, Q8_0, ...) for a .gguf output" if out_gguf else
                f"a {target} format with a quantizer (for example "
                f"{candidates(target, _blocks.get('Q4_0'))[0].name})"), 2)
        if not out_gguf and d.name not in {f.name for f in candidates(target, d)}:
            raise CliError(f"--requantize {d.name}: {target} does not hold it", 2)
    _need("rich", "pip install 'qarray[cli]'")
    metadata, config = {}, {}
    try:
        if args.input.suffix.lower() == ".gguf":
            tensors, metadata = gguf.read(args.input)
        elif checkpoint.is_checkpoint(args.input):
            tensors = qarray.load(args.input)
            config = {k: v for k, v in checkpoint.read_json(args.input / "config.json", "config").items()
                      if k not in ("quantization_config", "quantization")}
        else:
            raise CliError(f"{args.input}: expected a .gguf file or a checkpoint directory (config.json and "
                           ".safetensors)", 2)
    except ValueError as e:
        raise CliError(f"{args.input}: cannot read it: {_one_line(e)}") from None
    out, rows = {}, []
    for name, q in tensors.items():
        if not isinstance(q, qarray.QArray):
            out[name] = q
            continue
        try:
            out[name] = carry_over(q, target)
            rows.append((name, _shape(q), q.dtype.name, out[name].dtype.name, "exact"))
        except ValueError as e:
            if args.requantize is None:
                raise CliError(f"{name}: {e}; --requantize DTYPE quantizes it again from its values") from None
            x = q.dequantize()
            out[name] = qarray.quantize(x, dtype=args.requantize)
            rows.append((name, _shape(q), q.dtype.name, out[name].dtype.name,
                         f"{_sqnr(x, out[name].dequantize()):.2f} dB"))
    try:
        if out_gguf:
            qarray.save(args.output, out, metadata=metadata)
        else:
            checkpoint.save(args.output, out, target, config)
    except (ValueError, TypeError) as e:
        raise CliError(f"cannot write {args.output}: {_one_line(e)}") from None
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    _table(f"{args.input} -> {args.output}", ["name", "shape", "from", "to", "values"], rows,
           caption=f"{sum(r[-1] == 'exact' for r in rows)} of {len(rows)} quantized tensors carried over code for "
                   "code; the others were quantized again (SQNR against the input's values)", left=5)
    return 0

