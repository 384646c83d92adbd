/* ops_fast_copy.c: kernels/cpu/ops_fast.c once more, its functions renamed
 * with the prefix OPS_COPY (a compile definition), for test_ops_isa.c.
 * tests/CMakeLists.txt builds it twice: for x86-64 with AVX2 + FMA (the
 * generic 8-lane vectors with hardware FMA) and for the x86-64 baseline
 * (generic vectors, FMA through fmaf), whatever the rest of the build
 * targets. */
#if defined(__AVX512F__) || (defined(OPS_COPY_BASELINE) && (defined(__FMA__) || defined(__AVX__)))
#error "ops_fast_copy.c: the copy targets more than its instruction set (check the -mno- flags)"
#endif
#define CS_COPY_CAT_(p, n) p##n
#define CS_COPY_CAT(p, n) CS_COPY_CAT_(p, n)
#define cs_op_blas_fix_coretype CS_COPY_CAT(OPS_COPY, blas_fix_coretype)
#define cs_op_matmul CS_COPY_CAT(OPS_COPY, matmul)
#define cs_op_rmsnorm CS_COPY_CAT(OPS_COPY, rmsnorm)
#define cs_op_rope CS_COPY_CAT(OPS_COPY, rope)
#define cs_op_swiglu CS_COPY_CAT(OPS_COPY, swiglu)
#define cs_op_attention CS_COPY_CAT(OPS_COPY, attention)
#include "ops_fast.c"
