/* gpu_bench.c: chunkserve-gpu-bench, the measurements of
 * tests/gpu/device-check.sh (issue 8). Built only with CUDA. Prints
 * "RESULT <key> <value>" lines the script tabulates; never asserts timings
 * except where --compare checks correctness (exit 1 on a mismatch).
 *   --compare MODEL     greedy CPU vs CUDA on 5 prompts (>= 64 tokens each:
 *                       same tokens, teacher-forced logits error), chunked =
 *                       one pass on CUDA
 *   --perf MODEL        timings on a real model
 *   --perf llama3-8b    timings on random bf16 weights shaped like Llama-3-8B,
 *                       generated on the device
 * Timings: device copy bandwidth and cuBLAS bf16 GEMM rate measured first in
 * the same run; decode step at batch 1/32/128 vs the HBM floor (weight bytes
 * / copy bandwidth; also vs the bytes a decode step reads) and the logits
 * download of such a step (host-side sampling's price); decode at batch 1
 * over a 4096-token context (split-K attention); one-pass prefill vs the
 * GEMM rate; chunked prefill vs one pass. Each forward synchronizes its
 * stream, so host clocks time it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chunkserve/backend.h"
#include "backend_cuda.h"
#include "chunkserve/engine.h"
#include "chunkserve/tokenizer.h"
#include "cuda_impl.h"
#include "dtype.h"
#include "model-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double copy_bandwidth(void) { /* bytes/s of read + write */
    size_t bytes = (size_t)2 << 30;
    void *a, *b;
    CS_CUDA_CHECK(cudaMalloc(&a, bytes));
    CS_CUDA_CHECK(cudaMalloc(&b, bytes));
    CS_CUDA_CHECK(cudaMemset(a, 1, bytes));
    CS_CUDA_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    cudaEvent_t e0, e1;
    CS_CUDA_CHECK(cudaEventCreate(&e0));
    CS_CUDA_CHECK(cudaEventCreate(&e1));
    const int reps = 10;
    CS_CUDA_CHECK(cudaEventRecord(e0, 0));
    for (int i = 0; i < reps; i++)
        CS_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
    CS_CUDA_CHECK(cudaEventRecord(e1, 0));
    CS_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms;
    CS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CS_CUDA_CHECK(cudaFree(a));
    CS_CUDA_CHECK(cudaFree(b));
    return 2.0 * (double)bytes * reps / (ms * 1e-3);
}

static double gemm_rate(int T, int rows,
                        int cols) { /* flop/s of cs__cuda_gemm (bf16 in, fp32 out) */
    uint16_t *x, *w;
    float *o;
    CS_CUDA_CHECK(cudaMalloc((void **)&x, (size_t)T * cols * 2));
    CS_CUDA_CHECK(cudaMalloc((void **)&w, (size_t)rows * cols * 2));
    CS_CUDA_CHECK(cudaMalloc((void **)&o, (size_t)T * rows * 4));
    cs__cuda_fill_bf16(x, (size_t)T * cols, 1, 1.0f, 0);
    cs__cuda_fill_bf16(w, (size_t)rows * cols, 2, 0.02f, 0);
    cublasHandle_t h;
    CS_CUBLAS_CHECK(cublasCreate(&h));
    cs__cuda_gemm(h, o, x, w, T, rows, cols, 0.0f);
    CS_CUDA_CHECK(cudaDeviceSynchronize());
    const int reps = 20;
    double t0 = now();
    for (int i = 0; i < reps; i++)
        cs__cuda_gemm(h, o, x, w, T, rows, cols, 0.0f);
    CS_CUDA_CHECK(cudaDeviceSynchronize());
    double t = now() - t0;
    CS_CUBLAS_CHECK(cublasDestroy(h));
    CS_CUDA_CHECK(cudaFree(x));
    CS_CUDA_CHECK(cudaFree(w));
    CS_CUDA_CHECK(cudaFree(o));
    return 2.0 * T * (double)rows * cols * reps / t;
}

/* ---- timings through the backend vtable with a bump page allocator ---- */
typedef struct {
    cs_backend *b;
    cs_model_config cf;
    int32_t next_page, n_pages, page_size;
    float *logits;
} bench;

