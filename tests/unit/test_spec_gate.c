/* test_spec_gate.c: speculation's measured gate (engine/src/spec_gate.h),
 * driven as the scheduler drives it, on a simulated machine whose step time
 * is a step function of its tokens (as AMX tiles make it: 16 tokens cost
 * 100 ms, 17 to 32 cost 135 ms) with 10% noise, and drafts kept with a set
 * probability. Checks: where drafts lose (16 decodes, a chat's acceptance)
 * the gate refuses all but its retries and serves within 3% of never
 * drafting; where they win (8 decodes, a code edit's acceptance) it
 * allows all but its retries and serves within 3% of always drafting; when
 * the workload turns, the gate follows within two retries; retries come
 * as rarely as keeps their cost to 1%; a step with
 * prompt chunks gets the better side, never a retry; batch sizes are
 * measured apart, and below 8 decodes not gated; nonsense measurements
 * change nothing. */
#include <math.h>
#include <string.h>

#include "spec_gate.h"
#include "test.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform(void) { /* [0, 1) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng >> 11) / 9007199254740992.0;
}

typedef struct {
    int32_t n_decode, drafts; /* drafts each decode carries when allowed */
    double accept;            /* each draft kept with this probability, after the ones before */
} load;

/* One step on the simulated machine: its seconds, *emitted decode tokens. */
static double step(const load *l, bool drafting, int32_t *emitted) {
    int32_t tokens = l->n_decode * (drafting ? 1 + l->drafts : 1);
    double t = 0.100 + 0.035 * ((tokens - 1) / 16) + 0.0005 * tokens;
    *emitted = l->n_decode;
    if (drafting)
        for (int32_t i = 0; i < l->n_decode; i++)
            for (int32_t j = 0; j < l->drafts && uniform() < l->accept; j++)
                ++*emitted;
    return t * (0.95 + 0.1 * uniform());
}

typedef struct {
    int32_t steps, drafting;
    double tokens, seconds;
} tally;

/* n decode-only steps of l under the gate (or always / never drafting). */
static tally run(cs__spec_gate *g, const load *l, int32_t n, int mode /* 0 gate, 1 never, 2 always */) {
    tally t = {0};
    for (int32_t i = 0; i < n; i++) {
        bool d = mode == 2 || (mode == 0 && cs__spec_gate_allows(g, l->n_decode, true));
        int32_t emitted;
        double s = step(l, d, &emitted);
        if (mode == 0) cs__spec_gate_observe(g, l->n_decode, d, emitted, s);
        t.steps++, t.drafting += d, t.tokens += emitted, t.seconds += s;
    }
    return t;
}

static void test_losing_drafts_are_refused(void) {
    cs__spec_gate g;
    memset(&g, 0, sizeof g);
    /* 16 -> 32 tokens (151 ms for 108) for 2.4 kept: 17% fewer tokens a second */
    const load chat = {16, 1, 0.15};
    tally t = run(&g, &chat, 2000, 0), never = run(&g, &chat, 2000, 1);
    /* the first measurements, then retries: at least 16 steps apart, at
     * most 256, and together costing about 1% */
    ASSERT_TRUE(t.drafting <= CS__SPEC_GATE_SEEN + 2000 / CS__SPEC_GATE_RETRY_MIN + 1);
    ASSERT_TRUE(t.drafting >= 2000 / (CS__SPEC_GATE_RETRY_MAX + 1)); /* it keeps looking */
    ASSERT_TRUE(t.tokens / t.seconds >= 0.97 * (never.tokens / never.seconds));
}

static void test_winning_drafts_are_allowed(void) {
    cs__spec_gate g;
    memset(&g, 0, sizeof g);
    const load code = {8, 4, 0.8}; /* 8 -> 40 tokens (+46%) for 22 kept: a wide gap */
    tally t = run(&g, &code, 2000, 0), always = run(&g, &code, 2000, 2);
    ASSERT_TRUE(t.steps - t.drafting <= CS__SPEC_GATE_SEEN + 2000 / CS__SPEC_GATE_RETRY_MIN + 1);
    ASSERT_TRUE(t.steps - t.drafting >= 2000 / (CS__SPEC_GATE_RETRY_MAX + 1)); /* it keeps looking */
    ASSERT_TRUE(t.tokens / t.seconds >= 0.97 * (always.tokens / always.seconds));
}

static void test_retries_are_as_rare_as_their_cost(void) {
    /* drafting steps take 2.36 plain ones and serve 18% less a second: a
     * retry costs 0.42 of a plain step, so one in 41 costs 1% (the count
     * below starts one step after the last drafting one) */
    cs__spec_gate g;
    memset(&g, 0, sizeof g);
    for (int i = 0; i < 10; i++) {
        cs__spec_gate_observe(&g, 16, true, 31, 0.099);
        cs__spec_gate_observe(&g, 16, false, 16, 0.042);
    }
    int32_t i = 0;
    while (!cs__spec_gate_allows(&g, 16, true)) {
        cs__spec_gate_observe(&g, 16, false, 16, 0.042);
        i++;
    }
    ASSERT_TRUE(i >= 38 && i <= 42);
}

