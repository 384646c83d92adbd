/* openai.c: the OpenAI-compatible routes (openai.h) on the project's HTTP
 * server (chunkserve/http.h).
 *
 * One HTTP request (struct oa_call) runs one Generate call per choice
 * (struct oa_choice, a cs_gen_call: api/gen_call.h) through the process's
 * own generate function. Each choice's messages are written as SSE events
 * as they come (stream) or gathered into one JSON object (not stream). The
 * request ends when every choice has ended: a choice that fails cancels the
 * others and the answer is the failure (an HTTP status before the first
 * byte of a stream; an error event then [DONE] after it). A connection that
 * closes cancels every choice still running. Loop thread only; re-entrancy
 * (generate or a cancel answering at once) is held off by oc->busy. */
#include "openai.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "chunkserve/error.h"
#include "chunkserve/http.h"
#include "chunkserve/log.h"
#include "chunkserve/tokenizer.h"
#include "openai-impl.h"
#include "tenant_config.h"

#define DEFAULT_MAX_REQUEST ((size_t)4 << 20)

typedef struct oa_call oa_call;

struct cs_openai {
    cs_openai_opts o;
    cs_http_server *http;
    int32_t n_open;
    uint64_t next_id;
    long long started; /* the Unix time the API started: /v1/models' created */
    bool closed;       /* freed when the last open request ends */
    /* Calls whose later choices are due to start (see start_later), started
     * from the loop's check phase, outside any Generate callback. */
    uv_check_t kick;
    oa_call *kicks;
};

typedef struct {
    cs_gen_call base; /* what Generate sees */
    oa_call *oc;
    int32_t index;
    cs_gen_cancel_fn cancel_fn;
    void *cancel_arg;
    bool started, finished, role_sent, echoed, lp_echoed;
    bool due; /* not started; its prompt's first choice has answered: start it */
    /* gathered (not stream), and the end */
    char *text;
    size_t len, cap;
    int32_t *lp_ids;
    cs_logprobs *lp;
    size_t n_lp, cap_lp;
    Chunkserve__V1__FinishReason finish;
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    char *stop_string;  /* vLLM's stop_reason: the stop string, or */
    int32_t stop_token; /* the stop token id (-1: none) */
    int32_t n_streamed; /* tokens streamed so far (continuous usage) */
    size_t shown;       /* read for tool calls, streamed: the bytes of text shown as content */
    size_t lp_offset;   /* streamed logprobs: the tokens' text so far (the next text_offset) */
} oa_choice;

/* A prompt's logprobs (prompt_logprobs, completions' echo with logprobs),
 * from its first choice's first message. */
typedef struct {
    int32_t first;        /* the prompt's first token (it has no logprob); echo only */
    cs_prompt_logprob *e; /* (n) tokens 1.. of the prompt */
    int32_t n;
} oa_prompt_lp;

struct oa_call {
    cs_openai *s;
    cs_http_res *res;
    oa_request rq;
    oa_choice *choices;
    int32_t n_done, busy;
    bool sse_started, failed, closed, ended;
    bool kicked; /* on s->kicks (holds busy) */
    oa_call *kick_next;
    oa_error err;
    char id[160];
    long long created;
    char **echo;       /* echo: per prompt, the text the answer starts with */
    int32_t *n_prompt; /* continuous usage: per prompt, its tokens (as Generate counts them) */
    oa_prompt_lp *plp; /* per prompt, when its logprobs were asked */
    size_t last_event; /* bytes of the last SSE event written */
    size_t burst;      /* bytes of streamed echo-logprob chunks: written at once by the
                          server, not a slow reader's backlog (c_pending_bytes) */
    char cors[512];    /* Access-Control-* lines for this origin, or "" */
};

/* ------------------------------------------------------------ writing -- */

static void send_json(cs_http_res *res, int status, const char *cors, const char *extra,
                      const char *json) {
    char headers[1024];
    snprintf(headers, sizeof headers, "%s%s", cors ? cors : "", extra ? extra : "");
    cs_http_res_send(res, status, "application/json", headers, json, strlen(json));
}

static void send_error(cs_http_res *res, const char *cors, const oa_error *e) {
    char *body = oa_error_json(e);
    char retry[40];
    snprintf(retry, sizeof retry, "Retry-After: %lld\r\n",
             (long long)(e->retry_after_s > 0 ? e->retry_after_s : 1));
    const char *extra = e->status == 429 || e->status == 503 ? retry
                        : e->status == 401                   ? "WWW-Authenticate: Bearer\r\n"
                                                             : NULL;
    send_json(res, e->status, cors, extra,
              body ? body
                   : "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}");
    free(body);
}

/* One SSE event "data: <json>\n\n"; 0 or the write's error. */
static int sse_event(oa_call *oc, cJSON *j) {
    char *s = j ? cJSON_PrintUnformatted(j) : NULL;
    if (!s) return CS_ENOMEM;
    size_t n = strlen(s);
    char *ev = malloc(n + 8);
    int r = CS_ENOMEM;
    if (ev) {
        memcpy(ev, "data: ", 6);
        memcpy(ev + 6, s, n);
        memcpy(ev + 6 + n, "\n\n", 2);
        r = cs_http_res_write(oc->res, ev, n + 8);
        oc->last_event = n + 8;
        free(ev);
    }
    free(s);
    return r;
}

static int sse_start(oa_call *oc) {
    if (oc->sse_started) return 0;
    oc->sse_started = true;
    char headers[1024];
    snprintf(headers, sizeof headers, "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n%s",
             oc->cors);
    return cs_http_res_start(oc->res, 200, "text/event-stream", headers);
}

static const char *finish_name(Chunkserve__V1__FinishReason f) {
    switch (f) {
    case CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    default: return NULL;
    }
}

/* A chunk's or answer's frame: id, object, created, model, choices[]. */
static cJSON *frame(oa_call *oc, const char *object, cJSON **choices) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", oc->id);
    cJSON_AddStringToObject(j, "object", object);
    cJSON_AddNumberToObject(j, "created", (double)oc->created);
    cJSON_AddStringToObject(j, "model", oc->s->o.wm->name);
    *choices = cJSON_AddArrayToObject(j, "choices");
    return j;
}

/* The token's text (U+FFFD for bytes that are not UTF-8 by themselves), or
 * "token_id:N" when the request asked for return_tokens_as_token_ids. */
static char *decoded(oa_call *oc, int32_t id) {
    char *t = NULL;
    size_t n;
    if (cs_tokenizer_decode(cs_model_tokenizer(oc->s->o.wm->model), &id, 1, false, &t, &n) != 0)
        return NULL;
    return t;
}

