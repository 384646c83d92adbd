/* test_sampling_fields: the table of scalar sampling fields
 * (chunkserve/sampling_fields.h) against the proto it names (every row is a
 * singular field of SamplingParams of its type, and every scalar field of
 * SamplingParams has a row), its defaults, its bounds, and the gRPC door's
 * walk over it (cs_wire_sampling): the copy, and refusals that carry the
 * field (cs_last_error_field). */
#include <math.h>

#include "chunkserve/error.h"
#include "chunkserve/sampler.h"
#include "chunkserve/sampling_fields.h"
#include "test.h"
#include "wire.h"

static ProtobufCType proto_type(cs_field_type t) {
    switch (t) {
    case CS_FIELD_FLOAT: return PROTOBUF_C_TYPE_FLOAT;
    case CS_FIELD_INT: return PROTOBUF_C_TYPE_INT32;
    case CS_FIELD_U64: return PROTOBUF_C_TYPE_UINT64;
    default: return PROTOBUF_C_TYPE_BOOL;
    }
}

static void check_table(void) {
    const ProtobufCMessageDescriptor *d = &chunkserve__v1__sampling_params__descriptor;
    for (size_t i = 0; i < cs_n_sampling_fields; i++) {
        const cs_sampling_field *f = &cs_sampling_fields[i];
        const ProtobufCFieldDescriptor *fd =
            protobuf_c_message_descriptor_get_field_by_name(d, f->name);
        ASSERT_TRUE(fd != NULL);
        ASSERT_EQ_INT(fd->type, proto_type(f->type));
        ASSERT_EQ_INT(fd->label, PROTOBUF_C_LABEL_NONE);
        ASSERT_TRUE(cs_sampling_field_find(f->name) == f);
        if (f->needs) ASSERT_EQ_INT(cs_sampling_field_find(f->needs)->type, CS_FIELD_BOOL);
        if (f->type == CS_FIELD_FLOAT || f->type == CS_FIELD_INT) {
            ASSERT_EQ_INT(cs_sampling_field_check(f, f->def, ""), 0); /* the default is valid */
        }
    }
    for (unsigned i = 0; i < d->n_fields; i++) { /* no scalar field without its row */
        const ProtobufCFieldDescriptor *fd = &d->fields[i];
        if (fd->label == PROTOBUF_C_LABEL_REPEATED || fd->type == PROTOBUF_C_TYPE_MESSAGE) continue;
        ASSERT_TRUE(cs_sampling_field_find(fd->name) != NULL);
    }
    ASSERT_TRUE(cs_sampling_field_find("no_such_field") == NULL);
}

static void check_bounds(void) {
    const cs_sampling_field *top_p = cs_sampling_field_find("top_p");
    ASSERT_EQ_INT(cs_sampling_field_check(top_p, 1, "sampling."), 0);
    ASSERT_EQ_INT(cs_sampling_field_check(top_p, 0, "sampling."), CS_EINVAL); /* (0, 1] */
    ASSERT_EQ_STR(cs_last_error_field(), "sampling.top_p");
    ASSERT_MSG_HAS(cs_last_error(), "sampling.top_p must be in (0, 1]");
    ASSERT_EQ_INT(cs_sampling_field_check(top_p, NAN, ""), CS_EINVAL);
    ASSERT_EQ_STR(cs_last_error_field(), "top_p");
    const cs_sampling_field *temp = cs_sampling_field_find("temperature");
    ASSERT_EQ_INT(cs_sampling_field_check(temp, 1e30, ""), 0);
    ASSERT_EQ_INT(cs_sampling_field_check(temp, INFINITY, ""), CS_EINVAL);
    ASSERT_EQ_INT(cs_sampling_field_check(temp, -0.5, ""), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), ">= 0 (0 = greedy)");
    /* cs_fail forgets the field; cs_fail_in names one only where none was */
    cs_fail(CS_EINVAL, "x");
    ASSERT_EQ_STR(cs_last_error_field(), "");
    ASSERT_EQ_INT(cs_fail_in(CS_EINVAL, "chat"), CS_EINVAL);
    ASSERT_EQ_STR(cs_last_error_field(), "chat");
    cs_fail_in(CS_EINVAL, "prompt");
    ASSERT_EQ_STR(cs_last_error_field(), "chat");
    ASSERT_EQ_STR(cs_last_error(), "x");
    /* the engine's check walks the same rows, naming the field without prefix */
    cs_sampling_params p = cs_sampling_params_default();
    ASSERT_EQ_INT(cs_sampling_params_check(&p), 0);
    ASSERT_NEAR(p.top_p, 1, 0);
    ASSERT_NEAR(p.repetition_penalty, 1, 0);
    ASSERT_NEAR(p.temperature, 0, 0);
    p.min_p = 1.5f;
    ASSERT_EQ_INT(cs_sampling_params_check(&p), CS_EINVAL);
    ASSERT_EQ_STR(cs_last_error_field(), "min_p");
}

