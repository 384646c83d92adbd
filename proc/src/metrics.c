/* metrics.c: the metrics registry (chunkserve/metrics.h). Values are C11
 * atomics updated without locks (a double is kept as its uint64 bit pattern,
 * added with a compare-and-swap loop); the mutex guards only the family and
 * series lists, i.e. registration and rendering. Rendering reads each value
 * atomically but not the registry as one snapshot, which Prometheus allows.
 * Not here: removing series, summaries, the OpenMetrics format. */
#include "chunkserve/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/assert.h"
#include "chunkserve/error.h"

enum metric_type { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM };
static const char *const type_names[] = {"counter", "gauge", "histogram"};

struct cs_metric {
    enum metric_type type;
    char *labels;           /* inside of the braces; NULL = none */
    _Atomic uint64_t value; /* counter, gauge: the double's bits; histogram: the sum's */
    /* Histogram only: per-bucket (not cumulative) counts, the last one +Inf. */
    double *bounds; /* (n_bounds) ascending */
    size_t n_bounds;
    _Atomic uint64_t *counts; /* (n_bounds + 1) */
    struct cs_metric *next;   /* in its family, registration order */
};

typedef struct family {
    char *name, *help;
    enum metric_type type;
    cs_metric *first, *last;
    struct family *next; /* registration order */
} family;

struct cs_metrics {
    pthread_mutex_t lock;
    family *first, *last;
};

