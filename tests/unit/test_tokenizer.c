/* test_tokenizer.c: the BPE tokenizer on a small hand-made byte-level
 * vocabulary: pre-tokenizer splits for each family, merge order, special
 * tokens with parse_special on/off, decoding and streaming detokenization
 * (an emoji split across tokens), invalid input, spec validation,
 * tokenizer.json loading (valid and malformed) and chat templates.
 * Agreement with Hugging Face tokenizers on the real SmolLM2 vocabulary is
 * checked by the fixture tests, not here. */
#include <stdint.h>

#include <cjson/cJSON.h>

#include "chunkserve/error.h"
#include "test.h"
#include "tokenizer-impl.h"
#include "unicode.h"

/* ---- vocabulary builder ------------------------------------------------ */

#define MAXV 300
static char *g_tok[MAXV];
static int32_t g_type[MAXV];
static int32_t g_n;
static char *g_merge[32];
static int32_t g_nm;

/* Byte-level form of raw bytes (GPT-2 bytes_to_unicode). */
static char *byte_level(const char *raw, size_t n) {
    char *s = malloc(n * 2 + 1), *o = s;
    for (size_t i = 0; i < n; i++) {
        uint8_t u[4];
        int k = cs__utf8_encode(cs__byte_to_unicode((uint8_t)raw[i]), u);
        memcpy(o, u, (size_t)k);
        o += k;
    }
    *o = 0;
    return s;
}

static int32_t add_tok(const char *raw, int32_t type) {
    size_t n = strlen(raw);
    if (type == CS_TOKEN_NORMAL) {
        g_tok[g_n] = byte_level(raw, n);
    } else {
        g_tok[g_n] = malloc(n + 1);
        memcpy(g_tok[g_n], raw, n + 1);
    }
    g_type[g_n] = type;
    return g_n++;
}

static void add_merge(const char *l, const char *r) {
    char *bl = byte_level(l, strlen(l)), *br = byte_level(r, strlen(r));
    g_merge[g_nm] = malloc(strlen(bl) + strlen(br) + 2);
    sprintf(g_merge[g_nm], "%s %s", bl, br);
    g_nm++;
    free(bl);
    free(br);
}

enum {
    T_LL = 256,
    T_HE,
    T_HELL,
    T_HELLO,
    T_BC,
    T_AB,
    T_SP_T,
    T_SP_THE,
    T_E1,
    T_E2,
    T_AA,
    T_AAAA,
    T_IM_START,
    T_IM_END,
    T_EOT,
    T_EOM,
    T_TOOL,
    T_TOOL2
};

static const char smollm_template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n' }}{% endif %}";

