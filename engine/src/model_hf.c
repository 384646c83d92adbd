/* model_hf.c: Hugging Face model directory → cs_model: config.json for the
 * hyper-parameters, *.safetensors for the weights (already in HF layout, so
 * nothing is permuted), tokenizer.json (+ tokenizer_config.json) for the
 * tokenizer. A vocabulary-only load needs no *.safetensors (when there are
 * some, their shapes are still checked, so the configuration is a full load's). */
#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "model-impl.h"
#include "safetensors.h"
#include "tokenizer-impl.h"

static int st_find(void *ctx, const char *name, cs_src_tensor *out) {
    const cs_st_tensor *t = cs__st_find(ctx, name);
    if (!t) return CS_ENOENT;
    out->type = t->type;
    out->n_dims = t->n_dims;
    for (int d = 0; d < t->n_dims; d++)
        out->shape[d] = t->shape[d];
    out->data = t->data;
    return 0;
}

/* Integer field: required ones fail when missing; all must be exact ints. */
static int cfg_int(const cJSON *root, const char *key, bool required, int32_t *out,
                   const char *path) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!j || cJSON_IsNull(j)) {
        if (required) return cs_fail(CS_EBADMSG, "config.json in %s: missing key '%s'", path, key);
        return 0;
    }
    /* the range first: converting a double outside int64 is undefined */
    if (!cJSON_IsNumber(j) || !(j->valuedouble >= 0 && j->valuedouble <= INT32_MAX) ||
        j->valuedouble != (double)(int64_t)j->valuedouble)
        return cs_fail(CS_EBADMSG, "config.json in %s: '%s' must be a non-negative integer", path,
                       key);
    *out = (int32_t)j->valuedouble;
    return 0;
}

static int cfg_float(const cJSON *root, const char *key, float *out, const char *path) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!j || cJSON_IsNull(j)) return 0;
    if (!cJSON_IsNumber(j) || !(fabs(j->valuedouble) <= FLT_MAX)) /* no inf, NaN, overflow */
        return cs_fail(CS_EBADMSG, "config.json in %s: '%s' must be a finite float32 number", path,
                       key);
    *out = (float)j->valuedouble;
    return 0;
}

