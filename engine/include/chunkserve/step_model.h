/* chunkserve/step_model.h: an online model of how long an engine step
 * takes, for the scheduler's step-time target (cs_sched_params
 * .step_time_target_ms). A step is described by
 *   tokens  the tokens it computes (every span's),
 *   pairs   the attention work: for each span, its tokens times the context
 *           they attend on average (n_tokens * (start + (n_tokens + 1) / 2)),
 *   rows    the rows that get logits and a sample (decodes, last chunks),
 *   small   min(tokens, CS_STEP_MODEL_SMALL): the CPU's integer GEMMs cost
 *           more per token at a few tokens (each weight block unpacked per
 *           token group, no tile reuse) than at a prompt chunk's hundreds,
 *           so a decode step's extra token (a speculative draft) costs more
 *           than the prompt chunks' slope says,
 * and its time is fitted as w0 + w1 tokens + w2 pairs + w3 rows + w4 small by least
 * squares over the last CS_STEP_MODEL_WINDOW measured steps (a little ridge
 * keeps the fit defined when the steps do not vary enough). Old steps leave
 * the window, so the model follows the machine (thermal, neighbours) and
 * the mix. A fit is trusted only from a window whose token counts span a
 * factor of 2; while they do not (a steady run of decode-only steps), the
 * last trusted fit is kept. On a CPU tokens dominate (no idle compute for prefill to ride
 * on); on a GPU w0 does. Single-threaded, plain data, no allocation. */
#ifndef CHUNKSERVE_STEP_MODEL_H
#define CHUNKSERVE_STEP_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { CS_STEP_MODEL_WINDOW = 64, CS_STEP_MODEL_FEATURES = 5, CS_STEP_MODEL_SMALL = 32 };

typedef struct {
    double x[CS_STEP_MODEL_WINDOW][CS_STEP_MODEL_FEATURES]; /* scaled features of each step */
    double y[CS_STEP_MODEL_WINDOW];                         /* its seconds */
    int32_t n, head;                                        /* steps in the ring, next slot */
    double w[CS_STEP_MODEL_FEATURES];                       /* the trusted fit, scaled */
    bool fitted;                                            /* a trusted fit exists */
} cs_step_model;

void cs_step_model_init(cs_step_model *m);
/* Records one measured step and refits. */
void cs_step_model_observe(cs_step_model *m, double tokens, double pairs, double rows,
                           double seconds);
/* Predicted seconds of a step (>= 0) by the trusted fit; NAN until the
 * model is ready. */
double cs_step_model_predict(const cs_step_model *m, double tokens, double pairs, double rows);
/* Whether a trusted fit exists: one made from at least 8 steps whose token
 * counts span a factor of 2 or more, with time growing with tokens. Once
 * ready, a model stays ready (it keeps its last trusted fit). */
bool cs_step_model_ready(const cs_step_model *m);
/* The trusted fit's coefficients in seconds per unit (w0 s, w1 s/token,
 * w2 s/pair, w3 s/row, w4 s/small token); zeros before the first. */
void cs_step_model_coefficients(const cs_step_model *m, double w[CS_STEP_MODEL_FEATURES]);
/* A step's predicted seconds (>= 0) by coefficients w as
 * cs_step_model_coefficients gives them (possibly scaled): what
 * cs_step_model_predict computes, for a copy of the fit kept elsewhere. */
double cs_step_model_eval(const double w[CS_STEP_MODEL_FEATURES], double tokens, double pairs,
                          double rows);

#ifdef __cplusplus
}
#endif
#endif
