/* request.c: a request's life in the router (see router-impl.h for the
 * state table): the wait queue, attempts, failures (retry before the first
 * relayed token, migration after), the relay to the client, the end. Every
 * state change goes through cs__req_set_state. Not here: the worker calls
 * themselves (legs.c), admission of new requests (router.c). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "router-impl.h"

/* ------------------------------------------------------------ helpers -- */

uint64_t cs__splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* 64 random bits from the kernel, never 0: nothing public (request ids,
 * the clock) predicts them, so no one can name another request's transfer. */
static uint64_t new_transfer_id(router *r) {
    (void)r;
    return cs_random_u64();
}

void cs__router_count_code(router *r, int code) {
    if (code < 0 || code > 16 || !r->m.codes[code]) code = CS_RPC_UNKNOWN;
    cs_metric_inc(r->m.codes[code]);
}

int64_t cs__req_ms_left(const req *q) {
    double left = (q->t_deadline - cs_now()) * 1000.0;
    return left < 1 ? 0 : (int64_t)left;
}

/* ------------------------------------------------------ the states -- */

/* The transitions of the table in router-impl.h. WAITING -> WAITING is a
 * request that stays in the queue (perhaps for another reason); ADMITTING,
 * PREFILL, STREAMING -> ADMITTING is the next attempt (retry, migration). */
static const bool transitions[6][6] = {
    [RQ_NEW] = {[RQ_WAITING] = true, [RQ_ADMITTING] = true, [RQ_ENDED] = true},
    [RQ_WAITING] = {[RQ_WAITING] = true, [RQ_ADMITTING] = true, [RQ_ENDED] = true},
    [RQ_ADMITTING] = {[RQ_WAITING] = true,
                      [RQ_ADMITTING] = true,
                      [RQ_PREFILL] = true,
                      [RQ_STREAMING] = true,
                      [RQ_ENDED] = true},
    [RQ_PREFILL] =
        {[RQ_WAITING] = true, [RQ_ADMITTING] = true, [RQ_STREAMING] = true, [RQ_ENDED] = true},
    [RQ_STREAMING] = {[RQ_WAITING] = true, [RQ_ADMITTING] = true, [RQ_ENDED] = true},
};

static bool is_placed(enum req_state s) {
    return s == RQ_ADMITTING || s == RQ_PREFILL || s == RQ_STREAMING;
}

static void queue_insert(router *r, req *q) {
    req *after = r->qtail; /* keep arrival order: a retried request goes back in its place */
    while (after && after->seq > q->seq)
        after = after->qprev;
    q->qprev = after;
    q->qnext = after ? after->qnext : r->qhead;
    if (q->qnext)
        q->qnext->qprev = q;
    else
        r->qtail = q;
    if (after)
        after->qnext = q;
    else
        r->qhead = q;
    r->n_queued++;
}

static void queue_remove(router *r, req *q) {
    if (q->qprev)
        q->qprev->qnext = q->qnext;
    else
        r->qhead = q->qnext;
    if (q->qnext)
        q->qnext->qprev = q->qprev;
    else
        r->qtail = q->qprev;
    q->qprev = q->qnext = NULL;
    r->n_queued--;
}

void cs__req_set_state(req *q, enum req_state to) {
    router *r = q->r;
    enum req_state from = q->state;
    CS_ASSERT(transitions[from][to]);
    if (from == RQ_WAITING && to != RQ_WAITING) queue_remove(r, q);
    if (to == RQ_WAITING && from != RQ_WAITING) queue_insert(r, q);
    bool was = is_placed(from), now = is_placed(to);
    q->state = to;
    if (was != now) {
        r->n_placed += now ? 1 : -1;
        if (!now) cs__router_schedule_pump(r); /* a slot freed */
    }
}

/* ------------------------------------------------------- the queue -- */

