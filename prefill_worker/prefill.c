/* prefill.c: the prefill role (chunkserve-prefill). Serves
 * chunkserve.v1.Worker/Prefill: runs the prompt in chunks under the pool's
 * budget (CS_KV_PREFILL_ONLY), and after every step streams the pages that
 * step completed to the decode worker named in the request over the KV
 * transport (cs_kvx_tx), while the next chunk computes. After the last chunk
 * it samples the first token and sends the trailer; the call returns once
 * the decode worker has acknowledged it.
 *
 * Threads: the engine thread holds each step's completed pages (a page
 * reference, so the pool never reuses them) and queues them by id on the
 * transport, which reads them straight from the pool (TCP: writev; NCCL: a
 * gather kernel) and hands them back through its release callback
 * (cs_serve_kv_release, applied by the engine thread, with the held
 * record's own release: no allocation); the transport's I/O
 * thread reports the end; the loop thread owns the call. A slow decode
 * worker pushes back without blocking anyone: when the channel holds its
 * limit (--kv-queue-mib), the request's held ranges wait in its preq, the
 * request itself gets no further prompt chunk (cs_request.held: the engine
 * keeps computing every other prompt, and one request never holds more than
 * a chunk of pages beyond the channel's limit), and the transport's room
 * callback sends them and lets it go on; the transfer's deadline bounds the
 * wait.
 * A preq is a cs_worker_call (worker.h: admission, references, the event
 * drain and the answer are the shell's): the engine's final event and the
 * transfer's end each post the drain, which answers once both are known.
 *
 * Where pages may go. With --decode-workers / --decode-dns the worker polls
 * the decode pool as the router does (router/pool.h) and connects only to a
 * kv_endpoint that one of those decode workers advertised: a caller cannot
 * point it at an arbitrary address. A request naming an endpoint not (yet)
 * known waits, without computing, for up to one status staleness (a decode
 * worker the router saw first shows up at the next poll), then is refused
 * ABORTED, as a failed transfer would be (the router's pair breaker then
 * keeps that pair apart). Without a decode list any endpoint is taken (the
 * network is trusted; a warning says so off loopback). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunkserve/kvx_engine.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "outbuf.h"
#include "pool.h"
#include "worker.h"

typedef struct prefill prefill;

/* Completed pages held (a reference each) for the transport: waiting for
 * room on the channel, then queued there until it releases them. The
 * record itself carries their release to the engine, so handing the
 * references back needs no memory. */
typedef struct held {
    cs_serve_release rel; /* .pages = ids, .block = the record */
    struct prefill *p;
    struct held *next;
    int32_t first, n;
    int32_t ids[]; /* (n) */
} held;

typedef struct preq {
    cs_worker_call base; /* first: the shell's part (base.life.mu guards the fields below it) */
    prefill *p;
    char decode_id[80];
    char host[256];
    int port;
    int32_t n_context, total_pages;

    bool engine_done, tx_done, send_failed;
    held *held_head, *held_tail; /* waiting for room on the channel, in order */
    _Atomic bool kv_full;        /* pages wait for room: no next chunk (cs_request.held) */
    bool trailer_held;
    int32_t trailer_token;
    cs_logprobs trailer_lp; /* the first token's, when asked */
    double t_last_chunk;    /* when the final step's pages and trailer were queued */
    double tail;            /* from then to the trailer's acknowledgement */
    int32_t first_token, n_cached;
    cs_prompt_logprob *plp; /* prompt logprobs, when asked: answered to the router */
    int32_t n_plp;
    int eng_status, tx_status;
    char eng_error[256], tx_error[256];

    /* waiting for its kv_endpoint to be a known decode worker's (loop thread) */
    bool parked;
    double park_until;
    struct preq *park_next;
    char kv_endpoint[300];
    cs_request r; /* borrows the call's request message, alive until answered */
} preq;

struct prefill {
    cs_kvx_tx *tx;
    char kv_sender[64]; /* the name its KV channels authenticate as (GetStatus.kv_sender) */
    cs_worker *w;
    pthread_mutex_t rel_mu; /* engine_gone: releases after the engine stopped are dropped */
    bool engine_gone;
    size_t page_bytes;
    cs_kvx_stats last;
    cs_pool *decode_pool; /* the decode workers pages may go to; NULL = any endpoint */
    preq *parked;         /* requests whose kv_endpoint is not known yet */
    uv_timer_t park_timer;
    bool park_timer_ok;
    cs_metric *m_unknown_endpoint;
    cs_metric *m_requests, *m_xfer_started, *m_xfer_completed, *m_xfer_failed, *m_xfer_bytes,
        *m_xfer_seconds, *m_tail_seconds, *m_prefill_seconds, *m_backpressure, *m_kv_holds;
};

