/* openai-impl.h: the parts of openai/ (see openai.h): the request parser
 * (request.c: JSON -> GenerateRequests), the routes, which also write the
 * answers (openai.c: GenerateResponses -> JSON and SSE events), the error
 * bodies (errors.c) and tool calls (tools.c). */
#ifndef CS_OPENAI_IMPL_H
#define CS_OPENAI_IMPL_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "openai.h"

#define OA_MAX_N 16       /* choices per prompt */
#define OA_MAX_PROMPTS 64 /* prompts in one completions request */

/* An error answer: HTTP status, OpenAI type and code, the request field it
 * is about (NULL: none). */
typedef struct {
    int status;
    const char *type; /* "invalid_request_error", "authentication_error", ... */
    const char *code; /* NULL, "model_not_found", "context_length_exceeded", ... */
    char param[64];
    char message[512];
    int64_t retry_after_s; /* 429, 503: Retry-After (0: 1 s) */
} oa_error;

/* How a chat answer is read for tool calls (docs/tools.md). */
enum oa_tool_mode {
    OA_TOOLS_OFF = 0,  /* no tools, or tool_choice "none": text only */
    OA_TOOLS_AUTO,     /* the model's <tool_call> blocks, if it writes any */
    OA_TOOLS_REQUIRED, /* constrained: a JSON array of {"name", "parameters"} */
    OA_TOOLS_NAMED,    /* constrained: the named function's arguments */
};

/* One parsed request. The GenerateRequest of choice i is req[i]; their
 * strings point into json (kept until oa_request_free). */
typedef struct {
    cJSON *json;
    bool chat, stream, include_usage, logprobs;
    bool continuous_usage;   /* stream_options.continuous_usage_stats (with include_usage) */
    bool echo;               /* the prompt (chat: a final assistant message) before the text */
    bool tokens_as_ids;      /* return_tokens_as_token_ids: logprob tokens as "token_id:N" */
    const char *request_id;  /* the client's (vLLM's request_id), or NULL */
    char *tenant;            /* the X-Chunkserve-Tenant header's value (owned), or NULL */
    int32_t top_logprobs;    /* completions: logprobs=N asks N alternatives */
    int32_t prompt_logprobs; /* vLLM's: alternatives per prompt token; -1 = not asked */
    bool echo_logprobs;      /* completions' echo with logprobs: the prompt's come first */
    int32_t n;               /* choices per prompt */
    int32_t n_prompts;
    int32_t n_choices; /* n * n_prompts; choice i is prompt i / n */
    const char *model;
    Chunkserve__V1__GenerateRequest *req;     /* n_choices */
    Chunkserve__V1__SamplingParams *sampling; /* n_choices (seeds differ) */
    Chunkserve__V1__Chat chat_msg;
    Chunkserve__V1__ChatMessage *msgs, **msg_ptrs;
    Chunkserve__V1__TokenIds *ids; /* n_prompts (token-id prompts) */
    int32_t **id_store;
    char **stops;
    int32_t *stop_ids;
    int32_t *bias_ids; /* logit_bias, in the request's order */
    float *bias;
    char *text_store; /* chat contents joined from parts */
    /* structured output (sampling.structured points here): the schema printed
     * from the request's object, the choices borrowed from r->json */
    Chunkserve__V1__StructuredOutput structured;
    Chunkserve__V1__Choices choices;
    char *schema_text;
    char **choice_ptrs;
    /* tools (chat; openai/tools.c): how the answer is read, the tools as JSON
     * text for Chat.tools, the tool calls of the history's messages */
    enum oa_tool_mode tool_mode;
    const char *tool_name; /* OA_TOOLS_NAMED: the function */
    bool parallel_tools;
    char **tool_texts;
    const char **tool_names; /* (n_tools) borrowed from json */
    size_t n_tools;
    Chunkserve__V1__ToolCall *calls, **call_ptrs;
    size_t n_calls;
} oa_request;

/* Parses body (len bytes) for /v1/chat/completions (chat) or
 * /v1/completions. 0, or -1 with *e filled (status 400 and the field). */
int oa_request_parse(const char *body, size_t len, bool chat, const cs_wire_model *wm,
                     oa_request *out, oa_error *e);
void oa_request_free(oa_request *r);
/* The "messages" of object o (and add_generation_prompt,
 * continue_final_message) into r->chat_msg; r->json must hold o. 0 or -1
 * with *e filled. */
int oa_parse_messages(const cJSON *o, oa_request *r, oa_error *e);

/* A 400 invalid_request_error naming param; returns -1. */
int oa_fail(oa_error *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* tools.c. The tool fields of a chat request (tools, tool_choice,
 * parallel_tool_calls) into r (Chat.tools, the mode, and for required or a
 * named function the constraint in s->structured); after the messages and
 * the other sampling fields. 0 or -1 with *e filled. */
int oa_parse_tools(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_request *r, oa_error *e);
/* An assistant message's tool_calls, or a tool message's tool_call_id, of
 * message m (index i) into cm, the calls stored in r->calls from *next. */
int oa_parse_message_tools(const cJSON *m, int i, Chunkserve__V1__ChatMessage *cm, oa_request *r,
                           size_t *next, oa_error *e);
/* The tool calls in a choice's text, as OpenAI's tool_calls array (ids made
 * here), or NULL when it holds none (then all of it is content); *content_len:
 * the bytes before the calls that are the message's content (0: null). */
cJSON *oa_tool_calls(const oa_request *r, const char *text, size_t *content_len);
/* Streaming in auto mode: the bytes of text (len) that may be shown as
 * content now: all of it but a tail that could begin "<tool_call>", or up to
 * the first "<tool_call>" (*in_call true: the rest is held for the end). */
size_t oa_tool_visible(const char *text, size_t len, bool *in_call);

/* POST /tokenize and /detokenize (vLLM's): the answer's JSON (malloc'd) for
 * body, or NULL with *e filled. */
char *oa_tokenize(const char *body, size_t len, const cs_wire_model *wm, oa_error *e);
char *oa_detokenize(const char *body, size_t len, const cs_wire_model *wm, oa_error *e);

/* The HTTP status, OpenAI type/code and param of a gRPC status, message and
 * field (cs_fail_field's, or NULL) from Generate. */
void oa_error_from_status(int code, const char *msg, const char *field, bool chat, oa_error *e);
/* {"error":{...}} as a malloc'd string. */
char *oa_error_json(const oa_error *e);

#endif
