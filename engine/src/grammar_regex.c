/* grammar_regex.c: regular expressions into grammar nodes.
 *
 * The common syntax of Python's re, JavaScript and PCRE, over UTF-8 text:
 * literals, '.', classes [a-z] [^...] (ASCII ranges; non-ASCII characters as
 * members of a positive class), \d \w \s and their negations (ASCII classes;
 * the negations include every non-ASCII character), escapes \n \r \t \f \v
 * \xHH \uHHHH, groups ( ) (?: ) (?P<name> ) (?<name> ), '|', and the
 * quantifiers * + ? {m} {m,} {m,n} (lazy forms match the same text). '^' at
 * the start and '$' at the end are accepted; the whole output must match.
 * Refused by name: backreferences, lookaround, word boundaries, possessive
 * quantifiers, anchors inside, inline flags. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "util.h"

#define MAX_REPEAT 1000 /* {m,n} bounds */
#define MAX_NEST 200    /* nested groups */

typedef struct {
    cs_grammar *g;
    const char *s; /* the expression */
    size_t i, n;
    const char *what; /* "regex", "json_schema: pattern" */
    bool json;        /* inside a JSON string: no '"', '\\' or control bytes */
    int nest;
} rx;

/* A class: ASCII members, whether any non-ASCII character is a member, and
 * listed non-ASCII characters (UTF-8). */
typedef struct {
    cs_gset ascii;
    bool any_nonascii;
    char (*wide)[4];
    uint8_t *wide_len;
    uint32_t n_wide;
} cclass;

static uint32_t bad(rx *r, const char *fmt, const char *detail) {
    char msg[300];
    snprintf(msg, sizeof msg, fmt, detail);
    cs__g_fail(r->g, CS_EINVAL, "%s: %s (at offset %zu of '%.60s')", r->what, msg, r->i, r->s);
    return CS_G_BAD;
}

static void class_free(cclass *c) {
    free(c->wide);
    free(c->wide_len);
}

static bool class_add_wide(rx *r, cclass *c, const char *u, int len) {
    char(*w)[4] = realloc(c->wide, (c->n_wide + 1) * sizeof *w);
    if (w) c->wide = w;
    uint8_t *l = realloc(c->wide_len, c->n_wide + 1);
    if (l) c->wide_len = l;
    if (!w || !l) {
        cs__g_fail(r->g, CS_ENOMEM, "%s: out of memory", r->what);
        return false;
    }
    memcpy(c->wide[c->n_wide], u, (size_t)len);
    c->wide_len[c->n_wide++] = (uint8_t)len;
    return true;
}

/* Bytes of the UTF-8 character at s (1..4), 0 if it is not valid UTF-8. */
static int utf8_len(const unsigned char *s, size_t avail) {
    int n = s[0] < 0x80 ? 1 : s[0] >= 0xC2 && s[0] <= 0xDF ? 2 : s[0] >= 0xE0 && s[0] <= 0xEF ? 3
                                                          : s[0] >= 0xF0 && s[0] <= 0xF4 ? 4
                                                                                          : 0;
    if (!n || (size_t)n > avail) return 0;
    for (int k = 1; k < n; k++)
        if ((s[k] & 0xC0) != 0x80) return 0;
    return n;
}

static int utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) return out[0] = (char)cp, 1;
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 63));
        return 2;
    }
    out[0] = (char)(0xE0 | (cp >> 12)), out[1] = (char)(0x80 | ((cp >> 6) & 63));
    out[2] = (char)(0x80 | (cp & 63));
    return 3;
}

static void set_digit(cs_gset *s) { cs__gset_add_range(s, '0', '9'); }
static void set_word(cs_gset *s) {
    cs__gset_add_range(s, 'a', 'z');
    cs__gset_add_range(s, 'A', 'Z');
    cs__gset_add_range(s, '0', '9');
    cs__gset_add(s, '_');
}
static void set_space(cs_gset *s) {
    const char *sp = " \t\n\r\f\v";
    for (; *sp; sp++)
        cs__gset_add(s, (uint8_t)*sp);
}
static void set_negate_ascii(cs_gset *s) {
    s->w[0] = ~s->w[0], s->w[1] = ~s->w[1];
    s->w[2] = s->w[3] = 0;
}