/* ---------------------------------------------------------- loop thread -- */

/* The drain, posted by the engine thread (its final event) and by the
 * transport (the transfer's end): answers the call once the outcome is
 * known. */
static void prefill_drain(cs_worker_call *c) {
    preq *q = (preq *)c;
    pthread_mutex_lock(&q->base.life.mu);
    bool eng_done = q->engine_done, tx_done = q->tx_done;
    int eng_status = q->eng_status, tx_status = q->tx_status;
    char eng_error[256], tx_error[256];
    memcpy(eng_error, q->eng_error, sizeof eng_error);
    memcpy(tx_error, q->tx_error, sizeof tx_error);
    int32_t first = q->first_token, n_cached = q->n_cached;
    double tail = q->tail;
    pthread_mutex_unlock(&q->base.life.mu);
    char msg[400];
    if (q->base.call) {
        if (q->base.end_code && (eng_done || tx_done)) {
            cs_worker_call_finish(c, q->base.end_code, q->base.end_msg);
        } else if (eng_done && eng_status) {
            snprintf(msg, sizeof msg, "prefill failed: %s", eng_error);
            cs_worker_call_finish(c, cs_rpc_code_of_status(eng_status), msg);
        } else if (tx_done && tx_status) {
            /* The caller learns that the transfer failed, not how: refused,
             * unreachable, silent or not a KV port all read the same, so
             * kv_endpoint is no oracle for what listens where. The cause is
             * in this worker's log. */
            CS_LOGW("request %s: KV transfer to %s (%s:%d) failed: %s", q->base.request_id,
                    q->decode_id, q->host, q->port, tx_error);
            cs_worker_call_finish(c, CS_RPC_ABORTED, /* the pair's link, not this worker */
                                  "the KV transfer to the decode worker failed (the prefill "
                                  "worker's log has the cause)");
        } else if (tx_done && eng_done) {
            Chunkserve__V1__PrefillResponse r = CHUNKSERVE__V1__PREFILL_RESPONSE__INIT;
            r.first_token_id = first;
            r.num_tokens = q->n_context;
            r.num_cached_tokens = n_cached;
            r.num_pages = q->total_pages;
            r.kv_bytes = (uint64_t)q->total_pages * q->p->page_bytes;
            void *scratch = NULL; /* the engine is done: plp no longer changes */
            if (cs_prompt_logprobs_msgs(q->plp, q->n_plp, &r.prompt_logprobs, &scratch)) {
                cs_worker_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED,
                                      "out of memory for the prompt logprobs");
                return;
            }
            r.n_prompt_logprobs = (size_t)q->n_plp;
            cs_metric_observe(q->p->m_prefill_seconds, cs_now() - q->base.t_start);
            cs_metric_observe(q->p->m_tail_seconds, tail);
            CS_LOGI("request %s (transfer %016llx): %d tokens (%d cached), %d pages to %s in %.3f "
                    "s, last chunk "
                    "to acknowledged trailer %.4f s",
                    q->base.request_id, (unsigned long long)q->base.transfer_id, q->n_context,
                    n_cached, q->total_pages, q->decode_id, cs_now() - q->base.t_start, tail);
            cs_worker_call_reply(c, &r.base);
            free(scratch);
        }
    }
}

/* ------------------------------------------------- engine + I/O threads -- */

/* Transport I/O thread (or any, after a failure): a held record's pages go
 * back to the engine, which applies it before its next step and frees the
 * record. */
static void release_pages(void *arg, const int32_t *ids, int32_t n) {
    held *h = arg;
    prefill *p = h->p;
    (void)ids, (void)n; /* h's own */
    pthread_mutex_lock(&p->rel_mu);
    if (p->engine_gone)
        free(h);
    else
        cs_serve_kv_release(p->w->sv, &h->rel);
    pthread_mutex_unlock(&p->rel_mu);
}

static void drop_held_locked(preq *q) {
    while (q->held_head) {
        held *h = q->held_head;
        q->held_head = h->next;
        release_pages(h, h->ids, h->n);
    }
    q->held_tail = NULL;
    q->trailer_held = false;
}

/* Queues the held ranges, then the trailer, in order, as far as the channel
 * takes them (the rest waits for the room callback). 0 or the error. */
