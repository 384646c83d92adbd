/* tools.c: function calling on /v1/chat/completions (docs/tools.md).
 *
 * The tools go into the prompt through the model's chat template (Chat.tools;
 * the engine renders them), and the answer is read back as tool calls:
 *   auto      the model's own <tool_call>{"name": ..., "arguments": ...}</tool_call>
 *             blocks (Qwen2.5 / Hermes form), if it writes any; else an answer that
 *             is nothing but such an object (or a list of them), bare or in one
 *             ``` fence, naming one of the tools (small models write that);
 *   required  decoding constrained to a JSON array of {"name", "parameters"}
 *             objects, one per call (vLLM's form), at least one;
 *   named     decoding constrained to that function's parameters schema: the
 *             whole answer is its arguments.
 * Constrained forms always parse (structured outputs, chunkserve/grammar.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "chunkserve/error.h"
#include "chunkserve/grammar.h"
#include "openai-impl.h"

#define MAX_TOOLS 128

static const char OPEN_TAG[] = "<tool_call>", CLOSE_TAG[] = "</tool_call>";

static bool good_name(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64) return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '_' || *s == '-' || *s == '.'))
            return false;
    return true;
}

static const cJSON *fn_of(const cJSON *tool) {
    return cJSON_GetObjectItemCaseSensitive(tool, "function");
}

/* Local references of tool i's parameters, rewritten to where they live in
 * the required-mode schema: "#" and "#/$defs/X" (or definitions) become
 * "#/$defs/tI_" and "#/$defs/tI_X". Returns whether there were any. */
static bool rewrite_refs(cJSON *v, int i) {
    bool any = false;
    for (cJSON *it = v ? v->child : NULL; it; it = it->next) {
        if (it->string && !strcmp(it->string, "$ref") && cJSON_IsString(it)) {
            const char *r = it->valuestring, *name = NULL;
            if (!strncmp(r, "#/$defs/", 8)) name = r + 8;
            else if (!strncmp(r, "#/definitions/", 14)) name = r + 14;
            else if (strcmp(r, "#")) continue; /* not local: the compiler refuses it */
            char buf[300];
            snprintf(buf, sizeof buf, "#/$defs/t%d_%.256s", i, name ? name : "");
            cJSON_SetValuestring(it, buf);
            any = true;
        } else {
            any |= rewrite_refs(it, i);
        }
    }
    return any;
}

/* Tool i's parameters for the required-mode schema (a copy); its definitions
 * move to defs under "tI_" names, and the parameters too when they refer to
 * anything (then the copy is a reference to them). */
static cJSON *required_params(const cJSON *p, int i, cJSON *defs) {
    if (!p || cJSON_IsNull(p)) return cJSON_Parse("{\"type\":\"object\",\"properties\":{}}");
    cJSON *copy = cJSON_Duplicate(p, true);
    char name[300];
    for (const char *key = "$defs"; key; key = strcmp(key, "$defs") ? NULL : "definitions") {
        cJSON *d = cJSON_DetachItemFromObjectCaseSensitive(copy, key);
        for (cJSON *it = d ? d->child : NULL; it;) {
            cJSON *next = it->next;
            snprintf(name, sizeof name, "t%d_%.256s", i, it->string);
            cJSON *moved = cJSON_DetachItemViaPointer(d, it);
            rewrite_refs(moved, i);
            cJSON_AddItemToObject(defs, name, moved);
            it = next;
        }
        cJSON_Delete(d);
    }
    if (!rewrite_refs(copy, i)) return copy;
    snprintf(name, sizeof name, "t%d_", i);
    cJSON_AddItemToObject(defs, name, copy);
    cJSON *ref = cJSON_CreateObject();
    snprintf(name, sizeof name, "#/$defs/t%d_", i);
    cJSON_AddStringToObject(ref, "$ref", name);
    return ref;
}

