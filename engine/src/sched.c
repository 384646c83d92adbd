/* sched.c: the step scheduler. A sequence is its tokens (prompt, then what it
 * generated) and how many of them have KV in its pages (n_computed). Each
 * step computes, per scheduled sequence, tokens [n_computed, n_computed + k):
 * a decode is the case where exactly one token is left; a prompt chunk any
 * other. A span that reaches the last known token yields logits, and the
 * next token is sampled. Preemption sets n_computed back to 0 and frees the
 * pages: recomputation needs nothing but the tokens. */
#include "chunkserve/sched.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/sampling_fields.h"
#include "chunkserve/step_model.h"
#include "chunkserve/ttft.h"
#include "draft.h"
#include "spec_gate.h"
#include "util.h"

/* A tenant (sched.h, tenants): what the scheduler computed for it. */
typedef struct tenant {
    char name[CS_TENANT_NAME_MAX + 1];
    double weight;         /* its share (1 unless the params name it) */
    double vtokens;        /* tokens computed for it / weight */
    uint64_t joined;       /* when it last became active (cs_sched.joins): ties go to the later */
    uint64_t tokens;       /* tokens computed for it */
    int32_t n_live;        /* its live requests */
    bool named;            /* in the params' shares: kept while idle (the others go when idle) */
    uint64_t pass;         /* the last candidate pass (cs_sched.pass) that saw a prompt of it, */
    int32_t pass_priority; /* at this priority: its newer ones there are not candidates */
    struct tenant *next;
} tenant;

typedef struct seq {
    uint64_t id, arrival;
    tenant *tn;           /* whose request */
    uint64_t chunk_stamp; /* the step that last gave (or tried) it a prompt chunk */
    int32_t step_k;       /* tokens the step of chunk_stamp computes for it */
    int32_t *tokens;      /* (cap) prompt then generated */
    int32_t n_tokens, cap, n_prompt;
    int32_t n_context; /* tokens to compute before the first sample: the prompt
                          plus any resumed (migrated) tokens */
    int32_t n_computed;
    cs_page_table pt;
    int32_t *xfer;      /* PREFILL_ONLY and REMOTE: the context's pages in a KV transfer's
                           order (cs_page_table_xfer), filled as they are reported */
    int32_t n_hashed;   /* leading blocks whose prefix hash is registered or looked up */
    int32_t n_cached;   /* prompt tokens reused from the prefix cache at first admission */
    bool admitted;      /* has run at least once (n_cached is then final) */
    uint64_t last_hash; /* hash of block n_hashed - 1 (hash_root when n_hashed is 0) */
    uint64_t hash_root; /* the chain's seed: 0, or the request's cache_salt hashed */
    cs_sampler *smp;
    cs_stop *stop;
    cs_matcher *gm; /* structured output; NULL without */
    bool logprobs, running;
    const _Atomic bool *held; /* cs_request.held */
    int32_t top_logprobs;
    enum cs_kv_mode kv_mode;
    int32_t n_reported; /* PREFILL_ONLY: leading blocks whose pages were reported */
    bool kv_ready;      /* REMOTE: the KV is in place; join at the next step */
    int32_t first_token;
    cs_logprobs first_lp; /* REMOTE with logprobs: the first token's, from the prefill side */
    /* prompt_logprobs: entry i for prompt token i + 1 (from the logits at
     * position i), n_plp of them computed; handed to the first token's event */
    cs_prompt_logprob *plp;
    int32_t n_plp, plp_top;
    float spec_rate;  /* speculation: recent share of drafted tokens kept (moving average) */
    bool no_drafts;   /* cs_request.disable_speculation */
    cs__draft_seq ds; /* with a draft model: its KV of this sequence */
    int32_t priority; /* cs_request.priority: lower first */
    struct seq *next; /* in its list (waiting, running: in the order of before()) */
} seq;

struct cs_sched {
    cs_engine *e;
    cs_kv_cache *kv;
    const cs_tokenizer *tok;
    cs_sched_params p;
    int32_t n_vocab, page_size, ctx_len;
    seq *waiting, *running; /* both in the order of before(): priority, then arrival */
    seq *remote;            /* CS_KV_REMOTE requests waiting for their KV */
    seq *retired;           /* finished PREFILL_ONLY sequences: their pages are
                               reported in the last events, freed next step */
    tenant *tenants;        /* named ones, and the others while they have live requests */
    double vfloor;          /* the virtual tokens of the last tenant to go idle (tenant_join) */
    uint64_t joins;         /* counts tenants becoming active (tenant.joined) */
    uint64_t stamp;         /* counts steps (seq.chunk_stamp) */
    uint64_t pass; /* counts the candidate passes of a step's prompt chunks (tenant.pass) */
    int32_t n_waiting, n_running, n_remote, n_kv_ready;
    uint64_t next_arrival;
    cs_sched_stats st;
    cs_step_info last;
    cs_step_model model;  /* step time, for step_time_target_ms (fitted in every mode; the
                             target's part of a step: a draft model's is its own) */
    cs__drafter *drafter; /* with draft_engine */
    float spec_prior;     /* every check's acceptance rate, a slow moving average (0.5
                             before any): a new sequence's when above 0.5 */
    cs__spec_gate gate;   /* whether drafts paid, measured per decode batch size */
    double overrun;       /* measured / predicted seconds of recent steps with prompt chunks
                             (moving average; 1 until measured): the TTFT prediction's rate */
    double prompt_rate;   /* prompt tokens / seconds of recent steps with prompt chunks (moving
                             average; 0 until one): the rate while the model is not fitted */
    int32_t probe;        /* chunk cap until the model is ready (timed_chunk) */
    /* structured outputs: the vocabulary trie (built at the first such request)
     * and the compiled grammars, shared by equal specs with their mask caches */
    cs_vocab_trie *trie;
    struct grammar_slot {
        char *key; /* the spec serialized (spec_key) */
        size_t key_len;
        cs_grammar *g;
        uint64_t used;
    } grammars[CS_SCHED_GRAMMARS];
    uint64_t grammar_clock;
    /* step scratch */
    cs_span *spans;
    seq **owners;
    int32_t *drafts;     /* per span: drafted tokens after its decode token (speculation) */
    cs__draft_job *jobs; /* a draft model's: per drafting decode, and its span */
    int32_t *job_span;
    struct sample *samples; /* per span: its sample, drawn before the events (draw_samples) */
    int32_t *sampling;      /* the spans that sample this step (draw_samples) */
    float *logits;
    int32_t cap_spans, cap_rows;
    cs_event *events;
    char **texts;             /* texts of the last step's events, freed at the next step */
    cs_prompt_logprob **plps; /* their prompt logprobs, likewise */
    int32_t n_events, cap_events;
};

/* A span's sampled token (a decode's, or a prompt's last chunk's first token). */
typedef struct sample {
    seq *q;                /* NULL: the span samples nothing this step */
    float *row;            /* its logits (scratch for the sampler) */
    const uint32_t *allow; /* a structured output's mask, or NULL */
    bool failed;           /* no memory for that mask */
    int32_t id;
    cs_logprobs lp;
} sample;

cs_sched_params cs_sched_params_default(void) {
    cs_sched_params p = {0};
    p.max_num_seqs = 256;
    p.max_num_partial_prefills = 4;
    p.enable_prefix_caching = true;
    return p;
}

int cs_sched_init(cs_engine *e, const cs_sched_params *p, cs_sched **out) {
    *out = NULL;
    if (p->max_num_batched_tokens < 0 || p->max_num_seqs < 1 || p->max_num_partial_prefills < 1 ||
        p->max_chunk_tokens < 0 ||
        !(p->step_time_target_ms >= 0 && p->step_time_target_ms <= 1e7) ||
        p->num_speculative_tokens < 0 || p->num_speculative_tokens > CS_SCHED_SPEC_MAX)
        return cs_fail(CS_EINVAL,
                       "scheduler: max_num_batched_tokens must be >= 0 (0 = unlimited), "
                       "max_num_seqs and max_num_partial_prefills >= 1, max_chunk_tokens >= 0, "
                       "step_time_target_ms in [0, 1e7] (0 = off), num_speculative_tokens in "
                       "[0, %d] (0 = off)",
                       CS_SCHED_SPEC_MAX);
    if (p->n_tenant_shares < 0 || (p->n_tenant_shares && !p->tenant_shares))
        return cs_fail(CS_EINVAL, "scheduler: %d tenant shares", p->n_tenant_shares);
    for (int32_t i = 0; i < p->n_tenant_shares; i++) {
        const cs_tenant_share *t = &p->tenant_shares[i];
        size_t len = t->name ? strlen(t->name) : 0;
        if (len < 1 || len > CS_TENANT_NAME_MAX)
            return cs_fail(CS_EINVAL, "scheduler: tenant share %d: a name of 1..%d bytes, not '%s'",
                           i, CS_TENANT_NAME_MAX, t->name ? t->name : "");
        if (!(t->weight >= CS_TENANT_SHARE_MIN && t->weight <= CS_TENANT_SHARE_MAX))
            return cs_fail(CS_EINVAL, "scheduler: tenant '%s': share %g is not in [0.001, 1e6]",
                           t->name, t->weight);
        for (int32_t j = 0; j < i; j++)
            if (!strcmp(p->tenant_shares[j].name, t->name))
                return cs_fail(CS_EINVAL, "scheduler: tenant '%s' has two shares", t->name);
    }
    cs_sched *s = calloc(1, sizeof *s);
    if (!s) return cs_fail(CS_ENOMEM, "scheduler: out of memory");
    for (int32_t i = p->n_tenant_shares - 1; i >= 0; i--) {
        tenant *t = calloc(1, sizeof *t);
        if (!t) {
            cs_sched_free(s);
            return cs_fail(CS_ENOMEM, "scheduler: out of memory");
        }
        snprintf(t->name, sizeof t->name, "%s", p->tenant_shares[i].name);
        t->weight = p->tenant_shares[i].weight;
        t->named = true;
        t->next = s->tenants;
        s->tenants = t;
    }
    s->e = e;
    s->kv = cs_engine_kv(e);
    const cs_model *m = cs_engine_model(e);
    if (p->draft_engine && p->num_speculative_tokens > 0) {
        int r = cs__drafter_init(p->draft_engine, m, &s->drafter);
        if (r) {
            cs_sched_free(s);
            return r;
        }
    }
    s->tok = cs_model_tokenizer(m);
    s->p = *p;
    s->p.tenant_shares = NULL; /* copied above; the caller's may go */
    s->n_vocab = cs_model_get_config(m)->n_vocab;
    s->ctx_len = cs_model_get_config(m)->ctx_len;
    s->page_size = cs_kv_cache_page_size(s->kv);
    cs_step_model_init(&s->model);
    s->overrun = 1;
    s->spec_prior = 0.5f;
    s->probe = s->page_size < CS_SCHED_PROBE_TOKENS ? s->page_size : CS_SCHED_PROBE_TOKENS;
    *out = s;
    return 0;
}

/* The tenant named name, made (weight 1) when new; NULL when out of memory. */
static tenant *tenant_of(cs_sched *s, const char *name) {
    for (tenant *t = s->tenants; t; t = t->next)
        if (!strcmp(t->name, name)) return t;
    tenant *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    snprintf(t->name, sizeof t->name, "%s", name);
    t->weight = 1;
    t->next = s->tenants;
    s->tenants = t;
    return t;
}

