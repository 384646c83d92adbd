/* decode.c: the decode role (chunkserve-decode). Serves
 * chunkserve.v1.Worker/Decode: admits a request by reserving its pages (a
 * lease) or refuses it (RESOURCE_EXHAUSTED), receives the prompt's KV from a
 * prefill worker on its KV listener (cs_kvx_rx) straight into those pages,
 * or prefills short prompts itself (local_prefill), then streams tokens.
 *
 * Per request (struct dreq) three threads meet:
 *  - engine thread (cs_serve callback): the admission event starts the KV
 *    lease (cs_kvx_rx_expect on the reserved pages); token events are
 *    buffered under the dreq's mutex and a drain is posted;
 *  - KV I/O thread (rx done callback): on the trailer the sequence joins the
 *    batch (cs_serve_kv_ready); on failure (lease expired, peer died, bad
 *    frame, cancel) it is cancelled in the engine, which frees the pages
 *    only now that the transport will never write them again;
 *  - loop thread: the handler, the drain (sends `admitted`, then outputs,
 *    then the status) and the call's cancellation.
 * A dreq holds one reference for the engine side (dropped by the drain of
 * its final event) and one while a KV transfer is expected (dropped by the
 * rx done callback); the last one frees it on the loop thread. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chunkserve/kvx_engine.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "outbuf.h"
#include "worker.h"

#define MAX_UNSENT_BYTES ((size_t)4 << 20)

typedef struct decode decode;

typedef struct dreq {
    cs_worker *w;
    decode *d;
    cs_rpc_call *call; /* NULL once finished */
    uint64_t id, transfer_id;
    char request_id[80];
    bool local, logprobs;
    int32_t lease_ms;
    double t_start, t_last_token;
    int end_code; /* why we cancelled it ourselves (0 = the call's own cancel) */
    const char *end_msg;
    atomic_int refs;
    struct dreq *prev, *next; /* live list, loop thread */

    pthread_mutex_t mu; /* everything below */
    bool posted, admitted, sent_admitted, done, expected, kv_done, cancel_requested;
    int32_t pages_reserved, n_context;
    int kv_status;
    char kv_error[256];
    cs_outbuf out;
    enum cs_finish finish;
    int err_status;
    char error[256];
    int32_t n_prompt, n_completion, n_cached;
} dreq;

struct decode {
    cs_kvx_rx *rx;
    char kv_endpoint[300];
    dreq *live;
    int32_t n_live;
    uint64_t next_id;
    cs_kvx_stats last; /* exported so far */
    cs_metric *m_local, *m_remote, *m_refused, *m_xfer_started, *m_xfer_completed, *m_xfer_failed,
        *m_xfer_bytes, *m_xfer_seconds, *m_leases_expired, *m_ttft, *m_itl, *m_proto_errors,
        *m_router_hop;
};

static decode g_decode;

/* ------------------------------------------------------------ lifetime -- */

