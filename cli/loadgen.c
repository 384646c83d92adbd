/* loadgen.c: seeded arrivals and workloads for `chunkserve bench serve`
 * (see loadgen.h). */
#include "loadgen.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"

/* ---------------------------------------------------------------- rng -- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void cs_lg_rng_seed(cs_lg_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t cs_lg_rng_next(cs_lg_rng *r) {
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0], s[3] ^= s[1], s[1] ^= s[2], s[0] ^= s[3];
    s[2] ^= t, s[3] = rotl(s[3], 45);
    return out;
}

double cs_lg_uniform(cs_lg_rng *r) {
    /* 53 random bits, centred in their interval: (k + 0.5) / 2^53 */
    return ((double)(cs_lg_rng_next(r) >> 11) + 0.5) / 9007199254740992.0;
}

int64_t cs_lg_range(cs_lg_rng *r, int64_t lo, int64_t hi) {
    uint64_t span = (uint64_t)(hi - lo) + 1;
    if (span == 0) return (int64_t)cs_lg_rng_next(r); /* the whole int64 range */
    /* Lemire's rejection keeps every value equally likely */
    uint64_t limit = -span % span, x;
    do
        x = cs_lg_rng_next(r);
    while (x < limit);
    return lo + (int64_t)(x % span);
}

double cs_lg_exponential(cs_lg_rng *r, double mean) {
    return -mean * log(cs_lg_uniform(r));
}

static double normal(cs_lg_rng *r) {
    /* Box-Muller; one of the pair is enough here */
    return sqrt(-2.0 * log(cs_lg_uniform(r))) * cos(2.0 * M_PI * cs_lg_uniform(r));
}

double cs_lg_gamma(cs_lg_rng *r, double shape, double scale) {
    if (shape < 1.0) /* Gamma(a) = Gamma(a + 1) U^(1/a) */
        return cs_lg_gamma(r, shape + 1.0, scale) * pow(cs_lg_uniform(r), 1.0 / shape);
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = normal(r), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = cs_lg_uniform(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v)) return d * v * scale;
    }
}

/* ----------------------------------------------------------- arrivals -- */

static const char *const arrival_names[] = {"poisson", "gamma", "fixed", "closed"};

int cs_lg_arrival_parse(const char *s, enum cs_lg_arrival *out) {
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, arrival_names[i])) {
            *out = (enum cs_lg_arrival)i;
            return 0;
        }
    return cs_fail(CS_EINVAL, "--arrival '%s': one of poisson, gamma, fixed, closed", s);
}

const char *cs_lg_arrival_name(enum cs_lg_arrival a) {
    return arrival_names[a];
}

double cs_lg_next_gap(cs_lg_rng *r, enum cs_lg_arrival a, double rate, double burstiness) {
    if (isinf(rate)) return 0;
    switch (a) {
    case CS_LG_POISSON: return cs_lg_exponential(r, 1.0 / rate);
    case CS_LG_GAMMA: return cs_lg_gamma(r, burstiness, 1.0 / (rate * burstiness));
    case CS_LG_FIXED: return 1.0 / rate;
    case CS_LG_CLOSED: break;
    }
    return 0;
}

/* ---------------------------------------------------------- workloads -- */

static const struct builtin {
    const char *name;
    cs_lg_class classes[3];
    int n;
} builtins[] = {
    {"chat", {{"chat", 1, 32, 512, 64, 256}}, 1},
    {"rag", {{"rag", 1, 3000, 8000, 16, 64}}, 1},
    {"summarize", {{"summarize", 1, 1000, 4000, 128, 384}}, 1},
    {"mixed",
     {{"chat", 0.70, 32, 512, 64, 256},
      {"rag", 0.15, 3000, 8000, 16, 64},
      {"summarize", 0.15, 1000, 4000, 128, 384}},
     3},
};

void cs_lg_workload_free(cs_lg_workload *w) {
    for (size_t i = 0; i < w->n_lines; i++) {
        free(w->lines[i].text);
        free(w->lines[i].ids);
        free(w->lines[i].tenant);
    }
    free(w->lines);
    w->lines = NULL;
    w->n_lines = 0;
}

/* A whole number in [lo, hi] from item (absent: def). */
static int json_int(const cJSON *o, const char *key, int64_t lo, int64_t hi, int64_t def,
                    int64_t *out, const char *path, size_t line) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v) {
        *out = def;
        return 0;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= (double)lo && d <= (double)hi) || d != floor(d))
        return cs_fail(CS_EINVAL, "%s:%zu: \"%s\" must be a whole number in [%lld, %lld]", path,
                       line, key, (long long)lo, (long long)hi);
    *out = (int64_t)d;
    return 0;
}

