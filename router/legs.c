/* legs.c: the router's worker legs (see router-impl.h): one
 * Worker/Decode or Worker/Prefill call each. A leg turns its call's
 * messages and end into request events (request.c) while it is the
 * request's current leg; a leg left behind by a retry only cleans up. It
 * holds a reference to its worker, counted active there while the call
 * lives. Not here: what a request does with an event. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "router-impl.h"
#include "wire.h"

static leg *leg_new(req *q, cs_pool_worker *w, enum leg_kind kind) {
    leg *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->q = q;
    l->w = w;
    l->kind = kind;
    cs_pool_worker_ref(w);
    cs_pool_worker_active(w, 1);
    q->legs++;
    return l;
}

/* After its call ended (or never started): the worker reference and the
 * request's count; the request may be freed here. */
static void leg_free(leg *l) {
    req *q = l->q;
    if (l->reply) protobuf_c_message_free_unpacked(&l->reply->base, NULL);
    cs_pool_worker_active(l->w, -1);
    cs_pool_worker_unref(l->w);
    free(l);
    q->legs--;
    cs__req_maybe_free(q);
}

void cs__leg_cancel(leg *l) {
    if (l && l->c) cs_rpc_client_call_cancel(l->c);
}

/* Opens the leg's call (l is the request's current leg, in *slot). When it
 * cannot start (no time left, no channel, the RPC layer refused), the leg is
 * detached, the request told (an event like any other end), the leg freed. */
static void open_call(leg *l, leg **slot, const char *method, const ProtobufCMessage *m,
                      const cs_rpc_call_opts *o, cs_rpc_on_message on_message,
                      cs_rpc_on_done on_done) {
    int code = CS_RPC_DEADLINE_EXCEEDED;
    char why[300] = "";
    if (o->timeout_ms > 0) {
        cs_rpc_channel *ch = cs_pool_worker_channel(l->w);
        if (ch && cs_rpc_channel_call_msg(ch, method, m, o, on_message, on_done, l, &l->c) == 0)
            return;
        code = CS_RPC_UNAVAILABLE;
        snprintf(why, sizeof why, "cannot call it: %s", ch ? cs_last_error() : "no channel");
    }
    *slot = NULL;
    cs__req_on_leg_failed(l->q, l, code, why[0] ? why : NULL);
    leg_free(l);
}

/* The request's latest RNG state (sampled requests continue exactly). */
static Chunkserve__V1__RngState *rng_of(req *q, Chunkserve__V1__RngState *m) {
    if (!q->have_rng) return NULL;
    m->n_s = 4;
    m->s = q->rng;
    return m;
}

/* The worker's refusal of the client's input names the field (api/wire.h). */
static void keep_field(leg *l, cs_rpc_client_call *c, int code) {
    size_t len = 0;
    const char *v = code == CS_RPC_INVALID_ARGUMENT
                        ? cs_rpc_client_call_metadata(c, CS_FIELD_TRAILER, &len)
                        : NULL;
    if (v && len < sizeof l->field) memcpy(l->field, v, len), l->field[len] = 0;
}

/* ----------------------------------------------------------- cancel -- */

static void on_cancel_sent(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    (void)c;
    cs_pool_worker *w = data;
    CS_LOGD("Worker/Cancel on %s: %s %s", cs_pool_worker_addr(w), cs_rpc_code_name(code), msg);
    cs_pool_worker_active(w, -1);
    cs_pool_worker_unref(w);
}

void cs__leg_send_cancel(req *q, cs_pool_worker *w) {
    if (!w || !cs_pool_worker_channel(w)) return;
    Chunkserve__V1__CancelRequest m = CHUNKSERVE__V1__CANCEL_REQUEST__INIT;
    m.transfer_id = q->transfer_id;
    m.request_id = q->id;
    cs_rpc_call_opts o = {.timeout_ms = CANCEL_DEADLINE_MS};
    cs_pool_worker_ref(w);
    cs_pool_worker_active(w, 1);
    if (cs_rpc_channel_call_msg(cs_pool_worker_channel(w), WORKER_SERVICE "Cancel", &m.base, &o,
                                NULL, on_cancel_sent, w, NULL) != 0) {
        cs_pool_worker_active(w, -1);
        cs_pool_worker_unref(w);
    }
}

/* ---------------------------------------------------------- prefill -- */

