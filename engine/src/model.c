/* model.c: format-neutral model building: configuration checks, the weight
 * table (which tensor goes where, with which shape), one carved fp32 buffer,
 * RoPE frequencies. The readers in model_gguf.c and model_hf.c only supply
 * the configuration and a tensor lookup. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "model-impl.h"
#include "util.h"

enum { PERM_NONE, PERM_Q, PERM_K };
enum { DIM_ONE, DIM_VOCAB, DIM_MODEL, DIM_Q, DIM_KV, DIM_HIDDEN, DIM_HEAD };
/* Which rows a model has: every one, or those of an optional block part
 * (cs_model_config's flags); a part's rows are required when it is on and
 * not looked up when it is off. */
enum { WHEN_ALWAYS, WHEN_QK_NORM, WHEN_POST_NORMS };
/* In QUANT mode the matrices are packed in groups that one GEMM computes
 * (q|k|v, gate|up); QG_NONE tensors (norms, biases) stay fp32. */
enum { QG_NONE, QG_EMBD, QG_OUT, QG_QKV, QG_O, QG_GATE_UP, QG_DOWN, QG_COUNT };

typedef struct {
    const char *gguf, *hf; /* name formats; per-layer ones contain %d */
    int rows, cols;        /* DIM_*; cols DIM_ONE = vector */
    bool optional;
    int perm;
    size_t layer_off; /* offsetof in cs_layer, or (size_t)-1 for model-level */
    size_t model_off;
    int qg, qpart; /* QUANT mode: group QG_* and part within it */
    int when;      /* WHEN_* */
} weight_spec;

#define L(f) offsetof(cs_layer, f), 0
#define M(f) (size_t) - 1, offsetof(cs_model, f)
static const weight_spec weight_table[] = {
    {"token_embd.weight", "model.embed_tokens.weight", DIM_VOCAB, DIM_MODEL, false, PERM_NONE,
     M(tok_embd), QG_EMBD, 0, WHEN_ALWAYS},
    {"output_norm.weight", "model.norm.weight", DIM_MODEL, DIM_ONE, false, PERM_NONE, M(out_norm),
     QG_NONE, 0, WHEN_ALWAYS},
    {"output.weight", "lm_head.weight", DIM_VOCAB, DIM_MODEL, true, PERM_NONE, M(output), QG_OUT, 0,
     WHEN_ALWAYS},
    {"blk.%d.attn_norm.weight", "model.layers.%d.input_layernorm.weight", DIM_MODEL, DIM_ONE, false,
     PERM_NONE, L(attn_norm), QG_NONE, 0, WHEN_ALWAYS},
    {"blk.%d.attn_q.weight", "model.layers.%d.self_attn.q_proj.weight", DIM_Q, DIM_MODEL, false,
     PERM_Q, L(wq), QG_QKV, 0, WHEN_ALWAYS},
    {"blk.%d.attn_k.weight", "model.layers.%d.self_attn.k_proj.weight", DIM_KV, DIM_MODEL, false,
     PERM_K, L(wk), QG_QKV, 1, WHEN_ALWAYS},
    {"blk.%d.attn_v.weight", "model.layers.%d.self_attn.v_proj.weight", DIM_KV, DIM_MODEL, false,
     PERM_NONE, L(wv), QG_QKV, 2, WHEN_ALWAYS},
    {"blk.%d.attn_q.bias", "model.layers.%d.self_attn.q_proj.bias", DIM_Q, DIM_ONE, true, PERM_Q,
     L(bq), QG_NONE, 0, WHEN_ALWAYS},
    {"blk.%d.attn_k.bias", "model.layers.%d.self_attn.k_proj.bias", DIM_KV, DIM_ONE, true, PERM_K,
     L(bk), QG_NONE, 0, WHEN_ALWAYS},
    {"blk.%d.attn_v.bias", "model.layers.%d.self_attn.v_proj.bias", DIM_KV, DIM_ONE, true,
     PERM_NONE, L(bv), QG_NONE, 0, WHEN_ALWAYS},
    {"blk.%d.attn_output.weight", "model.layers.%d.self_attn.o_proj.weight", DIM_MODEL, DIM_Q,
     false, PERM_NONE, L(wo), QG_O, 0, WHEN_ALWAYS},
    {"blk.%d.ffn_norm.weight", "model.layers.%d.post_attention_layernorm.weight", DIM_MODEL,
     DIM_ONE, false, PERM_NONE, L(ffn_norm), QG_NONE, 0, WHEN_ALWAYS},
    {"blk.%d.ffn_gate.weight", "model.layers.%d.mlp.gate_proj.weight", DIM_HIDDEN, DIM_MODEL, false,
     PERM_NONE, L(w_gate), QG_GATE_UP, 0, WHEN_ALWAYS},
    {"blk.%d.ffn_up.weight", "model.layers.%d.mlp.up_proj.weight", DIM_HIDDEN, DIM_MODEL, false,
     PERM_NONE, L(w_up), QG_GATE_UP, 1, WHEN_ALWAYS},
    {"blk.%d.ffn_down.weight", "model.layers.%d.mlp.down_proj.weight", DIM_MODEL, DIM_HIDDEN, false,
     PERM_NONE, L(w_down), QG_DOWN, 0, WHEN_ALWAYS},
    /* optional parts (appended: the rows above keep their fingerprint indices) */
    {"blk.%d.attn_q_norm.weight", "model.layers.%d.self_attn.q_norm.weight", DIM_HEAD, DIM_ONE,
     false, PERM_NONE, L(q_norm), QG_NONE, 0, WHEN_QK_NORM},
    {"blk.%d.attn_k_norm.weight", "model.layers.%d.self_attn.k_norm.weight", DIM_HEAD, DIM_ONE,
     false, PERM_NONE, L(k_norm), QG_NONE, 0, WHEN_QK_NORM},
    {"blk.%d.post_attention_norm.weight", NULL, DIM_MODEL, DIM_ONE, false, PERM_NONE,
     L(post_attn_norm), QG_NONE, 0, WHEN_POST_NORMS},
    {"blk.%d.post_ffw_norm.weight", NULL, DIM_MODEL, DIM_ONE, false, PERM_NONE, L(post_ffn_norm),
     QG_NONE, 0, WHEN_POST_NORMS},
};
#undef L
#undef M
#define N_SPECS (sizeof weight_table / sizeof weight_table[0])

