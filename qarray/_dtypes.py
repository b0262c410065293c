"""The quantized dtype table: name, bits, signedness, range and storage.

Every ``dtype=`` argument in qarray goes through :func:`qdtype`, which accepts a
:class:`QDType`, its name, a PyTorch or ONNX spelling, or a NumPy integer dtype.
"""

from __future__ import annotations

import numpy as np

from . import _blocks, _formats
from . import _ggml  # noqa: F401  (registers ggml's block types with _blocks)
from . import _grouped  # noqa: F401  (the grouped formats' family, with _blocks)

__all__ = ["QDType", "qdtype", "iinfo"]


class QDType:
    """A quantized scalar type: ``bits`` wide, signed or not, held in ``storage``.

    Sub-byte types (2 and 4 bits) are held one value per byte in memory;
    ``QArray.pack()`` gives the packed layout.
    """

    __slots__ = ("name", "bits", "signed", "qmin", "qmax", "storage", "kind", "layout")

    def __init__(self, name: str, bits: int, signed: bool, storage, kind: str = "int", layout=None):
        self.name = name
        self.bits = bits
        self.signed = signed
        # "int"; "float" for the floating formats (qarray._formats); "block" for the block formats
        # (qarray._blocks: GGUF's Q4_K and the like), whose ``layout`` is their BlockFormat
        self.kind = kind
        self.layout = layout
        self.qmin = -(1 << (bits - 1)) if signed else 0
        self.qmax = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
        self.storage = np.dtype(storage)
        if kind == "float":  # the largest finite values; the zero point is always 0
            self.qmax = _formats.finfo(name).max
            self.qmin = -self.qmax

    def __repr__(self) -> str:
        return self.name

    def __eq__(self, other):
        """Equal to itself and to its name (``q.dtype == "qint8"``)."""
        return self is other or (isinstance(other, str) and other == self.name)

    def __hash__(self):
        return hash(self.name)

    def __reduce__(self):
        return (qdtype, (self.name,))

    @property
    def bits_dtype(self) -> np.dtype:
        """The codes as plain integers, as ``pack()``, files and moves between
        backends hold them: the storage of an integer format; a floating
        format's bit patterns, uint8 (mxint8's int8 codes too)."""
        return np.dtype(np.uint8) if self.kind == "float" else self.storage

    @property
    def packed(self) -> bool:
        """True for the sub-byte types that ``pack()`` stores several to a byte."""
        return self.bits < 8


qint2 = QDType("qint2", 2, True, "int8")
quint2 = QDType("quint2", 2, False, "uint8")
qint4 = QDType("qint4", 4, True, "int8")
quint4 = QDType("quint4", 4, False, "uint8")
qint8 = QDType("qint8", 8, True, "int8")
quint8 = QDType("quint8", 8, False, "uint8")
qint16 = QDType("qint16", 16, True, "int16")
quint16 = QDType("quint16", 16, False, "uint16")
qint32 = QDType("qint32", 32, True, "int32")

ALL = (qint2, quint2, qint4, quint4, qint8, quint8, qint16, quint16, qint32)

# Every accepted spelling (lower case) -> QDType. PyTorch spells its types
# qint8/quint8/qint32/quint4x2/quint2x4 ("torch." is stripped); ONNX spells
# them int8/uint8/int4/uint4/int2/uint2/int16/uint16/int32.
_NAMES = {d.name: d for d in ALL}
_NAMES.update({d.name[1:]: d for d in ALL})
_NAMES.update({"quint4x2": quint4, "quint2x4": quint2})

# NumPy storage dtypes name the 8, 16 and 32 bit types unambiguously.
_BY_NUMPY = {d.storage: d for d in (qint8, quint8, qint16, quint16, qint32)}


def qdtype(spec) -> QDType:
    """Return the :class:`QDType` that ``spec`` names.

    >>> qdtype("int4"), qdtype("torch.quint8"), qdtype(np.int16)
    (qint4, quint8, qint16)
    """
    if isinstance(spec, QDType):
        return spec
    if isinstance(spec, str):
        if spec in _NAMES:  # the common call: "qint8"
            return _NAMES[spec]
        key = spec.lower()
        key = key[6:] if key.startswith("torch.") else key
        if key in _NAMES:
            return _NAMES[key]
        floating = _floating(spec)
        if floating is not None:
            return floating
        block = _block(spec)
        if block is not None:
            return block
        raise TypeError(
            f"unknown quantized dtype {spec!r}; use one of "
            + ", ".join(d.name for d in ALL)
            + " (or int8, uint4, quint4x2, ...), or a floating format: "
            + ", ".join(FLOATING)
            + "; or a block format (GGUF's types, case-insensitive): "
            + ", ".join(f.name for f in _blocks.FORMATS.values() if f.ggml is not None)
            + " (and grouped ones such as int4_g128_f16)"  # (those made so far would make the list vary)
        )
    try:
        np_dtype = np.dtype(spec)
    except TypeError:
        np_dtype = None
    if np_dtype is not None and np_dtype in _BY_NUMPY:
        return _BY_NUMPY[np_dtype]
    if np_dtype is not None and _floating(np_dtype.name) is not None:  # an ml_dtypes dtype
        return _floating(np_dtype.name)
    text = str(spec)
    if text.startswith("torch."):  # torch.qint8 and friends, without importing torch
        return qdtype(text)
    raise TypeError(
        f"unknown quantized dtype {spec!r}; use one of " + ", ".join(d.name for d in ALL)
    )


_FLOATING = {}
# the floating formats a QArray holds (qarray._formats.FORMATS less the scale type;
# mxint8 is MX's element, made by quantize_mx)
FLOATING = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float6_e2m3fn", "float6_e3m2fn",
            "float4_e2m1fn", "mxint8")


def _floating(spec):
    """The floating-format QDType ``spec`` names (ml_dtypes', ONNX's or PyTorch's
    spelling), made on first use (it needs ml_dtypes); None if it names none."""
    try:
        f = _formats.fmt(spec)
    except TypeError:
        return None
    if f.name not in FLOATING:  # float8_e8m0fnu: a scale type, not an element type
        return None
    if f.name not in _FLOATING:
        _FLOATING[f.name] = QDType(f.name, f.bits, True, _formats.dtype(f), kind="float")
    return _FLOATING[f.name]


_BLOCK = {}


def _block(spec):
    """The QDType of the block format ``spec`` names (GGUF's ``Q4_K``, any case), or None. Its
    codes are held as the format's bytes (uint8); ``bits`` is its codes' width."""
    f = _blocks.get(spec)
    if f is None:
        return None
    if f.name not in _BLOCK:
        _BLOCK[f.name] = QDType(f.name, f.bits, False, "uint8", kind="block", layout=f)
    return _BLOCK[f.name]


class iinfo:
    """Range of a quantized dtype, like :class:`numpy.iinfo`.

    >>> iinfo("qint4")
    iinfo(min=-8, max=7, dtype=qint4)
    """

    __slots__ = ("dtype", "kind", "bits", "min", "max")

    def __init__(self, dtype):
        d = qdtype(dtype)
        if d.kind != "int":
            raise TypeError(f"iinfo takes integer formats; {d.name} is a floating format: use qarray.finfo")
        self.dtype = d
        self.kind = "i" if d.signed else "u"
        self.bits = d.bits
        self.min = d.qmin
        self.max = d.qmax

    def __repr__(self) -> str:
        return f"iinfo(min={self.min}, max={self.max}, dtype={self.dtype.name})"
