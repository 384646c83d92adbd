/* bench_engine.c: `chunkserve bench-engine`: the engine's speed against
 * limits measured in the same run on the same machine, printed as ratios
 * (timings on shared machines are noisy; ratios measured side by side are
 * what we compare):
 *   - GEMM: the BLAS library's own rate on the model's projection shapes;
 *   - prefill: achieved GFLOP/s (projections + attention) vs that rate;
 *   - decode: step time at batch 1, 8, 32 vs weight bytes / memory bandwidth
 *     (bandwidth measured by a copy loop);
 *   - chunked prefill: a long prompt in chunks of 64 .. 2048 vs one pass.
 * Nothing here is asserted by tests. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "chunkserve/engine.h"
#include "chunkserve/ops.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"

static double median(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

/* GB/s of a large memcpy (read + write counted as 2 bytes per byte copied). */
static double copy_bandwidth(void) {
    size_t n = (size_t)512 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) return 0;
    memset(a, 1, n), memset(b, 2, n);
    double t[5];
    for (int i = 0; i < 5; i++) {
        double t0 = cs_now();
        memcpy(b, a, n);
        t[i] = cs_now() - t0;
    }
    free(a), free(b);
    return 2.0 * (double)n / median(t, 5) / 1e9;
}

/* Flops of one forward over n tokens at positions pos..pos+n-1 (no lm_head). */
static double forward_flops(const cs_model_config *c, double n, double pos) {
    double qd = (double)c->n_heads * c->head_dim, kvd = (double)c->n_kv_heads * c->head_dim;
    double per_tok =
        2.0 * c->dim * (qd + 2 * kvd) + 2.0 * qd * c->dim + 3 * 2.0 * c->dim * c->hidden_dim;
    /* attention: QK^T and AV over on average pos + (n+1)/2 keys */
    double attn = 4.0 * qd * n * (pos + (n + 1) / 2);
    return c->n_layers * (per_tok * n + attn);
}

static double time_prefill(cs_engine *e, const int32_t *ids, int32_t n, int32_t chunk,
                           float *logits) {
    cs_page_table pt = {0};
    double t0 = cs_now();
    int r = cs_engine_eval_seq(e, &pt, 0, ids, n, chunk, logits);
    double t = cs_now() - t0;
    cs_page_table_release(&pt, cs_engine_kv(e));
    if (r) {
        fprintf(stderr, "bench: prefill failed: %s\n", cs_last_error());
        exit(1);
    }
    return t;
}

