/* serve.c: the serving loop. Submissions and cancellations are queued under
 * a mutex and applied by the engine thread between steps, so the scheduler
 * and engine stay single-threaded. The thread sleeps on a condition variable
 * when there is nothing to do.
 *
 * A cancel allocates nothing, so memory pressure cannot lose one (and leak a
 * request's pages until its end): each request's record (live) is made at
 * submit and sits in sv->all, under the mutex, until its final event; a
 * cancel marks it there and the loop applies the marks after the batch.
 *
 * CHUNKSERVE_STEP_TRACE=FILE appends one CSV line per step (what it held,
 * how long it took, the step model's prediction, and the gap since the
 * previous step ended: time the engine spent outside steps), for finding
 * where latency goes (docs/perf.md). */
#include "chunkserve/serve.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/ttft.h"

#include "util.h"

typedef struct pending {
    cs_request r; /* with owned copies of prompt, stop strings, logit_bias, cache_salt, tenant and the
                     structured output's text or choices */
    char **stops;
    char *st_text, **st_choices;
    int32_t *stop_ids, *bias_ids;
    float *bias;
    cs_serve_cb cb;
    void *user;
    enum { P_SUBMIT, P_KV_READY } kind;
    struct live *lv;     /* P_SUBMIT: the request's record, made at submit */
    int32_t first_token; /* P_KV_READY, with first_lp when has_lp, and n_cached */
    int32_t n_cached;
    bool has_lp;
    cs_logprobs first_lp;
    struct pending *next;
} pending;

typedef struct live {
    uint64_t id;
    cs_serve_cb cb;
    void *user;
    struct live *next; /* sv->lives: applied, engine thread only */
    /* under sv->mu */
    struct live *all_next, **all_prev; /* sv->all: from submit to the final event */
    bool cancel;                       /* cs_serve_cancel asked for it */
    struct live *cancel_next;          /* the loop's list of marked ones */
} live;

struct cs_serve {
    cs_sched *sched;
    cs_engine *e;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pending *head, **tail;
    cs_serve_release *releases; /* cs_serve_kv_release's (under mu) */
    live *all;                  /* every request not yet ended, applied or not (under mu) */
    bool any_cancel;            /* some record in all is marked (under mu) */
    bool stopping;
    live *lives;          /* engine thread only */
    cs_sched_stats stats; /* under mu */
    cs_ttft_load load;    /* under mu: as of the last step (cs_serve_ttft_load) */
    double step_began;    /* under mu: when the running step began (0: none runs) */
    double step_expect;   /* under mu: its predicted seconds */
    double step_chunk;    /* under mu: the queued prompt tokens it computes */
    cs_ttft_load applying; /* under mu: the submissions of the batch being applied (taken
                              off the queue, not yet published) */
    cs_sched_params shares; /* the tenants' weights, copied (tenant_shares, n_tenant_shares) */
    FILE *trace;          /* CHUNKSERVE_STEP_TRACE (engine thread) */
    double trace_end;     /* when the last traced step ended */
    /* the prefix summary (cs_serve_prefix_summary_enable): the fields below are
     * set before sum_on is (release), read by the engine thread after it */
    _Atomic bool sum_on;
    double sum_interval; /* seconds between builds at most; 0 = off (fixed before any submit) */
    size_t sum_n_bits;
    uint8_t *sum_next;    /* engine thread: built here, then swapped with sum_pub */
    uint8_t *sum_pub;     /* under mu: the published summary */
    uint64_t sum_version; /* under mu: the cache version it shows (0: none yet) */
    double sum_behind;    /* under mu: when the cache first changed after it was built
                             (0: it has not; the summary is current) */
    uint64_t sum_built;   /* engine thread: the cache version last built, + 1 */
    double sum_last;      /* engine thread: when */
    bool sum_behind_set;  /* engine thread: sum_behind is set */
};

