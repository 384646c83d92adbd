/* server.c: the single-process server: the Generation service's handlers
 * on the RPC layer's libuv loop, one cs_serve engine thread behind them.
 *
 * Threads. Handlers run on the loop thread; a Generate request is validated
 * and tokenized on libuv's thread pool first (api/prepare.h). Generation
 * events arrive on the engine thread (cs_serve callbacks); each appends the
 * event to its call's buffer under the call's mutex and, when no drain is
 * pending, posts one (cs_live_req_post_locked). The drain, on the loop thread, turns everything
 * buffered into one GenerateResponse, so a slow loop merges steps rather than
 * queueing a post per token. The engine thread never calls the RPC layer.
 *
 * Lifetime of a Generate call (struct gen, on the life the workers' requests
 * have too: api/live_req.h): created by the handler holding the engine's
 * reference, which the drain that sees the engine's final event drops (the
 * engine never touches it after that); the release frees it. The RPC call
 * can end earlier (client cancel, deadline): then the request is cancelled
 * in the engine and the gen waits for the final CANCELLED event.
 *
 * Shutdown (SIGTERM/SIGINT) is the process shell's drain (chunkserve/proc.h):
 * health NOT_SERVING, new calls refused, streams get grace_ms to finish,
 * then the rest are cancelled in the engine and end with UNAVAILABLE; once
 * the RPC server is gone the engine thread is stopped, the last posts drain,
 * and everything is freed in reverse order. */
#include "server.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/proc.h"
#include "chunkserve/rpc.h"
#include "chunkserve/serve.h"
#include "chunkserve/clock.h"
#include "chunkserve/ttft.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "engine_metrics.h"
#include "gen_call.h"
#include "live_req.h"
#include "generation.h"
#include "prepare.h"
#include "outbuf.h"
#include "stream.h"
#include "wire.h"

#define SERVICE CS_GENERATION_SERVICE

typedef struct server server;

typedef struct gen {
    cs_live_req life; /* first: s->live's entries; life.mu guards st */
    server *s;
    cs_gen_call *call; /* NULL once answered (either door: api/gen_call.h) */
    uint64_t id;       /* the engine's request id */
    char *request_id;  /* the client's, or "cs-<id>" */
    bool logprobs, sent_first;
    bool ended;   /* a drain saw the final event (a later drain may see it again) */
    int end_code; /* status when we cancelled it ourselves (shutdown) */
    const char *end_msg;
    int32_t n_prompt;
    cs_stream st; /* filled on the engine thread, taken by the drain: the
                     output and the outcome (api/stream.h) */
} gen;

struct server {
    const cs_server_opts *o;
    cs_wire_model wm;
    cs_proc *proc; /* the process shell: loop, RPC server, ops HTTP, drain */
    cs_rpc_loop *rl;
    cs_engine *engine;
    cs_spec_draft draft; /* --speculative draft:PATH: its model and engine */
    cs_serve *sv;
    bool stopping;        /* draining: new calls are refused */
    cs_live_list live;    /* the gens */
    int32_t n_calls;      /* live gens whose call is still open (the admission count) */
    int32_t n_preparing;  /* Generate calls being tokenized (api/prepare.h) */
    bool grace_over;      /* cancel_all ran: a request prepared now is refused */
    uint64_t instance_id; /* random per process start */
    uint64_t next_id;
    cs_api_keys keys;       /* the public API's (both doors) */
    cs_generation_ctx gctx; /* the unary Generation calls' */
    cs_openai *openai;      /* the OpenAI-compatible HTTP door, or NULL */
    cs_engine_metrics em;   /* the same engine and token metrics as the workers' */
    cs_token_metrics tok;
};

/* ------------------------------------------------------- engine thread -- */

/* cs_serve callback: engine thread. */
static void on_event(void *user, const cs_event *ev) {
    gen *g = user;
    if (ev->finish == CS_FINISH_ERROR && ev->status == CS_ENOSPC) cs_metric_inc(g->s->em.refused);
    pthread_mutex_lock(&g->life.mu);
    cs_stream_event(&g->st, ev);
    bool posted = cs_live_req_post_locked(&g->life);
    pthread_mutex_unlock(&g->life.mu);
    if (!posted) /* the loop is closed */
        CS_LOGE("request %s: cannot hand an event to the loop: %s", g->request_id, cs_last_error());
}

