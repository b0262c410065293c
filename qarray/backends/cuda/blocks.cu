// linear on block-format weights (GGUF's Q4_0 ... Q6_K, IQ4_NL, MXFP4, NVFP4, the grouped formats
// int4_g128_f16 and the like) and their dequantize, read from the blocks' bytes on the device:
// qarray/ops/block_linear.py's two contracts, bit for bit as the NumPy backend.
//
// One decoder reads every format from its description (qarray._blocks.BlockFormat), which
// CupyBackend hands over as a plan (qarray/backends/_cuda.py block_plan): for each field, where
// each of its values' bits lie in a block (the runs of Field.segments, value by value), how its
// bits read (unsigned, float16, bfloat16, float32), and the format's tables. An element is
//
//     y = rounded(scale * (value[code] - zero)) [* factor, rounded] [+ offset, rounded]
//
// with scale = d * table[sc] (the K-quants' two levels), divided or multiplied by the tensor's
// scale (NVFP4), offset likewise, each operation in float32 and rounded to the format's
// precision, as BlockFormat.decode. The IQ lattices and TQ1_0, whose values come from
// functions, are decoded on the host (CupyBackend falls back to the generic code for them).
//
// The kernels:
// - block_decode_<out>: dequantize (and the weights of block_gemm), a thread per group of
//   consecutive elements of one sub-block (their parameters decoded once);
// - block_gemv: float activations, M <= 16 (a token or a few): a block of threads owns GV_N
//   outputs n and every row m, decodes its weights GV_K k at a time into shared memory and each
//   output sums over k in increasing order in float64, the next chunk decoded while this one is
//   summed;
// - block_gemm: float activations for prompts, dequantize-then-GEMM: the weights decoded to
//   float32 once (block_decode), then a tiled float64 GEMM in which every thread accumulates its
//   4 x 4 outputs in increasing k;
// - block_gemv_q8: Q8_0 activations: the integer sums of the pieces (exact in any order) in
//   parallel, then each output's float64 terms in piece order.
// Work is split over n and m, never over k: no sum depends on the grid.
#include "common.cuh"

// -- x86's NaN results ------------------------------------------------------------------------------
// NumPy's results carry x86's NaNs: an operation with a NaN operand gives the first NaN operand,
// quieted (sign and payload kept); one that makes a NaN (inf - inf, 0 * inf) gives the default
// NaN, negative. The device's arithmetic gives one NaN without sign or payload. So every float
// operation here puts a NaN result right (qa_x86), except the sums' inner loops, where a chunk
// that turned a sum NaN is run again that way (qa_first_nan). The host build gives the device's
// NaN (qa_dev), so a NaN left unmended shows in the tests.
template <typename T> __device__ __forceinline__ T qa_quiet(T a) {
    return qa_from_bits(qa_bits(a) | ((typename QaBits<T>::U)1 << (QaBits<T>::M - 1)));
}
template <typename T> __device__ __forceinline__ T qa_x86(T r, T a, T b) {
    return !qa_isnan(r) ? r : qa_isnan(a) ? qa_quiet(a) : qa_isnan(b) ? qa_quiet(b) : qa_nan<T>(true);
}
#ifdef __CUDA_ARCH__
template <typename T> __device__ __forceinline__ T qa_dev(T r) { return r; }
#else
template <typename T> T qa_dev(T r) {  // the device's NaN: all ones but the sign
    typedef typename QaBits<T>::U U;
    return qa_isnan(r) ? qa_from_bits(~((U)1 << (QaBits<T>::E + QaBits<T>::M))) : r;
}
#endif
__device__ __forceinline__ float qa_fmul(float a, float b) { return qa_x86(qa_dev(qa_mul(a, b)), a, b); }
__device__ __forceinline__ float qa_fdiv(float a, float b) { return qa_x86(qa_dev(qa_div(a, b)), a, b); }
__device__ __forceinline__ float qa_fadd(float a, float b) { return qa_x86(qa_dev(qa_add(a, b)), a, b); }
__device__ __forceinline__ float qa_fsub(float a, float b) { return qa_x86(qa_dev(qa_sub(a, b)), a, b); }
__device__ __forceinline__ double qa_dmul(double a, double b) { return qa_x86(qa_dev(__dmul_rn(a, b)), a, b); }
__device__ __forceinline__ double qa_dadd(double a, double b) { return qa_x86(qa_dev(__dadd_rn(a, b)), a, b); }
// a * b + c rounded once, NaN the device's: the sums' inner loops, where a * b (float32 values) is
// exact, so the fused add rounds as the add alone
__device__ __forceinline__ double qa_dfma(double a, double b, double c) { return qa_dev(__fma_rn(a, b, c)); }