static bool any_active(const cs_sched *s) {
    for (const tenant *o = s->tenants; o; o = o->next)
        if (o->n_live > 0) return true;
    return false;
}

/* A tenant becomes active: no fewer virtual tokens than the least of the
 * active ones, or with none active the last one's to go idle (idle time
 * saves no credit). */
static void tenant_join(cs_sched *s, tenant *t) {
    if (t->n_live++ > 0) return;
    double least = s->vfloor;
    bool any = false;
    for (const tenant *o = s->tenants; o; o = o->next)
        if (o != t && o->n_live > 0 && (!any || o->vtokens < least)) least = o->vtokens, any = true;
    if (least > t->vtokens) t->vtokens = least;
    t->joined = ++s->joins;
}

static void tenant_leave(cs_sched *s, tenant *t) {
    if (--t->n_live > 0) return;
    if (!any_active(s)) s->vfloor = t->vtokens;
    if (t->named) return;
    for (tenant **l = &s->tenants; *l; l = &(*l)->next)
        if (*l == t) {
            *l = t->next;
            free(t);
            return;
        }
}

/* k tokens computed for q's tenant. */
static void charge(seq *q, int32_t k) {
    q->tn->tokens += (uint64_t)k;
    q->tn->vtokens += k / q->tn->weight;
}

uint64_t cs_sched_tenant_tokens(const cs_sched *s, const char *name) {
    for (const tenant *t = s->tenants; t; t = t->next)
        if (!strcmp(t->name, name ? name : "")) return t->tokens;
    return 0;
}

static void seq_free(cs_sched *s, seq *q) {
    if (q->tn) tenant_leave(s, q->tn);
    cs_page_table_release(&q->pt, s->kv);
    if (s->drafter) cs__draft_seq_release(s->drafter, &q->ds);
    free(q->xfer);
    cs_sampler_free(q->smp);
    cs_stop_free(q->stop);
    cs_matcher_free(q->gm);
    free(q->plp);
    free(q->tokens);
    free(q);
}

static void free_texts(cs_sched *s) {
    for (int32_t i = 0; i < s->n_events; i++)
        free(s->texts[i]), free(s->plps[i]);
    s->n_events = 0;
}

static void free_list(cs_sched *s, seq **list) {
    for (seq *q = *list, *n; q; q = n)
        n = q->next, seq_free(s, q);
    *list = NULL;
}

void cs_sched_free(cs_sched *s) {
    if (!s) return;
    free_list(s, &s->waiting);
    free_list(s, &s->running);
    free_list(s, &s->remote);
    free_list(s, &s->retired);
    free_texts(s);
    for (tenant *t = s->tenants, *n; t; t = n)
        n = t->next, free(t);
    free(s->spans), free(s->owners), free(s->drafts), free(s->logits), free(s->events);
    free(s->jobs), free(s->job_span), free(s->samples), free(s->sampling);
    free(s->texts);
    free(s->plps);
    for (int i = 0; i < CS_SCHED_GRAMMARS; i++) {
        free(s->grammars[i].key);
        cs_grammar_free(s->grammars[i].g);
    }
    cs_vocab_trie_free(s->trie);
    cs__drafter_free(s->drafter);
    free(s);
}

static bool is_held(const seq *q) {
    return q->held && atomic_load_explicit(q->held, memory_order_acquire);
}

bool cs_sched_idle(const cs_sched *s) {
    if (s->waiting || s->retired || s->n_kv_ready) return false;
    for (const seq *q = s->running; q; q = q->next)
        if (!is_held(q) || q->n_tokens - q->n_computed <= 1) return false;
    return true; /* nothing, or only held prompts */
}
void cs_sched_last_step(const cs_sched *s, cs_step_info *info) {
    *info = s->last;
}
void cs_sched_get_stats(const cs_sched *s, cs_sched_stats *st) {
    *st = s->st;
    st->n_running = s->n_running;
    st->n_waiting = s->n_waiting + s->n_remote;
    st->n_waiting_kv = s->n_remote;
    st->queued_prompt_tokens = 0;
    for (const seq *q = s->waiting; q; q = q->next)
        st->queued_prompt_tokens += q->n_tokens - q->n_computed;
    for (const seq *q = s->running; q; q = q->next)
        if (q->n_tokens - q->n_computed > 1)
            st->queued_prompt_tokens += q->n_tokens - q->n_computed;
    st->kv_pages_total = cs_kv_cache_n_pages(s->kv);
    st->kv_pages_used = cs_kv_cache_n_used(s->kv);
    st->kv_pages_cached = cs_kv_cache_n_cached(s->kv);
    st->page_size = s->page_size;
    st->max_num_batched_tokens = s->p.max_num_batched_tokens;
    st->num_speculative_tokens = s->p.num_speculative_tokens;
    st->draft_model = s->drafter != NULL;
}

/* The live sequence id (waiting, running or waiting for its KV). */
static seq *find(cs_sched *s, uint64_t id, seq ***link) {
    seq **lists[] = {&s->waiting, &s->running, &s->remote};
    for (int i = 0; i < 3; i++)
        for (seq **l = lists[i]; *l; l = &(*l)->next)
            if ((*l)->id == id) return *link = l, *l;
    return NULL;
}

/* The scheduler's order: the lower priority value first, then arrival. */
static bool before(const seq *a, const seq *b) {
    return a->priority < b->priority || (a->priority == b->priority && a->arrival < b->arrival);
}

/* Inserts q into list in that order (preempted sequences go back in place). */
static void insert_ordered(seq **list, seq *q) {
    while (*list && before(*list, q))
        list = &(*list)->next;
    q->next = *list;
    *list = q;
}

/* min_tokens: the sampler never picks a stop token before it is reached. */
static int suppress_stops(cs_sched *s, seq *q, const cs_stop_params *sp) {
    int32_t n_eog = 0;
    for (int32_t i = 0; !sp->ignore_eos && i < s->n_vocab; i++)
        n_eog += cs_tokenizer_is_eog(s->tok, i);
    int32_t *ids = malloc(((size_t)n_eog + sp->n_stop_ids + 1) * sizeof *ids);
    if (!ids) return cs_fail(CS_ENOMEM, "out of memory");
    size_t k = 0;
    for (int32_t i = 0; n_eog && i < s->n_vocab; i++)
        if (cs_tokenizer_is_eog(s->tok, i)) ids[k++] = i;
    for (size_t i = 0; i < sp->n_stop_ids; i++)
        ids[k++] = sp->stop_ids[i];
    int rc = cs_sampler_suppress(q->smp, ids, k, sp->min_tokens);
    free(ids);
    return rc;
}

static void reuse_prefix(cs_sched *s, seq *q);

/* The spec as bytes: kind, then each string with its terminating NUL. */
static char *spec_key(const cs_structured *sp, size_t *len) {
    size_t n = 1 + (sp->text ? strlen(sp->text) + 1 : 0);
    for (int32_t i = 0; i < sp->n_choices; i++)
        n += strlen(sp->choices[i]) + 1;
    char *k = malloc(n), *p = k;
    if (!k) return NULL;
    *p++ = (char)sp->kind;
    if (sp->text) p = stpcpy(p, sp->text) + 1;
    for (int32_t i = 0; i < sp->n_choices; i++)
        p = stpcpy(p, sp->choices[i]) + 1;
    *len = n;
    return k;
}

/* The grammar of a spec: one compiled before, else compiled now into the
 * least recently used slot. Borrowed (the matcher takes its own reference). */
static int grammar_for(cs_sched *s, const cs_structured *sp, cs_grammar **out) {
    size_t kl;
    char *key = spec_key(sp, &kl);
    if (!key) return cs_fail(CS_ENOMEM, "out of memory");
    int lru = 0;
    for (int i = 0; i < CS_SCHED_GRAMMARS; i++) {
        struct grammar_slot *g = &s->grammars[i];
        if (g->g && g->key_len == kl && !memcmp(g->key, key, kl)) {
            free(key);
            g->used = ++s->grammar_clock;
            *out = g->g;
            return 0;
        }
        if (g->used < s->grammars[lru].used) lru = i;
    }
    cs_grammar *g;
    int r = cs_grammar_compile(sp, &g);
    if (r) {
        free(key);
        return r;
    }
    struct grammar_slot *slot = &s->grammars[lru];
    free(slot->key);
    cs_grammar_free(slot->g);
    *slot = (struct grammar_slot){key, kl, g, ++s->grammar_clock};
    *out = g;
    return 0;
}

/* The request's matcher, with its resumed tokens fed. */
static int start_matcher(cs_sched *s, seq *q, const cs_request *r, int32_t n_real) {
    if (!s->trie) {
        int rc = cs_vocab_trie_init(s->tok, s->n_vocab, &s->trie);
        if (rc) return rc;
    }
    cs_grammar *g = NULL;
    int rc = grammar_for(s, &r->structured, &g);
    if (!rc) rc = cs_matcher_init(g, s->trie, &q->gm);
    for (int32_t i = n_real; !rc && i < r->n_prompt; i++)
        if ((rc = cs_matcher_accept(q->gm, r->prompt[i])) == CS_EINVAL)
            rc = cs_fail(CS_EINVAL,
                         "request %llu: resumed token %d (index %d) does not follow the "
                         "structured output",
                         (unsigned long long)r->id, r->prompt[i], i);
    return rc;
}

