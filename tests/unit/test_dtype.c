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
    ASSERT_TRUE(cs__dtype_info(14) == NULL); /* q6_K: not supported */
    ASSERT_EQ_STR(cs__dtype_name(14), "q6_K");
}

int main(void) {
    check_f16();
    check_blocks();
    return 0;
}