static int flush_locked(preq *q) {
    prefill *p = q->p;
    while (q->held_head) {
        held *h = q->held_head;
        int r = cs_kvx_tx_send_pages(p->tx, q->base.transfer_id, h->first, h->n, h->ids,
                                     release_pages, h);
        if (r == CS_EAGAIN) {
            cs_metric_inc(p->m_backpressure);
            if (!atomic_exchange(&q->kv_full, true)) cs_metric_inc(p->m_kv_holds);
            return 0;
        }
        if (r) return r;
        q->held_head = h->next; /* the transport's now: it releases h */
        if (!q->held_head) q->held_tail = NULL;
    }
    if (atomic_exchange(&q->kv_full, false)) cs_serve_wake(q->base.w->sv); /* its next chunk */
    if (!q->trailer_held) return 0;
    q->trailer_held = false;
    cs_kvx_trailer t = {.first_token = q->trailer_token,
                        .prompt_len = q->n_context,
                        .total_pages = q->total_pages,
                        .n_cached = q->n_cached};
    _Static_assert(CS_KVX_MAX_TOP == CS_MAX_TOP_LOGPROBS, "the trailer carries every alternative");
    t.first_logprob = q->trailer_lp.logprob;
    t.n_top = q->trailer_lp.n_top;
    memcpy(t.top_ids, q->trailer_lp.top_ids, sizeof t.top_ids);
    memcpy(t.top_logprobs, q->trailer_lp.top_logprobs, sizeof t.top_logprobs);
    return cs_kvx_tx_finish(p->tx, q->base.transfer_id, &t);
}

/* A send failed: records why (CS_ENOENT: the transfer already failed, its
 * done reports why) and hands the held pages back. Whether the transfer is
 * aborted and the request cancelled is the caller's. */
static void send_failed_locked(preq *q, int r) {
    drop_held_locked(q);
    if (q->send_failed) return;
    q->send_failed = true;
    if (r != CS_ENOENT) {
        q->eng_status = r;
        snprintf(q->eng_error, sizeof q->eng_error, "sending KV: %s", cs_last_error());
    }
}

/* Transport I/O thread: the transfer ended (acknowledged, or failed). */
static void on_tx_done(void *arg, uint64_t xfer, int status, const char *msg,
                       const cs_kvx_trailer *t) {
    preq *q = arg;
    (void)xfer, (void)t;
    pthread_mutex_lock(&q->base.life.mu);
    q->tx_done = true;
    q->tx_status = status;
    drop_held_locked(q);
    if (q->t_last_chunk > 0) q->tail = cs_now() - q->t_last_chunk;
    if (status)
        snprintf(q->tx_error, sizeof q->tx_error, "%s", msg && msg[0] ? msg : cs_strerror(status));
    bool engine_running = !q->engine_done;
    cs_live_req_post_locked(&q->base.life);
    pthread_mutex_unlock(&q->base.life.mu);
    if (!status)
        cs_metric_observe(q->p->m_xfer_seconds, cs_now() - q->base.t_start);
    else if (engine_running)
        cs_serve_cancel(q->base.w->sv, q->base.id); /* nobody will take these pages: stop */
    cs_live_req_unref(&q->base.life);               /* the transfer's */
}

/* Transport I/O thread: the channel has room again for what q holds. */
static void on_tx_room(void *arg, uint64_t xfer) {
    preq *q = arg;
    (void)xfer;
    pthread_mutex_lock(&q->base.life.mu);
    int r = q->send_failed ? 0 : flush_locked(q);
    if (r) send_failed_locked(q, r);
    bool engine_running = !q->engine_done;
    pthread_mutex_unlock(&q->base.life.mu);
    if (r && r != CS_ENOENT) cs_kvx_tx_abort(q->p->tx, q->base.transfer_id);
    if (r && engine_running) cs_serve_cancel(q->base.w->sv, q->base.id);
}

/* Engine thread: holds the pages a step completed (a reference each, so the
 * pool never reuses them before the transport released them) behind the
 * ones still waiting. */
static int hold_pages_locked(preq *q, const cs_event *ev) {
    held *h = malloc(sizeof *h + (size_t)ev->kv_n_pages * sizeof *h->ids);
    if (!h) return cs_fail(CS_ENOMEM, "no memory to hold %d KV pages", ev->kv_n_pages);
    cs_kv_cache *kv = cs_engine_kv(q->base.w->engine);
    for (int32_t i = 0; i < ev->kv_n_pages; i++) {
        int r = cs_kv_cache_ref_page(kv, ev->kv_pages[i]);
        if (r) {
            cs_kv_cache_free_pages(kv, ev->kv_pages, i);
            free(h);
            return r;
        }
    }
    h->next = NULL;
    h->p = q->p;
    h->first = ev->kv_first_page;
    h->n = ev->kv_n_pages;
    memcpy(h->ids, ev->kv_pages, (size_t)h->n * sizeof *h->ids);
    h->rel = (cs_serve_release){.pages = h->ids, .n = h->n, .block = h};
    if (q->held_tail)
        q->held_tail->next = h;
    else
        q->held_head = h;
    q->held_tail = h;
    return 0;
}

