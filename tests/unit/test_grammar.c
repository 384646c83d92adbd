/* test_grammar.c: structured outputs (chunkserve/grammar.h). Which texts each
 * kind of constraint accepts and refuses (regexes, choices, any JSON object,
 * JSON Schemas: integer and number ranges swept value by value), the
 * constraints refused by name, and token masks: every mask equals the
 * brute-force answer (each token's bytes fed on their own), cached masks
 * included, on the tiny model's tokenizer and, with CS_MODEL, on a real one;
 * random walks through the masks always end in a sentence. */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/grammar.h"
#include "chunkserve/tokenizer.h"
#include "test.h"

static cs_tokenizer *tok;
static cs_vocab_trie *trie;

static cs_grammar *compile(enum cs_structured_kind kind, const char *text) {
    cs_structured s = {.kind = kind, .text = text};
    cs_grammar *g = NULL;
    int r = cs_grammar_compile(&s, &g);
    if (r) fprintf(stderr, "compile '%s': %s\n", text ? text : "", cs_last_error());
    ASSERT_EQ_INT(r, 0);
    return g;
}

/* 1: the whole text is a sentence; 0: a prefix of one; -1: neither. */
static int match(cs_grammar *g, const char *text) {
    cs_matcher *m;
    ASSERT_EQ_INT(cs_matcher_init(g, trie, &m), 0);
    int r = cs_matcher_feed(m, text, strlen(text));
    int out = r ? -1 : cs_matcher_complete(m) ? 1 : 0;
    cs_matcher_free(m);
    return out;
}

