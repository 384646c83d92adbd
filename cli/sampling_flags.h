/* sampling_flags.h (cli/): the sampling flags of `chunkserve generate`, one
 * per field of cs_sampling_params in the sampling table
 * (chunkserve/sampling_fields.h): the field's name with dashes ("top-p"),
 * its default, its help and bounds in the text. A new sampling field is a
 * flag here with nothing written for it. */
#ifndef CS_CLI_SAMPLING_FLAGS_H
#define CS_CLI_SAMPLING_FLAGS_H

#include <stddef.h>
#include <stdint.h>

#include "chunkserve/config.h"
#include "chunkserve/sampler.h"

enum { CS_CLI_SAMPLING_MAX = 16 };

/* Where cs_config_parse writes the flags: one slot per table row, d[k] for a
 * FLOAT row, i[k] for an INT or U64 one (the seed: -1 is 2^64 - 1). */
typedef struct {
    double d[CS_CLI_SAMPLING_MAX];
    int64_t i[CS_CLI_SAMPLING_MAX];
} cs_cli_sampling;

/* The flags' entries, relative to a cs_cli_sampling (a cs_config_part of
 * the CLI's table); built on the first call. */
const cs_config_entry *cs_cli_sampling_table(size_t *n);
/* The parsed flags as sampling parameters (checked by the sampler's init). */
cs_sampling_params cs_cli_sampling_params(const cs_cli_sampling *f);

#endif
