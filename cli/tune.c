/* tune.c: `chunkserve tune`: which configuration serves a workload best on
 * this machine under a latency SLO. It starts each candidate itself (real
 * processes on loopback: `chunkserve serve` colocated, unchunked, with token
 * budgets and with step-time targets; `chunkserve cluster up` disaggregated
 * with prefill budgets and P:D ratios within --cores), measures each with
 * `chunkserve bench serve` over an ascending rate sweep that stops at the
 * first rate missing the SLO, and prints a table and the recommendation: the
 * configuration with the highest rate that met the SLO (ties: the one using
 * least of the SLO there, max of p99 TTFT / bound and p99 ITL / bound; then
 * the earlier, simpler candidate),
 * with the flags to deploy it and the per-replica prefill rate the Helm
 * chart's autoscaler needs (prefill.autoscaling.prefillTokensPerSecond).
 *
 * Deterministic given --seed: the same candidates in the same order, each
 * measured with the same requests at the same offsets; the decision then
 * depends only on what was measured. Bounded: it prints how long it can take
 * before starting; each point stops issuing after --seconds-per-point and a
 * request not done within that time counts as failed (the SLO missed).
 * Child processes' logs go to files under --log-dir.
 * Not here: several hosts, GPUs (tune each pool where it runs). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "chunkserve/config.h"
#include "chunkserve/engine.h"
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"

typedef struct {
    const char *model, *workload, *rates, *budgets, *step_targets, *ratios, *prefill_budgets;
    const char *out, *log_dir;
    double slo_ttft_ms, slo_itl_ms, seconds_per_point;
    int64_t cores, requests, seed, kv_cache_mib, decode_budget, start_timeout_ms;
    bool dry_run;
} tune_opts;

#define O(f) offsetof(tune_opts, f)
static const cs_config_entry tune_table[] = {
    {"model", CS_CONFIG_STR, O(model), NULL, "model: a .gguf file or a Hugging Face directory", 0,
     0},
    {"slo-ttft-p99-ms", CS_CONFIG_DOUBLE, O(slo_ttft_ms), "2000",
     "SLO: p99 time to first token, ms (0 = not part of the SLO)", 0, 1e9},
    {"slo-itl-p99-ms", CS_CONFIG_DOUBLE, O(slo_itl_ms), "100",
     "SLO: p99 inter-token latency, ms (0 = not part of the SLO)", 0, 1e9},
    {"workload", CS_CONFIG_STR, O(workload), "chat",
     "chat, rag, summarize, mixed, or a .jsonl dataset (as chunkserve bench serve)", 0, 0},
    {"cores", CS_CONFIG_INT, O(cores), "0",
     "cores the configurations may use (threads of serve; workers of a cluster); 0 = all", 0, 4096},
    {"rates", CS_CONFIG_STR, O(rates), "0.25,0.5,1,2,4,8,16",
     "request rates to sweep, ascending (requests/s); each sweep stops at its first miss", 0, 0},
    {"requests", CS_CONFIG_INT, O(requests), "40", "requests per rate (at most)", 1, 1000000},
    {"seconds-per-point", CS_CONFIG_DOUBLE, O(seconds_per_point), "60",
     "a rate point starts requests for at most this long; a request not done within it fails", 1,
     86400},
    {"budgets", CS_CONFIG_STR, O(budgets), "0,64,256,1024,4096,8192",
     "colocated: --max-batched-tokens values to try (0 = unchunked); none = skip", 0, 0},
    {"step-targets", CS_CONFIG_STR, O(step_targets), "auto",
     "colocated: --step-time-target-ms values to try (auto = 0.5 and 0.8 x the ITL SLO); none", 0,
     0},
    {"ratios", CS_CONFIG_STR, O(ratios), "auto",
     "disaggregated: prefill:decode worker counts, e.g. 1:1,1:2 (auto = every P:D with P + D <= "
     "--cores); none = skip",
     0, 0},
    {"prefill-budgets", CS_CONFIG_STR, O(prefill_budgets), "2048,8192",
     "disaggregated: the prefill pool's --max-batched-tokens values to try", 0, 0},
    {"decode-budget", CS_CONFIG_INT, O(decode_budget), "512",
     "disaggregated: the decode pool's --max-batched-tokens", 0, 1 << 30},
    {"kv-cache-mib", CS_CONFIG_INT, O(kv_cache_mib), "1024", "KV-cache pool per process, MiB", 1,
     1 << 24},
    {"seed", CS_CONFIG_INT, O(seed), "0", "the workload's seed (same seed: same requests)", 0, 0},
    {"start-timeout-ms", CS_CONFIG_INT, O(start_timeout_ms), "300000",
     "longest a configuration may take to start", 1000, 3600000},
    {"log-dir", CS_CONFIG_STR, O(log_dir), NULL,
     "where the processes' logs and each bench report go (default: a new /tmp directory)", 0, 0},
    {"out", CS_CONFIG_STR, O(out), NULL, "write the results as JSON here", 0, 0},
    {"dry-run", CS_CONFIG_BOOL, O(dry_run), "false",
     "print the plan and how long it can take, start nothing", 0, 0},
};
#undef O
#define N_TUNE_OPTS (sizeof tune_table / sizeof tune_table[0])

enum { MAX_CONFIGS = 64, MAX_LIST = 32 };

typedef struct {
    char name[64]; /* "serve budget 512", "P1:D1 prefill budget 8192" */
    bool disagg;
    int64_t budget; /* colocated: --max-batched-tokens; disaggregated: the prefill pool's */
    double step_ms; /* colocated: --step-time-target-ms (0 = off) */
    int prefill, decode;
    /* measured */
    bool ran, started;
    char error[256];
    double goodput_rate; /* NAN: the SLO held at no rate */
    double rps, ttft_p99, itl_p99, out_tok_s, prefill_tok_s_per_replica;
    int points;
} candidate;

