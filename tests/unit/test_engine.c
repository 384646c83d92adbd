/* test_engine: the paged, ragged engine on the tiny models.
 * - chunked prefill = one-pass prefill (last-token logits, every KV page,
 *   32 greedy tokens) for many prompt lengths, chunk sizes and page sizes;
 * - one-pass engine = reference forward pass (cs_ref_seq);
 *   (the Llama block, Qwen2's biases, and Gemma 3's: QK-norm, sandwich norms,
 *   GeGLU, 8-position windows on 2 of 3 layers);
 * - batch invariance: 8 sequences in mixed steps under random budgets give
 *   the tokens each gives alone (greedy and seeded sampling);
 * - page accounting, pool exhaustion and bad steps. */
#include <stdlib.h>

#include "chunkserve/engine.h"
#include "chunkserve/refeval.h"
#include "chunkserve/sampler.h"
#include "test.h"

static cs_model *load(const char *variant) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/tiny.gguf", getenv("CS_TINY_DIR"), variant);
    cs_model *m = NULL;
    int r = cs_model_load(path, &m);
    if (r) fprintf(stderr, "%s: %s\n", path, cs_last_error());
    ASSERT_EQ_INT(r, 0);
    return m;
}

static cs_engine *engine(const cs_model *m, int page_size, int n_pages, int threads) {
    cs_engine_params p = cs_engine_params_default();
    p.page_size = page_size;
    p.n_pages = n_pages;
    p.n_threads = threads;
    cs_engine *e = NULL;
    ASSERT_EQ_INT(cs_engine_init(m, &p, &e), 0);
    return e;
}

static double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++)
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static int32_t argmax(const float *v, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* Prefill prompt in chunks, then greedy-decode n_gen tokens. Returns the
 * prompt's last logits in last, the pages in kv_out (export of the prompt's
 * pages), the generated tokens in gen. */
static void run_one(cs_engine *e, const int32_t *prompt, int32_t n, int32_t chunk, float *last,
                    float *kv_out, int32_t *gen, int n_gen) {
    const cs_model *m = cs_engine_model(e);
    int32_t V = cs_model_get_config(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    cs_page_table pt = {0};
    ASSERT_EQ_INT(cs_engine_eval_seq(e, &pt, 0, prompt, n, chunk, logits), 0);
    memcpy(last, logits, sizeof(float) * (size_t)V);
    if (kv_out) { /* the pages it keeps, in a KV transfer's order */
        cs_kv_cache *kv = cs_engine_kv(e);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)cs_kv_cache_seq_pages(kv, n));
        int32_t n_ids = cs_page_table_xfer(&pt, kv, n, 0, pt.n_pages, ids);
        ASSERT_EQ_INT(n_ids, cs_kv_cache_seq_pages(kv, n));
        ASSERT_EQ_INT(cs_engine_kv_export(e, ids, n_ids, kv_out), 0);
        free(ids);
    }
    for (int i = 0; i < n_gen; i++) {
        gen[i] = argmax(logits, V);
        ASSERT_EQ_INT(cs_engine_eval_seq(e, &pt, n + i, &gen[i], 1, 0, logits), 0);
    }
    cs_page_table_release(&pt, cs_engine_kv(e));
    free(logits);
}

/* Compares pages exported in a transfer's order over the positions [0, n)
 * only (the tail of the last block is unwritten). Layout: page after page
 * (block by block, its kinds in order, the windowed ones only in the window
 * the next query sees), each [kv_layers][K,V][page_size][kv_dim]. */
static double kv_rel_err(const float *a, const float *b, cs_engine *e, int page_size, int32_t n) {
    const cs_model_config *c = cs_model_get_config(cs_engine_model(e));
    const cs_kv_cache *kvc = cs_engine_kv(e);
    const size_t kvd = (size_t)c->n_kv_heads * c->head_dim, L = (size_t)cs_engine_kv_layers(e);
    const int32_t wb = cs_kv_cache_window_block(kvc, n);
    double s_num = 0, s_den = 0;
    size_t page = 0;
    for (int32_t blk = 0; blk * page_size < n; blk++)
        for (int32_t j = 0; j < cs_kv_cache_per_block(kvc); j++) {
            if (j >= cs_kv_cache_n_global(kvc) && blk < wb) continue;
            for (int32_t slot = 0; slot < page_size && blk * page_size + slot < n; slot++)
                for (size_t l = 0; l < L; l++)
                    for (int kv = 0; kv < 2; kv++) {
                        size_t off = (((page * L + l) * 2 + kv) * page_size + slot) * kvd;
                        for (size_t i = 0; i < kvd; i++) {
                            double d = (double)a[off + i] - b[off + i];
                            s_num += d * d, s_den += (double)b[off + i] * b[off + i];
                        }
                    }
            page++;
        }
    return sqrt(s_num / (s_den > 0 ? s_den : 1));
}

