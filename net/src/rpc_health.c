/* rpc_health.c: grpc.health.v1.Health (Check, Watch) over the RPC layer: a
 * small table of service statuses and the list of Watch streams, each sent
 * the status of its service whenever it changes. Not here: deciding what is
 * healthy; the process sets statuses. */
#include <stdlib.h>
#include <string.h>

#include "chunkserve/rpc_health.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpc-impl.h"

typedef struct {
    char *name;
    enum cs_rpc_serving status;
} cs__health_svc;

typedef struct cs__health_watch {
    struct cs__health_watch *prev, *next;
    cs_rpc_health *h;
    cs_rpc_call *call;
    char *service;
    enum cs_rpc_serving last; /* what the stream was last sent */
} cs__health_watch;

struct cs_rpc_health {
    cs__health_svc *svcs; /* (n_svcs) */
    size_t n_svcs;
    cs__health_watch *watches;
    int64_t n_watches, max_watches;
    bool shut;
};

static cs__health_svc *find_svc(cs_rpc_health *h, const char *name) {
    for (size_t i = 0; i < h->n_svcs; i++)
        if (strcmp(h->svcs[i].name, name) == 0) return &h->svcs[i];
    return NULL;
}

static enum cs_rpc_serving status_of(cs_rpc_health *h, const char *name, bool watch) {
    cs__health_svc *s = find_svc(h, name);
    if (h->shut) return CS_RPC_SERVING_NOT_SERVING;
    if (!s) return watch ? CS_RPC_SERVING_SERVICE_UNKNOWN : CS_RPC_SERVING_UNKNOWN;
    return s->status;
}

static void response(Grpc__Health__V1__HealthCheckResponse *r, enum cs_rpc_serving st) {
    grpc__health__v1__health_check_response__init(r);
    r->status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)st;
}

static void handle_check(cs_rpc_call *c, void *data) {
    cs_rpc_health *h = data;
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)cs_rpc_call_request_msg(c);
    if (!h->shut && !find_svc(h, req->service)) {
        cs_rpc_call_finish(c, CS_RPC_NOT_FOUND, "unknown service");
        return;
    }
    Grpc__Health__V1__HealthCheckResponse r;
    response(&r, status_of(h, req->service, false));
    cs_rpc_call_reply_msg(c, &r.base);
}

static void watch_end(cs__health_watch *w, int code, const char *msg) {
    cs_rpc_health *h = w->h;
    if (w->prev)
        w->prev->next = w->next;
    else
        h->watches = w->next;
    if (w->next) w->next->prev = w->prev;
    h->n_watches--;
    cs_rpc_call_finish(w->call, code, msg);
    free(w->service);
    free(w);
}

static void on_watch_cancel(cs_rpc_call *c, void *data) {
    watch_end(data, CS_RPC_CANCELLED, NULL);
}

static void watch_send(cs__health_watch *w, enum cs_rpc_serving st) {
    Grpc__Health__V1__HealthCheckResponse r;
    response(&r, st);
    if (cs_rpc_call_send_msg(w->call, &r.base) == 0) w->last = st;
}

static void handle_watch(cs_rpc_call *c, void *data) {
    cs_rpc_health *h = data;
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)cs_rpc_call_request_msg(c);
    if (h->n_watches >= h->max_watches) {
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED,
                           "too many Health/Watch streams on this server; use Check");
        return;
    }
    cs__health_watch *w = calloc(1, sizeof *w);
    if (!w || !(w->service = strdup(req->service))) {
        free(w);
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    w->h = h;
    w->call = c;
    w->next = h->watches;
    if (h->watches) h->watches->prev = w;
    h->watches = w;
    h->n_watches++;
    cs_rpc_call_on_cancel(c, on_watch_cancel, w);
    watch_send(w, status_of(h, w->service, true));
    if (h->shut) watch_end(w, CS_RPC_UNAVAILABLE, "server is shutting down");
}

static int set_status(cs_rpc_health *h, const char *service, enum cs_rpc_serving status) {
    cs__health_svc *s = find_svc(h, service);
    if (!s) {
        cs__health_svc *svcs = realloc(h->svcs, (h->n_svcs + 1) * sizeof *svcs);
        if (!svcs) return cs_fail(CS_ENOMEM, "rpc: out of memory");
        h->svcs = svcs;
        s = &svcs[h->n_svcs];
        if (!(s->name = strdup(service))) return cs_fail(CS_ENOMEM, "rpc: out of memory");
        h->n_svcs++;
    }
    s->status = status;
    for (cs__health_watch *w = h->watches; w; w = w->next)
        if (w->last != status && strcmp(w->service, service) == 0) watch_send(w, status);
    return 0;
}

int cs_rpc_health_init(cs_rpc_server *s, cs_rpc_health **out) {
    *out = NULL;
    cs_rpc_health *h = calloc(1, sizeof *h);
    if (!h) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    h->max_watches = cs__rpc_server_max_watches(s);
    int rc = set_status(h, "", CS_RPC_SERVING_NOT_SERVING);
    if (rc == 0)
        rc = cs_rpc_server_add_method(s, "/grpc.health.v1.Health/Check", CS_RPC_UNARY,
                                      &grpc__health__v1__health_check_request__descriptor,
                                      handle_check, h);
    if (rc == 0)
        rc = cs_rpc_server_add_method(s, "/grpc.health.v1.Health/Watch", CS_RPC_SERVER_STREAMING,
                                      &grpc__health__v1__health_check_request__descriptor,
                                      handle_watch, h);
    if (rc) {
        cs_rpc_health_free(h);
        return rc;
    }
    *out = h;
    return 0;
}

int cs_rpc_health_set(cs_rpc_health *h, const char *service, enum cs_rpc_serving status) {
    if (!service || status < CS_RPC_SERVING_UNKNOWN || status > CS_RPC_SERVING_NOT_SERVING)
        return cs_fail(CS_EINVAL, "rpc: health status %d for '%s'", (int)status,
                       service ? service : "(null)");
    if (h->shut) return 0;
    return set_status(h, service, status);
}

void cs_rpc_health_shutdown(cs_rpc_health *h) {
    if (h->shut) return;
    for (size_t i = 0; i < h->n_svcs; i++)
        set_status(h, h->svcs[i].name, CS_RPC_SERVING_NOT_SERVING);
    h->shut = true;
    while (h->watches)
        watch_end(h->watches, CS_RPC_UNAVAILABLE, "server is shutting down");
}

void cs_rpc_health_free(cs_rpc_health *h) {
    if (!h) return;
    CS_ASSERT(!h->watches); /* the server must be gone first */
    for (size_t i = 0; i < h->n_svcs; i++)
        free(h->svcs[i].name);
    free(h->svcs);
    free(h);
}
