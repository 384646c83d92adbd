/* test_kvx_engine: real KV pages of the tiny model, computed by one engine,
 * cross the TCP payload by page id (gathered from a sender pool at scattered
 * ids) and land bit-identical in another engine's reserved pages (the
 * receiver writes the engine's pool, cs_kvx_pool_of_engine): ranges from 1
 * page to thousands, many transfers interleaved on one channel, several
 * channels at once (2 senders x 2 receivers); abort, cancel and deadlines
 * give every reserved page back and every sent page is released once; a
 * layout mismatch is refused at connect time. */
#include <stdio.h>
#include <stdlib.h>

#include "chunkserve/engine.h"
#include "chunkserve/kvx_engine.h"
#include "kvx_test.h"

static cs_model *model;
static size_t page_bytes;
static uint8_t *real; /* n_real pages of real KV exported from the sender engine */
static int32_t n_real;
#define NSRC 8192
static uint8_t *src_pool;      /* the senders' host pool: NSRC pages */
static int32_t src_perm[NSRC]; /* its page ids, handed out in a scattered order */
static int src_next;
static int released;     /* pages handed back by the senders */
static int queued_pages; /* pages queued successfully: each is released once */

static void on_release(void *arg, const int32_t *ids, int32_t n) {
    (void)arg, (void)ids;
    __atomic_add_fetch(&released, n, __ATOMIC_SEQ_CST);
}

typedef struct {
    cs_engine *e;
    cs_kvx_rx *rx;
    waiter w;
} recv_side;

static void recv_init(recv_side *r, int32_t n_pages, int32_t dead_ms) {
    cs_engine_params ep = cs_engine_params_default();
    ep.n_pages = n_pages;
    ep.n_threads = 1;
    ASSERT_EQ_INT(cs_engine_init(model, &ep, &r->e), 0);
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = cs_kvx_layout_of_engine(r->e);
    p.pool = cs_kvx_pool_of_engine(r->e);
    p.keepalive_ms = 200;
    p.dead_ms = dead_ms;
    ASSERT_EQ_INT(cs_kvx_rx_init(&p, &r->rx), 0);
    waiter_init(&r->w);
}

static void recv_free(recv_side *r) {
    ASSERT_EQ_INT(cs_kv_cache_n_free(cs_engine_kv(r->e)), cs_kv_cache_n_pages(cs_engine_kv(r->e)));
    ASSERT_EQ_INT(cs_kv_cache_check(cs_engine_kv(r->e)), 0);
    cs_kvx_rx_free(r->rx);
    cs_engine_free(r->e);
}

/* The source bytes of page i of a transfer: real pages, cycled, each one
 * salted with its index in the first 8 bytes so that misplaced pages show. */
static void fill_src(uint8_t *dst, int32_t n, uint64_t salt) {
    for (int32_t i = 0; i < n; i++) {
        memcpy(dst + (size_t)i * page_bytes, real + (size_t)(i % n_real) * page_bytes, page_bytes);
        uint64_t s = salt * 1000003u + (uint64_t)i;
        memcpy(dst + (size_t)i * page_bytes, &s, sizeof s);
    }
}

static cs_kvx_tx *tx_new(const char *name, cs_engine *like) {
    cs_kvx_tx_params p = cs_kvx_tx_params_default();
    p.layout = cs_kvx_layout_of_engine(like);
    p.pool = host_pool(src_pool, NSRC);
    p.name = name;
    p.keepalive_ms = 200;
    p.dead_ms = 3000;
    p.max_frame_bytes = 64 * 1024; /* many frames per chunk */
    cs_kvx_tx *tx;
    ASSERT_EQ_INT(cs_kvx_tx_init(&p, &tx), 0);
    return tx;
}

typedef struct {
    uint64_t id;
    int32_t n;
    int32_t *ids;  /* receiver's reserved pages */
    int32_t *sids; /* sender's pages (in src_pool) */
    uint8_t *src;  /* their expected content, contiguous */
    int32_t sent;
} xfer;

