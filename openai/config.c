/* config.c: the OpenAI door's options (openai.h), joined into the router's
 * and `chunkserve serve`'s tables. */
#include <stddef.h>

#include "openai.h"

#define C(f) offsetof(cs_openai_config, f)
const cs_config_entry cs_openai_config_table[] = {
    {"openai-host", CS_CONFIG_STR, C(host), NULL,
     "address of the OpenAI-compatible HTTP API (default: host)", 0, 0},
    {"openai-port", CS_CONFIG_INT, C(port), "-1",
     "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models); "
     "0 = any free port, -1 = off",
     -1, 65535},
    {"openai-tls", CS_CONFIG_BOOL, C(tls), "true",
     "the OpenAI HTTP API speaks TLS (HTTPS) with --tls-cert-file/--tls-key-file when they are "
     "set, as the gRPC port does; --no-openai-tls: plain HTTP (TLS ends in front of it, at an "
     "Ingress or Gateway)",
     0, 0},
    {"api-key", CS_CONFIG_SECRET, C(api_key), NULL,
     "API key the public API requires (repeat the flag, or comma-separate, for more): HTTP "
     "'Authorization: Bearer KEY', gRPC 'authorization' metadata; none = open",
     0, 0},
    {"api-key-file", CS_CONFIG_STR, C(api_key_file), NULL,
     "file with more API keys, one per line: KEY, or KEY TENANT (a request's tenant for "
     "--tenant-shares is its key's; a key naming none is a tenant of its own)",
     0, 0},
    {"cors-allow-origins", CS_CONFIG_STR, C(cors_allow_origins), NULL,
     "origins (comma-separated, * = any) browsers may call the HTTP API from; none = no CORS", 0,
     0},
    {"max-request-bytes", CS_CONFIG_INT, C(max_request_bytes), "4194304",
     "largest HTTP request body (413 beyond)", 1024, 1 << 30},
    {"openai-request-timeout-ms", CS_CONFIG_INT, C(request_timeout_ms), "30000",
     "deadline for an HTTP request's headers and body from its first byte (408 after; slow "
     "clients cannot hold a connection)",
     100, 3600000},
    {"openai-idle-timeout-ms", CS_CONFIG_INT, C(idle_timeout_ms), "30000",
     "an idle keep-alive HTTP connection is closed after this", 100, 3600000},
};
const size_t cs_openai_config_n = sizeof cs_openai_config_table / sizeof cs_openai_config_table[0];
