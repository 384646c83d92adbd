/* grammar.c: the grammar builder, the matcher and token masks.
 *
 * The matcher's state is a set of threads, each a stack of frames (node,
 * index): the ways the bytes read so far can continue. Every thread's top is
 * a byte set (expand() runs sequences, alternations and repetitions down to
 * one); a byte pops the tops that contain it and expands what is under them.
 * An empty stack means the text is a whole sentence (state.accept).
 *
 * A token mask walks the vocabulary's byte trie in preorder with one state
 * per depth, skipping a subtree as soon as its prefix leaves the grammar.
 * Masks are cached per grammar under the state they were computed from: a
 * JSON document revisits few states (inside a string, after a comma ...), so
 * most steps are one hash lookup and a copy. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "chunkserve/tokenizer.h"
#include "grammar-impl.h"
#include "util.h"

/* ---- builder ---- */

int cs__g_fail(cs_grammar *g, int code, const char *fmt, ...) {
    if (g->err) return g->err;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    g->err = code;
    return cs_fail(code, "%s", msg);
}

static bool grow(cs_grammar *g, void **p, uint32_t *cap, uint32_t need, size_t elem) {
    if (need <= *cap) return true;
    if (need > CS_G_MAX_NODES * 4u) {
        cs__g_fail(g, CS_EINVAL, "structured output: the grammar is too large (over %u nodes)",
                   CS_G_MAX_NODES);
        return false;
    }
    uint32_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) {
        cs__g_fail(g, CS_ENOMEM, "structured output: out of memory");
        return false;
    }
    *p = q, *cap = c;
    return true;
}

static uint32_t add_node(cs_grammar *g, cs_gnode n) {
    if (g->err) return CS_G_BAD;
    if (g->n_nodes >= CS_G_MAX_NODES) {
        cs__g_fail(g, CS_EINVAL, "structured output: the grammar is too large (over %u nodes)",
                   CS_G_MAX_NODES);
        return CS_G_BAD;
    }
    if (!grow(g, (void **)&g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof *g->nodes))
        return CS_G_BAD;
    g->nodes[g->n_nodes] = n;
    return g->n_nodes++;
}

uint32_t cs__g_set(cs_grammar *g, const cs_gset *set) {
    if (g->err) return CS_G_BAD;
    uint32_t i = 0;
    while (i < g->n_sets && memcmp(&g->sets[i], set, sizeof *set))
        i++;
    if (i == g->n_sets) {
        if (g->n_sets >= CS_G_MAX_SETS) {
            cs__g_fail(g, CS_EINVAL, "structured output: over %d distinct character classes",
                       CS_G_MAX_SETS);
            return CS_G_BAD;
        }
        if (!grow(g, (void **)&g->sets, &g->cap_sets, g->n_sets + 1, sizeof *g->sets))
            return CS_G_BAD;
        g->sets[g->n_sets++] = *set;
    }
    return add_node(g, (cs_gnode){.kind = CS_G_SET, .a = i});
}

uint32_t cs__g_range(cs_grammar *g, uint8_t lo, uint8_t hi) {
    cs_gset s = {{0}};
    cs__gset_add_range(&s, lo, hi);
    return cs__g_set(g, &s);
}

/* A compiler passed on a failed node without recording why: fail anyway. */
static uint32_t unexplained(cs_grammar *g) {
    cs__g_fail(g, CS_EINVAL, "structured output: the constraint could not be compiled");
    return CS_G_BAD;
}

static uint32_t add_list(cs_grammar *g, int kind, const uint32_t *kids, uint32_t n) {
    if (g->err) return CS_G_BAD;
    for (uint32_t i = 0; i < n; i++)
        if (kids[i] == CS_G_BAD) return unexplained(g);
    if (!grow(g, (void **)&g->kids, &g->cap_kids, g->n_kids + n, sizeof *g->kids))
        return CS_G_BAD;
    uint32_t a = g->n_kids;
    if (n) memcpy(g->kids + a, kids, n * sizeof *kids);
    g->n_kids += n;
    return add_node(g, (cs_gnode){.kind = (uint8_t)kind, .a = a, .b = n});
}

uint32_t cs__g_seq(cs_grammar *g, const uint32_t *kids, uint32_t n) {
    if (n == 1) return kids[0];
    return add_list(g, CS_G_SEQ, kids, n);
}

uint32_t cs__g_alt(cs_grammar *g, const uint32_t *kids, uint32_t n) {
    if (n == 1) return kids[0];
    if (n == 0) {
        cs__g_fail(g, CS_EINVAL, "structured output: an empty alternation admits nothing");
        return CS_G_BAD;
    }
    return add_list(g, CS_G_ALT, kids, n);
}

uint32_t cs__g_rep(cs_grammar *g, uint32_t kid, uint32_t min, uint32_t max) {
    if (g->err) return CS_G_BAD;
    if (kid == CS_G_BAD) return unexplained(g);
    if (max != CS_G_INF && min > max) {
        cs__g_fail(g, CS_EINVAL, "structured output: a repetition of at least %u and at most %u",
                   min, max);
        return CS_G_BAD;
    }
    if (min == 1 && max == 1) return kid;
    return add_node(g, (cs_gnode){.kind = CS_G_REP, .a = kid, .min = min, .max = max});
}

uint32_t cs__g_seq2(cs_grammar *g, uint32_t x, uint32_t y) {
    return cs__g_seq(g, (uint32_t[]){x, y}, 2);
}
uint32_t cs__g_seq3(cs_grammar *g, uint32_t x, uint32_t y, uint32_t z) {
    return cs__g_seq(g, (uint32_t[]){x, y, z}, 3);
}
uint32_t cs__g_alt2(cs_grammar *g, uint32_t x, uint32_t y) {
    return cs__g_alt(g, (uint32_t[]){x, y}, 2);
}

