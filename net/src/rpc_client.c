/* rpc_client.c: the client side of the RPC layer: channels and unary or
 * server-streaming calls (one request message, any number of responses),
 * with deadlines, metadata, cancellation, callbacks on the loop thread.
 *
 * A call is three batches started together: (send headers + message +
 * half-close, receive headers), (receive status), and (receive one message),
 * the last re-armed after each message, so gRPC flow control paces a fast
 * server to the speed of our callbacks. on_done runs when all three have
 * completed, hence after the last message. Not here: client streaming,
 * retries, load balancing policy (gRPC's defaults apply). */
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <protobuf-c/protobuf-c.h>
#include <stdlib.h>
#include <string.h>

#include "rpc-impl.h"

enum { CS__DEFAULT_MAX_RECV = 4 << 20 };

struct cs_rpc_channel {
    cs_rpc_loop *loop;
    grpc_channel *ch;
    cs_rpc_client_call *calls; /* in flight, doubly linked */
    char **md;                 /* sent with every call: key, value, key, value, ... */
    size_t n_md;               /* pairs */
    bool freeing;
};

struct cs_rpc_client_call {
    cs_rpc_channel *ch;
    cs_rpc_client_call *prev, *next;
    grpc_call *call;
    cs__rpc_tag t_start, t_recv, t_status;
    int ops; /* batches in flight + the event being handled */
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array hdrs_in, trailers_in;
    cs__rpc_md_list md_out;
    grpc_status_code status;
    grpc_slice details;
    bool cancelled;
    cs_rpc_on_message on_message;
    cs_rpc_on_done on_done;
    void *data;
};

static void md_free(cs_rpc_channel *ch) {
    for (size_t i = 0; i < 2 * ch->n_md; i++)
        free(ch->md[i]);
    free(ch->md);
}

static void channel_destroy(cs_rpc_channel *ch) {
    cs_rpc_loop *l = ch->loop;
    grpc_channel_destroy(ch->ch);
    md_free(ch);
    free(ch);
    cs__rpc_loop_unref(l);
}

static void call_free(cs_rpc_client_call *c) {
    cs_rpc_channel *ch = c->ch;
    if (c->prev)
        c->prev->next = c->next;
    else if (ch->calls == c)
        ch->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    if (c->call) grpc_call_unref(c->call);
    if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
    if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
    grpc_metadata_array_destroy(&c->hdrs_in);
    grpc_metadata_array_destroy(&c->trailers_in);
    cs__rpc_md_free(&c->md_out);
    grpc_slice_unref(c->details);
    free(c);
    if (ch->freeing && !ch->calls) channel_destroy(ch);
}

static void call_maybe_done(cs_rpc_client_call *c) {
    if (c->ops > 0) return;
    char *msg = grpc_slice_to_c_string(c->details);
    c->on_done(c, (int)c->status, msg ? msg : "", c->data);
    gpr_free(msg);
    call_free(c);
}

static void start_batch(cs_rpc_client_call *c, const grpc_op *ops, size_t n, cs__rpc_tag *tag) {
    cs__rpc_loop_begin(c->ch->loop);
    c->ops++;
    grpc_call_error err = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (err != GRPC_CALL_OK) {
        /* Only a bug in this file's sequencing can get here. */
        CS_LOGE("rpc: grpc_call_start_batch: %s", grpc_call_error_to_string(err));
        CS_ASSERT(err == GRPC_CALL_OK);
    }
}

static void arm_recv(cs_rpc_client_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    start_batch(c, &op, 1, &c->t_recv);
}

static void on_start(cs__rpc_tag *t, bool ok) {
    (void)ok; /* a failed send shows in the status */
    cs_rpc_client_call *c = CS__CONTAINER_OF(t, cs_rpc_client_call, t_start);
    grpc_byte_buffer_destroy(c->send_bb);
    c->send_bb = NULL;
    c->ops--;
    call_maybe_done(c);
}

static void on_recv(cs__rpc_tag *t, bool ok) {
    cs_rpc_client_call *c = CS__CONTAINER_OF(t, cs_rpc_client_call, t_recv);
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    if (ok && bb) {
        grpc_slice s;
        if (!cs__rpc_bb_flatten(bb, &s)) {
            grpc_call_cancel_with_status(c->call, GRPC_STATUS_INTERNAL,
                                         "undecodable response message", NULL);
            c->cancelled = true;
        } else {
            if (!c->cancelled && c->on_message)
                c->on_message(c, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), c->data);
            grpc_slice_unref(s);
        }
        if (!c->cancelled) arm_recv(c);
    }
    if (bb) grpc_byte_buffer_destroy(bb);
    c->ops--;
    call_maybe_done(c);
}

