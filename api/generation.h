/* generation.h: the chunkserve.v1.Generation service's unary calls
 * (ListModels, Tokenize, Detokenize), answered from the model's config and
 * tokenizer alone. The single-process server and the router register the
 * same handlers; Generate itself differs (one engine vs worker legs) and
 * stays with each process. Loop thread only, like the RPC layer; Tokenize's
 * rendering and encoding run on libuv's thread pool (api/prepare.h says why). */
#ifndef CHUNKSERVE_API_GENERATION_H
#define CHUNKSERVE_API_GENERATION_H

#include "auth.h"
#include "chunkserve/rpc.h"
#include "wire.h"

#define CS_GENERATION_SERVICE "chunkserve.v1.Generation"

/* What the handlers serve from: the model, and the API keys calls must
 * carry (NULL or none: open). */
typedef struct {
    const cs_wire_model *wm;
    const cs_api_keys *keys;
    struct uv_loop_s *uv; /* Tokenize runs on its thread pool */
} cs_generation_ctx;

/* Registers ListModels, Tokenize and Detokenize on s (before start); ctx
 * and what it points to must outlive the server. Returns
 * cs_rpc_server_add_method's errors. */
int cs_generation_add_unary(cs_rpc_server *s, const cs_generation_ctx *ctx);

#endif
