/* test_live_req.c: a request's life (api/live_req.h) on a real RPC loop,
 * with producer threads as the engine: every event recorded is drained on
 * the loop thread, drains never overlap, a drain runs after the last event,
 * each request is released exactly once, after its last reference, off the
 * list; a request whose producer keeps posting while its drains run sees
 * drains that find nothing new (the hook must be idempotent). */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <uv.h>

#include "live_req.h"
#include "test.h"

#define N_REQ 64
#define N_EVENTS 400
#define N_THREADS 4

typedef struct {
    cs_live_req life; /* first */
    int32_t recorded; /* under life.mu: events recorded by the producer */
    bool done;        /* under life.mu: the final event was recorded */
    int32_t taken;    /* loop thread: events the drains took */
    bool ended;       /* loop thread: a drain saw the final event */
    int32_t empty;    /* loop thread: drains that found nothing new */
    atomic_int in_drain;
} req;

static cs_live_list list;
static req *reqs[N_REQ];
static atomic_int released, drains, empty_drains;
static bool released_flag[N_REQ];

static int index_of(const req *q) {
    for (int i = 0; i < N_REQ; i++)
        if (reqs[i] == q) return i;
    return -1;
}

static void drain(cs_live_req *l) {
    req *q = (req *)l;
    ASSERT_EQ_INT(atomic_fetch_add(&q->in_drain, 1), 0); /* never two at once */
    pthread_mutex_lock(&l->mu);
    int32_t n = q->recorded;
    bool done = q->done;
    pthread_mutex_unlock(&l->mu);
    ASSERT_TRUE(n >= q->taken);
    if (n == q->taken && done == q->ended) q->empty++, atomic_fetch_add(&empty_drains, 1);
    q->taken = n;
    atomic_fetch_add(&drains, 1);
    atomic_fetch_sub(&q->in_drain, 1);
    if (done && !q->ended) {
        q->ended = true;
        cs_live_req_unref(l); /* the producer's, as serve's drain drops the engine's */
    }
}

static void release(cs_live_req *l) {
    req *q = (req *)l;
    int i = index_of(q);
    ASSERT_TRUE(i >= 0);
    ASSERT_TRUE(!released_flag[i]);
    released_flag[i] = true;
    ASSERT_EQ_INT(atomic_load(&l->refs), 0);
    ASSERT_TRUE(q->ended);
    ASSERT_EQ_INT(q->taken, N_EVENTS); /* the last event was drained before the release */
    for (cs_live_req *o = list.head; o; o = o->next)
        ASSERT_TRUE(o != l); /* off the list */
    atomic_fetch_add(&released, 1);
    reqs[i] = NULL;
    free(q);
}

static void *producer(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int e = 0; e < N_EVENTS; e++)
        for (int i = t; i < N_REQ; i += N_THREADS) {
            req *q = reqs[i];
            pthread_mutex_lock(&q->life.mu);
            q->recorded++;
            if (e == N_EVENTS - 1) q->done = true;
            ASSERT_TRUE(cs_live_req_post_locked(&q->life));
            pthread_mutex_unlock(&q->life.mu);
            if (e % 37 == 0) nanosleep(&(struct timespec){.tv_nsec = 20000}, NULL);
        }
    return NULL;
}

static uv_loop_t uv;
static cs_rpc_loop *rl;
static pthread_t threads[N_THREADS];

/* Polls until every request is released, then closes the RPC loop. */
static void on_check(uv_timer_t *t) {
    static int ticks;
    if (atomic_load(&released) < N_REQ) {
        ASSERT_TRUE(++ticks < 30000); /* 30 s: a lost drain or release never ends */
        return;
    }
    ASSERT_EQ_INT(list.n, 0);
    ASSERT_TRUE(list.head == NULL);
    uv_timer_stop(t);
    uv_close((uv_handle_t *)t, NULL);
    cs_rpc_loop_close(rl);
}

static void on_start(uv_timer_t *t) {
    uv_close((uv_handle_t *)t, NULL);
    for (int i = 0; i < N_REQ; i++) {
        reqs[i] = calloc(1, sizeof *reqs[i]);
        ASSERT_TRUE(reqs[i]);
        cs_live_req_init(&list, &reqs[i]->life); /* the producer's reference */
        if (i % 2) cs_live_req_ref(&reqs[i]->life), cs_live_req_unref(&reqs[i]->life);
    }
    ASSERT_EQ_INT(list.n, N_REQ);
    ASSERT_TRUE(list.head == &reqs[N_REQ - 1]->life); /* newest first */
    for (int k = 0; k < N_THREADS; k++)
        ASSERT_EQ_INT(pthread_create(&threads[k], NULL, producer, (void *)(intptr_t)k), 0);
}

int main(void) {
    ASSERT_EQ_INT(uv_loop_init(&uv), 0);
    ASSERT_EQ_INT(cs_rpc_loop_init(&uv, &rl), 0);
    list = (cs_live_list){.rl = rl, .drain = drain, .release = release};
    uv_timer_t start, check;
    uv_timer_init(&uv, &start);
    uv_timer_start(&start, on_start, 0, 0);
    uv_timer_init(&uv, &check);
    uv_timer_start(&check, on_check, 1, 1);
    uv_run(&uv, UV_RUN_DEFAULT);
    for (int t = 0; t < N_THREADS; t++)
        pthread_join(threads[t], NULL);
    ASSERT_EQ_INT(atomic_load(&released), N_REQ);
    ASSERT_TRUE(atomic_load(&drains) >= N_REQ);
    printf("live_req: %d requests x %d events, %d drains (%d found nothing new), %d released\n",
           N_REQ, N_EVENTS, atomic_load(&drains), atomic_load(&empty_drains),
           atomic_load(&released));
    ASSERT_EQ_INT(uv_loop_close(&uv), 0);
    cs_rpc_wait_grpc_ended(5000);
    return 0;
}
