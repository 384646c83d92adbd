/* chunkserve/rpc_health.h: the standard gRPC health service
 * (grpc.health.v1.Health: Check and Watch) on a cs_rpc_server, so Kubernetes'
 * gRPC probes, grpc_health_probe and the router can ask any chunkserve
 * process whether it serves. Statuses are kept per service name; "" is the
 * whole server. Same thread rules as chunkserve/rpc.h: loop thread only.
 * Not here: HTTP /healthz and /readyz (they belong with /metrics). */
#ifndef CHUNKSERVE_RPC_HEALTH_H
#define CHUNKSERVE_RPC_HEALTH_H

#include "chunkserve/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The values of grpc.health.v1.HealthCheckResponse.ServingStatus. */
enum cs_rpc_serving {
    CS_RPC_SERVING_UNKNOWN = 0,
    CS_RPC_SERVING_SERVING = 1,
    CS_RPC_SERVING_NOT_SERVING = 2,
    CS_RPC_SERVING_SERVICE_UNKNOWN = 3, /* Watch only: no such service (yet) */
};

typedef struct cs_rpc_health cs_rpc_health;

/* Registers /grpc.health.v1.Health/Check and /Watch on s (before start).
 * The server ("") starts NOT_SERVING: set it SERVING once ready. Check on
 * a service never set answers NOT_FOUND; Watch sends SERVICE_UNKNOWN and
 * waits. CS_ENOMEM, or add_method's errors. Free with cs_rpc_health_free
 * after the server's shutdown has completed. */
int cs_rpc_health_init(cs_rpc_server *s, cs_rpc_health **out);

/* Sets a service's status (name copied) and sends it to its watchers when it
 * changed. Ignored after cs_rpc_health_shutdown. CS_EINVAL, CS_ENOMEM. */
int cs_rpc_health_set(cs_rpc_health *h, const char *service, enum cs_rpc_serving status);

/* For graceful shutdown, before cs_rpc_server_shutdown: every service
 * becomes NOT_SERVING, watchers are told, then their streams end (status
 * UNAVAILABLE) so they do not hold the grace period open. Later Check and
 * Watch calls see NOT_SERVING. */
void cs_rpc_health_shutdown(cs_rpc_health *h);

/* NULL is a no-op. Only once the server is gone (no health call alive). */
void cs_rpc_health_free(cs_rpc_health *h);

#ifdef __cplusplus
}
#endif
#endif