/* ---------------------------------------------------------- loop thread -- */

/* The last reference went (api/live_req.h): g is off s->live. */
static void gen_release(cs_live_req *l) {
    gen *g = (gen *)l;
    cs_stream_free(&g->st);
    free(g->request_id);
    free(g);
}

static void gen_finish_call(gen *g, int code, const char *msg) {
    if (!g->call) return;
    cs_gen_call_finish(g->call, code, msg);
    g->call = NULL;
    g->s->n_calls--;
}

/* Sends what one drain took (the first message names the request). */
static int gen_send(gen *g, const cs_stream *snap) {
    Chunkserve__V1__GenerateResponse r;
    void *scratch;
    if (cs_stream_response(snap, g->logprobs, g->n_prompt, &r, &scratch)) return CS_ENOMEM;
    if (!g->sent_first) r.request_id = g->request_id;
    int rc = cs_gen_call_send(g->call, &r);
    cs_outbuf_response_free(scratch);
    g->sent_first = true;
    return rc;
}

static void gen_log_end(const gen *g, const cs_stream *snap) {
    CS_LOGI("request %s: %s, %d prompt + %d completion tokens in %.3f s%s%s", g->request_id,
            cs_finish_name(snap->finish), g->n_prompt, snap->n_completion, cs_now() - snap->t_start,
            snap->error[0] ? ": " : "", snap->error);
}

/* Posted by on_event: takes everything buffered and streams it. */
static void gen_drain(cs_live_req *l) {
    gen *g = (gen *)l;
    pthread_mutex_lock(&g->life.mu);
    cs_stream snap;
    cs_stream_take(&g->st, &snap);
    pthread_mutex_unlock(&g->life.mu);

    if (g->call) {
        int rc = snap.out.oom ? CS_ENOMEM : 0;
        if (!rc && cs_stream_has_message(&snap)) rc = gen_send(g, &snap);
        cs_stream_end end;
        cs_stream_outcome(&snap, rc, g->call ? cs_gen_call_pending_bytes(g->call) : 0, "the client",
                          g->end_code, g->end_msg, &end);
        /* rc == CS_ECANCELED: the call is dead and on_call_cancel has run or
         * will run; it cancels the request. */
        if (end.code >= 0) gen_finish_call(g, end.code, end.code ? end.msg : NULL);
        if (end.cancel) cs_serve_cancel(g->s->sv, g->id);
    }
    if (snap.done && !g->ended) {
        g->ended = true;
        gen_log_end(g, &snap);
        cs_live_req_unref(&g->life); /* the engine's */
    }
    cs_stream_free(&snap);
}

/* The client cancelled or went away, its deadline passed, or the RPC
 * server's backstop cancelled it: stop the request in the engine (its pages
 * are freed there); the gen lives on until the CANCELLED event drains. */
static void on_call_cancel(cs_gen_call *c, void *data) {
    gen *g = data;
    CS_LOGD("request %s: call cancelled (%s)", g->request_id,
            cs_gen_call_deadline_ms(c) <= 0 ? "deadline" : "client");
    cs_serve_cancel(g->s->sv, g->id);
    gen_finish_call(g, CS_RPC_CANCELLED, "cancelled");
}

static void on_prepared(void *arg, cs_gen_call *c, uint64_t id, double t_queued, int r,
                        const char *err, const char *field, cs_wire_request *wp);

/* Generate, from either door (gRPC below, or the OpenAI HTTP routes): the
 * request is validated and tokenized on the thread pool (api/prepare.h),
 * then submitted in on_prepared. */
