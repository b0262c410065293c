"""The CuPy backend on a real GPU against the NumPy backend, bit for bit.

Runs only where CuPy imports and a CUDA device answers (``pytest -m gpu``);
elsewhere every test here is skipped. The no-device error paths are tested in
test_backends.py, which runs everywhere.
"""

import warnings

import numpy as np
import pytest

import qarray

from _reference import assert_same, device_cupy, float32_boundaries, float64_boundaries, mx_vectors

pytestmark = pytest.mark.gpu

cupy = device_cupy()


def both(fn, *host_arrays):
    """``fn`` on NumPy arrays and on their CuPy copies; results back on the host."""
    want = fn(*host_arrays)
    got = fn(*[cupy.asarray(a) for a in host_arrays])
    return want, got


def ints(q):
    return qarray.backends.get(q.backend).to_host(q.data)


def same(got, want):
    """``got`` (on the GPU) is ``want`` (NumPy) bit for bit (``assert_same``)."""
    assert got.backend == "cupy" and isinstance(got.data, cupy.ndarray), got.backend
    for p in (got.scale, got.zero_point):
        assert isinstance(p, np.ndarray)  # parameters are host metadata, whatever the data's device
    assert_same(got, want)


def test_seed_use_case():
    x = cupy.random.rand(10, dtype=cupy.float32)
    q = qarray.quantize(x, 0.01, 0, qarray.qint8)
    assert q.backend == "cupy" and isinstance(q.data, cupy.ndarray)
    text = repr(q)
    assert "backend=cupy" in text and "dtype=qint8" in text
    d = q.dequantize()
    assert isinstance(d, cupy.ndarray)
    np.testing.assert_array_equal(d.get(), qarray.quantize(x.get(), 0.01, 0, qarray.qint8).dequantize())


def _case(rng, dtype, in_dtype, shape, axis, block_size, spread):
    """Normal data times ``spread``, and random parameters of the layout (zero points near qmin)."""
    from qarray._params import param_shape

    d = qarray.qdtype(dtype)
    ps = param_shape(shape, axis, block_size)
    return ((rng.standard_normal(shape) * spread).astype(in_dtype), rng.uniform(0.05, 0.5, ps).astype(np.float32),
            rng.integers(d.qmin, min(d.qmax, d.qmin + 100), ps, endpoint=True))


@pytest.mark.parametrize("dtype", ["qint2", "quint4", "qint8", "quint8", "qint16", "quint16", "qint32"])
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape,axis,block_size", [
    ((1,), None, None), (((1 << 20) + 3,), None, None), ((33, 65), 0, None), ((33, 65), 1, None), ((40, 129), 1, 32)])
def test_quantize_dequantize(dtype, in_dtype, shape, axis, block_size, rng):
    x, scale, zp = _case(rng, dtype, in_dtype, shape, axis, block_size, 50)
    want, got = both(lambda a: qarray.quantize(a, scale, zp, dtype, axis=axis, block_size=block_size), x)
    np.testing.assert_array_equal(ints(got), ints(want))
    for ft in ("float16", "float32", "float64"):
        np.testing.assert_array_equal(got.dequantize(ft).get(), want.dequantize(ft))


@pytest.mark.parametrize("dtype", ["Q4_K", "Q8_0", "IQ4_XS", "IQ2_XXS"])
def test_block_formats(dtype, rng):
    """GGUF's block formats with device data: the same bytes (quantized on the host, moved), the same
    values, slices of whole blocks."""
    x = rng.standard_normal((8, 512)).astype(np.float32)
    if dtype == "IQ2_XXS":  # read only: bytes, not values, to start from
        want = qarray.QArray.from_blocks(rng.integers(0, 256, (8, 2 * 66), dtype=np.uint8), dtype)
        got = want.to("cupy")
    else:
        want, got = both(lambda a: qarray.quantize(a, dtype=dtype), x)
    assert got.backend == "cupy" and isinstance(got.data, cupy.ndarray)
    np.testing.assert_array_equal(got.data.get(), want.data)
    d = got.dequantize()
    assert isinstance(d, cupy.ndarray)
    np.testing.assert_array_equal(d.get(), want.dequantize())
    np.testing.assert_array_equal(got[2:, 256:].dequantize().get(), want[2:, 256:].dequantize())
    if dtype in ("Q4_K", "IQ4_XS"):  # with an importance matrix, itself on the device or the host
        imp = rng.uniform(0, 2, 512).astype(np.float32)
        want, got = both(lambda a, w: qarray.quantize(a, dtype=dtype, importance=w), x, imp)
        assert got.backend == "cupy"
        np.testing.assert_array_equal(got.data.get(), want.data)
        np.testing.assert_array_equal(qarray.quantize(cupy.asarray(x), dtype=dtype, importance=imp).data.get(),
                                      want.data)


@pytest.mark.parametrize("dtype", ["uint3_g32_bf16_zp", "e2m1_g16_e4m3_gdiv"])
def test_grouped_formats(dtype, rng):
    """The Hugging Face checkpoints' grouped formats with device data: act-order columns and NVFP4's
    tensor scale move with the bytes, and the values are the host's."""
    x = rng.standard_normal((8, 512)).astype(np.float32)
    want = qarray.quantize(x, dtype=dtype)
    if dtype.startswith("uint"):
        want = qarray.QArray._blocks(want.data, want.dtype, None, rng.permutation(512))
    got = want.to("cupy")
    assert got.backend == "cupy" and isinstance(got.data, cupy.ndarray) and got.global_scale == want.global_scale
    assert (got.columns is None) == (want.columns is None)
    d = got.dequantize()
    assert isinstance(d, cupy.ndarray)
    np.testing.assert_array_equal(d.get(), want.dequantize())


