/* tests/emu/cuda_emu.cpp: the CUDA runtime and cuBLAS calls of
 * fake/cuda_runtime_api.h and fake/cublas_v2.h, on the host, so that the
 * CUDA backend (kernels/cuda/backend_cuda.c) and its kernels (compiled for
 * the host under simt_emu.h) run end to end where no GPU exists. One
 * emulated device ("SIMT emulator", sm_90, 4 SMs: few enough that small
 * grids take the split-K path). Device memory is host memory, 256-byte
 * aligned like cudaMalloc's; streams run each call at once, in order;
 * cublasGemmEx accumulates in fp32. Nothing here is timed. */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "cublas_v2.h"
#include "cuda_runtime_api.h"
#include "simt_emu.h"

struct cs_emu_stream {
    int unused;
};
struct cs_emu_event {
    double t;
};
struct cs_emu_blas {
    cudaStream_t stream;
};

extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "SIMT emulator (host)");
    prop->totalGlobalMem = (size_t)8 << 30;
    prop->major = 9, prop->minor = 0, prop->multiProcessorCount = 4;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
    *value = 4;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
cudaError_t cudaDeviceSynchronize(void) {
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
    return cudaSuccess;
}
const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    }
    return "cudaErrorUnknown";
}
const char *cudaGetErrorString(cudaError_t e) {
    return cudaGetErrorName(e);
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
    *p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) {
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t bytes) {
    return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeHost(void *p) {
    return cudaFree(p);
}
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned) {
    return cudaMalloc(p, bytes);
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind) {
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
    return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    memset(p, value, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t) {
    return cudaMemset(p, value, bytes);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = new cs_emu_stream();
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
    return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t) {
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) {
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new cs_emu_event();
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) {
    return cudaEventCreate(e);
}
cudaError_t cudaEventQuery(cudaEvent_t) {
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    e->t = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    *ms = (float)((end->t - start->t) * 1e3);
    return cudaSuccess;
}

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new cs_emu_blas();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
const char *cublasGetStatusName(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_NOT_SUPPORTED";
}
const char *cublasGetStatusString(cublasStatus_t s) {
    return cublasGetStatusName(s);
}

cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType a_type,
                            int lda, const void *B, cudaDataType b_type, int ldb, const void *beta,
                            void *C, cudaDataType c_type, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
    if (a_type != CUDA_R_16BF || b_type != CUDA_R_16BF || c_type != CUDA_R_32F ||
        compute != CUBLAS_COMPUTE_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    const uint16_t *a = (const uint16_t *)A, *b = (const uint16_t *)B;
    float *c = (float *)C, al = *(const float *)alpha, be = *(const float *)beta;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p++) {
                float x = simt::bf16_f32(ta == CUBLAS_OP_N ? a[i + (size_t)p * lda]
                                                           : a[p + (size_t)i * lda]);
                float y = simt::bf16_f32(tb == CUBLAS_OP_N ? b[p + (size_t)j * ldb]
                                                           : b[j + (size_t)p * ldb]);
                acc += x * y;
            }
            float *o = &c[i + (size_t)j * ldc];
            *o = al * acc + (be != 0.0f ? be * *o : 0.0f);
        }
    return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */
