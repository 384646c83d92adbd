/* generation.h: the chunkserve.v1.Generation service's unary calls
 * (ListModels, Tokenize, Detokenize), answered from the model's config and
 * tokenizer alone. The single-process server and the router register the
 * same handlers; Generate itself differs (one engine vs worker legs) and
 * stays with each process. Loop thread only, like the RPC layer. */
#ifndef CHUNKSERVE_API_GENERATION_H
#define CHUNKSERVE_API_GENERATION_H

#include "chunkserve/rpc.h"
#include "wire.h"

#define CS_GENERATION_SERVICE "chunkserve.v1.Generation"

/* Registers ListModels, Tokenize and Detokenize on s (before start); wm
 * must outlive the server. Returns cs_rpc_server_add_method's errors. */
int cs_generation_add_unary(cs_rpc_server *s, const cs_wire_model *wm);

#endif
