// Elementwise quantize / dequantize / requantize, bit-identical to the NumPy
// backend. Grid-stride loops with 64-bit indices; one extern "C" name per
// dtype pair (quantize_float32_int8, ...), template bodies underneath.
#include "common.cuh"

// q = clamp(rint(x / s) + z, lo, hi): x and s in TF (float for float16 and
// float32 input, as NumPy computes), the sum and clamp in TC (float for <= 16-bit
// outputs from float input, double otherwise: exact either way).
// rint(v / s) + z before the clamp: quantize's, fake_quantize's and the mask's.
template <typename TF, typename TC>
__device__ __forceinline__ TC qa_rounded(TF v, TF s, int z) { return (TC)qa_rint(qa_div(v, s)) + (TC)z; }

// Fake false: the code. Fake true (fake_quantize, TOut the input's type): that
// code dequantized as dequantize_body computes it (c - z is exact in TC; one
// rounding to TF, one in the multiply), in one pass.
template <bool Fake, typename TIn, typename TF, typename TC, typename TOut>
__device__ void quantize_body(const TIn* x, const TF* s, const int* z, const i64* bidx, i64 total,
                              Layout lay, TC lo, TC hi, TOut* out, int* nan_seen) {
    qa_map(x, out, total, lay, bidx, [=](TIn in, i64 p) -> TOut {
        TF v = qa_float(in);
        if (v != v) *nan_seen = 1;
        TC w = qa_rounded<TF, TC>(v, s[p], z[p]);
        TC c = w < lo ? lo : (w > hi ? hi : w);
        if constexpr (Fake) return qa_cast<TOut>(qa_mul((TF)(c - (TC)z[p]), s[p]));
        else return (TOut)c;
    });
}

// quantize with stochastic rounding: the random word of each element Philox's of
// its flat index (qarray/_philox.py), so every grid and device gives the same
// codes. Fake false: the codes. Fake true (fake_quantize, TOut the input's
// type): the code dequantized as quantize_body<true> writes it, and where
// with_mask is set, whether the value before the clamp lay inside [lo, hi].
template <bool Fake, typename TIn, typename TF, typename TC, typename TOut>
__device__ void quantize_stochastic_body(const TIn* x, const TF* s, const int* z, const i64* bidx, i64 total,
                                         Layout lay, TC lo, TC hi, unsigned k0, unsigned k1, TOut* out,
                                         bool* mask, int with_mask, int* nan_seen) {
    const QaRows<i64> rows(lay, total);
    QA_GRID_STRIDE(idx, total) {
        const i64 row = idx / rows.cols, p = rows.rowbase(row, bidx) + rows.colterm(idx - row * rows.cols, bidx);
        const TF v = qa_float(x[idx]);
        if (v != v) *nan_seen = 1;
        const TC w = (TC)qa_round_stochastic(qa_div(v, s[p]), qa_philox_bits(idx, k0, k1)) + (TC)z[p];
        const TC c = w < lo ? lo : (w > hi ? hi : w);
        if constexpr (Fake) {
            if (with_mask) mask[idx] = w >= lo && w <= hi;
            out[idx] = qa_cast<TOut>(qa_mul((TF)(c - (TC)z[p]), s[p]));
        } else {
            out[idx] = (TOut)c;
        }
    }
}

// the straight-through mask: rint(v / s) + z inside [lo, hi] before the clamp
// (false for NaN and +-inf)
template <typename TIn, typename TF, typename TC>
__device__ void quantize_mask_body(const TIn* x, const TF* s, const int* z, const i64* bidx, i64 total,
                                   Layout lay, TC lo, TC hi, bool* mask) {
    qa_map(x, mask, total, lay, bidx, [=](TIn in, i64 p) -> bool {
        TC w = qa_rounded<TF, TC>(qa_float(in), s[p], z[p]);
        return w >= lo && w <= hi;
    });
}

// out = float(q - z) * s, one rounding in TF, then (float16 output) one more,
// as NumPy's float32 result cast to float16.
template <typename TIn, typename TF, typename TOut>
__device__ void dequantize_body(const TIn* q, const TF* s, const int* z, const i64* bidx, i64 total,
                                Layout lay, TOut* out) {
    qa_map(q, out, total, lay, bidx, [=](TIn v, i64 p) -> TOut {
        TF d = (TF)((i64)v - (i64)z[p]);
        return qa_cast<TOut>(qa_mul(d, s[p]));
    });
}