@pytest.mark.parametrize("dtype", ["Q4_K", "int4_g128_f16", "uint4_g32_f16_zp"])
def test_block_linear(dtype, rng):
    """linear on block-format weights on the device (cuda/blocks.cu: block_gemv for a token or a few,
    dequantize-then-GEMM for a prompt, Q8_0 activations; Q8_K ones), the NumPy backend's bits; act-order
    columns."""
    w = qarray.quantize(rng.standard_normal((40, 512)).astype(np.float32), dtype=dtype)
    if dtype.startswith("uint"):
        w = qarray.QArray._blocks(w.data, w.dtype, None, rng.permutation(512))
    wd, bias = w.to("cupy"), rng.standard_normal(40).astype(np.float32)
    for m in (1, 3, 40):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        got = qarray.linear(cupy.asarray(x), wd, cupy.asarray(bias))
        assert isinstance(got, cupy.ndarray)
        assert_same(got.get(), qarray.linear(x, w, bias))
        for act in ("Q8_0", "Q8_K") if w.columns is None else ():
            if act == "Q8_K" and qarray.ops.block_linear.q8k_supported(w.dtype.layout) is not None:
                continue
            xq = qarray.quantize(x, dtype=act)  # (Q8_K: the generic code on the device's arrays)
            assert_same(qarray.linear(xq.to("cupy"), wd, cupy.asarray(bias)).get(), qarray.linear(xq, w, bias))


@pytest.mark.parametrize("dtype", ["qint4", "quint8", "qint8", "qint16", "qint32"])
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape,axis,block_size", [(((1 << 20) + 3,), None, None), ((33, 65), 1, None),
                                                   ((40, 129), 1, 32)])
def test_fake_quantize(dtype, in_dtype, shape, axis, block_size, rng):
    """The fused fake_quantize and mask kernels: the CPU's values and mask, bit for bit."""
    x, scale, zp = _case(rng, dtype, in_dtype, shape, axis, block_size, 80)
    (want, wmask), (got, gmask) = both(lambda a: qarray.fake_quantize(a, scale, zp, dtype, axis=axis,
                                                                      block_size=block_size, return_mask=True), x)
    assert isinstance(got, cupy.ndarray) and got.dtype == in_dtype
    np.testing.assert_array_equal(got.get().view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(gmask.get(), wmask)


def test_fake_quantize_out_and_stochastic_mask(rng):
    """fake_quantize into out= (a buffer, and x itself with the mask), and with
    stochastic rounding and its mask: the CPU's, bit for bit."""
    x, scale, zp = _case(rng, "qint8", np.float32, (257, 129), 1, None, 80)
    want, wmask = qarray.fake_quantize(x, scale, zp, "qint8", axis=1, return_mask=True)
    gx = cupy.asarray(x)
    buf = cupy.empty_like(gx)
    assert qarray.fake_quantize(gx, scale, zp, "qint8", axis=1, out=buf) is buf
    np.testing.assert_array_equal(buf.get().view(np.uint32), want.view(np.uint32))
    got, gmask = qarray.fake_quantize(gx, scale, zp, "qint8", axis=1, out=gx, return_mask=True)
    assert got is gx
    np.testing.assert_array_equal(gx.get().view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(gmask.get(), wmask)
    want, wmask = qarray.fake_quantize(x, scale, zp, "qint8", axis=1, return_mask=True, rounding="stochastic", seed=4)
    got, gmask = qarray.fake_quantize(cupy.asarray(x), scale, zp, "qint8", axis=1, return_mask=True,
                                      rounding="stochastic", seed=4)
    np.testing.assert_array_equal(got.get().view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(gmask.get(), wmask)


@pytest.mark.parametrize("dtype", ["qint4", "qint8", "quint16", "qint32"])
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape,axis,block_size", [(((1 << 20) + 3,), None, None), ((33, 65), 1, None),
                                                   ((40, 129), 1, 32)])
def test_quantize_stochastic(dtype, in_dtype, shape, axis, block_size, rng):
    """The stochastic quantize kernel: the CPU's codes for the same seed, bit for bit."""
    x, scale, zp = _case(rng, dtype, in_dtype, shape, axis, block_size, 30)
    want, got = both(lambda a: qarray.quantize(a, scale, zp, dtype, axis=axis, block_size=block_size,
                                               rounding="stochastic", seed=2**40 + 3), x)
    np.testing.assert_array_equal(ints(got), ints(want))


@pytest.mark.parametrize("rounding", ["half_even", "half_away", "half_up", "tflite"])
@pytest.mark.parametrize("mode", ["fixed", "float"])
def test_requantize(rounding, mode, rng):
    q = qarray.QArray.from_int(rng.integers(-(2**24), 2**24, (257, 129)).astype(np.int32), 1e-4, 0, "qint32")
    want = qarray.requantize(q, 0.05, 3, "qint8", mode=mode, rounding=rounding)
    got = qarray.requantize(q.to("cupy"), 0.05, 3, "qint8", mode=mode, rounding=rounding)
    np.testing.assert_array_equal(ints(got), ints(want))


@pytest.mark.parametrize("shape,axis", [(((1 << 20) + 3,), None), ((257, 129), 1), ((257, 129), 0)])
def test_requantize_stochastic(shape, axis, rng):
    """The stochastic requantize kernel: the CPU's codes for the same seed, bit for bit."""
    q = qarray.QArray.from_int(rng.integers(-(2**31), 2**31, shape).astype(np.int32), 1e-4, 0, "qint32")
    scale = np.float32(0.05) if axis is None else rng.uniform(0.01, 100, shape[axis]).astype(np.float32)
    want = qarray.requantize(q, scale, 3, "qint8", axis, rounding="stochastic", seed=2**50 + 1)
    got = qarray.requantize(q.to("cupy"), scale, 3, "qint8", axis, rounding="stochastic", seed=2**50 + 1)
    np.testing.assert_array_equal(ints(got), ints(want))


def test_linear_gradients(rng):
    """A linear layer's gradients on the device's int8 GEMM: grad_w = grad_out.T @ x
    with grad_out per output channel (a per-row a), grad_x = grad_out @ w with w
    per input feature; the CPU's integers and scales, requantized and not."""
    x = qarray.quantize(rng.standard_normal((96, 64)).astype(np.float32), 0.03, 0, "qint8")
    g = rng.standard_normal((96, 48)).astype(np.float32)
    qg = qarray.quantize(g, np.abs(g).max(0) / 127, 0, "qint8", axis=1)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    qw = qarray.quantize(w, np.abs(w).max(0) / 127, 0, "qint8", axis=1)
    qgt = qarray.quantize(g, np.abs(g).max() / 127, 0, "qint8")
    for a, b in ((qg.T, x), (qgt, qw)):
        for kw in ({}, dict(scale=0.5, zero_point=0, dtype="qint8")):
            want, got = qarray.matmul(a, b, **kw), qarray.matmul(a.to("cupy"), b.to("cupy"), **kw)
            np.testing.assert_array_equal(ints(got), ints(want))
            np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))


