/* test_kvx_nccl_ctl: the KV transport's NCCL payload without a GPU. First
 * the wire: the NCCL frame types decode on an NCCL channel and are refused by
 * a TCP reader (and PAGES by an NCCL reader), malformed NCCL frames are
 * refused with a message, the KV sum's properties. Then the one control
 * plane (kvx_tx*.c, kvx_rx*.c: the same code the TCP tests drive) over the
 * loopback stand-in of kvx_nccl_loop.h: pages bit-identical from 1 to 3,000 pages, 24 interleaved
 * transfers, abort and cancel mid-transfer (the receiver still drains the
 * cancelled transfer's chunks, so later transfers stay matched), deadlines,
 * an async communicator error, a hung send (op timeout), a corrupted chunk,
 * an init that never completes, no communicator id, a chunk-size mismatch,
 * TCP/NCCL payload mix-ups (refused at HELLO, naming both), peer death both
 * ways. Every failure must reach
 * every transfer of the channel exactly once, and the next transfer must
 * build a new communicator. What it cannot show: NCCL and the kernels
 * themselves (tests/gpu/test_kvx_nccl.c, 2 GPUs). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvx_nccl_loop.h"
#include "kvx_test.h"

#define PB 256
#define NPOOL 4096
static const cs_kvx_layout L = {2, 1, 16, CS_KVX_DTYPE_BF16, 2, PB, CS_KVX_WEIGHTS_FP32, 0x5eed};
static uint8_t *pool_a, *pool_b; /* sender's and receiver's "device" pools */
static int releases, accepted;   /* release runs once per accepted send_pages call */

static void on_release(void *arg, const int32_t *ids, int32_t n) {
    (void)arg, (void)ids, (void)n;
    __atomic_add_fetch(&releases, 1, __ATOMIC_SEQ_CST);
}

