/* bench_serve.c: `chunkserve bench serve --target HOST:PORT`: a load
 * generator for any running deployment that speaks chunkserve.v1.Generation
 * (one `chunkserve serve`, the router of a local cluster, a cluster on
 * Kubernetes), like `vllm bench serve`.
 *
 * One libuv loop, the RPC layer's client (net/): requests start on their
 * seeded schedule (loadgen.h), each a server-streaming Generate of token
 * ids (or a dataset's text), greedy unless --temperature, ignore_eos so
 * outputs have the lengths asked for. Every token message is timed on
 * arrival. For each point of the sweep (--rates for open-loop arrivals,
 * --concurrency for closed-loop) it reports TTFT, TPOT, ITL and end-to-end
 * latency (mean/p50/p90/p99/max; numpy's percentile definition, stats.h),
 * request and token throughput, cached prompt tokens, errors by status and
 * whether the SLO held; over the sweep, the goodput: the highest offered
 * rate at which the SLO held and the request throughput measured there.
 * JSON on stdout or --out (bench/plot_bench_serve.py draws it), progress on
 * stderr. ITL is the gap between two token messages of a stream (a message
 * carrying k > 1 tokens counts once: what a client sees).
 *
 * The client costs little: a loop thread that unpacks one small message
 * per token (the tool keeps up with thousands of tokens/s on one core; the
 * report states the client's own CPU time).
 * An http://HOST:PORT target is measured through its OpenAI-compatible API
 * instead (bench_http.h: POST /v1/completions, streamed, one connection a
 * request): a choice chunk is a token message, the usage chunk gives the
 * counts, HTTP statuses are counted under the gRPC code of the same
 * meaning (429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, ...).
 * Not here: chat-completions requests, multi-turn sessions, TLS for http. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <uv.h>

#include "bench.h"
#include "bench_http.h"
#include "loadgen.h"
#include "stats.h"
#include "chunkserve/config.h"
#include "chunkserve/rpc.h"
#include "chunkserve/v1/generation.pb-c.h"
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"

typedef struct {
    const char *target, *workload, *arrival, *rates, *concurrency, *out, *model, *cache_salt;
    const char *tenants;
    const char *api_key, *ca_file, *cert_file, *key_file, *server_name;
    double burstiness, duration, temperature, slo_ttft_ms, slo_itl_ms;
    int64_t requests, max_concurrency, seed, prefix_groups, prefix_tokens, timeout_ms;
    int64_t connect_timeout_ms, warmup, vocab_size;
    bool save_requests, dry_run, no_ignore_eos, quiet, stop_after_miss;
} serve_opts;

#define O(f) offsetof(serve_opts, f)
static const cs_config_entry serve_table[] = {
    {"target", CS_CONFIG_STR, O(target), NULL,
     "HOST:PORT of the deployment's gRPC API (or dns:///NAME:PORT), or http://HOST:PORT of its "
     "OpenAI-compatible API (/v1/completions, streamed)",
     0, 0},
    {"vocab-size", CS_CONFIG_INT, O(vocab_size), "0",
     "http targets that do not report vocab_size in /v1/models: the model's vocabulary (token-id "
     "prompts draw from it)",
     0, 1 << 30},
    {"workload", CS_CONFIG_STR, O(workload), "chat",
     "chat, rag, summarize, mixed, or a .jsonl dataset (see --help text)", 0, 0},
    {"arrival", CS_CONFIG_STR, O(arrival), "poisson",
     "poisson, gamma (with --burstiness), fixed, or closed (--concurrency in flight)", 0, 0},
    {"rates", CS_CONFIG_STR, O(rates), "inf",
     "request rates to sweep, requests/s, comma-separated (inf = all at once)", 0, 0},
    {"burstiness", CS_CONFIG_DOUBLE, O(burstiness), "1",
     "gamma arrivals' shape: < 1 burstier than Poisson, 1 = Poisson", 0.01, 100},
    {"concurrency", CS_CONFIG_STR, O(concurrency), "1",
     "closed arrivals: requests in flight to sweep, comma-separated", 0, 0},
    {"max-concurrency", CS_CONFIG_INT, O(max_concurrency), "0",
     "open arrivals: at most this many in flight (later arrivals wait); 0 = no cap", 0, 1 << 20},
    {"requests", CS_CONFIG_INT, O(requests), "100", "requests per sweep point", 1, 10000000},
    {"duration", CS_CONFIG_DOUBLE, O(duration), "0",
     "stop starting requests of a point after this many seconds; 0 = no limit", 0, 1e7},
    {"seed", CS_CONFIG_INT, O(seed), "0", "the workload's and the arrivals' seed", 0, 0},
    {"prefix-groups", CS_CONFIG_INT, O(prefix_groups), "0",
     "shared-prefix groups: each request joins one at random; 0 = none", 0, 1 << 20},
    {"prefix-tokens", CS_CONFIG_INT, O(prefix_tokens), "0",
     "tokens of each group's shared prompt head (before the request's own)", 0, 1 << 24},
    {"temperature", CS_CONFIG_DOUBLE, O(temperature), "0", "sampling temperature; 0 = greedy", 0,
     100},
    {"no-ignore-eos", CS_CONFIG_BOOL, O(no_ignore_eos), "false",
     "stop at end-of-generation tokens (outputs may then be shorter than asked)", 0, 0},
    {"cache-salt", CS_CONFIG_STR, O(cache_salt), NULL, "every request's cache_salt", 0, 0},
    {"tenants", CS_CONFIG_STR, O(tenants), NULL,
     "a mix of tenants: NAME=WEIGHT[:WORKLOAD[:PRIORITY]],... (each request draws one by "
     "weight; a tenant may draw its lengths from the built-in chat, rag or summarize and send "
     "its priority); sent as GenerateRequest.tenant / X-Chunkserve-Tenant; the report gives "
     "each tenant's and priority's latencies and Jain's index over the tenants' tokens",
     0, 0},
    /* not "model": CHUNKSERVE_MODEL is every server's model path */
    {"served-model-name", CS_CONFIG_STR, O(model), NULL,
     "the model name to ask for, as the target lists it (default: the first one)", 0, 0},
    {"slo-ttft-p99-ms", CS_CONFIG_DOUBLE, O(slo_ttft_ms), "2000",
     "SLO: p99 time to first token, ms (0 = not part of the SLO)", 0, 1e9},
    {"slo-itl-p99-ms", CS_CONFIG_DOUBLE, O(slo_itl_ms), "100",
     "SLO: p99 inter-token latency, ms (0 = not part of the SLO)", 0, 1e9},
    {"timeout-ms", CS_CONFIG_INT, O(timeout_ms), "600000", "each request's deadline", 1, 86400000},
    {"connect-timeout-ms", CS_CONFIG_INT, O(connect_timeout_ms), "30000",
     "how long to wait for the target at start", 1, 3600000},
    {"warmup", CS_CONFIG_INT, O(warmup), "1",
     "requests sent one at a time before the sweep, not measured (connections, page faults)", 0,
     1000},
    {"stop-after-miss", CS_CONFIG_BOOL, O(stop_after_miss), "false",
     "end the sweep at the first point that misses the SLO (rates ascending)", 0, 0},
    {"out", CS_CONFIG_STR, O(out), NULL, "write the JSON report here (default: stdout)", 0, 0},
    {"save-requests", CS_CONFIG_BOOL, O(save_requests), "false",
     "the report also lists every request (lengths, TTFT, every ITL sample)", 0, 0},
    {"dry-run", CS_CONFIG_BOOL, O(dry_run), "false",
     "print the first point's schedule (arrival offsets, lengths) as JSON; no target", 0, 0},
    {"quiet", CS_CONFIG_BOOL, O(quiet), "false", "no progress lines on stderr", 0, 0},
    {"api-key", CS_CONFIG_SECRET, O(api_key), NULL, "sent as authorization: Bearer KEY", 0, 0},
    {"tls-ca-file", CS_CONFIG_STR, O(ca_file), NULL, "TLS: the roots the target must chain to", 0,
     0},
    {"tls-cert-file", CS_CONFIG_STR, O(cert_file), NULL, "TLS: this client's certificate (mTLS)", 0,
     0},
    {"tls-key-file", CS_CONFIG_STR, O(key_file), NULL, "TLS: its private key", 0, 0},
    {"tls-server-name", CS_CONFIG_STR, O(server_name), NULL,
     "TLS: the name the target's certificate must carry", 0, 0},
};
#undef O
#define N_SERVE_OPTS (sizeof serve_table / sizeof serve_table[0])

