/* fuzz_wire: fuzz driver for the gRPC request messages every door decodes
 * (protobuf-c unpack of the wire bytes, as cs_rpc_unpack does) and the checks
 * that turn them into engine requests (api/wire.c): GenerateRequest
 * (cs_wire_generate_request: request_id, model name, prompt text tokenized
 * with special tokens, token ids, chat rendered with the model's template,
 * prompt length against the context and the KV pool, sampling and stop
 * parameters, cs_stop_init), the Tokenize and Detokenize requests as
 * api/generation.c handles them, the router's forwarded SamplingParams
 * (cs_wire_sampling), the workers' Prefill and Decode requests (request_id
 * and sampling as worker/call.c checks them), and the messages decoded from
 * peers (WorkerStatus, DecodeResponse, Cancel, the empty ones: unpacked only).
 *
 * Input: byte 0 % 10 picks the message type; the rest is its protobuf bytes.
 * The model is the tiny test model ($CS_TINY_DIR/f32/tiny.gguf, vocabulary
 * only) with a KV pool of 64 pages of 16 tokens.
 * Properties besides the sanitizers: every refusal is CS_EINVAL (or
 * CS_ENOMEM) with cs_last_error() set and leaves nothing to free (the
 * cs_wire_request zeroed); an accepted request has 1 <= n_prompt <
 * context, every prompt id in the vocabulary, and fits the pool.
 * Usage (fallback): fuzz_wire CORPUS_DIR [ITERATIONS]
 *                   fuzz_wire --write-corpus DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"
#include "chunkserve/model.h"
#include "chunkserve/tokenizer.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "chunkserve/v1/generation.pb-c.h"
#include "wire.h"

enum {
    M_GENERATE,
    M_TOKENIZE,
    M_DETOKENIZE,
    M_SAMPLING,
    M_PREFILL,
    M_DECODE,
    M_STATUS,
    M_DECODE_RESPONSE,
    M_CANCEL,
    M_EMPTY,
    N_TYPES
};

static const ProtobufCMessageDescriptor *const descs[N_TYPES] = {
    &chunkserve__v1__generate_request__descriptor,
    &chunkserve__v1__tokenize_request__descriptor,
    &chunkserve__v1__detokenize_request__descriptor,
    &chunkserve__v1__sampling_params__descriptor,
    &chunkserve__v1__prefill_request__descriptor,
    &chunkserve__v1__decode_request__descriptor,
    &chunkserve__v1__worker_status__descriptor,
    &chunkserve__v1__decode_response__descriptor,
    &chunkserve__v1__cancel_request__descriptor,
    &chunkserve__v1__list_models_request__descriptor,
};

static cs_model *model;
static cs_wire_model wm;

static void refused(int r) {
    const char *e = cs_last_error();
    if (getenv("CS_FUZZ_VERBOSE")) fprintf(stderr, "[%d %s]\n", r, e); /* how far a seed gets */
    if (r != CS_EINVAL && r != CS_ENOMEM && r != CS_ENOTSUP) {
        fprintf(stderr, "fuzz_wire: refusal with status %d (%s)\n", r, e);
        abort();
    }
    if (!e || !e[0]) {
        fprintf(stderr, "fuzz_wire: status %d without a message\n", r);
        abort();
    }
}

static void setup(void) {
    cs_log_set_level(CS_LOG_ERROR);
    const char *dir = getenv("CS_TINY_DIR");
    static char path[1024]; /* wm borrows it */
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", dir ? dir : "build/test-tmp/tiny");
    if (cs_model_load_vocab(path, &model)) {
        fprintf(stderr, "fuzz_wire: cannot load %s (set CS_TINY_DIR): %s\n", path, cs_last_error());
        exit(2);
    }
    cs_wire_model_init(&wm, model, path);
    wm.n_kv_pages = 64, wm.page_size = 16;
}

static void generate(const Chunkserve__V1__GenerateRequest *m) {
    cs_wire_request w;
    int r = cs_wire_generate_request(&wm, m, 7, &w);
    if (r) {
        refused(r);
        static const cs_wire_request zero;
        if (memcmp(&w, &zero, sizeof w)) abort(); /* "nothing is left to free" */
        return;
    }
    int32_t ctx = cs_model_get_config(model)->ctx_len, nv = cs_model_get_config(model)->n_vocab;
    if (w.r.n_prompt < 1 || w.r.n_prompt >= ctx || w.r.prompt != w.prompt || w.r.id != 7) abort();
    if ((w.r.n_prompt + 1 + wm.page_size - 1) / wm.page_size > wm.n_kv_pages) abort();
    for (int32_t i = 0; i < w.r.n_prompt; i++)
        if (w.prompt[i] < 0 || w.prompt[i] >= nv) abort();
    cs_wire_request_free(&w);
}

