/* chunkserve/metrics.h: a process's metrics registry and its Prometheus text
 * exposition (format 0.0.4). Counters, gauges and histograms, each one
 * series (a family name plus a fixed label set), updated from any thread
 * with atomics (no locks on the hot path) and rendered on demand.
 *
 * Names follow vLLM's where the meaning is the same (architecture.md, operations):
 * "chunkserve:num_requests_waiting", "chunkserve:kv_cache_usage_perc",
 * "chunkserve:time_to_first_token_seconds", ... Series of one family (same
 * name, different labels) share one HELP/TYPE header; the family's type and
 * help are those of its first series.
 * Not here: removing series, label values chosen at run time (register each
 * series once at start-up), summaries. */
#ifndef CHUNKSERVE_METRICS_H
#define CHUNKSERVE_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_metrics cs_metrics;
typedef struct cs_metric cs_metric; /* one series */

/* CS_ENOMEM. Free with cs_metrics_free (NULL is a no-op); series die with it. */
int cs_metrics_init(cs_metrics **out);
void cs_metrics_free(cs_metrics *m);

/* Registers a series and returns it (never NULL: out of memory or a bad name
 * aborts through CS_ASSERT, since this runs once at start-up with constant
 * arguments). name: [a-zA-Z_:][a-zA-Z0-9_:]*; labels: NULL or the inside of
 * the braces, e.g. "path=\"local\""; help: one line.
 * Registering the same name+labels twice returns the first series; a series
 * whose type differs from its family's aborts (CS_ASSERT). Thread-safe. */
cs_metric *cs_metrics_counter(cs_metrics *m, const char *name, const char *labels,
                              const char *help);
cs_metric *cs_metrics_gauge(cs_metrics *m, const char *name, const char *labels, const char *help);
/* bounds: n ascending upper bounds (copied); +Inf is implicit. */
cs_metric *cs_metrics_histogram(cs_metrics *m, const char *name, const char *labels,
                                const char *help, const double *bounds, size_t n);

/* Updates; thread-safe, lock-free. inc/add on a counter only (v >= 0);
 * set/add on a gauge; observe on a histogram. NULL metric is a no-op; a
 * negative or NaN add to a counter is dropped; the wrong kind of update for
 * the metric's type aborts (CS_ASSERT). */
void cs_metric_inc(cs_metric *c);
void cs_metric_add(cs_metric *c, double v);
void cs_metric_set(cs_metric *g, double v);
void cs_metric_observe(cs_metric *h, double v);
/* Current value of a counter or gauge; a histogram's count. */
double cs_metric_value(const cs_metric *c);

/* A process's metrics table (the twin of its config table, chunkserve/
 * config.h): one row per series, registered at start-up into a struct of
 * cs_metric pointers; tools read the same rows (--metrics-json). */
enum cs_metric_kind { CS_METRIC_COUNTER, CS_METRIC_GAUGE, CS_METRIC_HISTOGRAM };

typedef struct {
    size_t offset;    /* of the cs_metric * field that gets the series */
    const char *name; /* "chunkserve:num_requests_waiting" */
    enum cs_metric_kind kind;
    const char *labels;    /* NULL or the inside of the braces: "role=\"decode\"" */
    const char *help;      /* one line */
    const double *buckets; /* histograms: ascending upper bounds */
    size_t n_buckets;      /* 0 with one of the standard sets below: its length */
} cs_metric_def;

/* Registers every row of t, storing each series at (char *)owner + offset.
 * Aborts on a bad row (CS_ASSERT), like the calls above. */
void cs_metrics_register_table(cs_metrics *m, const cs_metric_def *t, size_t n, void *owner);
/* The rows as one JSON array on f (a FILE *): {"name", "kind" (counter|gauge|
 * histogram), "labels" (text or null), "help"} per row. */
void cs_metrics_print_json(const cs_metric_def *t, size_t n, void *f);

/* Standard bucket sets (seconds) for latency histograms. */
extern const double cs_metrics_ttft_buckets[]; /* 1 ms .. 60 s */
extern const size_t cs_metrics_n_ttft_buckets;
extern const double cs_metrics_itl_buckets[]; /* 1 ms .. 10 s */
extern const size_t cs_metrics_n_itl_buckets;
/* For relative errors (|predicted - measured| / measured): 5% .. 500%. */
extern const double cs_metrics_error_buckets[];
extern const size_t cs_metrics_n_error_buckets;

/* Renders every series as Prometheus text into a malloc'd, NUL-terminated
 * buffer (*len bytes without the NUL). CS_ENOMEM. Thread-safe. */
int cs_metrics_render(cs_metrics *m, char **out, size_t *len);

#ifdef __cplusplus
}
#endif
#endif
