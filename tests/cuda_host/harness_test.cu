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

// Each thread's view of shared memory nobody wrote: garbage on hardware, and in the harness.
extern "C" __global__ void shared_unwritten(int* out) {
    __shared__ int s[64];
    out[(i64)blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x % 64];
}

// The order blocks ran in: thread 0 takes a ticket.
extern "C" __global__ void block_tickets(int* counter, int* out) {
    if (threadIdx.x == 0) out[blockIdx.x] = atomicAdd(counter, 1);
}

// Lanes 16..31 leave; lanes 0..15 then shuffle with a full mask (mode 0: names exited
// lanes), or with the mask 0xffff reading lane 16 (mode 1: outside the mask), or
// correctly (mode 2: mask 0xffff, reading within it).
extern "C" __global__ void shuffle_after_exit(int mode, int* out) {
    const unsigned lane = threadIdx.x & 31;
    if (lane >= 16) return;
    int v = (int)lane;
    if (mode == 0) v = __shfl_down_sync(0xffffffffu, v, 1);
    if (mode == 1) v = __shfl_sync(0xffffu, v, 16);
    if (mode == 2) v = __shfl_down_sync(0xffffu, v, 1, 16);
    out[threadIdx.x] = v;
}
