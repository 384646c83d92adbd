/* stop.c: finish conditions and held-back text. The decoded text is kept in a
 * buffer: bytes before `emitted` were shown; the rest is shown only once no
 * stop string can start in it (the longest stop string minus one byte can
 * hide a partial match at the end). */
#include "chunkserve/stop.h"

#include <stdlib.h>
#include <string.h>

#include "unicode.h"
#include "util.h"

#define MAX_STOPS 64
#define MAX_STOP_LEN 256

struct cs_stop {
    const cs_tokenizer *tok;
    cs_detok detok;
    char **stop;
    size_t *stop_len;
    size_t n_stop, max_stop_len;
    int32_t *stop_ids;
    size_t n_stop_ids;
    int32_t max_tokens, min_tokens, n_tokens;
    bool ignore_eos;
    int32_t matched_stop, matched_token; /* what ended it: cs_stop_matched_*; -1 none */
    char *buf;                           /* text decoded and not yet emitted */
    size_t len, cap;
};

const char *cs_finish_name(enum cs_finish f) {
    static const char *const names[] = {"none", "stop", "length", "cancelled", "error"};
    return (unsigned)f < sizeof names / sizeof names[0] ? names[f] : "unknown";
}

int cs_stop_init(const cs_tokenizer *tok, const cs_stop_params *p, cs_stop **out) {
    *out = NULL;
    if (p->max_tokens < 1)
        return cs_fail(CS_EINVAL, "max_tokens %d must be at least 1", p->max_tokens);
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return cs_fail(CS_EINVAL, "min_tokens %d must be in [0, max_tokens %d]", p->min_tokens,
                       p->max_tokens);
    if (p->n_stop > MAX_STOPS || p->n_stop_ids > MAX_STOPS)
        return cs_fail(CS_EINVAL, "at most %d stop strings and %d stop token ids", MAX_STOPS,
                       MAX_STOPS);
    for (size_t i = 0; i < p->n_stop; i++) {
        size_t n = p->stop[i] ? strlen(p->stop[i]) : 0;
        if (n == 0 || n > MAX_STOP_LEN)
            return cs_fail(CS_EINVAL, "stop string %zu must be 1..%d bytes", i, MAX_STOP_LEN);
        if (!cs__utf8_valid((const uint8_t *)p->stop[i], n))
            return cs_fail(CS_EINVAL, "stop string %zu is not valid UTF-8", i);
    }
    for (size_t i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= cs_tokenizer_n_vocab(tok))
            return cs_fail(CS_EINVAL, "stop token id %d is outside the vocabulary", p->stop_ids[i]);
    cs_stop *s = calloc(1, sizeof *s);
    if (!s) return cs_fail(CS_ENOMEM, "out of memory");
    s->tok = tok;
    s->matched_stop = s->matched_token = -1;
    s->max_tokens = p->max_tokens;
    s->ignore_eos = p->ignore_eos;
    s->min_tokens = p->min_tokens;
    cs_detok_init(&s->detok, tok, p->skip_special);
    s->stop = calloc(p->n_stop + 1, sizeof *s->stop);
    s->stop_len = calloc(p->n_stop + 1, sizeof *s->stop_len);
    s->stop_ids = malloc((p->n_stop_ids + 1) * sizeof *s->stop_ids);
    bool ok = s->stop && s->stop_len && s->stop_ids;
    for (size_t i = 0; ok && i < p->n_stop; i++) {
        ok = (s->stop[i] = strdup(p->stop[i])) != NULL;
        s->stop_len[i] = ok ? strlen(s->stop[i]) : 0;
        if (s->stop_len[i] > s->max_stop_len) s->max_stop_len = s->stop_len[i];
        s->n_stop = i + 1;
    }
    if (!ok) {
        cs_stop_free(s);
        return cs_fail(CS_ENOMEM, "out of memory");
    }
    if (p->n_stop_ids) memcpy(s->stop_ids, p->stop_ids, p->n_stop_ids * sizeof *s->stop_ids);
    s->n_stop_ids = p->n_stop_ids;
    *out = s;
    return 0;
}

void cs_stop_free(cs_stop *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n_stop; i++)
        free(s->stop[i]);
    free(s->stop);
    free(s->stop_len);
    free(s->stop_ids);
    free(s->buf);
    free(s);
}

const char *cs_stop_matched_string(const cs_stop *s) {
    return s->matched_stop >= 0 ? s->stop[s->matched_stop] : NULL;
}

