/* chunkserve: command-line entry point. Thin: parse options from one table,
 * load the model, run one subcommand, free in reverse order.
 *
 *   chunkserve generate --model PATH --prompt TEXT [--chat] [--max-tokens N] ...
 *   chunkserve serve --model PATH --port P [--max-batched-tokens N] ...   (server/)
 *   chunkserve tokenize | detokenize | chat-format --model PATH   (JSON lines on stdin)
 *   chunkserve logits --model PATH --ids 1,2,3 --out FILE
 *   chunkserve info --model PATH */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "chunkserve/config.h"
#include "chunkserve/engine.h"
#include "chunkserve/model.h"
#include "chunkserve/proc.h"
#include "chunkserve/refeval.h"
#include "chunkserve/sampler.h"
#include "chunkserve/tokenizer.h"
#include "cluster.h"
#include "sampling_flags.h"
#include "spec_config.h"
#include "slo_config.h"
#include "tenant_config.h"
#include "server.h"
#include "chunkserve/ops.h"
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

/* Every field is written by cs_config_parse from the joined table (all_options). */
typedef struct {
    const char *model, *prompt, *system, *ids, *out, *kv_out, *tensor;
    bool chat, no_special, no_gen_prompt, verbose, ignore_eos, reference, exact, engine, every_pos,
        kv_bf16;
    int64_t max_tokens, threads, page_size, kv_mib, prompt_tokens, max_chunk_tokens;
    int64_t port, http_port, max_num_seqs, max_queue, grace_ms;
    const char *budget, *budgets, *host, *http_host;
    double duration, step_time_target_ms;
    cs_cli_sampling sampling; /* generate: the sampling table's flags (sampling_flags.h) */
    cs_spec_opts spec;        /* serve: speculative decoding (api/spec_config.h) */
    cs_tenant_opts tenants;   /* serve: the tenants' shares (api/tenant_config.h) */
    cs_slo_opts slo;          /* serve: the TTFT bound (api/slo_config.h) */
    cs_openai_config openai;  /* serve: the OpenAI-compatible HTTP API, API keys */
    cs_rpc_limits rpc;        /* serve: the gRPC port's limits */
    cs_rpc_tls tls;           /* serve: TLS on the gRPC port */
} options;

/* The flags, their CHUNKSERVE_* variables and --help (chunkserve/config.h).
 * No bounds here: the commands check their values and say what they need. */
