/* request.c: an OpenAI request body -> one chunkserve.v1 GenerateRequest per
 * choice (openai-impl.h). Only the JSON's shape is checked here (types,
 * integral numbers within +-2^53, no NaN or Infinity, no duplicate keys,
 * the fields we do not serve; the scalar sampling fields by their table,
 * chunkserve/sampling_fields.h); the values go through the same checks as
 * the gRPC door (api/wire.c), whose refusals carry the proto field
 * (cs_fail_field), which oa_error_from_status maps to the request's. */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "chunkserve/error.h"
#include "chunkserve/grammar.h"
#include "chunkserve/sampling_fields.h"
#include "chunkserve/tokenizer.h"
#include "openai-impl.h"

#define MAX_SAFE_INT 9007199254740992.0 /* 2^53 */

int oa_fail(oa_error *e, const char *param, const char *fmt, ...) {
    e->status = 400;
    e->type = "invalid_request_error";
    e->code = NULL;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

/* The first key that appears twice in an object, anywhere in j; NULL. */
static const char *duplicate_key(const cJSON *j) {
    for (const cJSON *a = j ? j->child : NULL; a; a = a->next) {
        if (cJSON_IsObject(j))
            for (const cJSON *b = a->next; b; b = b->next)
                if (a->string && b->string && strcmp(a->string, b->string) == 0) return a->string;
        const char *d = duplicate_key(a);
        if (d) return d;
    }
    return NULL;
}

/* The item at key, NULL when absent or null. */
static cJSON *field(const cJSON *o, const char *key) {
    cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    return it && !cJSON_IsNull(it) ? it : NULL;
}

static bool is_int(const cJSON *it) {
    return cJSON_IsNumber(it) && isfinite(it->valuedouble) &&
           it->valuedouble == floor(it->valuedouble) && fabs(it->valuedouble) <= MAX_SAFE_INT;
}

/* *out = the integer at key within [lo, hi]; untouched when absent. */
static int get_int(const cJSON *o, const char *key, double lo, double hi, int64_t *out,
                   oa_error *e) {
    cJSON *it = field(o, key);
    if (!it) return 0;
    if (!is_int(it)) return oa_fail(e, key, "%s must be an integer", key);
    if (it->valuedouble < lo || it->valuedouble > hi)
        return oa_fail(e, key, "%s must be in [%.0f, %.0f]; got %.0f", key, lo, hi,
                       it->valuedouble);
    *out = (int64_t)it->valuedouble;
    return 0;
}

static int get_bool(const cJSON *o, const char *key, bool *out, oa_error *e) {
    cJSON *it = field(o, key);
    if (!it) return 0;
    if (!cJSON_IsBool(it)) return oa_fail(e, key, "%s must be true or false", key);
    *out = cJSON_IsTrue(it);
    return 0;
}

static int get_str(const cJSON *o, const char *key, const char **out, oa_error *e) {
    cJSON *it = field(o, key);
    if (!it) return 0;
    if (!cJSON_IsString(it)) return oa_fail(e, key, "%s must be a string", key);
    *out = it->valuestring;
    return 0;
}

/* Every request field this server knows besides the sampling fields of
 * chunkserve/sampling_fields.h that OpenAI spells as we do (docs/openai.md
 * has the whole list for users): SERVED fields are read by the parsers below; REFUSED ones
 * are refused by name unless they ask for nothing (null, false, empty, or
 * their default); any other key is refused as unrecognized, as OpenAI's
 * own API does, so nothing a client asks for is ignored silently. */
enum { SERVED, REFUSED };
enum { BOTH, CHAT, COMPL };
static const struct {
    const char *name;
    char served, door;
} known_fields[] = {
    {"model", SERVED, BOTH},
    {"messages", SERVED, CHAT},
    {"prompt", SERVED, COMPL},
    {"stream", SERVED, BOTH},
    {"stream_options", SERVED, BOTH},
    {"n", SERVED, BOTH},
    {"max_tokens", SERVED, BOTH},
    {"max_completion_tokens", SERVED, CHAT},
    {"seed", SERVED, BOTH},
    {"stop", SERVED, BOTH},
    {"stop_token_ids", SERVED, BOTH},
    {"logit_bias", SERVED, BOTH},
    {"skip_special_tokens", SERVED, BOTH},
    {"logprobs", SERVED, BOTH},
    {"top_logprobs", SERVED, CHAT},
    {"return_tokens_as_token_ids", SERVED, BOTH},
    {"echo", SERVED, BOTH},
    {"add_generation_prompt", SERVED, CHAT},
    {"continue_final_message", SERVED, CHAT},
    {"cache_salt", SERVED, BOTH},
    {"request_id", SERVED, BOTH},
    {"user", SERVED, BOTH},
    {"response_format", SERVED, BOTH},
    {"structured_outputs", SERVED, BOTH},
    {"guided_json", SERVED, BOTH},
    {"guided_regex", SERVED, BOTH},
    {"guided_choice", SERVED, BOTH},
    {"best_of", REFUSED, COMPL}, /* 1 is the default */
    {"store", REFUSED, CHAT},
    {"metadata", REFUSED, CHAT},
    {"service_tier", REFUSED, BOTH},
    {"suffix", REFUSED, COMPL},
    {"prompt_logprobs", SERVED, BOTH},
    {"tools", SERVED, CHAT},
    {"tool_choice", SERVED, CHAT},
    {"parallel_tool_calls", SERVED, CHAT},
    {"functions", REFUSED, CHAT},
    {"function_call", REFUSED, CHAT},
    {"audio", REFUSED, CHAT},
    {"modalities", REFUSED, CHAT},
    {"prediction", REFUSED, CHAT},
    {"reasoning_effort", REFUSED, CHAT},
    {"web_search_options", REFUSED, CHAT},
    {"include_stop_str_in_output", REFUSED, BOTH},
    {"bad_words", REFUSED, BOTH},
    {"allowed_token_ids", REFUSED, BOTH},
    {"truncate_prompt_tokens", REFUSED, BOTH},
    {"use_beam_search", REFUSED, BOTH},
    {"length_penalty", REFUSED, BOTH},
    {"spaces_between_special_tokens", REFUSED, BOTH}, /* true is the default */
    {"guided_grammar", REFUSED, BOTH},
    {"chat_template", REFUSED, CHAT},
    {"chat_template_kwargs", REFUSED, CHAT},
    {"documents", REFUSED, CHAT},
    {"mm_processor_kwargs", REFUSED, BOTH},
    {"logits_processors", REFUSED, BOTH},
    {"kv_transfer_params", REFUSED, BOTH},
};

/* Whether a refused field's value asks for nothing: null, false, an empty
 * object or list, or the field's default. */
static bool asks_nothing(const char *name, const cJSON *it) {
    if (!strcmp(name, "spaces_between_special_tokens")) return cJSON_IsNull(it) || cJSON_IsTrue(it);
    if (!it || cJSON_IsNull(it) || cJSON_IsFalse(it)) return true;
    if ((cJSON_IsObject(it) || cJSON_IsArray(it)) && !it->child) return true;
    if (!strcmp(name, "best_of")) return is_int(it) && it->valuedouble == 1;
    return false;
}

static int check_fields(const cJSON *o, bool chat, oa_error *e) {
    for (const cJSON *it = o->child; it; it = it->next) {
        bool sampling = false;
        for (size_t i = 0; i < cs_n_sampling_fields; i++)
            sampling |=
                cs_sampling_fields[i].openai && !strcmp(cs_sampling_fields[i].openai, it->string);
        if (sampling) continue;
        int k = -1;
        for (int i = 0; i < (int)(sizeof known_fields / sizeof known_fields[0]); i++)
            if (!strcmp(known_fields[i].name, it->string) &&
                known_fields[i].door != (chat ? COMPL : CHAT))
                k = i;
        if (k < 0)
            return oa_fail(e, it->string,
                           "Unrecognized request argument supplied: %s (docs/openai.md lists the "
                           "fields of %s)",
                           it->string, chat ? "/v1/chat/completions" : "/v1/completions");
        if (known_fields[k].served == REFUSED && !asks_nothing(it->string, it))
            return oa_fail(e, it->string, "%s is not supported by this server", it->string);
    }
    return 0;
}

int oa_parse_messages(const cJSON *o, oa_request *r, oa_error *e) {
    cJSON *ms = field(o, "messages");
    if (!ms) return oa_fail(e, "messages", "messages is required");
    if (!cJSON_IsArray(ms) || !ms->child)
        return oa_fail(e, "messages", "messages must be a non-empty array");
    int n = cJSON_GetArraySize(ms);
    size_t text_bytes = 0, n_calls = 0, next_call = 0;
    for (cJSON *m = ms->child; m; m = m->next) {
        cJSON *tc = cJSON_IsObject(m) ? field(m, "tool_calls") : NULL;
        if (cJSON_IsArray(tc)) n_calls += (size_t)cJSON_GetArraySize(tc);
        cJSON *c = cJSON_IsObject(m) ? field(m, "content") : NULL;
        if (cJSON_IsArray(c))
            for (cJSON *p = c->child; p; p = p->next) {
                cJSON *t = cJSON_IsObject(p) ? field(p, "text") : NULL;
                if (cJSON_IsString(t)) text_bytes += strlen(t->valuestring);
            }
    }
    r->msgs = calloc((size_t)n, sizeof *r->msgs);
    r->msg_ptrs = calloc((size_t)n, sizeof *r->msg_ptrs);
    r->text_store = malloc(text_bytes + (size_t)n);
    r->calls = calloc(n_calls + 1, sizeof *r->calls);
    r->call_ptrs = calloc(n_calls + 1, sizeof *r->call_ptrs);
    if (!r->msgs || !r->msg_ptrs || !r->text_store || !r->calls || !r->call_ptrs)
        return oa_fail(e, NULL, "out of memory");
    char *store = r->text_store, param[64];
    int i = 0;
    for (cJSON *m = ms->child; m; m = m->next, i++) {
        Chunkserve__V1__ChatMessage *cm = &r->msgs[i];
        chunkserve__v1__chat_message__init(cm);
        r->msg_ptrs[i] = cm;
        snprintf(param, sizeof param, "messages[%d]", i);
        if (!cJSON_IsObject(m)) return oa_fail(e, param, "%s must be an object", param);
        cJSON *role = field(m, "role");
        snprintf(param, sizeof param, "messages[%d].role", i);
        if (!cJSON_IsString(role)) return oa_fail(e, param, "%s must be a string", param);
        const char *rs = role->valuestring;
        if (!strcmp(rs, "developer"))
            cm->role = "system"; /* OpenAI's newer name for the system role */
        else if (!strcmp(rs, "system") || !strcmp(rs, "user") || !strcmp(rs, "assistant") ||
                 !strcmp(rs, "tool"))
            cm->role = role->valuestring;
        else
            return oa_fail(e, param,
                           "%s '%s' is not supported: use system, developer, user, assistant or "
                           "tool",
                           param, rs);
        if (oa_parse_message_tools(m, i, cm, r, &next_call, e)) return -1;
        cJSON *c = field(m, "content");
        snprintf(param, sizeof param, "messages[%d].content", i);
        if (!c) {
            if (strcmp(cm->role, "assistant") != 0)
                return oa_fail(e, param, "%s is required", param);
            cm->content = "";
        } else if (cJSON_IsString(c)) {
            cm->content = c->valuestring;
        } else if (cJSON_IsArray(c)) {
            cm->content = store;
            int j = 0;
            for (cJSON *p = c->child; p; p = p->next, j++) {
                cJSON *t = cJSON_IsObject(p) ? field(p, "type") : NULL;
                cJSON *tx = cJSON_IsObject(p) ? field(p, "text") : NULL;
                snprintf(param, sizeof param, "messages[%d].content[%d]", i, j);
                if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0)
                    return oa_fail(e, param,
                                   "%s: only text parts are supported ({\"type\": \"text\", "
                                   "\"text\": ...})",
                                   param);
                if (!cJSON_IsString(tx))
                    return oa_fail(e, param, "%s.text must be a string", param);
                size_t l = strlen(tx->valuestring);
                memcpy(store, tx->valuestring, l);
                store += l;
            }
            *store++ = 0;
        } else {
            return oa_fail(e, param, "%s must be a string or an array of text parts", param);
        }
    }
    chunkserve__v1__chat__init(&r->chat_msg);
    r->chat_msg.n_messages = (size_t)n;
    r->chat_msg.messages = r->msg_ptrs;
    r->n_prompts = 1;
    /* how the rendered chat ends (vLLM's two fields) */
    bool gen = true, cont = false;
    if (get_bool(o, "add_generation_prompt", &gen, e) ||
        get_bool(o, "continue_final_message", &cont, e))
        return -1;
    if (gen && cont && field(o, "add_generation_prompt"))
        return oa_fail(e, "continue_final_message",
                       "continue_final_message and add_generation_prompt cannot both be true");
    r->chat_msg.end = cont  ? CHUNKSERVE__V1__CHAT_END__CHAT_END_CONTINUE
                      : gen ? CHUNKSERVE__V1__CHAT_END__CHAT_END_GENERATION_PROMPT
                            : CHUNKSERVE__V1__CHAT_END__CHAT_END_CLOSED;
    return 0;
}

