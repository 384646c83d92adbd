/* router.c: the router's Generation handlers and the request state machine
 * (DESIGN §4 request flow, §6 failure contract), on one libuv loop.
 *
 * A request (struct req) is validated and tokenized on arrival (api/wire.h,
 * exactly as the single-process server), then admitted: placed at once when
 * fewer than max-inflight are placed and nobody waits, else queued (FIFO,
 * at most max-queue), else refused RESOURCE_EXHAUSTED.
 *
 * An attempt: pick a decode worker (pool.h), open Worker/Decode with a new
 * transfer id; the worker admits (first message) or ends RESOURCE_EXHAUSTED
 * (then the next worker is tried; when all refuse, the request waits in the
 * queue for a status that shows room). For a long context the router then
 * calls Worker/Prefill on a prefill worker with the decode worker's KV
 * endpoint. Outputs stream back on Decode and are relayed to the client.
 *
 * Failures: a worker call that ends with anything else than OK (or than
 * INVALID_ARGUMENT, which goes to the client as is) fails the attempt: the
 * other call is cancelled (the workers free the lease and pages on cancel),
 * the failed worker is excluded for this request, and a new attempt starts:
 * a retry before any token was relayed, a migration after (context = prompt
 * + relayed tokens, latest RNG state). After max-retries failed attempts the
 * client gets UNAVAILABLE.
 *
 * Each worker call is a struct leg (request, worker, call); a leg's on_done
 * always runs (the RPC layer guarantees it), so a request is freed when its
 * client call is finished and its last leg has ended. Callbacks of a leg that
 * is no longer the request's current one (cancelled by a retry) only clean up.
 *
 * Shutdown (SIGTERM/SIGINT): health NOT_SERVING, the server stops accepting,
 * streams get grace-ms, then every request ends UNAVAILABLE and its worker
 * calls are cancelled; once the RPC server is gone, the pools, the HTTP
 * server and the RPC loop close and everything is freed in reverse order. */
#include "router.h"

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/metrics.h"
#include "chunkserve/proc.h"
#include "chunkserve/rpc.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "generation.h"
#include "pool.h"
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "wire.h"

#define SERVICE CS_GENERATION_SERVICE
#define WORKER "/chunkserve.v1.Worker/"
/* Unsent bytes a stream may hold for a client that does not read. */
#define MAX_UNSENT_BYTES ((size_t)4 << 20)
#define TICK_MS 20
#define PUMP_MIN_MS 10
#define CANCEL_DEADLINE_MS 1000

typedef struct router router;
typedef struct req req;

enum req_state {
    RQ_WAITING,   /* in the queue (or not yet placed) */
    RQ_ADMITTING, /* Decode call open, not admitted yet */
    RQ_PREFILL,   /* admitted; Prefill call in flight */
    RQ_STREAMING, /* admitted and prefilled (or local): tokens flow */
    RQ_ENDED,     /* the client's call is finished; legs may still be ending */
};

/* Why a request waits in the queue; each has its own bound. */
enum req_wait {
    WAIT_SLOT,   /* max-inflight placed: queue-timeout-ms */
    WAIT_ROOM,   /* decode workers refused or have no room: queue-timeout-ms */
    WAIT_WORKER, /* no usable decode worker: no-worker-wait-ms */
};

enum leg_kind { LEG_DECODE, LEG_PREFILL };

typedef struct leg {
    req *q;
    cs_pool_worker *w; /* referenced; active on it while the call lives */
    cs_rpc_client_call *c;
    enum leg_kind kind;
} leg;

struct req {
    router *r;
    cs_rpc_call *call; /* the client's; NULL once finished */
    char *id;
    uint64_t seq;
    enum req_state state;
    bool placed, queued;
    req *qprev, *qnext; /* the wait queue, in arrival order */
    req *prev, *next;   /* the router's live list */

    int32_t *ctx; /* prompt + every token relayed */
    size_t n_ctx, cap_ctx;
    int32_t n_prompt;
    int32_t max_new; /* tokens the client may get at most */
    int32_t n_relayed;
    Chunkserve__V1__SamplingParams *sampling; /* the client's, copied (NULL: none sent) */
    uint64_t rng[4];
    bool have_rng;

    /* The current attempt. */
    uint64_t transfer_id;
    leg *dleg, *pleg;
    cs_pool_worker *pw;      /* chosen prefill worker, before its call starts */
    cs_pool_worker *dw_last; /* decode worker of the attempt (referenced), for Cancel */
    cs_pool_worker *pw_last; /* prefill worker of the attempt (referenced), for Cancel */
    bool local, admitted, prefill_ok, sent_first;
    int legs; /* legs alive (current or not) */

    int failures, retries, migrations, refusals;
    cs_pool_marks marks;
    char last_error[300];

    enum req_wait wait;
    /* When the request first waited for each reason since it was last
     * admitted (0 = not yet): each wait has its own bound, and attempts that
     * are refused do not restart it. */
    double t_wait[3];

    double t_recv, t_deadline, t_first, t_last;
    int64_t t_recv_wall_us; /* CLOCK_REALTIME at receipt, for the worker's hop measurement */
    double t_attempt; /* the current Decode call's start */
    bool overhead_seen;
};

struct router {
    const cs_router_opts *o;
    const cs_model *model; /* vocabulary and config only */
    cs_wire_model wm;
    cs_proc *proc; /* the process shell: loop, RPC server, ops HTTP, drain */
    cs_rpc_loop *rl;
    cs_pool *pool;
    cs_metrics *metrics;
    uv_timer_t tick, pump;
    bool stopping, grace_over, handles_ok;
    req *live;
    int n_live;
    req *qhead, *qtail;
    int n_queued;
    int n_placed;
    double t_last_pump;
    uint64_t next_seq;
    uint64_t id_base; /* random per process: transfer ids and request ids */
    uint64_t n_transfers;