int cs_sched_add(cs_sched *s, const cs_request *r) {
    seq **link;
    if (find(s, r->id, &link))
        return cs_fail(CS_EINVAL, "request %llu is already live", (unsigned long long)r->id);
    if (r->n_prompt < 1 || !r->prompt)
        return cs_fail(CS_EINVAL, "request %llu: empty prompt", (unsigned long long)r->id);
    if (r->n_resumed < 0 || r->n_resumed >= r->n_prompt)
        return cs_fail(
            CS_EINVAL,
            "request %llu: %d resumed tokens in a context of %d (the prompt must keep one)",
            (unsigned long long)r->id, r->n_resumed, r->n_prompt);
    if (r->top_logprobs < 0 || r->top_logprobs > CS_MAX_TOP_LOGPROBS)
        return cs_fail(CS_EINVAL, "request %llu: top_logprobs %d must be in [0, %d]",
                       (unsigned long long)r->id, r->top_logprobs, CS_MAX_TOP_LOGPROBS);
    if (cs_sampling_field_check(cs_sampling_field_find("priority"), r->priority, ""))
        return CS_EINVAL; /* the table's bounds, named */
    bool plp = r->prompt_logprobs && r->kv_mode != CS_KV_REMOTE;
    if (plp && (r->prompt_top_logprobs < 0 || r->prompt_top_logprobs > CS_MAX_TOP_LOGPROBS))
        return cs_fail(CS_EINVAL, "request %llu: prompt_top_logprobs %d must be in [0, %d]",
                       (unsigned long long)r->id, r->prompt_top_logprobs, CS_MAX_TOP_LOGPROBS);
    if (plp && r->n_resumed)
        return cs_fail(CS_EINVAL,
                       "request %llu: prompt logprobs of a resumed request (they come with its "
                       "first token, which was sent before)",
                       (unsigned long long)r->id);
    if ((unsigned)r->kv_mode > CS_KV_REMOTE)
        return cs_fail(CS_EINVAL, "request %llu: unknown kv mode %d", (unsigned long long)r->id,
                       (int)r->kv_mode);
    if (r->tenant && strlen(r->tenant) > CS_TENANT_NAME_MAX)
        return cs_fail(CS_EINVAL, "request %llu: tenant '%.16s...' is longer than %d bytes",
                       (unsigned long long)r->id, r->tenant, CS_TENANT_NAME_MAX);
    if (r->n_prompt >= s->ctx_len)
        return cs_fail(
            CS_EINVAL,
            "request %llu: prompt of %d tokens leaves no room in the model's context of %d",
            (unsigned long long)r->id, r->n_prompt, s->ctx_len);
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= s->n_vocab)
            return cs_fail(
                CS_EINVAL,
                "request %llu: token id %d at index %d is outside the vocabulary (0..%d)",
                (unsigned long long)r->id, r->prompt[i], i, s->n_vocab - 1);
    /* the least it must hold: its whole prompt, and a first token computed;
     * a reserved local prompt takes every page of its prompt at admission */
    const cs_page_table none = {0};
    int32_t need = cs_kv_cache_min_pages(s->kv, r->n_prompt + 1);
    if (r->reserve && r->kv_mode != CS_KV_REMOTE) {
        int32_t all = cs_page_table_need(&none, s->kv, 0, r->n_prompt);
        if (all > need) need = all;
    }
    if (need > cs_kv_cache_n_pages(s->kv))
        return cs_fail(
            CS_ENOSPC, "request %llu: a prompt of %d tokens needs %lld KV pages; the pool has %d",
            (unsigned long long)r->id, r->n_prompt, (long long)need, cs_kv_cache_n_pages(s->kv));
    int32_t n_real = r->n_prompt - r->n_resumed; /* the prompt proper */
    if (r->n_resumed && r->stop.max_tokens > 0 && r->n_resumed >= r->stop.max_tokens)
        return cs_fail(CS_EINVAL, "request %llu: its %d resumed tokens already reach max_tokens %d",
                       (unsigned long long)r->id, r->n_resumed, r->stop.max_tokens);
    seq *q = calloc(1, sizeof *q);
    if (!q) return cs_fail(CS_ENOMEM, "out of memory");
    int64_t max_total = (int64_t)n_real + (r->stop.max_tokens > 0 ? r->stop.max_tokens : 0);
    if (max_total > s->ctx_len || r->stop.max_tokens <= 0) max_total = s->ctx_len;
    q->cap = (int32_t)max_total + 1;
    q->tokens = malloc((size_t)q->cap * sizeof(int32_t));
    if (r->kv_mode != CS_KV_LOCAL || r->reserve)
        q->xfer = malloc(((size_t)cs_kv_cache_seq_pages(s->kv, r->n_prompt) + 1) * sizeof *q->xfer);
    int rc = q->tokens && (q->xfer || (r->kv_mode == CS_KV_LOCAL && !r->reserve))
                 ? 0
                 : cs_fail(CS_ENOMEM, "out of memory");
    if (!rc) rc = cs_sampler_init(&r->sampling, s->n_vocab, &q->smp);
    cs_stop_params sp = r->stop;
    if (sp.max_tokens > s->ctx_len - n_real)
        sp.max_tokens = s->ctx_len - n_real; /* the context ends it */
    if (sp.min_tokens > sp.max_tokens) sp.min_tokens = sp.max_tokens;
    if (!rc) rc = cs_stop_init(s->tok, &sp, &q->stop);
    if (!rc && sp.min_tokens > 0) rc = suppress_stops(s, q, &sp);
    if (!rc && r->structured.kind != CS_STRUCTURED_NONE) rc = start_matcher(s, q, r, n_real);
    /* Resumed tokens: the stop checker sees them as generated (max_tokens,
     * stop strings spanning the resume point); their text was shown before. */
    for (int32_t i = n_real; !rc && i < r->n_prompt; i++) {
        char *text = NULL;
        enum cs_finish fin = CS_FINISH_NONE;
        rc = cs_stop_push(q->stop, r->prompt[i], &text, &fin);
        free(text);
        if (!rc && fin != CS_FINISH_NONE)
            rc = cs_fail(CS_EINVAL, "request %llu: its resumed tokens already end the sequence",
                         (unsigned long long)r->id);
    }
    if (!rc && plp) {
        q->plp = malloc((size_t)(r->n_prompt > 1 ? r->n_prompt - 1 : 1) * sizeof *q->plp);
        if (!q->plp) rc = cs_fail(CS_ENOMEM, "out of memory");
        q->plp_top = r->prompt_top_logprobs;
    }
    if (!rc) { /* the prompt and its hash chain's seed, before any page is taken */
        memcpy(q->tokens, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
        q->n_tokens = q->n_context = r->n_prompt;
        q->hash_root = cs_kv_cache_hash_root(r->cache_salt);
        q->last_hash = q->hash_root;
    }
    /* A reserved local prompt takes its cached prefix first and reserves only
     * the rest (at admission reuse_prefix skips a sequence that holds pages) */
    if (!rc && r->reserve && r->kv_mode != CS_KV_REMOTE) reuse_prefix(s, q);
    /* REMOTE: the pages a transfer lands in (for a next query at n_prompt) */
    int32_t from = r->kv_mode == CS_KV_REMOTE ? r->n_prompt : q->n_computed;
    if (!rc && (r->reserve || r->kv_mode == CS_KV_REMOTE) &&
        (rc = cs_page_table_reserve(&q->pt, s->kv, from, r->n_prompt)) == CS_ENOSPC)
        rc = cs_fail(CS_ENOSPC,
                     "request %llu: no room now: its %d tokens need %d KV pages, %d are free",
                     (unsigned long long)r->id, r->n_prompt,
                     cs_page_table_need(&q->pt, s->kv, from, r->n_prompt),
                     cs_kv_cache_n_free(s->kv) + cs_kv_cache_n_cached(s->kv));
    if (!rc && !(q->tn = tenant_of(s, r->tenant ? r->tenant : "")))
        rc = cs_fail(CS_ENOMEM, "out of memory");
    if (!rc) tenant_join(s, q->tn);
    if (rc) {
        seq_free(s, q);
        return rc;
    }
    q->n_prompt = n_real;
    q->id = r->id;
    q->logprobs = r->logprobs;
    q->top_logprobs = r->logprobs ? r->top_logprobs : 0;
    q->held = r->held;
    q->kv_mode = r->kv_mode;
    q->arrival = s->next_arrival++;
    /* no history of its own: the scheduler's, or even odds when that is
     * lower (each request gets its chance to show it drafts well) */
    q->spec_rate = s->spec_prior > 0.5f ? s->spec_prior : 0.5f;
    q->no_drafts = r->disable_speculation;
    q->priority = r->priority;
    cs_sampler_accept_prompt(q->smp, r->prompt, (size_t)n_real);
    for (int32_t i = n_real; i < r->n_prompt; i++)
        cs_sampler_accept(q->smp, r->prompt[i]);
    if (q->kv_mode == CS_KV_REMOTE) {
        q->next = s->remote;
        s->remote = q;
        s->n_remote++;
    } else {
        insert_ordered(&s->waiting, q);
        s->n_waiting++;
    }
    return 0;
}

int cs_sched_kv_pages(cs_sched *s, uint64_t id, const int32_t **pages, int32_t *n_pages) {
    seq **link;
    seq *q = find(s, id, &link);
    if (!q || q->admitted || !q->pt.n_pages || !q->xfer) /* n_computed may count a reused prefix */
        return cs_fail(CS_ENOENT, "request %llu has no reserved pages waiting",
                       (unsigned long long)id);
    int32_t blocks = (q->n_context + s->page_size - 1) / s->page_size;
    int32_t n = cs_page_table_xfer(&q->pt, s->kv, q->n_context, 0, blocks, q->xfer);
    if (n < 0) return n;
    *pages = q->xfer;
    *n_pages = n;
    return 0;
}

int cs_sched_kv_ready(cs_sched *s, uint64_t id, int32_t first_token, int32_t n_cached,
                      const cs_logprobs *first_lp) {
    seq **link;
    seq *q = find(s, id, &link);
    if (!q || q->kv_mode != CS_KV_REMOTE || q->running || q->kv_ready)
        return cs_fail(CS_ENOENT, "request %llu is not waiting for its KV", (unsigned long long)id);
    if (first_token < 0 || first_token >= s->n_vocab)
        return cs_fail(CS_EINVAL, "request %llu: first token %d is outside the vocabulary (0..%d)",
                       (unsigned long long)id, first_token, s->n_vocab - 1);
    /* of the context: a migrated stream's cached prefix may cover resumed tokens */
    if (n_cached < 0 || n_cached >= q->n_context)
        return cs_fail(CS_EINVAL, "request %llu: %d cached tokens of a %d-token context",
                       (unsigned long long)id, n_cached, q->n_context);
    if (q->logprobs) {
        if (!first_lp || first_lp->n_top < 0 || first_lp->n_top > q->top_logprobs)
            return cs_fail(
                CS_EINVAL,
                "request %llu: the first token came with %d alternatives, at most %d asked",
                (unsigned long long)id, first_lp ? first_lp->n_top : -1, q->top_logprobs);
        for (int32_t i = 0; i < first_lp->n_top; i++)
            if (first_lp->top_ids[i] < 0 || first_lp->top_ids[i] >= s->n_vocab)
                return cs_fail(CS_EINVAL, "request %llu: alternative %d is outside the vocabulary",
                               (unsigned long long)id, first_lp->top_ids[i]);
        q->first_lp = *first_lp;
    }
    q->kv_ready = true;
    q->first_token = first_token;
    q->n_cached = n_cached;
    s->n_kv_ready++;
    return 0;
}

int cs_sched_cancel(cs_sched *s, uint64_t id) {
    seq **link;
    seq *q = find(s, id, &link);
    if (!q) return cs_fail(CS_ENOENT, "request %llu is not live", (unsigned long long)id);
    *link = q->next;
    if (q->running)
        s->n_running--;
    else if (q->kv_mode == CS_KV_REMOTE)
        s->n_remote--, s->n_kv_ready -= q->kv_ready;
    else
        s->n_waiting--;
    seq_free(s, q);
    s->st.requests_cancelled++;
    return 0;
}

/* The highest of blocks [b0, b1) missing a page that a prefix hit of `hit`
 * blocks needs (the global kinds, and the windowed kinds from that hit's
 * window block on) in the prefix cache, or -1 when none is missing. */
static int32_t missing_block(const cs_sched *s, const uint64_t *h, int32_t b0, int32_t b1,
                             int32_t hit) {
    const int32_t per_block = cs_kv_cache_per_block(s->kv), n_global = cs_kv_cache_n_global(s->kv);
    const int32_t wb = cs_kv_cache_window_block(s->kv, hit * s->page_size);
    for (int32_t b = b1 - 1; b >= b0; b--)
        for (int32_t j = 0; j < per_block; j++)
            if ((j < n_global || b >= wb) &&
                !cs_kv_cache_has(s->kv, cs_kv_cache_kind_hash(h[b], j)))
                return b;
    return -1;
}

/* Takes back the longest cached prefix of a sequence that has nothing
 * computed, leaving at least one token to compute (it yields the logits).
 * The rule with windowed layers: a prefix of k blocks is a hit when every
 * block's global pages are cached and so are the windowed pages of the
 * blocks the query at k * page_size still sees (the window before it); the
 * windowed pages of earlier blocks are never needed again. When some of
 * those are gone (given back and evicted), the hit is cut back to the
 * longest shorter prefix whose window is whole (or to none). */
