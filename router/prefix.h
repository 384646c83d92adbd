/* prefix.h: which prompt pages a worker holds, as the router sees it
 * (prefix-aware placement).
 *
 * A request's prefix is the chain of its full KV pages' hashes, computed as
 * the workers' prefix cache computes them (cs_kv_cache_page_hash, rooted at
 * cs_kv_cache_hash_root of the cache salt), so a page hash names one prompt
 * prefix of one tenant. The router records on each worker the chain of every
 * request it placed there, and predicts a new request's cached tokens on a
 * worker as the leading pages of its chain found there. The record is the
 * router's own (approximate, as SGLang's cache-aware router): no message
 * from the workers; an entry expires after a TTL, the oldest go first when a
 * worker's set is full (at most as many pages as its pool: beyond, its own
 * LRU has evicted some), and a worker that restarted (new instance id)
 * starts empty. What it gets wrong shows as the difference between the
 * router's chunkserve:prefix_predicted_tokens_total and the cached tokens
 * the workers report.
 *
 * A worker that publishes a summary of its cache (WorkerStatus
 * .prefix_summary: a Bloom filter of its registered page hashes, complete up
 * to a time it reports) corrects the record: a page then counts when the
 * summary has it, or when the router placed it there less than
 * CS_PREFIX_OWN_GRACE_S before the time the summary is complete up to (its
 * pages register as they are computed, after queueing and prefill). So what
 * the worker evicted (for whatever reason: other routers' traffic too)
 * shows a summary interval plus the grace later, and the filter's false
 * positives (~0.24% a page at 16 bits a page) are the error left. Loop
 * thread only. */
#ifndef CHUNKSERVE_ROUTER_PREFIX_H
#define CHUNKSERVE_ROUTER_PREFIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The pages a worker reuses for a context of n tokens: the full pages
 * before its last token (one token is always computed: it yields the
 * logits). */
int32_t cs_prefix_pages(int64_t n_tokens, int32_t page_size);

/* out[0..k) = the chain of the first k = min(cs_prefix_pages(n), cap) full
 * pages of ids under cache_salt (NULL or "": the shared namespace); k. */
int32_t cs_prefix_chain(const int32_t *ids, int64_t n, int32_t page_size, const char *cache_salt,
                        uint64_t *out, int32_t cap);

typedef struct cs_prefix_set cs_prefix_set;

/* A set of at most cap page hashes; NULL when out of memory. */
cs_prefix_set *cs_prefix_set_new(int32_t cap);
void cs_prefix_set_free(cs_prefix_set *s);
void cs_prefix_set_clear(cs_prefix_set *s);
int32_t cs_prefix_set_size(const cs_prefix_set *s);
/* Records the n hashes of chain as held at time now (seconds): new ones
 * after the others, evicting the oldest recorded when full; known ones get
 * the new time. */
void cs_prefix_set_add(cs_prefix_set *s, const uint64_t *chain, int32_t n, double now);
/* The leading hashes of chain recorded within ttl seconds of now. */
int32_t cs_prefix_set_match(const cs_prefix_set *s, const uint64_t *chain, int32_t n, double now,
                            double ttl);

enum { CS_PREFIX_OWN_GRACE_S = 2 };

/* A worker's published summary (bits owned; NULL: none). */
typedef struct {
    uint8_t *bits;
    size_t n_bits;
    uint64_t version; /* the worker's; 0 = none */
    double complete;  /* it shows every page registered before this time (router clock) */
} cs_prefix_summary;

/* Replaces sum with a copy of bits (n_bits a power of two >= 8, len bytes);
 * CS_EINVAL for a malformed one (sum unchanged), CS_ENOMEM. */
int cs_prefix_summary_set(cs_prefix_summary *sum, const uint8_t *bits, size_t len, size_t n_bits,
                          uint64_t version, double complete);
void cs_prefix_summary_clear(cs_prefix_summary *sum);

/* The leading pages of chain the worker holds: with a summary, those it has
 * or that s recorded after sum->complete - CS_PREFIX_OWN_GRACE_S (and
 * within ttl); without one (sum NULL or empty), cs_prefix_set_match. s may
 * be NULL. */
int32_t cs_prefix_match(const cs_prefix_set *s, const cs_prefix_summary *sum, const uint64_t *chain,
                        int32_t n, double now, double ttl);

#endif
