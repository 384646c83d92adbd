/* chat.c: cs_tokenizer_apply_chat for the chat template families recognised
 * from the model's template text: ChatML (SmolLM2, Qwen2; including the
 * default system message such templates insert), Llama-3 and Gemma
 * (<start_of_turn>; cs__gemma_chat_template for GGUF files without one). The output is
 * byte-for-byte what jinja2 renders from those templates. This is not a
 * Jinja interpreter: any other template is CS_ENOTSUP. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "tokenizer-impl.h"
#include "unicode.h"
#include "util.h"

typedef struct {
    char *p;
    size_t n, cap;
} sbuf;

static int sb_add(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return cs_fail(CS_ENOMEM, "chat: out of memory");
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n); /* s may be NULL when n is 0 (an empty literal) */
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static int sb_adds(sbuf *b, const char *s) {
    return sb_add(b, s, strlen(s));
}

/* Unescapes a Jinja string literal body (\n, \t, \r, \\, \', \"; other
 * escapes stay as written, like Python's). */
static int sb_add_unescaped(sbuf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '\\' && i + 1 < n) {
            char e = s[i + 1], r = 0;
            switch (e) {
            case 'n': r = '\n'; break;
            case 't': r = '\t'; break;
            case 'r': r = '\r'; break;
            case '\\':
            case '\'':
            case '"': r = e; break;
            default: break;
            }
            if (r) {
                i++;
                c = r;
            }
        }
        int rc = sb_add(b, &c, 1);
        if (rc) return rc;
    }
    return 0;
}

/* ChatML templates that add a system message when the conversation has none
 * (SmolLM2: `{% if loop.first and messages[0]['role'] != 'system' %}`) carry
 * its text in a string literal '<|im_start|>system\n...<|im_end|>'. A
 * literal that closes right after "system\n" is the template's own system
 * branch (+ message['content']), not a default. */
static int chatml_default_system(const char *tmpl, sbuf *out, bool *found) {
    static const char open[] = "<|im_start|>system";
    static const char close[] = "<|im_end|>";
    *found = false;
    for (const char *p = strstr(tmpl, open); p; p = strstr(p + 1, open)) {
        if (p == tmpl || (p[-1] != '\'' && p[-1] != '"')) continue;
        char quote = p[-1];
        const char *s = p + sizeof open - 1;
        if (s[0] == '\n') {
            s += 1;
        } else if (s[0] == '\\' && s[1] == 'n') {
            s += 2;
        } else {
            continue;
        }
        const char *e = s;
        while (*e && *e != quote && strncmp(e, close, sizeof close - 1) != 0)
            e += *e == '\\' && e[1] ? 2 : 1;
        if (strncmp(e, close, sizeof close - 1) != 0) continue;
        *found = true;
        return sb_add_unescaped(out, s, (size_t)(e - s));
    }
    return 0;
}

/* Python's str.strip() (Jinja's |trim) over UTF-8. */
static void py_strip(const char *s, size_t n, size_t *start, size_t *end) {
    const uint8_t *u = (const uint8_t *)s;
    size_t a = 0, b = n;
    while (a < b) {
        uint32_t cp;
        int k = cs__utf8_decode(u + a, b - a, &cp);
        if (k <= 0 || !(cs__unicode_flags(cp) & CS_UFLAG_PYSPACE)) break;
        a += (size_t)k;
    }
    while (b > a) {
        size_t c = b - 1;
        while (c > a && (u[c] & 0xC0) == 0x80)
            c--;
        uint32_t cp;
        int k = cs__utf8_decode(u + c, b - c, &cp);
        if (k <= 0 || !(cs__unicode_flags(cp) & CS_UFLAG_PYSPACE)) break;
        b = c;
    }
    *start = a;
    *end = b;
}

/* JSON as Python's json.dumps(x, ensure_ascii=False) writes it (what the
 * templates' tojson filter prints): ", " and ": " separators, only '"', '\\'
 * and control characters escaped. Numbers: integral values as integers
 * (cJSON does not keep whether the text said 1 or 1.0), others in the
 * shortest form that reads back. */
