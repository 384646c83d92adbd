/* chunkserve/sampler.h: next-token selection for one sequence: greedy,
 * temperature, top-k, top-p, min-p, repetition / presence / frequency
 * penalties, with a per-sequence RNG so a sampled sequence's tokens never
 * depend on what it is batched with or where it runs. One sampler per sequence; not
 * thread-safe per object. */
#ifndef CHUNKSERVE_SAMPLER_H
#define CHUNKSERVE_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature;        /* 0 = greedy (argmax, lowest id on ties); must be >= 0 */
    int32_t top_k;            /* 0 = off; keep the k most likely */
    float top_p;              /* 1 = off; in (0, 1] */
    float min_p;              /* 0 = off; in [0, 1]: drop p < min_p * p_max */
    float repetition_penalty; /* 1 = off; > 0; prompt and output tokens (CTRL / HF style) */
    float presence_penalty;   /* 0 = off; in [-2, 2]; output tokens (OpenAI style) */
    float frequency_penalty;  /* 0 = off; in [-2, 2]; output tokens, times their count */
    uint64_t seed;
    /* logit_bias: bias[i] (finite, in [-100, 100]) added to token bias_ids[i]'s logit after
     * the penalties, before temperature and the filters; n_bias 0 = none (at most
     * CS_MAX_LOGIT_BIAS). Borrowed: cs_sampler_init copies them */
    const int32_t *bias_ids;
    const float *bias;
    int32_t n_bias;
} cs_sampling_params;
#define CS_MAX_LOGIT_BIAS 1024

/* The defaults of chunkserve/sampling_fields.h: greedy, no penalties, seed 0. */
cs_sampling_params cs_sampling_params_default(void);
/* 0, or CS_EINVAL with cs_last_error() naming the bad field and its range. */
int cs_sampling_params_check(const cs_sampling_params *p);

typedef struct cs_sampler cs_sampler;
/* Checks p, allocates the per-vocabulary scratch. Free with cs_sampler_free. */
int cs_sampler_init(const cs_sampling_params *p, int32_t n_vocab, cs_sampler **out);
void cs_sampler_free(cs_sampler *s); /* NULL is a no-op */

/* min_tokens: until min_tokens tokens have been accepted, the n ids (the
 * stop tokens: end-of-generation unless ignored, stop_token_ids; copied) are
 * never sampled (their logits are -inf after the penalties; logprobs stay
 * raw). CS_ENOMEM. */
int cs_sampler_suppress(cs_sampler *s, const int32_t *ids, size_t n, int32_t min_tokens);

/* Records prompt tokens (they count for the repetition penalty only). */
void cs_sampler_accept_prompt(cs_sampler *s, const int32_t *ids, size_t n);
/* Records a generated token (all penalties). Call after each sample. */
void cs_sampler_accept(cs_sampler *s, int32_t id);

/* Log-probabilities under the model's raw distribution (before penalties and
 * temperature): the chosen token's and the n_top most likely tokens' (most
 * likely first, the lower id first on ties), as OpenAI's logprobs and
 * top_logprobs report them. */
#define CS_MAX_TOP_LOGPROBS 20
/* The largest (lowest) request priority (cs_request.priority; 0 is the highest). */
#define CS_MAX_PRIORITY 1000000
typedef struct {
    float logprob; /* the chosen token's */
    int32_t n_top; /* 0..CS_MAX_TOP_LOGPROBS */
    int32_t top_ids[CS_MAX_TOP_LOGPROBS];
    float top_logprobs[CS_MAX_TOP_LOGPROBS];
} cs_logprobs;

/* A prompt token's log-probability given the tokens before it (vLLM's
 * prompt_logprobs): the raw distribution as above, and its rank (1 + the
 * tokens strictly more likely). */
typedef struct {
    int32_t token, rank;
    cs_logprobs lp; /* the token's logprob and n_top alternatives */
} cs_prompt_logprob;
void cs_prompt_logprob_of(const float *logits, int32_t n_vocab, int32_t token, int32_t n_top,
                          cs_prompt_logprob *out);

/* The greedy choice: the largest of v[0..n), the lowest id on ties (what
 * temperature 0 samples, and what a speculative draft proposes). */
int32_t cs_argmax(const float *v, int32_t n);

/* Picks the next token from logits (n_vocab floats; overwritten as scratch).
 * If lp is not NULL it receives the chosen token's log-probability and the
 * n_top (0..CS_MAX_TOP_LOGPROBS, clamped) most likely alternatives. */
int32_t cs_sampler_sample(cs_sampler *s, float *logits, int32_t n_top, cs_logprobs *lp);
/* A speculative draft's proposal for the token `ahead` tokens after the
 * next (0: the next), from a draft model's logits over the first n ids
 * (overwritten as scratch): greedy requests take the argmax; sampled ones
 * the pick of the request's temperature and filters with the very random
 * number its own sample there will use (no penalties, bias or masks). The
 * check compares the proposal with that sample, so a draft model close to
 * the target proposes what the target will draw, not only its most likely
 * token; and the output stays the target's own samples. */
int32_t cs_sampler_propose(cs_sampler *s, float *logits, int32_t n, int32_t ahead);
/* The same, with only the tokens set in allow (n_vocab bits, bit i of
 * allow[i / 32]; at least one set) eligible: a structured output's mask
 * (chunkserve/grammar.h), applied after the penalties, logit_bias and the
 * min_tokens suppression; the latter is skipped when it would leave nothing
 * allowed. Logprobs stay raw. */
int32_t cs_sampler_sample_allowed(cs_sampler *s, float *logits, const uint32_t *allow,
                                  int32_t n_top, cs_logprobs *lp);

/* Randomness is counter-based: the draw for the k-th generated token (k =
 * tokens accepted so far) depends only on (seed, k). So a sequence continued
 * in another process (a decode worker after a prefill worker sampled its
 * first token, a migration) draws the same numbers with no state to carry:
 * create a sampler with the same params and accept the same tokens. */

#ifdef __cplusplus
}
#endif
#endif