static void check_chunked_equals_one_pass(const char *variant, int page_size) {
    cs_model *m = load(variant);
    const cs_model_config *c = cs_model_get_config(m);
    cs_engine *e = engine(m, page_size, 4096 / page_size * 8, 2);
    int32_t V = c->n_vocab;
    const int32_t lens[] = {1, 2, 15, 16, 17, 33, 100, 257, 700};
    const int32_t chunks[] = {1, 2, 15, 16, 17, 64, 100, 256, 0};
    enum { GEN = 32 };
    int32_t *prompt = malloc(sizeof(int32_t) * 700);
    for (int i = 0; i < 700; i++)
        prompt[i] = (int32_t)rnd((uint32_t)V);
    size_t kv_floats = cs_engine_page_bytes(e) / sizeof(float) *
                       (size_t)cs_kv_cache_seq_pages(cs_engine_kv(e), 700 + GEN + page_size);
    float *ref_last = malloc(sizeof(float) * V), *last = malloc(sizeof(float) * V);
    float *ref_kv = malloc(sizeof(float) * kv_floats), *kv = malloc(sizeof(float) * kv_floats);
    int32_t ref_gen[GEN], gen[GEN];
    double worst_logit = 0, worst_kv = 0;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int32_t n = lens[li];
        run_one(e, prompt, n, 0, ref_last, ref_kv, ref_gen, GEN);
        /* the one-pass engine against the reference forward pass */
        cs_ref_seq *rs = NULL;
        float *rl = malloc(sizeof(float) * V);
        ASSERT_EQ_INT(cs_ref_seq_init(m, n, &rs), 0);
        ASSERT_EQ_INT(cs_ref_seq_eval(rs, prompt, n, false, rl), 0);
        double er = rel_err(ref_last, rl, (size_t)V);
        ASSERT_TRUE(er <= 1e-5);
        cs_ref_seq_free(rs);
        free(rl);
        for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
            if (chunks[ci] >= n) continue; /* same as one pass */
            run_one(e, prompt, n, chunks[ci], last, kv, gen, GEN);
            double el = rel_err(last, ref_last, (size_t)V),
                   ek = kv_rel_err(kv, ref_kv, e, page_size, n);
            if (el > worst_logit) worst_logit = el;
            if (ek > worst_kv) worst_kv = ek;
            if (el > 1e-5 || ek > 1e-5)
                fprintf(stderr, "len %d chunk %d: logits rel %g, kv rel %g\n", n, chunks[ci], el,
                        ek);
            ASSERT_TRUE(el <= 1e-5);
            ASSERT_TRUE(ek <= 1e-5);
            for (int i = 0; i < GEN; i++)
                ASSERT_EQ_INT(gen[i], ref_gen[i]);
        }
    }
    printf("%-6s page %2d: chunked vs one pass over %zu lengths x %zu chunk sizes: worst logits "
           "rel %.3g, "
           "worst KV rel %.3g, 32 greedy tokens identical\n",
           variant, page_size, sizeof lens / sizeof lens[0], sizeof chunks / sizeof chunks[0],
           worst_logit, worst_kv);
    ASSERT_EQ_INT(cs_kv_cache_n_free(cs_engine_kv(e)), cs_kv_cache_n_pages(cs_engine_kv(e)));
    free(prompt), free(ref_last), free(last), free(ref_kv), free(kv);
    cs_engine_free(e);
    cs_model_free(m);
}

/* ---- batch invariance ---- */
enum { N_SEQ = 8, N_GEN = 24 };
typedef struct {
    int32_t prompt[400];
    int32_t n_prompt;
    int32_t done;       /* prompt tokens already evaluated */
    int32_t out[N_GEN]; /* generated tokens */
    int32_t n_out;
    cs_page_table pt;
    cs_sampler *smp;
    int32_t next;  /* token to feed at the next decode */
    uint64_t seed; /* sampling seed: the sequence's own, wherever it runs */
} seq;

