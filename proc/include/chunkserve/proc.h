/* chunkserve/proc.h: the one process shell every serving process runs in
 * (chunkserve-router, `chunkserve serve`, chunkserve-prefill,
 * chunkserve-decode), with role hooks (nginx's process cycle; the upstream
 * hooks stay apart from the role's own logic).
 *
 * The shell owns: the libuv loop, the RPC loop and server (with
 * grpc.health.v1), the metrics registry with chunkserve:draining, the ops
 * HTTP port (/metrics, /healthz, /readyz), SIGTERM/SIGINT, the drain and the
 * ordered teardown. The role owns its RPC methods, its metrics and its work.
 *
 * Life (cs_proc_run):
 *   start    loop, RPC loop, RPC server, health, metrics; role->start
 *            (register methods and metrics); RPC server start; ops HTTP;
 *            health SERVING; signals. Prints "listening on HOST:PORT" and
 *            "http listening on HOST:PORT" on stdout.
 *   drain    SIGTERM or SIGINT: health NOT_SERVING, /readyz 503,
 *            chunkserve:draining 1, role->drain (the role refuses new work:
 *            UNAVAILABLE, so a router places it elsewhere). The RPC server
 *            keeps answering the role's other calls (a worker's GetStatus and
 *            Cancel: the router sees a draining process, not a dead one).
 *            When role->n_open reaches 0, or after grace_ms (then
 *            role->cancel_all ends the rest), the drain is over: logged
 *            "drained in S s (N calls ended by the grace period)".
 *   stop     the RPC server shuts down (a 3 s backstop for the calls just
 *            cancelled); once it is gone: role->stop (the role stops its
 *            threads and transports), the HTTP port and the RPC loop close;
 *            the loop runs until its last handle closed; role->free.
 *
 * Threads: every hook runs on the loop thread. Roles hand work from their own
 * threads to it with cs_rpc_loop_post (cs_proc_rpc_loop). */
#ifndef CHUNKSERVE_PROC_H
#define CHUNKSERVE_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_proc cs_proc;
struct uv_loop_s;
struct cs_rpc_loop;
struct cs_rpc_server;
struct cs_rpc_health;
struct cs_metrics;

typedef struct {
    const char *name;           /* "router", "serve", "prefill", "decode": logs */
    const char *health_service; /* the service health reports besides "" */
    /* After the loop, the RPC server and the metrics exist, before the
     * server starts: register the role's methods and metrics. 0 or a CS_E*
     * code (the start fails; stop and free still run). */
    int (*start)(cs_proc *p, void *role);
    /* The RPC server and the ops port listen (cs_proc_port is known), just
     * after "listening on" / "http listening on" are printed: the role's
     * start-up log line and any listening line of its own. May be NULL. */
    void (*started)(cs_proc *p, void *role);
    /* Before each /metrics render: update gauges. May be NULL. */
    void (*metrics)(cs_proc *p, void *role);
    /* /readyz beyond "not draining": false with why. NULL: ready. */
    bool (*ready)(cs_proc *p, void *role, char *why, size_t why_len);
    /* Calls or requests still open; the drain waits for 0. */
    int32_t (*n_open)(cs_proc *p, void *role);
    /* The drain begins: stop taking work (cs_proc_draining is already true).
     * May be NULL. */
    void (*drain)(cs_proc *p, void *role);
    /* The grace period is over: end everything still open (UNAVAILABLE). */
    void (*cancel_all)(cs_proc *p, void *role);
    /* The RPC server is gone (or never started): stop the role's threads,
     * timers and transports. Handles it closes finish before the loop ends. */
    void (*stop)(cs_proc *p, void *role);
    /* After the loop ended: free what the role made. May be NULL. */
    void (*free)(cs_proc *p, void *role);
} cs_proc_role;

/* The RPC server's limits as options of a process (cs_rpc_limits, field m
 * of options struct T): one set of flags, env variables and Helm values for
 * every process. Bounds: 0 keeps the RPC layer's default. */
