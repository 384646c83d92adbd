/* test_malformed: damaged model files give a clear error naming the problem
 * and never crash (this test also runs under ASan+UBSan). Each case starts
 * from the valid tiny model and breaks one thing. */
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chunkserve/model.h"
#include "gguf.h"
#include "util.h"
#include "test.h"

static uint8_t *orig;
static size_t orig_size;
static char tmp_path[1024];

static uint8_t *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    ASSERT_TRUE(f != NULL);
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*size);
    ASSERT_TRUE(fread(b, 1, *size, f) == *size);
    fclose(f);
    return b;
}

static void write_all(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    ASSERT_TRUE(f != NULL);
    ASSERT_TRUE(fwrite(b, 1, n, f) == n);
    fclose(f);
}

/* Loads bytes as a model; returns the status (and frees any model). */
static int load_bytes(const uint8_t *b, size_t n) {
    write_all(tmp_path, b, n);
    cs_model *m = NULL;
    int r = cs_model_load(tmp_path, &m);
    if (r == 0)
        ASSERT_TRUE(m != NULL);
    else
        ASSERT_TRUE(m == NULL);
    cs_model_free(m);
    return r;
}

static void expect(const char *what, const uint8_t *b, size_t n, int code, const char *needle) {
    int r = load_bytes(b, n);
    printf("%-28s -> %d: %s\n", what, r, cs_last_error());
    ASSERT_EQ_INT(r, code);
    ASSERT_MSG_HAS(cs_last_error(), needle);
}

/* Offsets of fields inside the valid file, found with our own reader. */
static size_t key_offset(const cs_gguf *g, const char *key) {
    const cs_gguf_kv *kv = cs__gguf_find(g, key);
    ASSERT_TRUE(kv != NULL);
    return (size_t)((const uint8_t *)kv->key.ptr - g->file.data);
}
static size_t tensor_info_offset(const cs_gguf *g, const char *name) {
    const cs_gguf_tensor *t = cs__gguf_find_tensor(g, name);
    ASSERT_TRUE(t != NULL);
    return (size_t)((const uint8_t *)t->name.ptr - g->file.data) + t->name.len; /* -> n_dims */
}

static void put_u32(uint8_t *b, size_t off, uint32_t v) {
    memcpy(b + off, &v, 4);
}
static void put_u64(uint8_t *b, size_t off, uint64_t v) {
    memcpy(b + off, &v, 8);
}

/* cs__first_duplicate: a table of 300,000 names (O(n): instant; the old
 * pairwise check took minutes), the first repeat found, NULL-free. */
static char dup_names[300000][16];
static const char *dup_name(const void *ctx, size_t i, size_t *len) {
    (void)ctx;
    *len = strlen(dup_names[i]);
    return dup_names[i];
}
static void duplicate_cases(void) {
    size_t n = sizeof dup_names / sizeof dup_names[0];
    for (size_t i = 0; i < n; i++)
        snprintf(dup_names[i], sizeof dup_names[i], "t.%zu", i);
    ASSERT_EQ_INT(cs__first_duplicate(n, dup_name, NULL), -1);
    ASSERT_EQ_INT(cs__first_duplicate(0, dup_name, NULL), -1);
    snprintf(dup_names[n - 1], sizeof dup_names[0], "t.%d", 123);
    ASSERT_EQ_INT(cs__first_duplicate(n, dup_name, NULL), (int64_t)(n - 1));
    snprintf(dup_names[7], sizeof dup_names[0], "t.%d", 5);
    ASSERT_EQ_INT(cs__first_duplicate(n, dup_name, NULL), 7);
    printf("duplicate names: found in O(n) over %zu names\n", n);
}

