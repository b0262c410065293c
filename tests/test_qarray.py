import pickle

import numpy as np
import pytest

import qarray
from qarray import QArray

from _reference import assert_same


@pytest.fixture
def q3(rng):
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)
    return qarray.quantize(x, 0.05, 3, "qint8")


@pytest.fixture
def qaxis(rng):
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)
    return qarray.quantize(x, np.linspace(0.01, 0.06, 6, dtype=np.float32), np.arange(6) - 3, "qint8", axis=1)


@pytest.fixture
def qblock(rng):
    x = rng.standard_normal((4, 10)).astype(np.float32)
    return qarray.quantize_dynamic(x, "qint4", axis=1, block_size=4)


def test_direct_construction_refused():
    with pytest.raises(TypeError, match=r"use qarray.quantize\(x, scale, zero_point, dtype\).*QArray.from_int"):
        QArray(np.zeros(3), 1.0)


def test_attributes(q3, qaxis, qblock):
    assert (q3.shape, q3.ndim, q3.size, q3.dtype, q3.axis, q3.block_size) == ((4, 6, 8), 3, 192, qarray.qint8, None, None)
    assert q3.qscheme == "per_tensor_affine" and q3.backend == "numpy"
    assert q3.scale.dtype == np.float32 and q3.scale.shape == () and q3.zero_point.dtype == np.int32
    assert qaxis.qscheme == "per_channel_affine" and qaxis.scale.shape == (6,)
    assert qblock.qscheme == "per_block_affine" and qblock.scale.shape == (4, 3)
    assert len(q3) == 4
    with pytest.raises(TypeError, match="len"):
        len(qarray.quantize(1.0, 1.0))


def test_repr():
    q = qarray.quantize(np.array([-1.0, 0.0, 0.5], np.float32), 0.5, 0, "qint8")
    assert repr(q) == (
        "QArray([-1. ,  0. ,  0.5],\n"
        "       dtype=qint8, scale=0.5, zero_point=0,\n"
        "       qscheme=per_tensor_affine, backend=numpy)"
    )
    q = qarray.quantize(np.ones((2, 2), np.float32), [0.5, 0.25], [0, 1], "quint8", axis=0)
    assert "scale=[0.5 , 0.25], zero_point=[0, 1], axis=0," in repr(q)
    assert "qscheme=per_channel_affine" in repr(q)


def test_array_protocol_and_int_repr(q3):
    np.testing.assert_array_equal(np.asarray(q3), q3.dequantize())
    assert np.asarray(q3).dtype == np.float32
    r = q3.int_repr()
    r[...] = 0
    assert q3.data.any()  # int_repr is a copy


def test_pickle(qaxis, qblock):
    for q in (qaxis, qblock):
        assert_same(pickle.loads(pickle.dumps(q)), q)


def test_indexing_per_tensor(q3):
    s = q3[1:3, ..., ::2]
    np.testing.assert_array_equal(s.int_repr(), q3.int_repr()[1:3, ..., ::2])
    assert s.scale == q3.scale
    assert q3[None, 0].shape == (1, 6, 8)


def test_indexing_per_axis(qaxis):
    s = qaxis[:, 1:5:2]
    np.testing.assert_array_equal(s.scale, qaxis.scale[1:5:2])
    np.testing.assert_array_equal(s.zero_point, qaxis.zero_point[1:5:2])
    assert s.axis == 1
    np.testing.assert_array_equal(s.dequantize(), qaxis.dequantize()[:, 1:5:2])
    t = qaxis[2, :, 0]
    assert t.axis == 0 and t.shape == (6,)
    np.testing.assert_array_equal(t.dequantize(), qaxis.dequantize()[2, :, 0])
    u = qaxis[:, -2]  # integer on the axis: per-tensor
    assert u.axis is None and u.scale == qaxis.scale[-2]
    np.testing.assert_array_equal(u.dequantize(), qaxis.dequantize()[:, -2])
    v = qaxis[None, ..., 3]
    assert v.axis == 2 and v.shape == (1, 4, 6)


