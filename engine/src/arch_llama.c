/* arch_llama.c: the Llama family: Llama 2/3, Mistral, SmolLM, and Qwen2
 * (q/k/v biases, found by their tensors). Pre-norm blocks, SwiGLU, one RoPE
 * for every layer, attention over every position: the block with none of
 * its optional parts, so nothing beyond the common keys is read. Mistral
 * v0.1's 4096-token window is not applied (as llama.cpp does for "llama"
 * files: every position is attended). */
#include "arch.h"

const cs_arch cs__arch_llama = {
    .name = "llama",
    .gguf = {"llama", "mistral", NULL},
    .hf = {"llama", "mistral", NULL},
    .gguf_qk_permuted = true,
};

/* Qwen2: Llama's block with q/k/v biases; its converter keeps q/k rows in
 * Hugging Face order. */
const cs_arch cs__arch_qwen2 = {
    .name = "qwen2",
    .gguf = {"qwen2", NULL},
    .hf = {"qwen2", NULL},
    .gguf_qk_permuted = false,
};
