/* tokenizer.c: byte-level BPE over a vocabulary handed in by a loader
 * (cs_vocab_spec): special-token splitting, pre-tokenization, merges by rank,
 * decoding and streaming detokenization. Loaders (GGUF metadata,
 * tokenizer.json) and the chat template live elsewhere; SentencePiece,
 * WordPiece and Unigram vocabularies are not supported. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "tokenizer-impl.h"
#include "unicode.h"
#include "util.h"

/* ---- hashing ---------------------------------------------------------- */

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) { /* splitmix64 finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static size_t table_size(size_t n) {
    size_t cap = 16;
    while (cap < n * 2)
        cap *= 2;
    return cap;
}

static int32_t text_lookup(const cs_tokenizer *tok, const void *s, size_t n) {
    size_t i = (size_t)hash_bytes(s, n) & tok->text_map_mask;
    for (;;) {
        int32_t id = tok->text_map[i];
        if (id < 0) return -1;
        size_t len;
        const char *t = cs__tok_text(tok, id, &len);
        if (len == n && memcmp(t, s, n) == 0) return id;
        i = (i + 1) & tok->text_map_mask;
    }
}

static const struct cs__merge_slot *merge_lookup(const cs_tokenizer *tok, int32_t left,
                                                 int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    size_t i = (size_t)hash_u64(key) & tok->merge_map_mask;
    for (;;) {
        const struct cs__merge_slot *s = &tok->merge_map[i];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
        i = (i + 1) & tok->merge_map_mask;
    }
}

/* ---- construction ----------------------------------------------------- */

/* Undoes the byte-level mapping of a normal token. Characters outside the
 * mapping (not produced by byte-level vocabularies) are kept as UTF-8. */
static size_t unmap_byte_level(const char *text, size_t len, char *out) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0, o = 0;
    while (i < len) {
        uint32_t cp;
        int k = cs__utf8_decode(s + i, len - i, &cp);
        if (k <= 0) {
            out[o++] = (char)s[i++];
            continue;
        }
        int b = cs__unicode_to_byte(cp);
        if (b >= 0) {
            out[o++] = (char)b;
        } else {
            memcpy(out + o, s + i, (size_t)k);
            o += (size_t)k;
        }
        i += (size_t)k;
    }
    return o;
}

/* SentencePiece's space, U+2581 LOWER ONE EIGHTH BLOCK, in UTF-8. */
#define SPM_SPACE "\xE2\x96\x81"

/* A SentencePiece piece's bytes: each U+2581 back to a space. */
static size_t unescape_spaces(const char *t, size_t len, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        if (len - i >= 3 && !memcmp(t + i, SPM_SPACE, 3)) {
            out[o++] = ' ';
            i += 3;
        } else {
            out[o++] = t[i++];
        }
    }
    return o;
}

static int parse_byte_token(const char *t, size_t len) {
    if (len != 6 || memcmp(t, "<0x", 3) != 0 || t[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = t[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

typedef struct {
    uint8_t first;
    size_t len;
    int32_t id;
} special_key;

static int cmp_special(const void *a, const void *b) {
    const special_key *x = a, *y = b;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1; /* longest first */
    return x->id < y->id ? -1 : x->id > y->id;
}

static int check_id(int32_t id, int32_t n_vocab, const char *what) {
    if (id < -1 || id >= n_vocab)
        return cs_fail(CS_EBADMSG, "tokenizer: %s id %d out of range (n_vocab %d)", what, id,
                       n_vocab);
    return 0;
}

static int build_tokens(cs_tokenizer *tok, const cs_vocab_spec *spec) {
    int32_t n = spec->n_vocab;
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!spec->tokens[i]) return cs_fail(CS_EBADMSG, "tokenizer: token %d is missing", i);
        size_t len = spec->token_lens ? spec->token_lens[i] : strlen(spec->tokens[i]);
        if (cs__add_overflow(total, len + 1, &total) || len >= (size_t)1 << 30)
            return cs_fail(CS_EBADMSG, "tokenizer: token %d too long", i);
        int32_t type = spec->token_types ? spec->token_types[i] : CS_TOKEN_NORMAL;
        if (type < CS_TOKEN_UNDEFINED || type > CS_TOKEN_BYTE)
            return cs_fail(CS_EBADMSG, "tokenizer: token %d has bad type %d", i, type);
        tok->types[i] = (uint8_t)type;
    }
    tok->text = malloc(total ? total : 1);
    tok->bytes = malloc(total ? total : 1);
    if (!tok->text || !tok->bytes) return cs_fail(CS_ENOMEM, "tokenizer: out of memory");
    size_t off = 0, boff = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len = spec->token_lens ? spec->token_lens[i] : strlen(spec->tokens[i]);
        const char *t = spec->tokens[i];
        tok->text_off[i] = off;
        memcpy(tok->text + off, t, len);
        tok->text[off + len] = 0;
        off += len + 1;

        tok->bytes_off[i] = boff;
        size_t blen;
        int byte = tok->types[i] == CS_TOKEN_BYTE ? parse_byte_token(t, len) : -1;
        switch (tok->types[i]) {
        case CS_TOKEN_CONTROL:
        case CS_TOKEN_USER_DEFINED:
        case CS_TOKEN_UNKNOWN:
            /* Added/special tokens are stored as plain text, not byte-level. */
            memcpy(tok->bytes + boff, t, len);
            blen = len;
            break;
        default:
            if (byte >= 0) {
                tok->bytes[boff] = (char)byte;
                blen = 1;
            } else if (spec->model == CS_TOK_SPM) {
                blen = unescape_spaces(t, len, tok->bytes + boff);
            } else {
                blen = unmap_byte_level(t, len, tok->bytes + boff);
            }
            break;
        }
        tok->bytes[boff + blen] = 0;
        boff += blen + 1;
    }
    tok->text_off[n] = off;
    tok->bytes_off[n] = boff;

    size_t cap = table_size((size_t)n);
    tok->text_map = malloc(cap * sizeof *tok->text_map);
    if (!tok->text_map) return cs_fail(CS_ENOMEM, "tokenizer: out of memory");
    memset(tok->text_map, 0xff, cap * sizeof *tok->text_map);
    tok->text_map_mask = cap - 1;
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *t = cs__tok_text(tok, i, &len);
        if (len == 0) continue; /* never matched; some vocabularies pad with "" */
        size_t h = (size_t)hash_bytes(t, len) & tok->text_map_mask;
        while (tok->text_map[h] >= 0) {
            size_t l2;
            const char *t2 = cs__tok_text(tok, tok->text_map[h], &l2);
            if (l2 == len && memcmp(t, t2, len) == 0)
                return cs_fail(CS_EBADMSG, "tokenizer: tokens %d and %d are both '%.40s'",
                               tok->text_map[h], i, t);
            h = (h + 1) & tok->text_map_mask;
        }
        tok->text_map[h] = i;
    }

    for (int b = 0; b < 256; b++) {
        uint8_t u[4];
        int k = cs__utf8_encode(cs__byte_to_unicode((uint8_t)b), u);
        tok->byte_id[b] = text_lookup(tok, u, (size_t)k);
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        int32_t id = text_lookup(tok, name, 6);
        tok->byte_fallback[b] = id >= 0 && tok->types[id] == CS_TOKEN_BYTE ? id : -1;
    }
    return 0;
}