int32_t cs_stop_matched_token(const cs_stop *s) {
    return s->matched_token;
}

int32_t cs_stop_n_tokens(const cs_stop *s) {
    return s->n_tokens;
}

static int append(cs_stop *s, const char *p, size_t n) {
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 64;
        while (cap < s->len + n + 1)
            cap *= 2;
        char *nb = realloc(s->buf, cap);
        if (!nb) return cs_fail(CS_ENOMEM, "out of memory");
        s->buf = nb;
        s->cap = cap;
    }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
    s->buf[s->len] = 0;
    return 0;
}

/* Moves the first n bytes of buf into a new string *text. */
static int take(cs_stop *s, size_t n, char **text) {
    char *t = malloc(n + 1);
    if (!t) return cs_fail(CS_ENOMEM, "out of memory");
    if (n) memcpy(t, s->buf, n); /* buf is NULL until text arrives (a first token that stops) */
    t[n] = 0;
    if (s->len > n) memmove(s->buf, s->buf + n, s->len - n);
    s->len -= n;
    if (s->buf) s->buf[s->len] = 0;
    *text = t;
    return 0;
}

int cs_stop_push(cs_stop *s, int32_t id, char **text, enum cs_finish *finish) {
    *text = NULL;
    *finish = CS_FINISH_NONE;
    if (id < 0 || id >= cs_tokenizer_n_vocab(s->tok))
        return cs_fail(CS_EINVAL, "token id %d is outside the vocabulary", id);
    s->n_tokens++;
    const bool eog = !s->ignore_eos && cs_tokenizer_is_eog(s->tok, id);
    bool stop_token = eog;
    for (size_t i = 0; i < s->n_stop_ids; i++)
        stop_token |= s->stop_ids[i] == id;
    /* min_tokens: the sampler masks stop tokens up to here; one forced in (a
     * resumed token, a prefill side without the mask) is text like any other */
    if (s->n_tokens <= s->min_tokens) stop_token = false;
    size_t n_stop = s->n_tokens < s->min_tokens ? 0 : s->n_stop;
    int r;
    if (stop_token) { /* the stop token's own text is not shown */
        *finish = CS_FINISH_STOP;
        s->matched_token = eog ? -1 : id; /* vLLM: end-of-generation reports none */
    } else {
        char piece[512];
        size_t n = 0;
        const char *bytes;
        size_t blen;
        cs_tokenizer_token_bytes(s->tok, id, &bytes, &blen);
        char *big = blen * 3 + 16 > sizeof piece ? malloc(blen * 3 + 16) : NULL;
        char *dst = big ? big : piece;
        size_t cap = big ? blen * 3 + 16 : sizeof piece;
        r = cs_detok_push(&s->detok, id, dst, cap, &n);
        if (!r) r = append(s, dst, n);
        free(big);
        if (r) return r;
        /* the earliest stop string occurrence ends the text there */
        size_t cut = s->len + 1;
        for (size_t i = 0; i < n_stop; i++) {
            const char *hit = strstr(s->buf ? s->buf : "", s->stop[i]);
            if (hit && (size_t)(hit - s->buf) < cut)
                cut = (size_t)(hit - s->buf), s->matched_stop = (int32_t)i;
        }
        if (cut <= s->len) {
            s->len = cut;
            *finish = CS_FINISH_STOP;
            return take(s, cut, text);
        }
        if (s->n_tokens >= s->max_tokens) *finish = CS_FINISH_LENGTH;
    }
    if (*finish != CS_FINISH_NONE) { /* flush held text and any incomplete character */
        char tail[16];
        size_t n = 0;
        if (*finish == CS_FINISH_LENGTH &&
            (r = cs_detok_flush(&s->detok, tail, sizeof tail, &n)) == 0 && n)
            if ((r = append(s, tail, n))) return r;
        return take(s, s->len, text);
    }
    /* hold back a suffix that could be the start of a stop string */
    size_t hold = 0;
    for (size_t i = 0; i < s->n_stop; i++) {
        size_t m = s->stop_len[i] - 1 < s->len ? s->stop_len[i] - 1 : s->len;
        for (; m > hold; m--)
            if (!memcmp(s->buf + s->len - m, s->stop[i], m)) {
                hold = m;
                break;
            }
    }
    /* never split a UTF-8 character when emitting */
    size_t emit = s->len - hold;
    while (emit > 0 && emit < s->len && ((unsigned char)s->buf[emit] & 0xc0) == 0x80)
        emit--;
    return take(s, emit, text);
}
