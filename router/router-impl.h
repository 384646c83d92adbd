/* router-impl.h: inside chunkserve-router (internal to router/). The router
 * is three parts, each in its own file:
 *
 *   router.c   the Generation handler (validation, admission) and the
 *              process shell's hooks (chunkserve/proc.h), metrics, run;
 *   request.c  a request's life: the wait queue, attempts, retries and
 *              migration, the relay to the client, its end; an explicit
 *              state machine (the table below);
 *   legs.c     the worker legs: one Worker/Decode or Worker/Prefill call
 *              each, whose messages and callbacks become request events.
 *
 * A request's states, and the only transitions set_state allows (CS_ASSERT):
 *
 *   from \ to   WAITING      ADMITTING        PREFILL        STREAMING        ENDED
 *   NEW         queued (a)   placed (b)       -              -                any end (e)
 *   WAITING     -            placed (b)       -              -                any end (e)
 *   ADMITTING   parked (c)   retry (d)        admitted (f)   admitted local   any end (e)
 *   PREFILL     parked (c)   retry (d)        -              prefilled (g)    any end (e)
 *   STREAMING   parked (c)   migration (d)    -              -                any end (e)
 *   ENDED       -            -                -              -                -
 *
 *   (a) the router is full (max-inflight placed), or others wait and a run of
 *       the queue is wanted (router.pump_wanted): it joins the FIFO queue (at
 *       most max-queue, else RESOURCE_EXHAUSTED); WAITING is
 *       exactly "in the queue", with a reason (enum req_wait) and a bound;
 *   (b) a decode worker was chosen: a Decode call opens with a new transfer
 *       id; ADMITTING, PREFILL and STREAMING are exactly "placed" (they count
 *       against max-inflight);
 *   (c) no worker can take it now (all refused, none usable, no slot);
 *   (d) the attempt failed (a worker's error, silence, a refusal with others
 *       left): the calls are cancelled, the worker excluded, the next attempt
 *       starts at once; a migration when tokens were already relayed (the
 *       context is prompt + relayed tokens, with the latest RNG state);
 *   (e) OK (the last token), the client's cancel or deadline, bad input from
 *       a worker (INVALID_ARGUMENT), max-retries failed attempts, a wait past
 *       its bound, the router shutting down, out of memory;
 *   (f) the decode worker reserved the pages: the Prefill call opens on the
 *       chosen prefill worker (remote prefill);
 *   (g) the Prefill call returned OK (tokens may already flow before that).
 *
 * The current attempt's legs are q->dleg / q->pleg; a leg that is no longer
 * current (cancelled by a retry) only cleans up when its callbacks come. A
 * request is freed when its client call is finished and its last leg ended.
 * Threads: everything here runs on the router's one loop thread. */
#ifndef CS_ROUTER_IMPL_H
#define CS_ROUTER_IMPL_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "chunkserve/metrics.h"
#include "chunkserve/proc.h"
#include "chunkserve/rpc.h"
#include "chunkserve/secret.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "demand.h"
#include "pool.h"
#include "router.h"
#include "gen_call.h"
#include "outbuf.h"
#include "generation.h"
#include "openai.h"
#include "wire.h"

#define WORKER_SERVICE "/chunkserve.v1.Worker/"
#define TICK_MS 20
#define PUMP_MIN_MS 10
#define CANCEL_DEADLINE_MS 1000

typedef struct router router;
typedef struct req req;
typedef struct leg leg;

enum req_state {
    RQ_NEW,       /* just validated: neither queued nor placed yet */
    RQ_WAITING,   /* in the wait queue */
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

/* One worker call of a request. */
struct leg {
    req *q;
    cs_pool_worker *w; /* referenced; active on it while the call lives */
    cs_rpc_client_call *c;
    enum leg_kind kind;
    Chunkserve__V1__PrefillResponse *reply; /* LEG_PREFILL: its answer, once read */
    char field[64]; /* INVALID_ARGUMENT: the field the worker named (its trailer), "" */
};

struct req {
    router *r;
    cs_gen_call *call; /* the client's (either door: api/gen_call.h); NULL once answered */
    char *id;
    uint64_t seq;
    enum req_state state; /* change it only with cs__req_set_state */
    req *qprev, *qnext;   /* the wait queue (state WAITING), in arrival order */
    req *prev, *next;     /* the router's live list */

    int32_t *ctx; /* prompt + every token relayed */
    size_t n_ctx, cap_ctx;
    int32_t n_prompt;
    int32_t max_new; /* tokens the client may get at most */
    int32_t n_relayed;
    Chunkserve__V1__SamplingParams *sampling; /* the client's, copied (NULL: none sent) */
    char *cache_salt;                         /* the client's, copied ("" when none) */
    char *tenant;                             /* the client's, copied ("" when none) */
    int32_t priority;                         /* the client's (0 when none) */
    double predicted_ttft; /* seconds, predicted at admission (0: none) */
    double predicted_tokens; /* its queue part's tokens (cs_pool_ttft), by pool predicted_pool */
    bool predicted_busy;     /* with prompt tokens ahead of its own (cs_ttft_rest) */
    int predicted_pool;     /* enum cs_pool_role, or -1: none */
    bool slo_local;         /* its prompt prefilled by a decode worker (until its first token):
                               the prefill pool was predicted over its TTFT bound, the decode
                               pool within it (router.c) */
    uint64_t rng[4];
    bool have_rng;
    bool sent_first; /* the client has its first message (it carries the request id) */

