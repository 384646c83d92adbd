/* tests/emu/fake/cuda_bf16.h: the bf16 types come from the SIMT emulator. */
#ifndef CS_EMU_CUDA_BF16_H
#define CS_EMU_CUDA_BF16_H
#include "simt_emu.h"
#endif
