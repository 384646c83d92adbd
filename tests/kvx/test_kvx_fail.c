/* test_kvx_fail: failures across real processes on loopback. A child
 * process plays the sender or the receiver and is killed with SIGKILL
 * mid-transfer; the parent must report the failure well within its deadline,
 * free everything, accept the restarted peer and refuse frames of the old
 * incarnation. Then raw misbehaving peers: bad checksum, truncated frame,
 * absurd lengths, wrong fingerprint: each closes only its own channel while
 * a good transfer on another channel completes. A frame for a transfer that
 * is not live (never expected, or ended) closes nothing: it is dropped,
 * answered with ABORT and counted, and the channel goes on. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvx_test.h"

/* The next ABORT the receiver sends on fd (HELLO_ACK and PING skipped). */
static bool read_abort(int fd, cs_kvx_hdr *h) {
    uint8_t in[CS_KVX_CTRL_MAX_BYTES];
    while (raw_read_frame(fd, h, in, sizeof in))
        if (h->type == CS_KVX_ABORT) return true;
    return false;
}

/* A port the kernel just handed out (bound to port 0, then released), so
 * both lives of the receiver can listen on the same, currently free port. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_TRUE(fd >= 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_TRUE(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    socklen_t len = sizeof a;
    ASSERT_TRUE(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    close(fd);
    return ntohs(a.sin_port);
}

static cs_kvx_layout L = {
    4, 2, 16, CS_KVX_DTYPE_F32, 16, 4 * 2 * 16 * 2 * 16 * 4, CS_KVX_WEIGHTS_FP32, 0x5eed};
#define PB 16384
#define NP 64
static uint8_t page[PB];
static uint8_t *tx_pool,
    *rx_pool;           /* NP pages each: the sender's (page i = 0x5a) and the receiver's */
static int32_t ids[NP]; /* 0..63 */

/* Pages landed in rx so far. */
static int64_t landed(cs_kvx_rx *rx) {
    cs_kvx_stats st;
    cs_kvx_rx_get_stats(rx, &st);
    return (int64_t)(st.bytes / PB);
}

/* Child: sends transfer xfer of n pages to port, slowly when slow, then
 * (if it is not killed) the trailer; exits 0 when acknowledged. */
static void child_sender(int port, uint64_t xfer, int n, bool slow, uint64_t inc) {
    cs_kvx_tx_params p = cs_kvx_tx_params_default();
    p.layout = L;
    p.pool = host_pool(tx_pool, NP);
    p.name = "prefill-0";
    p.incarnation = inc;
    p.keepalive_ms = 100;
    p.dead_ms = 1000;
    cs_kvx_tx *tx;
    if (cs_kvx_tx_init(&p, &tx)) _exit(2);
    waiter w;
    waiter_init(&w);
    if (cs_kvx_tx_begin(tx, "127.0.0.1", port, xfer, n, 30000, waiter_done, &w)) _exit(3);
    for (int i = 0; i < n; i++) {
        send_retry(tx, xfer, i, 1, &ids[i % NP], NULL, NULL);
        if (slow) usleep(20000);
    }
    cs_kvx_trailer t = {.first_token = 1, .prompt_len = n * 16, .total_pages = n};
    cs_kvx_tx_finish(tx, xfer, &t);
    if (!waiter_wait(&w, 1, 20000)) _exit(4);
    int st = w.status[0];
    cs_kvx_tx_free(tx);
    _exit(st == 0 ? 0 : 5);
}