/* The node for a class, restricted to what a JSON string may hold raw. */
static uint32_t class_node(rx *r, cclass *c) {
    cs_grammar *g = r->g;
    cs_gset a = c->ascii;
    a.w[2] = a.w[3] = 0;
    if (r->json) {
        a.w[0] &= ~0xFFFFFFFFull; /* controls */
        a.w[0] &= ~(1ull << '"');
        a.w[1] &= ~(1ull << ('\\' - 64));
    }
    uint32_t alts[3], n = 0;
    alts[n++] = cs__g_set(g, &a);
    if (c->any_nonascii) {
        cs_gset none = {{0}};
        alts[n++] = cs__g_utf8_char(g, &none);
    }
    if (c->n_wide && !c->any_nonascii) {
        uint32_t *k = malloc(c->n_wide * sizeof *k);
        if (!k) {
            cs__g_fail(g, CS_ENOMEM, "%s: out of memory", r->what);
            return CS_G_BAD;
        }
        for (uint32_t i = 0; i < c->n_wide; i++)
            k[i] = cs__g_lit(g, c->wide[i], c->wide_len[i]);
        alts[n++] = cs__g_alt(g, k, c->n_wide);
        free(k);
    }
    return cs__g_alt(g, alts, n);
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* Reads the escape after '\\' into c (a class of one or more characters).
 * Returns false after an error. */
static bool escape(rx *r, cclass *c, bool in_class) {
    if (r->i >= r->n) return bad(r, "%s", "a trailing backslash"), false;
    char e = r->s[r->i++];
    switch (e) {
    case 'd': set_digit(&c->ascii); return true;
    case 'w': set_word(&c->ascii); return true;
    case 's': set_space(&c->ascii); return true;
    case 'D': case 'W': case 'S': {
        cs_gset s = {{0}};
        (e == 'D' ? set_digit : e == 'W' ? set_word : set_space)(&s);
        set_negate_ascii(&s);
        for (int k = 0; k < 2; k++)
            c->ascii.w[k] |= s.w[k];
        c->any_nonascii = true;
        return true;
    }
    case 'n': cs__gset_add(&c->ascii, '\n'); return true;
    case 'r': cs__gset_add(&c->ascii, '\r'); return true;
    case 't': cs__gset_add(&c->ascii, '\t'); return true;
    case 'f': cs__gset_add(&c->ascii, '\f'); return true;
    case 'v': cs__gset_add(&c->ascii, '\v'); return true;
    case 'x': case 'u': {
        int digits = e == 'x' ? 2 : 4;
        uint32_t cp = 0;
        for (int k = 0; k < digits; k++) {
            int h = r->i < r->n ? hexval(r->s[r->i]) : -1;
            if (h < 0) return bad(r, "\\%s needs hex digits", e == 'x' ? "x" : "u"), false;
            cp = cp * 16 + (uint32_t)h;
            r->i++;
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) return bad(r, "%s", "a surrogate code point"), false;
        if (cp < 0x80) {
            cs__gset_add(&c->ascii, (uint8_t)cp);
            return true;
        }
        char u[4];
        int len = utf8_put(cp, u);
        return class_add_wide(r, c, u, len);
    }
    case 'b': case 'B': case 'A': case 'Z': case 'z': case 'G':
        if (in_class && e == 'b') {
            cs__gset_add(&c->ascii, '\b');
            return true;
        }
        return bad(r, "anchors and word boundaries (\\%s) are not supported",
                   (char[]){e, 0}), false;
    default:
        if (e >= '1' && e <= '9')
            return bad(r, "%s", "backreferences are not supported"), false;
        if (e == '0') return bad(r, "%s", "\\0 and octal escapes are not supported"), false;
        if ((unsigned char)e >= 0x80 || (e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z'))
            return bad(r, "unknown escape \\%s", (char[]){e, 0}), false;
        cs__gset_add(&c->ascii, (uint8_t)e); /* \. \\ \[ \- ... */
        return true;
    }
}

/* One class member character (not an escape): ASCII code or -1 for a wide one
 * (added to c), -2 after an error. */
static int class_char(rx *r, cclass *c) {
    const unsigned char *p = (const unsigned char *)r->s + r->i;
    int len = utf8_len(p, r->n - r->i);
    if (!len) return bad(r, "%s", "invalid UTF-8"), -2;
    r->i += (size_t)len;
    if (len == 1) return p[0];
    return class_add_wide(r, c, (const char *)p, len) ? -1 : -2;
}

static uint32_t parse_class(rx *r) {
    cclass c = {0};
    bool neg = false;
    if (r->i < r->n && r->s[r->i] == '^') neg = true, r->i++;
    bool first = true;
    for (;;) {
        if (r->i >= r->n) {
            class_free(&c);
            return bad(r, "%s", "an unterminated [class]");
        }
        char ch = r->s[r->i];
        if (ch == ']' && !first) {
            r->i++;
            break;
        }
        first = false;
        if (ch == '[' && r->i + 1 < r->n && r->s[r->i + 1] == ':') {
            class_free(&c);
            return bad(r, "%s", "POSIX classes [:name:] are not supported");
        }
        int lo;
        if (ch == '\\') {
            r->i++;
            cclass one = {0};
            if (!escape(r, &one, true)) {
                class_free(&one), class_free(&c);
                return CS_G_BAD;
            }
            int members = 0, last = -1;
            for (int k = 0; k < 128; k++)
                if (cs__gset_has(&one.ascii, (uint8_t)k)) members++, last = k;
            for (int k = 0; k < 4; k++)
                c.ascii.w[k] |= one.ascii.w[k];
            c.any_nonascii |= one.any_nonascii;
            for (uint32_t k = 0; k < one.n_wide; k++)
                if (!class_add_wide(r, &c, one.wide[k], one.wide_len[k])) {
                    class_free(&one), class_free(&c);
                    return CS_G_BAD;
                }
            bool single = members == 1 && !one.any_nonascii && !one.n_wide;
            class_free(&one);
            if (!single) continue;
            lo = last;
        } else {
            lo = class_char(r, &c);
            if (lo == -2) {
                class_free(&c);
                return CS_G_BAD;
            }
            if (lo == -1) {
                if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
                    class_free(&c);
                    return bad(r, "%s", "ranges of non-ASCII characters are not supported");
                }
                continue;
            }
            cs__gset_add(&c.ascii, (uint8_t)lo);
        }
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            int hi;
            if (r->s[r->i] == '\\') {
                r->i++;
                cclass one = {0};
                bool ok = escape(r, &one, true);
                int members = 0;
                hi = -1;
                for (int k = 0; k < 128; k++)
                    if (cs__gset_has(&one.ascii, (uint8_t)k)) members++, hi = k;
                bool single = members == 1 && !one.any_nonascii && !one.n_wide;
                class_free(&one);
                if (!ok) {
                    class_free(&c);
                    return CS_G_BAD;
                }
                if (!single) {
                    class_free(&c);
                    return bad(r, "%s", "a range must end at one character");
                }
            } else {
                hi = class_char(r, &c);
                if (hi < 0) {
                    class_free(&c);
                    return hi == -2 ? CS_G_BAD
                                    : bad(r, "%s", "ranges of non-ASCII characters are not supported");
                }
            }
            if (hi < lo) {
                class_free(&c);
                return bad(r, "%s", "a range out of order");
            }
            cs__gset_add_range(&c.ascii, (uint8_t)lo, (uint8_t)hi);
        }
    }
    if (neg) {
        if (c.n_wide) {
            class_free(&c);
            return bad(r, "%s", "non-ASCII characters in a negated class are not supported");
        }
        set_negate_ascii(&c.ascii);
        c.any_nonascii = true;
    }
    uint32_t node = class_node(r, &c);
    class_free(&c);
    return node;
}

static uint32_t parse_alt(rx *r);

static uint32_t parse_atom(rx *r) {
    char ch = r->s[r->i];
    cclass c = {0};
    switch (ch) {
    case '(': {
        r->i++;
        if (r->i < r->n && r->s[r->i] == '?') {
            r->i++;
            char k = r->i < r->n ? r->s[r->i] : 0;
            if (k == ':') {
                r->i++;
            } else if (k == 'P' || (k == '<' && r->i + 1 < r->n && r->s[r->i + 1] != '=' &&
                                    r->s[r->i + 1] != '!')) {
                if (k == 'P') r->i++;
                if (r->i >= r->n || r->s[r->i] != '<') return bad(r, "%s", "a bad group name");
                while (r->i < r->n && r->s[r->i] != '>')
                    r->i++;
                if (r->i >= r->n) return bad(r, "%s", "a bad group name");
                r->i++;
            } else if (k == '=' || k == '!' || k == '<') {
                return bad(r, "%s", "lookaround is not supported");
            } else {
                return bad(r, "%s", "inline flags and other (? groups are not supported");
            }
        }
        if (++r->nest > MAX_NEST) return bad(r, "%s", "groups nested too deep");
        uint32_t node = parse_alt(r);
        r->nest--;
        if (node == CS_G_BAD) return node;
        if (r->i >= r->n || r->s[r->i] != ')') return bad(r, "%s", "an unclosed group");
        r->i++;
        return node;
    }
    case '[':
        r->i++;
        return parse_class(r);
    case '.': {
        r->i++;
        cs__gset_add_range(&c.ascii, 0, 127);
        c.ascii.w[0] &= ~(1ull << '\n');
        c.any_nonascii = true;
        return class_node(r, &c);
    }
    case '\\': {
        r->i++;
        if (!escape(r, &c, false)) {
            class_free(&c);
            return CS_G_BAD;
        }
        uint32_t node = class_node(r, &c);
        class_free(&c);
        return node;
    }
    case '^': case '$':
        return bad(r, "%s", "anchors are supported only at the start and end");
    case '*': case '+': case '?': case '{':
        return bad(r, "%s", "a quantifier with nothing to repeat");
    default: {
        int code = class_char(r, &c);
        if (code == -2) {
            class_free(&c);
            return CS_G_BAD;
        }
        if (code >= 0) cs__gset_add(&c.ascii, (uint8_t)code);
        uint32_t node = class_node(r, &c);
        class_free(&c);
        return node;
    }
    }
}

static bool number(rx *r, uint32_t *v) {
    size_t start = r->i;
    uint64_t x = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        x = x * 10 + (uint64_t)(r->s[r->i++] - '0');
        if (x > MAX_REPEAT) return bad(r, "repetition counts above %s are not supported", "1000"),
                                   false;
    }
    *v = (uint32_t)x;
    return r->i > start;
}

