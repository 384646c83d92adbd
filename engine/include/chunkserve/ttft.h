/* chunkserve/ttft.h: a request's time to first token, predicted at
 * admission from the prompt work queued ahead of it and the step model
 * (chunkserve/step_model.h).
 *
 * A pool's load is its queued prompt tokens grouped by (priority, tenant),
 * the work of its running decodes, how many prompt tokens a step takes
 * beside them (under the step-time target, the longest chunk the model fits
 * in it) and a copy of the step model's fit. The scheduler serves
 * priorities in order and, within one, shares the prompt chunks between
 * tenants by tokens served per weight (sched.h), so the work done before a
 * new request's last prompt token is, as in generalized processor sharing:
 *   every better priority's tokens
 *   + Q = its own tenant's queued tokens at its priority + its prompt
 *   + for each other tenant t of that priority, min(tokens of t, Q w_t / w)
 * and the prediction is the rest of the running step, then the
 * ceil(work / chunk_tokens) steps that compute that work, each costed by
 * the step model with the running decodes in it. Steps are full while
 * anything is queued (the scheduler is work-conserving: what the request's
 * share leaves goes to the others, lower priorities too), so those steps
 * compute min(every queued token, steps x chunk_tokens), the last one with
 * the request's sampling row. Cached prefix tokens are not known before
 * admission: a prompt that hits the prefix cache is predicted slower than
 * it will be.
 *
 * Plain data, no allocation; the scheduler fills one after each step
 * (cs_sched_ttft_load), the serving loop adds what was submitted since and
 * what is left of the running step (cs_serve_ttft_load). */
#ifndef CHUNKSERVE_TTFT_H
#define CHUNKSERVE_TTFT_H

#include <stdbool.h>
#include <stdint.h>

#include "chunkserve/sched.h"
#include "chunkserve/step_model.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { CS_TTFT_GROUPS = 32 };

typedef struct {
    int32_t priority;
    char tenant[CS_TENANT_NAME_MAX + 1]; /* "" the default tenant */
    double weight;                       /* its share (1 unless --tenant-shares names it) */
    int64_t tokens;                      /* prompt tokens queued, not computed yet */
} cs_ttft_group;

typedef struct cs_ttft_load {
    bool ready;                       /* the step model is fitted (else nothing is predicted) */
    double w[CS_STEP_MODEL_FEATURES]; /* its coefficients, scaled by how much recent steps
                                         with prompt chunks overran their prediction */
    double dec_tokens, dec_pairs, dec_rows; /* the running decodes' share of a step */
    double chunk_tokens;        /* prompt tokens a step takes beside them */
    double position;            /* where the chunks computing the queued prompts start (the mean,
                                   weighted by their tokens left) */
    double prompt_tokens_per_s; /* chunk_tokens over such a step's seconds; before the model
                                   is fitted, the measured rate of recent prompt steps */
    double decode_tokens_per_s; /* what decodes alone could make a second: the most
                                   sequences a step fits under the step-time target (the ITL
                                   target; 0 without one), at most max_num_seqs and what the
                                   KV pool holds at the running decodes' mean context (else
                                   1,024 tokens) */
    double residual_s;          /* what is left of the step running now (cs_serve_ttft_load
                                   fills it in: when it began, what it was predicted to take) */
    double in_step_tokens;      /* queued tokens that step computes (done when it ends) */
    int32_t n_groups;
    cs_ttft_group groups[CS_TTFT_GROUPS];
    int64_t overflow_tokens; /* tokens of groups past the table: counted ahead of everyone */
} cs_ttft_load;

/* Adds tokens queued by (priority, tenant of weight w) to L; 0 tokens:
 * the group only says the tenant's weight (cs_ttft_load_weight). */
void cs_ttft_load_add(cs_ttft_load *L, int32_t priority, const char *tenant, double weight,
                      int64_t tokens);

/* Every queued token of L. */
double cs_ttft_load_tokens(const cs_ttft_load *L);

/* Seconds of a step of L's decodes and a prompt chunk of `chunk` tokens at
 * L's position, with `rows` sampling rows of prompts; 0 when not ready. */
double cs_ttft_step_s(const cs_ttft_load *L, double chunk, double rows);

/* The prompt tokens computed before the first token of a request of
 * n_tokens prompt tokens (priority, tenant of weight w) joining the queue
 * L, its own last: the better priorities' queued tokens, its tenant's at
 * its priority, and each other tenant's there up to its weighted share of
 * those (generalized processor sharing: the scheduler's token-fair steps),
 * less what the running step computes (in_step_tokens). Only L's groups,
 * overflow and in_step_tokens are read: a router fills them from a
 * worker's status and divides by the worker's rate. */
double cs_ttft_work(const cs_ttft_load *L, int32_t priority, const char *tenant, double weight,
                    int64_t n_tokens);

/* The predicted seconds to the first token of a request of n_tokens prompt
 * tokens (priority, tenant of weight w) joining the queue L: the steps that
 * compute cs_ttft_work, full while anything is queued; NAN when L is not
 * ready. */
double cs_ttft_predict(const cs_ttft_load *L, int32_t priority, const char *tenant, double weight,
                       int64_t n_tokens);

/* The prediction for the same request with nothing ahead of it: the
 * groups of its priority and better removed, the worse ones kept (they
 * fill its steps). What the work ahead adds is the difference. */
double cs_ttft_predict_alone(const cs_ttft_load *L, int32_t priority, int64_t n_tokens);

/* The weight L's groups give a tenant (1 when it has none there). */
double cs_ttft_load_weight(const cs_ttft_load *L, const char *tenant);

/* The weight p's shares give a tenant (1 when not named). */
double cs_ttft_weight(const cs_sched_params *p, const char *tenant);

#ifdef __cplusplus
}
#endif
#endif
