"""QArrays and other frameworks: PyTorch quantized tensors both ways, DLPack,
and ONNX QDQ parameters and models run by onnxruntime (each skipped where the
framework is not installed)."""

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray._params import param_shape

from _reference import assert_same

# PyTorch deprecates its own quantized tensors (a warning from torch, not qarray)
pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


# -- PyTorch quantized tensors ---------------------------------------------------------------
@pytest.mark.parametrize("tdtype,qd", [("quint8", "quint8"), ("qint8", "qint8"), ("qint32", "qint32"),
                                       ("quint4x2", "quint4")])
def test_from_torch_per_tensor_and_back(torch, tdtype, qd, rng):
    x = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32) * 4)
    d = qarray.qdtype(qd)
    for zp in (d.qmin, d.qmax, (d.qmin + d.qmax) // 2):
        t = torch.quantize_per_tensor(x, 0.0625, zp, getattr(torch, tdtype))
        q = qarray.from_torch(t)
        assert q.dtype is d and q.axis is None and q.scale == np.float32(0.0625) and q.zero_point == zp
        want = t.int_repr().numpy() if not d.packed else None
        if want is not None:
            np.testing.assert_array_equal(q.int_repr(), want)
        np.testing.assert_array_equal(q.dequantize(), t.dequantize().numpy())
        back = q.to_torch()
        assert back.dtype == t.dtype and back.q_scale() == t.q_scale() and back.q_zero_point() == t.q_zero_point()
        assert torch.equal(back.int_repr(), t.int_repr())
        assert_same(qarray.from_torch(back), q)


@pytest.mark.parametrize("qd", ["qint8", "quint8", "qint32"])
@pytest.mark.parametrize("axis", [0, 1])
def test_per_channel_round_trip(torch, qd, axis, rng):
    d = qarray.qdtype(qd)
    x = rng.standard_normal((4, 6)).astype(np.float32) * 3
    n = x.shape[axis]
    q = qarray.quantize(x, rng.uniform(0.01, 0.2, n).astype(np.float32),
                        np.linspace(d.qmin, min(d.qmax, d.qmin + 300), n).astype(np.int32), qd, axis=axis)
    t = q.to_torch()
    assert t.qscheme() == torch.per_channel_affine and t.q_per_channel_axis() == axis
    np.testing.assert_array_equal(t.int_repr().numpy(), q.int_repr())
    np.testing.assert_array_equal(t.q_per_channel_scales().numpy(), q.scale.astype(np.float64))
    assert_same(qarray.from_torch(t), q)


def test_torch_interop_errors(torch, rng):
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="takes a quantized torch.Tensor, got Tensor of dtype torch.float32"):
        qarray.from_torch(x)
    with pytest.raises(TypeError, match="takes a quantized torch.Tensor, got ndarray"):
        qarray.from_torch(np.zeros(3))
    t = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)  # 0.1 is a double, not a float32 value
    with pytest.raises(ValueError, match="a scale is not a float32 value"):
        qarray.from_torch(t)
    q = qarray.quantize(rng.standard_normal(8).astype(np.float32), 0.1, 0, "qint4")
    with pytest.raises(TypeError, match="PyTorch has no quantized dtype for qint4"):
        q.to_torch()
    qb = qarray.quantize(rng.standard_normal((2, 8)).astype(np.float32), 0.1, 0, "qint8", axis=1, block_size=4)
    with pytest.raises(TypeError, match="no blocked quantization"):
        qb.to_torch()