/* "a,b,c" of numbers >= 0 ("none" = empty) into v. */
static int parse_numbers(const char *flag, const char *s, double *v, int *n, bool integer) {
    *n = 0;
    if (!strcmp(s, "none")) return 0;
    const char *p = s;
    while (*p) {
        char *end;
        double x = strtod(p, &end);
        if (end == p || (*end && *end != ',') || !(x >= 0) || (integer && x != floor(x)) ||
            *n == MAX_LIST)
            return cs_fail(CS_EINVAL, "--%s '%s': at most %d comma-separated %s, or none", flag, s,
                           MAX_LIST, integer ? "whole numbers >= 0" : "numbers >= 0");
        v[(*n)++] = x;
        p = *end ? end + 1 : end;
    }
    return 0;
}

static int add(candidate *c, int *n, const candidate *x) {
    if (*n == MAX_CONFIGS) return cs_fail(CS_EINVAL, "at most %d configurations", MAX_CONFIGS);
    c[*n] = *x;
    c[(*n)++].goodput_rate = NAN;
    return 0;
}

/* The candidates in their fixed order: colocated (unchunked, budgets, step
 * targets), then disaggregated (ratios x prefill budgets). */
static int plan(const tune_opts *o, int cores, candidate *c, int *n) {
    double v[MAX_LIST];
    int k, r;
    *n = 0;
    if ((r = parse_numbers("budgets", o->budgets, v, &k, true))) return r;
    for (int i = 0; i < k; i++) {
        candidate x = {.budget = (int64_t)v[i]};
        snprintf(x.name, sizeof x.name, v[i] == 0 ? "serve unchunked" : "serve budget %.0f", v[i]);
        if ((r = add(c, n, &x))) return r;
    }
    if (!strcmp(o->step_targets, "auto")) {
        k = 0;
        if (o->slo_itl_ms > 0) v[k++] = 0.5 * o->slo_itl_ms, v[k++] = 0.8 * o->slo_itl_ms;
    } else if ((r = parse_numbers("step-targets", o->step_targets, v, &k, false))) {
        return r;
    }
    for (int i = 0; i < k; i++) {
        if (!(v[i] > 0))
            return cs_fail(CS_EINVAL, "--step-targets: %g: a step-time target must be > 0 ms",
                           v[i]);
        candidate x = {.step_ms = v[i]};
        snprintf(x.name, sizeof x.name, "serve step target %g ms", v[i]);
        if ((r = add(c, n, &x))) return r;
    }
    int ratios[MAX_LIST][2], n_ratios = 0;
    if (!strcmp(o->ratios, "auto")) {
        for (int p = 1; p < cores; p++)
            for (int d = 1; p + d <= cores && n_ratios < MAX_LIST; d++)
                ratios[n_ratios][0] = p, ratios[n_ratios++][1] = d;
    } else if (strcmp(o->ratios, "none")) {
        const char *p = o->ratios;
        while (*p) {
            char *end;
            long a = strtol(p, &end, 10), b = -1;
            if (*end == ':') b = strtol(end + 1, &end, 10);
            if (a < 1 || b < 1 || a > 64 || b > 64 || (*end && *end != ',') || n_ratios == MAX_LIST)
                return cs_fail(CS_EINVAL,
                               "--ratios '%s': P:D pairs like 1:1,1:2 (1..64 workers each), "
                               "auto or none",
                               o->ratios);
            if (a + b > cores)
                return cs_fail(CS_EINVAL, "--ratios %ld:%ld needs %ld cores; --cores is %d", a, b,
                               a + b, cores);
            ratios[n_ratios][0] = (int)a, ratios[n_ratios++][1] = (int)b;
            p = *end ? end + 1 : end;
        }
    }
    if (n_ratios) {
        if ((r = parse_numbers("prefill-budgets", o->prefill_budgets, v, &k, true))) return r;
        if (k == 0) return cs_fail(CS_EINVAL, "--prefill-budgets: at least one with --ratios");
    }
    for (int i = 0; i < n_ratios; i++)
        for (int j = 0; j < k; j++) {
            candidate x = {.disagg = true,
                           .prefill = ratios[i][0],
                           .decode = ratios[i][1],
                           .budget = (int64_t)v[j]};
            snprintf(x.name, sizeof x.name, "cluster P%d:D%d prefill budget %.0f", x.prefill,
                     x.decode, v[j]);
            if ((r = add(c, n, &x))) return r;
        }
    if (*n == 0) return cs_fail(CS_EINVAL, "no configurations to try (every list is none)");
    return 0;
}

