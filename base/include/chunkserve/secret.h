/* chunkserve/secret.h: the cluster secret and the few primitives the trust
 * boundaries need (architecture.md, trust): random bytes from the kernel, HMAC-SHA256
 * (OpenSSL's libcrypto) and constant-time comparison.
 *
 * The cluster secret is shared by the router and every worker of one
 * cluster (a flag, CHUNKSERVE_CLUSTER_SECRET or a file, in Kubernetes a
 * mounted Secret). It never goes on the wire: worker RPCs carry a token
 * derived from it (cs_secret_rpc_token), the KV link proves it by
 * challenge-response. An unset secret means "trust the network" (the
 * pre-secret behaviour, for loopback and isolated networks). */
#ifndef CHUNKSERVE_SECRET_H
#define CHUNKSERVE_SECRET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CS_SECRET_MIN 16                      /* bytes a cluster secret must have at least */
#define CS_SECRET_MAX 512                     /* and at most */
#define CS_RPC_TOKEN_KEY "x-chunkserve-token" /* metadata key of worker RPCs */

typedef struct {
    bool set;
    size_t len;
    uint8_t key[CS_SECRET_MAX];
    char token[65]; /* hex HMAC(key, "chunkserve worker rpc v1"): what worker RPCs carry */
} cs_secret;

/* From a value (flag or environment; NULL/"" = none) or a file (its bytes,
 * one trailing newline dropped; NULL/"" = none); both set is an error, as
 * is a secret shorter than CS_SECRET_MIN or longer than CS_SECRET_MAX bytes.
 * Neither: out->set is false (no authentication). 0 or CS_EINVAL with
 * cs_last_error() naming the flag. */
int cs_secret_load(const char *value, const char *file, cs_secret *out);
/* Overwrites the key (before the struct goes away). */
void cs_secret_clear(cs_secret *s);
/* Whether a worker RPC's token (metadata value, not NUL-terminated) is the
 * secret's, in constant time. An unset secret accepts anything. */
bool cs_secret_check_token(const cs_secret *s, const char *v, size_t len);

/* n bytes from getrandom(2); 0, or the error (never partial). */
int cs_random_bytes(void *buf, size_t n);
/* 64 random bits (never 0): incarnations, ids. Aborts if the kernel has no
 * entropy to give (getrandom blocks until it has). */
uint64_t cs_random_u64(void);

/* HMAC-SHA256 of the concatenation of n parts (part i: p[i], len[i]). */
void cs_hmac_sha256(const void *key, size_t key_len, int n, const void *const *p, const size_t *len,
                    uint8_t out[32]);
/* a == b over n bytes, in time independent of the contents. */
bool cs_ct_equal(const void *a, const void *b, size_t n);

#ifdef __cplusplus
}
#endif
#endif
