/* engine_metrics.c: the table of engine_metrics.h and its refresh. */
#include "engine_metrics.h"

#include <math.h>

#include "chunkserve/sampler.h"
#include "chunkserve/ttft.h"

#define M(f) offsetof(cs_engine_metrics, f)
const cs_metric_def cs_engine_metrics_table[] = {
    {M(running), "chunkserve:num_requests_running", CS_METRIC_GAUGE, NULL,
     "sequences in the running batch", NULL, 0},
    {M(waiting), "chunkserve:num_requests_waiting", CS_METRIC_GAUGE, NULL,
     "requests admitted and not running (waiting for a seat, pages or their KV)", NULL, 0},
    {M(kv_usage), "chunkserve:kv_cache_usage_perc", CS_METRIC_GAUGE, NULL,
     "fraction of KV pages in use (0..1)", NULL, 0},
    {M(kv_free), "chunkserve:kv_pages_free", CS_METRIC_GAUGE, NULL,
     "KV pages free or holding reusable prefixes (not reserved)", NULL, 0},
    {M(kv_total), "chunkserve:kv_pages_total", CS_METRIC_GAUGE, NULL, "KV pages in the pool", NULL,
     0},
    {M(queued_prefill), "chunkserve:queued_prefill_tokens", CS_METRIC_GAUGE, NULL,
     "prompt tokens admitted and not computed yet", NULL, 0},
    {M(preemptions), "chunkserve:num_preemptions_total", CS_METRIC_COUNTER, NULL,
     "sequences preempted (pages freed, recomputed)", NULL, 0},
    {M(priority_preemptions), "chunkserve:num_priority_preemptions_total", CS_METRIC_COUNTER, NULL,
     "of the preemptions, those that seated a request of a higher priority", NULL, 0},
    {M(prompt_tokens), "chunkserve:prompt_tokens_total", CS_METRIC_COUNTER, NULL,
     "prompt tokens computed", NULL, 0},
    {M(gen_tokens), "chunkserve:generation_tokens_total", CS_METRIC_COUNTER, NULL, "tokens sampled",
     NULL, 0},
    {M(prefix_hits), "chunkserve:prefix_cache_hit_tokens_total", CS_METRIC_COUNTER, NULL,
     "prompt tokens taken from the prefix cache", NULL, 0},
    {M(steps), "chunkserve:engine_steps_total", CS_METRIC_COUNTER, NULL, "engine steps run", NULL,
     0},
    {M(weights_quant), "chunkserve:weight_mode", CS_METRIC_GAUGE, "mode=\"quant\"",
     "1 for the engine's weight mode: quant (quantized blocks, integer kernels) or exact (fp32)",
     NULL, 0},
    {M(weights_exact), "chunkserve:weight_mode", CS_METRIC_GAUGE, "mode=\"exact\"",
     "1 for the engine's weight mode: quant (quantized blocks, integer kernels) or exact (fp32)",
     NULL, 0},
    {M(refused), "chunkserve:requests_refused_total", CS_METRIC_COUNTER, NULL,
     "requests refused (RESOURCE_EXHAUSTED): the queue limit, no free KV pages, or a predicted "
     "TTFT over --ttft-slo-ms (those also in requests_refused_ttft_total)",
     NULL, 0},
    {M(ttft_refused), "chunkserve:requests_refused_ttft_total", CS_METRIC_COUNTER, NULL,
     "requests refused early (RESOURCE_EXHAUSTED / 429 + Retry-After) because the work queued "
     "ahead put their predicted time to first token over --ttft-slo-ms",
     NULL, 0},
    {M(prefill_rate), "chunkserve:prefill_capacity_tokens_per_second", CS_METRIC_GAUGE, NULL,
     "prompt tokens a second this engine computes beside its current decodes, from the fitted "
     "step model (under the step-time target, if set) and recent steps' overrun; until the "
     "model is fitted, the measured rate of recent steps with prompt chunks (0 before any)",
     NULL, 0},
    {M(ttft_predicted), "chunkserve:predicted_queue_seconds", CS_METRIC_GAUGE, NULL,
     "predicted time to first token of a one-token prompt arriving now (the queued prompt work "
     "over the prefill capacity); 0 until the model is fitted",
     NULL, 0},
    {M(spec_drafts), "chunkserve:spec_decode_num_drafts_total", CS_METRIC_COUNTER, NULL,
     "speculative decoding: decodes that carried drafted tokens (verifications)", NULL, 0},
    {M(spec_draft_tokens), "chunkserve:spec_decode_num_draft_tokens_total", CS_METRIC_COUNTER, NULL,
     "speculative decoding: drafted tokens verified", NULL, 0},
    {M(spec_accepted), "chunkserve:spec_decode_num_accepted_tokens_total", CS_METRIC_COUNTER, NULL,
     "speculative decoding: drafted tokens kept (acceptance rate = this / draft tokens; mean "
     "accepted length = 1 + this / drafts)",
     NULL, 0},
};
const size_t cs_engine_metrics_n = sizeof cs_engine_metrics_table / sizeof *cs_engine_metrics_table;
#undef M

