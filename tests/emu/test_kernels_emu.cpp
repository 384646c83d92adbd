/* test_kernels_emu: the CUDA backend's other kernels (kernels/cuda/
 * kernels.cuh: embedding gather (scaled), RMSNorm, the post norm + residual
 * add, the fused bias + QK-norm + RoPE + K/V page store, SwiGLU and GeGLU,
 * bf16 conversions), their own source compiled for the host
 * and run under the SIMT emulator (simt_emu.h) with the launchers' shapes
 * (and grid-stride loops cut short on purpose), against the CPU reference
 * ops (kernels/cpu/ops_ref.c) by normalized error on bf16-exact inputs, as
 * tests/gpu/test_cuda_ops.c does on a GPU. */
#include <cstdio>

#include "simt_emu.h"

#include "kernels.cuh"
#include "chunkserve/ops.h"

#define TOL_F32 2e-5  /* fp32 outputs from bf16-exact inputs */
#define TOL_BF16 6e-3 /* bf16 outputs */

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float frand() { /* uniform [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 4503599627370496.0 - 1.0);
}
static int irand(int n) {
    return (int)((frand() + 1.0f) * 0.5f * n) % n;
}
static float bf_round(float f) {
    return simt::bf16_f32(simt::bf16_rn(f));
}
static std::vector<float> rand_vec(size_t n, bool bf16_exact) {
    std::vector<float> v(n);
    for (float &x : v)
        x = bf16_exact ? bf_round(frand()) : frand();
    return v;
}
static std::vector<uint16_t> to_bf16(const std::vector<float> &f) {
    std::vector<uint16_t> b(f.size());
    for (size_t i = 0; i < f.size(); i++)
        b[i] = simt::bf16_rn(f[i]);
    return b;
}
static std::vector<float> from_bf16(const std::vector<uint16_t> &b) {
    std::vector<float> f(b.size());
    for (size_t i = 0; i < b.size(); i++)
        f[i] = simt::bf16_f32(b[i]);
    return f;
}
static double norm_err(const std::vector<float> &got, const std::vector<float> &ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); i++)
        num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]),
            den += (double)ref[i] * ref[i];
    return std::sqrt(num / (den > 0 ? den : 1)); /* NaN stays NaN: fails below */
}

static int failures;
static void check(const char *what, double err, double tol) {
    bool ok = err <= tol;
    printf("  %-58s err %.2e (tol %.0e) %s\n", what, err, tol, ok ? "ok" : "FAIL");
    failures += !ok;
}

