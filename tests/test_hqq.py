"""qarray.hqq against hqq's own code: the ``hqq`` package where it is installed (0.2.8.post1,
``Quantizer.quantize(..., device="cpu")``), and a literal torch port of its quantizer and solver
here (hqq/core/quantize.py ``Quantizer.quantize``, hqq/core/optimize.py
``optimize_weights_proximal_legacy``, mobiusml/hqq e0b1d00), which runs wherever torch does."""

import contextlib
import doctest
import io

import numpy as np
import pytest

import qarray
from qarray import hqq

torch = pytest.importorskip("torch")


# -- hqq, ported literally (float32 on the CPU, as hqq runs there) -----------------------------------

def _shrink_lp_op(x, beta, lp_norm):
    if lp_norm == 1:
        out = torch.abs(x)
        out.sub_(1.0 / beta).clamp_min_(0.0)
        out.mul_(torch.sign(x))
        return out
    out = torch.abs(x)
    out.sub_((1.0 / beta) * out.pow(lp_norm - 1)).clamp_min_(0.0)
    out.mul_(torch.sign(x))
    return out


def _legacy_step(W_f, scale, zero, min_max, beta, lp_norm, axis):
    W_q = torch.round(W_f * scale + zero).clamp_(min_max[0], min_max[1])
    W_r = (W_q - zero) / scale
    W_e = _shrink_lp_op(W_f - W_r, beta, lp_norm)
    zero = torch.mean(W_q - (W_f - W_e) * scale, axis=axis, keepdim=True)
    return W_r, W_q, zero, scale


def torch_optimize(tensor, scale, zero, min_max, axis=0, lp_norm=0.7, beta=1e1, iters=20):
    """optimize_weights_proximal_legacy on the CPU (float32); also returns the steps run."""
    W_f, scale, zero = tensor.float(), scale.float(), zero.float()
    best_error = torch.tensor(torch.inf, dtype=torch.float32)
    steps = 0
    for i in range(iters):
        W_r, W_q, zero, scale = _legacy_step(W_f, scale, zero, min_max, beta, lp_norm, axis)
        current_error = torch.abs(W_f - W_r).mean().float()
        steps += 1
        if current_error < best_error:
            best_error = current_error
        else:
            break
    W_q = torch.round(tensor * scale + zero).clamp_(min_max[0], min_max[1])
    return W_q, scale, zero, steps


def torch_quantize(W, nbits=4, group_size=64, optimize=True, round_zero=False, axis=0):
    """Quantizer.quantize (channel_wise, no bit packing): codes, meta scale (1 / inv), zero, steps."""
    W = W.float()
    W = W.reshape([-1, group_size]) if axis == 1 else W.reshape([group_size, -1])
    _min = W.min(axis=axis, keepdim=True)[0]
    _max = W.max(axis=axis, keepdim=True)[0]
    max_v = round(2 ** nbits - 1)
    min_max = [0, max_v]
    denom = (_max - _min)
    scale = (max_v / denom)
    scale = torch.where(denom.abs() <= 1e-4, torch.full_like(scale, 1.0), scale)
    scale = scale.clamp(max=2e4)
    zero = -_min * scale
    if round_zero:
        zero = torch.round(zero)
    steps = 0
    if optimize:
        W_q, scale, zero, steps = torch_optimize(W, scale, zero, min_max, axis=axis)
    else:
        W_q = (W * scale + zero).round_().clamp_(min_max[0], min_max[1])
    return W_q, 1.0 / scale, zero, steps


def _weights(kind, shape, seed=0):
    rng = np.random.default_rng(seed)
    w = {"normal": lambda: rng.standard_normal(shape), "uniform": lambda: rng.uniform(-1, 1, shape),
         "t3": lambda: rng.standard_t(3, shape), "laplace": lambda: rng.laplace(0, 1, shape)}[kind]()
    return (w * 0.02).astype(np.float32)


