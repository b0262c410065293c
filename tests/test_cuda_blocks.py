"""linear and dequantize on block-format weights in CUDA (cuda/blocks.cu) without a GPU: the host
build of the kernels, launched as CupyBackend launches them, against the NumPy backend's generic
code bit for bit: every format, both of linear's modes and both of its float paths (block_gemv
for M <= 16, dequantize-then-GEMM above), act-order columns, tensor scales, biases, NaN and inf
in x and in the weights' parameters, codes and zero points at their ends, scales at float16's
and float32's extremes, K that ends inside a chunk or a tile.

The host build gives the device's NaN (one NaN, no sign or payload) for every operation of the
kernels, so a NaN result that the kernels do not put right to x86's (NumPy's) shows here."""

import math
import shutil

import numpy as np
import pytest

import qarray as qa
from qarray import QArray, _blocks
from qarray.backends import get
from qarray.backends._cuda import BLOCK_GEMV_ROWS, CUDA_DIR, PLAN_INTEGERS, block_plan

from _reference import assert_same
from cuda_host.harness import HostCupyBackend, build

pytest.importorskip("ml_dtypes")

GGML = sorted(k for k, f in _blocks.FORMATS.items() if f.ggml is not None)
GROUPED = ["int4_g128_f16", "uint4_g64_f16_zp", "int8_g32_bf16", "uint4_g32_bf16_bias", "uint4_g32_f16_bias",
           "int3_g32_f16", "nf4_g64_f32", "fp4bnb_g64_f32", "e4m3_g32_f16", "e2m1_g32_e8m0", "e2m1_g16_e4m3_gdiv",
           "e2m1_g16_e4m3_gmul", "int8_g64_f32_scb", "uint8_g32_f16_zp", "int7_g24_bf16", "uint2_g8_f32_zp"]
FORMATS = GGML + GROUPED
LATTICES = [n for n in FORMATS if _blocks.get(n).plan is None]  # their values come from functions: NumPy's
Q8 = [n for n in FORMATS if qa.ops.block_linear.q8_supported(_blocks.get(n)) is None]