static uint64_t rng = 0x1234567887654321ull;
static uint64_t rnd(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

/* ---------------------------------------------------------------- wire */

static size_t put_frame(uint8_t *out, int type, uint32_t flags, uint64_t xfer, uint32_t first,
                        uint32_t n, const void *pl, size_t len) {
    cs_kvx_hdr h = {0};
    h.type = (uint16_t)type, h.epoch = 9, h.xfer_id = xfer, h.first_page = first, h.n_pages = n;
    h.fingerprint = cs_kvx_layout_fingerprint(&L), h.payload_len = len, h.flags = flags;
    if (len) h.flags |= CS_KVX_FLAG_CHECKSUM, h.payload_xxh64 = cs_kvx_payload_sum(pl, len);
    cs_kvx_hdr_encode(&h, out);
    if (len) memcpy(out + CS_KVX_HDR_BYTES, pl, len);
    return CS_KVX_HDR_BYTES + len;
}

static size_t put_desc(uint8_t *out, uint64_t xfer, uint32_t first, uint32_t n, uint64_t bytes,
                       uint32_t dflags) {
    cs_kvx_link_desc d = {bytes, 0x1234, dflags};
    uint8_t pl[CS_KVX_LINK_DESC_BYTES];
    cs_kvx_link_desc_encode(&d, pl);
    return put_frame(out, CS_KVX_LINK_PAGES, 0, xfer, first, n, pl, sizeof pl);
}

#define EXPECT_REFUSED(call, code, needle)                                                         \
    do {                                                                                           \
        char e_[256] = "";                                                                         \
        int r_ = (call);                                                                           \
        if (r_ != (code)) fprintf(stderr, "refusal: %d (%s)\n", r_, e_);                           \
        ASSERT_EQ_INT(r_, code);                                                                   \
        ASSERT_MSG_HAS(e_, needle);                                                                \
    } while (0)

static void test_wire(void) {
    cs_kvx_limits lim = {PB, 16 * PB, true}, /* an inline channel's reader (TCP) */
        nlim = {PB, 16 * PB, false};         /* a link channel's (NCCL) */
    uint8_t buf[4096], pl[256];
    size_t n = 0;
    cs_kvx_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.layout = L;
    strcpy(hello.name, "prefill-0");
    hello.payload = CS_KVX_PAYLOAD_NCCL;
    cs_kvx_hello_encode(&hello, pl);
    n += put_frame(buf + n, CS_KVX_HELLO, 0, 0, 0, 0, pl, CS_KVX_HELLO_BYTES);
    size_t hello_end = n;
    for (int i = 0; i < CS_KVX_LINK_ID_BYTES; i++)
        pl[i] = (uint8_t)(i * 7);
    n += put_frame(buf + n, CS_KVX_LINK_ID, 0, 0, 0, 0, pl, CS_KVX_LINK_ID_BYTES);
    uint8_t ack[CS_KVX_ACK_BYTES];
    cs_kvx_ack_encode(0, "ok", ack);
    n += put_frame(buf + n, CS_KVX_LINK_READY, 0, 0, 0, 16, ack, sizeof ack);
    n += put_desc(buf + n, 1, 0, 2, 2 * PB, CS_KVX_DESC_SUM);
    cs_kvx_trailer_wire tw = {.t = {.first_token = 5, .prompt_len = 4, .total_pages = 2},
                              .xxh64 = 77};
    uint8_t tb[CS_KVX_TRAILER_BYTES];
    cs_kvx_trailer_encode(&tw, tb);
    n += put_frame(buf + n, CS_KVX_TRAILER, 0, 1, 0, 0, tb, sizeof tb);
    n += put_frame(buf + n, CS_KVX_PING, 0, 0, 0, 0, NULL, 0);
    char err[256] = "";
    ASSERT_EQ_INT(cs_kvx_decode_stream(buf, n, &nlim, err, sizeof err), 6);
    /* a TCP reader takes the HELLO (the receiver refuses its payload, naming
     * both) but refuses the NCCL frames after it, also after a plain HELLO */
    EXPECT_REFUSED(cs_kvx_decode_stream(buf, n, &lim, e_, sizeof e_), CS_EPROTO,
                   "LINK_ID frame on an inline channel");
    uint8_t b2[1024];
    size_t n2 = put_frame(b2, CS_KVX_HELLO, 0, 0, 0, 0, buf + CS_KVX_HDR_BYTES, CS_KVX_HELLO_BYTES);
    memcpy(b2 + n2, buf + hello_end, CS_KVX_HDR_BYTES + CS_KVX_LINK_ID_BYTES);
    n2 += CS_KVX_HDR_BYTES + CS_KVX_LINK_ID_BYTES;
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &lim, e_, sizeof e_), CS_EPROTO, "inline channel");
    ASSERT_EQ_INT(cs_kvx_decode_stream(b2, n2, &nlim, err, sizeof err), 2);
    /* an NCCL reader refuses page bytes on TCP */
    uint8_t pg[2 * PB] = {1};
    n2 = put_frame(b2, CS_KVX_PAGES, 0, 1, 0, 2, pg, sizeof pg);
    ASSERT_EQ_INT(cs_kvx_decode_stream(b2, n2, &lim, err, sizeof err), 1);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EPROTO, "link channel");
    /* malformed NCCL frames */
    n2 = put_desc(b2, 1, 0, 0, 0, CS_KVX_DESC_SUM);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG, "0 pages");
    n2 = put_desc(b2, 1, 0, 17, 17 * PB, CS_KVX_DESC_SUM);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG, "chunk limit");
    n2 = put_desc(b2, 1, 0, 2, 3 * PB, CS_KVX_DESC_SUM);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG, "announces");
    n2 = put_desc(b2, 1, 0, 2, 2 * PB, 2);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG, "unknown flags");
    n2 = put_frame(b2, CS_KVX_LINK_ID, 0, 0, 0, 0, pl, 100);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG,
                   "payload length");
    n2 = put_frame(b2, CS_KVX_PING, 2, 0, 0, 0, NULL, 0); /* version 4's NCCL flag: gone */
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG,
                   "unknown frame flags");
    cs_kvx_ack_encode(5, "??", ack);
    n2 = put_frame(b2, CS_KVX_LINK_READY, 0, 0, 0, 0, ack, sizeof ack);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EBADMSG,
                   "positive status");
    n2 = put_frame(b2, CS_KVX_LAST_TYPE + 1, 0, 0, 0, 0, NULL, 0);
    EXPECT_REFUSED(cs_kvx_decode_stream(b2, n2, &nlim, e_, sizeof e_), CS_EPROTO,
                   "unknown frame type");
    ASSERT_EQ_STR(cs_kvx_frame_type_name(CS_KVX_LINK_PAGES), "LINK_PAGES");
    /* the payload registry (kvx_io.c) agrees with the ifaces it holds */
    const cs__kvx_payload *tcp = cs__kvx_payload_of_kind(CS_KVX_PAYLOAD_TCP);
    ASSERT_TRUE(tcp == &cs__kvx_payload_tcp && tcp == cs__kvx_payload_for_pool(CS_KVX_POOL_HOST));
    ASSERT_EQ_STR(cs_kvx_payload_name(tcp->kind), tcp->name);
    ASSERT_EQ_INT(cs_kvx_payload_of_pool(tcp->pool_kind), tcp->kind);
    ASSERT_EQ_STR(cs_kvx_payload_name(CS_KVX_PAYLOAD_NCCL), "nccl"); /* named in any build */
    ASSERT_EQ_INT(cs_kvx_payload_of_pool(CS_KVX_POOL_CUDA), CS_KVX_PAYLOAD_NCCL);
    ASSERT_EQ_STR(cs_kvx_payload_name(7), "?");
    ASSERT_EQ_STR(cs_kvx_frame_type_name(CS_KVX_AUTH), "AUTH");
    ASSERT_EQ_STR(cs_kvx_frame_type_name(CS_KVX_LAST_TYPE + 1), "unknown");

    /* the KV sum: every changed word, every swap, and the zero-padded tail count */
    uint8_t a[200], b[200];
    for (int i = 0; i < 200; i++)
        a[i] = (uint8_t)rnd();
    uint64_t s0 = cs__kvx_sum_ref(a, sizeof a);
    for (int w = 0; w < 25; w++) {
        memcpy(b, a, sizeof a);
        b[w * 8 + (w % 8)] ^= 1;
        ASSERT_TRUE(cs__kvx_sum_ref(b, sizeof b) != s0);
    }
    memcpy(b, a, sizeof a);
    memcpy(b, a + 8, 8), memcpy(b + 8, a, 8);
    if (memcmp(a, a + 8, 8)) ASSERT_TRUE(cs__kvx_sum_ref(b, sizeof b) != s0);
    ASSERT_TRUE(cs__kvx_sum_ref(a, 13) != cs__kvx_sum_ref(a, 12) || a[12] == 0);
    printf("wire: NCCL frames decoded on NCCL channels, refused by TCP readers; malformed ones "
           "named\n");
}

