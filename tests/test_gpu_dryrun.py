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

TESTS = Path(__file__).parent


def test_gpu_tests_pass_on_the_host_harness():
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cuda_host.gpu_dryrun", "-p", "no:cacheprovider",
                        "-m", "gpu", "-k", "not beyond_2_31", str(TESTS / "test_gpu.py"), str(TESTS / "test_gpu_dask.py")],
                       capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout and " error" not in r.stdout, r.stdout[-2000:]
