/* tests/emu/simt_emu.h: enough of CUDA to run a kernel's own source on the
 * host, for the kernels whose logic must be checked where no GPU exists
 * (CI, the development machines). One POSIX thread per CUDA thread of a
 * block, blocks one after another; __syncthreads is a barrier of the block,
 * warp shuffles, mma.sync and ldmatrix are exchanges among the 32 threads of
 * a warp through a per-warp barrier. The mma and ldmatrix helpers implement
 * the fragment layouts of the PTX ISA (mma.m16n8k16 .bf16 with .f32
 * accumulators; ldmatrix .m8n8 .x4 .trans) and accumulate in fp32 like the
 * hardware; the real ones are inline PTX in the kernel's header, compiled
 * out under CS_SIMT_EMU. What this cannot show: timing, the memory model
 * beyond barriers, the hardware's own rounding inside an mma (it sums the 16
 * products in a different order), anything about occupancy or registers.
 * C++17, host only. */
#ifndef CS_TESTS_EMU_SIMT_EMU_H
#define CS_TESTS_EMU_SIMT_EMU_H

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
struct float2 {
    float x, y;
};
static inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return {a, b}; }

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
inline float bf16_f32(uint16_t v) { return f32((uint32_t)v << 16); }

constexpr int MAX_WARPS = 32;
struct Block {
    pthread_barrier_t block, warp[MAX_WARPS];
    uint32_t words[MAX_WARPS][32][8]; /* what each lane offers to its warp */
    const void *ptrs[MAX_WARPS][32];
};
inline Block *&block() {
    static Block *b;
    return b;
}
inline thread_local unsigned tid, bx, by, bz;
inline dim3 grid_dim, block_dim; /* of the running launch */
inline int warp_of() { return (int)tid >> 5; }
inline int lane_of() { return (int)tid & 31; }
inline void warp_sync() { pthread_barrier_wait(&block()->warp[warp_of()]); }

/* Runs fn for every thread of every block of grid, threads per block a
 * multiple of 32 (at most 1024). */
inline void launch(dim3 grid, unsigned threads, const std::function<void()> &fn) {
    Block *b = new Block;
    block() = b;
    grid_dim = grid, block_dim = dim3(threads);
    pthread_barrier_init(&b->block, nullptr, threads);
    for (unsigned w = 0; w < threads / 32; w++)
        pthread_barrier_init(&b->warp[w], nullptr, 32);
    struct Arg {
        unsigned t;
        dim3 grid;
        const std::function<void()> *fn;
    };
    std::vector<pthread_t> th(threads);
    std::vector<Arg> args(threads);
    for (unsigned t = 0; t < threads; t++) {
        args[t] = {t, grid, &fn};
        pthread_create(
            &th[t], nullptr,
            [](void *p) -> void * {
                Arg *a = (Arg *)p;
                tid = a->t;
                for (unsigned z = 0; z < a->grid.z; z++)
                    for (unsigned y = 0; y < a->grid.y; y++)
                        for (unsigned x = 0; x < a->grid.x; x++) {
                            bx = x, by = y, bz = z;
                            (*a->fn)();
                            pthread_barrier_wait(&block()->block); /* the block is done with its shared memory */
                        }
                return nullptr;
            },
            &args[t]);
    }
    for (unsigned t = 0; t < threads; t++)
        pthread_join(th[t], nullptr);
    pthread_barrier_destroy(&b->block);
    for (unsigned w = 0; w < threads / 32; w++)
        pthread_barrier_destroy(&b->warp[w]);
    delete b;
}
} // namespace simt

/* threadIdx / blockIdx of the calling emulated thread */
#define threadIdx (dim3(simt::tid))
#define blockIdx (dim3(simt::bx, simt::by, simt::bz))
#define blockDim (simt::block_dim)
#define gridDim (simt::grid_dim)

static inline void __syncthreads() { pthread_barrier_wait(&simt::block()->block); }

static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    int w = simt::warp_of(), l = simt::lane_of();
    simt::block()->words[w][l][0] = simt::u32(v);
    simt::warp_sync();
    float r = simt::f32(simt::block()->words[w][l ^ lane_mask][0]);
    simt::warp_sync();
    return r;
}

static inline float __uint_as_float(uint32_t u) { return simt::f32(u); }
struct __nv_bfloat16 {
    uint16_t x;
};
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {simt::bf16_rn(f)}; }
struct __nv_bfloat162 {
    uint16_t x, y;
};
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {simt::bf16_rn(a), simt::bf16_rn(b)};
}
static inline float __low2float(__nv_bfloat162 v) { return simt::bf16_f32(v.x); }
static inline float __high2float(__nv_bfloat162 v) { return simt::bf16_f32(v.y); }

/* the PTX helpers of kernels/cuda/attention.cuh */
static inline uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)simt::bf16_rn(lo) | ((uint32_t)simt::bf16_rn(hi) << 16);
}

/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b */
static inline void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    int w = simt::warp_of(), l = simt::lane_of();
    uint32_t *mine = simt::block()->words[w][l];
    for (int i = 0; i < 4; i++)
        mine[i] = a[i];
    mine[4] = b0, mine[5] = b1;
    simt::warp_sync();
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
    simt::warp_sync();
    int g = l >> 2, c = l & 3;
    const int dr[4] = {g, g, g + 8, g + 8}, dc[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
    for (int i = 0; i < 4; i++) {
        float s = 0.0f;
        for (int k = 0; k < 16; k++)
            s += A[dr[i]][k] * B[k][dc[i]];
        d[i] += s;
    }
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
