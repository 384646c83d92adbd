/* http.c: the operator HTTP/1.1 server (chunkserve/http.h): GET/HEAD
 * /metrics, /healthz, /readyz on a libuv loop, requests parsed by
 * http-parser. Each request is answered as soon as it is complete, in order,
 * so pipelined requests get their responses in order (uv_write queues them).
 * Not here: request bodies (skipped), TLS, chunked responses.
 *
 * A connection owns two handles (its socket and its idle timer) and is freed
 * when both close callbacks have run, which libuv calls from its closing
 * phase: never inside the connection's own read or write callbacks. Closing
 * after a response is graceful: the write side is shut down once the queued
 * responses are out, and the socket closes at the peer's end of stream (or a
 * short linger), so a client that is still sending is not answered with a
 * reset that could destroy the response it has not read yet. */
#include "chunkserve/http.h"

#include <errno.h>
#include <http_parser.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/metrics.h"
#include "http-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

#define MAX_CONNS 1024  /* more are accepted and closed at once */
#define MAX_INFLIGHT 16 /* responses queued per connection before reading pauses */
#define LINGER_MS 5000  /* after our last response, how long we wait for the peer's close */
#define READ_BUF 8192
#define URL_MAX 1024 /* longer targets are kept truncated: they name no route */

enum conn_state { CONN_OPEN, CONN_DRAINING, CONN_CLOSING };

typedef struct conn conn;
struct conn {
    cs_http_server *server;
    conn *prev, *next; /* the server's list */
    uv_tcp_t tcp;
    uv_timer_t timer; /* idle, then linger */
    uv_shutdown_t shutdown;
    http_parser parser;
    enum conn_state state;
    int open_handles; /* tcp + timer; the conn is freed when this reaches 0 */
    int n_writes;     /* responses handed to uv_write and not yet called back */
    bool reading, peer_eof, shutdown_started, shutdown_done;
    size_t req_bytes; /* of the request being parsed */
    /* The request just completed (recorded by on_message_complete). */
    char url[URL_MAX];
    size_t url_len;
    unsigned method;
    bool keep_alive, http10;
    /* Input not parsed yet, rbuf[roff..rlen): non-empty only while reading is
     * paused (too many responses queued); alloc_cb hands out rbuf otherwise. */
    size_t roff, rlen;
    char rbuf[READ_BUF];
};

struct cs_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    cs_http_routes routes;
    int port;
    uint64_t idle_ms;
    bool closing, listener_closed;
    conn *conns;
    size_t n_conns;
};

static void conn_process(conn *c);

static void maybe_free_server(cs_http_server *s) {
    if (s->closing && s->listener_closed && s->n_conns == 0) free(s);
}

static void on_listener_close(uv_handle_t *h) {
    cs_http_server *s = h->data;
    s->listener_closed = true;
    maybe_free_server(s);
}

static void on_conn_close(uv_handle_t *h) {
    conn *c = h->data;
    if (--c->open_handles > 0) return;
    cs_http_server *s = c->server;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    free(c);
    maybe_free_server(s);
}

/* Closes both handles now (pending writes are cancelled); freed in on_conn_close. */
static void conn_close(conn *c) {
    if (c->state == CONN_CLOSING) return;
    c->state = CONN_CLOSING;
    uv_close((uv_handle_t *)&c->tcp, on_conn_close);
    uv_close((uv_handle_t *)&c->timer, on_conn_close);
}

static void on_timer(uv_timer_t *t) {
    conn *c = t->data;
    CS_LOGD("http: closing %s connection", c->state == CONN_OPEN ? "an idle" : "a lingering");
    conn_close(c);
}

static void conn_timer(conn *c, uint64_t ms) {
    uv_timer_start(&c->timer, on_timer, ms, 0);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    conn *c = h->data;
    /* Reading runs only while rbuf holds nothing unparsed. */
    CS_ASSERT(c->roff == c->rlen);
    *buf = uv_buf_init(c->rbuf, sizeof c->rbuf);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
    conn *c = req->data;
    if (c->state == CONN_CLOSING) return; /* cancelled by conn_close */
    c->shutdown_done = true;
    if (status < 0 || c->peer_eof) conn_close(c);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);

/* Stops answering: the queued responses go out, then our end of stream;
 * input is read and dropped until the peer's end of stream or the linger. */
