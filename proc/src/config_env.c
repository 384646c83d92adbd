/* config_env.c: the CHUNKSERVE_* variables a process refuses (a typo such
 * as CHUNKSERVE_MAX_BATCH_TOKENS would otherwise start with the default and
 * say nothing). One environment is often shared by several chunkserve
 * processes (`chunkserve cluster up` passes its own on to the router and
 * workers; a shell exports one set for all), so a variable that is a flag of
 * any of them is not a typo; it is only refused when nobody reads it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "config-impl.h"

extern char **environ;

/* The flags of every chunkserve process and command, as variables without
 * the CHUNKSERVE_ prefix: the union of their tables (`--help-json` of
 * chunkserve generate, bench serve, tune, cluster up, chunkserve-router,
 * -prefill, -decode). tests/py/test_config_env.py checks that this list
 * equals that union, so a new flag that is missing here fails a test. */
static const char *const family_flags[] = {
    "API_KEY",
    "API_KEY_FILE",
    "ARRIVAL",
    "AUTOSCALE_DRAIN_S",
    "AUTOSCALE_UTILIZATION",
    "AUTOSCALE_WINDOW_S",
    "BUDGETS",
    "BURSTINESS",
    "CACHE_SALT",
    "CHAT",
    "CLUSTER_SECRET",
    "CLUSTER_SECRET_FILE",
    "CONCURRENCY",
    "CONNECT_TIMEOUT_MS",
    "CORES",
    "CORS_ALLOW_ORIGINS",
    "CREDENTIALS_RELOAD_S",
    "DECODE",
    "DECODE_BUDGET",
    "DECODE_DNS",
    "DECODE_THREADS",
    "DECODE_WORKERS",
    "DNS_REFRESH_MS",
    "DRY_RUN",
    "DURATION",
    "ENGINE",
    "EVERY_POSITION",
    "EXACT",
    "FAULT_MIGRATE_EVERY",
    "FREQUENCY_PENALTY",
    "GRACE_MS",
    "GRPC_KEEPALIVE_MS",
    "GRPC_KEEPALIVE_TIMEOUT_MS",
    "GRPC_MAX_CONNECTION_AGE_GRACE_MS",
    "GRPC_MAX_CONNECTION_AGE_MS",
    "GRPC_MAX_CONNECTION_IDLE_MS",
    "GRPC_MAX_HEALTH_WATCHES",
    "GRPC_MAX_STREAMS",
    "GRPC_MEMORY_MIB",
    "HOST",
    "HTTP_HOST",
    "HTTP_PORT",
    "IDS",
    "IGNORE_EOS",
    "KV_ADVERTISE",
    "KV_BF16",
    "KV_CACHE_MIB",
    "KV_CHECKSUM",
    "KV_DEADLINE_MS",
    "KV_DEAD_MS",
    "KV_HOST",
    "KV_OUT",
    "KV_PORT",
    "KV_QUEUE_MIB",
    "KV_RENEW_MS",
    "LEASE_MS",
    "LOCAL_PREFILL_THRESHOLD",
    "LOG_DIR",
    "LOG_LEVEL",
    "MAX_BATCHED_TOKENS",
    "MAX_CHUNK_TOKENS",
    "MAX_CONCURRENCY",
    "MAX_INFLIGHT",
    "MAX_NUM_SEQS",
    "MAX_PARTIAL_PREFILLS",
    "MAX_QUEUE",
    "MAX_REQUEST_BYTES",
    "MAX_RETRIES",
    "MAX_TOKENS",
    "MIN_P",
    "MODEL",
    "NO_GENERATION_PROMPT",
    "NO_IGNORE_EOS",
    "NO_SPECIAL",
    "NO_WORKER_WAIT_MS",
    "NUM_SPECULATIVE_TOKENS",
    "OPENAI_HOST",
    "OPENAI_IDLE_TIMEOUT_MS",
    "OPENAI_PORT",
    "OPENAI_REQUEST_TIMEOUT_MS",
    "OPENAI_TLS",
    "OUT",
    "PAGE_SIZE",
    "PORT",
    "PREFILL",
    "PREFILL_BUDGET",
    "PREFILL_BUDGETS",
    "PREFILL_DNS",
    "PREFILL_THREADS",
    "PREFILL_WORKERS",
    "PREFIX_BALANCE_SEQS",
    "PREFIX_BALANCE_TOKENS",
    "PREFIX_CACHING",
    "PREFIX_GROUPS",
    "PREFIX_INDEX_PAGES",
    "PREFIX_ROUTING",
    "PREFIX_SUMMARY_MS",
    "PREFIX_TOKENS",
    "PREFIX_TTL_MS",
    "PRESENCE_PENALTY",
    "PROMPT",
    "PROMPT_TOKENS",
    "QUEUE_TIMEOUT_MS",
    "QUIET",
    "RATES",
    "RATIOS",
    "READY_WITHOUT_WORKERS",
    "REFERENCE",
    "REPETITION_PENALTY",
    "REQUESTS",
    "REQUEST_TIMEOUT_MS",
    "SAVE_REQUESTS",
    "SECONDS_PER_POINT",
    "SEED",
    "SERVED_MODEL_NAME",
    "SLO_ITL_P99_MS",
    "SLO_TTFT_P99_MS",
    "SPECULATIVE",
    "SPECULATIVE_ALWAYS",
    "START_TIMEOUT_MS",
    "STATUS_INTERVAL_MS",
    "STEP_TARGETS",
    "STEP_TIME_TARGET_MS",
    "STOP_AFTER_MISS",
    "SYSTEM",
    "TARGET",
    "TEMPERATURE",
    "TENANTS",
    "TENANT_SHARES",
    "TENSOR",
    "THREADS",
    "TIMEOUT_MS",
    "TLS_CA_FILE",
    "TLS_CERT_FILE",
    "TLS_CLIENT_CA_FILE",
    "TLS_KEY_FILE",
    "TLS_SERVER_NAME",
    "TOP_K",
    "TOP_P",
    "TTFT_SLO_MS",
    "VERBOSE",
    "VOCAB_SIZE",
    "WARMUP",
    "WORKER_ID",
    "WORKER_TLS_CA_FILE",
    "WORKER_TLS_CERT_FILE",
    "WORKER_TLS_KEY_FILE",
    "WORKER_TLS_SERVER_NAME",
    "WORKLOAD",
};

