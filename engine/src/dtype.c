/* dtype.c: element types and their conversion to fp32 (the reference
 * dequantizers; block layouts follow ggml's ggml-common.h). */
#include "dtype.h"

#include <string.h>

#include "util.h"

static const cs_dtype_info infos[CS_DTYPE_COUNT] = {
    [CS_DTYPE_F32] = {"f32", 1, 4},     [CS_DTYPE_F16] = {"f16", 1, 2},
    [CS_DTYPE_Q4_0] = {"q4_0", 32, 18}, [CS_DTYPE_Q4_1] = {"q4_1", 32, 20},
    [CS_DTYPE_Q8_0] = {"q8_0", 32, 34}, [CS_DTYPE_BF16] = {"bf16", 1, 2},
};

const cs_dtype_info *cs__dtype_info(uint32_t type) {
    if (type >= CS_DTYPE_COUNT || !infos[type].name) return NULL;
    return &infos[type];
}

const char *cs__dtype_name(uint32_t type) {
    static const char *ggml_names[] = {
        "f32",   "f16",   "q4_0",    "q4_1",   "q4_2(removed)", "q4_3(removed)", "q5_0",
        "q5_1",  "q8_0",  "q8_1",    "q2_K",   "q3_K",          "q4_K",          "q5_K",
        "q6_K",  "q8_K",  "iq2_xxs", "iq2_xs", "iq3_xxs",       "iq1_s",         "iq4_nl",
        "iq3_s", "iq2_s", "iq4_xs",  "i8",     "i16",           "i32",           "i64",
        "f64",   "iq1_m", "bf16"};
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
    default: CS_ASSERT(!"cs__dtype_to_f32: unsupported type"); break;
    }
}
