/* test_rpc.c: the RPC layer end to end on loopback: an echo server (its own
 * thread, libuv loop and completion queue) called by the C client on the main
 * thread. Unary round trip with metadata and deadline, a 10,000-message
 * stream, cancellation mid-stream seen by the handler, deadline expiry,
 * unknown methods answered at once, oversized and malformed requests, and
 * shutdown with 8 streams in flight. Timings here are generous bounds that
 * catch hangs, not performance assertions. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/error.h"
#include "chunkserve/rpc.h"
#include "chunkserve/rpc_health.h"
#include "grpc/health/v1/health.pb-c.h"
#include "chunkserve/v1/echo.pb-c.h"
#include "echo_service.h"
#include "rpc_check.h"

static atomic_int failures;

/* ------------------------------------------------------------ server -- */

typedef struct {
    uv_loop_t uv;
    cs_rpc_loop *rl;
    cs_rpc_server *srv;
    cs_rpc_health *health;
    cs_echo_service echo;
    int port;
    atomic_int ready, stopped;
    int32_t grace_ms;
    pthread_t thread;
} server_ctx;

static void on_server_done(void *data) {
    server_ctx *s = data;
    cs_rpc_loop_close(s->rl); /* uv_run returns once it has closed */
}

static void do_shutdown(void *data) {
    server_ctx *s = data;
    cs_rpc_health_shutdown(s->health);
    cs_rpc_server_shutdown(s->srv, s->grace_ms, on_server_done, s);
}

static void set_echo_not_serving(void *data) {
    server_ctx *s = data;
    cs_rpc_health_set(s->health, "chunkserve.v1.Echo", CS_RPC_SERVING_NOT_SERVING);
}

static void *server_main(void *arg) {
    server_ctx *s = arg;
    uv_loop_init(&s->uv);
    s->echo.uv = &s->uv;
    cs_rpc_server_opts o = {.addr = "127.0.0.1:0", .max_recv_bytes = 1 << 20};
    if (cs_rpc_loop_init(&s->uv, &s->rl) != 0 || cs_rpc_server_init(s->rl, &o, &s->srv) != 0 ||
        cs_echo_register(s->srv, &s->echo) != 0 || cs_rpc_health_init(s->srv, &s->health) != 0 ||
        cs_rpc_server_start(s->srv, &s->port) != 0) {
        fprintf(stderr, "server setup failed\n");
        exit(1);
    }
    cs_rpc_health_set(s->health, "", CS_RPC_SERVING_SERVING);
    cs_rpc_health_set(s->health, "chunkserve.v1.Echo", CS_RPC_SERVING_SERVING);
    atomic_store(&s->ready, 1);
    uv_run(&s->uv, UV_RUN_DEFAULT);
    cs_rpc_health_free(s->health);
    int rc = uv_loop_close(&s->uv);
    if (rc != 0) fprintf(stderr, "server uv_loop_close: %s\n", uv_strerror(rc));
    CHECK_EQ(rc, 0);
    atomic_store(&s->stopped, 1);
    return NULL;
}

/* ------------------------------------------------------------ client -- */

static uv_loop_t cuv;
static cs_rpc_loop *crl;
static cs_rpc_channel *chan;

typedef struct {
    int done, code;
    char msg[256];
    int n_msgs;
    bool in_order;
    size_t payload_bytes;
    int cancel_after; /* cancel once this many messages arrived (0: never) */
    cs_rpc_client_call *call;
    char hdr_request_id[64], trl_deadline[32];
    uint8_t first_payload[64];
    size_t first_len;
    double t_start, t_end;
} result;

static void copy_md(const cs_rpc_client_call *c, const char *key, char *out, size_t cap) {
    size_t n;
    const char *v = cs_rpc_client_call_metadata(c, key, &n);
    if (!v) return;
    snprintf(out, cap, "%.*s", (int)n, v);
}

static void on_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    result *r = data;
    Chunkserve__V1__EchoResponse *m = chunkserve__v1__echo_response__unpack(NULL, len, buf);
    CHECK(m != NULL);
    if (!m) return;
    if (m->seq != r->n_msgs) r->in_order = false;
    if (r->n_msgs == 0) {
        r->first_len =
            m->payload.len < sizeof r->first_payload ? m->payload.len : sizeof r->first_payload;
        memcpy(r->first_payload, m->payload.data, r->first_len);
        copy_md(c, "x-request-id", r->hdr_request_id, sizeof r->hdr_request_id);
    }
    r->payload_bytes += m->payload.len;
    r->n_msgs++;
    chunkserve__v1__echo_response__free_unpacked(m, NULL);
    if (r->cancel_after && r->n_msgs == r->cancel_after) cs_rpc_client_call_cancel(c);
}

