/* sampler.c: token selection. Order of operations follows vLLM: penalties on
 * raw logits, then logit_bias, the min_tokens suppression and a structured output's mask
 * (tokens it does not allow at -inf), temperature, then top-k / min-p / top-p on probabilities,
 * then one number from the sequence's counter-based splitmix64 stream (seed, token index). */
#include "chunkserve/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/sampling_fields.h"
#include "util.h"

struct cs_sampler {
    cs_sampling_params p;
    int32_t n_vocab;
    int64_t n_generated; /* tokens accepted with cs_sampler_accept: the draw counter */
    uint8_t *seen;       /* (n_vocab) token in prompt or output; NULL without repetition penalty */
    int32_t *counts;     /* (n_vocab) output count; NULL without presence/frequency penalty */
    int32_t *idx;        /* (n_vocab) scratch for sorting */
    float *raw;          /* (n_vocab) raw logits kept for logprobs; allocated on first use */
    int32_t *suppress;   /* (n_suppress) ids masked while n_generated < min_tokens */
    int32_t *bias_ids;   /* (p.n_bias) logit_bias, copied (p's pointers point here) */
    float *bias;
    size_t n_suppress;
    int32_t min_tokens;
};

cs_sampling_params cs_sampling_params_default(void) {
    cs_request q = {0}; /* the table's defaults (sampling_fields.c) */
    const size_t lo = offsetof(cs_request, sampling), hi = lo + sizeof q.sampling;
    for (size_t i = 0; i < cs_n_sampling_fields; i++)
        if (cs_sampling_fields[i].off >= lo && cs_sampling_fields[i].off < hi)
            cs_sampling_field_set(&cs_sampling_fields[i], &q, cs_sampling_fields[i].def);
    return q.sampling;
}