/* The schema the answer must follow for required / named. */
static char *constraint(const cJSON *tools, oa_request *r) {
    cJSON *root = NULL;
    if (r->tool_mode == OA_TOOLS_NAMED) {
        for (const cJSON *t = tools->child; t; t = t->next) {
            const cJSON *f = fn_of(t);
            if (strcmp(cJSON_GetObjectItemCaseSensitive(f, "name")->valuestring, r->tool_name))
                continue;
            const cJSON *p = cJSON_GetObjectItemCaseSensitive(f, "parameters");
            root = p && !cJSON_IsNull(p) ? cJSON_Duplicate(p, true)
                                         : cJSON_Parse("{\"type\":\"object\",\"properties\":{}}");
        }
    } else {
        root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "type", "array");
        cJSON_AddNumberToObject(root, "minItems", 1);
        if (!r->parallel_tools) cJSON_AddNumberToObject(root, "maxItems", 1);
        cJSON *any = cJSON_AddArrayToObject(cJSON_AddObjectToObject(root, "items"), "anyOf");
        cJSON *defs = cJSON_AddObjectToObject(root, "$defs");
        int i = 0;
        for (const cJSON *t = tools->child; t; t = t->next, i++) {
            const cJSON *f = fn_of(t);
            const cJSON *p = cJSON_GetObjectItemCaseSensitive(f, "parameters");
            cJSON *o = cJSON_CreateObject(), *props;
            cJSON_AddStringToObject(o, "type", "object");
            props = cJSON_AddObjectToObject(o, "properties");
            cJSON *nm = cJSON_AddObjectToObject(props, "name");
            cJSON_AddStringToObject(nm, "type", "string");
            cJSON *en = cJSON_AddArrayToObject(nm, "enum");
            cJSON_AddItemToArray(en, cJSON_CreateString(
                                         cJSON_GetObjectItemCaseSensitive(f, "name")->valuestring));
            cJSON_AddItemToObject(props, "parameters", required_params(p, i, defs));
            cJSON *req = cJSON_AddArrayToObject(o, "required");
            cJSON_AddItemToArray(req, cJSON_CreateString("name"));
            cJSON_AddItemToArray(req, cJSON_CreateString("parameters"));
            cJSON_AddItemToArray(any, o);
        }
    }
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return s;
}