static void conn_drain(conn *c) {
    if (c->state != CONN_OPEN) return;
    c->state = CONN_DRAINING;
    c->roff = c->rlen = 0;
    if (!c->peer_eof && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
            conn_close(c);
            return;
        }
        c->reading = true;
    }
    c->shutdown.data = c;
    c->shutdown_started = true;
    if (uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) != 0) {
        conn_close(c);
        return;
    }
    conn_timer(c, c->server->idle_ms < LINGER_MS ? c->server->idle_ms : LINGER_MS);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
    conn *c = st->data;
    if (c->state == CONN_CLOSING || nread == 0) return;
    if (nread > 0) {
        if (c->state != CONN_OPEN) return; /* draining: dropped */
        conn_timer(c, c->server->idle_ms);
        c->roff = 0;
        c->rlen = (size_t)nread;
        conn_process(c);
        return;
    }
    if (nread != UV_EOF) {
        CS_LOGD("http: read error: %s", uv_strerror((int)nread));
        conn_close(c);
        return;
    }
    c->peer_eof = true;
    uv_read_stop(st);
    c->reading = false;
    if (c->state == CONN_OPEN)
        conn_drain(c); /* answers already queued still go out */
    else if (c->shutdown_done)
        conn_close(c);
    /* else on_shutdown closes, now that peer_eof is set */
}

typedef struct {
    uv_write_t req;
    conn *c;
    char *owned; /* a body to free after the write, or NULL */
    char head[];
} wreq;

static void on_write(uv_write_t *req, int status) {
    wreq *w = (wreq *)req;
    conn *c = w->c;
    free(w->owned);
    free(w);
    c->n_writes--;
    if (c->state == CONN_CLOSING) return;
    if (status < 0) {
        CS_LOGD("http: write error: %s", uv_strerror(status));
        conn_close(c);
        return;
    }
    if (c->state == CONN_OPEN) {
        conn_timer(c, c->server->idle_ms);
        /* Half the queue drained: go on parsing what is buffered, then reading. */
        if (!c->reading && c->n_writes <= MAX_INFLIGHT / 2) conn_process(c);
    }
}

static const char *status_text(int status) {
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
    }
}

/* Queues one response. body: len bytes; owned: body is malloc'd and now
 * ours. close: this is the connection's last response. */
static void send_response(conn *c, int status, const char *ctype, const char *body, size_t len,
                          bool owned, bool close, const char *extra) {
    char head[512];
    bool head_only = c->method == HTTP_HEAD;
    int hlen = snprintf(head, sizeof head,
                        "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s%s\r\n",
                        status, status_text(status), ctype, len, extra ? extra : "",
                        close       ? "Connection: close\r\n"
                        : c->http10 ? "Connection: keep-alive\r\n"
                                    : "");
    CS_ASSERT(hlen > 0 && (size_t)hlen < sizeof head);
    size_t inline_len = (size_t)hlen + (owned || head_only ? 0 : len);
    wreq *w = malloc(sizeof *w + inline_len);
    if (!w) {
        if (owned) free((void *)body);
        CS_LOGW("http: out of memory for a response; closing the connection");
        conn_close(c);
        return;
    }
    w->c = c;
    w->owned = NULL;
    memcpy(w->head, head, (size_t)hlen);
    uv_buf_t bufs[2] = {uv_buf_init(w->head, (unsigned)inline_len), uv_buf_init(NULL, 0)};
    unsigned nbufs = 1;
    if (!head_only && !owned) memcpy(w->head + hlen, body, len);
    if (owned && head_only) free((void *)body);
    if (owned && !head_only) {
        w->owned = (char *)body;
        bufs[1] = uv_buf_init(w->owned, (unsigned)len);
        nbufs = 2;
    }
    int r = uv_write(&w->req, (uv_stream_t *)&c->tcp, bufs, nbufs, on_write);
    if (r != 0) {
        free(w->owned);
        free(w);
        CS_LOGD("http: write failed: %s", uv_strerror(r));
        conn_close(c);
        return;
    }
    c->n_writes++;
    if (close) conn_drain(c);
}

static void send_text(conn *c, int status, const char *text, bool close, const char *extra) {
    send_response(c, status, "text/plain; charset=utf-8", text, strlen(text), false, close, extra);
}