static void test_embed_rmsnorm_swiglu() {
    for (int iter = 0; iter < 3; iter++) {
        int T = 1 + irand(12), dim = 16 * (1 + irand(40)), V = 50 + irand(100);
        char what[96];
        std::vector<float> table = rand_vec((size_t)V * dim, true), ref((size_t)T * dim),
                           got((size_t)T * dim, NAN);
        std::vector<int32_t> ids(T);
        for (int32_t &id : ids)
            id = irand(V);
        cs_op_embed(ref.data(), table.data(), ids.data(), T, dim);
        std::vector<uint16_t> tb = to_bf16(table);
        simt::launch(dim3(T), 256, [&] { k_embed(got.data(), tb.data(), ids.data(), dim, 1.0f); });
        snprintf(what, sizeof what, "embed T=%d dim=%d", T, dim);
        check(what, norm_err(got, ref), 0.0);
        const float es = sqrtf((float)dim); /* Gemma's scale */
        for (float &r : ref)
            r *= es;
        simt::launch(dim3(T), 256, [&] { k_embed(got.data(), tb.data(), ids.data(), dim, es); });
        snprintf(what, sizeof what, "embed x sqrt(dim) T=%d dim=%d", T, dim);
        check(what, norm_err(got, ref), 0.0);

        /* RMSNorm over a row subset (the logits path), fp32 and bf16 out */
        std::vector<float> w = rand_vec(dim, false), x = rand_vec((size_t)T * dim, false);
        int n_rows = 1 + irand(T);
        std::vector<int32_t> rows(n_rows);
        std::vector<float> xs((size_t)n_rows * dim), rref((size_t)n_rows * dim),
            g32((size_t)n_rows * dim, NAN);
        for (int r = 0; r < n_rows; r++) {
            rows[r] = irand(T);
            memcpy(&xs[(size_t)r * dim], &x[(size_t)rows[r] * dim], sizeof(float) * dim);
        }
        cs_op_rmsnorm_ref(rref.data(), xs.data(), w.data(), n_rows, dim, 1e-5f);
        std::vector<uint16_t> g16((size_t)n_rows * dim, 0xffff);
        simt::launch(dim3(n_rows), 256, [&] {
            k_rmsnorm(g16.data(), g32.data(), x.data(), rows.data(), w.data(), dim, 1e-5f);
        });
        snprintf(what, sizeof what, "rmsnorm fp32 rows=%d/%d dim=%d", n_rows, T, dim);
        check(what, norm_err(g32, rref), TOL_F32);
        snprintf(what, sizeof what, "rmsnorm bf16 rows=%d/%d dim=%d", n_rows, T, dim);
        check(what, norm_err(from_bf16(g16), rref), TOL_BF16);

        /* post norm + residual add: x += rmsnorm(y) * w */
        std::vector<float> y = rand_vec((size_t)T * dim, false), xa = x, aref = x,
                           ny((size_t)T * dim);
        cs_op_rmsnorm_ref(ny.data(), y.data(), w.data(), T, dim, 1e-6f);
        for (size_t i = 0; i < aref.size(); i++)
            aref[i] += ny[i];
        simt::launch(dim3(T), 256,
                     [&] { k_add_rmsnorm(xa.data(), y.data(), w.data(), dim, 1e-6f); });
        snprintf(what, sizeof what, "post norm + residual T=%d dim=%d", T, dim);
        check(what, norm_err(xa, aref), TOL_F32);

        /* SwiGLU over [gate | up] rows; 3 blocks of 64: the grid-stride loop wraps */
        int hid = 8 + irand(300);
        std::vector<float> gu = rand_vec((size_t)T * 2 * hid, false), gate((size_t)T * hid),
                           up((size_t)T * hid), sref((size_t)T * hid);
        for (int t = 0; t < T; t++) {
            memcpy(&gate[(size_t)t * hid], &gu[(size_t)t * 2 * hid], sizeof(float) * hid);
            memcpy(&up[(size_t)t * hid], &gu[(size_t)t * 2 * hid + hid], sizeof(float) * hid);
        }
        for (int act = CS_ACT_SILU; act <= CS_ACT_GELU_TANH; act++) {
            cs_op_glu_ref(sref.data(), gate.data(), up.data(), (size_t)T * hid, (cs_act)act);
            std::vector<uint16_t> so((size_t)T * hid, 0xffff);
            simt::launch(dim3(3), 64,
                         [&] { k_glu(so.data(), gu.data(), hid, (size_t)T * hid, act); });
            snprintf(what, sizeof what, "%s T=%d hidden=%d", act ? "geglu" : "swiglu", T, hid);
            check(what, norm_err(from_bf16(so), sref), TOL_BF16);
        }
    }
}

