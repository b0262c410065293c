"""Bit-exact NumPy ports of ggml's weight quantizers for Q2_K..Q6_K, IQ4_NL and IQ4_XS.

Each ``quantize_*`` follows what ``ggml_quantize_chunk`` (ggml/src/ggml.c) runs with no importance
matrix, in ggml/src/ggml-quants.c of llama.cpp 0c1e570 (tests/data/ggml/make_vectors.py), and
returns the per-block fields unpacked (element order of the input, not ggml's byte order).

Every step is C's float32 arithmetic as written, vectorized over blocks and sub-blocks: the same
operation order (no contraction), float32 literals, ``nearest_int``'s bit trick, first-wins
argmax loops, and C's ``s += t`` loops summed in element order (``_seqsum``), never pairwise.
The helpers hold sub-blocks as columns, an (elements, sub-blocks) array, so that C's loop over
the elements is a loop over contiguous rows; the blocks go through in chunks that stay in cache.
"""

import functools

import numpy as np

__all__ = ["quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k",
           "quantize_iq4_nl", "quantize_iq4_xs"]

F = np.float32
GROUP_MAX_EPS = F(1e-15)
_CHUNK = 1 << 17  # elements quantized at a time
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _f(v):
    return np.asarray(v, dtype=F)


def _seqsum(a, start=True):
    """C's ``float s = 0; for (i...) s += a[i];`` over the rows of ``a``, in element order (``np.sum``
    leaves the order open, pairwise along a contiguous axis). ``start=False`` is the loop seeded
    with ``a[0]`` (no ``0 + a[0]``)."""
    s = np.zeros(a.shape[1:], F) if start else a[0].copy()
    for row in a if start else a[1:]:
        s += row
    return s


def _nearest_int(f):
    """ggml-quants.c ``nearest_int``: ``f + 12582912.f`` viewed as int32, low 22 bits (RNE in range)."""
    i = (_f(f) + F(12582912.0)).view(np.int32)
    return (i & 0x007FFFFF) - 0x00400000


def _fp16(f):
    """ggml-impl.h ``ggml_compute_fp32_to_fp16`` (RNE, overflow to inf, NaN -> 0x7E00 | sign)."""
    f = _f(f)
    with np.errstate(over="ignore"):
        h = f.astype(np.float16)
    nan = np.isnan(f)
    if nan.any():
        h[nan] = (np.uint16(0x7E00) | (f.view(np.uint32)[nan] >> 16 & 0x8000).astype(np.uint16)).view(np.float16)
    return h


def _signed_absmax(v, axis=0):
    """C's ``if (fabsf(v[i]) > amax) { amax = fabsf(v[i]); max = v[i]; }`` from amax = max = 0."""
    a = np.abs(v)
    a = np.where(a > 0, a, F(0))  # NaN never wins in C
    i = np.expand_dims(a.argmax(axis=axis), axis)  # first index on ties
    amax = np.take_along_axis(a, i, axis).squeeze(axis)
    return amax, np.where(amax > 0, np.take_along_axis(v, i, axis).squeeze(axis), F(0))


def _positive_max(v):
    """C's ``if (v[i] > m) m = v[i];`` from m = 0."""
    return np.where(v > 0, v, F(0)).max(axis=-1)


def _best_index_int8(values, x):
    """ggml-quants.c ``best_index_int8``: 0 if ``x <= val[0]``, n-1 if ``x >= val[n-1]``, else the
    bisection's bracket ``val[mu-1] <= x < val[mu]`` and ``x - val[mu-1] < val[mu] - x ? mu-1 : mu``
    (a tie takes the upper index; NaN ends at n-1).

    The table values are integers, so ``val > x`` iff ``val > floor(x)``: mu is looked up at
    ``floor(x)`` in a table of the first index above each integer in [val[0], val[n-1]).
    """
    n = len(values)
    lo, hi = int(values[0]), int(values[-1])
    upper = np.searchsorted(values, np.arange(lo, hi), side="right")
    k = np.floor(np.fmin(np.fmax(x, F(lo)), F(hi - 1))).astype(np.intp)  # NaN -> lo, fixed below
    mu = upper[k - lo]
    val = values.astype(F)
    res = np.where(x - val[mu - 1] < val[mu] - x, mu - 1, mu)
    res = np.where((x >= val[n - 1]) | np.isnan(x), n - 1, res)
    return np.where(x <= val[0], 0, res)


