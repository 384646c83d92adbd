/* tokenizer_json.c: builds a tokenizer from a Hugging Face tokenizer.json
 * (+ tokenizer_config.json). Accepts only the byte-level BPE shapes we
 * implement exactly (GPT-2, SmolLM, Llama-3, Qwen2 pre-tokenizers) and
 * refuses everything else with CS_ENOTSUP naming it, rather than tokenizing
 * differently from the reference. Not a general tokenizers.json interpreter. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "tokenizer-impl.h"
#include "util.h"

#define MAX_VOCAB (1 << 24)

/* The exact Split regexes of the Llama-3 and Qwen2 tokenizer.json files. */
static const char re_llama3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char re_qwen2[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                               "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static const char *type_of(const cJSON *o) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "type");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

static bool is_type(const cJSON *o, const char *type) {
    const char *t = type_of(o);
    return t && strcmp(t, type) == 0;
}

/* Optional boolean member: absent or null gives def; another type is -1. */
static int opt_bool(const cJSON *o, const char *key, int def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) return def;
    if (!cJSON_IsBool(v)) return -1;
    return cJSON_IsTrue(v) ? 1 : 0;
}

static int unsupported_shape(const char *what, const cJSON *o) {
    const char *t = type_of(o);
    return cs_fail(CS_ENOTSUP, "tokenizer.json: unsupported %s '%s'", what, t ? t : "(no type)");
}

/* ByteLevel pre-tokenizer without add_prefix_space; use_regex as given. */
static int check_byte_level(const cJSON *o, int want_regex) {
    if (!is_type(o, "ByteLevel")) return unsupported_shape("pre-tokenizer", o);
    int aps = opt_bool(o, "add_prefix_space", 1), rx = opt_bool(o, "use_regex", 1);
    if (aps < 0 || rx < 0) return cs_fail(CS_EBADMSG, "tokenizer.json: bad ByteLevel options");
    if (aps)
        return cs_fail(CS_ENOTSUP, "tokenizer.json: ByteLevel add_prefix_space is not supported");
    if (rx != want_regex)
        return cs_fail(CS_ENOTSUP, "tokenizer.json: ByteLevel use_regex=%s is not supported here",
                       rx ? "true" : "false");
    return 0;
}

static int parse_pretok(const cJSON *pt, enum cs_pretok *out) {
    if (!cJSON_IsObject(pt))
        return cs_fail(CS_ENOTSUP, "tokenizer.json: a pre-tokenizer is required (byte-level BPE)");
    if (is_type(pt, "ByteLevel")) {
        *out = CS_PRETOK_GPT2;
        return check_byte_level(pt, 1);
    }
    if (!is_type(pt, "Sequence")) return unsupported_shape("pre-tokenizer", pt);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
    if (!cJSON_IsArray(list))
        return cs_fail(CS_EBADMSG, "tokenizer.json: Sequence pre-tokenizer without a list");
    if (cJSON_GetArraySize(list) != 2)
        return cs_fail(CS_ENOTSUP, "tokenizer.json: Sequence of %d pre-tokenizers is not supported",
                       cJSON_GetArraySize(list));
    const cJSON *a = cJSON_GetArrayItem(list, 0), *b = cJSON_GetArrayItem(list, 1);
    if (is_type(a, "Digits")) {
        int ind = opt_bool(a, "individual_digits", 0);
        if (ind < 0) return cs_fail(CS_EBADMSG, "tokenizer.json: bad Digits options");
        if (!ind)
            return cs_fail(CS_ENOTSUP,
                           "tokenizer.json: Digits without individual_digits is not supported");
        *out = CS_PRETOK_SMOLLM;
        return check_byte_level(b, 1);
    }
    if (is_type(a, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(a, "pattern");
        const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
        const cJSON *beh = cJSON_GetObjectItemCaseSensitive(a, "behavior");
        int invert = opt_bool(a, "invert", 0);
        if (!cJSON_IsString(re) || !cJSON_IsString(beh) || invert < 0)
            return cs_fail(CS_ENOTSUP,
                           "tokenizer.json: Split pre-tokenizer without a Regex pattern");
        if (strcmp(beh->valuestring, "Isolated") != 0 || invert)
            return cs_fail(CS_ENOTSUP, "tokenizer.json: Split behavior '%s'%s is not supported",
                           beh->valuestring, invert ? " (inverted)" : "");
        if (strcmp(re->valuestring, re_llama3) == 0) {
            *out = CS_PRETOK_LLAMA3;
        } else if (strcmp(re->valuestring, re_qwen2) == 0) {
            *out = CS_PRETOK_QWEN2;
        } else {
            return cs_fail(CS_ENOTSUP, "tokenizer.json: unsupported Split regex '%.120s'",
                           re->valuestring);
        }
        return check_byte_level(b, 0);
    }
    return unsupported_shape("pre-tokenizer", a);
}

/* Decoder must be ByteLevel, possibly inside a Sequence; null is accepted
 * (decoding is defined by the byte-level vocabulary anyway). */
static int check_decoder(const cJSON *d) {
    if (!d || cJSON_IsNull(d) || is_type(d, "ByteLevel")) return 0;
    if (is_type(d, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(d, "decoders");
        const cJSON *it;
        if (!cJSON_IsArray(list)) return cs_fail(CS_EBADMSG, "tokenizer.json: bad decoder");
        cJSON_ArrayForEach(it, list) {
            if (!is_type(it, "ByteLevel")) return unsupported_shape("decoder", it);
        }
        return 0;
    }
    return unsupported_shape("decoder", d);
}

typedef struct {
    int32_t n_vocab;
    const char **tokens;
    int32_t *types;
    int32_t n_merges;
    char **merges;
    bool post_bos; /* post-processor prepends a special token */
    int32_t post_bos_id;
} hf_parts;

static int find_token(const hf_parts *p, const char *text) {
    for (int32_t i = 0; i < p->n_vocab; i++)
        if (p->tokens[i] && strcmp(p->tokens[i], text) == 0) return i;
    return -1;
}

static int read_id(const cJSON *v, int32_t *id, const char *what) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= MAX_VOCAB ||
        v->valuedouble != floor(v->valuedouble))
        return cs_fail(CS_EBADMSG, "tokenizer.json: %s has a bad id", what);
    *id = (int32_t)v->valuedouble;
    return 0;
}

