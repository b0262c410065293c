// Quantize / dequantize of the floating element formats (qarray/_formats.py:
// ONNX QuantizeLinear / DequantizeLinear to float8, float6, float4), bit for
// bit as ml_dtypes casts, codes stored as uint8 bit patterns. One software
// converter serves every format, from its exponent and mantissa widths, bias
// and kind; sm_89 and later convert float32 to e4m3fn / e5m2 with saturation
// in hardware (cvt.rn.satfinite), which rounds the same way.
#include "common.cuh"

// What a format does beyond its finite values (qarray/backends/cupy.py FORMAT_*):
#define QA_FMT_IEEE 0    // inf, and NaNs with an all-ones exponent (e5m2)
#define QA_FMT_FN 1      // no inf, NaN the all-ones pattern with either sign (e4m3fn)
#define QA_FMT_FNUZ 2    // no inf, no -0, one NaN: the sign bit alone (e4m3fnuz, e5m2fnuz)
#define QA_FMT_FINITE 3  // neither inf nor NaN: always saturates, NaN input refused (float6, float4)

struct QaFormat {
    int e, m, bias, kind;
    __device__ unsigned sign() const { return 1u << (e + m); }
    __device__ unsigned top() const {  // the largest finite magnitude
        return kind == QA_FMT_IEEE ? (((1u << e) - 1) << m) - 1 : sign() - (kind == QA_FMT_FN ? 2 : 1);
    }
    __device__ unsigned inf() const { return ((1u << e) - 1) << m; }
    __device__ bool isnan(unsigned c) const {
        const unsigned a = c & (sign() - 1);
        return kind == QA_FMT_IEEE ? a > inf() : kind == QA_FMT_FN ? a == sign() - 1 : kind == QA_FMT_FNUZ && c == sign();
    }
    __device__ unsigned nan(bool neg) const {  // ml_dtypes' NaN: quiet, the input's sign (fnuz: its one NaN)
        if (kind == QA_FMT_FNUZ) return sign();
        return (kind == QA_FMT_IEEE ? inf() | (1u << (m - 1)) : sign() - 1) | (neg ? sign() : 0);
    }
};
#define FORMAT_ARGS int fe, int fm, int fbias, int fkind
#define FORMAT QaFormat{fe, fm, fbias, fkind}

