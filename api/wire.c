/* wire.c: GenerateRequest -> cs_request and the checks behind
 * INVALID_ARGUMENT. Refusals name the proto field ("sampling.top_p") in the
 * message and as the error's field (cs_fail_field), because that is what the
 * client wrote; the scalar sampling fields are copied and checked by their
 * table (chunkserve/sampling_fields.h). Not here: building responses (server.c
 * fills GenerateResponse directly from its event buffers). */
#include "wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/sampling_fields.h"
#include "chunkserve/stop.h"
#include "chunkserve/tokenizer.h"
#include "chunkserve/ttft.h"
#include "chunkserve/error.h"

enum { MAX_STOP = 64, MAX_STOP_BYTES = 256 };

int cs_wire_check_model(const cs_wire_model *wm, const char *name) {
    if (!name || !name[0] || !strcmp(name, wm->name) || !strcmp(name, wm->alias)) return 0;
    return cs_fail_field(
        CS_EINVAL, "model",
        "unknown model '%s'; this server serves '%s' (see ListModels, or leave model empty)", name,
        wm->name);
}

int cs_wire_render_chat(const cs_wire_model *wm, const Chunkserve__V1__Chat *chat, char **text) {
    *text = NULL;
    if (!chat || chat->n_messages == 0)
        return cs_fail_field(CS_EINVAL, "chat", "chat has no messages");
    cs_chat_message *msgs = calloc(chat->n_messages, sizeof *msgs);
    size_t n_calls = 0;
    for (size_t i = 0; i < chat->n_messages; i++)
        n_calls += chat->messages[i]->n_tool_calls;
    cs_chat_tool_call *calls = calloc(n_calls + 1, sizeof *calls);
    if (!msgs || !calls) {
        free(msgs), free(calls);
        return cs_fail(CS_ENOMEM, "out of memory");
    }
    for (size_t i = 0, k = 0; i < chat->n_messages; i++) {
        const Chunkserve__V1__ChatMessage *m = chat->messages[i];
        msgs[i] = (cs_chat_message){.role = m->role,
                                    .content = m->content,
                                    .tool_calls = calls + k,
                                    .n_tool_calls = m->n_tool_calls};
        for (size_t j = 0; j < m->n_tool_calls; j++, k++)
            calls[k] = (cs_chat_tool_call){.name = m->tool_calls[j]->name,
                                           .arguments = m->tool_calls[j]->arguments};
    }
    cs_chat_end end;
    switch (chat->end) {
    case CHUNKSERVE__V1__CHAT_END__CHAT_END_GENERATION_PROMPT:
        end = CS_CHAT_GENERATION_PROMPT;
        break;
    case CHUNKSERVE__V1__CHAT_END__CHAT_END_CLOSED: end = CS_CHAT_CLOSED; break;
    case CHUNKSERVE__V1__CHAT_END__CHAT_END_CONTINUE: end = CS_CHAT_CONTINUE; break;
    default:
        free(msgs), free(calls);
        return cs_fail_field(CS_EINVAL, "chat.end", "chat.end = %d is not a ChatEnd",
                             (int)chat->end);
    }
    int r =
        cs_tokenizer_apply_chat_tools(cs_model_tokenizer(wm->model), msgs, chat->n_messages,
                                      (const char *const *)chat->tools, chat->n_tools, end, text);
    free(msgs), free(calls);
    return r;
}

/* The proto's lists (stop strings and ids): counts and lengths. The scalar
 * fields are checked by their table (chunkserve/sampling_fields.h) in
 * cs_wire_sampling. */