static int build_merges(cs_tokenizer *tok, const cs_vocab_spec *spec) {
    int32_t n = spec->n_merges;
    size_t cap = table_size((size_t)n);
    tok->merge_map = malloc(cap * sizeof *tok->merge_map);
    if (!tok->merge_map) return cs_fail(CS_ENOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < cap; i++)
        tok->merge_map[i].key = UINT64_MAX;
    tok->merge_map_mask = cap - 1;
    tok->n_merges = n;

    char *buf = NULL;
    size_t buf_cap = 0;
    int rc = 0;
    for (int32_t r = 0; r < n; r++) {
        const char *m = spec->merges[r];
        if (!m) {
            rc = cs_fail(CS_EBADMSG, "tokenizer: merge %d is missing", r);
            break;
        }
        size_t len = spec->merge_lens ? spec->merge_lens[r] : strlen(m);
        /* Split at the first space after the first byte, as llama.cpp does;
         * byte-level tokens never contain a literal space. */
        const char *sp = len > 1 ? memchr(m + 1, ' ', len - 1) : NULL;
        if (!sp) {
            rc = cs_fail(CS_EBADMSG, "tokenizer: merge %d ('%.40s') has no space", r, m);
            break;
        }
        size_t ll = (size_t)(sp - m), rl = len - ll - 1;
        int32_t left = text_lookup(tok, m, ll);
        int32_t right = rl ? text_lookup(tok, sp + 1, rl) : -1;
        if (ll + rl > buf_cap) {
            char *nb = realloc(buf, ll + rl);
            if (!nb) {
                rc = cs_fail(CS_ENOMEM, "tokenizer: out of memory");
                break;
            }
            buf = nb;
            buf_cap = ll + rl;
        }
        memcpy(buf, m, ll);
        memcpy(buf + ll, sp + 1, rl);
        int32_t result = left >= 0 && right >= 0 ? text_lookup(tok, buf, ll + rl) : -1;
        if (result < 0) {
            rc = cs_fail(CS_EBADMSG, "tokenizer: merge %d ('%.*s') refers to unknown tokens", r,
                         (int)(len < 60 ? len : 60), m);
            break;
        }
        uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
        size_t h = (size_t)hash_u64(key) & tok->merge_map_mask;
        while (tok->merge_map[h].key != UINT64_MAX && tok->merge_map[h].key != key)
            h = (h + 1) & tok->merge_map_mask;
        if (tok->merge_map[h].key == key) {
            rc = cs_fail(CS_EBADMSG, "tokenizer: merge %d ('%.*s') duplicates merge %d", r,
                         (int)(len < 60 ? len : 60), m, tok->merge_map[h].rank);
            break;
        }
        tok->merge_map[h].key = key;
        tok->merge_map[h].rank = r;
        tok->merge_map[h].result = result;
    }
    free(buf);
    return rc;
}

static const char *const eog_texts[] = {"<|im_end|>", "<|eot_id|>", "<|endoftext|>",
                                        "<|end_of_text|>", "<end_of_turn>"};

