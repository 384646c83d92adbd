/* worker.c: the process skeleton of chunkserve-prefill and chunkserve-decode
 * (see worker.h): the model, the engine and its serving loop, then the
 * process shell (chunkserve/proc.h) with the worker's hooks: the
 * chunkserve.v1.Worker service (GetStatus, Cancel) and health, the common
 * metrics table, and a role (prefill or decode) plugged in through
 * cs_worker_role.
 *
 * Drain (SIGTERM; Kubernetes scale-in) is the shell's: the role refuses new
 * calls (w->stopping) while GetStatus and Cancel keep answering, so the
 * router sees a draining worker, not a dead one, and leaves its streams here
 * until they end or the grace passes (then the role ends the rest and the
 * router retries or migrates them). Once the RPC server is gone the role
 * stops its KV transport, the engine loop stops, and everything is freed in
 * reverse. */
#include "worker.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "chunkserve/clock.h"
#include "chunkserve/ttft.h"
#include "chunkserve/kvx_engine.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

/* ------------------------------------------------------------ helpers -- */

/* Every Worker method: the caller proves the cluster secret (its token in
 * metadata, compared in constant time) or is answered UNAUTHENTICATED
 * before its request is looked at. */
static void gated(cs_rpc_call *c, void *data) {
    cs_worker_method *m = data;
    size_t len = 0;
    const char *v = cs_rpc_call_metadata(c, CS_RPC_TOKEN_KEY, &len);
    if (!cs_secret_check_token(&m->w->secret, v, v ? len : 0)) {
        cs_metric_inc(m->w->m_unauthenticated);
        cs_rpc_call_finish(c, CS_RPC_UNAUTHENTICATED,
                           "this worker takes calls from its cluster only: metadata "
                           "'" CS_RPC_TOKEN_KEY "' (derived from --cluster-secret) is missing "
                           "or wrong");
        return;
    }
    m->fn(c, m->w);
}

int cs_worker_add_method(cs_worker *w, const char *method, enum cs_rpc_method_kind kind,
                         const ProtobufCMessageDescriptor *desc, cs_rpc_handler fn) {
    if (w->n_methods == CS_WORKER_MAX_METHODS) return cs_fail(CS_ENOMEM, "too many methods");
    cs_worker_method *m = &w->methods[w->n_methods++];
    m->w = w;
    m->fn = fn;
    return cs_rpc_server_add_method(cs_proc_server(w->proc), method, kind, desc, gated, m);
}

/* The KV link's payloads (chunkserve/kvx.h) and the proto's KvTransport:
 * one row each. */
static const struct {
    int payload;
    Chunkserve__V1__KvTransport wire;
} kv_transports[] = {
    {CS_KVX_PAYLOAD_TCP, CHUNKSERVE__V1__KV_TRANSPORT__KV_TRANSPORT_TCP},
    {CS_KVX_PAYLOAD_NCCL, CHUNKSERVE__V1__KV_TRANSPORT__KV_TRANSPORT_NCCL},
};

Chunkserve__V1__KvTransport cs_worker_kv_transport(int payload) {
    for (size_t i = 0; i < sizeof kv_transports / sizeof kv_transports[0]; i++)
        if (kv_transports[i].payload == payload) return kv_transports[i].wire;
    return CHUNKSERVE__V1__KV_TRANSPORT__KV_TRANSPORT_UNSPECIFIED;
}

const char *cs_worker_kv_transport_name(Chunkserve__V1__KvTransport t) {
    for (size_t i = 0; i < sizeof kv_transports / sizeof kv_transports[0]; i++)
        if (kv_transports[i].wire == t) return cs_kvx_payload_name(kv_transports[i].payload);
    return "unknown";
}

