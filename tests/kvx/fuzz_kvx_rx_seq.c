/* fuzz_kvx_rx_seq: fuzz driver for the KV receiver's whole state machine
 * (kvx/src/kvx_rx*.c with kvx_io.c, kvx_wire.c, the TCP payload): a SEQUENCE
 * of frames from one sender on one channel, not one frame. One receiver
 * (TCP payload, a host pool of 16 pages of 64 bytes, a cluster secret)
 * lives for the whole process; each input is one loopback connection to it,
 * with two transfers expected: id 1 into pages {3, 1, 7, 5} and id 2 into
 * {10, 12}.
 *
 * Input: byte 0 is the mode, the rest goes on the wire.
 *   bit 0  handshake: the driver first plays HELLO, reads the CHALLENGE
 *          and answers AUTH with the secret (a fresh incarnation each
 *          input, so a new channel fences the previous one), as a real
 *          sender would; without it the bytes start before HELLO;
 *   bit 1  seal: the rest is read as frames, and each one's epoch (the
 *          channel's incarnation), layout fingerprint, payload checksum
 *          (when flagged), and a TRAILER's chunk digest and session MAC are
 *          set as the real sender sets them (and the header's own
 *          checksum), so mutations reach the states past those checks;
 *          bytes from the first header that does not decode on go out as
 *          they are;
 *   bit 2  the transfers are expected from the sender "prefill-fuzz" only
 *          (else from any authenticated sender);
 *   bit 3  transfer 2's deadline is 1 ms (its late frames take the
 *          ended-transfer path); else both have 10 s.
 * The driver then half-closes, reads until the receiver closes (abort after
 * 10 s: a receiver that keeps a finished sender's channel), cancels what is
 * still pending and waits for both done callbacks (abort after 10 s).
 * Properties besides the sanitizers and the receiver's own CS_ASSERTs:
 *  - each expected transfer reports exactly once (also no late second call,
 *    checked at the next input);
 *  - no byte lands outside the reserved pages (the others hold a canary);
 *  - a transfer that succeeds was sealed by the driver and its pages hold
 *    exactly the bytes of the PAGES frames sent for it (first frame per
 *    page: later ones must have been refused or dropped), and the trailer
 *    it reports is the first one sent for it.
 * Inputs run one at a time, so executions/s are bounded by loopback round
 * trips (docs/security.md, Fuzzing, has the figures).
 * Usage (fallback): fuzz_kvx_rx_seq CORPUS_DIR [ITERATIONS]
 *                   fuzz_kvx_rx_seq --write-corpus DIR */
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "chunkserve/log.h"
#include "kvx_test.h"

#define NP 16
#define PB 64
static const cs_kvx_layout L = {.n_layers = 2,
                                .n_kv_heads = 2,
                                .head_dim = 16,
                                .dtype = CS_KVX_DTYPE_F32,
                                .page_size = 16,
                                .page_bytes = PB,
                                .weights = CS_KVX_WEIGHTS_FP32};
static const char SECRET[] = "fuzz-cluster-secret-0123456789";
static const char NAME[] = "prefill-fuzz";
#define CANARY 0xa5
#define FUZZ_OUT (1u << 17) /* the sealed frames of one input (inputs are <= 64 KiB) */

static const int32_t ids1[4] = {3, 1, 7, 5}, ids2[2] = {10, 12};
static cs_kvx_rx *rx;
static uint8_t *pool;
static uint64_t inc = 0x1000;

/* The done callbacks of one input (they run on the receiver's I/O thread). */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static struct {
    int calls, status;
    cs_kvx_trailer t;
} done[3];

