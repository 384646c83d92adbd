/* worker.c: the process skeleton of chunkserve-prefill and chunkserve-decode
 * (see worker.h). Start-up builds, in order: options, model, engine, serving
 * loop, libuv loop, RPC loop, RPC server (+ role method, Worker/GetStatus,
 * Worker/Cancel, health), metrics, HTTP port, signals.
 *
 * Drain and shutdown (SIGTERM or SIGINT; Kubernetes scale-in): the worker
 * goes unready (/readyz 503, health NOT_SERVING, status draining, metric
 * chunkserve:draining 1) and the role refuses new calls (UNAVAILABLE, so the
 * router places them elsewhere), while the RPC server keeps answering
 * GetStatus and Cancel: the router sees a draining worker, not a dead one,
 * and leaves its streams here. Once the role's calls have all ended, or
 * grace_ms has passed (the role then ends the rest UNAVAILABLE and the
 * router retries or migrates them), the RPC server shuts down; then the role
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
#include "chunkserve/error.h"
#include "chunkserve/log.h"

/* ------------------------------------------------------------ helpers -- */

int cs_worker_add_method(cs_worker *w, const char *method, enum cs_rpc_method_kind kind,
                         const ProtobufCMessageDescriptor *desc, cs_rpc_handler fn) {
    return cs_rpc_server_add_method(w->srv, method, kind, desc, fn, w);
}

int cs_worker_request(cs_worker *w, const int32_t *ids, size_t n, int32_t num_prompt,
                      const Chunkserve__V1__SamplingParams *sampling, cs_request *r) {
    const cs_model_config *cfg = cs_model_get_config(w->model);
    memset(r, 0, sizeof *r);
    if (n == 0) return cs_fail(CS_EINVAL, "token_ids is empty");
    if (num_prompt < 1 || (size_t)num_prompt > n)
        return cs_fail(CS_EINVAL, "num_prompt_tokens = %d must be in 1..%zu (the token ids sent)", num_prompt, n);
    if (n >= (size_t)cfg->ctx_len)
        return cs_fail(CS_EINVAL, "%zu tokens leave no room in the model's context of %d", n, cfg->ctx_len);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= cfg->n_vocab)
            return cs_fail(CS_EINVAL, "token_ids[%zu] = %d is outside the vocabulary (0..%d)", i, ids[i],
                            cfg->n_vocab - 1);
    if ((int64_t)(n + 1 + (size_t)w->wm.page_size - 1) / w->wm.page_size > w->wm.n_kv_pages)
        return cs_fail(CS_EINVAL, "%zu tokens need more KV pages than this worker has (%d of %d tokens)", n,
                        w->wm.n_kv_pages, w->wm.page_size);
    int rc = cs_wire_sampling(&w->wm, sampling, r);
    if (rc) return rc;
    r->prompt = ids;
    r->n_prompt = (int32_t)n;
    r->n_resumed = (int32_t)n - num_prompt;
    return 0;
}

int cs_worker_split_endpoint(const char *ep, char *host, size_t host_len, int *port) {
    const char *colon = strrchr(ep ? ep : "", ':');
    if (!ep || !colon || colon == ep) return cs_fail(CS_EINVAL, "endpoint '%s' is not host:port", ep ? ep : "");
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
    Chunkserve__V1__ModelInfo mi;
    Chunkserve__V1__WorkerStatus r;
    cs_wire_worker_status(&w->wm, &st, &mi, &r);
    r.worker_id = w->worker_id;
    r.instance_id = w->instance_id;
    r.role = w->role->role;
    r.ready = !w->stopping;
    r.draining = w->stopping;
    char ep[300] = "";
    r.kv_endpoint = ep;
    if (w->role->status) w->role->status(w, &r);
    cs_rpc_call_reply_msg(c, &r.base);
}

static void handle_cancel(cs_rpc_call *c, void *data) {
    cs_worker *w = data;
    const Chunkserve__V1__CancelRequest *m = (const void *)cs_rpc_call_request_msg(c);
    Chunkserve__V1__CancelResponse r = CHUNKSERVE__V1__CANCEL_RESPONSE__INIT;
    r.found = w->role->cancel(w, m->transfer_id);
    CS_LOGD("cancel transfer %016llx (%s): %s", (unsigned long long)m->transfer_id, m->request_id,
            r.found ? "found" : "not found");
    cs_rpc_call_reply_msg(c, &r.base);
}

