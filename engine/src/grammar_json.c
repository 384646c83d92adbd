/* grammar_json.c: JSON Schema (and any JSON object) into grammar nodes.
 *
 * Supported: type (one or a list), enum, const, properties / required /
 * additionalProperties, items / prefixItems / minItems / maxItems,
 * minLength / maxLength / pattern / format (date, time, date-time, uuid,
 * email, ipv4; other formats are annotations), minimum / maximum /
 * exclusiveMinimum / exclusiveMaximum (integers; numbers with integer-valued
 * inclusive bounds), anyOf, allOf of one schema, local $ref (#, #/$defs/...,
 * #/definitions/...) including recursion, nullable (OpenAPI). Refused by
 * name: the keywords that constrain in ways a grammar cannot follow here
 * (oneOf, not, if/then/else, uniqueItems, patternProperties, ...).
 *
 * Choices: properties are written in the schema's order, the required ones
 * always, the optional ones at the model's choice; an object with
 * properties never gets other keys (additionalProperties allows them, it
 * does not ask for them). Whitespace between tokens: nothing, one space, or
 * one line break and up to 32 spaces of indent. Numbers: at most 16 digits before and after the point, a
 * 3-digit exponent. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "grammar-impl.h"
#include "util.h"

#define WS_INDENT 32 /* spaces after a line break */
#define INT_DIGITS 16
#define FRAC_DIGITS 16

typedef struct {
    const char *ref;
    uint32_t node;
} ref_entry;

typedef struct {
    cs_grammar *g;
    const cJSON *root;
    uint32_t ws, value_any, string_any, str_char;
    ref_entry *refs;
    uint32_t n_refs;
    int depth;
} jc;

static uint32_t fail(jc *c, const char *fmt, const char *a) {
    char m[300];
    snprintf(m, sizeof m, fmt, a);
    cs__g_fail(c->g, CS_EINVAL, "json_schema: %s", m);
    return CS_G_BAD;
}

static uint32_t L(jc *c, const char *s) { return cs__g_lit(c->g, s, strlen(s)); }

/* "{" ws ... : the grammar's building blocks */
static uint32_t tok(jc *c, const char *s) { return L(c, s); }

static uint32_t json_string_char(jc *c) {
    if (c->str_char != CS_G_BAD) return c->str_char;
    cs_grammar *g = c->g;
    cs_gset plain = {{0}};
    cs__gset_add_range(&plain, 0x20, 0x7F);
    plain.w[0] &= ~(1ull << '"');
    plain.w[1] &= ~(1ull << ('\\' - 64));
    cs_gset esc = {{0}};
    for (const char *e = "\"\\/bfnrt"; *e; e++)
        cs__gset_add(&esc, (uint8_t)*e);
    cs_gset hex = {{0}};
    cs__gset_add_range(&hex, '0', '9');
    cs__gset_add_range(&hex, 'a', 'f');
    cs__gset_add_range(&hex, 'A', 'F');
    uint32_t u = cs__g_seq2(g, L(c, "u"), cs__g_rep(g, cs__g_set(g, &hex), 4, 4));
    uint32_t escape = cs__g_seq2(g, L(c, "\\"), cs__g_alt2(g, cs__g_set(g, &esc), u));
    return c->str_char = cs__g_alt2(g, cs__g_utf8_char(g, &plain), escape);
}

static uint32_t string_of(jc *c, uint32_t min, uint32_t max) {
    return cs__g_seq3(c->g, L(c, "\""), cs__g_rep(c->g, json_string_char(c), min, max), L(c, "\""));
}

/* A pattern inside quotes: the characters stand for themselves. Unanchored
 * ends may be followed / preceded by anything. */
static uint32_t string_pattern(jc *c, const char *pat) {
    cs_grammar *g = c->g;
    size_t n = strlen(pat);
    bool start = n && pat[0] == '^';
    size_t bs = 0;
    while (bs + 1 < n && pat[n - 2 - bs] == '\\')
        bs++;
    bool end = n > (size_t)start && pat[n - 1] == '$' && bs % 2 == 0;
    uint32_t core = cs__g_regex_node(g, pat, true, "json_schema: pattern");
    uint32_t any = cs__g_rep(g, json_string_char(c), 0, CS_G_INF);
    uint32_t k[5], m = 0;
    k[m++] = L(c, "\"");
    if (!start) k[m++] = any;
    k[m++] = core;
    if (!end) k[m++] = any;
    k[m++] = L(c, "\"");
    return cs__g_seq(g, k, m);
}

