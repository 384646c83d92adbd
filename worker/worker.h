/* worker.h: the process skeleton both workers share (chunkserve-prefill,
 * chunkserve-decode): configuration, the engine and its serving loop, the
 * RPC server with chunkserve.v1.Worker (GetStatus, Cancel) and health, the
 * HTTP port (/metrics, /healthz, /readyz), signals and the ordered shutdown,
 * through the process shell (chunkserve/proc.h). A role
 * (prefill_worker/prefill.c, decode_worker/decode.c) plugs in through
 * cs_worker_role: its RPC method, its KV transport end and its metrics.
 *
 * Threads: the libuv loop thread runs RPC handlers, HTTP and role hooks;
 * the engine thread (cs_serve) runs steps and the roles' event callbacks;
 * the KV transport has its own I/O thread. Roles hand work to the loop
 * thread with cs_rpc_loop_post.
 * Not here: the Generation service (the router serves clients). */
#ifndef CHUNKSERVE_WORKER_H
#define CHUNKSERVE_WORKER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "chunkserve/config.h"
#include "chunkserve/engine.h"
#include "chunkserve/http.h"
#include "chunkserve/metrics.h"
#include "chunkserve/proc.h"
#include "chunkserve/rpc.h"
#include "chunkserve/rpc_health.h"
#include "chunkserve/serve.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "wire.h"

/* Every worker option; a process's table lists the ones it uses. */
typedef struct {
    const char *host, *http_host, *model, *worker_id, *kv_host, *kv_advertise;
    int64_t port, http_port, kv_port;
    int64_t max_batched_tokens, max_num_seqs, max_partial_prefills, max_chunk_tokens, page_size,
        kv_cache_mib, threads;
    int64_t max_queue, grace_ms, lease_ms, kv_deadline_ms, kv_dead_ms;
    bool prefix_caching, kv_checksum, verbose;
} cs_worker_opts;

/* The entries both workers have (spliced into each process's table). */
#define CS_WORKER_CONFIG_COMMON(default_port, default_budget, default_partial, default_chunk)      \
    {"model",                                                                                      \
     CS_CONFIG_STR,                                                                                \
     offsetof(cs_worker_opts, model),                                                              \
     NULL,                                                                                         \
     "model: a .gguf file or a Hugging Face directory (required)",                                 \
     0,                                                                                            \
     0},                                                                                           \
        {"host",                                                                                   \
         CS_CONFIG_STR,                                                                            \
         offsetof(cs_worker_opts, host),                                                           \
         "127.0.0.1",                                                                              \
         "address of the gRPC port (0.0.0.0 = all interfaces)",                                    \
         0,                                                                                        \
         0},                                                                                       \
        {"port",                                                                                   \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, port),                                                           \
         default_port,                                                                             \
         "gRPC port (chunkserve.v1.Worker + health); 0 = any free port",                           \
         0,                                                                                        \
         65535},                                                                                   \
        {"http-host",                                                                              \
         CS_CONFIG_STR,                                                                            \
         offsetof(cs_worker_opts, http_host),                                                      \
         "127.0.0.1",                                                                              \
         "address of the HTTP port (/metrics, /healthz, /readyz)",                                 \
         0,                                                                                        \
         0},                                                                                       \
        {"http-port",                                                                              \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, http_port),                                                      \
         "0",                                                                                      \
         "HTTP port; 0 = any free port",                                                           \
         0,                                                                                        \
         65535},                                                                                   \
        {"worker-id",                                                                              \
         CS_CONFIG_STR,                                                                            \
         offsetof(cs_worker_opts, worker_id),                                                      \
         NULL,                                                                                     \
         "stable name in logs and status (default ROLE-HOST:PORT)",                                \
         0,                                                                                        \
         0},                                                                                       \
        {"max-batched-tokens",                                                                     \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, max_batched_tokens),                                             \
         default_budget,                                                                           \
         "step token budget (decodes first, prompt chunks fill the rest); 0 = unlimited",          \
         0,                                                                                        \
         1 << 30},                                                                                 \
        {"max-num-seqs",                                                                           \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, max_num_seqs),                                                   \
         "256",                                                                                    \
         "running sequences at most",                                                              \
         1,                                                                                        \
         1 << 20},                                                                                 \
        {"max-partial-prefills",                                                                   \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, max_partial_prefills),                                           \
         default_partial,                                                                          \
         "prompts part-way through prefill at once (1 = one at a time, in arrival order)",         \
         1,                                                                                        \
         1 << 20},                                                                                 \
        {"max-chunk-tokens",                                                                       \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, max_chunk_tokens),                                               \
         default_chunk,                                                                            \
         "one prompt's chunk per step at most; 0 = the budget (smaller: pages stream while the "   \
         "next "                                                                                   \
         "chunk computes)",                                                                        \
         0,                                                                                        \
         1 << 30},                                                                                 \
        {"page-size", CS_CONFIG_INT,        offsetof(cs_worker_opts, page_size),                   \
         "16",        "tokens per KV page", 1,                                                     \
         4096},                                                                                    \
        {"kv-cache-mib",                                                                           \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, kv_cache_mib),                                                   \
         "1024",                                                                                   \
         "KV-cache pool size in MiB",                                                              \
         1,                                                                                        \
         1 << 24},                                                                                 \
        {"threads",                                                                                \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, threads),                                                        \
         "0",                                                                                      \
         "CPU threads for the engine; 0 = one per core",                                           \
         0,                                                                                        \
         4096},                                                                                    \
        {"prefix-caching",                                                                         \
         CS_CONFIG_BOOL,                                                                           \
         offsetof(cs_worker_opts, prefix_caching),                                                 \
         "true",                                                                                   \
         "reuse KV pages of prompts with the same prefix",                                         \
         0,                                                                                        \
         0},                                                                                       \
        {"max-queue",                                                                              \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, max_queue),                                                      \
         "1024",                                                                                   \
         "requests held at most; more are refused with RESOURCE_EXHAUSTED",                        \
         1,                                                                                        \
         1 << 24},                                                                                 \
        {"grace-ms",                                                                               \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, grace_ms),                                                       \
         "5000",                                                                                   \
         "on SIGTERM/SIGINT: time calls get to finish before they are cancelled",                  \
         0,                                                                                        \
         3600000},                                                                                 \
        {"kv-dead-ms",                                                                             \
         CS_CONFIG_INT,                                                                            \
         offsetof(cs_worker_opts, kv_dead_ms),                                                     \
         "5000",                                                                                   \
         "KV channel: a peer silent this long (despite keepalives) is dead",                       \
         100,                                                                                      \
         3600000},                                                                                 \
        {"kv-checksum",                                                                            \
         CS_CONFIG_BOOL,                                                                           \
         offsetof(cs_worker_opts, kv_checksum),                                                    \
         "true",                                                                                   \
         "xxHash64 of every KV frame's payload",                                                   \
         0,                                                                                        \
         0},                                                                                       \
    {                                                                                              \
        "verbose", CS_CONFIG_BOOL, offsetof(cs_worker_opts, verbose), "false", "debug logging", 0, \
            0                                                                                      \
    }

