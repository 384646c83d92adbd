/* forward_ref.c: the reference Llama forward pass. Plain single-threaded fp32
 * loops, one sequence, contiguous KV cache: the specification, not the fast
 * path (that is the CPU backend's job). Mirrors
 * Hugging Face's LlamaForCausalLM arithmetic: RMSNorm in fp32, RoPE with
 * rotate_half and fp32 angles, softmax attention with GQA, SwiGLU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/refeval.h"
#include "model-impl.h"
#include "util.h"

struct cs_ref_seq {
    const cs_model *m;
    int32_t max_tokens;
    int32_t len;
    float *k_cache; /* (n_layers, max_tokens, n_kv_heads * head_dim) */
    float *v_cache; /* (n_layers, max_tokens, n_kv_heads * head_dim) */
};

int cs_ref_seq_init(const cs_model *m, int32_t max_tokens, cs_ref_seq **out) {
    *out = NULL;
    const cs_model_config *c = &m->cfg;
    if (max_tokens < 1 || max_tokens > c->ctx_len)
        return cs__fail(CS_EINVAL, "sequence length %d must be in 1..%d (the model's context)", max_tokens, c->ctx_len);
    cs_ref_seq *s = calloc(1, sizeof *s);
    size_t n = (size_t)c->n_layers * (size_t)max_tokens * (size_t)(c->n_kv_heads * c->head_dim);
    if (s) {
        s->k_cache = malloc(n * sizeof(float));
        s->v_cache = malloc(n * sizeof(float));
    }
    if (!s || !s->k_cache || !s->v_cache) {
        cs_ref_seq_free(s);
        return cs__fail(CS_ENOMEM, "out of memory for a %d-token KV cache", max_tokens);
    }
    s->m = m;
    s->max_tokens = max_tokens;
    *out = s;
    return 0;
}

void cs_ref_seq_free(cs_ref_seq *s) {
    if (!s) return;
    free(s->k_cache);
    free(s->v_cache);
    free(s);
}

int32_t cs_ref_seq_len(const cs_ref_seq *s) { return s->len; }
void cs_ref_seq_reset(cs_ref_seq *s) { s->len = 0; }

static float dot(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float sum = 0;
    for (int j = 0; j < 16; j++) sum += acc[j];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]) for n tokens. */
static void matmul(float *out, const float *x, const float *w, const float *bias, int n, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const float *wr = w + (size_t)r * cols;
        for (int t = 0; t < n; t++) {
            float v = dot(wr, x + (size_t)t * cols, cols);
            out[(size_t)t * rows + r] = bias ? v + bias[r] : v;
        }
    }
}

static void rmsnorm(float *out, const float *x, const float *w, int n, int dim, float eps) {
    for (int t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * dim;
        float ss = 0;
        for (int i = 0; i < dim; i++) ss += xt[i] * xt[i];
        float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) out[(size_t)t * dim + i] = w[i] * (xt[i] * scale);
    }
}

/* rotate_half RoPE on n_heads vectors of head_dim at position pos. */
static void rope(float *v, int n_heads, int head_dim, int pos, const float *inv_freq) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float angle = (float)pos * inv_freq[i];
        float c = cosf(angle), s = sinf(angle);
        for (int h = 0; h < n_heads; h++) {
            float *x = v + h * head_dim;
            float x0 = x[i], x1 = x[i + half];
            x[i] = x0 * c - x1 * s;
            x[i + half] = x1 * c + x0 * s;
        }
    }
}

