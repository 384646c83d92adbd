/* chunkserve/refeval.h: single-sequence evaluation with the reference forward
 * pass: plain, readable fp32 loops over a contiguous per-sequence KV cache.
 * This is the specification the batched, paged and GPU paths are tested
 * against; it is not the serving path. */
#ifndef CHUNKSERVE_REFEVAL_H
#define CHUNKSERVE_REFEVAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_ref_seq cs_ref_seq;

/* A sequence of up to max_tokens positions (its KV cache is allocated now:
 * n_layers * max_tokens * n_kv_heads * head_dim * 2 floats). The model must
 * outlive it. CS_EINVAL when max_tokens is not in 1..ctx_len. */
int cs_ref_seq_init(const cs_model *m, int32_t max_tokens, cs_ref_seq **out);
void cs_ref_seq_free(cs_ref_seq *s); /* NULL is a no-op */
/* Tokens evaluated so far (the next token's position). */
int32_t cs_ref_seq_len(const cs_ref_seq *s);
/* Forgets all positions (keeps the allocation). */
void cs_ref_seq_reset(cs_ref_seq *s);

/* Evaluates n tokens at positions len .. len+n-1, appending them to the
 * cache. logits receives n * n_vocab floats (all_logits) or n_vocab floats for
 * the last token. CS_EINVAL for n < 1 or a token id out of range, CS_ENOSPC
 * when the sequence would exceed max_tokens; nothing changes on failure. */
int cs_ref_seq_eval(cs_ref_seq *s, const int32_t *tokens, int32_t n, bool all_logits,
                    float *logits);

#ifdef __cplusplus
}
#endif
#endif
