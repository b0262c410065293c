"""qarray's own int8 GEMM (``qarray.backends.cpu.gemm``): every instruction set
(AMX, AVX-512 VNNI, AVX-VNNI, AVX2, portable loops) gives int64's products exactly,
at the extremes of u8 x s8, on every block shape (rows and columns past 32,
AMX's 16-row and VNNI's 8-row branches, K past 64 and past int32's reach);
the epilogue fused into each block's store equals the accumulator requantized
on its own; and the dispatch picks each instruction set in turn as the ones
above it are turned off."""

import logging

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray._fixed_point import IDENTITY
from qarray.backends import _gemm
from qarray.ops import linear
from _reference import force_isa

pytest.importorskip("numba")
from qarray.backends.cpu import gemm, isa  # noqa: E402


@pytest.fixture(params=isa.ORDER)
def only(request, monkeypatch):
    """Instruction set ``request.param``, the ones above it turned off (skipped
    where this CPU lacks it)."""
    return force_isa(monkeypatch, request.param)


def raw(name, a, w, threads=None):
    """``a @ w`` (uint8 x int8) on instruction set ``name``, no epilogue."""
    k, n = w.shape
    out = np.empty((a.shape[0], n), np.int32 if k <= gemm.KMAX else np.int64)
    zero, ends = np.zeros(n, np.int64), np.iinfo(out.dtype)
    return gemm.run(name, IDENTITY, False, a, False, gemm.pack(w), None, (zero,) * 5 + (np.zeros(n),), ends.min,
                    ends.max, out, threads)


def extreme(rng, shape, lo, hi):
    """Random codes, half of them at ``lo`` or ``hi``."""
    c = rng.integers(lo, hi + 1, shape)
    return np.where(rng.random(shape) < 0.5, rng.choice([lo, hi], shape), c)


# rows: VNNI's passes of 8 and single rows, AMX's 16-row branch, a second block;
# columns: a part block, a second block, a second group; K: one step, a part
# step, several, several STEPS chunks (the C tiles stored and loaded between)
SHAPES = [(1, 1, 1), (40, 1100, 300), (33, 2200, 40), (7, 64, 32), (8, 65, 31), (9, 200, 33),
          (16, 128, 64), (17, 63, 1), (31, 130, 70), (32, 64, 32), (33, 192, 40), (100, 300, 77),
          (64, 192, 40), (96, 576, 70)]  # the last two (and (32, 64, 32)) read a's rows in place


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_products_are_exact_at_the_extremes(m, k, n, only, rng):
    a = extreme(rng, (m, k), 0, 255).astype(np.uint8)
    w = extreme(rng, (k, n), -128, 127).astype(np.int8)
    a[0], w[:, 0] = 255, -128  # the most negative sum of the shape
    if m > 1:
        w[:, -1] = 127
        a[-1] = 255  # and the most positive
    want = a.astype(np.int64) @ w.astype(np.int64)
    np.testing.assert_array_equal(raw(only, a, w), want)
    np.testing.assert_array_equal(raw(only, a, w, threads=1), want)


@pytest.mark.parametrize("m,k", [(1, 130), (9, 64), (17, 200), (40, 100)])
def test_rows_past_m_in_the_scratch_change_nothing(m, k, only, rng):
    """``pack_rows`` leaves the scratch's rows past M as the last call left them
    (here 0xFF bytes, the largest codes): the tiles and rows that read them make
    rows of C that no store reads, and every element stays exact."""
    a = extreme(rng, (m, k), 0, 255).astype(np.uint8)
    w = extreme(rng, (k, 45), -128, 127).astype(np.int8)
    gemm._scratch((2, 4, gemm.BM, gemm.BK))[...] = 0xFF
    np.testing.assert_array_equal(raw(only, a, w, threads=1), a.astype(np.int64) @ w.astype(np.int64))