static int32_t lease_ms = 20000; /* the receiver's deadline in xfer_open */

static void xfer_open(xfer *x, uint64_t id, int32_t n, recv_side *r, cs_kvx_tx *tx, waiter *tw) {
    x->id = id;
    x->n = n;
    x->sent = 0;
    x->ids = malloc((size_t)n * sizeof *x->ids);
    x->sids = malloc((size_t)n * sizeof *x->sids);
    x->src = malloc((size_t)n * page_bytes);
    fill_src(x->src, n, id);
    for (int32_t i = 0; i < n; i++) {
        x->sids[i] = src_perm[src_next++ % NSRC];
        memcpy(src_pool + (size_t)x->sids[i] * page_bytes, x->src + (size_t)i * page_bytes,
               page_bytes);
    }
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(cs_engine_kv(r->e), n, x->ids), 0);
    ASSERT_EQ_INT(cs_kvx_rx_expect(r->rx, id, NULL, x->ids, n, lease_ms, waiter_done, &r->w), 0);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(r->rx), id, n, 20000, waiter_done, tw), 0);
}

/* Queues the next chunk (up to `chunk` pages) by id. Returns whether the
 * transfer is fully queued (trailer included). */
static bool xfer_step(xfer *x, cs_kvx_tx *tx, int32_t chunk) {
    if (x->sent == x->n) return true;
    int32_t k = x->n - x->sent < chunk ? x->n - x->sent : chunk;
    ASSERT_EQ_INT(send_retry(tx, x->id, x->sent, k, x->sids + x->sent, on_release, NULL), 0);
    queued_pages += k;
    x->sent += k;
    if (x->sent == x->n) {
        /* the first token's logprobs ride along (n_top varies with the id) */
        cs_kvx_trailer t = {.first_token = (int32_t)(x->id % 1000),
                            .prompt_len = x->n * 16 - 3,
                            .total_pages = x->n,
                            .first_logprob = -0.5f,
                            .n_top = (int32_t)(x->id % (CS_KVX_MAX_TOP + 1))};
        for (int32_t i = 0; i < t.n_top; i++)
            t.top_ids[i] = i * 7, t.top_logprobs[i] = -0.125f * (float)(i + 1);
        ASSERT_EQ_INT(cs_kvx_tx_finish(tx, x->id, &t), 0);
        return true;
    }
    return false;
}

static void xfer_check_free(xfer *x, recv_side *r) {
    ASSERT_EQ_INT(waiter_status(&r->w, x->id), 0);
    uint8_t *got = malloc((size_t)x->n * page_bytes);
    ASSERT_EQ_INT(cs_engine_kv_export(r->e, x->ids, x->n, got), 0);
    if (memcmp(got, x->src, (size_t)x->n * page_bytes) != 0) {
        fprintf(stderr, "transfer %llu: pages differ\n", (unsigned long long)x->id);
        exit(1);
    }
    ASSERT_EQ_INT(cs_kv_cache_free_pages(cs_engine_kv(r->e), x->ids, x->n), 0);
    free(got);
    free(x->ids);
    free(x->sids);
    free(x->src);
}

static void release_pages(recv_side *r, xfer *x) {
    ASSERT_EQ_INT(cs_kv_cache_free_pages(cs_engine_kv(r->e), x->ids, x->n), 0);
    free(x->ids);
    free(x->sids);
    free(x->src);
}