static void reuse_prefix(cs_sched *s, seq *q) {
    if (!s->p.enable_prefix_caching || q->n_computed || q->pt.n_pages || q->plp)
        return; /* pages reserved at add; prompt logprobs need every position's logits */
    int32_t full = (q->n_tokens - 1) / s->page_size;
    if (full < 1) return;
    uint64_t *h = malloc((size_t)full * sizeof *h);
    if (!h) return; /* no reuse; the pages are computed instead */
    uint64_t prev = q->hash_root;
    for (int32_t i = 0; i < full; i++)
        h[i] = prev =
            cs_kv_cache_page_hash(prev, q->tokens + (size_t)i * s->page_size, s->page_size);
    /* the longest run of blocks whose global pages are all cached */
    const int32_t per_block = cs_kv_cache_per_block(s->kv), n_global = cs_kv_cache_n_global(s->kv);
    int32_t k = 0;
    while (k < full && missing_block(s, h, k, k + 1, INT32_MAX / s->page_size) < 0)
        k++;
    /* cut back until the window before the hit is whole */
    for (int32_t m; k > 0;) {
        m = missing_block(s, h, cs_kv_cache_window_block(s->kv, k * s->page_size), k, k);
        if (m < 0) break;
        k = m;
    }
    if (k > 0) { /* take them: every lookup finds its page (nothing was evicted since) */
        cs_page_table *pt = &q->pt;
        int32_t cap = pt->cap ? pt->cap : 8;
        while (cap < k)
            cap *= 2;
        int32_t *pages = malloc((size_t)cap * (size_t)per_block * sizeof *pages);
        if (pages) {
            const int32_t wb = cs_kv_cache_window_block(s->kv, k * s->page_size);
            for (int32_t j = 0; j < per_block; j++)
                for (int32_t b = 0; b < cap; b++)
                    pages[(size_t)j * cap + b] =
                        b < k && (j < n_global || b >= wb)
                            ? cs_kv_cache_lookup(s->kv, cs_kv_cache_kind_hash(h[b], j))
                            : -1;
            free(pt->pages);
            *pt = (cs_page_table){pages, k, cap, wb};
            q->n_hashed = k;
            q->last_hash = h[k - 1];
            q->n_computed = k * s->page_size;
        }
    }
    free(h);
}

/* Registers the hashes of pages that became full with computed tokens (each
 * kind of a block under cs_kv_cache_kind_hash of its chained hash), then
 * gives back the windowed pages the next query no longer sees. */
static void settle_pages(cs_sched *s, seq *q) {
    if (s->p.enable_prefix_caching) {
        const int32_t per_block = cs_kv_cache_per_block(s->kv);
        int32_t full = q->n_computed / s->page_size;
        for (; q->n_hashed < full; q->n_hashed++) {
            q->last_hash = cs_kv_cache_page_hash(
                q->last_hash, q->tokens + (size_t)q->n_hashed * s->page_size, s->page_size);
            for (int32_t j = 0; j < per_block; j++) {
                int32_t id = q->pt.pages[(size_t)j * q->pt.cap + q->n_hashed];
                if (id >= 0)
                    cs_kv_cache_register(s->kv, id, cs_kv_cache_kind_hash(q->last_hash, j));
            }
        }
    }
    cs_page_table_trim(&q->pt, s->kv, q->n_computed);
}

/* Frees a running sequence's pages and puts it back in the waiting queue. */
static void preempt(cs_sched *s, seq **link) {
    seq *q = *link;
    *link = q->next;
    s->n_running--;
    cs_page_table_release(&q->pt, s->kv);
    if (s->drafter) cs__draft_seq_release(s->drafter, &q->ds);
    q->n_computed = 0;
    q->n_hashed = 0;
    q->last_hash = q->hash_root;
    q->running = false;
    insert_ordered(&s->waiting, q);
    s->n_waiting++;
    s->st.preemptions++;
}

/* Room for n events in the step (the events already made keep their place
 * in the new array). */
static int grow_events(cs_sched *s, int32_t n) {
    if (n <= s->cap_events) return 0;
    cs_event *ev = realloc(s->events, (size_t)n * sizeof *ev);
    if (ev) s->events = ev;
    char **tx = realloc(s->texts, (size_t)n * sizeof *tx);
    if (tx) s->texts = tx;
    cs_prompt_logprob **pl = realloc(s->plps, (size_t)n * sizeof *pl);
    if (pl) s->plps = pl;
    if (!ev || !tx || !pl) return cs_fail(CS_ENOMEM, "scheduler: out of memory");
    s->cap_events = n;
    return 0;
}

static int grow_scratch(cs_sched *s, int32_t n) {
    if (n <= s->cap_spans) return 0;
    int32_t cap = s->cap_spans ? s->cap_spans : 16;
    while (cap < n)
        cap *= 2;
    cs_span *sp = realloc(s->spans, (size_t)cap * sizeof *sp);
    if (sp) s->spans = sp;
    seq **ow = realloc(s->owners, (size_t)cap * sizeof *ow);
    if (ow) s->owners = ow;
    int32_t *dr = realloc(s->drafts, (size_t)cap * sizeof *dr);
    if (dr) s->drafts = dr;
    cs__draft_job *jb = realloc(s->jobs, (size_t)cap * sizeof *jb);
    if (jb) s->jobs = jb;
    int32_t *js = realloc(s->job_span, (size_t)cap * sizeof *js);
    if (js) s->job_span = js;
    sample *sm = realloc(s->samples, (size_t)cap * sizeof *sm);
    if (sm) s->samples = sm;
    int32_t *sg = realloc(s->sampling, (size_t)cap * sizeof *sg);
    if (sg) s->sampling = sg;
    if (!sp || !ow || !dr || !jb || !js || !sm || !sg)
        return cs_fail(CS_ENOMEM, "scheduler: out of memory");
    s->cap_spans = cap;
    return grow_events(s, 2 * cap);
}

static int grow_logits(cs_sched *s, int32_t rows) {
    if (rows <= s->cap_rows) return 0;
    float *lg = realloc(s->logits, (size_t)rows * (size_t)s->n_vocab * sizeof *lg);
    if (!lg) return cs_fail(CS_ENOMEM, "scheduler: out of memory for %d rows of logits", rows);
    s->logits = lg;
    s->cap_rows = rows;
    return 0;
}

/* Prompt-logprob rows a chunk of k tokens of q yields: one per prompt
 * position it covers (i, whose logits give token i + 1's) not done yet. */
static int32_t plp_rows(const seq *q, int32_t k) {
    if (!q->plp) return 0;
    int32_t lo = q->n_computed > q->n_plp ? q->n_computed : q->n_plp;
    int32_t hi = q->n_computed + k < q->n_prompt - 1 ? q->n_computed + k : q->n_prompt - 1;
    return hi > lo ? hi - lo : 0;
}

/* k capped so that the chunk yields at most room prompt-logprob rows. */
static int32_t plp_cap(const seq *q, int32_t k, int32_t room) {
    if (plp_rows(q, k) <= room) return k;
    int32_t lo = q->n_computed > q->n_plp ? q->n_computed : q->n_plp;
    return lo - q->n_computed + room;
}

/* A span of k tokens of q. Its logits rows: its prompt-logprob rows, then
 * (when it reaches the last known token) the row to sample from; they are
 * the span's last rows, as cs_span asks. */
static void add_span(cs_sched *s, int32_t *n_spans, seq *q, int32_t k) {
    bool last = q->n_computed + k == q->n_tokens;
    int32_t rows = plp_rows(q, k);
    s->spans[*n_spans] =
        (cs_span){q->tokens + q->n_computed, k,        q->n_computed, q->pt.pages, q->pt.n_pages,
                  rows ? rows + last : last, q->pt.cap};
    s->drafts[*n_spans] = 0;
    s->owners[(*n_spans)++] = q;
    q->step_k = k;
}

/* The next event slot (scratch holds two per live sequence: a join's first
 * token and a decode in the same step; and one per draft in a step with
 * drafts). */
static cs_event *next_event(cs_sched *s, char *text) {
    CS_ASSERT(s->n_events < s->cap_events);
    s->texts[s->n_events] = text;
    s->plps[s->n_events] = NULL;
    cs_event *ev = &s->events[s->n_events++];
    *ev = (cs_event){.token = -1, .text = text ? text : "", .stop_token = -1};
    return ev;
}

/* Removes a finished sequence from the running list. */
static void unlink_running(cs_sched *s, seq *q) {
    seq **link = NULL;
    CS_ASSERT(find(s, q->id, &link) == q && q->running);
    *link = q->next;
    s->n_running--;
    s->st.requests_finished++;
}

/* An error event ending q (its caller frees it). */
static void error_event(cs_sched *s, const seq *q, int status, const char *error) {
    cs_event *ev = next_event(s, NULL);
    ev->id = q->id;
    ev->finish = CS_FINISH_ERROR;
    ev->n_prompt_tokens = q->n_prompt;
    ev->n_completion_tokens = q->n_tokens - q->n_prompt;
    ev->error = error;
    ev->status = status;
}

/* A running sequence ends with an error event (left running without a
 * token, it would never be scheduled again). */
static void end_in_error(cs_sched *s, seq *q, int status, const char *error) {
    error_event(s, q, status, error);
    unlink_running(s, q);
    seq_free(s, q);
}

/* Records token id for q (sampled here, or by the prefill side) and emits
 * its event. A finished sequence leaves the running list: freed now, or kept
 * until the next step when its pages are reported (PREFILL_ONLY); *ended
 * (when not NULL) says so, q is not to be touched then. */
static int emit_token(cs_sched *s, seq *q, int32_t id, const cs_logprobs *lp, const int32_t *pages,
                      int32_t first_page, int32_t n_pages, bool *ended) {
    char *text = NULL;
    enum cs_finish fin = CS_FINISH_NONE;
    if (ended) *ended = true; /* until it is known to go on */
    if (q->kv_mode == CS_KV_PREFILL_ONLY) {
        fin = CS_FINISH_LENGTH; /* one token; the decode side applies the stop rules */
    } else if (cs_stop_push(q->stop, id, &text, &fin) != 0) {
        end_in_error(s, q, CS_ENOMEM, "out of memory for the request's text");
        return 0;
    }
    /* the structured output follows the token (a first token from a bad peer
     * that breaks it ends the request) */
    if (q->gm && cs_matcher_accept(q->gm, id) != 0) {
        free(text);
        end_in_error(s, q, CS_EINVAL, "the token does not follow the request's structured output");
        return 0;
    }
    /* the stop string that ended it travels after the text, in its allocation (the
     * stop checker goes with the sequence); without memory for it, no name */
    const char *matched = fin == CS_FINISH_STOP ? cs_stop_matched_string(q->stop) : NULL;
    size_t tl = 0;
    if (matched) {
        tl = text ? strlen(text) : 0;
        char *t = realloc(text, tl + strlen(matched) + 2);
        if (t) {
            t[tl] = 0;
            strcpy(t + tl + 1, matched);
            text = t;
        } else {
            matched = NULL;
        }
    }
    cs_sampler_accept(q->smp, id);
    CS_ASSERT(q->n_tokens < q->cap);
    q->tokens[q->n_tokens++] = id;
    s->st.generated_tokens++;
    cs_event *ev = next_event(s, text);
    if (q->plp) { /* the first token: the prompt's logprobs go with it */
        CS_ASSERT(q->n_plp == (q->n_prompt > 1 ? q->n_prompt - 1 : 0));
        ev->prompt_lp = s->plps[s->n_events - 1] = q->plp;
        ev->n_prompt_lp = q->n_plp;
        q->plp = NULL;
    }
    if (matched) ev->stop_string = text + tl + 1;
    if (fin == CS_FINISH_STOP) ev->stop_token = cs_stop_matched_token(q->stop);
    ev->id = q->id;
    ev->token = id;
    if (q->logprobs) ev->lp = *lp;
    ev->finish = fin;
    ev->n_prompt_tokens = q->n_prompt;
    ev->n_completion_tokens = q->n_tokens - q->n_prompt;
    ev->n_cached_prompt_tokens = q->n_cached;
    ev->kv_pages = pages;
    ev->kv_first_page = first_page;
    ev->kv_n_pages = n_pages;
    if (fin != CS_FINISH_NONE) {
        unlink_running(s, q);
        if (q->kv_mode == CS_KV_PREFILL_ONLY) {
            q->next = s->retired;
            s->retired = q;
        } else {
            seq_free(s, q);
        }
    } else if (ended) {
        *ended = false;
    }
    return 0;
}

