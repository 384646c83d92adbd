/* draft.h (engine/src/): a draft model's proposals for speculation (the
 * scheduler's draft mode, chunkserve/sched.h). The draft model runs on its
 * own engine and KV pool, on the scheduler's thread, inside the step that
 * verifies what it proposes: for each sequence that drafts, one pass
 * computes the tokens its draft KV lacks (after a prefill, a migration or
 * a rejection) and proposes the first draft, then each further pass feeds
 * the last draft and proposes the next. A proposal is what the request's
 * sampler picks from the draft's logits with the random number the
 * target's sample at that position will use (cs_sampler_propose: the
 * argmax for greedy requests): a function of the tokens and the seed alone,
 * so the scheduler's check (sampling each row with the request's own
 * sampler, keeping drafts while they equal the sample) keeps the output
 * exactly the target's. */
#ifndef CS_DRAFT_H
#define CS_DRAFT_H

#include <stdint.h>

#include "chunkserve/engine.h"
#include "chunkserve/sampler.h"

/* A sequence's state in the draft model: its pages in the draft pool and how
 * many of its leading tokens have draft KV there. Zeroed: nothing yet. */
typedef struct {
    cs_page_table pt;
    int32_t n_computed;
} cs__draft_seq;

/* One sequence's part in a run. */
typedef struct {
    cs__draft_seq *ds;
    int32_t *tokens;  /* the sequence's tokens, with room for want after n_tokens */
    int32_t n_tokens; /* the last one is the decode token: its draft KV comes too */
    int32_t want;     /* drafts wanted (> 0); the run lowers it to what it plans: 0
                         when the catch-up does not finish within the room */
    int32_t got;      /* out: drafts written at tokens[n_tokens ..] (0 when the draft
                         pool had no pages, or the catch-up did not finish) */
    cs_sampler *smp;  /* the request's: proposals by cs_sampler_propose (NULL: argmax) */
} cs__draft_job;

typedef struct cs__drafter cs__drafter;

/* A drafter for target: CS_EINVAL naming both models when the draft's
 * vocabulary is not the target's (the same ids for the same bytes). The
 * draft engine must outlive the drafter. */
int cs__drafter_init(cs_engine *draft, const cs_model *target, cs__drafter **out);
void cs__drafter_free(cs__drafter *d); /* NULL is a no-op */

/* Measured cost, 0 until measured: seconds of one pass that proposes a token
 * for each sequence (no catch-up), and of a catch-up token. */
double cs__drafter_pass_seconds(const cs__drafter *d);
double cs__drafter_token_seconds(const cs__drafter *d);
/* The draft model's context: a sequence this long gets no drafts. */
int32_t cs__drafter_ctx_len(const cs__drafter *d);

/* Runs jobs[0..n): catch-up tokens (beyond each sequence's decode token; a
 * lag of up to CS_SCHED_SPEC_MAX + 1, what a check leaves, is not counted)
 * come to at most catchup in all, in job order; a job whose catch-up does
 * not finish proposes nothing, nor one that finds no draft pages (its draft
 * KV goes: rebuilt later). Writes each job's got; *seconds: the time it
 * took. A draft engine's error is logged and ends the drafts there (those
 * proposed stand); fails only when out of memory. */
int cs__drafter_run(cs__drafter *d, cs__draft_job *jobs, int32_t n, int32_t catchup,
                    double *seconds);

/* The sequence's tokens from position valid on changed (a rejected draft,
 * or never computed): its draft KV stops there, and windowed pages no
 * later query reads are given back. */
void cs__draft_seq_settle(cs__drafter *d, cs__draft_seq *ds, int32_t valid);
/* Gives the sequence's draft pages back (preemption, end). */
void cs__draft_seq_release(cs__drafter *d, cs__draft_seq *ds);

#endif
