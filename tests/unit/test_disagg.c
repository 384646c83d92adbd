/* test_disagg: disaggregated prefill at the scheduler level, on the tiny
 * model, with no network: a prefill scheduler (CS_KV_PREFILL_ONLY) on one
 * engine, a decode scheduler (CS_KV_REMOTE) on another, pages copied with
 * kv export/import as each step reports them. Checks:
 * - the tokens equal those of one local scheduler, greedy and sampled, for
 *   any prefill chunk size, with pages arriving in step-sized pieces; so do
 *   their logprobs and alternatives (the first token's come from the prefill
 *   side, as the KV trailer carries them);
 * - pages are reported in order, each exactly once, covering the prompt;
 * - resumed (migrated) requests continue exactly where the original was;
 * - admission by free pages (reserve): CS_ENOSPC changes nothing;
 * - cancelling a request waiting for its KV frees its pages. */
#include <stdlib.h>

#include "chunkserve/sched.h"
#include "test.h"

static cs_model *model;
static int32_t V;

static uint64_t rng = 0x2545F4914F6CDD1Dull;
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

enum { N_REQ = 12, MAX_PROMPT = 300, MAX_GEN = 24 };
typedef struct {
    int32_t prompt[MAX_PROMPT + MAX_GEN];
    int32_t n_prompt, max_tokens;
    bool sampled;
    int32_t out[MAX_GEN + 1];
    cs_logprobs lp[MAX_GEN + 1];
    int32_t n_out;
} req;

static cs_request make_req(const req *q, uint64_t id) {
    cs_request r = {0};
    r.id = id;
    r.prompt = q->prompt;
    r.n_prompt = q->n_prompt;
    r.sampling = cs_sampling_params_default();
    if (q->sampled)
        r.sampling.temperature = 0.9f, r.sampling.top_k = 40, r.sampling.seed = 1000 + id;
    r.stop.max_tokens = q->max_tokens;
    r.stop.ignore_eos = true;
    r.logprobs = true;
    r.top_logprobs = (int32_t)(id % 4) * 3; /* 0, 3, 6, 9 alternatives */
    return r;
}

/* Reference: every request through one local scheduler. */
static void run_local(cs_engine *e, req *reqs, int n) {
    cs_sched_params sp = cs_sched_params_default();
    sp.max_num_batched_tokens = 96;
    cs_sched *s = NULL;
    ASSERT_EQ_INT(cs_sched_init(e, &sp, &s), 0);
    for (int i = 0; i < n; i++) {
        cs_request r = make_req(&reqs[i], (uint64_t)i);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        reqs[i].n_out = 0;
    }
    while (!cs_sched_idle(s)) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        for (int32_t i = 0; i < ne; i++) {
            req *q = &reqs[ev[i].id];
            q->lp[q->n_out] = ev[i].lp;
            q->out[q->n_out++] = ev[i].token;
        }
    }
    cs_sched_free(s);
}

/* The same requests disaggregated: prefill on P (budget chunk, or a large
 * budget with each prompt's chunk capped at cap), decode on D. */