/* Doubles in atomics: memcpy is the defined way to move the bits. */
static uint64_t d2u(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}
static double u2d(uint64_t u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

static void atomic_add_double(_Atomic uint64_t *a, double v) {
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(a, &old, d2u(u2d(old) + v), memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

int cs_metrics_init(cs_metrics **out) {
    *out = NULL;
    cs_metrics *m = calloc(1, sizeof *m);
    if (!m) return cs_fail(CS_ENOMEM, "metrics: out of memory");
    if (pthread_mutex_init(&m->lock, NULL) != 0) {
        free(m);
        return cs_fail(CS_ENOMEM, "metrics: cannot create the registry lock");
    }
    *out = m;
    return 0;
}

static void metric_free(cs_metric *s) {
    free(s->labels);
    free(s->bounds);
    free((void *)s->counts);
    free(s);
}

void cs_metrics_free(cs_metrics *m) {
    if (!m) return;
    for (family *f = m->first, *fn; f; f = fn) {
        fn = f->next;
        for (cs_metric *s = f->first, *sn; s; s = sn) {
            sn = s->next;
            metric_free(s);
        }
        free(f->name);
        free(f->help);
        free(f);
    }
    pthread_mutex_destroy(&m->lock);
    free(m);
}

static bool valid_name(const char *s) {
    if (!s || !*s) return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                  (p != s && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

static char *dup_or_die(const char *s) {
    char *d = strdup(s);
    CS_ASSERT(d != NULL);
    return d;
}

static cs_metric *register_series(cs_metrics *m, enum metric_type type, const char *name,
                                  const char *labels, const char *help, const double *bounds,
                                  size_t n_bounds) {
    CS_ASSERT(m != NULL);
    CS_ASSERT(valid_name(name));
    if (labels && !*labels) labels = NULL;
    for (size_t i = 0; i < n_bounds; i++) /* finite and strictly ascending */
        CS_ASSERT(isfinite(bounds[i]) && (i == 0 || bounds[i] > bounds[i - 1]));
    pthread_mutex_lock(&m->lock);
    family *f = m->first;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    if (f) {
        /* One family, one type: a counter and a gauge under one name would
         * render as an invalid exposition. */
        CS_ASSERT(f->type == type);
        for (cs_metric *s = f->first; s; s = s->next)
            if ((!s->labels && !labels) || (s->labels && labels && !strcmp(s->labels, labels))) {
                pthread_mutex_unlock(&m->lock);
                return s;
            }
    } else {
        f = calloc(1, sizeof *f);
        CS_ASSERT(f != NULL);
        f->name = dup_or_die(name);
        f->help = dup_or_die(help ? help : "");
        f->type = type;
        if (m->last)
            m->last->next = f;
        else
            m->first = f;
        m->last = f;
    }
    cs_metric *s = calloc(1, sizeof *s);
    CS_ASSERT(s != NULL);
    s->type = type;
    s->labels = labels ? dup_or_die(labels) : NULL;
    atomic_init(&s->value, d2u(0.0));
    if (type == METRIC_HISTOGRAM) {
        s->n_bounds = n_bounds;
        s->bounds = malloc((n_bounds ? n_bounds : 1) * sizeof *s->bounds);
        s->counts = malloc((n_bounds + 1) * sizeof *s->counts);
        CS_ASSERT(s->bounds && s->counts);
        if (n_bounds) memcpy(s->bounds, bounds, n_bounds * sizeof *bounds);
        for (size_t i = 0; i <= n_bounds; i++)
            atomic_init(&s->counts[i], 0);
    }
    if (f->last)
        f->last->next = s;
    else
        f->first = s;
    f->last = s;
    pthread_mutex_unlock(&m->lock);
    return s;
}

cs_metric *cs_metrics_counter(cs_metrics *m, const char *name, const char *labels,
                              const char *help) {
    return register_series(m, METRIC_COUNTER, name, labels, help, NULL, 0);
}

cs_metric *cs_metrics_gauge(cs_metrics *m, const char *name, const char *labels, const char *help) {
    return register_series(m, METRIC_GAUGE, name, labels, help, NULL, 0);
}

cs_metric *cs_metrics_histogram(cs_metrics *m, const char *name, const char *labels,
                                const char *help, const double *bounds, size_t n) {
    CS_ASSERT(bounds || n == 0);
    return register_series(m, METRIC_HISTOGRAM, name, labels, help, bounds, n);
}

void cs_metric_inc(cs_metric *c) {
    cs_metric_add(c, 1.0);
}

void cs_metric_add(cs_metric *c, double v) {
    if (!c) return;
    CS_ASSERT(c->type != METRIC_HISTOGRAM);
    /* A counter only goes up: a negative or NaN increment (a clock step, a
     * bad subtraction) is dropped rather than break rate(). */
    if (c->type == METRIC_COUNTER && !(v >= 0)) return;
    atomic_add_double(&c->value, v);
}

void cs_metric_set(cs_metric *g, double v) {
    if (!g) return;
    CS_ASSERT(g->type == METRIC_GAUGE);
    atomic_store_explicit(&g->value, d2u(v), memory_order_relaxed);
}

void cs_metric_observe(cs_metric *h, double v) {
    if (!h) return;
    CS_ASSERT(h->type == METRIC_HISTOGRAM);
    size_t i = 0; /* first bucket with v <= bound ("le"); NaN lands in +Inf */
    while (i < h->n_bounds && !(v <= h->bounds[i]))
        i++;
    atomic_fetch_add_explicit(&h->counts[i], 1, memory_order_relaxed);
    atomic_add_double(&h->value, v);
}

static uint64_t histogram_count(const cs_metric *h) {
    uint64_t n = 0;
    for (size_t i = 0; i <= h->n_bounds; i++)
        n += atomic_load_explicit(&h->counts[i], memory_order_relaxed);
    return n;
}

double cs_metric_value(const cs_metric *c) {
    if (!c) return 0;
    if (c->type == METRIC_HISTOGRAM) return (double)histogram_count(c);
    return u2d(atomic_load_explicit(&c->value, memory_order_relaxed));
}

const double cs_metrics_ttft_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                          0.1,   0.25,  0.5,  0.75, 1.0,  2.5,  5.0,
                                          7.5,   10.0,  20.0, 40.0, 60.0};
const size_t cs_metrics_n_ttft_buckets =
    sizeof cs_metrics_ttft_buckets / sizeof cs_metrics_ttft_buckets[0];
const double cs_metrics_itl_buckets[] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                         0.3,   0.4,   0.5,  0.75,  1.0,  2.5,   5.0, 7.5,  10.0};
const size_t cs_metrics_n_itl_buckets =
    sizeof cs_metrics_itl_buckets / sizeof cs_metrics_itl_buckets[0];
const double cs_metrics_error_buckets[] = {0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5};
const size_t cs_metrics_n_error_buckets =
    sizeof cs_metrics_error_buckets / sizeof cs_metrics_error_buckets[0];

/* Growable text buffer; a failed allocation sticks and is reported once. */
typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_reserve(sbuf *b, size_t extra) {
    if (b->oom || b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return;
    }
    b->p = p;
    b->cap = cap;
}

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    sb_reserve(b, (size_t)n);
    if (b->oom) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

static void sb_putc(sbuf *b, char c) {
    sb_reserve(b, 1);
    if (b->oom) return;
    b->p[b->len++] = c;
    b->p[b->len] = 0;
}

/* Prometheus floats: Go's shortest form in spirit ("1", "0.005", "1e+20"),
 * with the exposition's spellings of the non-finite values. */
static void format_double(double v, char *out, size_t cap) {
    if (isnan(v)) {
        snprintf(out, cap, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(out, cap, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, cap, "%.*g", prec, v);
        if (strtod(out, NULL) == v) return;
    }
}

/* HELP text escapes backslash and newline (format 0.0.4). */
static void put_help(sbuf *b, const char *s) {
    for (; *s; s++) {
        if (*s == '\\')
            sb_printf(b, "\\\\");
        else if (*s == '\n')
            sb_printf(b, "\\n");
        else
            sb_putc(b, *s);
    }
}

/* name{labels} or name (suffix: "_sum" ...; extra: a further label or NULL). */
static void put_series(sbuf *b, const char *name, const char *suffix, const char *labels,
                       const char *extra) {
    sb_printf(b, "%s%s", name, suffix);
    if (labels || extra)
        sb_printf(b, "{%s%s%s}", labels ? labels : "", labels && extra ? "," : "",
                  extra ? extra : "");
}

int cs_metrics_render(cs_metrics *m, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    sbuf b = {0};
    sb_reserve(&b, 0); /* an empty registry renders as "" */
    if (!b.oom) b.p[0] = 0;
    char num[64], le[96];
    pthread_mutex_lock(&m->lock);
    for (const family *f = m->first; f; f = f->next) {
        sb_printf(&b, "# HELP %s ", f->name);
        put_help(&b, f->help);
        sb_printf(&b, "\n# TYPE %s %s\n", f->name, type_names[f->type]);
        for (const cs_metric *s = f->first; s; s = s->next) {
            if (s->type != METRIC_HISTOGRAM) {
                format_double(cs_metric_value(s), num, sizeof num);
                put_series(&b, f->name, "", s->labels, NULL);
                sb_printf(&b, " %s\n", num);
                continue;
            }
            /* Cumulative buckets from per-bucket counts read once each, so
             * that +Inf and _count agree even while observations race. */
            uint64_t cum = 0;
            for (size_t i = 0; i <= s->n_bounds; i++) {
                cum += atomic_load_explicit(&s->counts[i], memory_order_relaxed);
                if (i < s->n_bounds) format_double(s->bounds[i], num, sizeof num);
                snprintf(le, sizeof le, "le=\"%s\"", i < s->n_bounds ? num : "+Inf");
                put_series(&b, f->name, "_bucket", s->labels, le);
                sb_printf(&b, " %llu\n", (unsigned long long)cum);
            }
            format_double(u2d(atomic_load_explicit(&s->value, memory_order_relaxed)), num,
                          sizeof num);
            put_series(&b, f->name, "_sum", s->labels, NULL);
            sb_printf(&b, " %s\n", num);
            put_series(&b, f->name, "_count", s->labels, NULL);
            sb_printf(&b, " %llu\n", (unsigned long long)cum);
        }
    }
    pthread_mutex_unlock(&m->lock);
    if (b.oom) {
        free(b.p);
        return cs_fail(CS_ENOMEM, "metrics: out of memory rendering");
    }
    *out = b.p;
    if (len) *len = b.len;
    return 0;
}

void cs_metrics_register_table(cs_metrics *m, const cs_metric_def *t, size_t n, void *owner) {
    for (size_t i = 0; i < n; i++) {
        cs_metric **slot = (cs_metric **)((char *)owner + t[i].offset);
        switch (t[i].kind) {
        case CS_METRIC_COUNTER:
            *slot = cs_metrics_counter(m, t[i].name, t[i].labels, t[i].help);
            break;
        case CS_METRIC_GAUGE: *slot = cs_metrics_gauge(m, t[i].name, t[i].labels, t[i].help); break;
        case CS_METRIC_HISTOGRAM: {
            size_t nb = t[i].n_buckets;
            if (!nb && t[i].buckets == cs_metrics_ttft_buckets) nb = cs_metrics_n_ttft_buckets;
            if (!nb && t[i].buckets == cs_metrics_itl_buckets) nb = cs_metrics_n_itl_buckets;
            if (!nb && t[i].buckets == cs_metrics_error_buckets) nb = cs_metrics_n_error_buckets;
            CS_ASSERT(t[i].buckets && nb > 0);
            *slot = cs_metrics_histogram(m, t[i].name, t[i].labels, t[i].help, t[i].buckets, nb);
            break;
        }
        }
    }
}

static void json_str(FILE *f, const char *s) {
    if (!s) {
        fputs("null", f);
        return;
    }
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

void cs_metrics_print_json(const cs_metric_def *t, size_t n, void *fp) {
    static const char *kinds[] = {"counter", "gauge", "histogram"};
    FILE *f = fp;
    fputc('[', f);
    for (size_t i = 0; i < n; i++) {
        fprintf(f, "%s\n {\"name\": ", i ? "," : "");
        json_str(f, t[i].name);
        fprintf(f, ", \"kind\": \"%s\", \"labels\": ", kinds[t[i].kind]);
        json_str(f, t[i].labels);
        fputs(", \"help\": ", f);
        json_str(f, t[i].help);
        fputc('}', f);
    }
    fputs("\n]\n", f);
}
