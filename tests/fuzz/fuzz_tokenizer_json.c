/* fuzz_tokenizer_json: fuzz driver for the Hugging Face tokenizer loader
 * (engine/src/tokenizer_json.c, cs__tokenizer_from_hf_json): tokenizer.json
 * (model type and options, vocab, merges in both the "a b" and ["a","b"]
 * forms, added tokens and their flags, normalizer, pre-tokenizer sequences
 * and Split regexes, decoder, post-processor) plus tokenizer_config.json
 * (chat_template, bos/eos tokens, add_bos_token), and then the vocabulary
 * checks of cs__tokenizer_create (engine/src/tokenizer.c: ids, duplicate
 * texts, merges naming tokens whose concatenation is a token).
 *
 * Input: tokenizer.json, one 0x00 byte, then tokenizer_config.json (no NUL:
 * no config file). A tokenizer that loads is then used once: a fixed text
 * with special tokens is encoded and decoded, the chat template applied, the
 * fingerprint taken. Properties besides the sanitizers: a refusal sets
 * cs_last_error(); encoded ids are in range; decode gives valid UTF-8.
 * Seeds: small tokenizers of each supported pre-tokenizer shape written by
 * fuzz_write_corpus (byte-level vocabularies of the printable ASCII bytes).
 * Usage (fallback): fuzz_tokenizer_json CORPUS_DIR [ITERATIONS]
 *                   fuzz_tokenizer_json --write-corpus DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/tokenizer.h"
#include "tokenizer-impl.h"
#include "unicode.h"
#include "fuzz_check.h"

#define check_refusal(r) fuzz_check_refusal("fuzz_tokenizer_json", (r))

static void use(const cs_tokenizer *tok) {
    static const char text[] =
        "Hello, world! 12345 <|im_start|>user\n\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80";
    int32_t *ids = NULL;
    size_t n = 0;
    int r = cs_tokenizer_encode(tok, text, sizeof text - 1, true, true, &ids, &n);
    check_refusal(r);
    if (!r) {
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= cs_tokenizer_n_vocab(tok)) abort();
        char *out = NULL;
        size_t len = 0;
        if (cs_tokenizer_decode(tok, ids, n, false, &out, &len) == 0 &&
            !cs__utf8_valid((const uint8_t *)out, len))
            abort();
        free(out);
    }
    free(ids);
    cs_chat_message msgs[2] = {{.role = "system", .content = "s"},
                               {.role = "user", .content = "hi"}};
    char *chat = NULL;
    check_refusal(cs_tokenizer_apply_chat(tok, msgs, 2, true, &chat));
    free(chat);
    (void)cs_tokenizer_fingerprint(tok);
    for (int32_t id = 0; id < cs_tokenizer_n_vocab(tok) && id < 64; id++) {
        const char *b;
        size_t len;
        if (cs_tokenizer_token_bytes(tok, id, &b, &len)) abort();
        (void)cs_tokenizer_is_eog(tok, id);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) cs_log_set_level(CS_LOG_ERROR), quiet = true;
    const uint8_t *nul = memchr(data, 0, size);
    size_t json_len = nul ? (size_t)(nul - data) : size;
    /* exact-size copies, so an over-read is ASan's to see; the config is a C string */
    char *json = malloc(json_len ? json_len : 1), *cfg = NULL;
    if (!json) abort();
    memcpy(json, data, json_len);
    if (nul) {
        size_t n = size - json_len - 1;
        if (!(cfg = malloc(n + 1))) abort();
        memcpy(cfg, nul + 1, n);
        cfg[n] = 0;
    }
    cs_tokenizer *tok = NULL;
    int r = cs__tokenizer_from_hf_json(json, json_len, cfg, &tok);
    check_refusal(r);
    if (!r) use(tok);
    cs_tokenizer_free(tok);
    free(json);
    free(cfg);
    return 0;
}

#ifndef CS_LIBFUZZER
/* A byte-level BPE vocabulary of the printable ASCII bytes (their
 * byte-level form is themselves), merges "h e", "he l", "l o", ..., and the
 * given added tokens. */
static int write_one(const char *dir, const char *name, const char *pretok, const char *merges,
                     const char *config) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fputs("{\"version\":\"1.0\",\"added_tokens\":["
          "{\"id\":0,\"content\":\"<|im_start|>\",\"special\":true,\"normalized\":false},"
          "{\"id\":1,\"content\":\"<|im_end|>\",\"special\":true,\"normalized\":false},"
          "{\"id\":2,\"content\":\"<tool>\",\"special\":false,\"normalized\":false}],"
          "\"normalizer\":null,\"pre_tokenizer\":",
          f);
    fputs(pretok, f);
    fputs(",\"post_processor\":null,\"decoder\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,"
          "\"trim_offsets\":true,\"use_regex\":true},\"model\":{\"type\":\"BPE\",\"dropout\":null,"
          "\"unk_token\":null,\"byte_fallback\":false,\"ignore_merges\":false,\"vocab\":{"
          "\"<|im_start|>\":0,\"<|im_end|>\":1,\"<tool>\":2",
          f);
    int id = 3;
    for (int c = 0x21; c < 0x7f; c++) {
        if (c == '"' || c == '\\')
            fprintf(f, ",\"\\%c\":%d", c, id++);
        else
            fprintf(f, ",\"%c\":%d", c, id++);
    }
    fprintf(f, ",\"\xc4\xa0\":%d,\"he\":%d,\"hel\":%d,\"lo\":%d,\"\xc4\xa0w\":%d}", id, id + 1,
            id + 2, id + 3, id + 4);
    fprintf(f, ",\"merges\":%s}}", merges);
    if (config) {
        fputc(0, f);
        fputs(config, f);
    }
    return fclose(f) != 0;
}

static int fuzz_write_corpus(const char *dir) {
    static const char bl[] =
        "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
        "\"use_regex\":true}";
    static const char smollm[] =
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":"
        "true},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
        "\"use_regex\":true}]}";
    static const char llama3[] =
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
        "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| "
        "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},"
        "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":"
        "false,\"trim_offsets\":true,\"use_regex\":false}]}";
    static const char qwen2[] =
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
        "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| "
        "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},"
        "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":"
        "false,\"trim_offsets\":false,\"use_regex\":false}]}";
    static const char chatml[] =
        "{\"bos_token\":\"<|im_start|>\",\"eos_token\":\"<|im_end|>\",\"add_bos_token\":false,"
        "\"chat_template\":\"{% for message in messages %}{% if loop.first and "
        "messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' "
        "}}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}\"}";
    static const char llama3_cfg[] =
        "{\"bos_token\":{\"content\":\"<|im_start|>\"},\"add_bos_token\":true,\"chat_template\":"
        "\"{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
        "<|end_header_id|>\\n\\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}\"}";
    return write_one(dir, "bytelevel", bl, "[\"h e\",\"he l\",\"l o\"]", NULL) ||
           write_one(dir, "smollm", smollm, "[\"h e\",\"he l\",\"l o\",\"\xc4\xa0 w\"]", chatml) ||
           write_one(dir, "llama3", llama3, "[[\"h\",\"e\"],[\"he\",\"l\"],[\"l\",\"o\"]]",
                     llama3_cfg) ||
           write_one(dir, "qwen2", qwen2, "[\"h e\",\"l o\"]", "{\"add_bos_token\":false}");
}
#endif

#include "fuzz_main.h"
