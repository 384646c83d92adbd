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

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "chunkserve/config.h"
#include "chunkserve/engine.h"
#include "chunkserve/http.h"
#include "chunkserve/metrics.h"
#include "engine_metrics.h"
#include "live_req.h"
#include "spec_config.h"
#include "tenant_config.h"
#include "chunkserve/proc.h"
#include "chunkserve/rpc.h"
#include "chunkserve/rpc_health.h"
#include "chunkserve/secret.h"
#include "chunkserve/serve.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "wire.h"

/* Every worker option; a process's table lists the ones it uses. */
typedef struct {
    const char *host, *http_host, *model, *worker_id, *kv_host, *kv_advertise;
    const char *cluster_secret, *cluster_secret_file;
    int64_t port, http_port, kv_port;
    int64_t max_batched_tokens, max_num_seqs, max_partial_prefills, max_chunk_tokens, page_size,
        kv_cache_mib, threads;
    int64_t max_queue, grace_ms, lease_ms, kv_deadline_ms, kv_dead_ms, kv_renew_ms, kv_queue_mib;
    int64_t prefix_summary_ms;
    bool prefix_caching, kv_checksum, verbose, exact, kv_bf16;
    double step_time_target_ms;
    cs_rpc_limits rpc; /* the gRPC port's limits (cs_proc_rpc_config) */
    cs_rpc_tls tls;    /* TLS on the gRPC port (cs_proc_tls_config) */
    /* prefill: the decode workers it may send KV pages to (polled like the
     * router's pool), and TLS for those polls */
    const char *decode_workers, *decode_dns;
    int64_t dns_refresh_ms, status_interval_ms;
    cs_rpc_tls worker_tls;
    cs_spec_opts spec;      /* decode: speculative decoding (api/spec_config.h) */
    cs_tenant_opts tenants; /* the tenants' shares (api/tenant_config.h) */
} cs_worker_opts;

/* The options both workers have (worker_config.c; offsets in
 * cs_worker_opts). A worker's table is these, the gRPC port's limits and
 * TLS (chunkserve/proc.h), then its role's (cs_worker_main joins them). */
extern const cs_config_entry cs_worker_config[];
extern const size_t cs_worker_config_n;

typedef struct cs_worker cs_worker;
typedef struct cs_worker_call cs_worker_call;

/* A registered Worker method: its handler runs only for callers with the
 * cluster's token (worker.c). */
typedef struct {
    cs_worker *w;
    cs_rpc_handler fn;
} cs_worker_method;
#define CS_WORKER_MAX_METHODS 8

/* What a role adds to the skeleton. Hooks run on the loop thread. */
typedef struct {
    const char *name; /* "prefill", "decode": logs, default worker id */
    Chunkserve__V1__WorkerRole role;
    const cs_config_entry *config; /* the role's own options (offsets in cs_worker_opts) */
    size_t n_config;
    /* the defaults the role gives the shared options (the port, the step
     * budget, the chunking) */
    const cs_config_default *config_defaults;
    size_t n_config_defaults;
    bool speculates;     /* takes the speculative-decoding options (api/spec_config.h) */
    const char *summary; /* first line of --help */
    size_t state_size;   /* the role's state: w->role_data, zeroed, owned by the shell */
    size_t call_size;    /* the role's request struct, which begins with a cs_worker_call */
    /* After the engine and the serving loop exist, before the RPC server
     * starts: create the KV transport end and register the role's RPC
     * method (cs_worker_add_method). Returns 0 or a CS_E* code. */
    int (*start)(cs_worker *w);
    /* The role's metrics table: registered right after start, into
     * w->role_data as the owner struct. */
    const cs_metric_def *metrics_table;
    size_t n_metrics_table;
    bool token_metrics; /* exports time to first token and between tokens (w->tok) */
    /* The cluster secret was reloaded (w->secret): hand it to the KV
     * transport end. */
    void (*secret_changed)(cs_worker *w);
    /* Fills the role's status fields (kv_endpoint, ...). */
    void (*status)(cs_worker *w, Chunkserve__V1__WorkerStatus *st);
    /* Before each /metrics render. */
    void (*metrics)(cs_worker *w);
    /* The event drain, after cs_live_req_post_locked: forwards what the engine
     * and the transport produced to the call, and answers it once the
     * outcome is known (with q->end_code / q->end_msg when the shell
     * cancelled it). Posts coalesce, and a drain may find nothing new: it
     * must be idempotent. */
    void (*drain)(cs_worker_call *q);
    /* Stops the request wherever it is (engine, transport); its final
     * events then drain as usual. */
    void (*cancel)(cs_worker_call *q);
    /* The RPC server is gone: stop the KV transport (its callbacks run
     * before this returns) and, if the data path needs that order, the
     * engine loop first (set w->sv to NULL then). The decode role stops the
     * transport first (it writes into pages the engine would free); the
     * prefill role the engine first (its final events abort transfers). */
    void (*stop)(cs_worker *w);
    /* The last reference to a request went (its life's mutex is gone): free
     * what the role added (optional; the shell frees the struct). */
    void (*call_free)(cs_worker_call *q);
} cs_worker_role;