int oa_parse_tools(const cJSON *o, Chunkserve__V1__SamplingParams *s, oa_request *r,
                   oa_error *e) {
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(o, "tools");
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(o, "tool_choice");
    const cJSON *par = cJSON_GetObjectItemCaseSensitive(o, "parallel_tool_calls");
    if (cJSON_IsNull(tools) || (cJSON_IsArray(tools) && !tools->child)) tools = NULL;
    if (cJSON_IsNull(choice)) choice = NULL;
    r->parallel_tools = true;
    if (par && !cJSON_IsNull(par)) {
        if (!cJSON_IsBool(par))
            return oa_fail(e, "parallel_tool_calls", "parallel_tool_calls must be a boolean");
        r->parallel_tools = cJSON_IsTrue(par);
    }
    if (!tools) {
        if (choice && !(cJSON_IsString(choice) && !strcmp(choice->valuestring, "none")))
            return oa_fail(e, "tool_choice", "tool_choice is only allowed when tools are given");
        return 0;
    }
    if (!cJSON_IsArray(tools)) return oa_fail(e, "tools", "tools must be an array");
    int n = cJSON_GetArraySize(tools);
    if (n > MAX_TOOLS) return oa_fail(e, "tools", "at most %d tools are allowed", MAX_TOOLS);
    r->tool_texts = calloc((size_t)n, sizeof *r->tool_texts);
    r->tool_names = calloc((size_t)n, sizeof *r->tool_names);
    if (!r->tool_texts || !r->tool_names) return oa_fail(e, "tools", "out of memory");
    int i = 0;
    for (const cJSON *t = tools->child; t; t = t->next, i++) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *f = cJSON_IsObject(t) ? fn_of(t) : NULL;
        const cJSON *name = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "name") : NULL;
        const cJSON *params = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "parameters")
                                                : NULL;
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "function"))
            return oa_fail(e, "tools", "tools[%d].type must be \"function\"", i);
        if (!cJSON_IsString(name) || !good_name(name->valuestring))
            return oa_fail(e, "tools",
                           "tools[%d].function.name must be 1 to 64 of a-z, A-Z, 0-9, _, -, .", i);
        if (params && !cJSON_IsNull(params) && !cJSON_IsObject(params))
            return oa_fail(e, "tools", "tools[%d].function.parameters must be a JSON Schema object",
                           i);
        for (const cJSON *u = tools->child; u != t; u = u->next)
            if (!strcmp(cJSON_GetObjectItemCaseSensitive(fn_of(u), "name")->valuestring,
                        name->valuestring))
                return oa_fail(e, "tools", "two tools are named '%s'", name->valuestring);
        if (!(r->tool_texts[i] = cJSON_PrintUnformatted(t)))
            return oa_fail(e, "tools", "out of memory");
        r->tool_names[i] = name->valuestring;
        r->n_tools = (size_t)i + 1;
    }
    r->tool_mode = OA_TOOLS_AUTO;
    if (cJSON_IsString(choice)) {
        const char *c = choice->valuestring;
        if (!strcmp(c, "none")) r->tool_mode = OA_TOOLS_OFF;
        else if (!strcmp(c, "required")) r->tool_mode = OA_TOOLS_REQUIRED;
        else if (strcmp(c, "auto"))
            return oa_fail(e, "tool_choice", "tool_choice '%s' is not one of none, auto, required, "
                                             "or {\"type\": \"function\", \"function\": {\"name\"}}", c);
    } else if (choice) {
        const cJSON *f = cJSON_IsObject(choice) ? fn_of(choice) : NULL;
        const cJSON *nm = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "name") : NULL;
        if (!cJSON_IsString(nm))
            return oa_fail(e, "tool_choice", "tool_choice must be none, auto, required, or "
                                             "{\"type\": \"function\", \"function\": {\"name\"}}");
        r->tool_name = nm->valuestring;
        bool found = false;
        for (const cJSON *t = tools->child; t; t = t->next)
            found |= !strcmp(cJSON_GetObjectItemCaseSensitive(fn_of(t), "name")->valuestring,
                             r->tool_name);
        if (!found)
            return oa_fail(e, "tool_choice", "tool_choice names '%s', which is not in tools",
                           r->tool_name);
        r->tool_mode = OA_TOOLS_NAMED;
    }
    r->chat_msg.tools = r->tool_texts;
    r->chat_msg.n_tools = r->n_tools;
    if (r->tool_mode == OA_TOOLS_OFF || r->tool_mode == OA_TOOLS_AUTO) return 0;
    if (s->structured)
        return oa_fail(e, "tool_choice", "tool_choice %s constrains the answer; it cannot be "
                                         "combined with a structured output field",
                       r->tool_mode == OA_TOOLS_NAMED ? "naming a function" : "required");
    free(r->schema_text);
    if (!(r->schema_text = constraint(tools, r))) return oa_fail(e, "tools", "out of memory");
    cs_structured sp = {.kind = CS_STRUCTURED_JSON_SCHEMA, .text = r->schema_text};
    cs_grammar *g;
    if (cs_grammar_compile(&sp, &g)) return oa_fail(e, "tools", "%s", cs_last_error());
    cs_grammar_free(g);
    r->structured = (Chunkserve__V1__StructuredOutput)CHUNKSERVE__V1__STRUCTURED_OUTPUT__INIT;
    r->structured.kind_case = CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_SCHEMA;
    r->structured.json_schema = r->schema_text;
    s->structured = &r->structured;
    return 0;
}

