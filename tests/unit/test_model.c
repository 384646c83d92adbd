/* test_model: the tiny model loads identically from GGUF (every weight type,
 * llama q/k permutation undone) and from its Hugging Face directory; the
 * reference forward pass gives the same logits whether a prompt is evaluated
 * at once or token by token; bad evaluation input is refused harmlessly; a
 * vocabulary-only load (the router's) gives a full load's configuration and
 * tokenizer without weights, also from a Hugging Face directory that has none;
 * a Gemma 3 file's hyperparameters are read from its metadata (window,
 * layer pattern, per-type RoPE bases, the block's parts), and a file with an
 * impossible window or pattern is refused naming the key. */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

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

static const int32_t prompt[] = {1,   40, 258, 7,  250, 99,  3,   250, 12,
                                 201, 2,  77,  77, 77,  150, 151, 5};
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
    for (size_t i = 0; i < n; i++)
        d = fmax(d, fabs((double)a[i] - b[i]));
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
    for (size_t i = 0; i < (size_t)V * N_PROMPT; i++)
        num += (a[i] - b[i]) * (a[i] - b[i]), den += a[i] * a[i];
    printf("q8_0 vs f32 relative L2 = %g\n", sqrt(num / den));
    ASSERT_TRUE(sqrt(num / den) < 0.05);
    free(a);
    free(b);
    cs_model_free(f);
    cs_model_free(q);
}

/* Same configuration, same tokens, same encoding and chat rendering. */
static void check_same_vocab(const cs_model *full, const cs_model *voc) {
    ASSERT_TRUE(
        memcmp(cs_model_get_config(full), cs_model_get_config(voc), sizeof(cs_model_config)) == 0);
    ASSERT_EQ_INT(cs_model_weight_bytes(voc), 0);
    ASSERT_TRUE(cs_model_weight_bytes(full) > 0);
    const cs_tokenizer *a = cs_model_tokenizer(full), *b = cs_model_tokenizer(voc);
    ASSERT_EQ_INT(cs_tokenizer_n_vocab(a), cs_tokenizer_n_vocab(b));
    ASSERT_EQ_INT(cs_tokenizer_bos(a), cs_tokenizer_bos(b));
    ASSERT_EQ_INT(cs_tokenizer_eos(a), cs_tokenizer_eos(b));
    for (int32_t id = 0; id < cs_tokenizer_n_vocab(a); id++) {
        const char *ba, *bb;
        size_t la, lb;
        ASSERT_EQ_INT(cs_tokenizer_token_bytes(a, id, &ba, &la), 0);
        ASSERT_EQ_INT(cs_tokenizer_token_bytes(b, id, &bb, &lb), 0);
        ASSERT_EQ_INT(la, lb);
        ASSERT_TRUE(memcmp(ba, bb, la) == 0);
        ASSERT_EQ_INT(cs_tokenizer_is_special(a, id), cs_tokenizer_is_special(b, id));
        ASSERT_EQ_INT(cs_tokenizer_is_eog(a, id), cs_tokenizer_is_eog(b, id));
    }
    const char *text = "Hello, world! <|im_start|>user caf\xc3\xa9 42\n";
    int32_t *ia = NULL, *ib = NULL;
    size_t na = 0, nb = 0;
    ASSERT_EQ_INT(cs_tokenizer_encode(a, text, strlen(text), true, true, &ia, &na), 0);
    ASSERT_EQ_INT(cs_tokenizer_encode(b, text, strlen(text), true, true, &ib, &nb), 0);
    ASSERT_EQ_INT(na, nb);
    ASSERT_TRUE(memcmp(ia, ib, na * sizeof *ia) == 0);
    free(ia);
    free(ib);
    cs_chat_message msg = {.role = "user", .content = "hi"};
    char *ca = NULL, *cb = NULL;
    int ra = cs_tokenizer_apply_chat(a, &msg, 1, true, &ca),
        rb = cs_tokenizer_apply_chat(b, &msg, 1, true, &cb);
    ASSERT_EQ_INT(ra, rb);
    if (!ra) ASSERT_EQ_STR(ca, cb);
    free(ca);
    free(cb);
}

