/* test_router_place: the router's placement policy (router/pool.h) over
 * worker snapshots: decode placement by room (free pages minus pages placed
 * since the status), ties by load then rotation, the prompt's pages as a
 * floor; prefill placement by queued tokens plus tokens placed; unusable and
 * skipped (excluded/refused) workers never chosen. */
#include "pool.h"
#include "test.h"

static cs_place_worker dec(int32_t free_pages, int32_t placed, int32_t running, int32_t waiting) {
    return (cs_place_worker){.usable = true,
                             .page_size = 16,
                             .kv_pages_free = free_pages,
                             .pages_placed = placed,
                             .num_running = running,
                             .num_waiting = waiting};
}

static cs_place_worker pre(int64_t queued, int64_t placed) {
    return (cs_place_worker){.usable = true,
                             .page_size = 16,
                             .kv_pages_total = 1000,
                             .queued_prefill_tokens = queued,
                             .tokens_placed = placed};
}

static void test_pages(void) {
    ASSERT_EQ_INT(cs_place_pages(1, 16), 1);
    ASSERT_EQ_INT(cs_place_pages(16, 16), 1);
    ASSERT_EQ_INT(cs_place_pages(17, 16), 2);
    ASSERT_EQ_INT(cs_place_pages(0, 16), 1);
    ASSERT_EQ_INT(cs_place_pages(100, 0), 7); /* unknown page size: 16 */
    ASSERT_EQ_INT(cs_place_pages((int64_t)1 << 40, 1), INT32_MAX);
}

static void test_decode(void) {
    cs_place_worker w[4];
    /* most room wins */
    w[0] = dec(10, 0, 0, 0), w[1] = dec(50, 0, 5, 5), w[2] = dec(30, 0, 0, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 20, 0), 1);
    /* room is free minus what this router placed since the status */
    w[1].pages_placed = 25;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 20, 0), 2);
    /* the prompt's pages are a floor: 300 tokens = 19 pages */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 300, 0), 2);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 30 * 16 + 1, 0), -1);
    /* exactly enough room is enough */
    ASSERT_EQ_INT(cs_place_decode(w, 3, 30 * 16, 0), 2);
    /* ties on room: fewest running + waiting */
    w[0] = dec(40, 0, 3, 1), w[1] = dec(40, 0, 1, 1), w[2] = dec(40, 0, 2, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0), 1);
    /* full ties: the first at or after start, so equal workers share */
    w[0] = dec(40, 0, 1, 0), w[1] = dec(40, 0, 1, 0), w[2] = dec(40, 0, 1, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0), 0);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 1), 1);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 2), 2);
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 4), 1);
    /* unusable and skipped are never chosen, whatever their room */
    w[0] = dec(1000, 0, 0, 0), w[1] = dec(999, 0, 0, 0), w[2] = dec(5, 0, 9, 9);
    w[0].usable = false;
    w[1].skip = true;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0), 2);
    w[2].skip = true;
    ASSERT_EQ_INT(cs_place_decode(w, 3, 1, 0), -1);
    ASSERT_EQ_INT(cs_place_decode(w, 0, 1, 0), -1);
    /* over-placed (negative room) is no room */
    w[0] = dec(2, 5, 0, 0);
    ASSERT_EQ_INT(cs_place_decode(w, 1, 1, 0), -1);
    /* page size per worker */
    w[0] = dec(4, 0, 0, 0), w[1] = dec(4, 0, 0, 0);
    w[1].page_size = 64;
    ASSERT_EQ_INT(cs_place_decode(w, 2, 200, 0), 1);
}

static void test_prefill(void) {
    cs_place_worker w[3];
    w[0] = pre(1000, 0), w[1] = pre(200, 0), w[2] = pre(500, 0);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0), 1);
    w[1].tokens_placed = 400; /* 600 now */
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0), 2);
    w[2].usable = false;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0), 1);
    w[1].skip = true;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0), 0);
    w[0].skip = true;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 0), -1);
    w[0] = pre(7, 0), w[1] = pre(7, 0), w[2] = pre(7, 0);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 2), 2);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 100, 3), 0);
    /* a pool that can never hold the prompt is skipped, however idle */
    w[0] = pre(0, 0), w[1] = pre(5000, 0), w[2] = pre(9000, 0);
    w[0].kv_pages_total = 10; /* 160 tokens */
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 160, 0), 0);
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 161, 0), 1);
    w[1].kv_pages_total = w[2].kv_pages_total = 10;
    ASSERT_EQ_INT(cs_place_prefill(w, 3, 161, 0), -1);
}

/* Placing repeatedly with the router's own accounting spreads a burst over
 * equal workers instead of piling it on the one the last status favoured. */
static void test_burst_spreads(void) {
    cs_place_worker w[3] = {dec(100, 0, 0, 0), dec(100, 0, 0, 0), dec(100, 0, 0, 0)};
    int count[3] = {0, 0, 0};
    for (int i = 0; i < 30; i++) {
        int k = cs_place_decode(w, 3, 64, (size_t)i);
        ASSERT_TRUE(k >= 0);
        count[k]++;
        w[k].pages_placed += cs_place_pages(64, 16);
    }
    for (int k = 0; k < 3; k++)
        ASSERT_EQ_INT(count[k], 10);
    /* 300 - 30 * 4 = 180 pages left in all: 45 more contexts of 4 pages */
    int more = 0;
    for (int k; (k = cs_place_decode(w, 3, 64, 0)) >= 0; more++)
        w[k].pages_placed += 4;
    ASSERT_EQ_INT(more, 45);
}

int main(void) {
    test_pages();
    test_decode();
    test_prefill();
    test_burst_spreads();
    printf("placement policy ok\n");
    return 0;
}
