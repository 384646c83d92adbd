/* stats.c: samples and percentiles (see stats.h). */
#include "stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"

int cs_samples_push(cs_samples *s, double x) {
    if (s->n == s->cap) {
        size_t nc = s->cap ? 2 * s->cap : 256;
        double *nv = realloc(s->v, nc * sizeof *nv);
        if (!nv) return cs_fail(CS_ENOMEM, "samples: out of memory");
        s->v = nv, s->cap = nc;
    }
    s->v[s->n++] = x;
    s->sorted = false;
    return 0;
}

int cs_samples_extend(cs_samples *s, const cs_samples *b) {
    for (size_t i = 0; i < b->n; i++) {
        int r = cs_samples_push(s, b->v[i]);
        if (r) return r;
    }
    return 0;
}

void cs_samples_free(cs_samples *s) {
    free(s->v);
    memset(s, 0, sizeof *s);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double cs_samples_percentile(cs_samples *s, double p) {
    if (s->n == 0) return NAN;
    if (!s->sorted) {
        qsort(s->v, s->n, sizeof *s->v, cmp_double);
        s->sorted = true;
    }
    double rank = p / 100.0 * (double)(s->n - 1);
    size_t lo = (size_t)floor(rank);
    if (lo + 1 >= s->n) return s->v[s->n - 1];
    double frac = rank - (double)lo;
    return s->v[lo] + frac * (s->v[lo + 1] - s->v[lo]);
}

double cs_samples_mean(const cs_samples *s) {
    if (s->n == 0) return NAN;
    double sum = 0;
    for (size_t i = 0; i < s->n; i++)
        sum += s->v[i];
    return sum / (double)s->n;
}

cs_summary cs_samples_summary(cs_samples *s) {
    cs_summary m = {.n = s->n, .mean = cs_samples_mean(s)};
    m.p50 = cs_samples_percentile(s, 50);
    m.p90 = cs_samples_percentile(s, 90);
    m.p99 = cs_samples_percentile(s, 99);
    m.max = cs_samples_percentile(s, 100);
    return m;
}