/* ------------------------------------------------------- control plane */

typedef struct {
    uint64_t id;
    int32_t n, sent;
    int32_t *src, *dst;
} xf;

static int32_t *perm; /* receiver page ids handed out in turn */
static int perm_pos;

static void xf_make(xf *x, uint64_t id, int32_t n) {
    x->id = id, x->n = n, x->sent = 0;
    x->src = malloc((size_t)n * sizeof *x->src);
    x->dst = malloc((size_t)n * sizeof *x->dst);
    for (int32_t i = 0; i < n; i++) {
        x->src[i] = (int32_t)(rnd() % NPOOL);
        x->dst[i] = perm[perm_pos++ % NPOOL];
    }
}

static void xf_free(xf *x) {
    free(x->src), free(x->dst);
}

/* Queues up to step pages of x (retrying on backpressure); 0 or the error. */
static int xf_send_try(cs_kvx_tx *tx, xf *x, int32_t step) {
    int32_t k = x->n - x->sent < step ? x->n - x->sent : step;
    if (k <= 0) return 0;
    int r = send_retry(tx, x->id, x->sent, k, x->src + x->sent, on_release, NULL);
    if (r == 0) x->sent += k, __atomic_add_fetch(&accepted, 1, __ATOMIC_SEQ_CST);
    return r;
}

static void xf_send(cs_kvx_tx *tx, xf *x, int32_t step) {
    ASSERT_EQ_INT(xf_send_try(tx, x, step), 0);
}

static void xf_finish(cs_kvx_tx *tx, xf *x) {
    cs_kvx_trailer t = {.first_token = (int32_t)(x->id % 1000),
                        .prompt_len = x->n * L.page_size,
                        .total_pages = x->n};
    ASSERT_EQ_INT(cs_kvx_tx_finish(tx, x->id, &t), 0);
}

static void xf_check(const xf *x) {
    for (int32_t i = 0; i < x->n; i++)
        if (memcmp(pool_a + (size_t)x->src[i] * PB, pool_b + (size_t)x->dst[i] * PB, PB)) {
            fprintf(stderr, "transfer %llu: page %d differs\n", (unsigned long long)x->id, i);
            exit(1);
        }
}

