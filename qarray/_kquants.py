"""Bit-exact NumPy ports of ggml's weight quantizers for Q2_K..Q6_K, IQ4_NL and IQ4_XS.

Each ``quantize_*(x, importance=None)`` follows what ``ggml_quantize_chunk`` (ggml/src/ggml.c) runs,
in ggml/src/ggml-quants.c of llama.cpp 0c1e570 (tests/data/ggml/make_vectors.py), and returns the
per-block fields unpacked (element order of the input, not ggml's byte order). Without
``importance`` that is ggml's path with no importance matrix (``quantize_row_q*_K_ref``,
``quantize_iq4_nl`` / ``quantize_iq4_xs`` with NULL weights). With it, ``importance`` holds the
``quant_weights`` entry of each value (llama.cpp's imatrix of the value's column: the caller lays
it over the blocks) and the port is ggml's importance-weighted path, ``quantize_row_*_impl``:

======  =====================================================================================
Q2_K    ``quantize_row_q2_K_impl``: weights ``qw * sqrtf(sigma2 + x^2)``, ``sigma2 = sum x^2 / 256``
        over the block; ``make_qkx3_quants`` per 16 (-0.9, 0.05, 36 steps), then ``make_qp_quants``
        of the scales and of the mins (weights: each sub-block's summed weights), 4 bits each
Q3_K    ``quantize_row_q3_K_impl``: ``sigma2 = 2 * sum x^2 / 256``; ``make_qx_quants`` (nmax 4)
        with the weights, then ``make_qx_quants`` (nmax 32) of the scales, weighted likewise
Q4_K    ``quantize_row_q4_K_impl`` / ``q5_K_impl``: ``sigma2 = 2 * sum x^2 / 256``;
Q5_K    ``make_qkx3_quants`` per 32 (-0.9, 0.05, 36 steps), ``make_qp_quants`` (nmax 63) of the
        scales and mins; Q4_K packs its 6-bit codes unclamped (a wrapped negative code keeps
        the bits that get_scale_min_k4 reads back), Q5_K clamps them to 63
Q6_K    ``quantize_row_q6_K_impl``: ``make_qx_quants`` weighted by ``qw`` itself (no sigma2)
IQ4_NL  ``quantize_row_iq4_nl_impl``: ``sigma2 = sum x^2 * (2 / super-block)`` over the 32-block
IQ4_XS  (IQ4_NL) or the 256-super-block (IQ4_XS); weights ``qw * sqrtf(sigma2 + x^2)``
======  =====================================================================================

``make_qkx3_quants`` is ``make_qkx2_quants`` (``_make_qkx2_quants``) wherever weights are given:
the two differ only in ``max <= min`` against ``max == min``, the same test once ``min`` is
clipped to 0, and in the weights' default.

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
    """ggml-quants.c ``make_qkx2_quants`` (and ``make_qkx3_quants`` with weights) on the columns of
    ``x``: returns (scale, the_min, L)."""
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


def _refine(x, weights, L, sumlx, suml2, clip, sl2_checked_after, store=lambda l: l):
    """The 5-pass search of ggml-quants.c ``make_q3_quants`` and ``make_qp_quants`` on the columns:
    each code ``L[i]`` in turn (a row of ``L``, changed in place) becomes ``clip(nearest_int(x[i] *
    sl2 / slx))`` (stored as ``store`` gives it: make_qp_quants' uint8) where ``slx > 0``, ``sl2 > 0``
    (after the move in make_q3_quants, before it in make_qp_quants), the code changes and the move
    raises ``sumlx^2 / suml2``, the sums without ``L[i]`` being ``slx`` and ``sl2``. A pass with no
    change leaves the state as it was, so running the passes on columns that C stopped changes
    nothing. Returns the final (sumlx, suml2)."""
    for _ in range(5):
        changed = False
        for xi, wi, Li in zip(x, weights, L):
            li = Li.astype(F)
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new_l = clip(_nearest_int(xi * sl2 / slx))
            nl = new_l.astype(F)
            slx_new = slx + wi * xi * nl
            sl2_new = sl2 + wi * nl * nl
            take = ((slx > 0) & ((sl2_new if sl2_checked_after else sl2) > 0) & (new_l != Li)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            Li[take] = store(new_l[take])  # a row of L, in place
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
            changed = changed or take.any()
        if not changed:
            break
    return sumlx, suml2


def _make_q3_quants(x, nmax):
    """ggml-quants.c ``make_q3_quants`` with do_rmse=true on the columns of ``x``: returns (scale, L + nmax)."""
    amax, mx = _signed_absmax(x)
    L = np.clip(_nearest_int(F(-nmax) / mx * x), -nmax, nmax - 1)
    w = x * x
    lf = L.astype(F)
    sumlx = _seqsum(w * x * lf)
    suml2 = _seqsum(w * lf * lf)
    sumlx, suml2 = _refine(x, w, L, sumlx, suml2, lambda l: np.clip(l, -nmax, nmax - 1), sl2_checked_after=True)
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


def _make_qp_quants(x, nmax, weights):
    """ggml-quants.c ``make_qp_quants`` on the columns of ``x`` (a block's sub-scales or sub-mins,
    one block a column), ``weights`` its ``quant_weights``: returns (scale, L), L as C's uint8 array
    holds it (a negative code wraps, and the search reads it back wrapped)."""
    mx = np.zeros(x.shape[1:], F)
    for xi in x:  # C: max = MAX(max, x[i]), i.e. max > x[i] ? max : x[i] (a NaN takes over, then the next x[i])
        mx = np.where(mx > xi, mx, xi)

    def mse(scale, l):
        diff = x - scale * l.astype(F)
        return _seqsum(weights * diff * diff)

    iscale = F(nmax) / mx
    best = mse(F(1) / iscale, _nearest_int(iscale * x) & 0xFF)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = (F(0.1) * F(step) + F(nmax)) / mx
        cur = mse(F(1) / iscale_is, np.minimum(nmax, _nearest_int(iscale_is * x)))
        take = cur < best
        best = np.where(take, cur, best)
        iscale = np.where(take, iscale_is, iscale)
    l = np.minimum(nmax, _nearest_int(iscale * x))
    lf = l.astype(F)
    sumlx = _seqsum(weights * x * lf)
    suml2 = _seqsum(weights * lf * lf)
    L = l & 0xFF
    sumlx, suml2 = _refine(x, weights, L, sumlx, suml2, lambda l: np.minimum(nmax, l), sl2_checked_after=False,
                           store=lambda l: l & 0xFF)
    zero = mx < GROUP_MAX_EPS
    return np.where(zero | ~(suml2 > 0), F(0), sumlx / suml2), np.where(zero, 0, L)


def _sum_squares(x):
    """C's ``float s = 0; for (j...) s += x[j]*x[j];`` over each block (row) of ``x``."""
    xt = _columns(x, x.shape[1])
    return _seqsum(xt * xt)


def _weighted(x, qw, n, sigma2):
    """The sub-blocks of ``n`` of ``x`` as columns, and their ``weight[l] = qw[l] * sqrtf(sigma2 +
    x[l]*x[l])`` (``sigma2`` one a block of ``x``), the importance-weighted paths' weights."""
    xs = _columns(x, n)
    return xs, _columns(qw, n) * np.sqrt(np.repeat(sigma2, x.shape[1] // n) + xs * xs)


def _by_block(v, nb):
    """Per-sub-block values in column order ``(nb * k,)`` as columns of a block each, ``(k, nb)``."""
    return np.ascontiguousarray(v.reshape(nb, -1).T)


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
    """Checks x as (nblocks, block) float32 (and ``importance``, the quant_weights of each value, as
    x) and quantizes it in chunks (the fields concatenated)."""
    def wrap(fn):
        @functools.wraps(fn)
        def quantize(x, importance=None):
            x = np.ascontiguousarray(x, dtype=F)
            if x.ndim != 2 or x.shape[1] != block:
                raise ValueError(f"expected a float32 array of shape (nblocks, {block}), got {x.shape}")
            if importance is not None:
                importance = np.ascontiguousarray(importance, dtype=F)
                if importance.shape != x.shape:
                    raise ValueError(f"expected importance of x's shape {x.shape}, got {importance.shape}")
            step = _CHUNK // block
            with np.errstate(all="ignore"):
                parts = [fn(x[i:i + step], None if importance is None else importance[i:i + step])
                         for i in range(0, max(len(x), 1), step)]
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        quantize.takes_importance = True  # (qarray.quantize's importance= goes to these alone)
        return quantize
    return wrap


@_chunked(256)
def quantize_q2_k(x, qw):
    """ggml-quants.c ``quantize_row_q2_K_ref`` (what ``quantize_q2_K`` runs without an imatrix), or
    ``quantize_row_q2_K_impl`` with one.

    Fields: d, dmin float16 (nb,); scales, mins uint8 (nb, 16) 4-bit codes; q uint8 (nb, 256) in [0, 3].
    """
    nb = len(x)
    if qw is None:
        xs = _columns(x, 16)
        scales, mins, L = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        scales, mins, L = scales.reshape(nb, 16), mins.reshape(nb, 16), _blocks(L, nb)
        max_scale, max_min = _positive_max(scales), _positive_max(mins)
        has_s, has_m = (max_scale > 0)[:, None], (max_min > 0)[:, None]
        byte = np.where(has_s, _nearest_int((F(15) / max_scale)[:, None] * scales) & 0xFF, 0)  # uint8 stores
        byte |= np.where(has_m, (_nearest_int((F(15) / max_min)[:, None] * mins) << 4) & 0xFF, 0)
        d = _fp16(np.where(max_scale > 0, max_scale / F(15), F(0)))
        dmin = _fp16(np.where(max_min > 0, max_min / F(15), F(0)))
    else:
        xs, weights = _weighted(x, qw, 16, _sum_squares(x) / F(256))
        sw = _by_block(_seqsum(weights), nb)
        scales, mins, L = _make_qkx2_quants(xs, weights, 3, -0.9, 0.05, 36, False)
        dm, ls = _make_qp_quants(_by_block(scales, nb), 15, sw)
        mm, lm = _make_qp_quants(_by_block(mins, nb), 15, sw)
        byte = (ls.T | (lm.T << 4)) & 0xFF  # C: y[i].scales[j] = Ls[j] | (Lm[j] << 4), a uint8
        d, dmin, L = _fp16(dm), _fp16(mm), _blocks(L, nb)
    sc, m = byte & 0xF, byte >> 4
    dl = d.astype(F)[:, None] * sc.astype(F)
    ml = dmin.astype(F)[:, None] * m.astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 16, 16), dl, 0, 3, ml), L)
    return {"d": d, "dmin": dmin, "scales": sc.astype(np.uint8), "mins": m.astype(np.uint8),
            "q": L.reshape(nb, 256).astype(np.uint8)}


