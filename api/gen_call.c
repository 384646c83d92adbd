/* gen_call.c: the gRPC door of cs_gen_call (gen_call.h): each operation is
 * the RPC layer's call operation of the same name. */
#include "gen_call.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Protobuf's wire format, the little the status details need. */
static size_t put_varint(uint8_t *b, uint64_t v) {
    size_t n = 0;
    do {
        b[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}

static size_t put_bytes(uint8_t *b, uint8_t tag, const void *p, size_t len) {
    size_t n = 0;
    b[n++] = tag;
    n += put_varint(b + n, len);
    memcpy(b + n, p, len);
    return n + len;
}

/* google.rpc.Status{code, message, details: [Any(google.rpc.RetryInfo{
 * retry_delay: Duration(ms)})]}: gRPC's richer error model, which clients
 * read from the grpc-status-details-bin trailer (grpcio-status'
 * rpc_status.from_call, grpc-java's StatusProto). Bytes written to b
 * (at least 700 long; msg is cut to 512 bytes). */
static size_t retry_status(uint8_t *b, int code, const char *msg, int64_t ms) {
    uint8_t dur[24], info[32], any[96];
    size_t nd = 0;
    dur[nd++] = 0x08;
    nd += put_varint(dur + nd, (uint64_t)(ms / 1000));
    if (ms % 1000) {
        dur[nd++] = 0x10;
        nd += put_varint(dur + nd, (uint64_t)(ms % 1000) * 1000000);
    }
    size_t ni = put_bytes(info, 0x0a, dur, nd);
    static const char url[] = "type.googleapis.com/google.rpc.RetryInfo";
    size_t na = put_bytes(any, 0x0a, url, sizeof url - 1);
    na += put_bytes(any + na, 0x12, info, ni);
    size_t n = 0;
    b[n++] = 0x08;
    n += put_varint(b + n, (uint64_t)code);
    size_t ml = msg ? strlen(msg) : 0; /* at most 512 (g_finish) */
    if (ml) n += put_bytes(b + n, 0x12, msg, ml < 512 ? ml : 512);
    return n + put_bytes(b + n, 0x1a, any, na);
}

static void g_finish(cs_gen_call *c, int code, const char *msg, const char *field) {
    if (field) cs_rpc_call_add_trailer(((grpc_call *)c)->rpc, CS_FIELD_TRAILER, field);
    char cut[513];
    if (c->retry_after_ms > 0) {
        /* the status's message is the call's (clients compare them), cut alike at a
         * character's start */
        size_t ml = msg ? strlen(msg) : 0;
        if (ml > 512) {
            ml = 512;
            while (ml > 0 && ((unsigned char)msg[ml] & 0xc0) == 0x80)
                ml--;
            memcpy(cut, msg, ml);
            cut[ml] = 0;
            msg = cut;
        }
        uint8_t b[700];
        size_t n = retry_status(b, code, msg, c->retry_after_ms);
        cs_rpc_call_add_trailer_bytes(((grpc_call *)c)->rpc, "grpc-status-details-bin", b, n);
    }
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