void cs__req_park(req *q, enum req_wait why) {
    router *r = q->r;
    if (q->state == RQ_NEW && r->n_queued >= r->o->max_queue) {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "the router is overloaded: %d requests placed and %d waiting (--max-queue %lld); "
                 "retry later",
                 r->n_placed, r->n_queued, (long long)r->o->max_queue);
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    q->parked = true;
    if (!q->t_wait[why]) {
        q->t_wait[why] = cs_now();
        CS_LOGD("request %s: waits %s", q->id,
                why == WAIT_SLOT   ? "for a slot"
                : why == WAIT_ROOM ? "for KV room on a decode worker"
                                   : "for a usable decode worker");
    }
    q->wait = why;
    cs__req_set_state(q, RQ_WAITING);
}

/* ---------------------------------------------------------- the end -- */

/* An output of the Decode stream held for the prompt logprobs. */
struct held_output {
    struct held_output *next;
    Chunkserve__V1__DecodeResponse *m;
};

static void drop_held(req *q) {
    for (struct held_output *h = q->held, *n; h; h = n) {
        n = h->next;
        protobuf_c_message_free_unpacked(&h->m->base, NULL);
        free(h);
    }
    q->held = NULL;
    q->held_tail = &q->held;
    q->held_ended = false;
    if (q->prefilled) protobuf_c_message_free_unpacked(&q->prefilled->base, NULL);
    q->prefilled = NULL;
}

bool cs__req_wants_prompt_logprobs(const req *q) {
    return q->sampling && q->sampling->prompt_logprobs && !q->local && q->n_relayed == 0;
}

int cs__req_hold(req *q, Chunkserve__V1__DecodeResponse *m) {
    if (q->state != RQ_PREFILL || !cs__req_wants_prompt_logprobs(q)) return 0;
    struct held_output *h = malloc(sizeof *h);
    if (!h) return CS_ENOMEM;
    *h = (struct held_output){NULL, m};
    CS_LOGD("request %s: an output waits for the prompt logprobs of the Prefill reply", q->id);
    if (!q->held) q->held_tail = &q->held;
    *q->held_tail = h;
    q->held_tail = &h->next;
    return 1;
}

bool cs__req_hold_end(req *q) {
    if (!q->held) return false;
    q->held_ended = true;
    return true;
}

const Chunkserve__V1__SamplingParams *cs__req_leg_sampling(const req *q,
                                                           Chunkserve__V1__SamplingParams *copy) {
    if (!q->sampling || !q->sampling->prompt_logprobs || q->n_relayed == 0) return q->sampling;
    *copy = *q->sampling; /* shallow: packed before q->sampling changes */
    copy->prompt_logprobs = false;
    copy->prompt_top_logprobs = 0;
    return copy;
}

void cs__req_maybe_free(req *q) {
    if (q->call || q->legs) return;
    router *r = q->r;
    CS_ASSERT(q->state == RQ_ENDED);
    if (q->prev)
        q->prev->next = q->next;
    else
        r->live = q->next;
    if (q->next) q->next->prev = q->prev;
    r->n_live--;
    cs_pool_marks_free(&q->marks);
    drop_held(q);
    if (q->sampling) protobuf_c_message_free_unpacked(&q->sampling->base, NULL);
    free(q->ctx);
    free(q->id);
    free(q->cache_salt);
    free(q->tenant);
    cs__router_fault_end(r, q->seq);
    free(q);
}

/* The attempt's prompt left its prefilling worker's queue: computed (its
 * first token came) or dropped (the attempt ended before). */
static void prompt_left(req *q, bool computed) {
    if (!q->prompt_placed) return;
    const cs_place_class c = {q->priority, q->tenant};
    cs_pool_prompt_left(cs__req_worker(q, q->prompt_w), q->prompt_placed, q->prompt_seq, &c,
                        computed);
    q->prompt_placed = 0;
}

/* Cancels the current attempt's calls; their on_done still comes (and only
 * cleans up). When the Prefill call already returned (a remote prefill in
 * STREAMING), the transfer may live on in the workers without a call:
 * Worker/Cancel tells both. */
