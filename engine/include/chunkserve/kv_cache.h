/* chunkserve/kv_cache.h: the KV page allocator. The pool's memory lives in
 * the backend (host or device); this hands out page ids (int32, never
 * pointers), counts references (a page shared by several sequences' prefixes
 * is freed when its last reference goes) and keeps per-sequence page tables.
 * Single-threaded: the engine thread owns it. */
#ifndef CHUNKSERVE_KV_CACHE_H
#define CHUNKSERVE_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_kv_cache cs_kv_cache;

/* n_pages >= 1 pages of page_size >= 1 tokens. Free with cs_kv_cache_free. */
int cs_kv_cache_init(int32_t n_pages, int32_t page_size, cs_kv_cache **out);
void cs_kv_cache_free(cs_kv_cache *kv); /* NULL is a no-op */

int32_t cs_kv_cache_n_pages(const cs_kv_cache *kv);
int32_t cs_kv_cache_page_size(const cs_kv_cache *kv);
int32_t cs_kv_cache_n_free(const cs_kv_cache *kv); /* truly free pages: cached ones not counted */

/* Allocates n pages (refcount 1) into ids: all or nothing. Free pages go
 * first, then cached pages are evicted oldest first (and unregistered).
 * CS_ENOSPC (and no change) when free + cached < n; CS_EINVAL for n < 0. */
int cs_kv_cache_alloc_pages(cs_kv_cache *kv, int32_t n, int32_t *ids);
/* Adds a reference to an allocated page (prefix sharing). CS_EINVAL for an
 * id out of range or not allocated, including a cached page (no references):
 * its id is stale for whoever passes it, so take it back with
 * cs_kv_cache_lookup instead. */
int cs_kv_cache_ref_page(cs_kv_cache *kv, int32_t id);
/* Drops one reference from each page; a page whose count reaches 0 is free
 * again, or cached (newest in the LRU) when registered. Checks every id
 * first: CS_EINVAL (and no change) for an id out of range or with no
 * reference (free or cached). */
int cs_kv_cache_free_pages(cs_kv_cache *kv, const int32_t *ids, int32_t n);
/* References held on page id (0 = free or cached); -1 for an id out of range. */
int32_t cs_kv_cache_refcount(const cs_kv_cache *kv, int32_t id);

/* ---- prefix caching ----
 * A full page can be registered under a hash of its tokens chained with the
 * hash of the page before it (cs_kv_cache_page_hash), so its content is
 * identified by the whole prefix. When its last reference goes, a registered
 * page is not freed but kept as "cached" (LRU order) and can be taken back
 * by a later prompt with the same prefix; cached pages are evicted, oldest
 * first, only when allocation finds no free page. Always:
 *   n_free + n_used + n_cached == n_pages. */

/* Hash of one page's tokens (page_size of them) given the previous page's
 * hash (0 for the first page): XXH64 of the tokens as int32 little-endian
 * bytes with parent as the seed, so the same on every host and run.
 * n_tokens >= 0 (tokens may be NULL when it is 0). */
uint64_t cs_kv_cache_page_hash(uint64_t parent, const int32_t *tokens, int32_t n_tokens);
/* The parent of a prompt's first page under cache_salt: 0 (the shared
 * namespace) for NULL or "", else a hash of the salt (never 0), so tenants
 * with different salts never share a page. */
uint64_t cs_kv_cache_hash_root(const char *cache_salt);
/* Registers allocated page id as holding the prefix identified by hash. A
 * page already registered under another hash is re-registered; if another
 * page already holds hash, nothing changes (the first copy wins; id keeps
 * any registration it had). Returns 0 in all these cases. CS_EINVAL for an
 * id out of range or with no reference. */
int cs_kv_cache_register(cs_kv_cache *kv, int32_t id, uint64_t hash);
/* The page registered under hash with one more reference (taken back from
 * the cached LRU if it had none), or -1 when no page holds it. */
