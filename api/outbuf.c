/* outbuf.c: a stream's pending output (see outbuf.h). */
#include "outbuf.h"

#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"

void cs_outbuf_append(cs_outbuf *b, const cs_event *ev) {
    if (ev->finish == CS_FINISH_STOP) {
        if (ev->stop_string && !(b->stop_string = strdup(ev->stop_string))) b->oom = true;
        b->has_stop_token = ev->stop_token >= 0;
        b->stop_token = ev->stop_token;
    }
    if (ev->token >= 0) {
        if (b->n == b->cap) {
            size_t nc = b->cap ? 2 * b->cap : 16;
            int32_t *t = realloc(b->toks, nc * sizeof *t);
            if (t) b->toks = t;
            cs_logprobs *l = realloc(b->lps, nc * sizeof *l);
            if (l) b->lps = l;
            if (t && l) b->cap = nc;
        }
        if (b->n < b->cap) {
            b->toks[b->n] = ev->token;
            b->lps[b->n++] = ev->lp;
        } else {
            b->oom = true;
        }
    }
    size_t tl = ev->text ? strlen(ev->text) : 0;
    if (!tl) return;
    if (b->text_len + tl + 1 > b->text_cap) {
        size_t nc = (b->text_len + tl + 1) * 2;
        char *t = realloc(b->text, nc);
        if (t) b->text = t, b->text_cap = nc;
    }
    if (b->text_len + tl + 1 <= b->text_cap) {
        memcpy(b->text + b->text_len, ev->text, tl + 1);
        b->text_len += tl;
    } else {
        b->oom = true;
    }
}

void cs_outbuf_take(cs_outbuf *b, cs_outbuf *out) {
    *out = *b;
    memset(b, 0, sizeof *b);
}

void cs_outbuf_free(cs_outbuf *b) {
    free(b->toks);
    free(b->lps);
    free(b->text);
    free(b->stop_string);
    memset(b, 0, sizeof *b);
}

bool cs_outbuf_empty(const cs_outbuf *b) {
    return b->n == 0 && !b->text;
}

int cs_outbuf_response(const cs_outbuf *b, bool logprobs, Chunkserve__V1__GenerateResponse *r,
                       void **scratch) {
    *r = (Chunkserve__V1__GenerateResponse)CHUNKSERVE__V1__GENERATE_RESPONSE__INIT;
    *scratch = NULL;
    r->n_token_ids = b->n;
    r->token_ids = b->toks;
    r->text = b->text ? b->text : "";
    if (b->stop_string) {
        r->stop_reason_case = CHUNKSERVE__V1__GENERATE_RESPONSE__STOP_REASON_STOP_STRING;
        r->stop_string = b->stop_string;
    } else if (b->has_stop_token) {
        r->stop_reason_case = CHUNKSERVE__V1__GENERATE_RESPONSE__STOP_REASON_STOP_TOKEN_ID;
        r->stop_token_id = b->stop_token;
    }
    if (!logprobs || !b->n) return 0;
    /* one block: the messages (each token's, then the alternatives'), then
     * the pointers to them */
    size_t n_msg = b->n;
    for (size_t i = 0; i < b->n; i++)
        n_msg += (size_t)b->lps[i].n_top;
    Chunkserve__V1__TokenLogprob *lp = malloc(n_msg * (sizeof *lp + sizeof(void *)));
    if (!lp) return CS_ENOMEM;
    Chunkserve__V1__TokenLogprob **lpp = (Chunkserve__V1__TokenLogprob **)(lp + n_msg);
    size_t k = b->n; /* the next alternative's slot */
    for (size_t i = 0; i < b->n; i++) {
        const cs_logprobs *e = &b->lps[i];
        lp[i] = (Chunkserve__V1__TokenLogprob)CHUNKSERVE__V1__TOKEN_LOGPROB__INIT;
        lp[i].token_id = b->toks[i];
        lp[i].logprob = e->logprob;
        lp[i].n_top_logprobs = (size_t)e->n_top;
        lp[i].top_logprobs = e->n_top ? &lpp[k] : NULL;
        for (int32_t j = 0; j < e->n_top; j++, k++) {
            lp[k] = (Chunkserve__V1__TokenLogprob)CHUNKSERVE__V1__TOKEN_LOGPROB__INIT;
            lp[k].token_id = e->top_ids[j];
            lp[k].logprob = e->top_logprobs[j];
            lpp[k] = &lp[k];
        }
        lpp[i] = &lp[i];
    }
    r->n_logprobs = b->n;
    r->logprobs = lpp;
    *scratch = lp;
    return 0;
}

void cs_outbuf_response_free(void *scratch) {
    free(scratch);
}
