// Min / max reductions, equal to numpy.min / numpy.max (a NaN anywhere gives
// NaN). The data is seen as `rows` rows of `len` values, each row cut into
// `nseg` segments of `seg` values (the last one shorter); one block reduces
// one segment (grid-stride over segments) into lo[s], hi[s]. The backend
// arranges per-tensor (two passes), per-axis and blocked reductions this way.
#include "common.cuh"

#define QA_FULL_MASK 0xffffffffu

template <typename T> __device__ __forceinline__ T qa_min(T a, T b) { return (a != a || qa_lt(a, b)) ? a : b; }
template <typename T> __device__ __forceinline__ T qa_max(T a, T b) { return (a != a || qa_lt(b, a)) ? a : b; }

template <typename T>
__device__ __forceinline__ void qa_warp_minmax(T& lo, T& hi) {
    for (int off = 16; off > 0; off >>= 1) {
        lo = qa_min(lo, __shfl_down_sync(QA_FULL_MASK, lo, off));
        hi = qa_max(hi, __shfl_down_sync(QA_FULL_MASK, hi, off));
    }
}

// The block's min and max in thread 0 (blockDim.x a multiple of 32).
template <typename T>
__device__ void qa_block_minmax(T& lo, T& hi) {
    __shared__ T s_lo[32], s_hi[32];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    qa_warp_minmax(lo, hi);
    if (lane == 0) s_lo[warp] = lo, s_hi[warp] = hi;
    __syncthreads();
    if (warp == 0) {
        const unsigned k = lane < (blockDim.x >> 5) ? lane : 0;
        lo = s_lo[k], hi = s_hi[k];
        qa_warp_minmax(lo, hi);
    }
    __syncthreads();  // s_lo / s_hi are reused by the block's next segment
}

template <typename T>
__device__ void minmax_body(const T* x, i64 rows, i64 len, i64 seg, i64 nseg, T* lo, T* hi) {
    for (i64 s = blockIdx.x; s < rows * nseg; s += gridDim.x) {
        const T* p = x + (s / nseg) * len;
        const i64 start = (s % nseg) * seg, end = start + seg < len ? start + seg : len;
        T a = p[start], b = a;  // segments are never empty
        for (i64 j = start + threadIdx.x; j < end; j += blockDim.x) {
            a = qa_min(a, p[j]);
            b = qa_max(b, p[j]);
        }
        qa_block_minmax(a, b);
        if (threadIdx.x == 0) lo[s] = a, hi[s] = b;
    }
}


// The same for many short segments (blocked parameters of a few dozen values):
// one thread a segment, rather than a block of threads for a few values.
template <typename T>
__device__ void minmax_each_body(const T* x, i64 rows, i64 len, i64 seg, i64 nseg, T* lo, T* hi) {
    QA_GRID_STRIDE(s, rows * nseg) {
        const T* p = x + (s / nseg) * len;
        const i64 start = (s % nseg) * seg, end = start + seg < len ? start + seg : len;
        T a = p[start], b = a;
        for (i64 j = start + 1; j < end; ++j) {
            a = qa_min(a, p[j]);
            b = qa_max(b, p[j]);
        }
        lo[s] = a, hi[s] = b;
    }
}

// minmax_NAME: a block a segment; minmax_each_NAME: a thread a segment.
#define MINMAX_KERNEL(KERNEL, BODY, T)                                                                   \
    extern "C" __global__ void KERNEL(const T* x, i64 rows, i64 len, i64 seg, i64 nseg, T* lo, T* hi) { \
        BODY<T>(x, rows, len, seg, nseg, lo, hi);                                                       \
    }
#define MINMAX(NAME, T) MINMAX_KERNEL(minmax_##NAME, minmax_body, T) MINMAX_KERNEL(minmax_each_##NAME, minmax_each_body, T)
MINMAX(float32, float)
MINMAX(float64, double)
