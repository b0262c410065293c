"""Floating-point formats (qarray/_formats.py): ONNX's QuantizeLinear /
DequantizeLinear for float8, float4 against ``onnx.reference`` bit for bit
(random data, ties, saturation, inf, NaN, both saturate modes, per tensor, axis
and block), float6 (which ONNX lacks) against ml_dtypes' own rounding, and
finfo against ml_dtypes."""

import numpy as np
import pytest

from qarray import _formats as F
from qarray._params import expand

from _reference import float64_boundaries

ml_dtypes = pytest.importorskip("ml_dtypes")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

SCALE_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
ONNX_TYPES = {"float8_e4m3fn": TensorProto.FLOAT8E4M3FN, "float8_e4m3fnuz": TensorProto.FLOAT8E4M3FNUZ,
              "float8_e5m2": TensorProto.FLOAT8E5M2, "float8_e5m2fnuz": TensorProto.FLOAT8E5M2FNUZ,
              "float4_e2m1fn": TensorProto.FLOAT4E2M1}
LAYOUTS = [((5, 8), None, None), ((5, 8), 0, None), ((5, 8), 1, None), ((4, 12), 1, 4)]


def _x(rng, shape, f):
    top = F.finfo(f).max
    x = (rng.standard_normal(shape) * top / 3).astype(np.float32)
    flat = x.reshape(-1)
    specials = [0.0, -0.0, top, -top, top * 1.1, -top * 4, F.finfo(f).smallest_subnormal / 2,
                F.finfo(f).smallest_subnormal * 1.5, 3 * F.finfo(f).smallest_subnormal / 2]
    flat[: len(specials)] = specials
    if F.fmt(f).has_nan:
        flat[len(specials): len(specials) + 3] = [np.inf, -np.inf, np.nan]
    return x


def _reference(x, scale, f, axis, block_size, saturate):
    attrs = {"saturate": int(saturate)}
    if axis is not None:
        attrs["axis"] = axis
    if block_size is not None:
        attrs["block_size"] = block_size
    zp = helper.make_tensor("zp", ONNX_TYPES[f], scale.shape, [0] * scale.size)
    node = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], **attrs)
    dq = helper.make_node("DequantizeLinear", ["y", "s", "zp"], ["z"], **{k: v for k, v in attrs.items() if k != "saturate"})
    graph = helper.make_graph([node, dq], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                                                helper.make_tensor_value_info("s", SCALE_TYPES[scale.dtype.name], scale.shape)],
                              [helper.make_tensor_value_info("y", ONNX_TYPES[f], x.shape),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, x.shape)], [zp])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    with np.errstate(over="ignore"):  # a float16 dequantize of e5m2's largest values overflows to inf
        return ReferenceEvaluator(model).run(None, {"x": x, "s": scale})


def _expand(s, shape, axis, block_size):
    if axis is None:
        return s
    if block_size is None:
        return s.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return np.repeat(s, block_size, axis=axis)[tuple(slice(0, n) for n in shape)]


