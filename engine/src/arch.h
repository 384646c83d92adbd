/* arch.h: what a model family is, to the loader. One cs_arch per family,
 * each in its own file (arch_llama.c: Llama, Mistral, Qwen2; arch_gemma3.c:
 * Gemma 3), listed in arch.c's registry: the only place that knows which
 * families exist.
 *
 * A family is a set of properties, not code: the hyperparameters its GGUF
 * metadata carries beyond the common ones (model_gguf.c reads those:
 * {arch}.block_count, .embedding_length, .attention.*, .rope.freq_base,
 * RoPE scaling), which it turns into the block's optional parts in
 * cs_model_config (QK-norm, post norms, the gate activation, embedding and
 * attention scales, sliding windows and their RoPE base), plus the few
 * things a converter did to its tensors and a default chat template. The
 * forward passes (the backends, forward_ref.c) run one block shape whose
 * parts those flags switch on; none of them names a family.
 *
 * Adding a family: a new arch_<name>.c with its cs_arch, one row in arch.c,
 * and, when its block needs a part the kernels lack, that part (an optional
 * tensor row in model.c's weight table and a flag here). */
#ifndef CS_ARCH_H
#define CS_ARCH_H

#include "gguf.h"
#include "chunkserve/model.h"

typedef struct {
    const char *name;          /* family, for messages */
    const char *gguf[4];       /* general.architecture values it loads, NULL-ended */
    const char *hf[4];         /* config.json model_type values, NULL-ended; none: GGUF only */
    bool gguf_qk_permuted;     /* llama.cpp's converter interleaved q/k rows for ggml's RoPE */
    const char *chat_template; /* for files that lack one, or NULL */
    /* Reads the family's own GGUF keys into c, after the common ones, and
     * checks them: 0, or an error naming the key. NULL: nothing more. */
    int (*gguf_config)(const cs_gguf *g, cs_model_config *c, const char *path);
} cs_arch;

/* The family that loads general.architecture (or model_type) `name`, or
 * NULL. */
const cs_arch *cs__arch_find_gguf(const char *name);
const cs_arch *cs__arch_find_hf(const char *model_type);
/* The names those load, "llama, mistral, ...", into buf (for a refusal). */
void cs__arch_names(bool hf, char *buf, size_t cap);
/* The chat template for a GGUF of architecture `name` that carries none:
 * its family's, or Gemma's for the Gemma architectures not served (gemma,
 * gemma2: their vocabulary-only loads still render chats); NULL if none. */
const char *cs__arch_default_chat_template(const char *name);

/* {arch}.<suffix> as u32 / f32 into *out: an absent optional key leaves
 * *out; an absent required one fails naming it. */
int cs__gguf_arch_u32(const cs_gguf *g, const char *arch, const char *suffix, bool required,
                      int32_t *out, const char *path);
int cs__gguf_arch_f32(const cs_gguf *g, const char *arch, const char *suffix, float *out);

#endif
