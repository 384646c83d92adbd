/* test_router_place: the router's placement policy (router/pool.h) over
 * worker snapshots: decode placement by room (free pages minus pages placed
 * since the status), ties by load then rotation, the prompt's pages as a
 * floor; prefill placement by the predicted TTFT when every worker reports
 * its prefill rate, else by queued tokens plus tokens placed; unusable and
 * skipped (excluded/refused) workers never chosen; prefix-aware choice
 * (most cached tokens within the load balance, the hot prefix spreading)
 * and the router's page-hash set (the workers' hashes, eviction, expiry);
 * the learnt rest of a TTFT prediction (a windowed median). */
#include <math.h>

#include "chunkserve/kv_cache.h"
#include "demand.h"
#include "pool.h"
#include "prefix.h"
#include "test.h"

#define ONE_PAGE_BLOCKS ((cs_kv_blocks){16, 1, 1, 0}) /* a model without windows */

static cs_place_worker dec(int32_t free_pages, int32_t placed, int32_t running, int32_t waiting) {
    return (cs_place_worker){.usable = true,
                             .kv = ONE_PAGE_BLOCKS,
                             .kv_pages_free = free_pages,
                             .pages_placed = placed,
                             .num_running = running,
                             .num_waiting = waiting};
}

static cs_place_worker pre(int64_t queued, int64_t placed) {
    return (cs_place_worker){.usable = true,
                             .kv = ONE_PAGE_BLOCKS,
                             .kv_pages_total = 1000,
                             .queued_prefill_tokens = queued,
                             .tokens_placed = placed};
}

static void test_pages(void) {
    const cs_kv_blocks b16 = ONE_PAGE_BLOCKS, unknown = {0, 1, 1, 0}, b1 = {1, 1, 1, 0};
    ASSERT_EQ_INT(cs_place_pages(1, &b16), 1);
    ASSERT_EQ_INT(cs_place_pages(16, &b16), 1);
    ASSERT_EQ_INT(cs_place_pages(17, &b16), 2);
    ASSERT_EQ_INT(cs_place_pages(0, &b16), 1);
    ASSERT_EQ_INT(cs_place_pages(100, &unknown), 7); /* unknown page size: 16 */
    ASSERT_EQ_INT(cs_place_pages((int64_t)1 << 40, &b1), INT32_MAX);
    /* Gemma-3-270M's blocks: 6 pages of 16 positions, 1 global, 512-position
     * windows: 8,000 tokens land in 500 global pages + 5 x 32 windowed (blocks 468..499) */
    const cs_kv_blocks gemma = {16, 6, 1, 512};
    ASSERT_EQ_INT(cs_place_pages(8000, &gemma), 500 + 5 * 32);
    ASSERT_EQ_INT(cs_place_pages(100, &gemma), 6 * 7); /* all within the window */
    /* each worker counted by its own blocks: 700 free pages of Gemma's hold
     * an 8k-token context, 499 one-page blocks of 16 do not (500 needed) */
    cs_place_worker w[2];
    w[0] = (cs_place_worker){.usable = true, .kv = gemma, .kv_pages_free = 700};
    w[1] = (cs_place_worker){.usable = true, .kv = b16, .kv_pages_free = 499};
    ASSERT_EQ_INT(cs_place_decode(w, 2, 8000, 1, -1), 0);
    w[0].kv_pages_free = 600; /* 660 needed */
    ASSERT_EQ_INT(cs_place_decode(w, 2, 8000, 0, -1), -1);
}

