/* tests/emu/fake/cuda_runtime.h: the runtime API plus, for kernel sources
 * (C++), the SIMT emulator's built-ins. */
#ifndef CS_EMU_CUDA_RUNTIME_H
#define CS_EMU_CUDA_RUNTIME_H
#include "cuda_runtime_api.h"
#ifdef __cplusplus
#include "simt_emu.h"
#endif
#endif
