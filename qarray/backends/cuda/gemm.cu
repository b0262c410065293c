// The integer GEMM and conv of the CuPy backend, bit-identical to the NumPy
// backend (qarray.backends._base.Backend.int_matmul and conv_grouped):
//  - to_s8: activation codes a as the int8 a' = a + off, rows padded with
//    zeros to the packed weights' K (cuBLAS and gemv read a' this way);
//  - epilogue: one pass over cuBLAS's int32 product (or the int64 sum of its
//    K-split parts): zero-point terms, bias, requantize, output dtype;
//  - gemv: the same for M <= 16 rows without cuBLAS, reading each weight once
//    (int8, or 4-bit two to a byte) with __dp4a, the epilogue in the same kernel;
//  - im2col (channels-last rows for the GEMM) and conv_grouped (grouped and
//    depthwise conv, direct, requantized in the same pass).
#include "common.cuh"

// The GEMM's per-column terms. With a' = a + off and w' = w - shift as the
// kernels multiply them, za' = za + off and zw' = zw - shift:
//     sum_k (a - za)(w - zw) + bias = raw + bias[n] - za' * colsum[n] - zw'[n] * (rowsum[r] - K * za')
// where raw = sum_k a' w', colsum = sum_k w', rowsum = sum_k a'. A step of 0
// reads element 0 of that array for every column (per-tensor) or row.
struct GemmTerms {
    const i64 *bias, *colsum, *zw, *rowsum;
    i64 bstep, zstep, rstep, za, kza;
    __device__ __forceinline__ i64 operator()(i64 raw, i64 r, i64 n) const {
        return raw + bias[n * bstep] - za * colsum[n] - zw[n * zstep] * (rowsum[r * rstep] - kza);
    }
};
#define GEMM_TERMS_ARGS const i64 *bias, i64 bstep, const i64 *colsum, const i64 *zw, i64 zstep, const i64 *rowsum, \
                        i64 rstep, i64 za, i64 kza
#define GEMM_TERMS GemmTerms{bias, colsum, zw, rowsum, bstep, zstep, rstep, za, kza}

// The output requantize of column (channel) n: Requant with zp_in 0, its
// parameters per column (pstep 1) or per tensor (pstep 0).
struct OutQ {
    const i64 *zo, *m, *sh;
    const double* f;
    i64 pstep, lo, hi;
    int rounding;
    __device__ __forceinline__ i64 operator()(i64 d, i64 n) const {
        const i64 p = n * pstep;
        return qa_requantize(d, zo[p], m[p], sh[p], f[p], lo, hi, rounding);
    }
};
#define OUTQ_ARGS const i64 *zo, const i64 *m, const i64 *qshift, const double *f, i64 pstep, REQUANT_BOUNDS
#define OUTQ OutQ{zo, m, qshift, f, pstep, lo, hi, rounding}

// a' = a + off as int8, (rows, k) -> (rows, kpad), zeros past k; 32-bit
// indices below 2**31 elements, and no division where nothing is padded.
template <typename I, typename T>
__device__ __forceinline__ void to_s8_as(const T* __restrict__ a, I k, I kpad, I total, int off,
                                         signed char* __restrict__ out) {
    for (I idx = (I)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (I)blockDim.x * gridDim.x) {
        if (k == kpad) {
            out[idx] = (signed char)((int)a[idx] + off);
        } else {
            const I r = idx / kpad, c = idx - r * kpad;
            out[idx] = c < k ? (signed char)((int)a[r * k + c] + off) : (signed char)0;
        }
    }
}
template <typename T>
__device__ void to_s8_body(const T* a, i64 rows, i64 k, i64 kpad, int off, signed char* out) {
    if (rows * kpad < ((i64)1 << 31))
        to_s8_as<unsigned>(a, (unsigned)k, (unsigned)kpad, (unsigned)(rows * kpad), off, out);
    else
        to_s8_as<unsigned long long>(a, (unsigned long long)k, (unsigned long long)kpad,
                                     (unsigned long long)(rows * kpad), off, out);
}

// out[r, n] = q(terms(raw[r, n])), raw rows `ld` apart, out (rows, cols);
// 32-bit indices (a 32-bit divide an element) below 2**31 elements.
template <typename I, typename TRaw, typename TOut>
__device__ __forceinline__ void epilogue_as(const TRaw* __restrict__ raw, I ld, I total, I cols, GemmTerms t, OutQ q,
                                            TOut* __restrict__ out) {
    for (I idx = (I)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (I)blockDim.x * gridDim.x) {
        const I r = idx / cols, n = idx - r * cols;
        out[idx] = (TOut)q(t((i64)raw[r * ld + n], r, n), n);
    }
}
template <typename TRaw, typename TOut>
__device__ void epilogue_body(const TRaw* raw, i64 ld, i64 rows, i64 cols, GemmTerms t, OutQ q, TOut* out) {
    if (rows * ld < ((i64)1 << 31))
        epilogue_as<unsigned>(raw, (unsigned)ld, (unsigned)(rows * cols), (unsigned)cols, t, q, out);
    else
        epilogue_as<unsigned long long>(raw, (unsigned long long)ld, (unsigned long long)(rows * cols),
                                        (unsigned long long)cols, t, q, out);
}