static void test_decode(void) {
    cs_place_worker w[4];
    /* most room wins */
    w[0] = dec(10, 0, 0, 0), w[1] = dec(50, 0, 5, 5), w[2] = dec(30, 0, 0, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 20, 0, -1), 1);
    /* room is free minus what this router placed since the status */
    w[1].pages_placed = 25;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 20, 0, -1), 2);
    /* the prompt's pages are a floor: 300 tokens = 19 pages */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 300, 0, -1), 2);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 30 * 16 + 1, 0, -1), -1);
    /* exactly enough room is enough */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 30 * 16, 0, -1), 2);
    /* ties on room: fewest running + waiting */
    w[0] = dec(40, 0, 3, 1), w[1] = dec(40, 0, 1, 1), w[2] = dec(40, 0, 2, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0, -1), 1);
    /* full ties: the first at or after start, so equal workers share */
    w[0] = dec(40, 0, 1, 0), w[1] = dec(40, 0, 1, 0), w[2] = dec(40, 0, 1, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0, -1), 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 1, -1), 1);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 2, -1), 2);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 4, -1), 1);
    /* unusable and skipped are never chosen, whatever their room */
    w[0] = dec(1000, 0, 0, 0), w[1] = dec(999, 0, 0, 0), w[2] = dec(5, 0, 9, 9);
    w[0].usable = false;
    w[1].skip = true;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0, -1), 2);
    w[2].skip = true;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0, -1), -1);
    ASSERT_EQ_INT(cs_place_decode(w, 0, 1, 0, -1), -1);
    /* over-placed (negative room) is no room */
    w[0] = dec(2, 5, 0, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 1, 1, 0, -1), -1);
    /* page size per worker */
    w[0] = dec(4, 0, 0, 0), w[1] = dec(4, 0, 0, 0);
    w[1].kv.page_size = 64;
    ASSERT_EQ_INT(cs_place_decode(w, 2, 200, 0, -1), 1);
}

static void test_prefill(void) {
    cs_place_worker w[3];
    w[0] = pre(1000, 0), w[1] = pre(200, 0), w[2] = pre(500, 0);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), 1);
    w[1].tokens_placed = 400; /* 600 now */
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), 2);
    w[2].usable = false;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), 1);
    w[1].skip = true;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), 0);
    w[0].skip = true;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), -1);
    w[0] = pre(7, 0), w[1] = pre(7, 0), w[2] = pre(7, 0);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 2, -1, NULL), 2);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 3, -1, NULL), 0);
    /* a pool that can never hold the prompt is skipped, however idle */
    w[0] = pre(0, 0), w[1] = pre(5000, 0), w[2] = pre(9000, 0);
    w[0].kv_pages_total = 10; /* 160 tokens */
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 160, 0, -1, NULL), 0);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 161, 0, -1, NULL), 1);
    w[1].kv_pages_total = w[2].kv_pages_total = 10;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 161, 0, -1, NULL), -1);
    /* with every worker's prefill rate known: the least predicted TTFT, so a
     * worker twice as fast takes a queue up to twice as long */
    w[0] = pre(1000, 0), w[1] = pre(700, 0), w[2] = pre(1500, 300);
    w[0].prefill_rate = 2000, w[1].prefill_rate = 1000, w[2].prefill_rate = 4000;
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, NULL) - 1100.0 / 2000) < 1e-12);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), 2); /* 0.475 s, against 0.55 and 0.8 */
    w[2].cached_tokens = 100; /* its prompt held there: only a token to compute */
    ASSERT_TRUE(fabs(cs_place_ttft(&w[2], 100, NULL) - 1801.0 / 4000) < 1e-12);
    w[2].prefill_rate = 0; /* one unknown: the queues in tokens decide, as before */
    ASSERT_TRUE(isnan(cs_place_ttft(&w[2], 100, NULL)));
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0, -1, NULL), 1);

    /* with the queues' groups: a request's share as each worker serves it. w0's
     * 1,000 queued tokens are tenant b's flood, w1's 700 are the chat tenant's own */
    w[0] = pre(1000, 0), w[1] = pre(700, 0);
    w[0].prefill_rate = w[1].prefill_rate = 1000;
    cs_ttft_load q0 = {0}, q1 = {0};
    cs_ttft_load_add(&q0, 0, "b", 1, 1000);
    cs_ttft_load_add(&q1, 0, "chat", 1, 700);
    w[0].queue = &q0, w[1].queue = &q1;
    const cs_place_class chat = {0, "chat"}, b = {0, "b"}, urgent = {-1, "b"};
    /* chat on w0: its 100 and b's as many (token-fair), not all 1,000 */
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &chat) - 200.0 / 1000) < 1e-12);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &b) - 1100.0 / 1000) < 1e-12);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &urgent) - 100.0 / 1000) < 1e-12);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, NULL) - 1100.0 / 1000) < 1e-12); /* no class */
    ASSERT_EQ_INT(cs_place_prefill(w, 2, 100, 0, -1, &chat), 0); /* 0.2 s against 0.8 */
    ASSERT_EQ_INT(cs_place_prefill(w, 2, 100, 0, -1, &b), 1);    /* 0.2 s against 1.1 */
    ASSERT_EQ_INT(cs_place_prefill(w, 2, 100, 0, -1, NULL), 1);  /* the queues' sums */
    /* placed since the status: ahead of everyone */
    w[0].tokens_placed = 300;
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &chat) - 500.0 / 1000) < 1e-12);
    /* a worker that reports no groups (none, or an empty table): all of its queue is ahead */
    w[0].tokens_placed = 0, w[0].queue = NULL;
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &chat) - 1100.0 / 1000) < 1e-12);
    cs_ttft_load none = {0};
    w[0].queue = &none;
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &chat) - 1100.0 / 1000) < 1e-12);
    /* shares: a tenant of weight 4 waits for a quarter as many of b's tokens, one of
     * weight 0.25 for four times as many; the weight comes from the worker's groups,
     * also from a group of 0 tokens (a named share with nothing queued) */
    cs_ttft_load_add(&q0, 0, "big", 4, 0);
    cs_ttft_load_add(&q0, 0, "small", 0.25, 0);
    w[0].queue = &q0;
    const cs_place_class big = {0, "big"}, small = {0, "small"};
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &big) - 125.0 / 1000) < 1e-12);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &small) - 500.0 / 1000) < 1e-12);
    /* tokens past the worker's table: ahead of everyone */
    q0.overflow_tokens = 50;
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &chat) - 250.0 / 1000) < 1e-12);
    /* tokens that left the worker's queue since its status come off their own group and
     * the sum: 150 of b's flood done, chat's share is as before (its 100 and as many of
     * b's), b's own wait shorter; no more than the group holds; a class the table lacks:
     * the overflow (an unbounded time since the status: all of them at once) */
    const cs_place_class chat_urgent = {-1, "chat"};
    cs_place_since since = {0};
    cs_place_queue_left(&q0, &w[0].queued_prefill_tokens, &since, &b, 150, INFINITY);
    ASSERT_EQ_INT((int)w[0].queued_prefill_tokens, 850);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &chat) - 250.0 / 1000) < 1e-12);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &b) - 1000.0 / 1000) < 1e-12);
    cs_place_queue_left(&q0, &w[0].queued_prefill_tokens, &since, &b, 5000, INFINITY);
    ASSERT_EQ_INT((int)w[0].queued_prefill_tokens, 0);
    ASSERT_TRUE(fabs(cs_place_ttft(&w[0], 100, &b) - 150.0 / 1000) < 1e-12); /* the overflow */
    cs_place_queue_left(&q0, &w[0].queued_prefill_tokens, &since, &chat_urgent, 30, INFINITY);
    ASSERT_TRUE(q0.overflow_tokens == 20);
    cs_place_since none_since = {0};
    int64_t sum = 10; /* no groups: the sum */
    cs_place_queue_left(NULL, &sum, &none_since, NULL, 25, INFINITY);
    ASSERT_EQ_INT((int)sum, 0);
}

