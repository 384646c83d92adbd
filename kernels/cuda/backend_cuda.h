/* kernels/cuda/backend_cuda.h: the CUDA backend's entry points for the
 * registry (kernels/backend.c) and the GPU tests/bench. Plain C, no CUDA
 * types: including it never needs the CUDA headers. Only compiled when the
 * build has CUDA (CS_HAVE_CUDA). */
#ifndef CS_KERNELS_CUDA_BACKEND_CUDA_H
#define CS_KERNELS_CUDA_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "chunkserve/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable GPUs (compute capability >= 8.0: bf16), 0 when there is
 * none. Never fails: a cudaGetDeviceCount error (35 = no driver, 100 = no
 * device, ...) counts as 0 and is described in why. name gets device 0's
 * name when the result is >= 1. Safe to call without a driver: the runtime
 * is linked, never libcuda (architecture.md, dependencies). */
int cs_backend_cuda_probe(char *name, size_t name_len, char *why, size_t why_len);

/* Bytes of one KV page in the CUDA backend's format: bf16,
 * n_layers * 2 (K, V) * page_size * n_kv_heads * head_dim * 2 bytes. */
size_t cs_backend_cuda_page_bytes(const cs_weights_shape *shape, int32_t page_size);

/* The CUDA backend on device 0: uploads w's fp32 weights as bf16 (the device
 * holds its own copy: w need not outlive the backend).
 * CS_ENOTSUP for shapes the kernels do not cover (odd head_dim, head_dim >
 * 256, more than 64 query heads per KV head), CS_ENOMEM when the weights do
 * not fit. Any other CUDA/cuBLAS error is fatal (logged, then abort). */
int cs_backend_cuda_init(const cs_weights *w, cs_backend **out);

/* The same backend with random bf16 weights generated on the device (uniform,
 * scaled by 1/sqrt(fan_in); norms 1) for a config that need not exist on disk:
 * benchmarks of large shapes. rope_inv_freq: (head_dim / 2) floats. */
int cs_backend_cuda_init_random(const cs_weights_shape *shape, const float *rope_inv_freq,
                                uint64_t seed, cs_backend **out);

/* Device bytes of the bf16 weights the backend holds (for roofline numbers). */
size_t cs_backend_cuda_weight_bytes(const cs_backend *b);

#ifdef __cplusplus
}
#endif
#endif
