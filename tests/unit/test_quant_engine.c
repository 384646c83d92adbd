/* test_quant_engine: the engine in quant mode (the integer kernels of
 * kernels/cpu/qmat.h) on the tiny Q4_0 / Q4_1 / Q8_0 models, compared with
 * memcmp, never a tolerance (the legacy types and, written by mktiny with
 * rows of whole super-blocks, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and a qwen2
 * model mixing Q5_0 with a Q4_K ffn_down):
 * - chunked prefill == one pass for chunks 1, 2, 15, 16, 17, 64, 100, 256,
 *   512 of a 600-token prompt: last logits and every KV page (a tiny Gemma 3
 *   too: windows of 8 positions, so every chunk straddles a window edge);
 * - a sequence alone == the same sequence inside steps with 1..31 random
 *   co-tenants (prompt chunks and decode tokens), its logits at every step;
 * - 1 thread == 2 threads;
 * all with fp32 and with bf16 KV pages;
 * - the mode is what was asked: AUTO picks quant for these files, EXACT fp32,
 *   and the reference forward refuses a quant model. */
#include <stdlib.h>

#include "chunkserve/engine.h"
#include "chunkserve/refeval.h"
#include "test.h"

static cs_model *load(const char *variant, cs_weight_mode mode) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/tiny.gguf", getenv("CS_TINY_DIR"), variant);
    cs_model *m = NULL;
    int r = cs_model_load_mode(path, mode, &m);
    if (r) fprintf(stderr, "%s: %s\n", path, cs_last_error());
    ASSERT_EQ_INT(r, 0);
    return m;
}

static bool g_kv_bf16; /* the engines below hold bf16 KV pages */
static bool g_real;    /* a real model: fewer chunk sizes (each 1-token step reads it all) */

static cs_engine *engine(const cs_model *m, int threads) {
    cs_engine_params p = cs_engine_params_default();
    p.kv_bf16 = g_kv_bf16;
    p.page_size = 16;
    p.n_pages = 2048;
    p.n_threads = threads;
    cs_engine *e = NULL;
    ASSERT_EQ_INT(cs_engine_init(m, &p, &e), 0);
    return e;
}

static uint64_t rng = 0x853c49e6748fea9bull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static int32_t PROMPT = 600; /* CS_QUANT_PROMPT for a real model */

/* Pages exported in a KV transfer's order (block by block, each block's
 * kinds, the windowed ones only in the last window), each [kv_layers][K, V]
 * [16 slots][kv_dim], compared over positions [0, PROMPT) (the last block's
 * tail holds whatever its previous user left). */
static bool kv_equal(const char *a, const char *b, cs_engine *e, size_t page_bytes) {
    const cs_model_config *c = cs_model_get_config(cs_engine_model(e));
    const cs_kv_cache *kv = cs_engine_kv(e);
    size_t slot = (size_t)c->n_kv_heads * c->head_dim * (g_kv_bf16 ? 2 : sizeof(float));
    const int32_t n_blocks = (PROMPT + 15) / 16, wb = cs_kv_cache_window_block(kv, PROMPT);
    size_t p = 0;
    for (int32_t blk = 0; blk < n_blocks; blk++)
        for (int32_t j = 0; j < cs_kv_cache_per_block(kv); j++) {
            if (j >= cs_kv_cache_n_global(kv) && blk < wb) continue;
            int used = blk == n_blocks - 1 && PROMPT % 16 ? PROMPT % 16 : 16;
            for (int l = 0; l < cs_engine_kv_layers(e) * 2; l++) {
                size_t off = p * page_bytes + (size_t)l * 16 * slot;
                if (memcmp(a + off, b + off, (size_t)used * slot)) return false;
            }
            p++;
        }
    return true;
}

