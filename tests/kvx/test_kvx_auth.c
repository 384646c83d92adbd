/* test_kvx_auth: the KV link's trust boundary (kvx_wire.h version 5). A
 * receiver with a cluster secret takes pages only from senders that prove
 * it: a sender with another secret is refused, a forged HELLO (a real
 * sender's name, epoch UINT64_MAX, an empty key) neither opens a channel nor
 * fences the real sender, frames before the handshake close their
 * connection before any page is written, and a trailer whose MAC is not the
 * session's fails its transfer; a transfer expected from one sender takes no
 * page from another. Throughout, a legitimate transfer completes
 * with the right bytes. A rotation (8): a sender accepts a receiver that
 * proves either of its keys; a receiver's rotated secret applies to the
 * next handshake and leaves open channels alone. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvx_test.h"

#define NP 16
static cs_kvx_layout L = {
    2, 2, 16, CS_KVX_DTYPE_F32, 16, 2 * 2 * 16 * 2 * 16 * 4, CS_KVX_WEIGHTS_FP32, 0x5eed};
#define PB (2 * 2 * 16 * 2 * 16 * 4)
static const char SECRET[] = "kv-link-secret-0123456789abcdef";
static const char OTHER[] = "another-secret-0123456789abcdef";
static uint8_t *tx_pool, *rx_pool;
static int32_t ids[NP];

/* The keys of a --cluster-secret-file holding a, then b (NULL: a alone). */
static cs_secret keys(const char *a, const char *b) {
    char path[] = "/tmp/test_kvx_auth_XXXXXX";
    int fd = mkstemp(path);
    ASSERT_TRUE(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "%s\n", a);
    if (b) fprintf(f, "%s\n", b);
    fclose(f);
    cs_secret s;
    ASSERT_EQ_INT(cs_secret_load(NULL, path, &s), 0);
    unlink(path);
    ASSERT_EQ_INT(s.n, b ? 2 : 1);
    return s;
}

static cs_kvx_tx *sender_keys(const char *name, const cs_secret *s) {
    cs_kvx_tx_params p = cs_kvx_tx_params_default();
    p.layout = L;
    p.pool = host_pool(tx_pool, NP);
    p.name = name;
    p.secret = s;
    cs_kvx_tx *tx;
    ASSERT_EQ_INT(cs_kvx_tx_init(&p, &tx), 0);
    return tx;
}

static cs_kvx_tx *sender(const char *name, const char *secret) {
    cs_secret s = keys(secret, NULL);
    cs_kvx_tx *tx = sender_keys(name, &s);
    cs_secret_clear(&s);
    return tx;
}

/* Transfer id of n pages from tx to port; the sender's status. */
static int transfer(cs_kvx_tx *tx, int port, uint64_t id, int n) {
    waiter w;
    waiter_init(&w);
    ASSERT_EQ_INT(cs_kvx_tx_begin(tx, "127.0.0.1", port, id, n, 10000, waiter_done, &w), 0);
    /* a refused handshake may end the transfer before its pages are queued */
    int r = send_retry(tx, id, 0, n, ids, NULL, NULL);
    ASSERT_TRUE(r == 0 || r == CS_ENOENT);
    cs_kvx_trailer t = {.first_token = 3, .prompt_len = n * 16, .total_pages = n};
    if (r == 0) {
        r = cs_kvx_tx_finish(tx, id, &t);
        ASSERT_TRUE(r == 0 || r == CS_ENOENT);
    }
    ASSERT_TRUE(waiter_wait(&w, 1, 15000));
    if (w.status[0]) fprintf(stderr, "transfer %llu: %s\n", (unsigned long long)id, w.msg[0]);
    return w.status[0];
}

static bool pages_are(const uint8_t *pool, int n, uint8_t v) {
    for (size_t i = 0; i < (size_t)n * PB; i++)
        if (pool[i] != v) return false;
    return true;
}

static uint64_t closed_conns(cs_kvx_rx *rx) {
    cs_kvx_stats st;
    cs_kvx_rx_get_stats(rx, &st);
    return st.conns_closed;
}

static uint64_t tx_stat(cs_kvx_tx *tx, bool opened) {
    cs_kvx_stats st;
    cs_kvx_tx_get_stats(tx, &st);
    return opened ? st.conns_opened : st.conns_closed;
}

/* Polls cond for up to 5 s. */
#define EVENTUALLY(cond)                                                                           \
    do {                                                                                           \
        int64_t t_end_ = test_now_ms() + 5000;                                                     \
        while (!(cond) && test_now_ms() < t_end_)                                                  \
            usleep(10000);                                                                         \
        ASSERT_TRUE(cond);                                                                         \
    } while (0)

