/* stream.h (api/): a generation stream from the engine thread to the loop
 * thread, and how its call ends: the one request path of `chunkserve serve`
 * (server/server.c) and the decode worker (decode_worker/decode.c).
 *
 * The engine thread appends each event under the owner's lock
 * (cs_stream_event: the output buffer, the outcome, the token latencies);
 * the owner posts one drain to the loop thread for any number of events,
 * and the drain takes what is buffered at once (cs_stream_take), sends it
 * as one GenerateResponse
 * (cs_stream_response: the last one with finish reason and usage) and asks
 * cs_stream_outcome how the call ends: still streaming, OK, or a status
 * (out of memory, a reader that stopped reading, cancelled, failed), and
 * whether the request must also be cancelled in the engine. */
#ifndef CHUNKSERVE_API_STREAM_H
#define CHUNKSERVE_API_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/sched.h"
#include "engine_metrics.h"
#include "outbuf.h"

typedef struct {
    cs_outbuf out;
    bool done;             /* the final event arrived */
    enum cs_finish finish; /* its finish */
    int err_status;        /* its status (CS_FINISH_ERROR: why, e.g. CS_ENOSPC) */
    char error[256];       /* its message, "" */
    int32_t n_completion, n_cached;
    /* the token latencies (engine thread): observed into tok when set */
    const cs_token_metrics *tok;
    double t_start, t_last_token;
    double predicted_ttft; /* seconds, predicted at admission (0: none): in the usage, and
                              its error observed into tok at the first token */
} cs_stream;

/* Engine thread, the owner's lock held: ev's token, text, logprobs and
 * stop reason into the buffer, its outcome when final, ttft/itl. */
void cs_stream_event(cs_stream *s, const cs_event *ev);

/* Loop thread, the owner's lock held: moves the buffered output and the
 * outcome so far into *snap (free its output with cs_stream_free). */
void cs_stream_take(cs_stream *s, cs_stream *snap);
void cs_stream_free(cs_stream *s);

/* Whether snap has a message to send: output, or the end of a stream that
 * ended well (its finish reason and usage). */
bool cs_stream_has_message(const cs_stream *snap);

/* snap's GenerateResponse (cs_outbuf_response; with finish reason and usage
 * when the stream ended well). Free *scratch with cs_outbuf_response_free
 * after sending. CS_ENOMEM. */
int cs_stream_response(const cs_stream *snap, bool logprobs, int32_t n_prompt,
                       Chunkserve__V1__GenerateResponse *r, void **scratch);

/* How a drain's call ends. */
typedef struct {
    int code;       /* a CS_RPC_* status to answer with; -1: keep streaming */
    bool cancel;    /* also stop the request in the engine (it is still running) */
    char msg[400];  /* the status message ("" for OK) */
} cs_stream_end;

/* The outcome after a drain sent snap: send_rc is what sending returned (0;
 * CS_ENOMEM, also when snap's output overflowed), unsent the
 * bytes the reader has not taken (over CS_MAX_UNSENT_BYTES the request
 * stops), reader who reads ("the client", "the router"), end_code/end_msg
 * how a request the process cancelled itself ends (0/NULL: CANCELLED). */
void cs_stream_outcome(const cs_stream *snap, int send_rc, size_t unsent, const char *reader,
                       int end_code, const char *end_msg, cs_stream_end *out);

#endif
