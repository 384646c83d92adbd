/* threadpool.c: the fixed-size thread pool the CPU kernels run on.
 *
 * One job at a time: the caller publishes (fn, arg, n) and bumps a
 * generation counter g. The split is static, one range per thread, fixed by
 * n and the pool size, so results cannot depend on timing; who runs a range
 * is whoever claims it first. Range i is claimed by moving its word from
 * g - 1 to g (a compare-exchange, so one winner, and a worker that wakes
 * for a job already over claims nothing) and marked done by storing g.
 * Thread i claims range i first, then any range still unclaimed; the caller
 * runs range 0, claims what is left, then waits for the ranges others hold.
 * Workers wait on the generation counter, the caller on a range's done word.
 * Linux only (futex). Not a task scheduler: no queue, no nesting.
 *
 * Claiming is what keeps a loaded machine from stalling every step: a worker
 * that the scheduler has not run yet (its CPU busy with another process)
 * holds nothing up, because the caller runs its range instead. With waits
 * for every worker, a 2-core machine with two busy loops beside the engine
 * spent most of each job waiting for a worker's time slice (the engine got
 * about 5% of a CPU). Equal ranges make claiming never slower: a worker that
 * turns up after the caller took its range would have finished later still.
 * On an idle machine each worker's words sit on a line only it and the
 * caller touch, so a job costs the cache-line transfers a plain barrier does.
 *
 * Waiting: poll for up to CS_POOL_SPIN_NS, yielding the CPU every few polls,
 * then sleep on a futex. Measured on a 2-vCPU VM, a decode step of 30
 * layers at SmolLM2-135M shapes (~450 jobs) took 20-24 ms this way, 36-50 ms
 * with futex waits alone (the scheduler wakes a worker on its waker's CPU,
 * so short jobs ran on one core) and 104-128 ms polling 200 us without
 * yielding (a poller on the caller's CPU starved the caller). */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "chunkserve/ops.h"
#include "chunkserve/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Short enough that an idle pool stops costing CPU at once, long enough to
 * catch the next op of a forward step. */
#define CS_POOL_SPIN_NS 50000
#define CS_POOL_YIELD_EVERY 16

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Polls *word while (*word == val) != until_eq, for at most the spin time;
 * returns the last value read. The yields let a thread that shares our CPU
 * (often the one we wait for) run, and keep us runnable so the scheduler
 * moves one of us to an idle CPU. */
static uint32_t spin(_Atomic uint32_t *word, uint32_t val, bool until_eq) {
    uint32_t v = atomic_load_explicit(word, memory_order_acquire);
    if ((v == val) == until_eq) return v;
    uint64_t t0 = now_ns();
    for (unsigned i = 1;; i++) {
        cpu_relax();
        v = atomic_load_explicit(word, memory_order_acquire);
        if ((v == val) == until_eq) return v;
        if (i % CS_POOL_YIELD_EVERY == 0) {
            sched_yield();
            if (now_ns() - t0 > CS_POOL_SPIN_NS) return v;
        }
    }
}

struct cs_threadpool {
    int n_threads;          /* workers + the caller */
    int n_started;          /* workers created */
    pthread_t *threads;     /* (n_threads - 1) */
    struct worker *workers; /* (n_threads - 1) */
    struct range *ranges;   /* (n_threads), 64-byte aligned */
    /* The job; written by the caller before gen is bumped, read by whoever
     * claims a range of it (a claim proves the job still open). */
    cs_range_fn fn;
    void *arg;
    int64_t n;
    _Atomic uint32_t gen;      /* futex word: +1 per job and at shutdown */
    _Atomic int sleepers;      /* workers asleep (or going to sleep) on gen */
    _Atomic int caller_asleep; /* the caller asleep (or going to) on a done word */
    atomic_bool stop;
};

/* One range's state, on a line of its own: its owner thread and the caller
 * touch it, idle workers polling gen never do. */
