/* http.c: the HTTP/1.1 server (chunkserve/http.h) on a libuv loop, requests
 * parsed by http-parser and handed whole (headers and decoded body) to the
 * server's handler, responses written as the handler produces them: whole
 * (Content-Length) or streamed (chunked), over TLS when the server has a
 * certificate (http_tls.c: ciphertext in and out of the socket here,
 * plaintext parsed and written as without it). Not here: what any path
 * means (the handlers: ops_http.c, the OpenAI layer), HTTP/2.
 *
 * A connection owns two handles (its socket and its timer) and is freed when
 * both close callbacks have run, which libuv calls from its closing phase:
 * never inside the connection's own read or write callbacks. A response
 * (cs_http_res, with its request) is a separate allocation owned by the
 * handler until cs_http_res_end: it outlives its connection when the peer goes
 * or the server closes first (res->c is cleared in the connection's close
 * callback, which is also where on_close fires).
 *
 * One connection, one request at a time (the state machine of http.h):
 *   conn->res == NULL, !in_message   idle: timer T_IDLE (restarted by write
 *                                    progress, not by stray bytes)
 *   on_message_begin                 arriving: timer T_REQUEST (absolute)
 *   on_headers_complete (paused)     limits checked, 100 Continue written
 *   on_message_complete (paused)     handled: conn->res set, timer stopped,
 *                                    the handler called; parsing waits
 *   cs_http_res_end                  inside the handler: parsing goes on at
 *                                    once; later: T_RESUME (0 ms) resumes it
 *                                    from the loop, so a handler is never
 *                                    called from inside another's call
 *   an error, or a response that     draining: timer T_LINGER
 *   must close the connection
 * Input is read into rbuf while it has room, also while a response is in
 * flight (so the peer's end of stream or a reset is seen); parsing stops at
 * each complete request. More than MAX_INFLIGHT writes queued also pauses
 * parsing until half of them are done (a pipelining client that does not
 * read cannot make us queue without bound).
 *
 * Closing after a response is graceful: the write side is shut down once the
 * queued writes are out, and the socket closes at the peer's end of stream
 * (or a short linger), so a client that is still sending is not answered
 * with a reset that could destroy the response it has not read yet. */
#include "chunkserve/http.h"

#include <errno.h>
#include <http_parser.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "http-impl.h"

#define MAX_CONNS 1024   /* beyond: the oldest connection not being answered is closed */
#define MAX_PER_ADDR 256 /* from one peer address, the same */
#define MAX_INFLIGHT 16  /* writes queued per connection before parsing pauses */
#define LINGER_MS 5000   /* after our last response, how long we wait for the peer's close */
#define READ_BUF 16384   /* unparsed input buffered per connection */
#define PEER_MAX 64      /* "[ipv6]:port" */
#define TLS_OUT_CAP                                                                                \
    (256 * 1024)              /* TLS: bytes queued on the socket beyond which nothing more         \
                                 is read or decrypted (the TLS layer answers some records          \
                                 itself: a client that does not read must not make it              \
                                 queue without bound) */
#define TLS_PIECE (16 * 1024) /* plaintext per SSL_write: one record, a small write BIO */

enum conn_state { CONN_OPEN, CONN_DRAINING, CONN_CLOSING };
/* What the connection's one timer is doing (the phases are exclusive). */
enum conn_timer { T_NONE, T_IDLE, T_REQUEST, T_RESUME, T_LINGER };
/* Why the parser paused. */
enum parse_event { EV_NONE, EV_HEADERS, EV_MESSAGE };
/* The request piece the parser delivered last. */
enum piece { P_NONE, P_URL, P_FIELD, P_VALUE };

typedef struct conn conn;

typedef struct {
    size_t name, value; /* offsets of NUL-terminated strings in the request buffer */
} hdr;

struct cs_http_req {
    unsigned method;
    char *buf; /* url \0 headers (name \0 value \0)... body \0 path \0 query \0; owned */
    hdr *hdrs; /* owned */
    size_t n_hdrs;
    const char *path, *query, *body; /* into buf */
    size_t body_len;
    char peer[PEER_MAX];
};

enum res_state { RES_NEW, RES_STREAM, RES_SENT };

struct cs_http_res {
    conn *c; /* NULL once the connection's handles are closed */
    cs_http_req req;
    enum res_state state;
    bool head_only;  /* a HEAD request: headers only */
    bool http10;     /* an HTTP/1.0 client */
    bool keep_alive; /* false: the connection closes after this response */
    bool chunked;    /* a streamed response in chunks */
    bool internal;   /* the server's own error response, not the handler's */
    bool closed;     /* the connection is gone */
    bool close_fired;
    void (*on_close)(void *arg);
    void *on_close_arg;
};

