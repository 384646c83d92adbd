/* fuzz_tokenizer_roundtrip: property fuzzer for a real tokenizer (the tiny
 * test models' byte-level BPE: $CS_TINY_DIR/f32/tiny.gguf, SmolLM
 * pre-tokenizer and ChatML specials, and $CS_TINY_DIR/qwen2/tiny.gguf,
 * Qwen2 pre-tokenizer), loaded once: encode (pre-tokenizer, BPE merges,
 * special-token matching), decode and the streaming detokenizer
 * (engine/src/tokenizer.c, pretok.c, unicode.c).
 *
 * Input: byte 0 picks the tokenizer (bit 0), parse_special (bit 1), add_bos
 * (bit 2) and skip_special (bit 3); the rest is the text, and also (as
 * little-endian u16 pairs, mod n_vocab) a sequence of token ids.
 * Properties, each an abort() when it fails (what tokenizer.h promises):
 *  - encode refuses invalid UTF-8 with CS_EINVAL and accepts valid UTF-8;
 *  - every id is in range; BOS comes first exactly when add_bos is asked
 *    and the model adds one;
 *  - lossless: decode(encode(text)) == text, byte for byte (the vocabulary
 *    has a token for each of the 256 bytes, checked at load; special-token
 *    text decodes to itself without skip_special);
 *  - encode is deterministic (the same text twice gives the same ids);
 *  - decode of any ids is valid UTF-8;
 *  - streaming: cs_detok_push of each id then cs_detok_flush, concatenated,
 *    equals cs_tokenizer_decode of all ids (both replace each ill-formed
 *    maximal subpart by U+FFFD; the stream holds only incomplete ones).
 * Usage (fallback): fuzz_tokenizer_roundtrip CORPUS_DIR [ITERATIONS]
 *                   fuzz_tokenizer_roundtrip --write-corpus DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/tokenizer.h"
#include "tokenizer-impl.h"
#include "unicode.h"

static cs_tokenizer *toks[2];

static void fail(const char *what, const uint8_t *text, size_t n) {
    fprintf(stderr, "fuzz_tokenizer_roundtrip: %s (text of %zu bytes: '%.*s')\n", what, n,
            (int)(n > 200 ? 200 : n), (const char *)text);
    abort();
}

static void setup(void) {
    cs_log_set_level(CS_LOG_ERROR);
    const char *dir = getenv("CS_TINY_DIR"), *names[2] = {"f32", "qwen2"};
    for (int i = 0; i < 2; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s/tiny.gguf", dir ? dir : "build/test-tmp/tiny", names[i]);
        if (cs_tokenizer_load(path, &toks[i])) {
            fprintf(stderr, "fuzz_tokenizer_roundtrip: cannot load %s (set CS_TINY_DIR): %s\n",
                    path, cs_last_error());
            exit(2);
        }
        for (int b = 0; b < 256; b++) /* what makes the round trip lossless */
            if (toks[i]->byte_id[b] < 0) {
                fprintf(stderr, "fuzz_tokenizer_roundtrip: %s has no token for byte %d\n", path, b);
                exit(2);
            }
    }
}

