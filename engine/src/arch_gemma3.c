/* arch_gemma3.c: Gemma 3 (text), everything it adds to the Llama block, as
 * Hugging Face's Gemma3ForCausalLM and llama.cpp's gemma3 graph compute it:
 *   - the embedding rows scaled by sqrt(dim);
 *   - QK-norm: each q and k head RMSNormed (its own weights) before RoPE;
 *   - sandwich norms: the attention and the FFN outputs RMSNormed again
 *     before their residual adds;
 *   - GeGLU with GELU's tanh form;
 *   - interleaved layers: windowed ("local") layers attend to the last
 *     {arch}.attention.sliding_window positions and use RoPE base
 *     rope.freq_base_swa (10000 when absent); every
 *     attention.sliding_window_pattern-th layer (6 when absent: 5 local,
 *     then 1 global) attends to everything with rope.freq_base and the
 *     file's RoPE scaling;
 *   - query_pre_attn_scalar: q . k scaled by 1/sqrt(head_dim), except the
 *     27B (62 layers), which uses 1/sqrt(dim / n_heads); GGUF files do not
 *     carry it, so this follows llama.cpp;
 *   - tied output; Gemma's chat template when the file has none.
 * The GGUF converter stores RMSNorm weights as 1 + w (Gemma's norm
 * multiplies by 1 + w), so every norm is the plain RMSNorm here. No logit
 * soft-capping (Gemma 2's; Gemma 3 has none). */
#include <math.h>

#include "arch.h"
#include "tokenizer-impl.h"

static int gemma3_gguf_config(const cs_gguf *g, cs_model_config *c, const char *path) {
    const char *a = c->arch;
    int32_t window = -1, period = 6;
    float theta_swa = 10000.0f;
    int r;
    if ((r = cs__gguf_arch_u32(g, a, "attention.sliding_window", true, &window, path)) ||
        (r = cs__gguf_arch_u32(g, a, "attention.sliding_window_pattern", false, &period, path)) ||
        (r = cs__gguf_arch_f32(g, a, "rope.freq_base_swa", &theta_swa)))
        return r;
    if (window < 1 || window > c->ctx_len)
        return cs_fail(CS_EBADMSG,
                       "gguf: %s: %s.attention.sliding_window = %d must be in 1..%d (the "
                       "context length)",
                       path, a, window, c->ctx_len);
    if (period < 2 || period > c->n_layers)
        return cs_fail(CS_EBADMSG,
                       "gguf: %s: %s.attention.sliding_window_pattern = %d must be in 2..%d (a "
                       "global layer after every pattern - 1 windowed ones, within the %d layers)",
                       path, a, period, c->n_layers, c->n_layers);
    if (!(theta_swa > 0) || !isfinite(theta_swa))
        return cs_fail(CS_EBADMSG, "gguf: %s: %s.rope.freq_base_swa = %g must be positive", path, a,
                       theta_swa);
    c->sliding_window = window;
    c->swa_period = period;
    c->rope_theta_swa = theta_swa;
    c->qk_norm = true;
    c->post_norms = true;
    c->gelu = true;
    c->embed_scale = sqrtf((float)c->dim);
    c->attn_scale = c->n_layers == 62 ? 1.0f / sqrtf((float)(c->dim / c->n_heads))
                                      : 1.0f / sqrtf((float)c->head_dim);
    c->tied_embeddings = true;
    return 0;
}

const cs_arch cs__arch_gemma3 = {
    .name = "gemma3",
    .gguf = {"gemma3", NULL},
    .hf = {NULL}, /* Hugging Face directories of Gemma 3: not yet (the GGUF files are) */
    .gguf_qk_permuted = false,
    .chat_template = cs__gemma_chat_template,
    .gguf_config = gemma3_gguf_config,
};
