// Host execution of qarray's CUDA kernels: the CUDA built-ins the kernels use,
// defined for an ordinary C++ compiler, and a launcher that runs a grid on the
// CPU. The threads of a block are fibers (ucontext), run round-robin, each
// until it waits at a barrier or finishes: __syncthreads waits for every live
// thread of the block, __syncwarp and the warp shuffles for every live lane of
// the warp. The harness (tests/cuda_host/harness.py) generates one
// launch_NAME per kernel with QA_HOST_LAUNCHER.
//
// No kinder than hardware, where the host could be:
// - blocks run one at a time but in a shuffled order, new for every launch;
// - shared memory (static, rewritten by harness.py into qa_host::shared, and
//   dynamic) holds garbage when each block starts, never zeros or the
//   previous block's values;
// - a shuffle checks its mask: the lane must be in it, every lane it names
//   must be live and at the same shuffle with the same mask, and the lane read
//   must be one of them; anything else aborts with a message.
//
// -DQA_HOST_BROKEN_BARRIER makes __syncthreads a no-op (the tests use it to
// show that a kernel needs its barriers, and that the fibers provide them).
#pragma once
#include <cmath>
#include <csetjmp>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <ucontext.h>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline dim3 blockIdx, threadIdx, blockDim, gridDim;  // threadIdx: the running fiber's
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __align__(n) __attribute__((aligned(n)))
// harness.py rewrites every __shared__ declaration; one it missed fails to compile
#define __shared__ qa_host_shared_declaration_not_rewritten

namespace qa_host {

enum State : unsigned char { RUN, AT_BLOCK, AT_WARP, DONE };

// A fiber starts once per launch (makecontext) and runs the kernel for every
// block; switches are _setjmp/_longjmp (no signal-mask system call, unlike
// swapcontext). Build with -U_FORTIFY_SOURCE: the checked longjmp refuses to
// jump between stacks.
struct Fiber { ucontext_t ctx; jmp_buf jb; State state; bool started; };

inline jmp_buf scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<char> stacks;
inline std::vector<unsigned long long> lane_value;  // the shuffles' per-thread slots
inline std::vector<unsigned> lane_mask;             // and the masks they gave
inline std::vector<unsigned char> dynamic_shared;   // extern __shared__ (rewritten to this)
inline constexpr size_t STACK = 64 * 1024;
inline void (*body)(void*);
inline void* body_ctx;
inline unsigned block_serial = 0;   // one per block run: shared memory is refilled on a new one
inline unsigned launch_serial = 0;  // seeds the block order and the garbage

inline void fill_garbage(void* p, size_t n) {
    std::minstd_rand g(block_serial * 2654435761u + 12345u);
    auto* b = static_cast<unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) b[i] = (unsigned char)(g() >> 7);
}

// __shared__ T name; (rewritten by harness.py to `auto& name = qa_host::shared<T>([]{});`,
// the lambda making one variable per declaration): garbage at the start of every block.
template <class T, class Site>
T& shared(Site) {
    alignas(16) static unsigned char storage[sizeof(T)];
    static unsigned seen = ~0u;
    if (seen != block_serial) {
        seen = block_serial;
        fill_garbage(storage, sizeof storage);
    }
    return *reinterpret_cast<T*>(storage);
}

inline void wait(State s) {
    Fiber& f = fibers[threadIdx.x];
    f.state = s;
    if (!_setjmp(f.jb)) _longjmp(scheduler, 1);
}

inline void entry() {
    for (;;) {  // one kernel body per block, for the whole launch
        body(body_ctx);
        wait(DONE);
    }
}

inline void resume(unsigned t) {
    Fiber& f = fibers[t];
    threadIdx.x = t;
    if (_setjmp(scheduler)) return;
    if (f.started) _longjmp(f.jb, 1);
    f.started = true;
    setcontext(&f.ctx);
}

// Run live fibers until all are done, releasing a barrier once every thread
// it waits for (live threads of the block, or of the warp) has reached it.
inline void run_block(unsigned n) {
    for (unsigned t = 0; t < n; ++t) fibers[t].state = RUN;
    for (;;) {
        bool ran = false;
        for (unsigned t = 0; t < n; ++t) {
            if (fibers[t].state != RUN) continue;
            resume(t);
            ran = true;
        }
        unsigned live = 0, at_block = 0;
        for (unsigned w = 0; w < n; w += 32) {
            unsigned wl = 0, ww = 0;
            for (unsigned t = w; t < n && t < w + 32; ++t) {
                wl += fibers[t].state != DONE;
                ww += fibers[t].state == AT_WARP;
                at_block += fibers[t].state == AT_BLOCK;
            }
            live += wl;
            if (ww && ww == wl)  // release the waiting lanes (an exited one stays exited)
                for (unsigned t = w; t < n && t < w + 32; ++t)
                    if (fibers[t].state == AT_WARP) fibers[t].state = RUN, ran = true;
        }
        if (live == 0) return;
        if (at_block == live) {
            for (unsigned t = 0; t < n; ++t)
                if (fibers[t].state == AT_BLOCK) fibers[t].state = RUN;
            ran = true;
        }
        if (!ran) {
            std::fprintf(stderr, "qa_host: deadlock in block %u (threads wait at different barriers)\n", blockIdx.x);
            std::abort();
        }
    }
}

