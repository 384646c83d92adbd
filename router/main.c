/* main.c: `chunkserve-router`: parse the option table (flags, CHUNKSERVE_*
 * variables, --help), load the model's vocabulary, run the router, free in
 * reverse order. Everything else is in router.c and pool.c. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chunkserve/config.h"
#include "chunkserve/model.h"
#include "chunkserve/proc.h"
#include "router.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

#define O(f) offsetof(cs_router_opts, f)
#define I64 9.2e18
/* The one table: flags, CHUNKSERVE_<NAME> variables, --help and Helm values. */
static const cs_config_entry options[] = {
    {"host", CS_CONFIG_STR, O(host), "127.0.0.1", "address the gRPC API binds", 0, 0},
    {"port", CS_CONFIG_INT, O(port), "50050", "gRPC port (0 = any free port)", 0, 65535},
    {"http-host", CS_CONFIG_STR, O(http_host), NULL,
     "address /metrics, /healthz, /readyz bind (default: host)", 0, 0},
    {"http-port", CS_CONFIG_INT, O(http_port), "0", "HTTP port (0 = any free port)", 0, 65535},
    {"model", CS_CONFIG_STR, O(model), NULL,
     "model file (.gguf) or Hugging Face directory: its tokenizer and config (required)", 0, 0},
    {"prefill-workers", CS_CONFIG_STR, O(prefill_workers), NULL,
     "static prefill workers: host:port,host:port", 0, 0},
    {"decode-workers", CS_CONFIG_STR, O(decode_workers), NULL,
     "static decode workers: host:port,host:port", 0, 0},
    {"prefill-dns", CS_CONFIG_STR, O(prefill_dns), NULL,
     "DNS name:port whose A/AAAA records are prefill workers (a headless Service)", 0, 0},
    {"decode-dns", CS_CONFIG_STR, O(decode_dns), NULL,
     "DNS name:port whose A/AAAA records are decode workers", 0, 0},
    {"dns-refresh-ms", CS_CONFIG_INT, O(dns_refresh_ms), "5000",
     "re-resolve the DNS names this often", 100, 3600000},
    {"status-interval-ms", CS_CONFIG_INT, O(status_interval_ms), "200",
     "poll every worker's status this often", 10, 60000},
    {"autoscale-window-s", CS_CONFIG_DOUBLE, O(autoscale_window_s), "10",
     "the leading autoscaling signal (chunkserve:pool_replicas_wanted): the window of its token "
     "rates, seconds",
     0.5, 3600},
    {"autoscale-utilization", CS_CONFIG_DOUBLE, O(autoscale_utilization), "0.8",
     "the leading autoscaling signal: the share of a replica's measured capacity (its prefill "
     "or decode tokens/s at its step-time target) one replica may run at",
     0.05, 1},
    {"autoscale-drain-s", CS_CONFIG_DOUBLE, O(autoscale_drain_s), "10",
     "the leading autoscaling signal: the prompt tokens of requests waiting for their first "
     "token count as replicas that would serve them within this many seconds",
     0.05, 3600},
    {"local-prefill-threshold", CS_CONFIG_INT, O(local_prefill_threshold), "512",
     "contexts shorter than this (tokens, less the ones predicted cached on the decode worker) "
     "prefill on the decode worker (and longer ones whose --ttft-slo-ms bound only the decode "
     "worker is predicted to meet)",
     0, 1e9},
    {"prefix-routing", CS_CONFIG_BOOL, O(prefix_routing), "true",
     "place requests where their prompt's KV pages are predicted cached (the pages of requests "
     "this router placed there), balanced against load",
     0, 0},
    {"prefix-balance-seqs", CS_CONFIG_INT, O(prefix_balance_seqs), "4",
     "decode: a worker holding the prompt is chosen while its running + waiting sequences are "
     "at most this many above the least loaded's",
     0, 1e6},
    {"prefix-balance-tokens", CS_CONFIG_INT, O(prefix_balance_tokens), "8192",
     "prefill: the same, in queued prompt tokens", 0, 1e12},
    {"prefix-ttl-ms", CS_CONFIG_INT, O(prefix_ttl_ms), "600000",
     "a page recorded on a worker counts as cached there this long", 1, I64},
    {"prefix-index-pages", CS_CONFIG_INT, O(prefix_index_pages), "65536",
     "page hashes remembered per worker (the oldest go first)", 1, 1 << 26},
    {"max-inflight", CS_CONFIG_INT, O(max_inflight), "256", "requests placed on workers at once", 1,
     1e6},
    {"max-queue", CS_CONFIG_INT, O(max_queue), "1024",
     "requests waiting beyond max-inflight; more are refused (RESOURCE_EXHAUSTED)", 0, 1e7},
    {"queue-timeout-ms", CS_CONFIG_INT, O(queue_timeout_ms), "30000",
     "longest wait for a slot or for KV room (then RESOURCE_EXHAUSTED)", 1, I64},
    {"no-worker-wait-ms", CS_CONFIG_INT, O(no_worker_wait_ms), "2000",
     "longest wait for a usable decode worker (then UNAVAILABLE)", 0, I64},
    {"max-retries", CS_CONFIG_INT, O(max_retries), "3",
     "failed attempts retried or migrated before UNAVAILABLE", 0, 100},
    {"cluster-secret", CS_CONFIG_SECRET, O(cluster_secret), NULL,
     "the cluster's shared secret (>= 16 bytes): calls to workers carry its token; unset = "
     "trust the network",
     0, 0},
    {"cluster-secret-file", CS_CONFIG_STR, O(cluster_secret_file), NULL,
     "file holding the cluster secret (a mounted Kubernetes Secret)", 0, 0},
    {"lease-ms", CS_CONFIG_INT, O(lease_ms), "10000",
     "how long a decode worker holds reserved pages for the KV without a renewal from the "
     "prefill worker (DecodeRequest.lease_ms; the worker's --lease-ms caps it)",
     1, 2147483647},
    {"request-timeout-ms", CS_CONFIG_INT, O(request_timeout_ms), "600000",
     "deadline of a request whose client sets none", 1, I64},
    {"ready-without-workers", CS_CONFIG_BOOL, O(ready_without_workers), "false",
     "/readyz answers 200 even when no decode worker is usable (Kubernetes: keeps the router's "
     "Service up while a pool scales or restarts; requests then wait up to no-worker-wait-ms)",
     0, 0},
    {"fault-migrate-every", CS_CONFIG_INT, O(fault_migrate_every), "0",
     "fault injection (tests): after every Nth message relayed, drop the stream's worker calls "
     "as if its decode worker had failed (blaming nobody) and migrate it; 0 = off",
     0, 1000000},
    {"worker-tls-ca-file", CS_CONFIG_STR, O(worker_tls.ca_file), NULL,
     "PEM roots: talk TLS to the workers and check their certificates against these", 0, 0},
    {"worker-tls-cert-file", CS_CONFIG_STR, O(worker_tls.cert_file), NULL,
     "PEM certificate the router presents to the workers (their --tls-client-ca-file)", 0, 0},
    {"worker-tls-key-file", CS_CONFIG_STR, O(worker_tls.key_file), NULL,
     "PEM private key of --worker-tls-cert-file", 0, 0},
    {"worker-tls-server-name", CS_CONFIG_STR, O(worker_tls.server_name), NULL,
     "name the workers' certificates must carry (default: each worker's host)", 0, 0},
    {"grace-ms", CS_CONFIG_INT, O(grace_ms), "5000",
     "on SIGTERM/SIGINT: time streams get to finish", 0, 3600000},
    {"log-level", CS_CONFIG_STR, O(log_level), "info", "error, warn, info or debug", 0, 0},
    {"verbose", CS_CONFIG_BOOL, O(verbose), "false", "debug logging (same as --log-level debug)", 0,
     0},
};
#undef O
#define N_OPTIONS (sizeof options / sizeof options[0])