    /* The current attempt. */
    uint64_t transfer_id;
    leg *dleg, *pleg;
    bool local;             /* prefilled by the decode worker itself */
    int64_t prompt_placed;  /* the prompt tokens its prefilling worker counts for it until
                               they leave there (prompt_left); 0: none */
    cs_pool_handle prompt_w; /* that worker */
    uint64_t prompt_seq;     /* its status then (cs_pool_prompt_left) */
    cs_pool_handle pw;      /* chosen prefill worker, until its leg starts */
    cs_pool_handle dw_last; /* decode worker of the attempt, for Cancel and blame */
    cs_pool_handle pw_last; /* prefill worker of the attempt, for Cancel and blame */
    int legs;               /* legs alive (current or not) */
    /* Prompt logprobs with a remote prefill come in the Prefill reply: the
     * Decode stream's outputs wait for it (held, in order), and the first
     * relayed output carries them (cs__req_wants_prompt_logprobs). */
    Chunkserve__V1__PrefillResponse *prefilled;
    struct held_output *held, **held_tail;
    bool held_ended; /* the Decode stream ended (OK) behind held outputs */

    int failures, retries, migrations, refusals;
    int64_t n_msgs; /* messages relayed with tokens (--fault-migrate-every counts them) */
    cs_pool_marks marks;
    char last_error[300];

    enum req_wait wait;
    /* When the request first waited for each reason since it was last
     * admitted (0 = not yet): each wait has its own bound, and attempts that
     * are refused do not restart it. */
    double t_wait[3];

    double t_recv, t_deadline, t_first, t_last;
    int64_t t_recv_wall_us;   /* CLOCK_REALTIME at receipt, for the worker's hop measurement */
    double t_attempt;         /* the current Decode call's start */
    bool overhead_seen;       /* router_overhead_seconds observed (first attempt) */
    bool parked;              /* it waited in the router's queue at some point */
    int64_t predicted_cached; /* prompt tokens the attempt's prefilling worker should hold */
    char fault_worker[24];    /* fault builds: x-chunkserve-fault-alloc for its worker calls */
};

/* Ends the allocation-failure injection armed for request seq (fault.h),
 * if it is that one, logging whether the failure happened in its life. */
void cs__router_fault_end(router *r, uint64_t seq);

struct router {
    const cs_router_opts *o;
    cs_api_keys keys;       /* the public API's (both doors) */
    cs_secret secret;       /* --cluster-secret: calls to workers carry its token */
    cs_generation_ctx gctx; /* the unary Generation calls' */
    cs_openai *openai;      /* the OpenAI-compatible HTTP door, or NULL */
    const cs_model *model;  /* vocabulary and config only */
    cs_wire_model wm;
    cs_proc *proc; /* the process shell: loop, RPC server, ops HTTP, drain */
    cs_rpc_loop *rl;
    cs_pool *pool;
    cs_metrics *metrics;
    uv_timer_t tick, pump;
    bool stopping, grace_over, handles_ok;
    req *live;
    int n_live;
    int n_preparing; /* Generate calls being tokenized (api/prepare.h), not yet in live */
    req *qhead, *qtail;
    int n_queued;
    int n_placed;
    double t_last_pump;
    bool pump_wanted; /* a change (a slot, a status) asked for a run of the queue not yet run */
    uint64_t next_seq;
    uint64_t fault_seq;    /* the request an allocation failure is armed for (fault.h), or 0 */
    char fault_worker[24]; /* its x-chunkserve-fault-alloc-worker, passed on to its workers */
    uint64_t id_base;      /* random per process: transfer ids and request ids */