void cs_worker_kv_status(cs_worker *w, int payload, Chunkserve__V1__WorkerStatus *st) {
    cs_kvx_layout l = cs_kvx_layout_of_engine(w->engine);
    st->kv_transport = cs_worker_kv_transport(payload);
    st->kv_dtype = l.dtype == CS_KVX_DTYPE_BF16  ? CHUNKSERVE__V1__KV_DTYPE__KV_DTYPE_BF16
                   : l.dtype == CS_KVX_DTYPE_F16 ? CHUNKSERVE__V1__KV_DTYPE__KV_DTYPE_F16
                                                 : CHUNKSERVE__V1__KV_DTYPE__KV_DTYPE_F32;
    st->kv_layout_fingerprint = cs_kvx_layout_fingerprint(&l);
    const cs_kv_blocks *b = cs_kv_cache_blocks(cs_engine_kv(w->engine));
    st->kv_pages_per_block = b->per_block;
    st->kv_global_pages_per_block = b->n_global;
    st->kv_window = b->window;
    st->weight_mode = (char *)cs_weight_mode_name(cs_model_weight_mode(w->model));
}

int cs_worker_split_endpoint(const char *ep, char *host, size_t host_len, int *port) {
    const char *colon = strrchr(ep ? ep : "", ':');
    if (!ep || !colon || colon == ep)
        return cs_fail(CS_EINVAL, "endpoint '%s' is not host:port", ep ? ep : "");
    const char *h = ep;
    size_t hl = (size_t)(colon - ep);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2;
    char *end = NULL;
    long p = strtol(colon + 1, &end, 10);
    if (hl == 0 || hl >= host_len || !end || *end || end == colon + 1 || p < 1 || p > 65535)
        return cs_fail(CS_EINVAL, "endpoint '%s' is not host:port", ep);
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (int)p;
    return 0;
}

/* -------------------------------------------------------- Worker calls -- */

static void handle_status(cs_rpc_call *c, void *data) {
    cs_worker *w = data;
    cs_sched_stats st;
    cs_serve_stats(w->sv, &st);
    cs_ttft_load load;
    cs_serve_ttft_load(w->sv, &load);
    cs_wire_status_buf buf;
    Chunkserve__V1__WorkerStatus r;
    cs_wire_worker_status(&w->wm, &st, &load, &buf, &r);
    r.worker_id = w->worker_id;
    r.instance_id = w->instance_id;
    r.role = w->role->role;
    r.ready = !w->stopping;
    r.draining = w->stopping;
    char ep[300] = "";
    r.kv_endpoint = ep;
    if (w->role->status) w->role->status(w, &r);
    const Chunkserve__V1__WorkerStatusRequest *q = (const void *)cs_rpc_call_request_msg(c);
    cs_serve_summary sum;
    if (cs_serve_prefix_summary(w->sv, q->prefix_summary_version, &sum) == 0 && sum.version) {
        r.prefix_summary_version = sum.version;
        r.prefix_summary_bits = (uint32_t)sum.n_bits;
        r.prefix_summary_behind_ms = (uint32_t)(sum.behind_s * 1e3);
        r.prefix_summary.data = sum.bits;
        r.prefix_summary.len = sum.bits ? sum.n_bits / 8 : 0;
    }
    cs_rpc_call_reply_msg(c, &r.base);
    free(sum.bits);
}

static void handle_cancel(cs_rpc_call *c, void *data) {
    cs_worker *w = data;
    const Chunkserve__V1__CancelRequest *m = (const void *)cs_rpc_call_request_msg(c);
    Chunkserve__V1__CancelResponse r = CHUNKSERVE__V1__CANCEL_RESPONSE__INIT;
    for (cs_live_req *l = w->live.head; l && !r.found; l = l->next) {
        cs_worker_call *q = cs_worker_call_of(l);
        if (q->transfer_id == m->transfer_id) {
            q->end_code = CS_RPC_CANCELLED;
            q->end_msg = "cancelled by Worker/Cancel";
            w->role->cancel(q); /* the role's drain answers the call */
            r.found = true;
        }
    }
    CS_LOGD("cancel transfer %016llx (%s): %s", (unsigned long long)m->transfer_id, m->request_id,
            r.found ? "found" : "not found");
    cs_rpc_call_reply_msg(c, &r.base);
}

/* ------------------------------------------------------------- metrics -- */

#define M(f) offsetof(cs_worker, f)
/* The worker's own metrics, besides the engine's table (api/engine_metrics.h)
 * and its role's; --metrics-json prints all three. */