int32_t cs_kv_cache_lookup(cs_kv_cache *kv, uint64_t hash);
int32_t cs_kv_cache_n_cached(const cs_kv_cache *kv); /* registered pages with no reference */
int32_t cs_kv_cache_n_used(const cs_kv_cache *kv);   /* pages with references */
/* Forgets every registration (cached pages become free; pages in use stay
 * in use, unregistered). */
void cs_kv_cache_clear_prefixes(cs_kv_cache *kv);
/* Whether page id is registered (in use or cached); its hash into *hash when
 * hash is not NULL. False for an id out of range. */
bool cs_kv_cache_registered(const cs_kv_cache *kv, int32_t id, uint64_t *hash);
/* Changes whenever a registration is added or removed (a summary made at
 * one version stays true until the next). */
uint64_t cs_kv_cache_version(const cs_kv_cache *kv);

/* Prefix summary: what a worker publishes about its prefix cache (the
 * router's prefix-aware placement reads it): a Bloom filter of every
 * registered page hash, cached or in use. n_bits is a power of two; each
 * hash sets CS_KV_SUMMARY_PROBES bits. At cs_kv_summary_bits(n_pages) bits
 * (16 per page) a hash that is not there tests present with probability
 * ~0.24% when the pool is full of registered pages; a hash that is there
 * always tests present. */
enum { CS_KV_SUMMARY_PROBES = 4 };
size_t cs_kv_summary_bits(int32_t n_pages); /* 16 per page, in [1024, 2^24] */
/* Fills bits[0 .. n_bits / 8) (n_bits a power of two >= 8). */
void cs_kv_cache_summary(const cs_kv_cache *kv, uint8_t *bits, size_t n_bits);
bool cs_kv_summary_has(const uint8_t *bits, size_t n_bits, uint64_t hash);
/* Full consistency check, O(n_pages) (for tests and debugging): counters,
 * free stack, LRU and hash table agree with each page's refcount and
 * registration, with no duplicates. 0, or CS_EBADMSG with a message naming
 * the first broken invariant (CS_ENOMEM if its scratch space fails). */
int cs_kv_cache_check(const cs_kv_cache *kv);

/* ---- blocks: pages of several kinds ----
 * A sequence's positions go in blocks of page_size. Without sliding-window
 * layers a block is one page holding every layer's K and V. A model with
 * windowed layers (cs_kv_cache_set_blocks) holds a block in per_block pages
 * of the same size, each for a few layers: the first n_global kinds for the
 * layers that attend to every position before them, the others for the
 * windowed layers, which a query at position p reads only for keys in
 * (p - window, p]. A sequence keeps its windowed pages only for the blocks
 * its next query can still see (cs_page_table_trim gives back the rest), so
 * their memory is bounded by the window whatever the context, and a KV
 * transfer moves only those. Default: one global page per block, no window. */
int cs_kv_cache_set_blocks(cs_kv_cache *kv, int32_t per_block, int32_t n_global, int32_t window);
/* The blocks' shape, also what a worker publishes (WorkerStatus) so a
 * router counts pages as the worker does: the cs_kv_blocks_* functions are
 * the cs_kv_cache_* ones below on a shape alone. */
typedef struct {
    int32_t page_size, per_block, n_global, window;
} cs_kv_blocks;
const cs_kv_blocks *cs_kv_cache_blocks(const cs_kv_cache *kv);
int32_t cs_kv_blocks_window_block(const cs_kv_blocks *b, int64_t pos);
int32_t cs_kv_blocks_xfer_index(const cs_kv_blocks *b, int64_t n_tokens, int64_t block);
int32_t cs_kv_blocks_seq_pages(const cs_kv_blocks *b, int64_t n_tokens);
int32_t cs_kv_blocks_min_pages(const cs_kv_blocks *b, int64_t n_tokens);
int32_t cs_kv_cache_per_block(const cs_kv_cache *kv);
int32_t cs_kv_cache_n_global(const cs_kv_cache *kv);
int32_t cs_kv_cache_window(const cs_kv_cache *kv); /* 0: no windowed kind */
/* The first block whose windowed pages a query at position pos reads: the
 * block of pos - window + 1 (0 without a window). */
