/* model_gguf.c: GGUF → cs_model. Reads the hyper-parameters every family has
 * ({arch}.block_count, ...), lets the family (arch.h) read its own, offers
 * the file's tensors to cs__model_build and builds the tokenizer from
 * tokenizer.ggml.* metadata. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "gguf.h"
#include "model-impl.h"
#include "tokenizer-impl.h"

static int gguf_find(void *ctx, const char *name, cs_src_tensor *out) {
    const cs_gguf_tensor *t = cs__gguf_find_tensor(ctx, name);
    if (!t) return CS_ENOENT;
    out->type = t->type;
    out->n_dims = (int)t->n_dims;
    for (uint32_t d = 0; d < t->n_dims; d++)
        out->shape[d] = t->ne[t->n_dims - 1 - d];
    out->data = t->data;
    return 0;
}

static int str_copy(const cs_gguf_str *s, char *dst, size_t cap) {
    size_t n = s->len < cap - 1 ? s->len : cap - 1;
    memcpy(dst, s->ptr, n);
    dst[n] = 0;
    return 0;
}

int cs__model_load_gguf(const char *path, cs_model *m, bool vocab_only) {
    cs_gguf g;
    int r = cs__gguf_open(path, &g);
    if (r) return r;
    float *freq_factors = NULL;
    cs_model_config *c = &m->cfg;
    cs_gguf_str s;
    if ((r = cs__gguf_get_str(&g, "general.architecture", &s))) {
        if (r == CS_ENOENT)
            r = cs_fail(CS_EBADMSG, "gguf: %s: missing metadata key 'general.architecture'", path);
        goto done;
    }
    str_copy(&s, c->arch, sizeof c->arch);
    const cs_arch *family = cs__arch_find_gguf(c->arch);
    if (!family) {
        char supported[256];
        cs__arch_names(false, supported, sizeof supported);
        r = cs_fail(CS_ENOTSUP, "gguf: %s: architecture '%s' is not supported (%s are)", path,
                    c->arch, supported);
        goto done;
    }
    if (cs__gguf_get_str(&g, "general.name", &s) == 0) str_copy(&s, c->name, sizeof c->name);
    const char *a = c->arch;
    c->n_kv_heads = -1;
    c->head_dim = -1;
    int32_t rope_dims = -1, v_dim = -1;
    if ((r = cs__gguf_arch_u32(&g, a, "block_count", true, &c->n_layers, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "embedding_length", true, &c->dim, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "feed_forward_length", true, &c->hidden_dim, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "attention.head_count", true, &c->n_heads, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "context_length", true, &c->ctx_len, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "attention.head_count_kv", false, &c->n_kv_heads, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "attention.key_length", false, &c->head_dim, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "attention.value_length", false, &v_dim, path)) ||
        (r = cs__gguf_arch_u32(&g, a, "rope.dimension_count", false, &rope_dims, path)))
        goto done;
    if (c->n_kv_heads < 0) c->n_kv_heads = c->n_heads;
    if (c->head_dim < 0 && c->n_heads > 0) c->head_dim = c->dim / c->n_heads;
    if (v_dim >= 0 && v_dim != c->head_dim) {
        r = cs_fail(CS_ENOTSUP,
                    "gguf: %s: value heads of %d dims with key heads of %d are not "
                    "supported",
                    path, v_dim, c->head_dim);
        goto done;
    }
    if (rope_dims >= 0 && rope_dims != c->head_dim) {
        r = cs_fail(CS_ENOTSUP,
                    "gguf: %s: partial rotary embeddings (%d of %d dims) are not supported", path,
                    rope_dims, c->head_dim);
        goto done;
    }
    c->norm_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    if ((r = cs__gguf_arch_f32(&g, a, "attention.layer_norm_rms_epsilon", &c->norm_eps)) ||
        (r = cs__gguf_arch_f32(&g, a, "rope.freq_base", &c->rope_theta)))
        goto done;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (cs__gguf_get_str(&g, key, &s) == 0) {
        char type[32];
        str_copy(&s, type, sizeof type);
        if (!strcmp(type, "linear")) {
            c->rope_scaling = CS_ROPE_SCALING_LINEAR;
            if ((r = cs__gguf_arch_f32(&g, a, "rope.scaling.factor", &c->rope_factor))) goto done;
        } else if (strcmp(type, "none") != 0) {
            r = cs_fail(CS_ENOTSUP,
                        "gguf: %s: RoPE scaling '%s' is not supported (linear and llama3 are)",
                        path, type);
            goto done;
        }
    }
    const cs_gguf_tensor *embd = cs__gguf_find_tensor(&g, "token_embd.weight");
    if (!embd || embd->n_dims != 2) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: tensor 'token_embd.weight' is missing or not 2-D", path);
        goto done;
    }
    c->n_vocab = (int32_t)(embd->ne[1] > INT32_MAX ? -1 : embd->ne[1]);
    const cs_gguf_tensor *rf = cs__gguf_find_tensor(&g, "rope_freqs.weight");
    if (rf) { /* llama3 scaling is stored as per-frequency divisors */
        if (rf->n_dims != 1 || rf->ne[0] != c->head_dim / 2 || rf->type != CS_DTYPE_F32) {
            r = cs_fail(CS_EBADMSG, "gguf: %s: rope_freqs.weight must be f32 [%d]", path,
                        c->head_dim / 2);
            goto done;
        }
        freq_factors = malloc((size_t)rf->ne[0] * sizeof(float));
        if (!freq_factors) {
            r = cs_fail(CS_ENOMEM, "gguf: out of memory");
            goto done;
        }
        memcpy(freq_factors, rf->data, (size_t)rf->ne[0] * sizeof(float));
        for (int64_t i = 0; i < rf->ne[0]; i++) {
            if (!(freq_factors[i] > 0)) {
                r = cs_fail(CS_EBADMSG, "gguf: %s: rope_freqs.weight[%lld] is not positive", path,
                            (long long)i);
                goto done;
            }
        }
        c->rope_scaling = CS_ROPE_SCALING_LLAMA3;
        c->rope_factor = 1; /* the divisors carry the scaling */
        c->rope_orig_ctx = 1;
        c->rope_low_freq_factor = 0;
        c->rope_high_freq_factor = 1;
    }
    c->tied_embeddings = cs__gguf_find_tensor(&g, "output.weight") == NULL;
    if (family->gguf_config && (r = family->gguf_config(&g, c, path))) goto done;
    cs_tensor_source src = {gguf_find,    &g,        true, family->gguf_qk_permuted,
                            freq_factors, vocab_only};
    if ((r = cs__model_build(m, &src, path))) goto done;
    if ((r = cs__tokenizer_load_gguf(path, &m->tok))) goto done;
    if (cs_tokenizer_n_vocab(m->tok) != c->n_vocab) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: tokenizer has %d tokens but token_embd has %d rows",
                    path, cs_tokenizer_n_vocab(m->tok), c->n_vocab);
        goto done;
    }