/* Child: a receiver on port; runs until killed. */
static void child_receiver(int port) {
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = L;
    p.port = port;
    p.pool = host_pool(rx_pool, NP);
    p.keepalive_ms = 100;
    p.dead_ms = 1000;
    cs_kvx_rx *rx;
    if (cs_kvx_rx_init(&p, &rx)) _exit(2);
    waiter w;
    waiter_init(&w);
    for (uint64_t id = 1; id <= 4; id++)
        cs_kvx_rx_expect(rx, id, NULL, ids, 64, 30000, waiter_done, &w);
    waiter_wait(&w, 4, 30000);
    _exit(w.status[0] == 0 ? 0 : 5);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    memset(page, 0x5a, sizeof page);
    tx_pool = malloc((size_t)NP * PB);
    rx_pool = calloc(NP, PB);
    ASSERT_TRUE(tx_pool && rx_pool);
    memset(tx_pool, 0x5a, (size_t)NP * PB);
    for (int i = 0; i < NP; i++)
        ids[i] = i;
    cs_kvx_rx_params rp = cs_kvx_rx_params_default();
    rp.layout = L;
    rp.pool = host_pool(rx_pool, NP);
    rp.keepalive_ms = 100;
    rp.dead_ms = 1000;
    cs_kvx_rx *rx;
    ASSERT_EQ_INT(cs_kvx_rx_init(&rp, &rx), 0);
    int port = cs_kvx_rx_port(rx);
    waiter w;
    waiter_init(&w);
    int nd = 0;

    /* 1. Sender killed mid-transfer: the receiver fails the transfer at once
     * (EOF), long before its 20 s deadline. */
    uint64_t inc1 = 1000, inc2 = 2000;
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 1, NULL, ids, 64, 20000, waiter_done, &w), 0);
    pid_t pid = fork();
    if (pid == 0) child_sender(port, 1, 64, true, inc1);
    while (landed(rx) < 5)
        usleep(1000);
    int64_t t0 = test_now_ms();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 1), CS_ECONNRESET);
    fprintf(stderr, "sender killed: receiver failed the transfer after %lld ms\n",
            (long long)(test_now_ms() - t0));
    ASSERT_TRUE(test_now_ms() - t0 < 2000);

    /* 2. The restarted sender (new incarnation) connects and completes. */
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 2, NULL, ids, 64, 20000, waiter_done, &w), 0);
    pid = fork();
    if (pid == 0) child_sender(port, 2, 64, false, inc2);
    int cst;
    waitpid(pid, &cst, 0);
    ASSERT_TRUE(WIFEXITED(cst));
    ASSERT_EQ_INT(WEXITSTATUS(cst), 0);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 2), 0);

    /* 3. The old incarnation is fenced: its HELLO is refused, and frames
     * stamped with it on a current channel close that channel. */
    int fd = raw_connect(port);
    raw_hello(fd, &L, "prefill-0", inc1);
    ASSERT_TRUE(raw_closed_by_peer(fd));
    close(fd);
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 3, NULL, ids, 4, 20000, waiter_done, &w), 0);
    fd = raw_connect(port);
    raw_hello(fd, &L, "prefill-0", inc2 + 1);
    uint64_t fp = cs_kvx_layout_fingerprint(&L);
    raw_frame(fd, CS_KVX_PAGES, inc2 + 1, 3, 0, 1, fp, page, PB, true); /* current: accepted */
    raw_frame(fd, CS_KVX_PAGES, inc1, 3, 1, 1, fp, page, PB, true);     /* old: refused */
    ASSERT_TRUE(raw_closed_by_peer(fd));
    close(fd);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 3), CS_EPROTO);
    fprintf(stderr, "old incarnation fenced: ok\n");

    /* 4. Malformed input from raw peers; each case closes its channel and
     * fails only the transfer bound to it. */
    struct {
        const char *what;
        int expect_status; /* of transfer 10+i, bound by a first good frame */
    } cases[] = {{"bad payload checksum", CS_EBADMSG}, {"truncated frame", CS_ECONNRESET},
                 {"absurd page count", CS_EBADMSG},    {"wrong fingerprint", CS_EPROTO},
                 {"garbage header", CS_EBADMSG},       {"pages out of order", CS_EPROTO},
                 {"no checksum", CS_EBADMSG}};
    int nc = (int)(sizeof cases / sizeof *cases);
    for (int i = 0; i < nc; i++) {
        uint64_t id = 10 + (uint64_t)i;
        ASSERT_EQ_INT(cs_kvx_rx_expect(rx, id, NULL, ids, 8, 20000, waiter_done, &w), 0);
        char name[32];
        snprintf(name, sizeof name, "raw-%d", i);
        fd = raw_connect(port);
        raw_hello(fd, &L, name, 1);
        raw_frame(fd, CS_KVX_PAGES, 1, id, 0, 1, fp, page, PB, true);
        switch (i) {
        case 0: {
            cs_kvx_hdr h = {0};
            h.type = CS_KVX_PAGES, h.epoch = 1, h.xfer_id = id, h.first_page = 1, h.n_pages = 1,
            h.fingerprint = fp;
            h.payload_len = PB, h.flags = CS_KVX_FLAG_CHECKSUM, h.payload_xxh64 = 12345;
            uint8_t hb[CS_KVX_HDR_BYTES];
            cs_kvx_hdr_encode(&h, hb);
            raw_write(fd, hb, sizeof hb);
            raw_write(fd, page, PB);
            break;
        }
        case 1: {
            uint8_t hb[CS_KVX_HDR_BYTES];
            cs_kvx_hdr h = {0};
            h.type = CS_KVX_PAGES, h.epoch = 1, h.xfer_id = id, h.first_page = 1, h.n_pages = 1,
            h.fingerprint = fp;
            h.payload_len = PB;
            cs_kvx_hdr_encode(&h, hb);
            raw_write(fd, hb, sizeof hb);
            raw_write(fd, page, 100);
            shutdown(fd, SHUT_WR);
            break;
        }
        case 2: raw_frame(fd, CS_KVX_PAGES, 1, id, 1, 0x7fffffff, fp, NULL, 0, false); break;
        case 3: raw_frame(fd, CS_KVX_PAGES, 1, id, 1, 1, fp ^ 1, page, PB, true); break;
        case 4: {
            uint8_t junk[CS_KVX_HDR_BYTES];
            memset(junk, 0xee, sizeof junk);
            raw_write(fd, junk, sizeof junk);
            break;
        }
        case 5: raw_frame(fd, CS_KVX_PAGES, 1, id, 5, 1, fp, page, PB, true); break;
        case 6: raw_frame(fd, CS_KVX_PAGES, 1, id, 1, 1, fp, page, PB, false); break;
        }
        ASSERT_TRUE(raw_closed_by_peer(fd));
        close(fd);
        ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
        if (waiter_status(&w, id) != cases[i].expect_status) {
            fprintf(stderr, "%s: status %d, expected %d\n", cases[i].what, waiter_status(&w, id),
                    cases[i].expect_status);
            exit(1);
        }
        fprintf(stderr, "%s: rejected, channel closed\n", cases[i].what);
    }
    /* 5. Frames for transfers that are not live: one never expected, one
     * that ended here (cancelled) while its sender still sends. Each is
     * answered with ABORT for its id and dropped; the channel stays open and
     * its live transfer goes on. */
    {
        cs_kvx_stats s0, s1;
        cs_kvx_rx_get_stats(rx, &s0);
        ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 40, NULL, ids, 8, 20000, waiter_done, &w), 0);
        ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 41, NULL, ids + 8, 8, 20000, waiter_done, &w), 0);
        fd = raw_connect(port);
        raw_hello(fd, &L, "raw-stale", 7);
        raw_frame(fd, CS_KVX_PAGES, 7, 40, 0, 1, fp, page, PB, true); /* binds 40 */
        raw_frame(fd, CS_KVX_PAGES, 7, 41, 0, 1, fp, page, PB, true); /* binds 41 */
        /* both pages landed before the cancel (else 41's is a third stale frame) */
        for (int64_t t_end = test_now_ms() + 5000;;) {
            cs_kvx_rx_get_stats(rx, &s1);
            if (s1.bytes - s0.bytes >= 2 * (uint64_t)PB) break;
            ASSERT_TRUE(test_now_ms() < t_end);
            usleep(1000);
        }
        ASSERT_EQ_INT(cs_kvx_rx_cancel(rx, 41), 0);
        ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
        ASSERT_EQ_INT(waiter_status(&w, 41), CS_ECANCELED);
        cs_kvx_hdr h;
        ASSERT_TRUE(read_abort(fd, &h)); /* the cancel's */
        ASSERT_TRUE(h.xfer_id == 41);
        raw_frame(fd, CS_KVX_PAGES, 7, 999999, 0, 1, fp, page, PB, true); /* never expected */
        raw_frame(fd, CS_KVX_PAGES, 7, 41, 1, 1, fp, page, PB, true);     /* ended here */
        for (int k = 0; k < 2; k++) {
            ASSERT_TRUE(read_abort(fd, &h));
            ASSERT_TRUE(h.xfer_id == (k ? 41u : 999999u));
        }
        /* the channel still carries transfer 40 */
        raw_frame(fd, CS_KVX_PAGES, 7, 40, 1, 1, fp, page, PB, true);
        cs_kvx_rx_get_stats(rx, &s1);
        ASSERT_EQ_INT(s1.stale_frames - s0.stale_frames, 2);
        ASSERT_EQ_INT(s1.protocol_errors, s0.protocol_errors);
        ASSERT_EQ_INT(cs_kvx_rx_cancel(rx, 40), 0); /* still live: nothing failed it */
        ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
        ASSERT_EQ_INT(waiter_status(&w, 40), CS_ECANCELED);
        close(fd);
        fprintf(stderr, "stale frames: dropped, answered, channel kept\n");
    }
    /* ... and a good sender is unaffected by all of it. */
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, 50, NULL, ids, 64, 20000, waiter_done, &w), 0);
    pid = fork();
    if (pid == 0) child_sender(port, 50, 64, false, inc2 + 5);
    waitpid(pid, &cst, 0);
    ASSERT_EQ_INT(WEXITSTATUS(cst), 0);
    ASSERT_TRUE(waiter_wait(&w, ++nd, 5000));
    ASSERT_EQ_INT(waiter_status(&w, 50), 0);
    cs_kvx_stats st;
    cs_kvx_rx_get_stats(rx, &st);
    ASSERT_EQ_INT(st.transfers_active, 0);
    cs_kvx_rx_free(rx);

    /* 5. Receiver killed mid-transfer: the sender fails it at once; after the
     * receiver restarts on the same port the same channel reopens. */
    int rport = free_port();
    pid = fork();
    if (pid == 0) child_receiver(rport);
    cs_kvx_tx_params tp = cs_kvx_tx_params_default();
    tp.layout = L;
    tp.pool = host_pool(tx_pool, NP);
    tp.name = "prefill-parent";
    tp.keepalive_ms = 100;
    tp.dead_ms = 1000;
    cs_kvx_tx *tx;
    ASSERT_EQ_INT(cs_kvx_tx_init(&tp, &tx), 0);
    waiter tw;
    waiter_init(&tw);
    usleep(200000); /* the child listens */
    ASSERT_EQ_INT(cs_kvx_tx_begin(tx, "127.0.0.1", rport, 1, 64, 20000, waiter_done, &tw), 0);
    for (int i = 0; i < 10; i++)
        ASSERT_EQ_INT(cs_kvx_tx_send_pages(tx, 1, i, 1, &ids[i], NULL, NULL), 0);
    usleep(100000);
    t0 = test_now_ms();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ASSERT_TRUE(waiter_wait(&tw, 1, 5000));
    ASSERT_EQ_INT(waiter_status(&tw, 1), CS_ECONNRESET);
    fprintf(stderr, "receiver killed: sender failed the transfer after %lld ms\n",
            (long long)(test_now_ms() - t0));
    ASSERT_TRUE(test_now_ms() - t0 < 2000);
    pid = fork();
    if (pid == 0) child_receiver(rport);
    usleep(200000);
    ASSERT_EQ_INT(cs_kvx_tx_begin(tx, "127.0.0.1", rport, 2, 64, 20000, waiter_done, &tw), 0);
    ASSERT_EQ_INT(cs_kvx_tx_send_pages(tx, 2, 0, 64, NULL, NULL, NULL), CS_EINVAL);
    int32_t bad = NP;
    ASSERT_EQ_INT(cs_kvx_tx_send_pages(tx, 2, 0, 1, &bad, NULL, NULL),
                  CS_EINVAL); /* outside the pool */
    memset(tx_pool, 0x11, (size_t)NP * PB);
    ASSERT_EQ_INT(cs_kvx_tx_send_pages(tx, 2, 0, 64, ids, NULL, NULL), 0);
    cs_kvx_trailer t = {.first_token = 1, .prompt_len = 64 * 16, .total_pages = 64};
    ASSERT_EQ_INT(cs_kvx_tx_finish(tx, 2, &t), 0);
    ASSERT_TRUE(waiter_wait(&tw, 2, 5000));
    ASSERT_EQ_INT(waiter_status(&tw, 2), 0);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cs_kvx_tx_free(tx);
    free(tx_pool), free(rx_pool);
    fprintf(stderr, "ok\n");
    return 0;
}
