"""qarray.onnx's ``com.microsoft.MatMulNBits``: weights exported for onnxruntime
and models read back, with onnxruntime as the oracle (skipped without onnx and
onnxruntime; the tests of onnxruntime's own quantizer also need its ``onnx_ir``).

onnxruntime's dequantized weights are read exactly with ``A = I_K``: each output
``Y[m, n] = sum_k I[m, k] * w[n, k]`` is ``1 * w[n, m]`` plus zeros, exact in
float32 in any order. Such a sum cannot carry a zero's sign, so values are
compared bit for bit after ``+ 0.0`` (which makes ``-0.0`` ``+0.0``)."""

import doctest

import numpy as np
import pytest

import qarray
from qarray import QArray

from _reference import assert_same

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper, numpy_helper  # noqa: E402
from qarray import onnx as qonnx  # noqa: E402

BITS = {"qint2": 2, "quint2": 2, "qint4": 4, "quint4": 4, "qint8": 8, "quint8": 8}
# scales at float32's ends: the smallest subnormal, tiny, ordinary, and large (255 * 1e36 stays finite)
EXTREME_SCALES = np.float32([1.5e-45, 1e-30, 0.1, 0.375, 1e30, 1e36])


def _run(model, a):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in sess.get_inputs()]
    return sess.run(None, {name: a})[0]


def _ort_weights(model, k, dtype=np.float32):
    """onnxruntime's dequantized ``B`` ``[N, K]``, read with ``A = I_K``."""
    return _run(model, np.eye(k, dtype=dtype)).T


def _same_values(got, want):
    assert_same(np.asarray(got) + got.dtype.type(0), np.asarray(want) + want.dtype.type(0))


def _weights(rng, qd, n, k, axis, block_size, scales=EXTREME_SCALES):
    """Random weights ``[n, k]`` with codes and zero points at both ends of ``qd``'s range."""
    d = qarray.qdtype(qd)
    ps = qarray._params.param_shape((n, k), axis, block_size)
    s = rng.choice(scales, ps).astype(np.float32)
    z = rng.integers(d.qmin, d.qmax, ps, endpoint=True)
    z.reshape(-1)[:2] = [d.qmin, d.qmax][: z.size]
    codes = rng.integers(d.qmin, d.qmax, (n, k), endpoint=True)
    codes[0, :2] = [d.qmin, d.qmax]
    return QArray.from_int(codes, s, z, qd, axis=axis, block_size=block_size)


def _with(model, **arrays):
    """``model`` with initializers replaced or added (a new one also as the node's input of that name)."""
    inits = model.graph.initializer
    for name, a in arrays.items():
        t = numpy_helper.from_array(a, name)
        i = [j for j, old in enumerate(inits) if old.name == name]
        if i:
            inits[i[0]].CopyFrom(t)
        else:
            inits.append(t)
            node = model.graph.node[0]
            slot = ["A", "B", "scales", "zero_points", "g_idx", "bias"].index(name)
            node.input.extend([""] * (slot + 1 - len(node.input)))
            node.input[slot] = name
    return model


# -- export: qarray's weights as onnxruntime's -------------------------------------------------
# (K, axis, block_size): blocks along K, a short tail, one block over a short K,
# per-tensor and per-channel (written as blocks of 128, the scale repeated)
LAYOUTS = [(64, 1, 16), (40, 1, 32), (300, 1, 128), (256, 1, 256), (20, 1, 32), (200, None, None), (100, 0, None)]


