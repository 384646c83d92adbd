/* spec_config.c: the speculative-decoding options (spec_config.h). */
#include "spec_config.h"

#include <stdio.h>
#include <string.h>

#include "chunkserve/error.h"

#define S(f) offsetof(cs_spec_opts, f)
const cs_config_entry cs_spec_config[] = {
    {"speculative", CS_CONFIG_STR, S(mode), "off",
     "speculative decoding: off; ngram (drafts looked up in the request's own context: the "
     "tokens that followed its last tokens before; no second model); or draft:PATH (a smaller "
     "model with the same vocabulary proposes them, e.g. Qwen2.5-Coder-0.5B for the 1.5B; it "
     "runs in the same steps, with its own KV pages). Output is byte-identical either way",
     0, 0},
    {"num-speculative-tokens", CS_CONFIG_INT, S(num_tokens), "4",
     "with --speculative: drafted tokens per decode at most (each sequence gets what pays, by the "
     "step model and its acceptance rate)",
     1, CS_SCHED_SPEC_MAX},
    {"speculative-always", CS_CONFIG_BOOL, S(always), "false",
     "with --speculative: draft whenever drafts are found, as many as --num-speculative-tokens "
     "allows, whatever the step model says they cost (vLLM's behaviour; for benchmarks, tests, "
     "and GPUs where a draft costs next to nothing). Off: each sequence gets the drafts that pay",
     0, 0},
};
const size_t cs_spec_config_n = sizeof cs_spec_config / sizeof cs_spec_config[0];
#undef S

int cs_spec_opts_apply(const cs_spec_opts *o, cs_sched_params *sp) {
    const char *m = o->mode ? o->mode : "off";
    if (o->num_tokens < 1 || o->num_tokens > CS_SCHED_SPEC_MAX)
        return cs_fail(CS_EINVAL, "--num-speculative-tokens %lld: must be in 1..%d",
                       (long long)o->num_tokens, CS_SCHED_SPEC_MAX);
    sp->speculative_always = o->always;
    if (!strcmp(m, "off")) {
        if (o->always)
            return cs_fail(CS_EINVAL, "--speculative-always: needs --speculative ngram or "
                                      "draft:PATH (speculation is off)");
        sp->num_speculative_tokens = 0;
        return 0;
    }
    if (!strcmp(m, "ngram")) {
        sp->num_speculative_tokens = (int32_t)o->num_tokens;
        return 0;
    }
    if (!strncmp(m, "draft:", 6)) {
        if (!m[6]) return cs_fail(CS_EINVAL, "--speculative draft: needs the draft model's path");
        sp->num_speculative_tokens = (int32_t)o->num_tokens;
        return 0;
    }
    return cs_fail(CS_EINVAL, "--speculative '%s': must be off, ngram or draft:PATH", m);
}

int cs_spec_draft_open(const cs_spec_opts *o, cs_engine *target, const cs_engine_params *ep,
                       cs_sched_params *sp, cs_spec_draft *d) {
    *d = (cs_spec_draft){0};
    if (!o->mode || strncmp(o->mode, "draft:", 6) != 0) return 0;
    const char *path = o->mode + 6;
    const cs_model *tm = cs_engine_model(target);
    char why[512];
    int r = cs_model_load_mode(path, cs_model_weight_mode(tm), &d->model);
    cs_engine_params dp = *ep;
    dp.n_pages = cs_kv_cache_n_pages(cs_engine_kv(target));
    if (!r) r = cs_engine_init(d->model, &dp, &d->engine);
    if (r) {
        snprintf(why, sizeof why, "%s", cs_last_error());
        cs_spec_draft_close(d);
        return cs_fail(r, "--speculative draft:%s: %s", path, why);
    }
    sp->draft_engine = d->engine;
    return 0;
}

void cs_spec_draft_close(cs_spec_draft *d) {
    cs_engine_free(d->engine);
    cs_model_free(d->model);
    *d = (cs_spec_draft){0};
}
