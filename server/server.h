/* server.h: `chunkserve serve`: one process, one engine, the
 * chunkserve.v1.Generation service and grpc.health.v1.Health on the RPC
 * layer, in the process shell (chunkserve/proc.h: ops HTTP, drain). The
 * colocated baseline the disaggregated cluster is compared with.
 * Not here: several models, TLS. */
#ifndef CHUNKSERVE_SERVER_H
#define CHUNKSERVE_SERVER_H

#include <stdint.h>

#include "chunkserve/engine.h"
#include "chunkserve/model.h"
#include "chunkserve/rpc.h"
#include "chunkserve/sched.h"
#include "openai.h"
#include "slo_config.h"
#include "spec_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *host;       /* address to bind, e.g. "127.0.0.1" or "0.0.0.0" */
    int port;               /* 0 = any free port */
    const char *http_host;  /* ops HTTP (/metrics, /healthz, /readyz); NULL = host */
    int http_port;          /* 0 = any free port */
    const char *model_path; /* its basename is accepted as a model name too */
    cs_engine_params engine;
    cs_sched_params sched;
    cs_spec_opts spec;       /* speculation (applied to sched already): a draft model's path */
    int32_t max_queue; /* waiting requests beyond this are refused (RESOURCE_EXHAUSTED) */
    int32_t grace_ms;  /* on SIGTERM/SIGINT: time streams get before they are cancelled */
    cs_openai_config openai; /* the public HTTP API and the API keys */
    cs_rpc_limits rpc;       /* the gRPC port's limits */
    cs_rpc_tls tls;          /* TLS on the gRPC port */
    cs_slo_opts slo;         /* the TTFT bound by priority (parsed) */
} cs_server_opts;

/* Builds the engine on m (which must outlive the call), serves until SIGTERM
 * or SIGINT, shuts down gracefully and frees everything it made. Prints
 * "listening on HOST:PORT" and "http listening on HOST:PORT" on stdout once
 * ready. Returns 0 after a clean
 * shutdown, or a CS_E* code (cs_last_error() says why) when it cannot start. */
int cs_server_run(const cs_model *m, const cs_server_opts *o);

#ifdef __cplusplus
}
#endif
#endif
