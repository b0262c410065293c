"""qarray.gptq: GPTQ against a float64 port of AutoGPTQ's ``fasterquant`` (torch, where installed),
its gain over round to nearest, the Hessian's exact streaming and merging, bad input and extremes."""

import copy
import doctest
import itertools
from fractions import Fraction

import numpy as np
import pytest

import qarray as qa
from qarray import gptq
from qarray.io.hf import from_qarray, g_idx_of

try:
    import torch
except ImportError:  # the reference port needs torch; the rest of the module does not
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (the reference port runs on it)")


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """One BLAS (and torch) thread: these are small products, where a busy machine's spinning BLAS
    threads cost more than they save (numpy's 256 x 256 Cholesky took 0.4 s on two threads here)."""
    limits = None
    try:
        from threadpoolctl import threadpool_limits
        limits = threadpool_limits(1)
    except ImportError:
        pass
    n = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    yield
    if torch is not None:
        torch.set_num_threads(n)
    if limits is not None:
        limits.restore_original_limits()


# -- the reference: AutoGPTQ's quantizer.py and gptq.py, ported line for line to float64 torch -------

def _ref_quantize(x, scale, zero, maxq):
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return scale * (q - zero)


class RefQuantizer:
    """AutoGPTQ's ``Quantizer`` (``perchannel=True``, ``weight=True``). One addition: ``store`` rounds
    each scale as the format keeps it, where the original keeps float32 and rounds at packing (the
    identity: the original)."""

    def __init__(self, bits, sym, mse=False, norm=2.4, grid=100, maxshrink=0.8, store=lambda s: s):
        self.maxq = torch.tensor(2 ** bits - 1)
        self.sym, self.mse, self.norm, self.grid, self.maxshrink, self.store = sym, mse, norm, grid, maxshrink, store

    def find_params(self, x):
        x = x.flatten(1)
        tmp = torch.zeros(x.shape[0], dtype=x.dtype)
        xmin = torch.minimum(x.min(1)[0], tmp)
        xmax = torch.maximum(x.max(1)[0], tmp)
        if self.sym:
            xmax = torch.maximum(torch.abs(xmin), xmax)
            tmp = xmin < 0
            if torch.any(tmp):
                xmin[tmp] = -xmax[tmp]
        tmp = (xmin == 0) & (xmax == 0)
        xmin[tmp] = -1
        xmax[tmp] = +1
        self.scale = self.store((xmax - xmin) / self.maxq)
        if self.sym:
            self.zero = torch.full_like(self.scale, (self.maxq + 1) / 2)
        else:
            self.zero = torch.round(-xmin / self.scale)
        if self.mse:
            best = torch.full([x.shape[0]], float("inf"), dtype=x.dtype)
            for i in range(int(self.maxshrink * self.grid)):
                p = 1 - i / self.grid
                xmin1 = p * xmin
                xmax1 = p * xmax
                scale1 = self.store((xmax1 - xmin1) / self.maxq)
                zero1 = torch.round(-xmin1 / scale1) if not self.sym else self.zero
                q = _ref_quantize(x, scale1.unsqueeze(1), zero1.unsqueeze(1), self.maxq)
                q -= x
                q.abs_()
                q.pow_(self.norm)
                err = torch.sum(q, 1)
                tmp = err < best
                if torch.any(tmp):
                    best[tmp] = err[tmp]
                    self.scale[tmp] = scale1[tmp]
                    self.zero[tmp] = zero1[tmp]
        self.scale = self.scale.reshape(-1, 1)
        self.zero = self.zero.reshape(-1, 1)

    def quantize(self, x):
        return _ref_quantize(x, self.scale, self.zero, self.maxq)