static char *token_text(oa_call *oc, int32_t id) {
    char *t = NULL;
    if (oc->rq.tokens_as_ids) {
        if ((t = malloc(24))) snprintf(t, 24, "token_id:%d", id);
        return t;
    }
    return decoded(oc, id);
}

/* A chat logprob entry: {token, logprob, bytes}. */
static cJSON *token_entry(oa_call *oc, int32_t id, float logprob) {
    const cs_tokenizer *tok = cs_model_tokenizer(oc->s->o.wm->model);
    cJSON *e = cJSON_CreateObject();
    char *t = token_text(oc, id);
    cJSON_AddStringToObject(e, "token", t ? t : "");
    free(t);
    cJSON_AddNumberToObject(e, "logprob", logprob);
    const char *b;
    size_t bl;
    cJSON *bytes = cJSON_AddArrayToObject(e, "bytes");
    if (cs_tokenizer_token_bytes(tok, id, &b, &bl) == 0)
        for (size_t k = 0; k < bl; k++)
            cJSON_AddItemToArray(bytes, cJSON_CreateNumber((unsigned char)b[k]));
    return e;
}

/* {text: logprob} of the first k alternatives of lp (tokens with the same
 * text: the likelier stays). */
static cJSON *top_dict(oa_call *oc, const cs_logprobs *lp, int32_t k) {
    cJSON *d = cJSON_CreateObject();
    for (int32_t i = 0; i < lp->n_top && i < k; i++) {
        char *a = token_text(oc, lp->top_ids[i]);
        if (a && !cJSON_GetObjectItemCaseSensitive(d, a))
            cJSON_AddNumberToObject(d, a, lp->top_logprobs[i]);
        free(a);
    }
    return d;
}

/* One row of completions' logprobs: the token's text and offset, its
 * logprob (null: the prompt's first token) and its alternatives' dict. */
static void completion_row(oa_call *oc, cJSON *j, int32_t id, const cs_logprobs *lp,
                           size_t *text_offset) {
    char *t = token_text(oc, id);
    cJSON_AddItemToArray(cJSON_GetObjectItem(j, "tokens"), cJSON_CreateString(t ? t : ""));
    cJSON_AddItemToArray(cJSON_GetObjectItem(j, "token_logprobs"),
                         lp ? cJSON_CreateNumber(lp->logprob) : cJSON_CreateNull());
    cJSON_AddItemToArray(cJSON_GetObjectItem(j, "text_offset"),
                         cJSON_CreateNumber((double)*text_offset));
    *text_offset += t ? strlen(t) : 0;
    free(t);
    cJSON *tops = cJSON_GetObjectItem(j, "top_logprobs");
    if (cJSON_IsArray(tops))
        cJSON_AddItemToArray(tops, lp ? top_dict(oc, lp, oc->rq.top_logprobs) : cJSON_CreateNull());
}

/* logprobs for ids[0..n): chat {"content":[{token,logprob,bytes,top_logprobs}]},
 * completions {tokens, token_logprobs, top_logprobs ([{text: logprob}] when
 * alternatives were asked, else null), text_offset (from *text_offset, the
 * tokens' texts before these; advanced)}, after the prompt's rows when echo
 * is not NULL (completions' echo with logprobs). */
static cJSON *logprobs_json(oa_call *oc, const int32_t *ids, const cs_logprobs *lp, size_t n,
                            size_t *text_offset, const oa_prompt_lp *echo) {
    cJSON *j = cJSON_CreateObject();
    if (oc->rq.chat) {
        cJSON *content = cJSON_AddArrayToObject(j, "content");
        for (size_t i = 0; i < n; i++) {
            cJSON *e = token_entry(oc, ids[i], lp[i].logprob);
            cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
            for (int32_t k = 0; k < lp[i].n_top; k++)
                cJSON_AddItemToArray(top, token_entry(oc, lp[i].top_ids[k], lp[i].top_logprobs[k]));
            cJSON_AddItemToArray(content, e);
        }
    } else {
        cJSON_AddArrayToObject(j, "tokens");
        cJSON_AddArrayToObject(j, "token_logprobs");
        if (oc->rq.top_logprobs > 0)
            cJSON_AddArrayToObject(j, "top_logprobs");
        else
            cJSON_AddNullToObject(j, "top_logprobs");
        cJSON_AddArrayToObject(j, "text_offset");
        if (echo) {
            completion_row(oc, j, echo->first, NULL, text_offset);
            for (int32_t i = 0; i < echo->n; i++)
                completion_row(oc, j, echo->e[i].token, &echo->e[i].lp, text_offset);
        }
        for (size_t i = 0; i < n; i++)
            completion_row(oc, j, ids[i], &lp[i], text_offset);
    }
    return j;
}

/* vLLM's prompt_logprobs: [null, {"<id>": {logprob, rank, decoded_token}}, ...]:
 * each prompt token after the first, then its first k alternatives (ranked
 * 1..k, as vLLM ranks them). */
static cJSON *prompt_logprobs_json(oa_call *oc, const oa_prompt_lp *pl, int32_t k) {
    cJSON *a = cJSON_CreateArray();
    cJSON_AddItemToArray(a, cJSON_CreateNull());
    for (int32_t i = 0; pl && i < pl->n; i++) {
        const cs_prompt_logprob *p = &pl->e[i];
        cJSON *d = cJSON_CreateObject();
        for (int32_t j = -1; j < p->lp.n_top && j < k; j++) {
            int32_t id = j < 0 ? p->token : p->lp.top_ids[j];
            char key[16];
            snprintf(key, sizeof key, "%d", id);
            if (j >= 0 && cJSON_GetObjectItemCaseSensitive(d, key)) continue;
            cJSON *v = cJSON_AddObjectToObject(d, key);
            cJSON_AddNumberToObject(v, "logprob", j < 0 ? p->lp.logprob : p->lp.top_logprobs[j]);
            cJSON_AddNumberToObject(v, "rank", j < 0 ? p->rank : j + 1);
            char *t = decoded(oc, id); /* vLLM: the text, whatever return_tokens_as_token_ids */
            cJSON_AddStringToObject(v, "decoded_token", t ? t : "");
            free(t);
        }
        cJSON_AddItemToArray(a, d);
    }
    return a;
}