static void run_disagg(cs_engine *P, cs_engine *D, const req *reqs, int n, int32_t chunk,
                       int32_t cap) {
    cs_sched_params pp = cs_sched_params_default(), dp = cs_sched_params_default();
    pp.max_num_batched_tokens = chunk;
    pp.max_chunk_tokens = cap;
    dp.max_num_batched_tokens = 32;
    cs_sched *sp = NULL, *sd = NULL;
    ASSERT_EQ_INT(cs_sched_init(P, &pp, &sp), 0);
    ASSERT_EQ_INT(cs_sched_init(D, &dp, &sd), 0);
    size_t pb = cs_engine_page_bytes(P);
    ASSERT_EQ_INT((int)pb, (int)cs_engine_page_bytes(D));
    const int32_t ps = cs_kv_cache_page_size(cs_engine_kv(P));
    static int32_t n_got[N_REQ], reported[N_REQ], out[N_REQ][MAX_GEN + 1];
    static cs_logprobs lps[N_REQ][MAX_GEN + 1];
    static const int32_t *dst[N_REQ];
    static int32_t n_dst[N_REQ];
    int finished = 0;
    for (int i = 0; i < n; i++) {
        cs_request r = make_req(&reqs[i], (uint64_t)i);
        r.kv_mode = CS_KV_REMOTE;
        ASSERT_EQ_INT(cs_sched_add(sd, &r), 0);
        ASSERT_EQ_INT(cs_sched_kv_pages(sd, (uint64_t)i, &dst[i], &n_dst[i]), 0);
        ASSERT_EQ_INT(n_dst[i], (reqs[i].n_prompt + ps - 1) / ps);
        r.kv_mode = CS_KV_PREFILL_ONLY;
        ASSERT_EQ_INT(cs_sched_add(sp, &r), 0);
        n_got[i] = reported[i] = 0;
    }
    cs_sched_stats st;
    cs_sched_get_stats(sd, &st);
    ASSERT_EQ_INT(st.n_waiting_kv, n);
    void *buf = malloc(pb * 64);
    int guard = 0;
    while (finished < n) {
        ASSERT_TRUE(++guard < 100000);
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(sp, &ev, &ne), 0);
        cs_step_info info;
        cs_sched_last_step(sp, &info);
        if (cap) ASSERT_TRUE(info.n_tokens <= cap * pp.max_num_partial_prefills);
        for (int32_t k = 0; k < ne; k++) {
            int i = (int)ev[k].id;
            if (ev[k].kv_n_pages) { /* in order, once each, then copied over */
                ASSERT_EQ_INT(ev[k].kv_first_page, reported[i]);
                ASSERT_TRUE(ev[k].kv_first_page + ev[k].kv_n_pages <= n_dst[i]);
                for (int32_t c = 0; c < ev[k].kv_n_pages; c += 64) {
                    int32_t m = ev[k].kv_n_pages - c < 64 ? ev[k].kv_n_pages - c : 64;
                    ASSERT_EQ_INT(cs_engine_kv_export(P, ev[k].kv_pages + c, m, buf), 0);
                    ASSERT_EQ_INT(cs_engine_kv_import(D, dst[i] + ev[k].kv_first_page + c, m, buf),
                                  0);
                }
                reported[i] += ev[k].kv_n_pages;
            }
            if (ev[k].token >= 0) { /* the first token: the prompt's KV is all there */
                ASSERT_EQ_INT(ev[k].finish, CS_FINISH_LENGTH);
                ASSERT_EQ_INT(reported[i], n_dst[i]);
                ASSERT_EQ_INT(cs_sched_kv_ready(sd, ev[k].id, ev[k].token,
                                                ev[k].n_cached_prompt_tokens, &ev[k].lp),
                              0);
            }
        }
        ASSERT_EQ_INT(cs_sched_step(sd, &ev, &ne), 0);
        for (int32_t k = 0; k < ne; k++) {
            int i = (int)ev[k].id;
            ASSERT_TRUE(ev[k].token >= 0 && n_got[i] <= MAX_GEN);
            lps[i][n_got[i]] = ev[k].lp;
            out[i][n_got[i]++] = ev[k].token;
            if (ev[k].finish) finished++;
        }
    }
    for (int i = 0; i < n; i++) {
        ASSERT_EQ_INT(n_got[i], reqs[i].n_out);
        for (int j = 0; j < n_got[i]; j++) {
            ASSERT_EQ_INT(out[i][j], reqs[i].out[j]);
            /* chunking changes the logits' bits only within the CPU tolerance */
            const cs_logprobs *a = &lps[i][j], *b = &reqs[i].lp[j];
            ASSERT_NEAR(a->logprob, b->logprob, 1e-3);
            ASSERT_EQ_INT(a->n_top, (i % 4) * 3);
            ASSERT_EQ_INT(b->n_top, a->n_top);
            for (int32_t k = 0; k < a->n_top; k++)
                ASSERT_NEAR(a->top_logprobs[k], b->top_logprobs[k], 1e-3);
            if (a->n_top) ASSERT_EQ_INT(a->top_ids[0], b->top_ids[0]);
        }
    }
    free(buf);
    const cs_event *ev;
    int32_t ne;
    ASSERT_EQ_INT(cs_sched_step(sp, &ev, &ne), 0); /* releases the last reported pages */
    ASSERT_TRUE(cs_sched_idle(sp) && cs_sched_idle(sd));
    cs_sched_free(sp);
    cs_sched_free(sd);
    ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(P)), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(D)), 0);
    ASSERT_EQ_INT(cs_kv_cache_check(cs_engine_kv(D)), 0);
}