#define ACCEPTS(g, t)                                                                              \
    do {                                                                                           \
        if (match(g, t) != 1) {                                                                    \
            fprintf(stderr, "%s:%d: '%s' should be a sentence (got %d)\n", __FILE__, __LINE__, t, \
                    match(g, t));                                                                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define PREFIX(g, t)                                                                               \
    do {                                                                                           \
        if (match(g, t) != 0) {                                                                    \
            fprintf(stderr, "%s:%d: '%s' should be a proper prefix (got %d)\n", __FILE__,         \
                    __LINE__, t, match(g, t));                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define REJECTS(g, t)                                                                              \
    do {                                                                                           \
        if (match(g, t) != -1) {                                                                   \
            fprintf(stderr, "%s:%d: '%s' should be refused (got %d)\n", __FILE__, __LINE__, t,    \
                    match(g, t));                                                                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void refused(enum cs_structured_kind kind, const char *text, const char *needle) {
    cs_structured s = {.kind = kind, .text = text};
    cs_grammar *g = (cs_grammar *)1;
    ASSERT_EQ_INT(cs_grammar_compile(&s, &g), CS_EINVAL);
    ASSERT_TRUE(g == NULL);
    ASSERT_MSG_HAS(cs_last_error(), needle);
}

static void test_regex(void) {
    cs_grammar *g = compile(CS_STRUCTURED_REGEX, "[a-z]+@[a-z]+\\.(com|org)");
    ACCEPTS(g, "ab@cd.com");
    ACCEPTS(g, "x@y.org");
    PREFIX(g, "ab@cd.co");
    PREFIX(g, "ab");
    REJECTS(g, "Ab@cd.com");
    REJECTS(g, "ab@cd.comm");
    cs_grammar_free(g);

    g = compile(CS_STRUCTURED_REGEX, "^(ab|cd){2,3}x?$");
    ACCEPTS(g, "abcd");
    ACCEPTS(g, "cdcdabx");
    PREFIX(g, "ab");
    REJECTS(g, "abcdabcd");
    REJECTS(g, "abx");
    cs_grammar_free(g);

    g = compile(CS_STRUCTURED_REGEX, "\\d{3}-\\d{4}|colou?r|[^0-9\\s]{2}|h\xc3\xa9|.\\.");
    ACCEPTS(g, "555-1234");
    ACCEPTS(g, "color");
    ACCEPTS(g, "colour");
    ACCEPTS(g, "z!");
    ACCEPTS(g, "\xc3\xa9\xc3\xa9"); /* negated classes take non-ASCII characters */
    ACCEPTS(g, "h\xc3\xa9");
    ACCEPTS(g, "\xe2\x82\xac."); /* '.' is one character, not one byte */
    REJECTS(g, "55-1234");
    REJECTS(g, "a1");
    REJECTS(g, "\xc3("); /* invalid UTF-8 never fits */
    REJECTS(g, "\n.");
    cs_grammar_free(g);

    g = compile(CS_STRUCTURED_REGEX, "[\\w.-]{1,3}\\x41\\u00e9(?:a|b)*?");
    ACCEPTS(g, "a.-A\xc3\xa9");
    ACCEPTS(g, "_A\xc3\xa9" "abba");
    REJECTS(g, "abcdA\xc3\xa9");
    cs_grammar_free(g);

    refused(CS_STRUCTURED_REGEX, "(a*)*", "can be empty");
    refused(CS_STRUCTURED_REGEX, "a(?=b)", "lookaround");
    refused(CS_STRUCTURED_REGEX, "(a)\\1", "backreferences");
    refused(CS_STRUCTURED_REGEX, "a\\bc", "word boundaries");
    refused(CS_STRUCTURED_REGEX, "(ab", "unclosed group");
    refused(CS_STRUCTURED_REGEX, "ab)", "unopened");
    refused(CS_STRUCTURED_REGEX, "[b-a]", "out of order");
    refused(CS_STRUCTURED_REGEX, "a{2000}", "above 1000");
    refused(CS_STRUCTURED_REGEX, "*a", "nothing to repeat");
    refused(CS_STRUCTURED_REGEX, "a++", "possessive");
    refused(CS_STRUCTURED_REGEX, "[^\xc3\xa9]", "negated class");
    refused(CS_STRUCTURED_REGEX, "", "empty");
}

static void test_choice(void) {
    const char *ch[] = {"yes", "no", "not sure"};
    cs_structured s = {.kind = CS_STRUCTURED_CHOICE, .choices = ch, .n_choices = 3};
    cs_grammar *g;
    ASSERT_EQ_INT(cs_grammar_compile(&s, &g), 0);
    ACCEPTS(g, "yes");
    ACCEPTS(g, "no");
    ACCEPTS(g, "not sure");
    PREFIX(g, "not");
    REJECTS(g, "nope");
    REJECTS(g, "yes!");
    cs_grammar_free(g);
    s.n_choices = 0;
    ASSERT_EQ_INT(cs_grammar_compile(&s, &g), CS_EINVAL);
    const char *empty[] = {"a", ""};
    s.choices = empty, s.n_choices = 2;
    ASSERT_EQ_INT(cs_grammar_compile(&s, &g), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "empty");
}

static void test_json_object(void) {
    cs_grammar *g = compile(CS_STRUCTURED_JSON_OBJECT, NULL);
    ACCEPTS(g, "{}");
    ACCEPTS(g, "{ }");
    ACCEPTS(g, "{\"a\": [1, 2.5, -3e10, 0, true, null, {\"b\": \"c\\n\\u00e9\xc3\xa9\"}], \"\": {}}");
    ACCEPTS(g, "{\n  \"k\": \"v\"\n}");
    PREFIX(g, "{\"a\": [1,");
    REJECTS(g, "[1]");
    REJECTS(g, "{'a': 1}");
    REJECTS(g, "{\"a\"}");
    REJECTS(g, "{\"a\": 01}");
    REJECTS(g, "{\"a\": 1,}");
    REJECTS(g, "{\"a\": \"\x01\"}");
    REJECTS(g, "{} ");
    REJECTS(g, "{\n\n\"k\": 1}"); /* one line break per gap */
    REJECTS(g, "{\t\"k\": 1}");
    REJECTS(g, "{\"a\": 12345678901234567}"); /* 17 digits: past the bound */
    cs_grammar_free(g);
}

static void test_schema(void) {
    cs_grammar *g = compile(CS_STRUCTURED_JSON_SCHEMA,
                            "{\"type\":\"object\",\"properties\":{"
                            "\"name\":{\"type\":\"string\",\"maxLength\":5},"
                            "\"age\":{\"type\":\"integer\"},"
                            "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",3]},"
                            "\"minItems\":1,\"maxItems\":2},"
                            "\"ok\":{\"type\":[\"boolean\",\"null\"]}},"
                            "\"required\":[\"name\",\"tags\"],\"additionalProperties\":false}");
    ACCEPTS(g, "{\"name\": \"bob\", \"tags\": [\"a\"]}");
    ACCEPTS(g, "{\"name\":\"\",\"age\":-7,\"tags\":[3, \"b\"],\"ok\":null}");
    ACCEPTS(g, "{\"name\":\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\",\"tags\":[3],\"ok\":true}");
    REJECTS(g, "{\"tags\": [\"a\"]}");                         /* name is required */
    REJECTS(g, "{\"name\": \"bob\", \"tags\": []}");           /* minItems */
    REJECTS(g, "{\"name\": \"bob\", \"tags\": [3, 3, 3]}");    /* maxItems */
    REJECTS(g, "{\"name\": \"bobbyy\", \"tags\": [3]}");       /* maxLength */
    REJECTS(g, "{\"name\": \"b\", \"tags\": [\"c\"]}");        /* enum */
    REJECTS(g, "{\"name\": \"b\", \"x\": 1, \"tags\": [3]}");  /* no other keys */
    REJECTS(g, "{\"tags\": [3], \"name\": \"b\"}");            /* the schema's order */
    cs_grammar_free(g);

    /* integer ranges, swept */
    const char *ranges[] = {"{\"type\":\"integer\",\"minimum\":-15,\"maximum\":123}",
                            "{\"type\":\"integer\",\"exclusiveMinimum\":7,\"exclusiveMaximum\":1000}",
                            "{\"type\":\"integer\",\"minimum\":0}",
                            "{\"type\":\"integer\",\"maximum\":-3}",
                            "{\"type\":\"integer\",\"minimum\":99,\"maximum\":101}"};
    const long lo[] = {-15, 8, 0, -9999999, 99}, hi[] = {123, 999, 9999999, -3, 101};
    for (int k = 0; k < 5; k++) {
        g = compile(CS_STRUCTURED_JSON_SCHEMA, ranges[k]);
        for (long v = -1200; v <= 1200; v++) {
            char s[32];
            snprintf(s, sizeof s, "%ld", v);
            int want = v >= lo[k] && v <= hi[k];
            if ((match(g, s) == 1) != want) {
                fprintf(stderr, "schema %s: %ld %s\n", ranges[k], v, want ? "refused" : "accepted");
                exit(1);
            }
        }
        REJECTS(g, "007");
        REJECTS(g, "1.0");
        cs_grammar_free(g);
    }
    /* number ranges */
    g = compile(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":-2,\"maximum\":1}");
    const char *in[] = {"0", "1", "1.000", "0.5", "-2", "-2.0", "-1.999", "-0.25"};
    const char *out[] = {"1.01", "-2.01", "2", "-3", "1e3", "01"};
    for (size_t i = 0; i < sizeof in / sizeof *in; i++)
        ACCEPTS(g, in[i]);
    for (size_t i = 0; i < sizeof out / sizeof *out; i++)
        if (match(g, out[i]) == 1) {
            fprintf(stderr, "number in [-2, 1] accepted %s\n", out[i]);
            exit(1);
        }
    cs_grammar_free(g);

    /* $ref, recursion, anyOf, formats, patterns, nullable */
    g = compile(CS_STRUCTURED_JSON_SCHEMA,
                "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
                "\"v\":{\"anyOf\":[{\"type\":\"string\",\"format\":\"date\"},{\"const\":42}]},"
                "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},"
                "\"required\":[\"v\"]}},"
                "\"type\":\"object\",\"properties\":{\"root\":{\"$ref\":\"#/$defs/node\"},"
                "\"code\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-[0-9]+$\"},"
                "\"note\":{\"type\":\"string\",\"pattern\":\"ok\",\"nullable\":true}},"
                "\"required\":[\"root\",\"code\",\"note\"]}");
    ACCEPTS(g, "{\"root\": {\"v\": 42, \"kids\": [{\"v\": \"2024-02-29\"}, {\"v\": 42, \"kids\": []}]},"
               " \"code\": \"AB-12\", \"note\": \"is ok!\"}");
    ACCEPTS(g, "{\"root\":{\"v\":42},\"code\":\"ZZ-0\",\"note\":null}");
    REJECTS(g, "{\"root\":{\"v\":\"2024-13-01\"},\"code\":\"ZZ-0\",\"note\":null}");
    REJECTS(g, "{\"root\":{\"v\":42},\"code\":\"Z-0\",\"note\":null}");
    REJECTS(g, "{\"root\":{\"v\":42},\"code\":\"ZZ-0\",\"note\":\"no\"}");
    REJECTS(g, "{\"root\":{\"kids\":[]},\"code\":\"ZZ-0\",\"note\":null}");
    cs_grammar_free(g);

    /* wide alternations: every reading kept (choices and enums are tries, the
     * optional properties one comma) */
    {
        char buf[16384];
        int n = snprintf(buf, sizeof buf, "{\"enum\":[");
        for (int i = 0; i < 300; i++)
            n += snprintf(buf + n, sizeof buf - (size_t)n, "%s\"v%d\"", i ? "," : "", i);
        snprintf(buf + n, sizeof buf - (size_t)n, "]}");
        g = compile(CS_STRUCTURED_JSON_SCHEMA, buf);
        ACCEPTS(g, "\"v299\"");
        ACCEPTS(g, "\"v3\"");
        PREFIX(g, "\"v29");
        REJECTS(g, "\"v300\"");
        cs_grammar_free(g);
        n = snprintf(buf, sizeof buf, "{\"type\":\"object\",\"properties\":{");
        for (int i = 0; i < 80; i++)
            n += snprintf(buf + n, sizeof buf - (size_t)n, "%s\"p%d\":{\"type\":\"integer\"}",
                          i ? "," : "", i);
        snprintf(buf + n, sizeof buf - (size_t)n, "}}");
        g = compile(CS_STRUCTURED_JSON_SCHEMA, buf);
        ACCEPTS(g, "{\"p0\":1}");
        ACCEPTS(g, "{\"p79\": 2}");
        ACCEPTS(g, "{\"p3\":1, \"p50\":2,\n  \"p79\":3}");
        ACCEPTS(g, "{}");
        REJECTS(g, "{\"p50\":1,\"p3\":2}");
        cs_grammar_free(g);
        const char *many[400];
        char names[400][8];
        for (int i = 0; i < 400; i++) {
            snprintf(names[i], sizeof names[i], "c%d", i);
            many[i] = names[i];
        }
        cs_structured s = {.kind = CS_STRUCTURED_CHOICE, .choices = many, .n_choices = 400};
        ASSERT_EQ_INT(cs_grammar_compile(&s, &g), 0);
        ACCEPTS(g, "c399");
        ACCEPTS(g, "c1");
        ACCEPTS(g, "c10");
        PREFIX(g, "c");
        REJECTS(g, "c400");
        cs_grammar_free(g);
    }
    /* items: false through a reference: the empty array only */
    g = compile(CS_STRUCTURED_JSON_SCHEMA,
                "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/x\"}},"
                "\"required\":[\"a\"],\"$defs\":{\"x\":{\"type\":\"array\",\"items\":false}}}");
    ACCEPTS(g, "{\"a\":[]}");
    REJECTS(g, "{\"a\":}");
    REJECTS(g, "{\"a\":[1]}");
    cs_grammar_free(g);
    refused(CS_STRUCTURED_REGEX, "a\\0b", "octal");
    refused(CS_STRUCTURED_REGEX, "(a?){100}b", "at most 32");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":0,\"exclusiveMinimum\":true}",
            "draft 4");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"oneOf\":[{\"type\":\"string\"}]}", "'oneOf'");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"array\",\"uniqueItems\":true}", "'uniqueItems'");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"object\"", "not valid JSON");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"enum\":[]}", "'enum'");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"strin\"}", "unknown type");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"$ref\":\"#/$defs/none\"}", "names no definition");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"$ref\":\"http://x/y\"}", "not supported");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"$defs\":{\"a\":{\"anyOf\":[{\"$ref\":\"#/$defs/a\"},"
                                       "{\"type\":\"null\"}]}},\"$ref\":\"#/$defs/a\"}",
            "left recursion");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#\"}},"
                                       "\"required\":[\"a\"]}", "no finite output");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":0.5}", "integers");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}",
            "no value");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"required\":[\"x\"],\"properties\":{}}",
            "not in 'properties'");
    refused(CS_STRUCTURED_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"(?=a)\"}", "lookaround");
}

