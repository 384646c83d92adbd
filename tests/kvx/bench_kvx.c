/* bench_kvx: bandwidth of the KV transport's TCP payload on loopback, side
 * by side in one run with memcpy and with a plain loopback socket copy (one
 * writer thread, one reader, 1 MiB write()/read() calls, no framing). Pages
 * are SmolLM2-135M-sized (30 layers x K,V x 16 tokens x 3 kv heads x 64 x
 * fp32 = 720 KiB), sent by id from a host pool and landing by id in another.
 * The kvx figure includes framing, the XXH3 checksums on both sides (and
 * without), and the receiver's ack. The last two columns are what
 * encrypting the link would cost each side: one core's AES-256-GCM and
 * ChaCha20-Poly1305 (OpenSSL EVP) over 16 KiB records, the work TLS or a
 * WireGuard/IPsec overlay adds per byte on the sender (and the same again on
 * the receiver). Not a test: prints a table.
 * Usage: chunkserve-bench-kvx [max_MiB [repetitions]] */
#include <netinet/in.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvx_test.h"

static const cs_kvx_layout L = {
    30, 3, 64, CS_KVX_DTYPE_F32, 16, 30ull * 2 * 16 * 3 * 64 * 4, CS_KVX_WEIGHTS_FP32, 0x5eed};
static uint8_t *pool; /* receiver's page pool */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct {
    int fd;
    size_t bytes;
    uint8_t *buf;
} sock_arg;

static void *sock_reader(void *p) {
    sock_arg *a = p;
    size_t got = 0;
    while (got < a->bytes) {
        size_t want = a->bytes - got < (1u << 20) ? a->bytes - got : (1u << 20);
        ssize_t n = read(a->fd, a->buf + got, want);
        if (n <= 0) break;
        got += (size_t)n;
    }
    return NULL;
}

static double bench_socket(const uint8_t *src, uint8_t *dst, size_t bytes) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(lfd, (struct sockaddr *)&sa, sizeof sa);
    listen(lfd, 1);
    socklen_t sl = sizeof sa;
    getsockname(lfd, (struct sockaddr *)&sa, &sl);
    int cfd = raw_connect(ntohs(sa.sin_port));
    int afd = accept(lfd, NULL, NULL);
    sock_arg a = {afd, bytes, dst};
    double t0 = now_s();
    pthread_t th;
    pthread_create(&th, NULL, sock_reader, &a);
    raw_write(cfd, src, bytes);
    pthread_join(th, NULL);
    double t = now_s() - t0;
    close(cfd), close(afd), close(lfd);
    return t;
}

static double bench_kvx(cs_kvx_tx *tx, cs_kvx_rx *rx, int32_t n_pages, uint64_t id) {
    static int32_t ids[8192];
    for (int32_t i = 0; i < n_pages; i++)
        ids[i] = i;
    waiter rw, tw;
    waiter_init(&rw);
    waiter_init(&tw);
    double t0 = now_s();
    ASSERT_EQ_INT(cs_kvx_rx_expect(rx, id, NULL, ids, n_pages, 60000, waiter_done, &rw), 0);
    ASSERT_EQ_INT(
        cs_kvx_tx_begin(tx, "127.0.0.1", cs_kvx_rx_port(rx), id, n_pages, 60000, waiter_done, &tw),
        0);
    /* in chunks of 32 pages, as a prefill worker would after each step */
    for (int32_t p = 0; p < n_pages; p += 32) {
        int32_t k = n_pages - p < 32 ? n_pages - p : 32;
        ASSERT_EQ_INT(send_retry(tx, id, p, k, ids + p, NULL, NULL), 0);
    }
    cs_kvx_trailer t = {.first_token = 0, .prompt_len = n_pages * 16, .total_pages = n_pages};
    ASSERT_EQ_INT(cs_kvx_tx_finish(tx, id, &t), 0);
    ASSERT_TRUE(waiter_wait(&tw, 1, 60000));
    double dt = now_s() - t0;
    ASSERT_EQ_INT(tw.status[0], 0);
    ASSERT_TRUE(waiter_wait(&rw, 1, 60000));
    return dt;
}