static int parse_line(const char *text, const char *path, size_t line, cs_lg_line *out) {
    memset(out, 0, sizeof *out);
    out->group = -1;
    cJSON *o = cJSON_Parse(text);
    int r = 0;
    if (!cJSON_IsObject(o)) {
        r = cs_fail(CS_EINVAL, "%s:%zu: not a JSON object", path, line);
        goto done;
    }
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(o, "token_ids");
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(o, "prompt_tokens");
    if ((prompt != NULL) + (ids != NULL) + (n != NULL) != 1) {
        r = cs_fail(CS_EINVAL, "%s:%zu: one of \"prompt\", \"token_ids\", \"prompt_tokens\"", path,
                    line);
        goto done;
    }
    int64_t v;
    if (prompt) {
        if (!cJSON_IsString(prompt) || !prompt->valuestring[0]) {
            r = cs_fail(CS_EINVAL, "%s:%zu: \"prompt\" must be a non-empty string", path, line);
            goto done;
        }
        if (!(out->text = strdup(prompt->valuestring))) goto nomem;
    } else if (ids) {
        int k = cJSON_IsArray(ids) ? cJSON_GetArraySize(ids) : 0;
        if (k <= 0 || k > (1 << 24)) {
            r = cs_fail(CS_EINVAL, "%s:%zu: \"token_ids\" must be a non-empty array", path, line);
            goto done;
        }
        if (!(out->ids = malloc(sizeof(int32_t) * (size_t)k))) goto nomem;
        int i = 0;
        for (const cJSON *e = ids->child; e; e = e->next, i++) {
            double d = cJSON_IsNumber(e) ? e->valuedouble : -1;
            if (!(d >= 0 && d < 2147483647.0) || d != floor(d)) {
                r = cs_fail(CS_EINVAL, "%s:%zu: token_ids[%d] is not a token id", path, line, i);
                goto done;
            }
            out->ids[i] = (int32_t)d;
        }
        out->n_ids = k;
    } else {
        if ((r = json_int(o, "prompt_tokens", 1, 1 << 24, 0, &v, path, line))) goto done;
        out->n_ids = (int32_t)v;
    }
    const char *out_key =
        cJSON_GetObjectItemCaseSensitive(o, "max_tokens") ? "max_tokens" : "output_tokens";
    if ((r = json_int(o, out_key, 1, 1 << 24, 0, &v, path, line))) goto done;
    if (v == 0) {
        r = cs_fail(CS_EINVAL, "%s:%zu: \"output_tokens\" (or \"max_tokens\") is required", path,
                    line);
        goto done;
    }
    out->out_tokens = (int32_t)v;
    if ((r = json_int(o, "group", 0, 1 << 30, -1, &v, path, line))) goto done;
    out->group = (int32_t)v;
    if ((r = json_int(o, "priority", 0, 1000000, 0, &v, path, line))) goto done;
    out->priority = (int32_t)v;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "tenant");
    if (t) {
        bool ok = cJSON_IsString(t) && t->valuestring[0] &&
                  strlen(t->valuestring) <= CS_LG_TENANT_NAME;
        for (const char *c = ok ? t->valuestring : ""; *c; c++)
            ok = ok && (unsigned char)*c > ' ' && *c != 0x7f; /* it goes into an HTTP header */
        if (!ok) {
            r = cs_fail(CS_EINVAL,
                        "%s:%zu: \"tenant\" must be 1..%d bytes, no blanks or control "
                        "characters",
                        path, line, CS_LG_TENANT_NAME);
            goto done;
        }
        if (!(out->tenant = strdup(t->valuestring))) goto nomem;
    }
    goto done;
nomem:
    r = cs_fail(CS_ENOMEM, "%s:%zu: out of memory", path, line);
done:
    cJSON_Delete(o);
    if (r) {
        free(out->text);
        free(out->ids);
        free(out->tenant);
        memset(out, 0, sizeof *out);
    }
    return r;
}