static int64_t dim_value(const cs_model_config *c, int d) {
    switch (d) {
    case DIM_ONE: return 1;
    case DIM_VOCAB: return c->n_vocab;
    case DIM_MODEL: return c->dim;
    case DIM_Q: return (int64_t)c->n_heads * c->head_dim;
    case DIM_KV: return (int64_t)c->n_kv_heads * c->head_dim;
    case DIM_HIDDEN: return c->hidden_dim;
    case DIM_HEAD: return c->head_dim;
    }
    return 0;
}

static int check_config(const cs_model_config *c, const char *path) {
#define REQ(cond, ...)                                                                             \
    if (!(cond)) return cs_fail(CS_EBADMSG, __VA_ARGS__)
    REQ(c->n_vocab > 0 && c->n_vocab <= (1 << 22), "model %s: vocabulary size %d out of range",
        path, c->n_vocab);
    REQ(c->dim > 0 && c->dim <= 65536, "model %s: hidden size %d out of range", path, c->dim);
    REQ(c->n_layers > 0 && c->n_layers <= 1024, "model %s: layer count %d out of range", path,
        c->n_layers);
    REQ(c->n_heads > 0 && c->n_heads <= 1024, "model %s: head count %d out of range", path,
        c->n_heads);
    REQ(c->n_kv_heads > 0 && c->n_kv_heads <= c->n_heads && c->n_heads % c->n_kv_heads == 0,
        "model %s: %d kv heads must divide %d heads", path, c->n_kv_heads, c->n_heads);
    REQ(c->head_dim > 0 && c->head_dim <= 1024 && c->head_dim % 2 == 0,
        "model %s: head dimension %d must be even and at most 1024", path, c->head_dim);
    REQ(c->hidden_dim > 0 && c->hidden_dim <= (1 << 20), "model %s: FFN size %d out of range", path,
        c->hidden_dim);
    REQ(c->ctx_len > 0, "model %s: context length %d must be positive", path, c->ctx_len);
    REQ(c->norm_eps > 0 && c->norm_eps < 1, "model %s: RMSNorm epsilon %g out of range", path,
        c->norm_eps);
    REQ(c->rope_theta > 0 && isfinite(c->rope_theta), "model %s: RoPE theta %g must be positive",
        path, c->rope_theta);
    REQ(c->rope_scaling == CS_ROPE_SCALING_NONE || (c->rope_factor > 0 && isfinite(c->rope_factor)),
        "model %s: RoPE scaling factor %g must be positive", path, c->rope_factor);
    REQ(c->rope_scaling != CS_ROPE_SCALING_LLAMA3 ||
            (c->rope_orig_ctx > 0 && c->rope_high_freq_factor > c->rope_low_freq_factor),
        "model %s: llama3 RoPE scaling needs original_max_position_embeddings and high_freq_factor "
        "> low_freq_factor",
        path);
    REQ(c->embed_scale > 0 && isfinite(c->embed_scale), "model %s: embedding scale %g out of range",
        path, c->embed_scale);
    REQ(c->attn_scale > 0 && isfinite(c->attn_scale), "model %s: attention scale %g out of range",
        path, c->attn_scale);
    REQ(c->sliding_window >= 0 && c->swa_period >= 0, "model %s: sliding window %d / pattern %d",
        path, c->sliding_window, c->swa_period);
    REQ(!c->sliding_window || (c->rope_theta_swa > 0 && isfinite(c->rope_theta_swa)),
        "model %s: windowed layers' RoPE theta %g must be positive", path, c->rope_theta_swa);
#undef REQ
    return 0;
}