static int check_lists(const Chunkserve__V1__SamplingParams *p) {
    if (p->n_stop > MAX_STOP)
        return cs_fail_field(CS_EINVAL, "sampling.stop",
                             "sampling.stop has %zu strings; at most %d are allowed", p->n_stop,
                             MAX_STOP);
    for (size_t i = 0; i < p->n_stop; i++) {
        size_t len = strlen(p->stop[i]);
        if (len == 0 || len > MAX_STOP_BYTES)
            return cs_fail_field(CS_EINVAL, "sampling.stop",
                                 "sampling.stop[%zu] must be 1 to %d bytes; it has %zu", i,
                                 MAX_STOP_BYTES, len);
    }
    if (p->n_stop_token_ids > MAX_STOP)
        return cs_fail_field(CS_EINVAL, "sampling.stop_token_ids",
                             "sampling.stop_token_ids has %zu ids; at most %d are allowed",
                             p->n_stop_token_ids, MAX_STOP);
    return 0;
}

/* Each scalar field of m into q by its row: the proto field of the row's
 * name (read through the descriptor), its "not set" zero, its bounds, the
 * field it needs. */
static int copy_fields(const Chunkserve__V1__SamplingParams *m, cs_request *q) {
    const ProtobufCMessageDescriptor *d = &chunkserve__v1__sampling_params__descriptor;
    for (size_t i = 0; i < cs_n_sampling_fields; i++) {
        const cs_sampling_field *f = &cs_sampling_fields[i];
        const ProtobufCFieldDescriptor *fd =
            protobuf_c_message_descriptor_get_field_by_name(d, f->name);
        if (!fd) /* test_sampling_fields checks every row against the proto */
            return cs_fail(CS_EINVAL, "sampling field %s is not in the proto", f->name);
        const char *p = (const char *)m + fd->offset;
        if (f->type == CS_FIELD_U64) {
            cs_sampling_field_set_u64(f, q, *(const uint64_t *)p);
            continue;
        }
        double v = f->type == CS_FIELD_FLOAT ? *(const float *)p
                   : f->type == CS_FIELD_INT ? *(const int32_t *)p
                                             : (double)(*(const protobuf_c_boolean *)p != 0);
        if (v == 0 && (f->flags & CS_FIELD_ZERO_UNSET)) v = f->def;
        int r = cs_sampling_field_check(f, v, "sampling.");
        if (r) return r;
        cs_sampling_field_set(f, q, v);
    }
    for (size_t i = 0; i < cs_n_sampling_fields; i++) { /* after the copy: needs reads q */
        const cs_sampling_field *f = &cs_sampling_fields[i];
        if (f->needs && cs_sampling_field_get(f, q) != 0 &&
            cs_sampling_field_get(cs_sampling_field_find(f->needs), q) == 0) {
            char field[64];
            snprintf(field, sizeof field, "sampling.%s", f->name);
            return cs_fail_field(CS_EINVAL, field, "%s needs sampling.%s set", field, f->needs);
        }
    }
    return 0;
}

static int check_ids(const int32_t *ids, size_t n, int32_t n_vocab, const char *field) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_vocab)
            return cs_fail_field(CS_EINVAL, field, "%s[%zu] = %d is outside the vocabulary (0..%d)",
                                 field, i, ids[i], n_vocab - 1);
    return 0;
}

void cs_wire_model_init(cs_wire_model *wm, const cs_model *m, const char *path) {
    const cs_model_config *cfg = cs_model_get_config(m);
    const char *base = path ? strrchr(path, '/') : NULL;
    base = base ? base + 1 : path ? path : "";
    cs_chat_message msg = {.role = "user", .content = "hi"};
    char *text = NULL;
    bool chat = cs_tokenizer_apply_chat(cs_model_tokenizer(m), &msg, 1, CS_CHAT_GENERATION_PROMPT,
                                        &text) == 0;
    free(text);
    *wm = (cs_wire_model){m,
                          cfg->name[0] ? cfg->name : base,
                          base,
                          0,
                          0,
                          {0, 0, 0, 0},
                          chat,
                          cs_wire_max_prompt_bytes(m),
                          cs_tokenizer_fingerprint(cs_model_tokenizer(m))};
}

