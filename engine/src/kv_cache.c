/* kv_cache.c: page ids from a free stack, reference counts, page tables and
 * the prefix cache (hash -> page table, LRU of cached pages). Every structure
 * is sized from n_pages at init; no operation allocates. Not the KV memory
 * itself, which the backend owns. */
#include "chunkserve/kv_cache.h"

#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH64_state_t on the stack (big-endian path) */
#include <xxhash.h>

#include "util.h"

struct cs_kv_cache {
    int32_t n_pages;
    int32_t page_size;
    cs_kv_blocks blocks; /* how a block of page_size positions is held */
    int32_t n_free;
    int32_t n_cached;
    int32_t *free_stack; /* (n_pages) ids of free pages, top at n_free - 1 */
    int32_t *refs;       /* (n_pages) references per page; 0 = free or cached */
    uint64_t *hash;      /* (n_pages) registered hash, valid where registered[id] */
    uint8_t *registered; /* (n_pages) 1 when the page is in the hash table */
    int32_t *lru_prev;   /* (n_pages) cached pages only, -1 elsewhere and at the ends */
    int32_t *lru_next;   /* (n_pages) */
    int32_t lru_head;    /* oldest cached page (evicted first), -1 when none */
    int32_t lru_tail;    /* newest cached page */
    /* Open addressing, linear probing, load <= 1/2 (at most n_pages keys in
     * >= 2 * n_pages slots); deletion shifts back, so there are no tombstones. */
    int32_t *slots;   /* (slot_mask + 1) page id or -1 */
    size_t slot_mask; /* slots - 1, a power of two minus one */
    int slot_bits;    /* log2(slots), >= 1 */
    uint64_t version; /* bumped by every change to the registrations */
};

int cs_kv_cache_init(int32_t n_pages, int32_t page_size, cs_kv_cache **out) {
    *out = NULL;
    if (n_pages < 1 || page_size < 1)
        return cs_fail(
            CS_EINVAL,
            "kv cache: need at least one page of at least one token (got %d pages of %d)", n_pages,
            page_size);
    int bits = 1;
    while ((UINT64_C(1) << bits) < 2 * (uint64_t)n_pages)
        bits++;
    if ((UINT64_C(1) << bits) > SIZE_MAX / sizeof(int32_t))
        return cs_fail(CS_ENOMEM, "kv cache: %d pages too many for this host", n_pages);
    size_t n_slots = (size_t)1 << bits;
    size_t n = (size_t)n_pages;
    cs_kv_cache *kv = calloc(1, sizeof *kv);
    if (kv) {
        kv->free_stack = malloc(n * sizeof(int32_t));
        kv->refs = calloc(n, sizeof(int32_t));
        kv->hash = calloc(n, sizeof(uint64_t));
        kv->registered = calloc(n, 1);
        kv->lru_prev = malloc(n * sizeof(int32_t));
        kv->lru_next = malloc(n * sizeof(int32_t));
        kv->slots = calloc(n_slots, sizeof(int32_t));
    }
    if (!kv || !kv->free_stack || !kv->refs || !kv->hash || !kv->registered || !kv->lru_prev ||
        !kv->lru_next || !kv->slots) {
        cs_kv_cache_free(kv);
        return cs_fail(CS_ENOMEM, "kv cache: out of memory for %d pages", n_pages);
    }
    kv->n_pages = n_pages;
    kv->page_size = page_size;
    kv->blocks = (cs_kv_blocks){page_size, 1, 1, 0};
    kv->n_free = n_pages;
    /* lowest ids on top, so a fresh cache hands out 0, 1, 2, ... */
    for (int32_t i = 0; i < n_pages; i++)
        kv->free_stack[i] = n_pages - 1 - i;
    for (int32_t i = 0; i < n_pages; i++)
        kv->lru_prev[i] = kv->lru_next[i] = -1;
    kv->lru_head = kv->lru_tail = -1;
    kv->slot_bits = bits;
    kv->slot_mask = n_slots - 1;
    for (size_t i = 0; i < n_slots; i++)
        kv->slots[i] = -1;
    *out = kv;
    return 0;
}

void cs_kv_cache_free(cs_kv_cache *kv) {
    if (!kv) return;
    free(kv->free_stack);
    free(kv->refs);
    free(kv->hash);
    free(kv->registered);
    free(kv->lru_prev);
    free(kv->lru_next);
    free(kv->slots);
    free(kv);
}