static int32_t *alloc_pages(bench *B, int32_t n) {
    int32_t *p = malloc(sizeof(int32_t) * (size_t)n);
    for (int32_t i = 0; i < n; i++)
        p[i] = B->next_page++ % B->n_pages;
    return p;
}

/* Prefill n tokens of one sequence in chunks (0 = one pass); seconds. */
static double prefill(bench *B, const int32_t *toks, int32_t n, int32_t chunk, const int32_t *pages,
                      int32_t n_pg) {
    if (chunk <= 0) chunk = n;
    double t0 = now();
    for (int32_t p = 0; p < n; p += chunk) {
        int32_t k = n - p < chunk ? n - p : chunk;
        int32_t nb = (p + k + B->page_size - 1) / B->page_size;
        cs_backend_span s = {toks + p, k, p, pages, nb, p + k == n, nb}; /* one kind of page */
        CS_ASSERT(B->b->iface->forward(B->b->ctx, &s, 1, k, B->logits) == 0);
    }
    return now() - t0;
}

/* Seconds to copy n rows of logits (fp32) to pageable host memory, as the
 * backend's forward does: what host-side sampling costs a step. */
static double logits_copy(int32_t n, int32_t n_vocab, float *host) {
    size_t bytes = (size_t)n * n_vocab * sizeof(float);
    float *d;
    CS_CUDA_CHECK(cudaMalloc((void **)&d, bytes));
    CS_CUDA_CHECK(cudaMemset(d, 0, bytes));
    CS_CUDA_CHECK(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost)); /* warm-up */
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t0 = now();
        CS_CUDA_CHECK(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost));
        if (now() - t0 < best) best = now() - t0;
    }
    CS_CUDA_CHECK(cudaFree(d));
    return best;
}

/* Decode steps of nb sequences at context ctx (prefilled first), 1 token
 * each: mean milliseconds of steps 3..steps. */
static double decode_ms(bench *B, const int32_t *toks, int nb, int32_t ctx, int32_t steps) {
    int32_t per_seq = (ctx + steps + B->page_size) / B->page_size + 1;
    int32_t **pt = malloc(sizeof *pt * nb);
    cs_backend_span *sp = malloc(sizeof *sp * nb);
    int32_t *tk = malloc(sizeof(int32_t) * nb);
    for (int s = 0; s < nb; s++) {
        pt[s] = alloc_pages(B, per_seq);
        prefill(B, toks + s, ctx, 0, pt[s], per_seq);
    }
    double t = 0;
    for (int st = 0; st < steps; st++) {
        for (int s = 0; s < nb; s++) {
            tk[s] = toks[s + st];
            int32_t pos = ctx + st;
            sp[s] = (cs_backend_span){&tk[s], 1, pos, pt[s], pos / B->page_size + 1, true, 0};
        }
        double t0 = now();
        CS_ASSERT(B->b->iface->forward(B->b->ctx, sp, nb, nb, B->logits) == 0);
        if (st >= 2) t += now() - t0; /* 2 warm-up steps */
    }
    for (int s = 0; s < nb; s++)
        free(pt[s]);
    free(pt), free(sp), free(tk);
    return t / (steps - 2) * 1e3;
}

