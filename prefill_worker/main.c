/* chunkserve-prefill: the prefill worker (see prefill.c). Thin: the shared
 * worker skeleton runs it. */
#include "chunkserve/ops.h"
#include "worker.h"

extern const cs_worker_role cs_prefill_role;

int main(int argc, char **argv) {
    cs_op_blas_fix_coretype(argv);
    return cs_worker_main(argc, argv, &cs_prefill_role);
}
