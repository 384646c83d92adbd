/* cluster.c: `chunkserve cluster up`: a whole cluster on one host, in the
 * foreground, for demos, benchmarks and development: N prefill workers, M
 * decode workers and the router on --port, each a real process (the sibling
 * binaries chunkserve-prefill, chunkserve-decode, chunkserve-router next to
 * this one). Workers start first (in parallel; each prints its ports once
 * its model is loaded), then the router with their addresses. A worker that
 * dies is restarted on the same port (the router sees its new instance id
 * and uses it again). SIGINT/SIGTERM: the router drains first, then the
 * workers; whatever outlives its grace is killed.
 * Not here: several hosts (use the Helm chart), GPUs placement. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"
#include "chunkserve/config.h"
#include "chunkserve/engine.h"
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/secret.h"

typedef struct {
    const char *model, *host, *api_key, *cors_allow_origins;
    int64_t prefill, decode, port, prefill_budget, decode_budget, prefill_threads, decode_threads;
    int64_t local_prefill_threshold, kv_cache_mib, start_timeout_ms, grace_ms, openai_port;
    bool verbose;
} cluster_opts;

#define O(f) offsetof(cluster_opts, f)
static const cs_config_entry cluster_table[] = {
    {"model", CS_CONFIG_STR, O(model), NULL,
     "model: a .gguf file or a Hugging Face directory (required)", 0, 0},
    {"host", CS_CONFIG_STR, O(host), "127.0.0.1", "address every process binds", 0, 0},
    {"port", CS_CONFIG_INT, O(port), "50050", "the router's gRPC port (the cluster's public API)",
     0, 65535},
    {"prefill", CS_CONFIG_INT, O(prefill), "1", "prefill workers", 0, 64},
    {"decode", CS_CONFIG_INT, O(decode), "1", "decode workers", 1, 64},
    {"prefill-budget", CS_CONFIG_INT, O(prefill_budget), "8192",
     "prefill workers' step token budget", 0, 1 << 30},
    {"decode-budget", CS_CONFIG_INT, O(decode_budget), "512", "decode workers' step token budget",
     0, 1 << 30},
    {"prefill-threads", CS_CONFIG_INT, O(prefill_threads), "0",
     "engine threads per prefill worker; 0 = the cores split evenly between all workers", 0, 4096},
    {"decode-threads", CS_CONFIG_INT, O(decode_threads), "0",
     "engine threads per decode worker; 0 = the cores split evenly between all workers", 0, 4096},
    {"local-prefill-threshold", CS_CONFIG_INT, O(local_prefill_threshold), "512",
     "prompts shorter than this are prefilled on the decode worker", 0, 1 << 30},
    {"kv-cache-mib", CS_CONFIG_INT, O(kv_cache_mib), "1024", "KV-cache pool per worker, MiB", 1,
     1 << 24},
    {"start-timeout-ms", CS_CONFIG_INT, O(start_timeout_ms), "300000",
     "longest a process may take to start", 1000, 3600000},
    {"grace-ms", CS_CONFIG_INT, O(grace_ms), "5000",
     "on SIGINT/SIGTERM: time streams get to finish", 0, 3600000},
    {"openai-port", CS_CONFIG_INT, O(openai_port), "-1",
     "the router's OpenAI-compatible HTTP API port (0 = any free port, -1 = off)", -1, 65535},
    {"api-key", CS_CONFIG_SECRET, O(api_key), NULL,
     "API key the router's public API requires (repeat the flag, or comma-separate, for more); "
     "handed to the router in its environment, never on a command line; none = open",
     0, 0},
    {"cors-allow-origins", CS_CONFIG_STR, O(cors_allow_origins), NULL,
     "origins (comma-separated, * = any) browsers may call the router's HTTP API from", 0, 0},
    {"verbose", CS_CONFIG_BOOL, O(verbose), "false", "debug logging in every process", 0, 0},
};
#undef O

enum { MAX_PROCS = 129 };
typedef struct {
    const char *exe;
    char *argv[48];
    int n_args;
    char argbuf[8192]; /* argv's strings, back to back (a worker list is long) */
    size_t argbuf_len;
    pid_t pid;
    int port;
    char http[300];
    char openai[300]; /* "openai listening on" (the router, with --openai-port) */
    int want_lines;   /* listening lines to read at start: 2, or 3 with openai */
    const char *role;
    int restarts;
    double last_start;
} proc;

static proc procs[MAX_PROCS];
static int n_procs;
static volatile sig_atomic_t got_signal, got_child;

