/* secret.c: the cluster secret, random bytes, HMAC-SHA256 (secret.h). */
#include "chunkserve/secret.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

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

static void set_key(cs_secret_key *k, const uint8_t *s, size_t n) {
    k->len = n;
    memcpy(k->key, s, n);
    static const char label[] = "chunkserve worker rpc v1";
    const void *p[] = {label};
    size_t l[] = {sizeof label - 1};
    uint8_t mac[32];
    cs_hmac_sha256(k->key, k->len, 1, p, l, mac);
    for (int i = 0; i < 32; i++)
        snprintf(k->token + 2 * i, 3, "%02x", mac[i]);
}

/* A slow derivation (PBKDF2-HMAC-SHA256, 100,000 rounds) of 48 bits: the id
 * is shown on the unauthenticated ops port, so a guess at a weak secret
 * costs that much to check against it. */
static uint64_t key_id(const cs_secret_key *k) {
    static const char salt[] = "chunkserve key id";
    uint8_t out[6];
    CS_ASSERT(PKCS5_PBKDF2_HMAC((const char *)k->key, (int)k->len, (const unsigned char *)salt,
                                (int)sizeof salt - 1, 100000, EVP_sha256(), sizeof out, out));
    uint64_t id = 0;
    for (int i = 0; i < 6; i++) /* 48 bits: exact in a metric's double */
        id = id << 8 | out[i];
    return id ? id : 1;
}

static int check_len(size_t n, const char *where, int line) {
    if (n >= CS_SECRET_MIN && n <= CS_SECRET_MAX) return 0;
    if (line)
        return cs_fail(CS_EINVAL,
                       "%s: the cluster secret on line %d has %zu bytes; %d to %d are needed",
                       where, line, n, CS_SECRET_MIN, CS_SECRET_MAX);
    return cs_fail(CS_EINVAL, "%s: a cluster secret has %zu bytes; %d to %d are needed", where, n,
                   CS_SECRET_MIN, CS_SECRET_MAX);
}

/* A file's bytes into out's keys: one a line (see secret.h). */
static int parse_lines(const uint8_t *buf, size_t n, cs_secret *out, const char *where) {
    if (n && buf[n - 1] == '\n') n--; /* the file's last newline ends a line, starts none */
    size_t at = 0;
    for (int line = 1; at <= n; line++) {
        const uint8_t *nl = memchr(buf + at, '\n', n - at);
        size_t end = nl ? (size_t)(nl - buf) : n, len = end - at;
        if (len && buf[at + len - 1] == '\r') len--;
        if (out->n == CS_SECRET_KEYS)
            return cs_fail(CS_EINVAL,
                           "%s: more than %d lines; it holds the cluster secret this process "
                           "proves and, during a rotation, one more that it accepts",
                           where, CS_SECRET_KEYS);
        int r = check_len(len, where, line);
        if (r) return r;
        if (out->n == 1 && len == out->k[0].len && !memcmp(out->k[0].key, buf + at, len)) {
            /* the same secret twice: one key */
        } else {
            set_key(&out->k[out->n++], buf + at, len);
        }
        at = end + 1;
    }
    return 0;
}

static void finish(cs_secret *s) {
    s->set = s->n > 0;
    s->id = s->set ? key_id(&s->k[0]) : 0;
}

/* The identity of an open file (what a later reload compares). */
static void file_id(int fd, cs_secret *s) {
    struct stat st;
    if (fstat(fd, &st)) return;
    s->f_dev = (uint64_t)st.st_dev, s->f_ino = (uint64_t)st.st_ino;
    s->f_size = (uint64_t)st.st_size;
    s->f_mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000u + (uint64_t)st.st_mtim.tv_nsec;
    s->f_ctime_ns = (uint64_t)st.st_ctim.tv_sec * 1000000000u + (uint64_t)st.st_ctim.tv_nsec;
}

static bool same_file(const cs_secret *a, const cs_secret *b) {
    return a->f_dev == b->f_dev && a->f_ino == b->f_ino && a->f_size == b->f_size &&
           a->f_mtime_ns == b->f_mtime_ns && a->f_ctime_ns == b->f_ctime_ns;
}

/* Reads file into out (keys and the identity of what was read): 0,
 * CS_EIO when it cannot be read (worth retrying), CS_EINVAL when its
 * contents are refused. */