/* Placing repeatedly with the router's own accounting spreads a burst over
 * equal workers instead of piling it on the one the last status favoured. */
static void test_burst_spreads(void) {
    cs_place_worker w[3] = {dec(100, 0, 0, 0), dec(100, 0, 0, 0), dec(100, 0, 0, 0)};
    int count[3] = {0, 0, 0};
    for (int i = 0; i < 30; i++) {
        int k = cs_place_decode(w, 3, 64, (size_t)i, -1);
        ASSERT_TRUE(k >= 0);
        count[k]++;
        w[k].pages_placed += cs_place_pages(64, &w[k].kv);
    }
    for (int k = 0; k < 3; k++)
        ASSERT_EQ_INT(count[k], 10);
    /* 300 - 30 * 4 = 180 pages left in all: 45 more contexts of 4 pages */
    int more = 0;
    for (int k; (k = cs_place_decode(w, 3, 64, 0, -1)) >= 0; more++)
        w[k].pages_placed += 4;
    ASSERT_EQ_INT(more, 45);
}

/* Prefix-aware: the worker holding most of the prompt wins while its load is
 * within balance of the least loaded; beyond, the usual rule; balance -1 or
 * no cached tokens anywhere: the usual rule. */
static void test_prefix_choice(void) {
    cs_place_worker w[3] = {dec(100, 0, 0, 0), dec(50, 0, 2, 0), dec(80, 0, 0, 0)};
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 4), 0); /* nothing cached: most room */
    w[1].cached_tokens = 992;
    w[2].cached_tokens = 512;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 4), 1);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, -1), 0); /* the policy off */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 1), 2);  /* 1 holds more, but 2 above the least */
    w[1].reqs_placed = 3;                               /* load 5, least 0: beyond 4 */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 4), 2);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 5), 1);
    w[1].skip = true; /* skipped or without room: never chosen for its cache */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 100), 2);
    w[1].skip = false, w[1].kv_pages_free = 3;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 64, 0, 100), 2);
    /* a hot prefix (all requests share it) fills its worker up to the balance, then
     * the next request goes to another, which then holds it too */
    cs_place_worker h[2] = {dec(1000, 0, 0, 0), dec(1000, 0, 0, 0)};
    h[0].cached_tokens = 992;
    int count[2] = {0, 0};
    for (int i = 0; i < 20; i++) {
        int k = cs_place_decode(h, 2, 1000, (size_t)i, 2);
        ASSERT_TRUE(k >= 0);
        count[k]++;
        h[k].reqs_placed++;
        h[k].cached_tokens = 992;
    }
    ASSERT_TRUE(count[0] >= 8 && count[1] >= 8);
    /* prefill: the queue in tokens is the load */
    cs_place_worker p[2] = {pre(100, 0), pre(0, 0)};
    p[0].cached_tokens = 992;
    ASSERT_EQ_INT(cs_place_prefill(p, 2, 1000, 0, 8192, NULL), 0);
    ASSERT_EQ_INT(cs_place_prefill(p, 2, 1000, 0, 50, NULL), 1);
    ASSERT_EQ_INT(cs_place_prefill(p, 2, 1000, 0, -1, NULL), 1);
}