// float32 -> float64 exactly, a NaN as cvtss2sd (payload kept, quieted)
__device__ __forceinline__ double qa_widen(float v) {
    const unsigned u = qa_bits(v);
    if (qa_isnan(v))
        return qa_from_bits((unsigned long long)(u >> 31) << 63 | 0x7FF8000000000000ull | (unsigned long long)(u & 0x7FFFFFu) << 29);
    return qa_to_double(v);
}
// float64 -> float32 to nearest even, a NaN as cvtsd2ss (its payload's top bits, quieted)
__device__ __forceinline__ float qa_narrow(double v) {
    const unsigned long long u = qa_bits(v);
    if (qa_isnan(v)) return qa_from_bits((unsigned)(u >> 63) << 31 | 0x7FC00000u | (unsigned)(u >> 29 & 0x3FFFFFu));
    return qa_to_float(v);
}
// float16 bits -> float32 exactly; a NaN's payload moves up, unquieted, as NumPy widens it (the
// multiply that always follows quiets it, as x86's does)
__device__ __forceinline__ float qa_from_half(unsigned h) {
    if ((h & 0x7FFFu) > 0x7C00u) return qa_from_bits((h >> 15) << 31 | 0x7F800000u | (h & 0x3FFu) << 13);
    return qa_float(qa_half{(unsigned short)h});
}
// float32 -> float16 as NumPy's astype: to nearest even, inf beyond; a NaN keeps sign and top bits
__device__ __forceinline__ qa_half qa_half_of(float v) {
    const unsigned u = qa_bits(v);
    if (qa_isnan(v)) return qa_half{(unsigned short)((u >> 16 & 0x8000u) | 0x7C00u | ((u & 0x7FFFFFu) >> 13 ? (u & 0x7FFFFFu) >> 13 : 1u))};
    return qa_to_half(v);
}
__device__ __forceinline__ void qa_put(float* out, i64 i, float v) { out[i] = v; }
__device__ __forceinline__ void qa_put(double* out, i64 i, float v) { out[i] = qa_widen(v); }
__device__ __forceinline__ void qa_put(qa_half* out, i64 i, float v) { out[i] = qa_half_of(v); }

// y rounded to the format's precision (0 float32, 1 float16, 2 bfloat16: to nearest even),
// as qarray._blocks.rounded; NaN as it is (its payload's low bits are 0 wherever a decoder meets one)
__device__ __forceinline__ float qa_rounded(float y, int precision) {
    if (precision == 0 || qa_isnan(y)) return y;
    if (precision == 1) return qa_float(qa_to_half(y));
    const unsigned u = qa_bits(y);
    return qa_from_bits((u + 0x7FFFu + (u >> 16 & 1u)) & 0xFFFF0000u);
}

// -- the plan ------------------------------------------------------------------------------------
// A field: value i of a block is the OR of its R runs, each `width` bits of byte `byte` from bit
// `shift`, moved up by `value shift`: runs[i * R + r] = byte << 12 | value shift << 7 | width << 3 | shift.
struct QaField {
    const int* runs;
    int R, count, kind;  // R 0: no such field; kind: 0 unsigned, 1 float16, 2 bfloat16, 3 float32
    __device__ unsigned bits(const unsigned char* blk, int i) const {
        unsigned u = 0;
        for (int r = 0; r < R; ++r) {
            const int c = runs[i * R + r];
            u |= ((unsigned)blk[c >> 12] >> (c & 7) & ((1u << (c >> 3 & 15)) - 1)) << (c >> 7 & 31);
        }
        return u;
    }
    __device__ unsigned at(const unsigned char* blk, int j) const { return bits(blk, count > 1 ? j : 0); }
    __device__ float value(const unsigned char* blk, int j) const {
        const unsigned u = at(blk, j);
        return kind == 0 ? (float)u : kind == 1 ? qa_from_half(u) : qa_from_bits(kind == 2 ? u << 16 : u);
    }
};

