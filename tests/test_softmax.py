"""softmax and log_softmax against an independent Python reference of the contract
(``qarray/ops/softmax.py``'s module docstring), element by element.

The reference uses only ``math`` and Python ints and floats: ``T[j] =
round(2**30 * math.exp(s * -j))``, the row sum as a Python int, and the final
step as the same IEEE double operations written with Python floats
(``float(T) / (float(S) * s_out)``; ``(j * -s - math.log(float(S) / 2**30)) / s_out``).
It calls no qarray arithmetic. Every test runs on both CPU paths (``kernels``); the
main ones on every backend (``backend``: the CUDA backend has no softmax kernel, its
arrays take the generic code).
"""

from __future__ import annotations

import doctest
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import qarray
from qarray import QArray, qdtype

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny arrays: one thread (conftest.py)

TFLITE_SOFTMAX = {"quint8": ("quint8", 1 / 256, 0), "qint8": ("qint8", 1 / 256, -128),
                  "qint16": ("qint16", 1 / 32768, 0), "qint4": ("qint4", 1 / 16, -8)}
TFLITE_LOG_SOFTMAX = {"quint8": ("quint8", 16 / 256, 255), "qint8": ("qint8", 16 / 256, 127),
                      "qint16": ("qint16", 16 / 65536, 32767), "qint4": ("qint4", 1.0, 7)}


def ref_rows(codes, s_in, dtype_in, s_out, z_out, dtype_out, log):
    """Reference on a 2-D int array, rows along the last axis."""
    din, dout = qdtype(dtype_in), qdtype(dtype_out)
    s, so = float(np.float32(s_in)), float(np.float32(s_out))
    T = {}
    out = []
    for row in codes.tolist():
        m = max(row)
        for c in row:
            if m - c not in T:
                T[m - c] = round(2**30 * math.exp(s * -(m - c)))
        S = sum(T[m - c] for c in row)  # a Python int: exact
        res = []
        for c in row:
            j = m - c
            if log:
                v = round((float(j) * -s - math.log(float(S) / 2**30)) / so)
            else:
                v = round(float(T[j]) / (float(S) * so))
            res.append(min(max(v + int(z_out), dout.qmin), dout.qmax))
        out.append(res)
    assert din.qmax - din.qmin >= 0
    return np.array(out, np.int64).reshape(codes.shape)


def reference(q, axis, s_out, z_out, dtype_out, log):
    codes = np.moveaxis(q.int_repr().astype(np.int64), axis, -1)
    r = ref_rows(codes.reshape(-1, codes.shape[-1]), float(q.scale), q.dtype, s_out, z_out, dtype_out, log)
    return np.moveaxis(r.reshape(codes.shape), -1, axis)


def check(q, axis=-1, log=False, backend=None, **out):
    op = qarray.log_softmax if log else qarray.softmax
    got = op(q, axis, **out) if backend is None else backend.run(op, q, axis, **out)
    if out:
        d = qdtype(out.get("dtype", q.dtype))
        s, z = out["scale"], out.get("zero_point", 0)
    else:
        d, s, z = (TFLITE_LOG_SOFTMAX if log else TFLITE_SOFTMAX)[q.dtype.name]
        d = qdtype(d)
    assert got.dtype is d and got.qscheme == "per_tensor_affine" and got.shape == q.shape
    assert float(got.scale) == np.float32(s) and int(got.zero_point) == z
    np.testing.assert_array_equal(got.int_repr().astype(np.int64), reference(q, axis, s, z, d, log))
    return got


def random_q(rng, shape, d, scale, zp=0):
    d = qdtype(d)
    return QArray.from_int(rng.integers(d.qmin, d.qmax + 1, shape), scale, zp, d)


DTYPES = [("quint8", 0.05, 128), ("qint8", 0.1, 3), ("qint16", 0.001, 0), ("qint4", 0.5, -8)]


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("din,s_in,z_in", DTYPES)
def test_defaults_and_extremes(backend, rng, din, s_in, z_in, log):
    d = qdtype(din)
    rows = [
        [d.qmin, d.qmax] + [d.qmin] * 5 + [d.qmax] * 3,  # both ends
        [d.qmin] * 10,  # all equal, at qmin
        [d.qmax] * 10,
        list(rng.integers(d.qmin, d.qmax + 1, 10)),
        [d.qmin + 1] * 9 + [d.qmax],  # one winner: saturates the top code
    ]
    q = QArray.from_int(np.array(rows), s_in, z_in, d)
    check(q, log=log, backend=backend)
    check(QArray.from_int(np.array([[d.qmin], [d.qmax], [0 if d.qmin < 0 else d.qmin]]), s_in, z_in, d),
          log=log, backend=backend)  # single-element rows: softmax 1, log_softmax 0


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_every_axis_of_3d(backend, rng, axis, log):
    q = random_q(rng, (3, 4, 5), "qint8", 0.07, -3)
    check(q, axis, log, backend)
    check(q, axis, log, backend, scale=0.003, zero_point=-100, dtype="qint8")


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("din,s_in,z_in", DTYPES + [("quint4", 0.3, 15), ("qint2", 1.5, 1), ("quint16", 1e-4, 65535)])
@pytest.mark.parametrize("dout,s_out,z_out", [("quint8", 0.002, 0), ("qint8", 0.01, 127), ("qint16", 1e-5, -32768),
                                               ("quint8", 0.5, 255), ("qint4", 0.07, -8)])
