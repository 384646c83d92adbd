/* errors.c: OpenAI error bodies, and gRPC statuses from Generate turned
 * into them (openai-impl.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/rpc.h"
#include "openai-impl.h"

/* The OpenAI param of a Generate refusal's field (cs_fail_field: the
 * GenerateRequest's own path, "sampling.top_p"): the same name where the
 * two APIs agree, else OpenAI's. */
static void param_of(const char *field, bool chat, char *param, size_t cap) {
    static const struct {
        const char *field, *param; /* a field, or a prefix ending in '.' */
    } renames[] = {
        {"context", NULL}, /* NULL: the prompt's own param */
        {"prompt", NULL},
        {"token_ids", NULL},
        {"token_ids.", NULL},
        {"chat", NULL},
        {"chat.", NULL},
        {"sampling.logit_bias_ids", "logit_bias"}, /* the proto's two lists: OpenAI's one map */
        {"sampling.logit_bias_values", "logit_bias"},
        {"sampling.include_special", "skip_special_tokens"},
        {"sampling.prompt_top_logprobs", "prompt_logprobs"},
        {"sampling.structured", "response_format"},
    };
    param[0] = 0;
    if (!field || !field[0]) return;
    for (size_t i = 0; i < sizeof renames / sizeof renames[0]; i++) {
        size_t n = strlen(renames[i].field);
        bool prefix = renames[i].field[n - 1] == '.';
        if (prefix ? strncmp(field, renames[i].field, n) : strcmp(field, renames[i].field))
            continue;
        snprintf(param, cap, "%s",
                 renames[i].param ? renames[i].param
                 : chat           ? "messages"
                                  : "prompt");
        return;
    }
    if (!strncmp(field, "sampling.", 9)) field += 9;
    if (!strcmp(field, "top_logprobs") && !chat) field = "logprobs"; /* completions' one field */
    snprintf(param, cap, "%s", field);
}

void oa_error_from_status(int code, const char *msg, const char *field, bool chat, oa_error *e) {
    memset(e, 0, sizeof *e);
    snprintf(e->message, sizeof e->message, "%s", msg && msg[0] ? msg : cs_rpc_code_name(code));
    switch (code) {
    case CS_RPC_INVALID_ARGUMENT:
    case CS_RPC_FAILED_PRECONDITION:
    case CS_RPC_OUT_OF_RANGE:
        e->status = 400;
        e->type = "invalid_request_error";
        param_of(field, chat, e->param, sizeof e->param);
        if (field && !strcmp(field, "context")) e->code = "context_length_exceeded";
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
        param_of(field, chat, e->param, sizeof e->param);
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