int oa_parse_message_tools(const cJSON *m, int i, Chunkserve__V1__ChatMessage *cm, oa_request *r,
                           size_t *next, oa_error *e) {
    char param[96];
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(m, "tool_call_id");
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
    if (cJSON_IsNull(calls) || (cJSON_IsArray(calls) && !calls->child)) calls = NULL;
    if (!strcmp(cm->role, "tool")) {
        snprintf(param, sizeof param, "messages[%d].tool_call_id", i);
        if (id && !cJSON_IsString(id)) return oa_fail(e, param, "%s must be a string", param);
        if (id) cm->tool_call_id = id->valuestring;
    }
    if (!calls) return 0;
    snprintf(param, sizeof param, "messages[%d].tool_calls", i);
    if (strcmp(cm->role, "assistant"))
        return oa_fail(e, param, "%s: only assistant messages carry tool calls", param);
    if (!cJSON_IsArray(calls)) return oa_fail(e, param, "%s must be an array", param);
    cm->tool_calls = r->call_ptrs + *next;
    int k = 0;
    for (const cJSON *c = calls->child; c; c = c->next, k++) {
        snprintf(param, sizeof param, "messages[%d].tool_calls[%d]", i, k);
        const cJSON *f = cJSON_IsObject(c) ? fn_of(c) : NULL;
        const cJSON *nm = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "name") : NULL;
        const cJSON *args = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "arguments")
                                              : NULL;
        const cJSON *cid = cJSON_IsObject(c) ? cJSON_GetObjectItemCaseSensitive(c, "id") : NULL;
        if (!cJSON_IsString(nm) || !nm->valuestring[0] || !cJSON_IsString(args))
            return oa_fail(e, param, "%s needs function.name and function.arguments (a string "
                                     "holding a JSON object)", param);
        cJSON *parsed = cJSON_Parse(args->valuestring);
        bool ok = cJSON_IsObject(parsed);
        cJSON_Delete(parsed);
        if (!ok)
            return oa_fail(e, param, "%s.function.arguments is not a JSON object", param);
        Chunkserve__V1__ToolCall *tc = &r->calls[*next];
        chunkserve__v1__tool_call__init(tc);
        tc->name = nm->valuestring;
        tc->arguments = args->valuestring;
        tc->id = cJSON_IsString(cid) ? cid->valuestring : (char *)"";
        r->call_ptrs[(*next)++] = tc;
    }
    cm->n_tool_calls = (size_t)k;
    return 0;
}

/* One call of OpenAI's tool_calls. */
static void add_call(cJSON *arr, const char *name, const cJSON *args_obj, const char *args_text) {
    char id[40];
    unsigned char rnd[12] = {0};
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) { /* ids need not be secret */
        static unsigned counter;
        memcpy(rnd, &counter, sizeof counter), counter++;
    }
    int n = snprintf(id, sizeof id, "call_");
    for (size_t i = 0; i < sizeof rnd; i++)
        n += snprintf(id + n, sizeof id - (size_t)n, "%02x", rnd[i]);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "id", id);
    cJSON_AddStringToObject(c, "type", "function");
    cJSON *f = cJSON_AddObjectToObject(c, "function");
    cJSON_AddStringToObject(f, "name", name);
    char *a = args_obj ? cJSON_PrintUnformatted(args_obj) : NULL;
    cJSON_AddStringToObject(f, "arguments", a ? a : args_text ? args_text : "{}");
    free(a);
    cJSON_AddItemToArray(arr, c);
}

static bool is_tool(const oa_request *r, const char *name) {
    for (size_t i = 0; i < r->n_tools; i++)
        if (!strcmp(r->tool_names[i], name)) return true;
    return false;
}

static const char *skip_space(const char *p) {
    while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')
        p++;
    return p;
}

/* A JSON array (taken) of {"name": a tool, "arguments" or "parameters": an
 * object} as calls; NULL unless every entry is one. */
