/* test_metrics.c: the metrics registry (proc/src/metrics.c): the exact
 * Prometheus text of a small registry (families grouped under one header
 * even when registered interleaved, cumulative histogram buckets, escaping,
 * number formats), re-registration, and exact sums of concurrent updates
 * from four threads. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/metrics.h"
#include "test.h"

static char *render(cs_metrics *m) {
    char *text = NULL;
    size_t len = 0;
    ASSERT_EQ_INT(cs_metrics_render(m, &text, &len), 0);
    ASSERT_TRUE(text != NULL);
    ASSERT_EQ_INT(len, strlen(text));
    return text;
}

static void test_empty(void) {
    cs_metrics *m = NULL;
    ASSERT_EQ_INT(cs_metrics_init(&m), 0);
    char *text = render(m);
    ASSERT_EQ_STR(text, "");
    free(text);
    cs_metrics_free(m);
    cs_metrics_free(NULL);
}

static void test_render(void) {
    cs_metrics *m = NULL;
    ASSERT_EQ_INT(cs_metrics_init(&m), 0);
    cs_metric *req_local =
        cs_metrics_counter(m, "chunkserve:requests_total", "path=\"local\"", "Requests served.");
    cs_metric *waiting =
        cs_metrics_gauge(m, "chunkserve:num_requests_waiting", NULL, "Requests waiting.");
    /* Interleaved: a second series of the first family after another family. */
    cs_metric *req_remote =
        cs_metrics_counter(m, "chunkserve:requests_total", "path=\"remote\"", "ignored help");
    const double bounds[] = {0.005, 0.1, 1};
    cs_metric *ttft = cs_metrics_histogram(m, "chunkserve:time_to_first_token_seconds",
                                           "model=\"m\"", "Time to first token.", bounds, 3);
    cs_metric *usage = cs_metrics_gauge(m, "chunkserve:kv_cache_usage_perc", "",
                                        "KV cache usage \\ 1 = full\nnext");
    /* Same name and labels: the same series. */
    ASSERT_TRUE(cs_metrics_counter(m, "chunkserve:requests_total", "path=\"local\"", "x") ==
                req_local);
    ASSERT_TRUE(cs_metrics_gauge(m, "chunkserve:kv_cache_usage_perc", NULL, "x") == usage);

    cs_metric_inc(req_local);
    cs_metric_inc(req_local);
    cs_metric_add(req_local, 3);
    cs_metric_add(req_local, -1); /* dropped: counters only go up */
    cs_metric_add(req_remote, 0.5);
    cs_metric_set(waiting, 7);
    cs_metric_add(waiting, -2);
    cs_metric_set(usage, 0.25);
    cs_metric_observe(ttft, 0.001); /* first bucket */
    cs_metric_observe(ttft, 0.005); /* le is inclusive: first bucket */
    cs_metric_observe(ttft, 0.05);  /* 0.1 */
    cs_metric_observe(ttft, 2);     /* +Inf */
    cs_metric_observe(ttft, 0.5);   /* 1 */
    cs_metric_inc(NULL);            /* no-ops */
    cs_metric_set(NULL, 1);
    cs_metric_observe(NULL, 1);
    ASSERT_NEAR(cs_metric_value(req_local), 5, 0);
    ASSERT_NEAR(cs_metric_value(waiting), 5, 0);
    ASSERT_NEAR(cs_metric_value(ttft), 5, 0);

    char *text = render(m);
    const char *want = "# HELP chunkserve:requests_total Requests served.\n"
                       "# TYPE chunkserve:requests_total counter\n"
                       "chunkserve:requests_total{path=\"local\"} 5\n"
                       "chunkserve:requests_total{path=\"remote\"} 0.5\n"
                       "# HELP chunkserve:num_requests_waiting Requests waiting.\n"
                       "# TYPE chunkserve:num_requests_waiting gauge\n"
                       "chunkserve:num_requests_waiting 5\n"
                       "# HELP chunkserve:time_to_first_token_seconds Time to first token.\n"
                       "# TYPE chunkserve:time_to_first_token_seconds histogram\n"
                       "chunkserve:time_to_first_token_seconds_bucket{model=\"m\",le=\"0.005\"} 2\n"
                       "chunkserve:time_to_first_token_seconds_bucket{model=\"m\",le=\"0.1\"} 3\n"
                       "chunkserve:time_to_first_token_seconds_bucket{model=\"m\",le=\"1\"} 4\n"
                       "chunkserve:time_to_first_token_seconds_bucket{model=\"m\",le=\"+Inf\"} 5\n"
                       "chunkserve:time_to_first_token_seconds_sum{model=\"m\"} 2.556\n"
                       "chunkserve:time_to_first_token_seconds_count{model=\"m\"} 5\n"
                       "# HELP chunkserve:kv_cache_usage_perc KV cache usage \\\\ 1 = full\\nnext\n"
                       "# TYPE chunkserve:kv_cache_usage_perc gauge\n"
                       "chunkserve:kv_cache_usage_perc 0.25\n";
    ASSERT_EQ_STR(text, want);
    free(text);
    cs_metrics_free(m);
}