static void perf(bench *B, const char *label, double bw, double rate) {
    const cs_model_config *cf = &B->cf;
    /* the floor: every weight byte once per step; and the bytes a
     * decode step does read (an untied embedding table is only gathered) */
    size_t wbytes = cs_backend_cuda_weight_bytes(B->b);
    size_t rbytes = wbytes - (cf->tied_embeddings ? 0 : (size_t)cf->n_vocab * cf->dim * 2);
    double floor_s = (double)wbytes / bw, read_floor_s = (double)rbytes / bw;
    printf("RESULT %s.weight_GB %.2f\nRESULT %s.hbm_floor_ms %.3f\nRESULT %s.read_floor_ms %.3f\n",
           label, wbytes / 1e9, label, floor_s * 1e3, label, read_floor_s * 1e3);
    int32_t *toks = malloc(sizeof(int32_t) * 8192);
    for (int i = 0; i < 8192; i++)
        toks[i] = (int32_t)((i * 2654435761u) % (uint32_t)cf->n_vocab);

    /* decode: B sequences with a 256-token context, then 1 token each per
     * step; the logits download of such a step on its own */
    static const int batches[] = {1, 32, 128};
    for (size_t bi = 0; bi < 3; bi++) {
        int nb = batches[bi];
        double ms = decode_ms(B, toks, nb, 256, 16);
        double lg = logits_copy(nb, cf->n_vocab, B->logits) * 1e3;
        printf("RESULT %s.decode_b%d_ms %.3f\nRESULT %s.decode_b%d_vs_floor %.2f\n"
               "RESULT %s.decode_b%d_vs_read_floor %.2f\nRESULT %s.logits_b%d_ms %.3f\n",
               label, nb, ms, label, nb, ms / (floor_s * 1e3), label, nb, ms / (read_floor_s * 1e3),
               label, nb, lg);
    }
    /* long context at batch 1: the attention's split-K at work */
    if (cf->ctx_len >= 4096 + 16) {
        double ms = decode_ms(B, toks, 1, 4096, 10);
        printf("RESULT %s.decode_b1_ctx4096_ms %.3f\nRESULT %s.decode_b1_ctx4096_vs_floor %.2f\n",
               label, ms, label, ms / (floor_s * 1e3));
    }

    /* prefill: one pass vs chunks */
    int32_t L = cf->ctx_len >= 4096 ? 4096 : cf->ctx_len;
    if (L > 8192) L = 8192;
    int32_t n_pg = (L + B->page_size - 1) / B->page_size;
    int32_t *pg = alloc_pages(B, n_pg);
    prefill(B, toks, L, 0, pg, n_pg); /* warm-up: cuBLAS heuristics, allocations */
    double one = 1e30;
    for (int r = 0; r < 3; r++) {
        double t = prefill(B, toks, L, 0, pg, n_pg);
        if (t < one) one = t;
    }
    double qd = (double)cf->n_heads * cf->head_dim, kvd = (double)cf->n_kv_heads * cf->head_dim;
    double mm_params = (double)cf->n_layers *
                       ((qd + 2 * kvd) * cf->dim + cf->dim * qd + 3.0 * cf->hidden_dim * cf->dim);
    double flops = 2.0 * mm_params * L; /* GEMMs only; attention not counted */
    printf("RESULT %s.prefill_len %d\nRESULT %s.prefill_tok_s %.0f\nRESULT %s.prefill_TFLOPS %.1f\n"
           "RESULT %s.prefill_vs_cublas %.2f\n",
           label, L, label, L / one, label, flops / one / 1e12, label, flops / one / rate);
    static const int32_t chunks[] = {2048, 512};
    for (size_t c = 0; c < 2; c++) {
        if (chunks[c] >= L) continue;
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
            double t = prefill(B, toks, L, chunks[c], pg, n_pg);
            if (t < best) best = t;
        }
        printf("RESULT %s.chunk%d_vs_onepass %.3f\n", label, chunks[c], best / one);
    }
    free(pg), free(toks);
    fflush(stdout);
}

/* ---- correctness on the real model through the engine ---- */
static cs_engine *engine_on(const cs_model *m, const char *backend) {
    setenv("CHUNKSERVE_BACKEND", backend, 1);
    cs_engine_params p = cs_engine_params_default();
    p.n_pages = 512;
    cs_engine *e = NULL;
    if (cs_engine_init(m, &p, &e)) {
        fprintf(stderr, "engine on %s: %s\n", backend, cs_last_error());
        exit(1);
    }
    return e;
}
static int32_t argmax(const float *v, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}
static float top2_gap(const float *v, int32_t n) { /* best logit minus the second best */
    float a = -INFINITY, b = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (v[i] > a)
            b = a, a = v[i];
        else if (v[i] > b)
            b = v[i];
    return a - b;
}
static double rel(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++)
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return sqrt(num / (den > 0 ? den : 1));
}