def test_ops_match(rng):
    a = qarray.quantize(rng.standard_normal((64, 96)).astype(np.float32), 0.02, 3, "quint8")
    b = qarray.quantize(rng.standard_normal((96, 32)).astype(np.float32), np.full(32, 0.01, np.float32), 0, "qint8", axis=1)
    ga, gb = a.to("cupy"), b.to("cupy")
    for f in (lambda x, y: qarray.matmul(x, y), lambda x, y: qarray.matmul(x, y, scale=0.1, zero_point=0, dtype="qint8"),
              lambda x, y: qarray.cat([x, x[:3]], scale=0.05, zero_point=0, dtype="qint8"),
              lambda x, y: qarray.add(x, x, scale=0.05, zero_point=0, dtype="qint8"),
              lambda x, y: qarray.sigmoid(x), lambda x, y: qarray.relu(x)):
        np.testing.assert_array_equal(ints(f(ga, gb)), ints(f(a, b)))
    a16 = qarray.quantize(rng.standard_normal((8, 96)).astype(np.float32), 1e-4, -7, "qint16")  # 16 x 8
    for kw in ({}, dict(scale=0.5, zero_point=0, dtype="qint16")):
        np.testing.assert_array_equal(ints(qarray.matmul(a16.to("cupy"), gb, **kw)), ints(qarray.matmul(a16, b, **kw)))


@pytest.mark.parametrize("groups", [1, 8])
def test_conv_transpose2d(groups, rng):
    """conv_transpose2d (conv2d of the spread input) on the device: the CPU's accumulator and requantized codes."""
    x = qarray.QArray.from_int(rng.integers(0, 256, (2, 8, 9, 7)), 0.02, 128, "quint8")
    w = qarray.QArray.from_int(rng.integers(-128, 128, (8, 3, 3, 3)), np.full(3, 0.01, np.float32), 0, "qint8",
                               axis=1)
    for kw in ({}, dict(scale=0.5, zero_point=1, dtype="qint8")):
        want = qarray.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1, groups=groups, **kw)
        got = qarray.conv_transpose2d(x.to("cupy"), w.to("cupy"), stride=2, padding=1, output_padding=1,
                                      groups=groups, **kw)
        np.testing.assert_array_equal(ints(got), ints(want))


