/* kernels.cu: the CUDA kernels of the CUDA backend, behind the C launchers of
 * cuda_impl.h. One .cu file on purpose (nvcc is slow). GEMMs are not here:
 * they go to cuBLAS (backend_cuda.c). Everything accumulates in fp32;
 * weights, KV and GEMM inputs are bf16.
 *
 * Fusions, and why: the QKV GEMM output is read once by one kernel that adds
 * the bias, applies RoPE and stores K/V into their pages (three passes over
 * (T, q+2kv) fp32 become one); the residual add rides in the cuBLAS epilogue
 * (beta = 1) of the o-proj and down-proj GEMMs, so RMSNorm reads x once;
 * SwiGLU reads the fused gate/up GEMM output and writes the bf16 input of the
 * down GEMM. Attention runs on tensor cores (mma.sync) for prompt chunks
 * and decode alike. Not here yet: split-K flash-decoding for long contexts
 * at small batch; see docs/architecture.md. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "cuda_impl.h"
#include "attention.cuh"

#define LAUNCH_CHECK() CS_CUDA_CHECK(cudaGetLastError())

static __device__ __forceinline__ float bf(uint16_t v) { return __uint_as_float((uint32_t)v << 16); }
static __device__ __forceinline__ uint16_t to_bf(float f) {
    __nv_bfloat16 h = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&h);
}

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static unsigned blocks_for(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65535u * 16u ? 65535u * 16u : (b ? b : 1));
}

/* ---- embedding ---- */
__global__ void k_embed(float *x, const uint16_t *table, const int32_t *ids, int dim) {
    int t = blockIdx.x;
    const uint16_t *row = table + (size_t)ids[t] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) x[(size_t)t * dim + i] = bf(row[i]);
}

extern "C" void cs__cuda_embed(float *x, const uint16_t *table, const int32_t *ids, int n_tokens, int dim,
                               cudaStream_t s) {
    if (n_tokens <= 0) return;
    k_embed<<<n_tokens, 256, 0, s>>>(x, table, ids, dim);
    LAUNCH_CHECK();
}

/* ---- RMSNorm: one block per row ---- */
__global__ void k_rmsnorm(uint16_t *out16, float *out32, const float *x, const int32_t *rows, const float *w,
                          int dim, float eps) {
    __shared__ float red[32];
    int r = blockIdx.x;
    const float *xr = x + (size_t)(rows ? rows[r] : r) * dim;
    float ss = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    float scale = 1.0f / sqrtf(red[0] / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = w[i] * (xr[i] * scale);
        if (out16) out16[(size_t)r * dim + i] = to_bf(v);
        if (out32) out32[(size_t)r * dim + i] = v;
    }
}

extern "C" void cs__cuda_rmsnorm(uint16_t *out16, float *out32, const float *x, const int32_t *rows, const float *w,
                                 int n_rows, int dim, float eps, cudaStream_t s) {
    if (n_rows <= 0) return;
    k_rmsnorm<<<n_rows, 256, 0, s>>>(out16, out32, x, rows, w, dim, eps);
    LAUNCH_CHECK();
}

/* ---- bias + RoPE + KV store: one block per token ---- */
__global__ void k_qkv_rope_store(float *q, const float *qkv, const float *bias, const int32_t *pos,
                                 const float *inv_freq, const int32_t *page, const int32_t *slot, cs_cuda_kv kv,
                                 int layer, int n_heads, int n_kv_heads, int head_dim) {
    int t = blockIdx.x, half = head_dim / 2;
    int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim, width = q_dim + 2 * kv_dim;
    const float *row = qkv + (size_t)t * width;
    uint16_t *kd = kv.pool + (size_t)page[t] * kv.page_elems + (size_t)layer * 2 * kv.page_size * kv_dim +
                   (size_t)slot[t] * kv_dim;
    uint16_t *vd = kd + (size_t)kv.page_size * kv_dim;
    float p = (float)pos[t];
    /* rotated pairs of q heads then k heads */
    int n_pairs = (n_heads + n_kv_heads) * half;
    for (int j = threadIdx.x; j < n_pairs; j += blockDim.x) {
        int h = j / half, i = j % half;
        int c0 = h * head_dim + i, c1 = c0 + half; /* k heads follow q heads in the row */
        float x0 = row[c0], x1 = row[c1];
        if (bias) x0 += bias[c0], x1 += bias[c1];
        float angle = p * inv_freq[i];
        float cs = cosf(angle), sn = sinf(angle);
        float y0 = x0 * cs - x1 * sn, y1 = x1 * cs + x0 * sn;
        if (h < n_heads) {
            q[(size_t)t * q_dim + c0] = y0;
            q[(size_t)t * q_dim + c1] = y1;
        } else {
            kd[c0 - q_dim] = to_bf(y0);
            kd[c1 - q_dim] = to_bf(y1);
        }
    }
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        int c = q_dim + kv_dim + i;
        vd[i] = to_bf(row[c] + (bias ? bias[c] : 0.0f));
    }
}