static const char llama3_template[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

static void build_vocab(void) {
    for (int b = 0; b < 256; b++) {
        char raw[2] = {(char)b, 0};
        g_tok[g_n] = byte_level(raw, 1); /* handles b == 0 too */
        g_type[g_n++] = CS_TOKEN_NORMAL;
    }
    ASSERT_EQ_INT(add_tok("ll", 1), T_LL);
    ASSERT_EQ_INT(add_tok("he", 1), T_HE);
    ASSERT_EQ_INT(add_tok("hell", 1), T_HELL);
    ASSERT_EQ_INT(add_tok("hello", 1), T_HELLO);
    ASSERT_EQ_INT(add_tok("bc", 1), T_BC);
    ASSERT_EQ_INT(add_tok("ab", 1), T_AB);
    ASSERT_EQ_INT(add_tok(" t", 1), T_SP_T);
    ASSERT_EQ_INT(add_tok(" the", 1), T_SP_THE);
    ASSERT_EQ_INT(add_tok("\xf0\x9f", 1), T_E1); /* first half of U+1F600 */
    ASSERT_EQ_INT(add_tok("\x98\x80", 1), T_E2); /* second half */
    ASSERT_EQ_INT(add_tok("aa", 1), T_AA);
    ASSERT_EQ_INT(add_tok("aaaa", 1), T_AAAA);
    ASSERT_EQ_INT(add_tok("<|im_start|>", CS_TOKEN_CONTROL), T_IM_START);
    ASSERT_EQ_INT(add_tok("<|im_end|>", CS_TOKEN_CONTROL), T_IM_END);
    ASSERT_EQ_INT(add_tok("<|endoftext|>", CS_TOKEN_CONTROL), T_EOT);
    ASSERT_EQ_INT(add_tok("<|eom_id|>", CS_TOKEN_CONTROL), T_EOM);
    ASSERT_EQ_INT(add_tok("<tool>", CS_TOKEN_USER_DEFINED), T_TOOL);
    ASSERT_EQ_INT(add_tok("<tool><tool>", CS_TOKEN_USER_DEFINED), T_TOOL2);
    add_merge("l", "l");       /* 0 */
    add_merge("h", "e");       /* 1 */
    add_merge("he", "ll");     /* 2 */
    add_merge("hell", "o");    /* 3 */
    add_merge("b", "c");       /* 4: before "a b", so "abc" is a + bc */
    add_merge("a", "b");       /* 5 */
    add_merge(" ", "t");       /* 6 */
    add_merge(" t", "he");     /* 7 */
    add_merge("\xf0", "\x9f"); /* 8 */
    add_merge("\x98", "\x80"); /* 9 */
    add_merge("a", "a");       /* 10 */
    add_merge("aa", "aa");     /* 11 */
}

static int32_t g_eog[] = {T_EOM};

static cs_vocab_spec base_spec(void) {
    cs_vocab_spec s = {0};
    s.n_vocab = g_n;
    s.tokens = (const char *const *)g_tok;
    s.token_types = g_type;
    s.n_merges = g_nm;
    s.merges = (const char *const *)g_merge;
    s.pretok = CS_PRETOK_SMOLLM;
    s.bos_id = T_IM_START;
    s.eos_id = T_EOT;
    s.unk_id = -1;
    s.pad_id = -1;
    s.eog_ids = g_eog;
    s.n_eog_ids = 1;
    s.add_bos = true;
    s.chat_template = smollm_template;
    return s;
}

static cs_tokenizer *make_tok(void) {
    cs_vocab_spec s = base_spec();
    cs_tokenizer *tok = NULL;
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    return tok;
}

/* ---- helpers ----------------------------------------------------------- */

static size_t enc(const cs_tokenizer *tok, const char *s, bool special, bool bos, int32_t *out,
                  size_t cap) {
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_EQ_INT(cs_tokenizer_encode(tok, s, strlen(s), special, bos, &ids, &n), 0);
    ASSERT_TRUE(ids != NULL);
    ASSERT_TRUE(n <= cap);
    if (n) memcpy(out, ids, n * sizeof *ids);
    free(ids);
    return n;
}

#define ASSERT_IDS(tok, text, special, bos, ...)                                                   \
    do {                                                                                           \
        const int32_t want_[] = {__VA_ARGS__};                                                     \
        int32_t got_[64];                                                                          \
        size_t n_ = enc(tok, text, special, bos, got_, 64);                                        \
        ASSERT_EQ_INT(n_, sizeof want_ / sizeof want_[0]);                                         \
        for (size_t i_ = 0; i_ < n_; i_++)                                                         \
            ASSERT_EQ_INT(got_[i_], want_[i_]);                                                    \
    } while (0)

static char *dec(const cs_tokenizer *tok, const int32_t *ids, size_t n, bool skip) {
    char *text = NULL;
    size_t len = 0;
    ASSERT_EQ_INT(cs_tokenizer_decode(tok, ids, n, skip, &text, &len), 0);
    ASSERT_EQ_INT(strlen(text), len);
    return text;
}

/* ---- tests ------------------------------------------------------------- */

static void test_pretok_cases(void) {
    static const struct {
        enum cs_pretok kind;
        const char *text;
        const char *pieces[12];
    } cases[] = {
        /* Expected pieces from Hugging Face tokenizers' regex Split. */
        {CS_PRETOK_GPT2, "Hello  world", {"Hello", " ", " world"}},
        {CS_PRETOK_GPT2, "don't stop", {"don", "'t", " stop"}},
        {CS_PRETOK_GPT2, " 's x", {" '", "s", " x"}},
        {CS_PRETOK_GPT2,
         "a\x0a\x0a"
         "b ",
         {"a", "\x0a", "\x0a", "b", " "}},
        {CS_PRETOK_GPT2, "x  \x09y", {"x", "  ", "\x09", "y"}},
        {CS_PRETOK_GPT2, "123 45", {"123", " 45"}},
        {CS_PRETOK_GPT2, "foo!!  bar", {"foo", "!!", " ", " bar"}},
        {CS_PRETOK_GPT2, "  ", {"  "}},
        {CS_PRETOK_SMOLLM, "abc123 x", {"abc", "1", "2", "3", " x"}},
        {CS_PRETOK_SMOLLM, "a 1", {"a", " ", "1"}},
        {CS_PRETOK_SMOLLM, "12.5%", {"1", "2", ".", "5", "%"}},
        {CS_PRETOK_SMOLLM, "2024-01-01", {"2", "0", "2", "4", "-", "0", "1", "-", "0", "1"}},
        {CS_PRETOK_LLAMA3, "Hello  world", {"Hello", " ", " world"}},
        {CS_PRETOK_LLAMA3, "DON'T", {"DON", "'T"}},
        {CS_PRETOK_LLAMA3, "x'\xc5\xbfx", {"x", "'\xc5\xbf", "x"}},
        {CS_PRETOK_LLAMA3, "12345", {"123", "45"}},
        {CS_PRETOK_LLAMA3, "(hello)\x0a\x0a  x", {"(hello", ")\x0a\x0a", " ", " x"}},
        {CS_PRETOK_LLAMA3, "!!\x0d\x0a", {"!!\x0d\x0a"}},
        {CS_PRETOK_LLAMA3, "a \x0a b", {"a", " \x0a", " b"}},
        {CS_PRETOK_QWEN2, "12345", {"1", "2", "3", "4", "5"}},
        {CS_PRETOK_QWEN2, "x'S y", {"x", "'S", " y"}},
        {CS_PRETOK_QWEN2, "a \x0a b", {"a", " \x0a", " b"}},
    };
    cs__pieces p = {0};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *t = cases[c].text;
        ASSERT_EQ_INT(cs__pretok_split(cases[c].kind, t, strlen(t), &p), 0);
        size_t start = 0, k = 0;
        for (; k < p.n; k++) {
            const char *want = cases[c].pieces[k];
            ASSERT_TRUE(want != NULL);
            char got[64];
            size_t len = p.ends[k] - start;
            memcpy(got, t + start, len);
            got[len] = 0;
            ASSERT_EQ_STR(got, want);
            start = p.ends[k];
        }
        ASSERT_TRUE(cases[c].pieces[k] == NULL);
        ASSERT_EQ_INT(start, strlen(t));
    }
    ASSERT_EQ_INT(cs__pretok_split(CS_PRETOK_GPT2, "", 0, &p), 0);
    ASSERT_EQ_INT(p.n, 0);
    ASSERT_EQ_INT(cs__pretok_split(CS_PRETOK_GPT2, "a\xff", 2, &p), CS_EINVAL);
    free(p.ends);

    enum cs_pretok k;
    ASSERT_EQ_INT(cs__pretok_from_name("smollm", &k), 0);
    ASSERT_EQ_INT(k, CS_PRETOK_SMOLLM);
    ASSERT_EQ_INT(cs__pretok_from_name("starcoder", &k), 0);
    ASSERT_EQ_INT(k, CS_PRETOK_SMOLLM);
    ASSERT_EQ_INT(cs__pretok_from_name("gpt-2", &k), 0);
    ASSERT_EQ_INT(k, CS_PRETOK_GPT2);
    ASSERT_EQ_INT(cs__pretok_from_name("llama-bpe", &k), 0);
    ASSERT_EQ_INT(k, CS_PRETOK_LLAMA3);
    ASSERT_EQ_INT(cs__pretok_from_name("qwen2", &k), 0);
    ASSERT_EQ_INT(k, CS_PRETOK_QWEN2);
    ASSERT_EQ_INT(cs__pretok_from_name("deepseek-coder", &k), CS_ENOTSUP);
    ASSERT_MSG_HAS(cs_last_error(), "deepseek-coder");
    ASSERT_EQ_STR(cs__pretok_name(CS_PRETOK_LLAMA3), "llama3");
}

