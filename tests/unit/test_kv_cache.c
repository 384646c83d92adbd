/* test_kv_cache: page allocation and reference counts, the prefix cache
 * (register, lookup, LRU eviction, clear), the page hash, page tables, and a
 * randomized run checked against a simple model of the cache after every
 * operation. */
#include "chunkserve/kv_cache.h"

#include <xxhash.h>

#include "test.h"

#define CHECK(kv) ASSERT_EQ_INT(cs_kv_cache_check(kv), 0)

static void counts_are(const cs_kv_cache *kv, int32_t n_free, int32_t n_used, int32_t n_cached) {
    ASSERT_EQ_INT(cs_kv_cache_check(kv), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), n_free);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), n_used);
    ASSERT_EQ_INT(cs_kv_cache_n_cached(kv), n_cached);
}

static void test_init_alloc_free(void) {
    cs_kv_cache *kv = (cs_kv_cache *)1;
    ASSERT_EQ_INT(cs_kv_cache_init(0, 16, &kv), CS_EINVAL);
    ASSERT_TRUE(kv == NULL);
    ASSERT_EQ_INT(cs_kv_cache_init(4, 0, &kv), CS_EINVAL);
    cs_kv_cache_free(NULL);

    ASSERT_EQ_INT(cs_kv_cache_init(4, 16, &kv), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_pages(kv), 4);
    ASSERT_EQ_INT(cs_kv_cache_page_size(kv), 16);
    counts_are(kv, 4, 0, 0);
    int32_t ids[4];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, -1, ids), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 0, ids), 0);
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 4, ids), 0);
    for (int i = 0; i < 4; i++)
        ASSERT_EQ_INT(ids[i], i); /* fresh cache: 0, 1, 2, ... */
    counts_are(kv, 0, 4, 0);
    int32_t more;
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 1, &more), CS_ENOSPC);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &ids[1], 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &ids[1], 1), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "double free");
    int32_t twice[2] = {0, 0};
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, twice, 2), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "freed 2 times");
    int32_t bad[2] = {2, 4};
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, bad, 2), CS_EINVAL); /* and page 2 untouched */
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, 2), 1);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, 4), -1);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, -1), -1);
    ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, 1), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, -1), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, 4), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, 0), 0);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, 0), 2);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, twice, 2), 0);
    counts_are(kv, 2, 2, 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &ids[2], 2), 0);
    counts_are(kv, 4, 0, 0);
    cs_kv_cache_free(kv);
}

static void test_register_lookup(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(4, 16, &kv), 0);
    int32_t ids[2];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 2, ids), 0);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[0], 100), 0);
    uint64_t h = 0;
    ASSERT_TRUE(cs_kv_cache_registered(kv, ids[0], &h));
    ASSERT_EQ_INT(h, 100);
    ASSERT_TRUE(!cs_kv_cache_registered(kv, ids[1], NULL));
    ASSERT_TRUE(!cs_kv_cache_registered(kv, 99, NULL));

    /* registered + last reference gone -> cached, not free */
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids, 2), 0);
    counts_are(kv, 3, 0, 1);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, ids[0]), 0);
    ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, ids[0]), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "cached");
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids, 1), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[0], 101), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[1], 101), CS_EINVAL); /* free page */
    ASSERT_EQ_INT(cs_kv_cache_register(kv, -1, 101), CS_EINVAL);
    counts_are(kv, 3, 0, 1);

    /* miss, then hit on the cached page, then hit on the used page */
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 101), -1);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 100), ids[0]);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, ids[0]), 1);
    counts_are(kv, 3, 1, 0);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 100), ids[0]);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, ids[0]), 2);
    counts_are(kv, 3, 1, 0);
    int32_t two[2] = {ids[0], ids[0]};
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, two, 2), 0);
    counts_are(kv, 3, 0, 1);
    cs_kv_cache_free(kv);
}

