/* chunkserve-mktiny: writes a tiny, deterministic, random-weight Llama in both
 * formats chunkserve loads, for fast tests (with --gemma3 W, a Gemma 3 block
 * instead: QK-norm, sandwich norms, GeGLU, windowed layers of W positions
 * with every third layer global; GGUF only, as chunkserve loads Gemma 3):
 *   OUT/tiny.gguf             GGUF v3, weights in --type, llama q/k rows permuted
 *                             the way llama.cpp's converter does
 *   OUT/tiny-hf/              config.json, model.safetensors, tokenizer.json,
 *                             tokenizer_config.json (Hugging Face layout)
 * Both hold the same values (quantized GGUF weights are written to the
 * safetensors file dequantized), so both must give identical logits.
 * The tokenizer is a real byte-level BPE: 256 byte tokens plus merges learned
 * from a built-in corpus, ChatML special tokens and SmolLM2's chat template.
 * It is not a model of anything: outputs are deterministic noise. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dtype.h"
#include "unicode.h"

typedef struct {
    int dim, n_layers, n_heads, n_kv_heads, head_dim, hidden, ctx;
    bool untied, bias;
    enum cs_dtype type;
    uint64_t seed;
    const char *arch;
    int window; /* gemma3: sliding window (0: a llama-family model) */
    /* gemma3 metadata chunkserve refuses (for the refusal tests): a logit
     * soft-cap, or the window pattern as a per-layer list */
    const char *unsupported; /* NULL, "softcap" or "pattern-list" */
} tiny_cfg;

