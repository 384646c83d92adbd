/* kernels/cpu/ops.h: the CPU kernels the CPU backend is built from, and a
 * small thread pool to run them on.
 *
 * Every op has two forms: `cs_op_X_ref` is the plain-loop specification
 * (single-threaded, readable, what the tests trust) and `cs_op_X` is the fast
 * path (threaded on the pool, vectorized, BLAS for GEMM), tested against the
 * reference by normalized error in tests/unit/test_cpu_ops.c.
 * Dimension names: n_tokens, n_heads, n_kv_heads, head_dim, page_size. All
 * matrices are row-major fp32. Not a general tensor library. */
#ifndef CS_KERNELS_CPU_OPS_H
#define CS_KERNELS_CPU_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/backend.h"
#include "chunkserve/half.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- thread pool ---- */
/* Fast ops take a pool; NULL runs them on the caller alone. Whatever the
 * pool size, a fast op's output is bit-for-bit the same (work is cut by
 * shape, never by thread count), so results don't depend on the machine.
 * Ops keep no state between calls: different pools may run ops at the same
 * time. */
typedef struct cs_threadpool cs_threadpool;
/* n_threads <= 0: cs_threadpool_default_size(). Between jobs workers poll for up to
 * 50 us (yielding the CPU as they go), then sleep on a futex, so an idle
 * engine costs no CPU; signals are blocked on them. Free with cs_threadpool_free. CS_EINVAL above
 * 1024 threads, CS_EAGAIN or CS_ENOMEM when threads cannot be started. */
int cs_threadpool_init(int n_threads, cs_threadpool **out);
/* The CPUs this process may use: its affinity mask, capped by a cgroup CPU
 * quota (a container's CPU limit, v2 cpu.max or v1 cfs_quota_us) rounded
 * up; at most 1024. */
int cs_threadpool_default_size(void);
void cs_threadpool_free(cs_threadpool *pool);      /* NULL is a no-op */
int cs_threadpool_size(const cs_threadpool *pool); /* 1 for NULL */
/* Splits [0, n) into one contiguous range per thread, calls
 * fn(arg, begin, end, range) for each non-empty one and returns when all are
 * done. The split depends only on n and the pool size; range is the index
 * of [begin, end) in it (0 .. size-1), so per-range scratch is indexed by
 * it. Each range runs on whichever thread claims it first (the caller or a
 * worker; one thread may run several, one after the other), so a worker the
 * scheduler has not run yet holds nothing up. Not reentrant: one job at a
 * time per pool. */
typedef void (*cs_range_fn)(void *arg, int64_t begin, int64_t end, int range);
void cs_threadpool_for(cs_threadpool *pool, int64_t n, cs_range_fn fn, void *arg);

/* Debian 12's OpenBLAS 0.3.21 does not know the newest Xeons and falls back
 * to its SSE3 ("Prescott") kernels, 4-5x slower. It reads OPENBLAS_CORETYPE
 * only when it loads, so when it made that choice, the environment names no
 * core type and the CPU has AVX-512 (AVX2), this restarts the process (execv
 * of /proc/self/exe with argv) with OPENBLAS_CORETYPE=SkylakeX (Haswell).
 * Call first thing in main, before any thread exists. Returns when nothing
 * needs doing or the exec failed. */
void cs_op_blas_fix_coretype(char **argv);

/* The integer kernels (cpu/qmat.h) as a benchmark reports them: "generic",
 * "avx2", "avx-512 vnni" or "amx"; and the int8 multiply-accumulates per
 * second of the whole pool, every thread in the vpdpbusd loop (amx false) or
 * the tile loop (amx true) for about `seconds` (0 where those kernels do not
 * run). */
const char *cs_qmat_kernels_name(void);
double cs_qmat_peak_macs(cs_threadpool *pool, double seconds, bool amx);

/* ---- dense ops ---- */
/* out (n_tokens, rows) = x (n_tokens, cols) * w (rows, cols)^T (+ bias (rows) if not NULL).
 * The fast path calls OpenBLAS single-threaded on fixed tiles spread over
 * the pool, and sets OpenBLAS's own thread count to 1 (process-wide) on
 * first use; out must not overlap x, w or bias. */
void cs_op_matmul_ref(float *out, const float *x, const float *w, const float *bias, int n_tokens,
                      int rows, int cols);