typedef struct cs_worker cs_worker;

/* What a role adds to the skeleton. Hooks run on the loop thread. */
typedef struct {
    const char *name; /* "prefill", "decode": logs, default worker id */
    Chunkserve__V1__WorkerRole role;
    const cs_config_entry *config;
    size_t n_config;
    const char *summary; /* first line of --help */
    /* After the engine and the serving loop exist, before the RPC server
     * starts: create the KV transport end, register metrics and the role's
     * RPC method (cs_worker_add_method). Returns 0 or a CS_E* code. */
    int (*start)(cs_worker *w);
    /* The role's metrics table: registered right after start, into the
     * role's data (w->role_data, which start sets) as the owner struct. */
    const cs_metric_def *metrics_table;
    size_t n_metrics_table;
    /* Fills the role's status fields (kv_endpoint, ...). */
    void (*status)(cs_worker *w, Chunkserve__V1__WorkerStatus *st);
    /* Before each /metrics render. */
    void (*metrics)(cs_worker *w);
    /* Worker/Cancel: cancels what the role holds for transfer_id. */
    bool (*cancel)(cs_worker *w, uint64_t transfer_id);
    /* Calls of the role's method still open (the drain waits for 0). */
    int32_t (*n_calls)(cs_worker *w);
    /* Grace is over: end every call still open with UNAVAILABLE. */
    void (*cancel_all)(cs_worker *w);
    /* The RPC server is gone: stop the KV transport (its callbacks run
     * before this returns) and, if the data path needs that order, the
     * engine loop first (set w->sv to NULL then). The decode role stops the
     * transport first (it writes into pages the engine would free); the
     * prefill role the engine first (its final events abort transfers). */
    void (*stop)(cs_worker *w);
    /* After the engine loop stopped and the loop drained: free the role. */
    void (*free)(cs_worker *w);
} cs_worker_role;

/* The skeleton's state, shared with the role. */
struct cs_worker {
    const cs_worker_role *role;
    cs_worker_opts o;
    char worker_id[128];
    uint64_t instance_id; /* random per process start */
    cs_model *model;
    cs_wire_model wm;
    cs_engine *engine;
    cs_serve *sv;
    cs_proc *proc;       /* the process shell (loop, RPC server, metrics, drain) */
    cs_rpc_loop *rl;     /* cs_proc_rpc_loop(proc): roles post to the loop with it */
    cs_metrics *metrics; /* cs_proc_metrics(proc) */
    bool stopping;       /* draining or shutting down: the role takes no new call */
    void *role_data;
    /* the common metrics table (worker.c) */
    cs_metric *m_running, *m_waiting, *m_kv_usage, *m_kv_free, *m_kv_total, *m_preemptions,
        *m_prompt_tokens, *m_gen_tokens, *m_prefix_hits, *m_steps, *m_queued_prefill;
    cs_sched_stats last_stats; /* counters already exported */
};

/* Parses the role's table, loads the model, runs until SIGTERM/SIGINT, shuts
 * down in order. The process's exit status: 0 after a clean shutdown, 1 on
 * a start-up error (printed), 2 on bad options. */
int cs_worker_main(int argc, char **argv, const cs_worker_role *role);

/* For role start hooks. */
int cs_worker_add_method(cs_worker *w, const char *method, enum cs_rpc_method_kind kind,
                         const ProtobufCMessageDescriptor *desc, cs_rpc_handler fn);
/* A request's prompt from a Decode/Prefill message: checks token ids against
 * the vocabulary, the context and the pool, num_prompt_tokens in [1, n], and
 * the sampling params; fills r (prompt borrowed from ids). CS_EINVAL with a
 * message. */
int cs_worker_request(cs_worker *w, const int32_t *ids, size_t n, int32_t num_prompt,
                      const Chunkserve__V1__SamplingParams *sampling, cs_request *r);
/* The KV fields of a status: the payload the role's transport end speaks
 * (enum cs_kvx_payload), the pool's dtype and layout fingerprint (the router
 * pairs a prefill and a decode worker only when both match). */
void cs_worker_kv_status(cs_worker *w, int payload, Chunkserve__V1__WorkerStatus *st);
/* Splits "host:port" (IPv6 as [addr]:port) into host (NUL-terminated) and port. */
int cs_worker_split_endpoint(const char *ep, char *host, size_t host_len, int *port);

#endif
