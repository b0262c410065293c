"""The CuPy backend's integer GEMM and conv (qarray/backends/cuda/gemm.cu and the
cuBLAS call), host-run: kernels through the harness, ``gemmEx`` through the
stand-in of tests/cuda_host/cublas_host.py (cuBLAS's layout and alignment
rules, int32 that wraps). Every result against the NumPy backend bit for bit,
and the exact sums against int64 references."""

import numpy as np
import pytest
from cuda_host import cublas_host

import qarray
from qarray import QArray, qdtype
from qarray._params import Gemm
from qarray.backends import cupy as cuda_backend

WEIGHTS = ["qint8", "quint8", "qint4", "quint4", "qint2"]
ACTS = ["quint8", "qint8", "quint4", "qint2"]
SHAPES = [(1, 5, 3), (3, 37, 10), (16, 64, 7), (17, 33, 5), (40, 100, 33), (2, 300, 4), (33, 96, 8)]


def _codes(rng, dtype, shape, extremes=False):
    d = qdtype(dtype)
    if extremes:  # only qmin and qmax: the largest products of every sign
        return rng.choice(np.array([d.qmin, d.qmax]), shape).astype(d.storage)
    return rng.integers(d.qmin, d.qmax, shape, endpoint=True).astype(d.storage)


def _to(host, q):
    """QArray ``q`` on the host-run CuPy backend."""
    return QArray._new(q.data, q.scale, q.zero_point, q.dtype, q.axis, q.block_size, host)


def _kernel(host):
    names = [n for n, _, _ in host.launches if n.startswith(("gemv", "gemm_epilogue"))]
    return names[-1] if names else None


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wd", WEIGHTS)
@pytest.mark.parametrize("ad", ACTS)
def test_exact_sums_against_int64(host, shape, ad, wd, rng):
    """``sum (a - za)(w - zw) + bias``, zero points at both ends and inside,
    per-tensor and per-channel, extreme codes: the int64 reference exactly."""
    m, k, n = shape
    qa_, qw = qdtype(ad), qdtype(wd)
    for extremes in (False, True):
        a, w = _codes(rng, ad, (m, k), extremes), _codes(rng, wd, (k, n), extremes)
        for za, zw in ((qa_.qmin, np.int64(qw.qmax)), (qa_.qmax, np.full(n, qw.qmin)),
                       (int(rng.integers(qa_.qmin, qa_.qmax + 1)), rng.integers(qw.qmin, qw.qmax + 1, n))):
            bias = rng.integers(-(2**40), 2**40, n)
            want = (a.astype(np.int64) - za) @ (w.astype(np.int64) - zw) + bias
            got = host.int_matmul(a, host.pack_weight(w, qw), Gemm(za, zw, bias, acc_dtype=np.int64, qd=qa_))
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, want)
            want_kernel = (f"gemv{4 if qw.bits <= 4 else 8}_" if m <= 16 else "gemm_epilogue_int32_")
            assert _kernel(host).startswith(want_kernel), _kernel(host)


@pytest.mark.parametrize("m", [4, 40])
def test_int8_activations_are_read_in_place(host, rng, m):
    """qint8 activations whose K is a multiple of 32 (the weights' padding) go to
    gemv and cuBLAS as they are, no shifted copy; where their address is not 16-byte
    aligned they are copied, as every other activation."""
    w = _codes(rng, "qint8", (64, 9))
    pw = host.pack_weight(w, qdtype("qint8"))
    buf = _codes(rng, "qint8", (m * 64 + 16,))
    for offset, copies in ((0, 0), (1, 1)):
        a = buf[offset:offset + m * 64].reshape(m, 64)
        before = len(host.launches)
        got = host.int_matmul(a, pw, Gemm(-128, np.int64(127), acc_dtype=np.int64, qd=qdtype("qint8")))
        np.testing.assert_array_equal(got, (a.astype(np.int64) + 128) @ (w.astype(np.int64) - 127))
        assert sum(n.startswith("to_s8") for n, _, _ in host.launches[before:]) == copies