static void test_it_follows_a_change_of_workload(void) {
    cs__spec_gate g;
    memset(&g, 0, sizeof g);
    load l = {8, 4, 0.0}; /* nothing kept: 40 tokens for 8 */
    run(&g, &l, 500, 0);
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 8, false));
    l.accept = 0.8; /* the answer turns predictable: seen at the next retry or the one after */
    int32_t i = 0;
    while (i < 2 * CS__SPEC_GATE_RETRY_MAX + 2 && !cs__spec_gate_allows(&g, 8, false)) {
        run(&g, &l, 1, 0);
        i++;
    }
    ASSERT_TRUE(cs__spec_gate_allows(&g, 8, false));
    l.accept = 0.0; /* and back */
    for (i = 0; i < 2 * CS__SPEC_GATE_RETRY_MAX + 2 && cs__spec_gate_allows(&g, 8, false); i++)
        run(&g, &l, 1, 0);
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 8, false));
}

static void test_mixed_steps_get_the_better_side(void) {
    cs__spec_gate g;
    memset(&g, 0, sizeof g);
    /* before any measurement a mixed step may draft (the rule alone decides) */
    ASSERT_TRUE(cs__spec_gate_allows(&g, 8, false));
    for (int i = 0; i < CS__SPEC_GATE_SEEN; i++)
        cs__spec_gate_observe(&g, 8, true, 8, 0.1); /* 80 tok/s drafting */
    /* now a plain one is wanted: a decode-only step gets it, a mixed one
     * is not spent on it */
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 8, true));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 8, false));
    for (int i = 0; i < CS__SPEC_GATE_SEEN; i++)
        cs__spec_gate_observe(&g, 8, false, 8, 0.05); /* 160 tok/s plain */
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 8, true));
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 8, false));
    for (int i = 0; i < CS__SPEC_GATE_RETRY_MAX; i++)
        cs__spec_gate_observe(&g, 8, false, 8, 0.05);
    ASSERT_TRUE(cs__spec_gate_allows(&g, 8, true));   /* the retry */
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 8, false)); /* not in a mixed step */
}

static void test_sizes_are_apart(void) {
    cs__spec_gate g;
    memset(&g, 0, sizeof g);
    for (int i = 0; i < 10; i++) {
        cs__spec_gate_observe(&g, 16, true, 16, 0.2);
        cs__spec_gate_observe(&g, 16, false, 16, 0.1);
        cs__spec_gate_observe(&g, 9, true, 18, 0.1);
        cs__spec_gate_observe(&g, 9, false, 9, 0.1);
        cs__spec_gate_observe(&g, 4, true, 4, 0.2); /* below the gated sizes: not kept */
        cs__spec_gate_observe(&g, 4, false, 4, 0.1);
    }
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 16, false));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 9, false));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 4, true));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 1, true));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 17, false)); /* 17 is not 16: nothing measured */
    /* past 24, ranges: 40 and 48 share one, 49 is the next */
    for (int i = 0; i < 10; i++) {
        cs__spec_gate_observe(&g, 40, true, 40, 0.2);
        cs__spec_gate_observe(&g, 40, false, 40, 0.1);
    }
    ASSERT_TRUE(!cs__spec_gate_allows(&g, 48, false));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 49, false));
    ASSERT_TRUE(cs__spec_gate_allows(&g, 100000, false)); /* the last range */
    /* each range's ends share a slot, and the sizes on either side of an
     * end do not */
    static const int32_t ends[][2] = {{24, 25}, {32, 33}, {48, 49}, {64, 65},
                                      {96, 97}, {128, 129}, {192, 193}, {256, 257}};
    static const int32_t first[] = {25, 33, 49, 65, 97, 129, 193, 257};
    for (size_t k = 0; k < sizeof ends / sizeof ends[0]; k++) {
        cs__spec_gate h;
        memset(&h, 0, sizeof h);
        for (int i = 0; i < 10; i++) { /* plain serves more at the range's upper end */
            cs__spec_gate_observe(&h, ends[k][0], true, 10, 0.2);
            cs__spec_gate_observe(&h, ends[k][0], false, 10, 0.1);
        }
        ASSERT_TRUE(!cs__spec_gate_allows(&h, ends[k][0], false));
        ASSERT_TRUE(cs__spec_gate_allows(&h, ends[k][1], false));
        if (k > 0) ASSERT_TRUE(!cs__spec_gate_allows(&h, first[k - 1], false));
    }
}

static void test_nonsense_is_ignored(void) {
    cs__spec_gate g, zero;
    memset(&g, 0, sizeof g);
    memset(&zero, 0, sizeof zero);
    cs__spec_gate_observe(&g, 8, true, 8, 0.0);
    cs__spec_gate_observe(&g, 8, true, 8, -1.0);
    cs__spec_gate_observe(&g, 8, true, 8, NAN);
    cs__spec_gate_observe(&g, 0, true, 4, 0.1);
    cs__spec_gate_observe(&g, 7, true, 7, 0.1); /* below the gated sizes */
    cs__spec_gate_observe(&g, 8, true, 0, 0.1);
    ASSERT_TRUE(memcmp(&g, &zero, sizeof g) == 0);
}

int main(void) {
    test_losing_drafts_are_refused();
    test_winning_drafts_are_allowed();
    test_retries_are_as_rare_as_their_cost();
    test_it_follows_a_change_of_workload();
    test_mixed_steps_get_the_better_side();
    test_sizes_are_apart();
    test_nonsense_is_ignored();
    return 0;
}