extern "C" void cs__cuda_qkv_rope_store(float *q, const float *qkv, const float *bias, const int32_t *pos,
                                        const float *inv_freq, const int32_t *page, const int32_t *slot,
                                        cs_cuda_kv kv, int layer, int n_tokens, int n_heads, int n_kv_heads,
                                        int head_dim, cudaStream_t s) {
    if (n_tokens <= 0) return;
    k_qkv_rope_store<<<n_tokens, 256, 0, s>>>(q, qkv, bias, pos, inv_freq, page, slot, kv, layer, n_heads, n_kv_heads,
                                              head_dim);
    LAUNCH_CHECK();
}

/* ---- paged attention: the kernel is in attention.cuh ---- */
extern "C" int cs__cuda_attention_tile_rows(int n_heads, int n_kv_heads) {
    return ATT_ROWS / (n_heads / n_kv_heads);
}

extern "C" void cs__cuda_attention_scratch_size(int max_parts, int head_dim, size_t *o_floats, size_t *ml_floats) {
    *o_floats = (size_t)max_parts * ATT_ROWS * head_dim;
    *ml_floats = (size_t)max_parts * ATT_ROWS * 2;
}

/* Split-K policy: split only when the (tile, KV head) blocks cannot fill the
 * GPU and the longest context spans more than two key chunks; aim at two
 * blocks per SM, at least two chunks per split. The split depends on the
 * step's shape, so a row's attention may round differently in a small step
 * than in a large one (within bf16 of each other; decode vs prefill already
 * differ by their GEMMs). */
static cs_cuda_att_parts att_parts(const cs_cuda_att_scratch *sc, int n_tiles, int n_kv_heads, int max_ctx, int kc) {
    cs_cuda_att_parts p = {NULL, NULL, 0, 1};
    long blocks = (long)n_tiles * n_kv_heads;
    if (!sc || !sc->o || blocks >= sc->n_sm || max_ctx <= 2 * kc) return p;
    long n = (2L * sc->n_sm + blocks - 1) / blocks, most = max_ctx / (2 * kc);
    if (n > most) n = most;
    if (n > sc->max_parts / blocks) n = sc->max_parts / blocks;
    if (n < 2) return p;
    int keys = (int)((max_ctx + n - 1) / n);
    keys = (keys + kc - 1) / kc * kc;
    p.o = sc->o, p.ml = sc->ml, p.keys = keys, p.n = (max_ctx + keys - 1) / keys;
    return p;
}

extern "C" void cs__cuda_attention(uint16_t *out, const float *q, const cs_cuda_att_tile *tiles, int n_tiles,
                                   int max_ctx, const int32_t *pages, cs_cuda_kv kv, int layer, int n_heads,
                                   int n_kv_heads, int head_dim, const cs_cuda_att_scratch *scratch, cudaStream_t s) {
    if (n_tiles <= 0) return;
    if (head_dim % 2 || head_dim > 256 || n_heads % n_kv_heads || n_heads / n_kv_heads > ATT_ROWS)
        cs__cuda_fatal(__FILE__, __LINE__, "cs__cuda_attention", "shape",
                       "head_dim must be even and <= 256, n_heads a multiple of n_kv_heads, group <= 64");
    int vec16 = head_dim % 8 == 0;
    cs_cuda_att_parts sp = att_parts(scratch, n_tiles, n_kv_heads, max_ctx, head_dim <= 128 ? 64 : 32);
    dim3 grid((unsigned)n_tiles, (unsigned)n_kv_heads, (unsigned)sp.n);
#define ATT_LAUNCH(HDP, KC)                                                                                    \
    k_attention<HDP, KC><<<grid, 32 * ATT_WARPS, 0, s>>>(out, q, tiles, pages, kv, layer, n_heads, n_kv_heads, \
                                                        head_dim, vec16, sp)
    if (head_dim <= 32)
        ATT_LAUNCH(32, 64);
    else if (head_dim <= 64)
        ATT_LAUNCH(64, 64);
    else if (head_dim <= 96)
        ATT_LAUNCH(96, 64);
    else if (head_dim <= 128)
        ATT_LAUNCH(128, 64);
    else
        ATT_LAUNCH(256, 32); /* 32 keys per chunk keeps K + V staging under 48 KiB */
#undef ATT_LAUNCH
    LAUNCH_CHECK();
    if (sp.keys) {
        k_attention_combine<<<dim3((unsigned)n_tiles, (unsigned)n_kv_heads), 32 * ATT_WARPS, 0, s>>>(
            out, tiles, n_heads, n_kv_heads, head_dim, sp);
        LAUNCH_CHECK();
    }
}