static void run_seqs(cs_engine *e, seq *s, int n_seq, bool sampled, bool mixed) {
    int32_t V = cs_model_get_config(cs_engine_model(e))->n_vocab;
    cs_kv_cache *kv = cs_engine_kv(e);
    float *logits = malloc(sizeof(float) * (size_t)V * n_seq);
    for (int i = 0; i < n_seq; i++) {
        cs_sampling_params p = cs_sampling_params_default();
        if (sampled) p.temperature = 0.9f, p.top_p = 0.95f, p.top_k = 40, p.seed = s[i].seed;
        ASSERT_EQ_INT(cs_sampler_init(&p, V, &s[i].smp), 0);
        s[i].done = s[i].n_out = 0;
        memset(&s[i].pt, 0, sizeof s[i].pt);
    }
    int32_t alive = n_seq;
    while (alive) {
        /* decodes first, then prompt chunks fill the budget (Sarathi style) */
        int32_t budget = mixed ? 1 + (int32_t)rnd(96) : 1 << 20, used = 0;
        cs_span spans[N_SEQ];
        int owner[N_SEQ], n_spans = 0;
        for (int i = 0; i < n_seq && used < budget; i++)
            if (s[i].done == s[i].n_prompt && s[i].n_out < N_GEN) {
                int32_t pos = s[i].n_prompt + s[i].n_out - 1;
                ASSERT_EQ_INT(cs_page_table_reserve(&s[i].pt, kv, pos, pos + 1), 0);
                spans[n_spans] = (cs_span){&s[i].next,      1,    pos,         s[i].pt.pages,
                                           s[i].pt.n_pages, true, s[i].pt.cap};
                owner[n_spans++] = i;
                used++;
            }
        for (int i = 0; i < n_seq && used < budget; i++)
            if (s[i].done < s[i].n_prompt) {
                int32_t k = s[i].n_prompt - s[i].done;
                if (k > budget - used) k = budget - used;
                ASSERT_EQ_INT(cs_page_table_reserve(&s[i].pt, kv, s[i].done, s[i].done + k), 0);
                spans[n_spans] = (cs_span){s[i].prompt + s[i].done,
                                           k,
                                           s[i].done,
                                           s[i].pt.pages,
                                           s[i].pt.n_pages,
                                           s[i].done + k == s[i].n_prompt,
                                           s[i].pt.cap};
                owner[n_spans++] = i;
                used += k;
            }
        ASSERT_TRUE(n_spans > 0 && used <= budget);
        ASSERT_EQ_INT(cs_engine_step(e, spans, n_spans, logits), 0);
        int li = 0;
        for (int k = 0; k < n_spans; k++) {
            seq *q = &s[owner[k]];
            bool was_prompt = q->done < q->n_prompt;
            if (was_prompt) q->done += spans[k].n_tokens;
            if (!spans[k].n_logits) continue;
            int32_t id = cs_sampler_sample(q->smp, logits + (size_t)li++ * V, 0, NULL);
            cs_sampler_accept(q->smp, id);
            q->out[q->n_out++] = id;
            q->next = id;
            if (q->n_out == N_GEN) {
                cs_page_table_release(&q->pt, kv);
                alive--;
            }
        }
    }
    for (int i = 0; i < n_seq; i++)
        cs_sampler_free(s[i].smp);
    free(logits);
}

static void check_batch_invariance(const char *variant) {
    cs_model *m = load(variant);
    int32_t V = cs_model_get_config(m)->n_vocab;
    cs_engine *e = engine(m, 16, 1024, 2);
    static seq together[N_SEQ], alone[N_SEQ];
    for (int sampled = 0; sampled < 2; sampled++) {
        for (int i = 0; i < N_SEQ; i++) {
            together[i].n_prompt = 1 + (int32_t)rnd(380);
            together[i].seed = 1000 + (uint64_t)i;
            for (int j = 0; j < together[i].n_prompt; j++)
                together[i].prompt[j] = (int32_t)rnd((uint32_t)V);
            alone[i] = together[i];
        }
        run_seqs(e, together, N_SEQ, sampled, true);
        for (int i = 0; i < N_SEQ; i++)
            run_seqs(e, &alone[i], 1, sampled, false);
        for (int i = 0; i < N_SEQ; i++)
            for (int j = 0; j < N_GEN; j++)
                ASSERT_EQ_INT(together[i].out[j], alone[i].out[j]);
        printf("%-6s batch invariance (%s): 8 sequences x %d tokens, mixed steps = alone\n",
               variant, sampled ? "seeded sampling" : "greedy", N_GEN);
    }
    ASSERT_EQ_INT(cs_kv_cache_n_free(cs_engine_kv(e)), cs_kv_cache_n_pages(cs_engine_kv(e)));
    cs_engine_free(e);
    cs_model_free(m);
}

