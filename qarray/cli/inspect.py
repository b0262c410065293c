"""``qarray inspect FILE``: what a .npz, .npy or .safetensors file or a .zarr
store holds."""

from __future__ import annotations

import qarray
from .._params import to_host
from ._files import _read, _scheme, _stored_bytes
from ._shared import _need, _shape, _table


def inspect(args) -> int:
    _need("rich", "pip install 'qarray[cli]'")
    quantized, arrays = _read(args.file)
    if not quantized:
        _table(str(args.file), ["name", "shape", "dtype", "bytes"],
               [(n, _shape(a), str(a.dtype), a.nbytes) for n, a in arrays.items()], left=3)
        return 0
    rows = []
    for name, q in arrays.items():
        if not isinstance(q, qarray.QArray):  # a NumPy array, or a Zarr store's dask array
            rows.append((name, _shape(q), str(q.dtype), "plain array", "", "", q.nbytes))
            continue
        s, z = to_host(q.scale), to_host(q.zero_point)
        rows.append((name, _shape(q), q.dtype.name, _scheme(q), _span(s, "{:.6g}"), _span(z, "{}"), _stored_bytes(q, args.file)))
    _table(f"{args.file} (qarray file)", ["name", "shape", "dtype", "scheme", "scale", "zero point", "stored bytes"],
           rows, left=4)
    return 0


def _span(a, fmt) -> str:
    lo, hi = a.min(), a.max()
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)} .. {fmt.format(hi)}"