static void check_chunks(cs_model *m, int32_t V) {
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)PROMPT);
    for (int i = 0; i < PROMPT; i++)
        prompt[i] = (int32_t)rnd((uint32_t)V);
    cs_engine *e = engine(m, 2);
    size_t page_bytes = cs_engine_page_bytes(e);
    int32_t n_pages = cs_kv_cache_seq_pages(cs_engine_kv(e), PROMPT); /* what it keeps */
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_pages);
    float *l0 = malloc(sizeof(float) * (size_t)V), *l1 = malloc(sizeof(float) * (size_t)V);
    char *kv0 = calloc((size_t)n_pages, page_bytes), *kv1 = calloc((size_t)n_pages, page_bytes);
    ASSERT_TRUE(l0 && l1 && kv0 && kv1 && ids);
    int32_t chunks[16] = {0, 16, 17, 100, 15, 512, 1, 2, 64, 256};
    size_t n_chunks = g_real ? 4 : 10;
    const char *list = getenv("CS_QUANT_CHUNKS"); /* "1,7,256": chunk sizes after one pass */
    for (n_chunks = list ? 1 : n_chunks; list && *list && n_chunks < 16; n_chunks++) {
        chunks[n_chunks] = (int32_t)strtol(list, (char **)&list, 10);
        ASSERT_TRUE(chunks[n_chunks] > 0 && chunks[n_chunks] < PROMPT);
        list += *list == ',';
    }
    for (size_t c = 0; c < n_chunks; c++) {
        cs_page_table pt = {0};
        ASSERT_EQ_INT(cs_engine_eval_seq(e, &pt, 0, prompt, PROMPT, chunks[c], c ? l1 : l0), 0);
        ASSERT_EQ_INT(pt.n_pages, (PROMPT + 15) / 16);
        /* it holds what its length keeps, whatever the chunks (with windows:
         * the windowed layers' pages of the last window only) */
        ASSERT_EQ_INT(cs_kv_cache_n_used(cs_engine_kv(e)), n_pages);
        ASSERT_EQ_INT(cs_page_table_xfer(&pt, cs_engine_kv(e), PROMPT, 0, pt.n_pages, ids),
                      n_pages);
        ASSERT_EQ_INT(cs_engine_kv_export(e, ids, n_pages, c ? kv1 : kv0), 0);
        cs_page_table_release(&pt, cs_engine_kv(e));
        if (!c) continue;
        if (memcmp(l0, l1, sizeof(float) * (size_t)V) != 0) {
            fprintf(stderr, "chunk %d: logits differ from one pass\n", chunks[c]);
            exit(1);
        }
        if (!kv_equal(kv0, kv1, e, page_bytes)) {
            fprintf(stderr, "chunk %d: KV pages differ from one pass\n", chunks[c]);
            exit(1);
        }
    }
    printf("a %d-token prompt keeps %d KV pages; every kind of page of every block: %d\n", PROMPT,
           n_pages, cs_kv_cache_per_block(cs_engine_kv(e)) * ((PROMPT + 15) / 16));
    cs_engine_free(e);
    free(l0), free(l1), free(kv0), free(kv1), free(prompt), free(ids);
}

/* The target: a 37-token prompt in chunks of 7, then 20 greedy tokens; its
 * logits at each of its 26 steps into log. With co-tenants, each step also
 * carries 1..31 other spans. */
#define STEPS 26
static void run_target(cs_engine *e, int32_t V, bool crowd, float *log) {
    int32_t prompt[37];
    uint64_t keep = rng;
    rng = 0x1234567ull;
    for (int i = 0; i < 37; i++)
        prompt[i] = (int32_t)rnd((uint32_t)V);
    rng = keep;
    cs_kv_cache *kv = cs_engine_kv(e);
    cs_page_table pt = {0};
    enum { MAXC = 31 };
    cs_page_table cpt[MAXC] = {{0}};
    int32_t cpos[MAXC] = {0}, ctok[MAXC][40];
    int32_t pos = 0, tok[8];
    cs_span spans[1 + MAXC];
    float *logits = malloc(sizeof(float) * (size_t)V * (1 + MAXC));
    ASSERT_TRUE(logits);
    for (int s = 0; s < STEPS; s++) {
        int32_t n = s < 5 ? 7 : s == 5 ? 2 : 1; /* 5 x 7 + 2 = 37, then decodes */
        const int32_t *t = s <= 5 ? prompt + pos : tok;
        ASSERT_EQ_INT(cs_page_table_reserve(&pt, kv, pos, pos + n), 0);
        spans[0] = (cs_span){t, n, pos, pt.pages, pt.n_pages, true, pt.cap};
        int ns = 1;
        int n_co = crowd ? 1 + (int)rnd(MAXC) : 0;
        for (int c = 0; c < n_co; c++) {
            int32_t cn = rnd(3) ? 1 : 1 + (int32_t)rnd(40); /* a decode or a prompt chunk */
            if (cpos[c] + cn > 900) {                       /* start over: a new sequence */
                cs_page_table_release(&cpt[c], kv);
                cpos[c] = 0;
            }
            for (int i = 0; i < cn; i++)
                ctok[c][i] = (int32_t)rnd((uint32_t)V);
            ASSERT_EQ_INT(cs_page_table_reserve(&cpt[c], kv, cpos[c], cpos[c] + cn), 0);
            spans[ns++] = (cs_span){ctok[c],        cn,          cpos[c], cpt[c].pages,
                                    cpt[c].n_pages, rnd(2) == 0, cpt[c].cap};
            cpos[c] += cn;
        }
        /* the target somewhere in the step, not always first */
        int at = ns > 1 ? (int)rnd((uint32_t)ns) : 0;
        cs_span tmp = spans[at];
        spans[at] = spans[0];
        spans[0] = tmp;
        ASSERT_EQ_INT(cs_engine_step(e, spans, ns, logits), 0);
        int row = 0;
        for (int i = 0; i < at; i++)
            row += spans[i].n_logits;
        memcpy(log + (size_t)s * V, logits + (size_t)row * V, sizeof(float) * (size_t)V);
        pos += n;
        if (s >= 5) { /* greedy next token */
            int32_t b = 0;
            for (int32_t i = 1; i < V; i++)
                if (log[(size_t)s * V + i] > log[(size_t)s * V + b]) b = i;
            tok[0] = b;
        }
    }
    cs_page_table_release(&pt, kv);
    for (int c = 0; c < MAXC; c++)
        cs_page_table_release(&cpt[c], kv);
    ASSERT_EQ_INT(cs_kv_cache_n_free(kv), cs_kv_cache_n_pages(kv));
    free(logits);
}