# -- DLPack ----------------------------------------------------------------------------
def test_dlpack_arrays_go_into_quantize_and_from_int(torch, rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    assert_same(qarray.quantize(torch.from_numpy(x), 0.05, 1, "qint8"), qarray.quantize(x, 0.05, 1, "qint8"))
    ints = torch.tensor([[-128, 0, 127]], dtype=torch.int8)
    assert_same(QArray.from_int(ints, 0.5, 0, "qint8"), QArray.from_int(ints.numpy(), 0.5, 0, "qint8"))
    with pytest.raises(ValueError, match="outside the range"):
        QArray.from_int(torch.tensor([300]), 0.5, 0, "qint8")
    with pytest.raises(TypeError, match=r"quantize: could not take the torch.Tensor through DLPack .*t.detach\(\)"):
        qarray.quantize(torch.ones(3, requires_grad=True), 0.1, 0, "qint8")


def test_data_moves_out_without_a_copy_and_a_qarray_is_not_one_tensor(torch, rng):
    q = qarray.quantize(rng.standard_normal(6).astype(np.float32), 0.1, 0, "qint8")
    t = torch.from_dlpack(q.data)
    assert t.data_ptr() == q.data.ctypes.data  # the same memory
    np.testing.assert_array_equal(t.numpy(), q.int_repr())
    with pytest.raises(TypeError, match=r"not one DLPack tensor: pass q.data"):
        np.from_dlpack(q)
    with pytest.raises(TypeError, match=r"not one DLPack tensor"):
        q.__dlpack__()
    assert not hasattr(q, "__dlpack__")  # code that probes for DLPack moves on
    # PyTorch takes no __array__ from objects that are not ndarrays: the values go through NumPy
    np.testing.assert_array_equal(torch.as_tensor(np.asarray(q)).numpy(), q.dequantize())
    np.testing.assert_array_equal(torch.as_tensor(np.asarray(q[0])).numpy(), q.dequantize()[0])


# -- ONNX QDQ --------------------------------------------------------------------------------
LAYOUTS = [("qint8", None, None), ("quint8", None, None), ("qint16", None, None), ("quint16", None, None),
           ("qint4", None, None), ("quint4", None, None), ("qint8", 0, None), ("quint8", 1, None),
           ("qint4", 1, 32), ("quint8", 1, 16), ("qint16", 0, 3)]


@pytest.mark.parametrize("qd,axis,block_size", LAYOUTS)
def test_export_qdq_runs_in_onnxruntime_with_qarrays_integers(qd, axis, block_size, rng, tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from qarray import onnx as qonnx

    d = qarray.qdtype(qd)
    x = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
    x[0, :6] = [0.125, -0.375, 1e9, -1e9, 2.5, -2.5]  # ties and saturation
    ps = param_shape(x.shape, axis, block_size)
    s = rng.choice(np.float32([0.25, 0.5, 0.1, 0.03]), ps).astype(np.float32)
    z = rng.integers(d.qmin, d.qmax, ps, endpoint=True).astype(np.int32)
    z.reshape(-1)[: min(2, z.size)] = [d.qmin, d.qmax][: min(2, z.size)]  # zero points at both ends
    q = qarray.quantize(x, s, z, qd, axis=axis, block_size=block_size)
    p = qonnx.qdq_params(q)
    assert (p.axis, p.block_size) == (axis, block_size) and p.scale.dtype == np.float32
    np.testing.assert_array_equal(p.zero_point, z)
    assert p.zero_point.dtype == d.storage
    path = tmp_path / "qdq.onnx"
    qonnx.export_qdq(q, path)
    sess = ort.InferenceSession(str(path))
    if d.bits == 4:  # onnxruntime cannot hand int4 outputs to NumPy: the values pin the codes down
        (values,) = sess.run(["values"], {"x": x})
    else:
        codes, values = sess.run(["codes", "values"], {"x": x})
        assert codes.dtype == d.storage
        np.testing.assert_array_equal(codes, q.int_repr())
    np.testing.assert_array_equal(values, q.dequantize())


def test_qdq_refuses_types_quantizelinear_lacks(rng):
    from qarray import onnx as qonnx

    for qd in ("qint2", "quint2", "qint32"):
        q = QArray.from_int(np.zeros(4, np.int8 if qd != "qint32" else np.int32), 0.1, 0, qd)
        with pytest.raises(TypeError, match=f"has no {qd} output"):
            qonnx.qdq_params(q)
    with pytest.raises(TypeError, match="takes a QArray"):
        qonnx.qdq_params(np.zeros(3))


def test_torch_as_tensor_of_a_qarray_says_what_to_call():
    """torch.as_tensor walks a QArray as a sequence down to its 0-d elements, whose
    len() fails: the error says what to call (it said only "len() of a 0-d QArray")."""
    torch = pytest.importorskip("torch")
    for q in (qarray.quantize(np.float32(0.5), 0.1, 0, "qint8"), qarray.quantize(np.ones(3, np.float32), 0.1, 0, "qint8")):
        with pytest.raises(TypeError, match=r"^len\(\) of a 0-d QArray; for its value use float\(q\) or q\.item\(\), "
                                            r"and for an array or tensor convert the dequantized values: "
                                            r"torch\.as_tensor\(q\.dequantize\(\)\), or q\.to_torch\(\) for a PyTorch "
                                            r"quantized tensor$"):
            torch.as_tensor(q)
        np.testing.assert_array_equal(torch.as_tensor(q.dequantize()).numpy(), q.dequantize())