static void on_event(void *user, const cs_event *ev) {
    preq *q = user;
    int r = 0;
    pthread_mutex_lock(&q->base.life.mu);
    if (!q->send_failed) {
        if (ev->kv_n_pages) r = hold_pages_locked(q, ev);
        if (!r && ev->n_prompt_lp > 0) {
            size_t bytes = (size_t)ev->n_prompt_lp * sizeof *q->plp;
            if (!(q->plp = malloc(bytes))) r = CS_ENOMEM;
            if (!r) memcpy(q->plp, ev->prompt_lp, bytes), q->n_plp = ev->n_prompt_lp;
        }
        if (!r && ev->token >= 0 && ev->finish == CS_FINISH_LENGTH) {
            q->trailer_held = true;
            q->trailer_token = ev->token;
            q->trailer_lp = ev->lp;                   /* zero unless the request asked */
            q->n_cached = ev->n_cached_prompt_tokens; /* the trailer carries it */
        }
        if (!r) r = flush_locked(q);
        if (r) send_failed_locked(q, r);
    }
    if (ev->finish != CS_FINISH_NONE) {
        q->engine_done = true;
        q->first_token = ev->token;
        q->n_cached = ev->n_cached_prompt_tokens;
        q->t_last_chunk = cs_now();
        if (ev->finish == CS_FINISH_ERROR && !q->eng_status) {
            q->eng_status = ev->status ? ev->status : CS_EIO;
            snprintf(q->eng_error, sizeof q->eng_error, "%s",
                     ev->error ? ev->error : "engine error");
        }
    }
    bool abort_tx =
        (r && r != CS_ENOENT) || ev->finish == CS_FINISH_ERROR || ev->finish == CS_FINISH_CANCELLED;
    bool cancel = r && ev->finish == CS_FINISH_NONE;
    if (ev->finish != CS_FINISH_NONE) cs_live_req_post_locked(&q->base.life);
    pthread_mutex_unlock(&q->base.life.mu);
    if (abort_tx) cs_kvx_tx_abort(q->p->tx, q->base.transfer_id); /* CS_ENOENT when already over */
    if (cancel) cs_serve_cancel(q->base.w->sv, q->base.id);
    if (ev->finish != CS_FINISH_NONE) cs_live_req_unref(&q->base.life); /* the engine's */
}

/* ---------------------------------------------------------- loop thread -- */

static void unpark(preq *q) {
    preq **pp = &q->p->parked;
    while (*pp && *pp != q)
        pp = &(*pp)->park_next;
    if (*pp) *pp = q->park_next;
    q->park_next = NULL;
    q->parked = false;
}

static void prefill_cancel(cs_worker_call *c) {
    preq *q = (preq *)c;
    if (q->parked) { /* nothing started: no event will drain it */
        unpark(q);
        cs_worker_call_finish(c, c->end_code ? c->end_code : CS_RPC_CANCELLED,
                              c->end_msg ? c->end_msg : "cancelled");
        return;
    }
    cs_serve_cancel(c->w->sv, c->id);
    cs_kvx_tx_abort(q->p->tx, c->transfer_id);
}

/* Opens the transfer to q's decode worker and hands the prompt to the
 * engine. */
static void begin(preq *q) {
    cs_worker *w = q->base.w;
    prefill *p = q->p;
    int64_t left = q->base.call ? cs_rpc_call_deadline_ms(q->base.call) : 0;
    if (left > w->o.kv_deadline_ms) left = w->o.kv_deadline_ms;
    if (left < 1) left = 1;
    cs_metric_inc(p->m_requests);
    cs_live_req_ref(&q->base.life); /* the transfer's */
    int rc = cs_kvx_tx_begin(p->tx, q->host, q->port, q->base.transfer_id, q->total_pages,
                             (int32_t)left, on_tx_done, q);
    if (rc) {
        cs_live_req_unref_not_last(&q->base.life); /* never the last: the RPC holds one */
        cs_worker_call_finish(&q->base,
                              rc == CS_EEXIST ? CS_RPC_ALREADY_EXISTS : CS_RPC_UNAVAILABLE,
                              cs_last_error());
        return;
    }
    q->r.kv_mode = CS_KV_PREFILL_ONLY;
    q->r.held = &q->kv_full;
    if (cs_worker_call_submit(&q->base, &q->r, on_event) != 0)
        cs_kvx_tx_abort(p->tx, q->base.transfer_id);
}

/* The longest a request waits for its kv_endpoint to be known: the pool's
 * own bound on a status's age, plus one DNS refresh with --decode-dns (the
 * router may have resolved a new decode pod that long before this worker):
 * a decode worker that answers is known by then. */