def test_paths(host, rng):
    """M <= 16 reads the weights in gemv (packed nibbles for 4 bits), M > 16 goes
    through cuBLAS (T x N, padded to multiples of 4) and the epilogue."""
    w = _codes(rng, "qint4", (70, 9))
    pw = host.pack_weight(w, qdtype("qint4"))
    assert pw.w8.shape == (12, 96) and pw.w4.shape == (12, 48)
    for m, kernel in ((1, "gemv4_1"), (5, "gemv4_16"), (16, "gemv4_16"), (17, "gemm_epilogue_int32_int64")):
        before = len(cublas_host.calls)
        a = _codes(rng, "quint8", (m, 70))
        got = host.int_matmul(a, pw, Gemm(3, np.int64(-2), acc_dtype=np.int64, qd=qdtype("quint8")))
        np.testing.assert_array_equal(got, (a.astype(np.int64) - 3) @ (w.astype(np.int64) + 2))
        assert _kernel(host) == kernel
        assert cublas_host.calls[before:] == ([] if m <= 16 else [(12, m, 96)])
    pw8 = host.pack_weight(_codes(rng, "qint8", (70, 9)), qdtype("qint8"))
    assert pw8.w4 is None
    host.int_matmul(_codes(rng, "qint8", (3, 70)), pw8, Gemm(0, np.int64(0), acc_dtype=np.int32, qd=qdtype("qint8")))
    assert _kernel(host) == "gemv8_4"


def test_k_beyond_int32_is_split_and_exact(host, rng, monkeypatch):
    """Sums beyond int32 (the stand-in wraps, as the device does): K is cut where
    no int32 part can overflow and the parts are summed in int64. A smaller cut
    (K_INT32 patched) shows the split at test size; then the real bound."""
    qd = qdtype("qint8")
    monkeypatch.setattr(cuda_backend, "K_INT32", 64)
    k = 200
    a, w = np.full((20, k), -128, np.int8), np.full((k, 3), -128, np.int8)
    before = len(cublas_host.calls)
    got = host.int_matmul(a, host.pack_weight(w, qd), Gemm(0, np.int64(0), acc_dtype=np.int64, qd=qd))
    assert cublas_host.calls[before:] == [(4, 20, 64)] * 3 + [(4, 20, 32)]
    np.testing.assert_array_equal(got, np.full((20, 3), k * 2**14))
    monkeypatch.undo()
    k = cuda_backend.K_INT32 + 4000  # the true bound: 2**31 < k * 2**14
    assert k * 2**14 > 2**31
    a, w = np.full((17, k), -128, np.int8), np.full((k, 4), -128, np.int8)
    got = host.int_matmul(a, host.pack_weight(w, qd), Gemm(0, np.int64(0), acc_dtype=np.int64, qd=qd))
    np.testing.assert_array_equal(got, np.full((17, 4), k * 2**14))


def test_stand_in_wraps_and_refuses_misalignment(rng):
    """The stand-in is no kinder than cuBLAS: int32 wraps, and misaligned calls fail."""
    a = np.full((4, 2**17), -128, np.int8)  # column-major k x 4: each column's sum is 2**31
    c = np.zeros((4, 4), np.int32)
    one, zero = np.ones(1, np.int32), np.zeros(1, np.int32)
    ptr = lambda x: x.__array_interface__["data"][0]  # noqa: E731
    args = (0, cublas_host.CUBLAS_OP_T, cublas_host.CUBLAS_OP_N, 4, 4, 2**17, one.ctypes.data, ptr(a), 3, 2**17,
            ptr(a), 3, 2**17, zero.ctypes.data, ptr(c), 10, 4, 72, -1)
    cublas_host.gemmEx(*args)
    assert (c == np.int32(-(2**31))).all()
    bad = list(args)
    bad[5] = 2**17 - 2  # k not a multiple of 4
    with pytest.raises(cublas_host.CUBLASError, match="multiples of 4"):
        cublas_host.gemmEx(*bad)
    bad = list(args)
    bad[7] = ptr(a) + 1  # A not 4-byte aligned
    with pytest.raises(cublas_host.CUBLASError, match="aligned"):
        cublas_host.gemmEx(*bad)