/* A prompt's logprobs from the message that brought them (copied). */
static int take_prompt_logprobs(oa_prompt_lp *pl, const Chunkserve__V1__GenerateResponse *m) {
    if (pl->e || !m->n_prompt_logprobs) return 0;
    if (!(pl->e = calloc(m->n_prompt_logprobs, sizeof *pl->e))) return CS_ENOMEM;
    for (size_t i = 0; i < m->n_prompt_logprobs; i++) {
        const Chunkserve__V1__PromptLogprob *t = m->prompt_logprobs[i];
        cs_prompt_logprob *p = &pl->e[i];
        p->token = t->token_id;
        p->rank = t->rank;
        p->lp.logprob = t->logprob;
        for (size_t k = 0; k < t->n_top_logprobs && k < CS_MAX_TOP_LOGPROBS; k++) {
            p->lp.top_ids[k] = t->top_logprobs[k]->token_id;
            p->lp.top_logprobs[k] = t->top_logprobs[k]->logprob;
            p->lp.n_top++;
        }
    }
    pl->n = (int32_t)m->n_prompt_logprobs;
    return 0;
}

/* The logprobs of m's tokens, alternatives included (at most
 * CS_MAX_TOP_LOGPROBS kept), into ids[i] and lp[i]. */
static void take_logprobs(const Chunkserve__V1__GenerateResponse *m, int32_t *ids,
                          cs_logprobs *lp) {
    for (size_t i = 0; i < m->n_logprobs; i++) {
        const Chunkserve__V1__TokenLogprob *t = m->logprobs[i];
        ids[i] = t->token_id;
        lp[i] = (cs_logprobs){.logprob = t->logprob};
        for (size_t k = 0; k < t->n_top_logprobs && k < CS_MAX_TOP_LOGPROBS; k++) {
            lp[i].top_ids[k] = t->top_logprobs[k]->token_id;
            lp[i].top_logprobs[k] = t->top_logprobs[k]->logprob;
            lp[i].n_top++;
        }
    }
}