/* inv_freq as Hugging Face computes it (fp32) for base theta, then, when
 * scaled, the configured scaling (the windowed layers' table is unscaled). */
static void compute_rope(const cs_model_config *c, float theta, bool scaled,
                         const float *freq_factors, float *inv_freq) {
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float f = 1.0f / powf(theta, (float)(2 * i) / (float)c->head_dim);
        if (!scaled) {
        } else if (freq_factors) {
            f /= freq_factors[i];
        } else if (c->rope_scaling == CS_ROPE_SCALING_LINEAR) {
            f /= c->rope_factor;
        } else if (c->rope_scaling == CS_ROPE_SCALING_LLAMA3) {
            float low_wavelen = (float)c->rope_orig_ctx / c->rope_low_freq_factor;
            float high_wavelen = (float)c->rope_orig_ctx / c->rope_high_freq_factor;
            float wavelen = 2.0f * (float)M_PI / f;
            if (wavelen > low_wavelen) {
                f /= c->rope_factor;
            } else if (wavelen >= high_wavelen) {
                float s = ((float)c->rope_orig_ctx / wavelen - c->rope_low_freq_factor) /
                          (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0f - s) * f / c->rope_factor + s * f;
            }
        }
        inv_freq[i] = f;
    }
}

/* GGUF llama q/k rows: within each head, row 2i+j holds HF row j*head_dim/2+i. */
static void unpermute_rows(float *w, int64_t n_heads, int64_t head_dim, int64_t cols, float *tmp) {
    int64_t half = head_dim / 2;
    for (int64_t h = 0; h < n_heads; h++) {
        float *base = w + h * head_dim * cols;
        memcpy(tmp, base, (size_t)(head_dim * cols) * sizeof(float));
        for (int64_t i = 0; i < half; i++)
            for (int64_t j = 0; j < 2; j++)
                memcpy(base + (j * half + i) * cols, tmp + (2 * i + j) * cols,
                       (size_t)cols * sizeof(float));
    }
}

static int qmat_type_of(enum cs_dtype t) {
    switch (t) {
    case CS_DTYPE_Q4_0: return CS_QMAT_Q4_0;
    case CS_DTYPE_Q4_1: return CS_QMAT_Q4_1;
    case CS_DTYPE_Q8_0: return CS_QMAT_Q8_0;
    case CS_DTYPE_Q5_0: return CS_QMAT_Q5_0;
    case CS_DTYPE_Q5_1: return CS_QMAT_Q5_1;
    case CS_DTYPE_Q4_K: return CS_QMAT_Q4_K;
    case CS_DTYPE_Q5_K: return CS_QMAT_Q5_K;
    case CS_DTYPE_Q6_K: return CS_QMAT_Q6_K;
    default: return -1;
    }
}

/* QUANT mode: packs each group of matrices (backend.h cs_qmat_pack), each
 * part from the file's blocks when its type is one the integer kernels run
 * (Q4_0 ... Q6_K; the parts of a group may differ, as Q4_K_M files mix
 * Q4_K and Q6_K), else from its fp32 conversion (quantized to Q8_0). GGUF
 * q/k rows go back to Hugging Face order through the packer's row
 * permutation. */