@_chunked(256)
def quantize_q3_k(x, qw):
    """ggml-quants.c ``quantize_row_q3_K_ref`` (what ``quantize_q3_K`` runs without an imatrix), or
    ``quantize_row_q3_K_impl`` with one.

    Fields: d float16 (nb,); scales uint8 (nb, 16) in [0, 63] (sub-scale + 32);
    q uint8 (nb, 256) in [0, 7] (q + 4; bit 2 is the hmask bit).
    """
    nb = len(x)
    if qw is None:
        scales, L = _make_q3_quants(_columns(x, 16), 4)
        scales, L = scales.reshape(nb, 16), _blocks(L, nb)
        _, max_scale = _signed_absmax(scales, axis=1)
        iscale = F(-32) / max_scale
        l = _nearest_int(iscale[:, None] * scales).astype(np.int8)  # C: int8_t l = nearest_int(...)
        ls = np.where((max_scale != 0)[:, None], np.clip(l, -32, 31) + 32, 0)
        d = _fp16(np.where(max_scale != 0, F(1) / iscale, F(0)))
    else:
        xs, weights = _weighted(x, qw, 16, F(2) * _sum_squares(x) / F(256))
        scales, L = _make_qx_quants(xs, 4, weights)
        d_block, ls = _make_qx_quants(_by_block(scales, nb), 32, _by_block(_seqsum(weights), nb))
        d, ls, L = _fp16(d_block), ls.T, _blocks(L, nb)
    dl = d.astype(F)[:, None] * (ls - 32).astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 16, 16), dl, -4, 3) + 4, L)
    return {"d": d, "scales": ls.astype(np.uint8), "q": L.reshape(nb, 256).astype(np.uint8)}