static cJSON *list_calls(const oa_request *r, cJSON *j) {
    if (!cJSON_IsArray(j) || !j->child) {
        cJSON_Delete(j);
        return NULL;
    }
    cJSON *arr = cJSON_CreateArray();
    for (const cJSON *c = j->child; c && arr; c = c->next) {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(c, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(c, "arguments");
        if (!args) args = cJSON_GetObjectItemCaseSensitive(c, "parameters");
        if (!cJSON_IsString(nm) || !is_tool(r, nm->valuestring) || !cJSON_IsObject(args)) {
            cJSON_Delete(arr);
            arr = NULL;
            break;
        }
        add_call(arr, nm->valuestring, args, NULL);
    }
    cJSON_Delete(j);
    return arr;
}

/* A whole answer that is one call object or a list of them, bare or in a
 * ``` fence (```json), each naming a tool, with object "arguments" (or
 * "parameters"). */
static cJSON *bare_calls(const oa_request *r, const char *text) {
    const char *p = skip_space(text), *end = p + strlen(p);
    while (end > p && (end[-1] == ' ' || end[-1] == '\n' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    if (end - p >= 6 && !strncmp(p, "```", 3) && !strncmp(end - 3, "```", 3)) {
        p += 3;
        while (p < end && *p != '\n') /* the fence's language tag */
            p++;
        end -= 3;
        if (p > end) p = end; /* a one-line fence ("```{}```"): nothing inside */
    }
    cJSON *j = cJSON_ParseWithLength(p, (size_t)(end - p));
    if (cJSON_IsObject(j)) {
        cJSON *a = cJSON_CreateArray();
        cJSON_AddItemToArray(a, j);
        j = a;
    }
    return list_calls(r, j);
}

/* Auto: every <tool_call>...</tool_call> block a JSON object with a string
 * "name" (and "arguments"); any block that is not makes the text content. */
static cJSON *auto_calls(const oa_request *r, const char *text, size_t *content_len) {
    const char *first = strstr(text, OPEN_TAG);
    if (!first) {
        cJSON *bare = bare_calls(r, text);
        if (bare) *content_len = 0;
        return bare;
    }
    cJSON *arr = cJSON_CreateArray();
    for (const char *p = first; p && arr; p = strstr(p, OPEN_TAG)) {
        const char *body = p + sizeof OPEN_TAG - 1, *end = strstr(body, CLOSE_TAG);
        const char *stop = end ? end : body + strlen(body);
        cJSON *j = cJSON_ParseWithLength(body, (size_t)(stop - body));
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(j, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(j, "arguments");
        if (!cJSON_IsObject(j) || !cJSON_IsString(nm) || (args && !cJSON_IsObject(args))) {
            cJSON_Delete(j);
            cJSON_Delete(arr);
            return NULL;
        }
        add_call(arr, nm->valuestring, args, NULL);
        cJSON_Delete(j);
        p = end ? end + sizeof CLOSE_TAG - 1 : NULL;
    }
    size_t n = (size_t)(first - text);
    while (n && (text[n - 1] == '\n' || text[n - 1] == ' '))
        n--;
    *content_len = n;
    return arr;
}

cJSON *oa_tool_calls(const oa_request *r, const char *text, size_t *content_len) {
    *content_len = strlen(text);
    if (r->tool_mode == OA_TOOLS_AUTO) return auto_calls(r, text, content_len);
    if (r->tool_mode == OA_TOOLS_NAMED) {
        cJSON *arr = cJSON_CreateArray();
        if (arr) add_call(arr, r->tool_name, NULL, text);
        *content_len = 0;
        return arr;
    }
    if (r->tool_mode != OA_TOOLS_REQUIRED) return NULL;
    /* cut by max_tokens: not JSON, the text stays content */
    cJSON *arr = list_calls(r, cJSON_Parse(text));
    if (arr) *content_len = 0;
    return arr;
}

size_t oa_tool_visible(const char *text, size_t len, bool *in_call) {
    const char *at = strstr(text, OPEN_TAG);
    *in_call = at != NULL;
    const char *p = skip_space(text); /* may be a bare call: held to the end */
    if (*p == '{' || *p == '[' || *p == '`') return 0;
    if (!*p) return 0;
    size_t n = at ? (size_t)(at - text) : len;
    /* hold back a tail that could be the start of the tag */
    for (size_t k = sizeof OPEN_TAG - 2; !at && k > 0; k--)
        if (k <= len && !memcmp(text + len - k, OPEN_TAG, k)) {
            n = len - k;
            break;
        }
    /* and the spaces and line breaks before it, which the content loses
     * when a call follows (as auto_calls trims them) */
    while (n && (text[n - 1] == '\n' || text[n - 1] == ' '))
        n--;
    return n;
}