def ref_fasterquant(W, H, quantizer, blocksize=128, percdamp=0.01, group_size=-1, actorder=False,
                    static_groups=False):
    """AutoGPTQ's ``GPTQ.fasterquant`` on ``W`` (rows, columns) and ``H``, float64: ``(Q, scale, zero,
    g_idx, Hinv)``. One change: act-order's argsort is stable (torch's default leaves the order of
    ties, such as dead columns, open)."""
    W = W.clone()
    H = H.clone()
    columns = W.shape[1]
    quantizer.find_params(W)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    scale, zero = [], []
    now_idx = 1
    if static_groups:
        groups = []
        for i in range(0, columns, group_size):
            q = copy.deepcopy(quantizer)
            q.find_params(W[:, i:(i + group_size)])
            scale.append(q.scale)
            zero.append(q.zero)
            groups.append(q)
    if actorder:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]
        invperm = torch.argsort(perm)
    Q = torch.zeros_like(W)
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    Hinv = H
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if group_size != -1:
                if not static_groups:
                    if (i1 + i) % group_size == 0:
                        quantizer.find_params(W[:, (i1 + i):(i1 + i + group_size)])
                    if ((i1 + i) // group_size) - now_idx == -1:
                        scale.append(quantizer.scale)
                        zero.append(quantizer.zero)
                        now_idx += 1
                else:
                    idx = i1 + i
                    if actorder:
                        idx = perm[idx]
                    quantizer = groups[idx // group_size]
            q = quantizer.quantize(w.unsqueeze(1)).flatten()
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    group_size = group_size if group_size != -1 else columns
    if static_groups and actorder:
        g_idx = [perm[i] // group_size for i in range(columns)]
    else:
        g_idx = [i // group_size for i in range(columns)]
    g_idx = torch.tensor(g_idx, dtype=torch.int32)
    if actorder:
        Q = Q[:, invperm]
        g_idx = g_idx[invperm]
    if scale == []:
        scale.append(quantizer.scale)
        zero.append(quantizer.zero)
    return Q, torch.cat(scale, dim=1), torch.cat(zero, dim=1), g_idx, Hinv


def store_as(stype):
    """The reference's scale rounding for a scale type: through float32, as AutoGPTQ's float32 scales."""
    if stype is None:
        return lambda s: s
    t = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[stype]
    return lambda s: s.to(torch.float32).to(t).to(torch.float64)


# -- data ---------------------------------------------------------------------------------------------

def correlated(rng, n, k, rank=None, noise=0.3):
    """Inputs whose columns are strongly correlated: a low-rank product plus a little noise."""
    rank = rank or max(1, k // 4)
    return rng.standard_normal((n, rank)) @ rng.standard_normal((rank, k)) + noise * rng.standard_normal((n, k))


@pytest.fixture(scope="module")
def layer():
    """A 32 x 256 weight and the Hessian of 600 correlated float32 inputs, three of them dead."""
    rng = np.random.default_rng(1)
    x = correlated(rng, 600, 256)
    x[:, [5, 77, 200]] = 0
    return rng.standard_normal((32, 256)), gptq.Hessian(256).update(x.astype(np.float32)).hessian()


def ours(w, h, bits, sym, group_size, act_order=False, static_groups=False, block_size=128, mse=False, stype="f16"):
    k = w.shape[1]
    grid = gptq._GPTQGrid(bits, sym, mse, stype)
    codes, params, g_idx, values = gptq.fasterquant(
        w, h, grid, k if group_size == -1 else group_size, block_size=block_size, act_order=act_order,
        static_groups=static_groups and group_size != -1, per_channel=group_size == -1, values=True)
    return codes, np.stack([p[0] for p in params], 1), np.stack([p[1] for p in params], 1), g_idx, values


def theirs(w, h, bits, sym, group_size, act_order=False, static_groups=False, block_size=128, mse=False, stype="f16"):
    q, scale, zero, g_idx, hinv = ref_fasterquant(
        torch.from_numpy(w), torch.from_numpy(h), RefQuantizer(bits, sym, mse, store=store_as(stype)), block_size,
        0.01, group_size, act_order, static_groups and group_size != -1)
    q, scale, zero, g_idx = q.numpy(), scale.numpy(), zero.numpy(), g_idx.numpy().astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scale[:, g_idx] > 0, np.rint(q / scale[:, g_idx] + zero[:, g_idx]), zero[:, g_idx])
    return codes, scale, zero, g_idx, q


def same(a, b, scale_rtol=0.0):
    ca, sa, za, ga, va = a
    cb, sb, zb, gb, vb = b
    assert np.array_equal(ga, gb), "g_idx"
    assert np.array_equal(ca, cb), f"{int((ca != cb).sum())} codes of {ca.size} differ"
    assert np.array_equal(za, zb), "zero points"
    if scale_rtol:
        np.testing.assert_allclose(sa, sb, rtol=scale_rtol, atol=0)
        np.testing.assert_allclose(va, vb, rtol=1e-12, atol=1e-12)
    else:
        assert np.array_equal(sa, sb), "scales"
        assert np.array_equal(va, vb), "values"


# -- against the reference ----------------------------------------------------------------------------

SETTINGS = [(g, ao, st, blk) for g, ao, st, blk in itertools.product((-1, 32, 128), (False, True), (False, True),
                                                                        (32, 128)) if not (g == -1 and st)]


@needs_torch
@pytest.mark.parametrize("bits,sym", list(itertools.product((2, 3, 4, 8), (True, False))))
def test_matches_fasterquant_float16_scales(layer, bits, sym):
    """What GPTQ() does (float16 scales, rounded before the codes are chosen): the reference with the same
    rounding gives the same codes, scales, zero points, g_idx and values, bit for bit, for every group
    size (per channel, 32, 128), act-order with and without static groups, blocks of 32 and 128, with
    dead columns."""
    w, h = layer
    for g, ao, st, blk in SETTINGS:
        kw = dict(group_size=g, act_order=ao, static_groups=st, block_size=blk)
        try:
            same(ours(w, h, bits, sym, **kw), theirs(w, h, bits, sym, **kw))
        except AssertionError as e:
            raise AssertionError(f"{kw}: {e}") from None


@needs_torch
@pytest.mark.parametrize("bits", (2, 3, 4, 8))
def test_matches_fasterquant_unrounded(layer, bits):
    """GPTQ's own arithmetic (scales not rounded), the reference unchanged: the same codes, zero points and
    g_idx; scales within 1e-12 (both in float64, but the lazy batch updates are BLAS products whose
    sums run in different orders, so W differs in its last bits when a group's parameters are taken).

    Symmetric groups are compared where no such product comes before a group's first column: with one
    block, or per channel. Elsewhere GPTQ's symmetric grid puts a group's extreme negative weight exactly
    on a tie (``x / scale = -maxq / 2``) when the group starts a block (its first column then untouched
    by the block's own updates), and the last bit of that weight (the BLAS order) picks one of two codes;
    from there the two runs part. Rounding the scales to float16 (what ``GPTQ`` does) takes the tie
    away, and the test above compares that everywhere."""
    w, h = layer
    for g, ao, st, blk in SETTINGS:
        kw = dict(group_size=g, act_order=ao, static_groups=st, block_size=blk, stype=None)
        try:
            same(ours(w, h, bits, False, **kw), theirs(w, h, bits, False, **kw), scale_rtol=1e-12)
            kw["block_size"] = blk if g == -1 else 256
            same(ours(w, h, bits, True, **kw), theirs(w, h, bits, True, **kw), scale_rtol=1e-12)
        except AssertionError as e:
            raise AssertionError(f"{kw}: {e}") from None


@needs_torch
@pytest.mark.parametrize("sym", (True, False))
@pytest.mark.parametrize("stype", ("f16", None))
def test_matches_fasterquant_mse(layer, sym, stype):
    """``mse=True``: GPTQ's grid search of the range (100 steps, norm 2.4, up to 80% shrink)."""
    w, h = layer
    w = w[:8]
    kw = dict(group_size=32, act_order=True, block_size=32, mse=True, stype=stype)
    same(ours(w, h, 4, sym, **kw), theirs(w, h, 4, sym, **kw), scale_rtol=1e-12 if stype is None else 0)


@needs_torch
def test_inverse_cholesky_matches_torch(layer):
    """The upper Cholesky factor of H^-1: torch's cholesky -> cholesky_inverse -> cholesky(upper)."""
    _, h = layer
    h = h + np.eye(len(h)) * (0.01 * np.mean(np.diag(h)) + (np.diag(h) == 0))
    t = torch.from_numpy(h)
    want = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(t)), upper=True).numpy()
    got = gptq.inverse_cholesky(h)
    assert np.array_equal(got, np.triu(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())


# -- what GPTQ returns ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,act_order,static", [(None, False, False), (None, True, False), (None, True, True),
                                                    ("uint3_g32_f16_zp", True, False), ("int8_g64_bf16", True, False),
                                                    ("uint4_g128_f32_zp", False, False)])
def test_qarray_holds_what_the_loop_chose(layer, dtype, act_order, static):
    """The QArray's codes, scales, zero points and act-order (g_idx) are the loop's; it dequantizes to
    the loop's values, rounded once to the scales' type as GPTQ's kernels compute them; GPTQ's
    checkpoint round trip keeps it."""
    w, h = layer
    g = gptq.GPTQ(w, dtype=dtype, act_order=act_order, static_groups=static)
    codes, params, g_idx, values = g._run(h, values=True)
    q = g._qarray(codes, params, g_idx)
    assert q.shape == w.shape and q.dtype == g.dtype
    grouped = from_qarray(q)
    assert np.array_equal(grouped.codes, codes)
    assert np.array_equal(grouped.scale.astype(np.float64), np.stack([p[0] for p in params], 1))
    if grouped.zero is not None:
        assert np.array_equal(grouped.zero, np.stack([p[1] for p in params], 1))
    assert np.array_equal(g_idx_of(q, g._group), g_idx)
    assert (q.columns is not None) == (act_order and not static)
    precision = q.dtype.layout.precision
    want = qa._blocks.rounded(values.astype(np.float32), precision)
    assert np.array_equal(q.dequantize(), want)
    assert np.array_equal(g.quantize(hessian=h).dequantize(), want)


def test_saved_as_gptq_reads_back(layer, tmp_path):
    """A GPTQ result with act-order saves as a GPTQ checkpoint (g_idx, desc_act) and loads the same."""
    w, h = layer
    q = gptq.quantize(w, hessian=h, bits=4, group_size=32, sym=False, act_order=True)
    qa.save(tmp_path / "m", {"layers.0.mlp.down_proj.weight": q}, format="gptq")
    back = qa.load(tmp_path / "m")["layers.0.mlp.down_proj.weight"]
    assert back.dtype == q.dtype and np.array_equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("dtype", ["Q4_0", "Q4_K", "IQ4_NL", "nf4_g64_f32", "uint4_g32_f16_bias", "MXFP4"])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, False), (True, True)])
