/* test_sampler: parameter checks, greedy ties, the filters (top-k, top-p,
 * min-p), penalties, logit_bias, reproducibility from the seed and RNG state transfer. */
#include "chunkserve/sampler.h"
#include "test.h"

#define V 8

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
    return 0;
}