static void on_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    result *r = data;
    CHECK(!r->done);
    r->done = 1;
    r->code = code;
    r->t_end = now_s();
    snprintf(r->msg, sizeof r->msg, "%s", message);
    copy_md(c, "x-request-id", r->hdr_request_id, sizeof r->hdr_request_id);
    copy_md(c, "x-deadline-ms", r->trl_deadline, sizeof r->trl_deadline);
    r->call = NULL;
}

static void start_echo(cs_rpc_channel *ch, result *r, const char *method, const void *payload,
                       size_t len, int count, int interval_ms, int delay_ms,
                       const cs_rpc_call_opts *o) {
    memset(r, 0, sizeof *r);
    r->in_order = true;
    r->t_start = now_s();
    Chunkserve__V1__EchoRequest req = CHUNKSERVE__V1__ECHO_REQUEST__INIT;
    req.payload.data = (uint8_t *)payload;
    req.payload.len = len;
    req.count = count;
    req.interval_ms = interval_ms;
    req.delay_ms = delay_ms;
    int rc = cs_rpc_channel_call_msg(ch, method, &req.base, o, on_msg, on_done, r, &r->call);
    CHECK_EQ(rc, 0);
    if (rc) r->done = 1;
}

/* Runs the client loop until every result is done. */
static void wait_all(result *rs, int n) {
    for (;;) {
        int all = 1;
        for (int i = 0; i < n; i++)
            all &= rs[i].done;
        if (all) return;
        uv_run(&cuv, UV_RUN_ONCE);
    }
}

/* Waits (client loop running) until *flag >= want or timeout_s passes. */
static bool wait_counter(atomic_int *flag, int want, double timeout_s) {
    double t0 = now_s();
    while (atomic_load(flag) < want) {
        if (now_s() - t0 > timeout_s) return false;
        uv_run(&cuv, UV_RUN_NOWAIT);
        usleep(1000);
    }
    return true;
}

static void wait_flag(const int *flag) {
    while (!*flag)
        uv_run(&cuv, UV_RUN_ONCE);
}

#define UNARY "/chunkserve.v1.Echo/Unary"
#define STREAM "/chunkserve.v1.Echo/Stream"

/* -------------------------------------------------------------- tests -- */

static void test_unary(void) {
    cs_rpc_metadata md[] = {{"x-request-id", "req-42"}};
    cs_rpc_call_opts o = {.timeout_ms = 5000, .metadata = md, .n_metadata = 1};
    result r;
    start_echo(chan, &r, UNARY, "hello", 5, 0, 0, 0, &o);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_OK);
    CHECK_EQ(r.n_msgs, 1);
    CHECK_EQ(r.first_len, 5);
    CHECK(memcmp(r.first_payload, "hello", 5) == 0);
    CHECK(strcmp(r.hdr_request_id, "req-42") == 0);
    long dl = atol(r.trl_deadline);
    /* The handler saw the deadline (grpc-timeout is rounded up on the wire
     * and counted from arrival, so it may read a little over 5000). */
    CHECK(dl > 0 && dl <= 5100);

    /* No deadline: the handler sees none. */
    start_echo(chan, &r, UNARY, "x", 1, 0, 0, 0, NULL);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_OK);
    CHECK(strcmp(r.trl_deadline, "9223372036854775807") == 0);
    fprintf(stderr, "unary: ok (handler saw deadline %ld ms)\n", dl);
}

static void test_stream_10k(void) {
    result r;
    double t0 = now_s();
    start_echo(chan, &r, STREAM, "0123456789abcdef", 16, 10000, 0, 0, NULL);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_OK);
    CHECK_EQ(r.n_msgs, 10000);
    CHECK(r.in_order);
    CHECK_EQ(r.payload_bytes, 16 * 10000);
    fprintf(stderr, "stream: 10000 messages in %.3f s\n", now_s() - t0);
}

static void test_cancel_mid_stream(server_ctx *s) {
    int cancels0 = atomic_load(&s->echo.cancels_seen);
    result r;
    start_echo(chan, &r, STREAM, "p", 1, 1000000000, 0, 0, NULL);
    r.cancel_after = 100;
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_CANCELLED);
    CHECK_EQ(r.n_msgs, 100); /* nothing delivered after the cancel */
    CHECK(wait_counter(&s->echo.cancels_seen, cancels0 + 1, 10.0));
    fprintf(stderr, "cancel mid-stream: seen by the handler\n");
}