static int load_jsonl(const char *path, cs_lg_workload *w) {
    FILE *f = fopen(path, "r");
    if (!f) return cs_fail(errno == ENOENT ? CS_ENOENT : CS_EIO, "%s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t cap = 0, n_cap = 0, line = 0;
    ssize_t len;
    int r = 0;
    while ((len = getline(&buf, &cap, f)) >= 0) {
        line++;
        while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r'))
            buf[--len] = 0;
        if (len == 0) continue;
        if (w->n_lines == n_cap) {
            size_t nc = n_cap ? 2 * n_cap : 64;
            cs_lg_line *nl = realloc(w->lines, nc * sizeof *nl);
            if (!nl) {
                r = cs_fail(CS_ENOMEM, "%s: out of memory", path);
                break;
            }
            w->lines = nl, n_cap = nc;
        }
        if ((r = parse_line(buf, path, line, &w->lines[w->n_lines]))) break;
        w->n_lines++;
    }
    free(buf);
    fclose(f);
    if (!r && w->n_lines == 0) r = cs_fail(CS_EINVAL, "%s: no requests in the file", path);
    return r;
}

int cs_lg_workload_load(const char *spec, cs_lg_workload *w) {
    memset(w, 0, sizeof *w);
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++)
        if (!strcmp(spec, builtins[i].name)) {
            snprintf(w->name, sizeof w->name, "%s", spec);
            memcpy(w->classes, builtins[i].classes, sizeof builtins[i].classes);
            w->n_classes = builtins[i].n;
            return 0;
        }
    size_t n = strlen(spec);
    if (n < 6 || strcmp(spec + n - 6, ".jsonl"))
        return cs_fail(CS_EINVAL,
                       "--workload '%s': one of chat, rag, summarize, mixed or a .jsonl file",
                       spec);
    const char *base = strrchr(spec, '/');
    snprintf(w->name, sizeof w->name, "%s", base ? base + 1 : spec);
    return load_jsonl(spec, w);
}

static int bad_tenant(const char *p, size_t len, const char *why) {
    return cs_fail(CS_EINVAL, "--tenants: '%.*s': %s", (int)len, p, why);
}

int cs_lg_tenants_parse(const char *spec, cs_lg_workload *w) {
    w->n_tenants = 0;
    for (const char *p = spec ? spec : ""; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char buf[160];
        if (len == 0 || len >= sizeof buf) return bad_tenant(p, len, "not NAME=WEIGHT[:WORKLOAD[:PRIORITY]]");
        memcpy(buf, p, len);
        buf[len] = 0;
        char *eq = strchr(buf, '=');
        for (const char *c = buf; eq && c < eq; c++)
            if ((unsigned char)*c <= ' ' || *c == 0x7f) eq = NULL; /* an HTTP header's value */
        if (!eq || eq == buf || (size_t)(eq - buf) > CS_LG_TENANT_NAME)
            return bad_tenant(p, len, "not NAME=WEIGHT[:WORKLOAD[:PRIORITY]] (a name of 1..64 bytes)");
        if (w->n_tenants == CS_LG_MAX_TENANTS) return bad_tenant(p, len, "more than 16 tenants");
        cs_lg_tenant *t = &w->tenants[w->n_tenants];
        memset(t, 0, sizeof *t);
        *eq = 0;
        snprintf(t->name, sizeof t->name, "%s", buf);
        for (int i = 0; i < w->n_tenants; i++)
            if (!strcmp(w->tenants[i].name, t->name)) return bad_tenant(p, len, "named twice");
        char *f = eq + 1, *wl = strchr(f, ':'), *prio = NULL, *stop;
        if (wl) *wl++ = 0, prio = strchr(wl, ':');
        if (prio) *prio++ = 0;
        t->weight = strtod(f, &stop);
        if (stop == f || *stop || !(t->weight > 0 && t->weight <= 1e6))
            return bad_tenant(p, len, "the weight must be in (0, 1e6]");
        if (wl && wl[0]) {
            size_t k = 0;
            while (k < sizeof builtins / sizeof builtins[0] &&
                   (strcmp(builtins[k].name, wl) || builtins[k].n != 1))
                k++;
            if (k == sizeof builtins / sizeof builtins[0])
                return bad_tenant(p, len, "the workload must be chat, rag or summarize");
            t->has_class = true;
            t->cls = builtins[k].classes[0];
        }
        if (prio) {
            long v = strtol(prio, &stop, 10);
            if (stop == prio || *stop || v < 0 || v > 1000000)
                return bad_tenant(p, len, "the priority must be an integer in 0..1000000");
            t->priority = (int32_t)v;
        }
        w->n_tenants++;
        p += len + (end != NULL);
    }
    return 0;
}