static void drop_attempt(req *q, bool tell_workers) {
    prompt_left(q, false);
    drop_held(q);
    cs__leg_cancel(q->dleg);
    cs__leg_cancel(q->pleg);
    q->dleg = q->pleg = NULL;
    if (tell_workers && !q->local && q->state == RQ_STREAMING) {
        cs__leg_send_cancel(q, cs__req_worker(q, q->dw_last));
        cs__leg_send_cancel(q, cs__req_worker(q, q->pw_last));
    }
    q->pw = (cs_pool_handle){0, 0};
}

static const char *code_msg(int code) {
    switch (code) {
    case CS_RPC_CANCELLED: return "cancelled";
    case CS_RPC_DEADLINE_EXCEEDED: return "the request's deadline passed";
    default: return NULL;
    }
}

void cs__req_end(req *q, int code, const char *msg) {
    cs__req_refuse(q, code, msg, NULL);
}

void cs__req_refuse(req *q, int code, const char *msg, const char *field) {
    router *r = q->r;
    if (q->state == RQ_ENDED) return;
    drop_attempt(q, code != CS_RPC_OK);
    cs__req_set_state(q, RQ_ENDED);
    double now = cs_now();
    if (q->call) {
        cs_gen_call_refuse(q->call, code, msg ? msg : code_msg(code), field);
        q->call = NULL;
    }
    cs__router_count_code(r, code);
    if (code == CS_RPC_OK) cs_metric_observe(r->m.e2e, now - q->t_recv);
    if (code == CS_RPC_OK || code == CS_RPC_CANCELLED)
        CS_LOGI("request %s: %s, %d prompt + %d completion tokens in %.3f s (ttft %.3f s, "
                "predicted %.3f s, %s prefill, %d retries, %d migrations)",
                q->id, cs_rpc_code_name(code), q->n_prompt, q->n_relayed, now - q->t_recv,
                q->t_first ? q->t_first - q->t_recv : 0.0, q->predicted_ttft,
                q->local ? "local" : "remote", q->retries, q->migrations);
    else
        CS_LOGW("request %s: %s: %s (%d completion tokens, %d retries, %d migrations, %.3f s)",
                q->id, cs_rpc_code_name(code),
                msg              ? msg
                : code_msg(code) ? code_msg(code)
                                 : "",
                q->n_relayed, q->retries, q->migrations, now - q->t_recv);
    cs__req_maybe_free(q);
}

/* ---------------------------------------------------------- attempts -- */

/* The prefix-aware placement policy for q (NULL: --prefix-routing false). */
static const cs_pool_prefix *prefix_of(const req *q, cs_pool_prefix *pf) {
    const cs_router_opts *o = q->r->o;
    if (!o->prefix_routing) return NULL;
    *pf = (cs_pool_prefix){.ids = q->ctx,
                           .salt = q->cache_salt,
                           .ttl_s = (double)o->prefix_ttl_ms / 1000.0,
                           .balance = {[CS_POOL_PREFILL] = o->prefix_balance_tokens,
                                       [CS_POOL_DECODE] = o->prefix_balance_seqs},
                           .index_pages = (int32_t)o->prefix_index_pages};
    return pf;
}

/* A new attempt on decode worker dw (a reference from the pool, taken over;
 * predicted to hold dcached of the context's tokens): a new transfer id, a
 * prefill worker when what is left to compute is long, the Decode call. */
