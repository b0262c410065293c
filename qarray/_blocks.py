"""Block formats: the LLM weight formats (GGUF's ggml types and the like) as
descriptions read by one generic packer, unpacker and dequantizer.

A block format stores a tensor's last axis in blocks of ``block`` elements,
each ``nbytes`` bytes. A block is a set of *fields*: the element codes
(``q``), the scales (``d``), sub-block scales and mins, ... Each field is
``count`` unsigned integers of ``bits`` bits, and its description says where
every bit of every value lies in the block (:class:`Field`); a float16 scale is
a 16-bit field viewed as float16. So one unpacker (:meth:`Field.unpack`) and
one packer (:meth:`BlockFormat.pack`) serve every layout: ggml's split nibbles,
its 6-bit scales packed in 12 bytes, a fifth bit kept in another array.

The values follow one formula, in float32 as the formats' own references
compute them::

    y = scale[sub-block] * value[code] + offset[sub-block]

``value`` is a table indexed by the code (``code - zero`` for integer codes,
a codebook such as NF4 or IQ4_NL otherwise); ``scale`` is a float field, or a
float field times a table of the small integer sub-scales (the two-level
K-quants: ``d * sc``), and ``offset`` likewise (``-dmin * m``). Each such
product is exact in float32 (an 11-bit float16 times a code of at most 8
bits), so ``y`` rounds once after the multiply and once after the add, as
gguf-py and ggml compute it. A format whose values have no such form (the IQ
lattices, whose codes index vectors of 4 or 8 values) gives its own
``elements`` function beside its description.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Field", "BlockFormat", "FORMATS", "get"]


class Field:
    """``count`` values of ``bits`` bits in a block; ``place(i)`` gives the
    ``(bit offset, width)`` runs of value ``i`` in the block, low bits first.
    ``view`` is how the unsigned bits read: ``float16`` for a scale, ``int8``
    for signed codes; unsigned by default."""

    def __init__(self, name, count, bits, place, view=None):
        self.name, self.count, self.bits = name, count, bits
        self.store = np.dtype(np.uint8 if bits <= 8 else np.uint16 if bits <= 16 else np.uint32)
        self.view = np.dtype(view) if view is not None else self.store
        pieces = []  # per value: (byte, shift, width, value shift) runs inside one byte each
        for i in range(count):
            runs, got = [], 0
            for start, width in place(i):
                while width:
                    w = min(width, 8 - start % 8)
                    runs.append((start // 8, start % 8, w, got))
                    start, width, got = start + w, width - w, got + w
            if got != bits:
                raise AssertionError(f"{name}[{i}] places {got} bits, not {bits}")
            pieces.append(runs)
        p = max(len(r) for r in pieces)
        runs = np.array([r + [(0, 0, 0, 0)] * (p - len(r)) for r in pieces], dtype=np.int64)
        self.byte, self.shift, self.width, self.vshift = (runs[..., k] for k in range(4))
        self.mask = (1 << self.width) - 1
        self.bytes = np.unique(self.byte[self.width > 0])
        # the runs as one array for compiled decoders: (byte, shift, mask, value shift) x runs x values
        self.pieces = np.ascontiguousarray(np.stack([self.byte, self.shift, self.mask, self.vshift]).transpose(0, 2, 1),
                                           np.int64)
        # the packer's gather: for each byte the field touches, the (value, run) pairs that land in it
        flat = [[i * p + k for i in range(count) for k in range(p) if self.mask[i, k] and self.byte[i, k] == b]
                for b in self.bytes]
        slots = max(len(f) for f in flat)
        self.gather = np.array([f + [count * p] * (slots - len(f)) for f in flat], dtype=np.int64)

    def unpack(self, raw):
        """The field's values from blocks ``raw`` (uint8, ``(n, nbytes)``): ``(n, count)``."""
        out = np.zeros((raw.shape[0], self.count), self.store)
        for k in range(self.byte.shape[1]):
            if not self.mask[:, k].any():
                continue
            part = (raw[:, self.byte[:, k]] >> self.shift[:, k].astype(np.uint8)) & self.mask[:, k].astype(np.uint8)
            out |= part.astype(self.store) << self.vshift[:, k].astype(self.store)
        return out.view(self.view) if self.view != self.store else out

    def check(self, fmt, v):
        """``v`` as the field's unsigned bits, ``(n, count)``; ValueError for a wrong shape or a value that
        does not fit."""
        v = np.asarray(v)
        if v.ndim == 1 and self.count == 1:  # one value a block (a scale), as a column
            v = v[:, None]
        if v.ndim != 2 or v.shape[1] != self.count:
            raise ValueError(f"{fmt}: field {self.name!r} has {self.count} values a block, got shape {v.shape}")
        if v.dtype == self.view:
            return v.view(self.store)
        if v.dtype.kind not in "iu" or self.view.kind not in "iu":
            raise TypeError(f"{fmt}: field {self.name!r} is {self.view}, got {v.dtype}")
        lo, hi = -(1 << (self.bits - 1)), (1 << self.bits) - 1  # unsigned values, or two's complement ones
        if v.size and (v.min() < lo or v.max() > hi):
            raise ValueError(f"{fmt}: field {self.name!r} holds {self.bits}-bit values, got [{v.min()}, {v.max()}]")
        return (v.astype(np.int64) & ((1 << self.bits) - 1)).astype(self.store)

    def contribute(self, v):
        """The field's bits in the bytes it touches: uint8 ``(n, len(self.bytes))`` to OR into the blocks."""
        v = v.astype(np.uint32)
        runs = ((v[:, :, None] >> self.vshift.astype(np.uint32)) & self.mask.astype(np.uint32)) << self.shift.astype(
            np.uint32)
        runs = np.concatenate([runs.reshape(len(v), -1), np.zeros((len(v), 1), np.uint32)], axis=1)
        return np.bitwise_or.reduce(runs[:, self.gather], axis=2).astype(np.uint8)


