/* proc.c: the process shell (chunkserve/proc.h): start, drain, stop, in one
 * place for every serving process. What the shell does not do: anything a
 * role knows (its methods, its requests, its engine or pools). */
#include "chunkserve/proc.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/http.h"
#include "chunkserve/log.h"
#include "chunkserve/metrics.h"
#include "chunkserve/rpc.h"
#include "chunkserve/rpc_health.h"

#define DRAIN_POLL_MS 50
#define SERVER_BACKSTOP_MS 3000

struct cs_proc {
    const cs_proc_opts *o;
    const cs_proc_role *role;
    void *rd; /* the role's data */
    uv_loop_t uv;
    cs_rpc_loop *rl;
    cs_rpc_server *srv;
    cs_rpc_health *health;
    cs_metrics *metrics;
    cs_metric *m_draining;
    cs_metric *m_key_id, *m_keys, *m_reloads, *m_reload_errors; /* with a cluster secret */
    uv_timer_t reload;
    bool reload_failing; /* the secret's file cannot be read (already reported) */
    cs_http_server *http;
    uv_signal_t sigterm, sigint;
    uv_timer_t grace, drain_poll;
    bool draining, server_closing;
    double drain_start;
    int port;
};

uv_loop_t *cs_proc_uv(cs_proc *p) {
    return &p->uv;
}
cs_rpc_loop *cs_proc_rpc_loop(cs_proc *p) {
    return p->rl;
}
cs_rpc_server *cs_proc_server(cs_proc *p) {
    return p->srv;
}
cs_rpc_health *cs_proc_health(cs_proc *p) {
    return p->health;
}
cs_metrics *cs_proc_metrics(cs_proc *p) {
    return p->metrics;
}
bool cs_proc_draining(const cs_proc *p) {
    return p->draining;
}
int cs_proc_port(const cs_proc *p) {
    return p->port;
}

/* ---------------------------------------------------------- ops HTTP -- */

static void before_metrics(void *arg) {
    cs_proc *p = arg;
    cs_metric_set(p->m_draining, p->draining);
    if (p->o->secret) {
        cs_metric_set(p->m_key_id, (double)p->o->secret->id);
        cs_metric_set(p->m_keys, p->o->secret->n);
    }
    if (p->role->metrics) p->role->metrics(p, p->rd);
}

static bool ready(void *arg, char *why, size_t why_len) {
    cs_proc *p = arg;
    if (p->draining) {
        snprintf(why, why_len, "draining (shutting down)");
        return false;
    }
    return p->role->ready ? p->role->ready(p, p->rd, why, why_len) : true;
}

/* ------------------------------------------------------- credentials -- */

static void log_secret(const char *what, const cs_secret *s) {
    CS_LOGI("%s: proving key %012llx%s", what, (unsigned long long)s->id,
            s->n > 1 ? ", accepting one more (a rotation)" : "");
}

static void on_reload(uv_timer_t *t) {
    cs_proc *p = t->data;
    int r = cs_secret_reload(p->o->secret, p->o->secret_file);
    if (r < 0) { /* counted and logged once while it lasts (a missing file is tried again) */
        if (!p->reload_failing) {
            cs_metric_inc(p->m_reload_errors);
            CS_LOGE("cluster secret not reloaded (the previous one stays): %s", cs_last_error());
        }
        p->reload_failing = r == CS_EIO;
        return;
    }
    p->reload_failing = false;
    if (r == 1) {
        cs_metric_inc(p->m_reloads);
        log_secret("cluster secret reloaded", p->o->secret);
        if (p->role->secret_changed) p->role->secret_changed(p, p->rd);
    }
}

