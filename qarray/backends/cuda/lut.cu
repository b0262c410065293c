// Lookup tables: out[i] = table[row * T + u[i]], u the input's storage bits as
// unsigned and T = 256 or 65536 the table length. Per-tensor input has one
// table (row 0); per-axis input (n > 1) one row per index along the axis:
// element idx uses row (idx / inner) % n. The tables are copied bit for bit,
// so one kernel per (index width, value width): lut_uint8_uint32 looks 8-bit
// codes up in tables of 4-byte values. One 256-entry table is staged in
// shared memory; anything else is read from global memory through the
// read-only cache.
#include "common.cuh"

template <typename TIn, typename TV>
__device__ void lut_body(const TIn* q, const TV* __restrict__ table, i64 n, i64 inner, i64 total, TV* out) {
    constexpr i64 T = (i64)1 << (8 * sizeof(TIn));
    if (T == 256 && n == 1) {  // the same branch for the whole grid
        __shared__ TV tab[256];
        for (int i = threadIdx.x; i < 256; i += blockDim.x) tab[i] = table[i];
        __syncthreads();
        QA_GRID_STRIDE(idx, total) out[idx] = tab[q[idx]];
        return;
    }
    QA_GRID_STRIDE(idx, total) {
        const i64 row = n == 1 ? 0 : (idx / inner) % n;
        out[idx] = __ldg(table + row * T + q[idx]);
    }
}

#define LUT(IN, TIN, OUT, TV)                                                                      \
    extern "C" __global__ void lut_##IN##_##OUT(const TIN* q, const TV* table, i64 n, i64 inner,   \
                                                i64 total, TV* out) {                              \
        lut_body<TIN, TV>(q, table, n, inner, total, out);                                         \
    }
#define LUT_ALL(IN, TIN)                        \
    LUT(IN, TIN, uint8, unsigned char)          \
    LUT(IN, TIN, uint16, unsigned short)        \
    LUT(IN, TIN, uint32, unsigned int)          \
    LUT(IN, TIN, uint64, unsigned long long)
LUT_ALL(uint8, unsigned char)
LUT_ALL(uint16, unsigned short)
