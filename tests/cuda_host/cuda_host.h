// Host execution of qarray's CUDA kernels: the CUDA built-ins the kernels use,
// defined for an ordinary C++ compiler. The harness (tests/test_cuda.py)
// compiles qarray/backends/cuda/*.cu against this header with g++ and runs each
// kernel for every (block, thread) of the launch CupyBackend would make.
// Kernels here synchronise nothing (grid-stride loops), so threads run one
// after another; kernels with __syncthreads would need fibers.
#pragma once
#include <cmath>

struct dim3 { unsigned x = 0, y = 0, z = 0; };
inline dim3 blockIdx, threadIdx, blockDim, gridDim;

extern "C" void qa_host_set(unsigned grid, unsigned block, unsigned b, unsigned t) {
    gridDim.x = grid; blockDim.x = block; blockIdx.x = b; threadIdx.x = t;
    gridDim.y = gridDim.z = blockDim.y = blockDim.z = 1;
}

#define __global__
#define __device__
#define __forceinline__ inline

// IEEE round-to-nearest arithmetic: plain operators on the host (built with
// -ffp-contract=off, so nothing is fused).
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
