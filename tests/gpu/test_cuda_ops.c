/* test_cuda_ops: every CUDA kernel (kernels/cuda/kernels.cu) and the cuBLAS
 * GEMM against the CPU reference ops (kernels/cpu/ops_ref.c) by normalized
 * error, on random ragged shapes. Inputs are rounded to bf16 before the
 * reference sees them, so the tolerances measure the kernel (fp32
 * accumulation, bf16 outputs: ~2^-9 relative), not the weight format.
 * Exits 77 (CTest skip) without a usable GPU. Also built against the host
 * emulation of the CUDA backend (tests/emu: test_cuda_ops_emu, quick
 * shapes). */
#include <cuda_runtime_api.h>

#include "cuda_impl.h"
#include "gpu_test.h"
#include "chunkserve/ops.h"

#define TOL_F32 2e-5  /* fp32 outputs from bf16-exact inputs */
#define TOL_BF16 6e-3 /* bf16 outputs */

static cublasHandle_t blas;

static void *dup_to_dev(const void *h, size_t bytes) {
    void *d = NULL;
    CS_CUDA_CHECK(cudaMalloc(&d, bytes ? bytes : 4));
    if (bytes) CS_CUDA_CHECK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}
static void *dev_zero(size_t bytes) {
    void *d = NULL;
    CS_CUDA_CHECK(cudaMalloc(&d, bytes ? bytes : 4));
    CS_CUDA_CHECK(cudaMemset(d, 0, bytes ? bytes : 4));
    return d;
}
static float *rand_f32(size_t n, int bf16_exact) {
    float *p = malloc(n * sizeof *p);
    ASSERT_TRUE(p);
    for (size_t i = 0; i < n; i++)
        p[i] = bf16_exact ? gt_round_bf16(gt_frand()) : gt_frand();
    return p;
}
static uint16_t *to_bf16(const float *f, size_t n) {
    uint16_t *p = malloc(n * sizeof *p + 2);
    ASSERT_TRUE(p);
    for (size_t i = 0; i < n; i++)
        p[i] = cs_f32_to_bf16(f[i]);
    return p;
}
static float *down_f32(const float *d, size_t n) {
    float *h = malloc(n * sizeof *h + 4);
    ASSERT_TRUE(h);
    CS_CUDA_CHECK(cudaDeviceSynchronize());
    CS_CUDA_CHECK(cudaMemcpy(h, d, n * sizeof *h, cudaMemcpyDeviceToHost));
    return h;
}
static float *down_bf16(const uint16_t *d, size_t n) {
    uint16_t *t = malloc(n * sizeof *t + 2);
    float *h = malloc(n * sizeof *h + 4);
    ASSERT_TRUE(t && h);
    CS_CUDA_CHECK(cudaDeviceSynchronize());
    CS_CUDA_CHECK(cudaMemcpy(t, d, n * sizeof *t, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        h[i] = cs_bf16_to_f32(t[i]);
    free(t);
    return h;
}

static void test_gemm(void) {
    static const int shapes[][3] = {
        {1, 64, 64}, {7, 96, 200}, {33, 130, 64}, {128, 256, 512}, {5, 1000, 48}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int T = shapes[k][0], rows = shapes[k][1], cols = shapes[k][2];
        float *x = rand_f32((size_t)T * cols, 1), *w = rand_f32((size_t)rows * cols, 1);
        float *res = rand_f32((size_t)T * rows, 0), *ref = malloc(sizeof(float) * T * rows);
        cs_op_matmul_ref(ref, x, w, NULL, T, rows, cols);
        uint16_t *xb = to_bf16(x, (size_t)T * cols), *wb = to_bf16(w, (size_t)rows * cols);
        uint16_t *dx = dup_to_dev(xb, (size_t)T * cols * 2),
                 *dw = dup_to_dev(wb, (size_t)rows * cols * 2);
        float *dout = dev_zero((size_t)T * rows * 4);
        cs__cuda_gemm(blas, dout, dx, dw, T, rows, cols, 0.0f);
        float *got = down_f32(dout, (size_t)T * rows);
        char what[96];
        snprintf(what, sizeof what, "gemm T=%d rows=%d cols=%d", T, rows, cols);
        GT_CHECK_ERR(what, gt_norm_err(got, ref, (size_t)T * rows), TOL_F32);
        /* beta = 1: the residual add in the epilogue */
        CS_CUDA_CHECK(cudaMemcpy(dout, res, (size_t)T * rows * 4, cudaMemcpyHostToDevice));
        cs__cuda_gemm(blas, dout, dx, dw, T, rows, cols, 1.0f);
        free(got);
        got = down_f32(dout, (size_t)T * rows);
        for (size_t i = 0; i < (size_t)T * rows; i++)
            ref[i] += res[i];
        snprintf(what, sizeof what, "gemm + residual T=%d rows=%d cols=%d", T, rows, cols);
        GT_CHECK_ERR(what, gt_norm_err(got, ref, (size_t)T * rows), TOL_F32);
        free(x), free(w), free(res), free(ref), free(xb), free(wb), free(got);
        CS_CUDA_CHECK(cudaFree(dx));
        CS_CUDA_CHECK(cudaFree(dw));
        CS_CUDA_CHECK(cudaFree(dout));
    }
}

static void test_embed_rmsnorm_swiglu(void) {
    for (int iter = 0; iter < 4; iter++) {
        int T = 1 + gt_irand(40), dim = 16 * (1 + gt_irand(40)), V = 50 + gt_irand(100);
        float *table = rand_f32((size_t)V * dim, 1);
        int32_t *ids = malloc(sizeof(int32_t) * T);
        for (int t = 0; t < T; t++)
            ids[t] = gt_irand(V);
        float *ref = malloc(sizeof(float) * T * dim);
        cs_op_embed(ref, table, ids, T, dim);
        uint16_t *tb = to_bf16(table, (size_t)V * dim);
        uint16_t *dtable = dup_to_dev(tb, (size_t)V * dim * 2);
        int32_t *dids = dup_to_dev(ids, sizeof(int32_t) * T);
        float *dx = dev_zero((size_t)T * dim * 4);
        cs__cuda_embed(dx, dtable, dids, T, dim, 1.0f, 0);
        float *got = down_f32(dx, (size_t)T * dim);
        char what[96];
        snprintf(what, sizeof what, "embed T=%d dim=%d", T, dim);
        GT_CHECK_ERR(what, gt_norm_err(got, ref, (size_t)T * dim), 0.0);

        /* rmsnorm over a row subset (the logits path) and over all rows */
        float *w = rand_f32(dim, 0), *x = rand_f32((size_t)T * dim, 0);
        int n_rows = 1 + gt_irand(T);
        int32_t *rows = malloc(sizeof(int32_t) * n_rows);
        float *xs = malloc(sizeof(float) * n_rows * dim),
              *rref = malloc(sizeof(float) * n_rows * dim);
        for (int r = 0; r < n_rows; r++) {
            rows[r] = gt_irand(T);
            memcpy(xs + (size_t)r * dim, x + (size_t)rows[r] * dim, sizeof(float) * dim);
        }
        cs_op_rmsnorm_ref(rref, xs, w, n_rows, dim, 1e-5f);
        float *dw = dup_to_dev(w, sizeof(float) * dim),
              *dxx = dup_to_dev(x, sizeof(float) * T * dim);
        int32_t *drows = dup_to_dev(rows, sizeof(int32_t) * n_rows);
        float *d32 = dev_zero(sizeof(float) * n_rows * dim);
        uint16_t *d16 = dev_zero(2 * (size_t)n_rows * dim);
        cs__cuda_rmsnorm(d16, d32, dxx, drows, dw, n_rows, dim, 1e-5f, 0);
        float *g32 = down_f32(d32, (size_t)n_rows * dim),
              *g16 = down_bf16(d16, (size_t)n_rows * dim);
        snprintf(what, sizeof what, "rmsnorm fp32 rows=%d/%d dim=%d", n_rows, T, dim);
        GT_CHECK_ERR(what, gt_norm_err(g32, rref, (size_t)n_rows * dim), TOL_F32);
        snprintf(what, sizeof what, "rmsnorm bf16 rows=%d/%d dim=%d", n_rows, T, dim);
        GT_CHECK_ERR(what, gt_norm_err(g16, rref, (size_t)n_rows * dim), TOL_BF16);

        /* swiglu over [gate | up] rows */
        int hid = 8 + gt_irand(300);
        float *gu = rand_f32((size_t)T * 2 * hid, 0);
        float *gate = malloc(sizeof(float) * T * hid), *up = malloc(sizeof(float) * T * hid),
              *sref = malloc(sizeof(float) * T * hid);
        for (int t = 0; t < T; t++) {
            memcpy(gate + (size_t)t * hid, gu + (size_t)t * 2 * hid, sizeof(float) * hid);
            memcpy(up + (size_t)t * hid, gu + (size_t)t * 2 * hid + hid, sizeof(float) * hid);
        }
        cs_op_glu_ref(sref, gate, up, (size_t)T * hid, CS_ACT_SILU);
        float *dgu = dup_to_dev(gu, sizeof(float) * T * 2 * hid);
        uint16_t *dso = dev_zero(2 * (size_t)T * hid);
        cs__cuda_glu(dso, dgu, T, hid, CS_ACT_SILU, 0);
        float *gs = down_bf16(dso, (size_t)T * hid);
        snprintf(what, sizeof what, "swiglu T=%d hidden=%d", T, hid);
        GT_CHECK_ERR(what, gt_norm_err(gs, sref, (size_t)T * hid), TOL_BF16);
        free(gs);
        cs_op_glu_ref(sref, gate, up, (size_t)T * hid, CS_ACT_GELU_TANH); /* Gemma's GeGLU */
        cs__cuda_glu(dso, dgu, T, hid, CS_ACT_GELU_TANH, 0);
        gs = down_bf16(dso, (size_t)T * hid);
        snprintf(what, sizeof what, "geglu T=%d hidden=%d", T, hid);
        GT_CHECK_ERR(what, gt_norm_err(gs, sref, (size_t)T * hid), TOL_BF16);

        /* a post norm and its residual add (Gemma): x += rmsnorm(y) * w */
        float *y = rand_f32((size_t)T * dim, 0), *aref = malloc(sizeof(float) * T * dim);
        cs_op_rmsnorm_ref(aref, y, w, T, dim, 1e-6f);
        for (size_t i = 0; i < (size_t)T * dim; i++)
            aref[i] += x[i];
        float *dxa = dup_to_dev(x, sizeof(float) * T * dim),
              *dy = dup_to_dev(y, sizeof(float) * T * dim),
              *dw2 = dup_to_dev(w, sizeof(float) * dim);
        cs__cuda_add_rmsnorm(dxa, dy, dw2, T, dim, 1e-6f, 0);
        float *ga = down_f32(dxa, (size_t)T * dim);
        snprintf(what, sizeof what, "post norm + residual T=%d dim=%d", T, dim);
        GT_CHECK_ERR(what, gt_norm_err(ga, aref, (size_t)T * dim), TOL_F32);
        free(y), free(aref), free(ga);

        free(table), free(ids), free(ref), free(tb), free(got), free(w), free(x), free(rows),
            free(xs), free(rref);
        free(g32), free(g16), free(gu), free(gate), free(up), free(sref), free(gs);
        void *dev[] = {dtable, dids, dx, dw, dxx, drows, d32, d16, dgu, dso, dxa, dy, dw2};
        for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
            CS_CUDA_CHECK(cudaFree(dev[i]));
    }
}

/* bias + RoPE + KV store, then attention, on random ragged spans (prompt
 * chunks over cached pages, decode tokens), GQA shapes, page sizes; then the
 * page gather/scatter of kv_export/kv_import. */
static void test_attention_case(int nh, int nkv, int hd, int page_size, int n_spans, int max_pos,
                                int max_q) {
    const int n_layers = 2, layer = 1, qd = nh * hd, kvd = nkv * hd, width = qd + 2 * kvd;
    cs_attn_span sp[8];
    int32_t pos[8], nq[8], npg[8], T = 0, P = 0;
    for (int s = 0; s < n_spans; s++) {
        pos[s] = gt_irand(3) == 0 ? 0 : gt_irand(max_pos);
        nq[s] = gt_irand(3) == 0 ? 1 : 1 + gt_irand(max_q); /* a third decode tokens */
        npg[s] = (pos[s] + nq[s] + page_size - 1) / page_size;
        T += nq[s], P += npg[s];
    }
    const int n_pages = P + 3;
    /* distinct shuffled page ids: spans never share pages here */
    int32_t *perm = malloc(sizeof(int32_t) * n_pages), *ptab = malloc(sizeof(int32_t) * P);
    for (int i = 0; i < n_pages; i++)
        perm[i] = i;
    for (int i = n_pages - 1; i > 0; i--) {
        int j = gt_irand(i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    memcpy(ptab, perm, sizeof(int32_t) * P);
    const size_t page_elems = (size_t)n_layers * 2 * page_size * kvd, pool_n = page_elems * n_pages;
    float *pool = malloc(sizeof(float) * pool_n);
    ASSERT_TRUE(pool);
    for (size_t i = 0; i < pool_n; i++)
        pool[i] = NAN;
    cs_kv_view kv = {pool + (size_t)layer * 2 * page_size * kvd, page_elems,
                     (size_t)page_size * kvd, page_size, NULL};
    int32_t *tpos = malloc(sizeof(int32_t) * T), *tpage = malloc(sizeof(int32_t) * T),
            *tslot = malloc(sizeof(int32_t) * T);
    int32_t t = 0, poff = 0;
    int rows_per_tile = cs__cuda_attention_tile_rows(nh, nkv);
    cs_cuda_att_tile *tiles = malloc(sizeof *tiles * T);
    int n_tiles = 0;
    for (int s = 0; s < n_spans; s++) {
        sp[s] = (cs_attn_span){t, nq[s], pos[s], ptab + poff};
        /* the cached context: bf16-exact random K and V at positions < pos */
        for (int32_t p = 0; p < pos[s]; p++) {
            float *k = kv.k + (size_t)sp[s].pages[p / page_size] * page_elems +
                       (size_t)(p % page_size) * kvd;
            for (int i = 0; i < kvd; i++)
                k[i] = gt_round_bf16(gt_frand()), k[kv.v_offset + i] = gt_round_bf16(gt_frand());
        }
        for (int32_t i0 = 0; i0 < nq[s]; i0 += rows_per_tile)
            tiles[n_tiles++] = (cs_cuda_att_tile){
                t + i0, nq[s] - i0 < rows_per_tile ? nq[s] - i0 : rows_per_tile, pos[s] + i0, poff};
        for (int i = 0; i < nq[s]; i++, t++) {
            tpos[t] = pos[s] + i;
            tpage[t] = sp[s].pages[tpos[t] / page_size];
            tslot[t] = tpos[t] % page_size;
        }
        poff += npg[s];
    }
    /* device pool = the host pool in bf16 (NaN included), before the store */
    uint16_t *pool16 = to_bf16(pool, pool_n);
    cs_cuda_kv dkv = {dup_to_dev(pool16, pool_n * 2), page_elems, page_size, kvd};

    /* reference: bias, RoPE on q and k, store bf16-rounded k and v */
    float *qkv = rand_f32((size_t)T * width, 0), *bias = rand_f32(width, 0),
          *inv = malloc(sizeof(float) * hd / 2);
    for (int i = 0; i < hd / 2; i++)
        inv[i] = powf(10000.0f, -2.0f * i / hd);
    float *q = malloc(sizeof(float) * T * qd), *k = malloc(sizeof(float) * T * kvd),
          *v = malloc(sizeof(float) * T * kvd);
    for (int tt = 0; tt < T; tt++) {
        const float *r = qkv + (size_t)tt * width;
        for (int i = 0; i < qd; i++)
            q[(size_t)tt * qd + i] = r[i] + bias[i];
        for (int i = 0; i < kvd; i++) {
            k[(size_t)tt * kvd + i] = r[qd + i] + bias[qd + i];
            v[(size_t)tt * kvd + i] = gt_round_bf16(r[qd + kvd + i] + bias[qd + kvd + i]);
        }
    }
    cs_op_rope_ref(q, T, nh, hd, tpos, inv);
    cs_op_rope_ref(k, T, nkv, hd, tpos, inv);
    for (size_t i = 0; i < (size_t)T * kvd; i++)
        k[i] = gt_round_bf16(k[i]);
    cs_op_kv_store(&kv, sp, n_spans, k, v, kvd);

    float *dqkv = dup_to_dev(qkv, sizeof(float) * T * width),
          *dbias = dup_to_dev(bias, sizeof(float) * width);
    float *dinv = dup_to_dev(inv, sizeof(float) * hd / 2), *dq = dev_zero(sizeof(float) * T * qd);
    int32_t *dpos = dup_to_dev(tpos, 4 * (size_t)T), *dpage = dup_to_dev(tpage, 4 * (size_t)T),
            *dslot = dup_to_dev(tslot, 4 * (size_t)T);
    cs__cuda_qkv_rope_store(dq, dqkv, dbias, NULL, NULL, 1e-6f, dpos, dinv, dpage, dslot, dkv,
                            layer, T, nh, nkv, hd, 0);
    float *gq = down_f32(dq, (size_t)T * qd), *gpool = down_bf16(dkv.pool, pool_n);
    char what[128];
    snprintf(what, sizeof what, "bias+rope q  heads %d/%d hd %d T %d", nh, nkv, hd, T);
    GT_CHECK_ERR(what, gt_norm_err(gq, q, (size_t)T * qd), TOL_F32);
    snprintf(what, sizeof what, "rope+kv store  heads %d/%d hd %d ps %d T %d", nh, nkv, hd,
             page_size, T);
    GT_CHECK_ERR(what, gt_norm_err(gpool, pool, pool_n), TOL_BF16);

    /* attention: the reference's q and pool on both sides (isolates the kernel) */
    float *ref = malloc(sizeof(float) * T * qd);
    cs_op_attention_ref(ref, q, sp, n_spans, &kv, nh, nkv, hd, 1.0f / sqrtf((float)hd), 0);
    uint16_t *ref_pool16 = to_bf16(pool, pool_n);
    CS_CUDA_CHECK(cudaMemcpy(dkv.pool, ref_pool16, pool_n * 2, cudaMemcpyHostToDevice));
    CS_CUDA_CHECK(cudaMemcpy(dq, q, sizeof(float) * T * qd, cudaMemcpyHostToDevice));
    cs_cuda_att_tile *dtiles = dup_to_dev(tiles, sizeof *tiles * n_tiles);
    int32_t *dptab = dup_to_dev(ptab, 4 * (size_t)P);
    uint16_t *dout = dev_zero(2 * (size_t)T * qd);
    int max_ctx = 0;
    for (int s = 0; s < n_spans; s++)
        if (pos[s] + nq[s] > max_ctx) max_ctx = pos[s] + nq[s];
    /* whole contexts per block, then split-K: the policy splits a grid
     * smaller than the SM count, so claim 4x this grid's blocks as SMs */
    cs_cuda_att_scratch split = {NULL, NULL, 12 * n_tiles * nkv, 4 * n_tiles * nkv};
    size_t o_floats, ml_floats;
    cs__cuda_attention_scratch_size(split.max_parts, hd, &o_floats, &ml_floats);
    split.o = dev_zero(o_floats * 4), split.ml = dev_zero(ml_floats * 4);
    for (int pass = 0; pass < 2; pass++) {
        CS_CUDA_CHECK(cudaMemset(dout, 0xff, 2 * (size_t)T * qd));
        cs__cuda_attention(dout, dq, dtiles, n_tiles, max_ctx, dptab, dkv, layer, nh, nkv, hd,
                           1.0f / sqrtf((float)hd), 0, pass ? &split : NULL, 0);
        float *gout = down_bf16(dout, (size_t)T * qd);
        snprintf(what, sizeof what, "attention%s heads %d/%d hd %d ps %d spans %d T %d ctx %d",
                 pass ? " (split-K)" : "", nh, nkv, hd, page_size, n_spans, T, max_ctx);
        GT_CHECK_ERR(what, gt_norm_err(gout, ref, (size_t)T * qd), TOL_BF16);
        free(gout);
    }
    CS_CUDA_CHECK(cudaFree(split.o));
    CS_CUDA_CHECK(cudaFree(split.ml));

    /* page gather (export) then scatter (import) into other pages */
    int n_move = 1 + gt_irand(n_pages);
    int32_t *mv = malloc(sizeof(int32_t) * n_move);
    for (int i = 0; i < n_move; i++)
        mv[i] = perm[(i * 7) % n_pages];
    size_t pb = page_elems * 2;
    int32_t *dmv = dup_to_dev(mv, 4 * (size_t)n_move);
    uint16_t *dflat = dev_zero(pb * n_move);
    cs_cuda_kv_gather(dkv.pool, pb, dmv, n_move, dflat, NULL, 0);
    uint16_t *flat = malloc(pb * n_move);
    CS_CUDA_CHECK(cudaDeviceSynchronize());
    CS_CUDA_CHECK(cudaMemcpy(flat, dflat, pb * n_move, cudaMemcpyDeviceToHost));
    int same = 1;
    for (int i = 0; i < n_move; i++)
        same &=
            memcmp(flat + (size_t)i * page_elems, ref_pool16 + (size_t)mv[i] * page_elems, pb) == 0;
    printf("  %-60s %s\n", "page gather (kv_export layout)", same ? "exact" : "MISMATCH");
    ASSERT_TRUE(same);
    for (int i = 0; i < n_move; i++)
        mv[i] = perm[(n_pages - 1 - i + n_pages) % n_pages];
    CS_CUDA_CHECK(cudaMemcpy(dmv, mv, 4 * (size_t)n_move, cudaMemcpyHostToDevice));
    cs_cuda_kv_scatter(dkv.pool, pb, dmv, n_move, dflat, NULL, 0);
    uint16_t *back = malloc(pool_n * 2);
    CS_CUDA_CHECK(cudaDeviceSynchronize());
    CS_CUDA_CHECK(cudaMemcpy(back, dkv.pool, pool_n * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n_move; i++) /* the last write of a page wins */
        memcpy(ref_pool16 + (size_t)mv[i] * page_elems, flat + (size_t)i * page_elems, pb);
    same = memcmp(back, ref_pool16, pool_n * 2) == 0;
    printf("  %-60s %s\n", "page scatter (kv_import layout)", same ? "exact" : "MISMATCH");
    ASSERT_TRUE(same);

    void *dev[] = {dkv.pool, dqkv,   dbias, dinv, dq,  dpos, dpage,
                   dslot,    dtiles, dptab, dout, dmv, dflat};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        CS_CUDA_CHECK(cudaFree(dev[i]));
    free(perm), free(ptab), free(pool), free(tpos), free(tpage), free(tslot), free(tiles),
        free(pool16);
    free(qkv), free(bias), free(inv), free(q), free(k), free(v), free(gq), free(gpool), free(ref),
        free(ref_pool16);
    free(mv), free(flat), free(back);
}

int main(void) {
    gpu_test_require("test_cuda_ops");
    CS_CUBLAS_CHECK(cublasCreate(&blas));
    test_gemm();
    test_embed_rmsnorm_swiglu();
    static const int shapes[][3] = {/* n_heads, n_kv_heads, head_dim */
                                    {4, 2, 16}, {9, 3, 64}, {32, 8, 128}, {8, 1, 256},
                                    {6, 6, 32}, {4, 4, 96}, {16, 1, 64}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int rep = 0; rep < 3; rep++) {
            static const int page_sizes[] = {1, 3, 16};
            test_attention_case(shapes[s][0], shapes[s][1], shapes[s][2], page_sizes[rep],
                                1 + gt_irand(6), 70, 24);
        }
    /* several query tiles per span and several key chunks per tile (not
     * under the host emulator, CS_EMU_QUICK: minutes there) */
    if (!getenv("CS_EMU_QUICK")) {
        test_attention_case(32, 8, 128, 16, 3, 600, 300);
        test_attention_case(9, 3, 64, 16, 3, 400, 200);
        test_attention_case(8, 1, 256, 3, 2, 200, 100);
    } else {
        test_attention_case(9, 3, 64, 16, 2, 200, 8); /* split-K on the emulator's 4 SMs */
    }
    CS_CUBLAS_CHECK(cublasDestroy(blas));
    printf("test_cuda_ops: all passed\n");
    return 0;
}
