"""qarray.ops.block_linear (linear with block-format weights) and its kernels
(qarray/backends/cpu/blocks.py): the two contracts, bit for bit, on every path."""

import math
from fractions import Fraction

import numpy as np
import pytest

import qarray as qa
import qarray.nn as qnn
from _reference import assert_same, force_isa, same_on_threads
from qarray import QArray, _blocks
from qarray._config import THREADS

ml_dtypes = pytest.importorskip("ml_dtypes")

GGML = sorted(k for k, f in _blocks.FORMATS.items() if f.ggml is not None)
GROUPED = ["int4_g128_f16", "uint4_g64_f16_zp", "int8_g32_bf16", "uint4_g32_bf16_bias", "uint4_g32_f16_bias",
           "int3_g32_f16", "nf4_g64_f32", "fp4bnb_g64_f32", "e4m3_g32_f16", "e2m1_g32_e8m0", "e2m1_g16_e4m3_gdiv",
           "e2m1_g16_e4m3_gmul", "int8_g64_f32_scb", "uint8_g32_f16_zp"]
# the formats Q8_0 activations take (integer values, sub-blocks that meet Q8_0's 32)
Q8 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "NVFP4", "TQ2_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
      "Q6_K", "IQ4_XS", "int4_g128_f16", "uint4_g64_f16_zp", "int8_g32_bf16", "uint4_g32_f16_bias", "int2_g16_f32",
      "uint8_g32_f16_zp"]
# the formats Q8_K activations take (blocks of 256, integer sub-scales), and the test's own reading of
# their two levels: (d field, sub-scale field or None, its integers; offset's field, its sub-field)
Q8K = {"Q2_K": ("d", "scales", lambda c: c, "dmin", "mins"),
       "Q3_K": ("d", "scales", lambda c: c.astype(np.int64) - 32, None, None),
       "Q4_K": ("d", "scales", lambda c: c, "dmin", "mins"), "Q5_K": ("d", "scales", lambda c: c, "dmin", "mins"),
       "Q6_K": ("d", "scales", lambda c: c.view(np.int8), None, None),
       "IQ4_XS": ("d", "scales", lambda c: c.astype(np.int64) - 32, None, None), "TQ2_0": ("d", None, None, None, None)}