static uint32_t parse_repeat(rx *r) {
    uint32_t atom = parse_atom(r);
    while (atom != CS_G_BAD && r->i < r->n) {
        char q = r->s[r->i];
        uint32_t min, max;
        if (q == '*') min = 0, max = CS_G_INF, r->i++;
        else if (q == '+') min = 1, max = CS_G_INF, r->i++;
        else if (q == '?') min = 0, max = 1, r->i++;
        else if (q == '{') {
            size_t save = r->i++;
            if (!number(r, &min)) {
                if (r->g->err) return CS_G_BAD;
                r->i = save; /* a literal '{' */
                return bad(r, "%s", "a '{' that is not a repetition must be escaped");
            }
            max = min;
            if (r->i < r->n && r->s[r->i] == ',') {
                r->i++;
                max = CS_G_INF;
                if (r->i < r->n && r->s[r->i] != '}' && !number(r, &max))
                    return r->g->err ? CS_G_BAD : bad(r, "%s", "a bad {m,n}");
            }
            if (r->i >= r->n || r->s[r->i] != '}') return bad(r, "%s", "an unclosed {m,n}");
            r->i++;
        } else {
            break;
        }
        if (r->i < r->n && r->s[r->i] == '?') r->i++; /* lazy: the same language */
        else if (r->i < r->n && r->s[r->i] == '+')
            return bad(r, "%s", "possessive quantifiers are not supported");
        atom = cs__g_rep(r->g, atom, min, max);
    }
    return atom;
}