static void start_attempt(req *q, cs_pool_worker *dw, int64_t dcached) {
    router *r = q->r;
    q->dw_last = cs_pool_worker_handle(dw);
    q->transfer_id = new_transfer_id(r);
    /* remote prefill for long contexts when a prefill worker can take it */
    cs_pool_worker *pw = NULL;
    cs_pool_prefix pf;
    int64_t pcached = 0;
    if (q->sampling && q->sampling->prompt_logprobs && q->n_relayed == 0)
        dcached = 0; /* prompt logprobs: the prompt is computed whole, cache or not */
    if ((int64_t)q->n_ctx - dcached >= r->o->local_prefill_threshold &&
        !(q->slo_local && q->n_relayed == 0))
        pw = cs_pool_place(r->pool, CS_POOL_PREFILL, (int64_t)q->n_ctx, &q->marks, NULL, dw,
                           prefix_of(q, &pf), &(cs_place_class){q->priority, q->tenant},
                           &pcached);
    q->pw = cs_pool_worker_handle(pw); /* the leg takes a reference when its call starts */
    /* its prompt is its prefilling worker's load until it leaves there (prompt_left) */
    q->prompt_w = cs_pool_worker_handle(pw ? pw : dw);
    q->prompt_seq = cs_pool_status_seq(pw ? pw : dw);
    q->prompt_placed = (int64_t)q->n_ctx; /* what cs_pool_place counted on pw */
    if (!pw) cs_pool_prompt_placed(dw, q->prompt_placed);
    cs_pool_worker_unref(pw);
    q->local = pw == NULL;
    q->predicted_cached = q->local ? dcached : pcached;
    cs__req_set_state(q, RQ_ADMITTING);
    q->t_attempt = cs_now();
    bool first = !q->overhead_seen;
    if (first) {
        q->overhead_seen = true;
        cs_metric_observe(r->m.overhead, q->t_attempt - q->t_recv);
    }
    cs__leg_start_decode(q, dw, first);
}

void cs__req_attempt(req *q) {
    router *r = q->r;
    if (q->state == RQ_ENDED || !q->call) return;
    if (r->grace_over) {
        cs__req_end(q, CS_RPC_UNAVAILABLE, "the router is shutting down");
        return;
    }
    if (!is_placed(q->state) && r->n_placed >= r->o->max_inflight) {
        cs__req_park(q, WAIT_SLOT);
        return;
    }
    int cand = 0;
    cs_pool_prefix pf;
    int64_t dcached = 0;
    cs_pool_worker *dw = cs_pool_place(r->pool, CS_POOL_DECODE, (int64_t)q->n_ctx, &q->marks, &cand,
                                       NULL, prefix_of(q, &pf), NULL, &dcached);
    if (dw) {
        start_attempt(q, dw, dcached);
        return;
    }
    enum req_wait why = cand ? WAIT_ROOM : WAIT_WORKER;
    if (why == WAIT_WORKER && q->failures > 0 && cs_pool_n_usable(r->pool, CS_POOL_DECODE) > 0 &&
        q->wait != WAIT_WORKER) {
        /* usable workers exist but each failed this request already */
        CS_LOGD("request %s: every usable decode worker failed it; waiting for another", q->id);
    }
    cs__req_park(q, why);
}

void cs__req_fail_attempt(req *q, cs_pool_worker *w, const char *what, int code, const char *msg) {
    router *r = q->r;
    snprintf(q->last_error, sizeof q->last_error, "%s on %s: %s%s%s", what,
             w ? cs_pool_worker_addr(w) : "?", cs_rpc_code_name(code), msg && *msg ? ": " : "",
             msg ? msg : "");
    drop_attempt(q, false);
    if (w) {
        if (code == CS_RPC_UNAVAILABLE) cs_pool_worker_suspect(w, q->last_error); /* not ABORTED */
        if (cs_pool_mark_add(&q->marks.excluded, &q->marks.n_excluded, w) != 0) {
            cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
            return;
        }
    }
    q->failures++;
    bool migrate = q->n_relayed > 0;
    if (migrate) {
        q->migrations++;
        cs_metric_inc(r->m.migrations);
    } else {
        q->retries++;
        cs_metric_inc(r->m.retries);
    }
    if (q->failures > r->o->max_retries) {
        char m[512];
        snprintf(m, sizeof m, "no worker could serve the request: %d attempts failed (last: %s)",
                 q->failures, q->last_error);
        cs__req_end(q, CS_RPC_UNAVAILABLE, m);
        return;
    }
    CS_LOGW("request %s: %s; %s (%d/%d)", q->id, q->last_error, migrate ? "migrating" : "retrying",
            q->failures, (int)r->o->max_retries);
    cs__req_attempt(q);
}

/* ------------------------------------------------- events from legs -- */