def _k4_read(ls):
    """Q4_K / Q5_K's 6-bit codes ``ls`` (uint8 values, ``(nb, 8)``: scales or mins) as
    ``get_scale_min_k4`` reads them back from the 12 bytes ``quantize_row_q4_K_*`` packs them into:
    ``ls`` where each is at most 63; where one is not (Q4_K's importance path stores
    make_qp_quants' codes unclamped), the bits that C's shifts and uint8 stores let through."""
    lo, hi = ls[:, :4], ls[:, 4:]
    return np.concatenate([lo & 63, (hi & 0xF) | ((((lo >> 6) | (hi >> 4)) & 3) << 4)], axis=1)


def _q45_k(x, qw, nmax, rmin, nstep):
    """``quantize_row_q4_K_ref`` / ``quantize_row_q5_K_ref``, which differ only in these constants,
    or with weights ``quantize_row_q4_K_impl`` / ``q5_K_impl``, which differ only in them and in
    Q5_K's clamp of the 6-bit codes."""
    nb = len(x)
    if qw is None:
        xs = _columns(x, 32)
        av_x = np.sqrt(_seqsum(xs * xs) / F(32))
        scales, mins, L = _make_qkx2_quants(xs, av_x + np.abs(xs), nmax, rmin, 0.1, nstep, False)
        scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
        max_scale, max_min = _positive_max(scales), _positive_max(mins)
        inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0))
        inv_min = np.where(max_min > 0, F(63) / max_min, F(0))
        ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)  # C: uint8_t, then MIN(63, .)
        lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
        d, dmin = _fp16(max_scale / F(63)), _fp16(max_min / F(63))
    else:
        xs, weights = _weighted(x, qw, 32, F(2) * _sum_squares(x) / F(256))
        sw = _by_block(_seqsum(weights), nb)
        scales, mins, L = _make_qkx2_quants(xs, weights, nmax, -0.9, 0.05, 36, False)
        d_block, ls = _make_qp_quants(_by_block(scales, nb), 63, sw)
        m_block, lm = _make_qp_quants(_by_block(mins, nb), 63, sw)
        # Q5_K (nmax 31) clamps the codes to 63; Q4_K stores them as they are
        ls, lm = (ls.T, lm.T) if nmax == 15 else (np.minimum(ls.T, 63), np.minimum(lm.T, 63))
        ls, lm = _k4_read(ls), _k4_read(lm)
        d, dmin = _fp16(d_block), _fp16(m_block)
    L = _blocks(L, nb)
    dl = d.astype(F)[:, None] * ls.astype(F)
    ml = dmin.astype(F)[:, None] * lm.astype(F)
    L = np.where((dl != 0)[..., None], _requant(x.reshape(nb, 8, 32), dl, 0, nmax, ml), L)
    return {"d": d, "dmin": dmin, "scales": ls.astype(np.uint8), "mins": lm.astype(np.uint8),
            "q": L.reshape(nb, 256).astype(np.uint8)}