done:
    free(freq_factors);
    cs__gguf_close(&g);
    return r;
}

static int32_t opt_id(const cs_gguf *g, const char *key, int32_t n_vocab, int *err) {
    uint32_t v;
    int r = cs__gguf_get_u32(g, key, &v);
    if (r == CS_ENOENT) return -1;
    if (r || v >= (uint32_t)n_vocab) {
        *err = cs_fail(CS_EBADMSG, "gguf: '%s' = %u is not a valid token id (vocabulary has %d)",
                       key, v, n_vocab);
        return -1;
    }
    return (int32_t)v;
}

int cs__tokenizer_load_gguf(const char *path, cs_tokenizer **out) {
    *out = NULL;
    cs_gguf g;
    int r = cs__gguf_open(path, &g);
    if (r) return r;
    cs_gguf_str *tokens = NULL, *merges = NULL;
    const char **tok_ptrs = NULL, **merge_ptrs = NULL;
    size_t *tok_lens = NULL, *merge_lens = NULL;
    int32_t *types = NULL;
    float *scores = NULL;
    char *tmpl = NULL;
    uint64_t n_tokens = 0, n_merges = 0, n_types = 0, n_scores = 0;
    cs_gguf_str s;
    char model[32] = "", pre[64] = "gpt2";
    if ((r = cs__gguf_get_str(&g, "tokenizer.ggml.model", &s))) {
        if (r == CS_ENOENT)
            r = cs_fail(CS_EBADMSG, "gguf: %s: missing metadata key 'tokenizer.ggml.model'", path);
        goto done;
    }
    str_copy(&s, model, sizeof model);
    bool spm = !strcmp(model, "llama");
    if (!spm && strcmp(model, "gpt2") != 0) {
        r = cs_fail(CS_ENOTSUP,
                    "gguf: %s: tokenizer model '%s' is not supported (byte-level BPE 'gpt2' and "
                    "SentencePiece 'llama' are)",
                    path, model);
        goto done;
    }
    if (spm)
        ; /* no pre-tokenizer: SentencePiece merges the whole text between special tokens */
    else if (cs__gguf_get_str(&g, "tokenizer.ggml.pre", &s) == 0)
        str_copy(&s, pre, sizeof pre);
    else
        CS_LOGW(
            "gguf: %s: no tokenizer.ggml.pre (an old conversion); using the GPT-2 pre-tokenizer",
            path);
    if ((r = cs__gguf_get_str_array(&g, "tokenizer.ggml.tokens", &tokens, &n_tokens))) {
        if (r == CS_ENOENT)
            r = cs_fail(CS_EBADMSG, "gguf: %s: missing metadata key 'tokenizer.ggml.tokens'", path);
        goto done;
    }
    if (n_tokens == 0 || n_tokens > (1 << 22)) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: tokenizer.ggml.tokens has %llu entries", path,
                    (unsigned long long)n_tokens);
        goto done;
    }
    if (spm) {
        if ((r = cs__gguf_get_f32_array(&g, "tokenizer.ggml.scores", &scores, &n_scores))) {
            if (r == CS_ENOENT)
                r = cs_fail(CS_EBADMSG, "gguf: %s: missing metadata key 'tokenizer.ggml.scores'",
                            path);
            goto done;
        }
        if (n_scores != n_tokens) {
            r = cs_fail(CS_EBADMSG,
                        "gguf: %s: tokenizer.ggml.scores has %llu entries for %llu "
                        "tokens",
                        path, (unsigned long long)n_scores, (unsigned long long)n_tokens);
            goto done;
        }
    } else if ((r = cs__gguf_get_str_array(&g, "tokenizer.ggml.merges", &merges, &n_merges))) {
        if (r == CS_ENOENT)
            r = cs_fail(CS_EBADMSG, "gguf: %s: missing metadata key 'tokenizer.ggml.merges'", path);
        goto done;
    }
    r = cs__gguf_get_i32_array(&g, "tokenizer.ggml.token_type", &types, &n_types);
    if (r && r != CS_ENOENT) goto done;
    r = 0;
    if (types && n_types != n_tokens) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: token_type has %llu entries for %llu tokens", path,
                    (unsigned long long)n_types, (unsigned long long)n_tokens);
        goto done;
    }
    tok_ptrs = malloc(n_tokens * sizeof *tok_ptrs);
    tok_lens = malloc(n_tokens * sizeof *tok_lens);
    merge_ptrs = malloc((n_merges + 1) * sizeof *merge_ptrs);
    merge_lens = malloc((n_merges + 1) * sizeof *merge_lens);
    if (!tok_ptrs || !tok_lens || !merge_ptrs || !merge_lens) {
        r = cs_fail(CS_ENOMEM, "gguf: out of memory");
        goto done;
    }
    for (uint64_t i = 0; i < n_tokens; i++)
        tok_ptrs[i] = tokens[i].ptr, tok_lens[i] = tokens[i].len;
    for (uint64_t i = 0; i < n_merges; i++)
        merge_ptrs[i] = merges[i].ptr, merge_lens[i] = merges[i].len;
    cs_vocab_spec spec = {0};
    spec.model = spm ? CS_TOK_SPM : CS_TOK_BPE;
    spec.scores = scores;
    spec.add_space_prefix = true; /* SentencePiece's default (add_dummy_prefix) */
    if ((r = cs__gguf_get_bool(&g, "tokenizer.ggml.add_space_prefix", &spec.add_space_prefix)) &&
        r != CS_ENOENT)
        goto done;
    r = 0;
    spec.n_vocab = (int32_t)n_tokens;
    spec.tokens = tok_ptrs;
    spec.token_lens = tok_lens;
    spec.token_types = types;
    spec.n_merges = (int32_t)n_merges;
    spec.merges = merge_ptrs;
    spec.merge_lens = merge_lens;
    if (!spm && (r = cs__pretok_from_name(pre, &spec.pretok))) goto done;
    spec.bos_id = opt_id(&g, "tokenizer.ggml.bos_token_id", spec.n_vocab, &r);
    spec.eos_id = opt_id(&g, "tokenizer.ggml.eos_token_id", spec.n_vocab, &r);
    spec.unk_id = opt_id(&g, "tokenizer.ggml.unknown_token_id", spec.n_vocab, &r);
    spec.pad_id = opt_id(&g, "tokenizer.ggml.padding_token_id", spec.n_vocab, &r);
    int32_t eot = opt_id(&g, "tokenizer.ggml.eot_token_id", spec.n_vocab, &r);
    if (r) goto done;
    if (eot >= 0) {
        spec.eog_ids = &eot;
        spec.n_eog_ids = 1;
    }
    bool add_bos = true; /* llama.cpp's default for BPE vocabularies when the key is absent */
    if ((r = cs__gguf_get_bool(&g, "tokenizer.ggml.add_bos_token", &add_bos)) && r != CS_ENOENT)
        goto done;
    r = 0;
    spec.add_bos = add_bos;
    char arch[32] = "";
    if (cs__gguf_get_str(&g, "general.architecture", &s) == 0) str_copy(&s, arch, sizeof arch);
    bool has_template = cs__gguf_get_str(&g, "tokenizer.chat_template", &s) == 0;
    if (!has_template) /* some converters drop it */
        spec.chat_template = cs__arch_default_chat_template(arch);
    if (has_template) {
        tmpl = malloc(s.len + 1);
        if (!tmpl) {
            r = cs_fail(CS_ENOMEM, "gguf: out of memory");
            goto done;
        }
        memcpy(tmpl, s.ptr, s.len);
        tmpl[s.len] = 0;
        spec.chat_template = tmpl;
    }
    r = cs__tokenizer_create(&spec, out);