int32_t cs_kv_cache_n_pages(const cs_kv_cache *kv) {
    return kv->n_pages;
}
int32_t cs_kv_cache_page_size(const cs_kv_cache *kv) {
    return kv->page_size;
}
int32_t cs_kv_cache_n_free(const cs_kv_cache *kv) {
    return kv->n_free;
}
int32_t cs_kv_cache_n_cached(const cs_kv_cache *kv) {
    return kv->n_cached;
}
int32_t cs_kv_cache_n_used(const cs_kv_cache *kv) {
    return kv->n_pages - kv->n_free - kv->n_cached;
}

/* ---- blocks ---- */

int32_t cs_kv_blocks_window_block(const cs_kv_blocks *b, int64_t pos) {
    if (!b->window || pos < b->window) return 0;
    int64_t wb = (pos - b->window + 1) / b->page_size;
    return wb > INT32_MAX ? INT32_MAX : (int32_t)wb;
}

static int32_t clamp32(int64_t n) {
    return n > INT32_MAX ? INT32_MAX : (int32_t)n;
}

int32_t cs_kv_blocks_xfer_index(const cs_kv_blocks *b, int64_t n_tokens, int64_t block) {
    int64_t wb = cs_kv_blocks_window_block(b, n_tokens);
    return clamp32((int64_t)b->n_global * block +
                   (int64_t)(b->per_block - b->n_global) * (block > wb ? block - wb : 0));
}

int32_t cs_kv_blocks_seq_pages(const cs_kv_blocks *b, int64_t n_tokens) {
    if (n_tokens < 0) n_tokens = 0;
    return cs_kv_blocks_xfer_index(b, n_tokens, (n_tokens + b->page_size - 1) / b->page_size);
}

int32_t cs_kv_blocks_min_pages(const cs_kv_blocks *b, int64_t n_tokens) {
    if (n_tokens < 0) n_tokens = 0;
    int64_t blocks = (n_tokens + b->page_size - 1) / b->page_size;
    int64_t win = b->window ? (b->window - 1) / b->page_size + 2 : 0; /* any alignment */
    return clamp32((int64_t)b->n_global * blocks +
                   (int64_t)(b->per_block - b->n_global) * (win < blocks ? win : blocks));
}

int cs_kv_cache_set_blocks(cs_kv_cache *kv, int32_t per_block, int32_t n_global, int32_t window) {
    if (per_block < 1 || n_global < 0 || n_global > per_block || window < 0 ||
        (n_global < per_block) != (window > 0))
        return cs_fail(CS_EINVAL,
                       "kv cache: %d pages per block, %d of them global, window %d: need "
                       "0 <= global <= per block, and a window > 0 exactly when some kind is "
                       "windowed",
                       per_block, n_global, window);
    kv->blocks = (cs_kv_blocks){kv->page_size, per_block, n_global, window};
    return 0;
}
const cs_kv_blocks *cs_kv_cache_blocks(const cs_kv_cache *kv) {
    return &kv->blocks;
}
int32_t cs_kv_cache_per_block(const cs_kv_cache *kv) {
    return kv->blocks.per_block;
}
int32_t cs_kv_cache_n_global(const cs_kv_cache *kv) {
    return kv->blocks.n_global;
}
int32_t cs_kv_cache_window(const cs_kv_cache *kv) {
    return kv->blocks.window;
}
int32_t cs_kv_cache_window_block(const cs_kv_cache *kv, int32_t pos) {
    return cs_kv_blocks_window_block(&kv->blocks, pos);
}
int32_t cs_kv_cache_xfer_index(const cs_kv_cache *kv, int32_t n_tokens, int32_t block) {
    return cs_kv_blocks_xfer_index(&kv->blocks, n_tokens, block);
}
int32_t cs_kv_cache_seq_pages(const cs_kv_cache *kv, int32_t n_tokens) {
    return cs_kv_blocks_seq_pages(&kv->blocks, n_tokens);
}
int32_t cs_kv_cache_min_pages(const cs_kv_cache *kv, int32_t n_tokens) {
    return cs_kv_blocks_min_pages(&kv->blocks, n_tokens);
}

uint64_t cs_kv_cache_kind_hash(uint64_t block_hash, int32_t kind) {
    if (kind == 0) return block_hash;
    /* a negative "token": never a block's own hash, even of one-token blocks */
    int32_t t = -kind;
    return cs_kv_cache_page_hash(block_hash, &t, 1);
}

/* ---- hash table ---- */

/* Callers may register any 64-bit value, not only xxHash output (tests use
 * 1, 2, 3), so the home slot comes from a Fibonacci multiply of all bits. */
static size_t slot_home(const cs_kv_cache *kv, uint64_t h) {
    return (size_t)((h * 0x9E3779B97F4A7C15ull) >> (64 - kv->slot_bits));
}

