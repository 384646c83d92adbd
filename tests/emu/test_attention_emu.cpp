/* test_attention_emu: the CUDA backend's attention kernel
 * (kernels/cuda/attention.cuh), its own source compiled for the host and
 * run under the SIMT emulator (simt_emu.h), so that its indexing, masking,
 * online softmax and fragment plumbing are checked on every machine, GPU or
 * not. Against an fp64 reference on the same bf16 inputs (q rounded to bf16
 * as the kernel does), by normalized error, on random ragged spans (prompt
 * chunks over cached pages, decode rows), GQA groups 1-16, head_dim 16-256
 * (padded and unpadded, 16-byte and 4-byte staging), page sizes 1/3/16, NaN
 * in every slot the spans do not own. Then the claim the engine relies on:
 * a prompt attended in chunks (each chunk a span over the pages of the
 * previous ones) gives bit-identical rows to one pass; split-K parts
 * merged by the combine kernel match the reference too. The same kernel on a
 * GPU is checked by tests/gpu/test_cuda_ops.c. */
#include <cstdio>

#include "simt_emu.h"

#include "attention.cuh"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double frand() { /* uniform [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / 4503599627370496.0 - 1.0;
}
static int irand(int n) {
    return (int)((frand() + 1.0) * 0.5 * n) % n;
}

/* The launcher of kernels.cu, minus the stream, with the split chosen by
 * the caller: keys per split (0: none; a multiple of the kernel's chunk). */
static void attention(uint16_t *out, const float *q, const cs_cuda_att_tile *tiles, int n_tiles,
                      int max_ctx, const int32_t *pages, cs_cuda_kv kv, int layer, int nh, int nkv,
                      int hd, float scale, int window, int keys) {
    int vec16 = hd % 8 == 0;
    cs_cuda_att_parts sp = {nullptr, nullptr, 0, 1};
    std::vector<float> po, pml;
    if (keys) {
        sp.keys = keys, sp.n = (max_ctx + keys - 1) / keys;
        po.assign((size_t)n_tiles * nkv * sp.n * ATT_ROWS * hd, NAN);
        pml.assign((size_t)n_tiles * nkv * sp.n * ATT_ROWS * 2, NAN);
        sp.o = po.data(), sp.ml = pml.data();
    }
    dim3 grid((unsigned)n_tiles, (unsigned)nkv, (unsigned)sp.n);
#define RUN(HDP, KC)                                                                               \
    simt::launch(grid, 32 * ATT_WARPS, [&] {                                                       \
        k_attention<HDP, KC>(out, q, tiles, pages, kv, layer, nh, nkv, hd, vec16, scale, window,   \
                             sp);                                                                  \
    })
    if (hd <= 32)
        RUN(32, 64);
    else if (hd <= 64)
        RUN(64, 64);
    else if (hd <= 96)
        RUN(96, 64);
    else if (hd <= 128)
        RUN(128, 64);
    else
        RUN(256, 32);
#undef RUN
    if (keys)
        simt::launch(dim3((unsigned)n_tiles, (unsigned)nkv), 32 * ATT_WARPS,
                     [&] { k_attention_combine(out, tiles, nh, nkv, hd, sp); });
}

struct Case {
    int nh, nkv, hd, ps, layer = 1, n_layers = 2;
    int window = 0;           /* sliding window, 0: none */
    float scale = 0;          /* 0: 1 / sqrt(hd) */
    int32_t nan_page = -1;    /* a page nobody owns (all NaN) */
    std::vector<int> pos, nq; /* per span */
    std::vector<int32_t> ptab;
    std::vector<int> poff;
    std::vector<uint16_t> pool;
    std::vector<float> q;
    int T = 0;
    size_t page_elems() const {
        return (size_t)n_layers * 2 * ps * nkv * hd;
    }
    const uint16_t *row(int s, int p,
                        int v) const { /* K (v 0) or V (v 1) of span s at position p */
        size_t kvd = (size_t)nkv * hd;
        return pool.data() + (size_t)ptab[poff[s] + p / ps] * page_elems() +
               (size_t)layer * 2 * ps * kvd + (size_t)v * ps * kvd + (size_t)(p % ps) * kvd;
    }
};

/* Random spans over distinct shuffled pages; bf16 K/V at every position a
 * span attends to, NaN everywhere else. */