static void test_encode(void) {
    cs_tokenizer *tok = make_tok();
    ASSERT_EQ_INT(cs_tokenizer_n_vocab(tok), g_n);
    ASSERT_EQ_INT(cs_tokenizer_bos(tok), T_IM_START);
    ASSERT_EQ_INT(cs_tokenizer_eos(tok), T_EOT);

    ASSERT_IDS(tok, "hello", false, false, T_HELLO);
    ASSERT_IDS(tok, "hello the", false, false, T_HELLO, T_SP_THE);
    /* Lowest rank first: "b c" (4) beats "a b" (5). */
    ASSERT_IDS(tok, "abc", false, false, 'a', T_BC);
    ASSERT_IDS(tok, "ab", false, false, T_AB);
    /* Leftmost pair first on equal ranks: aa aa a -> aaaa a. */
    ASSERT_IDS(tok, "aaaaa", false, false, T_AAAA, 'a');
    /* Digits are isolated (SmolLM), so no merges across them. */
    ASSERT_IDS(tok, "a1b", false, false, 'a', '1', 'b');
    ASSERT_IDS(tok, "\xf0\x9f\x98\x80", false, false, T_E1, T_E2);
    ASSERT_IDS(tok, "", false, false);
    ASSERT_IDS(tok, "", false, true, T_IM_START);
    ASSERT_IDS(tok, "he", false, true, T_IM_START, T_HE);

    /* Special tokens: parsed only with parse_special; USER_DEFINED always. */
    ASSERT_IDS(tok, "<|im_start|>hello<|im_end|>", true, false, T_IM_START, T_HELLO, T_IM_END);
    int32_t ids[64];
    size_t n = enc(tok, "<|im_start|>", false, false, ids, 64);
    ASSERT_EQ_INT(n, 12);
    ASSERT_EQ_INT(ids[0], '<');
    ASSERT_EQ_INT(ids[11], '>');
    ASSERT_IDS(tok, "x<tool>y", false, false, 'x', T_TOOL, 'y');
    ASSERT_IDS(tok, "<tool><tool><tool>", false, false, T_TOOL2, T_TOOL); /* longest match */
    ASSERT_IDS(tok, "<|im_end", true, false, '<', '|', 'i', 'm', '_', 'e', 'n', 'd');

    /* Invalid UTF-8 is refused, not guessed at. */
    static const char *bad[] = {"\xff", "a\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                                "ok\xe2\x82"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int32_t *out = (int32_t *)1;
        size_t nout = 1;
        ASSERT_EQ_INT(cs_tokenizer_encode(tok, bad[i], strlen(bad[i]), true, false, &out, &nout),
                      CS_EINVAL);
        ASSERT_TRUE(out == NULL);
        ASSERT_EQ_INT(nout, 0);
    }

    /* Long inputs stay linear-ish: 20000 'a' -> 5000 "aaaa". */
    size_t big = 20000;
    char *s = malloc(big + 1);
    memset(s, 'a', big);
    s[big] = 0;
    int32_t *out = NULL;
    size_t nout = 0;
    ASSERT_EQ_INT(cs_tokenizer_encode(tok, s, big, false, false, &out, &nout), 0);
    ASSERT_EQ_INT(nout, big / 4);
    for (size_t i = 0; i < nout; i++)
        ASSERT_EQ_INT(out[i], T_AAAA);
    free(out);
    free(s);
    cs_tokenizer_free(tok);
}

static void test_ignore_merges(void) {
    /* "hello" is in the vocabulary: with ignore_merges it is taken whole
     * even if merges could not build it. Drop merge 3 ("hell o") to see. */
    cs_vocab_spec s = base_spec();
    char *saved = g_merge[3];
    g_merge[3] = g_merge[2]; /* duplicate: must be rejected */
    cs_tokenizer *tok = NULL;
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), CS_EBADMSG);
    ASSERT_MSG_HAS(cs_last_error(), "duplicates");
    g_merge[3] = saved;

    s.n_merges = 3; /* only "l l", "h e", "he ll" */
    s.pretok = CS_PRETOK_GPT2;
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    ASSERT_IDS(tok, "hello", false, false, T_HELL, 'o');
    cs__tokenizer_set_ignore_merges(tok, true);
    ASSERT_IDS(tok, "hello", false, false, T_HELLO);
    cs_tokenizer_free(tok);

    s.pretok = CS_PRETOK_LLAMA3; /* on by default, as llama.cpp does for llama-bpe */
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    ASSERT_IDS(tok, "hello", false, false, T_HELLO);
    cs_tokenizer_free(tok);
}

