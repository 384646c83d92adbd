/* slo_config.h (api/): the bound on the predicted time to first token by
 * which a door refuses a request early (`chunkserve serve`, the router):
 * --ttft-slo-ms, per priority. A request whose predicted TTFT
 * (chunkserve/ttft.h) is over its priority's bound because of the work
 * queued ahead of it is refused RESOURCE_EXHAUSTED / 429 with the time after
 * which the queue will have drained enough (gRPC: google.rpc.RetryInfo;
 * HTTP: Retry-After), rather than accepted and missed. One that would miss
 * the bound even alone is admitted once nothing is ahead of it: waiting
 * would not help it. */
#ifndef CHUNKSERVE_API_SLO_CONFIG_H
#define CHUNKSERVE_API_SLO_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "chunkserve/config.h"

enum { CS_SLO_CLASSES = 16 };

typedef struct {
    const char *ttft_spec; /* --ttft-slo-ms: "MS", "PRIORITY=MS,...", or both; NULL: none */
    /* parsed by cs_slo_opts_apply */
    int32_t n;
    int32_t priority[CS_SLO_CLASSES];
    double ttft_s[CS_SLO_CLASSES];
    double default_s; /* the other priorities' bound; 0 = none */
} cs_slo_opts;

extern const cs_config_entry cs_slo_config[]; /* offsets in cs_slo_opts */
extern const size_t cs_slo_config_n;

/* Parses o->ttft_spec. CS_EINVAL naming the flag and the entry: a bound
 * not in (0, 1e7] ms, a priority outside 0..CS_MAX_PRIORITY or named twice,
 * two defaults, more than CS_SLO_CLASSES entries. */
int cs_slo_opts_apply(cs_slo_opts *o);

/* The TTFT bound of a priority in seconds; 0 when it has none. */
double cs_slo_ttft_bound(const cs_slo_opts *o, int32_t priority);

/* The refusal rule: given a request's predicted TTFT with the queue
 * (predicted) and alone (alone), both seconds, and its bound (0: none),
 * the milliseconds after which to retry, or 0 to admit it. */
int64_t cs_slo_refuse_ms(double predicted, double alone, double bound);

#endif