static void on_prefill_message(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c;
    leg *l = data;
    if (l->reply) return; /* unary: one answer */
    if (cs_rpc_unpack(&chunkserve__v1__prefill_response__descriptor, buf, len,
                      (ProtobufCMessage **)&l->reply) != 0)
        l->reply = NULL; /* read as no prompt logprobs; the stream goes on */
}

static void on_prefill_done(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    leg *l = data;
    keep_field(l, c, code);
    req *q = l->q;
    /* counted even when the stream already ended (a one-token answer can
     * finish on the Decode stream before the Prefill reply arrives) */
    if (code == CS_RPC_OK) cs_metric_inc(q->r->m.prefill_remote);
    if (q->pleg != l || q->state == RQ_ENDED) {
        leg_free(l);
        return;
    }
    q->pleg = NULL;
    if (code == CS_RPC_OK) {
        cs_pool_worker *dw = cs__req_worker(q, q->dw_last);
        if (dw) cs_pool_pair_ok(l->w, dw); /* the pair works */
        Chunkserve__V1__PrefillResponse *reply = l->reply;
        l->reply = NULL;
        cs__req_on_prefilled(q, l, reply);
    } else
        cs__req_on_leg_failed(q, l, code, msg);
    leg_free(l);
}

void cs__leg_start_prefill(req *q, const char *kv_endpoint, int kv_transport) {
    cs_pool_worker *pw = cs__req_worker(q, q->pw);
    q->pw = (cs_pool_handle){0, 0};
    if (!pw) { /* it left the pool since it was chosen: as if its call had failed */
        cs__req_fail_attempt(q, NULL, "prefill", CS_RPC_UNAVAILABLE,
                             "the prefill worker chosen for it left the pool");
        return;
    }
    leg *l = leg_new(q, pw, LEG_PREFILL);
    if (!l) {
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    q->pw_last = cs_pool_worker_handle(pw);
    Chunkserve__V1__PrefillRequest m = CHUNKSERVE__V1__PREFILL_REQUEST__INIT;
    Chunkserve__V1__RngState rng = CHUNKSERVE__V1__RNG_STATE__INIT;
    m.request_id = q->id;
    m.transfer_id = q->transfer_id;
    m.n_token_ids = q->n_ctx;
    m.token_ids = q->ctx;
    m.num_prompt_tokens = q->n_prompt;
    Chunkserve__V1__SamplingParams sampling;
    m.sampling = (Chunkserve__V1__SamplingParams *)cs__req_leg_sampling(q, &sampling);
    m.rng_state = rng_of(q, &rng);
    m.kv_endpoint = (char *)kv_endpoint;
    m.kv_transport = kv_transport;
    m.cache_salt = q->cache_salt;
    m.tenant = q->tenant;
    m.decode_worker_id = (char *)cs_pool_worker_id(q->dleg->w);
    cs_rpc_call_opts o = {.timeout_ms = cs__req_ms_left(q)};
    cs_rpc_metadata fault = {"x-chunkserve-fault-alloc", q->fault_worker};
    if (q->fault_worker[0]) o.metadata = &fault, o.n_metadata = 1;
    q->pleg = l;
    CS_LOGD("request %s: prefill %zu tokens on %s -> %s (transfer %016" PRIx64 ")", q->id, q->n_ctx,
            cs_pool_worker_addr(pw), kv_endpoint, q->transfer_id);
    open_call(l, &q->pleg, WORKER_SERVICE "Prefill", &m.base, &o, on_prefill_message,
              on_prefill_done);
}

/* ----------------------------------------------------------- decode -- */

static void on_decode_message(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c;
    leg *l = data;
    req *q = l->q;
    if (q->dleg != l || q->state == RQ_ENDED) return;
    Chunkserve__V1__DecodeResponse *m = NULL;
    if (cs_rpc_unpack(&chunkserve__v1__decode_response__descriptor, buf, len,
                      (ProtobufCMessage **)&m) != 0) {
        cs__req_fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "malformed DecodeResponse");
        return;
    }
    if (m->rng_state && m->rng_state->n_s == 4) {
        memcpy(q->rng, m->rng_state->s, sizeof q->rng);
        q->have_rng = true;
    }
    switch (m->event_case) {
    case CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_ADMITTED: {
        if (q->state != RQ_ADMITTING) {
            cs__req_fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "admitted twice");
            break;
        }
        const Chunkserve__V1__DecodeAdmitted *a = m->admitted;
        const char *ep =
            a->kv_endpoint && a->kv_endpoint[0] ? a->kv_endpoint : cs_pool_worker_kv_endpoint(l->w);
        int tr = a->kv_transport ? (int)a->kv_transport : cs_pool_worker_kv_transport(l->w);
        CS_LOGD("request %s: admitted by %s (%d pages, kv %s)", q->id, cs_pool_worker_addr(l->w),
                a->pages_reserved, ep);
        cs__req_on_admitted(q, l, ep, tr);
        break;
    }
    case CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_OUTPUT:
        if (q->state == RQ_ADMITTING) {
            cs__req_fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "output before admitted");
            break;
        }
        int held = cs__req_hold(q, m);
        if (held == 1) return; /* kept, unfreed, until the prompt logprobs come */
        if (held < 0)
            cs__req_fail_attempt(q, l->w, "decode", CS_RPC_RESOURCE_EXHAUSTED,
                                 "the router ran out of memory");
        else
            cs__req_on_output(q, l, m->output);
        break;
    default: break; /* an event of a newer worker: ignore */
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