    struct {
        cs_metric *running, *waiting, *retries, *migrations, *prefill_local, *prefill_remote;
        cs_metric *ttft, *itl, *e2e, *overhead, *prompt_tokens, *gen_tokens;
        cs_metric *usable[2];
        cs_metric *codes[17];
    } m;
};

static void attempt(req *q);
static void schedule_pump(router *r);

/* ------------------------------------------------------------ helpers -- */

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Router-unique (a bijection of a counter), random-looking, never 0. */
static uint64_t new_transfer_id(router *r) {
    uint64_t id;
    do
        id = splitmix64(r->id_base + ++r->n_transfers);
    while (id == 0);
    return id;
}

static void count_code(router *r, int code) {
    if (code < 0 || code > 16 || !r->m.codes[code]) code = CS_RPC_UNKNOWN;
    cs_metric_inc(r->m.codes[code]);
}

static int64_t ms_left(const req *q) {
    double left = (q->t_deadline - cs_now()) * 1000.0;
    return left < 1 ? 0 : (int64_t)left;
}

/* ------------------------------------------------------- the queue -- */

static void queue_insert(router *r, req *q) {
    CS_ASSERT(!q->queued);
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
    q->queued = true;
    r->n_queued++;
}

static void queue_remove(router *r, req *q) {
    if (!q->queued) return;
    if (q->qprev)
        q->qprev->qnext = q->qnext;
    else
        r->qhead = q->qnext;
    if (q->qnext)
        q->qnext->qprev = q->qprev;
    else
        r->qtail = q->qprev;
    q->qprev = q->qnext = NULL;
    q->queued = false;
    r->n_queued--;
}

static void set_placed(req *q, bool placed) {
    if (q->placed == placed) return;
    q->placed = placed;
    q->r->n_placed += placed ? 1 : -1;
    if (!placed) schedule_pump(q->r);
}

/* Waits in the queue (keeping its place) with the given reason. A new
 * request (never attempted) finds the queue full: RESOURCE_EXHAUSTED. */