static const cs_metric_def worker_metrics[] = {
    {M(m_unauthenticated), "chunkserve:rpc_unauthenticated_total", CS_METRIC_COUNTER, NULL,
     "Worker calls refused for a missing or wrong cluster token", NULL, 0},
};
#undef M

static void update_metrics(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    cs_engine_metrics_update(&w->em, w->sv, w->model);
    if (w->role->metrics) w->role->metrics(w);
}

/* ------------------------------------------- the process shell's hooks -- */

static int start(cs_proc *p, void *arg) {
    cs_worker *w = arg;
    w->proc = p;
    w->rl = cs_proc_rpc_loop(p);
    cs_worker_calls_init(w);
    w->metrics = cs_proc_metrics(p);
    cs_metrics_register_table(w->metrics, cs_engine_metrics_table, cs_engine_metrics_n, &w->em);
    cs_metrics_register_table(w->metrics, worker_metrics,
                              sizeof worker_metrics / sizeof worker_metrics[0], w);
    int r;
    if ((r = cs_worker_add_method(w, "/chunkserve.v1.Worker/GetStatus", CS_RPC_UNARY,
                                  &chunkserve__v1__worker_status_request__descriptor,
                                  handle_status)))
        return r;
    if ((r = cs_worker_add_method(w, "/chunkserve.v1.Worker/Cancel", CS_RPC_UNARY,
                                  &chunkserve__v1__cancel_request__descriptor, handle_cancel)))
        return r;
    if (!(w->role_data = calloc(1, w->role->state_size)))
        return cs_fail(CS_ENOMEM, "out of memory");
    if ((r = w->role->start(w))) return r;
    if (w->role->n_metrics_table)
        cs_metrics_register_table(w->metrics, w->role->metrics_table, w->role->n_metrics_table,
                                  w->role_data);
    if (w->role->token_metrics)
        cs_metrics_register_table(w->metrics, cs_token_metrics_table, cs_token_metrics_n, &w->tok);
    return 0;
}

static void started(cs_proc *p, void *arg) {
    cs_worker *w = arg;
    const cs_worker_opts *o = &w->o;
    if (!o->worker_id) { /* a wildcard address names no host: the host name does (a pod's name) */
        char host[64];
        bool wild = !o->host[0] || !strcmp(o->host, "0.0.0.0") || !strcmp(o->host, "::") ||
                    !strcmp(o->host, "[::]");
        if (!wild || gethostname(host, sizeof host) != 0)
            snprintf(host, sizeof host, "%s", o->host);
        host[sizeof host - 1] = 0;
        snprintf(w->worker_id, sizeof w->worker_id, "%s-%s:%d", w->role->name, host,
                 cs_proc_port(p));
        if (wild)
            CS_LOGW("binding %s with no --worker-id: named %s (give each replica its own id, "
                    "e.g. the pod name)",
                    o->host, w->worker_id);
    }
    bool loopback =
        !strncmp(o->host, "127.", 4) || !strcmp(o->host, "::1") || !strcmp(o->host, "localhost");
    if (!w->secret.set && !loopback)
        CS_LOGW("no --cluster-secret: anyone who reaches %s:%d can call this worker and its KV "
                "port; set one (docs/security.md) or isolate the network",
                o->host, cs_proc_port(p));
    CS_LOGI("%s worker %s: '%s' (%s backend, %d KV pages of %d tokens, step budget %lld) on %s:%d",
            w->role->name, w->worker_id, w->wm.name, cs_engine_backend_name(w->engine),
            w->wm.n_kv_pages, w->wm.page_size, (long long)o->max_batched_tokens, o->host,
            cs_proc_port(p));
}

/* Calls not answered yet (the drain waits for none). */
static int32_t n_open(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    int32_t n = 0;
    for (cs_live_req *l = w->live.head; l; l = l->next)
        n += cs_worker_call_of(l)->call != NULL;
    return n;
}

static void drain(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    w->stopping = true; /* the role refuses new calls from now on */
}

/* The grace period is over: every open call ends UNAVAILABLE (the router
 * retries or migrates it) and its work stops. */