struct conn {
    cs_http_server *server;
    conn *prev, *next; /* the server's list */
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_shutdown_t shutdown;
    http_parser parser;
    enum conn_state state;
    enum conn_timer timer_kind;
    int open_handles; /* tcp + timer; the conn is freed when this reaches 0 */
    int n_writes;     /* uv_write requests not yet called back */
    bool reading, peer_eof, shutdown_done;
    bool processing;    /* inside conn_process */
    bool in_handler;    /* inside the handler call */
    bool write_blocked; /* parsing paused until half the writes are done */
    cs_http_res *res;   /* the response in flight, or NULL */
    /* The request being parsed. */
    bool in_message, headers_done;
    enum parse_event event;
    enum piece last;
    int err_status; /* set by a parser callback that failed */
    const char *err_msg;
    size_t head_bytes; /* consumed since the last request, until its headers are complete */
    size_t body_max;
    size_t body_len, trailer_bytes;
    size_t url_len, body_off;
    char *buf; /* the request's pieces (cs_http_req.buf) */
    size_t len, cap;
    hdr *hdrs;
    size_t n_hdrs, cap_hdrs;
    char peer[PEER_MAX];
    char ip[PEER_MAX]; /* the peer's address without its port (the per-address cap) */
    SSL *ssl;          /* TLS (http_tls.c); NULL: plaintext */
    /* Input not parsed yet, rbuf[roff..rlen) (plaintext). */
    size_t roff, rlen;
    char rbuf[READ_BUF];
};

struct cs_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    cs_http_opts o; /* defaults filled in */
    int port;
    bool closing, listener_closed;
    conn *conns;
    size_t n_conns;
    uint64_t n_evicted; /* connections closed to make room (make_room) */
    void (*on_free)(void *);
    void *on_free_arg;
    cs__http_tls *tls;  /* NULL: plaintext */
    char tls_in[65536]; /* ciphertext as read, fed to the connection's SSL at once */
};

typedef struct {
    uv_write_t req;
    conn *c;
    char data[];
} wreq;

static void conn_process(conn *c);
static void conn_error(conn *c, int status, const char *msg);
static void conn_eof(conn *c);
static int conn_tls_flush(conn *c);
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);

/* ------------------------------------------------------------ lifetime -- */

static void maybe_free_server(cs_http_server *s) {
    if (!(s->closing && s->listener_closed && s->n_conns == 0)) return;
    if (s->on_free) s->on_free(s->on_free_arg);
    cs__http_tls_free(s->tls);
    free(s);
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
    cs_http_res *res = c->res;
    cs__http_tls_conn_free(c->ssl);
    free(c->buf);
    free(c->hdrs);
    free(c);
    /* The response in flight outlives its connection; its owner hears of it
     * here, from the loop, with nothing of ours on the stack. */
    if (res) {
        res->c = NULL;
        res->closed = true;
        if (res->on_close && !res->close_fired) {
            res->close_fired = true;
            res->on_close(res->on_close_arg);
        }
    }
    maybe_free_server(s);
}

/* Closes both handles now (pending writes are cancelled); freed in on_conn_close. */
static void conn_close(conn *c) {
    if (c->state == CONN_CLOSING) return;
    c->state = CONN_CLOSING;
    if (c->res) c->res->closed = true;
    uv_close((uv_handle_t *)&c->tcp, on_conn_close);
    uv_close((uv_handle_t *)&c->timer, on_conn_close);
}

static void on_timer(uv_timer_t *t);

static void conn_timer(conn *c, enum conn_timer kind) {
    if (c->state == CONN_CLOSING) return;
    const cs_http_opts *o = &c->server->o;
    c->timer_kind = kind;
    switch (kind) {
    case T_NONE: uv_timer_stop(&c->timer); break;
    case T_IDLE: uv_timer_start(&c->timer, on_timer, o->idle_ms, 0); break;
    case T_REQUEST: uv_timer_start(&c->timer, on_timer, o->request_ms, 0); break;
    case T_RESUME: uv_timer_start(&c->timer, on_timer, 0, 0); break;
    case T_LINGER:
        uv_timer_start(&c->timer, on_timer, o->idle_ms < LINGER_MS ? o->idle_ms : LINGER_MS, 0);
        break;
    }
}

static void on_timer(uv_timer_t *t) {
    conn *c = t->data;
    enum conn_timer kind = c->timer_kind;
    c->timer_kind = T_NONE;
    switch (kind) {
    case T_IDLE:
        CS_LOGD("http: closing an idle connection from %s", c->peer);
        conn_close(c);
        break;
    case T_REQUEST:
        CS_LOGD("http: %s took too long to send its request", c->peer);
        conn_error(c, 408, "request timeout");
        break;
    case T_RESUME: conn_process(c); break;
    case T_LINGER:
    case T_NONE: conn_close(c); break;
    }
}

/* Reads while there is room for input (and always while draining, to drop
 * it), until the peer's end of stream. */
