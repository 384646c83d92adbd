/* auth.c: the public API's keys (auth.h). */
#include "auth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"

#define MIN_KEY 8

static int add_key(cs_api_keys *k, const char *s, size_t len, const char *where) {
    while (len && (s[0] == ' ' || s[0] == '\t'))
        s++, len--;
    while (len && (s[len - 1] == ' ' || s[len - 1] == '\t' || s[len - 1] == '\r'))
        len--;
    if (!len) return 0;
    if (len < MIN_KEY)
        return cs_fail(CS_EINVAL, "%s: an API key has %zu bytes; at least %d are needed", where,
                       len, MIN_KEY);
    char **keys = realloc(k->keys, (k->n + 1) * sizeof *keys);
    if (!keys) return cs_fail(CS_ENOMEM, "out of memory");
    k->keys = keys;
    if (!(keys[k->n] = strndup(s, len))) return cs_fail(CS_ENOMEM, "out of memory");
    k->n++;
    return 0;
}

int cs_api_keys_load(const char *csv, const char *file, cs_api_keys *out) {
    memset(out, 0, sizeof *out);
    int r = 0;
    for (const char *p = csv; p && *p && !r;) {
        size_t l = strcspn(p, ",");
        r = add_key(out, p, l, "--api-key");
        p += l + (p[l] == ',');
    }
    if (!r && file && file[0]) {
        FILE *f = fopen(file, "r");
        if (!f) {
            r = cs_fail(CS_EINVAL, "--api-key-file %s cannot be read", file);
        } else {
            char line[1024];
            while (!r && fgets(line, sizeof line, f)) {
                size_t l = strcspn(line, "\n");
                if (line[0] != '#') r = add_key(out, line, l, "--api-key-file");
            }
            fclose(f);
        }
    }
    if (r) cs_api_keys_free(out);
    return r;
}

void cs_api_keys_free(cs_api_keys *k) {
    for (size_t i = 0; i < k->n; i++) {
        memset(k->keys[i], 0, strlen(k->keys[i]));
        free(k->keys[i]);
    }
    free(k->keys);
    memset(k, 0, sizeof *k);
}

bool cs_api_keys_check(const cs_api_keys *k, const char *auth, size_t len) {
    if (!k || k->n == 0) return true;
    if (!auth || len < 7 || strncmp(auth, "Bearer ", 7) != 0) return false;
    const char *s = auth + 7;
    size_t sl = len - 7;
    unsigned ok = 0;
    for (size_t j = 0; j < k->n; j++) {
        const char *key = k->keys[j];
        size_t kl = strlen(key);
        unsigned diff = kl != sl;
        for (size_t i = 0; i < kl; i++)
            diff |= (unsigned char)key[i] ^ (unsigned char)(i < sl ? s[i] : 0);
        ok |= diff == 0;
    }
    return ok != 0;
}

bool cs_api_keys_rpc_check(const cs_api_keys *k, cs_rpc_call *c) {
    if (!k || k->n == 0) return true;
    size_t len = 0;
    const char *v = cs_rpc_call_metadata(c, "authorization", &len);
    if (cs_api_keys_check(k, v, v ? len : 0)) return true;
    cs_rpc_call_finish(c, CS_RPC_UNAUTHENTICATED,
                       "a valid API key is required: send metadata 'authorization: Bearer <key>'");
    return false;
}
