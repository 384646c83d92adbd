/* fuzz_chat_template: fuzz driver for chat template rendering
 * (engine/src/chat.c, cs_tokenizer_apply_chat): the template text (a model
 * file's tokenizer.chat_template or tokenizer_config.json's, so outside
 * bytes) is recognised as ChatML, Llama-3 or Gemma or refused; a ChatML default
 * system message is dug out of its string literal (quotes, escapes); the
 * messages (roles, contents: client bytes) are checked and rendered, with
 * Llama-3's | trim over UTF-8 whitespace.
 *
 * Input: byte 0: bit 0 add_generation_prompt, bit 1 the vocabulary has a
 * BOS token; then the template up to the first 0x00; then up to 8 messages,
 * each ended by 0x00: a role byte (% 4: system, user, assistant, or the
 * unsupported "tool") and the content. Each input builds a small tokenizer
 * (cs__tokenizer_create) that carries the template.
 * Properties besides the sanitizers (what jinja2 renders from those
 * templates, as chat.c promises):
 *  - an empty template is CS_ENOTSUP; else a bad role or content that is not
 *    valid UTF-8 is CS_EINVAL; any refusal sets cs_last_error();
 *  - ChatML: the output ends with, per message, "<|im_start|>" role "\n"
 *    content "<|im_end|>\n" (then "<|im_start|>assistant\n" when asked);
 *    anything before is one system block "<|im_start|>system\n...<|im_end|>\n",
 *    and only when the first message is not a system message;
 *  - Llama-3: BOS text first (when the vocabulary has one and there are
 *    messages), one header per message, the assistant header last when asked;
 *  - Gemma: BOS text first (when the vocabulary has one), a turn per message
 *    (a first system message folds into the next), the model turn last when
 *    asked;
 *  - the output is valid UTF-8 when the template is.
 * Usage (fallback): fuzz_chat_template CORPUS_DIR [ITERATIONS]
 *                   fuzz_chat_template --write-corpus DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/tokenizer.h"
#include "tokenizer-impl.h"
#include "unicode.h"

#define MAX_MSGS 8

static void fail(const char *what, const char *out) {
    fprintf(stderr, "fuzz_chat_template: %s\n--- output ---\n%s\n", what, out ? out : "(none)");
    abort();
}

static bool ends_with(const char *s, size_t n, const char *suf, size_t m) {
    return m <= n && memcmp(s + n - m, suf, m) == 0;
}

static size_t count(const char *s, const char *sub) {
    size_t k = 0;
    for (const char *p = strstr(s, sub); p; p = strstr(p + 1, sub))
        k++;
    return k;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) cs_log_set_level(CS_LOG_ERROR), quiet = true;
    if (!size) return 0;
    bool agp = data[0] & 1, has_bos = data[0] & 2;
    /* a NUL-terminated copy split in place: template, then messages */
    char *buf = malloc(size + 1);
    if (!buf) abort();
    memcpy(buf, data + 1, size - 1);
    buf[size - 1] = 0;
    char *end = buf + size - 1, *tmpl = buf, *p = buf + strlen(buf) + 1;
    static const char *roles[4] = {"system", "user", "assistant", "wizard"}; /* the last: refused */
    cs_chat_message msgs[MAX_MSGS] = {{0}};
    size_t n = 0;
    bool bad = false;
    while (p < end && n < MAX_MSGS) {
        msgs[n].role = roles[(uint8_t)*p % 4];
        msgs[n].content = p + 1;
        size_t len = strlen(p + 1); /* p < end: buf[size - 1] ends the last one */
        bad |= (uint8_t)*p % 4 == 3 || !cs__utf8_valid((const uint8_t *)msgs[n].content, len);
        n++;
        p += 1 + len + 1;
    }

    static const char *const tokens[] = {"a", "b", "<|im_start|>", "<|begin_of_text|>"};
    static const int32_t types[] = {CS_TOKEN_NORMAL, CS_TOKEN_NORMAL, CS_TOKEN_CONTROL,
                                    CS_TOKEN_CONTROL};
    cs_vocab_spec spec = {0};
    spec.n_vocab = 4, spec.tokens = tokens, spec.token_types = types;
    spec.bos_id = has_bos ? 3 : -1, spec.eos_id = -1, spec.unk_id = -1, spec.pad_id = -1;
    spec.chat_template = tmpl;
    cs_tokenizer *tok = NULL;
    if (cs__tokenizer_create(&spec, &tok)) fail("cannot build the tokenizer", cs_last_error());

    char *out = NULL;
    int r = cs_tokenizer_apply_chat(tok, msgs, n, agp, &out);
    const char *e = cs_last_error();
    if (r && (!e || !e[0])) fail("a refusal without a message", NULL);
    if (!tmpl[0] && r != CS_ENOTSUP) fail("an empty template not refused", out);
    if (tmpl[0] && bad && r != CS_EINVAL) fail("a bad message not refused", out);
    if (r == 0) {
        size_t len = strlen(out);
        if (cs__utf8_valid((const uint8_t *)tmpl, strlen(tmpl)) &&
            !cs__utf8_valid((const uint8_t *)out, len))
            fail("invalid UTF-8 out of a valid template", out);
        if (strstr(tmpl, "<|im_start|>")) {
            /* what the messages render to, at the end of the output */
            size_t want_len = agp ? 22 : 0;
            for (size_t i = 0; i < n; i++)
                want_len += 12 + strlen(msgs[i].role) + 1 + strlen(msgs[i].content) + 11;
            char *want = malloc(want_len + 1), *w = want;
            if (!want) abort();
            for (size_t i = 0; i < n; i++)
                w += sprintf(w, "<|im_start|>%s\n%s<|im_end|>\n", msgs[i].role, msgs[i].content);
            if (agp) w += sprintf(w, "<|im_start|>assistant\n");
            if ((size_t)(w - want) != want_len || !ends_with(out, len, want, want_len))
                fail("ChatML output does not end with the messages", out);
            size_t pre = len - want_len;
            if (pre) {
                if (n == 0 || !strcmp(msgs[0].role, "system")) fail("an unasked system block", out);
                if (pre < 30 || memcmp(out, "<|im_start|>system\n", 19) ||
                    memcmp(out + pre - 11, "<|im_end|>\n", 11))
                    fail("the default system block is not one block", out);
            }
            free(want);
        } else if (strstr(tmpl, "<|start_header_id|>")) {
            if (n && has_bos && strncmp(out, "<|begin_of_text|>", 17)) fail("no BOS first", out);
            if (count(out, "<|start_header_id|>") < n + agp) fail("a header is missing", out);
            static const char gen[] = "<|start_header_id|>assistant<|end_header_id|>\n\n";
            if (agp && !ends_with(out, len, gen, sizeof gen - 1)) fail("no assistant header", out);
        } else { /* Gemma: bos_token always; a first system message folds into a turn */
            if (has_bos && strncmp(out, "<|begin_of_text|>", 17)) fail("no BOS first", out);
            size_t turns = n - (n && !strcmp(msgs[0].role, "system"));
            if (count(out, "<start_of_turn>") < turns + agp) fail("a turn is missing", out);
            static const char gen[] = "<start_of_turn>model\n";
            if (agp && !ends_with(out, len, gen, sizeof gen - 1)) fail("no model turn", out);
        }
    }
    free(out);
    cs_tokenizer_free(tok);
    free(buf);
    return 0;
}

