/* bench_local.c: `chunkserve bench-local`: why chunked prefill exists, in one
 * process. Chat streams decode continuously while long prompts arrive on a
 * seeded Poisson schedule; for each step budget (unlimited = whole prompts,
 * then the chunked budgets) the same workload runs for --duration seconds of
 * wall time and we report the streams' inter-token latency (p50/p99), the
 * long prompts' time to first token, throughput, and how step time grows with
 * the tokens in a step. The last line printed is the p99 ITL ratio
 * unlimited / 512. Results also go to OUT/bench_local.json for plotting
 * (bench/plot_bench_local.py). Nothing here is asserted by tests. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "chunkserve/sched.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"

typedef struct {
    double *v;
    size_t n, cap;
} vec;

static void push(vec *a, double x) {
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 256;
        a->v = realloc(a->v, a->cap * sizeof *a->v);
    }
    a->v[a->n++] = x;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(vec *a, double p) {
    if (!a->n) return NAN;
    qsort(a->v, a->n, sizeof *a->v, cmp_d);
    size_t i = (size_t)(p / 100.0 * (double)(a->n - 1) + 0.5);
    return a->v[i];
}

static uint64_t rng_state;
static double urand(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

enum { MAX_STREAMS = 64, CHAT_PROMPT = 48 };
#define LONG_ID_BASE 1000000ull

typedef struct {
    int32_t budget;
    double itl_p50, itl_p99, itl_max, ttft_mean, ttft_max;
    double gen_tok_s, total_tok_s;
    int long_done, long_arrived;
    vec step_tokens, step_ms;
} result;

static int run_one(const cs_model *m, int threads, int32_t budget, double duration, int n_streams,
                   int min_long, int max_long, double rate, uint64_t seed, result *res) {
    const cs_model_config *c = cs_model_get_config(m);
    cs_engine_params ep = cs_engine_params_default();
    ep.n_threads = threads;
    ep.kv_bytes = (size_t)1536 << 20;
    cs_engine *e = NULL;
    int r = cs_engine_init(m, &ep, &e);
    if (r) return r;
    cs_sched_params sp = cs_sched_params_default();
    sp.max_num_batched_tokens = budget;
    sp.enable_prefix_caching = false; /* every long prompt is computed in full */
    cs_sched *s = NULL;
    if ((r = cs_sched_init(e, &sp, &s))) {
        cs_engine_free(e);
        return r;
    }
    rng_state = seed * 2654435761u + 1;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)max_long);
    for (int i = 0; i < max_long; i++)
        prompt[i] = 100 + (int32_t)(urand() * 20000);
    double t0 = cs_now(), last_tok[MAX_STREAMS], next_arrival = t0 + (-log(1 - urand()) / rate);
    double arrival[64];
    int n_long = 0;
    uint64_t gen = 0, computed = 0;
    vec itl = {0}, ttft = {0};
    memset(res, 0, sizeof *res);
    res->budget = budget;
    for (int i = 0; i < n_streams; i++) { /* chat streams: short prompt, long answer */
        cs_request q = {0};
        q.id = (uint64_t)i;
        q.prompt = prompt + i * 7;
        q.n_prompt = CHAT_PROMPT;
        q.sampling = cs_sampling_params_default();
        q.stop.max_tokens = 1 << 20;
        q.stop.ignore_eos = true;
        cs_sched_add(s, &q);
        last_tok[i] = -1;
    }
    while (cs_now() - t0 < duration) {
        double now = cs_now();
        if (now >= next_arrival && n_long < 64) {
            cs_request q = {0};
            q.id = LONG_ID_BASE + (uint64_t)n_long;
            q.prompt = prompt;
            q.n_prompt = min_long + (int32_t)(urand() * (max_long - min_long));
            q.sampling = cs_sampling_params_default();
            q.stop.max_tokens = 8;
            q.stop.ignore_eos = true;
            if (cs_sched_add(s, &q) == 0) arrival[n_long++] = now;
            next_arrival = now + (-log(1 - urand()) / rate);
        }
        const cs_event *ev;
        int32_t ne;
        double ts = cs_now();
        if ((r = cs_sched_step(s, &ev, &ne))) break;
        double te = cs_now();
        cs_step_info info;
        cs_sched_last_step(s, &info);
        if (info.n_tokens) {
            push(&res->step_tokens, info.n_tokens);
            push(&res->step_ms, (te - ts) * 1e3);
        }
        computed += (uint64_t)info.n_tokens;
        for (int32_t i = 0; i < ne; i++) {
            gen++;
            if (ev[i].id < LONG_ID_BASE) {
                int k = (int)ev[i].id;
                if (last_tok[k] >= 0) push(&itl, (te - last_tok[k]) * 1e3);
                last_tok[k] = te;
            } else if (ev[i].n_completion_tokens == 1) {
                push(&ttft, te - arrival[ev[i].id - LONG_ID_BASE]);
                res->long_done++;
            }
        }
    }
    double el = cs_now() - t0;
    res->long_arrived = n_long;
    res->itl_p50 = pct(&itl, 50);
    res->itl_p99 = pct(&itl, 99);
    res->itl_max = itl.n ? itl.v[itl.n - 1] : NAN;
    double sum = 0;
    for (size_t i = 0; i < ttft.n; i++)
        sum += ttft.v[i];
    res->ttft_mean = ttft.n ? sum / (double)ttft.n : NAN;
    res->ttft_max = ttft.n ? pct(&ttft, 100) : NAN;
    res->gen_tok_s = (double)gen / el;
    res->total_tok_s = (double)computed / el;
    free(itl.v), free(ttft.v), free(prompt);
    cs_sched_free(s);
    cs_engine_free(e);
    (void)c;
    return r;
}

