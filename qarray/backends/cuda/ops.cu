// Integer-code kernels behind the elementwise ops, bit-identical to the NumPy
// backend: clip (relu / clamp), sub-byte pack / unpack, add / sub / mul (the
// exact int64 accumulator, or requantized with a fused ReLU in the same pass)
// and the strided requantize of cat. Grid-stride loops with 64-bit indices.
#include "common.cuh"

// out = min(max(q, lo), hi), as numpy.clip; 16-byte vectors where aligned.
template <typename T>
__device__ void clip_body(const T* q, i64 lo, i64 hi, i64 total, T* out) {
    qa_map(q, out, total, QA_PER_TENSOR, nullptr, [=](T x, i64) -> T {
        const i64 v = (i64)x < lo ? lo : (i64)x;
        return (T)(v > hi ? hi : v);
    });
}

// One thread per byte: 8 / bits codes, the first in the low bits, zero padding.
extern "C" __global__ void pack_bits(const unsigned char* q, i64 count, int bits, i64 total, unsigned char* out) {
    const int per = 8 / bits;
    const unsigned mask = (1u << bits) - 1;
    QA_GRID_STRIDE(idx, total) {
        unsigned byte = 0;
        for (int j = 0; j < per; ++j) {
            i64 k = idx * per + j;
            if (k < count) byte |= ((unsigned)q[k] & mask) << (bits * j);
        }
        out[idx] = (unsigned char)byte;
    }
}

// One thread per code; sign-extended when is_signed (the bits of an int8).
extern "C" __global__ void unpack_bits(const unsigned char* packed, int bits, int is_signed, i64 total,
                                       unsigned char* out) {
    const int per = 8 / bits;
    const int sign = 1 << (bits - 1);
    QA_GRID_STRIDE(idx, total) {
        int v = (packed[idx / per] >> (bits * (int)(idx % per))) & ((1 << bits) - 1);
        out[idx] = (unsigned char)(is_signed ? (v ^ sign) - sign : v);
    }
}

// One operand of binary: x[idx % period] - z, then rescaled by (m, s) with
// rounding code `code` (QA_IDENTITY: as it is), as qarray._fixed_point.Requant
// with no clamp: add's operands on their common scale.
template <typename I, typename T>
__device__ __forceinline__ i64 qa_operand(const T* x, I period, i64 z, i64 m, i64 s, int code, I idx) {
    i64 d = (i64)x[idx < period ? idx : idx % period] - z;
    return qa_requantize(d, 0, m, s, 0.0, -0x7fffffffffffffffLL - 1, 0x7fffffffffffffffLL, code);
}

// v = a' + b' (op 0), a' - b' (op 1) or a' * b' (op 2), exact in int64
// (the ops refuse operands whose product could pass 2**63); operands
// broadcast by period. With out_kind 0, out is v itself (int64); otherwise
// rq(v) in the same pass (lo > qmin being a fused ReLU), stored as out_kind's
// type. Indices in I: 32 bits below 2**31 elements, so a broadcast operand's
// modulo is a 32-bit one; per-tensor output parameters take slot 0 without
// Layout::slot's four 64-bit divisions an element.
template <typename I, typename TA, typename TB>
__device__ __forceinline__ void binary_as(const TA* a, I pa, i64 za, i64 ma, i64 sa, int ca, const TB* b, I pb, i64 zb,
                                          i64 mb, i64 sb, int cb, int op, Requant rq, const i64* bidx, I total,
                                          Layout lay, int out_kind, void* out) {
    const bool flat = lay.blocks == 1 && lay.pinner == 1 && lay.pouter_on == 0;
    for (I idx = (I)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (I)blockDim.x * gridDim.x) {
        i64 x = qa_operand<I>(a, pa, za, ma, sa, ca, idx);
        i64 y = qa_operand<I>(b, pb, zb, mb, sb, cb, idx);
        i64 v = op == 2 ? x * y : (op == 1 ? x - y : x + y);
        if (out_kind) v = rq(v, flat ? 0 : lay.slot((i64)idx, bidx));
        qa_store(out, out_kind, (i64)idx, v);
    }
}
template <typename TA, typename TB>
__device__ void binary_body(const TA* a, i64 pa, i64 za, i64 ma, i64 sa, int ca, const TB* b, i64 pb, i64 zb,
                            i64 mb, i64 sb, int cb, int op, Requant rq, const i64* bidx, i64 total, Layout lay,
                            int out_kind, void* out) {
    if (total < ((i64)1 << 31))
        binary_as<unsigned>(a, (unsigned)pa, za, ma, sa, ca, b, (unsigned)pb, zb, mb, sb, cb, op, rq, bidx,
                            (unsigned)total, lay, out_kind, out);
    else
        binary_as<unsigned long long>(a, (unsigned long long)pa, za, ma, sa, ca, b, (unsigned long long)pb, zb, mb,
                                      sb, cb, op, rq, bidx, (unsigned long long)total, lay, out_kind, out);
}