def _fields(q):
    f = q.dtype.layout.unpack(q.data.reshape(-1, q.dtype.layout.nbytes))
    return f["q"].astype(np.float32), f["d"].astype(np.float32), f["m"].astype(np.float32)


def _start(g, bits, round_zero):
    """hqq's starting inverse scale and zero for groups ``g`` (rows), in NumPy."""
    lo, hi = g.min(1, keepdims=True), g.max(1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.float32((1 << bits) - 1) / (hi - lo)
    inv = np.minimum(np.where(np.abs(hi - lo) <= np.float32(1e-4), np.float32(1), inv), np.float32(2e4))
    z = (-lo * inv).astype(np.float32)
    return inv.astype(np.float32), np.rint(z) if round_zero else z


# -- the solver against the port ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["normal", "uniform", "t3"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_solver_matches_hqq_port(kind, bits):
    w = _weights(kind, (64, 512), seed=bits)
    g = w.reshape(-1, 64)
    inv, z = _start(g, bits, bits == 4)
    wq_t, _, z_t, steps = torch_optimize(torch.from_numpy(g), torch.from_numpy(inv), torch.from_numpy(z),
                                         [0, (1 << bits) - 1], axis=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        wq, inv2, z2 = hqq.optimize_weights_proximal(g, inv, z, [0, (1 << bits) - 1], axis=1, verbose=True)
    assert len(out.getvalue().splitlines()) == steps  # the same early stop
    assert np.array_equal(inv2, inv)
    # the same codes and zeros but where a last-bit difference moved a code at a tie (none here)
    assert np.array_equal(wq, wq_t.numpy())
    np.testing.assert_allclose(z2, z_t.numpy(), rtol=0, atol=4e-6 * max(1, bits == 8 and 16))


def test_solver_stops_early_as_hqq():
    """A step whose error is not below the best ends the loop (uniform weights at 3 bits stop after
    15 steps of 20)."""
    g = _weights("uniform", (64, 512), seed=3).reshape(-1, 64)
    inv, z = _start(g, 3, False)
    _, _, z_t, steps = torch_optimize(torch.from_numpy(g), torch.from_numpy(inv), torch.from_numpy(z), [0, 7], axis=1)
    assert steps < 20
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _, _, z2 = hqq.optimize_weights_proximal(g, inv, z, [0, 7], axis=1, verbose=True)
    assert len(out.getvalue().splitlines()) == steps
    np.testing.assert_allclose(z2, z_t.numpy(), rtol=0, atol=4e-6)
    _, _, z_same = hqq.optimize_weights_proximal(g, inv, z, [0, 7], axis=1, iters=steps)
    assert np.array_equal(z_same, z2)


@pytest.mark.parametrize("axis", [0, 1])
def test_solver_axes_match_port(axis):
    w = _weights("laplace", (128, 256), seed=5)
    g = w.reshape(-1, 64) if axis == 1 else w.reshape(64, -1)
    gr = g if axis == 1 else g.T
    inv, z = _start(np.ascontiguousarray(gr), 4, True)
    if axis == 0:
        inv, z = inv.T, z.T
    wq_t, _, z_t, _ = torch_optimize(torch.from_numpy(g), torch.from_numpy(inv), torch.from_numpy(z), [0, 15],
                                     axis=axis)
    wq, _, z2 = hqq.optimize_weights_proximal(g, inv, z, [0, 15], axis=axis)
    assert wq.shape == g.shape and z2.shape == z.shape
    assert (wq == wq_t.numpy()).mean() > 0.9999
    assert (np.abs(z2 - z_t.numpy()) <= 4e-6).mean() > 0.999


def test_shrink_lp_op():
    x = np.array([-2.0, -0.5, 0.0, 1e-6, 0.3, 4.0], np.float32)
    for p in (0.7, 1.0, 0.5):
        np.testing.assert_allclose(hqq.shrink_lp_op(x, 10.0, p), _shrink_lp_op(torch.from_numpy(x), 10.0, p).numpy(),
                                   rtol=2e-7, atol=0)
    assert hqq.shrink_lp_op(x, 10.0, 0.7)[2] == 0


# -- quantize: the QArray against the port -------------------------------------------------------------

@pytest.mark.parametrize("bits,group", [(4, 64), (3, 128), (2, 32), (6, 64), (8, 64)])
def test_quantize_matches_port(bits, group):
    w = _weights("t3", (96, 512), seed=bits)
    wq_t, scale_t, z_t, _ = torch_quantize(torch.from_numpy(w), bits, group, round_zero=bits == 4, axis=1)
    q = hqq.quantize(w, bits=bits, group_size=group)
    assert q.dtype.name == f"uint{bits}_g{group}_f16_bias" and q.shape == w.shape
    codes, d, m = _fields(q)
    assert (codes == wq_t.numpy()).mean() > 0.9999  # (a last-bit difference can move a code at a tie)
    assert np.array_equal(d, scale_t.numpy().astype(np.float16).astype(np.float32))
    z = z_t.numpy()
    np.testing.assert_allclose(m, (-(d * z)).astype(np.float16).astype(np.float32), rtol=2.0**-10, atol=0)
    # dequantize is the float16 format's: s16 * q rounded, + b16 rounded
    want = (d * codes).astype(np.float16).astype(np.float32)
    want = (want + m).astype(np.float16).astype(np.float32)
    assert np.array_equal(q.dequantize().reshape(-1, group), want)
    # the error within 1% of hqq's own (float32) at up to 6 bits; at 8 the float16 bias costs more
    # (its rounding is about 2^-12 of |bias|, up to 128 steps), the float32 format's is hqq's
    ref = ((wq_t - z_t) * scale_t).reshape(w.shape).numpy()
    e_ref, e = np.linalg.norm(w - ref), np.linalg.norm(w - q.dequantize())
    assert abs(e / e_ref - 1) < (0.01 if bits <= 6 else 0.03)
    e32 = np.linalg.norm(w - hqq.quantize(w, dtype=f"uint{bits}_g{group}_f32_bias").dequantize())
    assert abs(e32 / e_ref - 1) < 1e-4


def test_f32_bias_keeps_hqqs_scale():
    w = _weights("normal", (32, 256), seed=7)
    wq_t, scale_t, z_t, _ = torch_quantize(torch.from_numpy(w), 4, 64, round_zero=True, axis=1)
    q = hqq.quantize(w, dtype="uint4_g64_f32_bias")
    codes, d, m = _fields(q)
    assert np.array_equal(codes, wq_t.numpy())
    assert np.array_equal(d, scale_t.numpy())  # hqq's scale, bit for bit
    np.testing.assert_allclose(m, -(d * z_t.numpy()), rtol=4e-7, atol=0)  # (z within the float error)
    ref = ((wq_t - z_t) * scale_t).reshape(w.shape).numpy()
    np.testing.assert_allclose(q.dequantize(), ref, rtol=0, atol=4 * np.spacing(np.abs(ref).max()))


@pytest.mark.parametrize("round_zero", [False, True])
def test_no_optimize_matches_port(round_zero):
    w = _weights("normal", (16, 128), seed=2)
    wq_t, scale_t, z_t, _ = torch_quantize(torch.from_numpy(w), 4, 64, optimize=False, round_zero=round_zero, axis=1)
    codes, d, m = _fields(hqq.quantize(w, optimize=False, round_zero=round_zero, dtype="uint4_g64_f32_bias"))
    assert np.array_equal(codes, wq_t.numpy()) and np.array_equal(d, scale_t.numpy())


def test_constant_groups():
    """A group of one value (max - min <= 1e-4): inverse scale 1, the value back exactly (float32)."""
    w = np.full((4, 64), 0.25, np.float32)
    w[1] = -3.0
    w[2, :32] = 1e-5
    q = hqq.quantize(w, dtype="uint4_g64_f32_bias")
    np.testing.assert_allclose(q.dequantize(), w, rtol=0, atol=1e-5)
    assert np.array_equal(q.dequantize()[:2], w[:2])


# -- against the hqq package, where installed -----------------------------------------------------------

@pytest.fixture(scope="module")
def hqq_pkg():
    pytest.importorskip("hqq")
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")
        from hqq.core.quantize import Quantizer
    return Quantizer


@pytest.mark.parametrize("bits,group,kind", [(4, 64, "t3"), (3, 64, "normal"), (2, 128, "laplace"), (8, 64, "uniform")])
def test_against_hqq_package(hqq_pkg, bits, group, kind):
    w = _weights(kind, (128, 512), seed=11)
    wt = torch.from_numpy(w)
    W_q, meta = hqq_pkg.quantize(wt, nbits=bits, group_size=group, axis=1, device="cpu", bitpack=False,
                                 round_zero=bits == 4, optimize=True)
    port = torch_quantize(wt, bits, group, round_zero=bits == 4, axis=1)
    assert torch.equal(W_q, port[0]) and torch.equal(meta["zero"], port[2])  # the port is hqq's code
    stype = "f16" if bits <= 6 else "f32"  # (see test_quantize_matches_port)
    q = hqq.quantize(w, dtype=f"uint{bits}_g{group}_{stype}_bias")
    codes, d, m = _fields(q)
    assert (codes == W_q.numpy()).mean() > 0.9999
    assert np.array_equal(d, meta["scale"].numpy().astype(np.float16 if stype == "f16" else np.float32)
                          .astype(np.float32))
    ref = hqq_pkg.dequantize(W_q, {**meta, "compute_dtype": torch.float32}).numpy()
    e_ref, e = np.linalg.norm(w - ref), np.linalg.norm(w - q.dequantize())
    assert abs(e / e_ref - 1) < 0.01
    # hqq's HQQLinear computes in float16: (W_q - zero16) * scale16; ours in float16 as well, as close
    ref16 = hqq_pkg.dequantize(W_q, {**meta, "scale": meta["scale"].half(), "zero": meta["zero"].half(),
                                     "compute_dtype": torch.float16}).float().numpy()
    assert abs(np.linalg.norm(w - ref16) / e - 1) < 0.01


def test_against_hqq_package_axis0(hqq_pkg):
    w = _weights("t3", (128, 256), seed=12)
    W_q, meta = hqq_pkg.quantize(torch.from_numpy(w), nbits=4, group_size=64, axis=0, device="cpu", bitpack=False,
                                 round_zero=True)
    g = w.reshape(64, -1)
    inv, z = _start(np.ascontiguousarray(g.T), 4, True)
    wq, _, z2 = hqq.optimize_weights_proximal(g, inv.T, z.T, [0, 15], axis=0)
    assert (wq == W_q.numpy()).mean() > 0.9999
    assert (np.abs(z2 - meta["zero"].numpy()) <= 4e-6).mean() > 0.999


# -- the property: better than round to nearest on heavy tails ----------------------------------------------

@pytest.mark.parametrize("kind", ["t3", "laplace"])
@pytest.mark.parametrize("bits", [3, 4])
def test_hqq_beats_round_to_nearest(kind, bits):
    """On heavy-tailed weights HQQ's error (squared and absolute) is below the two round-to-nearest
    quantizers of the same format: MLX's (``qarray.quantize``) and hqq's own start."""
    w = _weights(kind, (256, 1024), seed=21)
    name = f"uint{bits}_g64_f16_bias"
    ours = hqq.quantize(w, bits=bits, group_size=64).dequantize()
    for rtn in (qarray.quantize(w, dtype=name).dequantize(),
                hqq.quantize(w, bits=bits, group_size=64, optimize=False).dequantize()):
        assert np.linalg.norm(w - ours) < 0.99 * np.linalg.norm(w - rtn)
        assert np.abs(w - ours).mean() < 0.99 * np.abs(w - rtn).mean()


# -- the format and the arguments ---------------------------------------------------------------------

def test_shapes_and_dtypes():
    w = _weights("normal", (2, 3, 128), seed=1)
    q = hqq.quantize(w.astype(np.float16), group_size=-1)
    assert q.dtype.name == "uint4_g128_f16_bias" and q.shape == (2, 3, 128)
    q2 = hqq.quantize(w, dtype="uint3_g32_bf16_bias")
    assert q2.dtype.name == "uint3_g32_bf16_bias"
    assert np.array_equal(hqq.quantize(w.astype(np.float64)).data, hqq.quantize(w).data)
    assert np.array_equal(hqq.quantize(w.tolist()).data, hqq.quantize(w).data)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(bits=1), ValueError, "bits must be 2..8"),
    (dict(bits=9), ValueError, "bits must be 2..8"),
    (dict(bits=4.5), TypeError, "bits must be an integer"),
    (dict(bits=True), TypeError, "bits must be an integer"),
    (dict(group_size=12), ValueError, "multiple of 8"),
    (dict(group_size=0), ValueError, "multiple of 8"),
    (dict(group_size=40), ValueError, "does not divide the last axis"),
    (dict(group_size="64"), TypeError, "group_size must be an integer"),
    (dict(axis=0), ValueError, "axis must be 1"),
    (dict(dtype="uint4_g64_f16_zp"), ValueError, "float bias"),
    (dict(dtype="Q4_K"), ValueError, "float bias"),
    (dict(dtype="uint4_g64_f16_bias", bits=3), ValueError, "disagrees"),
    (dict(dtype="uint4_g64_f16_bias", group_size=128), ValueError, "disagrees"),
    (dict(iters=-1), ValueError, "iters"),
    (dict(iters=2.0), TypeError, "iters"),
    (dict(lp_norm=1.5), ValueError, "lp_norm"),
    (dict(beta=0), ValueError, "beta"),
    (dict(beta=float("nan")), TypeError, "beta"),
])
def test_bad_arguments(kwargs, exc, match):
    w = _weights("normal", (4, 96), seed=0)
    with pytest.raises(exc, match=match):
        hqq.quantize(w, **kwargs)


