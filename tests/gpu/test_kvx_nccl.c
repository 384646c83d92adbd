/* test_kvx_nccl: the KV transport's NCCL payload on real GPUs (labels gpu,
 * kvx): the public API with CUDA pools (the payload follows the pool).
 *
 * The parent never touches CUDA (a CUDA context does not survive fork): a
 * probe child counts the devices and, on device 0, checks the kv_pack.cu
 * kernels against the host (gather/scatter bit-exact on both vector paths,
 * more pages than a grid column, device KV sum == cs__kvx_sum_ref). Fewer than
 * two GPUs: SKIP, exit 77 (after the kernel checks when there is one GPU).
 * With two, each scenario forks a receiver on GPU 1 and a sender on GPU 0
 * (one NCCL communicator per channel, over whatever NCCL picks between them):
 *  - transfers: 1 to 2,000 pages one after another, 8 interleaved, one aborted
 *    by the sender mid-transfer, one more after it: pages bit-identical
 *    (content is a function of the source page id, so the receiver checks it
 *    alone), done statuses as expected on both sides;
 *  - kill -9 of the receiver mid-transfer: the sender reports the failure
 *    within 15 s, then a restarted receiver on the same port gets a transfer
 *    from the same sender process (a new communicator on the same channel);
 *  - kill -9 of the sender mid-transfer: the receiver reports the failure
 *    within 15 s.
 * Not yet run on GPUs (docs/architecture.md, "KV transport"). */
#include <cuda_runtime_api.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chunkserve/kvx.h"
#include "cuda_impl.h"
#include "kvx-impl.h"
#include "kvx_test.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

/* 8 layers, 2 KV heads, head_dim 64, 16-token pages, bf16: 64 KiB pages */
static const cs_kvx_layout LG = {
    8, 2, 64, CS_KVX_DTYPE_BF16, 16, 8 * 2 * 16 * 2 * 64 * 2, CS_KVX_WEIGHTS_FP32, 0x5eed};
#define PB ((size_t)(8 * 2 * 16 * 2 * 64 * 2))
#define NPOOL 4096
#define PW (PB / 8) /* 64-bit words per page */

enum { SC_TRANSFERS, SC_KILL_RX, SC_KILL_TX, SC_RESTART };

#define FAILX(...)                                                                                 \
    do {                                                                                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);                                         \
        _exit(1);                                                                                  \
    } while (0)

/* ------------------------------------------------------------ helpers */

static uint64_t word_of(uint32_t page, uint64_t w) {
    return cs__kvx_sum_mix(((uint64_t)page << 40) ^ w, 0x5eed);
}

static uint64_t prng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    prng ^= prng << 13, prng ^= prng >> 7, prng ^= prng << 17;
    return prng;
}

/* Messages from children to the parent: 'P' port, 'R' data is flowing,
 * 'F' failure seen at time v (CLOCK_MONOTONIC ms, comparable across
 * processes). */
typedef struct {
    char tag;
    int64_t v;
} msg;

static void say(int fd, char tag, int64_t v) {
    msg m = {tag, v};
    if (write(fd, &m, sizeof m) != (ssize_t)sizeof m) _exit(3);
}

static bool hear(int fd, msg *m, int timeout_ms) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) != 1) return false;
    return read(fd, m, sizeof *m) == (ssize_t)sizeof *m;
}

/* The transfer plan, the same in both processes. */
typedef struct {
    uint64_t id;
    int32_t n;
    int32_t src[2000], dst[2000];
    bool aborted;
} tplan;

static const int32_t SEQ[] = {1, 2, 17, 128, 129, 1000, 2000};
#define N_SEQ 7
#define N_IL 8
#define N_PLAN (N_SEQ + N_IL + 2)

