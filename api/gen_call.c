/* gen_call.c: the gRPC door of cs_gen_call (gen_call.h): each operation is
 * the RPC layer's call operation of the same name. */
#include "gen_call.h"

#include <stdlib.h>

#include "chunkserve/error.h"
#include "wire.h"

typedef struct {
    cs_gen_call base;
    cs_rpc_call *rpc;
    cs_gen_cancel_fn fn;
    void *arg;
} grpc_call;

static int g_send(cs_gen_call *c, const Chunkserve__V1__GenerateResponse *m) {
    return cs_rpc_call_send_msg(((grpc_call *)c)->rpc, &m->base);
}

static void g_finish(cs_gen_call *c, int code, const char *msg, const char *field) {
    if (field) cs_rpc_call_add_trailer(((grpc_call *)c)->rpc, CS_FIELD_TRAILER, field);
    cs_rpc_call_finish(((grpc_call *)c)->rpc, code, msg);
    free(c);
}

static size_t g_pending_bytes(cs_gen_call *c) {
    return cs_rpc_call_pending_bytes(((grpc_call *)c)->rpc);
}

static void g_cancelled(cs_rpc_call *rpc, void *data) {
    grpc_call *g = data;
    (void)rpc;
    g->fn(&g->base, g->arg);
}

static int g_on_cancel(cs_gen_call *c, cs_gen_cancel_fn fn, void *arg) {
    grpc_call *g = (grpc_call *)c;
    g->fn = fn;
    g->arg = arg;
    return cs_rpc_call_on_cancel(g->rpc, g_cancelled, g);
}

static int64_t g_deadline_ms(cs_gen_call *c) {
    return cs_rpc_call_deadline_ms(((grpc_call *)c)->rpc);
}

static const cs_gen_call_ops grpc_ops = {
    .send = g_send,
    .finish = g_finish,
    .pending_bytes = g_pending_bytes,
    .on_cancel = g_on_cancel,
    .deadline_ms = g_deadline_ms,
};

cs_gen_call *cs_gen_call_grpc(cs_rpc_call *rpc) {
    grpc_call *g = calloc(1, sizeof *g);
    if (!g) {
        cs_rpc_call_finish(rpc, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    g->base.ops = &grpc_ops;
    g->base.req = (const void *)cs_rpc_call_request_msg(rpc);
    g->rpc = rpc;
    return &g->base;
}
