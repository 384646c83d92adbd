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
 * A dreq is a cs_worker_call (worker.h: admission, references, the drain's
 * posting and the answer are the shell's); it adds a reference while a KV
 * transfer is expected (dropped by the rx done callback). */
#include <netdb.h>
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
#include "stream.h"
#include "worker.h"

typedef struct decode decode;

typedef struct dreq {
    cs_worker_call base; /* first: the shell's part (base.life.mu guards the fields below it) */
    decode *d;
    bool local, logprobs;
    int32_t lease_ms;
    char kv_sender[64]; /* the only sender whose pages are taken ("" = any authenticated) */
    int32_t n_prompt;

    bool admitted, sent_admitted, logged, expected, kv_done, cancel_requested;
    int32_t pages_reserved, n_context;
    int kv_status;
    char kv_error[256];
    cs_stream st; /* the output and the outcome (api/stream.h) */
} dreq;

struct decode {
    cs_kvx_rx *rx;
    char kv_endpoint[300];
    cs_kvx_stats last; /* exported so far */
    cs_metric *m_local, *m_remote, *m_xfer_started, *m_xfer_completed, *m_xfer_failed,
        *m_xfer_bytes, *m_xfer_seconds, *m_leases_expired, *m_proto_errors, *m_stale_frames,
        *m_renewals, *m_router_hop;
};

static void decode_call_free(cs_worker_call *c) {
    cs_stream_free(&((dreq *)c)->st);
}

/* ------------------------------------------------- engine + I/O threads -- */

/* KV I/O thread: the transfer into the reserved pages ended. */
static void on_kv_done(void *arg, uint64_t xfer, int status, const char *msg,
                       const cs_kvx_trailer *t) {
    dreq *q = arg;
    decode *d = q->d;
    double secs = cs_now() - q->base.t_start;
    pthread_mutex_lock(&q->base.life.mu);
    q->kv_done = true;
    if (!status && (t->prompt_len != q->n_context || t->total_pages != q->pages_reserved)) {
        status = CS_EPROTO;
        msg = "the trailer does not match the request (prompt length or pages)";
    }
    if (status) {
        q->kv_status = status;
        snprintf(q->kv_error, sizeof q->kv_error, "%s", msg && msg[0] ? msg : cs_strerror(status));
    }
    pthread_mutex_unlock(&q->base.life.mu);
    if (!status) {
        cs_metric_observe(d->m_xfer_seconds, secs);
        cs_logprobs lp = {.logprob = t->first_logprob, .n_top = t->n_top};
        memcpy(lp.top_ids, t->top_ids, sizeof lp.top_ids);
        memcpy(lp.top_logprobs, t->top_logprobs, sizeof lp.top_logprobs);
        if (cs_serve_kv_ready(q->base.w->sv, q->base.id, t->first_token, t->n_cached,
                              q->logprobs ? &lp : NULL) != 0)
            cs_serve_cancel(q->base.w->sv, q->base.id);
    } else {
        if (status == CS_ETIMEDOUT) cs_metric_inc(d->m_leases_expired);
        CS_LOGW("request %s: KV transfer %016llx failed: %s", q->base.request_id,
                (unsigned long long)xfer, q->kv_error);
        cs_serve_cancel(q->base.w->sv,
                        q->base.id); /* frees the pages: the transport is done with them */
    }
    cs_live_req_unref(&q->base.life);
}

/* Engine thread: every event of the request. */
static void on_event(void *user, const cs_event *ev) {
    dreq *q = user;
    decode *d = q->d;
    pthread_mutex_lock(&q->base.life.mu);
    if (ev->token < 0 && ev->finish == CS_FINISH_NONE &&
        ev->kv_pages) { /* admission: pages reserved */
        q->admitted = true;
        q->pages_reserved = ev->kv_n_pages;
        cs_metric_inc(q->local ? d->m_local : d->m_remote);
        if (!q->local && !q->cancel_requested) {
            cs_live_req_ref(&q->base.life);
            int r = cs_kvx_rx_expect(d->rx, q->base.transfer_id, q->kv_sender, ev->kv_pages,
                                     ev->kv_n_pages, q->lease_ms, on_kv_done, q);
            if (r == 0) {
                q->expected = true;
            } else {
                /* never the last: the engine holds one */
                cs_live_req_unref_not_last(&q->base.life);
                q->kv_status = r;
                snprintf(q->kv_error, sizeof q->kv_error, "cannot expect the KV transfer: %s",
                         cs_last_error());
                cs_serve_cancel(q->base.w->sv, q->base.id);
            }
        }
    } else {
        cs_stream_event(&q->st, ev);
        if (ev->finish == CS_FINISH_ERROR && ev->status == CS_ENOSPC)
            cs_metric_inc(q->base.w->em.refused);
    }
    cs_live_req_post_locked(&q->base.life);
    pthread_mutex_unlock(&q->base.life.mu);
    if (ev->finish != CS_FINISH_NONE) cs_live_req_unref(&q->base.life); /* the engine's */
}

/* ---------------------------------------------------------- loop thread -- */

/* The payload the KV listener takes: the engine's pool decides (host: TCP,
 * device: NCCL). */
static Chunkserve__V1__KvTransport kv_transport(decode *d) {
    return cs_worker_kv_transport(cs_kvx_rx_payload(d->rx));
}

static int send_admitted(dreq *q, int32_t pages) {
    Chunkserve__V1__DecodeAdmitted a = CHUNKSERVE__V1__DECODE_ADMITTED__INIT;
    a.transfer_id = q->base.transfer_id;
    a.pages_reserved = pages;
    a.kv_endpoint = q->d->kv_endpoint;
    a.kv_transport = kv_transport(q->d);
    Chunkserve__V1__DecodeResponse r = CHUNKSERVE__V1__DECODE_RESPONSE__INIT;
    r.event_case = CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_ADMITTED;
    r.admitted = &a;
    return cs_rpc_call_send_msg(q->base.call, &r.base);
}

static int send_output(dreq *q, const cs_stream *snap) {
    Chunkserve__V1__GenerateResponse g;
    void *scratch;
    if (cs_stream_response(snap, q->logprobs, q->n_prompt, &g, &scratch)) return CS_ENOMEM;
    Chunkserve__V1__DecodeResponse r = CHUNKSERVE__V1__DECODE_RESPONSE__INIT;
    r.event_case = CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_OUTPUT;
    r.output = &g;
    int rc = cs_rpc_call_send_msg(q->base.call, &r.base);
    cs_outbuf_response_free(scratch);
    return rc;
}

/* Cancels the request wherever it is. While a KV transfer is expected the
 * transport is cancelled first: its done callback then cancels in the engine
 * (freeing pages the transport might otherwise still write). */
static void decode_cancel(cs_worker_call *c) {
    dreq *q = (dreq *)c;
    pthread_mutex_lock(&q->base.life.mu);
    q->cancel_requested = true;
    bool via_rx = q->expected && !q->kv_done;
    pthread_mutex_unlock(&q->base.life.mu);
    if (!via_rx || cs_kvx_rx_cancel(q->d->rx, q->base.transfer_id) != 0)
        cs_serve_cancel(q->base.w->sv, q->base.id);
}

/* The drain: sends `admitted`, then the outputs, then the status. */
static void decode_drain(cs_worker_call *c) {
    dreq *q = (dreq *)c;
    pthread_mutex_lock(&q->base.life.mu);
    cs_stream snap;
    cs_stream_take(&q->st, &snap);
    bool admit = q->admitted && !q->sent_admitted, log_end = snap.done && !q->logged;
    q->sent_admitted |= admit;
    q->logged |= snap.done;
    int32_t pages = q->pages_reserved;
    int kv_status = q->kv_status;
    char kv_error[256];
    memcpy(kv_error, q->kv_error, sizeof kv_error);
    pthread_mutex_unlock(&q->base.life.mu);

    if (c->call) {
        int rc = admit ? send_admitted(q, pages) : 0;
        if (!rc && snap.out.oom) rc = CS_ENOMEM;
        if (!rc && cs_stream_has_message(&snap)) rc = send_output(q, &snap);
        cs_stream_end end;
        cs_stream_outcome(&snap, rc, cs_rpc_call_pending_bytes(c->call), "the router", c->end_code,
                          c->end_msg, &end);
        if (rc != CS_ENOMEM && snap.done && snap.finish == CS_FINISH_CANCELLED && kv_status) {
            /* ABORTED: the transfer into this worker failed (the link or the
             * sender), this worker is fine; a lease that ran out is this
             * worker giving up on a slow prefill: UNAVAILABLE */
            end.code = kv_status == CS_ETIMEDOUT ? CS_RPC_UNAVAILABLE : CS_RPC_ABORTED;
            snprintf(end.msg, sizeof end.msg, "%s: %s",
                     kv_status == CS_ETIMEDOUT ? "KV lease expired before the transfer completed"
                                               : "KV transfer failed",
                     kv_error);
        }
        if (end.code >= 0) cs_worker_call_finish(c, end.code, end.code ? end.msg : NULL);
        if (end.cancel) decode_cancel(c);
    }
    if (log_end)
        CS_LOGI("request %s (transfer %016llx, %s prefill): %s, %d + %d tokens in %.3f s%s%s",
                q->base.request_id, (unsigned long long)q->base.transfer_id,
                q->local ? "local" : "remote", cs_finish_name(snap.finish), q->n_prompt,
                snap.n_completion, cs_now() - q->base.t_start,
                snap.error[0] || kv_error[0] ? ": " : "", snap.error[0] ? snap.error : kv_error);
    cs_stream_free(&snap);
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
    decode *d = w->role_data;
    const Chunkserve__V1__DecodeRequest *m = (const void *)cs_rpc_call_request_msg(c);
    cs_request r;
    dreq *q = (dreq *)cs_worker_admit(w, c, m->token_ids, m->n_token_ids, m->num_prompt_tokens,
                                      m->sampling, m->transfer_id, m->request_id, m->cache_salt,
                                      m->tenant, &r);
    if (!q) return;
    observe_router_hop(d, c);
    q->d = d;
    q->local = m->local_prefill;
    snprintf(q->kv_sender, sizeof q->kv_sender, "%s", m->kv_sender ? m->kv_sender : "");
    /* --lease-ms is the default and the most a caller gets: a reservation
     * can never hold pages longer than the operator allowed */
    q->lease_ms =
        m->lease_ms > 0 && m->lease_ms < w->o.lease_ms ? m->lease_ms : (int32_t)w->o.lease_ms;
    q->logprobs = r.logprobs;
    q->st.tok = &w->tok;
    q->st.t_start = q->base.t_start;
    q->n_prompt = m->num_prompt_tokens;
    q->n_context = (int32_t)m->n_token_ids;
    r.kv_mode = q->local ? CS_KV_LOCAL : CS_KV_REMOTE;
    r.reserve = true;
    cs_worker_call_submit(&q->base, &r, on_event);
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
    {M(m_renewals), "chunkserve:kv_lease_renewals_total", CS_METRIC_COUNTER, NULL,
     "reservations extended by their prefill worker while the prompt waits or runs", NULL, 0},
    {M(m_stale_frames), "chunkserve:kv_stale_frames_total", CS_METRIC_COUNTER, NULL,
     "KV frames for a transfer that had ended or was never expected here: dropped and "
     "answered with ABORT (the channel stays open)",
     NULL, 0},
    {M(m_xfer_seconds), "chunkserve:kv_transfer_seconds", CS_METRIC_HISTOGRAM, NULL,
     "admission to the KV trailer, per completed transfer", xfer_secs,
     sizeof xfer_secs / sizeof xfer_secs[0]},
    {M(m_router_hop), "chunkserve:router_to_worker_seconds", CS_METRIC_HISTOGRAM, NULL,
     "the router's receipt of a client call to this worker's receipt of its Decode call (wall "
     "clocks)",
     hop_secs, sizeof hop_secs / sizeof hop_secs[0]},
    {M(m_leases_expired), "chunkserve:kv_leases_expired_total", CS_METRIC_COUNTER, NULL,
     "reservations freed at their deadline", NULL, 0},
};
#undef M
#undef PREFILLS

/* ---------------------------------------------------------- role hooks -- */

/* The KV endpoint prefill workers are told: host resolved here, once, to a
 * numeric address (they connect to numbers only, so no KV I/O thread ever
 * waits on DNS), IPv6 in brackets. */
static int advertised_endpoint(const char *host, int port, char *out, size_t cap) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    int gr = getaddrinfo(host, NULL, &hints, &res);
    if (gr != 0)
        return cs_fail(CS_EINVAL, "cannot resolve the KV address %s: %s", host, gai_strerror(gr));
    char num[NI_MAXHOST];
    gr = getnameinfo(res->ai_addr, res->ai_addrlen, num, sizeof num, NULL, 0, NI_NUMERICHOST);
    bool v6 = res->ai_family == AF_INET6;
    freeaddrinfo(res);
    if (gr != 0) return cs_fail(CS_EINVAL, "KV address %s: %s", host, gai_strerror(gr));
    if (strcmp(num, host)) CS_LOGI("KV endpoint: %s is advertised as %s", host, num);
    snprintf(out, cap, v6 ? "[%s]:%d" : "%s:%d", num, port);
    return 0;
}