#define GENERATE "/chunkserve.v1.Generation/Generate"

/* ------------------------------------------------------------- sweep -- */

enum { MAX_POINTS = 64 };

/* "1,2.5,inf" into vals; integer sweeps (concurrency) also refuse fractions. */
static int parse_list(const char *flag, const char *s, bool integer, double *vals, int *n) {
    *n = 0;
    const char *p = s;
    while (*p) {
        if (*n == MAX_POINTS)
            return cs_fail(CS_EINVAL, "--%s: at most %d values", flag, MAX_POINTS);
        char *end;
        double v =
            !integer && !strncmp(p, "inf", 3) ? (end = (char *)p + 3, INFINITY) : strtod(p, &end);
        if (end == p || (*end && *end != ',') || !(v > 0) || (integer && v != floor(v)) ||
            (integer && v > (1 << 20)))
            return cs_fail(CS_EINVAL, "--%s '%s': a comma-separated list of %s", flag, s,
                           integer ? "whole numbers in [1, 1048576]"
                                   : "rates > 0 in requests/s, or inf");
        vals[(*n)++] = v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) return cs_fail(CS_EINVAL, "--%s: no values", flag);
    return 0;
}

/* ----------------------------------------------------------- requests -- */

typedef struct bench bench;

typedef struct {
    bench *b;
    int idx;
    double t_send, t_first, t_last; /* cs_now() */
    int32_t n_out, n_msgs, prompt_tokens, cached;
    double predicted_ttft; /* the target's prediction (Usage.predicted_ttft_seconds), s; 0: none */
    int code; /* -1 while running */
    bool started;
    char *error; /* the first failed request of each code keeps its message */
    cs_samples itl_ms;
} req_state;

struct bench {
    const serve_opts *o;
    const cs_lg_workload *w;
    uv_loop_t uv;
    cs_rpc_loop *rl;
    cs_rpc_channel *ch;
    cs_rpc_metadata md[1];
    size_t n_md;
    char auth[600];
    bool http; /* an OpenAI-compatible target */
    struct sockaddr_storage addr;
    char host[300], http_headers[700];
    /* the model */
    char model_name[256];
    int32_t ctx_len, vocab;
    /* this point */
    const cs_lg_request *sched;
    req_state *reqs;
    size_t n, next, n_done, n_failed, in_flight;
    size_t cap;  /* in flight at most (closed: the concurrency); 0 = none */
    bool closed; /* start the next request as one ends */
    double t0, stop_issuing_at;
    int32_t *ids; /* prompt buffer: ctx_len */
    uv_timer_t arrive, progress;
    int point;
};

static void start_due(bench *b);

static void on_gen_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c;
    req_state *r = data;
    double now = cs_now();
    Chunkserve__V1__GenerateResponse *m = chunkserve__v1__generate_response__unpack(NULL, len, buf);
    if (!m) return; /* the RPC layer's peer sent garbage: the status will say so */
    if (m->n_token_ids > 0) {
        if (r->n_out == 0)
            r->t_first = now;
        else
            cs_samples_push(&r->itl_ms, (now - r->t_last) * 1e3);
        r->t_last = now;
        r->n_out += (int32_t)m->n_token_ids;
        r->n_msgs++;
    }
    if (m->usage) {
        r->prompt_tokens = m->usage->prompt_tokens;
        r->cached = m->usage->cached_prompt_tokens;
        r->predicted_ttft = m->usage->predicted_ttft_seconds;
    }
    chunkserve__v1__generate_response__free_unpacked(m, NULL);
}

static void request_done(req_state *r, int code, const char *message) {
    bench *b = r->b;
    r->code = code;
    if (code != CS_RPC_OK) {
        r->error = strdup(message ? message : "");
        b->n_failed++;
    }
    if (r->n_out == 0) r->t_last = cs_now(); /* the end, for its latency */
    b->n_done++;
    b->in_flight--;
    start_due(b);
}

static void on_gen_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    (void)c;
    request_done(data, code, message);
}

/* The prompt tokens' seed of this point: each point of a sweep has prompts
 * of its own (same lengths, other tokens), or an earlier point's would sit
 * in the target's prefix cache and flatter the later ones; a point's
 * shared-prefix groups are its own too. */
static uint64_t point_seed(const bench *b) {
    return (uint64_t)b->o->seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(b->point + 2));
}

/* ------------------------------------------------------- OpenAI (HTTP) -- */

/* One SSE event of /v1/completions: a choice chunk is a token message (the
 * closing chunk with only a finish_reason is not), the usage chunk the
 * counts, an error event the reason. */
static void on_sse(void *user, const char *data, size_t len) {
    req_state *r = user;
    double now = cs_now();
    cJSON *j = cJSON_ParseWithLength(data, len);
    if (!j) return;
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
    if (err && !r->error) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(err, "message");
        r->error = strdup(cJSON_IsString(m) ? m->valuestring : "error event");
    }
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
    if (ch) {
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(ch, "text");
        const cJSON *fin = cJSON_GetObjectItemCaseSensitive(ch, "finish_reason");
        bool token = (cJSON_IsString(text) && text->valuestring[0]) || !cJSON_IsString(fin);
        if (token) {
            if (r->n_msgs == 0)
                r->t_first = now;
            else
                cs_samples_push(&r->itl_ms, (now - r->t_last) * 1e3);
            r->t_last = now;
            r->n_msgs++;
            r->n_out = r->n_msgs; /* until the usage says */
        }
    }
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
    if (cJSON_IsObject(u)) {
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens");
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(u, "completion_tokens");
        const cJSON *det = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens_details");
        const cJSON *cached = cJSON_GetObjectItemCaseSensitive(det, "cached_tokens");
        if (cJSON_IsNumber(pt)) r->prompt_tokens = pt->valueint;
        if (cJSON_IsNumber(ct)) r->n_out = ct->valueint;
        if (cJSON_IsNumber(cached)) r->cached = cached->valueint;
    }
    cJSON_Delete(j);
}

