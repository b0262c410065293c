#!/usr/bin/env bash
# One prepared GPU check for a lent device (no network there): the GPU tests and
# the GPU benchmark, results under $OUT (default ./gpu_out). Finishes in under
# 10 minutes on an H200: run as  timeout 580 bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" > "$OUT/versions.txt" 2>&1
export PYTHONPATH=.
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
timeout 240 python benchmarks/bench_gpu.py "$OUT" > "$OUT/bench_gpu.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench_gpu.log"
tail -3 "$OUT/pytest_gpu.txt" "$OUT/bench_gpu.log"