/* The chain is the workers' (the scheduler's page hashes, rooted at the
 * salt); the set matches leading pages, evicts the oldest, expires, clears. */
static void test_prefix_set(void) {
    int32_t ids[100];
    for (int i = 0; i < 100; i++)
        ids[i] = 7 * i + 3;
    uint64_t c[8], d[8], e[8];
    ASSERT_EQ_INT(cs_prefix_pages(1, 16), 0);
    ASSERT_EQ_INT(cs_prefix_pages(16, 16), 0); /* the last token is always computed */
    ASSERT_EQ_INT(cs_prefix_pages(17, 16), 1);
    ASSERT_EQ_INT(cs_prefix_chain(ids, 100, 16, NULL, c, 8), 6);
    uint64_t h = cs_kv_cache_page_hash(0, ids, 16);
    ASSERT_TRUE(c[0] == h && c[1] == cs_kv_cache_page_hash(h, ids + 16, 16));
    ASSERT_EQ_INT(cs_prefix_chain(ids, 100, 16, "", d, 8), 6);
    ASSERT_TRUE(memcmp(c, d, sizeof(uint64_t) * 6) == 0); /* "" is the shared namespace */
    ASSERT_EQ_INT(cs_prefix_chain(ids, 100, 16, "tenant-a", d, 8), 6);
    ASSERT_TRUE(d[0] == cs_kv_cache_page_hash(cs_kv_cache_hash_root("tenant-a"), ids, 16));
    ASSERT_TRUE(d[0] != c[0]);
    ASSERT_EQ_INT(cs_prefix_chain(ids, 100, 16, NULL, e, 3), 3);

    cs_prefix_set *s = cs_prefix_set_new(8);
    ASSERT_TRUE(s != NULL);
    ASSERT_EQ_INT(cs_prefix_set_match(s, c, 6, 0, 10), 0);
    cs_prefix_set_add(s, c, 4, 1.0);
    ASSERT_EQ_INT(cs_prefix_set_match(s, c, 6, 1.5, 10), 4);
    ASSERT_EQ_INT(cs_prefix_set_match(s, d, 6, 1.5, 10), 0);  /* another tenant */
    ASSERT_EQ_INT(cs_prefix_set_match(s, c, 6, 11.5, 10), 0); /* expired */
    cs_prefix_set_add(s, c, 6, 2.0);                          /* 4 refreshed, 2 new */
    ASSERT_EQ_INT(cs_prefix_set_size(s), 6);
    ASSERT_EQ_INT(cs_prefix_set_match(s, c, 6, 2.5, 10), 6);
    cs_prefix_set_add(s, d, 4, 3.0); /* 10 > 8: c[0], c[1] (the oldest) go */
    ASSERT_EQ_INT(cs_prefix_set_size(s), 8);
    ASSERT_EQ_INT(cs_prefix_set_match(s, c, 6, 3.5, 10), 0);
    ASSERT_EQ_INT(cs_prefix_set_match(s, c + 2, 4, 3.5, 10), 4);
    ASSERT_EQ_INT(cs_prefix_set_match(s, d, 6, 3.5, 10), 4);
    /* many adds through a small set: what remains is what was added last */
    uint64_t many[200];
    for (int i = 0; i < 200; i++)
        many[i] = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
    for (int r = 0; r < 5; r++)
        cs_prefix_set_add(s, many + 40 * r, 40, 4.0 + r);
    ASSERT_EQ_INT(cs_prefix_set_size(s), 8);
    ASSERT_EQ_INT(cs_prefix_set_match(s, many + 192, 8, 9.0, 10), 8);
    ASSERT_EQ_INT(cs_prefix_set_match(s, many + 191, 1, 9.0, 10), 0);
    cs_prefix_set_clear(s); /* a restarted worker */
    ASSERT_EQ_INT(cs_prefix_set_size(s), 0);
    ASSERT_EQ_INT(cs_prefix_set_match(s, many + 192, 8, 9.0, 10), 0);
    cs_prefix_set_free(s);
}