static void conn_update_reading(conn *c) {
    bool want;
    if (c->state == CONN_CLOSING || c->peer_eof)
        want = false;
    else if (c->state == CONN_DRAINING)
        want = true;
    else
        want = c->rlen - c->roff < READ_BUF &&
               (!c->ssl || (cs__http_tls_buffered_in(c->ssl) < READ_BUF &&
                            c->tcp.write_queue_size < TLS_OUT_CAP));
    if (want && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
            conn_close(c);
            return;
        }
        c->reading = true;
    } else if (!want && c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    conn *c = h->data;
    (void)suggested;
    if (c->state != CONN_OPEN) c->roff = c->rlen = 0; /* draining: input is dropped */
    if (c->ssl) { /* ciphertext, into the SSL at once (on_read) */
        *buf = uv_buf_init(c->server->tls_in, sizeof c->server->tls_in);
        return;
    }
    if (c->roff > 0) {
        memmove(c->rbuf, c->rbuf + c->roff, c->rlen - c->roff);
        c->rlen -= c->roff;
        c->roff = 0;
    }
    CS_ASSERT(c->rlen < sizeof c->rbuf); /* reading runs only while there is room */
    *buf = uv_buf_init(c->rbuf + c->rlen, (unsigned)(sizeof c->rbuf - c->rlen));
}

static void on_shutdown(uv_shutdown_t *req, int status) {
    conn *c = req->data;
    if (c->state == CONN_CLOSING) return; /* cancelled by conn_close */
    c->shutdown_done = true;
    if (status < 0 || c->peer_eof) conn_close(c);
}

/* Stops answering: the queued writes go out, then our end of stream; input
 * is read and dropped until the peer's end of stream or the linger. */
static void conn_drain(conn *c) {
    if (c->state != CONN_OPEN) return;
    CS_ASSERT(!c->res);
    c->state = CONN_DRAINING;
    c->roff = c->rlen = 0;
    conn_update_reading(c);
    if (c->state == CONN_CLOSING) return;
    if (c->ssl) {
        cs__http_tls_close_notify(c->ssl);
        if (conn_tls_flush(c)) return;
    }
    c->shutdown.data = c;
    if (uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) != 0) {
        conn_close(c);
        return;
    }
    conn_timer(c, T_LINGER);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
    conn *c = st->data;
    if (c->state == CONN_CLOSING || nread == 0) return;
    if (nread > 0) {
        if (c->state != CONN_OPEN) return; /* draining: dropped */
        if (c->ssl) {
            if (cs__http_tls_feed(c->ssl, buf->base, (size_t)nread)) {
                conn_close(c);
                return;
            }
        } else {
            c->rlen += (size_t)nread;
        }
        conn_process(c); /* with TLS: decrypts what fits first */
        return;
    }
    if (nread != UV_EOF) {
        CS_LOGD("http: read error from %s: %s", c->peer, uv_strerror((int)nread));
        conn_close(c);
        return;
    }
    conn_eof(c);
}

/* The peer's end of stream: TCP's, or TLS's close_notify (then the socket
 * may stay open; nothing more is read from it either way). */
static void conn_eof(conn *c) {
    c->peer_eof = true;
    if (c->reading) uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = false;
    if (c->state == CONN_OPEN && c->res) {
        /* A client that stops sending while its answer is being made has
         * gone (Go's net/http and uvicorn read it so too): the handler hears
         * of it now, not when a write fails, which for an answer that takes
         * long to start may be much later. Half-closed clients are still
         * answered when the answer is given at once. */
        CS_LOGD("http: %s ended its stream with a response in flight", c->peer);
        conn_close(c);
    } else if (c->state == CONN_OPEN) {
        conn_process(c); /* answers what is buffered, then drains */
    } else if (c->shutdown_done) {
        conn_close(c);
    } /* else on_shutdown closes, now that peer_eof is set */
}

/* -------------------------------------------------------------- writes -- */

static void on_write(uv_write_t *req, int status) {
    wreq *w = (wreq *)req;
    conn *c = w->c;
    free(w);
    c->n_writes--;
    if (c->state == CONN_CLOSING) return;
    if (status < 0) {
        CS_LOGD("http: write error to %s: %s", c->peer, uv_strerror(status));
        conn_close(c);
        return;
    }
    if (c->state != CONN_OPEN) return;
    if (c->timer_kind == T_IDLE) conn_timer(c, T_IDLE); /* progress */
    if (c->write_blocked && c->n_writes <= MAX_INFLIGHT / 2) {
        c->write_blocked = false;
        conn_process(c);
    } else if (c->ssl && !c->reading) {
        conn_process(c); /* below TLS_OUT_CAP again: decrypt and read on */
    }
}

/* Hands w->data[0..len) to the socket; w is ours to free either way. */
static int conn_write_raw(conn *c, wreq *w, size_t len) {
    w->c = c;
    uv_buf_t b = uv_buf_init(w->data, (unsigned)len);
    int r = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
    if (r != 0) {
        free(w);
        CS_LOGD("http: write to %s failed: %s", c->peer, uv_strerror(r));
        conn_close(c);
        return CS_ECONNRESET;
    }
    c->n_writes++;
    return 0;
}

/* The ciphertext the SSL has made (records, handshake messages) to the
 * socket. 0, or the connection is closed. */
