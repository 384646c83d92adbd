/* arch_gemma3.c: Gemma 3 (text), everything it adds to the Llama block, as
 * Hugging Face's Gemma3ForCausalLM and llama.cpp's gemma3 graph compute it:
 *   - the embedding rows scaled by sqrt(dim);
 *   - QK-norm: each q and k head RMSNormed (its own weights) before RoPE;
 *   - sandwich norms: the attention and the FFN outputs RMSNormed again
 *     before their residual adds;
 *   - GeGLU with GELU's tanh form;
 *   - interleaved layers: windowed ("local") layers attend to the last
 *     {arch}.attention.sliding_window positions and use RoPE base
 *     rope.freq_base_swa (10000 when absent); layer l attends to everything,
 *     with rope.freq_base and the file's RoPE scaling, when (l + 1) is a
 *     multiple of attention.sliding_window_pattern (6 when absent: 5 local,
 *     then 1 global, llama.cpp's fixed gemma3 pattern; with llama.cpp's rule
 *     for other patterns, 1 makes every layer global and one longer than the
 *     model every layer local). A file without a window has no windowed
 *     layers; a window of 0 is refused (llama.cpp reads it as none);
 *   - query_pre_attn_scalar: q . k scaled by 1/sqrt(head_dim), except the
 *     27B (62 layers), which uses 1/sqrt(dim / n_heads); GGUF files do not
 *     carry it, so this follows llama.cpp;
 *   - Gemma's chat template when the file has none.
 * The GGUF converter stores RMSNorm weights as 1 + w (Gemma's norm
 * multiplies by 1 + w), so every norm is the plain RMSNorm here. Logit
 * soft-capping (Gemma 2's; Gemma 3 has none) is refused when a file asks
 * for it, as is a layer pattern given as a per-layer list. */
#include <math.h>
#include <stdio.h>

#include "arch.h"
#include "tokenizer-impl.h"

static int gemma3_gguf_config(const cs_gguf *g, cs_model_config *c, const char *path) {
    const char *a = c->arch;
    int32_t window = 0, period = 6;
    float theta_swa = 10000.0f;
    char key[128];
    static const char *const unsupported[] = {"final_logit_softcapping", "attn_logit_softcapping"};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++) {
        float cap = 0; /* 0 (or absent): no soft-capping */
        int r = cs__gguf_arch_f32(g, a, unsupported[i], &cap);
        if (r) return r;
        if (cap != 0)
            return cs_fail(CS_ENOTSUP,
                           "gguf: %s: '%s.%s' = %g: logit soft-capping is not supported", path, a,
                           unsupported[i], cap);
    }
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
    const cs_gguf_kv *pat = cs__gguf_find(g, key);
    if (pat && pat->type == CS_GGUF_ARRAY)
        return cs_fail(CS_ENOTSUP, "gguf: %s: '%s' as a per-layer list is not supported", path,
                       key);
    int r;
    if ((r = cs__gguf_arch_u32(g, a, "attention.sliding_window", false, &window, path)) ||
        (r = cs__gguf_arch_u32(g, a, "attention.sliding_window_pattern", false, &period, path)) ||
        (r = cs__gguf_arch_f32(g, a, "rope.freq_base_swa", &theta_swa)))
        return r;
    snprintf(key, sizeof key, "%s.attention.sliding_window", a);
    if (cs__gguf_find(g, key) && window < 1)
        return cs_fail(CS_EBADMSG, "gguf: %s: %s = %d: a window must hold at least one position",
                       path, key, window);
    if (period < 1)
        return cs_fail(CS_EBADMSG,
                       "gguf: %s: %s.attention.sliding_window_pattern = %d must be at least 1",
                       path, a, period);
    if (!(theta_swa > 0) || !isfinite(theta_swa))
        return cs_fail(CS_EBADMSG, "gguf: %s: %s.rope.freq_base_swa = %g must be positive", path, a,
                       theta_swa);
    if (c->n_heads < 1 || c->head_dim < 1)
        return cs_fail(CS_EBADMSG, "gguf: %s: %d heads of %d dims", path, c->n_heads, c->head_dim);
    c->sliding_window = period == 1 ? 0 : window; /* pattern 1: every layer global */
    c->swa_period = period;
    c->rope_theta_swa = theta_swa;
    c->qk_norm = true;
    c->post_norms = true;
    c->gelu = true;
    c->embed_scale = sqrtf((float)c->dim);
    c->attn_scale = c->n_layers == 62 ? 1.0f / sqrtf((float)(c->dim / c->n_heads))
                                      : 1.0f / sqrtf((float)c->head_dim);
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