/* Rebuilds the prefix summary when the cache changed, at most every
 * sum_interval unless force (the engine goes idle: what it holds now is
 * what stays). Engine thread. */
static void update_summary(cs_serve *sv, bool force) {
    if (!atomic_load_explicit(&sv->sum_on, memory_order_acquire)) return;
    cs_kv_cache *kv = cs_engine_kv(sv->e);
    uint64_t v = cs_kv_cache_version(kv) + 1;
    double now = cs_now();
    if (v == sv->sum_built) return;
    if (!force && now - sv->sum_last < sv->sum_interval) {
        if (!sv->sum_behind_set) { /* readers learn how far behind the summary may be */
            pthread_mutex_lock(&sv->mu);
            sv->sum_behind = now;
            pthread_mutex_unlock(&sv->mu);
            sv->sum_behind_set = true;
        }
        return;
    }
    cs_kv_cache_summary(kv, sv->sum_next, sv->sum_n_bits);
    pthread_mutex_lock(&sv->mu);
    uint8_t *t = sv->sum_pub;
    sv->sum_pub = sv->sum_next;
    sv->sum_next = t;
    sv->sum_version = v;
    sv->sum_behind = 0;
    pthread_mutex_unlock(&sv->mu);
    sv->sum_built = v, sv->sum_last = now, sv->sum_behind_set = false;
}

static void trace_step(cs_serve *sv) {
    cs_step_info in;
    cs_sched_last_step(sv->sched, &in);
    if (in.n_tokens == 0) return;
    double end = cs_now(), start = end - in.seconds;
    fprintf(sv->trace, "%.6f,%.6f,%.6f,%.6f,%d,%d,%d,%d,%d,%d,%.6f\n", start, in.seconds,
            isnan(in.predicted_seconds) ? -1.0 : in.predicted_seconds,
            sv->trace_end > 0 ? start - sv->trace_end : 0.0, in.n_tokens, in.n_decode, in.n_prefill,
            in.n_running_decodes, in.budget == INT32_MAX ? 0 : in.budget, in.n_draft_tokens,
            in.draft_seconds);
    sv->trace_end = end;
}

static void pending_free(pending *p) {
    if (!p) return;
    for (size_t i = 0; p->stops && i < p->r.stop.n_stop; i++)
        free(p->stops[i]);
    free(p->stops);
    free(p->stop_ids);
    free(p->bias_ids);
    free(p->bias);
    free(p->st_text);
    for (int32_t i = 0; p->st_choices && i < p->r.structured.n_choices; i++)
        free(p->st_choices[i]);
    free(p->st_choices);
    free((void *)p->r.prompt);
    free((void *)p->r.cache_salt);
    free((void *)p->r.tenant);
    free(p->lv); /* a submit that never started (its record was unlinked) */
    free(p);
}

/* Under sv->mu. */
static void link_all(cs_serve *sv, live *x) {
    x->all_next = sv->all;
    x->all_prev = &sv->all;
    if (sv->all) sv->all->all_prev = &x->all_next;
    sv->all = x;
}

static void unlink_all(cs_serve *sv, live *x) {
    pthread_mutex_lock(&sv->mu);
    *x->all_prev = x->all_next;
    if (x->all_next) x->all_next->all_prev = x->all_prev;
    pthread_mutex_unlock(&sv->mu);
}

static live **find_live(cs_serve *sv, uint64_t id) {
    live **l = &sv->lives;
    while (*l && (*l)->id != id)
        l = &(*l)->next;
    return l;
}

static void finish_live(cs_serve *sv, live **l, const cs_event *ev) {
    live *x = *l;
    x->cb(x->user, ev);
    *l = x->next;
    unlink_all(sv, x);
    free(x);
}

/* The one event that ends a request without a token (cancel, refusal). */
static cs_event end_event(uint64_t id, enum cs_finish finish, int32_t n_prompt, const char *error) {
    return (cs_event){.id = id,
                      .token = -1,
                      .text = "",
                      .finish = finish,
                      .n_prompt_tokens = n_prompt,
                      .error = error};
}