static void test_eviction_order(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(4, 1, &kv), 0);
    int32_t ids[4];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 4, ids), 0);
    for (int i = 0; i < 4; i++)
        ASSERT_EQ_INT(cs_kv_cache_register(kv, i, 1000 + i), 0);
    const int32_t order[4] = {2, 0, 3, 1};
    for (int i = 0; i < 4; i++)
        ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &order[i], 1), 0);
    counts_are(kv, 0, 0, 4); /* LRU, oldest first: 2 0 3 1 */
    /* using page 0 again makes it the newest: 2 3 1 0 */
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 1000), 0);
    int32_t p0 = 0;
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &p0, 1), 0);

    int32_t got[3];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 1, got), 0);
    ASSERT_EQ_INT(got[0], 2);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 1002), -1); /* evicted pages are unregistered */
    ASSERT_TRUE(!cs_kv_cache_registered(kv, 2, NULL));
    counts_are(kv, 0, 1, 3);
    /* a truly free page goes before any cached one */
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, got, 1), 0);
    counts_are(kv, 1, 0, 3);
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 1, got), 0);
    ASSERT_EQ_INT(got[0], 2);
    counts_are(kv, 0, 1, 3);
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 2, got + 1), 0);
    ASSERT_EQ_INT(got[1], 3);
    ASSERT_EQ_INT(got[2], 1);
    counts_are(kv, 0, 3, 1);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 1000), 0); /* the newest survived */
    counts_are(kv, 0, 4, 0);
    cs_kv_cache_free(kv);
}

static void test_alloc_all_or_nothing(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(4, 1, &kv), 0);
    int32_t ids[4];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 4, ids), 0);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[0], 7), 0);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[1], 8), 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids, 3), 0);
    counts_are(kv, 1, 1, 2);
    int32_t got[4] = {-1, -1, -1, -1};
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 4, got), CS_ENOSPC);
    ASSERT_MSG_HAS(cs_last_error(), "2 cached");
    counts_are(kv, 1, 1, 2);
    ASSERT_EQ_INT(got[0], -1);
    ASSERT_TRUE(cs_kv_cache_registered(kv, ids[0], NULL));
    ASSERT_TRUE(cs_kv_cache_registered(kv, ids[1], NULL));
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 3, got), 0);
    ASSERT_EQ_INT(got[0], ids[2]);
    ASSERT_EQ_INT(got[1], ids[0]);
    ASSERT_EQ_INT(got[2], ids[1]);
    counts_are(kv, 0, 4, 0);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 7), -1);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 8), -1);
    cs_kv_cache_free(kv);
}

static void test_page_hash(void) {
    const int32_t toks[4] = {1, -2, 0x01020304, 151643};
    uint8_t bytes[16];
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 4; b++)
            bytes[4 * i + b] = (uint8_t)((uint32_t)toks[i] >> (8 * b));
    uint64_t h1 = cs_kv_cache_page_hash(0, toks, 4);
    ASSERT_TRUE(h1 ==
                XXH64(bytes, sizeof bytes, 0)); /* int32 little-endian bytes, parent as seed */
    ASSERT_TRUE(h1 == cs_kv_cache_page_hash(0, toks, 4));
    uint64_t h2 = cs_kv_cache_page_hash(h1, toks, 4);
    ASSERT_TRUE(h2 == XXH64(bytes, sizeof bytes, h1));
    ASSERT_TRUE(h2 != h1); /* same tokens after a different prefix */
    ASSERT_TRUE(cs_kv_cache_page_hash(1, toks, 4) != h1);
    const int32_t swapped[4] = {-2, 1, 0x01020304, 151643};
    ASSERT_TRUE(cs_kv_cache_page_hash(0, swapped, 4) != h1);
    ASSERT_TRUE(cs_kv_cache_page_hash(0, toks, 3) != h1);
    ASSERT_TRUE(cs_kv_cache_page_hash(5, NULL, 0) == XXH64(NULL, 0, 5));
}