static void plan_make(tplan *t) {
    prng = 0x9e3779b97f4a7c15ull;
    static int32_t perm[NPOOL];
    for (int i = 0; i < NPOOL; i++)
        perm[i] = i;
    for (int i = NPOOL - 1; i > 0; i--) {
        int j = (int)(rnd() % (uint64_t)(i + 1)), x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    int next = 0;
    for (int k = 0; k < N_PLAN; k++) {
        tplan *p = &t[k];
        p->id = 7000 + (uint64_t)k;
        p->n = k < N_SEQ ? SEQ[k] : k < N_SEQ + N_IL ? 50 : k == N_SEQ + N_IL ? 100 : 200;
        p->aborted = k == N_SEQ + N_IL;
        for (int32_t i = 0; i < p->n; i++) {
            p->src[i] = (int32_t)(rnd() % NPOOL);
            p->dst[i] = perm[next++];
        }
    }
    if (next > NPOOL) FAILX("plan needs %d pages", next);
}

/* The kill scenarios' transfer: 2,000 pages (ids of plan[N_SEQ - 1]). */
static void big_make(const tplan *plan, tplan *big) {
    *big = plan[N_SEQ - 1];
    big->id = 9000;
}

static void *pool_alloc(int device, bool fill) {
    CS_CUDA_CHECK(cudaSetDevice(device));
    void *pool;
    CS_CUDA_CHECK(cudaMalloc(&pool, (size_t)NPOOL * PB));
    if (!fill) {
        CS_CUDA_CHECK(cudaMemset(pool, 0xff, (size_t)NPOOL * PB));
        return pool;
    }
    uint64_t *h = malloc((size_t)NPOOL * PB);
    if (!h) FAILX("out of memory");
    for (uint32_t p = 0; p < NPOOL; p++)
        for (uint64_t w = 0; w < PW; w++)
            h[p * PW + w] = word_of(p, w);
    CS_CUDA_CHECK(cudaMemcpy(pool, h, (size_t)NPOOL * PB, cudaMemcpyHostToDevice));
    free(h);
    return pool;
}

static cs_kvx_tx *tx_make(void *pool) {
    cs_kvx_tx_params p = cs_kvx_tx_params_default();
    p.layout = LG;
    p.name = "prefill-gpu0";
    p.max_frame_bytes = 8u << 20; /* 128 pages per chunk */
    p.keepalive_ms = 500;
    p.dead_ms = 3000;
    p.pool = (cs_kvx_pool){CS_KVX_POOL_CUDA, 0, pool, NPOOL};
    p.init_timeout_ms = 60000;
    p.op_timeout_ms = 20000;
    cs_kvx_tx *tx;
    if (cs_kvx_tx_init(&p, &tx)) FAILX("cs_kvx_tx_init: %s", cs_last_error());
    return tx;
}

static cs_kvx_rx *rx_make(void *pool, int port) {
    cs_kvx_rx_params p = cs_kvx_rx_params_default();
    p.layout = LG;
    p.port = port;
    p.max_frame_bytes = 8u << 20;
    p.keepalive_ms = 500;
    p.dead_ms = 3000;
    p.pool = (cs_kvx_pool){CS_KVX_POOL_CUDA, 1, pool, NPOOL};
    p.init_timeout_ms = 60000;
    p.op_timeout_ms = 20000;
    cs_kvx_rx *rx;
    if (cs_kvx_rx_init(&p, &rx)) FAILX("cs_kvx_rx_init: %s", cs_last_error());
    return rx;
}

/* Receiver side: the pages of t landed bit-identical. */
static void check_pages(const uint64_t *h, const tplan *t) {
    for (int32_t i = 0; i < t->n; i++)
        for (uint64_t w = 0; w < PW; w++)
            if (h[(size_t)t->dst[i] * PW + w] != word_of((uint32_t)t->src[i], w))
                FAILX("transfer %llu page %d (src %d -> dst %d) word %llu differs",
                      (unsigned long long)t->id, i, t->src[i], t->dst[i], (unsigned long long)w);
}

static int send_some(cs_kvx_tx *tx, const tplan *t, int32_t *sent, int32_t step) {
    int32_t k = t->n - *sent < step ? t->n - *sent : step;
    if (k <= 0) return 0;
    int r;
    while ((r = cs_kvx_tx_send_pages(tx, t->id, *sent, k, t->src + *sent, NULL, NULL)) == CS_EAGAIN)
        usleep(500);
    if (r == 0) *sent += k;
    return r;
}

static void finish(cs_kvx_tx *tx, const tplan *t) {
    cs_kvx_trailer tr = {.first_token = 1, .prompt_len = t->n * LG.page_size, .total_pages = t->n};
    if (cs_kvx_tx_finish(tx, t->id, &tr))
        FAILX("finish %llu: %s", (unsigned long long)t->id, cs_last_error());
}

static waiter w_done;

/* -------------------------------------------------------------- roles */

static void run_receiver(int scenario, int port, int wfd) {
    cs_log_set_role("test-rx");
    static tplan plan[N_PLAN], big;
    plan_make(plan);
    big_make(plan, &big);
    tplan *list[N_PLAN];
    int n = 0;
    if (scenario == SC_TRANSFERS)
        for (int k = 0; k < N_PLAN; k++)
            list[n++] = &plan[k];
    else if (scenario == SC_RESTART)
        list[n++] = &plan[N_PLAN - 1];
    else
        list[n++] = &big;
    void *pool = pool_alloc(1, false);
    cs_kvx_rx *rx = rx_make(pool, port);
    waiter_init(&w_done);
    for (int k = 0; k < n; k++)
        if (cs_kvx_rx_expect(rx, list[k]->id, NULL, list[k]->dst, list[k]->n, 150000, waiter_done,
                             &w_done))
            FAILX("expect: %s", cs_last_error());
    say(wfd, 'P', cs_kvx_rx_port(rx));
    if (scenario == SC_KILL_TX) {
        cs_kvx_stats st;
        do {
            usleep(1000);
            cs_kvx_rx_get_stats(rx, &st);
        } while (st.bytes == 0);
        say(wfd, 'R', 0);
        if (!waiter_wait(&w_done, 1, 60000))
            FAILX("receiver: no failure after the sender was killed");
        say(wfd, 'F', test_now_ms());
        if (w_done.status[0] >= 0)
            FAILX("receiver: status %d after the sender was killed", w_done.status[0]);
        printf("receiver: %s (%s)\n", cs_strerror(w_done.status[0]), w_done.msg[0]);
        cs_kvx_rx_free(rx);
        _exit(0);
    }
    if (!waiter_wait(&w_done, n, 150000))
        FAILX("receiver: %d of %d transfers reported", w_done.n_done, n);
    uint64_t *h = malloc((size_t)NPOOL * PB);
    CS_CUDA_CHECK(cudaMemcpy(h, pool, (size_t)NPOOL * PB, cudaMemcpyDeviceToHost));
    for (int k = 0; k < n; k++) {
        int st = waiter_status(&w_done, list[k]->id);
        if (list[k]->aborted) {
            if (st != CS_ECANCELED)
                FAILX("receiver: aborted transfer %llu: status %d", (unsigned long long)list[k]->id,
                      st);
            continue;
        }
        if (st != 0)
            FAILX("receiver: transfer %llu: status %d", (unsigned long long)list[k]->id, st);
        check_pages(h, list[k]);
    }
    free(h);
    cs_kvx_stats st;
    cs_kvx_rx_get_stats(rx, &st);
    printf("receiver: %d transfers checked bit-identical, %llu bytes scattered, %llu protocol "
           "errors\n",
           n, (unsigned long long)st.bytes, (unsigned long long)st.protocol_errors);
    cs_kvx_rx_free(rx);
    CS_CUDA_CHECK(cudaFree(pool));
    _exit(0);
}

static void wait_ok(const tplan *t) {
    for (int i = 0; i < 150000 && waiter_status(&w_done, t->id) == 1; i++)
        usleep(1000);
    int st = waiter_status(&w_done, t->id);
    if (st != 0) FAILX("sender: transfer %llu: status %d", (unsigned long long)t->id, st);
}

static void run_sender(int scenario, int port, int wfd, int rfd) {
    cs_log_set_role("test-tx");
    static tplan plan[N_PLAN];
    plan_make(plan);
    void *pool = pool_alloc(0, true);
    cs_kvx_tx *tx = tx_make(pool);
    waiter_init(&w_done);
    if (scenario == SC_TRANSFERS) {
        double t0 = cs_now();
        size_t bytes = 0;
        for (int k = 0; k < N_SEQ; k++) {
            tplan *t = &plan[k];
            int32_t sent = 0;
            if (cs_kvx_tx_begin(tx, "127.0.0.1", port, t->id, t->n, 120000, waiter_done, &w_done))
                FAILX("begin: %s", cs_last_error());
            while (sent < t->n)
                if (send_some(tx, t, &sent, 37)) FAILX("send: %s", cs_last_error());
            finish(tx, t);
            wait_ok(t);
            bytes += (size_t)t->n * PB;
        }
        double dt = cs_now() - t0;
        printf("sender: %d transfers, %.1f MiB in %.3f s (%.2f GB/s incl. communicator creation)\n",
               N_SEQ, (double)bytes / (1 << 20), dt, (double)bytes / dt / 1e9);
        int32_t sent[N_IL] = {0};
        for (int k = 0; k < N_IL; k++)
            if (cs_kvx_tx_begin(tx, "127.0.0.1", port, plan[N_SEQ + k].id, plan[N_SEQ + k].n,
                                120000, waiter_done, &w_done))
                FAILX("begin: %s", cs_last_error());
        for (int left = 1; left;) {
            left = 0;
            for (int k = 0; k < N_IL; k++) {
                tplan *t = &plan[N_SEQ + k];
                if (sent[k] == t->n) continue;
                if (send_some(tx, t, &sent[k], 1 + (int32_t)(rnd() % 9)))
                    FAILX("send: %s", cs_last_error());
                if (sent[k] == t->n)
                    finish(tx, t);
                else
                    left = 1;
            }
        }
        for (int k = 0; k < N_IL; k++)
            wait_ok(&plan[N_SEQ + k]);
        tplan *a = &plan[N_SEQ + N_IL];
        int32_t sa = 0;
        if (cs_kvx_tx_begin(tx, "127.0.0.1", port, a->id, a->n, 120000, waiter_done, &w_done))
            FAILX("begin: %s", cs_last_error());
        if (send_some(tx, a, &sa, 50)) FAILX("send: %s", cs_last_error());
        usleep(200000);
        if (cs_kvx_tx_abort(tx, a->id)) FAILX("abort: %s", cs_last_error());
        for (int i = 0; i < 10000 && waiter_status(&w_done, a->id) == 1; i++)
            usleep(1000);
        if (waiter_status(&w_done, a->id) != CS_ECANCELED)
            FAILX("sender: abort reported %d", waiter_status(&w_done, a->id));
        tplan *f = &plan[N_PLAN - 1];
        int32_t sf = 0;
        if (cs_kvx_tx_begin(tx, "127.0.0.1", port, f->id, f->n, 120000, waiter_done, &w_done))
            FAILX("begin: %s", cs_last_error());
        while (sf < f->n)
            if (send_some(tx, f, &sf, 64)) FAILX("send: %s", cs_last_error());
        finish(tx, f);
        wait_ok(f);
        cs_kvx_stats st;
        cs_kvx_tx_get_stats(tx, &st);
        if (st.conns_opened != 1)
            FAILX("sender: %llu channels opened, expected 1", (unsigned long long)st.conns_opened);
        printf("sender: all transfers acknowledged, one communicator\n");
        cs_kvx_tx_free(tx);
        CS_CUDA_CHECK(cudaFree(pool));
        _exit(0);
    }
    /* kill scenarios: one big transfer, sent slowly (2 pages every 5 ms) */
    static tplan big;
    big_make(plan, &big);
    int32_t sent = 0;
    if (cs_kvx_tx_begin(tx, "127.0.0.1", port, big.id, big.n, 120000, waiter_done, &w_done))
        FAILX("begin: %s", cs_last_error());
    bool told = false;
    for (;;) {
        if (sent < big.n && send_some(tx, &big, &sent, 2) != 0) break; /* ended: failed */
        if (waiter_status(&w_done, big.id) != 1) break;
        cs_kvx_stats st;
        cs_kvx_tx_get_stats(tx, &st);
        if (!told && st.bytes > 0) say(wfd, 'R', 0), told = true;
        usleep(5000);
    }
    if (!waiter_wait(&w_done, 1, 60000)) FAILX("sender: no failure after the receiver was killed");
    say(wfd, 'F', test_now_ms());
    if (w_done.status[0] >= 0)
        FAILX("sender: status %d after the receiver was killed", w_done.status[0]);
    printf("sender: %s (%s)\n", cs_strerror(w_done.status[0]), w_done.msg[0]);
    /* peer restart: a new receiver on the same port, the same channel */
    msg m;
    if (!hear(rfd, &m, 120000) || m.tag != 'P') FAILX("sender: no restarted receiver");
    tplan *f = &plan[N_PLAN - 1];
    int32_t sf = 0;
    if (cs_kvx_tx_begin(tx, "127.0.0.1", (int)m.v, f->id, f->n, 120000, waiter_done, &w_done))
        FAILX("begin: %s", cs_last_error());
    while (sf < f->n)
        if (send_some(tx, f, &sf, 64)) FAILX("send after restart: %s", cs_last_error());
    finish(tx, f);
    wait_ok(f);
    cs_kvx_stats st;
    cs_kvx_tx_get_stats(tx, &st);
    printf("sender: transfer after the receiver's restart acknowledged (%llu connections)\n",
           (unsigned long long)st.conns_opened);
    cs_kvx_tx_free(tx);
    CS_CUDA_CHECK(cudaFree(pool));
    _exit(0);
}

/* ------------------------------------------------------------- parent */

static int reap(pid_t pid, int timeout_ms) {
    for (int i = 0; i < timeout_ms / 10; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static pid_t spawn_receiver(int scenario, int port, int *rd) {
    int p[2];
    ASSERT_EQ_INT(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        run_receiver(scenario, port, p[1]);
    }
    close(p[1]);
    *rd = p[0];
    return pid;
}

static int scenario_transfers(void) {
    int rd;
    pid_t r = spawn_receiver(SC_TRANSFERS, 0, &rd);
    msg m;
    if (!hear(rd, &m, 120000) || m.tag != 'P') return reap(r, 1000), 1;
    pid_t s = fork();
    if (s == 0) run_sender(SC_TRANSFERS, (int)m.v, -1, -1);
    int ss = reap(s, 240000), rs = reap(r, 60000);
    printf("transfers: sender exit %d, receiver exit %d\n", ss, rs);
    return ss || rs;
}

static int scenario_kill_rx(void) {
    int rd;
    pid_t r = spawn_receiver(SC_KILL_RX, 0, &rd);
    msg m;
    if (!hear(rd, &m, 120000) || m.tag != 'P') return reap(r, 1000), 1;
    int port = (int)m.v;
    int up[2], down[2];
    ASSERT_EQ_INT(pipe(up), 0);
    ASSERT_EQ_INT(pipe(down), 0);
    pid_t s = fork();
    if (s == 0) {
        close(up[0]), close(down[1]);
        run_sender(SC_KILL_RX, port, up[1], down[0]);
    }
    close(up[1]), close(down[0]);
    if (!hear(up[0], &m, 120000) || m.tag != 'R') goto fail;
    int64_t t_kill = test_now_ms();
    kill(r, SIGKILL);
    reap(r, 10000);
    r = 0;
    if (!hear(up[0], &m, 60000) || m.tag != 'F') goto fail;
    printf("kill -9 receiver: the sender reported the failure after %lld ms\n",
           (long long)(m.v - t_kill));
    if (m.v - t_kill > 15000) goto fail;
    int rd2;
    pid_t r2 = spawn_receiver(SC_RESTART, port, &rd2);
    if (!hear(rd2, &m, 120000) || m.tag != 'P') {
        reap(r2, 1000);
        goto fail;
    }
    say(down[1], 'P', m.v);
    int ss = reap(s, 240000), rs = reap(r2, 60000);
    printf("restart: sender exit %d, restarted receiver exit %d\n", ss, rs);
    return ss || rs;
fail:
    fprintf(stderr, "kill -9 receiver: scenario failed\n");
    if (r) reap(r, 1000);
    reap(s, 1000);
    return 1;
}

static int scenario_kill_tx(void) {
    int rd;
    pid_t r = spawn_receiver(SC_KILL_TX, 0, &rd);
    msg m;
    if (!hear(rd, &m, 120000) || m.tag != 'P') return reap(r, 1000), 1;
    pid_t s = fork();
    if (s == 0) run_sender(SC_KILL_TX, (int)m.v, -1, -1);
    int bad = 0;
    if (!hear(rd, &m, 120000) || m.tag != 'R') bad = 1;
    int64_t t_kill = test_now_ms();
    kill(s, SIGKILL);
    reap(s, 10000);
    if (!bad && (!hear(rd, &m, 60000) || m.tag != 'F')) bad = 1;
    if (bad) fprintf(stderr, "kill -9 sender: scenario failed\n");
    if (!bad) {
        printf("kill -9 sender: the receiver reported the failure after %lld ms\n",
               (long long)(m.v - t_kill));
        if (m.v - t_kill > 15000) bad = 1;
    }
    int rs = reap(r, 60000);
    return bad || rs;
}

/* Probe child: device count, then the kv_pack kernels on device 0 against
 * the host. Exit 10: no GPU, 11: one GPU, 12: two or more (kernels ok);
 * 1: a kernel check failed. */
static void kernel_checks(void) {
    size_t pbs[] = {PB, 24, 40};
    for (int v = 0; v < 3; v++) {
        size_t pb = pbs[v];
        int32_t np = pb == PB ? 300 : 70000; /* 70000 > one grid column */
        uint8_t *hpool = malloc((size_t)np * pb), *hst = malloc((size_t)np * pb),
                *back = malloc((size_t)np * pb);
        int32_t *ids = malloc((size_t)np * sizeof *ids);
        for (size_t i = 0; i < (size_t)np * pb; i++)
            hpool[i] = (uint8_t)rnd();
        for (int32_t i = 0; i < np; i++)
            ids[i] = i;
        for (int32_t i = np - 1; i > 0; i--) {
            int32_t j = (int32_t)(rnd() % (uint64_t)(i + 1)), x = ids[i];
            ids[i] = ids[j], ids[j] = x;
        }
        void *dpool, *dst;
        int32_t *dids;
        unsigned long long *dsum, sum;
        CS_CUDA_CHECK(cudaMalloc(&dpool, (size_t)np * pb));
        CS_CUDA_CHECK(cudaMalloc(&dst, (size_t)np * pb));
        CS_CUDA_CHECK(cudaMalloc((void **)&dids, (size_t)np * sizeof *ids));
        CS_CUDA_CHECK(cudaMalloc((void **)&dsum, sizeof *dsum));
        CS_CUDA_CHECK(cudaMemcpy(dpool, hpool, (size_t)np * pb, cudaMemcpyHostToDevice));
        CS_CUDA_CHECK(cudaMemcpy(dids, ids, (size_t)np * sizeof *ids, cudaMemcpyHostToDevice));
        int32_t ns[] = {1, 7, np};
        for (int k = 0; k < 3; k++) {
            int32_t n = ns[k];
            cs_cuda_kv_gather(dpool, pb, dids, n, dst, dsum, 0);
            CS_CUDA_CHECK(cudaMemcpy(back, dst, (size_t)n * pb, cudaMemcpyDeviceToHost));
            CS_CUDA_CHECK(cudaMemcpy(&sum, dsum, sizeof sum, cudaMemcpyDeviceToHost));
            for (int32_t i = 0; i < n; i++)
                if (memcmp(back + (size_t)i * pb, hpool + (size_t)ids[i] * pb, pb))
                    FAILX("gather: page_bytes %zu, %d pages: page %d differs", pb, n, i);
            if (sum != cs__kvx_sum_ref(back, (size_t)n * pb))
                FAILX("gather: page_bytes %zu, %d pages: device sum %016llx, host %016llx", pb, n,
                      sum, (unsigned long long)cs__kvx_sum_ref(back, (size_t)n * pb));
        }
        /* scatter random staging into the permuted ids */
        for (size_t i = 0; i < (size_t)np * pb; i++)
            hst[i] = (uint8_t)rnd();
        CS_CUDA_CHECK(cudaMemcpy(dst, hst, (size_t)np * pb, cudaMemcpyHostToDevice));
        cs_cuda_kv_scatter(dpool, pb, dids, np, dst, dsum, 0);
        CS_CUDA_CHECK(cudaMemcpy(back, dpool, (size_t)np * pb, cudaMemcpyDeviceToHost));
        CS_CUDA_CHECK(cudaMemcpy(&sum, dsum, sizeof sum, cudaMemcpyDeviceToHost));
        for (int32_t i = 0; i < np; i++)
            if (memcmp(back + (size_t)ids[i] * pb, hst + (size_t)i * pb, pb))
                FAILX("scatter: page_bytes %zu: page %d differs", pb, i);
        if (sum != cs__kvx_sum_ref(hst, (size_t)np * pb))
            FAILX("scatter: page_bytes %zu: sum differs", pb);
        cs_cuda_kv_gather(dpool, pb, dids, 0, dst, dsum, 0); /* no pages: sum 0 */
        CS_CUDA_CHECK(cudaMemcpy(&sum, dsum, sizeof sum, cudaMemcpyDeviceToHost));
        if (sum != 0) FAILX("gather of 0 pages: sum %llx", sum);
        cudaFree(dpool), cudaFree(dst), cudaFree(dids), cudaFree(dsum);
        free(hpool), free(hst), free(back), free(ids);
        printf(
            "  kv_pack: page_bytes %6zu, %5d pages: gather/scatter bit-exact, device sum == host\n",
            pb, np);
    }
}

static int probe(void) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess || n < 1) {
            printf("test_kvx_nccl: SKIP: no GPU (cudaGetDeviceCount: %s, %d devices); needs 2\n",
                   e != cudaSuccess ? cudaGetErrorName(e) : "ok", n);
            fflush(stdout);
            _exit(10);
        }
        CS_CUDA_CHECK(cudaSetDevice(0));
        kernel_checks();
        fflush(stdout);
        _exit(n >= 2 ? 12 : 11);
    }
    return reap(pid, 120000);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    int p = probe();
    if (p == 10) return TEST_SKIP;
    if (p == 11) {
        printf("test_kvx_nccl: SKIP: kernels checked on 1 GPU; the NCCL transport needs 2\n");
        return TEST_SKIP;
    }
    if (p != 12) {
        fprintf(stderr, "test_kvx_nccl: device probe / kernel checks failed (%d)\n", p);
        return 1;
    }
    int bad = 0;
    bad |= scenario_transfers();
    bad |= scenario_kill_rx();
    bad |= scenario_kill_tx();
    printf("test_kvx_nccl: %s\n", bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