static void on_done(void *arg, uint64_t id, int status, const char *msg, const cs_kvx_trailer *t) {
    (void)arg, (void)msg;
    if (id < 1 || id > 2) abort();
    pthread_mutex_lock(&mu);
    if (++done[id].calls > 1) {
        fprintf(stderr, "fuzz_kvx_rx_seq: transfer %llu reported twice\n", (unsigned long long)id);
        abort();
    }
    done[id].status = status;
    if (getenv("CS_FUZZ_VERBOSE")) /* how far a seed gets */
        fprintf(stderr, "[transfer %llu: %d %s]\n", (unsigned long long)id, status, msg ? msg : "");
    if (t) done[id].t = *t;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void setup(void) {
    signal(SIGPIPE, SIG_IGN);
    cs_log_set_level(CS_LOG_ERROR); /* a line per refused channel otherwise */
    pool = malloc((size_t)NP * PB);
    if (!pool) abort();
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = L;
    p.pool = host_pool(pool, NP);
    static cs_secret s;
    if (cs_secret_load(SECRET, NULL, &s)) abort();
    p.secret = &s;
    p.hello_timeout_ms = 2000;
    if (cs_kvx_rx_init(&p, &rx)) {
        fprintf(stderr, "fuzz_kvx_rx_seq: cannot start the receiver: %s\n", cs_last_error());
        exit(2);
    }
}

/* What the driver sent for a transfer (seal mode): the first bytes per page. */
typedef struct {
    uint64_t digest;
    bool sealed_trailer;
    cs_kvx_trailer t;
    bool have[4];
    uint8_t page[4][PB];
} shadow;

static int xfer_index(uint64_t id) {
    return id == 1 || id == 2 ? (int)id : 0;
}

/* Seals one frame (header h as decoded, payload pl of len bytes, len <=
 * payload_len when the input ends early) and records it in sh. */
static void seal(cs_kvx_hdr *h, uint8_t *pl, size_t len, const uint8_t session[32], shadow *sh) {
    h->epoch = inc;
    h->fingerprint = cs_kvx_layout_fingerprint(&L);
    int x = xfer_index(h->xfer_id);
    bool whole = len == h->payload_len;
    if (h->type == CS_KVX_PAGES && whole && x) {
        uint64_t sum = cs_kvx_payload_sum(pl, len);
        cs__kvx_fold(&sh[x].digest, sum);
        for (uint64_t i = 0; i < h->n_pages && h->first_page + i < 4; i++)
            if (!sh[x].have[h->first_page + i]) {
                sh[x].have[h->first_page + i] = true;
                memcpy(sh[x].page[h->first_page + i], pl + i * PB, PB);
            }
    }
    if (h->type == CS_KVX_TRAILER && whole && len == CS_KVX_TRAILER_BYTES && x) {
        cs_kvx_trailer_wire tw;
        char err[256];
        if (cs_kvx_trailer_decode(pl, len, &tw, err, sizeof err) == 0) {
            tw.xxh64 = sh[x].digest;
            cs_kvx_trailer_encode(&tw, pl);
            cs__kvx_trailer_mac(session, h->xfer_id, pl, pl + CS_KVX_TRAILER_MAC_AT);
            if (!sh[x].sealed_trailer) sh[x].t = tw.t; /* the first one completes it */
            sh[x].sealed_trailer = true;
        }
    }
    if (h->flags & CS_KVX_FLAG_CHECKSUM) h->payload_xxh64 = whole ? cs_kvx_payload_sum(pl, len) : 0;
}

/* Writes the frames of data (sealing each), then whatever is left raw, in
 * one write (frames never wait on each other's segments). */
static void send_sealed(int fd, const uint8_t *data, size_t n, const uint8_t session[32],
                        shadow *sh) {
    cs_kvx_limits lim = {PB, 1u << 20, true}; /* inline (TCP) */
    static uint8_t pl[1u << 16], out[FUZZ_OUT];
    size_t o = 0;
    while (n >= CS_KVX_HDR_BYTES) {
        /* the header's own checksum first, so mutated fields survive to the checks */
        uint8_t in[CS_KVX_HDR_BYTES];
        memcpy(in, data, sizeof in);
        memset(in + 12, 0, 4);
        uint32_t hs = XXH32(in, sizeof in, 0);
        for (int i = 0; i < 4; i++)
            in[12 + i] = (uint8_t)(hs >> (8 * i));
        cs_kvx_hdr h;
        if (cs_kvx_hdr_decode(in, &lim, &h, NULL, 0)) break;
        size_t len =
            h.payload_len < n - CS_KVX_HDR_BYTES ? (size_t)h.payload_len : n - CS_KVX_HDR_BYTES;
        if (len > sizeof pl || o + CS_KVX_HDR_BYTES + len > sizeof out) break;
        memcpy(pl, data + CS_KVX_HDR_BYTES, len);
        seal(&h, pl, len, session, sh);
        cs_kvx_hdr_encode(&h, out + o);
        memcpy(out + o + CS_KVX_HDR_BYTES, pl, len);
        o += CS_KVX_HDR_BYTES + len;
        data += CS_KVX_HDR_BYTES + len, n -= CS_KVX_HDR_BYTES + len;
    }
    raw_write(fd, out, o);
    raw_write(fd, data, n);
}

/* Reads until the receiver closes the connection; false after 10 s. */
static bool wait_closed(int fd) {
    int64_t end = test_now_ms() + 10000;
    uint8_t buf[4096];
    for (;;) {
        int left = (int)(end - test_now_ms());
        if (left <= 0) return false;
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, left) <= 0) continue;
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
}