static cs_kvx_rx *rotating_rx;
static const cs_secret *rotate_to;
static void rotate_now(void *arg) {
    (void)arg;
    cs_kvx_rx_set_secret(rotating_rx, rotate_to);
}

/* 8. A rotation from SECRET to OTHER in three steps (secret.h). */
static void rotation(void) {
    cs_secret old_new = keys(SECRET, OTHER), new_old = keys(OTHER, SECRET),
              old = keys(SECRET, NULL), new = keys(OTHER, NULL);
    cs_kvx_rx_params rp = cs_kvx_rx_params_default();
    rp.layout = L;
    rp.pool = host_pool(rx_pool, NP);
    rp.secret = &old;
    cs_kvx_rx *rx;
    ASSERT_EQ_INT(cs_kvx_rx_init(&rp, &rx), 0);
    int port = cs_kvx_rx_port(rx);
    waiter w;
    waiter_init(&w);
    int nd = 0;
    uint64_t id = 100;
#define DELIVERS(tx, want)                                                                         \
    do {                                                                                           \
        memset(rx_pool, 0, (size_t)NP *PB);                                                        \
        ASSERT_EQ_INT(cs_kvx_rx_expect(rx, ++id, NULL, ids, 2, 20000, waiter_done, &w), 0);        \
        ASSERT_EQ_INT(transfer(tx, port, id, 2), (want));                                          \
        if ((want) == 0) {                                                                         \
            ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));                                              \
            ASSERT_EQ_INT(waiter_status(&w, id), 0);                                               \
            ASSERT_TRUE(pages_are(rx_pool, 2, 0x5a));                                              \
        } else {                                                                                   \
            ASSERT_EQ_INT(cs_kvx_rx_cancel(rx, id), 0);                                            \
            ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));                                              \
        }                                                                                          \
    } while (0)
    /* a sender still on the old secret alone, one in step 1 ("old\nnew") */
    cs_kvx_tx *a = sender_keys("prefill-a", &old), *b = sender_keys("prefill-b", &old_new);
    DELIVERS(a, 0);
    DELIVERS(b, 0);
    /* the receiver at step 1, rotated to step 2 between its CHALLENGE
     * (proved with old) and the sender's AUTH (proved with old too): the
     * channel opens under the key CHALLENGE used, and delivers */
    cs_kvx_rx_set_secret(rx, &old_new);
    rotating_rx = rx, rotate_to = &new_old;
    raw_before_auth = rotate_now;
    memset(rx_pool, 0, (size_t)NP * PB);
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, ++id, NULL, ids, 1, 20000, waiter_done, &w), 0);
    int fd = raw_connect(port);
    uint8_t session[32], tb[CS_KVX_TRAILER_BYTES];
    uint64_t fp = cs_kvx_layout_fingerprint(&L);
    ASSERT_TRUE(raw_hello_key(fd, &L, "raw-rotating", 90, SECRET, strlen(SECRET), session));
    raw_before_auth = NULL;
    raw_frame(fd, CS_KVX_PAGES, 90, id, 0, 1, fp, tx_pool, PB, true);
    cs_kvx_trailer_wire tw;
    memset(&tw, 0, sizeof tw);
    tw.t.total_pages = 1;
    tw.t.prompt_len = 16;
    cs__kvx_fold(&tw.xxh64, cs_kvx_payload_sum(tx_pool, PB));
    cs_kvx_trailer_encode(&tw, tb);
    cs__kvx_trailer_mac(session, id, tb, tb + CS_KVX_TRAILER_MAC_AT);
    raw_frame(fd, CS_KVX_TRAILER, 90, id, 0, 0, fp, tb, sizeof tb, true);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, id), 0);
    ASSERT_TRUE(pages_are(rx_pool, 1, 0x5a));
    close(fd);
    /* the receiver at step 2 (proves new, accepts both): a's open channel
     * keeps its session (old is still accepted); b2 takes the receiver's
     * proof by its second key */
    DELIVERS(a, 0);
    cs_kvx_tx *b2 = sender_keys("prefill-b2", &old_new);
    DELIVERS(b2, 0);
    /* a new channel of a sender that skipped step 1 is refused: it does not
     * accept the receiver's proof (that is why step 1 must reach everyone) */
    cs_kvx_tx *a2 = sender_keys("prefill-a2", &old);
    DELIVERS(a2, CS_ECONNREFUSED);
    /* b reaches step 3 first: its channel's session (old) is rotated out,
     * so the channel closes once idle and the next transfer opens another
     * one, under new */
    cs_kvx_tx_set_secret(b, &new);
    EVENTUALLY(tx_stat(b, false) == 1);
    DELIVERS(b, 0);
    ASSERT_EQ_INT(tx_stat(b, true), 2);
    /* the receiver reaches step 3: a's channel (session under old) is closed
     * once idle; b's and b2's (under new) stay */
    uint64_t closed = closed_conns(rx);
    cs_kvx_rx_set_secret(rx, &new);
    EVENTUALLY(closed_conns(rx) >= closed + 1);
    EVENTUALLY(tx_stat(a, false) == 1);
    DELIVERS(a, CS_ECONNREFUSED); /* reconnects, still on old alone */
    DELIVERS(b2, 0);
    ASSERT_EQ_INT(tx_stat(b2, true), 1);
    cs_kvx_tx_set_secret(a2, &new);
    DELIVERS(a2, 0);
    cs_kvx_tx *c = sender_keys("prefill-c", &old);
    DELIVERS(c, CS_ECONNREFUSED);