/* A token id list (JSON array of integers) into ids; param names it. */
static int parse_ids(const cJSON *a, Chunkserve__V1__TokenIds *ids, int32_t **store,
                     const char *param, oa_error *e) {
    int n = cJSON_GetArraySize(a);
    chunkserve__v1__token_ids__init(ids);
    *store = malloc((size_t)(n ? n : 1) * sizeof **store);
    if (!*store) return oa_fail(e, NULL, "out of memory");
    int i = 0;
    for (cJSON *t = a->child; t; t = t->next, i++) {
        if (!is_int(t) || t->valuedouble < 0 || t->valuedouble > INT32_MAX)
            return oa_fail(e, param, "%s[%d] must be a token id (a non-negative integer)", param,
                           i);
        (*store)[i] = (int32_t)t->valuedouble;
    }
    ids->n_ids = (size_t)n;
    ids->ids = *store;
    return 0;
}

/* prompt: a string, a list of strings, a list of token ids, or a list of
 * token id lists. Sets n_prompts; texts are left in json. */
static int parse_prompt(const cJSON *o, oa_request *r, oa_error *e) {
    cJSON *p = field(o, "prompt");
    if (!p) return oa_fail(e, "prompt", "prompt is required");
    if (cJSON_IsString(p)) {
        r->n_prompts = 1;
        return 0;
    }
    if (!cJSON_IsArray(p) || !p->child)
        return oa_fail(e, "prompt",
                       "prompt must be a string, a list of strings, a list of token ids or a list "
                       "of token id lists");
    int n = cJSON_GetArraySize(p);
    if (cJSON_IsNumber(p->child)) { /* one prompt of token ids */
        r->ids = calloc(1, sizeof *r->ids);
        r->id_store = calloc(1, sizeof *r->id_store);
        if (!r->ids || !r->id_store) return oa_fail(e, NULL, "out of memory");
        r->n_prompts = 1;
        return parse_ids(p, &r->ids[0], &r->id_store[0], "prompt", e);
    }
    if (n > OA_MAX_PROMPTS)
        return oa_fail(e, "prompt", "prompt has %d entries; at most %d are allowed", n,
                       OA_MAX_PROMPTS);
    bool lists = cJSON_IsArray(p->child);
    if (lists) {
        r->ids = calloc((size_t)n, sizeof *r->ids);
        r->id_store = calloc((size_t)n, sizeof *r->id_store);
        if (!r->ids || !r->id_store) return oa_fail(e, NULL, "out of memory");
        r->n_prompts = n; /* oa_request_free frees the lists parsed before an error */
    }
    int i = 0;
    char param[32];
    for (cJSON *it = p->child; it; it = it->next, i++) {
        snprintf(param, sizeof param, "prompt[%d]", i);
        if (lists ? !cJSON_IsArray(it) : !cJSON_IsString(it))
            return oa_fail(e, param, "%s must be a %s like the first entry", param,
                           lists ? "token id list" : "string");
        if (lists && parse_ids(it, &r->ids[i], &r->id_store[i], param, e)) return -1;
    }
    r->n_prompts = n;
    return 0;
}