/* bias (+ QK-norm) + RoPE on q and k, K/V stored as bf16 into their pages and slots */
static void test_qkv_rope_store(int nh, int nkv, int hd, int ps, bool bias, bool qk_norm = false) {
    const int n_layers = 2, layer = 1, qd = nh * hd, kvd = nkv * hd, width = qd + 2 * kvd;
    const int T = 1 + irand(9), n_pages = (T + 40) / ps + 2;
    std::vector<int32_t> pos(T), page(T), slot(T);
    for (int t = 0; t < T; t++) { /* distinct positions on distinct slots */
        pos[t] = t * 3 + irand(3);
        page[t] = n_pages - 1 - pos[t] / ps, slot[t] = pos[t] % ps;
    }
    std::vector<float> qkv = rand_vec((size_t)T * width, false), b = rand_vec(width, false),
                       inv(hd / 2);
    for (int i = 0; i < hd / 2; i++)
        inv[i] = powf(10000.0f, -2.0f * i / hd);
    /* reference */
    std::vector<float> q((size_t)T * qd), k((size_t)T * kvd), v((size_t)T * kvd);
    for (int t = 0; t < T; t++) {
        const float *r = &qkv[(size_t)t * width];
        for (int i = 0; i < qd; i++)
            q[(size_t)t * qd + i] = r[i] + (bias ? b[i] : 0.0f);
        for (int i = 0; i < kvd; i++) {
            k[(size_t)t * kvd + i] = r[qd + i] + (bias ? b[qd + i] : 0.0f);
            v[(size_t)t * kvd + i] = r[qd + kvd + i] + (bias ? b[qd + kvd + i] : 0.0f);
        }
    }
    std::vector<float> qn = rand_vec(hd, false), kn = rand_vec(hd, false);
    if (qk_norm) {
        cs_op_rmsnorm_ref(q.data(), q.data(), qn.data(), T * nh, hd, 1e-6f);
        cs_op_rmsnorm_ref(k.data(), k.data(), kn.data(), T * nkv, hd, 1e-6f);
    }
    cs_op_rope_ref(q.data(), T, nh, hd, pos.data(), inv.data());
    cs_op_rope_ref(k.data(), T, nkv, hd, pos.data(), inv.data());
    const size_t page_elems = (size_t)n_layers * 2 * ps * kvd;
    std::vector<uint16_t> pool(page_elems * n_pages, 0x7fc0), want = pool;
    for (int t = 0; t < T; t++) {
        size_t at =
            (size_t)page[t] * page_elems + (size_t)layer * 2 * ps * kvd + (size_t)slot[t] * kvd;
        for (int i = 0; i < kvd; i++) {
            want[at + i] = simt::bf16_rn(k[(size_t)t * kvd + i]);
            want[at + (size_t)ps * kvd + i] = simt::bf16_rn(v[(size_t)t * kvd + i]);
        }
    }
    std::vector<float> gq((size_t)T * qd, NAN);
    cs_cuda_kv kv = {pool.data(), page_elems, ps, kvd};
    simt::launch(dim3(T), 64, [&] {
        k_qkv_rope_store(gq.data(), qkv.data(), bias ? b.data() : nullptr,
                         qk_norm ? qn.data() : nullptr, qk_norm ? kn.data() : nullptr, 1e-6f,
                         pos.data(), inv.data(), page.data(), slot.data(), kv, layer, nh, nkv, hd);
    });
    char what[96];
    snprintf(what, sizeof what, "bias+rope q  heads %d/%d hd %d T %d%s%s", nh, nkv, hd, T,
             bias ? " bias" : "", qk_norm ? " qk-norm" : "");
    check(what, norm_err(gq, q), TOL_F32);
    size_t diff = 0; /* every stored element within bf16 rounding, NaN elsewhere untouched */
    for (size_t i = 0; i < pool.size(); i++)
        if (pool[i] != want[i]) {
            float a = simt::bf16_f32(pool[i]), e = simt::bf16_f32(want[i]);
            diff += !(std::fabs(a - e) <= 1e-2f * std::fabs(e) + 1e-6f);
        }
    snprintf(what, sizeof what, "rope+kv store heads %d/%d hd %d ps %d T %d (elements off)", nh,
             nkv, hd, ps, T);
    check(what, (double)diff, 0.0);
}

static void test_conversions() {
    size_t n = 1000 + irand(500);
    std::vector<float> f = rand_vec(n, false), back(n, NAN);
    std::vector<uint16_t> b(n, 0);
    simt::launch(dim3(2), 128, [&] { k_f32_to_bf16(b.data(), f.data(), n); });
    simt::launch(dim3(3), 32, [&] { k_bf16_to_f32(back.data(), b.data(), n); });
    std::vector<float> ref(n);
    for (size_t i = 0; i < n; i++)
        ref[i] = bf_round(f[i]);
    check("f32 -> bf16 -> f32 (round to nearest even)", norm_err(back, ref), 0.0);
    std::vector<uint16_t> r1(n), r2(n);
    simt::launch(dim3(2), 64, [&] { k_fill_bf16(r1.data(), n, 7, 0.5f); });
    simt::launch(dim3(5), 32, [&] { k_fill_bf16(r2.data(), n, 7, 0.5f); });
    double worst = 0;
    for (uint16_t v : r1)
        worst = std::max(worst, (double)std::fabs(simt::bf16_f32(v)));
    check("random fill: same values for any launch shape", r1 == r2 ? 0.0 : 1.0, 0.0);
    check("random fill: within scale", worst > 0.5 ? worst : 0.0, 0.0);
}

int main() {
    test_embed_rmsnorm_swiglu();
    static const int shapes[][3] = {{4, 2, 16}, {9, 3, 64}, {32, 8, 128}, {4, 4, 18}};
    for (const auto &sh : shapes) {
        test_qkv_rope_store(sh[0], sh[1], sh[2], 16, false);
        test_qkv_rope_store(sh[0], sh[1], sh[2], 3, true);
        test_qkv_rope_store(sh[0], sh[1], sh[2], 16, false, true);
    }
    test_qkv_rope_store(4, 1, 256, 16, false, true); /* Gemma-3-270M's heads */
    test_conversions();
    if (failures) {
        printf("test_kernels_emu: %d FAILED\n", failures);
        return 1;
    }
    printf("test_kernels_emu: all passed\n");
    return 0;
}