def test_indexing_blocked(qblock):
    s = qblock[1:3, 4:10]
    assert s.axis == 1 and s.block_size == 4 and s.scale.shape == (2, 2)
    np.testing.assert_array_equal(s.dequantize(), qblock.dequantize()[1:3, 4:10])
    t = qblock[:, 5]
    assert (t.axis, t.block_size) == (0, 1)
    np.testing.assert_array_equal(t.dequantize(), qblock.dequantize()[:, 5])
    with pytest.raises(ValueError, match="the slice 2:10:1 cuts the blocks of size 4 along axis 1"):
        qblock[:, 2:]
    with pytest.raises(ValueError, match="cuts the blocks"):
        qblock[:, ::2]


def test_indexing_errors(q3):
    with pytest.raises(TypeError, match="basic indexing only"):
        q3[np.array([0, 1])]
    with pytest.raises(IndexError, match="too many indices"):
        q3[0, 0, 0, 0]
    with pytest.raises(IndexError):
        q3[10]


def test_reshape(qaxis, qblock, q3):
    r = qaxis.reshape(2, 2, 6, 8)
    assert r.axis == 2
    np.testing.assert_array_equal(r.dequantize(), qaxis.dequantize().reshape(2, 2, 6, 8))
    r = qaxis.reshape((4, 6, 2, 4))
    assert r.axis == 1
    assert q3.reshape(-1).shape == (192,)
    with pytest.raises(ValueError, match=r"cannot reshape \(4, 6, 8\) to \(24, 8\): the parameter axis 1"):
        qaxis.reshape(24, 8)
    b = qblock.reshape(2, 2, 10)
    assert b.axis == 2 and b.scale.shape == (2, 2, 3)
    np.testing.assert_array_equal(b.dequantize(), qblock.dequantize().reshape(2, 2, 10))


def test_transpose(qaxis, qblock):
    t = qaxis.transpose(2, 0, 1)
    assert t.axis == 2 and t.shape == (8, 4, 6)
    np.testing.assert_array_equal(t.dequantize(), qaxis.dequantize().transpose(2, 0, 1))
    b = qblock.T
    assert b.axis == 0 and b.scale.shape == (3, 4)
    np.testing.assert_array_equal(b.dequantize(), qblock.dequantize().T)
    with pytest.raises(ValueError, match="not a permutation"):
        qaxis.transpose(0, 0, 1)


@pytest.mark.parametrize(
    "ints,dtype,exc,message",
    [(np.array([8]), "qint4", ValueError, r"values span \[8, 8\], outside the range \[-8, 7\] of qint4"),
     (np.array([-1, 3]), "quint2", ValueError, r"outside the range \[0, 3\] of quint2"),
     (np.array([0.5]), "qint8", TypeError, "from_int takes integer data, got dtype float64"),
     (np.array([2**31], np.int64), "qint32", ValueError, "outside the range")],
)
def test_from_int_errors(ints, dtype, exc, message):
    with pytest.raises(exc, match=message):
        QArray.from_int(ints, 1.0, 0, dtype)


def test_from_int_per_axis():
    q = QArray.from_int(np.array([[1, 2], [3, 4]], np.int64), [1.0, 0.5], [0, 1], "qint8", axis=0)
    assert q.data.dtype == np.int8
    np.testing.assert_array_equal(q.dequantize(), [[1, 2], [1, 1.5]])


