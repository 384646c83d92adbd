/* ops_http.c: the operator routes (cs_http_ops_start in chunkserve/http.h):
 * GET/HEAD /metrics (Prometheus text), /healthz, /readyz as one handler on
 * the HTTP server of http.c, answered at once, text/plain. Request bodies
 * are read (within the 16 KiB a request may have) and ignored. Its own
 * errors keep the operator server's historical form: anything too large is a
 * 400 "request too large". Not here: anything that takes time to answer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <http_parser.h>

#include "chunkserve/error.h"
#include "chunkserve/http.h"
#include "chunkserve/metrics.h"
#include "http-impl.h"

#define TEXT "text/plain; charset=utf-8"

static void send_text(cs_http_res *res, int status, const char *text, const char *extra) {
    /* A failure means the connection is gone or closed: nothing to do. */
    (void)cs_http_res_send(res, status, TEXT, extra, text, strlen(text));
}

/* The callbacks may close the server (and so this connection): then the
 * sends return CS_ECONNRESET and the response is only ended. */
static void ops_handle(void *arg, cs_http_req *req, cs_http_res *res) {
    const cs_http_routes *rt = arg;
    const char *path = cs_http_req_path(req);
    unsigned method = cs_http_req_method(req);
    enum { R_NONE, R_METRICS, R_HEALTHZ, R_READYZ } route = R_NONE;
    if (!strcmp(path, "/metrics"))
        route = rt->metrics ? R_METRICS : R_NONE;
    else if (!strcmp(path, "/healthz"))
        route = R_HEALTHZ;
    else if (!strcmp(path, "/readyz"))
        route = R_READYZ;
    if (route == R_NONE) {
        send_text(res, 404, "not found\n", NULL);
    } else if (method != HTTP_GET && method != HTTP_HEAD) {
        send_text(res, 405, "method not allowed\n", "Allow: GET, HEAD\r\n");
    } else if (route == R_METRICS) {
        if (rt->before_metrics) rt->before_metrics(rt->arg);
        char *text = NULL;
        size_t len = 0;
        if (cs_metrics_render(rt->metrics, &text, &len) != 0) {
            send_text(res, 500, "cannot render metrics\n", NULL);
        } else {
            (void)cs_http_res_send(res, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, text,
                                   len);
            free(text);
        }
    } else if (route == R_HEALTHZ) {
        bool ok = !rt->healthy || rt->healthy(rt->arg);
        send_text(res, ok ? 200 : 503, ok ? "ok\n" : "unhealthy\n", NULL);
    } else {
        char why[256] = "";
        bool ok = !rt->ready || rt->ready(rt->arg, why, sizeof why);
        if (ok) {
            send_text(res, 200, "ready\n", NULL);
        } else {
            char body[300];
            why[sizeof why - 1] = 0;
            snprintf(body, sizeof body, "not ready: %s\n", why[0] ? why : "no reason given");
            send_text(res, 503, body, NULL);
        }
    }
    cs_http_res_end(res);
}

static void ops_error(void *arg, int status, const char *message, cs_http_res *res) {
    (void)arg;
    switch (status) {
    case 413:
    case 431: send_text(res, 400, "request too large\n", NULL); break;
    case 400: send_text(res, 400, "bad request\n", NULL); break;
    default: break; /* the server's text/plain "<message>\n" */
    }
}

int cs_http_ops_start(struct uv_loop_s *loop, const char *host, int port,
                      const cs_http_routes *routes, cs_http_server **out) {
    if (!out) return cs_fail(CS_EINVAL, "http: no place for the server");
    *out = NULL;
    if (!routes) return cs_fail(CS_EINVAL, "http: loop, host and routes are required");
    cs_http_routes *rt = malloc(sizeof *rt);
    if (!rt) return cs_fail(CS_ENOMEM, "http: out of memory");
    *rt = *routes;
    cs_http_opts o = {.handler = ops_handle, .arg = rt, .error = ops_error};
    int r = cs_http_server_start(loop, host, port, &o, out);
    if (r) {
        free(rt);
        return r;
    }
    cs__http_server_on_free(*out, free, rt);
    return 0;
}
