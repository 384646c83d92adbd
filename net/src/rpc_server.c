/* rpc_server.c: the server side of the RPC layer: registered methods (unary
 * and server-streaming, one request message each) plus a generic slot that
 * answers unknown methods UNIMPLEMENTED at once (without it they would hang
 * until their deadline), per-call send queues, cancellation, and shutdown
 * with calls in flight. Runs entirely on the loop thread (rpc_loop.c).
 *
 * A call's life: a request slot (grpc_server_request_*call) fires; we start
 * RECV_CLOSE_ON_SERVER at once (it completes when the call ends, with
 * cancelled=1 if it died), unpack the request and hand it to the handler,
 * which owns it until cs_rpc_call_finish. Writes leave one batch at a time:
 * [initial metadata] + message [+ status when it is the last one]. The call
 * is released when the handler has finished it, no batch is in flight and
 * RECV_CLOSE has completed. c->ops counts batches in flight plus the event
 * being handled, so a callback that finishes the call never frees it under
 * our feet. Not here: services, TLS, client or bidirectional streaming. */
#include <grpc/grpc_security.h>
#include <protobuf-c/protobuf-c.h>
#include <stdlib.h>
#include <string.h>

#include "rpc-impl.h"

enum { CS__SLOTS_PER_METHOD = 2, CS__DEFAULT_MAX_RECV = 4 << 20 };

typedef struct {
    char *path;
    enum cs_rpc_method_kind kind;
    const ProtobufCMessageDescriptor *desc;
    cs_rpc_handler handler;
    void *data;
    void *handle; /* grpc_server_register_method's */
} cs__rpc_method;

typedef struct cs__rpc_wmsg {
    struct cs__rpc_wmsg *next;
    grpc_byte_buffer *bb;
    size_t len;
} cs__rpc_wmsg;

struct cs_rpc_server {
    cs_rpc_loop *loop;
    grpc_server *server;
    char *addr;
    cs__rpc_method *methods; /* (n_methods) */
    int n_methods;
    cs_rpc_call *calls; /* live calls, doubly linked */
    int64_t n_slots;    /* request slots handed to gRPC */
    bool started, shutting_down, shutdown_notified, destroyed;
    cs__rpc_tag t_shutdown;
    uv_timer_t grace_timer;
    cs_rpc_done_cb done;
    void *done_data;
    cs_rpc_limits lim;              /* defaults resolved */
    grpc_server_credentials *creds; /* TLS; NULL = plaintext */
    grpc_resource_quota *quota;     /* until the server holds it */
};

int64_t cs__rpc_server_max_watches(const cs_rpc_server *s) {
    return s->lim.max_watches;
}

struct cs_rpc_call {
    cs_rpc_server *srv;
    cs__rpc_method *m; /* NULL: the generic slot (an unknown method) */
    cs_rpc_call *prev, *next;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array req_md;
    grpc_byte_buffer *payload;
    grpc_call_details details; /* generic slot only */
    grpc_slice req;            /* the flattened request */
    ProtobufCMessage *req_msg;

    cs__rpc_tag t_new, t_close, t_write;
    int close_cancelled;
    int ops;        /* batches in flight + the event being handled */
    bool app_owned; /* with the handler, not finished yet */
    bool dead;      /* cancelled or failed: nothing more goes out */
    bool closed;    /* RECV_CLOSE_ON_SERVER completed */
    bool hdr_sent, status_queued, status_started, write_busy;
    cs__rpc_wmsg *q_head, *q_tail;
    size_t q_bytes;
    int64_t n_queued; /* messages ever queued */
    grpc_byte_buffer *w_bb;
    int status;
    char *status_msg;
    cs__rpc_md_list hdrs, trailers;
    cs_rpc_call_cb on_cancel, on_drain;
    void *cancel_data, *drain_data, *user;
};

static void on_new_call(cs__rpc_tag *t, bool ok);
static void server_maybe_finish(cs_rpc_server *s);

/* ------------------------------------------------------------- calls -- */