static void test_reregister(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(4, 1, &kv), 0);
    int32_t ids[2];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 2, ids), 0);
    int32_t a = ids[0], b = ids[1];
    uint64_t h;
    ASSERT_EQ_INT(cs_kv_cache_register(kv, a, 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, a, 1), 0); /* same hash again: no-op */
    CHECK(kv);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, a, 2), 0); /* moves a to hash 2 */
    CHECK(kv);
    ASSERT_TRUE(cs_kv_cache_registered(kv, a, &h) && h == 2);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 1), -1);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 2), a);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, a), 2);
    /* another page with a held hash: the first copy wins, b stays unregistered */
    ASSERT_EQ_INT(cs_kv_cache_register(kv, b, 2), 0);
    ASSERT_TRUE(!cs_kv_cache_registered(kv, b, NULL));
    /* ... or keeps the registration it had */
    ASSERT_EQ_INT(cs_kv_cache_register(kv, b, 3), 0);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, b, 2), 0);
    ASSERT_TRUE(cs_kv_cache_registered(kv, b, &h) && h == 3);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 2), a);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, a), 3);
    CHECK(kv);
    int32_t all[4] = {a, a, a, b};
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, all, 4), 0);
    counts_are(kv, 2, 0, 2);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 3), b);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 2), a);
    counts_are(kv, 2, 2, 0);
    cs_kv_cache_free(kv);
}

static void test_clear_prefixes(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(6, 1, &kv), 0);
    int32_t ids[6];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 5, ids), 0);
    for (int i = 0; i < 4; i++)
        ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[i], 50 + i), 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids, 2),
                  0); /* 0, 1 cached; 2, 3 used+registered; 4 used */
    counts_are(kv, 1, 3, 2);
    cs_kv_cache_clear_prefixes(kv);
    counts_are(kv, 3, 3, 0);
    for (int i = 0; i < 4; i++) {
        ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 50 + i), -1);
        ASSERT_TRUE(!cs_kv_cache_registered(kv, ids[i], NULL));
    }
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids + 2, 3), 0);
    counts_are(kv, 6, 0, 0);
    cs_kv_cache_clear_prefixes(kv); /* nothing registered: no-op */
    counts_are(kv, 6, 0, 0);
    /* the hash table is usable again after a clear */
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 1, ids), 0);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[0], 50), 0);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 50), ids[0]);
    CHECK(kv);
    cs_kv_cache_free(kv);
}

static void test_page_table(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(4, 16, &kv), 0);
    cs_page_table pt = {0}, other = {0};
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, 0, 17), 0);
    ASSERT_EQ_INT(pt.n_pages, 2);
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, 0, 32), 0);
    ASSERT_EQ_INT(pt.n_pages, 2);
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, 0, -1), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_register(kv, pt.pages[0], 9), 0);
    ASSERT_EQ_INT(cs_page_table_reserve(&other, kv, 0, 16 * 3), CS_ENOSPC);
    ASSERT_EQ_INT(other.n_pages, 0);
    cs_page_table_release(&pt, kv);
    ASSERT_TRUE(pt.pages == NULL && pt.n_pages == 0);
    counts_are(kv, 3, 0, 1);
    /* the cached page is evicted once the table needs it */
    ASSERT_EQ_INT(cs_page_table_reserve(&other, kv, 0, 16 * 4), 0);
    counts_are(kv, 0, 4, 0);
    ASSERT_EQ_INT(cs_kv_cache_lookup(kv, 9), -1);
    cs_page_table_release(&other, kv);
    counts_are(kv, 4, 0, 0);
    cs_kv_cache_free(kv);
}

/* ---- randomized: the cache against a plain model of it ---- */

#define MAX_PAGES 64
#define MAX_HELD 4096
#define N_KEYS 48

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33) % n;
}

typedef struct {
    int32_t n;
    int32_t refs[MAX_PAGES];
    bool reg[MAX_PAGES];
    uint64_t hash[MAX_PAGES];
    int32_t lru[MAX_PAGES]; /* oldest first */
    int32_t n_lru;
    int32_t held[MAX_HELD]; /* one entry per reference the test holds */
    int32_t n_held;
} model;