static int conn_tls_flush(conn *c) {
    size_t n;
    while ((n = cs__http_tls_take(c->ssl, NULL, 0)) > 0) {
        if (n > UINT_MAX / 2) n = UINT_MAX / 2;
        wreq *w = malloc(sizeof *w + n);
        if (!w) {
            CS_LOGW("http: out of memory for a write; closing the connection");
            conn_close(c);
            return CS_ENOMEM;
        }
        size_t got = cs__http_tls_take(c->ssl, w->data, n);
        int r = conn_write_raw(c, w, got);
        if (r) return r;
    }
    return 0;
}

/* Plaintext w->data[0..len) out (through TLS when on, a record at a time);
 * w is ours to free. */
static int conn_write(conn *c, wreq *w, size_t len) {
    if (!c->ssl) return conn_write_raw(c, w, len);
    int r = 0;
    for (size_t off = 0; !r && (off < len || len == 0); off += TLS_PIECE) {
        size_t n = len - off < TLS_PIECE ? len - off : TLS_PIECE;
        if (cs__http_tls_write(c->ssl, w->data + off, n)) {
            CS_LOGD("http: TLS write to %s failed", c->peer);
            conn_close(c);
            r = CS_ECONNRESET;
        } else {
            r = conn_tls_flush(c);
        }
        if (len == 0) break;
    }
    free(w);
    return r;
}

/* Decrypts what the SSL holds into rbuf while it has room, and sends the
 * handshake's answers. The peer's close_notify is its end of stream; a
 * failed handshake or a bad record closes the connection. */
static void conn_tls_pull(conn *c) {
    if (c->state != CONN_OPEN || c->peer_eof || c->tcp.write_queue_size >= TLS_OUT_CAP) return;
    if (c->roff > 0) {
        memmove(c->rbuf, c->rbuf + c->roff, c->rlen - c->roff);
        c->rlen -= c->roff;
        c->roff = 0;
    }
    int n = 0;
    while (c->rlen < sizeof c->rbuf &&
           (n = cs__http_tls_read(c->ssl, c->rbuf + c->rlen, sizeof c->rbuf - c->rlen, c->peer)) >
               0)
        c->rlen += (size_t)n;
    if (conn_tls_flush(c)) return;
    if (n == CS_EPROTO)
        conn_close(c);
    else if (n == CS_ECONNRESET)
        conn_eof(c);
}

static int conn_write_copy(conn *c, const char *data, size_t len) {
    wreq *w = malloc(sizeof *w + len);
    if (!w) {
        CS_LOGW("http: out of memory for a write; closing the connection");
        conn_close(c);
        return CS_ENOMEM;
    }
    memcpy(w->data, data, len);
    return conn_write(c, w, len);
}

/* ----------------------------------------------------------- responses -- */

static bool res_closed(const cs_http_res *res) {
    return res->closed || !res->c || res->c->state == CONN_CLOSING;
}

static const char *status_text(int status) {
    const char *t = http_status_str((enum http_status)status);
    return t && t[0] != '<' ? t : "Unknown";
}

/* Allocates a write holding the status line and headers, with room for
 * body_len more bytes after them; *head_len is the headers' length. */
static int res_head(cs_http_res *res, int status, const char *ctype, const char *framing,
                    const char *extra, size_t body_len, wreq **out, size_t *head_len) {
    const char *conn_hdr = !res->keep_alive ? "Connection: close\r\n"
                           : res->http10    ? "Connection: keep-alive\r\n"
                                            : "";
    const char *fmt = "HTTP/1.1 %d %s\r\n%s%s%s%s%s%s\r\n";
    const char *ct0 = ctype ? "Content-Type: " : "", *ct1 = ctype ? "\r\n" : "";
    if (!ctype) ctype = "";
    if (!extra) extra = "";
    int n = snprintf(NULL, 0, fmt, status, status_text(status), ct0, ctype, ct1, framing, extra,
                     conn_hdr);
    CS_ASSERT(n > 0);
    if (body_len > UINT_MAX - (size_t)n - 1) return CS_EINVAL; /* uv_buf_t's length is unsigned */
    wreq *w = malloc(sizeof *w + (size_t)n + 1 + body_len);
    if (!w) {
        CS_LOGW("http: out of memory for a response; closing the connection");
        conn_close(res->c);
        return CS_ENOMEM;
    }
    snprintf(w->data, (size_t)n + 1, fmt, status, status_text(status), ct0, ctype, ct1, framing,
             extra, conn_hdr);
    *out = w;
    *head_len = (size_t)n;
    return 0;
}

int cs_http_res_send(cs_http_res *res, int status, const char *content_type,
                     const char *extra_headers, const void *body, size_t len) {
    if (!res || status < 200 || status > 599 || (len && !body)) return CS_EINVAL;
    if (res_closed(res)) return CS_ECONNRESET;
    if (res->state != RES_NEW) return CS_EINVAL;
    bool no_body = status == 204 || status == 304;
    char framing[48] = "";
    if (!no_body) snprintf(framing, sizeof framing, "Content-Length: %zu\r\n", len);
    size_t blen = res->head_only || no_body ? 0 : len;
    wreq *w;
    size_t hlen;
    int r = res_head(res, status, content_type, framing, extra_headers, blen, &w, &hlen);
    if (r) return r;
    if (blen) memcpy(w->data + hlen, body, blen);
    res->state = RES_SENT;
    return conn_write(res->c, w, hlen + blen);
}

