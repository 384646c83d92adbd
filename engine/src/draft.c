/* draft.c: a draft model's proposals (draft.h). */
#include "draft.h"

#include <stdlib.h>
#include <string.h>

#include "chunkserve/sampler.h"
#include "chunkserve/sched.h"
#include "util.h"

struct cs__drafter {
    cs_engine *e;
    cs_kv_cache *kv;
    int32_t n_vocab; /* ids a proposal may take: the vocabulary both models share */
    int32_t n_rows;  /* the draft's logits row length */
    int32_t ctx_len; /* the draft's context */
    cs_span *spans;
    int32_t *slot;  /* per span: its job */
    int32_t *first; /* per job: the tokens of its first span (0: none) */
    float *logits;
    int32_t cap;
    double pass_s, token_s; /* moving averages (0: not measured) */
};

/* The first id whose bytes differ between a and b, -1 when none (and the
 * counts are equal). */
static int32_t vocab_differs(const cs_tokenizer *a, const cs_tokenizer *b) {
    int32_t na = cs_tokenizer_n_vocab(a), nb = cs_tokenizer_n_vocab(b);
    int32_t n = na < nb ? na : nb;
    for (int32_t i = 0; i < n; i++) {
        const char *ba, *bb;
        size_t la, lb;
        if (cs_tokenizer_token_bytes(a, i, &ba, &la) || cs_tokenizer_token_bytes(b, i, &bb, &lb) ||
            la != lb || memcmp(ba, bb, la) != 0 ||
            cs_tokenizer_is_special(a, i) != cs_tokenizer_is_special(b, i))
            return i;
    }
    return na == nb ? -1 : n;
}

int cs__drafter_init(cs_engine *draft, const cs_model *target, cs__drafter **out) {
    *out = NULL;
    const cs_model *dm = cs_engine_model(draft);
    const cs_model_config *dc = cs_model_get_config(dm), *tc = cs_model_get_config(target);
    const cs_tokenizer *dt = cs_model_tokenizer(dm), *tt = cs_model_tokenizer(target);
    int32_t bad = vocab_differs(dt, tt);
    if (bad >= 0)
        return cs_fail(CS_EINVAL,
                       "speculation: the draft model '%s' (%s, a vocabulary of %d tokens) and "
                       "the target '%s' (%s, %d tokens) do not share a vocabulary: token %d "
                       "differs; a draft model must have the target's",
                       dc->name, dc->arch, cs_tokenizer_n_vocab(dt), tc->name, tc->arch,
                       cs_tokenizer_n_vocab(tt), bad);
    cs__drafter *d = calloc(1, sizeof *d);
    if (!d) return cs_fail(CS_ENOMEM, "speculation: out of memory");
    d->e = draft;
    d->kv = cs_engine_kv(draft);
    d->n_rows = dc->n_vocab;
    d->n_vocab = dc->n_vocab < tc->n_vocab ? dc->n_vocab : tc->n_vocab;
    d->ctx_len = dc->ctx_len;
    *out = d;
    return 0;
}

void cs__drafter_free(cs__drafter *d) {
    if (!d) return;
    free(d->spans), free(d->slot), free(d->first), free(d->logits);
    free(d);
}

double cs__drafter_pass_seconds(const cs__drafter *d) {
    return d->pass_s;
}
double cs__drafter_token_seconds(const cs__drafter *d) {
    return d->token_s;
}
int32_t cs__drafter_ctx_len(const cs__drafter *d) {
    return d->ctx_len;
}

static int grow(cs__drafter *d, int32_t n) {
    if (n <= d->cap) return 0;
    cs_span *sp = realloc(d->spans, (size_t)n * sizeof *sp);
    if (sp) d->spans = sp;
    int32_t *sl = realloc(d->slot, (size_t)n * sizeof *sl);
    if (sl) d->slot = sl;
    int32_t *fi = realloc(d->first, (size_t)n * sizeof *fi);
    if (fi) d->first = fi;
    float *lg = realloc(d->logits, (size_t)n * (size_t)d->n_rows * sizeof *lg);
    if (lg) d->logits = lg;
    if (!sp || !sl || !fi || !lg)
        return cs_fail(CS_ENOMEM, "speculation: out of memory for the draft");
    d->cap = n;
    return 0;
}

static void observe(double *avg, double x) {
    *avg = *avg > 0 ? 0.8 * *avg + 0.2 * x : x;
}

/* A lag this short rides in the pass without counting as catch-up: a
 * sequence whose drafts were all kept lags by one (its last draft was
 * never fed), one whose drafts the target cut short by a few. */
#define SHORT_LAG (CS_SCHED_SPEC_MAX + 1)

/* The job proposes nothing this step; with no pages (or a table the
 * reservation refused) its draft KV goes, to be rebuilt (no page it holds
 * is ever needed to go on). */
static void skip(cs__drafter *d, cs__draft_job *j, int why) {
    j->want = 0;
    if (why) cs__draft_seq_release(d, j->ds);
}

