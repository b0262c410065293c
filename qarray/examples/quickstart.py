"""qarray in one page: quantize, look, requantize between dtypes, save, load.

Plain prints (no rich): it needs only NumPy and qarray. ``--quick`` changes
nothing (it takes well under a second); ``--backend cupy`` puts the arrays on
the GPU.

Run: ``python -m qarray.examples.quickstart [--backend numpy|cupy]``
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

import qarray as qa
from qarray._params import to_host

from . import _common

NAME = "quickstart"


def main(argv: list[str] | None = None) -> int:
    ready = _common.setup(NAME, __doc__, argv, needs=())
    if ready is None:
        return 1
    xp = ready[1]
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((4, 8)).astype(np.float32))

    # Per-tensor int8, exactly as ONNX QuantizeLinear computes it.
    q = qa.quantize(x, scale=0.02, zero_point=0, dtype=qa.qint8)
    print(q[:2, :4])
    print("max error:", abs(q.dequantize() - x).max(), "<= scale / 2 inside the range")

    # Parameters from the data: per row (axis 0), and 4-bit blocks of 4 along rows.
    per_row = qa.quantize_dynamic(x, qa.qint8, symmetric=True, axis=0)
    blocks = qa.quantize_dynamic(x, qa.qint4, axis=1, block_size=4)
    print("per-row scales:", per_row.scale)
    print("int4 blocks, packed two per byte:", blocks.pack()[:6], "...")

    # An int32 accumulator requantized to uint8, integer-only, with each tie rule.
    ints = xp.asarray(np.array([-7, -5, -3, 3, 5, 7], np.int32))
    acc = qa.QArray.from_int(ints, scale=0.5, zero_point=0, dtype="qint32")
    for rounding in ("half_even", "half_away", "half_up", "tflite"):
        r = qa.requantize(acc, scale=1.0, zero_point=128, dtype="quint8", rounding=rounding)
        print(f"{rounding:>9}:", r.int_repr())

    # Save and load: packed sub-byte data, no pickle (a file holds host arrays).
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.npz")
        qa.save(path, {"per_row": per_row, "blocks": blocks})
        back = qa.load(path)
        same = bool((back["blocks"].int_repr() == to_host(blocks.int_repr())).all())
        print("saved and loaded:", sorted(back), "from", os.path.getsize(path), "bytes; same codes:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
