/* bench_rpc_client.c: the RPC layer's C client against chunkserve-echo-server,
 * for bench/bench_rpc.py: messages/s one server-streaming call carries and
 * unary calls/s (a fixed number in flight). One JSON line on stdout. Not a
 * test: it asserts nothing about speed.
 *
 *   chunkserve-bench-rpc TARGET stream PAYLOAD_HEX N_MSGS
 *   chunkserve-bench-rpc TARGET unary  PAYLOAD_HEX N_CALLS IN_FLIGHT */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "chunkserve/rpc.h"
#include "chunkserve/v1/echo.pb-c.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static cs_rpc_channel *chan;
static uint8_t payload[4096];
static size_t payload_len;
static long n_msgs, n_done, n_started, n_total, n_bad;
static int last_code;

static void on_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c, (void)data;
    Chunkserve__V1__EchoResponse *m = chunkserve__v1__echo_response__unpack(NULL, len, buf);
    if (!m || m->payload.len != payload_len) n_bad++;
    if (m) chunkserve__v1__echo_response__free_unpacked(m, NULL);
    n_msgs++;
}

static int start(const char *method, int count);

static void on_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    (void)c, (void)data;
    if (code != CS_RPC_OK) fprintf(stderr, "call ended %s: %s\n", cs_rpc_code_name(code), message);
    last_code = code;
    n_done++;
    if (n_started < n_total && code == CS_RPC_OK) start("/chunkserve.v1.Echo/Unary", 0);
}

static int start(const char *method, int count) {
    Chunkserve__V1__EchoRequest req = CHUNKSERVE__V1__ECHO_REQUEST__INIT;
    req.payload.data = payload;
    req.payload.len = payload_len;
    req.count = count;
    cs_rpc_call_opts o = {.timeout_ms = 120000, .wait_for_ready = true};
    n_started++;
    return cs_rpc_channel_call_msg(chan, method, &req.base, &o, on_msg, on_done, NULL, NULL);
}

int main(int argc, char **argv) {
    if (argc < 5 || (strcmp(argv[2], "stream") && strcmp(argv[2], "unary"))) {
        fprintf(stderr, "usage: %s TARGET stream|unary PAYLOAD_HEX N [IN_FLIGHT]\n", argv[0]);
        return 2;
    }
    const char *hex = argv[3];
    for (payload_len = 0;
         hex[2 * payload_len] && hex[2 * payload_len + 1] && payload_len < sizeof payload;
         payload_len++) {
        unsigned v;
        sscanf(hex + 2 * payload_len, "%2x", &v);
        payload[payload_len] = (uint8_t)v;
    }
    long n = atol(argv[4]);
    int in_flight = argc > 5 ? atoi(argv[5]) : 1;
    uv_loop_t uv;
    cs_rpc_loop *rl;
    uv_loop_init(&uv);
    if (cs_rpc_loop_init(&uv, &rl) != 0 || cs_rpc_channel_init(rl, argv[1], NULL, &chan) != 0) {
        fprintf(stderr, "setup: %s\n", cs_last_error());
        return 1;
    }
    /* Warm-up: connect. */
    n_total = 1;
    start("/chunkserve.v1.Echo/Unary", 0);
    while (n_done < 1)
        uv_run(&uv, UV_RUN_ONCE);
    n_msgs = n_done = n_started = 0;

    double t0 = now_s();
    long want;
    if (!strcmp(argv[2], "stream")) {
        n_total = 1;
        start("/chunkserve.v1.Echo/Stream", (int)n);
        want = 1;
    } else {
        n_total = n;
        for (int i = 0; i < in_flight && i < n; i++)
            start("/chunkserve.v1.Echo/Unary", 0);
        want = n;
    }
    while (n_done < want && !(last_code != CS_RPC_OK && n_done == n_started))
        uv_run(&uv, UV_RUN_ONCE);
    double dt = now_s() - t0;
    int rc = last_code == CS_RPC_OK && n_bad == 0 ? 0 : 1;
    if (!strcmp(argv[2], "stream"))
        printf("{\"mode\": \"stream\", \"messages\": %ld, \"seconds\": %.6f, \"per_s\": %.1f}\n",
               n_msgs, dt, n_msgs / dt);
    else
        printf("{\"mode\": \"unary\", \"calls\": %ld, \"in_flight\": %d, \"seconds\": %.6f, "
               "\"per_s\": %.1f}\n",
               n_done, in_flight, dt, n_done / dt);

    cs_rpc_channel_free(chan);
    cs_rpc_loop_close(rl);
    uv_run(&uv, UV_RUN_DEFAULT);
    uv_loop_close(&uv);
    return rc;
}