static int pick_tenant(const cs_lg_workload *w, cs_lg_rng *r) {
    double total = 0;
    for (int i = 0; i < w->n_tenants; i++)
        total += w->tenants[i].weight;
    double u = cs_lg_uniform(r) * total;
    for (int i = 0; i < w->n_tenants - 1; i++)
        if ((u -= w->tenants[i].weight) < 0) return i;
    return w->n_tenants - 1;
}

static int pick_class(const cs_lg_workload *w, cs_lg_rng *r) {
    double total = 0;
    for (int i = 0; i < w->n_classes; i++)
        total += w->classes[i].weight;
    double u = cs_lg_uniform(r) * total;
    for (int i = 0; i < w->n_classes - 1; i++)
        if ((u -= w->classes[i].weight) < 0) return i;
    return w->n_classes - 1;
}

void cs_lg_schedule(const cs_lg_workload *w, const cs_lg_params *p, cs_lg_request *out, size_t n) {
    /* three streams: lengths do not depend on the rate, offsets do; tenants
     * are drawn apart, so adding them leaves the lengths alone */
    cs_lg_rng len_rng, gap_rng, tenant_rng;
    cs_lg_rng_seed(&len_rng, p->seed);
    cs_lg_rng_seed(&gap_rng, p->seed ^ 0x5bd1e9955bd1e995ull);
    cs_lg_rng_seed(&tenant_rng, p->seed ^ 0x2545f4914f6cdd1dull);
    double t = 0;
    for (size_t i = 0; i < n; i++) {
        cs_lg_request *q = &out[i];
        memset(q, 0, sizeof *q);
        q->cls = -1, q->line = -1, q->group = -1, q->tenant = -1;
        const cs_lg_tenant *tn = NULL;
        if (w->n_tenants) {
            q->tenant = pick_tenant(w, &tenant_rng);
            tn = &w->tenants[q->tenant];
            q->priority = tn->priority;
        }
        if (w->n_lines) {
            q->line = (int32_t)cs_lg_range(&len_rng, 0, (int64_t)w->n_lines - 1);
            const cs_lg_line *l = &w->lines[q->line];
            q->prompt_len = l->text ? 0 : l->n_ids;
            q->output_len = l->out_tokens;
            if (l->group >= 0 && !l->text && !l->ids) q->group = l->group;
            if (!tn) q->priority = l->priority;
        } else {
            q->cls = tn && tn->has_class ? -1 : pick_class(w, &len_rng);
            const cs_lg_class *c = q->cls >= 0 ? &w->classes[q->cls] : &tn->cls;
            q->prompt_len = (int32_t)cs_lg_range(&len_rng, c->prompt_min, c->prompt_max);
            q->output_len = (int32_t)cs_lg_range(&len_rng, c->output_min, c->output_max);
            if (p->prefix_groups > 0)
                q->group = (int32_t)cs_lg_range(&len_rng, 0, p->prefix_groups - 1);
        }
        q->prompt_seed = cs_lg_rng_next(&len_rng);
        if (q->group >= 0 && p->prefix_tokens > 0) {
            q->n_prefix = p->prefix_tokens;
            if (w->n_lines == 0) q->prompt_len += p->prefix_tokens; /* the prefix, then its own */
        }
        if (p->context_length > 0) {
            int32_t ctx = p->context_length;
            if (q->output_len > ctx / 2) q->output_len = ctx / 2;
            if (q->prompt_len > ctx - q->output_len) q->prompt_len = ctx - q->output_len;
        }
        if (q->n_prefix > q->prompt_len) q->n_prefix = q->prompt_len;
        if (p->arrival != CS_LG_CLOSED) {
            if (i > 0) t += cs_lg_next_gap(&gap_rng, p->arrival, p->rate, p->burstiness);
            q->offset_s = t;
        }
    }
}

void cs_lg_prompt_ids(const cs_lg_request *q, uint64_t seed, int32_t id_lo, int32_t id_hi,
                      int32_t *ids) {
    cs_lg_rng r;
    int32_t i = 0;
    if (q->group >= 0 && q->n_prefix > 0) {
        cs_lg_rng_seed(&r, seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(q->group + 1)));
        for (; i < q->n_prefix; i++)
            ids[i] = (int32_t)cs_lg_range(&r, id_lo, id_hi - 1);
    }
    cs_lg_rng_seed(&r, q->prompt_seed ^ seed);
    for (; i < q->prompt_len; i++)
        ids[i] = (int32_t)cs_lg_range(&r, id_lo, id_hi - 1);
}