// qarray/backends/_cuda.py block_plan, in its order.
struct QaPlan {
    int block, nbytes, sub, precision, tensor, osign, has_factor, group;
    QaField q, sbase, ssub, obase, osub, zero;
    const float *values, *stable, *otable;
    float factor;
    const int* ivalues;
    __device__ QaField field(const int* p, int slot) const {
        const int* f = p + 8 + 4 * slot;
        return QaField{p + f[0], f[1], f[2], f[3]};
    }
    __device__ QaPlan(const int* p, const float* t) {
        block = p[0], nbytes = p[1], sub = p[2], precision = p[3], tensor = p[4], osign = p[5], has_factor = p[6];
        group = p[7];
        q = field(p, 0), sbase = field(p, 1), ssub = field(p, 2), obase = field(p, 3), osub = field(p, 4);
        zero = field(p, 5);
        values = t + p[32], stable = t + p[33], otable = t + p[34], factor = t[p[35]];
        ivalues = p[36] < 0 ? nullptr : p + p[36];
    }
};

// d * table[sc], d alone or table[sc] alone, for sub-block j (BlockFormat._product)
__device__ __forceinline__ float qa_product(const unsigned char* blk, const QaField& base, const QaField& sub,
                                            const float* table, int j) {
    const float t = sub.R ? table[sub.at(blk, j)] : 0.0f;
    if (!base.R) return t;
    const float d = base.value(blk, j);
    return sub.R ? qa_fmul(d, t) : d;
}

// Sub-block j's scale (tensor scale applied), offset (sign applied; 0 where none) and zero point
// (float32; 0 where none), as BlockFormat.parameters.
struct QaSub {
    float s, o, z;
};
__device__ __forceinline__ QaSub qa_sub_params(const unsigned char* blk, int j, const QaPlan& P, float g) {
    QaSub r;
    r.s = qa_product(blk, P.sbase, P.ssub, P.stable, j);
    if (P.tensor) r.s = P.tensor == 1 ? qa_fdiv(r.s, g) : qa_fmul(r.s, g);
    r.o = P.osign ? qa_product(blk, P.obase, P.osub, P.otable, j) : 0.0f;
    if (P.osign < 0) r.o = qa_from_bits(qa_bits(r.o) ^ 0x80000000u);  // NumPy's negative: the sign bit
    r.z = P.zero.R ? (float)P.zero.at(blk, j) : 0.0f;
    return r;
}

// Element e of block blk, its sub-block's parameters p: w.dequantize()'s value.
__device__ __forceinline__ float qa_element(const unsigned char* blk, int e, const QaSub& p, const QaPlan& P) {
    float v = P.values[P.q.bits(blk, e)];
    if (P.zero.R) v = qa_fsub(v, p.z);
    float y = qa_rounded(qa_fmul(p.s, v), P.precision);
    if (P.has_factor) y = qa_rounded(qa_fmul(y, P.factor), P.precision);
    if (P.osign) y = qa_rounded(qa_fadd(y, p.o), P.precision);
    return y;
}

// Elements p .. p + count - 1 of a row (stored order, one sub-block), put(i, value).
template <typename Put>
__device__ __forceinline__ void qa_decode(const unsigned char* row, i64 p, int count, const QaPlan& P, float g, Put put) {
    const unsigned char* blk = row + p / P.block * P.nbytes;
    const int e = (int)(p % P.block);
    const QaSub s = qa_sub_params(blk, e / P.sub, P, g);
    for (int i = 0; i < count; ++i) put(i, qa_element(blk, e + i, s, P));
}

// -- dequantize ----------------------------------------------------------------------------------
// Rows of blocks raw (rows x row_len elements) into out, element p of a row at dest[p] (act-order's
// logical column) where given; a thread per group of P.group elements.
template <typename T>
__device__ void block_decode_body(const unsigned char* raw, const int* plan, const float* tables, float g, i64 total,
                                  i64 row_len, const i64* dest, int has_dest, T* out) {
    const QaPlan P(plan, tables);
    const i64 row_bytes = row_len / P.block * P.nbytes, groups = total / P.group;
    QA_GRID_STRIDE(gi, groups) {
        const i64 el = gi * P.group, row = el / row_len, p = el % row_len;
        T* o = out + row * row_len;
        qa_decode(raw + row * row_bytes, p, P.group, P, g,
                  [&](int i, float v) { qa_put(o, has_dest ? dest[p + i] : p + i, v); });
    }
}
#define BLOCK_DECODE(OUT, T)                                                                                      \
    extern "C" __global__ void block_decode_##OUT(const unsigned char* raw, const int* plan, const float* tables,  \
                                                  float g, i64 total, i64 row_len, const i64* dest, int has_dest, \
                                                  T* out) {                                                       \
        block_decode_body<T>(raw, plan, tables, g, total, row_len, dest, has_dest, out);                         \
    }