static void check_stream(const cs_tokenizer *tok, const int32_t *ids, size_t n, bool skip) {
    char *whole = NULL;
    size_t whole_len = 0;
    if (cs_tokenizer_decode(tok, ids, n, skip, &whole, &whole_len)) fail("decode failed", NULL, 0);
    if (!cs__utf8_valid((const uint8_t *)whole, whole_len) || whole[whole_len])
        fail("decode is not valid UTF-8", (const uint8_t *)whole, whole_len);
    char *cat = malloc(whole_len + 16), piece[512];
    size_t cat_len = 0, len;
    if (!cat) abort();
    cs_detok d;
    cs_detok_init(&d, tok, skip);
    for (size_t i = 0; i < n; i++) {
        const char *b;
        size_t tl;
        if (cs_tokenizer_token_bytes(tok, ids[i], &b, &tl) || tl + 8 > sizeof piece) abort();
        if (cs_detok_push(&d, ids[i], piece, sizeof piece, &len))
            fail("detok_push failed", NULL, 0);
        if (cat_len + len > whole_len) fail("the stream is longer than decode", NULL, 0);
        memcpy(cat + cat_len, piece, len);
        cat_len += len;
    }
    if (cs_detok_flush(&d, piece, sizeof piece, &len)) fail("detok_flush failed", NULL, 0);
    if (cat_len + len > whole_len) fail("the stream is longer than decode", NULL, 0);
    memcpy(cat + cat_len, piece, len);
    cat_len += len;
    if (cat_len != whole_len || memcmp(cat, whole, whole_len))
        fail("stream != decode", (const uint8_t *)whole, whole_len);
    free(cat);
    free(whole);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!toks[0]) setup();
    if (!size) return 0;
    const cs_tokenizer *tok = toks[data[0] & 1];
    bool special = data[0] & 2, bos = data[0] & 4, skip = data[0] & 8;
    const uint8_t *text = data + 1;
    size_t n = size - 1;
    int32_t nv = cs_tokenizer_n_vocab(tok);

    /* 1. encode / decode of the text */
    int32_t *ids = NULL, *again = NULL;
    size_t n_ids = 0, n_again = 0;
    bool valid = cs__utf8_valid(text, n);
    int r = cs_tokenizer_encode(tok, (const char *)text, n, special, bos, &ids, &n_ids);
    if (!valid && r != CS_EINVAL) fail("invalid UTF-8 not refused", text, n);
    if (valid && r) fail("valid UTF-8 refused", text, n);
    if (valid) {
        for (size_t i = 0; i < n_ids; i++)
            if (ids[i] < 0 || ids[i] >= nv) fail("id out of range", text, n);
        size_t skip_bos = 0;
        bool adds = bos && tok->add_bos && tok->bos_id >= 0;
        if (adds && (n_ids == 0 || ids[0] != tok->bos_id)) fail("no BOS", text, n);
        if (adds) skip_bos = 1;
        char *back = NULL;
        size_t back_len = 0;
        if (cs_tokenizer_decode(tok, ids + skip_bos, n_ids - skip_bos, false, &back, &back_len))
            fail("decode of encode failed", text, n);
        if (back_len != n || memcmp(back, text, n)) fail("decode(encode(text)) != text", text, n);
        free(back);
        if (cs_tokenizer_encode(tok, (const char *)text, n, special, bos, &again, &n_again) ||
            n_again != n_ids || memcmp(again, ids, n_ids * sizeof *ids))
            fail("encode is not deterministic", text, n);
        check_stream(tok, ids, n_ids, skip);
    }
    free(ids);
    free(again);

    /* 2. arbitrary ids: decode and the stream agree */
    size_t m = n / 2;
    int32_t *any = malloc((m ? m : 1) * sizeof *any);
    if (!any) abort();
    for (size_t i = 0; i < m; i++)
        any[i] = (int32_t)((text[2 * i] | (uint32_t)text[2 * i + 1] << 8) % (uint32_t)nv);
    check_stream(tok, any, m, skip);
    free(any);
    return 0;
}

#ifndef CS_LIBFUZZER
static int fuzz_write_corpus(const char *dir) {
    static const struct {
        const char *name;
        uint8_t mode;
        const char *text;
    } seeds[] = {
        {"ascii", 0, "Hello, world! The quick brown fox jumps over the lazy dog."},
        {"digits", 1, "1234567890 3.14159 x=42; y = -7e10"},
        {"special", 2 | 4, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"},
        {"special-skip", 2 | 8, "<|endoftext|>a<|im_end|><|im_start|>"},
        {"unicode", 1 | 2,
         "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f"
         "\x8f\xbd \xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 "
         "\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8"
         "\xd8\xa7"},
        {"spaces", 0, "  a\t\tb\r\n\r\n   c    \n\n\n'll 've 'S 'T"},
        {"bytes", 8,
         "\xe2\x82\xac\xe2\x82\xff\xc3\x28\xf0\x9f\x98\x80\xf0\x9f\x98\xc0\xc1\xf5\xed\xa0\x80"},
    };
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, seeds[i].name);
        FILE *f = fopen(path, "wb");
        if (!f) return 1;
        fputc(seeds[i].mode, f);
        fputs(seeds[i].text, f);
        if (fclose(f)) return 1;
    }
    return 0;
}
#endif

#include "fuzz_main.h"