int cs_cli_bench_engine(const cs_model *m, int threads, int prompt_tokens, bool kv_bf16) {
    const cs_model_config *c = cs_model_get_config(m);
    cs_engine_params ep = cs_engine_params_default();
    ep.n_threads = threads;
    ep.kv_bf16 = kv_bf16;
    ep.kv_bytes = (size_t)1 << 30;
    cs_engine *e = NULL;
    if (cs_engine_init(m, &ep, &e)) {
        fprintf(stderr, "bench: %s\n", cs_last_error());
        return 1;
    }
    int32_t n = prompt_tokens;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    for (int32_t i = 0; i < n; i++)
        ids[i] = 100 + (int32_t)((i * 7919u) % 20000u);
    float *logits = malloc(sizeof(float) * (size_t)c->n_vocab * 64);
    cs_threadpool *pool = NULL;
    cs_threadpool_init(threads, &pool);

    /* 1. the GEMM library's own rate on the model's shapes, 512 tokens: one
     * cblas_sgemm per weight with OpenBLAS's own threads (the engine runs
     * OpenBLAS single-threaded on fixed tiles over its pool instead) */
    int T = 512;
    float *x = calloc((size_t)T * c->hidden_dim, sizeof(float)),
          *y = calloc((size_t)T * c->hidden_dim * 2, sizeof(float));
    for (size_t i = 0; i < (size_t)T * c->hidden_dim; i++)
        x[i] = (float)(i % 13) * 0.01f;
    /* weights of layer 0's shapes (a GEMM's speed does not depend on the values) */
    int qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    struct {
        float *w;
        int rows, cols;
    } shapes[] = {
        {NULL, qd, c->dim},           {NULL, kvd, c->dim},           {NULL, kvd, c->dim},
        {NULL, c->dim, qd},           {NULL, c->hidden_dim, c->dim}, {NULL, c->hidden_dim, c->dim},
        {NULL, c->dim, c->hidden_dim}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        size_t n_w = (size_t)shapes[s].rows * (size_t)shapes[s].cols;
        shapes[s].w = malloc(n_w * sizeof(float));
        if (!shapes[s].w) {
            fprintf(stderr, "bench: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < n_w; i++)
            shapes[s].w[i] = (float)(i % 17) * 0.01f - 0.08f;
    }
    double gemm_flops = 0, gemm_time = 0;
    openblas_set_num_threads(cs_threadpool_size(pool));
    for (int rep = 0; rep < 4; rep++) {
        double t0 = cs_now();
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, shapes[s].rows, shapes[s].cols,
                        1.0f, x, shapes[s].cols, shapes[s].w, shapes[s].cols, 0.0f, y,
                        shapes[s].rows);
        double t = cs_now() - t0;
        if (rep) { /* first is warm-up */
            gemm_time += t;
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                gemm_flops += 2.0 * T * shapes[s].rows * shapes[s].cols;
        }
    }
    double gemm_rate = gemm_flops / gemm_time / 1e9;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        free(shapes[s].w);
    openblas_set_num_threads(1); /* back to what the engine expects */

    /* 1b. the int8 multiply-accumulate peak of the quantized kernels' instruction */
    bool quant = cs_model_weight_mode(m) == CS_WEIGHTS_QUANT;
    double peak_macs = quant ? cs_qmat_peak_macs(pool, 0.5, false) : 0;
    double amx_peak_macs = quant ? cs_qmat_peak_macs(pool, 0.5, true) : 0;

    /* 2. prefill */
    time_prefill(e, ids, n < 64 ? n : 64, 0, logits); /* warm-up */
    double tp[3];
    for (int i = 0; i < 3; i++)
        tp[i] = time_prefill(e, ids, n, 0, logits);
    double t_prefill = median(tp, 3);
    double prefill_rate = forward_flops(c, n, 0) / t_prefill / 1e9;

    /* 3. decode steps at batch 1, 8, 32 (each sequence with a 128-token context) */
    double bw = copy_bandwidth();
    double weight_bytes = (double)cs_model_weight_bytes(m);
    int batches[] = {1, 8, 32};
    double step_time[3];
    for (int bi = 0; bi < 3; bi++) {
        int B = batches[bi];
        cs_page_table *pts = calloc((size_t)B, sizeof *pts);
        cs_span *sp = calloc((size_t)B, sizeof *sp);
        int32_t *next = calloc((size_t)B, sizeof(int32_t));
        for (int b = 0; b < B; b++) {
            if (cs_engine_eval_seq(e, &pts[b], 0, ids + b, 128, 0, logits)) {
                fprintf(stderr, "bench: %s\n", cs_last_error());
                return 1;
            }
            next[b] = 1000 + b;
        }
        double ts[8];
        for (int step = 0; step < 9; step++) {
            for (int b = 0; b < B; b++) {
                cs_page_table_reserve(&pts[b], cs_engine_kv(e), 128 + step, 128 + step + 1);
                sp[b] = (cs_span){&next[b],      1,    128 + step, pts[b].pages,
                                  pts[b].n_pages, true, pts[b].cap};
            }
            float *lg = malloc(sizeof(float) * (size_t)c->n_vocab * B);
            double t0 = cs_now();
            cs_engine_step(e, sp, B, lg);
            if (step) ts[step - 1] = cs_now() - t0;
            free(lg);
        }
        step_time[bi] = median(ts, 8);
        for (int b = 0; b < B; b++)
            cs_page_table_release(&pts[b], cs_engine_kv(e));
        free(pts), free(sp), free(next);
    }
    double floor_s = weight_bytes / (bw * 1e9); /* every weight byte is read once per step */

    /* 4. chunked prefill overhead on the same prompt */
    int chunks[] = {64, 128, 256, 512, 1024, 2048};
    double t_chunk[6];
    for (int i = 0; i < 6; i++) {
        double t3[3];
        for (int k = 0; k < 3; k++)
            t3[k] = time_prefill(e, ids, n, chunks[i], logits);
        t_chunk[i] = median(t3, 3);
    }

    printf("chunkserve bench-engine: %s, %d threads, backend %s, weights %s, %.0f MiB%s%s\n",
           c->name, cs_threadpool_size(pool), cs_engine_backend_name(e), cs_model_weight_desc(m),
           weight_bytes / (1 << 20), quant ? ", kernels " : "",
           quant ? cs_qmat_kernels_name() : "");
    printf("\n%-44s %10s %10s %8s\n", "measure", "ours", "limit", "ratio");
    printf("%-44s %10.1f %10s %8s\n", "OpenBLAS sgemm, model shapes x512 [GFLOP/s]", gemm_rate, "",
           "");
    printf("%-44s %10.1f %10.1f %8.2f\n", "prefill one pass [GFLOP/s] vs OpenBLAS rate",
           prefill_rate, gemm_rate, prefill_rate / gemm_rate);
    printf("%-44s %10.1f\n", "prefill tokens/s", n / t_prefill);
    if (peak_macs > 0) { /* quant mode: the projections' MACs (no attention) vs vpdpbusd's peak */
        double macs = forward_flops(c, n, 0) / 2 -
                      2.0 * c->n_layers * (double)c->n_heads * c->head_dim * n * ((n + 1) / 2.0);
        printf("%-44s %10.1f %10.1f %8.2f\n", "prefill int8 GMAC/s vs vpdpbusd peak",
               macs / t_prefill / 1e9, peak_macs / 1e9, macs / t_prefill / peak_macs);
        if (amx_peak_macs > 0)
            printf("%-44s %10.1f %10.1f %8.2f\n", "prefill int8 GMAC/s vs AMX tdpbsud peak",
                   macs / t_prefill / 1e9, amx_peak_macs / 1e9, macs / t_prefill / amx_peak_macs);
    }
    printf("%-44s %10.1f %10s %8s\n", "memory copy bandwidth [GB/s, read+write]", bw, "", "");
    for (int bi = 0; bi < 3; bi++) {
        char label[64];
        snprintf(label, sizeof label, "decode step batch %d [ms] vs weights/bandwidth",
                 batches[bi]);
        printf("%-44s %10.2f %10.2f %8.2f\n", label, step_time[bi] * 1e3, floor_s * 1e3,
               step_time[bi] / floor_s);
    }
    for (int bi = 0; bi < 3; bi++)
        printf("decode batch %-2d aggregate tokens/s %31.1f\n", batches[bi],
               batches[bi] / step_time[bi]);
    printf("\nchunked prefill of %d tokens vs one pass (%.3f s):\n", n, t_prefill);
    for (int i = 0; i < 6; i++)
        printf("  chunk %5d: %.3f s  ratio %.3f\n", chunks[i], t_chunk[i], t_chunk[i] / t_prefill);
    free(x), free(y), free(ids), free(logits);
    cs_threadpool_free(pool);
    cs_engine_free(e);
    return 0;
}
