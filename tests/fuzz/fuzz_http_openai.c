/* fuzz_http_openai: fuzz driver for the public HTTP path: the HTTP/1.1
 * server (proc/src/http.c: request line, headers, chunked bodies,
 * Expect, pipelining, keep-alive), the OpenAI routes and their JSON request
 * parser, API keys and CORS (openai/, api/auth.c), and the answers they write
 * (JSON and SSE, errors). Each input is real bytes on a real loopback TCP
 * connection to a real server on a libuv loop in this process; the client
 * half-closes after sending and reads until the server closes, so a server
 * that leaves a finished client's connection open is a hang (abort after
 * 10 s). Only Generate is played here, by a small backend that answers
 * every call from its request (a few tokens, logprobs with alternatives when
 * asked, usage, or an error status chosen by max_tokens), now or from the
 * loop's next turn, so both answered-in-the-handler and cancelled-by-the-
 * client paths run. The real engine behind these routes is tested by
 * tests/py/test_openai.py.
 *
 * Input: byte 0 picks the server (bit 0: the one with an API key
 * "fuzz-key-0123" and CORS for https://a.example) and the backend's timing
 * (bit 1: answer later); the rest goes on the wire.
 * Built two ways (tests/fuzz/CMakeLists.txt): with clang's libFuzzer when
 * it works here, and with the project's compiler as a deterministic
 * mutation run over the corpus (tests/fuzz/fuzz_main.h). The model (for
 * /v1/models, the context length and token text) is the tiny test model:
 * $CS_TINY_DIR/f32/tiny.gguf.
 * Usage (fallback): fuzz_http_openai CORPUS_DIR [ITERATIONS]
 *                   fuzz_http_openai --write-corpus DIR */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "chunkserve/error.h"
#include "chunkserve/model.h"
#include "openai.h"

#define KEY "fuzz-key-0123"

static uv_loop_t loop;
static cs_openai *servers[2]; /* open, with a key and CORS */
static cs_api_keys keys;
static cs_model *model;
static cs_wire_model wm;
static bool answer_later;
static bool verbose; /* CS_FUZZ_VERBOSE=1: the answers on stderr */

/* ------------------------------------------------------- the backend -- */

typedef struct later {
    cs_gen_call *c;
    bool cancelled;
    struct later *next;
} later;
static later *pending;

/* A Generate answer from the request alone: max_tokens % 7 == 6 picks an
 * error status (the message names a field, as api/wire.c's do); else up to
 * 3 tokens, each its own message, with logprobs when asked, then usage. */
static void answer(cs_gen_call *c) {
    const Chunkserve__V1__GenerateRequest *q = c->req;
    const Chunkserve__V1__SamplingParams *s = q->sampling;
    int32_t max = s && s->max_tokens > 0 ? s->max_tokens : 3;
    if (max % 7 == 6) {
        static const int codes[] = {CS_RPC_INVALID_ARGUMENT, CS_RPC_RESOURCE_EXHAUSTED,
                                    CS_RPC_UNAVAILABLE,      CS_RPC_DEADLINE_EXCEEDED,
                                    CS_RPC_NOT_FOUND,        CS_RPC_INTERNAL};
        cs_gen_call_refuse(c, codes[(max / 7) % 6], "sampling.top_p must be in (0, 1]",
                           "sampling.top_p");
        return;
    }
    int32_t n = max < 3 ? max : 3, vocab = cs_model_get_config(model)->n_vocab;
    for (int32_t i = 0; i < n; i++) {
        Chunkserve__V1__GenerateResponse m = CHUNKSERVE__V1__GENERATE_RESPONSE__INIT;
        Chunkserve__V1__Usage u = CHUNKSERVE__V1__USAGE__INIT;
        Chunkserve__V1__TokenLogprob lp = CHUNKSERVE__V1__TOKEN_LOGPROB__INIT, top[20], *topp[20],
                                     *lpp = &lp;
        int32_t id = (int32_t)((7 * i + 3) % vocab);
        m.n_token_ids = 1, m.token_ids = &id;
        m.text = i == 1 ? "\xc3\xa9\"\\\n" : "ab";
        if (s && s->logprobs) {
            lp.token_id = id, lp.logprob = -0.5f * (float)i;
            int32_t k = s->top_logprobs < 20 ? s->top_logprobs : 20;
            for (int32_t j = 0; j < k; j++) {
                top[j] = (Chunkserve__V1__TokenLogprob)CHUNKSERVE__V1__TOKEN_LOGPROB__INIT;
                top[j].token_id = (j * 5) % vocab, top[j].logprob = -(float)j;
                topp[j] = &top[j];
            }
            lp.n_top_logprobs = (size_t)k, lp.top_logprobs = topp;
            m.n_logprobs = 1, m.logprobs = &lpp;
        }
        if (i == 0) m.request_id = "fuzz";
        if (i == n - 1) {
            m.finish_reason = max <= 3 ? CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH
                                       : CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_STOP;
            u.prompt_tokens = 5, u.completion_tokens = n, u.cached_prompt_tokens = 1;
            m.usage = &u;
        }
        if (cs_gen_call_send(c, &m)) {
            cs_gen_call_finish(c, CS_RPC_CANCELLED, "cancelled");
            return;
        }
    }
    cs_gen_call_finish(c, CS_RPC_OK, NULL);
}

