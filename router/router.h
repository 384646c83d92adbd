/* router.h: `chunkserve-router`, the process clients talk to: the public
 * chunkserve.v1.Generation service and grpc.health.v1 on the RPC layer, and
 * the client of the workers' chunkserve.v1.Worker service (architecture.md:
 * request flow, failure contract).
 * It validates and tokenizes requests itself (it holds the model's
 * vocabulary, not its weights), admits or queues them, places them on decode
 * and prefill workers, relays their tokens, retries and migrates on worker
 * failure. /metrics, /healthz, /readyz on a small HTTP port; the process
 * shell (chunkserve/proc.h) runs it.
 * Not here: the option table and flag parsing (main.c), the pools (pool.h),
 * OpenAI-style HTTP, TLS. */
#ifndef CS_ROUTER_H
#define CS_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "chunkserve/model.h"
#include "chunkserve/rpc.h"
#include "openai.h"
#include "slo_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Filled from main.c's option table (integers are int64_t there). */
typedef struct {
    const char *host;      /* gRPC address to bind */
    int64_t port;          /* 0 = any free port */
    const char *http_host; /* NULL = host */
    int64_t http_port;     /* 0 = any free port */
    const char *model;     /* path; its basename is accepted as a model name */
    const char *prefill_workers, *decode_workers; /* "h:p,h:p" or NULL */
    const char *prefill_dns, *decode_dns;         /* "name:port[,...]" or NULL */
    int64_t dns_refresh_ms;
    int64_t status_interval_ms;
    int64_t local_prefill_threshold; /* contexts (less their predicted cached tokens) shorter than
                                        this prefill on the decode worker (longer ones too when
                                        only it is predicted to meet their TTFT bound) */
    bool prefix_routing;             /* place by predicted cached prefix too (router/prefix.h) */
    int64_t prefix_balance_seqs;     /* decode: load slack a cached prefix may cost */
    int64_t prefix_balance_tokens;   /* prefill: queued-token slack a cached prefix may cost */
    int64_t prefix_ttl_ms;           /* a recorded page counts this long */
    int64_t prefix_index_pages;      /* page hashes remembered per worker */
    int64_t max_inflight;            /* requests placed on workers at once */
    int64_t max_queue;               /* requests waiting beyond that; more: RESOURCE_EXHAUSTED */
    int64_t queue_timeout_ms;        /* longest wait for a slot or for KV room */
    int64_t no_worker_wait_ms;       /* longest wait for any usable decode worker */
    int64_t max_retries;             /* failed attempts before UNAVAILABLE */
    int64_t lease_ms;                /* DecodeRequest.lease_ms */
    int64_t request_timeout_ms;      /* deadline when the client sets none */
    int64_t grace_ms;                /* on SIGTERM/SIGINT: time streams get to finish */
    bool ready_without_workers;      /* /readyz ignores the decode pool */
    int64_t fault_migrate_every;     /* fault injection: migrate after every Nth message */
    const char *cluster_secret, *cluster_secret_file; /* worker RPCs carry its token */
    const char *log_level;
    bool verbose;
    cs_openai_config openai; /* the public HTTP API and the API keys */
    cs_rpc_limits rpc;       /* the gRPC port's limits (cs_proc_rpc_config) */
    cs_rpc_tls tls;          /* TLS on the gRPC port (cs_proc_tls_config) */
    cs_rpc_tls worker_tls;   /* TLS to the workers: CA, client identity, server name */
    cs_slo_opts slo;         /* the TTFT bound by priority (api/slo_config.h; parsed by main) */
    double autoscale_window_s;   /* the demand rates' window (demand.h) */
    double autoscale_utilization; /* the share of a replica's capacity the signal allows */
    double autoscale_drain_s;     /* a backlog is to be served within this */
} cs_router_opts;

/* Serves until SIGTERM or SIGINT with m (a vocabulary-only load is enough;
 * it must outlive the call), shuts down gracefully and frees everything it
 * made. Prints "listening on HOST:PORT" and "http listening on HOST:PORT" on
 * stdout once ready. Returns 0 after a clean shutdown, or a CS_E* code
 * (cs_last_error() says why) when it cannot start. */
int cs_router_run(const cs_model *m, const cs_router_opts *o);

/* The router's metrics table as JSON on f (a FILE *): --metrics-json. */
void cs_router_print_metrics_json(void *f);

#ifdef __cplusplus
}
#endif
#endif