/* The usage object over every choice (a prompt counted once, not n times). */
static cJSON *usage_json(oa_call *oc) {
    int64_t prompt = 0, completion = 0, cached = 0;
    for (int32_t i = 0; i < oc->rq.n_choices; i++) {
        oa_choice *c = &oc->choices[i];
        completion += c->completion_tokens;
        if (i % oc->rq.n == 0) prompt += c->prompt_tokens, cached += c->cached_tokens;
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", (double)completion);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(prompt + completion));
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", (double)cached);
    return u;
}

/* vLLM's stop_reason: the stop string or stop token id that ended the choice,
 * null when the end-of-generation token or the length did. */
static void add_stop_reason(cJSON *ch, const oa_choice *c) {
    if (c->stop_string)
        cJSON_AddStringToObject(ch, "stop_reason", c->stop_string);
    else if (c->stop_token >= 0)
        cJSON_AddNumberToObject(ch, "stop_reason", c->stop_token);
    else
        cJSON_AddNullToObject(ch, "stop_reason");
}

/* One streamed chunk for choice c: delta text (chat) or text, its logprobs,
 * and the finish reason (with the stop reason) when final. */
static int stream_chunk(oa_call *oc, oa_choice *c, const char *text, cJSON *lp,
                        const char *finish) {
    cJSON *choices,
        *j = frame(oc, oc->rq.chat ? "chat.completion.chunk" : "text_completion", &choices);
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
    if (oc->rq.chat) {
        cJSON *delta = cJSON_AddObjectToObject(ch, "delta");
        if (!c->role_sent) cJSON_AddStringToObject(delta, "role", "assistant");
        if (text) cJSON_AddStringToObject(delta, "content", text);
        c->role_sent = true;
    } else {
        cJSON_AddStringToObject(ch, "text", text ? text : "");
    }
    if (lp)
        cJSON_AddItemToObject(ch, "logprobs", lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    if (finish) {
        cJSON_AddStringToObject(ch, "finish_reason", finish);
        add_stop_reason(ch, c);
    } else {
        cJSON_AddNullToObject(ch, "finish_reason");
    }
    cJSON_AddItemToArray(choices, ch);
    if (oc->rq.continuous_usage) { /* vLLM's: this choice's counts so far */
        int32_t p = oc->n_prompt[c->index / oc->rq.n];
        cJSON *u = cJSON_AddObjectToObject(j, "usage");
        cJSON_AddNumberToObject(u, "prompt_tokens", p);
        cJSON_AddNumberToObject(u, "completion_tokens", c->n_streamed);
        cJSON_AddNumberToObject(u, "total_tokens", p + c->n_streamed);
    } else if (oc->rq.include_usage) {
        cJSON_AddNullToObject(j, "usage");
    }
    int r = sse_event(oc, j);
    cJSON_Delete(j);
    return r;
}

/* ------------------------------------------------------------ the end -- */

static void complete(oa_call *oc);

static void on_kick_closed(uv_handle_t *h) {
    free(h->data);
}

static void server_free(cs_openai *s) {
    uv_close((uv_handle_t *)&s->kick, on_kick_closed);
}

static void oa_call_free(oa_call *oc) {
    for (int32_t i = 0; oc->choices && i < oc->rq.n_choices; i++) {
        free(oc->choices[i].text);
        free(oc->choices[i].lp_ids);
        free(oc->choices[i].lp);
        free(oc->choices[i].stop_string);
    }
    free(oc->choices);
    for (int32_t p = 0; oc->echo && p < oc->rq.n_prompts; p++)
        free(oc->echo[p]);
    free(oc->echo);
    free(oc->n_prompt);
    for (int32_t p = 0; oc->plp && p < oc->rq.n_prompts; p++)
        free(oc->plp[p].e);
    free(oc->plp);
    oa_request_free(&oc->rq);
    cs_openai *s = oc->s;
    free(oc);
    if (--s->n_open == 0 && s->closed) server_free(s);
}

/* Every choice ended: the answer, then the response ends. */
static void complete(oa_call *oc) {
    if (oc->busy || oc->n_done < oc->rq.n_choices || oc->ended) return;
    oc->ended = true;
    if (oc->closed) {
        /* nobody to answer */
    } else if (oc->failed && oc->sse_started) {
        char *e = oa_error_json(&oc->err);
        if (e) {
            char *ev = malloc(strlen(e) + 32);
            if (ev) {
                int n = sprintf(ev, "data: %s\n\n", e);
                cs_http_res_write(oc->res, ev, (size_t)n);
                free(ev);
            }
            free(e);
        }
        cs_http_res_write(oc->res, "data: [DONE]\n\n", 14);
    } else if (oc->failed) {
        send_error(oc->res, oc->cors, &oc->err);
    } else if (oc->rq.stream) {
        if (oc->rq.include_usage) {
            cJSON *choices,
                *j = frame(oc, oc->rq.chat ? "chat.completion.chunk" : "text_completion", &choices);
            cJSON_AddItemToObject(j, "usage", usage_json(oc));
            sse_event(oc, j);
            cJSON_Delete(j);
        }
        cs_http_res_write(oc->res, "data: [DONE]\n\n", 14);
    } else {
        cJSON *choices,
            *j = frame(oc, oc->rq.chat ? "chat.completion" : "text_completion", &choices);
        for (int32_t i = 0; i < oc->rq.n_choices; i++) {
            oa_choice *c = &oc->choices[i];
            cJSON *ch = cJSON_CreateObject();
            cJSON_AddNumberToObject(ch, "index", i);
            const char *f = finish_name(c->finish);
            if (oc->rq.chat) {
                cJSON *m = cJSON_AddObjectToObject(ch, "message");
                cJSON_AddStringToObject(m, "role", "assistant");
                size_t cl = 0;
                cJSON *calls = oc->rq.tool_mode != OA_TOOLS_OFF
                                   ? oa_tool_calls(&oc->rq, c->text ? c->text : "", &cl)
                                   : NULL;
                if (!calls) {
                    cJSON_AddStringToObject(m, "content", c->text ? c->text : "");
                } else {
                    if (cl) c->text[cl] = 0;
                    if (cl)
                        cJSON_AddStringToObject(m, "content", c->text);
                    else
                        cJSON_AddNullToObject(m, "content");
                    cJSON_AddItemToObject(m, "tool_calls", calls);
                    if (oc->rq.tool_mode != OA_TOOLS_NAMED) f = "tool_calls";
                }
            } else {
                cJSON_AddStringToObject(ch, "text", c->text ? c->text : "");
            }
            const oa_prompt_lp *pl = oc->plp ? &oc->plp[i / oc->rq.n] : NULL;
            if (oc->rq.logprobs)
                cJSON_AddItemToObject(ch, "logprobs",
                                      logprobs_json(oc, c->lp_ids, c->lp, c->n_lp, &(size_t){0},
                                                    oc->rq.echo_logprobs ? pl : NULL));
            else
                cJSON_AddNullToObject(ch, "logprobs");
            if (!oc->rq.chat && oc->rq.prompt_logprobs >= 0)
                cJSON_AddItemToObject(ch, "prompt_logprobs",
                                      prompt_logprobs_json(oc, pl, oc->rq.prompt_logprobs));
            cJSON_AddStringToObject(ch, "finish_reason", f ? f : "stop");
            add_stop_reason(ch, c);
            cJSON_AddItemToArray(choices, ch);
        }
        if (oc->rq.chat && oc->rq.prompt_logprobs >= 0) /* vLLM: beside the choices */
            cJSON_AddItemToObject(j, "prompt_logprobs",
                                  prompt_logprobs_json(oc, oc->plp, oc->rq.prompt_logprobs));
        cJSON_AddItemToObject(j, "usage", usage_json(oc));
        char *s = cJSON_PrintUnformatted(j);
        cJSON_Delete(j);
        if (s)
            send_json(oc->res, 200, oc->cors, NULL, s);
        else
            send_error(
                oc->res, oc->cors,
                &(oa_error){.status = 500, .type = "server_error", .message = "out of memory"});
        free(s);
    }
    cs_http_res_end(oc->res);
    oc->res = NULL;
    oa_call_free(oc);
}

/* Cancels every choice still running (they then finish CANCELLED). */
static void cancel_choices(oa_call *oc) {
    oc->busy++;
    for (int32_t i = 0; i < oc->rq.n_choices; i++) {
        oa_choice *c = &oc->choices[i];
        if (c->started && !c->finished && c->cancel_fn) {
            cs_gen_cancel_fn fn = c->cancel_fn;
            c->cancel_fn = NULL;
            fn(&c->base, c->cancel_arg);
        }
    }
    oc->busy--;
}

/* ------------------------------------------- cs_gen_call for a choice -- */

/* n > 1: a prompt's first choice runs alone until its first message (its
 * prompt's pages are then in the prefix cache) or its end; then the other
 * n - 1 start and reuse those pages instead of computing the prompt again.
 * They start from the loop's check phase, never inside the Generate callback
 * that got here. */
static void on_kick(uv_check_t *h);

static void start_later(oa_call *oc, oa_choice *first) {
    int32_t n = oc->rq.n;
    if (n <= 1 || first->index % n != 0 || oc->choices[first->index + 1].due ||
        oc->choices[first->index + 1].started)
        return;
    for (int32_t i = first->index + 1; i < first->index + n; i++)
        oc->choices[i].due = true;
    if (!oc->kicked) {
        cs_openai *s = oc->s;
        oc->kicked = true;
        oc->busy++;
        oc->kick_next = s->kicks, s->kicks = oc;
        uv_check_start(&s->kick, on_kick);
    }
}

static void start_choice(oa_call *oc, oa_choice *c) {
    if (oc->failed || oc->closed) { /* an earlier choice already decided the answer */
        c->finished = true;
        oc->n_done++;
        return;
    }
    c->started = true;
    oc->s->o.generate(oc->s->o.arg, &c->base);
}

static void on_kick(uv_check_t *h) {
    cs_openai *s = h->data;
    while (s->kicks) {
        oa_call *oc = s->kicks;
        s->kicks = oc->kick_next;
        oc->kicked = false;
        for (int32_t i = 0; i < oc->rq.n_choices; i++) {
            oa_choice *c = &oc->choices[i];
            if (c->due) c->due = false, start_choice(oc, c);
        }
        oc->busy--;
        complete(oc);
    }
    uv_check_stop(&s->kick);
}

static int send_text(oa_call *oc, oa_choice *c, const Chunkserve__V1__GenerateResponse *m,
                     const char *text);

static int c_send(cs_gen_call *g, const Chunkserve__V1__GenerateResponse *m) {
    oa_choice *c = (oa_choice *)g;
    oa_call *oc = c->oc;
    if (oc->closed) return CS_ECANCELED;
    start_later(oc, c); /* its prompt is in the prefix cache now */
    if (m->usage) {
        c->prompt_tokens = m->usage->prompt_tokens;
        c->completion_tokens = m->usage->completion_tokens;
        c->cached_tokens = m->usage->cached_prompt_tokens;
    }
    if (m->finish_reason) c->finish = m->finish_reason;
    if (m->stop_reason_case == CHUNKSERVE__V1__GENERATE_RESPONSE__STOP_REASON_STOP_STRING &&
        !c->stop_string && !(c->stop_string = strdup(m->stop_string)))
        return CS_ENOMEM;
    if (m->stop_reason_case == CHUNKSERVE__V1__GENERATE_RESPONSE__STOP_REASON_STOP_TOKEN_ID)
        c->stop_token = m->stop_token_id;
    if (oc->plp && c->index % oc->rq.n == 0 &&
        take_prompt_logprobs(&oc->plp[c->index / oc->rq.n], m))
        return CS_ENOMEM;
    /* echo: the prompt's text goes first, with the first message */
    const char *text = m->text ? m->text : "";
    char *joined = NULL;
    if (oc->echo && !c->echoed) {
        c->echoed = true;
        const char *e = oc->echo[c->index / oc->rq.n];
        if (e && *e) {
            if (!(joined = malloc(strlen(e) + strlen(text) + 1))) return CS_ENOMEM;
            text = strcat(strcpy(joined, e), text);
        }
    }
    int r = send_text(oc, c, m, text);
    free(joined);
    return r;
}

/* A streamed chunk with the tool calls (each given its index). */
static int stream_tool_calls(oa_call *oc, oa_choice *c, cJSON *calls) {
    cJSON *choices, *j = frame(oc, "chat.completion.chunk", &choices);
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
    cJSON *delta = cJSON_AddObjectToObject(ch, "delta");
    if (!c->role_sent) cJSON_AddStringToObject(delta, "role", "assistant");
    c->role_sent = true;
    int k = 0;
    for (cJSON *t = calls->child; t; t = t->next)
        cJSON_AddItemToObject(t, "index", cJSON_CreateNumber(k++));
    cJSON_AddItemToObject(delta, "tool_calls", calls);
    cJSON_AddNullToObject(ch, "logprobs");
    cJSON_AddNullToObject(ch, "finish_reason");
    cJSON_AddItemToArray(choices, ch);
    if (oc->rq.include_usage) cJSON_AddNullToObject(j, "usage");
    int r = sse_event(oc, j);
    cJSON_Delete(j);
    return r;
}

/* Streams the content of c->text from c->shown up to `upto`. */
static int stream_content(oa_call *oc, oa_choice *c, size_t upto) {
    if (upto <= c->shown) return 0;
    char save = c->text[upto];
    c->text[upto] = 0;
    int r = stream_chunk(oc, c, c->text + c->shown, NULL, NULL);
    c->text[upto] = save;
    c->shown = upto;
    return r;
}

/* Streaming an answer read for tool calls: the text is gathered; content
 * is shown up to where a call may begin (auto) and the calls go in one
 * chunk at the end, before the finish reason. */
static int send_tool_text(oa_call *oc, oa_choice *c, const Chunkserve__V1__GenerateResponse *m) {
    int r = sse_start(oc);
    c->n_streamed += (int32_t)m->n_token_ids;
    const char *fin = finish_name(m->finish_reason);
    bool in_call = false;
    size_t show =
        oc->rq.tool_mode == OA_TOOLS_AUTO ? oa_tool_visible(c->text, c->len, &in_call) : 0;
    if (!r && fin) {
        size_t cl;
        cJSON *calls = oa_tool_calls(&oc->rq, c->text ? c->text : "", &cl);
        if (calls && oc->rq.tool_mode != OA_TOOLS_NAMED) fin = "tool_calls";
        r = stream_content(oc, c, calls ? cl : c->len);
        if (!r && calls) r = stream_tool_calls(oc, c, calls), calls = NULL;
        cJSON_Delete(calls);
        if (!r && !c->role_sent) r = stream_chunk(oc, c, "", NULL, NULL);
        if (!r) r = stream_chunk(oc, c, NULL, NULL, fin);
    } else if (!r) {
        r = show > c->shown ? stream_content(oc, c, show)
            : !c->role_sent ? stream_chunk(oc, c, "", NULL, NULL)
                            : 0;
    }
    return r ? CS_ECANCELED : 0;
}

/* c_send's work on one message whose text (echo included) is text. */
static int send_text(oa_call *oc, oa_choice *c, const Chunkserve__V1__GenerateResponse *m,
                     const char *text) {
    size_t tl = strlen(text);
    bool tools = oc->rq.chat && oc->rq.tool_mode != OA_TOOLS_OFF;
    if (!oc->rq.stream || tools) { /* gather */
        if (c->len + tl + 1 > c->cap) {
            size_t cap = (c->len + tl + 1) * 2;
            char *t = realloc(c->text, cap);
            if (!t) return CS_ENOMEM;
            c->text = t, c->cap = cap;
        }
        memcpy(c->text + c->len, text, tl);
        c->len += tl;
        c->text[c->len] = 0;
        if (oc->rq.logprobs && m->n_logprobs) {
            if (c->n_lp + m->n_logprobs > c->cap_lp) {
                size_t cap = (c->n_lp + m->n_logprobs) * 2;
                int32_t *ids = realloc(c->lp_ids, cap * sizeof *ids);
                if (ids) c->lp_ids = ids;
                cs_logprobs *lp = realloc(c->lp, cap * sizeof *lp);
                if (lp) c->lp = lp;
                if (!ids || !lp) return CS_ENOMEM;
                c->cap_lp = cap;
            }
            take_logprobs(m, c->lp_ids + c->n_lp, c->lp + c->n_lp);
            c->n_lp += m->n_logprobs;
        }
        return oc->rq.stream ? send_tool_text(oc, c, m) : 0;
    }
    int r = sse_start(oc);
    c->n_streamed += (int32_t)m->n_token_ids;
    cJSON *lp = NULL;
    bool echo = false;
    if (!r && oc->rq.logprobs && m->n_logprobs) {
        int32_t *ids = malloc(m->n_logprobs * sizeof *ids);
        cs_logprobs *v = malloc(m->n_logprobs * sizeof *v);
        if (ids && v) {
            take_logprobs(m, ids, v);
            echo = oc->rq.echo_logprobs && !c->lp_echoed; /* the prompt's rows go first */
            c->lp_echoed = true;
            lp = logprobs_json(oc, ids, v, m->n_logprobs, &c->lp_offset,
                               echo ? &oc->plp[c->index / oc->rq.n] : NULL);
        }
        free(ids);
        free(v);
    }
    c->len += tl;
    const char *fin = finish_name(m->finish_reason);
    if (!r && oc->rq.chat) {
        /* the role first, then text, then exactly one finish_reason */
        if (!c->role_sent && !tl) r = stream_chunk(oc, c, "", NULL, NULL);
        if (!r && (tl || lp)) r = stream_chunk(oc, c, text, lp, NULL), lp = NULL;
        if (!r && fin) r = stream_chunk(oc, c, NULL, NULL, fin);
    } else if (!r && (tl || lp || fin)) {
        r = stream_chunk(oc, c, text, lp, fin), lp = NULL;
        if (echo) oc->burst += oc->last_event; /* a long prompt's rows: one big chunk */
    }
    cJSON_Delete(lp);
    return r ? CS_ECANCELED : 0;
}

static void c_finish(cs_gen_call *g, int code, const char *msg, const char *field) {
    oa_choice *c = (oa_choice *)g;
    oa_call *oc = c->oc;
    c->finished = true;
    c->cancel_fn = NULL;
    oc->n_done++;
    start_later(oc, c);
    if (code != CS_RPC_OK && !oc->failed) {
        oc->failed = true;
        oa_error_from_status(code, msg, field, oc->rq.chat, &oc->err);
        oc->err.retry_after_s = (g->retry_after_ms + 999) / 1000;
        if (oc->rq.n_choices > 1) /* n > 1: one choice failed, the answer is that failure */
            CS_LOGD("%s: choice %d failed (%s); cancelling the others", oc->id, c->index,
                    oc->err.message);
        cancel_choices(oc);
    }
    complete(oc);
}

static size_t c_pending_bytes(cs_gen_call *g) {
    oa_call *oc = ((oa_choice *)g)->oc;
    size_t n = oc->res && !oc->closed ? cs_http_res_pending_bytes(oc->res) : 0;
    return n > oc->burst ? n - oc->burst : 0; /* the server's own burst is not a backlog */
}

static int c_on_cancel(cs_gen_call *g, cs_gen_cancel_fn fn, void *arg) {
    oa_choice *c = (oa_choice *)g;
    if (c->oc->closed || c->oc->failed) return CS_ECANCELED; /* the answer is a failure now */
    c->cancel_fn = fn;
    c->cancel_arg = arg;
    return 0;
}

static int64_t c_deadline_ms(cs_gen_call *g) {
    (void)g;
    return INT64_MAX; /* HTTP carries none: the process's own timeout applies */
}

static const cs_gen_call_ops choice_ops = {
    .send = c_send,
    .finish = c_finish,
    .pending_bytes = c_pending_bytes,
    .on_cancel = c_on_cancel,
    .deadline_ms = c_deadline_ms,
};

/* The client went away: stop everything it asked for. */
static void on_conn_close(void *arg) {
    oa_call *oc = arg;
    oc->closed = true;
    CS_LOGD("%s: the client closed the connection; cancelling", oc->id);
    cancel_choices(oc);
    complete(oc);
}

/* ------------------------------------------------------------- routes -- */

/* Access-Control-* lines for this request's Origin when CORS allows it. */
static void cors_headers(const cs_openai *s, const cs_http_req *req, char *out, size_t cap) {
    out[0] = 0;
    const char *origin = cs_http_req_header(req, "Origin");
    const char *allow = s->o.cors_allow_origins;
    if (!allow || !origin) return;
    bool ok = !strcmp(allow, "*");
    size_t ol = strlen(origin);
    for (const char *p = allow; !ok && *p;) {
        size_t l = strcspn(p, ",");
        while (l && p[l - 1] == ' ')
            l--;
        if (l == ol && !strncmp(p, origin, l)) ok = true;
        p += strcspn(p, ",");
        while (*p == ',' || *p == ' ')
            p++;
    }
    if (ok && ol < 300)
        snprintf(out, cap, "Access-Control-Allow-Origin: %s\r\nVary: Origin\r\n", origin);
}

static cJSON *model_json(const cs_openai *s) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->o.wm->name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->started);
    cJSON_AddStringToObject(m, "owned_by", "chunkserve");
    cJSON_AddStringToObject(m, "root", s->o.wm->name);
    cJSON_AddNullToObject(m, "parent");
    cJSON_AddNumberToObject(m, "max_model_len", cs_model_get_config(s->o.wm->model)->ctx_len);
    /* an extension (vLLM has none): a load generator drawing token-id prompts needs it */
    cJSON_AddNumberToObject(m, "vocab_size", cs_model_get_config(s->o.wm->model)->n_vocab);
    return m;
}