static void on_cancel(cs_gen_call *c, void *arg) {
    (void)c;
    ((later *)arg)->cancelled = true;
}

static void generate(void *arg, cs_gen_call *c) {
    (void)arg;
    if (!answer_later) {
        answer(c);
        return;
    }
    later *l = calloc(1, sizeof *l);
    if (!l) {
        cs_gen_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    l->c = c;
    if (cs_gen_call_on_cancel(c, on_cancel, l)) l->cancelled = true;
    l->next = pending, pending = l;
}

/* Answers (or ends, when cancelled) every call left for later. */
static void answer_pending(void) {
    while (pending) {
        later *l = pending;
        pending = l->next;
        if (l->cancelled)
            cs_gen_call_finish(l->c, CS_RPC_CANCELLED, "cancelled");
        else
            answer(l->c);
        free(l);
    }
}

/* -------------------------------------------------------- the client -- */

typedef struct {
    const uint8_t *data;
    size_t len, sent;
    bool shut, done;
} client;

static void on_poll(uv_poll_t *p, int status, int events) {
    client *cl = p->data;
    int fd;
    uv_fileno((uv_handle_t *)p, &fd);
    if (status < 0) events = UV_READABLE; /* the error shows on recv */
    if ((events & UV_WRITABLE) && !cl->shut) {
        while (cl->sent < cl->len) {
            ssize_t w = send(fd, cl->data + cl->sent, cl->len - cl->sent, MSG_NOSIGNAL);
            if (w < 0 && errno == EINTR) continue;
            if (w < 0 && errno == EAGAIN) return;
            if (w < 0) break; /* the server closed early (431, 413): read what it said */
            cl->sent += (size_t)w;
        }
        shutdown(fd, SHUT_WR);
        cl->shut = true;
        uv_poll_start(p, UV_READABLE, on_poll);
    }
    if (events & UV_READABLE) {
        char buf[65536];
        for (;;) {
            ssize_t r = recv(fd, buf, sizeof buf, 0);
            if (r > 0 && verbose) fwrite(buf, 1, (size_t)r, stderr);
            if (r > 0) continue;
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && errno == EAGAIN) return;
            if (verbose) fprintf(stderr, "\n[end: %zd %s]\n", r, r < 0 ? strerror(errno) : "eof");
            cl->done = true; /* the server's end (or a reset) */
            uv_poll_stop(p);
            return;
        }
    }
}

static void on_hang(uv_timer_t *t) {
    (void)t;
    fprintf(stderr, "fuzz_http_openai: the server kept a finished client's connection 10 s\n");
    abort();
}

static void run_input(int port, const uint8_t *data, size_t len) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) abort();
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) && errno != EINPROGRESS) abort();
    client cl = {.data = data, .len = len};
    uv_poll_t poll;
    uv_timer_t hang;
    if (uv_poll_init_socket(&loop, &poll, fd)) abort();
    poll.data = &cl;
    uv_poll_start(&poll, UV_READABLE | UV_WRITABLE, on_poll);
    uv_timer_init(&loop, &hang);
    uv_timer_start(&hang, on_hang, 10000, 0);
    while (!cl.done) {
        uv_run(&loop, UV_RUN_ONCE);
        answer_pending();
    }
    uv_close((uv_handle_t *)&poll, NULL);
    uv_close((uv_handle_t *)&hang, NULL);
    uv_run(&loop, UV_RUN_NOWAIT); /* the close callbacks; the server's own as well */
    answer_pending();
    close(fd);
}