void cs__req_on_admitted(req *q, leg *l, const char *kv_endpoint, int kv_transport) {
    memset(q->t_wait, 0, sizeof q->t_wait);
    if (q->local) {
        cs_metric_inc(q->r->m.prefill_local);
        if (q->slo_local && q->n_relayed == 0) cs_metric_inc(q->r->m.prefill_slo_local);
        cs__req_set_state(q, RQ_STREAMING);
    } else if (!kv_endpoint[0]) {
        cs__req_fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "admitted without a KV endpoint");
    } else {
        cs__req_set_state(q, RQ_PREFILL);
        cs__leg_start_prefill(q, kv_endpoint, kv_transport);
    }
}

void cs__req_on_prefilled(req *q, leg *l, Chunkserve__V1__PrefillResponse *reply) {
    CS_LOGD("request %s: prefill on %s done", q->id, cs_pool_worker_addr(l->w));
    bool wants = cs__req_wants_prompt_logprobs(q);
    if (wants && !reply) { /* asked, and the reply that brings them could not be read */
        cs__req_fail_attempt(q, l->w, "prefill", CS_RPC_INTERNAL,
                             "the Prefill reply could not be read (prompt logprobs)");
        return;
    }
    cs__req_set_state(q, RQ_STREAMING);
    if (!wants && reply) protobuf_c_message_free_unpacked(&reply->base, NULL);
    q->prefilled = wants ? reply : NULL; /* the next output relayed carries its prompt logprobs */
    /* the outputs that waited, in order, as they would have come */
    struct held_output *h = q->held;
    bool ended = q->held_ended;
    q->held = NULL;
    q->held_ended = false;
    while (h) {
        struct held_output *n = h->next;
        if (q->state == RQ_STREAMING) cs__req_on_output(q, q->dleg, h->m->output);
        protobuf_c_message_free_unpacked(&h->m->base, NULL);
        free(h);
        h = n;
    }
    if (ended && q->state == RQ_STREAMING) /* the stream closed behind them, unfinished */
        cs__req_fail_attempt(q, cs__req_worker(q, q->dw_last), "decode", CS_RPC_INTERNAL,
                             "the stream ended without a finish reason");
}

void cs__req_on_refused(req *q, leg *l, const char *msg) {
    /* no room there now; try the next decode worker */
    q->refusals++;
    CS_LOGD("request %s: decode worker %s refused: %s", q->id, cs_pool_worker_addr(l->w), msg);
    drop_attempt(q, false);
    if (cs_pool_mark_add(&q->marks.refused, &q->marks.n_refused, l->w) != 0)
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
    else
        cs__req_attempt(q);
}