static void send_cjson(cs_http_res *res, const char *cors, cJSON *j) {
    char *t = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    send_json(res, 200, cors, NULL, t ? t : "{}");
    free(t);
}

static void route_models(cs_openai *s, const char *path, cs_http_res *res, const char *cors) {
    if (!strcmp(path, "/v1/models")) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "object", "list");
        cJSON_AddItemToArray(cJSON_AddArrayToObject(j, "data"), model_json(s));
        send_cjson(res, cors, j);
        return;
    }
    char id[256]; /* percent-decoded: model names have spaces */
    size_t n = 0;
    for (const char *p = path + strlen("/v1/models/"); *p && n + 1 < sizeof id; p++) {
        unsigned v;
        if (p[0] == '%' && p[1] && p[2] && sscanf(p + 1, "%2x", &v) == 1)
            id[n++] = (char)v, p += 2;
        else
            id[n++] = *p;
    }
    id[n] = 0;
    if (id[0] && strlen(id) == n && cs_wire_check_model(s->o.wm, id) == 0) {
        send_cjson(res, cors, model_json(s));
        return;
    }
    oa_error e = {.status = 404, .type = "invalid_request_error", .code = "model_not_found"};
    snprintf(e.param, sizeof e.param, "model");
    snprintf(e.message, sizeof e.message, "The model '%.200s' does not exist", id);
    send_error(res, cors, &e);
}