done:
    free(tokens);
    free(merges);
    free(tok_ptrs);
    free(tok_lens);
    free(merge_ptrs);
    free(merge_lens);
    free(types);
    free(scores);
    free(tmpl);
    cs__gguf_close(&g);
    return r;
}

int cs_gguf_tensor_f32(const char *path, const char *name, float **out, int64_t *n) {
    *out = NULL;
    *n = 0;
    cs_gguf g;
    int r = cs__gguf_open(path, &g);
    if (r) return r;
    const cs_gguf_tensor *t = cs__gguf_find_tensor(&g, name);
    uint64_t count = 1;
    if (!t) {
        r = cs_fail(CS_ENOENT, "gguf: %s: no tensor '%s'", path, name);
        goto done;
    }
    for (uint32_t d = 0; d < t->n_dims; d++)
        count *= (uint64_t)t->ne[d];
    if (cs__dtype_bad_scale(t->type, t->data, (size_t)count) >= 0) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: tensor '%s' (%s) has an infinite or NaN block scale",
                    path, name, cs__dtype_name(t->type));
        goto done;
    }
    float *f = malloc((size_t)count * sizeof(float));
    if (!f) {
        r = cs_fail(CS_ENOMEM, "gguf: out of memory for tensor '%s'", name);
        goto done;
    }
    cs__dtype_to_f32(t->type, t->data, f, (size_t)count);
    *out = f;
    *n = (int64_t)count;
done:
    cs__gguf_close(&g);
    return r;
}