/* Remote sequences whose KV arrived join the running batch: their first
 * token (sampled by the prefill side) is recorded and emitted. */
static int join_ready(cs_sched *s) {
    for (seq **l = &s->remote; *l && s->n_kv_ready;) {
        seq *q = *l;
        if (!q->kv_ready) {
            l = &q->next;
            continue;
        }
        *l = q->next;
        s->n_remote--;
        s->n_kv_ready--;
        q->kv_ready = false;
        q->n_computed = q->n_context;
        q->admitted = q->running = true;
        settle_pages(s, q);
        insert_ordered(&s->running, q);
        s->n_running++;
        int r = emit_token(s, q, q->first_token, &q->first_lp, NULL, 0, 0, NULL);
        if (r) return r;
    }
    return 0;
}

/* Ends every live sequence with an error event after the engine failed. */
static void fail_all(cs_sched *s, const char *why) {
    seq **lists[] = {&s->running, &s->waiting, &s->remote};
    for (int i = 0; i < 3; i++)
        for (seq *q = *lists[i]; q; q = q->next)
            error_event(s, q, CS_EIO, why);
    for (int i = 0; i < 3; i++)
        free_list(s, lists[i]);
    s->n_waiting = s->n_running = s->n_remote = s->n_kv_ready = 0;
}

/* Tokens of a prompt with left to compute that go into this step. */
static int32_t chunk_len(const cs_sched *s, int32_t left, int32_t room) {
    int32_t k = left < room ? left : room;
    return s->p.max_chunk_tokens && k > s->p.max_chunk_tokens ? s->p.max_chunk_tokens : k;
}

/* At most k tokens of q's next chunk, as many as its pages could ever hold:
 * with windowed layers a chunk's windowed pages grow with its length (every
 * position is written, then given back), so a long prompt in one chunk may
 * not fit a pool that holds it in smaller ones. Without windows a chunk
 * always fits (cs_sched_add checked the whole prompt). */