#define O(name, type, field, def, help)                                                            \
    { name, CS_CONFIG_##type, offsetof(options, field), def, help, 0, 0 }
static const cs_config_entry opt_table[] = {
    O("model", STR, model, NULL, "model: a .gguf file or a Hugging Face directory"),
    O("prompt", STR, prompt, NULL, "prompt text (generate)"),
    O("chat", BOOL, chat, NULL, "wrap the prompt as a user message in the model's chat template"),
    O("system", STR, system, NULL, "system message for --chat"),
    O("max-tokens", INT, max_tokens, "256", "maximum tokens to generate"),
    O("ignore-eos", BOOL, ignore_eos, NULL,
      "keep generating past end-of-generation tokens (benchmarks)"),
    O("max-batched-tokens", STR, budget, "512",
      "step token budget: prompts are prefilled in chunks so a step computes at most N tokens; "
      "0 or unlimited = whole prompts in one step"),
    O("max-chunk-tokens", INT, max_chunk_tokens, "0",
      "one prompt's chunk per step at most; 0 = the budget"),
    O("step-time-target-ms", DOUBLE, step_time_target_ms, "0",
      "size prompt chunks so each step's predicted time (fitted online from measured steps) "
      "stays within this many ms; decodes first, --max-batched-tokens still caps; 0 = off"),
    O("page-size", INT, page_size, "16", "tokens per KV-cache page"),
    O("kv-cache-mib", INT, kv_mib, "256", "KV-cache pool size in MiB"),
    O("threads", INT, threads, "0", "CPU threads; 0 = one per core"),
    O("kv-bf16", BOOL, kv_bf16, NULL,
      "CPU backend: KV pages in bf16 (half the memory and KV bytes; values rounded to nearest "
      "even when stored); the CUDA backend's are bf16 anyway"),
    O("exact", BOOL, exact, NULL,
      "fp32 weights (quantized files dequantized at load, OpenBLAS GEMMs); default: a "
      "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K file keeps its blocks and runs the CPU's integer "
      "kernels"),
    O("host", STR, host, "127.0.0.1", "serve: address to listen on (0.0.0.0 = all interfaces)"),
    O("port", INT, port, "50051",
      "serve: port to listen on; 0 = any free port (printed on stdout)"),
    O("http-host", STR, http_host, NULL,
      "serve: address of the ops HTTP port (/metrics, /healthz, /readyz); default --host"),
    O("http-port", INT, http_port, "0",
      "serve: ops HTTP port; 0 = any free port (printed on stdout)"),
    O("max-num-seqs", INT, max_num_seqs, "256", "serve: running sequences at most"),
    O("max-queue", INT, max_queue, "256",
      "serve: waiting requests at most; more are refused (RESOURCE_EXHAUSTED)"),
    O("grace-ms", INT, grace_ms, "2000",
      "serve: on SIGTERM, time streams get to finish before they are cancelled"),
    O("duration", DOUBLE, duration, "60", "bench-local: seconds per budget"),
    O("budgets", STR, budgets, "unlimited,256,512,2048", "bench-local: step budgets to compare"),
    O("prompt-tokens", INT, prompt_tokens, "2000", "bench-engine: prompt length"),
    O("reference", BOOL, reference, NULL, "use the single-threaded fp32 reference forward pass"),
    O("ids", STR, ids, NULL, "comma-separated token ids: the prompt for generate and logits"),
    O("out", STR, out, NULL,
      "output file (logits: raw float32 [n_tokens, n_vocab]; with --engine [1, n_vocab])"),
    O("tensor", STR, tensor, NULL, "tensor: the GGUF tensor's name (e.g. blk.0.attn_q.weight)"),
    O("engine", BOOL, engine, NULL,
      "logits: run the engine (backend, weight mode, --threads, prompt chunks of "
      "--max-batched-tokens) instead of the fp32 reference; writes the last position's logits"),
    O("every-position", BOOL, every_pos, NULL,
      "logits --engine: one token a step, the logits of every position (quantized kernels "
      "give any chunking's bits)"),
    O("kv-out", STR, kv_out, NULL, "logits --engine: also write the prompt's KV pages (raw bytes)"),
    O("no-special", BOOL, no_special, NULL, "tokenize: treat special-token text as plain text"),
    O("no-generation-prompt", BOOL, no_gen_prompt, NULL, "chat-format: omit the assistant header"),
    O("verbose", BOOL, verbose, NULL, "debug logging"),
};
#undef O
#define N_OPTS (sizeof opt_table / sizeof opt_table[0])

/* The whole table: the commands' options, the sampling flags (from the
 * sampling table), then serve's OpenAI door, gRPC port and TLS (their
 * modules' tables), joined once for the process. */
static const cs_config_entry *all_options(size_t *n) {
    static cs_config_entry *table;
    static size_t n_table;
    size_t n_sampling;
    const cs_config_entry *sampling = cs_cli_sampling_table(&n_sampling);
    const cs_config_part parts[] = {
        {opt_table, N_OPTS, 0},
        {sampling, n_sampling, offsetof(options, sampling)},
        {cs_spec_config, cs_spec_config_n, offsetof(options, spec)},
        {cs_tenant_config, cs_tenant_config_n, offsetof(options, tenants)},
        {cs_slo_config, cs_slo_config_n, offsetof(options, slo)},
        {cs_openai_config_table, cs_openai_config_n, offsetof(options, openai)},
        {cs_proc_rpc_config, cs_proc_rpc_config_n, offsetof(options, rpc)},
        {cs_proc_tls_config, cs_proc_tls_config_n, offsetof(options, tls)},
    };
    if (!table && cs_config_join(parts, sizeof parts / sizeof parts[0], NULL, 0, &table, &n_table))
        CS_ASSERT(!"the option tables join"); /* two entries of one name: a programming error */
    *n = n_table;
    return table;
}

/* The commands' part of the usage text, made from their table (at the end
 * of this file, where their functions are) before any option is parsed. */
static char commands_help[2048];

/* argv[1] is the command; the options follow it. Returns 0, 1 after --help
 * (exit 0) or -1 after printing the error (exit 2). */
static int parse_options(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    size_t n;
    const cs_config_entry *table = all_options(&n);
    int r = cs_config_parse(table, n, o, argc, argv, 2, "chunkserve COMMAND", commands_help);
    if (r < 0) fprintf(stderr, "chunkserve: %s\n", cs_last_error());
    return r < 0 ? -1 : r;
}

static int fail_msg(const char *what, int r) {
    const char *msg = cs_last_error();
    fprintf(stderr, "chunkserve: %s: %s\n", what, msg[0] ? msg : cs_strerror(r));
    return 1;
}

/* Reads one line of stdin (any length) into *buf; returns length or -1 at EOF. */
static long read_line(char **buf, size_t *cap) {
    ssize_t n = getline(buf, cap, stdin);
    if (n < 0) return -1;
    while (n > 0 && ((*buf)[n - 1] == '\n' || (*buf)[n - 1] == '\r'))
        (*buf)[--n] = 0;
    return n;
}

static int cmd_tokenize(const cs_tokenizer *tok, const options *o) {
    char *line = NULL;
    size_t cap = 0;
    long n;
    int rc = 0;
    while ((n = read_line(&line, &cap)) >= 0) {
        if (n == 0) continue;
        cJSON *j = cJSON_ParseWithLength(line, (size_t)n);
        if (!cJSON_IsString(j)) {
            fprintf(stderr, "chunkserve: tokenize: each input line must be a JSON string\n");
            cJSON_Delete(j);
            rc = 1;
            break;
        }
        int32_t *ids = NULL;
        size_t n_ids = 0;
        int r = cs_tokenizer_encode(tok, j->valuestring, strlen(j->valuestring), !o->no_special,
                                    false, &ids, &n_ids);
        cJSON_Delete(j);
        if (r) {
            rc = fail_msg("tokenize", r);
            break;
        }
        putchar('[');
        for (size_t i = 0; i < n_ids; i++)
            printf(i ? ",%d" : "%d", ids[i]);
        printf("]\n");
        free(ids);
    }
    free(line);
    return rc;
}

static int cmd_detokenize(const cs_tokenizer *tok) {
    char *line = NULL;
    size_t cap = 0;
    long n;
    int rc = 0;
    while ((n = read_line(&line, &cap)) >= 0) {
        if (n == 0) continue;
        cJSON *j = cJSON_ParseWithLength(line, (size_t)n);
        int count = cJSON_IsArray(j) ? cJSON_GetArraySize(j) : -1;
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)(count > 0 ? count : 1));
        for (int i = 0; ids && i < count; i++) {
            const cJSON *e = cJSON_GetArrayItem(j, i);
            if (!cJSON_IsNumber(e) || e->valuedouble != (double)(int32_t)e->valuedouble)
                count = -1;
            else
                ids[i] = (int32_t)e->valuedouble;
        }
        cJSON_Delete(j);
        if (count < 0 || !ids) {
            fprintf(
                stderr,
                "chunkserve: detokenize: each input line must be a JSON array of integer ids\n");
            free(ids);
            rc = 1;
            break;
        }
        char *text = NULL;
        size_t len = 0;
        int r = cs_tokenizer_decode(tok, ids, (size_t)count, false, &text, &len);
        free(ids);
        if (r) {
            rc = fail_msg("detokenize", r);
            break;
        }
        cJSON *s = cJSON_CreateString(text);
        char *out = cJSON_PrintUnformatted(s);
        printf("%s\n", out);
        cJSON_free(out);
        cJSON_Delete(s);
        free(text);
    }
    free(line);
    return rc;
}

