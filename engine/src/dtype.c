/* dtype.c: element types and their conversion to fp32 (the reference
 * dequantizers; block layouts follow ggml's ggml-common.h). */
#include "dtype.h"

#include <string.h>

#include "util.h"

static const cs_dtype_info infos[CS_DTYPE_COUNT] = {
    [CS_DTYPE_F32] = {"f32", 1, 4},       [CS_DTYPE_F16] = {"f16", 1, 2},
    [CS_DTYPE_Q4_0] = {"q4_0", 32, 18},   [CS_DTYPE_Q4_1] = {"q4_1", 32, 20},
    [CS_DTYPE_Q8_0] = {"q8_0", 32, 34},   [CS_DTYPE_BF16] = {"bf16", 1, 2},
    [CS_DTYPE_Q5_0] = {"q5_0", 32, 22},   [CS_DTYPE_Q5_1] = {"q5_1", 32, 24},
    [CS_DTYPE_Q4_K] = {"q4_K", 256, 144}, [CS_DTYPE_Q5_K] = {"q5_K", 256, 176},
    [CS_DTYPE_Q6_K] = {"q6_K", 256, 210},
};

const cs_dtype_info *cs__dtype_info(uint32_t type) {
    if (type >= CS_DTYPE_COUNT || !infos[type].name) return NULL;
    return &infos[type];
}

const char *cs__dtype_name(uint32_t type) {
    static const char *ggml_names[] = {"f32",
                                       "f16",
                                       "q4_0",
                                       "q4_1",
                                       "q4_2(removed)",
                                       "q4_3(removed)",
                                       "q5_0",
                                       "q5_1",
                                       "q8_0",
                                       "q8_1",
                                       "q2_K",
                                       "q3_K",
                                       "q4_K",
                                       "q5_K",
                                       "q6_K",
                                       "q8_K",
                                       "iq2_xxs",
                                       "iq2_xs",
                                       "iq3_xxs",
                                       "iq1_s",
                                       "iq4_nl",
                                       "iq3_s",
                                       "iq2_s",
                                       "iq4_xs",
                                       "i8",
                                       "i16",
                                       "i32",
                                       "i64",
                                       "f64",
                                       "iq1_m",
                                       "bf16",
                                       "q4_0_4_4(removed)",
                                       "q4_0_4_8(removed)",
                                       "q4_0_8_8(removed)",
                                       "tq1_0",
                                       "tq2_0",
                                       "iq4_nl_4_4(removed)",
                                       "iq4_nl_4_8(removed)",
                                       "iq4_nl_8_8(removed)",
                                       "mxfp4"};
    if (type < sizeof ggml_names / sizeof ggml_names[0]) return ggml_names[type];
    return "unknown";
}

bool cs__dtype_nbytes(enum cs_dtype t, uint64_t n, size_t *out) {
    const cs_dtype_info *in = cs__dtype_info(t);
    if (!in || n % (uint64_t)in->block_size) return false;
    uint64_t blocks = n / (uint64_t)in->block_size;
    if (blocks > SIZE_MAX / (uint64_t)in->block_bytes) return false;
    *out = (size_t)(blocks * (uint64_t)in->block_bytes);
    return true;
}

static uint16_t rd16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static void k4_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4;
        *mn = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
    }
}

/* Built with -ffp-contract=off (CMakeLists.txt): d * q + m is two roundings,
 * as numpy and ggml's scalar code compute it. */
