"""qarray in one page: quantize, look, requantize between dtypes, save, load.

Run: python examples/quickstart.py
"""

import os
import tempfile

import numpy as np

import qarray as qa

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 8)).astype(np.float32)

# Per-tensor int8, exactly as ONNX QuantizeLinear computes it.
q = qa.quantize(x, scale=0.02, zero_point=0, dtype=qa.qint8)
print(q[:2, :4])
print("max error:", np.abs(q.dequantize() - x).max(), "<= scale / 2 inside the range")

# Parameters from the data: per row (axis 0), and 4-bit blocks of 4 along rows.
per_row = qa.quantize_dynamic(x, qa.qint8, symmetric=True, axis=0)
blocks = qa.quantize_dynamic(x, qa.qint4, axis=1, block_size=4)
print("per-row scales:", per_row.scale)
print("int4 blocks, packed two per byte:", blocks.pack()[:6], "...")

# An int32 accumulator requantized to uint8, integer-only, with each tie rule.
acc = qa.QArray.from_int(np.array([-7, -5, -3, 3, 5, 7], np.int32), scale=0.5, zero_point=0, dtype="qint32")
for rounding in ("half_even", "half_away", "half_up", "tflite"):
    r = qa.requantize(acc, scale=1.0, zero_point=128, dtype="quint8", rounding=rounding)
    print(f"{rounding:>9}:", r.int_repr())

# Save and load: packed sub-byte data, no pickle.
path = os.path.join(tempfile.mkdtemp(), "weights.npz")
qa.save(path, {"per_row": per_row, "blocks": blocks})
back = qa.load(path)
assert (back["blocks"].int_repr() == blocks.int_repr()).all()
print("saved and loaded:", sorted(back), "from", os.path.getsize(path), "bytes")
