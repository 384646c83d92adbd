/* page_table.c: a sequence's pages, block by block and kind by kind, and
 * the windowed kinds' pages given back once no later query can see them
 * (the layout is in chunkserve/kv_cache.h). */
#include <stdlib.h>
#include <string.h>

#include "chunkserve/kv_cache.h"
#include "util.h"

static int32_t blocks_for(const cs_kv_cache *kv, int32_t n_tokens) {
    int32_t ps = cs_kv_cache_page_size(kv);
    return (int32_t)(((int64_t)n_tokens + ps - 1) / ps);
}

static int32_t *row(const cs_page_table *pt, int32_t kind) {
    return pt->pages + (size_t)kind * (size_t)pt->cap;
}

/* Blocks [lo, hi) whose windowed pages reserve(from, n_tokens) allocates:
 * the window the first query reads up to the last block, less those held. */
typedef struct {
    int32_t blocks, new_lo; /* the table after: blocks, and win_lo */
    int32_t a_lo, a_hi;     /* windowed pages to allocate before the held ones */
    int32_t b_lo, b_hi;     /* ... and after them */
    bool drop_old;          /* the held ones lie wholly before the window: give them back */
} plan;

static plan make_plan(const cs_page_table *pt, const cs_kv_cache *kv, int32_t from,
                      int32_t n_tokens) {
    plan p = {0};
    p.blocks = blocks_for(kv, n_tokens);
    if (p.blocks < pt->n_pages) p.blocks = pt->n_pages;
    int32_t wb = cs_kv_cache_window_block(kv, from);
    if (wb > p.blocks) wb = p.blocks;
    int32_t lo = pt->win_lo, hi = pt->n_pages; /* held: [lo, hi) */
    if (lo >= hi || hi < wb) {                 /* nothing held that the window reads */
        p.drop_old = lo < hi;
        p.new_lo = wb;
        p.b_lo = wb;
        p.b_hi = p.blocks;
    } else {
        p.new_lo = wb < lo ? wb : lo;
        p.a_lo = p.new_lo;
        p.a_hi = lo;
        p.b_lo = hi;
        p.b_hi = p.blocks;
    }
    return p;
}

static int32_t plan_pages(const plan *p, const cs_page_table *pt, const cs_kv_cache *kv) {
    int32_t n_win = cs_kv_cache_per_block(kv) - cs_kv_cache_n_global(kv);
    int64_t n = (int64_t)cs_kv_cache_n_global(kv) * (p->blocks - pt->n_pages) +
                (int64_t)n_win * ((p->a_hi - p->a_lo) + (p->b_hi - p->b_lo));
    return n > INT32_MAX ? INT32_MAX : (int32_t)n;
}

int32_t cs_page_table_need(const cs_page_table *pt, const cs_kv_cache *kv, int32_t from,
                           int32_t n_tokens) {
    plan p = make_plan(pt, kv, from, n_tokens);
    return plan_pages(&p, pt, kv);
}

static int grow(cs_page_table *pt, int32_t per_block, int32_t blocks) {
    if (blocks <= pt->cap) return 0;
    int32_t cap = pt->cap ? pt->cap : 8;
    while (cap < blocks)
        cap *= 2;
    int32_t *p = malloc((size_t)cap * (size_t)per_block * sizeof *p);
    if (!p) return cs_fail(CS_ENOMEM, "page table: out of memory");
    for (int32_t j = 0; j < per_block; j++) {
        int32_t *dst = p + (size_t)j * (size_t)cap;
        if (pt->n_pages) memcpy(dst, row(pt, j), (size_t)pt->n_pages * sizeof *p);
        for (int32_t i = pt->n_pages; i < cap; i++)
            dst[i] = -1;
    }
    free(pt->pages);
    pt->pages = p;
    pt->cap = cap;
    return 0;
}

static void free_range(cs_page_table *pt, cs_kv_cache *kv, int32_t kind, int32_t lo, int32_t hi) {
    if (hi <= lo) return;
    int32_t *r = row(pt, kind) + lo;
    int rc = cs_kv_cache_free_pages(kv, r, hi - lo);
    CS_ASSERT(rc == 0);
    for (int32_t i = 0; i < hi - lo; i++)
        r[i] = -1;
}

static void alloc_range(cs_page_table *pt, cs_kv_cache *kv, int32_t kind, int32_t lo, int32_t hi) {
    if (hi <= lo) return;
    int rc = cs_kv_cache_alloc_pages(kv, hi - lo, row(pt, kind) + lo);
    CS_ASSERT(rc == 0); /* counted before: the pool had room for all of them */
}

