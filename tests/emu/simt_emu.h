/* tests/emu/simt_emu.h: enough of CUDA to run a kernel's own source on the
 * host, for the kernels whose logic must be checked where no GPU exists
 * (CI, the development machines). Every CUDA thread of a block is a fiber
 * (ucontext) on the calling thread; blocks run one after another; fibers
 * switch only at __syncthreads (a barrier of the block) and at warp
 * exchanges (shuffles, mma.sync, ldmatrix: a barrier of the 32 lanes). The
 * mma and ldmatrix helpers implement the fragment layouts of the PTX ISA
 * (mma.m16n8k16 .bf16 with .f32 accumulators; ldmatrix .m8n8 .x4 .trans)
 * and accumulate in fp32 like the hardware; the real ones are inline PTX in
 * the kernel's header, compiled out under CS_SIMT_EMU. Fiber switches are
 * annotated for AddressSanitizer. What this cannot show: timing, the memory
 * model beyond barriers, the hardware's own rounding inside an mma (it sums
 * the 16 products in another order), anything about occupancy or
 * registers. C++17, host only. */
#ifndef CS_TESTS_EMU_SIMT_EMU_H
#define CS_TESTS_EMU_SIMT_EMU_H

#include <pthread.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define CS_SIMT_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static /* one copy per kernel instantiation: blocks run one at a time */
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)

using std::max;
using std::min;

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct uint2 {
    uint32_t x, y;
};
struct float2 {
    float x, y;
};
static inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return {a, b, c, d};
}
static inline float2 make_float2(float a, float b) {
    return {a, b};
}

