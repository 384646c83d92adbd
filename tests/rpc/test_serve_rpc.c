/* test_serve_rpc.c: the layer's C client (the one the router will use)
 * against `chunkserve serve` as a separate process on loopback, on a tiny
 * random-weight model: a greedy stream of N tokens ends LENGTH with usage and
 * N ids in total (twice, same ids), temperature -1 is INVALID_ARGUMENT and the
 * server keeps serving, health Check answers SERVING, and SIGTERM makes the
 * process exit 0 (under ASan with detect_leaks that also means no leak).
 *
 * Usage: test_serve_rpc CHUNKSERVE_BIN MODEL.gguf
 *
 * Every wait has a deadline; the child is killed whenever the test gives up
 * (failed check before SIGTERM, alarm, exit) and dies with us (PDEATHSIG).
 * Not here: the Python grpcio checks of every status (tests/py/test_serve.py). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/rpc.h"
#include "chunkserve/rpc_health.h"
#include "chunkserve/v1/generation.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpc_check.h"

static int failures;
static volatile pid_t child = -1;

/* ------------------------------------------------------------- child -- */

static void kill_child(void) {
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        child = -1;
    }
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "test_serve_rpc: timed out, killing the server\n";
    (void)!write(2, msg, sizeof msg - 1);
    if (child > 0) kill(child, SIGKILL);
    _exit(1);
}

/* Starts `exe serve --model model --port 0 --threads 1` with stdout on a
 * pipe (stderr inherited: it shows in the test log) and reads the port from
 * its "listening on HOST:PORT" line within timeout_s. Returns the port, or -1
 * (the child killed). */
static int start_server(const char *exe, const char *model, double timeout_s) {
    int fds[2];
    if (pipe(fds) != 0) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execl(exe, exe, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
              "--threads", "1", "--kv-cache-mib", "8", (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", exe, strerror(errno));
        _exit(127);
    }
    child = pid;
    close(fds[1]);
    char line[256];
    size_t n = 0;
    double t0 = now_s();
    while (n < sizeof line - 1 && !memchr(line, '\n', n)) {
        int left_ms = (int)((timeout_s - (now_s() - t0)) * 1000);
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        if (left_ms <= 0 || poll(&p, 1, left_ms) <= 0) break;
        ssize_t k = read(fds[0], line + n, sizeof line - 1 - n);
        if (k <= 0) break;
        n += (size_t)k;
    }
    line[n] = 0;
    char *nl = strchr(line, '\n'); /* the first line; "http listening on" follows */
    if (nl) *nl = 0;
    /* The read end stays open (the server must not get SIGPIPE). */
    const char *colon = strrchr(line, ':');
    if (strncmp(line, "listening on ", 13) != 0 || !colon) {
        fprintf(stderr, "server did not report listening (exit or %.0f s); got \"%s\"\n", timeout_s,
                line);
        kill_child();
        return -1;
    }
    return atoi(colon + 1);
}

/* SIGTERM, then waits up to timeout_s for the exit; returns the exit status
 * (exit code, or 128 + signal), or -1 on timeout (the child killed). */
static int stop_server(double timeout_s) {
    kill(child, SIGTERM);
    double t0 = now_s();
    for (;;) {
        int st;
        pid_t r = waitpid(child, &st, WNOHANG);
        if (r == child) {
            child = -1;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (now_s() - t0 > timeout_s) {
            fprintf(stderr, "server did not exit within %.0f s of SIGTERM\n", timeout_s);
            kill_child();
            return -1;
        }
        usleep(10000);
    }
}

/* ------------------------------------------------------------ client -- */

static uv_loop_t uv;
static cs_rpc_loop *rl;
static cs_rpc_channel *chan;

static void on_timeout(uv_timer_t *t) {
    *(int *)t->data = 1;
}

/* Runs the loop until *flag is set or timeout_s passes; false on timeout.
 * Calls carry their own deadline too, so a timeout here is a layer bug. */
static bool wait_flag(const int *flag, double timeout_s) {
    int timed_out = 0;
    uv_timer_t t;
    uv_timer_init(&uv, &t);
    t.data = &timed_out;
    uv_timer_start(&t, on_timeout, (uint64_t)(timeout_s * 1000), 0);
    while (!*flag && !timed_out)
        uv_run(&uv, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&t, NULL);
    uv_run(&uv, UV_RUN_NOWAIT);
    if (!*flag) fprintf(stderr, "wait: no answer within %.0f s\n", timeout_s);
    return *flag;
}

enum { MAX_IDS = 256 };

typedef struct {
    int done, code;
    char msg[256];
    int n_msgs, n_ids;
    int32_t ids[MAX_IDS];
    int finish;    /* of the last message */
    int early_end; /* a message with finish_reason set that was not the last */
    int bad_msg;   /* undecodable response */
    int32_t n_prompt, n_completion;
} gen_result;

static void on_gen_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c;
    gen_result *r = data;
    Chunkserve__V1__GenerateResponse *m = chunkserve__v1__generate_response__unpack(NULL, len, buf);
    if (!m) {
        r->bad_msg++;
        return;
    }
    if (r->finish != CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED) r->early_end++;
    for (size_t i = 0; i < m->n_token_ids; i++) {
        if (r->n_ids < MAX_IDS) r->ids[r->n_ids] = m->token_ids[i];
        r->n_ids++;
    }
    r->finish = m->finish_reason;
    if (m->usage) {
        r->n_prompt = m->usage->prompt_tokens;
        r->n_completion = m->usage->completion_tokens;
    }
    r->n_msgs++;
    chunkserve__v1__generate_response__free_unpacked(m, NULL);
}

static void on_gen_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    (void)c;
    gen_result *r = data;
    CHECK(!r->done);
    r->done = 1;
    r->code = code;
    snprintf(r->msg, sizeof r->msg, "%s", message);
}