/* Reads all of stdin (bounded) into a malloc'd NUL-terminated string. */
static char *read_stdin(size_t limit) {
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n + 1 >= cap) {
            if (cap >= limit) {
                free(buf);
                return NULL;
            }
            char *nb = realloc(buf, cap *= 2);
            if (!nb) free(buf);
            buf = nb;
            continue;
        }
        size_t r = fread(buf + n, 1, cap - 1 - n, stdin);
        if (r == 0) break;
        n += r;
    }
    if (buf) buf[n] = 0;
    return buf;
}

static int cmd_chat_format(const cs_tokenizer *tok, const options *o) {
    char *in = read_stdin(64u << 20);
    cJSON *j = in ? cJSON_Parse(in) : NULL;
    free(in);
    int n = cJSON_IsArray(j) ? cJSON_GetArraySize(j) : -1;
    cs_chat_message *msgs = calloc((size_t)(n > 0 ? n : 1), sizeof *msgs);
    for (int i = 0; msgs && i < n; i++) {
        const cJSON *m = cJSON_GetArrayItem(j, i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(role) || !cJSON_IsString(content))
            n = -1;
        else
            msgs[i] = (cs_chat_message){.role = role->valuestring, .content = content->valuestring};
    }
    int rc = 0;
    if (n < 0 || !msgs) {
        fprintf(stderr, "chunkserve: chat-format: stdin must hold a JSON array of {\"role\": ..., "
                        "\"content\": ...}\n");
        rc = 1;
    } else {
        char *text = NULL;
        int r = cs_tokenizer_apply_chat(
            tok, msgs, (size_t)n, o->no_gen_prompt ? CS_CHAT_CLOSED : CS_CHAT_GENERATION_PROMPT,
            &text);
        if (r)
            rc = fail_msg("chat-format", r);
        else
            fputs(text, stdout);
        free(text);
    }
    free(msgs);
    cJSON_Delete(j);
    return rc;
}