static void apply(cs_serve *sv, pending *p) {
    live **l = find_live(sv, p->r.id);
    if (p->kind == P_KV_READY) {
        if (*l && cs_sched_kv_ready(sv->sched, p->r.id, p->first_token, p->n_cached,
                                    p->has_lp ? &p->first_lp : NULL) != 0) {
            CS_LOGW("request %llu: %s", (unsigned long long)p->r.id, cs_last_error());
            cs_sched_cancel(sv->sched, p->r.id);
            cs_event ev = end_event(p->r.id, CS_FINISH_ERROR, 0, cs_last_error());
            ev.status = CS_EINVAL;
            finish_live(sv, l, &ev);
        }
        return;
    }
    int r = *l ? cs_fail(CS_EINVAL, "request id %llu is already live", (unsigned long long)p->r.id)
               : cs_sched_add(sv->sched, &p->r);
    if (r) {
        unlink_all(sv, p->lv); /* pending_free frees it */
        cs_event ev =
            end_event(p->r.id, CS_FINISH_ERROR, p->r.n_prompt - p->r.n_resumed, cs_last_error());
        ev.status = r;
        p->cb(p->user, &ev);
        return;
    }
    live *x = p->lv;
    p->lv = NULL;
    x->next = sv->lives;
    sv->lives = x;
    /* admission event: the reserved pages (decode workers start the KV
     * transfer into them) */
    cs_event ev = end_event(p->r.id, CS_FINISH_NONE, p->r.n_prompt - p->r.n_resumed, NULL);
    if (cs_sched_kv_pages(sv->sched, p->r.id, &ev.kv_pages, &ev.kv_n_pages) == 0)
        x->cb(x->user, &ev);
}

/* A submission's prompt work into L (a remote request's KV comes computed). */
static void add_submit(const cs_serve *sv, cs_ttft_load *L, const pending *p) {
    if (p->kind != P_SUBMIT || p->r.kv_mode == CS_KV_REMOTE) return;
    cs_ttft_load_add(L, p->r.priority, p->r.tenant, cs_ttft_weight(&sv->shares, p->r.tenant),
                     p->r.n_prompt);
}

/* The stats and the TTFT load as of now, for other threads. Engine thread. */
static void publish(cs_serve *sv) {
    cs_ttft_load L;
    cs_sched_ttft_load(sv->sched, &L);
    pthread_mutex_lock(&sv->mu);
    cs_sched_get_stats(sv->sched, &sv->stats);
    sv->load = L;
    sv->step_began = 0;
    sv->applying.n_groups = 0;
    sv->applying.overflow_tokens = 0;
    pthread_mutex_unlock(&sv->mu);
}

/* A step begins: what it is expected to take (its decodes and a chunk of the
 * queued prompt work, by the published load), for the residual of a TTFT
 * predicted while it runs. Engine thread. */
static void step_begins(cs_serve *sv) {
    pthread_mutex_lock(&sv->mu);
    const cs_ttft_load *L = &sv->load;
    double todo = cs_ttft_load_tokens(L);
    sv->step_began = cs_now();
    sv->step_chunk = todo < L->chunk_tokens ? todo : L->chunk_tokens;
    sv->step_expect = cs_ttft_step_s(L, sv->step_chunk, todo > 0);
    pthread_mutex_unlock(&sv->mu);
}