static void register_secret(cs_proc *p) {
    p->m_key_id = cs_metrics_gauge(
        p->metrics, "chunkserve:cluster_secret_key_id", NULL,
        "id of the cluster secret this process proves (48 bits of PBKDF2 of it, not the secret; "
        "0: none): a rotation step has reached every process when they all show one id");
    p->m_keys = cs_metrics_gauge(p->metrics, "chunkserve:cluster_secret_keys", NULL,
                                 "cluster secrets this process accepts (2 during a rotation)");
    p->m_reloads = cs_metrics_counter(p->metrics, "chunkserve:cluster_secret_reloads_total", NULL,
                                      "new cluster secrets read from --cluster-secret-file");
    p->m_reload_errors =
        cs_metrics_counter(p->metrics, "chunkserve:cluster_secret_reload_errors_total", NULL,
                           "changes of --cluster-secret-file refused, or the file unreadable "
                           "(once while it lasts): the previous secret stays");
}

/* -------------------------------------------------------------- stop -- */

static void on_server_done(void *data) {
    cs_proc *p = data;
    p->srv = NULL;
    p->role->stop(p, p->rd);
    cs_http_server_close(p->http);
    p->http = NULL;
    cs_rpc_loop_close(p->rl);
}

/* The drain is over: the RPC server goes (its own grace is a backstop for
 * the calls cancel_all just ended). */
static void close_server(cs_proc *p, int32_t cancelled) {
    if (p->server_closing) return;
    p->server_closing = true;
    uv_close((uv_handle_t *)&p->grace, NULL);
    uv_close((uv_handle_t *)&p->drain_poll, NULL);
    uv_close((uv_handle_t *)&p->reload, NULL);
    CS_LOGI("drained in %.3f s (%d calls ended by the grace period): shutting down",
            cs_now() - p->drain_start, cancelled);
    cs_rpc_server_shutdown(p->srv, SERVER_BACKSTOP_MS, on_server_done, p);
}

static void on_grace(uv_timer_t *t) {
    cs_proc *p = t->data;
    int32_t n = p->role->n_open(p, p->rd);
    if (n) p->role->cancel_all(p, p->rd);
    close_server(p, n);
}

static void on_drain_poll(uv_timer_t *t) {
    cs_proc *p = t->data;
    if (p->role->n_open(p, p->rd) == 0) close_server(p, 0);
}

static void on_signal(uv_signal_t *h, int signum) {
    cs_proc *p = h->data;
    if (p->draining) return;
    p->draining = true;
    p->drain_start = cs_now();
    CS_LOGI("signal %d: draining (%d open, %lld ms grace)", signum, p->role->n_open(p, p->rd),
            (long long)p->o->grace_ms);
    uv_close((uv_handle_t *)&p->sigterm, NULL);
    uv_close((uv_handle_t *)&p->sigint, NULL);
    cs_rpc_health_shutdown(p->health);
    if (p->role->drain) p->role->drain(p, p->rd);
    uv_timer_start(&p->grace, on_grace, (uint64_t)p->o->grace_ms, 0);
    uv_timer_start(&p->drain_poll, on_drain_poll, 0, DRAIN_POLL_MS);
}

static void on_failed_server_done(void *data) {
    cs_proc *p = data;
    p->srv = NULL;
    cs_rpc_loop_close(p->rl);
}

/* --------------------------------------------------------------- run -- */