struct range {
    _Alignas(64) _Atomic uint32_t claimed; /* the last job that claimed it */
    _Atomic uint32_t done;                 /* futex word: the last job that finished it */
};

static void futex_wait(_Atomic uint32_t *word, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word, int n) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

/* The i-th of t contiguous ranges of [0, n); the first n % t get one more. */
static void split(int64_t n, int t, int i, int64_t *begin, int64_t *end) {
    int64_t base = n / t, rem = n % t;
    *begin = base * i + (i < rem ? i : rem);
    *end = *begin + base + (i < rem);
}

static void run_range(cs_threadpool *pool, int i) {
    int64_t b, e;
    split(pool->n, pool->n_threads, i, &b, &e);
    if (b < e) pool->fn(pool->arg, b, e, i);
}

/* Claims range i for job g: true for the one thread that gets it. Every job
 * claims every range, so its word holds g - 1 until then; a thread still
 * working on an older job finds a newer value and claims nothing. A plain
 * read first, so a range already taken costs no exclusive line. */
static bool claim(cs_threadpool *pool, int i, uint32_t g) {
    _Atomic uint32_t *w = &pool->ranges[i].claimed;
    uint32_t expect = g - 1;
    return atomic_load_explicit(w, memory_order_relaxed) == expect &&
           atomic_compare_exchange_strong_explicit(w, &expect, g, memory_order_acquire,
                                                   memory_order_relaxed);
}

/* A worker's part of job g: its own range, then any left unclaimed. */
static void work(cs_threadpool *pool, int self, uint32_t g) {
    for (int k = 0; k < pool->n_threads; k++) {
        int i = (self + k) % pool->n_threads;
        if (i == 0 || !claim(pool, i, g)) continue; /* range 0 is the caller's */
        run_range(pool, i);
        atomic_store(&pool->ranges[i].done, g); /* seq_cst: pairs with caller_asleep */
        if (atomic_load(&pool->caller_asleep)) futex_wake(&pool->ranges[i].done, 1);
    }
}

struct worker {
    cs_threadpool *pool;
    int index; /* 1 .. n_threads-1; the caller is 0 */
};

static void *worker_main(void *p) {
    struct worker *w = p;
    cs_threadpool *pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = spin(&pool->gen, seen, false);
        if (g == seen) {
            /* seq_cst pairs with the caller's bump-then-read of sleepers:
             * either it sees us here or we see its new generation. */
            atomic_fetch_add(&pool->sleepers, 1);
            while ((g = atomic_load(&pool->gen)) == seen)
                futex_wait(&pool->gen, seen);
            atomic_fetch_sub(&pool->sleepers, 1);
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_relaxed)) break;
        work(pool, w->index, g);
    }
    return NULL;
}

/* The first two numbers of a small text file; how many were read. */
static int read_two(const char *path, long long *a, long long *b) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char w[32] = "";
    int n = fscanf(f, "%31s %lld", w, b);
    fclose(f);
    if (n < 1) return 0;
    if (!strcmp(w, "max")) { /* cgroup v2: no quota */
        *a = -1;
        return n;
    }
    *a = strtoll(w, NULL, 10);
    return n;
}

int cs_threadpool_default_size(void) {
    long n = 0;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n <= 0) n = 1;
    /* A container's CPU limit (Kubernetes resources.limits.cpu) is a CFS
     * quota, not an affinity: threads beyond it only get throttled. */
    long long quota = -1, period = 0;
    if (read_two("/sys/fs/cgroup/cpu.max", &quota, &period) != 2) { /* cgroup v2, else v1 */
        long long p = 0, unused = 0;
        quota = -1;
        if (read_two("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", &quota, &unused) < 1 ||
            read_two("/sys/fs/cgroup/cpu/cpu.cfs_period_us", &p, &unused) < 1)
            quota = -1;
        period = p;
    }
    if (quota > 0 && period > 0) {
        long limit = (long)((quota + period - 1) / period);
        if (limit >= 1 && limit < n) n = limit;
    }
    return (int)(n < 1024 ? n : 1024);
}