static void check_batch_and_threads(cs_model *m, int32_t V) {
    size_t n = (size_t)STEPS * (size_t)V;
    float *alone = malloc(n * sizeof(float)), *crowd = malloc(n * sizeof(float));
    ASSERT_TRUE(alone && crowd);
    cs_engine *e1 = engine(m, 1), *e2 = engine(m, 2);
    run_target(e1, V, false, alone);
    for (int rep = 0; rep < 3; rep++) {
        run_target(rep == 1 ? e1 : e2, V, true, crowd);
        for (int s = 0; s < STEPS; s++)
            if (memcmp(alone + (size_t)s * V, crowd + (size_t)s * V, sizeof(float) * (size_t)V)) {
                fprintf(stderr, "step %d: logits among co-tenants (%d threads) differ from alone\n",
                        s, rep == 1 ? 1 : 2);
                exit(1);
            }
    }
    run_target(e2, V, false, crowd);
    ASSERT_TRUE(memcmp(alone, crowd, n * sizeof(float)) == 0); /* 1 thread == 2 threads */
    cs_engine_free(e1);
    cs_engine_free(e2);
    free(alone), free(crowd);
}

static int real_model(const char *path) {
    cs_model *m = NULL;
    int r = cs_model_load_mode(path, CS_WEIGHTS_AUTO, &m);
    if (r) fprintf(stderr, "%s: %s\n", path, cs_last_error());
    ASSERT_EQ_INT(r, 0);
    ASSERT_EQ_INT(cs_model_weight_mode(m), CS_WEIGHTS_QUANT);
    int32_t V = cs_model_get_config(m)->n_vocab;
    g_real = true; /* fp32 KV only: bf16 pages are covered on the tiny models */
    if (getenv("CS_QUANT_PROMPT")) PROMPT = atoi(getenv("CS_QUANT_PROMPT"));
    ASSERT_TRUE(PROMPT >= 1 && PROMPT <= 30000);
    check_chunks(m, V);
    check_batch_and_threads(m, V);
    printf("%s (%s): a %d-token prompt chunked (%s) == one pass, alone == among co-tenants, "
           "1 == 2 threads\n",
           path, cs_model_weight_desc(m), PROMPT,
           getenv("CS_QUANT_CHUNKS") ? getenv("CS_QUANT_CHUNKS") : "16, 17, 100");
    cs_model_free(m);
    printf("ok\n");
    return 0;
}

int main(void) {
    if (getenv("CS_QUANT_MODEL")) return real_model(getenv("CS_QUANT_MODEL"));
    const char *variants[] = {"q4_1", "q4_0", "q8_0", "q5_0",     "q5_1",
                              "q4_k", "q5_k", "q6_k", "q4_k_mix", "gemma3_q8"};
    const char *descs[] = {"q4_1", "q4_0", "q8_0", "q5_0",      "q5_1",
                           "q4_K", "q5_K", "q6_K", "q5_0+q4_K", "q8_0"};
    for (int v = 0; v < (int)(sizeof variants / sizeof variants[0]); v++) {
        cs_model *m = load(variants[v], CS_WEIGHTS_AUTO);
        ASSERT_EQ_INT(cs_model_weight_mode(m), CS_WEIGHTS_QUANT);
        if (!strstr(cs_model_weight_desc(m), descs[v]))
            fprintf(stderr, "%s: weights %s\n", variants[v], cs_model_weight_desc(m));
        ASSERT_TRUE(strstr(cs_model_weight_desc(m), descs[v]) != NULL);
        cs_ref_seq *ref = NULL;
        ASSERT_EQ_INT(cs_ref_seq_init(m, 8, &ref), CS_ENOTSUP);
        int32_t V = cs_model_get_config(m)->n_vocab;
        for (int bf = 0; bf < 2; bf++) {
            g_kv_bf16 = bf;
            check_chunks(m, V);
            check_batch_and_threads(m, V);
            printf("%s, %s KV: chunked == one pass, alone == among co-tenants, 1 == 2 threads\n",
                   variants[v], bf ? "bf16" : "fp32");
        }
        cs_model_free(m);
    }
    /* an fp16 file stays fp32 in AUTO; EXACT is fp32 whatever the file */
    cs_model *m = load("f16", CS_WEIGHTS_AUTO);
    ASSERT_EQ_INT(cs_model_weight_mode(m), CS_WEIGHTS_EXACT);
    cs_model_free(m);
    m = load("q4_1", CS_WEIGHTS_EXACT);
    ASSERT_EQ_INT(cs_model_weight_mode(m), CS_WEIGHTS_EXACT);
    ASSERT_EQ_STR(cs_model_weight_desc(m), "fp32");
    cs_model_free(m);
    printf("ok\n");
    return 0;
}