static cs_kvx_tx *mk_tx(const char *name, int32_t chunk_pages, int32_t op_timeout,
                        int32_t init_timeout) {
    cs_kvx_tx_params p = cs_kvx_tx_params_default();
    p.layout = L;
    p.name = name;
    p.max_frame_bytes = (size_t)chunk_pages * PB;
    p.max_queued_bytes = 64 * PB;
    p.keepalive_ms = 100;
    p.dead_ms = 1000;
    p.pool = (cs_kvx_pool){CS_KVX_POOL_CUDA, -1, pool_a, NPOOL};
    p.n_slots = 2;
    p.op_timeout_ms = op_timeout;
    p.init_timeout_ms = init_timeout;
    cs_kvx_tx *tx;
    ASSERT_EQ_INT(cs__kvx_tx_init_payload(&p, &loop_ops, &tx), 0);
    return tx;
}

static cs_kvx_rx *mk_rx(int32_t chunk_pages, int32_t op_timeout, int32_t init_timeout) {
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = L;
    p.max_frame_bytes = (size_t)chunk_pages * PB;
    p.keepalive_ms = 100;
    p.dead_ms = 1000;
    p.pool = (cs_kvx_pool){CS_KVX_POOL_CUDA, -1, pool_b, NPOOL};
    p.n_slots = 3;
    p.op_timeout_ms = op_timeout;
    p.init_timeout_ms = init_timeout;
    cs_kvx_rx *rx;
    ASSERT_EQ_INT(cs__kvx_rx_init_payload(&p, &loop_ops, &rx), 0);
    return rx;
}

static waiter *wt, *wr; /* sender's and receiver's done callbacks */

#define LOOP_SET_PTR(p, v)                                                                         \
    do {                                                                                           \
        pthread_mutex_lock(&loop_mu);                                                              \
        *(p) = (v);                                                                                \
        pthread_mutex_unlock(&loop_mu);                                                            \
    } while (0)

static void waiters_reset(void) {
    waiter_init(wt);
    waiter_init(wr);
}

static void begin(cs_kvx_tx *tx, cs_kvx_rx *rx, const xf *x, int32_t deadline_ms) {
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, x->id, NULL, x->dst, x->n, deadline_ms, waiter_done, wr), 0);
    ASSERT_EQ_INT(cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(rx), x->id, x->n, deadline_ms,
                                  waiter_done, wt),
                  0);
}

/* Each waiter got exactly n callbacks (and no more after a while). */
static void expect_done(int n, int timeout_ms) {
    ASSERT_TRUE(waiter_wait(wt, n, timeout_ms));
    ASSERT_TRUE(waiter_wait(wr, n, timeout_ms));
    usleep(100000);
    ASSERT_EQ_INT(wt->n_done, n);
    ASSERT_EQ_INT(wr->n_done, n);
}

static void test_sizes(void) {
    waiters_reset();
    cs_kvx_rx *rx = mk_rx(16, 5000, 5000);
    cs_kvx_tx *tx = mk_tx("prefill-0", 8, 5000, 5000);
    int32_t sizes[] = {1, 7, 8, 9, 37, 3000};
    int nt = (int)(sizeof sizes / sizeof *sizes);
    int64_t pages = 0;
    for (int i = 0; i < nt; i++) {
        xf x;
        xf_make(&x, 100 + (uint64_t)i, sizes[i]);
        begin(tx, rx, &x, 20000);
        while (x.sent < x.n)
            xf_send(tx, &x, 5);
        xf_finish(tx, &x);
        ASSERT_TRUE(waiter_wait(wr, i + 1, 20000));
        ASSERT_TRUE(waiter_wait(wt, i + 1, 20000));
        ASSERT_EQ_INT(waiter_status(wr, x.id), 0);
        ASSERT_EQ_INT(waiter_status(wt, x.id), 0);
        ASSERT_EQ_INT(wr->t[i].total_pages, x.n);
        ASSERT_EQ_INT(wr->t[i].prompt_len, x.n * L.page_size);
        ASSERT_EQ_INT(wr->t[i].first_token, (int32_t)(x.id % 1000));
        xf_check(&x);
        pages += x.n;
        xf_free(&x);
    }
    cs_kvx_stats st, sr;
    cs_kvx_tx_get_stats(tx, &st);
    cs_kvx_rx_get_stats(rx, &sr);
    ASSERT_EQ_INT(st.transfers_completed, nt);
    ASSERT_EQ_INT(sr.transfers_completed, nt);
    ASSERT_EQ_INT(st.bytes, pages * PB);
    ASSERT_EQ_INT(sr.bytes, pages * PB);
    ASSERT_EQ_INT(st.conns_opened, 1);
    ASSERT_EQ_INT(sr.protocol_errors, 0);
    for (int i = 0; i < 200 && __atomic_load_n(&releases, __ATOMIC_SEQ_CST) < accepted; i++)
        usleep(10000);
    ASSERT_EQ_INT(releases, accepted);
    cs_kvx_tx_free(tx);
    cs_kvx_rx_free(rx);
    ASSERT_EQ_INT(loop_get_open_links(), 0);
    printf("sizes: 1 to 3000 pages bit-identical over 8-page chunks, one communicator, every page "
           "released\n");
}