void cs__req_on_leg_failed(req *q, leg *l, int code, const char *msg) {
    const char *what = l->kind == LEG_DECODE ? "decode" : "prefill";
    if (code == CS_RPC_ABORTED && !q->local && cs__req_ms_left(q) > 0) {
        /* Either side says the KV transfer between them failed: blame the
         * pair (its breaker), not a worker; retry without this prefill
         * worker. A worker that already left the pool is blamed for nothing. */
        cs_pool_worker *pw = cs__req_worker(q, q->pw_last), *dw = cs__req_worker(q, q->dw_last);
        if (pw && dw) cs_pool_pair_failed(pw, dw);
        cs__req_fail_attempt(q, pw && dw ? pw : NULL, "KV transfer", code, msg);
        return;
    }
    if (code == CS_RPC_INVALID_ARGUMENT)
        cs__req_refuse(q, code, msg, l->field); /* the client's input, as the worker judged it */
    else if (cs__req_ms_left(q) <= 0)
        cs__req_end(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
    else if (code == CS_RPC_OK)
        cs__req_fail_attempt(q, l->w, what, CS_RPC_INTERNAL,
                             "the stream ended without a finish reason");
    else
        cs__req_fail_attempt(q, l->w, what, code, msg);
}

/* ------------------------------------------------------------ relay -- */

static int ctx_append(req *q, const int32_t *t, size_t n) {
    if (q->n_ctx + n > q->cap_ctx) {
        size_t nc = (q->n_ctx + n) * 2;
        int32_t *nt = realloc(q->ctx, nc * sizeof *nt);
        if (!nt) return CS_ENOMEM;
        q->ctx = nt;
        q->cap_ctx = nc;
    }
    memcpy(q->ctx + q->n_ctx, t, n * sizeof *t);
    q->n_ctx += n;
    return 0;
}

/* A first token after measured seconds: what the queue part of its
 * prediction left out, learnt for its pool (router.ttft_rest). Only from a
 * request the prediction describes: prefilled where it was predicted (a
 * local prefill for the decode pool's), with nothing predicted cached, in
 * its first attempt (a retry's time is the failure's) and never parked in
 * the router's own queue (that wait is the router's, not the workers'). */
static void learn_ttft_rest(req *q, double measured) {
    router *r = q->r;
    int pool = q->predicted_pool;
    if (pool < 0 || !isfinite(q->predicted_tokens) || q->failures || q->refusals || q->parked ||
        q->local != (pool == CS_POOL_DECODE) || q->predicted_cached > 0)
        return;
    cs_ttft_rest_add(&r->ttft_rest[pool], q->predicted_busy, measured, q->predicted_tokens);
}

/* One output of the Decode stream to the client, as is but for the request
 * id (the router's, on the first message only) and the final usage (the
 * router's counts, which stay right across migrations). Returns true when
 * the attempt ended here (the request finished or failed over). */
static bool relay(req *q, Chunkserve__V1__GenerateResponse *out) {
    router *r = q->r;
    int fin = out->finish_reason;
    bool final_ok = fin == CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_STOP ||
                    fin == CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    bool failed = fin == CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_CANCELLED ||
                  fin == CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_ERROR;
    bool truncated = false;
    size_t n = out->n_token_ids, n_logprobs = out->n_logprobs; /* restored: the free walks them */
    int32_t allowed = q->max_new - q->n_relayed;
    if ((int64_t)n > allowed) {
        /* the worker promised to stop at max_tokens; never relay more */
        CS_LOGE("request %s: decode worker sent %zu tokens with %d left of max %d; truncated",
                q->id, n, allowed, q->max_new);
        n = (size_t)(allowed > 0 ? allowed : 0);
        out->n_token_ids = n;
        if (out->n_logprobs > n) out->n_logprobs = n;
        truncated = true;
        final_ok = true;
        failed = false;
        out->finish_reason = CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        out->stop_reason_case = CHUNKSERVE__V1__GENERATE_RESPONSE__STOP_REASON__NOT_SET;
    }
    /* a failed stream's finish is not the client's: its tokens are, then we fail over */
    if (failed) out->finish_reason = CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    if (ctx_append(q, out->token_ids, n) != 0) {
        out->n_logprobs = n_logprobs;
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return true;
    }
    double now = cs_now();
    if (n) {
        prompt_left(q, true); /* the attempt's prompt is computed */
        if (q->n_relayed == 0) {
            q->t_first = now;
            cs_metric_observe(r->m.ttft, now - q->t_recv);
            if (q->predicted_ttft > 0 && now > q->t_recv)
                cs_metric_observe(r->m.ttft_error, fabs(q->predicted_ttft - (now - q->t_recv)) /
                                                       (now - q->t_recv));
            learn_ttft_rest(q, now - q->t_recv);
            cs_metric_add(r->m.prompt_tokens, q->n_prompt);
        } else {
            cs_metric_observe(r->m.itl, now - q->t_last);
        }
        q->t_last = now;
        q->n_relayed += (int32_t)n;
        cs_metric_add(r->m.gen_tokens, (double)n);
        cs_rate_add(&r->output_demand, (double)n, now, r->o->autoscale_window_s);
    }
    int rc = 0;
    if (q->call && (n || final_ok || (out->text && out->text[0]) || out->n_logprobs)) {
        static char empty[] = "";
        char *worker_id = out->request_id;
        out->request_id = q->sent_first ? empty : q->id;
        Chunkserve__V1__Usage usage = CHUNKSERVE__V1__USAGE__INIT;
        Chunkserve__V1__Usage *worker_usage = out->usage;
        if (final_ok) {
            if (worker_usage) usage = *worker_usage;
            usage.predicted_ttft_seconds = q->predicted_ttft;
            usage.prompt_tokens = q->n_prompt;
            usage.completion_tokens = q->n_relayed;
            /* after a migration the worker's cache count is of prompt + relayed tokens */
            if (usage.cached_prompt_tokens > q->n_prompt) usage.cached_prompt_tokens = q->n_prompt;
            cs_metric_add(r->m.prefix_predicted, (double)q->predicted_cached);
            cs_metric_add(r->m.prefix_cached,
                          worker_usage ? (double)worker_usage->cached_prompt_tokens : 0.0);
            out->usage = &usage;
        } else {
            out->usage = NULL;
        }
        rc = cs_gen_call_send(q->call, out);
        out->usage = worker_usage; /* both freed with the message */
        out->request_id = worker_id;
        q->sent_first = true;
    }
    out->n_logprobs = n_logprobs;
    if (rc == CS_ENOMEM) {
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory for this stream");
        return true;
    }
    if (q->call && rc == 0 && cs_gen_call_pending_bytes(q->call) > CS_MAX_UNSENT_BYTES) {
        cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED,
                    "the client is not reading its stream; generation stopped");
        return true;
    }
    if (final_ok) {
        /* The Decode stream ends OK by itself after its last message, the
         * Prefill call (if still out) on its own: leave them be. */
        leg *d = q->dleg;
        q->dleg = NULL;
        q->pleg = NULL;
        if (truncated) cs__leg_cancel(d);
        cs__req_end(q, CS_RPC_OK, NULL);
        return true;
    }
    if (!failed && n && q->dleg && r->o->fault_migrate_every > 0 &&
        ++q->n_msgs % r->o->fault_migrate_every == 0) {
        /* fault injection: the worker "failed" here; nobody is blamed */
        CS_LOGD("request %s: fault injection: migrating after message %lld", q->id,
                (long long)q->n_msgs);
        drop_attempt(q, true);
        q->migrations++;
        cs_metric_inc(r->m.migrations);
        cs__req_attempt(q);
        return true;
    }
    if (failed && q->dleg) {
        cs__req_fail_attempt(q, q->dleg->w, "decode",
                             fin == CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_ERROR
                                 ? CS_RPC_INTERNAL
                                 : CS_RPC_ABORTED,
                             "the stream ended with finish reason error/cancelled");
        return true;
    }
    return false;
}

