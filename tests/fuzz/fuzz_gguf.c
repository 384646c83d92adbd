/* fuzz_gguf: fuzz driver for the GGUF reader (engine/src/gguf.c) and what
 * the model loader builds from it (engine/src/model_gguf.c, model.c): the
 * header, every metadata type (nested arrays included), tensor infos,
 * alignment and data bounds, then the typed getters, the architecture's
 * hyper-parameters and their checks, every tensor's shape against the
 * configuration, the tokenizer built from tokenizer.ggml.* (BPE merges,
 * token types, special ids, pre-tokenizer, chat template) and, when all of
 * that passed, the weights themselves: converted to fp32 (exact mode) or
 * packed into the quantized kernels' layout (auto mode).
 *
 * Each input is a whole file: the loaders take a path and mmap it, so the
 * bytes go into one memfd and are opened as /proc/self/fd/N. Properties
 * checked besides the sanitizers: a refusal always sets cs_last_error();
 * every pointer and length cs__gguf_open hands out lies inside the mapping;
 * every key it lists is found by cs__gguf_find and the typed getters; a
 * model that loads has as many tokenizer tokens as embedding rows. Not
 * here: running the model (tests/unit/test_model.c).
 *
 * Seeds: fuzz_write_corpus writes metadata-only files (every kv type,
 * arrays of strings and ints, a tensor info); the committed corpus
 * (tests/fuzz/corpus-gguf) adds whole tiny models written by
 * `chunkserve-mktiny --layers 1 --dim 32` (see docs/security.md, Fuzzing):
 * q4_0 llama, q8_0 qwen2, q5_1, and with `--hidden 256` a Q5_0 model whose
 * ffn_down is Q4_K, Q5_K or (qwen2) Q6_K, so every block type is parsed,
 * scale-checked, dequantized and packed.
 * Usage (fallback): fuzz_gguf CORPUS_DIR [ITERATIONS]
 *                   fuzz_gguf --write-corpus DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/model.h"
#include "chunkserve/tokenizer.h"
#include "gguf.h"
#include "fuzz_check.h"

static int memfd = -1;
static char gguf_path[64];

#define check_refusal(r) fuzz_check_refusal("fuzz_gguf", (r))

static void check_inside(const cs_gguf *g, const void *p, size_t n) {
    const uint8_t *a = g->file.data, *b = p;
    if (b < a || b > a + g->file.size || n > (size_t)(a + g->file.size - b)) {
        fprintf(stderr, "fuzz_gguf: a view of %zu bytes outside the mapping\n", n);
        abort();
    }
}

/* The reader alone, then every accessor over what it returned. */
static void walk(void) {
    cs_gguf g;
    int r = cs__gguf_open(gguf_path, &g);
    check_refusal(r);
    if (r) return;
    for (uint64_t i = 0; i < g.n_kv; i++) {
        const cs_gguf_kv *kv = &g.kv[i];
        check_inside(&g, kv->key.ptr, kv->key.len);
        check_inside(&g, kv->data, 0);
        char key[256];
        /* a key is valid UTF-8, which may hold a NUL: the getters take C strings */
        if (kv->key.len >= sizeof key || memchr(kv->key.ptr, 0, kv->key.len)) continue;
        memcpy(key, kv->key.ptr, kv->key.len);
        key[kv->key.len] = 0;
        if (!cs__gguf_find(&g, key)) abort(); /* a key it listed, it finds */
        uint32_t u;
        float f;
        bool b;
        cs_gguf_str s;
        if (cs__gguf_get_u32(&g, key, &u) == CS_ENOENT) abort();
        (void)cs__gguf_get_f32(&g, key, &f);
        (void)cs__gguf_get_bool(&g, key, &b);
        if (cs__gguf_get_str(&g, key, &s) == 0) check_inside(&g, s.ptr, s.len);
        cs_gguf_str *strs = NULL;
        int32_t *ints = NULL;
        uint64_t n = 0;
        if (cs__gguf_get_str_array(&g, key, &strs, &n) == 0)
            for (uint64_t k = 0; k < n; k++)
                check_inside(&g, strs[k].ptr, strs[k].len);
        free(strs);
        if (cs__gguf_get_i32_array(&g, key, &ints, &n) == 0 && n && !ints) abort();
        free(ints);
    }
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const cs_gguf_tensor *t = &g.tensors[i];
        check_inside(&g, t->name.ptr, t->name.len);
        check_inside(&g, t->data, t->nbytes);
        if (t->n_dims > CS_GGUF_MAX_DIMS) abort();
    }
    cs__gguf_close(&g);
}