void cs__dtype_to_f32(enum cs_dtype t, const void *src, float *dst, size_t n) {
    const uint8_t *s = src;
    switch (t) {
    case CS_DTYPE_F32: memcpy(dst, src, n * 4); break;
    case CS_DTYPE_F16:
        for (size_t i = 0; i < n; i++)
            dst[i] = cs_f16_to_f32(rd16(s + 2 * i));
        break;
    case CS_DTYPE_BF16:
        for (size_t i = 0; i < n; i++)
            dst[i] = cs_bf16_to_f32(rd16(s + 2 * i));
        break;
    case CS_DTYPE_Q8_0: /* {f16 d; int8 qs[32]}: x = d * q */
        for (size_t b = 0; b < n / 32; b++, s += 34) {
            float d = cs_f16_to_f32(rd16(s));
            for (int j = 0; j < 32; j++)
                dst[b * 32 + j] = d * (float)(int8_t)s[2 + j];
        }
        break;
    case CS_DTYPE_Q4_0: /* {f16 d; u8 qs[16]}: low nibbles are x[0..15], high x[16..31]; x = d*(q-8)
                         */
        for (size_t b = 0; b < n / 32; b++, s += 18) {
            float d = cs_f16_to_f32(rd16(s));
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + j] = d * (float)((s[2 + j] & 0x0f) - 8);
                dst[b * 32 + j + 16] = d * (float)((s[2 + j] >> 4) - 8);
            }
        }
        break;
    case CS_DTYPE_Q4_1: /* {f16 d; f16 m; u8 qs[16]}: x = d*q + m */
        for (size_t b = 0; b < n / 32; b++, s += 20) {
            float d = cs_f16_to_f32(rd16(s));
            float m = cs_f16_to_f32(rd16(s + 2));
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + j] = d * (float)(s[4 + j] & 0x0f) + m;
                dst[b * 32 + j + 16] = d * (float)(s[4 + j] >> 4) + m;
            }
        }
        break;
    case CS_DTYPE_Q5_0:   /* {f16 d; u32 qh; u8 qs[16]}: q = nibble | qh bit << 4; x = d*(q-16) */
    case CS_DTYPE_Q5_1: { /* {f16 d; f16 m; u32 qh; u8 qs[16]}: x = d*q + m */
        const bool min = t == CS_DTYPE_Q5_1;
        const size_t bb = min ? 24 : 22;
        for (size_t b = 0; b < n / 32; b++, s += bb) {
            float d = cs_f16_to_f32(rd16(s)), m = min ? cs_f16_to_f32(rd16(s + 2)) : 0.0f;
            const uint8_t *p = s + (min ? 4 : 2), *qs = p + 4;
            uint32_t qh =
                (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
            for (int j = 0; j < 16; j++) {
                int q0 = (qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
                int q1 = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
                dst[b * 32 + j] = min ? d * (float)q0 + m : d * (float)(q0 - 16);
                dst[b * 32 + j + 16] = min ? d * (float)q1 + m : d * (float)(q1 - 16);
            }
        }
        break;
    }
    case CS_DTYPE_Q4_K:   /* {f16 d, dmin; u8 scales[12]; u8 qs[128]} */
    case CS_DTYPE_Q5_K: { /* {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} */
        /* sub-block j of 32: x = (d*sc_j)*q - dmin*m_j; q's low 4 bits from
         * qs[32*(j/2) + l] (low nibble for even j), Q5_K's 5th from qh[l] bit j */
        const bool five = t == CS_DTYPE_Q5_K;
        const size_t bb = five ? 176 : 144;
        for (size_t b = 0; b < n / 256; b++, s += bb) {
            float d = cs_f16_to_f32(rd16(s)), dmin = cs_f16_to_f32(rd16(s + 2));
            const uint8_t *qh = s + 16, *qs = s + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                k4_scale_min(s + 4, j, &sc, &mn);
                float d1 = d * (float)sc, m1 = dmin * (float)mn;
                for (int l = 0; l < 32; l++) {
                    int q = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0x0f;
                    if (five) q |= ((qh[l] >> j) & 1) << 4;
                    dst[b * 256 + (size_t)(32 * j + l)] = d1 * (float)q - m1;
                }
            }
        }
        break;
    }
    case CS_DTYPE_Q6_K: /* {u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d}: x = (d*sc)*(q-32) */
        for (size_t b = 0; b < n / 256; b++, s += 210) {
            const uint8_t *ql = s, *qh = s + 128;
            const int8_t *sc = (const int8_t *)(s + 192);
            float d = cs_f16_to_f32(rd16(s + 208));
            for (int e = 0; e < 256; e++) {
                int half = e / 128, f = e % 128;
                int lo = f < 64 ? ql[64 * half + f] & 0x0f : ql[64 * half + f - 64] >> 4;
                int hi = (qh[32 * half + f % 32] >> (2 * (f / 32))) & 3;
                float ds = d * (float)sc[e / 16];
                dst[b * 256 + (size_t)e] = ds * (float)((lo | hi << 4) - 32);
            }
        }
        break;
    default: CS_ASSERT(!"cs__dtype_to_f32: unsupported type"); break;
    }
}

static bool bad16(const uint8_t *p) { /* exponent all ones: Inf or NaN */
    return (rd16(p) & 0x7c00) == 0x7c00;
}

int64_t cs__dtype_bad_scale(enum cs_dtype t, const void *src, size_t n) {
    const cs_dtype_info *in = cs__dtype_info(t);
    if (!in || in->block_size == 1) return -1;
    const uint8_t *s = src;
    /* where the fp16 scales sit in a block: offsets, -1 ends */
    int offs[3] = {0, -1, -1};
    switch (t) {
    case CS_DTYPE_Q4_1:
    case CS_DTYPE_Q5_1:
    case CS_DTYPE_Q4_K:
    case CS_DTYPE_Q5_K: offs[1] = 2; break;
    case CS_DTYPE_Q6_K: offs[0] = 208; break;
    default: break;
    }
    size_t nb = n / (size_t)in->block_size;
    for (size_t b = 0; b < nb; b++, s += in->block_bytes)
        for (int k = 0; k < 3 && offs[k] >= 0; k++)
            if (bad16(s + offs[k])) return (int64_t)b;
    return -1;
}
