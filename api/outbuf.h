/* outbuf.h: a stream's pending output between the engine thread and the
 * loop thread. The engine thread appends each event's token, logprob and text
 * (under the owner's lock); the loop thread's drain takes everything at once
 * and sends it as one GenerateResponse, so a slow loop merges steps instead
 * of queueing a message per token. Used by `chunkserve serve` and the decode
 * worker. Not thread-safe by itself: the owner holds its lock around append
 * and take. */
#ifndef CHUNKSERVE_API_OUTBUF_H
#define CHUNKSERVE_API_OUTBUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/sched.h"
#include "chunkserve/v1/generation.pb-c.h"

typedef struct {
    int32_t *toks;    /* (n) */
    cs_logprobs *lps; /* (n) */
    size_t n, cap;
    char *text; /* NUL-terminated, text_len bytes; NULL when none */
    size_t text_len, text_cap;
    bool oom;           /* a token or text could not be kept: end the stream */
    char *stop_string;  /* the final event's (cs_event), or NULL */
    int32_t stop_token; /* the final event's, with has_stop_token */
    bool has_stop_token;
    cs_prompt_logprob *plp; /* (n_plp) the first token's event's prompt logprobs, copied */
    int32_t n_plp;
} cs_outbuf;

/* Appends ev's token (if any), text and stop reason; sets oom instead of failing. */
void cs_outbuf_append(cs_outbuf *b, const cs_event *ev);
/* Moves everything buffered to *out (which the caller frees) and empties b. */
void cs_outbuf_take(cs_outbuf *b, cs_outbuf *out);
void cs_outbuf_free(cs_outbuf *b);
bool cs_outbuf_empty(const cs_outbuf *b);

/* Unsent bytes a stream may hold for a client that does not read before the
 * request is stopped (a few thousand messages of one token each): serve, the
 * decode worker and the router apply it. */
#define CS_MAX_UNSENT_BYTES ((size_t)4 << 20)

/* How a stream ended, for its last message: finish_reason and usage. */
typedef struct {
    enum cs_finish finish;
    int32_t n_prompt, n_completion, n_cached;
    double predicted_ttft; /* seconds, the door's prediction at admission (0: none) */
} cs_outbuf_end;

/* Builds the GenerateResponse of what b holds into *r (borrowing b's
 * arrays): tokens, text, the stop reason, logprobs with their alternatives when asked,
 * and with end (NULL: not the last message) the finish reason and usage
 * (allocated into *scratch: cs_outbuf_response_free after packing).
 * CS_ENOMEM. */
int cs_outbuf_response(const cs_outbuf *b, bool logprobs, const cs_outbuf_end *end,
                       Chunkserve__V1__GenerateResponse *r, void **scratch);
void cs_outbuf_response_free(void *scratch);

/* The messages of n prompt logprobs into *msgs (one allocation, *scratch:
 * free() it after packing). CS_ENOMEM. n = 0: *msgs NULL, nothing allocated. */
int cs_prompt_logprobs_msgs(const cs_prompt_logprob *p, int32_t n,
                            Chunkserve__V1__PromptLogprob ***msgs, void **scratch);

#endif
