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

/* A sequence's page table: pages[i] holds positions [i*page_size, (i+1)*page_size). */
typedef struct {
    int32_t *pages;
    int32_t n_pages;
    int32_t cap;
} cs_page_table;

/* Grows pt so it covers n_tokens positions, allocating the missing pages:
 * all or nothing (CS_ENOSPC leaves pt as it was). */
int cs_page_table_reserve(cs_page_table *pt, cs_kv_cache *kv, int32_t n_tokens);
/* Drops the table's references and empties it (keeps nothing allocated). */
void cs_page_table_release(cs_page_table *pt, cs_kv_cache *kv);

#ifdef __cplusplus
}
#endif
#endif