static int pack_quant(cs_model *m, const cs_tensor_source *src, const cs_src_tensor *found,
                      const bool *present, const char *path) {
    const cs_model_config *c = &m->cfg;
    const int n_layers = c->n_layers;
    int32_t *perm[2] = {0};
    float *f32[3] = {0};
    int r = 0;
    if (src->unpermute_qk) {
        int heads[2] = {c->n_heads, c->n_kv_heads};
        for (int k = 0; k < 2; k++) {
            int half = c->head_dim / 2;
            perm[k] = malloc((size_t)heads[k] * (size_t)c->head_dim * sizeof(int32_t));
            if (!perm[k]) {
                r = cs_fail(CS_ENOMEM, "model %s: out of memory", path);
                goto out;
            }
            for (int h = 0; h < heads[k]; h++)
                for (int i = 0; i < half; i++)
                    for (int j = 0; j < 2; j++)
                        perm[k][h * c->head_dim + j * half + i] = h * c->head_dim + 2 * i + j;
        }
    }
    for (int g = QG_EMBD; g < QG_COUNT; g++) {
        bool per_layer = g != QG_EMBD && g != QG_OUT;
        for (int l = 0; l < (per_layer ? n_layers : 1); l++) {
            size_t spec[3];
            int n = 0;
            for (size_t s = 0; s < N_SPECS; s++)
                if (weight_table[s].qg == g) spec[weight_table[s].qpart] = s, n++;
            const cs_src_tensor *t[3];
            for (int k = 0; k < n; k++) {
                size_t idx = spec[k] * (size_t)n_layers + (size_t)l;
                if (!present[idx]) goto next; /* an absent output: tied */
                t[k] = &found[idx];
            }
            cs_qmat_src parts[3];
            int64_t cols = dim_value(c, weight_table[spec[0]].cols);
            for (int k = 0; k < n; k++) {
                const weight_spec *w = &weight_table[spec[k]];
                int64_t rows = dim_value(c, w->rows);
                int pk = w->perm == PERM_Q ? 0 : w->perm == PERM_K ? 1 : -1;
                if (qmat_type_of(t[k]->type) >= 0) {
                    parts[k] = (cs_qmat_src){qmat_type_of(t[k]->type), t[k]->data, rows,
                                             pk >= 0 ? perm[pk] : NULL};
                    continue;
                }
                free(f32[k]);
                f32[k] = malloc((size_t)(rows * cols) * sizeof(float));
                float *tmp = pk >= 0 ? malloc((size_t)(rows * cols) * sizeof(float)) : NULL;
                if (!f32[k] || (pk >= 0 && !tmp)) {
                    free(tmp);
                    r = cs_fail(CS_ENOMEM, "model %s: out of memory", path);
                    goto out;
                }
                cs__dtype_to_f32(t[k]->type, t[k]->data, f32[k], (size_t)(rows * cols));
                if (pk >= 0 && src->unpermute_qk)
                    unpermute_rows(f32[k], pk == 0 ? c->n_heads : c->n_kv_heads, c->head_dim, cols,
                                   tmp);
                free(tmp);
                parts[k] = (cs_qmat_src){CS_QMAT_F32, f32[k], rows, NULL};
            }
            cs_qmat *q;
            if ((r = cs_qmat_pack(parts, n, cols, &q))) goto out;
            for (int k = 0; k < n; k++) { /* packed: the file's pages may go */
                size_t bytes;
                if (cs__dtype_nbytes(t[k]->type, (uint64_t)(parts[k].rows * cols), &bytes))
                    cs__mapped_release(t[k]->data, bytes);
            }
            m->q_bytes += cs_qmat_bytes(q);
            cs_layer *L = &m->layers[l];
            cs_qmat **slot = g == QG_EMBD      ? &m->q_tok_embd
                             : g == QG_OUT     ? &m->q_output
                             : g == QG_QKV     ? &L->q_qkv
                             : g == QG_O       ? &L->q_o
                             : g == QG_GATE_UP ? &L->q_gate_up
                                               : &L->q_down;
            *slot = q;
        next:;
        }
    }
    if (!m->q_output) m->q_output = m->q_tok_embd; /* tied */
out:
    free(perm[0]), free(perm[1]);
    for (int k = 0; k < 3; k++)
        free(f32[k]);
    return r;
}

/* "q4_1 (quantized kernels)", or for a mix the types in order of first
 * use: "q4_K+q6_K (quantized kernels)". */
static void describe_quant(cs_model *m) {
    bool seen[CS_QMAT_TYPES] = {0};
    char *d = m->weight_desc;
    size_t cap = sizeof m->weight_desc, off = 0;
    d[0] = 0;
    for (int l = -1; l < m->cfg.n_layers; l++) {
        const cs_qmat *qs[4] = {m->q_tok_embd, m->q_output, NULL, NULL};
        if (l >= 0) {
            const cs_layer *L = &m->layers[l];
            qs[0] = L->q_qkv, qs[1] = L->q_o, qs[2] = L->q_gate_up, qs[3] = L->q_down;
        }
        for (int i = 0; i < 4; i++)
            for (int p = 0; qs[i] && p < cs_qmat_n_parts(qs[i]); p++) {
                int t = cs_qmat_type(qs[i], p);
                if (seen[t] || off + 8 >= cap) continue;
                seen[t] = true;
                off += (size_t)snprintf(d + off, cap - off, "%s%s", off ? "+" : "",
                                        cs_qmat_type_name(t));
            }
    }
    snprintf(d + off, cap - off, " (quantized kernels)");
}

static void fp_u64(XXH3_state_t *st, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    XXH3_64bits_update(st, b, 8);
}

/* The tensor table and samples of each tensor's bytes (cs_model_fingerprint):
 * role (spec, layer), type, shape, then 16 windows of 64 bytes spread evenly
 * over the tensor (all of it up to 1 KiB), so a vocabulary-only load reads a
 * few pages per tensor and a full load the same ones. */
