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

The values follow one formula::

    y = scale[sub-block] * (value[code] - zero[sub-block]) + offset[sub-block]

``value`` is a table indexed by the code (``code - zero`` for integer codes,
a codebook such as NF4 or IQ4_NL otherwise); ``scale`` is a float field, or a
float field times a table of the small integer sub-scales (the two-level
K-quants: ``d * sc``), and ``offset`` likewise (``-dmin * m``). Each such
product is exact in float32 (an 11-bit float16 times a code of at most 8
bits), so ``y`` rounds once after the multiply and once after the add, as
gguf-py and ggml compute it. ``zero`` is an integer field (GPTQ's, AWQ's and
compressed-tensors' zero points; 0 where a format has none). A format's
``precision`` is the float type its reference computes in: float32 for
ggml's types, the scales' float16 or bfloat16 for GPTQ, AWQ, MLX and
compressed-tensors; the multiply and the add each round to it. Computing each
operation in float32 and rounding its result to float16 or bfloat16 gives the
same bits as computing in that type (float32 has more than twice their
significand bits plus two, so the double rounding is innocuous).

A format whose values have no such form (the IQ lattices, whose codes index vectors of 4 or 8 values) gives its own
``elements`` function beside its description.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["Field", "BlockFormat", "FORMATS", "get", "rounded", "convert"]


def rounded(y, precision):
    """float32 ``y`` rounded to ``precision`` (``"float32"``, ``"float16"`` or ``"bfloat16"``: to
    nearest, ties to even), as float32."""
    if precision == "float32":
        return y
    if precision == "float16":
        with np.errstate(over="ignore"):
            return y.astype(np.float16).astype(np.float32)
    u = y.view(np.uint32)  # bfloat16: the top 16 bits, rounded to nearest even; NaN stays NaN
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(y), y, r)