int32_t cs_kv_cache_window_block(const cs_kv_cache *kv, int32_t pos);
/* Pages that hold positions [0, n_tokens) for a next query at n_tokens:
 * every global kind of every block, the windowed kinds from
 * cs_kv_cache_window_block(n_tokens) on. What a sequence keeps between
 * steps, and what a KV transfer of n_tokens positions moves. */
int32_t cs_kv_cache_seq_pages(const cs_kv_cache *kv, int32_t n_tokens);
/* The least a pool must hold for a sequence of n_tokens positions to be
 * computed one token a step: every global page, and the windowed pages the
 * widest window a query sees spans (window - 1) / page_size + 2 blocks,
 * whatever its alignment. The admission bound (a larger sequence never
 * fits). */
int32_t cs_kv_cache_min_pages(const cs_kv_cache *kv, int32_t n_tokens);
/* Where block's first page sits in that transfer's order (block by block,
 * kinds in order, windowed kinds only from the window block on). */
int32_t cs_kv_cache_xfer_index(const cs_kv_cache *kv, int32_t n_tokens, int32_t block);
/* The hash a block's page of kind `kind` is registered under in the prefix
 * cache: the block's chained hash itself for kind 0 (what the router's
 * prefix summaries test), a hash of it and the kind for the others. */
uint64_t cs_kv_cache_kind_hash(uint64_t block_hash, int32_t kind);
/* Whether some page (in use or cached) is registered under hash; takes
 * nothing. */
bool cs_kv_cache_has(const cs_kv_cache *kv, uint64_t hash);

/* A sequence's page table: pages[j * cap + i] is the page of kind j holding
 * block i, positions [i * page_size, (i + 1) * page_size), for i < n_pages
 * (blocks; with one kind per block, the page of block i at pages[i]).
 * Windowed kinds are held for blocks [win_lo, n_pages) only; entries before
 * are -1. Zero-initialized = empty. */
typedef struct {
    int32_t *pages;
    int32_t n_pages; /* blocks */
    int32_t cap;     /* blocks each kind's row has room for (the rows' stride) */
    int32_t win_lo;  /* first block whose windowed pages are held */
} cs_page_table;

/* Grows pt so it covers n_tokens positions for a computation whose first
 * query is at `from` (from == n_tokens: pages a KV transfer lands in, for a
 * next query at n_tokens): every global kind of every block, the windowed
 * kinds from cs_kv_cache_window_block(from) on. All or nothing: CS_ENOSPC
 * leaves pt as it was; CS_EINVAL for from outside [0, n_tokens]. */
int cs_page_table_reserve(cs_page_table *pt, cs_kv_cache *kv, int32_t from, int32_t n_tokens);
/* The pages that reserve(pt, kv, from, n_tokens) would allocate. */
int32_t cs_page_table_need(const cs_page_table *pt, const cs_kv_cache *kv, int32_t from,
                           int32_t n_tokens);
/* Gives back the windowed pages of blocks no query at position >= next
 * reads (before cs_kv_cache_window_block(next)). */
void cs_page_table_trim(cs_page_table *pt, cs_kv_cache *kv, int32_t next);
/* Writes the pages of blocks [b0, b1) in a transfer of n_tokens positions'
 * order (cs_kv_cache_xfer_index) into out; returns how many, or CS_EINVAL
 * when a page that order names is not held. */
int32_t cs_page_table_xfer(const cs_page_table *pt, const cs_kv_cache *kv, int32_t n_tokens,
                           int32_t b0, int32_t b1, int32_t *out);
/* The pages pt holds. */
int32_t cs_page_table_held(const cs_page_table *pt, const cs_kv_cache *kv);
/* Drops the table's references and empties it (keeps nothing allocated). */
void cs_page_table_release(cs_page_table *pt, cs_kv_cache *kv);

#ifdef __cplusplus
}
#endif
#endif