def bits_at(offset, bits):
    """``place`` for values stored one after another from byte ``offset``, ``bits`` each (LSB first)."""
    return lambda i: [(8 * offset + bits * i, bits)]


class BlockFormat:
    """One block format (see the module's docstring).

    - ``fields``: the :class:`Field` s, which together cover the block's bytes;
    - ``sub``: the elements each scale (and offset) entry covers;
    - ``values``: float32 table indexed by the code field ``q``;
    - ``scale``: ``(float field, (sub-scale field, table) or None)``: scale = d * table[sc];
    - ``offset``: the same for an offset, or None; ``sign`` -1 for ggml's ``- dmin * m``;
    - ``elements(fields)``: per-element values where no table gives them (IQ lattices);
    - ``quantize(x)``: float32 ``(n, block)`` -> fields, or None where the format is read only.
    """

    def __init__(self, name, block, nbytes, fields, sub=None, values=None, scale=("d", None), offset=None,
                 elements=None, quantize=None, ggml=None, bits=None):
        self.name, self.block, self.nbytes, self.ggml = name, block, nbytes, ggml
        self.fields = {f.name: f for f in fields}
        self.sub = sub or block
        self.values = None if values is None else np.asarray(values, np.float32)
        self.scale, self.offset, self.elements, self.quantize = scale, offset, elements, quantize
        self.bits = bits if bits is not None else self.fields["q"].bits
        covered = np.zeros(8 * nbytes, int)  # every bit of the block in exactly one field
        for f in fields:
            for b, s, w in zip(f.byte.ravel(), f.shift.ravel(), f.width.ravel()):
                covered[8 * b + s:8 * b + s + w] += 1
        if (covered != 1).any():
            raise AssertionError(f"{name}: the fields cover bits {np.flatnonzero(covered != 1)[:8]} "
                                 "not exactly once")

    def __repr__(self):
        return f"BlockFormat({self.name}: {self.block} elements in {self.nbytes} bytes)"

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.block

    def unpack(self, raw) -> dict:
        """Fields of blocks ``raw`` (uint8 ``(n, nbytes)``), each ``(n, count)``."""
        return {name: f.unpack(raw) for name, f in self.fields.items()}

    def pack(self, fields: dict) -> np.ndarray:
        """Blocks (uint8 ``(n, nbytes)``) from fields as :meth:`unpack` gives them; every field is needed."""
        missing = set(self.fields) - set(fields)
        if missing or set(fields) - set(self.fields):
            raise ValueError(f"{self.name}: fields are {sorted(self.fields)}, got {sorted(fields)}")
        n = len(np.asarray(next(iter(fields.values()))))
        raw = np.zeros((n, self.nbytes), np.uint8)
        for name, f in self.fields.items():
            v = f.check(self.name, fields[name])
            if len(v) != n:
                raise ValueError(f"{self.name}: the fields hold {n} and {len(v)} blocks ({name!r})")
            raw[:, f.bytes] |= f.contribute(v)
        return raw

    def _product(self, fields, spec):
        if callable(spec):  # a format's own (the IQ lattices')
            return spec(fields)
        base, sub = spec
        d = fields[base].astype(np.float32) if base is not None else None  # (n, 1): one a block
        if sub is None:
            return d
        name, table = sub
        s = np.asarray(table, np.float32)[fields[name].view(self.fields[name].store)]
        return s if d is None else d * s

    def scales(self, fields) -> np.ndarray:
        """float32 scale of each sub-block, ``(n, block // sub)``."""
        return self._product(fields, self.scale)

    def offsets(self, fields):
        """float32 offset of each sub-block, or None."""
        if self.offset is None:
            return None
        spec, sign = self.offset
        off = self._product(fields, spec)
        return -off if sign < 0 else off

    def element_values(self, fields) -> np.ndarray:
        """float32 value of each element before its scale, ``(n, block)``."""
        if self.elements is not None:
            return self.elements(fields)
        return self.values[fields["q"]]

    @property
    def plan(self):
        """The description as arrays for a compiled decoder (``backends._numba.block_decode``; each
        field's runs as ``Field.pieces``: byte, shift, mask, value shift x runs x values), or None
        for a format with decoding functions of its own. Each part of ``y = scale * value + offset`` is
        ``dtab[d] * stab[s]`` with either factor absent: ``d`` a field read once a block (a float16 scale
        through the table of every float16's float32 value), ``s`` one a sub-block; ``neg`` negates
        the offset."""
        if self.elements is not None or callable(self.scale):
            return None
        if "_plan" not in self.__dict__:
            self._plan = (self.fields["q"].pieces, self.values, *self._plan_part(self.scale),
                          *self._plan_part(self.offset[0] if self.offset else (None, None)),
                          self.offset is not None, self.offset is not None and self.offset[1] < 0)
        return self._plan

    def _plan_part(self, spec):
        base, sub = spec
        none = (np.zeros((4, 0, 1), np.int64), np.ones(1, np.float32))
        if base is None:
            d = none
        else:
            f = self.fields[base]
            table = _F16 if f.view == np.float16 else np.arange(1 << f.bits, dtype=np.float32)
            d = (f.pieces, table)
        s = none if sub is None else (self.fields[sub[0]].pieces, np.asarray(sub[1], np.float32))
        return (*d, *s)

    def decode(self, raw) -> np.ndarray:
        """float32 values of blocks ``raw`` (uint8 ``(n, nbytes)``): ``(n, block)``."""
        f = self.unpack(raw)
        n, k = len(raw), self.block // self.sub
        v = self.element_values(f).reshape(n, k, self.sub)
        with np.errstate(over="ignore", invalid="ignore"):
            y = self.scales(f).reshape(n, k, 1) * v
            off = self.offsets(f)
            if off is not None:
                y = y + off.reshape(n, k, 1)
        return y.reshape(n, self.block)


_F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
FORMATS: dict = {}  # upper-case name -> BlockFormat


def register(fmt: BlockFormat) -> BlockFormat:
    FORMATS[fmt.name.upper()] = fmt
    return fmt


def get(name):
    """The block format ``name`` names (case-insensitive), or None."""
    return FORMATS.get(name.upper()) if isinstance(name, str) else None