/* stop: a string or a list of strings. */
static int parse_stop(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_request *r,
                      oa_error *e) {
    cJSON *st = field(o, "stop");
    if (!st) return 0;
    if (cJSON_IsString(st)) {
        r->stops = malloc(sizeof *r->stops);
        if (!r->stops) return oa_fail(e, NULL, "out of memory");
        r->stops[0] = st->valuestring;
        s->n_stop = 1;
    } else if (cJSON_IsArray(st)) {
        int n = cJSON_GetArraySize(st), i = 0;
        r->stops = malloc((size_t)(n ? n : 1) * sizeof *r->stops);
        if (!r->stops) return oa_fail(e, NULL, "out of memory");
        for (cJSON *it = st->child; it; it = it->next, i++) {
            if (!cJSON_IsString(it)) return oa_fail(e, "stop", "stop[%d] must be a string", i);
            r->stops[i] = it->valuestring;
        }
        s->n_stop = (size_t)n;
    } else {
        return oa_fail(e, "stop", "stop must be a string or a list of strings");
    }
    s->stop = r->stops;
    return 0;
}

static int parse_stop_ids(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_request *r,
                          oa_error *e) {
    cJSON *st = field(o, "stop_token_ids");
    if (!st) return 0;
    if (!cJSON_IsArray(st)) return oa_fail(e, "stop_token_ids", "stop_token_ids must be a list");
    int n = cJSON_GetArraySize(st), i = 0;
    r->stop_ids = malloc((size_t)(n ? n : 1) * sizeof *r->stop_ids);
    if (!r->stop_ids) return oa_fail(e, NULL, "out of memory");
    for (cJSON *it = st->child; it; it = it->next, i++) {
        if (!is_int(it) || it->valuedouble < 0 || it->valuedouble > INT32_MAX)
            return oa_fail(e, "stop_token_ids", "stop_token_ids[%d] must be a token id", i);
        r->stop_ids[i] = (int32_t)it->valuedouble;
    }
    s->n_stop_token_ids = (size_t)n;
    s->stop_token_ids = r->stop_ids;
    return 0;
}