static int compare(const cs_model *m) {
    static const char *prompts[] = {
        "The capital of France is", "Write a short poem about the sea.",
        "def fibonacci(n):", "Explain how a transformer language model works, step by step.",
        "1, 2, 3, 4, 5,"};
    const int n_gen = 64;
    const int32_t V = m->cfg.n_vocab;
    cs_engine *ec = engine_on(m, "cpu"), *eg = engine_on(m, "cuda");
    float *lc = malloc(sizeof(float) * V), *lg = malloc(sizeof(float) * V),
          *l0 = malloc(sizeof(float) * V);
    int bad = 0;
    double worst = 0;
    for (int p = 0; p < 5; p++) {
        int32_t *ids;
        size_t n;
        CS_ASSERT(cs_tokenizer_encode(m->tok, prompts[p], strlen(prompts[p]), false, true, &ids,
                                      &n) == 0);
        int32_t tc[64], tg[64];
        float gap[64]; /* the CPU's top-2 gap at each step of its path */
        cs_page_table pc = {0}, pg = {0};
        CS_ASSERT(cs_engine_eval_seq(ec, &pc, 0, ids, (int32_t)n, 0, lc) == 0);
        CS_ASSERT(cs_engine_eval_seq(eg, &pg, 0, ids, (int32_t)n, 0, lg) == 0);
        double w = 0, margin = -1;        /* the CPU's top-2 gap where the paths part */
        for (int i = 0; i < n_gen; i++) { /* free-running, each on its own path */
            tc[i] = argmax(lc, V), tg[i] = argmax(lg, V), gap[i] = top2_gap(lc, V);
            if (tc[i] != tg[i] && margin < 0) margin = lc[tc[i]] - lc[tg[i]];
            if (tc[i] == tg[i]) {
                double e = rel(lg, lc, (size_t)V);
                if (e > w) w = e;
            }
            CS_ASSERT(cs_engine_eval_seq(ec, &pc, (int32_t)n + i, &tc[i], 1, 0, lc) == 0);
            CS_ASSERT(cs_engine_eval_seq(eg, &pg, (int32_t)n + i, &tg[i], 1, 0, lg) == 0);
        }
        int same = 0;
        while (same < n_gen && tc[same] == tg[same])
            same++;
        printf("compare prompt %d: %zu prompt tokens, same greedy tokens %d/%d, worst logits err "
               "%.2e",
               p, n, same, n_gen, w);
        if (same < n_gen) /* a near-tie (a small gap) is bf16 rounding, a large one a bug */
            printf("; parted at token %d where the CPU's logit for its token led the GPU's pick by "
                   "%.3f",
                   same, margin);
        printf("\n");
        printf("RESULT compare.prompt%d_same_tokens %d\n", p, same);
        /* the GPU along the CPU's path: where its argmax differs, how close
         * was the CPU's own choice (near-ties are bf16 rounding) */
        cs_page_table pf = {0};
        CS_ASSERT(cs_engine_eval_seq(eg, &pf, 0, ids, (int32_t)n, 0, lg) == 0);
        int forced = 0;
        float forced_gap = 0;
        for (int i = 0; i < n_gen; i++) {
            int32_t g = argmax(lg, V);
            if (g == tc[i])
                forced++;
            else if (gap[i] > forced_gap)
                forced_gap = gap[i];
            CS_ASSERT(cs_engine_eval_seq(eg, &pf, (int32_t)n + i, &tc[i], 1, 0, lg) == 0);
        }
        cs_page_table_release(&pf, cs_engine_kv(eg));
        printf("compare prompt %d: on the CPU's path the GPU's argmax agrees at %d/%d steps; "
               "largest CPU top-2 gap where it did not: %.3f\n",
               p, forced, n_gen, forced_gap);
        printf("RESULT compare.prompt%d_forced_agree %d\nRESULT compare.prompt%d_forced_worst_gap "
               "%.3f\n",
               p, forced, p, forced_gap);
        /* bf16 weights, activations, KV, q and P vs fp32: the host emulation
         * of this backend (tests/emu) saw 3.1-4.6e-2 on these prompts */
        if (same < n_gen || w > 8e-2) bad = 1;
        if (w > worst) worst = w;
        cs_page_table_release(&pc, cs_engine_kv(ec));
        cs_page_table_release(&pg, cs_engine_kv(eg));
        /* chunked = one pass on CUDA, on the prompt + generated tokens */
        int32_t all[1024], na = 0;
        for (size_t i = 0; i < n && na < 900; i++)
            all[na++] = ids[i];
        for (int i = 0; i < n_gen; i++)
            all[na++] = tg[i];
        static const int32_t chunks[] = {0, 1, 16, 37};
        for (int c = 0; c < 4; c++) {
            cs_page_table pt = {0};
            CS_ASSERT(cs_engine_eval_seq(eg, &pt, 0, all, na, chunks[c], c ? lg : l0) == 0);
            cs_page_table_release(&pt, cs_engine_kv(eg));
            if (!c) continue;
            double e = rel(lg, l0, (size_t)V);
            printf("compare prompt %d: cuda chunk %d vs one pass: logits err %.2e, argmax %s\n", p,
                   chunks[c], e, argmax(lg, V) == argmax(l0, V) ? "same" : "DIFFERENT");
            if (e > 5e-3 || argmax(lg, V) != argmax(l0, V)) bad = 1;
        }
        free(ids);
    }
    printf("RESULT compare.worst_logits_err %.2e\nRESULT compare.ok %d\n", worst, !bad);
    cs_engine_free(ec), cs_engine_free(eg);
    free(lc), free(lg), free(l0);
    return bad;
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "--compare") && strcmp(argv[1], "--perf"))) {
        fprintf(stderr,
                "usage: chunkserve-gpu-bench --compare MODEL | --perf MODEL | --perf llama3-8b\n");
        return 2;
    }
    char name[320], why[320];
    if (cs_backend_cuda_probe(name, sizeof name, why, sizeof why) < 1) {
        fprintf(stderr, "chunkserve-gpu-bench: no usable GPU: %s\n", why);
        return 77;
    }
    printf("device: %s\n", name);
    cs_model *m = NULL;
    bool synth = strcmp(argv[2], "llama3-8b") == 0;
    if (!synth && cs_model_load(argv[2], &m)) {
        fprintf(stderr, "%s: %s\n", argv[2], cs_last_error());
        return 1;
    }
    if (!strcmp(argv[1], "--compare")) {
        if (synth) return 2;
        int r = compare(m);
        cs_model_free(m);
        return r;
    }
    double bw = copy_bandwidth();
    double rate = gemm_rate(4096, 14336, 4096);
    printf("RESULT hbm_copy_GB_s %.0f\nRESULT cublas_bf16_TFLOPS %.1f\n", bw / 1e9, rate / 1e12);
    bench B = {0};
    B.page_size = 16;
    float inv[64];
    if (synth) {
        cs_model_config cf = {0};
        snprintf(cf.arch, sizeof cf.arch, "llama");
        snprintf(cf.name, sizeof cf.name, "random Llama-3-8B shape");
        cf.n_vocab = 128256, cf.dim = 4096, cf.n_layers = 32, cf.n_heads = 32, cf.n_kv_heads = 8;
        cf.head_dim = 128, cf.hidden_dim = 14336, cf.ctx_len = 8192, cf.norm_eps = 1e-5f,
        cf.rope_theta = 500000.0f;
        cf.tied_embeddings = false;
        for (int i = 0; i < 64; i++)
            inv[i] = powf(cf.rope_theta, -2.0f * (float)i / 128.0f);
        cs_weights_shape shape = {cf.n_vocab,    cf.dim,        cf.n_layers,
                                  cf.n_heads,    cf.n_kv_heads, cf.head_dim,
                                  cf.hidden_dim, cf.norm_eps,   cf.tied_embeddings,
                                  CS_ACT_SILU,   1.0f,          1.0f / sqrtf(128.0f),
                                  cf.n_layers};
        CS_ASSERT(cs_backend_cuda_init_random(&shape, inv, 42, &B.b) == 0);
        B.cf = cf;
    } else {
        cs_weights w;
        cs_layer_weights *layers = calloc((size_t)m->cfg.n_layers, sizeof *layers);
        CS_ASSERT(layers);
        cs__model_weights(m, &w, layers);
        CS_ASSERT(cs_backend_cuda_init(&w, &B.b) == 0); /* the device keeps its own copy */
        free(layers);
        B.cf = m->cfg;
    }
    /* pool: 128 sequences x ~18 pages for decode + a 4096-token prompt */
    B.n_pages = 128 * 20 + 600;
    size_t pb;
    CS_ASSERT(B.b->iface->kv_init(B.b->ctx, B.n_pages, B.page_size, &pb) == 0);
    B.logits = malloc(sizeof(float) * (size_t)B.cf.n_vocab * 128);
    perf(&B, synth ? "llama3_8b" : "default", bw, rate);
    printf("RESULT %s.kv_page_bytes %zu\n", synth ? "llama3_8b" : "default", pb);
    cs_backend_free(B.b);
    cs_model_free(m);
    free(B.logits);
    return 0;
}