static uint32_t digits(jc *c, uint32_t min, uint32_t max) {
    return cs__g_rep(c->g, cs__g_range(c->g, '0', '9'), min, max);
}

/* Unsigned integers without leading zeros of `len` digits in [lo, hi], both given
 * as `len` digit strings. */
static uint32_t digit_range(jc *c, const char *lo, const char *hi, size_t len) {
    cs_grammar *g = c->g;
    if (len == 0) return cs__g_seq(g, NULL, 0);
    if (lo[0] == hi[0])
        return cs__g_seq2(g, cs__g_range(g, (uint8_t)lo[0], (uint8_t)hi[0]),
                          digit_range(c, lo + 1, hi + 1, len - 1));
    bool lo_zero = strspn(lo + 1, "0") >= len - 1, hi_nine = strspn(hi + 1, "9") >= len - 1;
    char nines[INT_DIGITS + 2], zeros[INT_DIGITS + 2];
    memset(nines, '9', len), memset(zeros, '0', len);
    nines[len] = zeros[len] = 0;
    uint32_t k[3], n = 0;
    char a = lo[0], b = hi[0];
    if (!lo_zero) k[n++] = cs__g_seq2(g, cs__g_range(g, (uint8_t)a, (uint8_t)a),
                                      digit_range(c, lo + 1, nines, len - 1)), a++;
    if (!hi_nine) b--;
    if (a <= b) k[n++] = cs__g_seq2(g, cs__g_range(g, (uint8_t)a, (uint8_t)b),
                                    digits(c, (uint32_t)len - 1, (uint32_t)len - 1));
    if (!hi_nine) k[n++] = cs__g_seq2(g, cs__g_range(g, (uint8_t)hi[0], (uint8_t)hi[0]),
                                      digit_range(c, zeros, hi + 1, len - 1));
    return cs__g_alt(g, k, n);
}

static const uint64_t INT_TOP = 9999999999999999ull; /* INT_DIGITS nines */

/* Unsigned integers in [lo, hi] (hi <= INT_TOP), written without leading zeros. */
static uint32_t uint_range(jc *c, uint64_t lo, uint64_t hi) {
    uint32_t k[INT_DIGITS], n = 0;
    uint64_t p = 1;
    for (int len = 1; len <= INT_DIGITS; len++, p *= 10) {
        uint64_t a = len == 1 ? 0 : p, b = p * 10 - 1;
        if (a < lo) a = lo;
        if (b > hi) b = hi;
        if (a > b) continue;
        char sa[INT_DIGITS + 1], sb[INT_DIGITS + 1];
        snprintf(sa, sizeof sa, "%0*llu", len, (unsigned long long)a);
        snprintf(sb, sizeof sb, "%0*llu", len, (unsigned long long)b);
        k[n++] = digit_range(c, sa, sb, (size_t)len);
    }
    return cs__g_alt(c->g, k, n);
}

/* Integers in [lo, hi]; has_lo / has_hi false = unbounded that side. */
static uint32_t int_range(jc *c, bool has_lo, double lo, bool has_hi, double hi) {
    cs_grammar *g = c->g;
    double top = (double)INT_TOP;
    if (!has_lo) lo = -top;
    if (!has_hi) hi = top;
    if (lo < -top) lo = -top;
    if (hi > top) hi = top;
    if (lo > hi) return fail(c, "%s", "the integer bounds admit no value");
    uint32_t k[2], n = 0;
    if (hi >= 0) k[n++] = uint_range(c, lo > 0 ? (uint64_t)lo : 0, (uint64_t)hi);
    if (lo < 0) /* negative values: '-' and a magnitude in [max(1, -hi), -lo] */
        k[n++] = cs__g_seq2(g, L(c, "-"),
                            uint_range(c, hi < 0 ? (uint64_t)-hi : 1, (uint64_t)-lo));
    return cs__g_alt(g, k, n);
}

static uint32_t fraction(jc *c) { return cs__g_seq2(c->g, L(c, "."), digits(c, 1, FRAC_DIGITS)); }
static uint32_t opt(jc *c, uint32_t x) { return cs__g_rep(c->g, x, 0, 1); }