def test_other_outputs_and_saturation(kernels, rng, din, s_in, z_in, dout, s_out, z_out, log):
    q = random_q(rng, (6, 40), din, s_in, z_in)
    check(q, log=log, scale=s_out, zero_point=z_out, dtype=dout)


@pytest.mark.parametrize("log", [False, True])
def test_long_and_short_rows_both_kernel_branches(kernels, rng, log):
    """Rows longer than their code range (Numba's per-row output table) and
    shorter (a division per element); the generic code has one formula."""
    check(random_q(rng, (3, 1000), "qint8", 0.02, 0), log=log)
    check(random_q(rng, (50, 7), "qint16", 0.0005, 0), log=log)
    check(random_q(rng, (4, 3000), "qint16", 0.0005, 0), log=log, scale=1e-4, dtype="quint16")
    # a huge scale: far terms of the table are 0
    check(random_q(rng, (5, 300), "quint8", 4.0, 7), log=log)


@pytest.mark.parametrize("vbmi", [True, False])
@pytest.mark.parametrize("log", [False, True])
def test_byte_lookups_64_at_a_time(rng, monkeypatch, vbmi, log):
    """8-bit codes in and out take their table lookups 64 at a time, by AVX-512
    VBMI byte permutes where the CPU has them (``vbmi`` True), else one at a
    time (forced here): rows of every length around the 64-byte steps (their
    tails one at a time), every code of the dtype in one row (both halves of
    the 256-entry table and the top bit that picks between them), scales
    whose table integers fill all four byte planes or leave the upper ones
    zero, and a row whose sum passes 2**46."""
    pytest.importorskip("numba")
    from qarray.backends.cpu import isa

    if vbmi and not isa.usable("avx512vbmi")[0]:
        pytest.skip("the CPU has no AVX-512 VBMI")
    monkeypatch.setattr(isa, "OFF", set() if vbmi else {"avx512vbmi"})
    with qarray.config.using(numba=True):
        for d in (qdtype("qint8"), qdtype("quint8")):
            every = np.arange(d.qmin, d.qmax + 1)
            for n in (63, 64, 65, 127, 128, 256, 257, 1000):
                codes = rng.integers(d.qmin, d.qmax + 1, (4, n))
                codes[0] = np.resize(rng.permutation(every), n)  # every code where n >= 256
                codes[1], codes[1, -1] = d.qmin, d.qmax  # distances 0 and 255 only
                codes[2] = d.qmax
                for s in (1e-4, 0.05, 3.0):
                    check(QArray.from_int(codes, s, 0, d), log=log)
        long_row = rng.integers(120, 128, (1, 2**17))
        assert round(2**30 * math.exp(-1e-5 * 7)) * 2**17 > 2**46  # the smallest term, times the row
        check(QArray.from_int(long_row, 1e-5, 0, "qint8"), log=log)


def test_zero_point_cancels(kernels, rng):
    codes = rng.integers(-128, 128, (4, 33))
    a = qarray.softmax(QArray.from_int(codes, 0.05, -128, "qint8"))
    b = qarray.softmax(QArray.from_int(codes, 0.05, 127, "qint8"))
    np.testing.assert_array_equal(a.int_repr(), b.int_repr())


def test_numba_and_generic_agree(rng):
    pytest.importorskip("numba")
    for d, s, shape in [("qint8", 0.04, (64, 1000)), ("qint16", 0.0003, (40, 100)), ("quint8", 0.2, (7, 300))]:
        q = random_q(rng, shape, d, s)
        for op in (qarray.softmax, qarray.log_softmax):
            with qarray.config.using(numba=True):
                a = op(q).int_repr()
            with qarray.config.using(numba=False):
                b = op(q).int_repr()
            np.testing.assert_array_equal(a, b)