static int py_str(sbuf *b, const char *s) {
    int rc = sb_add(b, "\"", 1);
    for (; !rc && *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        const char *e = NULL;
        switch (c) {
        case '"': e = "\\\""; break;
        case '\\': e = "\\\\"; break;
        case '\n': e = "\\n"; break;
        case '\r': e = "\\r"; break;
        case '\t': e = "\\t"; break;
        case '\b': e = "\\b"; break;
        case '\f': e = "\\f"; break;
        default:
            if (c < 0x20) snprintf(esc, sizeof esc, "\\u%04x", c), e = esc;
        }
        rc = e ? sb_adds(b, e) : sb_add(b, (const char *)&c, 1);
    }
    return rc ? rc : sb_add(b, "\"", 1);
}

static int py_json(sbuf *b, const cJSON *v, int depth) {
    if (depth > 64) return cs_fail(CS_EINVAL, "chat: JSON nested more than 64 deep");
    int rc = 0;
    if (cJSON_IsObject(v) || cJSON_IsArray(v)) {
        bool obj = cJSON_IsObject(v);
        rc = sb_add(b, obj ? "{" : "[", 1);
        for (const cJSON *it = v->child; !rc && it; it = it->next) {
            if (it != v->child) rc = sb_adds(b, ", ");
            if (!rc && obj) rc = py_str(b, it->string);
            if (!rc && obj) rc = sb_adds(b, ": ");
            if (!rc) rc = py_json(b, it, depth + 1);
        }
        return rc ? rc : sb_add(b, obj ? "}" : "]", 1);
    }
    if (cJSON_IsString(v)) return py_str(b, v->valuestring);
    if (cJSON_IsTrue(v)) return sb_adds(b, "true");
    if (cJSON_IsFalse(v)) return sb_adds(b, "false");
    if (cJSON_IsNull(v)) return sb_adds(b, "null");
    double x = v->valuedouble;
    char num[40];
    if (!isfinite(x)) return cs_fail(CS_EINVAL, "chat: a number that is not finite");
    if (x == floor(x) && fabs(x) < 1e16) {
        snprintf(num, sizeof num, "%.0f", x == 0 ? 0.0 : x); /* -0 read as an integer is 0 */
    } else {
        for (int p = 1; p <= 17; p++) {
            snprintf(num, sizeof num, "%.*g", p, x);
            if (strtod(num, NULL) == x) break;
        }
    }
    return sb_adds(b, num);
}

/* text, a JSON object, as py_json writes it. */
static int py_json_text(sbuf *b, const char *text, const char *what, size_t index) {
    cJSON *j = cJSON_Parse(text ? text : "");
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return cs_fail(CS_EINVAL, "chat: %s %zu is not a JSON object", what, index);
    }
    int rc = py_json(b, j, 0);
    cJSON_Delete(j);
    return rc;
}

static int check_messages(const cs_chat_message *msgs, size_t n_msgs) {
    if (n_msgs && !msgs) return cs_fail(CS_EINVAL, "chat: NULL messages");
    for (size_t i = 0; i < n_msgs; i++) {
        const char *r = msgs[i].role;
        if (!r || !msgs[i].content)
            return cs_fail(CS_EINVAL, "chat: message %zu has no role or content", i);
        if (strcmp(r, "system") != 0 && strcmp(r, "user") != 0 && strcmp(r, "assistant") != 0 &&
            strcmp(r, "tool") != 0)
            return cs_fail(CS_EINVAL,
                           "chat: message %zu has role '%.32s' (system, user, assistant, tool "
                           "supported)",
                           i, r);
        if (msgs[i].n_tool_calls && strcmp(r, "assistant") != 0)
            return cs_fail(CS_EINVAL, "chat: message %zu has tool calls but is not the assistant's",
                           i);
        for (size_t k = 0; k < msgs[i].n_tool_calls; k++) {
            const cs_chat_tool_call *tc = &msgs[i].tool_calls[k];
            if (!tc->name || !tc->name[0] || !tc->arguments ||
                !cs__utf8_valid((const uint8_t *)tc->name, strlen(tc->name)) ||
                !cs__utf8_valid((const uint8_t *)tc->arguments, strlen(tc->arguments)))
                return cs_fail(CS_EINVAL,
                               "chat: message %zu: tool call %zu needs a name and "
                               "arguments in UTF-8",
                               i, k);
        }
        if (!cs__utf8_valid((const uint8_t *)msgs[i].content, strlen(msgs[i].content)))
            return cs_fail(CS_EINVAL, "chat: message %zu is not valid UTF-8", i);
    }
    return 0;
}

