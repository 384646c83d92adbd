/* model-impl.h: the in-memory model (one representation whatever the file
 * format) and the loader plumbing shared by model_gguf.c and model_hf.c.
 *
 * Conventions: weights are fp32, row-major, PyTorch [out, in] order. q and k
 * projection rows are in Hugging Face order, i.e. RoPE rotates dimension i
 * with i + head_dim/2 ("rotate_half"/NeoX style): GGUF llama files, whose
 * converter interleaved those rows, are un-permuted at load. */
#ifndef CS_MODEL_IMPL_H
#define CS_MODEL_IMPL_H

#include "chunkserve/backend.h"
#include "chunkserve/model.h"
#include "dtype.h"

typedef struct {
    int32_t window;             /* cs_model_layer_window */
    const float *rope_inv_freq; /* (head_dim / 2): the model's, or its windowed layers' */
    float *q_norm;              /* (head_dim) or NULL */
    float *k_norm;              /* (head_dim) or NULL */
    float *post_attn_norm;      /* (dim) or NULL */
    float *post_ffn_norm;       /* (dim) or NULL */
    float *attn_norm;           /* (dim) */
    float *wq;                  /* (n_heads * head_dim, dim) */
    float *wk;                  /* (n_kv_heads * head_dim, dim) */
    float *wv;                  /* (n_kv_heads * head_dim, dim) */
    float *bq;                  /* (n_heads * head_dim) or NULL */
    float *bk;                  /* (n_kv_heads * head_dim) or NULL */
    float *bv;                  /* (n_kv_heads * head_dim) or NULL */
    float *wo;                  /* (dim, n_heads * head_dim) */
    float *ffn_norm;            /* (dim) */
    float *w_gate;              /* (hidden_dim, dim) */
    float *w_up;                /* (hidden_dim, dim) */
    float *w_down;              /* (dim, hidden_dim) */
    /* QUANT mode: the matrices above are NULL and live here (backend.h) */
    cs_qmat *q_qkv;     /* parts wq, wk, wv */
    cs_qmat *q_o;       /* wo */
    cs_qmat *q_gate_up; /* parts w_gate, w_up */
    cs_qmat *q_down;    /* w_down */
} cs_layer;

struct cs_model {
    cs_model_config cfg;
    float *tok_embd;          /* (n_vocab, dim) */
    float *out_norm;          /* (dim) */
    float *output;            /* (n_vocab, dim); == tok_embd when tied */
    float *rope_inv_freq;     /* (head_dim / 2) angle per position, scaling applied */
    float *rope_inv_freq_swa; /* (head_dim / 2) the windowed layers' (rope_theta_swa), or NULL */
    cs_layer *layers;         /* (n_layers) */
    cs_weight_mode mode;      /* EXACT or QUANT; set before cs__model_build (AUTO resolved there) */
    cs_qmat *q_tok_embd;      /* QUANT: tok_embd (NULL then) */
    cs_qmat *q_output;        /* QUANT: output; == q_tok_embd when tied */
    char weight_desc[96];
    float *weights;   /* one allocation all the above point into */
    size_t n_weights; /* floats in weights */
    size_t q_bytes;   /* bytes of the packed matrices */
    cs_tokenizer *tok;
    uint64_t fp_tensors;  /* the tensor table and samples of the bytes (cs__model_build) */
    bool fp_has_tensors;  /* whether the load saw the tensors (not a directory without weights) */
    uint64_t fingerprint; /* cs_model_fingerprint, 0 = unknown */
};

/* A tensor as a format reader sees it; shape outermost first (PyTorch order). */
typedef struct {
    enum cs_dtype type;
    int n_dims;
    int64_t shape[4];
    const void *data; /* inside the file's read-only mapping (cs__mapped_release) */
} cs_src_tensor;

/* Format-neutral access to a file's tensors. find returns 0, or CS_ENOENT
 * when the tensor does not exist. */
typedef struct {
    int (*find)(void *ctx, const char *name, cs_src_tensor *out);
    void *ctx;
    bool gguf_names;   /* blk.N.attn_q.weight vs model.layers.N.self_attn.q_proj.weight */
    bool unpermute_qk; /* GGUF llama: q/k rows interleaved for ggml's RoPE */
    const float *rope_freq_factors; /* GGUF rope_freqs.weight (head_dim/2) or NULL */
    bool shapes_only;               /* vocab-only load: check names and shapes, read no weights */
} cs_tensor_source;

/* Validates cfg, then allocates and fills m's weights from src. m->cfg must
 * be filled (tied_embeddings is decided here from what src holds when
 * cfg.tied_embeddings is false but no output tensor exists). With
 * src->shapes_only every tensor is still found and its shape checked (so the
 * configuration comes out as a full load's), but nothing is allocated or
 * read. src NULL: only the configuration is checked (a Hugging Face
 * directory without weights). */
int cs__model_build(cs_model *m, const cs_tensor_source *src, const char *path);

/* The kernels' view of m's weights (kernels/backend.h): w->layers points at
 * layers, an array of n_layers the caller provides; both borrow m's memory. */
void cs__model_weights(const cs_model *m, cs_weights *w, cs_layer_weights *layers);

/* vocab_only: configuration and tokenizer, no weights (cs_model_load_vocab). */
int cs__model_load_gguf(const char *path, cs_model *m, bool vocab_only);
int cs__model_load_hf(const char *dir, cs_model *m, bool vocab_only);
int cs__tokenizer_load_gguf(const char *path, cs_tokenizer **out);
int cs__tokenizer_load_hf(const char *dir, cs_tokenizer **out);

#endif