static int decode_start(cs_worker *w) {
    decode *d = w->role_data;
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = cs_kvx_layout_of_engine(w->engine);
    p.pool = cs_kvx_pool_of_engine(w->engine); /* pages land straight in the reserved ids */
    p.host = w->o.kv_host;
    p.port = (int)w->o.kv_port;
    p.require_checksum = w->o.kv_checksum;
    p.dead_ms = (int32_t)w->o.kv_dead_ms;
    p.secret = &w->secret; /* senders must prove the cluster secret */
    int r = cs_kvx_rx_init(&p, &d->rx);
    if (r) return r;
    r = advertised_endpoint(w->o.kv_advertise ? w->o.kv_advertise : w->o.kv_host,
                            cs_kvx_rx_port(d->rx), d->kv_endpoint, sizeof d->kv_endpoint);
    if (r) return r;
    return cs_worker_add_method(w, "/chunkserve.v1.Worker/Decode", CS_RPC_SERVER_STREAMING,
                                &chunkserve__v1__decode_request__descriptor, handle_decode);
}

static void decode_secret_changed(cs_worker *w) {
    decode *d = w->role_data;
    if (d->rx) cs_kvx_rx_set_secret(d->rx, &w->secret);
}

static void decode_status(cs_worker *w, Chunkserve__V1__WorkerStatus *st) {
    decode *d = w->role_data;
    st->kv_endpoint = d->kv_endpoint;
    if (d->rx) cs_worker_kv_status(w, cs_kvx_rx_payload(d->rx), st);
}