static double park_limit_s(const cs_worker *w) {
    double ms = 2.0 * (double)w->o.status_interval_ms + 1000.0;
    if (w->o.decode_dns) ms += (double)w->o.dns_refresh_ms;
    return ms / 1000.0;
}

/* Starts the parked requests whose endpoint became known and refuses those
 * that waited too long. Loop thread: the park timer, and the pool's
 * on_change after each poll round. */
static void check_parked(prefill *p) {
    double now = cs_now();
    preq *q = p->parked;
    while (q) {
        preq *next = q->park_next;
        bool known = cs_pool_knows_kv_endpoint(p->decode_pool, CS_POOL_DECODE, q->kv_endpoint);
        if (known || now >= q->park_until || !q->base.call) {
            unpark(q);
            if (known && q->base.call)
                begin(q);
            else {
                cs_metric_inc(p->m_unknown_endpoint);
                CS_LOGW("request %s: kv_endpoint %s is not the KV endpoint of a decode worker "
                        "this worker knows (--decode-workers/--decode-dns); refused",
                        q->base.request_id, q->kv_endpoint);
                cs_worker_call_finish(&q->base, CS_RPC_ABORTED,
                                      "the KV transfer to the decode worker failed (the prefill "
                                      "worker's log has the cause)");
            }
        }
        q = next;
    }
    if (!p->parked && p->park_timer_ok) uv_timer_stop(&p->park_timer);
}

static void on_park_tick(uv_timer_t *t) {
    check_parked(t->data);
}

static void on_decode_pool_change(void *arg) {
    prefill *p = arg;
    if (p->parked) check_parked(p);
}

static void handle_prefill(cs_rpc_call *c, void *data) {
    cs_worker *w = data;
    prefill *p = w->role_data;
    const Chunkserve__V1__PrefillRequest *m = (const void *)cs_rpc_call_request_msg(c);
    cs_request r;
    preq *q = (preq *)cs_worker_admit(w, c, m->token_ids, m->n_token_ids, m->num_prompt_tokens,
                                      m->sampling, m->transfer_id, m->request_id, m->cache_salt,
                                      m->tenant, &r);
    if (!q) return;
    char host[256];
    int port = 0;
    const int payload = cs_kvx_tx_payload(p->tx);
    int rc = 0;
    if (m->kv_transport && m->kv_transport != cs_worker_kv_transport(payload))
        rc = cs_fail(CS_ENOTSUP, "kv_transport %s: this worker sends KV over %s",
                     cs_worker_kv_transport_name(m->kv_transport), cs_kvx_payload_name(payload));
    if (!rc) rc = cs_worker_split_endpoint(m->kv_endpoint, host, sizeof host, &port);
    if (rc) {
        cs_worker_call_finish(&q->base, cs_rpc_code_of_status(rc), cs_last_error());
        return;
    }
    q->p = p;
    q->r = r;
    q->n_context = (int32_t)m->n_token_ids;
    q->total_pages = cs_kv_cache_seq_pages(cs_engine_kv(w->engine), q->n_context);
    snprintf(q->decode_id, sizeof q->decode_id, "%s",
             m->decode_worker_id[0] ? m->decode_worker_id : "decode");
    snprintf(q->host, sizeof q->host, "%s", host);
    snprintf(q->kv_endpoint, sizeof q->kv_endpoint, "%s", m->kv_endpoint);
    q->port = port;
    if (!p->decode_pool ||
        cs_pool_knows_kv_endpoint(p->decode_pool, CS_POOL_DECODE, m->kv_endpoint)) {
        begin(q);
        return;
    }
    /* not known (yet): wait for the decode pool's next polls, within the call's deadline */
    double wait = park_limit_s(w), left_s = (double)cs_rpc_call_deadline_ms(c) / 1000.0;
    q->park_until = cs_now() + (left_s < wait ? left_s : wait);
    q->parked = true;
    q->park_next = p->parked;
    p->parked = q;
    if (!uv_is_active((uv_handle_t *)&p->park_timer))
        uv_timer_start(&p->park_timer, on_park_tick, 50, 50);
    CS_LOGD("request %s: kv_endpoint %s not known yet; waiting up to %.1f s", q->base.request_id,
            q->kv_endpoint, q->park_until - cs_now());
}

/* ---------------------------------------------------------- metrics -- */