static void on_decode_done(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    leg *l = data;
    keep_field(l, c, code);
    req *q = l->q;
    if (q->dleg != l || q->state == RQ_ENDED) {
        leg_free(l);
        return;
    }
    q->dleg = NULL;
    if (code == CS_RPC_OK && cs__req_hold_end(q)) { /* its outputs wait for the Prefill reply */
        leg_free(l);
        return;
    }
    if (code == CS_RPC_RESOURCE_EXHAUSTED && q->state == RQ_ADMITTING)
        cs__req_on_refused(q, l, msg);
    else
        cs__req_on_leg_failed(q, l, code, msg);
    leg_free(l);
}

void cs__leg_start_decode(req *q, cs_pool_worker *dw, bool first) {
    router *r = q->r;
    leg *l = leg_new(q, dw, LEG_DECODE);
    cs_pool_worker_unref(dw);
    if (!l) {
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    Chunkserve__V1__DecodeRequest m = CHUNKSERVE__V1__DECODE_REQUEST__INIT;
    Chunkserve__V1__RngState rng = CHUNKSERVE__V1__RNG_STATE__INIT;
    m.request_id = q->id;
    m.transfer_id = q->transfer_id;
    m.n_token_ids = q->n_ctx;
    m.token_ids = q->ctx;
    m.num_prompt_tokens = q->n_prompt;
    Chunkserve__V1__SamplingParams sampling;
    m.sampling = (Chunkserve__V1__SamplingParams *)cs__req_leg_sampling(q, &sampling);
    m.rng_state = rng_of(q, &rng);
    m.local_prefill = q->local;
    m.lease_ms = (int32_t)r->o->lease_ms;
    /* the decode worker takes this transfer's pages only from the prefill
     * worker chosen for it (by the name its KV channel authenticates as) */
    cs_pool_worker *pw = q->local ? NULL : cs__req_worker(q, q->pw);
    m.kv_sender = (char *)(pw ? cs_pool_worker_kv_sender(pw) : "");
    m.cache_salt = q->cache_salt;
    m.tenant = q->tenant;
    cs_rpc_call_opts o = {.timeout_ms = cs__req_ms_left(q)};
    /* The wall-clock time of the client call's receipt, on the first attempt:
     * the decode worker measures receipt-to-receipt (same host or synced
     * clocks: chunkserve:router_to_worker_seconds). */
    char t0[32];
    cs_rpc_metadata md[2] = {{"x-chunkserve-received-us", t0},
                             {"x-chunkserve-fault-alloc", q->fault_worker}};
    o.metadata = first ? md : md + 1;
    o.n_metadata = (first ? 1 : 0) + (q->fault_worker[0] ? 1 : 0);
    if (first) snprintf(t0, sizeof t0, "%" PRId64, q->t_recv_wall_us);
    q->dleg = l;
    CS_LOGD("request %s: decode on %s, %s prefill%s%s, %zu tokens (transfer %016" PRIx64 ")", q->id,
            cs_pool_worker_addr(dw), q->local ? "local" : "remote", pw ? " on " : "",
            pw ? cs_pool_worker_addr(pw) : "", q->n_ctx, q->transfer_id);
    open_call(l, &q->dleg, WORKER_SERVICE "Decode", &m.base, &o, on_decode_message, on_decode_done);
}
