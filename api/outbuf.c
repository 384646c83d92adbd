/* outbuf.c: a stream's pending output (see outbuf.h). */
#include "outbuf.h"

#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "wire.h"

void cs_outbuf_append(cs_outbuf *b, const cs_event *ev) {
    if (ev->n_prompt_lp > 0) {
        size_t bytes = (size_t)ev->n_prompt_lp * sizeof *b->plp;
        free(b->plp);
        b->n_plp = 0;
        if ((b->plp = malloc(bytes))) {
            memcpy(b->plp, ev->prompt_lp, bytes);
            b->n_plp = ev->n_prompt_lp;
        } else {
            b->oom = true;
        }
    }
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
    free(b->plp);
    memset(b, 0, sizeof *b);
}

bool cs_outbuf_empty(const cs_outbuf *b) {
    return b->n == 0 && !b->text && !b->n_plp;
}

int cs_prompt_logprobs_msgs(const cs_prompt_logprob *p, int32_t n,
                            Chunkserve__V1__PromptLogprob ***msgs, void **scratch) {
    *msgs = NULL;
    *scratch = NULL;
    if (n <= 0) return 0;
    size_t n_alt = 0;
    for (int32_t i = 0; i < n; i++)
        n_alt += (size_t)p[i].lp.n_top;
    /* one block: the entries, their pointers, the alternatives, theirs */
    size_t bytes = (size_t)n * (sizeof(Chunkserve__V1__PromptLogprob) + sizeof(void *)) +
                   n_alt * (sizeof(Chunkserve__V1__TokenLogprob) + sizeof(void *));
    char *blk = malloc(bytes ? bytes : 1);
    if (!blk) return CS_ENOMEM;
    Chunkserve__V1__PromptLogprob *e = (Chunkserve__V1__PromptLogprob *)blk;
    Chunkserve__V1__PromptLogprob **ep = (Chunkserve__V1__PromptLogprob **)(e + n);
    Chunkserve__V1__TokenLogprob *a = (Chunkserve__V1__TokenLogprob *)(ep + n);
    Chunkserve__V1__TokenLogprob **ap = (Chunkserve__V1__TokenLogprob **)(a + n_alt);
    size_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        e[i] = (Chunkserve__V1__PromptLogprob)CHUNKSERVE__V1__PROMPT_LOGPROB__INIT;
        e[i].token_id = p[i].token;
        e[i].logprob = p[i].lp.logprob;
        e[i].rank = p[i].rank;
        e[i].n_top_logprobs = (size_t)p[i].lp.n_top;
        e[i].top_logprobs = p[i].lp.n_top ? &ap[k] : NULL;
        for (int32_t j = 0; j < p[i].lp.n_top; j++, k++) {
            a[k] = (Chunkserve__V1__TokenLogprob)CHUNKSERVE__V1__TOKEN_LOGPROB__INIT;
            a[k].token_id = p[i].lp.top_ids[j];
            a[k].logprob = p[i].lp.top_logprobs[j];
            ap[k] = &a[k];
        }
        ep[i] = &e[i];
    }
    *msgs = ep;
    *scratch = blk;
    return 0;
}

/* What a response borrows besides b: its logprobs and prompt logprobs. */
typedef struct {
    void *lp, *plp;
    Chunkserve__V1__Usage usage;
} response_scratch;

int cs_outbuf_response(const cs_outbuf *b, bool logprobs, const cs_outbuf_end *end,
                       Chunkserve__V1__GenerateResponse *r, void **scratch) {
    *r = (Chunkserve__V1__GenerateResponse)CHUNKSERVE__V1__GENERATE_RESPONSE__INIT;
    response_scratch *sc = calloc(1, sizeof *sc);
    *scratch = sc;
    if (!sc) return CS_ENOMEM;
    if (end) {
        r->finish_reason = cs_wire_finish_reason(end->finish);
        sc->usage = (Chunkserve__V1__Usage)CHUNKSERVE__V1__USAGE__INIT;
        sc->usage.prompt_tokens = end->n_prompt;
        sc->usage.completion_tokens = end->n_completion;
        sc->usage.cached_prompt_tokens = end->n_cached;
        sc->usage.predicted_ttft_seconds = end->predicted_ttft;
        r->usage = &sc->usage;
    }
    if (cs_prompt_logprobs_msgs(b->plp, b->n_plp, &r->prompt_logprobs, &sc->plp)) goto oom;
    r->n_prompt_logprobs = (size_t)b->n_plp;
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
    if (!lp) goto oom;
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
    sc->lp = lp;
    return 0;
oom: /* nothing borrowed stays behind */
    cs_outbuf_response_free(sc);
    *scratch = NULL;
    return CS_ENOMEM;
}

void cs_outbuf_response_free(void *scratch) {
    response_scratch *sc = scratch;
    if (sc) free(sc->lp), free(sc->plp);
    free(sc);
}