def test_empty(kernels):
    for shape in [(0, 5), (3, 0), (0,)]:
        q = QArray.from_int(np.zeros(shape, np.int8), 0.1, 0, "qint8")
        assert qarray.softmax(q).shape == shape and qarray.log_softmax(q, 0).shape == shape


def test_against_torch(kernels, rng):
    torch = pytest.importorskip("torch")
    q = random_q(rng, (20, 100), "qint8", 0.05, 0)
    x = torch.from_numpy(q.dequantize())
    for op, tf in ((qarray.softmax, torch.softmax), (qarray.log_softmax, torch.log_softmax)):
        got = op(q)
        want = np.clip(np.rint(tf(x.double(), -1).numpy() / float(got.scale)) + int(got.zero_point),
                       got.dtype.qmin, got.dtype.qmax)
        assert np.abs(got.int_repr().astype(np.int64) - want).max() <= 1


def test_table_is_the_contract():
    """T[0] is 2**30 and the table is the documented rounding of exp."""
    T = sys.modules["qarray.ops.softmax"].table(np.float32(0.1), qarray.qint8)
    assert T.dtype == np.int64 and T.shape == (256,) and T[0] == 2**30
    assert T.tolist() == [round(2**30 * math.exp(float(np.float32(0.1)) * -j)) for j in range(256)]


def _q8():
    return QArray.from_int(np.zeros((2, 3), np.int8), 0.1, 0, "qint8")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: qarray.softmax(np.zeros(3)), TypeError, "softmax: the input must be a QArray"),
    (lambda: qarray.log_softmax(QArray.from_int(np.zeros(3, np.int32), 0.1, 0, "qint32")), TypeError,
     "log_softmax: needs an input of 16 bits or less.*qint32.*requantize"),
    (lambda: qarray.softmax(QArray.from_int(np.zeros((2, 3), np.int8), [0.1, 0.2], 0, "qint8", axis=0)), ValueError,
     "softmax: the input has per-axis parameters.*requantize it per-tensor"),
    (lambda: qarray.softmax(QArray.from_int(np.zeros((2, 4), np.int8), np.full((2, 2), 0.1), 0, "qint8", axis=1,
                                            block_size=2)), ValueError, "softmax: blocked parameters are not supported"),
    (lambda: qarray.softmax(_q8(), 2), ValueError, "softmax: axis 2 is out of range"),
    (lambda: qarray.softmax(_q8(), 1.0), TypeError, "softmax: axis must be an integer"),
    (lambda: qarray.softmax(_q8(), zero_point=3), ValueError, "softmax: pass the output scale="),
    (lambda: qarray.log_softmax(_q8(), scale=-1.0), ValueError, "scale"),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_row_too_long_for_int64():
    softmax_module = sys.modules["qarray.ops.softmax"]
    q = QArray.from_int(np.zeros((1, 1), np.int8), 0.1, 0, "qint8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(softmax_module, "_MAX_ROW", 1)
        with pytest.raises(ValueError, match="softmax: rows of 1 elements .* overflow the exact int64"):
            qarray.softmax(q)


def test_docstring_examples():
    import qarray.ops.elementwise

    for module in (sys.modules["qarray.ops.softmax"], qarray.ops.elementwise):
        result = doctest.testmod(module, extraglobs={"numpy": np, "qarray": qarray, "QArray": QArray},
                                 optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_a_generic_numba_target_keeps_to_portable_code(tmp_path):
    """With ``NUMBA_CPU_NAME=generic`` (a cache portable across machines) LLVM
    cannot lower the 512-bit x86 intrinsics of the IR kernels and aborts the
    process: softmax takes its loop of loads instead (and the packed 4-bit GEMM
    the engine), with the same codes; quantize's streamed stores are portable
    LLVM and stay."""
    pytest.importorskip("numba")
    script = """
import numpy as np, qarray
from qarray.backends import _gemm
from qarray.backends.cpu import isa
q = qarray.QArray.from_int(np.random.default_rng(0).integers(-128, 128, (1048, 1000)), 0.05, 0, "qint8")
x = np.random.default_rng(1).standard_normal(1 << 22).astype(np.float32)
got = qarray.softmax(q).int_repr(), qarray.quantize(x, 0.02, 3, "qint8").int_repr()
with qarray.config.using(numba=False):
    want = qarray.softmax(q).int_repr(), qarray.quantize(x, 0.02, 3, "qint8").int_repr()
assert all(np.array_equal(a, b) for a, b in zip(got, want))
assert not isa.usable("avx512vbmi")[0] and _gemm.packed4_kernel() is None
print("ok")
"""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
