/* tenant_config.h (api/): the tenants' shares of every process that
 * schedules prompts (`chunkserve serve`, the prefill and decode workers):
 * one flag, joined into each one's table (chunkserve/config.h), and its
 * parse. What the shares do is the scheduler's (chunkserve/sched.h,
 * tenants). */
#ifndef CHUNKSERVE_API_TENANT_CONFIG_H
#define CHUNKSERVE_API_TENANT_CONFIG_H

#include <stddef.h>

#include "chunkserve/config.h"
#include "chunkserve/sched.h"

enum { CS_TENANT_SHARES_MAX = 64 }; /* tenants the flag may name */

typedef struct {
    const char *spec; /* --tenant-shares: "NAME=WEIGHT,..." or NULL */
    /* parsed by cs_tenant_opts_apply (sp points into them) */
    cs_tenant_share shares[CS_TENANT_SHARES_MAX];
    char names[CS_TENANT_SHARES_MAX][CS_TENANT_NAME_MAX + 1];
} cs_tenant_opts;

extern const cs_config_entry cs_tenant_config[]; /* offsets in cs_tenant_opts */
extern const size_t cs_tenant_config_n;

/* Parses o->spec into o's arrays and points sp's tenant shares at them (o
 * must outlive cs_sched_init, which copies them). CS_EINVAL naming the flag
 * and the entry: not NAME=WEIGHT, a name of 0 or more than
 * CS_TENANT_NAME_MAX bytes, a weight outside [0.001, 1e6], more than
 * CS_TENANT_SHARES_MAX entries, a name twice. */
int cs_tenant_opts_apply(cs_tenant_opts *o, cs_sched_params *sp);

/* The HTTP header a request names its tenant in (OpenAI door). */
#define CS_TENANT_HEADER "X-Chunkserve-Tenant"

#endif