void cs_wire_model_info(const cs_wire_model *wm, Chunkserve__V1__ModelInfo *mi) {
    const cs_model_config *cfg = cs_model_get_config(wm->model);
    *mi = (Chunkserve__V1__ModelInfo)CHUNKSERVE__V1__MODEL_INFO__INIT;
    mi->name = (char *)wm->name;
    mi->context_length = cfg->ctx_len;
    mi->vocab_size = cfg->n_vocab;
    mi->architecture = (char *)cfg->arch;
    mi->has_chat_template = wm->has_chat_template;
    mi->fingerprint = cs_model_fingerprint(wm->model);
    mi->tokenizer_fingerprint = wm->tokenizer_fingerprint;
}

void cs_wire_worker_status(const cs_wire_model *wm, const cs_sched_stats *st,
                           const cs_ttft_load *load, cs_wire_status_buf *buf,
                           Chunkserve__V1__WorkerStatus *r) {
    cs_wire_model_info(wm, &buf->mi);
    *r = (Chunkserve__V1__WorkerStatus)CHUNKSERVE__V1__WORKER_STATUS__INIT;
    r->model = &buf->mi;
    r->page_size = st->page_size;
    r->kv_pages_total = st->kv_pages_total;
    r->kv_pages_free =
        st->kv_pages_total - st->kv_pages_used; /* cached prefix pages are reusable */
    r->num_running = st->n_running;
    r->num_waiting = st->n_waiting;
    r->queued_prefill_tokens = st->queued_prompt_tokens;
    r->max_num_batched_tokens = st->max_num_batched_tokens;
    r->speculative = st->num_speculative_tokens == 0 ? "off" : st->draft_model ? "draft" : "ngram";
    r->num_speculative_tokens = st->num_speculative_tokens;
    r->prefill_tokens_per_second = load ? load->prompt_tokens_per_s : 0;
    r->decode_tokens_per_second = load ? load->decode_tokens_per_s : 0;
    for (int32_t i = 0; load && i < load->n_groups; i++) {
        const cs_ttft_group *g = &load->groups[i];
        Chunkserve__V1__QueuedPrompts *q = &buf->queued[i];
        *q = (Chunkserve__V1__QueuedPrompts)CHUNKSERVE__V1__QUEUED_PROMPTS__INIT;
        q->priority = g->priority;
        q->tenant = (char *)g->tenant;
        q->weight = g->weight;
        q->tokens = g->tokens;
        buf->queued_ptrs[i] = q;
    }
    r->n_queued_prompts = load ? (size_t)load->n_groups : 0;
    r->queued_prompts = buf->queued_ptrs;
    r->queued_unsorted_tokens = load ? load->overflow_tokens : 0;
}

size_t cs_wire_max_prompt_bytes(const cs_model *m) {
    const cs_tokenizer *tok = cs_model_tokenizer(m);
    size_t longest = 1;
    for (int32_t id = 0; id < cs_tokenizer_n_vocab(tok); id++) {
        const char *b;
        size_t len;
        if (cs_tokenizer_token_bytes(tok, id, &b, &len) == 0 && len > longest) longest = len;
    }
    return longest * (size_t)cs_model_get_config(m)->ctx_len;
}

/* Text that cannot fit in the context whatever its tokens is refused before
 * it is tokenized (tokenizing runs on the server's loop thread). */
static int check_prompt_bytes(const cs_wire_model *wm, size_t len, const char *what) {
    if (len > wm->max_prompt_bytes)
        return cs_fail_field(
            CS_EINVAL, "context",
            "the %s has %zu bytes: more than the model's context of %d tokens can hold", what, len,
            cs_model_get_config(wm->model)->ctx_len);
    return 0;
}