int cs_ref_seq_eval(cs_ref_seq *s, const int32_t *tokens, int32_t n, bool all_logits, float *logits) {
    const cs_model *m = s->m;
    const cs_model_config *c = &m->cfg;
    if (n < 1) return cs__fail(CS_EINVAL, "evaluate: need at least one token");
    if (n > s->max_tokens - s->len)
        return cs__fail(CS_ENOSPC, "evaluate: %d tokens after %d exceed the sequence's %d positions", n, s->len, s->max_tokens);
    for (int32_t t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= c->n_vocab)
            return cs__fail(CS_EINVAL, "evaluate: token id %d at index %d is outside the vocabulary (0..%d)", tokens[t], t, c->n_vocab - 1);

    const int dim = c->dim, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads;
    const int q_dim = nh * hd, kv_dim = nkv * hd, hidden = c->hidden_dim;
    const int group = nh / nkv, pos0 = s->len;
    const float scale = 1.0f / sqrtf((float)hd);
    size_t N = (size_t)n;
    float *x = malloc(N * dim * sizeof(float));       /* residual stream (n, dim) */
    float *xn = malloc(N * dim * sizeof(float));      /* normed input (n, dim) */
    float *q = malloc(N * q_dim * sizeof(float));     /* (n, n_heads * head_dim) */
    float *att = malloc(N * q_dim * sizeof(float));   /* attention output (n, q_dim) */
    float *proj = malloc(N * dim * sizeof(float));    /* (n, dim) */
    float *gate = malloc(N * hidden * sizeof(float)); /* (n, hidden) */
    float *up = malloc(N * hidden * sizeof(float));   /* (n, hidden) */
    float *scores = malloc((size_t)(pos0 + n) * sizeof(float));   /* one row of attention weights */
    if (!x || !xn || !q || !att || !proj || !gate || !up || !scores) {
        free(x), free(xn), free(q), free(att), free(proj), free(gate), free(up), free(scores);
        return cs__fail(CS_ENOMEM, "evaluate: out of memory for %d tokens", n);
    }
    for (int t = 0; t < n; t++) memcpy(x + (size_t)t * dim, m->tok_embd + (size_t)tokens[t] * dim, dim * sizeof(float));

    for (int l = 0; l < c->n_layers; l++) {
        const cs_layer *L = &m->layers[l];
        float *kc = s->k_cache + (size_t)l * s->max_tokens * kv_dim;
        float *vc = s->v_cache + (size_t)l * s->max_tokens * kv_dim;
        rmsnorm(xn, x, L->attn_norm, n, dim, c->norm_eps);
        matmul(q, xn, L->wq, L->bq, n, q_dim, dim);
        matmul(kc + (size_t)pos0 * kv_dim, xn, L->wk, L->bk, n, kv_dim, dim);
        matmul(vc + (size_t)pos0 * kv_dim, xn, L->wv, L->bv, n, kv_dim, dim);
        for (int t = 0; t < n; t++) {
            rope(q + (size_t)t * q_dim, nh, hd, pos0 + t, m->rope_inv_freq);
            rope(kc + (size_t)(pos0 + t) * kv_dim, nkv, hd, pos0 + t, m->rope_inv_freq);
        }
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < nh; h++) {
                float *sc = scores;
                const float *qh = q + (size_t)t * q_dim + h * hd;
                int kvh = h / group, n_ctx = pos0 + t + 1; /* causal: positions 0..pos0+t */
                float mx = -INFINITY;
                for (int j = 0; j < n_ctx; j++) {
                    sc[j] = dot(qh, kc + (size_t)j * kv_dim + kvh * hd, hd) * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                float sum = 0;
                for (int j = 0; j < n_ctx; j++) {
                    sc[j] = expf(sc[j] - mx);
                    sum += sc[j];
                }
                float *o = att + (size_t)t * q_dim + h * hd;
                for (int d = 0; d < hd; d++) o[d] = 0;
                for (int j = 0; j < n_ctx; j++) {
                    const float *vj = vc + (size_t)j * kv_dim + kvh * hd;
                    float a = sc[j] / sum;
                    for (int d = 0; d < hd; d++) o[d] += a * vj[d];
                }
            }
        }
        matmul(proj, att, L->wo, NULL, n, dim, q_dim);
        for (size_t i = 0; i < N * dim; i++) x[i] += proj[i];

        rmsnorm(xn, x, L->ffn_norm, n, dim, c->norm_eps);
        matmul(gate, xn, L->w_gate, NULL, n, hidden, dim);
        matmul(up, xn, L->w_up, NULL, n, hidden, dim);
        for (size_t i = 0; i < N * hidden; i++) {
            float g = gate[i];
            gate[i] = g / (1.0f + expf(-g)) * up[i];
        }
        matmul(proj, gate, L->w_down, NULL, n, dim, hidden);
        for (size_t i = 0; i < N * dim; i++) x[i] += proj[i];
    }
    int first = all_logits ? 0 : n - 1;
    rmsnorm(xn, x + (size_t)first * dim, m->out_norm, n - first, dim, c->norm_eps);
    matmul(logits, xn, m->output, NULL, n - first, c->n_vocab, dim);
    s->len += n;
    free(x), free(xn), free(q), free(att), free(proj), free(gate), free(up), free(scores);
    return 0;
}
