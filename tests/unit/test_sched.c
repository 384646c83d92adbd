/* test_sched: the step scheduler on the tiny model.
 * - invariants at every step of randomized workloads: budget kept, every
 *   running decode served when the budget allows, nobody starves, pages
 *   conserved (free + used + cached = pool);
 * - the same tokens with and without chunking, with the prefix cache on and
 *   off, and under forced preemption (greedy and seeded sampling);
 * - a shared 300-token prefix is computed once;
 * - cancellation at random points leaks no page;
 * - the serving loop (submit / callbacks / cancel from other threads);
 * - prompt logprobs equal those of one pass over the prompt, bit for bit,
 *   whatever the chunking, the prefix cache and the company;
 * - speculation (prompt-lookup drafts) gives the tokens of decoding one
 *   token a step, greedy and seeded, whatever the budget, the draft length
 *   and preemption, and keeps some drafts;
 * - priority: the same tokens whatever the priorities (they change only the
 *   order), a high-priority request behind a queue of long low-priority
 *   prompts gets its first token at the next step (taking a seat by
 *   preemption when none is free), and out-of-range priorities are refused. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "chunkserve/serve.h"
#include "chunkserve/step_model.h"
#include "chunkserve/ttft.h"
#include "test.h"

static cs_model *model;
static int32_t V;
/* a pool small enough that the equivalence runs preempt: a model with
 * windowed layers holds fewer pages per sequence */
static int32_t small_pool = 60;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static cs_engine *engine(int n_pages) {
    cs_engine_params p = cs_engine_params_default();
    p.n_pages = n_pages;
    p.n_threads = 2;
    cs_engine *e = NULL;
    ASSERT_EQ_INT(cs_engine_init(model, &p, &e), 0);
    return e;
}

enum { MAX_REQ = 24, MAX_PROMPT = 420, MAX_GEN = 40 };
typedef struct {
    int32_t prompt[MAX_PROMPT];
    int32_t n_prompt, max_tokens;
    uint64_t seed;
    bool sampled, no_spec;
    int32_t priority;
    const char *tenant;
} req_spec;

typedef struct {
    int32_t out[MAX_GEN];
    int32_t n_out;
    enum cs_finish finish;
    float lp[MAX_GEN][5]; /* run_accounted: each token's log-probability and its top 4 */
} req_out;

static cs_request make_req(const req_spec *s, uint64_t id) {
    cs_request r = {0};
    r.id = id;
    r.prompt = s->prompt;
    r.n_prompt = s->n_prompt;
    r.sampling = cs_sampling_params_default();
    if (s->sampled) r.sampling.temperature = 0.8f, r.sampling.top_k = 50, r.sampling.seed = s->seed;
    r.stop.max_tokens = s->max_tokens;
    r.stop.ignore_eos = true;
    r.disable_speculation = s->no_spec;
    r.priority = s->priority;
    r.tenant = s->tenant;
    return r;
}

static void check_pages(cs_engine *e) {
    cs_kv_cache *kv = cs_engine_kv(e);
    ASSERT_EQ_INT(cs_kv_cache_check(kv), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv) + cs_kv_cache_n_used(kv) + cs_kv_cache_n_cached(kv),
                  cs_kv_cache_n_pages(kv));
}

static cs_sched_stats last_stats; /* the last run's scheduler's, before it is freed */
static int64_t unready_drafts;    /* drafts verified before a step model was ready (run) */

/* Runs all requests through a scheduler (arriving in rounds), checking the
 * invariants at every step; returns the total steps. */
static int run(cs_engine *e, const cs_sched_params *sp, const req_spec *specs, int n, req_out *outs,
               bool arrive_late) {
    cs_sched *s = NULL;
    ASSERT_EQ_INT(cs_sched_init(e, sp, &s), 0);
    memset(outs, 0, sizeof(req_out) * (size_t)n);
    int added = 0, finished = 0, steps = 0;
    int last_progress = 0;
    while (finished < n) {
        /* requests arrive over time */
        while (added < n && (!arrive_late || rnd(3) == 0 || cs_sched_idle(s))) {
            cs_request r = make_req(&specs[added], (uint64_t)added);
            ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
            added++;
        }
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_step_info info;
        cs_sched_last_step(s, &info);
        steps++;
        ASSERT_TRUE(info.n_tokens <= info.budget);
        if (sp->num_speculative_tokens > 0 && !sp->speculative_always &&
            isnan(info.predicted_seconds)) { /* no fitted model yet: drafts bounded */
            int32_t probe = sp->num_speculative_tokens > info.n_decode ? sp->num_speculative_tokens
                                                                       : info.n_decode;
            ASSERT_TRUE(info.n_draft_tokens <= probe);
            unready_drafts += info.n_draft_tokens;
        }
        int32_t can = info.n_running_decodes < info.budget ? info.n_running_decodes : info.budget;
        ASSERT_EQ_INT(info.n_decode, can);
        check_pages(e);
        for (int32_t i = 0; i < ne; i++) {
            req_out *o = &outs[ev[i].id];
            ASSERT_TRUE(ev[i].token >= 0 && o->n_out < MAX_GEN);
            o->out[o->n_out++] = ev[i].token;
            if (ev[i].finish) {
                o->finish = ev[i].finish;
                finished++;
            }
            last_progress = steps;
        }
        ASSERT_TRUE(steps - last_progress < 2000); /* no starvation, no livelock */
    }
    ASSERT_TRUE(cs_sched_idle(s));
    cs_sched_get_stats(s, &last_stats);
    cs_sched_free(s);
    ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(e)), 0);
    return steps;
}

static void make_specs(req_spec *specs, int n, bool sampled) {
    for (int i = 0; i < n; i++) {
        specs[i].n_prompt = 1 + (int32_t)rnd(MAX_PROMPT - 1);
        for (int j = 0; j < specs[i].n_prompt; j++)
            specs[i].prompt[j] = (int32_t)rnd((uint32_t)V);
        if (i % 3 == 1 && i > 0) { /* share a prefix with the previous request */
            int32_t k = specs[i - 1].n_prompt < specs[i].n_prompt ? specs[i - 1].n_prompt
                                                                  : specs[i].n_prompt;
            memcpy(specs[i].prompt, specs[i - 1].prompt, sizeof(int32_t) * (size_t)(k * 3 / 4));
        }
        specs[i].max_tokens = 1 + (int32_t)rnd(MAX_GEN);
        specs[i].seed = 77 + (uint64_t)i;
        specs[i].sampled = sampled;
        specs[i].no_spec = false;
        specs[i].priority = 0;
        specs[i].tenant = (const char *[]){"", "x", "y"}[i % 3]; /* no draw: the stream stays */
    }
}

static void check_same(const req_out *a, const req_out *b, int n, const char *what) {
    for (int i = 0; i < n; i++) {
        ASSERT_EQ_INT(a[i].n_out, b[i].n_out);
        for (int j = 0; j < a[i].n_out; j++) {
            if (a[i].out[j] != b[i].out[j])
                fprintf(stderr, "%s: request %d token %d differs\n", what, i, j);
            ASSERT_EQ_INT(a[i].out[j], b[i].out[j]);
        }
    }
}

static void check_equivalence(void) {
    static req_spec specs[MAX_REQ];
    static req_out base[MAX_REQ], other[MAX_REQ];
    for (int sampled = 0; sampled < 2; sampled++) {
        make_specs(specs, MAX_REQ, sampled);
        cs_engine *big = engine(4096), *small = engine(small_pool); /* preemption guaranteed */
        cs_sched_params one_pass = cs_sched_params_default();
        one_pass.enable_prefix_caching = false;
        run(big, &one_pass, specs, MAX_REQ, base, false);
        uint64_t preempt = 0;
        const int32_t budgets[] = {0, 512, 64, 17, 3};
        for (int pc = 0; pc < 2; pc++)
            for (size_t bi = 0; bi < sizeof budgets / sizeof budgets[0]; bi++)
                for (int tight = 0; tight < 2; tight++) {
                    cs_sched_params p = cs_sched_params_default();
                    p.max_num_batched_tokens = budgets[bi];
                    p.enable_prefix_caching = pc;
                    p.max_num_seqs = tight ? 8 : 256;
                    /* the requests' three tenants, equal or weighted: another order */
                    static const cs_tenant_share shares[] = {{"x", 3}, {"y", 0.5}};
                    p.tenant_shares = shares;
                    p.n_tenant_shares = pc ? 2 : 0;
                    cs_engine *e = tight ? small : big;
                    cs_sched *probe = NULL;
                    (void)probe;
                    int steps = run(e, &p, specs, MAX_REQ, other, true);
                    char what[96];
                    snprintf(what, sizeof what, "%s budget %d prefix %d %s",
                             sampled ? "sampled" : "greedy", budgets[bi], pc,
                             tight ? "small pool" : "big pool");
                    check_same(base, other, MAX_REQ, what);
                    (void)steps;
                }
        /* a run that must preempt: count it */
        cs_sched *s = NULL;
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 64;
        ASSERT_EQ_INT(cs_sched_init(small, &p, &s), 0);
        for (int i = 0; i < MAX_REQ; i++) {
            cs_request r = make_req(&specs[i], (uint64_t)i);
            ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        }
        while (!cs_sched_idle(s)) {
            const cs_event *ev;
            int32_t ne;
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        }
        cs_sched_stats st;
        cs_sched_get_stats(s, &st);
        preempt = st.preemptions;
        cs_sched_free(s);
        printf("%s: one pass = budgets {unlimited, 512, 64, 17, 3} x prefix cache on/off x "
               "big/small pool "
               "(small pool preempted %llu times)\n",
               sampled ? "seeded sampling" : "greedy", (unsigned long long)preempt);
        ASSERT_TRUE(preempt > 0);
        cs_engine_free(big);
        cs_engine_free(small);
    }
}