/* A request as the shell sees it: the first member of the role's request
 * struct, itself beginning with its life (api/live_req.h: on w->live,
 * references, the event drain posted to the loop, the release). The shell
 * admits it (cs_worker_admit), drains its events on the loop thread
 * (role->drain after cs_live_req_post_locked), counts, cancels and ends the
 * open ones (Worker/Cancel, the client's cancel, the end of the grace
 * period) and frees it on the loop thread when its last reference goes.
 * References: the RPC's (until answered: cs_worker_call_finish/reply), the
 * engine's (cs_worker_call_submit; the role drops it after posting the
 * final event), the transport's (the role takes and drops it), a posted
 * drain's. */
struct cs_worker_call {
    cs_live_req life; /* first: w->live's entries are these */
    cs_worker *w;
    cs_rpc_call *call;        /* NULL once answered */
    uint64_t id, transfer_id; /* the engine's request id; the router's transfer id */
    char request_id[CS_WIRE_MAX_REQUEST_ID + 1];
    double t_start;
    int end_code;        /* set by the shell before role->cancel: how the call is to end */
    const char *end_msg; /* (0, NULL: the request's own outcome) */
    bool fault_armed;    /* an allocation failure is armed for this call's life (fault.h) */
};

static inline cs_worker_call *cs_worker_call_of(cs_live_req *l) {
    return (cs_worker_call *)l;
}

/* The skeleton's state, shared with the role. */
struct cs_worker {
    const cs_worker_role *role;
    cs_worker_opts o;
    char worker_id[128];
    uint64_t instance_id; /* random per process start */
    cs_secret secret;     /* --cluster-secret: worker RPCs and the KV link prove it (the
                             shell reloads it from its file: loop thread) */
    cs_worker_method methods[CS_WORKER_MAX_METHODS];
    int n_methods;
    cs_model *model;
    cs_wire_model wm;
    cs_engine *engine;
    cs_spec_draft draft; /* --speculative draft:PATH: its model and engine */
    cs_serve *sv;
    cs_proc *proc;       /* the process shell (loop, RPC server, metrics, drain) */
    cs_rpc_loop *rl;     /* cs_proc_rpc_loop(proc): roles post to the loop with it */
    cs_metrics *metrics; /* cs_proc_metrics(proc) */
    bool stopping;       /* draining or shutting down: no new call is admitted */
    void *role_data;     /* role->state_size bytes */
    cs_live_list live;   /* live requests (cs_worker_call), newest first; live.n is the
                            --max-queue count */
    uint64_t next_id;
    /* the engine's metrics (api/engine_metrics.h) and the worker's own (worker.c) */
    cs_engine_metrics em;
    cs_token_metrics tok; /* roles with token_metrics observe them */
    cs_metric *m_unauthenticated;
};

/* Parses the role's table, loads the model, runs until SIGTERM/SIGINT, shuts
 * down in order. The process's exit status: 0 after a clean shutdown, 1 on
 * a start-up error (printed), 2 on bad options. */
int cs_worker_main(int argc, char **argv, const cs_worker_role *role);

/* For role start hooks. */
int cs_worker_add_method(cs_worker *w, const char *method, enum cs_rpc_method_kind kind,
                         const ProtobufCMessageDescriptor *desc, cs_rpc_handler fn);

/* --- requests (worker/call.c; loop thread unless said otherwise) --- */

/* Sets up w->live (after w->rl): its drains run role->drain, its releases
 * role->call_free. */
void cs_worker_calls_init(cs_worker *w);

/* Admits a Decode/Prefill call: refuses it while draining (UNAVAILABLE),
 * beyond --max-queue (RESOURCE_EXHAUSTED) or when its prompt is bad
 * (INVALID_ARGUMENT: token ids against the vocabulary, the context and the
 * pool, num_prompt_tokens in [1, n], the sampling params); otherwise
 * returns a zeroed request of role->call_size bytes on w->live holding the
 * RPC's reference, with r filled (prompt borrowed from ids, cache_salt and
 * tenant borrowed, r->id set).
 * NULL when the call was answered. */
cs_worker_call *cs_worker_admit(cs_worker *w, cs_rpc_call *c, const int32_t *ids, size_t n,
                                int32_t num_prompt, const Chunkserve__V1__SamplingParams *sampling,
                                uint64_t transfer_id, const char *request_id,
                                const char *cache_salt, const char *tenant, cs_request *r);
/* Hands r to the engine (on_event gets q) with the engine's reference and
 * watches for the client's cancel. Otherwise the call is answered
 * UNAVAILABLE; returns the error. */
int cs_worker_call_submit(cs_worker_call *q, cs_request *r, cs_serve_cb on_event);
/* Answers the RPC (once; later calls do nothing) and drops its reference. */
void cs_worker_call_finish(cs_worker_call *q, int code, const char *msg);
void cs_worker_call_reply(cs_worker_call *q, const ProtobufCMessage *msg);
/* The KV fields of a status: the payload the role's transport end speaks
 * (enum cs_kvx_payload), the pool's dtype and layout fingerprint (the router
 * pairs a prefill and a decode worker only when both match). */
void cs_worker_kv_status(cs_worker *w, int payload, Chunkserve__V1__WorkerStatus *st);
/* A KV payload (CS_KVX_PAYLOAD_*) as the proto's KvTransport (UNSPECIFIED
 * when it has none), and a KvTransport's name ("tcp", "nccl"; "unknown"). */
Chunkserve__V1__KvTransport cs_worker_kv_transport(int payload);
const char *cs_worker_kv_transport_name(Chunkserve__V1__KvTransport t);
/* Splits "host:port" (IPv6 as [addr]:port) into host (NUL-terminated) and port. */
int cs_worker_split_endpoint(const char *ep, char *host, size_t host_len, int *port);

#endif