/* The prompt's token ids, from whichever input the request set. */
static int prompt_ids(const cs_wire_model *wm, const Chunkserve__V1__GenerateRequest *m,
                      int32_t **ids, size_t *n) {
    const cs_tokenizer *tok = cs_model_tokenizer(wm->model);
    *ids = NULL;
    *n = 0;
    switch (m->input_case) {
    case CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_PROMPT: {
        if (!m->prompt[0]) return cs_fail_field(CS_EINVAL, "prompt", "the prompt is empty");
        int r = check_prompt_bytes(wm, strlen(m->prompt), "prompt");
        return r ? r : cs_tokenizer_encode(tok, m->prompt, strlen(m->prompt), true, true, ids, n);
    }
    case CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS: {
        const Chunkserve__V1__TokenIds *t = m->token_ids;
        if (!t || t->n_ids == 0) return cs_fail_field(CS_EINVAL, "token_ids", "token_ids is empty");
        int r = check_ids(t->ids, t->n_ids, cs_tokenizer_n_vocab(tok), "token_ids.ids");
        if (r) return r;
        if (!(*ids = malloc(t->n_ids * sizeof(int32_t))))
            return cs_fail(CS_ENOMEM, "out of memory");
        memcpy(*ids, t->ids, t->n_ids * sizeof(int32_t));
        *n = t->n_ids;
        return 0;
    }
    case CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_CHAT: {
        char *text = NULL;
        int r = cs_wire_render_chat(wm, m->chat, &text);
        if (r && r != CS_ENOMEM) r = cs_fail_in(r, "chat"); /* the template's refusals */
        if (!r) r = check_prompt_bytes(wm, strlen(text), "rendered chat");
        if (!r) r = cs_tokenizer_encode(tok, text, strlen(text), true, true, ids, n);
        free(text);
        return r;
    }
    default:
        return cs_fail_field(CS_EINVAL, "prompt",
                             "the request sets no input: set prompt, token_ids or chat");
    }
}

/* sampling.structured into the engine's spec (strings borrowed from m),
 * compiled once here so a bad schema or regex is INVALID_ARGUMENT at the door. */
static int structured(const Chunkserve__V1__StructuredOutput *m, cs_structured *out) {
    *out = (cs_structured){0};
    if (!m) return 0;
    switch (m->kind_case) {
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_SCHEMA:
        *out = (cs_structured){.kind = CS_STRUCTURED_JSON_SCHEMA, .text = m->json_schema};
        break;
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_JSON_OBJECT:
        if (m->json_object) out->kind = CS_STRUCTURED_JSON_OBJECT;
        break;
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_REGEX:
        *out = (cs_structured){.kind = CS_STRUCTURED_REGEX, .text = m->regex};
        break;
    case CHUNKSERVE__V1__STRUCTURED_OUTPUT__KIND_CHOICE:
        if (!m->choice || m->choice->n_choices > CS_GRAMMAR_MAX_CHOICES)
            return cs_fail_field(CS_EINVAL, "sampling.structured",
                                 "sampling.structured.choice has %zu choices; 1 to %d are "
                                 "allowed",
                                 m->choice ? m->choice->n_choices : 0, CS_GRAMMAR_MAX_CHOICES);
        *out = (cs_structured){.kind = CS_STRUCTURED_CHOICE,
                               .choices = (const char *const *)m->choice->choices,
                               .n_choices = (int32_t)m->choice->n_choices};
        break;
    default: return 0;
    }
    if (out->kind == CS_STRUCTURED_NONE) return 0;
    cs_grammar *g;
    int r = cs_grammar_compile(out, &g);
    cs_grammar_free(g);
    return r && r != CS_ENOMEM ? cs_fail_in(r, "sampling.structured") : r;
}