/* A schema given as an object (or, as vLLM also takes, as JSON text) into
 * r->schema_text. */
static int schema_text(const cJSON *v, const char *param, oa_request *r, oa_error *e) {
    if (cJSON_IsString(v)) {
        r->structured.json_schema = v->valuestring;
    } else if (cJSON_IsObject(v) || cJSON_IsBool(v)) {
        if (!(r->schema_text = cJSON_PrintUnformatted(v))) {
            oa_fail(e, param, "out of memory");
            e->status = 500;
            return -1;
        }
        r->structured.json_schema = r->schema_text;
    } else {
        return oa_fail(e, param, "%s must be a JSON Schema (an object)", param);
    }
    r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_SCHEMA;
    return 0;
}

/* Choices: a non-empty array of strings, borrowed from r->json. */
static int choice_list(const cJSON *v, const char *param, oa_request *r, oa_error *e) {
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : 0;
    if (n < 1 || n > CS_GRAMMAR_MAX_CHOICES)
        return oa_fail(e, param, "%s must be an array of 1 to %d strings", param,
                       CS_GRAMMAR_MAX_CHOICES);
    if (!(r->choice_ptrs = calloc((size_t)n, sizeof *r->choice_ptrs))) {
        oa_fail(e, param, "out of memory");
        e->status = 500;
        return -1;
    }
    int i = 0;
    for (const cJSON *c = v->child; c; c = c->next) {
        if (!cJSON_IsString(c) || !c->valuestring[0])
            return oa_fail(e, param, "%s must list non-empty strings", param);
        r->choice_ptrs[i++] = c->valuestring;
    }
    r->choices.choices = r->choice_ptrs;
    r->choices.n_choices = (size_t)n;
    r->structured.choice = &r->choices;
    r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_CHOICE;
    return 0;
}

/* Structured outputs, from one of: OpenAI's response_format (json_object,
 * json_schema), vLLM's structured_outputs {json, regex, choice, json_object}
 * or its older guided_json / guided_regex / guided_choice. Compiled here so a
 * schema this server cannot follow is refused naming the field. */
