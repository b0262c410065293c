// Lookup tables: out[i] = table[row * T + u[i]], u the input's storage bits as
// unsigned and T = 256 or 65536 the table length. Per-tensor input has one
// table (row 0); per-axis input one row per index along the axis, the row being
// the Layout's parameter slot. The tables are copied bit for bit,
// so one kernel per (index width, value width): lut_uint8_uint32 looks 8-bit
// codes up in tables of 4-byte values. One 256-entry table is staged in
// shared memory; anything else is read from global memory through the
// read-only cache.
#include "common.cuh"

template <typename TIn, typename TV>
__device__ void lut_body(const TIn* q, const TV* __restrict__ table, const i64* bidx, i64 total, Layout lay,
                         TV* out) {
    constexpr i64 T = (i64)1 << (8 * sizeof(TIn));
    if (T == 256 && lay.blocks == 1) {  // the same branch for the whole grid
        __shared__ TV tab[256];
        for (int i = threadIdx.x; i < 256; i += blockDim.x) tab[i] = table[i];
        __syncthreads();
        const TV* t = tab;
        qa_map(q, out, total, lay, bidx, [=](TIn u, i64) -> TV { return t[u]; });
        return;
    }
    qa_map(q, out, total, lay, bidx, [=](TIn u, i64 row) -> TV { return __ldg(table + row * T + u); });
}

#define LUT(IN, TIN, OUT, TV)                                                                      \
    extern "C" __global__ void lut_##IN##_##OUT(const TIN* q, const TV* table, const i64* bidx,    \
                                                i64 total, LAYOUT_ARGS, TV* out) {                 \
        lut_body<TIN, TV>(q, table, bidx, total, LAYOUT, out);                                     \
    }
#define LUT_ALL(IN, TIN)                        \
    LUT(IN, TIN, uint8, unsigned char)          \
    LUT(IN, TIN, uint16, unsigned short)        \
    LUT(IN, TIN, uint32, unsigned int)          \
    LUT(IN, TIN, uint64, unsigned long long)
LUT_ALL(uint8, unsigned char)
LUT_ALL(uint16, unsigned short)