inline void run_grid(unsigned grid, unsigned block, size_t shmem, void (*fn)(void*), void* ctx) {
    gridDim = dim3{grid, 1, 1};
    blockDim = dim3{block, 1, 1};
    body = fn;
    body_ctx = ctx;
    fibers.resize(block);
    stacks.resize(block * STACK);
    lane_value.resize(block);
    lane_mask.resize(block);
    dynamic_shared.resize(shmem);
    for (unsigned t = 0; t < block; ++t) {
        Fiber& f = fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks.data() + t * STACK;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;  // entry never returns
        makecontext(&f.ctx, entry, 0);
        f.started = false;
    }
    std::vector<unsigned> order(grid);
    for (unsigned b = 0; b < grid; ++b) order[b] = b;
    std::shuffle(order.begin(), order.end(), std::mt19937(++launch_serial));
    for (unsigned b : order) {
        blockIdx = dim3{b, 0, 0};
        ++block_serial;
        fill_garbage(dynamic_shared.data(), dynamic_shared.size());
        run_block(block);
    }
}

template <class... A, size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A>
void launch(void (*f)(A...), unsigned grid, unsigned block, size_t shmem, void** args) {
    struct Call { void (*f)(A...); void** args; } c{f, args};
    run_grid(grid, block, shmem, [](void* p) {
        auto* c = static_cast<Call*>(p);
        call(c->f, c->args, std::index_sequence_for<A...>{});
    }, &c);
}

// "p" for a pointer, "i4" / "u8" / "f4" ... for a scalar: what Python must pass.
template <class T>
std::string code() {
    if (std::is_pointer_v<T>) return "p";
    const char* k = std::is_floating_point_v<T> ? "f" : (std::is_signed_v<T> ? "i" : "u");
    return k + std::to_string(sizeof(T));
}

template <class... A>
const char* signature(void (*)(A...)) {
    static const std::string s = [] { std::string r; ((r += code<A>() + ","), ...); return r; }();
    return s.c_str();
}

[[noreturn]] inline void shuffle_error(const char* what, unsigned mask, unsigned lane) {
    std::fprintf(stderr, "qa_host: block %u thread %u: shuffle with mask 0x%08x %s (lane %u)\n", blockIdx.x,
                 threadIdx.x, mask, what, lane);
    std::abort();
}

// Lane src's value (v itself when keep: the source is out of range, as the
// hardware gives back), once every live lane of the warp has arrived; the
// mask must name exactly lanes that are live and here with the same mask.
template <class T>
T shuffle(unsigned mask, T v, int src, bool keep) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    const unsigned t = threadIdx.x, base = t & ~31u, lane = t & 31u;
    if (!(mask >> lane & 1u)) shuffle_error("that leaves out the calling lane", mask, lane);
    std::memcpy(&lane_value[t], &v, sizeof(T));
    lane_mask[t] = mask;
    wait(AT_WARP);
    for (unsigned l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        const unsigned u = base + l;
        if (u >= blockDim.x || fibers[u].state == DONE) shuffle_error("names a lane that is not running", mask, l);
        if (lane_mask[u] != mask) shuffle_error("differs from the mask of", mask, l);
    }
    T r = v;
    if (!keep) {
        if (src < 0 || src >= 32 || !(mask >> src & 1u)) shuffle_error("reads a lane outside it", mask, (unsigned)src);
        std::memcpy(&r, &lane_value[base + (unsigned)src], sizeof(T));
    }
    wait(AT_WARP);
    return r;
}

}  // namespace qa_host

// Everything else is hidden (-fvisibility=hidden): each built library keeps its own state.
#define QA_HOST_EXPORT __attribute__((visibility("default")))
#define QA_HOST_LAUNCHER(name)                                                              \
    extern "C" QA_HOST_EXPORT void launch_##name(unsigned grid, unsigned block, size_t shmem, void** args) { \
        qa_host::launch(name, grid, block, shmem, args);                                    \
    }                                                                                       \
    extern "C" QA_HOST_EXPORT const char* signature_##name() { return qa_host::signature(name); }

#ifdef QA_HOST_BROKEN_BARRIER
inline void __syncthreads() {}
#else
inline void __syncthreads() { qa_host::wait(qa_host::AT_BLOCK); }
#endif
inline void __syncwarp(unsigned = 0xffffffffu) { qa_host::wait(qa_host::AT_WARP); }

// Warp shuffles (width a power of two up to 32, as CUDA's), masks checked.
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    int lane = threadIdx.x & 31;
    return qa_host::shuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)), false);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = threadIdx.x & 31;
    return qa_host::shuffle(mask, v, lane + (int)d, (lane & (width - 1)) + (int)d >= width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = threadIdx.x & 31;
    return qa_host::shuffle(mask, v, lane - (int)d, (lane & (width - 1)) < (int)d);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    int lane = threadIdx.x & 31, src = lane ^ m;
    return qa_host::shuffle(mask, v, src, (src & ~(width - 1)) > (lane & ~(width - 1)));
}

// Atomics: fibers never interleave inside one, so plain read-modify-writes are atomic.
template <class T> T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> T atomicMax(T* p, T v) { T o = *p; *p = v > o ? v : o; return o; }
template <class T> T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }
template <class T> T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> T atomicCAS(T* p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }
template <class T> T __ldg(const T* p) { return *p; }

// Four products of signed bytes, summed with c in int32 arithmetic (wrapping, as the instruction).
inline int __dp4a(int a, int b, int c) {
    unsigned r = (unsigned)c;
    for (int j = 0; j < 4; ++j) r += (unsigned)((int)(signed char)(a >> (8 * j)) * (int)(signed char)(b >> (8 * j)));
    return (int)r;
}

// IEEE round-to-nearest arithmetic: plain operators on the host (built with
// -ffp-contract=off, so nothing is fused).
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
