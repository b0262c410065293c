// Kernels that test the host harness itself (not part of qarray).
#include "common.cuh"

// Inclusive prefix sum of each block's blockDim.x values (Hillis-Steele in
// dynamic shared memory, two buffers): wrong without its barriers.
extern "C" __global__ void block_scan(const int* x, int* out) {
    extern __shared__ int buf[];
    const unsigned t = threadIdx.x, n = blockDim.x;
    const i64 base = (i64)blockIdx.x * n;
    int* cur = buf;
    int* nxt = buf + n;
    cur[t] = x[base + t];
    __syncthreads();
    for (unsigned d = 1; d < n; d <<= 1) {
        nxt[t] = cur[t] + (t >= d ? cur[t - d] : 0);
        __syncthreads();
        int* tmp = cur;
        cur = nxt;
        nxt = tmp;
    }
    out[base + t] = cur[t];
}

// Every lane gets its warp's sum (xor butterfly) and its warp's first value.
extern "C" __global__ void warp_ops(const int* x, int* sum, int* first) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    int v = x[i];
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    sum[i] = v;
    first[i] = __shfl_sync(0xffffffffu, x[i], 0);
}