// Four int8 products summed into c; as the __dp4a intrinsic (sm_61 and later).
__device__ __forceinline__ int qa_dp4a(int a, int b, int c) { return __dp4a(a, b, c); }

// 16 bytes of weights against the a' values they meet (x: one int4 of a' for
// int8 weights, two for 4-bit): int8 weights are 16 values; 4-bit weights are
// 32, each 32-bit word holding k..k+3 in its low nibbles and k+4..k+7 in its
// high nibbles, offset by 8 (u = w' + 8 in 0..15): the 8 * sum(a') that adds
// is taken off by the caller.
template <int BITS>
__device__ __forceinline__ int qa_dot16(const int4* x, int4 w, int acc) {
    const int wv[4] = {w.x, w.y, w.z, w.w};
    if (BITS == 8) {
        const int av[4] = {x[0].x, x[0].y, x[0].z, x[0].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) acc = qa_dp4a(av[j], wv[j], acc);
    } else {
        const int av[8] = {x[0].x, x[0].y, x[0].z, x[0].w, x[1].x, x[1].y, x[1].z, x[1].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc = qa_dp4a(av[2 * j], wv[j] & 0x0F0F0F0F, acc);
            acc = qa_dp4a(av[2 * j + 1], (int)(((unsigned)wv[j] >> 4) & 0x0F0F0F0Fu), acc);
        }
    }
    return acc;
}

// out[r, n] for r < rows <= MT: one warp per GEMV_COLS columns reads their
// weights once, 16 bytes a lane and column (a warp: 512 contiguous bytes a
// column), each row of a' (rows kpad apart, kpad a multiple of 32 values) loaded
// once for all GEMV_COLS columns; the lanes' int32 sums (each of at most kpad / 32
// products: the backend keeps that within int32) meet in int64, then the
// epilogue. The packed weights have a multiple of 4 rows: no column is read
// out of bounds.
#define GEMV_COLS 4
template <int BITS, int MT>
__device__ void gemv_body(const signed char* __restrict__ a, i64 rows, i64 kpad, const int4* __restrict__ w, i64 cols,
                          GemmTerms t, OutQ q, int kind, void* out) {
    constexpr int V = BITS == 8 ? 1 : 2;  // int4s of a' against 16 bytes of weights
    const i64 vals = 128 / BITS;           // values in 16 bytes of weights
    const i64 chunks = kpad / vals;        // 16-byte chunks in a column
    const unsigned lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5, groups = (cols + GEMV_COLS - 1) / GEMV_COLS;
    for (i64 g = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; g < groups; g += warps) {
        const i64 n0 = g * GEMV_COLS;
        int acc[MT][GEMV_COLS];
#pragma unroll
        for (int r = 0; r < MT; ++r)
#pragma unroll
            for (int j = 0; j < GEMV_COLS; ++j) acc[r][j] = 0;
        for (i64 c = lane; c < chunks; c += 32) {
            int4 wc[GEMV_COLS];
#pragma unroll
            for (int j = 0; j < GEMV_COLS; ++j) wc[j] = w[(n0 + j) * chunks + c];
#pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (r >= rows) break;
                int4 x[V];
#pragma unroll
                for (int v = 0; v < V; ++v) x[v] = reinterpret_cast<const int4*>(a + r * kpad + c * vals)[v];
#pragma unroll
                for (int j = 0; j < GEMV_COLS; ++j) acc[r][j] = qa_dot16<BITS>(x, wc[j], acc[r][j]);
            }
        }
#pragma unroll
        for (int r = 0; r < MT; ++r) {
            if (r >= rows) break;  // warp-uniform
#pragma unroll
            for (int j = 0; j < GEMV_COLS; ++j) {
                i64 s = acc[r][j];
                for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
                if (lane == 0 && n0 + j < cols) {
                    if (BITS == 4) s -= 8 * t.rowsum[r];  // the offset of the nibbles (t.rstep is 1 here)
                    qa_store(out, kind, r * cols + n0 + j, q(t(s, r, n0 + j), n0 + j));
                }
            }
        }
    }
}

// im2col of channels-last xpad (N, Hp, Wp, C): row (n, i, j), column (p, q, c)
// of out (N * OH * OW, kh * kw * C) is xpad[n, i*sh + p*dh, j*sw + q*dw, c];
// one thread copies the C codes of one (row, tap).
template <typename T>
__device__ void im2col_body(const T* x, i64 hp, i64 wp, i64 c, i64 oh, i64 ow, i64 kh, i64 kw, i64 sh, i64 sw,
                            i64 dh, i64 dw, i64 total, T* out) {
    QA_GRID_STRIDE(idx, total) {  // total = N * OH * OW * kh * kw
        const i64 tap = idx % (kh * kw), row = idx / (kh * kw);
        const i64 j = row % ow, i = (row / ow) % oh, n = row / (ow * oh);
        const i64 p = tap / kw, q = tap % kw;
        const T* src = x + ((n * hp + i * sh + p * dh) * wp + j * sw + q * dw) * c;
        T* dst = out + idx * c;
        for (i64 k = 0; k < c; ++k) dst[k] = src[k];
    }
}

