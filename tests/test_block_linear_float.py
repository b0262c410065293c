"""BlockLinear's float activations on weights packed once (qarray/backends/cpu/blocks_float.py):
the float contract of qarray.ops.block_linear, bit for bit against the generic code, on each
instruction set."""

import numpy as np
import pytest

import qarray as qa
import qarray.nn as qnn
from _reference import assert_same, force_isa, same_on_threads
from qarray import QArray, _blocks
from test_block_linear import GGML, GROUPED, _blocks_of, _k, ref_float, weights

ml_dtypes = pytest.importorskip("ml_dtypes")
numba = pytest.importorskip("numba")

from qarray.backends.cpu.blocks_float import float_packable  # noqa: E402  (Numba's)


# every format the packed float path takes (value tables of 16 entries or fewer), and some it does not
COVERED = [n for n in GGML + GROUPED + ["int4_g32_f16", "uint4_g64_f16_bias", "uint4_g64_f16_zp"]
           if float_packable(_blocks.get(n))]
DECLINED = [n for n in GGML + GROUPED if not float_packable(_blocks.get(n))]


@pytest.fixture(params=["avx512vnni", "avx2", "portable"])  # (AMX's is AVX-512's; AVX-VNNI's AVX2's)
def only(request, monkeypatch):
    return force_isa(monkeypatch, request.param)


def _generic(x, w, bias=None):
    with qa.config.using(numba=False):
        return qa.linear(x, w, bias)


def test_covered_formats():
    assert {"NF4_G64_F32", "INT4_G128_F16", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4", "Q4_K",
            "UINT4_G64_F16_BIAS", "UINT4_G32_BF16_BIAS", "E2M1_G16_E4M3_GDIV"} <= {n.upper() for n in COVERED}
    assert {"Q8_0", "Q5_K", "Q6_K", "INT8_G32_BF16", "IQ2_XS"} <= {n.upper() for n in DECLINED}


@pytest.mark.parametrize("name", sorted(set(COVERED)))
def test_packed_float_every_format(name, rng, only):
    """Every covered format on each instruction set: 37 rows (two groups of 16 and a part), one row of
    x and nine (a call of RM = 8 rows, then one), with and without bias, float32, float16 and
    bfloat16 x: the generic code's bits and the contract's (``ref_float``)."""
    k_len = _k(name)
    w = weights(name, 37, k_len, rng)
    bias = rng.standard_normal(37).astype(np.float32)
    layer, plain = qnn.BlockLinear(w, bias), qnn.BlockLinear(w)
    assert layer._packed_float is not None
    for m in (1, 9):
        x = (rng.standard_normal((m, k_len)) * 3).astype(np.float32)
        want = _generic(x, w, bias)
        assert_same(layer(x), want)
        assert_same(want, ref_float(x, w, bias))
        assert_same(plain(x), _generic(x, w))
    for dt in (np.float16, ml_dtypes.bfloat16):
        x = rng.standard_normal((2, 3, k_len)).astype(dt)
        assert_same(plain(x), _generic(x, w))
        assert_same(plain(x, dtype="like"), _generic(x, w).astype(dt))


@pytest.mark.parametrize("name", ["uint4_g64_f16_zp", "uint4_g64_f16_bias", "uint4_g32_bf16_bias", "int4_g128_f16",
                                  "nf4_g64_f32", "Q4_1", "Q4_K", "IQ4_NL"])
def test_packed_float_extremes(name, only):
    """Codes at both ends, zero points at both ends, float16 scales (and offsets) at 65504 (float16
    products past it: inf), at the smallest subnormal 2^-24 (products rounded among float16's
    subnormals) and at ties (scale 1 + 2^-10 times odd values), inf and NaN (with payloads) scales,
    x with inf, NaN, 2^127 and 2^-149: against the generic code and the contract, bit for bit."""
    fmt = _blocks.get(name)
    k_len, n = 2 * fmt.block if fmt.block < 128 else fmt.block, 19
    nblocks = n * k_len // fmt.block
    fields = fmt.unpack(np.zeros((nblocks, fmt.nbytes), np.uint8))
    top = len(fmt.values) - 1
    b = np.arange(nblocks)[:, None]
    fields["q"] = np.select([b % 3 == 0, b % 3 == 1], [top, 0], np.arange(fields["q"].shape[1]) % (top + 1)
                            ).astype(fields["q"].dtype)
    ends = np.array([65504, 2.0**-24, 1 + 2.0**-10, -65504, np.inf, 0.5, -3.0, 2.0**-14], np.float32)
    for fname, f in fmt.fields.items():
        if f.view == np.float16:
            s = np.resize(ends, fields[fname].size).reshape(fields[fname].shape).astype(np.float16)
            bits = s.view(np.uint16)
            bits[np.arange(bits.shape[0]) % 7 == 5] = 0x7C01  # a NaN with a payload
            fields[fname] = bits.view(np.float16)
        elif f.bf16:
            bits = np.array([0x7F7F0000, 0x00010000, 0xBFC00000, 0x7F800000, 0x3F000000, 0x7F810000], np.uint32)
            fields[fname] = np.resize(bits, fields[fname].size).reshape(fields[fname].shape).view(np.float32)
        elif f.view == np.float32:
            fields[fname] = np.resize(np.array([3.0e38, 1e-45, -1.5, np.nan], np.float32), fields[fname].size
                                      ).reshape(fields[fname].shape)
        elif fname in ("scales", "mins"):
            fields[fname] = np.full(fields[fname].shape, (1 << f.bits) - 1, fields[fname].dtype)
    if fmt.zero is not None:
        zmax = (1 << fmt.fields[fmt.zero].bits) - 1
        fields[fmt.zero] = (np.where(b % 2 == 0, 0, zmax) * np.ones(fields[fmt.zero].shape, np.int64)
                            ).astype(fields[fmt.zero].dtype)
    w = _blocks_of(name, n, fields)
    x = np.ones((9, k_len), np.float32) * np.array([[1.5], [-2.0], [2.0**127], [2.0**-149], [1.0], [3.0], [-1.0],
                                                    [0.25], [7.0]], np.float32)
    x[4, 5], x[5, 7], x[6, 1] = np.inf, np.nan, -np.inf
    layer = qnn.BlockLinear(w)
    got, nan = layer(x), np.isnan(layer(x))
    # which NaN's payload (and sign) an operation keeps where two NaNs meet (a NaN scale's, inf * 0's, a
    # negated offset's) is the compiler's choice of operand order: NaNs where they are, every other bit
    for want in (_generic(x, w), ref_float(x, w), qa.linear(x, w)):
        assert_same(got[~nan], want[~nan])
        assert (nan == np.isnan(want)).all()
    one = layer(x[2:3])
    assert_same(one[~np.isnan(one)], got[2:3][~nan[2:3]])
    assert np.isinf(got).any() and np.isnan(got).any()


