/* auth.c: the public API's keys (auth.h). */
#include "auth.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/sched.h"

#define MIN_KEY 8

static bool blank(char c) {
    return c == ' ' || c == '\t' || c == '\r';
}

/* A key's own tenant: "key-" and 8 hex digits of its FNV-1a hash. */
static char *key_tenant(const char *key) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = key; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    char name[16];
    snprintf(name, sizeof name, "key-%08x", (unsigned)(h >> 32));
    return strdup(name);
}

/* Adds the key s[0..len) ("KEY" or "KEY TENANT" when a file line); blanks
 * around are dropped, a blank line adds nothing. */
static int add_key(cs_api_keys *k, const char *s, size_t len, bool named, const char *where) {
    while (len && blank(s[0]))
        s++, len--;
    while (len && blank(s[len - 1]))
        len--;
    if (!len) return 0;
    size_t kl = len;
    const char *t = NULL;
    size_t tl = 0;
    if (named) {
        kl = 0;
        while (kl < len && !blank(s[kl]))
            kl++;
        t = s + kl;
        tl = len - kl;
        while (tl && blank(t[0]))
            t++, tl--;
        for (size_t i = 0; i < tl; i++)
            if (blank(t[i]))
                return cs_fail(CS_EINVAL,
                               "%s: a line is KEY or KEY TENANT: this one has more fields (a key "
                               "may not contain blanks)",
                               where);
        if (tl > CS_TENANT_NAME_MAX)
            return cs_fail(CS_EINVAL, "%s: a tenant name has %zu bytes; at most %d are allowed",
                           where, tl, CS_TENANT_NAME_MAX);
        for (size_t i = 0; i < tl; i++)
            if ((unsigned char)t[i] <= ' ' || t[i] == 0x7f)
                return cs_fail(CS_EINVAL,
                               "%s: a line is KEY or KEY TENANT; the tenant may not contain "
                               "blanks or control characters",
                               where);
    }
    if (kl < MIN_KEY)
        return cs_fail(CS_EINVAL, "%s: an API key has %zu bytes; at least %d are needed", where,
                       kl, MIN_KEY);
    char **keys = realloc(k->keys, (k->n + 1) * sizeof *keys);
    if (!keys) return cs_fail(CS_ENOMEM, "out of memory");
    k->keys = keys;
    char **tenants = realloc(k->tenants, (k->n + 1) * sizeof *tenants);
    if (!tenants) return cs_fail(CS_ENOMEM, "out of memory");
    k->tenants = tenants;
    for (size_t j = 0; j < k->n; j++)
        if (strlen(k->keys[j]) == kl && !memcmp(k->keys[j], s, kl))
            return cs_fail(CS_EINVAL, "%s: an API key is given twice (key %zu of %zu)", where,
                           k->n + 1, j + 1);
    char *key = strndup(s, kl);
    char *tenant = !key ? NULL : tl ? strndup(t, tl) : key_tenant(key);
    if (!key || !tenant) {
        free(key);
        return cs_fail(CS_ENOMEM, "out of memory");
    }
    keys[k->n] = key;
    tenants[k->n] = tenant;
    k->n++;
    return 0;
}

int cs_api_keys_load(const char *csv, const char *file, cs_api_keys *out) {
    memset(out, 0, sizeof *out);
    int r = 0;
    for (const char *p = csv; p && *p && !r;) {
        size_t l = strcspn(p, ",");
        r = add_key(out, p, l, false, "--api-key");
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
                if (line[0] != '#') r = add_key(out, line, l, true, "--api-key-file");
            }
            memset(line, 0, sizeof line);
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
        free(k->tenants[i]);
    }
    free(k->keys);
    free(k->tenants);
    memset(k, 0, sizeof *k);
}

/* The index of the key auth carries, or -1; every key compared in full. */
static long match(const cs_api_keys *k, const char *auth, size_t len) {
    if (!auth || len < 7 || strncmp(auth, "Bearer ", 7) != 0) return -1;
    const char *s = auth + 7;
    size_t sl = len - 7;
    long found = -1;
    for (size_t j = 0; j < k->n; j++) {
        const char *key = k->keys[j];
        size_t kl = strlen(key);
        unsigned diff = kl != sl;
        for (size_t i = 0; i < kl; i++)
            diff |= (unsigned char)key[i] ^ (unsigned char)(i < sl ? s[i] : 0);
        if (diff == 0 && found < 0) found = (long)j;
    }
    return found;
}

bool cs_api_keys_check(const cs_api_keys *k, const char *auth, size_t len) {
    return !k || k->n == 0 || match(k, auth, len) >= 0;
}

const char *cs_api_keys_tenant(const cs_api_keys *k, const char *auth, size_t len) {
    long j = k && k->n ? match(k, auth, len) : -1;
    return j >= 0 ? k->tenants[j] : NULL;
}

bool cs_api_keys_rpc_check(const cs_api_keys *k, cs_rpc_call *c, const char **tenant) {
    if (tenant) *tenant = NULL;
    if (!k || k->n == 0) return true;
    size_t len = 0;
    const char *v = cs_rpc_call_metadata(c, "authorization", &len);
    long j = match(k, v, v ? len : 0);
    if (j >= 0) {
        if (tenant) *tenant = k->tenants[j];
        return true;
    }
    cs_rpc_call_finish(c, CS_RPC_UNAUTHENTICATED,
                       "a valid API key is required: send metadata 'authorization: Bearer <key>'");
    return false;
}