uint32_t cs__g_lit(cs_grammar *g, const char *s, size_t n) {
    if (g->err) return CS_G_BAD;
    if (n > CS_GRAMMAR_MAX_TEXT) {
        cs__g_fail(g, CS_EINVAL, "structured output: a literal of %zu bytes", n);
        return CS_G_BAD;
    }
    uint32_t *k = malloc((n ? n : 1) * sizeof *k);
    if (!k) {
        cs__g_fail(g, CS_ENOMEM, "structured output: out of memory");
        return CS_G_BAD;
    }
    for (size_t i = 0; i < n; i++)
        k[i] = cs__g_range(g, (uint8_t)s[i], (uint8_t)s[i]);
    uint32_t r = add_list(g, CS_G_SEQ, k, (uint32_t)n);
    free(k);
    return r;
}

static int by_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The trie of the sorted strings s[lo..hi), all sharing their first d bytes. */
static uint32_t lit_trie(cs_grammar *g, const char *const *s, uint32_t lo, uint32_t hi, size_t d) {
    size_t run = d; /* one chain while every string goes on with the same byte */
    for (;;) {
        char b = s[lo][run];
        if (!b) break;
        uint32_t k = lo;
        while (k < hi && s[k][run] == b)
            k++;
        if (k < hi) break;
        run++;
    }
    uint32_t chain = cs__g_lit(g, s[lo] + d, run - d);
    uint32_t *alts = malloc((size_t)(hi - lo + 1) * sizeof *alts), n = 0;
    if (!alts) {
        cs__g_fail(g, CS_ENOMEM, "structured output: out of memory");
        return CS_G_BAD;
    }
    uint32_t k = lo;
    if (!s[k][run]) alts[n++] = cs__g_seq(g, NULL, 0), k++; /* one ends here (sorted first) */
    while (k < hi && !g->err) {
        uint32_t e = k;
        while (e < hi && s[e][run] == s[k][run])
            e++;
        alts[n++] = lit_trie(g, s, k, e, run); /* s[k..e) share run + 1 bytes */
        k = e;
    }
    uint32_t r = g->err ? CS_G_BAD : n == 1 && run == d ? alts[0] : cs__g_seq2(g, chain, cs__g_alt(g, alts, n));
    free(alts);
    return r;
}

uint32_t cs__g_lit_alt(cs_grammar *g, const char *const *s, uint32_t n) {
    if (g->err) return CS_G_BAD;
    if (n == 0) {
        cs__g_fail(g, CS_EINVAL, "structured output: an empty alternation admits nothing");
        return CS_G_BAD;
    }
    const char **sorted = malloc(n * sizeof *sorted);
    if (!sorted) {
        cs__g_fail(g, CS_ENOMEM, "structured output: out of memory");
        return CS_G_BAD;
    }
    memcpy(sorted, s, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, by_str);
    uint32_t k = 0; /* duplicates once */
    for (uint32_t i = 0; i < n; i++)
        if (!k || strcmp(sorted[k - 1], sorted[i])) sorted[k++] = sorted[i];
    uint32_t r = lit_trie(g, sorted, 0, k, 0);
    free(sorted);
    return r;
}

uint32_t cs__g_forward(cs_grammar *g) {
    return add_node(g, (cs_gnode){.kind = CS_G_SEQ, .a = 0, .b = 0});
}

void cs__g_define(cs_grammar *g, uint32_t fwd, uint32_t node) {
    if (g->err) return;
    if (fwd == CS_G_BAD || node == CS_G_BAD) {
        unexplained(g);
        return;
    }
    if (!grow(g, (void **)&g->kids, &g->cap_kids, g->n_kids + 1, sizeof *g->kids)) return;
    g->kids[g->n_kids] = node;
    g->nodes[fwd].a = g->n_kids++;
    g->nodes[fwd].b = 1;
}

uint32_t cs__g_utf8_char(cs_grammar *g, const cs_gset *ascii) {
    uint32_t cont = cs__g_range(g, 0x80, 0xBF);
    uint32_t alts[8];
    uint32_t n = 0;
    alts[n++] = cs__g_set(g, ascii);
    alts[n++] = cs__g_seq2(g, cs__g_range(g, 0xC2, 0xDF), cont);
    alts[n++] = cs__g_seq3(g, cs__g_range(g, 0xE0, 0xE0), cs__g_range(g, 0xA0, 0xBF), cont);
    alts[n++] = cs__g_seq3(g, cs__g_range(g, 0xE1, 0xEC), cont, cont);
    alts[n++] = cs__g_seq3(g, cs__g_range(g, 0xED, 0xED), cs__g_range(g, 0x80, 0x9F), cont);
    alts[n++] = cs__g_seq3(g, cs__g_range(g, 0xEE, 0xEF), cont, cont);
    alts[n++] = cs__g_seq(g, (uint32_t[]){cs__g_range(g, 0xF0, 0xF0), cs__g_range(g, 0x90, 0xBF),
                                          cont, cont}, 4);
    alts[n++] = cs__g_seq(g, (uint32_t[]){cs__g_range(g, 0xF1, 0xF4), cont, cont, cont}, 4);
    /* F4 allows up to 8F in the second byte; F4 90.. is past U+10FFFF */
    alts[n - 1] = cs__g_alt2(
        g, cs__g_seq(g, (uint32_t[]){cs__g_range(g, 0xF1, 0xF3), cont, cont, cont}, 4),
        cs__g_seq(g, (uint32_t[]){cs__g_range(g, 0xF4, 0xF4), cs__g_range(g, 0x80, 0x8F), cont,
                                  cont}, 4));
    return cs__g_alt(g, alts, n);
}

/* A node that can reach itself without reading a byte would expand forever:
 * refused (a $ref cycle through anyOf, say). Iterative DFS over the edges a
 * node takes before its first byte. */