/* ---------------------------------------------------------- the driver -- */

static void setup(void) {
    const char *dir = getenv("CS_TINY_DIR"), *v = getenv("CS_FUZZ_VERBOSE");
    verbose = v && *v == '1';
    static char path[1024]; /* wm borrows it */
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", dir ? dir : "build/test-tmp/tiny");
    if (cs_model_load(path, &model)) {
        fprintf(stderr, "fuzz_http_openai: cannot load %s (set CS_TINY_DIR): %s\n", path,
                cs_last_error());
        exit(2);
    }
    cs_wire_model_init(&wm, model, path);
    wm.n_kv_pages = 64, wm.page_size = 16;
    if (uv_loop_init(&loop) || cs_api_keys_load(KEY, NULL, &keys)) abort();
    for (int i = 0; i < 2; i++) {
        cs_openai_opts o = {.host = "127.0.0.1",
                            .wm = &wm,
                            .generate = generate,
                            .max_request_bytes = 4096,
                            .api_keys = i ? &keys : NULL,
                            .cors_allow_origins = i ? "https://a.example" : NULL};
        if (cs_openai_start(&loop, &o, &servers[i])) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!model) setup();
    if (!size) return 0;
    answer_later = data[0] & 2;
    if (verbose) fprintf(stderr, "\n[input %zu bytes, mode %d: %.40s]\n", size, data[0], data + 1);
    run_input(cs_openai_port(servers[data[0] & 1]), data + 1, size - 1);
    return 0;
}

#ifndef CS_LIBFUZZER
/* The seeds: every route, the request shapes the parser knows, and the
 * HTTP framings the server takes. */
static int fuzz_write_corpus(const char *dir) {
    static const struct {
        const char *name;
        uint8_t mode;
        const char *body; /* NULL: the request is whole in head */
        const char *head;
    } seeds[] = {
        {"chat", 0,
         "{\"model\":\"chunkserve tiny test "
         "model\",\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
         "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}],"
         "\"max_tokens\":3,\"temperature\":0,\"logprobs\":true,\"top_logprobs\":2}",
         "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"},
        {"chat-stream", 2,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":true,"
         "\"stream_options\":{\"include_usage\":true},\"n\":2,\"seed\":7,\"stop\":[\"a\",\"b\"],"
         "\"max_completion_tokens\":5,\"top_k\":4,\"min_p\":0.1,\"min_tokens\":1}",
         "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"},
        {"completions", 0,
         "{\"model\":\"tiny.gguf\",\"prompt\":[\"one\",\"two\"],\"max_tokens\":2,\"logprobs\":2,"
         "\"echo\":false,\"stop_token_ids\":[1,2],\"ignore_eos\":true,\"user\":\"u\"}",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"},
        {"completions-ids", 2,
         "{\"prompt\":[[1,2,3],[4,5]],\"max_tokens\":13,\"stream\":true,\"presence_penalty\":1,"
         "\"frequency_penalty\":-1,\"repetition_penalty\":1.2,\"top_p\":0.9}",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"},
        {"error", 0, "{\"prompt\":\"x\",\"max_tokens\":6,\"logit_bias\":{\"1\":2},\"a\":1,\"a\":2}",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"},
        {"models", 1, NULL,
         "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " KEY "\r\n\r\n"
         "GET /v1/models/tiny HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n"
         "DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"},
        {"cors", 1, NULL,
         "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://a.example\r\n"
         "Access-Control-Request-Method: POST\r\n\r\n"},
        {"chunked", 3, NULL,
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " KEY "\r\n"
         "Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
         "b\r\n{\"prompt\":\"\r\na\r\nhi\",\"n\":3}\r\n0\r\n\r\n"},
        {"http10", 0, NULL, "GET /v1/models HTTP/1.0\r\n\r\nGARBAGE / HTTP/9.9\r\n\r\n"},
    };
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, seeds[i].name);
        FILE *f = fopen(path, "wb");
        if (!f) return 1;
        fputc(seeds[i].mode, f);
        fputs(seeds[i].head, f);
        if (seeds[i].body)
            fprintf(f, "Content-Length: %zu\r\n\r\n%s", strlen(seeds[i].body), seeds[i].body);
        fclose(f);
    }
    return 0;
}
#endif

#include "fuzz_main.h"
