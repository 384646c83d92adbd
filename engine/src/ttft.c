/* ttft.c: time to first token predicted at admission (chunkserve/ttft.h). */
#include "chunkserve/ttft.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char *name_of(const char *tenant) {
    return tenant ? tenant : "";
}

void cs_ttft_load_add(cs_ttft_load *L, int32_t priority, const char *tenant, double weight,
                      int64_t tokens) {
    if (tokens < 0) return;
    tenant = name_of(tenant);
    for (int32_t i = 0; i < L->n_groups; i++) {
        cs_ttft_group *g = &L->groups[i];
        if (g->priority == priority && !strcmp(g->tenant, tenant)) {
            g->tokens += tokens;
            return;
        }
    }
    if (L->n_groups == CS_TTFT_GROUPS) {
        L->overflow_tokens += tokens;
        return;
    }
    cs_ttft_group *g = &L->groups[L->n_groups++];
    g->priority = priority;
    snprintf(g->tenant, sizeof g->tenant, "%s", tenant);
    g->weight = weight > 0 ? weight : 1;
    g->tokens = tokens;
}

double cs_ttft_predict_alone(const cs_ttft_load *L, int32_t priority, int64_t n_tokens) {
    cs_ttft_load A = *L;
    A.n_groups = 0;
    A.overflow_tokens = 0;
    double dropped = (double)L->overflow_tokens;
    for (int32_t i = 0; i < L->n_groups; i++)
        if (L->groups[i].priority > priority)
            A.groups[A.n_groups++] = L->groups[i];
        else
            dropped += (double)L->groups[i].tokens;
    /* the running step's tokens come first out of what was dropped */
    A.in_step_tokens = L->in_step_tokens > dropped ? L->in_step_tokens - dropped : 0;
    return cs_ttft_predict(&A, priority, NULL, 1, n_tokens);
}

double cs_ttft_weight(const cs_sched_params *p, const char *tenant) {
    tenant = name_of(tenant);
    for (int32_t i = 0; i < p->n_tenant_shares; i++)
        if (!strcmp(p->tenant_shares[i].name, tenant)) return p->tenant_shares[i].weight;
    return 1;
}

double cs_ttft_load_tokens(const cs_ttft_load *L) {
    double all = (double)L->overflow_tokens;
    for (int32_t i = 0; i < L->n_groups; i++)
        all += (double)L->groups[i].tokens;
    return all;
}

double cs_ttft_step_s(const cs_ttft_load *L, double chunk, double rows) {
    if (!L->ready) return 0;
    double pairs = L->dec_pairs + chunk * (L->position + (chunk + 1) / 2);
    return cs_step_model_eval(L->w, L->dec_tokens + chunk, pairs, L->dec_rows + rows);
}

double cs_ttft_load_weight(const cs_ttft_load *L, const char *tenant) {
    tenant = name_of(tenant);
    for (int32_t i = 0; i < L->n_groups; i++)
        if (!strcmp(L->groups[i].tenant, tenant)) return L->groups[i].weight;
    return 1;
}

double cs_ttft_work(const cs_ttft_load *L, int32_t priority, const char *tenant, double weight,
                    int64_t n_tokens) {
    tenant = name_of(tenant);
    if (!(weight > 0)) weight = 1;
    double q = (double)n_tokens; /* its tenant's work at its priority, its prompt last */
    for (int32_t i = 0; i < L->n_groups; i++) {
        const cs_ttft_group *g = &L->groups[i];
        if (g->priority == priority && !strcmp(g->tenant, tenant)) q += (double)g->tokens;
    }
    double work = q + (double)L->overflow_tokens;
    for (int32_t i = 0; i < L->n_groups; i++) {
        const cs_ttft_group *g = &L->groups[i];
        if (g->priority < priority) {
            work += (double)g->tokens;
        } else if (g->priority == priority && strcmp(g->tenant, tenant) != 0) {
            double fair = q * g->weight / weight;
            work += (double)g->tokens < fair ? (double)g->tokens : fair;
        }
    }
    /* the running step computes in_step_tokens of the queue: ahead of everyone */
    double ahead = work - (double)n_tokens - L->in_step_tokens;
    return (double)n_tokens + (ahead > 0 ? ahead : 0);
}

double cs_ttft_predict(const cs_ttft_load *L, int32_t priority, const char *tenant, double weight,
                       int64_t n_tokens) {
    if (!L->ready || !(L->chunk_tokens >= 1)) return NAN;
    double work = cs_ttft_work(L, priority, tenant, weight, n_tokens);
    double all = cs_ttft_load_tokens(L) - L->in_step_tokens;
    all = (double)n_tokens + (all > 0 ? all : 0);
    const double c = L->chunk_tokens;
    double steps = ceil(work / c);
    /* full steps while anything is queued, whoever's; the last one ends the prompt */
    double last = (all < steps * c ? all : steps * c) - (steps - 1) * c;
    return L->residual_s + (steps - 1) * cs_ttft_step_s(L, c, 0) + cs_ttft_step_s(L, last, 1);
}