static void gguf_cases(const char *src) {
    orig = read_all(src, &orig_size);
    uint8_t *b = malloc(orig_size);
    cs_gguf g;
    ASSERT_EQ_INT(cs__gguf_open(src, &g), 0);
    ASSERT_EQ_INT(load_bytes(orig, orig_size), 0);

    expect("empty file", orig, 0, CS_EBADMSG, "empty");
    expect("truncated header", orig, 10, CS_EBADMSG, "truncated");
    expect("truncated tensor data", orig, orig_size - 100, CS_EBADMSG, "past end of file");
    memcpy(b, orig, orig_size), b[0] = 'X';
    expect("bad magic", b, orig_size, CS_EBADMSG, "bad magic");
    memcpy(b, orig, orig_size), put_u32(b, 4, 7);
    expect("wrong version", b, orig_size, CS_ENOTSUP, "version 7");
    memcpy(b, orig, orig_size), put_u64(b, 8, (uint64_t)1 << 60);
    expect("absurd tensor count", b, orig_size, CS_EBADMSG, "absurd");
    memcpy(b, orig, orig_size), put_u64(b, 16, (uint64_t)1 << 62);
    expect("absurd metadata count", b, orig_size, CS_EBADMSG, "absurd");

    size_t q = tensor_info_offset(&g, "blk.0.attn_q.weight");
    memcpy(b, orig, orig_size), put_u64(b, q + 4 + 8, 63); /* rows 64 -> 63 */
    expect("wrong shape", b, orig_size, CS_EBADMSG, "shape");
    memcpy(b, orig, orig_size), put_u32(b, q + 4 + 16, 99);
    expect("unknown type", b, orig_size, CS_ENOTSUP, "type");
    memcpy(b, orig, orig_size), put_u32(b, q + 4 + 16, 11);
    expect("unsupported type q3_K", b, orig_size, CS_ENOTSUP, "q3_K");
    memcpy(b, orig, orig_size), put_u32(b, q + 4 + 16, 23);
    expect("unsupported type iq4_xs", b, orig_size, CS_ENOTSUP, "iq4_xs");
    memcpy(b, orig, orig_size), put_u32(b, q + 4 + 16, 12); /* rows of 64: not whole q4_K blocks */
    expect("q4_K rows of 64", b, orig_size, CS_EBADMSG, "q4_K");
    memcpy(b, orig, orig_size), put_u64(b, q + 4 + 20, (uint64_t)1 << 40);
    expect("tensor out of bounds", b, orig_size, CS_EBADMSG, "past end of file");
    memcpy(b, orig, orig_size), put_u64(b, q + 4 + 20, 4);
    expect("misaligned tensor", b, orig_size, CS_EBADMSG, "aligned");
    memcpy(b, orig, orig_size), put_u32(b, q, 9);
    expect("too many dimensions", b, orig_size, CS_EBADMSG, "dimensions");
    size_t kt = tensor_info_offset(&g, "blk.0.attn_k.weight");
    memcpy(b, orig, orig_size), b[kt - 8] = 'q'; /* "blk.0.attn_q.weight" twice */
    expect("duplicate tensor", b, orig_size, CS_EBADMSG, "duplicate tensor 'blk.0.attn_q.weight'");

    size_t name = key_offset(&g, "general.name");
    memcpy(b, orig, orig_size),
        b[name + 12 + 4 + 8 + 3] = 0xff; /* key, type, length, then the value */
    expect("invalid UTF-8 in metadata", b, orig_size, CS_EBADMSG, "UTF-8");
    memcpy(b, orig, orig_size), b[name + 2] = 0xc0;
    expect("invalid UTF-8 in a key", b, orig_size, CS_EBADMSG, "UTF-8");
    memcpy(b, orig, orig_size), put_u64(b, name - 8, (uint64_t)1 << 50);
    expect("absurd key length", b, orig_size, CS_EBADMSG, "past end of file");

    size_t bc = key_offset(&g, "llama.block_count");
    memcpy(b, orig, orig_size), b[bc] = 'X'; /* "Xlama.block_count": the real key is missing */
    expect("missing config key", b, orig_size, CS_EBADMSG, "llama.block_count");
    memcpy(b, orig, orig_size), put_u32(b, bc + 17, 42);
    expect("unknown value type", b, orig_size, CS_EBADMSG, "unknown");
    memcpy(b, orig, orig_size), put_u32(b, bc + 17 + 4, 1000);
    expect("wrong layer count", b, orig_size, CS_EBADMSG, "missing");
    size_t arch = key_offset(&g, "general.architecture");
    memcpy(b, orig, orig_size), memcpy(b + arch + 20 + 4 + 8, "gpt9x", 5);
    expect("unknown architecture", b, orig_size, CS_ENOTSUP, "architecture");
    size_t tm = key_offset(&g, "tokenizer.ggml.model");
    memcpy(b, orig, orig_size), memcpy(b + tm + 20 + 4 + 8, "bert", 4);
    expect("unknown tokenizer", b, orig_size, CS_ENOTSUP, "tokenizer");

    /* every truncation point in the header, and random byte flips: an error or
     * a model, never a crash */
    size_t hdr = (size_t)(g.data_section - g.file.data);
    for (size_t n = 0; n < hdr; n += 1 + n / 64) {
        int r = load_bytes(orig, n);
        ASSERT_TRUE(r < 0);
    }
    srand(1234);
    int n_err = 0;
    for (int i = 0; i < 300; i++) {
        memcpy(b, orig, orig_size);
        for (int k = 0; k < 4; k++)
            b[(size_t)rand() % hdr] ^= (uint8_t)(1 + rand() % 255);
        n_err += load_bytes(b, orig_size) < 0;
    }
    printf("random header damage: %d of 300 refused, none crashed\n", n_err);
    cs__gguf_close(&g);
    free(b);
    free(orig);
}