/* Numbers in [lo, hi] with integer bounds: an integer part below the top
 * bound's magnitude takes any fraction; the bound itself only zeros. */
static uint32_t magnitude(jc *c, uint64_t lo, bool has_hi, uint64_t hi) {
    cs_grammar *g = c->g;
    uint32_t k[2], n = 0;
    if (!has_hi || hi > lo) k[n++] = cs__g_seq2(g, uint_range(c, lo, has_hi ? hi - 1 : INT_TOP),
                                                 opt(c, fraction(c)));
    if (has_hi) {
        char s[32];
        snprintf(s, sizeof s, "%llu", (unsigned long long)hi);
        k[n++] = cs__g_seq2(g, L(c, s), opt(c, cs__g_seq2(g, L(c, "."), cs__g_rep(g, L(c, "0"), 1,
                                                                                    FRAC_DIGITS))));
    }
    return cs__g_alt(g, k, n);
}

static uint32_t number_range(jc *c, bool has_lo, double lo, bool has_hi, double hi) {
    cs_grammar *g = c->g;
    if ((has_lo && (lo != floor(lo) || fabs(lo) > (double)INT_TOP)) ||
        (has_hi && (hi != floor(hi) || fabs(hi) > (double)INT_TOP)))
        return fail(c, "%s", "minimum / maximum of a number must be integers of at most 16 digits");
    if (has_lo && has_hi && lo > hi) return fail(c, "%s", "the number bounds admit no value");
    uint32_t k[2], n = 0;
    if (!has_hi || hi >= 0) /* the non-negative part */
        k[n++] = magnitude(c, has_lo && lo > 0 ? (uint64_t)lo : 0, has_hi, has_hi ? (uint64_t)hi : 0);
    if (!has_lo || lo < 0) { /* '-' and a magnitude in [max(0, -hi), -lo] */
        uint64_t mlo = has_hi && hi < 0 ? (uint64_t)-hi : 0;
        k[n++] = cs__g_seq2(g, L(c, "-"), magnitude(c, mlo, has_lo, has_lo ? (uint64_t)-lo : 0));
    }
    return cs__g_alt(g, k, n);
}

static uint32_t number_any(jc *c, bool integer) {
    cs_grammar *g = c->g;
    uint32_t intpart = cs__g_alt2(g, L(c, "0"),
                                  cs__g_seq2(g, cs__g_range(g, '1', '9'), digits(c, 0, INT_DIGITS - 1)));
    uint32_t sign = opt(c, L(c, "-"));
    if (integer) return cs__g_seq2(g, sign, intpart);
    cs_gset e = {{0}}, pm = {{0}};
    cs__gset_add(&e, 'e'), cs__gset_add(&e, 'E');
    cs__gset_add(&pm, '+'), cs__gset_add(&pm, '-');
    uint32_t exp = cs__g_seq3(g, cs__g_set(g, &e), opt(c, cs__g_set(g, &pm)), digits(c, 1, 3));
    return cs__g_seq(g, (uint32_t[]){sign, intpart, opt(c, fraction(c)), opt(c, exp)}, 4);
}

/* The JSON text of v, as cJSON writes it. */
static uint32_t value_literal(jc *c, const cJSON *v) {
    char *p = v ? cJSON_PrintUnformatted(v) : NULL;
    if (!p) {
        cs__g_fail(c->g, CS_ENOMEM, "json_schema: out of memory");
        return CS_G_BAD;
    }
    uint32_t n = L(c, p);
    free(p);
    return n;
}

/* A JSON string literal for s. */
static uint32_t key_literal(jc *c, const char *s) {
    cJSON *str = cJSON_CreateString(s);
    uint32_t n = value_literal(c, str);
    cJSON_Delete(str);
    return n;
}

static uint32_t comma(jc *c) { return cs__g_seq3(c->g, c->ws, tok(c, ","), c->ws); }

/* "[" ws (item (ws "," ws item){min-1, max-1})? ws "]" */
static uint32_t array_of(jc *c, uint32_t item, uint32_t min, uint32_t max) {
    cs_grammar *g = c->g;
    uint32_t open = cs__g_seq2(g, tok(c, "["), c->ws), close = cs__g_seq2(g, c->ws, tok(c, "]"));
    if (max == 0) return cs__g_seq2(g, open, close);
    uint32_t rest = cs__g_rep(g, cs__g_seq2(g, comma(c), item), min ? min - 1 : 0,
                              max == CS_G_INF ? CS_G_INF : max - 1);
    uint32_t list = cs__g_seq2(g, item, rest);
    if (min == 0) list = opt(c, list);
    return cs__g_seq3(g, open, list, close);
}