namespace simt {
inline float f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline uint32_t u32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
inline uint16_t bf16_rn(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u = u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
inline float bf16_f32(uint16_t v) {
    return f32((uint32_t)v << 16);
}

constexpr int MAX_WARPS = 32;

/* One emulated thread: a fiber (ucontext) with its own stack. */
struct Fiber {
    ucontext_t ctx;
    char *stack;
    unsigned tid;
    bool done;
    void *asan_fake; /* ASan's fake stack while switched away */
};
/* The running block: its fibers, barriers (arrival counts and generations)
 * and what each lane offers to its warp. */
struct Block {
    std::vector<Fiber> fibers;
    unsigned n_threads;
    unsigned block_count, block_gen;
    unsigned warp_count[MAX_WARPS], warp_gen[MAX_WARPS];
    uint32_t words[MAX_WARPS][32][8];
    const void *ptrs[MAX_WARPS][32];
    ucontext_t sched;
    const void *sched_bottom;
    size_t sched_size;
    const std::function<void()> *fn;
    unsigned long yields; /* switches so far in this launch */
    bool direct;          /* threads run as plain calls: the kernel never synchronizes */
};
inline Block *&block() {
    static Block *b;
    return b;
}
inline Fiber *&cur() {
    static Fiber *f;
    return f;
}
inline unsigned bx, by, bz;
inline dim3 grid_dim, block_dim; /* of the running launch */
inline unsigned tid() {
    return cur()->tid;
}
inline int warp_of() {
    return (int)tid() >> 5;
}
inline int lane_of() {
    return (int)tid() & 31;
}

#if defined(__SANITIZE_ADDRESS__)
#define CS_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CS_SIMT_ASAN 1
#endif
#endif
#ifdef CS_SIMT_ASAN
extern "C" void __sanitizer_start_switch_fiber(void **fake_stack_save, const void *bottom,
                                               size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void *fake_stack_save, const void **bottom_old,
                                                size_t *size_old);
#endif
/* A fiber's stack, with a PROT_NONE guard page below it: an overflow faults
 * instead of writing into a neighbour. Small on purpose: ASan clears a
 * stack's shadow at every switch into it. */
constexpr size_t STACK = 64 << 10, GUARD = 4096;

/* Back to the scheduler (the fiber resumes where it left). */
inline void yield() {
    Block *b = block();
    Fiber *f = cur();
    if (b->direct) {
        fprintf(stderr,
                "simt_emu: a kernel synchronized in a block after its first block did not\n");
        abort();
    }
    b->yields++;
#ifdef CS_SIMT_ASAN
    __sanitizer_start_switch_fiber(f->done ? nullptr : &f->asan_fake, b->sched_bottom,
                                   b->sched_size);
#endif
    swapcontext(&f->ctx, &b->sched);
#ifdef CS_SIMT_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, &b->sched_bottom, &b->sched_size);
#endif
}
inline void fiber_main(int index) {
    Block *b = block();
#ifdef CS_SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &b->sched_bottom, &b->sched_size);
#endif
    (*b->fn)();
    b->fibers[index].done = true;
    yield(); /* never resumed */
}

/* Waits until count threads have arrived (count, gen: a barrier's state). */
inline void barrier(unsigned &count, unsigned &gen, unsigned n) {
    unsigned g = gen;
    if (++count == n) {
        count = 0, gen++;
        return;
    }
    while (gen == g)
        yield();
}
inline void warp_sync() {
    int w = warp_of();
    barrier(block()->warp_count[w], block()->warp_gen[w], 32);
}

/* Runs fn for every thread of every block of grid, threads per block a
 * multiple of 32 (at most 1024): blocks one after another, a block's
 * threads as fibers on the calling thread, switched at barriers only. When
 * the first block never switched (an elementwise kernel), the other blocks'
 * threads run as plain calls, one after another (a later block that does
 * synchronize aborts loudly). One launch at a time: launches from several
 * host threads (a worker's engine and its KV transport) take turns. */
inline void launch(dim3 grid, unsigned threads, const std::function<void()> &fn) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    struct unlock {
        ~unlock() {
            pthread_mutex_unlock(&mu);
        }
    } unlock_at_return;
    static char *stacks[1024]; /* reused by every launch; never freed (reachable) */
    for (unsigned t = 0; t < threads; t++)
        if (!stacks[t]) {
            void *m = mmap(nullptr, GUARD + STACK, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) abort();
            mprotect(m, GUARD, PROT_NONE);
            stacks[t] = (char *)m + GUARD;
        }
    Block *b = new Block();
    block() = b;
    b->fn = &fn, b->n_threads = threads;
    b->fibers.resize(threads);
    grid_dim = grid, block_dim = dim3(threads);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                bx = x, by = y, bz = z;
                if (b->direct) { /* no barrier in the first block: no fibers needed */
                    for (unsigned t = 0; t < threads; t++) {
                        b->fibers[t].tid = t;
                        cur() = &b->fibers[t];
                        fn();
                    }
                    continue;
                }
                for (unsigned t = 0; t < threads; t++) {
                    Fiber &f = b->fibers[t];
                    f.tid = t, f.done = false, f.stack = stacks[t], f.asan_fake = nullptr;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack, f.ctx.uc_stack.ss_size = STACK;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, (void (*)())fiber_main, 1, (int)t);
                }
                for (unsigned live = threads; live;) { /* round robin until every thread is done */
                    live = 0;
                    for (unsigned t = 0; t < threads; t++) {
                        Fiber &f = b->fibers[t];
                        if (f.done) continue;
                        cur() = &f;
#ifdef CS_SIMT_ASAN
                        void *fake = nullptr;
                        __sanitizer_start_switch_fiber(&fake, f.stack, STACK);
#endif
                        swapcontext(&b->sched, &f.ctx);
#ifdef CS_SIMT_ASAN
                        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
                        live += !f.done;
                    }
                }
                if (!b->yields) b->direct = true;
            }
    cur() = nullptr;
    block() = nullptr;
    delete b;
}
} // namespace simt

/* threadIdx / blockIdx of the calling emulated thread */
#define threadIdx (dim3(simt::tid()))
#define blockIdx (dim3(simt::bx, simt::by, simt::bz))
#define blockDim (simt::block_dim)
#define gridDim (simt::grid_dim)

static inline void __syncthreads() {
    simt::Block *b = simt::block();
    simt::barrier(b->block_count, b->block_gen, b->n_threads);
}

static inline unsigned long long __shfl_down_sync(unsigned, unsigned long long v, int delta) {
    int w = simt::warp_of(), l = simt::lane_of();
    memcpy(simt::block()->words[w][l], &v, 8);
    simt::warp_sync();
    unsigned long long r = v; /* lanes past the end keep their own value, as on the GPU */
    if (l + delta < 32) memcpy(&r, simt::block()->words[w][l + delta], 8);
    simt::warp_sync();
    return r;
}