static int build_attrs(cs_tokenizer *tok, const cs_vocab_spec *spec) {
    int32_t n = tok->n_vocab;
    int32_t n_specials = 0;
    for (int32_t i = 0; i < n; i++) {
        uint8_t a = 0;
        if (tok->types[i] == CS_TOKEN_CONTROL || tok->types[i] == CS_TOKEN_UNKNOWN)
            a |= CS__TOK_SPECIAL;
        if (tok->types[i] == CS_TOKEN_USER_DEFINED) a |= CS__TOK_ADDED;
        size_t len;
        const char *t = cs__tok_text(tok, i, &len);
        for (size_t k = 0; k < sizeof eog_texts / sizeof eog_texts[0]; k++)
            if (strlen(eog_texts[k]) == len && memcmp(t, eog_texts[k], len) == 0) a |= CS__TOK_EOG;
        tok->attrs[i] = a;
        if ((a & (CS__TOK_SPECIAL | CS__TOK_ADDED)) && len > 0) n_specials++;
    }
    if (spec->eos_id >= 0) tok->attrs[spec->eos_id] |= CS__TOK_EOG;
    for (int32_t k = 0; k < spec->n_eog_ids; k++) {
        int32_t id = spec->eog_ids[k];
        if (id < 0 || id >= n)
            return cs_fail(CS_EBADMSG, "tokenizer: end-of-generation id %d out of range", id);
        tok->attrs[id] |= CS__TOK_EOG;
    }

    tok->specials = malloc((size_t)(n_specials ? n_specials : 1) * sizeof *tok->specials);
    special_key *keys = malloc((size_t)(n_specials ? n_specials : 1) * sizeof *keys);
    if (!tok->specials || !keys) {
        free(keys);
        return cs_fail(CS_ENOMEM, "tokenizer: out of memory");
    }
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *t = cs__tok_text(tok, i, &len);
        if ((tok->attrs[i] & (CS__TOK_SPECIAL | CS__TOK_ADDED)) && len > 0)
            keys[k++] = (special_key){(uint8_t)t[0], len, i};
    }
    qsort(keys, (size_t)n_specials, sizeof *keys, cmp_special);
    for (k = 0; k < n_specials; k++)
        tok->specials[k] = keys[k].id;
    free(keys);
    tok->n_specials = n_specials;
    int32_t j = 0;
    for (int b = 0; b <= 256; b++) {
        while (j < n_specials && (uint8_t)tok->text[tok->text_off[tok->specials[j]]] < b)
            j++;
        tok->special_start[b] = j;
    }
    return 0;
}

int cs__tokenizer_create(const cs_vocab_spec *spec, cs_tokenizer **out) {
    *out = NULL;
    if (!spec || spec->n_vocab <= 0 || spec->n_vocab >= INT32_MAX - 1 || !spec->tokens)
        return cs_fail(CS_EBADMSG, "tokenizer: empty vocabulary");
    if (spec->n_merges < 0 || (spec->n_merges > 0 && !spec->merges))
        return cs_fail(CS_EBADMSG, "tokenizer: bad merge list");
    if (spec->n_eog_ids < 0 || (spec->n_eog_ids > 0 && !spec->eog_ids))
        return cs_fail(CS_EBADMSG, "tokenizer: bad end-of-generation list");
    if ((unsigned)spec->pretok > CS_PRETOK_QWEN2)
        return cs_fail(CS_EBADMSG, "tokenizer: bad pre-tokenizer %d", (int)spec->pretok);
    if ((unsigned)spec->model > CS_TOK_SPM)
        return cs_fail(CS_EBADMSG, "tokenizer: bad model %d", (int)spec->model);
    if (spec->model == CS_TOK_SPM && spec->n_merges)
        return cs_fail(CS_EBADMSG, "tokenizer: a SentencePiece vocabulary has no merge list");
    int rc;
    if ((rc = check_id(spec->bos_id, spec->n_vocab, "bos")) ||
        (rc = check_id(spec->eos_id, spec->n_vocab, "eos")) ||
        (rc = check_id(spec->unk_id, spec->n_vocab, "unk")) ||
        (rc = check_id(spec->pad_id, spec->n_vocab, "pad")))
        return rc;
    if (spec->add_bos && spec->bos_id < 0)
        return cs_fail(CS_EBADMSG, "tokenizer: add_bos is set but there is no bos token");

    size_t n = (size_t)spec->n_vocab;
    cs_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return cs_fail(CS_ENOMEM, "tokenizer: out of memory");
    tok->n_vocab = spec->n_vocab;
    tok->types = malloc(n);
    tok->attrs = malloc(n);
    tok->text_off = malloc((n + 1) * sizeof *tok->text_off);
    tok->bytes_off = malloc((n + 1) * sizeof *tok->bytes_off);
    if (!tok->types || !tok->attrs || !tok->text_off || !tok->bytes_off) {
        rc = cs_fail(CS_ENOMEM, "tokenizer: out of memory");
        goto fail;
    }
    tok->model = spec->model;
    tok->add_space_prefix = spec->model == CS_TOK_SPM && spec->add_space_prefix;
    if (spec->model == CS_TOK_SPM) {
        tok->scores = malloc(n * sizeof *tok->scores);
        if (!tok->scores) {
            rc = cs_fail(CS_ENOMEM, "tokenizer: out of memory");
            goto fail;
        }
        for (size_t i = 0; i < n; i++) {
            float s = spec->scores ? spec->scores[i] : 0.0f;
            if (s != s) {
                rc = cs_fail(CS_EBADMSG, "tokenizer: token %zu has a NaN score", i);
                goto fail;
            }
            tok->scores[i] = s;
        }
    }
    if ((rc = build_tokens(tok, spec))) goto fail;
    if ((rc = build_merges(tok, spec))) goto fail;
    if ((rc = build_attrs(tok, spec))) goto fail;
    if (spec->chat_template) {
        size_t l = strlen(spec->chat_template);
        tok->chat_template = malloc(l + 1);
        if (tok->chat_template) memcpy(tok->chat_template, spec->chat_template, l + 1);
        if (!tok->chat_template) {
            rc = cs_fail(CS_ENOMEM, "tokenizer: out of memory");
            goto fail;
        }
    }
    tok->pretok = spec->pretok;
    tok->ignore_merges = spec->pretok == CS_PRETOK_LLAMA3;
    tok->add_bos = spec->add_bos;
    tok->bos_id = spec->bos_id;
    tok->eos_id = spec->eos_id;
    tok->unk_id = spec->unk_id;
    tok->pad_id = spec->pad_id;
    *out = tok;
    return 0;
fail:
    cs_tokenizer_free(tok);
    return rc;
}

