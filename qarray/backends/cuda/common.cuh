// Shared device helpers for qarray's CUDA kernels.
//
// Every kernel sees its data as (outer, n, inner) and its parameters as
// (outer or 1, blocks, inner or 1), exactly as the CPU kernels do (see
// qarray/_params.py Layout, whose ints these are); Layout turns a flat index into the
// parameter slot. The integer rescale is a line-for-line port of
// qarray/_fixed_point.py rescale, so both backends give the same integers.
#pragma once

typedef long long i64;

struct Layout {
    i64 n, inner;        // data shape (outer, n, inner), outer implied
    i64 blocks, pinner;  // parameter shape (outer or 1, blocks, pinner)
    i64 pouter_on;       // 1 when parameters vary along outer
    __device__ i64 slot(i64 idx, const i64* bidx) const {
        i64 i = idx % inner;
        i64 rest = idx / inner;
        i64 l = rest % n;
        i64 o = rest / n;
        return (o * pouter_on * blocks + bidx[l]) * pinner + (pinner > 1 ? i : 0);
    }
};

// A kernel's Layout parameters, as CupyBackend passes them, and the Layout.
#define LAYOUT_ARGS i64 n, i64 inner, i64 blocks, i64 pinner, i64 pouter_on
#define LAYOUT Layout{n, inner, blocks, pinner, pouter_on}

// Rounding codes, as qarray._fixed_point.
#define QA_HALF_EVEN 0
#define QA_HALF_AWAY 1
#define QA_HALF_UP 2
#define QA_TFLITE 3
#define QA_FLOAT -1
#define QA_IDENTITY -2

// d * m / 2**s rounded, exactly: d * m (up to 94 bits) is h * 2**32 + l from
// two 64-bit products. A line-for-line port of qarray/_fixed_point.py rescale;
// shifts of negative values go through unsigned (defined in C++17).
__device__ __forceinline__ i64 qa_shl(i64 v, i64 n) { return (i64)((unsigned long long)v << n); }

// d * m / 2**s == (h * 2**32 + l) / 2**(t + 32) with 0 <= l < 2**32, t >= 0
// (qarray/_fixed_point.py wide): a multiplier >= 1/2 (s < 32) saturates |d| at
// 2**(s + 30), then shifts d left so that the shift is 32 + t; x * m from two
// products below 2**63.
__device__ __forceinline__ void qa_wide(i64 d, i64 m, i64 s, i64& h, i64& l, i64& t) {
    const i64 one = 1, m31 = (one << 31) - 1, m32 = (one << 32) - 1;
    const bool lt = s < 32;
    const i64 u = lt ? 32 - s : 0;
    t = s + u - 32;
    const i64 mm = m & m31;
    const i64 b = one << (lt ? s + 30 : 0);
    const i64 x = qa_shl(lt ? (d > b ? b : (d < -b ? -b : d)) : d, u);
    const i64 lo = (x & m32) * mm;
    h = (x >> 32) * mm + (lo >> 32);
    l = lo & m32;
}

// d * m / 2**s rounded down or up, up when the random word r is below its
// fraction times 2**32, compared exactly: r < ceil(rem / 2**t) for the
// remainder rem = (h mod 2**t) * 2**32 + l (qarray/_fixed_point.py
// rescale_stochastic)
__device__ __forceinline__ i64 qa_rescale_stochastic(i64 d, i64 m, i64 s, unsigned r) {
    const i64 one = 1;
    i64 h, l, t;
    qa_wide(d, m, s, h, l, t);
    const i64 a = t > 32 ? 32 : t, b = t - a;
    const i64 y = ((h & ((one << t) - 1)) << (32 - a)) + (l >> a);
    const i64 below = ((l & ((one << a) - 1)) | (y & ((one << b) - 1))) != 0;
    return (h >> t) + ((i64)r < (y >> b) + below);
}

