/* test_ops_isa.c: the fast CPU ops (kernels/cpu/ops_fast.c) give the same
 * bits whatever instruction set the build targets. This build's ops
 * (AVX-512 when the compiler targets it, else the generic vectors) against
 * two more copies of the same source built for x86-64 with AVX2 + FMA and
 * for the x86-64 baseline (ops_fast_copy.c), by memcmp: RMSNorm over widths
 * with and without a tail; SwiGLU over inputs that drive e^x into both
 * clamps and below the normal range; RoPE; attention on fp32 and bf16 pools
 * (prompt chunks, decode tokens, GQA, ragged pages, and scores spread wide
 * enough that softmax weights underflow). With the quantized GEMM, which
 * picks its kernels at run time and is held to its C reference by
 * test_qmat, these are the whole quantized forward pass. */
#include <stdbool.h>
#include <stdint.h>

#include "chunkserve/ops.h"
#include "test.h"

#if !defined(__x86_64__)
int main(void) {
    printf("SKIP: the ISA copies are built on x86-64 only\n");
    return 77;
}
#else

__typeof__(cs_op_rmsnorm) avx2_rmsnorm, base_rmsnorm;
__typeof__(cs_op_rope) avx2_rope, base_rope;
__typeof__(cs_op_glu) avx2_glu, base_glu;
__typeof__(cs_op_attention) avx2_attention, base_attention;

typedef struct {
    const char *name;
    __typeof__(cs_op_rmsnorm) *rmsnorm;
    __typeof__(cs_op_rope) *rope;
    __typeof__(cs_op_glu) *glu;
    __typeof__(cs_op_attention) *attention;
} ops_copy;

static const ops_copy copies[] = {
    {"x86-64 baseline", base_rmsnorm, base_rope, base_glu, base_attention},
    {"x86-64 + AVX2 + FMA", avx2_rmsnorm, avx2_rope, avx2_glu, avx2_attention},
};
static int n_copies; /* the AVX2 copy runs only where the CPU has AVX2 and FMA */

static uint64_t rng = 0x243f6a8885a308d3u;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1 << 23) - 1.0f;
}
static float *frandn(size_t n, float scale) {
    float *p = malloc(n * sizeof(float));
    ASSERT_TRUE(p);
    for (size_t i = 0; i < n; i++)
        p[i] = scale * frand();
    return p;
}

static void same(const char *what, const char *copy, const float *a, const float *b, size_t n) {
    if (memcmp(a, b, n * sizeof(float)) == 0) return;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float))) {
            fprintf(stderr, "%s: %s differs from this build at [%zu]: %.9g vs %.9g\n", what, copy,
                    i, b[i], a[i]);
            break;
        }
    exit(1);
}

static void test_rmsnorm(int n_tokens, int dim) {
    size_t n = (size_t)n_tokens * dim;
    float *x = frandn(n, 4.0f), *w = frandn((size_t)dim, 1.0f), *want = malloc(n * sizeof(float)),
          *got = malloc(n * sizeof(float));
    cs_op_rmsnorm(NULL, want, x, w, n_tokens, dim, 1e-5f);
    for (int c = 0; c < n_copies; c++) {
        copies[c].rmsnorm(NULL, got, x, w, n_tokens, dim, 1e-5f);
        same("rmsnorm", copies[c].name, want, got, n);
    }
    free(x), free(w), free(want), free(got);
}

static void test_glu(cs_act act) {
    const size_t n = 4099;
    float *g = frandn(n, 140.0f), *u = frandn(n, 1.0f), *want = malloc(n * sizeof(float)),
          *got = malloc(n * sizeof(float));
    for (size_t i = 0; i < 64; i++) /* e^-g around the edges of exp's range */
        g[i] = 86.0f + 0.7f * (float)i;
    g[64] = INFINITY, g[65] = -INFINITY, g[66] = 0.0f, g[67] = -0.0f;
    cs_op_glu(NULL, want, g, u, n, act);
    for (int c = 0; c < n_copies; c++) {
        copies[c].glu(NULL, got, g, u, n, act);
        same(act == CS_ACT_SILU ? "swiglu" : "geglu", copies[c].name, want, got, n);
    }
    free(g), free(u), free(want), free(got);
}

static void test_rope(void) {
    const int n_tokens = 7, n_heads = 5, hd = 64;
    size_t n = (size_t)n_tokens * n_heads * hd;
    float *x = frandn(n, 2.0f), *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    float inv_freq[32];
    for (int i = 0; i < 32; i++)
        inv_freq[i] = powf(10000.0f, -(float)i / 32.0f);
    int32_t pos[7] = {0, 1, 2, 100, 1000, 4097, 30000};
    memcpy(want, x, n * sizeof(float));
    cs_op_rope(NULL, want, n_tokens, n_heads, hd, pos, inv_freq);
    for (int c = 0; c < n_copies; c++) {
        memcpy(got, x, n * sizeof(float));
        copies[c].rope(NULL, got, n_tokens, n_heads, hd, pos, inv_freq);
        same("rope", copies[c].name, want, got, n);
    }
    free(x), free(want), free(got);
}

/* With wide scores (q_scale > 10) every other V row gets zeros in its
 * heads' first 4 dims: where a row's top key has such zeros, those outputs
 * are sums of weights far below 1, which show how e^x ends its range. */
