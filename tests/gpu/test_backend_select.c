/* test_backend_select: the registry's choice on this machine (runs
 * everywhere, GPU or not): auto picks cuda iff the probe finds a GPU,
 * CHUNKSERVE_BACKEND=cpu forces the CPU, =cuda without a GPU is a clear
 * error (never a silent fallback), and the page size follows the backend
 * (fp32 CPU pages, bf16 CUDA pages). */
#include <stdlib.h>

#include "chunkserve/engine.h"
#include "gpu_test.h"

int main(void) {
    char path[1024], name[320], why[320];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    cs_model *m = NULL;
    ASSERT_EQ_INT(cs_model_load(path, &m), 0);
    const cs_model_config *cf = cs_model_get_config(m);
    int n = cs_backend_cuda_probe(name, sizeof name, why, sizeof why);
    printf("probe: %d device(s) %s%s\n", n, name, why);
    cs_engine_params p = cs_engine_params_default();
    cs_engine *e = NULL;
    size_t fp32_page = (size_t)cf->n_layers * 2 * 16 * cf->n_kv_heads * cf->head_dim * 4;

    unsetenv("CHUNKSERVE_BACKEND");
    ASSERT_EQ_INT(cs_engine_init(m, &p, &e), 0);
    ASSERT_EQ_STR(cs_engine_backend_name(e), n > 0 ? "cuda" : "cpu");
    ASSERT_EQ_INT(cs_engine_page_bytes(e), n > 0 ? fp32_page / 2 : fp32_page);
    cs_engine_free(e);

    setenv("CHUNKSERVE_BACKEND", "cpu", 1);
    ASSERT_EQ_INT(cs_engine_init(m, &p, &e), 0);
    ASSERT_EQ_STR(cs_engine_backend_name(e), "cpu");
    cs_engine_free(e);

    setenv("CHUNKSERVE_BACKEND", "cuda", 1);
    int r = cs_engine_init(m, &p, &e);
    if (n > 0) {
        ASSERT_EQ_INT(r, 0);
        ASSERT_EQ_STR(cs_engine_backend_name(e), "cuda");
        cs_engine_free(e);
    } else {
        ASSERT_EQ_INT(r, CS_ENOSYS);
        ASSERT_MSG_HAS(cs_last_error(), "no usable GPU");
        printf("forced cuda without a GPU: %s\n", cs_last_error());
    }
    cs_model_free(m);
    return 0;
}
