/* test_cpu_ops.c: the fast CPU ops (kernels/cpu/ops_fast.c) against their
 * references (ops_ref.c) by normalized error ||fast - ref|| / ||ref||, on
 * random shapes and the ragged cases of paged attention; that a fast op's
 * output is bit-identical on pools of 1, 2 and 3 threads; and the thread
 * pool's split. Unwritten KV slots hold NaN, so an op that reads past a
 * sequence's context fails the error check. */
#include <stdatomic.h>
#include <stdint.h>

#include "chunkserve/ops.h"
#include "test.h"

#define TOL 1e-5

static cs_threadpool *pools[3]; /* 1, 2 and 3 threads */

static uint64_t rng = 0x9e3779b97f4a7c15u;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1 << 23) - 1.0f;
}
static int irand(int n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (int)(rng % (uint64_t)n);
}
static float *frandn(size_t n) {
    float *p = malloc(n * sizeof(float));
    ASSERT_TRUE(p);
    for (size_t i = 0; i < n; i++)
        p[i] = frand();
    return p;
}
static float *falloc(size_t n) {
    float *p = calloc(n, sizeof(float));
    ASSERT_TRUE(p);
    return p;
}

static double norm_err(const float *fast, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)fast[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* out[k] is the fast op's result on pools[k]: all within TOL of ref, and
 * bit-identical to each other. */
static void check(const char *what, float *const out[3], const float *ref, size_t n) {
    double err = norm_err(out[0], ref, n);
    printf("  %-52s err %.2e\n", what, err);
    ASSERT_TRUE(err <= TOL);
    ASSERT_TRUE(memcmp(out[0], out[1], n * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(out[0], out[2], n * sizeof(float)) == 0);
}

/* ---- thread pool ---- */

typedef struct {
    _Atomic int *visits;
    int *owner;
    int size;
} visit_arg;

static void visit(void *a, int64_t begin, int64_t end, int range) {
    visit_arg *v = a;
    ASSERT_TRUE(range >= 0 && range < v->size);
    ASSERT_TRUE(begin < end);
    for (int64_t i = begin; i < end; i++) {
        atomic_fetch_add(&v->visits[i], 1);
        v->owner[i] = range;
    }
}

static void test_threadpool(void) {
    printf("threadpool\n");
    cs_threadpool *p0 = NULL;
    ASSERT_EQ_INT(cs_threadpool_init(0, &p0), 0);
    ASSERT_TRUE(cs_threadpool_size(p0) >= 1);
    cs_threadpool_free(p0);
    cs_threadpool_free(NULL);
    ASSERT_EQ_INT(cs_threadpool_size(NULL), 1);

    const int64_t ns[] = {0, 1, 2, 3, 5, 1000};
    for (int k = 0; k < 3; k++) {
        int size = cs_threadpool_size(pools[k]);
        ASSERT_EQ_INT(size, k + 1);
        for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
            int64_t n = ns[c];
            _Atomic int visits[1000];
            int owner[1000], owner2[1000];
            for (int64_t i = 0; i < n; i++)
                atomic_init(&visits[i], 0);
            visit_arg v = {visits, owner, size};
            cs_threadpool_for(pools[k], n, visit, &v);
            for (int64_t i = 0; i < n; i++)
                ASSERT_EQ_INT(atomic_load(&visits[i]), 1);
            /* contiguous ranges in range order, the same every time */
            for (int64_t i = 1; i < n; i++)
                ASSERT_TRUE(owner[i] >= owner[i - 1]);
            memcpy(owner2, owner, sizeof owner);
            cs_threadpool_for(pools[k], n, visit, &v);
            for (int64_t i = 0; i < n; i++)
                ASSERT_EQ_INT(owner[i], owner2[i]);
            if (n >= size)
                for (int64_t i = 0; i < n; i++)
                    ASSERT_EQ_INT(owner[i], (int)(i * size / n));
        }
        /* many small jobs back to back: the wake/finish handshake */
        static _Atomic int many[2];
        atomic_init(&many[0], 0), atomic_init(&many[1], 0);
        int owner[2];
        visit_arg v = {many, owner, size};
        for (int r = 0; r < 20000; r++)
            cs_threadpool_for(pools[k], 2, visit, &v);
        ASSERT_EQ_INT(atomic_load(&many[0]), 20000);
        ASSERT_EQ_INT(atomic_load(&many[1]), 20000);
    }
}

/* ---- dense ops ---- */

static void test_matmul(void) {
    printf("matmul\n");
    const int shapes[][4] = {
        /* n_tokens, rows, cols, bias */
        {1, 37, 19, 0},    {1, 1000, 64, 1}, {1, 300, 576, 0},  {2, 33, 17, 1},   {5, 100, 64, 1},
        {64, 192, 130, 0}, {70, 400, 96, 1}, {300, 257, 48, 0}, {600, 20, 40, 1},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int n = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
        float *x = frandn((size_t)n * cols), *w = frandn((size_t)rows * cols);
        float *bias = shapes[s][3] ? frandn((size_t)rows) : NULL;
        float *ref = falloc((size_t)n * rows), *out[3];
        cs_op_matmul_ref(ref, x, w, bias, n, rows, cols);
        for (int k = 0; k < 3; k++) {
            out[k] = falloc((size_t)n * rows);
            cs_op_matmul(pools[k], out[k], x, w, bias, n, rows, cols);
        }
        char what[96];
        snprintf(what, sizeof what, "%d x %d -> %d%s", n, cols, rows, bias ? " + bias" : "");
        check(what, out, ref, (size_t)n * rows);
        /* NULL pool: the caller alone, same bits */
        cs_op_matmul(NULL, out[1], x, w, bias, n, rows, cols);
        ASSERT_TRUE(memcmp(out[0], out[1], (size_t)n * rows * sizeof(float)) == 0);
        free(x), free(w), free(bias), free(ref), free(out[0]), free(out[1]), free(out[2]);
    }
}

static void test_rmsnorm(void) {
    printf("rmsnorm\n");
    const int shapes[][2] = {{1, 576}, {7, 100}, {33, 17}, {300, 576}, {2, 5}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int n = shapes[s][0], dim = shapes[s][1];
        size_t sz = (size_t)n * dim;
        float *x = frandn(sz), *w = frandn((size_t)dim), *ref = falloc(sz), *out[3];
        cs_op_rmsnorm_ref(ref, x, w, n, dim, 1e-5f);
        for (int k = 0; k < 3; k++) {
            out[k] = falloc(sz);
            if (k == 2) { /* in place */
                memcpy(out[k], x, sz * sizeof(float));
                cs_op_rmsnorm(pools[k], out[k], out[k], w, n, dim, 1e-5f);
            } else {
                cs_op_rmsnorm(pools[k], out[k], x, w, n, dim, 1e-5f);
            }
        }
        char what[96];
        snprintf(what, sizeof what, "%d x %d", n, dim);
        check(what, out, ref, sz);
        free(x), free(w), free(ref), free(out[0]), free(out[1]), free(out[2]);
    }
}

static void test_rope(void) {
    printf("rope\n");
    const int shapes[][3] = {{1, 9, 64}, {5, 3, 64}, {40, 9, 16}, {300, 4, 128}, {3, 2, 6}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int n = shapes[s][0], nh = shapes[s][1], hd = shapes[s][2];
        size_t sz = (size_t)n * nh * hd;
        float *x = frandn(sz), *ref = falloc(sz), *out[3], inv_freq[64];
        int32_t *pos = malloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < hd / 2; i++)
            inv_freq[i] = powf(10000.0f, -2.0f * i / hd);
        for (int t = 0; t < n; t++)
            pos[t] = irand(8192);
        memcpy(ref, x, sz * sizeof(float));
        cs_op_rope_ref(ref, n, nh, hd, pos, inv_freq);
        for (int k = 0; k < 3; k++) {
            out[k] = falloc(sz);
            memcpy(out[k], x, sz * sizeof(float));
            cs_op_rope(pools[k], out[k], n, nh, hd, pos, inv_freq);
        }
        char what[96];
        snprintf(what, sizeof what, "%d tokens x %d heads x %d", n, nh, hd);
        check(what, out, ref, sz);
        /* same operations as the reference: exact */
        ASSERT_TRUE(memcmp(out[0], ref, sz * sizeof(float)) == 0);
        free(x), free(ref), free(pos), free(out[0]), free(out[1]), free(out[2]);
    }
}