def test_block_formats_round_to_the_nearest_value_of_their_blocks(layer, dtype, act_order, static):
    """A block format: its QArray dequantizes to exactly the values the loop compensated for, and each is
    the value of the block (its parameters as stored) nearest to the weight the loop rounded, found here
    by trying every code."""
    w, h = layer
    g = gptq.GPTQ(w, dtype=dtype, act_order=act_order, static_groups=static)
    seen = []
    grid = g._grid
    rounder = grid.round

    def spy(col, p, slot):
        codes, vals = rounder(col, p, slot)
        seen.append((col.copy(), p, slot, codes, vals))
        return codes, vals
    grid.round = spy
    codes, params, g_idx, values = g._run(h, values=True)
    q = g._qarray(codes, params, g_idx)
    assert q.dtype.name == qa.qdtype(dtype).name and q.shape == w.shape
    assert np.array_equal(q.dequantize().astype(np.float64), values)
    f = q.dtype.layout
    table = f.values.astype(np.float32)
    for col, p, slot, c, v in seen[:: max(1, len(seen) // 40)]:
        all_values = grid._value(table[None, :], *[None if a is None else a[:, slot // f.sub, None]
                                                   for a in p[1:]])  # (rows, codes)
        best = np.abs(all_values - col[:, None]).min(axis=1)
        assert np.array_equal(np.abs(v - col), best)
        assert np.array_equal(all_values[np.arange(len(col)), c], v)


# -- better than round to nearest ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int4_g128_f16", "uint3_g64_f16_zp", "int3_g32_f16", "Q4_0", "Q4_K",
                                   "uint4_g128_f16_zp"])
@pytest.mark.parametrize("act_order", (False, True))
def test_lower_output_error_than_round_to_nearest(dtype, act_order):
    """On inputs with strongly correlated columns, ``||W X^T - Q X^T||`` (on inputs the Hessian never saw)
    is at least 20% below round to nearest's (``qarray.quantize`` of the same format)."""
    rng = np.random.default_rng(3)
    k = 256
    mix = rng.standard_normal((32, k))
    def inputs(n):
        return rng.standard_normal((n, 32)) @ mix + 0.2 * rng.standard_normal((n, k))
    w = rng.standard_normal((48, k)).astype(np.float32)
    q = gptq.quantize(w, inputs(1024).astype(np.float32), dtype=dtype, act_order=act_order)
    rtn = qa.quantize(w, dtype=dtype)
    x = inputs(512)

    def err(r):
        return np.linalg.norm((w.astype(np.float64) - r.dequantize().astype(np.float64)) @ x.T)
    assert err(q) < 0.8 * err(rtn), (err(q), err(rtn))


# -- the Hessian ---------------------------------------------------------------------------------------

def exact_sum(h):
    """The Hessian's sum X^T X as exact integers times powers of two (Fractions), from its state."""
    s = h.state_dict()
    total = np.zeros(s["digits"].shape[1:], object)
    for j, d in zip(s["exponents"].tolist(), s["digits"]):
        total = total + np.vectorize(lambda v, j=j: Fraction(int(v)) * Fraction(2) ** (60 * j), otypes=[object])(d)
    return total


def mixed(rng, n, k, dtype=np.float32):
    """Inputs of very different magnitudes (1e-30 to 1e20), zeros, and a column of a constant."""
    x = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-30, 20, size=(n, k))
    x[rng.random((n, k)) < 0.1] = 0
    x[:, 1] = 3.0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, "bfloat16", np.int32])