/* A published summary corrects the router's own record: its pages count,
 * own entries only within the grace, a malformed one is refused. */
static void test_prefix_summary(void) {
    uint64_t c[6];
    int32_t ids[96];
    for (int i = 0; i < 96; i++)
        ids[i] = 3 + i;
    ASSERT_EQ_INT(cs_prefix_chain(ids, 97, 16, NULL, c, 6), 6);
    cs_kv_cache *kv;
    ASSERT_EQ_INT(cs_kv_cache_init(64, 16, &kv), 0);
    int32_t pg[4];
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 4, pg), 0);
    for (int i = 0; i < 4; i++) /* the worker holds the first 4 pages */
        ASSERT_EQ_INT(cs_kv_cache_register(kv, pg[i], c[i]), 0);
    size_t nb = cs_kv_summary_bits(64);
    uint8_t *bits = calloc(nb / 8, 1);
    cs_kv_cache_summary(kv, bits, nb);
    cs_prefix_summary sum = {0};
    ASSERT_EQ_INT(cs_prefix_summary_set(&sum, bits, nb / 8, nb - 1, 7, 0), CS_EINVAL);
    ASSERT_EQ_INT(cs_prefix_summary_set(&sum, bits, nb / 8 - 1, nb, 7, 0), CS_EINVAL);
    ASSERT_EQ_INT(cs_prefix_summary_set(&sum, bits, nb / 8, nb, 0, 0), CS_EINVAL);
    ASSERT_TRUE(sum.bits == NULL);
    ASSERT_EQ_INT(cs_prefix_summary_set(&sum, bits, nb / 8, nb, 7, 100.5), 0);
    ASSERT_EQ_INT(cs_prefix_match(NULL, &sum, c, 6, 100, 600), 4); /* the summary alone */
    cs_prefix_set *s = cs_prefix_set_new(16);
    cs_prefix_set_add(s, c, 6, 100.0); /* placed all 6 at t = 100 */
    /* complete until 100.5: pages placed at 100 may not have registered yet */
    ASSERT_EQ_INT(cs_prefix_match(s, &sum, c, 6, 105, 600), 6);
    sum.complete = 100 + CS_PREFIX_OWN_GRACE_S + 0.5; /* a later status: still the same cache */
    ASSERT_EQ_INT(cs_prefix_match(s, &sum, c, 6, 105, 600), 4);
    ASSERT_EQ_INT(cs_prefix_match(s, NULL, c, 6, 200, 600), 6); /* no summary: the record */
    /* the worker evicted page 0: nothing is predicted past the grace */
    cs_kv_cache_free_pages(kv, pg, 4);
    cs_kv_cache_clear_prefixes(kv);
    cs_kv_cache_summary(kv, bits, nb);
    ASSERT_EQ_INT(cs_prefix_summary_set(&sum, bits, nb / 8, nb, 8, 200), 0);
    ASSERT_EQ_INT(cs_prefix_match(s, &sum, c, 6, 200, 600), 0);
    cs_prefix_summary_clear(&sum);
    ASSERT_TRUE(sum.bits == NULL && sum.version == 0);
    cs_prefix_set_free(s);
    free(bits);
    cs_kv_cache_free(kv);
}