static int parse_ids(const char *s, int32_t **ids, int32_t *n) {
    size_t cap = 16, k = 0;
    int32_t *a = malloc(cap * sizeof *a);
    while (a && *s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < INT32_MIN || v > INT32_MAX || (*end && *end != ',')) {
            free(a);
            return cs_fail(CS_EINVAL, "--ids must be comma-separated integers");
        }
        if (k == cap) {
            int32_t *na = realloc(a, (cap *= 2) * sizeof *a);
            if (!na) free(a);
            a = na;
            if (!a) break;
        }
        a[k++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    if (!a) return cs_fail(CS_ENOMEM, "out of memory");
    if (k == 0) {
        free(a);
        return cs_fail(CS_EINVAL, "--ids is empty");
    }
    *ids = a;
    *n = (int32_t)k;
    return 0;
}

/* What generate evaluates with: the paged engine (default) or the reference. */
typedef struct {
    cs_engine *engine;
    cs_page_table pt;
    cs_ref_seq *ref;
    int32_t chunk; /* engine: prompt chunk size, 0 = one pass */
} evaluator;

static int parse_budget(const char *s, int32_t *out) {
    if (!strcmp(s, "unlimited") || !strcmp(s, "0")) {
        *out = 0;
        return 0;
    }
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < 1 || v > (1 << 30))
        return cs_fail(
            CS_EINVAL,
            "--max-batched-tokens must be a positive number, 0 or 'unlimited' (got '%s')", s);
    *out = (int32_t)v;
    return 0;
}

static int eval_init(evaluator *ev, const cs_model *m, const options *o, int32_t max_tokens) {
    memset(ev, 0, sizeof *ev);
    if (o->reference) return cs_ref_seq_init(m, max_tokens, &ev->ref);
    int r = parse_budget(o->budget, &ev->chunk);
    if (r) return r;
    cs_engine_params ep = cs_engine_params_default();
    if (o->page_size < 1 || o->page_size > 4096 || o->kv_mib < 1 || o->threads < 0)
        return cs_fail(CS_EINVAL,
                       "--page-size must be 1..4096, --kv-cache-mib >= 1, --threads >= 0");
    ep.page_size = (int32_t)o->page_size;
    ep.kv_bytes = (size_t)o->kv_mib << 20;
    ep.n_threads = (int32_t)o->threads;
    ep.kv_bf16 = o->kv_bf16;
    return cs_engine_init(m, &ep, &ev->engine);
}

static int eval_tokens(evaluator *ev, const int32_t *ids, int32_t n, int32_t pos, float *logits) {
    if (ev->ref) return cs_ref_seq_eval(ev->ref, ids, n, false, logits);
    return cs_engine_eval_seq(ev->engine, &ev->pt, pos, ids, n, ev->chunk, logits);
}

static void eval_free(evaluator *ev) {
    if (ev->engine) cs_page_table_release(&ev->pt, cs_engine_kv(ev->engine));
    cs_engine_free(ev->engine);
    cs_ref_seq_free(ev->ref);
}

static int write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = n ? fwrite(p, 1, n, f) : 0;
    return (fclose(f) != 0 || w != n) ? -1 : 0;
}

/* logits: the fp32 reference's logits of every position (default), or with
 * --engine the engine's (backend, weight mode, --threads, prompt chunks of
 * --max-batched-tokens): the last position's logits, and with --kv-out the
 * prompt's KV pages as the engine holds them, so two runs compare with cmp. */
static int cmd_logits(const cs_model *m, const options *o) {
    if (!o->ids || !o->out) {
        fprintf(stderr, "chunkserve: logits needs --ids and --out\n");
        return 2;
    }
    if ((o->kv_out || o->every_pos) && !o->engine) {
        fprintf(stderr, "chunkserve: logits: %s needs --engine\n",
                o->kv_out ? "--kv-out" : "--every-position");
        return 2;
    }
    int32_t *ids = NULL, n = 0;
    int r = parse_ids(o->ids, &ids, &n);
    if (r) return fail_msg("logits", r);
    const cs_model_config *c = cs_model_get_config(m);
    for (int32_t i = 0; !r && i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->n_vocab)
            r = cs_fail(CS_EINVAL, "token id %d is outside the vocabulary (0..%d)", ids[i],
                        c->n_vocab - 1);
    int32_t rows = o->engine && !o->every_pos ? 1 : n;
    float *logits = malloc((size_t)rows * (size_t)c->n_vocab * sizeof(float));
    void *kv = NULL;
    size_t kv_bytes = 0;
    int rc = 1;
    evaluator ev;
    memset(&ev, 0, sizeof ev);
    if (!r && !logits) r = cs_fail(CS_ENOMEM, "out of memory for %d x %d logits", rows, c->n_vocab);
    if (!r && o->engine) {
        options eo = *o;
        eo.reference = false;
        r = eval_init(&ev, m, &eo, n);
        if (!r && o->every_pos)
            for (int32_t i = 0; !r && i < n; i++)
                r = eval_tokens(&ev, ids + i, 1, i, logits + (size_t)i * (size_t)c->n_vocab);
        else if (!r)
            r = eval_tokens(&ev, ids, n, 0, logits);
        if (!r && o->kv_out) { /* the pages it keeps, in a KV transfer's order */
            cs_kv_cache *kvc = cs_engine_kv(ev.engine);
            int32_t n_ids = cs_kv_cache_seq_pages(kvc, n);
            int32_t *ids_kv = malloc(((size_t)n_ids + 1) * sizeof *ids_kv);
            kv_bytes = (size_t)n_ids * cs_engine_page_bytes(ev.engine);
            kv = malloc(kv_bytes ? kv_bytes : 1);
            r = kv && ids_kv ? 0 : cs_fail(CS_ENOMEM, "out of memory for the KV pages");
            if (!r) {
                int32_t got = cs_page_table_xfer(&ev.pt, kvc, n, 0, ev.pt.n_pages, ids_kv);
                r = got < 0 ? got : cs_engine_kv_export(ev.engine, ids_kv, got, kv);
            }
            /* positions past the prompt in its last block's pages hold whatever
             * a reused page held: zeroed, so the file is the prompt's alone */
            int32_t ps = cs_kv_cache_page_size(kvc), used = n % ps;
            size_t pb = cs_engine_page_bytes(ev.engine);
            size_t slot = pb / ((size_t)cs_engine_kv_layers(ev.engine) * 2 * (size_t)ps);
            for (int32_t j = 0; !r && used && j < cs_kv_cache_per_block(kvc); j++)
                for (size_t half = 0; half < (size_t)cs_engine_kv_layers(ev.engine) * 2; half++)
                    memset((char *)kv + (size_t)(n_ids - 1 - j) * pb + half * slot * (size_t)ps +
                               (size_t)used * slot,
                           0, (size_t)(ps - used) * slot);
            free(ids_kv);
        }
    } else if (!r) {
        r = cs_ref_seq_init(m, n, &ev.ref);
        if (!r) r = cs_ref_seq_eval(ev.ref, ids, n, true, logits);
    }
    if (r) {
        fail_msg("logits", r);
    } else if (write_file(o->out, logits, sizeof(float) * (size_t)c->n_vocab * (size_t)rows) ||
               (o->kv_out && write_file(o->kv_out, kv, kv_bytes))) {
        fprintf(stderr, "chunkserve: logits: cannot write: %s\n", strerror(errno));
    } else {
        rc = 0;
    }
    eval_free(&ev);
    free(kv);
    free(logits);
    free(ids);
    return rc;
}

