/* place.h: the placement policy, a pair of pure functions over snapshots of
 * the workers (cs_place_decode, cs_place_prefill), so that it is tested
 * without sockets (tests/unit/test_router_place.c). The pool (pool.h) builds
 * the snapshots and applies the answer. */
#ifndef CS_ROUTER_PLACE_H
#define CS_ROUTER_PLACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/kv_cache.h"
#include "chunkserve/ttft.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One worker as placement sees it. */
typedef struct {
    bool usable;            /* fresh status, ready, not draining, right role */
    bool skip;              /* excluded or refused for this request */
    cs_kv_blocks kv;        /* how its pages hold a block (page_size positions) */
    int32_t kv_pages_total; /* the worker's whole pool (a prompt beyond it can never run there) */
    int32_t kv_pages_free;  /* from the last status */
    int32_t pages_placed;   /* pages this router placed there since that status */
    int32_t num_running, num_waiting;
    int64_t queued_prefill_tokens; /* from the last status (prefill) */
    int64_t tokens_placed;         /* prompt tokens this router sent there since that status */
    int32_t reqs_placed;           /* requests this router sent there since that status */
    int64_t cached_tokens;         /* the request's prompt tokens predicted cached there */
    double prefill_rate;           /* prompt tokens a second beside its decodes (0: unknown) */
    const cs_ttft_load *queue;     /* queued_prefill_tokens by (priority, tenant), from the
                                      last status (groups and overflow; NULL or empty: only
                                      their sum is known) */
} cs_place_worker;

/* A request's class: its priority and tenant ("" or NULL: the default). */
typedef struct {
    int32_t priority;
    const char *tenant;
} cs_place_class;

/* The predicted seconds to the first token of a prompt of n_tokens of
 * class c on w: over w's prefill rate, the prompt tokens computed there
 * before its first token. They are its own less what w is predicted to
 * hold; of w's queue, its share as w's scheduler serves it (cs_ttft_work:
 * better priorities, its tenant's, the other tenants' up to their weighted
 * share) when w reports the queue's groups and c is given, else all of it;
 * and every token placed there since the status (their classes are not
 * counted: ahead). NAN when the rate is unknown. */
double cs_place_ttft(const cs_place_worker *w, int64_t n_tokens, const cs_place_class *c);

/* What a pool's queue model (cs_place_ttft) leaves out of a time to first
 * token: the hops, the step under way, a step's fixed cost. Learnt from the
 * last CS_TTFT_REST_WINDOW first tokens, each kept as its measured seconds
 * and the tokens its queue part counted; read at the rate of the worker
 * now predicted as the median of measured - tokens / rate. The rate is
 * applied when it is read because a worker's reported rate moves (its
 * measured rate, then its step model's once that fits): a rest kept in
 * seconds would carry the old rate's error until the window turned over.
 * A median, not a mean: one slow first token (a worker's first step of a
 * shape, a descheduled thread) would lift every prediction after it for
 * many requests, and a short prompt's first token is mostly this rest.
 * Kept apart by whether the worker had prompt tokens ahead of the request
 * (busy): then a step runs and the request waits for its end, where an
 * idle worker starts the request's step at once. The router does not see
 * where in a step a worker is; the two differ by up to a step (13 against
 * 28 ms for four short prompts arriving together on the default model). */
#define CS_TTFT_REST_WINDOW 16
typedef struct {
    double seconds[CS_TTFT_REST_WINDOW]; /* the newest first tokens' measured times, a ring */
    double tokens[CS_TTFT_REST_WINDOW];  /* and their queue parts' tokens */
    int32_t n;                           /* samples held (<= the window) */
    int32_t next;                        /* the slot the next sample takes */
} cs_ttft_ring;

typedef struct {
    cs_ttft_ring idle, busy;
} cs_ttft_rest;

/* One more first token, of a request predicted with prompt tokens ahead
 * (busy) or not (one with a number that is not finite or negative is
 * ignored). */
void cs_ttft_rest_add(cs_ttft_rest *r, bool busy, double seconds, double tokens);
/* The rest at a worker's rate (tokens/s): the median over busy's samples,
 * or the other's while it has none (the mean of the middle two for an even
 * count); NAN before any, or when the rate is not positive. */
double cs_ttft_rest_get(const cs_ttft_rest *r, bool busy, double rate);

/* What left a worker's reported queue since that status: done, the tokens
 * taken off it; owed, computed prompts' tokens not taken yet because the
 * worker cannot have computed that many since the status at its rate, by
 * the group of the queue they belong to (the last: the tokens past the
 * table, or the queue's sum when it has no groups). Each is at most what
 * its group holds. Zeroed with each status. */
typedef struct {
    int64_t done;
    int64_t owed[CS_TTFT_GROUPS + 1];
} cs_place_since;

/* A prompt of n tokens of class c (NULL: the default) came off a worker's
 * queue computed (its first token came): its tokens, at most what c's
 * group of the reported queue L (may be NULL: the sum *queued alone) holds
 * and does not owe yet, are owed, then settled (below). */
void cs_place_queue_left(cs_ttft_load *L, int64_t *queued, cs_place_since *s,
                         const cs_place_class *c, int64_t n, double most);
/* Takes owed tokens off their groups of L and off the sum *queued, all of
 * them since the status at most `most` (the worker's rate times the time
 * since its status; NAN or 0: none): the status counted only what each
 * prompt had left then, so the rest comes off as that time grows, at each
 * reading of the queue. In the order the worker computes them: the tokens
 * past the table first, then by priority. */
void cs_place_queue_settle(cs_ttft_load *L, int64_t *queued, cs_place_since *s, double most);

/* Pages a context of n_tokens takes on a worker whose pages hold blocks as
 * kv says (the pages a KV transfer of it lands in: cs_kv_blocks_seq_pages;
 * at least one block's). A page size <= 0 (unknown) counts as 16. */
int32_t cs_place_pages(int64_t n_tokens, const cs_kv_blocks *kv);

/* The decode worker for a context of n_tokens: among usable, not skipped
 * workers with room for the context's pages (kv_pages_free - pages_placed),
 * the one with the most room left; ties go to the fewest running + waiting
 * sequences, then to the first at or after index start (so equal workers
 * share the load). -1 when none qualifies.
 * Prefix-aware (balance >= 0): when some of those workers are predicted to
 * hold part of the prompt (cached_tokens), the choice is among the ones
 * whose load (num_running + num_waiting + reqs_placed) is within balance of
 * the least loaded: the most cached tokens, then the rule above. So a hot
 * prefix fills its worker up to balance sequences more than the others, and
 * the next request goes to another (which then holds it too). */
int cs_place_decode(const cs_place_worker *w, size_t n, int64_t n_tokens, size_t start,
                    int64_t balance);

/* The prefill worker for a prompt of n_tokens: among usable, not skipped
 * workers whose whole pool can hold it, the least predicted TTFT for
 * class c (cs_place_ttft) when every such worker reports its rate, else the fewest
 * queued_prefill_tokens + tokens_placed; ties as above. -1 when none (the decode worker then
 * prefills it itself). Prefix-aware (balance >= 0): as cs_place_decode, with
 * that queue (tokens) as the load. */
int cs_place_prefill(const cs_place_worker *w, size_t n, int64_t n_tokens, size_t start,
                     int64_t balance, const cs_place_class *c);

#ifdef __cplusplus
}
#endif

#endif