__device__ __forceinline__ i64 qa_rescale(i64 d, i64 m, i64 s, int rounding) {
    const i64 one = 1;
    if (rounding == QA_TFLITE) {
        i64 e = 31 - s;
        const i64 lo = -(one << 31), hi = (one << 31) - 1;
        i64 a = d < lo ? lo : (d > hi ? hi : d);
        a = qa_shl(a, e > 0 ? e : 0);
        a = a < lo ? lo : (a > hi ? hi : a);
        i64 ab = a * m;
        i64 y = ab + (one << 30) - (ab < 0 ? (one << 31) - 1 : 0);
        i64 x = (y + (y < 0 ? (one << 31) - 1 : 0)) >> 31;  // C division, toward zero
        i64 rs = e < 0 ? -e : 0;
        i64 mask = (one << rs) - 1;
        return (x >> rs) + (((x & mask) > ((mask >> 1) + (x < 0 ? 1 : 0))) ? 1 : 0);
    }
    // Narrow: |d| < 2**31, 0 <= m < 2**31 and 1 <= s <= 62 (add's operands and
    // output, 8- and 16-bit requantizes, most accumulators): v = d * m is one
    // 32 x 32 -> 64-bit product, |v| < 2**62, and no saturation applies (|d| <
    // 2**(s + 30)); v / 2**s rounded by the rule below, the same integer as the
    // wide path's in a handful of instructions instead of a 94-bit product.
    if (d == (i64)(int)d && (unsigned long long)m < (1ull << 31) && s >= 1 && s <= 62) {
        const i64 v = (i64)(int)d * (i64)(int)m;
        const i64 delta = rounding == QA_HALF_UP ? 0 : (rounding == QA_HALF_AWAY ? (v < 0 ? -1 : 0) : ((v >> s) & 1) - 1);
        return (v + (one << (s - 1)) + delta) >> s;
    }
    i64 h, l, t;
    qa_wide(d, m, s, h, l, t);
    // floor((h * 2**32 + l + 2**(t + 31) + delta) / 2**(t + 32)), delta in
    // {-1, 0} the tie rule's: the half and delta go into the high word, the
    // low word gives only its borrow or carry
    const i64 p = one << t;
    const i64 delta = rounding == QA_HALF_UP ? 0 : (rounding == QA_HALF_AWAY ? (h < 0 ? -1 : 0) : ((h & p) >> t) - 1);
    const i64 half_hi = p >> 1, half_lo = t == 0 ? one << 31 : 0;
    return (h + half_hi + ((l + half_lo + delta) >> 32)) >> t;
}

// One requantized value from d = q - zp_in: fixed point (rounding >= 0),
// float (QA_FLOAT, no FMA: as the CPU) or none (QA_IDENTITY), plus zo,
// saturated to [lo, hi].
__device__ __forceinline__ i64 qa_requantize(i64 d, i64 zo, i64 m, i64 sh, double f, i64 lo, i64 hi, int rounding) {
    if (rounding == QA_FLOAT) {
        double w = rint(__dadd_rn(__dmul_rn((double)d, f), (double)zo));
        return (i64)(w < (double)lo ? (double)lo : (w > (double)hi ? (double)hi : w));
    }
    i64 r = (rounding == QA_IDENTITY ? d : qa_rescale(d, m, sh, rounding)) + zo;
    return r < lo ? lo : (r > hi ? hi : r);
}

// qarray._fixed_point.Requant: out = clamp(R((v - zi) * M) + zo, lo, hi) with
// the parameters of slot p. Kernels take it as REQUANT_ARGS and build it with
// REQUANT; CupyBackend._requant_args passes them in this order.
struct Requant {
    const i64 *zi, *zo, *m, *sh;
    const double* f;
    i64 lo, hi;
    int rounding;
    __device__ i64 operator()(i64 v, i64 p) const {
        return qa_requantize(v - zi[p], zo[p], m[p], sh[p], f[p], lo, hi, rounding);
    }
};
#define REQUANT_PARAMS const i64 *zi, const i64 *zo, const i64 *m, const i64 *sh, const double *f
#define REQUANT_BOUNDS i64 lo, i64 hi, int rounding
#define REQUANT Requant{zi, zo, m, sh, f, lo, hi, rounding}

