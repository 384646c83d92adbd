/* kvx_engine.c: the glue between the KV transport and the engine: the
 * layout an engine's pool has on the wire. */
#include "chunkserve/engine.h"
#include "chunkserve/kvx.h"

cs_kvx_layout cs_kvx_layout_of_engine(cs_engine *e) {
    const cs_model_config *cf = cs_model_get_config(cs_engine_model(e));
    cs_kvx_layout l = {0};
    l.n_layers = cf->n_layers;
    l.n_kv_heads = cf->n_kv_heads;
    l.head_dim = cf->head_dim;
    l.dtype = CS_KVX_DTYPE_F32; /* the CPU backend's pool */
    l.page_size = cs_kv_cache_page_size(cs_engine_kv(e));
    l.page_bytes = cs_engine_page_bytes(e);
    return l;
}
