/* slo_config.c: the TTFT bound by priority (slo_config.h). */
#include "slo_config.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/sampler.h"

#define S(f) offsetof(cs_slo_opts, f)
const cs_config_entry cs_slo_config[] = {
    {"ttft-slo-ms", CS_CONFIG_STR, S(ttft_spec), NULL,
     "bound on a request's predicted time to first token, by priority: MS for all, "
     "PRIORITY=MS for one, comma-separated (e.g. 0=500,5000); a request over it because of "
     "the work queued ahead is refused early (429 + Retry-After, gRPC RESOURCE_EXHAUSTED + "
     "RetryInfo); none = no bound",
     0, 0},
};
const size_t cs_slo_config_n = sizeof cs_slo_config / sizeof cs_slo_config[0];
#undef S

static int bad(const char *p, size_t len, const char *why) {
    return cs_fail(CS_EINVAL, "--ttft-slo-ms: '%.*s': %s", (int)len, p, why);
}

int cs_slo_opts_apply(cs_slo_opts *o) {
    o->n = 0;
    o->default_s = 0;
    const char *p = o->ttft_spec ? o->ttft_spec : "";
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char buf[64];
        if (len == 0 || len >= sizeof buf) return bad(p, len, "not MS or PRIORITY=MS");
        memcpy(buf, p, len);
        buf[len] = 0;
        char *eq = strchr(buf, '='), *stop;
        long prio = -1;
        if (eq) {
            *eq = 0;
            prio = strtol(buf, &stop, 10);
            if (stop == buf || *stop || prio < 0 || prio > CS_MAX_PRIORITY)
                return cs_fail(CS_EINVAL,
                               "--ttft-slo-ms: '%.*s': the priority must be an integer in 0..%d",
                               (int)len, p, CS_MAX_PRIORITY);
        }
        const char *num = eq ? eq + 1 : buf;
        double ms = strtod(num, &stop);
        if (stop == num || *stop || !isfinite(ms) || !(ms > 0 && ms <= 1e7))
            return bad(p, len, "the bound must be milliseconds in (0, 1e7]");
        if (!eq) {
            if (o->default_s > 0) return bad(p, len, "a second bound for every priority");
            o->default_s = ms / 1e3;
        } else {
            for (int32_t i = 0; i < o->n; i++)
                if (o->priority[i] == prio) return bad(p, len, "the priority is named twice");
            if (o->n == CS_SLO_CLASSES) return cs_fail(CS_EINVAL, "--ttft-slo-ms: more than %d priorities", CS_SLO_CLASSES);
            o->priority[o->n] = (int32_t)prio;
            o->ttft_s[o->n++] = ms / 1e3;
        }
        p += len + (end != NULL);
    }
    return 0;
}

double cs_slo_ttft_bound(const cs_slo_opts *o, int32_t priority) {
    for (int32_t i = 0; i < o->n; i++)
        if (o->priority[i] == priority) return o->ttft_s[i];
    return o->default_s;
}

int64_t cs_slo_refuse_ms(double predicted, double alone, double bound) {
    if (!(bound > 0) || !isfinite(predicted)) return 0;
    double limit = alone > bound ? alone : bound;
    if (!(predicted > limit)) return 0;
    return (int64_t)ceil((predicted - limit) * 1e3);
}