static void test_decode(void) {
    cs_tokenizer *tok = make_tok();
    int32_t ids[] = {T_IM_START, T_HELLO, T_SP_THE, T_E1, T_E2, T_IM_END};
    char *t = dec(tok, ids, 6, false);
    ASSERT_EQ_STR(t, "<|im_start|>hello the\xf0\x9f\x98\x80<|im_end|>");
    free(t);
    t = dec(tok, ids, 6, true);
    ASSERT_EQ_STR(t, "hello the\xf0\x9f\x98\x80");
    free(t);
    /* Half a character: U+FFFD, once per maximal ill-formed subpart. */
    int32_t half[] = {'a', T_E1, 'b', T_E2, 0xFF};
    t = dec(tok, half, 5, false);
    ASSERT_EQ_STR(t, "a\xef\xbf\xbd"
                     "b\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    free(t);
    /* USER_DEFINED tokens are text, not control: kept by skip_special. */
    int32_t tool[] = {T_TOOL, T_EOT};
    t = dec(tok, tool, 2, true);
    ASSERT_EQ_STR(t, "<tool>");
    free(t);
    t = dec(tok, NULL, 0, false);
    ASSERT_EQ_STR(t, "");
    free(t);
    int32_t bad[] = {1, g_n};
    char *x = (char *)1;
    size_t len = 7;
    ASSERT_EQ_INT(cs_tokenizer_decode(tok, bad, 2, false, &x, &len), CS_EINVAL);
    ASSERT_TRUE(x == NULL);
    int32_t neg[] = {-1};
    ASSERT_EQ_INT(cs_tokenizer_decode(tok, neg, 1, false, &x, &len), CS_EINVAL);

    const char *b;
    size_t bl;
    ASSERT_EQ_INT(cs_tokenizer_token_bytes(tok, T_SP_THE, &b, &bl), 0);
    ASSERT_EQ_INT(bl, 4);
    ASSERT_TRUE(memcmp(b, " the", 4) == 0);
    ASSERT_EQ_INT(cs_tokenizer_token_bytes(tok, ' ', &b, &bl), 0);
    ASSERT_EQ_INT(bl, 1);
    ASSERT_EQ_INT(b[0], ' ');
    ASSERT_EQ_INT(cs_tokenizer_token_bytes(tok, 0, &b, &bl), 0); /* the NUL byte */
    ASSERT_EQ_INT(bl, 1);
    ASSERT_EQ_INT(b[0], 0);
    ASSERT_EQ_INT(cs_tokenizer_token_bytes(tok, T_IM_END, &b, &bl), 0);
    ASSERT_EQ_STR(b, "<|im_end|>");
    ASSERT_EQ_INT(cs_tokenizer_token_bytes(tok, g_n, &b, &bl), CS_EINVAL);

    ASSERT_TRUE(cs_tokenizer_is_eog(tok, T_EOT));    /* eos */
    ASSERT_TRUE(cs_tokenizer_is_eog(tok, T_IM_END)); /* by its text */
    ASSERT_TRUE(cs_tokenizer_is_eog(tok, T_EOM));    /* eog_ids */
    ASSERT_TRUE(!cs_tokenizer_is_eog(tok, T_IM_START));
    ASSERT_TRUE(!cs_tokenizer_is_eog(tok, 'a'));
    ASSERT_TRUE(!cs_tokenizer_is_eog(tok, -1));
    ASSERT_TRUE(!cs_tokenizer_is_eog(tok, g_n));
    ASSERT_TRUE(cs_tokenizer_is_special(tok, T_IM_START));
    ASSERT_TRUE(!cs_tokenizer_is_special(tok, T_TOOL));
    ASSERT_TRUE(!cs_tokenizer_is_special(tok, T_HELLO));
    cs_tokenizer_free(tok);
}

static void test_detok(void) {
    cs_tokenizer *tok = make_tok();
    cs_detok d;
    char out[64];
    size_t n;
    cs_detok_init(&d, tok, true);
    ASSERT_EQ_INT(cs_detok_push(&d, T_HELLO, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 5);
    ASSERT_TRUE(memcmp(out, "hello", 5) == 0);
    /* The emoji's first half is held back until the second half arrives. */
    ASSERT_EQ_INT(cs_detok_push(&d, T_E1, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 0);
    ASSERT_EQ_INT(d.n_pending, 2);
    /* A skipped special token in between does not break the character. */
    ASSERT_EQ_INT(cs_detok_push(&d, T_IM_END, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 0);
    /* Too small a buffer: CS_ERANGE and nothing consumed. */
    ASSERT_EQ_INT(cs_detok_push(&d, T_E2, out, 3, &n), CS_ERANGE);
    ASSERT_EQ_INT(d.n_pending, 2);
    ASSERT_EQ_INT(cs_detok_push(&d, T_E2, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 4);
    ASSERT_TRUE(memcmp(out, "\xf0\x9f\x98\x80", 4) == 0);
    ASSERT_EQ_INT(cs_detok_flush(&d, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 0);

    /* Byte by byte: 0xF0 0x9F 0x98 0x80 as four single-byte tokens. */
    cs_detok_init(&d, tok, false);
    const int32_t bytes[] = {0xF0, 0x9F, 0x98, 0x80};
    size_t total = 0;
    for (int i = 0; i < 4; i++) {
        ASSERT_EQ_INT(cs_detok_push(&d, bytes[i], out + total, sizeof out - total, &n), 0);
        ASSERT_EQ_INT(n, i < 3 ? 0 : 4);
        total += n;
    }
    /* An interrupted character becomes U+FFFD, and the next one survives. */
    ASSERT_EQ_INT(cs_detok_push(&d, T_E1, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(cs_detok_push(&d, 'a', out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 4);
    ASSERT_TRUE(memcmp(out,
                       "\xef\xbf\xbd"
                       "a",
                       4) == 0);
    /* Special tokens print when not skipped. */
    ASSERT_EQ_INT(cs_detok_push(&d, T_IM_END, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 10);
    /* End of stream inside a character. */
    ASSERT_EQ_INT(cs_detok_push(&d, T_E1, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 0);
    ASSERT_EQ_INT(cs_detok_flush(&d, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 3);
    ASSERT_TRUE(memcmp(out, "\xef\xbf\xbd", 3) == 0);
    ASSERT_EQ_INT(d.n_pending, 0);
    ASSERT_EQ_INT(cs_detok_push(&d, g_n, out, sizeof out, &n), CS_EINVAL);
    ASSERT_EQ_INT(cs_detok_push(&d, -5, out, sizeof out, &n), CS_EINVAL);
    cs_tokenizer_free(tok);
}

static void expect_spec_error(cs_vocab_spec *s, int code, const char *needle) {
    cs_tokenizer *tok = (cs_tokenizer *)1;
    ASSERT_EQ_INT(cs__tokenizer_create(s, &tok), code);
    ASSERT_TRUE(tok == NULL);
    if (needle) ASSERT_MSG_HAS(cs_last_error(), needle);
}

static void test_spec_validation(void) {
    cs_vocab_spec s = base_spec();
    s.bos_id = g_n;
    expect_spec_error(&s, CS_EBADMSG, "bos");
    s = base_spec();
    s.eos_id = -2;
    expect_spec_error(&s, CS_EBADMSG, "eos");
    s = base_spec();
    int32_t bad_eog = 100000;
    s.eog_ids = &bad_eog;
    expect_spec_error(&s, CS_EBADMSG, "100000");
    s = base_spec();
    s.n_vocab = 0;
    expect_spec_error(&s, CS_EBADMSG, NULL);

    /* Duplicate token text. */
    s = base_spec();
    char *saved = g_tok[T_AB];
    g_tok[T_AB] = g_tok[T_BC];
    expect_spec_error(&s, CS_EBADMSG, "both");
    g_tok[T_AB] = saved;

    /* Bad token type. */
    s = base_spec();
    g_type[T_AB] = 9;
    expect_spec_error(&s, CS_EBADMSG, "type");
    g_type[T_AB] = CS_TOKEN_NORMAL;

    /* Merges that name unknown tokens, or have no separator. */
    s = base_spec();
    const char *merges[] = {"l l", "zz qq"};
    s.merges = merges;
    s.n_merges = 2;
    expect_spec_error(&s, CS_EBADMSG, "merge 1");
    const char *merges2[] = {"ll"};
    s.merges = merges2;
    s.n_merges = 1;
    expect_spec_error(&s, CS_EBADMSG, "no space");
    const char *merges3[] = {"b a"}; /* "ba" is not a token */
    s.merges = merges3;
    expect_spec_error(&s, CS_EBADMSG, "unknown");

    /* Explicit lengths: tokens need not be NUL-terminated. */
    s = base_spec();
    size_t *lens = malloc((size_t)g_n * sizeof *lens);
    for (int32_t i = 0; i < g_n; i++)
        lens[i] = strlen(g_tok[i]);
    lens[0] = 1; /* token 0 is byte 0x00 as "Ā" (2 bytes): its first byte alone */
    s.token_lens = lens;
    cs_tokenizer *tok = NULL;
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    cs_tokenizer_free(tok);
    free(lens);
    cs_tokenizer_free(NULL);
}

/* ---- tokenizer.json ---------------------------------------------------- */

enum {
    J_OK,
    J_PAIRS,
    J_GPT2,
    J_LLAMA3,
    J_NOT_JSON,
    J_TRUNC,
    J_NO_MODEL,
    J_WORDPIECE,
    J_WHITESPACE,
    J_BAD_REGEX,
    J_ID_STRING,
    J_ID_HOLE,
    J_ID_HUGE,
    J_MERGES_OBJECT,
    J_MERGE_UNKNOWN,
    J_ADDED_CONFLICT,
    J_LOWERCASE,
    J_PREFIX_SPACE,
    J_VOCAB_ARRAY,
    J_MERGE_NUMBER,
    J_ROBERTA,
    J_COUNT
};

static char *make_json(int variant) {
    if (variant == J_NOT_JSON) {
        char *s = malloc(16);
        strcpy(s, "{not json");
        return s;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", variant == J_WORDPIECE ? "WordPiece" : "BPE");
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int32_t i = 0; i < g_n; i++) {
        if (g_type[i] != CS_TOKEN_NORMAL) {
            cJSON *a = cJSON_CreateObject();
            cJSON_AddNumberToObject(a, "id", i);
            cJSON_AddStringToObject(a, "content", g_tok[i]);
            cJSON_AddBoolToObject(a, "special", g_type[i] == CS_TOKEN_CONTROL);
            cJSON_AddItemToArray(added, a);
            continue;
        }
        if (variant == J_ID_HOLE && i == 100) continue;
        if (variant == J_ID_STRING && i == 5) {
            cJSON_AddStringToObject(vocab, g_tok[i], "5");
        } else if (variant == J_ID_HUGE && i == 5) {
            cJSON_AddNumberToObject(vocab, g_tok[i], 4e9);
        } else {
            cJSON_AddNumberToObject(vocab, g_tok[i], i);
        }
    }
    if (variant == J_ADDED_CONFLICT) {
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", 'a');
        cJSON_AddStringToObject(a, "content", "<conflict>");
        cJSON_AddItemToArray(added, a);
    }
    cJSON *merges = variant == J_MERGES_OBJECT ? cJSON_AddObjectToObject(model, "merges")
                                               : cJSON_AddArrayToObject(model, "merges");
    for (int32_t r = 0; r < g_nm && variant != J_MERGES_OBJECT; r++) {
        if (variant == J_PAIRS) {
            char *sp = strchr(g_merge[r], ' ');
            *sp = 0;
            const char *pair[2] = {g_merge[r], sp + 1};
            cJSON_AddItemToArray(merges, cJSON_CreateStringArray(pair, 2));
            *sp = ' ';
        } else {
            cJSON_AddItemToArray(merges, cJSON_CreateString(g_merge[r]));
        }
    }
    if (variant == J_MERGE_UNKNOWN) cJSON_AddItemToArray(merges, cJSON_CreateString("zz qq"));
    if (variant == J_MERGE_NUMBER) cJSON_AddItemToArray(merges, cJSON_CreateNumber(3));
    if (variant == J_VOCAB_ARRAY) cJSON_ReplaceItemInObject(model, "vocab", cJSON_CreateArray());
    if (variant == J_NO_MODEL) cJSON_DeleteItemFromObject(root, "model");

    cJSON *bl = cJSON_CreateObject();
    cJSON_AddStringToObject(bl, "type", "ByteLevel");
    cJSON_AddBoolToObject(bl, "add_prefix_space", variant == J_PREFIX_SPACE);
    cJSON_AddBoolToObject(bl, "trim_offsets", true);
    cJSON_AddBoolToObject(bl, "use_regex", variant != J_LLAMA3 && variant != J_BAD_REGEX);
    cJSON *pt;
    if (variant == J_GPT2 || variant == J_PREFIX_SPACE) {
        pt = bl;
    } else if (variant == J_WHITESPACE) {
        cJSON_Delete(bl);
        pt = cJSON_CreateObject();
        cJSON_AddStringToObject(pt, "type", "Whitespace");
    } else {
        pt = cJSON_CreateObject();
        cJSON_AddStringToObject(pt, "type", "Sequence");
        cJSON *list = cJSON_AddArrayToObject(pt, "pretokenizers");
        cJSON *first = cJSON_CreateObject();
        if (variant == J_LLAMA3 || variant == J_BAD_REGEX) {
            cJSON_AddStringToObject(first, "type", "Split");
            cJSON *pat = cJSON_AddObjectToObject(first, "pattern");
            cJSON_AddStringToObject(
                pat, "Regex",
                variant == J_BAD_REGEX
                    ? "\\w+|[^\\w\\s]+"
                    : "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+");
            cJSON_AddStringToObject(first, "behavior", "Isolated");
            cJSON_AddBoolToObject(first, "invert", false);
        } else {
            cJSON_AddStringToObject(first, "type", "Digits");
            cJSON_AddBoolToObject(first, "individual_digits", true);
        }
        cJSON_AddItemToArray(list, first);
        cJSON_AddItemToArray(list, bl);
    }
    cJSON_AddItemToObject(root, "pre_tokenizer", pt);
    if (variant == J_LOWERCASE) {
        cJSON *n = cJSON_AddObjectToObject(root, "normalizer");
        cJSON_AddStringToObject(n, "type", "Lowercase");
    }
    cJSON *dec = cJSON_AddObjectToObject(root, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON *pp = cJSON_AddObjectToObject(root, "post_processor");
    cJSON_AddStringToObject(pp, "type", variant == J_ROBERTA ? "RobertaProcessing" : "ByteLevel");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (variant == J_TRUNC) s[strlen(s) / 2] = 0;
    return s;
}

static int load_json(int variant, const char *cfg, cs_tokenizer **tok) {
    char *js = make_json(variant);
    int rc = cs__tokenizer_from_hf_json(js, strlen(js), cfg, tok);
    free(js);
    return rc;
}

static void test_json(void) {
    static const struct {
        int variant, code;
        const char *needle;
    } cases[] = {
        {J_OK, 0, NULL},
        {J_PAIRS, 0, NULL},
        {J_GPT2, 0, NULL},
        {J_LLAMA3, 0, NULL},
        {J_NOT_JSON, CS_EBADMSG, "JSON"},
        {J_TRUNC, CS_EBADMSG, "JSON"},
        {J_NO_MODEL, CS_EBADMSG, "model"},
        {J_WORDPIECE, CS_ENOTSUP, "WordPiece"},
        {J_WHITESPACE, CS_ENOTSUP, "Whitespace"},
        {J_BAD_REGEX, CS_ENOTSUP, "\\w+"},
        {J_ID_STRING, CS_EBADMSG, "id"},
        {J_ID_HOLE, CS_EBADMSG, "100"},
        {J_ID_HUGE, CS_EBADMSG, "id"},
        {J_MERGES_OBJECT, CS_EBADMSG, "merges"},
        {J_MERGE_UNKNOWN, CS_EBADMSG, "unknown"},
        {J_ADDED_CONFLICT, CS_EBADMSG, "<conflict>"},
        {J_LOWERCASE, CS_ENOTSUP, "Lowercase"},
        {J_PREFIX_SPACE, CS_ENOTSUP, "add_prefix_space"},
        {J_VOCAB_ARRAY, CS_EBADMSG, "vocab"},
        {J_MERGE_NUMBER, CS_EBADMSG, "merge"},
        {J_ROBERTA, CS_ENOTSUP, "RobertaProcessing"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cs_tokenizer *tok = (cs_tokenizer *)1;
        int rc = load_json(cases[i].variant, NULL, &tok);
        if (rc != cases[i].code)
            fprintf(stderr, "variant %d: %s\n", cases[i].variant, cs_last_error());
        ASSERT_EQ_INT(rc, cases[i].code);
        if (rc) {
            ASSERT_TRUE(tok == NULL);
            ASSERT_MSG_HAS(cs_last_error(), cases[i].needle);
            continue;
        }
        /* Same ids as the spec-built tokenizer (no BOS without a config). */
        ASSERT_IDS(tok, "<|im_start|>hello the abc<tool>", true, true, T_IM_START, T_HELLO,
                   T_SP_THE, ' ', 'a', T_BC, T_TOOL);
        ASSERT_EQ_INT(cs_tokenizer_eos(tok), -1);
        ASSERT_TRUE(cs_tokenizer_is_special(tok, T_IM_END));
        ASSERT_TRUE(!cs_tokenizer_is_special(tok, T_TOOL));
        if (cases[i].variant == J_LLAMA3)
            ASSERT_IDS(tok, "12345", false, false, '1', '2', '3', '4', '5');
        else if (cases[i].variant == J_GPT2)
            ASSERT_IDS(tok, "a 1", false, false, 'a', ' ', '1');
        cs_tokenizer_free(tok);
    }

    /* tokenizer_config.json: special ids, BOS policy, template. */
    cJSON *cfg = cJSON_CreateObject();
    cJSON_AddStringToObject(cfg, "bos_token", "<|im_start|>");
    cJSON *eos = cJSON_AddObjectToObject(cfg, "eos_token");
    cJSON_AddStringToObject(eos, "content", "<|im_end|>");
    cJSON_AddBoolToObject(cfg, "add_bos_token", true);
    cJSON_AddStringToObject(cfg, "chat_template", smollm_template);
    char *cfgs = cJSON_PrintUnformatted(cfg);
    cs_tokenizer *tok = NULL;
    ASSERT_EQ_INT(load_json(J_OK, cfgs, &tok), 0);
    ASSERT_EQ_INT(cs_tokenizer_bos(tok), T_IM_START);
    ASSERT_EQ_INT(cs_tokenizer_eos(tok), T_IM_END);
    ASSERT_IDS(tok, "hello", false, true, T_IM_START, T_HELLO);
    cs_chat_message m = {.role = "user", .content = "hi"};
    char *text = NULL;
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, &m, 1, false, &text), 0);
    ASSERT_MSG_HAS(text, "<|im_start|>user\nhi<|im_end|>\n");
    free(text);
    cs_tokenizer_free(tok);
    free(cfgs);

    cJSON_ReplaceItemInObject(cfg, "add_bos_token", cJSON_CreateString("yes"));
    cfgs = cJSON_PrintUnformatted(cfg);
    ASSERT_EQ_INT(load_json(J_OK, cfgs, &tok), CS_EBADMSG);
    ASSERT_MSG_HAS(cs_last_error(), "add_bos_token");
    free(cfgs);
    cJSON_ReplaceItemInObject(cfg, "add_bos_token", cJSON_CreateBool(false));
    cJSON_ReplaceItemInObject(cfg, "bos_token", cJSON_CreateString("<nope>"));
    cfgs = cJSON_PrintUnformatted(cfg);
    ASSERT_EQ_INT(load_json(J_OK, cfgs, &tok), CS_EBADMSG);
    ASSERT_MSG_HAS(cs_last_error(), "<nope>");
    free(cfgs);
    cJSON_Delete(cfg);
    ASSERT_EQ_INT(load_json(J_OK, "{\"eos_token\": ", &tok), CS_EBADMSG);
    ASSERT_MSG_HAS(cs_last_error(), "tokenizer_config.json");

    /* Every truncation of a valid file fails cleanly; none crashes. */
    char *js = make_json(J_OK);
    size_t len = strlen(js);
    for (size_t cut = 0; cut < len; cut += 1 + cut / 16) {
        tok = (cs_tokenizer *)1;
        ASSERT_EQ_INT(cs__tokenizer_from_hf_json(js, cut, NULL, &tok), CS_EBADMSG);
        ASSERT_TRUE(tok == NULL);
    }
    /* Byte flips may or may not still parse; they must not crash or leak. */
    uint32_t rng = 12345;
    for (int k = 0; k < 300; k++) {
        char *copy = malloc(len + 1);
        memcpy(copy, js, len + 1);
        for (int f = 0; f < 3; f++) {
            rng = rng * 1664525u + 1013904223u;
            copy[(rng >> 8) % len] = (char)(rng >> 24);
        }
        tok = NULL;
        if (cs__tokenizer_from_hf_json(copy, len, NULL, &tok) == 0) cs_tokenizer_free(tok);
        free(copy);
    }
    free(js);
}

/* ---- chat templates ---------------------------------------------------- */

static void test_chat(void) {
    cs_tokenizer *tok = make_tok();
    char *text = NULL;
    cs_chat_message one[] = {{.role = "user", .content = "Hi"}};
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, one, 1, true, &text), 0);
    ASSERT_EQ_STR(text,
                  "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                  "<|im_start|>assistant\n");
    free(text);
    cs_chat_message three[] = {{.role = "system", .content = "S"},
                               {.role = "user", .content = "U"},
                               {.role = "assistant", .content = "A"}};
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, three, 3, false, &text), 0);
    ASSERT_EQ_STR(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                        "<|im_start|>assistant\nA<|im_end|>\n");
    free(text);
    /* continue_final_message: the last message left open */
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, three, 3, CS_CHAT_CONTINUE, &text), 0);
    ASSERT_EQ_STR(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                        "<|im_start|>assistant\nA");
    free(text);
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, NULL, 0, CS_CHAT_CONTINUE, &text), CS_EINVAL);
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, three, 3, (cs_chat_end)7, &text), CS_EINVAL);
    ASSERT_TRUE(text == NULL);
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, NULL, 0, true, &text), 0);
    ASSERT_EQ_STR(text, "<|im_start|>assistant\n");
    free(text);
    cs_chat_message bad_role[] = {{.role = "user", .content = "x"},
                                  {.role = "wizard", .content = "y"}};
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, bad_role, 2, true, &text), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "wizard");
    ASSERT_TRUE(text == NULL);
    cs_chat_message no_content[] = {{.role = "user", .content = NULL}};
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, no_content, 1, true, &text), CS_EINVAL);
    cs_tokenizer_free(tok);

    cs_vocab_spec s = base_spec();
    s.chat_template = llama3_template;
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    cs_chat_message l3[] = {{.role = "system", .content = "  S\n"},
                            {.role = "user", .content = "\tU"}};
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, l3, 2, true, &text), 0);
    ASSERT_EQ_STR(text, "<|im_start|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n");
    free(text);
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, l3, 2, CS_CHAT_CONTINUE, &text), 0);
    ASSERT_EQ_STR(text, "<|im_start|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nU");
    free(text);
    cs_tokenizer_free(tok);

    /* an empty default system message (found by fuzz_chat_template: it once
     * passed NULL to memcpy, undefined behaviour) */
    s.chat_template =
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
        "'<|im_start|>system\n<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + "
        "'\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    cs_chat_message hi[] = {{.role = "user", .content = "hi"}};
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, hi, 1, false, &text), 0);
    ASSERT_EQ_STR(text, "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    free(text);
    cs_tokenizer_free(tok);

    s.chat_template = NULL;
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, one, 1, true, &text), CS_ENOTSUP);
    ASSERT_MSG_HAS(cs_last_error(), "no chat template");
    cs_tokenizer_free(tok);

    s.chat_template = "{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]";
    ASSERT_EQ_INT(cs__tokenizer_create(&s, &tok), 0);
    ASSERT_EQ_INT(cs_tokenizer_apply_chat(tok, one, 1, true, &text), CS_ENOTSUP);
    ASSERT_MSG_HAS(cs_last_error(), "[INST]");
    cs_tokenizer_free(tok);
}