/* "{" ws (key ws ":" ws value (ws "," ws key ...)*)? ws "}" with any keys */
static uint32_t map_of(jc *c, uint32_t value) {
    cs_grammar *g = c->g;
    uint32_t member = cs__g_seq(g, (uint32_t[]){c->string_any, c->ws, tok(c, ":"), c->ws, value}, 5);
    uint32_t list = cs__g_seq2(g, member, cs__g_rep(g, cs__g_seq2(g, comma(c), member), 0, CS_G_INF));
    return cs__g_seq(g, (uint32_t[]){tok(c, "{"), c->ws, opt(c, list), c->ws, tok(c, "}")}, 5);
}

static void build_any(jc *c) {
    cs_grammar *g = c->g;
    /* one space, or one line break and an indent: enough for compact and
     * pretty-printed JSON, never a run of blank lines */
    c->ws = opt(c, cs__g_alt2(g, L(c, " "), cs__g_seq2(g, L(c, "\n"), cs__g_rep(g, L(c, " "), 0,
                                                                               WS_INDENT))));
    c->string_any = string_of(c, 0, CS_G_INF);
    c->value_any = cs__g_forward(g);
    uint32_t v[] = {map_of(c, c->value_any), array_of(c, c->value_any, 0, CS_G_INF), c->string_any,
                    number_any(c, false), L(c, "true"), L(c, "false"), L(c, "null")};
    cs__g_define(g, c->value_any, cs__g_alt(g, v, 7));
}

static uint32_t schema(jc *c, const cJSON *s);

static const char *const REFUSED[] = {
    "oneOf", "not", "if", "then", "else", "uniqueItems", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "minProperties", "maxProperties",
    "contains", "minContains", "maxContains", "multipleOf", "unevaluatedProperties",
    "unevaluatedItems", "$dynamicRef", "$recursiveRef",
};

static uint32_t resolve_ref(jc *c, const char *ref) {
    for (uint32_t i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].ref, ref)) return c->refs[i].node;
    const cJSON *target = NULL;
    if (!strcmp(ref, "#")) target = c->root;
    else if (!strncmp(ref, "#/$defs/", 8))
        target = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c->root, "$defs"),
                                                  ref + 8);
    else if (!strncmp(ref, "#/definitions/", 14))
        target = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(c->root, "definitions"), ref + 14);
    else return fail(c, "$ref '%.80s' is not supported (only #, #/$defs/NAME, #/definitions/NAME)", ref);
    if (!target) return fail(c, "$ref '%.80s' names no definition", ref);
    ref_entry *r = realloc(c->refs, (c->n_refs + 1) * sizeof *r);
    if (!r) {
        cs__g_fail(c->g, CS_ENOMEM, "json_schema: out of memory");
        return CS_G_BAD;
    }
    c->refs = r;
    uint32_t fwd = cs__g_forward(c->g);
    c->refs[c->n_refs++] = (ref_entry){ref, fwd};
    cs__g_define(c->g, fwd, schema(c, target));
    return fwd;
}

static bool get_num(const cJSON *s, const char *k, double *v) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(s, k);
    if (!cJSON_IsNumber(x)) return false;
    *v = x->valuedouble;
    return true;
}

static uint32_t get_count(jc *c, const cJSON *s, const char *k, uint32_t dflt) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(s, k);
    if (!x) return dflt;
    if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 100000 ||
        x->valuedouble != floor(x->valuedouble)) {
        fail(c, "'%s' must be an integer in [0, 100000]", k);
        return dflt;
    }
    return (uint32_t)x->valuedouble;
}