/* Speculation: the same tokens as one token a step, for greedy and seeded
 * sampling, under budgets down to 3 tokens, draft lengths 1..16, and a pool
 * small enough to preempt, with drafts always taken or weighed by the step
 * model; drafts verified and some kept. The prompts are
 * random ids of a 349-token vocabulary and the tiny model repeats itself:
 * prompt lookup finds drafts. */
static void check_speculation(void) {
    static req_spec specs[MAX_REQ];
    static req_out base[MAX_REQ], other[MAX_REQ];
    uint64_t rejected = 0; /* drafts not kept, in either mode */
    cs_engine *e0 = engine(16);
    for (int sampled = 0; sampled < 2; sampled++) {
        make_specs(specs, MAX_REQ, sampled);
        cs_engine *big = engine(4096), *small = engine(small_pool);
        cs_sched_params plain = cs_sched_params_default();
        run(big, &plain, specs, MAX_REQ, base, false);
        const int32_t budgets[] = {0, 512, 17, 3}, drafts[] = {1, 4, 16};
        uint64_t verified = 0, drafted = 0, kept = 0;
        for (size_t bi = 0; bi < sizeof budgets / sizeof budgets[0]; bi++)
            for (size_t di = 0; di < sizeof drafts / sizeof drafts[0]; di++)
                for (int tight = 0; tight < 2; tight++) {
                    cs_sched_params p = cs_sched_params_default();
                    p.max_num_batched_tokens = budgets[bi];
                    p.num_speculative_tokens = drafts[di];
                    /* mostly always; the cost rule too (timing decides how many
                     * drafts it keeps, never which tokens come out) */
                    p.speculative_always = !(tight && di == 1);
                    run(tight ? small : big, &p, specs, MAX_REQ, other, true);
                    char what[96];
                    snprintf(what, sizeof what, "%s, budget %d, %d drafts%s",
                             sampled ? "seeded" : "greedy", budgets[bi], drafts[di],
                             tight ? ", preempting" : "");
                    check_same(base, other, MAX_REQ, what);
                    verified += last_stats.spec_drafts;
                    drafted += last_stats.spec_draft_tokens;
                    kept += last_stats.spec_accepted_tokens;
                }
        ASSERT_TRUE(unready_drafts > 0); /* the cost rule's run probed before its model was ready */
        printf("speculation (%s): %llu verifications, %llu drafted tokens, %llu kept\n",
               sampled ? "seeded" : "greedy", (unsigned long long)verified,
               (unsigned long long)drafted, (unsigned long long)kept);
        ASSERT_TRUE(verified > 0 && kept > 0 && kept <= drafted);
        rejected += drafted - kept;
        /* every request opting out: no drafts, the same tokens */
        for (int i = 0; i < MAX_REQ; i++)
            specs[i].no_spec = true;
        cs_sched_params p = cs_sched_params_default();
        p.num_speculative_tokens = 8;
        p.speculative_always = true;
        run(big, &p, specs, MAX_REQ, other, false);
        check_same(base, other, MAX_REQ, "speculation disabled per request");
        ASSERT_TRUE(last_stats.spec_drafts == 0);
        cs_engine_free(big);
        cs_engine_free(small);
    }
    /* the tiny gemma3 repeats one token whatever the prompt: every draft is
     * kept there, and rejections are the llama model's to cover */
    ASSERT_TRUE(rejected > 0 || cs_kv_cache_window(cs_engine_kv(e0)) > 0);
    /* out of range */
    cs_engine *e = engine(64);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    p.num_speculative_tokens = CS_SCHED_SPEC_MAX + 1;
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), CS_EINVAL);
    p.num_speculative_tokens = -1;
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), CS_EINVAL);
    cs_engine_free(e);
    cs_engine_free(e0);
}

/* A draft model: the same tokens as one token a step, for greedy and seeded
 * sampling, under budgets down to 3 tokens (the unlimited one with a
 * step-time target), draft lengths 1..16, a target
 * pool small enough to preempt and a draft pool too small for every
 * sequence (those draft nothing), drafts always taken or weighed by the
 * step model. Drafts from the target itself (every draft kept, greedy and seeded), from
 * the same model in f16 and from one with other weights (the seed2 tiny:
 * mostly rejected). The tiny gemma3 drafts for itself (windowed layers: the
 * draft's windowed pages are trimmed and rebuilt). (Every tiny model has
 * one vocabulary: test_serve.py checks that another is refused.)
 * drafts[0] is the target's own file: with it every draft must be kept,
 * greedy and seeded, which checks the drafter itself (its catch-up, pages
 * and passes) and that a seeded proposal uses the very random number the
 * check's sample will: verification would hide either fault, this does
 * not. */
static void check_draft_model(const char *const *drafts, int n_drafts) {
    static req_spec specs[MAX_REQ];
    static req_out base[MAX_REQ], other[MAX_REQ];
    for (int di = 0; di < n_drafts; di++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s/tiny.gguf", getenv("CS_TINY_DIR"), drafts[di]);
        cs_model *dm = NULL;
        ASSERT_EQ_INT(cs_model_load(path, &dm), 0);
        uint64_t verified = 0, drafted = 0, kept = 0, greedy_drafted = 0, greedy_kept = 0;
        for (int sampled = 0; sampled < 2; sampled++) {
            make_specs(specs, MAX_REQ, sampled);
            cs_engine *big = engine(4096), *small = engine(small_pool);
            cs_sched_params plain = cs_sched_params_default();
            run(big, &plain, specs, MAX_REQ, base, false);
            const int32_t budgets[] = {0, 17, 3}, lens[] = {1, 4, 16};
            for (size_t bi = 0; bi < 3; bi++)
                for (size_t li = 0; li < 3; li++)
                    for (int tight = 0; tight < 2; tight++) {
                        cs_engine_params ep = cs_engine_params_default();
                        ep.n_pages = tight ? 24 : 4096;
                        ep.n_threads = 2;
                        cs_engine *de = NULL;
                        ASSERT_EQ_INT(cs_engine_init(dm, &ep, &de), 0);
                        cs_sched_params p = cs_sched_params_default();
                        p.max_num_batched_tokens = budgets[bi];
                        p.num_speculative_tokens = lens[li];
                        p.draft_engine = de;
                        /* the unlimited budget with a step-time target: the
                         * catch-up goes a page a step until the draft's
                         * token time is measured, then by what the target
                         * leaves */
                        if (bi == 0) p.step_time_target_ms = 5;
                        p.speculative_always = !(tight && li == 1);
                        run(tight ? small : big, &p, specs, MAX_REQ, other, true);
                        ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(de)), 0);
                        cs_engine_free(de);
                        char what[128];
                        snprintf(what, sizeof what, "draft %s, %s, budget %d, %d drafts%s",
                                 drafts[di], sampled ? "seeded" : "greedy", budgets[bi], lens[li],
                                 tight ? ", preempting" : "");
                        check_same(base, other, MAX_REQ, what);
                        verified += last_stats.spec_drafts;
                        drafted += last_stats.spec_draft_tokens;
                        kept += last_stats.spec_accepted_tokens;
                        if (!sampled) {
                            greedy_drafted += last_stats.spec_draft_tokens;
                            greedy_kept += last_stats.spec_accepted_tokens;
                        }
                    }
            cs_engine_free(big);
            cs_engine_free(small);
        }
        printf("draft model %s: %llu verifications, %llu drafted tokens, %llu kept; greedy %llu "
               "of %llu\n",
               drafts[di], (unsigned long long)verified, (unsigned long long)drafted,
               (unsigned long long)kept, (unsigned long long)greedy_kept,
               (unsigned long long)greedy_drafted);
        ASSERT_TRUE(verified > 0 && kept > 0 && kept <= drafted);
        /* the target drafting for itself: seeded drafts are picked with the
         * random number the check's sample uses (cs_sampler_propose), so
         * they are all kept too */
        if (di == 0) ASSERT_TRUE(greedy_drafted > 0 && drafted > greedy_drafted && kept == drafted);
        if (!strcmp(drafts[di], "seed2")) ASSERT_TRUE(kept < drafted);
        cs_model_free(dm);
    }
}

/* The last position's logits of toks, in one engine step. */
static void last_logits(cs_engine *e, const int32_t *toks, int32_t n, float *out) {
    cs_page_table pt = {0};
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, cs_engine_kv(e), 0, n), 0);
    cs_span sp = {toks, n, 0, pt.pages, pt.n_pages, 1, pt.cap};
    ASSERT_EQ_INT(cs_engine_step(e, &sp, 1, out), 0);
    cs_page_table_release(&pt, cs_engine_kv(e));
}

/* Pearson's statistic of counts against probabilities q over k bins (n
 * draws), bins expecting fewer than 5 merged into one (the test's
 * condition); *dof gets its degrees of freedom. */
static double chi_square(const int *counts, const double *q, int k, int n, int *dof) {
    double x = 0, small_want = 0;
    int small = 0, bins = 0;
    for (int i = 0; i < k; i++) {
        double want = q[i] * n;
        if (want < 5) {
            small_want += want, small += counts[i];
            continue;
        }
        x += (counts[i] - want) * (counts[i] - want) / want;
        bins++;
    }
    if (small_want > 0) x += (small - small_want) * (small - small_want) / small_want, bins++;
    *dof = bins - 1;
    return x;
}

/* The chi-square statistic exceeded with probability 0.001, by degrees of freedom. */
static double chi_square_bound(int dof) {
    static const double at[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32};
    ASSERT_TRUE(dof >= 1 && dof <= 7);
    return at[dof];
}

/* The first token prompt lookup drafts after toks (sched.c's rule: the
 * longest tail n-gram that occurred before, its latest occurrence), or -1. */
