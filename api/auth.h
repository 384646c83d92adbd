/* auth.h (api/): the public API's keys, checked alike at both doors: HTTP
 * "Authorization: Bearer <key>" (openai/) and gRPC "authorization:
 * Bearer <key>" metadata (Generation service). Keys come from
 * --api-key (repeatable) / CHUNKSERVE_API_KEY (comma-separated) and --api-key-file (one
 * per line: "KEY" or "KEY TENANT"); they are compared in constant time and never logged.
 * No keys configured: every call is let through.
 *
 * Each key belongs to a tenant (the scheduler's token-fair shares,
 * chunkserve/sched.h): the one its file line names (several keys may name
 * one), else a tenant of its own, "key-" and 8 hex digits of a hash of the key
 * (name tenants in the file to keep that hash out of logs and metrics). With
 * keys configured a request's tenant is its key's: a request naming another
 * (GenerateRequest.tenant, the X-Chunkserve-Tenant header) is refused
 * PERMISSION_DENIED / 403. Without keys the request's own field is trusted. */
#ifndef CHUNKSERVE_API_AUTH_H
#define CHUNKSERVE_API_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "chunkserve/rpc.h"

typedef struct {
    char **keys;
    char **tenants; /* the tenant of each key */
    size_t n;
} cs_api_keys;

/* Loads keys from csv (NULL or "": none) and file (NULL: none; blank lines
 * and lines starting with '#' skipped; a line is "KEY" or "KEY TENANT",
 * split at blanks). CS_EINVAL when the file cannot be read, a key is shorter
 * than 8 bytes or a tenant is not 1..CS_TENANT_NAME_MAX printable bytes
 * (cs_last_error says which, without the key), CS_ENOMEM. */
int cs_api_keys_load(const char *csv, const char *file, cs_api_keys *out);
void cs_api_keys_free(cs_api_keys *k);

/* Whether an Authorization value ("Bearer <key>", len bytes, not
 * necessarily NUL-terminated) carries one of the keys; true when none are
 * configured. Every key is compared in full, whatever matches. */
bool cs_api_keys_check(const cs_api_keys *k, const char *authorization, size_t len);
/* The tenant of the key an Authorization value carries; NULL when no keys
 * are configured or none matches. Every key is compared in full. */
const char *cs_api_keys_tenant(const cs_api_keys *k, const char *authorization, size_t len);

/* For gRPC handlers of the public API: true when c may proceed (then
 * *tenant, when tenant is not NULL, is its key's tenant, or NULL without
 * keys); otherwise c is finished UNAUTHENTICATED and false returned. */
bool cs_api_keys_rpc_check(const cs_api_keys *k, cs_rpc_call *c, const char **tenant);

#endif