static int read_file(const char *file, cs_secret *out) {
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return cs_fail(CS_EIO, "--cluster-secret-file %s cannot be read: %s", file,
                       strerror(errno));
    file_id(fd, out);
    enum { CAP = CS_SECRET_KEYS * (CS_SECRET_MAX + 2) + 1 };
    uint8_t buf[CAP];
    size_t n = 0;
    int r = 0;
    while (n < CAP) { /* read(2), not stdio: no copy of the secret in a FILE buffer */
        ssize_t got = read(fd, buf + n, CAP - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0)
            r = cs_fail(CS_EIO, "--cluster-secret-file %s cannot be read: %s", file,
                        strerror(errno));
        if (got <= 0) break;
        n += (size_t)got;
    }
    close(fd);
    if (!r)
        r = n == CAP ? cs_fail(CS_EINVAL, "--cluster-secret-file %s: over %d bytes", file, CAP - 1)
                     : parse_lines(buf, n, out, "--cluster-secret-file");
    cs_secure_zero(buf, sizeof buf);
    if (!r) finish(out);
    return r;
}

int cs_secret_load(const char *value, const char *file, cs_secret *out) {
    memset(out, 0, sizeof *out);
    bool hv = value && value[0], hf = file && file[0];
    if (hv && hf)
        return cs_fail(CS_EINVAL,
                       "--cluster-secret and --cluster-secret-file are both set; give one");
    if (hv) {
        size_t n = strlen(value);
        if (strpbrk(value, "\r\n"))
            return cs_fail(CS_EINVAL,
                           "--cluster-secret: the value holds a line break; a value is one "
                           "secret (two, during a rotation, go in --cluster-secret-file)");
        int r = check_len(n, "--cluster-secret", 0);
        if (r) return r;
        set_key(&out->k[out->n++], (const uint8_t *)value, n);
        finish(out);
        return 0;
    }
    if (!hf) return 0;
    int r = read_file(file, out);
    if (r) cs_secret_clear(out);
    return r ? CS_EINVAL : 0;
}

int cs_secret_reload(cs_secret *s, const char *file) {
    cs_secret now;
    memset(&now, 0, sizeof now);
    struct stat st;
    if (stat(file, &st) == 0) { /* unchanged: nothing read */
        now.f_dev = (uint64_t)st.st_dev, now.f_ino = (uint64_t)st.st_ino;
        now.f_size = (uint64_t)st.st_size;
        now.f_mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000u + (uint64_t)st.st_mtim.tv_nsec;
        now.f_ctime_ns = (uint64_t)st.st_ctim.tv_sec * 1000000000u + (uint64_t)st.st_ctim.tv_nsec;
        if (same_file(&now, s)) return 0;
    }
    memset(&now, 0, sizeof now);
    int r = read_file(file, &now);
    if (r) {
        /* refused contents are reported once (until the file changes again);
         * a read that failed is tried again next time */
        if (r == CS_EINVAL) {
            s->f_dev = now.f_dev, s->f_ino = now.f_ino, s->f_size = now.f_size;
            s->f_mtime_ns = now.f_mtime_ns, s->f_ctime_ns = now.f_ctime_ns;
        }
        cs_secret_clear(&now);
        return r;
    }
    bool same = now.n == s->n;
    for (int i = 0; same && i < now.n; i++)
        same = now.k[i].len == s->k[i].len && cs_ct_equal(now.k[i].key, s->k[i].key, now.k[i].len);
    if (same) {
        s->f_dev = now.f_dev, s->f_ino = now.f_ino, s->f_size = now.f_size;
        s->f_mtime_ns = now.f_mtime_ns, s->f_ctime_ns = now.f_ctime_ns;
    } else {
        *s = now;
    }
    cs_secret_clear(&now);
    return !same;
}

const char *cs_secret_token(const cs_secret *s) {
    return s && s->set ? s->k[0].token : NULL;
}

void cs_secure_zero(void *p, size_t n) {
    volatile uint8_t *v = p;
    for (size_t i = 0; i < n; i++)
        v[i] = 0;
}

void cs_secret_clear(cs_secret *s) {
    cs_secure_zero(s, sizeof *s);
}

bool cs_secret_check_token(const cs_secret *s, const char *v, size_t len) {
    if (!s || !s->set) return true;
    if (!v || len != 64) return false;
    bool ok = false;
    for (int i = 0; i < s->n; i++) /* every key compared: no early exit on a match */
        ok |= cs_ct_equal(s->k[i].token, v, 64);
    return ok;
}