    struct {
        cs_metric *running, *waiting, *retries, *migrations, *prefill_local, *prefill_remote;
        cs_metric *prefix_predicted, *prefix_cached;
        cs_metric *ttft, *itl, *e2e, *overhead, *prompt_tokens, *gen_tokens;
        cs_metric *ttft_error, *ttft_refused, *prefill_slo_local;
        cs_metric *wanted[2], *demand[2], *capacity[2]; /* by role (demand.h) */
        cs_metric *usable[2];
        cs_metric *lag_max, *stalls, *pair_trips;
        cs_metric *codes[17];
    } m;
    /* the leading autoscaling signal's rates (demand.h) */
    cs_rate prompt_demand, local_demand, output_demand;
    struct { /* one replica's capacity, smoothed (demand.h) */
        cs_smooth prefill;        /* a prefill replica's prompt tokens/s */
        cs_smooth decode;         /* a decode replica's output tokens/s */
        cs_smooth decode_prefill; /* a decode replica's prompt tokens/s */
    } capacity;
    /* What the queue model (cs_pool_ttft) leaves out of a time to first
     * token, by the pool that predicted it (place.h: cs_ttft_rest), added to
     * each prediction. */
    cs_ttft_rest ttft_rest[2];
    uint64_t stalls_counted; /* cs_pool_loop_lag stalls already added to m.stalls */
    uint64_t trips_counted;  /* cs_pool_pair_trips already added to m.pair_trips */
};

/* --- request.c: a request's life --------------------------------------- */

/* The one way to change q->state (the table above); keeps the placed count
 * and the wait queue in step with it. */
void cs__req_set_state(req *q, enum req_state to);
/* Places the request now, or parks it in the queue with the reason. */
void cs__req_attempt(req *q);
/* A new request that must wait (WAIT_SLOT); RESOURCE_EXHAUSTED when the
 * queue is full. */
void cs__req_park(req *q, enum req_wait why);
/* Ends the request for the client (once) and cancels what runs for it. */
void cs__req_end(req *q, int code, const char *msg);
/* The same, naming the request field the refusal is about (NULL: none). */
void cs__req_refuse(req *q, int code, const char *msg, const char *field);
/* Frees q once its client call is finished and its last leg ended. */
void cs__req_maybe_free(req *q);
/* Counts a finished Generate call by gRPC code. */
void cs__router_count_code(router *r, int code);
/* Runs the queue soon (now when a slot freed). */
void cs__router_schedule_pump(router *r);
/* The pool's callbacks and the router's tick (every TICK_MS). */
void cs__router_on_pool_change(void *arg);
void cs__router_on_worker_down(void *arg, cs_pool_worker *w);
void cs__router_on_tick(uv_timer_t *t);
/* Milliseconds left before the request's deadline (0 when past). */
int64_t cs__req_ms_left(const req *q);
uint64_t cs__splitmix64(uint64_t x);

/* Events from the legs (legs.c calls them for the current leg only). */
void cs__req_on_admitted(req *q, leg *l, const char *kv_endpoint, int kv_transport);
void cs__req_on_output(req *q, leg *l, Chunkserve__V1__GenerateResponse *out);
/* The Prefill reply (owned from here; NULL when it could not be read). */
void cs__req_on_prefilled(req *q, leg *l, Chunkserve__V1__PrefillResponse *reply);
/* Whether q's first output must wait for the Prefill reply's prompt logprobs. */
bool cs__req_wants_prompt_logprobs(const req *q);
/* Takes an output m of the Decode stream to hold (1) while the prompt
 * logprobs are on their way; 0: relay it now; CS_ENOMEM: m not taken. */
int cs__req_hold(req *q, Chunkserve__V1__DecodeResponse *m);
/* The Decode stream ended OK: true when outputs are held (the end is
 * taken up after them). */
bool cs__req_hold_end(req *q);
/* The sampling parameters for the attempt's calls (prompt logprobs only
 * while nothing was relayed: a migrated stream had them already). */
const Chunkserve__V1__SamplingParams *cs__req_leg_sampling(const req *q,
                                                           Chunkserve__V1__SamplingParams *copy);
/* The decode worker refused (RESOURCE_EXHAUSTED before admitting). */
void cs__req_on_refused(req *q, leg *l, const char *msg);
/* The leg's call ended with code (not OK, or OK without a finish) or could
 * not start: the request ends (bad input, deadline) or the attempt fails. */
void cs__req_on_leg_failed(req *q, leg *l, int code, const char *msg);
/* The attempt failed on worker w (what: "decode" or "prefill"). */
void cs__req_fail_attempt(req *q, cs_pool_worker *w, const char *what, int code, const char *msg);

/* --- legs.c: the worker legs ------------------------------------------- */

/* Opens Worker/Decode on dw for the current attempt (q->transfer_id,
 * q->local), taking over the caller's reference to dw; first: the request's
 * first Decode call (it carries the receipt time for the worker's hop
 * measurement). Failures come back as events. */
void cs__leg_start_decode(req *q, cs_pool_worker *dw, bool first);
/* Opens Worker/Prefill on q->pw to the decode worker's KV endpoint. */
void cs__leg_start_prefill(req *q, const char *kv_endpoint, int kv_transport);
/* Cancels the leg's call; its callbacks still come and only clean up. */
void cs__leg_cancel(leg *l);
/* Worker/Cancel by the attempt's transfer id, best effort. */
void cs__leg_send_cancel(req *q, cs_pool_worker *w);
/* The worker a request's handle names (NULL: gone, or the pool closed). */
static inline cs_pool_worker *cs__req_worker(const req *q, cs_pool_handle h) {
    return cs_pool_worker_get(q->r->pool, h);
}

#endif