static uint32_t string_schema(jc *c, const cJSON *s) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(s, "pattern");
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
    uint32_t min = get_count(c, s, "minLength", 0), max = get_count(c, s, "maxLength", CS_G_INF);
    if (c->g->err) return CS_G_BAD;
    if (max != CS_G_INF && min > max) return fail(c, "%s", "minLength is above maxLength");
    if (pat) {
        if (!cJSON_IsString(pat)) return fail(c, "%s", "'pattern' must be a string");
        if (min || max != CS_G_INF)
            return fail(c, "%s", "'pattern' with minLength / maxLength is not supported");
        return string_pattern(c, pat->valuestring);
    }
    if (cJSON_IsString(fmt)) {
        static const struct {
            const char *name, *re;
        } F[] = {
            {"date", "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
            {"time", "^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?"
                     "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"},
            {"date-time", "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T"
                          "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?"
                          "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"},
            {"uuid", "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"},
            {"email", "^[a-zA-Z0-9._+-]{1,64}@[a-zA-Z0-9-]{1,63}(\\.[a-zA-Z0-9-]{1,63}){1,4}$"},
            {"ipv4", "^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}"
                     "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$"},
        };
        for (size_t i = 0; i < sizeof F / sizeof *F; i++)
            if (!strcmp(fmt->valuestring, F[i].name)) {
                if (min || max != CS_G_INF)
                    return fail(c, "format '%s' with minLength / maxLength is not supported",
                                F[i].name);
                return string_pattern(c, F[i].re);
            }
    }
    return string_of(c, min, max);
}

static uint32_t numeric_schema(jc *c, const cJSON *s, bool integer) {
    double lo = 0, hi = 0, x;
    if (cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum")) ||
        cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum")))
        return fail(c, "%s", "boolean exclusiveMinimum / exclusiveMaximum (draft 4) are not "
                             "supported: give the bound as a number");
    bool has_lo = get_num(s, "minimum", &lo), has_hi = get_num(s, "maximum", &hi);
    if (get_num(s, "exclusiveMinimum", &x)) {
        if (!integer) return fail(c, "%s", "exclusiveMinimum is supported on integers only");
        x = floor(x) + 1;
        if (!has_lo || x > lo) lo = x, has_lo = true;
    }
    if (get_num(s, "exclusiveMaximum", &x)) {
        if (!integer) return fail(c, "%s", "exclusiveMaximum is supported on integers only");
        x = ceil(x) - 1;
        if (!has_hi || x < hi) hi = x, has_hi = true;
    }
    if (!has_lo && !has_hi) return number_any(c, integer);
    if (integer) {
        if (has_lo) lo = ceil(lo);
        if (has_hi) hi = floor(hi);
        return int_range(c, has_lo, lo, has_hi, hi);
    }
    return number_range(c, has_lo, lo, has_hi, hi);
}

static uint32_t object_schema(jc *c, const cJSON *s) {
    cs_grammar *g = c->g;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props && !cJSON_IsObject(props)) return fail(c, "%s", "'properties' must be an object");
    if (req && !cJSON_IsArray(req)) return fail(c, "%s", "'required' must be an array");
    int n = props ? cJSON_GetArraySize(props) : 0;
    if (n > 1024) return fail(c, "%s", "over 1024 properties in one object");
    cJSON *r;
    cJSON_ArrayForEach(r, req) {
        if (!cJSON_IsString(r)) return fail(c, "%s", "'required' must list strings");
        if (!cJSON_GetObjectItemCaseSensitive(props, r->valuestring))
            return fail(c, "required property '%.80s' is not in 'properties'", r->valuestring);
    }
    if (n == 0) {
        if (cJSON_IsFalse(addl)) return cs__g_seq3(g, tok(c, "{"), c->ws, tok(c, "}"));
        uint32_t v = !addl || cJSON_IsTrue(addl) ? c->value_any : schema(c, addl);
        return map_of(c, v);
    }
    uint32_t *member = calloc((size_t)n, sizeof *member);
    bool *required = calloc((size_t)n, sizeof *required);
    if (!member || !required) {
        free(member), free(required);
        cs__g_fail(g, CS_ENOMEM, "json_schema: out of memory");
        return CS_G_BAD;
    }
    int i = 0;
    cJSON *p;
    cJSON_ArrayForEach(p, props) {
        cJSON_ArrayForEach(r, req) required[i] |= !strcmp(r->valuestring, p->string);
        member[i] = cs__g_seq(
            g, (uint32_t[]){key_literal(c, p->string), c->ws, tok(c, ":"), c->ws, schema(c, p)}, 5);
        i++;
    }
    /* pick(i): the next property written is one of i.. up to the first
     * required one, then tail; tail(i): after at least one was written, the
     * rest of i.. behind one comma (optional while none of them is required) */
    uint32_t tail = cs__g_seq(g, NULL, 0), pick = CS_G_BAD, none = tail;
    bool req_after = false;
    for (i = n - 1; i >= 0; i--) {
        uint32_t first = cs__g_seq2(g, member[i], tail);
        pick = required[i] || pick == CS_G_BAD ? first : cs__g_alt2(g, first, pick);
        req_after |= required[i];
        uint32_t more = cs__g_seq2(g, comma(c), pick);
        tail = req_after ? more : cs__g_alt2(g, none, more);
    }
    uint32_t head = req_after ? pick : cs__g_alt2(g, none, pick);
    free(member), free(required);
    return cs__g_seq(g, (uint32_t[]){tok(c, "{"), c->ws, head, c->ws, tok(c, "}")}, 5);
}