int cs_http_res_start(cs_http_res *res, int status, const char *content_type,
                      const char *extra_headers) {
    if (!res || status < 200 || status > 599 || status == 204 || status == 304) return CS_EINVAL;
    if (res_closed(res)) return CS_ECONNRESET;
    if (res->state != RES_NEW) return CS_EINVAL;
    /* HTTP/1.0 has no chunks: the end of the body is the end of the connection. */
    res->chunked = !res->http10;
    if (res->http10) res->keep_alive = false;
    wreq *w;
    size_t hlen;
    int r =
        res_head(res, status, content_type, res->chunked ? "Transfer-Encoding: chunked\r\n" : "",
                 extra_headers, 0, &w, &hlen);
    if (r) return r;
    res->state = RES_STREAM;
    return conn_write(res->c, w, hlen);
}

int cs_http_res_write(cs_http_res *res, const void *data, size_t len) {
    if (!res || (len && !data)) return CS_EINVAL;
    if (res_closed(res)) return CS_ECONNRESET;
    if (res->state != RES_STREAM) return CS_EINVAL;
    if (len == 0 || res->head_only) return 0;
    if (len > UINT_MAX - 32) return CS_EINVAL;
    if (!res->chunked) return conn_write_copy(res->c, data, len);
    wreq *w = malloc(sizeof *w + len + 32);
    if (!w) {
        CS_LOGW("http: out of memory for a write; closing the connection");
        conn_close(res->c);
        return CS_ENOMEM;
    }
    int n = snprintf(w->data, 24, "%zx\r\n", len);
    memcpy(w->data + n, data, len);
    memcpy(w->data + n + len, "\r\n", 2);
    return conn_write(res->c, w, (size_t)n + len + 2);
}

size_t cs_http_res_pending_bytes(const cs_http_res *res) {
    return !res || res_closed(res) ? 0 : res->c->tcp.write_queue_size;
}

void cs_http_res_on_close(cs_http_res *res, void (*fn)(void *arg), void *arg) {
    if (!res) return;
    if (res_closed(res)) {
        res->close_fired = true;
        if (fn) fn(arg);
        return;
    }
    res->on_close = fn;
    res->on_close_arg = arg;
}

bool cs_http_res_closed(const cs_http_res *res) {
    return !res || res_closed(res);
}

/* The server's own answer on res (the error hook's, else text/plain); the
 * connection closes after it. */
static void res_answer_error(cs_http_res *res, int status, const char *msg) {
    cs_http_server *s = res->c->server;
    res->keep_alive = false;
    if (s->o.error) s->o.error(s->o.arg, status, msg, res);
    if (res->state == RES_NEW) {
        char body[256];
        int n = snprintf(body, sizeof body, "%s\n", msg);
        if (n < 0 || (size_t)n >= sizeof body) n = (int)sizeof body - 1;
        cs_http_res_send(res, status, "text/plain; charset=utf-8", NULL, body, (size_t)n);
    } else if (res->state == RES_STREAM && res->chunked && !res->head_only && !res_closed(res)) {
        conn_write_copy(res->c, "0\r\n\r\n", 5);
    }
}

static void req_free(cs_http_req *req) {
    free(req->buf);
    free(req->hdrs);
}

void cs_http_res_end(cs_http_res *res) {
    if (!res) return;
    CS_ASSERT(!res->internal); /* the server ends its own error responses */
    conn *c = res->c;
    if (!res_closed(res)) {
        if (res->state == RES_NEW) {
            CS_LOGW("http: %s %s from %s ended without an answer", http_method_str(res->req.method),
                    res->req.path, res->req.peer);
            res_answer_error(res, 500, "internal server error");
        } else if (res->state == RES_STREAM && res->chunked && !res->head_only) {
            conn_write_copy(c, "0\r\n\r\n", 5);
        }
    }
    bool keep_alive = res->keep_alive;
    if (c && c->res == res) c->res = NULL;
    req_free(&res->req);
    free(res);
    if (!c || c->state != CONN_OPEN) return;
    if (!keep_alive)
        conn_drain(c);
    else if (!c->in_handler)
        conn_timer(c, T_RESUME); /* not from inside the caller's call chain */
    /* else conn_process, which called the handler, goes on */
}

/* ------------------------------------------------------------- parsing -- */

static int rq_reserve(conn *c, size_t add) {
    if (c->len + add + 1 <= c->cap) return 0;
    size_t cap = c->cap ? c->cap : 512;
    while (cap < c->len + add + 1)
        cap *= 2;
    char *b = realloc(c->buf, cap);
    if (!b) {
        c->err_status = 500;
        c->err_msg = "out of memory";
        return -1;
    }
    c->buf = b;
    c->cap = cap;
    return 0;
}

static int rq_append(conn *c, const char *at, size_t len) {
    if (rq_reserve(c, len)) return -1;
    memcpy(c->buf + c->len, at, len);
    c->len += len;
    return 0;
}

