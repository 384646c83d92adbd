/* router.c: chunkserve-router's Generation handler and its process hooks
 * (architecture.md: request flow, failure contract). The router is three parts
 * (router-impl.h): this file admits requests and runs the process; a
 * request's life is request.c (a state machine with its table in
 * router-impl.h); the worker calls are legs.c.
 *
 * A request is validated and tokenized on arrival (api/wire.h, exactly as the
 * single-process server), on libuv's thread pool (api/prepare.h: never on the
 * loop thread, whose stall would look like dead workers), then admitted:
 * placed at once when fewer than
 * max-inflight are placed and the waiting ones are not due to be tried
 * again, else queued (FIFO, at most max-queue), else refused
 * RESOURCE_EXHAUSTED.
 *
 * Shutdown is the process shell's drain (chunkserve/proc.h): new calls are
 * refused UNAVAILABLE, the requests here get grace-ms, then every one left
 * ends UNAVAILABLE and its worker calls are cancelled; once the RPC server is
 * gone the pools close and everything is freed in reverse order. */
#include "router.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/fault.h"
#include "chunkserve/log.h"
#include "generation.h"
#include "prepare.h"
#include "router-impl.h"

#define SERVICE CS_GENERATION_SERVICE

/* --------------------------------------------------------- handlers -- */

/* The client cancelled or went away, or its deadline passed: the workers'
 * calls are cancelled at once (that is how cancellation reaches them). */
static void on_call_cancel(cs_gen_call *c, void *data) {
    req *q = data;
    bool deadline = cs_gen_call_deadline_ms(c) <= 0;
    CS_LOGD("request %s: call cancelled (%s)", q->id, deadline ? "deadline" : "client");
    cs__req_end(q, deadline ? CS_RPC_DEADLINE_EXCEEDED : CS_RPC_CANCELLED, NULL);
}

static int copy_sampling(const Chunkserve__V1__SamplingParams *p,
                         Chunkserve__V1__SamplingParams **out) {
    *out = NULL;
    if (!p) return 0;
    size_t len = protobuf_c_message_get_packed_size(&p->base);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) return CS_ENOMEM;
    protobuf_c_message_pack(&p->base, buf);
    int rc = cs_rpc_unpack(&chunkserve__v1__sampling_params__descriptor, buf, len,
                           (ProtobufCMessage **)out);
    free(buf);
    return rc ? CS_ENOMEM : 0;
}

static void on_prepared(void *arg, cs_gen_call *c, uint64_t seq, double t_recv, int rc,
                        const char *err, const char *field, cs_wire_request *wp);

/* Generate, from either door (gRPC below, or the OpenAI HTTP routes): the
 * request is validated and tokenized on the thread pool (api/prepare.h),
 * then admitted in on_prepared. Requests being prepared count as waiting. */
