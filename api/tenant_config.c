/* tenant_config.c: the tenants' shares (tenant_config.h). */
#include "tenant_config.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"

#define T(f) offsetof(cs_tenant_opts, f)
const cs_config_entry cs_tenant_config[] = {
    {"tenant-shares", CS_CONFIG_STR, T(spec), NULL,
     "tenants' shares of the prompt tokens within a priority, NAME=WEIGHT,... (a request's "
     "tenant is its API key's; without keys, GenerateRequest.tenant or the " CS_TENANT_HEADER
     " header names it; others, and requests without one, weigh 1): each step's prompt chunks "
     "go to the tenant with the fewest tokens served per share",
     0, 0},
};
const size_t cs_tenant_config_n = sizeof cs_tenant_config / sizeof cs_tenant_config[0];
#undef T

int cs_tenant_opts_apply(cs_tenant_opts *o, cs_sched_params *sp) {
    sp->tenant_shares = o->shares;
    sp->n_tenant_shares = 0;
    const char *p = o->spec ? o->spec : "";
    int32_t n = 0;
    while (*p) {
        const char *end = strchr(p, ','), *eq;
        size_t len = end ? (size_t)(end - p) : strlen(p);
        eq = memchr(p, '=', len);
        if (!eq || eq == p || (size_t)(eq - p) > CS_TENANT_NAME_MAX)
            return cs_fail(CS_EINVAL,
                           "--tenant-shares: '%.*s' is not NAME=WEIGHT (a name of 1..%d bytes)",
                           (int)len, p, CS_TENANT_NAME_MAX);
        if (n == CS_TENANT_SHARES_MAX)
            return cs_fail(CS_EINVAL, "--tenant-shares: more than %d tenants",
                           CS_TENANT_SHARES_MAX);
        char num[32];
        size_t nl = len - (size_t)(eq + 1 - p);
        if (nl == 0 || nl >= sizeof num)
            return cs_fail(CS_EINVAL, "--tenant-shares: '%.*s' has no weight", (int)len, p);
        memcpy(num, eq + 1, nl);
        num[nl] = 0;
        char *stop;
        double w = strtod(num, &stop);
        if (*stop || !isfinite(w) || !(w >= 1e-3 && w <= 1e6))
            return cs_fail(CS_EINVAL,
                           "--tenant-shares: '%.*s': the weight must be in [0.001, 1e6]",
                           (int)len, p);
        memcpy(o->names[n], p, (size_t)(eq - p));
        o->names[n][eq - p] = 0;
        for (int32_t i = 0; i < n; i++)
            if (!strcmp(o->names[i], o->names[n]))
                return cs_fail(CS_EINVAL, "--tenant-shares: tenant '%s' is named twice",
                               o->names[n]);
        o->shares[n] = (cs_tenant_share){o->names[n], w};
        n++;
        p += len + (end != NULL);
    }
    sp->n_tenant_shares = n;
    return 0;
}