@_chunked(256)
def quantize_q4_k(x, qw):
    """ggml-quants.c ``quantize_row_q4_K_ref`` (what ``quantize_q4_K`` runs without an imatrix), or
    ``quantize_row_q4_K_impl`` with one.

    Fields: d, dmin float16 (nb,); scales, mins uint8 (nb, 8) in [0, 63]; q uint8 (nb, 256) in [0, 15].
    """
    return _q45_k(x, qw, 15, -1.0, 20)


@_chunked(256)
def quantize_q5_k(x, qw):
    """ggml-quants.c ``quantize_row_q5_K_ref`` (what ``quantize_q5_K`` runs without an imatrix), or
    ``quantize_row_q5_K_impl`` with one.

    Fields: d, dmin float16 (nb,); scales, mins uint8 (nb, 8) in [0, 63]; q uint8 (nb, 256) in [0, 31].
    """
    return _q45_k(x, qw, 31, -0.5, 15)


@_chunked(256)
def quantize_q6_k(x, qw):
    """ggml-quants.c ``quantize_row_q6_K_ref`` (what ``quantize_q6_K`` runs without an imatrix), or
    ``quantize_row_q6_K_impl`` with one, which weights make_qx_quants by the imatrix alone.

    Fields: d float16 (nb,); scales int8 (nb, 16); q uint8 (nb, 256) in [0, 63] (q + 32).
    """
    nb = len(x)
    xs = _columns(x, 16)
    scales, L = _make_qx_quants(xs, 32, xs * xs if qw is None else _columns(qw, 16))
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


