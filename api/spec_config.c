/* spec_config.c: the speculative-decoding options (spec_config.h). */
#include "spec_config.h"

#include <string.h>

#include "chunkserve/error.h"

#define S(f) offsetof(cs_spec_opts, f)
const cs_config_entry cs_spec_config[] = {
    {"speculative", CS_CONFIG_STR, S(mode), "off",
     "speculative decoding: off, or ngram (drafts looked up in the request's own context: the "
     "tokens that followed its last tokens before; no second model). Output is byte-identical "
     "either way",
     0, 0},
    {"num-speculative-tokens", CS_CONFIG_INT, S(num_tokens), "4",
     "with --speculative: drafted tokens per decode at most (each sequence gets what pays, by the "
     "step model and its acceptance rate)",
     1, CS_SCHED_SPEC_MAX},
};
const size_t cs_spec_config_n = sizeof cs_spec_config / sizeof cs_spec_config[0];
#undef S

int cs_spec_opts_apply(const cs_spec_opts *o, cs_sched_params *sp) {
    const char *m = o->mode ? o->mode : "off";
    if (o->num_tokens < 1 || o->num_tokens > CS_SCHED_SPEC_MAX)
        return cs_fail(CS_EINVAL, "--num-speculative-tokens %lld: must be in 1..%d",
                       (long long)o->num_tokens, CS_SCHED_SPEC_MAX);
    if (!strcmp(m, "off")) {
        sp->num_speculative_tokens = 0;
        return 0;
    }
    if (!strcmp(m, "ngram")) {
        sp->num_speculative_tokens = (int32_t)o->num_tokens;
        return 0;
    }
    if (!strncmp(m, "draft:", 6))
        return cs_fail(CS_EINVAL,
                       "--speculative %s: a draft model is not supported yet (use ngram)", m);
    return cs_fail(CS_EINVAL, "--speculative '%s': must be off or ngram", m);
}
