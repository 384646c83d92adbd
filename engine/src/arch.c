/* arch.c: the registry of model families (arch.h). */
#include <stdio.h>
#include <string.h>

#include "arch.h"

extern const cs_arch cs__arch_llama, cs__arch_qwen2, cs__arch_gemma3;

static const cs_arch *const families[] = {&cs__arch_llama, &cs__arch_qwen2, &cs__arch_gemma3};
#define N_FAMILIES (sizeof families / sizeof families[0])

static const cs_arch *find(const char *name, bool hf, const char **supported) {
    static char list[2][256];
    char *l = list[hf];
    if (!l[0]) { /* the names in registry order, built once: "llama, mistral, ..." */
        size_t off = 0;
        for (size_t f = 0; f < N_FAMILIES; f++) {
            const char *const *names = hf ? families[f]->hf : families[f]->gguf;
            for (int i = 0; i < 4 && names[i] && off < sizeof list[0]; i++)
                off += (size_t)snprintf(l + off, sizeof list[0] - off, "%s%s", off ? ", " : "",
                                        names[i]);
        }
    }
    if (supported) *supported = l;
    for (size_t f = 0; f < N_FAMILIES; f++) {
        const char *const *names = hf ? families[f]->hf : families[f]->gguf;
        for (int i = 0; i < 4 && names[i]; i++)
            if (!strcmp(names[i], name)) return families[f];
    }
    return NULL;
}

const cs_arch *cs__arch_find_gguf(const char *name, const char **supported) {
    return find(name, false, supported);
}
const cs_arch *cs__arch_find_hf(const char *model_type, const char **supported) {
    return find(model_type, true, supported);
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