/* ---- SwiGLU ---- */
__global__ void k_swiglu(uint16_t *out, const float *gu, int hidden, size_t n) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        size_t t = e / hidden, i = e % hidden;
        float g = gu[t * 2 * hidden + i], u = gu[t * 2 * hidden + hidden + i];
        out[e] = to_bf(g / (1.0f + expf(-g)) * u);
    }
}

extern "C" void cs__cuda_swiglu(uint16_t *out, const float *gu, int n_tokens, int hidden, cudaStream_t s) {
    size_t n = (size_t)n_tokens * hidden;
    if (!n) return;
    k_swiglu<<<blocks_for(n, 256), 256, 0, s>>>(out, gu, hidden, n);
    LAUNCH_CHECK();
}

/* ---- page gather/scatter: one block row per page, 32-bit words ---- */
__global__ void k_pages_copy(uint32_t *pool, uint32_t *flat, const int32_t *pages, size_t page_words, int to_pages) {
    int i = blockIdx.y;
    uint32_t *pg = pool + (size_t)pages[i] * page_words, *fl = flat + (size_t)i * page_words;
    for (size_t w = blockIdx.x * (size_t)blockDim.x + threadIdx.x; w < page_words; w += (size_t)gridDim.x * blockDim.x) {
        if (to_pages)
            pg[w] = fl[w];
        else
            fl[w] = pg[w];
    }
}

extern "C" void cs__cuda_pages_copy(uint16_t *pool, void *flat, const int32_t *pages, int n, size_t page_bytes,
                                    int to_pages, cudaStream_t s) {
    if (n <= 0) return;
    size_t words = page_bytes / 4;
    unsigned bx = blocks_for(words, 256);
    if (bx > 64) bx = 64;
    dim3 grid(bx, (unsigned)n);
    k_pages_copy<<<grid, 256, 0, s>>>((uint32_t *)pool, (uint32_t *)flat, pages, words, to_pages);
    LAUNCH_CHECK();
}

/* ---- conversions and fills ---- */
__global__ void k_f32_to_bf16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = to_bf(src[i]);
}
__global__ void k_bf16_to_f32(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = bf(src[i]);
}
__global__ void k_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1); /* splitmix64 of the index */
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        float u = (float)(z >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
        dst[i] = to_bf(u * scale);
    }
}
__global__ void k_fill_f32(float *dst, size_t n, float v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = v;
}

extern "C" void cs__cuda_f32_to_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s) {
    if (!n) return;
    k_f32_to_bf16<<<blocks_for(n, 256), 256, 0, s>>>(dst, src, n);
    LAUNCH_CHECK();
}
extern "C" void cs__cuda_bf16_to_f32(float *dst, const uint16_t *src, size_t n, cudaStream_t s) {
    if (!n) return;
    k_bf16_to_f32<<<blocks_for(n, 256), 256, 0, s>>>(dst, src, n);
    LAUNCH_CHECK();
}
extern "C" void cs__cuda_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale, cudaStream_t s) {
    if (!n) return;
    k_fill_bf16<<<blocks_for(n, 256), 256, 0, s>>>(dst, n, seed, scale);
    LAUNCH_CHECK();
}
extern "C" void cs__cuda_fill_f32(float *dst, size_t n, float value, cudaStream_t s) {
    if (!n) return;
    k_fill_f32<<<blocks_for(n, 256), 256, 0, s>>>(dst, n, value);
    LAUNCH_CHECK();
}