static int32_t lookup_draft(const int32_t *t, int32_t n_tok) {
    for (int32_t n = CS_SCHED_NGRAM_MAX; n >= CS_SCHED_NGRAM_MIN; n--)
        for (int32_t i = n_tok - n - 1; n_tok > n && i >= 0; i--)
            if (!memcmp(t + i, t + n_tok - n, (size_t)n * sizeof *t)) return t[i + n];
    return -1;
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* The distribution under speculation: 12,000 seeded requests (temperature 1,
 * top-k 8) on a prompt built so that its most likely first token a occurred
 * before, followed by the most likely token after a: when the first token is
 * a, the first decode verifies that draft. The second token, given a, is
 * compared with the model's distribution by a chi-square test (p = 0.001;
 * bins expecting under 5 merged); the same samples bent by two wrong
 * acceptance rules (keep the draft always; keep it half the time, else the
 * sample) must fail it. The seeds are fixed: the result is deterministic. */
/* The sampler's distribution after ctx[0..n): the top K logits (lower id
 * first on ties) and their softmax. */
static void top_k_dist(cs_engine *e, const int32_t *ctx, int n, float *lg, int K, int32_t *top,
                       double *q) {
    last_logits(e, ctx, n, lg);
    for (int k = 0; k < K; k++) {
        int32_t best = -1;
        for (int32_t v = 0; v < V; v++) {
            bool taken = false;
            for (int j = 0; j < k; j++)
                taken |= top[j] == v;
            if (!taken && (best < 0 || lg[v] > lg[best])) best = v;
        }
        top[k] = best;
    }
    double z = 0;
    for (int k = 0; k < K; k++)
        z += (q[k] = exp((double)lg[top[k]] - (double)lg[top[0]]));
    for (int k = 0; k < K; k++)
        q[k] /= z;
}

static void check_spec_distribution(void) {
    enum { N = 12000, K = 8, P = 24 };
    int32_t ctx[P + 1], top[K];
    double q[K];
    cs_engine *e = engine(8192);
    float *lg = malloc((size_t)V * sizeof *lg);
    int32_t a = -1, d = -1;
    /* A case the test can decide: the draft after a is a's likeliest, and
     * likely enough to be drafted but not so likely (q[0] <= 0.9) that the
     * wrong acceptance rules below look right. Drawn from the random stream
     * until one is found, whatever tests ran before. */
    for (int tries = 0; tries < 64 && !(d >= 0 && q[0] <= 0.9); tries++) {
        d = -1;
        for (int i = 0; i < P; i++)
            ctx[i] = (int32_t)rnd((uint32_t)V);
        for (int iter = 0; iter < 64; iter++) { /* the draft after a is a's likeliest */
            last_logits(e, ctx, P, lg);
            a = argmax(lg, V);
            int32_t at = -1;
            for (int32_t i = P - 2; i >= 0 && at < 0; i--)
                if (ctx[i] == a) at = i;
            if (at < 0) {
                ctx[8] = a;
                continue;
            }
            ctx[P] = a;
            last_logits(e, ctx, P + 1, lg);
            int32_t c = argmax(lg, V);
            d = lookup_draft(ctx, P + 1);
            if (d == c) break;
            ctx[at + 1] = c;
            d = -1;
        }
        if (d >= 0) top_k_dist(e, ctx, P + 1, lg, K, top, q);
    }
    ASSERT_TRUE(d >= 0 && q[0] <= 0.9); /* the construction converged */
    cs_sched_params p = cs_sched_params_default();
    p.num_speculative_tokens = 4;
    p.speculative_always = true;
    cs_sched *s = NULL;
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static int32_t t1[N], t2[N];
    for (int i = 0; i < N; i++) {
        cs_request r = {0};
        r.id = (uint64_t)i;
        r.prompt = ctx;
        r.n_prompt = P;
        r.sampling = cs_sampling_params_default();
        r.sampling.temperature = 1.0f;
        r.sampling.top_k = K;
        r.sampling.seed = 1000 + (uint64_t)i;
        r.stop.max_tokens = 2;
        r.stop.ignore_eos = true;
        t1[i] = t2[i] = -1;
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        if (i % 500 == 499 || i == N - 1) /* in batches, as a server meets them */
            while (!cs_sched_idle(s)) {
                const cs_event *ev;
                int32_t ne;
                ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
                for (int32_t j = 0; j < ne; j++) {
                    int32_t *slot = t1[ev[j].id] < 0 ? &t1[ev[j].id] : &t2[ev[j].id];
                    *slot = ev[j].token;
                }
            }
    }
    cs_sched_stats st;
    cs_sched_get_stats(s, &st);
    cs_sched_free(s);
    ASSERT_EQ_INT(top[0], d);
    int counts[K] = {0}, always[K] = {0}, half[K] = {0}, n = 0;
    for (int i = 0; i < N; i++) {
        if (t1[i] != a) continue;
        int k = 0;
        while (k < K && top[k] != t2[i])
            k++;
        ASSERT_TRUE(k < K); /* top-k: nothing else is sampled */
        counts[k]++;
        always[0]++;             /* wrong: the draft (top[0]) kept every time */
        half[(i & 1) ? 0 : k]++; /* wrong: kept half the time, else the sample */
        n++;
    }
    int dof;
    double x = chi_square(counts, q, K, n, &dof), xa = chi_square(always, q, K, n, &dof),
           xh = chi_square(half, q, K, n, &dof), bound = chi_square_bound(dof);
    printf("speculation, distribution: %d of %d first tokens are %d, draft %d (p %.2f); "
           "chi-square %.1f (%d dof, bound %.2f), wrong rules %.1f and %.1f; %llu drafted, "
           "%llu kept\n",
           n, N, a, d, q[0], x, dof, bound, xa, xh, (unsigned long long)st.spec_draft_tokens,
           (unsigned long long)st.spec_accepted_tokens);
    ASSERT_TRUE(n >= 500 && st.spec_draft_tokens > 0 && st.spec_accepted_tokens > 0);
    ASSERT_TRUE(x < bound);
    ASSERT_TRUE(xa > bound && xh > bound);
    free(lg);
    cs_engine_free(e);
}

static void check_prefix_cache(void) {
    cs_engine *e = engine(1024);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    p.max_num_batched_tokens = 128;
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static req_spec a, b;
    a.n_prompt = 340, b.n_prompt = 320;
    for (int i = 0; i < 340; i++)
        a.prompt[i] = (int32_t)rnd((uint32_t)V);
    memcpy(b.prompt, a.prompt, sizeof(int32_t) * 300);
    for (int i = 300; i < 320; i++)
        b.prompt[i] = (int32_t)rnd((uint32_t)V);
    a.max_tokens = b.max_tokens = 16;
    req_out oa = {0}, ob = {0}, ob_cold = {0};
    cs_sched_stats st0, st1;
    for (int k = 0; k < 2; k++) {
        cs_request r = make_req(k ? &b : &a, (uint64_t)k);
        cs_sched_get_stats(s, &st0);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        while (!cs_sched_idle(s)) {
            const cs_event *ev;
            int32_t ne;
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
            for (int32_t i = 0; i < ne; i++) {
                req_out *o = k ? &ob : &oa;
                o->out[o->n_out++] = ev[i].token;
            }
        }
        cs_sched_get_stats(s, &st1);
    }
    /* 300 shared tokens = 18 full pages of 16 (288 tokens): only 320 - 288 computed */
    uint64_t computed = st1.prompt_tokens_computed - st0.prompt_tokens_computed;
    printf("prefix cache: second request computed %llu of its 320 prompt tokens (%llu reused)\n",
           (unsigned long long)computed,
           (unsigned long long)(st1.prefix_hit_tokens - st0.prefix_hit_tokens));
    ASSERT_EQ_INT(computed, 320 - 288);
    ASSERT_EQ_INT(st1.prefix_hit_tokens - st0.prefix_hit_tokens, 288);
    cs_sched_free(s);
    cs_engine_free(e);
    /* same output as with a cold cache */
    cs_engine *e2 = engine(1024);
    req_out dummy[1];
    (void)dummy;
    cs_sched_params cold = cs_sched_params_default();
    cold.enable_prefix_caching = false;
    run(e2, &cold, &b, 1, &ob_cold, false);
    ASSERT_EQ_INT(ob.n_out, ob_cold.n_out);
    for (int j = 0; j < ob.n_out; j++)
        ASSERT_EQ_INT(ob.out[j], ob_cold.out[j]);
    cs_engine_free(e2);
}

static void check_cancel(void) {
    cs_engine *e = engine(200);
    static req_spec specs[MAX_REQ];
    make_specs(specs, MAX_REQ, true);
    for (int round = 0; round < 20; round++) {
        cs_sched *s = NULL;
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 1 + (int32_t)rnd(200);
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        bool live[MAX_REQ] = {0};
        for (int i = 0; i < MAX_REQ; i++) {
            cs_request r = make_req(&specs[i], (uint64_t)i);
            ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
            live[i] = true;
        }
        while (!cs_sched_idle(s)) {
            int victim = (int)rnd(MAX_REQ * 3);
            if (victim < MAX_REQ && live[victim]) {
                ASSERT_EQ_INT(cs_sched_cancel(s, (uint64_t)victim), 0);
                live[victim] = false;
                ASSERT_EQ_INT(cs_sched_cancel(s, (uint64_t)victim), CS_ENOENT);
            }
            const cs_event *ev;
            int32_t ne;
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
            for (int32_t i = 0; i < ne; i++)
                if (ev[i].finish) live[ev[i].id] = false;
            check_pages(e);
        }
        if (round == 7) { /* free with live requests: everything released */
            cs_request r = make_req(&specs[0], 999);
            ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
            const cs_event *ev;
            int32_t ne;
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        }
        cs_sched_free(s);
        ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(e)), 0);
    }
    cs_engine_free(e);
}

