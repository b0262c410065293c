import math

import numpy as np
import pytest

import qarray
from qarray import QArray
import qarray as L  # every LUT op is exported at the top level
from _reference import all_codes


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


REFS = {
    "sigmoid": _sigmoid,
    "tanh": math.tanh,
    "hardswish": lambda x: x * min(max(x + 3.0, 0.0), 6.0) / 6.0,
    "gelu": lambda x: 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))),
    "silu": lambda x: x / (1.0 + math.exp(-x)),
    "exp": math.exp,
    "elu": lambda x: x if x > 0 else math.expm1(x),
    "leaky_relu": lambda x: x if x >= 0 else 0.01 * x,
}


def reference(codes, s_in, z_in, fn, s_out, z_out, d):
    """Independent float64 reference, one Python float at a time."""
    d = qarray.qdtype(d)
    out = []
    for c in codes.reshape(-1).tolist():
        y = fn((c - int(z_in)) * float(np.float32(s_in)))
        v = y / float(np.float32(s_out))
        r = (d.qmax if v > 0 else d.qmin) if math.isinf(v) else round(v) + int(z_out)
        out.append(min(max(r, d.qmin), d.qmax))
    return np.array(out, np.int64).reshape(codes.shape)


CASES = [("qint8", 0.05, 3), ("quint8", 0.04, 128), ("qint4", 0.5, -1), ("quint4", 0.3, 7), ("qint2", 1.5, 0)]


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("din,s_in,z_in", CASES)
def test_activation_exhaustive(backend, name, din, s_in, z_in):
    q = all_codes(din, s_in, z_in)
    s_out, z_out, dout = 0.03, -5, "qint8"
    got = backend.run(getattr(L, name), q, scale=s_out, zero_point=z_out, dtype=dout)
    assert backend.ran("lut_uint8_uint8"), backend.launched
    assert got.dtype is qarray.qint8 and got.qscheme == "per_tensor_affine"
    assert float(got.scale) == np.float32(s_out) and int(got.zero_point) == z_out
    want = reference(q.int_repr(), s_in, z_in, REFS[name], s_out, z_out, dout)
    np.testing.assert_array_equal(got.int_repr().astype(np.int64), want)


@pytest.mark.parametrize("name", ["hardswish", "gelu", "silu", "exp", "elu", "leaky_relu"])
@pytest.mark.parametrize("din,s_in,z_in", CASES[:3])
def test_activation_default_keeps_input_params(kernels, name, din, s_in, z_in):
    q = all_codes(din, s_in, z_in)
    got = getattr(L, name)(q)
    assert got.dtype is q.dtype and float(got.scale) == float(q.scale) and int(got.zero_point) == z_in
    want = reference(q.int_repr(), s_in, z_in, REFS[name], s_in, z_in, din)
    np.testing.assert_array_equal(got.int_repr().astype(np.int64), want)


@pytest.mark.parametrize("din,s_in,z_in", CASES)
def test_sigmoid_tanh_defaults(kernels, din, s_in, z_in):
    q = all_codes(din, s_in, z_in)
    sg, th = L.sigmoid(q), L.tanh(q)
    assert sg.dtype is qarray.quint8 and float(sg.scale) == 1 / 256 and int(sg.zero_point) == 0
    assert th.dtype is qarray.qint8 and float(th.scale) == 1 / 128 and int(th.zero_point) == 0
    np.testing.assert_array_equal(sg.int_repr(), reference(q.int_repr(), s_in, z_in, _sigmoid, 1 / 256, 0, "quint8"))
    np.testing.assert_array_equal(th.int_repr(), reference(q.int_repr(), s_in, z_in, math.tanh, 1 / 128, 0, "qint8"))
    # any other output params work (PyTorch's QNNPACK sigmoid insists on 1/256)
    other = L.sigmoid(q, scale=0.01, dtype="qint8")
    np.testing.assert_array_equal(other.int_repr(), reference(q.int_repr(), s_in, z_in, _sigmoid, 0.01, 0, "qint8"))


def test_elu_alpha_and_leaky_slope():
    q = all_codes("qint8", 0.05, 0)
    got = L.elu(q, alpha=0.5)
    want = reference(q.int_repr(), 0.05, 0, lambda x: x if x > 0 else 0.5 * math.expm1(x), 0.05, 0, "qint8")
    np.testing.assert_array_equal(got.int_repr(), want)
    got = L.leaky_relu(q, negative_slope=0.2)
    want = reference(q.int_repr(), 0.05, 0, lambda x: x if x >= 0 else 0.2 * x, 0.05, 0, "qint8")
    np.testing.assert_array_equal(got.int_repr(), want)


def test_activation_tables_are_kept_per_parameter():
    """The activations keep their tables (qarray._params.kept, keyed by the
    function's code and closure): another slope or alpha, input scale or output
    is another table, and a user's fn in lut() is never kept."""
    q = all_codes("qint8", 0.05, 0)
    for slope in (0.2, 0.5, 0.2):
        want = reference(q.int_repr(), 0.05, 0, lambda x: x if x >= 0 else slope * x, 0.05, 0, "qint8")
        np.testing.assert_array_equal(L.leaky_relu(q, negative_slope=slope).int_repr(), want)
    q2 = all_codes("qint8", 0.1, 3)
    want = reference(q2.int_repr(), 0.1, 3, lambda x: x if x >= 0 else 0.5 * x, 0.05, 0, "qint8")
    np.testing.assert_array_equal(L.leaky_relu(q2, negative_slope=0.5, scale=0.05, zero_point=0).int_repr(), want)
    state = [1.0]

    def stateful(x):  # reads state that changes between calls: its table is made each call
        return x * state[0]

    first = L.lut(q, stateful, scale=0.05).int_repr()
    state[0] = -1.0
    want = np.clip(-first.astype(np.int64), -128, 127)
    np.testing.assert_array_equal(L.lut(q, stateful, scale=0.05).int_repr(), want)


