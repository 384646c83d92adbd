/* gguf.c: GGUF reader. A cursor walks the header, metadata and tensor infos,
 * checking every read against the end of the mapping; tensor data is then
 * checked to lie inside the data section. Values are not copied: accessors
 * point into the read-only mapping. */
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unicode.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NESTING 2

typedef struct {
    const uint8_t *p, *end;
    const char *path;
} cursor;

static int need(cursor *c, size_t n, const char *what) {
    if ((size_t)(c->end - c->p) < n)
        return cs_fail(CS_EBADMSG, "gguf: %s: file truncated while reading %s", c->path, what);
    return 0;
}

static int rd_u32(cursor *c, uint32_t *v, const char *what) {
    int r = need(c, 4, what);
    if (r) return r;
    memcpy(v, c->p, 4);
    c->p += 4;
    return 0;
}

static int rd_u64(cursor *c, uint64_t *v, const char *what) {
    int r = need(c, 8, what);
    if (r) return r;
    memcpy(v, c->p, 8);
    c->p += 8;
    return 0;
}

static int rd_str(cursor *c, cs_gguf_str *s, const char *what) {
    uint64_t len;
    int r = rd_u64(c, &len, what);
    if (r) return r;
    if (len > (uint64_t)(c->end - c->p))
        return cs_fail(CS_EBADMSG, "gguf: %s: %s has length %llu, past end of file", c->path, what,
                       (unsigned long long)len);
    if (!cs__utf8_valid(c->p, (size_t)len))
        return cs_fail(CS_EBADMSG, "gguf: %s: %s is not valid UTF-8", c->path, what);
    s->ptr = (const char *)c->p;
    s->len = (size_t)len;
    c->p += len;
    return 0;
}