int cs_proc_run(const cs_proc_opts *o, const cs_proc_role *role, void *role_data) {
    CS_ASSERT(o && role && role->start && role->n_open && role->cancel_all && role->stop);
    cs_proc *p = calloc(1, sizeof *p);
    if (!p) return cs_fail(CS_ENOMEM, "out of memory");
    p->o = o;
    p->role = role;
    p->rd = role_data;
    const char *http_host = o->http_host && o->http_host[0] ? o->http_host : o->host;
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%d", o->host, o->port);
    cs_rpc_server_opts so = {
        .addr = addr, .max_recv_bytes = o->max_recv_bytes, .lim = o->rpc, .tls = o->tls};
    bool uv_ok = false, started = false;
    int r;
    if ((r = cs_metrics_init(&p->metrics))) goto fail;
    p->m_draining =
        cs_metrics_gauge(p->metrics, "chunkserve:draining", NULL,
                         "1 from SIGTERM on: taking no new requests, finishing the open ones");
    if (o->secret) register_secret(p);
    if ((r = uv_loop_init(&p->uv))) {
        r = cs_fail(CS_EIO, "uv_loop_init: %s", uv_strerror(r));
        goto fail;
    }
    uv_ok = true;
    if ((r = cs_rpc_loop_init(&p->uv, &p->rl))) goto fail;
    if ((r = cs_rpc_server_init(p->rl, &so, &p->srv))) goto fail;
    if ((r = cs_rpc_health_init(p->srv, &p->health))) goto fail;
    started = true; /* from here on, role->stop runs whatever happens */
    if ((r = role->start(p, role_data))) goto fail;
    if ((r = cs_rpc_server_start(p->srv, &p->port))) goto fail;
    cs_http_routes routes = {
        .metrics = p->metrics, .before_metrics = before_metrics, .ready = ready, .arg = p};
    if ((r = cs_http_ops_start(&p->uv, http_host, o->http_port, &routes, &p->http))) {
        if (!cs_last_error()[0])
            cs_fail(r, "http: cannot listen on %s:%d: %s", http_host, o->http_port, uv_strerror(r));
        goto fail;
    }
    cs_rpc_health_set(p->health, "", CS_RPC_SERVING_SERVING);
    if (role->health_service)
        cs_rpc_health_set(p->health, role->health_service, CS_RPC_SERVING_SERVING);
    uv_signal_init(&p->uv, &p->sigterm);
    uv_signal_init(&p->uv, &p->sigint);
    uv_timer_init(&p->uv, &p->grace);
    uv_timer_init(&p->uv, &p->drain_poll);
    uv_timer_init(&p->uv, &p->reload);
    p->sigterm.data = p->sigint.data = p->grace.data = p->drain_poll.data = p->reload.data = p;
    if (o->secret && o->secret->set) log_secret("cluster secret", o->secret);
    if (o->secret && o->secret_file && o->secret_file[0]) {
        uint64_t ms = (uint64_t)(o->tls.reload_s > 0 ? o->tls.reload_s : 10) * 1000;
        uv_timer_start(&p->reload, on_reload, ms, ms);
    }
    uv_signal_start(&p->sigterm, on_signal, SIGTERM);
    uv_signal_start(&p->sigint, on_signal, SIGINT);
    printf("listening on %s:%d\nhttp listening on %s:%d\n", o->host, p->port, http_host,
           cs_http_server_port(p->http));
    fflush(stdout);
    if (role->started) role->started(p, role_data); /* may print more listening lines */
    uv_run(&p->uv, UV_RUN_DEFAULT);
    r = 0;
    CS_LOGI("stopped");
    goto out;

fail:
    CS_LOGE("cannot start: %s", cs_last_error()[0] ? cs_last_error() : cs_strerror(r));
    {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", cs_last_error()); /* teardown may overwrite it */
        cs_http_server_close(p->http);
        p->http = NULL;
        if (started) role->stop(p, role_data);
        if (p->srv)
            cs_rpc_server_shutdown(p->srv, 0, on_failed_server_done, p);
        else if (p->rl)
            cs_rpc_loop_close(p->rl);
        if (uv_ok) uv_run(&p->uv, UV_RUN_DEFAULT);
        cs_fail(r, "%s", msg);
    }
out:
    cs_rpc_health_free(p->health);
    if (uv_ok && uv_loop_close(&p->uv) != 0) CS_LOGW("the event loop still had handles at exit");
    if (uv_ok && !cs_rpc_wait_grpc_ended(2000))
        CS_LOGW("gRPC was still in use 2 s after the last close");
    if (role->free) role->free(p, role_data);
    cs_metrics_free(p->metrics);
    free(p);
    return r;
}