static uint64_t fingerprint_tensors(const cs_src_tensor *found, const bool *present, int n_layers,
                                    const float *freq_factors, int32_t head_dim) {
    enum { WINDOWS = 16, WINDOW = 64 };
    XXH3_state_t state, *st = &state;
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, "chunkserve tensors v1", 21);
    for (size_t i = 0; i < N_SPECS * (size_t)n_layers; i++) {
        if (!present[i]) continue;
        const cs_src_tensor *t = &found[i];
        fp_u64(st, i), fp_u64(st, (uint64_t)t->type), fp_u64(st, (uint64_t)t->n_dims);
        uint64_t n = 1;
        for (int d = 0; d < t->n_dims; d++)
            fp_u64(st, (uint64_t)t->shape[d]), n *= (uint64_t)t->shape[d];
        size_t bytes = 0;
        if (!t->data || !cs__dtype_nbytes(t->type, n, &bytes)) continue;
        const uint8_t *p = t->data;
        if (bytes <= WINDOWS * WINDOW) {
            XXH3_64bits_update(st, p, bytes);
            continue;
        }
        for (int w = 0; w < WINDOWS; w++)
            XXH3_64bits_update(st, p + (bytes - WINDOW) / (WINDOWS - 1) * (size_t)w, WINDOW);
    }
    if (freq_factors) XXH3_64bits_update(st, freq_factors, (size_t)(head_dim / 2) * sizeof(float));
    return XXH3_64bits_digest(st);
}

int32_t cs_model_layer_window(const cs_model_config *c, int32_t layer) {
    if (!c->sliding_window) return 0;
    return c->swa_period && (layer + 1) % c->swa_period == 0 ? 0 : c->sliding_window;
}

/* Whether rows of weight_table[s] exist in a model of configuration c. */
static bool row_used(const cs_model_config *c, size_t s) {
    switch (weight_table[s].when) {
    case WHEN_QK_NORM: return c->qk_norm;
    case WHEN_POST_NORMS: return c->post_norms;
    }
    return true;
}