static size_t scalar_size(enum cs_gguf_type t) {
    switch (t) {
    case CS_GGUF_UINT8:
    case CS_GGUF_INT8:
    case CS_GGUF_BOOL: return 1;
    case CS_GGUF_UINT16:
    case CS_GGUF_INT16: return 2;
    case CS_GGUF_UINT32:
    case CS_GGUF_INT32:
    case CS_GGUF_FLOAT32: return 4;
    case CS_GGUF_UINT64:
    case CS_GGUF_INT64:
    case CS_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* Skips (validating) one value of type t; key names it in messages. */
static int skip_value(cursor *c, enum cs_gguf_type t, const cs_gguf_str *key, int depth) {
    if (t == CS_GGUF_STRING) {
        cs_gguf_str s;
        char what[160];
        snprintf(what, sizeof what, "the value of key '%.*s'", (int)key->len, key->ptr);
        return rd_str(c, &s, what);
    }
    if (t == CS_GGUF_ARRAY) {
        uint32_t et;
        uint64_t n;
        int r = rd_u32(c, &et, "array type");
        if (!r) r = rd_u64(c, &n, "array count");
        if (r) return r;
        if (et >= CS_GGUF_TYPE_COUNT || (et == CS_GGUF_ARRAY && depth >= GGUF_MAX_NESTING))
            return cs_fail(CS_EBADMSG, "gguf: %s: key '%.*s': bad array element type %u", c->path,
                           (int)key->len, key->ptr, et);
        size_t es = scalar_size((enum cs_gguf_type)et);
        if (es) {
            if (n > (uint64_t)(c->end - c->p) / es)
                return cs_fail(CS_EBADMSG,
                               "gguf: %s: key '%.*s': array of %llu elements runs past end of file",
                               c->path, (int)key->len, key->ptr, (unsigned long long)n);
            c->p += n * es;
            return 0;
        }
        /* strings/arrays: each element is at least 8 bytes, so n is bounded by the file */
        if (n > (uint64_t)(c->end - c->p) / 8)
            return cs_fail(CS_EBADMSG,
                           "gguf: %s: key '%.*s': array count %llu is larger than the file allows",
                           c->path, (int)key->len, key->ptr, (unsigned long long)n);
        for (uint64_t i = 0; i < n; i++) {
            int r2 = skip_value(c, (enum cs_gguf_type)et, key, depth + 1);
            if (r2) return r2;
        }
        return 0;
    }
    size_t sz = scalar_size(t);
    if (!sz)
        return cs_fail(CS_EBADMSG, "gguf: %s: key '%.*s': unknown value type %u", c->path,
                       (int)key->len, key->ptr, (unsigned)t);
    int r = need(c, sz, "scalar value");
    if (r) return r;
    if (t == CS_GGUF_BOOL && *c->p > 1)
        return cs_fail(CS_EBADMSG, "gguf: %s: key '%.*s': bool value %u is not 0 or 1", c->path,
                       (int)key->len, key->ptr, *c->p);
    c->p += sz;
    return 0;
}

static bool str_eq(cs_gguf_str s, const char *z) {
    size_t n = strlen(z);
    return s.len == n && memcmp(s.ptr, z, n) == 0;
}

static const char *kv_name(const void *ctx, size_t i, size_t *len) {
    const cs_gguf *g = ctx;
    *len = g->kv[i].key.len;
    return g->kv[i].key.ptr;
}

static const char *tensor_name(const void *ctx, size_t i, size_t *len) {
    const cs_gguf *g = ctx;
    *len = g->tensors[i].name.len;
    return g->tensors[i].name.ptr;
}

int cs__gguf_open(const char *path, cs_gguf *g) {
    memset(g, 0, sizeof *g);
    int r = cs__map_file(path, &g->file);
    if (r) return r;
    cursor c = {g->file.data, g->file.data + g->file.size, path};
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    if ((r = rd_u32(&c, &magic, "magic"))) goto fail;
    if (magic != GGUF_MAGIC) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: bad magic 0x%08x (not a GGUF file)", path, magic);
        goto fail;
    }
    if ((r = rd_u32(&c, &g->version, "version"))) goto fail;
    if (g->version != 2 && g->version != 3) {
        r = cs_fail(CS_ENOTSUP, "gguf: %s: unsupported GGUF version %u (2 and 3 are supported)",
                    path, g->version);
        goto fail;
    }
    if ((r = rd_u64(&c, &n_tensors, "tensor count")) || (r = rd_u64(&c, &n_kv, "metadata count")))
        goto fail;
    /* a key-value pair takes at least 12 bytes, a tensor info at least 24 */
    if (n_kv > g->file.size / 12 || n_tensors > g->file.size / 24) {
        r = cs_fail(
            CS_EBADMSG,
            "gguf: %s: absurd counts (%llu metadata keys, %llu tensors) for a %zu-byte file", path,
            (unsigned long long)n_kv, (unsigned long long)n_tensors, g->file.size);
        goto fail;
    }
    g->n_kv = n_kv;
    g->n_tensors = n_tensors;
    g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) {
        r = cs_fail(CS_ENOMEM, "gguf: %s: out of memory", path);
        goto fail;
    }

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < n_kv; i++) {
        cs_gguf_kv *kv = &g->kv[i];
        uint32_t t;
        if ((r = rd_str(&c, &kv->key, "metadata key")) || (r = rd_u32(&c, &t, "metadata type")))
            goto fail;
        if (t >= CS_GGUF_TYPE_COUNT) {
            r = cs_fail(CS_EBADMSG, "gguf: %s: key '%.*s' has unknown type %u", path,
                        (int)kv->key.len, kv->key.ptr, t);
            goto fail;
        }
        kv->type = (enum cs_gguf_type)t;
        if (t == CS_GGUF_ARRAY) {
            const uint8_t *save = c.p;
            uint32_t et;
            if ((r = rd_u32(&c, &et, "array type")) ||
                (r = rd_u64(&c, &kv->arr_count, "array count")))
                goto fail;
            kv->arr_type = (enum cs_gguf_type)et;
            kv->data = c.p;
            c.p = save;
        } else {
            kv->data = c.p;
        }
        if ((r = skip_value(&c, kv->type, &kv->key, 0))) goto fail;
        if (str_eq(kv->key, "general.alignment")) {
            uint32_t a = 0;
            if (kv->type != CS_GGUF_UINT32) {
                r = cs_fail(CS_EBADMSG, "gguf: %s: general.alignment must be uint32", path);
                goto fail;
            }
            memcpy(&a, kv->data, 4);
            if (a == 0 || (a & (a - 1)) || a > 65536) {
                r = cs_fail(CS_EBADMSG,
                            "gguf: %s: general.alignment %u is not a power of two <= 65536", path,
                            a);
                goto fail;
            }
            g->alignment = a;
        }
    }

    for (uint64_t i = 0; i < n_tensors; i++) {
        cs_gguf_tensor *t = &g->tensors[i];
        uint32_t type;
        if ((r = rd_str(&c, &t->name, "tensor name")) ||
            (r = rd_u32(&c, &t->n_dims, "tensor dims")))
            goto fail;
        if (t->n_dims == 0 || t->n_dims > CS_GGUF_MAX_DIMS) {
            r = cs_fail(CS_EBADMSG, "gguf: %s: tensor '%.*s' has %u dimensions (1..%d allowed)",
                        path, (int)t->name.len, t->name.ptr, t->n_dims, CS_GGUF_MAX_DIMS);
            goto fail;
        }
        uint64_t n_elem = 1;
        for (uint32_t d = 0; d < CS_GGUF_MAX_DIMS; d++)
            t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            uint64_t ne;
            if ((r = rd_u64(&c, &ne, "tensor shape"))) goto fail;
            if (ne == 0 || ne > ((uint64_t)1 << 40) || n_elem > UINT64_MAX / ne) {
                r = cs_fail(CS_EBADMSG, "gguf: %s: tensor '%.*s' has bad dimension %u = %llu", path,
                            (int)t->name.len, t->name.ptr, d, (unsigned long long)ne);
                goto fail;
            }
            t->ne[d] = (int64_t)ne;
            n_elem *= ne;
        }
        if ((r = rd_u32(&c, &type, "tensor type")) || (r = rd_u64(&c, &t->offset, "tensor offset")))
            goto fail;
        if (!cs__dtype_info(type)) {
            r = cs_fail(CS_ENOTSUP,
                        "gguf: %s: tensor '%.*s' has type %s (%u), which chunkserve does not "
                        "support (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K)",
                        path, (int)t->name.len, t->name.ptr, cs__dtype_name(type), type);
            goto fail;
        }
        t->type = (enum cs_dtype)type;
        if (!cs__dtype_nbytes(t->type, n_elem, &t->nbytes) ||
            t->ne[0] % cs__dtype_info(type)->block_size) {
            r = cs_fail(
                CS_EBADMSG,
                "gguf: %s: tensor '%.*s': row of %lld elements is not a whole number of %s blocks",
                path, (int)t->name.len, t->name.ptr, (long long)t->ne[0], cs__dtype_name(type));
            goto fail;
        }
        if (t->offset % g->alignment) {
            r = cs_fail(CS_EBADMSG, "gguf: %s: tensor '%.*s' offset %llu is not aligned to %u",
                        path, (int)t->name.len, t->name.ptr, (unsigned long long)t->offset,
                        g->alignment);
            goto fail;
        }
    }
    /* duplicate keys and tensor names: O(n), so a header of a million names
     * costs milliseconds, not hours */
    int64_t dk = cs__first_duplicate((size_t)g->n_kv, kv_name, g);
    int64_t dt = dk == -1 ? cs__first_duplicate((size_t)g->n_tensors, tensor_name, g) : -1;
    if (dk == CS_DUP_NOMEM || dt == CS_DUP_NOMEM) {
        r = cs_fail(CS_ENOMEM, "gguf: %s: out of memory", path);
        goto fail;
    }
    if (dk >= 0) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: duplicate key '%.*s'", path, (int)g->kv[dk].key.len,
                    g->kv[dk].key.ptr);
        goto fail;
    }
    if (dt >= 0) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: duplicate tensor '%.*s'", path,
                    (int)g->tensors[dt].name.len, g->tensors[dt].name.ptr);
        goto fail;
    }

    size_t hdr = (size_t)(c.p - g->file.data);
    size_t data_off = (hdr + g->alignment - 1) / g->alignment * g->alignment;
    if (n_tensors && data_off > g->file.size) {
        r = cs_fail(CS_EBADMSG, "gguf: %s: file truncated before the tensor data section", path);
        goto fail;
    }
    g->data_section = g->file.data + data_off;
    size_t data_size = g->file.size - (data_off < g->file.size ? data_off : g->file.size);
    for (uint64_t i = 0; i < n_tensors; i++) {
        cs_gguf_tensor *t = &g->tensors[i];
        if (t->offset > data_size || t->nbytes > data_size - t->offset) {
            r = cs_fail(CS_EBADMSG,
                        "gguf: %s: tensor '%.*s' (%zu bytes at offset %llu) ends past end of file "
                        "(data section is %zu bytes)",
                        path, (int)t->name.len, t->name.ptr, t->nbytes,
                        (unsigned long long)t->offset, data_size);
            goto fail;
        }
        t->data = g->data_section + t->offset;
    }
    return 0;