/* SentencePiece (CS_TOK_SPM): a small vocabulary whose scores make the
 * order of merges visible. */
static void test_spm(void) {
    enum {
        S_UNK,
        S_BOS,
        S_SOT,
        S_NL,
        S_SP,
        S_A,
        S_B,
        S_C,
        S_AB,
        S_BC,
        S_ABC,
        S_SPA,
        S_SPAB,
        S_BYTE0
    };
    const char *tokens[S_BYTE0 + 256];
    int32_t types[S_BYTE0 + 256];
    float scores[S_BYTE0 + 256];
    const char *base[] = {"<unk>",
                          "<bos>",
                          "<start_of_turn>",
                          "\n",
                          "\xE2\x96\x81",
                          "a",
                          "b",
                          "c",
                          "ab",
                          "bc",
                          "abc",
                          "\xE2\x96\x81"
                          "a",
                          "\xE2\x96\x81"
                          "ab"};
    const int32_t base_types[] = {CS_TOKEN_UNKNOWN,
                                  CS_TOKEN_CONTROL,
                                  CS_TOKEN_CONTROL,
                                  CS_TOKEN_USER_DEFINED,
                                  1,
                                  1,
                                  1,
                                  1,
                                  1,
                                  1,
                                  1,
                                  1,
                                  1};
    /* "bc" outscores "ab": "abc" is a + bc, then abc */
    const float base_scores[] = {0, 0, 0, 0, -1, -2, -2, -2, -5, -4, -3, -6, -7};
    char names[256][8];
    for (int i = 0; i < S_BYTE0; i++)
        tokens[i] = base[i], types[i] = base_types[i], scores[i] = base_scores[i];
    for (int b = 0; b < 256; b++) {
        snprintf(names[b], sizeof names[b], "<0x%02X>", b);
        tokens[S_BYTE0 + b] = names[b], types[S_BYTE0 + b] = CS_TOKEN_BYTE;
        scores[S_BYTE0 + b] = 0;
    }
    cs_vocab_spec sp = {0};
    sp.model = CS_TOK_SPM;
    sp.n_vocab = S_BYTE0 + 256;
    sp.tokens = tokens;
    sp.token_types = types;
    sp.scores = scores;
    sp.bos_id = S_BOS, sp.eos_id = -1, sp.unk_id = S_UNK, sp.pad_id = -1;
    sp.add_bos = true;
    cs_tokenizer *tok;
    ASSERT_EQ_INT(cs__tokenizer_create(&sp, &tok), 0);
    /* merges by the score of the piece they make */
    ASSERT_IDS(tok, "abc", false, false, S_ABC);
    ASSERT_IDS(tok, "ab", false, false, S_AB);
    ASSERT_IDS(tok, "cab", false, false, S_C, S_AB);
    /* spaces are U+2581 pieces; no prefix without add_space_prefix */
    ASSERT_IDS(tok, " ab", false, false, S_SPAB);
    ASSERT_IDS(tok, "a a", false, true, S_BOS, S_A, S_SPA);
    /* byte fallback: a character without a piece goes out as its bytes */
    ASSERT_IDS(tok,
               "\xC3\xA9"
               "a",
               false, false, S_BYTE0 + 0xC3, S_BYTE0 + 0xA9, S_A);
    /* user-defined pieces always, control ones with parse_special */
    ASSERT_IDS(tok, "a\nb", false, false, S_A, S_NL, S_B);
    ASSERT_IDS(tok, "<start_of_turn>a", true, false, S_SOT, S_A);
    char *t = dec(tok, (const int32_t[]){S_SPAB, S_SP, S_BYTE0 + 0xC3, S_BYTE0 + 0xA9}, 4, false);
    ASSERT_EQ_STR(t, " ab \xC3\xA9");
    free(t);
    /* streaming: byte pieces make a character only once it is whole */
    cs_detok d;
    char out[16];
    size_t n;
    cs_detok_init(&d, tok, true);
    ASSERT_EQ_INT(cs_detok_push(&d, S_BYTE0 + 0xC3, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 0);
    ASSERT_EQ_INT(cs_detok_push(&d, S_BYTE0 + 0xA9, out, sizeof out, &n), 0);
    ASSERT_EQ_INT(n, 2);
    ASSERT_TRUE(memcmp(out, "\xC3\xA9", 2) == 0);
    cs_tokenizer_free(tok);

    /* add_space_prefix: a space before the text and after each special token */
    sp.add_space_prefix = true;
    ASSERT_EQ_INT(cs__tokenizer_create(&sp, &tok), 0);
    ASSERT_IDS(tok, "ab", false, false, S_SPAB);
    ASSERT_IDS(tok, "<start_of_turn>ab", true, false, S_SOT, S_SPAB);
    ASSERT_IDS(tok, "a\nab", false, false, S_SPA, S_NL, S_SPAB);
    cs_tokenizer_free(tok);

    /* refused: a merge list, a NaN score */
    const char *merge = "a b";
    sp.n_merges = 1, sp.merges = &merge;
    expect_spec_error(&sp, CS_EBADMSG, "no merge list");
    sp.n_merges = 0, sp.merges = NULL;
    scores[S_AB] = NAN;
    expect_spec_error(&sp, CS_EBADMSG, "NaN score");
}

int main(void) {
    build_vocab();
    test_pretok_cases();
    test_encode();
    test_ignore_merges();
    test_decode();
    test_detok();
    test_spec_validation();
    test_json();
    test_chat();
    test_spm();
    for (int32_t i = 0; i < g_n; i++)
        free(g_tok[i]);
    for (int32_t i = 0; i < g_nm; i++)
        free(g_merge[i]);
    printf("test_tokenizer: ok\n");
    return 0;
}
