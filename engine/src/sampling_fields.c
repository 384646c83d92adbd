/* sampling_fields.c: the table of scalar sampling fields
 * (chunkserve/sampling_fields.h) and the walk behind
 * cs_sampling_params_check. */
#include "chunkserve/sampling_fields.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "chunkserve/error.h"

#define AT(member) offsetof(cs_request, member)

/* clang-format off */
const cs_sampling_field cs_sampling_fields[] = {
    {.name = "temperature", .help = "sampling temperature", .openai = "temperature",
     .type = CS_FIELD_FLOAT, .lo = 0, .hi = INFINITY, .meaning = "0 = greedy",
     .off = AT(sampling.temperature)},
    {.name = "top_p",
     .help = "nucleus sampling: the most likely tokens whose probabilities sum to top-p",
     .openai = "top_p", .type = CS_FIELD_FLOAT, .lo = 0, .hi = 1, .def = 1,
     .flags = CS_FIELD_LO_OPEN | CS_FIELD_ZERO_UNSET, .meaning = "1 = off",
     .off = AT(sampling.top_p)},
    {.name = "top_k", .help = "keep the k most likely tokens", .openai = "top_k",
     .type = CS_FIELD_INT, .lo = 0, .hi = INFINITY, .flags = CS_FIELD_OFF_MINUS1,
     .meaning = "0 = off", .off = AT(sampling.top_k)},
    {.name = "min_p", .help = "drop tokens below min-p times the top probability",
     .openai = "min_p", .type = CS_FIELD_FLOAT, .lo = 0, .hi = 1, .meaning = "0 = off",
     .off = AT(sampling.min_p)},
    {.name = "repetition_penalty", .help = "penalty for tokens already seen (prompt and output)",
     .openai = "repetition_penalty", .type = CS_FIELD_FLOAT, .lo = 0, .hi = INFINITY, .def = 1,
     .flags = CS_FIELD_LO_OPEN | CS_FIELD_ZERO_UNSET, .meaning = "1 = off",
     .off = AT(sampling.repetition_penalty)},
    {.name = "presence_penalty", .help = "OpenAI presence penalty", .openai = "presence_penalty",
     .type = CS_FIELD_FLOAT, .lo = -2, .hi = 2, .meaning = "0 = off",
     .off = AT(sampling.presence_penalty)},
    {.name = "frequency_penalty", .help = "OpenAI frequency penalty", .openai = "frequency_penalty",
     .type = CS_FIELD_FLOAT, .lo = -2, .hi = 2, .meaning = "0 = off",
     .off = AT(sampling.frequency_penalty)},
    {.name = "seed", .help = "random seed for sampling", .type = CS_FIELD_U64,
     .off = AT(sampling.seed)},
    {.name = "max_tokens", .help = "tokens to generate at most", .type = CS_FIELD_INT, .lo = 0,
     .hi = INFINITY, .meaning = "0 = until the context is full", .off = AT(stop.max_tokens)},
    {.name = "min_tokens", .help = "tokens generated before a stop or end of generation may end it",
     .openai = "min_tokens", .type = CS_FIELD_INT, .lo = 0, .hi = INFINITY, .meaning = "0 = off",
     .off = AT(stop.min_tokens)},
    {.name = "ignore_eos", .help = "keep generating past end-of-generation tokens",
     .openai = "ignore_eos", .type = CS_FIELD_BOOL, .off = AT(stop.ignore_eos)},
    {.name = "include_special", .help = "keep special tokens in the text", .type = CS_FIELD_BOOL,
     .flags = CS_FIELD_NEGATE, .off = AT(stop.skip_special)},
    {.name = "logprobs", .help = "each generated token's log-probability", .type = CS_FIELD_BOOL,
     .off = AT(logprobs)},
    {.name = "top_logprobs",
     .help = "alternatives per generated token, with their log-probabilities", .type = CS_FIELD_INT,
     .lo = 0, .hi = CS_MAX_TOP_LOGPROBS, .needs = "logprobs", .off = AT(top_logprobs)},
    {.name = "prompt_logprobs", .help = "each prompt token's log-probability",
     .type = CS_FIELD_BOOL, .off = AT(prompt_logprobs)},
    {.name = "prompt_top_logprobs", .help = "alternatives per prompt token", .type = CS_FIELD_INT,
     .lo = 0, .hi = CS_MAX_TOP_LOGPROBS, .needs = "prompt_logprobs",
     .off = AT(prompt_top_logprobs)},
    {.name = "disable_speculation", .help = "no speculative drafts for this request",
     .openai = "disable_speculation", .type = CS_FIELD_BOOL, .off = AT(disable_speculation)},
    {.name = "priority", .help = "scheduling priority: lower values are served first",
     .openai = "priority", .type = CS_FIELD_INT, .lo = 0, .hi = CS_MAX_PRIORITY,
     .meaning = "0 = the highest", .off = AT(priority)},
};
/* clang-format on */
const size_t cs_n_sampling_fields = sizeof cs_sampling_fields / sizeof cs_sampling_fields[0];