def _make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """ggml-quants.c ``make_qkx2_quants`` on the columns of ``x``: returns (scale, the_min, L)."""
    mn = x[0]
    mx = x[0]
    for xi in x[1:]:  # C: if (x[i] < min) min = x[i]; if (x[i] > max) max = x[i];
        mn = np.where(xi < mn, xi, mn)
        mx = np.where(xi > mx, xi, mx)
    sum_w = _seqsum(weights, start=False)
    sum_x = _seqsum(weights * x, start=False)
    mn = np.where(mn > 0, F(0), mn)
    flat = mx == mn

    def error(scale, mn, L):
        diff = scale * L.astype(F) + mn - x
        diff = np.abs(diff) if use_mad else diff * diff
        return _seqsum(weights * diff)

    iscale = F(nmax) / (mx - mn)
    L = np.clip(_nearest_int(iscale * (x - mn)), 0, nmax)
    scale = F(1) / iscale
    best_error = error(scale, mn, L)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (mx - mn)  # mn: the best min so far
        Laux = np.clip(_nearest_int(iscale * (x - mn)), 0, nmax)
        lf = Laux.astype(F)
        sum_l = _seqsum(weights * lf)
        sum_l2 = _seqsum(weights * lf * lf)
        sum_xl = _seqsum(weights * lf * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, F(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        cur_error = error(this_scale, this_min, Laux)
        take = (D > 0) & (cur_error < best_error) & ~flat
        L = np.where(take, Laux, L)
        best_error = np.where(take, cur_error, best_error)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    return np.where(flat, F(0), scale), -mn, np.where(flat, 0, L)


def _make_q3_quants(x, nmax):
    """ggml-quants.c ``make_q3_quants`` with do_rmse=true on the columns of ``x``: returns (scale, L + nmax)."""
    amax, mx = _signed_absmax(x)
    L = np.clip(_nearest_int(F(-nmax) / mx * x), -nmax, nmax - 1)
    w = x * x
    lf = L.astype(F)
    sumlx = _seqsum(w * x * lf)
    suml2 = _seqsum(w * lf * lf)
    for _ in range(5):  # a pass with no change leaves the state as it was, so columns that C stops stay put
        changed = False
        for xi, wi, Li in zip(x, w, L):
            li = Li.astype(F)
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new_l = np.clip(_nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
            nl = new_l.astype(F)
            slx_new = slx + wi * xi * nl
            sl2_new = sl2 + wi * nl * nl
            take = ((slx > 0) & (new_l != Li) & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            Li[take] = new_l[take]  # a row of L, in place
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
            changed = changed or take.any()
        if not changed:
            break
    zero = amax < GROUP_MAX_EPS
    scale = np.where(zero | ~(suml2 > 0), F(0), sumlx / suml2)
    return scale, np.where(zero, 0, L + nmax)


def _make_qx_quants(x, nmax, weights):
    """ggml-quants.c ``make_qx_quants`` with rmse_type=1 on the columns of ``x``: returns (scale, L).

    ``weights`` is C's ``w``: ``x*x`` when ``qw`` is NULL.
    """
    amax, mx = _signed_absmax(x)

    def try_scale(iscale):
        l = np.clip(_nearest_int(iscale * x), -nmax, nmax - 1)
        lf = l.astype(F)
        return l + nmax, _seqsum(weights * x * lf), _seqsum(weights * lf * lf)

    L, sumlx, suml2 = try_scale(F(-nmax) / mx)
    scale = np.where(suml2 != 0, sumlx / suml2, F(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        Lt, sumlx, suml2 = try_scale(-(F(nmax) + F(0.1) * F(step)) / mx)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(take, Lt, L)
        scale = np.where(take, sumlx / suml2, scale)
        best = np.where(take, scale * sumlx, best)
    zero = amax < GROUP_MAX_EPS
    return np.where(zero, F(0), scale), np.where(zero, 0, L)


def _iq4_scales(x, weights, values, ntry):
    """The per-block search of ggml-quants.c ``quantize_row_iq4_nl_impl`` (ntry > 0) on the
    columns of ``x``: the float scale of each block (0 for an all-zero block)."""
    amax, mx = _signed_absmax(x)
    vf = values.astype(F)

    def sums(iscale):
        q = vf[_best_index_int8(values, iscale * x)]
        return _seqsum(weights * q * x), _seqsum(weights * q * q)

    sumqx, sumq2 = sums(F(1) / (-mx / F(values[0])))
    d = np.where(sumq2 > 0, sumqx / sumq2, F(0))
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        sumqx, sumq2 = sums(F(itry + int(values[0])) / mx)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(take, sumqx / sumq2, d)
        best = np.where(take, d * sumqx, best)
    return np.where(amax < GROUP_MAX_EPS, F(0), d)


def _columns(x, n):
    """The (nb, block) blocks as an (n, nb*block/n) array: one column per sub-block of n."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _blocks(L, nb):
    """Back from columns of n to (nb, 256/n, n)."""
    return L.T.reshape(nb, 256 // len(L), len(L))


def _requant(x, d, lo, hi, dm=None):
    """The K-quants' last step ``clamp(nearest_int((x + dm)/d), lo, hi)`` for x (nb, nsub, n),
    d and dm (nb, nsub); the caller keeps the search's L where ``!d``, as C does."""
    xv = x if dm is None else x + dm[..., None]
    return np.clip(_nearest_int(xv / d[..., None]), lo, hi)


def _chunked(block):
    """Checks x as (nblocks, block) float32 and quantizes it in chunks (the fields concatenated)."""
    def wrap(fn):
        @functools.wraps(fn)
        def quantize(x):
            x = np.ascontiguousarray(x, dtype=F)
            if x.ndim != 2 or x.shape[1] != block:
                raise ValueError(f"expected a float32 array of shape (nblocks, {block}), got {x.shape}")
            step = _CHUNK // block
            with np.errstate(all="ignore"):
                parts = [fn(x[i:i + step]) for i in range(0, max(len(x), 1), step)]
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return quantize
    return wrap


@_chunked(256)
def quantize_q2_k(x):
    """ggml-quants.c ``quantize_row_q2_K_ref`` (what ``quantize_q2_K`` runs without an imatrix).

    Fields: d, dmin float16 (nb,); scales, mins uint8 (nb, 16) 4-bit codes; q uint8 (nb, 256) in [0, 3].
    """
    nb = len(x)
    xs = _columns(x, 16)
    scales, mins, L = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins, L = scales.reshape(nb, 16), mins.reshape(nb, 16), _blocks(L, nb)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    has_s, has_m = (max_scale > 0)[:, None], (max_min > 0)[:, None]
    byte = np.where(has_s, _nearest_int((F(15) / max_scale)[:, None] * scales) & 0xFF, 0)  # uint8 stores
    byte |= np.where(has_m, (_nearest_int((F(15) / max_min)[:, None] * mins) << 4) & 0xFF, 0)
    d = _fp16(np.where(max_scale > 0, max_scale / F(15), F(0)))
    dmin = _fp16(np.where(max_min > 0, max_min / F(15), F(0)))
    sc, m = byte & 0xF, byte >> 4
    dl = d.astype(F)[:, None] * sc.astype(F)
    ml = dmin.astype(F)[:, None] * m.astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 16, 16), dl, 0, 3, ml), L)
    return {"d": d, "dmin": dmin, "scales": sc.astype(np.uint8), "mins": m.astype(np.uint8),
            "q": L.reshape(nb, 256).astype(np.uint8)}


@_chunked(256)
def quantize_q3_k(x):
    """ggml-quants.c ``quantize_row_q3_K_ref`` (what ``quantize_q3_K`` runs without an imatrix).

    Fields: d float16 (nb,); scales uint8 (nb, 16) in [0, 63] (sub-scale + 32);
    q uint8 (nb, 256) in [0, 7] (q + 4; bit 2 is the hmask bit).
    """
    nb = len(x)
    scales, L = _make_q3_quants(_columns(x, 16), 4)
    scales, L = scales.reshape(nb, 16), _blocks(L, nb)
    _, max_scale = _signed_absmax(scales, axis=1)
    iscale = F(-32) / max_scale
    l = _nearest_int(iscale[:, None] * scales).astype(np.int8)  # C: int8_t l = nearest_int(...)
    ls = np.where((max_scale != 0)[:, None], np.clip(l, -32, 31) + 32, 0)
    d = _fp16(np.where(max_scale != 0, F(1) / iscale, F(0)))
    dl = d.astype(F)[:, None] * (ls - 32).astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 16, 16), dl, -4, 3) + 4, L)
    return {"d": d, "scales": ls.astype(np.uint8), "q": L.reshape(nb, 256).astype(np.uint8)}