static void end_request(req *q, int code, const char *msg);
static void park(req *q, enum req_wait why) {
    router *r = q->r;
    if (!q->queued && !q->transfer_id && r->n_queued >= r->o->max_queue) {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "the router is overloaded: %d requests placed and %d waiting (--max-queue "
                 "%lld); retry later",
                 r->n_placed, r->n_queued, (long long)r->o->max_queue);
        end_request(q, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    set_placed(q, false);
    q->state = RQ_WAITING;
    if (!q->t_wait[why]) {
        q->t_wait[why] = cs_now();
        CS_LOGD("request %s: waits %s", q->id,
                why == WAIT_SLOT   ? "for a slot"
                : why == WAIT_ROOM ? "for KV room on a decode worker"
                                   : "for a usable decode worker");
    }
    q->wait = why;
    if (!q->queued) queue_insert(r, q);
}

/* ---------------------------------------------------------- the end -- */

static void req_maybe_free(req *q) {
    if (q->call || q->legs) return;
    router *r = q->r;
    CS_ASSERT(!q->queued && !q->placed);
    if (q->prev)
        q->prev->next = q->next;
    else
        r->live = q->next;
    if (q->next) q->next->prev = q->prev;
    r->n_live--;
    cs_pool_worker_unref(q->pw);
    cs_pool_worker_unref(q->dw_last);
    cs_pool_worker_unref(q->pw_last);
    cs_pool_marks_free(&q->marks);
    if (q->sampling) protobuf_c_message_free_unpacked(&q->sampling->base, NULL);
    free(q->ctx);
    free(q->id);
    free(q);
}

static void on_cancel_sent(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    cs_pool_worker *w = data;
    CS_LOGD("Worker/Cancel on %s: %s %s", cs_pool_worker_addr(w), cs_rpc_code_name(code), msg);
    cs_pool_worker_active(w, -1);
    cs_pool_worker_unref(w);
}

/* Worker/Cancel by transfer id, best effort, not tied to the request. */
static void send_cancel(req *q, cs_pool_worker *w) {
    if (!w || !cs_pool_worker_channel(w)) return;
    Chunkserve__V1__CancelRequest m = CHUNKSERVE__V1__CANCEL_REQUEST__INIT;
    m.transfer_id = q->transfer_id;
    m.request_id = q->id;
    cs_rpc_call_opts o = {.timeout_ms = CANCEL_DEADLINE_MS};
    cs_pool_worker_ref(w);
    cs_pool_worker_active(w, 1);
    if (cs_rpc_channel_call_msg(cs_pool_worker_channel(w), WORKER "Cancel", &m.base, &o, NULL,
                                on_cancel_sent, w, NULL) != 0) {
        cs_pool_worker_active(w, -1);
        cs_pool_worker_unref(w);
    }
}

/* Cancels the current attempt's calls; their on_done still comes (and only
 * cleans up). When the Prefill call already returned, the transfer may live
 * on in the workers without a call: Worker/Cancel tells both. */
static void drop_attempt(req *q, bool tell_workers) {
    if (q->dleg) {
        cs_rpc_client_call_cancel(q->dleg->c);
        q->dleg = NULL;
    }
    if (q->pleg) {
        cs_rpc_client_call_cancel(q->pleg->c);
        q->pleg = NULL;
    }
    if (tell_workers && q->prefill_ok) {
        send_cancel(q, q->dw_last);
        send_cancel(q, q->pw_last);
    }
    cs_pool_worker_unref(q->pw);
    q->pw = NULL;
    q->admitted = q->prefill_ok = false;
}

static const char *code_msg(int code) {
    switch (code) {
    case CS_RPC_CANCELLED: return "cancelled";
    case CS_RPC_DEADLINE_EXCEEDED: return "the request's deadline passed";
    default: return NULL;
    }
}

/* Ends the request for the client (once) and cancels what runs for it. */
static void end_request(req *q, int code, const char *msg) {
    router *r = q->r;
    if (q->state == RQ_ENDED) return;
    drop_attempt(q, code != CS_RPC_OK);
    queue_remove(r, q);
    set_placed(q, false);
    q->state = RQ_ENDED;
    double now = cs_now();
    if (q->call) {
        cs_rpc_call_finish(q->call, code, msg ? msg : code_msg(code));
        q->call = NULL;
    }
    count_code(r, code);
    if (code == CS_RPC_OK) cs_metric_observe(r->m.e2e, now - q->t_recv);
    if (code == CS_RPC_OK || code == CS_RPC_CANCELLED)
        CS_LOGI("request %s: %s, %d prompt + %d completion tokens in %.3f s (ttft %.3f s, %d "
                "retries, %d migrations)",
                q->id, cs_rpc_code_name(code), q->n_prompt, q->n_relayed, now - q->t_recv,
                q->t_first ? q->t_first - q->t_recv : 0.0, q->retries, q->migrations);
    else
        CS_LOGW("request %s: %s: %s (%d completion tokens, %d retries, %d migrations, %.3f s)",
                q->id, cs_rpc_code_name(code),
                msg              ? msg
                : code_msg(code) ? code_msg(code)
                                 : "",
                q->n_relayed, q->retries, q->migrations, now - q->t_recv);
    req_maybe_free(q);
}

/* ------------------------------------------------------------- legs -- */

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

/* After its on_done: the leg's worker reference and the request's count. */
static void leg_free(leg *l) {
    req *q = l->q;
    cs_pool_worker_active(l->w, -1);
    cs_pool_worker_unref(l->w);
    free(l);
    q->legs--;
    req_maybe_free(q);
}

/* ---------------------------------------------------------- failures -- */

/* The attempt failed on worker w (code, msg): exclude it, try again. */
static void fail_attempt(req *q, cs_pool_worker *w, const char *what, int code, const char *msg) {
    router *r = q->r;
    snprintf(q->last_error, sizeof q->last_error, "%s on %s: %s%s%s", what,
             w ? cs_pool_worker_addr(w) : "?", cs_rpc_code_name(code), msg && *msg ? ": " : "",
             msg ? msg : "");
    drop_attempt(q, false);
    if (w) {
        if (code == CS_RPC_UNAVAILABLE) cs_pool_worker_suspect(w, q->last_error);
        if (cs_pool_mark_add(&q->marks.excluded, &q->marks.n_excluded, w) != 0) {
            end_request(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
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
        end_request(q, CS_RPC_UNAVAILABLE, m);
        return;
    }
    CS_LOGW("request %s: %s; %s (%d/%d)", q->id, q->last_error, migrate ? "migrating" : "retrying",
            q->failures, (int)r->o->max_retries);
    attempt(q);
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
    }
    /* a failed stream's finish is not the client's: its tokens are, then we fail over */
    if (failed) out->finish_reason = CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    if (ctx_append(q, out->token_ids, n) != 0) {
        out->n_logprobs = n_logprobs;
        end_request(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return true;
    }
    double now = cs_now();
    if (n) {
        if (q->n_relayed == 0) {
            q->t_first = now;
            cs_metric_observe(r->m.ttft, now - q->t_recv);
            cs_metric_add(r->m.prompt_tokens, q->n_prompt);
        } else {
            cs_metric_observe(r->m.itl, now - q->t_last);
        }
        q->t_last = now;
        q->n_relayed += (int32_t)n;
        cs_metric_add(r->m.gen_tokens, (double)n);
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
            usage.prompt_tokens = q->n_prompt;
            usage.completion_tokens = q->n_relayed;
            out->usage = &usage;
        } else {
            out->usage = NULL;
        }
        rc = cs_rpc_call_send_msg(q->call, &out->base);
        out->usage = worker_usage; /* both freed with the message */
        out->request_id = worker_id;
        q->sent_first = true;
    }
    out->n_logprobs = n_logprobs;
    if (rc == CS_ENOMEM) {
        end_request(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory for this stream");
        return true;
    }
    if (q->call && rc == 0 && cs_rpc_call_pending_bytes(q->call) > MAX_UNSENT_BYTES) {
        end_request(q, CS_RPC_RESOURCE_EXHAUSTED,
                    "the client is not reading its stream; generation stopped");
        return true;
    }
    if (final_ok) {
        /* The Decode stream ends OK by itself after its last message, the
         * Prefill call (if still out) on its own: leave them be. */
        leg *d = q->dleg;
        q->dleg = NULL;
        q->pleg = NULL;
        if (truncated && d) cs_rpc_client_call_cancel(d->c);
        end_request(q, CS_RPC_OK, NULL);
        return true;
    }
    if (failed && q->dleg) {
        fail_attempt(q, q->dleg->w, "decode",
                     fin == CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_ERROR ? CS_RPC_INTERNAL
                                                                               : CS_RPC_ABORTED,
                     "the stream ended with finish reason error/cancelled");
        return true;
    }
    return false;
}

/* ---------------------------------------------------------- prefill -- */

static void on_prefill_done(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    leg *l = data;
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
        q->prefill_ok = true;
        CS_LOGD("request %s: prefill on %s done", q->id, cs_pool_worker_addr(l->w));
        if (q->state == RQ_PREFILL) q->state = RQ_STREAMING;
    } else if (code == CS_RPC_INVALID_ARGUMENT) {
        end_request(q, code, msg);
    } else if (ms_left(q) <= 0) {
        end_request(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
    } else {
        fail_attempt(q, l->w, "prefill", code, msg);
    }
    leg_free(l);
}

/* The decode worker admitted the transfer: prefill it remotely. */
static void start_prefill(req *q, const char *kv_endpoint, int kv_transport) {
    cs_pool_worker *pw = q->pw;
    q->pw = NULL;
    leg *l = leg_new(q, pw, LEG_PREFILL);
    cs_pool_worker_unref(pw); /* the leg holds its own reference */
    if (!l) {
        end_request(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    cs_pool_worker_unref(q->pw_last);
    q->pw_last = pw;
    cs_pool_worker_ref(pw);
    Chunkserve__V1__PrefillRequest m = CHUNKSERVE__V1__PREFILL_REQUEST__INIT;
    Chunkserve__V1__RngState rng = CHUNKSERVE__V1__RNG_STATE__INIT;
    m.request_id = q->id;
    m.transfer_id = q->transfer_id;
    m.n_token_ids = q->n_ctx;
    m.token_ids = q->ctx;
    m.num_prompt_tokens = q->n_prompt;
    m.sampling = q->sampling;
    if (q->have_rng) {
        rng.n_s = 4;
        rng.s = q->rng;
        m.rng_state = &rng;
    }
    m.kv_endpoint = (char *)kv_endpoint;
    m.kv_transport = kv_transport;
    m.decode_worker_id = (char *)cs_pool_worker_id(q->dleg->w);
    cs_rpc_call_opts o = {.timeout_ms = ms_left(q)};
    q->pleg = l;
    q->state = RQ_PREFILL;
    CS_LOGD("request %s: prefill %zu tokens on %s -> %s (transfer %016" PRIx64 ")", q->id, q->n_ctx,
            cs_pool_worker_addr(pw), kv_endpoint, q->transfer_id);
    if (o.timeout_ms <= 0) {
        q->pleg = NULL;
        leg_free(l);
        end_request(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
        return;
    }
    if (!cs_pool_worker_channel(pw) ||
        cs_rpc_channel_call_msg(cs_pool_worker_channel(pw), WORKER "Prefill", &m.base, &o, NULL,
                                on_prefill_done, l, &l->c) != 0) {
        char why[300];
        snprintf(why, sizeof why, "cannot call it: %s", cs_last_error());
        q->pleg = NULL;
        cs_pool_worker_ref(pw);
        leg_free(l);
        fail_attempt(q, pw, "prefill", CS_RPC_UNAVAILABLE, why);
        cs_pool_worker_unref(pw);
    }
}

/* ----------------------------------------------------------- decode -- */

static void on_decode_message(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    leg *l = data;
    req *q = l->q;
    if (q->dleg != l || q->state == RQ_ENDED) return;
    Chunkserve__V1__DecodeResponse *m = NULL;
    if (cs_rpc_unpack(&chunkserve__v1__decode_response__descriptor, buf, len,
                      (ProtobufCMessage **)&m) != 0) {
        fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "malformed DecodeResponse");
        return;
    }
    if (m->rng_state && m->rng_state->n_s == 4) {
        memcpy(q->rng, m->rng_state->s, sizeof q->rng);
        q->have_rng = true;
    }
    switch (m->event_case) {
    case CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_ADMITTED: {
        if (q->admitted) {
            fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "admitted twice");
            break;
        }
        q->admitted = true;
        memset(q->t_wait, 0, sizeof q->t_wait);
        const Chunkserve__V1__DecodeAdmitted *a = m->admitted;
        const char *ep =
            a->kv_endpoint && a->kv_endpoint[0] ? a->kv_endpoint : cs_pool_worker_kv_endpoint(l->w);
        int tr = a->kv_transport ? (int)a->kv_transport : cs_pool_worker_kv_transport(l->w);
        CS_LOGD("request %s: admitted by %s (%d pages, kv %s)", q->id, cs_pool_worker_addr(l->w),
                a->pages_reserved, ep);
        if (q->local) {
            cs_metric_inc(q->r->m.prefill_local);
            q->state = RQ_STREAMING;
        } else if (!ep[0]) {
            fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "admitted without a KV endpoint");
        } else {
            start_prefill(q, ep, tr);
        }
        break;
    }
    case CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_OUTPUT:
        if (!q->admitted) {
            fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL, "output before admitted");
            break;
        }
        relay(q, m->output);
        break;
    default: break; /* an event of a newer worker: ignore */
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

static void on_decode_done(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    leg *l = data;
    req *q = l->q;
    if (q->dleg != l || q->state == RQ_ENDED) {
        leg_free(l);
        return;
    }
    q->dleg = NULL;
    if (code == CS_RPC_RESOURCE_EXHAUSTED && !q->admitted) {
        /* refused: no room there now; try the next decode worker */
        q->refusals++;
        CS_LOGD("request %s: decode worker %s refused: %s", q->id, cs_pool_worker_addr(l->w), msg);
        drop_attempt(q, false);
        if (cs_pool_mark_add(&q->marks.refused, &q->marks.n_refused, l->w) != 0)
            end_request(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        else
            attempt(q);
    } else if (code == CS_RPC_INVALID_ARGUMENT) {
        end_request(q, code, msg);
    } else if (ms_left(q) <= 0) {
        end_request(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
    } else if (code == CS_RPC_OK) {
        fail_attempt(q, l->w, "decode", CS_RPC_INTERNAL,
                     "the stream ended without a finish reason");
    } else {
        fail_attempt(q, l->w, "decode", code, msg);
    }
    leg_free(l);
}

/* Starts an attempt on decode worker dw (a reference from the pool, taken
 * over here). */
static void start_decode(req *q, cs_pool_worker *dw) {
    router *r = q->r;
    queue_remove(r, q);
    set_placed(q, true);
    leg *l = leg_new(q, dw, LEG_DECODE);
    cs_pool_worker_unref(dw);
    if (!l) {
        end_request(q, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    cs_pool_worker_unref(q->dw_last);
    q->dw_last = dw;
    cs_pool_worker_ref(dw);
    q->transfer_id = new_transfer_id(r);
    q->admitted = q->prefill_ok = false;
    /* remote prefill for long contexts when a prefill worker can take it */
    cs_pool_worker_unref(q->pw);
    q->pw = NULL;
    if ((int64_t)q->n_ctx >= r->o->local_prefill_threshold)
        q->pw = cs_pool_place(r->pool, CS_POOL_PREFILL, (int64_t)q->n_ctx, &q->marks, NULL);
    q->local = q->pw == NULL;

    Chunkserve__V1__DecodeRequest m = CHUNKSERVE__V1__DECODE_REQUEST__INIT;
    Chunkserve__V1__RngState rng = CHUNKSERVE__V1__RNG_STATE__INIT;
    m.request_id = q->id;
    m.transfer_id = q->transfer_id;
    m.n_token_ids = q->n_ctx;
    m.token_ids = q->ctx;
    m.num_prompt_tokens = q->n_prompt;
    m.sampling = q->sampling;
    if (q->have_rng) {
        rng.n_s = 4;
        rng.s = q->rng;
        m.rng_state = &rng;
    }
    m.local_prefill = q->local;
    m.lease_ms = (int32_t)r->o->lease_ms;
    cs_rpc_call_opts o = {.timeout_ms = ms_left(q)};
    /* The wall-clock time of the client call's receipt, on the first attempt:
     * the decode worker measures receipt-to-receipt (same host or synced
     * clocks: chunkserve:router_to_worker_seconds). */
    char t0[32];
    cs_rpc_metadata md = {"x-chunkserve-received-us", t0};
    if (!q->overhead_seen) {
        snprintf(t0, sizeof t0, "%" PRId64, q->t_recv_wall_us);
        o.metadata = &md;
        o.n_metadata = 1;
    }
    q->dleg = l;
    q->state = RQ_ADMITTING;
    q->t_attempt = cs_now();
    if (!q->overhead_seen) {
        q->overhead_seen = true;
        cs_metric_observe(r->m.overhead, cs_now() - q->t_recv);
    }
    CS_LOGD("request %s: decode on %s, %s prefill%s%s, %zu tokens (transfer %016" PRIx64 ")", q->id,
            cs_pool_worker_addr(dw), q->local ? "local" : "remote", q->pw ? " on " : "",
            q->pw ? cs_pool_worker_addr(q->pw) : "", q->n_ctx, q->transfer_id);
    if (o.timeout_ms <= 0) {
        q->dleg = NULL;
        leg_free(l);
        end_request(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
        return;
    }
    if (!cs_pool_worker_channel(dw) ||
        cs_rpc_channel_call_msg(cs_pool_worker_channel(dw), WORKER "Decode", &m.base, &o,
                                on_decode_message, on_decode_done, l, &l->c) != 0) {
        char why[300];
        snprintf(why, sizeof why, "cannot call it: %s", cs_last_error());
        q->dleg = NULL;
        cs_pool_worker_ref(dw);
        leg_free(l);
        fail_attempt(q, dw, "decode", CS_RPC_UNAVAILABLE, why);
        cs_pool_worker_unref(dw);
    }
}

/* Places the request now, or parks it in the queue with the reason. */
static void attempt(req *q) {
    router *r = q->r;
    if (q->state == RQ_ENDED || !q->call) return;
    if (r->grace_over) {
        end_request(q, CS_RPC_UNAVAILABLE, "the router is shutting down");
        return;
    }
    if (!q->placed && r->n_placed >= r->o->max_inflight) {
        park(q, WAIT_SLOT);
        return;
    }
    int cand = 0;
    cs_pool_worker *dw = cs_pool_place(r->pool, CS_POOL_DECODE, (int64_t)q->n_ctx, &q->marks, &cand);
    if (dw) {
        start_decode(q, dw);
        return;
    }
    enum req_wait why = cand ? WAIT_ROOM : WAIT_WORKER;
    if (why == WAIT_WORKER && q->failures > 0 && cs_pool_n_usable(r->pool, CS_POOL_DECODE) > 0 &&
        q->wait != WAIT_WORKER) {
        /* usable workers exist but each failed this request already */
        CS_LOGD("request %s: every usable decode worker failed it; waiting for another", q->id);
    }
    park(q, why);
}

/* ------------------------------------------------- queue processing -- */

static void on_pump(uv_timer_t *t) {
    router *r = t->data;
    r->t_last_pump = cs_now();
    req *next;
    for (req *q = r->qhead; q; q = next) {
        next = q->qnext;
        if (r->n_placed >= r->o->max_inflight) break;
        attempt(q); /* starts it (leaves the queue) or keeps its place */
    }
}

/* Runs the queue soon: at once when a slot freed, at most every PUMP_MIN_MS
 * when it is only that some worker's status arrived (with many workers that
 * is often, and each run tries every waiting request). */
static void schedule_pump_after(router *r, double min_gap_s) {
    if (!r->handles_ok || !r->qhead || r->grace_over || uv_is_active((uv_handle_t *)&r->pump))
        return;
    double wait = r->t_last_pump + min_gap_s - cs_now();
    uv_timer_start(&r->pump, on_pump, wait > 0 ? (uint64_t)(wait * 1000) + 1 : 0, 0);
}

static void schedule_pump(router *r) {
    schedule_pump_after(r, 0);
}

static void on_pool_change(void *arg) {
    schedule_pump_after(arg, PUMP_MIN_MS / 1000.0);
}

/* A worker stopped answering: every attempt with a call there fails over. */
static void on_worker_down(void *arg, cs_pool_worker *w) {
    router *r = arg;
    req *next;
    for (req *q = r->live; q; q = next) {
        next = q->next;
        if (q->state == RQ_ENDED) continue;
        if (q->dleg && q->dleg->w == w)
            fail_attempt(q, w, "decode", CS_RPC_UNAVAILABLE, "the worker stopped answering");
        else if (q->pleg && q->pleg->w == w)
            fail_attempt(q, w, "prefill", CS_RPC_UNAVAILABLE, "the worker stopped answering");
    }
}

/* Bounds every wait: queue timeouts, the no-worker wait, request deadlines. */
static void on_tick(uv_timer_t *t) {
    router *r = t->data;
    double now = cs_now();
    req *next;
    for (req *q = r->live; q; q = next) {
        next = q->next;
        if (q->state == RQ_ENDED) continue;
        if (now >= q->t_deadline) {
            end_request(q, CS_RPC_DEADLINE_EXCEEDED, NULL);
            continue;
        }
        if (q->state == RQ_ADMITTING && q->dleg && now - q->t_attempt >= r->o->lease_ms / 1000.0) {
            /* admitting is a reservation, not work: a worker that cannot do it
             * within a lease period is stuck */
            fail_attempt(q, q->dleg->w, "decode", CS_RPC_DEADLINE_EXCEEDED,
                         "not admitted within --lease-ms");
            continue;
        }
        if (!q->queued) continue;
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
            end_request(q, CS_RPC_UNAVAILABLE, msg);
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
            end_request(q, CS_RPC_RESOURCE_EXHAUSTED, msg);
        }
    }
    /* a safety net: slots and statuses schedule runs themselves */
    if (r->qhead && r->n_placed < r->o->max_inflight) schedule_pump_after(r, 0.25);
}

/* --------------------------------------------------------- handlers -- */

/* The client cancelled or went away, or its deadline passed: the workers'
 * calls are cancelled at once (that is how cancellation reaches them). */
static void on_call_cancel(cs_rpc_call *c, void *data) {
    req *q = data;
    bool deadline = cs_rpc_call_deadline_ms(c) <= 0;
    CS_LOGD("request %s: call cancelled (%s)", q->id, deadline ? "deadline" : "client");
    end_request(q, deadline ? CS_RPC_DEADLINE_EXCEEDED : CS_RPC_CANCELLED, NULL);
}

static int copy_sampling(const Chunkserve__V1__SamplingParams *p,
                         Chunkserve__V1__SamplingParams **out) {
    *out = NULL;
    if (!p) return 0;
    size_t len = protobuf_c_message_get_packed_size(&p->base);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) return CS_ENOMEM;
    protobuf_c_message_pack(&p->base, buf);
    int rc = cs_rpc_unpack(&chunkserve__v1__sampling_params__descriptor, buf, len,
                           (ProtobufCMessage **)out);
    free(buf);
    return rc ? CS_ENOMEM : 0;
}

static void handle_generate(cs_rpc_call *c, void *data) {
    router *r = data;
    const Chunkserve__V1__GenerateRequest *m = (const void *)cs_rpc_call_request_msg(c);
    if (r->stopping) {
        count_code(r, CS_RPC_UNAVAILABLE);
        cs_rpc_call_finish(c, CS_RPC_UNAVAILABLE, "the router is shutting down");
        return;
    }
    double t_recv = cs_now();
    uint64_t seq = ++r->next_seq;
    cs_wire_request w;
    int rc = cs_wire_generate_request(&r->wm, m, seq, &w);
    if (rc) {
        int code = cs_rpc_code_of_status(rc);
        CS_LOGD("request %s rejected: %s", m->request_id, cs_last_error());
        count_code(r, code);
        cs_rpc_call_finish(c, code, cs_last_error());
        return;
    }
    bool queue = r->n_placed >= r->o->max_inflight || r->qhead;
    if (queue && r->n_queued >= r->o->max_queue) {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "the router is overloaded: %d requests placed and %d waiting (--max-queue "
                 "%lld); retry later",
                 r->n_placed, r->n_queued, (long long)r->o->max_queue);
        cs_wire_request_free(&w);
        count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    req *q = calloc(1, sizeof *q);
    char idbuf[40];
    snprintf(idbuf, sizeof idbuf, "rt-%016" PRIx64, splitmix64(r->id_base ^ (seq << 1)));
    if (q) q->id = strdup(m->request_id[0] ? m->request_id : idbuf);
    if (!q || !q->id || copy_sampling(m->sampling, &q->sampling) != 0) {
        if (q) free(q->id);
        free(q);
        cs_wire_request_free(&w);
        count_code(r, CS_RPC_RESOURCE_EXHAUSTED);
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "the router ran out of memory");
        return;
    }
    const cs_model_config *cfg = cs_model_get_config(r->wm.model);
    q->r = r;
    q->call = c;
    q->seq = seq;
    q->ctx = w.prompt; /* taken over */
    q->n_ctx = q->cap_ctx = (size_t)w.r.n_prompt;
    q->n_prompt = w.r.n_prompt;
    w.prompt = NULL;
    w.r.prompt = NULL;
    int32_t room = cfg->ctx_len - q->n_prompt;
    q->max_new = m->sampling && m->sampling->max_tokens > 0 && m->sampling->max_tokens < room
                     ? m->sampling->max_tokens
                     : room;
    q->t_recv = t_recv;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    q->t_recv_wall_us = (int64_t)wall.tv_sec * 1000000 + wall.tv_nsec / 1000;
    int64_t client_ms = cs_rpc_call_deadline_ms(c);
    q->t_deadline =
        t_recv + (client_ms == INT64_MAX ? r->o->request_timeout_ms : client_ms) / 1000.0;
    q->state = RQ_WAITING;
    q->next = r->live;
    if (r->live) r->live->prev = q;
    r->live = q;
    r->n_live++;
    cs_wire_request_free(&w);
    CS_LOGD("request %s: %d prompt tokens, up to %d new", q->id, q->n_prompt, q->max_new);
    if (cs_rpc_call_on_cancel(c, on_call_cancel, q) != 0) {
        on_call_cancel(c, q); /* already dead */
        return;
    }
    if (queue) {
        park(q, WAIT_SLOT);
        if (r->n_placed < r->o->max_inflight) schedule_pump(r); /* others wait for room */
    } else {
        attempt(q);
    }
}

/* ---------------------------------------------------------- metrics -- */

static const double e2e_buckets[] = {0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,
                                     10,   20,  40,   60,  120, 300, 600};
static const double overhead_buckets[] = {1e-5, 5e-5, 1e-4,  2.5e-4, 5e-4, 1e-3, 2.5e-3,
                                          5e-3, 0.01, 0.025, 0.05,   0.1,  0.5,  1};
#define N_BUCKETS(b) (sizeof b / sizeof b[0])
#define M(f) offsetof(router, m.f)
#define REQUESTS(code, name)                                                                   \
    {M(codes[code]), "chunkserve:requests_total", CS_METRIC_COUNTER, "code=\"" name "\"",     \
     "Generate requests ended, by gRPC status.", NULL, 0}
#define PREFILLS "Prefills, on the decode worker (local) or on a prefill worker (remote)."
/* The router's metrics: one table, the twin of its config table
 * (chunkserve-router --metrics-json prints it). */
static const cs_metric_def router_metrics[] = {
    {M(running), "chunkserve:num_requests_running", CS_METRIC_GAUGE, NULL,
     "Requests placed on workers (Decode call open).", NULL, 0},
    {M(waiting), "chunkserve:num_requests_waiting", CS_METRIC_GAUGE, NULL, "Requests waiting in the router's queue.",
     NULL, 0},
    REQUESTS(CS_RPC_OK, "OK"),
    REQUESTS(CS_RPC_CANCELLED, "CANCELLED"),
    REQUESTS(CS_RPC_UNKNOWN, "UNKNOWN"),
    REQUESTS(CS_RPC_INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    REQUESTS(CS_RPC_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    REQUESTS(CS_RPC_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"),
    REQUESTS(CS_RPC_FAILED_PRECONDITION, "FAILED_PRECONDITION"),
    REQUESTS(CS_RPC_ABORTED, "ABORTED"),
    REQUESTS(CS_RPC_INTERNAL, "INTERNAL"),
    REQUESTS(CS_RPC_UNAVAILABLE, "UNAVAILABLE"),
    {M(prefill_local), "chunkserve:prefills_total", CS_METRIC_COUNTER, "path=\"local\"", PREFILLS, NULL, 0},
    {M(prefill_remote), "chunkserve:prefills_total", CS_METRIC_COUNTER, "path=\"remote\"", PREFILLS, NULL, 0},
    {M(retries), "chunkserve:retries_total", CS_METRIC_COUNTER, NULL,
     "Attempts that failed before any token and were retried.", NULL, 0},
    {M(migrations), "chunkserve:migrations_total", CS_METRIC_COUNTER, NULL,
     "Attempts that failed after tokens streamed and were migrated to another worker.", NULL, 0},
    {M(ttft), "chunkserve:time_to_first_token_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Receipt of the request to its first token relayed.", cs_metrics_ttft_buckets, 0},
    {M(itl), "chunkserve:inter_token_latency_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Time between token messages relayed to a client.", cs_metrics_itl_buckets, 0},
    {M(e2e), "chunkserve:e2e_request_latency_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Receipt of the request to its last message (OK only).", e2e_buckets, N_BUCKETS(e2e_buckets)},
    {M(overhead), "chunkserve:router_overhead_seconds", CS_METRIC_HISTOGRAM, NULL,
     "Receipt of the request to its first Decode call (validation, tokenization, placement).", overhead_buckets,
     N_BUCKETS(overhead_buckets)},
    {M(prompt_tokens), "chunkserve:prompt_tokens_total", CS_METRIC_COUNTER, NULL,
     "Prompt tokens of requests that got a first token.", NULL, 0},
    {M(gen_tokens), "chunkserve:generation_tokens_total", CS_METRIC_COUNTER, NULL, "Tokens relayed to clients.",
     NULL, 0},
    {M(usable[CS_POOL_PREFILL]), "chunkserve:workers_usable", CS_METRIC_GAUGE, "role=\"prefill\"",
     "Workers usable now.", NULL, 0},
    {M(usable[CS_POOL_DECODE]), "chunkserve:workers_usable", CS_METRIC_GAUGE, "role=\"decode\"",
     "Workers usable now.", NULL, 0},
};
#undef M
#undef REQUESTS
#undef PREFILLS
#define N_ROUTER_METRICS (sizeof router_metrics / sizeof router_metrics[0])

void cs_router_print_metrics_json(void *f) { cs_metrics_print_json(router_metrics, N_ROUTER_METRICS, f); }

static void metrics_register(router *r) {
    /* the standard latency bucket sets' lengths are not constant expressions */
    cs_metric_def t[N_ROUTER_METRICS];
    memcpy(t, router_metrics, sizeof t);
    for (size_t i = 0; i < N_ROUTER_METRICS; i++) {
        if (t[i].buckets == cs_metrics_ttft_buckets) t[i].n_buckets = cs_metrics_n_ttft_buckets;
        if (t[i].buckets == cs_metrics_itl_buckets) t[i].n_buckets = cs_metrics_n_itl_buckets;
    }
    cs_metrics_register_table(r->metrics, t, N_ROUTER_METRICS, r);
}

static void update_metrics(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    cs_metric_set(r->m.running, r->n_placed);
    cs_metric_set(r->m.waiting, r->n_queued);
    for (int role = 0; role < 2; role++)
        cs_metric_set(r->m.usable[role],
                      r->pool ? cs_pool_n_usable(r->pool, (enum cs_pool_role)role) : 0);
}

/* ---------------------------------------- the process shell's hooks -- */

static bool ready(cs_proc *p, void *arg, char *why, size_t why_len) {
    (void)p;
    router *r = arg;
    int n = r->pool ? cs_pool_n_usable(r->pool, CS_POOL_DECODE) : 0;
    if (n == 0 && !r->o->ready_without_workers) {
        snprintf(why, why_len, "no usable decode worker (%d known)",
                 r->pool ? cs_pool_n_workers(r->pool, CS_POOL_DECODE) : 0);
        return false;
    }
    return true;
}

static int start(cs_proc *p, void *arg) {
    router *r = arg;
    const cs_router_opts *o = r->o;
    r->proc = p;
    r->rl = cs_proc_rpc_loop(p);
    r->metrics = cs_proc_metrics(p);
    metrics_register(r);
    cs_rpc_server *srv = cs_proc_server(p);
    int rc = cs_rpc_server_add_method(srv, "/" SERVICE "/Generate", CS_RPC_SERVER_STREAMING,
                                      &chunkserve__v1__generate_request__descriptor, handle_generate, r);
    if (!rc) rc = cs_generation_add_unary(srv, &r->wm);
    if (rc) return rc;
    const cs_model_config *cfg = cs_model_get_config(r->model);
    cs_pool_opts po = {
        .static_workers = {o->prefill_workers, o->decode_workers},
        .dns = {o->prefill_dns, o->decode_dns},
        .dns_refresh_ms = (int32_t)o->dns_refresh_ms,
        .status_interval_ms = (int32_t)o->status_interval_ms,
        .expect_n_vocab = cfg->n_vocab,
        .expect_arch = cfg->arch,
        .expect_ctx_len = cfg->ctx_len,
        .on_change = on_pool_change,
        .on_down = on_worker_down,
        .arg = r,
    };
    if ((rc = cs_pool_init(cs_proc_uv(p), r->rl, &po, &r->pool))) return rc;
    uv_timer_init(cs_proc_uv(p), &r->tick);
    uv_timer_init(cs_proc_uv(p), &r->pump);
    r->tick.data = r->pump.data = r;
    r->handles_ok = true;
    uv_timer_start(&r->tick, on_tick, TICK_MS, TICK_MS);
    return 0;
}

static void started(cs_proc *p, void *arg) {
    router *r = arg;
    const cs_model_config *cfg = cs_model_get_config(r->model);
    CS_LOGI("routing '%s' (vocab %d, context %d) on %s:%d; max %lld in flight, %lld queued; "
            "local prefill below %lld tokens",
            r->wm.name, cfg->n_vocab, cfg->ctx_len, r->o->host, cs_proc_port(p), (long long)r->o->max_inflight,
            (long long)r->o->max_queue, (long long)r->o->local_prefill_threshold);
}

static int32_t n_open(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    return r->n_live;
}

/* New Generate calls are refused (UNAVAILABLE) from now on; the requests
 * already here keep going until they end or the grace period does. */
static void drain(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    r->stopping = true;
    CS_LOGI("draining: %d requests (%d placed, %d waiting)", r->n_live, r->n_placed, r->n_queued);
}

/* Grace is over: what still streams or waits ends UNAVAILABLE. */
static void cancel_all(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    r->grace_over = true;
    int n = 0;
    req *next;
    for (req *q = r->live; q; q = next) {
        next = q->next;
        if (q->state == RQ_ENDED) continue;
        end_request(q, CS_RPC_UNAVAILABLE, "the router is shutting down");
        n++;
    }
    if (n) CS_LOGI("grace period over: %d requests ended", n);
}

/* Every client call has ended; their worker calls end as the channels go. */
static void stop(cs_proc *p, void *arg) {
    (void)p;
    router *r = arg;
    if (r->handles_ok) {
        r->handles_ok = false;
        uv_close((uv_handle_t *)&r->tick, NULL);
        uv_close((uv_handle_t *)&r->pump, NULL);
    }
    cs_pool_close(r->pool);
    r->pool = NULL;
}

static const cs_proc_role router_proc = {
    .name = "router",
    .health_service = SERVICE,
    .start = start,
    .started = started,
    .metrics = update_metrics,
    .ready = ready,
    .n_open = n_open,
    .drain = drain,
    .cancel_all = cancel_all,
    .stop = stop,
};

/* --------------------------------------------------------------- run -- */

int cs_router_run(const cs_model *model, const cs_router_opts *o) {
    router *r = calloc(1, sizeof *r);
    if (!r) return cs_fail(CS_ENOMEM, "out of memory");
    r->o = o;
    r->model = model;
    if (getrandom(&r->id_base, sizeof r->id_base, 0) != sizeof r->id_base)
        r->id_base = (uint64_t)time(NULL) << 20 ^ (uint64_t)getpid();
    /* KV room is the workers' to judge: no pool bound here */
    cs_wire_model_init(&r->wm, model, o->model);
    r->wm.n_kv_pages = INT32_MAX;
    r->wm.page_size = 16;
    cs_proc_opts po = {.host = o->host,
                       .port = (int)o->port,
                       .http_host = o->http_host,
                       .http_port = (int)o->http_port,
                       .grace_ms = o->grace_ms};
    int rc = cs_proc_run(&po, &router_proc, r);
    CS_ASSERT(rc || r->n_live == 0);
    free(r);
    return rc;
}