/* api/generation.c's handle_tokenize without the RPC call around it. */
static void tokenize(const Chunkserve__V1__TokenizeRequest *m) {
    char *chat = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    int r = cs_wire_check_model(&wm, m->model);
    if (!r && m->input_case == CHUNKSERVE__V1__TOKENIZE_REQUEST__INPUT_CHAT)
        r = cs_wire_render_chat(&wm, m->chat, &chat);
    const char *text = chat                                                            ? chat
                       : m->input_case == CHUNKSERVE__V1__TOKENIZE_REQUEST__INPUT_TEXT ? m->text
                                                                                       : "";
    if (!r && strlen(text) > wm.max_prompt_bytes) r = cs_fail(CS_EINVAL, "too long");
    if (!r)
        r = cs_tokenizer_encode(cs_model_tokenizer(model), text, strlen(text), true, m->add_special,
                                &ids, &n);
    if (r) refused(r);
    free(ids);
    free(chat);
}

/* api/generation.c's handle_detokenize: ids checked, then decoded. */
static void detokenize(const Chunkserve__V1__DetokenizeRequest *m) {
    const cs_tokenizer *tok = cs_model_tokenizer(model);
    int r = cs_wire_check_model(&wm, m->model);
    if (r) {
        refused(r);
        return;
    }
    if (m->n_ids > (size_t)cs_model_get_config(model)->ctx_len) return;
    for (size_t i = 0; i < m->n_ids; i++)
        if (m->ids[i] < 0 || m->ids[i] >= cs_tokenizer_n_vocab(tok)) return;
    char *text = NULL;
    size_t len;
    if (cs_tokenizer_decode(tok, m->ids, m->n_ids, !m->include_special, &text, &len)) abort();
    free(text);
}

static void sampling(const Chunkserve__V1__SamplingParams *p, const char *request_id) {
    int r = request_id ? cs_wire_check_request_id(request_id) : 0;
    cs_request q;
    memset(&q, 0, sizeof q);
    if (!r) r = cs_wire_sampling(&wm, p, &q);
    if (r) refused(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!model) setup();
    if (!size) return 0;
    int type = data[0] % N_TYPES;
    ProtobufCMessage *msg = protobuf_c_message_unpack(descs[type], NULL, size - 1, data + 1);
    if (!msg) return 0; /* cs_rpc_unpack: INVALID_ARGUMENT, nothing else runs */
    switch (type) {
    case M_GENERATE: generate((const void *)msg); break;
    case M_TOKENIZE: tokenize((const void *)msg); break;
    case M_DETOKENIZE: detokenize((const void *)msg); break;
    case M_SAMPLING: sampling((const void *)msg, NULL); break;
    case M_PREFILL: {
        const Chunkserve__V1__PrefillRequest *m = (const void *)msg;
        sampling(m->sampling, m->request_id);
        break;
    }
    case M_DECODE: {
        const Chunkserve__V1__DecodeRequest *m = (const void *)msg;
        sampling(m->sampling, m->request_id);
        break;
    }
    default: break;
    }
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}

#ifndef CS_LIBFUZZER
static int write_msg(const char *dir, const char *name, int type, const ProtobufCMessage *m) {
    uint8_t buf[4096];
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > sizeof buf) return 1;
    protobuf_c_message_pack(m, buf);
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fputc(type, f);
    fwrite(buf, 1, n, f);
    return fclose(f) != 0;
}

