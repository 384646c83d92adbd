/* kv_pack.cu: KV pages <-> a contiguous device buffer: the staging of the
 * backend's kv_export/kv_import (backend_cuda.c, then host memory) and the
 * buffer the NCCL KV transport hands to ncclSend / fills with ncclRecv
 * (kvx/src/kvx_payload_nccl.c). One pass per direction: the copy and, when
 * asked, the chunk's checksum (the "KV sum" of kvx/src/kvx-impl.h) read
 * each byte once.
 *
 * Layout: a block column (blockIdx.y) walks pages, its blocks (blockIdx.x)
 * stride over the page in 16-byte vectors (8-byte when page_bytes is not a
 * multiple of 16). The sum is order-independent (a sum of per-word hashes of
 * (word, index in the staging buffer)), so each warp adds its part with one
 * 64-bit atomic and the result does not depend on the launch shape. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_impl.h"

#define LAUNCH_CHECK() CS_CUDA_CHECK(cudaGetLastError())

/* Must match cs__kvx_sum_mix (kvx/src/kvx-impl.h); tests/gpu/test_kvx_nccl.c
 * checks both against each other. */
static __device__ __forceinline__ unsigned long long kv_mix(unsigned long long w,
                                                            unsigned long long i) {
    unsigned long long z = w + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static __device__ __forceinline__ unsigned long long vec_sum(uint4 d, size_t word) {
    return kv_mix(((unsigned long long)d.y << 32) | d.x, word) +
           kv_mix(((unsigned long long)d.w << 32) | d.z, word + 1);
}
static __device__ __forceinline__ unsigned long long vec_sum(uint2 d, size_t word) {
    return kv_mix(((unsigned long long)d.y << 32) | d.x, word);
}

/* V: uint4 (2 words) or uint2 (1 word); page_vecs vectors per page. */
template <typename V, bool TO_PAGES, bool SUM>
__global__ void k_kv_pack(V *pool, V *stage, const int32_t *ids, int n, size_t page_vecs,
                          unsigned long long *sum) {
    const size_t words_per_vec = sizeof(V) / 8;
    unsigned long long acc = 0;
    for (int p = blockIdx.y; p < n; p += gridDim.y) {
        V *pg = pool + (size_t)ids[p] * page_vecs;
        V *st = stage + (size_t)p * page_vecs;
        for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < page_vecs;
             v += (size_t)gridDim.x * blockDim.x) {
            V d;
            if (TO_PAGES) {
                d = st[v];
                pg[v] = d;
            } else {
                d = pg[v];
                st[v] = d;
            }
            if (SUM) acc += vec_sum(d, ((size_t)p * page_vecs + v) * words_per_vec);
        }
    }
    if (SUM) {
        for (int o = 16; o > 0; o >>= 1)
            acc += __shfl_down_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31) == 0 && acc) atomicAdd(sum, acc);
    }
}

template <typename V, bool TO_PAGES>
static void launch_v(void *pool, void *stage, const int32_t *ids, int32_t n, size_t page_bytes,
                     unsigned long long *sum, cudaStream_t s) {
    size_t page_vecs = page_bytes / sizeof(V);
    size_t bx = (page_vecs + 255) / 256;
    if (bx > 64) bx = 64;
    if (bx < 1) bx = 1;
    dim3 grid((unsigned)bx, (unsigned)(n < 65535 ? n : 65535));
    auto *with_sum = k_kv_pack<V, TO_PAGES, true>, *without = k_kv_pack<V, TO_PAGES, false>;
    if (sum)
        CS_LAUNCH(with_sum, grid, 256, s, (V *)pool, (V *)stage, ids, n, page_vecs, sum);
    else
        CS_LAUNCH(without, grid, 256, s, (V *)pool, (V *)stage, ids, n, page_vecs, NULL);
    LAUNCH_CHECK();
}

template <bool TO_PAGES>
static void launch(void *pool, void *stage, const int32_t *ids, int32_t n, size_t page_bytes,
                   unsigned long long *sum, cudaStream_t s) {
    if (sum) CS_CUDA_CHECK(cudaMemsetAsync(sum, 0, sizeof *sum, s));
    if (n <= 0) return;
    /* cudaMalloc'd bases are 256-byte aligned: pages stay 16-byte aligned
     * when page_bytes is a multiple of 16 */
    bool v16 = page_bytes % 16 == 0 && ((uintptr_t)pool | (uintptr_t)stage) % 16 == 0;
    if (v16)
        launch_v<uint4, TO_PAGES>(pool, stage, ids, n, page_bytes, sum, s);
    else
        launch_v<uint2, TO_PAGES>(pool, stage, ids, n, page_bytes, sum, s);
}

extern "C" void cs_cuda_kv_gather(const void *pool, size_t page_bytes, const int32_t *ids,
                                   int32_t n, void *staging, unsigned long long *sum,
                                   cudaStream_t s) {
    launch<false>((void *)pool, staging, ids, n, page_bytes, sum, s);
}

extern "C" void cs_cuda_kv_scatter(void *pool, size_t page_bytes, const int32_t *ids, int32_t n,
                                    const void *staging, unsigned long long *sum, cudaStream_t s) {
    launch<true>(pool, (void *)staging, ids, n, page_bytes, sum, s);
}