@pytest.mark.parametrize("f", list(ONNX_TYPES))
@pytest.mark.parametrize("shape,axis,block_size", LAYOUTS)
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_quantize_dequantize_equal_onnx_reference(rng, f, shape, axis, block_size, saturate, scale_dtype):
    x = _x(rng, shape, f)
    pshape = () if axis is None else (shape[axis],) if block_size is None else \
        tuple(-(-n // block_size) if i == axis else n for i, n in enumerate(shape))
    scale = rng.choice(np.array([1.0, 0.5, 0.375, 2.0, 0.1], scale_dtype), pshape).astype(scale_dtype)
    if not F.fmt(f).has_nan:
        x = np.nan_to_num(x, nan=0.0, posinf=1e30, neginf=-1e30)
    y, z = _reference(x, np.asarray(scale), f, axis, block_size, saturate)
    s = _expand(np.asarray(scale), shape, axis, block_size)
    got = F.quantize(x, s, f, saturate)
    assert got.dtype == F.dtype(f)
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(y).astype(F.dtype(f)).view(np.uint8))
    # DequantizeLinear computes in the scale's type: a float16 scale gives float16, the
    # exact float32 product (two 11-bit significands) rounded once
    # (compared as float32: ml_dtypes 0.6's bfloat16 NaN is no NaN to assert_array_equal)
    f32 = lambda a: np.asarray(a).astype(np.asarray(z).dtype).astype(np.float32)  # noqa: E731
    with np.errstate(over="ignore"):  # e5m2's 57344 times 2 passes float16's 65504: inf, as ONNX's
        np.testing.assert_array_equal(f32(F.dequantize(got, s, f)), f32(z))
    # the QArray path keeps the scale's dtype and gives the same bits (the Numba kernel where installed)
    q = qarray.quantize(x, scale, 0, f, axis, block_size, saturate=saturate)
    assert q.scale.dtype == np.dtype(scale_dtype) and q.scale.shape == np.shape(scale)
    np.testing.assert_array_equal(q.int_repr(), got.view(np.uint8))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(f32(q.dequantize()), f32(z))


@pytest.mark.parametrize("f", ["float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"])
def test_formats_without_nan_saturate_and_refuse_nan(f):
    top = F.finfo(f).max
    got = F.quantize(np.array([1e30, -np.inf, np.inf, top * 2], np.float32), np.float32(1), f, saturate=False)
    np.testing.assert_array_equal(got.astype(np.float32), [top, -top, top, top])
    with pytest.raises(ValueError, match=f"cannot quantize NaN to {f}"):
        F.quantize(np.array([1.0, np.nan], np.float32), np.float32(1), f)


def test_float6_rounds_to_nearest_even_against_exhaustive_grid():
    """float6 (no ONNX type): every midpoint between neighbouring values rounds
    to the one with the even bit pattern, checked over all 64 codes."""
    for f in ("float6_e2m3fn", "float6_e3m2fn"):
        codes = np.arange(64, dtype=np.uint8).view(F.dtype(f))
        vals = np.unique(codes.astype(np.float64))
        vals = vals[vals >= 0]
        mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
        got = F.quantize(mids, np.float32(1), f).astype(np.float64)
        lo, hi = vals[:-1], vals[1:]
        lo_bits = np.array(lo, np.float32).astype(F.dtype(f)).view(np.uint8)
        np.testing.assert_array_equal(got, np.where(lo_bits % 2 == 0, lo, hi))


@pytest.mark.parametrize("f", [f for f in F.FORMATS if f != "mxint8"])
def test_finfo_and_spellings(f):
    i = ml_dtypes.finfo(getattr(ml_dtypes, f))
    got = F.finfo(f)
    assert (got.max, got.smallest_normal, got.smallest_subnormal, got.eps) == (
        float(i.max), float(i.smallest_normal), float(i.smallest_subnormal), float(i.eps))
    for alias in F.FORMATS[f].aliases:
        assert F.fmt(alias) is F.FORMATS[f]
    with pytest.raises(TypeError, match="unknown floating format"):
        F.fmt("float8_e4m3")
    with pytest.raises(TypeError, match="saturate must be True or False"):
        F.quantize(np.ones(2, np.float32), np.float32(1), f if f != "float8_e8m0fnu" else "float8_e5m2", saturate=1)


def test_mxint8_element():
    """MXINT8's element (OCP MX v1.0, 5.3.4): int8 codes times 2**-6, saturating at
    +-127/64 (symmetric, as microsoft/microxcaling's int8 has it), ties to even."""
    assert F.finfo("mxint8") == F.FInfo("mxint8", 127 / 64, 1 / 64, 1 / 64, 1 / 64)
    v = np.array([0.5 / 64, 1.5 / 64, 2.5 / 64, -2.5 / 64, 1.0, 127.5 / 64, 3.0, -2.0, -np.inf], np.float32)
    np.testing.assert_array_equal(F.cast(v, "mxint8"), np.array([0, 2, 2, -2, 64, 127, 127, -127, -127], np.int8))
    np.testing.assert_array_equal(F.values(np.array([-127, 1], np.int8), "mxint8"), np.float32([-127 / 64, 1 / 64]))


# -- the QArray path ---------------------------------------------------------------------
import qarray  # noqa: E402
from qarray import QArray  # noqa: E402


@pytest.mark.parametrize("f", list(ONNX_TYPES))
@pytest.mark.parametrize("shape,axis,block_size", LAYOUTS)
def test_qarray_quantize_dequantize_equal_onnx(rng, f, shape, axis, block_size):
    x = _x(rng, shape, f)
    if not F.fmt(f).has_nan:
        x = np.nan_to_num(x, nan=0.0)
    pshape = () if axis is None else (shape[axis],) if block_size is None else \
        tuple(-(-n // block_size) if i == axis else n for i, n in enumerate(shape))
    scale = rng.choice(np.float32([1.0, 0.5, 0.375, 2.0]), pshape).astype(np.float32)
    for saturate in (True, False):
        q = qarray.quantize(x, scale, 0, f, axis=axis, block_size=block_size, saturate=saturate)
        y, z = _reference(x, np.asarray(scale), f, axis, block_size, saturate)
        assert q.dtype == f and q.dtype.kind == "float" and q.data.dtype == F.dtype(f)
        np.testing.assert_array_equal(q.int_repr(), np.asarray(y).astype(F.dtype(f)).view(np.uint8))
        np.testing.assert_array_equal(q.dequantize(), z)
        assert q.int_repr().dtype == np.uint8
        back = QArray.from_int(q.int_repr(), scale, 0, f, axis, block_size)  # from bit patterns
        np.testing.assert_array_equal(back.int_repr(), q.int_repr())
        np.testing.assert_array_equal(QArray.from_int(q.data, scale, 0, f, axis, block_size).int_repr(), q.int_repr())


def test_spellings_name_one_qdtype():
    d = qarray.qdtype("float8_e4m3fn")
    assert qarray.qdtype("float8e4m3fn") is d and qarray.qdtype("torch.float8_e4m3fn") is d
    assert qarray.qdtype(ml_dtypes.float8_e4m3fn) is d and qarray.qdtype(np.dtype(ml_dtypes.float8_e4m3fn)) is d
    assert qarray.qdtype("float4e2m1") is qarray.qdtype("float4_e2m1fn")
    assert (d.kind, d.bits, d.qmax, d.qmin) == ("float", 8, 448.0, -448.0)
    assert qarray.finfo(d).max == 448.0
    with pytest.raises(TypeError, match="unknown quantized dtype"):
        qarray.qdtype("float8_e8m0fnu")  # a scale type, not an element type


def test_requantize_goes_through_the_real_values(rng):
    x = rng.standard_normal(64).astype(np.float32)
    q8 = qarray.quantize(x, 0.05, 0, "float8_e4m3fn")
    r = q8.requantize(0.02, 3, "qint8")
    np.testing.assert_array_equal(r.int_repr(), qarray.quantize(q8.dequantize(), 0.02, 3, "qint8").int_repr())
    qi = qarray.quantize(x, 0.01, 0, "qint16")
    r = qi.requantize(0.125, 0, "float4_e2m1fn")
    np.testing.assert_array_equal(r.int_repr(), qarray.quantize(qi.dequantize(), 0.125, 0, "float4_e2m1fn").int_repr())


def test_floating_errors(rng):
    x = rng.standard_normal(8).astype(np.float32)
    q = qarray.quantize(x, 0.1, 0, "float8_e5m2")
    with pytest.raises(ValueError, match="zero_point must be 0 for the floating format float8_e5m2, got 2"):
        qarray.quantize(x, 0.1, 2, "float8_e5m2")
    with pytest.raises(TypeError, match="saturate= is for floating formats; qint8 is an integer format"):
        qarray.quantize(x, 0.1, 0, "qint8", saturate=False)
    with pytest.raises(TypeError, match="saturate must be True or False"):
        qarray.quantize(x, 0.1, 0, "float8_e5m2", saturate="no")
    for op in (lambda: qarray.add(q, q, scale=1.0), lambda: qarray.relu(q), lambda: qarray.cat([q, q])):
        with pytest.raises(TypeError, match="takes integer formats; float8_e5m2 is a floating format"):
            op()
    with pytest.raises(TypeError, match="use qarray.finfo"):
        qarray.iinfo("float8_e5m2")
    with pytest.raises(ValueError, match="a uint8 code above 15 is none of them"):
        QArray.from_int(np.array([3, 200], np.uint8), 1.0, 0, "float4_e2m1fn")
    with pytest.raises(TypeError, match="come as an ml_dtypes float8_e5m2 array or as uint8 bit patterns, got int16"):
        QArray.from_int(np.array([3], np.int16), 1.0, 0, "float8_e5m2")
    with pytest.raises(TypeError, match="mode=, rounding=, out= and seed= do not apply"):
        q.requantize(0.1, 0, "qint8", rounding="half_away")


def test_pack_gives_bit_patterns_and_save_refuses_floating_formats(rng, tmp_path):
    x = rng.standard_normal(7).astype(np.float32)
    q8 = qarray.quantize(x, 0.1, 0, "float8_e4m3fn")
    np.testing.assert_array_equal(q8.pack(), q8.int_repr())
    q4 = qarray.quantize(x, 0.5, 0, "float4_e2m1fn")
    bits = q4.int_repr()
    want = np.array([bits[i] | (bits[i + 1] << 4 if i + 1 < 7 else 0) for i in range(0, 7, 2)], np.uint8)
    np.testing.assert_array_equal(q4.pack(), want)  # ONNX's order: the first value in the low nibble


def _torchao_pack_uint6(d):
    """torchao's MXFP6 packing as published (pytorch/ao,
    torchao/prototype/mx_formats/kernels.py, ``pack_uint6_pytorch``),
    transcribed with its own formulas for the three bytes of every four values."""
    d = d.astype(np.uint8)
    a = (d[1::4] >> 2) | ((d[::4] << 2) & 0xF0)
    b = (d[2::4] >> 2) | ((d[3::4] << 2) & 0xF0)
    c = (d[::4] << 6) | ((d[1::4] << 4) & 0x30) | ((d[3::4] << 2) & 0xC) | (d[2::4] & 0x3)
    return np.stack([a, b, c], axis=-1).reshape(-1)


def test_float6_packs_four_in_three_bytes_as_torchao(rng):
    bits = rng.integers(0, 64, 4 * 50).astype(np.uint8)
    bits[:8] = [0x3F, 0x00, 0x2A, 0x15, 0x01, 0x20, 0x3E, 0x07]
    np.testing.assert_array_equal(F.pack6(bits), _torchao_pack_uint6(bits))
    np.testing.assert_array_equal(F.pack6(bits[:4]), [240, 90, 198])  # worked by hand from the formulas
    for n in (1, 2, 3, 5, 199):  # padded with zero values to whole groups of four
        np.testing.assert_array_equal(F.unpack6(F.pack6(bits[:n]), n), bits[:n])
        assert F.pack6(bits[:n]).size == -(-n // 4) * 3
    x = rng.standard_normal(11).astype(np.float32)
    q = qarray.quantize(x, 0.5, 0, "float6_e2m3fn")
    np.testing.assert_array_equal(q.pack(), F.pack6(q.int_repr()))
    np.testing.assert_array_equal(qarray.unpack(q.pack(), "float6_e2m3fn", (11,)).view(np.uint8), q.int_repr())


@pytest.mark.parametrize("suffix", ["npz", "safetensors"])
def test_save_load_floating_formats_exactly(rng, tmp_path, suffix):
    x = _x(rng, (6, 10), "float8_e5m2")
    arrays = {"e4m3": qarray.quantize(np.nan_to_num(x, posinf=1e9, neginf=-1e9), np.float32(64), 0, "float8_e4m3fn"),
              "e5m2": qarray.quantize(x, np.linspace(1, 4, 10).astype(np.float32), 0, "float8_e5m2", axis=1,
                                      saturate=False),
              "fp4": qarray.quantize(np.nan_to_num(x, nan=0.0), np.float32(1e4), 0, "float4_e2m1fn", axis=1,
                                     block_size=4),
              "fp6": qarray.quantize(np.nan_to_num(x, nan=0.0)[:, :7], np.float32(1e3), 0, "float6_e3m2fn")}
    path = tmp_path / f"m.{suffix}"
    qarray.save(path, arrays)
    got = qarray.load(path)
    for k, q in arrays.items():
        assert got[k].dtype is q.dtype and (got[k].axis, got[k].block_size) == (q.axis, q.block_size)
        np.testing.assert_array_equal(got[k].int_repr(), q.int_repr())  # bits: NaN, inf and -0 included
        np.testing.assert_array_equal(got[k].scale, q.scale)


@pytest.mark.parametrize("f", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
@pytest.mark.parametrize("axis,block_size", [(None, None), (0, None), (1, 4)])
def test_quantize_dynamic_scales_amax_to_the_largest_value(rng, f, axis, block_size):
    x = rng.standard_normal((3, 8)).astype(np.float32) * 5
    x[0] = 0.0  # an all-zero row: scale 1 where it is a slice of its own
    q = qarray.quantize_dynamic(x, f, axis=axis, block_size=block_size)
    top = F.finfo(f).max
    if axis is None:
        want = np.float32(np.abs(x).max()) / np.float32(top)
    elif block_size is None:
        a = np.abs(x).max(axis=1).astype(np.float32)
        want = np.where(a == 0, np.float32(1), a / np.float32(top))
    else:
        a = np.abs(x).reshape(3, 2, 4).max(axis=2).astype(np.float32)
        want = np.where(a == 0, np.float32(1), a / np.float32(top))
    np.testing.assert_array_equal(q.scale, want)
    assert q.scale.dtype == np.float32
    np.testing.assert_array_equal(q.int_repr(), qarray.quantize(x, want, 0, f, axis=axis, block_size=block_size).int_repr())
    assert np.abs(q.dequantize()).max() == pytest.approx(np.abs(x).max(), rel=0.07)  # the largest value lands on +-max


def _boundaries(f, rng):
    """float32 values at every code of ``f``, every midpoint between neighbours, one
    ulp either side of each, beyond the range, specials, and random values."""
    d = F.dtype(f)
    allc = np.arange(1 << F.fmt(f).bits, dtype=np.uint8).view(d).astype(np.float64)
    vals = np.unique(allc[np.isfinite(allc)])
    mids = (vals[:-1] + vals[1:]) / 2
    top, sub = vals[-1], vals[vals > 0][0]
    ext = np.array([top * 1.0625, top * 1.125, top * 1.1875, top * 1.25, top * 2, sub / 2, sub / 4])
    base = np.concatenate([vals, mids, ext, -ext]).astype(np.float32)
    return np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf)),
                           np.float32([0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 3e38, -3e38]),
                           rng.standard_normal(5000).astype(np.float32) * np.float32(top / 3),
                           (rng.standard_normal(5000) * 2.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)])


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("f", [f for f in F.FORMATS if f not in ("float8_e8m0fnu", "mxint8")])
def test_kernel_rounding_on_every_boundary(kernels, rng, f, saturate):
    """The Numba kernel's rounding on the float32 bits (``_fbits``) equals ml_dtypes'
    cast at every boundary of every format, both saturate modes, ONNX's zeros (the
    QArray path) and MX's (signed zeros, NaN allowed), per tensor, axis and block."""
    from qarray.backends import get

    b = get("numpy")
    x = _boundaries(f, rng)
    if F.fmt(f).has_nan:
        x = np.concatenate([x, np.float32([np.nan, -np.nan])])
    want = F.quantize(x, np.float32(1), f, saturate).view(np.uint8)
    np.testing.assert_array_equal(b.quantize_float(x, np.float32(1), qarray.qdtype(f), None, None, saturate).view(np.uint8), want)
    mx = b.quantize_float(x, np.float32(1), qarray.qdtype(f), None, None, saturate, mx=True).view(np.uint8)
    ok = ~np.isnan(x)
    np.testing.assert_array_equal(mx[ok], F.cast(x[ok], f, saturate).view(np.uint8))
    x2 = x[: x.size // 60 * 60].reshape(60, -1)
    s = rng.uniform(0.25, 4, 60).astype(np.float32)
    for axis, block, sp in ((0, None, s), (1, 7, rng.uniform(0.25, 4, (60, -(-x2.shape[1] // 7))).astype(np.float32))):
        got = b.quantize_float(x2, sp, qarray.qdtype(f), axis, block, saturate)
        np.testing.assert_array_equal(got.view(np.uint8), F.quantize(x2, expand(sp, x2.shape, axis, block), f,
                                                                    saturate).view(np.uint8))
    if not F.fmt(f).has_nan:
        with pytest.raises(ValueError, match=f"cannot quantize NaN to {f}, which holds no NaN"):
            b.quantize_float(np.float32([1, np.nan]), np.float32(1), qarray.qdtype(f), None, None, saturate)



def _rounded_once(x, f, saturate):
    """The codes of float64 ``x`` rounded once to format ``f``, worked out in
    Fractions from the format's table of values (no cast of ml_dtypes'): the
    nearest value, ties to the even code; past the largest value +-max
    (``saturate``, or a format without inf and NaN) else the overflow code; the
    sign bit as ONNX sets it (-0.0 is +0 in float4/6, no -0 in the fnuz formats)."""
    from fractions import Fraction

    import qarray

    fm, c = F.fmt(f), F.codes(f, saturate)
    positive = np.arange(1 << (qarray.qdtype(f).bits - 1), dtype=np.uint8)  # ascending in value
    vals = positive.view(F.dtype(f)).astype(np.float64)
    codes, vals = [int(k) for k in positive[np.isfinite(vals)]], [Fraction(v) for v in vals[np.isfinite(vals)]]
    nxt = 2 * vals[-1] - vals[-2]  # the value code maxc + 1 would have
    out = []
    for xv in x:
        v = Fraction(abs(xv)) if np.isfinite(xv) else 2 * nxt
        grid = [(w, k) for w, k in zip(vals + [nxt], codes + [c.maxc + 1])]
        (lo, clo), (hi, chi) = max((p for p in grid if p[0] <= v), key=lambda p: p[0]), \
            min((p for p in grid if p[0] >= v), key=lambda p: p[0], default=(None, c.maxc + 1))
        code = clo if hi is None and v == lo or hi is not None and (
            v - lo < hi - v or v - lo == hi - v and clo % 2 == 0) else chi
        if code > c.maxc:
            code = c.ovf
        negative = np.signbit(xv) and (xv != 0 or fm.has_nan)
        if code == 0x180 or (code == 0 and fm.name.endswith("fnuz")):  # fnuz: one NaN, no -0
            code &= 0xFF
        elif negative:
            code |= 1 << c.sign_at
        out.append(code)
    return np.array(out, np.uint8)


@pytest.mark.parametrize("f", [f for f in F.FORMATS if f not in ("float8_e8m0fnu", "mxint8")])
@pytest.mark.parametrize("saturate", [True, False])
def test_float64_input_is_rounded_once_whatever_ml_dtypes_does(f, saturate):
    """float64 values a hair either side of every value and midpoint of the format
    (where a detour through float32 rounds twice: ml_dtypes 0.6.0 for float8,
    0.7.0 still for float4, 0.2500000000002274 -> 0), and beyond its range,
    against the rounding worked out in Fractions from the format's table."""
    import qarray

    x = float64_boundaries(f)
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):
        got = qarray.quantize(x, 1.0, 0, f, saturate=saturate).int_repr().view(np.uint8)
    np.testing.assert_array_equal(got, _rounded_once(x, f, saturate), err_msg=f)
    if f == "float4_e2m1fn":
        assert got[x == 0.2500000000002274] == 1  # 0.5, not 0


@pytest.mark.parametrize("f", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_choose_qparams_of_a_floating_format_is_symmetric(f):
    """A floating format has no zero point: its scale maps max |x| onto the
    format's largest value whether or not symmetric= is asked for."""
    import qarray

    top = np.float32(F.finfo(f).max)
    for lo, hi in ((-1.0, 3.0), (0.5, 2.0), (-7.0, -1.0)):
        want = np.float32(max(abs(lo), abs(hi))) / top
        for symmetric in (False, True):
            s, z = qarray.choose_qparams(lo, hi, f, symmetric=symmetric)
            assert (s, z) == (want, 0), (lo, hi, symmetric)