static int left_recursion(cs_grammar *g) {
    uint8_t *color = calloc(g->n_nodes, 1); /* 0 new, 1 on the path, 2 done */
    uint32_t *stk = malloc((size_t)g->n_nodes * 2 * sizeof *stk);
    int r = 0;
    if (!color || !stk) {
        r = cs__g_fail(g, CS_ENOMEM, "structured output: out of memory");
        goto out;
    }
    for (uint32_t s0 = 0; s0 < g->n_nodes && !r; s0++) {
        if (color[s0]) continue;
        uint32_t sp = 0;
        stk[sp++] = s0, stk[sp++] = 0;
        color[s0] = 1;
        while (sp && !r) {
            uint32_t x = stk[sp - 2], e = stk[sp - 1];
            const cs_gnode *n = &g->nodes[x];
            uint32_t next = UINT32_MAX;
            if (n->kind == CS_G_ALT && e < n->b) next = g->kids[n->a + e];
            else if (n->kind == CS_G_SEQ && e < n->b &&
                     (e == 0 || g->nodes[g->kids[n->a + e - 1]].nullable))
                next = g->kids[n->a + e];
            else if (n->kind == CS_G_REP && e == 0 && n->max > 0) next = n->a;
            if (next == UINT32_MAX) {
                color[x] = 2;
                sp -= 2;
                continue;
            }
            stk[sp - 1]++;
            if (color[next] == 1)
                r = cs__g_fail(g, CS_EINVAL,
                               "structured output: a definition refers to itself before any "
                               "text (left recursion)");
            else if (!color[next]) {
                color[next] = 1;
                stk[sp++] = next, stk[sp++] = 0;
            }
        }
    }
out:
    free(color);
    free(stk);
    return r;
}

/* Nullable and productive (derives some finite string), to a fixed point;
 * the matcher never enters an unproductive node, and a repetition without
 * bound of something that can be empty is refused (it would loop). */
static int finish(cs_grammar *g, bool *productive) {
    bool changed = true;
    while (changed) {
        changed = false;
        for (uint32_t i = 0; i < g->n_nodes; i++) {
            cs_gnode *n = &g->nodes[i];
            bool nl = n->nullable, pr = productive[i];
            switch (n->kind) {
            case CS_G_SET: {
                const cs_gset *s = &g->sets[n->a];
                pr = (s->w[0] | s->w[1] | s->w[2] | s->w[3]) != 0;
                break;
            }
            case CS_G_SEQ:
                nl = pr = true;
                for (uint32_t k = 0; k < n->b; k++) {
                    nl &= g->nodes[g->kids[n->a + k]].nullable;
                    pr &= productive[g->kids[n->a + k]];
                }
                break;
            case CS_G_ALT:
                nl = pr = false;
                for (uint32_t k = 0; k < n->b; k++) {
                    nl |= g->nodes[g->kids[n->a + k]].nullable;
                    pr |= productive[g->kids[n->a + k]];
                }
                break;
            case CS_G_REP:
                nl = n->min == 0 || g->nodes[n->a].nullable;
                pr = n->min == 0 || productive[n->a];
                break;
            }
            if (nl != n->nullable || pr != productive[i]) {
                n->nullable = nl;
                productive[i] = pr;
                changed = true;
            }
        }
    }
    for (uint32_t i = 0; i < g->n_nodes; i++) {
        const cs_gnode *n = &g->nodes[i];
        if (n->kind == CS_G_REP && n->max == CS_G_INF && g->nodes[n->a].nullable)
            return cs__g_fail(g, CS_EINVAL,
                              "structured output: an unbounded repetition of something that can "
                              "be empty (as in (a*)*) is not supported");
        if (n->kind == CS_G_REP && n->max != CS_G_INF && n->max > 32 && g->nodes[n->a].nullable)
            return cs__g_fail(g, CS_EINVAL,
                              "structured output: a repetition of up to %u of something that can "
                              "be empty (as in (a?){100}) is not supported; at most 32",
                              n->max);
    }
    int r = left_recursion(g);
    if (r) return r;
    if (!productive[g->root])
        return cs__g_fail(g, CS_EINVAL,
                          "structured output: the constraint admits no finite output (a "
                          "required recursion without end, or an empty choice)");
    /* Unproductive alternatives and repetitions are dropped: no thread enters them */
    for (uint32_t i = 0; i < g->n_nodes; i++) {
        cs_gnode *n = &g->nodes[i];
        if (n->kind == CS_G_ALT) {
            uint32_t k = 0;
            for (uint32_t j = 0; j < n->b; j++)
                if (productive[g->kids[n->a + j]]) g->kids[n->a + k++] = g->kids[n->a + j];
            n->b = k; /* an unproductive ALT is never entered: k >= 1 where it matters */
        } else if (n->kind == CS_G_REP && !productive[n->a]) {
            n->max = 0; /* min is 0 here, or the REP itself is unproductive */
        }
    }
    return 0;
}

static void mask_cache_free(struct cs_mask_cache *c);