int cs_wire_sampling(const cs_wire_model *wm, const Chunkserve__V1__SamplingParams *m,
                     cs_request *q) {
    const cs_model_config *cfg = cs_model_get_config(wm->model);
    static const Chunkserve__V1__SamplingParams no_params = CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;
    const Chunkserve__V1__SamplingParams *p = m ? m : &no_params;
    int r = check_lists(p);
    if (!r) r = copy_fields(p, q);
    if (!r && q->stop.max_tokens > 0 && q->stop.min_tokens > q->stop.max_tokens)
        r = cs_fail_field(CS_EINVAL, "sampling.min_tokens",
                          "sampling.min_tokens %d is more than sampling.max_tokens %d",
                          q->stop.min_tokens, q->stop.max_tokens);
    if (!r && q->stop.min_tokens > cfg->ctx_len)
        r = cs_fail_field(CS_EINVAL, "sampling.min_tokens",
                          "sampling.min_tokens %d is more than the model's context of %d tokens",
                          q->stop.min_tokens, cfg->ctx_len);
    if (!r)
        r = check_ids(p->stop_token_ids, p->n_stop_token_ids, cfg->n_vocab,
                      "sampling.stop_token_ids");
    if (r) return r;
    if (p->n_logit_bias_ids != p->n_logit_bias_values)
        return cs_fail_field(
            CS_EINVAL, "sampling.logit_bias_values",
            "sampling.logit_bias_ids has %zu entries and sampling.logit_bias_values %zu; "
            "they must pair up",
            p->n_logit_bias_ids, p->n_logit_bias_values);
    if (p->n_logit_bias_ids > CS_MAX_LOGIT_BIAS)
        return cs_fail_field(CS_EINVAL, "sampling.logit_bias_ids",
                             "sampling.logit_bias_ids has %zu entries; at most %d are allowed",
                             p->n_logit_bias_ids, CS_MAX_LOGIT_BIAS);
    r = check_ids(p->logit_bias_ids, p->n_logit_bias_ids, cfg->n_vocab, "sampling.logit_bias_ids");
    if (r) return r;
    q->sampling.bias_ids = p->logit_bias_ids; /* borrowed from m, like the stop lists */
    q->sampling.bias = p->logit_bias_values;
    q->sampling.n_bias = (int32_t)p->n_logit_bias_ids;
    if ((r = cs_sampling_params_check(&q->sampling))) { /* what is left: the bias values */
        char why[512];
        snprintf(why, sizeof why, "%s", cs_last_error());
        return cs_fail_field(r, "sampling.logit_bias_values", "sampling.%s", why);
    }
    r = structured(p->structured, &q->structured);
    if (r) return r;
    q->stop.stop = (const char *const *)p->stop;
    q->stop.n_stop = p->n_stop;
    q->stop.stop_ids = p->stop_token_ids;
    q->stop.n_stop_ids = p->n_stop_token_ids;
    if (q->stop.max_tokens == 0) q->stop.max_tokens = cfg->ctx_len; /* the scheduler caps it */
    cs_stop *st = NULL;
    r = cs_stop_init(cs_model_tokenizer(wm->model), &q->stop, &st);
    cs_stop_free(st);
    return r;
}

int cs_wire_check_request_id(const char *id) {
    size_t n = id ? strlen(id) : 0;
    if (n > CS_WIRE_MAX_REQUEST_ID)
        return cs_fail_field(CS_EINVAL, "request_id",
                             "request_id has %zu bytes; at most %d are allowed", n,
                             CS_WIRE_MAX_REQUEST_ID);
    for (size_t i = 0; i < n; i++)
        if (id[i] < 0x21 || id[i] > 0x7e)
            return cs_fail_field(
                CS_EINVAL, "request_id",
                "request_id byte %zu is 0x%02x; only printable ASCII without spaces "
                "(0x21..0x7e) is allowed",
                i, (unsigned char)id[i]);
    return 0;
}

int cs_wire_check_cache_salt(const char *salt) {
    size_t n = salt ? strlen(salt) : 0;
    if (n > CS_WIRE_MAX_CACHE_SALT)
        return cs_fail_field(CS_EINVAL, "cache_salt",
                             "cache_salt has %zu bytes; at most %d are allowed", n,
                             CS_WIRE_MAX_CACHE_SALT);
    return 0;
}

