/* chunkserve/http.h: the one HTTP/1.1 server of chunkserve, on a libuv loop,
 * with a request handler interface, and the operator routes as one handler on
 * it (cs_http_ops_start: GET/HEAD /metrics, /healthz, /readyz beside every
 * process's gRPC port). The OpenAI-compatible API is another handler on a
 * second server instance (its own port).
 *
 * Thread model: everything (the handler, the error hook, every cs_http_res_*
 * call, on_close callbacks) runs on the loop thread; nothing blocks. Requests
 * are parsed by http-parser; bodies (Content-Length or chunked, decoded) are
 * collected whole before the handler is called. One request at a time per
 * connection: while a response is in flight the next pipelined request waits
 * (its bytes stay buffered; reading pauses when the buffer is full), so
 * responses go out in request order. Keep-alive per HTTP/1.1 and 1.0 rules;
 * Connection: close is honoured.
 *
 * A request's life on its connection:
 *   idle --first byte--> arriving --headers+body--> handled --res_end--> idle
 *   idle: the idle timer (idle_ms) runs; expiry closes silently.
 *   arriving: the request deadline (request_ms from its first byte) runs;
 *     expiry: 408 and close. Limits: 431 (headers), 413 (body), malformed 400,
 *     each followed by a graceful close (our last bytes are not lost to a
 *     reset: the write side is shut down, input is read and dropped until the
 *     peer's end or a short linger).
 *   handled: the handler owns the response; no timer runs (a streamed
 *     response takes as long as it takes; cap slow readers with
 *     cs_http_res_pending_bytes).
 * The peer's end of stream while a response is in flight (the handler has
 * not ended it) means the client has gone: the connection closes and
 * on_close fires, so work for a client that left is cancelled even before
 * anything is written (input is read while a response is in flight, as long
 * as the buffer has room). Half-closed clients are still answered when the
 * handler answers within its call (queued responses go out before our end of
 * stream). A reset or a failed write also closes the connection.
 *
 * A server holds at most 1024 connections; more are accepted and closed at
 * once (no 503: answering would cost what the cap saves).
 *
 * Not here: TLS, HTTP/2, Upgrade (answered, then the connection closes),
 * request bodies streamed to the handler piece by piece. */
#ifndef CHUNKSERVE_HTTP_H
#define CHUNKSERVE_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

struct uv_loop_s;
typedef struct cs_http_server cs_http_server;
typedef struct cs_http_req cs_http_req; /* one complete request (loop thread) */
typedef struct cs_http_res cs_http_res; /* its response, in flight */
typedef struct cs_metrics cs_metrics;

/* ------------------------------------------------------------ request -- */

/* The request: valid from the handler call until cs_http_res_end of its
 * response (also after the connection closed). Strings are NUL-terminated and
 * owned by the request. */
unsigned cs_http_req_method(const cs_http_req *r);         /* http-parser's enum http_method */
const char *cs_http_req_method_name(const cs_http_req *r); /* "GET", ... */
/* The target without the query (absolute-form targets: their path only);
 * "" when the target has no path (CONNECT, unparsable). Not percent-decoded. */
const char *cs_http_req_path(const cs_http_req *r);
const char *cs_http_req_query(const cs_http_req *r); /* after '?', "" if none */
/* Case-insensitive name; the first occurrence; NULL if absent; the value
 * without leading or trailing spaces and tabs. Trailers of a chunked body are
 * not included. */
const char *cs_http_req_header(const cs_http_req *r, const char *name);
/* The whole body, NUL-terminated after len bytes (chunked bodies decoded);
 * "" and 0 if none. len may be NULL. */
const char *cs_http_req_body(const cs_http_req *r, size_t *len);
const char *cs_http_req_peer(const cs_http_req *r); /* "ip:port" of the client, for logs */

/* ------------------------------------------------------------- server -- */

/* Called once per complete request. It must answer through res (now or
 * later, from the loop thread) and call cs_http_res_end(res) exactly once. */
typedef void (*cs_http_handler)(void *arg, cs_http_req *req, cs_http_res *res);

typedef struct {
    cs_http_handler handler; /* required */
    void *arg;               /* passed to handler and error */
    /* Request line + headers, bytes; beyond: 431 and close. 0 = 16 KiB;
     * at most 80 KiB (http-parser's own limit, also a 431). */
    size_t max_header_bytes;
    /* Decoded body, bytes; beyond (Content-Length up front, or while a
     * chunked body grows): 413 and close. 0 = the whole request (headers and
     * body) within 16 KiB, as the operator server always had it. */
    size_t max_body_bytes;
    uint64_t idle_ms; /* keep-alive idle timeout, ms; 0 = 30 s */
    /* Deadline for one request's headers + body from its first byte (a
     * pipelined request: from when its turn comes), ms; 0 = 30 s; expiry:
     * 408 and close (slowloris). */
    uint64_t request_ms;
    /* Optional: formats the server's own error responses (400 malformed, 408,
     * 413, 431; 500 when a handler ends a response it never answered) so that
     * a JSON API answers in its format. message is a short lower-case
     * description ("request body too large", "bad request: invalid HTTP
     * version"). It must answer with cs_http_res_send (the connection is
     * closed after it, and "Connection: close" is added); it must not call
     * cs_http_res_end (the server does). NULL, or no answer: text/plain
     * "<message>\n". */
    void (*error)(void *arg, int status, const char *message, cs_http_res *res);
    /* TLS (NULL, or no cert_file: plaintext): cert_file and key_file, and
     * ca_file to require client certificates it signed; read at start (an
     * error names the bad file), re-read when they change (at most every
     * reload_s seconds, at an accept): new connections get the new
     * certificate. HTTP/1.1 over TLS 1.2 or 1.3, ALPN "http/1.1". */
    const cs_rpc_tls *tls;
} cs_http_opts;