static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    unsigned long long old = *p;
    *p = old + v;
    pthread_mutex_unlock(&mu);
    return old;
}

static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    int w = simt::warp_of(), l = simt::lane_of();
    simt::block()->words[w][l][0] = simt::u32(v);
    simt::warp_sync();
    float r = simt::f32(simt::block()->words[w][l ^ lane_mask][0]);
    simt::warp_sync();
    return r;
}

static inline float __uint_as_float(uint32_t u) {
    return simt::f32(u);
}
struct __nv_bfloat16 {
    uint16_t x;
};
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return {simt::bf16_rn(f)};
}
struct __nv_bfloat162 {
    uint16_t x, y;
};
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {simt::bf16_rn(a), simt::bf16_rn(b)};
}
static inline float __low2float(__nv_bfloat162 v) {
    return simt::bf16_f32(v.x);
}
static inline float __high2float(__nv_bfloat162 v) {
    return simt::bf16_f32(v.y);
}

/* the PTX helpers of kernels/cuda/attention.cuh */
static inline uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)simt::bf16_rn(lo) | ((uint32_t)simt::bf16_rn(hi) << 16);
}

/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b: the
 * lanes offer their fragments, the first one past the barrier computes the
 * 16x8 product for the warp, each lane adds its four elements. */
static inline void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    static float prod[simt::MAX_WARPS][32][4];
    static unsigned done_gen[simt::MAX_WARPS];
    int w = simt::warp_of(), l = simt::lane_of();
    uint32_t *mine = simt::block()->words[w][l];
    for (int i = 0; i < 4; i++)
        mine[i] = a[i];
    mine[4] = b0, mine[5] = b1;
    simt::warp_sync();
    unsigned gen = simt::block()->warp_gen[w];
    if (done_gen[w] != gen + 1) { /* this exchange's product is not computed yet */
        float A[16][16], B[16][8];
        for (int ln = 0; ln < 32; ln++) {
            const uint32_t *f = simt::block()->words[w][ln];
            int g = ln >> 2, c = ln & 3;
            const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {2 * c, 2 * c, 2 * c + 8, 2 * c + 8};
            for (int i = 0; i < 4; i++) {
                A[ar[i]][ac[i]] = simt::bf16_f32((uint16_t)f[i]);
                A[ar[i]][ac[i] + 1] = simt::bf16_f32((uint16_t)(f[i] >> 16));
            }
            for (int i = 0; i < 2; i++) {
                B[2 * c + 8 * i][g] = simt::bf16_f32((uint16_t)f[4 + i]);
                B[2 * c + 8 * i + 1][g] = simt::bf16_f32((uint16_t)(f[4 + i] >> 16));
            }
        }
        for (int ln = 0; ln < 32; ln++) {
            int g = ln >> 2, c = ln & 3;
            const int dr[4] = {g, g, g + 8, g + 8}, dc[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
            for (int i = 0; i < 4; i++) {
                float s = 0.0f;
                for (int k = 0; k < 16; k++)
                    s += A[dr[i]][k] * B[k][dc[i]];
                prod[w][ln][i] = s;
            }
        }
        done_gen[w] = gen + 1;
    }
    for (int i = 0; i < 4; i++)
        d[i] += prod[w][l][i];
    simt::warp_sync(); /* every lane has read its part before the next exchange */
}

/* ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 */
static inline void ldsm_x4_trans(uint32_t r[4], const uint16_t *row) {
    int w = simt::warp_of(), l = simt::lane_of();
    simt::block()->ptrs[w][l] = row;
    simt::warp_sync();
    int g = l >> 2, c = l & 3;
    for (int i = 0; i < 4; i++) {
        const uint16_t *r0 = (const uint16_t *)simt::block()->ptrs[w][8 * i + 2 * c];
        const uint16_t *r1 = (const uint16_t *)simt::block()->ptrs[w][8 * i + 2 * c + 1];
        r[i] = (uint32_t)r0[g] | ((uint32_t)r1[g] << 16);
    }
    simt::warp_sync();
}

#endif