/* The model loader: vocabulary and shapes only, then with weights. */
static void load(void) {
    cs_model *m = NULL;
    int r = cs_model_load_vocab(gguf_path, &m);
    check_refusal(r);
    if (r) return;
    const cs_tokenizer *tok = cs_model_tokenizer(m);
    const cs_model_config *c = cs_model_get_config(m);
    if (cs_tokenizer_n_vocab(tok) != c->n_vocab) abort(); /* model_gguf.c checks it */
    cs_model_free(m);
    static const cs_weight_mode modes[] = {CS_WEIGHTS_EXACT, CS_WEIGHTS_AUTO};
    for (int i = 0; i < 2; i++) {
        r = cs_model_load_mode(gguf_path, modes[i], &m);
        check_refusal(r);
        cs_model_free(m);
        m = NULL;
    }
    cs_tokenizer *t = NULL;
    check_refusal(cs_tokenizer_load(gguf_path, &t));
    cs_tokenizer_free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (memfd < 0) {
        cs_log_set_level(CS_LOG_ERROR); /* "no tokenizer.ggml.pre" would print per input */
        memfd = memfd_create("fuzz_gguf", MFD_CLOEXEC);
        if (memfd < 0) abort();
        snprintf(gguf_path, sizeof gguf_path, "/proc/self/fd/%d", memfd);
    }
    if (ftruncate(memfd, 0) || (size && pwrite(memfd, data, size, 0) != (ssize_t)size)) abort();
    walk();
    load();
    return 0;
}

#ifndef CS_LIBFUZZER
/* ------------------------------------------------- a small GGUF writer -- */

typedef struct {
    uint8_t b[8192];
    size_t n;
} gbuf;

static void put(gbuf *g, const void *p, size_t n) {
    if (g->n + n > sizeof g->b) abort();
    memcpy(g->b + g->n, p, n);
    g->n += n;
}
static void put_u32(gbuf *g, uint32_t v) {
    put(g, &v, 4);
}
static void put_u64(gbuf *g, uint64_t v) {
    put(g, &v, 8);
}
static void put_str(gbuf *g, const char *s) {
    put_u64(g, strlen(s));
    put(g, s, strlen(s));
}
static void kv_u32(gbuf *g, const char *k, uint32_t v) {
    put_str(g, k), put_u32(g, CS_GGUF_UINT32), put_u32(g, v);
}
static void kv_f32(gbuf *g, const char *k, float v) {
    put_str(g, k), put_u32(g, CS_GGUF_FLOAT32), put(g, &v, 4);
}
static void kv_str(gbuf *g, const char *k, const char *v) {
    put_str(g, k), put_u32(g, CS_GGUF_STRING), put_str(g, v);
}

static int write_file(const char *dir, const char *name, const void *p, size_t n) {
    char fn[1024];
    snprintf(fn, sizeof fn, "%s/%s", dir, name);
    FILE *f = fopen(fn, "wb");
    if (!f) return 1;
    fwrite(p, 1, n, f);
    return fclose(f) != 0;
}

/* Metadata-only files: a llama header with a tiny byte vocabulary (the
 * loader gets as far as the missing tensors), every scalar type, nested
 * arrays, and one f32 tensor with its data. */