static void *loop(void *arg) {
    cs_serve *sv = arg;
    cs_log_set_role("engine");
    for (;;) {
        if (cs_sched_idle(sv->sched)) update_summary(sv, true);
        pthread_mutex_lock(&sv->mu);
        while (!sv->head && !sv->releases && !sv->stopping && !sv->any_cancel &&
               cs_sched_idle(sv->sched))
            pthread_cond_wait(&sv->cv, &sv->mu);
        pending *batch = sv->head;
        for (const pending *p = batch; p; p = p->next) /* visible until published */
            add_submit(sv, &sv->applying, p);
        sv->head = NULL;
        sv->tail = &sv->head;
        bool stopping = sv->stopping;
        live *cancels = NULL; /* marked ones, each taken once */
        for (live *x = sv->any_cancel ? sv->all : NULL; x; x = x->all_next)
            if (x->cancel) x->cancel = false, x->cancel_next = cancels, cancels = x;
        sv->any_cancel = false;
        cs_serve_release *rels = sv->releases;
        sv->releases = NULL;
        pthread_mutex_unlock(&sv->mu);
        for (cs_serve_release *x = rels, *n; x; x = n) {
            n = x->next;
            if (cs_kv_cache_free_pages(cs_engine_kv(sv->e), x->pages, x->n) != 0)
                CS_LOGE("serve: releasing held KV pages: %s", cs_last_error());
            free(x->block);
        }
        for (pending *p = batch, *n; p; p = n) {
            n = p->next;
            if (!stopping || p->kind != P_SUBMIT)
                apply(sv, p);
            else { /* submitted as we stop: never started */
                unlink_all(sv, p->lv);
                cs_event ev = end_event(p->r.id, CS_FINISH_CANCELLED, p->r.n_prompt, NULL);
                p->cb(p->user, &ev);
            }
            pending_free(p);
        }
        /* after the batch, which holds every submit made before the cancels */
        for (live *x = cancels, *n; x; x = n) {
            n = x->cancel_next;
            live **l = &sv->lives;
            while (*l && *l != x)
                l = &(*l)->next;
            if (*l && cs_sched_cancel(sv->sched, x->id) == 0) {
                cs_event ev = end_event(x->id, CS_FINISH_CANCELLED, 0, NULL);
                finish_live(sv, l, &ev);
            }
        }
        if (stopping) break;
        if (batch) /* what was just queued shows in the stats before the step runs */
            publish(sv);
        const cs_event *evs;
        int32_t n = 0;
        step_begins(sv);
        cs_sched_step(sv->sched, &evs, &n);
        if (sv->trace) trace_step(sv);
        update_summary(sv, false);
        for (int32_t i = 0; i < n; i++) {
            live **l = find_live(sv, evs[i].id);
            if (!*l) continue;
            if (evs[i].finish != CS_FINISH_NONE)
                finish_live(sv, l, &evs[i]);
            else
                (*l)->cb((*l)->user, &evs[i]);
        }
        publish(sv);
    }
    /* cancel whatever is still live */
    while (sv->lives) {
        cs_sched_cancel(sv->sched, sv->lives->id);
        cs_event ev = end_event(sv->lives->id, CS_FINISH_CANCELLED, 0, NULL);
        finish_live(sv, &sv->lives, &ev);
    }
    return NULL;
}