/* HTTP status -> the gRPC code the report counts it under (one vocabulary
 * for both doors, as docs/architecture.md maps them). */
static int code_of_http(int status) {
    switch (status) {
    case 200: return CS_RPC_OK;
    case 400:
    case 404:
    case 413:
    case 422: return CS_RPC_INVALID_ARGUMENT;
    case 401:
    case 403: return CS_RPC_UNAUTHENTICATED;
    case 408:
    case 504: return CS_RPC_DEADLINE_EXCEEDED;
    case 429: return CS_RPC_RESOURCE_EXHAUSTED;
    case 0:
    case 502:
    case 503: return CS_RPC_UNAVAILABLE;
    default: return CS_RPC_INTERNAL;
    }
}

static void on_http_done(void *user, int status, const char *msg) {
    req_state *r = user;
    int code = code_of_http(status);
    if (status == 0 && !strcmp(msg, "deadline exceeded")) code = CS_RPC_DEADLINE_EXCEEDED;
    if (code == CS_RPC_OK && r->error) code = CS_RPC_INTERNAL; /* an error event mid-stream */
    char *event_error = r->error; /* the reason a failed request keeps (request_done copies) */
    r->error = NULL;
    request_done(r, code, event_error ? event_error : msg);
    free(event_error);
}

/* q's tenant (--tenants, or its dataset line's), NULL when none. */
static const char *tenant_of(const bench *b, const cs_lg_request *q) {
    if (q->tenant >= 0) return b->w->tenants[q->tenant].name;
    return q->line >= 0 ? b->w->lines[q->line].tenant : NULL;
}

static int start_http(bench *b, req_state *r, const cs_lg_request *q, const cs_lg_line *line) {
    const serve_opts *o = b->o;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "model", b->model_name);
    if (line && line->text) {
        cJSON_AddStringToObject(j, "prompt", line->text);
    } else {
        const int32_t *ids = line && line->ids ? line->ids : b->ids;
        if (!(line && line->ids))
            cs_lg_prompt_ids(q, point_seed(b), b->vocab / 8, b->vocab, b->ids);
        cJSON *arr = cJSON_AddArrayToObject(j, "prompt");
        for (int32_t i = 0; i < q->prompt_len; i++)
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    }
    cJSON_AddNumberToObject(j, "max_tokens", q->output_len);
    cJSON_AddNumberToObject(j, "temperature", o->temperature);
    cJSON_AddNumberToObject(j, "seed", r->idx);
    cJSON_AddBoolToObject(j, "ignore_eos", !o->no_ignore_eos);
    cJSON_AddBoolToObject(j, "stream", true);
    cJSON_AddBoolToObject(cJSON_AddObjectToObject(j, "stream_options"), "include_usage", true);
    if (o->cache_salt) cJSON_AddStringToObject(j, "cache_salt", o->cache_salt);
    if (q->priority) cJSON_AddNumberToObject(j, "priority", q->priority);
    char *body = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!body) return cs_fail(CS_ENOMEM, "out of memory");
    char headers[sizeof b->http_headers + 100];
    const char *tenant = tenant_of(b, q);
    snprintf(headers, sizeof headers, "%s%s%s%s", b->http_headers,
             tenant ? "X-Chunkserve-Tenant: " : "", tenant ? tenant : "", tenant ? "\r\n" : "");
    cs_http_client_cbs cbs = {on_sse, on_http_done};
    int rc = cs_http_client_request(&b->uv, (const struct sockaddr *)&b->addr, b->host, "POST",
                                    "/v1/completions", headers, body, strlen(body),
                                    (double)o->timeout_ms / 1e3, &cbs, r);
    free(body);
    return rc;
}

/* The Generate call of request q over gRPC. */
static int start_grpc(bench *b, req_state *r, const cs_lg_request *q, const cs_lg_line *line) {
    const serve_opts *o = b->o;
    Chunkserve__V1__SamplingParams sp = CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;
    sp.temperature = (float)o->temperature;
    sp.seed = (uint64_t)r->idx;
    sp.max_tokens = q->output_len;
    sp.ignore_eos = !o->no_ignore_eos;
    sp.priority = q->priority;
    Chunkserve__V1__GenerateRequest req = CHUNKSERVE__V1__GENERATE_REQUEST__INIT;
    const char *tenant = tenant_of(b, q);
    req.tenant = (char *)(tenant ? tenant : "");
    char id[64];
    snprintf(id, sizeof id, "bench-%d-%d", b->point, r->idx);
    req.request_id = id;
    req.model = (char *)(o->model ? o->model : "");
    req.cache_salt = (char *)(o->cache_salt ? o->cache_salt : "");
    req.sampling = &sp;
    Chunkserve__V1__TokenIds tids = CHUNKSERVE__V1__TOKEN_IDS__INIT;
    if (line && line->text) {
        req.input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_PROMPT;
        req.prompt = line->text;
    } else {
        if (line && line->ids) {
            tids.ids = line->ids;
        } else {
            cs_lg_prompt_ids(q, point_seed(b), b->vocab / 8, b->vocab, b->ids);
            tids.ids = b->ids;
        }
        tids.n_ids = (size_t)q->prompt_len;
        req.input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
        req.token_ids = &tids;
    }
    cs_rpc_call_opts co = {.timeout_ms = o->timeout_ms, .metadata = b->md, .n_metadata = b->n_md};
    return cs_rpc_channel_call_msg(b->ch, GENERATE, &req.base, &co, on_gen_msg, on_gen_done, r,
                                   NULL);
}

static int start_one(bench *b, req_state *r) {
    const cs_lg_request *q = &b->sched[r->idx];
    const cs_lg_line *line = q->line >= 0 ? &b->w->lines[q->line] : NULL;
    r->started = true;
    r->code = -1;
    r->t_send = cs_now();
    b->in_flight++;
    int rc = b->http ? start_http(b, r, q, line) : start_grpc(b, r, q, line);
    if (rc) { /* counted as failed, with the layer's reason */
        b->in_flight--;
        r->code = CS_RPC_INTERNAL;
        r->t_last = cs_now();
        r->error = strdup(cs_last_error());
        b->n_failed++;
        b->n_done++;
    }
    return rc;
}

static void on_arrive(uv_timer_t *t) {
    start_due(t->data);
}

/* Starts every request that is due (its offset passed, a slot free), then
 * arms the timer for the next one. */