/* Variables read outside the option tables: the compute backend and the CPU
 * kernel set (kernels/), the step trace (engine/src/serve.c), and the
 * scripts' and tests' (scripts/, tests/py/conftest.py). */
static const char *const other_vars[] = {
    "BACKEND", "CPU_KERNELS", "STEP_TRACE", "BIN_DIR", "EMU_BIN_DIR", "MODELS_DIR", "DEMO_PORT",
};

/* Kubernetes' service links: a pod that does not turn them off
 * (enableServiceLinks) gets, for each Service named e.g. chunkserve-router,
 * CHUNKSERVE_ROUTER_SERVICE_HOST, ..._SERVICE_PORT[_NAME] and
 * ..._PORT[_N_TCP[_PROTO|_PORT|_ADDR]]: not ours, and not typos. */
static bool service_link(const char *name, size_t len) {
    char buf[128];
    if (len >= sizeof buf) return false;
    memcpy(buf, name, len);
    buf[len] = 0;
    if (strstr(buf, "_SERVICE_HOST") || strstr(buf, "_SERVICE_PORT")) return true;
    for (const char *p = strstr(buf, "_PORT_"); p; p = strstr(p + 1, "_PORT_")) {
        const char *q = p + 6;
        if (*q < '0' || *q > '9') continue;
        while (*q >= '0' && *q <= '9')
            q++;
        if (!strncmp(q, "_TCP", 4) || !strncmp(q, "_UDP", 4) || !strncmp(q, "_SCTP", 5))
            return true;
    }
    /* the Service's own URL variable: SERVICE_PORT=tcp://10.0.0.1:50050 */
    const char *eq = name + len;
    return len > 5 && !strcmp(buf + len - 5, "_PORT") && !strncmp(eq + 1, "tcp://", 6);
}

static bool listed(const char *const *list, size_t n, const char *name, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (strlen(list[i]) == len && !memcmp(list[i], name, len)) return true;
    return false;
}

/* Edit distance of a[0..na) and b[0..nb), both at most 64 characters. */
static size_t distance(const char *a, size_t na, const char *b, size_t nb) {
    size_t row[65];
    for (size_t j = 0; j <= nb; j++)
        row[j] = j;
    for (size_t i = 1; i <= na; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= nb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[nb];
}

int cs__config_check_env(const cs_config_entry *table, size_t n) {
    static const char prefix[] = "CHUNKSERVE_";
    const size_t lp = sizeof prefix - 1;
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, prefix, lp) != 0) continue;
        const char *eq = strchr(*e, '=');
        if (!eq || !eq[1]) continue; /* an empty variable counts as unset */
        const char *name = *e + lp;
        size_t len = (size_t)(eq - name);
        bool mine = false;
        char var[96];
        for (size_t k = 0; k < n && !mine; k++) {
            cs__config_env_name(table[k].name, var, sizeof var);
            mine = strlen(var) == lp + len && !memcmp(var + lp, name, len);
        }
        if (mine || listed(family_flags, sizeof family_flags / sizeof *family_flags, name, len) ||
            listed(other_vars, sizeof other_vars / sizeof *other_vars, name, len) ||
            service_link(name, len))
            continue;
        /* the nearest name: this process's own first (a tie goes to it), then
         * the other processes' */
        char near[96] = "";
        size_t best = (size_t)-1;
        for (size_t k = 0; k < n && len <= 64; k++) {
            cs__config_env_name(table[k].name, var, sizeof var);
            size_t nv = strlen(var) - lp;
            if (nv > 64) continue;
            size_t d = distance(name, len, var + lp, nv);
            if (d < best) best = d, snprintf(near, sizeof near, "%s", var + lp);
        }
        for (size_t k = 0; k < sizeof family_flags / sizeof *family_flags && len <= 64; k++) {
            size_t d = distance(name, len, family_flags[k], strlen(family_flags[k]));
            if (d < best) best = d, snprintf(near, sizeof near, "%s", family_flags[k]);
        }
        char hint[128] = "";
        if (near[0] && best <= (len + 2) / 3)
            snprintf(hint, sizeof hint, " (did you mean %s%s?)", prefix, near);
        return cs_fail(CS_EINVAL,
                       "unknown environment variable %s%.*s%s: no chunkserve process reads it; "
                       "fix its name or unset it",
                       prefix, (int)(len < 80 ? len : 80), name, hint);
    }
    return 0;
}
