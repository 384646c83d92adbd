/* generation.c: the Generation service's unary calls, shared by the
 * single-process server and the router (see generation.h). */
#include "generation.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "chunkserve/v1/generation.pb-c.h"
#include "chunkserve/error.h"

static void handle_list_models(cs_rpc_call *c, void *data) {
    const cs_generation_ctx *g = data;
    const cs_wire_model *wm = g->wm;
    if (!cs_api_keys_rpc_check(g->keys, c, NULL)) return;
    Chunkserve__V1__ModelInfo mi, *mis[1] = {&mi};
    cs_wire_model_info(wm, &mi);
    Chunkserve__V1__ListModelsResponse r = CHUNKSERVE__V1__LIST_MODELS_RESPONSE__INIT;
    r.n_models = 1;
    r.models = mis;
    cs_rpc_call_reply_msg(c, &r.base);
}

typedef struct {
    uv_work_t work;
    const cs_wire_model *wm;
    cs_rpc_call *c;
    const Chunkserve__V1__TokenizeRequest *m; /* the call's: valid until it is answered */
    int r;
    char err[512];
    int32_t *ids;
    size_t n;
} tokenize_job;

/* A pool thread: the model (read-only) and the request message only. */
static void tokenize_work(uv_work_t *wk) {
    tokenize_job *j = wk->data;
    const cs_wire_model *wm = j->wm;
    const Chunkserve__V1__TokenizeRequest *m = j->m;
    char *chat = NULL;
    int r = cs_wire_check_model(wm, m->model);
    if (!r && m->input_case == CHUNKSERVE__V1__TOKENIZE_REQUEST__INPUT_CHAT)
        r = cs_wire_render_chat(wm, m->chat, &chat);
    const char *text = chat                                                            ? chat
                       : m->input_case == CHUNKSERVE__V1__TOKENIZE_REQUEST__INPUT_TEXT ? m->text
                                                                                       : "";
    if (!r && strlen(text) > wm->max_prompt_bytes)
        r = cs_fail(CS_EINVAL, "the text has %zu bytes: more than the model's context can hold",
                    strlen(text));
    if (!r)
        r = cs_tokenizer_encode(cs_model_tokenizer(wm->model), text, strlen(text), true,
                                m->add_special, &j->ids, &j->n);
    if (r) snprintf(j->err, sizeof j->err, "%s", cs_last_error());
    j->r = r;
    free(chat);
}

static void tokenize_after(uv_work_t *wk, int status) {
    tokenize_job *j = wk->data;
    (void)status; /* never cancelled */
    if (j->r) {
        cs_rpc_call_finish(j->c, cs_rpc_code_of_status(j->r), j->err);
    } else {
        Chunkserve__V1__TokenizeResponse resp = CHUNKSERVE__V1__TOKENIZE_RESPONSE__INIT;
        resp.n_ids = j->n;
        resp.ids = j->ids;
        cs_rpc_call_reply_msg(j->c, &resp.base);
    }
    free(j->ids);
    free(j);
}

static void handle_tokenize(cs_rpc_call *c, void *data) {
    const cs_generation_ctx *g = data;
    if (!cs_api_keys_rpc_check(g->keys, c, NULL)) return;
    tokenize_job *j = calloc(1, sizeof *j);
    if (!j) {
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    j->wm = g->wm;
    j->c = c;
    j->m = (const void *)cs_rpc_call_request_msg(c);
    j->work.data = j;
    if (uv_queue_work(g->uv, &j->work, tokenize_work, tokenize_after) != 0) {
        free(j);
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "cannot queue the tokenization");
    }
}

static void handle_detokenize(cs_rpc_call *c, void *data) {
    const cs_generation_ctx *g = data;
    const cs_wire_model *wm = g->wm;
    if (!cs_api_keys_rpc_check(g->keys, c, NULL)) return;
    const Chunkserve__V1__DetokenizeRequest *m = (const void *)cs_rpc_call_request_msg(c);
    const cs_tokenizer *tok = cs_model_tokenizer(wm->model);
    int32_t n_vocab = cs_tokenizer_n_vocab(tok);
    int r = cs_wire_check_model(wm, m->model);
    int32_t ctx = cs_model_get_config(wm->model)->ctx_len;
    if (!r && m->n_ids > (size_t)ctx) /* bounds the text too: no token is long */
        r = cs_fail(CS_EINVAL, "ids has %zu tokens; at most the context (%d) are detokenized",
                    m->n_ids, ctx);
    for (size_t i = 0; !r && i < m->n_ids; i++)
        if (m->ids[i] < 0 || m->ids[i] >= n_vocab)
            r = cs_fail(CS_EINVAL, "ids[%zu] = %d is outside the vocabulary (0..%d)", i, m->ids[i],
                        n_vocab - 1);
    char *text = NULL;
    size_t len = 0;
    if (!r) r = cs_tokenizer_decode(tok, m->ids, m->n_ids, !m->include_special, &text, &len);
    if (r) {
        cs_rpc_call_finish(c, cs_rpc_code_of_status(r), cs_last_error());
    } else {
        Chunkserve__V1__DetokenizeResponse resp = CHUNKSERVE__V1__DETOKENIZE_RESPONSE__INIT;
        resp.text = text;
        cs_rpc_call_reply_msg(c, &resp.base);
    }
    free(text);
}

int cs_generation_add_unary(cs_rpc_server *s, const cs_generation_ctx *ctx) {
    static const struct {
        const char *path;
        const ProtobufCMessageDescriptor *desc;
        cs_rpc_handler fn;
    } methods[] = {
        {"/" CS_GENERATION_SERVICE "/ListModels", &chunkserve__v1__list_models_request__descriptor,
         handle_list_models},
        {"/" CS_GENERATION_SERVICE "/Tokenize", &chunkserve__v1__tokenize_request__descriptor,
         handle_tokenize},
        {"/" CS_GENERATION_SERVICE "/Detokenize", &chunkserve__v1__detokenize_request__descriptor,
         handle_detokenize},
    };
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        int r = cs_rpc_server_add_method(s, methods[i].path, CS_RPC_UNARY, methods[i].desc,
                                         methods[i].fn, (void *)ctx);
        if (r) return r;
    }
    return 0;
}
