/* chunkserve/stop.h: when a generated sequence ends, and which of its text
 * may be shown yet. Stop token ids, the model's end-of-generation tokens,
 * stop strings (never shown; text that could still become one is held back
 * until it cannot) and max_tokens, with vLLM's semantics. One per sequence;
 * not thread-safe per object. */
#ifndef CHUNKSERVE_STOP_H
#define CHUNKSERVE_STOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Why a sequence ended. The stop checker reports STOP and LENGTH; the
 * scheduler adds CANCELLED and ERROR. */
enum cs_finish {
    CS_FINISH_NONE = 0,
    CS_FINISH_STOP,
    CS_FINISH_LENGTH,
    CS_FINISH_CANCELLED,
    CS_FINISH_ERROR
};
/* "none", "stop", "length", "cancelled", "error" (logs; the doors use their
 * API's own names). */
const char *cs_finish_name(enum cs_finish f);

typedef struct {
    const char *const *stop; /* stop strings (UTF-8, non-empty) */
    size_t n_stop;
    const int32_t *stop_ids; /* extra stop token ids */
    size_t n_stop_ids;
    int32_t max_tokens; /* >= 1 */
    bool ignore_eos;    /* do not stop on the model's end-of-generation tokens */
    int32_t min_tokens; /* 0..max_tokens: no stop token before token min_tokens + 1 and
                           no stop string before token min_tokens (as vLLM); 0 = off */
    bool skip_special;  /* leave control tokens out of the text */
} cs_stop_params;

typedef struct cs_stop cs_stop;

/* Copies the params. CS_EINVAL for max_tokens < 1, min_tokens outside
 * [0, max_tokens], an empty or invalid UTF-8
 * stop string, more than 64 stop strings or ids, or strings over 256 bytes. */
int cs_stop_init(const cs_tokenizer *tok, const cs_stop_params *p, cs_stop **out);
void cs_stop_free(cs_stop *s); /* NULL is a no-op */

/* Feeds the next generated token. Appends to *text (malloc'd by the callee,
 * NUL-terminated, caller frees; may be empty) the text that is now final, and
 * returns the finish reason (CS_FINISH_NONE while the sequence goes on). When
 * it finishes, *text also holds everything held back that is not part of the
 * stop string. CS_EINVAL for a bad token id, CS_ENOMEM. */
int cs_stop_push(cs_stop *s, int32_t id, char **text, enum cs_finish *finish);

/* After CS_FINISH_STOP, what ended it (vLLM's stop_reason): the stop string
 * that matched (the earliest in the text, the first listed on a tie; NULL when
 * a token ended it), valid until cs_stop_free; and the stop_ids entry that
 * did (-1 when a stop string or the model's end-of-generation token did). */
const char *cs_stop_matched_string(const cs_stop *s);
int32_t cs_stop_matched_token(const cs_stop *s);

/* Tokens pushed so far. */
int32_t cs_stop_n_tokens(const cs_stop *s);

#ifdef __cplusplus
}
#endif
#endif
