/* config-impl.h: what config.c shares with config_env.c. */
#ifndef CHUNKSERVE_PROC_CONFIG_IMPL_H
#define CHUNKSERVE_PROC_CONFIG_IMPL_H

#include <stddef.h>

#include "chunkserve/config.h"

/* "max-batched-tokens" -> "CHUNKSERVE_MAX_BATCHED_TOKENS" (truncated to cap). */
void cs__config_env_name(const char *name, char *out, size_t cap);

/* Refuses a set CHUNKSERVE_* variable that no chunkserve process or tool
 * reads (a typo): CS_EINVAL naming it and the nearest name this process
 * knows. A variable that is a flag of another chunkserve process (the
 * environment `chunkserve cluster up` passes on is shared) or one read
 * outside the tables (CHUNKSERVE_BACKEND, the scripts' and tests') is
 * left alone. */
int cs__config_check_env(const cs_config_entry *table, size_t n);

#endif