class Field:
    """``count`` values of ``bits`` bits in a block; ``place(i)`` gives the
    ``(bit offset, width)`` runs of value ``i`` in the block, low bits first.
    ``view`` is how the unsigned bits read: ``float16`` for a scale, ``int8``
    for signed codes, ``"bfloat16"`` for a bfloat16 scale (read as float32);
    unsigned by default.

    The runs become ``segments``: rows ``(first value, count, first byte, byte
    stride, shift, mask, value shift)``, each saying that values ``first ..
    first + count - 1`` take ``((byte >> shift) & mask) << value shift`` from
    bytes ``first byte, + stride, ...``: ggml's 4-bit codes are two segments
    of 16 or 32 (the low and the high nibbles of a run of bytes), a float16
    scale two of one. The unpacker, the packer and the compiled decoder walk
    the segments, slice by slice."""

    def __init__(self, name, count, bits, place, view=None):
        self.name, self.count, self.bits, self._place = name, count, bits, place
        self.store = np.dtype(np.uint8 if bits <= 8 else np.uint16 if bits <= 16 else np.uint32)
        self.bf16 = view == "bfloat16"  # NumPy has no bfloat16: its bits are the top half of a float32
        self.view = np.dtype(np.float32 if self.bf16 else view if view is not None else self.store)

    @functools.cached_property
    def segments(self) -> np.ndarray:
        """The runs of ``place`` grouped into segments (worked out on first use: ``import qarray`` stays
        cheap)."""
        runs = []  # (run index, value, byte, shift, width, value shift): a value's bits inside one byte
        for i in range(self.count):
            got, k = 0, 0
            for start, width in self._place(i):
                while width:
                    w = min(width, 8 - start % 8)
                    runs.append((k, i, start // 8, start % 8, w, got))
                    start, width, got, k = start + w, width - w, got + w, k + 1
            if got != self.bits:
                raise AssertionError(f"{self.name}[{i}] places {got} bits, not {self.bits}")
        segments = []
        for k, i, byte, shift, w, vs in sorted(runs):
            last = segments[-1] if segments else None
            if last and last[7] == k and last[0] + last[1] == i and (last[4], last[5], last[6]) == (shift, (1 << w) - 1, vs) \
                    and (last[1] == 1 or byte - last[2] == last[1] * last[3]):
                last[3] = byte - last[2] if last[1] == 1 else last[3]
                last[1] += 1
                continue
            segments.append([i, 1, byte, 1, shift, (1 << w) - 1, vs, k])
        return np.array([g[:7] for g in segments], dtype=np.int64)

    @property
    def bits_used(self) -> list:
        """The bit positions in the block that the field's values take."""
        return [(b + j * st) * 8 + sh + t for i, n, b, st, sh, m, vs in self.segments for j in range(n)
                for t in range(int(m).bit_length())]

    def _slices(self):
        for i, n, b, st, sh, m, vs in self.segments.tolist():
            yield slice(i, i + n), slice(b, b + (n - 1) * st + 1, st), sh, m, vs

    def unpack(self, raw):
        """The field's values from blocks ``raw`` (uint8, ``(n, nbytes)``): ``(n, count)``."""
        out = np.zeros((raw.shape[0], self.count), self.store)
        for values, bytes_, sh, m, vs in self._slices():
            part = (raw[:, bytes_] >> np.uint8(sh)) & np.uint8(m)
            out[:, values] |= part.astype(self.store) << self.store.type(vs)
        if self.bf16:
            return (out.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return out.view(self.view) if self.view != self.store else out

    def pack_into(self, raw, v):
        """OR the field's values ``v`` (its unsigned bits, ``(n, count)``) into blocks ``raw``."""
        for values, bytes_, sh, m, vs in self._slices():
            raw[:, bytes_] |= (((v[:, values] >> self.store.type(vs)) & self.store.type(m)) << self.store.type(sh)
                               ).astype(np.uint8)

    def check(self, fmt, v):
        """``v`` as the field's unsigned bits, ``(n, count)``; ValueError for a wrong shape or a value that
        does not fit."""
        v = np.asarray(v)
        if v.ndim == 1 and self.count == 1:  # one value a block (a scale), as a column
            v = v[:, None]
        if v.ndim != 2 or v.shape[1] != self.count:
            raise ValueError(f"{fmt}: field {self.name!r} has {self.count} values a block, got shape {v.shape}")
        if self.bf16 and v.dtype in (np.float32, "bfloat16"):  # (ml_dtypes' bfloat16, where given)
            u = v.view(np.uint16) if v.dtype.itemsize == 2 else v.view(np.uint32)
            if u.dtype == np.uint32 and np.any(u & np.uint32(0xFFFF)):
                raise ValueError(f"{fmt}: field {self.name!r} is bfloat16; got float32 values that are not bfloat16")
            return (u >> np.uint32(16)).astype(np.uint16) if u.dtype == np.uint32 else u
        if v.dtype == self.view:
            return v.view(self.store)
        if v.dtype.kind not in "iu" or self.view.kind not in "iu":
            raise TypeError(f"{fmt}: field {self.name!r} is {self.view}, got {v.dtype}")
        lo, hi = -(1 << (self.bits - 1)), (1 << self.bits) - 1  # unsigned values, or two's complement ones
        if v.size and (v.min() < lo or v.max() > hi):
            raise ValueError(f"{fmt}: field {self.name!r} holds {self.bits}-bit values, got [{v.min()}, {v.max()}]")
        return (v.astype(np.int64) & ((1 << self.bits) - 1)).astype(self.store)


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
    - ``zero``: the integer field subtracted from each sub-block's values, or None;
    - ``precision``: the float type the reference computes in (see the module's docstring);
    - ``tensor_scale``: ``"divide"`` or ``"multiply"``: each scale divided or multiplied (float32) by
      the tensor's one scale (``QArray.global_scale``: NVFP4's second level), or None;
    - ``factor``: a float32 constant the product is multiplied by, rounded (bitsandbytes' LLM.int8:
      ``q * SCB * (1 / 127)``), or None;
    - ``elements(fields)``: per-element values where no table gives them (IQ lattices);
    - ``quantize(x)``: float32 ``(n, block)`` -> fields, or None where the format is read only.
    """

    def __init__(self, name, block, nbytes, fields, sub=None, values=None, scale=("d", None), offset=None,
                 elements=None, quantize=None, ggml=None, bits=None, zero=None, precision="float32",
                 tensor_scale=None, factor=None):
        self.name, self.block, self.nbytes, self.ggml = name, block, nbytes, ggml
        self.zero, self.precision, self.tensor_scale = zero, precision, tensor_scale
        self.factor = None if factor is None else np.float32(factor)
        self.fields = {f.name: f for f in fields}
        self.sub = sub or block
        self.values = None if values is None else np.asarray(values, np.float32)
        self.scale, self.offset, self.elements, self.quantize = scale, offset, elements, quantize
        self.bits = bits if bits is not None else self.fields["q"].bits

    def covered(self) -> np.ndarray:
        """How many fields take each bit of a block: ones everywhere for a sound description."""
        covered = np.zeros(8 * self.nbytes, int)
        for f in self.fields.values():
            np.add.at(covered, f.bits_used, 1)
        return covered

    def __repr__(self):
        return f"BlockFormat({self.name}: {self.block} elements in {self.nbytes} bytes)"

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.block

    @property
    def takes_importance(self) -> bool:
        """Whether the format's quantizer weights its search by an importance matrix (llama.cpp's imatrix:
        ``quantize(..., importance=)``)."""
        return getattr(self.quantize, "takes_importance", False)

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
            f.pack_into(raw, v)
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

    def scales(self, fields, g=None) -> np.ndarray:
        """float32 scale of each sub-block, ``(n, block // sub)`` (``g``: the tensor's scale, where the
        format has one)."""
        s = self._product(fields, self.scale)
        if self.tensor_scale is None:
            return s
        if g is None:
            raise ValueError(f"{self.name} needs the tensor's scale (QArray.global_scale)")
        return s / np.float32(g) if self.tensor_scale == "divide" else s * np.float32(g)

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
        """The codes' description for a compiled decoder (``backends.cpu.quantize.block_decode``): the code
        field's ``Field.segments`` and the value table; None for a format with decoding functions of
        its own (the IQ lattices)."""
        if self.elements is not None:
            return None
        return self.fields["q"].segments, self.values

    def parameters(self, raw, g=None):
        """``(scale, offset or None, zero or None)`` of blocks ``raw``, float32 ``(n, block // sub)``
        each, from the fields they need alone (not the codes)."""
        names = [n for n in self.fields if n != "q"] if callable(self.scale) else \
            [n for spec in (self.scale, self.offset and self.offset[0]) if spec for n in (spec[0], spec[1] and spec[1][0])
             if n is not None]
        fields = {n: self.fields[n].unpack(raw) for n in names}
        zero = None if self.zero is None else self.fields[self.zero].unpack(raw).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self.scales(fields, g), self.offsets(fields), zero

    @functools.cached_property
    def leveled(self) -> bool:
        """Whether :meth:`levels` reads this format's scales (and offsets) as two levels."""
        if self.zero is not None or self.factor is not None or self.tensor_scale is not None:
            return False
        return all(not callable(spec) and spec[0] is not None and (spec[1] is not None or self.sub == self.block)
                   and (spec[1] is None or np.all(np.asarray(spec[1][1]) == np.rint(spec[1][1])))
                   for spec in (self.scale, self.offset and self.offset[0]) if spec)

    def levels(self, raw):
        """The scales and offsets of blocks ``raw`` as their two levels, where each is a float field
        times a table of integers (the K-quants' ``d * scales[j]`` and ``-dmin * mins[j]``, IQ4_XS's
        ``d * (ls - 32)``) or a float field alone over the whole block (TQ2_0's ``d``): ``(d, sc, dm,
        m)``, ``d`` float32 ``(n,)``, ``sc`` int64 ``(n, block // sub)`` (ones for one level), ``dm``
        (the offset's, its sign included) and ``m`` likewise, or None where there is no offset. None
        where a scale or offset has another form, or the format a zero point, factor or tensor scale
        (:attr:`leveled`)."""
        if not self.leveled:
            return None
        sides = [(self.scale, 1)] + ([self.offset] if self.offset is not None else [])
        out = []
        for spec, sign in sides:
            with np.errstate(invalid="ignore"):  # (a signalling NaN scale stays NaN, quietly)
                d = (self.fields[spec[0]].unpack(raw).astype(np.float32) * np.float32(sign)).reshape(-1)
            sc = np.ones((len(raw), 1), np.int64) if spec[1] is None else \
                np.asarray(spec[1][1], np.int64)[self.fields[spec[1][0]].unpack(raw).astype(np.int64)]
            out += [d, sc]
        return tuple(out) + (None, None) * (2 - len(sides))

    def decode(self, raw, g=None) -> np.ndarray:
        """float32 values of blocks ``raw`` (uint8 ``(n, nbytes)``): ``(n, block)`` (``g``: the tensor's
        scale, where the format has one)."""
        f = self.unpack(raw)
        n, k = len(raw), self.block // self.sub
        v = self.element_values(f).reshape(n, k, self.sub)
        if self.zero is not None:
            v = v - f[self.zero].astype(np.float32).reshape(n, k, 1)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            y = rounded(self.scales(f, g).reshape(n, k, 1) * v, self.precision)
            if self.factor is not None:
                y = rounded(y * self.factor, self.precision)
            off = self.offsets(f)
            if off is not None:
                y = rounded(y + off.reshape(n, k, 1), self.precision)
        return y.reshape(n, self.block)


FORMATS: dict = {}  # upper-case name -> BlockFormat
FAMILIES: list = []  # functions name -> BlockFormat (registered on first use) or None: qarray._grouped's


def register(fmt: BlockFormat) -> BlockFormat:
    FORMATS[fmt.name.upper()] = fmt
    return fmt


def get(name):
    """The block format ``name`` names (case-insensitive), or None: a registered one (ggml's types), or
    one that a family makes (qarray._grouped's ``int4_g128_f16`` and the like)."""
    if not isinstance(name, str):
        return None
    return FORMATS.get(name.upper()) or next(filter(None, (family(name) for family in FAMILIES)), None)


# -- converting between formats with the same codes and parameters -----------------------------------

def _plain(fmt):
    """The one-level form of ``fmt``: ``(scale field, offset field or None)`` where its scale and offset
    are float fields (not two-level) and its values a table; None otherwise (K-quants, lattices)."""
    if fmt.elements is not None or fmt.values is None or callable(fmt.scale) or fmt.scale[1] is not None \
            or fmt.sub != fmt.block:
        return None
    if fmt.offset is not None and (fmt.offset[0][1] is not None or fmt.offset[1] < 0):
        return None
    return fmt.scale[0], fmt.offset and fmt.offset[0][0]


def convert(raw, src: BlockFormat, dst: BlockFormat) -> np.ndarray:
    """Blocks of ``dst`` holding the codes and parameters of ``src``'s blocks ``raw``: every scale,
    offset and ``value - zero`` the same, which each format then computes in its own precision
    (GPTQ's symmetric 4-bit groups of 32 are GGUF's Q4_0; MLX's 4-bit groups of 32 with float16 scales
    and biases are Q4_1). ValueError saying what would change otherwise."""
    a, b = _plain(src), _plain(dst)
    if a is None or b is None:
        raise ValueError(f"{src.name} -> {dst.name}: only one-level formats (a scale, a zero point or an offset, and a "
                         "value table) carry over code for code")
    if src.block != dst.block:
        raise ValueError(f"{src.name} -> {dst.name}: blocks of {src.block} and {dst.block} values")
    if (a[1] is None) != (b[1] is None):
        raise ValueError(f"{src.name} -> {dst.name}: " + ("the offsets (biases) have nowhere to go" if b[1] is None
                                                         else f"{dst.name} stores an offset that {src.name} lacks"))
    f = src.unpack(raw)
    out = {b[0]: f[a[0]]}
    if b[1] is not None:
        out[b[1]] = f[a[1]]
    # the destination's code of each (source code, source zero): the one whose value - zero is the same
    zs = np.arange(1 << src.fields[src.zero].bits) if src.zero else np.zeros(1, int)
    target = src.values[:, None] - zs[None, :].astype(np.float32)  # value - zero, by (code, zero)
    if dst.zero is not None:  # codes are value + zero: the source's zero, or the middle code
        mid = len(dst.values) // 2
        out[dst.zero] = f[src.zero] if src.zero else np.full((len(raw), 1), mid, dst.fields[dst.zero].store)
        target = target + (zs if src.zero else np.full(1, mid))[None, :].astype(np.float32)
    index = {float(x): i for i, x in reversed(list(enumerate(dst.values.tolist()))) if x == x}
    table = np.array([index.get(float(x), -1) for x in target.ravel()]).reshape(target.shape)
    codes = table[f["q"], f[src.zero] if src.zero else 0]
    if codes.size and codes.min() < 0:
        at = np.argwhere(codes < 0)[0]
        bad = src.values[f["q"][tuple(at)]] - (f[src.zero][at[0], 0] if src.zero else 0)
        raise ValueError(f"{src.name} -> {dst.name}: a value of {bad:g} (code - zero) is not one of {dst.name}'s codes")
    out["q"] = codes.astype(dst.fields["q"].store)
    with np.errstate(over="ignore"):
        for name in filter(None, b):  # the parameters in the destination's float type, checked below
            out[name] = out[name].astype(dst.fields[name].view)
    try:
        result = dst.pack({k: out[k] for k in dst.fields})
    except ValueError as e:  # (its message starts with dst's name)
        raise ValueError(f"{src.name} -> {e}") from None
    same = [x is y or x is not None and y is not None and np.array_equal(x, y, equal_nan=True)
            for x, y in zip(src.parameters(raw)[:2], dst.parameters(result)[:2])]
    if not all(same):
        raise ValueError(f"{src.name} -> {dst.name}: the " + ["scales", "offsets"][same.index(False)]
                         + f" of {src.name} do not fit {dst.name}'s fields exactly")
    return result
