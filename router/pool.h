/* pool.h: the router's view of the worker pools: which workers exist (static
 * lists and DNS names re-resolved periodically), what each last said about
 * itself (Worker/GetStatus, polled), which ones are usable, and the placement
 * policy that picks one for a request.
 *
 * The placement policy is pure (place.h); discovery (static lists, DNS)
 * is discovery.c's. Everything else runs on the router's libuv loop thread and must be called
 * there. Not here: requests, retries (request.c), the client side of
 * Decode/Prefill (legs.c); the pool only lends a worker's channel and counts what the
 * router placed there since its last status. */
#ifndef CS_ROUTER_POOL_H
#define CS_ROUTER_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/rpc.h"
#include "place.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ pool -- */

enum cs_pool_role { CS_POOL_PREFILL = 0, CS_POOL_DECODE = 1 };

typedef struct cs_pool cs_pool;
/* A worker process as the router sees it (address, channel, last status);
 * not the worker's own process skeleton (worker/worker.h). */
typedef struct cs_pool_worker cs_pool_worker;

typedef struct {
    const char *static_workers[2]; /* per role: "h:p,h:p" or NULL */
    const char *dns[2];            /* per role: "name:port[,name:port]" or NULL */
    int32_t dns_refresh_ms;        /* re-resolve period */
    int32_t status_interval_ms;    /* GetStatus period per worker */
    int32_t expect_n_vocab;        /* a worker whose model has another vocabulary, */
    const char *expect_arch;       /* architecture */
    int32_t expect_ctx_len;        /* or context length is unusable, */
    uint64_t expect_model_fp;      /* or another cs_model_fingerprint (0: not checked), */
    uint64_t expect_tokenizer_fp;  /* or another tokenizer (0: not checked) */
    const char *rpc_token;         /* sent with every call (CS_RPC_TOKEN_KEY); NULL = none;
                                      must outlive the pool; rotated in place, then
                                      cs_pool_rpc_token_changed */
    const cs_rpc_tls *worker_tls;  /* TLS to the workers (NULL = plaintext); outlives the pool */
    /* Called after a status poll round in which some worker's status arrived
     * (room may have appeared): the router retries what waits. May be NULL. */
    void (*on_change)(void *arg);
    /* Called once when a worker with calls of the router on it (see
     * cs_pool_worker_active) has not answered a status poll for a few seconds:
     * the router fails those calls over. May be NULL. */
    void (*on_down)(void *arg, cs_pool_worker *w);
    void *arg;
} cs_pool_opts;

/* Builds the pools and starts discovery and polling on the RPC loop's uv
 * loop. Addresses are checked here (CS_EINVAL naming the bad entry); the
 * option strings are only read during the call. Free with cs_pool_close. */
int cs_pool_init(struct uv_loop_s *uv, cs_rpc_loop *rl, const cs_pool_opts *o, cs_pool **out);

/* Stops timers and DNS, frees every worker's channel (their calls in flight
 * are cancelled and still end through their callbacks); the memory goes once
 * libuv has closed the handles and the last worker reference is dropped.
 * NULL is a no-op. */
void cs_pool_close(cs_pool *p);
/* The string opts.rpc_token points to holds a new token (a rotated cluster
 * secret): every worker's calls send it from now on. */
void cs_pool_rpc_token_changed(cs_pool *p);

/* Workers of a role currently usable. */
int cs_pool_n_usable(const cs_pool *p, enum cs_pool_role role);
/* The least predicted time to first token of a prompt of n_tokens of class
 * c (may be NULL: behind the whole queue) over the usable workers of role
 * (cs_place_ttft, the prefix cache not counted), into *rate that worker's
 * prefill rate and into *alone what it would be there with nothing queued;
 * NAN (and *alone, *rate NAN) when no usable worker reports its rate.
 * Each worker's queue is first settled (cs_pool_prompt_left). */
double cs_pool_ttft(cs_pool *p, enum cs_pool_role role, int64_t n_tokens,
                    const cs_place_class *c, double *alone, double *rate);
/* One replica's capacity in role's pool (demand.h): the mean prefill and
 * decode rates over its usable workers that report them (0 when none). */
void cs_pool_capacity(const cs_pool *p, enum cs_pool_role role, double *prefill, double *decode);
/* This process's own loop stalls as the status timer saw them: the longest
 * lag of a tick behind its schedule (seconds) and how many ticks came over a
 * second late. After such a stall no worker is declared down before a fresh
 * round of polls could answer. */
void cs_pool_loop_lag(const cs_pool *p, double *lag_max_s, uint64_t *stalls);

/* Per-(prefill, decode) KV pair breakers: a KV transfer from pw to dw failed
 * (the link between them, not necessarily either worker): cs_pool_place
 * gives dw no prefill on pw for 10 s, then tries the pair again (doubling
 * up to 60 s while it keeps failing); cs_pool_pair_ok closes it. A restart
 * of dw (new instance) starts afresh. Trips: how many times one opened. */
void cs_pool_pair_failed(cs_pool_worker *pw, cs_pool_worker *dw);
void cs_pool_pair_ok(cs_pool_worker *pw, const cs_pool_worker *dw);
uint64_t cs_pool_pair_trips(const cs_pool *p);
/* Workers of a role known (usable or not). */
int cs_pool_n_workers(const cs_pool *p, enum cs_pool_role role);

/* A worker named without being held, as nginx names its upstream peers: its
 * slot in the pool and that slot's generation. A handle reads NULL once its
 * worker object is gone (a slot's next worker has the next generation);
 * {0, 0} names none. Requests keep handles (the workers of their attempt,
 * their marks); only a leg (a call on the worker) holds a reference. */
