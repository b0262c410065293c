"""Concatenate branches with different scales and zero points, integer-only, against the float way.

Three feature maps of scikit-learn's 8x8 digits, as an Inception-style block
would join them along the channel axis, each quantized with its own
parameters by ``quantize_dynamic``: the pixels (quint8), their horizontal
differences (qint8, symmetric) and their vertical differences (quint8,
asymmetric). ``qarray.cat(..., scale=, zero_point=, dtype=)`` requantizes each
input with integer arithmetic only (``mode="fixed"``: an integer multiplier
and shift, int64 inside) straight into its slice of the output. The float way
dequantizes each input to float32, calls ``numpy.concatenate`` and quantizes
again. The example shows that the two agree within one quantization step
everywhere (the largest code difference and how many codes differ), the dtype
of the arrays each way makes, and the time of each.

Run: ``python -m qarray.examples.concat [--quick] [--backend numpy|cupy]``
"""

from __future__ import annotations

import numpy as np

import qarray as qa
from qarray._params import to_host

from . import _common

NAME = "concat"


def branches(x, xp):
    """The three quantized feature maps ``(N, 1, 8, 8)`` of images ``x`` ``(N, 64)``."""
    img = xp.asarray(x).reshape(-1, 1, 8, 8)
    dx, dy = xp.zeros_like(img), xp.zeros_like(img)
    dx[..., 1:] = img[..., 1:] - img[..., :-1]
    dy[..., 1:, :] = img[..., 1:, :] - img[..., :-1, :]
    return [qa.quantize_dynamic(img, "quint8"), qa.quantize_dynamic(dx, "qint8", symmetric=True),
            qa.quantize_dynamic(dy, "quint8")]


def run(quick: bool = False, xp=np) -> dict:
    """Both ways on every image (the first 256 with ``quick``).

    Returns ``{"shape", "inputs": [(dtype name, scale, zero_point)], "output":
    (dtype name, scale, zero_point), "max_code_diff", "differing", "size",
    "integer_steps", "float_steps": [(step, array dtype, bytes)],
    "integer_ms", "float_ms"}``.
    """
    x = _common.load_digits()[0]
    qs = branches(x[:256] if quick else x, xp)
    lo = min(float(to_host(q.dequantize().min())) for q in qs)
    hi = max(float(to_host(q.dequantize().max())) for q in qs)
    scale, zero_point = qa.choose_qparams(lo, hi, "quint8")
    out = {"scale": scale, "zero_point": zero_point, "dtype": "quint8"}

    def integer_way():
        return qa.cat(qs, axis=1, **out)

    def float_way():
        floats = [q.dequantize() for q in qs]
        joined = xp.concatenate(floats, axis=1)
        return floats, joined, qa.quantize(joined, scale, zero_point, "quint8")

    joined_q = integer_way()
    floats, joined, float_q = float_way()
    diff = np.abs(to_host(joined_q.int_repr()).astype(np.int64) - to_host(float_q.int_repr()))
    repeats = 5 if quick else 30
    return {
        "shape": joined_q.shape,
        "inputs": [(q.dtype.name, float(to_host(q.scale)), int(to_host(q.zero_point))) for q in qs],
        "output": ("quint8", float(scale), int(zero_point)),
        "max_code_diff": int(diff.max()),
        "differing": int(np.count_nonzero(diff)),
        "size": int(diff.size),
        "integer_steps": [*(("input codes", q.data.dtype, q.data.nbytes) for q in qs),
                          ("qarray.cat: requantized into the output", joined_q.data.dtype, joined_q.data.nbytes)],
        "float_steps": [*(("dequantize", f.dtype, f.nbytes) for f in floats),
                        ("numpy.concatenate", joined.dtype, joined.nbytes),
                        ("quantize", float_q.data.dtype, float_q.data.nbytes)],
        "integer_ms": _common.median_ms(integer_way, repeats, xp),
        "float_ms": _common.median_ms(float_way, repeats, xp),
    }


def show(r: dict, backend: str) -> None:
    """Print ``run``'s result as rich tables."""
    names = ("pixels", "d/dx", "d/dy")
    _common.print_table(
        f"concat: 3 branches -> {r['shape']} ({backend})", ("tensor", "dtype", "scale", "zero point"),
        [*((n, *p) for n, p in zip(names, r["inputs"])), ("joined", *r["output"])])
    steps = [("integer", s, d, f"{b:,}") for s, d, b in r["integer_steps"]]
    steps += [("float", s, d, f"{b:,}") for s, d, b in r["float_steps"]]
    _common.print_table("the arrays each way makes", ("way", "step", "dtype", "bytes"), steps)
    _common.print_table(
        "integer-only qarray.cat vs dequantize -> numpy.concatenate -> quantize",
        ("way", "median ms", "max code difference", "codes that differ"),
        [("integer (qarray.cat)", f"{r['integer_ms']:.3f}", r["max_code_diff"], f"{r['differing']:,} of {r['size']:,}"),
         ("float", f"{r['float_ms']:.3f}", "", "")])


def main(argv: list[str] | None = None) -> int:
    return _common.main(NAME, __doc__, argv, run, show)


if __name__ == "__main__":
    raise SystemExit(main())