static void test_glu(cs_act act) {
    printf("glu (%s)\n", act == CS_ACT_SILU ? "silu" : "gelu tanh");
    const size_t ns[] = {1, 15, 16, 17, 1000, 100003};
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
        size_t n = ns[c];
        float *g = frandn(n), *u = frandn(n), *ref = falloc(n), *out[3];
        for (size_t i = 0; i < n; i++)
            g[i] *= 12.0f; /* reach both tails of silu */
        cs_op_glu_ref(ref, g, u, n, act);
        for (int k = 0; k < 3; k++) {
            out[k] = falloc(n);
            if (k == 1) { /* in place */
                memcpy(out[k], g, n * sizeof(float));
                cs_op_glu(pools[k], out[k], out[k], u, n, act);
            } else {
                cs_op_glu(pools[k], out[k], g, u, n, act);
            }
        }
        char what[96];
        snprintf(what, sizeof what, "n %zu", n);
        check(what, out, ref, n);
        free(g), free(u), free(ref), free(out[0]), free(out[1]), free(out[2]);
    }
}

static void test_embed(void) {
    printf("embed\n");
    float *table = frandn(50 * 24), out[4 * 24];
    int32_t ids[4] = {7, 0, 49, 7};
    cs_op_embed(out, table, ids, 4, 24);
    for (int t = 0; t < 4; t++)
        ASSERT_TRUE(memcmp(out + t * 24, table + ids[t] * 24, 24 * sizeof(float)) == 0);
    free(table);
}