static int fuzz_write_corpus(const char *dir) {
    setup(); /* the model's alias and status fields */
    Chunkserve__V1__SamplingParams sp = CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;
    char *stops[] = {"\n\n", "<|im_end|>", "\xc3\xa9"};
    int32_t stop_ids[] = {2, 5};
    sp.temperature = 0.7f, sp.top_p = 0.9f, sp.top_k = 40, sp.min_p = 0.05f;
    sp.repetition_penalty = 1.1f, sp.presence_penalty = 0.5f, sp.frequency_penalty = -0.5f;
    sp.seed = 42, sp.max_tokens = 16, sp.n_stop = 3, sp.stop = stops;
    sp.n_stop_token_ids = 2, sp.stop_token_ids = stop_ids;
    sp.logprobs = true, sp.top_logprobs = 3, sp.min_tokens = 2, sp.include_special = true;

    Chunkserve__V1__GenerateRequest g = CHUNKSERVE__V1__GENERATE_REQUEST__INIT;
    g.request_id = "req-1";
    g.model = (char *)wm.alias;
    g.input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_PROMPT;
    g.prompt = "<|im_start|>user\nHello 123 w\xc3\xb6rld<|im_end|>";
    g.sampling = &sp;
    int rc = write_msg(dir, "generate-prompt", M_GENERATE, &g.base);

    Chunkserve__V1__TokenIds ti = CHUNKSERVE__V1__TOKEN_IDS__INIT;
    int32_t ids[] = {1, 40, 41, 300, 2};
    ti.n_ids = 5, ti.ids = ids;
    g.input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    g.token_ids = &ti;
    g.model = "";
    rc |= write_msg(dir, "generate-ids", M_GENERATE, &g.base);

    Chunkserve__V1__ChatMessage cm[2] = {CHUNKSERVE__V1__CHAT_MESSAGE__INIT,
                                         CHUNKSERVE__V1__CHAT_MESSAGE__INIT},
                                *cmp[2] = {&cm[0], &cm[1]};
    cm[0].role = "system", cm[0].content = "be brief";
    cm[1].role = "user", cm[1].content = "hi \xf0\x9f\x98\x80";
    Chunkserve__V1__Chat chat = CHUNKSERVE__V1__CHAT__INIT;
    chat.n_messages = 2, chat.messages = cmp;
    g.input_case = CHUNKSERVE__V1__GENERATE_REQUEST__INPUT_CHAT;
    g.chat = &chat;
    g.sampling = NULL;
    rc |= write_msg(dir, "generate-chat", M_GENERATE, &g.base);

    Chunkserve__V1__TokenizeRequest tq = CHUNKSERVE__V1__TOKENIZE_REQUEST__INIT;
    tq.input_case = CHUNKSERVE__V1__TOKENIZE_REQUEST__INPUT_CHAT, tq.chat = &chat;
    tq.add_special = true;
    rc |= write_msg(dir, "tokenize-chat", M_TOKENIZE, &tq.base);
    tq.input_case = CHUNKSERVE__V1__TOKENIZE_REQUEST__INPUT_TEXT, tq.text = "a b\n\n12<|im_end|>";
    rc |= write_msg(dir, "tokenize-text", M_TOKENIZE, &tq.base);

    Chunkserve__V1__DetokenizeRequest dq = CHUNKSERVE__V1__DETOKENIZE_REQUEST__INIT;
    dq.n_ids = 5, dq.ids = ids, dq.include_special = true;
    rc |= write_msg(dir, "detokenize", M_DETOKENIZE, &dq.base);
    rc |= write_msg(dir, "sampling", M_SAMPLING, &sp.base);

    Chunkserve__V1__PrefillRequest pq = CHUNKSERVE__V1__PREFILL_REQUEST__INIT;
    pq.request_id = "r-2", pq.transfer_id = 99, pq.n_token_ids = 5, pq.token_ids = ids;
    pq.num_prompt_tokens = 4, pq.sampling = &sp, pq.kv_endpoint = "[::1]:7001";
    pq.decode_worker_id = "decode-0";
    rc |= write_msg(dir, "prefill", M_PREFILL, &pq.base);
    Chunkserve__V1__DecodeRequest dr = CHUNKSERVE__V1__DECODE_REQUEST__INIT;
    dr.request_id = "r-3", dr.transfer_id = 100, dr.n_token_ids = 5, dr.token_ids = ids;
    dr.num_prompt_tokens = 5, dr.sampling = &sp, dr.lease_ms = 500, dr.kv_sender = "prefill-0";
    rc |= write_msg(dir, "decode", M_DECODE, &dr.base);

    cs_wire_status_buf sb;
    Chunkserve__V1__WorkerStatus ws;
    cs_sched_stats st;
    memset(&st, 0, sizeof st);
    cs_ttft_load load = {0};
    cs_ttft_load_add(&load, 0, "chat", 2, 40);
    cs_ttft_load_add(&load, 5, "", 1, 900);
    cs_wire_worker_status(&wm, &st, &load, &sb, &ws);
    ws.worker_id = "decode-0", ws.kv_endpoint = "127.0.0.1:7001", ws.ready = true;
    rc |= write_msg(dir, "status", M_STATUS, &ws.base);

    Chunkserve__V1__DecodeAdmitted ad = CHUNKSERVE__V1__DECODE_ADMITTED__INIT;
    ad.transfer_id = 5, ad.pages_reserved = 3, ad.kv_endpoint = "127.0.0.1:7001";
    Chunkserve__V1__DecodeResponse drs = CHUNKSERVE__V1__DECODE_RESPONSE__INIT;
    drs.event_case = CHUNKSERVE__V1__DECODE_RESPONSE__EVENT_ADMITTED, drs.admitted = &ad;
    rc |= write_msg(dir, "decode-response", M_DECODE_RESPONSE, &drs.base);
    Chunkserve__V1__CancelRequest cq = CHUNKSERVE__V1__CANCEL_REQUEST__INIT;
    cq.transfer_id = 5, cq.request_id = "r-3";
    rc |= write_msg(dir, "cancel", M_CANCEL, &cq.base);
    return rc;
}
#endif

#include "fuzz_main.h"
