/* engine_metrics.h (api/): the metrics of a process that runs an engine:
 * the scheduler's gauges and counters (vLLM-style names: what the chart's
 * autoscalers and dashboards read) and the per-token latencies. One table,
 * exported alike by `chunkserve serve` and both workers. */
#ifndef CHUNKSERVE_API_ENGINE_METRICS_H
#define CHUNKSERVE_API_ENGINE_METRICS_H

#include <stddef.h>

#include "chunkserve/metrics.h"
#include "chunkserve/model.h"
#include "chunkserve/serve.h"

typedef struct {
    cs_metric *running, *waiting, *kv_usage, *kv_free, *kv_total, *queued_prefill, *preemptions,
        *priority_preemptions, *prompt_tokens, *gen_tokens, *prefix_hits, *steps, *weights_quant,
        *weights_exact;
    cs_metric *refused; /* the process counts: its --max-queue, no free KV pages (CS_ENOSPC) */
    cs_metric *ttft_refused;   /* the process counts: a predicted TTFT over --ttft-slo-ms */
    cs_metric *prefill_rate;   /* prompt tokens a second beside the decodes (ttft.h) */
    cs_metric *ttft_predicted; /* what a request of one token would wait now */
    cs_metric *spec_drafts, *spec_draft_tokens, *spec_accepted; /* speculative decoding */
    cs_sched_stats last;                                        /* counters already exported */
} cs_engine_metrics;

/* The scheduler's rows (owner: a cs_engine_metrics). */
extern const cs_metric_def cs_engine_metrics_table[];
extern const size_t cs_engine_metrics_n;

/* Time to first token and between tokens, where tokens leave the engine for
 * the stream (owner: a cs_token_metrics). A decode worker's first token is
 * its Decode call's; serve's is the client call's. */
typedef struct {
    cs_metric *ttft, *itl;
    cs_metric *ttft_error; /* |predicted - measured| / measured TTFT (chunkserve/ttft.h) */
} cs_token_metrics;
extern const cs_metric_def cs_token_metrics_table[];
extern const size_t cs_token_metrics_n;

/* Refreshes em from the engine's scheduler statistics (the ops port's
 * scrape hook calls it). */
void cs_engine_metrics_update(cs_engine_metrics *em, cs_serve *sv, const cs_model *model);

#endif