static void decode_metrics(cs_worker *w) {
    decode *d = w->role_data;
    if (!d->rx) return;
    cs_kvx_stats s;
    cs_kvx_rx_get_stats(d->rx, &s);
    cs_metric_add(d->m_xfer_started, (double)(s.transfers_started - d->last.transfers_started));
    cs_metric_add(d->m_xfer_completed,
                  (double)(s.transfers_completed - d->last.transfers_completed));
    cs_metric_add(d->m_xfer_failed, (double)(s.transfers_failed - d->last.transfers_failed));
    cs_metric_add(d->m_xfer_bytes, (double)(s.bytes - d->last.bytes));
    cs_metric_add(d->m_proto_errors, (double)(s.protocol_errors - d->last.protocol_errors));
    cs_metric_add(d->m_stale_frames, (double)(s.stale_frames - d->last.stale_frames));
    cs_metric_add(d->m_renewals, (double)(s.renewals - d->last.renewals));
    d->last = s;
}

static void decode_stop(cs_worker *w) {
    decode *d = w->role_data;
    cs_kvx_rx_free(d->rx); /* pending transfers fail: their callbacks cancel in the engine */
    d->rx = NULL;
}

/* The shared options' defaults for decode: a step budget that keeps the
 * inter-token latency low, up to four local prompts part-way at once. */