def test_hessian_is_exact(rng, dtype):
    """Each entry of the sum is sum_t x_ti x_tj exactly (Fractions), for every input type, over a batch of
    rows longer than one product takes (ROWS), with magnitudes 50 decades apart."""
    k = 5
    if dtype == "bfloat16":
        import ml_dtypes
        x = mixed(rng, 300, k).astype(ml_dtypes.bfloat16)
        f = x.astype(np.float64)
    elif dtype == np.int32:
        x = rng.integers(-2**31, 2**31, size=(300, k)).astype(np.int32)
        f = x.astype(np.float64)
    else:
        x = mixed(rng, 300, k, np.float64 if dtype == np.float64 else np.float32)
        x = x.astype(dtype) if dtype != np.float16 else np.clip(x, -60000, 60000).astype(np.float16)
        f = x.astype(np.float64)
    h = gptq.Hessian(k).update(x)
    want = np.empty((k, k), object)
    for i in range(k):
        for j in range(k):
            want[i, j] = sum((Fraction(a) * Fraction(b) for a, b in zip(f[:, i].tolist(), f[:, j].tolist())),
                             Fraction(0))
    assert (exact_sum(h) == want).all()
    np.testing.assert_allclose(h.hessian(), 2 / 300 * (f.T @ f), rtol=1e-12)