static Case make_case(int nh, int nkv, int hd, int ps, int n_spans, int max_pos, int max_q) {
    Case c;
    c.nh = nh, c.nkv = nkv, c.hd = hd, c.ps = ps;
    int P = 0;
    for (int s = 0; s < n_spans; s++) {
        c.pos.push_back(irand(3) == 0 ? 0 : irand(max_pos));
        c.nq.push_back(irand(3) == 0 ? 1 : 1 + irand(max_q));
        c.poff.push_back(P);
        P += (c.pos[s] + c.nq[s] + ps - 1) / ps;
        c.T += c.nq[s];
    }
    int n_pages = P + 3;
    std::vector<int32_t> perm(n_pages);
    for (int i = 0; i < n_pages; i++)
        perm[i] = i;
    for (int i = n_pages - 1; i > 0; i--)
        std::swap(perm[i], perm[irand(i + 1)]);
    c.ptab.assign(perm.begin(), perm.begin() + P);
    c.nan_page = perm[P];
    c.pool.assign(c.page_elems() * n_pages, 0x7fc0);
    for (int s = 0; s < n_spans; s++)
        for (int p = 0; p < c.pos[s] + c.nq[s]; p++)
            for (int v = 0; v < 2; v++) {
                uint16_t *r = (uint16_t *)c.row(s, p, v);
                for (int i = 0; i < nkv * hd; i++)
                    r[i] = simt::bf16_rn((float)frand());
            }
    c.q.resize((size_t)c.T * nh * hd);
    for (float &x : c.q)
        x = (float)(2.0 * frand());
    return c;
}

static std::vector<uint16_t> run(const Case &c, int keys) {
    int rows = ATT_ROWS / (c.nh / c.nkv), max_ctx = 0; /* cs__cuda_attention_tile_rows */
    std::vector<cs_cuda_att_tile> tiles;
    for (int s = 0, t = 0; s < (int)c.pos.size(); t += c.nq[s], s++) {
        max_ctx = std::max(max_ctx, c.pos[s] + c.nq[s]);
        for (int i0 = 0; i0 < c.nq[s]; i0 += rows)
            tiles.push_back({t + i0, std::min(rows, c.nq[s] - i0), c.pos[s] + i0, c.poff[s]});
    }
    std::vector<uint16_t> out((size_t)c.T * c.nh * c.hd, 0xffff); /* NaN until written */
    cs_cuda_kv kv = {(uint16_t *)c.pool.data(), c.page_elems(), c.ps, c.nkv * c.hd};
    /* with a window, the pages wholly before a span's first row's window are
     * named as a NaN page (as if released): the kernel must not read them */
    std::vector<int32_t> ptab = c.ptab;
    for (size_t s = 0; c.window > 0 && s < c.pos.size(); s++) {
        int lo = c.pos[s] + 1 - c.window; /* the lowest first-row window of the table's spans */
        for (size_t o = 0; o < c.pos.size(); o++)
            if (c.poff[o] == c.poff[s]) lo = std::min(lo, c.pos[o] + 1 - c.window);
        for (int p = 0; p < lo / c.ps; p++)
            ptab[c.poff[s] + p] = c.nan_page;
    }
    float scale = c.scale ? c.scale : 1.0f / std::sqrt((float)c.hd);
    attention(out.data(), c.q.data(), tiles.data(), (int)tiles.size(), max_ctx, ptab.data(), kv,
              c.layer, c.nh, c.nkv, c.hd, scale, c.window, keys);
    return out;
}

static int failures;

static void check_reference(int nh, int nkv, int hd, int ps, int n_spans, int max_pos, int max_q,
                            int keys = 0, int window = 0) {
    Case c = make_case(nh, nkv, hd, ps, n_spans, max_pos, max_q);
    c.window = window;
    if (window) c.scale = 0.07f; /* not 1/sqrt(hd): the scale is an argument */
    const double scale = c.scale ? c.scale : 1.0 / std::sqrt((double)hd);
    std::vector<uint16_t> out = run(c, keys);
    const int group = nh / nkv, qd = nh * hd;
    double num = 0, den = 0;
    int nan = 0;
    for (int s = 0, t = 0; s < (int)c.pos.size(); s++)
        for (int i = 0; i < c.nq[s]; i++, t++)
            for (int h = 0; h < nh; h++) {
                const int kvh = h / group, n_ctx = c.pos[s] + i + 1;
                const int lo = window && n_ctx > window ? n_ctx - window : 0;
                std::vector<double> w(n_ctx, -INFINITY);
                double mx = -INFINITY, sum = 0;
                for (int j = lo; j < n_ctx; j++) {
                    const uint16_t *k = c.row(s, j, 0) + kvh * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += (double)simt::bf16_f32(
                                 simt::bf16_rn(c.q[(size_t)t * qd + h * hd + e])) *
                             simt::bf16_f32(k[e]);
                    w[j] = d * scale;
                    mx = std::max(mx, w[j]);
                }
                for (double &x : w)
                    sum += x = std::exp(x - mx);
                for (int e = 0; e < hd; e++) {
                    double o = 0;
                    for (int j = lo; j < n_ctx; j++)
                        o += w[j] / sum * simt::bf16_f32(c.row(s, j, 1)[kvh * hd + e]);
                    float got = simt::bf16_f32(out[(size_t)t * qd + h * hd + e]);
                    nan += std::isnan(got);
                    num += (got - o) * (got - o), den += o * o;
                }
            }
    double err = std::sqrt(num / den);
    bool ok = err <= 6e-3 && !nan; /* bf16 output and P: ~2^-9 relative */
    printf("  attention heads %2d/%-2d hd %3d ps %2d spans %d T %3d split %3d window %3d  err "
           "%.2e%s  %s\n",
           nh, nkv, hd, ps, n_spans, c.T, keys, window, err, nan ? " NaN" : "", ok ? "ok" : "FAIL");
    failures += !ok;
}