static void start_due(bench *b) {
    double now = cs_now();
    if (now >= b->stop_issuing_at && b->next < b->n) b->n = b->next; /* --duration is over */
    while (b->next < b->n && (b->cap == 0 || b->in_flight < b->cap)) {
        if (!b->closed && b->t0 + b->sched[b->next].offset_s > now) break;
        req_state *r = &b->reqs[b->next];
        r->idx = (int)b->next++;
        start_one(b, r);
    }
    uv_timer_stop(&b->arrive);
    if (b->next < b->n && !b->closed && (b->cap == 0 || b->in_flight < b->cap)) {
        double due = b->t0 + b->sched[b->next].offset_s;
        if (b->stop_issuing_at < due) due = b->stop_issuing_at;
        uv_timer_start(&b->arrive, on_arrive, (uint64_t)ceil(fmax(0, due - now) * 1e3), 0);
    }
}

static void on_progress(uv_timer_t *t) {
    bench *b = t->data;
    fprintf(stderr, "bench serve: point %d: %.0f s, %zu/%zu done, %zu in flight, %zu failed\n",
            b->point, cs_now() - b->t0, b->n_done, b->n, b->in_flight, b->n_failed);
}

/* ------------------------------------------------------------ report -- */

static cJSON *summary_json(cs_samples *s) {
    cs_summary m = cs_samples_summary(s);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "n", (double)m.n);
    cJSON_AddNumberToObject(j, "mean", m.mean);
    cJSON_AddNumberToObject(j, "p50", m.p50);
    cJSON_AddNumberToObject(j, "p90", m.p90);
    cJSON_AddNumberToObject(j, "p99", m.p99);
    cJSON_AddNumberToObject(j, "max", m.max);
    return j;
}

/* cJSON_CreateDoubleArray answers NULL (no item at all) for no samples. */
static cJSON *double_array(const double *v, size_t n) {
    return n ? cJSON_CreateDoubleArray(v, (int)n) : cJSON_CreateArray();
}

static cJSON *rate_json(double rate) {
    return isinf(rate) ? cJSON_CreateString("inf") : cJSON_CreateNumber(rate);
}

typedef struct {
    double rate; /* offered (open) */
    int concurrency;
    bool slo_met;
    double request_throughput;
} point_result;

/* One tenant's (tenant set) or one priority's requests of the point: their
 * count, latencies and the tokens served to the completed ones (into
 * *served: prompt + output). */
static cJSON *group_json(const bench *b, const char *tenant, int32_t priority, double wall_s,
                         double *served) {
    cs_samples ttft = {0}, itl = {0}, e2e = {0};
    long long n = 0, ok = 0, prompt = 0, out = 0;
    for (size_t i = 0; i < b->n; i++) {
        const cs_lg_request *q = &b->sched[i];
        const char *t = tenant_of(b, q);
        if (tenant ? !t || strcmp(t, tenant) : q->priority != priority) continue;
        const req_state *r = &b->reqs[i];
        n++;
        if (r->code != CS_RPC_OK) continue;
        ok++;
        if (r->n_out > 0) cs_samples_push(&ttft, (r->t_first - r->t_send) * 1e3);
        cs_samples_extend(&itl, &r->itl_ms);
        cs_samples_push(&e2e, (r->t_last - r->t_send) * 1e3);
        prompt += r->prompt_tokens, out += r->n_out;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "requests", (double)n);
    cJSON_AddNumberToObject(j, "completed", (double)ok);
    cJSON_AddNumberToObject(j, "prompt_tokens", (double)prompt);
    cJSON_AddNumberToObject(j, "output_tokens", (double)out);
    cJSON_AddNumberToObject(j, "tok_s", wall_s > 0 ? (double)(prompt + out) / wall_s : NAN);
    cJSON_AddItemToObject(j, "ttft_ms", summary_json(&ttft));
    cJSON_AddItemToObject(j, "itl_ms", summary_json(&itl));
    cJSON_AddItemToObject(j, "e2e_ms", summary_json(&e2e));
    cs_samples_free(&ttft), cs_samples_free(&itl), cs_samples_free(&e2e);
    if (served) *served = (double)(prompt + out);
    return j;
}

/* Per tenant (with Jain's index over the tokens they were served:
 * (sum x)^2 / (n sum x^2), 1 = equal) and per priority, when the workload
 * has more than one of either. */
static void classes_json(const bench *b, double wall_s, cJSON *p) {
    const char *names[256];
    int n_names = 0;
    int32_t prios[64];
    int n_prios = 0;
    bool cut = false; /* more tenants or priorities than reported */
    for (size_t i = 0; i < b->n; i++) {
        const char *t = tenant_of(b, &b->sched[i]);
        int k = 0;
        while (t && k < n_names && strcmp(names[k], t))
            k++;
        if (t && k == n_names) {
            if (n_names < (int)(sizeof names / sizeof names[0]))
                names[n_names++] = t;
            else
                cut = true;
        }
        int32_t pr = b->sched[i].priority;
        for (k = 0; k < n_prios && prios[k] != pr; k++)
            ;
        if (k == n_prios) {
            if (n_prios < 64)
                prios[n_prios++] = pr;
            else
                cut = true;
        }
    }
    if (cut) cJSON_AddBoolToObject(p, "classes_truncated", true); /* 256 tenants, 64 priorities */
    if (n_names > 0) {
        cJSON *tj = cJSON_AddObjectToObject(p, "tenants");
        double sum = 0, sum2 = 0;
        for (int k = 0; k < n_names; k++) {
            double x;
            cJSON_AddItemToObject(tj, names[k], group_json(b, names[k], 0, wall_s, &x));
            sum += x, sum2 += x * x;
        }
        cJSON_AddNumberToObject(p, "jain_index", sum2 > 0 ? sum * sum / (n_names * sum2) : NAN);
    }
    if (n_prios > 1) {
        cJSON *pj = cJSON_AddObjectToObject(p, "priorities");
        for (int k = 0; k < n_prios; k++) {
            char key[16];
            snprintf(key, sizeof key, "%d", prios[k]);
            cJSON_AddItemToObject(pj, key, group_json(b, NULL, prios[k], wall_s, NULL));
        }
    }
}

/* The target's TTFT predictions (Usage.predicted_ttft_seconds: gRPC
 * targets that predict) against the TTFT measured here:
 * |predicted - measured| / measured over the completed requests. */
static void prediction_json(const bench *b, cJSON *p) {
    cs_samples err = {0};
    long long within = 0;
    for (size_t i = 0; i < b->n; i++) {
        const req_state *r = &b->reqs[i];
        if (r->code != CS_RPC_OK || !(r->predicted_ttft > 0) || r->n_out == 0) continue;
        double measured = r->t_first - r->t_send;
        if (!(measured > 0)) continue;
        double e = fabs(r->predicted_ttft - measured) / measured;
        cs_samples_push(&err, e);
        within += e <= 0.2;
    }
    if (err.n == 0) return;
    cJSON *j = cJSON_AddObjectToObject(p, "ttft_prediction_error");
    cJSON_AddNumberToObject(j, "n", (double)err.n);
    cJSON_AddNumberToObject(j, "p50", cs_samples_percentile(&err, 50));
    cJSON_AddNumberToObject(j, "p90", cs_samples_percentile(&err, 90));
    cJSON_AddNumberToObject(j, "within_20pct", (double)within / (double)err.n);
    cs_samples_free(&err);
}

