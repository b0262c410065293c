"""CUDA kernels with barriers and warp shuffles (LUT, min/max) run on the host
through fibers, against the NumPy backend bit for bit; and the harness's
fibers themselves: kernels that are wrong without their barriers."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qarray
from qarray import QArray
from qarray.backends import _cuda
from qarray.backends._cuda import CUDA_DIR

from cuda_host.harness import HOST_GRID, HostCupyBackend, build
from _reference import numpy_and_host

BIG = _cuda.BLOCK * HOST_GRID * 64 + 77  # beyond one grid: the grid-stride tail runs
HARNESS_KERNELS = Path(__file__).parent / "cuda_host" / "harness_test.cu"


@pytest.fixture(scope="module")
def broken_barrier(tmp_path_factory):
    """The LUT, reduce and harness-test kernels built with __syncthreads a no-op."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    out = tmp_path_factory.mktemp("broken") / "kernels.so"
    return build(out, [CUDA_DIR / "lut.cu", CUDA_DIR / "reduce.cu", HARNESS_KERNELS], ["-DQA_HOST_BROKEN_BARRIER"])


@pytest.fixture(scope="module")
def harness_lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    return build(tmp_path_factory.mktemp("harness") / "kernels.so", [HARNESS_KERNELS])


# -- LUT ----------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 37, 1000, BIG])
@pytest.mark.parametrize("storage", ["int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("out", ["int8", "uint16", "int32", "float64"])
def test_lut(host, rng, size, storage, out):
    info = np.iinfo(storage)
    q = rng.integers(info.min, info.max, size, endpoint=True).astype(storage)
    q[0] = info.min
    table = rng.integers(-100, 100, 1 << (8 * q.itemsize)).astype(out)
    want, got = numpy_and_host(host, lambda b: b.lut(q, table))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert host.launches[-1][0] == f"lut_u{storage.lstrip('u')}_{np.dtype(f'u{np.dtype(out).itemsize}').name}"


@pytest.mark.parametrize("shape", [(0,), (3, 5, 7)])
def test_lut_shapes(host, rng, shape):
    q = rng.integers(-128, 127, shape, endpoint=True).astype(np.int8)
    table = rng.integers(0, 255, 256, endpoint=True).astype(np.uint8)
    want, got = numpy_and_host(host, lambda b: b.lut(q, table))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("start", [0, 1, 3, 8])
@pytest.mark.parametrize("storage,out", [("int8", "uint8"), ("int8", "int32"), ("uint16", "float64")])
def test_lut_vector_path_and_misaligned_starts(host, rng, start, storage, out):
    """Per-tensor lookups move 16 bytes at a time where both pointers allow it,
    element by element otherwise; the tail after the last whole vector too."""
    info = np.iinfo(storage)
    q = rng.integers(info.min, info.max, 16 * 41 + 13, endpoint=True).astype(storage)[start:]
    table = rng.integers(-1000, 1000, 1 << (8 * q.itemsize)).astype(out)
    want, got = numpy_and_host(host, lambda b: b.lut(q, table))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape,axis", [((3, 5, 7), 1), ((3, 5, 7), 0), ((3, 5, 7), 2), ((6,), 0), ((BIG // 64, 64), 1)])
@pytest.mark.parametrize("storage,out", [("int8", "uint8"), ("uint8", "float32"), ("int16", "int16")])
def test_lut_per_axis(host, rng, shape, axis, storage, out):
    """One table per index along ``axis`` (per-axis input): a row of tables in
    global memory, element idx reading row ``(idx / inner) % n``."""
    info = np.iinfo(storage)
    q = rng.integers(info.min, info.max, shape, endpoint=True).astype(storage)
    tables = rng.integers(-100, 100, (shape[axis], 1 << (8 * q.itemsize))).astype(out)
    want, got = numpy_and_host(host, lambda b: b.lut(q, tables, axis))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert host.launches[-1][0] == f"lut_u{storage.lstrip('u')}_{np.dtype(f'u{np.dtype(out).itemsize}').name}"


def test_lut_through_the_api(host, rng):
    q = qarray.quantize(rng.standard_normal((5, 67)).astype(np.float32), 0.05, 3, "qint8")
    hq = QArray._new(q.int_repr(), q.scale, q.zero_point, q.dtype, None, None, host)
    np.testing.assert_array_equal(qarray.sigmoid(hq).int_repr(), qarray.sigmoid(q).int_repr())
    assert host.launches[-1][0] == "lut_uint8_uint8"
    q = qarray.quantize(rng.standard_normal((5, 67)).astype(np.float32), rng.uniform(0.01, 0.1, 5), 3, "qint8", axis=0)
    hq = QArray._new(q.int_repr(), q.scale, q.zero_point, q.dtype, 0, None, host)
    out = dict(scale=0.02, zero_point=-10, dtype="qint8")
    np.testing.assert_array_equal(qarray.gelu(hq, **out).int_repr(), qarray.gelu(q, **out).int_repr())
    assert host.launches[-1][0] == "lut_uint8_uint8"


# -- min / max ----------------------------------------------------------------
def _data(rng, shape, dtype, special):
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    flat = x.reshape(-1)
    if special == "inf" and flat.size:
        flat[rng.integers(0, flat.size, 3)] = [np.inf, -np.inf, np.inf]
    if special == "nan" and flat.size:
        flat[rng.integers(0, flat.size, 2)] = np.nan
    if special == "last":  # the extremes at the very end: the last segment and thread count
        flat[-1], flat[-2 if flat.size > 1 else -1] = 1e4, -1e4
    return x


def _assert_minmax(want, got, dtype):
    for w, g in zip(want, got):
        assert np.asarray(g).dtype == dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("size", [1, 37, 256 * 16, 256 * 16 + 1, 100_003, BIG])
@pytest.mark.parametrize("special", ["none", "inf", "nan", "last"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_minmax_per_tensor(host, rng, size, special, dtype):
    x = _data(rng, (size,), dtype, special)
    want, got = numpy_and_host(host, lambda b: b.minmax(x, None, None))
    _assert_minmax(want, got, dtype)
    assert host.launches[-1][0].endswith(f"_{'float64' if dtype == np.float64 else 'float32'}") and host.launches[-1][0].startswith("minmax_")


def test_minmax_all_nan_and_one_nan_per_slot(host):
    x = np.full((4, 300), np.nan, np.float32)
    want, got = numpy_and_host(host, lambda b: b.minmax(x, None, None))
    _assert_minmax(want, got, np.float32)
    x = np.arange(1200, dtype=np.float32).reshape(4, 300)
    x[1, 299] = np.nan
    x[3, 0] = np.nan
    for axis in (0, 1):
        want, got = numpy_and_host(host, lambda b: b.minmax(x, axis, None))
        _assert_minmax(want, got, np.float32)


AXES = [((6, 7), 0, None), ((6, 7), 1, None), ((2, 5, 3), 1, None), ((3, 1000), 0, None), ((1000, 3), 1, None),
        ((3, 10), 1, 4), ((10, 3), 0, 3), ((2, 9, 3), 1, 2), ((2, 700, 3), 1, 300), ((5,), 0, 5)]


@pytest.mark.parametrize("shape,axis,block_size", AXES)
@pytest.mark.parametrize("special", ["none", "inf", "nan"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_minmax_per_axis_and_blocked(host, rng, shape, axis, block_size, special, dtype):
    x = _data(rng, shape, dtype, special)
    want, got = numpy_and_host(host, lambda b: b.minmax(x, axis, block_size))
    for w, g in zip(want, got):
        assert g.shape == w.shape
    _assert_minmax(want, got, dtype)


def test_minmax_falls_back(host):
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    want, got = numpy_and_host(host, lambda b: b.minmax(x, 1, None))
    _assert_minmax(want, got, np.int32)


# -- the fibers ---------------------------------------------------------------
def test_barriers_are_needed_and_kept(host, broken_barrier, rng):
    """Without __syncthreads the LUT and the reduction give wrong results; the
    same sources with the fibers' barriers give the right ones."""
    broken = HostCupyBackend(broken_barrier)
    q = rng.integers(-128, 127, 5000, endpoint=True).astype(np.int8)
    table = np.arange(256, dtype=np.int16) + 1000
    assert not np.array_equal(broken.lut(q, table), host.lut(q, table))
    np.testing.assert_array_equal(host.lut(q, table), table[q.view(np.uint8)])
    x = np.arange(1, 20_001, dtype=np.float32)
    # in the last block's last warp, which its first warp reads through shared memory
    # (the segments have 4096 values; thread 255 starts at 255)
    x[4 * 4096 + 255] = 1e6
    assert [float(v) for v in broken.minmax(x, None, None)] != [1.0, 1e6]
    assert [float(v) for v in host.minmax(x, None, None)] == [1.0, 1e6]


@pytest.mark.parametrize("block", [32, 256, 1024])
def test_block_scan_with_dynamic_shared_memory(harness_lib, broken_barrier, rng, block):
    x = rng.integers(-1000, 1000, 3 * block).astype(np.int32)
    want = np.cumsum(x.reshape(3, block), axis=1).reshape(-1)
    for lib, ok in ((harness_lib, True), (broken_barrier, False)):
        out = np.zeros_like(x)
        HostCupyBackend(lib).run("block_scan", (3,), (block,), (x, out), shared_mem=8 * block)
        assert np.array_equal(out, want) == ok


def test_warp_shuffles(harness_lib, rng):
    x = rng.integers(-1000, 1000, 2 * 128).astype(np.int32)
    s, f = np.zeros_like(x), np.zeros_like(x)
    HostCupyBackend(harness_lib).run("warp_ops", (2,), (128,), (x, s, f))
    w = x.reshape(-1, 32)
    np.testing.assert_array_equal(s.reshape(-1, 32), np.repeat(w.sum(axis=1, keepdims=True), 32, axis=1))
    np.testing.assert_array_equal(f.reshape(-1, 32), np.repeat(w[:, :1], 32, axis=1))


# -- the harness is no kinder than hardware ----------------------------------------
def test_shared_memory_starts_as_garbage(harness_lib):
    """Shared memory nobody wrote holds garbage at each block's start, different
    from block to block: a kernel that reads it before writing fails here."""
    out = np.zeros(4 * 64, np.int32)
    HostCupyBackend(harness_lib).run("shared_unwritten", (4,), (64,), (out,))
    blocks = out.reshape(4, 64)
    assert np.count_nonzero(blocks) > 200
    assert len({b.tobytes() for b in blocks}) == 4


def test_blocks_run_in_a_shuffled_order(harness_lib):
    tickets = []
    for _ in range(2):
        counter, out = np.zeros(1, np.int32), np.zeros(64, np.int32)
        HostCupyBackend(harness_lib).run("block_tickets", (64,), (32,), (counter, out))
        assert sorted(out) == list(range(64))
        tickets.append(out.tolist())
    assert tickets[0] != list(range(64)) and tickets[0] != tickets[1]


@pytest.mark.parametrize("mode,message", [(0, "names a lane that is not running"), (1, "reads a lane outside it"),
                                          (2, None)])
def test_shuffle_masks_are_checked(harness_lib, mode, message):
    """A shuffle whose mask names exited lanes, or that reads outside its mask,
    aborts (undefined on hardware); a correct partial mask works. In a
    subprocess: the harness aborts the process."""
    code = (f"import ctypes, numpy as np, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from cuda_host.harness import HostCupyBackend\n"
            f"out = np.full(32, -1, np.int32)\n"
            f"HostCupyBackend(ctypes.CDLL({harness_lib._name!r})).run('shuffle_after_exit', (1,), (32,), "
            f"(np.int32({mode}), out))\n"
            "print(out[:16].tolist())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if message is None:
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str([*range(1, 16), 15])
    else:
        assert r.returncode != 0 and message in r.stderr, r.stderr


def test_minmax_fills_the_device_per_axis_and_blocked(host, rng):
    """Per-axis rows are cut into enough segments to fill the device (3 channels
    do not make 3 blocks), then one pass over the segments; short blocks take
    a thread each, not a block each."""
    x = rng.standard_normal((3, 65536)).astype(np.float32)
    want, got = numpy_and_host(host, lambda b: b.minmax(x, 0, None))
    _assert_minmax(want, got, np.float32)
    assert [n for n, _, _ in host.launches[-2:]] == ["minmax_float32", "minmax_each_float32"]
    assert host.launches[-2][1] == HOST_GRID  # 3 rows x 3 segments, on a grid of the device's size
    xb = rng.standard_normal((4, 256)).astype(np.float32)
    want, got = numpy_and_host(host, lambda b: b.minmax(xb, 1, 32))
    _assert_minmax(want, got, np.float32)
    assert host.launches[-1][0] == "minmax_each_float32"