void cs__tokenizer_set_ignore_merges(cs_tokenizer *tok, bool on) {
    tok->ignore_merges = on;
}

void cs_tokenizer_free(cs_tokenizer *tok) {
    if (!tok) return;
    free(tok->scores);
    free(tok->chat_template);
    free(tok->specials);
    free(tok->merge_map);
    free(tok->text_map);
    free(tok->bytes);
    free(tok->text);
    free(tok->bytes_off);
    free(tok->text_off);
    free(tok->attrs);
    free(tok->types);
    free(tok);
}

/* ---- accessors -------------------------------------------------------- */

int32_t cs_tokenizer_n_vocab(const cs_tokenizer *tok) {
    return tok->n_vocab;
}

static void fp_i32(XXH3_state_t *st, int32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    XXH3_64bits_update(st, b, 4);
}

uint64_t cs_tokenizer_fingerprint(const cs_tokenizer *tok) {
    XXH3_state_t state, *st = &state;
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, "chunkserve tokenizer v1", 23);
    fp_i32(st, tok->n_vocab);
    if (tok->model == CS_TOK_SPM) { /* (a BPE vocabulary's fingerprint is as it always was) */
        fp_i32(st, 1000 + tok->add_space_prefix);
        XXH3_64bits_update(st, tok->scores, (size_t)tok->n_vocab * sizeof *tok->scores);
    }
    XXH3_64bits_update(st, tok->types, (size_t)tok->n_vocab);
    XXH3_64bits_update(st, tok->attrs, (size_t)tok->n_vocab);
    /* texts with their NULs: the boundaries count */
    XXH3_64bits_update(st, tok->text, tok->text_off[tok->n_vocab]);
    /* merges in rank order (the table's slot order depends on nothing else,
     * but rank order is what defines the tokenizer) */
    int32_t *by_rank = tok->n_merges ? malloc((size_t)tok->n_merges * 3 * sizeof *by_rank) : NULL;
    CS_ASSERT(!tok->n_merges || by_rank);
    for (int32_t i = 0; i < 3 * tok->n_merges; i++)
        by_rank[i] = -1;
    if (tok->merge_map)
        for (size_t i = 0; i <= tok->merge_map_mask; i++) {
            const struct cs__merge_slot *e = &tok->merge_map[i];
            if (e->key == UINT64_MAX || e->rank < 0 || e->rank >= tok->n_merges) continue;
            int32_t *d = by_rank + 3 * (size_t)e->rank;
            d[0] = (int32_t)(e->key >> 32), d[1] = (int32_t)(uint32_t)e->key, d[2] = e->result;
        }
    for (int32_t i = 0; i < 3 * tok->n_merges; i++)
        fp_i32(st, by_rank[i]);
    free(by_rank);
    fp_i32(st, tok->n_merges);
    for (int32_t i = 0; i < tok->n_specials; i++)
        fp_i32(st, tok->specials[i]);
    fp_i32(st, tok->n_specials);
    /* UNK only where it can come out: a byte with neither a token nor a
     * fallback. PAD never changes a token. (A GGUF file and its
     * tokenizer.json often disagree about both.) */
    bool unk_reachable = false;
    for (int b = 0; b < 256; b++) {
        fp_i32(st, tok->byte_fallback[b] >= 0);
        unk_reachable |= tok->byte_id[b] < 0 && tok->byte_fallback[b] < 0;
    }
    fp_i32(st, (int32_t)tok->pretok);
    fp_i32(st, tok->ignore_merges), fp_i32(st, tok->add_bos);
    fp_i32(st, tok->bos_id), fp_i32(st, tok->eos_id), fp_i32(st, unk_reachable ? tok->unk_id : -2);
    if (tok->chat_template)
        XXH3_64bits_update(st, tok->chat_template, strlen(tok->chat_template) + 1);
    return XXH3_64bits_digest(st);
}
int32_t cs_tokenizer_bos(const cs_tokenizer *tok) {
    return tok->bos_id;
}
int32_t cs_tokenizer_eos(const cs_tokenizer *tok) {
    return tok->eos_id;
}

