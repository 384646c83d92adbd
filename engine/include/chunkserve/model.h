/* chunkserve/model.h: a decoder-only transformer loaded from GGUF or a Hugging
 * Face safetensors directory into one in-memory representation.
 *
 * Covers the Llama family (RMSNorm, RoPE with theta, linear and Llama-3
 * scaling, GQA, SwiGLU, tied or untied embeddings, optional q/k/v biases as
 * Qwen2's) and Gemma 3 (QK-norm, sandwich norms, GeGLU, scaled embeddings,
 * sliding-window layers with their own RoPE base; GGUF only). Weights are held in
 * one of two modes (cs_weight_mode): fp32 ("exact"), or the file's quantized
 * blocks repacked for the CPU's integer kernels ("quant"). Every length, offset,
 * count, shape and type read from a file is validated before use: a bad file
 * gives an error naming the problem, never a crash. */
#ifndef CHUNKSERVE_MODEL_H
#define CHUNKSERVE_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_model cs_model;

enum cs_rope_scaling { CS_ROPE_SCALING_NONE = 0, CS_ROPE_SCALING_LINEAR, CS_ROPE_SCALING_LLAMA3 };

typedef struct {
    char arch[32];  /* "llama", "qwen2", ... */
    char name[128]; /* general.name or directory name */
    int32_t n_vocab;
    int32_t dim; /* hidden size */
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t hidden_dim; /* FFN inner size */
    int32_t ctx_len;    /* max positions the model was trained for */
    float norm_eps;
    float rope_theta;
    enum cs_rope_scaling rope_scaling;
    float rope_factor;           /* linear / llama3 factor */
    float rope_low_freq_factor;  /* llama3 */
    float rope_high_freq_factor; /* llama3 */
    int32_t rope_orig_ctx;       /* llama3 original_max_position_embeddings */
    bool tied_embeddings;
    bool qkv_bias;
    /* The block's optional parts (one family's file sets them: engine/src/arch_*.c) */
    bool qk_norm;           /* each q and k head RMSNormed before RoPE */
    bool post_norms;        /* attention and FFN outputs RMSNormed before their residual adds */
    bool gelu;              /* GeGLU (GELU's tanh form) instead of SwiGLU */
    float embed_scale;      /* embedding rows times this (1: none) */
    float attn_scale;       /* q . k multiplier (1 / sqrt(head_dim) unless the family says) */
    int32_t sliding_window; /* positions a windowed layer attends to (itself included); 0: none */
    int32_t swa_period;     /* with a window: layer l attends to everything when
                               (l + 1) % swa_period == 0; 0: every layer is windowed */
    float rope_theta_swa;   /* RoPE base of the windowed layers (no scaling) */
} cs_model_config;

/* The window layer `layer` attends within: c->sliding_window for a windowed
 * layer, 0 (every position) for the others. */
int32_t cs_model_layer_window(const cs_model_config *c, int32_t layer);

/* Loads a model. path is a .gguf file or a directory holding config.json,
 * *.safetensors (one file or shards with model.safetensors.index.json) and
 * tokenizer.json. The format is chosen from what path is.
 * On success *out owns everything; free with cs_model_free().
 * Failure: CS_ENOENT, CS_EBADMSG (malformed file), CS_ENOTSUP (architecture,
 * tensor type or tokenizer not supported), CS_ENOMEM; cs_last_error() says
 * what and where. *out is NULL on failure. */
int cs_model_load(const char *path, cs_model **out);

/* How weight matrices are held. EXACT: fp32 (quantized GGUF types
 * dequantized at load), what every backend and the reference forward run.
 * QUANT: the matrices stay at the file's bits (Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, Q4_K, Q5_K, Q6_K), repacked once for the CPU backend's integer
 * kernels (kernels/cpu/qmat.h), no fp32 copy; F16/BF16/F32 matrices are
 * quantized to Q8_0; norms and biases stay fp32. Only the CPU backend runs
 * it. AUTO: QUANT when every layer matrix of the file is in those blocks and
 * the backend registry will pick the CPU (cs_backend_will_use_cuda), else
 * EXACT. */
typedef enum { CS_WEIGHTS_AUTO = 0, CS_WEIGHTS_EXACT, CS_WEIGHTS_QUANT } cs_weight_mode;
/* cs_model_load (which is EXACT) with a mode; same errors, and CS_EINVAL for
 * QUANT when a matrix's inner size is not a multiple of 32. A block whose
 * fp16 scale is infinite or NaN is CS_EBADMSG naming the tensor (any mode). */
int cs_model_load_mode(const char *path, cs_weight_mode mode, cs_model **out);
/* The mode the model was loaded in: EXACT or QUANT (never AUTO). */
cs_weight_mode cs_model_weight_mode(const cs_model *m);
/* "exact" / "quant" (and "auto"). */
const char *cs_weight_mode_name(cs_weight_mode mode);
/* A short description of the weights: "fp32", "q4_1 (quantized kernels)" or
 * for a file that mixes types "q4_K+q6_K+q8_0 (quantized kernels)". */
const char *cs_model_weight_desc(const cs_model *m);
/* Loads only what serves requests without running the model: the
 * configuration, the tokenizer and the chat template (the router's needs).
 * Same formats and errors as cs_model_load; the configuration and tokenizer
 * equal a full load's. A GGUF file's tensor table is read and checked but no
 * weight is; a Hugging Face directory needs config.json and tokenizer.json
 * (its *.safetensors, when present, are checked but not read).
 * cs_model_weight_bytes is 0 and the model cannot be run (cs_engine_init,
 * cs_ref_seq_init need a full load). Free with cs_model_free(). */
int cs_model_load_vocab(const char *path, cs_model **out);
/* One tensor of a GGUF file as fp32, dequantized exactly as an EXACT load
 * does (bit for bit GGUF's reference dequantizers), for tools and tests:
 * *out (malloc'ed, the caller frees it) gets *n elements in the file's
 * order. CS_ENOENT when the file has no tensor of that name; the file's
 * errors as cs_model_load; CS_EBADMSG for a non-finite block scale. */
int cs_gguf_tensor_f32(const char *path, const char *name, float **out, int64_t *n);
void cs_model_free(cs_model *m); /* NULL is a no-op */

const cs_model_config *cs_model_get_config(const cs_model *m);
const cs_tokenizer *cs_model_tokenizer(const cs_model *m);
/* Bytes of weights held in memory, fp32 and packed (0 after cs_model_load_vocab). */
size_t cs_model_weight_bytes(const cs_model *m);

/* What a cluster compares to know that two processes serve the same model
 * (the router and its workers, a prefill and a decode worker). 64 bits of
 * XXH3 over the architecture and every hyperparameter, the tensor table
 * (each tensor's role, layer, type and shape), samples of every tensor's
 * bytes (16 windows of 64 bytes spread over the tensor, all of it when it is
 * smaller) and the tokenizer (cs_tokenizer_fingerprint). Not the file's name
 * or general.name. It tells apart another model, another fine-tune or seed,
 * another quantization or format of the same weights; it is not an integrity
 * check against a crafted file (verify the file's checksum for that).
 * A vocabulary-only load reads the same samples when the weights are there
 * (a GGUF file; a Hugging Face directory with its *.safetensors) and gives
 * the same value as a full load; without them it is 0 (unknown). */
uint64_t cs_model_fingerprint(const cs_model *m);

#ifdef __cplusplus
}
#endif
#endif