static void write_text(const char *dir, const char *file, const char *text) {
    char p[2048];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    write_all(p, (const uint8_t *)text, strlen(text));
}

static void copy_file(const char *from_dir, const char *to_dir, const char *file) {
    char p[2048];
    size_t n;
    snprintf(p, sizeof p, "%s/%s", from_dir, file);
    uint8_t *b = read_all(p, &n);
    snprintf(p, sizeof p, "%s/%s", to_dir, file);
    write_all(p, b, n);
    free(b);
}

static int load_dir(const char *dir) {
    cs_model *m = NULL;
    int r = cs_model_load(dir, &m);
    cs_model_free(m);
    return r;
}

static void hf_cases(const char *src, const char *tmp) {
    char dir[1024], p[2048];
    snprintf(dir, sizeof dir, "%s/malformed-hf", tmp);
    mkdir(dir, 0755);
    copy_file(src, dir, "config.json");
    copy_file(src, dir, "tokenizer.json");
    copy_file(src, dir, "tokenizer_config.json");
    copy_file(src, dir, "model.safetensors");
    ASSERT_EQ_INT(load_dir(dir), 0);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    size_t n;
    uint8_t *st = read_all(p, &n), *b = malloc(n + 64);
    uint64_t hlen;
    memcpy(&hlen, st, 8);

#define CASE(what, code, needle)                                                                   \
    do {                                                                                           \
        int r_ = load_dir(dir);                                                                    \
        printf("%-28s -> %d: %s\n", what, r_, cs_last_error());                                    \
        ASSERT_EQ_INT(r_, code);                                                                   \
        ASSERT_MSG_HAS(cs_last_error(), needle);                                                   \
    } while (0)

    memcpy(b, st, n), put_u64(b, 0, (uint64_t)n);
    write_all(p, b, n);
    CASE("st: header length", CS_EBADMSG, "header length");
    write_all(p, st, 5);
    CASE("st: truncated", CS_EBADMSG, "truncated");
    memcpy(b, st, n), b[8] = '[';
    write_all(p, b, n);
    CASE("st: header not an object", CS_EBADMSG, "JSON object");
    write_all(p, st, n - 64);
    CASE("st: data cut short", CS_EBADMSG, "outside");
    /* replace the first "F32" dtype by "I64" */
    memcpy(b, st, n);
    char *f32 = memmem(b + 8, (size_t)hlen, "\"F32\"", 5);
    ASSERT_TRUE(f32 != NULL);
    memcpy(f32, "\"I64\"", 5);
    write_all(p, b, n);
    CASE("st: unsupported dtype", CS_ENOTSUP, "I64");
    memcpy(b, st, n);
    char *sh = memmem(b + 8, (size_t)hlen, "\"shape\":[64", 11);
    ASSERT_TRUE(sh != NULL);
    sh[10] = '5'; /* 64 -> 65: bytes no longer match */
    write_all(p, b, n);
    CASE("st: shape vs bytes", CS_EBADMSG, "bytes");
    write_all(p, st, n);
    ASSERT_EQ_INT(load_dir(dir), 0);
    char p2[2048]; /* the same tensors again in a second shard */
    snprintf(p2, sizeof p2, "%s/model-2.safetensors", dir);
    write_all(p2, st, n);
    CASE("st: tensor in two shards", CS_EBADMSG, "appears twice");
    unlink(p2);
    ASSERT_EQ_INT(load_dir(dir), 0);

    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"vocab_size\": 512}");
    CASE("config: missing key", CS_EBADMSG, "hidden_size");
    write_text(dir, "config.json", "{\"model_type\": \"gpt_neox\"}");
    CASE("config: unsupported model", CS_ENOTSUP, "gpt_neox");
    write_text(dir, "config.json", "{not json");
    CASE("config: not JSON", CS_EBADMSG, "JSON");
    copy_file(src, dir, "config.json");
    write_text(dir, "tokenizer.json", "{\"model\": {\"type\": \"Unigram\"}}");
    ASSERT_TRUE(load_dir(dir) < 0);
    printf("%-28s -> %s\n", "tokenizer: unigram", cs_last_error());
    write_text(dir, "tokenizer.json", "[1, 2");
    ASSERT_TRUE(load_dir(dir) < 0);
    printf("%-28s -> %s\n", "tokenizer: not JSON", cs_last_error());
    copy_file(src, dir, "tokenizer.json");
    ASSERT_EQ_INT(load_dir(dir), 0);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    CASE("no weights", CS_ENOENT, "safetensors");
    free(st);
    free(b);