static int rq_nul(conn *c) {
    return rq_append(c, "", 1);
}

/* Terminates the piece the parser delivered last. */
static int rq_end_piece(conn *c) {
    switch (c->last) {
    case P_NONE:
    case P_URL: c->url_len = c->len; return rq_nul(c);
    case P_FIELD: /* a header without a value */
        if (rq_nul(c)) return -1;
        c->hdrs[c->n_hdrs - 1].value = c->len;
        return rq_nul(c);
    case P_VALUE:
        while (c->len > c->hdrs[c->n_hdrs - 1].value &&
               (c->buf[c->len - 1] == ' ' || c->buf[c->len - 1] == '\t'))
            c->len--;
        return rq_nul(c);
    }
    return 0;
}

static const char *hdr_find(const char *buf, const hdr *hdrs, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcasecmp(buf + hdrs[i].name, name)) return buf + hdrs[i].value;
    return NULL;
}

static int on_message_begin(http_parser *p) {
    conn *c = p->data;
    c->in_message = true;
    c->headers_done = false;
    c->last = P_NONE;
    c->len = c->n_hdrs = 0;
    c->body_len = c->trailer_bytes = 0;
    conn_timer(c, T_REQUEST); /* from the first byte of the request line */
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t len) {
    conn *c = p->data;
    c->last = P_URL;
    return rq_append(c, at, len);
}

/* Trailers of a chunked body are not kept; they count against the body limit. */
static int on_trailer(conn *c, size_t len) {
    c->trailer_bytes += len;
    if (c->body_len + c->trailer_bytes > c->body_max) {
        c->err_status = 413;
        c->err_msg = "request body too large";
        return -1;
    }
    return 0;
}

static int on_header_field(http_parser *p, const char *at, size_t len) {
    conn *c = p->data;
    if (c->headers_done) return on_trailer(c, len);
    if (c->last != P_FIELD) {
        if (rq_end_piece(c)) return -1;
        if (c->n_hdrs == c->cap_hdrs) {
            size_t cap = c->cap_hdrs ? 2 * c->cap_hdrs : 16;
            hdr *h = realloc(c->hdrs, cap * sizeof *h);
            if (!h) {
                c->err_status = 500;
                c->err_msg = "out of memory";
                return -1;
            }
            c->hdrs = h;
            c->cap_hdrs = cap;
        }
        c->hdrs[c->n_hdrs++] = (hdr){.name = c->len, .value = 0};
        c->last = P_FIELD;
    }
    return rq_append(c, at, len);
}

static int on_header_value(http_parser *p, const char *at, size_t len) {
    conn *c = p->data;
    if (c->headers_done) return on_trailer(c, len);
    if (c->last != P_VALUE) {
        if (rq_nul(c)) return -1;
        c->hdrs[c->n_hdrs - 1].value = c->len;
        c->last = P_VALUE;
    }
    return rq_append(c, at, len);
}

static int on_headers_complete(http_parser *p) {
    conn *c = p->data;
    if (rq_end_piece(c)) return -1;
    c->body_off = c->len;
    c->headers_done = true;
    c->event = EV_HEADERS; /* conn_process checks the limits before the body is read */
    http_parser_pause(p, 1);
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len) {
    conn *c = p->data;
    if (c->body_len + len > c->body_max) {
        c->err_status = 413;
        c->err_msg = "request body too large";
        return -1;
    }
    c->body_len += len;
    return rq_append(c, at, len);
}

static int on_message_complete(http_parser *p) {
    conn *c = p->data;
    if (rq_nul(c)) return -1;
    c->event = EV_MESSAGE; /* one request at a time: execute returns here */
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings parser_settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

/* The server's own error response; the connection closes after it. */
static void conn_error(conn *c, int status, const char *msg) {
    if (c->state != CONN_OPEN) return;
    CS_ASSERT(!c->res);
    CS_LOGD("http: %d for %s: %s", status, c->peer, msg);
    cs_http_res *res = calloc(1, sizeof *res);
    if (!res) {
        conn_close(c);
        return;
    }
    res->c = c;
    res->internal = true;
    res->req.method = HTTP_GET;
    res_answer_error(res, status, msg);
    free(res);
    conn_drain(c);
}

/* The request's headers are complete: its limits, and 100 Continue. */
static void conn_headers_done(conn *c) {
    const cs_http_opts *o = &c->server->o;
    http_parser *p = &c->parser;
    c->head_bytes++; /* the final LF, consumed when parsing resumes */
    if (c->head_bytes > o->max_header_bytes) {
        conn_error(c, 431, "request header fields too large");
        return;
    }
    if (o->max_body_bytes)
        c->body_max = o->max_body_bytes;
    else
        c->body_max = c->head_bytes < CS_HTTP_MAX_REQUEST ? CS_HTTP_MAX_REQUEST - c->head_bytes : 0;
    bool chunked = p->flags & F_CHUNKED;
    bool has_length = !chunked && p->content_length != ULLONG_MAX;
    if (has_length && p->content_length > c->body_max) {
        conn_error(c, 413, "request body too large"); /* without reading it */
        return;
    }
    bool has_body = chunked || (has_length && p->content_length > 0);
    bool http11 = p->http_major > 1 || (p->http_major == 1 && p->http_minor >= 1);
    const char *expect = hdr_find(c->buf, c->hdrs, c->n_hdrs, "Expect");
    if (has_body && http11 && expect && !strcasecmp(expect, "100-continue")) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        conn_write_copy(c, cont, sizeof cont - 1);
    }
}