// requantize (as elementwise.cu) into rows of a strided destination: element
// idx goes to out[idx / row * stride + idx % row] (cat along an inner axis).
template <typename TIn, typename TOut>
__device__ void requantize_rows_body(const TIn* q, Requant rq, const i64* bidx, i64 total, Layout lay, i64 row,
                                     i64 stride, TOut* out) {
    QA_GRID_STRIDE(idx, total) {
        out[idx / row * stride + idx % row] = (TOut)rq((i64)q[idx], lay.slot(idx, bidx));
    }
}

#define CLIP(_, N, T)                                                                                   \
    extern "C" __global__ void clip_##N(const T* q, i64 lo, i64 hi, i64 total, T* out) {               \
        clip_body<T>(q, lo, hi, total, out);                                                           \
    }
#define BINARY(A, TA, B, TB)                                                                                    \
    extern "C" __global__ void binary_##A##_##B(const TA* a, i64 pa, i64 za, i64 ma, i64 sa, int ca, const TB* b,  \
                                                i64 pb, i64 zb, i64 mb, i64 sb, int cb, int op, REQUANT_PARAMS,       \
                                                const i64* bidx, i64 total, LAYOUT_ARGS, REQUANT_BOUNDS,              \
                                                int out_kind, void* out) {                                            \
        binary_body<TA, TB>(a, pa, za, ma, sa, ca, b, pb, zb, mb, sb, cb, op, REQUANT, bidx, total, LAYOUT,         \
                            out_kind, out);                                                                           \
    }
#define PER_STORAGE(M, ...)                   \
    M(__VA_ARGS__, int8, signed char)         \
    M(__VA_ARGS__, uint8, unsigned char)      \
    M(__VA_ARGS__, int16, short)              \
    M(__VA_ARGS__, uint16, unsigned short)    \
    M(__VA_ARGS__, int32, int)
PER_STORAGE(CLIP, _)
#define BINARY_B(A, TA) PER_STORAGE(BINARY, A, TA)
BINARY_B(int8, signed char)
BINARY_B(uint8, unsigned char)
BINARY_B(int16, short)
BINARY_B(uint16, unsigned short)
BINARY_B(int32, int)

#define REQUANTIZE_ROWS(IN, TIN, OUT, TOUT)                                                                \
    extern "C" __global__ void requantize_rows_##IN##_##OUT(const TIN* q, REQUANT_PARAMS, const i64* bidx,  \
                                                            i64 total, LAYOUT_ARGS, REQUANT_BOUNDS, i64 row, \
                                                            i64 stride, TOUT* out) {                         \
        requantize_rows_body<TIN, TOUT>(q, REQUANT, bidx, total, LAYOUT, row, stride, out);                 \
    }
#define REQUANTIZE_ROWS_OUT(IN, TIN) PER_STORAGE(REQUANTIZE_ROWS, IN, TIN)
REQUANTIZE_ROWS_OUT(int8, signed char)
REQUANTIZE_ROWS_OUT(uint8, unsigned char)
REQUANTIZE_ROWS_OUT(int16, short)
REQUANTIZE_ROWS_OUT(uint16, unsigned short)
REQUANTIZE_ROWS_OUT(int32, int)
REQUANTIZE_ROWS_OUT(int64, long long)