int cs__model_build(cs_model *m, const cs_tensor_source *src, const char *path) {
    cs_model_config *c = &m->cfg;
    if (c->embed_scale == 0) c->embed_scale = 1; /* a family that says nothing */
    if (c->attn_scale == 0 && c->head_dim > 0) c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    int r = check_config(c, path);
    if (r || !src) return r;
    int n_layers = c->n_layers;
    /* pass 1: find every tensor, check its shape, count floats */
    size_t n_specs_total = N_SPECS * (size_t)n_layers;
    cs_src_tensor *found = calloc(n_specs_total, sizeof *found);
    bool *present = calloc(n_specs_total, sizeof *present);
    float *tmp = NULL;
    if (!found || !present) {
        r = cs_fail(CS_ENOMEM, "model %s: out of memory", path);
        goto done;
    }
    size_t total = (size_t)(c->head_dim / 2) * (c->sliding_window ? 2 : 1); /* RoPE tables */
    int n_bias = 0; /* q/k/v biases found: all layers have all three, or none */
    for (size_t s = 0; s < N_SPECS; s++) {
        const weight_spec *w = &weight_table[s];
        int reps = w->layer_off == (size_t)-1 ? 1 : n_layers;
        if (!row_used(c, s)) continue;
        if (!src->gguf_names && !w->hf) {
            r = cs_fail(CS_ENOTSUP, "model %s: this block's '%s' has no Hugging Face name here",
                        path, w->gguf);
            goto done;
        }
        for (int l = 0; l < reps; l++) {
            char name[160];
            snprintf(name, sizeof name, src->gguf_names ? w->gguf : w->hf, l);
            size_t idx = s * (size_t)n_layers + (size_t)l;
            if (w->model_off == offsetof(cs_model, output) && w->layer_off == (size_t)-1 &&
                c->tied_embeddings)
                continue; /* tied: ignore an lm_head a checkpoint may still carry */
            r = src->find(src->ctx, name, &found[idx]);
            if (r == CS_ENOENT) {
                if (!w->optional) {
                    r = cs_fail(CS_EBADMSG, "model %s: tensor '%s' is missing", path, name);
                    goto done;
                }
                r = 0;
                continue;
            }
            if (r) goto done;
            int64_t rows = dim_value(c, w->rows), cols = dim_value(c, w->cols);
            const cs_src_tensor *t = &found[idx];
            bool ok = w->cols == DIM_ONE
                          ? (t->n_dims == 1 && t->shape[0] == rows)
                          : (t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols);
            if (!ok) {
                char got[96];
                int off = 0;
                for (int d = 0; d < t->n_dims && off < (int)sizeof got - 24; d++)
                    off += snprintf(got + off, sizeof got - (size_t)off, d ? ", %lld" : "%lld",
                                    (long long)t->shape[d]);
                if (w->cols == DIM_ONE)
                    r = cs_fail(CS_EBADMSG, "model %s: tensor '%s' has shape [%s], expected [%lld]",
                                path, name, got, (long long)rows);
                else
                    r = cs_fail(CS_EBADMSG,
                                "model %s: tensor '%s' has shape [%s], expected [%lld, %lld]", path,
                                name, got, (long long)rows, (long long)cols);
                goto done;
            }
            if (w->layer_off == offsetof(cs_layer, bq) || w->layer_off == offsetof(cs_layer, bk) ||
                w->layer_off == offsetof(cs_layer, bv))
                n_bias++;
            int64_t bad = src->shapes_only || !t->data
                              ? -1
                              : cs__dtype_bad_scale(t->type, t->data, (size_t)(rows * cols));
            if (bad >= 0) {
                r = cs_fail(CS_EBADMSG,
                            "model %s: tensor '%s' (%s): block %lld has an infinite or NaN scale",
                            path, name, cs__dtype_name(t->type), (long long)bad);
                goto done;
            }
            present[idx] = true;
            total += (size_t)(rows * cols);
        }
    }
    if (!present[2 * (size_t)n_layers] && !c->tied_embeddings) c->tied_embeddings = true;
    if (n_bias != 0 && n_bias != 3 * n_layers) {
        r = cs_fail(CS_EBADMSG, "model %s: q/k/v biases are present in some layers only (%d of %d)",
                    path, n_bias, 3 * n_layers);
        goto done;
    }
    c->qkv_bias = n_bias != 0;
    m->fp_tensors =
        fingerprint_tensors(found, present, n_layers, src->rope_freq_factors, c->head_dim);
    m->fp_has_tensors = true;
    if (src->shapes_only) {
        r = 0;
        goto done;
    }
    if (m->mode == CS_WEIGHTS_AUTO) {
        bool all_blocks = true; /* every layer matrix in blocks the integer kernels run */
        for (size_t s = 0; s < N_SPECS; s++)
            if (weight_table[s].qg != QG_NONE && weight_table[s].layer_off != (size_t)-1)
                for (int l = 0; l < n_layers; l++)
                    if (qmat_type_of(found[s * (size_t)n_layers + (size_t)l].type) < 0)
                        all_blocks = false;
        m->mode = all_blocks && !cs_backend_will_use_cuda() ? CS_WEIGHTS_QUANT : CS_WEIGHTS_EXACT;
    }
    if (m->mode == CS_WEIGHTS_QUANT) {
        if (c->dim % 32 || ((int64_t)c->n_heads * c->head_dim) % 32 || c->hidden_dim % 32) {
            r = cs_fail(CS_EINVAL,
                        "model %s: quantized weights need inner sizes that are multiples of 32 "
                        "(dim %d, heads x head_dim %d, ffn %d); load it in exact mode",
                        path, c->dim, c->n_heads * c->head_dim, c->hidden_dim);
            goto done;
        }
        for (size_t s = 0; s < N_SPECS; s++) /* packed matrices take no fp32 */
            if (weight_table[s].qg != QG_NONE) {
                int reps = weight_table[s].layer_off == (size_t)-1 ? 1 : n_layers;
                for (int l = 0; l < reps; l++)
                    if (present[s * (size_t)n_layers + (size_t)l])
                        total -= (size_t)(dim_value(c, weight_table[s].rows) *
                                          dim_value(c, weight_table[s].cols));
            }
    }

    m->weights = malloc(total * sizeof(float));
    m->layers = calloc((size_t)n_layers, sizeof *m->layers);
    int64_t max_rows =
        dim_value(c, DIM_Q) > dim_value(c, DIM_KV) ? dim_value(c, DIM_Q) : dim_value(c, DIM_KV);
    tmp = malloc((size_t)(max_rows * c->dim) * sizeof(float));
    if (!m->weights || !m->layers || !tmp) {
        r = cs_fail(CS_ENOMEM, "model %s: out of memory for %zu MiB of fp32 weights", path,
                    total * 4 >> 20);
        goto done;
    }
    m->n_weights = total;
    /* pass 2: convert into the carved buffer */
    float *p = m->weights;
    m->rope_inv_freq = p;
    p += c->head_dim / 2;
    if (c->sliding_window) {
        m->rope_inv_freq_swa = p;
        p += c->head_dim / 2;
    }
    for (size_t s = 0; s < N_SPECS; s++) {
        const weight_spec *w = &weight_table[s];
        int reps = w->layer_off == (size_t)-1 ? 1 : n_layers;
        for (int l = 0; l < reps; l++) {
            size_t idx = s * (size_t)n_layers + (size_t)l;
            if (!present[idx] || (m->mode == CS_WEIGHTS_QUANT && w->qg != QG_NONE)) continue;
            const cs_src_tensor *t = &found[idx];
            int64_t rows = dim_value(c, w->rows), cols = dim_value(c, w->cols);
            size_t n = (size_t)(rows * cols);
            cs__dtype_to_f32(t->type, t->data, p, n);
            size_t bytes;
            if (cs__dtype_nbytes(t->type, n, &bytes)) cs__mapped_release(t->data, bytes);
            if (src->unpermute_qk && w->perm != PERM_NONE) {
                int64_t heads = w->perm == PERM_Q ? c->n_heads : c->n_kv_heads;
                unpermute_rows(p, heads, c->head_dim, w->cols == DIM_ONE ? 1 : cols, tmp);
            }
            float **slot = w->layer_off == (size_t)-1
                               ? (float **)((char *)m + w->model_off)
                               : (float **)((char *)&m->layers[l] + w->layer_off);
            *slot = p;
            p += n;
        }
    }
    CS_ASSERT((size_t)(p - m->weights) == total);
    if (c->tied_embeddings) m->output = m->tok_embd;
    compute_rope(c, c->rope_theta, true, src->rope_freq_factors, m->rope_inv_freq);
    if (c->sliding_window) compute_rope(c, c->rope_theta_swa, false, NULL, m->rope_inv_freq_swa);
    for (int l = 0; l < n_layers; l++) {
        m->layers[l].window = cs_model_layer_window(c, l);
        m->layers[l].rope_inv_freq = m->layers[l].window ? m->rope_inv_freq_swa : m->rope_inv_freq;
    }
    if (m->mode == CS_WEIGHTS_QUANT && (r = pack_quant(m, src, found, present, path))) goto done;
    if (m->mode == CS_WEIGHTS_QUANT)
        describe_quant(m);
    else
        snprintf(m->weight_desc, sizeof m->weight_desc, "fp32");
    r = 0;
done:
    free(found);
    free(present);
    free(tmp);
    return r;
}

