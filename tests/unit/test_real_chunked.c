/* test_real_chunked: chunked prefill = one-pass prefill on the real default
 * model (SmolLM2-135M): for prompts of 1 to 700 tokens and chunk sizes 1 ..
 * 256, the last prompt token's logits and every KV page agree with one pass
 * (relative L2 <= 1e-5) and 32 greedy tokens are identical. Also checks the
 * engine's one pass against the reference forward pass. */
#include <stdlib.h>
#include <unistd.h>

#include "chunkserve/engine.h"
#include "chunkserve/refeval.h"
#include "test.h"

static double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++)
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return sqrt(num / (den > 0 ? den : 1));
}

static int32_t argmax(const float *v, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

enum { GEN = 32 };

/* Prefill in chunks; returns last logits, exported pages (positions < n
 * compared by the caller) and GEN greedy tokens. */
static void run(cs_engine *e, const int32_t *prompt, int32_t n, int32_t chunk, float *last,
                float *kv, int32_t *gen) {
    int32_t V = cs_model_get_config(cs_engine_model(e))->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    cs_page_table pt = {0};
    ASSERT_EQ_INT(cs_engine_eval_seq(e, &pt, 0, prompt, n, chunk, logits), 0);
    memcpy(last, logits, sizeof(float) * (size_t)V);
    int32_t full = n / 16; /* whole pages only: the tail page is still being written */
    ASSERT_EQ_INT(cs_engine_kv_export(e, pt.pages, full, kv), 0);
    for (int i = 0; i < GEN; i++) {
        gen[i] = argmax(logits, V);
        ASSERT_EQ_INT(cs_engine_eval_seq(e, &pt, n + i, &gen[i], 1, 0, logits), 0);
    }
    cs_page_table_release(&pt, cs_engine_kv(e));
    free(logits);
}

int main(void) {
    const char *path = getenv("CS_MODEL");
    if (!path || access(path, R_OK) != 0) {
        fprintf(stderr, "default model not found (%s): run scripts/fetch-model.sh\n",
                path ? path : "CS_MODEL unset");
        return TEST_SKIP;
    }
    cs_model *m = NULL;
    ASSERT_EQ_INT(cs_model_load(path, &m), 0);
    const cs_model_config *c = cs_model_get_config(m);
    int32_t V = c->n_vocab;
    cs_engine_params ep = cs_engine_params_default();
    cs_engine *e = NULL;
    ASSERT_EQ_INT(cs_engine_init(m, &ep, &e), 0);
    /* a real prompt: varied token ids from across the vocabulary */
    int32_t prompt[700];
    uint64_t x = 12345;
    for (int i = 0; i < 700; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = (int32_t)((x >> 33) % 20000) + 100;
    }
    size_t page_floats = cs_engine_page_bytes(e) / sizeof(float);
    float *ref_last = malloc(sizeof(float) * V), *last = malloc(sizeof(float) * V);
    float *ref_kv = malloc(sizeof(float) * page_floats * 44),
          *kv = malloc(sizeof(float) * page_floats * 44);
    int32_t ref_gen[GEN], gen[GEN];
    const int32_t lens[] = {1, 17, 300, 700};
    const int32_t chunks[] = {1, 2, 15, 16, 17, 64, 100, 256};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int32_t n = lens[li];
        run(e, prompt, n, 0, ref_last, ref_kv, ref_gen);
        if (n >= 300) { /* one-pass engine vs the reference forward pass */
            cs_ref_seq *rs = NULL;
            float *rl = malloc(sizeof(float) * V);
            ASSERT_EQ_INT(cs_ref_seq_init(m, n, &rs), 0);
            ASSERT_EQ_INT(cs_ref_seq_eval(rs, prompt, n, false, rl), 0);
            double er = rel_err(ref_last, rl, (size_t)V);
            printf("len %3d: engine one pass vs reference forward: logits rel %.3g\n", n, er);
            ASSERT_TRUE(er <= 1e-5);
            ASSERT_EQ_INT(argmax(rl, V), ref_gen[0]);
            cs_ref_seq_free(rs);
            free(rl);
        }
        for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
            int32_t ch = chunks[ci];
            if (ch >= n || (ch <= 2 && n > 300))
                continue; /* chunk 1-2 of 700: covered by 300, too slow */
            run(e, prompt, n, ch, last, kv, gen);
            double el = rel_err(last, ref_last, (size_t)V);
            double ek = rel_err(kv, ref_kv, page_floats * (size_t)(n / 16));
            int same = 0;
            while (same < GEN && gen[same] == ref_gen[same])
                same++;
            printf(
                "len %3d chunk %3d: logits rel %.3g, KV pages rel %.3g, greedy %d/%d identical\n",
                n, ch, el, ek, same, GEN);
            ASSERT_TRUE(el <= 1e-5);
            ASSERT_TRUE(ek <= 1e-5);
            ASSERT_EQ_INT(same, GEN);
        }
    }
    ASSERT_EQ_INT(cs_kv_cache_n_free(cs_engine_kv(e)), cs_kv_cache_n_pages(cs_engine_kv(e)));
    free(ref_last), free(last), free(ref_kv), free(kv);
    cs_engine_free(e);
    cs_model_free(m);
    return 0;
}
