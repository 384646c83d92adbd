/* pretok.c: hand-written pre-tokenizers (the regex split before BPE merges)
 * for the GPT-2, SmolLM, Llama-3 and Qwen2 families, equivalent to the
 * Hugging Face tokenizers regexes they replace (see enum cs_pretok) and to
 * llama.cpp's splitters. Not a regex engine: each family is a small scanner
 * that tries the regex alternatives in order at each position. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer-impl.h"
#include "unicode.h"
#include "util.h"

/* Scanner over one range [begin, end) of valid UTF-8. Positions are byte
 * offsets; lookahead past end sees "no character" (as a regex at the end of
 * its input), which matters for \s+(?!\S). */
typedef struct {
    const uint8_t *s;
    size_t end;
    cs__pieces *out;
    size_t last; /* end of the last emitted piece */
} scan;

#define OUT_OF_RANGE 0xFFFFFFFFu

typedef struct {
    uint32_t cp;    /* OUT_OF_RANGE past the end */
    unsigned flags; /* CS_UFLAG_* */
    size_t next;    /* position after this character */
} ch;

static ch at(const scan *sc, size_t pos) {
    ch c = {OUT_OF_RANGE, 0, pos};
    if (pos >= sc->end) return c;
    uint32_t cp;
    int k = cs__utf8_decode(sc->s + pos, sc->end - pos, &cp);
    if (k <= 0) { /* callers validate first; treat a stray byte as "other" */
        c.cp = 0xFFFD;
        c.next = pos + 1;
        return c;
    }
    c.cp = cp;
    c.flags = cs__unicode_flags(cp);
    c.next = pos + (size_t)k;
    return c;
}

/* In range and not \s, \p{L} or \p{N}: the class [^\s\p{L}\p{N}]. */
static int is_other(ch c) {
    return c.cp != OUT_OF_RANGE &&
           !(c.flags & (CS_UFLAG_SPACE | CS_UFLAG_LETTER | CS_UFLAG_NUMBER));
}

static int emit(scan *sc, size_t end) {
    if (end <= sc->last) return 0;
    cs__pieces *p = sc->out;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        size_t *e = realloc(p->ends, cap * sizeof *e);
        if (!e) return cs_fail(CS_ENOMEM, "tokenizer: out of memory pre-tokenizing");
        p->ends = e;
        p->cap = cap;
    }
    p->ends[p->n++] = end;
    sc->last = end;
    return 0;
}

static size_t skip_while(const scan *sc, size_t pos, unsigned flag) {
    for (;;) {
        ch c = at(sc, pos);
        if (!(c.flags & flag)) return pos;
        pos = c.next;
    }
}

static size_t skip_other(const scan *sc, size_t pos) {
    for (;;) {
        ch c = at(sc, pos);
        if (!is_other(c)) return pos;
        pos = c.next;
    }
}

/* 's|'t|'re|'ve|'m|'ll|'d at pos (an apostrophe); returns the end or 0.
 * Case-insensitive for Llama-3/Qwen2's (?i:...), where Unicode simple case
 * folding also lets U+017F LATIN SMALL LETTER LONG S match 's' (as the HF
 * tokenizers regex does; llama.cpp's [sS] rewrite does not). */
