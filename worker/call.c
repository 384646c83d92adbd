/* call.c: the requests of both worker roles (see cs_worker_call in
 * worker.h): admission, the engine's submission, answers, the drain and
 * release hooks of their life (api/live_req.h: the list, references, the
 * posts), in one place; the
 * roles add their data path (prefill_worker/prefill.c: pages out over the KV
 * transport; decode_worker/decode.c: pages in, tokens out). The shell's
 * side (Worker/Cancel, open calls, the grace period's end) is in worker.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/fault.h"
#include "chunkserve/log.h"
#include "worker.h"

/* The prompt of a Decode/Prefill message into r; CS_EINVAL with a message. */
static int check_request(cs_worker *w, const int32_t *ids, size_t n, int32_t num_prompt,
                         const Chunkserve__V1__SamplingParams *sampling, cs_request *r) {
    const cs_model_config *cfg = cs_model_get_config(w->model);
    memset(r, 0, sizeof *r);
    if (n == 0) return cs_fail_field(CS_EINVAL, "token_ids", "token_ids is empty");
    if (num_prompt < 1 || (size_t)num_prompt > n)
        return cs_fail_field(CS_EINVAL, "num_prompt_tokens",
                             "num_prompt_tokens = %d must be in 1..%zu (the token ids sent)",
                             num_prompt, n);
    if (n >= (size_t)cfg->ctx_len)
        return cs_fail_field(CS_EINVAL, "context",
                             "%zu tokens leave no room in the model's context of %d", n,
                             cfg->ctx_len);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= cfg->n_vocab)
            return cs_fail_field(CS_EINVAL, "token_ids",
                                 "token_ids[%zu] = %d is outside the vocabulary (0..%d)", i, ids[i],
                                 cfg->n_vocab - 1);
    /* the least a sequence holds: the prompt and a first token computed (the
     * pool's shape is fixed at start, so reading it here is safe) */
    if (cs_wire_min_pages(&w->wm, (int64_t)n + 1) > w->wm.n_kv_pages)
        return cs_fail_field(CS_EINVAL, "token_ids",
                             "%zu tokens need more KV pages than this worker has (%d of %d tokens)",
                             n, w->wm.n_kv_pages, w->wm.page_size);
    int rc = cs_wire_sampling(&w->wm, sampling, r);
    if (rc) return rc;
    r->prompt = ids;
    r->n_prompt = (int32_t)n;
    r->n_resumed = (int32_t)n - num_prompt;
    return 0;
}

/* The last reference went (api/live_req.h): q is off w->live. */
static void call_release(cs_live_req *l) {
    cs_worker_call *q = cs_worker_call_of(l);
    if (q->w->role->call_free) q->w->role->call_free(q);
    if (q->fault_armed)
        CS_LOGW("fault injection: request %s ended, the armed allocation %s", q->request_id,
                cs_fault_alloc_disarm() ? "failed in its life" : "was not reached");
    free(q);
}

static void call_drain(cs_live_req *l) {
    cs_worker_call *q = cs_worker_call_of(l);
    q->w->role->drain(q);
}

void cs_worker_calls_init(cs_worker *w) {
    w->live = (cs_live_list){.rl = w->rl, .drain = call_drain, .release = call_release};
}

void cs_worker_call_finish(cs_worker_call *q, int code, const char *msg) {
    if (!q->call) return;
    cs_rpc_call_finish(q->call, code, msg);
    q->call = NULL;
    cs_live_req_unref(&q->life);
}

void cs_worker_call_reply(cs_worker_call *q, const ProtobufCMessage *msg) {
    if (!q->call) return;
    cs_rpc_call_reply_msg(q->call, msg);
    q->call = NULL;
    cs_live_req_unref(&q->life);
}

/* Fault builds only (fault.h): x-chunkserve-fault-alloc: N on the call fails
 * the Nth allocation from here on, in its life (one call at a time). */
static bool arm_fault(cs_rpc_call *c) {
    size_t len = 0;
    const char *v =
        cs_fault_enabled() ? cs_rpc_call_metadata(c, "x-chunkserve-fault-alloc", &len) : NULL;
    char buf[24];
    if (!v || !len || len >= sizeof buf) return false;
    memcpy(buf, v, len);
    buf[len] = 0;
    cs_fault_alloc_arm(strtol(buf, NULL, 10));
    return true;
}