int cs_grammar_compile(const cs_structured *spec, cs_grammar **out) {
    *out = NULL;
    if (!spec) return cs_fail(CS_EINVAL, "structured output: no constraint");
    cs_grammar *g = calloc(1, sizeof *g);
    if (!g) return cs_fail(CS_ENOMEM, "structured output: out of memory");
    g->refs = 1;
    int r = 0;
    switch (spec->kind) {
    case CS_STRUCTURED_JSON_OBJECT:
        r = cs__g_compile_json_object(g);
        break;
    case CS_STRUCTURED_JSON_SCHEMA:
        if (!spec->text) r = cs__g_fail(g, CS_EINVAL, "json_schema: no schema");
        else if (strlen(spec->text) > CS_GRAMMAR_MAX_TEXT)
            r = cs__g_fail(g, CS_EINVAL, "json_schema: the schema is over %d bytes",
                           CS_GRAMMAR_MAX_TEXT);
        else r = cs__g_compile_json_schema(g, spec->text);
        break;
    case CS_STRUCTURED_REGEX:
        if (!spec->text || !*spec->text) r = cs__g_fail(g, CS_EINVAL, "regex: empty expression");
        else if (strlen(spec->text) > CS_GRAMMAR_MAX_TEXT)
            r = cs__g_fail(g, CS_EINVAL, "regex: the expression is over %d bytes",
                           CS_GRAMMAR_MAX_TEXT);
        else r = cs__g_compile_regex(g, spec->text, "regex");
        break;
    case CS_STRUCTURED_CHOICE: {
        if (spec->n_choices < 1 || spec->n_choices > CS_GRAMMAR_MAX_CHOICES || !spec->choices) {
            r = cs__g_fail(g, CS_EINVAL, "choice: %d choices; 1 to %d are allowed",
                           spec->n_choices, CS_GRAMMAR_MAX_CHOICES);
            break;
        }
        size_t total = 0;
        for (int32_t i = 0; i < spec->n_choices && !g->err; i++) {
            size_t n = strlen(spec->choices[i]);
            total += n;
            if (!n || total > CS_GRAMMAR_MAX_TEXT)
                cs__g_fail(g, CS_EINVAL, n ? "choice: over %d bytes in all"
                                           : "choice: choice %d is empty",
                           n ? CS_GRAMMAR_MAX_TEXT : i);
        }
        if (!g->err) g->root = cs__g_lit_alt(g, spec->choices, (uint32_t)spec->n_choices);
        r = g->err;
        break;
    }
    default:
        r = cs__g_fail(g, CS_EINVAL, "structured output: unknown kind %d", (int)spec->kind);
    }
    if (!r) r = g->err;
    if (!r && g->root >= g->n_nodes) /* a compiler returned no node without saying why */
        r = cs__g_fail(g, CS_EINVAL, "structured output: the constraint could not be compiled");
    if (!r) {
        bool *pr = calloc(g->n_nodes ? g->n_nodes : 1, sizeof *pr);
        r = pr ? finish(g, pr) : cs__g_fail(g, CS_ENOMEM, "structured output: out of memory");
        free(pr);
    }
    if (r) {
        cs_grammar_free(g);
        return r;
    }
    *out = g;
    return 0;
}

cs_grammar *cs_grammar_ref(cs_grammar *g) {
    if (g) g->refs++;
    return g;
}

void cs_grammar_free(cs_grammar *g) {
    if (!g || --g->refs > 0) return;
    mask_cache_free(g->cache);
    free(g->nodes);
    free(g->kids);
    free(g->sets);
    free(g);
}

cs_grammar_stats cs_grammar_get_stats(const cs_grammar *g) { return g->stats; }

/* ---- states ---- */

#define MAX_DEPTH 512   /* frames in one thread */
#define MAX_THREADS 1024 /* ways to read the text at once */
#define MAX_FORKS 64    /* nested forks in one expansion */
#define EXPAND_FUEL 20000 /* expansion steps for one byte */

typedef struct {
    uint32_t node, idx;
} gframe;

typedef struct {
    gframe *f; /* every thread's frames, one after the other */
    uint32_t nf, capf;
    uint32_t *th; /* (nth + 1) thread i is f[th[i] .. th[i + 1]) */
    uint32_t nth, capth;
    bool accept; /* some reading of the text is complete */
    bool oom;
} gstate;

static void state_clear(gstate *s) {
    s->nf = s->nth = 0;
    s->accept = false;
    s->oom = false;
}

static void state_free(gstate *s) {
    free(s->f);
    free(s->th);
    *s = (gstate){0};
}

static bool state_reserve(gstate *s, uint32_t nf, uint32_t nth) {
    if (nf > s->capf) {
        uint32_t c = s->capf ? s->capf : 64;
        while (c < nf)
            c *= 2;
        gframe *f = realloc(s->f, (size_t)c * sizeof *f);
        if (!f) return s->oom = true, false;
        s->f = f, s->capf = c;
    }
    if (nth + 1 > s->capth) {
        uint32_t c = s->capth ? s->capth : 16;
        while (c < nth + 1)
            c *= 2;
        uint32_t *t = realloc(s->th, (size_t)c * sizeof *t);
        if (!t) return s->oom = true, false;
        s->th = t, s->capth = c;
    }
    return true;
}

static bool state_copy(gstate *dst, const gstate *src) {
    if (!state_reserve(dst, src->nf, src->nth)) return false;
    if (src->nf) memcpy(dst->f, src->f, src->nf * sizeof *src->f);
    if (src->nth) memcpy(dst->th, src->th, (src->nth + 1) * sizeof *src->th);
    dst->nf = src->nf, dst->nth = src->nth, dst->accept = src->accept;
    return true;
}

/* Adds a thread unless an identical one is there. */
static void push_thread(gstate *s, const gframe *w, uint32_t d) {
    if (d == 0) {
        s->accept = true;
        return;
    }
    for (uint32_t i = 0; i < s->nth; i++)
        if (s->th[i + 1] - s->th[i] == d && !memcmp(s->f + s->th[i], w, d * sizeof *w)) return;
    if (s->nth >= MAX_THREADS || !state_reserve(s, s->nf + d, s->nth + 1)) return;
    if (s->nth == 0) s->th[0] = 0;
    memcpy(s->f + s->nf, w, d * sizeof *w);
    s->nf += d;
    s->th[++s->nth] = s->nf;
}

/* Runs the stack w[0..d) down until its top is a byte set (or it is empty),
 * adding every thread that reaches one to out. */