def test_rows_read_in_place_only_where_the_layout_allows():
    """``run`` reads a's rows where they are for unsigned, writable codes in whole
    blocks of 32 rows and steps of 64 k, whose rows spread over L1's sets; it
    packs them otherwise."""
    rows = np.zeros((3136, 576), np.uint8)
    assert gemm._in_place(rows, False)
    assert not gemm._in_place(rows, True)  # signed: flipped to unsigned as they are copied
    assert not gemm._in_place(rows[:3135], False) and not gemm._in_place(rows[:, :575], False)
    assert not gemm._in_place(np.zeros((64, 1024), np.uint8), False)  # 1 KB apart: 4 sets
    assert gemm._in_place(np.zeros((64, 1216), np.uint8), False)  # 19 steps: every set
    rows.setflags(write=False)
    assert not gemm._in_place(rows, False)


def test_k_beyond_int32_sums_in_int64(only):
    """u8 x s8 sums pass int32 beyond K = 65,793: blocks sum ``KMAX`` k in int32
    each, then in int64, and the result, beyond 2**31, is exact."""
    k = gemm.KMAX + 2 * 64 + 5
    a = np.full((3, k), 255, np.uint8)
    a[1, ::2] = 0
    w = np.full((k, 2), -128, np.int8)
    w[::3, 1] = 127
    got = raw(only, a, w)
    want = a.astype(np.int64) @ w.astype(np.int64)
    assert got.dtype == np.int64 and np.abs(want).max() > 2**31
    np.testing.assert_array_equal(got, want)


def test_pairs_past_int16_are_exact(only):
    """Signed activations flipped to unsigned (``a + 128``: 127 -> 255) against
    -128 or 127 in adjacent k: a pair of products, 255 * -128 * 2 = -65,280 or
    255 * 127 * 2 = 64,770, is past int16, where ``vpmaddubsw`` saturates it
    (to -32,768, 32,767); beside them, pairs that fit (255 and 0 against w, 255
    against -128 and 127). Summed without saturating, every element is exact."""
    k = 4 * 64 + 8
    a = np.full((3, k), 127, np.int8)
    a[1, 1::2] = -128  # 255, 0, 255, 0, ...: pairs within int16
    a[2, ::4] = -128
    w = np.full((k, 3), -128, np.int8)
    w[:, 1] = 127
    w[1::2, 2] = 127  # -128, 127 in each pair
    out = np.empty((3, 3), np.int32)
    zero = np.zeros(3, np.int64)
    gemm.run(only, IDENTITY, False, a, True, gemm.pack(w), None, (zero,) * 5 + (np.zeros(3),), -2**31, 2**31 - 1, out)
    want = (a.astype(np.int64) + 128) @ w.astype(np.int64)
    assert want[0, 0] == 255 * -128 * k and want[0, 1] == 255 * 127 * k
    np.testing.assert_array_equal(out, want)


# The epilogue is one function for every instruction set: every rounding and
# dtype pair on the CPU's best, one case on each of the others (each case is a
# kernel of its own to compile: seconds in CI)
_BEST = next(n for n in isa.ORDER if isa._probe(n)[0])
_CASES = [(r, a, w) for r in ("half_even", "half_away", "half_up", "tflite")
          for a, w in (("qint8", "qint8"), ("quint8", "quint8"), ("qint8", "quint4"))]


@pytest.mark.parametrize("only,rounding,adt,wdt", [(_BEST, *c) for c in _CASES]
                         + [(n, "tflite", "qint8", "quint4") for n in isa.ORDER if n != _BEST], indirect=["only"])