static void cancel_all(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    char msg[80];
    snprintf(msg, sizeof msg, "the %s worker is shutting down", w->role->name);
    int n = 0;
    for (cs_live_req *l = w->live.head; l; l = l->next) {
        cs_worker_call *q = cs_worker_call_of(l);
        if (q->call) {
            q->end_code = CS_RPC_UNAVAILABLE;
            q->end_msg = "the worker is shutting down";
            w->role->cancel(q);
            cs_worker_call_finish(q, CS_RPC_UNAVAILABLE, msg);
            n++;
        }
    }
    if (n) CS_LOGI("grace period over: cancelling %d %s calls", n, w->role->name);
}

/* The RPC server is gone: the role stops its KV transport (and, where its
 * data path needs that order, the engine loop first), then the engine loop
 * stops: every live request gets its final event, whose posts drain before
 * the loop closes. */
static void stop(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    if (w->role_data) w->role->stop(w);
    cs_serve_stop(w->sv);
    w->sv = NULL;
}

static void free_role(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    free(w->role_data);
    w->role_data = NULL;
}

static void secret_changed(cs_proc *p, void *arg) {
    (void)p;
    cs_worker *w = arg;
    if (w->role->secret_changed) w->role->secret_changed(w);
}

static const cs_proc_role worker_proc = {
    .name = "worker",
    .health_service = "chunkserve.v1.Worker",
    .start = start,
    .started = started,
    .secret_changed = secret_changed,
    .metrics = update_metrics,
    .n_open = n_open,
    .drain = drain,
    .cancel_all = cancel_all,
    .stop = stop,
    .free = free_role,
};

/* ----------------------------------------------------------------- run -- */

/* Model, engine and serving loop, then the process shell; freed in reverse. */
static int run(cs_worker *w) {
    const cs_worker_opts *o = &w->o;
    int r;
    if ((r = cs_model_load_mode(o->model, o->exact ? CS_WEIGHTS_EXACT : CS_WEIGHTS_AUTO,
                                &w->model)))
        goto out;
    cs_wire_model_init(&w->wm, w->model, o->model);
    cs_engine_params ep = cs_engine_params_default();
    ep.page_size = (int32_t)o->page_size;
    ep.kv_bytes = (size_t)o->kv_cache_mib << 20;
    ep.n_threads = (int32_t)o->threads;
    ep.kv_bf16 = o->kv_bf16;
    if ((r = cs_engine_init(w->model, &ep, &w->engine))) goto out;
    w->wm.n_kv_pages = cs_kv_cache_n_pages(cs_engine_kv(w->engine));
    w->wm.page_size = cs_kv_cache_page_size(cs_engine_kv(w->engine));
    w->wm.kv_blocks = *cs_kv_cache_blocks(cs_engine_kv(w->engine));
    cs_sched_params sp = cs_sched_params_default();
    sp.max_num_batched_tokens = (int32_t)o->max_batched_tokens;
    sp.max_num_seqs = (int32_t)o->max_num_seqs;
    sp.max_num_partial_prefills = (int32_t)o->max_partial_prefills;
    sp.max_chunk_tokens = (int32_t)o->max_chunk_tokens;
    sp.step_time_target_ms = o->step_time_target_ms;
    sp.enable_prefix_caching = o->prefix_caching;
    if (w->role->speculates && ((r = cs_spec_opts_apply(&o->spec, &sp)) ||
                                (r = cs_spec_draft_open(&o->spec, w->engine, &ep, &sp, &w->draft))))
        goto out;
    if ((r = cs_tenant_opts_apply(&w->o.tenants, &sp))) goto out;
    if ((r = cs_serve_start(w->engine, &sp, &w->sv))) goto out;
    if (o->prefix_caching && o->prefix_summary_ms > 0 &&
        (r = cs_serve_prefix_summary_enable(w->sv, (double)o->prefix_summary_ms / 1e3)))
        goto out;
    cs_proc_opts po = {.host = o->host,
                       .port = (int)o->port,
                       .http_host = o->http_host,
                       .http_port = (int)o->http_port,
                       .grace_ms = o->grace_ms,
                       .max_recv_bytes = 64 << 20,
                       .rpc = o->rpc,
                       .tls = o->tls,
                       .secret = &w->secret,
                       .secret_file = o->cluster_secret_file};
    r = cs_proc_run(&po, &worker_proc, w);
out:
    if (r) CS_LOGE("cannot start: %s", cs_last_error()[0] ? cs_last_error() : cs_strerror(r));
    cs_serve_stop(w->sv); /* NULL after a normal shutdown */
    cs_spec_draft_close(&w->draft);
    cs_engine_free(w->engine);
    cs_model_free(w->model);
    cs_secret_clear(&w->secret);
    return r;
}

