/* forward_ref.c: the reference forward pass. Plain single-threaded fp32
 * loops, one sequence, contiguous KV cache: the specification, not the fast
 * path (that is the CPU backend's job). Mirrors Hugging Face's
 * LlamaForCausalLM arithmetic (RMSNorm in fp32, RoPE with rotate_half and
 * fp32 angles, softmax attention with GQA, SwiGLU) with the optional parts
 * of the block (backend.h's cs_layer_weights: QK-norm, post norms, GeGLU,
 * scaled embeddings, sliding windows) as Gemma3ForCausalLM has them. The
 * arithmetic itself lives in the *_ref ops (kernels/cpu/ops_ref.c), which the
 * fast paths are tested against; this file only strings them together. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/refeval.h"
#include "model-impl.h"
#include "chunkserve/ops.h"
#include "util.h"

struct cs_ref_seq {
    const cs_model *m;
    int32_t max_tokens;
    int32_t len;
    /* (n_layers, 2 (K, V), max_tokens, n_kv_heads * head_dim): to the ops,
     * each layer is one page of max_tokens positions. */
    float *kv;
};

int cs_ref_seq_init(const cs_model *m, int32_t max_tokens, cs_ref_seq **out) {
    *out = NULL;
    const cs_model_config *c = &m->cfg;
    if (m->mode == CS_WEIGHTS_QUANT)
        return cs_fail(CS_ENOTSUP, "the reference forward runs fp32 weights; this model was "
                                   "loaded with quantized ones (load it in exact mode)");
    if (max_tokens < 1 || max_tokens > c->ctx_len)
        return cs_fail(CS_EINVAL, "sequence length %d must be in 1..%d (the model's context)",
                       max_tokens, c->ctx_len);
    cs_ref_seq *s = calloc(1, sizeof *s);
    size_t n = (size_t)c->n_layers * 2 * (size_t)max_tokens * (size_t)(c->n_kv_heads * c->head_dim);
    if (s) s->kv = malloc(n * sizeof(float));
    if (!s || !s->kv) {
        cs_ref_seq_free(s);
        return cs_fail(CS_ENOMEM, "out of memory for a %d-token KV cache", max_tokens);
    }
    s->m = m;
    s->max_tokens = max_tokens;
    *out = s;
    return 0;
}

void cs_ref_seq_free(cs_ref_seq *s) {
    if (!s) return;
    free(s->kv);
    free(s);
}

int32_t cs_ref_seq_len(const cs_ref_seq *s) {
    return s->len;
}
void cs_ref_seq_reset(cs_ref_seq *s) {
    s->len = 0;
}