void cs__req_on_output(req *q, leg *l, Chunkserve__V1__GenerateResponse *out) {
    (void)l;
    Chunkserve__V1__PrefillResponse *p = q->prefilled;
    if (!p || out->n_prompt_logprobs) { /* a local prefill's come in the stream itself */
        relay(q, out);
        return;
    }
    q->prefilled = NULL;
    out->n_prompt_logprobs = p->n_prompt_logprobs; /* borrowed for the relay */
    out->prompt_logprobs = p->prompt_logprobs;
    relay(q, out);
    out->n_prompt_logprobs = 0;
    out->prompt_logprobs = NULL;
    protobuf_c_message_free_unpacked(&p->base, NULL);
}

/* ------------------------------------------------- queue processing -- */

static void on_pump(uv_timer_t *t) {
    router *r = t->data;
    r->t_last_pump = cs_now();
    r->pump_wanted = false;
    req *next;
    for (req *q = r->qhead; q; q = next) {
        next = q->qnext;
        if (r->n_placed >= r->o->max_inflight) break;
        cs__req_attempt(q); /* starts it (leaves the queue) or keeps its place */
    }
}

/* Runs the queue soon: at once when a slot freed, at most every PUMP_MIN_MS
 * when it is only that some worker's status arrived (with many workers that
 * is often, and each run tries every waiting request), and min_gap_s after
 * the last run for the safety net. An earlier run replaces a later one: the
 * safety net's must not hold back the run a status asks for. A run for a
 * change (a slot, a status: change) is wanted (router.pump_wanted) until it
 * runs. */