static void test_interleaved(void) {
    waiters_reset();
    cs_kvx_rx *rx = mk_rx(16, 5000, 5000);
    cs_kvx_tx *tx = mk_tx("prefill-1", 16, 5000, 5000);
    enum { NX = 24 };
    xf xs[NX];
    for (int i = 0; i < NX; i++) {
        xf_make(&xs[i], 1000 + (uint64_t)i, 1 + (int32_t)(rnd() % 200));
        begin(tx, rx, &xs[i], 20000);
    }
    for (int left = NX; left > 0;) {
        left = 0;
        for (int i = 0; i < NX; i++) {
            if (xs[i].sent == xs[i].n) continue;
            xf_send(tx, &xs[i], 1 + (int32_t)(rnd() % 7));
            if (xs[i].sent == xs[i].n)
                xf_finish(tx, &xs[i]);
            else
                left++;
        }
    }
    expect_done(NX, 20000);
    for (int i = 0; i < NX; i++) {
        ASSERT_EQ_INT(waiter_status(wt, xs[i].id), 0);
        ASSERT_EQ_INT(waiter_status(wr, xs[i].id), 0);
        xf_check(&xs[i]);
        xf_free(&xs[i]);
    }
    cs_kvx_tx_free(tx);
    cs_kvx_rx_free(rx);
    printf("interleaved: %d transfers on one channel, all bit-identical\n", NX);
}

static void test_abort_cancel_deadline(void) {
    waiters_reset();
    cs_kvx_rx *rx = mk_rx(16, 5000, 5000);
    cs_kvx_tx *tx = mk_tx("prefill-2", 8, 5000, 5000);
    xf a, b, c, d;
    /* sender aborts mid-transfer */
    xf_make(&a, 2001, 100);
    begin(tx, rx, &a, 20000);
    xf_send(tx, &a, 50);
    usleep(50000);
    ASSERT_EQ_INT(cs_kvx_tx_abort(tx, a.id), 0);
    ASSERT_TRUE(waiter_wait(wt, 1, 5000) && waiter_wait(wr, 1, 5000));
    ASSERT_EQ_INT(waiter_status(wt, a.id), CS_ECANCELED);
    ASSERT_EQ_INT(waiter_status(wr, a.id), CS_ECANCELED);
    /* receiver cancels; the sender goes on sending: the receiver drains the
     * chunks (every descriptor gets its receive) and answers ABORT */
    xf_make(&b, 2002, 100);
    begin(tx, rx, &b, 20000);
    xf_send(tx, &b, 20);
    usleep(50000);
    ASSERT_EQ_INT(cs_kvx_rx_cancel(rx, b.id), 0);
    ASSERT_TRUE(waiter_wait(wr, 2, 5000));
    ASSERT_EQ_INT(waiter_status(wr, b.id), CS_ECANCELED);
    while (b.sent < b.n && xf_send_try(tx, &b, 10) == 0) {
    }
    ASSERT_TRUE(waiter_wait(wt, 2, 5000));
    ASSERT_EQ_INT(waiter_status(wt, b.id), CS_ECANCELED);
    /* sender deadline: ABORT reaches the receiver */
    xf_make(&d, 2004, 10);
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, d.id, NULL, d.dst, d.n, 20000, waiter_done, wr), 0);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(rx), d.id, d.n, 200, waiter_done, wt), 0);
    xf_send(tx, &d, 3);
    ASSERT_TRUE(waiter_wait(wt, 3, 5000) && waiter_wait(wr, 3, 5000));
    ASSERT_EQ_INT(waiter_status(wt, d.id), CS_ETIMEDOUT);
    ASSERT_EQ_INT(waiter_status(wr, d.id), CS_ECANCELED);
    /* receiver deadline */
    int32_t ids[4] = {1, 2, 3, 4};
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 2005, NULL, ids, 4, 150, waiter_done, wr), 0);
    ASSERT_TRUE(waiter_wait(wr, 4, 5000));
    ASSERT_EQ_INT(waiter_status(wr, 2005), CS_ETIMEDOUT);
    /* the channel and its communicator still work, ops still matched */
    xf_make(&c, 2003, 300);
    begin(tx, rx, &c, 20000);
    while (c.sent < c.n)
        xf_send(tx, &c, 33);
    xf_finish(tx, &c);
    ASSERT_TRUE(waiter_wait(wt, 4, 10000) && waiter_wait(wr, 5, 10000));
    ASSERT_EQ_INT(waiter_status(wt, c.id), 0);
    ASSERT_EQ_INT(waiter_status(wr, c.id), 0);
    xf_check(&c);
    cs_kvx_stats st;
    cs_kvx_tx_get_stats(tx, &st);
    ASSERT_EQ_INT(st.conns_opened, 1);
    ASSERT_EQ_INT(loop_get_open_links(), 2);
    cs_kvx_tx_free(tx);
    cs_kvx_rx_free(rx);
    xf_free(&a), xf_free(&b), xf_free(&c), xf_free(&d);
    printf("abort, cancel (chunks drained), deadlines both sides; the channel kept its "
           "communicator\n");
}