static const double xfer_secs[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25,  0.5,    1,     2.5,  5,     10,   30};
#define M(f) offsetof(prefill, f)
#define N_SECS (sizeof xfer_secs / sizeof xfer_secs[0])
/* The prefill role's metrics (besides the worker's common ones). */
static const cs_metric_def prefill_metrics_table[] = {
    {M(m_requests), "chunkserve:prefill_requests_total", CS_METRIC_COUNTER, NULL,
     "Prefill calls accepted", NULL, 0},
    {M(m_xfer_started), "chunkserve:kv_transfers_started_total", CS_METRIC_COUNTER, NULL,
     "KV transfers begun", NULL, 0},
    {M(m_xfer_completed), "chunkserve:kv_transfers_completed_total", CS_METRIC_COUNTER, NULL,
     "KV transfers acknowledged by the decode worker", NULL, 0},
    {M(m_xfer_failed), "chunkserve:kv_transfers_failed_total", CS_METRIC_COUNTER, NULL,
     "KV transfers failed (peer died, deadline, aborted)", NULL, 0},
    {M(m_xfer_bytes), "chunkserve:kv_transfer_bytes_total", CS_METRIC_COUNTER, NULL,
     "KV payload bytes sent", NULL, 0},
    {M(m_xfer_seconds), "chunkserve:kv_transfer_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Prefill call received to trailer acknowledged", xfer_secs, N_SECS},
    {M(m_tail_seconds), "chunkserve:kv_transfer_tail_seconds", CS_METRIC_HISTOGRAM, NULL,
     "last chunk computed to trailer acknowledged: the transfer time left on the critical path",
     xfer_secs, N_SECS},
    {M(m_prefill_seconds), "chunkserve:prefill_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Prefill call received to answered", xfer_secs, N_SECS},
    {M(m_backpressure), "chunkserve:kv_backpressure_waits_total", CS_METRIC_COUNTER, NULL,
     "page ranges held back by a full KV channel until it drained", NULL, 0},
    {M(m_kv_holds), "chunkserve:kv_backpressure_holds_total", CS_METRIC_COUNTER, NULL,
     "times a request's prompt stopped (no next chunk) until its full KV channel drained", NULL, 0},
    {M(m_unknown_endpoint), "chunkserve:kv_endpoint_refused_total", CS_METRIC_COUNTER, NULL,
     "Prefill calls refused: their kv_endpoint is no known decode worker's (--decode-workers, "
     "--decode-dns)",
     NULL, 0},
};
#undef M
#undef N_SECS

/* ---------------------------------------------------------- role hooks -- */

/* --decode-workers / --decode-dns: the decode pool whose advertised KV
 * endpoints are the only ones pages go to. */
static int start_decode_pool(cs_worker *w) {
    prefill *p = w->role_data;
    const cs_worker_opts *o = &w->o;
    bool loopback =
        !strncmp(o->host, "127.", 4) || !strcmp(o->host, "::1") || !strcmp(o->host, "localhost");
    if (!o->decode_workers && !o->decode_dns) {
        if (!loopback)
            CS_LOGW("no --decode-workers/--decode-dns: KV pages go to any kv_endpoint a caller "
                    "names; list the decode pool (docs/security.md)");
        return 0;
    }
    const cs_model_config *cfg = cs_model_get_config(w->model);
    cs_pool_opts po = {
        .static_workers = {NULL, o->decode_workers},
        .dns = {NULL, o->decode_dns},
        .dns_refresh_ms = (int32_t)o->dns_refresh_ms,
        .status_interval_ms = (int32_t)o->status_interval_ms,
        .expect_n_vocab = cfg->n_vocab,
        .expect_arch = cfg->arch,
        .expect_ctx_len = cfg->ctx_len,
        .expect_model_fp = cs_model_fingerprint(w->model),
        .expect_tokenizer_fp = w->wm.tokenizer_fingerprint,
        .rpc_token = cs_secret_token(&w->secret),
        .worker_tls = &w->o.worker_tls,
        .on_change = on_decode_pool_change,
        .arg = p,
    };
    uv_timer_init(cs_proc_uv(w->proc), &p->park_timer);
    p->park_timer.data = p;
    p->park_timer_ok = true;
    return cs_pool_init(cs_proc_uv(w->proc), w->rl, &po, &p->decode_pool);
}