static cs_worker_call *admit(cs_worker *w, cs_rpc_call *c, const int32_t *ids, size_t n,
                             int32_t num_prompt, const Chunkserve__V1__SamplingParams *sampling,
                             uint64_t transfer_id, const char *request_id, const char *cache_salt,
                             const char *tenant, cs_request *r) {
    if (w->stopping) {
        cs_rpc_call_finish(c, CS_RPC_UNAVAILABLE, "the worker is draining (shutting down)");
        return NULL;
    }
    if (w->live.n >= w->o.max_queue) {
        char msg[80];
        snprintf(msg, sizeof msg, "the %s worker holds --max-queue requests", w->role->name);
        cs_metric_inc(w->em.refused);
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return NULL;
    }
    cs_error_clear(); /* a field named below is this request's */
    int rc = cs_wire_check_request_id(request_id);
    if (!rc) rc = cs_wire_check_cache_salt(cache_salt);
    if (!rc) rc = cs_wire_check_tenant(tenant);
    if (!rc) rc = check_request(w, ids, n, num_prompt, sampling, r);
    if (rc) {
        char msg[512], field[64];
        snprintf(msg, sizeof msg, "%s", cs_last_error());
        snprintf(field, sizeof field, "%s", cs_last_error_field());
        if (field[0]) cs_rpc_call_add_trailer(c, CS_FIELD_TRAILER, field); /* as the doors' */
        cs_rpc_call_finish(c, cs_rpc_code_of_status(rc), msg);
        return NULL;
    }
    cs_worker_call *q = calloc(1, w->role->call_size);
    if (!q) {
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    q->w = w;
    q->call = c;
    q->id = r->id = ++w->next_id;
    r->cache_salt = cache_salt; /* borrowed from the call's message; the engine copies it */
    r->tenant = tenant;         /* likewise */
    q->transfer_id = transfer_id;
    snprintf(q->request_id, sizeof q->request_id, "%s",
             request_id && request_id[0] ? request_id : "-");
    q->t_start = cs_now();
    cs_live_req_init(&w->live, &q->life); /* holding the RPC's reference */
    return q;
}

cs_worker_call *cs_worker_admit(cs_worker *w, cs_rpc_call *c, const int32_t *ids, size_t n,
                                int32_t num_prompt, const Chunkserve__V1__SamplingParams *sampling,
                                uint64_t transfer_id, const char *request_id,
                                const char *cache_salt, const char *tenant, cs_request *r) {
    bool armed = arm_fault(c);
    cs_worker_call *q =
        admit(w, c, ids, n, num_prompt, sampling, transfer_id, request_id, cache_salt, tenant, r);
    if (q)
        q->fault_armed = armed;
    else if (armed)
        CS_LOGW("fault injection: request %s ended, the armed allocation %s",
                request_id && request_id[0] ? request_id : "-",
                cs_fault_alloc_disarm() ? "failed in its life" : "was not reached");
    return q;
}

/* The client cancelled (or its deadline passed): the work stops, the call
 * ends at once. */
static void on_call_cancel(cs_rpc_call *c, void *data) {
    cs_worker_call *q = data;
    (void)c;
    CS_LOGD("request %s: call cancelled", q->request_id);
    q->w->role->cancel(q);
    cs_worker_call_finish(q, CS_RPC_CANCELLED, "cancelled");
}

int cs_worker_call_submit(cs_worker_call *q, cs_request *r, cs_serve_cb on_event) {
    cs_live_req_ref(&q->life); /* the engine's */
    int rc = cs_serve_submit(q->w->sv, r, on_event, q);
    if (rc) {
        cs_live_req_unref_not_last(&q->life); /* the RPC holds one */
        cs_worker_call_finish(q, CS_RPC_UNAVAILABLE, "the engine refused the request");
        return rc;
    }
    if (cs_rpc_call_on_cancel(q->call, on_call_cancel, q) != 0) on_call_cancel(q->call, q);
    return 0;
}
