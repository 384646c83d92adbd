/* config.c: the declarative option table (chunkserve/config.h): defaults,
 * CHUNKSERVE_* environment variables and command-line flags, in that order
 * of precedence, with every value checked; --help and the start-up dump come
 * from the same table. Not here: config files, reloading, short flags other
 * than -h. */
#include "chunkserve/config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "config-impl.h"

/* Where a value came from, for error messages: "--port" or "CHUNKSERVE_PORT". */
typedef struct {
    char text[96];
} origin;

void cs__config_env_name(const char *name, char *out, size_t cap) {
    size_t k = (size_t)snprintf(out, cap, "CHUNKSERVE_");
    for (const char *p = name; *p && k + 1 < cap; p++)
        out[k++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    out[k < cap ? k : cap - 1] = 0;
}

static bool bounded(const cs_config_entry *e) {
    return e->min != 0 || e->max != 0;
}

static int parse_bool(const char *s, bool *out) {
    if (!strcmp(s, "1") || !strcasecmp(s, "true"))
        *out = true;
    else if (!strcmp(s, "0") || !strcasecmp(s, "false"))
        *out = false;
    else
        return -1;
    return 0;
}

/* Converts text into the entry's field. where names the source in errors. */
static int set_value(const cs_config_entry *e, void *opts, const char *val, const char *where) {
    void *p = (char *)opts + e->offset;
    if (e->type == CS_CONFIG_STR || e->type == CS_CONFIG_SECRET) {
        *(const char **)p = val;
        return 0;
    }
    if (!val) { /* no default: zero */
        if (e->type == CS_CONFIG_INT)
            *(int64_t *)p = 0;
        else if (e->type == CS_CONFIG_BOOL)
            *(bool *)p = false;
        else
            *(double *)p = 0;
        return 0;
    }
    if (e->type == CS_CONFIG_BOOL) {
        if (parse_bool(val, (bool *)p))
            return cs_fail(CS_EINVAL, "%s: '%s' is not a boolean (true, false, 1 or 0)", where,
                           val);
        return 0;
    }
    /* strtoll/strtod skip leading space and accept an empty string: refuse both. */
    if (!*val || isspace((unsigned char)*val))
        return cs_fail(CS_EINVAL, "%s: '%s' is not a%s number", where, val,
                       e->type == CS_CONFIG_INT ? "n integer" : "");
    char *end = NULL;
    errno = 0;
    if (e->type == CS_CONFIG_INT) {
        long long v = strtoll(val, &end, 10);
        if (*end) return cs_fail(CS_EINVAL, "%s: '%s' is not an integer", where, val);
        if (errno == ERANGE || (bounded(e) && ((double)v < e->min || (double)v > e->max))) {
            if (bounded(e))
                return cs_fail(CS_EINVAL, "%s: %s is out of range (%.0f..%.0f)", where, val, e->min,
                               e->max);
            return cs_fail(CS_EINVAL, "%s: %s is out of range (a 64-bit integer)", where, val);
        }
        *(int64_t *)p = (int64_t)v;
        return 0;
    }
    CS_ASSERT(e->type == CS_CONFIG_DOUBLE);
    double v = strtod(val, &end);
    bool overflow = errno == ERANGE && isinf(v); /* an underflow rounds, and is fine */
    if (*end || (!isfinite(v) && !overflow))
        return cs_fail(CS_EINVAL, "%s: '%s' is not a finite number", where, val);
    if (overflow) return cs_fail(CS_EINVAL, "%s: %s is out of range (a double)", where, val);
    if (bounded(e) && (v < e->min || v > e->max))
        return cs_fail(CS_EINVAL, "%s: %s is out of range (%g..%g)", where, val, e->min, e->max);
    *(double *)p = v;
    return 0;
}

/* The entry called name[0..len), or NULL. */
static const cs_config_entry *find_entry(const cs_config_entry *table, size_t n, const char *name,
                                         size_t len) {
    for (size_t i = 0; i < n; i++)
        if (strlen(table[i].name) == len && !strncmp(table[i].name, name, len)) return &table[i];
    return NULL;
}

static bool is_help(const char *a) {
    return !strcmp(a, "-h") || !strcmp(a, "--help");
}

/* One flag of argv resolved to its entry and its value text. */
typedef struct {
    const cs_config_entry *e;
    const char *val;
    char where[80];
} assignment;

/* Resolves argv[*i] (and its value, which may be argv[*i + 1]) into a. */
static int resolve_flag(const cs_config_entry *table, size_t n, int argc, char **argv, int *i,
                        assignment *a) {
    const char *arg = argv[*i];
    if (strncmp(arg, "--", 2) != 0 || arg[2] == 0)
        return cs_fail(CS_EINVAL, "unexpected argument '%s' (options are --name VALUE)", arg);
    const char *name = arg + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    const char *val = eq ? eq + 1 : NULL;
    const cs_config_entry *e = find_entry(table, n, name, len);
    bool negated = false;
    /* --no-x for a boolean x, unless "no-x" is itself an entry (found above). */
    if (!e && len > 3 && !strncmp(name, "no-", 3)) {
        e = find_entry(table, n, name + 3, len - 3);
        if (e && e->type != CS_CONFIG_BOOL) e = NULL;
        negated = e != NULL;
    }
    if (!e) return cs_fail(CS_EINVAL, "unknown option '%.*s' (see --help)", (int)(len + 2), arg);
    a->e = e;
    snprintf(a->where, sizeof a->where, "--%s", e->name);
    if (negated) {
        if (val) return cs_fail(CS_EINVAL, "--no-%s takes no value (got '%s')", e->name, val);
        a->val = "false";
        snprintf(a->where, sizeof a->where, "--no-%s", e->name);
    } else if (val) {
        a->val = val;
    } else if (e->type == CS_CONFIG_BOOL) {
        a->val =
            "true"; /* a boolean never takes the next argument: --chat FILE is not --chat=FILE */
    } else {
        if (*i + 1 >= argc) return cs_fail(CS_EINVAL, "--%s needs a value", e->name);
        a->val = argv[++*i];
    }
    return 0;
}

/* Every value given to as[k]'s entry on the command line, joined by ','
 * (a repeated CS_CONFIG_SECRET flag). A join lives as long as the process,
 * like argv: `joins` keeps it reachable. NULL when out of memory. */
static const char *join_repeats(const assignment *as, int n_as, int k) {
    static char **joins;
    static size_t n_joins;
    size_t len = 0;
    int count = 0;
    for (int j = 0; j < n_as; j++)
        if (as[j].e == as[k].e) len += strlen(as[j].val) + 1, count++;
    if (count == 1) return as[k].val;
    char **grown = realloc(joins, (n_joins + 1) * sizeof *joins);
    if (!grown) return NULL;
    joins = grown;
    char *s = malloc(len);
    if (!s) return NULL;
    joins[n_joins++] = s;
    size_t at = 0;
    for (int j = 0; j < n_as; j++) {
        if (as[j].e != as[k].e) continue;
        if (at) s[at++] = ',';
        size_t l = strlen(as[j].val);
        memcpy(s + at, as[j].val, l);
        at += l;
    }
    s[at] = 0;
    return s;
}

int cs_config_join(const cs_config_part *parts, size_t n_parts, const cs_config_default *defs,
                   size_t n_defs, cs_config_entry **out, size_t *n_out) {
    *out = NULL;
    *n_out = 0;
    size_t n = 0;
    for (size_t i = 0; i < n_parts; i++)
        n += parts[i].n;
    cs_config_entry *t = malloc((n ? n : 1) * sizeof *t);
    if (!t) return cs_fail(CS_ENOMEM, "out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n_parts; i++)
        for (size_t j = 0; j < parts[i].n; j++) {
            t[k] = parts[i].entries[j];
            t[k].offset += parts[i].base;
            if (find_entry(t, k, t[k].name, strlen(t[k].name))) {
                cs_fail(CS_EINVAL, "config: entry '%s' is in two tables", t[k].name);
                free(t);
                return CS_EINVAL;
            }
            k++;
        }
    for (size_t i = 0; i < n_defs; i++) {
        cs_config_entry *e =
            (cs_config_entry *)find_entry(t, n, defs[i].name, strlen(defs[i].name));
        if (!e) {
            free(t);
            return cs_fail(CS_EINVAL, "config: a default for '%s', which no table has",
                           defs[i].name);
        }
        e->def = defs[i].def;
    }
    *out = t;
    *n_out = n;
    return 0;
}

int cs_config_parse(const cs_config_entry *table, size_t n, void *opts, int argc, char **argv,
                    int first, const char *prog, const char *summary) {
    CS_ASSERT(table && opts && first >= 0);
    /* First the command line's shape (so --help wins over a bad environment and
     * no field is touched on a syntax error), then defaults, environment, flags. */
    int n_args = argc > first ? argc - first : 0;
    assignment *as = n_args ? calloc((size_t)n_args, sizeof *as) : NULL;
    if (n_args && !as) return cs_fail(CS_ENOMEM, "out of memory parsing options");
    int n_as = 0, r = 0;
    char first_error[256] = "";
    for (int i = first; i < argc; i++) {
        if (!strcmp(argv[i], "--help-json")) { /* the table for tools (the Helm chart's tests) */
            cs_config_print_json(table, n, stdout);
            free(as);
            return 1;
        }
        if (is_help(argv[i])) { /* help wins over any other mistake on the line */
            cs_config_print_help(table, n, prog, summary, stdout);
            free(as);
            return 1;
        }
        int e = resolve_flag(table, n, argc, argv, &i, &as[n_as]);
        if (!e)
            n_as++;
        else if (!r) {
            r = e;
            snprintf(first_error, sizeof first_error, "%s", cs_last_error());
        }
    }
    if (r) {
        free(as);
        return cs_fail(r, "%s", first_error);
    }
    for (size_t k = 0; k < n && !r; k++) {
        r = set_value(&table[k], opts, table[k].def, "default");
        CS_ASSERT(r == 0); /* a default that does not parse is a bug in the table */
        char var[96];
        cs__config_env_name(table[k].name, var, sizeof var);
        const char *v = getenv(var);
        /* An empty variable counts as unset (a Helm value left blank). */
        if (v && *v) r = set_value(&table[k], opts, v, var);
    }
    if (!r) r = cs__config_check_env(table, n); /* a variable nobody reads: a typo */
    for (int k = 0; k < n_as && !r; k++) {
        const char *v = as[k].val;
        if (as[k].e->type == CS_CONFIG_SECRET) { /* a list: the first flag takes them all */
            bool repeat = false;
            for (int j = 0; j < k && !repeat; j++)
                repeat = as[j].e == as[k].e;
            if (repeat) continue;
            if (!(v = join_repeats(as, n_as, k)))
                r = cs_fail(CS_ENOMEM, "out of memory parsing options");
        }
        if (!r) r = set_value(as[k].e, opts, v, as[k].where);
    }
    free(as);
    return r;
}

void cs_config_print_help(const cs_config_entry *table, size_t n, const char *prog,
                          const char *summary, void *f) {
    FILE *fp = f;
    fprintf(fp, "usage: %s [options]\n", prog ? prog : "chunkserve");
    if (summary && *summary)
        fprintf(fp, "\n%s%s", summary, summary[strlen(summary) - 1] == '\n' ? "" : "\n");
    fprintf(fp, "\noptions:\n");
    int width = (int)strlen("-h, --help");
    for (size_t i = 0; i < n; i++) {
        int w = (int)strlen(table[i].name) + 2 + (table[i].type == CS_CONFIG_BOOL ? 0 : 6);
        if (w > width) width = w;
    }
    for (size_t i = 0; i < n; i++) {
        const cs_config_entry *e = &table[i];
        char flag[128], var[96];
        snprintf(flag, sizeof flag, "--%s%s", e->name, e->type == CS_CONFIG_BOOL ? "" : " VALUE");
        cs__config_env_name(e->name, var, sizeof var);
        fprintf(fp, "  %-*s   %s (", width, flag, e->help ? e->help : "");
        /* A boolean that defaults to off says nothing, like an unset string. */
        bool on = false;
        if (e->def && (e->type != CS_CONFIG_BOOL || (parse_bool(e->def, &on) == 0 && on)))
            fprintf(fp, "default %s; ", e->def);
        fprintf(fp, "env %s)\n", var);
    }
    fprintf(fp, "  %-*s   print this help and exit\n", width, "-h, --help");
}

static void json_string(FILE *fp, const char *s) {
    fputc('"', fp);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(fp, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(fp, "\\u%04x", *p);
        else
            fputc(*p, fp);
    }
    fputc('"', fp);
}

void cs_config_print_json(const cs_config_entry *table, size_t n, void *f) {
    static const char *types[] = {"string", "int", "bool", "double", "string"};
    FILE *fp = f;
    fputc('[', fp);
    for (size_t i = 0; i < n; i++) {
        const cs_config_entry *e = &table[i];
        char var[96];
        cs__config_env_name(e->name, var, sizeof var);
        fprintf(fp, "%s\n {\"name\": ", i ? "," : "");
        json_string(fp, e->name);
        fprintf(fp, ", \"env\": ");
        json_string(fp, var);
        fprintf(fp, ", \"type\": \"%s\", \"default\": ", types[e->type]);
        if (e->def)
            json_string(fp, e->def);
        else
            fputs("null", fp);
        fprintf(fp, ", \"help\": ");
        json_string(fp, e->help ? e->help : "");
        if (bounded(e)) fprintf(fp, ", \"min\": %.17g, \"max\": %.17g", e->min, e->max);
        if (e->type == CS_CONFIG_SECRET) fputs(", \"secret\": true", fp);
        fputc('}', fp);
    }
    fputs("\n]\n", fp);
}

void cs_config_dump(const cs_config_entry *table, size_t n, const void *opts, void *f) {
    FILE *fp = f;
    for (size_t i = 0; i < n; i++) {
        const cs_config_entry *e = &table[i];
        const void *p = (const char *)opts + e->offset;
        switch (e->type) {
        case CS_CONFIG_STR: {
            const char *s = *(const char *const *)p;
            fprintf(fp, "%s = %s\n", e->name, s ? s : "(unset)");
            break;
        }
        case CS_CONFIG_INT: fprintf(fp, "%s = %" PRId64 "\n", e->name, *(const int64_t *)p); break;
        case CS_CONFIG_BOOL:
            fprintf(fp, "%s = %s\n", e->name, *(const bool *)p ? "true" : "false");
            break;
        case CS_CONFIG_DOUBLE: fprintf(fp, "%s = %g\n", e->name, *(const double *)p); break;
        case CS_CONFIG_SECRET:
            fprintf(fp, "%s = %s\n", e->name, *(const char *const *)p ? "(set)" : "(unset)");
            break;
        }
    }
}