/* ---- paged KV and attention ---- */

typedef struct {
    int n_q, pos;
} span_shape;

/* One attention case: spans of the given shapes, each with its own pages
 * drawn in scrambled order from a shared pool. History positions [0, pos)
 * get random K/V written directly; the step's tokens go through
 * cs_op_kv_store. */
static int g_bf16; /* attention cases on a bf16 pool */

/* window > 0: a sliding window; the page-table entries of pages wholly
 * before a span's first row's window then name a page of NaNs (as if
 * released), which the ops must not read. */
static void attention_case(const char *name, const span_shape *shape, int n_spans, int n_heads,
                           int n_kv_heads, int head_dim, int page_size, int window) {
    const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    int n_tokens = 0, n_pages = 0;
    for (int s = 0; s < n_spans; s++) {
        n_tokens += shape[s].n_q;
        n_pages += (shape[s].pos + shape[s].n_q + page_size - 1) / page_size;
    }
    n_pages += 3; /* pages nobody owns */
    /* page layout as the CPU backend's: [page][layer 0..1][K, V][slot][kv_dim]; layer 1 is tested
     */
    const size_t layer_floats = 2 * (size_t)page_size * kv_dim, page_stride = 2 * layer_floats;
    float *pool = malloc((size_t)n_pages * page_stride * sizeof(float));
    uint16_t *pool16 = malloc((size_t)n_pages * page_stride * sizeof(uint16_t));
    ASSERT_TRUE(pool && pool16);
    for (size_t i = 0; i < (size_t)n_pages * page_stride; i++)
        pool[i] = NAN, pool16[i] = 0x7fc0; /* NaN */
    cs_kv_view kv = {pool + layer_floats, page_stride, (size_t)page_size * kv_dim, page_size, NULL};
    if (g_bf16) kv.k = NULL, kv.k16 = pool16 + layer_floats;

    int32_t *perm = malloc((size_t)n_pages * sizeof(int32_t));
    for (int i = 0; i < n_pages; i++)
        perm[i] = i;
    for (int i = n_pages - 1; i > 0; i--) {
        int j = irand(i + 1);
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    cs_attn_span *spans = calloc((size_t)n_spans, sizeof *spans);
    int used = 0, q_begin = 0;
    for (int s = 0; s < n_spans; s++) {
        int np = (shape[s].pos + shape[s].n_q + page_size - 1) / page_size;
        spans[s] = (cs_attn_span){q_begin, shape[s].n_q, shape[s].pos, perm + used};
        used += np;
        q_begin += shape[s].n_q;
        for (int p = 0; p < shape[s].pos; p++) {
            size_t off = (size_t)spans[s].pages[p / page_size] * page_stride +
                         (size_t)(p % page_size) * kv_dim;
            for (int i = 0; i < kv_dim; i++) {
                float a = 2.0f * frand(), b = frand();
                if (g_bf16) {
                    kv.k16[off + i] = cs_f32_to_bf16(a);
                    kv.k16[off + kv.v_offset + i] = cs_f32_to_bf16(b);
                } else {
                    kv.k[off + i] = a, kv.k[off + kv.v_offset + i] = b;
                }
            }
        }
    }
    float *k = frandn((size_t)n_tokens * kv_dim), *v = frandn((size_t)n_tokens * kv_dim);
    float *q = frandn((size_t)n_tokens * q_dim);
    for (size_t i = 0; i < (size_t)n_tokens * q_dim; i++)
        q[i] *= 2.0f;
    cs_op_kv_store(&kv, spans, n_spans, k, v, kv_dim);
    /* kv_store put each token where the view says */
    for (int s = 0; s < n_spans; s++)
        for (int i = 0; i < spans[s].n_q; i++) {
            int p = spans[s].pos + i;
            size_t off = (size_t)spans[s].pages[p / page_size] * page_stride +
                         (size_t)(p % page_size) * kv_dim;
            size_t src = (size_t)(spans[s].q_begin + i) * kv_dim;
            if (g_bf16) { /* rounded to nearest even: within half a bf16 ulp (2^-8 relative) */
                for (int d = 0; d < kv_dim; d++) {
                    float a = cs_bf16_to_f32(kv.k16[off + d]), b = k[src + d];
                    ASSERT_TRUE(kv.k16[off + d] == cs_f32_to_bf16(b));
                    ASSERT_TRUE(fabsf(a - b) <= fabsf(b) * (1.0f / 256));
                    ASSERT_TRUE(kv.k16[off + kv.v_offset + d] == cs_f32_to_bf16(v[src + d]));
                }
                continue;
            }
            const float *slot = kv.k + off;
            ASSERT_TRUE(memcmp(slot, k + src, kv_dim * sizeof(float)) == 0);
            ASSERT_TRUE(memcmp(slot + kv.v_offset, v + src, kv_dim * sizeof(float)) == 0);
        }

    for (int s = 0; window > 0 && s < n_spans; s++) {
        int lo = spans[s].pos + 1 - window;
        for (int p = 0; p < lo / page_size; p++)
            ((int32_t *)spans[s].pages)[p] = perm[n_pages - 1]; /* nobody's: NaN */
    }
    /* a scale that is not 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar) */
    const float scale = window % 2 ? 0.37f : 1.0f / sqrtf((float)head_dim);
    size_t sz = (size_t)n_tokens * q_dim;
    float *ref = falloc(sz), *out[3];
    cs_op_attention_ref(ref, q, spans, n_spans, &kv, n_heads, n_kv_heads, head_dim, scale, window);
    for (int kk = 0; kk < 3; kk++) {
        out[kk] = falloc(sz);
        cs_op_attention(pools[kk], out[kk], q, spans, n_spans, &kv, n_heads, n_kv_heads, head_dim,
                        scale, window);
    }
    char what[128];
    snprintf(what, sizeof what, "%s (%d/%d heads x %d, page %d, window %d%s)", name, n_heads,
             n_kv_heads, head_dim, page_size, window, g_bf16 ? ", bf16 KV" : "");
    check(what, out, ref, sz);
    free(pool), free(pool16), free(perm), free(spans), free(k), free(v), free(q), free(ref);
    free(out[0]), free(out[1]), free(out[2]);
}

static void test_attention(void) {
    printf("attention\n");
    const int heads[][3] = {{9, 3, 64}, {4, 4, 64}, {6, 2, 16}, {3, 3, 16}, {12, 1, 32}};
    for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++) {
        int nh = heads[h][0], nkv = heads[h][1], hd = heads[h][2];
        const span_shape empty[] = {{1, 0}};
        const span_shape decode[] = {{1, 37}};
        const span_shape prompt[] = {{5, 0}};
        const span_shape crossing[] = {{20, 10}};
        const span_shape mixed[] = {{1, 100}, {13, 0}, {1, 0}, {40, 17}, {1, 15}, {2, 31}};
        const span_shape long_prompt[] = {{150, 0}};
        const span_shape long_decode[] = {{1, 250}, {1, 3}, {3, 70}};
        attention_case("1 token, empty cache", empty, 1, nh, nkv, hd, 16, 0);
        attention_case("decode at pos 37", decode, 1, nh, nkv, hd, 16, 0);
        attention_case("5-token prompt", prompt, 1, nh, nkv, hd, 16, 0);
        attention_case("20 tokens at pos 10, crossing pages", crossing, 1, nh, nkv, hd, 16, 0);
        attention_case("20 tokens at pos 10, page 7", crossing, 1, nh, nkv, hd, 7, 0);
        attention_case("6 spans, mixed", mixed, 6, nh, nkv, hd, 16, 0);
        attention_case("6 spans, mixed, page 5", mixed, 6, nh, nkv, hd, 5, 0);
        attention_case("6 spans, mixed, page 1", mixed, 6, nh, nkv, hd, 1, 0);
        attention_case("150-token prompt, page 64", long_prompt, 1, nh, nkv, hd, 64, 0);
        attention_case("long decode spans, page 256", long_decode, 3, nh, nkv, hd, 256, 0);
        /* sliding windows: narrower and wider than a tile or a key block,
         * spans starting inside and past the window */
        const int windows[] = {1, 5, 16, 33, 64, 97};
        for (size_t w = 0; w < sizeof windows / sizeof *windows; w++) {
            attention_case("window: 6 spans, mixed", mixed, 6, nh, nkv, hd, 5, windows[w]);
            attention_case("window: 150-token prompt", long_prompt, 1, nh, nkv, hd, 16, windows[w]);
            attention_case("window: long decode spans", long_decode, 3, nh, nkv, hd, 8, windows[w]);
            attention_case("window: crossing pages", crossing, 1, nh, nkv, hd, 7, windows[w]);
        }
    }
}

int main(void) {
    for (int k = 0; k < 3; k++)
        ASSERT_EQ_INT(cs_threadpool_init(k + 1, &pools[k]), 0);
    test_threadpool();
    test_matmul();
    test_rmsnorm();
    test_rope();
    test_glu(CS_ACT_SILU);
    test_glu(CS_ACT_GELU_TANH);
    test_embed();
    test_attention();
    g_bf16 = 1;
    test_attention();
    for (int k = 0; k < 3; k++)
        cs_threadpool_free(pools[k]);
    printf("ok\n");
    return 0;
}
