import numpy as np
import pytest

import qarray
from qarray import iinfo, qdtype

TABLE = [
    # name, bits, signed, qmin, qmax, storage
    ("qint2", 2, True, -2, 1, np.int8),
    ("quint2", 2, False, 0, 3, np.uint8),
    ("qint4", 4, True, -8, 7, np.int8),
    ("quint4", 4, False, 0, 15, np.uint8),
    ("qint8", 8, True, -128, 127, np.int8),
    ("quint8", 8, False, 0, 255, np.uint8),
    ("qint16", 16, True, -32768, 32767, np.int16),
    ("quint16", 16, False, 0, 65535, np.uint16),
    ("qint32", 32, True, -(2**31), 2**31 - 1, np.int32),
]


@pytest.mark.parametrize("name,bits,signed,qmin,qmax,storage", TABLE)
def test_table(name, bits, signed, qmin, qmax, storage):
    d = qdtype(name)
    assert (d.name, d.bits, d.signed, d.qmin, d.qmax, d.storage) == (name, bits, signed, qmin, qmax, np.dtype(storage))
    assert getattr(qarray, name) is d
    info = iinfo(name)
    assert (info.min, info.max, info.bits, info.kind) == (qmin, qmax, bits, "i" if signed else "u")


@pytest.mark.parametrize(
    "spelling,name",
    [("int2", "qint2"), ("uint2", "quint2"), ("quint2x4", "quint2"), ("int4", "qint4"),
     ("uint4", "quint4"), ("quint4x2", "quint4"), ("int8", "qint8"), ("uint8", "quint8"),
     ("INT16", "qint16"), ("uint16", "quint16"), ("int32", "qint32"), ("torch.qint8", "qint8"),
     ("torch.quint8", "quint8"), ("torch.qint32", "qint32"), (np.int8, "qint8"),
     (np.dtype("uint16"), "quint16"), ("QINT4", "qint4")],
)
def test_spellings(spelling, name):
    assert qdtype(spelling) is qdtype(name)


def test_iinfo_repr():
    assert repr(iinfo(qarray.qint4)) == "iinfo(min=-8, max=7, dtype=qint4)"
    assert repr(iinfo("uint2")) == "iinfo(min=0, max=3, dtype=quint2)"


@pytest.mark.parametrize("bad", ["int3", "float32", np.float32, 8, None])
def test_unknown_dtype(bad):
    with pytest.raises(TypeError, match="unknown quantized dtype"):
        qdtype(bad)


def test_version_matches_metadata():
    from importlib.metadata import PackageNotFoundError, version

    try:
        assert qarray.__version__ == version("qarray")
    except PackageNotFoundError:
        pytest.skip("qarray is not installed")


def test_all_is_exported():
    for name in qarray.__all__:
        assert hasattr(qarray, name), name