@pytest.mark.parametrize("n", (1, 2, 511, 512, 513, 2048))
def test_hessian_is_exact_at_the_bound(rng, n):
    """Positive values near the largest, full float32 significands: the slices' products sum to nearly
    ``n * 2^(2 bits)``, as close to 2^53 as the slice width allows (one more bit would round)."""
    x = (rng.uniform(0.999, 1, size=(n, 3)) * np.array([1, -1, 1]) * 2.0**60).astype(np.float32)
    f = x.astype(np.float64)
    h = gptq.Hessian(3).update(x)
    for i, j in ((0, 0), (0, 1), (1, 2)):
        assert exact_sum(h)[i, j] == sum(Fraction(a) * Fraction(b) for a, b in zip(f[:, i].tolist(), f[:, j].tolist()))


def test_hessian_is_exact_over_many_rows(rng, monkeypatch):
    """More rows than one product takes: the rows go in blocks, each its own slices."""
    monkeypatch.setattr(gptq, "ROWS", 64)
    x = mixed(rng, 300, 4)
    a = gptq.Hessian(4).update(x)
    monkeypatch.setattr(gptq, "ROWS", 8192)
    b = gptq.Hessian(4).update(x)
    assert (exact_sum(a) == exact_sum(b)).all()
    f = x.astype(np.float64)
    want = sum(Fraction(float(u)) * Fraction(float(v)) for u, v in zip(f[:, 2], f[:, 3]))
    assert exact_sum(a)[2, 3] == want


def test_hessian_pending_products_flush_exactly(rng, monkeypatch):
    """Products wait as int64 sums at their power of two and go into the digits every ``_PENDING``
    products: values near the slices' top, streamed a row at a time past two flushes (sums near
    2^60, twice that with a cross product's mirror), columns at several powers so that the sums land
    at several places in a digit; and a flush every 3 products gives the same state."""
    x = (rng.uniform(0.999, 1, size=(600, 4)) * np.array([1, -2.0**-7, 2.0**-13, -2.0**-40]) * 2.0**60)
    x = x.astype(np.float32)
    streamed = gptq.Hessian(4)
    for row in x:
        streamed.update(row[None])
    f = x.astype(np.float64)
    for i in range(4):
        for j in range(i, 4):
            assert exact_sum(streamed)[i, j] == sum(Fraction(a) * Fraction(b)
                                                    for a, b in zip(f[:, i].tolist(), f[:, j].tolist()))
    monkeypatch.setattr(gptq, "_PENDING", 3)
    often = gptq.Hessian(4)
    for row in x[:100]:
        often.update(row[None])
    assert states_equal(often, gptq.Hessian(4).update(x[:100]))


def states_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)


def test_hessian_same_bits_in_any_order_and_split(rng):
    """Batches in any order, split anywhere, merged in any tree: the same state and the same H bits."""
    x = correlated(rng, 700, 64).astype(np.float32)
    x[:7] *= 1e-6  # rows whose slices lie lower
    whole = gptq.Hessian(64).update(x)
    h = whole.hessian()
    cuts = [0, 1, 50, 333, 334, 600, 700]
    parts = [x[a:b] for a, b in zip(cuts, cuts[1:])]
    streamed = gptq.Hessian(64)
    for p in reversed(parts):
        streamed.update(p)
    singles = [gptq.Hessian(64).update(p) for p in parts]
    left = copy.deepcopy(singles[0])
    for s in singles[1:]:
        left.merge(s)
    right = gptq.Hessian(64)
    for s in reversed(singles):
        right = gptq.Hessian(64).merge(s).merge(right)
    tree = copy.deepcopy(singles[0]).merge(singles[1]).merge(copy.deepcopy(singles[4]).merge(singles[5])).merge(
        copy.deepcopy(singles[2]).merge(singles[3]))
    for other in (streamed, left, right, tree):
        assert states_equal(whole, other)
        assert np.array_equal(other.hessian(), h)
        assert other.count == 700
    back = gptq.Hessian.from_state(whole.state_dict())
    assert states_equal(back, whole) and np.array_equal(back.hessian(), h)
    self_merge = copy.deepcopy(whole).merge(whole)
    assert states_equal(self_merge, copy.deepcopy(whole).merge(copy.deepcopy(whole)))
    assert np.array_equal(h, h.T)