static int parse_config(const char *dir, cs_model_config *c) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = NULL;
    size_t len;
    int r = cs__read_file(path, &text, &len);
    if (r) return r;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return cs_fail(CS_EBADMSG, "%s: not a JSON object", path);
    }
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) {
        r = cs_fail(CS_EBADMSG, "%s: missing key 'model_type'", path);
        goto done;
    }
    if (!cs__arch_find_hf(mt->valuestring)) {
        char supported[256];
        cs__arch_names(true, supported, sizeof supported);
        r = cs_fail(CS_ENOTSUP, "%s: model_type '%s' is not supported (%s are)", path,
                    mt->valuestring, supported);
        goto done;
    }
    snprintf(c->arch, sizeof c->arch, "%s", mt->valuestring);
    const char *base = strrchr(dir, '/');
    snprintf(c->name, sizeof c->name, "%s", base && base[1] ? base + 1 : dir);
    c->n_kv_heads = -1;
    c->head_dim = -1;
    c->ctx_len = 2048;
    c->norm_eps = 1e-6f;
    c->rope_theta = 10000.0f;
    if ((r = cfg_int(root, "vocab_size", true, &c->n_vocab, dir)) ||
        (r = cfg_int(root, "hidden_size", true, &c->dim, dir)) ||
        (r = cfg_int(root, "intermediate_size", true, &c->hidden_dim, dir)) ||
        (r = cfg_int(root, "num_hidden_layers", true, &c->n_layers, dir)) ||
        (r = cfg_int(root, "num_attention_heads", true, &c->n_heads, dir)) ||
        (r = cfg_int(root, "num_key_value_heads", false, &c->n_kv_heads, dir)) ||
        (r = cfg_int(root, "head_dim", false, &c->head_dim, dir)) ||
        (r = cfg_int(root, "max_position_embeddings", false, &c->ctx_len, dir)) ||
        (r = cfg_float(root, "rms_norm_eps", &c->norm_eps, dir)) ||
        (r = cfg_float(root, "rope_theta", &c->rope_theta, dir)))
        goto done;
    if (c->n_kv_heads < 0) c->n_kv_heads = c->n_heads;
    if (c->head_dim < 0 && c->n_heads > 0) c->head_dim = c->dim / c->n_heads;
    const cJSON *tie = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings");
    if (tie && !cJSON_IsBool(tie)) {
        r = cs_fail(CS_EBADMSG, "%s: 'tie_word_embeddings' must be true or false", path);
        goto done;
    }
    /* transformers' default is tied for PretrainedConfig */
    c->tied_embeddings = tie ? cJSON_IsTrue(tie) : true;
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (rs && !cJSON_IsNull(rs)) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
        if (!t) t = cJSON_GetObjectItemCaseSensitive(rs, "type");
        if (!cJSON_IsObject(rs) || !cJSON_IsString(t)) {
            r = cs_fail(CS_EBADMSG, "%s: 'rope_scaling' needs a 'rope_type'", path);
            goto done;
        }
        c->rope_factor = 1;
        if ((r = cfg_float(rs, "factor", &c->rope_factor, dir))) goto done;
        if (!strcmp(t->valuestring, "linear")) {
            c->rope_scaling = CS_ROPE_SCALING_LINEAR;
        } else if (!strcmp(t->valuestring, "llama3")) {
            c->rope_scaling = CS_ROPE_SCALING_LLAMA3;
            if ((r = cfg_float(rs, "low_freq_factor", &c->rope_low_freq_factor, dir)) ||
                (r = cfg_float(rs, "high_freq_factor", &c->rope_high_freq_factor, dir)) ||
                (r = cfg_int(rs, "original_max_position_embeddings", true, &c->rope_orig_ctx, dir)))
                goto done;
        } else if (strcmp(t->valuestring, "default") != 0) {
            r = cs_fail(CS_ENOTSUP,
                        "%s: RoPE scaling '%s' is not supported (linear and llama3 are)", path,
                        t->valuestring);
            goto done;
        }
    }
done:
    cJSON_Delete(root);
    return r;
}

int cs__model_load_hf(const char *dir, cs_model *m, bool vocab_only) {
    int r = parse_config(dir, &m->cfg);
    if (r) return r;
    cs_st_set set;
    if ((r = cs__st_open_dir(dir, &set))) {
        /* A directory with config and tokenizer only is enough for the
         * vocabulary (the router's copy of a model need not hold weights). */
        if (!(vocab_only && r == CS_ENOENT)) return r;
        if ((r = cs__model_build(m, NULL, dir))) return r;
        /* what the tensors would have said: Qwen2 checkpoints carry q/k/v biases */
        m->cfg.qkv_bias = !strcmp(m->cfg.arch, "qwen2");
    } else {
        cs_tensor_source src = {st_find, &set, false, false, NULL, vocab_only};
        r = cs__model_build(m, &src, dir);
        cs__st_close(&set);
        if (r) return r;
    }
    if ((r = cs__tokenizer_load_hf(dir, &m->tok))) return r;
    if (cs_tokenizer_n_vocab(m->tok) > m->cfg.n_vocab)
        return cs_fail(CS_EBADMSG,
                       "model %s: tokenizer has %d tokens but the embedding only %d rows", dir,
                       cs_tokenizer_n_vocab(m->tok), m->cfg.n_vocab);
    return 0;
}

int cs__tokenizer_load_hf(const char *dir, cs_tokenizer **out) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    char *json = NULL, *cfg = NULL;
    size_t len, cfg_len;
    int r = cs__read_file(path, &json, &len);
    if (r) return r;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (cs__read_file(path, &cfg, &cfg_len) != 0) cfg = NULL; /* optional */
    r = cs__tokenizer_from_hf_json(json, len, cfg, out);
    free(json);
    free(cfg);
    return r;
}