static int parse_structured(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_request *r,
                            oa_error *e) {
    static const char *const sources[] = {"response_format", "structured_outputs", "guided_json",
                                          "guided_regex", "guided_choice"};
    const char *param = NULL;
    for (size_t i = 0; i < sizeof sources / sizeof *sources; i++) {
        const cJSON *v = field(o, sources[i]);
        if (!v) continue;
        if (!strcmp(sources[i], "response_format") && cJSON_IsObject(v)) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
            if (cJSON_IsString(t) && !strcmp(t->valuestring, "text") && !t->next && v->child == t)
                continue; /* the default */
        }
        if (param)
            return oa_fail(e, sources[i], "%s and %s both ask for a structured output; give one",
                           param, sources[i]);
        param = sources[i];
    }
    if (!param) return 0;
    r->structured = (Chunkserve__V1__StructuredOutput)CHUNKSERVE__V1__STRUCTURED_OUTPUT__INIT;
    r->choices = (Chunkserve__V1__Choices)CHUNKSERVE__V1__CHOICES__INIT;
    const cJSON *v = field(o, param);
    int rc = 0;
    if (!strcmp(param, "response_format")) {
        const cJSON *t = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "type") : NULL;
        if (!cJSON_IsString(t))
            return oa_fail(e, param,
                           "response_format must be an object with a type: text, "
                           "json_object or json_schema");
        for (const cJSON *it = v->child; it; it = it->next)
            if (strcmp(it->string, "type") && strcmp(it->string, "json_schema"))
                return oa_fail(e, param, "response_format.%s is not a field of response_format",
                               it->string);
        if (!strcmp(t->valuestring, "json_object")) {
            r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_OBJECT;
            r->structured.json_object = true;
        } else if (!strcmp(t->valuestring, "json_schema")) {
            const cJSON *js = cJSON_GetObjectItemCaseSensitive(v, "json_schema");
            if (!cJSON_IsObject(js))
                return oa_fail(e, param,
                               "response_format json_schema needs a json_schema object "
                               "with the schema");
            for (const cJSON *it = js->child; it; it = it->next)
                if (strcmp(it->string, "name") && strcmp(it->string, "schema") &&
                    strcmp(it->string, "strict") && strcmp(it->string, "description"))
                    return oa_fail(e, param,
                                   "response_format.json_schema.%s is not a field of it "
                                   "(name, description, schema, strict)",
                                   it->string);
            const cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict");
            if (strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict))
                return oa_fail(e, param, "response_format.json_schema.strict must be a boolean");
            const cJSON *sc = field(js, "schema");
            if (!sc) return oa_fail(e, param, "response_format.json_schema has no schema");
            rc = schema_text(sc, param, r, e);
        } else if (!strcmp(t->valuestring, "text")) {
            return 0; /* with other keys, refused above */
        } else {
            return oa_fail(e, param,
                           "response_format type '%s' is not supported (text, "
                           "json_object, json_schema)",
                           t->valuestring);
        }
    } else if (!strcmp(param, "structured_outputs")) {
        if (!cJSON_IsObject(v)) return oa_fail(e, param, "structured_outputs must be an object");
        const char *set = NULL;
        for (const cJSON *it = v->child; it; it = it->next) {
            if (cJSON_IsNull(it) || (cJSON_IsFalse(it) && !strcmp(it->string, "json_object")))
                continue;
            if (strcmp(it->string, "json") && strcmp(it->string, "regex") &&
                strcmp(it->string, "choice") && strcmp(it->string, "json_object"))
                return oa_fail(e, param,
                               "structured_outputs.%s is not supported (json, regex, "
                               "choice, json_object)",
                               it->string);
            if (set)
                return oa_fail(e, param, "structured_outputs sets both %s and %s; give one", set,
                               it->string);
            set = it->string;
            if (!strcmp(set, "json"))
                rc = schema_text(it, param, r, e);
            else if (!strcmp(set, "choice"))
                rc = choice_list(it, param, r, e);
            else if (!strcmp(set, "regex")) {
                if (!cJSON_IsString(it))
                    return oa_fail(e, param, "structured_outputs.regex must be a string");
                r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_REGEX;
                r->structured.regex = it->valuestring;
            } else if (cJSON_IsTrue(it)) {
                r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_OBJECT;
                r->structured.json_object = true;
            } else {
                return oa_fail(e, param, "structured_outputs.json_object must be a boolean");
            }
            if (rc) return rc;
        }
        if (!set) return 0;
    } else if (!strcmp(param, "guided_json")) {
        rc = schema_text(v, param, r, e);
    } else if (!strcmp(param, "guided_regex")) {
        if (!cJSON_IsString(v)) return oa_fail(e, param, "guided_regex must be a string");
        r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_REGEX;
        r->structured.regex = v->valuestring;
    } else {
        rc = choice_list(v, param, r, e);
    }
    if (rc) return rc;
    /* compiled once here for the error's field; the engine compiles its own */
    cs_structured sp = {0};
    switch (r->structured.kind_case) {
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_OBJECT:
        sp.kind = CS_STRUCTURED_JSON_OBJECT;
        break;
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_SCHEMA:
        sp = (cs_structured){.kind = CS_STRUCTURED_JSON_SCHEMA, .text = r->structured.json_schema};
        break;
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_REGEX:
        sp = (cs_structured){.kind = CS_STRUCTURED_REGEX, .text = r->structured.regex};
        break;
    default:
        sp = (cs_structured){.kind = CS_STRUCTURED_CHOICE,
                             .choices = (const char *const *)r->choice_ptrs,
                             .n_choices = (int32_t)r->choices.n_choices};
    }
    cs_grammar *g;
    if (cs_grammar_compile(&sp, &g)) return oa_fail(e, param, "%s", cs_last_error());
    cs_grammar_free(g);
    s->structured = &r->structured;
    return 0;
}

/* logit_bias: {"token id": bias, ...} into the two lists of the proto (ids
 * and ranges are checked with the rest of the sampling, in cs_wire). */
static int parse_logit_bias(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_request *r,
                            oa_error *e) {
    cJSON *lb = field(o, "logit_bias");
    if (!lb) return 0;
    if (!cJSON_IsObject(lb))
        return oa_fail(e, "logit_bias", "logit_bias must be an object of token id: bias");
    int n = cJSON_GetArraySize(lb), i = 0;
    r->bias_ids = malloc((size_t)(n ? n : 1) * sizeof *r->bias_ids);
    r->bias = malloc((size_t)(n ? n : 1) * sizeof *r->bias);
    if (!r->bias_ids || !r->bias) return oa_fail(e, NULL, "out of memory");
    for (cJSON *it = lb->child; it; it = it->next, i++) {
        char *end;
        long id = strtol(it->string, &end, 10);
        if (!it->string[0] || *end || id < 0 || id > INT32_MAX)
            return oa_fail(e, "logit_bias", "logit_bias key '%.40s' is not a token id", it->string);
        if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
            return oa_fail(e, "logit_bias", "logit_bias of token %ld must be a number", id);
        r->bias_ids[i] = (int32_t)id;
        r->bias[i] = (float)it->valuedouble;
    }
    s->n_logit_bias_ids = s->n_logit_bias_values = (size_t)n;
    s->logit_bias_ids = r->bias_ids;
    s->logit_bias_values = r->bias;
    return 0;
}