int cs_serve_start(cs_engine *e, const cs_sched_params *p, cs_serve **out) {
    *out = NULL;
    cs_serve *sv = calloc(1, sizeof *sv);
    if (!sv) return cs_fail(CS_ENOMEM, "serve: out of memory");
    int r = cs_sched_init(e, p, &sv->sched);
    if (r) {
        free(sv);
        return r;
    }
    sv->e = e;
    sv->tail = &sv->head;
    if (p->n_tenant_shares > 0) {
        cs_tenant_share *t = calloc((size_t)p->n_tenant_shares, sizeof *t);
        char *names = calloc((size_t)p->n_tenant_shares, CS_TENANT_NAME_MAX + 1);
        if (!t || !names) {
            free(t), free(names);
            cs_sched_free(sv->sched);
            free(sv);
            return cs_fail(CS_ENOMEM, "serve: out of memory");
        }
        for (int32_t i = 0; i < p->n_tenant_shares; i++) {
            char *n = names + (size_t)i * (CS_TENANT_NAME_MAX + 1);
            snprintf(n, CS_TENANT_NAME_MAX + 1, "%s", p->tenant_shares[i].name);
            t[i] = (cs_tenant_share){n, p->tenant_shares[i].weight};
        }
        sv->shares.tenant_shares = t;
        sv->shares.n_tenant_shares = p->n_tenant_shares;
    }
    const char *trace = getenv("CHUNKSERVE_STEP_TRACE");
    if (trace && trace[0]) {
        if (!(sv->trace = fopen(trace, "a")))
            CS_LOGE("serve: CHUNKSERVE_STEP_TRACE=%s cannot be opened: no step trace", trace);
        else
            fprintf(sv->trace, "start_s,seconds,predicted_s,gap_s,tokens,decode_spans,"
                               "prefill_spans,running_decodes,budget,draft_tokens,draft_s\n");
    }
    cs_sched_get_stats(sv->sched, &sv->stats); /* before the thread exists: no lock needed */
    pthread_mutex_init(&sv->mu, NULL);
    pthread_cond_init(&sv->cv, NULL);
    if (pthread_create(&sv->thread, NULL, loop, sv) != 0) {
        cs_sched_free(sv->sched);
        if (sv->trace) fclose(sv->trace);
        if (sv->shares.n_tenant_shares) {
            free((void *)sv->shares.tenant_shares[0].name);
            free((void *)sv->shares.tenant_shares);
        }
        free(sv);
        return cs_fail(CS_EAGAIN, "serve: cannot start the engine thread");
    }
    *out = sv;
    return 0;
}

static int enqueue(cs_serve *sv, pending *p) {
    pthread_mutex_lock(&sv->mu);
    if (sv->stopping) {
        pthread_mutex_unlock(&sv->mu);
        return CS_ECANCELED;
    }
    *sv->tail = p;
    sv->tail = &p->next;
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    return 0;
}

int cs_serve_submit(cs_serve *sv, const cs_request *r, cs_serve_cb cb, void *user) {
    pending *p = calloc(1, sizeof *p);
    if (!p) return cs_fail(CS_ENOMEM, "serve: out of memory");
    p->lv = calloc(1, sizeof *p->lv);
    p->r = *r;
    p->cb = cb;
    p->user = user;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(r->n_prompt > 0 ? r->n_prompt : 1));
    p->r.prompt = prompt;
    p->stops = calloc(r->stop.n_stop + 1, sizeof(char *));
    p->stop_ids = malloc(sizeof(int32_t) * (r->stop.n_stop_ids + 1));
    const int32_t nb = r->sampling.n_bias > 0 ? r->sampling.n_bias : 0;
    p->bias_ids = malloc(sizeof(int32_t) * ((size_t)nb + 1));
    p->bias = malloc(sizeof(float) * ((size_t)nb + 1));
    bool ok = prompt && p->stops && p->stop_ids && p->bias_ids && p->bias && p->lv;
    if (ok && nb) {
        memcpy(p->bias_ids, r->sampling.bias_ids, sizeof(int32_t) * (size_t)nb);
        memcpy(p->bias, r->sampling.bias, sizeof(float) * (size_t)nb);
    }
    p->r.sampling.bias_ids = p->bias_ids;
    p->r.sampling.bias = p->bias;
    if (ok && r->n_prompt > 0) memcpy(prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
    for (size_t i = 0; ok && i < r->stop.n_stop; i++)
        ok = (p->stops[i] = strdup(r->stop.stop[i] ? r->stop.stop[i] : "")) != NULL;
    if (ok && r->stop.n_stop_ids)
        memcpy(p->stop_ids, r->stop.stop_ids, sizeof(int32_t) * r->stop.n_stop_ids);
    p->r.stop.stop = (const char *const *)p->stops;
    p->r.stop.stop_ids = p->stop_ids;
    p->r.cache_salt = NULL;
    if (ok && r->cache_salt && r->cache_salt[0])
        ok = (p->r.cache_salt = strdup(r->cache_salt)) != NULL;
    p->r.tenant = NULL;
    if (ok && r->tenant && r->tenant[0]) ok = (p->r.tenant = strdup(r->tenant)) != NULL;
    const cs_structured *st = &r->structured;
    p->r.structured.text = NULL, p->r.structured.choices = NULL;
    if (ok && st->text) ok = (p->r.structured.text = p->st_text = strdup(st->text)) != NULL;
    if (ok && st->n_choices > 0) {
        ok = (p->st_choices = calloc((size_t)st->n_choices, sizeof *p->st_choices)) != NULL;
        for (int32_t i = 0; ok && i < st->n_choices; i++)
            ok = (p->st_choices[i] = strdup(st->choices[i])) != NULL;
        p->r.structured.choices = (const char *const *)p->st_choices;
    }
    if (!ok) {
        pending_free(p);
        return cs_fail(CS_ENOMEM, "serve: out of memory");
    }
    p->lv->id = r->id, p->lv->cb = cb, p->lv->user = user;
    pthread_mutex_lock(&sv->mu);
    if (sv->stopping) {
        pthread_mutex_unlock(&sv->mu);
        pending_free(p);
        return CS_ECANCELED;
    }
    link_all(sv, p->lv);
    *sv->tail = p;
    sv->tail = &p->next;
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    return 0;
}

