/* rpc_loop.c: the completion queue's thread and its hand-off to libuv.
 *
 * The thread does nothing but wait on grpc_completion_queue_next and append
 * (tag, ok) to a locked list, then uv_async_send. uv_async_send coalesces
 * wake-ups, so the loop-side callback takes the whole list at once (swapping
 * two buffers, no allocation in steady state) and runs the tags in arrival
 * order. Posts from other threads travel through the same list. Not here:
 * anything about servers, calls or channels. */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc-impl.h"

typedef struct {
    cs__rpc_tag tag;
    void (*fn)(void *data);
    void *data;
} cs__rpc_post;

/* Appends under l->mu. false when out of memory. */
static bool push_locked(cs_rpc_loop *l, cs__rpc_tag *tag, bool ok) {
    if (l->n_events == l->cap_events) {
        size_t cap = l->cap_events ? 2 * l->cap_events : 64;
        cs__rpc_event *e = realloc(l->events, cap * sizeof *e);
        if (!e) return false;
        l->events = e;
        l->cap_events = cap;
    }
    l->events[l->n_events++] = (cs__rpc_event){tag, ok};
    /* Under the lock: the loop thread closes the handle only after setting
     * l->closed under the same lock, so the handle is alive here. */
    uv_async_send(&l->async);
    return true;
}

static void *cq_thread(void *arg) {
    cs_rpc_loop *l = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(l->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        pthread_mutex_lock(&l->mu);
        bool pushed = push_locked(l, ev.tag, ev.success != 0);
        pthread_mutex_unlock(&l->mu);
        /* A completion cannot be dropped: the object waiting for it would
         * never be freed. Running out of memory here is fatal. */
        CS_ASSERT(pushed);
    }
    return NULL;
}

static void run_post(cs__rpc_tag *t, bool ok) {
    (void)ok;
    cs__rpc_post *p = CS__CONTAINER_OF(t, cs__rpc_post, tag);
    void (*fn)(void *) = p->fn;
    void *data = p->data;
    free(p);
    fn(data);
}

/* Runs one batch: what was queued when we took it. Events that arrive while
 * it runs have sent another wake-up, so nothing is left behind. */
static size_t drain_once(cs_rpc_loop *l) {
    pthread_mutex_lock(&l->mu);
    cs__rpc_event *batch = l->events;
    size_t n = l->n_events, cap = l->cap_events;
    l->events = l->spare;
    l->cap_events = l->cap_spare;
    l->n_events = 0;
    cs_rpc_post *posts = l->posts_head;
    l->posts_head = l->posts_tail = NULL;
    pthread_mutex_unlock(&l->mu);
    l->spare = batch;
    l->cap_spare = cap;
    for (size_t i = 0; i < n; i++) {
        cs__rpc_tag *t = batch[i].tag;
        if (t->fn != run_post) cs__rpc_loop_end(l);
        t->fn(t, batch[i].ok);
    }
    for (cs_rpc_post *p = posts, *next; p; p = next, n++) {
        next = p->next; /* p may be freed, or posted again, by its fn */
        p->fn(p->data);
    }
    return n;
}

int cs__rpc_loop_channel_creds(cs_rpc_loop *l, const cs_rpc_tls *t,
                               grpc_channel_credentials **out) {
    if (!t->ca_file || !t->ca_file[0]) return cs__rpc_channel_creds(t, out);
    char key[4200];
    int kn =
        snprintf(key, sizeof key, "%s\n%s\n%s\n%lld", t->ca_file, t->cert_file ? t->cert_file : "",
                 t->key_file ? t->key_file : "", (long long)t->reload_s);
    if (kn < 0 || (size_t)kn >= sizeof key) return cs__rpc_channel_creds(t, out); /* not cached */
    if (l->tls_creds && !strcmp(l->tls_key, key)) {
        *out = l->tls_creds;
        return 0;
    }
    char *k = strdup(key);
    if (!k) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    int r = cs__rpc_channel_creds(t, out);
    if (r) {
        free(k);
        return r;
    }
    if (l->tls_creds) grpc_channel_credentials_release(l->tls_creds);
    free(l->tls_key);
    l->tls_creds = *out;
    l->tls_key = k;
    return 0;
}

void cs__rpc_loop_creds_release(cs_rpc_loop *l, grpc_channel_credentials *c) {
    if (c != l->tls_creds) grpc_channel_credentials_release(c);
}