@pytest.mark.parametrize("m", [1, 7, 16, 50])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("out", ["qint8", "quint8", "qint16", "qint32"])
def test_requantized_linear_matches_numpy(on_host, host, m, per_channel, out, rng):
    """linear with bias, requantized (every rounding, float mode, relu): the fused
    epilogue (gemv's or the cuBLAS path's) equals the NumPy backend's generic code
    (its Numba kernels compiled a fused epilogue for each case: 46-206 s of cold suite runs)."""
    x = qarray.quantize(rng.standard_normal((m, 45)).astype(np.float32), 0.05, 3, "quint8")
    wf = rng.standard_normal((11, 45)).astype(np.float32)
    w = qarray.quantize(wf, np.linspace(0.01, 0.03, 11).astype(np.float32), 0, "qint8", axis=0) if per_channel \
        else qarray.quantize(wf, 0.02, -4, "qint8")
    bias = rng.standard_normal(11).astype(np.float32)
    for mode, rounding in (("fixed", "half_even"), ("fixed", "half_away"), ("fixed", "tflite"), ("float", None)):
        for relu in (False, True):
            kw = dict(scale=0.07, zero_point=qdtype(out).qmin // 2 + 1, dtype=out, relu=relu, mode=mode,
                      rounding=rounding)
            with qarray.config.using(numba=False):  # the generic code (test_cpu_gemm holds Numba's to it)
                want = qarray.linear(x, w, bias, **kw)
            got = on_host(lambda: qarray.linear(_to(host, x), _to(host, w), bias, **kw))
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.int_repr(), want.int_repr())
    acc = on_host(lambda: qarray.linear(_to(host, x), _to(host, w)))  # the exact accumulator, no bias
    with qarray.config.using(numba=False):
        np.testing.assert_array_equal(acc.int_repr(), qarray.linear(x, w).int_repr())


def test_matmul_batched_activations_and_16_bit(on_host, host, rng):
    """(..., M, K) activations flatten into the GEMM's rows; 16-bit activations
    (two 8-bit products) run through the same kernels."""
    w = qarray.quantize(rng.standard_normal((24, 6)).astype(np.float32), 0.02, 0, "qint8")
    for x in (qarray.quantize(rng.standard_normal((2, 3, 24)).astype(np.float32), 0.05, 9, "qint8"),
              qarray.quantize(rng.standard_normal((4, 24)).astype(np.float32), 0.001, -300, "qint16")):
        hx, hw = _to(host, x), _to(host, w)
        np.testing.assert_array_equal(on_host(lambda: qarray.matmul(hx, hw)).int_repr(), qarray.matmul(x, w).int_repr())
        kw = dict(scale=0.1, zero_point=1, dtype="qint8")
        np.testing.assert_array_equal(on_host(lambda: qarray.matmul(hx, hw, **kw)).int_repr(),
                                      qarray.matmul(x, w, **kw).int_repr())


@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("geometry", [dict(stride=1, padding=1, dilation=1), dict(stride=(2, 1), padding=(0, 2), dilation=(1, 2))],
                         ids=["s1p1", "s21p02d12"])
@pytest.mark.parametrize("xd", ["quint8", "qint8", "qint16"])
def test_conv2d_matches_numpy(on_host, host, groups, geometry, xd, rng):
    """conv2d through im2col + GEMM (groups 1) or the direct grouped kernel, exact
    and requantized per-channel with relu, against the NumPy backend."""
    x = qarray.quantize(rng.standard_normal((2, 6, 7, 9)).astype(np.float32), 0.05, 5, xd)
    w = qarray.quantize(rng.standard_normal((12, 6 // groups, 3, 2)).astype(np.float32),
                        np.linspace(0.01, 0.05, 12).astype(np.float32), 0, "qint8", axis=0)
    bias = rng.standard_normal(12).astype(np.float32)
    for kw in ({}, dict(scale=0.2, zero_point=-3, dtype="qint8", relu=True)):
        host.launches.clear()
        got = on_host(lambda: qarray.conv2d(_to(host, x), _to(host, w), bias if kw else None, groups=groups, **geometry, **kw))
        want = qarray.conv2d(x, w, bias if kw else None, groups=groups, **geometry, **kw)
        np.testing.assert_array_equal(got.int_repr(), want.int_repr())
        names = {n for n, _, _ in host.launches}
        if groups > 1:
            assert any(n.startswith("conv_grouped_") for n in names), names
        elif xd != "qint16":
            assert any(n.startswith("im2col_") for n in names), names


def test_nn_linear_packs_once_for_the_device(on_host, host, rng):
    """nn.Linear on the device keeps a DeviceWeight (packed once) and its calls
    equal the NumPy layer's."""
    w = qarray.quantize(rng.standard_normal((8, 40)).astype(np.float32), 0.02, 0, "qint8")
    x = qarray.quantize(rng.standard_normal((3, 40)).astype(np.float32), 0.05, 3, "quint8")
    hw = _to(host, w)
    lin = on_host(lambda: qarray.nn.Linear(hw))
    assert isinstance(lin._packed.packed, cuda_backend.DeviceWeight)
    want = qarray.nn.Linear(w)(x, scale=0.1, zero_point=0, dtype="qint8")
    got = on_host(lambda: lin(_to(host, x), scale=0.1, zero_point=0, dtype="qint8"))
    np.testing.assert_array_equal(got.int_repr(), want.int_repr())