BLOCK_DECODE(float16, qa_half)
BLOCK_DECODE(float32, float)
BLOCK_DECODE(float64, double)

// -- float activations -------------------------------------------------------------------------------

// The x86 result of acc += x[k] * w[k] over a chunk, run again where the fast loop turned acc NaN:
// the first NaN it met (an operand's, or the default one of inf - inf or 0 * inf) stays.
__device__ double qa_first_nan(double acc, const double* x, int xstride, const float* w, int wstride, int count) {
    for (int k = 0; k < count && !qa_isnan(acc); ++k) acc = qa_dadd(acc, qa_dmul(x[k * xstride], qa_widen(w[k * wstride])));
    return acc;
}
// acc after a chunk that started at `start`: the fast loop's, or where it is NaN the x86 one
__device__ __forceinline__ double qa_mend(double acc, double start, const double* x, int xstride, const float* w,
                                          int wstride, int count) {
    return !qa_isnan(acc) ? acc : qa_isnan(start) ? start : qa_first_nan(start, x, xstride, w, wstride, count);
}
// out[m, n] = float32(acc (+ bias[n])), the bias added last in float64
__device__ __forceinline__ void qa_put_sum(float* out, i64 N, i64 m, i64 n, double acc, const double* bias, int has_bias) {
    out[m * N + n] = qa_narrow(has_bias ? qa_dadd(acc, bias[n]) : acc);
}

#define GV_N 32  // outputs n a block of block_gemv
#define GV_M 16  // rows m it takes, at most
#define GV_K 64  // k a chunk
#define GV_OUT (GV_N * GV_M / 256)  // outputs a thread (of 256)