/* ------------------------------------------------------------- metrics -- */

static void register_metrics(cs_worker *w) {
    cs_metrics *m = w->metrics;
    w->m_running = cs_metrics_gauge(m, "chunkserve:num_requests_running", NULL, "sequences in the running batch");
    w->m_waiting = cs_metrics_gauge(m, "chunkserve:num_requests_waiting", NULL,
                                    "requests admitted and not running (waiting for a seat, pages or their KV)");
    w->m_kv_usage =
        cs_metrics_gauge(m, "chunkserve:kv_cache_usage_perc", NULL, "fraction of KV pages in use (0..1)");
    w->m_kv_free = cs_metrics_gauge(m, "chunkserve:kv_pages_free", NULL,
                                    "KV pages free or holding reusable prefixes (not reserved)");
    w->m_kv_total = cs_metrics_gauge(m, "chunkserve:kv_pages_total", NULL, "KV pages in the pool");
    w->m_queued_prefill = cs_metrics_gauge(m, "chunkserve:queued_prefill_tokens", NULL,
                                           "prompt tokens admitted and not computed yet");
    w->m_preemptions =
        cs_metrics_counter(m, "chunkserve:num_preemptions_total", NULL, "sequences preempted (pages freed, recomputed)");
    w->m_prompt_tokens = cs_metrics_counter(m, "chunkserve:prompt_tokens_total", NULL, "prompt tokens computed");
    w->m_gen_tokens = cs_metrics_counter(m, "chunkserve:generation_tokens_total", NULL, "tokens sampled");
    w->m_prefix_hits = cs_metrics_counter(m, "chunkserve:prefix_cache_hit_tokens_total", NULL,
                                          "prompt tokens taken from the prefix cache");
    w->m_steps = cs_metrics_counter(m, "chunkserve:engine_steps_total", NULL, "engine steps run");
    w->m_draining = cs_metrics_gauge(m, "chunkserve:draining", NULL,
                                     "1 from SIGTERM on: taking no new requests, finishing the open ones");
}

static void before_metrics(void *arg) {
    cs_worker *w = arg;
    cs_sched_stats st;
    cs_serve_stats(w->sv, &st);
    cs_metric_set(w->m_running, st.n_running);
    cs_metric_set(w->m_waiting, st.n_waiting);
    cs_metric_set(w->m_kv_usage, st.kv_pages_total ? (double)st.kv_pages_used / st.kv_pages_total : 0);
    cs_metric_set(w->m_kv_free, st.kv_pages_total - st.kv_pages_used);
    cs_metric_set(w->m_kv_total, st.kv_pages_total);
    cs_metric_set(w->m_queued_prefill, (double)st.queued_prompt_tokens);
    cs_metric_set(w->m_draining, w->stopping);
    cs_sched_stats *l = &w->last_stats;
    cs_metric_add(w->m_preemptions, (double)(st.preemptions - l->preemptions));
    cs_metric_add(w->m_prompt_tokens, (double)(st.prompt_tokens_computed - l->prompt_tokens_computed));
    cs_metric_add(w->m_gen_tokens, (double)(st.generated_tokens - l->generated_tokens));
    cs_metric_add(w->m_prefix_hits, (double)(st.prefix_hit_tokens - l->prefix_hit_tokens));
    cs_metric_add(w->m_steps, (double)(st.steps - l->steps));
    *l = st;
    if (w->role->metrics) w->role->metrics(w);
}

static bool ready(void *arg, char *why, size_t why_len) {
    cs_worker *w = arg;
    if (w->stopping) snprintf(why, why_len, "shutting down");
    return !w->stopping;
}

/* ------------------------------------------------------------ shutdown -- */

static void on_server_done(void *data) {
    cs_worker *w = data;
    w->srv = NULL;
    w->role->stop(w); /* KV transport: its last callbacks cancel in the engine */
    cs_serve_stop(w->sv); /* every live request gets its final event; its posts drain next */
    w->sv = NULL;
    cs_http_server_close(w->http);
    w->http = NULL;
    cs_rpc_loop_close(w->rl);
}