// CuPy compiles every RawModule with -ftz=true, which flushes float32
// subnormals to zero in arithmetic and comparisons; NumPy keeps them. So the
// float32 operations whose operands or results can be subnormal (x / scale,
// code * scale, the comparisons of min/max, the block formats' decoding and
// float32 <-> float64) are PTX without .ftz here. The
// float32 adds, compares and conversions left to the compiler see only
// integer values (rint results, zero points, bounds), where flushing changes
// nothing; tests/test_cuda_nvrtc.py checks CuPy's own PTX for this.
#ifdef __CUDA_ARCH__
#define QA_F32_OP(NAME, OP)                                                \
    __device__ __forceinline__ float NAME(float a, float b) {             \
        float r;                                                           \
        asm(OP ".rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));          \
        return r;                                                          \
    }
QA_F32_OP(qa_div, "div")
QA_F32_OP(qa_mul, "mul")
QA_F32_OP(qa_add, "add")
QA_F32_OP(qa_sub, "sub")
__device__ __forceinline__ bool qa_lt(float a, float b) {
    int r;
    asm("{\n\t.reg .pred p;\n\tsetp.lt.f32 p, %1, %2;\n\tselp.s32 %0, 1, 0, p;\n\t}" : "=r"(r) : "f"(a), "f"(b));
    return r;
}
// float32 <-> float64: widening is exact, narrowing rounds to nearest even; a
// float32 subnormal on either side is kept (cvt without .ftz)
__device__ __forceinline__ double qa_to_double(float a) {
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float qa_to_float(double a) {
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(a));
    return r;
}
#else
__device__ __forceinline__ float qa_div(float a, float b) { return a / b; }
__device__ __forceinline__ float qa_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float qa_add(float a, float b) { return a + b; }
__device__ __forceinline__ float qa_sub(float a, float b) { return a - b; }
__device__ __forceinline__ bool qa_lt(float a, float b) { return a < b; }
__device__ __forceinline__ double qa_to_double(float a) { return (double)a; }
__device__ __forceinline__ float qa_to_float(double a) { return (float)a; }
#endif
// float16 travels as its 16 bits; the conversions round as NumPy's (to nearest
// even) and never flush (PTX cvt without .ftz; _Float16 on the host).
struct __align__(2) qa_half {
    unsigned short bits;
};
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float qa_float(qa_half h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h.bits));
    return r;
}
__device__ __forceinline__ qa_half qa_to_half(float f) {
    qa_half r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}
#else
__device__ __forceinline__ float qa_float(qa_half h) {
    _Float16 v;
    __builtin_memcpy(&v, &h.bits, 2);
    return (float)v;
}
__device__ __forceinline__ qa_half qa_to_half(float f) {
    _Float16 v = (_Float16)f;
    qa_half r;
    __builtin_memcpy(&r.bits, &v, 2);
    return r;
}
#endif
__device__ __forceinline__ float qa_float(float f) { return f; }
__device__ __forceinline__ double qa_float(double f) { return f; }
// (T)v, float16 included.
template <typename T, typename F> __device__ __forceinline__ T qa_cast(F v) { return (T)v; }
template <> __device__ __forceinline__ qa_half qa_cast<qa_half, float>(float v) { return qa_to_half(v); }

// Bits of float and double, and back.
template <typename T> struct QaBits;
template <> struct QaBits<float> {
    typedef unsigned U;
    static constexpr int E = 8, M = 23, BIAS = 127;
};
template <> struct QaBits<double> {
    typedef unsigned long long U;
    static constexpr int E = 11, M = 52, BIAS = 1023;
};
#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned qa_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned long long qa_bits(double v) { return (unsigned long long)__double_as_longlong(v); }
__device__ __forceinline__ float qa_from_bits(unsigned u) { return __uint_as_float(u); }
__device__ __forceinline__ double qa_from_bits(unsigned long long u) { return __longlong_as_double((long long)u); }
#else
template <typename U, typename F> U qa_pun(F v) {
    U u;
    __builtin_memcpy(&u, &v, sizeof u);
    return u;
}
inline unsigned qa_bits(float v) { return qa_pun<unsigned>(v); }
inline unsigned long long qa_bits(double v) { return qa_pun<unsigned long long>(v); }
inline float qa_from_bits(unsigned u) { return qa_pun<float>(u); }
inline double qa_from_bits(unsigned long long u) { return qa_pun<double>(u); }
#endif
// NaN and sign tests on the bits: no float compare to flush (-ftz=true), and
// the sign of a NaN as the input holds it (hardware arithmetic drops it).
template <typename T> __device__ __forceinline__ bool qa_isnan(T v) {
    typedef QaBits<T> B;
    return (qa_bits(v) & ~((typename B::U)1 << (B::E + B::M))) > ((typename B::U)((1 << B::E) - 1) << B::M);
}
template <typename T> __device__ __forceinline__ bool qa_neg(T v) { return qa_bits(v) >> (QaBits<T>::E + QaBits<T>::M); }
__device__ __forceinline__ bool qa_neg(qa_half h) { return h.bits >> 15; }

// Quiet NaN with the given sign, as NumPy and ml_dtypes give it in each output type.
template <typename T> __device__ __forceinline__ T qa_nan(bool neg);
template <> __device__ __forceinline__ float qa_nan<float>(bool neg) { return qa_from_bits((neg ? 0xFFC00000u : 0x7FC00000u)); }
template <> __device__ __forceinline__ double qa_nan<double>(bool neg) {
    return qa_from_bits((unsigned long long)(neg ? 0xFFF8000000000000ull : 0x7FF8000000000000ull));
}
template <> __device__ __forceinline__ qa_half qa_nan<qa_half>(bool neg) { return qa_half{(unsigned short)(neg ? 0xFE00 : 0x7E00)}; }