static void zero_dims(float *v, int n_rows, int n_kv_heads, int hd, int row0, float q_scale) {
    if (q_scale <= 10) return;
    for (int r = 0; r < n_rows; r++)
        if ((row0 + r) % 2 == 0)
            for (int h = 0; h < n_kv_heads; h++)
                memset(v + ((size_t)r * n_kv_heads + h) * hd, 0, 4 * sizeof(float));
}

/* Spans (n_q, pos): a prompt chunk after history, two decode tokens, a
 * prompt from position 0; pages of page_size in scrambled order. */
static void test_attention(bool bf16, int n_heads, int n_kv_heads, int hd, int page_size,
                           float q_scale, int window) {
    const int n_spans = 4, shape[4][2] = {{37, 50}, {1, 200}, {1, 7}, {70, 0}};
    const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
    int n_tokens = 0, n_pages = 0;
    for (int s = 0; s < n_spans; s++) {
        n_tokens += shape[s][0];
        n_pages += (shape[s][0] + shape[s][1] + page_size - 1) / page_size;
    }
    const size_t page_stride = 2 * (size_t)page_size * kv_dim;
    float *pool = calloc((size_t)n_pages * page_stride, sizeof(float));
    uint16_t *pool16 = calloc((size_t)n_pages * page_stride, sizeof(uint16_t));
    int32_t *pages = malloc((size_t)n_pages * sizeof(int32_t));
    ASSERT_TRUE(pool && pool16 && pages);
    ASSERT_TRUE(n_pages % 7 != 0); /* so that i * 7 + 3 scrambles without repeats */
    for (int i = 0; i < n_pages; i++)
        pages[i] = (int32_t)((i * 7 + 3) % n_pages);
    cs_kv_view kv = {bf16 ? NULL : pool, page_stride, (size_t)page_size * kv_dim, page_size,
                     bf16 ? pool16 : NULL};
    cs_attn_span spans[4];
    int used = 0, q0 = 0;
    for (int s = 0; s < n_spans; s++) {
        spans[s] = (cs_attn_span){q0, shape[s][0], shape[s][1], pages + used};
        used += (shape[s][0] + shape[s][1] + page_size - 1) / page_size;
        q0 += shape[s][0];
        /* history: through kv_store as well, one position at a time */
        for (int p = 0; p < shape[s][1]; p++) {
            float *k = frandn((size_t)kv_dim, 2.0f), *v = frandn((size_t)kv_dim, 1.0f);
            zero_dims(v, 1, n_kv_heads, hd, p, q_scale);
            cs_attn_span one = {0, 1, p, spans[s].pages};
            cs_op_kv_store(&kv, &one, 1, k, v, kv_dim);
            free(k), free(v);
        }
    }
    float *k = frandn((size_t)n_tokens * kv_dim, 2.0f),
          *v = frandn((size_t)n_tokens * kv_dim, 1.0f);
    float *q = frandn((size_t)n_tokens * q_dim, q_scale);
    zero_dims(v, n_tokens, n_kv_heads, hd, 0, q_scale);
    cs_op_kv_store(&kv, spans, n_spans, k, v, kv_dim);
    size_t n = (size_t)n_tokens * q_dim;
    float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    const float scale = 1.0f / sqrtf((float)hd);
    cs_op_attention(NULL, want, q, spans, n_spans, &kv, n_heads, n_kv_heads, hd, scale, window);
    char what[128];
    snprintf(what, sizeof what, "attention (%s KV, %d/%d heads x %d, page %d, q x %g, window %d)",
             bf16 ? "bf16" : "fp32", n_heads, n_kv_heads, hd, page_size, q_scale, window);
    for (int c = 0; c < n_copies; c++) {
        memset(got, 0xff, n * sizeof(float));
        copies[c].attention(NULL, got, q, spans, n_spans, &kv, n_heads, n_kv_heads, hd, scale,
                            window);
        same(what, copies[c].name, want, got, n);
    }
    free(pool), free(pool16), free(pages), free(k), free(v), free(q), free(want), free(got);
}

int main(void) {
    __builtin_cpu_init();
    n_copies = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 1;
#ifdef __AVX512F__
    printf("this build: AVX-512 (16 lanes); against");
#else
    printf("this build: generic vectors (8 lanes); against");
#endif
    for (int c = 0; c < n_copies; c++)
        printf(" [%s]", copies[c].name);
    printf("\n");
    const int dims[] = {576, 64, 16, 8, 100, 7, 1};
    for (int i = 0; i < 7; i++)
        test_rmsnorm(3, dims[i]);
    test_glu(CS_ACT_SILU);
    test_glu(CS_ACT_GELU_TANH);
    test_rope();
    for (int bf16 = 0; bf16 < 2; bf16++) {
        test_attention(bf16, 9, 3, 64, 16, 2.0f, 0); /* SmolLM2's heads */
        test_attention(bf16, 4, 4, 32, 5, 2.0f, 0);
        test_attention(bf16, 8, 1, 48, 16, 2.0f, 0);
        test_attention(bf16, 6, 2, 36, 16, 2.0f, 0);  /* head_dim not a multiple of 8 */
        test_attention(bf16, 9, 3, 64, 16, 40.0f, 0); /* weights underflow */
        test_attention(bf16, 4, 1, 64, 16, 2.0f, 24); /* sliding windows */
        test_attention(bf16, 9, 3, 64, 5, 2.0f, 100);
    }
    printf("ok\n");
    return 0;
}
#endif