def _iq4_weights(x, qw):
    """``quantize_row_iq4_nl_impl``'s weights for 32-blocks of the super-blocks (rows) of ``x``, as
    columns: ``x*x`` without an imatrix, else ``qw * sqrtf(sigma2 + x*x)`` with ``sigma2 = sum x*x``
    over the super-block, times ``2.f / super_block_size``. Returns (x's columns, weights)."""
    if qw is None:
        xs = _columns(x, 32)
        return xs, xs * xs
    return _weighted(x, qw, 32, _sum_squares(x) * (F(2) / F(x.shape[1])))


@_chunked(32)
def quantize_iq4_nl(x, qw):
    """ggml-quants.c ``quantize_iq4_nl`` (``quantize_row_iq4_nl_impl`` with 32-blocks, ntry=7;
    not ``quantize_row_iq4_nl_ref``, which uses ntry=-1).

    Fields: d float16 (nb,); q uint8 (nb, 32) in [0, 15], indices into kvalues_iq4nl.
    """
    d = _iq4_scales(*_iq4_weights(x, qw), KVALUES_IQ4NL, 7)
    inv = np.where(d != 0, F(1) / d, F(0))
    q = _best_index_int8(KVALUES_IQ4NL, inv[:, None] * x)
    return {"d": _fp16(d), "q": q.astype(np.uint8)}


@_chunked(256)
def quantize_iq4_xs(x, qw):
    """ggml-quants.c ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` with 256-super-blocks of
    32-blocks, ntry=7).

    Fields: d float16 (nb,); scales uint8 (nb, 8) in [0, 63] (sub-scale + 32); q uint8 (nb, 256) in [0, 15].
    """
    nb = len(x)
    scales = _iq4_scales(*_iq4_weights(x, qw), KVALUES_IQ4NL, 7).reshape(nb, 8)
    _, max_scale = _signed_absmax(scales, axis=1)
    d = -max_scale / F(32)  # -0.0 for an all-zero super-block, as in C
    inv = np.where(d != 0, F(1) / d, F(0))
    l = np.clip(_nearest_int(inv[:, None] * scales), -32, 31)
    dl = d[:, None] * l.astype(F)
    idl = np.where(dl != 0, F(1) / dl, F(0))
    q = _best_index_int8(KVALUES_IQ4NL, idl[..., None] * x.reshape(nb, 8, 32))
    return {"d": _fp16(d), "scales": (l + 32).astype(np.uint8), "q": q.reshape(nb, 256).astype(np.uint8)}
