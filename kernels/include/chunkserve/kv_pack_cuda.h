/* chunkserve/kv_pack_cuda.h: the CUDA backend's KV pages <-> a contiguous
 * device buffer (kernels/cuda/kv_pack.cu), for its kv_export/kv_import and
 * the NCCL payload of the KV transport's staging (kvx/src/kvx_payload_nccl.c):
 * all that crosses from kernels/ to kvx/. Builds with CUDA only.
 *
 * gather: staging page i = pool page ids[i], i < n, contiguous; scatter: the
 * reverse. Pool page p starts at pool + p * page_bytes; ids are n device
 * int32 page ids; page_bytes a multiple of 8. sum (device, may be NULL) is
 * set to the KV sum of the staging bytes, computed in the same pass: the
 * formula of cs__kvx_sum_ref (kvx/src/kvx-impl.h). Asynchronous on s. */
#ifndef CHUNKSERVE_KV_PACK_CUDA_H
#define CHUNKSERVE_KV_PACK_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

void cs_cuda_kv_gather(const void *pool, size_t page_bytes, const int32_t *ids, int32_t n,
                       void *staging, unsigned long long *sum, cudaStream_t s);
void cs_cuda_kv_scatter(void *pool, size_t page_bytes, const int32_t *ids, int32_t n,
                        const void *staging, unsigned long long *sum, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