__device__ __forceinline__ double qa_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double qa_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ bool qa_lt(double a, double b) { return a < b; }
__device__ __forceinline__ float qa_rint(float a) { return rintf(a); }
__device__ __forceinline__ double qa_rint(double a) { return rint(a); }
__device__ __forceinline__ float qa_floor(float a) { return floorf(a); }
__device__ __forceinline__ double qa_floor(double a) { return floor(a); }

// qarray/_philox.py line for line: Philox4x32-10's word 0 of counter (idx mod
// 2**32, idx >> 32, 0, 0) under key (k0, k1), and the stochastic rounding it
// drives (frac(t) exact in T, the comparison exact in double).
__device__ __forceinline__ unsigned qa_philox_bits(unsigned long long idx, unsigned k0, unsigned k1) {
    unsigned c0 = (unsigned)idx, c1 = (unsigned)(idx >> 32), c2 = 0, c3 = 0;
    for (int round = 0; round < 10; ++round) {
        const unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
        const unsigned n0 = (unsigned)(p1 >> 32) ^ c1 ^ k0, n2 = (unsigned)(p0 >> 32) ^ c3 ^ k1;
        c1 = (unsigned)p1;
        c3 = (unsigned)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}
template <typename T>
__device__ __forceinline__ T qa_round_stochastic(T t, unsigned r) {
    const T f = qa_floor(t);
    return f + (T)((double)r < __dmul_rn((double)t - (double)f, 4294967296.0));
}

// Store v as the storage type numbered `kind` (CupyBackend's OUT_KINDS; for kernels whose
// stores are few (binary's, gemv's), one kernel serves every output dtype).
__device__ __forceinline__ void qa_store(void* out, int kind, i64 idx, i64 v) {
    switch (kind) {
        case 1: static_cast<signed char*>(out)[idx] = (signed char)v; break;
        case 2: static_cast<unsigned char*>(out)[idx] = (unsigned char)v; break;
        case 3: static_cast<short*>(out)[idx] = (short)v; break;
        case 4: static_cast<unsigned short*>(out)[idx] = (unsigned short)v; break;
        case 5: static_cast<int*>(out)[idx] = (int)v; break;
        default: static_cast<i64*>(out)[idx] = v;
    }
}

// M(args..., NAME, TYPE) for every integer storage type: the list the kernel
// files instantiate their extern "C" names from.
#define QA_PER_INT(M, ...)                        \
    M(__VA_ARGS__, int8, signed char)             \
    M(__VA_ARGS__, uint8, unsigned char)          \
    M(__VA_ARGS__, int16, short)                  \
    M(__VA_ARGS__, uint16, unsigned short)        \
    M(__VA_ARGS__, int32, int)                    \
    M(__VA_ARGS__, int64, long long)

// The Layout of per-tensor data: qa_map reads no bidx for it.
#define QA_PER_TENSOR Layout{1, 1, 1, 1, 0}

#define QA_GRID_STRIDE(idx, n) \
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < (n); idx += (i64)blockDim.x * gridDim.x)

// Apply ``op(value, slot)`` to every element, moving N elements (16 bytes on
// the wider side, N = 16 / the wider element size) per vector access, QA_UNROLL
// vectors per thread per step, with 32-bit indices below 2**31 elements.
// QA_UNROLL is 1: the backend's grid fills every SM (the occupancy calculator),
// so an SM has 2048 threads x 16 bytes = 32 KB of loads in flight, above the
// ~22 KB an H200 SM needs at full bandwidth (4.8 TB/s x ~600 ns / 132 SMs);
// 2 doubled nvcc's time for elementwise.cu (22 -> 40 s an arch) with no device
// to show that it pays. Raise it where bench_gpu.py shows a gain.
//
// Every layout runs as rows of contiguous elements whose parameter slot is
// rowbase(row) + colterm(col): rows of `inner` elements when inner > 1 (row
// (o, l): one slot, or pinner > 1 slots along the row: blocked on an outer
// axis), else rows of `n` elements (row o: slot bidx[col], per-axis or blocked
// along the last axis); per-tensor data is one row. Rows whose length is a
// multiple of N move in vectors (the slot worked out once per vector where it
// is one); the rest, and unaligned pointers, go element by element.
#define QA_UNROLL 1