/* The point's report; fills res. */
static cJSON *point_json(bench *b, double rate, int concurrency, double wall_s, point_result *res) {
    const serve_opts *o = b->o;
    cs_samples ttft = {0}, tpot = {0}, itl = {0}, e2e = {0};
    long long prompt = 0, out = 0, cached = 0, good = 0, ok = 0;
    cJSON *errors = cJSON_CreateObject(), *messages = cJSON_CreateObject();
    cJSON *list = o->save_requests ? cJSON_CreateArray() : NULL;
    for (size_t i = 0; i < b->n; i++) {
        req_state *r = &b->reqs[i];
        if (r->code != CS_RPC_OK) {
            const char *name = cs_rpc_code_name(r->code);
            cJSON *e = cJSON_GetObjectItemCaseSensitive(errors, name);
            if (e)
                cJSON_SetNumberValue(e, e->valuedouble + 1);
            else {
                cJSON_AddNumberToObject(errors, name, 1);
                cJSON_AddStringToObject(messages, name, r->error ? r->error : "");
            }
        } else {
            ok++;
            double t = (r->t_first - r->t_send) * 1e3;
            if (r->n_out > 0) cs_samples_push(&ttft, t);
            double tp = r->n_out > 1 ? (r->t_last - r->t_first) * 1e3 / (r->n_out - 1) : NAN;
            if (r->n_out > 1) cs_samples_push(&tpot, tp);
            cs_samples_extend(&itl, &r->itl_ms);
            cs_samples_push(&e2e, (r->t_last - r->t_send) * 1e3);
            prompt += r->prompt_tokens, out += r->n_out, cached += r->cached;
            if ((o->slo_ttft_ms == 0 || (r->n_out > 0 && t <= o->slo_ttft_ms)) &&
                (o->slo_itl_ms == 0 || !(tp > o->slo_itl_ms)))
                good++;
        }
        if (list) {
            cJSON *q = cJSON_CreateObject();
            cJSON_AddNumberToObject(q, "offset_s", b->sched[i].offset_s);
            cJSON_AddNumberToObject(q, "sent_s", r->t_send - b->t0);
            cJSON_AddStringToObject(q, "status", cs_rpc_code_name(r->code));
            cJSON_AddNumberToObject(q, "prompt_tokens", r->prompt_tokens);
            cJSON_AddNumberToObject(q, "cached_prompt_tokens", r->cached);
            cJSON_AddNumberToObject(q, "output_tokens", r->n_out);
            cJSON_AddNumberToObject(q, "messages", r->n_msgs);
            cJSON_AddNumberToObject(q, "max_tokens", b->sched[i].output_len);
            cJSON_AddNumberToObject(q, "group", b->sched[i].group);
            const char *tenant = tenant_of(b, &b->sched[i]);
            if (tenant) cJSON_AddStringToObject(q, "tenant", tenant);
            cJSON_AddNumberToObject(q, "priority", b->sched[i].priority);
            if (r->predicted_ttft > 0)
                cJSON_AddNumberToObject(q, "predicted_ttft_ms", r->predicted_ttft * 1e3);
            cJSON_AddNumberToObject(q, "ttft_ms",
                                    r->n_out > 0 ? (r->t_first - r->t_send) * 1e3 : NAN);
            cJSON_AddNumberToObject(q, "e2e_ms", (r->t_last - r->t_send) * 1e3);
            cJSON_AddItemToObject(q, "itl_ms", double_array(r->itl_ms.v, r->itl_ms.n));
            cJSON_AddItemToArray(list, q);
        }
    }
    cJSON *p = cJSON_CreateObject();
    if (b->closed)
        cJSON_AddNumberToObject(p, "concurrency", concurrency);
    else
        cJSON_AddItemToObject(p, "rate", rate_json(rate));
    cJSON_AddNumberToObject(p, "requests", (double)b->n);
    cJSON_AddNumberToObject(p, "completed", (double)ok);
    cJSON_AddNumberToObject(p, "failed", (double)(b->n - (size_t)ok));
    cJSON_AddItemToObject(p, "errors", errors);
    cJSON_AddItemToObject(p, "error_messages", messages);
    cJSON_AddNumberToObject(p, "duration_s", wall_s);
    cJSON_AddNumberToObject(p, "start_monotonic_s",
                            b->t0); /* CLOCK_MONOTONIC: align server traces */
    double rt = wall_s > 0 ? (double)ok / wall_s : NAN;
    cJSON_AddNumberToObject(p, "request_throughput", rt);
    cJSON_AddNumberToObject(p, "output_tokens", (double)out);
    cJSON_AddNumberToObject(p, "prompt_tokens", (double)prompt);
    cJSON_AddNumberToObject(p, "cached_prompt_tokens", (double)cached);
    cJSON_AddNumberToObject(p, "output_tok_s", wall_s > 0 ? (double)out / wall_s : NAN);
    cJSON_AddNumberToObject(p, "total_tok_s", wall_s > 0 ? (double)(out + prompt) / wall_s : NAN);
    double ttft_p99 = cs_samples_percentile(&ttft, 99), itl_p99 = cs_samples_percentile(&itl, 99);
    cJSON_AddItemToObject(p, "ttft_ms", summary_json(&ttft));
    cJSON_AddItemToObject(p, "tpot_ms", summary_json(&tpot));
    cJSON_AddItemToObject(p, "itl_ms", summary_json(&itl));
    cJSON_AddItemToObject(p, "e2e_ms", summary_json(&e2e));
    double cdf[101];
    for (int k = 0; k <= 100; k++)
        cdf[k] = cs_samples_percentile(&itl, k);
    cJSON_AddItemToObject(p, "itl_cdf_ms", double_array(cdf, itl.n ? 101 : 0));
    /* every request ended OK and both percentiles within the SLO */
    bool met = ok == (long long)b->n && ok > 0 &&
               (o->slo_ttft_ms == 0 || ttft_p99 <= o->slo_ttft_ms) &&
               (o->slo_itl_ms == 0 || !(itl_p99 > o->slo_itl_ms));
    cJSON_AddBoolToObject(p, "slo_met", met);
    cJSON_AddNumberToObject(p, "good_requests", (double)good);
    cJSON_AddNumberToObject(p, "good_request_rate", wall_s > 0 ? (double)good / wall_s : NAN);
    classes_json(b, wall_s, p);
    prediction_json(b, p);
    if (list) cJSON_AddItemToObject(p, "per_request", list);
    if (!o->quiet)
        fprintf(stderr,
                "bench serve: point %d done: %lld/%zu ok, %.2f req/s, %.1f output tok/s, TTFT "
                "p50 %.0f p99 %.0f ms, ITL p50 %.1f p99 %.1f ms, SLO %s\n",
                b->point, ok, b->n, rt, wall_s > 0 ? (double)out / wall_s : NAN,
                cs_samples_percentile(&ttft, 50), ttft_p99, cs_samples_percentile(&itl, 50),
                itl_p99, met ? "met" : "missed");
    res->rate = rate, res->concurrency = concurrency, res->slo_met = met;
    res->request_throughput = rt;
    cs_samples_free(&ttft), cs_samples_free(&tpot), cs_samples_free(&itl), cs_samples_free(&e2e);
    return p;
}