def test_gptq_objects_merge(rng):
    """Two GPTQs fed halves of the data, merged, quantize as one fed all of it (``add_batch`` too)."""
    w = rng.standard_normal((16, 64))
    x = correlated(rng, 300, 64).astype(np.float32)
    a = gptq.GPTQ(w, group_size=32).add_batch(x[:100])
    b = gptq.GPTQ(w, group_size=32).update(x[100:])
    one = gptq.GPTQ(w, group_size=32).update(x)
    assert a.merge(b).nsamples == 300
    assert np.array_equal(a.quantize().data, one.quantize().data)
    assert np.array_equal(one.quantize().data, gptq.quantize(w, x, group_size=32).data)


def test_hessian_of_dask_chunks(rng):
    """A Dask array: each chunk of rows summed on its own, the parts merged: the same state as NumPy's."""
    da = pytest.importorskip("dask.array")
    x = correlated(rng, 500, 48).astype(np.float32)
    x[3] *= 1e-9
    lazy = da.from_array(x, chunks=(77, 20))
    assert states_equal(gptq.Hessian(48).update(lazy), gptq.Hessian(48).update(x))
    assert states_equal(gptq.Hessian(48).update(lazy.reshape(5, 100, 48)), gptq.Hessian(48).update(x))


def test_hessian_leading_axes_and_empty_batches(rng):
    x = rng.standard_normal((3, 10, 16)).astype(np.float32)
    a = gptq.Hessian(16).update(x).update(np.zeros((0, 16), np.float32))
    assert a.count == 30 and states_equal(a, gptq.Hessian(16).update(x.reshape(30, 16)))


def test_inexact_hessian_is_gptqmodels_float_sum(rng):
    """``exact=False``: one float32 product ``x^T x`` a batch of float32 inputs (float64 for float64 and
    integer inputs), summed in float64 (GPTQModel's arithmetic, its running mean aside): bit for bit
    that sum of NumPy's products, within float32 rounding of the exact sum; it merges, keeps its state
    and feeds GPTQ (the codes of a well-conditioned layer as the exact Hessian's, nearly all)."""
    x = correlated(rng, 600, 64).astype(np.float32)
    h = gptq.Hessian(64, exact=False).update(x[:250]).update(x[250:])
    want = (x[:250].T @ x[:250]).astype(np.float64) + (x[250:].T @ x[250:]).astype(np.float64)
    assert np.array_equal(h.sum(), want) and h.count == 600 and "exact=False" in repr(h)
    exact = gptq.Hessian(64).update(x)
    np.testing.assert_allclose(h.sum(), exact.sum(), rtol=0, atol=1e-5 * np.abs(exact.sum()).max())
    f = rng.integers(-2**31, 2**31, (5, 64), dtype=np.int64).astype(np.int32)
    assert np.array_equal(gptq.Hessian(64, exact=False).update(f).sum(), f.astype(np.float64).T @ f.astype(np.float64))
    merged = gptq.Hessian(64, exact=False).update(x[:250]).merge(gptq.Hessian(64, exact=False).update(x[250:]))
    assert np.array_equal(merged.hessian(), h.hessian())
    back = gptq.Hessian.from_state(h.state_dict())
    assert not back.exact and back.count == 600 and np.array_equal(back.hessian(), h.hessian())
    assert gptq.Hessian.from_state(gptq.Hessian(3, exact=False).state_dict()).count == 0
    w = rng.standard_normal((32, 64))
    a = gptq.quantize(w, x, group_size=32, exact=False)
    b = gptq.quantize(w, x, group_size=32)
    assert np.mean(a.dequantize() == b.dequantize()) > 0.99


def test_inexact_hessian_of_dask_chunks(rng):
    da = pytest.importorskip("dask.array")
    x = correlated(rng, 500, 48).astype(np.float32)
    h = gptq.Hessian(48, exact=False).update(da.from_array(x, chunks=(100, 48)))
    want = sum((x[i:i + 100].T @ x[i:i + 100]).astype(np.float64) for i in range(0, 500, 100))
    np.testing.assert_allclose(h.sum(), want, rtol=1e-12, atol=1e-9)
    assert h.count == 500 and not h.exact


# -- bad input -----------------------------------------------------------------------------------------

