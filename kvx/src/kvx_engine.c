/* kvx_engine.c: the glue between the KV transport and the engine: the
 * layout an engine's pool has on the wire, and where the pool is. */
#include "chunkserve/kvx_engine.h"

cs_kvx_layout cs_kvx_layout_of_engine(cs_engine *e) {
    const cs_model_config *cf = cs_model_get_config(cs_engine_model(e));
    cs_kvx_layout l = {0};
    l.n_layers = cs_engine_kv_layers(e); /* per page: every layer, or one kind's share */
    l.n_kv_heads = cf->n_kv_heads;
    l.head_dim = cf->head_dim;
    l.page_size = cs_kv_cache_page_size(cs_engine_kv(e));
    l.page_bytes = cs_engine_page_bytes(e);
    /* the element size tells the backend's pool: fp32 on the CPU, bf16 on
     * CUDA (the only 2-byte pool) */
    uint64_t elems = (uint64_t)l.n_layers * 2 * (uint64_t)l.page_size * (uint64_t)l.n_kv_heads *
                     (uint64_t)l.head_dim;
    l.dtype = elems && l.page_bytes == 2 * elems ? CS_KVX_DTYPE_BF16 : CS_KVX_DTYPE_F32;
    l.weights = cs_model_weight_mode(cs_engine_model(e)) == CS_WEIGHTS_QUANT ? CS_KVX_WEIGHTS_QUANT
                                                                             : CS_KVX_WEIGHTS_FP32;
    l.model = cs_model_fingerprint(cs_engine_model(e));
    return l;
}

cs_kvx_pool cs_kvx_pool_of_engine(cs_engine *e) {
    cs_engine_kv_pool_info in;
    cs_engine_kv_pool(e, &in);
    cs_kvx_pool p = {0};
    p.kind = in.device < 0 ? CS_KVX_POOL_HOST : CS_KVX_POOL_CUDA;
    p.device = in.device < 0 ? 0 : in.device;
    p.base = in.base;
    p.n_pages = in.n_pages;
    return p;
}
