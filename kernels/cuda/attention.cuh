/* kernels/cuda/attention.cuh: the paged attention kernel of the CUDA backend
 * (launched by cs__cuda_attention in kernels.cu). A file of its own so that
 * tests/emu/test_attention_emu.cpp compiles this very source on the host
 * under a SIMT emulator (with CS_SIMT_EMU the emulator provides the CUDA
 * built-ins and the three PTX helpers below) and runs it in CI, where no GPU
 * exists.
 *
 * Paged attention on tensor cores, FlashAttention-2 style, mma.sync m16n8k16 (bf16 in, fp32
 * accumulate; sm_80+). A block is (query tile, KV head); its ATT_WARPS warps own 16 mma rows each,
 * and row m is query row m / group of the tile with query head m % group of that KV head's group
 * (GQA packing: the group's heads share every K/V load and fill the mma's 16 rows even with one
 * query row, so decode runs the same kernel). The block walks the tile's context ATT_KC keys at a
 * time from key 0 (with a sliding window, from the chunk holding its first row's first key): K and V rows of the chunk are staged in shared memory (row-major, rows padded by
 * 8 bf16: 16-byte aligned and conflict-free fragment loads; zeros past the context and past
 * head_dim), S = Q K^T by mma with Q held in registers as bf16, the causal mask, an online softmax
 * on the S fragments in registers (exp2 with the scale folded in), then P rounded to bf16 is the A
 * operand of O += P V as it stands (the C layout of two 8-key n-tiles is the A layout of one 16-key
 * k-step), V's B operands come from ldmatrix.trans. The row sum adds the
 * rounded P, so the normalization matches what was multiplied.
 * Every query row walks the same key chunks in the same order whatever tile
 * it is in (with a window, chunks wholly before a row's window leave its
 * running state exactly zero), so chunked and one-pass prefill give
 * bit-identical attention (split-K aside: the launcher's split depends on
 * the step's shape).
 * Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, c = lane % 4):
 * A regs {(g, 2c..), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..)} (row, col);
 * B regs {(2c.., g), (2c+8.., g)} (k, n); C {(g, 2c), (g, 2c+1), (g+8, 2c),
 * (g+8, 2c+1)}; a register holds two bf16, the lower index in the low half. */
#ifndef CS_KERNELS_CUDA_ATTENTION_CUH
#define CS_KERNELS_CUDA_ATTENTION_CUH

#include "attention.h"

#define ATT_ROWS CS_CUDA_ATT_ROWS /* mma rows of a block: query rows x group heads */
#define ATT_WARPS (ATT_ROWS / 16)

#ifndef CS_SIMT_EMU
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* d += a b, one m16n8k16 bf16 mma with fp32 accumulators */
static __device__ __forceinline__ void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0,
                                                uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 bf16 matrices from shared memory, transposed: lane l gives the
 * address of row l % 8 of matrix l / 8; register i of every lane gets its
 * pair (rows 2c, 2c+1; column g) of matrix i: a B operand when the rows
 * are the k dimension. */
static __device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const uint16_t *row) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

#endif /* CS_SIMT_EMU */

/* HDP: head_dim rounded up to a multiple of 16 (the padded k dimension of
 * QK^T, the n dimension of PV); KC: keys per chunk (a multiple of 16).
 * vec16: head_dim is a multiple of 8, so K/V rows load as 16-byte vectors.
 * Split-K (flash-decoding), when the grid alone would leave the GPU idle
 * (few tiles, long contexts): sp.keys > 0 (a multiple of KC) and
 * blockIdx.z = split z takes keys [z keys, (z + 1) keys) only and writes
 * its unnormalized rows, running max and sum to sp.o / sp.ml (part p =
 * (tile * n_kv_heads + kv head) * sp.n + z, ATT_ROWS rows each);
 * k_attention_combine then merges the parts into out. */