def test_packed_float_threads_and_long_rows(rng, only, monkeypatch):
    """K = 8192, 16 * 9 + 5 rows, both threads taking groups, 1 and 11 rows of x: the same bits as one
    thread and as the generic code."""
    from qarray.backends.cpu import pool

    monkeypatch.setattr(pool, "GRAIN", 1)
    for name in ("int4_g128_f16", "uint4_g32_bf16_bias"):
        w = weights(name, 16 * 9 + 5, 8192, rng)
        layer = qnn.BlockLinear(w)
        for m in (1, 11):
            x = rng.standard_normal((m, 8192)).astype(np.float32)
            assert_same(same_on_threads(lambda: layer(x)), _generic(x, w))


def test_packed_float_sum_order(only):
    """The sum runs in k order per output, one rounding an add: x = 1, 2^-60, -1, 2^-60 against ones
    sums to 2^-60 in k order (1 + 2^-60 rounds to 1), where adjacent k summed in pairs first, or k in
    reverse, give 0; the same again across a sub-block's end (k = 32 .. 35): 2^-60 again."""
    w = qa.quantize(np.ones((16, 64), np.float32), dtype="nf4_g64_f32")
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = x[0, 32:36] = [1.0, 2.0**-60, -1.0, 2.0**-60]
    layer = qnn.BlockLinear(w)
    assert_same(layer(x), ref_float(x, w))
    assert (layer(x) == np.float32(2.0**-60)).all()


@pytest.mark.parametrize("name", ["int4_g32_f16", "uint4_g32_f16_bias", "uint4_g32_bf16_bias", "nf4_g64_f32"])
def test_packed_float_nan_scales(name, rng, only):
    """NaN scales with payloads (and inf ones), one NaN a sum: its bits as dequantize leaves them, through
    the sums (test_block_linear's test_nan_scales, on the packed path)."""
    w = weights(name, 20, 128, rng)
    fmt = w.dtype.layout
    fields = fmt.unpack(w.data.reshape(-1, fmt.nbytes))
    half = fmt.fields["d"].view == np.float16
    d = fields["d"].view(np.uint16 if half else np.uint32).copy()
    nan, inf = (0x7C01, 0x7C00) if half else (0x7F810000, 0x7F800000)
    d[0], d[3], d[6] = nan, nan | (0x200 if half else 0x400000), inf
    fields["d"] = d.view(np.float16) if half else d.view(np.float32)
    w = QArray.from_blocks(fmt.pack(fields).reshape(20, -1), name)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    assert np.isnan(w.dequantize()).any()
    layer = qnn.BlockLinear(w)
    assert_same(layer(x), ref_float(x, w))
    assert_same(layer(x), _generic(x, w))


def test_packed_float_declines(rng):
    """Act-order weights, and formats of more than 16 values, keep the generic kernels (no packed
    float weights); with Numba turned off after packing, the layer runs the generic code."""
    w = weights("uint4_g32_f16_zp", 32, 256, rng)
    wp = QArray._blocks(w.data, w.dtype, w._backend, rng.permutation(256))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    layer = qnn.BlockLinear(wp)
    assert layer._packed_float is None
    assert_same(layer(x), ref_float(x, wp))
    for name in ("Q8_0", "Q6_K"):
        assert qnn.BlockLinear(weights(name, 16, 256, rng))._packed_float is None
    layer = qnn.BlockLinear(w)
    assert layer._packed_float is not None
    with qa.config.using(numba=False):
        assert_same(layer(x), qa.linear(x, w))
    assert_same(layer(np.zeros((0, 256), np.float32)), np.zeros((0, 32), np.float32))
