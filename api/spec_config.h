/* spec_config.h (api/): the speculative-decoding options of every process
 * that decodes (`chunkserve serve`, the decode worker): one table, joined
 * into each one's (chunkserve/config.h), and its check. What speculation
 * does is the scheduler's (chunkserve/sched.h, speculation). */
#ifndef CHUNKSERVE_API_SPEC_CONFIG_H
#define CHUNKSERVE_API_SPEC_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/config.h"
#include "chunkserve/sched.h"

typedef struct {
    const char *mode;   /* --speculative: "off", "ngram", "draft:PATH" */
    int64_t num_tokens; /* --num-speculative-tokens */
    bool always;        /* --speculative-always */
} cs_spec_opts;

extern const cs_config_entry cs_spec_config[]; /* offsets in cs_spec_opts */
extern const size_t cs_spec_config_n;

/* Checks o and sets sp's speculation (a draft model's engine comes from
 * cs_spec_draft_open). CS_EINVAL naming the flag. */
int cs_spec_opts_apply(const cs_spec_opts *o, cs_sched_params *sp);

/* A draft model and its engine (--speculative draft:PATH). */
typedef struct {
    cs_model *model;
    cs_engine *engine;
} cs_spec_draft;

/* With draft:PATH, loads PATH (its weights held as the target's are: quantized
 * kernels or fp32), makes its engine like target's (page size, KV format,
 * threads, as many pages; draft KV is each sequence's own, not shared by
 * prefix: a sequence that finds no draft pages drafts nothing until some
 * are free) and sets sp->draft_engine; for the other modes, nothing.
 * The scheduler checks the vocabulary (chunkserve/sched.h). The model's
 * errors (cs_model_load) on failure, *d left empty. */
int cs_spec_draft_open(const cs_spec_opts *o, cs_engine *target, const cs_engine_params *ep,
                       cs_sched_params *sp, cs_spec_draft *d);
void cs_spec_draft_close(cs_spec_draft *d); /* an empty one is a no-op */

#endif