static bool is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int model_load(const char *path, bool vocab_only, cs_weight_mode mode, cs_model **out) {
    *out = NULL;
    cs_model *m = calloc(1, sizeof *m);
    if (!m) return cs_fail(CS_ENOMEM, "model: out of memory");
    m->mode = mode;
    double t0 = cs_now();
    int r = is_dir(path) ? cs__model_load_hf(path, m, vocab_only)
                         : cs__model_load_gguf(path, m, vocab_only);
    if (r) {
        cs_model_free(m);
        return r;
    }
    const cs_model_config *c = &m->cfg;
    if (m->fp_has_tensors) { /* the configuration as loaded, the tensors, the tokenizer */
        XXH3_state_t state, *st = &state;
        XXH3_64bits_reset(st);
        XXH3_64bits_update(st, "chunkserve model v2", 19); /* v2: the block's optional parts */
        XXH3_64bits_update(st, c->arch, strnlen(c->arch, sizeof c->arch));
        const int32_t ints[] = {
            c->n_vocab,         c->dim,        c->n_layers, c->n_heads,      c->n_kv_heads,
            c->head_dim,        c->hidden_dim, c->ctx_len,  c->rope_scaling, c->rope_orig_ctx,
            c->tied_embeddings, c->qkv_bias,   c->qk_norm,  c->post_norms,   c->gelu,
            c->sliding_window,  c->swa_period};
        for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
            fp_u64(st, (uint64_t)(uint32_t)ints[i]);
        const float floats[] = {c->norm_eps,
                                c->rope_theta,
                                c->rope_factor,
                                c->rope_low_freq_factor,
                                c->rope_high_freq_factor,
                                c->embed_scale,
                                c->attn_scale,
                                c->rope_theta_swa};
        for (size_t i = 0; i < sizeof floats / sizeof *floats; i++) {
            uint32_t u;
            memcpy(&u, &floats[i], 4);
            fp_u64(st, u);
        }
        fp_u64(st, m->fp_tensors);
        fp_u64(st, cs_tokenizer_fingerprint(m->tok));
        m->fingerprint = XXH3_64bits_digest(st);
    }
    char what[64];
    if (vocab_only)
        snprintf(what, sizeof what, "vocabulary only");
    else
        snprintf(what, sizeof what, "%.0f MiB %s", (double)cs_model_weight_bytes(m) / (1 << 20),
                 m->weight_desc);
    char windows[64] = "";
    if (c->sliding_window) {
        int n_local = 0;
        for (int l = 0; l < c->n_layers; l++)
            n_local += cs_model_layer_window(c, l) != 0;
        snprintf(windows, sizeof windows, ", %d-position windows on %d of the layers",
                 c->sliding_window, n_local);
    }
    CS_LOGI("loaded %s (%s): %d layers, dim %d, %d/%d heads x %d, ffn %d, vocab %d, %s embeddings"
            "%s, %s, fingerprint %016llx in %.2f s",
            path, c->arch, c->n_layers, c->dim, c->n_heads, c->n_kv_heads, c->head_dim,
            c->hidden_dim, c->n_vocab, c->tied_embeddings ? "tied" : "untied", windows, what,
            (unsigned long long)m->fingerprint, cs_now() - t0);
    *out = m;
    return 0;
}

int cs_model_load(const char *path, cs_model **out) {
    return model_load(path, false, CS_WEIGHTS_EXACT, out);
}
int cs_model_load_mode(const char *path, cs_weight_mode mode, cs_model **out) {
    return model_load(path, false, mode, out);
}
int cs_model_load_vocab(const char *path, cs_model **out) {
    return model_load(path, true, CS_WEIGHTS_EXACT, out);
}