def _q45_k(x, nmax, rmin, nstep):
    """``quantize_row_q4_K_ref`` / ``quantize_row_q5_K_ref``, which differ only in these constants."""
    nb = len(x)
    xs = _columns(x, 32)
    av_x = np.sqrt(_seqsum(xs * xs) / F(32))
    weights = av_x + np.abs(xs)
    scales, mins, L = _make_qkx2_quants(xs, weights, nmax, rmin, 0.1, nstep, False)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), _blocks(L, nb)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0))
    inv_min = np.where(max_min > 0, F(63) / max_min, F(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)  # C: uint8_t, then MIN(63, .)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d = _fp16(max_scale / F(63))
    dmin = _fp16(max_min / F(63))
    dl = d.astype(F)[:, None] * ls.astype(F)
    ml = dmin.astype(F)[:, None] * lm.astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 8, 32), dl, 0, nmax, ml), L)
    return {"d": d, "dmin": dmin, "scales": ls.astype(np.uint8), "mins": lm.astype(np.uint8),
            "q": L.reshape(nb, 256).astype(np.uint8)}


@_chunked(256)
def quantize_q4_k(x):
    """ggml-quants.c ``quantize_row_q4_K_ref`` (what ``quantize_q4_K`` runs without an imatrix).

    Fields: d, dmin float16 (nb,); scales, mins uint8 (nb, 8) in [0, 63]; q uint8 (nb, 256) in [0, 15].
    """
    return _q45_k(x, 15, -1.0, 20)