#undef CASE
}

/* A quantized file whose block scale is NaN or Inf: refused, naming the tensor. */
static void bad_scale_cases(const char *src) {
    cs_gguf g;
    ASSERT_EQ_INT(cs__gguf_open(src, &g), 0);
    size_t n_bytes = g.file.size;
    uint8_t *b = malloc(n_bytes);
    ASSERT_TRUE(b);
    memcpy(b, g.file.data, n_bytes);
    const cs_gguf_tensor *t = cs__gguf_find_tensor(&g, "blk.1.ffn_down.weight");
    ASSERT_TRUE(t != NULL && t->type == CS_DTYPE_Q8_0);
    size_t at = (size_t)(t->data - g.file.data) + 34 * 5; /* block 5's d */
    b[at] = 0x00, b[at + 1] = 0x7e;                       /* NaN */
    expect("q8_0 scale NaN", b, n_bytes, CS_EBADMSG, "blk.1.ffn_down.weight");
    b[at + 1] = 0xfc; /* -Inf */
    expect("q8_0 scale -Inf", b, n_bytes, CS_EBADMSG, "block 5 has an infinite or NaN scale");
    free(b);
    cs__gguf_close(&g);
}

int main(void) {
    const char *tiny = getenv("CS_TINY_DIR"), *tmp = getenv("CS_TEST_TMPDIR");
    ASSERT_TRUE(tiny && tmp);
    snprintf(tmp_path, sizeof tmp_path, "%s/malformed-%d.gguf", tmp, (int)getpid());
    char src[1024];
    snprintf(src, sizeof src, "%s/f32/tiny.gguf", tiny);
    duplicate_cases();
    gguf_cases(src);
    snprintf(src, sizeof src, "%s/q8_0/tiny.gguf", tiny);
    bad_scale_cases(src);
    unlink(tmp_path);
    snprintf(src, sizeof src, "%s/f32/tiny-hf", tiny);
    hf_cases(src, tmp);
    cs_model *m = NULL;
    ASSERT_EQ_INT(cs_model_load("/nonexistent/model.gguf", &m), CS_ENOENT);
    ASSERT_MSG_HAS(cs_last_error(), "/nonexistent/model.gguf");
    return 0;
}