/* The drain is over (every call ended, or the grace passed and the role
 * ended the rest): the RPC server goes. Its own grace is a backstop for the
 * calls the role just cancelled. */
static void close_server(cs_worker *w, int32_t cancelled) {
    if (w->server_closing) return;
    w->server_closing = true;
    uv_close((uv_handle_t *)&w->grace, NULL);
    uv_close((uv_handle_t *)&w->drain_poll, NULL);
    CS_LOGI("drained in %.3f s (%d calls ended by the grace period): shutting down",
            cs_now() - w->drain_start, cancelled);
    cs_rpc_server_shutdown(w->srv, 3000, on_server_done, w);
}

static void on_grace(uv_timer_t *t) {
    cs_worker *w = t->data;
    int32_t n = w->role->n_calls(w);
    w->role->cancel_all(w);
    close_server(w, n);
}

static void on_drain_poll(uv_timer_t *t) {
    cs_worker *w = t->data;
    if (w->role->n_calls(w) == 0) close_server(w, 0);
}

static void on_signal(uv_signal_t *h, int signum) {
    cs_worker *w = h->data;
    if (w->stopping) return;
    w->stopping = true;
    w->drain_start = cs_now();
    CS_LOGI("signal %d: draining (%d calls open, %lld ms grace)", signum, w->role->n_calls(w),
            (long long)w->o.grace_ms);
    uv_close((uv_handle_t *)&w->sigterm, NULL);
    uv_close((uv_handle_t *)&w->sigint, NULL);
    cs_rpc_health_shutdown(w->health);
    uv_timer_start(&w->grace, on_grace, (uint64_t)w->o.grace_ms, 0);
    uv_timer_start(&w->drain_poll, on_drain_poll, 0, 50);
}

static void on_failed_server_done(void *data) {
    cs_worker *w = data;
    w->srv = NULL;
    cs_rpc_loop_close(w->rl);
}

/* ----------------------------------------------------------------- run -- */

