/* chunkserve/proc.h: the one process shell every serving process runs in
 * (chunkserve-router, `chunkserve serve`, chunkserve-prefill,
 * chunkserve-decode), with role hooks (nginx's process cycle; the upstream
 * hooks stay apart from the role's own logic).
 *
 * The shell owns: the libuv loop, the RPC loop and server (with
 * grpc.health.v1), the metrics registry with chunkserve:draining, the ops
 * HTTP port (/metrics, /healthz, /readyz), SIGTERM/SIGINT, the drain and the
 * ordered teardown, and keeping credentials current: the RPC server's TLS
 * files (re-read by gRPC) and the cluster secret's file (re-read here, both
 * every tls.reload_s seconds). The role owns its RPC methods, its metrics
 * and its work.
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

#include "chunkserve/config.h"
#include "chunkserve/rpc.h"
#include "chunkserve/secret.h"

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
    /* The cluster secret was re-read from its file and changed (the new keys
     * are in the role's cs_secret, cs_proc_opts.secret): hand them to what
     * copied the old ones (a KV transport). May be NULL. */
    void (*secret_changed)(cs_proc *p, void *role);
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

/* The RPC server's limits as options of a process: one set of flags, env
 * variables and Helm values for every process (offsets in cs_rpc_limits:
 * a process joins it at its field, chunkserve/config.h). The keepalive
 * defaults are a client-facing port's (60 s, 20 s); workers, whose clients
 * are routers, change them. */
extern const cs_config_entry cs_proc_rpc_config[];
extern const size_t cs_proc_rpc_config_n;

/* TLS on the process's gRPC port (offsets in cs_rpc_tls). */
extern const cs_config_entry cs_proc_tls_config[];
extern const size_t cs_proc_tls_config_n;

typedef struct {
    const char *host;       /* gRPC bind address */
    int port;               /* 0 = any free port */
    const char *http_host;  /* ops HTTP bind address; NULL = host */
    int http_port;          /* 0 = any free port */
    int64_t grace_ms;       /* the drain's longest wait for open calls */
    int32_t max_recv_bytes; /* largest RPC request; 0 = the RPC layer's default (4 MiB) */
    cs_rpc_limits rpc;      /* cs_proc_rpc_config */
    cs_rpc_tls tls;         /* cs_proc_tls_config */
    /* The cluster secret the role loaded (NULL: the process has none) and
     * the file it came from (NULL/"": a value, never re-read). The shell
     * re-reads the file on the loop thread every tls.reload_s seconds (0:
     * 10, as gRPC's TLS watcher) and
     * exports chunkserve:cluster_secret_key_id and _keys. */
    cs_secret *secret;
    const char *secret_file;
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