def test_bad_input():
    w = np.zeros((4, 128))
    x = np.ones((8, 128), np.float32)
    cases = [
        (lambda: gptq.GPTQ(np.zeros(64)), ValueError,
         r"GPTQ: w must be a 2-d weight \(out_features, in_features\), got shape \(64,\)"),
        (lambda: gptq.GPTQ(np.zeros((4, 64), np.int32)), TypeError, "GPTQ: w must be a float array"),
        (lambda: gptq.GPTQ(np.full((4, 64), np.nan)), ValueError,
         r"GPTQ: w holds 256 NaN or infinite value\(s\) \(the first at \(0, 0\)\)"),
        (lambda: gptq.GPTQ(w, bits=1), ValueError, r"GPTQ: bits must be in \[2, 8\], got 1"),
        (lambda: gptq.GPTQ(w, bits=9), ValueError, r"GPTQ: bits must be in \[2, 8\], got 9"),
        (lambda: gptq.GPTQ(w, bits=4.0), TypeError, "GPTQ: bits must be an integer, got float"),
        (lambda: gptq.GPTQ(w, group_size=48), ValueError, "GPTQ: group_size 48 does not divide in_features 128"),
        (lambda: gptq.GPTQ(np.zeros((4, 60)), group_size=12), ValueError,
         "GPTQ: groups of 12 columns: GPTQ's formats hold groups of a multiple of 8 columns"),
        (lambda: gptq.GPTQ(np.zeros((4, 60)), group_size=-1), ValueError,
         r"GPTQ: groups of 60 columns \(per channel\)"),
        (lambda: gptq.GPTQ(w, group_size=32.0), TypeError, "GPTQ: group_size must be an integer, got float"),
        (lambda: gptq.GPTQ(w, damp_percent=1.5), ValueError, r"GPTQ: damp_percent must be in \[0, 1\), got 1.5"),
        (lambda: gptq.GPTQ(w, block_size=0), ValueError, "GPTQ: block_size must be >= 1, got 0"),
        (lambda: gptq.GPTQ(w, dtype="qint8"), ValueError, "GPTQ: dtype 'qint8' is not a block format"),
        (lambda: gptq.GPTQ(np.zeros((4, 256)), dtype="IQ2_XXS"), ValueError, "GPTQ: IQ2_XXS is not one GPTQ can fill"),
        (lambda: gptq.GPTQ(w, dtype="Q4_0", bits=4), ValueError, "GPTQ: Q4_0 picks its own parameters; drop bits"),
        (lambda: gptq.GPTQ(w, dtype="Q4_0", mse=True), ValueError, "GPTQ: Q4_0 picks its own parameters; drop mse"),
        (lambda: gptq.GPTQ(w, dtype="int4_g32_f16", bits=3), ValueError,
         r"GPTQ: bits=3 disagrees with dtype int4_g32_f16 \(bits 4\)"),
        (lambda: gptq.GPTQ(w, dtype="int4_g32_f16", sym=False), ValueError,
         r"GPTQ: sym=False disagrees with dtype int4_g32_f16 \(sym True\)"),
        (lambda: gptq.GPTQ(np.zeros((4, 48)), dtype="Q4_K"), ValueError,
         r"GPTQ: group_size 256 does not divide in_features 48 \(Q4_K's blocks of 256 values\)"),
        (lambda: gptq.GPTQ(w).update(np.ones((8, 32))), ValueError,
         r"Hessian.update: inputs of shape \(\.\.\., 128\) are needed \(in_features 128\), got shape \(8, 32\)"),
        (lambda: gptq.GPTQ(w).update(np.full((8, 128), np.inf)), ValueError,
         r"Hessian.update: the inputs hold 1024 NaN or infinite value\(s\) \(the first at flat index 0\)"),
        (lambda: gptq.GPTQ(w).update(np.ones((8, 128), np.complex64)), TypeError, "Hessian.update: takes float16"),
        (lambda: gptq.GPTQ(w).update(np.ones((8, 128), np.int64)), TypeError, "Hessian.update: takes float16"),
        (lambda: gptq.GPTQ(w).quantize(), ValueError, "Hessian: no calibration inputs yet; call update"),
        (lambda: gptq.GPTQ(w).quantize(hessian=np.eye(32)), ValueError,
         r"GPTQ.quantize: hessian must be \(128, 128\), got shape \(32, 32\)"),
        (lambda: gptq.GPTQ(w, damp_percent=0).update(x).quantize(), ValueError,
         "GPTQ: the damped Hessian is not positive definite"),
        (lambda: gptq.GPTQ(np.full((4, 128), 1e6)).update(x).quantize(), ValueError,
         "GPTQ: a group spans 1e[+]06, which needs a scale above 65504, the largest f16 scale"),
        (lambda: gptq.quantize(w), TypeError, "gptq.quantize: give the calibration inputs x or a hessian"),
        (lambda: gptq.quantize(w, x, hessian=np.eye(128)), TypeError, "gptq.quantize: give the calibration inputs"),
        (lambda: gptq.Hessian(0), ValueError, "Hessian: in_features must be positive, got 0"),
        (lambda: gptq.Hessian(4.0), TypeError, "Hessian: in_features must be an integer, got float"),
        (lambda: gptq.Hessian(64).merge(gptq.Hessian(32)), ValueError,
         r"Hessian.merge: in_features differ \(64 here, 32 in the other\)"),
        (lambda: gptq.Hessian(64).merge(np.eye(64)), TypeError,
         "Hessian.merge: takes a Hessian or a GPTQ, got ndarray"),
        (lambda: gptq.Hessian.from_state({"kind": np.array("x")}), ValueError, "Hessian.from_state: a dict of arrays"),
        (lambda: gptq.Hessian(4, exact=1), TypeError, "Hessian: exact must be True or False, got 1"),
        (lambda: gptq.Hessian(2).merge(gptq.Hessian(2, exact=False)), ValueError,
         r"Hessian.merge: an exact Hessian cannot take an inexact one's sums \(exact=False\); collect both with the "
         "same exact setting"),
        (lambda: gptq.Hessian(2, exact=False).merge(gptq.Hessian(2)), ValueError,
         r"Hessian.merge: an inexact Hessian cannot take an exact one's sums \(exact=True\)"),
        (lambda: gptq.Hessian.from_state({**gptq.Hessian(2, exact=False).state_dict(), "sum": np.ones((2, 2),
                                                                                                     np.float32)}),
         ValueError, r"Hessian.from_state: 'sum' must be finite float64 of shape \(2, 2\); got float32 \(2, 2\)"),
        (lambda: gptq.Hessian.from_state({**gptq.Hessian(2).update(np.ones((1, 2))).state_dict(),
                                          "digits": np.full((1, 2, 2), 2**60)}), ValueError,
         r"Hessian.from_state: 'digits' must lie in \[-2\^59, 2\^59\)"),
        (lambda: gptq.Hessian.from_state({**gptq.Hessian(2).state_dict(), "in_features": np.array(3)}), ValueError,
         "Hessian.from_state: 'exponents' must be distinct integers and 'digits' int64 of shape"),
    ]
    for fn, kind, message in cases:
        with pytest.raises(kind, match=message):
            fn()


