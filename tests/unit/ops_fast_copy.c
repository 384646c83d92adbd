/* ops_fast_copy.c: kernels/cpu/ops_fast.c once more, its functions renamed
 * with the prefix OPS_COPY (a compile definition), for test_ops_isa.c.
 * tests/CMakeLists.txt builds it twice: with AVX2 + FMA and no AVX-512 (the
 * generic 8-lane vectors with FMA instructions), and with the x86-64
 * baseline's vector ISA (SSE2: no AVX, no FMA, so fmaf) and no load-time
 * clones. The other flags of the build stay, so the copies differ from
 * this build's ops in their vector ISA, which is what the test is about. */
#if defined(__AVX512F__) ||                                                                        \
    (defined(OPS_COPY_AVX2) && !(defined(__AVX2__) && defined(__FMA__))) ||                        \
    (defined(OPS_COPY_BASELINE) && (defined(__FMA__) || defined(__AVX__)))
#error "ops_fast_copy.c: the copy's instruction set is not the one intended (check the -m flags)"
#endif
#define CS_COPY_CAT_(p, n) p##n
#define CS_COPY_CAT(p, n) CS_COPY_CAT_(p, n)
#define cs_op_blas_fix_coretype CS_COPY_CAT(OPS_COPY, blas_fix_coretype)
#define cs_op_matmul CS_COPY_CAT(OPS_COPY, matmul)
#define cs_op_rmsnorm CS_COPY_CAT(OPS_COPY, rmsnorm)
#define cs_op_rope CS_COPY_CAT(OPS_COPY, rope)
#define cs_op_glu CS_COPY_CAT(OPS_COPY, glu)
#define cs_op_attention CS_COPY_CAT(OPS_COPY, attention)
#include "ops_fast.c"