@_chunked(256)
def quantize_q5_k(x):
    """ggml-quants.c ``quantize_row_q5_K_ref`` (what ``quantize_q5_K`` runs without an imatrix).

    Fields: d, dmin float16 (nb,); scales, mins uint8 (nb, 8) in [0, 63]; q uint8 (nb, 256) in [0, 31].
    """
    return _q45_k(x, 31, -0.5, 15)


@_chunked(256)
def quantize_q6_k(x):
    """ggml-quants.c ``quantize_row_q6_K_ref`` (what ``quantize_q6_K`` runs without an imatrix).

    Fields: d float16 (nb,); scales int8 (nb, 16); q uint8 (nb, 256) in [0, 63] (q + 32).
    """
    nb = len(x)
    xs = _columns(x, 16)
    scales, L = _make_qx_quants(xs, 32, xs * xs)
    scales, L = scales.reshape(nb, 16), _blocks(L, nb)
    amax, max_scale = _signed_absmax(scales, axis=1)
    iscale = F(-128) / max_scale
    d = _fp16(F(1) / iscale)
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales)).astype(np.int8)
    dl = d.astype(F)[:, None] * sc.astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 16, 16), dl, -32, 31) + 32, L)
    zero = amax < GROUP_MAX_EPS  # C: the whole block memset to 0
    d = np.where(zero, np.float16(0), d)
    sc = np.where(zero[:, None], np.int8(0), sc)
    L = np.where(zero[:, None, None], 0, L)
    return {"d": d, "scales": sc, "q": L.reshape(nb, 256).astype(np.uint8)}


@_chunked(32)
def quantize_iq4_nl(x):
    """ggml-quants.c ``quantize_iq4_nl`` (``quantize_row_iq4_nl_impl`` with 32-blocks, ntry=7;
    not ``quantize_row_iq4_nl_ref``, which uses ntry=-1).

    Fields: d float16 (nb,); q uint8 (nb, 32) in [0, 15], indices into kvalues_iq4nl.
    """
    xs = _columns(x, 32)
    d = _iq4_scales(xs, xs * xs, KVALUES_IQ4NL, 7)
    inv = np.where(d != 0, F(1) / d, F(0))
    q = _best_index_int8(KVALUES_IQ4NL, inv[:, None] * x)
    return {"d": _fp16(d), "q": q.astype(np.uint8)}


@_chunked(256)
def quantize_iq4_xs(x):
    """ggml-quants.c ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` with 256-super-blocks of
    32-blocks, ntry=7).

    Fields: d float16 (nb,); scales uint8 (nb, 8) in [0, 63] (sub-scale + 32); q uint8 (nb, 256) in [0, 15].
    """
    nb = len(x)
    xs = _columns(x, 32)
    scales = _iq4_scales(xs, xs * xs, KVALUES_IQ4NL, 7).reshape(nb, 8)
    _, max_scale = _signed_absmax(scales, axis=1)
    d = -max_scale / F(32)  # -0.0 for an all-zero super-block, as in C
    inv = np.where(d != 0, F(1) / d, F(0))
    l = np.clip(_nearest_int(inv[:, None] * scales), -32, 31)
    dl = d[:, None] * l.astype(F)
    idl = np.where(dl != 0, F(1) / dl, F(0))
    q = _best_index_int8(KVALUES_IQ4NL, idl[..., None] * x.reshape(nb, 8, 32))
    return {"d": _fp16(d), "scales": (l + 32).astype(np.uint8), "q": q.reshape(nb, 256).astype(np.uint8)}