def test_bad_weights():
    w = _weights("normal", (4, 64), seed=0)
    for bad in (np.nan, np.inf):
        x = w.copy()
        x[2, 5] = bad
        with pytest.raises(ValueError, match=r"1 NaN or infinite value\(s\) as float32 \(the first at \(2, 5\)\)"):
            hqq.quantize(x)
    with pytest.raises(ValueError, match="NaN or infinite"):
        hqq.quantize(np.full((1, 64), 1e39))  # beyond float32
    with pytest.raises(TypeError, match="float array"):
        hqq.quantize(np.ones((4, 64), np.int32))
    with pytest.raises(ValueError, match="at least one dimension"):
        hqq.quantize(np.float32(1))
    with pytest.raises(ValueError, match="overflows"):
        hqq.quantize(np.concatenate([np.zeros((1, 63)), [[1e6]]], axis=1).astype(np.float32))


def test_optimize_bad_arguments():
    g = _weights("normal", (8, 64))
    inv, z = _start(g, 4, True)
    with pytest.raises(ValueError, match="shape"):
        hqq.optimize_weights_proximal(g, inv.T, z, [0, 15], axis=1)
    with pytest.raises(ValueError, match="axis must be 0 or 1"):
        hqq.optimize_weights_proximal(g, inv, z, [0, 15], axis=2)
    with pytest.raises(ValueError, match="2-d"):
        hqq.optimize_weights_proximal(g.ravel(), inv, z, [0, 15], axis=1)
    with pytest.raises(ValueError, match="min_max"):
        hqq.optimize_weights_proximal(g, inv, z, [1, 15], axis=1)


def test_docstring_example():
    assert doctest.testmod(hqq, extraglobs={"numpy": np}).failed == 0


def test_dask_weight():
    da = pytest.importorskip("dask.array")
    w = _weights("t3", (32, 128), seed=3)
    assert np.array_equal(hqq.quantize(da.from_array(w, chunks=(8, 64))).data, hqq.quantize(w).data)