// v (not NaN) rounded to nearest, ties to even, into format f, as ml_dtypes'
// cast from T: beyond the largest finite value (inf included) gives +-max when
// saturating (float6 and float4 always), else inf (e5m2) or NaN. signed_zero:
// MX and NVFP4 elements, where float6/float4 keep an exact -0 as ml_dtypes does.
template <typename T>
__device__ __forceinline__ unsigned qa_encode(T v, QaFormat f, bool saturate, bool signed_zero = false) {
    typedef QaBits<T> B;
    typedef typename B::U U;
    const U u = qa_bits(v), a = u & ~((U)1 << (B::E + B::M));
    const bool neg = u != a;
    const int be = (int)(a >> B::M);               // biased exponent; all ones for inf
    const int e0 = (be ? be : 1) - B::BIAS;        // exponent of sig's leading digit
    const U sig = (a & (((U)1 << B::M) - 1)) | ((U)(be ? 1 : 0) << B::M);
    const int emin = 1 - f.bias, ex = e0 > emin ? e0 : emin;  // the format's exponent (subnormals: emin)
    const int shift = ex - f.m - e0 + B::M;        // digits of sig below the format's last, >= 1
    const U n = shift > B::M + 1 ? 0 : (sig + ((U)1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift;
    // n counts units of the last digit; a carry out of the mantissa moves to the next exponent by itself
    const long long code = (long long)n + ((long long)(ex - emin) << f.m);
    const unsigned s = neg ? f.sign() : 0;
    if (code > (long long)f.top()) {
        if (saturate || f.kind == QA_FMT_FINITE) return f.top() | s;
        return f.kind == QA_FMT_IEEE ? f.inf() | s : f.nan(neg);
    }
    // -0 stays -0 but in fnuz (none there), and float6/float4 take an exact -0 as +0 (ONNX adds a +0 zero point)
    if (code == 0 && (f.kind == QA_FMT_FNUZ || (f.kind == QA_FMT_FINITE && a == 0 && !signed_zero))) return 0;
    return (unsigned)code | s;
}

// float32 to the format: on sm_89 and later e4m3fn and e5m2 with saturation
// in hardware (round to nearest even, +-max beyond the range, inf included,
// as qa_encode; NaN never comes here), else qa_encode.
__device__ __forceinline__ unsigned qa_to_format(float v, QaFormat f, bool saturate, bool signed_zero = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (saturate && f.kind == QA_FMT_FN && f.e == 4 && f.m == 3 && f.bias == 7) {
        unsigned short r;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
        return r & 0xFFu;
    }
    if (saturate && f.kind == QA_FMT_IEEE && f.e == 5 && f.m == 2 && f.bias == 15) {
        unsigned short r;
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
        return r & 0xFFu;
    }
#endif
    return qa_encode(v, f, saturate, signed_zero);
}
// float64 input is divided in float64 and rounded once, straight into the format
__device__ __forceinline__ unsigned qa_to_format(double v, QaFormat f, bool saturate, bool signed_zero = false) {
    return qa_encode(v, f, saturate, signed_zero);
}

// The value of code c (not NaN) exactly in T: its significand times a signed power of two.
template <typename T> __device__ __forceinline__ T qa_decode(unsigned c, QaFormat f) {
    typedef QaBits<T> B;
    typedef typename B::U U;
    const bool neg = c & f.sign();
    const unsigned be = (c & (f.sign() - 1)) >> f.m, mant = c & ((1u << f.m) - 1);
    if (f.kind == QA_FMT_IEEE && be == (1u << f.e) - 1)
        return qa_from_bits(((U)neg << (B::E + B::M)) | ((U)((1 << B::E) - 1) << B::M));  // +-inf
    const int k = (int)(be ? be : 1) - f.bias - f.m;
    const T pow2 = qa_from_bits(((U)neg << (B::E + B::M)) | ((U)(k + B::BIAS) << B::M));
    return qa_mul((T)(be ? mant | (1u << f.m) : mant), pow2);
}

// out = code of x / s (TF: float for float16 and float32 input, double for
// float64), NaN input its NaN (flagged where the format has none).
template <typename TIn, typename TF>
__device__ void quantize_format_body(const TIn* x, const TF* s, const i64* bidx, i64 total, Layout lay, QaFormat f,
                                     bool saturate, unsigned char* out, int* nan_seen) {
    qa_map(x, out, total, lay, bidx, [=](TIn in, i64 p) -> unsigned char {
        const TF v = qa_float(in);
        if (qa_isnan(v)) {
            if (f.kind == QA_FMT_FINITE) *nan_seen = 1;  // and the host path raises; the code is never read
            return (unsigned char)f.nan(qa_neg(in));
        }
        return (unsigned char)qa_to_format(qa_div(v, s[p]), f, saturate);
    });
}

// out = decode(q) * s in TF, one rounding, then (float16 output) one more;
// NaN codes give the quiet NaN of their sign without arithmetic.
template <typename TF, typename TOut>
__device__ void dequantize_format_body(const unsigned char* q, const TF* s, const i64* bidx, i64 total, Layout lay,
                                       QaFormat f, TOut* out) {
    qa_map(q, out, total, lay, bidx, [=](unsigned char c, i64 p) -> TOut {
        if (f.isnan(c)) return qa_nan<TOut>(c & f.sign());
        return qa_cast<TOut>(qa_mul(qa_decode<TF>(c, f), s[p]));
    });
}

#define QUANTIZE_FORMAT(IN, TIN, TF)                                                                          \
    extern "C" __global__ void quantize_format_##IN(const TIN* x, const TF* s, const i64* bidx, i64 total,    \
                                                    LAYOUT_ARGS, FORMAT_ARGS, int saturate, unsigned char* out, \
                                                    int* nan_seen) {                                          \
        quantize_format_body<TIN, TF>(x, s, bidx, total, LAYOUT, FORMAT, saturate != 0, out, nan_seen);       \
    }
QUANTIZE_FORMAT(float16, qa_half, float)
QUANTIZE_FORMAT(float32, float, float)
QUANTIZE_FORMAT(float64, double, double)

#define DEQUANTIZE_FORMAT(OUT, TF, TOUT)                                                                       \
    extern "C" __global__ void dequantize_format_##OUT(const unsigned char* q, const TF* s, const i64* bidx,   \
                                                       i64 total, LAYOUT_ARGS, FORMAT_ARGS, TOUT* out) {      \
        dequantize_format_body<TF, TOUT>(q, s, bidx, total, LAYOUT, FORMAT, out);                             \
    }