static int32_t fit_chunk(const cs_sched *s, const seq *q, int32_t k, int32_t room) {
    if (cs_page_table_need(&q->pt, s->kv, q->n_computed, q->n_computed + k) <= room) return k;
    int32_t lo = 0, hi = k; /* lo fits, hi does not */
    while (hi - lo > 1) {
        int32_t mid = lo + (hi - lo) / 2;
        if (cs_page_table_need(&q->pt, s->kv, q->n_computed, q->n_computed + mid) <= room)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

static int32_t pool_chunk(const cs_sched *s, const seq *q, int32_t k) {
    return fit_chunk(s, q, k, cs_kv_cache_n_pages(s->kv) - cs_page_table_held(&q->pt, s->kv));
}

/* What the spans scheduled so far cost the step (the step model's features). */
typedef struct {
    int32_t tokens, rows;
    double pairs;
} step_work;

static void work_add(step_work *w, int32_t start, int32_t k, int32_t rows) {
    w->tokens += k;
    w->pairs += (double)k * ((double)start + (double)(k + 1) / 2);
    w->rows += rows;
}

/* The logits rows of a chunk of k tokens of q (add_span's n_logits): its
 * prompt-logprob rows, and the sampling row when it ends the context. */
static int32_t chunk_rows(const seq *q, int32_t k) {
    return plp_rows(q, k) + (q->n_computed + k == q->n_tokens);
}

static double predict(const cs_sched *s, const step_work *w, const seq *q, int32_t k) {
    step_work t = *w;
    work_add(&t, q->n_computed, k, chunk_rows(q, k));
    return cs_step_model_predict(&s->model, t.tokens, t.pairs, t.rows);
}

/* With a step-time target: the longest chunk of q, at most k tokens, that
 * keeps the step's predicted time within it (page-aligned unless it ends
 * the prompt); 0 when none fits and the step already has a chunk. */
static int32_t timed_chunk(const cs_sched *s, const seq *q, int32_t k, const step_work *w,
                           bool has_chunk) {
    if (s->p.step_time_target_ms <= 0) return k;
    if (!cs_step_model_ready(&s->model)) return k < s->probe ? k : s->probe;
    double target = s->p.step_time_target_ms / 1e3;
    if (predict(s, w, q, k) <= target) return k;
    int32_t lo = 0, hi = k; /* predict(lo) fits (lo = 0: nothing), predict(hi) does not */
    while (hi - lo > 1) {
        int32_t mid = lo + (hi - lo) / 2;
        if (predict(s, w, q, mid) <= target)
            lo = mid;
        else
            hi = mid;
    }
    if (lo > s->page_size) lo -= lo % s->page_size;
    if (lo == 0 && !has_chunk) lo = k < s->page_size ? k : s->page_size;
    return lo;
}

/* A step of m of the queue's tokens beside the decodes, by L's model. Its
 * chunks start, on average, half a chunk before the queued tokens' mean
 * position (L->position is set so): a queue of prompts not yet begun costs
 * the attention of their whole length, not of their first chunks (a flood
 * of 3,000-token prompts read at where their next chunks start was
 * predicted at half its time). */
static double queue_step_s(cs_ttft_load *L, double mean, double m) {
    L->position = mean > m / 2 ? mean - m / 2 : 0;
    return cs_ttft_step_s(L, m, 0);
}

/* The queue and the step costs for cs_ttft_predict: prompt work by
 * (priority, tenant), the running decodes' work, the step model's fit
 * scaled by recent overrun, and how many prompt tokens a step takes beside
 * the decodes: under the step-time target the longest chunk the model fits
 * in it (at least a page: a step always gets one), else the token budget's
 * rest (the chunk limits applied). */
void cs_sched_ttft_load(const cs_sched *s, cs_ttft_load *L) {
    memset(L, 0, sizeof *L);
    double todo = 0, at = 0; /* queued prompt tokens, and their positions summed */
    const seq *lists[2] = {s->running, s->waiting};
    for (int i = 0; i < 2; i++)
        for (const seq *q = lists[i]; q; q = q->next) {
            int32_t rem = q->n_tokens - q->n_computed;
            if (rem == 1 && i == 0) {
                L->dec_tokens += 1;
                L->dec_pairs += q->n_computed + 1;
                L->dec_rows += 1;
            } else if (rem > 1) {
                cs_ttft_load_add(L, q->priority, q->tn->name, q->tn->weight, rem);
                todo += rem;
                at += (double)rem * (q->n_computed + rem / 2.0); /* its tokens' mean position */
            }
        }
    if (!cs_step_model_ready(&s->model)) {
        /* steps of one size (a prefill pool of like prompts) never fit the model: the
         * measured rate stands for the capacity, and nothing is predicted */
        L->prompt_tokens_per_s = s->prompt_rate;
        return;
    }
    L->ready = true;
    cs_step_model_coefficients(&s->model, L->w);
    for (int k = 0; k < CS_STEP_MODEL_FEATURES; k++)
        L->w[k] *= s->overrun;
    const double mean = todo > 0 ? at / todo : 0; /* the queued tokens' mean position */
    int32_t c =
        (s->p.max_num_batched_tokens ? s->p.max_num_batched_tokens : 8192) - (int32_t)L->dec_tokens;
    if (s->p.max_chunk_tokens > 0 && s->p.max_num_partial_prefills > 0 &&
        c > s->p.max_chunk_tokens * s->p.max_num_partial_prefills)
        c = s->p.max_chunk_tokens * s->p.max_num_partial_prefills;
    if (c < s->page_size) c = s->page_size;
    const double target = s->p.step_time_target_ms / 1e3 * s->overrun;
    if (target > 0 && queue_step_s(L, mean, c) > target) {
        int32_t lo = 0, hi = c; /* lo fits (or is 0), hi does not */
        while (hi - lo > 1) {
            int32_t m = lo + (hi - lo) / 2;
            if (queue_step_s(L, mean, m) <= target)
                lo = m;
            else
                hi = m;
        }
        c = lo > s->page_size ? lo : s->page_size;
    }
    L->chunk_tokens = c;
    double step = queue_step_s(L, mean, c); /* and L->position for chunks of c */
    L->prompt_tokens_per_s = step > 0 ? c / step : 0;
    /* decode capacity: n sequences of the mean context in one step under the
     * step-time target (the ITL target); without one it is not defined */
    if (!(target > 0)) return;
    const double ctx = L->dec_tokens > 0 ? L->dec_pairs / L->dec_tokens : 1024;
    double n = s->p.max_num_seqs > 0 ? s->p.max_num_seqs : 256;
    int32_t per_seq = cs_kv_cache_seq_pages(s->kv, (int32_t)(ctx < 1e9 ? ctx : 1e9) + 1);
    double fit = (double)cs_kv_cache_n_pages(s->kv) / (per_seq > 0 ? per_seq : 1);
    if (fit < n) n = fit > 1 ? floor(fit) : 1;
#define DECODES(k) cs_step_model_eval(L->w, (k), (k)*ctx, (k))
    if (DECODES(n) > target) {
        double lo = 1, hi = n; /* lo fits (or is the least), hi does not */
        while (hi - lo > 1) {
            double m = floor((lo + hi) / 2);
            if (DECODES(m) <= target)
                lo = m;
            else
                hi = m;
        }
        n = lo;
    }
    double dstep = DECODES(n);
#undef DECODES
    L->decode_tokens_per_s = dstep > 0 ? n / dstep : 0;
}

/* ------------------------------------------------------ speculation -- */

/* Prompt lookup: the tokens that followed the latest earlier occurrence of
 * q's last n tokens, for the longest n (CS_SCHED_NGRAM_MAX down to
 * CS_SCHED_NGRAM_MIN) that occurs; at most max of them, written after q's
 * tokens (q->tokens has room: the caller checked). How many. */
static int32_t ngram_draft(seq *q, int32_t max) {
    const int32_t *t = q->tokens, n_tok = q->n_tokens;
    for (int32_t n = CS_SCHED_NGRAM_MAX; n >= CS_SCHED_NGRAM_MIN; n--) {
        if (n_tok <= n) continue;
        const int32_t *tail = t + n_tok - n;
        for (int32_t i = n_tok - n - 1; i >= 0; i--) { /* followed by a token: i + n < n_tok */
            if (memcmp(t + i, tail, (size_t)n * sizeof *t) != 0) continue;
            int32_t k = n_tok - (i + n) < max ? n_tok - (i + n) : max;
            memmove(q->tokens + n_tok, t + i + n, (size_t)k * sizeof *t);
            return k;
        }
    }
    return 0;
}

/* Drafted tokens expected to be kept out of d, each kept with probability a
 * once the ones before it were: a + a^2 + ... + a^d. */
static double kept_of(double a, int32_t d) {
    double e = 0, p = 1;
    for (int32_t i = 0; i < d; i++)
        e += (p *= a);
    return e;
}

/* What the drafts chosen so far this step cost beyond the target's rows: a
 * draft model's passes (pass_s each, one a step for the most drafts a
 * sequence gets). Prompt lookup costs nothing. A sequence's catch-up is not
 * weighed: it is paid once, like a prompt chunk, not for these drafts. */
typedef struct {
    double pass_s, token_s;
    int32_t passes;
} draft_cost;

/* How many of d drafts q gets. With speculative_always, or until the step
 * model is ready, all (add_drafts bounds the unready case). In a gated
 * step (all: prompt lookup, decodes alone, as many as the gate measures),
 * all that fit the step-time target, none when q's acceptance is under
 * CS__SPEC_FLOOR: the gate measures whether that pays (a linear fit cannot
 * see that a few drafts pay a tile's jump for little where many pay it
 * well). Else the count that maximizes the step's expected decode tokens
 * per predicted second (a draft model's passes counted), 0 when no count
 * beats none; within the step-time target. *expect (the step's expected
 * decode tokens) grows by the count's kept tokens, *c by its passes. */
#define CS__SPEC_FLOOR 0.3f
static int32_t draft_count(const cs_sched *s, const step_work *w, const seq *q, int32_t d,
                           bool all, double *expect, draft_cost *c) {
    const double a = q->spec_rate;
    int32_t best_d = d;
    if (all && !s->p.speculative_always && cs_step_model_ready(&s->model)) {
        const double target = s->p.step_time_target_ms / 1e3;
        const int32_t want = a < CS__SPEC_FLOOR ? 0 : d;
        for (best_d = 0; best_d < want; best_d++) {
            const int32_t k = best_d + 1;
            step_work t = *w;
            work_add(&t, q->n_computed + 1, k, k);
            double tk = cs_step_model_predict(&s->model, t.tokens, t.pairs, t.rows);
            if (target > 0 && tk > target) break;
        }
    } else if (!s->p.speculative_always && cs_step_model_ready(&s->model)) {
        const double target = s->p.step_time_target_ms / 1e3;
        double t0 = cs_step_model_predict(&s->model, w->tokens, w->pairs, w->rows);
        t0 += c->passes * c->pass_s;
        double best = t0 > 0 ? *expect / t0 : 0;
        best_d = 0;
        for (int32_t k = 1; k <= d; k++) {
            step_work t = *w;
            work_add(&t, q->n_computed + 1, k, k);
            double tk = cs_step_model_predict(&s->model, t.tokens, t.pairs, t.rows);
            tk += (k > c->passes ? k : c->passes) * c->pass_s;
            if (target > 0 && tk > target) break;
            double v = tk > 0 ? (*expect + kept_of(a, k)) / tk : 0;
            if (v > best) best = v, best_d = k;
        }
    }
    if (best_d > c->passes) c->passes = best_d;
    *expect += kept_of(a, best_d);
    return best_d;
}

/* q's drafts do not pay at its acceptance rate: the rate drifts back toward
 * the prior, slowly (about 70 decodes from break-even at 0.4 to 0.36's
 * recovery), so a sequence whose answer turns predictable drafts again. */
static void reprobe(seq *q) {
    if (q->spec_rate < 0.5f) q->spec_rate += 0.005f * (0.5f - q->spec_rate);
}

/* Span i (a decode of q) verifies the d drafts after its decode token:
 * pages for them (what is free now, never by preempting: fewer when short),
 * its rows, the work and the tenant's count. How many it got. */
static int32_t take_drafts(cs_sched *s, step_work *work, int32_t i, int32_t d) {
    seq *q = s->owners[i];
    if (d > 0 && cs_page_table_reserve(&q->pt, s->kv, q->n_computed, q->n_tokens + d) != 0) {
        int32_t fit = q->pt.n_pages * s->page_size - q->n_tokens;
        d = fit < d ? fit : d;
    }
    cs_span *sp = &s->spans[i];
    sp->pages = q->pt.pages; /* a reservation may have moved them, drafts or not */
    sp->n_pages = q->pt.n_pages;
    sp->stride = q->pt.cap;
    if (d <= 0) return 0;
    work_add(work, q->n_computed + 1, d, d);
    charge(q, d);
    sp->n_tokens = 1 + d;
    sp->n_logits = 1 + d;
    s->drafts[i] = d;
    return d;
}

/* Step pass 3: drafts for the step's decodes (spans [0, n_decode)), within
 * room tokens (a draft model's catch-up too); all: a gated step (prompt
 * lookup only), where every sequence not under the acceptance floor
 * drafts what it found (draft_count). A span with d drafts computes its decode token and the d
 * drafted after it, one logits row each. Returns the drafted tokens
 * added. */
static int32_t add_drafts(cs_sched *s, step_work *work, int32_t room, bool all) {
    int32_t added = 0;
    double expect = s->last.n_decode;
    /* Until the step model is ready nothing weighs a draft's cost: a step
     * carries at most one sequence's worth of drafts (num_speculative_tokens)
     * or as many drafts as decodes, whichever is more. On a busy CPU, every
     * sequence's drafts could multiply the step's time for tokens that are
     * not kept; this much doubles a decode step's tokens at most, enough
     * spread for the model to be fitted (cs_step_model_ready). */
    const int32_t probe = s->p.num_speculative_tokens > s->last.n_decode
                              ? s->p.num_speculative_tokens
                              : s->last.n_decode;
    const int32_t tokens_room = room; /* a draft model's catch-up is not a draft: not probed */
    if (!s->p.speculative_always && !cs_step_model_ready(&s->model) && room > probe) room = probe;
    draft_cost cost = {0};
    if (s->drafter) {
        cost.pass_s = cs__drafter_pass_seconds(s->drafter);
        cost.token_s = cs__drafter_token_seconds(s->drafter);
    }
    /* a draft model's plan: its choices weighed on a copy of the work (the
     * work gets what the drafts turn out to be) */
    step_work plan = *work;
    int32_t n_jobs = 0;
    for (int32_t i = 0; i < s->last.n_decode && added < room; i++) {
        seq *q = s->owners[i];
        /* a real decode: a token was sampled already (not a prompt's last
         * token, whose span may carry prompt logprobs or report pages) */
        if (q->no_drafts || q->kv_mode == CS_KV_PREFILL_ONLY || q->n_tokens <= q->n_context)
            continue;
        int32_t max = s->p.num_speculative_tokens;
        if (max > room - added) max = room - added;
        /* room in its tokens for the drafts and the token sampled after them */
        if (max > q->cap - q->n_tokens - 1) max = q->cap - q->n_tokens - 1;
        if (max <= 0) continue;
        if (!s->drafter) {
            int32_t d = ngram_draft(q, max);
            if (d > 0 && (d = draft_count(s, work, q, d, all, &expect, &cost)) == 0) reprobe(q);
            added += take_drafts(s, work, i, d);
            continue;
        }
        if (q->n_tokens >= cs__drafter_ctx_len(s->drafter)) continue; /* past its context */
        int32_t d = draft_count(s, &plan, q, max, false, &expect, &cost); /* not gated */
        if (d <= 0) {
            reprobe(q);
            continue;
        }
        work_add(&plan, q->n_computed + 1, d, d);
        s->jobs[n_jobs++] = (cs__draft_job){
            .ds = &q->ds, .tokens = q->tokens, .n_tokens = q->n_tokens, .want = d, .smp = q->smp};
        s->job_span[n_jobs - 1] = i;
        added += d;
    }
    if (n_jobs == 0) return added;
    /* the catch-up (draft model tokens, not the target's budget): the room
     * left, and within the step-time target what its predicted time leaves
     * (until the draft's per-token time is measured, a page: the first
     * catch-up of a long context would otherwise take the whole room, far
     * past the target); a page at least, so it progresses */
    int32_t catchup = tokens_room - added;
    const double target = s->p.step_time_target_ms / 1e3;
    if (target > 0 && cost.token_s <= 0) {
        catchup = s->page_size;
    } else if (target > 0 && cs_step_model_ready(&s->model)) {
        double left = target -
                      cs_step_model_predict(&s->model, plan.tokens, plan.pairs, plan.rows) -
                      cost.passes * cost.pass_s;
        double fit = left > 0 ? left / cost.token_s : 0;
        if (fit < catchup) catchup = (int32_t)fit;
    }
    if (catchup < s->page_size) catchup = s->page_size;
    if (cs__drafter_run(s->drafter, s->jobs, n_jobs, catchup, &s->last.draft_seconds) != 0) {
        CS_LOGE("speculation: no drafts this step: %s", cs_last_error());
        for (int32_t j = 0; j < n_jobs; j++)
            s->jobs[j].got = 0;
    }
    added = 0;
    for (int32_t j = 0; j < n_jobs; j++) {
        const cs__draft_job *jb = &s->jobs[j];
        int32_t i = s->job_span[j], d = take_drafts(s, work, i, jb->got);
        /* fewer checked than drafted: the draft KV past the decode token's
         * is of drafts the target will not check (and a check never rolls
         * back before it) */
        if (d < jb->got) cs__draft_seq_settle(s->drafter, jb->ds, s->owners[i]->n_tokens);
        added += d;
    }
    return added;
}

static void sample_range(void *arg, int64_t begin, int64_t end, int range) {
    (void)range;
    const cs_sched *s = arg;
    for (int64_t i = begin; i < end; i++) {
        sample *x = &s->samples[s->sampling[i]];
        if (x->failed) continue;
        x->id = cs_sampler_sample_allowed(x->q->smp, x->row, x->allow, x->q->top_logprobs,
                                          x->q->logprobs ? &x->lp : NULL);
    }
}

/* Draws the step's samples (every span that ends at its sequence's last
 * token, not a speculating one: verify draws those in order) on the
 * engine's threads: each sequence's sampler is its own, so the tokens are
 * those of one after the other; the events follow in span order. The
 * structured outputs' masks are taken first, here. */
static void draw_samples(cs_sched *s, int32_t n_spans) {
    int32_t row = 0, n = 0;
    for (int32_t i = 0; i < n_spans; i++) {
        const cs_span *sp = &s->spans[i];
        sample *x = &s->samples[i];
        *x = (sample){0};
        row += sp->n_logits;
        seq *q = s->owners[i];
        if (s->drafts[i] > 0 || q->n_computed + sp->n_tokens != q->n_tokens) continue;
        x->q = q;
        x->row = s->logits + (size_t)(row - 1) * s->n_vocab;
        x->failed = q->gm && cs_matcher_mask(q->gm, &x->allow) < 0;
        s->sampling[n++] = i;
    }
    if (n > 1)
        cs_engine_parallel_for(s->e, n, sample_range, s);
    else
        sample_range(s, 0, n, 0);
}

/* Checks span i's drafts (speculation in sched.h): samples its rows in order
 * with the sequence's own sampler (and structured output), keeps drafted
 * tokens while they equal the sample, and emits every sampled token up to
 * and including the first that differs. Advances *li past its rows. */
static int verify(cs_sched *s, int32_t i, int32_t *li) {
    seq *q = s->owners[i];
    const int32_t d = s->drafts[i], row0 = *li;
    int32_t kept = 0;
    bool ended = false, rejected = false;
    int r = 0;
    *li += d + 1;
    s->owners[i] = NULL;
    for (int32_t j = 0; j <= d && !ended && !rejected; j++) {
        /* every token so far has KV now: the decode token and the drafts kept */
        q->n_computed = q->n_tokens;
        settle_pages(s, q);
        const uint32_t *allow = NULL;
        if (q->gm && cs_matcher_mask(q->gm, &allow) < 0) {
            end_in_error(s, q, CS_ENOMEM, "out of memory for the structured output's mask");
            ended = true;
            break;
        }
        const int32_t draft = j < d ? q->tokens[q->n_tokens] : -1;
        cs_logprobs lp;
        int32_t id = cs_sampler_sample_allowed(q->smp, s->logits + (size_t)(row0 + j) * s->n_vocab,
                                               allow, q->top_logprobs, q->logprobs ? &lp : NULL);
        if (id == draft) kept++;
        rejected = j < d && id != draft;
        if ((r = emit_token(s, q, id, &lp, NULL, 0, 0, &ended))) return r;
    }
    s->st.spec_drafts++;
    s->st.spec_draft_tokens += (uint64_t)d;
    s->st.spec_accepted_tokens += (uint64_t)kept;
    /* the draft KV past the tokens kept was computed from rejected drafts */
    if (!ended && s->drafter) cs__draft_seq_settle(s->drafter, &q->ds, q->n_computed);
    /* each kept draft a success, a rejection one failure */
    for (int32_t j = 0; j < kept; j++)
        s->spec_prior += 0.01f * (1 - s->spec_prior);
    if (rejected) s->spec_prior -= 0.01f * s->spec_prior;
    if (!ended) {
        for (int32_t j = 0; j < kept; j++)
            q->spec_rate += 0.1f * (1 - q->spec_rate);
        if (rejected) q->spec_rate -= 0.1f * q->spec_rate;
    }
    return 0;
}

/* Priority: while the best waiting request outranks the worst running one
 * (not held) and finds no seat (max_num_seqs) or no pages for its first
 * chunk, that running one is preempted (it resumes later, exactly, from its
 * tokens). Equal priorities never preempt each other: arrival order holds. */
static void make_room_by_priority(cs_sched *s, int32_t budget) {
    for (seq *w = s->waiting; w;) {
        seq **worst = NULL;
        for (seq **l = &s->running; *l; l = &(*l)->next)
            if (!is_held(*l)) worst = l;
        if (!worst || (*worst)->priority <= w->priority) return;
        int32_t k = pool_chunk(s, w, chunk_len(s, w->n_tokens - w->n_computed, budget));
        int32_t need = cs_page_table_need(&w->pt, s->kv, w->n_computed, w->n_computed + k);
        bool seat = s->n_running < s->p.max_num_seqs;
        bool pages = cs_kv_cache_n_free(s->kv) + cs_kv_cache_n_cached(s->kv) >= need;
        if (seat && pages) return;
        preempt(s, worst);
        s->st.priority_preemptions++;
    }
}

/* Tenant a is due before b: fewer virtual tokens; at equal counts the one
 * that became active later (it joined at the least of the active ones:
 * none of their busy period was served to it, so it goes first once). */
static bool tenant_before(const tenant *a, const tenant *b) {
    return a->vtokens < b->vtokens || (a->vtokens == b->vtokens && a->joined > b->joined);
}

/* Where a chunk of prompt work is due: its tenant's virtual tokens once
 * the chunk the work would get now (room tokens of the budget left, the
 * step's work so far w) is charged. Chunks go by this virtual finish
 * (weighted fair queueing), not by the tenant's count before the chunk: by
 * that, a tenant's short prompts arriving together would each wait for
 * another tenant's whole chunk once the first of them put their tenant a
 * few tokens ahead (one prompt a step). By finish they go first until
 * their tenant is a chunk ahead, as a fluid share of the step serves them
 * (and as cs_ttft_predict counts). Over many steps the shares are the
 * same. */
typedef struct {
    int32_t room;
    const step_work *w;
    bool has_chunk;
} chunk_room;

/* (A waiting prompt is costed before its cached prefix is taken: as a
 * whole chunk. A chunk that gets no tokens now is due last.) */
static double finish_of(const cs_sched *s, const seq *q, const chunk_room *c) {
    int32_t k = chunk_len(s, q->n_tokens - q->n_computed, c->room);
    k = timed_chunk(s, q, pool_chunk(s, q, k), c->w, c->has_chunk);
    return k > 0 ? q->tn->vtokens + k / q->tn->weight : INFINITY;
}

/* Whether q is its tenant's candidate in this pass (s->pass): the first of
 * its prompts seen at its priority (the lists are in priority, then
 * arrival order; running ones are seen before waiting ones), so a tenant's
 * prompts go in list order. Marks it. */
static bool tenant_candidate(const cs_sched *s, const seq *q) {
    tenant *t = q->tn;
    if (t->pass == s->pass && t->pass_priority <= q->priority) return false;
    t->pass = s->pass;
    t->pass_priority = q->priority;
    return true;
}

/* Whether prompt work a (virtual finish fa) is due before b (fb): by
 * priority, then finish, then tenant_before; false for one tenant's two
 * (list order then: running before waiting, older before newer). */
static bool due_before(const seq *a, double fa, const seq *b, double fb) {
    if (a->priority != b->priority) return a->priority < b->priority;
    if (a->tn == b->tn) return false;
    if (fa != fb) return fa < fb;
    return tenant_before(a->tn, b->tn);
}

/* The running prompt next due a chunk this step: part-way through, not held,
 * not yet tried this step; of each tenant's first such (tenant_candidate),
 * the first by due_before (its finish in *f). Call before next_waiting, in
 * the same pass. */
static seq *next_partial(const cs_sched *s, const chunk_room *c, double *f) {
    seq *best = NULL;
    for (seq *q = s->running; q; q = q->next) {
        if (q->n_tokens - q->n_computed <= 1 || is_held(q) || q->chunk_stamp == s->stamp) continue;
        if (best && q->priority > best->priority) continue;
        if (!tenant_candidate(s, q)) continue;
        double fq = finish_of(s, q, c);
        if (!best || due_before(q, fq, best, *f)) best = q, *f = fq;
    }
    return best;
}

/* The waiting request next in line: of the best priority waiting, each
 * tenant's oldest, unless the tenant has a running prompt due a chunk at
 * that priority (tenant_candidate: running first); of those, the first by
 * due_before (its finish in *f). A tenant whose count is already past the
 * best finish cannot be due first: not costed. */
static seq *next_waiting(const cs_sched *s, const chunk_room *c, double *f) {
    seq *best = NULL;
    for (seq *q = s->waiting; q; q = q->next) {
        if (best && q->priority != best->priority) break;
        if (best && q->tn->vtokens > *f) continue;
        if (!tenant_candidate(s, q)) continue;
        double fq = finish_of(s, q, c);
        if (!best || due_before(q, fq, best, *f)) best = q, *f = fq;
    }
    return best;
}

static void unlink_waiting(cs_sched *s, seq *q) {
    seq **l = &s->waiting;
    while (*l != q)
        l = &(*l)->next;
    *l = q->next;
    s->n_waiting--;
}

/* Whether waiting q (its chunk due at virtual finish fq) may take a prompt
 * seat, partial seats being taken: below max_num_partial_prefills, yes;
 * beyond it, when it goes before every running sequence part-way through
 * its prompt, by a better priority (any number of seats: priority preempts
 * anyway), or by due_before (one seat beyond the cap in all, so a tenant's
 * flood of prompts holding every seat does not keep the others out, and
 * requests naming ever new tenants cannot open seats without end). A
 * prompt whose last chunk this step computes holds no seat; one that had
 * its chunk this step is due at its count now. */
static bool may_take_seat(const cs_sched *s, const seq *q, double fq, int32_t partial,
                          const chunk_room *c) {
    if (partial < s->p.max_num_partial_prefills) return true;
    bool by_priority = true, fairly = partial == s->p.max_num_partial_prefills;
    for (const seq *r = s->running; r; r = r->next) {
        if (r->n_tokens - r->n_computed <= 1 || is_held(r)) continue;
        bool chunked = r->chunk_stamp == s->stamp;
        if (chunked && r->n_computed + r->step_k >= r->n_tokens) continue;
        by_priority = by_priority && q->priority < r->priority;
        fairly = fairly && due_before(q, fq, r, chunked ? r->tn->vtokens : finish_of(s, r, c));
    }
    return by_priority || fairly;
}

int cs_sched_step(cs_sched *s, const cs_event **events, int32_t *n_events) {
    free_texts(s);
    free_list(s, &s->retired); /* their pages were reported by the last step */
    *events = s->events;
    *n_events = 0;
    memset(&s->last, 0, sizeof s->last);
    s->stamp++;
    if (cs_sched_idle(s)) return 0;
    int r = grow_scratch(s, s->n_running + s->n_waiting + s->n_remote);
    if (r) return r;
    *events = s->events; /* after grow_scratch: it may move them */
    if ((r = join_ready(s))) return r;
    *n_events = s->n_events;
    if (!s->waiting && !s->running) return 0;
    int32_t budget = s->p.max_num_batched_tokens ? s->p.max_num_batched_tokens : INT32_MAX,
            used = 0, n_spans = 0;
    s->last.budget = budget;
    step_work work = {0};
    make_room_by_priority(s, budget);

    /* 1. one token for every running decode, oldest first; a decode that
     * finds no page preempts the newest running sequence */
    for (seq **l = &s->running; *l;) {
        seq *q = *l;
        if (q->n_tokens - q->n_computed != 1) {
            l = &q->next;
            continue;
        }
        s->last.n_running_decodes++;
        if (used >= budget) {
            l = &q->next;
            continue;
        }
        /* Sequences after q in the list are newer and not scheduled yet, so
         * the newest running one never holds pages this step already uses. */
        while ((r = cs_page_table_reserve(&q->pt, s->kv, q->n_computed, q->n_tokens)) ==
               CS_ENOSPC) {
            seq **newest = &s->running;
            while ((*newest)->next)
                newest = &(*newest)->next;
            bool self = *newest == q;
            preempt(s, newest);
            s->last.n_running_decodes -= self;
            if (self) break;
        }
        if (r == CS_ENOSPC || *l != q) { /* q itself was preempted, or nothing could be freed */
            if (*l == q) l = &q->next;
            continue;
        }
        if (r) return r;
        work_add(&work, q->n_computed, 1, 1);
        add_span(s, &n_spans, q, 1);
        charge(q, 1);
        used++;
        l = &q->next;
    }
    s->last.n_decode = n_spans;

    /* 2. prompt chunks, in the scheduler's order (priority, then the
     * tenant's virtual finish, then arrival: next_partial, next_waiting,
     * due_before) over running sequences
     * part-way through their prompt and waiting ones,
     * while budget, seats and pages last; a waiting one that cannot start
     * now stops the waiting queue (no overtaking within the order) */
    int32_t partial = 0;
    for (seq *q = s->running; q; q = q->next)
        if (q->n_tokens - q->n_computed > 1 && !is_held(q)) partial++; /* held: no seat */
    int32_t plp_room = CS_SCHED_PROMPT_LOGPROB_ROWS;
    bool waiting_open = true, starved = false; /* starved: a running prompt found no pages */
    while (used < budget) {
        const chunk_room room = {budget - used, &work, n_spans > s->last.n_decode};
        double frq = 0, fq = 0;
        s->pass++;
        seq *rq = next_partial(s, &room, &frq);
        seq *q = waiting_open ? next_waiting(s, &room, &fq) : NULL;
        if (q && s->n_running >= s->p.max_num_seqs) q = NULL;
        if (q && !may_take_seat(s, q, fq, partial, &room)) q = NULL;
        if (q && rq && !due_before(q, fq, rq, frq)) q = NULL; /* the running one's chunk first */
        if (!q && !rq) break;
        if (!q) { /* the running one's next chunk */
            q = rq;
            q->chunk_stamp = s->stamp;
            int32_t left = q->n_tokens - q->n_computed;
            int32_t k = timed_chunk(s, q, pool_chunk(s, q, chunk_len(s, left, budget - used)),
                                    &work, n_spans > s->last.n_decode);
            if (k == 0) break;
            if ((k = plp_cap(q, k, plp_room)) == 0) continue;
            if (cs_page_table_reserve(&q->pt, s->kv, q->n_computed, q->n_computed + k) != 0) {
                /* as much as the free (and cached) pages hold now */
                k = fit_chunk(s, q, k, cs_kv_cache_n_free(s->kv) + cs_kv_cache_n_cached(s->kv));
                if (k == 0 ||
                    cs_page_table_reserve(&q->pt, s->kv, q->n_computed, q->n_computed + k) != 0) {
                    starved = true;
                    continue;
                }
            }
            plp_room -= plp_rows(q, k);
            work_add(&work, q->n_computed, k, chunk_rows(q, k));
            add_span(s, &n_spans, q, k);
            charge(q, k);
            used += k;
            continue;
        }
        reuse_prefix(s, q);
        int32_t left = q->n_tokens - q->n_computed;
        int32_t k = timed_chunk(s, q, pool_chunk(s, q, chunk_len(s, left, budget - used)), &work,
                                n_spans > s->last.n_decode);
        k = plp_cap(q, k, plp_room);
        if (k == 0 || cs_page_table_reserve(&q->pt, s->kv, q->n_computed, q->n_computed + k) != 0) {
            /* no time, or not enough pages now: give back the prefix and wait */
            cs_page_table_release(&q->pt, s->kv);
            q->n_computed = q->n_hashed = 0;
            q->last_hash = q->hash_root;
            waiting_open = false;
            if (k == 0) break;
            continue;
        }
        plp_room -= plp_rows(q, k);
        unlink_waiting(s, q);
        q->chunk_stamp = s->stamp;
        s->st.prefix_hit_tokens += (uint64_t)q->n_computed;
        if (!q->admitted) q->n_cached = q->n_computed, q->admitted = true;
        q->running = true;
        insert_ordered(&s->running, q);
        s->n_running++;
        work_add(&work, q->n_computed, k, chunk_rows(q, k));
        add_span(s, &n_spans, q, k);
        charge(q, k);
        used += k;
        if (q->n_computed + k < q->n_tokens) partial++;
    }
    s->last.n_prefill = n_spans - s->last.n_decode;
    /* Nothing could run because running prompts (two or more, not held) each
     * found no page for even a token of their next chunk (admitted part-way
     * side by side, no decode to preempt for): the newest of them gives its
     * pages back, so the others finish. */
    if (n_spans == 0 && starved) {
        seq **newest = NULL;
        int32_t n_prompts = 0;
        for (seq **l = &s->running; *l; l = &(*l)->next)
            if ((*l)->n_tokens - (*l)->n_computed > 1 && !is_held(*l)) newest = l, n_prompts++;
        if (n_prompts >= 2) preempt(s, newest);
    }

    /* 3. speculation: drafts for the decodes, in the budget that is left
     * (at most CS_SCHED_DRAFT_ROWS: they are logits rows too) */
    /* prompt lookup's drafts are gated once the step model is fitted (before,
     * the probe bounds them); a draft model's are not: after plain steps its
     * KV lags, and the catch-up would be charged to the drafting side */
    const bool gated = s->p.num_speculative_tokens > 0 && !s->drafter &&
                       !s->p.speculative_always && cs_step_model_ready(&s->model);
    if (s->p.num_speculative_tokens > 0 && s->last.n_decode > 0 && used < budget &&
        (!gated || cs__spec_gate_allows(&s->gate, s->last.n_decode, s->last.n_prefill == 0))) {
        int32_t room = budget - used < CS_SCHED_DRAFT_ROWS ? budget - used : CS_SCHED_DRAFT_ROWS;
        int32_t added = add_drafts(s, &work, room,
                                   gated && s->last.n_prefill == 0 &&
                                       s->last.n_decode >= CS__SPEC_GATE_MIN_DECODES);
        s->last.n_draft_tokens = added;
        used += added;
        /* an event per emitted token: up to one more per draft than the two
         * per live sequence that grow_scratch keeps room for */
        r = added ? grow_events(s, 2 * s->cap_spans + added) : 0;
        *events = s->events; /* it may have moved them */
        if (r) return r;
    }
    s->last.n_tokens = used;
    if (n_spans == 0) return 0; /* everything waits for pages or seats */

    /* 4. run it, then sample where a span reached the last known token */
    int32_t n_logits = 0;
    for (int32_t i = 0; i < n_spans; i++)
        n_logits += s->spans[i].n_logits;
    if ((r = grow_logits(s, n_logits))) return r;
    s->last.predicted_seconds =
        cs_step_model_ready(&s->model)
            ? cs_step_model_predict(&s->model, work.tokens, work.pairs, work.rows)
            : NAN;
    const uint64_t emitted0 = s->st.generated_tokens;
    double t0 = cs_now();
    r = cs_engine_step(s->e, s->spans, n_spans, s->logits);
    if (r) {
        CS_LOGE("scheduler: engine step failed: %s", cs_last_error());
        fail_all(s, "engine step failed");
        *events = s->events;
        *n_events = s->n_events;
        return r;
    }
    s->st.steps++;
    draw_samples(s, n_spans);
    int32_t li = 0;
    for (int32_t i = 0; i < n_spans; i++) {
        if (s->drafts[i] > 0) { /* a decode with drafts: its own rows */
            if ((r = verify(s, i, &li))) return r;
            continue;
        }
        seq *q = s->owners[i];
        const cs_span *sp = &s->spans[i];
        bool last = q->n_computed + sp->n_tokens == q->n_tokens;
        /* prompt logprobs: the rows before the sampling row, positions
         * [end - n_logits, ...) of the span */
        int32_t n_plp = sp->n_logits - last, p0 = q->n_computed + sp->n_tokens - sp->n_logits;
        for (int32_t j = 0; j < n_plp; j++, li++) {
            int32_t pos = p0 + j;
            CS_ASSERT(q->plp && pos == q->n_plp);
            cs_prompt_logprob_of(s->logits + (size_t)li * s->n_vocab, s->n_vocab,
                                 q->tokens[pos + 1], q->plp_top, &q->plp[pos]);
            q->n_plp = pos + 1;
        }
        if (q->n_computed < q->n_context)
            s->st.prompt_tokens_computed += (uint64_t)((sp->n_tokens < q->n_context - q->n_computed)
                                                           ? sp->n_tokens
                                                           : q->n_context - q->n_computed);
        q->n_computed += sp->n_tokens;
        settle_pages(s, q);
        /* PREFILL_ONLY: the pages of the blocks this step completed (the
         * partial last one once the whole context is computed), in the
         * transfer's order: first and n_new count pages of that order */
        int32_t first = 0, n_new = 0;
        if (q->kv_mode == CS_KV_PREFILL_ONLY) {
            int32_t done = q->n_computed >= q->n_context
                               ? (q->n_context + s->page_size - 1) / s->page_size
                               : q->n_computed / s->page_size;
            if (done > q->n_reported) {
                first = cs_kv_cache_xfer_index(s->kv, q->n_context, q->n_reported);
                n_new = cs_page_table_xfer(&q->pt, s->kv, q->n_context, q->n_reported, done,
                                           q->xfer + first);
                CS_ASSERT(n_new >= 0); /* the transfer's pages are never trimmed before */
                q->n_reported = done;
            }
        }
        if (!last) {
            if (n_new) {
                cs_event *ev = next_event(s, NULL);
                ev->id = q->id;
                ev->n_prompt_tokens = q->n_prompt;
                ev->n_cached_prompt_tokens = q->n_cached;
                ev->kv_pages = q->xfer + first;
                ev->kv_first_page = first;
                ev->kv_n_pages = n_new;
            }
            continue;
        }
        sample *x = &s->samples[i];
        CS_ASSERT(x->q == q);
        li++;
        if (x->failed) {
            end_in_error(s, q, CS_ENOMEM, "out of memory for the structured output's mask");
            s->owners[i] = NULL;
            continue;
        }
        if ((r = emit_token(s, q, x->id, &x->lp, n_new ? q->xfer + first : NULL, first, n_new,
                            NULL)))
            return r;
        s->owners[i] = NULL;
    }
    CS_ASSERT(li == n_logits);
    const double target_s = cs_now() - t0;
    cs_step_model_observe(&s->model, work.tokens, work.pairs, work.rows, target_s);
    s->last.seconds = target_s + s->last.draft_seconds;
    if (gated && s->last.n_prefill == 0) /* drafts paid? */
        cs__spec_gate_observe(&s->gate, s->last.n_decode, s->last.n_draft_tokens > 0,
                              (int32_t)(s->st.generated_tokens - emitted0), s->last.seconds);
    if (s->last.n_prefill > 0 && s->last.seconds > 0) {
        double x = (s->last.n_tokens - s->last.n_decode - s->last.n_draft_tokens) / s->last.seconds;
        s->prompt_rate = s->prompt_rate > 0 ? 0.9 * s->prompt_rate + 0.1 * x : x;
    }
    if (s->last.n_prefill > 0 && s->last.predicted_seconds > 0) {
        double x = target_s / s->last.predicted_seconds;
        s->overrun = 0.9 * s->overrun + 0.1 * (x < 0.25 ? 0.25 : x > 4 ? 4 : x);
    }
    /* Until the model is ready, probe chunks start at one page and double
     * while a step takes under half the target, halve when one overshoots:
     * a model of any size reaches its fit within about one step of the
     * target, the token counts spread for the fit (cs_step_model_ready) */
    if (s->p.step_time_target_ms > 0 && s->last.n_prefill > 0 && !cs_step_model_ready(&s->model)) {
        const double target = s->p.step_time_target_ms / 1e3;
        if (target_s < target / 2)
            s->probe = 2 * s->probe < CS_SCHED_PROBE_TOKENS ? 2 * s->probe : CS_SCHED_PROBE_TOKENS;
        else if (target_s > target && s->probe > s->page_size)
            s->probe /= 2;
    }
    *events = s->events; /* drafts may have grown them */
    *n_events = s->n_events;
    return 0;
}