/* The request recorded in c is complete: answer it. */
static void handle_request(conn *c) {
    const cs_http_routes *rt = &c->server->routes;
    bool close = !c->keep_alive;
    /* The path of an origin-form or absolute-form target, without the query. */
    struct http_parser_url u;
    http_parser_url_init(&u);
    const char *path = "";
    size_t path_len = 0;
    if (http_parser_parse_url(c->url, c->url_len, 0, &u) == 0 && (u.field_set & (1 << UF_PATH))) {
        path = c->url + u.field_data[UF_PATH].off;
        path_len = u.field_data[UF_PATH].len;
    }
    enum { R_NONE, R_METRICS, R_HEALTHZ, R_READYZ } route = R_NONE;
    if (path_len == 8 && !memcmp(path, "/metrics", 8))
        route = rt->metrics ? R_METRICS : R_NONE;
    else if (path_len == 8 && !memcmp(path, "/healthz", 8))
        route = R_HEALTHZ;
    else if (path_len == 7 && !memcmp(path, "/readyz", 7))
        route = R_READYZ;
    if (route == R_NONE) {
        send_text(c, 404, "not found\n", close, NULL);
        return;
    }
    if (c->method != HTTP_GET && c->method != HTTP_HEAD) {
        send_text(c, 405, "method not allowed\n", close, "Allow: GET, HEAD\r\n");
        return;
    }
    /* The callbacks may close the server (and so this connection). */
    if (route == R_METRICS) {
        if (rt->before_metrics) rt->before_metrics(rt->arg);
        if (c->state != CONN_OPEN) return;
        char *text = NULL;
        size_t len = 0;
        if (cs_metrics_render(rt->metrics, &text, &len) != 0) {
            send_text(c, 500, "cannot render metrics\n", close, NULL);
            return;
        }
        send_response(c, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, true, close,
                      NULL);
    } else if (route == R_HEALTHZ) {
        bool ok = !rt->healthy || rt->healthy(rt->arg);
        if (c->state != CONN_OPEN) return;
        send_text(c, ok ? 200 : 503, ok ? "ok\n" : "unhealthy\n", close, NULL);
    } else {
        char why[256] = "";
        bool ok = !rt->ready || rt->ready(rt->arg, why, sizeof why);
        if (c->state != CONN_OPEN) return;
        if (ok) {
            send_text(c, 200, "ready\n", close, NULL);
        } else {
            char body[300];
            why[sizeof why - 1] = 0;
            snprintf(body, sizeof body, "not ready: %s\n", why[0] ? why : "no reason given");
            send_text(c, 503, body, close, NULL);
        }
    }
}

static int on_message_begin(http_parser *p) {
    conn *c = p->data;
    c->url_len = 0;
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t len) {
    conn *c = p->data;
    size_t room = sizeof c->url - c->url_len;
    if (len > room) len = room; /* a truncated target matches no route */
    memcpy(c->url + c->url_len, at, len);
    c->url_len += len;
    return 0;
}

static int on_message_complete(http_parser *p) {
    conn *c = p->data;
    c->method = p->method;
    c->keep_alive = http_should_keep_alive(p) && !p->upgrade;
    c->http10 = p->http_major == 1 && p->http_minor == 0;
    /* One request at a time: execute returns here, the caller answers. */
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings parser_settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_message_complete = on_message_complete,
};

/* Parses and answers what rbuf holds, then reads on, unless too many
 * responses are queued: then reading pauses and on_write resumes here. */
static void conn_process(conn *c) {
    while (c->state == CONN_OPEN && c->roff < c->rlen) {
        if (c->n_writes >= MAX_INFLIGHT) {
            if (c->reading) uv_read_stop((uv_stream_t *)&c->tcp);
            c->reading = false;
            return;
        }
        size_t n = c->rlen - c->roff;
        size_t done = http_parser_execute(&c->parser, &parser_settings, c->rbuf + c->roff, n);
        c->roff += done;
        c->req_bytes += done;
        enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
        if (c->req_bytes > CS_HTTP_MAX_REQUEST) {
            c->method = HTTP_GET; /* a body even if the request said HEAD */
            send_text(c, 400, "request too large\n", true, NULL);
        } else if (e == HPE_PAUSED) {
            http_parser_pause(&c->parser, 0);
            c->req_bytes = 0;
            handle_request(c);
        } else if (e != HPE_OK || done < n) {
            CS_LOGD("http: bad request: %s", http_errno_description(e));
            c->method = HTTP_GET;
            send_text(c, 400, "bad request\n", true, NULL);
        }
    }
    if (c->state != CONN_OPEN) return;
    c->roff = c->rlen = 0;
    if (!c->reading && !c->peer_eof) {
        if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
            conn_close(c);
            return;
        }
        c->reading = true;
    }
}