template <typename I>
struct QaRows {
    I cols, n;            // row length; rows per outer index (inner > 1)
    i64 pstride, pinner;  // slots per outer index (0: the same for every outer), slots along a row
    bool by_col;          // slot bidx[col] (rows of n elements), else one slot per row (+ col when pinner > 1)
    bool flat;            // per-tensor: slot 0, bidx never read (it may be null)
    __device__ __forceinline__ QaRows(Layout lay, I total) {
        by_col = lay.inner == 1 && lay.n > 1;
        cols = (I)(by_col ? lay.n : lay.inner);
        n = (I)lay.n;
        pstride = lay.pouter_on * lay.blocks;
        pinner = lay.pinner;
        flat = lay.blocks == 1 && lay.pinner == 1 && lay.pouter_on == 0;
        if (flat) {  // per-tensor: one row
            by_col = false;
            cols = total;
            n = 1;
        }
    }
    __device__ __forceinline__ i64 rowbase(I row, const i64* __restrict__ bidx) const {
        if (flat) return 0;
        if (by_col) return (i64)row * pstride;
        const I o = row / n, l = row - o * n;
        return ((i64)o * pstride + bidx[l]) * pinner;
    }
    __device__ __forceinline__ i64 colterm(I col, const i64* __restrict__ bidx) const {
        return by_col ? bidx[col] : (pinner > 1 ? (i64)col : 0);
    }
};

template <typename I, typename TIn, typename TOut, typename Op>
__device__ __forceinline__ void qa_map_as(const TIn* __restrict__ in, TOut* __restrict__ out, I total, Layout lay,
                                          const i64* __restrict__ bidx, Op op) {
    constexpr int N = 16 / (sizeof(TIn) > sizeof(TOut) ? sizeof(TIn) : sizeof(TOut));
    struct alignas(N * sizeof(TIn)) VecIn { TIn v[N]; };
    struct alignas(N * sizeof(TOut)) VecOut { TOut v[N]; };
    const QaRows<I> rows(lay, total);
    const I step = (I)blockDim.x * gridDim.x, first = (I)blockIdx.x * blockDim.x + threadIdx.x;
    const bool aligned = (unsigned long long)in % sizeof(VecIn) == 0 && (unsigned long long)out % sizeof(VecOut) == 0;
    const bool one_slot = !rows.by_col && rows.pinner == 1;  // the slot is the row's for every element
    I done = 0;
    if (aligned && (rows.cols % N == 0 || rows.cols == total)) {
        const I chunks = total / N, per_row = rows.cols / N > 0 ? rows.cols / N : 1;
        for (I k0 = first; k0 < chunks; k0 += step * QA_UNROLL) {
            VecIn a[QA_UNROLL];
#pragma unroll
            for (int u = 0; u < QA_UNROLL; ++u)
                if (k0 + u * step < chunks) a[u] = reinterpret_cast<const VecIn*>(in)[k0 + u * step];
#pragma unroll
            for (int u = 0; u < QA_UNROLL; ++u) {
                const I k = k0 + u * step;
                if (k >= chunks) break;
                const I row = k / per_row, c0 = (k - row * per_row) * N;
                const i64 base = rows.rowbase(row, bidx);
                VecOut b;
#pragma unroll
                for (int j = 0; j < N; ++j) b.v[j] = op(a[u].v[j], one_slot ? base : base + rows.colterm(c0 + j, bidx));
                reinterpret_cast<VecOut*>(out)[k] = b;
            }
        }
        done = chunks * N;
    }
    for (I idx = done + first; idx < total; idx += step) {
        const I row = idx / rows.cols, col = idx - row * rows.cols;
        out[idx] = op(in[idx], rows.rowbase(row, bidx) + rows.colterm(col, bidx));
    }
}

// Below 2**31 elements (every benchmark size) the vectors with 32-bit indices;
// beyond, element by element with 64-bit ones (one copy of the op's code: the
// vector path inlines it N * QA_UNROLL times).
template <typename TIn, typename TOut, typename Op>
__device__ void qa_map(const TIn* in, TOut* out, i64 total, Layout lay, const i64* bidx, Op op) {
    if (total < ((i64)1 << 31)) {
        qa_map_as<unsigned>(in, out, (unsigned)total, lay, bidx, op);
        return;
    }
    const QaRows<unsigned long long> rows(lay, (unsigned long long)total);
    QA_GRID_STRIDE(idx, total) {
        const i64 row = idx / (i64)rows.cols, col = idx - row * (i64)rows.cols;
        out[idx] = op(in[idx], rows.rowbase(row, bidx) + rows.colterm(col, bidx));
    }
}