static int cmd_generate(const cs_model *m, const options *o) {
    if (!o->prompt == !o->ids) {
        fprintf(stderr, "chunkserve: generate needs --prompt TEXT or --ids 1,2,3 (one of them)\n");
        return 2;
    }
    if (o->max_tokens < 1) {
        fprintf(stderr, "chunkserve: --max-tokens must be at least 1\n");
        return 2;
    }
    if (o->spec.mode && strcmp(o->spec.mode, "off") != 0) {
        fprintf(stderr, "chunkserve: generate decodes one token a step: --speculative is for "
                        "serve and the decode worker\n");
        return 2;
    }
    const cs_tokenizer *tok = cs_model_tokenizer(m);
    const cs_model_config *c = cs_model_get_config(m);
    cs_sampling_params sp = cs_cli_sampling_params(&o->sampling);
    char *text = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    cs_sampler *smp = NULL;
    evaluator ev;
    memset(&ev, 0, sizeof ev);
    float *logits = NULL;
    int r = cs_sampler_init(&sp, c->n_vocab, &smp);
    if (!r && o->chat && o->ids) r = cs_fail(CS_EINVAL, "--chat needs --prompt text, not --ids");
    if (!r && o->chat) {
        cs_chat_message msgs[2];
        size_t n = 0;
        if (o->system) msgs[n++] = (cs_chat_message){.role = "system", .content = o->system};
        msgs[n++] = (cs_chat_message){.role = "user", .content = o->prompt};
        r = cs_tokenizer_apply_chat(tok, msgs, n, CS_CHAT_GENERATION_PROMPT, &text);
    }
    const char *prompt = text ? text : o->prompt;
    if (!r && o->ids) {
        int32_t n = 0;
        r = parse_ids(o->ids, &ids, &n);
        n_ids = (size_t)n;
        for (size_t i = 0; !r && i < n_ids; i++)
            if (ids[i] < 0 || ids[i] >= c->n_vocab)
                r = cs_fail(CS_EINVAL, "token id %d is outside the vocabulary (0..%d)", ids[i],
                            c->n_vocab - 1);
    } else if (!r) {
        r = cs_tokenizer_encode(tok, prompt, strlen(prompt), true, true, &ids, &n_ids);
    }
    if (!r && n_ids == 0) r = cs_fail(CS_EINVAL, "the prompt is empty");
    if (!r && (long)n_ids >= c->ctx_len)
        r = cs_fail(CS_EINVAL, "the prompt has %zu tokens; the model's context is %d", n_ids,
                    c->ctx_len);
    long total = (long)n_ids + o->max_tokens;
    if (total > c->ctx_len) total = c->ctx_len;
    if (!r) r = eval_init(&ev, m, o, (int32_t)total);
    if (!r && !(logits = malloc((size_t)c->n_vocab * sizeof(float))))
        r = cs_fail(CS_ENOMEM, "out of memory");
    if (r) {
        int rc = fail_msg("generate", r);
        free(text), free(ids), free(logits);
        cs_sampler_free(smp);
        eval_free(&ev);
        return rc;
    }
    cs_sampler_accept_prompt(smp, ids, n_ids);
    double t0 = cs_now();
    r = eval_tokens(&ev, ids, (int32_t)n_ids, 0, logits);
    double t1 = cs_now();
    cs_detok dt;
    cs_detok_init(&dt, tok, true);
    char buf[1024];
    size_t len;
    long generated = 0, pos = (long)n_ids;
    const char *reason = "length";
    while (!r) {
        int32_t id = cs_sampler_sample(smp, logits, 0, NULL);
        cs_sampler_accept(smp, id);
        generated++;
        if (!o->ignore_eos && cs_tokenizer_is_eog(tok, id)) {
            reason = "stop";
            break;
        }
        if (cs_detok_push(&dt, id, buf, sizeof buf, &len) == 0 && len) {
            fwrite(buf, 1, len, stdout);
            fflush(stdout);
        }
        if (generated >= o->max_tokens || pos >= total) break;
        r = eval_tokens(&ev, &id, 1, (int32_t)pos++, logits);
    }
    if (cs_detok_flush(&dt, buf, sizeof buf, &len) == 0 && len) fwrite(buf, 1, len, stdout);
    putchar('\n');
    fflush(stdout);
    double t2 = cs_now();
    int rc = 0;
    if (r)
        rc = fail_msg("generate", r);
    else
        CS_LOGI("prompt %zu tokens in %.3f s (%.1f tok/s); generated %ld tokens in %.3f s (%.1f "
                "tok/s); finish: %s",
                n_ids, t1 - t0, (double)n_ids / (t1 - t0), generated, t2 - t1,
                generated > 1 ? (double)(generated - 1) / (t2 - t1) : 0.0, reason);
    free(logits);
    eval_free(&ev);
    free(ids);
    free(text);
    cs_sampler_free(smp);
    return rc;
}