/* The leading autoscaling signal (demand.h): a decayed rate reads a steady
 * rate from the first seconds on (not a lull, not one request as a flood),
 * follows a step within its window, and the replicas follow from the rates
 * and the capacities. */
static void test_demand(void) {
    const double tau = 10;
    cs_rate r = {0};
    ASSERT_TRUE(cs_rate_get(&r, 100, tau) == 0);
    cs_rate_add(&r, 500, 100, tau); /* one request of 500 tokens, read as 5 s old: 127/s */
    ASSERT_TRUE(fabs(cs_rate_get(&r, 100, tau) - 500 / (tau * (1 - exp(-0.5)))) < 1e-9);
    /* 1,000 tokens/s, in 100-token requests every 0.1 s */
    double t = 100;
    for (int i = 0; i < 50; i++)
        cs_rate_add(&r, 100, t += 0.1, tau);
    double at3 = cs_rate_get(&r, t, tau);
    ASSERT_TRUE(at3 > 900 && at3 < 1200); /* after 5 s: about the rate already */
    for (int i = 0; i < 600; i++)
        cs_rate_add(&r, 100, t += 0.1, tau);
    ASSERT_TRUE(fabs(cs_rate_get(&r, t, tau) - 1000) < 20); /* steady: the rate */
    for (int i = 0; i < 100; i++) /* four times as much for 10 s: most of the way */
        cs_rate_add(&r, 400, t += 0.1, tau);
    double step = cs_rate_get(&r, t, tau);
    ASSERT_TRUE(step > 2800 && step < 4000);
    ASSERT_TRUE(cs_rate_get(&r, t + 60, tau) < 0.01 * step); /* then silence: it decays */

    /* capacities, smoothed: one poll's dip to 40% moves the mean by a few percent
     * (0.25 s of 10 s), a lasting change gets through, an unknown one restarts it */
    cs_smooth c = {0};
    ASSERT_TRUE(cs_smooth_add(&c, 4000, 100, tau) == 4000);
    double dip = cs_smooth_add(&c, 1600, 100.25, tau);
    dip = cs_smooth_add(&c, 4000, 100.5, tau); /* the dip held 0.25 s */
    ASSERT_TRUE(dip > 3900 && dip < 4000);
    for (double u = 100.5; u < 130; u += 0.25)
        dip = cs_smooth_add(&c, 2000, u, tau);
    ASSERT_TRUE(fabs(dip - 2000) < 200);
    ASSERT_TRUE(cs_smooth_add(&c, 0, 131, tau) == 0 && cs_smooth_add(&c, 3000, 132, tau) == 3000);

    cs_demand d = {.prompt_rate = 6000, .output_rate = 900, .local_rate = 200,
                   .prefill_cap = 2000, .decode_cap = 600, .decode_prefill_cap = 1000,
                   .utilization = 0.75};
    ASSERT_TRUE(fabs(cs_demand_prefill_replicas(&d) - 4.0) < 1e-9);         /* 3 / 0.75 */
    ASSERT_TRUE(fabs(cs_demand_decode_replicas(&d) - (1.5 + 0.2) / 0.75) < 1e-9);
    d.prompt_backlog = 10000, d.drain_s = 2.5; /* 4,000 tokens/s more: two replicas */
    ASSERT_TRUE(fabs(cs_demand_prefill_replicas(&d) - 6.0) < 1e-9);
    d.prefill_cap = 0; /* no worker has measured yet: nothing is asked */
    ASSERT_TRUE(cs_demand_prefill_replicas(&d) == 0);
    printf("demand: a steady 1,000 tokens/s read %.0f after 5 s; four times it %.0f after 10 s\n",
           at3, step);
}

