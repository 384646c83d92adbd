/* openai.h (openai/): the OpenAI-compatible HTTP API of the router and of
 * `chunkserve serve`, on a port of its own (the ops port keeps /metrics,
 * /healthz, /readyz):
 *
 *   POST /v1/chat/completions   chat.completion / SSE chat.completion.chunk
 *   POST /v1/completions        text_completion (also streamed)
 *   GET  /v1/models, /v1/models/{id}
 *
 * A request becomes one chunkserve.v1 GenerateRequest per choice (n per
 * prompt), handed to the process's own Generate (the same function its gRPC
 * door calls, through api/gen_call.h), so HTTP and gRPC validate, admit,
 * stream and refuse alike; gRPC statuses become HTTP ones (400, 404, 429
 * and 503 with Retry-After, 504, 500) with OpenAI error bodies
 * {"error":{"message","type","param","code"}}. Streams are Server-Sent
 * Events written as tokens come (no buffering); a client that goes away
 * cancels its choices (their pages are freed). Loop thread only. */
#ifndef CHUNKSERVE_OPENAI_H
#define CHUNKSERVE_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "chunkserve/config.h"
#include "gen_call.h"
#include "wire.h"

struct uv_loop_s;
typedef struct cs_openai cs_openai;

/* The public HTTP API's options (the router's, `chunkserve serve`'s): the
 * table cs_openai_config_table (offsets in cs_openai_config), which a
 * process joins at its member of this type (chunkserve/config.h). */
typedef struct {
    const char *host, *api_key, *api_key_file, *cors_allow_origins;
    int64_t port, max_request_bytes, request_timeout_ms, idle_timeout_ms;
    bool tls; /* over the process's TLS files (when set) */
} cs_openai_config;
extern const cs_config_entry cs_openai_config_table[];
extern const size_t cs_openai_config_n;

typedef struct {
    const char *host;
    int port;                /* 0: any free port (cs_openai_port) */
    const cs_wire_model *wm; /* the model served: /v1/models, token text for logprobs */
    /* The process's Generate: takes c (answers it exactly once). */
    void (*generate)(void *arg, cs_gen_call *c);
    void *arg;
    size_t max_request_bytes; /* a body beyond gets 413; 0 = 4 MiB */
    uint64_t request_ms;      /* a request's arrival deadline (408); 0 = 30 s */
    uint64_t idle_ms;         /* keep-alive idle timeout; 0 = 30 s */
    /* API keys (NULL or none: no key needed). A request without
     * "Authorization: Bearer <one of them>" gets 401. */
    const cs_api_keys *api_keys;
    /* Origins allowed by CORS (comma-separated, "*" = any); NULL: no CORS. */
    const char *cors_allow_origins;
    /* TLS on the port (the process's --tls-* files, as its gRPC port):
     * NULL or no cert_file: plain HTTP. */
    const cs_rpc_tls *tls;
} cs_openai_opts;

/* For a process with the cs_openai_config_table options: loads the API keys (into
 * *keys, shared with the process's gRPC door; free with cs_api_keys_free)
 * and, unless c->port is -1, starts the HTTP API on c->host (default_host
 * when unset), over TLS with tls's files when set (the process's public
 * gRPC port's) unless c->tls is false; *out stays NULL when off. 0 or the error (printed by the
 * caller). */
int cs_openai_start_config(struct uv_loop_s *loop, const cs_openai_config *c, const cs_rpc_tls *tls,
                           const char *default_host, const cs_wire_model *wm,
                           void (*generate)(void *arg, cs_gen_call *call), void *arg,
                           cs_api_keys *keys, cs_openai **out);
/* "openai listening on HOST:PORT" on stdout (after the process's other
 * listening lines), when s runs. */
void cs_openai_print_listening(const cs_openai *s);

/* Binds and starts serving on loop. The options are copied (the strings and
 * key list are borrowed: keep them alive). CS_EINVAL, CS_ENOMEM, or the bind
 * error. */
int cs_openai_start(struct uv_loop_s *loop, const cs_openai_opts *o, cs_openai **out);
int cs_openai_port(const cs_openai *s);
/* Stops accepting; open streams go on until they end (their Generate calls
 * are the process's to end). Freed once the last one ended and libuv closed
 * the handles (keep running the loop). NULL is a no-op. */
void cs_openai_close(cs_openai *s);

#endif