# -- extremes ------------------------------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("sym", (True, False))
def test_extremes_match_the_reference(rng, sym):
    """Constant rows (positive, negative, zero), zero columns and dead inputs, a group of identical values,
    one row 1e30 times larger and one 1e-30 times smaller than the rest (float32 scales, which hold
    both): the reference's codes, scales and values."""
    k = 64
    x = correlated(rng, 200, k)
    x[:, [3, 40]] = 0  # dead inputs
    h = gptq.Hessian(k).update(x.astype(np.float32)).hessian()
    w = rng.standard_normal((8, k))
    w[0], w[1], w[2] = 0.75, -2.5, 0.0
    w[3, 16:32] = 1.25  # one group of identical values
    w[:, 10] = 0  # a zero column
    w[4] *= 1e30
    w[5] *= 1e-30
    for stype in ("f32", None):
        for g, ao in ((16, False), (16, True), (-1, False)):
            kw = dict(group_size=g, act_order=ao, block_size=32, stype=stype)
            a = ours(w, h, 4, sym, **kw)
            same(a, theirs(w, h, 4, sym, **kw), scale_rtol=1e-12 if stype is None else 0)
            assert np.isfinite(a[4]).all()
    q = gptq.quantize(w, hessian=h, dtype="int4_g16_f32" if sym else "uint4_g16_f32_zp")
    v = q.dequantize().astype(np.float64)
    assert np.isfinite(v).all() and np.array_equal(v[2], np.zeros(k))


def test_tiny_weights_in_float16_scales(rng):
    """Weights below float16's smallest scale step: their groups' scales round to 0, their values to 0
    (the error then carried by later columns), no NaN; bfloat16 scales hold them."""
    k = 64
    h = gptq.Hessian(k).update(correlated(rng, 200, k).astype(np.float32)).hessian()
    w = rng.standard_normal((4, k)) * 1e-12
    q = gptq.quantize(w, hessian=h, group_size=32)
    assert np.array_equal(q.dequantize(), np.zeros((4, k), np.float32))
    assert (q.scale == 0).all() and (from_qarray(q).codes == 8).all()  # each at the zero point
    r = gptq.quantize(w, hessian=h, dtype="int4_g32_bf16")
    err = np.abs(r.dequantize().astype(np.float64) - w).max()
    assert 0 < err < 1e-11


def test_docstring_example():
    assert doctest.testmod(gptq, extraglobs={"numpy": np}).failed == 0