#define GENERATE "/chunkserve.v1.Generation/Generate"

static void generate(gen_result *r, const char *prompt, float temperature, int max_tokens) {
    memset(r, 0, sizeof *r);
    Chunkserve__V1__SamplingParams sp = CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;
    sp.temperature = temperature;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    Chunkserve__V1__GenerateRequest req = CHUNKSERVE__V1__GENERATE_REQUEST__INIT;
    req.request_id = "c-client";
    req.input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_PROMPT;
    req.prompt = (char *)prompt;
    req.sampling = &sp;
    cs_rpc_call_opts o = {.timeout_ms = 60000, .wait_for_ready = true};
    int rc =
        cs_rpc_channel_call_msg(chan, GENERATE, &req.base, &o, on_gen_msg, on_gen_done, r, NULL);
    CHECK_EQ(rc, 0);
    if (rc != 0) r->done = 1, r->code = -1;
    CHECK(wait_flag(&r->done, 90));
}

/* ------------------------------------------------------------- tests -- */

static void test_generate(void) {
    enum { N = 24 };
    gen_result a, b;
    double t0 = now_s();
    generate(&a, "hello", 0.0f, N);
    CHECK_CODE(a.code, CS_RPC_OK);
    CHECK_EQ(a.finish, CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    CHECK_EQ(a.n_completion, N);
    CHECK_EQ(a.n_ids, N);
    CHECK(a.n_prompt > 0);
    CHECK_EQ(a.early_end, 0);
    CHECK_EQ(a.bad_msg, 0);
    fprintf(stderr, "generate: %d tokens in %d messages, %.3f s, prompt %d tokens\n", a.n_ids,
            a.n_msgs, now_s() - t0, a.n_prompt);

    /* Greedy: the same ids again. */
    generate(&b, "hello", 0.0f, N);
    CHECK_CODE(b.code, CS_RPC_OK);
    CHECK_EQ(b.n_ids, N);
    CHECK(a.n_ids == b.n_ids && memcmp(a.ids, b.ids, sizeof a.ids[0] * (size_t)N) == 0);
}

static void test_bad_temperature(void) {
    gen_result r;
    generate(&r, "hello", -1.0f, 4);
    CHECK_CODE(r.code, CS_RPC_INVALID_ARGUMENT);
    CHECK(strstr(r.msg, "temperature") != NULL);
    CHECK_EQ(r.n_msgs, 0);
    fprintf(stderr, "temperature -1: %s (\"%s\")\n", cs_rpc_code_name(r.code), r.msg);

    /* The server keeps serving. */
    generate(&r, "after", 0.0f, 3);
    CHECK_CODE(r.code, CS_RPC_OK);
    CHECK_EQ(r.n_ids, 3);
}

typedef struct {
    int done, code, status, n;
} health_result;

static void on_health_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c;
    health_result *r = data;
    Grpc__Health__V1__HealthCheckResponse *m =
        grpc__health__v1__health_check_response__unpack(NULL, len, buf);
    CHECK(m != NULL);
    if (!m) return;
    r->status = m->status;
    r->n++;
    grpc__health__v1__health_check_response__free_unpacked(m, NULL);
}

static void on_health_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    (void)c, (void)message;
    health_result *r = data;
    r->done = 1;
    r->code = code;
}

static void test_health(void) {
    const char *services[] = {"", "chunkserve.v1.Generation"};
    for (int i = 0; i < 2; i++) {
        health_result r = {0};
        Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        req.service = (char *)services[i];
        cs_rpc_call_opts o = {.timeout_ms = 10000};
        CHECK_EQ(cs_rpc_channel_call_msg(chan, "/grpc.health.v1.Health/Check", &req.base, &o,
                                         on_health_msg, on_health_done, &r, NULL),
                 0);
        CHECK(wait_flag(&r.done, 20));
        CHECK_CODE(r.code, CS_RPC_OK);
        CHECK_EQ(r.n, 1);
        CHECK_EQ(r.status, CS_RPC_SERVING_SERVING);
    }
    fprintf(stderr, "health: Check SERVING\n");
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CHUNKSERVE_BIN MODEL.gguf\n", argv[0]);
        return 2;
    }
    signal(SIGALRM, on_alarm);
    signal(SIGPIPE, SIG_IGN);
    alarm(170); /* below the CTest timeout, so the child is killed by us */
    atexit(kill_child);

    int port = start_server(argv[1], argv[2], 60);
    if (port <= 0) return 1;
    fprintf(stderr, "server pid %d on 127.0.0.1:%d\n", (int)child, port);

    CHECK_EQ(uv_loop_init(&uv), 0);
    CHECK_EQ(cs_rpc_loop_init(&uv, &rl), 0);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    CHECK_EQ(cs_rpc_channel_init(rl, target, NULL, &chan), 0);

    test_generate();
    test_bad_temperature();
    test_health();

    /* SIGTERM with our channel still connected: a clean exit 0. */
    if (failures == 0) {
        double t0 = now_s();
        int st = stop_server(30);
        CHECK_EQ(st, 0);
        fprintf(stderr, "SIGTERM: exit %d after %.3f s\n", st, now_s() - t0);
    }
    kill_child();

    cs_rpc_channel_free(chan);
    cs_rpc_loop_close(rl);
    uv_run(&uv, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&uv), 0);
    if (failures) {
        fprintf(stderr, "test_serve_rpc: %d failure(s)\n", failures);
        return 1;
    }
    fprintf(stderr, "test_serve_rpc: all passed\n");
    return 0;
}