static void test_deadline(server_ctx *s) {
    int cancels0 = atomic_load(&s->echo.cancels_seen);
    cs_rpc_call_opts o = {.timeout_ms = 200};
    result r;
    start_echo(chan, &r, UNARY, "slow", 4, 0, 0, 30000, &o);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_DEADLINE_EXCEEDED);
    CHECK(r.t_end - r.t_start < 5.0);
    CHECK(wait_counter(&s->echo.cancels_seen, cancels0 + 1, 10.0));

    /* A stream whose deadline passes mid-way. */
    start_echo(chan, &r, STREAM, "s", 1, 1000000, 10, 0, &o);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_DEADLINE_EXCEEDED);
    CHECK(r.n_msgs > 0);
    CHECK(wait_counter(&s->echo.cancels_seen, cancels0 + 2, 10.0));
    fprintf(stderr, "deadline: DEADLINE_EXCEEDED after %.3f s, handler cancelled\n",
            r.t_end - r.t_start);
}

static void test_unknown_method(void) {
    cs_rpc_call_opts o = {.timeout_ms = 20000};
    const char *methods[] = {"/chunkserve.v1.Echo/Nope", "/no.such.Service/Call"};
    for (int i = 0; i < 2; i++) {
        result r;
        start_echo(chan, &r, methods[i], "x", 1, 0, 0, 0, &o);
        wait_all(&r, 1);
        CHECK_CODE(r.code, CS_RPC_UNIMPLEMENTED);
        CHECK(r.t_end - r.t_start < 5.0); /* at once, not at the deadline */
        CHECK(strstr(r.msg, methods[i]) != NULL);
        fprintf(stderr, "unknown method: UNIMPLEMENTED in %.3f s (\"%s\")\n", r.t_end - r.t_start,
                r.msg);
    }
}

static void test_too_large(void) {
    size_t n = 2 << 20; /* the server accepts 1 MiB */
    uint8_t *big = calloc(1, n);
    result r;
    start_echo(chan, &r, UNARY, big, n, 0, 0, 0, NULL);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_RESOURCE_EXHAUSTED);
    fprintf(stderr, "too large: RESOURCE_EXHAUSTED (\"%s\")\n", r.msg);
    free(big);

    /* The server keeps serving. */
    start_echo(chan, &r, UNARY, "after", 5, 0, 0, 0, NULL);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_OK);
}

static void test_malformed(void) {
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0x0f};
    result r;
    memset(&r, 0, sizeof r);
    CHECK_EQ(cs_rpc_channel_call(chan, UNARY, junk, sizeof junk, NULL, on_msg, on_done, &r, NULL),
             0);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_INVALID_ARGUMENT);
    fprintf(stderr, "malformed: INVALID_ARGUMENT (\"%s\")\n", r.msg);
}

/* ------------------------------------------------------------- health -- */

typedef struct {
    int done, code, n, cancel_at;
    int statuses[8];
} hresult;

static void on_health_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    hresult *r = data;
    Grpc__Health__V1__HealthCheckResponse *m =
        grpc__health__v1__health_check_response__unpack(NULL, len, buf);
    CHECK(m != NULL);
    if (!m) return;
    if (r->n < 8) r->statuses[r->n] = m->status;
    r->n++;
    grpc__health__v1__health_check_response__free_unpacked(m, NULL);
    if (r->cancel_at && r->n == r->cancel_at) cs_rpc_client_call_cancel(c);
}

static void on_health_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    hresult *r = data;
    r->done = 1;
    r->code = code;
}

static void health_call(hresult *r, const char *method, const char *service) {
    memset(r, 0, sizeof *r);
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    CHECK_EQ(cs_rpc_channel_call_msg(chan, method, &req.base, NULL, on_health_msg, on_health_done,
                                     r, NULL),
             0);
}

static void test_health(server_ctx *s) {
    hresult r;
    health_call(&r, "/grpc.health.v1.Health/Check", "");
    wait_flag(&r.done);
    CHECK_CODE(r.code, CS_RPC_OK);
    CHECK_EQ(r.statuses[0], CS_RPC_SERVING_SERVING);
    health_call(&r, "/grpc.health.v1.Health/Check", "no.such.Service");
    wait_flag(&r.done);
    CHECK_CODE(r.code, CS_RPC_NOT_FOUND);

    /* Watch sees the current status, then the change made on the server. */
    health_call(&r, "/grpc.health.v1.Health/Watch", "chunkserve.v1.Echo");
    r.cancel_at = 2;
    while (r.n < 1 && !r.done)
        uv_run(&cuv, UV_RUN_ONCE);
    CHECK_EQ(cs_rpc_loop_post(s->rl, set_echo_not_serving, s), 0);
    wait_flag(&r.done);
    CHECK_CODE(r.code, CS_RPC_CANCELLED);
    CHECK_EQ(r.n, 2);
    CHECK_EQ(r.statuses[0], CS_RPC_SERVING_SERVING);
    CHECK_EQ(r.statuses[1], CS_RPC_SERVING_NOT_SERVING);
    fprintf(stderr, "health: Check and Watch ok\n");
}

