/* grammar-impl.h: the grammar's nodes and the builder the compilers
 * (grammar_json.c, grammar_regex.c) use. A grammar is a graph of nodes over
 * bytes: a byte set (one byte of input), a sequence, an alternation and a
 * bounded or unbounded repetition; recursion (JSON values in JSON values) is
 * a node referring back to an ancestor. The matcher (grammar.c) runs it as a
 * set of stacks, one per way the text so far can be read. */
#ifndef CS_GRAMMAR_IMPL_H
#define CS_GRAMMAR_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "chunkserve/grammar.h"

enum { CS_G_SET, CS_G_SEQ, CS_G_ALT, CS_G_REP };
#define CS_G_INF UINT32_MAX /* a repetition's max: unbounded */
#define CS_G_BAD UINT32_MAX /* a builder's result after an error */
#define CS_G_MAX_NODES (1u << 20)
#define CS_G_MAX_SETS 4096 /* distinct byte sets (character classes) */

typedef struct {
    uint8_t kind;
    bool nullable; /* matches the empty string (cs__g_finish) */
    uint32_t a;    /* SET: index of the byte set; SEQ/ALT: first kid in kids[]; REP: the kid */
    uint32_t b;    /* SEQ/ALT: number of kids */
    uint32_t min, max; /* REP */
} cs_gnode;

typedef struct {
    uint64_t w[4];
} cs_gset;

struct cs_mask_cache;

struct cs_grammar {
    int refs;
    cs_gnode *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t *kids;
    uint32_t n_kids, cap_kids;
    cs_gset *sets;
    uint32_t n_sets, cap_sets;
    uint32_t root;
    int err; /* the first builder error (CS_ENOMEM, CS_EINVAL); later calls do nothing */
    struct cs_mask_cache *cache;
    cs_grammar_stats stats;
};

/* Builders: each returns a node index, or CS_G_BAD once g->err is set. */
uint32_t cs__g_set(cs_grammar *g, const cs_gset *set);
uint32_t cs__g_range(cs_grammar *g, uint8_t lo, uint8_t hi);
uint32_t cs__g_lit(cs_grammar *g, const char *s, size_t n);
/* One of n literals (NUL-terminated), as a trie: alternatives only where the
 * literals part, so a matcher follows one reading per distinct next byte. */
uint32_t cs__g_lit_alt(cs_grammar *g, const char *const *s, uint32_t n);
uint32_t cs__g_seq(cs_grammar *g, const uint32_t *kids, uint32_t n);
uint32_t cs__g_alt(cs_grammar *g, const uint32_t *kids, uint32_t n);
uint32_t cs__g_rep(cs_grammar *g, uint32_t kid, uint32_t min, uint32_t max);
uint32_t cs__g_seq2(cs_grammar *g, uint32_t x, uint32_t y);
uint32_t cs__g_seq3(cs_grammar *g, uint32_t x, uint32_t y, uint32_t z);
uint32_t cs__g_alt2(cs_grammar *g, uint32_t x, uint32_t y);
/* A node defined later (recursion): cs__g_define makes it a one-kid sequence. */
uint32_t cs__g_forward(cs_grammar *g);
void cs__g_define(cs_grammar *g, uint32_t fwd, uint32_t node);
/* One UTF-8 encoded character (any code point but the surrogates) whose
 * first byte is not in `exclude_ascii` (a set of ASCII bytes to leave out). */
uint32_t cs__g_utf8_char(cs_grammar *g, const cs_gset *ascii);

static inline void cs__gset_add(cs_gset *s, uint8_t c) { s->w[c >> 6] |= 1ull << (c & 63); }
static inline bool cs__gset_has(const cs_gset *s, uint8_t c) {
    return (s->w[c >> 6] >> (c & 63)) & 1;
}
static inline void cs__gset_add_range(cs_gset *s, uint8_t lo, uint8_t hi) {
    for (unsigned c = lo; c <= hi; c++)
        cs__gset_add(s, (uint8_t)c);
}

/* Records the first error (formatted into cs_last_error) and returns it. */
int cs__g_fail(cs_grammar *g, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Compilers: set g->root or fail through cs__g_fail. */
int cs__g_compile_json_schema(cs_grammar *g, const char *text);
int cs__g_compile_json_object(cs_grammar *g);
int cs__g_compile_regex(cs_grammar *g, const char *re, const char *what);
/* The regex compiler's entry for a JSON string's pattern: only characters that
 * stand for themselves inside a JSON string (no '"', '\\' or controls). */
uint32_t cs__g_regex_node(cs_grammar *g, const char *re, bool json_string, const char *what);

#endif