static void schedule_pump_after(router *r, double min_gap_s, bool change) {
    if (!r->handles_ok || !r->qhead || r->grace_over) return;
    if (change) r->pump_wanted = true;
    double wait = r->t_last_pump + min_gap_s - cs_now();
    uint64_t ms = wait > 0 ? (uint64_t)(wait * 1000) + 1 : 0;
    if (uv_is_active((uv_handle_t *)&r->pump) && uv_timer_get_due_in(&r->pump) <= ms) return;
    uv_timer_start(&r->pump, on_pump, ms, 0);
}

void cs__router_schedule_pump(router *r) {
    schedule_pump_after(r, 0, true);
}

void cs__router_on_pool_change(void *arg) {
    schedule_pump_after(arg, PUMP_MIN_MS / 1000.0, true);
}

/* A worker stopped answering: every attempt with a call there fails over. */
void cs__router_on_worker_down(void *arg, cs_pool_worker *w) {
    router *r = arg;
    req *next;
    for (req *q = r->live; q; q = next) {
        next = q->next;
        if (q->state == RQ_ENDED) continue;
        if (q->dleg && q->dleg->w == w)
            cs__req_fail_attempt(q, w, "decode", CS_RPC_UNAVAILABLE,
                                 "the worker stopped answering");
        else if (q->pleg && q->pleg->w == w)
            cs__req_fail_attempt(q, w, "prefill", CS_RPC_UNAVAILABLE,
                                 "the worker stopped answering");
    }
}

/* Bounds every wait: queue timeouts, the no-worker wait, request deadlines. */
void cs__router_on_tick(uv_timer_t *t) {
    router *r = t->data;
    double now = cs_now();
    req *next;
    for (req *q = r->live; q; q = next) {
        next = q->next;
        if (q->state == RQ_ENDED) continue;
        if (now >= q->t_deadline) {
            cs__req_end(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
            continue;
        }
        if (q->state == RQ_ADMITTING && q->dleg && now - q->t_attempt >= r->o->lease_ms / 1000.0) {
            /* admitting is a reservation, not work: a worker that cannot do it
             * within a lease period is stuck */
            cs__req_fail_attempt(q, q->dleg->w, "decode", CS_RPC_DEADLINE_EXCEEDED,
                                 "not admitted within --lease-ms");
            continue;
        }
        if (q->state != RQ_WAITING) continue;
        char msg[400];
        double waited = now - q->t_wait[q->wait];
        if (q->wait == WAIT_WORKER && waited >= r->o->no_worker_wait_ms / 1000.0) {
            int known = cs_pool_n_workers(r->pool, CS_POOL_DECODE);
            if (q->failures)
                snprintf(msg, sizeof msg,
                         "no decode worker can take the request: %d attempts failed (last: %s)",
                         q->failures, q->last_error);
            else
                snprintf(msg, sizeof msg,
                         "no decode worker is available (%d known, none usable for %lld ms)", known,
                         (long long)r->o->no_worker_wait_ms);
            cs__req_end(q, CS_RPC_UNAVAILABLE, msg);
        } else if (q->wait != WAIT_WORKER && waited >= r->o->queue_timeout_ms / 1000.0) {
            if (q->wait == WAIT_ROOM)
                snprintf(msg, sizeof msg,
                         "the cluster is overloaded: no decode worker had room for %zu tokens "
                         "within %lld ms (%d refusals); retry later",
                         q->n_ctx, (long long)r->o->queue_timeout_ms, q->refusals);
            else
                snprintf(msg, sizeof msg,
                         "the router is overloaded: the request waited %lld ms for one of "
                         "%lld slots (--max-inflight); retry later",
                         (long long)r->o->queue_timeout_ms, (long long)r->o->max_inflight);
            cs__req_end(q, CS_RPC_RESOURCE_EXHAUSTED, msg);
        }
    }
    /* a safety net: slots and statuses schedule runs themselves */
    if (r->qhead && r->n_placed < r->o->max_inflight) schedule_pump_after(r, 0.25, false);
}