fail:
    cs__gguf_close(g);
    return r;
}

void cs__gguf_close(cs_gguf *g) {
    free(g->kv);
    free(g->tensors);
    cs__unmap_file(&g->file);
    memset(g, 0, sizeof *g);
}

const cs_gguf_kv *cs__gguf_find(const cs_gguf *g, const char *key) {
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (str_eq(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

const cs_gguf_tensor *cs__gguf_find_tensor(const cs_gguf *g, const char *name) {
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (str_eq(g->tensors[i].name, name)) return &g->tensors[i];
    return NULL;
}

static int get_int(const cs_gguf_kv *kv, int64_t *v) {
    const uint8_t *p = kv->data;
    switch (kv->type) {
    case CS_GGUF_UINT8: *v = p[0]; return 0;
    case CS_GGUF_INT8: *v = (int8_t)p[0]; return 0;
    case CS_GGUF_UINT16: {
        uint16_t x;
        memcpy(&x, p, 2);
        *v = x;
        return 0;
    }
    case CS_GGUF_INT16: {
        int16_t x;
        memcpy(&x, p, 2);
        *v = x;
        return 0;
    }
    case CS_GGUF_UINT32: {
        uint32_t x;
        memcpy(&x, p, 4);
        *v = x;
        return 0;
    }
    case CS_GGUF_INT32: {
        int32_t x;
        memcpy(&x, p, 4);
        *v = x;
        return 0;
    }
    case CS_GGUF_UINT64: {
        uint64_t x;
        memcpy(&x, p, 8);
        if (x > INT64_MAX) return -1;
        *v = (int64_t)x;
        return 0;
    }
    case CS_GGUF_INT64: {
        int64_t x;
        memcpy(&x, p, 8);
        *v = x;
        return 0;
    }
    default: return -1;
    }
}

int cs__gguf_get_u32(const cs_gguf *g, const char *key, uint32_t *out) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    if (!kv) return CS_ENOENT;
    int64_t v;
    if (get_int(kv, &v) || v < 0 || v > UINT32_MAX)
        return cs_fail(CS_EBADMSG, "gguf: key '%s' must be a non-negative 32-bit integer", key);
    *out = (uint32_t)v;
    return 0;
}

int cs__gguf_get_f32(const cs_gguf *g, const char *key, float *out) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    if (!kv) return CS_ENOENT;
    if (kv->type == CS_GGUF_FLOAT32) {
        memcpy(out, kv->data, 4);
    } else if (kv->type == CS_GGUF_FLOAT64) {
        double d;
        memcpy(&d, kv->data, 8);
        *out = (float)d;
    } else {
        int64_t v;
        if (get_int(kv, &v)) return cs_fail(CS_EBADMSG, "gguf: key '%s' must be a number", key);
        *out = (float)v;
    }
    return 0;
}

int cs__gguf_get_bool(const cs_gguf *g, const char *key, bool *out) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    if (!kv) return CS_ENOENT;
    if (kv->type != CS_GGUF_BOOL) return cs_fail(CS_EBADMSG, "gguf: key '%s' must be a bool", key);
    *out = kv->data[0] != 0;
    return 0;
}