static const char *summary =
    "The chunkserve router: serves chunkserve.v1.Generation and grpc.health.v1 to clients and\n"
    "places requests on the prefill and decode worker pools.";

static int log_level(const char *s) {
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (!strcasecmp(s, names[i])) return i;
    return -1;
}

int main(int argc, char **argv) {
    cs_log_set_role("router");
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--metrics-json")) { /* the metrics table, for tools and dashboards */
            cs_router_print_metrics_json(stdout);
            return 0;
        }
    cs_router_opts o;
    memset(&o, 0, sizeof o);
    /* the router's own options, then the OpenAI door's, the gRPC port's, TLS's */
    const cs_config_part parts[] = {
        {options, N_OPTIONS, 0},
        {cs_openai_config_table, cs_openai_config_n, offsetof(cs_router_opts, openai)},
        {cs_proc_rpc_config, cs_proc_rpc_config_n, offsetof(cs_router_opts, rpc)},
        {cs_proc_tls_config, cs_proc_tls_config_n, offsetof(cs_router_opts, tls)},
        {cs_slo_config, cs_slo_config_n, offsetof(cs_router_opts, slo)},
    };
    cs_config_entry *table;
    size_t n_table;
    int rc = cs_config_join(parts, sizeof parts / sizeof parts[0], NULL, 0, &table, &n_table);
    if (!rc) rc = cs_config_parse(table, n_table, &o, argc, argv, 1, "chunkserve-router", summary);
    if (rc) free(table);
    if (rc == 1) return 0; /* --help */
    if (rc) {
        fprintf(stderr, "chunkserve-router: %s (see --help)\n", cs_last_error());
        return 2;
    }
    o.worker_tls.reload_s = o.tls.reload_s; /* one interval for every credential */
    int level = log_level(o.log_level);
    if (level >= 0) cs_log_set_level(o.verbose ? CS_LOG_DEBUG : level);
    if (level >= 0 && cs_log_level() >= CS_LOG_DEBUG) cs_config_dump(table, n_table, &o, stderr);
    free(table);
    if (level < 0) {
        fprintf(stderr, "chunkserve-router: --log-level: '%s' is not error, warn, info or debug\n",
                o.log_level);
        return 2;
    }
    if (!o.model || !o.model[0]) {
        fprintf(stderr, "chunkserve-router: --model (or CHUNKSERVE_MODEL) is required\n");
        return 2;
    }
    if (cs_slo_opts_apply(&o.slo)) {
        fprintf(stderr, "chunkserve-router: %s\n", cs_last_error());
        return 2;
    }

    cs_model *model = NULL;
    if ((rc = cs_model_load_vocab(o.model, &model))) {
        fprintf(stderr, "chunkserve-router: %s\n", cs_last_error());
        return 1;
    }
    rc = cs_router_run(model, &o);
    cs_model_free(model);
    if (rc) {
        fprintf(stderr, "chunkserve-router: %s\n", cs_last_error());
        return 1;
    }
    return 0;
}
