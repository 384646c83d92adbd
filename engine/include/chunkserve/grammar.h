/* chunkserve/grammar.h: structured outputs. A request's constraint (a JSON
 * Schema, any JSON object, a regular expression or a list of choices) is
 * compiled into a grammar over bytes; a matcher follows one sequence through
 * it, and before each token is sampled it gives the set of tokens whose bytes
 * keep the text a prefix of a sentence of the grammar (end-of-generation
 * tokens only where the text is a whole sentence). The text of a request
 * that ends by end-of-generation is therefore always a sentence: JSON that
 * parses and validates against the schema, a full match of the regex, one of
 * the choices.
 *
 * Everything is a function of the constraint and the tokens fed, so a
 * sequence continued elsewhere (the decode worker after the prefill worker
 * sampled its first token, a migration) rebuilds its matcher by compiling the
 * same constraint and feeding the same tokens. */
#ifndef CHUNKSERVE_GRAMMAR_H
#define CHUNKSERVE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct cs_tokenizer;

enum cs_structured_kind {
    CS_STRUCTURED_NONE = 0,
    CS_STRUCTURED_JSON_OBJECT, /* any JSON object (OpenAI response_format json_object) */
    CS_STRUCTURED_JSON_SCHEMA, /* text: a JSON Schema, as JSON text */
    CS_STRUCTURED_REGEX,       /* text: a regular expression the whole output matches */
    CS_STRUCTURED_CHOICE,      /* choices: the output is exactly one of them */
};

typedef struct {
    enum cs_structured_kind kind;
    const char *text;           /* JSON_SCHEMA, REGEX: NUL-terminated */
    const char *const *choices; /* CHOICE: n_choices NUL-terminated strings */
    int32_t n_choices;
} cs_structured;

/* Limits: a spec's text, the grammar it compiles to, the nesting a matcher follows. */
#define CS_GRAMMAR_MAX_TEXT (256 * 1024)
#define CS_GRAMMAR_MAX_CHOICES 1024

typedef struct cs_grammar cs_grammar;

/* Compiles spec. CS_EINVAL with cs_last_error() naming what is wrong or not
 * supported (e.g. "json_schema: keyword 'oneOf' is not supported"); CS_ENOMEM.
 * The grammar is shared by reference (cs_grammar_ref / cs_grammar_free) and
 * holds a cache of token masks; it is not thread-safe. */
int cs_grammar_compile(const cs_structured *spec, cs_grammar **out);
cs_grammar *cs_grammar_ref(cs_grammar *g);
void cs_grammar_free(cs_grammar *g); /* drops one reference; NULL is a no-op */

/* A tokenizer's vocabulary as a byte trie, for computing masks. Built once
 * per tokenizer (tens of milliseconds for 150k tokens); read-only after.
 * n_vocab: the model's vocabulary, when it has more rows than the tokenizer
 * has tokens (Qwen2.5: 151,936 and 151,665): masks cover it, its extra ids
 * never allowed (0 = the tokenizer's size). */
typedef struct cs_vocab_trie cs_vocab_trie;
int cs_vocab_trie_init(const struct cs_tokenizer *tok, int32_t n_vocab, cs_vocab_trie **out);
void cs_vocab_trie_free(cs_vocab_trie *t);

/* One sequence's position in a grammar. */
typedef struct cs_matcher cs_matcher;
int cs_matcher_init(cs_grammar *g, const cs_vocab_trie *t, cs_matcher **out); /* refs g */
void cs_matcher_free(cs_matcher *m);
/* Advances over the bytes of token id (end-of-generation tokens: no bytes).
 * CS_EINVAL, the matcher unchanged, when the token does not continue a
 * sentence. */
int cs_matcher_accept(cs_matcher *m, int32_t id);
/* Advances over raw bytes; CS_EINVAL (unchanged) when they do not fit. */
int cs_matcher_feed(cs_matcher *m, const char *bytes, size_t n);
/* The text so far is a whole sentence / nothing may follow it. */
bool cs_matcher_complete(const cs_matcher *m);
bool cs_matcher_finished(const cs_matcher *m);
/* The tokens allowed next, as n_vocab bits (bit i of allow[i / 32]):
 * tokens whose bytes continue a sentence; the end-of-generation tokens when
 * the text is one. Returns how many are allowed, or a negative CS_ENOMEM.
 * Should no token continue the text (a reading dropped at the matcher's
 * nesting or work limits, out of reach of sane constraints), the
 * end-of-generation tokens are allowed. The pointer stays valid until the next call on m. */
int32_t cs_matcher_mask(cs_matcher *m, const uint32_t **allow);

/* Counters for benchmarks: masks computed by walking the trie, masks found in
 * the cache, trie nodes visited. */
typedef struct {
    uint64_t walks, hits, nodes;
} cs_grammar_stats;
cs_grammar_stats cs_grammar_get_stats(const cs_grammar *g);

#ifdef __cplusplus
}
#endif

#endif