/* Appends node x to the list k (n of cap); on a failed x or no memory frees
 * the list and returns false. */
static bool push(rx *r, uint32_t **k, uint32_t *n, uint32_t *cap, uint32_t x) {
    if (x != CS_G_BAD && *n == *cap) {
        uint32_t c = *cap ? 2 * *cap : 8, *q = realloc(*k, c * sizeof *q);
        if (!q) {
            cs__g_fail(r->g, CS_ENOMEM, "%s: out of memory", r->what);
            x = CS_G_BAD;
        } else {
            *k = q, *cap = c;
        }
    }
    if (x == CS_G_BAD) {
        free(*k);
        *k = NULL;
        return false;
    }
    (*k)[(*n)++] = x;
    return true;
}

static uint32_t parse_concat(rx *r) {
    uint32_t *k = NULL, n = 0, cap = 0, node;
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')') {
        if (r->s[r->i] == '$' && r->i + 1 == r->n && r->nest == 0) { /* the end anchor */
            r->i++;
            break;
        }
        if (!push(r, &k, &n, &cap, parse_repeat(r))) return CS_G_BAD;
    }
    node = cs__g_seq(r->g, k, n); /* n == 0: the empty string */
    free(k);
    return node;
}

static uint32_t parse_alt(rx *r) {
    uint32_t *k = NULL, n = 0, cap = 0, node;
    for (;;) {
        if (!push(r, &k, &n, &cap, parse_concat(r))) return CS_G_BAD;
        if (r->i < r->n && r->s[r->i] == '|') {
            r->i++;
            continue;
        }
        break;
    }
    node = cs__g_alt(r->g, k, n);
    free(k);
    return node;
}

uint32_t cs__g_regex_node(cs_grammar *g, const char *re, bool json_string, const char *what) {
    rx r = {.g = g, .s = re, .n = strlen(re), .what = what, .json = json_string};
    if (r.n && re[0] == '^') r.i++;
    uint32_t node = parse_alt(&r);
    if (node != CS_G_BAD && r.i < r.n)
        return bad(&r, "%s", r.s[r.i] == ')' ? "an unopened ')'" : "unexpected text");
    return node;
}

int cs__g_compile_regex(cs_grammar *g, const char *re, const char *what) {
    g->root = cs__g_regex_node(g, re, false, what);
    return g->err;
}