static void generate(void *arg, cs_gen_call *c) {
    router *r = arg;
    if (r->stopping) {
        cs__router_fault_end(r, r->next_seq + 1);
        cs__router_count_code(r, CS_RPC_UNAVAILABLE);
        cs_gen_call_finish(c, CS_RPC_UNAVAILABLE, "the router is shutting down");
        return;
    }
    if (r->n_preparing + r->n_queued >= r->o->max_queue + r->o->max_inflight) {
        cs__router_fault_end(r, r->next_seq + 1);
        char msg[200];
        snprintf(msg, sizeof msg,
                 "the router is overloaded: %d requests being tokenized and %d waiting "
                 "(--max-queue %lld); retry later",
                 r->n_preparing, r->n_queued, (long long)r->o->max_queue);
        cs__router_count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    if (cs_prepare_generate(cs_proc_uv(r->proc), &r->wm, c, ++r->next_seq, on_prepared, r) != 0) {
        cs__router_fault_end(r, r->next_seq);
        cs__router_count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    r->n_preparing++;
}

/* A predicted time to first token on one pool. */
typedef struct {
    int pool;         /* enum cs_pool_role */
    double queued;    /* the queue part (cs_pool_ttft): NAN when no worker reports a rate */
    double rate;      /* that worker's prefill rate */
    double alone;     /* the time with nothing queued, the rest learnt alone added */
    double predicted; /* queued plus the rest learnt (cs_ttft_rest): the prediction */
    bool busy;        /* prompt tokens ahead of its own: the worker is in a step */
} ttft_guess;

static ttft_guess guess_ttft(router *r, int pool, int64_t n, const cs_place_class *c) {
    ttft_guess g = {.pool = pool, .rate = NAN};
    g.queued = cs_pool_ttft(r->pool, (enum cs_pool_role)pool, n, c, &g.alone, &g.rate);
    g.predicted = g.queued;
    g.busy = g.queued * g.rate > (double)n + 0.5;
    double rest = cs_ttft_rest_get(&r->ttft_rest[pool], g.busy, g.rate);
    double rest_idle = g.busy ? cs_ttft_rest_get(&r->ttft_rest[pool], false, g.rate) : rest;
    if (!isnan(g.queued) && !isnan(rest)) {
        g.predicted = fmax(g.queued + rest, 0);
        g.alone = fmax(g.alone + rest_idle, 0);
    }
    return g;
}

/* The request is tokenized (or refused): admitted now, queued, or refused. */
static void on_prepared(void *arg, cs_gen_call *c, uint64_t seq, double t_recv, int rc,
                        const char *err, const char *field, cs_wire_request *wp) {
    router *r = arg;
    const Chunkserve__V1__GenerateRequest *m = c->req;
    cs_wire_request w = *wp;
    r->n_preparing--;
    if (rc) {
        cs__router_fault_end(r, seq);
        int code = cs_rpc_code_of_status(rc);
        CS_LOGD("request rejected: %s", err); /* its id may be what is bad */
        cs__router_count_code(r, code);
        cs_gen_call_refuse(c, code, err, field);
        return;
    }
    if (r->grace_over || !r->pool) { /* prepared after the grace period ended */
        cs__router_fault_end(r, seq);
        cs_wire_request_free(&w);
        cs__router_count_code(r, CS_RPC_UNAVAILABLE);
        cs_gen_call_finish(c, CS_RPC_UNAVAILABLE, "the router is shutting down");
        return;
    }
    /* demand counts as it arrives, refused or not (a refusal is demand unmet), by where
     * its prompt is to be prefilled (request.c start_attempt): a long prompt the prefill
     * pool is too busy for, prefilled on a decode worker to keep its TTFT bound (below),
     * is the prefill pool's demand unmet too */
    bool remote = w.r.n_prompt >= r->o->local_prefill_threshold &&
                  cs_pool_n_usable(r->pool, CS_POOL_PREFILL) > 0;
    cs_rate_add(remote ? &r->prompt_demand : &r->local_demand, w.r.n_prompt, cs_now(),
                r->o->autoscale_window_s);
    /* Behind those waiting only while a run of the queue is wanted: every change
     * that may let a waiting request in (a slot freed, a status) asks for one, so
     * with none wanted each was tried against the pools as they are, and this one,
     * which may fit where they do not (a short prompt beside long contexts waiting
     * for KV room), is tried now rather than at the next status. */
    bool queue = r->n_placed >= r->o->max_inflight ||
                 (r->qhead && (!r->handles_ok || r->pump_wanted));
    if (queue && r->n_queued >= r->o->max_queue) {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "the router is overloaded: %d requests placed and %d waiting (--max-queue "
                 "%lld); retry later",
                 r->n_placed, r->n_queued, (long long)r->o->max_queue);
        cs__router_fault_end(r, seq);
        cs_wire_request_free(&w);
        cs__router_count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    /* the TTFT the workers' queues predict (prefill pool for a long prompt,
     * else the decode workers' own prefill), what they leave out added, and
     * the refusal it may bring */
    const cs_place_class cls = {w.r.priority, w.r.tenant};
    ttft_guess p = {.queued = NAN};
    if (w.r.n_prompt >= r->o->local_prefill_threshold)
        p = guess_ttft(r, CS_POOL_PREFILL, w.r.n_prompt, &cls);
    if (isnan(p.queued)) p = guess_ttft(r, CS_POOL_DECODE, w.r.n_prompt, &cls);
    double bound = cs_slo_ttft_bound(&r->o->slo, w.r.priority);
    int64_t retry = cs_slo_refuse_ms(p.predicted, p.alone, bound);
    bool local = false;
    if (retry && p.pool == CS_POOL_PREFILL) {
        /* the prefill pool would miss the bound: a decode worker's own prefill
         * instead, when that is predicted to meet it (disaggregation as long as it
         * keeps the SLO, then its decode pool's spare steps, then a refusal) */
        ttft_guess l = guess_ttft(r, CS_POOL_DECODE, w.r.n_prompt, &cls);
        if (isfinite(l.predicted) && l.predicted < p.predicted && l.predicted <= bound)
            p = l, retry = 0, local = true;
    }
    if (retry && !c->sibling) { /* a sibling goes with the first (gen_call.h) */
        char msg[300];
        snprintf(msg, sizeof msg,
                 "the predicted time to first token is %.2f s, over the bound of %.2f s for "
                 "priority %d (--ttft-slo-ms): the workers are busy; retry in %.1f s",
                 p.predicted, bound, w.r.priority, retry / 1e3);
        cs__router_fault_end(r, seq);
        cs_wire_request_free(&w);
        cs_metric_inc(r->m.ttft_refused);
        cs__router_count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_gen_call_refuse_retry(c, msg, retry);
        return;
    }
    req *q = calloc(1, sizeof *q);
    char idbuf[40];
    snprintf(idbuf, sizeof idbuf, "rt-%016" PRIx64, cs__splitmix64(r->id_base ^ (seq << 1)));
    if (q) q->id = strdup(m->request_id[0] ? m->request_id : idbuf);
    if (q) q->cache_salt = strdup(m->cache_salt);
    if (q) q->tenant = strdup(w.r.tenant ? w.r.tenant : ""); /* the key's, or m's */
    if (!q || !q->id || !q->cache_salt || !q->tenant ||
        copy_sampling(m->sampling, &q->sampling) != 0) {
        if (q) free(q->id), free(q->cache_salt), free(q->tenant);
        free(q);
        cs__router_fault_end(r, seq);
        cs_wire_request_free(&w);
        cs__router_count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    const cs_model_config *cfg = cs_model_get_config(r->wm.model);
    q->r = r;
    q->call = c;
    q->seq = seq;
    q->priority = w.r.priority;
    q->predicted_ttft = isfinite(p.predicted) ? p.predicted : 0;
    q->predicted_tokens = p.queued * p.rate; /* NAN without a prediction */
    q->predicted_busy = p.busy;
    q->predicted_pool = isfinite(p.queued) ? p.pool : -1;
    q->slo_local = local;
    if (seq == r->fault_seq) memcpy(q->fault_worker, r->fault_worker, sizeof q->fault_worker);
    q->ctx = w.prompt; /* taken over */
    q->n_ctx = q->cap_ctx = (size_t)w.r.n_prompt;
    q->n_prompt = w.r.n_prompt;
    w.prompt = NULL;
    w.r.prompt = NULL;
    int32_t room = cfg->ctx_len - q->n_prompt;
    q->max_new = m->sampling && m->sampling->max_tokens > 0 && m->sampling->max_tokens < room
                     ? m->sampling->max_tokens
                     : room;
    q->t_recv = t_recv;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    q->t_recv_wall_us = (int64_t)wall.tv_sec * 1000000 + wall.tv_nsec / 1000 -
                        (int64_t)((cs_now() - t_recv) * 1e6); /* at receipt, before tokenizing */
    int64_t client_ms = cs_gen_call_deadline_ms(c); /* what is left of it now, after tokenizing */
    q->t_deadline = client_ms == INT64_MAX ? t_recv + r->o->request_timeout_ms / 1000.0
                                           : cs_now() + client_ms / 1000.0;
    q->next = r->live;
    if (r->live) r->live->prev = q;
    r->live = q;
    r->n_live++;
    cs_wire_request_free(&w);
    CS_LOGD("request %s: %d prompt tokens, up to %d new", q->id, q->n_prompt, q->max_new);
    if (cs_gen_call_on_cancel(c, on_call_cancel, q) != 0) {
        on_call_cancel(c, q); /* already dead */
        return;
    }
    if (queue) {
        cs__req_park(q, WAIT_SLOT);
        if (r->n_placed < r->o->max_inflight) /* others wait for room: a run is due already */
            cs__router_on_pool_change(r);     /* (at most every PUMP_MIN_MS, as for a status) */
    } else {
        cs__req_attempt(q);
    }
}

void cs__router_fault_end(router *r, uint64_t seq) {
    if (!seq || seq != r->fault_seq) return;
    r->fault_seq = 0;
    CS_LOGW("fault injection: request %llu ended, the armed allocation %s", (unsigned long long)seq,
            cs_fault_alloc_disarm() ? "failed in its life" : "was not reached");
}

/* Fault builds only (fault.h): x-chunkserve-fault-alloc: N fails the Nth
 * allocation from here on, in this request's life (one request at a time). */
static void arm_fault(router *r, cs_rpc_call *rpc) {
    if (!cs_fault_enabled()) return;
    size_t len = 0, wlen = 0;
    const char *v = cs_rpc_call_metadata(rpc, "x-chunkserve-fault-alloc", &len);
    const char *wv = cs_rpc_call_metadata(rpc, "x-chunkserve-fault-alloc-worker", &wlen);
    char buf[24] = "0";
    if ((!v || !len || len >= sizeof buf) && (!wv || !wlen || wlen >= sizeof buf)) return;
    if (v && len && len < sizeof buf) memcpy(buf, v, len), buf[len] = 0;
    r->fault_worker[0] = 0;
    if (wv && wlen && wlen < sizeof r->fault_worker)
        memcpy(r->fault_worker, wv, wlen), r->fault_worker[wlen] = 0;
    r->fault_seq = r->next_seq + 1; /* the seq generate() gives it */
    cs_fault_alloc_arm(strtol(buf, NULL, 10));
}

static void handle_generate(cs_rpc_call *rpc, void *data) {
    router *r = data;
    const char *tenant;
    if (!cs_api_keys_rpc_check(&r->keys, rpc, &tenant)) {
        cs__router_count_code(r, CS_RPC_UNAUTHENTICATED);
        return;
    }
    arm_fault(r, rpc);
    cs_gen_call *c = cs_gen_call_grpc(rpc);
    if (c) {
        c->key_tenant = tenant;
        generate(r, c);
    } else {
        cs__router_fault_end(r, r->next_seq + 1);
    }
}

/* ---------------------------------------------------------- metrics -- */

static const double e2e_buckets[] = {0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,
                                     10,   20,  40,   60,  120, 300, 600};
static const double overhead_buckets[] = {1e-5, 5e-5, 1e-4,  2.5e-4, 5e-4, 1e-3, 2.5e-3,
                                          5e-3, 0.01, 0.025, 0.05,   0.1,  0.5,  1};
#define N_BUCKETS(b) (sizeof b / sizeof b[0])
#define M(f) offsetof(router, m.f)
#define REQUESTS(code, name)                                                                       \
    {                                                                                              \
        M(codes[code]), "chunkserve:requests_total", CS_METRIC_COUNTER, "code=\"" name "\"",       \
            "Generate requests ended, by gRPC status.", NULL, 0                                    \
    }
#define PREFILLS "Prefills, on the decode worker (local) or on a prefill worker (remote)."
/* The router's metrics: one table, the twin of its config table
 * (chunkserve-router --metrics-json prints it). */
static const cs_metric_def router_metrics[] = {
    {M(running), "chunkserve:num_requests_running", CS_METRIC_GAUGE, NULL,
     "Requests placed on workers (Decode call open).", NULL, 0},
    {M(waiting), "chunkserve:num_requests_waiting", CS_METRIC_GAUGE, NULL,
     "Requests waiting in the router's queue.", NULL, 0},
    REQUESTS(CS_RPC_OK, "OK"),
    REQUESTS(CS_RPC_CANCELLED, "CANCELLED"),
    REQUESTS(CS_RPC_UNKNOWN, "UNKNOWN"),
    REQUESTS(CS_RPC_INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    REQUESTS(CS_RPC_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    REQUESTS(CS_RPC_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"),
    REQUESTS(CS_RPC_FAILED_PRECONDITION, "FAILED_PRECONDITION"),
    REQUESTS(CS_RPC_ABORTED, "ABORTED"),
    REQUESTS(CS_RPC_INTERNAL, "INTERNAL"),
    REQUESTS(CS_RPC_UNAVAILABLE, "UNAVAILABLE"),
    REQUESTS(CS_RPC_UNAUTHENTICATED, "UNAUTHENTICATED"),
    {M(prefill_local), "chunkserve:prefills_total", CS_METRIC_COUNTER, "path=\"local\"", PREFILLS,
     NULL, 0},
    {M(prefill_remote), "chunkserve:prefills_total", CS_METRIC_COUNTER, "path=\"remote\"", PREFILLS,
     NULL, 0},
    {M(prefix_predicted), "chunkserve:prefix_predicted_tokens_total", CS_METRIC_COUNTER, NULL,
     "Prompt tokens the router predicted cached on the worker that prefilled them (requests "
     "ended OK; --prefix-routing).",
     NULL, 0},
    {M(prefix_cached), "chunkserve:prefix_cached_tokens_total", CS_METRIC_COUNTER, NULL,
     "Prompt tokens the workers reported taken from their prefix cache (requests ended OK): "
     "against prefix_predicted_tokens_total, the prediction's error.",
     NULL, 0},
    {M(retries), "chunkserve:retries_total", CS_METRIC_COUNTER, NULL,
     "Attempts that failed before any token and were retried.", NULL, 0},
    {M(migrations), "chunkserve:migrations_total", CS_METRIC_COUNTER, NULL,
     "Attempts that failed after tokens streamed and were migrated to another worker.", NULL, 0},
    {M(ttft), "chunkserve:time_to_first_token_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Receipt of the request to its first token relayed.", cs_metrics_ttft_buckets, 0},
    {M(ttft_error), "chunkserve:ttft_prediction_error_ratio", CS_METRIC_HISTOGRAM, NULL,
     "|predicted - measured| / measured time to first token of the requests whose TTFT was "
     "predicted at admission (from the workers' queued prompt tokens and prefill rates)",
     cs_metrics_error_buckets, 0},
    {M(ttft_refused), "chunkserve:requests_refused_ttft_total", CS_METRIC_COUNTER, NULL,
     "Requests refused early (RESOURCE_EXHAUSTED / 429 + Retry-After) because the workers' "
     "queues put their predicted time to first token over --ttft-slo-ms.",
     NULL, 0},
    {M(prefill_slo_local), "chunkserve:prefills_slo_local_total", CS_METRIC_COUNTER, NULL,
     "Long prompts prefilled on a decode worker because the prefill pool was predicted over "
     "their --ttft-slo-ms bound and the decode pool within it (they would have been refused).",
     NULL, 0},
    {M(itl), "chunkserve:inter_token_latency_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Time between token messages relayed to a client.", cs_metrics_itl_buckets, 0},
    {M(e2e), "chunkserve:e2e_request_latency_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Receipt of the request to its last message (OK only).", e2e_buckets, N_BUCKETS(e2e_buckets)},
    {M(overhead), "chunkserve:router_overhead_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Receipt of the request to its first Decode call (validation, tokenization, placement).",
     overhead_buckets, N_BUCKETS(overhead_buckets)},
    {M(prompt_tokens), "chunkserve:prompt_tokens_total", CS_METRIC_COUNTER, NULL,
     "Prompt tokens of requests that got a first token.", NULL, 0},
    {M(gen_tokens), "chunkserve:generation_tokens_total", CS_METRIC_COUNTER, NULL,
     "Tokens relayed to clients.", NULL, 0},
    {M(usable[CS_POOL_PREFILL]), "chunkserve:workers_usable", CS_METRIC_GAUGE, "role=\"prefill\"",
     "Workers usable now.", NULL, 0},
    {M(usable[CS_POOL_DECODE]), "chunkserve:workers_usable", CS_METRIC_GAUGE, "role=\"decode\"",
     "Workers usable now.", NULL, 0},
#define WANTED                                                                                     \
    "The leading autoscaling signal: replicas the pool needs for this router's traffic (prompt "   \
    "tokens/s as requests arrive, output tokens/s relayed; over one replica's measured "            \
    "capacity x --autoscale-utilization). Sum over routers; target AverageValue 1."
    {M(wanted[CS_POOL_PREFILL]), "chunkserve:pool_replicas_wanted", CS_METRIC_GAUGE,
     "role=\"prefill\"", WANTED, NULL, 0},
    {M(wanted[CS_POOL_DECODE]), "chunkserve:pool_replicas_wanted", CS_METRIC_GAUGE,
     "role=\"decode\"", WANTED, NULL, 0},
#define DEMAND                                                                                     \
    "Tokens/s this router sends the pool (prefill: prompt tokens of arriving requests bound "      \
    "for it; decode: output tokens relayed), over --autoscale-window-s."
    {M(demand[CS_POOL_PREFILL]), "chunkserve:pool_demand_tokens_per_second", CS_METRIC_GAUGE,
     "role=\"prefill\"", DEMAND, NULL, 0},
    {M(demand[CS_POOL_DECODE]), "chunkserve:pool_demand_tokens_per_second", CS_METRIC_GAUGE,
     "role=\"decode\"", DEMAND, NULL, 0},
#define CAPACITY                                                                                   \
    "One replica's measured capacity, the mean over the pool's usable workers that report it "     \
    "(prefill: prompt tokens/s; decode: output tokens/s at the step-time target), smoothed over "  \
    "--autoscale-window-s."
    {M(capacity[CS_POOL_PREFILL]), "chunkserve:pool_replica_capacity_tokens_per_second",
     CS_METRIC_GAUGE, "role=\"prefill\"", CAPACITY, NULL, 0},
    {M(capacity[CS_POOL_DECODE]), "chunkserve:pool_replica_capacity_tokens_per_second",
     CS_METRIC_GAUGE, "role=\"decode\"", CAPACITY, NULL, 0},
#undef WANTED
#undef DEMAND
#undef CAPACITY
    {M(lag_max), "chunkserve:router_loop_lag_max_seconds", CS_METRIC_GAUGE, NULL,
     "The longest the router's event loop ran behind its status timer.", NULL, 0},
    {M(stalls), "chunkserve:router_loop_stalls_total", CS_METRIC_COUNTER, NULL,
     "Loop stalls over a second (no worker is declared down right after one).", NULL, 0},
    {M(pair_trips), "chunkserve:kv_pair_breaker_trips_total", CS_METRIC_COUNTER, NULL,
     "A (prefill, decode) pair's KV transfer failed: the pair is avoided for a while.", NULL, 0},
};
#undef M
#undef REQUESTS
#undef PREFILLS
#define N_ROUTER_METRICS (sizeof router_metrics / sizeof router_metrics[0])

void cs_router_print_metrics_json(void *f) {
    cs_metrics_print_json(router_metrics, N_ROUTER_METRICS, f);
}

static void metrics_register(router *r) {
    cs_metrics_register_table(r->metrics, router_metrics, N_ROUTER_METRICS, r);
}

/* The shell reloaded r->secret (in place): the calls to workers carry the
 * new token. */
static void secret_changed(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    cs_pool_rpc_token_changed(r->pool);
}

static void update_metrics(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    cs_metric_set(r->m.running, r->n_placed);
    cs_metric_set(r->m.waiting, r->n_queued);
    for (int role = 0; role < 2; role++)
        cs_metric_set(r->m.usable[role],
                      r->pool ? cs_pool_n_usable(r->pool, (enum cs_pool_role)role) : 0);
    if (r->pool) { /* the leading autoscaling signal (demand.h) */
        double now = cs_now(), tau = r->o->autoscale_window_s, pp, pd, dp, dd;
        cs_pool_capacity(r->pool, CS_POOL_PREFILL, &pp, &pd); /* pd: unused */
        cs_pool_capacity(r->pool, CS_POOL_DECODE, &dp, &dd);
        pp = cs_smooth_add(&r->capacity.prefill, pp, now, tau);
        dp = cs_smooth_add(&r->capacity.decode_prefill, dp, now, tau);
        dd = cs_smooth_add(&r->capacity.decode, dd, now, tau);
        cs_demand d = {.prompt_rate = cs_rate_get(&r->prompt_demand, now, tau),
                       .output_rate = cs_rate_get(&r->output_demand, now, tau),
                       .local_rate = cs_rate_get(&r->local_demand, now, tau),
                       .prefill_cap = pp,
                       .decode_cap = dd,
                       .decode_prefill_cap = dp,
                       .utilization = r->o->autoscale_utilization,
                       .drain_s = r->o->autoscale_drain_s};
        /* its requests before their first token: where they are prefilled once placed
         * (q->local: a local prefill streams from admission, its prompt not computed yet) */
        bool any_prefill = cs_pool_n_usable(r->pool, CS_POOL_PREFILL) > 0;
        for (const req *q = r->live; q; q = q->next) {
            bool placed = q->state == RQ_ADMITTING || q->state == RQ_PREFILL ||
                          q->state == RQ_STREAMING;
            if (q->n_relayed > 0 || q->state == RQ_ENDED || (q->state == RQ_STREAMING && !q->local))
                continue;
            bool remote = placed ? !q->local
                                 : !q->slo_local &&
                                       q->n_prompt >= r->o->local_prefill_threshold && any_prefill;
            *(remote ? &d.prompt_backlog : &d.local_backlog) += q->n_prompt;
        }
        cs_metric_set(r->m.wanted[CS_POOL_PREFILL], cs_demand_prefill_replicas(&d));
        cs_metric_set(r->m.wanted[CS_POOL_DECODE], cs_demand_decode_replicas(&d));
        cs_metric_set(r->m.demand[CS_POOL_PREFILL], d.prompt_rate);
        cs_metric_set(r->m.demand[CS_POOL_DECODE], d.output_rate);
        cs_metric_set(r->m.capacity[CS_POOL_PREFILL], pp);
        cs_metric_set(r->m.capacity[CS_POOL_DECODE], dd);
    }
    if (r->pool) {
        double lag;
        uint64_t stalls;
        cs_pool_loop_lag(r->pool, &lag, &stalls);
        cs_metric_set(r->m.lag_max, lag);
        cs_metric_add(r->m.stalls, (double)(stalls - r->stalls_counted));
        r->stalls_counted = stalls;
        uint64_t trips = cs_pool_pair_trips(r->pool);
        cs_metric_add(r->m.pair_trips, (double)(trips - r->trips_counted));
        r->trips_counted = trips;
    }
}

/* ---------------------------------------- the process shell's hooks -- */

static bool ready(cs_proc *p, void *arg, char *why, size_t why_len) {
    (void)p;
    router *r = arg;
    int n = r->pool ? cs_pool_n_usable(r->pool, CS_POOL_DECODE) : 0;
    if (n == 0 && !r->o->ready_without_workers) {
        snprintf(why, why_len, "no usable decode worker (%d known)",
                 r->pool ? cs_pool_n_workers(r->pool, CS_POOL_DECODE) : 0);
        return false;
    }
    return true;
}

static int start(cs_proc *p, void *arg) {
    router *r = arg;
    const cs_router_opts *o = r->o;
    r->proc = p;
    r->rl = cs_proc_rpc_loop(p);
    r->metrics = cs_proc_metrics(p);
    metrics_register(r);
    cs_rpc_server *srv = cs_proc_server(p);
    int rc =
        cs_rpc_server_add_method(srv, "/" SERVICE "/Generate", CS_RPC_SERVER_STREAMING,
                                 &chunkserve__v1__generate_request__descriptor, handle_generate, r);
    r->gctx = (cs_generation_ctx){&r->wm, &r->keys, cs_proc_uv(p)};
    if (!rc) rc = cs_generation_add_unary(srv, &r->gctx);
    if (!rc)
        rc = cs_openai_start_config(cs_proc_uv(p), &o->openai, &o->tls, o->host, &r->wm, generate,
                                    r, &r->keys, &r->openai);
    if (rc) return rc;
    const cs_model_config *cfg = cs_model_get_config(r->model);
    cs_pool_opts po = {
        .static_workers = {o->prefill_workers, o->decode_workers},
        .dns = {o->prefill_dns, o->decode_dns},
        .dns_refresh_ms = (int32_t)o->dns_refresh_ms,
        .status_interval_ms = (int32_t)o->status_interval_ms,
        .expect_n_vocab = cfg->n_vocab,
        .expect_arch = cfg->arch,
        .expect_ctx_len = cfg->ctx_len,
        .expect_model_fp = cs_model_fingerprint(r->model),
        .expect_tokenizer_fp = r->wm.tokenizer_fingerprint,
        .rpc_token = cs_secret_token(&r->secret),
        .worker_tls = &o->worker_tls,
        .on_change = cs__router_on_pool_change,
        .on_down = cs__router_on_worker_down,
        .arg = r,
    };
    if ((rc = cs_pool_init(cs_proc_uv(p), r->rl, &po, &r->pool))) return rc;
    uv_timer_init(cs_proc_uv(p), &r->tick);
    uv_timer_init(cs_proc_uv(p), &r->pump);
    r->tick.data = r->pump.data = r;
    r->handles_ok = true;
    uv_timer_start(&r->tick, cs__router_on_tick, TICK_MS, TICK_MS);
    return 0;
}

static void started(cs_proc *p, void *arg) {
    router *r = arg;
    const cs_model_config *cfg = cs_model_get_config(r->model);
    CS_LOGI("routing '%s' (vocab %d, context %d) on %s:%d; max %lld in flight, %lld queued; "
            "local prefill below %lld tokens",
            r->wm.name, cfg->n_vocab, cfg->ctx_len, r->o->host, cs_proc_port(p),
            (long long)r->o->max_inflight, (long long)r->o->max_queue,
            (long long)r->o->local_prefill_threshold);
    cs_openai_print_listening(r->openai);
}

static int32_t n_open(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    return r->n_live + r->n_preparing;
}

/* New Generate calls are refused (UNAVAILABLE) from now on; the requests
 * already here keep going until they end or the grace period does. */
static void drain(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    r->stopping = true;
    CS_LOGI("draining: %d requests (%d placed, %d waiting)", r->n_live, r->n_placed, r->n_queued);
}

/* Grace is over: what still streams or waits ends UNAVAILABLE. */
static void cancel_all(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    r->grace_over = true;
    int n = 0;
    req *next;
    for (req *q = r->live; q; q = next) {
        next = q->next;
        if (q->state == RQ_ENDED) continue;
        cs__req_end(q, CS_RPC_UNAVAILABLE, "the router is shutting down");
        n++;
    }
    if (n) CS_LOGI("grace period over: %d requests ended", n);
}

/* Every client call has ended; their worker calls end as the channels go. */
static void stop(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    if (r->handles_ok) {
        r->handles_ok = false;
        uv_close((uv_handle_t *)&r->tick, NULL);
        uv_close((uv_handle_t *)&r->pump, NULL);
    }
    cs_pool_close(r->pool);
    r->pool = NULL;
    cs_openai_close(r->openai);
    r->openai = NULL;
}

static const cs_proc_role router_proc = {
    .name = "router",
    .health_service = SERVICE,
    .start = start,
    .started = started,
    .secret_changed = secret_changed,
    .metrics = update_metrics,
    .ready = ready,
    .n_open = n_open,
    .drain = drain,
    .cancel_all = cancel_all,
    .stop = stop,
};

/* --------------------------------------------------------------- run -- */

int cs_router_run(const cs_model *model, const cs_router_opts *o) {
    router *r = calloc(1, sizeof *r);
    if (!r) return cs_fail(CS_ENOMEM, "out of memory");
    r->o = o;
    r->model = model;
    int rc = cs_secret_load(o->cluster_secret, o->cluster_secret_file, &r->secret);
    if (rc) {
        free(r);
        return rc;
    }
    r->id_base = cs_random_u64(); /* public request ids; transfer ids are drawn apart */
    /* KV room is the workers' to judge: no pool bound here */
    cs_wire_model_init(&r->wm, model, o->model);
    r->wm.n_kv_pages = INT32_MAX;
    r->wm.page_size = 16;
    cs_proc_opts po = {.host = o->host,
                       .port = (int)o->port,
                       .http_host = o->http_host,
                       .http_port = (int)o->http_port,
                       .grace_ms = o->grace_ms,
                       .rpc = o->rpc,
                       .tls = o->tls,
                       .secret = &r->secret,
                       .secret_file = o->cluster_secret_file};
    rc = cs_proc_run(&po, &router_proc, r);
    CS_ASSERT(rc || r->n_live == 0);
    cs_openai_close(r->openai); /* when start failed after opening it */
    cs_api_keys_free(&r->keys);
    cs_secret_clear(&r->secret);
    free(r);
    return rc;
}
