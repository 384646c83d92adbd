/* live_req.h (api/): a request's life in a serving process, the one
 * skeleton `chunkserve serve` (server/server.c) and both cluster workers
 * (worker/call.c) run their requests on.
 *
 * A live request is the first member of its owner's request struct. It is
 * on its process's list (newest first) from cs_live_req_init until its last
 * reference goes; then it is unlinked and the list's release hook frees it,
 * on the loop thread. References are counted by the owner: whoever may
 * still touch the request holds one (the RPC call until answered, the
 * engine until its final event, a transfer in flight, a posted drain).
 *
 * Events arrive on other threads (the engine's, the KV transport's): each
 * is recorded under q->mu, and cs_live_req_post_locked asks for one drain on
 * the loop thread for any number of events before it runs. The drain hook
 * (the list's) takes what was recorded and forwards it to the call.
 *
 *   engine/transport thread                loop thread
 *   lock mu; record; post_locked; unlock -> drain(q)   (a reference held)
 *   unref (the last)                     -> unlink; release(q)
 */
#ifndef CHUNKSERVE_API_LIVE_REQ_H
#define CHUNKSERVE_API_LIVE_REQ_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "chunkserve/rpc.h"

typedef struct cs_live_req cs_live_req;

/* A process's live requests (loop thread, except rl and the hooks, which
 * are set once before the first request). */
typedef struct {
    cs_rpc_loop *rl;
    cs_live_req *head; /* newest first */
    int32_t n;
    /* A posted drain (loop thread; a reference is held while it runs).
     * Posts coalesce, and a drain may find nothing new: it must be
     * idempotent. */
    void (*drain)(cs_live_req *q);
    /* The last reference went: q is off the list and q->mu destroyed; free
     * it (loop thread). */
    void (*release)(cs_live_req *q);
} cs_live_list;

struct cs_live_req {
    cs_live_list *list;
    cs_live_req *prev, *next; /* list->head (loop thread) */
    atomic_int refs;
    pthread_mutex_t mu; /* the owner's fields several threads touch, and: */
    bool drain_posted;
    cs_rpc_post drain_post, free_post; /* posting them allocates nothing */
};

/* Loop thread: q (zeroed by its owner) goes on the list holding one
 * reference, its first owner's. */
void cs_live_req_init(cs_live_list *l, cs_live_req *q);
/* Any thread. */
void cs_live_req_ref(cs_live_req *q);
/* Any thread: drops a reference; the last posts the release to the loop. */
void cs_live_req_unref(cs_live_req *q);
/* Any thread: drops a reference the caller knows is not the last (another
 * holder outlives the call), e.g. one taken for a hand-off that failed. */
void cs_live_req_unref_not_last(cs_live_req *q);
/* Any thread, q->mu held: runs list->drain(q) on the loop thread soon, once
 * for any number of posts before it runs; holds a reference until then.
 * Once the loop is closed nothing is posted (false; true otherwise). */
bool cs_live_req_post_locked(cs_live_req *q);

#endif