/* A migrated request (prompt + the first k tokens it generated, resumed)
 * continues with exactly the tokens the original produced after k. */
static void check_resume(cs_engine *e, const req *reqs, int n) {
    cs_sched_params sp = cs_sched_params_default();
    sp.max_num_batched_tokens = 64;
    for (int i = 0; i < n; i++) {
        const req *q = &reqs[i];
        int32_t k = q->n_out / 2;
        if (k < 1 || k >= q->max_tokens) continue;
        req m = *q;
        memcpy(m.prompt + q->n_prompt, q->out, sizeof(int32_t) * (size_t)k);
        cs_request r = make_req(&m, (uint64_t)i);
        r.n_prompt = q->n_prompt + k;
        r.n_resumed = k;
        cs_sched *s = NULL;
        ASSERT_EQ_INT(cs_sched_init(e, &sp, &s), 0);
        ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
        int32_t got = k;
        while (!cs_sched_idle(s)) {
            const cs_event *ev;
            int32_t ne;
            ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
            for (int32_t j = 0; j < ne; j++) {
                ASSERT_TRUE(got < q->n_out);
                ASSERT_EQ_INT(ev[j].token, q->out[got]);
                got++;
                ASSERT_EQ_INT(ev[j].n_prompt_tokens, q->n_prompt);
                ASSERT_EQ_INT(ev[j].n_completion_tokens, got);
            }
        }
        ASSERT_EQ_INT(got, q->n_out);
        cs_sched_free(s);
    }
    /* nothing left to generate is a bad request */
    cs_sched *s = NULL;
    ASSERT_EQ_INT(cs_sched_init(e, &sp, &s), 0);
    req m = reqs[0];
    memcpy(m.prompt + m.n_prompt, m.out, sizeof(int32_t) * (size_t)m.max_tokens);
    cs_request r = make_req(&m, 1);
    r.n_prompt = m.n_prompt + m.max_tokens;
    r.n_resumed = m.max_tokens;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_EINVAL);
    cs_sched_free(s);
}