const cs_sampling_field *cs_sampling_field_find(const char *name) {
    for (size_t i = 0; i < cs_n_sampling_fields; i++)
        if (!strcmp(cs_sampling_fields[i].name, name)) return &cs_sampling_fields[i];
    return NULL;
}

int cs_sampling_field_check(const cs_sampling_field *f, double v, const char *prefix) {
    if (f->type == CS_FIELD_U64 || f->type == CS_FIELD_BOOL) return 0;
    bool lo_ok = (f->flags & CS_FIELD_LO_OPEN) ? v > f->lo : v >= f->lo;
    bool hi_ok = (f->flags & CS_FIELD_HI_OPEN) ? v < f->hi : v <= f->hi;
    if (lo_ok && hi_ok && isfinite(v)) return 0;
    char field[64], range[64], more[64] = "";
    snprintf(field, sizeof field, "%s%s", prefix, f->name);
    if (isinf(f->hi))
        snprintf(range, sizeof range, "%s %g", (f->flags & CS_FIELD_LO_OPEN) ? ">" : ">=", f->lo);
    else
        snprintf(range, sizeof range, "in %c%g, %g%c", (f->flags & CS_FIELD_LO_OPEN) ? '(' : '[',
                 f->lo, f->hi, (f->flags & CS_FIELD_HI_OPEN) ? ')' : ']');
    if (f->meaning) snprintf(more, sizeof more, " (%s)", f->meaning);
    return cs_fail_field(CS_EINVAL, field, "%s must be %s%s; got %g", field, range, more, v);
}

double cs_sampling_field_get(const cs_sampling_field *f, const cs_request *q) {
    const char *p = (const char *)q + f->off;
    switch (f->type) {
    case CS_FIELD_FLOAT: return *(const float *)p;
    case CS_FIELD_INT: return *(const int32_t *)p;
    case CS_FIELD_U64: return (double)*(const uint64_t *)p;
    default: return *(const bool *)p != ((f->flags & CS_FIELD_NEGATE) != 0);
    }
}

void cs_sampling_field_set(const cs_sampling_field *f, cs_request *q, double v) {
    char *p = (char *)q + f->off;
    switch (f->type) {
    case CS_FIELD_FLOAT: *(float *)p = (float)v; break;
    case CS_FIELD_INT: *(int32_t *)p = (int32_t)v; break;
    case CS_FIELD_U64: *(uint64_t *)p = (uint64_t)v; break;
    default: *(bool *)p = (v != 0) != ((f->flags & CS_FIELD_NEGATE) != 0);
    }
}

void cs_sampling_field_set_u64(const cs_sampling_field *f, cs_request *q, uint64_t v) {
    memcpy((char *)q + f->off, &v, sizeof v);
}
