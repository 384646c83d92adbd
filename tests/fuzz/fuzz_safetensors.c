/* fuzz_safetensors: fuzz driver for a Hugging Face model directory as the
 * loader reads it: config.json (engine/src/model_hf.c: model_type, the
 * hyper-parameters, tie_word_embeddings, rope_scaling) and a
 * model.safetensors file (engine/src/safetensors.c: the u64 header length,
 * the JSON header, dtypes, shapes, data_offsets against the data buffer,
 * duplicate names), then the model built from both: every tensor's shape
 * against the configuration (vocabulary-only load) and, when that passed,
 * the weights converted to fp32.
 *
 * Input: config.json, one 0x00 byte, then the safetensors file (config.json
 * cannot hold a raw NUL, so the first one splits; without one the input is
 * all config.json and there is no weights file). The directory also holds a
 * fixed small tokenizer.json, so a load that gets past the weights reaches
 * the tokenizer check. Files are rewritten per input in one temporary
 * directory ($TMPDIR/fuzz-st-*, removed at exit). Properties besides the sanitizers: a refusal sets
 * cs_last_error(); every tensor view of cs__st_open_file lies inside the
 * mapping and its byte size matches shape x dtype; what loads
 * vocabulary-only has a configuration check_config accepts.
 * Usage (fallback): fuzz_safetensors CORPUS_DIR [ITERATIONS]
 *                   fuzz_safetensors --write-corpus DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/model.h"
#include "safetensors.h"
#include "fuzz_check.h"

/* Three ASCII tokens and one merge: enough for the HF tokenizer loader. */
static const char tokenizer_json[] =
    "{\"version\":\"1.0\",\"added_tokens\":[],\"normalizer\":null,"
    "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true},"
    "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,"
    "\"ab\":2},\"merges\":[\"a b\"]}}";

static char dir[256], st_path[300], cfg_path[300];

#define check_refusal(r) fuzz_check_refusal("fuzz_safetensors", (r))

static void write_file(const char *p, const void *data, size_t n) {
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f)) abort();
}

static void cleanup(void) {
    char tp[300];
    snprintf(tp, sizeof tp, "%s/tokenizer.json", dir);
    unlink(tp), unlink(st_path), unlink(cfg_path), rmdir(dir);
}

static void setup(void) {
    cs_log_set_level(CS_LOG_ERROR);
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/fuzz-st-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) abort();
    snprintf(st_path, sizeof st_path, "%s/model.safetensors", dir);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    char tp[300];
    snprintf(tp, sizeof tp, "%s/tokenizer.json", dir);
    write_file(tp, tokenizer_json, sizeof tokenizer_json - 1);
    atexit(cleanup);
}

static void check_file(void) {
    cs_st_set set;
    int r = cs__st_open_file(st_path, &set);
    check_refusal(r);
    if (r) return;
    const uint8_t *a = set.files[0].data, *e = a + set.files[0].size;
    for (int i = 0; i < set.n_tensors; i++) {
        const cs_st_tensor *t = &set.tensors[i];
        if (t->data < a || t->data > e || t->nbytes > (size_t)(e - t->data)) abort();
        if (t->n_dims < 1 || t->n_dims > CS_ST_MAX_DIMS) abort();
        if (cs__st_find(&set, t->name) != t) abort(); /* names are unique */
    }
    cs__st_close(&set);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) setup();
    const uint8_t *nul = memchr(data, 0, size);
    size_t cfg_len = nul ? (size_t)(nul - data) : size;
    write_file(cfg_path, data, cfg_len);
    unlink(st_path);
    if (nul) {
        write_file(st_path, nul + 1, size - cfg_len - 1);
        check_file();
    }
    cs_model *m = NULL;
    int r = cs_model_load_vocab(dir, &m);
    check_refusal(r);
    if (r) return 0;
    const cs_model_config *c = cs_model_get_config(m);
    if (c->n_vocab <= 0 || c->dim <= 0 || c->n_layers <= 0 || c->head_dim <= 0 ||
        c->n_heads % c->n_kv_heads)
        abort();
    cs_model_free(m);
    if (!nul) return 0;
    m = NULL;
    check_refusal(cs_model_load(dir, &m));
    cs_model_free(m);
    return 0;
}