static void expand(const cs_grammar *g, gframe *w, uint32_t d, gstate *out, int forks, int *fuel) {
    for (;;) {
        if (--*fuel < 0) return; /* a pathological grammar: this reading is dropped */
        if (d == 0) {
            out->accept = true;
            return;
        }
        gframe *t = &w[d - 1];
        const cs_gnode *n = &g->nodes[t->node];
        switch (n->kind) {
        case CS_G_SET:
            push_thread(out, w, d);
            return;
        case CS_G_SEQ:
            if (t->idx >= n->b) {
                d--;
            } else if (t->idx + 1 == n->b) { /* the last kid replaces the frame */
                *t = (gframe){g->kids[n->a + t->idx], 0};
            } else {
                uint32_t k = g->kids[n->a + t->idx++];
                if (d == MAX_DEPTH) return; /* too deep: this reading is dropped */
                w[d++] = (gframe){k, 0};
            }
            break;
        case CS_G_ALT: {
            if (n->b == 0) return;
            gframe w2[MAX_DEPTH];
            for (uint32_t k = 0; k + 1 < n->b && forks < MAX_FORKS; k++) {
                memcpy(w2, w, (d - 1) * sizeof *w);
                w2[d - 1] = (gframe){g->kids[n->a + k], 0};
                expand(g, w2, d, out, forks + 1, fuel);
            }
            *t = (gframe){g->kids[n->a + n->b - 1], 0};
            break;
        }
        case CS_G_REP: {
            uint32_t c = t->idx;
            if (c < n->min) {
                t->idx++;
                if (d == MAX_DEPTH) return;
                w[d++] = (gframe){n->a, 0};
                break;
            }
            if (n->max != CS_G_INF && c >= n->max) {
                d--;
                break;
            }
            if (forks < MAX_FORKS) { /* done repeating (past the limit: that reading is lost) */
                gframe w2[MAX_DEPTH];
                memcpy(w2, w, (d - 1) * sizeof *w);
                expand(g, w2, d - 1, out, forks + 1, fuel);
            }
            if (n->max == CS_G_INF) t->idx = n->min; /* past min the count no longer matters */
            else t->idx++;
            if (n->max != CS_G_INF && t->idx == n->max) { /* the last one replaces the frame */
                *t = (gframe){n->a, 0};
            } else {
                if (d == MAX_DEPTH) return;
                w[d++] = (gframe){n->a, 0};
            }
            break;
        }
        }
    }
}

static void state_start(const cs_grammar *g, gstate *s) {
    state_clear(s);
    gframe w[MAX_DEPTH];
    w[0] = (gframe){g->root, 0};
    int fuel = EXPAND_FUEL;
    expand(g, w, 1, s, 0, &fuel);
}

/* to = from after byte c; returns whether any reading survives. */
static bool state_step(const cs_grammar *g, const gstate *from, uint8_t c, gstate *to) {
    state_clear(to);
    gframe w[MAX_DEPTH];
    int fuel = EXPAND_FUEL;
    for (uint32_t i = 0; i < from->nth; i++) {
        uint32_t b = from->th[i], d = from->th[i + 1] - b;
        const cs_gnode *top = &g->nodes[from->f[b + d - 1].node];
        if (!cs__gset_has(&g->sets[top->a], c)) continue;
        memcpy(w, from->f + b, (d - 1) * sizeof *w);
        expand(g, w, d - 1, to, 0, &fuel);
    }
    return to->nth > 0 || to->accept;
}

/* ---- vocabulary trie ---- */

enum { TOK_NORMAL = 0, TOK_EOG = 1, TOK_NONE = 2 };

struct cs_vocab_trie {
    int32_t n_vocab;
    uint32_t n_nodes;   /* node 0 is the root; the rest in preorder */
    uint8_t *byte;      /* (n_nodes) the byte on the edge into node i */
    uint16_t *depth;    /* (n_nodes) */
    uint32_t *end;      /* (n_nodes) one past the last node of i's subtree */
    uint32_t *tok_off;  /* (n_nodes + 1) the tokens spelled by node i: toks[tok_off[i]..] */
    int32_t *toks;
    uint16_t max_depth;
    uint8_t *kind;      /* (n_vocab) TOK_* */
    uint32_t *tb_off;   /* (n_vocab + 1) token i's bytes: tb[tb_off[i] .. tb_off[i + 1]) */
    uint8_t *tb;
    uint32_t *eog_bits; /* (words) */
};