void cs_op_matmul(cs_threadpool *pool, float *out, const float *x, const float *w,
                  const float *bias, int n_tokens, int rows, int cols);

/* out (n_tokens, dim) = x / sqrt(mean(x^2) + eps) * w; out may equal x */
void cs_op_rmsnorm_ref(float *out, const float *x, const float *w, int n_tokens, int dim,
                       float eps);
void cs_op_rmsnorm(cs_threadpool *pool, float *out, const float *x, const float *w, int n_tokens,
                   int dim, float eps);

/* In-place rotate-half RoPE on x (n_tokens, n_heads * head_dim); token t is at
 * position pos[t]; angle_i = pos * inv_freq[i] in fp32 (Hugging Face order).
 * The fast path is bit-identical to the reference; head_dim <= 512. */
void cs_op_rope_ref(float *x, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                    const float *inv_freq);
void cs_op_rope(cs_threadpool *pool, float *x, int n_tokens, int n_heads, int head_dim,
                const int32_t *pos, const float *inv_freq);

/* The gated FFN's activation: out[i] = act(gate[i]) * up[i] for n elements,
 * act = silu (SwiGLU: x / (1 + e^-x)) or GELU's tanh form (GeGLU:
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's
 * gelu(approximate="tanh"), computed as x / (1 + e^-2u), the same function);
 * out may equal gate. */
void cs_op_glu_ref(float *out, const float *gate, const float *up, size_t n, cs_act act);
void cs_op_glu(cs_threadpool *pool, float *out, const float *gate, const float *up, size_t n,
               cs_act act);

/* out (n_tokens, dim) = table rows ids[t] */
void cs_op_embed(float *out, const float *table, const int32_t *ids, int n_tokens, int dim);

/* ---- paged KV and attention ---- */
/* Where one layer's K and V live. Token at position p of a sequence whose
 * page table is pages[] is stored at
 *   K: k + pages[p / page_size] * page_stride + (p % page_size) * n_kv_heads * head_dim
 *   V: the same address + v_offset
 * (elements, not bytes). k holds fp32 elements, or, when k16 is set instead
 * (k NULL), bf16 ones: cs_op_kv_store rounds each value to nearest even, the
 * attention ops widen them back (exactly). */
typedef struct {
    float *k;
    size_t page_stride;
    size_t v_offset;
    int page_size;
    uint16_t *k16;
} cs_kv_view;

/* One sequence's share of a step: its query rows q[q_begin .. q_begin+n_q)
 * sit at positions pos .. pos+n_q-1; its pages cover [0, pos+n_q). */
typedef struct {
    int32_t q_begin;
    int32_t n_q;
    int32_t pos;
    const int32_t *pages;
} cs_attn_span;

/* Writes k, v (n_tokens, n_kv_heads * head_dim) of each span's tokens into
 * their page slots. */
void cs_op_kv_store(const cs_kv_view *kv, const cs_attn_span *spans, int n_spans, const float *k,
                    const float *v, int kv_dim);

/* Causal attention with GQA over paged KV: for every query row of every span,
 * softmax(q . K[lo..p] * scale) V[lo..p] where p is the row's position and
 * lo = 0, or with a sliding window (window > 0) lo = max(0, p - window + 1):
 * a row sees itself and the window - 1 keys before it. query head h reads kv
 * head h / (n_heads / n_kv_heads). scale is usually 1 / sqrt(head_dim). out and q are
 * (n_tokens, n_heads * head_dim) and must not overlap. The keys of the step's
 * own tokens must already be stored (cs_op_kv_store). Only the slots of
 * positions < pos + n_q are read, and with a window none below the span's
 * first row's lo (their pages may be gone). n_heads is a multiple of n_kv_heads. The
 * fast path needs head_dim <= 256 and uses no heap memory (~70 KB of stack
 * per thread, ~135 KB on a bf16 pool, whose blocks of keys it widens). */
void cs_op_attention_ref(float *out, const float *q, const cs_attn_span *spans, int n_spans,
                         const cs_kv_view *kv, int n_heads, int n_kv_heads, int head_dim,
                         float scale, int32_t window);
void cs_op_attention(cs_threadpool *pool, float *out, const float *q, const cs_attn_span *spans,
                     int n_spans, const cs_kv_view *kv, int n_heads, int n_kv_heads, int head_dim,
                     float scale, int32_t window);

#ifdef __cplusplus
}
#endif
#endif
