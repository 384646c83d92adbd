/* echo_service.c: chunkserve.v1.Echo over the RPC layer.
 *
 * Unary answers with the payload after delay_ms, echoing the x-request-id
 * header back and reporting the deadline it saw in the x-deadline-ms
 * trailer. Stream sends count messages: interval_ms apart on a timer, or
 * with interval 0 in bursts of 64 refilled from on_drain, so a fast stream
 * never queues more than a burst and never blocks the loop. Every call is
 * finished exactly once, also after on_cancel. */
#include "echo_service.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "chunkserve/v1/echo.pb-c.h"

enum { BURST = 64 };

typedef struct {
    cs_rpc_call *call;
    cs_echo_service *st;
    uv_timer_t timer;
    const Chunkserve__V1__EchoRequest *req;
    int32_t next_seq;
    int done;
} echo_call;

static void echo_call_free(uv_handle_t *h) {
    free(h->data);
}

/* Finishes the call (once) and frees the state after its timer closed. */
static void echo_end(echo_call *e, int code, const char *msg) {
    if (e->done) return;
    e->done = 1;
    uv_timer_stop(&e->timer);
    atomic_fetch_add(&e->st->calls_finished, 1);
    cs_rpc_call_finish(e->call, code, msg);
    uv_close((uv_handle_t *)&e->timer, echo_call_free);
}

static void on_cancel(cs_rpc_call *c, void *data) {
    echo_call *e = data;
    atomic_fetch_add(&e->st->cancels_seen, 1);
    echo_end(e, CS_RPC_CANCELLED, "cancelled");
}

static echo_call *echo_begin(cs_rpc_call *c, cs_echo_service *st) {
    echo_call *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->call = c;
    e->st = st;
    e->req = (const Chunkserve__V1__EchoRequest *)cs_rpc_call_request_msg(c);
    uv_timer_init(st->uv, &e->timer);
    e->timer.data = e;
    atomic_fetch_add(&st->calls_started, 1);
    cs_rpc_call_on_cancel(c, on_cancel, e);
    return e;
}

/* ---------------------------------------------------------------- Unary -- */

static void unary_answer(echo_call *e) {
    char v[32];
    snprintf(v, sizeof v, "%" PRId64, cs_rpc_call_deadline_ms(e->call));
    cs_rpc_call_add_trailer(e->call, "x-deadline-ms", v);
    Chunkserve__V1__EchoResponse r = CHUNKSERVE__V1__ECHO_RESPONSE__INIT;
    r.payload = e->req->payload;
    e->done = 1;
    uv_timer_stop(&e->timer);
    atomic_fetch_add(&e->st->calls_finished, 1);
    cs_rpc_call_reply_msg(e->call, &r.base);
    uv_close((uv_handle_t *)&e->timer, echo_call_free);
}

static void on_unary_timer(uv_timer_t *t) {
    unary_answer(t->data);
}

static void handle_unary(cs_rpc_call *c, void *data) {
    echo_call *e = echo_begin(c, data);
    if (!e) {
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    size_t n;
    const char *rid = cs_rpc_call_metadata(c, "x-request-id", &n);
    if (rid) {
        char buf[128];
        snprintf(buf, sizeof buf, "%.*s", (int)(n < 100 ? n : 100), rid);
        cs_rpc_call_add_header(c, "x-request-id", buf);
    }
    if (e->req->delay_ms > 0)
        uv_timer_start(&e->timer, on_unary_timer, (uint64_t)e->req->delay_ms, 0);
    else
        unary_answer(e);
}

/* --------------------------------------------------------------- Stream -- */

static int stream_send_one(echo_call *e) {
    Chunkserve__V1__EchoResponse r = CHUNKSERVE__V1__ECHO_RESPONSE__INIT;
    r.payload = e->req->payload;
    r.seq = e->next_seq++;
    return cs_rpc_call_send_msg(e->call, &r.base);
}

static void stream_burst(cs_rpc_call *c, void *data);

/* Sends up to a burst; finishes after the last message is queued (the
 * status goes out behind it), else asks to hear when the queue drains. */
static void stream_burst(cs_rpc_call *c, void *data) {
    echo_call *e = data;
    for (int i = 0; i < BURST && e->next_seq < e->req->count; i++)
        if (stream_send_one(e) != 0) return; /* dead: on_cancel ends it */
    if (e->next_seq >= e->req->count)
        echo_end(e, CS_RPC_OK, NULL);
    else
        cs_rpc_call_on_drain(c, stream_burst, e);
}

static void on_stream_timer(uv_timer_t *t) {
    echo_call *e = t->data;
    if (stream_send_one(e) != 0) return;
    if (e->next_seq >= e->req->count) echo_end(e, CS_RPC_OK, NULL);
}

static void handle_stream(cs_rpc_call *c, void *data) {
    echo_call *e = echo_begin(c, data);
    if (!e) {
        cs_rpc_call_finish(c, CS_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    if (e->req->count < 0 || e->req->interval_ms < 0) {
        echo_end(e, CS_RPC_INVALID_ARGUMENT, "count and interval_ms must be >= 0");
        return;
    }
    if (e->req->interval_ms > 0)
        uv_timer_start(&e->timer, on_stream_timer, 0, (uint64_t)e->req->interval_ms);
    else
        stream_burst(c, e);
}

int cs_echo_register(cs_rpc_server *s, cs_echo_service *svc) {
    int rc = cs_rpc_server_add_method(s, "/chunkserve.v1.Echo/Unary", CS_RPC_UNARY,
                                      &chunkserve__v1__echo_request__descriptor, handle_unary, svc);
    if (rc == 0)
        rc =
            cs_rpc_server_add_method(s, "/chunkserve.v1.Echo/Stream", CS_RPC_SERVER_STREAMING,
                                     &chunkserve__v1__echo_request__descriptor, handle_stream, svc);
    return rc;
}