/* ------------------------------------------------------------ target -- */

typedef struct {
    int done, code;
    char msg[256];
    bench *b;
} models_call;

static void on_models_msg(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    (void)c;
    models_call *mc = data;
    bench *b = mc->b;
    Chunkserve__V1__ListModelsResponse *m =
        chunkserve__v1__list_models_response__unpack(NULL, len, buf);
    if (!m) return;
    for (size_t i = 0; i < m->n_models; i++) {
        const Chunkserve__V1__ModelInfo *mi = m->models[i];
        if (b->o->model && strcmp(b->o->model, mi->name)) continue;
        snprintf(b->model_name, sizeof b->model_name, "%s", mi->name);
        b->ctx_len = mi->context_length;
        b->vocab = mi->vocab_size;
        break;
    }
    chunkserve__v1__list_models_response__free_unpacked(m, NULL);
}

static void on_models_done(cs_rpc_client_call *c, int code, const char *message, void *data) {
    (void)c;
    models_call *mc = data;
    mc->done = 1;
    mc->code = code;
    snprintf(mc->msg, sizeof mc->msg, "%s", message);
}

typedef struct {
    bench *b;
    int done, status;
    char msg[256];
} models_http;

static void on_models_body(void *user, const char *data, size_t len) {
    models_http *mh = user;
    bench *b = mh->b;
    cJSON *j = cJSON_ParseWithLength(data, len);
    const cJSON *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItemCaseSensitive(j, "data")) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(m, "id");
        if (!cJSON_IsString(id) || (b->o->model && strcmp(b->o->model, id->valuestring))) continue;
        const cJSON *ctx = cJSON_GetObjectItemCaseSensitive(m, "max_model_len");
        const cJSON *voc = cJSON_GetObjectItemCaseSensitive(m, "vocab_size");
        snprintf(b->model_name, sizeof b->model_name, "%s", id->valuestring);
        b->ctx_len = cJSON_IsNumber(ctx) ? ctx->valueint : 0;
        b->vocab = cJSON_IsNumber(voc) ? voc->valueint : (int32_t)b->o->vocab_size;
        break;
    }
    cJSON_Delete(j);
}

static void on_models_http_done(void *user, int status, const char *msg) {
    models_http *mh = user;
    mh->done = 1, mh->status = status;
    snprintf(mh->msg, sizeof mh->msg, "%s", msg);
}

/* GET /v1/models: the model's name, context (max_model_len) and, from a
 * chunkserve router or serve, its vocabulary (else --vocab-size). */
static int probe_http(bench *b) {
    const serve_opts *o = b->o;
    if (cs_http_client_resolve(o->target, b->host, sizeof b->host, (struct sockaddr *)&b->addr,
                               sizeof b->addr))
        return CS_EINVAL;
    if (o->api_key) {
        const char *comma = strchr(o->api_key, ',');
        int len = comma ? (int)(comma - o->api_key) : (int)strlen(o->api_key);
        snprintf(b->http_headers, sizeof b->http_headers, "Authorization: Bearer %.*s\r\n", len,
                 o->api_key);
    }
    double deadline = cs_now() + (double)o->connect_timeout_ms / 1e3;
    for (;;) { /* the server may still be starting: retry until the deadline */
        models_http mh = {.b = b};
        cs_http_client_cbs cbs = {on_models_body, on_models_http_done};
        int r = cs_http_client_request(&b->uv, (const struct sockaddr *)&b->addr, b->host, "GET",
                                       "/v1/models", b->http_headers, NULL, 0, deadline - cs_now(),
                                       &cbs, &mh);
        if (r) return r;
        while (!mh.done)
            uv_run(&b->uv, UV_RUN_ONCE);
        if (mh.status == 200) break;
        if (mh.status != 0 || cs_now() + 0.2 >= deadline)
            return cs_fail(CS_EIO, "target %s: GET /v1/models: %s%s%d %s", o->target,
                           mh.status ? "HTTP " : "", mh.status ? "" : "no answer", mh.status,
                           mh.msg);
        uv_sleep(200);
    }
    if (!b->model_name[0])
        return cs_fail(CS_EINVAL, "target %s serves no model named '%s'", o->target,
                       o->model ? o->model : "");
    if (b->vocab <= 0)
        return cs_fail(CS_EINVAL,
                       "target %s does not report vocab_size in /v1/models: pass --vocab-size",
                       o->target);
    if (b->ctx_len <= 0) b->ctx_len = 1 << 20; /* unknown: no cut */
    return 0;
}

/* ListModels: the model's context length and vocabulary (and a connection). */
static int probe_target(bench *b) {
    Chunkserve__V1__ListModelsRequest req = CHUNKSERVE__V1__LIST_MODELS_REQUEST__INIT;
    models_call mc = {.b = b};
    cs_rpc_call_opts co = {.timeout_ms = b->o->connect_timeout_ms,
                           .metadata = b->md,
                           .n_metadata = b->n_md,
                           .wait_for_ready = true};
    int r = cs_rpc_channel_call_msg(b->ch, "/chunkserve.v1.Generation/ListModels", &req.base, &co,
                                    on_models_msg, on_models_done, &mc, NULL);
    if (r) return r;
    while (!mc.done)
        uv_run(&b->uv, UV_RUN_ONCE);
    if (mc.code != CS_RPC_OK)
        return cs_fail(CS_EIO, "target %s: ListModels: %s: %s", b->o->target,
                       cs_rpc_code_name(mc.code), mc.msg);
    if (!b->model_name[0])
        return cs_fail(CS_EINVAL, "target %s serves no model named '%s'", b->o->target,
                       b->o->model ? b->o->model : "");
    if (b->vocab < 16 || b->ctx_len < 16)
        return cs_fail(CS_EINVAL, "target %s: model '%s' reports vocab %d, context %d",
                       b->o->target, b->model_name, b->vocab, b->ctx_len);
    return 0;
}