static int cmd_serve(const cs_model *m, const options *o) {
    cs_server_opts so = {.host = o->host, .model_path = o->model, .grace_ms = (int32_t)o->grace_ms};
    so.engine = cs_engine_params_default();
    so.sched = cs_sched_params_default();
    int r = parse_budget(o->budget, &so.sched.max_num_batched_tokens);
    if (r) return fail_msg("serve", r);
    if (o->port < 0 || o->port > 65535 || o->http_port < 0 || o->http_port > 65535 ||
        o->page_size < 1 || o->page_size > 4096 || o->kv_mib < 1 || o->threads < 0 ||
        o->max_num_seqs < 1 || o->max_queue < 1 || o->grace_ms < 0 || o->grace_ms > 600000 ||
        o->max_chunk_tokens < 0 || o->max_chunk_tokens > (1 << 30) ||
        !(o->step_time_target_ms >= 0 && o->step_time_target_ms <= 1e7)) {
        fprintf(stderr,
                "chunkserve: serve: --port and --http-port must be 0..65535, --page-size 1..4096, "
                "--kv-cache-mib >= 1, "
                "--threads >= 0, --max-num-seqs >= 1, --max-queue >= 1, --grace-ms 0..600000, "
                "--max-chunk-tokens 0..2^30, --step-time-target-ms 0..1e7\n");
        return 2;
    }
    so.port = (int)o->port;
    so.http_host = o->http_host;
    so.http_port = (int)o->http_port;
    so.engine.page_size = (int32_t)o->page_size;
    so.engine.kv_bytes = (size_t)o->kv_mib << 20;
    so.engine.n_threads = (int32_t)o->threads;
    so.engine.kv_bf16 = o->kv_bf16;
    so.sched.max_num_seqs = (int32_t)o->max_num_seqs;
    so.sched.max_chunk_tokens = (int32_t)o->max_chunk_tokens;
    so.sched.step_time_target_ms = o->step_time_target_ms;
    if ((r = cs_spec_opts_apply(&o->spec, &so.sched))) return fail_msg("serve", r);
    so.spec = o->spec;
    static cs_tenant_opts tenants; /* parsed here; outlives the scheduler's init */
    tenants = o->tenants;
    if ((r = cs_tenant_opts_apply(&tenants, &so.sched))) return fail_msg("serve", r);
    so.slo = o->slo;
    if ((r = cs_slo_opts_apply(&so.slo))) return fail_msg("serve", r);
    so.max_queue = (int32_t)o->max_queue;
    so.openai = o->openai;
    so.rpc = o->rpc;
    so.tls = o->tls;
    r = cs_server_run(m, &so);
    return r ? fail_msg("serve", r) : 0;
}