def weights(name, n, k, rng, global_scale=None):
    """A block QArray ``(n, k)`` of format ``name``: quantized normal data where the format has a
    quantizer, else random bytes with sane float16 scales."""
    fmt = _blocks.get(name)
    if fmt.quantize is not None and fmt.tensor_scale is None:
        return qa.quantize((rng.standard_normal((n, k)) * 0.7).astype(np.float32), dtype=name)
    raw = rng.integers(0, 256, (n * k // fmt.block, fmt.nbytes), dtype=np.uint8)
    fields = fmt.unpack(raw)
    for fname, f in fmt.fields.items():
        if f.view == np.float16:  # d / dmin: |d| in [2^-6, 2)
            fields[fname] = (rng.uniform(0.02, 2, fields[fname].shape) * rng.choice([-1, 1], fields[fname].shape)
                             ).astype(np.float16)
        elif fname == "d" and name.startswith("e2m1_g16_e4m3"):  # e4m3 block scales: finite, not NaN
            fields[fname] = rng.integers(0x20, 0x60, fields[fname].shape).astype(np.uint8)
    raw = fmt.pack(fields).reshape(n, -1)
    g = None if fmt.tensor_scale is None else np.float32(0.37 if global_scale is None else global_scale)
    return QArray.from_blocks(raw, name, global_scale=g)


def ref_float(x, w, bias=None):
    """The float contract, written out: float64 products of ``w.dequantize()``, summed in k order."""
    x64 = np.asarray(x).astype(np.float64).reshape(-1, x.shape[-1])
    wf = w.dequantize().astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        products = x64[:, None, :] * wf[None, :, :]
        acc = np.zeros(products.shape[:2])
        for k in range(products.shape[2]):
            acc = acc + products[:, :, k]
        if bias is not None:
            acc = acc + np.asarray(bias).astype(np.float64)
        return acc.astype(np.float32).reshape(*x.shape[:-1], wf.shape[0])


def _k(name):
    return 2 * _blocks.get(name).block if _blocks.get(name).block >= 128 else 256


@pytest.mark.parametrize("name", GGML)
def test_float_ggml_types(name, rng, kernels):
    w = weights(name, 67, _k(name), rng)  # 67 rows: a full task of 64 and a short one
    x = rng.standard_normal((3, _k(name))).astype(np.float32)
    bias = rng.standard_normal(67).astype(np.float32)
    assert_same(qa.linear(x, w), ref_float(x, w))
    assert_same(qa.linear(x, w, bias), ref_float(x, w, bias))


@pytest.mark.parametrize("name", GROUPED)
def test_float_grouped(name, rng, kernels):
    w = weights(name, 70, 256, rng)
    x = rng.standard_normal((2, 5, 256)).astype(np.float32)
    y = qa.linear(x, w)
    assert y.shape == (2, 5, 70) and y.dtype == np.float32
    assert_same(y, ref_float(x, w))


def test_float_global_scale_counts(rng, kernels):
    a, b = (weights("e2m1_g16_e4m3_gdiv", 9, 64, rng, g) for g in (0.5, 0.25))
    b = QArray.from_blocks(a.data, "e2m1_g16_e4m3_gdiv", global_scale=np.float32(0.25))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert_same(qa.linear(x, b), 2 * qa.linear(x, a))  # divided by a scale half as large: exactly twice


@pytest.mark.parametrize("name", ["uint4_g32_f16_zp", "Q4_K", "uint4_g32_bf16_bias"])
def test_float_act_order(name, rng, kernels):
    w = weights(name, 66, 256, rng)
    columns = rng.permutation(256)
    wp = QArray._blocks(w.data, w.dtype, w._backend, columns)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    np.testing.assert_array_equal(wp.dequantize()[:, columns], w.dequantize())
    y = qa.linear(x, wp)
    assert_same(y, ref_float(x, wp))
    assert not np.array_equal(y, qa.linear(x, w))


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XS", "uint4_g32_bf16_bias", "Q8_0"])
def test_paths_and_threads_agree(name, rng, monkeypatch):
    pytest.importorskip("numba")
    from qarray.backends.cpu import pool

    monkeypatch.setattr(pool, "GRAIN", 1)  # a task a part: both threads take some
    w = weights(name, 64 * 5 + 3, 512, rng)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    xq = qa.quantize(x, dtype="Q8_0")
    n = THREADS[0]
    got = []
    try:
        for numba, threads in ((False, 1), (True, 1), (True, 2)):
            qa.set_num_threads(threads)
            with qa.config.using(numba=numba):
                got.append((qa.linear(x, w), qa.linear(xq, w) if name in ("Q4_K", "Q8_0") else None))
    finally:
        qa.set_num_threads(n)
    for y, yq in got[1:]:
        assert_same(y, got[0][0])
        if yq is not None:
            assert_same(yq, got[0][1])
    assert_same(got[0][0], ref_float(x, w))


def test_dtype_and_bias_kinds(rng, kernels):
    w = weights("Q4_0", 10, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        xl = x.astype(dt)
        want = ref_float(xl, w)
        assert_same(qa.linear(xl, w), want)
        assert_same(qa.linear(xl, w, dtype="like"), want.astype(dt))
        assert_same(qa.linear(xl, w, dtype=dt), want.astype(dt))
    assert_same(qa.linear(x, w, dtype="float16"), ref_float(x, w).astype(np.float16))
    bias = rng.standard_normal(10)  # float64: added as it is
    assert_same(qa.linear(x, w, bias), ref_float(x, w, bias))
    assert_same(qa.linear(x, w, bias.astype(np.float16)), ref_float(x, w, bias.astype(np.float16)))
    assert_same(qa.linear(x[0], w), ref_float(x[:1], w)[0])  # a 1-d x gives a 1-d result


def test_sum_order_is_k(kernels):
    """1 + 2^-30 - 1 in k order is 2^-30; any other order loses it or changes the rounding."""
    w = QArray.from_blocks(_q8_0([1.0], np.ones((1, 32))).reshape(1, 34), "Q8_0")
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [2.0**24, 1.0, -(2.0**24)]
    assert qa.linear(x, w)[0, 0] == 1.0  # float32 sums would give 0
    x[0, :3] = [1.0, 2.0**-30, -1.0]
    assert qa.linear(x, w)[0, 0] == np.float32(2.0**-30)


def test_nan_inf_propagate(rng, kernels):
    w = weights("Q4_1", 6, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[0, 3], x[1, 5] = np.nan, np.inf
    y = qa.linear(x, w)
    assert np.isnan(y[0]).all() and not np.isnan(y[2]).any()
    assert np.isinf(y[1]).sum() + np.isnan(y[1]).sum() == 6
    assert_same(y, ref_float(x, w))


def _q8_0(d, codes):
    """Q8_0 blocks of float16 scales ``d`` (n,) and int8 codes (n, 32)."""
    return _blocks.get("Q8_0").pack({"d": np.asarray(d, np.float16), "q": np.asarray(codes, np.int8)})


def test_extremes(kernels):
    """Codes at their limits, scales at float16's largest: float32 overflows to inf as the
    float64 sums say, in both modes."""
    codes = np.tile(np.array([127, -128] * 16, np.int8), (2, 1))
    w = QArray.from_blocks(_q8_0([65504, -65504], codes).reshape(2, 34), "Q8_0")
    x = np.full((1, 32), 1e31, np.float32)
    x[0, 1::2] = -1e31
    assert_same(qa.linear(x, w), ref_float(x, w))
    assert np.isposinf(qa.linear(x, w)[0, 0]) and np.isneginf(qa.linear(x, w)[0, 1])
    xq = QArray.from_blocks(_q8_0([65504], codes[:1]).reshape(1, 34), "Q8_0")
    y = qa.linear(xq, w)
    assert y[0, 0] == np.float32(65504.0 * 65504 * (127 * 127 + 128 * 128) * 16)
    q4 = QArray.from_blocks(_blocks.get("Q4_0").pack({"d": np.float16([65504]), "q": np.array([[0, 15] * 16])}
                                                     ).reshape(1, 18), "Q4_0")
    assert_same(qa.linear(x[:, :32], q4), ref_float(x[:, :32], q4))
    assert qa.linear(xq, q4)[0, 0] == np.float32(65504.0 * 65504 * (127 * -8 + -128 * 7) * 16)


def _pieces(xq, w):
    """(dx, qx, s, o, v) as Python numbers, piece by piece: the test's own reading of the formats."""
    fmt = w.dtype.layout
    n, k_len = w.shape
    dx = xq.fields["d"].astype(np.float32).reshape(-1, k_len // 32)
    qx = xq.fields["q"].view(np.int8).reshape(-1, k_len).astype(np.int64)
    s = w.scale.reshape(n, -1).astype(np.float64)
    o = None if w.offset is None else w.offset.reshape(n, -1).astype(np.float64)
    v = fmt.values.astype(np.int64)[w.fields["q"].reshape(n, k_len)]
    if w.zero_point is not None:
        v = v - np.repeat(w.zero_point.reshape(n, -1).astype(np.int64), fmt.sub, axis=1)
    return dx, qx, s, o, v, min(fmt.sub, 32), fmt.sub


def ref_q8(xq, w):
    """The Q8_0 contract in Python floats (IEEE float64) and ints, plus the exact value (Fraction)
    and ggml's float32 sum (ggml-cpu's vec_dot: ``sumf += sumi * d_w * d_x``, float32)."""
    dx, qx, s, o, v, piece, sub = _pieces(xq, w)
    m_len, n = qx.shape[0], v.shape[0]
    want, exact, f32 = (np.zeros((m_len, n), t) for t in (np.float32, object, np.float32))
    for m in range(m_len):
        for j in range(n):
            acc, ex, sf = 0.0, Fraction(0), np.float32(0)
            for k0 in range(0, qx.shape[1], piece):
                isum = int(np.dot(qx[m, k0:k0 + piece], v[j, k0:k0 + piece]))
                xsum = int(qx[m, k0:k0 + piece].sum())
                d, sj = float(dx[m, k0 // 32]), float(s[j, k0 // sub])
                oj = 0.0 if o is None else float(o[j, k0 // sub])
                acc += d * sj * isum + d * oj * xsum
                ex += Fraction(d) * Fraction(sj) * isum + Fraction(d) * Fraction(oj) * xsum
                sf = np.float32(sf + np.float32(isum) * np.float32(sj) * np.float32(d)
                                + np.float32(oj) * np.float32(xsum) * np.float32(d))
            want[m, j], exact[m, j], f32[m, j] = np.float32(acc), ex, sf
    return want, exact, f32


@pytest.mark.parametrize("name", Q8)
def test_q8_activations(name, rng, kernels):
    k_len = _k(name)
    w = weights(name, 66, k_len, rng)
    x = rng.standard_normal((2, k_len)).astype(np.float32)
    xq = qa.quantize(x, dtype="Q8_0")
    want, exact, ggml = ref_q8(xq, w)
    y = qa.linear(xq, w)
    assert_same(y, want)
    # as accurate as float32 allows: within half an ulp of the exact value (plus float64's part)
    ulp = np.spacing(np.abs(y))
    err = np.array([[abs(Fraction(float(a)) - e) for a, e in zip(r, er)] for r, er in zip(y, exact)], dtype=object)
    assert all(float(e) <= 0.5 * u * (1 + 2.0**-20) for e, u in zip(err.ravel(), ulp.ravel()))
    ggml_err = np.array([[abs(Fraction(float(a)) - e) for a, e in zip(r, er)] for r, er in zip(ggml, exact)])
    assert sum(float(e) for e in err.ravel()) <= sum(float(e) for e in ggml_err.ravel())
    bias = rng.standard_normal(66)
    assert_same(qa.linear(xq, w, bias), (want.astype(np.float64) * 0 + _with_bias(xq, w, bias)).astype(np.float32))


def _with_bias(xq, w, bias):
    dx, qx, s, o, v, piece, sub = _pieces(xq, w)
    out = np.zeros((qx.shape[0], v.shape[0]))
    for m in range(qx.shape[0]):
        for j in range(v.shape[0]):
            acc = 0.0
            for k0 in range(0, qx.shape[1], piece):
                d, sj = float(dx[m, k0 // 32]), float(s[j, k0 // sub])
                oj = 0.0 if o is None else float(o[j, k0 // sub])
                acc += d * sj * int(np.dot(qx[m, k0:k0 + piece], v[j, k0:k0 + piece])) \
                    + d * oj * int(qx[m, k0:k0 + piece].sum())
            out[m, j] = acc + float(bias[j])
    return out


def ref_q8k(xq, w, bias=None):
    """The Q8_K contract in Python floats (IEEE float64) and ints, read off the fields by the test
    (``Q8K``), plus the exact value (Fraction) and a float32 sum as ggml's (``sumf += d * S - dmin *
    M`` a block, float32)."""
    name = w.dtype.name.upper()
    dfield, scfield, table, mfield, minfield = Q8K[name]
    fmt = w.dtype.layout
    n, k_len = w.shape
    nb, subs = k_len // 256, 256 // fmt.sub
    f = w.fields
    dx = xq.fields["d"].reshape(-1, nb).astype(np.float32)
    qx = xq.fields["q"].view(np.int8).reshape(-1, k_len).astype(np.int64)
    d = f[dfield].reshape(n, nb).astype(np.float32)
    sc = np.ones((n, nb * subs), np.int64) if scfield is None else \
        table(f[scfield]).astype(np.int64).reshape(n, nb * subs)
    dm = None if mfield is None else -f[mfield].reshape(n, nb).astype(np.float32)
    mins = None if minfield is None else f[minfield].astype(np.int64).reshape(n, nb * subs)
    v = fmt.values.astype(np.int64)[f["q"].reshape(n, k_len)]
    m_len = qx.shape[0]
    want, exact, f32 = (np.zeros((m_len, n), t) for t in (np.float32, object, np.float32))
    with np.errstate(over="ignore", invalid="ignore"):  # (float32 overflows to inf, as the kernels' results)
        for m in range(m_len):
            for j in range(n):
                acc, ex, sf = 0.0, Fraction(0), np.float32(0)
                for b in range(nb):
                    big = small = 0
                    for t in range(subs):
                        part = slice(b * 256 + t * fmt.sub, b * 256 + (t + 1) * fmt.sub)
                        big += int(sc[j, b * subs + t]) * int(np.dot(qx[m, part], v[j, part]))
                        small += 0 if mins is None else int(mins[j, b * subs + t]) * int(qx[m, part].sum())
                    c, dj = float(dx[m, b]), float(d[j, b])
                    dmj = 0.0 if dm is None else float(dm[j, b])
                    acc += c * dj * big + c * dmj * small
                    ex += Fraction(c) * Fraction(dj) * big + Fraction(c) * Fraction(dmj) * small
                    sf = np.float32(sf + np.float32(dx[m, b] * d[j, b]) * np.float32(big)
                                    + np.float32(dx[m, b] * np.float32(dmj)) * np.float32(small))
                if bias is not None:
                    acc += float(bias[j])
                want[m, j], exact[m, j], f32[m, j] = np.float32(acc), ex, sf
    return want, exact, f32


@pytest.mark.parametrize("name", sorted(Q8K))
def test_q8k_activations(name, rng, kernels):
    """Q8_K activations (ggml's for the K-quants) against every format they take: the contract written
    out (``ref_q8k``), bit for bit, with and without bias; within half an ulp of the exact value, and
    no further from it than ggml's float32 sums."""
    w = weights(name, 21, 512, rng)
    xq = qa.quantize(rng.standard_normal((3, 512)).astype(np.float32), dtype="Q8_K")
    want, exact, ggml = ref_q8k(xq, w)
    y = qa.linear(xq, w)
    assert_same(y, want)
    ulp = np.spacing(np.abs(y))
    err = [abs(Fraction(float(a)) - e) for a, e in zip(y.ravel(), exact.ravel())]
    assert all(float(e) <= 0.5 * u * (1 + 2.0**-20) for e, u in zip(err, ulp.ravel()))
    assert sum(float(e) for e in err) <= sum(float(abs(Fraction(float(a)) - e)) for a, e in zip(ggml.ravel(), exact.ravel()))
    bias = rng.standard_normal(21)
    assert_same(qa.linear(xq, w, bias), ref_q8k(xq, w, bias)[0])
    assert_same(qa.linear(xq.reshape(3, 1, 512), w), want.reshape(3, 1, 21))


def test_q8k_refuses(rng):
    """Formats whose blocks or scales do not meet Q8_K's, act-order columns, and the messages."""
    xq = qa.quantize(rng.standard_normal((2, 256)).astype(np.float32), dtype="Q8_K")
    with pytest.raises(TypeError, match=r"Q4_0's blocks of 32 elements do not meet Q8_K's blocks of 256.*"
                                        r"float activations.* or Q8_0 activations instead"):
        qa.linear(xq, weights("Q4_0", 4, 256, rng))
    with pytest.raises(TypeError, match="uint4_g256_f16_zp has zero points.* or Q8_0 activations instead"):
        qa.linear(xq, weights("uint4_g256_f16_zp", 4, 256, rng))
    w = weights("int4_g256_f16", 4, 256, rng)  # one level over the block: taken
    assert_same(qa.linear(xq, w), _generic(xq, w))
    with pytest.raises(TypeError, match="lattice codebook"):
        qa.linear(xq, weights("IQ2_XS", 4, 256, rng))
    with pytest.raises(TypeError, match="int4_g128_f16's blocks of 128"):
        qa.linear(xq, weights("int4_g128_f16", 4, 256, rng))
    with pytest.raises(ValueError, match="x's last axis must be 512"):
        qa.linear(xq, weights("Q4_K", 4, 512, rng))
    with pytest.raises(TypeError, match="takes float activations .* or Q8_0 / Q8_K ones"):
        qa.linear(qa.quantize(np.ones((2, 256), np.float32), dtype="Q4_K"), weights("Q4_K", 4, 256, rng))


def test_q8_more_accurate_than_float32_sums(rng, kernels):
    """Long rows of large, cancelling terms: float32 sums (ggml's) drift, float64 ones do not."""
    k_len = 8192
    w = weights("Q8_0", 8, k_len, rng)
    x = (rng.standard_normal((2, k_len)) * np.exp(rng.uniform(-4, 4, k_len))).astype(np.float32)
    xq = qa.quantize(x, dtype="Q8_0")
    want, exact, ggml = ref_q8(xq, w)
    y = qa.linear(xq, w)
    assert_same(y, want)
    ours = max(abs(Fraction(float(a)) - e) / abs(e) for a, e in zip(y.ravel(), exact.ravel()))
    theirs = max(abs(Fraction(float(a)) - e) / abs(e) for a, e in zip(ggml.ravel(), exact.ravel()))
    assert ours <= 2.0**-24 < theirs


@pytest.mark.parametrize("name", ["nf4_g64_f32", "e2m1_g32_e8m0", "IQ2_XXS", "TQ1_0", "int8_g64_f32_scb",
                                  "int4_g24_f16", "fp4bnb_g64_f32"])
def test_q8_refuses(name, rng):
    fmt = _blocks.get(name)
    k_len = math.lcm(fmt.block, 256)
    w = weights(name, 3, k_len, rng)
    xq = qa.quantize(rng.standard_normal((1, k_len)).astype(np.float32), dtype="Q8_0")
    with pytest.raises(TypeError, match="Q8_0 activations take weights of integer values.*pass float activations"):
        qa.linear(xq, w)
    qa.linear(xq.dequantize(), w)  # the float mode takes them


def test_errors(rng):
    w = weights("Q4_0", 4, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="takes float32, float16 or bfloat16 activations.*got int32; cast x"):
        qa.linear(x.astype(np.int32), w)
    with pytest.raises(TypeError, match="got float64; cast x"):
        qa.linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match=r"x's last axis must be 64 \(in_features\)"):
        qa.linear(x[:, :32], w)
    with pytest.raises(ValueError, match=r"x's last axis must be 64 \(in_features\)"):
        qa.linear(qa.quantize(x[:, :32], dtype="Q8_0"), w)
    w3 = QArray.from_blocks(w.data.reshape(2, 2, 36), "Q4_0")
    with pytest.raises(ValueError, match=r"w must have shape \(out_features, in_features\)"):
        qa.linear(x, w3)
    with pytest.raises(ValueError, match=r"bias must be a float array of shape \(4,\)"):
        qa.linear(x, w, np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="float32 \\(the default\\), float16 or bfloat16"):
        qa.linear(x, w, dtype="float64")
    with pytest.raises(TypeError, match="scale, relu do not apply"):
        qa.linear(x, w, scale=0.1, relu=True)
    with pytest.raises(TypeError, match="not Q4_0; dequantize x or quantize it to Q8_0"):
        qa.linear(qa.quantize(x, dtype="Q4_0"), w)
    with pytest.raises(TypeError, match=r"matmul does not take block formats yet.*use qarray.linear\(x, w\)"):
        qa.matmul(qa.quantize(x, 0.1), w)
    for other in (qa.quantize(x, 0.1), qa.quantize(x, 0.1, dtype="float8_e4m3fn")):  # block x, other w
        with pytest.raises(TypeError, match="linear does not take block formats yet; Q8_0 is one"):
            qa.linear(qa.quantize(x, dtype="Q8_0"), other)
    with pytest.raises(TypeError, match=r"act-order"):
        qa.linear(qa.quantize(x, dtype="Q8_0"), QArray._blocks(w.data, w.dtype, w._backend, np.arange(64)[::-1]))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        qa.quantize(x[:, :48], dtype="Q8_0")  # K must hold whole blocks: Q8_0's own error
    with pytest.raises(TypeError, match="dtype='like' takes x's float dtype"):
        qa.linear(qa.quantize(x, dtype="Q8_0"), w, dtype="like")


def test_empty(rng, kernels):
    w = weights("Q4_0", 4, 64, rng)
    assert qa.linear(np.zeros((0, 64), np.float32), w).shape == (0, 4)
    assert qa.linear(qa.quantize(np.zeros((0, 64), np.float32), dtype="Q8_0"), w).shape == (0, 4)


def test_rounded_matches_numpy():
    """The kernels' float16 / bfloat16 rounding (cpu.blocks.rounded) against qarray._blocks.rounded."""
    pytest.importorskip("numba")
    from numba import njit

    from qarray.backends.cpu import blocks

    @njit
    def run(y, p, out):
        for i in range(y.size):
            out[i] = blocks.rounded(y[i], p)

    rng = np.random.default_rng(1)
    bits = np.concatenate([rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x38000000, 0x38800000, 97, dtype=np.uint32),  # float16's subnormals
                           np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x7F7FFFFF, 0x7F800000, 0x80000000,
                                     0x00000001, 0x7FC00000], np.uint32)])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    y = bits.view(np.float32)
    for p, name in ((1, "float16"), (2, "bfloat16")):
        out = np.empty_like(y)
        run(y, p, out)
        want = _blocks.rounded(y, name)
        # NaN stays as it is (NumPy's float16 round trip clears its payload's low 13 bits, which are 0 in
        # the NaNs a decoder meets: test_nan_scales)
        assert_same(out[~np.isnan(y)], want[~np.isnan(y)])


@pytest.mark.parametrize("name", ["int4_g32_f16", "uint4_g32_f16_bias", "int8_g32_bf16"])
def test_nan_scales(name, rng, kernels):
    """NaN scales with payloads (and inf ones): NaN's bits as dequantize leaves them, through the sums."""
    w = weights(name, 5, 64, rng)
    fmt = w.dtype.layout
    fields = fmt.unpack(w.data.reshape(-1, fmt.nbytes))
    d = fields["d"].view(np.uint16 if fmt.fields["d"].view == np.float16 else np.uint32).copy()
    nan, inf = (0x7C01, 0x7C00) if d.dtype == np.uint16 else (0x7F810000, 0x7F800000)
    d[0], d[3], d[6] = nan, nan | (0x200 if d.dtype == np.uint16 else 0x400000), inf
    fields["d"] = d.view(fmt.fields["d"].view) if d.dtype == np.uint16 else d.view(np.float32)
    w = QArray.from_blocks(fmt.pack(fields).reshape(5, -1), name)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.isnan(w.dequantize()).any()
    assert_same(qa.linear(x, w), ref_float(x, w))


def test_dask(rng):
    da = pytest.importorskip("dask.array")
    w = weights("Q4_K", 9, 512, rng)
    x = rng.standard_normal((7, 512)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    y = qa.linear(da.from_array(x, chunks=(3, 256)), w.to("dask"), bias)
    assert isinstance(y, da.Array)
    assert_same(y.compute(), qa.linear(x, w, bias))
    for act in ("Q8_0", "Q8_K"):
        xq = qa.quantize(da.from_array(x, chunks=(2, 512)), dtype=act)
        y = qa.linear(xq, w, bias)
        assert isinstance(y, da.Array)
        assert_same(y.compute(), qa.linear(qa.quantize(x, dtype=act), w, bias))


# -- BlockLinear: Q8_0 activations on weights packed once (cpu/blocks.py's PackedQ8, VNNI dots) ------

@pytest.fixture(params=["amx", "avx512vnni", "avxvnni", "portable"])  # (AMX: Q8_K x of 32 rows or more)
def only(request, monkeypatch):
    pytest.importorskip("numba")
    return force_isa(monkeypatch, request.param)


def _generic(xq, w, bias=None):
    """The Q8_0 contract by the generic NumPy code (int64 sums; ``test_q8_activations`` checks it
    against ``ref_q8``)."""
    with qa.config.using(numba=False):
        return qa.linear(xq, w, bias)


# the formats whose Q8_0 activations of 32 rows or more run on AMX's tiles, a piece a C tile
AMX_PIECES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "TQ2_0", "int4_g128_f16",
              "uint4_g64_f16_zp", "int8_g32_bf16", "uint4_g32_f16_bias"}


@pytest.mark.parametrize("name", Q8)
def test_packed_q8_every_format(name, rng, only):
    """Every Q8 format on each instruction set: 37 rows (two groups of 16 and a part), one row of x,
    nine (a call of RM = 8 rows, then one) and 37 (AMX's tiles of 16 rows, the last one part, where
    the format's pieces run on them), with and without bias, against the generic code, bit for
    bit."""
    blocks = pytest.importorskip("qarray.backends.cpu.blocks")
    k_len = _k(name)
    w = weights(name, 37, k_len, rng)
    bias = rng.standard_normal(37)
    layer, plain = qnn.BlockLinear(w, bias), qnn.BlockLinear(w)
    assert layer._packed is not None and blocks.amx_pieces(layer._packed) == (name in AMX_PIECES)
    for m in (1, 9, 37):
        xq = qa.quantize(rng.standard_normal((m, k_len)).astype(np.float32) * 3, dtype="Q8_0")
        assert_same(layer(xq), _generic(xq, w, bias))
        assert_same(plain(xq), _generic(xq, w))


@pytest.mark.parametrize("name", sorted(Q8K))
def test_packed_q8k_every_format(name, rng, only):
    """Q8_K activations on each instruction set, packed (the layer) and packed on the fly (``linear``):
    37 rows, 1, 9 and 37 rows of x (AMX's tiles of 16, the last one part), with and without bias,
    against the generic code, bit for bit."""
    w = weights(name, 37, 512, rng)
    bias = rng.standard_normal(37)
    layer = qnn.BlockLinear(w, bias)
    for m in (1, 9, 37):
        xq = qa.quantize(rng.standard_normal((m, 512)).astype(np.float32) * 3, dtype="Q8_K")
        assert_same(layer(xq), _generic(xq, w, bias))
        assert_same(qa.linear(xq, w), _generic(xq, w))


def test_packed_q8_scales_kept(rng, only):
    """Packed scales are kept as float16 bits where each is a float16 (Q4_0's d), as float32 where not
    (int4 groups of 128 with float32 scales): both through every instruction set's dots, AMX's pieces
    included (37 rows), against the generic code, bit for bit."""
    blocks = pytest.importorskip("qarray.backends.cpu.blocks")
    for name, kept in (("Q4_0", np.uint16), ("int4_g128_f32", np.float32), ("uint4_g32_f16_bias", np.uint16)):
        w = weights(name, 37, 256, rng)
        layer = qnn.BlockLinear(w)
        assert layer._packed.s.dtype == kept and blocks.amx_pieces(layer._packed)
        for m in (1, 9, 37):
            xq = qa.quantize(rng.standard_normal((m, 256)).astype(np.float32) * 3, dtype="Q8_0")
            assert_same(layer(xq), _generic(xq, w))


def test_amx_pieces_need_whole_blocks(rng, only):
    """Q8_0 x of 32 rows or more against K = 96 (not a multiple of AMX's blocks of 256): the VNNI dots
    take them, with the same bits."""
    blocks = pytest.importorskip("qarray.backends.cpu.blocks")
    w = weights("Q4_0", 21, 96, rng)
    layer = qnn.BlockLinear(w)
    assert not blocks.amx_pieces(layer._packed) and blocks.amx_pieces(qnn.BlockLinear(weights("Q4_0", 21, 256, rng))._packed)
    xq = qa.quantize(rng.standard_normal((40, 96)).astype(np.float32), dtype="Q8_0")
    assert_same(layer(xq), _generic(xq, w))


@pytest.mark.parametrize("vmin, vmax, smin, smax, small, planes", [
    (0, 3, 4, 15, 1, 1),  # Q2_K: 2-bit values, 4-bit sub-scales and mins
    (-4, 3, -32, 31, 0, 2),  # Q3_K
    (0, 15, 0, 63, 1, 2),  # Q4_K
    (0, 31, 0, 63, 1, 3),  # Q5_K
    (-32, 31, -128, 127, 0, 4),  # Q6_K: int8 sub-scales at both ends
    (-127, 113, -32, 31, 0, 4),  # IQ4_XS: its table's values, split in two 4-bit parts
    (-1, 1, 1, 1, 0, 1),  # TQ2_0: no sub-scales
    (-128, 127, -128, 127, 0, None)])  # no split into 5 tiles: AVX-512 VNNI's path
def test_amx_plan_splits_exactly(vmin, vmax, smin, smax, small, planes):
    """AMX's planes (``blocks.amx_plan``): for every value and sub-scale in range, the planes' products
    each fit an int8 (tdpbssd's operand) and their sum, each shifted by its weight, is ``v * sc``
    exactly; at most 5 C tiles with the offset's plane."""
    blocks = pytest.importorskip("qarray.backends.cpu.blocks")
    plan = blocks.amx_plan(vmin, vmax, smin, smax, small)
    if planes is None:
        assert plan is None
        return
    parts, digits, bits = plan
    assert parts * digits == planes and planes + small <= blocks.AMX_TILES
    v, sc = np.arange(vmin, vmax + 1)[:, None], np.arange(smin, smax + 1)[None, :]
    total = np.zeros(np.broadcast_shapes(v.shape, sc.shape), np.int64)
    for i in range(parts):
        part = v if parts == 1 else v & 15 if i == 0 else v >> 4
        for t in range(digits):
            d = sc >> bits * t
            prod = part * (d if t == digits - 1 else d & (1 << bits) - 1)
            assert -128 <= prod.min() and prod.max() <= 127
            total += prod << 4 * i + bits * t
    np.testing.assert_array_equal(total, v * sc)


def _blocks_of(name, n, fields):
    fmt = _blocks.get(name)
    return QArray.from_blocks(fmt.pack(fields).reshape(n, -1), name)


@pytest.mark.parametrize("name", ["uint4_g64_f16_zp", "uint8_g32_f16_zp", "Q8_0", "IQ4_NL", "Q6_K", "Q4_K", "IQ4_XS"])
def test_packed_q8_extremes(name, only):
    """Codes at both ends of the format, zero points at both ends, activations at -128 and 127 (the
    largest integer sums, through the u = value - vmin shift), a float16 scale at 65504 and sub-block
    scales at their ends (the two-level scales' int8: K-quants, IQ4_XS): against the contract written
    out (``ref_q8``), bit for bit."""
    fmt = _blocks.get(name)
    k_len, n = max(256, fmt.block), 19  # a group of 16 rows and a part; a block of AMX's tiles
    nblocks = n * k_len // fmt.block
    raw = np.zeros((nblocks, fmt.nbytes), np.uint8)
    fields = fmt.unpack(raw)
    top = len(fmt.values) - 1
    b = np.arange(nblocks)[:, None]
    fields["q"] = np.select([b % 3 == 0, b % 3 == 1], [top, 0], np.arange(fields["q"].shape[1]) % 2 * top
                            ).astype(fields["q"].dtype)  # all top, all 0, alternating
    for fname, f in fmt.fields.items():
        if f.view == np.float16:
            fields[fname] = np.full(fields[fname].shape, 65504 if fname == "d" else 0.5, np.float16)
        elif fname in ("scales", "mins"):  # sub-block scales at their ends (Q6_K's int8: 127 and -128)
            top_sc = (1 << f.bits) - 1
            ends = (127, 128) if f.bits == 8 else (top_sc, top_sc // 2)
            fields[fname] = np.where(np.arange(fields[fname].shape[-1]) % 2 == 0, *ends).astype(fields[fname].dtype) \
                * np.ones(fields[fname].shape, fields[fname].dtype)
    if fmt.zero is not None:  # zero points at both ends, block by block
        zmax = (1 << fmt.fields[fmt.zero].bits) - 1
        fields[fmt.zero] = (np.where(b % 2 == 0, 0, zmax) * np.ones(fields[fmt.zero].shape, np.int64)
                            ).astype(fields[fmt.zero].dtype)
    w = _blocks_of(name, n, fields)
    codes = np.ones((9, k_len), np.int64) * np.array([[127], [-128], [0]] * 3)  # RM = 8 rows, then one
    codes[2::3] = np.where(np.arange(k_len) % 3 == 0, -128, 127)
    xq = QArray.from_blocks(_q8_0(np.full(9 * k_len // 32, 3.0), codes.reshape(-1, 32)).reshape(9, -1), "Q8_0")
    want, _, _ = ref_q8(xq, w)
    layer = qnn.BlockLinear(w)
    assert layer._packed.has_sc == (name in ("Q6_K", "Q4_K", "IQ4_XS")) and layer._packed.has_osc == (name == "Q4_K")
    assert layer._packed.s.dtype == np.uint16  # float16 scales, kept as their bits (65504 among them)
    assert_same(layer(xq), want)
    if name in Q8K:  # Q8_K: float32 scales up to 2^127 (the float32 result overflows to inf); 36 rows (AMX's path)
        d = np.tile(np.array([3.0, 2.0**-126, 2.0**127, -1e-3, 7.5, 1.0, -3.0, 2.0**100, 1e-30], np.float32), 4)
        codes = np.tile(codes, (4, 1))
        xk = QArray.from_blocks(_blocks.get("Q8_K").pack({
            "d": d, "q": codes.astype(np.int8), "bsums": codes.reshape(36, 16, 16).sum(axis=2).astype(np.int16)}),
                                "Q8_K")
        want = ref_q8k(xk, w)[0]
        assert np.isinf(want).any() and (want != 0).all()
        assert_same(layer(xk), want)
    # Q8_0 x of 36 rows (AMX's pieces where the format takes them): its float16 scales at their ends
    # (65504, the smallest subnormal 2^-24), negative, and 0 (a block that adds 0.0)
    d = np.tile(np.array([3.0, 65504.0, 2.0**-24, -0.5, 0.0, 1.0, -3.0, 2.0**-14, 7.5]), 4 * k_len // 32)
    xq = QArray.from_blocks(_q8_0(d, np.tile(codes[:9], (4, 1)).reshape(-1, 32)).reshape(36, -1), "Q8_0")
    want, _, _ = ref_q8(xq, w)
    assert_same(layer(xq), want)


def test_packed_q8_threads_and_long_rows(rng, only, monkeypatch):
    """K = 8192 (128 pieces a row), 16 * 9 + 5 rows, both threads taking groups, Q8_0 and Q8_K x: the
    same bits as one thread and as the generic code."""
    from qarray.backends.cpu import pool

    monkeypatch.setattr(pool, "GRAIN", 1)
    for name, act, m in (("Q4_K", "Q8_0", 11), ("Q4_K", "Q8_K", 33), ("Q4_1", "Q8_0", 33)):  # (33 rows: AMX's tiles)
        w = weights(name, 16 * 9 + 5, 8192, rng)
        layer = qnn.BlockLinear(w)
        xq = qa.quantize(rng.standard_normal((m, 8192)).astype(np.float32), dtype=act)
        assert_same(same_on_threads(lambda: layer(xq)), _generic(xq, w))


def test_block_linear_layer(rng):
    """The layer: float activations through the float contract, the dtype asked for, formats the packed
    path does not take (NF4: float x only), and its errors."""
    w = weights("Q4_0", 20, 256, rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    layer = qnn.BlockLinear(w, np.ones(20, np.float32))
    assert_same(layer(x), qa.linear(x, w, np.ones(20, np.float32)))
    assert layer(qa.quantize(x, dtype="Q8_0"), dtype="float16").dtype == np.float16
    assert "packed=True" in repr(layer)
    nf4 = qnn.BlockLinear(weights("nf4_g64_f32", 4, 256, rng))
    assert nf4._packed is None and "packed=False" in repr(nf4)
    with pytest.raises(TypeError, match="lattice codebook|not integers"):
        nf4(qa.quantize(x, dtype="Q8_0"))
    with pytest.raises(TypeError, match="BlockLinear takes a block-format QArray weight"):
        qnn.BlockLinear(qa.quantize(np.ones((2, 2), np.float32), 0.1, 0, "qint8"))
    with pytest.raises(ValueError, match=r"BlockLinear: weight must be \(out_features, in_features\)"):
        qnn.BlockLinear(weights("Q4_0", 4, 64, rng).reshape(2, 2, 64))


def test_q8_0_quantizer_kernel(rng, kernels):
    """Activations to Q8_0 (cpu/blocks.py's quantize_q8_0 where Numba runs): the bytes of ggml's
    quantize_row_q8_0_ref as gguf-py computes it (``_ggml._q8_0``), at the roundings' edges: halves
    (away from zero), zeros and -0.0, the smallest subnormal, float32's largest values (d rounds to
    float16 inf), magnitudes from 2^-43 to 2^43."""
    fmt = _blocks.get("Q8_0")
    halves = np.tile((np.arange(32) - 16 + 0.5).astype(np.float32), (8, 1))
    halves[:, 0] = 127  # d = 1: x * id = k + 0.5 exactly
    zeros = np.zeros((3, 32), np.float32)
    zeros[1, 3], zeros[2, 5] = -0.0, 1e-45
    xs = [(rng.standard_normal((16, 1024)) * np.exp(rng.uniform(-30, 30, (16, 1)))).astype(np.float32), halves,
          zeros, np.where(rng.standard_normal((2, 32)) < 0, -3.4e38, 3.4e38).astype(np.float32)]
    for x in xs:
        with np.errstate(over="ignore"):
            want = fmt.pack(fmt.quantize(x.reshape(-1, 32))).reshape(len(x), -1)
            got = qa.quantize(x, dtype="Q8_0").data
        assert np.array_equal(got, want)
    q = qa.quantize(halves, dtype="Q8_0").fields["q"].reshape(8, 32).view(np.int8)[0]
    v = halves[0, 1:]  # -14.5 .. 15.5: halves away from zero
    assert q[0] == 127 and (q[1:] == np.where(v < 0, np.floor(v), np.ceil(v))).all()