/* One sweep point: the schedule at rate (open) or concurrency (closed). */
static cJSON *run_point(bench *b, const cs_lg_params *lp, int concurrency, point_result *res) {
    const serve_opts *o = b->o;
    size_t n = (size_t)o->requests;
    cs_lg_request *sched = malloc(n * sizeof *sched);
    req_state *reqs = calloc(n, sizeof *reqs);
    CS_ASSERT(sched && reqs);
    cs_lg_schedule(b->w, lp, sched, n);
    for (size_t i = 0; i < n; i++)
        reqs[i].b = b, reqs[i].code = CS_RPC_CANCELLED; /* never started: --duration */
    b->sched = sched, b->reqs = reqs, b->n = n;
    b->next = b->n_done = b->n_failed = b->in_flight = 0;
    b->closed = lp->arrival == CS_LG_CLOSED;
    b->cap = b->closed ? (size_t)concurrency : (size_t)o->max_concurrency;
    b->t0 = cs_now();
    b->stop_issuing_at = o->duration > 0 ? b->t0 + o->duration : INFINITY;
    if (!o->quiet) uv_timer_start(&b->progress, on_progress, 2000, 2000);
    start_due(b);
    while (b->n_done < b->next || b->next < b->n)
        uv_run(&b->uv, UV_RUN_ONCE);
    double wall = cs_now() - b->t0;
    uv_timer_stop(&b->progress);
    uv_timer_stop(&b->arrive);
    cJSON *p = point_json(b, lp->rate, concurrency, wall, res);
    for (size_t i = 0; i < n; i++) {
        cs_samples_free(&reqs[i].itl_ms);
        free(reqs[i].error);
    }
    free(reqs);
    free(sched);
    b->sched = NULL, b->reqs = NULL;
    return p;
}

/* --dry-run: the first point's schedule. */
static int dry_run(const cs_lg_workload *w, const cs_lg_params *lp, const serve_opts *o, FILE *f) {
    size_t n = (size_t)o->requests;
    cs_lg_request *s = malloc(n * sizeof *s);
    double *off = malloc(n * sizeof *off), *pl = malloc(n * sizeof *pl),
           *ol = malloc(n * sizeof *ol);
    double *gr = malloc(n * sizeof *gr), *cl = malloc(n * sizeof *cl);
    double *tn = malloc(n * sizeof *tn), *pr = malloc(n * sizeof *pr);
    CS_ASSERT(s && off && pl && ol && gr && cl && tn && pr);
    cs_lg_schedule(w, lp, s, n);
    for (size_t i = 0; i < n; i++)
        off[i] = s[i].offset_s, pl[i] = s[i].prompt_len, ol[i] = s[i].output_len,
        gr[i] = s[i].group, cl[i] = s[i].cls >= 0 ? s[i].cls : s[i].line, tn[i] = s[i].tenant,
        pr[i] = s[i].priority;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "arrival", cs_lg_arrival_name(lp->arrival));
    if (lp->arrival != CS_LG_CLOSED) cJSON_AddItemToObject(j, "rate", rate_json(lp->rate));
    cJSON_AddNumberToObject(j, "burstiness", lp->burstiness);
    cJSON *names = cJSON_AddArrayToObject(j, "classes");
    for (int i = 0; i < w->n_classes; i++)
        cJSON_AddItemToArray(names, cJSON_CreateString(w->classes[i].name));
    cJSON_AddItemToObject(j, "offset_s", double_array(off, n));
    cJSON_AddItemToObject(j, "prompt_tokens", double_array(pl, n));
    cJSON_AddItemToObject(j, "output_tokens", double_array(ol, n));
    cJSON_AddItemToObject(j, "group", double_array(gr, n));
    cJSON_AddItemToObject(j, "class", double_array(cl, n));
    cJSON *tnames = cJSON_AddArrayToObject(j, "tenants");
    for (int i = 0; i < w->n_tenants; i++)
        cJSON_AddItemToArray(tnames, cJSON_CreateString(w->tenants[i].name));
    cJSON_AddItemToObject(j, "tenant", double_array(tn, n));
    cJSON_AddItemToObject(j, "priority", double_array(pr, n));
    char *text = cJSON_PrintUnformatted(j);
    CS_ASSERT(text);
    fprintf(f, "%s\n", text);
    free(text);
    cJSON_Delete(j);
    free(s), free(off), free(pl), free(ol), free(gr), free(cl), free(tn), free(pr);
    return 0;
}

static int fail(const char *what) {
    fprintf(stderr, "chunkserve bench serve: %s%s%s\n", what, what[0] ? ": " : "", cs_last_error());
    return 2;
}