static void lru_remove(model *m, int32_t id) {
    for (int32_t i = 0; i < m->n_lru; i++)
        if (m->lru[i] == id) {
            memmove(m->lru + i, m->lru + i + 1, (size_t)(m->n_lru - i - 1) * sizeof(int32_t));
            m->n_lru--;
            return;
        }
    ASSERT_TRUE(!"page not in model LRU");
}

static int32_t holder_of(const model *m, uint64_t h) {
    for (int32_t id = 0; id < m->n; id++)
        if (m->reg[id] && m->hash[id] == h) return id;
    return -1;
}

static void compare(const cs_kv_cache *kv, const model *m) {
    ASSERT_EQ_INT(cs_kv_cache_check(kv), 0);
    int32_t n_free = 0;
    for (int32_t id = 0; id < m->n; id++) {
        ASSERT_EQ_INT(cs_kv_cache_refcount(kv, id), m->refs[id]);
        uint64_t h;
        ASSERT_EQ_INT(cs_kv_cache_registered(kv, id, &h), m->reg[id]);
        if (m->reg[id]) ASSERT_TRUE(h == m->hash[id]);
        n_free += m->refs[id] == 0 && !m->reg[id];
    }
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), n_free);
    ASSERT_EQ_INT(cs_kv_cache_n_cached(kv), m->n_lru);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), m->n - n_free - m->n_lru);
}