/* The scalar sampling fields OpenAI spells as the proto does, by their one
 * definition (chunkserve/sampling_fields.h): the JSON type, the field's
 * bounds, written into the proto field of the same name. */
static int parse_fields(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_error *e) {
    const ProtobufCMessageDescriptor *d = &chunkserve__v1__sampling_params__descriptor;
    for (size_t i = 0; i < cs_n_sampling_fields; i++) {
        const cs_sampling_field *f = &cs_sampling_fields[i];
        cJSON *it = f->openai ? field(o, f->openai) : NULL;
        if (!it) continue;
        const char *key = f->openai;
        double v;
        if (f->type == CS_FIELD_BOOL) {
            if (!cJSON_IsBool(it)) return oa_fail(e, key, "%s must be true or false", key);
            v = cJSON_IsTrue(it);
        } else if (f->type == CS_FIELD_INT) {
            if (!is_int(it) || fabs(it->valuedouble) > INT32_MAX)
                return oa_fail(e, key, "%s must be an integer", key);
            v = it->valuedouble;
            if ((f->flags & CS_FIELD_OFF_MINUS1) && v == -1) v = 0; /* vLLM's -1 = off */
        } else {
            if (!cJSON_IsNumber(it) || !(fabs(it->valuedouble) <= FLT_MAX))
                return oa_fail(e, key, "%s must be a number", key);
            v = it->valuedouble;
        }
        if (cs_sampling_field_check(f, v, "")) return oa_fail(e, key, "%s", cs_last_error());
        char *p = (char *)s + protobuf_c_message_descriptor_get_field_by_name(d, f->name)->offset;
        if (f->type == CS_FIELD_BOOL)
            *(protobuf_c_boolean *)p = v != 0;
        else if (f->type == CS_FIELD_INT)
            *(int32_t *)p = (int32_t)v;
        else
            *(float *)p = (float)v;
    }
    return 0;
}

/* Sampling shared by every choice (the seed is set per choice). The
 * table's fields, then what OpenAI's API says in its own shape. */
static int parse_sampling(const cJSON *o, oa_request *r, const cs_wire_model *wm,
                          Chunkserve__V1__SamplingParams *s, uint64_t *seed, bool *has_seed,
                          oa_error *e) {
    chunkserve__v1__sampling_params__init(s);
    const cs_model_config *cfg = cs_model_get_config(wm->model);
    if (parse_fields(o, s, e)) return -1;
    if (!field(o, "temperature")) s->temperature = 1.0f; /* OpenAI's default, */
    if (s->temperature > 2)                              /* and its bound */
        return oa_fail(e, "temperature", "temperature must be in [0, 2]; got %g", s->temperature);
    int64_t v = r->chat ? 0 : 16; /* completions: OpenAI's default of 16 tokens */
    if (get_int(o, "max_tokens", 1, cfg->ctx_len, &v, e)) return -1;
    if (r->chat && get_int(o, "max_completion_tokens", 1, cfg->ctx_len, &v, e)) return -1;
    s->max_tokens = (int32_t)v;
    bool skip = true;
    if (get_bool(o, "skip_special_tokens", &skip, e)) return -1;
    s->include_special = !skip;
    int64_t sd = 0;
    *has_seed = field(o, "seed") != NULL;
    if (get_int(o, "seed", -MAX_SAFE_INT, MAX_SAFE_INT, &sd, e)) return -1;
    *seed = (uint64_t)sd;
    /* logprobs: chat: a bool (+ top_logprobs 0..20); completions: 0..5 alternatives */
    int64_t top = 0;
    if (r->chat) {
        if (get_bool(o, "logprobs", &r->logprobs, e)) return -1;
        if (get_int(o, "top_logprobs", 0, CS_MAX_TOP_LOGPROBS, &top, e)) return -1;
        if (field(o, "top_logprobs") && !r->logprobs)
            return oa_fail(e, "top_logprobs", "top_logprobs needs logprobs set to true");
    } else {
        cJSON *lp = field(o, "logprobs");
        if (lp && cJSON_IsBool(lp)) return oa_fail(e, "logprobs", "logprobs must be an integer");
        top = -1;
        if (get_int(o, "logprobs", 0, 5, &top, e)) return -1;
        r->logprobs = top >= 0;
        if (top < 0) top = 0;
    }
    r->top_logprobs = (int32_t)top;
    s->logprobs = r->logprobs;
    s->top_logprobs = r->top_logprobs;
    if (parse_stop(o, s, r, e) || parse_stop_ids(o, s, r, e) || parse_logit_bias(o, s, r, e) ||
        parse_structured(o, s, r, e))
        return -1;
    return 0;
}

/* 404 model_not_found unless name is "" or names the model. */
static int check_model(const cs_wire_model *wm, const char *name, oa_error *e) {
    if (cs_wire_check_model(wm, name) == 0) return 0;
    oa_fail(e, "model", "The model '%s' does not exist (this server serves '%s')", name, wm->name);
    e->status = 404;
    e->code = "model_not_found";
    return -1;
}

/* The body (len bytes) as one JSON object with no key twice and nothing
 * after it, or NULL with *e filled. */