static int cmd_info(const cs_model *m) {
    const cs_model_config *c = cs_model_get_config(m);
    printf("{\"arch\":\"%s\",\"n_vocab\":%d,\"dim\":%d,\"n_layers\":%d,\"n_heads\":%d,\"n_kv_"
           "heads\":%d,"
           "\"head_dim\":%d,\"hidden_dim\":%d,\"ctx_len\":%d,\"norm_eps\":%g,\"rope_theta\":%g,"
           "\"tied_embeddings\":%s,\"qkv_bias\":%s,\"qk_norm\":%s,\"post_norms\":%s,"
           "\"activation\":\"%s\",\"embed_scale\":%g,\"attn_scale\":%g,\"sliding_window\":%d,"
           "\"layer_windows\":[",
           c->arch, c->n_vocab, c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim,
           c->hidden_dim, c->ctx_len, c->norm_eps, c->rope_theta,
           c->tied_embeddings ? "true" : "false", c->qkv_bias ? "true" : "false",
           c->qk_norm ? "true" : "false", c->post_norms ? "true" : "false",
           c->gelu ? "gelu_tanh" : "silu", c->embed_scale, c->attn_scale, c->sliding_window);
    for (int l = 0; l < c->n_layers; l++)
        printf("%s%d", l ? "," : "", cs_model_layer_window(c, l));
    printf("],\"rope_theta_swa\":%g,\"weight_bytes\":%zu,\"weights\":\"%s\"}\n",
           c->sliding_window ? c->rope_theta_swa : 0.0, cs_model_weight_bytes(m),
           cs_model_weight_desc(m));
    return 0;
}

/* ----------------------------------------------------- command table -- */

/* What a command needs before it runs: nothing but its argv (it parses its
 * own table), the tokenizer alone, or the whole model. */
enum cmd_needs { CMD_ARGV, CMD_FILE, CMD_TOKENIZER, CMD_MODEL };

typedef struct {
    const cs_model *m;
    const cs_tokenizer *tok;
    const options *o;
    int argc;
    char **argv;
} cmd_ctx;

static int run_generate(const cmd_ctx *c) {
    return cmd_generate(c->m, c->o);
}
static int run_serve(const cmd_ctx *c) {
    return cmd_serve(c->m, c->o);
}
static int run_cluster(const cmd_ctx *c) {
    return cs_cli_cluster(c->argc, c->argv);
}
static int run_tokenize(const cmd_ctx *c) {
    return cmd_tokenize(c->tok, c->o);
}
static int run_detokenize(const cmd_ctx *c) {
    return cmd_detokenize(c->tok);
}
static int run_chat_format(const cmd_ctx *c) {
    return cmd_chat_format(c->tok, c->o);
}
static int run_logits(const cmd_ctx *c) {
    return cmd_logits(c->m, c->o);
}
/* tensor: one GGUF tensor as raw float32 (--out), as --exact loads it. */
static int run_tensor(const cmd_ctx *c) {
    const options *o = c->o;
    if (!o->tensor || !o->out) {
        fprintf(stderr, "chunkserve tensor: needs --tensor NAME and --out FILE\n");
        return 2;
    }
    float *f;
    int64_t n;
    int r = cs_gguf_tensor_f32(o->model, o->tensor, &f, &n);
    if (r) return fail_msg("tensor", r);
    FILE *fp = fopen(o->out, "wb");
    bool ok = fp && fwrite(f, sizeof(float), (size_t)n, fp) == (size_t)n;
    if (fp && fclose(fp)) ok = false;
    free(f);
    if (!ok) {
        fprintf(stderr, "chunkserve tensor: cannot write %s: %s\n", o->out, strerror(errno));
        struct stat st; /* no half-written file left behind (never unlink a device) */
        if (stat(o->out, &st) == 0 && S_ISREG(st.st_mode)) unlink(o->out);
        return 1;
    }
    fprintf(stderr, "%s: %lld float32 values -> %s\n", o->tensor, (long long)n, o->out);
    return 0;
}
static int run_info(const cmd_ctx *c) {
    return cmd_info(c->m);
}
static int run_bench_engine(const cmd_ctx *c) {
    return cs_cli_bench_engine(c->m, (int)c->o->threads, (int)c->o->prompt_tokens, c->o->kv_bf16);
}
static int run_bench(const cmd_ctx *c) {
    if (c->argc >= 3 && !strcmp(c->argv[2], "serve"))
        return cs_cli_bench_serve(c->argc, c->argv, 3);
    fprintf(stderr, "usage: chunkserve bench serve --target HOST:PORT [options]\n"
                    "       chunkserve bench serve --help\n");
    return 2;
}
static int run_tune(const cmd_ctx *c) {
    return cs_cli_tune(c->argc, c->argv);
}
static int run_bench_local(const cmd_ctx *c) {
    const options *o = c->o;
    return cs_cli_bench_local(c->m, (int)o->threads, o->duration, o->budgets,
                              cs_cli_sampling_params(&o->sampling).seed, o->out);
}