/* Slot holding hash h, or the empty slot where it would go. */
static size_t slot_find(const cs_kv_cache *kv, uint64_t h) {
    size_t i = slot_home(kv, h);
    while (kv->slots[i] >= 0 && kv->hash[kv->slots[i]] != h)
        i = (i + 1) & kv->slot_mask;
    return i;
}

static void table_insert(cs_kv_cache *kv, int32_t id, uint64_t h) {
    size_t i = slot_find(kv, h);
    CS_ASSERT(kv->slots[i] < 0);
    kv->hash[id] = h;
    kv->registered[id] = 1;
    kv->slots[i] = id;
    kv->version++;
}

static void table_remove(cs_kv_cache *kv, int32_t id) {
    CS_ASSERT(kv->registered[id]);
    size_t i = slot_find(kv, kv->hash[id]);
    CS_ASSERT(kv->slots[i] == id);
    /* Backward-shift deletion: pull later entries of the probe run into the
     * hole unless their home lies cyclically in (hole, j]. */
    for (size_t j = (i + 1) & kv->slot_mask; kv->slots[j] >= 0; j = (j + 1) & kv->slot_mask) {
        size_t k = slot_home(kv, kv->hash[kv->slots[j]]);
        bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            kv->slots[i] = kv->slots[j];
            i = j;
        }
    }
    kv->slots[i] = -1;
    kv->registered[id] = 0;
    kv->version++;
}

/* ---- LRU of cached pages ---- */

static void lru_push_tail(cs_kv_cache *kv, int32_t id) {
    kv->lru_prev[id] = kv->lru_tail;
    kv->lru_next[id] = -1;
    if (kv->lru_tail >= 0)
        kv->lru_next[kv->lru_tail] = id;
    else
        kv->lru_head = id;
    kv->lru_tail = id;
    kv->n_cached++;
}

static void lru_unlink(cs_kv_cache *kv, int32_t id) {
    int32_t p = kv->lru_prev[id], n = kv->lru_next[id];
    if (p >= 0)
        kv->lru_next[p] = n;
    else
        kv->lru_head = n;
    if (n >= 0)
        kv->lru_prev[n] = p;
    else
        kv->lru_tail = p;
    kv->lru_prev[id] = kv->lru_next[id] = -1;
    kv->n_cached--;
}

/* ---- pages ---- */

int cs_kv_cache_alloc_pages(cs_kv_cache *kv, int32_t n, int32_t *ids) {
    if (n < 0) return cs_fail(CS_EINVAL, "kv cache: cannot allocate %d pages", n);
    if (n > kv->n_free + kv->n_cached)
        return cs_fail(CS_ENOSPC, "kv cache: %d pages wanted, %d free and %d cached of %d", n,
                       kv->n_free, kv->n_cached, kv->n_pages);
    for (int32_t i = 0; i < n; i++) {
        int32_t id;
        if (kv->n_free > 0) {
            id = kv->free_stack[--kv->n_free];
        } else {
            id = kv->lru_head;
            lru_unlink(kv, id);
            table_remove(kv, id);
        }
        CS_ASSERT(kv->refs[id] == 0 && !kv->registered[id]);
        kv->refs[id] = 1;
        ids[i] = id;
    }
    return 0;
}

int cs_kv_cache_ref_page(cs_kv_cache *kv, int32_t id) {
    if (id < 0 || id >= kv->n_pages)
        return cs_fail(CS_EINVAL, "kv cache: page %d out of range (%d pages)", id, kv->n_pages);
    /* A cached page is held by nobody, so the caller's id is stale: accepting
     * it would make the bug visible only when the page had been evicted. */
    if (kv->refs[id] == 0 && kv->registered[id])
        return cs_fail(CS_EINVAL,
                       "kv cache: page %d is cached with no reference; take it back with "
                       "cs_kv_cache_lookup",
                       id);
    if (kv->refs[id] == 0) return cs_fail(CS_EINVAL, "kv cache: page %d is not allocated", id);
    kv->refs[id]++;
    return 0;
}

int cs_kv_cache_free_pages(cs_kv_cache *kv, const int32_t *ids, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= kv->n_pages || kv->refs[id] == 0)
            return cs_fail(CS_EINVAL, "kv cache: page %d is not allocated (double free?)", id);
    }
    /* a page listed twice must hold two references */
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i], seen = 0;
        for (int32_t j = 0; j < n; j++)
            seen += ids[j] == id;
        if (seen > kv->refs[id])
            return cs_fail(CS_EINVAL, "kv cache: page %d freed %d times but holds %d references",
                           id, seen, kv->refs[id]);
    }
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (--kv->refs[id] > 0) continue;
        if (kv->registered[id])
            lru_push_tail(kv, id);
        else
            kv->free_stack[kv->n_free++] = id;
    }
    return 0;
}