bool cs_tokenizer_is_eog(const cs_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab && (tok->attrs[id] & CS__TOK_EOG);
}

bool cs_tokenizer_is_special(const cs_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab && (tok->attrs[id] & CS__TOK_SPECIAL);
}

int cs_tokenizer_token_bytes(const cs_tokenizer *tok, int32_t id, const char **bytes, size_t *len) {
    if (id < 0 || id >= tok->n_vocab)
        return cs_fail(CS_EINVAL, "tokenizer: token id %d out of range", id);
    *bytes = tok->bytes + tok->bytes_off[id];
    *len = tok->bytes_off[id + 1] - tok->bytes_off[id] - 1;
    return 0;
}

/* ---- encoding --------------------------------------------------------- */

typedef struct {
    int32_t *v;
    size_t n, cap;
} idvec;

static int idvec_push(idvec *a, int32_t id) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return cs_fail(CS_ENOMEM, "tokenizer: out of memory encoding");
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return 0;
}

/* One symbol per input byte at first; merged symbols absorb their right
 * neighbour, so a symbol's index is also its byte position. */
typedef struct {
    int32_t id; /* -1: byte without a token (cannot merge) */
    int32_t prev, next;
} bpe_sym;

typedef struct {
    int32_t rank, left, right, result;
    int32_t left_id, right_id; /* to detect stale entries */
} bpe_pair;

/* SentencePiece: a symbol is a run of the escaped text (one character at
 * first); a candidate merge is scored by the token it makes. */
typedef struct {
    int32_t start, len, prev, next;
} spm_sym;

typedef struct {
    float score;
    int32_t left, right, len; /* len: both symbols' length when queued (stale if changed) */
} spm_pair;

typedef struct {
    bpe_sym *syms;
    size_t syms_cap;
    bpe_pair *heap;
    size_t n_heap, heap_cap;
    uint8_t *word;
    size_t word_cap;
    cs__pieces pieces;
    spm_sym *ssyms;
    size_t ssyms_cap;
    spm_pair *sheap;
    size_t n_sheap, sheap_cap;
} bpe_scratch;

static int pair_less(const bpe_pair *a, const bpe_pair *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(bpe_scratch *sc, bpe_pair p) {
    size_t i = sc->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pair_less(&p, &sc->heap[parent])) break;
        sc->heap[i] = sc->heap[parent];
        i = parent;
    }
    sc->heap[i] = p;
}

static bpe_pair heap_pop(bpe_scratch *sc) {
    bpe_pair top = sc->heap[0];
    bpe_pair last = sc->heap[--sc->n_heap];
    size_t i = 0, n = sc->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_less(&sc->heap[c + 1], &sc->heap[c])) c++;
        if (!pair_less(&sc->heap[c], &last)) break;
        sc->heap[i] = sc->heap[c];
        i = c;
    }
    if (n) sc->heap[i] = last;
    return top;
}

static void try_pair(const cs_tokenizer *tok, bpe_scratch *sc, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    int32_t l = sc->syms[left].id, r = sc->syms[right].id;
    if (l < 0 || r < 0) return;
    const struct cs__merge_slot *m = merge_lookup(tok, l, r);
    if (!m) return;
    bpe_pair p = {m->rank, left, right, m->result, l, r};
    heap_push(sc, p);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return cs_fail(CS_ENOMEM, "tokenizer: out of memory encoding");
    *p = np;
    *cap = c;
    return 0;
}

static int emit_unknown_byte(const cs_tokenizer *tok, uint8_t b, idvec *out) {
    if (tok->byte_fallback[b] >= 0) return idvec_push(out, tok->byte_fallback[b]);
    if (tok->unk_id >= 0) return idvec_push(out, tok->unk_id);
    return 0; /* like HF BPE without unk_token: the byte is dropped */
}

/* BPE of one pre-token: repeatedly merge the adjacent pair with the lowest
 * rank (leftmost on ties), as HF tokenizers' Word::merge_all and llama.cpp
 * do; a heap of candidate pairs keeps this O(n log n). */