/* The request is complete: it becomes a cs_http_req and goes to the handler. */
static void conn_dispatch(conn *c) {
    cs_http_server *s = c->server;
    http_parser *p = &c->parser;
    c->in_message = c->headers_done = false;
    c->head_bytes = 0;
    size_t body_off = c->body_off, body_len = c->body_len;
    /* The path and query of an origin-form or absolute-form target. */
    struct http_parser_url u;
    http_parser_url_init(&u);
    size_t path_off = 0, path_len = 0, query_off = 0, query_len = 0;
    if (http_parser_parse_url(c->buf, c->url_len, p->method == HTTP_CONNECT, &u) == 0) {
        if (u.field_set & (1 << UF_PATH)) {
            path_off = u.field_data[UF_PATH].off;
            path_len = u.field_data[UF_PATH].len;
        }
        if (u.field_set & (1 << UF_QUERY)) {
            query_off = u.field_data[UF_QUERY].off;
            query_len = u.field_data[UF_QUERY].len;
        }
    }
    size_t path_at = c->len;
    size_t query_at = path_at + path_len + 1;
    cs_http_res *res = calloc(1, sizeof *res);
    if (!res || rq_reserve(c, path_len + query_len + 2)) {
        free(res);
        CS_LOGW("http: out of memory for a request; closing the connection");
        conn_close(c);
        return;
    }
    memcpy(c->buf + path_at, c->buf + path_off, path_len);
    c->buf[path_at + path_len] = 0;
    memcpy(c->buf + query_at, c->buf + query_off, query_len);
    c->buf[query_at + query_len] = 0;
    c->len = query_at + query_len + 1;

    cs_http_req *req = &res->req;
    req->method = p->method;
    req->buf = c->buf;
    req->hdrs = c->hdrs;
    req->n_hdrs = c->n_hdrs;
    req->path = c->buf + path_at;
    req->query = c->buf + query_at;
    req->body = c->buf + body_off;
    req->body_len = body_len;
    memcpy(req->peer, c->peer, sizeof req->peer);
    c->buf = NULL;
    c->hdrs = NULL;
    c->len = c->cap = c->n_hdrs = c->cap_hdrs = 0;

    res->c = c;
    res->head_only = p->method == HTTP_HEAD;
    res->http10 = p->http_major == 1 && p->http_minor == 0;
    res->keep_alive = http_should_keep_alive(p) && !p->upgrade;
    c->res = res;
    conn_timer(c, T_NONE);
    c->in_handler = true;
    s->o.handler(s->o.arg, req, res);
    c->in_handler = false;
}

/* Parses what rbuf holds and hands each complete request to the handler, one
 * at a time; stops while a response is in flight or too many writes are
 * queued. Then sets the idle timer and reading as the state wants. */
static void conn_process(conn *c) {
    if (c->processing) return;
    c->processing = true;
    const cs_http_opts *o = &c->server->o;
    for (;;) {
        if (c->ssl) conn_tls_pull(c);
        if (!(c->state == CONN_OPEN && !c->res && !c->write_blocked && c->roff < c->rlen)) break;
        if (c->n_writes >= MAX_INFLIGHT) {
            c->write_blocked = true;
            break;
        }
        size_t n = c->rlen - c->roff;
        bool in_head = !c->headers_done; /* the callbacks change it */
        size_t done = http_parser_execute(&c->parser, &parser_settings, c->rbuf + c->roff, n);
        c->roff += done;
        if (in_head) c->head_bytes += done;
        enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
        if (e == HPE_PAUSED) {
            http_parser_pause(&c->parser, 0);
            enum parse_event ev = c->event;
            c->event = EV_NONE;
            if (ev == EV_HEADERS)
                conn_headers_done(c);
            else
                conn_dispatch(c);
        } else if (c->err_status) {
            conn_error(c, c->err_status, c->err_msg);
        } else if (e == HPE_HEADER_OVERFLOW ||
                   (e == HPE_OK && !c->headers_done && c->head_bytes > o->max_header_bytes)) {
            conn_error(c, 431, "request header fields too large");
        } else if (e != HPE_OK || done < n) {
            char msg[128];
            snprintf(msg, sizeof msg, "bad request: %s", http_errno_description(e));
            conn_error(c, 400, msg);
        }
    }
    c->processing = false;
    if (c->state != CONN_OPEN) return;
    if (!c->res && !c->write_blocked && c->roff == c->rlen && c->peer_eof) {
        conn_drain(c); /* answers already queued still go out */
        return;
    }
    if (!c->res && !c->in_message && c->timer_kind != T_IDLE) conn_timer(c, T_IDLE);
    conn_update_reading(c);
}

