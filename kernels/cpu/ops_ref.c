/* ops_ref.c: the reference CPU ops, the specification every fast path
 * (ops_fast.c, the CUDA kernels) is tested against. Plain single-threaded
 * fp32 loops in Hugging Face's LlamaForCausalLM arithmetic; the reference
 * forward pass (engine/src/forward_ref.c) is built from them, so changing a
 * rounding here changes the golden logits. Not fast, and not meant to be.
 * Also the two ops that are plain copies (embed, kv_store): no fast twin. */
#include <math.h>
#include <string.h>

#include "chunkserve/ops.h"

/* 16 partial sums, then the tail: a fixed order the compiler vectorizes. */
static float dot(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++)
            acc[j] += a[i + j] * b[i + j];
    float sum = 0;
    for (int j = 0; j < 16; j++)
        sum += acc[j];
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

void cs_op_matmul_ref(float *out, const float *x, const float *w, const float *bias, int n_tokens,
                      int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const float *wr = w + (size_t)r * cols;
        for (int t = 0; t < n_tokens; t++) {
            float v = dot(wr, x + (size_t)t * cols, cols);
            out[(size_t)t * rows + r] = bias ? v + bias[r] : v;
        }
    }
}

void cs_op_rmsnorm_ref(float *out, const float *x, const float *w, int n_tokens, int dim,
                       float eps) {
    for (int t = 0; t < n_tokens; t++) {
        const float *xt = x + (size_t)t * dim;
        float ss = 0;
        for (int i = 0; i < dim; i++)
            ss += xt[i] * xt[i];
        float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++)
            out[(size_t)t * dim + i] = w[i] * (xt[i] * scale);
    }
}

void cs_op_rope_ref(float *x, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                    const float *inv_freq) {
    int half = head_dim / 2;
    for (int t = 0; t < n_tokens; t++) {
        float *xt = x + (size_t)t * n_heads * head_dim;
        for (int i = 0; i < half; i++) {
            float angle = (float)pos[t] * inv_freq[i];
            float c = cosf(angle), s = sinf(angle);
            for (int h = 0; h < n_heads; h++) {
                float *v = xt + (size_t)h * head_dim;
                float x0 = v[i], x1 = v[i + half];
                v[i] = x0 * c - x1 * s;
                v[i + half] = x1 * c + x0 * s;
            }
        }
    }
}

void cs_op_glu_ref(float *out, const float *gate, const float *up, size_t n, cs_act act) {
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        float e = act == CS_ACT_SILU ? -g : -1.5957691216057308f * (g + 0.044715f * g * g * g);
        out[i] = g / (1.0f + expf(e)) * up[i];
    }
}

void cs_op_embed(float *out, const float *table, const int32_t *ids, int n_tokens, int dim) {
    for (int t = 0; t < n_tokens; t++)
        memcpy(out + (size_t)t * dim, table + (size_t)ids[t] * dim, (size_t)dim * sizeof(float));
}

/* Element offset of position p's K row in a sequence with page table pages
 * (V: + v_offset). */
static size_t kv_off(const cs_kv_view *kv, const int32_t *pages, int32_t p, int kv_dim) {
    return (size_t)pages[p / kv->page_size] * kv->page_stride +
           (size_t)(p % kv->page_size) * kv_dim;
}

/* n values at element offset off as fp32: the pool's own floats, or bf16
 * widened into tmp. */
static const float *kv_vals(const cs_kv_view *kv, size_t off, int n, float *tmp) {
    if (!kv->k16) return kv->k + off;
    for (int i = 0; i < n; i++)
        tmp[i] = cs_bf16_to_f32(kv->k16[off + (size_t)i]);
    return tmp;
}

void cs_op_kv_store(const cs_kv_view *kv, const cs_attn_span *spans, int n_spans, const float *k,
                    const float *v, int kv_dim) {
    for (int s = 0; s < n_spans; s++) {
        const cs_attn_span *sp = &spans[s];
        for (int32_t i = 0; i < sp->n_q; i++) {
            size_t dst = kv_off(kv, sp->pages, sp->pos + i, kv_dim);
            size_t src = (size_t)(sp->q_begin + i) * kv_dim;
            if (kv->k16) {
                for (int d = 0; d < kv_dim; d++) {
                    kv->k16[dst + (size_t)d] = cs_f32_to_bf16(k[src + (size_t)d]);
                    kv->k16[dst + kv->v_offset + (size_t)d] = cs_f32_to_bf16(v[src + (size_t)d]);
                }
                continue;
            }
            memcpy(kv->k + dst, k + src, (size_t)kv_dim * sizeof(float));
            memcpy(kv->k + dst + kv->v_offset, v + src, (size_t)kv_dim * sizeof(float));
        }
    }
}

/* Three passes over the keys (max, sum, weighted values) that recompute each
 * score instead of storing it: no scratch memory, so the reference cannot
 * fail, and dot() is deterministic, so every pass sees the same values. */
#define CS_REF_MAX_HEAD_DIM 1024 /* the models' limit (model.c) */

void cs_op_attention_ref(float *out, const float *q, const cs_attn_span *spans, int n_spans,
                         const cs_kv_view *kv, int n_heads, int n_kv_heads, int head_dim,
                         float scale, int32_t window) {
    const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim,
              group = n_heads / n_kv_heads;
    for (int s = 0; s < n_spans; s++) {
        const cs_attn_span *sp = &spans[s];
        for (int32_t i = 0; i < sp->n_q; i++) {
            const int32_t t = sp->q_begin + i,
                          n_ctx = sp->pos + i + 1, /* causal: positions lo..pos+i */
                lo = window > 0 && n_ctx > window ? n_ctx - window : 0;
            for (int h = 0; h < n_heads; h++) {
                const float *qh = q + (size_t)t * q_dim + h * head_dim;
                const int kvh = h / group;
                float mx = -INFINITY, tk[CS_REF_MAX_HEAD_DIM], tv[CS_REF_MAX_HEAD_DIM];
                for (int32_t j = lo; j < n_ctx; j++) {
                    size_t off = kv_off(kv, sp->pages, j, kv_dim) + (size_t)kvh * head_dim;
                    float sc = dot(qh, kv_vals(kv, off, head_dim, tk), head_dim) * scale;
                    if (sc > mx) mx = sc;
                }
                float sum = 0;
                for (int32_t j = lo; j < n_ctx; j++) {
                    size_t off = kv_off(kv, sp->pages, j, kv_dim) + (size_t)kvh * head_dim;
                    float sc = dot(qh, kv_vals(kv, off, head_dim, tk), head_dim) * scale;
                    sum += expf(sc - mx);
                }
                float *o = out + (size_t)t * q_dim + h * head_dim;
                for (int d = 0; d < head_dim; d++)
                    o[d] = 0;
                for (int32_t j = lo; j < n_ctx; j++) {
                    size_t off = kv_off(kv, sp->pages, j, kv_dim) + (size_t)kvh * head_dim;
                    const float *kj = kv_vals(kv, off, head_dim, tk);
                    const float *vj = kv_vals(kv, off + kv->v_offset, head_dim, tv);
                    float sc = dot(qh, kj, head_dim) * scale;
                    float a = expf(sc - mx) / sum;
                    for (int d = 0; d < head_dim; d++)
                        o[d] += a * vj[d];
                }
            }
        }
    }
}