static int prefill_start(cs_worker *w) {
    prefill *p = w->role_data;
    p->w = w;
    pthread_mutex_init(&p->rel_mu, NULL);
    p->page_bytes = cs_engine_page_bytes(w->engine);
    cs_kvx_tx_params tp = cs_kvx_tx_params_default();
    tp.layout = cs_kvx_layout_of_engine(w->engine);
    tp.pool = cs_kvx_pool_of_engine(w->engine);
    tp.room = on_tx_room;
    /* The KV channel's sender name: decode workers fence by it (a new
     * incarnation of a name replaces the old one's channel and refuses older
     * ones), so two live prefill workers must never share it. --worker-id
     * (the chart passes the pod's name: stable across container restarts)
     * or, when unset, the host name and this process's random instance. */
    char name[64];
    if (w->worker_id[0])
        snprintf(name, sizeof name, "%s", w->worker_id);
    else {
        char host[40] = "";
        if (gethostname(host, sizeof host) != 0) host[0] = 0;
        host[sizeof host - 1] = 0;
        snprintf(name, sizeof name, "prefill-%s-%08x", host,
                 (unsigned)(w->instance_id & 0xffffffffu));
    }
    tp.name = name;
    snprintf(p->kv_sender, sizeof p->kv_sender, "%s", name);
    tp.checksum = w->o.kv_checksum;
    tp.dead_ms = (int32_t)w->o.kv_dead_ms;
    tp.renew_ms = (int32_t)w->o.kv_renew_ms;
    tp.max_queued_bytes = (size_t)w->o.kv_queue_mib << 20;
    tp.secret = &w->secret; /* the KV link proves the cluster secret too */
    int r = cs_kvx_tx_init(&tp, &p->tx);
    if (r) return r;
    if ((r = start_decode_pool(w))) return r;
    return cs_worker_add_method(w, "/chunkserve.v1.Worker/Prefill", CS_RPC_UNARY,
                                &chunkserve__v1__prefill_request__descriptor, handle_prefill);
}

/* Prompt tokens this worker holds and has not finished computing (n: their
 * requests; parked: the tokens of those parked before the engine, waiting
 * for their decode worker's endpoint): counted here at once, not at the
 * engine's next step (one step can be long). GetStatus (the router's
 * placement) and the chunkserve:queued_prefill_tokens metric (the prefill
 * pool's autoscaling signal) both read it. */
static int64_t queued_prefill_tokens(cs_worker *w, int32_t *n_requests, int64_t *parked) {
    int64_t queued = 0, waiting_tokens = 0;
    int32_t n = 0;
    for (cs_live_req *l = w->live.head; l; l = l->next) {
        preq *q = (preq *)l; /* its first member's first member */
        pthread_mutex_lock(&l->mu);
        if (!q->engine_done && q->p) queued += q->n_context, n++;
        if (!q->engine_done && q->parked) waiting_tokens += q->n_context;
        pthread_mutex_unlock(&l->mu);
    }
    if (n_requests) *n_requests = n;
    if (parked) *parked = waiting_tokens;
    return queued;
}

static void prefill_secret_changed(cs_worker *w) {
    prefill *p = w->role_data;
    if (p->tx) cs_kvx_tx_set_secret(p->tx, &w->secret);
    cs_pool_rpc_token_changed(p->decode_pool); /* its status polls carry the token */
}

static void prefill_status(cs_worker *w, Chunkserve__V1__WorkerStatus *st) {
    prefill *p = w->role_data;
    cs_worker_kv_status(w, p->tx ? cs_kvx_tx_payload(p->tx) : CS_KVX_PAYLOAD_TCP, st);
    st->kv_sender = p->kv_sender;
    int32_t n;
    int64_t parked;
    st->queued_prefill_tokens = queued_prefill_tokens(w, &n, &parked);
    st->queued_unsorted_tokens += parked; /* not in the engine's groups yet: ahead */
    if (st->num_running + st->num_waiting < n) st->num_waiting = n - st->num_running;
}

static void prefill_metrics(cs_worker *w) {
    prefill *p = w->role_data;
    cs_metric_set(w->em.queued_prefill, (double)queued_prefill_tokens(w, NULL, NULL));
    if (!p->tx) return;
    cs_kvx_stats s;
    cs_kvx_tx_get_stats(p->tx, &s);
    cs_metric_add(p->m_xfer_started, (double)(s.transfers_started - p->last.transfers_started));
    cs_metric_add(p->m_xfer_completed,
                  (double)(s.transfers_completed - p->last.transfers_completed));
    cs_metric_add(p->m_xfer_failed, (double)(s.transfers_failed - p->last.transfers_failed));
    cs_metric_add(p->m_xfer_bytes, (double)(s.bytes - p->last.bytes));
    p->last = s;
}

/* The engine goes first: its final events still abort their transfers on
 * a live transport; then the transport fails what is left (callbacks post
 * their ends, which the loop runs before it closes). */