static int bpe_piece(const cs_tokenizer *tok, const uint8_t *p, size_t n, bpe_scratch *sc,
                     idvec *out) {
    int rc;
    if (n == 0) return 0;
    if (n == 1)
        return tok->byte_id[p[0]] >= 0 ? idvec_push(out, tok->byte_id[p[0]])
                                       : emit_unknown_byte(tok, p[0], out);
    if (n > INT32_MAX / 2) return cs_fail(CS_EINVAL, "tokenizer: pre-token too long");
    if (tok->ignore_merges) {
        if ((rc = grow((void **)&sc->word, &sc->word_cap, n * 2, 1))) return rc;
        size_t w = 0;
        for (size_t i = 0; i < n; i++)
            w += (size_t)cs__utf8_encode(cs__byte_to_unicode(p[i]), sc->word + w);
        int32_t id = text_lookup(tok, sc->word, w);
        if (id >= 0) return idvec_push(out, id);
    }
    if ((rc = grow((void **)&sc->syms, &sc->syms_cap, n, sizeof *sc->syms))) return rc;
    /* Each merge adds at most two pairs on top of the n - 1 initial ones. */
    if ((rc = grow((void **)&sc->heap, &sc->heap_cap, 3 * n, sizeof *sc->heap))) return rc;
    for (size_t i = 0; i < n; i++) {
        sc->syms[i].id = tok->byte_id[p[i]];
        sc->syms[i].prev = (int32_t)i - 1;
        sc->syms[i].next = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    sc->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        try_pair(tok, sc, (int32_t)i, (int32_t)i + 1);
    while (sc->n_heap) {
        bpe_pair top = heap_pop(sc);
        bpe_sym *l = &sc->syms[top.left], *r = &sc->syms[top.right];
        if (l->id != top.left_id || l->next != top.right || r->id != top.right_id) continue;
        l->id = top.result;
        l->next = r->next;
        if (r->next >= 0) sc->syms[r->next].prev = top.left;
        r->id = -2;
        try_pair(tok, sc, l->prev, top.left);
        try_pair(tok, sc, top.left, l->next);
    }
    for (int32_t i = 0; i >= 0; i = sc->syms[i].next) {
        rc = sc->syms[i].id >= 0 ? idvec_push(out, sc->syms[i].id)
                                 : emit_unknown_byte(tok, p[i], out);
        if (rc) return rc;
    }
    return 0;
}

/* SentencePiece's order (llama.cpp's llm_tokenizer_spm): the highest score
 * first, the leftmost of equal scores. */
static int spm_before(const spm_pair *a, const spm_pair *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void spm_push(bpe_scratch *sc, spm_pair p) {
    size_t i = sc->n_sheap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!spm_before(&p, &sc->sheap[parent])) break;
        sc->sheap[i] = sc->sheap[parent];
        i = parent;
    }
    sc->sheap[i] = p;
}

static spm_pair spm_pop(bpe_scratch *sc) {
    spm_pair top = sc->sheap[0], last = sc->sheap[--sc->n_sheap];
    size_t i = 0, n = sc->n_sheap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && spm_before(&sc->sheap[c + 1], &sc->sheap[c])) c++;
        if (!spm_before(&sc->sheap[c], &last)) break;
        sc->sheap[i] = sc->sheap[c];
        i = c;
    }
    if (n) sc->sheap[i] = last;
    return top;
}

/* Queues the merge of symbols left and right when their text is a token
 * (any token, as llama.cpp: its score decides). */
static void spm_try(const cs_tokenizer *tok, bpe_scratch *sc, const uint8_t *text, int32_t left,
                    int32_t right) {
    if (left < 0 || right < 0) return;
    const spm_sym *l = &sc->ssyms[left], *r = &sc->ssyms[right];
    int32_t id = text_lookup(tok, text + l->start, (size_t)(l->len + r->len));
    if (id < 0) return;
    spm_push(sc, (spm_pair){tok->scores[id], left, right, l->len + r->len});
}

/* One SentencePiece fragment (spaces already U+2581): merge the adjacent
 * pair whose concatenation is the best-scored token until none is; a
 * symbol left that is no token goes out as its bytes' <0xNN> tokens. */
static int spm_fragment(const cs_tokenizer *tok, const uint8_t *p, size_t n, bpe_scratch *sc,
                        idvec *out) {
    int rc;
    if (n == 0) return 0;
    if (n > INT32_MAX / 4) return cs_fail(CS_EINVAL, "tokenizer: text too long");
    if ((rc = grow((void **)&sc->ssyms, &sc->ssyms_cap, n, sizeof *sc->ssyms))) return rc;
    if ((rc = grow((void **)&sc->sheap, &sc->sheap_cap, 3 * n, sizeof *sc->sheap))) return rc;
    int32_t ns = 0;
    for (size_t i = 0; i < n;) {
        uint8_t b = p[i];
        size_t cl = b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; /* a character */
        if (cl > n - i) cl = n - i; /* (valid UTF-8 here; defensive) */
        sc->ssyms[ns] = (spm_sym){(int32_t)i, (int32_t)cl, ns - 1, -1};
        if (ns > 0) sc->ssyms[ns - 1].next = ns;
        ns++;
        i += cl;
    }
    sc->n_sheap = 0;
    for (int32_t i = 1; i < ns; i++)
        spm_try(tok, sc, p, i - 1, i);
    while (sc->n_sheap) {
        spm_pair top = spm_pop(sc);
        spm_sym *l = &sc->ssyms[top.left], *r = &sc->ssyms[top.right];
        if (l->len == 0 || r->len == 0 || l->len + r->len != top.len || l->next != top.right)
            continue; /* stale: one side changed since it was queued */
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) sc->ssyms[r->next].prev = top.left;
        spm_try(tok, sc, p, l->prev, top.left);
        spm_try(tok, sc, p, top.left, l->next);
    }
    for (int32_t i = 0; i >= 0; i = sc->ssyms[i].next) {
        const spm_sym *s = &sc->ssyms[i];
        int32_t id = text_lookup(tok, p + s->start, (size_t)s->len);
        if (id >= 0) {
            rc = idvec_push(out, id);
        } else {
            rc = 0;
            for (int32_t k = 0; k < s->len && !rc; k++)
                rc = emit_unknown_byte(tok, p[s->start + k], out);
        }
        if (rc) return rc;
    }
    return 0;
}

