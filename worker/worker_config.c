/* worker_config.c: the options both workers have (worker.h), joined with
 * the gRPC port's, TLS's and the role's own into each worker's table
 * (cs_worker_main). The port, the step budget and the chunking defaults
 * are the role's (cs_worker_role.config_defaults). */
#include <stddef.h>

#include "worker.h"

#define W(f) offsetof(cs_worker_opts, f)
const cs_config_entry cs_worker_config[] = {
    {"model", CS_CONFIG_STR, W(model), NULL,
     "model: a .gguf file or a Hugging Face directory (required)", 0, 0},
    {"host", CS_CONFIG_STR, W(host), "127.0.0.1",
     "address of the gRPC port (0.0.0.0 = all interfaces)", 0, 0},
    {"port", CS_CONFIG_INT, W(port), "50060",
     "gRPC port (chunkserve.v1.Worker + health); 0 = any free port", 0, 65535},
    {"http-host", CS_CONFIG_STR, W(http_host), "127.0.0.1",
     "address of the HTTP port (/metrics, /healthz, /readyz)", 0, 0},
    {"http-port", CS_CONFIG_INT, W(http_port), "0", "HTTP port; 0 = any free port", 0, 65535},
    {"worker-id", CS_CONFIG_STR, W(worker_id), NULL,
     "stable name in logs and status (default ROLE-HOST:PORT)", 0, 0},
    {"cluster-secret", CS_CONFIG_SECRET, W(cluster_secret), NULL,
     "the cluster's shared secret (>= 16 bytes): worker RPCs must carry its token; unset = trust "
     "the network",
     0, 0},
    {"cluster-secret-file", CS_CONFIG_STR, W(cluster_secret_file), NULL,
     "file holding the cluster secret (a mounted Kubernetes Secret)", 0, 0},
    {"max-batched-tokens", CS_CONFIG_INT, W(max_batched_tokens), "512",
     "step token budget (decodes first, prompt chunks fill the rest); 0 = unlimited", 0, 1 << 30},
    {"max-num-seqs", CS_CONFIG_INT, W(max_num_seqs), "256", "running sequences at most", 1,
     1 << 20},
    {"max-partial-prefills", CS_CONFIG_INT, W(max_partial_prefills), "4",
     "prompts part-way through prefill at once (1 = one at a time, in arrival order)", 1, 1 << 20},
    {"max-chunk-tokens", CS_CONFIG_INT, W(max_chunk_tokens), "0",
     "one prompt's chunk per step at most; 0 = the budget (smaller: pages stream while the next "
     "chunk computes)",
     0, 1 << 30},
    {"prefix-summary-ms", CS_CONFIG_INT, W(prefix_summary_ms), "1000",
     "publish what the prefix cache holds (a Bloom filter in GetStatus, for the router's "
     "prefix-aware placement), rebuilt at most this often; 0 = off",
     0, 3600000},
    {"step-time-target-ms", CS_CONFIG_DOUBLE, W(step_time_target_ms), "0",
     "size prompt chunks so each step's predicted time (fitted online from measured steps) stays "
     "within this many ms; decodes first, the token budget still caps; 0 = off",
     0, 1e7},
    {"page-size", CS_CONFIG_INT, W(page_size), "16", "tokens per KV page", 1, 4096},
    {"kv-cache-mib", CS_CONFIG_INT, W(kv_cache_mib), "1024", "KV-cache pool size in MiB", 1,
     1 << 24},
    {"threads", CS_CONFIG_INT, W(threads), "0", "CPU threads for the engine; 0 = one per core", 0,
     4096},
    {"kv-bf16", CS_CONFIG_BOOL, W(kv_bf16), "false",
     "CPU backend: KV pages in bf16 (half the memory and transfer bytes); a prefill and a decode "
     "worker pair only when their KV dtypes match",
     0, 0},
    {"exact", CS_CONFIG_BOOL, W(exact), "false",
     "fp32 weights (quantized files dequantized at load); default: a Q4_0/Q4_1/Q8_0 file keeps its "
     "blocks and runs the CPU's integer kernels (every worker of a cluster must use the same mode)",
     0, 0},
    {"prefix-caching", CS_CONFIG_BOOL, W(prefix_caching), "true",
     "reuse KV pages of prompts with the same prefix", 0, 0},
    {"max-queue", CS_CONFIG_INT, W(max_queue), "1024",
     "requests held at most; more are refused with RESOURCE_EXHAUSTED", 1, 1 << 24},
    {"grace-ms", CS_CONFIG_INT, W(grace_ms), "5000",
     "on SIGTERM/SIGINT: time calls get to finish before they are cancelled", 0, 3600000},
    {"kv-dead-ms", CS_CONFIG_INT, W(kv_dead_ms), "5000",
     "KV channel: a peer silent this long (despite keepalives) is dead", 100, 3600000},
    {"kv-checksum", CS_CONFIG_BOOL, W(kv_checksum), "true",
     "checksum (XXH3-64) of every KV chunk's payload", 0, 0},
    {"verbose", CS_CONFIG_BOOL, W(verbose), "false", "debug logging", 0, 0},
};
const size_t cs_worker_config_n = sizeof cs_worker_config / sizeof cs_worker_config[0];