int cs_sampling_params_check(const cs_sampling_params *p) {
    /* the scalar fields by their one definition (sampling_fields.c) */
    const cs_request q = {.sampling = *p};
    const size_t lo = offsetof(cs_request, sampling), hi = lo + sizeof q.sampling;
    for (size_t i = 0; i < cs_n_sampling_fields; i++) {
        const cs_sampling_field *f = &cs_sampling_fields[i];
        if (f->off < lo || f->off >= hi) continue;
        int r = cs_sampling_field_check(f, cs_sampling_field_get(f, &q), "");
        if (r) return r;
    }
    if (p->n_bias < 0 || p->n_bias > CS_MAX_LOGIT_BIAS || (p->n_bias && (!p->bias_ids || !p->bias)))
        return cs_fail_field(CS_EINVAL, "logit_bias",
                             "logit_bias has %d entries; at most %d are allowed", p->n_bias,
                             CS_MAX_LOGIT_BIAS);
    for (int32_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0)
            return cs_fail_field(CS_EINVAL, "logit_bias", "logit_bias token %d is not a token id",
                                 p->bias_ids[i]);
        if (!(p->bias[i] >= -100 && p->bias[i] <= 100))
            return cs_fail_field(CS_EINVAL, "logit_bias",
                                 "logit_bias of token %d is %g; it must be in [-100, 100]",
                                 p->bias_ids[i], p->bias[i]);
    }
    return 0;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int cs_sampler_init(const cs_sampling_params *p, int32_t n_vocab, cs_sampler **out) {
    *out = NULL;
    int r = cs_sampling_params_check(p);
    if (r) return r;
    if (n_vocab < 1) return cs_fail(CS_EINVAL, "sampler: vocabulary size %d", n_vocab);
    cs_sampler *s = calloc(1, sizeof *s);
    if (!s) return cs_fail(CS_ENOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    for (int32_t i = 0; i < p->n_bias; i++)
        if (p->bias_ids[i] >= n_vocab) {
            free(s);
            return cs_fail(CS_EINVAL, "logit_bias token %d is outside the vocabulary (0..%d)",
                           p->bias_ids[i], n_vocab - 1);
        }
    bool ok = true;
    if (p->n_bias) {
        ok &= (s->bias_ids = malloc((size_t)p->n_bias * sizeof *s->bias_ids)) != NULL;
        ok &= (s->bias = malloc((size_t)p->n_bias * sizeof *s->bias)) != NULL;
        if (ok) {
            memcpy(s->bias_ids, p->bias_ids, (size_t)p->n_bias * sizeof *s->bias_ids);
            memcpy(s->bias, p->bias, (size_t)p->n_bias * sizeof *s->bias);
        }
    }
    s->p.bias_ids = s->bias_ids, s->p.bias = s->bias;
    if (p->repetition_penalty != 1.0f) ok &= (s->seen = calloc((size_t)n_vocab, 1)) != NULL;
    if (p->presence_penalty != 0 || p->frequency_penalty != 0)
        ok &= (s->counts = calloc((size_t)n_vocab, sizeof *s->counts)) != NULL;
    ok &= (s->idx = malloc((size_t)n_vocab * sizeof *s->idx)) != NULL;
    if (!ok) {
        cs_sampler_free(s);
        return cs_fail(CS_ENOMEM, "sampler: out of memory");
    }
    *out = s;
    return 0;
}

void cs_sampler_free(cs_sampler *s) {
    if (!s) return;
    free(s->seen);
    free(s->counts);
    free(s->idx);
    free(s->raw);
    free(s->suppress);
    free(s->bias_ids);
    free(s->bias);
    free(s);
}

int cs_sampler_suppress(cs_sampler *s, const int32_t *ids, size_t n, int32_t min_tokens) {
    int32_t *c = malloc((n ? n : 1) * sizeof *c);
    if (!c) return cs_fail(CS_ENOMEM, "sampler: out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < s->n_vocab) c[k++] = ids[i];
    free(s->suppress);
    s->suppress = c;
    s->n_suppress = k;
    s->min_tokens = min_tokens;
    return 0;
}

void cs_sampler_accept_prompt(cs_sampler *s, const int32_t *ids, size_t n) {
    if (!s->seen) return;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < s->n_vocab) s->seen[ids[i]] = 1;
}

void cs_sampler_accept(cs_sampler *s, int32_t id) {
    if (id < 0 || id >= s->n_vocab) return;
    s->n_generated++;
    if (id < 0 || id >= s->n_vocab) return;
    if (s->seen) s->seen[id] = 1;
    if (s->counts) s->counts[id]++;
}

/* The random number for the token ahead tokens after the next: the
 * (n_generated + ahead)-th output of a splitmix64 stream started at the
 * seed (counter-based, no state). */
static uint64_t draw(const cs_sampler *s, int64_t ahead) {
    uint64_t x = s->p.seed + 0x9E3779B97F4A7C15ull * (uint64_t)(s->n_generated + ahead);
    return splitmix64(&x);
}

static int by_prob_desc(const void *a, const void *b, void *keys) {
    const float *k = keys;
    float x = k[*(const int32_t *)a], y = k[*(const int32_t *)b];
    if (x != y) return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

int32_t cs_argmax(const float *v, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* lp from the raw logits: log-softmax in double, the top n_top by one pass of
 * insertion into a short sorted list (n_top <= 20: cheaper than a sort). */
static void raw_logprobs(const float *raw, int32_t n, int32_t chosen, int32_t n_top,
                         cs_logprobs *lp) {
    float mx = raw[cs_argmax(raw, n)];
    double sum = 0;
    for (int32_t i = 0; i < n; i++)
        sum += exp((double)(raw[i] - mx));
    float ls = (float)log(sum);
    lp->logprob = raw[chosen] - mx - ls;
    if (n_top < 0) n_top = 0;
    if (n_top > CS_MAX_TOP_LOGPROBS) n_top = CS_MAX_TOP_LOGPROBS;
    if (n_top > n) n_top = n;
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        if (k == n_top && (k == 0 || !(raw[i] > raw[lp->top_ids[k - 1]]))) continue;
        int32_t j = k < n_top ? k++ : k - 1; /* the slot freed at the end */
        while (j > 0 && raw[i] > raw[lp->top_ids[j - 1]]) {
            lp->top_ids[j] = lp->top_ids[j - 1];
            j--;
        }
        lp->top_ids[j] = i;
    }
    lp->n_top = k;
    for (int32_t j = 0; j < k; j++)
        lp->top_logprobs[j] = raw[lp->top_ids[j]] - mx - ls;
}

void cs_prompt_logprob_of(const float *logits, int32_t n_vocab, int32_t token, int32_t n_top,
                          cs_prompt_logprob *out) {
    out->token = token;
    raw_logprobs(logits, n_vocab, token, n_top, &out->lp);
    int32_t above = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        above += logits[i] > logits[token];
    out->rank = above + 1;
}

/* Whether some allowed token is outside the suppressed ones. */
static bool allowed_outside(const uint32_t *allow, int32_t n, const int32_t *sup, size_t n_sup) {
    for (int32_t w = 0; w < (n + 31) / 32; w++)
        for (uint32_t bits = allow[w]; bits; bits &= bits - 1) {
            int32_t id = w * 32 + __builtin_ctz(bits);
            size_t k = 0;
            while (k < n_sup && sup[k] != id)
                k++;
            if (k == n_sup) return true;
        }
    return false;
}

/* The filters' candidates: into s->idx, the first c tokens of the vocabulary
 * in the order (probability desc, id asc), for a c that holds every token
 * top-k, min-p and top-p can keep; returns c. probs are the unnormalized
 * probabilities (the largest is 1), sum their total in id order.
 *
 * Sorting the whole vocabulary (152k ids on Qwen) cost ~20 ms a token, so
 * only the tokens whose probability's binary exponent is at least a cut
 * are gathered and sorted: every token below the cut is less likely than
 * every token above, so they are that order's first c. The cut comes from
 * a histogram of the exponents: the highest that holds the top k, every
 * token at or above min_p, and (when neither cuts) enough mass for top-p;
 * if the mass read from the histogram proves short, every token. */
/* A non-negative float's biased binary exponent (0 for 0 and subnormals):
 * larger floats never have smaller ones. */
static inline uint32_t exponent(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return (b >> 23) & 0xff;
}

static int32_t candidates(cs_sampler *s, const float *probs, int32_t n, double sum) {
    const cs_sampling_params *p = &s->p;
    const int32_t k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    const bool by_mass = k == n && p->min_p <= 0 && p->top_p < 1; /* top-p alone */
    int32_t count[256] = {0};
    double mass[256] = {0};
    float pmax = 0;
    for (int32_t i = 0; i < n; i++) {
        const uint32_t e = exponent(probs[i]);
        count[e]++;
        if (by_mass) mass[e] += probs[i];
        if (probs[i] > pmax) pmax = probs[i];
    }
    int32_t cut = 0; /* gather the exponents >= cut; 0: every token */
    if (k < n) {     /* the highest cut holding k tokens */
        cut = 255;
        for (int32_t have = count[cut]; have < k && cut > 0;)
            have += count[--cut];
    }
    if (p->min_p > 0) { /* every token >= min_p * pmax: the exponent of that bound */
        const int32_t e = (int32_t)exponent(p->min_p * pmax);
        /* top-k and min-p together keep the fewer: either cut holds them */
        if (k == n || e > cut) cut = e;
    } else if (by_mass) { /* its mass, with a margin for the sums' order */
        double need = p->top_p * sum * (1 + 1e-9), have = 0;
        cut = 256;
        while (have < need && cut > 0)
            have += mass[--cut];
    }
    for (;;) {
        int32_t c = 0;
        for (int32_t i = 0; i < n; i++)
            if ((int32_t)exponent(probs[i]) >= cut) s->idx[c++] = i;
        qsort_r(s->idx, (size_t)c, sizeof *s->idx, by_prob_desc, (void *)probs);
        if (cut == 0 || !by_mass) return c;
        double acc = 0; /* top-p alone: does the walk end inside? */
        for (int32_t i = 0; i < c; i++)
            if ((acc += probs[s->idx[i]]) >= p->top_p * sum) return c;
        cut = 0; /* the histogram's mass was short (the sums' order; NaN): every token */
    }
}

/* Temperature, the filters and the pick by the sequence's random number for
 * its token `ahead` tokens from now: the first n logits become the
 * unnormalized probabilities (scratch). */
static int32_t pick(cs_sampler *s, float *logits, int32_t n, int64_t ahead) {
    const cs_sampling_params *p = &s->p;
    int32_t chosen;
    float mx = logits[cs_argmax(logits, n)];
    double sum = 0;
    for (int32_t i = 0; i < n; i++) {
        logits[i] = expf((logits[i] - mx) / p->temperature); /* now unnormalized probs */
        sum += logits[i];
    }
    int32_t m = n;
    bool filter = p->top_k > 0 || p->top_p < 1 || p->min_p > 0;
    if (filter) {
        int32_t c = candidates(s, logits, n, sum);
        if (p->top_k > 0 && p->top_k < m) m = p->top_k;
        if (p->min_p > 0) {
            float cut = p->min_p * logits[s->idx[0]];
            int32_t k = 1;
            while (k < m && k < c && logits[s->idx[k]] >= cut)
                k++;
            m = k;
        }
        /* nothing cut by top-k or min-p: the whole vocabulary's total, in id
         * order (no sort of every token needed) */
        double kept = sum;
        if (m < n) {
            CS_ASSERT(m <= c);
            kept = 0;
            for (int32_t i = 0; i < m; i++)
                kept += logits[s->idx[i]];
        }
        if (p->top_p < 1) {
            double acc = 0;
            int32_t k = 0;
            while (k < m) {
                CS_ASSERT(k < c);
                acc += logits[s->idx[k++]];
                if (acc >= p->top_p * kept) break;
            }
            m = k;
            kept = acc;
        }
        sum = kept;
    }
    double u = (double)(draw(s, ahead) >> 11) * (1.0 / 9007199254740992.0) * sum;
    double acc = 0;
    chosen = filter ? s->idx[m - 1] : n - 1;
    for (int32_t i = 0; i < m; i++) {
        int32_t id = filter ? s->idx[i] : i;
        acc += logits[id];
        if (u < acc) {
            chosen = id;
            break;
        }
    }
    return chosen;
}

int32_t cs_sampler_sample(cs_sampler *s, float *logits, int32_t n_top, cs_logprobs *lp) {
    return cs_sampler_sample_allowed(s, logits, NULL, n_top, lp);
}

int32_t cs_sampler_sample_allowed(cs_sampler *s, float *logits, const uint32_t *allow,
                                  int32_t n_top, cs_logprobs *lp) {
    const int32_t n = s->n_vocab;
    const cs_sampling_params *p = &s->p;
    if (lp && !s->raw && !(s->raw = malloc((size_t)n * sizeof *s->raw))) {
        *lp = (cs_logprobs){0}; /* out of memory: report nothing rather than fail the step */
        lp = NULL;
    }
    if (lp) memcpy(s->raw, logits, (size_t)n * sizeof *s->raw);
    int32_t chosen;
    if (s->seen)
        for (int32_t i = 0; i < n; i++)
            if (s->seen[i])
                logits[i] = logits[i] > 0 ? logits[i] / p->repetition_penalty
                                          : logits[i] * p->repetition_penalty;
    if (s->counts)
        for (int32_t i = 0; i < n; i++)
            if (s->counts[i])
                logits[i] -= p->frequency_penalty * (float)s->counts[i] + p->presence_penalty;
    for (int32_t i = 0; i < p->n_bias; i++) /* in the given order: a repeated id adds twice */
        logits[p->bias_ids[i]] += p->bias[i];
    /* min_tokens yields to a grammar that allows nothing else (its output is complete) */
    if (s->n_generated < s->min_tokens &&
        (!allow || allowed_outside(allow, n, s->suppress, s->n_suppress)))
        for (size_t i = 0; i < s->n_suppress; i++)
            logits[s->suppress[i]] = -INFINITY;
    if (allow)
        for (int32_t i = 0; i < n; i++)
            if (!((allow[i / 32] >> (i % 32)) & 1)) logits[i] = -INFINITY;

    if (p->temperature == 0) {
        chosen = cs_argmax(logits, n);
    } else {
        chosen = pick(s, logits, n, 0);
    }
    if (lp) raw_logprobs(s->raw, n, chosen, n_top, lp);
    return chosen;
}

int32_t cs_sampler_propose(cs_sampler *s, float *logits, int32_t n, int32_t ahead) {
    if (n > s->n_vocab) n = s->n_vocab;
    if (s->p.temperature == 0) return cs_argmax(logits, n);
    return pick(s, logits, n, ahead);
}
