/* arch.c: the registry of model families (arch.h). */
#include <stdio.h>
#include <string.h>

#include "arch.h"
#include "tokenizer-impl.h"

extern const cs_arch cs__arch_llama, cs__arch_qwen2, cs__arch_gemma3;

static const cs_arch *const families[] = {&cs__arch_llama, &cs__arch_qwen2, &cs__arch_gemma3};
#define N_FAMILIES (sizeof families / sizeof families[0])

static const cs_arch *find(const char *name, bool hf) {
    for (size_t f = 0; f < N_FAMILIES; f++) {
        const char *const *names = hf ? families[f]->hf : families[f]->gguf;
        for (int i = 0; i < 4 && names[i]; i++)
            if (!strcmp(names[i], name)) return families[f];
    }
    return NULL;
}

const cs_arch *cs__arch_find_gguf(const char *name) {
    return find(name, false);
}
const cs_arch *cs__arch_find_hf(const char *model_type) {
    return find(model_type, true);
}

void cs__arch_names(bool hf, char *buf, size_t cap) {
    size_t off = 0;
    buf[0] = 0;
    for (size_t f = 0; f < N_FAMILIES; f++) {
        const char *const *names = hf ? families[f]->hf : families[f]->gguf;
        for (int i = 0; i < 4 && names[i] && off < cap; i++)
            off += (size_t)snprintf(buf + off, cap - off, "%s%s", off ? ", " : "", names[i]);
    }
}

const char *cs__arch_default_chat_template(const char *name) {
    const cs_arch *family = find(name, false);
    if (family) return family->chat_template;
    return !strncmp(name, "gemma", 5) ? cs__gemma_chat_template : NULL;
}

int cs__gguf_arch_u32(const cs_gguf *g, const char *arch, const char *suffix, bool required,
                      int32_t *out, const char *path) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v;
    int r = cs__gguf_get_u32(g, key, &v);
    if (r == CS_ENOENT) {
        if (required) return cs_fail(CS_EBADMSG, "gguf: %s: missing metadata key '%s'", path, key);
        return 0;
    }
    if (r) return r;
    if (v > INT32_MAX) return cs_fail(CS_EBADMSG, "gguf: %s: '%s' = %u is too large", path, key, v);
    *out = (int32_t)v;
    return 0;
}

int cs__gguf_arch_f32(const cs_gguf *g, const char *arch, const char *suffix, float *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int r = cs__gguf_get_f32(g, key, out);
    return r == CS_ENOENT ? 0 : r;
}
