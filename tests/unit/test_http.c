/* test_http.c: the HTTP server (proc/src/http.c) on a real libuv loop (its
 * own thread) on 127.0.0.1, port 0, driven by real blocking client sockets.
 * First the operator routes (cs_http_ops_start, ops_http.c): /metrics,
 * /healthz, /readyz, 404, 405, HEAD, keep-alive, pipelining (beyond the
 * per-connection queue limit), Connection: close, HTTP/1.0, half-close,
 * oversized and malformed requests (400 and close), the idle timeout, and
 * closing the server with connections open. Then the handler interface
 * (cs_http_server_start) with a test handler and a JSON error hook: bodies
 * (Content-Length, chunked, Expect: 100-continue), 413, 431, 400, the 408 of
 * a slowloris client, async and streamed (chunked, HTTP/1.0) responses from
 * timers with pipelined requests behind them, a client gone mid-stream or
 * before its answer started, pending bytes of a client that does not read,
 * and closing the server with responses in flight. After each server the
 * loop must end with nothing left (leaks: run under ASan by make test). */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/http.h"
#include "chunkserve/metrics.h"
#include "http-impl.h"
#include "test.h"

#define IDLE_MS 1500

/* What the routes answer; the test thread changes it, the loop reads it. */
static atomic_bool healthy_flag = true, ready_flag = true;
static atomic_int n_before_metrics;
static cs_metric *scrapes;

static void before_metrics(void *arg) {
    atomic_fetch_add(&n_before_metrics, 1);
    cs_metric_inc(scrapes);
}
static bool healthy(void *arg) {
    return atomic_load(&healthy_flag);
}
static bool ready(void *arg, char *why, size_t why_len) {
    if (atomic_load(&ready_flag)) return true;
    snprintf(why, why_len, "loading model");
    return false;
}

typedef struct {
    uv_loop_t loop;
    uv_async_t stop;
    cs_http_server *server;
    pthread_t thread;
} fixture;

static void *loop_main(void *arg) {
    fixture *f = arg;
    uv_run(&f->loop, UV_RUN_DEFAULT);
    return NULL;
}

static void on_stop(uv_async_t *a) {
    fixture *f = a->data;
    cs_http_server_close(f->server);
    uv_close((uv_handle_t *)a, NULL);
}

/* ---- a blocking client ---- */

typedef struct {
    int fd;
    size_t len;
    char buf[1 << 18];
} client;

typedef struct {
    int status;
    char head[4096];
    size_t body_len;
    char body[1 << 18];
} response;

static client *client_open(int port) {
    client *c = calloc(1, sizeof *c);
    ASSERT_TRUE(c != NULL);
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_TRUE(c->fd >= 0);
    struct timeval tv = {10, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ_INT(connect(c->fd, (struct sockaddr *)&a, sizeof a), 0);
    return c;
}

static void client_close(client *c) {
    close(c->fd);
    free(c);
}

static void client_send(client *c, const char *data, size_t len) {
    while (len) {
        ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL);
        ASSERT_TRUE(n > 0);
        data += n;
        len -= (size_t)n;
    }
}

static void client_sends(client *c, const char *s) {
    client_send(c, s, strlen(s));
}

/* Reads more into c->buf; returns what recv returned. */
static ssize_t client_fill(client *c) {
    ASSERT_TRUE(c->len < sizeof c->buf);
    ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
    if (n > 0) c->len += (size_t)n;
    return n;
}

/* Reads one response (a response to HEAD has no body). */
static void read_response(client *c, response *r, bool head) {
    char *end;
    while (!(c->len && (end = memmem(c->buf, c->len, "\r\n\r\n", 4)))) {
        ssize_t n = client_fill(c);
        if (n <= 0) {
            fprintf(stderr, "read_response: recv returned %zd (%s) after %zu bytes\n", n,
                    strerror(errno), c->len);
            exit(1);
        }
    }
    size_t hlen = (size_t)(end - c->buf) + 4;
    ASSERT_TRUE(hlen < sizeof r->head);
    memcpy(r->head, c->buf, hlen);
    r->head[hlen] = 0;
    ASSERT_TRUE(sscanf(r->head, "HTTP/1.1 %d ", &r->status) == 1);
    const char *cl = strstr(r->head, "\r\nContent-Length: ");
    ASSERT_TRUE(cl != NULL);
    size_t len = strtoul(cl + 18, NULL, 10);
    r->body_len = head ? 0 : len;
    ASSERT_TRUE(r->body_len < sizeof r->body);
    while (c->len < hlen + r->body_len)
        ASSERT_TRUE(client_fill(c) > 0);
    memcpy(r->body, c->buf + hlen, r->body_len);
    r->body[r->body_len] = 0;
    memmove(c->buf, c->buf + hlen + r->body_len, c->len - hlen - r->body_len);
    c->len -= hlen + r->body_len;
}

/* The server has closed its side: nothing more, then end of stream. */
static void expect_eof(client *c) {
    ASSERT_EQ_INT(c->len, 0);
    ssize_t n = client_fill(c);
    if (n != 0)
        fprintf(stderr, "expect_eof: recv returned %zd (%s)\n", n,
                n < 0 ? strerror(errno) : "data");
    ASSERT_EQ_INT(n, 0);
}

/* One request on a fresh connection; returns the response (static). */
static response *fetch(int port, const char *request, bool head) {
    static response r;
    client *c = client_open(port);
    client_sends(c, request);
    read_response(c, &r, head);
    client_close(c);
    return &r;
}

#define HAS(r, s) ASSERT_MSG_HAS((r)->head, s)
#define LACKS(r, s) ASSERT_TRUE(strstr((r)->head, s) == NULL)

