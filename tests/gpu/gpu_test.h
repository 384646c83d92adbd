/* gpu_test.h: shared helpers of the GPU tests: skip (exit 77) without a GPU,
 * random numbers, bf16 rounding, normalized error that treats NaN == NaN
 * (unwritten KV slots hold NaN so reads past a context show up). */
#ifndef CS_GPU_TEST_H
#define CS_GPU_TEST_H

#include <stdint.h>

#include "backend_cuda.h"
#include "dtype.h"
#include "test.h"

static inline void gpu_test_require(const char *prog) {
    char name[320], why[320];
    if (cs_backend_cuda_probe(name, sizeof name, why, sizeof why) < 1) {
        printf("%s: SKIP: no usable GPU (%s)\n", prog, why);
        exit(TEST_SKIP);
    }
    printf("%s: device 0: %s\n", prog, name);
}

static uint64_t gt_rng = 0x2545f4914f6cdd1dull;
static inline uint64_t gt_next(void) {
    gt_rng ^= gt_rng << 13, gt_rng ^= gt_rng >> 7, gt_rng ^= gt_rng << 17;
    return gt_rng;
}
static inline float gt_frand(void) {
    return (float)(gt_next() >> 40) / (float)(1 << 23) - 1.0f;
}
static inline int gt_irand(int n) {
    return (int)(gt_next() % (uint64_t)n);
}
static inline float gt_round_bf16(float f) {
    return cs_bf16_to_f32(cs_f32_to_bf16(f));
}

/* ||a - ref|| / ||ref||; positions where both are NaN are skipped, a NaN on
 * one side only makes the error infinite. */
static inline double gt_norm_err(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        int na = a[i] != a[i], nr = ref[i] != ref[i];
        if (na && nr) continue;
        if (na || nr) return INFINITY;
        double d = (double)a[i] - ref[i];
        num += d * d, den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define GT_CHECK_ERR(what, err, tol)                                                               \
    do {                                                                                           \
        double e__ = (err);                                                                        \
        printf("  %-60s err %.2e (tol %.0e)\n", (what), e__, (double)(tol));                       \
        if (!(e__ <= (tol))) {                                                                     \
            fprintf(stderr, "%s:%d: %s: normalized error %.3e > %.1e\n", __FILE__, __LINE__,       \
                    (what), e__, (double)(tol));                                                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif
