/* test_kvx_layout_emu: the KV transport's layout of an engine
 * (kvx/src/kvx_engine.c) says what its backend's pool holds: fp32 pages on
 * the CPU backend, bf16 on CUDA (here the host emulation of the CUDA
 * backend), so that a CPU and a CUDA worker refuse each other's pages at
 * HELLO with the reason, instead of one misreading the other's bytes. */
#include <stdlib.h>

#include "chunkserve/engine.h"
#include "chunkserve/kvx_engine.h"
#include "test.h"

static void check(const cs_model *m, const char *backend, int32_t dtype, size_t elem_bytes) {
    setenv("CHUNKSERVE_BACKEND", backend, 1);
    cs_engine_params p = cs_engine_params_default();
    p.page_size = 16;
    p.n_pages = 8;
    cs_engine *e = NULL;
    ASSERT_EQ_INT(cs_engine_init(m, &p, &e), 0);
    cs_kvx_layout l = cs_kvx_layout_of_engine(e);
    const cs_model_config *cf = cs_model_get_config(m);
    ASSERT_EQ_INT(l.dtype, dtype);
    ASSERT_EQ_INT(l.page_size, 16);
    ASSERT_EQ_INT((int64_t)l.page_bytes, (int64_t)((size_t)cf->n_layers * 2 * 16 * cf->n_kv_heads *
                                                   cf->head_dim * elem_bytes));
    printf("  %-5s backend: KV dtype %d, %llu bytes a page\n", backend, l.dtype,
           (unsigned long long)l.page_bytes);
    cs_engine_free(e);
}

int main(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    cs_model *m = NULL;
    ASSERT_EQ_INT(cs_model_load(path, &m), 0);
    check(m, "cpu", CS_KVX_DTYPE_F32, 4);
    check(m, "cuda", CS_KVX_DTYPE_BF16, 2);
    cs_model_free(m);
    printf("test_kvx_layout_emu: all passed\n");
    return 0;
}