def test_fused_epilogue_equals_requantizing_the_accumulator(adt, wdt, rounding, only, rng):
    """Through ``linear`` (the fused path: zero points at both ends, per-channel
    weights, bias, ReLU, int8 out) == the exact accumulator requantized alone."""
    da, dw = qarray.qdtype(adt), qarray.qdtype(wdt)
    a = QArray.from_int(extreme(rng, (45, 130), da.qmin, da.qmax).astype(da.storage), 0.02, da.qmax, adt)
    zw = np.array([dw.qmin, dw.qmax] * 18 + [0])
    s_w = rng.uniform(0.01, 0.05, 37).astype(np.float32)
    w = QArray.from_int(extreme(rng, (37, 130), dw.qmin, dw.qmax).astype(dw.storage), s_w, zw, wdt, axis=0)
    bias = rng.uniform(-3, 3, 37).astype(np.float32)
    with qarray.config.using(gemm="qarray"):
        acc = linear(a, w, bias)  # int32 out: the fused kernel's IDENTITY epilogue
        want = (a.int_repr().astype(np.int64) - da.qmax) @ (w.int_repr().astype(np.int64) - zw[:, None]).T
        np.testing.assert_array_equal(acc.int_repr() - want, np.broadcast_to(acc.int_repr()[0] - want[0], want.shape))
        for mode in ("fixed", "float"):
            for relu in (False, True):
                got = linear(a, w, bias, scale=0.3, zero_point=-3, dtype="qint8", relu=relu, mode=mode,
                             rounding=rounding)
                r = acc.requantize(0.3, -3, "qint8", mode=mode, rounding=rounding).int_repr()
                np.testing.assert_array_equal(got.int_repr(), np.maximum(r, -3) if relu else r,
                                              err_msg=f"{mode} relu={relu}")


def _rounded(d, m, s, rule):
    """``d * m / 2**s`` rounded by ``rule`` in int64 (``|d| < 2**31``, ``m < 2**31``:
    the product fits): the floor, and the remainder against half of ``2**s``."""
    p = d * m
    s = np.minimum(s, 63)
    q, r = p >> s, p & ((np.int64(1) << s) - 1)  # floor, and what it dropped (>= 0)
    half = np.int64(1) << (s - 1)
    up = {"half_even": (r > half) | ((r == half) & (q % 2 == 1)),
          "half_away": (r > half) | ((r == half) & (p >= 0)),
          "half_up": r >= half}[rule]
    return q + up