static int parse_vocab(const cJSON *model, const cJSON *added, hf_parts *p) {
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab))
        return cs_fail(CS_EBADMSG, "tokenizer.json: model.vocab is not an object");
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return cs_fail(CS_EBADMSG, "tokenizer.json: added_tokens is not an array");
    int32_t max_id = -1, id;
    const cJSON *it;
    int rc;
    cJSON_ArrayForEach(it, vocab) {
        if ((rc = read_id(it, &id, "model.vocab entry"))) return rc;
        if (id > max_id) max_id = id;
    }
    cJSON_ArrayForEach(it, added) {
        if ((rc = read_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &id, "added token")))
            return rc;
        if (id > max_id) max_id = id;
    }
    if (max_id < 0) return cs_fail(CS_EBADMSG, "tokenizer.json: empty vocabulary");
    p->n_vocab = max_id + 1;
    p->tokens = calloc((size_t)p->n_vocab, sizeof *p->tokens);
    p->types = malloc((size_t)p->n_vocab * sizeof *p->types);
    if (!p->tokens || !p->types) return cs_fail(CS_ENOMEM, "tokenizer.json: out of memory");
    for (int32_t i = 0; i < p->n_vocab; i++)
        p->types[i] = CS_TOKEN_NORMAL;
    cJSON_ArrayForEach(it, vocab) {
        read_id(it, &id, "");
        if (p->tokens[id])
            return cs_fail(CS_EBADMSG, "tokenizer.json: id %d is used by '%.40s' and '%.40s'", id,
                           p->tokens[id], it->string);
        p->tokens[id] = it->string;
    }
    cJSON_ArrayForEach(it, added) {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        int special = opt_bool(it, "special", 0);
        if (!cJSON_IsString(content) || special < 0)
            return cs_fail(CS_EBADMSG, "tokenizer.json: malformed added token");
        read_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &id, "");
        if (p->tokens[id] && strcmp(p->tokens[id], content->valuestring) != 0)
            return cs_fail(CS_EBADMSG,
                           "tokenizer.json: added token '%.40s' reuses id %d of '%.40s'",
                           content->valuestring, id, p->tokens[id]);
        p->tokens[id] = content->valuestring;
        p->types[id] = special ? CS_TOKEN_CONTROL : CS_TOKEN_USER_DEFINED;
    }
    for (int32_t i = 0; i < p->n_vocab; i++)
        if (!p->tokens[i]) return cs_fail(CS_EBADMSG, "tokenizer.json: no token has id %d", i);
    return 0;
}