static void on_signal(int sig) {
    got_signal = sig;
}
static void on_child(int sig) {
    (void)sig;
    got_child = 1;
}

static void add_arg(proc *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_arg(proc *p, const char *fmt, ...) {
    CS_ASSERT(p->n_args < 46);
    if (p->n_args == 0) p->argbuf_len = 0;
    char *dst = p->argbuf + p->argbuf_len;
    size_t cap = sizeof p->argbuf - p->argbuf_len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
    CS_ASSERT(n >= 0 && (size_t)n < cap); /* 64+64 workers' addresses fit */
    p->argbuf_len += (size_t)n + 1;
    p->argv[p->n_args] = dst;
    p->argv[++p->n_args] = NULL;
}

/* The directory of this executable, where the sibling binaries are. */
static int sibling(const char *name, char *out, size_t cap) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return cs_fail(CS_EIO, "cannot find this executable (/proc/self/exe)");
    self[n] = 0;
    char *slash = strrchr(self, '/');
    *slash = 0;
    snprintf(out, cap, "%s/%s", self, name);
    if (access(out, X_OK) != 0)
        return cs_fail(CS_ENOENT, "%s is missing (build it with make build)", out);
    return 0;
}

/* Starts p and reads "listening on H:P" and "http listening on H:P" from its
 * stdout, within the deadline. */