static void check_wire(const cs_wire_model *wm) {
    const int32_t ctx = cs_model_get_config(wm->model)->ctx_len;
    cs_request q = {0};
    ASSERT_EQ_INT(cs_wire_sampling(wm, NULL, &q), 0); /* no params: every default */
    ASSERT_NEAR(q.sampling.top_p, 1, 0);
    ASSERT_NEAR(q.sampling.repetition_penalty, 1, 0);
    ASSERT_EQ_INT(q.stop.max_tokens, ctx);
    ASSERT_TRUE(q.stop.skip_special && !q.stop.ignore_eos && !q.logprobs);

    Chunkserve__V1__SamplingParams m = CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;
    m.temperature = 0.5f, m.top_k = 7, m.seed = 0xfedcba9876543210ull, m.max_tokens = 9;
    m.min_tokens = 3, m.include_special = 1, m.logprobs = 1, m.top_logprobs = 4;
    m.ignore_eos = 1, m.presence_penalty = -1.5f;
    memset(&q, 0, sizeof q);
    ASSERT_EQ_INT(cs_wire_sampling(wm, &m, &q), 0);
    ASSERT_NEAR(q.sampling.temperature, 0.5, 0);
    ASSERT_EQ_INT(q.sampling.top_k, 7);
    ASSERT_TRUE(q.sampling.seed == 0xfedcba9876543210ull); /* all 64 bits */
    ASSERT_EQ_INT(q.stop.max_tokens, 9);
    ASSERT_EQ_INT(q.stop.min_tokens, 3);
    ASSERT_TRUE(!q.stop.skip_special && q.stop.ignore_eos && q.logprobs);
    ASSERT_EQ_INT(q.top_logprobs, 4);
    ASSERT_NEAR(q.sampling.presence_penalty, -1.5, 0);

    /* each refusal names its proto field */
    Chunkserve__V1__SamplingParams b;
#define REFUSED(assign, field)                                                                     \
    do {                                                                                           \
        b = (Chunkserve__V1__SamplingParams)CHUNKSERVE__V1__SAMPLING_PARAMS__INIT;                 \
        assign;                                                                                    \
        memset(&q, 0, sizeof q);                                                                   \
        ASSERT_EQ_INT(cs_wire_sampling(wm, &b, &q), CS_EINVAL);                                    \
        ASSERT_EQ_STR(cs_last_error_field(), field);                                               \
    } while (0)
    REFUSED(b.top_p = -0.1f, "sampling.top_p");
    REFUSED(b.temperature = -1, "sampling.temperature");
    REFUSED(b.top_k = -1, "sampling.top_k"); /* -1 = off is the OpenAI door's, not the proto's */
    REFUSED(b.repetition_penalty = -2, "sampling.repetition_penalty");
    REFUSED(b.frequency_penalty = 2.5f, "sampling.frequency_penalty");
    REFUSED(b.max_tokens = -1, "sampling.max_tokens");
    REFUSED(b.top_logprobs = 21, "sampling.top_logprobs");
    REFUSED(b.top_logprobs = 2, "sampling.top_logprobs"); /* needs logprobs */
    ASSERT_MSG_HAS(cs_last_error(), "needs sampling.logprobs");
    REFUSED(b.prompt_top_logprobs = 2, "sampling.prompt_top_logprobs");
    REFUSED((b.max_tokens = 2, b.min_tokens = 3), "sampling.min_tokens");
    REFUSED(b.min_tokens = ctx + 1, "sampling.min_tokens"); /* beyond any context */
    int32_t ids[1] = {1 << 30};
    float vals[1] = {1};
    REFUSED((b.n_stop_token_ids = 1, b.stop_token_ids = ids), "sampling.stop_token_ids");
    REFUSED((b.n_logit_bias_ids = 1, b.logit_bias_ids = ids), "sampling.logit_bias_values");
    REFUSED((b.n_logit_bias_ids = b.n_logit_bias_values = 1, b.logit_bias_ids = ids,
             b.logit_bias_values = vals),
            "sampling.logit_bias_ids");
    ids[0] = 1, vals[0] = 101;
    REFUSED((b.n_logit_bias_ids = b.n_logit_bias_values = 1, b.logit_bias_ids = ids,
             b.logit_bias_values = vals),
            "sampling.logit_bias_values");
    char *stops[1] = {""};
    REFUSED((b.n_stop = 1, b.stop = stops), "sampling.stop");
#undef REFUSED
}

int main(void) {
    check_table();
    check_bounds();
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    cs_model *model;
    ASSERT_EQ_INT(cs_model_load(path, &model), 0);
    cs_wire_model wm;
    cs_wire_model_init(&wm, model, path);
    check_wire(&wm);
    cs_model_free(model);
    return 0;
}