/* --------------------------------------------------- server lifecycle -- */

static void on_flag_done(void *data) {
    *(int *)data = 1;
}

static void noop_handler(cs_rpc_call *c, void *data) {
    cs_rpc_call_finish(c, CS_RPC_OK, NULL);
}

/* SO_REUSEPORT is off: a second server on a bound port fails to start (and
 * is still freed by shutdown); a server never started shuts down too. */
static void test_server_lifecycle(server_ctx *s) {
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", s->port);
    cs_rpc_server_opts o = {.addr = addr};
    cs_rpc_server *srv;
    CHECK_EQ(cs_rpc_server_init(crl, &o, &srv), 0);
    CHECK_EQ(cs_rpc_server_add_method(srv, "/x.Y/Z", CS_RPC_UNARY, NULL, noop_handler, NULL), 0);
    CHECK_EQ(cs_rpc_server_add_method(srv, "/x.Y/Z", CS_RPC_UNARY, NULL, noop_handler, NULL),
             CS_EINVAL);
    CHECK_EQ(cs_rpc_server_add_method(srv, "bad", CS_RPC_UNARY, NULL, noop_handler, NULL),
             CS_EINVAL);
    CHECK_EQ(cs_rpc_server_start(srv, NULL), CS_EBUSY);
    int done = 0;
    cs_rpc_server_shutdown(srv, 0, on_flag_done, &done);
    CHECK_EQ(done, 0); /* never inside the call */
    wait_flag(&done);

    o.addr = "127.0.0.1:0";
    CHECK_EQ(cs_rpc_server_init(crl, &o, &srv), 0);
    done = 0;
    cs_rpc_server_shutdown(srv, 0, on_flag_done, &done);
    wait_flag(&done);
    fprintf(stderr, "server lifecycle: busy port refused, unstarted servers freed\n");
}

/* Freeing a channel cancels its calls; each still ends with a status. */
static void test_channel_free_in_flight(server_ctx *s) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", s->port);
    cs_rpc_channel *ch2;
    CHECK_EQ(cs_rpc_channel_init(crl, target, NULL, &ch2), 0);
    result rs[2];
    start_echo(ch2, &rs[0], STREAM, "t", 1, 1000000, 2, 0, NULL);
    start_echo(ch2, &rs[1], UNARY, "t", 1, 0, 0, 60000, NULL);
    while (rs[0].n_msgs < 2)
        uv_run(&cuv, UV_RUN_ONCE);
    cs_rpc_channel_free(ch2);
    wait_all(rs, 2);
    CHECK_CODE(rs[0].code, CS_RPC_CANCELLED);
    CHECK_CODE(rs[1].code, CS_RPC_CANCELLED);
    int calls = atomic_load(&s->echo.calls_started);
    CHECK(wait_counter(&s->echo.calls_finished, calls, 10.0));
    fprintf(stderr, "channel free: calls in flight cancelled\n");
}

/* 8 streams in flight at shutdown: 4 short ones end OK within the grace
 * period, 4 endless ones are cancelled when it runs out; the server thread
 * then exits, having finished every call it was handed. */