/* Binds host (a numeric IPv4 or IPv6 address) and port (0 = any free port,
 * see cs_http_server_port) and starts accepting on loop. opts is copied.
 * Returns 0, CS_EINVAL (no handler, bad host or port), CS_ENOMEM, or the bind
 * error (e.g. -EADDRINUSE); on error *out is NULL and nothing is left on the
 * loop that needs the caller. Free with cs_http_server_close. Loop thread.
 * Sets SIGPIPE to ignored if it is at its default (a peer that is gone must
 * fail a write, not kill the process). */
int cs_http_server_start(struct uv_loop_s *loop, const char *host, int port,
                         const cs_http_opts *opts, cs_http_server **out);
int cs_http_server_port(const cs_http_server *s); /* the bound port; -1 for NULL */
/* Closes the listener and every connection; the memory is freed once libuv
 * has closed the handles (keep running the loop). Responses still in flight:
 * their on_close callbacks fire (from the loop, after this returns), later
 * res calls return CS_ECONNRESET, and their owners must still call
 * cs_http_res_end to free them; the handler is not called again. NULL is a
 * no-op. Loop thread. */
void cs_http_server_close(cs_http_server *s);

/* ----------------------------------------------------------- response -- */

/* A whole response with Content-Length; it ends the response on the wire
 * (cs_http_res_end must still be called). status 200..599; content_type NULL
 * = no Content-Type; extra_headers: NULL or complete header lines, each
 * ending "\r\n" (e.g. "Retry-After: 1\r\n"); body is copied. HEAD requests:
 * headers only. 204 and 304: no body and no Content-Length.
 * Returns 0; CS_EINVAL (bad status, already answered); CS_ECONNRESET
 * (connection gone: nothing is sent); CS_ENOMEM (the connection is closed). */
int cs_http_res_send(cs_http_res *res, int status, const char *content_type,
                     const char *extra_headers, const void *body, size_t len);
/* A streamed response: the status line and headers go out now with
 * Transfer-Encoding: chunked (HTTP/1.0 clients: no chunking, Connection:
 * close, the body ends when the connection closes), then cs_http_res_write
 * for each piece, then cs_http_res_end. status 200..599 but not 204 or 304.
 * Same returns as cs_http_res_send. */
int cs_http_res_start(cs_http_res *res, int status, const char *content_type,
                      const char *extra_headers);
/* One piece of a started response, copied and handed to the socket at once
 * (one chunk; no buffering beyond the socket's queue). len 0 is a no-op.
 * HEAD requests: discarded. Returns 0; CS_EINVAL (not started);
 * CS_ECONNRESET; CS_ENOMEM (the connection is closed). */
int cs_http_res_write(cs_http_res *res, const void *data, size_t len);
/* Ends the response (the terminating chunk of a streamed one; a 500 through
 * the error hook when it was never answered) and frees res and its request;
 * the next pipelined request on the connection is then handled (at once when
 * called inside the handler, else from the loop's next turn). Called exactly
 * once per handler call, also after on_close fired. */
void cs_http_res_end(cs_http_res *res);
/* Bytes handed to the socket and not yet written by the kernel (libuv's
 * write queue: this response's and earlier ones'); 0 once closed. For
 * capping slow readers. */
size_t cs_http_res_pending_bytes(const cs_http_res *res);
/* fn(arg) once, on the loop thread, if the connection closes (peer gone,
 * error, server closing) before cs_http_res_end; from the loop, never inside
 * a cs_http_res_* call, except: registering on an already closed connection
 * calls fn at once. A later call replaces an earlier registration that has
 * not fired. fn may call cs_http_res_end. */
void cs_http_res_on_close(cs_http_res *res, void (*fn)(void *arg), void *arg);
/* True once the connection is gone (send/start/write then return
 * CS_ECONNRESET). */
bool cs_http_res_closed(const cs_http_res *res);

/* ------------------------------------------------- the operator routes -- */

/* Answers of the operator routes come from these callbacks (loop thread). */
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

/* A server (defaults of cs_http_opts) whose handler answers GET/HEAD
 * /metrics, /healthz and /readyz (other paths 404, other methods 405),
 * request bodies ignored, and whose own errors are text/plain 400s ("bad
 * request", "request too large" for anything over 16 KiB) or 408. The
 * routes struct is copied. Returns as cs_http_server_start (CS_EINVAL also
 * for routes == NULL). Free with cs_http_server_close. */
int cs_http_ops_start(struct uv_loop_s *loop, const char *host, int port,
                      const cs_http_routes *routes, cs_http_server **out);

#ifdef __cplusplus
}
#endif
#endif