static void check_bad_requests(void) {
    cs_engine *e = engine(64);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static req_spec sp;
    sp.n_prompt = 10, sp.max_tokens = 5;
    for (int i = 0; i < 10; i++)
        sp.prompt[i] = i;
    cs_request r = make_req(&sp, 1);
    ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL); /* id already live */
    ASSERT_MSG_HAS(cs_last_error(), "already live");
    r.id = 2, r.n_prompt = 0;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    r.n_prompt = 10, sp.prompt[3] = V;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "outside the vocabulary");
    sp.prompt[3] = 3, r.sampling.temperature = -1;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    r.sampling.temperature = 0, r.stop.max_tokens = 0;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    static int32_t huge[4096];
    r.stop.max_tokens = 4, r.prompt = huge, r.n_prompt = 4096;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL); /* no room left in the context */
    r.n_prompt = 2000;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_ENOSPC); /* 64 pages of 16 hold 1024 tokens */
    r.n_prompt = 10, r.priority = -1;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "priority");
    r.priority = CS_MAX_PRIORITY + 1;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "priority");
    r.priority = 0;
    cs_sched_stats st;
    cs_sched_get_stats(s, &st);
    ASSERT_EQ_INT(st.n_waiting, 1);
    cs_sched_free(s);
    ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(e)), 0);
    cs_sched_params bad = p;
    bad.max_num_seqs = 0;
    ASSERT_EQ_INT(cs_sched_init(e, &bad, &s), CS_EINVAL);
    cs_engine_free(e);
}

/* ---- the serving loop ---- */
typedef struct {
    pthread_mutex_t mu;
    int n_tokens[64];
    enum cs_finish finish[64];
    int finished;
    char err[64][128];
} sink;

static void on_event(void *user, const cs_event *ev) {
    sink *k = user;
    pthread_mutex_lock(&k->mu);
    if (ev->token >= 0) k->n_tokens[ev->id]++;
    if (ev->finish) {
        k->finish[ev->id] = ev->finish;
        if (ev->error) snprintf(k->err[ev->id], sizeof k->err[ev->id], "%s", ev->error);
        k->finished++;
    }
    pthread_mutex_unlock(&k->mu);
}

static void check_serve(void) {
    cs_engine *e = engine(512);
    cs_serve *sv = NULL;
    cs_sched_params p = cs_sched_params_default();
    p.max_num_batched_tokens = 64;
    ASSERT_EQ_INT(cs_serve_start(e, &p, &sv), 0);
    static sink k;
    pthread_mutex_init(&k.mu, NULL);
    static req_spec specs[40];
    make_specs(specs, 40, false);
    for (int i = 0; i < 40; i++) {
        cs_request r = make_req(&specs[i], (uint64_t)i);
        if (i == 39) r.n_prompt = 0; /* bad: an ERROR event */
        ASSERT_EQ_INT(cs_serve_submit(sv, &r, on_event, &k), 0);
        if (i % 5 == 4) cs_serve_cancel(sv, (uint64_t)(i - 2));
    }
    for (int wait = 0; wait < 3000; wait++) {
        pthread_mutex_lock(&k.mu);
        int f = k.finished;
        pthread_mutex_unlock(&k.mu);
        if (f == 40) break;
        usleep(10000);
    }
    ASSERT_EQ_INT(k.finished, 40);
    int cancelled = 0;
    for (int i = 0; i < 39; i++) {
        ASSERT_TRUE(k.finish[i] == CS_FINISH_LENGTH || k.finish[i] == CS_FINISH_CANCELLED);
        if (k.finish[i] == CS_FINISH_LENGTH) ASSERT_EQ_INT(k.n_tokens[i], specs[i].max_tokens);
        cancelled += k.finish[i] == CS_FINISH_CANCELLED;
    }
    ASSERT_EQ_INT(k.finish[39], CS_FINISH_ERROR);
    ASSERT_MSG_HAS(k.err[39], "empty prompt");
    printf("serve: 40 requests from another thread, %d cancelled, 1 refused, all finished\n",
           cancelled);
    /* stop with requests in flight: each gets CANCELLED */
    static sink k2;
    pthread_mutex_init(&k2.mu, NULL);
    for (int i = 0; i < 10; i++) {
        cs_request r = make_req(&specs[i], (uint64_t)i);
        r.stop.max_tokens = 40;
        ASSERT_EQ_INT(cs_serve_submit(sv, &r, on_event, &k2), 0);
    }
    cs_serve_stop(sv);
    ASSERT_EQ_INT(k2.finished, 10);
    ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(e)), 0);
    cs_engine_free(e);
}

/* Runs r alone to its end: the prompt tokens its finish event says were cached. */
static int32_t run_cached(cs_sched *s, const cs_request *r) {
    ASSERT_EQ_INT(cs_sched_add(s, r), 0);
    int32_t cached = -1;
    while (!cs_sched_idle(s)) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        for (int32_t i = 0; i < ne; i++)
            if (ev[i].finish != CS_FINISH_NONE) cached = ev[i].n_cached_prompt_tokens;
    }
    return cached;
}

/* cache_salt: the same prompt under another salt reuses nothing, under its
 * own salt everything a full page holds; no salt is a namespace of its own. */
static void check_cache_salt(void) {
    cs_engine *e = engine(1024);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static req_spec a;
    a.n_prompt = 100;
    for (int i = 0; i < a.n_prompt; i++)
        a.prompt[i] = (int32_t)rnd((uint32_t)V);
    a.max_tokens = 2;
    const char *salts[] = {"tenant-a", "tenant-b", NULL, "", "tenant-a", "tenant-b", "tenant-c"};
    /* 100 tokens: 6 full pages of 16 (96 tokens) are cacheable */
    const int32_t want[] = {0, 0, 0, 96, 96, 96, 0};
    for (int k = 0; k < 7; k++) {
        cs_request r = make_req(&a, (uint64_t)(100 + k));
        r.cache_salt = salts[k];
        int32_t cached = run_cached(s, &r);
        if (cached != want[k])
            fprintf(stderr, "salt %s: %d cached, want %d\n", salts[k] ? salts[k] : "(none)", cached,
                    want[k]);
        ASSERT_EQ_INT(cached, want[k]);
    }
    printf("cache_salt: a prompt is reused only under its own salt\n");
    cs_sched_free(s);
    cs_engine_free(e);
}

/* A reserved local request (a decode worker's local prefill) takes its cached
 * prefix too: it was admitted with every page reserved and never looked. */
static void check_reserved_reuse(void) {
    cs_engine *e = engine(1024);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static req_spec a;
    a.n_prompt = 100;
    for (int i = 0; i < a.n_prompt; i++)
        a.prompt[i] = (int32_t)rnd((uint32_t)V);
    a.max_tokens = 1; /* the first token is also the last */
    int32_t want[] = {0, 96, 96};
    for (int k = 0; k < 3; k++) {
        cs_request r = make_req(&a, (uint64_t)(200 + k));
        r.reserve = k > 0;
        int32_t cached = run_cached(s, &r);
        ASSERT_EQ_INT(cached, want[k]);
        ASSERT_EQ_INT(cs_kv_cache_check(cs_engine_kv(e)), 0);
    }
    cs_sched_free(s);
    cs_engine_free(e);
}

/* cs_request.held: a held prompt gets no further chunk while the others run
 * (and takes no partial-prefill seat); a scheduler with only held prompts is
 * idle; released, it finishes with the tokens it would have had unheld. */
static void check_held(void) {
    cs_engine *e = engine(1024);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    p.max_num_batched_tokens = 32;
    p.max_num_partial_prefills = 1;
    p.enable_prefix_caching = false; /* the reference run below must not warm the cache */
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static req_spec a, b;
    a.n_prompt = 200, b.n_prompt = 100;
    for (int i = 0; i < a.n_prompt; i++)
        a.prompt[i] = (int32_t)rnd((uint32_t)V);
    for (int i = 0; i < b.n_prompt; i++)
        b.prompt[i] = (int32_t)rnd((uint32_t)V);
    a.max_tokens = b.max_tokens = 3;
    req_out want[2], got[2];
    memset(got, 0, sizeof got);
    req_spec both[2] = {a, b};
    run(e, &p, both, 2, want, false);

    _Atomic bool held = false;
    cs_request ra = make_req(&a, 1), rb = make_req(&b, 2);
    ra.held = &held;
    ASSERT_EQ_INT(cs_sched_add(s, &ra), 0);
    const cs_event *ev;
    int32_t ne;
    ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0); /* a's first chunk */
    cs_step_info info;
    cs_sched_last_step(s, &info);
    ASSERT_EQ_INT(info.n_tokens, 32);
    atomic_store(&held, true);
    ASSERT_TRUE(cs_sched_idle(s));
    ASSERT_EQ_INT(cs_sched_add(s, &rb), 0); /* b is admitted past the held a, and finishes */
    while (got[1].n_out < b.max_tokens) {
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_sched_last_step(s, &info);
        ASSERT_TRUE(info.n_tokens > 0);
        for (int32_t i = 0; i < ne; i++) {
            ASSERT_EQ_INT((int)ev[i].id, 2);
            if (ev[i].token >= 0) got[1].out[got[1].n_out++] = ev[i].token;
        }
    }
    ASSERT_TRUE(cs_sched_idle(s)); /* only the held a is left */
    atomic_store(&held, false);
    ASSERT_TRUE(!cs_sched_idle(s));
    while (!cs_sched_idle(s)) {
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        for (int32_t i = 0; i < ne; i++)
            if (ev[i].token >= 0) got[0].out[got[0].n_out++] = ev[i].token;
    }
    for (int k = 0; k < 2; k++) {
        ASSERT_EQ_INT(got[k].n_out, want[k].n_out);
        ASSERT_TRUE(memcmp(got[k].out, want[k].out, sizeof(int32_t) * (size_t)got[k].n_out) == 0);
    }
    check_pages(e);
    cs_sched_free(s);
    cs_engine_free(e);
}

/* The step model recovers a known linear law, and follows a new one once
 * its window has turned over. */
