/* stats.h: the latency statistics of the CLI's benchmarks (stats.c): a
 * growable array of samples and its percentiles, computed as numpy's
 * default does (linear interpolation between the closest ranks: the p-th
 * percentile of n sorted samples sits at rank p/100 * (n - 1)), so that
 * anyone can recompute a report's figures from its raw samples. */
#ifndef CS_CLI_STATS_H
#define CS_CLI_STATS_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    double *v;
    size_t n, cap;
    bool sorted;
} cs_samples;

/* Appends x; CS_ENOMEM (then nothing changed). */
int cs_samples_push(cs_samples *s, double x);
/* Appends every sample of b. CS_ENOMEM. */
int cs_samples_extend(cs_samples *s, const cs_samples *b);
void cs_samples_free(cs_samples *s);
/* p in [0, 100]; NAN when empty. Sorts s (once). */
double cs_samples_percentile(cs_samples *s, double p);
double cs_samples_mean(const cs_samples *s);

typedef struct {
    size_t n;
    double mean, p50, p90, p99, max;
} cs_summary;

/* NANs when s is empty. */
cs_summary cs_samples_summary(cs_samples *s);

#endif
