/* chunkserve/secret.h: the cluster secret and the few primitives the trust
 * boundaries need (architecture.md, trust): random bytes from the kernel, HMAC-SHA256
 * (OpenSSL's libcrypto) and constant-time comparison.
 *
 * The cluster secret is shared by the router and every worker of one
 * cluster (a flag, CHUNKSERVE_CLUSTER_SECRET or a file, in Kubernetes a
 * mounted Secret). It never goes on the wire: worker RPCs carry a token
 * derived from it (cs_secret_token), the KV link proves it by
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
#define CS_SECRET_KEYS 2                      /* the one proved, and one more accepted */
#define CS_RPC_TOKEN_KEY "x-chunkserve-token" /* metadata key of worker RPCs */

typedef struct {
    size_t len;
    uint8_t key[CS_SECRET_MAX];
    char token[65]; /* hex HMAC(key, "chunkserve worker rpc v1"): what worker RPCs carry */
} cs_secret_key;

/* The cluster secret as a process holds it: one key, or two during a
 * rotation. k[0] is the one this process proves: the token its calls
 * carry, and as a KV receiver its CHALLENGE (whose key the sender's AUTH
 * must then use). Every key is accepted in a worker RPC's token and, by a
 * KV sender, in a receiver's CHALLENGE (the sender answers with the key it
 * matched); a KV channel authenticated under a key later rotated out is
 * closed once its transfers are over. A rotation is three edits of the
 * file, each reaching every process before the next (docs/security.md):
 * "old\nnew" (prove old, accept both), "new\nold" (prove new, accept both),
 * "new". */
typedef struct {
    bool set; /* n > 0; false: no authentication (trust the network) */
    int n;    /* keys held: 0, 1, or 2 during a rotation */
    cs_secret_key k[CS_SECRET_KEYS];
    uint64_t id; /* of k[0]: 48 bits of PBKDF2-HMAC-SHA256(k[0], "chunkserve key id",
                    100000 rounds), never the key itself; what logs and the key-id
                    metric show (0: none) */
    /* the file as last read (cs_secret_reload): a change to any of these reloads it */
    uint64_t f_dev, f_ino, f_size, f_mtime_ns, f_ctime_ns;
} cs_secret;

/* From a value (flag or environment; NULL/"" = none; one secret, a line
 * break refused) or a file (one secret a line: the first is proved, a second is
 * also accepted; a trailing newline and a CR before each newline are
 * dropped; NULL/"" = none); both set is an error, as is a secret shorter
 * than CS_SECRET_MIN or longer than CS_SECRET_MAX bytes, an empty line or
 * more than CS_SECRET_KEYS lines. Neither: out->set is false (no
 * authentication). 0 or CS_EINVAL with cs_last_error() naming the flag. */
int cs_secret_load(const char *value, const char *file, cs_secret *out);
/* Re-reads file when it changed since the last load or reload of s (its
 * inode, size or times differ: a Kubernetes Secret volume swaps a symlink,
 * an editor renames a new file into place). 1: new keys are in s; 0: the
 * file did not change, or holds the keys s has; CS_EINVAL (message in
 * cs_last_error()): the new contents are refused and s keeps its keys (the
 * same file is not reported again: the next change is); CS_EIO: it cannot
 * be read now (s keeps its keys; tried again at the next call). */
int cs_secret_reload(cs_secret *s, const char *file);
/* The token k[0] gives (what a caller sends); NULL without a secret. */
const char *cs_secret_token(const cs_secret *s);
/* Overwrites the keys (before the struct goes away). */
void cs_secret_clear(cs_secret *s);
/* Overwrites n bytes at p with zeros (a store the compiler keeps). */
void cs_secure_zero(void *p, size_t n);
/* Whether a worker RPC's token (metadata value, not NUL-terminated) is one
 * of the secret's keys', in constant time. An unset secret accepts anything. */
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