/* Allocates nothing: a cancel is never lost. O(live requests) under the
 * mutex. */
void cs_serve_cancel(cs_serve *sv, uint64_t id) {
    pthread_mutex_lock(&sv->mu);
    for (live *x = sv->all; x; x = x->all_next)
        if (x->id == id) x->cancel = true, sv->any_cancel = true;
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
}

/* The loop tests cs_sched_idle (which reads the held flags) under mu, so a
 * flag cleared before this lock is seen by its next test, and a loop already
 * waiting gets the signal. */
void cs_serve_wake(cs_serve *sv) {
    pthread_mutex_lock(&sv->mu);
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
}

int cs_serve_kv_ready(cs_serve *sv, uint64_t id, int32_t first_token, int32_t n_cached,
                      const cs_logprobs *first_lp) {
    pending *p = calloc(1, sizeof *p);
    if (!p) return cs_fail(CS_ENOMEM, "serve: out of memory");
    p->r.id = id;
    p->kind = P_KV_READY;
    p->first_token = first_token;
    p->n_cached = n_cached;
    if (first_lp) p->has_lp = true, p->first_lp = *first_lp;
    int rc = enqueue(sv, p);
    if (rc) pending_free(p);
    return rc;
}

void cs_serve_kv_release(cs_serve *sv, cs_serve_release *rec) {
    pthread_mutex_lock(&sv->mu);
    bool stopping = sv->stopping;
    if (!stopping) {
        rec->next = sv->releases; /* the order of releases does not matter */
        sv->releases = rec;
        pthread_cond_signal(&sv->cv);
    }
    pthread_mutex_unlock(&sv->mu);
    if (stopping) free(rec->block);
}

void cs_serve_stats(cs_serve *sv, cs_sched_stats *st) {
    pthread_mutex_lock(&sv->mu);
    *st = sv->stats;
    pthread_mutex_unlock(&sv->mu);
}