// out = rq(q) in every slot (see Requant in common.cuh).
template <typename TIn, typename TOut>
__device__ void requantize_body(const TIn* q, Requant rq, const i64* bidx, i64 total, Layout lay, TOut* out) {
    qa_map(q, out, total, lay, bidx, [=](TIn v, i64 p) -> TOut { return (TOut)rq((i64)v, p); });
}

// requantize with stochastic rounding (the Requant's multiplier and shift; its
// rounding unused), each element's random word drawn as quantize_stochastic's
template <typename TIn, typename TOut>
__device__ void requantize_stochastic_body(const TIn* q, Requant rq, const i64* bidx, i64 total, Layout lay,
                                           unsigned k0, unsigned k1, TOut* out) {
    const QaRows<i64> rows(lay, total);
    QA_GRID_STRIDE(idx, total) {
        const i64 row = idx / rows.cols, p = rows.rowbase(row, bidx) + rows.colterm(idx - row * rows.cols, bidx);
        const i64 r = qa_rescale_stochastic((i64)q[idx] - rq.zi[p], rq.m[p], rq.sh[p], qa_philox_bits(idx, k0, k1))
                      + rq.zo[p];
        out[idx] = (TOut)(r < rq.lo ? rq.lo : (r > rq.hi ? rq.hi : r));
    }
}

#define QUANTIZE(IN, TIN, TF, TC, OUT, TOUT)                                                      \
    extern "C" __global__ void quantize_##IN##_##OUT(const TIN* x, const TF* s, const int* z,      \
                                                     const i64* bidx, i64 total, LAYOUT_ARGS,      \
                                                     TC lo, TC hi, TOUT* out, int* nan_seen) {     \
        quantize_body<false, TIN, TF, TC, TOUT>(x, s, z, bidx, total, LAYOUT, lo, hi, out, nan_seen);     \
    }
#define QUANTIZE_STOCHASTIC(IN, TIN, TF, TC, OUT, TOUT)                                                 \
    extern "C" __global__ void quantize_stochastic_##IN##_##OUT(                                          \
        const TIN* x, const TF* s, const int* z, const i64* bidx, i64 total, LAYOUT_ARGS, TC lo, TC hi,    \
        unsigned k0, unsigned k1, TOUT* out, int* nan_seen) {                                              \
        quantize_stochastic_body<false, TIN, TF, TC, TOUT>(x, s, z, bidx, total, LAYOUT, lo, hi, k0, k1, out,  \
                                                           nullptr, 0, nan_seen);                                \
    }
#define QUANTIZE_ALL(IN, TIN, TF)                                 \
    QUANTIZE(IN, TIN, TF, TF, int8, signed char)                  \
    QUANTIZE(IN, TIN, TF, TF, uint8, unsigned char)               \
    QUANTIZE(IN, TIN, TF, TF, int16, short)                       \
    QUANTIZE(IN, TIN, TF, TF, uint16, unsigned short)             \
    QUANTIZE(IN, TIN, TF, double, int32, int)                    \
    QUANTIZE_STOCHASTIC(IN, TIN, TF, TF, int8, signed char)      \
    QUANTIZE_STOCHASTIC(IN, TIN, TF, TF, uint8, unsigned char)   \
    QUANTIZE_STOCHASTIC(IN, TIN, TF, TF, int16, short)           \
    QUANTIZE_STOCHASTIC(IN, TIN, TF, TF, uint16, unsigned short) \
    QUANTIZE_STOCHASTIC(IN, TIN, TF, double, int32, int)
QUANTIZE_ALL(float16, qa_half, float)
QUANTIZE_ALL(float32, float, float)
QUANTIZE_ALL(float64, double, double)