@pytest.mark.parametrize("groups", [1, 4])
def test_conv2d_weight_grad(groups, rng):
    """conv2d_weight_grad (conv2d with batch and channels swapped) on the device: the CPU's integers."""
    x = qarray.QArray.from_int(rng.integers(0, 256, (4, 8, 9, 9)), 0.02, 128, "quint8")
    g = qarray.QArray.from_int(rng.integers(-128, 128, (4, 12, 5, 5)), 0.01, 0, "qint8")
    for kw in ({}, dict(scale=4.0, zero_point=1, dtype="qint8")):
        want = qarray.conv2d_weight_grad(x, (12, 8 // groups, 3, 3), g, stride=2, padding=1, groups=groups, **kw)
        got = qarray.conv2d_weight_grad(x.to("cupy"), (12, 8 // groups, 3, 3), g.to("cupy"), stride=2, padding=1,
                                        groups=groups, **kw)
        np.testing.assert_array_equal(ints(got), ints(want))


def test_quantize_dynamic_and_minmax(rng):
    x = rng.standard_normal((128, 33)).astype(np.float32)
    want = qarray.quantize_dynamic(x, "quint8", axis=1)
    got = qarray.quantize_dynamic(cupy.asarray(x), "quint8", axis=1)
    np.testing.assert_array_equal(ints(got), ints(want))
    np.testing.assert_array_equal(got.scale, want.scale)


def test_non_contiguous_and_misaligned(rng):
    x = rng.standard_normal((64, 65)).astype(np.float32)
    gx = cupy.asarray(x)
    for view in (lambda a: a[:, ::2], lambda a: a.reshape(-1)[1:], lambda a: a.T):
        want = qarray.quantize(view(x), 0.1, 0, "qint8")
        got = qarray.quantize(view(gx), 0.1, 0, "qint8")
        np.testing.assert_array_equal(ints(got), ints(want))


def test_nan_on_device_is_the_cpu_error():
    x = cupy.zeros((3, 4), cupy.float32)
    x[2, 1] = cupy.nan
    q = qarray.quantize(x, 0.1, 0, "qint8")  # no wait for the device: the next host read reports it
    with pytest.raises(ValueError, match=r"1 NaN value\(s\), the first at index \(2, 1\)"):
        q.get()
    q.get()  # once


def test_numpy_and_cupy_in_one_op():
    a = qarray.quantize(np.ones(4, np.float32), 0.1, 0, "qint8")
    with pytest.raises(TypeError, match=r"arrays of two backends \(numpy and cupy\) can not be combined"):
        qarray.cat([a, a.to("cupy")])


def test_two_devices():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    with cupy.cuda.Device(0):
        a = qarray.quantize(cupy.ones(4, cupy.float32), 0.1, 0, "qint8")
    with cupy.cuda.Device(1):
        b = qarray.quantize(cupy.ones(4, cupy.float32), 0.1, 0, "qint8")
    with pytest.raises(TypeError, match=r"^CuPy arrays on two devices \(0 and 1\) can not be combined; copy them "
                                        r"to one device first \(cupy\.asarray under `with cupy\.cuda\.Device\(i\):`\)$"):
        qarray.cat([a, b])


def test_float32_subnormals_are_kept(rng):
    """CuPy compiles with -ftz=true; the kernels must still keep subnormals as NumPy does."""
    tiny = np.float32(2.0**-149)
    x = np.array([tiny, 3 * tiny, -5 * tiny, 2.0**-127, 0.0, 1e-39, -1e-38, 1.0], np.float32)
    for scale in (2.0**-149, 2.0**-140, 2.0**-126):  # subnormal, subnormal, the smallest normal
        want, got = both(lambda a: qarray.quantize(a, scale, 1, "qint16"), x)
        np.testing.assert_array_equal(ints(got), ints(want))
        np.testing.assert_array_equal(got.dequantize().get().view(np.uint32), want.dequantize().view(np.uint32))
    want, got = both(lambda a: qarray.quantize_dynamic(a, "quint8"), x[:6])
    np.testing.assert_array_equal(got.scale, want.scale)
    np.testing.assert_array_equal(ints(got), ints(want))


@pytest.mark.parametrize("f", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float6_e2m3fn",
                               "float6_e3m2fn", "float4_e2m1fn"])
@pytest.mark.parametrize("saturate", [True, False])
def test_floating_formats(f, saturate, rng):
    pytest.importorskip("ml_dtypes")  # the CPU reference
    """cuda/formats.cu (sm_89 and later: the hardware e4m3fn / e5m2 conversion
    with saturation) against NumPy: every float32 and float64 boundary of the
    format, every float16, per tensor and blocked; dequantize of every code."""
    x16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    for x, scale, layout in ((float32_boundaries(f), 1.0, {}), (float64_boundaries(f), 1.0, {}),
                             (x16, 0.37, {}), (x16.reshape(256, 256), np.full((256, 8), 0.25, np.float32),
                                               dict(axis=1, block_size=32))):
        if not qarray._formats.fmt(f).has_nan:
            x = np.where(np.isnan(x), 0, x).astype(x.dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            want, got = both(lambda a: qarray.quantize(a, scale, 0, f, saturate=saturate, **layout), x)
        assert got.backend == "cupy" and got.data.dtype == np.uint8
        np.testing.assert_array_equal(got.int_repr().get(), want.int_repr())
        np.testing.assert_array_equal(got.get().int_repr(), want.int_repr())
        for ft in ("float16", "float32", "float64"):
            with np.errstate(over="ignore"):
                np.testing.assert_array_equal(got.dequantize(ft).get().view(np.uint8), want.dequantize(ft).view(np.uint8))
    codes = qarray.QArray.from_int(np.arange(1 << qarray.qdtype(f).bits, dtype=np.uint8), 0.37, 0, f)
    for ft in ("float16", "float32", "float64"):
        np.testing.assert_array_equal(codes.to("cupy").dequantize(ft).get().view(np.uint8),
                                      codes.dequantize(ft).view(np.uint8))


@pytest.mark.parametrize("fmt", list(qarray._formats.MX_FORMATS))
def test_mx_and_nvfp4(fmt, rng):
    """cuda/formats.cu's block kernels against NumPy: torchao's vectors (NaN, inf,
    zero, subnormal, tie blocks) and float64 data, every scale rounding, blocks along
    the last axis and down the first (strided, a short last block); NVFP4 too."""
    pytest.importorskip("ml_dtypes")  # the CPU reference
    X = mx_vectors()["x"]
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    x64 = rng.standard_normal((40, 70)) * np.exp(rng.uniform(-300, 300, (40, 1)))
    for x, axis, rounding in [(X, -1, r) for r in qarray._formats.SCALE_ROUNDINGS] + [(X, 0, "floor"), (x64, 0, "rceil")]:
        with np.errstate(invalid="ignore", over="ignore"):
            want, got = both(lambda a: qarray.quantize_mx(a, fmt, axis=axis, scale_rounding=rounding), x)
        assert got.backend == "cupy"
        np.testing.assert_array_equal(bits(got.scale), bits(want.scale))
        np.testing.assert_array_equal(bits(ints(got)), bits(ints(want)))
    if fmt == "mxfp4":
        for axis, gs in ((-1, None), (0, 0.37)):
            with np.errstate(invalid="ignore", over="ignore"):
                want, got = both(lambda a: qarray.quantize_nvfp4(a, axis=axis, global_scale=gs), X)
            np.testing.assert_array_equal(bits(got.scale), bits(want.scale))
            np.testing.assert_array_equal(bits(ints(got)), bits(ints(want)))
            np.testing.assert_array_equal(got.global_scale, want.global_scale)


@pytest.mark.parametrize("op", [qarray.add, qarray.sub, qarray.mul])
@pytest.mark.parametrize("shapes", [((300, 257), (300, 257)), ((300, 257), (257,)), ((5, 1, 7), (5, 3, 7))])
@pytest.mark.parametrize("relu", [False, True])
def test_binary_ops_fused(op, shapes, relu, rng):
    a = qarray.quantize(rng.standard_normal(shapes[0]).astype(np.float32), 0.03, -5, "qint8")
    b = qarray.quantize(rng.standard_normal(shapes[1]).astype(np.float32), 0.07, 120, "quint8")
    out = dict(scale=0.05, zero_point=-3, dtype="qint8", relu=relu)
    np.testing.assert_array_equal(ints(op(a.to("cupy"), b.to("cupy"), **out)), ints(op(a, b, **out)))


def test_lut_per_axis_and_float16(rng):
    x = rng.standard_normal((64, 129)).astype(np.float16)
    q = qarray.quantize(x, rng.uniform(0.01, 0.1, 64).astype(np.float32), 3, "qint8", axis=0)
    out = dict(scale=0.01, zero_point=0, dtype="qint8")
    np.testing.assert_array_equal(ints(qarray.gelu(q.to("cupy"), **out)), ints(qarray.gelu(q, **out)))
    np.testing.assert_array_equal(q.to("cupy").dequantize("float16").get().view(np.uint16),
                                  q.dequantize("float16").view(np.uint16))


def test_no_implicit_host_conversion():
    """CuPy's arrays are no NumPy arrays (nor are the stand-in's of the dry run):
    NumPy refuses to convert them and to mix them with its own."""
    x = cupy.ones(3, cupy.float32)
    assert not isinstance(x, np.ndarray)
    implicit = r"^Implicit conversion to a NumPy array is not allowed\. Please use `\.get\(\)` to construct a NumPy array explicitly\.$"
    for convert in (np.asarray, np.array, lambda a: np.asarray(a, np.float64), lambda a: a.__array__()):
        with pytest.raises(TypeError, match=implicit), warnings.catch_warnings():
            # CuPy's __array__(dtype=None) takes no copy=: NumPy 2.5 warns of that before it calls it again
            warnings.filterwarnings("ignore", "__array__ implementation doesn't accept a copy keyword", DeprecationWarning)
            convert(x)
    host = np.ones(3, np.float32)
    for mix in (np.add, lambda a, b: a + b, lambda a, b: b * a, lambda a, b: np.maximum(b, a)):
        with pytest.raises(TypeError, match=r"^Unsupported type <class 'numpy\.ndarray'>$"):
            mix(x, host)
    np.testing.assert_array_equal(np.add(x, x).get(), [2, 2, 2])  # NumPy's functions on CuPy arrays alone: CuPy's
    assert isinstance(np.add(x, x), cupy.ndarray) and isinstance(np.concatenate([x, x]), cupy.ndarray)


@pytest.mark.parametrize("groups,stride,padding,dilation", [
    (1, 1, 0, 1), (2, (2, 1), (1, 2), (1, 2)), (6, 2, 1, 1), (3, (1, 3), 2, (2, 1))], ids=str)
@pytest.mark.parametrize("out", [{}, dict(scale=0.05, zero_point=3, dtype="quint8", relu=True)], ids=["acc", "requant"])
def test_conv2d(groups, stride, padding, dilation, out, rng):
    x = qarray.quantize(rng.standard_normal((2, 6, 9, 11)).astype(np.float32), 0.05, 3, "quint8")
    w = qarray.quantize(rng.standard_normal((12, 6 // groups, 3, 2)).astype(np.float32),
                        rng.uniform(0.01, 0.05, 12).astype(np.float32), 0, "qint8", axis=0)
    bias = rng.standard_normal(12).astype(np.float32)
    want = qarray.conv2d(x, w, bias, stride, padding, dilation, groups, **out)
    same(qarray.conv2d(x.to("cupy"), w.to("cupy"), bias, stride, padding, dilation, groups, **out), want)
    w4 = qarray.quantize(rng.standard_normal((12, 6 // groups, 2, 2)).astype(np.float32), 0.3, 0, "qint4")
    same(qarray.conv2d(x.to("cupy"), w4.to("cupy"), cupy.asarray(bias), stride, padding, dilation, groups, **out),
         qarray.conv2d(x, w4, bias, stride, padding, dilation, groups, **out))


POOLS = {
    "max": lambda q: qarray.max_pool2d(q, 3, 2, 1),
    "max_dilated": lambda q: qarray.max_pool2d(q, (2, 3), (1, 2), dilation=(2, 1)),
    "avg": lambda q: qarray.avg_pool2d(q, 3, 2, 1),
    "avg_no_pad_out": lambda q: qarray.avg_pool2d(q, (3, 2), 1, (1, 0), count_include_pad=False,
                                                  scale=0.02, zero_point=-1, dtype="qint8", rounding="tflite"),
    "avg_float": lambda q: qarray.avg_pool2d(q, 2, mode="float", scale=0.03, zero_point=0, dtype="quint8"),
    "adaptive": lambda q: qarray.adaptive_avg_pool2d(q, (4, 3)),
    "adaptive_3d": lambda q: qarray.adaptive_avg_pool2d(q[1], (None, 2), scale=0.01, zero_point=0, dtype="qint16"),
    "mean": lambda q: qarray.mean(q, axis=(2, 3)),
    "mean_out": lambda q: qarray.mean(q, keepdims=True, scale=0.001, zero_point=5, dtype="qint8", rounding="half_up"),
    "sum": lambda q: qarray.sum(q, axis=1),
    "sum_out": lambda q: qarray.sum(q, axis=(0, 3), scale=0.5, zero_point=0, dtype="qint16"),
}


@pytest.mark.parametrize("name", POOLS)
def test_pooling_and_reductions(name, rng):
    q = qarray.quantize(rng.standard_normal((2, 3, 10, 9)).astype(np.float32), 0.05, -3, "qint8")
    same(POOLS[name](q.to("cupy")), POOLS[name](q))


def test_max_pool_per_channel(rng):
    q = qarray.quantize(rng.standard_normal((3, 7, 8)).astype(np.float32), np.float32([0.1, 0.2, 0.05]),
                        np.int32([0, 4, -2]), "qint8", axis=0)
    same(qarray.max_pool2d(q.to("cupy"), 2), qarray.max_pool2d(q, 2))


def test_nn_layers_from_cupy_weights(rng):
    """``from_float`` on CuPy weights makes a layer on the GPU; calibrate and every
    call give the NumPy layer's results bit for bit."""
    from qarray.nn import Conv2d, DynamicLinear, Linear

    w, b = rng.standard_normal((16, 24)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    qx = qarray.quantize_dynamic(x, "quint8")
    want = Linear.from_float(w, b).calibrate(qx)
    got = Linear.from_float(cupy.asarray(w), cupy.asarray(b)).calibrate(qx.to("cupy"))
    same(got.weight, want.weight)
    assert (got.scale, got.zero_point, got.dtype) == (want.scale, want.zero_point, want.dtype)
    for kw in ({}, dict(relu=True), dict(scale=0.1, zero_point=0, dtype="qint8")):
        same(got(qx.to("cupy"), **kw), want(qx, **kw))
    same(got(qx[0].to("cupy")), want(qx[0]))

    wc, bc = rng.standard_normal((8, 2, 3, 3)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    xc = rng.standard_normal((2, 4, 7, 6)).astype(np.float32)
    qc = qarray.quantize_dynamic(xc, "quint8")
    want = Conv2d.from_float(wc, bc, stride=2, padding=1, groups=2).calibrate(xc, relu=True)
    got = Conv2d.from_float(cupy.asarray(wc), cupy.asarray(bc), stride=2, padding=1, groups=2)
    got.calibrate(cupy.asarray(xc), relu=True)
    same(got.weight, want.weight)
    assert (got.scale, got.zero_point, got.dtype) == (want.scale, want.zero_point, want.dtype)
    same(got(qc.to("cupy")), want(qc))

    for weight_dtype in ("qint8", "quint4", "float16"):
        want = DynamicLinear.from_float(w, b, weight_dtype=weight_dtype)
        got = DynamicLinear.from_float(cupy.asarray(w), cupy.asarray(b), weight_dtype=weight_dtype)
        y = got(cupy.asarray(x))
        assert isinstance(y, cupy.ndarray) and y.dtype == np.float32
        if weight_dtype == "float16":  # a float32 matmul: cuBLAS and the CPU's BLAS may round differently
            np.testing.assert_allclose(y.get(), want(x), rtol=1e-5, atol=1e-5)
        else:  # exact integers, then elementwise float32
            np.testing.assert_array_equal(y.get(), want(x))


def test_ops_run_on_their_datas_device(rng):
    """With device 0 current, every op on device 1's data allocates, launches and
    leaves its result (data, scale, zero point) on device 1."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    x = (rng.standard_normal((33, 65)) * 5).astype(np.float32)
    w = (rng.standard_normal((7, 65)) * 0.1).astype(np.float32)
    img = (rng.standard_normal((2, 3, 9, 9)) * 2).astype(np.float32)
    kern = (rng.standard_normal((4, 3, 3, 3)) * 0.1).astype(np.float32)

    def inputs(xp):
        return dict(x=xp.asarray(x), q=qarray.quantize(xp.asarray(x), 0.05, 3, "qint8"),
                    w=qarray.quantize(xp.asarray(w), 0.002, 0, "qint8"),
                    img=qarray.quantize(xp.asarray(img), 0.03, 128, "quint8"),
                    kern=qarray.quantize(xp.asarray(kern), 0.004, 0, "qint8"))

    out = dict(scale=0.1, zero_point=0, dtype="qint8")
    ops = {
        "quantize": lambda a: qarray.quantize(a["x"], 0.05, 3, "qint8"),
        "quantize_dynamic": lambda a: qarray.quantize_dynamic(a["x"], "quint8", axis=0),
        "requantize": lambda a: qarray.requantize(a["q"], 0.1, 120, "quint8"),
        "add": lambda a: qarray.add(a["q"], a["q"], **out),
        "mul": lambda a: qarray.mul(a["q"], a["q"], **out),
        "relu": lambda a: qarray.relu(a["q"]),
        "gelu": lambda a: qarray.gelu(a["q"], scale=0.02, zero_point=0, dtype="qint8"),
        "qint4": lambda a: qarray.quantize(a["x"], 0.5, 0, "qint4"),
        "cat": lambda a: qarray.cat([a["q"], qarray.requantize(a["q"], 0.07, 1)], **out),
        "linear": lambda a: qarray.linear(a["q"], a["w"], scale=0.5, zero_point=0, dtype="qint8"),
        "linear_acc": lambda a: qarray.linear(a["q"], a["w"]),
        "conv2d": lambda a: qarray.conv2d(a["img"], a["kern"], padding=1, scale=0.05, zero_point=0, dtype="qint8"),
        "max_pool2d": lambda a: qarray.max_pool2d(a["img"], 2),
        "avg_pool2d": lambda a: qarray.avg_pool2d(a["img"], 3, 2),
        "sum": lambda a: qarray.sum(a["q"], axis=1, **out),
        "mean": lambda a: qarray.mean(a["q"], axis=0),
    }
    with cupy.cuda.Device(1):
        dev = inputs(cupy)
    host = getattr(qarray.backends.get("cupy"), "host", None)  # the dry run's stand-in records each launch's device
    before = len(host.devices) if host else 0
    with cupy.cuda.Device(0):
        got = {name: op(dev) for name, op in ops.items()}
        deq = dev["q"].dequantize()
        packed = got["qint4"].pack()
    assert cupy.cuda.Device().id == 0
    cpu = inputs(np)
    for name, op in ops.items():
        r = got[name]
        assert r.data.device.id == 1 and isinstance(r.scale, np.ndarray), name  # parameters: host metadata
        np.testing.assert_array_equal(ints(r), ints(op(cpu)), err_msg=name)
    assert deq.device.id == 1 and packed.device.id == 1
    np.testing.assert_array_equal(deq.get(), cpu["q"].dequantize())
    np.testing.assert_array_equal(packed.get(), qarray.quantize(x, 0.5, 0, "qint4").pack())
    if host:
        assert len(host.devices) > before and set(host.devices[before:]) == {1}


def test_beyond_2_31_elements():
    """64-bit indices: the last elements of a 2**31 + 5 element array."""
    n = 2**31 + 5
    x = cupy.ones(n, cupy.float16)
    x[-3:] = cupy.asarray([2.0, -3.0, 0.25], cupy.float16)
    q = qarray.quantize(x, 0.25, 1, "qint8")
    np.testing.assert_array_equal(q.data[-4:].get(), [5, 9, -11, 2])
    r = qarray.requantize(q, 0.5, 0, "qint8")
    np.testing.assert_array_equal(r.data[-4:].get(), [2, 4, -6, 0])
    del x, q, r


def _repeated_ops(rng):
    """``{name: (op, device -> host copies, allocations or None)}`` for the tests
    of what a repeated op costs beyond its kernels."""
    x = cupy.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    img = cupy.asarray(rng.standard_normal((2, 6, 9, 9)).astype(np.float32))
    q = qarray.quantize(x, 0.05, 3, "quint8")
    q2 = qarray.quantize(x, 0.04, -2, "qint8")
    qc = qarray.quantize(x, cupy.asarray(np.linspace(0.01, 0.05, 96).astype(np.float32)), 0, "qint8", axis=1)
    w = qarray.quantize(x[:32], cupy.asarray(np.linspace(0.01, 0.02, 32).astype(np.float32)), 0, "qint8", axis=0)
    qi = qarray.quantize(img, 0.05, 0, "quint8")
    wc = qarray.quantize(cupy.asarray(rng.standard_normal((12, 3, 3, 3)).astype(np.float32)), 0.02, 0, "qint8")
    bias = rng.standard_normal(32).astype(np.float32)
    layer = qarray.nn.Linear(w, bias)
    conv = qarray.nn.Conv2d(wc, padding=1, groups=2)
    out = dict(scale=0.2, zero_point=1, dtype="qint8")
    return {
        "quantize": (lambda: qarray.quantize(x, 0.05, 3, "quint8"), 0, 1),
        "quantize per-axis": (lambda: qarray.quantize(x, np.full(96, 0.05, np.float32), 0, "qint8", axis=1), 0, 1),
        "dequantize": (lambda: qc.dequantize(), 0, 1),
        "requantize": (lambda: q.requantize(0.1, 0, "qint8"), 0, 1),
        "requantize per-axis": (lambda: qc.requantize(0.1, 0, "qint8"), 0, 1),
        "add": (lambda: qarray.add(q, q2, **out), 0, 1),
        "mul": (lambda: qarray.mul(q, q2, **out), 0, 1),
        "relu": (lambda: qarray.relu(q2), 0, 1),
        "relu per-axis": (lambda: qarray.relu(qc), 0, 1),
        "nn.Linear, small M (gemv)": (lambda: layer(q[:4], **out), 0, 2),  # out, a' (zero weight zero points: no row sums)
        "nn.Linear (cuBLAS)": (lambda: layer(q, **out), 0, 3),  # out, a', the int32 product
        # qint8 activations with K a multiple of 32 are read where they are: no a'
        "nn.Linear, qint8 activations (gemv)": (lambda: layer(q2[:4], **out), 0, 1),
        "nn.Linear, qint8 activations (cuBLAS)": (lambda: layer(q2, **out), 0, 2),
        "nn.Conv2d grouped": (lambda: conv(qi, **out), 0, None),
        "linear per-channel (packs per call)": (lambda: qarray.linear(q, w, bias, **out), 0, None),
        "matmul accumulator": (lambda: qarray.matmul(q2, w.T), 0, None),
    }


def test_no_host_round_trips(rng):
    """A repeated op copies nothing host -> device (parameters are host metadata,
    their device copies kept), and device -> host only where it needs an answer
    (none: quantize's NaN flag is read at the next host read); it allocates its output and nothing else, but
    for the GEMM's intermediates (a' = a + off, the int32 product, the row sums).
    Counted by the stand-in CuPy of the dry run (``cupy.transfers``,
    ``cupy.allocations``); on a device, test_ops_do_not_wait_for_the_device."""
    if not hasattr(cupy, "transfers"):
        pytest.skip("transfers are counted by the stand-in CuPy (tests/test_gpu_dryrun.py)")
    for name, (fn, reads, allocations) in _repeated_ops(rng).items():
        fn()  # the first call may copy parameters over, once
        cupy.transfers.update(h2d=0, d2h=0)
        cupy.allocations[0] = 0
        fn()
        assert cupy.transfers == {"h2d": 0, "d2h": reads}, name
        assert allocations is None or cupy.allocations[0] == allocations, (name, cupy.allocations[0])


def test_ops_do_not_wait_for_the_device(rng):
    """On a device: a copy from or to pageable host memory waits for the stream,
    so an op that copies nothing returns while earlier work still runs; CuPy's
    memory hook counts the arrays it allocates (as the dry run's counter)."""
    if hasattr(cupy, "transfers"):
        pytest.skip("the stand-in runs nothing asynchronously (its counters: test_no_host_round_trips)")
    busy = cupy.ones((4096, 4096), cupy.float32)

    class Mallocs(cupy.cuda.MemoryHook):
        name = "qarray_count"

        def __init__(self):
            self.count = 0

        def malloc_preprocess(self, **kwargs):
            self.count += 1

    for name, (fn, reads, allocations) in _repeated_ops(rng).items():
        fn()
        cupy.cuda.Device().synchronize()
        for _ in range(20):  # tens of ms of device work queued ahead of the op
            busy @ busy
        with Mallocs() as hook:
            fn()
        still_running = not cupy.cuda.get_current_stream().done
        cupy.cuda.Device().synchronize()
        assert still_running == (reads == 0), name
        assert allocations is None or hook.count == allocations, (name, hook.count)


@pytest.mark.parametrize("m", [1, 16, 17, 300])
@pytest.mark.parametrize("wd", ["qint8", "quint8", "qint4"])
def test_int8_gemm_paths(m, wd, rng):
    """linear on the GPU, gemv (M <= 16, int8 or packed 4-bit weights) or cuBLAS's
    integer GEMM plus our epilogue (M > 16): the NumPy backend's integers, for the
    accumulator and requantized per-channel with bias and ReLU."""
    x = rng.standard_normal((m, 200)).astype(np.float32)
    w = rng.standard_normal((70, 200)).astype(np.float32)
    b = rng.standard_normal(70).astype(np.float32)
    for xd in ("quint8", "qint8"):
        qx = qarray.quantize(x, 0.05, 3 if xd == "quint8" else -2, xd)
        qw = qarray.quantize(w, np.linspace(0.01, 0.03, 70).astype(np.float32), 0, wd, axis=0)
        gx, gw = qx.to("cupy"), qw.to("cupy")
        same(qarray.linear(gx, gw), qarray.linear(qx, qw))
        out = dict(scale=0.3, zero_point=-5, dtype="qint8", relu=True)
        same(qarray.linear(gx, gw, b, **out), qarray.linear(qx, qw, b, **out))


def test_reciprocal_quantize_is_the_cpus(rng):
    """PyTorch's rule (``reciprocal=True``) on the device: the float32 product on
    CuPy is the CPU's, so the codes are too; per tensor, per channel, blocked."""
    x = rng.standard_normal((6, 50)).astype(np.float32)
    for scale, axis, block_size in ((np.float32(1 / 127.5), None, None),
                                    (np.linspace(0.01, 0.03, 6).astype(np.float32), 0, None),
                                    (rng.uniform(0.01, 0.03, (6, 3)).astype(np.float32), 1, 20)):
        want, got = both(lambda a: qarray.quantize(a, scale, 0, "qint8", axis, block_size, reciprocal=True), x)
        same(got, want)
