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

__device__ __forceinline__ i64 qa_rescale(i64 d, i64 m, i64 s, int rounding) {
    const i64 one = 1, m31 = (one << 31) - 1, m32 = (one << 32) - 1;
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
    // A multiplier >= 1/2 (s < 32): saturate |d| at 2**(s + 30), then shift
    // d left so that the shift is 32 + t. (The CPU's narrow fast path, one
    // product where |d| < 2**32, gives the same result and is left out.)
    const bool lt = s < 32;
    const i64 u = lt ? 32 - s : 0;
    const i64 t = s + u - 32;
    // x * m = h * 2**32 + l with 0 <= l < 2**32, from two products below 2**63
    const i64 mm = m & m31;
    const i64 b = one << (lt ? s + 30 : 0);
    const i64 x = qa_shl(lt ? (d > b ? b : (d < -b ? -b : d)) : d, u);
    const i64 lo = (x & m32) * mm;
    const i64 h = (x >> 32) * mm + (lo >> 32), l = lo & m32;
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
// code * scale, the comparisons of min/max) are PTX without .ftz here. The
// float32 adds, compares and conversions left to the compiler see only
// integer values (rint results, zero points, bounds), where flushing changes
// nothing; tests/test_cuda_nvrtc.py checks CuPy's own PTX for this.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float qa_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float qa_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ bool qa_lt(float a, float b) {
    int r;
    asm("{\n\t.reg .pred p;\n\tsetp.lt.f32 p, %1, %2;\n\tselp.s32 %0, 1, 0, p;\n\t}" : "=r"(r) : "f"(a), "f"(b));
    return r;
}
#else
__device__ __forceinline__ float qa_div(float a, float b) { return a / b; }
__device__ __forceinline__ float qa_mul(float a, float b) { return a * b; }
__device__ __forceinline__ bool qa_lt(float a, float b) { return a < b; }
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

__device__ __forceinline__ double qa_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double qa_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ bool qa_lt(double a, double b) { return a < b; }
__device__ __forceinline__ float qa_rint(float a) { return rintf(a); }
__device__ __forceinline__ double qa_rint(double a) { return rint(a); }

#define QA_GRID_STRIDE(idx, n) \
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < (n); idx += (i64)blockDim.x * gridDim.x)

// Apply ``op(value, slot)`` to every element. Per-tensor data whose pointers
// allow it moves in N-element chunks with one 16-byte vector access on the
// wider side (N = 16 / the wider element size); the rest, and every per-axis
// or blocked layout, goes element by element.
template <typename TIn, typename TOut, typename Op>
__device__ void qa_map(const TIn* in, TOut* out, i64 total, Layout lay, const i64* bidx, Op op) {
    constexpr int N = 16 / (sizeof(TIn) > sizeof(TOut) ? sizeof(TIn) : sizeof(TOut));
    struct alignas(N * sizeof(TIn)) VecIn { TIn v[N]; };
    struct alignas(N * sizeof(TOut)) VecOut { TOut v[N]; };
    const bool per_tensor = lay.blocks == 1 && lay.pinner == 1 && lay.pouter_on == 0;
    const bool aligned = (unsigned long long)in % sizeof(VecIn) == 0 && (unsigned long long)out % sizeof(VecOut) == 0;
    i64 done = 0;
    if (per_tensor && aligned) {
        const i64 chunks = total / N;
        QA_GRID_STRIDE(k, chunks) {
            VecIn a = reinterpret_cast<const VecIn*>(in)[k];
            VecOut b;
#pragma unroll
            for (int j = 0; j < N; ++j) b.v[j] = op(a.v[j], 0);
            reinterpret_cast<VecOut*>(out)[k] = b;
        }
        done = chunks * N;
    }
    QA_GRID_STRIDE(t, total - done) {
        const i64 idx = done + t;
        out[idx] = op(in[idx], lay.slot(idx, bidx));
    }
}