cs_weight_mode cs_model_weight_mode(const cs_model *m) {
    return m->mode;
}
const char *cs_weight_mode_name(cs_weight_mode mode) {
    return mode == CS_WEIGHTS_QUANT ? "quant" : mode == CS_WEIGHTS_EXACT ? "exact" : "auto";
}
const char *cs_model_weight_desc(const cs_model *m) {
    return m->weight_desc[0] ? m->weight_desc : "none";
}

void cs_model_free(cs_model *m) {
    if (!m) return;
    cs_tokenizer_free(m->tok);
    if (m->layers)
        for (int32_t l = 0; l < m->cfg.n_layers; l++) {
            cs_qmat_free(m->layers[l].q_qkv);
            cs_qmat_free(m->layers[l].q_o);
            cs_qmat_free(m->layers[l].q_gate_up);
            cs_qmat_free(m->layers[l].q_down);
        }
    if (m->q_output != m->q_tok_embd) cs_qmat_free(m->q_output);
    cs_qmat_free(m->q_tok_embd);
    free(m->layers);
    free(m->weights);
    free(m);
}

const cs_model_config *cs_model_get_config(const cs_model *m) {
    return &m->cfg;
}
const cs_tokenizer *cs_model_tokenizer(const cs_model *m) {
    return m->tok;
}
uint64_t cs_model_fingerprint(const cs_model *m) {
    return m->fingerprint;
}
size_t cs_model_weight_bytes(const cs_model *m) {
    return m->n_weights * sizeof(float) + m->q_bytes;
}

int cs_tokenizer_load(const char *path, cs_tokenizer **out) {
    *out = NULL;
    return is_dir(path) ? cs__tokenizer_load_hf(path, out) : cs__tokenizer_load_gguf(path, out);
}

static int32_t gcd32(int32_t a, int32_t b) {
    while (b) {
        int32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The KV pages' layout (chunkserve/kv_cache.h's blocks): without windowed
 * layers one page holds every layer; with them a page holds gcd(n_global,
 * n_windowed) layers of one kind, so a block's pages are all one size: the
 * global layers' pages first, in layer order, then the windowed ones'. */
static int32_t kv_layout(const cs_model_config *c, cs_layer_weights *layers) {
    int32_t n_win = 0;
    for (int32_t l = 0; l < c->n_layers; l++)
        n_win += cs_model_layer_window(c, l) != 0;
    const int32_t n_glob = c->n_layers - n_win;
    const int32_t per_page = n_win ? gcd32(n_glob, n_win) : c->n_layers;
    int32_t gi = 0, wi = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        int32_t i = cs_model_layer_window(c, l) ? n_glob + wi++ : gi++;
        layers[l].kv_kind = i / per_page;
        layers[l].kv_slot = i % per_page;
    }
    return per_page;
}

void cs__model_weights(const cs_model *m, cs_weights *w, cs_layer_weights *layers) {
    const cs_model_config *c = &m->cfg;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const cs_layer *S = &m->layers[l];
        layers[l] = (cs_layer_weights){.window = S->window,
                                       .rope_inv_freq = S->rope_inv_freq,
                                       .q_norm = S->q_norm,
                                       .k_norm = S->k_norm,
                                       .post_attn_norm = S->post_attn_norm,
                                       .post_ffn_norm = S->post_ffn_norm,
                                       .attn_norm = S->attn_norm,
                                       .wq = S->wq,
                                       .wk = S->wk,
                                       .wv = S->wv,
                                       .bq = S->bq,
                                       .bk = S->bk,
                                       .bv = S->bv,
                                       .wo = S->wo,
                                       .ffn_norm = S->ffn_norm,
                                       .w_gate = S->w_gate,
                                       .w_up = S->w_up,
                                       .w_down = S->w_down,
                                       .qkv = S->q_qkv,
                                       .o = S->q_o,
                                       .gate_up = S->q_gate_up,
                                       .down = S->q_down};
    }
    w->shape = (cs_weights_shape){c->n_vocab,
                                  c->dim,
                                  c->n_layers,
                                  c->n_heads,
                                  c->n_kv_heads,
                                  c->head_dim,
                                  c->hidden_dim,
                                  c->norm_eps,
                                  m->mode == CS_WEIGHTS_QUANT ? m->q_output == m->q_tok_embd
                                                              : m->output == m->tok_embd,
                                  c->gelu ? CS_ACT_GELU_TANH : CS_ACT_SILU,
                                  c->embed_scale,
                                  c->attn_scale,
                                  kv_layout(c, layers)};
    w->tok_embd = m->tok_embd;
    w->out_norm = m->out_norm;
    w->output = m->output;
    w->layers = layers;
    w->q_tok_embd = m->q_tok_embd;
    w->q_output = m->q_output;
}
