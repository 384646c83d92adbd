/* kernels/cuda/attention.h: the arguments of the attention kernel
 * (attention.cuh), in plain C: backend_cuda.c fills them, kernels.cu passes
 * them, and the host-side emulator test (tests/emu) builds them without the
 * CUDA headers. */
#ifndef CS_KERNELS_CUDA_ATTENTION_H
#define CS_KERNELS_CUDA_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* One query tile of the attention kernel: n_q (<=
 * cs__cuda_attention_tile_rows()) consecutive query rows of one span, rows
 * q_begin.., positions pos..; the span's page table starts at
 * pages[page_off]. */
typedef struct {
    int32_t q_begin, n_q, pos, page_off;
} cs_cuda_att_tile;

/* Geometry of the bf16 KV pool, page-major like the CPU backend's:
 *   pool[n_pages][n_layers][2 (K, V)][page_size][n_kv_heads * head_dim]
 * page_elems = n_layers * 2 * page_size * kv_dim. */
typedef struct {
    uint16_t *pool;
    size_t page_elems;
    int32_t page_size, kv_dim;
} cs_cuda_kv;

/* Rows of one attention block (query rows x the query heads of one KV
 * head): a tile holds CS_CUDA_ATT_ROWS / group query rows. */
#define CS_CUDA_ATT_ROWS 64

/* Split-K parts, as the kernel sees them: keys per split (0: no split) and
 * splits per (tile, KV head); o (parts, CS_CUDA_ATT_ROWS, head_dim) and ml
 * (parts, CS_CUDA_ATT_ROWS, 2) fp32 device buffers. */
typedef struct {
    float *o, *ml;
    int32_t keys, n;
} cs_cuda_att_parts;

/* What the launcher may split into: buffers for max_parts parts
 * (cs__cuda_attention_scratch_size), and the device's SM count, the
 * parallelism a grid should reach. */
typedef struct {
    float *o, *ml;
    int32_t max_parts, n_sm;
} cs_cuda_att_scratch;

#endif