/* ---- deterministic random numbers ---- */
static uint64_t rng_state;
static uint64_t next_u64(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float uniform(float a) {
    return ((float)(next_u64() >> 40) / (float)(1 << 24) * 2.0f - 1.0f) * a;
}

/* ---- tokenizer: byte-level BPE trained on a small corpus ---- */
static const char *corpus =
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in "
    "fixed-size pages; the scheduler mixes prompt chunks with decode tokens under a token budget. "
    "Chunked prefill splits a long prompt into pieces so no step stalls the other streams. "
    "def forward(self, x):\n    return self.proj(x) + x\n\nint main(void) { return 0; }\n"
    "Hello, world! How are you today? I am fine, thank you. The cat sat on the mat. "
    "In 2024 there were 365 days and 12 months; numbers like 3.14159 and 2718 appear too. "
    "The model reads the prompt, writes its cache, and then generates one token at a time. "
    "Serving systems schedule requests, batch them together and stream tokens back to users. "
    "the the the and and of of to to in in is is that that it it for for on on with with as as ";

#define N_SPECIAL 3
static const char *special_tokens[N_SPECIAL] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
static const char *chat_template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

typedef struct {
    char **tokens;
    int n_tokens;
    char **merges;
    int n_merges;
} vocab;

static char *xstrdup(const char *s) {
    char *d = strdup(s);
    if (!d) {
        fprintf(stderr, "mktiny: out of memory\n");
        exit(1);
    }
    return d;
}

/* Splits the corpus into words: an optional leading space plus a run of
 * letters, single digits, or runs of other non-space bytes. Any split works
 * for training: merges never cross word boundaries. */
typedef struct {
    int *sym;
    int n;
    int count;
} word;

static void train_bpe(vocab *v, int n_merges) {
    v->tokens = calloc(N_SPECIAL + 256 + (size_t)n_merges, sizeof(char *));
    v->merges = calloc((size_t)n_merges, sizeof(char *));
    for (int i = 0; i < N_SPECIAL; i++)
        v->tokens[v->n_tokens++] = xstrdup(special_tokens[i]);
    for (int b = 0; b < 256; b++) {
        uint8_t u[5] = {0};
        cs__utf8_encode(cs__byte_to_unicode((uint8_t)b), u);
        v->tokens[v->n_tokens++] = xstrdup((char *)u);
    }
    word *words = NULL;
    int n_words = 0;
    const unsigned char *s = (const unsigned char *)corpus;
    size_t len = strlen(corpus), i = 0;
    while (i < len) {
        size_t j = i;
        if (s[j] == ' ' && j + 1 < len && s[j + 1] != ' ') j++;
        if ((s[j] | 32) >= 'a' && (s[j] | 32) <= 'z') {
            while (j < len && (s[j] | 32) >= 'a' && (s[j] | 32) <= 'z')
                j++;
        } else {
            j++;
        }
        words = realloc(words, (size_t)(n_words + 1) * sizeof *words);
        word *w = &words[n_words++];
        w->n = (int)(j - i);
        w->count = 1;
        w->sym = malloc((size_t)w->n * sizeof(int));
        for (int k = 0; k < w->n; k++)
            w->sym[k] = N_SPECIAL + s[i + k];
        i = j;
    }
    int cap = N_SPECIAL + 256 + n_merges;
    int *pair_count = calloc((size_t)cap * (size_t)cap, sizeof(int));
    for (int m = 0; m < n_merges; m++) {
        memset(pair_count, 0, (size_t)cap * (size_t)cap * sizeof(int));
        for (int w = 0; w < n_words; w++)
            for (int k = 0; k + 1 < words[w].n; k++)
                pair_count[words[w].sym[k] * cap + words[w].sym[k + 1]] += words[w].count;
        int best = -1, best_count = 1; /* a pair must occur twice to be merged */
        for (int p = 0; p < cap * cap; p++)
            if (pair_count[p] > best_count) best = p, best_count = pair_count[p];
        if (best < 0) break;
        int a = best / cap, b = best % cap, id = v->n_tokens;
        size_t la = strlen(v->tokens[a]), lb = strlen(v->tokens[b]);
        char *t = malloc(la + lb + 1), *mg = malloc(la + lb + 2);
        memcpy(t, v->tokens[a], la);
        memcpy(t + la, v->tokens[b], lb + 1);
        memcpy(mg, v->tokens[a], la);
        mg[la] = ' ';
        memcpy(mg + la + 1, v->tokens[b], lb + 1);
        v->tokens[v->n_tokens++] = t;
        v->merges[v->n_merges++] = mg;
        for (int w = 0; w < n_words; w++) {
            int o = 0;
            for (int k = 0; k < words[w].n; k++) {
                if (k + 1 < words[w].n && words[w].sym[k] == a && words[w].sym[k + 1] == b) {
                    words[w].sym[o++] = id;
                    k++;
                } else {
                    words[w].sym[o++] = words[w].sym[k];
                }
            }
            words[w].n = o;
        }
    }
    for (int w = 0; w < n_words; w++)
        free(words[w].sym);
    free(words);
    free(pair_count);
}

/* ---- the weights, in HF layout ---- */
typedef struct {
    char gguf[96], hf[128];
    int rows, cols; /* cols 0: vector */
    int perm_heads; /* >0: q/k rows to permute for GGUF llama */
    float *data;
} tensor;

static int add_tensor(tensor *ts, int n, const char *gguf, const char *hf, int layer, int rows,
                      int cols, float scale, float offset, int perm_heads) {
    tensor *t = &ts[n];
    snprintf(t->gguf, sizeof t->gguf, gguf, layer);
    snprintf(t->hf, sizeof t->hf, hf, layer);
    t->rows = rows;
    t->cols = cols;
    t->perm_heads = perm_heads;
    size_t count = (size_t)rows * (size_t)(cols ? cols : 1);
    t->data = malloc(count * sizeof(float));
    for (size_t i = 0; i < count; i++)
        t->data[i] = offset + uniform(scale);
    return n + 1;
}

/* Rounds weights through the GGUF type so both files hold identical values. */
static void *quantize(enum cs_dtype type, const float *x, size_t n, size_t *nbytes);
static enum cs_dtype tensor_type(const tiny_cfg *c, int cols);

static int build_tensors(const tiny_cfg *c, int n_vocab, tensor *ts) {
    int n = 0, q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
    bool llama = !strcmp(c->arch, "llama");
    n = add_tensor(ts, n, "token_embd.weight", "model.embed_tokens.weight", 0, n_vocab, c->dim,
                   1.0f, 0, 0);
    n = add_tensor(ts, n, "output_norm.weight", "model.norm.weight", 0, c->dim, 0, 0.1f, 1.0f, 0);
    if (c->untied)
        n = add_tensor(ts, n, "output.weight", "lm_head.weight", 0, n_vocab, c->dim,
                       sqrtf(3.0f / c->dim), 0, 0);
    for (int l = 0; l < c->n_layers; l++) {
        float sd = sqrtf(3.0f / c->dim), sh = sqrtf(3.0f / c->hidden), sq = sqrtf(3.0f / q);
        n = add_tensor(ts, n, "blk.%d.attn_norm.weight", "model.layers.%d.input_layernorm.weight",
                       l, c->dim, 0, 0.1f, 1.0f, 0);
        n = add_tensor(ts, n, "blk.%d.attn_q.weight", "model.layers.%d.self_attn.q_proj.weight", l,
                       q, c->dim, sd * 2, 0, llama ? c->n_heads : 0);
        n = add_tensor(ts, n, "blk.%d.attn_k.weight", "model.layers.%d.self_attn.k_proj.weight", l,
                       kv, c->dim, sd * 2, 0, llama ? c->n_kv_heads : 0);
        n = add_tensor(ts, n, "blk.%d.attn_v.weight", "model.layers.%d.self_attn.v_proj.weight", l,
                       kv, c->dim, sd, 0, 0);
        if (c->bias) {
            n = add_tensor(ts, n, "blk.%d.attn_q.bias", "model.layers.%d.self_attn.q_proj.bias", l,
                           q, 0, 0.5f, 0, llama ? c->n_heads : 0);
            n = add_tensor(ts, n, "blk.%d.attn_k.bias", "model.layers.%d.self_attn.k_proj.bias", l,
                           kv, 0, 0.5f, 0, llama ? c->n_kv_heads : 0);
            n = add_tensor(ts, n, "blk.%d.attn_v.bias", "model.layers.%d.self_attn.v_proj.bias", l,
                           kv, 0, 0.5f, 0, 0);
        }
        n = add_tensor(ts, n, "blk.%d.attn_output.weight",
                       "model.layers.%d.self_attn.o_proj.weight", l, c->dim, q, sq, 0, 0);
        n = add_tensor(ts, n, "blk.%d.ffn_norm.weight",
                       "model.layers.%d.post_attention_layernorm.weight", l, c->dim, 0, 0.1f, 1.0f,
                       0);
        n = add_tensor(ts, n, "blk.%d.ffn_gate.weight", "model.layers.%d.mlp.gate_proj.weight", l,
                       c->hidden, c->dim, sd, 0, 0);
        n = add_tensor(ts, n, "blk.%d.ffn_up.weight", "model.layers.%d.mlp.up_proj.weight", l,
                       c->hidden, c->dim, sd, 0, 0);
        n = add_tensor(ts, n, "blk.%d.ffn_down.weight", "model.layers.%d.mlp.down_proj.weight", l,
                       c->dim, c->hidden, sh, 0, 0);
        if (c->window) { /* Gemma 3's parts (norms stored as 1 + w, as its converter does) */
            n = add_tensor(ts, n, "blk.%d.attn_q_norm.weight", "-", l, c->head_dim, 0, 0.1f, 1.0f,
                           0);
            n = add_tensor(ts, n, "blk.%d.attn_k_norm.weight", "-", l, c->head_dim, 0, 0.1f, 1.0f,
                           0);
            n = add_tensor(ts, n, "blk.%d.post_attention_norm.weight", "-", l, c->dim, 0, 0.1f,
                           1.0f, 0);
            n = add_tensor(ts, n, "blk.%d.post_ffw_norm.weight", "-", l, c->dim, 0, 0.1f, 1.0f, 0);
        }
    }
    /* Vectors stay f32 in GGUF (as llama.cpp writes norms); matrices take the
     * type. The safetensors file stores everything as F16/BF16 when that is
     * the type, else F32: round each tensor through what will hold it. */
    bool half = c->type == CS_DTYPE_F16 || c->type == CS_DTYPE_BF16;
    for (int i = 0; i < n; i++) {
        if (c->type == CS_DTYPE_F32 || (!ts[i].cols && !half)) continue;
        size_t count = (size_t)ts[i].rows * (size_t)(ts[i].cols ? ts[i].cols : 1), nb;
        enum cs_dtype type = ts[i].cols ? tensor_type(c, ts[i].cols) : c->type;
        void *qd = quantize(type, ts[i].data, count, &nb);
        cs__dtype_to_f32(type, qd, ts[i].data, count);
        free(qd);
    }
    return n;
}

static bool is_k(enum cs_dtype t) {
    return t == CS_DTYPE_Q4_K || t == CS_DTYPE_Q5_K || t == CS_DTYPE_Q6_K;
}
/* A matrix's type: the model's, except that a K-quant falls back to Q5_0
 * where a row is not whole 256-weight super-blocks (as llama.cpp's
 * quantizer does for such tensors); vectors stay F32. */
static enum cs_dtype tensor_type(const tiny_cfg *c, int cols) {
    if (!cols) return CS_DTYPE_F32;
    if (is_k(c->type) && cols % 256) return CS_DTYPE_Q5_0;
    return c->type;
}

static void put16(uint8_t *o, float v) {
    uint16_t h = cs_f32_to_f16(v);
    memcpy(o, &h, 2);
}
static int clampi(float v, int lo, int hi) {
    int q = (int)lrintf(v);
    return q < lo ? lo : q > hi ? hi : q;
}

/* Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins under fp16
 * super-scales; levels = 15 or 31. Not llama.cpp's optimizing search, a
 * plain min/max fit: the bits are valid, the error a little larger. */
static void quantize_k45(const float *x, uint8_t *o, int levels) {
    float scale[8], mins[8], smax = 0, mmax = 0;
    for (int j = 0; j < 8; j++) {
        float lo = 0, hi = 0;
        for (int l = 0; l < 32; l++)
            lo = fminf(lo, x[32 * j + l]), hi = fmaxf(hi, x[32 * j + l]);
        scale[j] = (hi - lo) / (float)levels, mins[j] = -lo;
        smax = fmaxf(smax, scale[j]), mmax = fmaxf(mmax, mins[j]);
    }
    put16(o, smax / 63), put16(o + 2, mmax / 63);
    float d = cs_f16_to_f32(cs_f32_to_f16(smax / 63)), dm = cs_f16_to_f32(cs_f32_to_f16(mmax / 63));
    int sc[8], mn[8];
    uint8_t *sp = o + 4;
    memset(sp, 0, 12);
    for (int j = 0; j < 8; j++) {
        sc[j] = d > 0 ? clampi(scale[j] / d, 0, 63) : 0;
        mn[j] = dm > 0 ? clampi(mins[j] / dm, 0, 63) : 0;
        if (j < 4) {
            sp[j] |= (uint8_t)sc[j], sp[j + 4] |= (uint8_t)mn[j];
        } else {
            sp[j + 4] |= (uint8_t)((sc[j] & 15) | (mn[j] & 15) << 4);
            sp[j - 4] |= (uint8_t)((sc[j] >> 4) << 6), sp[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
    bool five = levels == 31;
    uint8_t *qh = o + 16, *qs = o + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        float dl = d * (float)sc[j], ml = dm * (float)mn[j];
        for (int l = 0; l < 32; l++) {
            int q = dl > 0 ? clampi((x[32 * j + l] + ml) / dl, 0, levels) : 0;
            qs[32 * (j / 2) + l] |= (uint8_t)((q & 15) << (4 * (j & 1)));
            if (five) qh[l] |= (uint8_t)((q >> 4) << j);
        }
    }
}

/* Q6_K: 16 sub-blocks of 16 with int8 scales under an fp16 super-scale. */
static void quantize_q6k(const float *x, uint8_t *o) {
    float scale[16], amax = 0;
    for (int j = 0; j < 16; j++) {
        float m = 0;
        for (int l = 0; l < 16; l++)
            if (fabsf(x[16 * j + l]) > fabsf(m)) m = x[16 * j + l];
        scale[j] = m / -32.0f;
        amax = fmaxf(amax, fabsf(scale[j]));
    }
    float d = cs_f16_to_f32(cs_f32_to_f16(amax / 127));
    put16(o + 208, amax / 127);
    uint8_t *ql = o, *qh = o + 128;
    for (int j = 0; j < 16; j++) {
        int8_t sc = (int8_t)(d > 0 ? clampi(scale[j] / d, -128, 127) : 0);
        o[192 + j] = (uint8_t)sc;
        float dl = d * (float)sc;
        for (int l = 0; l < 16; l++) {
            int e = 16 * j + l, half = e / 128, f = e % 128;
            int q = dl != 0 ? clampi(x[e] / dl + 32, 0, 63) : 32;
            if (f < 64)
                ql[64 * half + f] |= (uint8_t)(q & 15);
            else
                ql[64 * half + f - 64] |= (uint8_t)((q & 15) << 4);
            qh[32 * half + f % 32] |= (uint8_t)((q >> 4) << (2 * (f / 32)));
        }
    }
}

static void *quantize(enum cs_dtype type, const float *x, size_t n, size_t *nbytes) {
    size_t nb = 0;
    if (!cs__dtype_nbytes(type, n, &nb)) {
        fprintf(stderr, "mktiny: bad size for type\n");
        exit(1);
    }
    uint8_t *out = calloc(1, nb), *o = out;
    *nbytes = nb;
    switch (type) {
    case CS_DTYPE_F32: memcpy(out, x, n * 4); break;
    case CS_DTYPE_F16:
    case CS_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h = type == CS_DTYPE_F16 ? cs_f32_to_f16(x[i]) : cs_f32_to_bf16(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
        break;
    case CS_DTYPE_Q8_0:
        for (size_t b = 0; b < n / 32; b++, o += 34) {
            float amax = 0;
            for (int j = 0; j < 32; j++)
                amax = fmaxf(amax, fabsf(x[b * 32 + j]));
            uint16_t dh = cs_f32_to_f16(amax / 127.0f);
            float d = cs_f16_to_f32(dh), id = d ? 1.0f / d : 0;
            memcpy(o, &dh, 2);
            for (int j = 0; j < 32; j++)
                o[2 + j] = (uint8_t)(int8_t)lrintf(fminf(127, fmaxf(-127, x[b * 32 + j] * id)));
        }
        break;
    case CS_DTYPE_Q4_0:
        for (size_t b = 0; b < n / 32; b++, o += 18) {
            float amax = 0, mx = 0;
            for (int j = 0; j < 32; j++)
                if (fabsf(x[b * 32 + j]) > amax) amax = fabsf(x[b * 32 + j]), mx = x[b * 32 + j];
            uint16_t dh = cs_f32_to_f16(mx / -8.0f);
            float d = cs_f16_to_f32(dh), id = d ? 1.0f / d : 0;
            memcpy(o, &dh, 2);
            for (int j = 0; j < 16; j++) {
                int q0 = (int)fminf(15, fmaxf(0, x[b * 32 + j] * id + 8.5f));
                int q1 = (int)fminf(15, fmaxf(0, x[b * 32 + j + 16] * id + 8.5f));
                o[2 + j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        break;
    case CS_DTYPE_Q4_1:
        for (size_t b = 0; b < n / 32; b++, o += 20) {
            float mn = INFINITY, mx = -INFINITY;
            for (int j = 0; j < 32; j++)
                mn = fminf(mn, x[b * 32 + j]), mx = fmaxf(mx, x[b * 32 + j]);
            uint16_t dh = cs_f32_to_f16((mx - mn) / 15.0f), mh = cs_f32_to_f16(mn);
            float d = cs_f16_to_f32(dh), id = d ? 1.0f / d : 0;
            memcpy(o, &dh, 2);
            memcpy(o + 2, &mh, 2);
            for (int j = 0; j < 16; j++) {
                int q0 = (int)fminf(15, fmaxf(0, (x[b * 32 + j] - mn) * id + 0.5f));
                int q1 = (int)fminf(15, fmaxf(0, (x[b * 32 + j + 16] - mn) * id + 0.5f));
                o[4 + j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        break;
    case CS_DTYPE_Q5_0:
    case CS_DTYPE_Q5_1: {
        bool min = type == CS_DTYPE_Q5_1;
        for (size_t b = 0; b < n / 32; b++, o += min ? 24 : 22) {
            const float *xb = x + b * 32;
            float lo = INFINITY, hi = -INFINITY, mx = 0;
            for (int j = 0; j < 32; j++) {
                lo = fminf(lo, xb[j]), hi = fmaxf(hi, xb[j]);
                if (fabsf(xb[j]) > fabsf(mx)) mx = xb[j];
            }
            float d = cs_f16_to_f32(cs_f32_to_f16(min ? (hi - lo) / 31 : mx / -16.0f));
            put16(o, min ? (hi - lo) / 31 : mx / -16.0f);
            if (min) put16(o + 2, lo);
            float m = min ? cs_f16_to_f32(cs_f32_to_f16(lo)) : 0;
            uint8_t *qh = o + (min ? 4 : 2), *qs = qh + 4;
            uint32_t h = 0;
            for (int j = 0; j < 32; j++) {
                int q = d != 0 ? clampi(min ? (xb[j] - m) / d : xb[j] / d + 16, 0, 31) : 16 * !min;
                qs[j % 16] |= (uint8_t)((q & 15) << (j < 16 ? 0 : 4));
                h |= (uint32_t)(q >> 4) << j;
            }
            memcpy(qh, &h, 4);
        }
        break;
    }
    case CS_DTYPE_Q4_K:
    case CS_DTYPE_Q5_K:
        for (size_t b = 0; b < n / 256; b++, o += type == CS_DTYPE_Q4_K ? 144 : 176)
            quantize_k45(x + b * 256, o, type == CS_DTYPE_Q4_K ? 15 : 31);
        break;
    case CS_DTYPE_Q6_K:
        for (size_t b = 0; b < n / 256; b++, o += 210)
            quantize_q6k(x + b * 256, o);
        break;
    default: fprintf(stderr, "mktiny: unsupported type\n"); exit(1);
    }
    return out;
}

/* ---- GGUF writer ---- */
static void w_u32(FILE *f, uint32_t v) {
    fwrite(&v, 4, 1, f);
}
static void w_u64(FILE *f, uint64_t v) {
    fwrite(&v, 8, 1, f);
}
static void w_str(FILE *f, const char *s) {
    w_u64(f, strlen(s));
    fwrite(s, 1, strlen(s), f);
}
static uint64_t n_kv_written; /* patched into the header once all pairs are out */
static void kv_key(FILE *f, const char *k, uint32_t type) {
    w_str(f, k);
    w_u32(f, type);
    n_kv_written++;
}
static void kv_str(FILE *f, const char *k, const char *v) {
    kv_key(f, k, 8);
    w_str(f, v);
}
static void kv_u32(FILE *f, const char *k, uint32_t v) {
    kv_key(f, k, 4);
    w_u32(f, v);
}
static void kv_f32(FILE *f, const char *k, float v) {
    kv_key(f, k, 6);
    fwrite(&v, 4, 1, f);
}
static void kv_bool(FILE *f, const char *k, bool v) {
    kv_key(f, k, 7);
    uint8_t b = v;
    fwrite(&b, 1, 1, f);
}

static void permute_rows(const float *src, float *dst, int n_heads, int head_dim, int cols) {
    int half = head_dim / 2, c = cols ? cols : 1;
    for (int h = 0; h < n_heads; h++)
        for (int i = 0; i < half; i++)
            for (int j = 0; j < 2; j++)
                memcpy(dst + ((size_t)h * head_dim + 2 * i + j) * c,
                       src + ((size_t)h * head_dim + j * half + i) * c, (size_t)c * sizeof(float));
}

static int write_gguf(const char *path, const tiny_cfg *c, const vocab *v, tensor *ts, int n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    char k[128];
    const char *a = c->arch;
    w_u32(f, 0x46554747u);
    w_u32(f, 3);
    w_u64(f, (uint64_t)n);
    long kv_count_at = ftell(f);
    w_u64(f, 0);
    n_kv_written = 0;
    kv_str(f, "general.architecture", a);
    kv_str(f, "general.name", "chunkserve tiny test model");
    kv_u32(f, "general.alignment", 32);
#define AK(s) (snprintf(k, sizeof k, "%s.%s", a, s), k)
    kv_u32(f, AK("block_count"), (uint32_t)c->n_layers);
    kv_u32(f, AK("context_length"), (uint32_t)c->ctx);
    kv_u32(f, AK("embedding_length"), (uint32_t)c->dim);
    kv_u32(f, AK("feed_forward_length"), (uint32_t)c->hidden);
    kv_u32(f, AK("attention.head_count"), (uint32_t)c->n_heads);
    kv_u32(f, AK("attention.head_count_kv"), (uint32_t)c->n_kv_heads);
    kv_u32(f, AK("rope.dimension_count"), (uint32_t)c->head_dim);
    kv_f32(f, AK("rope.freq_base"), c->window ? 1000000.0f : 10000.0f);
    kv_f32(f, AK("attention.layer_norm_rms_epsilon"), 1e-5f);
    if (c->window) {
        kv_u32(f, AK("attention.key_length"), (uint32_t)c->head_dim);
        kv_u32(f, AK("attention.value_length"), (uint32_t)c->head_dim);
        kv_u32(f, AK("attention.sliding_window"), (uint32_t)c->window);
        if (c->unsupported && !strcmp(c->unsupported, "pattern-list")) {
            kv_key(f, AK("attention.sliding_window_pattern"), 9); /* array of bool, per layer */
            w_u32(f, 7);
            w_u64(f, (uint64_t)c->n_layers);
            for (int l = 0; l < c->n_layers; l++) {
                uint8_t windowed = (l + 1) % 3 != 0;
                fwrite(&windowed, 1, 1, f);
            }
        } else {
            kv_u32(f, AK("attention.sliding_window_pattern"), 3);
        }
        if (c->unsupported && !strcmp(c->unsupported, "softcap"))
            kv_f32(f, AK("final_logit_softcapping"), 30.0f);
    }
#undef AK
    kv_str(f, "tokenizer.ggml.model", "gpt2");
    kv_str(f, "tokenizer.ggml.pre", "smollm");
    kv_key(f, "tokenizer.ggml.tokens", 9);
    w_u32(f, 8);
    w_u64(f, (uint64_t)v->n_tokens);
    for (int i = 0; i < v->n_tokens; i++)
        w_str(f, v->tokens[i]);
    kv_key(f, "tokenizer.ggml.token_type", 9);
    w_u32(f, 5);
    w_u64(f, (uint64_t)v->n_tokens);
    for (int i = 0; i < v->n_tokens; i++)
        w_u32(f, i < N_SPECIAL ? 3 : 1);
    kv_key(f, "tokenizer.ggml.merges", 9);
    w_u32(f, 8);
    w_u64(f, (uint64_t)v->n_merges);
    for (int i = 0; i < v->n_merges; i++)
        w_str(f, v->merges[i]);
    kv_u32(f, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(f, "tokenizer.ggml.eos_token_id", 2);
    kv_u32(f, "tokenizer.ggml.unknown_token_id", 0);
    kv_u32(f, "tokenizer.ggml.padding_token_id", 2);
    kv_bool(f, "tokenizer.ggml.add_bos_token", false);
    kv_str(f, "tokenizer.chat_template", chat_template);
    long here = ftell(f);
    fseek(f, kv_count_at, SEEK_SET);
    w_u64(f, n_kv_written);
    fseek(f, here, SEEK_SET);

    void **blobs = calloc((size_t)n, sizeof(void *));
    size_t *sizes = calloc((size_t)n, sizeof(size_t)), off = 0;
    for (int i = 0; i < n; i++) {
        tensor *t = &ts[i];
        size_t count = (size_t)t->rows * (size_t)(t->cols ? t->cols : 1);
        float *src = t->data, *perm = NULL;
        if (t->perm_heads) {
            perm = malloc(count * sizeof(float));
            permute_rows(t->data, perm, t->perm_heads, c->head_dim, t->cols);
            src = perm;
        }
        enum cs_dtype type = tensor_type(c, t->cols);
        blobs[i] = quantize(type, src, count, &sizes[i]);
        free(perm);
        w_str(f, t->gguf);
        if (t->cols) {
            w_u32(f, 2);
            w_u64(f, (uint64_t)t->cols);
            w_u64(f, (uint64_t)t->rows);
        } else {
            w_u32(f, 1);
            w_u64(f, (uint64_t)t->rows);
        }
        w_u32(f, (uint32_t)type);
        w_u64(f, off);
        off += (sizes[i] + 31) / 32 * 32;
    }
    long pos = ftell(f);
    for (long p = pos; p % 32; p++)
        fputc(0, f);
    for (int i = 0; i < n; i++) {
        fwrite(blobs[i], 1, sizes[i], f);
        for (size_t p = sizes[i]; p % 32; p++)
            fputc(0, f);
        free(blobs[i]);
    }
    free(blobs);
    free(sizes);
    return fclose(f);
}

/* ---- Hugging Face directory ---- */
static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

static int write_hf(const char *dir, const tiny_cfg *c, const vocab *v, tensor *ts, int n) {
    char path[4096];
    if (mkdir(dir, 0755) && errno != EEXIST) return -1;
    enum cs_dtype st_type =
        c->type == CS_DTYPE_F16 || c->type == CS_DTYPE_BF16 ? c->type : CS_DTYPE_F32;
    const char *st_name = st_type == CS_DTYPE_F16    ? "F16"
                          : st_type == CS_DTYPE_BF16 ? "BF16"
                                                     : "F32";
    /* config.json */
    cJSON *cfg = cJSON_CreateObject();
    cJSON_AddStringToObject(cfg, "model_type", c->arch);
    cJSON *archs = cJSON_AddArrayToObject(cfg, "architectures");
    cJSON_AddItemToArray(archs, cJSON_CreateString(!strcmp(c->arch, "qwen2") ? "Qwen2ForCausalLM"
                                                                             : "LlamaForCausalLM"));
    cJSON_AddNumberToObject(cfg, "vocab_size", v->n_tokens);
    cJSON_AddNumberToObject(cfg, "hidden_size", c->dim);
    cJSON_AddNumberToObject(cfg, "intermediate_size", c->hidden);
    cJSON_AddNumberToObject(cfg, "num_hidden_layers", c->n_layers);
    cJSON_AddNumberToObject(cfg, "num_attention_heads", c->n_heads);
    cJSON_AddNumberToObject(cfg, "num_key_value_heads", c->n_kv_heads);
    cJSON_AddNumberToObject(cfg, "head_dim", c->head_dim);
    cJSON_AddNumberToObject(cfg, "max_position_embeddings", c->ctx);
    cJSON_AddNumberToObject(cfg, "rms_norm_eps", 1e-5);
    cJSON_AddNumberToObject(cfg, "rope_theta", 10000.0);
    cJSON_AddBoolToObject(cfg, "tie_word_embeddings", !c->untied);
    cJSON_AddBoolToObject(cfg, "attention_bias", c->bias);
    cJSON_AddNumberToObject(cfg, "bos_token_id", 1);
    cJSON_AddNumberToObject(cfg, "eos_token_id", 2);
    cJSON_AddStringToObject(cfg, "torch_dtype",
                            st_type == CS_DTYPE_F16    ? "float16"
                            : st_type == CS_DTYPE_BF16 ? "bfloat16"
                                                       : "float32");
    char *text = cJSON_Print(cfg);
    snprintf(path, sizeof path, "%s/config.json", dir);
    int r = write_text(path, text);
    free(text);
    cJSON_Delete(cfg);
    if (r) return r;
    /* tokenizer.json: SmolLM2's shape */
    cJSON *tj = cJSON_CreateObject();
    cJSON_AddStringToObject(tj, "version", "1.0");
    cJSON *added = cJSON_AddArrayToObject(tj, "added_tokens");
    for (int i = 0; i < N_SPECIAL; i++) {
        cJSON *t = cJSON_CreateObject();
        cJSON_AddNumberToObject(t, "id", i);
        cJSON_AddStringToObject(t, "content", special_tokens[i]);
        cJSON_AddBoolToObject(t, "single_word", false);
        cJSON_AddBoolToObject(t, "lstrip", false);
        cJSON_AddBoolToObject(t, "rstrip", false);
        cJSON_AddBoolToObject(t, "normalized", false);
        cJSON_AddBoolToObject(t, "special", true);
        cJSON_AddItemToArray(added, t);
    }
    cJSON_AddNullToObject(tj, "normalizer");
    cJSON *pre = cJSON_AddObjectToObject(tj, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "Sequence");
    cJSON *pts = cJSON_AddArrayToObject(pre, "pretokenizers");
    cJSON *dg = cJSON_CreateObject();
    cJSON_AddStringToObject(dg, "type", "Digits");
    cJSON_AddBoolToObject(dg, "individual_digits", true);
    cJSON_AddItemToArray(pts, dg);
    cJSON *bl = cJSON_CreateObject();
    cJSON_AddStringToObject(bl, "type", "ByteLevel");
    cJSON_AddBoolToObject(bl, "add_prefix_space", false);
    cJSON_AddBoolToObject(bl, "trim_offsets", true);
    cJSON_AddBoolToObject(bl, "use_regex", true);
    cJSON_AddItemToArray(pts, bl);
    cJSON_AddNullToObject(tj, "post_processor");
    cJSON *dec = cJSON_AddObjectToObject(tj, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON_AddBoolToObject(dec, "add_prefix_space", true);
    cJSON_AddBoolToObject(dec, "trim_offsets", true);
    cJSON_AddBoolToObject(dec, "use_regex", true);
    cJSON *model = cJSON_AddObjectToObject(tj, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddBoolToObject(model, "byte_fallback", false);
    cJSON *vj = cJSON_AddObjectToObject(model, "vocab");
    for (int i = 0; i < v->n_tokens; i++)
        cJSON_AddNumberToObject(vj, v->tokens[i], i);
    cJSON *mj = cJSON_AddArrayToObject(model, "merges");
    for (int i = 0; i < v->n_merges; i++)
        cJSON_AddItemToArray(mj, cJSON_CreateString(v->merges[i]));
    text = cJSON_PrintUnformatted(tj);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    r = write_text(path, text);
    free(text);
    cJSON_Delete(tj);
    if (r) return r;
    cJSON *tc = cJSON_CreateObject();
    cJSON_AddStringToObject(tc, "bos_token", "<|im_start|>");
    cJSON_AddStringToObject(tc, "eos_token", "<|im_end|>");
    cJSON_AddBoolToObject(tc, "add_bos_token", false);
    cJSON_AddStringToObject(tc, "chat_template", chat_template);
    text = cJSON_Print(tc);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    r = write_text(path, text);
    free(text);
    cJSON_Delete(tc);
    if (r) return r;
    /* model.safetensors */
    cJSON *hdr = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(hdr, "__metadata__");
    cJSON_AddStringToObject(meta, "format", "pt");
    size_t off = 0, esz = st_type == CS_DTYPE_F32 ? 4 : 2;
    for (int i = 0; i < n; i++) {
        tensor *t = &ts[i];
        size_t bytes = (size_t)t->rows * (size_t)(t->cols ? t->cols : 1) * esz;
        cJSON *e = cJSON_AddObjectToObject(hdr, t->hf);
        cJSON_AddStringToObject(e, "dtype", st_name);
        cJSON *shape = cJSON_AddArrayToObject(e, "shape");
        cJSON_AddItemToArray(shape, cJSON_CreateNumber(t->rows));
        if (t->cols) cJSON_AddItemToArray(shape, cJSON_CreateNumber(t->cols));
        cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + bytes)));
        off += bytes;
    }
    text = cJSON_PrintUnformatted(hdr);
    cJSON_Delete(hdr);
    size_t hlen = strlen(text), padded = (hlen + 7) / 8 * 8;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(text);
        return -1;
    }
    w_u64(f, padded);
    fwrite(text, 1, hlen, f);
    for (size_t p = hlen; p < padded; p++)
        fputc(' ', f);
    free(text);
    for (int i = 0; i < n; i++) {
        tensor *t = &ts[i];
        size_t count = (size_t)t->rows * (size_t)(t->cols ? t->cols : 1), nb;
        void *blob = quantize(st_type, t->data, count, &nb);
        fwrite(blob, 1, nb, f);
        free(blob);
    }
    return fclose(f);
}

static void usage(void) {
    fprintf(stderr,
            "usage: chunkserve-mktiny --out DIR [--type f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|\n"
            "                         q4_k|q5_k|q6_k] [--untied] [--qwen2] [--layers N] [--dim N]\n"
            "                         [--hidden N] [--seed N] [--gemma3 WINDOW]\n"
            "                         [--gemma3-unsupported softcap|pattern-list]\n"
            "Writes DIR/tiny.gguf and DIR/tiny-hf/ with identical weights.\n"
            "--qwen2: qwen2 architecture (q/k/v biases, no q/k permutation in GGUF).\n"
            "--gemma3 W: gemma3 architecture, windows of W positions, every 3rd layer global\n"
            "--gemma3-unsupported softcap|pattern-list: with it, metadata chunkserve refuses\n"
            "(3 layers unless --layers; GGUF only).\n"
            "K-quants apply where a row is whole 256-weight super-blocks, Q5_0 elsewhere\n"
            "(--dim 256 --hidden 512 makes every matrix a K-quant).\n");
}

int main(int argc, char **argv) {
    tiny_cfg c = {64, 2, 4, 2, 16, 192, 4096, false, false, CS_DTYPE_F32, 1, "llama", 0, NULL};
    bool layers_set = false;
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--out") && val)
            out = argv[++i];
        else if (!strcmp(a, "--untied"))
            c.untied = true;
        else if (!strcmp(a, "--qwen2"))
            c.bias = true, c.arch = "qwen2";
        else if (!strcmp(a, "--layers") && val)
            c.n_layers = atoi(argv[++i]), layers_set = true;
        else if (!strcmp(a, "--gemma3") && val)
            c.window = atoi(argv[++i]), c.arch = "gemma3";
        else if (!strcmp(a, "--gemma3-unsupported") && val)
            c.unsupported = argv[++i];
        else if (!strcmp(a, "--dim") && val)
            c.dim = atoi(argv[++i]);
        else if (!strcmp(a, "--hidden") && val)
            c.hidden = atoi(argv[++i]);
        else if (!strcmp(a, "--seed") && val)
            c.seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--type") && val) {
            const char *t = argv[++i];
            if (!strcmp(t, "f32"))
                c.type = CS_DTYPE_F32;
            else if (!strcmp(t, "f16"))
                c.type = CS_DTYPE_F16;
            else if (!strcmp(t, "bf16"))
                c.type = CS_DTYPE_BF16;
            else if (!strcmp(t, "q8_0"))
                c.type = CS_DTYPE_Q8_0;
            else if (!strcmp(t, "q4_0"))
                c.type = CS_DTYPE_Q4_0;
            else if (!strcmp(t, "q4_1"))
                c.type = CS_DTYPE_Q4_1;
            else if (!strcmp(t, "q5_0"))
                c.type = CS_DTYPE_Q5_0;
            else if (!strcmp(t, "q5_1"))
                c.type = CS_DTYPE_Q5_1;
            else if (!strcmp(t, "q4_k"))
                c.type = CS_DTYPE_Q4_K;
            else if (!strcmp(t, "q5_k"))
                c.type = CS_DTYPE_Q5_K;
            else if (!strcmp(t, "q6_k"))
                c.type = CS_DTYPE_Q6_K;
            else {
                usage();
                return 2;
            }
        } else {
            usage();
            return 2;
        }
    }
    if (c.window && !layers_set) c.n_layers = 3; /* two windowed, one global */
    if (!out || c.n_layers < 1 || c.dim < 32 || c.dim % 32 || c.dim % c.n_heads || c.hidden < 32 ||
        c.hidden % 32 || (!strcmp(c.arch, "gemma3") && (c.window < 1 || c.untied || c.bias)) ||
        (c.unsupported && (!c.window || (strcmp(c.unsupported, "softcap") &&
                                         strcmp(c.unsupported, "pattern-list"))))) {
        usage();
        return 2;
    }
    c.head_dim = c.dim / c.n_heads;
    rng_state = c.seed;
    vocab v = {0};
    train_bpe(&v, 512 - N_SPECIAL - 256);
    /* round the vocabulary to a multiple of 32 rows is not needed: rows are dim-long */
    tensor *ts = calloc(20 * (size_t)c.n_layers + 8, sizeof *ts);
    int n = build_tensors(&c, v.n_tokens, ts);
    char path[4096];
    if (mkdir(out, 0755) && errno != EEXIST) {
        fprintf(stderr, "mktiny: cannot create %s: %s\n", out, strerror(errno));
        return 1;
    }
    snprintf(path, sizeof path, "%s/tiny.gguf", out);
    if (write_gguf(path, &c, &v, ts, n)) {
        fprintf(stderr, "mktiny: cannot write %s\n", path);
        return 1;
    }
    snprintf(path, sizeof path, "%s/tiny-hf", out);
    if (!c.window && write_hf(path, &c, &v, ts, n)) {
        fprintf(stderr, "mktiny: cannot write %s\n", path);
        return 1;
    }
    fprintf(stderr, "mktiny: wrote %s/tiny.gguf%s%s%s (%s, %d layers, dim %d, vocab %d, %s)\n", out,
            c.window ? "" : " and ", c.window ? "" : out, c.window ? "" : "/tiny-hf", c.arch,
            c.n_layers, c.dim, v.n_tokens, cs__dtype_name(c.type));
    for (int i = 0; i < n; i++)
        free(ts[i].data);
    free(ts);
    for (int i = 0; i < v.n_tokens; i++)
        free(v.tokens[i]);
    for (int i = 0; i < v.n_merges; i++)
        free(v.merges[i]);
    free(v.tokens);
    free(v.merges);
    return 0;
}
