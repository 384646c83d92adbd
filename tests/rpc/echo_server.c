/* echo_server.c: chunkserve.v1.Echo (and grpc.health.v1.Health, reporting
 * "" and "chunkserve.v1.Echo" SERVING) as a process, for process-level tests
 * with real gRPC clients and for the RPC layer's benchmark. Prints the bound
 * port on stdout ("port N\n"), serves until SIGTERM or SIGINT, then shuts
 * down with a grace period and exits 0. Not a product binary.
 *
 *   chunkserve-echo-server [--addr 127.0.0.1:0] [--max-recv-bytes N] [--grace-ms N] */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "chunkserve/error.h"
#include "chunkserve/rpc.h"
#include "chunkserve/rpc_health.h"
#include "echo_service.h"

typedef struct {
    cs_rpc_loop *rl;
    cs_rpc_server *srv;
    cs_rpc_health *health;
    uv_signal_t sigterm, sigint;
    int32_t grace_ms;
    int stopping;
} app;

static void on_server_done(void *data) {
    app *a = data;
    cs_rpc_loop_close(a->rl);
}

static void on_signal(uv_signal_t *h, int signum) {
    app *a = h->data;
    if (a->stopping) return;
    a->stopping = 1;
    fprintf(stderr, "echo-server: signal %d, shutting down\n", signum);
    uv_close((uv_handle_t *)&a->sigterm, NULL);
    uv_close((uv_handle_t *)&a->sigint, NULL);
    cs_rpc_health_shutdown(a->health);
    cs_rpc_server_shutdown(a->srv, a->grace_ms, on_server_done, a);
}

int main(int argc, char **argv) {
    const char *addr = "127.0.0.1:0";
    cs_rpc_server_opts o = {0};
    app a = {.grace_ms = 1000};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--addr") == 0)
            addr = argv[i + 1];
        else if (strcmp(argv[i], "--max-recv-bytes") == 0)
            o.max_recv_bytes = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--grace-ms") == 0)
            a.grace_ms = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--max-streams") == 0)
            o.lim.max_streams = atoll(argv[i + 1]);
        else if (strcmp(argv[i], "--idle-ms") == 0)
            o.lim.idle_ms = atoll(argv[i + 1]);
        else if (strcmp(argv[i], "--age-ms") == 0)
            o.lim.age_ms = atoll(argv[i + 1]);
        else if (strcmp(argv[i], "--age-grace-ms") == 0)
            o.lim.age_grace_ms = atoll(argv[i + 1]);
        else {
            fprintf(stderr,
                    "usage: %s [--addr HOST:PORT] [--max-recv-bytes N] [--grace-ms N] "
                    "[--max-streams N] [--idle-ms N] [--age-ms N] [--age-grace-ms N]\n",
                    argv[0]);
            return 2;
        }
    }
    o.addr = addr;
    uv_loop_t uv;
    uv_loop_init(&uv);
    cs_echo_service echo = {.uv = &uv};
    int port = 0, rc;
    if ((rc = cs_rpc_loop_init(&uv, &a.rl)) != 0 ||
        (rc = cs_rpc_server_init(a.rl, &o, &a.srv)) != 0 ||
        (rc = cs_echo_register(a.srv, &echo)) != 0 ||
        (rc = cs_rpc_health_init(a.srv, &a.health)) != 0 ||
        (rc = cs_rpc_server_start(a.srv, &port)) != 0) {
        fprintf(stderr, "echo-server: %s: %s\n", cs_strerror(rc), cs_last_error());
        return 1;
    }
    cs_rpc_health_set(a.health, "", CS_RPC_SERVING_SERVING);
    cs_rpc_health_set(a.health, "chunkserve.v1.Echo", CS_RPC_SERVING_SERVING);
    uv_signal_init(&uv, &a.sigterm);
    uv_signal_init(&uv, &a.sigint);
    a.sigterm.data = a.sigint.data = &a;
    uv_signal_start(&a.sigterm, on_signal, SIGTERM);
    uv_signal_start(&a.sigint, on_signal, SIGINT);
    printf("port %d\n", port);
    fflush(stdout);
    uv_run(&uv, UV_RUN_DEFAULT);
    cs_rpc_health_free(a.health);
    rc = uv_loop_close(&uv);
    fprintf(stderr, "echo-server: stopped (%d calls, %d cancelled)\n",
            atomic_load(&echo.calls_started), atomic_load(&echo.cancels_seen));
    return rc == 0 ? 0 : 1;
}