static void random_run(int32_t n_pages, uint64_t seed, int n_ops) {
    static model m;
    memset(&m, 0, sizeof m);
    m.n = n_pages;
    rng_state = seed;
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(n_pages, 4, &kv), 0);
    /* real page hashes plus small raw values, which crowd the table's probe runs */
    uint64_t keys[N_KEYS];
    for (int i = 0; i < N_KEYS; i++) {
        int32_t t[4] = {i, i * 7, -i, 3};
        keys[i] = i % 2 ? cs_kv_cache_page_hash(keys[i - 1], t, 4) : (uint64_t)i;
    }
    for (int op = 0; op < n_ops; op++) {
        int kind = (int)rnd(100);
        if (kind < 25) { /* alloc */
            int32_t n = (int32_t)rnd((uint32_t)n_pages / 2 + 2), ids[MAX_PAGES + 2];
            int32_t n_free = n_pages - m.n_lru;
            for (int32_t id = 0; id < n_pages; id++)
                n_free -= m.refs[id] > 0;
            if (m.n_held + n > MAX_HELD) continue;
            int r = cs_kv_cache_alloc_pages(kv, n, ids);
            if (n > n_free + m.n_lru) {
                ASSERT_EQ_INT(r, CS_ENOSPC);
            } else {
                ASSERT_EQ_INT(r, 0);
                for (int32_t i = 0; i < n; i++) {
                    int32_t id = ids[i];
                    ASSERT_TRUE(id >= 0 && id < n_pages);
                    if (i < n_free) {
                        ASSERT_TRUE(m.refs[id] == 0 && !m.reg[id]);
                    } else {
                        ASSERT_TRUE(m.n_lru > 0);
                        ASSERT_EQ_INT(id, m.lru[0]); /* oldest cached page */
                        lru_remove(&m, id);
                        m.reg[id] = false;
                    }
                    m.refs[id] = 1;
                    m.held[m.n_held++] = id;
                }
            }
        } else if (kind < 50) { /* free some held references, sometimes a bad id */
            int32_t n = (int32_t)rnd(4), ids[4], pick[4];
            if (n > m.n_held) n = m.n_held;
            for (int32_t i = 0; i < n; i++) {
                int32_t j;
                bool dup;
                do { /* distinct held entries */
                    j = (int32_t)rnd((uint32_t)m.n_held);
                    dup = false;
                    for (int32_t k = 0; k < i; k++)
                        dup |= pick[k] == j;
                } while (dup);
                pick[i] = j;
                ids[i] = m.held[j];
            }
            bool bad = n < 4 && rnd(8) == 0;
            if (bad) {
                int32_t id = (int32_t)rnd((uint32_t)n_pages + 2) - 1;
                if (id >= 0 && id < n_pages && m.refs[id] > 0)
                    bad = false;
                else
                    ids[n++] = id;
            }
            int r = cs_kv_cache_free_pages(kv, ids, n);
            if (bad) {
                ASSERT_EQ_INT(r, CS_EINVAL);
            } else {
                ASSERT_EQ_INT(r, 0);
                /* drop picked entries, highest index first so the rest stay valid */
                for (int32_t i = 0; i < n; i++) {
                    int32_t id = ids[i];
                    if (--m.refs[id] == 0 && m.reg[id]) m.lru[m.n_lru++] = id;
                }
                for (int32_t a = 0; a < n; a++)
                    for (int32_t b = a + 1; b < n; b++)
                        if (pick[b] > pick[a]) {
                            int32_t t = pick[a];
                            pick[a] = pick[b], pick[b] = t;
                        }
                for (int32_t i = 0; i < n; i++)
                    m.held[pick[i]] = m.held[--m.n_held];
            }
        } else if (kind < 65) { /* register a held page */
            if (!m.n_held) continue;
            int32_t id = m.held[rnd((uint32_t)m.n_held)];
            uint64_t h = keys[rnd(N_KEYS)];
            ASSERT_EQ_INT(cs_kv_cache_register(kv, id, h), 0);
            if (holder_of(&m, h) < 0) m.reg[id] = true, m.hash[id] = h;
        } else if (kind < 85) { /* lookup */
            uint64_t h = keys[rnd(N_KEYS)];
            int32_t want = holder_of(&m, h);
            if (want >= 0 && m.n_held == MAX_HELD) continue;
            ASSERT_EQ_INT(cs_kv_cache_lookup(kv, h), want);
            if (want >= 0) {
                if (m.refs[want] == 0) lru_remove(&m, want);
                m.refs[want]++;
                m.held[m.n_held++] = want;
            }
        } else if (kind < 93) { /* ref_page: held pages yes, cached or free no */
            int32_t id = (int32_t)rnd((uint32_t)n_pages);
            if (m.n_held == MAX_HELD) continue;
            if (m.refs[id] > 0) {
                ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, id), 0);
                m.refs[id]++;
                m.held[m.n_held++] = id;
            } else {
                ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, id), CS_EINVAL);
            }
        } else if (kind < 94) {
            cs_kv_cache_clear_prefixes(kv);
            m.n_lru = 0;
            memset(m.reg, 0, sizeof m.reg);
        } else { /* registering a page with no reference is refused */
            int32_t id = (int32_t)rnd((uint32_t)n_pages);
            if (m.refs[id] == 0) ASSERT_EQ_INT(cs_kv_cache_register(kv, id, keys[0]), CS_EINVAL);
        }
        compare(kv, &m);
    }
    /* give everything back: nothing used, and after a clear all free */
    for (int32_t i = 0; i < m.n_held; i++)
        ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &m.held[i], 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 0);
    cs_kv_cache_clear_prefixes(kv);
    counts_are(kv, n_pages, 0, 0);
    cs_kv_cache_free(kv);
}

/* The prefix summary: every registered hash tests present, an evicted one
 * (almost always) absent, few false positives in a full pool; the version
 * moves with every registration change. */