/* ---------------------------------------------------------- processes -- */

static int self_exe(char *out, size_t cap) {
    ssize_t n = readlink("/proc/self/exe", out, cap - 1);
    if (n <= 0) return cs_fail(CS_EIO, "cannot find this executable (/proc/self/exe)");
    out[n] = 0;
    return 0;
}

/* Runs argv (argv[0] the path) with stderr to log (NULL: ours). With
 * out_fd, reads its stdout until "listening on HOST:PORT" (into addr)
 * within the deadline and leaves it running, *out_fd the read end of its
 * stdout (kept open until it is stopped: a closed pipe would kill it with
 * SIGPIPE at its next line); otherwise waits for it and returns its exit
 * status in *status. */
static int run_child(char *const argv[], const char *log, int *out_fd, double deadline,
                     pid_t *pid_out, char *addr, size_t addr_cap, int *status) {
    bool want_addr = out_fd != NULL;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return cs_fail(CS_EIO, "pipe: %s", strerror(errno));
    int lf = log ? open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : dup(2);
    if (lf < 0) {
        close(fds[0]), close(fds[1]);
        return cs_fail(CS_EIO, "%s: %s", log ? log : "stderr", strerror(errno));
    }
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]), close(fds[1]), close(lf);
        return cs_fail(CS_EIO, "fork: %s", strerror(errno));
    }
    if (pid == 0) {
        if (want_addr) dup2(fds[1], 1);
        dup2(lf, 2);
        execv(argv[0], argv);
        fprintf(stderr, "chunkserve tune: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    close(lf);
    *pid_out = pid;
    int r = 0;
    if (!want_addr) {
        close(fds[0]);
        while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
        }
        *pid_out = 0;
        return 0;
    }
    char buf[4096];
    size_t len = 0;
    for (;;) {
        int ms = (int)((deadline - cs_now()) * 1000);
        if (ms <= 0) {
            r = cs_fail(CS_ETIMEDOUT, "%s did not start in time (log: %s)", argv[0], log);
            break;
        }
        struct pollfd pf = {fds[0], POLLIN, 0};
        int k = poll(&pf, 1, ms);
        if (k < 0 && errno != EINTR) {
            r = cs_fail(CS_EIO, "poll: %s", strerror(errno));
            break;
        }
        if (k <= 0) continue;
        ssize_t n = read(fds[0], buf + len, sizeof buf - 1 - len);
        if (n <= 0) {
            r = cs_fail(CS_EIO, "%s exited while starting (log: %s)", argv[0], log);
            break;
        }
        len += (size_t)n;
        buf[len] = 0;
        char *nl, *at;
        bool found = false;
        while ((nl = strchr(buf, '\n'))) {
            *nl = 0;
            if (!strncmp(buf, "listening on ", 13) && (at = buf + 13) && strchr(at, ':')) {
                snprintf(addr, addr_cap, "%s", at);
                found = true;
                break;
            }
            len -= (size_t)(nl + 1 - buf);
            memmove(buf, nl + 1, len + 1);
        }
        if (found) break;
        if (len == sizeof buf - 1) len = 0; /* a line longer than the buffer: not ours */
    }
    if (r)
        close(fds[0]);
    else
        *out_fd = fds[0];
    return r;
}