static void test_routes(int port, cs_metrics *m) {
    response *r = fetch(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 200);
    HAS(r, "HTTP/1.1 200 OK\r\n");
    HAS(r, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n");
    LACKS(r, "Connection:");
    ASSERT_EQ_INT(atomic_load(&n_before_metrics), 1);
    /* The body is the registry's rendering, after before_metrics ran. */
    char *text = NULL;
    size_t len = 0;
    ASSERT_EQ_INT(cs_metrics_render(m, &text, &len), 0);
    ASSERT_EQ_INT(r->body_len, len);
    ASSERT_EQ_STR(r->body, text);
    ASSERT_MSG_HAS(r->body, "test_scrapes_total 1\n");
    ASSERT_TRUE(len > 20000); /* big enough to take several writes */
    free(text);

    r = fetch(port, "GET /metrics?name[]=x HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 200);
    r = fetch(port, "GET http://example:9/metrics HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 200);

    r = fetch(port, "GET /healthz HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 200);
    ASSERT_EQ_STR(r->body, "ok\n");
    HAS(r, "\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 3\r\n");
    atomic_store(&healthy_flag, false);
    r = fetch(port, "GET /healthz HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 503);
    HAS(r, "HTTP/1.1 503 Service Unavailable\r\n");
    atomic_store(&healthy_flag, true);

    r = fetch(port, "GET /readyz HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 200);
    ASSERT_EQ_STR(r->body, "ready\n");
    atomic_store(&ready_flag, false);
    r = fetch(port, "GET /readyz HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 503);
    ASSERT_EQ_STR(r->body, "not ready: loading model\n");
    atomic_store(&ready_flag, true);

    r = fetch(port, "GET /nope HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 404);
    HAS(r, "HTTP/1.1 404 Not Found\r\n");
    r = fetch(port, "GET /metricsx HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 404);
    r = fetch(port, "DELETE /nope HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 404);

    r = fetch(port, "POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", false);
    ASSERT_EQ_INT(r->status, 405);
    HAS(r, "HTTP/1.1 405 Method Not Allowed\r\n");
    HAS(r, "\r\nAllow: GET, HEAD\r\n");
    r = fetch(port, "PUT /healthz HTTP/1.1\r\n\r\n", false);
    ASSERT_EQ_INT(r->status, 405);
}

static void test_head(int port) {
    /* HEAD: GET's headers and length, no body; the next response follows at once. */
    client *c = client_open(port);
    static response r, r2;
    client_sends(c, "HEAD /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n");
    read_response(c, &r, true);
    ASSERT_EQ_INT(r.status, 200);
    HAS(&r, "\r\nContent-Length: 3\r\n");
    read_response(c, &r2, false);
    ASSERT_EQ_STR(r2.body, "ok\n");
    client_sends(c, "HEAD /metrics HTTP/1.1\r\n\r\nHEAD /readyz HTTP/1.1\r\n\r\n");
    read_response(c, &r, true);
    ASSERT_EQ_INT(r.status, 200);
    HAS(&r, "version=0.0.4");
    read_response(c, &r2, true);
    ASSERT_EQ_INT(r2.status, 200);
    HAS(&r2, "\r\nContent-Length: 6\r\n");
    ASSERT_EQ_INT(c->len, 0);
    client_close(c);
}

static void test_keep_alive(int port) {
    client *c = client_open(port);
    static response r;
    client_sends(c, "GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    /* A body of a request is skipped; the connection stays usable. */
    client_sends(c, "POST /nope HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 404);
    client_sends(c, "GET /readyz HTTP/1.1\r\nHost: a\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "ready\n");
    /* Connection: close is honoured and said back. */
    client_sends(c, "GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    HAS(&r, "\r\nConnection: close\r\n");
    expect_eof(c);
    client_close(c);

    /* HTTP/1.0: closes unless keep-alive is asked for. */
    c = client_open(port);
    client_sends(c, "GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    read_response(c, &r, false);
    HAS(&r, "\r\nConnection: keep-alive\r\n");
    client_sends(c, "GET /healthz HTTP/1.0\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    HAS(&r, "\r\nConnection: close\r\n");
    expect_eof(c);
    client_close(c);

    /* Half-close after the request: the answer still comes, then the end. */
    c = client_open(port);
    client_sends(c, "GET /readyz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n");
    shutdown(c->fd, SHUT_WR);
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "ready\n");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "ok\n");
    expect_eof(c);
    client_close(c);
}

static void test_pipelining(int port) {
    /* Many requests in one write, more than the server queues per connection:
     * every answer, in order. */
    enum { N = 100 };
    static const char *const reqs[] = {"GET /healthz HTTP/1.1\r\n\r\n",
                                       "GET /readyz HTTP/1.1\r\n\r\n", "GET /nope HTTP/1.1\r\n\r\n",
                                       "GET /metrics HTTP/1.1\r\n\r\n"};
    static const int want[] = {200, 200, 404, 200};
    static const char *const bodies[] = {"ok\n", "ready\n", "not found\n", NULL};
    static char all[N * 40];
    size_t len = 0;
    for (int i = 0; i < N; i++)
        len += (size_t)sprintf(all + len, "%s", reqs[i % 4]);
    client *c = client_open(port);
    client_send(c, all, len);
    static response r;
    for (int i = 0; i < N; i++) {
        read_response(c, &r, false);
        ASSERT_EQ_INT(r.status, want[i % 4]);
        if (bodies[i % 4])
            ASSERT_EQ_STR(r.body, bodies[i % 4]);
        else
            ASSERT_MSG_HAS(r.body, "# TYPE test_scrapes_total counter\n");
    }
    /* Split across writes, a byte at a time, too. */
    const char *req = "GET /readyz HTTP/1.1\r\nHost: a\r\n\r\n";
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (const char *p = req; *p; p++)
        client_send(c, p, 1);
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "ready\n");
    /* A request after Connection: close in the same write is not answered. */
    client_sends(c,
                 "GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\nGET /readyz HTTP/1.1\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "ok\n");
    expect_eof(c);
    client_close(c);
}

static void test_bad_requests(int port) {
    static response r;
    /* Over 16 KiB of headers: 400, then the server closes. */
    static char big[24 * 1024];
    size_t len = (size_t)sprintf(big, "GET /healthz HTTP/1.1\r\nX-Big: ");
    memset(big + len, 'a', 20 * 1024);
    len += 20 * 1024;
    len += (size_t)sprintf(big + len, "\r\n\r\n");
    client *c = client_open(port);
    client_send(c, big, len);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 400);
    HAS(&r, "\r\nConnection: close\r\n");
    ASSERT_EQ_STR(r.body, "request too large\n");
    expect_eof(c);
    client_close(c);

    /* A body that takes the request over 16 KiB, sent before reading. */
    c = client_open(port);
    len = (size_t)sprintf(big, "POST /nope HTTP/1.1\r\nContent-Length: %d\r\n\r\n", 20 * 1024);
    memset(big + len, 'b', 20 * 1024);
    client_send(c, big, len + 20 * 1024);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 400);
    expect_eof(c);
    client_close(c);

    /* Just under the limit is fine. */
    c = client_open(port);
    len = (size_t)sprintf(big, "GET /healthz HTTP/1.1\r\nX-Big: ");
    memset(big + len, 'a', 15 * 1024);
    len += 15 * 1024;
    len += (size_t)sprintf(big + len, "\r\n\r\n");
    client_send(c, big, len);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    client_close(c);

    static const char *const malformed[] = {
        "GARBAGE\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nContent-Length: x\r\n\r\n",
        "GET /healthz HTTP/9\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; i++) {
        c = client_open(port);
        /* A good request first: its answer comes, then the 400. */
        client_sends(c, "GET /healthz HTTP/1.1\r\n\r\n");
        client_sends(c, malformed[i]);
        read_response(c, &r, false);
        ASSERT_EQ_INT(r.status, 200);
        read_response(c, &r, false);
        if (r.status != 400) fprintf(stderr, "malformed request %zu answered %d\n", i, r.status);
        ASSERT_EQ_INT(r.status, 400);
        ASSERT_EQ_STR(r.body, "bad request\n");
        HAS(&r, "\r\nConnection: close\r\n");
        expect_eof(c);
        client_close(c);
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_idle(int port) {
    client *c = client_open(port);
    static response r;
    client_sends(c, "GET /healthz HTTP/1.1\r\n\r\n");
    read_response(c, &r, false);
    double t0 = now_s();
    expect_eof(c); /* nothing more sent: closed after the idle time */
    double dt = now_s() - t0;
    if (dt < IDLE_MS * 0.9e-3 || dt > IDLE_MS * 3e-3)
        fprintf(stderr, "idle close after %.3f s\n", dt);
    ASSERT_TRUE(dt >= IDLE_MS * 0.9e-3 && dt < IDLE_MS * 3e-3);
    client_close(c);
}

static void test_init_errors(uv_loop_t *loop, int port) {
    cs_http_routes routes = {0};
    cs_http_server *s = (cs_http_server *)1;
    ASSERT_EQ_INT(cs_http_ops_start(loop, "localhost", 0, &routes, &s), CS_EINVAL);
    ASSERT_TRUE(s == NULL);
    ASSERT_MSG_HAS(cs_last_error(), "'localhost' is not a numeric");
    ASSERT_EQ_INT(cs_http_ops_start(loop, "127.0.0.1", 65536, &routes, &s), CS_EINVAL);
    ASSERT_EQ_INT(cs_http_ops_start(loop, "127.0.0.1", 0, NULL, &s), CS_EINVAL);
    ASSERT_EQ_INT(cs_http_ops_start(loop, "127.0.0.1", port, &routes, &s), -EADDRINUSE);
    ASSERT_MSG_HAS(cs_last_error(), "cannot listen on 127.0.0.1:");
    ASSERT_TRUE(s == NULL);
    cs_http_server_close(NULL);
}

/* A server with no metrics: /metrics is 404; IPv6 loopback when available. */
static void test_minimal(void) {
    uv_loop_t loop;
    ASSERT_EQ_INT(uv_loop_init(&loop), 0);
    cs_http_routes routes = {0};
    cs_http_server *s = NULL;
    ASSERT_EQ_INT(cs_http_ops_start(&loop, "127.0.0.1", 0, &routes, &s), 0);
    int port = cs_http_server_port(s);
    ASSERT_TRUE(port > 0);
    cs_http_server_close(s);
    ASSERT_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
    if (cs_http_ops_start(&loop, "::1", 0, &routes, &s) == 0) {
        ASSERT_TRUE(cs_http_server_port(s) > 0);
        cs_http_server_close(s);
        ASSERT_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
    }
    ASSERT_EQ_INT(uv_loop_close(&loop), 0);
}

/* ================================================================== *
 * The server's handler interface (cs_http_server_start), with a test
 * handler on the loop thread: request bodies, limits, timeouts, streamed
 * responses. Its error hook answers in JSON, as the OpenAI layer will.
 * ================================================================== */

#define G_IDLE_MS 800    /* keep-alive idle timeout of the test server */
#define G_REQUEST_MS 300 /* deadline of one request's arrival */
#define G_MAX_HEADER 2048
#define G_MAX_BODY 65536
#define FLOOD_PIECE 65536

enum stream_kind { S_COUNT, S_FOREVER, S_FLOOD, S_LATER };

typedef struct {
    uv_timer_t timer;
    cs_http_res *res;
    enum stream_kind kind;
    int n, i;
    bool closed; /* on_close fired */
} stream;

/* What the loop thread saw; the test thread reads it. */
static atomic_int n_streams;          /* open (started, not yet freed) */
static atomic_int n_on_close;         /* on_close callbacks */
static atomic_int n_late_close;       /* on_close registered after the close: called at once */
static atomic_int after_close_rc = 1; /* a write after on_close */
static atomic_int n_after_close;      /* such writes that returned CS_ECONNRESET */
static atomic_int write_errors;       /* writes on open connections that failed */
static atomic_size_t flood_p1, flood_p2, flood_total;
static atomic_bool flood_done;

static int qint(const char *query, const char *key, int def) {
    size_t kl = strlen(key);
    for (const char *p = query; p && *p; p = strchr(p, '&')) {
        if (*p == '&') p++;
        if (!strncmp(p, key, kl) && p[kl] == '=') return atoi(p + kl + 1);
    }
    return def;
}

static void on_stream_freed(uv_handle_t *h) {
    free(h->data);
    atomic_fetch_sub(&n_streams, 1);
}

static void stream_finish(stream *st) {
    cs_http_res_end(st->res);
    st->res = NULL;
    uv_close((uv_handle_t *)&st->timer, on_stream_freed);
}

static void on_late_close(void *arg) {
    atomic_fetch_add(&n_late_close, 1);
}

static void on_stream_tick(uv_timer_t *t);

static void stream_close_cb(void *arg) {
    stream *st = arg;
    st->closed = true;
    atomic_fetch_add(&n_on_close, 1);
    ASSERT_TRUE(cs_http_res_closed(st->res));
    uv_timer_start(&st->timer, on_stream_tick, 0, 0); /* the next tick ends it */
}

static void stream_write(stream *st, const void *data, size_t len) {
    int rc = cs_http_res_write(st->res, data, len);
    if (rc != 0) {
        fprintf(stderr, "stream write: %s\n", cs_strerror(rc));
        atomic_fetch_add(&write_errors, 1);
    }
}

static void on_stream_tick(uv_timer_t *t) {
    stream *st = t->data;
    char piece[64];
    if (st->closed) {
        /* After on_close: every call fails, registering calls at once, and
         * res_end still frees. */
        int rc = cs_http_res_write(st->res, "x", 1);
        atomic_store(&after_close_rc, rc);
        if (rc == CS_ECONNRESET) atomic_fetch_add(&n_after_close, 1);
        ASSERT_EQ_INT(cs_http_res_send(st->res, 200, NULL, NULL, "", 0), CS_ECONNRESET);
        ASSERT_EQ_INT(cs_http_res_start(st->res, 200, NULL, NULL), CS_ECONNRESET);
        ASSERT_EQ_INT(cs_http_res_pending_bytes(st->res), 0);
        cs_http_res_on_close(st->res, on_late_close, NULL);
        stream_finish(st);
        return;
    }
    switch (st->kind) {
    case S_COUNT:
    case S_FOREVER: {
        int n = snprintf(piece, sizeof piece, "data: %d\n\n", st->i++);
        stream_write(st, piece, (size_t)n);
        if (st->kind == S_COUNT && st->i == st->n) stream_finish(st);
        break;
    }
    case S_LATER: {
        int n = snprintf(piece, sizeof piece, "later %d\n", st->n);
        ASSERT_EQ_INT(cs_http_res_send(st->res, 200, "text/plain", NULL, piece, (size_t)n), 0);
        stream_finish(st);
        break;
    }
    case S_FLOOD: {
        /* The client does not read: what we write piles up in our queue. */
        static char big[FLOOD_PIECE];
        size_t total = atomic_load(&flood_total);
        if (st->i++ == 0) {
            while (cs_http_res_pending_bytes(st->res) < (1u << 20) && total < (64u << 20)) {
                memset(big, 'a' + (int)(total / FLOOD_PIECE % 26), sizeof big);
                stream_write(st, big, sizeof big);
                total += sizeof big;
            }
            atomic_store(&flood_p1, cs_http_res_pending_bytes(st->res));
        } else {
            for (int k = 0; k < 4; k++) {
                memset(big, 'a' + (int)(total / FLOOD_PIECE % 26), sizeof big);
                stream_write(st, big, sizeof big);
                total += sizeof big;
            }
            atomic_store(&flood_p2, cs_http_res_pending_bytes(st->res));
            stream_finish(st);
            atomic_store(&flood_done, true);
        }
        atomic_store(&flood_total, total);
        break;
    }
    }
}

static void test_handle(void *arg, cs_http_req *req, cs_http_res *res) {
    uv_loop_t *loop = arg;
    const char *path = cs_http_req_path(req);
    const char *query = cs_http_req_query(req);
    if (!strcmp(path, "/echo")) {
        size_t len = 99;
        const char *body = cs_http_req_body(req, &len);
        ASSERT_TRUE(body != NULL && body[len] == 0);
        const char *xt = cs_http_req_header(req, "x-test");
        char extra[1024];
        snprintf(extra, sizeof extra,
                 "X-Method: %s\r\nX-Path: %s\r\nX-Query: [%s]\r\nX-Test: [%s]\r\nX-Peer: %s\r\n",
                 cs_http_req_method_name(req), path, query, xt ? xt : "(none)",
                 cs_http_req_peer(req));
        ASSERT_TRUE(cs_http_req_header(req, "X-Trailer") == NULL);
        ASSERT_EQ_INT(cs_http_res_send(res, 200, "application/octet-stream", extra, body, len), 0);
        ASSERT_EQ_INT(cs_http_res_send(res, 200, NULL, NULL, "", 0), CS_EINVAL); /* once */
        ASSERT_EQ_INT(cs_http_res_write(res, "x", 1), CS_EINVAL);
        cs_http_res_end(res);
        return;
    }
    if (!strcmp(path, "/noanswer")) {
        cs_http_res_end(res);
        return;
    }
    stream *st = NULL;
    if (!strcmp(path, "/stream") || !strcmp(path, "/forever") || !strcmp(path, "/flood") ||
        !strcmp(path, "/later")) {
        st = calloc(1, sizeof *st);
        ASSERT_TRUE(st != NULL);
        st->res = res;
        st->n = qint(query, "n", 3);
        st->kind = path[1] == 's'   ? S_COUNT
                   : path[2] == 'o' ? S_FOREVER
                   : path[1] == 'f' ? S_FLOOD
                                    : S_LATER;
        ASSERT_EQ_INT(uv_timer_init(loop, &st->timer), 0);
        st->timer.data = st;
        atomic_fetch_add(&n_streams, 1);
        if (st->kind != S_LATER) {
            ASSERT_EQ_INT(cs_http_res_write(res, "x", 1), CS_EINVAL); /* not started */
            ASSERT_EQ_INT(
                cs_http_res_start(res, 200, "text/event-stream", "Cache-Control: no-cache\r\n"), 0);
            ASSERT_EQ_INT(cs_http_res_start(res, 200, NULL, NULL), CS_EINVAL);
        }
        cs_http_res_on_close(res, stream_close_cb, st);
        uint64_t ms = (uint64_t)qint(query, "ms", 10);
        uv_timer_start(&st->timer, on_stream_tick, ms, st->kind == S_LATER ? 0 : ms);
        return; /* answered from the timer */
    }
    cs_http_res_send(res, 404, "text/plain", NULL, "no\n", 3);
    cs_http_res_end(res);
}

/* The error hook: JSON, as an API would. */
static void json_error(void *arg, int status, const char *message, cs_http_res *res) {
    char body[512];
    int n = snprintf(body, sizeof body, "{\"error\":{\"code\":%d,\"message\":\"%s\"}}", status,
                     message);
    ASSERT_EQ_INT(cs_http_res_send(res, status, "application/json", NULL, body, (size_t)n), 0);
}

static void fixture_start(fixture *f) {
    ASSERT_EQ_INT(uv_loop_init(&f->loop), 0);
    cs_http_opts o = {.handler = test_handle,
                      .arg = &f->loop,
                      .max_header_bytes = G_MAX_HEADER,
                      .max_body_bytes = G_MAX_BODY,
                      .idle_ms = G_IDLE_MS,
                      .request_ms = G_REQUEST_MS,
                      .error = json_error};
    ASSERT_EQ_INT(cs_http_server_start(&f->loop, "127.0.0.1", 0, &o, &f->server), 0);
    ASSERT_EQ_INT(uv_async_init(&f->loop, &f->stop, on_stop), 0);
    f->stop.data = f;
    ASSERT_EQ_INT(pthread_create(&f->thread, NULL, loop_main, f), 0);
}

/* Closes the server from its loop; the loop must then end with nothing left. */
static void fixture_stop(fixture *f) {
    ASSERT_EQ_INT(uv_async_send(&f->stop), 0);
    ASSERT_EQ_INT(pthread_join(f->thread, NULL), 0);
    ASSERT_EQ_INT(uv_loop_close(&f->loop), 0);
}

/* Waits (up to 5 s) for the loop thread to make cond true. */
#define WAIT_FOR(cond)                                                                             \
    do {                                                                                           \
        for (int w_ = 0; w_ < 500 && !(cond); w_++)                                                \
            usleep(10 * 1000);                                                                     \
        ASSERT_TRUE(cond);                                                                         \
    } while (0)

/* A streamed response as the client sees it. */
typedef struct {
    int status;
    char head[4096];
    int n_chunks;
    size_t len, cap;
    char *body; /* de-chunked, NUL-terminated */
} sresp;

static void sresp_add(sresp *r, const char *data, size_t len) {
    if (r->len + len + 1 > r->cap) {
        r->cap = (r->len + len + 1) * 2;
        r->body = realloc(r->body, r->cap);
        ASSERT_TRUE(r->body != NULL);
    }
    memcpy(r->body + r->len, data, len);
    r->len += len;
    r->body[r->len] = 0;
}

static void consume(client *c, size_t n) {
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

/* Reads a status line and headers; the body stays in c->buf. */
static void read_head(client *c, sresp *r) {
    char *end;
    while (!(c->len && (end = memmem(c->buf, c->len, "\r\n\r\n", 4))))
        ASSERT_TRUE(client_fill(c) > 0);
    size_t hlen = (size_t)(end - c->buf) + 4;
    ASSERT_TRUE(hlen < sizeof r->head);
    memcpy(r->head, c->buf, hlen);
    r->head[hlen] = 0;
    ASSERT_TRUE(sscanf(r->head, "HTTP/1.1 %d ", &r->status) == 1);
    consume(c, hlen);
    r->len = 0;
    r->n_chunks = 0;
    sresp_add(r, "", 0);
}

/* Reads the body of a chunked response, de-chunking it, up to the last chunk. */
static void read_chunked_body(client *c, sresp *r) {
    for (;;) {
        char *eol;
        while (!(c->len && (eol = memmem(c->buf, c->len, "\r\n", 2))))
            ASSERT_TRUE(client_fill(c) > 0);
        size_t size = strtoul(c->buf, NULL, 16);
        consume(c, (size_t)(eol - c->buf) + 2);
        if (size == 0) break;
        size_t left = size;
        while (left) {
            if (c->len == 0) ASSERT_TRUE(client_fill(c) > 0);
            size_t n = c->len < left ? c->len : left;
            sresp_add(r, c->buf, n);
            consume(c, n);
            left -= n;
        }
        while (c->len < 2)
            ASSERT_TRUE(client_fill(c) > 0);
        ASSERT_TRUE(!memcmp(c->buf, "\r\n", 2));
        consume(c, 2);
        r->n_chunks++;
    }
    while (c->len < 2) /* no trailers */
        ASSERT_TRUE(client_fill(c) > 0);
    ASSERT_TRUE(!memcmp(c->buf, "\r\n", 2));
    consume(c, 2);
}

/* Reads what comes until the server's end of stream. */
static void read_to_eof(client *c, sresp *r) {
    for (;;) {
        sresp_add(r, c->buf, c->len);
        c->len = 0;
        ssize_t n = client_fill(c);
        ASSERT_TRUE(n >= 0);
        if (n == 0) break;
    }
}

static void test_echo(int port) {
    static response r;
    client *c = client_open(port);
    client_sends(c, "POST /echo?a=1&b=2 HTTP/1.1\r\nHost: x\r\nx-TEST:   padded value \t\r\n"
                    "X-Test: second\r\nContent-Length: 11\r\n\r\nhello world");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_STR(r.body, "hello world");
    HAS(&r, "\r\nContent-Type: application/octet-stream\r\nContent-Length: 11\r\n");
    HAS(&r, "\r\nX-Method: POST\r\nX-Path: /echo\r\nX-Query: [a=1&b=2]\r\n");
    HAS(&r, "\r\nX-Test: [padded value]\r\n"); /* first occurrence, trimmed */
    HAS(&r, "\r\nX-Peer: 127.0.0.1:");
    LACKS(&r, "Connection:");
    /* A body with a NUL in it; then no body at all; HEAD. */
    client_send(c, "PUT /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nab\0cd", 46);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.body_len, 5);
    ASSERT_TRUE(!memcmp(r.body, "ab\0cd", 5));
    HAS(&r, "\r\nX-Method: PUT\r\nX-Path: /echo\r\nX-Query: []\r\nX-Test: [(none)]\r\n");
    client_sends(c,
                 "GET /echo HTTP/1.1\r\n\r\nHEAD /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.body_len, 0);
    read_response(c, &r, true);
    HAS(&r, "\r\nContent-Length: 3\r\n");
    /* Pipelined POSTs with bodies, in one write: answers in order. */
    client_sends(c, "POST /echo HTTP/1.1\r\nContent-Length: 1\r\n\r\n1"
                    "POST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\n22"
                    "POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\n333");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "1");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "22");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "333");
    /* request_ms bounds one request, not the wait between requests. */
    usleep((G_REQUEST_MS + G_IDLE_MS) / 2 * 1000); /* over request_ms, under idle_ms */
    client_sends(c, "GET /echo HTTP/1.1\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    /* A handler that ends without answering: 500 from the error hook, close. */
    client_sends(c, "GET /noanswer HTTP/1.1\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 500);
    HAS(&r, "\r\nContent-Type: application/json\r\n");
    HAS(&r, "\r\nConnection: close\r\n");
    expect_eof(c);
    client_close(c);
}

static void test_chunked_request(int port) {
    static response r;
    client *c = client_open(port);
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* A byte at a time: every piece of the parser's state split. */
    const char *req = "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX-Test: t\r\n\r\n"
                      "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: tr\r\n\r\n";
    for (const char *p = req; *p; p++)
        client_send(c, p, 1);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_STR(r.body, "hello world");
    HAS(&r, "\r\nX-Test: [t]\r\n");
    /* The connection goes on. */
    client_sends(c,
                 "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "abc");
    client_close(c);
}

static void test_expect_continue(int port) {
    static response r;
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    client *c = client_open(port);
    client_sends(c, "POST /echo HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-Continue\r\n\r\n");
    while (c->len < sizeof cont - 1)
        ASSERT_TRUE(client_fill(c) > 0);
    ASSERT_TRUE(!memcmp(c->buf, cont, sizeof cont - 1));
    consume(c, sizeof cont - 1);
    client_sends(c, "hello");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_STR(r.body, "hello");
    /* No body announced: no 100. */
    client_sends(c, "GET /echo HTTP/1.1\r\nExpect: 100-continue\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_INT(c->len, 0);
    client_close(c);

    /* Too long for max_body_bytes: 413 at once, the body never sent. */
    c = client_open(port);
    client_sends(c,
                 "POST /echo HTTP/1.1\r\nContent-Length: 100000\r\nExpect: 100-continue\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 413);
    HAS(&r, "HTTP/1.1 413 Payload Too Large\r\n");
    HAS(&r, "\r\nContent-Type: application/json\r\n");
    HAS(&r, "\r\nConnection: close\r\n");
    ASSERT_MSG_HAS(r.body, "{\"error\":{\"code\":413,");
    expect_eof(c);
    client_close(c);
}

static void test_limits(int port) {
    static response r;
    static char big[128 * 1024];
    /* A Content-Length over max_body_bytes, the body sent anyway. */
    client *c = client_open(port);
    size_t len =
        (size_t)sprintf(big, "POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n", G_MAX_BODY + 1);
    memset(big + len, 'b', G_MAX_BODY + 1);
    client_send(c, big, len + G_MAX_BODY + 1);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 413);
    HAS(&r, "\r\nConnection: close\r\n");
    expect_eof(c);
    client_close(c);

    /* Exactly max_body_bytes is fine. */
    c = client_open(port);
    len = (size_t)sprintf(big, "POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n", G_MAX_BODY);
    memset(big + len, 'b', G_MAX_BODY);
    client_send(c, big, len + G_MAX_BODY);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_INT(r.body_len, G_MAX_BODY);
    client_close(c);

    /* A chunked body that grows past the limit. */
    c = client_open(port);
    client_sends(c, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
    static char chunk[16 * 1024 + 16];
    len = (size_t)sprintf(chunk, "%x\r\n", 16 * 1024);
    memset(chunk + len, 'c', 16 * 1024);
    len += 16 * 1024;
    len += (size_t)sprintf(chunk + len, "\r\n");
    for (int i = 0; i < 5; i++)
        client_send(c, chunk, len);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 413);
    ASSERT_MSG_HAS(r.body, "request body too large");
    expect_eof(c);
    client_close(c);

    /* Headers over max_header_bytes: 431. */
    c = client_open(port);
    len = (size_t)sprintf(big, "GET /echo HTTP/1.1\r\nX-Big: ");
    memset(big + len, 'h', G_MAX_HEADER);
    len += G_MAX_HEADER;
    len += (size_t)sprintf(big + len, "\r\n\r\n");
    client_send(c, big, len);
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 431);
    HAS(&r, "HTTP/1.1 431 Request Header Fields Too Large\r\n");
    HAS(&r, "\r\nConnection: close\r\n");
    expect_eof(c);
    client_close(c);

    /* Malformed: 400 in the hook's format. */
    c = client_open(port);
    client_sends(c, "GET /echo HTTP/1.1\r\nBad Header\r\n\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_MSG_HAS(r.body, "\"message\":\"bad request: ");
    expect_eof(c);
    client_close(c);
}

static void test_slowloris(int port) {
    static response r;
    client *c = client_open(port);
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    const char *req =
        "GET /echo HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    double t0 = now_s();
    for (const char *p = req; *p; p++) {
        (void)send(c->fd, p, 1, MSG_NOSIGNAL); /* the server may have answered already */
        usleep(40 * 1000);
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        if (poll(&pfd, 1, 0) > 0) break;
    }
    read_response(c, &r, false);
    double dt = now_s() - t0;
    ASSERT_EQ_INT(r.status, 408);
    HAS(&r, "\r\nConnection: close\r\n");
    ASSERT_MSG_HAS(r.body, "{\"error\":{\"code\":408,");
    if (dt < G_REQUEST_MS * 0.9e-3 || dt > G_REQUEST_MS * 4e-3)
        fprintf(stderr, "408 after %.3f s\n", dt);
    ASSERT_TRUE(dt >= G_REQUEST_MS * 0.9e-3 && dt < G_REQUEST_MS * 4e-3);
    expect_eof(c);
    client_close(c);
}

static void test_stream(int port) {
    static response r;
    static sresp s;
    /* An async answer, a stream longer than the idle timeout in pieces from a
     * timer, and an echo, pipelined in one write: answered in order. */
    client *c = client_open(port);
    client_sends(c, "GET /later?n=7&ms=50 HTTP/1.1\r\n\r\n"
                    "GET /stream?n=10&ms=100 HTTP/1.1\r\n\r\n"
                    "POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_STR(r.body, "later 7\n");
    double t0 = now_s();
    read_head(c, &s);
    ASSERT_EQ_INT(s.status, 200);
    HAS(&s, "\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            "Cache-Control: no-cache\r\n\r\n");
    LACKS(&s, "Content-Length");
    read_chunked_body(c, &s);
    ASSERT_TRUE(now_s() - t0 > G_IDLE_MS * 1e-3); /* the idle timer left it alone */
    ASSERT_EQ_INT(s.n_chunks, 10);
    char want[256] = "";
    for (int i = 0; i < 10; i++)
        sprintf(want + strlen(want), "data: %d\n\n", i);
    ASSERT_EQ_STR(s.body, want);
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "abc");
    ASSERT_EQ_INT(c->len, 0);
    /* HEAD of a stream: headers only, the connection goes on. */
    client_sends(c, "HEAD /stream?n=2&ms=5 HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n");
    read_head(c, &s);
    HAS(&s, "\r\nTransfer-Encoding: chunked\r\n");
    read_response(c, &r, false);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_INT(c->len, 0);
    client_close(c);

    /* HTTP/1.0: no chunks, Connection: close, the body ends at the close. */
    c = client_open(port);
    client_sends(c, "GET /stream?n=3&ms=10 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    read_head(c, &s);
    ASSERT_EQ_INT(s.status, 200);
    HAS(&s, "\r\nConnection: close\r\n");
    LACKS(&s, "Transfer-Encoding");
    LACKS(&s, "Content-Length");
    read_to_eof(c, &s);
    ASSERT_EQ_STR(s.body, "data: 0\n\ndata: 1\n\ndata: 2\n\n");
    client_close(c);
    WAIT_FOR(atomic_load(&n_streams) == 0);
    ASSERT_EQ_INT(atomic_load(&write_errors), 0);
    free(s.body);
    memset(&s, 0, sizeof s);
}

static void test_stream_client_close(int port) {
    static sresp s;
    int closes = atomic_load(&n_on_close), late = atomic_load(&n_late_close);
    int resets = atomic_load(&n_after_close);
    client *c = client_open(port);
    client_sends(c, "GET /forever?ms=5 HTTP/1.1\r\n\r\n");
    read_head(c, &s);
    ASSERT_EQ_INT(s.status, 200);
    while (c->len < 12) /* a chunk or two */
        ASSERT_TRUE(client_fill(c) > 0);
    client_close(c); /* mid-stream */
    WAIT_FOR(atomic_load(&n_streams) == 0);
    ASSERT_EQ_INT(atomic_load(&n_on_close), closes + 1);
    ASSERT_EQ_INT(atomic_load(&n_after_close), resets + 1);
    ASSERT_EQ_INT(atomic_load(&after_close_rc), CS_ECONNRESET);
    ASSERT_EQ_INT(atomic_load(&n_late_close), late + 1);
    ASSERT_EQ_INT(atomic_load(&write_errors), 0);
    free(s.body);
    memset(&s, 0, sizeof s);
}

/* A client that leaves while its answer is not even started (a long prefill,
 * a queue): on_close fires from its end of stream, before anything is written. */
static void test_client_gone_early(int port) {
    int closes = atomic_load(&n_on_close), resets = atomic_load(&n_after_close);
    client *c = client_open(port);
    client_sends(c, "GET /later?ms=60000 HTTP/1.1\r\n\r\n");
    WAIT_FOR(atomic_load(&n_streams) == 1);
    shutdown(c->fd, SHUT_WR);
    WAIT_FOR(atomic_load(&n_streams) == 0); /* on_close, then ended by its owner */
    ASSERT_EQ_INT(atomic_load(&n_on_close), closes + 1);
    ASSERT_EQ_INT(atomic_load(&n_after_close), resets + 1);
    ASSERT_TRUE(client_fill(c) <= 0); /* no answer: the connection just ends */
    client_close(c);
}

static void test_pending_bytes(int port) {
    static sresp s;
    client *c = calloc(1, sizeof *c);
    ASSERT_TRUE(c != NULL);
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    int small = 32 * 1024;
    setsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct timeval tv = {10, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ_INT(connect(c->fd, (struct sockaddr *)&a, sizeof a), 0);
    client_sends(
        c, "GET /flood?ms=20 HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nok");
    WAIT_FOR(atomic_load(&flood_done)); /* we read nothing meanwhile */
    size_t p1 = atomic_load(&flood_p1), p2 = atomic_load(&flood_p2);
    size_t total = atomic_load(&flood_total);
    if (!(p1 >= (1u << 20) && p2 > p1))
        fprintf(stderr, "pending bytes %zu then %zu of %zu written\n", p1, p2, total);
    ASSERT_TRUE(p1 >= (1u << 20) && total < (64u << 20));
    ASSERT_TRUE(p2 > p1);
    /* All of it arrives, in order, then the pipelined request's answer. */
    read_head(c, &s);
    read_chunked_body(c, &s);
    ASSERT_EQ_INT(s.len, total);
    for (size_t off = 0; off < total; off += FLOOD_PIECE)
        ASSERT_EQ_INT(s.body[off], 'a' + (int)(off / FLOOD_PIECE % 26));
    static response r;
    read_response(c, &r, false);
    ASSERT_EQ_STR(r.body, "ok");
    client_close(c);
    WAIT_FOR(atomic_load(&n_streams) == 0);
    ASSERT_EQ_INT(atomic_load(&write_errors), 0);
    free(s.body);
    memset(&s, 0, sizeof s);
}

/* Closing the server with responses in flight: streamed (read and unread),
 * an async answer not given yet, a request half sent. on_close fires for each,
 * the owners end them, the loop ends with nothing left. */
static void test_close_with_streams(void) {
    fixture f;
    fixture_start(&f);
    int port = cs_http_server_port(f.server);
    static sresp s;
    int closes = atomic_load(&n_on_close), resets = atomic_load(&n_after_close);
    client *reader = client_open(port);
    client_sends(reader, "GET /forever?ms=5 HTTP/1.1\r\n\r\n");
    read_head(reader, &s);
    client *unread = client_open(port);
    client_sends(unread, "GET /forever?ms=1 HTTP/1.1\r\n\r\n");
    client *later = client_open(port);
    client_sends(later, "GET /later?ms=60000 HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n");
    client *partial = client_open(port);
    client_sends(partial, "POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc");
    WAIT_FOR(atomic_load(&n_streams) == 3);
    usleep(50 * 1000);
    fixture_stop(&f); /* asserts the loop ended with no handle left */
    ASSERT_EQ_INT(atomic_load(&n_streams), 0);
    ASSERT_EQ_INT(atomic_load(&n_on_close), closes + 3);
    ASSERT_EQ_INT(atomic_load(&n_after_close), resets + 3);
    client *cs[] = {reader, unread, later, partial};
    for (int i = 0; i < 4; i++) {
        ssize_t n;
        while ((n = client_fill(cs[i])) > 0)
            cs[i]->len = 0;
        ASSERT_TRUE(n <= 0);
        client_close(cs[i]);
    }
    free(s.body);
    memset(&s, 0, sizeof s);
}

static void test_generic(void) {
    cs_http_server *s = (cs_http_server *)1;
    uv_loop_t loop;
    ASSERT_EQ_INT(uv_loop_init(&loop), 0);
    cs_http_opts none = {0};
    ASSERT_EQ_INT(cs_http_server_start(&loop, "127.0.0.1", 0, &none, &s), CS_EINVAL);
    ASSERT_TRUE(s == NULL);
    ASSERT_EQ_INT(uv_loop_close(&loop), 0);

    fixture f;
    fixture_start(&f);
    int port = cs_http_server_port(f.server);
    test_echo(port);
    test_chunked_request(port);
    test_expect_continue(port);
    test_limits(port);
    test_slowloris(port);
    test_stream(port);
    test_stream_client_close(port);
    test_client_gone_early(port);
    test_pending_bytes(port);
    fixture_stop(&f);
    test_close_with_streams();
}

int main(void) {
    alarm(120); /* a hang is a failure, not a stuck ctest */
    test_minimal();

    cs_metrics *m = NULL;
    ASSERT_EQ_INT(cs_metrics_init(&m), 0);
    scrapes = cs_metrics_counter(m, "test_scrapes_total", NULL, "Scrapes of /metrics.");
    for (int i = 0; i < 1000; i++) { /* a body of tens of KiB */
        char labels[64];
        snprintf(labels, sizeof labels, "shard=\"%d\"", i);
        cs_metric_set(cs_metrics_gauge(m, "test_shard_load", labels, "Load per shard."), i * 0.5);
    }
    fixture f;
    ASSERT_EQ_INT(uv_loop_init(&f.loop), 0);
    cs_http_routes routes = {
        .metrics = m, .before_metrics = before_metrics, .healthy = healthy, .ready = ready};
    ASSERT_EQ_INT(cs_http_ops_start(&f.loop, "127.0.0.1", 0, &routes, &f.server), 0);
    cs__http_server_set_idle_ms(f.server, IDLE_MS);
    int port = cs_http_server_port(f.server);
    ASSERT_TRUE(port > 0 && port < 65536);
    test_init_errors(&f.loop, port);
    ASSERT_EQ_INT(uv_async_init(&f.loop, &f.stop, on_stop), 0);
    f.stop.data = &f;
    ASSERT_EQ_INT(pthread_create(&f.thread, NULL, loop_main, &f), 0);

    test_routes(port, m);
    test_head(port);
    test_keep_alive(port);
    test_pipelining(port);
    test_bad_requests(port);
    test_idle(port);

    /* Close with connections open: idle, mid-request, after a keep-alive
     * exchange, and one with a response the client never reads. */
    client *idle = client_open(port);
    client *partial = client_open(port);
    client_sends(partial, "GET /metrics HTTP/1.1\r\nHost:");
    client *done = client_open(port);
    static response r;
    client_sends(done, "GET /healthz HTTP/1.1\r\n\r\n");
    read_response(done, &r, false);
    client *unread = client_open(port);
    for (int i = 0; i < 20; i++)
        client_sends(unread, "GET /metrics HTTP/1.1\r\n\r\n");
    usleep(200 * 1000); /* let the server accept and start answering */
    ASSERT_EQ_INT(uv_async_send(&f.stop), 0);
    ASSERT_EQ_INT(pthread_join(f.thread, NULL), 0);
    ASSERT_EQ_INT(uv_loop_close(&f.loop), 0); /* no handle left behind */
    /* Every client sees its connection end (a reset is fine here). */
    client *cs[] = {idle, partial, done};
    for (int i = 0; i < 3; i++) {
        ASSERT_TRUE(client_fill(cs[i]) <= 0);
        client_close(cs[i]);
    }
    client_close(unread);
    /* Nobody listens any more. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_TRUE(connect(fd, (struct sockaddr *)&a, sizeof a) != 0);
    close(fd);
    cs_metrics_free(m);

    test_generic();
    printf("test_http: ok\n");
    return 0;
}