static int parse_merges(const cJSON *model, hf_parts *p) {
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsArray(merges))
        return cs_fail(CS_EBADMSG, "tokenizer.json: model.merges is not an array");
    int n = cJSON_GetArraySize(merges);
    p->merges = calloc((size_t)(n ? n : 1), sizeof *p->merges);
    if (!p->merges) return cs_fail(CS_ENOMEM, "tokenizer.json: out of memory");
    const cJSON *it;
    int32_t i = 0;
    cJSON_ArrayForEach(it, merges) {
        const char *l, *r;
        char *s;
        if (cJSON_IsString(it)) {
            /* "left right": kept as is, split by cs__tokenizer_create. */
            l = it->valuestring;
            r = NULL;
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            l = cJSON_GetArrayItem(it, 0)->valuestring;
            r = cJSON_GetArrayItem(it, 1)->valuestring;
            /* The spec's merge form is "left right"; a space inside a token
             * (impossible in byte-level vocabularies) would be ambiguous. */
            if (!*l || strchr(l, ' ') || strchr(r, ' '))
                return cs_fail(CS_EBADMSG, "tokenizer.json: merge %d has a token with a space", i);
        } else {
            return cs_fail(CS_EBADMSG,
                           "tokenizer.json: merge %d is neither \"a b\" nor [\"a\", \"b\"]", i);
        }
        size_t ll = strlen(l), rl = r ? strlen(r) : 0;
        s = malloc(ll + rl + 2);
        if (!s) return cs_fail(CS_ENOMEM, "tokenizer.json: out of memory");
        memcpy(s, l, ll);
        if (r) {
            s[ll] = ' ';
            memcpy(s + ll + 1, r, rl + 1);
        } else {
            s[ll] = 0;
        }
        p->merges[i++] = s;
        p->n_merges = i;
    }
    return 0;
}

/* TemplateProcessing whose single-sequence template starts with a special
 * token means "prepend BOS" (Llama-3); other processors change ids in ways
 * we do not model. */
static int parse_post(const cJSON *pp, hf_parts *p) {
    if (!pp || cJSON_IsNull(pp) || is_type(pp, "ByteLevel")) return 0;
    if (is_type(pp, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pp, "processors"), *it;
        if (!cJSON_IsArray(list)) return cs_fail(CS_EBADMSG, "tokenizer.json: bad post-processor");
        cJSON_ArrayForEach(it, list) {
            int rc = parse_post(it, p);
            if (rc) return rc;
        }
        return 0;
    }
    if (!is_type(pp, "TemplateProcessing")) return unsupported_shape("post-processor", pp);
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(pp, "single");
    int n = cJSON_IsArray(single) ? cJSON_GetArraySize(single) : 0;
    const cJSON *last = n ? cJSON_GetArrayItem(single, n - 1) : NULL;
    const cJSON *first = n == 2 ? cJSON_GetArrayItem(single, 0) : NULL;
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(first, "SpecialToken");
    const cJSON *sid = cJSON_GetObjectItemCaseSensitive(st, "id");
    if (!cJSON_GetObjectItemCaseSensitive(last, "Sequence") || n > 2 ||
        (n == 2 && !cJSON_IsString(sid)))
        return cs_fail(CS_ENOTSUP, "tokenizer.json: TemplateProcessing other than \"$A\" or "
                                   "\"<bos> $A\" is not supported");
    if (n == 2) {
        int32_t id = find_token(p, sid->valuestring);
        if (id < 0)
            return cs_fail(CS_EBADMSG,
                           "tokenizer.json: post-processor token '%.40s' is not in the vocabulary",
                           sid->valuestring);
        p->post_bos = true;
        p->post_bos_id = id;
    }
    return 0;
}

/* tokenizer_config.json token fields are "text" or {"content": "text"}. */
static int config_token(const cJSON *cfg, const char *key, const hf_parts *p, int32_t *id) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsString(v))
        return cs_fail(CS_EBADMSG, "tokenizer_config.json: %s is not a string", key);
    int32_t t = find_token(p, v->valuestring);
    if (t < 0)
        return cs_fail(CS_EBADMSG, "tokenizer_config.json: %s '%.40s' is not in the vocabulary",
                       key, v->valuestring);
    *id = t;
    return 0;
}

static int config_template(const cJSON *cfg, const char **out) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    if (!t || cJSON_IsNull(t)) return 0;
    if (cJSON_IsString(t)) {
        *out = t->valuestring;
        return 0;
    }
    if (cJSON_IsArray(t)) { /* [{"name": "default", "template": "..."}, ...] */
        const cJSON *it;
        cJSON_ArrayForEach(it, t) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
            const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(it, "template");
            if (cJSON_IsString(name) && cJSON_IsString(tmpl) &&
                strcmp(name->valuestring, "default") == 0) {
                *out = tmpl->valuestring;
                return 0;
            }
        }
        return 0;
    }
    return cs_fail(CS_EBADMSG,
                   "tokenizer_config.json: chat_template is neither a string nor a list");
}

