/* stream.c: a generation stream from the engine thread to the loop thread
 * and how its call ends (stream.h). */
#include "stream.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/rpc.h"

void cs_stream_event(cs_stream *s, const cs_event *ev) {
    if (ev->token >= 0) {
        if (s->tok) {
            double now = cs_now();
            if (s->t_last_token > 0)
                cs_metric_observe(s->tok->itl, now - s->t_last_token);
            else {
                double ttft = now - s->t_start;
                cs_metric_observe(s->tok->ttft, ttft);
                if (s->predicted_ttft > 0 && ttft > 0)
                    cs_metric_observe(s->tok->ttft_error, fabs(s->predicted_ttft - ttft) / ttft);
            }
            s->t_last_token = now;
        }
        /* a final event without a token (cancel, error) carries no counts */
        s->n_completion = ev->n_completion_tokens;
        s->n_cached = ev->n_cached_prompt_tokens;
    }
    cs_outbuf_append(&s->out, ev);
    if (ev->finish != CS_FINISH_NONE) {
        s->done = true;
        s->finish = ev->finish;
        s->err_status = ev->status;
        if (ev->error) snprintf(s->error, sizeof s->error, "%s", ev->error);
    }
}

void cs_stream_take(cs_stream *s, cs_stream *snap) {
    *snap = *s;
    cs_outbuf_take(&s->out, &snap->out);
}

void cs_stream_free(cs_stream *s) {
    cs_outbuf_free(&s->out);
}

static bool ended_well(const cs_stream *snap) {
    return snap->done && (snap->finish == CS_FINISH_STOP || snap->finish == CS_FINISH_LENGTH);
}

bool cs_stream_has_message(const cs_stream *snap) {
    return ended_well(snap) || !cs_outbuf_empty(&snap->out);
}

int cs_stream_response(const cs_stream *snap, bool logprobs, int32_t n_prompt,
                       Chunkserve__V1__GenerateResponse *r, void **scratch) {
    const cs_outbuf_end end = {snap->finish, n_prompt, snap->n_completion, snap->n_cached,
                               snap->predicted_ttft};
    return cs_outbuf_response(&snap->out, logprobs, ended_well(snap) ? &end : NULL, r, scratch);
}

void cs_stream_outcome(const cs_stream *snap, int send_rc, size_t unsent, const char *reader,
                       int end_code, const char *end_msg, cs_stream_end *out) {
    *out = (cs_stream_end){.code = -1};
    if (send_rc == CS_ENOMEM || snap->out.oom) {
        *out = (cs_stream_end){.code = CS_RPC_RESOURCE_EXHAUSTED, .cancel = !snap->done};
        snprintf(out->msg, sizeof out->msg, "out of memory for this stream");
    } else if (!snap->done && unsent > CS_MAX_UNSENT_BYTES) {
        /* the reader stopped reading: bound what waits for it */
        *out = (cs_stream_end){.code = CS_RPC_RESOURCE_EXHAUSTED, .cancel = true};
        snprintf(out->msg, sizeof out->msg, "%s is not reading its stream; generation stopped",
                 reader);
    } else if (ended_well(snap)) {
        out->code = CS_RPC_OK;
    } else if (snap->done && snap->finish == CS_FINISH_CANCELLED) {
        out->code = end_code ? end_code : CS_RPC_CANCELLED;
        snprintf(out->msg, sizeof out->msg, "%s", end_msg ? end_msg : "the request was cancelled");
    } else if (snap->done) {
        out->code = snap->err_status ? cs_rpc_code_of_status(snap->err_status) : CS_RPC_INTERNAL;
        snprintf(out->msg, sizeof out->msg, "generation failed: %s",
                 snap->error[0] ? snap->error : "engine error");
    }
}