static int run(cs_worker *w) {
    const cs_worker_opts *o = &w->o;
    int r, port = 0;
    bool uv_ok = false;
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%lld", o->host, (long long)o->port);
    cs_rpc_server_opts so = {.addr = addr, .max_recv_bytes = 64 << 20};

    if ((r = cs_model_load(o->model, &w->model))) goto fail;
    cs_wire_model_init(&w->wm, w->model, o->model);
    cs_engine_params ep = cs_engine_params_default();
    ep.page_size = (int32_t)o->page_size;
    ep.kv_bytes = (size_t)o->kv_cache_mib << 20;
    ep.n_threads = (int32_t)o->threads;
    if ((r = cs_engine_init(w->model, &ep, &w->engine))) goto fail;
    w->wm.n_kv_pages = cs_kv_cache_n_pages(cs_engine_kv(w->engine));
    w->wm.page_size = cs_kv_cache_page_size(cs_engine_kv(w->engine));
    cs_sched_params sp = cs_sched_params_default();
    sp.max_num_batched_tokens = (int32_t)o->max_batched_tokens;
    sp.max_num_seqs = (int32_t)o->max_num_seqs;
    sp.max_num_partial_prefills = (int32_t)o->max_partial_prefills;
    sp.max_chunk_tokens = (int32_t)o->max_chunk_tokens;
    sp.enable_prefix_caching = o->prefix_caching;
    if ((r = cs_serve_start(w->engine, &sp, &w->sv))) goto fail;
    if ((r = cs_metrics_init(&w->metrics))) goto fail;
    register_metrics(w);
    if ((r = uv_loop_init(&w->uv))) {
        r = cs_fail(CS_EIO, "uv_loop_init: %s", uv_strerror(r));
        goto fail;
    }
    uv_ok = true;
    if ((r = cs_rpc_loop_init(&w->uv, &w->rl))) goto fail;
    if ((r = cs_rpc_server_init(w->rl, &so, &w->srv))) goto fail;
    if ((r = cs_worker_add_method(w, "/chunkserve.v1.Worker/GetStatus", CS_RPC_UNARY,
                                  &chunkserve__v1__worker_status_request__descriptor, handle_status)))
        goto fail;
    if ((r = cs_worker_add_method(w, "/chunkserve.v1.Worker/Cancel", CS_RPC_UNARY,
                                  &chunkserve__v1__cancel_request__descriptor, handle_cancel)))
        goto fail;
    if ((r = cs_rpc_health_init(w->srv, &w->health))) goto fail;
    if ((r = w->role->start(w))) goto fail;
    if ((r = cs_rpc_server_start(w->srv, &port))) goto fail;
    if (!o->worker_id) { /* a wildcard address names no host: the host name does (a pod's name) */
        char host[64];
        bool wild = !o->host[0] || !strcmp(o->host, "0.0.0.0") || !strcmp(o->host, "::") ||
                    !strcmp(o->host, "[::]");
        if (!wild || gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "%s", o->host);
        host[sizeof host - 1] = 0;
        snprintf(w->worker_id, sizeof w->worker_id, "%s-%s:%d", w->role->name, host, port);
    }
    cs_http_routes routes = {.metrics = w->metrics, .before_metrics = before_metrics, .ready = ready, .arg = w};
    if ((r = cs_http_server_init(&w->uv, o->http_host, (int)o->http_port, &routes, &w->http))) goto fail;
    cs_rpc_health_set(w->health, "", CS_RPC_SERVING_SERVING);
    cs_rpc_health_set(w->health, "chunkserve.v1.Worker", CS_RPC_SERVING_SERVING);
    uv_signal_init(&w->uv, &w->sigterm);
    uv_signal_init(&w->uv, &w->sigint);
    uv_timer_init(&w->uv, &w->grace);
    uv_timer_init(&w->uv, &w->drain_poll);
    w->sigterm.data = w->sigint.data = w->grace.data = w->drain_poll.data = w;
    uv_signal_start(&w->sigterm, on_signal, SIGTERM);
    uv_signal_start(&w->sigint, on_signal, SIGINT);
    CS_LOGI("%s worker %s: '%s' (%s backend, %d KV pages of %d tokens, step budget %d) on %s:%d, http %s:%d",
            w->role->name, w->worker_id, w->wm.name, cs_engine_backend_name(w->engine), w->wm.n_kv_pages,
            w->wm.page_size, sp.max_num_batched_tokens, o->host, port, o->http_host,
            cs_http_server_port(w->http));
    printf("listening on %s:%d\nhttp listening on %s:%d\n", o->host, port, o->http_host,
           cs_http_server_port(w->http));
    fflush(stdout);
    uv_run(&w->uv, UV_RUN_DEFAULT);
    r = 0;
    CS_LOGI("stopped");
    goto out;

fail:
    CS_LOGE("cannot start: %s", cs_last_error()[0] ? cs_last_error() : cs_strerror(r));
    {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", cs_last_error());
        cs_http_server_close(w->http);
        w->http = NULL;
        if (w->srv)
            cs_rpc_server_shutdown(w->srv, 0, on_failed_server_done, w);
        else if (w->rl)
            cs_rpc_loop_close(w->rl);
        if (uv_ok) uv_run(&w->uv, UV_RUN_DEFAULT);
        if (w->role_data && w->role->stop) w->role->stop(w);
        cs_fail(r, "%s", msg);
    }
out:
    cs_rpc_health_free(w->health);
    if (uv_ok && uv_loop_close(&w->uv) != 0) CS_LOGW("the event loop still had handles at exit");
    cs_serve_stop(w->sv); /* NULL after a normal shutdown */
    if (w->role->free) w->role->free(w);
    cs_metrics_free(w->metrics);
    cs_engine_free(w->engine);
    cs_model_free(w->model);
    return r;
}

int cs_worker_main(int argc, char **argv, const cs_worker_role *role) {
    static cs_worker w; /* one per process */
    w.role = role;
    char prog[64];
    snprintf(prog, sizeof prog, "chunkserve-%s", role->name);
    int r = cs_config_parse(role->config, role->n_config, &w.o, argc, argv, 1, prog, role->summary);
    if (r == 1) return 0;
    if (r) {
        fprintf(stderr, "%s: %s\n", prog, cs_last_error());
        return 2;
    }
    if (!w.o.model) {
        fprintf(stderr, "%s: --model is required (or CHUNKSERVE_MODEL)\n", prog);
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