def _fields(name, n, k, rng):
    """The fields of ``n x k`` weights of format ``name``: random codes, zero points and integer
    sub-scales (every value), float scales of either sign in [0.02, 2), table scales (E8M0, E4M3) of
    moderate size."""
    fmt = _blocks.get(name)
    f = fmt.unpack(rng.integers(0, 256, (n * k // fmt.block, fmt.nbytes), dtype=np.uint8))
    tables = {} if callable(fmt.scale) else {spec[1][0]: np.asarray(spec[1][1]) for spec in (fmt.scale, fmt.offset and fmt.offset[0])
                                             if spec and spec[1] is not None}
    for name_, field in fmt.fields.items():
        shape = f[name_].shape
        if field.bf16 or field.view.kind == "f":
            v = (rng.uniform(0.02, 2, shape) * rng.choice([-1, 1], shape)).astype(np.float32)
            f[name_] = v.astype(np.float16) if field.view == np.float16 else _blocks.rounded(v, "bfloat16") \
                if field.bf16 else v
        elif name_ in tables and np.any(tables[name_] != np.rint(tables[name_])):
            t = tables[name_]
            f[name_] = rng.choice(np.flatnonzero((np.abs(t) > 2.0**-10) & (np.abs(t) < 2.0**10)), shape).astype(field.store)
    return f


def _weights(name, n, k, rng, fields=None, g=0.37):
    fmt = _blocks.get(name)
    raw = fmt.pack(_fields(name, n, k, rng) if fields is None else fields).reshape(n, -1)
    return QArray.from_blocks(raw, name, global_scale=None if fmt.tensor_scale is None else np.float32(g))


def _k(name):
    """K for format ``name``: whole blocks, whole Q8_0 blocks, and (blocks up to 128) a last chunk of
    block_gemv that is half full."""
    block = _blocks.get(name).block
    return 2 * block if block > 128 else 3 * math.lcm(block, 32)


def _numpy(fn):
    with qa.config.using(numba=False), np.errstate(over="ignore", invalid="ignore"):  # (inf, signalling NaN casts)
        return fn(get("numpy"))


def _same(host, fn, kernel):
    """``fn(backend)`` on the NumPy backend's generic code and on ``host``, bit for bit, ``kernel``
    (a name's start) the last kernel ``host`` launched, or None: none of cuda/blocks.cu's."""
    host.launches.clear()
    want = _numpy(fn)
    got = fn(host)
    assert_same(got, want)
    names = [name for name, *_ in host.launches]
    if kernel is None:
        assert not any(n.startswith("block_") for n in names), names
    else:
        assert names and names[-1].startswith(kernel), names
    return got


def _linear(w, x, columns=None, bias=None):
    return lambda b: b.block_linear(x, w.data, w.dtype.layout, w.global_scale, columns, bias)


def _linear_q8(w, xq, bias=None):
    return lambda b: b.block_linear_q8(xq.data, w.data, w.dtype.layout, bias)


@pytest.mark.parametrize("name", FORMATS)
def test_every_format(host, rng, name):
    """dequantize; linear with a token (block_gemv), with a prompt (block_gemm), with Q8_0 activations
    where the format takes them (block_gemv_q8), odd N and K past a whole chunk."""
    k = _k(name)
    w = _weights(name, 37, k, rng)
    plain = name in LATTICES
    _same(host, lambda b: b.dequantize_blocks(w.data, w.dtype.layout, np.float32, w.global_scale),
          None if plain else "block_decode_float32")
    x = rng.standard_normal((19, k)).astype(np.float32).astype(np.float64)
    bias = rng.standard_normal(37)
    _same(host, _linear(w, x[:3]), None if plain else "block_gemv")
    _same(host, _linear(w, x, bias=bias), None if plain else "block_gemm")
    if name in Q8:
        xq = qa.quantize(x[:, :k].astype(np.float32), dtype="Q8_0")
        _same(host, _linear_q8(w, xq[:2]), "block_gemv_q8")
        _same(host, _linear_q8(w, xq, bias), "block_gemv_q8")  # 19 rows: a second tile of 3


def test_plans():
    """The kernels read every format with a table of values; the lattices (values from functions) are
    NumPy's; Q8_0 activations meet integer values only."""
    assert LATTICES == ["IQ1_M", "IQ1_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_S", "IQ3_XXS", "TQ1_0"]
    assert all((block_plan(_blocks.get(n)) is None) == (n in LATTICES) for n in FORMATS)
    assert all(block_plan(_blocks.get(n))[0][PLAN_INTEGERS] >= 0 for n in Q8)
    assert len(Q8) == 24 and not {"nf4_g64_f32", "e4m3_g32_f16", "e2m1_g16_e4m3_gdiv", "int8_g64_f32_scb"} & set(Q8)
    ints, floats = block_plan(_blocks.get("Q5_0"))
    # Q5_0's element 17: its low 4 bits the high nibble of byte 7 (the nibbles from byte 6), its fifth bit
    # bit 17 of the 32 from byte 2: bit 1 of byte 4
    r = ints[ints[8] + 17 * ints[9]:ints[8] + 18 * ints[9]].tolist()
    assert r == [7 << 12 | 0 << 7 | 4 << 3 | 4, 4 << 12 | 4 << 7 | 1 << 3 | 1]


@pytest.mark.parametrize("name", ["uint4_g32_f16_zp", "Q4_K"])
def test_act_order(host, rng, name):
    """GPTQ's act-order: stored column i holds logical column columns[i]; block_gemv reads the stored
    columns in logical order, the GEMM's decode writes them there."""
    w = _weights(name, 35, 512, rng)
    columns = rng.permutation(512)
    x = rng.standard_normal((18, 512)).astype(np.float32).astype(np.float64)
    small = _same(host, _linear(w, x[:5], columns), "block_gemv")
    assert not np.array_equal(small, _numpy(_linear(w, x[:5])))
    _same(host, _linear(w, x, columns, rng.standard_normal(35)), "block_gemm")


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("name", ["Q4_1", "e2m1_g16_e4m3_gdiv", "uint4_g32_bf16_bias"])
def test_dequantize_dtypes(host, rng, name, dtype):
    """float16 and float64 results, NaN, inf and float16's overflow included, rows of any shape."""
    fmt = _blocks.get(name)
    f = _fields(name, 4, 2 * 64, rng)
    scale = next(n for n in fmt.fields if n != "q")
    d = f[scale].copy()
    if d.dtype == np.float16:
        d[0], d[1], d[2] = np.float16(np.nan), np.float16(np.inf), np.float16(60000)
    elif d.dtype == np.float32:  # bfloat16: NaN with a payload, inf, beyond float16
        d[0], d[1], d[2] = np.uint32(0x7FC10000).view(np.float32), np.inf, 2.0**127
    else:  # E4M3 codes: NaN, the largest (over a tensor scale of 1e-36: beyond float32)
        d[0], d[1] = 0x7F, 0x7E
    f[scale] = d
    w = _weights(name, 4, 128, rng, f, g=1e-36)
    raw = w.data.reshape(2, 2, -1)  # rows of any shape
    got = _same(host, lambda b: b.dequantize_blocks(raw, fmt, dtype, w.global_scale), f"block_decode_{np.dtype(dtype).name}")
    assert got.shape == (2, 2, 128) and np.isnan(got).any() and np.isinf(got).any()


def _payload_nans(fmt, f, name, rows):
    """NaN with a payload in field ``name`` of the first block of each of ``rows`` (fields ``f``)."""
    d = f[name].view(np.uint16 if f[name].dtype == np.float16 else np.uint32).copy()
    for i, r in enumerate(rows):
        d[r] = (0x7C01 + i if d.dtype == np.uint16 else 0x7F810000 + (i << 16)) | (0x8000 if i % 2 and d.dtype == np.uint16 else 0)
    f[name] = d.view(f[name].dtype)


@pytest.mark.parametrize("name", ["Q4_1", "uint4_g32_bf16_bias"])
def test_nan_and_inf(host, rng, name):
    """NaN results carry x86's NaN, as NumPy's do: the first NaN a sum meets (a weight's, an
    activation's, quieted, sign and payload kept) or the default NaN where inf meets -inf or 0; in
    each of block_gemv, the GEMM (its decode and its tiles) and the Q8_0 path."""
    fmt = _blocks.get(name)
    n, k = 9, 256
    f = _fields(name, n, k, rng)
    nb = k // fmt.block
    _payload_nans(fmt, f, "d", [1 * nb, 2 * nb + 1])  # rows 1 and 2: their scale NaN, in the first and second block
    _payload_nans(fmt, f, "m", [3 * nb + 2])  # row 3: an offset NaN in the third block
    d = f["d"].copy()
    d[4 * nb + 1] = np.inf  # row 4: an inf scale (its weights +-inf, or NaN where a code meets the offset)
    f["d"] = d
    w = _weights(name, n, k, rng, f)
    x = rng.standard_normal((20, k)).astype(np.float32)
    x[0, 40] = np.uint32(0x7FC12345).view(np.float32)  # NaN with a payload, after the weights' NaN of block 0
    x[1, 3] = np.uint32(0xFFC54321).view(np.float32)  # before them: x's NaN comes first
    x[2, 7], x[2, 100] = np.inf, -np.inf  # inf - inf
    x[3, 200] = -np.inf
    x[4, 0] = np.float32(3e38)
    x64 = x.astype(np.float64)
    bias = rng.standard_normal(n)
    bias[5] = np.uint64(0x7FF8000000000123).view(np.float64)  # a NaN bias: its payload
    small = _same(host, _linear(w, x64[:6], bias=bias), "block_gemv")  # (row 5 plain)
    big = _same(host, _linear(w, x64, bias=bias), "block_gemm")
    bits = {int(v) for v in np.concatenate([small.ravel(), big.ravel()]).view(np.uint32) if (v & 0x7FFFFFFF) > 0x7F800000}
    assert 0xFFC00000 in bits and len(bits) >= 5  # the default NaN, and payloads of x, the weights, the bias
    assert np.isinf(small).any() and np.isfinite(small).any()
    xq = qa.quantize(rng.standard_normal((18, k)).astype(np.float32), dtype="Q8_0")  # (no NaN in Q8_0's x)
    raw = xq.data.copy()
    raw[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # an inf activation scale
    if qa.ops.block_linear.q8_supported(fmt) is None:
        _same(host, _linear_q8(w, QArray.from_blocks(raw, "Q8_0"), bias), "block_gemv_q8")


def test_sum_order_and_tails(host, rng):
    """Sums in increasing k, K ending inside a chunk and a tile (groups of 24, blocks of 8 codes at a
    time): 1 + 2^-30 - 1 is 2^-30 only in that order."""
    w = _weights("int4_g24_f16", 3, 24 * 5, rng)
    x = np.zeros((20, 24 * 5))
    x[:, 0], x[:, 1], x[:, 119] = 1, 2.0**-30, -1
    ones = _blocks.get("int4_g24_f16").pack({"d": np.full((15, 1), 1, np.float16), "q": np.full((15, 24), 9, np.uint8)})
    w1 = QArray.from_blocks(ones.reshape(3, -1), "int4_g24_f16")
    assert _same(host, _linear(w1, x[:2]), "block_gemv")[0, 0] == np.float32(2.0**-30)
    assert _same(host, _linear(w1, x), "block_gemm")[19, 2] == np.float32(2.0**-30)
    x = rng.standard_normal((20, 120))
    _same(host, _linear(w, x[:BLOCK_GEMV_ROWS]), "block_gemv")
    _same(host, _linear(w, x), "block_gemm")


def test_extremes(host, rng):
    """Codes and zero points at both ends, scales at float16's largest and smallest (subnormal),
    float32 subnormal scales, products beyond float32 (inf), in every path."""
    fmt = _blocks.get("uint8_g32_f16_zp")
    n, k = 6, 128
    f = _fields("uint8_g32_f16_zp", n, k, rng)
    f["q"][0::2], f["q"][1::2] = 0, 255
    f["q"][:, ::3] = 128
    f["z"][0::2], f["z"][1::2] = 0, 255
    d = f["d"].copy()
    d[:4], d[4:8] = np.float16(65504), np.float16(2.0**-24)  # rows 0 and 1 large, 1 and 2 subnormal float16
    f["d"] = d
    w = _weights("uint8_g32_f16_zp", n, k, rng, f)
    x = (rng.standard_normal((17, k)) * 1e30).astype(np.float32).astype(np.float64)
    _same(host, _linear(w, x[:1]), "block_gemv")
    y = _same(host, _linear(w, x), "block_gemm")
    assert not np.isfinite(y[:, :2]).all()
    _same(host, _linear_q8(w, qa.quantize(rng.standard_normal((17, k)).astype(np.float32), dtype="Q8_0")),
          "block_gemv_q8")
    codes = np.tile(np.array([127, -128] * 16, np.int8), (2, 1))  # Q8_0 at both ends against itself
    q8 = _blocks.get("Q8_0")
    wq = QArray.from_blocks(q8.pack({"d": np.float16([65504, -65504]), "q": codes}).reshape(2, 34), "Q8_0")
    xq = QArray.from_blocks(q8.pack({"d": np.float16([65504]), "q": codes[:1]}).reshape(1, 34), "Q8_0")
    y = _same(host, _linear_q8(wq, xq), "block_gemv_q8")
    assert y[0, 0] == np.float32(65504.0 * 65504 * (127 * 127 + 128 * 128) * 16)
    for name in ("nf4_g64_f32", "int8_g32_bf16"):  # float32 subnormal scales: products no flush may lose
        f = _fields(name, 4, 128, rng)
        f["d"] = np.full(f["d"].shape, 1e-39 if name == "nf4_g64_f32" else 2.0**-133, np.float32)
        w = _weights(name, 4, 128, rng, f)
        got = _same(host, lambda b: b.dequantize_blocks(w.data, w.dtype.layout, np.float32, None), "block_decode")
        assert (np.abs(got) <= np.finfo(np.float32).tiny).all() and (got != 0).sum() > 100
        _same(host, _linear(w, np.full((2, 128), 2.0**100)), "block_gemv")
    w = _weights("e2m1_g16_e4m3_gdiv", 3, 64, rng, g=2.0**-120)  # the tensor scale: block scales / 2^-120
    _same(host, _linear(w, rng.standard_normal((2, 64))), "block_gemv")
    _same(host, _linear(w, rng.standard_normal((17, 64))), "block_gemm")


def test_through_the_op(host, on_host, rng):
    """qarray.linear and QArray.dequantize with the host-run backend under them: shapes, dtypes and
    the bias as the op hands them over."""
    w = _weights("Q4_K", 20, 512, rng)
    x = rng.standard_normal((2, 3, 512)).astype(np.float16)
    bias = rng.standard_normal(20).astype(np.float32)
    wh = QArray._blocks(w.data, w.dtype, host)
    xq = qa.quantize(x.reshape(6, 512).astype(np.float32), dtype="Q8_0")
    xh = QArray._blocks(xq.data, xq.dtype, host)
    with qa.config.using(numba=False):  # the generic code: no kernels to compile for the reference
        want = qa.linear(x, w, bias, dtype="like"), qa.linear(xq, w, bias), w.dequantize("float16")
    assert_same(on_host(lambda: qa.linear(x, wh, bias, dtype="like")), want[0])
    assert_same(on_host(lambda: qa.linear(xh, wh, bias)), want[1])
    assert_same(on_host(lambda: wh.dequantize("float16")), want[2])
    assert [name for name, *_ in host.launches] == ["block_gemv", "block_gemv_q8", "block_decode_float16"]


def test_the_barriers_are_needed(tmp_path, rng):
    """blocks.cu built with __syncthreads a no-op: block_gemv, block_gemm and block_gemv_q8 read
    shared memory before the block's other threads wrote it (garbage: the harness fills it so), so
    their results change; with the barriers they are the NumPy backend's (test_every_format)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    broken = HostCupyBackend(build(tmp_path / "broken.so", [CUDA_DIR / "blocks.cu"], ["-DQA_HOST_BROKEN_BARRIER"]))
    w = _weights("Q4_0", 40, 192, rng)
    x = rng.standard_normal((20, 192)).astype(np.float32)
    xq = qa.quantize(x, dtype="Q8_0")
    for fn in (_linear(w, x[:2].astype(np.float64)), _linear(w, x.astype(np.float64)), _linear_q8(w, xq)):
        with np.errstate(all="ignore"):
            got = fn(broken)
        assert not np.array_equal(got, _numpy(fn), equal_nan=True)