/* Admission by free pages, and cancellation while the KV is awaited. */
static void check_reserve(void) {
    cs_engine *e = engine(20);
    cs_kv_cache *kv = cs_engine_kv(e);
    cs_sched *s = NULL;
    cs_sched_params sp = cs_sched_params_default();
    ASSERT_EQ_INT(cs_sched_init(e, &sp, &s), 0);
    static int32_t prompt[200];
    for (int i = 0; i < 200; i++)
        prompt[i] = (int32_t)rnd((uint32_t)V);
    cs_request r = {0};
    r.prompt = prompt;
    r.n_prompt = 200; /* 13 pages of 16 */
    r.sampling = cs_sampling_params_default();
    r.stop.max_tokens = 4;
    r.kv_mode = CS_KV_REMOTE;
    r.logprobs = true;
    r.top_logprobs = 2;
    r.id = 1;
    ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 13);
    r.id = 2;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_ENOSPC); /* 7 left */
    r.kv_mode = CS_KV_LOCAL;
    r.reserve = true;
    ASSERT_EQ_INT(cs_sched_add(s, &r), CS_ENOSPC);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 13);
    ASSERT_EQ_INT(cs_kv_cache_check(kv), 0);
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, V, 0, NULL), CS_EINVAL); /* outside the vocabulary */
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, 3, -1, NULL), CS_EINVAL);
    ASSERT_TRUE(strstr(cs_last_error(), "cached tokens") != NULL);
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, 3, r.n_prompt + 1, NULL), CS_EINVAL);
    ASSERT_TRUE(strstr(cs_last_error(), "cached tokens") != NULL);
    cs_logprobs lp = {.logprob = -1, .n_top = 2, .top_ids = {3, V}, .top_logprobs = {-1, -2}};
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, 3, 0, NULL), CS_EINVAL); /* logprobs asked, none came */
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, 3, 0, &lp), CS_EINVAL);  /* an alternative outside */
    lp.n_top = 3;
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, 3, 0, &lp), CS_EINVAL); /* more than asked */
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 9, 1, 0, NULL), CS_ENOENT);
    ASSERT_TRUE(cs_sched_idle(s)); /* waiting for KV is not work */
    ASSERT_EQ_INT(cs_sched_cancel(s, 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 0);
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 1, 1, 0, NULL), CS_ENOENT);
    /* a migrated stream (50 of the 200 tokens resumed): the prefill worker's
     * cache may cover resumed tokens too, never the whole context */
    r.id = 3;
    r.n_resumed = 50;
    r.stop.max_tokens = 60;
    r.logprobs = false;
    r.kv_mode = CS_KV_REMOTE;
    r.reserve = false;
    ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 3, 3, 200, NULL), CS_EINVAL);
    ASSERT_EQ_INT(cs_sched_kv_ready(s, 3, 3, 176, NULL), 0);
    ASSERT_EQ_INT(cs_sched_cancel(s, 3), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 0);
    r.n_resumed = 0;
    r.stop.max_tokens = 4;
    r.logprobs = true;
    r.kv_mode = CS_KV_LOCAL;
    r.reserve = true;
    r.id = 2;
    /* a reserved local request runs normally from its reserved pages */
    r.n_prompt = 100;
    ASSERT_EQ_INT(cs_sched_add(s, &r), 0);
    const int32_t *pg;
    int32_t np;
    ASSERT_EQ_INT(cs_sched_kv_pages(s, 2, &pg, &np), 0);
    ASSERT_EQ_INT(np, 7);
    int n_ev = 0;
    while (!cs_sched_idle(s)) {
        const cs_event *ev;
        int32_t ne;
        ASSERT_EQ_INT(cs_sched_step(s, &ev, &ne), 0);
        n_ev += ne;
    }
    ASSERT_EQ_INT(n_ev, 4);
    ASSERT_EQ_INT(cs_kv_cache_n_used(kv), 0);
    cs_sched_free(s);
    cs_engine_free(e);
}

int main(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    ASSERT_EQ_INT(cs_model_load(path, &model), 0);
    V = cs_model_get_config(model)->n_vocab;
    static req reqs[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        reqs[i].n_prompt = 1 + (int32_t)rnd(MAX_PROMPT);
        for (int j = 0; j < reqs[i].n_prompt; j++)
            reqs[i].prompt[j] = (int32_t)rnd((uint32_t)V);
        reqs[i].max_tokens = 1 + (int32_t)rnd(MAX_GEN);
        reqs[i].sampled = i % 2;
    }
    reqs[1].n_prompt = 32; /* page-aligned prompts */
    reqs[2].n_prompt = 1;
    cs_engine *L = engine(400), *P = engine(400), *D = engine(400);
    run_local(L, reqs, N_REQ);
    const int32_t chunks[] = {0, 7, 16, 50, 128};
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++)
        run_disagg(P, D, reqs, N_REQ, chunks[c], 0);
    run_disagg(P, D, reqs, N_REQ, 8192, 48); /* a prefill pool: large budget, capped chunks */
    check_resume(L, reqs, N_REQ);
    check_reserve();
    cs_engine_free(L), cs_engine_free(P), cs_engine_free(D);
    cs_model_free(model);
    return 0;
}