// Grouped conv, NCHW: out[n, o, i, j] = q(sum over the taps of o's group of
// (xpad - za) * wc + bias[o]) with wc the centred weights (O, cg, kh, kw),
// exact in int64; one thread per output.
template <typename T, typename TOut>
__device__ void conv_grouped_body(const T* x, i64 za, const int* wc, i64 c, i64 hp, i64 wp, i64 o_n, i64 cg,
                                  i64 kh, i64 kw, i64 oh, i64 ow, i64 sh, i64 sw, i64 dh, i64 dw, const i64* bias,
                                  i64 bstep, OutQ q, i64 total, TOut* out) {
    const i64 og = o_n / (c / cg);  // output channels per group
    QA_GRID_STRIDE(idx, total) {
        const i64 j = idx % ow, i = (idx / ow) % oh, o = (idx / (ow * oh)) % o_n, n = idx / (ow * oh * o_n);
        const T* xg = x + (n * c + (o / og) * cg) * hp * wp + (i * sh) * wp + j * sw;
        const int* wo = wc + o * cg * kh * kw;
        i64 acc = 0;
        for (i64 ch = 0; ch < cg; ++ch)
            for (i64 p = 0; p < kh; ++p)
                for (i64 r = 0; r < kw; ++r)
                    acc += ((i64)xg[(ch * hp + p * dh) * wp + r * dw] - za) * wo[(ch * kh + p) * kw + r];
        out[idx] = (TOut)q(acc + bias[o * bstep], o);
    }
}

#define TO_S8(NAME, T)                                                                                    \
    extern "C" __global__ void to_s8_##NAME(const T* a, i64 rows, i64 k, i64 kpad, int off, signed char* out) { \
        to_s8_body<T>(a, rows, k, kpad, off, out);                                                         \
    }
TO_S8(int8, signed char)
TO_S8(uint8, unsigned char)

#define EPILOGUE(RAW, TRAW, OUT, TOUT)                                                                     \
    extern "C" __global__ void gemm_epilogue_##RAW##_##OUT(const TRAW* raw, i64 ld, i64 rows, i64 cols,    \
                                                           GEMM_TERMS_ARGS, OUTQ_ARGS, TOUT* out) {        \
        epilogue_body<TRAW, TOUT>(raw, ld, rows, cols, GEMM_TERMS, OUTQ, out);                             \
    }
// gemv<BITS>_<MT>: one kernel for every output dtype (`kind`, as qa_store).
#define GEMV(BITS, MT)                                                                                          \
    extern "C" __global__ void gemv##BITS##_##MT(const signed char* a, i64 rows, i64 kpad, const int4* w,       \
                                                 i64 cols, GEMM_TERMS_ARGS, OUTQ_ARGS, int kind, void* out) {  \
        gemv_body<BITS, MT>(a, rows, kpad, w, cols, GEMM_TERMS, OUTQ, kind, out);                               \
    }
GEMV(8, 1)
GEMV(8, 4)
GEMV(8, 16)
GEMV(4, 1)
GEMV(4, 4)
GEMV(4, 16)
QA_PER_INT(EPILOGUE, int32, int)
QA_PER_INT(EPILOGUE, int64, long long)

#define IM2COL(NAME, T)                                                                                     \
    extern "C" __global__ void im2col_##NAME(const T* x, i64 hp, i64 wp, i64 c, i64 oh, i64 ow, i64 kh,    \
                                             i64 kw, i64 sh, i64 sw, i64 dh, i64 dw, i64 total, T* out) {  \
        im2col_body<T>(x, hp, wp, c, oh, ow, kh, kw, sh, sw, dh, dw, total, out);                          \
    }
IM2COL(int8, signed char)
IM2COL(uint8, unsigned char)

#define CONV_GROUPED(IN, T, OUT, TOUT)                                                                      \
    extern "C" __global__ void conv_grouped_##IN##_##OUT(                                                   \
        const T* x, i64 za, const int* wc, i64 c, i64 hp, i64 wp, i64 o_n, i64 cg, i64 kh, i64 kw, i64 oh, \
        i64 ow, i64 sh, i64 sw, i64 dh, i64 dw, const i64* bias, i64 bstep, OUTQ_ARGS, i64 total, TOUT* out) { \
        conv_grouped_body<T, TOUT>(x, za, wc, c, hp, wp, o_n, cg, kh, kw, oh, ow, sh, sw, dh, dw, bias, bstep, \
                                   OUTQ, total, out);                                                       \
    }
QA_PER_INT(CONV_GROUPED, int8, signed char)
QA_PER_INT(CONV_GROUPED, uint8, unsigned char)
QA_PER_INT(CONV_GROUPED, int16, short)
QA_PER_INT(CONV_GROUPED, uint16, unsigned short)
