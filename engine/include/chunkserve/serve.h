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
 * with ev->error). The event's strings are valid during the call only. */
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
/* Scheduler statistics as of the last step. Thread-safe. */
void cs_serve_stats(cs_serve *sv, cs_sched_stats *st);

#ifdef __cplusplus
}
#endif
#endif