int cs__drafter_run(cs__drafter *d, cs__draft_job *jobs, int32_t n, int32_t catchup,
                    double *seconds) {
    const double t0 = cs_now();
    *seconds = 0;
    int r = grow(d, n);
    if (r) return r;
    /* plan: each job's first span (its catch-up, then the decode token when
     * it drafts) and pages for it and the drafts, within the draft's context */
    int32_t passes = 0, caught = 0;
    for (int32_t i = 0; i < n; i++) {
        cs__draft_job *j = &jobs[i];
        cs__draft_seq *ds = j->ds;
        j->got = 0;
        d->first[i] = 0;
        CS_ASSERT(ds->n_computed <= j->n_tokens - 1);   /* settled after each check */
        int32_t lag = j->n_tokens - 1 - ds->n_computed; /* before the decode token */
        int32_t k = lag + 1;
        if (lag > SHORT_LAG && lag > catchup - caught) /* a part of it this step, no draft */
            k = lag = catchup - caught > 0 ? catchup - caught : 0, j->want = 0;
        if (j->want > 0 && j->n_tokens + j->want - 1 > d->ctx_len) /* the draft's context */
            j->want = d->ctx_len - j->n_tokens + 1;
        if (j->want <= 0) k = lag, j->want = 0;
        int32_t end = ds->n_computed + k + (j->want > 0 ? j->want - 1 : 0);
        if (k <= 0 || end > d->ctx_len) {
            skip(d, j, 0);
            continue;
        }
        if ((r = cs_page_table_reserve(&ds->pt, d->kv, ds->n_computed, end))) {
            skip(d, j, r);
            continue;
        }
        d->first[i] = k;
        if (lag > SHORT_LAG) caught += lag;
        if (j->want > passes) passes = j->want;
    }
    /* pass 0: the first spans, proposing each job's first draft; pass p: the
     * p-th draft fed, proposing the next */
    for (int32_t p = 0; p < (passes > 0 ? passes : 1); p++) {
        int32_t ns = 0;
        for (int32_t i = 0; i < n; i++) {
            cs__draft_job *j = &jobs[i];
            cs__draft_seq *ds = j->ds;
            int32_t k = p == 0 ? d->first[i] : j->want > p;
            if (k == 0) continue;
            d->spans[ns] = (cs_span){j->tokens + ds->n_computed,
                                     k,
                                     ds->n_computed,
                                     ds->pt.pages,
                                     ds->pt.n_pages,
                                     j->want > 0,
                                     ds->pt.cap};
            d->slot[ns++] = i;
        }
        if (ns == 0) break;
        double tp = cs_now();
        if ((r = cs_engine_step(d->e, d->spans, ns, d->logits))) {
            /* drafts are optional: the ones proposed by earlier passes stand,
             * this pass's sequences lose their draft KV (rebuilt later) */
            CS_LOGE("speculation: the draft model's step failed (its drafts stop here): %s",
                    cs_last_error());
            for (int32_t s = 0; s < ns; s++) {
                cs__draft_job *j = &jobs[d->slot[s]];
                if (j->got > 0) {
                    cs__draft_seq_settle(d, j->ds, j->n_tokens);
                } else {
                    cs__draft_seq_release(d, j->ds);
                }
            }
            break;
        }
        int32_t row = 0;
        for (int32_t s = 0; s < ns; s++) {
            cs__draft_job *j = &jobs[d->slot[s]];
            j->ds->n_computed += d->spans[s].n_tokens;
            if (j->want <= 0) continue;
            float *lg = d->logits + (size_t)row++ * d->n_rows;
            j->tokens[j->n_tokens + p] =
                j->smp ? cs_sampler_propose(j->smp, lg, d->n_vocab, p) : cs_argmax(lg, d->n_vocab);
            j->got = p + 1;
        }
        tp = cs_now() - tp;
        if (p > 0 || caught == 0)
            observe(&d->pass_s, tp);
        else if (d->pass_s > 0 && tp > d->pass_s && caught >= cs_kv_cache_page_size(d->kv))
            observe(&d->token_s, (tp - d->pass_s) / caught);
    }
    /* windowed pages no later query reads go back now: a drafting job's
     * check never rolls back before its decode token's position */
    for (int32_t i = 0; i < n; i++) {
        cs__draft_seq *ds = jobs[i].ds;
        int32_t floor = jobs[i].got > 0 ? jobs[i].n_tokens : ds->n_computed;
        cs_page_table_trim(&ds->pt, d->kv, floor < ds->n_computed ? floor : ds->n_computed);
    }
    *seconds = cs_now() - t0;
    return 0;
}

void cs__draft_seq_settle(cs__drafter *d, cs__draft_seq *ds, int32_t valid) {
    if (ds->n_computed > valid) ds->n_computed = valid;
    cs_page_table_trim(&ds->pt, d->kv, ds->n_computed);
}

void cs__draft_seq_release(cs__drafter *d, cs__draft_seq *ds) {
    cs_page_table_release(&ds->pt, d->kv);
    ds->n_computed = 0;
}