static size_t contraction(const scan *sc, size_t pos, int icase) {
    ch c1 = at(sc, pos + 1);
    uint32_t a = c1.cp;
    if (icase) {
        if (a >= 'A' && a <= 'Z') a += 'a' - 'A';
        if (a == 0x17F) a = 's';
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return c1.next;
    if (a != 'r' && a != 'v' && a != 'l') return 0;
    ch c2 = at(sc, c1.next);
    uint32_t b = c2.cp;
    if (icase && b >= 'A' && b <= 'Z') b += 'a' - 'A';
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return c2.next;
    return 0;
}

/* Whitespace alternatives shared by both families, at a position where no
 * other alternative matched: \s+(?!\S) leaves the last char of a run that is
 * followed by a non-space for the next piece; \s+ takes a single one then. */
static size_t whitespace_run(const scan *sc, size_t pos) {
    size_t p = pos, last_start = pos;
    int n = 0;
    for (;;) {
        ch c = at(sc, p);
        if (!(c.flags & CS_UFLAG_SPACE)) break;
        last_start = p;
        p = c.next;
        if (n < 2) n++;
    }
    if (n > 1 && p < sc->end) return last_start;
    if (n > 0) return p;
    return at(sc, pos).next; /* no alternative matched; every char matches one */
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static int split_gpt2(scan *sc, size_t pos) {
    while (pos < sc->end) {
        ch c0 = at(sc, pos);
        size_t end = 0;
        if (c0.cp == '\'') end = contraction(sc, pos, 0);
        if (!end) {
            size_t body = c0.cp == ' ' ? c0.next : pos;
            ch c = c0.cp == ' ' ? at(sc, body) : c0;
            if (c.flags & CS_UFLAG_LETTER) {
                end = skip_while(sc, body, CS_UFLAG_LETTER);
            } else if (c.flags & CS_UFLAG_NUMBER) {
                end = skip_while(sc, body, CS_UFLAG_NUMBER);
            } else if (is_other(c)) {
                end = skip_other(sc, body);
            } else {
                end = whitespace_run(sc, pos);
            }
        }
        int rc = emit(sc, end);
        if (rc) return rc;
        pos = end;
    }
    return 0;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static int split_llama3(scan *sc, size_t pos, int max_digits) {
    while (pos < sc->end) {
        ch c0 = at(sc, pos);
        size_t end = 0;
        if (c0.cp == '\'') end = contraction(sc, pos, 1);
        if (!end && c0.cp != '\r' && c0.cp != '\n' && !(c0.flags & CS_UFLAG_NUMBER)) {
            if (c0.flags & CS_UFLAG_LETTER) {
                end = skip_while(sc, c0.next, CS_UFLAG_LETTER);
            } else if (at(sc, c0.next).flags & CS_UFLAG_LETTER) {
                end = skip_while(sc, c0.next, CS_UFLAG_LETTER);
            }
        }
        if (!end && (c0.flags & CS_UFLAG_NUMBER)) {
            end = c0.next;
            for (int k = 1; k < max_digits; k++) {
                ch c = at(sc, end);
                if (!(c.flags & CS_UFLAG_NUMBER)) break;
                end = c.next;
            }
        }
        if (!end) {
            size_t body = c0.cp == ' ' ? c0.next : pos;
            ch c = c0.cp == ' ' ? at(sc, body) : c0;
            if (is_other(c)) {
                end = skip_other(sc, body);
                for (;;) {
                    ch r = at(sc, end);
                    if (r.cp != '\r' && r.cp != '\n') break;
                    end = r.next;
                }
            }
        }
        if (!end) {
            /* \s*[\r\n]+ ends after the last CR/LF of the whitespace run. */
            size_t p = pos;
            for (;;) {
                ch c = at(sc, p);
                if (!(c.flags & CS_UFLAG_SPACE)) break;
                if (c.cp == '\r' || c.cp == '\n') end = c.next;
                p = c.next;
            }
            if (!end) end = whitespace_run(sc, pos);
        }
        int rc = emit(sc, end);
        if (rc) return rc;
        pos = end;
    }
    return 0;
}

int cs__pretok_split(enum cs_pretok kind, const char *text, size_t len, cs__pieces *out) {
    out->n = 0;
    if (!cs__utf8_valid((const uint8_t *)text, len))
        return cs_fail(CS_EINVAL, "tokenizer: input is not valid UTF-8");
    scan sc = {(const uint8_t *)text, len, out, 0};
    switch (kind) {
    case CS_PRETOK_GPT2: return split_gpt2(&sc, 0);
    case CS_PRETOK_LLAMA3: return split_llama3(&sc, 0, 3);
    case CS_PRETOK_QWEN2: return split_llama3(&sc, 0, 1);
    case CS_PRETOK_SMOLLM: {
        /* Digits(individual_digits) first, then the GPT-2 regex on each
         * remaining segment separately (HF Sequence / llama.cpp's chained
         * regex_exprs), so e.g. "a 1" gives "a", " ", "1". */
        size_t seg = 0, pos = 0;
        while (pos < len) {
            ch c = at(&sc, pos);
            if (c.flags & CS_UFLAG_NUMBER) {
                if (seg < pos) {
                    sc.end = pos;
                    int rc = split_gpt2(&sc, seg);
                    sc.end = len;
                    if (rc) return rc;
                }
                int rc = emit(&sc, c.next);
                if (rc) return rc;
                seg = c.next;
            }
            pos = c.next;
        }
        return seg < len ? split_gpt2(&sc, seg) : 0;
    }
    }
    return cs_fail(CS_EINVAL, "tokenizer: bad pre-tokenizer kind %d", (int)kind);
}

/* tokenizer.ggml.pre names, grouped as llama.cpp's llama-vocab.cpp groups
 * them by regex. Names whose llama.cpp entry also changes other behaviour we
 * do not model (dbrx/smaug-bpe: Llama-3 regex without ignore_merges;
 * roberta-style add_sep) are left out on purpose. */
static const struct {
    const char *name;
    enum cs_pretok kind;
} pretok_names[] = {
    {"gpt2", CS_PRETOK_GPT2},
    {"gpt-2", CS_PRETOK_GPT2},
    {"phi-2", CS_PRETOK_GPT2},
    {"mpt", CS_PRETOK_GPT2},
    {"olmo", CS_PRETOK_GPT2},
    {"jais", CS_PRETOK_GPT2},
    {"exaone4", CS_PRETOK_GPT2},
    {"trillion", CS_PRETOK_GPT2},
    {"granite-docling", CS_PRETOK_GPT2},
    {"smollm", CS_PRETOK_SMOLLM},
    {"starcoder", CS_PRETOK_SMOLLM},
    {"refact", CS_PRETOK_SMOLLM},
    {"command-r", CS_PRETOK_SMOLLM},
    {"codeshell", CS_PRETOK_SMOLLM},
    {"exaone", CS_PRETOK_SMOLLM},
    {"minerva-7b", CS_PRETOK_SMOLLM},
    {"llama3", CS_PRETOK_LLAMA3},
    {"llama-v3", CS_PRETOK_LLAMA3},
    {"llama-bpe", CS_PRETOK_LLAMA3},
    {"falcon3", CS_PRETOK_LLAMA3},
    {"qwen2", CS_PRETOK_QWEN2},
    {"deepseek-r1-qwen", CS_PRETOK_QWEN2},
    {"stablelm2", CS_PRETOK_QWEN2},
    {"megrez", CS_PRETOK_QWEN2},
};

int cs__pretok_from_name(const char *name, enum cs_pretok *out) {
    if (!name) return cs_fail(CS_ENOTSUP, "tokenizer: no pre-tokenizer name");
    for (size_t i = 0; i < sizeof pretok_names / sizeof pretok_names[0]; i++) {
        if (strcmp(name, pretok_names[i].name) == 0) {
            *out = pretok_names[i].kind;
            return 0;
        }
    }
    return cs_fail(CS_ENOTSUP, "tokenizer: unsupported pre-tokenizer '%.64s'", name);
}

const char *cs__pretok_name(enum cs_pretok kind) {
    switch (kind) {
    case CS_PRETOK_GPT2: return "gpt2";
    case CS_PRETOK_SMOLLM: return "smollm";
    case CS_PRETOK_LLAMA3: return "llama3";
    case CS_PRETOK_QWEN2: return "qwen2";
    }
    return "?";
}