@pytest.mark.parametrize("qd", BITS)
@pytest.mark.parametrize("k,axis,block_size", LAYOUTS)
def test_export_dequantizes_as_qarray(qd, k, axis, block_size, rng, tmp_path):
    """onnxruntime's ``(q - zp) * scale`` of the exported B, scales and zero
    points is qarray's ``dequantize()`` bit for bit; read back, the codes and
    zero points are qarray's plus ``2**(bits - 1)`` for signed types."""
    w = _weights(rng, qd, 5, k, axis, block_size)
    d = w.dtype
    p = qonnx.matmul_nbits_params(w)
    blocks = -(-k // p.block_size)
    assert (p.K, p.N, p.bits) == (k, 5, d.bits) and p.block_size in (16, 32, 128, 256)
    assert p.B.shape == (5, blocks, p.block_size * d.bits // 8) and p.B.dtype == np.uint8
    assert p.scales.shape == (5, blocks) and p.scales.dtype == np.float32
    assert p.zero_points.shape == (5, -(-blocks * d.bits // 8)) and p.zero_points.dtype == np.uint8
    model = qonnx.export_matmul_nbits(w, path=tmp_path / "w.onnx")
    _same_values(_ort_weights(model, k), w.dequantize())
    back = qonnx.load_matmul_nbits(tmp_path / "w.onnx")["matmul_nbits"]
    offset = 1 << (d.bits - 1) if d.signed else 0
    assert (back.dtype.name, back.axis, back.block_size) == (f"quint{d.bits}", 1, min(p.block_size, k))
    np.testing.assert_array_equal(back.int_repr(), w.int_repr().astype(int) + offset)
    full = (lambda q, a: np.broadcast_to(qarray._params.expand(a, q.shape, q.axis, q.block_size), q.shape))
    np.testing.assert_array_equal(full(back, back.zero_point), full(w, w.zero_point) + offset)
    assert_same(back.dequantize(), w.dequantize())


@pytest.mark.parametrize("qd", ["qint4", "qint8", "qint2"])
def test_export_symmetric_writes_no_zero_points(qd, rng):
    """Signed codes with zero point 0 are onnxruntime's default zero point ``2**(bits - 1)``:
    no zero_points input; the tail of K (40 = 32 + 8) is padded with it."""
    w = _weights(rng, qd, 3, 40, 1, 32)
    w = QArray.from_int(w.int_repr(), w.scale, 0, qd, axis=1, block_size=32)
    p = qonnx.matmul_nbits_params(w)
    assert p.zero_points is None
    model = qonnx.export_matmul_nbits(w)
    assert list(model.graph.node[0].input) == ["A", "B", "scales", ""]
    per = 8 // BITS[qd]
    tail = qarray.unpack(p.B[:, 1].reshape(-1), f"quint{BITS[qd]}", (3, 32))[:, 8:]
    assert (tail == 1 << (BITS[qd] - 1)).all() and p.B.shape == (3, 2, 32 // per)
    _same_values(_ort_weights(model, 40), w.dequantize())
    assert_same(qonnx.load_matmul_nbits(model)["matmul_nbits"].dequantize(), w.dequantize())


def test_export_packs_lowest_k_lowest_bits():
    """The worked layout: 4-bit code of k = 2i in byte i's low nibble, k = 2i + 1 in its high one;
    zero points packed the same way over the blocks."""
    codes = np.tile(np.arange(16), (2, 2))  # [2, 32]: two blocks of 16
    w = QArray.from_int(codes, [[0.5, 0.25], [1, 2]], [[0, 15], [8, 1]], "quint4", axis=1, block_size=16)
    p = qonnx.matmul_nbits_params(w)
    np.testing.assert_array_equal(p.B[0, 0], [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    np.testing.assert_array_equal(p.zero_points, [[0xF0], [0x18]])
    np.testing.assert_array_equal(p.scales, [[0.5, 0.25], [1, 2]])
    q8 = QArray.from_int(codes - 8, 1.0, 0, "qint8", axis=1, block_size=16)
    np.testing.assert_array_equal(qonnx.matmul_nbits_params(q8).B[0, 0], np.arange(16) + 120)


# qd, K, block_size, M: a K of 4096 (one row of A, and several: onnxruntime's two kernels),
# tails of 40 and 8 values, per-channel 8-bit weights
LINEARS = [("qint4", 4096, 32, 1), ("qint4", 4096, 32, 5), ("quint8", 1000, 64, 3), ("qint2", 520, 16, 9),
           ("quint4", 256, 128, 1), ("qint8", 300, None, 4)]


@pytest.mark.parametrize("accuracy_level", [0, 1])
@pytest.mark.parametrize("qd,k,block_size,m", LINEARS)
def test_export_linear_matches_float32_reference(qd, k, block_size, m, accuracy_level, rng):
    """onnxruntime's ``A @ dequant(B).T + bias`` against qarray's float32
    ``A @ w.dequantize().T + bias``. Both sum K + 1 float32 products in some
    order (onnxruntime in blocks, with FMA; NumPy's BLAS in another), and each
    is within ``gamma(K + 1) * sum |a| |w|`` (+ |bias|) of the exact value,
    ``gamma(n) = n u / (1 - n u)``, ``u = 2**-24`` (Higham, Accuracy and
    Stability, (3.5), whatever the order): so they differ by at most twice that."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    wf = rng.standard_normal((48, k)).astype(np.float32)
    w = (qarray.quantize_dynamic(wf, qd, axis=1, block_size=block_size) if block_size else
         qarray.quantize_dynamic(wf, qd, symmetric=True, axis=0))
    bias = rng.standard_normal(48).astype(np.float32)
    y = _run(qonnx.export_matmul_nbits(w, bias, accuracy_level=accuracy_level), a)
    v = w.dequantize()
    ref = a @ v.T + bias
    u = 2.0**-24
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    bound = 2 * gamma * (np.abs(a).astype(np.float64) @ np.abs(v).T.astype(np.float64) + np.abs(bias))
    assert y.dtype == np.float32 and y.shape == (m, 48)
    assert (np.abs(y.astype(np.float64) - ref) <= bound).all()


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("qd", ["qint4", "quint8", "qint2"])
def test_export_linear_exact_where_float32_is(qd, m, rng):
    """Integer activations, power-of-two scales and a bias of eighths: every
    product and partial sum is a multiple of 2**-3 below 2**21, exact in
    float32, so onnxruntime's result is the reference's in any order."""
    a = rng.integers(-4, 5, (m, 320)).astype(np.float32)
    w = _weights(rng, qd, 7, 320, 1, 64, scales=np.float32([0.125, 0.5, 1, 4]))
    bias = rng.integers(-800, 800, 7).astype(np.float32) / 8
    v = w.dequantize()
    assert (np.abs(a) @ np.abs(v).T + np.abs(bias)).max() < 2**21
    for level in (0, 1):
        assert_same(_run(qonnx.export_matmul_nbits(w, bias, accuracy_level=level), a), a @ v.T + bias)


# -- import: onnxruntime's weights as QArrays --------------------------------------------------
def _quantized_matmul(w, bits, block_size, symmetric):
    """A MatMul of constant weights ``w`` ``[K, N]`` through onnxruntime's own MatMulNBitsQuantizer."""
    mnq = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    k, n = w.shape
    elem = helper.np_dtype_to_tensor_dtype(w.dtype)
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="mm")], "mm",
                              [helper.make_tensor_value_info("A", elem, ["M", k])],
                              [helper.make_tensor_value_info("Y", elem, ["M", n])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    q = mnq.MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric)
    q.process()
    return q.model.model


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("k,block_size", [(64, 16), (96, 32), (300, 128), (40, 32), (20, 32)])
def test_load_onnxruntime_quantizer_model(k, block_size, bits, symmetric, rng):
    """onnxruntime's quantizer (MLAS: symmetric scales ``-m / 2**(bits - 1)``,
    negative where the block's largest magnitude is negative, and no zero
    points; asymmetric packed uint8 zero points; K zero-padded to whole
    blocks; scale 0 for a block of zeros) read back: the QArray's dequantize is
    onnxruntime's dequantized weight bit for bit."""
    wf = rng.standard_normal((k, 8)).astype(np.float32)
    wf[:, 0] = 0  # all blocks zero: scale 0
    wf[:16, 1] = 0  # one block zero
    wf[:, 2] = -3  # the codes at one end (symmetric: a negative scale, code 0)
    wf[:, 3] = 3
    wf[:, 4] *= 1e-30
    wf[:, 5] *= 1e30
    model = _quantized_matmul(wf, bits, block_size, symmetric)
    ins = list(model.graph.node[0].input)
    assert (ins[3:] == []) == symmetric  # symmetric: the default zero point
    ((name, w),) = qonnx.load_matmul_nbits(model).items()
    assert name == f"mm_Q{bits}" and w.shape == (8, k) and w.dtype.name == f"quint{bits}"
    assert (w.scale > 0).all()
    _same_values(w.dequantize(), _ort_weights(model, k))
    np.testing.assert_allclose(w.dequantize()[2:4].T, wf[:, 2:4])


@pytest.mark.parametrize("bits", [4, 8])
def test_load_float16_model(bits, rng):
    """A float16 model: its float16 scales widen exactly, and ``dequantize("float16")``
    is onnxruntime's float16 weight bit for bit."""
    wf = rng.standard_normal((100, 6)).astype(np.float16)
    model = _quantized_matmul(wf, bits, 32, False)
    w = qonnx.load_matmul_nbits(model)["mm_Q%d" % bits]
    _same_values(w.dequantize("float16"), _ort_weights(model, 100, np.float16))


def test_load_flips_negative_scales_and_clears_zero_ones():
    """Negative scales become positive with codes and zero point mirrored
    (``2**bits - 1 - x``); a zero scale becomes 1 with every code at its zero
    point; the tail's padding is dropped."""
    codes = np.tile([0, 15, 7, 8], (3, 10))  # [3, 40]: blocks of 32 and a tail of 8
    w = QArray.from_int(codes, 1.0, [[0, 15], [15, 0], [3, 9]], "quint4", axis=1, block_size=32)
    scales = np.float32([[-0.5, 0.25], [0, -0.0], [-1e-30, -3e30]])
    model = _with(qonnx.export_matmul_nbits(w), scales=scales)
    back = qonnx.load_matmul_nbits(model)["matmul_nbits"]
    np.testing.assert_array_equal(back.scale, np.float32([[0.5, 0.25], [1, 1], [1e-30, 3e30]]))
    np.testing.assert_array_equal(back.zero_point, [[15, 15], [15, 0], [12, 6]])
    np.testing.assert_array_equal(back.int_repr()[0, :4], [15, 0, 8, 7])  # the first block mirrored
    np.testing.assert_array_equal(back.int_repr()[0, 32:36], [0, 15, 7, 8])
    np.testing.assert_array_equal(back.int_repr()[1], np.r_[np.full(32, 15), np.zeros(8)])
    _same_values(back.dequantize(), _ort_weights(model, 40))
    zp, s = (np.float32(a).repeat(32, 1)[:, :40] for a in ([[0, 15], [15, 0], [3, 9]], scales))
    _same_values(back.dequantize(), (codes.astype(np.float32) - zp) * s)  # onnxruntime's (q - zp) * scale


def test_load_reads_one_dimensional_scales_and_zero_points(rng):
    """Older onnxruntime quantizers write scales and zero points flat; onnxruntime reads both."""
    w = _weights(rng, "quint4", 4, 96, 1, 32)
    model = qonnx.export_matmul_nbits(w)
    p = qonnx.matmul_nbits_params(w)
    model = _with(model, scales=p.scales.reshape(-1), zero_points=p.zero_points.reshape(-1))
    _same_values(_ort_weights(model, 96), w.dequantize())
    assert_same(qonnx.load_matmul_nbits(model)["matmul_nbits"], w)


def test_matmul_nbits_qarray_round_trip(rng):
    """matmul_nbits_qarray undoes matmul_nbits_params (quint weights come back as they were)."""
    w = _weights(rng, "quint2", 3, 80, 1, 16)
    assert_same(qonnx.matmul_nbits_qarray(qonnx.matmul_nbits_params(w)), w)


# -- errors ------------------------------------------------------------------------------------
def _q(qd="qint4", shape=(4, 64), axis=1, block_size=16):
    return QArray.from_int(np.zeros(shape, np.int8), np.ones(qarray._params.param_shape(shape, axis, block_size)),
                           0, qd, axis=axis, block_size=block_size)


EXPORT_ERRORS = [
    (lambda: qonnx.matmul_nbits_params(np.zeros((4, 64))), TypeError,
     "matmul_nbits_params takes a QArray, got ndarray"),
    (lambda: qonnx.matmul_nbits_params(_q("qint16")), TypeError,
     "matmul_nbits_params: MatMulNBits takes 2, 4 or 8-bit integer codes, not qint16; requantize or quantize to "
     "qint4, quint4, qint8, ... first"),
    (lambda: qonnx.matmul_nbits_params(qarray.quantize(np.ones((2, 32), np.float32), dtype="Q4_0")), TypeError,
     "matmul_nbits_params: MatMulNBits takes 2, 4 or 8-bit integer codes, not Q4_0; requantize or quantize to "
     "qint4, quint4, qint8, ... first"),
    (lambda: qonnx.matmul_nbits_params(_q(shape=(2, 4, 64), axis=2)), ValueError,
     "matmul_nbits_params: w must be 2-D weights [N, K] (out_features, in_features), got shape (2, 4, 64)"),
    (lambda: qonnx.matmul_nbits_params(_q(shape=(0, 64))), ValueError,
     "matmul_nbits_params: w must be 2-D weights [N, K] (out_features, in_features), got shape (0, 64)"),
    (lambda: qonnx.matmul_nbits_params(_q(axis=0, block_size=2)), ValueError,
     "matmul_nbits_params: w has per_block_affine parameters along axis 0; MatMulNBits has one scale per block of "
     "K (axis 1) and output row: quantize w [N, K] per-tensor, per-channel along axis 0, or with axis=1 and a "
     "block_size"),
    (lambda: qonnx.matmul_nbits_params(_q(axis=1, block_size=None)), ValueError,
     "matmul_nbits_params: w has per_channel_affine parameters along axis 1; MatMulNBits has one scale per block "
     "of K (axis 1) and output row: quantize w [N, K] per-tensor, per-channel along axis 0, or with axis=1 and a "
     "block_size"),
    (lambda: qonnx.matmul_nbits_params(_q(block_size=24)), ValueError,
     "matmul_nbits_params: block_size 24; MatMulNBits takes blocks of a power of two >= 16 along K: requantize "
     "with block_size=16, 32, 64, 128, ..."),
    (lambda: qonnx.matmul_nbits_params(_q(block_size=8)), ValueError,
     "matmul_nbits_params: block_size 8; MatMulNBits takes blocks of a power of two >= 16 along K: requantize "
     "with block_size=16, 32, 64, 128, ..."),
    (lambda: qonnx.export_matmul_nbits(_q(), np.ones(3, np.float32)), ValueError,
     "export_matmul_nbits: bias must be float [N] = [4], got float32 (3,)"),
    (lambda: qonnx.export_matmul_nbits(_q(), np.ones(4, np.int64)), ValueError,
     "export_matmul_nbits: bias must be float [N] = [4], got int64 (4,)"),
]


@pytest.mark.parametrize("call,exc,message", EXPORT_ERRORS, ids=range(len(EXPORT_ERRORS)))
def test_export_errors(call, exc, message):
    with pytest.raises(exc) as e:
        call()
    assert str(e.value) == message


def _model():
    """A 4-bit model, K=64, N=4, blocks of 16, with zero points."""
    return qonnx.export_matmul_nbits(QArray.from_int(np.zeros((4, 64), np.uint8), 1.0, 3, "quint4", axis=1,
                                                     block_size=16))


def _set_attr(model, name, value):
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + ([helper.make_attribute(name, value)] if value is not None else []))
    return model


def _not_initializer():
    model = _model()
    del model.graph.initializer[1]  # scales
    return model


NODE = "load_matmul_nbits: node 'matmul_nbits': "
LOAD_ERRORS = [
    (lambda: helper.make_model(helper.make_graph([], "g", [], [])), ValueError,
     "load_matmul_nbits: the model's graph has no com.microsoft MatMulNBits node"),
    (lambda: _with(_model(), g_idx=np.arange(64, dtype=np.int32) // 16), ValueError,
     NODE[:-2] + " has a g_idx input (act-order); qarray reads MatMulNBits weights without one"),
    (lambda: _with(_model(), zero_points=np.full((4, 4), 3, np.float32)), TypeError,
     NODE + "zero_points are float32; qarray reads packed uint8 zero points (float ones dequantize as q * scale - "
     "scale * zero_point, which no QArray holds)"),
    (lambda: _with(_model(), B=np.zeros((4, 4, 8), np.int8)), TypeError,
     NODE + "B is int8; MatMulNBits codes are uint8"),
    (lambda: _with(_model(), scales=np.ones((4, 4), np.float64)), TypeError,
     NODE + "scales are float64; qarray reads float32 or float16 scales"),
    (lambda: _with(_model(), scales=np.full((4, 4), np.nan, np.float32)), ValueError,
     NODE + f"scale must be finite and > 0 in float32; got {np.float32(np.nan)!r} (16 bad value(s))"),
    (lambda: _with(_model(), B=np.zeros(128, np.uint8)), ValueError,
     NODE + "B has shape [128]; K=64, N=4, bits=4 and block_size=16 make it [4, 4, 8]"),
    (lambda: _with(_model(), scales=np.ones((4, 3), np.float32)), ValueError,
     NODE + "scales has shape [4, 3]; K=64, N=4, bits=4 and block_size=16 make it [4, 4]"),
    (lambda: _with(_model(), zero_points=np.ones((4, 4), np.uint8)), ValueError,
     NODE + "zero_points has shape [4, 4]; K=64, N=4, bits=4 and block_size=16 make it [4, 2]"),
    (lambda: _set_attr(_model(), "bits", 3), ValueError,
     NODE + "bits=3; onnxruntime's MatMulNBits takes 2, 4 or 8"),
    (lambda: _set_attr(_model(), "block_size", 24), ValueError,
     NODE + "block_size=24; onnxruntime's MatMulNBits takes a power of two >= 16"),
    (lambda: _set_attr(_model(), "block_size", None), ValueError,
     NODE[:-2] + " lacks the attribute(s) block_size"),
    (_not_initializer, ValueError,
     "load_matmul_nbits: input 'scales' of node 'matmul_nbits' is not an initializer of the graph"),
]


@pytest.mark.parametrize("make,exc,message", LOAD_ERRORS, ids=range(len(LOAD_ERRORS)))
def test_load_errors(make, exc, message):
    with pytest.raises(exc) as e:
        qonnx.load_matmul_nbits(make())
    assert str(e.value) == message


def test_matmul_nbits_qarray_names_itself():
    p = qonnx.matmul_nbits_params(_q())._replace(bits=3)
    with pytest.raises(ValueError) as e:
        qonnx.matmul_nbits_qarray(p)
    assert str(e.value) == "matmul_nbits_qarray: bits=3; onnxruntime's MatMulNBits takes 2, 4 or 8"


def test_default_bits_is_four():
    """A node without ``bits`` is 4-bit (the attribute's default)."""
    w = _weights(np.random.default_rng(0), "qint4", 4, 64, 1, 16)
    model = _set_attr(qonnx.export_matmul_nbits(w), "bits", None)
    _same_values(qonnx.load_matmul_nbits(model)["matmul_nbits"].dequantize(), w.dequantize())


def test_docstring_examples():
    result = doctest.testmod(qonnx, extraglobs={"numpy": np, "qarray": qarray},
                             optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