static cs_model *load_vocab(const char *path) {
    cs_model *m = NULL;
    int r = cs_model_load_vocab(path, &m);
    if (r) fprintf(stderr, "load_vocab %s: %s\n", path, cs_last_error());
    ASSERT_EQ_INT(r, 0);
    return m;
}

static void copy_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    ASSERT_TRUE(in && out);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        ASSERT_EQ_INT(fwrite(buf, 1, n, out), n);
    fclose(in);
    ASSERT_EQ_INT(fclose(out), 0);
}

static void check_vocab_only(const char *variant) {
    char path[1024];
    const char *files[] = {"tiny.gguf", "tiny-hf"};
    for (int f = 0; f < (strcmp(variant, "gemma3") ? 2 : 1); f++) { /* gemma3: GGUF only */
        snprintf(path, sizeof path, "%s/%s/%s", tiny_dir(), variant, files[f]);
        cs_model *full = load(variant, files[f]), *voc = load_vocab(path);
        check_same_vocab(full, voc);
        /* the vocabulary-only load samples the same bytes */
        ASSERT_TRUE(cs_model_fingerprint(full) != 0);
        ASSERT_TRUE(cs_model_fingerprint(voc) == cs_model_fingerprint(full));
        cs_model_free(voc);
        if (f == 1) {
            /* config.json + tokenizer files only, no *.safetensors */
            const char *tmp = getenv("CS_TEST_TMPDIR");
            char dir[1024], from[1100], to[1100];
            snprintf(dir, sizeof dir, "%s/vocab-only-%s", tmp ? tmp : "/tmp", variant);
            mkdir(dir, 0755);
            const char *keep[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
            for (int k = 0; k < 3; k++) {
                snprintf(from, sizeof from, "%s/%s", path, keep[k]);
                snprintf(to, sizeof to, "%s/%s", dir, keep[k]);
                struct stat st;
                if (stat(from, &st) == 0) copy_file(from, to);
            }
            voc = load_vocab(dir);
            /* the name comes from the directory's name */
            cs_model_config cf = *cs_model_get_config(full), cv = *cs_model_get_config(voc);
            memset(cf.name, 0, sizeof cf.name);
            memset(cv.name, 0, sizeof cv.name);
            ASSERT_TRUE(memcmp(&cf, &cv, sizeof cf) == 0);
            ASSERT_EQ_INT(cs_model_weight_bytes(voc), 0);
            /* no tensors seen: the model's fingerprint is unknown, the tokenizer's is not */
            ASSERT_TRUE(cs_model_fingerprint(voc) == 0);
            ASSERT_TRUE(cs_tokenizer_fingerprint(cs_model_tokenizer(voc)) ==
                        cs_tokenizer_fingerprint(cs_model_tokenizer(full)));
            cs_model_free(voc);
            /* a full load of that directory still needs weights */
            cs_model *none = NULL;
            ASSERT_EQ_INT(cs_model_load(dir, &none), CS_ENOENT);
            ASSERT_TRUE(none == NULL);
        }
        cs_model_free(full);
    }
    cs_model *bad = NULL;
    ASSERT_EQ_INT(cs_model_load_vocab("/nonexistent/model.gguf", &bad), CS_ENOENT);
    ASSERT_TRUE(bad == NULL);
    /* a truncated file is refused as by a full load: the tensor table is still checked */
    snprintf(path, sizeof path, "%s/%s/tiny.gguf", tiny_dir(), variant);
    const char *tmp = getenv("CS_TEST_TMPDIR");
    char cut[1024];
    snprintf(cut, sizeof cut, "%s/vocab-only-cut-%s.gguf", tmp ? tmp : "/tmp", variant);
    copy_file(path, cut);
    struct stat st;
    ASSERT_EQ_INT(stat(cut, &st), 0);
    ASSERT_EQ_INT(truncate(cut, st.st_size - 1000), 0);
    ASSERT_TRUE(cs_model_load_vocab(cut, &bad) < 0);
    ASSERT_TRUE(bad == NULL);
    printf("%-7s vocab-only load = full load's config and tokenizer\n", variant);
}

/* cs_model_fingerprint tells models apart that the configuration does not:
 * another seed (same shapes, same tokenizer), another weight type; the same
 * file twice gives the same value. */
static void check_fingerprints(void) {
    cs_model *a = load("f32", "tiny.gguf"), *a2 = load("f32", "tiny.gguf");
    cs_model *s2 = load("seed2", "tiny.gguf"), *q = load("q4_1", "tiny.gguf");
    cs_model *h = load("f32", "tiny-hf"), *hs2 = load("seed2", "tiny-hf");
    uint64_t fa = cs_model_fingerprint(a);
    ASSERT_TRUE(fa != 0 && fa == cs_model_fingerprint(a2));
    ASSERT_TRUE(!memcmp(cs_model_get_config(a), cs_model_get_config(s2), sizeof(cs_model_config)));
    ASSERT_TRUE(fa != cs_model_fingerprint(s2));
    ASSERT_TRUE(fa != cs_model_fingerprint(q));
    ASSERT_TRUE(cs_model_fingerprint(h) != cs_model_fingerprint(hs2));
    uint64_t ta = cs_tokenizer_fingerprint(cs_model_tokenizer(a));
    ASSERT_TRUE(ta == cs_tokenizer_fingerprint(cs_model_tokenizer(s2)));
    ASSERT_TRUE(ta == cs_tokenizer_fingerprint(cs_model_tokenizer(q)));
    /* the same tokenizer from tokenizer.json */
    ASSERT_TRUE(ta == cs_tokenizer_fingerprint(cs_model_tokenizer(h)));
    printf("fingerprints: seed 1 %016llx, seed 2 %016llx, q4_1 %016llx, tokenizer %016llx\n",
           (unsigned long long)fa, (unsigned long long)cs_model_fingerprint(s2),
           (unsigned long long)cs_model_fingerprint(q), (unsigned long long)ta);
    cs_model_free(a), cs_model_free(a2), cs_model_free(s2), cs_model_free(q), cs_model_free(h),
        cs_model_free(hs2);
}

/* A copy of the tiny Gemma 3 with the u32 value of metadata key `key` set
 * to v (the key must be there as a u32: GGUF type 4). */
static void write_gemma3_with(const char *key, uint32_t v, const char *to) {
    char from[1024];
    snprintf(from, sizeof from, "%s/gemma3/tiny.gguf", tiny_dir());
    FILE *f = fopen(from, "rb");
    ASSERT_TRUE(f != NULL);
    static char buf[4 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    ASSERT_TRUE(n > 0 && n < sizeof buf);
    size_t klen = strlen(key);
    char *at = NULL;
    for (size_t i = 8; i + klen + 8 <= n && !at; i++) /* the key after its u64 length */
        if (!memcmp(buf + i, key, klen) && !memcmp(buf + i - 8, &(uint64_t){klen}, 8)) at = buf + i;
    ASSERT_TRUE(at != NULL);
    ASSERT_TRUE(!memcmp(at + klen, &(uint32_t){4}, 4));
    memcpy(at + klen + 4, &v, 4);
    FILE *o = fopen(to, "wb");
    ASSERT_TRUE(o && fwrite(buf, 1, n, o) == n);
    ASSERT_EQ_INT(fclose(o), 0);
}

static void check_gemma3(void) {
    cs_model *g = load("gemma3", "tiny.gguf");
    const cs_model_config *c = cs_model_get_config(g);
    ASSERT_EQ_STR(c->arch, "gemma3");
    ASSERT_TRUE(c->qk_norm && c->post_norms && c->gelu && c->tied_embeddings);
    ASSERT_EQ_INT(c->sliding_window, 8);
    ASSERT_EQ_INT(c->swa_period, 3); /* the file's key, not the default 6 */
    ASSERT_TRUE(c->rope_theta == 1e6f && c->rope_theta_swa == 1e4f);
    ASSERT_TRUE(c->embed_scale == sqrtf(64.0f) && c->attn_scale == 0.25f);
    ASSERT_EQ_INT(cs_model_layer_window(c, 0), 8);
    ASSERT_EQ_INT(cs_model_layer_window(c, 1), 8);
    ASSERT_EQ_INT(cs_model_layer_window(c, 2), 0);
    cs_model_free(g);
    char path[1100];
    snprintf(path, sizeof path, "%s/gemma3/bad.gguf", tiny_dir());
    /* the pattern as llama.cpp reads it: 1 = every layer global, longer than
     * the model = every layer windowed */
    write_gemma3_with("gemma3.attention.sliding_window_pattern", 1, path);
    g = NULL;
    ASSERT_EQ_INT(cs_model_load(path, &g), 0);
    ASSERT_EQ_INT(cs_model_get_config(g)->sliding_window, 0);
    for (int l = 0; l < 3; l++)
        ASSERT_EQ_INT(cs_model_layer_window(cs_model_get_config(g), l), 0);
    cs_model_free(g);
    write_gemma3_with("gemma3.attention.sliding_window_pattern", 99, path);
    ASSERT_EQ_INT(cs_model_load(path, &g), 0);
    for (int l = 0; l < 3; l++)
        ASSERT_EQ_INT(cs_model_layer_window(cs_model_get_config(g), l), 8);
    cs_model_free(g);
    const struct {
        const char *key;
        uint32_t v;
    } bad[] = {{"gemma3.attention.sliding_window", 0},
               {"gemma3.attention.sliding_window", 0xffffffffu}, /* past int32 */
               {"gemma3.attention.sliding_window_pattern", 0}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_gemma3_with(bad[i].key, bad[i].v, path);
        cs_model *m = (cs_model *)1;
        ASSERT_EQ_INT(cs_model_load(path, &m), CS_EBADMSG);
        ASSERT_TRUE(m == NULL);
        ASSERT_TRUE(strstr(cs_last_error(), bad[i].key) != NULL);
        printf("gemma3 %s = %u refused: %s\n", bad[i].key, bad[i].v, cs_last_error());
    }
    unlink(path);
    /* what the format allows and chunkserve does not run: refused by name */
    const struct {
        const char *dir, *key;
    } unsupported[] = {{"gemma3_softcap", "gemma3.final_logit_softcapping"},
                       {"gemma3_pattern-list", "gemma3.attention.sliding_window_pattern"}};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++) {
        snprintf(path, sizeof path, "%s/%s/tiny.gguf", tiny_dir(), unsupported[i].dir);
        cs_model *m = (cs_model *)1;
        ASSERT_EQ_INT(cs_model_load(path, &m), CS_ENOTSUP);
        ASSERT_TRUE(m == NULL);
        ASSERT_TRUE(strstr(cs_last_error(), unsupported[i].key) != NULL);
        printf("gemma3 %s refused: %s\n", unsupported[i].dir, cs_last_error());
    }
}

int main(void) {
    const char *variants[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "untied", "qwen2"};
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++)
        check_formats_agree(variants[i]);
    cs_model *u = load("untied", "tiny.gguf"), *q = load("qwen2", "tiny-hf");
    ASSERT_TRUE(!cs_model_get_config(u)->tied_embeddings);
    ASSERT_TRUE(cs_model_get_config(q)->qkv_bias);
    ASSERT_EQ_STR(cs_model_get_config(q)->arch, "qwen2");
    cs_model_free(u);
    cs_model_free(q);
    check_incremental();
    check_quantized_close();
    check_fingerprints();
    check_vocab_only("f32");
    check_vocab_only("q4_1");
    check_vocab_only("untied");
    check_vocab_only("qwen2");
    check_vocab_only("gemma3");
    check_gemma3();
    cs_model_free(NULL);
    return 0;
}