void cs_serve_ttft_load(cs_serve *sv, cs_ttft_load *L) {
    pthread_mutex_lock(&sv->mu);
    *L = sv->load;
    double left = sv->step_began > 0 ? sv->step_began + sv->step_expect - cs_now() : 0;
    L->residual_s = left > 0 ? left : 0;
    L->in_step_tokens = sv->step_began > 0 ? sv->step_chunk : 0;
    for (int32_t i = 0; i < sv->applying.n_groups; i++) {
        const cs_ttft_group *g = &sv->applying.groups[i];
        cs_ttft_load_add(L, g->priority, g->tenant, g->weight, g->tokens);
    }
    L->overflow_tokens += sv->applying.overflow_tokens;
    for (const pending *p = sv->head; p; p = p->next)
        add_submit(sv, L, p);
    pthread_mutex_unlock(&sv->mu);
    /* the named shares, so that a reader of the load (a router) knows a
     * tenant's weight before it has anything queued: groups of 0 tokens,
     * after the queued ones, while the table has room */
    for (int32_t i = 0; i < sv->shares.n_tenant_shares && L->n_groups < CS_TTFT_GROUPS; i++) {
        const cs_tenant_share *t = &sv->shares.tenant_shares[i];
        bool listed = false;
        for (int32_t k = 0; k < L->n_groups && !listed; k++)
            listed = !strcmp(L->groups[k].tenant, t->name);
        if (!listed) cs_ttft_load_add(L, 0, t->name, t->weight, 0);
    }
}

int cs_serve_prefix_summary_enable(cs_serve *sv, double interval_s) {
    if (!(interval_s > 0)) return cs_fail(CS_EINVAL, "prefix summary: interval must be > 0");
    size_t n_bits = cs_kv_summary_bits(cs_kv_cache_n_pages(cs_engine_kv(sv->e)));
    uint8_t *a = calloc(n_bits / 8, 1), *b = calloc(n_bits / 8, 1);
    if (!a || !b) {
        free(a), free(b);
        return cs_fail(CS_ENOMEM, "prefix summary: out of memory");
    }
    pthread_mutex_lock(&sv->mu);
    CS_ASSERT(!atomic_load(&sv->sum_on)); /* once */
    sv->sum_n_bits = n_bits;
    sv->sum_interval = interval_s;
    sv->sum_pub = b;
    sv->sum_next = a;
    atomic_store_explicit(&sv->sum_on, true, memory_order_release);
    sv->any_cancel = true;        /* wakes an idle engine (no record is marked: a no-op) */
    pthread_cond_signal(&sv->cv); /* so that it builds the first summary now */
    pthread_mutex_unlock(&sv->mu);
    return 0;
}

int cs_serve_prefix_summary(cs_serve *sv, uint64_t known, cs_serve_summary *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&sv->mu);
    out->n_bits = sv->sum_version ? sv->sum_n_bits : 0;
    out->version = sv->sum_version;
    out->behind_s = sv->sum_version && sv->sum_behind > 0 ? cs_now() - sv->sum_behind : 0;
    int r = 0;
    if (sv->sum_version && sv->sum_version != known) {
        if ((out->bits = malloc(sv->sum_n_bits / 8)))
            memcpy(out->bits, sv->sum_pub, sv->sum_n_bits / 8);
        else
            r = cs_fail(CS_ENOMEM, "prefix summary: out of memory");
    }
    pthread_mutex_unlock(&sv->mu);
    return r;
}

void cs_serve_stop(cs_serve *sv) {
    if (!sv) return;
    pthread_mutex_lock(&sv->mu);
    sv->stopping = true;
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    pthread_join(sv->thread, NULL);
    for (pending *p = sv->head, *n; p; p = n)
        n = p->next, pending_free(p);
    for (cs_serve_release *x = sv->releases, *n; x; x = n)
        n = x->next, free(x->block);
    cs_sched_free(sv->sched);
    if (sv->trace) fclose(sv->trace);
    free(sv->sum_next);
    free(sv->sum_pub);
    if (sv->shares.n_tenant_shares) {
        free((void *)sv->shares.tenant_shares[0].name); /* the names' block */
        free((void *)sv->shares.tenant_shares);
    }
    pthread_mutex_destroy(&sv->mu);
    pthread_cond_destroy(&sv->cv);
    free(sv);
}