/* A computed prompt leaves a worker's reported queue at most as fast as the
 * worker computes since its status: the rest is owed and comes off as time
 * passes, at each reading, by its own group, never more than the group holds,
 * and in the order the worker computes them. */
static void test_queue_owed(void) {
    cs_ttft_load L = {0};
    cs_ttft_load_add(&L, 0, "b", 1, 3000);
    cs_ttft_load_add(&L, 0, "chat", 1, 40);
    int64_t queued = 3040;
    cs_place_since s = {0};
    const cs_place_class b = {0, "b"}, chat = {0, "chat"}, other = {2, "x"};
    /* 10 ms after the status at 1,000 tokens/s: 10 of b's 2,000 come off now */
    cs_place_queue_left(&L, &queued, &s, &b, 2000, 10);
    ASSERT_EQ_INT((int)queued, 3030);
    ASSERT_EQ_INT((int)L.groups[0].tokens, 2990);
    ASSERT_EQ_INT((int)s.done, 10);
    ASSERT_EQ_INT((int)s.owed[0], 1990);
    /* a reading at 500 ms: 490 more; none taken twice for an unchanged time */
    cs_place_queue_settle(&L, &queued, &s, 500);
    cs_place_queue_settle(&L, &queued, &s, 500);
    ASSERT_EQ_INT((int)L.groups[0].tokens, 2500);
    ASSERT_EQ_INT((int)s.done, 500);
    /* chat's prompt finishes at 600 ms: 100 of room, all of it b's, owed first (the
     * same priority: the table's order) */
    cs_place_queue_left(&L, &queued, &s, &chat, 40, 600);
    ASSERT_EQ_INT((int)L.groups[0].tokens, 2400);
    ASSERT_EQ_INT((int)L.groups[1].tokens, 40);
    /* by 3 s every owed token is off, and no more: the rate's bound is not a debt */
    cs_place_queue_settle(&L, &queued, &s, 3000);
    ASSERT_EQ_INT((int)L.groups[0].tokens, 1000);
    ASSERT_EQ_INT((int)L.groups[1].tokens, 0);
    ASSERT_EQ_INT((int)queued, 1000);
    ASSERT_EQ_INT((int)s.done, 2040);
    ASSERT_EQ_INT((int)s.owed[0], 0);
    ASSERT_EQ_INT((int)s.owed[1], 0);
    /* a class the table lacks owes the tokens past it; an unknown rate (NAN, 0) takes
     * nothing; none below 0 */
    L.overflow_tokens = 100, queued = 1100;
    cs_place_queue_left(&L, &queued, &s, &other, 80, NAN);
    cs_place_queue_settle(&L, &queued, &s, 0);
    ASSERT_EQ_INT((int)s.owed[CS_TTFT_GROUPS], 80);
    ASSERT_EQ_INT((int)L.overflow_tokens, 100);
    cs_place_queue_settle(&L, &queued, &s, 10000);
    ASSERT_EQ_INT((int)L.overflow_tokens, 20);
    ASSERT_EQ_INT((int)queued, 1020);

    /* A prompt that spanned the status owes only what its group held: 1,900 of its
     * 2,000 were done before the status, which counted 100. So another group's prompt
     * that finishes later comes off by the room left, not behind 1,900 phantom tokens;
     * and the tokens past the table and a better priority come off first */
    cs_ttft_load M = {0};
    cs_ttft_load_add(&M, 0, "a", 1, 100);
    cs_ttft_load_add(&M, 0, "b", 1, 40);
    cs_ttft_load_add(&M, -1, "c", 1, 30);
    M.overflow_tokens = 10;
    int64_t q = 180;
    cs_place_since t = {0};
    const cs_place_class a = {0, "a"}, c = {-1, "c"}, stray = {5, "nobody"};
    cs_place_queue_left(&M, &q, &t, &a, 2000, 100); /* at 0.1 s: all 100 off */
    ASSERT_EQ_INT((int)M.groups[0].tokens, 0);
    ASSERT_EQ_INT((int)t.owed[0], 0);
    cs_place_queue_left(&M, &q, &t, &b, 40, 150); /* at 0.15 s: b's 40 off */
    ASSERT_EQ_INT((int)M.groups[1].tokens, 0);
    ASSERT_EQ_INT((int)q, 40);
    cs_place_queue_left(&M, &q, &t, &stray, 10, 140); /* no room yet: owed */
    cs_place_queue_left(&M, &q, &t, &c, 30, 140);
    ASSERT_EQ_INT((int)t.owed[CS_TTFT_GROUPS], 10);
    ASSERT_EQ_INT((int)t.owed[2], 30);
    cs_place_queue_settle(&M, &q, &t, 165); /* 25 of room: the overflow's 10, then c's 15 */
    ASSERT_EQ_INT((int)M.overflow_tokens, 0);
    ASSERT_EQ_INT((int)M.groups[2].tokens, 15);
    ASSERT_EQ_INT((int)q, 15);

    /* a worker with no groups: its sum */
    cs_place_since s2 = {0};
    int64_t q2 = 100;
    cs_place_queue_left(NULL, &q2, &s2, &chat, 80, 50);
    ASSERT_EQ_INT((int)q2, 50);
    cs_place_queue_settle(NULL, &q2, &s2, 1000);
    ASSERT_EQ_INT((int)q2, 20);
}