static void dreq_free_post(void *data) {
    dreq *q = data;
    decode *d = q->d;
    if (q->prev)
        q->prev->next = q->next;
    else
        d->live = q->next;
    if (q->next) q->next->prev = q->prev;
    d->n_live--;
    cs_outbuf_free(&q->out);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

static void dreq_unref(dreq *q) {
    if (atomic_fetch_sub(&q->refs, 1) == 1 && cs_rpc_loop_post(q->w->rl, dreq_free_post, q) != 0)
        CS_LOGE("request %s: cannot post its release (leaked)", q->request_id);
}

/* ------------------------------------------------- engine + I/O threads -- */

static void on_drain_post(void *data);

static void post_drain_locked(dreq *q) {
    if (q->posted) return;
    q->posted = true;
    if (cs_rpc_loop_post(q->w->rl, on_drain_post, q) != 0)
        q->posted = false; /* the next event retries */
}

static void append_locked(dreq *q, const cs_event *ev) {
    cs_outbuf_append(&q->out, ev);
    if (ev->finish != CS_FINISH_NONE) {
        q->done = true;
        q->finish = ev->finish;
        q->err_status = ev->status;
        if (ev->error) snprintf(q->error, sizeof q->error, "%s", ev->error);
        q->n_completion = ev->n_completion_tokens;
    } else if (ev->token >= 0) {
        q->n_completion = ev->n_completion_tokens;
        q->n_cached = ev->n_cached_prompt_tokens;
    }
}

/* KV I/O thread: the transfer into the reserved pages ended. */
static void on_kv_done(void *arg, uint64_t xfer, int status, const char *msg,
                       const cs_kvx_trailer *t) {
    dreq *q = arg;
    decode *d = q->d;
    double secs = cs_now() - q->t_start;
    pthread_mutex_lock(&q->mu);
    q->kv_done = true;
    if (!status && (t->prompt_len != q->n_context || t->total_pages != q->pages_reserved)) {
        status = CS_EPROTO;
        msg = "the trailer does not match the request (prompt length or pages)";
    }
    if (status) {
        q->kv_status = status;
        snprintf(q->kv_error, sizeof q->kv_error, "%s", msg && msg[0] ? msg : cs_strerror(status));
    }
    pthread_mutex_unlock(&q->mu);
    if (!status) {
        cs_metric_observe(d->m_xfer_seconds, secs);
        if (cs_serve_kv_ready(q->w->sv, q->id, t->first_token) != 0)
            cs_serve_cancel(q->w->sv, q->id);
    } else {
        if (status == CS_ETIMEDOUT) cs_metric_inc(d->m_leases_expired);
        CS_LOGW("request %s: KV transfer %016llx failed: %s", q->request_id,
                (unsigned long long)xfer, q->kv_error);
        cs_serve_cancel(q->w->sv, q->id); /* frees the pages: the transport is done with them */
    }
    dreq_unref(q);
}

/* Engine thread: every event of the request. */
static void on_event(void *user, const cs_event *ev) {
    dreq *q = user;
    decode *d = q->d;
    pthread_mutex_lock(&q->mu);
    if (ev->token < 0 && ev->finish == CS_FINISH_NONE &&
        ev->kv_pages) { /* admission: pages reserved */
        q->admitted = true;
        q->pages_reserved = ev->kv_n_pages;
        cs_metric_inc(q->local ? d->m_local : d->m_remote);
        if (!q->local && !q->cancel_requested) {
            atomic_fetch_add(&q->refs, 1);
            int r = cs_kvx_rx_expect(d->rx, q->transfer_id, ev->kv_pages, ev->kv_n_pages,
                                     q->lease_ms, on_kv_done, q);
            if (r == 0) {
                q->expected = true;
            } else {
                atomic_fetch_sub(&q->refs, 1);
                q->kv_status = r;
                snprintf(q->kv_error, sizeof q->kv_error, "cannot expect the KV transfer: %s",
                         cs_last_error());
                cs_serve_cancel(q->w->sv, q->id);
            }
        }
    } else {
        double now = cs_now();
        if (ev->token >= 0) {
            if (q->t_last_token > 0)
                cs_metric_observe(d->m_itl, now - q->t_last_token);
            else
                cs_metric_observe(d->m_ttft, now - q->t_start);
            q->t_last_token = now;
        }
        append_locked(q, ev);
        if (ev->finish == CS_FINISH_ERROR && ev->status == CS_ENOSPC) cs_metric_inc(d->m_refused);
    }
    post_drain_locked(q);
    pthread_mutex_unlock(&q->mu);
}

/* ---------------------------------------------------------- loop thread -- */

static void finish_call(dreq *q, int code, const char *msg) {
    if (!q->call) return;
    cs_rpc_call_finish(q->call, code, msg);
    q->call = NULL;
}

/* The payload the KV listener takes: the engine's pool decides (host: TCP,
 * device: NCCL). */
static Chunkserve__V1__KvTransport kv_transport(decode *d) {
    return cs_kvx_rx_payload(d->rx) == CS_KVX_PAYLOAD_NCCL
               ? CHUNKSERVE__V1__KV_TRANSPORT__KV_TRANSPORT_NCCL
               : CHUNKSERVE__V1__KV_TRANSPORT__KV_TRANSPORT_TCP;
}

static int send_admitted(dreq *q, int32_t pages) {
    Chunkserve__V1__DecodeAdmitted a = CHUNKSERVE__V1__DECODE_ADMITTED__INIT;
    a.transfer_id = q->transfer_id;
    a.pages_reserved = pages;
    a.kv_endpoint = q->d->kv_endpoint;
    a.kv_transport = kv_transport(q->d);
    Chunkserve__V1__DecodeResponse r = CHUNKSERVE__V1__DECODE_RESPONSE__INIT;
    r.event_case = CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_ADMITTED;
    r.admitted = &a;
    return cs_rpc_call_send_msg(q->call, &r.base);
}

static int send_output(dreq *q, const cs_outbuf *b, bool final, enum cs_finish finish,
                       int32_t n_prompt, int32_t n_completion, int32_t n_cached) {
    Chunkserve__V1__GenerateResponse g;
    Chunkserve__V1__Usage usage = CHUNKSERVE__V1__USAGE__INIT;
    void *scratch;
    if (cs_outbuf_response(b, q->logprobs, &g, &scratch)) return CS_ENOMEM;
    if (final) {
        g.finish_reason = cs_wire_finish_reason(finish);
        usage.prompt_tokens = n_prompt;
        usage.completion_tokens = n_completion;
        usage.cached_prompt_tokens = n_cached;
        g.usage = &usage;
    }
    Chunkserve__V1__DecodeResponse r = CHUNKSERVE__V1__DECODE_RESPONSE__INIT;
    r.event_case = CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_OUTPUT;
    r.output = &g;
    int rc = cs_rpc_call_send_msg(q->call, &r.base);
    cs_outbuf_response_free(scratch);
    return rc;
}

/* Cancels the request wherever it is. While a KV transfer is expected the
 * transport is cancelled first: its done callback then cancels in the engine
 * (freeing pages the transport might otherwise still write). */
static void dreq_cancel(dreq *q) {
    pthread_mutex_lock(&q->mu);
    q->cancel_requested = true;
    bool via_rx = q->expected && !q->kv_done;
    pthread_mutex_unlock(&q->mu);
    if (!via_rx || cs_kvx_rx_cancel(q->d->rx, q->transfer_id) != 0)
        cs_serve_cancel(q->w->sv, q->id);
}

static void on_drain_post(void *data) {
    dreq *q = data;
    pthread_mutex_lock(&q->mu);
    cs_outbuf out;
    cs_outbuf_take(&q->out, &out);
    bool done = q->done, oom = out.oom, admit = q->admitted && !q->sent_admitted;
    q->sent_admitted |= admit;
    int32_t pages = q->pages_reserved, n_prompt = q->n_prompt, n_completion = q->n_completion,
            n_cached = q->n_cached;
    enum cs_finish finish = q->finish;
    int kv_status = q->kv_status, err_status = q->err_status;
    char kv_error[256], error[256];
    memcpy(kv_error, q->kv_error, sizeof kv_error);
    memcpy(error, q->error, sizeof error);
    q->posted = false;
    pthread_mutex_unlock(&q->mu);

    if (q->call) {
        bool ok_end = done && (finish == CS_FINISH_STOP || finish == CS_FINISH_LENGTH);
        int rc = 0;
        if (admit) rc = send_admitted(q, pages);
        if (!rc && oom) rc = CS_ENOMEM;
        if (!rc && (ok_end || !cs_outbuf_empty(&out)))
            rc = send_output(q, &out, ok_end, finish, n_prompt, n_completion, n_cached);
        char msg[400];
        if (rc == CS_ENOMEM) {
            finish_call(q, CS_RPC_RESOURCE_EXHAUSTED,
                        "the worker ran out of memory for this stream");
            if (!done) dreq_cancel(q);
        } else if (!done && cs_rpc_call_pending_bytes(q->call) > MAX_UNSENT_BYTES) {
            finish_call(q, CS_RPC_RESOURCE_EXHAUSTED,
                        "the router is not reading the stream; decoding stopped");
            dreq_cancel(q);
        } else if (ok_end) {
            finish_call(q, CS_RPC_OK, NULL);
        } else if (done && finish == CS_FINISH_CANCELLED && kv_status) {
            snprintf(msg, sizeof msg, "%s: %s",
                     kv_status == CS_ETIMEDOUT ? "KV lease expired before the transfer completed"
                                               : "KV transfer failed",
                     kv_error);
            finish_call(q, CS_RPC_UNAVAILABLE, msg);
        } else if (done && finish == CS_FINISH_CANCELLED) {
            finish_call(q, q->end_code ? q->end_code : CS_RPC_CANCELLED,
                        q->end_msg ? q->end_msg : "the request was cancelled");
        } else if (done) {
            snprintf(msg, sizeof msg, "%s", error[0] ? error : "engine error");
            finish_call(q, err_status ? cs_rpc_code_of_status(err_status) : CS_RPC_INTERNAL, msg);
        }
    }
    cs_outbuf_free(&out);
    if (done) {
        static const char *names[] = {"none", "stop", "length", "cancelled", "error"};
        CS_LOGI("request %s (transfer %016llx, %s prefill): %s, %d + %d tokens in %.3f s%s%s",
                q->request_id, (unsigned long long)q->transfer_id, q->local ? "local" : "remote",
                names[finish], n_prompt, n_completion, cs_now() - q->t_start,
                error[0] || kv_error[0] ? ": " : "", error[0] ? error : kv_error);
        q->done = false; /* a later drain (none expected) must not drop the reference again */
        dreq_unref(q);
    }
}

static void on_call_cancel(cs_rpc_call *c, void *data) {
    dreq *q = data;
    (void)c;
    CS_LOGD("request %s: call cancelled", q->request_id);
    dreq_cancel(q);
    finish_call(q, CS_RPC_CANCELLED, "cancelled");
}

/* The router's receipt of the client call (wall clock, its metadata) to
 * ours: the router's own overhead plus the hop. Meaningful when both clocks
 * agree (one host, or NTP/PTP-synced); skewed values are dropped. */
static void observe_router_hop(decode *d, cs_rpc_call *c) {
    size_t len;
    const char *v = cs_rpc_call_metadata(c, "x-chunkserve-received-us", &len);
    char buf[32];
    if (!v || len == 0 || len >= sizeof buf) return;
    memcpy(buf, v, len);
    buf[len] = 0;
    char *end;
    long long t0 = strtoll(buf, &end, 10);
    if (*end) return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    double dt = ((double)now.tv_sec * 1e6 + (double)now.tv_nsec / 1e3 - (double)t0) / 1e6;
    if (dt >= 0 && dt < 60) cs_metric_observe(d->m_router_hop, dt);
}

static void handle_decode(cs_rpc_call *c, void *data) {
    cs_worker *w = data;
    decode *d = &g_decode;
    const Chunkserve__V1__DecodeRequest *m = (const void *)cs_rpc_call_request_msg(c);
    if (w->stopping) {
        cs_rpc_call_finish(c, CS_RPC_UNAVAILABLE, "the worker is draining (shutting down)");
        return;
    }
    if (d->n_live >= w->o.max_queue) {
        cs_metric_inc(d->m_refused);
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED,
                           "the decode worker holds --max-queue requests");
        return;
    }
    cs_request r;
    int rc =
        cs_worker_request(w, m->token_ids, m->n_token_ids, m->num_prompt_tokens, m->sampling, &r);
    if (rc) {
        cs_rpc_call_finish(c, cs_rpc_code_of_status(rc), cs_last_error());
        return;
    }
    observe_router_hop(d, c);
    dreq *q = calloc(1, sizeof *q);
    if (!q) {
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    q->w = w;
    q->d = d;
    q->call = c;
    q->id = ++d->next_id;
    q->transfer_id = m->transfer_id;
    q->local = m->local_prefill;
    q->lease_ms = m->lease_ms > 0 ? m->lease_ms : (int32_t)w->o.lease_ms;
    q->logprobs = r.logprobs;
    q->t_start = cs_now();
    q->n_prompt = m->num_prompt_tokens;
    q->n_context = (int32_t)m->n_token_ids;
    snprintf(q->request_id, sizeof q->request_id, "%s", m->request_id[0] ? m->request_id : "-");
    atomic_init(&q->refs, 1);
    pthread_mutex_init(&q->mu, NULL);
    q->next = d->live;
    if (d->live) d->live->prev = q;
    d->live = q;
    d->n_live++;
    r.id = q->id;
    r.kv_mode = q->local ? CS_KV_LOCAL : CS_KV_REMOTE;
    r.reserve = true;
    rc = cs_serve_submit(w->sv, &r, on_event, q);
    if (rc) {
        dreq_free_post(q);
        cs_rpc_call_finish(c, CS_RPC_UNAVAILABLE, "the engine refused the request");
        return;
    }
    if (cs_rpc_call_on_cancel(c, on_call_cancel, q) != 0) on_call_cancel(c, q);
}

/* ---------------------------------------------------------- metrics -- */

static const double xfer_secs[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25,  0.5,    1,     2.5,  5,     10,   30};
static const double hop_secs[] = {1e-5,   2.5e-5, 5e-5, 1e-4,  2.5e-4, 5e-4, 1e-3,
                                  2.5e-3, 5e-3,   0.01, 0.025, 0.1,    1};
#define M(f) offsetof(decode, f)
#define PREFILLS "requests admitted, by where their prompt is prefilled"
/* The decode role's metrics (besides the worker's common ones). */
static const cs_metric_def decode_metrics_table[] = {
    {M(m_local), "chunkserve:prefills_total", CS_METRIC_COUNTER, "path=\"local\"", PREFILLS, NULL,
     0},
    {M(m_remote), "chunkserve:prefills_total", CS_METRIC_COUNTER, "path=\"remote\"", PREFILLS, NULL,
     0},
    {M(m_refused), "chunkserve:requests_refused_total", CS_METRIC_COUNTER, NULL,
     "requests refused (RESOURCE_EXHAUSTED): queue limit or no free KV pages", NULL, 0},
    {M(m_xfer_started), "chunkserve:kv_transfers_started_total", CS_METRIC_COUNTER, NULL,
     "KV transfers expected", NULL, 0},
    {M(m_xfer_completed), "chunkserve:kv_transfers_completed_total", CS_METRIC_COUNTER, NULL,
     "KV transfers received whole", NULL, 0},
    {M(m_xfer_failed), "chunkserve:kv_transfers_failed_total", CS_METRIC_COUNTER, NULL,
     "KV transfers failed (lease expired, peer died, bad frame, cancelled)", NULL, 0},
    {M(m_xfer_bytes), "chunkserve:kv_transfer_bytes_total", CS_METRIC_COUNTER, NULL,
     "KV payload bytes received", NULL, 0},
    {M(m_proto_errors), "chunkserve:kv_protocol_errors_total", CS_METRIC_COUNTER, NULL,
     "KV connections closed for bad input", NULL, 0},
    {M(m_xfer_seconds), "chunkserve:kv_transfer_seconds", CS_METRIC_HISTOGRAM, NULL,
     "admission to the KV trailer, per completed transfer", xfer_secs,
     sizeof xfer_secs / sizeof xfer_secs[0]},
    {M(m_router_hop), "chunkserve:router_to_worker_seconds", CS_METRIC_HISTOGRAM, NULL,
     "the router's receipt of a client call to this worker's receipt of its Decode call (wall "
     "clocks)",
     hop_secs, sizeof hop_secs / sizeof hop_secs[0]},
    {M(m_leases_expired), "chunkserve:kv_leases_expired_total", CS_METRIC_COUNTER, NULL,
     "reservations freed at their deadline", NULL, 0},
    {M(m_ttft), "chunkserve:time_to_first_token_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Decode call received to first token, at this worker", cs_metrics_ttft_buckets, 0},
    {M(m_itl), "chunkserve:inter_token_latency_seconds", CS_METRIC_HISTOGRAM, NULL,
     "time between a sequence's consecutive tokens", cs_metrics_itl_buckets, 0},
};
#undef M
#undef PREFILLS

/* ---------------------------------------------------------- role hooks -- */

static int decode_start(cs_worker *w) {
    decode *d = &g_decode;
    w->role_data = d;
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = cs_kvx_layout_of_engine(w->engine);
    p.pool = cs_kvx_pool_of_engine(w->engine); /* pages land straight in the reserved ids */
    p.host = w->o.kv_host;
    p.port = (int)w->o.kv_port;
    p.require_checksum = w->o.kv_checksum;
    p.dead_ms = (int32_t)w->o.kv_dead_ms;
    int r = cs_kvx_rx_init(&p, &d->rx);
    if (r) return r;
    snprintf(d->kv_endpoint, sizeof d->kv_endpoint, "%s:%d",
             w->o.kv_advertise ? w->o.kv_advertise : w->o.kv_host, cs_kvx_rx_port(d->rx));
    return cs_worker_add_method(w, "/chunkserve.v1.Worker/Decode", CS_RPC_SERVER_STREAMING,
                                &chunkserve__v1__decode_request__descriptor, handle_decode);
}

static void decode_status(cs_worker *w, Chunkserve__V1__WorkerStatus *st) {
    st->kv_endpoint = g_decode.kv_endpoint;
    if (g_decode.rx) cs_worker_kv_status(w, cs_kvx_rx_payload(g_decode.rx), st);
}

static void decode_metrics(cs_worker *w) {
    (void)w;
    decode *d = &g_decode;
    if (!d->rx) return;
    cs_kvx_stats s;
    cs_kvx_rx_get_stats(d->rx, &s);
    cs_metric_add(d->m_xfer_started, (double)(s.transfers_started - d->last.transfers_started));
    cs_metric_add(d->m_xfer_completed,
                  (double)(s.transfers_completed - d->last.transfers_completed));
    cs_metric_add(d->m_xfer_failed, (double)(s.transfers_failed - d->last.transfers_failed));
    cs_metric_add(d->m_xfer_bytes, (double)(s.bytes - d->last.bytes));
    cs_metric_add(d->m_proto_errors, (double)(s.protocol_errors - d->last.protocol_errors));
    d->last = s;
}

static bool decode_cancel(cs_worker *w, uint64_t transfer_id) {
    (void)w;
    for (dreq *q = g_decode.live; q; q = q->next)
        if (q->transfer_id == transfer_id) {
            q->end_code = CS_RPC_CANCELLED;
            q->end_msg = "cancelled by Worker/Cancel";
            dreq_cancel(q);
            return true;
        }
    return false;
}

static int32_t decode_n_calls(cs_worker *w) {
    (void)w;
    int32_t n = 0;
    for (dreq *q = g_decode.live; q; q = q->next)
        n += q->call != NULL;
    return n;
}

static void decode_cancel_all(cs_worker *w) {
    (void)w;
    int n = 0;
    for (dreq *q = g_decode.live; q; q = q->next) {
        if (!q->call) continue;
        q->end_code = CS_RPC_UNAVAILABLE;
        q->end_msg = "the decode worker is shutting down";
        dreq_cancel(q);
        n++;
    }
    if (n) CS_LOGI("grace period over: cancelling %d streams", n);
}

static void decode_stop(cs_worker *w) {
    (void)w;
    cs_kvx_rx_free(g_decode.rx); /* pending transfers fail: their callbacks cancel in the engine */
    g_decode.rx = NULL;
}

static const cs_config_entry config[] = {
    CS_WORKER_CONFIG_COMMON("50060", "512", "4", "0"),
    {"kv-host", CS_CONFIG_STR, offsetof(cs_worker_opts, kv_host), "127.0.0.1",
     "address of the KV listener prefill workers send pages to", 0, 0},
    {"kv-port", CS_CONFIG_INT, offsetof(cs_worker_opts, kv_port), "0",
     "KV listener port; 0 = any free port", 0, 65535},
    {"kv-advertise", CS_CONFIG_STR, offsetof(cs_worker_opts, kv_advertise), NULL,
     "host prefill workers should connect to (default --kv-host; set it when binding 0.0.0.0)", 0,
     0},
    {"lease-ms", CS_CONFIG_INT, offsetof(cs_worker_opts, lease_ms), "120000",
     "a reservation whose KV has not arrived by then is freed (the router's lease_ms overrides)",
     100, 3600000},
};

const cs_worker_role cs_decode_role = {
    .name = "decode",
    .role = CHUNKSERVE__V1__WORKER_ROLE__WORKER_ROLE_DECODE,
    .config = config,
    .n_config = sizeof config / sizeof config[0],
    .summary = "the decode worker: admits requests by free KV pages, receives prompt KV from "
               "prefill workers, "
               "runs mixed decode/prefill steps under its budget and streams tokens",
    .start = decode_start,
    .metrics_table = decode_metrics_table,
    .n_metrics_table = sizeof decode_metrics_table / sizeof decode_metrics_table[0],
    .status = decode_status,
    .metrics = decode_metrics,
    .cancel = decode_cancel,
    .n_calls = decode_n_calls,
    .cancel_all = decode_cancel_all,
    .stop = decode_stop,
};
