/* echo_service.h: the chunkserve.v1.Echo service (proto/chunkserve/v1/echo.proto)
 * on the RPC layer, for the RPC tests, tests/rpc/echo_server and the layer's
 * benchmark. Not a product service. */
#ifndef CS_ECHO_SERVICE_H
#define CS_ECHO_SERVICE_H

#include <stdatomic.h>
#include <uv.h>

#include "chunkserve/rpc.h"

/* The service's state, owned by the caller; it must outlive the server. The
 * counters are written on the server's loop thread, readable from any. */
typedef struct {
    uv_loop_t *uv;             /* the server's loop (for timers) */
    atomic_int calls_started;  /* handler invocations */
    atomic_int calls_finished; /* cs_rpc_call_finish calls (every call must get one) */
    atomic_int cancels_seen;   /* on_cancel callbacks */
} cs_echo_service;

/* Registers /chunkserve.v1.Echo/Unary and /chunkserve.v1.Echo/Stream on s
 * (before start). svc->uv must be set and the counters zeroed. */
int cs_echo_register(cs_rpc_server *s, cs_echo_service *svc);

#endif