DEQUANTIZE_FORMAT(float16, float, qa_half)
DEQUANTIZE_FORMAT(float32, float, float)
DEQUANTIZE_FORMAT(float64, double, double)

// -- MX and NVFP4 blocks (qarray/backends/_base.py Backend.quantize_mx and
// quantize_nvfp4, bit for bit): one thread per block, that is per (outer,
// block, inner) column of the (outer, n, inner) data, its elements `inner`
// apart; it reads its block twice (the largest magnitude, then the elements)
// and writes the scale code bits[col] and every element code. A block whose
// largest magnitude is NaN gets the NaN scale and codes 0, in MX an inf one too
// (NVFP4 clamps an inf block's scale to 448, as torchao).

// The first element of column `col` and how many its block holds (the last one may be short).
__device__ __forceinline__ i64 qa_block(i64 col, i64 n, i64 inner, i64 blocks, i64 bs, i64* count) {
    const i64 i = col % inner, rest = col / inner, b = rest % blocks, o = rest / blocks;
    *count = n - b * bs < bs ? n - b * bs : bs;
    return (o * n + b * bs) * inner + i;
}

// The largest magnitude of a block as its bits: NaN's above inf's above every finite one's.
template <typename T>
__device__ __forceinline__ typename QaBits<T>::U qa_amax_bits(const T* x, i64 first, i64 count, i64 stride) {
    typedef typename QaBits<T>::U U;
    U a = 0;
    for (i64 j = 0; j < count; ++j) {
        const U u = qa_bits(x[first + j * stride]) & ~((U)1 << (QaBits<T>::E + QaBits<T>::M));
        a = u > a ? u : a;
    }
    return a;
}
template <typename T> __device__ __forceinline__ bool qa_finite_bits(typename QaBits<T>::U a) {
    return a < ((typename QaBits<T>::U)((1 << QaBits<T>::E) - 1) << QaBits<T>::M);
}

// Scale roundings, in qarray._formats.SCALE_ROUNDINGS' order.
#define QA_MX_FLOOR 0
#define QA_MX_CEIL 1
#define QA_MX_EVEN 2
#define QA_MX_RCEIL 3

// The E8M0 code of a block whose (finite) largest magnitude has bits `a`:
// qarray._formats.mx_exponents, exact on the bits (rceil divides by the
// element's largest value `top` in T first).
template <typename T>
__device__ unsigned qa_mx_exponent(typename QaBits<T>::U a, int emax, int mbits, int rounding, T top) {
    typedef QaBits<T> B;
    typedef typename B::U U;
    const U frac_mask = ((U)1 << B::M) - 1;
    if (rounding == QA_MX_RCEIL) a = qa_bits(qa_div(qa_from_bits(a), top));
    if (a == 0) return 0;  // an all-zero block: 2**-127
    const int be = (int)(a >> B::M);
    int e = (be ? be : 1) - B::BIAS;  // floor(log2(a)) once the leading one is at bit M
    U sig = a;
    if (!be)
        for (; !(sig >> B::M); sig <<= 1) --e;  // a subnormal: its leading one up to bit M
    const U frac = sig & frac_mask;  // a = (1 + frac / 2**M) * 2**e
    if (rounding == QA_MX_CEIL || rounding == QA_MX_RCEIL) e += frac != 0;
    else if (rounding == QA_MX_EVEN) e += frac >= frac_mask + 1 - ((U)1 << (B::M - mbits - 1));  // rounds up to 2**(e+1)
    if (rounding != QA_MX_RCEIL) e -= emax;
    return (unsigned)((e < -127 ? -127 : e > 127 ? 127 : e) + 127);
}