static void test_shutdown_in_flight(server_ctx *s) {
    enum { N = 8, SHORT = 40 };
    result rs[N];
    for (int i = 0; i < N; i++)
        start_echo(chan, &rs[i], STREAM, "tok", 3, i % 2 ? 1000000 : SHORT, 5, 0, NULL);
    /* Every stream is running on the server. */
    double t0 = now_s();
    for (int i = 0; i < N; i++)
        while (rs[i].n_msgs < 3 && !rs[i].done && now_s() - t0 < 10)
            uv_run(&cuv, UV_RUN_ONCE);
    for (int i = 0; i < N; i++)
        CHECK(rs[i].n_msgs >= 3 && !rs[i].done);

    s->grace_ms = 1000;
    double ts = now_s();
    CHECK_EQ(cs_rpc_loop_post(s->rl, do_shutdown, s), 0);
    wait_all(rs, N);
    CHECK(wait_counter(&s->stopped, 1, 10.0));
    pthread_join(s->thread, NULL);
    for (int i = 0; i < N; i++) {
        CHECK(rs[i].done);
        if (i % 2 == 0) {
            CHECK_CODE(rs[i].code, CS_RPC_OK);
            CHECK_EQ(rs[i].n_msgs, SHORT);
        } else {
            CHECK(rs[i].code != CS_RPC_OK);
        }
    }
    CHECK_EQ(atomic_load(&s->echo.calls_finished), atomic_load(&s->echo.calls_started));
    fprintf(stderr,
            "shutdown: %d streams ended (short: %s, endless: %s \"%s\"), server gone in %.3f s\n",
            N, cs_rpc_code_name(rs[0].code), cs_rpc_code_name(rs[1].code), rs[1].msg, now_s() - ts);

    /* A call to the server that is gone fails fast. */
    result r;
    cs_rpc_call_opts o = {.timeout_ms = 10000};
    start_echo(chan, &r, UNARY, "x", 1, 0, 0, 0, &o);
    wait_all(&r, 1);
    CHECK_CODE(r.code, CS_RPC_UNAVAILABLE);
    CHECK(r.t_end - r.t_start < 5.0);
}

/* The one status -> gRPC code map: client mistakes are never retried by the
 * router (INVALID_ARGUMENT), transport faults are (DATA_LOSS, UNAVAILABLE). */
static void test_code_of_status(void) {
    CHECK_EQ(cs_rpc_code_of_status(0), CS_RPC_OK);
    CHECK_EQ(cs_rpc_code_of_status(CS_EINVAL), CS_RPC_INVALID_ARGUMENT);
    CHECK_EQ(cs_rpc_code_of_status(CS_ERANGE), CS_RPC_INVALID_ARGUMENT);
    CHECK_EQ(cs_rpc_code_of_status(CS_ENOSPC), CS_RPC_RESOURCE_EXHAUSTED);
    CHECK_EQ(cs_rpc_code_of_status(CS_ENOMEM), CS_RPC_RESOURCE_EXHAUSTED);
    CHECK_EQ(cs_rpc_code_of_status(CS_ENOTSUP), CS_RPC_FAILED_PRECONDITION);
    CHECK_EQ(cs_rpc_code_of_status(CS_EEXIST), CS_RPC_ALREADY_EXISTS);
    CHECK_EQ(cs_rpc_code_of_status(CS_ETIMEDOUT), CS_RPC_DEADLINE_EXCEEDED);
    CHECK_EQ(cs_rpc_code_of_status(CS_ECANCELED), CS_RPC_CANCELLED);
    CHECK_EQ(cs_rpc_code_of_status(CS_EBADMSG), CS_RPC_DATA_LOSS);
    CHECK_EQ(cs_rpc_code_of_status(CS_ECONNRESET), CS_RPC_UNAVAILABLE);
    CHECK_EQ(cs_rpc_code_of_status(CS_EACCES), CS_RPC_PERMISSION_DENIED); /* a tenant not the key's */
    CHECK_EQ(cs_rpc_code_of_status(CS_EPERM), CS_RPC_INTERNAL);
}

int main(void) {
    alarm(120);
    test_code_of_status(); /* a hang fails the test rather than the CI job */
    server_ctx *s = calloc(1, sizeof *s);
    pthread_create(&s->thread, NULL, server_main, s);
    while (!atomic_load(&s->ready))
        usleep(1000);
    fprintf(stderr, "server on 127.0.0.1:%d\n", s->port);

    uv_loop_init(&cuv);
    CHECK_EQ(cs_rpc_loop_init(&cuv, &crl), 0);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", s->port);
    CHECK_EQ(cs_rpc_channel_init(crl, target, NULL, &chan), 0);

    test_unary();
    test_stream_10k();
    test_cancel_mid_stream(s);
    test_deadline(s);
    test_unknown_method();
    test_too_large();
    test_malformed();
    test_health(s);
    test_server_lifecycle(s);
    test_channel_free_in_flight(s);
    test_shutdown_in_flight(s);

    cs_rpc_channel_free(chan);
    cs_rpc_loop_close(crl);
    uv_run(&cuv, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&cuv), 0);
    free(s);
    if (failures) {
        fprintf(stderr, "test_rpc: %d failure(s)\n", failures);
        return 1;
    }
    fprintf(stderr, "test_rpc: all passed\n");
    return 0;
}