static int fuzz_write_corpus(const char *dir) {
    static gbuf g;
    /* 1: hyper-parameters + tokenizer, no tensors */
    g.n = 0;
    put_u32(&g, 0x46554747u), put_u32(&g, 3), put_u64(&g, 0), put_u64(&g, 15);
    kv_str(&g, "general.architecture", "llama");
    kv_str(&g, "general.name", "fuzz");
    kv_u32(&g, "llama.block_count", 1);
    kv_u32(&g, "llama.embedding_length", 32);
    kv_u32(&g, "llama.feed_forward_length", 64);
    kv_u32(&g, "llama.attention.head_count", 4);
    kv_u32(&g, "llama.attention.head_count_kv", 2);
    kv_u32(&g, "llama.context_length", 128);
    kv_f32(&g, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_str(&g, "tokenizer.ggml.model", "gpt2");
    kv_str(&g, "tokenizer.ggml.pre", "smollm");
    put_str(&g, "tokenizer.ggml.tokens"), put_u32(&g, CS_GGUF_ARRAY), put_u32(&g, CS_GGUF_STRING);
    put_u64(&g, 5);
    const char *toks[] = {"a", "b", "ab", "<|im_start|>", "<|im_end|>"};
    for (int i = 0; i < 5; i++)
        put_str(&g, toks[i]);
    put_str(&g, "tokenizer.ggml.merges"), put_u32(&g, CS_GGUF_ARRAY), put_u32(&g, CS_GGUF_STRING);
    put_u64(&g, 1), put_str(&g, "a b");
    put_str(&g, "tokenizer.ggml.token_type"), put_u32(&g, CS_GGUF_ARRAY),
        put_u32(&g, CS_GGUF_INT32), put_u64(&g, 5);
    for (int i = 0; i < 5; i++)
        put_u32(&g, i < 3 ? 1 : 3);
    kv_str(&g, "tokenizer.chat_template", "{{'<|im_start|>' + message['role']}}");
    if (write_file(dir, "header", g.b, g.n)) return 1;

    /* 2: every scalar type, a nested array, the alignment key, one tensor */
    g.n = 0;
    put_u32(&g, 0x46554747u), put_u32(&g, 2), put_u64(&g, 1), put_u64(&g, 14);
    static const uint8_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1};
    for (uint32_t t = 0; t <= CS_GGUF_BOOL; t++) {
        char k[32];
        snprintf(k, sizeof k, "t.%u", t);
        put_str(&g, k), put_u32(&g, t);
        uint64_t one = 1;
        put(&g, &one, sizes[t]);
    }
    put_str(&g, "t.u64"), put_u32(&g, CS_GGUF_UINT64), put_u64(&g, 7);
    put_str(&g, "t.i64"), put_u32(&g, CS_GGUF_INT64), put_u64(&g, (uint64_t)-7);
    put_str(&g, "t.f64"), put_u32(&g, CS_GGUF_FLOAT64), put_u64(&g, 0x3ff0000000000000u);
    put_str(&g, "t.nested"), put_u32(&g, CS_GGUF_ARRAY), put_u32(&g, CS_GGUF_ARRAY), put_u64(&g, 1);
    put_u32(&g, CS_GGUF_UINT32), put_u64(&g, 2), put_u32(&g, 1), put_u32(&g, 2);
    put_str(&g, "t.i32s"), put_u32(&g, CS_GGUF_ARRAY), put_u32(&g, CS_GGUF_INT32), put_u64(&g, 2);
    put_u32(&g, 3), put_u32(&g, 4);
    kv_u32(&g, "general.alignment", 16);
    put_str(&g, "output_norm.weight"), put_u32(&g, 1), put_u64(&g, 4), put_u32(&g, 0),
        put_u64(&g, 0);
    while (g.n % 16)
        put(&g, "", 1);
    float w[4] = {1, 2, 3, 4};
    put(&g, w, sizeof w);
    return write_file(dir, "types", g.b, g.n);
}
#endif

#include "fuzz_main.h"
