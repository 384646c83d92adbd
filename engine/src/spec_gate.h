/* spec_gate.h (engine/src/): whether prompt lookup's drafts pay at a
 * decode batch size, by measurement. The scheduler's cost rule picks each
 * sequence's drafts from the step model's predicted time
 * (chunkserve/step_model.h), a linear fit; a CPU's step time is not linear
 * in a few tokens (on AMX, 16 tokens fill a tile and a 17th costs a
 * quarter of the step), so at a large decode batch the rule cannot tell
 * whether drafts pay: a few pay that jump for little, many may pay it
 * well. There, once the step model is fitted, the scheduler asks the gate
 * instead, and a step of decodes alone carries either every draft found
 * (of sequences whose acceptance is not low, within the step-time target)
 * or none. The gate keeps, for each decode batch size, what each served:
 * decode tokens emitted (kept drafts included) per second of the
 * decode-only steps that carried drafts and of those that did not, and
 * chooses the one that served more (a step with prompt chunks gets that
 * choice too, with the rule's counts). The side not chosen is tried again
 * from time to time, so a change of workload or machine is seen: as
 * rarely as keeps what the retries lose (each its step's time times the
 * gap between the sides) to CS__SPEC_GATE_COST of the time, every
 * CS__SPEC_GATE_RETRY_MIN to _MAX steps of that size; a measurement taken
 * that long after its side's last weighs half the side's average. Before
 * three measurements of each side, decode-only steps draft until three
 * drafting steps are measured, then do not until three plain ones are
 * (steps with prompt chunks draft by the rule meanwhile). Below
 * CS__SPEC_GATE_MIN_DECODES decodes the rule alone decides: there a step's
 * outcome is a few sequences' luck (one answer's copied stretch, then its
 * own words), which the rule follows sequence by sequence and a
 * batch-wide average would not (gated, one stream's code edit fell from
 * 1.3x to 1.0x); and a step of a few tokens is not where the fit fails.
 * A draft model is not gated: after plain steps its KV lags, and the
 * catch-up would be charged to the drafting side. Plain data,
 * single-threaded, no allocation. */
#ifndef CS_SPEC_GATE_H
#define CS_SPEC_GATE_H

#include <stdbool.h>
#include <stdint.h>

enum {
    CS__SPEC_GATE_MIN_DECODES = 8, /* smaller decode batches are not gated */
    CS__SPEC_GATE_SIZES = 25, /* batch sizes 8-24 each their own, then 8 ranges (spec_gate.c) */
    CS__SPEC_GATE_SEEN = 3,   /* measurements of each side before the better one is chosen */
    CS__SPEC_GATE_RETRY_MIN = 16,
    CS__SPEC_GATE_RETRY_MAX = 256,
};
#define CS__SPEC_GATE_COST 0.01 /* of the time, lost to retries of the worse side */

typedef struct {
    double rate[2];   /* decode tokens per second, moving average: [0] steps without drafts,
                         [1] steps with */
    double secs[2];   /* their seconds, likewise */
    int32_t seen[2];  /* steps measured (stops counting at 1000) */
    int32_t since[2]; /* decode-only steps at this size since each side was last measured */
} cs__spec_size;

typedef struct {
    cs__spec_size size[CS__SPEC_GATE_SIZES];
} cs__spec_gate; /* zeroed: nothing measured */

/* Whether a step with n_decode decodes (>= 1) may carry drafts (always
 * below CS__SPEC_GATE_MIN_DECODES). A step with prompt chunks
 * (!decode_only) gets the better side, never a retry (it is not measured:
 * a retry there would learn nothing), and drafts while either side has
 * fewer than CS__SPEC_GATE_SEEN measurements. */
bool cs__spec_gate_allows(const cs__spec_gate *g, int32_t n_decode, bool decode_only);
/* Records a decode-only step: n_decode decodes, whether it carried drafts,
 * the tokens it emitted (at most n_decode plus the drafts kept: a sequence
 * may end on a kept draft) and its seconds. Steps with prompt chunks are
 * not recorded: their time is not the decodes'. Below
 * CS__SPEC_GATE_MIN_DECODES, nothing is. */
void cs__spec_gate_observe(cs__spec_gate *g, int32_t n_decode, bool drafted, int32_t emitted,
                           double seconds);

#endif
