/* kernels/cuda/kernels.cuh: the CUDA backend's kernels other than attention
 * (attention.cuh), launched by kernels.cu. A header so that tests/emu
 * compiles this very source for the host under its SIMT emulator (with
 * CS_SIMT_EMU the emulator provides the CUDA built-ins and types). */
#ifndef CS_KERNELS_CUDA_KERNELS_CUH
#define CS_KERNELS_CUDA_KERNELS_CUH

#include <stdint.h>

#include "attention.h"

static __device__ __forceinline__ float bf(uint16_t v) {
    return __uint_as_float((uint32_t)v << 16);
}
static __device__ __forceinline__ uint16_t to_bf(float f) {
    __nv_bfloat16 h = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&h);
}

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ---- embedding: one block per token, rows times scale ---- */
__global__ void k_embed(float *x, const uint16_t *table, const int32_t *ids, int dim, float scale) {
    int t = blockIdx.x;
    const uint16_t *row = table + (size_t)ids[t] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t)t * dim + i] = scale == 1.0f ? bf(row[i]) : bf(row[i]) * scale;
}

/* 1 / rms of row xr (dim), summed by the whole block (every thread gets it). */
static __device__ float block_inv_rms(const float *xr, int dim, float eps) {
    __shared__ float red[32];
    float ss = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    return 1.0f / sqrtf(red[0] / (float)dim + eps);
}

/* ---- RMSNorm: one block per row ---- */
__global__ void k_rmsnorm(uint16_t *out16, float *out32, const float *x, const int32_t *rows,
                          const float *w, int dim, float eps) {
    int r = blockIdx.x;
    const float *xr = x + (size_t)(rows ? rows[r] : r) * dim;
    float scale = block_inv_rms(xr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = w[i] * (xr[i] * scale);
        if (out16) out16[(size_t)r * dim + i] = to_bf(v);
        if (out32) out32[(size_t)r * dim + i] = v;
    }
}

/* ---- post norm + residual add: x row r += rmsnorm(y row r) * w; one block per row ---- */
__global__ void k_add_rmsnorm(float *x, const float *y, const float *w, int dim, float eps) {
    int r = blockIdx.x;
    const float *yr = y + (size_t)r * dim;
    float scale = block_inv_rms(yr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t)r * dim + i] += w[i] * (yr[i] * scale);
}

/* ---- bias + QK-norm + RoPE + KV store: one block per token ----
 * With q_norm / k_norm (head_dim each, both or neither), each q and k head is
 * RMSNormed (after the bias, before RoPE): one warp per head sums its squares
 * into rms[] first; at most CS_CUDA_QK_NORM_HEADS q + k heads. */
#define CS_CUDA_QK_NORM_HEADS 256
__global__ void k_qkv_rope_store(float *q, const float *qkv, const float *bias, const float *q_norm,
                                 const float *k_norm, float eps, const int32_t *pos,
                                 const float *inv_freq, const int32_t *page, const int32_t *slot,
                                 cs_cuda_kv kv, int layer, int n_heads, int n_kv_heads,
                                 int head_dim) {
    __shared__ float rms[CS_CUDA_QK_NORM_HEADS]; /* 1 / rms of each q then k head */
    int t = blockIdx.x, half = head_dim / 2;
    int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim, width = q_dim + 2 * kv_dim;
    const float *row = qkv + (size_t)t * width;
    uint16_t *kd = kv.pool + (size_t)page[t] * kv.page_elems +
                   (size_t)layer * 2 * kv.page_size * kv_dim + (size_t)slot[t] * kv_dim;
    uint16_t *vd = kd + (size_t)kv.page_size * kv_dim;
    float p = (float)pos[t];
    if (q_norm) {
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        for (int h = warp; h < n_heads + n_kv_heads; h += blockDim.x >> 5) {
            float ss = 0;
            for (int i = lane; i < head_dim; i += 32) {
                int c = h * head_dim + i;
                float x = row[c] + (bias ? bias[c] : 0.0f);
                ss += x * x;
            }
            ss = warp_sum(ss);
            if (lane == 0) rms[h] = 1.0f / sqrtf(ss / (float)head_dim + eps);
        }
        __syncthreads();
    }
    /* rotated pairs of q heads then k heads */
    int n_pairs = (n_heads + n_kv_heads) * half;
    for (int j = threadIdx.x; j < n_pairs; j += blockDim.x) {
        int h = j / half, i = j % half;
        int c0 = h * head_dim + i, c1 = c0 + half; /* k heads follow q heads in the row */
        float x0 = row[c0], x1 = row[c1];
        if (bias) x0 += bias[c0], x1 += bias[c1];
        if (q_norm) {
            const float *w = h < n_heads ? q_norm : k_norm;
            x0 = w[i] * (x0 * rms[h]), x1 = w[i + half] * (x1 * rms[h]);
        }
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

/* ---- the gate activation: SwiGLU (act 0) or GeGLU, GELU's tanh form as
 * x / (1 + e^-2u) (ops.h cs_op_glu) ---- */
__global__ void k_glu(uint16_t *out, const float *gu, int hidden, size_t n, int act) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t t = e / hidden, i = e % hidden;
        float g = gu[t * 2 * hidden + i], u = gu[t * 2 * hidden + hidden + i];
        float x = act == 0 ? -g : -1.5957691216057308f * (g + 0.044715f * g * g * g);
        out[e] = to_bf(g / (1.0f + expf(x)) * u);
    }
}

/* ---- conversions and fills ---- */
__global__ void k_f32_to_bf16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = to_bf(src[i]);
}
__global__ void k_bf16_to_f32(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = bf(src[i]);
}
__global__ void k_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1); /* splitmix64 of the index */
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        float u = (float)(z >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
        dst[i] = to_bf(u * scale);
    }
}
__global__ void k_fill_f32(float *dst, size_t n, float v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = v;
}

#endif
