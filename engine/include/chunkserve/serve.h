/* chunkserve/serve.h: the in-process serving loop: one engine thread runs
 * scheduler steps; any thread submits and cancels requests through a locked
 * queue; tokens, finish reasons and errors leave through a per-request
 * callback. This is what the workers and the single-process server wrap. */
#ifndef CHUNKSERVE_SERVE_H
#define CHUNKSERVE_SERVE_H

#include "chunkserve/sched.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Called on the engine thread for every event of the request; the last one
 * has finish != CS_FINISH_NONE (STOP, LENGTH, CANCELLED or ERROR, the latter
 * with ev->error and ev->status: CS_ENOSPC when a reserving request found no
 * room, CS_EINVAL for a bad request, ...). The event's strings and page ids
 * are valid during the call only.
 *
 * A request with reserve or CS_KV_REMOTE first gets an admission event once
 * its pages are reserved: token -1, finish NONE, kv_pages/kv_n_pages = the
 * page ids its prompt's KV fills, in a KV transfer's order
 * (cs_sched_kv_pages). A remote request's KV may then be written
 * into exactly those pages from any thread (cs_engine_kv_import: steps never
 * touch them while the request waits) until cs_serve_kv_ready; the writer
 * must have stopped before the request is cancelled (the pages are freed at
 * once). CS_KV_PREFILL_ONLY requests get events carrying completed pages
 * (kv_pages), which the callback may read (cs_engine_kv_export: it runs on
 * the engine thread) until it returns. */
typedef void (*cs_serve_cb)(void *user, const cs_event *ev);

typedef struct cs_serve cs_serve;

/* Starts the engine thread. The engine must outlive the loop. */
int cs_serve_start(cs_engine *e, const cs_sched_params *p, cs_serve **out);
/* Cancels every live request (each gets its CANCELLED event), joins the
 * thread, frees everything. NULL is a no-op. */
void cs_serve_stop(cs_serve *sv);

/* Queues a request (copied). The request is checked on the engine thread; a
 * bad one gets a single ERROR event naming the problem. Thread-safe. Returns
 * CS_ENOMEM, or CS_ECANCELED once the loop is stopping (then cb is never
 * called). */
int cs_serve_submit(cs_serve *sv, const cs_request *r, cs_serve_cb cb, void *user);
/* Cancels a request at any point; it gets a CANCELLED event unless it had
 * already finished. Thread-safe; unknown ids are ignored. */
void cs_serve_cancel(cs_serve *sv, uint64_t id);
/* Wakes the engine thread if it sleeps: after a request's cs_request.held
 * was cleared. Thread-safe; allocates nothing, so it cannot fail. */
void cs_serve_wake(cs_serve *sv);
/* A CS_KV_REMOTE request's KV is in place; first_token (sampled by the
 * prefill side, with its log-probabilities first_lp when asked; copied; and
 * n_cached, the prompt tokens that side took from its prefix cache) is
 * emitted at the next step and the sequence joins the batch. Thread-safe;
 * CS_ENOMEM or CS_ECANCELED (stopping). An id that is no longer waiting for
 * its KV ends with an ERROR event (as does one cs_sched_kv_ready refuses). */
int cs_serve_kv_ready(cs_serve *sv, uint64_t id, int32_t first_token, int32_t n_cached,
                      const cs_logprobs *first_lp);

/* A release of page references, in memory its caller allocated (malloc),
 * usually inside its own record of the pages it holds. */
typedef struct cs_serve_release {
    struct cs_serve_release *next; /* serve's */
    const int32_t *pages;          /* n ids, alive as long as the record */
    int32_t n;
    void *block; /* what to free() once applied: the record, or the block holding it */
} cs_serve_release;
/* Drops one reference from each of rec's pages, applied by the engine thread
 * before its next step (it wakes for it): the other half of holding pages
 * past a callback (see cs_serve_cb). It allocates nothing, so a release is
 * never lost for memory; rec->block is freed (free()) once applied, or at
 * once when the loop is stopping (the references are then left to the
 * pool's end). Thread-safe. */
void cs_serve_kv_release(cs_serve *sv, cs_serve_release *rec);

/* Scheduler statistics as of the last step. Thread-safe. */
void cs_serve_stats(cs_serve *sv, cs_sched_stats *st);
/* The load a TTFT is predicted from (chunkserve/ttft.h): the scheduler's as
 * of the last step, and the requests submitted since. Thread-safe. */
struct cs_ttft_load;
void cs_serve_ttft_load(cs_serve *sv, struct cs_ttft_load *L);

/* The prefix summary a worker publishes (a Bloom filter of its registered
 * page hashes, chunkserve/kv_cache.h): once enabled, the engine thread
 * rebuilds it after a step that changed the cache, at most every
 * interval_s, and at once when it goes idle. Call once, before submitting.
 * CS_EINVAL (interval <= 0), CS_ENOMEM. */
int cs_serve_prefix_summary_enable(cs_serve *sv, double interval_s);

typedef struct {
    uint8_t *bits;    /* a copy (free it), or NULL when the version is the caller's */
    size_t n_bits;    /* 0: no summary yet (or not enabled) */
    uint64_t version; /* changes with every rebuild that saw a different cache */
    double behind_s;  /* how far behind the cache it may be: 0 when the cache has not
                         changed since it was built, else the time since the first change
                         it does not show (everything registered before then it shows) */
} cs_serve_summary;

/* The latest summary; its bits only when its version differs from known.
 * Thread-safe. CS_ENOMEM (then out holds no bits). */
int cs_serve_prefix_summary(cs_serve *sv, uint64_t known, cs_serve_summary *out);

#ifdef __cplusplus
}
#endif
#endif