/* A preflight's allowed headers: the ones it asks for (the official JS
 * SDK sends x-stainless-* headers) when they are plain header names, and
 * always Authorization and Content-Type. */
static const char *allow_headers(const cs_http_req *req) {
    static const char base[] = "Authorization, Content-Type, " CS_TENANT_HEADER;
    static _Thread_local char buf[1024];
    const char *want = cs_http_req_header(req, "Access-Control-Request-Headers");
    if (!want || !*want || strlen(want) + sizeof base + 2 > sizeof buf) return base;
    for (const char *p = want; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-' || *p == '_' || *p == ',' || *p == ' '))
            return base;
    snprintf(buf, sizeof buf, "%s, %s", base, want);
    return buf;
}

#ifndef CS_VERSION
#define CS_VERSION "dev"
#endif

/* GET /health (200, empty: the process serves), GET /version, POST
 * /tokenize and /detokenize (vLLM's bodies and answers). */
static void route_util(cs_openai *s, cs_http_req *req, cs_http_res *res, const char *cors,
                       bool health, bool version, bool tokenize) {
    if (health) {
        cs_http_res_send(res, 200, NULL, cors, "", 0);
        return;
    }
    if (version) {
        send_json(res, 200, cors, NULL, "{\"version\":\"" CS_VERSION "\"}");
        return;
    }
    size_t len;
    const char *body = cs_http_req_body(req, &len);
    oa_error e = {0};
    char *out =
        tokenize ? oa_tokenize(body, len, s->o.wm, &e) : oa_detokenize(body, len, s->o.wm, &e);
    if (out)
        send_json(res, 200, cors, NULL, out);
    else
        send_error(res, cors, &e);
    free(out);
}

/* echo: the text each prompt's answer starts with: completions: the prompt
 * (token ids decoded); chat: the last message when it is the assistant's
 * (vLLM's rule), else nothing. 0, or -1 with *e set (nothing set: out of
 * memory). */
static int echo_texts(oa_call *oc, oa_error *e) {
    const oa_request *rq = &oc->rq;
    if (!(oc->echo = calloc((size_t)rq->n_prompts, sizeof *oc->echo))) return -1;
    const cs_tokenizer *tok = cs_model_tokenizer(oc->s->o.wm->model);
    for (int32_t p = 0; p < rq->n_prompts; p++) {
        const Chunkserve__V1__GenerateRequest *q = &rq->req[p * rq->n];
        const char *t = "";
        if (rq->chat) {
            const Chunkserve__V1__ChatMessage *last = q->chat->messages[q->chat->n_messages - 1];
            if (!strcmp(last->role, "assistant")) t = last->content;
        } else if (q->input_case == CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_PROMPT) {
            t = q->prompt;
        } else {
            size_t n;
            if (cs_tokenizer_decode(tok, q->token_ids->ids, q->token_ids->n_ids, false,
                                    &oc->echo[p], &n)) {
                *e = (oa_error){.status = 400, .type = "invalid_request_error"};
                snprintf(e->param, sizeof e->param, "prompt");
                snprintf(e->message, sizeof e->message, "prompt: %s", cs_last_error());
                return -1;
            }
            continue;
        }
        if (!(oc->echo[p] = strdup(t))) return -1;
    }
    return 0;
}

/* What the answer needs to know of each prompt's tokens, taken as Generate
 * will take them (a request Generate refuses gets 0 here and its error
 * there): continuous usage: their count; echo with logprobs: the first
 * (the engine's prompt logprobs start after it). 0 or -1 (out of memory). */
static int prompt_facts(oa_call *oc) {
    const oa_request *rq = &oc->rq;
    bool count = rq->continuous_usage, plp = rq->prompt_logprobs >= 0 || rq->echo_logprobs;
    if (count && !(oc->n_prompt = calloc((size_t)rq->n_prompts, sizeof *oc->n_prompt))) return -1;
    if (plp && !(oc->plp = calloc((size_t)rq->n_prompts, sizeof *oc->plp))) return -1;
    for (int32_t p = 0; (count || rq->echo_logprobs) && p < rq->n_prompts; p++) {
        cs_wire_request w;
        if (cs_wire_generate_request(oc->s->o.wm, &rq->req[p * rq->n], 0, &w) == 0) {
            if (count) oc->n_prompt[p] = w.r.n_prompt;
            if (plp) oc->plp[p].first = w.r.prompt[0];
            cs_wire_request_free(&w);
        }
    }
    return 0;
}

/* The tenant the X-Chunkserve-Tenant header names (api/tenant_config.h):
 * into every choice's GenerateRequest (checked with the rest by cs_wire).
 * 0, or -1 with *e set (nothing set: out of memory). */
static int request_tenant(cs_http_req *req, oa_request *rq, oa_error *e) {
    const char *t = cs_http_req_header(req, CS_TENANT_HEADER);
    if (!t || !t[0]) return 0;
    if (cs_wire_check_tenant(t) != 0) {
        *e = (oa_error){.status = 400, .type = "invalid_request_error"};
        snprintf(e->param, sizeof e->param, "tenant");
        snprintf(e->message, sizeof e->message, "%s: %s", CS_TENANT_HEADER, cs_last_error());
        return -1;
    }
    if (!(rq->tenant = strdup(t))) return -1;
    for (int32_t i = 0; i < rq->n_choices; i++)
        rq->req[i].tenant = rq->tenant;
    return 0;
}

/* key_tenant: the tenant of the caller's API key (NULL: no keys). */
static void route_generate(cs_openai *s, cs_http_req *req, cs_http_res *res, bool chat,
                           const char *cors, const char *key_tenant) {
    size_t len;
    const char *body = cs_http_req_body(req, &len);
    oa_call *oc = calloc(1, sizeof *oc);
    if (!oc) {
        send_error(res, cors,
                   &(oa_error){.status = 503, .type = "server_error", .message = "out of memory"});
        cs_http_res_end(res);
        return;
    }
    oa_error e = {0};
    oc->s = s;
    if (oa_request_parse(body, len, chat, s->o.wm, &oc->rq, &e) != 0 ||
        request_tenant(req, &oc->rq, &e) != 0 ||
        !(oc->choices = calloc((size_t)oc->rq.n_choices, sizeof *oc->choices)) ||
        (oc->rq.echo && echo_texts(oc, &e)) || prompt_facts(oc)) {
        if (!e.status)
            e = (oa_error){.status = 503, .type = "server_error", .message = "out of memory"};
        send_error(res, cors, &e);
        cs_http_res_end(res);
        for (int32_t p = 0; oc->echo && p < oc->rq.n_prompts; p++)
            free(oc->echo[p]);
        free(oc->echo);
        free(oc->n_prompt);
        free(oc->plp);
        free(oc->choices);
        oa_request_free(&oc->rq);
        free(oc);
        return;
    }
    s->n_open++;
    oc->res = res;
    oc->created = (long long)time(NULL);
    if (oc->rq.request_id) /* vLLM: the client's request_id names the answer */
        snprintf(oc->id, sizeof oc->id, "%s-%.140s", chat ? "chatcmpl" : "cmpl", oc->rq.request_id);
    else
        snprintf(oc->id, sizeof oc->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
                 (unsigned long long)++s->next_id ^ ((unsigned long long)oc->created << 24));
    snprintf(oc->cors, sizeof oc->cors, "%s", cors);
    cs_http_res_on_close(res, on_conn_close, oc);
    oc->busy++;
    for (int32_t i = 0; i < oc->rq.n_choices; i++) {
        oa_choice *c = &oc->choices[i];
        c->base.ops = &choice_ops;
        c->base.req = &oc->rq.req[i];
        c->base.key_tenant = key_tenant;
        c->base.sibling = i % oc->rq.n != 0; /* n > 1: a later choice of its prompt */
        c->oc = oc;
        c->index = i;
        c->stop_token = -1;
    }
    for (int32_t i = 0; i < oc->rq.n_choices; i += oc->rq.n) /* each prompt's first */
        start_choice(oc, &oc->choices[i]);
    oc->busy--;
    complete(oc);
}

static void handle(void *arg, cs_http_req *req, cs_http_res *res) {
    cs_openai *s = arg;
    const char *path = cs_http_req_path(req), *method = cs_http_req_method_name(req);
    char cors[512];
    cors_headers(s, req, cors, sizeof cors);
    bool chat = !strcmp(path, "/v1/chat/completions"), compl = !strcmp(path, "/v1/completions");
    bool models = !strcmp(path, "/v1/models") || !strncmp(path, "/v1/models/", 11);
    /* vLLM's utility routes: GET /health, /version; POST /tokenize, /detokenize */
    bool health = !strcmp(path, "/health"), version = !strcmp(path, "/version");
    bool tokenize = !strcmp(path, "/tokenize"), detokenize = !strcmp(path, "/detokenize");
    bool util = health || version || tokenize || detokenize;
    bool get = models || health || version; /* the GET routes; the others take POST */
    if (!strcmp(method, "OPTIONS") && s->o.cors_allow_origins &&
        (chat || compl || models || util)) {
        char h[2048];
        snprintf(h, sizeof h,
                 "%sAccess-Control-Allow-Methods: GET, POST, OPTIONS\r\n"
                 "Access-Control-Allow-Headers: %s\r\n"
                 "Access-Control-Max-Age: 600\r\n",
                 cors, allow_headers(req));
        cs_http_res_send(res, 204, NULL, h, "", 0);
        cs_http_res_end(res);
        return;
    }
    oa_error e = {.type = "invalid_request_error"};
    const char *auth = cs_http_req_header(req, "Authorization");
    if (!chat && !compl &&!models && !util) {
        e.status = 404;
        snprintf(e.message, sizeof e.message, "no route %.200s %.300s", method, path);
    } else if ((get && strcmp(method, "GET") && strcmp(method, "HEAD")) ||
               (!get && strcmp(method, "POST"))) {
        e.status = 405;
        snprintf(e.message, sizeof e.message, "%s takes %s, not %.20s", path, get ? "GET" : "POST",
                 method);
    } else if (!health && !version &&
               !cs_api_keys_check(s->o.api_keys, auth, auth ? strlen(auth) : 0)) {
        e.status = 401;
        e.type = "authentication_error";
        e.code = "invalid_api_key";
        snprintf(e.message, sizeof e.message,
                 "a valid API key is required: send it as 'Authorization: Bearer <key>'");
    }
    if (e.status) {
        if (e.status == 405) {
            char h[600];
            snprintf(h, sizeof h, "%sAllow: %s\r\n", cors, get ? "GET, HEAD" : "POST");
            char *b = oa_error_json(&e);
            send_json(res, 405, NULL, h, b ? b : "{}");
            free(b);
        } else {
            send_error(res, cors, &e);
        }
        cs_http_res_end(res);
        return;
    }
    if (models) {
        route_models(s, path, res, cors);
        cs_http_res_end(res);
        return;
    }
    if (util) {
        route_util(s, req, res, cors, health, version, tokenize);
        cs_http_res_end(res);
        return;
    }
    route_generate(s, req, res, chat, cors,
                   cs_api_keys_tenant(s->o.api_keys, auth, auth ? strlen(auth) : 0));
}

/* The HTTP server's own refusals (malformed, too large, too slow), as
 * OpenAI error bodies. */
static void http_error(void *arg, int status, const char *message, cs_http_res *res) {
    (void)arg;
    oa_error e = {.status = status, .type = "invalid_request_error"};
    snprintf(e.message, sizeof e.message, "%s", message ? message : "bad request");
    send_error(res, NULL, &e);
}

/* ------------------------------------------------------------- public -- */

int cs_openai_start(struct uv_loop_s *loop, const cs_openai_opts *o, cs_openai **out) {
    *out = NULL;
    if (!o || !o->wm || !o->generate) return cs_fail(CS_EINVAL, "openai: missing options");
    cs_openai *s = calloc(1, sizeof *s);
    if (!s) return cs_fail(CS_ENOMEM, "out of memory");
    s->o = *o;
    s->started = (long long)time(NULL);
    if (!s->o.max_request_bytes) s->o.max_request_bytes = DEFAULT_MAX_REQUEST;
    cs_http_opts ho = {.handler = handle,
                       .arg = s,
                       .max_body_bytes = s->o.max_request_bytes,
                       .request_ms = s->o.request_ms,
                       .idle_ms = s->o.idle_ms,
                       .error = http_error,
                       .tls = s->o.tls};
    int r = cs_http_server_start(loop, o->host, o->port, &ho, &s->http);
    if (r) {
        free(s);
        return r;
    }
    uv_check_init(loop, &s->kick);
    s->kick.data = s;
    *out = s;
    return 0;
}

int cs_openai_start_config(struct uv_loop_s *loop, const cs_openai_config *c, const cs_rpc_tls *tls,
                           const char *default_host, const cs_wire_model *wm,
                           void (*generate)(void *arg, cs_gen_call *call), void *arg,
                           cs_api_keys *keys, cs_openai **out) {
    *out = NULL;
    int r = cs_api_keys_load(c->api_key, c->api_key_file, keys);
    if (r || c->port < 0) return r;
    cs_openai_opts o = {.host = c->host && c->host[0] ? c->host : default_host,
                        .port = (int)c->port,
                        .wm = wm,
                        .generate = generate,
                        .arg = arg,
                        .max_request_bytes = (size_t)c->max_request_bytes,
                        .request_ms = (uint64_t)c->request_timeout_ms,
                        .idle_ms = (uint64_t)c->idle_timeout_ms,
                        .api_keys = keys,
                        .cors_allow_origins = c->cors_allow_origins,
                        .tls = c->tls ? tls : NULL};
    if ((r = cs_openai_start(loop, &o, out))) return r;
    CS_LOGI("OpenAI-compatible API on %s:%d (%s, %s)", o.host, cs_openai_port(*out),
            o.tls && o.tls->cert_file && o.tls->cert_file[0] ? "HTTPS" : "plain HTTP",
            keys->n ? "API key required" : "no API key");
    return 0;
}

void cs_openai_print_listening(const cs_openai *s) {
    if (!s) return;
    printf("openai listening on %s:%d\n", s->o.host, cs_openai_port(s));
    fflush(stdout);
}

int cs_openai_port(const cs_openai *s) {
    return cs_http_server_port(s->http);
}

void cs_openai_close(cs_openai *s) {
    if (!s || s->closed) return;
    s->closed = true;
    cs_http_server_close(s->http); /* open responses see their connection close */
    if (s->n_open == 0) server_free(s);
}