int32_t cs_kv_cache_refcount(const cs_kv_cache *kv, int32_t id) {
    if (id < 0 || id >= kv->n_pages) return -1;
    return kv->refs[id];
}

/* ---- prefix caching ---- */

uint64_t cs_kv_cache_hash_root(const char *cache_salt) {
    if (!cache_salt || !cache_salt[0]) return 0;
    return XXH64(cache_salt, strlen(cache_salt), 0x63616368652d73ull) | 1;
}

uint64_t cs_kv_cache_page_hash(uint64_t parent, const int32_t *tokens, int32_t n_tokens) {
    CS_ASSERT(n_tokens >= 0 && (tokens || n_tokens == 0));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return XXH64(tokens, (size_t)n_tokens * sizeof(int32_t), parent);
#else
    /* The hash is defined over little-endian bytes so that it is the same on
     * every host; a big-endian one swaps through a small buffer. */
    XXH64_state_t st;
    XXH64_reset(&st, parent);
    uint8_t buf[256];
    for (int32_t i = 0; i < n_tokens;) {
        size_t k = 0;
        for (; k < sizeof buf && i < n_tokens; k += 4, i++) {
            uint32_t t = (uint32_t)tokens[i];
            buf[k] = (uint8_t)t;
            buf[k + 1] = (uint8_t)(t >> 8);
            buf[k + 2] = (uint8_t)(t >> 16);
            buf[k + 3] = (uint8_t)(t >> 24);
        }
        XXH64_update(&st, buf, k);
    }
    return XXH64_digest(&st);
#endif
}

int cs_kv_cache_register(cs_kv_cache *kv, int32_t id, uint64_t hash) {
    if (id < 0 || id >= kv->n_pages || kv->refs[id] == 0)
        return cs_fail(CS_EINVAL, "kv cache: cannot register page %d: not allocated", id);
    int32_t holder = kv->slots[slot_find(kv, hash)];
    if (holder >= 0) return 0; /* this page already, or another copy that wins */
    if (kv->registered[id]) table_remove(kv, id);
    table_insert(kv, id, hash);
    return 0;
}

int32_t cs_kv_cache_lookup(cs_kv_cache *kv, uint64_t hash) {
    int32_t id = kv->slots[slot_find(kv, hash)];
    if (id < 0) return -1;
    if (kv->refs[id] == 0) lru_unlink(kv, id);
    kv->refs[id]++;
    return id;
}

bool cs_kv_cache_has(const cs_kv_cache *kv, uint64_t hash) {
    return kv->slots[slot_find(kv, hash)] >= 0;
}

bool cs_kv_cache_registered(const cs_kv_cache *kv, int32_t id, uint64_t *hash) {
    if (id < 0 || id >= kv->n_pages || !kv->registered[id]) return false;
    if (hash) *hash = kv->hash[id];
    return true;
}

uint64_t cs_kv_cache_version(const cs_kv_cache *kv) {
    return kv->version;
}

size_t cs_kv_summary_bits(int32_t n_pages) {
    size_t n = 1024;
    while (n < 16 * (size_t)(n_pages > 0 ? n_pages : 1) && n < ((size_t)1 << 24))
        n *= 2;
    return n;
}

/* Probe i of hash: double hashing over the hash's two halves (a page hash
 * is already uniformly random). */
static size_t probe(uint64_t h, int i, size_t n_bits) {
    uint32_t a = (uint32_t)h, b = (uint32_t)(h >> 32) | 1;
    return (size_t)(a + (uint32_t)i * b) & (n_bits - 1);
}

void cs_kv_cache_summary(const cs_kv_cache *kv, uint8_t *bits, size_t n_bits) {
    CS_ASSERT(n_bits >= 8 && (n_bits & (n_bits - 1)) == 0);
    memset(bits, 0, n_bits / 8);
    for (int32_t id = 0; id < kv->n_pages; id++) {
        if (!kv->registered[id]) continue;
        for (int i = 0; i < CS_KV_SUMMARY_PROBES; i++) {
            size_t k = probe(kv->hash[id], i, n_bits);
            bits[k / 8] |= (uint8_t)(1u << (k % 8));
        }
    }
}

bool cs_kv_summary_has(const uint8_t *bits, size_t n_bits, uint64_t hash) {
    if (n_bits < 8 || (n_bits & (n_bits - 1))) return false;
    for (int i = 0; i < CS_KV_SUMMARY_PROBES; i++) {
        size_t k = probe(hash, i, n_bits);
        if (!(bits[k / 8] & (1u << (k % 8)))) return false;
    }
    return true;
}

