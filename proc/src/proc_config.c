/* proc_config.c: the option tables of the process shell's own parts (the
 * gRPC port's limits and TLS; chunkserve/proc.h), which every process joins
 * into its table (chunkserve/config.h). */
#include <stddef.h>

#include "chunkserve/proc.h"

#define L(f) offsetof(cs_rpc_limits, f)
const cs_config_entry cs_proc_rpc_config[] = {
    {"grpc-max-streams", CS_CONFIG_INT, L(max_streams), "4096",
     "gRPC: concurrent streams per connection (a client queues the rest)", 1, 1 << 20},
    {"grpc-memory-mib", CS_CONFIG_INT, L(memory_mib), "512",
     "gRPC: memory quota of the transport's buffers (full: smaller reads, new streams refused)", 16,
     1 << 20},
    {"grpc-max-connection-idle-ms", CS_CONFIG_INT, L(idle_ms), "300000",
     "gRPC: close a connection without calls after this long; -1 = never", -1, 86400000},
    {"grpc-max-connection-age-ms", CS_CONFIG_INT, L(age_ms), "0",
     "gRPC: send GOAWAY to a connection this old (clients reconnect, e.g. to rebalance); "
     "0 = never",
     0, 86400000},
    {"grpc-max-connection-age-grace-ms", CS_CONFIG_INT, L(age_grace_ms), "60000",
     "gRPC: after that GOAWAY, time the connection's calls get to finish", 1, 86400000},
    {"grpc-max-health-watches", CS_CONFIG_INT, L(max_watches), "256",
     "gRPC: grpc.health.v1 Health/Watch streams at once (more: RESOURCE_EXHAUSTED)", 1, 1 << 20},
    {"grpc-keepalive-ms", CS_CONFIG_INT, L(keepalive_ms), "60000",
     "gRPC: ping a client with calls open after this long without a frame from it", 1000, 86400000},
    {"grpc-keepalive-timeout-ms", CS_CONFIG_INT, L(keepalive_timeout_ms), "20000",
     "gRPC: a ping unanswered this long closes the connection and cancels its calls (a "
     "partitioned or dead client's streams end and free their KV pages)",
     1000, 86400000},
};
const size_t cs_proc_rpc_config_n = sizeof cs_proc_rpc_config / sizeof cs_proc_rpc_config[0];
#undef L

#define T(f) offsetof(cs_rpc_tls, f)
const cs_config_entry cs_proc_tls_config[] = {
    {"tls-cert-file", CS_CONFIG_STR, T(cert_file), NULL,
     "PEM certificate chain: the gRPC port speaks TLS (needs --tls-key-file)", 0, 0},
    {"tls-key-file", CS_CONFIG_STR, T(key_file), NULL, "PEM private key of --tls-cert-file", 0, 0},
    {"tls-client-ca-file", CS_CONFIG_STR, T(ca_file), NULL,
     "PEM roots: gRPC clients must present a certificate they signed (mutual TLS)", 0, 0},
    {"credentials-reload-s", CS_CONFIG_INT, T(reload_s), "10",
     "seconds between checks of the TLS files and --cluster-secret-file for a change (a "
     "rotation): new handshakes use the new files, open connections keep theirs",
     1, 86400},
};
const size_t cs_proc_tls_config_n = sizeof cs_proc_tls_config / sizeof cs_proc_tls_config[0];
#undef T