static void call_free(cs_rpc_call *c) {
    cs_rpc_server *s = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else if (s->calls == c)
        s->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    for (cs__rpc_wmsg *w = c->q_head, *n; w; w = n) {
        n = w->next;
        grpc_byte_buffer_destroy(w->bb);
        free(w);
    }
    if (c->w_bb) grpc_byte_buffer_destroy(c->w_bb);
    if (c->payload) grpc_byte_buffer_destroy(c->payload);
    if (c->req_msg) protobuf_c_message_free_unpacked(c->req_msg, NULL);
    grpc_slice_unref(c->req);
    grpc_metadata_array_destroy(&c->req_md);
    grpc_call_details_destroy(&c->details);
    cs__rpc_md_free(&c->hdrs);
    cs__rpc_md_free(&c->trailers);
    free(c->status_msg);
    if (c->call) grpc_call_unref(c->call);
    free(c);
}

static void call_maybe_release(cs_rpc_call *c) {
    if (c->app_owned || c->ops > 0 || !c->closed) return;
    cs_rpc_server *s = c->srv;
    call_free(c);
    server_maybe_finish(s);
}

static void drop_queue(cs_rpc_call *c) {
    for (cs__rpc_wmsg *w = c->q_head, *n; w; w = n) {
        n = w->next;
        grpc_byte_buffer_destroy(w->bb);
        free(w);
    }
    c->q_head = c->q_tail = NULL;
    c->q_bytes = 0;
}

/* The call died; tells the handler once. Callers hold c->ops. */
static void call_mark_dead(cs_rpc_call *c) {
    if (c->dead) return;
    c->dead = true;
    drop_queue(c);
    c->on_drain = NULL;
    cs_rpc_call_cb cb = c->on_cancel;
    c->on_cancel = NULL;
    if (c->app_owned && cb) cb(c, c->cancel_data);
}

static void start_batch(cs_rpc_call *c, const grpc_op *ops, size_t n, cs__rpc_tag *tag) {
    cs__rpc_loop_begin(c->srv->loop);
    c->ops++;
    grpc_call_error err = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (err != GRPC_CALL_OK) {
        /* Only a bug in this file's sequencing can get here. */
        CS_LOGE("rpc: grpc_call_start_batch: %s", grpc_call_error_to_string(err));
        CS_ASSERT(err == GRPC_CALL_OK);
    }
}

/* Starts the next write if none is in flight: [headers] + message [+ status],
 * or [headers] + status when nothing is queued. */
static void call_pump(cs_rpc_call *c) {
    if (c->write_busy || c->dead || c->status_started) return;
    if (!c->q_head && !c->status_queued) return;
    grpc_op ops[3];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    if (!c->hdr_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[n].data.send_initial_metadata.count = c->hdrs.n;
        ops[n].data.send_initial_metadata.metadata = c->hdrs.md;
        n++;
        c->hdr_sent = true;
    }
    if (c->q_head) {
        cs__rpc_wmsg *w = c->q_head;
        c->q_head = w->next;
        if (!c->q_head) c->q_tail = NULL;
        c->q_bytes -= w->len;
        c->w_bb = w->bb;
        free(w);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        /* More behind it: let the transport coalesce; the last one flushes. */
        ops[n].flags = c->q_head ? GRPC_WRITE_BUFFER_HINT : 0;
        ops[n].data.send_message.send_message = c->w_bb;
        n++;
    }
    grpc_slice details = grpc_empty_slice();
    if (!c->q_head && c->status_queued) {
        details = grpc_slice_from_copied_string(c->status_msg ? c->status_msg : "");
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = (grpc_status_code)c->status;
        ops[n].data.send_status_from_server.status_details = &details;
        ops[n].data.send_status_from_server.trailing_metadata_count = c->trailers.n;
        ops[n].data.send_status_from_server.trailing_metadata = c->trailers.md;
        n++;
        c->status_started = true;
    }
    c->write_busy = true;
    start_batch(c, ops, n, &c->t_write);
    grpc_slice_unref(details); /* the call took its own reference */
}