/* A connection to the receiver from the next of 62,500 loopback source
 * addresses (127.1.1.1 ...): a thousand connections a second, each leaving
 * a TIME_WAIT behind, would use up one address's ephemeral ports in a
 * minute. */
static int connect_rx(void) {
    static uint32_t k;
    int fd = -1;
    /* a signal (libFuzzer's timers) may interrupt connect: start again from
     * the next address (the half-open one is the receiver's to close) */
    for (int attempt = 0; attempt < 8 && fd < 0; attempt++) {
        uint32_t a = k++ % 62500;
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in src = {.sin_family = AF_INET}, dst = {.sin_family = AF_INET};
        src.sin_addr.s_addr = htonl(0x7f010101u + (a % 250) + ((a / 250) << 8));
        dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        dst.sin_port = htons((uint16_t)cs_kvx_rx_port(rx));
        if (fd >= 0 && !bind(fd, (struct sockaddr *)&src, sizeof src) &&
            !connect(fd, (struct sockaddr *)&dst, sizeof dst))
            break;
        int err = errno;
        if (fd >= 0) close(fd);
        fd = -1;
        if (err != EINTR) {
            fprintf(stderr, "fuzz_kvx_rx_seq: cannot connect to the receiver: %s\n", strerror(err));
            abort();
        }
    }
    if (fd < 0) {
        fprintf(stderr, "fuzz_kvx_rx_seq: connect interrupted 8 times\n");
        abort();
    }
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1; /* raw_frame writes header and payload apart: no Nagle wait between them */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static void check_pages(int x, const int32_t *ids, int n, const shadow *sh) {
    if (done[x].status != 0) return;
    if (!sh[x].sealed_trailer) {
        fprintf(stderr, "fuzz_kvx_rx_seq: transfer %d completed without a sealed trailer\n", x);
        abort();
    }
    for (int i = 0; i < n; i++)
        if (!sh[x].have[i] || memcmp(pool + (size_t)ids[i] * PB, sh[x].page[i], PB)) {
            fprintf(stderr, "fuzz_kvx_rx_seq: transfer %d page %d is not what was sent\n", x, i);
            abort();
        }
    if (done[x].t.first_token != sh[x].t.first_token ||
        done[x].t.prompt_len != sh[x].t.prompt_len || done[x].t.total_pages != n) {
        fprintf(stderr, "fuzz_kvx_rx_seq: transfer %d reported another trailer\n", x);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!rx) setup();
    if (!size) return 0;
    uint8_t mode = data[0];
    data++, size--;
    memset(pool, CANARY, (size_t)NP * PB);
    for (int i = 0; i < 4; i++)
        memset(pool + (size_t)ids1[i] * PB, 0, PB);
    for (int i = 0; i < 2; i++)
        memset(pool + (size_t)ids2[i] * PB, 0, PB);
    pthread_mutex_lock(&mu);
    memset(done, 0, sizeof done);
    pthread_mutex_unlock(&mu);
    const char *from = mode & 4 ? NAME : NULL;
    if (cs_kvx_rx_expect(rx, 1, from, ids1, 4, 10000, on_done, NULL) ||
        cs_kvx_rx_expect(rx, 2, from, ids2, 2, mode & 8 ? 1 : 10000, on_done, NULL)) {
        fprintf(stderr, "fuzz_kvx_rx_seq: expect: %s\n", cs_last_error());
        abort();
    }

    inc++;
    int fd = connect_rx();
    uint8_t session[32] = {0};
    static shadow sh[3];
    memset(sh, 0, sizeof sh);
    bool open = true;
    if (mode & 1) open = raw_hello_key(fd, &L, NAME, inc, SECRET, strlen(SECRET), session);
    if (open) {
        if (mode & 2)
            send_sealed(fd, data, size, session, sh);
        else
            raw_write(fd, data, size);
    }
    shutdown(fd, SHUT_WR);
    if (!wait_closed(fd)) {
        fprintf(stderr, "fuzz_kvx_rx_seq: the receiver kept a finished sender's channel 10 s\n");
        abort();
    }
    close(fd);

    cs_kvx_rx_cancel(rx, 1); /* CS_ENOENT when it already ended */
    cs_kvx_rx_cancel(rx, 2);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 10;
    pthread_mutex_lock(&mu);
    while (done[1].calls < 1 || done[2].calls < 1)
        if (pthread_cond_timedwait(&cv, &mu, &ts)) {
            fprintf(stderr, "fuzz_kvx_rx_seq: a transfer never reported (10 s)\n");
            abort();
        }
    pthread_mutex_unlock(&mu);

    for (int p = 0; p < NP; p++) {
        bool reserved = false;
        for (int i = 0; i < 4; i++)
            reserved |= ids1[i] == p;
        for (int i = 0; i < 2; i++)
            reserved |= ids2[i] == p;
        for (int b = 0; !reserved && b < PB; b++)
            if (pool[(size_t)p * PB + (size_t)b] != CANARY) {
                fprintf(stderr, "fuzz_kvx_rx_seq: a byte landed in unreserved page %d\n", p);
                abort();
            }
    }
    check_pages(1, ids1, 4, sh);
    check_pages(2, ids2, 2, sh);
    return 0;
}

#ifndef CS_LIBFUZZER
static size_t frame(uint8_t *out, int type, uint64_t xfer, uint32_t first, uint32_t n,
                    const void *pl, size_t len) {
    cs_kvx_hdr h = {0};
    h.type = (uint16_t)type, h.xfer_id = xfer, h.first_page = first, h.n_pages = n;
    h.payload_len = len;
    if (len) h.flags = CS_KVX_FLAG_CHECKSUM; /* the sums are the driver's to seal */
    cs_kvx_hdr_encode(&h, out);
    if (len) memcpy(out + CS_KVX_HDR_BYTES, pl, len);
    return CS_KVX_HDR_BYTES + len;
}

static size_t trailer(uint8_t *out, uint64_t xfer, int32_t pages) {
    cs_kvx_trailer_wire tw = {.t = {.first_token = 5,
                                    .prompt_len = pages * 16 - 3,
                                    .total_pages = pages,
                                    .first_logprob = -0.25f,
                                    .n_top = 2,
                                    .top_ids = {5, 9},
                                    .top_logprobs = {-0.25f, -2.5f}}};
    uint8_t tb[CS_KVX_TRAILER_BYTES];
    cs_kvx_trailer_encode(&tw, tb);
    return frame(out, CS_KVX_TRAILER, xfer, 0, 0, tb, sizeof tb);
}

static int write_seed(const char *dir, const char *name, uint8_t mode, const uint8_t *b, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fputc(mode, f);
    fwrite(b, 1, n, f);
    return fclose(f) != 0;
}

/* Whole transfers after the driver's handshake (both completing; one of
 * them interleaved, pings, an abort, late frames), and the raw handshake
 * frames of a sender that does not know the secret. */
static int fuzz_write_corpus(const char *dir) {
    static uint8_t buf[8192], pl[4 * PB];
    for (size_t i = 0; i < sizeof pl; i++)
        pl[i] = (uint8_t)(i * 7 + 3);
    size_t n = 0;
    n += frame(buf + n, CS_KVX_PAGES, 1, 0, 2, pl, 2 * PB);
    n += frame(buf + n, CS_KVX_PAGES, 2, 0, 2, pl + PB, 2 * PB);
    n += frame(buf + n, CS_KVX_PING, 0, 0, 0, NULL, 0);
    n += frame(buf + n, CS_KVX_PAGES, 1, 2, 1, pl + 2 * PB, PB);
    n += trailer(buf + n, 2, 2);
    n += frame(buf + n, CS_KVX_PAGES, 1, 3, 1, pl + 3 * PB, PB);
    n += trailer(buf + n, 1, 4);
    int rc = write_seed(dir, "two-transfers", 1 | 2, buf, n);
    rc |= write_seed(dir, "two-transfers-named", 1 | 2 | 4, buf, n);

    n = 0;
    uint8_t sb[CS_KVX_STATUS_BYTES];
    cs_kvx_status_encode(CS_ECANCELED, sb);
    n += frame(buf + n, CS_KVX_PAGES, 2, 0, 1, pl, PB);
    n += frame(buf + n, CS_KVX_ABORT, 2, 0, 0, sb, sizeof sb);
    n += frame(buf + n, CS_KVX_PAGES, 2, 1, 1, pl, PB); /* late: dropped */
    n += frame(buf + n, CS_KVX_PAGES, 1, 0, 4, pl, 4 * PB);
    n += trailer(buf + n, 1, 4);
    n += trailer(buf + n, 1, 4); /* a second trailer */
    rc |= write_seed(dir, "abort-late", 1 | 2 | 8, buf, n);

    /* out of order, then a trailer before the pages */
    n = 0;
    n += frame(buf + n, CS_KVX_PAGES, 1, 1, 1, pl, PB);
    rc |= write_seed(dir, "out-of-order", 1 | 2, buf, n);
    n = 0;
    n += trailer(buf + n, 2, 2);
    n += frame(buf + n, CS_KVX_PAGES, 2, 0, 2, pl, 2 * PB);
    rc |= write_seed(dir, "early-trailer", 1 | 2, buf, n);

    /* before the handshake: HELLO, a forged AUTH, then pages */
    n = 0;
    cs_kvx_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.layout = L;
    snprintf(hello.name, sizeof hello.name, "%s", NAME);
    uint8_t hb[CS_KVX_HELLO_BYTES], proof[CS_KVX_AUTH_BYTES] = {1, 2, 3};
    cs_kvx_hello_encode(&hello, hb);
    n += frame(buf + n, CS_KVX_HELLO, 0, 0, 0, hb, sizeof hb);
    n += frame(buf + n, CS_KVX_AUTH, 0, 0, 0, proof, sizeof proof);
    n += frame(buf + n, CS_KVX_PAGES, 1, 0, 4, pl, 4 * PB);
    rc |= write_seed(dir, "unauthenticated", 2, buf, n);
    return rc;
}
#endif

#include "../fuzz/fuzz_main.h"
