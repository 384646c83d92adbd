/* kernels.cu: the C launchers of cuda_impl.h over the CUDA backend's
 * kernels (kernels.cuh, attention.cuh; kv_pack.cu has its own). One .cu file
 * for them on purpose (nvcc is slow); the kernels sit in headers so that
 * tests/emu compiles the same source for the host. GEMMs are not here: they
 * go to cuBLAS (backend_cuda.c). Everything accumulates in fp32; weights, KV
 * and GEMM inputs are bf16.
 *
 * Fusions, and why: the QKV GEMM output is read once by one kernel that adds
 * the bias, applies RoPE and stores K/V into their pages (three passes over
 * (T, q+2kv) fp32 become one); the residual add rides in the cuBLAS epilogue
 * (beta = 1) of the o-proj and down-proj GEMMs, so RMSNorm reads x once
 * (with post norms, Gemma's, the GEMM writes a scratch row that one kernel
 * norms and adds); the gate activation reads the fused gate/up GEMM output
 * and writes the bf16 input of the down GEMM. Attention runs on tensor cores (mma.sync) for prompt
 * chunks and decode alike, split-K when few blocks meet long contexts; see docs/architecture.md. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "cuda_impl.h"
#include "kernels.cuh"
#include "attention.cuh"

#define LAUNCH_CHECK() CS_CUDA_CHECK(cudaGetLastError())

static unsigned blocks_for(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65535u * 16u ? 65535u * 16u : (b ? b : 1));
}

/* ---- embedding ---- */
extern "C" void cs__cuda_embed(float *x, const uint16_t *table, const int32_t *ids, int n_tokens,
                               int dim, float scale, cudaStream_t s) {
    if (n_tokens <= 0) return;
    CS_LAUNCH(k_embed, n_tokens, 256, s, x, table, ids, dim, scale);
    LAUNCH_CHECK();
}

/* ---- RMSNorm: one block per row ---- */
extern "C" void cs__cuda_rmsnorm(uint16_t *out16, float *out32, const float *x, const int32_t *rows,
                                 const float *w, int n_rows, int dim, float eps, cudaStream_t s) {
    if (n_rows <= 0) return;
    CS_LAUNCH(k_rmsnorm, n_rows, 256, s, out16, out32, x, rows, w, dim, eps);
    LAUNCH_CHECK();
}

/* ---- post norm + residual add: one block per row ---- */
extern "C" void cs__cuda_add_rmsnorm(float *x, const float *y, const float *w, int n_rows, int dim,
                                     float eps, cudaStream_t s) {
    if (n_rows <= 0) return;
    CS_LAUNCH(k_add_rmsnorm, n_rows, 256, s, x, y, w, dim, eps);
    LAUNCH_CHECK();
}

/* ---- bias + QK-norm + RoPE + KV store: one block per token ---- */
extern "C" void cs__cuda_qkv_rope_store(float *q, const float *qkv, const float *bias,
                                        const float *q_norm, const float *k_norm, float eps,
                                        const int32_t *pos, const float *inv_freq,
                                        const int32_t *page, const int32_t *slot, cs_cuda_kv kv,
                                        int layer, int n_tokens, int n_heads, int n_kv_heads,
                                        int head_dim, cudaStream_t s) {
    if (n_tokens <= 0) return;
    if (q_norm && n_heads + n_kv_heads > CS_CUDA_QK_NORM_HEADS)
        cs__cuda_fatal(__FILE__, __LINE__, "cs__cuda_qkv_rope_store", "shape",
                       "QK-norm needs at most 256 q + k heads");
    CS_LAUNCH(k_qkv_rope_store, n_tokens, 256, s, q, qkv, bias, q_norm, k_norm, eps, pos, inv_freq,
              page, slot, kv, layer, n_heads, n_kv_heads, head_dim);
    LAUNCH_CHECK();
}

/* ---- paged attention: the kernel is in attention.cuh ---- */
extern "C" int cs__cuda_attention_tile_rows(int n_heads, int n_kv_heads) {
    return ATT_ROWS / (n_heads / n_kv_heads);
}