static const cs_config_default config_defaults[] = {
    {"port", "50060"},
    {"max-batched-tokens", "512"},
    {"max-partial-prefills", "4"},
    {"max-chunk-tokens", "0"},
    {"grpc-keepalive-ms", "5000"}, /* its callers are routers: a dead one is found fast */
    {"grpc-keepalive-timeout-ms", "5000"},
};

static const cs_config_entry config[] = {
    {"kv-host", CS_CONFIG_STR, offsetof(cs_worker_opts, kv_host), "127.0.0.1",
     "address of the KV listener prefill workers send pages to", 0, 0},
    {"kv-port", CS_CONFIG_INT, offsetof(cs_worker_opts, kv_port), "0",
     "KV listener port; 0 = any free port", 0, 65535},
    {"kv-advertise", CS_CONFIG_STR, offsetof(cs_worker_opts, kv_advertise), NULL,
     "host prefill workers should connect to (default --kv-host; set it when binding 0.0.0.0)", 0,
     0},
    {"lease-ms", CS_CONFIG_INT, offsetof(cs_worker_opts, lease_ms), "10000",
     "a reservation whose KV has not arrived by then is freed; every renewal from its prefill "
     "worker (--kv-renew-ms) moves that to lease-ms later (the router's lease_ms may shorten "
     "it, never lengthen it)",
     100, 3600000},
};

const cs_worker_role cs_decode_role = {
    .name = "decode",
    .role = CHUNKSERVE__V1__WORKER_ROLE__WORKER_ROLE_DECODE,
    .config = config,
    .n_config = sizeof config / sizeof config[0],
    .speculates = true,
    .config_defaults = config_defaults,
    .n_config_defaults = sizeof config_defaults / sizeof config_defaults[0],
    .summary = "the decode worker: admits requests by free KV pages, receives prompt KV from "
               "prefill workers, "
               "runs mixed decode/prefill steps under its budget and streams tokens",
    .state_size = sizeof(decode),
    .call_size = sizeof(dreq),
    .start = decode_start,
    .metrics_table = decode_metrics_table,
    .token_metrics = true,
    .n_metrics_table = sizeof decode_metrics_table / sizeof decode_metrics_table[0],
    .status = decode_status,
    .secret_changed = decode_secret_changed,
    .metrics = decode_metrics,
    .drain = decode_drain,
    .cancel = decode_cancel,
    .stop = decode_stop,
    .call_free = decode_call_free,
};
