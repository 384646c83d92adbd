/* auth.h (api/): the public API's keys, checked alike at both doors: HTTP
 * "Authorization: Bearer <key>" (openai/) and gRPC "authorization:
 * Bearer <key>" metadata (Generation service). Keys come from
 * --api-key (repeatable) / CHUNKSERVE_API_KEY (comma-separated) and --api-key-file (one
 * per line); they are compared in constant time and never logged. No keys
 * configured: every call is let through. */
#ifndef CHUNKSERVE_API_AUTH_H
#define CHUNKSERVE_API_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "chunkserve/rpc.h"

typedef struct {
    char **keys;
    size_t n;
} cs_api_keys;

/* Loads keys from csv (NULL or "": none) and file (NULL: none; blank lines
 * and lines starting with '#' skipped). CS_EINVAL when the file cannot be
 * read or a key is shorter than 8 bytes (cs_last_error says which, without
 * the key), CS_ENOMEM. */
int cs_api_keys_load(const char *csv, const char *file, cs_api_keys *out);
void cs_api_keys_free(cs_api_keys *k);

/* Whether an Authorization value ("Bearer <key>", len bytes, not
 * necessarily NUL-terminated) carries one of the keys; true when none are
 * configured. Every key is compared in full, whatever matches. */
bool cs_api_keys_check(const cs_api_keys *k, const char *authorization, size_t len);

/* For gRPC handlers of the public API: true when c may proceed; otherwise c
 * is finished UNAUTHENTICATED and false returned. */
bool cs_api_keys_rpc_check(const cs_api_keys *k, cs_rpc_call *c);

#endif