int cs_page_table_reserve(cs_page_table *pt, cs_kv_cache *kv, int32_t from, int32_t n_tokens) {
    if (n_tokens < 0 || from < 0 || from > n_tokens)
        return cs_fail(CS_EINVAL, "page table: positions %d..%d", from, n_tokens);
    if (pt->win_lo > 0 && cs_kv_cache_window_block(kv, from) < pt->win_lo)
        return cs_fail(CS_EINVAL,
                       "page table: a query at %d reads windowed pages of block %d, given back "
                       "(the table holds them from block %d)",
                       from, cs_kv_cache_window_block(kv, from), pt->win_lo);
    plan p = make_plan(pt, kv, from, n_tokens);
    int32_t need = plan_pages(&p, pt, kv);
    if (need == 0) return 0;
    if (need > cs_kv_cache_n_free(kv) + cs_kv_cache_n_cached(kv))
        return cs_fail(CS_ENOSPC, "kv cache: %d pages wanted, %d free and %d cached of %d", need,
                       cs_kv_cache_n_free(kv), cs_kv_cache_n_cached(kv), cs_kv_cache_n_pages(kv));
    const int32_t per_block = cs_kv_cache_per_block(kv), n_global = cs_kv_cache_n_global(kv);
    int r = grow(pt, per_block, p.blocks);
    if (r) return r;
    for (int32_t j = 0; j < n_global; j++)
        alloc_range(pt, kv, j, pt->n_pages, p.blocks);
    for (int32_t j = n_global; j < per_block; j++) {
        if (p.drop_old) free_range(pt, kv, j, pt->win_lo, pt->n_pages);
        alloc_range(pt, kv, j, p.a_lo, p.a_hi);
        alloc_range(pt, kv, j, p.b_lo, p.b_hi);
    }
    pt->n_pages = p.blocks;
    pt->win_lo = p.new_lo;
    return 0;
}

void cs_page_table_trim(cs_page_table *pt, cs_kv_cache *kv, int32_t next) {
    int32_t wb = cs_kv_cache_window_block(kv, next);
    if (wb > pt->n_pages) wb = pt->n_pages;
    if (wb <= pt->win_lo) return;
    for (int32_t j = cs_kv_cache_n_global(kv); j < cs_kv_cache_per_block(kv); j++)
        free_range(pt, kv, j, pt->win_lo, wb);
    pt->win_lo = wb;
}

int32_t cs_page_table_xfer(const cs_page_table *pt, const cs_kv_cache *kv, int32_t n_tokens,
                           int32_t b0, int32_t b1, int32_t *out) {
    const int32_t per_block = cs_kv_cache_per_block(kv), n_global = cs_kv_cache_n_global(kv);
    const int32_t wb = cs_kv_cache_window_block(kv, n_tokens);
    if (b0 < 0 || b1 > pt->n_pages || b1 > blocks_for(kv, n_tokens))
        return cs_fail(CS_EINVAL, "page table: blocks %d..%d of a table of %d", b0, b1,
                       pt->n_pages);
    int32_t n = 0;
    for (int32_t b = b0; b < b1; b++)
        for (int32_t j = 0; j < per_block; j++) {
            if (j >= n_global && b < wb) continue;
            int32_t id = row(pt, j)[b];
            if (id < 0)
                return cs_fail(CS_EINVAL, "page table: kind %d of block %d is not held", j, b);
            out[n++] = id;
        }
    return n;
}

int32_t cs_page_table_held(const cs_page_table *pt, const cs_kv_cache *kv) {
    int32_t n_global = cs_kv_cache_n_global(kv), n_win = cs_kv_cache_per_block(kv) - n_global;
    int32_t win = pt->n_pages > pt->win_lo ? pt->n_pages - pt->win_lo : 0;
    return n_global * pt->n_pages + n_win * win;
}

void cs_page_table_release(cs_page_table *pt, cs_kv_cache *kv) {
    if (pt->n_pages) {
        const int32_t n_global = cs_kv_cache_n_global(kv);
        for (int32_t j = 0; j < cs_kv_cache_per_block(kv); j++)
            free_range(pt, kv, j, j < n_global ? 0 : pt->win_lo, pt->n_pages);
    }
    free(pt->pages);
    memset(pt, 0, sizeof *pt);
}
