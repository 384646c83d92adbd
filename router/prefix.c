/* prefix.c: see prefix.h. The set is an open-addressing table (linear
 * probing, backward-shift deletion) of hash -> time, with a ring of the
 * hashes in the order they were first recorded for eviction. */
#include "prefix.h"

#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/kv_cache.h"

int32_t cs_prefix_pages(int64_t n_tokens, int32_t page_size) {
    if (page_size <= 0 || n_tokens < 2) return 0;
    int64_t k = (n_tokens - 1) / page_size;
    return k > INT32_MAX ? INT32_MAX : (int32_t)k;
}

int32_t cs_prefix_chain(const int32_t *ids, int64_t n, int32_t page_size, const char *cache_salt,
                        uint64_t *out, int32_t cap) {
    int32_t k = cs_prefix_pages(n, page_size);
    if (k > cap) k = cap;
    uint64_t h = cs_kv_cache_hash_root(cache_salt);
    for (int32_t i = 0; i < k; i++)
        out[i] = h = cs_kv_cache_page_hash(h, ids + (size_t)i * page_size, page_size);
    return k;
}

typedef struct {
    uint64_t h; /* 0: empty (a real hash of 0 is stored as 1) */
    double t;
} slot;

struct cs_prefix_set {
    slot *tab;
    size_t mask; /* table size - 1 (a power of two, at least twice cap) */
    uint64_t *ring;
    int32_t cap, n, head; /* ring: n hashes from head, oldest first */
};

static uint64_t key(uint64_t h) {
    return h ? h : 1;
}

static size_t home(const cs_prefix_set *s, uint64_t h) {
    return (size_t)(h ^ (h >> 29)) & s->mask;
}

cs_prefix_set *cs_prefix_set_new(int32_t cap) {
    if (cap < 1) cap = 1;
    size_t size = 16;
    while (size < 2 * (size_t)cap)
        size *= 2;
    cs_prefix_set *s = calloc(1, sizeof *s);
    if (s) s->tab = calloc(size, sizeof *s->tab);
    if (s && s->tab) s->ring = malloc((size_t)cap * sizeof *s->ring);
    if (!s || !s->tab || !s->ring) {
        cs_prefix_set_free(s);
        return NULL;
    }
    s->mask = size - 1;
    s->cap = cap;
    return s;
}

void cs_prefix_set_free(cs_prefix_set *s) {
    if (!s) return;
    free(s->tab);
    free(s->ring);
    free(s);
}

void cs_prefix_set_clear(cs_prefix_set *s) {
    memset(s->tab, 0, (s->mask + 1) * sizeof *s->tab);
    s->n = s->head = 0;
}

int32_t cs_prefix_set_size(const cs_prefix_set *s) {
    return s->n;
}

static slot *find(const cs_prefix_set *s, uint64_t h) {
    for (size_t i = home(s, h);; i = (i + 1) & s->mask) {
        if (s->tab[i].h == h) return &s->tab[i];
        if (!s->tab[i].h) return NULL;
    }
}

/* Removes h, shifting back the entries its slot separated from home. */
static void delete (cs_prefix_set *s, uint64_t h) {
    size_t i = home(s, h);
    while (s->tab[i].h != h) {
        if (!s->tab[i].h) return;
        i = (i + 1) & s->mask;
    }
    for (size_t j = (i + 1) & s->mask; s->tab[j].h; j = (j + 1) & s->mask) {
        size_t k = home(s, s->tab[j].h);
        /* j's entry may move to i when its home is not in (i, j] (cyclically) */
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            s->tab[i] = s->tab[j];
            i = j;
        }
    }
    s->tab[i].h = 0;
}

void cs_prefix_set_add(cs_prefix_set *s, const uint64_t *chain, int32_t n, double now) {
    for (int32_t c = 0; c < n; c++) {
        uint64_t h = key(chain[c]);
        slot *e = find(s, h);
        if (e) {
            e->t = now;
            continue;
        }
        if (s->n == s->cap) { /* the oldest recorded goes */
            delete (s, s->ring[s->head]);
            s->head = (s->head + 1) % s->cap;
            s->n--;
        }
        size_t i = home(s, h);
        while (s->tab[i].h)
            i = (i + 1) & s->mask;
        s->tab[i] = (slot){h, now};
        s->ring[(s->head + s->n) % s->cap] = h;
        s->n++;
    }
}

int32_t cs_prefix_set_match(const cs_prefix_set *s, const uint64_t *chain, int32_t n, double now,
                            double ttl) {
    int32_t k = 0;
    for (; k < n; k++) {
        const slot *e = find(s, key(chain[k]));
        if (!e || now - e->t > ttl) break;
    }
    return k;
}

int cs_prefix_summary_set(cs_prefix_summary *sum, const uint8_t *bits, size_t len, size_t n_bits,
                          uint64_t version, double complete) {
    if (n_bits < 8 || (n_bits & (n_bits - 1)) || len != n_bits / 8 || version == 0)
        return CS_EINVAL;
    uint8_t *b = malloc(len);
    if (!b) return CS_ENOMEM;
    memcpy(b, bits, len);
    free(sum->bits);
    *sum = (cs_prefix_summary){b, n_bits, version, complete};
    return 0;
}

void cs_prefix_summary_clear(cs_prefix_summary *sum) {
    free(sum->bits);
    memset(sum, 0, sizeof *sum);
}

int32_t cs_prefix_match(const cs_prefix_set *s, const cs_prefix_summary *sum, const uint64_t *chain,
                        int32_t n, double now, double ttl) {
    if (!sum || !sum->bits) return s ? cs_prefix_set_match(s, chain, n, now, ttl) : 0;
    int32_t k = 0;
    for (; k < n; k++) {
        if (cs_kv_summary_has(sum->bits, sum->n_bits, chain[k])) continue;
        const slot *e = s ? find(s, key(chain[k])) : NULL;
        if (!e || e->t < sum->complete - CS_PREFIX_OWN_GRACE_S || now - e->t > ttl) break;
    }
    return k;
}
