/* errors.c: OpenAI error bodies, and gRPC statuses from Generate turned
 * into them (openai-impl.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/rpc.h"
#include "openai-impl.h"

/* The request field a Generate message names: its first word (api/wire.c
 * starts its messages with the proto field), in the request's terms. */
static void param_of(const char *msg, bool chat, char *param, size_t cap) {
    param[0] = 0;
    if (!msg) return;
    if (strstr(msg, "context") || !strncmp(msg, "the prompt", 10) || !strncmp(msg, "chat ", 5)) {
        snprintf(param, cap, "%s", chat ? "messages" : "prompt");
        return;
    }
    if (!strncmp(msg, "sampling.", 9)) msg += 9;
    size_t n = strcspn(msg, " :[=."); /* "token_ids.ids[3] = ..." names token_ids */
    static const char *const known[] = {"temperature",
                                        "top_p",
                                        "top_k",
                                        "min_p",
                                        "repetition_penalty",
                                        "presence_penalty",
                                        "frequency_penalty",
                                        "max_tokens",
                                        "min_tokens",
                                        "top_logprobs",
                                        "stop",
                                        "stop_token_ids",
                                        "seed",
                                        "model",
                                        "token_ids",
                                        "prompt",
                                        "request_id",
                                        "cache_salt"};
    if ((n == 10 && !strncmp(msg, "logit_bias", 10)) || !strncmp(msg, "logit_bias_", 11)) {
        snprintf(param, cap, "logit_bias"); /* the proto's two lists are OpenAI's one map */
        return;
    }
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strlen(known[i]) == n && !strncmp(msg, known[i], n)) {
            if (!strcmp(known[i], "token_ids") || !strcmp(known[i], "prompt"))
                snprintf(param, cap, "%s", chat ? "messages" : "prompt");
            else
                snprintf(param, cap, "%s", known[i]);
            return;
        }
}

void oa_error_from_status(int code, const char *msg, bool chat, oa_error *e) {
    memset(e, 0, sizeof *e);
    snprintf(e->message, sizeof e->message, "%s", msg && msg[0] ? msg : cs_rpc_code_name(code));
    switch (code) {
    case CS_RPC_INVALID_ARGUMENT:
    case CS_RPC_FAILED_PRECONDITION:
    case CS_RPC_OUT_OF_RANGE:
        e->status = 400;
        e->type = "invalid_request_error";
        param_of(msg, chat, e->param, sizeof e->param);
        if (msg && strstr(msg, "context")) e->code = "context_length_exceeded";
        break;
    case CS_RPC_NOT_FOUND:
        e->status = 404;
        e->type = "invalid_request_error";
        e->code = "model_not_found";
        snprintf(e->param, sizeof e->param, "model");
        break;
    case CS_RPC_UNAUTHENTICATED:
        e->status = 401;
        e->type = "authentication_error";
        e->code = "invalid_api_key";
        break;
    case CS_RPC_PERMISSION_DENIED:
        e->status = 403;
        e->type = "permission_error";
        break;
    case CS_RPC_RESOURCE_EXHAUSTED:
        e->status = 429;
        e->type = "rate_limit_error";
        e->code = "rate_limit_exceeded";
        break;
    case CS_RPC_UNAVAILABLE:
        e->status = 503;
        e->type = "server_error";
        e->code = "service_unavailable";
        break;
    case CS_RPC_DEADLINE_EXCEEDED:
        e->status = 504;
        e->type = "server_error";
        e->code = "timeout";
        break;
    case CS_RPC_CANCELLED:
        e->status = 499; /* nobody reads it: the client went away */
        e->type = "invalid_request_error";
        e->code = "cancelled";
        break;
    default:
        e->status = 500;
        e->type = "server_error";
        break;
    }
}

char *oa_error_json(const oa_error *e) {
    cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
    if (!err) {
        cJSON_Delete(root);
        return NULL;
    }
    cJSON_AddStringToObject(err, "message", e->message);
    cJSON_AddStringToObject(err, "type", e->type ? e->type : "server_error");
    if (e->param[0])
        cJSON_AddStringToObject(err, "param", e->param);
    else
        cJSON_AddNullToObject(err, "param");
    if (e->code)
        cJSON_AddStringToObject(err, "code", e->code);
    else
        cJSON_AddNullToObject(err, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}
