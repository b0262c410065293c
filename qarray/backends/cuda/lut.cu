// Lookup tables: out[i] = table[u[i]], u the input's storage bits as unsigned.
// The table is copied bit for bit, so one kernel per (index width, value
// width): lut_uint8_uint32 looks 8-bit codes up in a table of 4-byte values.
// A 256-entry table is staged in shared memory; a 65536-entry one is read
// from global memory (through the read-only cache).
#include "common.cuh"

template <typename TV>
__device__ void lut8_body(const unsigned char* q, const TV* table, i64 total, TV* out) {
    __shared__ TV tab[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) tab[i] = table[i];
    __syncthreads();
    QA_GRID_STRIDE(idx, total) out[idx] = tab[q[idx]];
}

template <typename TV>
__device__ void lut16_body(const unsigned short* q, const TV* __restrict__ table, i64 total, TV* out) {
    QA_GRID_STRIDE(idx, total) out[idx] = __ldg(table + q[idx]);
}

#define LUT(IN, TIN, BODY, OUT, TV)                                                                 \
    extern "C" __global__ void lut_##IN##_##OUT(const TIN* q, const TV* table, i64 total, TV* out) { \
        BODY<TV>(q, table, total, out);                                                             \
    }
#define LUT_ALL(IN, TIN, BODY)                        \
    LUT(IN, TIN, BODY, uint8, unsigned char)          \
    LUT(IN, TIN, BODY, uint16, unsigned short)        \
    LUT(IN, TIN, BODY, uint32, unsigned int)          \
    LUT(IN, TIN, BODY, uint64, unsigned long long)
LUT_ALL(uint8, unsigned char, lut8_body)
LUT_ALL(uint16, unsigned short, lut16_body)