static void test_summary(void) {
    enum { N = 4096 };
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(N, 16, &kv), 0);
    size_t n_bits = cs_kv_summary_bits(N);
    ASSERT_EQ_INT((int)n_bits, 65536); /* 16 bits a page */
    ASSERT_EQ_INT((int)cs_kv_summary_bits(1), 1024);
    uint8_t *bits = malloc(n_bits / 8);
    static int32_t ids[N];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, N, ids), 0);
    uint64_t v0 = cs_kv_cache_version(kv), h = 0x1234;
    for (int i = 0; i < N; i++) {
        h = cs_kv_cache_page_hash(h, &i, 1);
        ASSERT_EQ_INT(cs_kv_cache_register(kv, ids[i], h), 0);
    }
    ASSERT_TRUE(cs_kv_cache_version(kv) != v0);
    cs_kv_cache_summary(kv, bits, n_bits);
    uint64_t hh = 0x1234;
    for (int i = 0; i < N; i++) {
        hh = cs_kv_cache_page_hash(hh, &i, 1);
        ASSERT_TRUE(cs_kv_summary_has(bits, n_bits, hh));
    }
    int fp = 0;
    for (int i = 0; i < 100000; i++) {
        int32_t t = N + i;
        fp += cs_kv_summary_has(bits, n_bits, cs_kv_cache_page_hash(0x99, &t, 1));
    }
    printf("prefix summary: %d pages in %zu bits, %d false positives in 100000 (%.3f%%)\n", N,
           n_bits, fp, fp / 1000.0);
    ASSERT_TRUE(fp < 500);                           /* theory: 0.24% */
    ASSERT_TRUE(!cs_kv_summary_has(bits, 1000, hh)); /* not a power of two: nothing */
    /* released pages stay registered (cached): same version; evicting changes it */
    uint64_t v1 = cs_kv_cache_version(kv);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids, N), 0);
    ASSERT_TRUE(cs_kv_cache_version(kv) == v1);
    int32_t got[8];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 8, got), 0); /* evicts the 8 oldest */
    ASSERT_TRUE(cs_kv_cache_version(kv) != v1);
    cs_kv_cache_summary(kv, bits, n_bits);
    int absent = 0;
    hh = 0x1234;
    for (int i = 0; i < N; i++) {
        hh = cs_kv_cache_page_hash(hh, &i, 1);
        absent += !cs_kv_summary_has(bits, n_bits, hh);
    }
    ASSERT_TRUE(absent >= 7 && absent <= 8); /* a false positive may keep one */
    cs_kv_cache_clear_prefixes(kv);
    cs_kv_cache_summary(kv, bits, n_bits);
    for (size_t i = 0; i < n_bits / 8; i++)
        ASSERT_EQ_INT(bits[i], 0);
    free(bits);
    cs_kv_cache_free(kv);
}

/* Blocks of three kinds (one global, two windowed) with a 20-position
 * window over pages of 8: reserve, trim, the transfer order, release. */