static uint32_t array_schema(jc *c, const cJSON *s) {
    cs_grammar *g = c->g;
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    const cJSON *prefix = cJSON_GetObjectItemCaseSensitive(s, "prefixItems");
    uint32_t min = get_count(c, s, "minItems", 0), max = get_count(c, s, "maxItems", CS_G_INF);
    if (g->err) return CS_G_BAD;
    if (max != CS_G_INF && min > max) return fail(c, "%s", "minItems is above maxItems");
    if (cJSON_IsArray(items)) return fail(c, "%s", "'items' as an array (use prefixItems)");
    uint32_t item = !items || cJSON_IsTrue(items) ? c->value_any
                    : cJSON_IsFalse(items)         ? CS_G_BAD
                                                   : schema(c, items);
    if (g->err) return CS_G_BAD;
    if (!prefix && item == CS_G_BAD) { /* items false: the empty array only */
        if (min > 0) return fail(c, "%s", "'items': false with minItems above 0 admits nothing");
        return array_of(c, c->value_any, 0, 0);
    }
    if (!prefix) return array_of(c, item, min, max);
    if (!cJSON_IsArray(prefix)) return fail(c, "%s", "'prefixItems' must be an array");
    int np = cJSON_GetArraySize(prefix);
    if (min > (uint32_t)np || max != CS_G_INF)
        return fail(c, "%s", "minItems above the prefixItems, or maxItems, with prefixItems are "
                             "not supported");
    /* all prefix items, then (if items allows) any number more */
    uint32_t *k = malloc(((size_t)np * 2 + 4) * sizeof *k), m = 0;
    if (!k) {
        cs__g_fail(g, CS_ENOMEM, "json_schema: out of memory");
        return CS_G_BAD;
    }
    k[m++] = tok(c, "[");
    k[m++] = c->ws;
    int i = 0;
    cJSON *it;
    cJSON_ArrayForEach(it, prefix) {
        if (i++) k[m++] = comma(c);
        k[m++] = schema(c, it);
    }
    if (item != CS_G_BAD) k[m++] = cs__g_rep(g, cs__g_seq2(g, comma(c), item), 0, CS_G_INF);
    k[m++] = c->ws;
    k[m++] = tok(c, "]");
    uint32_t node = np ? cs__g_seq(g, k, m) : array_of(c, item, min, max);
    free(k);
    return node;
}

static uint32_t typed(jc *c, const cJSON *s, const char *type) {
    if (!strcmp(type, "object")) return object_schema(c, s);
    if (!strcmp(type, "array")) return array_schema(c, s);
    if (!strcmp(type, "string")) return string_schema(c, s);
    if (!strcmp(type, "integer")) return numeric_schema(c, s, true);
    if (!strcmp(type, "number")) return numeric_schema(c, s, false);
    if (!strcmp(type, "boolean")) return cs__g_alt2(c->g, L(c, "true"), L(c, "false"));
    if (!strcmp(type, "null")) return L(c, "null");
    return fail(c, "unknown type '%.40s'", type);
}