/* Every token's bytes fed on their own: the mask's reference. */
static void check_mask(cs_grammar *g, const char *prefix) {
    cs_matcher *m, *ref;
    ASSERT_EQ_INT(cs_matcher_init(g, trie, &m), 0);
    ASSERT_EQ_INT(cs_matcher_feed(m, prefix, strlen(prefix)), 0);
    for (int pass = 0; pass < 2; pass++) { /* the second from the cache */
        const uint32_t *allow;
        int32_t count = cs_matcher_mask(m, &allow), want_count = 0;
        int32_t n = cs_tokenizer_n_vocab(tok);
        for (int32_t id = 0; id < n; id++) {
            ASSERT_EQ_INT(cs_matcher_init(g, trie, &ref), 0);
            ASSERT_EQ_INT(cs_matcher_feed(ref, prefix, strlen(prefix)), 0);
            int want = cs_matcher_accept(ref, id) == 0;
            if (cs_tokenizer_is_eog(tok, id)) want = cs_matcher_complete(ref);
            cs_matcher_free(ref);
            int got = (allow[id / 32] >> (id % 32)) & 1;
            if (got != want) {
                fprintf(stderr, "mask after '%s': token %d %s\n", prefix, id,
                        want ? "missing" : "extra");
                exit(1);
            }
            want_count += want;
        }
        ASSERT_EQ_INT(count, want_count);
        ASSERT_TRUE(count > 0);
    }
    cs_matcher_free(m);
}

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

