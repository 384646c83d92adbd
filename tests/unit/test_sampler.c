/* test_sampler: parameter checks, greedy ties, the filters (top-k, top-p,
 * min-p), penalties, logit_bias, reproducibility from the seed and RNG state
 * transfer; the filters against a reference that sorts the whole vocabulary. */
#include <stdint.h>

#include "chunkserve/sampler.h"
#include "test.h"

#define V 8

/* ---- the reference: the filters by a sort of every token (what the
 * sampler did before it sorted only the candidates) ---- */

static uint64_t ref_draw(uint64_t seed, int64_t n_generated) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (uint64_t)n_generated + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int by_prob_desc(const void *a, const void *b, void *keys) {
    const float *k = keys;
    float x = k[*(const int32_t *)a], y = k[*(const int32_t *)b];
    if (x != y) return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

/* The token a temperature > 0 request with filters draws from logits (n,
 * overwritten) at its n_generated-th token. When no top-k or min-p cut
 * applies, top-p's mass is measured against the total in id order. */
static int32_t ref_sample(const cs_sampling_params *p, float *l, int32_t n, int64_t n_generated) {
    float mx = l[0];
    for (int32_t i = 1; i < n; i++)
        if (l[i] > mx) mx = l[i];
    double sum = 0;
    for (int32_t i = 0; i < n; i++) {
        l[i] = expf((l[i] - mx) / p->temperature);
        sum += l[i];
    }
    int32_t *idx = malloc((size_t)n * sizeof *idx);
    ASSERT_TRUE(idx);
    for (int32_t i = 0; i < n; i++)
        idx[i] = i;
    qsort_r(idx, (size_t)n, sizeof *idx, by_prob_desc, l);
    int32_t m = n;
    if (p->top_k > 0 && p->top_k < m) m = p->top_k;
    if (p->min_p > 0) {
        float cut = p->min_p * l[idx[0]];
        int32_t k = 1;
        while (k < m && l[idx[k]] >= cut)
            k++;
        m = k;
    }
    double kept = sum;
    if (m < n) {
        kept = 0;
        for (int32_t i = 0; i < m; i++)
            kept += l[idx[i]];
    }
    if (p->top_p < 1) {
        double acc = 0;
        int32_t k = 0;
        while (k < m) {
            acc += l[idx[k++]];
            if (acc >= p->top_p * kept) break;
        }
        m = k;
        kept = acc;
    }
    double u = (double)(ref_draw(p->seed, n_generated) >> 11) * (1.0 / 9007199254740992.0) * kept;
    double acc = 0;
    int32_t chosen = idx[m - 1];
    for (int32_t i = 0; i < m; i++) {
        acc += l[idx[i]];
        if (u < acc) {
            chosen = idx[i];
            break;
        }
    }
    free(idx);
    return chosen;
}

/* Random logits of several shapes: flat, peaked, a few spikes, ties,
 * tokens at -inf, a vocabulary of 1 to ~40k. */
static uint64_t rng = 88172645463325252ull;
static uint64_t next_u64(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}
static float uniform(void) {
    return (float)(next_u64() >> 40) / (float)(1 << 24);
}

static void check_filters_against_the_reference(void) {
    const int cases = 3000;
    int32_t checked = 0, cut_by_mass = 0;
    for (int c = 0; c < cases; c++) {
        int32_t n =
            c % 10 == 0 ? 1 + (int32_t)(next_u64() % 40000) : 1 + (int32_t)(next_u64() % 3000);
        float *l = malloc((size_t)n * sizeof *l), *a = malloc((size_t)n * sizeof *a);
        ASSERT_TRUE(l && a);
        int shape = c % 5;
        float scale = shape == 0 ? 0.5f : shape == 1 ? 4 : 12;
        for (int32_t i = 0; i < n; i++) {
            l[i] = (uniform() - 0.5f) * scale;
            if (shape == 2 && next_u64() % 50 == 0) l[i] += 10;
            if (shape == 3) l[i] = (float)(int)(l[i]); /* many ties */
            if (shape == 4 && next_u64() % 3 == 0) l[i] = -INFINITY;
        }
        if (shape == 4) l[next_u64() % (uint64_t)n] = 1; /* one finite at least */
        cs_sampling_params p = cs_sampling_params_default();
        p.temperature = 0.2f + 1.8f * uniform();
        p.seed = next_u64();
        int f = (int)(next_u64() % 7);
        if (f & 1) p.top_k = 1 + (int32_t)(next_u64() % (uint64_t)(n + 5));
        if (f & 2) p.top_p = 0.05f + 0.95f * uniform();
        if (f & 4) p.min_p = uniform() * 0.5f;
        if (f == 0) p.top_p = 0.999f;
        cut_by_mass += !(f & 1) && !(f & 4);
        cs_sampler *s = NULL;
        ASSERT_EQ_INT(cs_sampler_init(&p, n, &s), 0);
        int64_t skip = (int64_t)(next_u64() % 5);
        for (int64_t i = 0; i < skip; i++)
            cs_sampler_accept(s, 0);
        memcpy(a, l, (size_t)n * sizeof *l);
        int32_t got = cs_sampler_sample(s, a, 0, NULL);
        int32_t want = ref_sample(&p, l, n, skip);
        if (got != want)
            fprintf(stderr, "case %d: n %d T %g top_k %d top_p %g min_p %g: %d != %d\n", c, n,
                    p.temperature, p.top_k, p.top_p, p.min_p, got, want);
        ASSERT_EQ_INT(got, want);
        checked++;
        cs_sampler_free(s);
        free(l);
        free(a);
    }
    printf("filters: %d cases equal to the full sort's (%d by top-p alone)\n", checked,
           cut_by_mass);
}

static int32_t sample_with(cs_sampling_params p, const float *logits_in, cs_sampler *s) {
    float l[V];
    memcpy(l, logits_in, sizeof l);
    (void)p;
    return cs_sampler_sample(s, l, 0, NULL);
}

int main(void) {
    cs_sampling_params p = cs_sampling_params_default();
    ASSERT_EQ_INT(cs_sampling_params_check(&p), 0);
    cs_sampling_params bad = p;
    bad.temperature = -1;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "temperature");
    bad = p, bad.top_p = 0;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    bad = p, bad.top_p = 1.5f;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    bad = p, bad.top_k = -1;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    bad = p, bad.min_p = 2;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    bad = p, bad.repetition_penalty = 0;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    bad = p, bad.presence_penalty = 3;
    ASSERT_EQ_INT(cs_sampling_params_check(&bad), CS_EINVAL);
    cs_sampler *s = NULL;
    ASSERT_EQ_INT(cs_sampler_init(&bad, V, &s), CS_EINVAL);
    ASSERT_TRUE(s == NULL);

    const float logits[V] = {1, 3, 3, 0, -1, 2, 0.5f, -2};
    /* greedy: first of the tied maxima */
    ASSERT_EQ_INT(cs_sampler_init(&p, V, &s), 0);
    ASSERT_EQ_INT(sample_with(p, logits, s), 1);
    cs_logprobs lp;
    float l2[V];
    memcpy(l2, logits, sizeof l2);
    ASSERT_EQ_INT(cs_sampler_sample(s, l2, 0, &lp), 1);
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp(logits[i]);
    ASSERT_NEAR(lp.logprob, 3 - log(z), 1e-5);
    ASSERT_EQ_INT(lp.n_top, 0);
    /* top logprobs: most likely first, the lower id first on ties; raw */
    memcpy(l2, logits, sizeof l2);
    ASSERT_EQ_INT(cs_sampler_sample(s, l2, 4, &lp), 1);
    ASSERT_EQ_INT(lp.n_top, 4);
    const int32_t want_top[4] = {1, 2, 5, 0};
    for (int i = 0; i < 4; i++) {
        ASSERT_EQ_INT(lp.top_ids[i], want_top[i]);
        ASSERT_NEAR(lp.top_logprobs[i], logits[want_top[i]] - log(z), 1e-5);
    }
    ASSERT_TRUE(lp.top_logprobs[0] == lp.logprob); /* the same formula, the same bits */
    memcpy(l2, logits, sizeof l2);
    ASSERT_EQ_INT(cs_sampler_sample(s, l2, 99, &lp), 1); /* clamped to the vocabulary */
    ASSERT_EQ_INT(lp.n_top, V);
    for (int i = 1; i < V; i++)
        ASSERT_TRUE(lp.top_logprobs[i] <= lp.top_logprobs[i - 1]);
    ASSERT_EQ_INT(lp.top_ids[V - 1], 7);
    cs_sampler_free(s);

    /* logit_bias: added after the penalties (greedy too), copied at init,
     * logprobs raw; checked: range, ids, count */
    {
        int32_t ids[3] = {1, 2, 4};
        float bias[3] = {-100, -0.5f, 4.5f};
        cs_sampling_params b = p;
        b.bias_ids = ids, b.bias = bias, b.n_bias = 3;
        ASSERT_EQ_INT(cs_sampler_init(&b, V, &s), 0);
        ids[2] = 0, bias[2] = 0; /* the sampler kept its own copy */
        memcpy(l2, logits, sizeof l2);
        ASSERT_EQ_INT(cs_sampler_sample(s, l2, 1, &lp), 4); /* -1 + 4.5 beats 2.5 and 2 */
        ASSERT_NEAR(lp.logprob, -1 - log(z), 1e-5);         /* raw */
        ASSERT_EQ_INT(lp.top_ids[0], 1);
        cs_sampler_free(s);
        ids[2] = 4, bias[2] = 100.5f;
        ASSERT_EQ_INT(cs_sampling_params_check(&b), CS_EINVAL);
        ASSERT_MSG_HAS(cs_last_error(), "[-100, 100]");
        bias[2] = NAN;
        ASSERT_EQ_INT(cs_sampling_params_check(&b), CS_EINVAL);
        bias[2] = 1, ids[2] = V;
        ASSERT_EQ_INT(cs_sampler_init(&b, V, &s), CS_EINVAL);
        ASSERT_MSG_HAS(cs_last_error(), "vocabulary");
        ASSERT_TRUE(s == NULL);
        ids[2] = -1;
        ASSERT_EQ_INT(cs_sampling_params_check(&b), CS_EINVAL);
        b.n_bias = CS_MAX_LOGIT_BIAS + 1;
        ASSERT_EQ_INT(cs_sampling_params_check(&b), CS_EINVAL);
    }

    /* min_tokens: suppressed ids are never picked until that many accepted;
     * logprobs stay raw */
    ASSERT_EQ_INT(cs_sampler_init(&p, V, &s), 0);
    const int32_t stops[] = {1, 2, 99};
    ASSERT_EQ_INT(cs_sampler_suppress(s, stops, 3, 2), 0);
    memcpy(l2, logits, sizeof l2);
    ASSERT_EQ_INT(cs_sampler_sample(s, l2, 1, &lp), 5);
    ASSERT_EQ_INT(lp.top_ids[0], 1);
    cs_sampler_accept(s, 5);
    ASSERT_EQ_INT(sample_with(p, logits, s), 5);
    cs_sampler_accept(s, 5);
    ASSERT_EQ_INT(sample_with(p, logits, s), 1); /* two accepted: free again */
    cs_sampler_free(s);
    cs_sampling_params hot = p;
    hot.temperature = 5;
    ASSERT_EQ_INT(cs_sampler_init(&hot, V, &s), 0);
    ASSERT_EQ_INT(cs_sampler_suppress(s, stops, 2, 1000), 0);
    for (int i = 0; i < 200; i++) {
        int32_t id = sample_with(hot, logits, s);
        ASSERT_TRUE(id != 1 && id != 2);
        cs_sampler_accept(s, id);
    }
    cs_sampler_free(s);

    /* repetition penalty turns the greedy choice */
    cs_sampling_params rp = p;
    rp.repetition_penalty = 2;
    ASSERT_EQ_INT(cs_sampler_init(&rp, V, &s), 0);
    int32_t prompt[] = {1, 2};
    cs_sampler_accept_prompt(s, prompt, 2);
    ASSERT_EQ_INT(sample_with(rp, logits, s), 5); /* 3/2 = 1.5 < 2 */
    cs_sampler_free(s);

    /* frequency penalty counts occurrences */
    cs_sampling_params fp = p;
    fp.frequency_penalty = 0.8f;
    ASSERT_EQ_INT(cs_sampler_init(&fp, V, &s), 0);
    cs_sampler_accept(s, 1);
    ASSERT_EQ_INT(sample_with(fp, logits, s), 2);
    cs_sampler_accept(s, 2);
    cs_sampler_accept(s, 2);
    ASSERT_EQ_INT(sample_with(fp, logits, s), 1); /* 3-0.8=2.2 > 3-1.6 */
    cs_sampler_free(s);

    /* top-k 1 and tiny top-p are greedy whatever the seed */
    for (uint64_t seed = 0; seed < 50; seed++) {
        cs_sampling_params t = p;
        t.temperature = 1.5f;
        t.top_k = 1;
        t.seed = seed;
        ASSERT_EQ_INT(cs_sampler_init(&t, V, &s), 0);
        int32_t id = sample_with(t, logits, s);
        ASSERT_TRUE(id == 1 || id == 2); /* the two tied maxima */
        cs_sampler_free(s);
        t.top_k = 0;
        t.min_p = 0.9f; /* only tokens within 90% of the max survive: 1 and 2 */
        ASSERT_EQ_INT(cs_sampler_init(&t, V, &s), 0);
        id = sample_with(t, logits, s);
        ASSERT_TRUE(id == 1 || id == 2);
        cs_sampler_free(s);
        t.min_p = 0;
        t.top_p = 0.5f; /* at T=1.5 tokens 1 and 2 hold 0.31 each: both are needed to reach 0.5 */
        ASSERT_EQ_INT(cs_sampler_init(&t, V, &s), 0);
        id = sample_with(t, logits, s);
        ASSERT_TRUE(id == 1 || id == 2);
        cs_sampler_free(s);
    }

    /* same seed, same stream; the RNG state can be carried over */
    cs_sampling_params t = p;
    t.temperature = 1;
    t.seed = 42;
    cs_sampler *a = NULL, *b = NULL;
    ASSERT_EQ_INT(cs_sampler_init(&t, V, &a), 0);
    ASSERT_EQ_INT(cs_sampler_init(&t, V, &b), 0);
    int32_t seq_a[64];
    int hist[V] = {0};
    for (int i = 0; i < 64; i++) {
        seq_a[i] = sample_with(t, logits, a);
        hist[seq_a[i]]++;
        ASSERT_EQ_INT(sample_with(t, logits, b), seq_a[i]);
        cs_sampler_accept(a, seq_a[i]);
        cs_sampler_accept(b, seq_a[i]);
    }
    ASSERT_TRUE(hist[1] + hist[2] > 16 && hist[1] + hist[2] < 64); /* sampled, not greedy */
    /* counter-based: a sampler that accepted the same tokens (a sequence
     * continued elsewhere) draws the same numbers */
    cs_sampler *c = NULL;
    ASSERT_EQ_INT(cs_sampler_init(&t, V, &c), 0);
    for (int i = 0; i < 64; i++)
        cs_sampler_accept(c, seq_a[i]);
    for (int i = 0; i < 32; i++) {
        int32_t x = sample_with(t, logits, a);
        ASSERT_EQ_INT(sample_with(t, logits, c), x);
        cs_sampler_accept(a, x);
        cs_sampler_accept(c, x);
    }
    cs_sampler_free(a);
    cs_sampler_free(b);
    cs_sampler_free(c);
    cs_sampler_free(NULL);
    check_filters_against_the_reference();
    return 0;
}