/* A failure of kind `what` while 3 transfers are in flight: every transfer
 * fails once on each side, then the knob is cleared and a new transfer
 * builds a new communicator. */
static void fail_case(const char *what, int *knob_on, int32_t op_timeout, int32_t init_timeout,
                      int max_ms, const char *tx_msg) {
    waiters_reset();
    cs_kvx_rx *rx = mk_rx(16, op_timeout, init_timeout);
    cs_kvx_tx *tx = mk_tx("prefill-3", 8, op_timeout, init_timeout);
    xf xs[3];
    bool before_init = !strcmp(what, "init never completes") || !strcmp(what, "no communicator id");
    /* the transfers may fail at any point from here: ENOENT is fine */
    int64_t t0 = test_now_ms();
    if (before_init) LOOP_SET_PTR(knob_on, 1);
    for (int i = 0; i < 3; i++) {
        xf_make(&xs[i], 3000 + (uint64_t)i, 60);
        begin(tx, rx, &xs[i], 30000);
        xf_send_try(tx, &xs[i], 30);
    }
    if (!before_init) {
        usleep(100000);
        t0 = test_now_ms();
        LOOP_SET_PTR(knob_on, 1);
        for (int i = 0; i < 3; i++) {
            cs_kvx_trailer t = {
                .first_token = 1, .prompt_len = 60 * L.page_size, .total_pages = 60};
            if (xf_send_try(tx, &xs[i], 30) == 0) (void)cs_kvx_tx_finish(tx, xs[i].id, &t);
        }
    }
    /* Before the communicator is up no descriptor reached the receiver: its
     * expectations are bound to no channel and wait for their own deadline
     * (as on TCP); the test cancels them. */
    ASSERT_TRUE(waiter_wait(wt, 3, max_ms));
    if (!before_init) ASSERT_TRUE(waiter_wait(wr, 3, max_ms));
    int64_t dt = test_now_ms() - t0;
    for (int i = 0; i < 3; i++) {
        ASSERT_TRUE(waiter_status(wt, xs[i].id) < 0);
        if (!before_init) ASSERT_TRUE(waiter_status(wr, xs[i].id) < 0);
    }
    if (tx_msg) ASSERT_MSG_HAS(wt->msg[0], tx_msg);
    if (knob_on == &loop_knobs.corrupt) ASSERT_MSG_HAS(wr->msg[0], "checksum");
    LOOP_SET_PTR(knob_on, 0);
    if (before_init) {
        for (int i = 0; i < 3; i++)
            ASSERT_EQ_INT(cs_kvx_rx_cancel(rx, xs[i].id), 0);
        ASSERT_TRUE(waiter_wait(wr, 3, 5000));
    }
    usleep(100000);
    ASSERT_EQ_INT(wt->n_done, 3);
    ASSERT_EQ_INT(wr->n_done, 3);
    printf("%s: 3 transfers failed within %lld ms (sender: %s: %s)\n", what, (long long)dt,
           cs_strerror(wt->status[0]), wt->msg[0]);
    /* peer restart path: the next transfer re-creates the communicator */
    xf x;
    xf_make(&x, 3100, 50);
    begin(tx, rx, &x, 20000);
    while (x.sent < x.n)
        xf_send(tx, &x, 16);
    xf_finish(tx, &x);
    ASSERT_TRUE(waiter_wait(wt, 4, 10000) && waiter_wait(wr, 4, 10000));
    ASSERT_EQ_INT(waiter_status(wt, x.id), 0);
    ASSERT_EQ_INT(waiter_status(wr, x.id), 0);
    xf_check(&x);
    cs_kvx_stats st;
    cs_kvx_tx_get_stats(tx, &st);
    ASSERT_EQ_INT(st.conns_opened,
                  knob_on == &loop_knobs.id_fail ? 1 : 2); /* no id: the connection never opened */
    cs_kvx_tx_free(tx);
    cs_kvx_rx_free(rx);
    ASSERT_EQ_INT(loop_get_open_links(), 0);
    for (int i = 0; i < 3; i++)
        xf_free(&xs[i]);
    xf_free(&x);
}