int cs__gguf_get_str(const cs_gguf *g, const char *key, cs_gguf_str *out) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    if (!kv) return CS_ENOENT;
    if (kv->type != CS_GGUF_STRING)
        return cs_fail(CS_EBADMSG, "gguf: key '%s' must be a string", key);
    uint64_t len;
    memcpy(&len, kv->data, 8);
    out->ptr = (const char *)kv->data + 8;
    out->len = (size_t)len;
    return 0;
}

int cs__gguf_get_str_array(const cs_gguf *g, const char *key, cs_gguf_str **out, uint64_t *count) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    if (!kv) return CS_ENOENT;
    if (kv->type != CS_GGUF_ARRAY || kv->arr_type != CS_GGUF_STRING)
        return cs_fail(CS_EBADMSG, "gguf: key '%s' must be an array of strings", key);
    cs_gguf_str *a = malloc((kv->arr_count ? kv->arr_count : 1) * sizeof *a);
    if (!a) return cs_fail(CS_ENOMEM, "gguf: out of memory reading '%s'", key);
    const uint8_t *p = kv->data; /* already validated by open */
    for (uint64_t i = 0; i < kv->arr_count; i++) {
        uint64_t len;
        memcpy(&len, p, 8);
        a[i].ptr = (const char *)p + 8;
        a[i].len = (size_t)len;
        p += 8 + len;
    }
    *out = a;
    *count = kv->arr_count;
    return 0;
}

/* A 4-byte-element array of one of two element types, copied. */
static int get_array4(const cs_gguf *g, const char *key, enum cs_gguf_type t1, enum cs_gguf_type t2,
                      const char *what, void **out, uint64_t *count) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    if (!kv) return CS_ENOENT;
    if (kv->type != CS_GGUF_ARRAY || (kv->arr_type != t1 && kv->arr_type != t2))
        return cs_fail(CS_EBADMSG, "gguf: key '%s' must be an array of %s", key, what);
    void *a = malloc((kv->arr_count ? kv->arr_count : 1) * 4);
    if (!a) return cs_fail(CS_ENOMEM, "gguf: out of memory reading '%s'", key);
    if (kv->arr_count) memcpy(a, kv->data, kv->arr_count * 4);
    *out = a;
    *count = kv->arr_count;
    return 0;
}

int cs__gguf_get_f32_array(const cs_gguf *g, const char *key, float **out, uint64_t *count) {
    return get_array4(g, key, CS_GGUF_FLOAT32, CS_GGUF_FLOAT32, "32-bit floats", (void **)out,
                      count);
}

int cs__gguf_get_i32_array(const cs_gguf *g, const char *key, int32_t **out, uint64_t *count) {
    return get_array4(g, key, CS_GGUF_INT32, CS_GGUF_UINT32, "32-bit integers", (void **)out,
                      count);
}