static int by_bytes(const void *a, const void *b, void *ctx) {
    const cs_vocab_trie *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = t->tb_off[x + 1] - t->tb_off[x], ly = t->tb_off[y + 1] - t->tb_off[y];
    int c = memcmp(t->tb + t->tb_off[x], t->tb + t->tb_off[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

void cs_vocab_trie_free(cs_vocab_trie *t) {
    if (!t) return;
    free(t->byte);
    free(t->depth);
    free(t->end);
    free(t->tok_off);
    free(t->toks);
    free(t->kind);
    free(t->tb_off);
    free(t->tb);
    free(t->eog_bits);
    free(t);
}

#define TRIE_MAX_TOKEN 65535 /* bytes of one token */

int cs_vocab_trie_init(const cs_tokenizer *tok, int32_t n_vocab, cs_vocab_trie **out) {
    *out = NULL;
    int32_t nt = cs_tokenizer_n_vocab(tok), n = n_vocab > nt ? n_vocab : nt;
    cs_vocab_trie *t = calloc(1, sizeof *t);
    int32_t *order = NULL, *node_of = NULL, *path = NULL;
    if (!t) return cs_fail(CS_ENOMEM, "vocabulary trie: out of memory");
    t->n_vocab = n;
    size_t words = ((size_t)n + 31) / 32, total = 0;
    t->kind = calloc((size_t)n, 1);
    t->tb_off = calloc((size_t)n + 1, sizeof *t->tb_off);
    t->eog_bits = calloc(words, sizeof *t->eog_bits);
    if (!t->kind || !t->tb_off || !t->eog_bits) goto oom;
    for (int32_t i = 0; i < n; i++) {
        const char *b;
        size_t len = 0;
        t->kind[i] = TOK_NONE;
        if (i >= nt) { /* the model's rows past the tokenizer: never allowed */
        } else if (cs_tokenizer_is_eog(tok, i)) {
            t->kind[i] = TOK_EOG;
            t->eog_bits[i / 32] |= 1u << (i % 32);
        } else if (!cs_tokenizer_is_special(tok, i) &&
                   cs_tokenizer_token_bytes(tok, i, &b, &len) == 0 && len > 0 &&
                   len <= TRIE_MAX_TOKEN) {
            t->kind[i] = TOK_NORMAL;
            total += len;
        }
        if (total > UINT32_MAX / 2) goto oom;
    }
    t->tb = malloc(total ? total : 1);
    order = malloc((size_t)n * sizeof *order);
    if (!t->tb || !order) goto oom;
    int32_t n_norm = 0;
    uint32_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        t->tb_off[i] = off;
        if (t->kind[i] != TOK_NORMAL) continue;
        const char *b;
        size_t len;
        cs_tokenizer_token_bytes(tok, i, &b, &len);
        memcpy(t->tb + off, b, len);
        off += (uint32_t)len;
        order[n_norm++] = i;
    }
    t->tb_off[n] = off;
    qsort_r(order, (size_t)n_norm, sizeof *order, by_bytes, t);
    /* at most one node per byte of all tokens, plus the root */
    size_t cap = total + 1;
    t->byte = malloc(cap);
    t->depth = malloc(cap * sizeof *t->depth);
    t->end = malloc(cap * sizeof *t->end);
    t->tok_off = calloc(cap + 1, sizeof *t->tok_off);
    t->toks = malloc(((size_t)n_norm + 1) * sizeof *t->toks);
    node_of = malloc(((size_t)n_norm + 1) * sizeof *node_of);
    path = malloc(((size_t)TRIE_MAX_TOKEN + 1) * sizeof *path);
    if (!t->byte || !t->depth || !t->end || !t->tok_off || !t->toks || !node_of || !path)
        goto oom;
    uint32_t nn = 1, dp = 0; /* path[0..dp] = nodes of the previous token's prefix */
    t->byte[0] = 0, t->depth[0] = 0;
    path[0] = 0;
    const uint8_t *prev = NULL;
    uint32_t prev_len = 0;
    for (int32_t k = 0; k < n_norm; k++) {
        int32_t id = order[k];
        const uint8_t *b = t->tb + t->tb_off[id];
        uint32_t len = t->tb_off[id + 1] - t->tb_off[id], cp = 0;
        while (prev && cp < len && cp < prev_len && b[cp] == prev[cp])
            cp++;
        while (dp > cp) /* close the subtrees the new token leaves */
            t->end[path[dp--]] = nn;
        for (uint32_t j = cp; j < len; j++) {
            t->byte[nn] = b[j];
            t->depth[nn] = (uint16_t)(j + 1);
            if (j + 1 > t->max_depth) t->max_depth = (uint16_t)(j + 1);
            path[++dp] = (int32_t)nn++;
        }
        node_of[k] = path[len];
        prev = b, prev_len = len;
    }
    while (dp > 0)
        t->end[path[dp--]] = nn;
    t->end[0] = nn;
    t->n_nodes = nn;
    for (int32_t k = 0; k < n_norm; k++) /* tokens in node order: counts, then offsets */
        t->tok_off[node_of[k] + 1]++;
    for (uint32_t i = 0; i < nn; i++)
        t->tok_off[i + 1] += t->tok_off[i];
    for (int32_t k = 0; k < n_norm; k++) /* sorted by bytes = by node: already in order */
        t->toks[k] = order[k];
    free(order);
    free(node_of);
    free(path);
    *out = t;
    return 0;
oom:
    free(order);
    free(node_of);
    free(path);
    cs_vocab_trie_free(t);
    return cs_fail(CS_ENOMEM, "vocabulary trie: out of memory");
}

/* ---- the state table: states interned, transitions and masks memoized ----
 *
 * Each state reached at a token boundary or inside a trie walk is interned
 * once (its key: accept, thread count, thread lengths, frames). Its byte
 * transitions are filled in as walks need them, so a walk through a JSON
 * string (which loops on one state) costs a table lookup per trie node after
 * the first; its mask is kept once computed. The table is per grammar and
 * starts over when it outgrows TABLE_BYTES (only between masks). */

typedef struct {
    uint64_t hash;
    uint32_t *key;
    uint32_t key_len;
    int32_t *next;  /* (256) the state after each byte: -2 not known yet, -1 none */
    uint32_t *mask; /* (words) once computed */
    int32_t count;
} table_entry;

struct cs_mask_cache {
    const cs_vocab_trie *trie; /* the vocabulary the masks are for */
    table_entry *e;            /* by state id */
    uint32_t n, cap;
    int32_t *slot; /* (n_slot) hash -> id, -1 empty */
    uint32_t n_slot;
    size_t bytes;
    gstate tmp, out; /* scratch for transitions */
};

#define TABLE_BYTES (32u << 20) /* per grammar: the scheduler keeps 32, so at most 1 GiB */
#define TABLE_MAX_STATES (1u << 20)

static void mask_cache_clear(struct cs_mask_cache *c) {
    for (uint32_t i = 0; i < c->n; i++) {
        free(c->e[i].key);
        free(c->e[i].next);
        free(c->e[i].mask);
    }
    c->n = 0;
    c->bytes = 0;
    for (uint32_t i = 0; i < c->n_slot; i++)
        c->slot[i] = -1;
}

static void mask_cache_free(struct cs_mask_cache *c) {
    if (!c) return;
    mask_cache_clear(c);
    free(c->e);
    free(c->slot);
    state_free(&c->tmp);
    state_free(&c->out);
    free(c);
}

static struct cs_mask_cache *table_get(cs_grammar *g, const cs_vocab_trie *t) {
    struct cs_mask_cache *c = g->cache;
    if (c && c->trie != t) {
        mask_cache_free(c);
        g->cache = c = NULL;
    }
    if (c) return c;
    c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->n_slot = 1024;
    c->slot = malloc(c->n_slot * sizeof *c->slot);
    if (!c->slot) {
        free(c);
        return NULL;
    }
    for (uint32_t i = 0; i < c->n_slot; i++)
        c->slot[i] = -1;
    c->trie = t;
    return g->cache = c;
}

/* The state as words: accept, thread count, thread lengths, frames. */
static uint32_t state_key(const gstate *s, uint32_t **buf, uint32_t *cap) {
    uint32_t need = 2 + s->nth + 2 * s->nf;
    if (need > *cap) {
        uint32_t *k = realloc(*buf, need * sizeof *k);
        if (!k) return 0;
        *buf = k, *cap = need;
    }
    uint32_t *k = *buf, n = 0;
    k[n++] = s->accept;
    k[n++] = s->nth;
    for (uint32_t i = 0; i < s->nth; i++)
        k[n++] = s->th[i + 1] - s->th[i];
    if (s->nf) memcpy(k + n, s->f, s->nf * sizeof *s->f);
    return n + 2 * s->nf;
}

static bool state_from_key(gstate *s, const uint32_t *k, uint32_t kl) {
    uint32_t nth = k[1], nf = (kl - 2 - nth) / 2;
    if (!state_reserve(s, nf, nth)) return false;
    s->accept = k[0], s->nth = nth, s->nf = nf;
    uint32_t off = 0;
    for (uint32_t i = 0; i < nth; i++) {
        s->th[i] = off;
        off += k[2 + i];
    }
    s->th[nth] = off;
    if (nf) memcpy(s->f, k + 2 + nth, nf * sizeof *s->f);
    return true;
}

/* The id of the state with this key, added if new; -1 out of memory. */
static int32_t table_intern(struct cs_mask_cache *c, const uint32_t *key, uint32_t kl) {
    uint64_t h = XXH3_64bits(key, kl * sizeof *key);
    uint32_t i = (uint32_t)h & (c->n_slot - 1);
    for (; c->slot[i] >= 0; i = (i + 1) & (c->n_slot - 1)) {
        const table_entry *e = &c->e[c->slot[i]];
        if (e->hash == h && e->key_len == kl && !memcmp(e->key, key, kl * sizeof *key))
            return c->slot[i];
    }
    if (c->n + 1 >= c->n_slot) return -1; /* earlier rehashes failed for want of memory */
    if (c->n == c->cap) {
        uint32_t cap = c->cap ? 2 * c->cap : 256;
        table_entry *e = realloc(c->e, cap * sizeof *e);
        if (!e) return -1;
        c->e = e, c->cap = cap;
    }
    table_entry e = {.hash = h, .key_len = kl};
    if (!(e.key = malloc(kl * sizeof *key))) return -1;
    memcpy(e.key, key, kl * sizeof *key);
    int32_t id = (int32_t)c->n;
    c->e[c->n++] = e;
    c->bytes += sizeof e + kl * sizeof *key;
    c->slot[i] = id;
    if (2 * c->n > c->n_slot) { /* rehash at half full */
        uint32_t ns = 2 * c->n_slot;
        int32_t *s = malloc(ns * sizeof *s);
        if (!s) return id; /* stays correct, only slower */
        for (uint32_t k = 0; k < ns; k++)
            s[k] = -1;
        for (uint32_t k = 0; k < c->n; k++) {
            uint32_t j = (uint32_t)c->e[k].hash & (ns - 1);
            while (s[j] >= 0)
                j = (j + 1) & (ns - 1);
            s[j] = (int32_t)k;
        }
        free(c->slot);
        c->slot = s, c->n_slot = ns;
    }
    return id;
}

/* The state after byte b from state id: an id, -1 when the byte does not
 * fit, -2 out of memory. */
static int32_t table_next(const cs_grammar *g, struct cs_mask_cache *c, int32_t id, uint8_t b,
                          uint32_t **kbuf, uint32_t *kcap) {
    table_entry *e = &c->e[id];
    if (!e->next) {
        if (!(e->next = malloc(256 * sizeof *e->next))) return -2;
        for (int k = 0; k < 256; k++)
            e->next[k] = -2;
        c->bytes += 256 * sizeof *e->next;
    }
    if (e->next[b] != -2) return e->next[b];
    if (!state_from_key(&c->tmp, e->key, e->key_len)) return -2;
    int32_t to = -1;
    if (state_step(g, &c->tmp, b, &c->out)) {
        if (c->out.oom) return -2;
        uint32_t kl = state_key(&c->out, kbuf, kcap);
        if (!kl || (to = table_intern(c, *kbuf, kl)) < 0) return -2;
    }
    c->e[id].next[b] = to; /* c->e may have moved */
    return to;
}

/* ---- matcher ---- */

struct cs_matcher {
    cs_grammar *g;
    const cs_vocab_trie *t;
    gstate cur, a, b;
    int32_t *walk; /* (t->max_depth + 1) the state id at each trie depth */
    uint32_t *key;
    uint32_t key_cap;
    uint32_t *allow; /* (words) */
    size_t words;
};

int cs_matcher_init(cs_grammar *g, const cs_vocab_trie *t, cs_matcher **out) {
    *out = NULL;
    cs_matcher *m = calloc(1, sizeof *m);
    if (!m) return cs_fail(CS_ENOMEM, "matcher: out of memory");
    m->g = cs_grammar_ref(g);
    m->t = t;
    m->words = ((size_t)t->n_vocab + 31) / 32;
    m->allow = malloc(m->words * sizeof *m->allow);
    state_start(g, &m->cur);
    if (!m->allow || m->cur.oom) {
        cs_matcher_free(m);
        return cs_fail(CS_ENOMEM, "matcher: out of memory");
    }
    *out = m;
    return 0;
}

void cs_matcher_free(cs_matcher *m) {
    if (!m) return;
    state_free(&m->cur);
    state_free(&m->a);
    state_free(&m->b);
    free(m->walk);
    free(m->key);
    free(m->allow);
    cs_grammar_free(m->g);
    free(m);
}

int cs_matcher_feed(cs_matcher *m, const char *bytes, size_t n) {
    if (n == 0) return 0;
    const gstate *from = &m->cur;
    gstate *to = &m->a;
    for (size_t i = 0; i < n; i++) {
        if (!state_step(m->g, from, (uint8_t)bytes[i], to))
            return cs_fail(CS_EINVAL, "structured output: byte %zu (0x%02x) does not fit", i,
                           (uint8_t)bytes[i]);
        if (to->oom) return cs_fail(CS_ENOMEM, "matcher: out of memory");
        from = to;
        to = to == &m->a ? &m->b : &m->a;
    }
    if (!state_copy(&m->cur, from)) return cs_fail(CS_ENOMEM, "matcher: out of memory");
    return 0;
}

int cs_matcher_accept(cs_matcher *m, int32_t id) {
    const cs_vocab_trie *t = m->t;
    if (id < 0 || id >= t->n_vocab)
        return cs_fail(CS_EINVAL, "structured output: token %d is outside the vocabulary", id);
    if (t->kind[id] == TOK_EOG) {
        if (!m->cur.accept)
            return cs_fail(CS_EINVAL,
                           "structured output: end of generation (token %d) before the output "
                           "is complete", id);
        return 0;
    }
    if (t->kind[id] != TOK_NORMAL)
        return cs_fail(CS_EINVAL, "structured output: token %d is a control token", id);
    int r = cs_matcher_feed(m, (const char *)t->tb + t->tb_off[id], t->tb_off[id + 1] - t->tb_off[id]);
    if (r == CS_EINVAL)
        return cs_fail(CS_EINVAL, "structured output: token %d does not continue the output", id);
    return r;
}

bool cs_matcher_complete(const cs_matcher *m) { return m->cur.accept; }
bool cs_matcher_finished(const cs_matcher *m) { return m->cur.accept && m->cur.nth == 0; }

/* Walks the trie from state id into bits (zeroed first); -1 out of memory. */
static int walk(cs_matcher *m, struct cs_mask_cache *c, int32_t id, uint32_t *bits) {
    const cs_vocab_trie *t = m->t;
    if (!m->walk && !(m->walk = malloc(((size_t)t->max_depth + 1) * sizeof *m->walk))) return -1;
    memset(bits, 0, m->words * sizeof *bits);
    m->walk[0] = id;
    uint64_t visited = 0;
    for (uint32_t i = 1; i < t->n_nodes;) {
        uint32_t d = t->depth[i];
        int32_t to = table_next(m->g, c, m->walk[d - 1], t->byte[i], &m->key, &m->key_cap);
        visited++;
        if (to == -2) return -1;
        if (to < 0) {
            i = t->end[i];
            continue;
        }
        m->walk[d] = to;
        for (uint32_t k = t->tok_off[i]; k < t->tok_off[i + 1]; k++)
            bits[t->toks[k] / 32] |= 1u << (t->toks[k] % 32);
        i++;
    }
    m->g->stats.nodes += visited;
    return 0;
}

static int32_t popcount(const uint32_t *w, size_t n) {
    int32_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += __builtin_popcount(w[i]);
    return c;
}

int32_t cs_matcher_mask(cs_matcher *m, const uint32_t **allow) {
    cs_grammar *g = m->g;
    const cs_vocab_trie *t = m->t;
    *allow = m->allow;
    if (m->cur.nth == 0) { /* finished: only the end */
        memcpy(m->allow, t->eog_bits, m->words * sizeof *m->allow);
        return popcount(m->allow, m->words);
    }
    struct cs_mask_cache *c = table_get(g, t);
    if (!c) return cs_fail(CS_ENOMEM, "matcher: out of memory");
    if (c->bytes > TABLE_BYTES || c->n > TABLE_MAX_STATES) mask_cache_clear(c);
    uint32_t kl = state_key(&m->cur, &m->key, &m->key_cap);
    int32_t id = kl ? table_intern(c, m->key, kl) : -1;
    if (id < 0) return cs_fail(CS_ENOMEM, "matcher: out of memory");
    if (c->e[id].mask) {
        memcpy(m->allow, c->e[id].mask, m->words * sizeof *m->allow);
        g->stats.hits++;
        return c->e[id].count;
    }
    if (walk(m, c, id, m->allow)) return cs_fail(CS_ENOMEM, "matcher: out of memory");
    g->stats.walks++;
    if (m->cur.accept)
        for (size_t i = 0; i < m->words; i++)
            m->allow[i] |= t->eog_bits[i];
    int32_t count = popcount(m->allow, m->words);
    if (count == 0) { /* a reading dropped at a limit (nesting, fuel): the text cannot go on */
        memcpy(m->allow, t->eog_bits, m->words * sizeof *m->allow);
        count = popcount(m->allow, m->words);
    }
    uint32_t *keep = malloc(m->words * sizeof *keep);
    if (keep) { /* without memory the mask is only not kept */
        memcpy(keep, m->allow, m->words * sizeof *keep);
        c->e[id].mask = keep;
        c->e[id].count = count;
        c->bytes += m->words * sizeof *keep;
    }
    return count;
}
