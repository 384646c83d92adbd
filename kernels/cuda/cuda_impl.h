/* kernels/cuda/cuda_impl.h: inside the CUDA backend: the error-check macros
 * and the kernel launchers of kernels.cu. All pointers here are device
 * pointers; bf16 tensors are passed as uint16_t so that C can name them.
 * Every launcher enqueues on stream and checks the launch (CS_CUDA_CHECK);
 * none synchronizes. Not a public header: only kernels/cuda and tests/gpu
 * include it. */
#ifndef CS_KERNELS_CUDA_IMPL_H
#define CS_KERNELS_CUDA_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "attention.h"
#include "chunkserve/kv_pack_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A kernel launch on stream s with no dynamic shared memory: kern<<<grid,
 * block, 0, s>>>(args); under the host SIMT emulator (tests/emu,
 * CS_SIMT_EMU) the same line runs the kernel's threads on the CPU. */
#ifdef __cplusplus
#ifdef CS_SIMT_EMU
#define CS_LAUNCH(kern, grid, block, s, ...)                                                       \
    simt::launch((grid), (block), [&] { kern(__VA_ARGS__); })
#else
#define CS_LAUNCH(kern, grid, block, s, ...) kern<<<(grid), (block), 0, (s)>>>(__VA_ARGS__)
#endif
#endif

/* Logs "cuda: <call> failed at file:line: <name>: <message>" and aborts:
 * a CUDA error leaves the device state unknown, so the worker dies and the
 * router fails its requests over (issue 8). */
#if defined(__GNUC__)
__attribute__((noreturn))
#endif
void cs__cuda_fatal(const char *file, int line, const char *call, const char *name, const char *msg);

#define CS_CUDA_CHECK(call)                                                                        \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            cs__cuda_fatal(__FILE__, __LINE__, #call, cudaGetErrorName(e_),                        \
                           cudaGetErrorString(e_));                                                \
    } while (0)

#define CS_CUBLAS_CHECK(call)                                                                      \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            cs__cuda_fatal(__FILE__, __LINE__, #call, cublasGetStatusName(s_),                     \
                           cublasGetStatusString(s_));                                             \
    } while (0)

/* out (rows) fp32 = bf16 weight W (rows, cols) . x (n_tokens, cols), into
 * out (n_tokens, rows) fp32: out = beta * out + W x (beta 1 fuses a
 * residual add into cuBLAS's epilogue). bf16 in, fp32 compute and out. */
void cs__cuda_gemm(cublasHandle_t h, float *out, const uint16_t *x, const uint16_t *w, int n_tokens,
                   int rows, int cols, float beta);

/* x (n_tokens, dim) fp32 = bf16 table rows ids[t] times scale. */
void cs__cuda_embed(float *x, const uint16_t *table, const int32_t *ids, int n_tokens, int dim,
                    float scale, cudaStream_t s);

/* RMSNorm: out row r (n_rows, dim) = x row (rows ? rows[r] : r) / rms * w,
 * written as bf16 (out16) and/or fp32 (out32, may be NULL). fp32 math. */
void cs__cuda_rmsnorm(uint16_t *out16, float *out32, const float *x, const int32_t *rows,
                      const float *w, int n_rows, int dim, float eps, cudaStream_t s);

/* x (n_rows, dim) += rmsnorm(y (n_rows, dim)) * w: a post norm and its
 * residual add in one pass. */
void cs__cuda_add_rmsnorm(float *x, const float *y, const float *w, int n_rows, int dim, float eps,
                          cudaStream_t s);

/* qkv (n_tokens, q_dim + 2 kv_dim) fp32 from the fused QKV GEMM:
 * adds bias (q_dim + 2 kv_dim or NULL), RMSNorms each q and k head by
 * q_norm / k_norm (head_dim each; both NULL: none; at most 256 q + k heads),
 * applies rotate-half RoPE at pos[t]
 * (angle pos * inv_freq[i] in fp32, like cs_op_rope_ref) to q and k, writes
 * q (n_tokens, q_dim) fp32 and K, V as bf16 into the pool slot of token t:
 * page page[t], slot slot[t], layer `layer`. One fused kernel: the QKV
 * output is read once. */
void cs__cuda_qkv_rope_store(float *q, const float *qkv, const float *bias, const float *q_norm,
                             const float *k_norm, float eps, const int32_t *pos,
                             const float *inv_freq, const int32_t *page, const int32_t *slot,
                             cs_cuda_kv kv, int layer, int n_tokens, int n_heads, int n_kv_heads,
                             int head_dim, cudaStream_t s);

/* Causal GQA attention over paged bf16 KV (same semantics as
 * cs_op_attention_ref: q . k times scale, a sliding window of `window`
 * positions when > 0) for the query tiles of one layer, on tensor cores
 * (attention.cuh): out (n_tokens, n_heads * head_dim) bf16 from q (fp32,
 * rounded to bf16 by the kernel). head_dim even and <= 256, at most 64 query
 * heads per KV head. max_ctx: the largest pos + n_q of the tiles. scratch
 * (NULL: never) lets a small grid over long contexts split its keys across
 * blocks (flash-decoding) and merge them in a second kernel. */
int cs__cuda_attention_tile_rows(int n_heads, int n_kv_heads);
void cs__cuda_attention_scratch_size(int max_parts, int head_dim, size_t *o_floats,
                                     size_t *ml_floats);
void cs__cuda_attention(uint16_t *out, const float *q, const cs_cuda_att_tile *tiles, int n_tiles,
                        int max_ctx, const int32_t *pages, cs_cuda_kv kv, int layer, int n_heads,
                        int n_kv_heads, int head_dim, float scale, int window,
                        const cs_cuda_att_scratch *scratch, cudaStream_t s);

/* out (n_tokens, hidden) bf16 = act(gate) * up (act: cs_act, backend.h:
 * silu or GELU's tanh form), where gu (n_tokens, 2 hidden) fp32 holds
 * [gate | up] per row (the fused gate/up GEMM). */
void cs__cuda_glu(uint16_t *out, const float *gu, int n_tokens, int hidden, int act,
                  cudaStream_t s);

/* kv_pack.cu: chunkserve/kv_pack_cuda.h (included above). */

/* fp32 -> bf16 (round to nearest even) and back, n elements. */
void cs__cuda_f32_to_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s);
void cs__cuda_bf16_to_f32(float *dst, const uint16_t *src, size_t n, cudaStream_t s);
/* dst[i] = bf16(scale * uniform(-1, 1)) from a counter hash of (seed, i):
 * random weights generated on the device; fill_f32 writes a constant. */
void cs__cuda_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale, cudaStream_t s);
void cs__cuda_fill_f32(float *dst, size_t n, float value, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
