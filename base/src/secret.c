/* secret.c: the cluster secret, random bytes, HMAC-SHA256 (secret.h). */
#include "chunkserve/secret.h"

#include <errno.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "chunkserve/assert.h"
#include "chunkserve/error.h"

int cs_random_bytes(void *buf, size_t n) {
    uint8_t *p = buf;
    while (n) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += r, n -= (size_t)r;
    }
    return 0;
}

uint64_t cs_random_u64(void) {
    uint64_t v = 0;
    while (v == 0)
        CS_ASSERT(cs_random_bytes(&v, sizeof v) == 0);
    return v;
}

bool cs_ct_equal(const void *a, const void *b, size_t n) {
    const volatile uint8_t *x = a, *y = b;
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++)
        d |= x[i] ^ y[i];
    return d == 0;
}

void cs_hmac_sha256(const void *key, size_t key_len, int n, const void *const *p, const size_t *len,
                    uint8_t out[32]) {
    /* One buffer, one HMAC() call: the messages here are small (handshake
     * transcripts, frame headers with their control payloads). */
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += len[i];
    uint8_t stack[1024], *buf = total <= sizeof stack ? stack : malloc(total);
    CS_ASSERT(buf);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        if (len[i]) memcpy(buf + off, p[i], len[i]);
        off += len[i];
    }
    unsigned int ol = 32;
    static const uint8_t empty = 0;
    CS_ASSERT(HMAC(EVP_sha256(), key_len ? key : &empty, (int)key_len, buf, total, out, &ol));
    if (buf != stack) free(buf);
}

static int set_key(cs_secret *out, const uint8_t *s, size_t n, const char *where) {
    if (n < CS_SECRET_MIN || n > CS_SECRET_MAX)
        return cs_fail(CS_EINVAL, "%s: a cluster secret has %zu bytes; %d to %d are needed", where,
                       n, CS_SECRET_MIN, CS_SECRET_MAX);
    out->set = true;
    out->len = n;
    memcpy(out->key, s, n);
    static const char label[] = "chunkserve worker rpc v1";
    const void *p[] = {label};
    size_t l[] = {sizeof label - 1};
    uint8_t mac[32];
    cs_hmac_sha256(out->key, out->len, 1, p, l, mac);
    for (int i = 0; i < 32; i++)
        snprintf(out->token + 2 * i, 3, "%02x", mac[i]);
    return 0;
}

int cs_secret_load(const char *value, const char *file, cs_secret *out) {
    memset(out, 0, sizeof *out);
    bool hv = value && value[0], hf = file && file[0];
    if (hv && hf)
        return cs_fail(CS_EINVAL,
                       "--cluster-secret and --cluster-secret-file are both set; give one");
    if (hv) return set_key(out, (const uint8_t *)value, strlen(value), "--cluster-secret");
    if (!hf) return 0;
    FILE *f = fopen(file, "rb");
    if (!f) return cs_fail(CS_EINVAL, "--cluster-secret-file %s cannot be read", file);
    uint8_t buf[CS_SECRET_MAX + 2];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    if (n && buf[n - 1] == '\n') n--;
    if (n && buf[n - 1] == '\r') n--;
    int r = set_key(out, buf, n, "--cluster-secret-file");
    memset(buf, 0, sizeof buf);
    return r;
}

void cs_secret_clear(cs_secret *s) {
    volatile uint8_t *p = (volatile uint8_t *)s;
    for (size_t i = 0; i < sizeof *s; i++)
        p[i] = 0;
}

bool cs_secret_check_token(const cs_secret *s, const char *v, size_t len) {
    if (!s || !s->set) return true;
    if (!v || len != 64) return false;
    return cs_ct_equal(s->token, v, 64);
}