static void on_write(cs__rpc_tag *t, bool ok) {
    cs_rpc_call *c = CS__CONTAINER_OF(t, cs_rpc_call, t_write);
    c->write_busy = false;
    if (c->w_bb) grpc_byte_buffer_destroy(c->w_bb);
    c->w_bb = NULL;
    if (!ok)
        call_mark_dead(c);
    else
        call_pump(c);
    if (!c->dead && c->app_owned && !c->write_busy && !c->q_head && c->on_drain) {
        cs_rpc_call_cb cb = c->on_drain;
        c->on_drain = NULL;
        cb(c, c->drain_data);
    }
    c->ops--;
    call_maybe_release(c);
}

static void on_close(cs__rpc_tag *t, bool ok) {
    cs_rpc_call *c = CS__CONTAINER_OF(t, cs_rpc_call, t_close);
    c->closed = true;
    if (!ok || c->close_cancelled) call_mark_dead(c);
    c->ops--;
    call_maybe_release(c);
}

/* Ends a call the handler never saw (unknown method, bad request). */
static void call_answer(cs_rpc_call *c, int code, const char *msg) {
    free(c->status_msg);
    c->status_msg = strdup(msg);
    c->status = code;
    c->status_queued = true;
    call_pump(c);
}

static int call_enqueue(cs_rpc_call *c, grpc_byte_buffer *bb, size_t len) {
    cs__rpc_wmsg *w = malloc(sizeof *w);
    if (!w) {
        grpc_byte_buffer_destroy(bb);
        return cs_fail(CS_ENOMEM, "rpc: out of memory");
    }
    w->next = NULL;
    w->bb = bb;
    w->len = len;
    if (c->q_tail)
        c->q_tail->next = w;
    else
        c->q_head = w;
    c->q_tail = w;
    c->q_bytes += len;
    c->n_queued++;
    return 0;
}

static int send_check(const cs_rpc_call *c) {
    CS_ASSERT(c->app_owned);
    if (c->dead) return cs_fail(CS_ECANCELED, "rpc: %s: call cancelled", c->m->path);
    if (c->m->kind == CS_RPC_UNARY && c->n_queued > 0)
        return cs_fail(CS_EINVAL, "rpc: %s: unary call answers one message", c->m->path);
    return 0;
}

/* ------------------------------------------------------ request slots -- */

static int request_slot(cs_rpc_server *s, cs__rpc_method *m) {
    cs_rpc_call *c = calloc(1, sizeof *c);
    if (!c) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    c->srv = s;
    c->m = m;
    c->req = grpc_empty_slice();
    c->t_new.fn = on_new_call;
    c->t_close.fn = on_close;
    c->t_write.fn = on_write;
    grpc_metadata_array_init(&c->req_md);
    grpc_call_details_init(&c->details);
    cs_rpc_loop *l = s->loop;
    cs__rpc_loop_begin(l);
    grpc_call_error err;
    if (m)
        err = grpc_server_request_registered_call(s->server, m->handle, &c->call, &c->deadline,
                                                  &c->req_md, &c->payload, l->cq, l->cq, &c->t_new);
    else
        err = grpc_server_request_call(s->server, &c->call, &c->details, &c->req_md, l->cq, l->cq,
                                       &c->t_new);
    if (err != GRPC_CALL_OK) {
        cs__rpc_loop_end(l);
        grpc_metadata_array_destroy(&c->req_md);
        grpc_call_details_destroy(&c->details);
        free(c);
        return cs_fail(CS_EIO, "rpc: request call: %s", grpc_call_error_to_string(err));
    }
    s->n_slots++;
    return 0;
}

/* Checks and unpacks the request. Returns a status code for the client. */
static int call_read_request(cs_rpc_call *c, const char **why) {
    if (!c->payload) {
        *why = "missing request message";
        return CS_RPC_INVALID_ARGUMENT;
    }
    if (!cs__rpc_bb_flatten(c->payload, &c->req)) {
        *why = "unreadable request message (compression)";
        return CS_RPC_INVALID_ARGUMENT;
    }
    grpc_byte_buffer_destroy(c->payload);
    c->payload = NULL;
    if (c->m->desc) {
        c->req_msg = protobuf_c_message_unpack(c->m->desc, NULL, GRPC_SLICE_LENGTH(c->req),
                                               GRPC_SLICE_START_PTR(c->req));
        if (!c->req_msg) {
            *why = "malformed request message";
            return CS_RPC_INVALID_ARGUMENT;
        }
    }
    return CS_RPC_OK;
}