/* Random tokens from the masks until end of generation: the text is a sentence. */
static char *random_walk(cs_grammar *g, int max_tokens) {
    cs_matcher *m;
    ASSERT_EQ_INT(cs_matcher_init(g, trie, &m), 0);
    int32_t n = cs_tokenizer_n_vocab(tok);
    size_t cap = 1 << 16, len = 0;
    char *text = calloc(cap, 1);
    for (int t = 0; t < max_tokens; t++) {
        const uint32_t *allow;
        int32_t count = cs_matcher_mask(m, &allow);
        ASSERT_TRUE(count > 0);
        /* prefer the end once possible, so walks finish */
        int32_t pick = -1;
        if (cs_matcher_complete(m) && next() % 4 == 0)
            for (int32_t id = 0; id < n && pick < 0; id++)
                if (cs_tokenizer_is_eog(tok, id) && ((allow[id / 32] >> (id % 32)) & 1)) pick = id;
        if (pick < 0) {
            int32_t k = (int32_t)(next() % (uint64_t)count);
            for (int32_t id = 0; id < n; id++)
                if (((allow[id / 32] >> (id % 32)) & 1) && k-- == 0) pick = id;
        }
        if (cs_tokenizer_is_eog(tok, pick)) break;
        ASSERT_EQ_INT(cs_matcher_accept(m, pick), 0);
        const char *b;
        size_t bl;
        ASSERT_EQ_INT(cs_tokenizer_token_bytes(tok, pick, &b, &bl), 0);
        ASSERT_TRUE(len + bl < cap);
        memcpy(text + len, b, bl);
        len += bl;
        if (cs_matcher_finished(m)) break;
    }
    int complete = cs_matcher_complete(m);
    cs_matcher_free(m);
    if (!complete) {
        free(text);
        return NULL;
    }
    return text;
}

