/* test_http.c: the operator HTTP server (proc/src/http.c) on a real libuv
 * loop (its own thread) on 127.0.0.1, port 0, driven by real blocking client
 * sockets: /metrics, /healthz, /readyz, 404, 405, HEAD, keep-alive,
 * pipelining (beyond the per-connection queue limit), Connection: close,
 * HTTP/1.0, half-close, oversized and malformed requests (400 and close),
 * the idle timeout, and closing the server with connections open, after
 * which the loop must end with nothing left (run under ASan by make test). */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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
    ASSERT_EQ_INT(cs_http_server_init(loop, "localhost", 0, &routes, &s), CS_EINVAL);
    ASSERT_TRUE(s == NULL);
    ASSERT_MSG_HAS(cs_last_error(), "'localhost' is not a numeric");
    ASSERT_EQ_INT(cs_http_server_init(loop, "127.0.0.1", 65536, &routes, &s), CS_EINVAL);
    ASSERT_EQ_INT(cs_http_server_init(loop, "127.0.0.1", 0, NULL, &s), CS_EINVAL);
    ASSERT_EQ_INT(cs_http_server_init(loop, "127.0.0.1", port, &routes, &s), -EADDRINUSE);
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
    ASSERT_EQ_INT(cs_http_server_init(&loop, "127.0.0.1", 0, &routes, &s), 0);
    int port = cs_http_server_port(s);
    ASSERT_TRUE(port > 0);
    cs_http_server_close(s);
    ASSERT_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
    if (cs_http_server_init(&loop, "::1", 0, &routes, &s) == 0) {
        ASSERT_TRUE(cs_http_server_port(s) > 0);
        cs_http_server_close(s);
        ASSERT_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
    }
    ASSERT_EQ_INT(uv_loop_close(&loop), 0);
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
    ASSERT_EQ_INT(cs_http_server_init(&f.loop, "127.0.0.1", 0, &routes, &f.server), 0);
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
    printf("test_http: ok\n");
    return 0;
}