/* -------------------------------------------------------------- server -- */

static void conn_peer_name(conn *c) {
    struct sockaddr_storage ss;
    int len = sizeof ss;
    char ip[64] = "?";
    int port = 0;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) == 0) {
        if (ss.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
            snprintf(c->peer, sizeof c->peer, "[%s]:%d", ip, port);
            snprintf(c->ip, sizeof c->ip, "%s", ip);
            return;
        }
        uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    }
    snprintf(c->peer, sizeof c->peer, "%s:%d", ip, port);
    snprintf(c->ip, sizeof c->ip, "%s", ip);
}

/* A newcomer c is in: when its address holds MAX_PER_ADDR connections or
 * the server MAX_CONNS, the oldest one with no response in flight (idle,
 * or a request still arriving: slowloris) goes, so a flood of slow sockets
 * delays a probe by nothing and never locks /healthz out. */
static void make_room(cs_http_server *s, conn *c) {
    size_t mine = 0;
    conn *old_mine = NULL, *old_any = NULL; /* the list is newest first */
    for (conn *o = s->conns; o; o = o->next) {
        if (o == c || o->state == CONN_CLOSING) continue;
        bool same = !strcmp(o->ip, c->ip);
        mine += same;
        if (o->res) continue;
        old_any = o;
        if (same) old_mine = o;
    }
    conn *evict = mine >= MAX_PER_ADDR ? old_mine : s->n_conns > MAX_CONNS ? old_any : NULL;
    if (evict) {
        s->n_evicted++;
        conn_close(evict);
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
    if (r == 0 && s->tls && !(c->ssl = cs__http_tls_accept(s->tls))) r = UV_ENOMEM;
    if (r == 0) {
        conn_peer_name(c);
        make_room(s, c);
    }
    if (r == 0 && s->n_conns > MAX_CONNS + MAX_CONNS / 4) { /* every one is answering */
        CS_LOGW("http: %zu connections open; refusing another", s->n_conns);
        r = UV_EMFILE;
    }
    if (r == 0) r = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (r != 0) {
        conn_close(c);
        return;
    }
    c->reading = true;
    uv_tcp_nodelay(&c->tcp, 1);
    conn_timer(c, T_IDLE);
}

/* libuv writes to sockets with write(2): a peer that is gone would kill the
 * process with SIGPIPE instead of failing the write with EPIPE. A process
 * that chose its own handling keeps it. */
static void ignore_sigpipe(void) {
    struct sigaction sa;
    if (sigaction(SIGPIPE, NULL, &sa) == 0 && !(sa.sa_flags & SA_SIGINFO) &&
        sa.sa_handler == SIG_DFL)
        signal(SIGPIPE, SIG_IGN);
}

int cs_http_server_start(struct uv_loop_s *loop, const char *host, int port,
                         const cs_http_opts *opts, cs_http_server **out) {
    if (!out) return cs_fail(CS_EINVAL, "http: no place for the server");
    *out = NULL;
    if (!loop || !host || !opts || !opts->handler)
        return cs_fail(CS_EINVAL, "http: loop, host, options and a handler are required");
    if (port < 0 || port > 65535)
        return cs_fail(CS_EINVAL, "http: port %d is not in 0..65535", port);
    ignore_sigpipe();
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
    s->o = *opts;
    s->o.tls = NULL; /* the files are read here, not kept */
    int tr = cs__http_tls_init(opts->tls, &s->tls);
    if (tr) {
        close(fd);
        free(s);
        return tr;
    }
    if (!s->o.max_header_bytes) s->o.max_header_bytes = CS_HTTP_MAX_REQUEST;
    if (!s->o.idle_ms) s->o.idle_ms = CS_HTTP_IDLE_MS;
    if (!s->o.request_ms) s->o.request_ms = CS_HTTP_REQUEST_MS;
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
    s->o.idle_ms = ms ? ms : CS_HTTP_IDLE_MS;
}

void cs__http_server_on_free(cs_http_server *s, void (*fn)(void *), void *arg) {
    s->on_free = fn;
    s->on_free_arg = arg;
}

/* ------------------------------------------------------------- request -- */

unsigned cs_http_req_method(const cs_http_req *r) {
    return r->method;
}

const char *cs_http_req_method_name(const cs_http_req *r) {
    return http_method_str((enum http_method)r->method);
}

const char *cs_http_req_path(const cs_http_req *r) {
    return r->path ? r->path : "";
}

const char *cs_http_req_query(const cs_http_req *r) {
    return r->query ? r->query : "";
}

const char *cs_http_req_header(const cs_http_req *r, const char *name) {
    return r->buf && name ? hdr_find(r->buf, r->hdrs, r->n_hdrs, name) : NULL;
}

const char *cs_http_req_body(const cs_http_req *r, size_t *len) {
    if (len) *len = r->body ? r->body_len : 0;
    return r->body ? r->body : "";
}

const char *cs_http_req_peer(const cs_http_req *r) {
    return r->peer;
}
