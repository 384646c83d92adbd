/* bench_http.h: the HTTP/1.1 client `chunkserve bench serve` uses for an
 * OpenAI-compatible target (bench_http.c): one request per connection
 * (Connection: close), on a libuv loop, the response read with
 * http_parser; a streamed (text/event-stream) body is cut into its SSE
 * events' data, any other body handed over whole. Every request has a
 * deadline. Loop thread only.
 * Not here: keep-alive pools, TLS, redirects, chunked request bodies. */
#ifndef CS_CLI_BENCH_HTTP_H
#define CS_CLI_BENCH_HTTP_H

#include <stddef.h>

struct uv_loop_s;
struct sockaddr;

typedef struct {
    /* One SSE event's data (without "data: "; "[DONE]" is not passed), or a
     * whole non-SSE body of a 2xx answer. Not NUL-terminated. */
    void (*on_data)(void *user, const char *data, size_t len);
    /* Exactly once, last: status the HTTP status (0: no answer: connect,
     * I/O or deadline, with the reason in msg), msg a non-2xx body or the
     * reason (NUL-terminated, valid during the call). */
    void (*on_done)(void *user, int status, const char *msg);
} cs_http_client_cbs;

/* Sends method path to addr (Host: host), with headers (CRLF-terminated
 * lines, or NULL) and body (may be NULL). CS_ENOMEM, CS_EIO (then no
 * callback runs). */
int cs_http_client_request(struct uv_loop_s *uv, const struct sockaddr *addr, const char *host,
                           const char *method, const char *path, const char *headers,
                           const char *body, size_t body_len, double timeout_s,
                           const cs_http_client_cbs *cbs, void *user);

/* "http://HOST:PORT" (a trailing slash allowed) into host (cap bytes) and
 * an address (resolved now, blocking: once, at start). CS_EINVAL with a
 * message naming the target. */
int cs_http_client_resolve(const char *url, char *host, size_t cap, struct sockaddr *addr,
                           size_t addr_cap);

#endif
