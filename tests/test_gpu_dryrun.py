"""tests/test_gpu.py and tests/test_gpu_dask.py without a GPU: the same tests in a fresh process, on a fake
CuPy made of NumPy whose backend runs the kernels through the host harness
(tests/cuda_host/gpu_dryrun.py). This checks the GPU tests themselves and the
whole API on the "cupy" backend before a real device ever runs them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_host.harness import SHARED_BUILDS, session_folder

TESTS = Path(__file__).parent


def test_gpu_tests_pass_on_the_host_harness(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    # the kernels' host build is this session's (built once, shared: cuda_host.harness.shared_build)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
           SHARED_BUILDS: str(session_folder(tmp_path_factory))}
    # -n 0: one process (workers of its own would each import and set up everything, beside this session's)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cuda_host.gpu_dryrun", "-p", "no:cacheprovider",
                        "-n", "0", "-m", "gpu", "-k", "not beyond_2_31", str(TESTS / "test_gpu.py"), str(TESTS / "test_gpu_dask.py")],
                       capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout and " error" not in r.stdout, r.stdout[-2000:]


BENCH = """
import sys, types
from pathlib import Path
import numpy as np
sys.path.insert(0, "benchmarks")
import bench_gpu_host
cupy, qarray, launches = bench_gpu_host._stand_in()  # the real CupyBackend, launches stubbed


class Times:  # what cupyx.profiler.benchmark returns, from three real calls
    def __init__(self, fn):
        for _ in range(3):
            fn()
        self.cpu_times, self.gpu_times = np.full(3, 1e-5), np.full((1, 3), 1e-5)


profiler = types.SimpleNamespace(benchmark=lambda fn, n_repeat, n_warmup: Times(fn))
sys.modules["cupyx"], sys.modules["cupyx.profiler"] = types.SimpleNamespace(profiler=profiler), profiler
import bench_gpu
bench_gpu.torch = None
bench_gpu.main(Path(sys.argv[1]), True)
print("launches", launches[0])
"""


def test_the_gpu_benchmark_runs_through_on_the_stand_in(tmp_path):
    """bench_gpu.py on the stand-in CuPy, every launch stubbed (its numbers mean
    nothing here): a device's minutes are not spent finding that it crashes, or
    that it uses a CuPy name the stand-in, like CuPy 13 or 14, does not have."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent)])}
    r = subprocess.run([sys.executable, "-c", BENCH, str(tmp_path)], capture_output=True, text=True, env=env,
                       cwd=TESTS.parent, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = (tmp_path / "bench_gpu.txt").read_text()
    for row in ("device-to-device copy of float32 (best of copyto, copy)", "quantize float32 -> qint8",
                "add qint8 + qint8 -> qint8", "gemv M=16 qint8 weights", "host time: nn.Linear M=16"):
        assert row in text, row
    assert int(r.stdout.split("launches")[-1]) > 50
