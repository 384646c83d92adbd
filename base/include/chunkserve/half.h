/* chunkserve/half.h: fp16 and bf16 <-> fp32, the one copy every module uses
 * (the model loaders, the quantized weights' scales, bf16 KV pages).
 * Widening is exact; narrowing rounds to nearest even; NaN stays NaN, and
 * fp16 overflow becomes infinity. Pure functions, thread-safe. */
#ifndef CHUNKSERVE_HALF_H
#define CHUNKSERVE_HALF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

float cs_f16_to_f32(uint16_t h);
uint16_t cs_f32_to_f16(float f);

/* Inline: bf16 pages convert one element at a time in the KV kernels. */
static inline float cs_bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } x = {(uint32_t)h << 16};
    return x.f;
}
static inline uint16_t cs_f32_to_bf16(float f) {
    union {
        float f;
        uint32_t u;
    } x = {f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#ifdef __cplusplus
}
#endif
#endif