int cs_wire_check_tenant(const char *tenant) {
    size_t n = tenant ? strlen(tenant) : 0;
    if (n > CS_TENANT_NAME_MAX)
        return cs_fail_field(CS_EINVAL, "tenant", "tenant has %zu bytes; at most %d are allowed", n,
                             CS_TENANT_NAME_MAX);
    return 0;
}

int32_t cs_wire_min_pages(const cs_wire_model *wm, int64_t n) {
    cs_kv_blocks b = wm->kv_blocks;
    if (b.per_block < 1) b = (cs_kv_blocks){wm->page_size, 1, 1, 0};
    if (b.page_size < 1) b.page_size = 16;
    return cs_kv_blocks_min_pages(&b, n);
}

int cs_wire_generate_request(const cs_wire_model *wm, const Chunkserve__V1__GenerateRequest *m,
                             uint64_t id, cs_wire_request *out) {
    memset(out, 0, sizeof *out);
    cs_error_clear(); /* a field named below is this request's (cs_fail_in) */
    const cs_model_config *cfg = cs_model_get_config(wm->model);
    int r = cs_wire_check_request_id(m->request_id);
    if (!r) r = cs_wire_check_cache_salt(m->cache_salt);
    if (!r) r = cs_wire_check_tenant(m->tenant);
    if (!r) r = cs_wire_check_model(wm, m->model);
    cs_request *q = &out->r;
    if (!r) r = cs_wire_sampling(wm, m->sampling, q);
    int32_t *ids = NULL;
    size_t n = 0;
    if (!r) r = prompt_ids(wm, m, &ids, &n);
    if (!r && n == 0)
        r = cs_fail_field(CS_EINVAL, "prompt", "the prompt is empty after tokenization");
    if (!r && n >= (size_t)cfg->ctx_len)
        r = cs_fail_field(
            CS_EINVAL, "context",
            "the prompt has %zu tokens; the model's context is %d tokens, so at most %d fit", n,
            cfg->ctx_len, cfg->ctx_len - 1);
    /* vLLM's rule: a max_tokens the context cannot hold after the prompt is
     * refused, not quietly cut (0 = until the context is full) */
    const int32_t max_new = m->sampling ? m->sampling->max_tokens : 0;
    if (!r && max_new > 0 && (int64_t)n + max_new > cfg->ctx_len)
        r = cs_fail_field(
            CS_EINVAL, "context",
            "the prompt has %zu tokens and max_tokens is %d: %lld tokens, more than the "
            "model's context of %d tokens (at most %lld can be generated)",
            n, max_new, (long long)n + max_new, cfg->ctx_len,
            (long long)cfg->ctx_len - (long long)n);
    if (!r && cs_wire_min_pages(wm, (int64_t)n + 1) > wm->n_kv_pages)
        r = cs_fail_field(
            CS_EINVAL, "prompt",
            "the prompt has %zu tokens, more than this server's KV cache holds (%d pages of %d "
            "tokens; start it with a larger --kv-cache-mib)",
            n, wm->n_kv_pages, wm->page_size);
    if (r) {
        free(ids);
        memset(out, 0, sizeof *out);
        return r;
    }
    q->id = id;
    q->prompt = ids;
    q->n_prompt = (int32_t)n;
    q->cache_salt = m->cache_salt; /* borrowed from m (cs_serve_submit copies it) */
    q->tenant = m->tenant;         /* likewise */
    out->prompt = ids;
    return 0;
}

void cs_wire_request_free(cs_wire_request *w) {
    free(w->prompt);
    memset(w, 0, sizeof *w);
}

Chunkserve__V1__FinishReason cs_wire_finish_reason(enum cs_finish f) {
    switch (f) {
    case CS_FINISH_STOP: return CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_STOP;
    case CS_FINISH_LENGTH: return CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    case CS_FINISH_CANCELLED: return CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_CANCELLED;
    case CS_FINISH_ERROR: return CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_ERROR;
    default: return CHUNKSERVE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    }
}