/* One core sealing bytes in 16 KiB AEAD records (a TLS record's size). */
static double bench_aead(const EVP_CIPHER *cipher, const uint8_t *src, uint8_t *dst, size_t bytes) {
    EVP_CIPHER_CTX *x = EVP_CIPHER_CTX_new();
    ASSERT_TRUE(x != NULL);
    uint8_t key[32] = {1}, iv[12] = {2}, tag[16];
    double t0 = now_s();
    for (size_t off = 0; off < bytes; off += 16384) {
        int len = (int)(bytes - off < 16384 ? bytes - off : 16384), n = 0;
        iv[0]++;
        ASSERT_TRUE(EVP_EncryptInit_ex(x, cipher, NULL, key, iv) == 1);
        ASSERT_TRUE(EVP_EncryptUpdate(x, dst + off, &n, src + off, len) == 1);
        ASSERT_TRUE(EVP_EncryptFinal_ex(x, dst + off + n, &n) == 1);
        ASSERT_TRUE(EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_AEAD_GET_TAG, 16, tag) == 1);
    }
    double t = now_s() - t0;
    EVP_CIPHER_CTX_free(x);
    return t;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of n values (sorted in place), and the spread around it. */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
static double minof(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] < m ? v[i] : m;
    return m;
}
static double maxof(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

int main(int argc, char **argv) {
    size_t max_mib = argc > 1 ? (size_t)atol(argv[1]) : 256;
    int reps = argc > 2 ? atoi(argv[2]) : 3;
    size_t maxb = max_mib << 20;
    uint8_t *src = malloc(maxb + L.page_bytes), *dst = malloc(maxb + L.page_bytes);
    pool = malloc(maxb + L.page_bytes);
    for (size_t i = 0; i < maxb + L.page_bytes; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    memset(dst, 0, maxb + L.page_bytes), memset(pool, 0, maxb + L.page_bytes);
    int32_t n_pool = (int32_t)(maxb / L.page_bytes + 1);
    cs_kvx_rx_params rp = cs_kvx_rx_params_default();
    rp.layout = L;
    rp.pool = host_pool(pool, n_pool);
    rp.require_checksum = false; /* so that the no-checksum sender can be measured too */
    cs_kvx_rx *rx;
    ASSERT_EQ_INT(cs_kvx_rx_init(&rp, &rx), 0);
    cs_kvx_tx *tx[2];
    for (int c = 0; c < 2; c++) {
        cs_kvx_tx_params tp = cs_kvx_tx_params_default();
        tp.layout = L;
        tp.pool = host_pool(src, n_pool);
        tp.name = c ? "bench-nosum" : "bench";
        tp.checksum = c == 0;
        ASSERT_EQ_INT(cs_kvx_tx_init(&tp, &tx[c]), 0);
    }
    printf("# KV transport (TCP payload, loopback) vs memcpy vs plain socket; page %llu bytes; "
           "GB/s = 1e9 bytes/s, "
           "median of %d repetitions, kvx/sock: median [min-max] of per-repetition ratios\n",
           (unsigned long long)L.page_bytes, reps);
    printf("%10s %10s %12s %12s %14s %10s %12s %12s\n", "MiB", "memcpy", "socket", "kvx+xxh3",
           "kvx(no sum)", "kvx/sock", "aes256-gcm", "chacha-poly");
    uint64_t id = 1;
    for (size_t mib = 1; mib <= max_mib; mib *= 4) {
        int32_t n_pages = (int32_t)(((mib << 20) + L.page_bytes - 1) / L.page_bytes);
        size_t bytes = (size_t)n_pages * L.page_bytes;
        enum { MAXR = 64 };
        double t[6][MAXR], ratio[MAXR];
        for (int rep = 0; rep < reps && rep < MAXR; rep++) {
            double t0 = now_s();
            memcpy(dst, src, bytes);
            t[0][rep] = now_s() - t0;
            t[1][rep] = bench_socket(src, dst, bytes);
            t[2][rep] = bench_kvx(tx[0], rx, n_pages, id++);
            t[3][rep] = bench_kvx(tx[1], rx, n_pages, id++);
            ratio[rep] = t[1][rep] / t[2][rep]; /* this repetition's socket time over kvx's */
            t[4][rep] = bench_aead(EVP_aes_256_gcm(), src, dst, bytes);
            t[5][rep] = bench_aead(EVP_chacha20_poly1305(), src, dst, bytes);
        }
        int nr = reps < MAXR ? reps : MAXR;
        double gb = (double)bytes / 1e9;
        printf("%10zu %10.2f %12.2f %12.2f %14.2f %9.0f%% [%3.0f-%3.0f%%] %12.2f %12.2f\n", mib,
               gb / median(t[0], nr), gb / median(t[1], nr), gb / median(t[2], nr),
               gb / median(t[3], nr), 100.0 * median(ratio, nr), 100.0 * minof(ratio, nr),
               100.0 * maxof(ratio, nr), gb / median(t[4], nr), gb / median(t[5], nr));
        fflush(stdout);
    }
    for (int c = 0; c < 2; c++)
        cs_kvx_tx_free(tx[c]);
    cs_kvx_rx_free(rx);
    free(src), free(dst), free(pool);
    return 0;
}