static void test_failures(void) {
    fail_case("async communicator error", &loop_knobs.fail_comm, 5000, 5000, 3000, NULL);
    fail_case("send never completes", &loop_knobs.hang, 400, 5000, 3000, NULL);
    fail_case("corrupted chunk", &loop_knobs.corrupt, 5000, 5000, 3000, NULL);
    fail_case("init never completes", &loop_knobs.init_never, 5000, 400, 3000, NULL);
    fail_case("no communicator id", &loop_knobs.id_fail, 5000, 5000, 3000, "ncclGetUniqueId");
}

static void test_mixups(void) {
    waiters_reset();
    /* receiver takes smaller chunks than the sender sends */
    cs_kvx_rx *rx = mk_rx(4, 5000, 5000);
    cs_kvx_tx *tx = mk_tx("prefill-4", 8, 5000, 5000);
    xf x;
    xf_make(&x, 4001, 20);
    begin(tx, rx, &x, 5000);
    xf_send(tx, &x, 20);
    ASSERT_TRUE(waiter_wait(wt, 1, 5000));
    ASSERT_EQ_INT(wt->status[0], CS_ECONNREFUSED);
    ASSERT_MSG_HAS(wt->msg[0], "max_frame_bytes");
    ASSERT_EQ_INT(cs_kvx_rx_cancel(rx, x.id), 0);
    ASSERT_TRUE(waiter_wait(wr, 1, 5000));
    /* a TCP sender at an NCCL endpoint is refused with the reason, naming both */
    cs_kvx_tx_params tp = cs_kvx_tx_params_default();
    tp.layout = L;
    tp.pool = (cs_kvx_pool){CS_KVX_POOL_HOST, 0, pool_a, NPOOL};
    tp.name = "tcp-prefill";
    cs_kvx_tx *ttx;
    ASSERT_EQ_INT(cs_kvx_tx_init(&tp, &ttx), 0);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(ttx, "127.0.0.1", cs_kvx_rx_port(rx), 4002, 1, 5000, waiter_done, wt), 0);
    ASSERT_TRUE(waiter_wait(wt, 2, 5000));
    ASSERT_EQ_INT(wt->status[1], CS_ECONNREFUSED);
    ASSERT_MSG_HAS(wt->msg[1], "payload mismatch: sender tcp-prefill");
    cs_kvx_tx_free(ttx);
    /* an NCCL sender at a TCP endpoint: refused the same way */
    cs_kvx_rx_params rp = cs_kvx_rx_params_default();
    rp.layout = L;
    rp.pool = (cs_kvx_pool){CS_KVX_POOL_HOST, 0, pool_b, NPOOL};
    cs_kvx_rx *trx;
    ASSERT_EQ_INT(cs_kvx_rx_init(&rp, &trx), 0);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(trx), 4003, 1, 5000, waiter_done, wt), 0);
    ASSERT_TRUE(waiter_wait(wt, 3, 5000));
    ASSERT_EQ_INT(wt->status[2], CS_ECONNREFUSED);
    ASSERT_MSG_HAS(wt->msg[2], "payload mismatch");
    cs_kvx_stats s;
    cs_kvx_rx_get_stats(trx, &s);
    ASSERT_TRUE(s.protocol_errors >= 1);
    cs_kvx_rx_free(trx);
    /* bad arguments */
    int32_t bad = NPOOL;
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 4004, NULL, &bad, 1, 1000, waiter_done, wr), CS_EINVAL);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(rx), 4004, 1, 1000, waiter_done, wt), 0);
    /* refused for what it is, whether or not the receiver has refused 4004 already */
    ASSERT_EQ_INT(cs_kvx_tx_send_pages(tx, 4004, 0, 1, &bad, NULL, NULL), CS_EINVAL);
    int ab = cs_kvx_tx_abort(tx, 4004); /* CS_ENOENT when the receiver ended it first */
    ASSERT_TRUE(ab == 0 || ab == CS_ENOENT);
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = L;
    p.pool = (cs_kvx_pool){CS_KVX_POOL_HOST, -1, pool_b, NPOOL}; /* not the payload's pool */
    cs_kvx_rx *r2;
    ASSERT_EQ_INT(cs__kvx_rx_init_payload(&p, &loop_ops, &r2), CS_EINVAL);
    p.pool.kind = CS_KVX_POOL_CUDA;
    p.layout.page_bytes = 100;
    p.max_frame_bytes = 1000;
    ASSERT_EQ_INT(cs__kvx_rx_init_payload(&p, &loop_ops, &r2), CS_EINVAL);
    cs_kvx_tx_free(tx);
    cs_kvx_rx_free(rx);
    xf_free(&x);
    printf("mix-ups: chunk limit, TCP sender at an NCCL endpoint, NCCL sender at a TCP endpoint, "
           "bad ids: refused\n");
}