static void on_async_closed(uv_handle_t *h) {
    cs_rpc_loop *l = h->data;
    if (l->tls_creds) grpc_channel_credentials_release(l->tls_creds);
    free(l->tls_key);
    pthread_mutex_destroy(&l->mu);
    free(l->events);
    free(l->spare);
    free(l);
    grpc_shutdown();
}

static void maybe_finish_close(cs_rpc_loop *l) {
    if (!l->closing || l->outstanding > 0 || l->n_objects > 0 || !l->cq) return;
    /* Nothing is pending on the queue, so the thread sees SHUTDOWN at once. */
    grpc_completion_queue_shutdown(l->cq);
    if (l->thread_started) pthread_join(l->thread, NULL);
    grpc_completion_queue_destroy(l->cq);
    l->cq = NULL;
    pthread_mutex_lock(&l->mu);
    l->closed = true;
    pthread_mutex_unlock(&l->mu);
    while (drain_once(l) > 0) {
    }
    uv_close((uv_handle_t *)&l->async, on_async_closed);
}

static void on_async(uv_async_t *h) {
    cs_rpc_loop *l = h->data;
    drain_once(l);
    maybe_finish_close(l);
}

int cs_rpc_loop_init(struct uv_loop_s *uv, cs_rpc_loop **out) {
    *out = NULL;
    cs_rpc_loop *l = calloc(1, sizeof *l);
    if (!l) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    l->uv = uv;
    pthread_mutex_init(&l->mu, NULL);
    grpc_init();
    l->cq = grpc_completion_queue_create_for_next(NULL);
    if (!l->cq) goto fail_cq;
    if (uv_async_init(uv, &l->async, on_async) != 0) goto fail_async;
    l->async.data = l;
    if (pthread_create(&l->thread, NULL, cq_thread, l) != 0) {
        /* The handle exists now: the close path frees everything. */
        l->closing = true;
        maybe_finish_close(l);
        return cs_fail(CS_EIO, "rpc: cannot start the completion queue thread");
    }
    l->thread_started = true;
    *out = l;
    return 0;

fail_async:
    grpc_completion_queue_shutdown(l->cq);
    grpc_completion_queue_destroy(l->cq);
fail_cq:
    grpc_shutdown();
    pthread_mutex_destroy(&l->mu);
    free(l);
    return cs_fail(CS_EIO, "rpc: cannot create the completion queue or its uv handle");
}

bool cs_rpc_wait_grpc_ended(int timeout_ms) {
    /* grpc_is_initialized takes the lock the ending holds: 0 means it is done. */
    for (int waited = 0; grpc_is_initialized(); waited++) {
        if (waited >= timeout_ms) return false;
        nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    }
    return true;
}

void cs_rpc_loop_close(cs_rpc_loop *l) {
    if (!l || l->closing) return;
    l->closing = true;
    /* Finish from the async callback, never from inside a caller's stack. */
    uv_async_send(&l->async);
}

int cs_rpc_loop_post_to(cs_rpc_loop *l, cs_rpc_post *p, void (*fn)(void *data), void *data) {
    p->next = NULL;
    p->fn = fn;
    p->data = data;
    pthread_mutex_lock(&l->mu);
    bool closed = l->closed;
    if (!closed) {
        if (l->posts_tail)
            l->posts_tail->next = p;
        else
            l->posts_head = p;
        l->posts_tail = p;
        uv_async_send(&l->async); /* under the lock, as in push_locked */
    }
    pthread_mutex_unlock(&l->mu);
    return closed ? cs_fail(CS_ECANCELED, "rpc: loop closed") : 0;
}

int cs_rpc_loop_post(cs_rpc_loop *l, void (*fn)(void *data), void *data) {
    cs__rpc_post *p = malloc(sizeof *p);
    if (!p) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    p->tag.fn = run_post;
    p->fn = fn;
    p->data = data;
    pthread_mutex_lock(&l->mu);
    int rc = 0;
    if (l->closed)
        rc = CS_ECANCELED;
    else if (!push_locked(l, &p->tag, true))
        rc = CS_ENOMEM;
    pthread_mutex_unlock(&l->mu);
    if (rc) {
        free(p);
        return cs_fail(rc, rc == CS_ECANCELED ? "rpc: loop closed" : "rpc: out of memory");
    }
    return 0;
}

void cs__rpc_loop_ref(cs_rpc_loop *l) {
    l->n_objects++;
}

void cs__rpc_loop_unref(cs_rpc_loop *l) {
    CS_ASSERT(l->n_objects > 0);
    if (--l->n_objects == 0 && l->closing) uv_async_send(&l->async);
}
