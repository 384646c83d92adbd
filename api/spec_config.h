/* spec_config.h (api/): the speculative-decoding options of every process
 * that decodes (`chunkserve serve`, the decode worker): one table, joined
 * into each one's (chunkserve/config.h), and its check. What speculation
 * does is the scheduler's (chunkserve/sched.h, speculation). */
#ifndef CHUNKSERVE_API_SPEC_CONFIG_H
#define CHUNKSERVE_API_SPEC_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "chunkserve/config.h"
#include "chunkserve/sched.h"

typedef struct {
    const char *mode;   /* --speculative: "off", "ngram" */
    int64_t num_tokens; /* --num-speculative-tokens */
} cs_spec_opts;

extern const cs_config_entry cs_spec_config[]; /* offsets in cs_spec_opts */
extern const size_t cs_spec_config_n;

/* Checks o and sets sp's speculation. CS_EINVAL naming the flag (a draft
 * model is not supported yet: refused, saying so). */
int cs_spec_opts_apply(const cs_spec_opts *o, cs_sched_params *sp);

#endif