static void test_masks(void) {
    ASSERT_EQ_INT(cs_vocab_trie_init(tok, 0, &trie), 0);
    cs_grammar *g = compile(CS_STRUCTURED_JSON_SCHEMA,
                            "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},"
                            "\"n\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":300},"
                            "\"xs\":{\"type\":\"array\",\"items\":{\"type\":\"number\"},\"maxItems\":3}},"
                            "\"required\":[\"name\",\"n\"]}");
    const char *prefixes[] = {"", "{", "{\"na", "{\"name\": \"a b", "{\"name\": \"\\u00",
                              "{\"name\":\"\",\"n\":2", "{\"name\":\"\",\"n\":30,\"xs\":[1.5,",
                              "{\"name\":\"\",\"n\":30}"};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++)
        check_mask(g, prefixes[i]);
    cs_grammar_stats st = cs_grammar_get_stats(g);
    ASSERT_TRUE(st.hits > 0 && st.walks > 0);
    int done = 0;
    for (int w = 0; w < 30; w++) {
        char *text = random_walk(g, 400);
        if (!text) continue;
        cJSON *j = cJSON_Parse(text);
        if (!j) fprintf(stderr, "not JSON: %s\n", text);
        ASSERT_TRUE(j != NULL);
        ASSERT_TRUE(cJSON_IsString(cJSON_GetObjectItem(j, "name")));
        const cJSON *n = cJSON_GetObjectItem(j, "n");
        ASSERT_TRUE(cJSON_IsNumber(n) && n->valuedouble >= 0 && n->valuedouble <= 300);
        cJSON_Delete(j);
        free(text);
        done++;
    }
    ASSERT_TRUE(done >= 10);
    cs_grammar_free(g);

    g = compile(CS_STRUCTURED_REGEX, "(ab|cd)+[0-9]{2}");
    check_mask(g, "");
    check_mask(g, "ab");
    check_mask(g, "abcd1");
    check_mask(g, "abcd12");
    cs_grammar_free(g);
    cs_vocab_trie_free(trie);
    trie = NULL;
}

int main(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    ASSERT_EQ_INT(cs_tokenizer_load(path, &tok), 0);
    ASSERT_EQ_INT(cs_vocab_trie_init(tok, 0, &trie), 0); /* byte-level matching needs one too */
    test_regex();
    test_choice();
    test_json_object();
    test_schema();
    cs_vocab_trie_free(trie);
    test_masks();
    cs_tokenizer_free(tok);
    const char *model = getenv("CS_MODEL"); /* the same mask checks on a real vocabulary */
    if (model && *model) {
        FILE *f = fopen(model, "rb");
        if (f) {
            fclose(f);
            ASSERT_EQ_INT(cs_tokenizer_load(model, &tok), 0);
            test_masks();
            cs_tokenizer_free(tok);
        }
    }
    printf("test_grammar: ok\n");
    return 0;
}