template <int HDP, int KC>
__global__ void __launch_bounds__(32 * ATT_WARPS)
    k_attention(uint16_t *out, const float *q, const cs_cuda_att_tile *tiles, const int32_t *pages,
                cs_cuda_kv kv, int layer, int n_heads, int n_kv_heads, int hd, int vec16,
                float scale, int window, cs_cuda_att_parts sp) {
    constexpr int STRIDE = HDP + 8; /* bf16 per staged row */
    constexpr int NT = KC / 8;      /* 8-key n-tiles of S per chunk */
    constexpr int KS = HDP / 16;    /* k-steps of QK^T */
    constexpr int DT = HDP / 8;     /* 8-dim n-tiles of O */
    constexpr int THREADS = 32 * ATT_WARPS;
    __shared__ __align__(16) uint16_t sk[KC * STRIDE];
    __shared__ __align__(16) uint16_t sv[KC * STRIDE];

    const cs_cuda_att_tile tile = tiles[blockIdx.x];
    const int kvh = blockIdx.y, group = n_heads / n_kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
    const int tile_ctx = tile.pos + tile.n_q; /* keys 0 .. pos + n_q - 1 */
    const int split_begin = sp.keys ? (int)blockIdx.z * sp.keys : 0;
    const int k_end = sp.keys ? min(tile_ctx, split_begin + sp.keys) : tile_ctx;
    if (split_begin >= tile_ctx) return; /* a split past this tile's context: the whole block */
    /* With a sliding window, no key before the first row's window (lo) is
     * read: its page may be gone. Chunks stay on the KC grid (so a row's
     * chunks, and its bits, do not depend on the tile it is in): keys before
     * lo in the first chunk are staged as zeros, and masked. A split wholly
     * before lo writes an empty part. */
    const int lo = window > 0 ? max(0, tile.pos + 1 - window) : 0;
    const int k_begin = max(split_begin, lo / KC * KC);
    const float scale_log2 = 1.4426950408889634f * scale;

    /* this thread's two rows (g and g + 8 of its warp): last key each may
     * see (-1: not a row of this tile) and where its q / out row starts */
    int lim[2];
    size_t off[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int m = warp * 16 + g + 8 * r, qi = m / group;
        bool valid = qi < tile.n_q;
        lim[r] = valid ? tile.pos + qi : -1;
        off[r] = valid
                     ? (size_t)(tile.q_begin + qi) * q_dim + (size_t)(kvh * group + m % group) * hd
                     : 0;
    }
    /* the warp computes while its first row is in the tile, up to its last row's key */
    const bool warp_on = (warp * 16) / group < tile.n_q;
    const int m_last = min(warp * 16 + 15, tile.n_q * group - 1);
    const int warp_lim = tile.pos + m_last / group;

    uint32_t qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = i & 1, d = ks * 16 + (i >> 1) * 8 + 2 * c;
            float2 v = make_float2(0.0f, 0.0f);
            if (lim[r] >= 0 && d < hd) v = *reinterpret_cast<const float2 *>(q + off[r] + d);
            qa[ks][i] = pack_bf16(v.x, v.y);
        }

    float o[DT][4], m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;

    const size_t layer_off = (size_t)layer * 2 * kv.page_size * kv_dim + (size_t)kvh * hd;
    const size_t v_off = (size_t)kv.page_size * kv_dim;
    const int32_t *pt = pages + tile.page_off;

    for (int c0 = k_begin; c0 < k_end; c0 += KC) {
        const int nk = min(KC, k_end - c0);
        __syncthreads(); /* every warp is done with the previous chunk */
        if (vec16) {
            constexpr int VPR = HDP / 8; /* 16-byte vectors per staged row */
#pragma unroll
            for (int i = 0; i < (KC * VPR + THREADS - 1) / THREADS; i++) {
                int e = threadIdx.x + i * THREADS;
                if (e >= KC * VPR) break;
                int j = e / VPR, d = (e % VPR) * 8;
                uint4 kw = make_uint4(0, 0, 0, 0), vw = kw;
                if (j < nk && d < hd && c0 + j >= lo) {
                    int p = c0 + j;
                    const uint16_t *src = kv.pool + (size_t)pt[p / kv.page_size] * kv.page_elems +
                                          layer_off + (size_t)(p % kv.page_size) * kv_dim + d;
                    kw = *reinterpret_cast<const uint4 *>(src);
                    vw = *reinterpret_cast<const uint4 *>(src + v_off);
                }
                *reinterpret_cast<uint4 *>(sk + j * STRIDE + d) = kw;
                *reinterpret_cast<uint4 *>(sv + j * STRIDE + d) = vw;
            }
        } else {
            constexpr int WPR = HDP / 2; /* 32-bit words per staged row */
#pragma unroll 4
            for (int i = 0; i < (KC * WPR + THREADS - 1) / THREADS; i++) {
                int e = threadIdx.x + i * THREADS;
                if (e >= KC * WPR) break;
                int j = e / WPR, d = (e % WPR) * 2;
                uint32_t kw = 0, vw = 0;
                if (j < nk && d < hd && c0 + j >= lo) {
                    int p = c0 + j;
                    const uint16_t *src = kv.pool + (size_t)pt[p / kv.page_size] * kv.page_elems +
                                          layer_off + (size_t)(p % kv.page_size) * kv_dim + d;
                    kw = *reinterpret_cast<const uint32_t *>(src);
                    vw = *reinterpret_cast<const uint32_t *>(src + v_off);
                }
                *reinterpret_cast<uint32_t *>(sk + j * STRIDE + d) = kw;
                *reinterpret_cast<uint32_t *>(sv + j * STRIDE + d) = vw;
            }
        }
        __syncthreads();
        if (!warp_on || c0 > warp_lim) continue; /* not break: the block syncs each chunk */

        /* S = Q K^T: B (k = dim, n = key) is row `key` of sk, two dims per register */
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const uint16_t *kr = sk + (nt * 8 + g) * STRIDE + 2 * c;
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                mma_bf16(s[nt], qa[ks], *reinterpret_cast<const uint32_t *>(kr + ks * 16),
                         *reinterpret_cast<const uint32_t *>(kr + ks * 16 + 8));
        }
        /* causal and window masks, log2-domain scores, running max per row */
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int key = c0 + nt * 8 + 2 * c + (i & 1), r = i >> 1;
                bool seen = key <= lim[r] && key < k_end && (window == 0 || key > lim[r] - window);
                float v = seen ? s[nt][i] * scale_log2 : -INFINITY;
                s[nt][i] = v;
                mx[r] = fmaxf(mx[r], v);
            }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            /* the 4 lanes of a row (same g) hold its 2 * NT * 4 scores */
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float m_new = fmaxf(m_run[r], mx[r]);
            base[r] = m_new == -INFINITY ? 0.0f : m_new; /* a row with no key yet: p = 0, no NaN */
            float corr = exp2f(m_run[r] - base[r]);      /* 0 on a row's first keys */
            m_run[r] = m_new;
            l_run[r] *= corr;
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                o[dt][2 * r] *= corr, o[dt][2 * r + 1] *= corr;
        }
        /* O += P V, 16 keys per k-step */