static void generate(void *arg, cs_gen_call *c) {
    server *s = arg;
    if (s->stopping) {
        cs_gen_call_finish(c, CS_RPC_UNAVAILABLE, "the server is shutting down");
        return;
    }
    cs_sched_stats st;
    cs_serve_stats(s->sv, &st);
    /* A request whose call ended (cancelled, deadline) no longer counts,
     * though the engine may not have dropped it yet. */
    int32_t waiting = s->n_calls - st.n_running + s->n_preparing;
    if (waiting >= s->o->max_queue) {
        char msg[160];
        snprintf(msg, sizeof msg,
                 "the server is overloaded: %d requests are waiting (--max-queue %d); retry later",
                 waiting, s->o->max_queue);
        cs_metric_inc(s->em.refused);
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    if (cs_prepare_generate(cs_proc_uv(s->proc), &s->wm, c, ++s->next_id, on_prepared, s) != 0) {
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    s->n_preparing++;
}

/* The request's predicted TTFT (chunkserve/ttft.h) into *predicted (NAN:
 * the step model is not fitted yet); when the work queued ahead puts it
 * over its priority's --ttft-slo-ms, the call is refused with the time to
 * retry after, and true returned. */
static bool refuse_early(server *s, cs_gen_call *c, const cs_request *r, double *predicted) {
    cs_ttft_load L;
    cs_serve_ttft_load(s->sv, &L);
    double w = cs_ttft_weight(&s->o->sched, r->tenant);
    *predicted = cs_ttft_predict(&L, r->priority, r->tenant, w, r->n_prompt);
    double bound = cs_slo_ttft_bound(&s->o->slo, r->priority);
    int64_t retry =
        cs_slo_refuse_ms(*predicted, cs_ttft_predict_alone(&L, r->priority, r->n_prompt), bound);
    if (!retry || c->sibling) return false; /* a sibling goes with the first (gen_call.h) */
    char msg[300];
    snprintf(msg, sizeof msg,
             "the predicted time to first token is %.2f s, over the bound of %.2f s for "
             "priority %d (--ttft-slo-ms): the server is busy; retry in %.1f s",
             *predicted, bound, r->priority, retry / 1e3);
    cs_metric_inc(s->em.ttft_refused);
    cs_metric_inc(s->em.refused);
    cs_gen_call_refuse_retry(c, msg, retry);
    return true;
}

static void on_prepared(void *arg, cs_gen_call *c, uint64_t id, double t_queued, int r,
                        const char *err, const char *field, cs_wire_request *wp) {
    server *s = arg;
    const Chunkserve__V1__GenerateRequest *m = c->req;
    cs_wire_request w = *wp;
    (void)t_queued;
    s->n_preparing--;
    if (r) {
        CS_LOGD("request rejected: %s", err);
        cs_gen_call_refuse(c, cs_rpc_code_of_status(r), err, field);
        return;
    }
    if (s->grace_over || !s->sv) { /* prepared after the grace period ended */
        cs_wire_request_free(&w);
        cs_gen_call_finish(c, CS_RPC_UNAVAILABLE, "the server is shutting down");
        return;
    }
    double predicted;
    if (refuse_early(s, c, &w.r, &predicted)) {
        cs_wire_request_free(&w);
        return;
    }
    gen *g = calloc(1, sizeof *g);
    char idbuf[32];
    snprintf(idbuf, sizeof idbuf, "cs-%llu", (unsigned long long)id);
    if (g) g->request_id = strdup(m->request_id[0] ? m->request_id : idbuf);
    if (!g || !g->request_id) {
        free(g);
        cs_wire_request_free(&w);
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    g->s = s;
    g->call = c;
    g->id = id;
    g->logprobs = w.r.logprobs;
    g->st.t_start = cs_now();
    g->st.tok = &s->tok;
    g->st.predicted_ttft = predicted > 0 ? predicted : 0;
    g->n_prompt = w.r.n_prompt;
    cs_live_req_init(&s->live, &g->life); /* holding the engine's reference */
    s->n_calls++;
    CS_LOGD("request %s: %d prompt tokens, max_tokens %d", g->request_id, w.r.n_prompt,
            w.r.stop.max_tokens);
    r = cs_serve_submit(s->sv, &w.r, on_event, g);
    cs_wire_request_free(&w);
    if (r) {
        gen_finish_call(g, r == CS_ENOMEM ? CS_RPC_RESOURCE_EXHAUSTED : CS_RPC_UNAVAILABLE,
                        "the engine refused the request");
        cs_live_req_unref(&g->life); /* the engine's: it never took it */
        return;
    }
    if (cs_gen_call_on_cancel(c, on_call_cancel, g) != 0) on_call_cancel(c, g); /* already dead */
}

static void handle_generate(cs_rpc_call *rpc, void *data) {
    server *s = data;
    const char *tenant;
    if (!cs_api_keys_rpc_check(&s->keys, rpc, &tenant)) return;
    cs_gen_call *c = cs_gen_call_grpc(rpc);
    if (!c) return;
    c->key_tenant = tenant;
    generate(s, c);
}

/* chunkserve.v1.Worker/GetStatus: the same snapshot the cluster's workers
 * give the router (role unspecified: this process prefills and decodes).
 * Tests use it to see that a cancelled stream's pages are free again. */
static void handle_status(cs_rpc_call *c, void *data) {
    server *s = data;
    cs_sched_stats st;
    cs_serve_stats(s->sv, &st);
    cs_wire_status_buf buf;
    Chunkserve__V1__WorkerStatus r;
    cs_ttft_load load;
    cs_serve_ttft_load(s->sv, &load);
    cs_wire_worker_status(&s->wm, &st, &load, &buf, &r);
    char worker_id[32];
    snprintf(worker_id, sizeof worker_id, "serve-%016llx", (unsigned long long)s->instance_id);
    r.worker_id = worker_id;
    r.instance_id = s->instance_id;
    r.role = CHUNKSERVE__V1__WORKER_ROLE__WORKER_ROLE_UNSPECIFIED;
    r.ready = !s->stopping;
    r.draining = s->stopping;
    cs_rpc_call_reply_msg(c, &r.base);
}

/* ---------------------------------------- the process shell's hooks -- */

static int add_methods(server *s, cs_rpc_server *srv) {
    static const struct {
        const char *path;
        enum cs_rpc_method_kind kind;
        const ProtobufCMessageDescriptor *desc;
        cs_rpc_handler fn;
    } methods[] = {
        {"/" SERVICE "/Generate", CS_RPC_SERVER_STREAMING,
         &chunkserve__v1__generate_request__descriptor, handle_generate},
        {"/chunkserve.v1.Worker/GetStatus", CS_RPC_UNARY,
         &chunkserve__v1__worker_status_request__descriptor, handle_status},
    };
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        int r = cs_rpc_server_add_method(srv, methods[i].path, methods[i].kind, methods[i].desc,
                                         methods[i].fn, s);
        if (r) return r;
    }
    s->gctx = (cs_generation_ctx){&s->wm, &s->keys, cs_proc_uv(s->proc)};
    return cs_generation_add_unary(srv, &s->gctx);
}

static int start(cs_proc *p, void *arg) {
    server *s = arg;
    s->proc = p;
    s->rl = cs_proc_rpc_loop(p);
    s->live = (cs_live_list){.rl = s->rl, .drain = gen_drain, .release = gen_release};
    cs_metrics_register_table(cs_proc_metrics(p), cs_engine_metrics_table, cs_engine_metrics_n,
                              &s->em);
    cs_metrics_register_table(cs_proc_metrics(p), cs_token_metrics_table, cs_token_metrics_n,
                              &s->tok);
    int r = add_methods(s, cs_proc_server(p));
    if (!r)
        r = cs_openai_start_config(cs_proc_uv(p), &s->o->openai, &s->o->tls, s->o->host, &s->wm,
                                   generate, s, &s->keys, &s->openai);
    return r;
}

static void started(cs_proc *p, void *arg) {
    server *s = arg;
    const cs_server_opts *o = s->o;
    CS_LOGI(
        "serving '%s' (%s backend, %d KV pages of %d tokens, step budget %d, max %d seqs) on %s:%d",
        s->wm.name, cs_engine_backend_name(s->engine), s->wm.n_kv_pages, s->wm.page_size,
        o->sched.max_num_batched_tokens, o->sched.max_num_seqs, o->host, cs_proc_port(p));
    cs_openai_print_listening(s->openai);
}

static int32_t n_open(cs_proc *p, void *arg) {
    (void)p;
    server *s = arg;
    return s->n_calls + s->n_preparing;
}

static void drain(cs_proc *p, void *arg) {
    (void)p;
    server *s = arg;
    s->stopping = true;
}

/* Grace is over: cancel what still streams; each ends with UNAVAILABLE. */
static void cancel_all(cs_proc *p, void *arg) {
    (void)p;
    server *s = arg;
    int n = 0;
    s->grace_over = true;
    for (cs_live_req *l = s->live.head; l; l = l->next) {
        gen *g = (gen *)l;
        if (!g->call) continue;
        g->end_code = CS_RPC_UNAVAILABLE;
        g->end_msg = "the server is shutting down";
        cs_serve_cancel(s->sv, g->id);
        n++;
    }
    if (n) CS_LOGI("grace period over: cancelling %d streams", n);
}

/* The RPC server is gone: every request still live gets its CANCELLED
 * event; its drain and then its release run in the loop's last drains,
 * before the loop is freed. */
static void stop(cs_proc *p, void *arg) {
    (void)p;
    server *s = arg;
    cs_openai_close(s->openai); /* its open streams' calls end with the engine below */
    s->openai = NULL;
    cs_serve_stop(s->sv);
    s->sv = NULL;
}

static void update_metrics(cs_proc *p, void *arg) {
    (void)p;
    server *s = arg;
    cs_engine_metrics_update(&s->em, s->sv, s->wm.model);
}

static const cs_proc_role server_proc = {
    .name = "serve",
    .health_service = SERVICE,
    .start = start,
    .started = started,
    .n_open = n_open,
    .drain = drain,
    .cancel_all = cancel_all,
    .stop = stop,
    .metrics = update_metrics,
};

/* --------------------------------------------------------------- run -- */

int cs_server_run(const cs_model *m, const cs_server_opts *o) {
    server *s = calloc(1, sizeof *s);
    if (!s) return cs_fail(CS_ENOMEM, "out of memory");
    s->o = o;
    if (getrandom(&s->instance_id, sizeof s->instance_id, 0) != sizeof s->instance_id)
        s->instance_id = (uint64_t)time(NULL) << 20 ^ (uint64_t)getpid();
    cs_wire_model_init(&s->wm, m, o->model_path);
    int r;
    if ((r = cs_engine_init(m, &o->engine, &s->engine))) goto out;
    s->wm.n_kv_pages = cs_kv_cache_n_pages(cs_engine_kv(s->engine));
    s->wm.page_size = cs_kv_cache_page_size(cs_engine_kv(s->engine));
    s->wm.kv_blocks = *cs_kv_cache_blocks(cs_engine_kv(s->engine));
    cs_sched_params sp = o->sched;
    if ((r = cs_spec_draft_open(&o->spec, s->engine, &o->engine, &sp, &s->draft))) goto out;
    if ((r = cs_serve_start(s->engine, &sp, &s->sv))) goto out;
    cs_proc_opts po = {.host = o->host,
                       .port = o->port,
                       .http_host = o->http_host,
                       .http_port = o->http_port,
                       .grace_ms = o->grace_ms,
                       .rpc = o->rpc,
                       .tls = o->tls};
    r = cs_proc_run(&po, &server_proc, s);
out:
    if (r) CS_LOGE("cannot start: %s", cs_last_error()[0] ? cs_last_error() : cs_strerror(r));
    cs_openai_close(s->openai); /* when the start failed after opening it */
    cs_serve_stop(s->sv);       /* NULL after a normal shutdown */
    cs_spec_draft_close(&s->draft);
    cs_engine_free(s->engine);
    cs_api_keys_free(&s->keys);
    free(s);
    return r;
}