/* ---- pages and bad input ---- */
static void check_pages(void) {
    cs_model *m = load("f32");
    int32_t V = cs_model_get_config(m)->n_vocab;
    cs_engine *e = engine(m, 16, 8, 1);
    cs_kv_cache *kv = cs_engine_kv(e);
    float *logits = malloc(sizeof(float) * (size_t)V);
    int32_t toks[200];
    for (int i = 0; i < 200; i++)
        toks[i] = i % V;
    cs_page_table a = {0}, b = {0};
    ASSERT_EQ_INT(cs_engine_eval_seq(e, &a, 0, toks, 100, 32, logits), 0); /* 7 pages */
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), 1);
    ASSERT_EQ_INT(cs_engine_eval_seq(e, &b, 0, toks, 40, 0, logits), CS_ENOSPC); /* needs 3 */
    ASSERT_MSG_HAS(cs_last_error(), "pages wanted");
    ASSERT_EQ_INT(b.n_pages, 0);
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), 1);
    cs_page_table_release(&b, kv); /* the table's array may have grown */
    /* bad steps change nothing */
    cs_span bad = {toks, 5, 0, a.pages, a.n_pages, true, a.cap};
    int32_t badtok[2] = {0, V};
    bad.tokens = badtok, bad.n_tokens = 2;
    ASSERT_EQ_INT(cs_engine_step(e, &bad, 1, logits), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "outside the vocabulary");
    bad.tokens = toks, bad.n_tokens = 20, bad.pos = 100;
    ASSERT_EQ_INT(cs_engine_step(e, &bad, 1, logits), CS_EINVAL); /* 120 > 7 pages * 16 */
    ASSERT_MSG_HAS(cs_last_error(), "pages hold");
    int32_t freed_page[1] = {7};
    bad.pages = freed_page, bad.n_pages = 1, bad.pos = 0, bad.n_tokens = 3;
    ASSERT_EQ_INT(cs_engine_step(e, &bad, 1, logits), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "not an allocated page");
    bad.n_tokens = 0;
    ASSERT_EQ_INT(cs_engine_step(e, &bad, 1, logits), CS_EINVAL);
    ASSERT_EQ_INT(cs_engine_step(e, &bad, 0, logits), CS_EINVAL);
    /* export / import round trip through another page */
    size_t pb = cs_engine_page_bytes(e);
    char *buf = malloc(pb * 2), *buf2 = malloc(pb);
    ASSERT_EQ_INT(cs_engine_kv_export(e, a.pages, 2, buf), 0);
    int32_t spare;
    ASSERT_EQ_INT(cs_kv_cache_alloc_pages(kv, 1, &spare), 0);
    ASSERT_EQ_INT(cs_engine_kv_import(e, &spare, 1, buf + pb), 0);
    ASSERT_EQ_INT(cs_engine_kv_export(e, &spare, 1, buf2), 0);
    ASSERT_TRUE(memcmp(buf + pb, buf2, pb) == 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &spare, 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &spare, 1), CS_EINVAL); /* double free refused */
    ASSERT_EQ_INT(cs_engine_kv_export(e, &spare, 1, buf2), CS_EINVAL);
    /* shared pages: a reference keeps a page alive */
    ASSERT_EQ_INT(cs_kv_cache_ref_page(kv, a.pages[0]), 0);
    int32_t first = a.pages[0];
    cs_page_table_release(&a, kv);
    ASSERT_EQ_INT(cs_kv_cache_refcount(kv, first), 1);
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), 7);
    ASSERT_EQ_INT(cs_kv_cache_free_pages(kv, &first, 1), 0);
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), 8);
    free(buf), free(buf2), free(logits);
    cs_engine_free(e);
    cs_model_free(m);
}

int main(void) {
    check_pages();
    check_chunked_equals_one_pass("f32", 16);
    check_chunked_equals_one_pass("f32", 7);
    check_chunked_equals_one_pass("qwen2", 16);
    check_chunked_equals_one_pass("gemma3", 16); /* windows of 8 positions */
    check_chunked_equals_one_pass("gemma3", 5);
    check_batch_invariance("f32");
    check_batch_invariance("qwen2");
    check_batch_invariance("gemma3");
    return 0;
}