/* A SentencePiece segment: a space first when add_space_prefix and the
 * segment opens the text or follows a special token (llama.cpp's rule), every
 * space as U+2581. */
static int spm_segment(const cs_tokenizer *tok, const char *text, size_t len, bool after_special,
                       bpe_scratch *sc, idvec *out) {
    bool prefix = tok->add_space_prefix && after_special;
    size_t spaces = prefix;
    for (size_t i = 0; i < len; i++)
        spaces += text[i] == ' ';
    size_t n = len + 2 * spaces; /* each space becomes three bytes */
    int rc = grow((void **)&sc->word, &sc->word_cap, n ? n : 1, 1);
    if (rc) return rc;
    size_t o = 0;
    if (prefix) memcpy(sc->word, SPM_SPACE, 3), o = 3;
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ')
            memcpy(sc->word + o, SPM_SPACE, 3), o += 3;
        else
            sc->word[o++] = (uint8_t)text[i];
    }
    return spm_fragment(tok, sc->word, o, sc, out);
}

static int encode_segment(const cs_tokenizer *tok, const char *text, size_t len, bpe_scratch *sc,
                          idvec *out) {
    if (len == 0) return 0;
    int rc = cs__pretok_split(tok->pretok, text, len, &sc->pieces);
    if (rc) return rc;
    size_t start = 0;
    for (size_t i = 0; i < sc->pieces.n; i++) {
        size_t end = sc->pieces.ends[i];
        if ((rc = bpe_piece(tok, (const uint8_t *)text + start, end - start, sc, out))) return rc;
        start = end;
    }
    return 0;
}

/* Longest special/added token starting at s, or -1. CONTROL and UNKNOWN
 * tokens only with parse_special; USER_DEFINED (HF added, non-special) ones
 * always, as HF tokenizers and llama.cpp do. */
static int32_t match_special(const cs_tokenizer *tok, const uint8_t *s, size_t n,
                             bool parse_special, size_t *mlen) {
    for (int32_t k = tok->special_start[s[0]]; k < tok->special_start[s[0] + 1]; k++) {
        int32_t id = tok->specials[k];
        if (!parse_special && !(tok->attrs[id] & CS__TOK_ADDED)) continue;
        size_t len;
        const char *t = cs__tok_text(tok, id, &len);
        if (len <= n && memcmp(t, s, len) == 0) {
            *mlen = len;
            return id;
        }
    }
    return -1;
}

int cs_tokenizer_encode(const cs_tokenizer *tok, const char *text, size_t len, bool parse_special,
                        bool add_bos, int32_t **ids, size_t *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    if (!text && len) return cs_fail(CS_EINVAL, "tokenizer: NULL text");
    if (!cs__utf8_valid((const uint8_t *)text, len))
        return cs_fail(CS_EINVAL, "tokenizer: input is not valid UTF-8");
    idvec out = {0};
    bpe_scratch sc = {0};
    int rc = 0;
    /* the model's BOS, unless the text brings its own (a chat template that
     * renders bos_token: Gemma, Llama 3): never two */
    if (add_bos && tok->add_bos && tok->bos_id >= 0) {
        size_t bl;
        const char *bt = cs__tok_text(tok, tok->bos_id, &bl);
        bool has = parse_special && bl && len >= bl && !memcmp(text, bt, bl);
        if (!has && (rc = idvec_push(&out, tok->bos_id))) goto done;
    }
    const uint8_t *s = (const uint8_t *)text;
    size_t seg = 0, i = 0;
    bool after_special = true; /* the text's start counts as one (SentencePiece's prefix) */
    while (i <= len) {
        size_t mlen = 0;
        int32_t id = i < len && tok->special_start[s[i]] < tok->special_start[s[i] + 1]
                         ? match_special(tok, s + i, len - i, parse_special, &mlen)
                         : -1;
        if (id < 0 && i < len) {
            i++;
            continue;
        }
        if (i > seg) { /* the text before the special token (or the end) */
            rc = tok->model == CS_TOK_SPM
                     ? spm_segment(tok, text + seg, i - seg, after_special, &sc, &out)
                     : encode_segment(tok, text + seg, i - seg, &sc, &out);
            if (rc) goto done;
            after_special = false;
        }
        if (id < 0) break; /* the end */
        if ((rc = idvec_push(&out, id))) goto done;
        after_special = true;
        i += mlen;
        seg = i;
    }
    if (!out.v && (rc = grow((void **)&out.v, &out.cap, 1, sizeof *out.v))) goto done;
    *ids = out.v;
    *n_ids = out.n;
    out.v = NULL;
done:
    free(out.v);
    free(sc.syms);
    free(sc.heap);
    free(sc.word);
    free(sc.pieces.ends);
    free(sc.ssyms);
    free(sc.sheap);
    return rc;
}

/* ---- decoding --------------------------------------------------------- */