@pytest.mark.parametrize("rule", ["half_even", "half_away", "half_up"])
@pytest.mark.parametrize("lo,hi", [(-128, 127), (0, 255), (5, 127)])  # int8, uint8, a ReLU at zero point 5
def test_float32_epilogue_rounds_ties_and_near_ties_exactly(rule, lo, hi):
    """The narrow epilogue's float32 rows (``gemm._store_near``) against int64:
    exact ties (``m = 2**30``), values a part in 2**30 above and below a tie
    (``m = 2**30 +- 1``: their float32 scale is a tie's), totals at int32's ends,
    outputs at and past both clamps with the zero point at either end, the
    largest multiplier and the smallest scale. Totals ``d = c + rowsum`` (``zw =
    -1``, ``a @ w = 0``), each in an int32. The 10 columns' terms repeat over 2
    column groups (``GROUP`` blocks of 32: their terms made once a group), the
    second starting at another column of the 10, on one thread and on the pool's."""
    code = qarray._fixed_point.ROUNDINGS[rule]
    ms = [2**30, 2**30 + 1, 2**30 - 1, 2**31 - 1, 2**30, 2**30 + 1, 1234567891, 0, 2**31 - 1, 2**30 - 1]
    shifts = [34, 34, 34, 40, 32, 35, 45, 40, 94, 37]
    zo = [lo, hi, lo, hi, (lo + hi) // 2, lo, hi, lo, hi, (lo + hi) // 2]
    n = gemm.GROUP * gemm.BN + 37
    assert n % 10 and gemm.GROUP * gemm.BN % 10
    ms, shifts, zo = (np.resize(np.array(v, np.int64), n) for v in (ms, shifts, zo))
    k = np.arange(-300, 301)
    d = np.concatenate([16 * k + 8, 16 * k + 7, 16 * k + 9, 4 * k + 2, 4 * k, [2**31 - 1, -2**31, -2**31 + 1, 0, 1, -1]])
    d = d.astype(np.int64)
    a, w = np.zeros((len(d), 1), np.uint8), np.zeros((1, n), np.int8)
    m, sh = ms, shifts
    columns = (np.zeros(n, np.int64), np.full(n, -1, np.int64), zo, m, sh, np.zeros(n))
    want = np.clip(_rounded(d[:, None], m, sh, rule) + zo, lo, hi)
    assert (want == lo).any() and (want == hi).any() and ((want > lo) & (want < hi)).mean() > 0.25
    for threads in (None, 1):
        out = np.empty((len(d), n), np.uint8 if lo >= 0 else np.int8)
        gemm.run(gemm.best(), code, True, a, False, gemm.pack(w), d, columns, lo, hi, out, threads=threads)
        np.testing.assert_array_equal(out, want)


def test_dispatch_names_the_instruction_set(only):
    assert qarray.backends.gemm_engine().startswith(f"qarray: qarray's own kernels on {only}:")


def test_amx_refused_falls_back_logged(monkeypatch, caplog):
    """Linux may refuse the tile state (an old kernel, a seccomp filter): AMX is
    then not usable, logged once, and the next instruction set runs."""
    monkeypatch.setattr(isa, "_granted", [])
    isa._probe.cache_clear()

    class Refusing:
        def syscall(self, *args):
            return -1

    monkeypatch.setattr(isa, "_libc", lambda: Refusing())
    try:
        with caplog.at_level(logging.WARNING, logger="qarray"):
            ok, why = isa._amx_permission()
        assert not ok and "arch_prctl(ARCH_REQ_XCOMP_PERM) refused" in why
        assert "AMX tiles not used" in caplog.text
    finally:
        isa._probe.cache_clear()


def test_an_unusable_instruction_set_raises(monkeypatch):
    monkeypatch.setattr(isa, "OFF", {"avxvnni"})
    with pytest.raises(ValueError, match="cannot run on avxvnni here: turned off"):
        gemm.gemm("avxvnni", IDENTITY, False)
    with pytest.raises(ValueError, match="unknown instruction set 'sse'"):
        isa.usable("sse")


@pytest.mark.parametrize("k,n", [(1, 1), (3, 5), (64, 32), (65, 33), (130, 47), (7, 300), (256, 16),
                                 (66, 2 * 16 * gemm.PACK_GRAIN // (16 * 128) + 40)])
def test_pack_lays_out_panels(rng, k, n):
    """``pack``'s bytes by their definition, element by element (by index): byte
    ``64 * k4 + 4 * c + b`` of panel ``p`` is ``w[4 * k4 + b, 16 * p + c]``, 0 past
    the edges (K to a multiple of 64, N of 32); for weights whose rows are
    contiguous, whose columns are (a layer's (N, K) codes, transposed), and
    neither (a strided view); the last shape's panels split between two
    threads; codes at both ends. And the column sums beside them."""
    w = rng.integers(-128, 128, (2 * k, 3 * n)).astype(np.int8)
    w[0, 0], w[-1, -1] = -128, 127
    kp, n_p = -(-k // 64) * 64, -(-n // 32) * 32
    kk, j = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
    for view in (w[:k, :n], np.ascontiguousarray(w[:k, :n].T).T, w[::2, ::3]):
        want = np.zeros((n_p // 16, kp * 16), np.int8)
        want[j // 16, 64 * (kk // 4) + 4 * (j % 16) + kk % 4] = view
        sums = np.full(n, -1, np.int64)
        got = gemm.pack(view, sums)
        np.testing.assert_array_equal(got, want)
        assert got.ctypes.data % 64 == 0
        np.testing.assert_array_equal(sums, view.astype(np.int64).sum(axis=0))


def test_pack_checks_its_input():
    with pytest.raises(TypeError, match=r"pack takes \(K, N\) int8 weights, got uint8 \(3, 4\)"):
        gemm.pack(np.zeros((3, 4), np.uint8))


def test_engine_status():
    ok, why = _gemm.status("qarray")
    assert ok and why.startswith(f"qarray's own kernels on {isa.best()}")


def test_without_numba_auto_takes_the_next_engine(monkeypatch):
    """Where Numba is missing, qarray's own kernels say so and "auto" goes on
    to MLAS or BLAS."""
    import sys

    import qarray.backends.cpu as cpu

    monkeypatch.delattr(cpu, "gemm")
    monkeypatch.setitem(sys.modules, "qarray.backends.cpu.gemm", None)
    ok, why = _gemm.status("qarray")
    assert not ok and why.endswith("pip install 'qarray[fast]'")
    assert _gemm.engine() in ("u8s8", "u8u8", "blas")


# -- conv2d's implicit GEMM (``gemm.conv``): stride 1, C a multiple of 64 ----------------------------
# (N, C, H, W), (O, kh, kw), padding, dilation
IMPLICIT = [
    ((1, 64, 14, 15), (40, 3, 3), (1, 1), (1, 1)),  # ResNet's taps; a part block of rows, 2 column blocks
    ((3, 128, 6, 7), (33, 1, 1), (0, 0), (1, 1)),  # 1x1: the rows run on from image to image
    ((2, 64, 20, 21), (70, 3, 3), (2, 0), (2, 1)),  # rows of padding alone, dilation; 3 column blocks
    ((1, 192, 16, 17), (5, 1, 3), (0, 3), (1, 2)),  # 3 steps of 64 channels a tap
]


def _conv_ref(x, zx, w, zw, padding, dilation):
    """``sum (x - zx) * (w - zw)`` over each window (stride 1), int64: tap by tap."""
    (ph, pw), (dh, dw) = padding, dilation
    xi = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    wi = w.astype(np.int64) - np.asarray(zw, np.int64).reshape(-1, 1, 1, 1)
    o, _, kh, kw = w.shape
    oh, ow = xi.shape[2] - dh * (kh - 1), xi.shape[3] - dw * (kw - 1)
    return sum(np.einsum("nchw,oc->nohw", xi[:, :, p * dh:p * dh + oh, q * dw:q * dw + ow], wi[:, :, p, q])
               for p in range(kh) for q in range(kw))


def _counting(monkeypatch):
    """The calls of ``gemm.conv`` (the NumPy backend finds it on the module at each call)."""
    calls, conv = [], gemm.conv
    monkeypatch.setattr(gemm, "conv", lambda *args: calls.append(args[3].shape) or conv(*args))
    return calls


@pytest.mark.parametrize("cfg", IMPLICIT, ids=range(len(IMPLICIT)))
@pytest.mark.parametrize("pair", [("quint8", "qint8"), ("qint8", "quint8")], ids="-".join)
def test_conv_implicit_gemm_is_exact_at_the_extremes(cfg, pair, only, rng, monkeypatch):
    """conv2d through ``gemm.conv`` (no im2col) on every instruction set:
    codes at qmin/qmax, the input's zero point (the padding's code) at either
    end, per-channel weight zero points at both ends (the patches' row sums in
    the epilogue), and none (no row term), against int64 window sums."""
    (n, c, h, wd), (o, kh, kw), padding, dilation = cfg
    dx, dw = (qarray.qdtype(d) for d in pair)
    calls = _counting(monkeypatch)
    ends = np.resize([dw.qmin, dw.qmax], o)
    for zx, zw in ((dx.qmin, ends), (dx.qmax, ends[::-1]), (dx.qmax, np.full(o, 0 if dw.signed else 128))):
        x = extreme(rng, (n, c, h, wd), dx.qmin, dx.qmax)
        x[0, :, 0, 0] = dx.qmin + dx.qmax - zx  # a pixel far from the zero point in every channel
        w = extreme(rng, (o, c, kh, kw), dw.qmin, dw.qmax)
        qx = QArray.from_int(x.astype(dx.storage), 0.5, zx, dx)
        qw = QArray.from_int(w.astype(dw.storage), np.full(o, 0.25, np.float32), zw, dw, axis=0)
        with qarray.config.using(gemm="qarray"):
            got = qarray.conv2d(qx, qw, padding=padding, dilation=dilation)
        np.testing.assert_array_equal(got.int_repr(), _conv_ref(x, zx, w, zw, padding, dilation))
    assert calls == [(n, h, wd, c)] * 3


def test_conv_implicit_gemm_requantizes_in_its_epilogue(rng, monkeypatch):
    """int8 out (the float32 rows of the epilogue), bias, ReLU, every rounding
    to nearest: the same codes as the exact sums requantized alone."""
    calls = _counting(monkeypatch)
    x = QArray.from_int(rng.integers(0, 256, (2, 64, 12, 13)).astype(np.uint8), 0.02, 131, "quint8")
    w = QArray.from_int(rng.integers(-128, 128, (24, 64, 3, 3)).astype(np.int8),
                        rng.uniform(0.01, 0.05, 24).astype(np.float32), np.zeros(24, np.int64), "qint8", axis=0)
    bias = rng.uniform(-3, 3, 24).astype(np.float32)
    with qarray.config.using(gemm="qarray"):
        acc = qarray.conv2d(x, w, bias, padding=1)
        for rounding in ("half_even", "half_away", "half_up"):
            for relu in (False, True):
                got = qarray.conv2d(x, w, bias, padding=1, scale=0.7, zero_point=-3, dtype="qint8", relu=relu,
                                    rounding=rounding)
                r = acc.requantize(0.7, -3, "qint8", rounding=rounding).int_repr()
                np.testing.assert_array_equal(got.int_repr(), np.maximum(r, -3) if relu else r,
                                              err_msg=f"{rounding} relu={relu}")
    assert len(calls) == 7


def test_conv_implicit_gemm_sums_past_int32(only, monkeypatch):
    """K = 70,400 input channels, 1x1: the kernel's int32 sums stop at KMAX
    and go on in int64, and the window sums reach +-4.58e9, past 2**32: each
    requantized (a scale of 2**-18, half up) as the exact integer says."""
    k = 64 * 1100
    calls = _counting(monkeypatch)
    x = np.zeros((1, k, 2, 2), np.uint8)
    x[0, :, 0, 0], x[0, ::2, 1, 0] = 255, 255
    x[0, :, 1, 1] = np.random.default_rng(3).integers(0, 256, k)
    w = np.zeros((2, k, 1, 1), np.uint8)
    w[1] = 255  # zero points 255 and 0: w - zw = -255 and +255 throughout
    qx = QArray.from_int(x, 0.5, 0, "quint8")
    qw = QArray.from_int(w, np.full(2, 0.25, np.float32), np.array([255, 0]), "quint8", axis=0)
    ref = _conv_ref(x, 0, w, [255, 0], (0, 0), (1, 1))
    assert np.abs(ref).max() == 255 * 255 * k > 2**32
    with qarray.config.using(gemm="qarray"):
        got = qarray.conv2d(qx, qw, scale=0.125 * 2**18, zero_point=0, dtype="qint16", rounding="half_up")
    np.testing.assert_array_equal(got.int_repr(), (ref + 2**17) >> 18)
    assert calls == [(1, 2, 2, k)]


@pytest.mark.parametrize("shape,kwargs", [
    ((1, 64, 14, 15), dict(stride=2, padding=1)),  # stride 2
    ((1, 96, 14, 15), dict(padding=1)),  # 96 channels: a step would straddle two taps
    ((1, 64, 7, 7), dict(padding=1)),  # 81 padded pixels for 49 outputs: past WASTE
    ((1, 512, 14, 14), dict(padding=1)),  # rows 512 bytes apart: 8 of L1's sets
])
def test_conv_takes_im2col_where_the_implicit_gemm_does_not_apply(shape, kwargs, rng, monkeypatch):
    calls = _counting(monkeypatch)
    x = QArray.from_int(rng.integers(0, 256, shape).astype(np.uint8), 0.5, 7, "quint8")
    w = QArray.from_int(rng.integers(-128, 128, (8, shape[1], 3, 3)).astype(np.int8), 0.25, 0, "qint8")
    with qarray.config.using(gemm="qarray"):
        got = qarray.conv2d(x, w, **kwargs)
    assert calls == []
    stride = kwargs.get("stride", 1)
    want = _conv_ref(x.int_repr(), 7, w.int_repr(), [0] * 8, (1, 1), (1, 1))[:, :, ::stride, ::stride]
    np.testing.assert_array_equal(got.int_repr(), want)