// 2**k exactly in T, k in [-127, 127] (a float32 subnormal at -127).
template <typename T> __device__ __forceinline__ T qa_pow2(int k) {
    typedef QaBits<T> B;
    typedef typename B::U U;
    return qa_from_bits(k > -B::BIAS ? (U)(k + B::BIAS) << B::M : (U)1 << (B::M - 1 + B::BIAS + k));
}

// An element's code: v rounded into f, saturating, -0 kept (NaN: code 0, as the
// reference's); mxint8 takes f = E1M6 with bias 1, whose values are n * 2**-6 for
// n = 0..127 (rint(v * 64) clamped), and stores the int8 -n for a negative code.
template <typename T> __device__ __forceinline__ unsigned char qa_mx_element(T v, QaFormat f, bool int8) {
    if (qa_isnan(v)) return 0;
    const unsigned c = qa_to_format(v, f, true, true);
    return (unsigned char)(int8 && (c & f.sign()) ? 0u - (c & (f.sign() - 1)) : c);
}

template <typename T>
__device__ void quantize_mx_body(const T* x, i64 cols, i64 n, i64 inner, i64 blocks, i64 bs, QaFormat f, bool int8,
                                 int emax, int mbits, int rounding, T top, unsigned char* out, unsigned char* bits) {
    QA_GRID_STRIDE(col, cols) {
        i64 count;
        const i64 first = qa_block(col, n, inner, blocks, bs, &count);
        const typename QaBits<T>::U a = qa_amax_bits(x, first, count, inner);
        const bool finite = qa_finite_bits<T>(a);
        const unsigned code = finite ? qa_mx_exponent<T>(a, emax, mbits, rounding, top) : 0xFFu;
        const T s = qa_pow2<T>((int)code - 127);
        for (i64 j = 0; j < count; ++j) {
            const i64 p = first + j * inner;
            out[p] = finite ? qa_mx_element(qa_div(x[p], s), f, int8) : 0;
        }
        bits[col] = (unsigned char)code;
    }
}

#define QUANTIZE_MX(IN, T)                                                                                        \
    extern "C" __global__ void quantize_mx_##IN(const T* x, i64 cols, i64 n, i64 inner, i64 blocks, i64 bs,        \
                                                FORMAT_ARGS, int int8, int emax, int mbits, int rounding, T top,   \
                                                unsigned char* out, unsigned char* bits) {                         \
        quantize_mx_body<T>(x, cols, n, inner, blocks, bs, FORMAT, int8 != 0, emax, mbits, rounding, top, out, bits); \
    }
QUANTIZE_MX(float32, float)
QUANTIZE_MX(float64, double)

// NVFP4 in float32 as the reference: s = e4m3(clamp(amax / 6 / gs, 2**-6, 448)),
// elements e2m1(x * ((1 / gs) / s)); a NaN block: scale 0x7F (NaN), codes 0; an
// inf block (no NaN): amax inf clamps to 448 (0x7E) and inf elements saturate to +-6.
extern "C" __global__ void quantize_nvfp4(const float* x, i64 cols, i64 n, i64 inner, i64 blocks, i64 bs, float gs,
                                          unsigned char* out, unsigned char* bits) {
    const QaFormat e4m3{4, 3, 7, QA_FMT_FN}, e2m1{2, 1, 1, QA_FMT_FINITE};
    const float lo = 0.015625f, hi = 448.0f;
    QA_GRID_STRIDE(col, cols) {
        i64 count;
        const i64 first = qa_block(col, n, inner, blocks, bs, &count);
        const unsigned a = qa_amax_bits(x, first, count, inner);
        const bool nan = qa_isnan(qa_from_bits(a));
        float s = qa_div(qa_div(qa_from_bits(a), 6.0f), gs);
        s = qa_lt(s, lo) ? lo : qa_lt(hi, s) ? hi : s;
        const unsigned code = qa_to_format(s, e4m3, true);
        const float recip = qa_div(qa_div(1.0f, gs), qa_decode<float>(code, e4m3));
        for (i64 j = 0; j < count; ++j) {
            const i64 p = first + j * inner;
            out[p] = nan ? 0 : qa_mx_element(qa_mul(x[p], recip), e2m1, false);
        }
        bits[col] = nan ? 0x7F : (unsigned char)code;
    }
}
