/* dtype.h: tensor element types (numbered as ggml's, so GGUF type ids map
 * directly) and conversion of any supported type to fp32. */
#ifndef CS_DTYPE_H
#define CS_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "chunkserve/half.h"

enum cs_dtype {
    CS_DTYPE_F32 = 0,
    CS_DTYPE_F16 = 1,
    CS_DTYPE_Q4_0 = 2,
    CS_DTYPE_Q4_1 = 3,
    CS_DTYPE_Q5_0 = 6,
    CS_DTYPE_Q5_1 = 7,
    CS_DTYPE_Q8_0 = 8,
    CS_DTYPE_Q4_K = 12,
    CS_DTYPE_Q5_K = 13,
    CS_DTYPE_Q6_K = 14,
    CS_DTYPE_BF16 = 30,
    CS_DTYPE_COUNT = 31 /* one past the largest id; not every id below is supported */
};

typedef struct {
    const char *name;
    int block_size;  /* elements per block */
    int block_bytes; /* bytes per block */
} cs_dtype_info;

/* Info for a supported type, NULL for an unknown or unsupported id. */
const cs_dtype_info *cs__dtype_info(uint32_t type);
/* Name for any ggml type id, including ones we don't support ("q6_K", ...). */
const char *cs__dtype_name(uint32_t type);
/* Bytes for n elements; false when n is not a whole number of blocks or the
 * size overflows. */
bool cs__dtype_nbytes(enum cs_dtype t, uint64_t n, size_t *out);
/* Converts n elements (a whole number of blocks) to fp32, exactly as the
 * GGUF reference dequantizers (ggml, and the gguf Python package's numpy
 * code) do: each product and sum rounded to fp32 on its own. */
void cs__dtype_to_f32(enum cs_dtype t, const void *src, float *dst, size_t n);
/* For the block types: the index of the first block of n elements whose
 * fp16 scale (d, m, dmin) is infinite or NaN, or -1 when every one is finite. */
int64_t cs__dtype_bad_scale(enum cs_dtype t, const void *src, size_t n);

#endif