int main(void) {
    const char *dir = getenv("CS_TINY_DIR");
    if (!dir) return TEST_SKIP;
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", dir);
    ASSERT_EQ_INT(cs_model_load(path, &model), 0);

    /* Sender engine: run two prompts through the model to fill real pages. */
    cs_engine_params ep = cs_engine_params_default();
    ep.n_pages = 64;
    ep.n_threads = 1;
    cs_engine *pe;
    ASSERT_EQ_INT(cs_engine_init(model, &ep, &pe), 0);
    page_bytes = cs_engine_page_bytes(pe);
    const cs_model_config *cf = cs_model_get_config(model);
    int32_t n_tok = cf->ctx_len < 256 ? cf->ctx_len : 256;
    int32_t *toks = malloc((size_t)n_tok * sizeof *toks);
    float *logits = malloc((size_t)cf->n_vocab * sizeof *logits);
    cs_page_table pt[2] = {{0}};
    for (int s = 0; s < 2; s++) {
        for (int32_t i = 0; i < n_tok; i++)
            toks[i] = (int32_t)((i * 7919 + s * 104729) % cf->n_vocab);
        ASSERT_EQ_INT(cs_engine_eval_seq(pe, &pt[s], 0, toks, n_tok, 48, logits), 0);
    }
    n_real = pt[0].n_pages + pt[1].n_pages;
    real = malloc((size_t)n_real * page_bytes);
    ASSERT_EQ_INT(cs_engine_kv_export(pe, pt[0].pages, pt[0].n_pages, real), 0);
    ASSERT_EQ_INT(cs_engine_kv_export(pe, pt[1].pages, pt[1].n_pages,
                                      real + (size_t)pt[0].n_pages * page_bytes),
                  0);
    fprintf(stderr, "page_bytes %zu, %d real pages\n", page_bytes, n_real);
    src_pool = malloc((size_t)NSRC * page_bytes);
    ASSERT_TRUE(src_pool != NULL);
    for (int i = 0; i < NSRC; i++)
        src_perm[i] = i;
    for (int i = NSRC - 1; i > 0; i--) {
        int j = (int)(((uint64_t)i * 2654435761u + 12345u) % (uint64_t)(i + 1)), t = src_perm[i];
        src_perm[i] = src_perm[j], src_perm[j] = t;
    }

    recv_side r[2];
    recv_init(&r[0], 8192, 3000);
    recv_init(&r[1], 2048, 3000);
    cs_kvx_tx *tx = tx_new("prefill-a", pe), *tx2 = tx_new("prefill-b", pe);
    waiter tw;
    waiter_init(&tw);

    /* 1. Ranges from 1 page to thousands, one at a time, chunks of 32 pages. */
    int32_t sizes[] = {1, 2, 7, 100, 3000};
    uint64_t id = 100;
    int done_tx = 0, done_rx0 = 0, done_rx1 = 0;
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        xfer x;
        xfer_open(&x, ++id, sizes[k], &r[0], tx, &tw);
        while (!xfer_step(&x, tx, 32)) {
        }
        ASSERT_TRUE(waiter_wait(&r[0].w, ++done_rx0, 20000));
        ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 20000));
        ASSERT_EQ_INT(waiter_status(&tw, x.id), 0);
        ASSERT_EQ_INT(r[0].w.t[done_rx0 - 1].total_pages, sizes[k]);
        const cs_kvx_trailer *got = &r[0].w.t[done_rx0 - 1];
        ASSERT_EQ_INT(got->first_token, (int32_t)(x.id % 1000));
        ASSERT_TRUE(got->first_logprob == -0.5f);
        ASSERT_EQ_INT(got->n_top, (int32_t)(x.id % (CS_KVX_MAX_TOP + 1)));
        for (int32_t i = 0; i < got->n_top; i++)
            ASSERT_TRUE(got->top_ids[i] == i * 7 &&
                        got->top_logprobs[i] == -0.125f * (float)(i + 1));
        xfer_check_free(&x, &r[0]);
    }
    fprintf(stderr, "ranges 1..3000 pages: ok\n");

    /* 2. 24 transfers interleaved chunk by chunk on one channel, and 3. the
     * same on four channels at once (2 senders x 2 receivers). */
    enum { NX = 24 };
    xfer xs[NX];
    for (int i = 0; i < NX; i++)
        xfer_open(&xs[i], ++id, 1 + (i * 37) % 90, &r[0], tx, &tw);
    for (bool all = false; !all;) {
        all = true;
        for (int i = 0; i < NX; i++)
            all &= xfer_step(&xs[i], tx, 1 + i % 5);
    }
    done_rx0 += NX, done_tx += NX;
    ASSERT_TRUE(waiter_wait(&r[0].w, done_rx0, 20000));
    ASSERT_TRUE(waiter_wait(&tw, done_tx, 20000));
    for (int i = 0; i < NX; i++)
        xfer_check_free(&xs[i], &r[0]);
    fprintf(stderr, "%d interleaved transfers on one channel: ok\n", NX);

    waiter tw2;
    waiter_init(&tw2);
    int done_tx2 = 0;
    for (int i = 0; i < NX; i++) {
        recv_side *rr = &r[i % 2];
        xfer_open(&xs[i], ++id, 3 + (i * 53) % 200, rr, i / 2 % 2 ? tx2 : tx,
                  i / 2 % 2 ? &tw2 : &tw);
    }
    for (bool all = false; !all;) {
        all = true;
        for (int i = 0; i < NX; i++)
            all &= xfer_step(&xs[i], i / 2 % 2 ? tx2 : tx, 8);
    }
    done_rx0 += NX / 2, done_rx1 += NX / 2, done_tx += NX / 2, done_tx2 += NX / 2;
    ASSERT_TRUE(waiter_wait(&r[0].w, done_rx0, 20000));
    ASSERT_TRUE(waiter_wait(&r[1].w, done_rx1, 20000));
    ASSERT_TRUE(waiter_wait(&tw, done_tx, 20000));
    ASSERT_TRUE(waiter_wait(&tw2, done_tx2, 20000));
    for (int i = 0; i < NX; i++)
        xfer_check_free(&xs[i], &r[i % 2]);
    fprintf(stderr, "%d transfers on 4 channels at once: ok\n", NX);

    /* 4. Sender abort mid-transfer: both sides report it; pages come back. */
    xfer x;
    xfer_open(&x, ++id, 50, &r[0], tx, &tw);
    xfer_step(&x, tx, 20);
    ASSERT_EQ_INT(cs_kvx_tx_abort(tx, x.id), 0);
    ASSERT_TRUE(waiter_wait(&r[0].w, ++done_rx0, 5000));
    ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 5000));
    ASSERT_EQ_INT(waiter_status(&r[0].w, x.id), CS_ECANCELED);
    ASSERT_EQ_INT(waiter_status(&tw, x.id), CS_ECANCELED);
    ASSERT_EQ_INT(cs_kvx_tx_send_pages(tx, x.id, 20, 1, x.sids + 20, on_release, NULL), CS_ENOENT);
    release_pages(&r[0], &x);

    /* 5. Receiver cancel mid-transfer: the sender learns it from an ABORT. */
    xfer_open(&x, ++id, 50, &r[0], tx, &tw);
    xfer_step(&x, tx, 20);
    ASSERT_EQ_INT(cs_kvx_rx_cancel(r[0].rx, x.id), 0);
    ASSERT_TRUE(waiter_wait(&r[0].w, ++done_rx0, 5000));
    ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 5000));
    ASSERT_EQ_INT(waiter_status(&r[0].w, x.id), CS_ECANCELED);
    ASSERT_EQ_INT(waiter_status(&tw, x.id), CS_ECANCELED);
    release_pages(&r[0], &x);

    /* 6. Deadline on the receiver (sender stalls after 10 pages) and on the
     * sender (its own shorter deadline); nothing is left reserved. */
    x.id = ++id;
    x.n = 40;
    x.ids = malloc(40 * sizeof *x.ids);
    x.sids = malloc(40 * sizeof *x.sids);
    x.src = malloc(40 * page_bytes);
    x.sent = 0;
    fill_src(x.src, 40, x.id);
    for (int32_t i = 0; i < 40; i++)
        x.sids[i] = src_perm[src_next++ % NSRC];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(cs_engine_kv(r[0].e), 40, x.ids), 0);
    int64_t t0 = test_now_ms();
    ASSERT_EQ_INT(cs_kvx_rx_expect(r[0].rx, x.id, NULL, x.ids, 40, 300, waiter_done, &r[0].w), 0);
    ASSERT_EQ_INT(cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(r[0].rx), x.id, 40, 10000,
                                  waiter_done, &tw),
                  0);
    xfer_step(&x, tx, 10);
    ASSERT_TRUE(waiter_wait(&r[0].w, ++done_rx0, 5000));
    ASSERT_EQ_INT(waiter_status(&r[0].w, x.id), CS_ETIMEDOUT);
    ASSERT_TRUE(test_now_ms() - t0 < 2000);
    ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 5000)); /* told by the receiver's ABORT */
    ASSERT_TRUE(waiter_status(&tw, x.id) < 0);
    release_pages(&r[0], &x);

    x.id = ++id;
    t0 = test_now_ms();
    int32_t one_id;
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(cs_engine_kv(r[0].e), 1, &one_id), 0);
    ASSERT_EQ_INT(cs_kvx_rx_expect(r[0].rx, x.id, NULL, &one_id, 1, 10000, waiter_done, &r[0].w),
                  0);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(r[0].rx), x.id, 1, 200, waiter_done, &tw),
        0);
    ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 5000));
    ASSERT_EQ_INT(waiter_status(&tw, x.id), CS_ETIMEDOUT);
    ASSERT_TRUE(test_now_ms() - t0 < 2000);
    /* the sender's ABORT reaches the decode side, which gives its pages back */
    ASSERT_TRUE(waiter_wait(&r[0].w, ++done_rx0, 5000));
    ASSERT_EQ_INT(waiter_status(&r[0].w, x.id), CS_ECANCELED);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(cs_engine_kv(r[0].e), &one_id, 1), 0);
    fprintf(stderr, "abort, cancel, deadlines: ok\n");

    /* 7. Layout mismatch: refused at connect time with a message. */
    cs_kvx_tx_params bp = cs_kvx_tx_params_default();
    bp.layout = cs_kvx_layout_of_engine(pe);
    bp.layout.page_size = 32;
    bp.pool = host_pool(src_pool, NSRC);
    bp.name = "prefill-wrong";
    cs_kvx_tx *bad;
    ASSERT_EQ_INT(cs_kvx_tx_init(&bp, &bad), 0);
    waiter bw;
    waiter_init(&bw);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(bad, "127.0.0.1", cs_kvx_rx_port(r[0].rx), ++id, 1, 5000, waiter_done, &bw),
        0);
    ASSERT_TRUE(waiter_wait(&bw, 1, 5000));
    ASSERT_EQ_INT(bw.status[0], CS_ECONNREFUSED);
    ASSERT_MSG_HAS(bw.msg[0], "layout mismatch");
    cs_kvx_tx_free(bad);
    /* Renewals: a 300 ms reservation outlives a 1.5 s wait for its first page
     * while the sender renews it every 50 ms, and the transfer completes; the
     * same wait without renewals (tx above: every 1000 ms) expires it. */
    {
        cs_kvx_tx_params np = cs_kvx_tx_params_default();
        np.layout = cs_kvx_layout_of_engine(pe);
        np.pool = host_pool(src_pool, NSRC);
        np.name = "prefill-renew";
        np.renew_ms = 50;
        cs_kvx_tx *rt;
        ASSERT_EQ_INT(cs_kvx_tx_init(&np, &rt), 0);
        cs_kvx_stats s0, s1;
        cs_kvx_rx_get_stats(r[0].rx, &s0);
        waiter rw;
        waiter_init(&rw);
        xfer x2;
        lease_ms = 300;
        xfer_open(&x2, ++id, 4, &r[0], rt, &rw);
        lease_ms = 20000;
        usleep(1500 * 1000);
        while (!xfer_step(&x2, rt, 4)) {
        }
        ASSERT_TRUE(waiter_wait(&r[0].w, ++done_rx0, 5000));
        xfer_check_free(&x2, &r[0]);
        ASSERT_TRUE(waiter_wait(&rw, 1, 5000));
        ASSERT_EQ_INT(waiter_status(&rw, x2.id), 0);
        cs_kvx_rx_get_stats(r[0].rx, &s1);
        ASSERT_TRUE(s1.renewals - s0.renewals >= 10);
        cs_kvx_tx_free(rt);
        fprintf(stderr, "renewals: %llu, the reservation lived through the wait\n",
                (unsigned long long)(s1.renewals - s0.renewals));
    }
    /* the same layout from another model (its fingerprint): refused as such */
    ASSERT_TRUE(cs_kvx_layout_of_engine(pe).model != 0);
    bp.layout = cs_kvx_layout_of_engine(pe);
    bp.layout.model ^= 1;
    bp.name = "prefill-other-model";
    ASSERT_EQ_INT(cs_kvx_tx_init(&bp, &bad), 0);
    waiter_init(&bw);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(bad, "127.0.0.1", cs_kvx_rx_port(r[0].rx), ++id, 1, 5000, waiter_done, &bw),
        0);
    ASSERT_TRUE(waiter_wait(&bw, 1, 5000));
    ASSERT_EQ_INT(bw.status[0], CS_ECONNREFUSED);
    ASSERT_MSG_HAS(bw.msg[0], "model mismatch: layout fingerprint");
    cs_kvx_tx_free(bad);
    /* a name is never resolved on the I/O thread: the transfer fails at once */
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "localhost", cs_kvx_rx_port(r[0].rx), ++id, 1, 5000, waiter_done, &tw),
        0);
    ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 5000));
    ASSERT_EQ_INT(waiter_status(&tw, id), CS_ENOENT);
    /* connection refused (nobody listening) fails the transfer, not the caller */
    ASSERT_EQ_INT(cs_kvx_tx_begin(tx, "127.0.0.1", 1, ++id, 1, 5000, waiter_done, &tw), 0);
    ASSERT_TRUE(waiter_wait(&tw, ++done_tx, 5000));
    ASSERT_EQ_INT(waiter_status(&tw, id), CS_ECONNREFUSED);

    cs_kvx_stats st;
    cs_kvx_rx_get_stats(r[0].rx, &st);
    fprintf(stderr,
            "rx0: started %llu completed %llu failed %llu bytes %llu protocol errors %llu\n",
            (unsigned long long)st.transfers_started, (unsigned long long)st.transfers_completed,
            (unsigned long long)st.transfers_failed, (unsigned long long)st.bytes,
            (unsigned long long)st.protocol_errors);
    ASSERT_EQ_INT(st.transfers_active, 0);
    ASSERT_EQ_INT(st.protocol_errors, 2); /* the two refused layouts */
    cs_kvx_tx_free(tx);
    cs_kvx_tx_free(tx2);
    ASSERT_EQ_INT(released, queued_pages); /* every page sent was handed back once */
    fprintf(stderr, "%d pages queued, %d released\n", queued_pages, released);
    recv_free(&r[0]);
    recv_free(&r[1]);
    cs_page_table_release(&pt[0], cs_engine_kv(pe));
    cs_page_table_release(&pt[1], cs_engine_kv(pe));
    free(pt[0].pages);
    free(pt[1].pages);
    cs_engine_free(pe);
    cs_model_free(model);
    free(real), free(toks), free(logits), free(src_pool);
    fprintf(stderr, "ok\n");
    return 0;
}