static void prefill_stop(cs_worker *w) {
    prefill *p = w->role_data;
    if (p->w) {
        pthread_mutex_lock(&p->rel_mu); /* held pages die with the engine from here */
        p->engine_gone = true;
        pthread_mutex_unlock(&p->rel_mu);
    }
    while (p->parked) { /* answered by the shell's cancel_all; drop what is left */
        preq *q = p->parked;
        unpark(q);
        cs_worker_call_finish(&q->base, CS_RPC_UNAVAILABLE, "the prefill worker is shutting down");
    }
    if (p->park_timer_ok) {
        p->park_timer_ok = false;
        uv_close((uv_handle_t *)&p->park_timer, NULL);
    }
    cs_pool_close(p->decode_pool);
    p->decode_pool = NULL;
    cs_serve_stop(w->sv);
    w->sv = NULL;
    cs_kvx_tx_free(p->tx);
    p->tx = NULL;
}

/* The shared options' defaults for prefill: a large step budget, one
 * prompt at a time in 512-token chunks (pages stream while the next chunk
 * computes). */
static const cs_config_default config_defaults[] = {
    {"port", "50070"},
    {"max-batched-tokens", "8192"},
    {"max-partial-prefills", "1"},
    {"max-chunk-tokens", "512"},
    {"grpc-keepalive-ms", "5000"}, /* its callers are routers: a dead one is found fast */
    {"grpc-keepalive-timeout-ms", "5000"},
};

static const cs_config_entry config[] = {
    {"kv-deadline-ms", CS_CONFIG_INT, offsetof(cs_worker_opts, kv_deadline_ms), "120000",
     "longest a KV transfer may take (the call's own deadline applies when shorter)", 100, 3600000},
    {"kv-queue-mib", CS_CONFIG_INT, offsetof(cs_worker_opts, kv_queue_mib), "256",
     "KV bytes per decode worker's channel queued and not yet sent; beyond it a request's "
     "pages wait and its prompt stops until the channel drains",
     1, 1 << 20},
    {"kv-renew-ms", CS_CONFIG_INT, offsetof(cs_worker_opts, kv_renew_ms), "1000",
     "renew each pending transfer's reservation on its decode worker this often (keep it "
     "well under the decode workers' --lease-ms)",
     10, 600000},
    {"decode-workers", CS_CONFIG_STR, offsetof(cs_worker_opts, decode_workers), NULL,
     "the decode workers (gRPC host:port,host:port): KV pages go only to the KV endpoints "
     "they advertise; unset (with --decode-dns) = to any endpoint a caller names",
     0, 0},
    {"decode-dns", CS_CONFIG_STR, offsetof(cs_worker_opts, decode_dns), NULL,
     "DNS name:port whose A/AAAA records are the decode workers (a headless Service)", 0, 0},
    {"dns-refresh-ms", CS_CONFIG_INT, offsetof(cs_worker_opts, dns_refresh_ms), "5000",
     "re-resolve --decode-dns this often", 100, 3600000},
    {"status-interval-ms", CS_CONFIG_INT, offsetof(cs_worker_opts, status_interval_ms), "500",
     "poll each decode worker's status (its KV endpoint) this often", 10, 60000},
    {"worker-tls-ca-file", CS_CONFIG_STR, offsetof(cs_worker_opts, worker_tls.ca_file), NULL,
     "PEM roots: poll the decode workers over TLS and check their certificates", 0, 0},
    {"worker-tls-cert-file", CS_CONFIG_STR, offsetof(cs_worker_opts, worker_tls.cert_file), NULL,
     "PEM certificate presented to the decode workers (their --tls-client-ca-file)", 0, 0},
    {"worker-tls-key-file", CS_CONFIG_STR, offsetof(cs_worker_opts, worker_tls.key_file), NULL,
     "PEM private key of --worker-tls-cert-file", 0, 0},
    {"worker-tls-server-name", CS_CONFIG_STR, offsetof(cs_worker_opts, worker_tls.server_name),
     NULL, "name the decode workers' certificates must carry (default: each one's host)", 0, 0},
};

static void prefill_call_free(cs_worker_call *c) {
    free(((preq *)c)->plp);
}

const cs_worker_role cs_prefill_role = {
    .name = "prefill",
    .role = CHUNKSERVE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL,
    .config = config,
    .n_config = sizeof config / sizeof config[0],
    .config_defaults = config_defaults,
    .n_config_defaults = sizeof config_defaults / sizeof config_defaults[0],
    .summary = "the prefill worker: computes prompts in chunks under its budget and streams each "
               "chunk's KV "
               "pages to the decode worker that reserved them",
    .state_size = sizeof(prefill),
    .call_size = sizeof(preq),
    .start = prefill_start,
    .metrics_table = prefill_metrics_table,
    .n_metrics_table = sizeof prefill_metrics_table / sizeof prefill_metrics_table[0],
    .status = prefill_status,
    .secret_changed = prefill_secret_changed,
    .metrics = prefill_metrics,
    .drain = prefill_drain,
    .cancel = prefill_cancel,
    .stop = prefill_stop,
    .call_free = prefill_call_free,
};
