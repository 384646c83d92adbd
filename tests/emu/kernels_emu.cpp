/* tests/emu/kernels_emu.cpp: the CUDA backend's launchers and kernels
 * (kernels/cuda/kernels.cu, kv_pack.cu) compiled as C++ for the host: with
 * CS_SIMT_EMU, CS_LAUNCH runs each kernel under simt_emu.h. */
#include "../../kernels/cuda/kernels.cu"
#include "../../kernels/cuda/kv_pack.cu"