/* The TTFT rest is the median of the window, read at the rate given: a
 * cold first token (20 ms over a 9 ms rest) moves it not at all, a lasting
 * shift gets through once it is half the window, the oldest samples leave,
 * and a new rate moves every sample's queue part at once; a busy worker's
 * samples are their own, the other kind standing in while there are none. */
static void test_ttft_rest(void) {
    const double rate = 4000; /* tokens/s: 16 tokens are 4 ms */
    cs_ttft_rest r = {0};
    ASSERT_TRUE(isnan(cs_ttft_rest_get(&r, false, rate)));
    cs_ttft_rest_add(&r, false, NAN, 16);
    cs_ttft_rest_add(&r, false, 0.01, -1);
    ASSERT_TRUE(r.idle.n == 0);
    cs_ttft_rest_add(&r, false, 0.024, 16);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.020) < 1e-12);
    ASSERT_TRUE(isnan(cs_ttft_rest_get(&r, false, 0)));
    cs_ttft_rest_add(&r, false, 0.013, 16);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.0145) < 1e-12); /* two: their mean */
    cs_ttft_rest_add(&r, false, 0.012, 16);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.009) < 1e-12);
    for (int i = 0; i < 13; i++)
        cs_ttft_rest_add(&r, false, 0.013, 16);
    ASSERT_TRUE(r.idle.n == CS_TTFT_REST_WINDOW);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.009) < 1e-12);
    /* the worker reports 16,000 tokens/s now: 16 tokens are 1 ms, the rest 12 ms, and the
     * prediction (1 + 12 ms) what was measured (13 ms) */
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, 16000) - 0.012) < 1e-12);
    for (int i = 0; i < 7; i++) /* a shift to 34 ms: not yet half the window */
        cs_ttft_rest_add(&r, false, 0.034, 16);
    ASSERT_TRUE(cs_ttft_rest_get(&r, false, rate) < 0.010);
    for (int i = 0; i < 2; i++)
        cs_ttft_rest_add(&r, false, 0.034, 16);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.030) < 1e-12);
    for (int i = 0; i < CS_TTFT_REST_WINDOW; i++) /* the window holds only the newest */
        cs_ttft_rest_add(&r, false, 0.0001 * i, 0);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.00075) < 1e-12);
    /* busy: the idle samples until busy ones come, then those alone */
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, true, rate) - 0.00075) < 1e-12);
    cs_ttft_rest_add(&r, true, 0.028, 44);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, true, rate) - (0.028 - 0.011)) < 1e-12);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&r, false, rate) - 0.00075) < 1e-12);
    cs_ttft_rest empty = {0};
    cs_ttft_rest_add(&empty, true, 0.028, 44);
    ASSERT_TRUE(fabs(cs_ttft_rest_get(&empty, false, rate) - (0.028 - 0.011)) < 1e-12);
}

int main(void) {
    test_queue_owed();
    test_ttft_rest();
    test_demand();
    test_prefix_summary();
    test_pages();
    test_decode();
    test_prefill();
    test_burst_spreads();
    test_prefix_choice();
    test_prefix_set();
    printf("placement policy ok\n");
    return 0;
}