#ifndef CS_LIBFUZZER
static const char config_json[] =
    "{\"model_type\":\"llama\",\"vocab_size\":8,\"hidden_size\":4,\"intermediate_size\":8,"
    "\"num_hidden_layers\":1,\"num_attention_heads\":2,\"num_key_value_heads\":1,"
    "\"head_dim\":2,\"max_position_embeddings\":64,\"rms_norm_eps\":1e-05,\"rope_theta\":10000,"
    "\"tie_word_embeddings\":true,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
    "\"low_freq_factor\":1,\"high_freq_factor\":4,\"original_max_position_embeddings\":32}}";

typedef struct {
    const char *name, *dtype;
    int rows, cols; /* cols 0: 1-D */
} spec;

/* A complete 1-layer model (dim 4, 2 heads of 2, 1 kv head, ffn 8, vocab 8)
 * in one dtype: config.json, NUL, the safetensors file. */
static int write_model(const char *out_dir, const char *name, const char *dtype, int esize) {
    static const spec specs[] = {
        {"model.embed_tokens.weight", "", 8, 4},
        {"model.norm.weight", "", 4, 0},
        {"model.layers.0.input_layernorm.weight", "", 4, 0},
        {"model.layers.0.self_attn.q_proj.weight", "", 4, 4},
        {"model.layers.0.self_attn.k_proj.weight", "", 2, 4},
        {"model.layers.0.self_attn.v_proj.weight", "", 2, 4},
        {"model.layers.0.self_attn.o_proj.weight", "", 4, 4},
        {"model.layers.0.post_attention_layernorm.weight", "", 4, 0},
        {"model.layers.0.mlp.gate_proj.weight", "", 8, 4},
        {"model.layers.0.mlp.up_proj.weight", "", 8, 4},
        {"model.layers.0.mlp.down_proj.weight", "", 4, 8},
    };
    char hdr[4096];
    int n = snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"format\":\"pt\"}");
    size_t off = 0;
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        const spec *s = &specs[i];
        size_t bytes = (size_t)s->rows * (size_t)(s->cols ? s->cols : 1) * (size_t)esize;
        if (s->cols)
            n += snprintf(hdr + n, sizeof hdr - (size_t)n,
                          ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%d,%d],\"data_offsets\":[%zu,%zu]}",
                          s->name, dtype, s->rows, s->cols, off, off + bytes);
        else
            n += snprintf(hdr + n, sizeof hdr - (size_t)n,
                          ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%d],\"data_offsets\":[%zu,%zu]}",
                          s->name, dtype, s->rows, off, off + bytes);
        off += bytes;
    }
    n += snprintf(hdr + n, sizeof hdr - (size_t)n, "}");
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", out_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fwrite(config_json, 1, sizeof config_json - 1, f);
    fputc(0, f);
    uint64_t hlen = (uint64_t)n;
    fwrite(&hlen, 8, 1, f);
    fwrite(hdr, 1, (size_t)n, f);
    for (size_t i = 0; i < off; i++) /* small values in every dtype: 0x3c00 f16 1.0, ... */
        fputc(esize == 4 ? (i % 4 == 3 ? 0x3f : 0) : (i % 2 ? 0x3c : 0), f);
    return fclose(f) != 0;
}

static int fuzz_write_corpus(const char *out_dir) {
    if (write_model(out_dir, "f32", "F32", 4) || write_model(out_dir, "f16", "F16", 2) ||
        write_model(out_dir, "bf16", "BF16", 2))
        return 1;
    /* a config alone (no weights file: the vocabulary-only path) */
    char path[1024];
    snprintf(path, sizeof path, "%s/config-only", out_dir);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fputs("{\"model_type\":\"qwen2\",\"vocab_size\":3,\"hidden_size\":8,\"intermediate_size\":16,"
          "\"num_hidden_layers\":2,\"num_attention_heads\":2,\"tie_word_embeddings\":false,"
          "\"rope_scaling\":{\"type\":\"linear\",\"factor\":2.0},\"rope_theta\":1e6}",
          f);
    return fclose(f) != 0;
}
#endif

#include "fuzz_main.h"