static void check_step_model(void) {
    cs_step_model m;
    cs_step_model_init(&m);
    ASSERT_TRUE(isnan(cs_step_model_predict(&m, 10, 10, 1)));
    ASSERT_TRUE(!cs_step_model_ready(&m));
    /* a law with a steeper slope under CS_STEP_MODEL_SMALL tokens (w[4]) */
    const double w[5] = {2e-3, 1e-5, 2e-9, 3e-5, 2e-4};
#define LAW(tok, pairs, rows)                                                                      \
    (w[0] + w[1] * (tok) + w[2] * (pairs) + w[3] * (rows) +                                        \
     w[4] * ((tok) < CS_STEP_MODEL_SMALL ? (tok) : CS_STEP_MODEL_SMALL))
    for (int i = 0; i < 100; i++) {
        double tok = 1 + (double)rnd(i % 2 ? 2048 : 48), pairs = tok * (double)rnd(4096),
               rows = 1 + rnd(32);
        cs_step_model_observe(&m, tok, pairs, rows, LAW(tok, pairs, rows));
    }
    ASSERT_TRUE(cs_step_model_ready(&m));
    double got[5];
    cs_step_model_coefficients(&m, got);
    for (int k = 0; k < 5; k++)
        ASSERT_TRUE(fabs(got[k] - w[k]) <= 1e-2 * w[k]);
    double t = cs_step_model_predict(&m, 512, 512.0 * 1000, 8);
    ASSERT_TRUE(fabs(t - LAW(512, 512e3, 8)) < 1e-2 * LAW(512, 512e3, 8));
    t = cs_step_model_predict(&m, 5, 5.0 * 1000, 5);
    ASSERT_TRUE(fabs(t - LAW(5, 5e3, 5)) < 1e-2 * LAW(5, 5e3, 5));
    for (int i = 0; i < CS_STEP_MODEL_WINDOW; i++) { /* the machine got twice as slow */
        double tok = 1 + (double)rnd(i % 2 ? 2048 : 48), pairs = tok * (double)rnd(4096),
               rows = 1 + rnd(32);
        cs_step_model_observe(&m, tok, pairs, rows, 2 * LAW(tok, pairs, rows));
    }
    cs_step_model_coefficients(&m, got);
    for (int k = 0; k < 5; k++)
        ASSERT_TRUE(fabs(got[k] - 2 * w[k]) <= 1e-2 * w[k]);
    /* steady decode-only steps (one token count): once the window holds
     * nothing else, the trusted fit stops changing and still predicts them */
    const double law8 = 2 * LAW(8, 800, 8);
#undef LAW
    for (int i = 0; i < CS_STEP_MODEL_WINDOW; i++)
        cs_step_model_observe(&m, 8, 800, 8, law8);
    double held[5], later[5];
    cs_step_model_coefficients(&m, held);
    for (int i = 0; i < CS_STEP_MODEL_WINDOW; i++)
        cs_step_model_observe(&m, 8, 800, 8, law8);
    cs_step_model_coefficients(&m, later);
    ASSERT_TRUE(cs_step_model_ready(&m));
    ASSERT_TRUE(memcmp(held, later, sizeof held) == 0);
    ASSERT_TRUE(fabs(cs_step_model_predict(&m, 8, 800, 8) - law8) < 1e-3 * law8);
    /* and they never make a new model ready */
    cs_step_model_init(&m);
    for (int i = 0; i < 100; i++)
        cs_step_model_observe(&m, 8, 8 * 100.0, 8, 1e-3);
    ASSERT_TRUE(!cs_step_model_ready(&m));
    printf("step model: coefficients recovered within 1%%, follows a 2x slowdown in %d steps\n",
           CS_STEP_MODEL_WINDOW);
}

/* The TTFT predictor (chunkserve/ttft.h). Its arithmetic on a hand-made
 * load; then its queue model against the real scheduler without clocks:
 * with every step costing 1 s and nothing running, a prediction is the
 * number of steps until the request's first token, and the scheduler must
 * take exactly that many (arrival order, another tenant's flood, a better
 * priority). The model is fluid: near a step boundary the scheduler may
 * finish a step sooner than it says (the cases are away from one). */
static void queue_prompts(cs_sched *s, const char *tenant, int32_t priority, int n, int32_t len,
                          uint64_t *id) {
    static req_spec sp;
    sp.n_prompt = len;
    sp.max_tokens = 1; /* no decodes: every step's budget goes to prompts */
    sp.tenant = tenant;
    sp.priority = priority;
    for (int k = 0; k < n; k++) {
        for (int i = 0; i < len; i++)
            sp.prompt[i] = (int32_t)rnd((uint32_t)V);
        cs_request r = make_req(&sp, (*id)++);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    }
}

/* Steps until request id's first token. */
static int steps_to_first(cs_sched *s, uint64_t id) {
    for (int n = 1; n < 1000; n++) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        for (int32_t i = 0; i < ne; i++)
            if (ev[i].id == id && ev[i].token >= 0) return n;
    }
    ASSERT_TRUE(!"the request never got its first token");
    return -1;
}

static void check_ttft(void) {
    cs_ttft_load L = {0};
    ASSERT_TRUE(isnan(cs_ttft_predict(&L, 0, NULL, 1, 10)));
    /* 10 ms a step, 1 ms a token, 2 ms a sampling row; 64 tokens a step */
    L.ready = true;
    L.w[0] = 0.01, L.w[1] = 0.001, L.w[3] = 0.002;
    L.chunk_tokens = 64;
    L.residual_s = 0.005;
    const double full = 0.01 + 0.064, eps = 1e-9;
    ASSERT_TRUE(fabs(cs_ttft_predict(&L, 0, NULL, 1, 10) - (0.005 + 0.01 + 0.010 + 0.002)) < eps);
    cs_ttft_load_add(&L, 0, "", 1, 150);
    cs_ttft_load_add(&L, 0, NULL, 1, 50); /* the same group */
    ASSERT_EQ_INT(L.n_groups, 1);
    /* behind 200 tokens: 210 in 4 steps, the last with 18 and its row */
    ASSERT_TRUE(fabs(cs_ttft_predict(&L, 0, NULL, 1, 10) -
                     (0.005 + 3 * full + 0.01 + 0.018 + 0.002)) < eps);
    /* a better priority: one step, full of the others' tokens */
    ASSERT_TRUE(fabs(cs_ttft_predict(&L, -1, NULL, 1, 10) - (0.005 + full + 0.002)) < eps);
    /* alone: the worse priority's tokens still fill its step (nothing is ahead of it:
     * the refusal rule compares with this, so such work never refuses it) */
    ASSERT_TRUE(cs_ttft_predict_alone(&L, -1, 10) == cs_ttft_predict(&L, -1, NULL, 1, 10));
    ASSERT_TRUE(fabs(cs_ttft_predict_alone(&L, 0, 10) - (0.005 + 0.01 + 0.010 + 0.002)) < eps);
    /* the running step computes 64 of the 200: when it ends 146 are left, 3 steps */
    L.in_step_tokens = 64;
    ASSERT_TRUE(fabs(cs_ttft_predict(&L, 0, NULL, 1, 10) -
                     (0.005 + 2 * full + 0.01 + 0.018 + 0.002)) < eps);
    ASSERT_TRUE(fabs(cs_ttft_predict_alone(&L, 0, 10) - (0.005 + 0.01 + 0.010 + 0.002)) < eps);
    L.in_step_tokens = 0;
    /* another tenant of equal weight: its share of 10 more, one full step */
    memset(L.groups, 0, sizeof L.groups), L.n_groups = 0;
    cs_ttft_load_add(&L, 0, "b", 1, 1000);
    ASSERT_TRUE(fabs(cs_ttft_predict(&L, 0, "a", 1, 10) - (0.005 + full + 0.002)) < eps);
    /* a tenant weighing a tenth: b goes ten times as fast, 110 tokens, 2 steps */
    ASSERT_TRUE(fabs(cs_ttft_predict(&L, 0, "a", 0.1, 10) - (0.005 + 2 * full + 0.002)) < eps);
    for (int i = 0; i < CS_TTFT_GROUPS + 3; i++) {
        char t[16];
        snprintf(t, sizeof t, "t%d", i);
        cs_ttft_load_add(&L, 0, t, 1, 1);
    }
    ASSERT_EQ_INT(L.n_groups, CS_TTFT_GROUPS);
    ASSERT_EQ_INT(L.overflow_tokens, 4); /* the table was full: ahead of everyone */

    const struct {
        const char *flood;
        int32_t flood_priority, n_flood, flood_len, warm_steps;
        const char *tenant;
        int32_t priority, n, count, seats;
    } cases[] = {
        {"b", 0, 3, 100, 0, "b", 0, 30, 1, 0}, /* arrival order: 330 tokens, 6 steps */
        {"b", 0, 6, 400, 2, "a", 0, 30, 1, 0}, /* a flood of b: a's 30 and b's share, 1 step */
        {"b", 0, 6, 400, 2, "a", 0, 90, 1, 0}, /* 180 tokens: 3 steps */
        {"b", 5, 4, 200, 1, "b", 0, 70, 1, 0}, /* a better priority: 2 steps */
        /* four short prompts of a at once beside b's running chunk: a's 24 tokens and
         * b's 24, all in the next step (by virtual finish; by virtual start a would get
         * one prompt a step: a few tokens ahead, it would wait for b's whole chunk) */
        {"b", 0, 6, 400, 2, "a", 0, 6, 4, 0},
        /* the same with b's running prompt holding the only partial seat: each of a's
         * takes the seat beyond it in turn (the one before ends its prompt in the step) */
        {"b", 0, 6, 400, 2, "a", 0, 6, 4, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        cs_engine *e = engine(4096);
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 64;
        if (cases[k].seats) p.max_num_partial_prefills = cases[k].seats;
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        uint64_t id = 1;
        queue_prompts(s, cases[k].flood, cases[k].flood_priority, cases[k].n_flood,
                      cases[k].flood_len, &id);
        for (int i = 0; i < cases[k].warm_steps; i++) {
            const cs_event *ev;
            int32_t ne;
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        }
        queue_prompts(s, cases[k].tenant, cases[k].priority, cases[k].count, cases[k].n, &id);
        cs_ttft_load Q;
        cs_sched_ttft_load(s, &Q);
        Q.ready = true, memset(Q.w, 0, sizeof Q.w), Q.w[0] = 1; /* a step: 1 s */
        Q.chunk_tokens = 64, Q.residual_s = 0;
        /* it is queued already (the last of them): predicted as the last of its
         * tenant's work */
        double want = cs_ttft_predict(&Q, cases[k].priority, cases[k].tenant, 1, 0);
        int got = steps_to_first(s, id - 1);
        printf("ttft: case %zu: predicted %.0f steps, took %d\n", k, want, got);
        ASSERT_EQ_INT((int)want, got);
        cs_sched_free(s);
        cs_engine_free(e);
    }
}

/* One run of every request under a step-time target, checking the sizing
 * rule on each step: probe chunks before the model is ready, one page a
 * prompt on a predicted step over the target. */
static void size_steps(cs_engine *e, const cs_sched_params *p, const req_spec *specs, bool tight,
                       int *ready, int *capped, int *probe_max) {
    cs_sched *s = NULL;
    ASSERT_EQ_INT(cs_sched_init(e, p, &s), 0);
    for (int i = 0; i < MAX_REQ; i++) {
        cs_request r = make_req(&specs[i], (uint64_t)i);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    }
    int steps = 0;
    *ready = *capped = *probe_max = 0;
    while (!cs_sched_idle(s)) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_step_info info;
        cs_sched_last_step(s, &info);
        int32_t chunk = info.n_tokens - info.n_decode;
        if (isnan(info.predicted_seconds)) {
            if (chunk > *probe_max) *probe_max = chunk;
            /* probes start at one page a prompt, and stay there while
             * every step overshoots the target */
            if (steps++ == 0 || tight) ASSERT_TRUE(chunk <= info.n_prefill * 16);
            continue;
        }
        (*ready)++;
        if (info.predicted_seconds > p->step_time_target_ms / 1e3) {
            ASSERT_TRUE(info.n_prefill <= 1 && chunk <= 16);
            (*capped)++;
        }
    }
    cs_sched_free(s);
}