static void test_blocks(void) {
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(64, 8, &kv), 0);
    ASSERT_EQ_INT(cs_kv_cache_set_blocks(kv, 0, 0, 0), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_set_blocks(kv, 2, 3, 0), CS_EINVAL);
    ASSERT_EQ_INT(cs_kv_cache_set_blocks(kv, 3, 1, 0), CS_EINVAL); /* windowed kinds, no window */
    ASSERT_EQ_INT(cs_kv_cache_set_blocks(kv, 3, 3, 20), CS_EINVAL); /* a window, no windowed kind */
    ASSERT_EQ_INT(cs_kv_cache_set_blocks(kv, 3, 1, 20), 0);
    /* a query at p reads [p - 19, p]: block (p - 19) / 8 on */
    ASSERT_EQ_INT(cs_kv_cache_window_block(kv, 19), 0);
    ASSERT_EQ_INT(cs_kv_cache_window_block(kv, 27), 1);
    ASSERT_EQ_INT(cs_kv_cache_window_block(kv, 100), 10);
    /* 100 positions: 13 blocks; windowed kinds kept for blocks 10..12 */
    ASSERT_EQ_INT(cs_kv_cache_seq_pages(kv, 100), 13 + 2 * 3);
    ASSERT_EQ_INT(cs_kv_cache_xfer_index(kv, 100, 11), 11 + 2 * 1);
    cs_page_table pt = {0};
    /* a 40-position chunk from 0 writes every kind of blocks 0..4 */
    ASSERT_EQ_INT(cs_page_table_need(&pt, kv, 0, 40), 15);
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, 0, 40), 0);
    ASSERT_EQ_INT(cs_page_table_held(&pt, kv), 15);
    counts_are(kv, 64 - 15, 15, 0);
    /* after it, the next query (40) reads from block 2: blocks 0, 1 go */
    for (int32_t b = 0; b < 5; b++) /* registered: they become cached, not free */
        ASSERT_EQ_INT(cs_kv_cache_register(kv, pt.pages[pt.cap + b], 100 + (uint64_t)b), 0);
    cs_page_table_trim(&pt, kv, 40);
    ASSERT_EQ_INT(pt.win_lo, 2);
    ASSERT_TRUE(pt.pages[pt.cap + 0] == -1 && pt.pages[2 * pt.cap + 1] == -1);
    ASSERT_EQ_INT(cs_page_table_held(&pt, kv), 5 + 2 * 3);
    counts_are(kv, 64 - 15 + 2, 11, 2);
    /* a one-token step at 40: block 5's three kinds */
    ASSERT_EQ_INT(cs_page_table_need(&pt, kv, 40, 41), 3);
    /* the transfer of 41 positions: every global page, windowed from block 2 */
    int32_t ids[64];
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, 40, 41), 0);
    ASSERT_EQ_INT(cs_page_table_xfer(&pt, kv, 41, 0, 6, ids), cs_kv_cache_seq_pages(kv, 41));
    ASSERT_EQ_INT(ids[0], pt.pages[0]);
    ASSERT_EQ_INT(ids[2], pt.pages[2]); /* blocks 0, 1: the global page only */
    ASSERT_EQ_INT(ids[3], pt.pages[pt.cap + 2]);
    ASSERT_EQ_INT(ids[4], pt.pages[2 * pt.cap + 2]);
    /* a table trimmed past the window names pages it no longer holds: refused */
    ASSERT_EQ_INT(cs_page_table_xfer(&pt, kv, 16, 0, 2, ids), CS_EINVAL);
    /* grows far: the rows move, the held windows stay */
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, 41, 120), 0);
    ASSERT_EQ_INT(cs_page_table_held(&pt, kv), 15 + 2 * (15 - 2));
    cs_page_table_trim(&pt, kv, 120);
    ASSERT_EQ_INT(cs_page_table_held(&pt, kv), cs_kv_cache_seq_pages(kv, 120));
    /* all or nothing */
    cs_page_table other = {0};
    int32_t room = cs_kv_cache_n_free(kv) + cs_kv_cache_n_cached(kv);
    ASSERT_EQ_INT(cs_page_table_reserve(&other, kv, 0, 8 * (room / 3 + 1)), CS_ENOSPC);
    ASSERT_EQ_INT(other.n_pages, 0);
    /* a landing (from == n_tokens) takes windowed pages of the last window only */
    ASSERT_EQ_INT(cs_page_table_reserve(&other, kv, 50, 50), 0);
    ASSERT_EQ_INT(other.win_lo, cs_kv_cache_window_block(kv, 50));
    ASSERT_EQ_INT(cs_page_table_held(&other, kv), cs_kv_cache_seq_pages(kv, 50));
    cs_page_table_release(&other, kv);
    cs_page_table_release(&pt, kv);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 0);
    ASSERT_EQ_INT(cs_kv_cache_check(kv), 0);
    cs_kv_cache_free(kv);
}

int main(void) {
    test_blocks();
    test_summary();
    test_init_alloc_free();
    test_register_lookup();
    test_eviction_order();
    test_alloc_all_or_nothing();
    test_page_hash();
    test_reregister();
    test_clear_prefixes();
    test_page_table();
    random_run(1, 1, 2000);
    random_run(3, 2, 5000);
    random_run(16, 3, 20000);
    random_run(40, 4, 20000);
    random_run(MAX_PAGES, 5, 20000);
    printf("test_kv_cache: ok\n");
    return 0;
}
