/* chunkserve/kvx_engine.h: the one place where the KV transport meets the
 * engine (library cs_kvx_engine): the wire layout of an engine's KV pool and
 * the pool itself. The transport proper (chunkserve/kvx.h, cs_kvx) knows no
 * engine. */
#ifndef CHUNKSERVE_KVX_ENGINE_H
#define CHUNKSERVE_KVX_ENGINE_H

#include "chunkserve/engine.h"
#include "chunkserve/kvx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The layout of e's KV pool: fp32 pages on the CPU backend, bf16 on CUDA
 * (told apart by the pool's bytes per element). */
cs_kvx_layout cs_kvx_layout_of_engine(cs_engine *e);

/* e's KV pool as the transport sees it: host memory on the CPU backend (the
 * TCP payload), device memory on CUDA (the NCCL payload). */
cs_kvx_pool cs_kvx_pool_of_engine(cs_engine *e);

#ifdef __cplusplus
}
#endif
#endif