#define CS_PROC_RPC_CONFIG(T, m, ka_default, ka_timeout_default)                                   \
    {"grpc-max-streams",                                                                           \
     CS_CONFIG_INT,                                                                                \
     offsetof(T, m.max_streams),                                                                   \
     "4096",                                                                                       \
     "gRPC: concurrent streams per connection (a client queues the rest)",                         \
     1,                                                                                            \
     1 << 20},                                                                                     \
        {"grpc-memory-mib",                                                                        \
         CS_CONFIG_INT,                                                                            \
         offsetof(T, m.memory_mib),                                                                \
         "512",                                                                                    \
         "gRPC: memory quota of the transport's buffers (full: smaller reads, new streams "        \
         "refused)",                                                                               \
         16,                                                                                       \
         1 << 20},                                                                                 \
        {"grpc-max-connection-idle-ms",                                                            \
         CS_CONFIG_INT,                                                                            \
         offsetof(T, m.idle_ms),                                                                   \
         "300000",                                                                                 \
         "gRPC: close a connection without calls after this long; -1 = never",                     \
         -1,                                                                                       \
         86400000},                                                                                \
        {"grpc-max-connection-age-ms",                                                             \
         CS_CONFIG_INT,                                                                            \
         offsetof(T, m.age_ms),                                                                    \
         "0",                                                                                      \
         "gRPC: send GOAWAY to a connection this old (clients reconnect, e.g. to rebalance); "     \
         "0 = never",                                                                              \
         0,                                                                                        \
         86400000},                                                                                \
        {"grpc-max-connection-age-grace-ms",                                                       \
         CS_CONFIG_INT,                                                                            \
         offsetof(T, m.age_grace_ms),                                                              \
         "60000",                                                                                  \
         "gRPC: after that GOAWAY, time the connection's calls get to finish",                     \
         1,                                                                                        \
         86400000},                                                                                \
        {"grpc-max-health-watches",                                                                \
         CS_CONFIG_INT,                                                                            \
         offsetof(T, m.max_watches),                                                               \
         "256",                                                                                    \
         "gRPC: grpc.health.v1 Health/Watch streams at once (more: RESOURCE_EXHAUSTED)",           \
         1,                                                                                        \
         1 << 20},                                                                                 \
        {"grpc-keepalive-ms",                                                                      \
         CS_CONFIG_INT,                                                                            \
         offsetof(T, m.keepalive_ms),                                                              \
         ka_default,                                                                               \
         "gRPC: ping a client with calls open after this long without a frame from it",            \
         1000,                                                                                     \
         86400000},                                                                                \
    {                                                                                              \
        "grpc-keepalive-timeout-ms", CS_CONFIG_INT, offsetof(T, m.keepalive_timeout_ms),           \
            ka_timeout_default,                                                                    \
            "gRPC: a ping unanswered this long closes the connection and cancels its calls (a "    \
            "partitioned or dead client's streams end and free their KV pages)",                   \
            1000, 86400000                                                                         \
    }

/* TLS on the process's gRPC port (cs_rpc_tls, field m of options struct T). */
#define CS_PROC_TLS_CONFIG(T, m)                                                                   \
    {"tls-cert-file",                                                                              \
     CS_CONFIG_STR,                                                                                \
     offsetof(T, m.cert_file),                                                                     \
     NULL,                                                                                         \
     "PEM certificate chain: the gRPC port speaks TLS (needs --tls-key-file)",                     \
     0,                                                                                            \
     0},                                                                                           \
        {"tls-key-file",                                                                           \
         CS_CONFIG_STR,                                                                            \
         offsetof(T, m.key_file),                                                                  \
         NULL,                                                                                     \
         "PEM private key of --tls-cert-file",                                                     \
         0,                                                                                        \
         0},                                                                                       \
    {                                                                                              \
        "tls-client-ca-file", CS_CONFIG_STR, offsetof(T, m.ca_file), NULL,                         \
            "PEM roots: gRPC clients must present a certificate they signed (mutual TLS)", 0, 0    \
    }

typedef struct {
    const char *host;       /* gRPC bind address */
    int port;               /* 0 = any free port */
    const char *http_host;  /* ops HTTP bind address; NULL = host */
    int http_port;          /* 0 = any free port */
    int64_t grace_ms;       /* the drain's longest wait for open calls */
    int32_t max_recv_bytes; /* largest RPC request; 0 = the RPC layer's default (4 MiB) */
    cs_rpc_limits rpc;      /* CS_PROC_RPC_CONFIG */
    cs_rpc_tls tls;         /* CS_PROC_TLS_CONFIG */
} cs_proc_opts;

/* Runs the process with role until SIGTERM/SIGINT and the drain end, then
 * tears down in reverse order. Returns 0 after a clean shutdown, or a CS_E*
 * code when it cannot start (cs_last_error() says why; role->stop and
 * role->free have run). */
int cs_proc_run(const cs_proc_opts *o, const cs_proc_role *role, void *role_data);

/* For the role's hooks (valid from role->start until role->free). */
struct uv_loop_s *cs_proc_uv(cs_proc *p);
struct cs_rpc_loop *cs_proc_rpc_loop(cs_proc *p);
struct cs_rpc_server *cs_proc_server(cs_proc *p);
struct cs_rpc_health *cs_proc_health(cs_proc *p);
struct cs_metrics *cs_proc_metrics(cs_proc *p);
/* True from the signal on. */
bool cs_proc_draining(const cs_proc *p);
/* The RPC server's port (after it started; 0 before). */
int cs_proc_port(const cs_proc *p);

#ifdef __cplusplus
}
#endif
#endif
