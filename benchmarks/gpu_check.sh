#!/usr/bin/env bash
# One prepared GPU check for a lent device (no network there): the GPU tests and
# the GPU benchmark, results under $OUT (default ./gpu_out). Finishes in under
# 10 minutes on an H200: run as  timeout 580 bash benchmarks/gpu_check.sh
# The device has no Dask: for the Dask tests and rows (CuPy chunks), carry it in
#   pip install --target .gpu_deps dask     (27 MB; not dask[array]: its NumPy would shadow the device's)
# passing carry=[".gpu_deps"]; without it they skip.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" > "$OUT/versions.txt" 2>&1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
[ -d .gpu_deps ] && export PYTHONPATH="$PYTHONPATH:.gpu_deps"
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_dask.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
# the recorded CuPy API (tests/cuda_host/cupy_api.json) against this device's CuPy, cuBLAS loaded
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_cupy_api.py >> "$OUT/pytest_gpu.txt" 2>&1
echo "pytest cupy_api rc=$?" >> "$OUT/pytest_gpu.txt"
timeout 240 python benchmarks/bench_gpu.py "$OUT" > "$OUT/bench_gpu.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench_gpu.log"
tail -3 "$OUT/pytest_gpu.txt" "$OUT/bench_gpu.log"