static const struct command {
    const char *name; /* argv[1] */
    enum cmd_needs needs;
    int (*run)(const cmd_ctx *c);
    const char *summary; /* the usage text's line(s) */
} commands[] = {
    {"generate", CMD_MODEL, run_generate,
     "generate text from --prompt, one sequence on the engine (--reference: fp32 reference path)"},
    {"serve", CMD_MODEL, run_serve,
     "the gRPC Generation service on --host:--port until SIGTERM (one process)"},
    {"cluster", CMD_ARGV, run_cluster,
     "up: a local disaggregated cluster, prefill + decode workers behind the router\n"
     "(chunkserve cluster up --help)"},
    {"tokenize", CMD_TOKENIZER, run_tokenize,
     "JSON lines of strings on stdin -> JSON arrays of ids"},
    {"detokenize", CMD_TOKENIZER, run_detokenize,
     "JSON lines of id arrays on stdin -> JSON strings"},
    {"chat-format", CMD_TOKENIZER, run_chat_format,
     "a JSON array of {role, content} on stdin -> rendered prompt"},
    {"logits", CMD_MODEL, run_logits,
     "--ids 1,2,3 --out FILE: float32 logits of every position (fp32 reference), or with\n"
     "--engine the engine's last-position logits (and --kv-out FILE its KV pages)"},
    {"info", CMD_MODEL, run_info, "print the model's configuration"},
    {"tensor", CMD_FILE, run_tensor,
     "--tensor NAME --out FILE: one GGUF tensor as raw float32, dequantized as --exact loads it"},
    {"bench-engine", CMD_MODEL, run_bench_engine,
     "engine speed vs GEMM rate, memory bandwidth, chunk sizes (--prompt-tokens)"},
    {"bench", CMD_ARGV, run_bench,
     "serve --target HOST:PORT: load a running deployment, report latency percentiles,\n"
     "throughput and goodput under an SLO (chunkserve bench serve --help)"},
    {"tune", CMD_ARGV, run_tune,
     "start candidate configurations here, bench each, recommend budgets and the P:D ratio\n"
     "for an SLO (chunkserve tune --help)"},
    {"bench-local", CMD_MODEL, run_bench_local,
     "chat streams + long prompts per step budget (--duration, --budgets, --seed)"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

/* commands_help from the table: each summary line indented under the first. */
static void make_commands_help(void) {
    FILE *f = fmemopen(commands_help, sizeof commands_help, "w");
    CS_ASSERT(f);
    fprintf(f, "commands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++) {
        fprintf(f, "  %-13s", commands[i].name);
        for (const char *p = commands[i].summary; *p; p++) {
            fputc(*p, f);
            if (*p == '\n') fprintf(f, "  %-13s", "");
        }
        fputc('\n', f);
    }
    CS_ASSERT(ftell(f) < (long)sizeof commands_help);
    fclose(f);
}

static void print_usage(FILE *f) {
    size_t n;
    const cs_config_entry *table = all_options(&n);
    cs_config_print_help(table, n, "chunkserve COMMAND", commands_help, f);
}

static const struct command *find_command(const char *name) {
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

int main(int argc, char **argv) {
    cs_op_blas_fix_coretype(argv);
    cs_log_set_role(argc > 1 && !strcmp(argv[1], "serve") ? "serve" : "cli");
    make_commands_help();
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        print_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const struct command *cmd = find_command(argv[1]);
    if (!cmd) {
        fprintf(stderr, "chunkserve: unknown command '%s' (see --help)\n", argv[1]);
        return 2;
    }
    cmd_ctx c = {.argc = argc, .argv = argv};
    if (cmd->needs == CMD_ARGV) return cmd->run(&c);
    options o;
    int pr = parse_options(argc, argv, &o);
    if (pr) return pr > 0 ? 0 : 2;
    if (o.verbose) cs_log_set_level(CS_LOG_DEBUG);
    if (!o.model) {
        fprintf(stderr, "chunkserve: %s needs --model PATH\n", cmd->name);
        return 2;
    }
    c.o = &o;
    int r, rc;
    if (cmd->needs == CMD_FILE) return cmd->run(&c);
    if (cmd->needs == CMD_TOKENIZER) {
        cs_tokenizer *tok = NULL;
        if ((r = cs_tokenizer_load(o.model, &tok))) return fail_msg("loading tokenizer", r);
        c.tok = tok;
        rc = cmd->run(&c);
        cs_tokenizer_free(tok);
        return rc;
    }
    cs_model *m = NULL;
    /* the reference forward and the CUDA backend run fp32 weights */
    bool fp32 = o.exact || o.reference || (!strcmp(cmd->name, "logits") && !o.engine);
    cs_weight_mode mode = fp32 ? CS_WEIGHTS_EXACT : CS_WEIGHTS_AUTO;
    if ((r = cs_model_load_mode(o.model, mode, &m))) return fail_msg("loading model", r);
    c.m = m;
    rc = cmd->run(&c);
    cs_model_free(m);
    return rc;
}
