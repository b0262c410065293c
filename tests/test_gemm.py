"""The CPU integer GEMM engines (``qarray.backends._gemm``): each forced in turn
(qarray's own kernels, onnxruntime MLAS u8s8, u8u8, float32 BLAS) must give
int64's exact answer on every dtype pair, at the extremes, with K split beyond
int32; the engine is chosen by CPU features and a self-check, and a failing
one is logged once and bypassed. (qarray's own kernels, instruction set by
instruction set: test_cpu_gemm.py.)"""

import logging

import numpy as np
import pytest

import qarray
from qarray import QArray, qdtype
from qarray._config import THREADS
from qarray._params import Gemm
from qarray.backends import _gemm
from qarray.ops import conv2d, linear, matmul

ENGINES = ["qarray", "u8s8", "u8u8", "blas"]
DTYPES = ["qint8", "quint8", "qint4", "quint4", "qint2", "quint2"]


@pytest.fixture(params=ENGINES)
def engine(request):
    ok, why = _gemm.status(request.param)
    if not ok:
        pytest.skip(f"{request.param} not usable here: {why}")
    with qarray.config.using(gemm=request.param):
        yield request.param


def needs_onnxruntime():
    """The MLAS engines' own tests (elsewhere a missing onnxruntime is a status, tested too)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")


@pytest.fixture
def fresh_state(monkeypatch):
    """Forget which engines were checked (restored after the test), and leave
    qarray's own out of "auto": these tests follow MLAS's fallbacks."""
    monkeypatch.setattr(_gemm, "_state", {})
    monkeypatch.setattr(_gemm, "_sessions", {})
    monkeypatch.setattr(_gemm, "_own_status", lambda: (False, "left out by this test"))


@pytest.fixture
def mlas(monkeypatch):
    """The first usable MLAS engine, forced (skipped without onnxruntime)."""
    name = next((e for e in ("u8s8", "u8u8") if _gemm.status(e)[0]), None)
    if name is None:
        pytest.skip("no onnxruntime engine here")
    with qarray.config.using(gemm=name):
        yield name


def codes(rng, d, shape, extreme=True):
    """Random codes of ``d``, half of them at qmin or qmax."""
    c = rng.integers(d.qmin, d.qmax + 1, shape)
    if extreme:
        ends = rng.choice([d.qmin, d.qmax], shape)
        c = np.where(rng.random(shape) < 0.5, ends, c)
    return c.astype(d.storage)


def ref(a, za, w, zw):
    """int64 ``(a - za) @ (w - zw)``, zw per column."""
    return (a.astype(np.int64) - za) @ (w.astype(np.int64) - np.asarray(zw, np.int64))


@pytest.mark.parametrize("adt", DTYPES + ["qint16", "quint16"])
@pytest.mark.parametrize("wdt", DTYPES)
def test_every_pair_exact_at_the_extremes(adt, wdt, engine, kernels, rng):
    da, dw = qdtype(adt), qdtype(wdt)
    a = codes(rng, da, (5, 37))
    w = codes(rng, dw, (37, 6))
    for za in (da.qmin, da.qmax):
        zw = np.array([dw.qmin, dw.qmax, 0, dw.qmin, dw.qmax, 1], np.int64).clip(dw.qmin, dw.qmax)
        qa_, qw = QArray.from_int(a, 0.5, za, adt), QArray.from_int(w, np.full(6, 0.25, np.float32), zw, wdt, axis=1)
        want = ref(a, za, w, zw)  # |want| < 37 * 65535 * 255 < 2**31
        np.testing.assert_array_equal(matmul(qa_, qw).int_repr(), want)
        s_out = 2.0 ** (da.bits + dw.bits - 2)
        out = matmul(qa_, qw, scale=s_out, zero_point=0, dtype="qint16", rounding="half_up")
        acc = QArray.from_int(want, np.float32(0.5) * np.float32(0.25), 0, "qint32")
        np.testing.assert_array_equal(out.int_repr(), acc.requantize(s_out, 0, "qint16", rounding="half_up").int_repr())


@pytest.mark.parametrize("rounding", ["half_even", "half_away", "half_up", "tflite"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fused_epilogue_equals_requantizing_the_accumulator(rounding, per_channel, engine, kernels, rng):
    """Zero points, bias, requantize and ReLU in one pass == the exact
    accumulator, plus bias, requantized on its own (mode fixed and float)."""
    a = QArray.from_int(codes(rng, qdtype("qint8"), (9, 50)), 0.02, -128, "qint8")
    zw = rng.integers(-128, 128, 7) if per_channel else 5
    s_w = rng.uniform(0.01, 0.05, 7).astype(np.float32) if per_channel else np.float32(0.03)
    w = QArray.from_int(codes(rng, qdtype("qint8"), (7, 50)), s_w, zw, "qint8", axis=0 if per_channel else None)
    bias = rng.uniform(-3, 3, 7).astype(np.float32)
    for mode in ("fixed", "float"):
        for relu in (False, True):
            got = linear(a, w, bias, scale=0.3, zero_point=-3, dtype="qint8", relu=relu, mode=mode, rounding=rounding)
            acc = linear(a, w, bias)  # the exact qint32 accumulator, bias included
            want = acc.requantize(0.3, -3, "qint8", mode=mode, rounding=rounding)
            want = np.maximum(want.int_repr(), -3) if relu else want.int_repr()
            np.testing.assert_array_equal(got.int_repr(), want, err_msg=f"{mode} relu={relu}")


@pytest.mark.parametrize("k", [2**16 + 300, 2**17])
def test_long_k_is_split_and_summed_in_int64(k, engine):
    """Raw u8 x s8 sums overflow int32 beyond K = 65793: the engine splits K and
    the result, far beyond 2**32, is exact."""
    a = QArray.from_int(np.full((2, k), 255, np.uint8), 1.0, 0, "quint8")
    wc = np.full((k, 3), -128, np.int8)
    wc[::3, 1] = 127
    w = QArray.from_int(wc, 1.0, np.array([0, -128, 127]), "qint8", axis=1)
    b = qarray.backends.get("numpy")
    pw = b.pack_weight(w.data, w.dtype, keep=True)
    got = b.int_matmul(a.data, pw, Gemm(0, np.array([0, -128, 127]), acc_dtype=np.int64, qd=a.dtype))
    want = ref(a.data, 0, wc, [0, -128, 127])
    assert np.abs(want).max() > 2**31 * (k // 2**16)  # beyond 2**32 at K = 2**17
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="beyond qint32"):
        matmul(a, w)


@pytest.mark.parametrize("dt", ["qint16", "quint16"])
def test_int16_activations_accumulate_in_int64(dt, engine, rng):
    """16 x 8 (TFLite's int16 activation mode): a = 256 * hi + lo, two 8-bit
    products combined exactly; K * 65535 * 255 is beyond int32."""
    d = qdtype(dt)
    k = 40000
    a = np.full((2, k), d.qmax, d.storage)
    a[1, ::2] = d.qmin
    w = np.full((k, 2), -128, np.int8)
    w[:, 1] = 127
    qa_, qw = QArray.from_int(a, 1.0, d.qmin, dt), QArray.from_int(w, 1.0, 0, "qint8")
    want = ref(a, d.qmin, w, 0)
    assert np.abs(want).max() > 2**32
    got = linear(qa_, QArray.from_int(w.T.copy(), 1.0, 0, "qint8"), scale=2.0**20, zero_point=0, dtype="qint32")
    want_q = np.rint(want / 2.0**20).astype(np.int64)  # exact: want / 2**20 has few bits
    np.testing.assert_array_equal(got.int_repr(), want_q)
    small = QArray.from_int(a[:, :100], 1.0, 7, dt)
    np.testing.assert_array_equal(matmul(small, QArray.from_int(w[:100], 1.0, 0, "qint8")).int_repr(),
                                  ref(a[:, :100], 7, w[:100], 0))


def test_layers_and_conv_on_every_engine(engine, rng):
    x = QArray.from_int(codes(rng, qdtype("qint8"), (2, 3, 9, 9)), 0.05, 3, "qint8")
    wf = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    layer = qarray.nn.Conv2d.from_float(wf, rng.standard_normal(4).astype(np.float32), padding=1)
    got = layer(x, scale=0.2, zero_point=0, dtype="quint8")
    acc = conv2d(x, layer.weight, layer.bias, padding=1)
    np.testing.assert_array_equal(got.int_repr(), acc.requantize(0.2, 0, "quint8").int_repr())
    lin = qarray.nn.Linear.from_float(rng.standard_normal((5, 81)).astype(np.float32))
    xs = QArray.from_int(codes(rng, qdtype("quint8"), (4, 81)), 0.1, 255, "quint8")
    np.testing.assert_array_equal(lin(xs).int_repr(), ref(xs.data, 255, lin.weight.data.T, lin.weight.zero_point))


def test_engines_agree_on_a_large_product(rng):
    """The three engines on one realistic product (2-D weights, prepacked)."""
    a = QArray.from_int(codes(rng, qdtype("qint8"), (64, 700), extreme=False), 0.02, -5, "qint8")
    lin = qarray.nn.Linear.from_float(rng.standard_normal((96, 700)).astype(np.float32))
    outs = {}
    for name in ENGINES:
        if _gemm.status(name)[0]:
            with qarray.config.using(gemm=name):
                outs[name] = qarray.nn.Linear(lin.weight)(a).int_repr()
    want = ref(a.data, -5, lin.weight.data.T, 0)
    for name, got in outs.items():
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_auto_prefers_u8s8_only_with_vnni(fresh_state, monkeypatch):
    needs_onnxruntime()
    monkeypatch.setattr(_gemm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(_gemm, "_cpu_flags", lambda: {"avx2", "avx512bw"})
    ok, why = _gemm.status("u8s8")
    assert not ok and "no VNNI" in why
    monkeypatch.setattr(_gemm, "_state", {})
    monkeypatch.setattr(_gemm, "_cpu_flags", lambda: {"avx2", "avx512_vnni"})
    ok, why = _gemm.status("u8s8")
    assert ok == _gemm.status("blas")[0] and "avx512vnni" in why


def test_a_failed_self_check_is_logged_once_and_bypassed(fresh_state, monkeypatch, caplog, rng):
    needs_onnxruntime()
    real = _gemm._self_check
    monkeypatch.setattr(_gemm, "_self_check",
                        lambda name: (False, "self-check failed: 32512 off") if name == "u8s8" else real(name))
    with caplog.at_level(logging.WARNING, logger="qarray"):
        a = QArray.from_int(codes(rng, qdtype("quint8"), (3, 40)), 1.0, 0, "quint8")
        w = QArray.from_int(codes(rng, qdtype("qint8"), (40, 2)), 1.0, 0, "qint8")
        for _ in range(3):
            np.testing.assert_array_equal(matmul(a, w).int_repr(), ref(a.data, 0, w.data, 0))
    assert [r.getMessage() for r in caplog.records].count(
        "qarray: int8 GEMM engine u8s8 not used: " + _gemm.status("u8s8")[1]) == 1
    assert "32512 off" in _gemm.status("u8s8")[1]
    assert qarray.backends.gemm_engine().startswith("u8u8: ")
    with pytest.raises(ValueError, match=r"qarray.config.gemm = 'u8s8' can not run here: .*32512 off; use 'auto'"):
        with qarray.config.using(gemm="u8s8"):
            matmul(a, w)


def test_an_engine_that_fails_to_load_is_bypassed(fresh_state, monkeypatch, caplog, rng):
    def broken():
        raise ImportError("no onnxruntime", name="onnxruntime")

    monkeypatch.setattr(_gemm, "_ort", broken)
    with caplog.at_level(logging.WARNING, logger="qarray"):
        assert _gemm.engine() == "blas"
    assert "pip install 'qarray[fast]'" in caplog.text
    a = QArray.from_int(codes(rng, qdtype("qint8"), (3, 40)), 1.0, 0, "qint8")
    w = QArray.from_int(codes(rng, qdtype("quint8"), (40, 2)), 1.0, 200, "quint8")
    np.testing.assert_array_equal(matmul(a, w).int_repr(), ref(a.data, 0, w.data, 200))
    assert qarray.backends.gemm_engine().startswith("blas: float32 BLAS")


def test_an_engine_that_crashes_is_bypassed(fresh_state, monkeypatch):
    needs_onnxruntime()
    def crash(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL")

    monkeypatch.setattr(_gemm, "_session", crash)
    ok, why = _gemm.status("u8u8")
    assert not ok and "failed to run: RuntimeError" in why


def test_config_gemm_is_checked():
    with pytest.raises(ValueError, match=r"gemm must be one of \('auto', 'qarray', 'u8s8', 'u8u8', 'blas'\), got 'mkl'"):
        qarray.config.gemm = "mkl"
    assert qarray.config.gemm == "auto"
    assert "gemm='auto'" in repr(qarray.config)


def test_small_products_run_on_a_one_thread_session(mlas, rng):
    """Below SMALL_WORK products a layer's GEMM runs on a one-thread session,
    made on the first such call (a pool's wake-up costs more than the work);
    larger calls keep the layer's sessions on every thread; both exact."""
    k, n = 64, 48
    wc = rng.integers(-128, 128, (n, k)).astype(np.int8)
    lin = qarray.nn.Linear(QArray.from_int(wc, 0.5, 0, "qint8"))
    pw = lin._packed.packed
    with qarray.config.using(numba=False):  # the engine, not the GEMV, for every M
        big = _gemm.SMALL_WORK // (k * n) + 1
        for m, made in ((big, False), (3, THREADS[0] > 1), (big, THREADS[0] > 1)):
            x = rng.integers(0, 256, (m, k)).astype(np.uint8)
            got = lin(QArray.from_int(x, 0.25, 7, "quint8")).int_repr()
            np.testing.assert_array_equal(got, ref(x, 7, wc.T, np.zeros(n, np.int64)))
            assert (pw.one_thread is not None) == made, m


@pytest.mark.parametrize("adt,za", [("quint8", 0), ("quint8", 255), ("qint8", -128), ("qint8", 127)])
def test_rows_split_among_threads_each_with_its_epilogue(adt, za, rng, monkeypatch, mlas):
    """From ``BY_ROWS`` rows a thread (with ``BY_ROWS_N`` columns and ``SMALL_WORK``
    products) a layer's GEMM runs one share of rows a thread on a one-thread
    session, each share's epilogue right after it (``NumpyBackend.int_matmul``):
    exact at the extremes. K = 65000 products of codes 255 apart give sums beyond 2**31
    (the int64 epilogue, every rounding; one session holds K <= 65793, so
    4.28e9 is this path's largest); asymmetric weights need the row sums
    (each share its own); K = 30000 gives int32 accumulators as the output."""
    if mlas != "u8s8" or qarray.backends.get("numpy")._fast(np.zeros(1)) is None:
        pytest.skip("needs the u8s8 engine (one session for K = 65000) and Numba")
    from _reference import RULES, bias_ints, ref_acc_out, rounding_kw

    before = THREADS[0]
    qarray.set_num_threads(2)
    if THREADS[0] < 2:
        pytest.skip("one CPU: no threads to split the rows among")
    monkeypatch.setattr(qarray, "set_num_threads", qarray.set_num_threads)  # restored below, whatever happens
    narrow = _gemm.BY_ROWS_N
    monkeypatch.setattr(_gemm, "BY_ROWS_N", 3)  # three columns split too: int64's reference stays quick
    shares = []
    real = _gemm.Packed.raw
    monkeypatch.setattr(_gemm.Packed, "raw", lambda self, a, threads=None: shares.append((len(a), threads))
                        or real(self, a, threads))
    da = qdtype(adt)
    m = _gemm.BY_ROWS * 2
    try:
        for k, wide in ((65000, True), (30000, False)):
            far = da.qmax if za == da.qmin else da.qmin  # 255 from the zero point
            x = np.where(rng.random((m, k)) < 0.7, far, za)
            x[0], x[1] = far, rng.integers(da.qmin, da.qmax + 1, k)
            wc = np.empty((3, k), np.int64)
            wc[0], wc[1], wc[2] = -128, 127, rng.integers(-128, 128, k)
            zw = np.array([127, -128, 3])  # w - zw: -255, 255, any
            s_x, s_w = np.float32(0.5), np.array([0.25, 0.125, 2.0], np.float32)
            bias = np.array([2**20, -(2**20), 7], np.float32) * (s_x * s_w)
            layer = qarray.nn.Linear(QArray.from_int(wc.astype(np.int8), s_w, zw, "qint8", axis=0), bias)
            qx = QArray.from_int(x.astype(da.storage), s_x, za, adt)
            acc = ref(x, za, wc.T, zw).astype(object) + bias_ints(bias, s_x, s_w)
            top = max(abs(int(v)) for v in acc.flat)
            assert top > 4.2e9 if wide else 2**30 < top < 2**31
            shares.clear()
            if wide:
                s_out = np.float32(2.0**26 * 0.5 * 0.25)
                for rule in RULES:
                    for dout, zo in (("qint8", -128), ("qint8", 127), ("quint8", 0), ("qint32", 0)):
                        got = layer(qx, scale=s_out, zero_point=zo, dtype=dout, **rounding_kw(rule)).int_repr()
                        want = ref_acc_out(acc, s_x, s_w, (s_out, zo), qdtype(dout), rule, False, 1)
                        np.testing.assert_array_equal(got, want, err_msg=f"{rule} {dout} {zo}")
            else:
                got = layer(qx)
                assert got.dtype == qdtype("qint32")
                np.testing.assert_array_equal(got.int_repr(), acc.astype(np.int64))
            assert shares and set(shares) == {(m // 2, 1)}, shares[:4]  # two shares a call, one thread each
            monkeypatch.setattr(_gemm, "BY_ROWS_N", narrow)
            assert not layer._packed.packed.by_rows(x)  # fewer columns than BY_ROWS_N: two-thread sessions
            monkeypatch.setattr(_gemm, "BY_ROWS_N", 3)
    finally:
        qarray.set_num_threads(before)


@pytest.mark.parametrize("wdt", ["qint4", "quint4"])
@pytest.mark.parametrize("m", [1, 2, 16, 17])
def test_small_m_reads_packed_4bit_weights(wdt, m, monkeypatch, rng):
    """One row (M <= SMALL_M) against 4-bit weights runs the VNNI kernel on the
    weights packed two to a byte (exact at the extremes); more rows the int8
    codes (exact too)."""
    if _gemm.packed4_kernel() is None:
        pytest.skip("no packed 4-bit kernel here: " + _gemm._state["packed4"][1])
    k_mod = _gemm.packed4_kernel()
    calls = []
    real = k_mod.gemm_packed4
    # one entry per part the threads run: its first task (0 once per call)
    monkeypatch.setattr(k_mod, "gemm_packed4", lambda *args: calls.append(args[-2]) or real(*args))
    d = qdtype(wdt)
    k, n = 300, 9
    wc = rng.choice([d.qmin, d.qmax], (n, k)).astype(d.storage)
    zw = np.array([d.qmin, d.qmax] * 4 + [0])
    lin = qarray.nn.Linear(QArray.from_int(wc, np.full(n, 0.5, np.float32), zw, wdt, axis=0))
    assert lin._packed.packed.nibbles is not None and lin._packed.packed.nibbles.shape == (n, 192)
    for za in (0, 255):
        x = np.full((m, k), 255 - za, np.uint8)
        x[0, ::3] = za
        got = lin(QArray.from_int(x, 0.25, za, "quint8")).int_repr()
        np.testing.assert_array_equal(got, ref(x, za, wc.T, zw))
    assert calls.count(0) == (2 if m <= _gemm.SMALL_M else 0)
    with qarray.config.using(numba=False):  # the kernel is Numba's: off with it
        assert qarray.nn.Linear(lin.weight)._packed.packed.nibbles is None


@pytest.mark.parametrize("wdt", ["qint8", "quint8", "qint4", "quint4"])
def test_packed_weights_pickle_as_codes_and_repack_where_loaded(wdt, engine, rng, monkeypatch):
    """A packed layer's weights go to a Dask worker by pickle: onnxruntime's
    sessions do not pickle, so they travel as codes and the loading process packs
    them its own way (here: another engine), once per weights."""
    import pickle

    monkeypatch.setattr(_gemm, "_REPACKED", type(_gemm._REPACKED)())
    d = qdtype(wdt)
    wc = codes(rng, d, (130, 7))
    packed = qarray.backends.get("numpy").pack_weight(wc, d, keep=True)
    if not isinstance(packed, _gemm.Packed):
        pytest.skip("the blas engine keeps the generic packing")
    blob = pickle.dumps(packed)
    other = next((e for e in ("u8u8", "blas") if e != engine and _gemm.status(e)[0]), engine)
    with qarray.config.using(gemm=other):
        loaded = pickle.loads(blob)
        assert pickle.loads(blob) is loaded  # packed once per process
    if other == "blas":
        assert not isinstance(loaded, _gemm.Packed)
        return
    assert loaded.name == other and loaded.sessions is not None and loaded is not packed
    a = codes(rng, qdtype("quint8"), (5, 130))
    got = loaded.raw(a).astype(np.int64) + loaded.shift * a.sum(1, dtype=np.int64, keepdims=True)  # w = codes - shift
    np.testing.assert_array_equal(got, ref(a, 0, wc, 0))