/* One prompt of n tokens in one pass, then the same rows as chunks: chunk k
 * is a span at pos k * chunk over the same pages (the earlier chunks'
 * positions are its cached context). Every output row must be identical. */
static void check_chunked(int nh, int nkv, int hd, int ps, int n, int chunk, int window = 0) {
    Case one = make_case(nh, nkv, hd, ps, 1, 1, 1); /* shapes and a pool; replaced below */
    int pages = (n + ps - 1) / ps;
    one.pos = {0}, one.nq = {n}, one.poff = {0}, one.T = n;
    one.ptab.resize(pages);
    for (int i = 0; i < pages; i++)
        one.ptab[i] = i;
    for (int i = pages - 1; i > 0; i--)
        std::swap(one.ptab[i], one.ptab[irand(i + 1)]);
    one.pool.assign(one.page_elems() * pages, 0x7fc0);
    for (int p = 0; p < n; p++)
        for (int v = 0; v < 2; v++) {
            uint16_t *r = (uint16_t *)one.row(0, p, v);
            for (int i = 0; i < nkv * hd; i++)
                r[i] = simt::bf16_rn((float)frand());
        }
    one.q.resize((size_t)n * nh * hd);
    for (float &x : one.q)
        x = (float)(2.0 * frand());
    one.window = window;
    Case ch = one;
    ch.pos.clear(), ch.nq.clear(), ch.poff.clear();
    for (int p = 0; p < n; p += chunk) /* every chunk's page table is the prompt's */
        ch.pos.push_back(p), ch.nq.push_back(std::min(chunk, n - p)), ch.poff.push_back(0);
    bool same = run(one, 0) == run(ch, 0);
    printf("  chunks of %d = one pass, heads %d/%d hd %d ps %d n %d window %d: %s\n", chunk, nh,
           nkv, hd, ps, n, window, same ? "bit-identical" : "DIFFERENT");
    failures += !same;
}

int main() {
    static const int shapes[][3] = {/* n_heads, n_kv_heads, head_dim */
                                    {4, 2, 16}, {9, 3, 64},  {32, 8, 128}, {8, 1, 256}, {6, 6, 32},
                                    {4, 4, 96}, {16, 1, 64}, {4, 2, 18},   {2, 1, 40}};
    static const int page_sizes[] = {1, 3, 16};
    for (const auto &sh : shapes)
        for (int ps : page_sizes)
            check_reference(sh[0], sh[1], sh[2], ps, 1 + irand(5), 90, 24);
    /* several tiles per span and several key chunks per tile */
    check_reference(32, 8, 128, 16, 2, 200, 70);
    check_reference(9, 3, 64, 16, 2, 150, 90);
    /* split-K (flash-decoding): parts of 64/128 keys merged by the combine kernel */
    check_reference(32, 8, 128, 16, 3, 300, 4, 64);
    check_reference(9, 3, 64, 3, 2, 200, 40, 128);
    check_reference(8, 1, 256, 16, 2, 150, 3, 64);
    check_reference(4, 2, 18, 1, 3, 200, 20, 64);
    /* sliding windows (Gemma 3: 4/1 heads x 256), with and without split-K */
    check_reference(4, 1, 256, 16, 3, 300, 70, 0, 64);
    check_reference(4, 1, 256, 16, 3, 300, 4, 64, 100);
    check_reference(9, 3, 64, 3, 4, 200, 40, 0, 7);
    check_reference(9, 3, 64, 16, 2, 200, 40, 128, 33);
    check_chunked(9, 3, 64, 16, 150, 37);
    check_chunked(32, 8, 128, 3, 100, 16);
    check_chunked(9, 3, 64, 16, 150, 37, 40); /* windows not on the 64-key chunk grid */
    check_chunked(4, 1, 256, 16, 200, 13, 70);
    if (failures) {
        printf("test_attention_emu: %d FAILED\n", failures);
        return 1;
    }
    printf("test_attention_emu: all passed\n");
    return 0;
}