static void on_connection(uv_stream_t *listener, int status) {
    cs_http_server *s = listener->data;
    if (status < 0) {
        CS_LOGW("http: accept: %s", uv_strerror(status));
        return;
    }
    conn *c = calloc(1, sizeof *c);
    if (!c) {
        /* libuv stops accepting until the pending connection is taken. */
        CS_LOGW("http: out of memory for a connection");
        return;
    }
    c->server = s;
    uv_tcp_init(s->loop, &c->tcp);
    uv_timer_init(s->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    int r = uv_accept(listener, (uv_stream_t *)&c->tcp);
    if (r == 0 && s->n_conns > MAX_CONNS) {
        CS_LOGW("http: %d connections open; refusing another", MAX_CONNS);
        r = UV_EMFILE;
    }
    if (r == 0) r = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (r != 0) {
        conn_close(c);
        return;
    }
    c->reading = true;
    uv_tcp_nodelay(&c->tcp, 1);
    conn_timer(c, s->idle_ms);
}

int cs_http_server_init(struct uv_loop_s *loop, const char *host, int port,
                        const cs_http_routes *routes, cs_http_server **out) {
    if (!out) return cs_fail(CS_EINVAL, "http: no place for the server");
    *out = NULL;
    if (!loop || !host || !routes)
        return cs_fail(CS_EINVAL, "http: loop, host and routes are required");
    if (port < 0 || port > 65535)
        return cs_fail(CS_EINVAL, "http: port %d is not in 0..65535", port);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    socklen_t sslen;
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)&ss) == 0)
        sslen = sizeof(struct sockaddr_in);
    else if (uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss) == 0)
        sslen = sizeof(struct sockaddr_in6);
    else
        return cs_fail(CS_EINVAL, "http: '%s' is not a numeric IPv4 or IPv6 address", host);
    /* The socket is bound and listening before any libuv handle exists, so
     * that a bind error leaves nothing behind for the caller's loop. */
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return cs_fail(-errno, "http: socket: %s", strerror(errno));
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, sslen) != 0 || listen(fd, 128) != 0) {
        int e = errno;
        close(fd);
        return cs_fail(-e, "http: cannot listen on %s:%d: %s", host, port, strerror(e));
    }
    struct sockaddr_storage bound;
    socklen_t blen = sizeof bound;
    if (getsockname(fd, (struct sockaddr *)&bound, &blen) != 0) {
        int e = errno;
        close(fd);
        return cs_fail(-e, "http: getsockname: %s", strerror(e));
    }
    cs_http_server *s = calloc(1, sizeof *s);
    if (!s) {
        close(fd);
        return cs_fail(CS_ENOMEM, "http: out of memory");
    }
    s->loop = loop;
    s->routes = *routes;
    s->idle_ms = CS_HTTP_IDLE_MS;
    s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    uv_tcp_init(loop, &s->listener);
    s->listener.data = s;
    int r = uv_tcp_open(&s->listener, fd);
    if (r != 0)
        close(fd);
    else
        r = uv_listen((uv_stream_t *)&s->listener, 128, on_connection);
    if (r != 0) {
        /* Not expected on a listening socket; the memory goes when the loop
         * runs the close callback. */
        s->closing = true;
        uv_close((uv_handle_t *)&s->listener, on_listener_close);
        return cs_fail(r, "http: cannot accept on %s:%d: %s", host, port, uv_strerror(r));
    }
    *out = s;
    return 0;
}

int cs_http_server_port(const cs_http_server *s) {
    return s ? s->port : -1;
}

void cs_http_server_close(cs_http_server *s) {
    if (!s) return;
    CS_ASSERT(!s->closing);
    s->closing = true;
    uv_close((uv_handle_t *)&s->listener, on_listener_close);
    for (conn *c = s->conns; c; c = c->next)
        conn_close(c);
}

void cs__http_server_set_idle_ms(cs_http_server *s, uint64_t ms) {
    s->idle_ms = ms;
}
