/* chunkserve/http.h: the small HTTP/1.1 server every process runs beside
 * its gRPC port for operators: GET /metrics (Prometheus text), /healthz
 * (alive), /readyz (ready for traffic), on a libuv loop. Requests are parsed
 * with http-parser (libhttp-parser); keep-alive is supported; bodies of
 * requests are ignored; a request larger than 16 KiB or malformed gets 400
 * and the connection is closed; an idle connection is closed after 30 s.
 * Everything runs on the loop thread; the handler must not block.
 * Not here: TLS, request bodies, the OpenAI-compatible API (a later issue). */
#ifndef CHUNKSERVE_HTTP_H
#define CHUNKSERVE_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct uv_loop_s;
typedef struct cs_http_server cs_http_server;
typedef struct cs_metrics cs_metrics;

/* Answers of the built-in routes come from these callbacks (loop thread). */
typedef struct {
    cs_metrics *metrics; /* rendered by GET /metrics; NULL = 404 */
    /* Called before each /metrics render, to refresh gauges (may be NULL). */
    void (*before_metrics)(void *arg);
    /* /healthz: 200 "ok" when it returns true (NULL = always true), else 503. */
    bool (*healthy)(void *arg);
    /* /readyz: 200 "ready" when true (NULL = always true), else 503 with the
     * reason written into why (NUL-terminated, at most why_len bytes). */
    bool (*ready)(void *arg, char *why, size_t why_len);
    void *arg;
} cs_http_routes;

/* Binds host:port (port 0 = any free port, see cs_http_server_port) and
 * starts accepting on loop. The routes struct is copied. CS_EINVAL, CS_ENOMEM,
 * or the bind error (e.g. -EADDRINUSE). Free with cs_http_server_close. */
int cs_http_server_init(struct uv_loop_s *loop, const char *host, int port,
                        const cs_http_routes *routes, cs_http_server **out);
int cs_http_server_port(const cs_http_server *s);
/* Closes the listener and every connection; the memory is freed once libuv
 * has closed the handles (keep running the loop). NULL is a no-op. */
void cs_http_server_close(cs_http_server *s);

#ifdef __cplusplus
}
#endif
#endif