#ifndef CS_LIBFUZZER
static int write_seed(const char *dir, const char *name, uint8_t mode, const char *tmpl,
                      const char *const *msgs, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fputc(mode, f);
    fputs(tmpl, f);
    fputc(0, f);
    for (size_t i = 0; i < n; i++) {
        fputs(msgs[i], f); /* the role byte is the first character */
        fputc(0, f);
    }
    return fclose(f) != 0;
}

static int fuzz_write_corpus(const char *dir) {
    static const char smollm[] =
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
        "'<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
        "'<|im_start|>assistant\\n' }}{% endif %}";
    static const char qwen[] =
        "{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == "
        "\"system\" and not loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + "
        "message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if "
        "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
        "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- \"<|im_start|>system\\nYou are "
        "Qwen, created by Alibaba Cloud. You are a \\\"helpful\\\" assistant.<|im_end|>\\n\" }}"
        "{%- endif %}";
    static const char llama3[] =
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
        "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
        "bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt "
        "%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
    static const char *const conv[] = {"\x01hi there", "\x02hello! \xc3\xa9\xf0\x9f\x98\x80",
                                       "\x01  and then?\n\t "};
    static const char *const sys[] = {"\x04"
                                      "be brief",
                                      "\x01q"}; /* 4 % 4: system */
    static const char *const bad[] = {"\x01ok", "\x03tool call", "\x01\xc3("};
    return write_seed(dir, "smollm", 1, smollm, conv, 3) ||
           write_seed(dir, "smollm-system", 0, smollm, sys, 2) ||
           write_seed(dir, "qwen", 1, qwen, conv, 2) ||
           write_seed(dir, "llama3", 3, llama3, conv, 3) ||
           write_seed(dir, "llama3-bad", 2, llama3, bad, 3) ||
           write_seed(dir, "unknown", 1, "{{ messages }}", conv, 1) ||
           write_seed(dir, "think", 1, "<|im_start|><think>", conv, 1) ||
           /* an empty default system literal (chat.c passed NULL to memcpy:
              crashes/chat_template-1) */
           write_seed(dir, "empty-default-system", 0, "'<|im_start|>system\n<|im_end|>'", conv, 1);
}
#endif

#include "fuzz_main.h"
