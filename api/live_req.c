/* live_req.c: a request's life in a serving process (live_req.h). */
#include "live_req.h"

#include "chunkserve/log.h"

void cs_live_req_init(cs_live_list *l, cs_live_req *q) {
    q->list = l;
    atomic_init(&q->refs, 1);
    pthread_mutex_init(&q->mu, NULL);
    q->prev = NULL;
    q->next = l->head;
    if (l->head) l->head->prev = q;
    l->head = q;
    l->n++;
}

void cs_live_req_ref(cs_live_req *q) {
    atomic_fetch_add(&q->refs, 1);
}

static void on_free_post(void *data) {
    cs_live_req *q = data;
    cs_live_list *l = q->list;
    if (q->prev)
        q->prev->next = q->next;
    else
        l->head = q->next;
    if (q->next) q->next->prev = q->prev;
    l->n--;
    pthread_mutex_destroy(&q->mu);
    l->release(q);
}

void cs_live_req_unref(cs_live_req *q) {
    if (atomic_fetch_sub(&q->refs, 1) == 1 &&
        cs_rpc_loop_post_to(q->list->rl, &q->free_post, on_free_post, q) != 0)
        CS_LOGE("a request's release cannot be posted: the loop is closed");
}

void cs_live_req_unref_not_last(cs_live_req *q) {
    atomic_fetch_sub(&q->refs, 1);
}

static void on_drain_post(void *data) {
    cs_live_req *q = data;
    pthread_mutex_lock(&q->mu);
    q->drain_posted = false; /* events from here on post again */
    pthread_mutex_unlock(&q->mu);
    q->list->drain(q);
    cs_live_req_unref(q); /* the post's */
}

bool cs_live_req_post_locked(cs_live_req *q) {
    if (q->drain_posted) return true;
    q->drain_posted = true;
    cs_live_req_ref(q);
    if (cs_rpc_loop_post_to(q->list->rl, &q->drain_post, on_drain_post, q) != 0) {
        q->drain_posted = false;       /* the loop is closed */
        cs_live_req_unref_not_last(q); /* the caller holds one */
        return false;
    }
    return true;
}