/* Copies s[0..n) to out replacing each ill-formed maximal subpart by U+FFFD
 * (what Python's errors="replace" and Rust's from_utf8_lossy do). With
 * hold_partial, a valid but incomplete sequence at the end is not consumed:
 * *used tells how far it got. out == NULL only counts. Returns the output
 * length. */
static size_t utf8_sanitize(const uint8_t *s, size_t n, uint8_t *out, bool hold_partial,
                            size_t *used) {
    size_t i = 0, o = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            if (out) out[o] = s[i];
            o++;
            i++;
            continue;
        }
        uint32_t cp;
        int k = cs__utf8_decode(s + i, n - i, &cp);
        if (k > 0) {
            if (out) memcpy(out + o, s + i, (size_t)k);
            o += (size_t)k;
            i += (size_t)k;
            continue;
        }
        if (k == 0 && hold_partial) break;
        if (out) memcpy(out + o, "\xEF\xBF\xBD", 3);
        o += 3;
        i += k == 0 ? n - i : (size_t)-k;
    }
    if (used) *used = i;
    return o;
}

int cs_tokenizer_decode(const cs_tokenizer *tok, const int32_t *ids, size_t n_ids,
                        bool skip_special, char **text, size_t *len) {
    *text = NULL;
    if (len) *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->n_vocab)
            return cs_fail(CS_EINVAL, "tokenizer: token id %d out of range (n_vocab %d)", id,
                           tok->n_vocab);
        if (skip_special && (tok->attrs[id] & CS__TOK_SPECIAL)) continue;
        total += tok->bytes_off[id + 1] - tok->bytes_off[id] - 1;
    }
    uint8_t *raw = malloc(total + 1);
    if (!raw) return cs_fail(CS_ENOMEM, "tokenizer: out of memory decoding");
    size_t o = 0;
    for (size_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (skip_special && (tok->attrs[id] & CS__TOK_SPECIAL)) continue;
        size_t l = tok->bytes_off[id + 1] - tok->bytes_off[id] - 1;
        memcpy(raw + o, tok->bytes + tok->bytes_off[id], l);
        o += l;
    }
    if (cs__utf8_valid(raw, total)) {
        raw[total] = 0;
        *text = (char *)raw;
        if (len) *len = total;
        return 0;
    }
    size_t need = utf8_sanitize(raw, total, NULL, false, NULL);
    uint8_t *clean = malloc(need + 1);
    if (!clean) {
        free(raw);
        return cs_fail(CS_ENOMEM, "tokenizer: out of memory decoding");
    }
    utf8_sanitize(raw, total, clean, false, NULL);
    clean[need] = 0;
    free(raw);
    *text = (char *)clean;
    if (len) *len = need;
    return 0;
}

/* ---- streaming detokenizer -------------------------------------------- */

void cs_detok_init(cs_detok *d, const cs_tokenizer *tok, bool skip_special) {
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->skip_special = skip_special;
}

int cs_detok_push(cs_detok *d, int32_t id, char *out, size_t out_cap, size_t *out_len) {
    *out_len = 0;
    const cs_tokenizer *tok = d->tok;
    if (id < 0 || id >= tok->n_vocab)
        return cs_fail(CS_EINVAL, "tokenizer: token id %d out of range (n_vocab %d)", id,
                       tok->n_vocab);
    const uint8_t *b = (const uint8_t *)tok->bytes + tok->bytes_off[id];
    size_t nb = tok->bytes_off[id + 1] - tok->bytes_off[id] - 1;
    if (d->skip_special && (tok->attrs[id] & CS__TOK_SPECIAL)) nb = 0;

    /* Work on pending + token bytes in one buffer; tokens are short, so the
     * stack buffer almost always suffices. */
    uint8_t stackbuf[256];
    size_t n = (size_t)d->n_pending + nb;
    uint8_t *buf = n <= sizeof stackbuf ? stackbuf : malloc(n);
    if (!buf) return cs_fail(CS_ENOMEM, "tokenizer: out of memory detokenizing");
    memcpy(buf, d->pending, (size_t)d->n_pending);
    if (nb) memcpy(buf + d->n_pending, b, nb);
    size_t used;
    size_t need = utf8_sanitize(buf, n, NULL, true, &used);
    int rc = 0;
    if (need > out_cap) {
        rc = cs_fail(CS_ERANGE, "tokenizer: detok buffer of %zu bytes too small (need %zu)",
                     out_cap, need);
    } else {
        utf8_sanitize(buf, n, (uint8_t *)out, true, NULL);
        /* What is held back is a proper prefix of one character: < 4 bytes. */
        CS_ASSERT(n - used < sizeof d->pending);
        memcpy(d->pending, buf + used, n - used);
        d->n_pending = (int)(n - used);
        *out_len = need;
    }
    if (buf != stackbuf) free(buf);
    return rc;
}

int cs_detok_flush(cs_detok *d, char *out, size_t out_cap, size_t *out_len) {
    *out_len = 0;
    if (d->n_pending == 0) return 0;
    if (out_cap < 3)
        return cs_fail(CS_ERANGE, "tokenizer: detok buffer of %zu bytes too small", out_cap);
    memcpy(out, "\xEF\xBF\xBD", 3);
    *out_len = 3;
    d->n_pending = 0;
    return 0;
}