int cs__tokenizer_from_hf_json(const char *tokenizer_json, size_t len, const char *config_json,
                               cs_tokenizer **out) {
    *out = NULL;
    hf_parts p = {0};
    cJSON *root = NULL, *cfg = NULL;
    int rc;
    if (!tokenizer_json) return cs_fail(CS_EINVAL, "tokenizer.json: no data");
    root = cJSON_ParseWithLength(tokenizer_json, len);
    if (!cJSON_IsObject(root)) {
        rc = cs_fail(CS_EBADMSG, "tokenizer.json: not a JSON object");
        goto fail;
    }
    if (config_json) {
        cfg = cJSON_Parse(config_json);
        if (!cJSON_IsObject(cfg)) {
            rc = cs_fail(CS_EBADMSG, "tokenizer_config.json: not a JSON object");
            goto fail;
        }
    }

    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) {
        rc = cs_fail(CS_EBADMSG, "tokenizer.json: no model object");
        goto fail;
    }
    const char *mtype = type_of(model);
    if (mtype ? strcmp(mtype, "BPE") != 0 : !cJSON_HasObjectItem(model, "merges")) {
        rc = cs_fail(CS_ENOTSUP, "tokenizer.json: model type '%s' is not supported (BPE is)",
                     mtype ? mtype : "(none)");
        goto fail;
    }
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (v && !cJSON_IsNull(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0)) {
        rc = cs_fail(CS_ENOTSUP, "tokenizer.json: BPE dropout is not supported");
        goto fail;
    }
    static const char *const no_affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        v = cJSON_GetObjectItemCaseSensitive(model, no_affix[i]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && !*v->valuestring)) {
            rc = cs_fail(CS_ENOTSUP, "tokenizer.json: BPE %s is not supported", no_affix[i]);
            goto fail;
        }
    }
    int ignore_merges = opt_bool(model, "ignore_merges", 0);
    if (ignore_merges < 0) {
        rc = cs_fail(CS_EBADMSG, "tokenizer.json: model.ignore_merges is not a boolean");
        goto fail;
    }
    v = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    /* NFC is accepted without being applied, as llama.cpp does: it only
     * matters for input that is not already NFC. */
    if (v && !cJSON_IsNull(v) && !is_type(v, "NFC")) {
        rc = unsupported_shape("normalizer", v);
        goto fail;
    }

    cs_vocab_spec spec = {0};
    spec.bos_id = spec.eos_id = spec.unk_id = spec.pad_id = -1;
    if ((rc = parse_pretok(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), &spec.pretok)))
        goto fail;
    if ((rc = check_decoder(cJSON_GetObjectItemCaseSensitive(root, "decoder")))) goto fail;
    if ((rc = parse_vocab(model, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), &p)))
        goto fail;
    if ((rc = parse_merges(model, &p))) goto fail;
    if ((rc = parse_post(cJSON_GetObjectItemCaseSensitive(root, "post_processor"), &p))) goto fail;

    v = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (cJSON_IsString(v) && (spec.unk_id = find_token(&p, v->valuestring)) < 0) {
        rc = cs_fail(CS_EBADMSG, "tokenizer.json: unk_token '%.40s' is not in the vocabulary",
                     v->valuestring);
        goto fail;
    }
    if (p.post_bos) {
        spec.bos_id = p.post_bos_id;
        spec.add_bos = true;
    }
    if (cfg) {
        if ((rc = config_token(cfg, "bos_token", &p, &spec.bos_id)) ||
            (rc = config_token(cfg, "eos_token", &p, &spec.eos_id)) ||
            (rc = config_token(cfg, "unk_token", &p, &spec.unk_id)) ||
            (rc = config_token(cfg, "pad_token", &p, &spec.pad_id)) ||
            (rc = config_template(cfg, &spec.chat_template)))
            goto fail;
        int ab = opt_bool(cfg, "add_bos_token", spec.add_bos);
        if (ab < 0) {
            rc = cs_fail(CS_EBADMSG, "tokenizer_config.json: add_bos_token is not a boolean");
            goto fail;
        }
        spec.add_bos = ab && spec.bos_id >= 0;
    }

    spec.n_vocab = p.n_vocab;
    spec.tokens = p.tokens;
    spec.token_types = p.types;
    spec.n_merges = p.n_merges;
    spec.merges = (const char *const *)p.merges;
    if ((rc = cs__tokenizer_create(&spec, out))) goto fail;
    cs__tokenizer_set_ignore_merges(*out, ignore_merges);
    rc = 0;
fail:
    for (int32_t i = 0; i < p.n_merges; i++)
        free(p.merges[i]);
    free(p.merges);
    free(p.types);
    free(p.tokens);
    cJSON_Delete(cfg);
    cJSON_Delete(root);
    return rc;
}