#define M(f) offsetof(cs_token_metrics, f)
const cs_metric_def cs_token_metrics_table[] = {
    {M(ttft), "chunkserve:time_to_first_token_seconds", CS_METRIC_HISTOGRAM, NULL,
     "call received to first token, at this process (a decode worker: its Decode call)",
     cs_metrics_ttft_buckets, 0},
    {M(itl), "chunkserve:inter_token_latency_seconds", CS_METRIC_HISTOGRAM, NULL,
     "time between a sequence's consecutive tokens", cs_metrics_itl_buckets, 0},
    {M(ttft_error), "chunkserve:ttft_prediction_error_ratio", CS_METRIC_HISTOGRAM, NULL,
     "|predicted - measured| / measured time to first token of the requests whose TTFT was "
     "predicted at admission (the median is the predictor's accuracy)",
     cs_metrics_error_buckets, 0},
};
const size_t cs_token_metrics_n = sizeof cs_token_metrics_table / sizeof *cs_token_metrics_table;
#undef M

void cs_engine_metrics_update(cs_engine_metrics *em, cs_serve *sv, const cs_model *model) {
    cs_sched_stats st;
    cs_serve_stats(sv, &st);
    cs_metric_set(em->running, st.n_running);
    cs_metric_set(em->waiting, st.n_waiting);
    cs_metric_set(em->kv_usage,
                  st.kv_pages_total ? (double)st.kv_pages_used / st.kv_pages_total : 0);
    cs_metric_set(em->kv_free, st.kv_pages_total - st.kv_pages_used);
    cs_metric_set(em->kv_total, st.kv_pages_total);
    cs_metric_set(em->queued_prefill, (double)st.queued_prompt_tokens);
    cs_ttft_load L;
    cs_serve_ttft_load(sv, &L);
    cs_metric_set(em->prefill_rate, L.prompt_tokens_per_s);
    double q = cs_ttft_predict(&L, CS_MAX_PRIORITY, NULL, 1, 1);
    cs_metric_set(em->ttft_predicted, isfinite(q) ? q : 0);
    bool quant = cs_model_weight_mode(model) == CS_WEIGHTS_QUANT;
    cs_metric_set(em->weights_quant, quant);
    cs_metric_set(em->weights_exact, !quant);
    cs_sched_stats *l = &em->last;
    cs_metric_add(em->preemptions, (double)(st.preemptions - l->preemptions));
    cs_metric_add(em->priority_preemptions,
                  (double)(st.priority_preemptions - l->priority_preemptions));
    cs_metric_add(em->prompt_tokens,
                  (double)(st.prompt_tokens_computed - l->prompt_tokens_computed));
    cs_metric_add(em->gen_tokens, (double)(st.generated_tokens - l->generated_tokens));
    cs_metric_add(em->prefix_hits, (double)(st.prefix_hit_tokens - l->prefix_hit_tokens));
    cs_metric_add(em->steps, (double)(st.steps - l->steps));
    cs_metric_add(em->spec_drafts, (double)(st.spec_drafts - l->spec_drafts));
    cs_metric_add(em->spec_draft_tokens, (double)(st.spec_draft_tokens - l->spec_draft_tokens));
    cs_metric_add(em->spec_accepted, (double)(st.spec_accepted_tokens - l->spec_accepted_tokens));
    *l = st;
}