int cs_cli_bench_local(const cs_model *m, int threads, double duration, const char *budgets_s,
                       uint64_t seed, const char *out_dir) {
    int32_t budgets[16];
    int nb = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", budgets_s);
    for (char *tok = strtok(buf, ","); tok && nb < 16; tok = strtok(NULL, ",")) {
        if (!strcmp(tok, "unlimited") || !strcmp(tok, "0"))
            budgets[nb++] = 0;
        else if (atoi(tok) > 0)
            budgets[nb++] = atoi(tok);
        else {
            fprintf(stderr, "bench-local: bad budget '%s' (numbers or 'unlimited')\n", tok);
            return 2;
        }
    }
    const int n_streams = 16, min_long = 2000, max_long = 8000;
    const double rate = 1.0 / 20.0; /* one long prompt per 20 s on average */
    result *res = calloc((size_t)nb, sizeof *res);
    printf("bench-local: %d chat streams decoding; prompts of %d-%d tokens arriving Poisson(1/%.0f "
           "s), seed %llu, "
           "%.0f s per budget\n\n",
           n_streams, min_long, max_long, 1 / rate, (unsigned long long)seed, duration);
    printf("%-10s %10s %10s %10s %10s %10s %9s %11s %11s\n", "budget", "ITL p50ms", "ITL p99ms",
           "ITL maxms", "TTFT mean", "TTFT max", "long done", "gen tok/s", "total tok/s");
    for (int i = 0; i < nb; i++) {
        if (run_one(m, threads, budgets[i], duration, n_streams, min_long, max_long, rate, seed,
                    &res[i])) {
            fprintf(stderr, "bench-local: %s\n", cs_last_error());
            return 1;
        }
        char name[16];
        snprintf(name, sizeof name, budgets[i] ? "%d" : "unlimited", budgets[i]);
        printf("%-10s %10.1f %10.1f %10.1f %9.1fs %9.1fs %5d/%-3d %11.1f %11.1f\n", name,
               res[i].itl_p50, res[i].itl_p99, res[i].itl_max, res[i].ttft_mean, res[i].ttft_max,
               res[i].long_done, res[i].long_arrived, res[i].gen_tok_s, res[i].total_tok_s);
        fflush(stdout);
    }
    /* step time against tokens per step, pooled over all runs */
    printf("\nstep time by tokens per step (all runs):\n%-14s %8s %12s\n", "tokens", "steps",
           "median ms");
    const int edges[] = {1, 17, 33, 65, 129, 257, 513, 1025, 2049, 4097, 1 << 30};
    for (int b = 0; b + 1 < (int)(sizeof edges / sizeof edges[0]); b++) {
        vec v = {0};
        for (int i = 0; i < nb; i++)
            for (size_t k = 0; k < res[i].step_tokens.n; k++)
                if (res[i].step_tokens.v[k] >= edges[b] && res[i].step_tokens.v[k] < edges[b + 1])
                    push(&v, res[i].step_ms.v[k]);
        if (v.n) printf("%6d-%-7d %8zu %12.1f\n", edges[b], edges[b + 1] - 1, v.n, pct(&v, 50));
        free(v.v);
    }
    if (out_dir) {
        char path[1024];
        snprintf(path, sizeof path, "%s/bench_local.json", out_dir);
        FILE *f = fopen(path, "w");
        if (f) {
            fprintf(f, "{\"duration\": %g, \"seed\": %llu, \"runs\": [", duration,
                    (unsigned long long)seed);
            for (int i = 0; i < nb; i++) {
                fprintf(f,
                        "%s{\"budget\": %d, \"itl_p50_ms\": %g, \"itl_p99_ms\": %g, "
                        "\"ttft_mean_s\": %g, "
                        "\"gen_tok_s\": %g, \"total_tok_s\": %g, \"steps\": [",
                        i ? ", " : "", res[i].budget, res[i].itl_p50, res[i].itl_p99,
                        isnan(res[i].ttft_mean) ? -1.0 : res[i].ttft_mean, res[i].gen_tok_s,
                        res[i].total_tok_s);
                for (size_t k = 0; k < res[i].step_tokens.n; k++)
                    fprintf(f, "%s[%g, %.3f]", k ? ", " : "", res[i].step_tokens.v[k],
                            res[i].step_ms.v[k]);
                fprintf(f, "]}");
            }
            fprintf(f, "]}\n");
            fclose(f);
            fprintf(stderr, "bench-local: wrote %s\n", path);
        }
    }
    double un = NAN, b512 = NAN;
    for (int i = 0; i < nb; i++) {
        if (res[i].budget == 0) un = res[i].itl_p99;
        if (res[i].budget == 512) b512 = res[i].itl_p99;
    }
    printf("p99 ITL ratio unlimited/512: %.2f\n", un / b512);
    for (int i = 0; i < nb; i++)
        free(res[i].step_tokens.v), free(res[i].step_ms.v);
    free(res);
    return 0;
}