int cs_cli_bench_serve(int argc, char **argv, int first) {
    serve_opts o;
    int r =
        cs_config_parse(serve_table, N_SERVE_OPTS, &o, argc, argv, first, "chunkserve bench serve",
                        "measure a running deployment: TTFT, TPOT, ITL, throughput and goodput "
                        "under an SLO over a sweep of request rates (or concurrencies); "
                        "built-in workloads chat (prompt 32-512 tokens, output 64-256), rag "
                        "(3000-8000, 16-64), summarize (1000-4000, 128-384), mixed (70/15/15), "
                        "or a JSONL dataset: {\"prompt\"|\"token_ids\"|\"prompt_tokens\", "
                        "\"output_tokens\", \"group\", \"tenant\", \"priority\"} per line");
    if (r == 1) return 0;
    if (r) return fail("");
    cs_lg_params lp = {.burstiness = o.burstiness,
                       .prefix_groups = (int32_t)o.prefix_groups,
                       .prefix_tokens = (int32_t)o.prefix_tokens,
                       .seed = (uint64_t)o.seed};
    double points[MAX_POINTS];
    int n_points;
    if (cs_lg_arrival_parse(o.arrival, &lp.arrival)) return fail("");
    bool closed = lp.arrival == CS_LG_CLOSED;
    if (parse_list(closed ? "concurrency" : "rates", closed ? o.concurrency : o.rates, closed,
                   points, &n_points))
        return fail("");
    if (o.burstiness != 1 && lp.arrival != CS_LG_GAMMA) {
        cs_fail(CS_EINVAL, "--burstiness applies to --arrival gamma only");
        return fail("");
    }
    if (!o.dry_run && !o.target) {
        cs_fail(CS_EINVAL, "--target HOST:PORT is required (or --dry-run)");
        return fail("");
    }
    cs_lg_workload w;
    if (cs_lg_workload_load(o.workload, &w) || cs_lg_tenants_parse(o.tenants, &w)) {
        cs_lg_workload_free(&w);
        return fail("");
    }
    for (int i = 0; i < w.n_tenants && w.n_lines; i++)
        if (w.tenants[i].has_class) {
            cs_fail(CS_EINVAL, "--tenants: '%s' names a workload, but a dataset's lines give "
                               "the lengths", w.tenants[i].name);
            cs_lg_workload_free(&w);
            return fail("");
        }
    /* a dataset's lines name their groups; a built-in workload draws them */
    if (w.n_lines ? o.prefix_groups > 0 : (o.prefix_groups > 0) != (o.prefix_tokens > 0)) {
        cs_fail(CS_EINVAL, w.n_lines
                               ? "--prefix-groups: a dataset's lines name their groups "
                                 "(\"group\"); --prefix-tokens sets their shared head"
                               : "--prefix-groups and --prefix-tokens go together (both > 0)");
        cs_lg_workload_free(&w);
        return fail("");
    }
    FILE *out = stdout;
    if (o.out && !(out = fopen(o.out, "w"))) {
        cs_fail(CS_EIO, "--out %s: cannot be written", o.out);
        cs_lg_workload_free(&w);
        return fail("");
    }
    if (o.dry_run) {
        lp.rate = points[0];
        dry_run(&w, &lp, &o, out);
        if (out != stdout) fclose(out);
        cs_lg_workload_free(&w);
        return 0;
    }

    bench *b = calloc(1, sizeof *b);
    CS_ASSERT(b);
    b->o = &o, b->w = &w;
    uv_loop_init(&b->uv);
    uv_timer_init(&b->uv, &b->arrive);
    uv_timer_init(&b->uv, &b->progress);
    b->arrive.data = b->progress.data = b;
    if (o.api_key) {
        const char *comma = strchr(o.api_key, ',');
        int len = comma ? (int)(comma - o.api_key) : (int)strlen(o.api_key);
        snprintf(b->auth, sizeof b->auth, "Bearer %.*s", len, o.api_key);
        b->md[0] = (cs_rpc_metadata){"authorization", b->auth};
        b->n_md = 1;
    }
    cs_rpc_channel_opts chopt = {
        .max_recv_bytes = 64 << 20,
        .tls = {o.cert_file, o.key_file, o.ca_file, o.server_name},
    };
    int rc = 0;
    double cpu0 = 0;
    cJSON *report = NULL;
    b->http = !strncmp(o.target, "http://", 7);
    if (b->http ? (r = probe_http(b))
                : ((r = cs_rpc_loop_init(&b->uv, &b->rl)) ||
                   (r = cs_rpc_channel_init(b->rl, o.target, &chopt, &b->ch)) ||
                   (r = probe_target(b)))) {
        fail("");
        rc = 1;
        goto done;
    }
    lp.context_length = b->ctx_len;
    b->ids = malloc(sizeof(int32_t) * (size_t)(b->ctx_len < (1 << 20) ? b->ctx_len : 1 << 20));
    CS_ASSERT(b->ids);
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    report = cJSON_CreateObject();
    cJSON_AddStringToObject(report, "tool", "chunkserve bench serve");
    cJSON_AddStringToObject(report, "target", o.target);
    cJSON *model = cJSON_AddObjectToObject(report, "model");
    cJSON_AddStringToObject(model, "name", b->model_name);
    cJSON_AddNumberToObject(model, "context_length", b->ctx_len);
    cJSON_AddNumberToObject(model, "vocab_size", b->vocab);
    cJSON *cfg = cJSON_AddObjectToObject(report, "config");
    cJSON_AddStringToObject(cfg, "workload", w.name);
    cJSON_AddStringToObject(cfg, "arrival", o.arrival);
    cJSON_AddNumberToObject(cfg, "burstiness", o.burstiness);
    cJSON_AddNumberToObject(cfg, "requests_per_point", (double)o.requests);
    cJSON_AddNumberToObject(cfg, "duration_s", o.duration);
    cJSON_AddNumberToObject(cfg, "max_concurrency", (double)o.max_concurrency);
    cJSON_AddNumberToObject(cfg, "seed", (double)o.seed);
    cJSON_AddNumberToObject(cfg, "prefix_groups", (double)o.prefix_groups);
    cJSON_AddNumberToObject(cfg, "prefix_tokens", (double)o.prefix_tokens);
    if (o.tenants) cJSON_AddStringToObject(cfg, "tenants", o.tenants);
    cJSON_AddNumberToObject(cfg, "temperature", o.temperature);
    cJSON_AddBoolToObject(cfg, "ignore_eos", !o.no_ignore_eos);
    cJSON_AddNumberToObject(cfg, "slo_ttft_p99_ms", o.slo_ttft_ms);
    cJSON_AddNumberToObject(cfg, "slo_itl_p99_ms", o.slo_itl_ms);
    cJSON_AddNumberToObject(cfg, "warmup", (double)o.warmup);
    if (o.warmup > 0) {
        serve_opts wo = o;
        wo.requests = o.warmup, wo.quiet = true, wo.save_requests = false, wo.duration = 0;
        cs_lg_params wp = lp;
        wp.arrival = CS_LG_CLOSED, wp.seed = lp.seed ^ 0xa5a5a5a5ull;
        b->o = &wo, b->point = -1;
        point_result wr;
        cJSON_Delete(run_point(b, &wp, 1, &wr));
        b->o = &o;
    }
    cJSON *pts = cJSON_AddArrayToObject(report, "points");
    point_result best = {.rate = NAN}, res;
    bool any = false;
    for (int i = 0; i < n_points; i++) {
        b->point = i;
        lp.rate = closed ? INFINITY : points[i];
        if (!o.quiet)
            fprintf(stderr, "bench serve: point %d: %s %g, %lld requests of '%s'\n", i,
                    closed ? "concurrency" : "rate", points[i], (long long)o.requests, w.name);
        cJSON_AddItemToArray(pts, run_point(b, &lp, closed ? (int)points[i] : 0, &res));
        double key = closed ? res.concurrency : res.rate;
        double best_key = closed ? best.concurrency : best.rate;
        if (res.slo_met && (!any || key > best_key)) best = res, any = true;
        if (!res.slo_met && o.stop_after_miss) break;
    }
    getrusage(RUSAGE_SELF, &ru1);
    cpu0 = (double)(ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec + ru1.ru_stime.tv_sec -
                    ru0.ru_stime.tv_sec) +
           (double)(ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec + ru1.ru_stime.tv_usec -
                    ru0.ru_stime.tv_usec) /
               1e6;
    cJSON *g = cJSON_AddObjectToObject(report, "goodput");
    cJSON_AddNumberToObject(g, "slo_ttft_p99_ms", o.slo_ttft_ms);
    cJSON_AddNumberToObject(g, "slo_itl_p99_ms", o.slo_itl_ms);
    if (any) {
        if (closed)
            cJSON_AddNumberToObject(g, "concurrency", best.concurrency);
        else
            cJSON_AddItemToObject(g, "rate", rate_json(best.rate));
        cJSON_AddNumberToObject(g, "request_throughput", best.request_throughput);
    } else {
        cJSON_AddNullToObject(g, closed ? "concurrency" : "rate");
        cJSON_AddNullToObject(g, "request_throughput");
    }
    cJSON_AddNumberToObject(report, "client_cpu_s", cpu0);
    char *text = cJSON_Print(report);
    CS_ASSERT(text);
    fprintf(out, "%s\n", text);
    free(text);
done:
    cJSON_Delete(report);
    if (out != stdout) fclose(out);
    cs_rpc_channel_free(b->ch);
    cs_rpc_loop_close(b->rl);
    uv_close((uv_handle_t *)&b->arrive, NULL);
    uv_close((uv_handle_t *)&b->progress, NULL);
    uv_run(&b->uv, UV_RUN_DEFAULT);
    uv_loop_close(&b->uv);
    if (b->rl) cs_rpc_wait_grpc_ended(2000);
    free(b->ids);
    free(b);
    cs_lg_workload_free(&w);
    return rc;
}