static int spawn(proc *p, double deadline) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return cs_fail(CS_EIO, "pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]), close(fds[1]);
        return cs_fail(CS_EIO, "fork: %s", strerror(errno));
    }
    if (pid == 0) {
        dup2(fds[1], 1);
        signal(SIGINT,
               SIG_IGN); /* a terminal's ^C reaches the whole group: we order the shutdown */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(p->exe, p->argv);
        fprintf(stderr, "chunkserve cluster: cannot run %s: %s\n", p->exe, strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    p->pid = pid;
    p->last_start = cs_now();
    char buf[1024];
    size_t len = 0;
    int lines = 0, r = 0;
    while (lines < (p->want_lines ? p->want_lines : 2)) {
        int ms = (int)((deadline - cs_now()) * 1000);
        if (ms <= 0) {
            r = cs_fail(CS_ETIMEDOUT, "%s did not start in time", p->exe);
            break;
        }
        struct pollfd pf = {fds[0], POLLIN, 0};
        int k = poll(&pf, 1, ms < 200 ? ms : 200);
        if (k < 0 && errno != EINTR) {
            r = cs_fail(CS_EIO, "poll: %s", strerror(errno));
            break;
        }
        if (got_signal) {
            r = cs_fail(CS_ECANCELED, "interrupted while starting %s", p->exe);
            break;
        }
        if (k <= 0) continue;
        ssize_t n = read(fds[0], buf + len, sizeof buf - 1 - len);
        if (n <= 0) {
            r = cs_fail(CS_EIO, "%s exited while starting (see its log above)", p->exe);
            break;
        }
        len += (size_t)n;
        buf[len] = 0;
        char *nl;
        while ((nl = strchr(buf, '\n'))) {
            *nl = 0;
            const char *colon = strrchr(buf, ':');
            if (!strncmp(buf, "listening on ", 13) && colon)
                p->port = atoi(colon + 1), lines++;
            else if (!strncmp(buf, "http listening on ", 18))
                snprintf(p->http, sizeof p->http, "%s", buf + 18), lines++;
            else if (!strncmp(buf, "openai listening on ", 20))
                snprintf(p->openai, sizeof p->openai, "%s", buf + 20), lines++;
            len -= (size_t)(nl + 1 - buf);
            memmove(buf, nl + 1, len + 1);
        }
    }
    close(fds[0]);
    return r;
}

static void stop_procs(int from, int to, int sig, double deadline) {
    for (int i = from; i < to; i++)
        if (procs[i].pid > 0) kill(procs[i].pid, sig);
    for (;;) {
        bool alive = false;
        for (int i = from; i < to; i++) {
            if (procs[i].pid <= 0) continue;
            if (waitpid(procs[i].pid, NULL, WNOHANG) == procs[i].pid)
                procs[i].pid = 0;
            else
                alive = true;
        }
        if (!alive) return;
        if (cs_now() > deadline) break;
        nanosleep(&(struct timespec){0, 20000000}, NULL);
    }
    for (int i = from; i < to; i++)
        if (procs[i].pid > 0) {
            fprintf(stderr, "chunkserve cluster: %s (pid %d) did not stop in time: killed\n",
                    procs[i].role, (int)procs[i].pid);
            kill(procs[i].pid, SIGKILL);
            waitpid(procs[i].pid, NULL, 0);
            procs[i].pid = 0;
        }
}

/* decode_list: for a prefill worker, the decode workers it may send KV pages
 * to (their gRPC addresses). */
static void worker_args(proc *p, const cluster_opts *o, const char *role, int64_t budget,
                        int64_t threads, int port, const char *decode_list) {
    p->role = role;
    p->n_args = 0;
    add_arg(p, "chunkserve-%s", role);
    add_arg(p, "--model=%s", o->model);
    add_arg(p, "--host=%s", o->host);
    add_arg(p, "--port=%d", port);
    add_arg(p, "--http-host=%s", o->host);
    add_arg(p, "--max-batched-tokens=%lld", (long long)budget);
    add_arg(p, "--threads=%lld", (long long)threads);
    add_arg(p, "--kv-cache-mib=%lld", (long long)o->kv_cache_mib);
    add_arg(p, "--grace-ms=%lld", (long long)o->grace_ms);
    if (!strcmp(role, "decode")) add_arg(p, "--kv-host=%s", o->host);
    if (decode_list && decode_list[0]) add_arg(p, "--decode-workers=%s", decode_list);
    if (o->verbose) add_arg(p, "--verbose");
}

int cs_cli_cluster(int argc, char **argv) {
    cluster_opts o;
    if (argc < 3 || strcmp(argv[2], "up") != 0) {
        fprintf(
            stderr,
            "usage: chunkserve cluster up --model PATH [--prefill N] [--decode M] [--port P] ...\n"
            "       chunkserve cluster up --help\n");
        return 2;
    }
    int r = cs_config_parse(
        cluster_table, sizeof cluster_table / sizeof cluster_table[0], &o, argc, argv, 3,
        "chunkserve cluster up",
        "a local cluster in the foreground: prefill and decode workers behind the router");
    if (r == 1) return 0;
    if (r) {
        fprintf(stderr, "chunkserve cluster: %s\n", cs_last_error());
        return 2;
    }
    if (!o.model) {
        fprintf(stderr, "chunkserve cluster: --model is required\n");
        return 2;
    }
    char prefill_exe[PATH_MAX], decode_exe[PATH_MAX], router_exe[PATH_MAX];
    if (sibling("chunkserve-prefill", prefill_exe, sizeof prefill_exe) ||
        sibling("chunkserve-decode", decode_exe, sizeof decode_exe) ||
        sibling("chunkserve-router", router_exe, sizeof router_exe)) {
        fprintf(stderr, "chunkserve cluster: %s\n", cs_last_error());
        return 1;
    }
    /* One secret for this cluster's processes (inherited through the
     * environment, never on a command line that ps shows), unless the
     * caller chose one: worker RPCs and the KV link then trust only them. */
    const char *sec = getenv("CHUNKSERVE_CLUSTER_SECRET");
    if ((!sec || !sec[0]) && !getenv("CHUNKSERVE_CLUSTER_SECRET_FILE")) {
        uint8_t raw[24];
        char hex[2 * sizeof raw + 1];
        if (cs_random_bytes(raw, sizeof raw) != 0) {
            fprintf(stderr, "chunkserve cluster: no random bytes for the cluster secret\n");
            return 1;
        }
        for (size_t i = 0; i < sizeof raw; i++)
            snprintf(hex + 2 * i, 3, "%02x", raw[i]);
        setenv("CHUNKSERVE_CLUSTER_SECRET", hex, 1);
    }
    long cores = cs_engine_default_threads();
    int64_t share = cores / (o.prefill + o.decode);
    if (share < 1) share = 1;
    int64_t pt = o.prefill_threads ? o.prefill_threads : share,
            dt = o.decode_threads ? o.decode_threads : share;

    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_child;
    sigaction(SIGCHLD, &sa, NULL);

    /* Decode workers first: each prefill worker is told their addresses (it
     * sends KV pages only to the endpoints they advertise). A process is
     * started once the one before it listens. */
    double deadline = cs_now() + (double)o.start_timeout_ms / 1000;
    n_procs = 0;
    char list[2][4096] = {"", ""}; /* prefill, decode gRPC addresses */
    int rc = 0;
    for (int64_t i = 0; i < o.decode + o.prefill && !rc; i++) {
        proc *p = &procs[n_procs++];
        bool pre = i >= o.decode;
        p->exe = pre ? prefill_exe : decode_exe;
        worker_args(p, &o, pre ? "prefill" : "decode", pre ? o.prefill_budget : o.decode_budget,
                    pre ? pt : dt, 0, pre ? list[1] : NULL);
        if ((rc = spawn(p, deadline))) break;
        char *l = list[!pre];
        snprintf(l + strlen(l), 4096 - strlen(l), "%s%s:%d", l[0] ? "," : "", o.host, p->port);
        /* a restart keeps the port the router (and the prefill workers) know */
        worker_args(p, &o, p->role, pre ? o.prefill_budget : o.decode_budget, pre ? pt : dt,
                    p->port, pre ? list[1] : NULL);
    }
    proc *router = &procs[n_procs];
    if (!rc) {
        n_procs++;
        router->exe = router_exe;
        router->role = "router";
        add_arg(router, "chunkserve-router");
        add_arg(router, "--model=%s", o.model);
        add_arg(router, "--host=%s", o.host);
        add_arg(router, "--port=%lld", (long long)o.port);
        add_arg(router, "--http-host=%s", o.host);
        if (list[0][0]) add_arg(router, "--prefill-workers=%s", list[0]);
        add_arg(router, "--decode-workers=%s", list[1]);
        add_arg(router, "--local-prefill-threshold=%lld", (long long)o.local_prefill_threshold);
        add_arg(router, "--grace-ms=%lld", (long long)o.grace_ms);
        if (o.openai_port >= 0) {
            add_arg(router, "--openai-port=%lld", (long long)o.openai_port);
            router->want_lines = 3;
        }
        if (o.cors_allow_origins && o.cors_allow_origins[0])
            add_arg(router, "--cors-allow-origins=%s", o.cors_allow_origins);
        if (o.verbose) add_arg(router, "--verbose");
        /* the keys reach the router alone, through its environment */
        if (o.api_key && o.api_key[0]) setenv("CHUNKSERVE_API_KEY", o.api_key, 1);
        rc = spawn(router, deadline);
        unsetenv("CHUNKSERVE_API_KEY");
    }
    if (rc) {
        fprintf(stderr, "chunkserve cluster: %s\n", cs_last_error());
        stop_procs(0, n_procs, SIGTERM, cs_now() + 5);
        return 1;
    }
    printf("cluster up: router %s:%d (http %s)\n", o.host, router->port, router->http);
    if (router->openai[0]) printf("openai listening on %s\n", router->openai);
    for (int i = 0; i < n_procs - 1; i++)
        printf("  %-7s %s:%d (http %s, pid %d)\n", procs[i].role, o.host, procs[i].port,
               procs[i].http, (int)procs[i].pid);
    printf("listening on %s:%d\n", o.host, router->port);
    fflush(stdout);

    while (!got_signal) {
        pause(); /* SIGCHLD or SIGINT/SIGTERM */
        if (!got_child || got_signal) continue;
        got_child = 0;
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            for (int i = 0; i < n_procs; i++) {
                proc *p = &procs[i];
                if (p->pid != pid) continue;
                p->pid = 0;
                fprintf(stderr, "chunkserve cluster: %s on port %d exited (%s %d)\n", p->role,
                        p->port, WIFSIGNALED(status) ? "signal" : "status",
                        WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
                if (p == router) {
                    got_signal = SIGTERM; /* no router, no cluster */
                    break;
                }
                if (cs_now() - p->last_start < 10 && p->restarts >= 3) {
                    fprintf(stderr, "chunkserve cluster: %s keeps failing; not restarting it\n",
                            p->role);
                    continue;
                }
                p->restarts++;
                if (spawn(p, cs_now() + (double)o.start_timeout_ms / 1000) == 0)
                    fprintf(stderr, "chunkserve cluster: %s restarted on port %d (pid %d)\n",
                            p->role, p->port, (int)p->pid);
                else
                    fprintf(stderr, "chunkserve cluster: cannot restart %s: %s\n", p->role,
                            cs_last_error());
            }
        }
    }
    fprintf(stderr, "chunkserve cluster: stopping (router first, then %d workers)\n", n_procs - 1);
    double grace = (double)o.grace_ms / 1000 + 10;
    stop_procs(n_procs - 1, n_procs, SIGTERM, cs_now() + grace);
    stop_procs(0, n_procs - 1, SIGTERM, cs_now() + grace);
    fprintf(stderr, "chunkserve cluster: stopped\n");
    return 0;
}