// out (M x N) = x (M x K, float64, M <= GV_M) . w^T + bias, w the N rows of blocks raw; k in the
// order perm gives (act-order: the stored column of logical k), else stored order.
extern "C" __global__ void block_gemv(const double* x, i64 M, i64 K, const unsigned char* raw, i64 N, const int* plan,
                                      const float* tables, float g, const i64* perm, int has_perm, const double* bias,
                                      int has_bias, float* out) {
    __shared__ float ws[2][GV_K][GV_N + 1];  // [buffer][k][n]: the chunk's weights, side by side
    __shared__ double xs[2][GV_M][GV_K];
    const QaPlan P(plan, tables);
    const i64 n0 = (i64)blockIdx.x * GV_N, row_bytes = K / P.block * P.nbytes;
    const int ncols = N - n0 < GV_N ? (int)(N - n0) : GV_N, mrows = (int)M, G = has_perm ? 1 : P.group, t = threadIdx.x;
    auto load = [&](int buf, i64 k0) {
        for (int i = t; i < GV_N * GV_K / G; i += blockDim.x) {
            const int nl = i / (GV_K / G), kk = i % (GV_K / G) * G;
            if (nl < ncols && k0 + kk < K)
                qa_decode(raw + (n0 + nl) * row_bytes, has_perm ? perm[k0 + kk] : k0 + kk, G, P, g,
                          [&](int j, float v) { ws[buf][kk + j][nl] = v; });
        }
        for (int i = t; i < mrows * GV_K; i += blockDim.x) {
            const int m = i / GV_K, kk = i % GV_K;
            if (k0 + kk < K) xs[buf][m][kk] = x[m * K + k0 + kk];
        }
    };
    double acc[GV_OUT];
#pragma unroll
    for (int j = 0; j < GV_OUT; ++j) acc[j] = 0.0;
    load(0, 0);
    __syncthreads();
    for (i64 k0 = 0, c = 0; k0 < K; k0 += GV_K, ++c) {
        const int buf = (int)(c & 1), count = K - k0 < GV_K ? (int)(K - k0) : GV_K;
        if (k0 + GV_K < K) load(buf ^ 1, k0 + GV_K);  // the next chunk, while this one is summed
#pragma unroll
        for (int j = 0; j < GV_OUT; ++j) {
            const int o = t + j * 256, m = o / GV_N, nl = o % GV_N;
            if (m >= mrows || nl >= ncols) continue;
            const double start = acc[j];
            double a = start;
            for (int kk = 0; kk < count; ++kk) a = qa_dfma(xs[buf][m][kk], qa_widen(ws[buf][kk][nl]), a);
            acc[j] = qa_mend(a, start, &xs[buf][m][0], 1, &ws[buf][0][nl], GV_N + 1, count);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < GV_OUT; ++j) {
        const int o = t + j * 256, m = o / GV_N, nl = o % GV_N;
        if (m < mrows && nl < ncols) qa_put_sum(out, N, m, n0 + nl, acc[j], bias, has_bias);
    }
}

#define GM_T 64  // outputs a block of block_gemm: GM_T x GM_T, 4 x 4 a thread (of 256)
#define GM_K 16  // k a tile

// out (M x N) = x (M x K, float64) . w^T + bias, w float32 (N x K): the dequantized weights.
extern "C" __global__ void block_gemm(const double* x, i64 M, i64 K, const float* w, i64 N, const double* bias,
                                      int has_bias, float* out) {
    __shared__ double xs[GM_K][GM_T + 1];  // [k][m]
    __shared__ float ws[GM_K][GM_T + 1];   // [k][n]
    const i64 tiles_n = (N + GM_T - 1) / GM_T;
    const i64 m0 = (i64)blockIdx.x / tiles_n * GM_T, n0 = (i64)blockIdx.x % tiles_n * GM_T;
    const int t = threadIdx.x, tm = t / 16, tn = t % 16;  // rows tm + 16 i, columns tn + 16 j
    double acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0;
    for (i64 k0 = 0; k0 < K; k0 += GM_K) {
        const int count = K - k0 < GM_K ? (int)(K - k0) : GM_K;
        for (int i = t; i < GM_T * GM_K; i += blockDim.x) {
            const int r = i / GM_K, kk = i % GM_K;
            const bool in_k = kk < count;
            xs[kk][r] = in_k && m0 + r < M ? x[(m0 + r) * K + k0 + kk] : 0.0;
            ws[kk][r] = in_k && n0 + r < N ? w[(n0 + r) * K + k0 + kk] : 0.0f;
        }
        __syncthreads();
        double start[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) start[i][j] = acc[i][j];
        for (int kk = 0; kk < count; ++kk) {
            double a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][tm + 16 * i], b[i] = qa_widen(ws[kk][tn + 16 * i]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = qa_dfma(a[i], b[j], acc[i][j]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                acc[i][j] = qa_mend(acc[i][j], start[i][j], &xs[0][tm + 16 * i], GM_T + 1, &ws[0][tn + 16 * j], GM_T + 1, count);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (m0 + tm + 16 * i < M && n0 + tn + 16 * j < N)
                qa_put_sum(out, N, m0 + tm + 16 * i, n0 + tn + 16 * j, acc[i][j], bias, has_bias);
}

// -- Q8_0 activations --------------------------------------------------------------------------------
#define GQ_K 64  // k a chunk of block_gemv_q8 (GV_N outputs n, GV_M rows m a block; pieces of 8 k or more)
typedef signed char qa_i8;

// out (M x N): xraw the M rows of Q8_0 blocks (K / 32 of 34 bytes: a float16 scale dx, 32 int8
// codes), raw the N rows of weight blocks of integer values v = value[code] - zero, scale s and
// offset o by sub-block; per piece of `piece` k (the smaller of 32 and the sub-block):
//     term = dx * s * isum + dx * o * xsum  (isum = sum qx * v, xsum = sum qx: exact integers)
// summed in piece order in float64, then the bias; the offset's term only where there is one.
extern "C" __global__ void block_gemv_q8(const unsigned char* xraw, i64 M, i64 K, const unsigned char* raw, i64 N,
                                         const int* plan, const float* tables, const double* bias, int has_bias,
                                         float* out) {
    __shared__ int vs[GV_N][GQ_K + 1];  // [n][k]: the chunk's integer values
    __shared__ qa_i8 qs[GV_M][GQ_K];
    __shared__ double ds[GV_M][GQ_K / 32];
    __shared__ float ss[GQ_K / 8][GV_N], os[GQ_K / 8][GV_N];  // [piece][n]
    __shared__ int isum[GV_M][GQ_K / 8][GV_N], xsum[GV_M][GQ_K / 8];
    const QaPlan P(plan, tables);
    const i64 tiles_n = (N + GV_N - 1) / GV_N;
    const i64 m0 = (i64)blockIdx.x / tiles_n * GV_M, n0 = (i64)blockIdx.x % tiles_n * GV_N;
    const i64 row_bytes = K / P.block * P.nbytes, xrow = K / 32 * 34;
    const int ncols = N - n0 < GV_N ? (int)(N - n0) : GV_N, mrows = M - m0 < GV_M ? (int)(M - m0) : GV_M;
    const int piece = P.sub < 32 ? P.sub : 32, G = P.group, t = threadIdx.x;
    double acc[GV_OUT];
#pragma unroll
    for (int j = 0; j < GV_OUT; ++j) acc[j] = 0.0;
    for (i64 k0 = 0; k0 < K; k0 += GQ_K) {
        const int count = K - k0 < GQ_K ? (int)(K - k0) : GQ_K;  // a multiple of 32
        for (int i = t; i < GV_N * GQ_K / G; i += blockDim.x) {
            const int nl = i / (GQ_K / G), kk = i % (GQ_K / G) * G;
            if (nl >= ncols || kk >= count) continue;
            const unsigned char* blk = raw + (n0 + nl) * row_bytes + (k0 + kk) / P.block * P.nbytes;
            const int e = (int)((k0 + kk) % P.block), j = e / P.sub;
            const int z = P.zero.R ? (int)P.zero.at(blk, j) : 0;
            for (int u = 0; u < G; ++u) vs[nl][kk + u] = P.ivalues[P.q.bits(blk, e + u)] - z;
            if (kk % piece == 0) {
                const QaSub p = qa_sub_params(blk, j, P, 0.0f);
                ss[kk / piece][nl] = p.s, os[kk / piece][nl] = p.o;
            }
        }
        for (int i = t; i < mrows * count; i += blockDim.x) {
            const int m = i / count, kk = i % count;
            const unsigned char* b = xraw + (m0 + m) * xrow + (k0 + kk) / 32 * 34;
            qs[m][kk] = (qa_i8)b[2 + kk % 32];
            if (kk % 32 == 0) ds[m][kk / 32] = qa_widen(qa_from_half(b[0] | (unsigned)b[1] << 8));
        }
        __syncthreads();
        const int np = count / piece;
        for (int i = t; i < mrows * np * GV_N; i += blockDim.x) {  // n fastest: vs's rows in different banks
            const int nl = i % GV_N, p = i / GV_N % np, m = i / (GV_N * np);
            int s = 0;
            for (int k = p * piece; k < p * piece + piece; ++k) s += (int)qs[m][k] * vs[nl][k];
            isum[m][p][nl] = s;
        }
        for (int i = t; i < mrows * np; i += blockDim.x) {
            const int p = i % np, m = i / np;
            int s = 0;
            for (int k = p * piece; k < p * piece + piece; ++k) s += qs[m][k];
            xsum[m][p] = s;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < GV_OUT; ++j) {
            const int o = t + j * 256, m = o / GV_N, nl = o % GV_N;
            if (m >= mrows || nl >= ncols) continue;
            double a = acc[j];
            for (int p = 0; p < np; ++p) {
                const double d = ds[m][p * piece / 32];
                double term = qa_dmul(qa_dmul(d, qa_widen(ss[p][nl])), (double)isum[m][p][nl]);
                if (P.osign) term = qa_dadd(term, qa_dmul(qa_dmul(d, qa_widen(os[p][nl])), (double)xsum[m][p]));
                a = qa_dadd(a, term);
            }
            acc[j] = a;
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < GV_OUT; ++j) {
        const int o = t + j * 256, m = o / GV_N, nl = o % GV_N;
        if (m < mrows && nl < ncols) qa_put_sum(out, N, m0 + m, n0 + nl, acc[j], bias, has_bias);
    }
}