/* --step-time-target-ms: any target gives the one-pass tokens; once the
 * model is ready, a step's predicted time stays within the target unless
 * its only chunk is the one page that keeps prompts moving. */
static void check_step_time_target(void) {
    static req_spec specs[MAX_REQ];
    static req_out base[MAX_REQ], other[MAX_REQ];
    make_specs(specs, MAX_REQ, false);
    cs_engine *e = engine(4096);
    cs_sched_params one_pass = cs_sched_params_default();
    run(e, &one_pass, specs, MAX_REQ, base, false);
    const double targets[] = {1e-6, 0.5, 1e6};
    for (size_t t = 0; t < sizeof targets / sizeof targets[0]; t++) {
        cs_sched_params p = cs_sched_params_default();
        p.step_time_target_ms = targets[t];
        run(e, &p, specs, MAX_REQ, other, true);
        char what[64];
        snprintf(what, sizeof what, "step time target %g ms", targets[t]);
        check_same(base, other, MAX_REQ, what);

        /* the sizing rule, step by step. The model is fitted from measured
         * steps, and the tiny model's steps are microseconds: on a loaded
         * machine preemptions can swamp them, so that no fit has time
         * growing with tokens. The loose target must reach a fit; it gets
         * up to 5 runs (a scheduler that never feeds its model fails all). */
        int ready = 0, capped = 0, probe_max = 0;
        for (int attempt = 0; attempt < (t == 2 ? 5 : 1); attempt++) {
            size_steps(e, &p, specs, t == 0, &ready, &capped, &probe_max);
            if (t != 2 || ready > 0) break;
            printf("step time target %g ms: no fit in run %d (a noisy machine); again\n",
                   targets[t], attempt + 1);
        }
        printf("step time target %g ms: one-pass tokens; %d steps predicted, %d over the target "
               "with one page of prompt; probe chunks <= %d tokens\n",
               targets[t], ready, capped, probe_max);
        ASSERT_TRUE(probe_max <= CS_SCHED_PROBE_TOKENS * 4); /* up to 4 partial prefills */
        /* The model is fitted from measured steps: on a loaded machine the
         * one-page probes of the tight targets may never spread enough to fit
         * (a timing, not a rule; the rule is checked above on every predicted
         * step). The loose target doubles its probes to 256 tokens: a fit. */
        if (t == 2) ASSERT_TRUE(ready > 0);
        if (t == 0 && ready) ASSERT_TRUE(capped > 0); /* nothing fits 1 ns: one page a step */
        if (t == 2) ASSERT_EQ_INT(capped, 0);         /* everything fits 1000 s */
    }
    cs_engine_free(e);
}

/* The reference: every position's logits in one engine step. */
static void plp_reference(cs_engine *e, const int32_t *toks, int32_t n, int32_t top,
                          cs_prompt_logprob *out) {
    cs_page_table pt = {0};
    ASSERT_EQ_INT(cs_page_table_reserve(&pt, cs_engine_kv(e), 0, n), 0);
    float *lg = malloc((size_t)n * (size_t)V * sizeof *lg);
    cs_span sp = {toks, n, 0, pt.pages, pt.n_pages, n, pt.cap};
    ASSERT_EQ_INT(cs_engine_step(e, &sp, 1, lg), 0);
    for (int32_t i = 0; i + 1 < n; i++)
        cs_prompt_logprob_of(lg + (size_t)i * V, V, toks[i + 1], top, &out[i]);
    free(lg);
    cs_page_table_release(&pt, cs_engine_kv(e));
}

/* Runs requests r[0..n) to their ends; copies request 0's prompt logprobs. */
static int32_t plp_run(cs_sched *s, const cs_request *r, int n, cs_prompt_logprob *out) {
    for (int i = 0; i < n; i++)
        ASSERT_EQ_INT(cs_sched_add(s, &r[i]), 0);
    int32_t got = -1, steps = 0;
    while (!cs_sched_idle(s)) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_step_info info;
        cs_sched_last_step(s, &info);
        ASSERT_TRUE(++steps < 10000);
        for (int32_t i = 0; i < ne; i++) {
            if (ev[i].id != r[0].id || !ev[i].prompt_lp) {
                ASSERT_TRUE(!ev[i].prompt_lp || ev[i].id == r[0].id);
                continue;
            }
            ASSERT_EQ_INT(got, -1); /* once, with the first token */
            ASSERT_EQ_INT(ev[i].n_completion_tokens, 1);
            got = ev[i].n_prompt_lp;
            memcpy(out, ev[i].prompt_lp, (size_t)got * sizeof *out);
        }
    }
    return got;
}

/* On a quantized model: its integer kernels give every row the same bits
 * whatever else the step holds (the f32 one goes through BLAS). */
static void check_prompt_logprobs(void) {
    enum { N = 300, TOP = 5 };
    char path[1024];
    snprintf(path, sizeof path, "%s/q4_k/tiny.gguf", getenv("CS_TINY_DIR"));
    cs_model *f32 = model;
    ASSERT_EQ_INT(cs_model_load_mode(path, CS_WEIGHTS_QUANT, &model), 0);
    cs_engine *e = engine(512);
    static int32_t toks[N], other[200];
    for (int i = 0; i < N; i++)
        toks[i] = (int32_t)rnd((uint32_t)V);
    for (int i = 0; i < 200; i++)
        other[i] = i < 100 ? toks[i] : (int32_t)rnd((uint32_t)V);
    static cs_prompt_logprob want[N], got[N];
    plp_reference(e, toks, N, TOP, want);
    for (int i = 0; i + 1 < N; i++) { /* the rank agrees with the alternatives */
        ASSERT_EQ_INT(want[i].token, toks[i + 1]);
        for (int j = 0; j < want[i].lp.n_top; j++)
            if (want[i].lp.top_ids[j] == toks[i + 1]) ASSERT_EQ_INT(want[i].rank, j + 1);
        if (want[i].rank <= TOP) ASSERT_EQ_INT(want[i].lp.top_ids[want[i].rank - 1], toks[i + 1]);
    }
    const int32_t budgets[] = {0, 64, 7};
    for (int b = 0; b < 3; b++) {
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = budgets[b];
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        req_spec spec = {.n_prompt = 200, .max_tokens = 3};
        memcpy(spec.prompt, other, sizeof other);
        cs_request r[2] = {{0}, make_req(&spec, 2)};
        /* first the other prompt alone: its pages are cached, request 1 must not use them */
        ASSERT_EQ_INT(plp_run(s, &r[1], 1, got), -1);
        r[0] = r[1];
        r[0].id = 1, r[0].prompt = toks, r[0].n_prompt = N;
        r[0].prompt_logprobs = true, r[0].prompt_top_logprobs = TOP;
        r[1].id = 3;
        memset(got, 0, sizeof got);
        ASSERT_EQ_INT(plp_run(s, r, 2, got), N - 1);
        for (int i = 0; i + 1 < N; i++) {
            ASSERT_EQ_INT(got[i].token, want[i].token);
            ASSERT_EQ_INT(got[i].rank, want[i].rank);
            ASSERT_EQ_INT(got[i].lp.n_top, TOP);
            if (got[i].lp.logprob != want[i].lp.logprob)
                fprintf(stderr, "budget %d: position %d: %.9g vs %.9g\n", budgets[b], i,
                        got[i].lp.logprob, want[i].lp.logprob);
            ASSERT_TRUE(got[i].lp.logprob == want[i].lp.logprob);
            for (int j = 0; j < TOP; j++) {
                ASSERT_EQ_INT(got[i].lp.top_ids[j], want[i].lp.top_ids[j]);
                if (got[i].lp.top_logprobs[j] != want[i].lp.top_logprobs[j])
                    fprintf(stderr, "b %d pos %d alt %d: %.9g vs %.9g\n", budgets[b], i, j,
                            got[i].lp.top_logprobs[j], want[i].lp.top_logprobs[j]);
                ASSERT_TRUE(got[i].lp.top_logprobs[j] == want[i].lp.top_logprobs[j]);
            }
        }
        cs_sched_free(s);
    }
    /* one token: no entry, but the (empty) list comes; resumed: refused */
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    req_spec spec = {.n_prompt = 1, .max_tokens = 2};
    spec.prompt[0] = toks[0];
    cs_request r = make_req(&spec, 9);
    r.prompt_logprobs = true;
    ASSERT_EQ_INT(plp_run(s, &r, 1, got), 0);
    r.prompt = toks, r.n_prompt = 10, r.n_resumed = 2;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    r.n_resumed = 0, r.prompt_top_logprobs = CS_MAX_TOP_LOGPROBS + 1;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    cs_sched_free(s);
    check_pages(e);
    cs_engine_free(e);
    cs_model_free(model);
    model = f32;
}

