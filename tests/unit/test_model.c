/* test_model: the tiny model loads identically from GGUF (every weight type,
 * llama q/k permutation undone) and from its Hugging Face directory; the
 * reference forward pass gives the same logits whether a prompt is evaluated
 * at once or token by token; bad evaluation input is refused harmlessly. */
#include <stdlib.h>

#include "chunkserve/model.h"
#include "chunkserve/refeval.h"
#include "test.h"

static const char *tiny_dir(void) {
    const char *d = getenv("CS_TINY_DIR");
    if (!d) {
        fprintf(stderr, "CS_TINY_DIR not set (run through ctest)\n");
        exit(1);
    }
    return d;
}

static cs_model *load(const char *variant, const char *file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", tiny_dir(), variant, file);
    cs_model *m = NULL;
    int r = cs_model_load(path, &m);
    if (r) fprintf(stderr, "load %s: %s\n", path, cs_last_error());
    ASSERT_EQ_INT(r, 0);
    return m;
}

static const int32_t prompt[] = {1, 40, 258, 7, 250, 99, 3, 250, 12, 201, 2, 77, 77, 77, 150, 151, 5};
#define N_PROMPT ((int32_t)(sizeof prompt / sizeof prompt[0]))

static float *all_logits(const cs_model *m) {
    int32_t V = cs_model_get_config(m)->n_vocab;
    float *out = malloc(sizeof(float) * (size_t)V * N_PROMPT);
    cs_ref_seq *s = NULL;
    ASSERT_EQ_INT(cs_ref_seq_init(m, 64, &s), 0);
    ASSERT_EQ_INT(cs_ref_seq_eval(s, prompt, N_PROMPT, true, out), 0);
    cs_ref_seq_free(s);
    return out;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

/* GGUF vs HF: same values must give bit-identical logits. */
static void check_formats_agree(const char *variant) {
    cs_model *g = load(variant, "tiny.gguf"), *h = load(variant, "tiny-hf");
    const cs_model_config *cg = cs_model_get_config(g), *ch = cs_model_get_config(h);
    ASSERT_EQ_INT(cg->n_vocab, ch->n_vocab);
    ASSERT_EQ_INT(cg->n_layers, ch->n_layers);
    ASSERT_EQ_INT(cg->tied_embeddings, ch->tied_embeddings);
    ASSERT_EQ_INT(cg->qkv_bias, ch->qkv_bias);
    float *lg = all_logits(g), *lh = all_logits(h);
    double d = max_abs_diff(lg, lh, (size_t)cg->n_vocab * N_PROMPT);
    printf("%-7s gguf vs hf: max |diff| = %g\n", variant, d);
    ASSERT_TRUE(d == 0.0);
    free(lg);
    free(lh);
    cs_model_free(g);
    cs_model_free(h);
}

/* Token-by-token (and in uneven pieces) equals one pass, up to fp32 rounding
 * from a different matmul batch shape (none here: each row is one dot). */
static void check_incremental(void) {
    cs_model *m = load("f32", "tiny.gguf");
    int32_t V = cs_model_get_config(m)->n_vocab;
    float *ref = all_logits(m), *step = malloc(sizeof(float) * (size_t)V * N_PROMPT);
    cs_ref_seq *s = NULL;
    ASSERT_EQ_INT(cs_ref_seq_init(m, 64, &s), 0);
    int32_t pos = 0, sizes[] = {1, 3, 5, 2, 6};
    for (int i = 0; pos < N_PROMPT; i++) {
        int32_t n = sizes[i % 5];
        if (n > N_PROMPT - pos) n = N_PROMPT - pos;
        ASSERT_EQ_INT(cs_ref_seq_eval(s, prompt + pos, n, true, step + (size_t)pos * V), 0);
        pos += n;
    }
    ASSERT_EQ_INT(cs_ref_seq_len(s), N_PROMPT);
    double d = max_abs_diff(ref, step, (size_t)V * N_PROMPT);
    printf("incremental vs one pass: max |diff| = %g\n", d);
    ASSERT_TRUE(d == 0.0);
    /* bad input: refused, nothing changes */
    int32_t bad[] = {5, V};
    ASSERT_EQ_INT(cs_ref_seq_eval(s, bad, 2, false, step), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "outside the vocabulary");
    ASSERT_EQ_INT(cs_ref_seq_eval(s, bad, 0, false, step), CS_EINVAL);
    ASSERT_EQ_INT(cs_ref_seq_eval(s, bad, -3, false, step), CS_EINVAL);
    ASSERT_EQ_INT(cs_ref_seq_len(s), N_PROMPT);
    int32_t many[64] = {0};
    ASSERT_EQ_INT(cs_ref_seq_eval(s, many, 64 - N_PROMPT + 1, false, step), CS_ENOSPC);
    ASSERT_EQ_INT(cs_ref_seq_len(s), N_PROMPT);
    cs_ref_seq_free(s);
    ASSERT_EQ_INT(cs_ref_seq_init(m, 0, &s), CS_EINVAL);
    ASSERT_EQ_INT(cs_ref_seq_init(m, 1 << 30, &s), CS_EINVAL);
    free(ref);
    free(step);
    cs_model_free(m);
}

/* Quantized types round-trip through the loader: the q8_0 model is close to
 * the f32 one it was made from (a sanity check on the block layouts). */
static void check_quantized_close(void) {
    cs_model *f = load("f32", "tiny.gguf"), *q = load("q8_0", "tiny.gguf");
    int32_t V = cs_model_get_config(f)->n_vocab;
    float *a = all_logits(f), *b = all_logits(q);
    double num = 0, den = 0;
    for (size_t i = 0; i < (size_t)V * N_PROMPT; i++) num += (a[i] - b[i]) * (a[i] - b[i]), den += a[i] * a[i];
    printf("q8_0 vs f32 relative L2 = %g\n", sqrt(num / den));
    ASSERT_TRUE(sqrt(num / den) < 0.05);
    free(a);
    free(b);
    cs_model_free(f);
    cs_model_free(q);
}

int main(void) {
    const char *variants[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "untied", "qwen2"};
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) check_formats_agree(variants[i]);
    cs_model *u = load("untied", "tiny.gguf"), *q = load("qwen2", "tiny-hf");
    ASSERT_TRUE(!cs_model_get_config(u)->tied_embeddings);
    ASSERT_TRUE(cs_model_get_config(q)->qkv_bias);
    ASSERT_EQ_STR(cs_model_get_config(q)->arch, "qwen2");
    cs_model_free(u);
    cs_model_free(q);
    check_incremental();
    check_quantized_close();
    cs_model_free(NULL);
    return 0;
}