static void on_status(cs__rpc_tag *t, bool ok) {
    (void)ok;
    cs_rpc_client_call *c = CS__CONTAINER_OF(t, cs_rpc_client_call, t_status);
    c->ops--;
    call_maybe_done(c);
}

static int call_start(cs_rpc_channel *ch, const char *method, grpc_byte_buffer *bb,
                      const cs_rpc_call_opts *o, cs_rpc_on_message on_message,
                      cs_rpc_on_done on_done, void *data, cs_rpc_client_call **out) {
    if (out) *out = NULL;
    int rc = 0;
    if (ch->freeing) {
        rc = cs_fail(CS_ECANCELED, "rpc: channel is being freed");
        goto fail_early;
    }
    if (!method || method[0] != '/' || !on_done) {
        rc =
            cs_fail(CS_EINVAL, "rpc: a method path (/pkg.Service/Method) and on_done are required");
        goto fail_early;
    }
    cs_rpc_client_call *c = calloc(1, sizeof *c);
    if (!c) {
        rc = cs_fail(CS_ENOMEM, "rpc: out of memory");
        goto fail_early;
    }
    c->ch = ch;
    c->send_bb = bb;
    c->details = grpc_empty_slice();
    c->status = GRPC_STATUS_UNKNOWN;
    c->t_start.fn = on_start;
    c->t_recv.fn = on_recv;
    c->t_status.fn = on_status;
    c->on_message = on_message;
    c->on_done = on_done;
    c->data = data;
    grpc_metadata_array_init(&c->hdrs_in);
    grpc_metadata_array_init(&c->trailers_in);
    for (size_t i = 0; i < ch->n_md; i++)
        if ((rc = cs__rpc_md_add(&c->md_out, ch->md[2 * i], ch->md[2 * i + 1])) != 0) goto fail;
    for (size_t i = 0; o && i < o->n_metadata; i++)
        if ((rc = cs__rpc_md_add(&c->md_out, o->metadata[i].key, o->metadata[i].value)) != 0)
            goto fail;

    gpr_timespec deadline = gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (o && o->timeout_ms > 0)
        deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                gpr_time_from_millis(o->timeout_ms, GPR_TIMESPAN));
    grpc_slice mslice = grpc_slice_from_copied_string(method);
    c->call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, ch->loop->cq, mslice,
                                       NULL, deadline, NULL);
    grpc_slice_unref(mslice);
    if (!c->call) {
        rc = cs_fail(CS_EIO, "rpc: cannot create a call to %s", method);
        goto fail;
    }

    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->md_out.n;
    ops[0].data.send_initial_metadata.metadata = c->md_out.md;
    if (o && o->wait_for_ready)
        ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY |
                       GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = c->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->hdrs_in;
    cs__rpc_loop_begin(ch->loop);
    grpc_call_error err = grpc_call_start_batch(c->call, ops, 4, &c->t_start, NULL);
    if (err != GRPC_CALL_OK) {
        cs__rpc_loop_end(ch->loop);
        rc = cs_fail(CS_EIO, "rpc: %s: %s", method, grpc_call_error_to_string(err));
        goto fail;
    }
    c->ops++;
    c->next = ch->calls;
    if (ch->calls) ch->calls->prev = c;
    ch->calls = c;

    grpc_op st;
    memset(&st, 0, sizeof st);
    st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    st.data.recv_status_on_client.trailing_metadata = &c->trailers_in;
    st.data.recv_status_on_client.status = &c->status;
    st.data.recv_status_on_client.status_details = &c->details;
    start_batch(c, &st, 1, &c->t_status);
    arm_recv(c);
    if (out) *out = c;
    return 0;

fail:
    if (c->call) grpc_call_unref(c->call);
    grpc_metadata_array_destroy(&c->hdrs_in);
    grpc_metadata_array_destroy(&c->trailers_in);
    cs__rpc_md_free(&c->md_out);
    free(c);
fail_early:
    grpc_byte_buffer_destroy(bb);
    return rc;
}