/* The tools section of Qwen2.5's template (other ChatML templates get the same). */
static const char TOOLS_HEAD[] =
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char TOOLS_TAIL[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

/* ChatML (SmolLM2, Qwen2.5): Qwen2.5's template, whose tool branches other
 * ChatML templates lack; without tools and tool messages the two agree. */
static int render_chatml(const cs_tokenizer *tok, const cs_chat_message *msgs, size_t n_msgs,
                         const char *const *tools, size_t n_tools, cs_chat_end end, sbuf *b) {
    sbuf def = {0};
    bool has_def;
    int rc = chatml_default_system(tok->chat_template, &def, &has_def);
    bool first_system = n_msgs && !strcmp(msgs[0].role, "system");
    if (!rc && n_tools) { /* the system turn carries the tools */
        rc = sb_adds(b, "<|im_start|>system\n");
        if (!rc) rc = first_system ? sb_adds(b, msgs[0].content) : sb_add(b, def.p, def.n);
        if (!rc) rc = sb_adds(b, TOOLS_HEAD);
        for (size_t t = 0; !rc && t < n_tools; t++)
            if (!(rc = sb_adds(b, "\n"))) rc = py_json_text(b, tools[t], "tool", t);
        if (!rc) rc = sb_adds(b, TOOLS_TAIL);
    }
    for (size_t i = 0; rc == 0 && i < n_msgs; i++) {
        const cs_chat_message *m = &msgs[i];
        if (i == 0 && n_tools && first_system) continue;
        if (i == 0 && !n_tools && has_def && !first_system) {
            if ((rc = sb_adds(b, "<|im_start|>system\n")) || (rc = sb_add(b, def.p, def.n)) ||
                (rc = sb_adds(b, "<|im_end|>\n")))
                break;
        }
        bool open = end == CS_CHAT_CONTINUE && i + 1 == n_msgs;
        if (!strcmp(m->role, "tool")) { /* consecutive tool messages share one user turn */
            if ((i == 0 || strcmp(msgs[i - 1].role, "tool")) &&
                (rc = sb_adds(b, "<|im_start|>user")))
                break;
            if ((rc = sb_adds(b, "\n<tool_response>\n")) || (rc = sb_adds(b, m->content)) ||
                (rc = sb_adds(b, "\n</tool_response>")))
                break;
            if ((i + 1 == n_msgs || strcmp(msgs[i + 1].role, "tool")) && !open)
                rc = sb_adds(b, "<|im_end|>\n");
            continue;
        }
        if (m->n_tool_calls) {
            if ((rc = sb_adds(b, "<|im_start|>assistant"))) break;
            if (m->content[0] && ((rc = sb_adds(b, "\n")) || (rc = sb_adds(b, m->content)))) break;
            for (size_t k = 0; !rc && k < m->n_tool_calls; k++) {
                if ((rc = sb_adds(b, "\n<tool_call>\n{\"name\": \"")) ||
                    (rc = sb_adds(b, m->tool_calls[k].name)) ||
                    (rc = sb_adds(b, "\", \"arguments\": ")) ||
                    (rc = py_json_text(b, m->tool_calls[k].arguments, "tool call", k)))
                    break;
                rc = sb_adds(b, "}\n</tool_call>");
            }
            if (!rc && !open) rc = sb_adds(b, "<|im_end|>\n");
            continue;
        }
        if ((rc = sb_adds(b, "<|im_start|>")) || (rc = sb_adds(b, m->role)) ||
            (rc = sb_adds(b, "\n")) || (rc = sb_adds(b, m->content)) ||
            (!open && (rc = sb_adds(b, "<|im_end|>\n"))))
            break;
    }
    if (rc == 0 && end == CS_CHAT_GENERATION_PROMPT) rc = sb_adds(b, "<|im_start|>assistant\n");
    free(def.p);
    return rc;
}

/* Llama-3 Instruct: bos_token, then per message
 * '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>'. */
static int render_llama3(const cs_tokenizer *tok, const cs_chat_message *msgs, size_t n_msgs,
                         cs_chat_end end, sbuf *b) {
    const char *t = tok->chat_template;
    bool trim = strstr(t, "| trim") || strstr(t, "|trim");
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < n_msgs; i++) {
        if (i == 0 && tok->bos_id >= 0) {
            size_t len;
            const char *bos = cs__tok_text(tok, tok->bos_id, &len);
            if ((rc = sb_add(b, bos, len))) break;
        }
        const char *c = msgs[i].content;
        size_t a = 0, e = strlen(c);
        if (trim) py_strip(c, e, &a, &e);
        bool open = end == CS_CHAT_CONTINUE && i + 1 == n_msgs;
        if ((rc = sb_adds(b, "<|start_header_id|>")) || (rc = sb_adds(b, msgs[i].role)) ||
            (rc = sb_adds(b, "<|end_header_id|>\n\n")) || (rc = sb_add(b, c + a, e - a)) ||
            (!open && (rc = sb_adds(b, "<|eot_id|>"))))
            break;
    }
    if (rc == 0 && end == CS_CHAT_GENERATION_PROMPT)
        rc = sb_adds(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return rc;
}

/* Gemma 2/3 instruction tuned models' template (Gemma 3's tokenizer_config.json):
 * the model's own text, rendered by render_gemma and, in the fixture script,
 * by jinja2. */
const char cs__gemma_chat_template[] =
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n";

/* Gemma: bos_token; a first system message becomes a prefix of the first
 * user turn (its text + "\n\n", not trimmed); then the user's turns are
 * every other one, starting with the first (else the template's own error;
 * a turn between them may have any other role, "assistant" becoming "model"):
 * '<start_of_turn>' + (user | model) + '\n' + content | trim +
 * '<end_of_turn>\n'. */
static int render_gemma(const cs_tokenizer *tok, const cs_chat_message *msgs, size_t n_msgs,
                        cs_chat_end end, const char *sep, sbuf *b) {
    size_t first = n_msgs && !strcmp(msgs[0].role, "system");
    for (size_t i = first; i < n_msgs; i++) /* the template's own check, to the letter */
        if (!strcmp(msgs[i].role, "user") != ((i - first) % 2 == 0))
            return cs_fail(CS_EINVAL,
                           "chat: Conversation roles must alternate "
                           "user/assistant/user/assistant/... (Gemma's template; message %zu "
                           "is '%s')",
                           i, msgs[i].role);
    int rc = 0;
    if (tok->bos_id >= 0) {
        size_t len;
        const char *bos = cs__tok_text(tok, tok->bos_id, &len);
        rc = sb_add(b, bos, len);
    }
    for (size_t i = first; rc == 0 && i < n_msgs; i++) {
        const char *c = msgs[i].content;
        size_t a = 0, e = strlen(c);
        py_strip(c, e, &a, &e);
        bool open = end == CS_CHAT_CONTINUE && i + 1 == n_msgs;
        if ((rc = sb_adds(b, "<start_of_turn>")) ||
            (rc = sb_adds(b, strcmp(msgs[i].role, "assistant") ? msgs[i].role : "model")) ||
            (rc = sb_adds(b, "\n")))
            break;
        if (i == first && first && ((rc = sb_adds(b, msgs[0].content)) || (rc = sb_adds(b, sep))))
            break;
        if ((rc = sb_add(b, c + a, e - a)) || (!open && (rc = sb_adds(b, "<end_of_turn>\n"))))
            break;
    }
    if (rc == 0 && end == CS_CHAT_GENERATION_PROMPT) rc = sb_adds(b, "<start_of_turn>model\n");
    return rc;
}

int cs_tokenizer_apply_chat(const cs_tokenizer *tok, const cs_chat_message *msgs, size_t n_msgs,
                            cs_chat_end end, char **text) {
    return cs_tokenizer_apply_chat_tools(tok, msgs, n_msgs, NULL, 0, end, text);
}

int cs_tokenizer_apply_chat_tools(const cs_tokenizer *tok, const cs_chat_message *msgs,
                                  size_t n_msgs, const char *const *tools, size_t n_tools,
                                  cs_chat_end end, char **text) {
    *text = NULL;
    const char *t = tok->chat_template;
    if (!t || !*t) return cs_fail(CS_ENOTSUP, "chat: the model has no chat template");
    if (end != CS_CHAT_CLOSED && end != CS_CHAT_GENERATION_PROMPT && end != CS_CHAT_CONTINUE)
        return cs_fail(CS_EINVAL, "chat: unknown ending %d", (int)end);
    if (end == CS_CHAT_CONTINUE && n_msgs == 0)
        return cs_fail(CS_EINVAL, "chat: continuing the final message needs a message");
    int rc = check_messages(msgs, n_msgs);
    if (rc) return rc;
    sbuf b = {0};
    if (strstr(t, "<|im_start|>")) {
        /* Reasoning templates (Qwen3 style) rewrite assistant turns. */
        if (strstr(t, "<think>"))
            return cs_fail(CS_ENOTSUP,
                           "chat: ChatML template with <think> blocks is not supported");
        rc = render_chatml(tok, msgs, n_msgs, tools, n_tools, end, &b);
    } else if (strstr(t, "<|start_header_id|>")) {
        /* 3.1+ templates add a dated system preamble and tool sections. */
        if (strstr(t, "Cutting Knowledge Date"))
            return cs_fail(CS_ENOTSUP,
                           "chat: Llama-3.1+ template (knowledge-date preamble) is not supported");
        bool tooled = n_tools > 0;
        for (size_t i = 0; i < n_msgs; i++)
            tooled |= msgs[i].n_tool_calls > 0 || !strcmp(msgs[i].role, "tool");
        if (tooled)
            return cs_fail(CS_ENOTSUP, "chat: tools with a Llama-3 template are not supported");
        rc = render_llama3(tok, msgs, n_msgs, end, &b);
    } else if (strstr(t, "<start_of_turn>")) {
        /* Gemma 3's template (first_user_prefix: a system message folded into the
         * first user turn); Gemma 2's refuses a system role; any other is not ours */
        bool g3 = strstr(t, "first_user_prefix") && strstr(t, "loop_messages");
        bool g2 = strstr(t, "System role not supported") != NULL;
        if (!g3 && !g2)
            return cs_fail(CS_ENOTSUP,
                           "chat: unrecognised <start_of_turn> template (Gemma 2 and "
                           "3's are supported): '%.60s'",
                           t);
        if (g2 && n_msgs && !strcmp(msgs[0].role, "system"))
            return cs_fail(CS_EINVAL, "chat: System role not supported (the model's template)");
        bool tooled = n_tools > 0;
        for (size_t i = 0; i < n_msgs; i++)
            tooled |= msgs[i].n_tool_calls > 0;
        if (tooled)
            return cs_fail(CS_ENOTSUP, "chat: tools with a Gemma template are not supported");
        /* the system prefix's separator, as the template writes it */
        const char *sep = strstr(t, "['content'] + '\\n'") ? "\n" : "\n\n";
        rc = render_gemma(tok, msgs, n_msgs, end, sep, &b);
    } else {
        return cs_fail(CS_ENOTSUP,
                       "chat: unrecognised chat template (ChatML, Llama-3 and Gemma are "
                       "supported): '%.60s'",
                       t);
    }
    if (rc == 0 && !b.p) rc = sb_add(&b, "", 0);
    if (rc) {
        free(b.p);
        return rc;
    }
    *text = b.p;
    return 0;
}