@pytest.mark.parametrize("dtype", ["qint2", "quint2", "qint4", "quint4"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9])
def test_pack_unpack(dtype, n):
    d = qarray.qdtype(dtype)
    codes = (np.arange(n) % (d.qmax - d.qmin + 1) + d.qmin).astype(d.storage)
    q = QArray.from_int(codes, 1.0, 0, dtype)
    p = q.pack()
    assert p.dtype == np.uint8 and p.size == -(-n * d.bits // 8)
    np.testing.assert_array_equal(qarray.unpack(p, dtype, (n,)), codes)


def test_pack_layout_first_element_low_bits():
    q = QArray.from_int(np.array([1, -2, 7]), 1.0, 0, "qint4")
    assert q.pack().tolist() == [0xE1, 0x07]
    q = QArray.from_int(np.array([1, 2, 3, 0, 3]), 1.0, 0, "quint2")
    assert q.pack().tolist() == [0b00111001, 0b11]
    q8 = QArray.from_int(np.array([[1, -2]]), 1.0, 0, "qint8")
    assert q8.pack().tolist() == [1, -2]


def test_unpack_errors():
    with pytest.raises(ValueError, match="3 qint4 values need 2 items, got 3"):
        qarray.unpack(np.zeros(3, np.uint8), "qint4", (3,))
    with pytest.raises(TypeError, match="qint4 data comes as uint8, got int8"):
        qarray.unpack(np.zeros(2, np.int8), "qint4", (3,))


def test_to_numpy_is_identity_and_cupy_errors_clearly(q3, monkeypatch):
    assert q3.to("numpy") is q3 and q3.get() is q3
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        q3.to("jax")
    import sys

    if "cupy" not in sys.modules:
        monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
        qarray.backends._by_name.pop("cupy", None)
        with pytest.raises(ImportError, match=r"the cupy backend needs CuPy: pip install 'qarray\[cuda12\]'"):
            q3.to("cupy")


def test_from_int_masked_refused_and_byte_order_converted(kernels):
    with pytest.raises(TypeError, match=r"from_int does not take masked arrays .* e\.g\. x\.filled\(0\)"):
        QArray.from_int(np.ma.array([1, 1000], mask=[False, True]), 1.0, 0, "qint8")
    ints = (np.arange(20000) % 200 - 100).astype(">i2")
    q = QArray.from_int(ints, 1.0, 0, "qint16")
    assert q.data.dtype == np.int16 and q.data.dtype.isnative
    np.testing.assert_array_equal(q.requantize(2.0, 0, "qint8").int_repr(), np.rint((np.arange(20000) % 200 - 100) / 2))


def test_unpack_shape_checked():
    with pytest.raises(ValueError, match=r"unpack: shape must hold non-negative integers, got \(-1,\)"):
        qarray.unpack(np.zeros(1, np.uint8), "qint4", (-1,))
    with pytest.raises(TypeError, match=r"unpack: shape must hold integers, got \(2\.5,\)"):
        qarray.unpack(np.zeros(2, np.uint8), "qint4", (2.5,))
    with pytest.raises(ValueError, match="unpack: 18446744073709551616 qint8 values need 18446744073709551616 items, got 2"):
        qarray.unpack(np.zeros(2, np.int8), "qint8", (2**33, 2**31))
    assert qarray.unpack(np.array([0x21], np.uint8), "quint4", np.int64(2)).tolist() == [1, 2]


def _full_repr_body(q):
    """The values' text as repr printed them before: the whole array dequantized."""
    return np.array2string(q.dequantize(), separator=", ", prefix="QArray(")


@pytest.mark.parametrize("shape,axis,block_size", [((1000, 1000), None, None), ((3000,), 0, None), ((7, 1001), 1, None),
                                                   ((40, 50, 3), 0, 7), ((2, 1, 1500), 2, 64), ((1001, 1), None, None)])
def test_repr_of_a_big_array_dequantizes_only_what_it_prints(shape, axis, block_size, rng, monkeypatch):
    from qarray._params import param_shape

    ps = param_shape(shape, axis, block_size)
    q = qarray.quantize(rng.standard_normal(shape).astype(np.float32), rng.uniform(0.01, 0.1, ps).astype(np.float32),
                        rng.integers(-5, 5, ps), "qint8", axis, block_size)
    want = _full_repr_body(q)
    b = q._backend
    sizes = []
    original = type(b).dequantize

    def recording(self, data, *args):
        sizes.append(data.size)
        return original(self, data, *args)

    monkeypatch.setattr(type(b), "dequantize", recording)
    text = repr(q)
    assert text.startswith("QArray(" + want + ",\n") and "..." in text
    e = np.get_printoptions()["edgeitems"]
    assert sizes and max(sizes) <= (2 * e + 1) ** len(shape)
    with np.printoptions(threshold=q.size):  # below the threshold: everything, as NumPy prints it
        sizes.clear()
        assert repr(q).startswith("QArray(" + _full_repr_body(q) + ",\n")
        assert sizes[0] == q.size
    with np.printoptions(edgeitems=1, threshold=5, linewidth=50, precision=3):
        assert repr(q).startswith("QArray(" + _full_repr_body(q) + ",\n")