int cs_rpc_channel_call(cs_rpc_channel *ch, const char *method, const uint8_t *req, size_t len,
                        const cs_rpc_call_opts *o, cs_rpc_on_message on_message,
                        cs_rpc_on_done on_done, void *data, cs_rpc_client_call **out) {
    return call_start(ch, method, cs__rpc_bb_from_bytes(req, len), o, on_message, on_done, data,
                      out);
}

int cs_rpc_channel_call_msg(cs_rpc_channel *ch, const char *method,
                            const struct ProtobufCMessage *req, const cs_rpc_call_opts *o,
                            cs_rpc_on_message on_message, cs_rpc_on_done on_done, void *data,
                            cs_rpc_client_call **out) {
    return call_start(ch, method, cs__rpc_bb_from_msg(req, NULL), o, on_message, on_done, data,
                      out);
}

void cs_rpc_client_call_cancel(cs_rpc_client_call *c) {
    if (c->cancelled) return;
    c->cancelled = true;
    grpc_call_cancel(c->call, NULL);
}

const char *cs_rpc_client_call_metadata(const cs_rpc_client_call *c, const char *key, size_t *len) {
    const char *v = cs__rpc_md_find(&c->hdrs_in, key, len);
    return v ? v : cs__rpc_md_find(&c->trailers_in, key, len);
}

int cs_rpc_channel_set_metadata(cs_rpc_channel *ch, const char *key, const char *value) {
    for (size_t i = 0; i < ch->n_md; i++) {
        if (strcmp(ch->md[2 * i], key)) continue;
        char *v = strdup(value);
        if (!v) return cs_fail(CS_ENOMEM, "rpc: out of memory");
        free(ch->md[2 * i + 1]);
        ch->md[2 * i + 1] = v;
        return 0;
    }
    return cs_fail(CS_ENOENT, "rpc: the channel sends no metadata '%s'", key);
}

int cs_rpc_channel_init(cs_rpc_loop *l, const char *target, const cs_rpc_channel_opts *o,
                        cs_rpc_channel **out) {
    *out = NULL;
    if (!target || !*target) return cs_fail(CS_EINVAL, "rpc: channel target is required");
    cs_rpc_channel *ch = calloc(1, sizeof *ch);
    if (!ch) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    ch->loop = l;
    if (o && o->n_metadata && !(ch->md = calloc(2 * o->n_metadata, sizeof *ch->md))) {
        free(ch);
        return cs_fail(CS_ENOMEM, "rpc: out of memory");
    }
    for (size_t i = 0; o && i < o->n_metadata; i++, ch->n_md++)
        if (!(ch->md[2 * i] = strdup(o->metadata[i].key)) ||
            !(ch->md[2 * i + 1] = strdup(o->metadata[i].value))) {
            ch->n_md++;
            md_free(ch);
            free(ch);
            return cs_fail(CS_ENOMEM, "rpc: out of memory");
        }
    grpc_arg args[2];
    memset(args, 0, sizeof args);
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = o && o->max_recv_bytes > 0 ? o->max_recv_bytes : CS__DEFAULT_MAX_RECV;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = o && o->max_send_bytes > 0 ? o->max_send_bytes : -1;
    grpc_arg name_arg = {GRPC_ARG_STRING,
                         (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                         {.string = o ? (char *)o->tls.server_name : NULL}};
    grpc_arg all[3] = {args[0], args[1], name_arg};
    bool named =
        o && o->tls.ca_file && o->tls.ca_file[0] && o->tls.server_name && o->tls.server_name[0];
    grpc_channel_args ca = {named ? 3 : 2, all};
    grpc_channel_credentials *creds = NULL;
    static const cs_rpc_tls plain = {0};
    int rc = cs__rpc_loop_channel_creds(l, o ? &o->tls : &plain, &creds);
    if (rc) {
        md_free(ch);
        free(ch);
        return rc;
    }
    ch->ch = grpc_channel_create(target, creds, &ca);
    cs__rpc_loop_creds_release(l, creds);
    if (!ch->ch) {
        md_free(ch);
        free(ch);
        return cs_fail(CS_EINVAL, "rpc: cannot create a channel to '%s'", target);
    }
    cs__rpc_loop_ref(l);
    *out = ch;
    return 0;
}

void cs_rpc_channel_free(cs_rpc_channel *ch) {
    if (!ch || ch->freeing) return;
    ch->freeing = true;
    if (!ch->calls) {
        channel_destroy(ch);
        return;
    }
    for (cs_rpc_client_call *c = ch->calls; c; c = c->next)
        cs_rpc_client_call_cancel(c);
}