static void test_formats(void) {
    cs_metrics *m = NULL;
    ASSERT_EQ_INT(cs_metrics_init(&m), 0);
    cs_metric *g = cs_metrics_gauge(m, "g", NULL, "h");
    cs_metric *h = cs_metrics_histogram(m, "h", NULL, "no bounds", NULL, 0);
    struct {
        double v;
        const char *text;
    } cases[] = {
        {0, "g 0\n"},
        {-3, "g -3\n"},
        {0.1, "g 0.1\n"},
        {1.0 / 3, "g 0.3333333333333333\n"},
        {0.1 + 0.2, "g 0.30000000000000004\n"},
        {1e20, "g 1e+20\n"},
        {9007199254740992.0, "g 9007199254740992\n"},
        {INFINITY, "g +Inf\n"},
        {-INFINITY, "g -Inf\n"},
        {NAN, "g NaN\n"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cs_metric_set(g, cases[i].v);
        char *text = render(m);
        ASSERT_MSG_HAS(text, cases[i].text);
        free(text);
    }
    cs_metric_observe(h, 3);
    char *text = render(m);
    ASSERT_MSG_HAS(text, "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 3\nh_count 1\n");
    free(text);
    cs_metrics_free(m);
}

static void test_standard_buckets(void) {
    ASSERT_TRUE(cs_metrics_n_ttft_buckets > 4 && cs_metrics_n_itl_buckets > 4);
    ASSERT_NEAR(cs_metrics_ttft_buckets[0], 0.001, 0);
    ASSERT_NEAR(cs_metrics_ttft_buckets[cs_metrics_n_ttft_buckets - 1], 60, 0);
    ASSERT_NEAR(cs_metrics_itl_buckets[0], 0.001, 0);
    ASSERT_NEAR(cs_metrics_itl_buckets[cs_metrics_n_itl_buckets - 1], 10, 0);
    for (size_t i = 1; i < cs_metrics_n_ttft_buckets; i++)
        ASSERT_TRUE(cs_metrics_ttft_buckets[i] > cs_metrics_ttft_buckets[i - 1]);
    for (size_t i = 1; i < cs_metrics_n_itl_buckets; i++)
        ASSERT_TRUE(cs_metrics_itl_buckets[i] > cs_metrics_itl_buckets[i - 1]);
    cs_metrics *m = NULL;
    ASSERT_EQ_INT(cs_metrics_init(&m), 0);
    cs_metric *h = cs_metrics_histogram(m, "chunkserve:time_to_first_token_seconds", NULL, "TTFT",
                                        cs_metrics_ttft_buckets, cs_metrics_n_ttft_buckets);
    cs_metric_observe(h, 0.03);
    char *text = render(m);
    ASSERT_MSG_HAS(
        text,
        "_bucket{le=\"0.02\"} 0\nchunkserve:time_to_first_token_seconds_bucket{le=\"0.04\"} 1\n");
    ASSERT_MSG_HAS(text, "_bucket{le=\"60\"} 1\n");
    free(text);
    cs_metrics_free(m);
}

#define N_THREADS 4
#define N_ITERS 200000

typedef struct {
    cs_metrics *m;
    cs_metric *counter, *gauge, *hist;
} shared;

static void *worker(void *arg) {
    shared *s = arg;
    for (int i = 0; i < N_ITERS; i++) {
        cs_metric_inc(s->counter);
        cs_metric_add(s->gauge, (i & 1) ? 0.5 : -0.25);
        cs_metric_observe(s->hist, (i % 4) * 0.5); /* 0, 0.5, 1, 1.5 */
        if (i % 50000 == 0) { /* registration and rendering while others update */
            cs_metrics_gauge(s->m, "late", NULL, "registered while running");
            char *text = NULL;
            size_t len = 0;
            ASSERT_EQ_INT(cs_metrics_render(s->m, &text, &len), 0);
            free(text);
        }
    }
    return NULL;
}

static void test_concurrent(void) {
    shared s = {0};
    ASSERT_EQ_INT(cs_metrics_init(&s.m), 0);
    s.counter = cs_metrics_counter(s.m, "c_total", NULL, "c");
    s.gauge = cs_metrics_gauge(s.m, "g", NULL, "g");
    const double bounds[] = {0.25, 1};
    s.hist = cs_metrics_histogram(s.m, "h", NULL, "h", bounds, 2);
    pthread_t t[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        ASSERT_EQ_INT(pthread_create(&t[i], NULL, worker, &s), 0);
    for (int i = 0; i < N_THREADS; i++)
        ASSERT_EQ_INT(pthread_join(t[i], NULL), 0);
    const double n = (double)N_THREADS * N_ITERS;
    ASSERT_NEAR(cs_metric_value(s.counter), n, 0);
    ASSERT_NEAR(cs_metric_value(s.gauge), n / 2 * 0.5 - n / 2 * 0.25, 0);
    ASSERT_NEAR(cs_metric_value(s.hist), n, 0);
    char *text = render(s.m);
    char want[512];
    snprintf(want, sizeof want,
             "h_bucket{le=\"0.25\"} %.0f\nh_bucket{le=\"1\"} %.0f\nh_bucket{le=\"+Inf\"} "
             "%.0f\nh_sum %.0f\n"
             "h_count %.0f\n",
             n / 4, n * 3 / 4, n, n / 4 * 3, n);
    ASSERT_MSG_HAS(text, want);
    free(text);
    cs_metrics_free(s.m);
}

int main(void) {
    test_empty();
    test_render();
    test_formats();
    test_standard_buckets();
    test_concurrent();
    printf("test_metrics: ok\n");
    return 0;
}