static void stop_child(pid_t pid, double grace_s) {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    double deadline = cs_now() + grace_s;
    while (cs_now() < deadline) {
        if (waitpid(pid, NULL, WNOHANG) == pid) return;
        nanosleep(&(struct timespec){0, 20000000}, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

typedef struct {
    char *argv[64];
    char buf[8192];
    size_t len;
    int n;
} args;

static void arg(args *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void arg(args *a, const char *fmt, ...) {
    CS_ASSERT(a->n < 62);
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(a->buf + a->len, sizeof a->buf - a->len, fmt, ap);
    va_end(ap);
    CS_ASSERT(k >= 0 && (size_t)k < sizeof a->buf - a->len);
    a->argv[a->n++] = a->buf + a->len;
    a->argv[a->n] = NULL;
    a->len += (size_t)k + 1;
}

/* ---------------------------------------------------------- measuring -- */

static double num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static double pct(const cJSON *o, const char *metric, const char *q) {
    return num(cJSON_GetObjectItemCaseSensitive(o, metric), q);
}

/* Reads a bench serve report into c. */
static int read_report(const char *path, candidate *c) {
    FILE *f = fopen(path, "r");
    if (!f) return cs_fail(CS_EIO, "%s: no report", path);
    char *text = NULL;
    size_t cap = 0;
    ssize_t n = getdelim(&text, &cap, 0, f);
    fclose(f);
    cJSON *rep = n > 0 ? cJSON_Parse(text) : NULL;
    free(text);
    const cJSON *pts = cJSON_GetObjectItemCaseSensitive(rep, "points");
    if (!cJSON_IsArray(pts)) {
        cJSON_Delete(rep);
        return cs_fail(CS_EBADMSG, "%s: not a bench serve report", path);
    }
    c->points = cJSON_GetArraySize(pts);
    /* the goodput point: the last one that met the SLO (rates ascend) */
    const cJSON *best = NULL;
    for (const cJSON *p = pts->child; p; p = p->next)
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(p, "slo_met"))) best = p;
    if (best) {
        const cJSON *rate = cJSON_GetObjectItemCaseSensitive(best, "rate");
        c->goodput_rate = cJSON_IsNumber(rate) ? rate->valuedouble : INFINITY;
        c->rps = num(best, "request_throughput");
        c->ttft_p99 = pct(best, "ttft_ms", "p99");
        c->itl_p99 = pct(best, "itl_ms", "p99");
        c->out_tok_s = num(best, "output_tok_s");
        double computed = num(best, "prompt_tokens") - num(best, "cached_prompt_tokens");
        int replicas = c->disagg ? c->prefill : 1;
        c->prefill_tok_s_per_replica = computed / num(best, "duration_s") / replicas;
    } else { /* the first point's figures, to show how far off it was */
        const cJSON *p = pts->child;
        c->rps = p ? num(p, "request_throughput") : NAN;
        c->ttft_p99 = p ? pct(p, "ttft_ms", "p99") : NAN;
        c->itl_p99 = p ? pct(p, "itl_ms", "p99") : NAN;
        c->out_tok_s = p ? num(p, "output_tok_s") : NAN;
        c->prefill_tok_s_per_replica = NAN;
    }
    cJSON_Delete(rep);
    return 0;
}

static void measure(const tune_opts *o, const char *self, const char *dir, int cores, int idx,
                    candidate *c) {
    args s = {0}, b = {0};
    char log[PATH_MAX], report[PATH_MAX], addr[300] = "";
    snprintf(log, sizeof log, "%s/config-%02d.log", dir, idx);
    snprintf(report, sizeof report, "%s/config-%02d.json", dir, idx);
    arg(&s, "%s", self);
    if (c->disagg) {
        arg(&s, "cluster"), arg(&s, "up");
        arg(&s, "--port=0");
        arg(&s, "--prefill=%d", c->prefill), arg(&s, "--decode=%d", c->decode);
        arg(&s, "--prefill-budget=%lld", (long long)c->budget);
        arg(&s, "--decode-budget=%lld", (long long)o->decode_budget);
        int share = cores / (c->prefill + c->decode); /* the cores split evenly */
        arg(&s, "--prefill-threads=%d", share > 0 ? share : 1);
        arg(&s, "--decode-threads=%d", share > 0 ? share : 1);
        arg(&s, "--start-timeout-ms=%lld", (long long)o->start_timeout_ms);
    } else {
        arg(&s, "serve");
        arg(&s, "--port=0"), arg(&s, "--http-port=0");
        arg(&s, "--max-batched-tokens=%lld", (long long)c->budget);
        if (c->step_ms > 0) arg(&s, "--step-time-target-ms=%g", c->step_ms);
        arg(&s, "--threads=%d", cores);
        arg(&s, "--max-queue=4096");
    }
    arg(&s, "--model=%s", o->model);
    arg(&s, "--kv-cache-mib=%lld", (long long)o->kv_cache_mib);
    pid_t pid = 0;
    int status = 0, out_fd = -1;
    c->ran = true;
    if (run_child(s.argv, log, &out_fd, cs_now() + (double)o->start_timeout_ms / 1e3, &pid, addr,
                  sizeof addr, &status)) {
        snprintf(c->error, sizeof c->error, "%s", cs_last_error());
        stop_child(pid, 5);
        return;
    }
    c->started = true;
    arg(&b, "%s", self);
    arg(&b, "bench"), arg(&b, "serve");
    arg(&b, "--target=%s", addr);
    arg(&b, "--workload=%s", o->workload);
    arg(&b, "--rates=%s", o->rates);
    arg(&b, "--requests=%lld", (long long)o->requests);
    arg(&b, "--duration=%g", o->seconds_per_point);
    arg(&b, "--timeout-ms=%.0f", o->seconds_per_point * 1e3);
    arg(&b, "--seed=%lld", (long long)o->seed);
    arg(&b, "--slo-ttft-p99-ms=%g", o->slo_ttft_ms);
    arg(&b, "--slo-itl-p99-ms=%g", o->slo_itl_ms);
    arg(&b, "--warmup=2");
    arg(&b, "--stop-after-miss");
    arg(&b, "--out=%s", report);
    pid_t bp = 0;
    /* the bench's progress lines go to our stderr */
    int r = run_child(b.argv, NULL, NULL, 0, &bp, NULL, 0, &status);
    if (r || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        snprintf(c->error, sizeof c->error, "bench serve failed (%s)",
                 r ? cs_last_error() : "see its message above");
    else if (read_report(report, c))
        snprintf(c->error, sizeof c->error, "%s", cs_last_error());
    stop_child(pid, 30);
    close(out_fd);
}

/* The SLO used at c's goodput point: the larger of p99 TTFT / its bound and
 * p99 ITL / its bound (< 1: headroom left). */
static double slo_use(const tune_opts *o, const candidate *c) {
    double u = 0;
    if (o->slo_ttft_ms > 0) u = fmax(u, c->ttft_p99 / o->slo_ttft_ms);
    if (o->slo_itl_ms > 0) u = fmax(u, c->itl_p99 / o->slo_itl_ms);
    return u;
}

/* Whether a beats b: a higher goodput rate; at the same rate (the request
 * rate measured there is then the same offered load, not a distinction)
 * more headroom under the SLO; then the earlier, simpler candidate. */
static bool better(const tune_opts *o, const candidate *a, const candidate *b) {
    if (isnan(a->goodput_rate)) return false;
    if (isnan(b->goodput_rate)) return true;
    if (a->goodput_rate != b->goodput_rate) return a->goodput_rate > b->goodput_rate;
    return slo_use(o, a) < slo_use(o, b);
}

static void print_table(const tune_opts *o, const candidate *c, int n, int best, FILE *f) {
    fprintf(f, "\n%-38s %10s %9s %10s %10s %8s %11s %14s\n", "configuration", "goodput", "req/s",
            "TTFT p99", "ITL p99", "SLO use", "output t/s", "prefill t/s/r");
    for (int i = 0; i < n; i++) {
        const candidate *x = &c[i];
        char g[32];
        if (x->error[0])
            snprintf(g, sizeof g, "error");
        else if (isnan(x->goodput_rate))
            snprintf(g, sizeof g, "none");
        else if (isinf(x->goodput_rate))
            snprintf(g, sizeof g, "inf/s");
        else
            snprintf(g, sizeof g, "%g/s", x->goodput_rate);
        fprintf(f, "%-38s %10s %9.2f %8.0fms %8.1fms %7.0f%% %11.1f %14.0f%s\n", x->name, g, x->rps,
                x->ttft_p99, x->itl_p99, 100 * slo_use(o, x), x->out_tok_s,
                x->prefill_tok_s_per_replica, i == best ? "  <= best" : "");
        if (x->error[0]) fprintf(f, "    %s\n", x->error);
    }
}

static void recommend(const tune_opts *o, const candidate *c, FILE *f) {
    fprintf(f, "\nrecommendation (workload %s, SLO p99 TTFT <= %g ms, p99 ITL <= %g ms):\n",
            o->workload, o->slo_ttft_ms, o->slo_itl_ms);
    fprintf(f, "  %s: the SLO held up to %g requests/s (%.2f requests/s measured there)\n", c->name,
            c->goodput_rate, c->rps);
    if (c->disagg) {
        fprintf(f,
                "  prefill pool: --max-batched-tokens=%lld; decode pool: "
                "--max-batched-tokens=%lld; P:D = %d:%d\n",
                (long long)c->budget, (long long)o->decode_budget, c->prefill, c->decode);
    } else {
        fprintf(f,
                "  colocated (chunkserve serve, or a decode pool prefilling locally): "
                "--max-batched-tokens=%lld",
                (long long)c->budget);
        if (c->step_ms > 0) fprintf(f, " --step-time-target-ms=%g", c->step_ms);
        fprintf(f, "\n");
    }
    fprintf(f,
            "  per-replica prefill rate for the autoscaler "
            "(prefill.autoscaling.prefillTokensPerSecond): %.0f tokens/s (computed prompt "
            "tokens/s a replica served at the goodput rate: a lower bound of what it sustains "
            "within the SLO)\n",
            c->prefill_tok_s_per_replica);
}

static cJSON *results_json(const tune_opts *o, const candidate *c, int n, int best) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "tool", "chunkserve tune");
    cJSON_AddStringToObject(j, "model", o->model);
    cJSON_AddStringToObject(j, "workload", o->workload);
    cJSON_AddNumberToObject(j, "slo_ttft_p99_ms", o->slo_ttft_ms);
    cJSON_AddNumberToObject(j, "slo_itl_p99_ms", o->slo_itl_ms);
    cJSON_AddNumberToObject(j, "seed", (double)o->seed);
    cJSON *arr = cJSON_AddArrayToObject(j, "configurations");
    for (int i = 0; i < n; i++) {
        const candidate *x = &c[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "name", x->name);
        cJSON_AddStringToObject(e, "kind", x->disagg ? "disaggregated" : "colocated");
        cJSON_AddNumberToObject(e, "max_batched_tokens", (double)x->budget);
        cJSON_AddNumberToObject(e, "step_time_target_ms", x->step_ms);
        cJSON_AddNumberToObject(e, "prefill", x->prefill);
        cJSON_AddNumberToObject(e, "decode", x->decode);
        if (isinf(x->goodput_rate))
            cJSON_AddStringToObject(e, "goodput_rate", "inf");
        else
            cJSON_AddNumberToObject(e, "goodput_rate", x->goodput_rate); /* NAN: null */
        cJSON_AddNumberToObject(e, "request_throughput", x->rps);
        cJSON_AddNumberToObject(e, "ttft_p99_ms", x->ttft_p99);
        cJSON_AddNumberToObject(e, "itl_p99_ms", x->itl_p99);
        cJSON_AddNumberToObject(e, "slo_use", slo_use(o, x));
        cJSON_AddNumberToObject(e, "output_tok_s", x->out_tok_s);
        cJSON_AddNumberToObject(e, "prefill_tok_s_per_replica", x->prefill_tok_s_per_replica);
        cJSON_AddNumberToObject(e, "points", x->points);
        if (x->error[0]) cJSON_AddStringToObject(e, "error", x->error);
        cJSON_AddItemToArray(arr, e);
    }
    if (best >= 0)
        cJSON_AddStringToObject(j, "recommended", c[best].name);
    else
        cJSON_AddNullToObject(j, "recommended");
    return j;
}

int cs_cli_tune(int argc, char **argv) {
    tune_opts o;
    int r = cs_config_parse(tune_table, N_TUNE_OPTS, &o, argc, argv, 2, "chunkserve tune",
                            "start candidate configurations on this machine, measure each with "
                            "chunkserve bench serve, recommend the one with the best goodput "
                            "under the SLO");
    if (r == 1) return 0;
    if (r) {
        fprintf(stderr, "chunkserve tune: %s\n", cs_last_error());
        return 2;
    }
    if (!o.model) {
        fprintf(stderr, "chunkserve tune: --model is required\n");
        return 2;
    }
    if (access(o.model, R_OK) != 0) {
        fprintf(stderr, "chunkserve tune: --model %s: %s\n", o.model, strerror(errno));
        return 2;
    }
    if (o.slo_ttft_ms == 0 && o.slo_itl_ms == 0) {
        fprintf(stderr, "chunkserve tune: an SLO needs --slo-ttft-p99-ms or --slo-itl-p99-ms\n");
        return 2;
    }
    int cores = o.cores ? (int)o.cores : (int)cs_engine_default_threads();
    static candidate c[MAX_CONFIGS];
    int n = 0;
    if ((r = plan(&o, cores, c, &n))) {
        fprintf(stderr, "chunkserve tune: %s\n", cs_last_error());
        return 2;
    }
    /* rates and the workload are checked by bench serve's own parser: a
     * dry run of it refuses bad ones before anything starts */
    char self[PATH_MAX];
    if (self_exe(self, sizeof self)) {
        fprintf(stderr, "chunkserve tune: %s\n", cs_last_error());
        return 1;
    }
    {
        args d = {0};
        arg(&d, "%s", self), arg(&d, "bench"), arg(&d, "serve"), arg(&d, "--dry-run");
        arg(&d, "--workload=%s", o.workload), arg(&d, "--rates=%s", o.rates);
        arg(&d, "--requests=1"), arg(&d, "--out=/dev/null");
        pid_t pid;
        int status = 0;
        if (run_child(d.argv, NULL, NULL, 0, &pid, NULL, 0, &status) || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0)
            return 2; /* bench serve said why */
    }
    int n_rates = 1;
    for (const char *p = o.rates; *p; p++)
        n_rates += *p == ',';
    double worst = n * (double)n_rates * 2 * o.seconds_per_point;
    fprintf(stderr,
            "chunkserve tune: %d configurations on %d cores, each swept over up to %d rates (a "
            "sweep stops at its first miss): at most %.0f min (each rate point <= %.0f s of "
            "requests + their %.0f s deadline), plus start-up\n",
            n, cores, n_rates, worst / 60, o.seconds_per_point, o.seconds_per_point);
    for (int i = 0; i < n; i++)
        fprintf(stderr, "  %2d. %s\n", i + 1, c[i].name);
    if (o.dry_run) return 0;

    char dir[PATH_MAX];
    if (o.log_dir) {
        snprintf(dir, sizeof dir, "%s", o.log_dir);
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "chunkserve tune: --log-dir %s: %s\n", dir, strerror(errno));
            return 2;
        }
    } else {
        snprintf(dir, sizeof dir, "/tmp/chunkserve-tune-XXXXXX");
        if (!mkdtemp(dir)) {
            fprintf(stderr, "chunkserve tune: mkdtemp: %s\n", strerror(errno));
            return 1;
        }
    }
    fprintf(stderr, "chunkserve tune: logs and reports in %s\n", dir);
    double t0 = cs_now();
    int best = -1;
    for (int i = 0; i < n; i++) {
        fprintf(stderr, "chunkserve tune: [%d/%d] %s (%.0f s so far)\n", i + 1, n, c[i].name,
                cs_now() - t0);
        measure(&o, self, dir, cores, i, &c[i]);
        if (!c[i].error[0] && (best < 0 || better(&o, &c[i], &c[best]))) best = i;
    }
    if (best >= 0 && isnan(c[best].goodput_rate)) best = -1;
    print_table(&o, c, n, best, stdout);
    if (best >= 0)
        recommend(&o, &c[best], stdout);
    else
        printf("\nno configuration met the SLO at the lowest rate; relax the SLO or lower "
               "--rates\n");
    printf("(measured in %.0f s; reports and logs in %s)\n", cs_now() - t0, dir);
    int rc = 0;
    if (o.out) {
        cJSON *j = results_json(&o, c, n, best);
        char *text = cJSON_Print(j);
        FILE *f = fopen(o.out, "w");
        if (!f || fprintf(f, "%s\n", text) < 0) {
            fprintf(stderr, "chunkserve tune: --out %s: cannot be written\n", o.out);
            rc = 1;
        }
        if (f) fclose(f);
        free(text);
        cJSON_Delete(j);
    }
    return rc;
}