@pytest.mark.parametrize("din", ["qint16", "quint16"])
def test_16_bit_input(backend, din, rng):
    d = qarray.qdtype(din)
    codes = rng.integers(d.qmin, d.qmax + 1, size=(7, 300))
    z_in = 100 if d.signed else 30000
    q = QArray.from_int(codes, 0.001, z_in, d)
    got = backend.run(L.tanh, q, scale=1 / 32768, dtype="qint16")
    assert backend.ran("lut_uint16_uint16"), backend.launched
    want = reference(codes, 0.001, z_in, math.tanh, 1 / 32768, 0, "qint16")
    np.testing.assert_array_equal(got.int_repr().astype(np.int64), want)
    assert got.int_repr().dtype == np.int16


def test_per_axis_input_one_table_per_channel(backend, rng):
    scales, zps = np.array([0.1, 0.02, 0.5], np.float32), np.array([0, -3, 4])
    codes = rng.integers(-128, 128, size=(2, 3, 5))
    q = QArray.from_int(codes, scales, zps, "qint8", axis=1)
    got = backend.run(L.silu, q, scale=0.05, zero_point=1, dtype="qint8")
    assert backend.ran("lut_uint8_uint8"), backend.launched  # one table per channel: (C, 256)
    assert got.qscheme == "per_tensor_affine"
    for c in range(3):
        want = reference(codes[:, c], scales[c], zps[c], REFS["silu"], 0.05, 1, "qint8")
        np.testing.assert_array_equal(got.int_repr()[:, c], want)
    with pytest.raises(ValueError, match="per-axis input needs output scale"):
        L.silu(q)


def test_lut_custom_fn_and_layouts(kernels):
    q = QArray.from_int(np.arange(-8, 8).reshape(4, 4), 0.25, 0, "qint4")
    got = L.lut(q.T, np.square, scale=0.125, dtype="quint8")  # non-contiguous input
    want = reference(q.int_repr().T, 0.25, 0, lambda x: x * x, 0.125, 0, "quint8")
    np.testing.assert_array_equal(got.int_repr(), want)
    assert got.shape == (4, 4) and got.int_repr().dtype == np.uint8
    # dtype defaults to the input's; integer-valued fn results are fine
    assert L.lut(q, lambda x: np.rint(x).astype(np.int64), scale=1.0).dtype is qarray.qint4
    zero_d = QArray.from_int(np.array(3), 0.5, 0, "qint8")
    assert L.lut(zero_d, np.negative, scale=0.5).int_repr() == -3
    empty = QArray.from_int(np.zeros((0, 3), np.int8), 0.5, 0, "qint8")
    assert L.exp(empty).shape == (0, 3)


def test_exp_saturates_on_overflow():
    q = QArray.from_int(np.array([-32768, 0, 32767]), 1.0, 0, "qint16")
    np.testing.assert_array_equal(L.exp(q, scale=1.0, dtype="quint8").int_repr(), [0, 1, 255])


def test_sigmoid_matches_torch_quantized_float():
    torch = pytest.importorskip("torch")
    q = all_codes("quint8", 0.05, 128)
    x = torch.from_numpy(q.dequantize().astype(np.float64))
    for ours, theirs in [(L.sigmoid, torch.sigmoid), (L.tanh, torch.tanh),
                         (L.hardswish, torch.nn.functional.hardswish), (L.gelu, torch.nn.functional.gelu)]:
        out = ours(q)
        want = np.rint(theirs(x).numpy() / float(out.scale)) + int(out.zero_point)
        want = np.clip(want, out.dtype.qmin, out.dtype.qmax)
        assert np.abs(out.int_repr().astype(np.int64) - want).max() <= 1  # torch's libm may differ in the last ulp
        assert np.mean(out.int_repr() == want) > 0.99


def test_errors():
    q = all_codes("qint8", 0.1, 0)
    with pytest.raises(TypeError, match="16 bits or less"):
        L.lut(QArray.from_int(np.array([1]), 1.0, 0, "qint32"), np.tanh, scale=0.1)
    with pytest.raises(TypeError, match="16 bits or less"):
        L.sigmoid(QArray.from_int(np.array([1]), 1.0, 0, "qint32"))
    with pytest.raises(TypeError, match="must be a QArray"):
        L.sigmoid(np.zeros(3, np.int8))
    with pytest.raises(TypeError, match="callable"):
        L.lut(q, 3.0, scale=0.1)
    with pytest.raises(ValueError, match="fn bad_fn returned NaN"):
        def bad_fn(x):
            return np.where(x > 1, np.nan, x)

        L.lut(q, bad_fn, scale=0.1)
    with pytest.raises(ValueError, match="shaped like its input"):
        L.lut(q, lambda x: 1.0, scale=0.1)
    with pytest.raises(ValueError, match="real numbers"):
        L.lut(q, lambda x: x.astype(complex), scale=0.1)
    blocked = QArray.from_int(np.zeros((4,), np.int8), [0.1, 0.2], [0, 0], "qint8", axis=0, block_size=2)
    with pytest.raises(ValueError, match="blocked"):
        L.tanh(blocked)
    with pytest.raises(ValueError, match="output scale="):
        L.gelu(q, zero_point=3)
    with pytest.raises(ValueError, match="scale must be finite"):
        L.lut(q, np.tanh, scale=0.0)