int cs_threadpool_init(int n_threads, cs_threadpool **out) {
    *out = NULL;
    if (n_threads <= 0) n_threads = cs_threadpool_default_size();
    if (n_threads > 1024)
        return cs_fail(CS_EINVAL, "thread pool: %d threads is more than 1024", n_threads);
    cs_threadpool *pool = calloc(1, sizeof *pool);
    if (!pool) return cs_fail(CS_ENOMEM, "thread pool: out of memory");
    pool->n_threads = n_threads;
    int r = 0;
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof *pool->threads);
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        pool->ranges = aligned_alloc(64, (size_t)n_threads * sizeof *pool->ranges);
        if (pool->ranges) memset(pool->ranges, 0, (size_t)n_threads * sizeof *pool->ranges);
        if (!pool->threads || !pool->workers || !pool->ranges) {
            r = cs_fail(CS_ENOMEM, "thread pool: out of memory for %d threads", n_threads);
            goto fail;
        }
    }
    /* Workers block every signal so that signals reach the caller's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 1; i < n_threads; i++) {
        pool->workers[i - 1] = (struct worker){pool, i};
        int e = pthread_create(&pool->threads[i - 1], NULL, worker_main, &pool->workers[i - 1]);
        if (e) {
            r = cs_fail(e == EAGAIN ? CS_EAGAIN : CS_ENOMEM,
                        "thread pool: cannot start thread %d of %d", i, n_threads);
            break;
        }
        pool->n_started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (r) goto fail;
    *out = pool;
    return 0;
fail:
    cs_threadpool_free(pool);
    return r;
}

void cs_threadpool_free(cs_threadpool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, true);
    atomic_fetch_add(&pool->gen, 1);
    futex_wake(&pool->gen, INT_MAX);
    for (int i = 0; i < pool->n_started; i++)
        pthread_join(pool->threads[i], NULL);
    free(pool->threads);
    free(pool->workers);
    free(pool->ranges);
    free(pool);
}

int cs_threadpool_size(const cs_threadpool *pool) {
    return pool ? pool->n_threads : 1;
}

void cs_threadpool_for(cs_threadpool *pool, int64_t n, cs_range_fn fn, void *arg) {
    if (n <= 0) return;
    /* With one thread, or one index (which the split gives to thread 0),
     * there is nobody to wake. */
    if (!pool || pool->n_threads == 1 || n == 1) {
        fn(arg, 0, n, 0);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    pool->n = n;
    /* Only the caller writes gen while the pool lives. seq_cst: publishes
     * the job, pairs with sleepers. */
    const uint32_t g = atomic_fetch_add(&pool->gen, 1) + 1;
    if (atomic_load(&pool->sleepers) > 0) futex_wake(&pool->gen, INT_MAX);

    /* Range 0 is the caller's alone (claimed for the word's sake). The rest:
     * whatever no worker has claimed yet, the caller runs itself. */
    atomic_store_explicit(&pool->ranges[0].claimed, g, memory_order_relaxed);
    run_range(pool, 0);
    bool theirs[1024];
    for (int i = 1; i < pool->n_threads; i++) {
        theirs[i] = !claim(pool, i, g);
        if (!theirs[i]) run_range(pool, i);
    }
    for (int i = 1; i < pool->n_threads; i++) {
        if (!theirs[i]) continue;
        _Atomic uint32_t *done = &pool->ranges[i].done;
        uint32_t d = spin(done, g, true);
        if (d == g) continue;
        atomic_store(&pool->caller_asleep, 1);
        while ((d = atomic_load(done)) != g)
            futex_wait(done, d);
        atomic_store(&pool->caller_asleep, 0);
    }
}