static void on_new_call(cs__rpc_tag *t, bool ok) {
    cs_rpc_call *c = CS__CONTAINER_OF(t, cs_rpc_call, t_new);
    cs_rpc_server *s = c->srv;
    s->n_slots--;
    if (!ok) { /* the server is shutting down: the slot comes back unused */
        c->closed = true;
        call_free(c);
        server_maybe_finish(s);
        return;
    }
    c->next = s->calls;
    if (s->calls) s->calls->prev = c;
    s->calls = c;
    if (!s->shutting_down && request_slot(s, c->m) != 0)
        CS_LOGE("rpc: cannot re-arm a request slot: %s", cs_last_error());

    c->ops++; /* hold while we handle it */
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    start_batch(c, &op, 1, &c->t_close);

    if (!c->m) {
        char msg[300];
        snprintf(msg, sizeof msg, "unknown method %.*s", (int)GRPC_SLICE_LENGTH(c->details.method),
                 (const char *)GRPC_SLICE_START_PTR(c->details.method));
        call_answer(c, CS_RPC_UNIMPLEMENTED, msg);
    } else if (s->shutting_down) {
        call_answer(c, CS_RPC_UNAVAILABLE, "server is shutting down");
    } else {
        const char *why = NULL;
        int code = call_read_request(c, &why);
        if (code != CS_RPC_OK) {
            char msg[300];
            snprintf(msg, sizeof msg, "%s: %s%s%s", c->m->path, why,
                     c->m->desc ? ", expected " : "", c->m->desc ? c->m->desc->name : "");
            call_answer(c, code, msg);
        } else {
            c->app_owned = true;
            c->m->handler(c, c->m->data);
        }
    }
    c->ops--;
    call_maybe_release(c);
}

/* ------------------------------------------------------- handler API -- */

const uint8_t *cs_rpc_call_request(const cs_rpc_call *c, size_t *len) {
    *len = GRPC_SLICE_LENGTH(c->req);
    return GRPC_SLICE_START_PTR(c->req);
}

const struct ProtobufCMessage *cs_rpc_call_request_msg(const cs_rpc_call *c) {
    return c->req_msg;
}

const char *cs_rpc_call_method(const cs_rpc_call *c) {
    return c->m ? c->m->path : "";
}