void cs_kv_cache_clear_prefixes(cs_kv_cache *kv) {
    kv->version++;
    while (kv->lru_head >= 0) {
        int32_t id = kv->lru_head;
        lru_unlink(kv, id);
        kv->free_stack[kv->n_free++] = id;
    }
    memset(kv->registered, 0, (size_t)kv->n_pages);
    for (size_t i = 0; i <= kv->slot_mask; i++)
        kv->slots[i] = -1;
}

/* Separate from CS_ASSERT so a test can report every kind of breakage as a
 * message; O(n_pages + slots), not for the hot path. */
int cs_kv_cache_check(const cs_kv_cache *kv) {
    int32_t n = kv->n_pages, n_free = 0, n_cached = 0, n_reg = 0;
    if (kv->n_free < 0 || kv->n_free > n || kv->n_cached < 0 || kv->n_cached > n - kv->n_free)
        return cs_fail(CS_EBADMSG, "kv check: counts free %d cached %d of %d", kv->n_free,
                       kv->n_cached, n);
    for (int32_t id = 0; id < n; id++) {
        if (kv->refs[id] < 0)
            return cs_fail(CS_EBADMSG, "kv check: page %d refcount %d", id, kv->refs[id]);
        bool cached = kv->refs[id] == 0 && kv->registered[id];
        n_free += kv->refs[id] == 0 && !kv->registered[id];
        n_cached += cached;
        n_reg += kv->registered[id] != 0;
        if (!cached && (kv->lru_prev[id] != -1 || kv->lru_next[id] != -1))
            return cs_fail(CS_EBADMSG, "kv check: page %d not cached but has LRU links %d/%d", id,
                           kv->lru_prev[id], kv->lru_next[id]);
        if (kv->registered[id] && kv->slots[slot_find(kv, kv->hash[id])] != id)
            return cs_fail(CS_EBADMSG,
                           "kv check: registered page %d not found under its hash %016llx", id,
                           (unsigned long long)kv->hash[id]);
    }
    if (n_free != kv->n_free || n_cached != kv->n_cached)
        return cs_fail(CS_EBADMSG, "kv check: %d free and %d cached pages, counters say %d and %d",
                       n_free, n_cached, kv->n_free, kv->n_cached);

    uint8_t *seen = calloc((size_t)n, 1);
    if (!seen) return cs_fail(CS_ENOMEM, "kv check: out of memory");
    int r = 0;
    for (int32_t i = 0; i < kv->n_free && !r; i++) {
        int32_t id = kv->free_stack[i];
        if (id < 0 || id >= n || seen[id] || kv->refs[id] != 0 || kv->registered[id])
            r = cs_fail(CS_EBADMSG,
                        "kv check: free stack entry %d is page %d (not free, or listed twice)", i,
                        id);
        else
            seen[id] = 1;
    }
    /* Walk the LRU from its head checking each back link; a cycle or a stray
     * page shows up as a page seen twice, a non-cached page, or a count or
     * end that differs from n_cached and lru_tail. */
    int32_t steps = 0, prev = -1, cur = kv->lru_head;
    while (cur >= 0 && cur < n && !r) {
        if (seen[cur] || kv->refs[cur] != 0 || !kv->registered[cur] || kv->lru_prev[cur] != prev)
            r = cs_fail(CS_EBADMSG,
                        "kv check: LRU entry %d is page %d (not cached, bad link, or listed twice)",
                        steps, cur);
        seen[cur] = 2;
        prev = cur;
        cur = kv->lru_next[cur];
        steps++;
    }
    if (!r && (cur != -1 || steps != kv->n_cached || kv->lru_tail != prev))
        r = cs_fail(CS_EBADMSG,
                    "kv check: LRU holds %d pages ending at %d (next %d), expected %d ending at %d",
                    steps, prev, cur, kv->n_cached, kv->lru_tail);
    int32_t n_slots_used = 0;
    for (size_t i = 0; i <= kv->slot_mask && !r; i++) {
        int32_t id = kv->slots[i];
        if (id < 0) continue;
        n_slots_used++;
        if (id >= n || !kv->registered[id] || slot_find(kv, kv->hash[id]) != i)
            r = cs_fail(CS_EBADMSG,
                        "kv check: slot %zu holds page %d, which is not registered there", i, id);
    }
    if (!r && n_slots_used != n_reg)
        r = cs_fail(CS_EBADMSG, "kv check: hash table holds %d pages, %d are registered",
                    n_slots_used, n_reg);
    free(seen);
    return r;
}