int cs_ref_seq_eval(cs_ref_seq *s, const int32_t *tokens, int32_t n, bool all_logits,
                    float *logits) {
    const cs_model *m = s->m;
    const cs_model_config *c = &m->cfg;
    if (n < 1) return cs_fail(CS_EINVAL, "evaluate: need at least one token");
    if (n > s->max_tokens - s->len)
        return cs_fail(CS_ENOSPC, "evaluate: %d tokens after %d exceed the sequence's %d positions",
                       n, s->len, s->max_tokens);
    for (int32_t t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= c->n_vocab)
            return cs_fail(CS_EINVAL,
                           "evaluate: token id %d at index %d is outside the vocabulary (0..%d)",
                           tokens[t], t, c->n_vocab - 1);

    const int dim = c->dim, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads;
    const int q_dim = nh * hd, kv_dim = nkv * hd, hidden = c->hidden_dim;
    const int pos0 = s->len;
    const size_t layer_floats = 2 * (size_t)s->max_tokens * kv_dim;
    size_t N = (size_t)n;
    float *x = malloc(N * dim * sizeof(float));       /* residual stream (n, dim) */
    float *xn = malloc(N * dim * sizeof(float));      /* normed input (n, dim) */
    float *q = malloc(N * q_dim * sizeof(float));     /* (n, n_heads * head_dim) */
    float *k = malloc(N * kv_dim * sizeof(float));    /* (n, n_kv_heads * head_dim) */
    float *v = malloc(N * kv_dim * sizeof(float));    /* (n, n_kv_heads * head_dim) */
    float *att = malloc(N * q_dim * sizeof(float));   /* attention output (n, q_dim) */
    float *proj = malloc(N * dim * sizeof(float));    /* (n, dim) */
    float *gate = malloc(N * hidden * sizeof(float)); /* (n, hidden) */
    float *up = malloc(N * hidden * sizeof(float));   /* (n, hidden) */
    int32_t *pos = malloc(N * sizeof(int32_t));       /* (n) */
    if (!x || !xn || !q || !k || !v || !att || !proj || !gate || !up || !pos) {
        free(x), free(xn), free(q), free(k), free(v), free(att), free(proj), free(gate), free(up),
            free(pos);
        return cs_fail(CS_ENOMEM, "evaluate: out of memory for %d tokens", n);
    }
    for (int t = 0; t < n; t++)
        pos[t] = pos0 + t;
    const int32_t page0 = 0;
    const cs_attn_span span = {0, n, pos0, &page0};
    cs_op_embed(x, m->tok_embd, tokens, n, dim);
    if (c->embed_scale != 1.0f)
        for (size_t i = 0; i < N * dim; i++)
            x[i] *= c->embed_scale;

    for (int l = 0; l < c->n_layers; l++) {
        const cs_layer *L = &m->layers[l];
        const cs_kv_view kv = {s->kv + (size_t)l * layer_floats, layer_floats,
                               (size_t)s->max_tokens * kv_dim, s->max_tokens, NULL};
        cs_op_rmsnorm_ref(xn, x, L->attn_norm, n, dim, c->norm_eps);
        cs_op_matmul_ref(q, xn, L->wq, L->bq, n, q_dim, dim);
        cs_op_matmul_ref(k, xn, L->wk, L->bk, n, kv_dim, dim);
        cs_op_matmul_ref(v, xn, L->wv, L->bv, n, kv_dim, dim);
        if (L->q_norm) cs_op_rmsnorm_ref(q, q, L->q_norm, n * nh, hd, c->norm_eps);
        if (L->k_norm) cs_op_rmsnorm_ref(k, k, L->k_norm, n * nkv, hd, c->norm_eps);
        cs_op_rope_ref(q, n, nh, hd, pos, L->rope_inv_freq);
        cs_op_rope_ref(k, n, nkv, hd, pos, L->rope_inv_freq);
        cs_op_kv_store(&kv, &span, 1, k, v, kv_dim);
        cs_op_attention_ref(att, q, &span, 1, &kv, nh, nkv, hd, c->attn_scale, L->window);
        cs_op_matmul_ref(proj, att, L->wo, NULL, n, dim, q_dim);
        if (L->post_attn_norm)
            cs_op_rmsnorm_ref(proj, proj, L->post_attn_norm, n, dim, c->norm_eps);
        for (size_t i = 0; i < N * dim; i++)
            x[i] += proj[i];

        cs_op_rmsnorm_ref(xn, x, L->ffn_norm, n, dim, c->norm_eps);
        cs_op_matmul_ref(gate, xn, L->w_gate, NULL, n, hidden, dim);
        cs_op_matmul_ref(up, xn, L->w_up, NULL, n, hidden, dim);
        cs_op_glu_ref(gate, gate, up, N * hidden, c->gelu ? CS_ACT_GELU_TANH : CS_ACT_SILU);
        cs_op_matmul_ref(proj, gate, L->w_down, NULL, n, dim, hidden);
        if (L->post_ffn_norm) cs_op_rmsnorm_ref(proj, proj, L->post_ffn_norm, n, dim, c->norm_eps);
        for (size_t i = 0; i < N * dim; i++)
            x[i] += proj[i];
    }
    int first = all_logits ? 0 : n - 1;
    cs_op_rmsnorm_ref(xn, x + (size_t)first * dim, m->out_norm, n - first, dim, c->norm_eps);
    cs_op_matmul_ref(logits, xn, m->output, NULL, n - first, c->n_vocab, dim);
    s->len += n;
    free(x), free(xn), free(q), free(k), free(v), free(att), free(proj), free(gate), free(up),
        free(pos);
    return 0;
}