static uint32_t schema(jc *c, const cJSON *s) {
    cs_grammar *g = c->g;
    if (g->err) return CS_G_BAD;
    if (cJSON_IsTrue(s)) return c->value_any;
    if (cJSON_IsFalse(s)) return fail(c, "%s", "a 'false' schema admits nothing");
    if (!cJSON_IsObject(s)) return fail(c, "%s", "a schema must be an object or a boolean");
    if (++c->depth > 64) return fail(c, "%s", "schemas nested more than 64 deep");
    uint32_t node = CS_G_BAD;
    for (size_t i = 0; i < sizeof REFUSED / sizeof *REFUSED; i++)
        if (cJSON_GetObjectItemCaseSensitive(s, REFUSED[i])) {
            node = fail(c, "keyword '%s' is not supported", REFUSED[i]);
            goto out;
        }
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(s, "allOf");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (ref) {
        node = cJSON_IsString(ref) ? resolve_ref(c, ref->valuestring)
                                   : fail(c, "%s", "'$ref' must be a string");
    } else if (all) {
        node = cJSON_IsArray(all) && cJSON_GetArraySize(all) == 1
                   ? schema(c, cJSON_GetArrayItem(all, 0))
                   : fail(c, "%s", "'allOf' is supported with one schema only");
    } else if (cn) {
        node = value_literal(c, cn);
    } else if (en) {
        int n = cJSON_IsArray(en) ? cJSON_GetArraySize(en) : 0;
        if (n < 1) {
            node = fail(c, "%s", "'enum' must be a non-empty array");
            goto out;
        }
        char **lits = calloc((size_t)n, sizeof *lits);
        int i = 0;
        cJSON *v;
        if (lits) cJSON_ArrayForEach(v, en) if (!(lits[i++] = cJSON_PrintUnformatted(v))) break;
        if (!lits || !lits[n - 1]) cs__g_fail(g, CS_ENOMEM, "json_schema: out of memory");
        else node = cs__g_lit_alt(g, (const char *const *)lits, (uint32_t)n);
        for (i = 0; lits && i < n; i++)
            free(lits[i]);
        free(lits);
    } else if (any) {
        int n = cJSON_IsArray(any) ? cJSON_GetArraySize(any) : 0;
        if (n < 1) {
            node = fail(c, "%s", "'anyOf' must be a non-empty array");
            goto out;
        }
        uint32_t *k = malloc((size_t)n * sizeof *k);
        if (!k) {
            cs__g_fail(g, CS_ENOMEM, "json_schema: out of memory");
            goto out;
        }
        int i = 0;
        cJSON *v;
        cJSON_ArrayForEach(v, any) k[i++] = schema(c, v);
        node = cs__g_alt(g, k, (uint32_t)n);
        free(k);
    } else if (cJSON_IsString(type)) {
        node = typed(c, s, type->valuestring);
    } else if (cJSON_IsArray(type)) {
        int n = cJSON_GetArraySize(type);
        uint32_t k[8];
        if (n < 1 || n > 7) {
            node = fail(c, "%s", "'type' must list 1 to 7 types");
            goto out;
        }
        int i = 0;
        cJSON *t;
        cJSON_ArrayForEach(t, type) {
            if (!cJSON_IsString(t)) {
                node = fail(c, "%s", "'type' must list strings");
                goto out;
            }
            k[i++] = typed(c, s, t->valuestring);
        }
        node = cs__g_alt(g, k, (uint32_t)n);
    } else if (type) {
        node = fail(c, "%s", "'type' must be a string or an array of strings");
    } else if (cJSON_GetObjectItemCaseSensitive(s, "properties") ||
               cJSON_GetObjectItemCaseSensitive(s, "additionalProperties") ||
               cJSON_GetObjectItemCaseSensitive(s, "required")) {
        node = object_schema(c, s);
    } else if (cJSON_GetObjectItemCaseSensitive(s, "items") ||
               cJSON_GetObjectItemCaseSensitive(s, "prefixItems")) {
        node = array_schema(c, s);
    } else {
        node = c->value_any; /* {} and annotation-only schemas: any value */
    }
    if (node != CS_G_BAD && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(s, "nullable")))
        node = cs__g_alt2(g, node, L(c, "null"));
out:
    c->depth--;
    return g->err ? CS_G_BAD : node;
}

int cs__g_compile_json_schema(cs_grammar *g, const char *text) {
    cJSON *root = cJSON_ParseWithOpts(text, NULL, true);
    if (!root) return cs__g_fail(g, CS_EINVAL, "json_schema: the schema is not valid JSON");
    jc c = {.g = g, .root = root, .str_char = CS_G_BAD};
    build_any(&c);
    g->root = schema(&c, root);
    free(c.refs);
    cJSON_Delete(root);
    return g->err;
}

int cs__g_compile_json_object(cs_grammar *g) {
    jc c = {.g = g, .str_char = CS_G_BAD};
    build_any(&c);
    g->root = map_of(&c, c.value_any);
    return g->err;
}
