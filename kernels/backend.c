/* backend.c: the backend registry: the only place that knows which backends
 * exist and that CUDA may be absent (the one #ifdef CS_HAVE_CUDA).
 *
 * Selection (logged once at start): CHUNKSERVE_BACKEND=cpu|cuda forces one
 * (cuda without a usable GPU is an error, not a silent fallback); unset or
 * "auto" picks CUDA when cudaGetDeviceCount succeeds with >= 1 device of
 * compute capability 8.0+, the CPU backend otherwise, with the reason. A
 * model the CUDA kernels cannot run (CS_ENOTSUP) also falls back in auto
 * mode. The CUDA runtime is linked, never libcuda (architecture.md,
 * dependencies): on a machine without a driver cudaGetDeviceCount fails
 * (error 35) and we use the CPU. */
#include <stdlib.h>
#include <string.h>

#include "chunkserve/backend.h"
#include "qmat.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"
#ifdef CS_HAVE_CUDA
#include "cuda/backend_cuda.h"
#endif

static int cpu(const cs_weights *m, int n_threads, bool kv_bf16, const char *why,
               cs_backend **out) {
    int r = cs_backend_cpu_init(m, n_threads, kv_bf16, out);
    if (r == 0)
        CS_LOGI("backend: cpu (%s), %s KV pages%s%s", why, kv_bf16 ? "bf16" : "fp32",
                m->q_tok_embd ? ", integer kernels: " : "",
                m->q_tok_embd ? cs_qmat_kernels_name() : "");
    return r;
}

bool cs_backend_will_use_cuda(void) {
    const char *want = getenv("CHUNKSERVE_BACKEND");
    if (want && strcmp(want, "cuda") == 0) return true;
    if (want && *want && strcmp(want, "auto") != 0) return false;
#ifdef CS_HAVE_CUDA
    char name[320], why[320];
    return cs_backend_cuda_probe(name, sizeof name, why, sizeof why) >= 1;
#else
    return false;
#endif
}

int cs_backend_init(const cs_weights *m, int n_threads, bool kv_bf16, cs_backend **out) {
    *out = NULL;
    const char *want = getenv("CHUNKSERVE_BACKEND");
    if (!want || !*want) want = "auto";
    bool force_cuda = strcmp(want, "cuda") == 0;
    if (strcmp(want, "cpu") == 0) return cpu(m, n_threads, kv_bf16, "CHUNKSERVE_BACKEND=cpu", out);
    if (!force_cuda && strcmp(want, "auto") != 0)
        return cs_fail(CS_EINVAL, "CHUNKSERVE_BACKEND=%s: expected cpu, cuda or auto", want);
    if (m->q_tok_embd) { /* quant mode: integer kernels exist for the CPU only */
        if (force_cuda)
            return cs_fail(CS_ENOTSUP, "CHUNKSERVE_BACKEND=cuda: the CUDA backend runs fp32 "
                                       "weights; load the model in exact mode (--exact)");
        return cpu(m, n_threads, kv_bf16, "quantized weights run on the CPU", out);
    }
#ifdef CS_HAVE_CUDA
    char name[320], why[320];
    int n = cs_backend_cuda_probe(name, sizeof name, why, sizeof why);
    if (n < 1) {
        if (force_cuda)
            return cs_fail(CS_ENOSYS, "CHUNKSERVE_BACKEND=cuda but no usable GPU: %s", why);
        return cpu(m, n_threads, kv_bf16, why, out);
    }
    int r = cs_backend_cuda_init(m, out);
    if (r == 0) {
        CS_LOGI("backend: cuda on device 0 of %d: %s", n, name);
        return 0;
    }
    if (r != CS_ENOTSUP || force_cuda) return r;
    CS_LOGW("backend: the CUDA backend cannot run this model (%s); using the CPU", cs_last_error());
    return cpu(m, n_threads, kv_bf16, "CUDA backend does not support the model", out);
#else
    if (force_cuda)
        return cs_fail(CS_ENOSYS, "CHUNKSERVE_BACKEND=cuda but this build has no CUDA backend "
                                  "(configure with -DCS_CUDA=ON)");
    return cpu(m, n_threads, kv_bf16, "built without CUDA", out);
#endif
}

size_t cs_backend_page_bytes(const cs_backend *b, const cs_weights_shape *shape,
                             int32_t page_size) {
#ifdef CS_HAVE_CUDA
    if (strcmp(b->iface->name, "cuda") == 0) return cs_backend_cuda_page_bytes(shape, page_size);
#endif
    return cs_backend_cpu_page_bytes(shape, page_size, cs_backend_cpu_kv_bf16(b));
}

void cs_backend_free(cs_backend *b) {
    if (!b) return;
    b->iface->free(b->ctx);
    free(b);
}