static void test_peer_death(void) {
    waiters_reset();
    /* the receiver goes away mid-transfer */
    cs_kvx_rx *rx = mk_rx(16, 5000, 5000);
    cs_kvx_tx *tx = mk_tx("prefill-5", 8, 5000, 5000);
    xf a;
    xf_make(&a, 5001, 200);
    begin(tx, rx, &a, 30000);
    xf_send(tx, &a, 100);
    usleep(100000);
    cs_kvx_rx_free(rx); /* its done callback: CS_ECANCELED */
    int64_t t0 = test_now_ms();
    ASSERT_TRUE(waiter_wait(wt, 1, 3000));
    ASSERT_TRUE(waiter_status(wt, a.id) < 0);
    ASSERT_EQ_INT(waiter_status(wr, a.id), CS_ECANCELED);
    int64_t dt1 = test_now_ms() - t0;
    /* the sender goes away mid-transfer */
    rx = mk_rx(16, 5000, 5000);
    xf b;
    xf_make(&b, 5002, 200);
    begin(tx, rx, &b, 30000);
    xf_send(tx, &b, 100);
    usleep(100000);
    cs_kvx_tx_free(tx);
    ASSERT_EQ_INT(waiter_status(wt, b.id), CS_ECANCELED);
    t0 = test_now_ms();
    ASSERT_TRUE(waiter_wait(wr, 2, 3000));
    ASSERT_TRUE(waiter_status(wr, b.id) < 0);
    int64_t dt2 = test_now_ms() - t0;
    cs_kvx_rx_free(rx);
    ASSERT_EQ_INT(loop_get_open_links(), 0);
    ASSERT_EQ_INT(wt->n_done, 2);
    ASSERT_EQ_INT(wr->n_done, 2);
    xf_free(&a), xf_free(&b);
    printf("peer death: sender noticed in %lld ms, receiver in %lld ms\n", (long long)dt1,
           (long long)dt2);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    pool_a = malloc((size_t)NPOOL * PB);
    pool_b = calloc((size_t)NPOOL, PB);
    perm = malloc(NPOOL * sizeof *perm);
    wt = malloc(sizeof *wt);
    wr = malloc(sizeof *wr);
    ASSERT_TRUE(pool_a && pool_b && perm && wt && wr);
    for (size_t i = 0; i < (size_t)NPOOL * PB; i++)
        pool_a[i] = (uint8_t)rnd();
    for (int i = 0; i < NPOOL; i++)
        perm[i] = i;
    for (int i = NPOOL - 1; i > 0; i--) {
        int j = (int)(rnd() % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    test_wire();
    test_sizes();
    test_interleaved();
    test_abort_cancel_deadline();
    test_failures();
    test_mixups();
    test_peer_death();
    ASSERT_EQ_INT(loop_get_open_links(), 0);
    ASSERT_EQ_INT(releases, accepted); /* every page handed over was released once */
    free(pool_a), free(pool_b), free(perm), free(wt), free(wr);
    printf("test_kvx_nccl_ctl: ok\n");
    return 0;
}