int cs_worker_main(int argc, char **argv, const cs_worker_role *role) {
    static cs_worker w; /* one per process */
    w.role = role;
    char prog[64];
    snprintf(prog, sizeof prog, "chunkserve-%s", role->name);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--metrics-json")) { /* the table for tools and dashboards */
            size_t ne = cs_engine_metrics_n, nw = sizeof worker_metrics / sizeof *worker_metrics;
            size_t nt = role->token_metrics ? cs_token_metrics_n : 0, n = ne + nw + nt;
            cs_metric_def *all = malloc((n + role->n_metrics_table) * sizeof *all);
            if (!all) return 1;
            memcpy(all, cs_engine_metrics_table, ne * sizeof *all);
            memcpy(all + ne, worker_metrics, nw * sizeof *all);
            if (nt) memcpy(all + ne + nw, cs_token_metrics_table, nt * sizeof *all);
            if (role->n_metrics_table)
                memcpy(all + n, role->metrics_table, role->n_metrics_table * sizeof *all);
            cs_metrics_print_json(all, n + role->n_metrics_table, stdout);
            free(all);
            return 0;
        }
    const cs_config_part parts[] = {
        {cs_worker_config, cs_worker_config_n, 0},
        {cs_proc_rpc_config, cs_proc_rpc_config_n, offsetof(cs_worker_opts, rpc)},
        {cs_proc_tls_config, cs_proc_tls_config_n, offsetof(cs_worker_opts, tls)},
        {role->config, role->n_config, 0},
        {cs_tenant_config, cs_tenant_config_n, offsetof(cs_worker_opts, tenants)},
        {cs_spec_config, cs_spec_config_n, offsetof(cs_worker_opts, spec)}, /* last: optional */
    };
    cs_config_entry *table;
    size_t n_table;
    int r = cs_config_join(parts, sizeof parts / sizeof parts[0] - !role->speculates,
                           role->config_defaults, role->n_config_defaults, &table, &n_table);
    if (!r) r = cs_config_parse(table, n_table, &w.o, argc, argv, 1, prog, role->summary);
    free(table); /* the options point into argv, environ or the entries' defaults, not here */
    if (r == 1) return 0;
    if (r) {
        fprintf(stderr, "%s: %s\n", prog, cs_last_error());
        return 2;
    }
    if (!w.o.model) {
        fprintf(stderr, "%s: --model is required (or CHUNKSERVE_MODEL)\n", prog);
        return 2;
    }
    w.o.worker_tls.reload_s = w.o.tls.reload_s; /* one interval for every credential */
    if (cs_secret_load(w.o.cluster_secret, w.o.cluster_secret_file, &w.secret)) {
        fprintf(stderr, "%s: %s\n", prog, cs_last_error());
        return 2;
    }
    cs_log_set_role(role->name);
    if (w.o.verbose) cs_log_set_level(CS_LOG_DEBUG);
    if (w.o.worker_id) snprintf(w.worker_id, sizeof w.worker_id, "%s", w.o.worker_id);
    if (getrandom(&w.instance_id, sizeof w.instance_id, 0) != sizeof w.instance_id)
        w.instance_id = (uint64_t)time(NULL) << 20 ^ (uint64_t)getpid();
    signal(SIGPIPE, SIG_IGN);
    r = run(&w);
    if (r) {
        fprintf(stderr, "%s: %s\n", prog, cs_last_error()[0] ? cs_last_error() : cs_strerror(r));
        return 1;
    }
    return 0;
}