static cJSON *parse_object(const char *body, size_t len, oa_error *e) {
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!j) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        oa_fail(e, NULL, "the body is not valid JSON (at byte %zu)", at);
        return NULL;
    }
    const char *dup = NULL;
    for (const char *p = end; p < body + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
            oa_fail(e, NULL, "the body has data after its JSON value (at byte %zu)",
                    (size_t)(p - body));
            goto bad;
        }
    if (!cJSON_IsObject(j)) {
        oa_fail(e, NULL, "the body must be a JSON object");
        goto bad;
    }
    if ((dup = duplicate_key(j))) {
        oa_fail(e, dup, "the key '%s' appears twice in one object", dup);
        goto bad;
    }
    return j;
bad:
    cJSON_Delete(j);
    return NULL;
}

int oa_request_parse(const char *body, size_t len, bool chat, const cs_wire_model *wm,
                     oa_request *r, oa_error *e) {
    memset(r, 0, sizeof *r);
    r->chat = chat;
    if (!(r->json = parse_object(body, len, e))) return -1;
    const cJSON *o = r->json;
    if (check_fields(o, chat, e)) return -1;
    r->model = "";
    if (get_str(o, "model", &r->model, e)) return -1;
    if (check_model(wm, r->model, e)) return -1;
    if (get_bool(o, "stream", &r->stream, e)) return -1;
    cJSON *so = field(o, "stream_options");
    if (so) {
        if (!r->stream)
            return oa_fail(e, "stream_options",
                           "stream_options is only allowed when stream is true");
        if (!cJSON_IsObject(so))
            return oa_fail(e, "stream_options", "stream_options must be an object");
        for (const cJSON *it = so->child; it; it = it->next)
            if (strcmp(it->string, "include_usage") != 0 &&
                strcmp(it->string, "continuous_usage_stats") != 0)
                return oa_fail(e, "stream_options",
                               "stream_options.%s is not supported by this server", it->string);
        if (get_bool(so, "include_usage", &r->include_usage, e) ||
            get_bool(so, "continuous_usage_stats", &r->continuous_usage, e))
            return -1;
        r->continuous_usage &= r->include_usage; /* vLLM: usage in every chunk needs both */
    }
    if (get_bool(o, "echo", &r->echo, e)) return -1;
    if (get_bool(o, "return_tokens_as_token_ids", &r->tokens_as_ids, e)) return -1;
    if (get_str(o, "request_id", &r->request_id, e)) return -1;
    if (r->request_id && cs_wire_check_request_id(r->request_id))
        return oa_fail(e, "request_id", "%s", cs_last_error());
    int64_t n = 1;
    if (get_int(o, "n", 1, OA_MAX_N, &n, e)) return -1;
    r->n = (int32_t)n;
    const char *user = NULL;
    if (get_str(o, "user", &user, e)) return -1;
    const char *salt = NULL; /* vLLM's field: the prefix cache's namespace (a tenant) */
    if (get_str(o, "cache_salt", &salt, e)) return -1;
    if (chat ? oa_parse_messages(o, r, e) : parse_prompt(o, r, e)) return -1;

    Chunkserve__V1__SamplingParams base;
    uint64_t seed = 0;
    bool has_seed = false;
    if (parse_sampling(o, r, wm, &base, &seed, &has_seed, e)) return -1;
    if (chat && oa_parse_tools(o, &base, r, e)) return -1;
    if (r->tool_mode != OA_TOOLS_OFF && r->logprobs && r->stream)
        return oa_fail(e, "logprobs",
                       "logprobs in a streamed answer that is read for tool calls are not "
                       "supported (ask without stream, or with tool_choice none)");
    /* prompt_logprobs: vLLM's (an integer: alternatives per prompt token) */
    r->prompt_logprobs = -1;
    cJSON *pl = field(o, "prompt_logprobs");
    if (pl && is_int(pl) && pl->valuedouble == -1)
        return oa_fail(e, "prompt_logprobs",
                       "prompt_logprobs -1 (the whole vocabulary) is not served; ask 0 to %d "
                       "alternatives",
                       CS_MAX_TOP_LOGPROBS);
    int64_t pk = -1;
    if (get_int(o, "prompt_logprobs", 0, CS_MAX_TOP_LOGPROBS, &pk, e)) return -1;
    r->prompt_logprobs = (int32_t)pk;
    if (r->prompt_logprobs >= 0 && r->stream) /* as vLLM */
        return oa_fail(e, "prompt_logprobs", "prompt_logprobs are not available when stream=true");
    /* completions' echo with logprobs: the prompt's tokens come first, with theirs */
    r->echo_logprobs = r->echo && r->logprobs && !chat;
    int32_t plp_top = r->prompt_logprobs;
    if (r->echo_logprobs && r->top_logprobs > plp_top) plp_top = r->top_logprobs;
    if (!has_seed && getrandom(&seed, sizeof seed, 0) != (ssize_t)sizeof seed)
        return oa_fail(e, NULL, "no randomness for the seed");
    r->n_choices = r->n * r->n_prompts;
    r->req = calloc((size_t)r->n_choices, sizeof *r->req);
    r->sampling = calloc((size_t)r->n_choices, sizeof *r->sampling);
    if (!r->req || !r->sampling) return oa_fail(e, NULL, "out of memory");
    cJSON *prompt = chat ? NULL : field(o, "prompt");
    for (int32_t i = 0; i < r->n_choices; i++) {
        int32_t p = i / r->n;
        Chunkserve__V1__GenerateRequest *q = &r->req[i];
        chunkserve__v1__generate_request__init(q);
        q->model = (char *)r->model;
        if (r->request_id) q->request_id = (char *)r->request_id; /* checked by cs_wire */
        if (salt) q->cache_salt = (char *)salt; /* checked with the rest (cs_wire) */
        r->sampling[i] = base;
        r->sampling[i].seed = seed + (uint64_t)(i % r->n); /* each choice its own stream */
        if (plp_top >= 0 && i % r->n == 0) {               /* a prompt's first choice brings them */
            r->sampling[i].prompt_logprobs = true;
            r->sampling[i].prompt_top_logprobs = plp_top;
        }
        q->sampling = &r->sampling[i];
        if (chat) {
            q->input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_CHAT;
            q->chat = &r->chat_msg;
        } else if (r->ids) {
            q->input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
            q->token_ids = &r->ids[p];
        } else {
            q->input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_PROMPT;
            q->prompt = cJSON_IsString(prompt) ? prompt->valuestring
                                               : cJSON_GetArrayItem(prompt, p)->valuestring;
        }
    }
    return 0;
}

