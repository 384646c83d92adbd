/* test_dtype: fp16/bf16 conversions and the block dequantizers against
 * values worked out by hand from ggml's block layouts. */
#include "dtype.h"
#include "test.h"

static void check_f16(void) {
    ASSERT_EQ_INT(cs_f32_to_f16(1.0f), 0x3c00);
    ASSERT_EQ_INT(cs_f32_to_f16(-2.0f), 0xc000);
    ASSERT_EQ_INT(cs_f32_to_f16(65504.0f), 0x7bff);
    ASSERT_EQ_INT(cs_f32_to_f16(1e6f), 0x7c00);          /* overflow -> inf */
    ASSERT_EQ_INT(cs_f32_to_f16(5.9604645e-8f), 0x0001); /* smallest subnormal */
    ASSERT_NEAR(cs_f16_to_f32(0x0001), 5.9604645e-8, 1e-15);
    ASSERT_NEAR(cs_f16_to_f32(0x3555), 0.33325195, 1e-8);
    for (uint32_t h = 0; h < 0x7c00; h++) /* every finite positive half round-trips */
        ASSERT_EQ_INT(cs_f32_to_f16(cs_f16_to_f32((uint16_t)h)), h);
    ASSERT_EQ_INT(cs_f32_to_bf16(1.0f), 0x3f80);
    ASSERT_NEAR(cs_bf16_to_f32(0x4049), 3.140625, 0);
    ASSERT_EQ_INT(cs_f32_to_bf16(1.00390625f), 0x3f80); /* tie rounds to even */
}

static void check_blocks(void) {
    uint8_t q8[34] = {0x00, 0x38}; /* d = 0.5 */
    for (int j = 0; j < 32; j++)
        q8[2 + j] = (uint8_t)(int8_t)(j - 16);
    float out[32];
    cs__dtype_to_f32(CS_DTYPE_Q8_0, q8, out, 32);
    for (int j = 0; j < 32; j++)
        ASSERT_NEAR(out[j], 0.5 * (j - 16), 0);

    uint8_t q40[18] = {0x00, 0x40}; /* d = 2 */
    for (int j = 0; j < 16; j++)
        q40[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    cs__dtype_to_f32(CS_DTYPE_Q4_0, q40, out, 32);
    for (int j = 0; j < 16; j++) {
        ASSERT_NEAR(out[j], 2.0 * (j - 8), 0);
        ASSERT_NEAR(out[j + 16], 2.0 * (15 - j - 8), 0);
    }
    uint8_t q41[20] = {0x00, 0x3c, 0x00, 0xbc}; /* d = 1, m = -1 */
    for (int j = 0; j < 16; j++)
        q41[4 + j] = (uint8_t)(j | (j << 4));
    cs__dtype_to_f32(CS_DTYPE_Q4_1, q41, out, 32);
    for (int j = 0; j < 16; j++) {
        ASSERT_NEAR(out[j], j - 1.0, 0);
        ASSERT_NEAR(out[j + 16], j - 1.0, 0);
    }
    size_t nb;
    ASSERT_TRUE(cs__dtype_nbytes(CS_DTYPE_Q4_1, 64, &nb) && nb == 40);
    ASSERT_TRUE(!cs__dtype_nbytes(CS_DTYPE_Q4_1, 33, &nb));
    ASSERT_TRUE(cs__dtype_info(11) == NULL); /* q3_K: not supported */
    ASSERT_EQ_STR(cs__dtype_name(11), "q3_K");
    ASSERT_TRUE(cs__dtype_info(10) == NULL && cs__dtype_info(23) == NULL); /* q2_K, iq4_xs */
    ASSERT_EQ_STR(cs__dtype_name(14), "q6_K");
    ASSERT_TRUE(cs__dtype_nbytes(CS_DTYPE_Q6_K, 512, &nb) && nb == 420);
    ASSERT_TRUE(!cs__dtype_nbytes(CS_DTYPE_Q4_K, 128, &nb)); /* half a super-block */
    ASSERT_TRUE(cs__dtype_nbytes(CS_DTYPE_Q5_0, 64, &nb) && nb == 44);
}

/* Q5_0, Q4_K and Q6_K blocks with known values (every type is checked
 * bitwise against the gguf package's dequantizer in tests/py/test_dequant.py). */
static void check_new_blocks(void) {
    float out[256];
    uint8_t q50[22] = {0x00, 0x3c}; /* d = 1.0 */
    q50[2] = 0x01;                  /* qh bit 0: element 0 gets +16 */
    for (int j = 0; j < 16; j++)
        q50[6 + j] = (uint8_t)(j | (15 - j) << 4);
    cs__dtype_to_f32(CS_DTYPE_Q5_0, q50, out, 32);
    ASSERT_NEAR(out[0], 0.0, 0); /* 0 + 16 - 16 */
    ASSERT_NEAR(out[1], -15.0, 0);
    ASSERT_NEAR(out[16], -1.0, 0);               /* 15 - 16 */
    uint8_t q4k[144] = {0x00, 0x3c, 0x00, 0x38}; /* d = 1, dmin = 0.5 */
    q4k[4] = 2, q4k[8] = 3;                      /* sub-block 0: sc 2, mn 3 */
    q4k[16] = 0x57;                              /* element 0: 7, element 32: 5 */
    cs__dtype_to_f32(CS_DTYPE_Q4_K, q4k, out, 256);
    ASSERT_NEAR(out[0], 2 * 7 - 1.5, 0);
    ASSERT_NEAR(out[32], 0.0, 0); /* sub-block 1: sc 0, mn 0 */
    uint8_t q6k[210] = {0};
    q6k[0] = 0x0f, q6k[128] = 0x03;   /* element 0: 15 | 3 << 4 = 63 */
    q6k[192] = (uint8_t)-3;           /* sc[0] = -3 */
    q6k[208] = 0x00, q6k[209] = 0x40; /* d = 2 */
    cs__dtype_to_f32(CS_DTYPE_Q6_K, q6k, out, 256);
    ASSERT_NEAR(out[0], 2 * -3 * 31.0, 0);
    ASSERT_NEAR(out[1], 2 * -3 * -32.0, 0);
    ASSERT_NEAR(out[16], 0.0, 0); /* sc[1] = 0 */
    /* scales that are not finite */
    ASSERT_TRUE(cs__dtype_bad_scale(CS_DTYPE_Q4_K, q4k, 256) == -1);
    q4k[3] = 0x7c; /* dmin = Inf */
    ASSERT_TRUE(cs__dtype_bad_scale(CS_DTYPE_Q4_K, q4k, 256) == 0);
    q6k[209] = 0x7e; /* d = NaN */
    ASSERT_TRUE(cs__dtype_bad_scale(CS_DTYPE_Q6_K, q6k, 256) == 0);
    ASSERT_TRUE(cs__dtype_bad_scale(CS_DTYPE_F16, q6k, 16) == -1); /* not a block type */
}

int main(void) {
    check_f16();
    check_blocks();
    check_new_blocks();
    return 0;
}