// fake_quantize_<in>_<codes>, quantize_mask_<in>_<codes> and
// fake_quantize_stochastic_<in>_<codes> (values and mask in one pass): the
// codes' type picks the clamp's (TC) and the bounds; the output is the input's
// float type
#define FAKE_QUANTIZE(IN, TIN, TF, TC, OUT)                                                                \
    extern "C" __global__ void fake_quantize_##IN##_##OUT(const TIN* x, const TF* s, const int* z,          \
                                                          const i64* bidx, i64 total, LAYOUT_ARGS,          \
                                                          TC lo, TC hi, TIN* out, int* nan_seen) {          \
        quantize_body<true, TIN, TF, TC, TIN>(x, s, z, bidx, total, LAYOUT, lo, hi, out, nan_seen);            \
    }                                                                                                        \
    extern "C" __global__ void quantize_mask_##IN##_##OUT(const TIN* x, const TF* s, const int* z,          \
                                                          const i64* bidx, i64 total, LAYOUT_ARGS,          \
                                                          TC lo, TC hi, bool* mask) {                       \
        quantize_mask_body<TIN, TF, TC>(x, s, z, bidx, total, LAYOUT, lo, hi, mask);                        \
    }                                                                                                        \
    extern "C" __global__ void fake_quantize_stochastic_##IN##_##OUT(                                        \
        const TIN* x, const TF* s, const int* z, const i64* bidx, i64 total, LAYOUT_ARGS, TC lo, TC hi,      \
        unsigned k0, unsigned k1, TIN* out, bool* mask, int with_mask, int* nan_seen) {                      \
        quantize_stochastic_body<true, TIN, TF, TC, TIN>(x, s, z, bidx, total, LAYOUT, lo, hi, k0, k1, out,   \
                                                         mask, with_mask, nan_seen);                          \
    }
#define FAKE_QUANTIZE_ALL(IN, TIN, TF)            \
    FAKE_QUANTIZE(IN, TIN, TF, TF, int8)          \
    FAKE_QUANTIZE(IN, TIN, TF, TF, uint8)         \
    FAKE_QUANTIZE(IN, TIN, TF, TF, int16)         \
    FAKE_QUANTIZE(IN, TIN, TF, TF, uint16)        \
    FAKE_QUANTIZE(IN, TIN, TF, double, int32)
FAKE_QUANTIZE_ALL(float16, qa_half, float)
FAKE_QUANTIZE_ALL(float32, float, float)
FAKE_QUANTIZE_ALL(float64, double, double)

#define DEQUANTIZE(IN, TIN, OUT, TF, TOUT)                                                         \
    extern "C" __global__ void dequantize_##IN##_##OUT(const TIN* q, const TF* s, const int* z,    \
                                                       const i64* bidx, i64 total, LAYOUT_ARGS,    \
                                                       TOUT* out) {                                \
        dequantize_body<TIN, TF, TOUT>(q, s, z, bidx, total, LAYOUT, out);                         \
    }
#define REQUANTIZE(IN, TIN, OUT, TOUT)                                                                   \
    extern "C" __global__ void requantize_##IN##_##OUT(const TIN* q, REQUANT_PARAMS, const i64* bidx,    \
                                                       i64 total, LAYOUT_ARGS, REQUANT_BOUNDS, TOUT* out) { \
        requantize_body<TIN, TOUT>(q, REQUANT, bidx, total, LAYOUT, out);                                 \
    } \
    extern "C" __global__ void requantize_stochastic_##IN##_##OUT(                                          \
        const TIN* q, REQUANT_PARAMS, const i64* bidx, i64 total, LAYOUT_ARGS, REQUANT_BOUNDS, unsigned k0,  \
        unsigned k1, TOUT* out) {                                                                            \
        requantize_stochastic_body<TIN, TOUT>(q, REQUANT, bidx, total, LAYOUT, k0, k1, out);                 \
    }
#define PER_INT(M, IN, TIN)                   \
    M(IN, TIN, int8, signed char)             \
    M(IN, TIN, uint8, unsigned char)          \
    M(IN, TIN, int16, short)                  \
    M(IN, TIN, uint16, unsigned short)        \
    M(IN, TIN, int32, int)
QA_PER_INT(PER_INT, REQUANTIZE)

#define DEQ_IN(IN, TIN)                          \
    DEQUANTIZE(IN, TIN, float16, float, qa_half) \
    DEQUANTIZE(IN, TIN, float32, float, float)   \
    DEQUANTIZE(IN, TIN, float64, double, double)
DEQ_IN(int8, signed char)
DEQ_IN(uint8, unsigned char)
DEQ_IN(int16, short)
DEQ_IN(uint16, unsigned short)
DEQ_IN(int32, int)