void oa_request_free(oa_request *r) {
    if (r->id_store)
        for (int32_t i = 0; i < r->n_prompts; i++)
            free(r->id_store[i]);
    free(r->id_store);
    free(r->ids);
    free(r->msgs);
    free(r->msg_ptrs);
    free(r->text_store);
    free(r->stops);
    free(r->stop_ids);
    free(r->bias_ids);
    free(r->bias);
    free(r->tenant);
    free(r->schema_text);
    free(r->choice_ptrs);
    for (size_t i = 0; r->tool_texts && i < r->n_tools; i++)
        free(r->tool_texts[i]);
    free(r->tool_texts);
    free(r->tool_names);
    free(r->calls);
    free(r->call_ptrs);
    free(r->req);
    free(r->sampling);
    cJSON_Delete(r->json);
    memset(r, 0, sizeof *r);
}

static int check_only(const cJSON *o, const char *const *names, size_t n, oa_error *e) {
    for (const cJSON *it = o->child; it; it = it->next) {
        size_t i = 0;
        while (i < n && strcmp(names[i], it->string) != 0)
            i++;
        if (i == n)
            return oa_fail(e, it->string, "Unrecognized request argument supplied: %s", it->string);
    }
    return 0;
}

char *oa_tokenize(const char *body, size_t len, const cs_wire_model *wm, oa_error *e) {
    static const char *const names[] = {"model",
                                        "prompt",
                                        "messages",
                                        "add_special_tokens",
                                        "add_generation_prompt",
                                        "continue_final_message",
                                        "tools"};
    oa_request r = {0};
    char *out = NULL, *text = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    const char *model = "", *prompt = NULL;
    bool add_special = true;
    if (!(r.json = parse_object(body, len, e)) ||
        check_only(r.json, names, sizeof names / sizeof names[0], e) ||
        get_str(r.json, "model", &model, e) ||
        get_bool(r.json, "add_special_tokens", &add_special, e) ||
        get_str(r.json, "prompt", &prompt, e))
        goto done;
    if (check_model(wm, model, e)) goto done;
    if (!prompt == !field(r.json, "messages")) {
        oa_fail(e, "prompt", "give either prompt (a string) or messages");
        goto done;
    }
    if (!prompt) {
        Chunkserve__V1__SamplingParams none = CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;
        if (oa_parse_messages(r.json, &r, e) || oa_parse_tools(r.json, &none, &r, e)) goto done;
        if (cs_wire_render_chat(wm, &r.chat_msg, &text)) {
            oa_fail(e, "messages", "%s", cs_last_error());
            goto done;
        }
        prompt = text;
    }
    if (cs_tokenizer_encode(cs_model_tokenizer(wm->model), prompt, strlen(prompt), true,
                            add_special, &ids, &n)) {
        oa_fail(e, text ? "messages" : "prompt", "%s", cs_last_error());
        goto done;
    }
    cJSON *j = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(j, "tokens");
    cJSON_AddNumberToObject(j, "count", (double)n);
    cJSON_AddNumberToObject(j, "max_model_len", cs_model_get_config(wm->model)->ctx_len);
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    cJSON_AddNullToObject(j, "token_strs");
    out = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!out) oa_fail(e, NULL, "out of memory");
done:
    free(ids);
    free(text);
    oa_request_free(&r);
    return out;
}

char *oa_detokenize(const char *body, size_t len, const cs_wire_model *wm, oa_error *e) {
    static const char *const names[] = {"model", "tokens"};
    cJSON *o = parse_object(body, len, e);
    char *out = NULL, *text = NULL;
    Chunkserve__V1__TokenIds ids = CHUNKSERVE__V1__TOKEN_IDS__INIT;
    int32_t *store = NULL;
    const char *model = "";
    const cs_tokenizer *tok = cs_model_tokenizer(wm->model);
    if (!o || check_only(o, names, sizeof names / sizeof names[0], e) ||
        get_str(o, "model", &model, e))
        goto done;
    if (check_model(wm, model, e)) goto done;
    cJSON *t = field(o, "tokens");
    if (!cJSON_IsArray(t)) {
        oa_fail(e, "tokens", "tokens must be a list of token ids");
        goto done;
    }
    if (parse_ids(t, &ids, &store, "tokens", e)) goto done;
    size_t n; /* the decoder refuses ids outside the vocabulary, naming them */
    if (cs_tokenizer_decode(tok, ids.ids, ids.n_ids, false, &text, &n)) {
        oa_fail(e, "tokens", "%s", cs_last_error());
        goto done;
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prompt", text);
    out = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!out) oa_fail(e, NULL, "out of memory");
done:
    free(store);
    free(text);
    cJSON_Delete(o);
    return out;
}