int64_t cs_rpc_call_deadline_ms(const cs_rpc_call *c) {
    gpr_timespec d = c->deadline;
    if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0) return INT64_MAX;
    d = gpr_convert_clock_type(d, GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

const char *cs_rpc_call_metadata(const cs_rpc_call *c, const char *key, size_t *len) {
    return cs__rpc_md_find(&c->req_md, key, len);
}

int cs_rpc_call_add_header(cs_rpc_call *c, const char *key, const char *value) {
    if (c->hdr_sent || !c->app_owned)
        return cs_fail(CS_EINVAL, "rpc: header '%s' after the first message", key);
    return cs__rpc_md_add(&c->hdrs, key, value);
}

int cs_rpc_call_add_trailer(cs_rpc_call *c, const char *key, const char *value) {
    if (c->status_queued || !c->app_owned)
        return cs_fail(CS_EINVAL, "rpc: trailer '%s' after finish", key);
    return cs__rpc_md_add(&c->trailers, key, value);
}

int cs_rpc_call_add_trailer_bytes(cs_rpc_call *c, const char *key, const void *value, size_t len) {
    if (c->status_queued || !c->app_owned)
        return cs_fail(CS_EINVAL, "rpc: trailer '%s' after finish", key);
    return cs__rpc_md_add_bytes(&c->trailers, key, value, len);
}

void cs_rpc_call_set_data(cs_rpc_call *c, void *data) {
    c->user = data;
}
void *cs_rpc_call_get_data(const cs_rpc_call *c) {
    return c->user;
}

int cs_rpc_call_on_cancel(cs_rpc_call *c, cs_rpc_call_cb cb, void *data) {
    CS_ASSERT(c->app_owned);
    if (c->dead) return cs_fail(CS_ECANCELED, "rpc: %s: call cancelled", c->m->path);
    c->on_cancel = cb;
    c->cancel_data = data;
    return 0;
}

bool cs_rpc_call_is_cancelled(const cs_rpc_call *c) {
    return c->dead;
}

int cs_rpc_call_on_drain(cs_rpc_call *c, cs_rpc_call_cb cb, void *data) {
    CS_ASSERT(c->app_owned);
    if (c->dead) return cs_fail(CS_ECANCELED, "rpc: %s: call cancelled", c->m->path);
    c->on_drain = cb;
    c->drain_data = data;
    return 0;
}

int cs_rpc_call_send(cs_rpc_call *c, const uint8_t *buf, size_t len) {
    int rc = send_check(c);
    if (rc) return rc;
    grpc_byte_buffer *bb = cs__rpc_bb_from_bytes(buf, len);
    if ((rc = call_enqueue(c, bb, len)) != 0) return rc;
    call_pump(c);
    return 0;
}

int cs_rpc_call_send_msg(cs_rpc_call *c, const struct ProtobufCMessage *m) {
    int rc = send_check(c);
    if (rc) return rc;
    size_t len;
    grpc_byte_buffer *bb = cs__rpc_bb_from_msg(m, &len);
    if ((rc = call_enqueue(c, bb, len)) != 0) return rc;
    call_pump(c);
    return 0;
}

size_t cs_rpc_call_pending_bytes(const cs_rpc_call *c) {
    return c->q_bytes;
}

static int call_finish(cs_rpc_call *c, int code, const char *message) {
    c->app_owned = false;
    c->on_cancel = c->on_drain = NULL;
    if (c->dead) {
        call_maybe_release(c);
        return CS_ECANCELED;
    }
    c->status = code;
    c->status_msg = message ? strdup(message) : NULL;
    c->status_queued = true;
    c->ops++;
    call_pump(c);
    c->ops--;
    call_maybe_release(c);
    return 0;
}

int cs_rpc_call_finish(cs_rpc_call *c, int code, const char *message) {
    CS_ASSERT(c->app_owned); /* finished twice, or a call the handler never had */
    if (c->m->kind == CS_RPC_UNARY && code == CS_RPC_OK && c->n_queued == 0) {
        /* Clients would fail it anyway ("no message"); say why. */
        CS_LOGE("rpc: %s: handler finished OK without a reply", c->m->path);
        code = CS_RPC_INTERNAL;
        message = "the server sent no reply";
    }
    return call_finish(c, code, message);
}

int cs_rpc_call_reply_msg(cs_rpc_call *c, const struct ProtobufCMessage *m) {
    CS_ASSERT(c->app_owned);
    int rc = send_check(c);
    if (rc) {
        call_finish(c, CS_RPC_INTERNAL, "reply failed");
        return rc;
    }
    size_t len;
    grpc_byte_buffer *bb = cs__rpc_bb_from_msg(m, &len);
    if ((rc = call_enqueue(c, bb, len)) != 0) {
        call_finish(c, CS_RPC_INTERNAL, "out of memory");
        return rc;
    }
    /* Queued before the status, so message and status leave in one batch. */
    return call_finish(c, CS_RPC_OK, NULL);
}

/* ------------------------------------------------------------ server -- */

int cs_rpc_server_init(cs_rpc_loop *l, const cs_rpc_server_opts *o, cs_rpc_server **out) {
    *out = NULL;
    if (!o || !o->addr || !*o->addr) return cs_fail(CS_EINVAL, "rpc: server address is required");
    cs_rpc_server *s = calloc(1, sizeof *s);
    if (!s) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    s->loop = l;
    s->t_shutdown.fn = NULL;
    if (!(s->addr = strdup(o->addr))) goto fail_addr;
    int rc = cs__rpc_server_creds(&o->tls, &s->creds);
    if (rc) {
        free(s->addr);
        free(s);
        return rc;
    }

    cs_rpc_limits lim = o->lim;
    if (!lim.max_streams) lim.max_streams = 4096;
    if (!lim.memory_mib) lim.memory_mib = 512;
    if (!lim.idle_ms) lim.idle_ms = 300000;
    if (!lim.age_grace_ms) lim.age_grace_ms = 60000;
    if (!lim.max_watches) lim.max_watches = 256;
    if (!lim.keepalive_ms) lim.keepalive_ms = 60000;
    if (!lim.keepalive_timeout_ms) lim.keepalive_timeout_ms = 20000;
    s->lim = lim;
    if (!(s->quota = grpc_resource_quota_create(s->addr))) goto fail_server;
    grpc_resource_quota_resize(s->quota, (size_t)lim.memory_mib << 20);
    grpc_arg args[12];
    int n = 0;
#define INT_ARG(k, v)                                                                              \
    args[n].type = GRPC_ARG_INTEGER, args[n].key = (char *)(k), args[n++].value.integer = (int)(v)
    INT_ARG(GRPC_ARG_ALLOW_REUSEPORT, 0);
    INT_ARG(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
            o->max_recv_bytes > 0 ? o->max_recv_bytes : CS__DEFAULT_MAX_RECV);
    INT_ARG(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, o->max_send_bytes > 0 ? o->max_send_bytes : 64 << 20);
    /* Find dead, partitioned or silent clients in keepalive + timeout, not
     * gRPC's default two hours: their calls (and anything queued for them,
     * a decode worker's KV pages) are then released. */
    INT_ARG(GRPC_ARG_KEEPALIVE_TIME_MS, lim.keepalive_ms);
    INT_ARG(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, lim.keepalive_timeout_ms);
    INT_ARG(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0); /* keep pinging a stream that waits */
    INT_ARG(GRPC_ARG_MAX_CONCURRENT_STREAMS,
            lim.max_streams > INT32_MAX ? INT32_MAX : lim.max_streams);
    INT_ARG(GRPC_ARG_MAX_METADATA_SIZE, 16 << 10);
    if (lim.idle_ms > 0) INT_ARG(GRPC_ARG_MAX_CONNECTION_IDLE_MS, lim.idle_ms);
    if (lim.age_ms > 0) {
        INT_ARG(GRPC_ARG_MAX_CONNECTION_AGE_MS, lim.age_ms);
        INT_ARG(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, lim.age_grace_ms);
    }
#undef INT_ARG
    args[n].type = GRPC_ARG_POINTER;
    args[n].key = (char *)GRPC_ARG_RESOURCE_QUOTA;
    args[n].value.pointer.p = s->quota;
    args[n++].value.pointer.vtable = grpc_resource_quota_arg_vtable();
    CS_ASSERT(n <= (int)(sizeof args / sizeof args[0]));
    grpc_channel_args ca = {(size_t)n, args};
    s->server = grpc_server_create(&ca, NULL);
    grpc_resource_quota_unref(s->quota); /* the server holds its own reference */
    s->quota = NULL;
    if (!s->server) goto fail_server;
    grpc_server_register_completion_queue(s->server, l->cq, NULL);
    if (uv_timer_init(l->uv, &s->grace_timer) != 0) goto fail_timer;
    s->grace_timer.data = s;
    cs__rpc_loop_ref(l);
    *out = s;
    return 0;

fail_timer:
    grpc_server_destroy(s->server);
fail_server:
    if (s->creds) grpc_server_credentials_release(s->creds);
    free(s->addr);
fail_addr:
    free(s);
    return cs_fail(CS_ENOMEM, "rpc: cannot create the server");
}

int cs_rpc_server_add_method(cs_rpc_server *s, const char *path, enum cs_rpc_method_kind kind,
                             const struct ProtobufCMessageDescriptor *req_desc,
                             cs_rpc_handler handler, void *data) {
    if (s->started) return cs_fail(CS_EINVAL, "rpc: add_method '%s' after start", path);
    if (!path || path[0] != '/' || !strchr(path + 1, '/') || !handler)
        return cs_fail(CS_EINVAL, "rpc: bad method path '%s' (want /package.Service/Method)",
                       path ? path : "(null)");
    for (int i = 0; i < s->n_methods; i++)
        if (strcmp(s->methods[i].path, path) == 0)
            return cs_fail(CS_EINVAL, "rpc: method '%s' registered twice", path);
    cs__rpc_method *ms = realloc(s->methods, (size_t)(s->n_methods + 1) * sizeof *ms);
    if (!ms) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    s->methods = ms;
    cs__rpc_method *m = &ms[s->n_methods];
    memset(m, 0, sizeof *m);
    if (!(m->path = strdup(path))) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    m->handle = grpc_server_register_method(s->server, m->path, NULL,
                                            GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle) {
        free(m->path);
        return cs_fail(CS_EINVAL, "rpc: gRPC refused method '%s'", path);
    }
    m->kind = kind;
    m->desc = req_desc;
    m->handler = handler;
    m->data = data;
    s->n_methods++;
    return 0;
}

int cs_rpc_server_start(cs_rpc_server *s, int *port) {
    if (s->started || s->shutting_down) return cs_fail(CS_EINVAL, "rpc: server started twice");
    grpc_server_credentials *creds =
        s->creds ? s->creds : grpc_insecure_server_credentials_create();
    int p = grpc_server_add_http2_port(s->server, s->addr, creds);
    grpc_server_credentials_release(creds);
    s->creds = NULL;
    if (p <= 0)
        return cs_fail(CS_EBUSY, "rpc: cannot listen on %s (in use, or a bad address)", s->addr);
    grpc_server_start(s->server);
    s->started = true;
    int rc = 0;
    for (int i = 0; i < s->n_methods && rc == 0; i++)
        for (int k = 0; k < CS__SLOTS_PER_METHOD && rc == 0; k++)
            rc = request_slot(s, &s->methods[i]);
    if (rc == 0) rc = request_slot(s, NULL);
    if (rc) return rc;
    if (port) *port = p;
    return 0;
}

static void on_server_closed(uv_handle_t *h) {
    cs_rpc_server *s = h->data;
    cs_rpc_loop *l = s->loop;
    cs_rpc_done_cb done = s->done;
    void *done_data = s->done_data;
    for (int i = 0; i < s->n_methods; i++)
        free(s->methods[i].path);
    free(s->methods);
    free(s->addr);
    if (s->creds) grpc_server_credentials_release(s->creds); /* never started */
    free(s);
    if (done) done(done_data);
    cs__rpc_loop_unref(l);
}

static void server_maybe_finish(cs_rpc_server *s) {
    if (!s->shutting_down || s->destroyed || s->calls || s->n_slots > 0) return;
    if (s->started && !s->shutdown_notified) return;
    s->destroyed = true;
    grpc_server_destroy(s->server);
    s->server = NULL;
    uv_timer_stop(&s->grace_timer);
    uv_close((uv_handle_t *)&s->grace_timer, on_server_closed);
}

static void on_shutdown(cs__rpc_tag *t, bool ok) {
    (void)ok;
    cs_rpc_server *s = CS__CONTAINER_OF(t, cs_rpc_server, t_shutdown);
    s->shutdown_notified = true;
    server_maybe_finish(s);
}

static void on_grace(uv_timer_t *h) {
    cs_rpc_server *s = h->data;
    if (!s->destroyed) grpc_server_cancel_all_calls(s->server);
}

void cs_rpc_server_shutdown(cs_rpc_server *s, int32_t grace_ms, cs_rpc_done_cb done, void *data) {
    CS_ASSERT(!s->shutting_down);
    s->shutting_down = true;
    s->done = done;
    s->done_data = data;
    if (!s->started) {
        server_maybe_finish(s); /* done runs from the handle's close callback */
        return;
    }
    s->t_shutdown.fn = on_shutdown;
    cs__rpc_loop_begin(s->loop);
    grpc_server_shutdown_and_notify(s->server, s->loop->cq, &s->t_shutdown);
    /* Calls in flight get grace_ms, then are cancelled: their handlers see
     * on_cancel and finish them, which lets the shutdown complete. */
    uv_timer_start(&s->grace_timer, on_grace, grace_ms > 0 ? (uint64_t)grace_ms : 0, 0);
}