#pragma unroll
        for (int kk = 0; kk < KC / 16; kk++) {
            uint32_t pa[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float *sv4 = s[2 * kk + (i >> 1)];
                int r = i & 1;
                __nv_bfloat162 p2 = __floats2bfloat162_rn(exp2f(sv4[2 * r] - base[r]),
                                                          exp2f(sv4[2 * r + 1] - base[r]));
                l_run[r] += __low2float(p2) + __high2float(p2);
                pa[i] = *reinterpret_cast<uint32_t *>(&p2);
            }
            /* lanes 0-7: keys 16kk + 0..7, 8-15: + 8..15, at dims 16dp; 16-31 the same at 16dp + 8
             */
            const uint16_t *vr =
                sv + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
#pragma unroll
            for (int dp = 0; dp < DT / 2; dp++) {
                uint32_t b[4];
                ldsm_x4_trans(b, vr + dp * 16);
                mma_bf16(o[2 * dp], pa, b[0], b[1]);
                mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
    }
    if (!warp_on) return;
    if (sp.keys) { /* a part: unnormalized rows, their max (log2 domain) and sum */
        const size_t part = ((size_t)blockIdx.x * n_kv_heads + kvh) * sp.n + blockIdx.z;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = l_run[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (lim[r] < 0) continue;
            const size_t row = part * ATT_ROWS + warp * 16 + g + 8 * r;
            if (c == 0) sp.ml[2 * row] = m_run[r], sp.ml[2 * row + 1] = l;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                int d = dt * 8 + 2 * c;
                if (d < hd)
                    *reinterpret_cast<float2 *>(sp.o + row * hd + d) =
                        make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
            }
        }
        return;
    }
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        int d = dt * 8 + 2 * c;
        if (d >= hd) continue;
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (lim[r] >= 0)
                *reinterpret_cast<uint32_t *>(out + off[r] + d) =
                    pack_bf16(o[dt][2 * r] * inv[r], o[dt][2 * r + 1] * inv[r]);
    }
}

/* Merges the split parts of k_attention: for every row of a tile and every
 * dim, out = sum_z 2^(m_z - M) o_z / sum_z 2^(m_z - M) l_z with M = max_z m_z,
 * over the splits z that start inside the tile's context. A block per
 * (tile, KV head), as in k_attention. */
__global__ void __launch_bounds__(32 * ATT_WARPS)
    k_attention_combine(uint16_t *out, const cs_cuda_att_tile *tiles, int n_heads, int n_kv_heads,
                        int hd, cs_cuda_att_parts sp) {
    const cs_cuda_att_tile tile = tiles[blockIdx.x];
    const int kvh = blockIdx.y, group = n_heads / n_kv_heads, q_dim = n_heads * hd;
    const int n_z = (tile.pos + tile.n_q + sp.keys - 1) / sp.keys;
    const size_t part0 = ((size_t)blockIdx.x * n_kv_heads + kvh) * sp.n;
    for (int e = threadIdx.x; e < tile.n_q * group * hd; e += 32 * ATT_WARPS) {
        const int m = e / hd, d = e % hd;
        float mx = -INFINITY;
        for (int z = 0; z < n_z; z++)
            mx = fmaxf(mx, sp.ml[2 * ((part0 + z) * ATT_ROWS + m)]);
        float l = 0.0f, acc = 0.0f;
        for (int z = 0; z < n_z; z++) {
            const size_t row = (part0 + z) * ATT_ROWS + m;
            float w = exp2f(sp.ml[2 * row] - mx); /* 0 for a split with no key of this row */
            l += w * sp.ml[2 * row + 1];
            acc += w * sp.o[row * hd + d];
        }
        const size_t o_at =
            (size_t)(tile.q_begin + m / group) * q_dim + (size_t)(kvh * group + m % group) * hd + d;
        out[o_at] = (uint16_t)(pack_bf16(l > 0.0f ? acc / l : 0.0f, 0.0f) & 0xffffu);
    }
}

#endif