/* Adds n prompts of len random tokens for tenant, ids from *id on. */
static void add_flood(cs_sched *s, const char *tenant, int n, int32_t len, uint64_t *id) {
    static req_spec sp;
    sp.n_prompt = len;
    sp.max_tokens = 2;
    sp.tenant = tenant;
    for (int k = 0; k < n; k++) {
        for (int i = 0; i < len; i++)
            sp.prompt[i] = (int32_t)rnd((uint32_t)V);
        cs_request r = make_req(&sp, (*id)++);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    }
}

/* Steps n times; the tokens each of three tenants got in them. */
static void steps_for(cs_sched *s, int n, const char *const names[3], uint64_t got[3]) {
    uint64_t t0[3];
    for (int k = 0; k < 3; k++)
        t0[k] = cs_sched_tenant_tokens(s, names[k]);
    for (int i = 0; i < n; i++) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
    }
    for (int k = 0; k < 3; k++)
        got[k] = cs_sched_tenant_tokens(s, names[k]) - t0[k];
}

/* Token-fair steps (sched.h, tenants): tenant a floods first, b after it;
 * with equal shares each gets half the prompt tokens while both have work
 * (arrival order would give b nothing until a's flood is done), with 3:1
 * shares three quarters and one; a tenant arriving later gets its share,
 * not the machine (it starts at the least virtual tokens); the budget is
 * always spent (work-conserving). Bad shares and tenants are refused. */
static void check_tenants(void) {
    const char *const names[3] = {"a", "b", "c"};
    for (int weighted = 0; weighted < 2; weighted++) {
        cs_engine *e = engine(4096);
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 64;
        const cs_tenant_share shares[] = {{"a", weighted ? 3 : 1}, {"b", 1}};
        p.tenant_shares = shares;
        p.n_tenant_shares = 2;
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        uint64_t id = 1, got[3];
        add_flood(s, "a", 12, 400, &id); /* 4,800 prompt tokens each: 75 full steps */
        add_flood(s, "b", 12, 400, &id);
        steps_for(s, 40, names, got);
        double share_a = (double)got[0] / (double)(got[0] + got[1]);
        printf("tenants %s: a %llu and b %llu tokens in 40 steps of 64 (a's share %.3f)\n",
               weighted ? "3:1" : "1:1", (unsigned long long)got[0], (unsigned long long)got[1],
               share_a);
        ASSERT_EQ_INT(got[0] + got[1], 40 * 64); /* every step full */
        double want = weighted ? 0.75 : 0.5;
        ASSERT_TRUE(fabs(share_a - want) <= 0.05);
        /* c arrives: it shares from now on, with no credit for the past */
        add_flood(s, "c", 4, 400, &id);
        steps_for(s, 20, names, got);
        double share_c = (double)got[2] / (double)(got[0] + got[1] + got[2]);
        printf("tenants %s: then c %llu of %llu tokens in 20 steps (share %.3f)\n",
               weighted ? "3:1" : "1:1", (unsigned long long)got[2],
               (unsigned long long)(got[0] + got[1] + got[2]), share_c);
        double want_c = weighted ? 1.0 / 5 : 1.0 / 3;
        ASSERT_TRUE(fabs(share_c - want_c) <= 0.06);
        cs_sched_free(s);
        cs_engine_free(e);
    }
    /* idle time banks no credit: a named tenant that ran alone, then went
     * idle, is not starved by one that arrived while the server was empty */
    {
        cs_engine *e = engine(4096);
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 64;
        const cs_tenant_share shares[] = {{"a", 1}, {"b", 1}};
        p.tenant_shares = shares;
        p.n_tenant_shares = 2;
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        uint64_t id = 100, got[3];
        add_flood(s, "a", 4, 400, &id);
        while (!cs_sched_idle(s))
            steps_for(s, 1, names, got);
        add_flood(s, "b", 6, 400, &id);
        steps_for(s, 1, names, got); /* b alone: it starts where a left off */
        add_flood(s, "a", 6, 400, &id);
        steps_for(s, 20, names, got);
        double share_a = (double)got[0] / (double)(got[0] + got[1]);
        printf("tenants: a back from idle gets %.3f of 20 steps beside b\n", share_a);
        ASSERT_TRUE(fabs(share_a - 0.5) <= 0.1);
        cs_sched_free(s);
        cs_engine_free(e);
    }
    /* a tenant served less takes a seat beyond max_num_partial_prefills,
     * one in all: new tenants cannot open seats without end */
    {
        cs_engine *e = engine(4096);
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 64;
        p.max_chunk_tokens = 16; /* room for four prompts' chunks a step */
        p.max_num_partial_prefills = 1;
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        uint64_t id = 200, got[3];
        static req_spec chat;
        chat.n_prompt = 4, chat.max_tokens = 200, chat.tenant = "chat";
        cs_request r = make_req(&chat, id++); /* low virtual tokens: it only decodes */
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        add_flood(s, "a", 2, 400, &id);
        steps_for(s, 3, names, got);
        for (int k = 0; k < 5; k++) {
            char t[8];
            snprintf(t, sizeof t, "t%d", k);
            add_flood(s, t, 1, 400, &id);
        }
        int32_t most = 0;
        for (int i = 0; i < 10; i++) {
            steps_for(s, 1, names, got);
            cs_step_info info;
            cs_sched_last_step(s, &info);
            if (info.n_prefill > most) most = info.n_prefill;
        }
        printf("tenants: five new tenants behind a flood: at most %d prompts a step (cap 1)\n",
               most);
        ASSERT_EQ_INT(most, 2);
        cs_sched_free(s);
        cs_engine_free(e);
    }
    /* a tenant's prompts start in its order: its short second prompt does not go
     * before its long first one (though its chunk would be due before another
     * tenant's), the tenant's candidate is its oldest */
    {
        cs_engine *e = engine(4096);
        cs_sched_params p = cs_sched_params_default();
        p.max_num_batched_tokens = 256;
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
        uint64_t id = 300;
        queue_prompts(s, "a", 0, 1, 400, &id);
        queue_prompts(s, "b", 0, 1, 400, &id);
        queue_prompts(s, "a", 0, 1, 10, &id); /* id 302 */
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0); /* b's chunk (joined last), full */
        for (int32_t i = 0; i < ne; i++)
            ASSERT_TRUE(ev[i].id != 302);
        ASSERT_EQ_INT((int)cs_sched_tenant_tokens(s, "a"), 0); /* not the short one's 10 */
        cs_sched_free(s);
        cs_engine_free(e);
    }
    /* bad shares, named */
    cs_engine *e = engine(64);
    cs_sched *s = NULL;
    cs_sched_params p = cs_sched_params_default();
    const struct {
        cs_tenant_share sh[2];
        int n;
        const char *msg;
    } bad[] = {{{{"a", 0}}, 1, "tenant 'a': share 0"},
               {{{"a", -1}}, 1, "tenant 'a': share -1"},
               {{{"a", 1e7}}, 1, "tenant 'a': share 1e+07"},
               {{{"a", 1e-4}}, 1, "tenant 'a': share 0.0001"},
               {{{"", 1}}, 1, "tenant share 0: a name"},
               {{{"a", 1}, {"a", 2}}, 2, "tenant 'a' has two shares"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        p.tenant_shares = bad[i].sh;
        p.n_tenant_shares = bad[i].n;
        ASSERT_EQ_INT(cs_sched_init(e, &p, &s), CS_EINVAL);
        ASSERT_MSG_HAS(cs_last_error(), bad[i].msg);
    }
    p.n_tenant_shares = 0;
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    static req_spec sp;
    sp.n_prompt = 4;
    sp.tenant = "a-tenant-name-that-goes-on-and-on-past-the-sixty-four-bytes-allowed";
    cs_request r = make_req(&sp, 1);
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "is longer than 64 bytes");
    cs_sched_free(s);
    cs_engine_free(e);
}

/* Priority: the tokens do not depend on it; a high-priority request behind
 * long low-priority prompts starts at the next step, taking a seat. */