#undef DELIVERS
    cs_kvx_tx_free(a), cs_kvx_tx_free(b), cs_kvx_tx_free(b2), cs_kvx_tx_free(a2), cs_kvx_tx_free(c);
    cs_kvx_rx_free(rx);
    cs_secret_clear(&old_new), cs_secret_clear(&new_old), cs_secret_clear(&old),
        cs_secret_clear(&new);
    fprintf(stderr, "rotation: either key accepted, the rotated one used from the next "
                    "handshake, channels under a retired key closed once idle\n");
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    tx_pool = malloc((size_t)NP * PB);
    rx_pool = calloc(NP, PB);
    ASSERT_TRUE(tx_pool && rx_pool);
    memset(tx_pool, 0x5a, (size_t)NP * PB);
    for (int i = 0; i < NP; i++)
        ids[i] = i;
    cs_kvx_rx_params rp = cs_kvx_rx_params_default();
    rp.layout = L;
    rp.pool = host_pool(rx_pool, NP);
    cs_secret rs = keys(SECRET, NULL);
    rp.secret = &rs;
    cs_kvx_rx *rx;
    ASSERT_EQ_INT(cs_kvx_rx_init(&rp, &rx), 0);
    int port = cs_kvx_rx_port(rx);
    uint64_t fp = cs_kvx_layout_fingerprint(&L);
    waiter w;
    waiter_init(&w);
    int nd = 0;

    /* 1. A sender of another cluster: refused at the handshake (it finds
     * the receiver's proof wrong); the reservation is untouched. */
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 1, NULL, ids, 4, 20000, waiter_done, &w), 0);
    cs_kvx_tx *bad = sender("prefill-x", OTHER);
    ASSERT_EQ_INT(transfer(bad, port, 1, 4), CS_ECONNREFUSED);
    cs_kvx_tx_free(bad);
    ASSERT_TRUE(pages_are(rx_pool, 4, 0));

    /* 2. Frames before the handshake and a forged HELLO: PAGES for the
     * live reservation, HELLO naming the real sender with epoch UINT64_MAX
     * answered with an AUTH under the empty key. Each connection closes;
     * no page is written. */
    int fd = raw_connect(port);
    raw_frame(fd, CS_KVX_PAGES, 1, 1, 0, 1, fp, tx_pool, PB, true);
    ASSERT_TRUE(raw_closed_by_peer(fd));
    close(fd);
    fd = raw_connect(port);
    ASSERT_TRUE(raw_hello_key(fd, &L, "prefill-0", UINT64_MAX, NULL, 0, NULL));
    raw_frame(fd, CS_KVX_PAGES, UINT64_MAX, 1, 0, 1, fp, tx_pool, PB, true);
    ASSERT_TRUE(raw_closed_by_peer(fd));
    close(fd);
    ASSERT_TRUE(pages_are(rx_pool, 4, 0));
    cs_kvx_stats st;
    cs_kvx_rx_get_stats(rx, &st);
    ASSERT_TRUE(st.protocol_errors >= 2);
    ASSERT_EQ_INT(st.transfers_completed, 0);
    fprintf(stderr, "foreign sender, pre-HELLO pages, forged HELLO: refused\n");

    /* 3. The real sender (whose name the forger used) is not fenced: its
     * transfer into the same reservation completes with its bytes. */
    cs_kvx_tx *good = sender("prefill-0", SECRET);
    ASSERT_EQ_INT(transfer(good, port, 1, 4), 0);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 1), 0);
    ASSERT_TRUE(pages_are(rx_pool, 4, 0x5a));

    /* 4. A trailer whose MAC is not the session's (a peer that holds the
     * secret but splices a trailer): the transfer fails, nothing else. */
    memset(rx_pool, 0, (size_t)NP * PB);
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 2, NULL, ids, 1, 20000, waiter_done, &w), 0);
    fd = raw_connect(port);
    uint8_t session[32];
    ASSERT_TRUE(raw_hello_key(fd, &L, "raw-insider", 77, SECRET, strlen(SECRET), session));
    raw_frame(fd, CS_KVX_PAGES, 77, 2, 0, 1, fp, tx_pool, PB, true);
    cs_kvx_trailer_wire tw;
    memset(&tw, 0, sizeof tw);
    tw.t.total_pages = 1;
    tw.t.prompt_len = 16;
    tw.xxh64 = 0;
    cs__kvx_fold(&tw.xxh64, cs_kvx_payload_sum(tx_pool, PB));
    uint8_t tb[CS_KVX_TRAILER_BYTES];
    cs_kvx_trailer_encode(&tw, tb); /* MAC all zero */
    raw_frame(fd, CS_KVX_TRAILER, 77, 2, 0, 0, fp, tb, sizeof tb, true);
    ASSERT_TRUE(raw_closed_by_peer(fd));
    close(fd);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 2), CS_EBADMSG);
    ASSERT_MSG_HAS(w.msg[nd - 1], "MAC");
    /* the same with the session's MAC completes */
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 3, NULL, ids, 1, 20000, waiter_done, &w), 0);
    fd = raw_connect(port);
    ASSERT_TRUE(raw_hello_key(fd, &L, "raw-insider", 78, SECRET, strlen(SECRET), session));
    raw_frame(fd, CS_KVX_PAGES, 78, 3, 0, 1, fp, tx_pool, PB, true);
    cs__kvx_trailer_mac(session, 3, tb, tb + CS_KVX_TRAILER_MAC_AT);
    raw_frame(fd, CS_KVX_TRAILER, 78, 3, 0, 0, fp, tb, sizeof tb, true);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 3), 0);
    close(fd);
    fprintf(stderr, "trailer MAC: a wrong one fails the transfer, the session's completes\n");

    /* 5. A transfer expected from prefill-0: another authenticated sender's
     * pages for it close that sender's channel and leave it waiting. */
    memset(rx_pool, 0, (size_t)NP * PB);
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 4, "prefill-0", ids, 8, 20000, waiter_done, &w), 0);
    fd = raw_connect(port);
    ASSERT_TRUE(raw_hello_key(fd, &L, "raw-insider", 79, SECRET, strlen(SECRET), NULL));
    raw_frame(fd, CS_KVX_PAGES, 79, 4, 0, 1, fp, rx_pool + PB, PB, true);
    ASSERT_TRUE(raw_closed_by_peer(fd));
    close(fd);
    ASSERT_EQ_INT(waiter_status(&w, 4), 1); /* still pending */
    ASSERT_TRUE(pages_are(rx_pool, 8, 0));
    fprintf(stderr, "a transfer's pages from another sender than the expected one: refused\n");

    /* 6. The real channel survived all of it and delivers the transfer. */
    ASSERT_EQ_INT(transfer(good, port, 4, 8), 0);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 4), 0);
    cs_kvx_stats ts;
    cs_kvx_tx_get_stats(good, &ts);
    ASSERT_EQ_INT(ts.conns_opened, 1);
    cs_kvx_tx_free(good);
    cs_kvx_rx_free(rx);

    /* 7. The transcript binds the payload HELLO names: a HELLO whose payload
     * byte was changed on the way gives other proofs and another session. */
    kvx_key key = {.len = strlen(SECRET)};
    memcpy(key.key, SECRET, key.len);
    kvx_transcript t0;
    memset(&t0, 0, sizeof t0);
    t0.tx_inc = 1, t0.rx_inc = 2, t0.fingerprint = fp;
    strcpy(t0.name, "prefill-0");
    kvx_transcript t1 = t0;
    t1.payload = CS_KVX_PAYLOAD_NCCL;
    for (int what = KVX_PROOF_RX; what <= KVX_SESSION; what++) {
        uint8_t a[32], b[32];
        cs__kvx_derive(&key, what, &t0, a);
        cs__kvx_derive(&key, what, &t1, b);
        ASSERT_TRUE(memcmp(a, b, sizeof a) != 0);
    }
    rotation();
    free(tx_pool);
    free(rx_pool);
    fprintf(stderr, "test_kvx_auth: ok\n");
    return 0;
}