typedef struct {
    uint32_t slot, gen;
} cs_pool_handle;
/* w's handle ({0, 0} for NULL), and the worker a handle names, or NULL
 * (gone, or p NULL: the pool closed). */
cs_pool_handle cs_pool_worker_handle(const cs_pool_worker *w);
cs_pool_worker *cs_pool_worker_get(const cs_pool *p, cs_pool_handle h);

/* Exclusion and refusal lists are per request: a small array of entries. An
 * exclusion names a worker instance (a restarted worker is a new instance
 * and usable again); a refusal lasts until that worker's next status. */
typedef struct {
    cs_pool_handle w;
    uint64_t instance_id;
    uint64_t status_seq;
} cs_pool_mark;

typedef struct {
    cs_pool_mark *excluded;
    size_t n_excluded;
    cs_pool_mark *refused;
    size_t n_refused;
} cs_pool_marks;

/* Prefix-aware placement (prefix.h): the request's context and cache salt,
 * and the policy. */
typedef struct {
    const int32_t *ids;  /* the context (n_tokens of them) */
    const char *salt;    /* its cache salt ("" or NULL: shared) */
    double ttl_s;        /* a recorded page counts this long */
    int64_t balance[2];  /* per role: the load slack (prefill: tokens, decode: sequences) */
    int32_t index_pages; /* page hashes remembered per worker */
} cs_pool_prefix;

/* Picks a worker of the role for a context of n_tokens, skipping the marked
 * ones (decode: needs room for the pages). peer (prefill only; may be NULL):
 * the decode worker the pages go to; a prefill worker whose KV payload (TCP,
 * NCCL) or page layout (dtype, page size, shapes: the layout fingerprint)
 * differs from it is never chosen, since its KV channel would be refused.
 * On success it takes a reference (drop it with cs_pool_worker_unref) and
 * counts the pages/tokens placed there until its next status. NULL when none
 * qualifies. *n_candidates (may be NULL) receives how many usable, not
 * excluded workers there were (with or without room, refused or not).
 * With pf (may be NULL: by load alone) the choice is prefix-aware, the
 * chosen worker's predicted cached tokens for the request go to *cached
 * (may be NULL), and the request's pages are recorded as held there.
 * cls (may be NULL): the request's class, for a prefill worker's predicted
 * TTFT (cs_place_prefill). */
cs_pool_worker *cs_pool_place(cs_pool *p, enum cs_pool_role role, int64_t n_tokens,
                              const cs_pool_marks *marks, int *n_candidates,
                              const cs_pool_worker *peer, const cs_pool_prefix *pf,
                              const cs_place_class *cls, int64_t *cached);

/* Adds a mark for w, or renews it (excluded: the worker's current instance;
 * refused: its current status). CS_ENOMEM. */
int cs_pool_mark_add(cs_pool_mark **arr, size_t *n, const cs_pool_worker *w);
/* Drops every mark; the struct is zeroed. */
void cs_pool_marks_free(cs_pool_marks *m);

/* Prompt tokens sent to w to prefill (a local prefill on a decode worker:
 * cs_pool_place counts the prefill pool's): until w's next status they are
 * its load beside that status's queue. w may be NULL. */
void cs_pool_prompt_placed(cs_pool_worker *w, int64_t n_tokens);
/* The status w had when a prompt was placed there (0: none yet). */
uint64_t cs_pool_status_seq(const cs_pool_worker *w);
/* A prompt of n_tokens of class c placed on w when w's status was
 * placed_seq left w's queue: computed (its first token came) or dropped
 * (its attempt ended first). Placed since w's last status, its placed
 * tokens are taken back. Counted by that status, a computed one comes off
 * its class's group of the status's queue, all of them together at most
 * what w computes at its prefill rate in the time since the status (the
 * status counted only what each had left then): the rest comes off as that
 * time grows, at each later reading of w's queue (cs_place_queue_settle).
 * A dropped one stays counted until the next status. w may be NULL. */
void cs_pool_prompt_left(cs_pool_worker *w, int64_t n_tokens, uint64_t placed_seq,
                         const cs_place_class *c, bool computed);

void cs_pool_worker_ref(cs_pool_worker *w);
void cs_pool_worker_unref(cs_pool_worker *w);

/* The worker's channel (NULL once the pool is closing), address, last known
 * worker_id ("" before the first status), KV endpoint/transport of its last
 * status, and page size. */
cs_rpc_channel *cs_pool_worker_channel(const cs_pool_worker *w);
const char *cs_pool_worker_addr(const cs_pool_worker *w);
const char *cs_pool_worker_id(const cs_pool_worker *w);
const char *cs_pool_worker_kv_endpoint(const cs_pool_worker *w);
/* Whether a listed worker of the role (not vanished from DNS, of this
 * model and role) advertised exactly ep as its KV endpoint in its last
 * status: the prefill worker sends KV pages only to decode workers it knows
 * this way (prefill_worker/prefill.c). */
bool cs_pool_knows_kv_endpoint(const cs_pool *p, enum cs_pool_role role, const char *ep);
/* A prefill worker's KV sender name ("" until its status said it). */
const char *cs_pool_worker_kv_sender(const cs_pool_worker *w);
int cs_pool_worker_kv_transport(const cs_pool_worker *w);

/* A call on the worker failed in a way that suggests the worker is gone
 * (UNAVAILABLE): treat it as unusable until its next successful status. */
void cs_pool_worker_suspect(cs_pool_worker *w, const char *why);

/* Counts calls the router has on the worker (a vanished or failing worker
 * is not torn down while one is active). */
void cs_pool_worker_active(cs_pool_worker *w, int delta);

#ifdef __cplusplus
}
#endif
#endif