static void check_priority(void) {
    static req_spec specs[MAX_REQ];
    static req_out base[MAX_REQ], other[MAX_REQ];
    make_specs(specs, MAX_REQ, false);
    cs_engine *big = engine(4096), *small = engine(small_pool);
    cs_sched_params p = cs_sched_params_default();
    run(big, &p, specs, MAX_REQ, base, false);
    for (int i = 0; i < MAX_REQ; i++)
        specs[i].priority = (int32_t)rnd(4);
    const int32_t budgets[] = {0, 64, 17};
    uint64_t by_priority = 0;
    for (size_t bi = 0; bi < sizeof budgets / sizeof budgets[0]; bi++)
        for (int tight = 0; tight < 2; tight++) {
            p.max_num_batched_tokens = budgets[bi];
            p.max_num_seqs = tight ? 4 : 256;
            run(tight ? small : big, &p, specs, MAX_REQ, other, true);
            by_priority += last_stats.priority_preemptions;
            check_same(base, other, MAX_REQ, "priorities");
        }
    ASSERT_TRUE(by_priority > 0); /* the seats were taken by preemption at least once */

    /* ten 400-token prompts of priority 5, then one of priority 0 */
    for (int seats = 0; seats < 2; seats++) {
        cs_sched *s = NULL;
        p = cs_sched_params_default();
        p.max_num_batched_tokens = 64;
        p.max_num_seqs = seats ? 2 : 256;
        p.max_num_partial_prefills = 1;
        ASSERT_EQ_INT(cs_sched_init(big, &p, &s), 0);
        static req_spec low, high;
        low.n_prompt = 400, low.max_tokens = 4, low.priority = 5;
        high.n_prompt = 20, high.max_tokens = 4, high.priority = 0;
        for (int j = 0; j < 400; j++)
            low.prompt[j] = (int32_t)rnd((uint32_t)V);
        for (int j = 0; j < 20; j++)
            high.prompt[j] = (int32_t)rnd((uint32_t)V);
        for (int i = 0; i < 10; i++) {
            cs_request r = make_req(&low, (uint64_t)i);
            ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        }
        const cs_event *ev;
        int32_t ne;
        for (int i = 0; i < 12; i++) /* the low ones are part-way through their prompts */
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_request r = make_req(&high, 100);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        bool first = false;
        for (int32_t i = 0; i < ne; i++)
            first |= ev[i].id == 100;
        ASSERT_TRUE(first);
        cs_sched_stats st;
        cs_sched_get_stats(s, &st);
        if (seats) ASSERT_TRUE(st.priority_preemptions >= 1);
        while (!cs_sched_idle(s))
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_sched_free(s);
        check_pages(big);
    }
    cs_engine_free(big);
    cs_engine_free(small);
}

/* Steps a lone request to its end; per step, the pool's used pages must be
 * exactly what its length keeps (cs_kv_cache_seq_pages: every global page,
 * the windowed ones of the last window only). Returns the most used. */
static int32_t run_accounted(cs_engine *e, cs_sched *s, const req_spec *spec, uint64_t id,
                             req_out *out) {
    cs_kv_cache *kv = cs_engine_kv(e);
    cs_request r = make_req(spec, id);
    r.logprobs = true, r.top_logprobs = 4;
    cs_sched_stats st0, st;
    cs_sched_get_stats(s, &st0);
    ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    int32_t len = 0, most = 0;
    memset(out, 0, sizeof *out);
    while (!cs_sched_idle(s)) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        cs_step_info info;
        cs_sched_last_step(s, &info);
        cs_sched_get_stats(s, &st);
        len += info.n_tokens; /* and the prefix it reused, a page each of its kinds */
        int32_t at = len + (int32_t)(st.prefix_hit_tokens - st0.prefix_hit_tokens);
        bool done = false;
        for (int32_t i = 0; i < ne; i++) {
            ASSERT_TRUE(ev[i].lp.n_top == 4);
            out->lp[out->n_out][0] = ev[i].lp.logprob;
            for (int t = 0; t < 4; t++)
                out->lp[out->n_out][1 + t] = ev[i].lp.top_logprobs[t];
            out->out[out->n_out++] = ev[i].token;
            done |= ev[i].finish != CS_FINISH_NONE;
            out->finish = ev[i].finish;
        }
        check_pages(e);
        if (done) break;
        if (cs_kv_cache_n_used(kv) != cs_kv_cache_seq_pages(kv, at))
            fprintf(stderr, "%d positions: %d pages used, %d expected\n", at,
                    cs_kv_cache_n_used(kv), cs_kv_cache_seq_pages(kv, at));
        ASSERT_EQ_INT(cs_kv_cache_n_used(kv), cs_kv_cache_seq_pages(kv, at));
        if (cs_kv_cache_n_used(kv) > most) most = cs_kv_cache_n_used(kv);
    }
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 0);
    return most;
}

/* A model with windowed layers: the pages of one long sequence stay
 * bounded in the windowed kinds, and the prefix cache's rule (a hit needs
 * the window before it: sched.c's reuse_prefix) cuts a hit back when those
 * pages were evicted, with the same tokens as a cold cache either way. */
static void check_windows(void) {
    cs_engine *e = engine(1024);
    cs_kv_cache *kv = cs_engine_kv(e);
    const int32_t W = cs_kv_cache_window(kv), per_block = cs_kv_cache_per_block(kv);
    const int32_t n_global = cs_kv_cache_n_global(kv);
    ASSERT_TRUE(W > 0 && n_global >= 1 && per_block > n_global);
    cs_sched_params p = cs_sched_params_default();
    p.max_num_batched_tokens = 16; /* one block a step */
    cs_sched *s = NULL;
    ASSERT_EQ_INT(cs_sched_init(e, &p, &s), 0);
    /* 1. accounting: a prompt of 40 windows, then 30 tokens */
    static req_spec a;
    a.n_prompt = 40 * W;
    for (int i = 0; i < a.n_prompt; i++)
        a.prompt[i] = (int32_t)rnd((uint32_t)V);
    a.max_tokens = 30;
    req_out oa;
    int32_t most = run_accounted(e, s, &a, 1, &oa);
    int32_t blocks = (a.n_prompt + a.max_tokens + 15) / 16;
    printf("windows: %d positions (%d windows) held at most %d pages; every page of every "
           "block would be %d\n",
           a.n_prompt + a.max_tokens - 1, (a.n_prompt + a.max_tokens) / W, most,
           per_block * blocks);
    ASSERT_TRUE(most <= n_global * blocks + (per_block - n_global) * ((W + 14) / 16 + 2));
    /* 2. the prefix rule. a's windowed pages went back block by block, in
     * order, so the oldest cached pages are blocks 0, 1, ...'s windowed ones.
     * Evict those of blocks 0..7 (take every free page and that many cached
     * ones, give them back). */
    const int32_t E = 8, n_take = cs_kv_cache_n_free(kv) + E * (per_block - n_global);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_take);
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, n_take, ids), 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, ids, n_take), 0);
    free(ids);
    static req_spec b, c;
    /* b: 6 full blocks shared; the window before block 6 starts in block 5,
     * evicted: cut back to nothing (each shorter hit's window is gone too) */
    b.n_prompt = 100;
    memcpy(b.prompt, a.prompt, sizeof(int32_t) * 98);
    b.prompt[98] = b.prompt[99] = 7;
    /* c: 9 full blocks; the window before block 9 lies in block 8, kept */
    c.n_prompt = 150;
    memcpy(c.prompt, a.prompt, sizeof(int32_t) * 149);
    c.prompt[149] = 5;
    b.max_tokens = c.max_tokens = 12;
    ASSERT_EQ_INT(cs_kv_cache_window_block(kv, 6 * 16), 5);
    ASSERT_EQ_INT(cs_kv_cache_window_block(kv, 9 * 16), 8);
    cs_request rb = make_req(&b, 2), rc = make_req(&c, 3);
    req_out ob = {0}, oc = {0}, cold = {0};
    int32_t hit_b = run_cached(s, &rb), hit_c = run_cached(s, &rc);
    printf("windows: prefix hits %d of b's 100 tokens (its window evicted), %d of c's 150\n", hit_b,
           hit_c);
    ASSERT_EQ_INT(hit_b, 0);
    ASSERT_EQ_INT(hit_c, 144);
    /* the same again with every page cached: a full hit for b */
    ASSERT_EQ_INT(run_cached(s, &rb), 96);
    cs_sched_free(s);
    /* the tokens and their log-probabilities: hit, cut back or cold, the same */
    cs_sched_params on = cs_sched_params_default(), off = on;
    off.enable_prefix_caching = false;
    const req_spec *sp[2] = {&b, &c};
    for (int k = 0; k < 2; k++) {
        cs_kv_cache_clear_prefixes(kv);
        ASSERT_EQ_INT(cs_sched_init(e, &on, &s), 0);
        run_accounted(e, s, &a, 10, &cold); /* warm: a's pages cached */
        run_accounted(e, s, sp[k], 11, k ? &oc : &ob);
        cs_sched_free(s);
        ASSERT_EQ_INT(cs_sched_init(e, &off, &s), 0);
        run_accounted(e, s, sp[k], 12, &cold);
        cs_sched_free(s);
        const req_out *warm = k ? &oc : &ob;
        ASSERT_EQ_INT(warm->n_out, cold.n_out);
        for (int j = 0; j < cold.n_out; j++)
            ASSERT_EQ_INT(warm->out[j], cold.out[j]);
        /* the fp32 GEMMs round by shape: close, not bitwise (the quantized
         * path's are; test_quant_engine). The tiny model repeats tokens, so
         * the log-probabilities say more than the tokens. */
        for (int j = 0; j < cold.n_out; j++)
            for (int t = 0; t < 5; t++)
                ASSERT_TRUE(fabsf(warm->lp[j][t] - cold.lp[j][t]) <= 1e-4f);
    }
    cs_engine_free(e);
}

int main(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    ASSERT_EQ_INT(cs_model_load(path, &model), 0);
    V = cs_model_get_config(model)->n_vocab;
    check_bad_requests();
    check_prompt_logprobs();
    check_prefix_cache();
    check_cache_salt();
    check_reserved_reuse();
    check_held();
    check_cancel();
    check_step_model();
    check_step_time_target();
    check_equivalence();
    check_priority();
    check_tenants();
    check_ttft();
    check_speculation();
    check_draft_model((const char *const[]){"f32", "f16", "seed2"}, 3);
    check_spec_distribution();
    check_serve();
    cs_model_free(model);
    /* a model with windowed layers (gemma3: 8-position windows on 2 of its
     * 3 layers): its pages come in three kinds a block */
    snprintf(path, sizeof path, "%s/gemma3/tiny.gguf", getenv("CS_TINY_DIR"));
    ASSERT_EQ_INT(cs_model_load(path, &model), 0);
    V = cs_model_get_config(model)->n_vocab;
    small_pool = 40;
    check_windows();
    check_prefix_cache();
    check_equivalence();
    check_speculation();
    check_draft_model((const char *const[]){"gemma3"}, 1);
    cs_model_free(model);
    return 0;
}