extern "C" void cs__cuda_attention_scratch_size(int max_parts, int head_dim, size_t *o_floats,
                                                size_t *ml_floats) {
    *o_floats = (size_t)max_parts * ATT_ROWS * head_dim;
    *ml_floats = (size_t)max_parts * ATT_ROWS * 2;
}

/* Split-K policy: split only when the (tile, KV head) blocks cannot fill the
 * GPU and the longest context spans more than two key chunks; aim at two
 * blocks per SM, at least two chunks per split. The split depends on the
 * step's shape, so a row's attention may round differently in a small step
 * than in a large one (within bf16 of each other; decode vs prefill already
 * differ by their GEMMs). */
static cs_cuda_att_parts att_parts(const cs_cuda_att_scratch *sc, int n_tiles, int n_kv_heads,
                                   int max_ctx, int kc) {
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

extern "C" void cs__cuda_attention(uint16_t *out, const float *q, const cs_cuda_att_tile *tiles,
                                   int n_tiles, int max_ctx, const int32_t *pages, cs_cuda_kv kv,
                                   int layer, int n_heads, int n_kv_heads, int head_dim,
                                   float scale, int window, const cs_cuda_att_scratch *scratch,
                                   cudaStream_t s) {
    if (n_tiles <= 0) return;
    if (head_dim % 2 || head_dim > 256 || n_heads % n_kv_heads || n_heads / n_kv_heads > ATT_ROWS)
        cs__cuda_fatal(
            __FILE__, __LINE__, "cs__cuda_attention", "shape",
            "head_dim must be even and <= 256, n_heads a multiple of n_kv_heads, group <= 64");
    int vec16 = head_dim % 8 == 0;
    cs_cuda_att_parts sp =
        att_parts(scratch, n_tiles, n_kv_heads, max_ctx, head_dim <= 128 ? 64 : 32);
    dim3 grid((unsigned)n_tiles, (unsigned)n_kv_heads, (unsigned)sp.n);
#define ATT_LAUNCH(HDP, KC)                                                                        \
    do {                                                                                           \
        auto *kern =                                                                               \
            k_attention<HDP, KC>; /* one name: CS_LAUNCH's argument list splits at commas */       \
        CS_LAUNCH(kern, grid, 32 * ATT_WARPS, s, out, q, tiles, pages, kv, layer, n_heads,         \
                  n_kv_heads, head_dim, vec16, scale, window, sp);                                 \
    } while (0)
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
        CS_LAUNCH(k_attention_combine, dim3((unsigned)n_tiles, (unsigned)n_kv_heads),
                  32 * ATT_WARPS, s, out, tiles, n_heads, n_kv_heads, head_dim, sp);
        LAUNCH_CHECK();
    }
}

/* ---- the gate activation ---- */
extern "C" void cs__cuda_glu(uint16_t *out, const float *gu, int n_tokens, int hidden, int act,
                             cudaStream_t s) {
    size_t n = (size_t)n_tokens * hidden;
    if (!n) return;
    CS_LAUNCH(k_glu, blocks_for(n, 256), 256, s, out, gu, hidden, n, act);
    LAUNCH_CHECK();
}

/* ---- conversions and fills ---- */
extern "C" void cs__cuda_f32_to_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s) {
    if (!n) return;
    CS_LAUNCH(k_f32_to_bf16, blocks_for(n, 256), 256, s, dst, src, n);
    LAUNCH_CHECK();
}
extern "C" void cs__cuda_bf16_to_f32(float *dst, const uint16_t *src, size_t n, cudaStream_t s) {
    if (!n) return;
    CS_LAUNCH(k_bf16_to_f32, blocks_for(n, 256), 256, s, dst, src, n);
    LAUNCH_CHECK();
}
extern "C" void cs__cuda_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale,
                                   cudaStream_t s) {
    if (!n) return;
    CS_LAUNCH(k_fill_bf16, blocks_for(n, 256), 256, s, dst, n, seed, scale);
    LAUNCH_CHECK();
}
extern "C" void cs__cuda_fill_f32(float *dst, size_t n, float value, cudaStream_t s) {
    if (!n) return;
    CS_LAUNCH(k_fill_f32, blocks_for(n, 256), 256, s, dst, n, value);
    LAUNCH_CHECK();
}
