/* gen_call.h (api/): one Generate call, whatever door it came in by: the
 * gRPC method chunkserve.v1.Generation/Generate (cs_gen_call_grpc below) or
 * the OpenAI-compatible HTTP routes (openai/: one call per choice). The
 * router and `chunkserve serve` serve Generate against this interface only,
 * so both doors validate, admit, stream, cancel and end a request alike.
 * Loop thread only. A call is answered exactly once (cs_gen_call_finish),
 * after which its object is gone; a cancel callback never runs after that. */
#ifndef CHUNKSERVE_API_GEN_CALL_H
#define CHUNKSERVE_API_GEN_CALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/rpc.h"
#include "chunkserve/v1/generation.pb-c.h"

typedef struct cs_gen_call cs_gen_call;
typedef void (*cs_gen_cancel_fn)(cs_gen_call *c, void *arg);

typedef struct {
    /* One streamed message. 0, CS_ECANCELED (the call is dead: its cancel
     * callback has run or will), or CS_ENOMEM. */
    int (*send)(cs_gen_call *c, const Chunkserve__V1__GenerateResponse *m);
    /* The end: code is a gRPC status (CS_RPC_*), msg its message (NULL for
     * OK), field the request field it is about or NULL (cs_fail_field: the
     * gRPC door sends it as the chunkserve-field trailer, the OpenAI door
     * as the error's param). Frees the call. */
    void (*finish)(cs_gen_call *c, int code, const char *msg, const char *field);
    /* Bytes sent and not yet taken by the client (slow readers are capped). */
    size_t (*pending_bytes)(cs_gen_call *c);
    /* fn(c, arg) once if the client cancels, goes away or its deadline
     * passes before finish. Nonzero when the call is already dead (the
     * caller then cancels at once). */
    int (*on_cancel)(cs_gen_call *c, cs_gen_cancel_fn fn, void *arg);
    /* Milliseconds left before the client's deadline; INT64_MAX: none. */
    int64_t (*deadline_ms)(cs_gen_call *c);
} cs_gen_call_ops;

struct cs_gen_call {
    const cs_gen_call_ops *ops;
    const Chunkserve__V1__GenerateRequest *req; /* valid until finish */
    /* The tenant the caller's API key belongs to (api/auth.h), set by its
     * door; NULL without keys (the request's own tenant field is then
     * trusted). Alive as long as the process's keys. */
    const char *key_tenant;
    /* Set before finish by a refusal that should be retried later: the
     * gRPC door sends it as google.rpc.RetryInfo in grpc-status-details-bin,
     * the OpenAI door as Retry-After (seconds, rounded up). 0: none. */
    int64_t retry_after_ms;
    /* A later choice of one prompt of an OpenAI request (n > 1): it was
     * admitted with the first (no early refusal of its own; its siblings are
     * not work queued ahead of it in any sense the client can act on). The
     * prompts of a list are each refused on their own. */
    bool sibling;
};

static inline int cs_gen_call_send(cs_gen_call *c, const Chunkserve__V1__GenerateResponse *m) {
    return c->ops->send(c, m);
}
static inline void cs_gen_call_finish(cs_gen_call *c, int code, const char *msg) {
    c->ops->finish(c, code, msg, NULL);
}
/* A refusal about one request field (field "" or NULL: none). */
static inline void cs_gen_call_refuse(cs_gen_call *c, int code, const char *msg,
                                      const char *field) {
    c->ops->finish(c, code, msg, field && field[0] ? field : NULL);
}
/* RESOURCE_EXHAUSTED, to be retried after retry_ms (> 0). */
static inline void cs_gen_call_refuse_retry(cs_gen_call *c, const char *msg, int64_t retry_ms) {
    c->retry_after_ms = retry_ms;
    c->ops->finish(c, CS_RPC_RESOURCE_EXHAUSTED, msg, NULL);
}
static inline size_t cs_gen_call_pending_bytes(cs_gen_call *c) {
    return c->ops->pending_bytes(c);
}
static inline int cs_gen_call_on_cancel(cs_gen_call *c, cs_gen_cancel_fn fn, void *arg) {
    return c->ops->on_cancel(c, fn, arg);
}
static inline int64_t cs_gen_call_deadline_ms(cs_gen_call *c) {
    return c->ops->deadline_ms(c);
}

/* The gRPC door: a cs_gen_call over a Generate RPC call (its request
 * message). NULL when out of memory (the RPC is then finished
 * RESOURCE_EXHAUSTED). */
cs_gen_call *cs_gen_call_grpc(cs_rpc_call *rpc);

#endif
