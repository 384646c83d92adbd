/* chunkserve/rpc.h: the RPC layer the router, the workers and the
 * single-process server share: gRPC (HTTP/2) over the gRPC C core, messages
 * as raw bytes or protobuf-c messages, everything delivered on a libuv loop.
 *
 * Thread model. A cs_rpc_loop owns one gRPC completion queue and one thread
 * that waits on it; that thread only hands completions to the libuv loop
 * (uv_async_send, drained in full on each wake-up). Every handler and callback
 * of this API therefore runs on the libuv loop's thread, and every function
 * here must be called on that thread, except cs_rpc_loop_post (any thread)
 * and cs_rpc_code_name. Nothing here blocks the loop: sends are queued per
 * call and written one at a time, as gRPC requires.
 *
 * Errors: functions return 0 or a negative CS_E* code (chunkserve/error.h)
 * with a message in cs_last_error(). Call outcomes are gRPC status codes
 * (enum cs_rpc_code). As in libuv, when a function that takes a callback
 * fails, the callback is never called.
 *
 * Not here: client streaming, bidirectional streaming, and the
 * services themselves (generation and cluster calls live with the processes
 * that serve them; the standard health service is in rpc_health.h). */
#ifndef CHUNKSERVE_RPC_H
#define CHUNKSERVE_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/error.h"

#ifdef __cplusplus
extern "C" {
#endif

struct uv_loop_s;                  /* uv_loop_t, from <uv.h> */
struct ProtobufCMessage;           /* from <protobuf-c/protobuf-c.h> */
struct ProtobufCMessageDescriptor; /* from <protobuf-c/protobuf-c.h> */

/* gRPC status codes (the values of grpc_status_code). */
enum cs_rpc_code {
    CS_RPC_OK = 0,
    CS_RPC_CANCELLED = 1,
    CS_RPC_UNKNOWN = 2,
    CS_RPC_INVALID_ARGUMENT = 3,
    CS_RPC_DEADLINE_EXCEEDED = 4,
    CS_RPC_NOT_FOUND = 5,
    CS_RPC_ALREADY_EXISTS = 6,
    CS_RPC_PERMISSION_DENIED = 7,
    CS_RPC_RESOURCE_EXHAUSTED = 8,
    CS_RPC_FAILED_PRECONDITION = 9,
    CS_RPC_ABORTED = 10,
    CS_RPC_OUT_OF_RANGE = 11,
    CS_RPC_UNIMPLEMENTED = 12,
    CS_RPC_INTERNAL = 13,
    CS_RPC_UNAVAILABLE = 14,
    CS_RPC_DATA_LOSS = 15,
    CS_RPC_UNAUTHENTICATED = 16,
};

/* "OK", "DEADLINE_EXCEEDED", ...; "UNKNOWN_CODE" outside the range. */
const char *cs_rpc_code_name(int code);

/* The one map from a CS_E* status (chunkserve/error.h) to the gRPC code a
 * call ends with (the server, the router and both workers use it): bad input
 * (EINVAL, ERANGE, E2BIG, EOVERFLOW) is INVALID_ARGUMENT, which the router
 * never retries; no room (ENOSPC, ENOMEM, EAGAIN) RESOURCE_EXHAUSTED;
 * ENOTSUP/ENOSYS FAILED_PRECONDITION; EEXIST ALREADY_EXISTS; ETIMEDOUT
 * DEADLINE_EXCEEDED; ECANCELED CANCELLED; corrupt data (EBADMSG: a KV
 * checksum) DATA_LOSS; a broken peer (ECONNRESET, ECONNREFUSED, EPROTO, EIO)
 * UNAVAILABLE; 0 OK; anything else INTERNAL. */
int cs_rpc_code_of_status(int status);

/* One metadata entry (gRPC header or trailer). Keys are lowercase ASCII
 * ("x-request-id"); keys ending in "-bin" carry binary values, others
 * printable ASCII. */
typedef struct {
    const char *key;
    const char *value;
} cs_rpc_metadata;

/* ---------------------------------------------------------------- loop -- */

typedef struct cs_rpc_loop cs_rpc_loop;

/* Binds a completion queue and its thread to a libuv loop (which must outlive
 * the cs_rpc_loop) and initializes gRPC. The loop gains one referenced handle,
 * so uv_run keeps running until cs_rpc_loop_close has finished. CS_ENOMEM,
 * CS_EIO when a thread or handle cannot be created. */
int cs_rpc_loop_init(struct uv_loop_s *uv, cs_rpc_loop **out);

/* Starts closing: once every server and channel made on it has been freed
 * (cs_rpc_server_shutdown's callback has run, cs_rpc_channel_free has been
 * called and their calls have ended), the queue is shut down, the thread
 * joined, the handle closed and the memory freed; keep running the uv loop
 * until uv_run returns. Posts not yet run still run first. NULL is a no-op. */
void cs_rpc_loop_close(cs_rpc_loop *l);

/* Waits, at most timeout_ms, for gRPC's own shutdown to end once the last
 * cs_rpc_loop has closed. gRPC ends itself on a thread of its own when the
 * last user let go on one of gRPC's threads (a channel torn down late); a
 * process that exits before that thread is done leaves gRPC's threads
 * unjoined. Call it after uv_run has returned from the last close, before
 * exiting. false when gRPC is still in use at the deadline. */
bool cs_rpc_wait_grpc_ended(int timeout_ms);

/* Runs fn(data) on the loop thread, soon, in posting order. Thread-safe: the
 * way for engine threads to hand tokens to a call. CS_ENOMEM, or CS_ECANCELED
 * once the close has shut the queue (fn is then never called). Posts made
 * before that always run. Posting after uv_run has returned from the close
 * is a bug (the object is freed): stop posting threads before closing. */
int cs_rpc_loop_post(cs_rpc_loop *l, void (*fn)(void *data), void *data);

/* A post its caller owns (embedded in the object it is about): posting it
 * allocates nothing, so it cannot fail for memory (a lost post would leave
 * a call unanswered or an object unfreed). */
typedef struct cs_rpc_post {
    struct cs_rpc_post *next;
    void (*fn)(void *data);
    void *data;
} cs_rpc_post;
/* cs_rpc_loop_post with p: CS_ECANCELED once the queue is shut, else 0. p
 * must stay alive, and not be posted again, until fn has started. Posts of
 * both kinds run in their own order; no order holds between the two. */
int cs_rpc_loop_post_to(cs_rpc_loop *l, cs_rpc_post *p, void (*fn)(void *data), void *data);

/* -------------------------------------------------------------- server -- */

typedef struct cs_rpc_server cs_rpc_server;
typedef struct cs_rpc_call cs_rpc_call;

/* What one server gives its clients (every field: 0 = the default named).
 * int64_t so that a process's option table (chunkserve/config.h) fills them
 * directly (cs_proc_rpc_config in chunkserve/proc.h). */
typedef struct {
    int64_t max_streams;          /* concurrent streams per connection (HTTP/2 SETTINGS; a client
                                     queues the rest); 0 = 4096 */
    int64_t memory_mib;           /* gRPC resource quota over the transport's buffers: under
                                     pressure it shrinks read windows and refuses new streams
                                     rather than grow; 0 = 512 */
    int64_t idle_ms;              /* close a connection with no call for this long; 0 = 300000,
                                     < 0 = never */
    int64_t age_ms;               /* GOAWAY a connection this old (clients reconnect); 0 = never */
    int64_t age_grace_ms;         /* then let its calls finish for this long; 0 = 60000 */
    int64_t max_watches;          /* grpc.health.v1 Health/Watch streams at once (more:
                                     RESOURCE_EXHAUSTED); 0 = 256 */
    int64_t keepalive_ms;         /* ping a client (with calls open) silent this long; 0 = 60000 */
    int64_t keepalive_timeout_ms; /* an unanswered ping closes the connection and cancels its
                                     calls after this long; 0 = 20000 */
} cs_rpc_limits;

/* TLS for a gRPC port or channel: PEM files, checked at init and then
 * watched: gRPC re-reads them every reload_s seconds, so a renewed
 * certificate (cert-manager) or a new CA bundle applies to the next
 * handshakes while open connections keep theirs. All NULL = plaintext. */
typedef struct {
    const char *cert_file;   /* this side's certificate chain. Server: TLS on when set.
                                Client: its identity for mutual TLS (optional) */
    const char *key_file;    /* the private key of cert_file (required with it) */
    const char *ca_file;     /* server: clients must present a certificate that chains to
                                these roots (mutual TLS; NULL = none asked). Client: TLS on
                                when set: the roots the server's certificate must chain to */
    const char *server_name; /* client: the name the server's certificate must carry
                                (default: the target's host) */
    int64_t reload_s;        /* seconds between checks of the files; 0 = 10 */
} cs_rpc_tls;

typedef struct {
    const char *addr;       /* "host:port"; port 0 picks a free one (see start) */
    int32_t max_recv_bytes; /* largest request accepted, else RESOURCE_EXHAUSTED;
                               0 = 4 MiB */
    int32_t max_send_bytes; /* largest message sent; 0 = 64 MiB */
    cs_rpc_limits lim;      /* also: request metadata at most 16 KiB */
    cs_rpc_tls tls;         /* cert_file (+ key_file, optional ca_file): TLS */
} cs_rpc_server_opts;

enum cs_rpc_method_kind { CS_RPC_UNARY, CS_RPC_SERVER_STREAMING };

/* A new call; the request has been read (see cs_rpc_call_request*). The
 * handler owns the call until it calls cs_rpc_call_finish (now or later). */
typedef void (*cs_rpc_handler)(cs_rpc_call *call, void *data);

/* Creates a server on loop l (not listening yet). CS_EINVAL for a missing
 * address, CS_ENOMEM. Free with cs_rpc_server_shutdown, also when
 * cs_rpc_server_start failed. */
int cs_rpc_server_init(cs_rpc_loop *l, const cs_rpc_server_opts *o, cs_rpc_server **out);

/* Registers a method before start. path: "/package.Service/Method" (copied).
 * With req_desc, the layer unpacks each request into that message type and
 * answers INVALID_ARGUMENT itself when it is malformed or missing; without
 * it, the handler gets raw bytes only. A call to a path nobody registered is
 * answered UNIMPLEMENTED at once. CS_EINVAL after start or for a bad or
 * duplicate path. */
int cs_rpc_server_add_method(cs_rpc_server *s, const char *path, enum cs_rpc_method_kind kind,
                             const struct ProtobufCMessageDescriptor *req_desc,
                             cs_rpc_handler handler, void *data);

/* Binds (SO_REUSEPORT off, so a busy port is an error, not a shared one) and
 * starts serving. *port (may be NULL) receives the bound port. CS_EBUSY
 * when the address cannot be bound, CS_EINVAL when called twice. */
int cs_rpc_server_start(cs_rpc_server *s, int *port);

typedef void (*cs_rpc_done_cb)(void *data);

/* Stops accepting calls at once; calls in flight may finish for grace_ms,
 * then every call still open is cancelled (handlers see on_cancel and must
 * finish their calls). When all calls have ended and gRPC has released the
 * server, done(data) runs (on the loop thread, never inside this function)
 * and the server is freed. Calling it twice is a bug. */
void cs_rpc_server_shutdown(cs_rpc_server *s, int32_t grace_ms, cs_rpc_done_cb done, void *data);

/* ------------------------------------------------- server calls (handler) -- */

/* The request as received (not NUL-terminated), valid until finish. */
const uint8_t *cs_rpc_call_request(const cs_rpc_call *c, size_t *len);
/* The unpacked request when the method has a descriptor, else NULL. Owned by
 * the call, valid until finish; cast to the generated type. */
const struct ProtobufCMessage *cs_rpc_call_request_msg(const cs_rpc_call *c);
/* The method path ("/chunkserve.v1.Echo/Unary"). */
const char *cs_rpc_call_method(const cs_rpc_call *c);
/* Milliseconds left before the client's deadline; INT64_MAX when it set
 * none; <= 0 once it has passed (the call is then being cancelled). */
int64_t cs_rpc_call_deadline_ms(const cs_rpc_call *c);
/* A request metadata value by key (lowercase), not NUL-terminated, *len
 * set; NULL when absent. Valid until finish. */
const char *cs_rpc_call_metadata(const cs_rpc_call *c, const char *key, size_t *len);

/* Adds a response header (before the first send) or trailer (before
 * finish); both strings copied. CS_EINVAL for an illegal key or value or
 * when too late. */
int cs_rpc_call_add_header(cs_rpc_call *c, const char *key, const char *value);
int cs_rpc_call_add_trailer(cs_rpc_call *c, const char *key, const char *value);
/* A trailer of len bytes: binary when key ends in "-bin" (e.g.
 * grpc-status-details-bin, a google.rpc.Status). */
int cs_rpc_call_add_trailer_bytes(cs_rpc_call *c, const char *key, const void *value, size_t len);

void cs_rpc_call_set_data(cs_rpc_call *c, void *data);
void *cs_rpc_call_get_data(const cs_rpc_call *c);

typedef void (*cs_rpc_call_cb)(cs_rpc_call *c, void *data);

/* cb runs once if the call dies before the handler finishes it: the client
 * cancelled or went away, its deadline passed, a write failed, or the server
 * is shutting down. The handler must still call cs_rpc_call_finish (its
 * status is then dropped). Replaces an earlier cb. CS_ECANCELED when the
 * call is already dead (cb never called: check cs_rpc_call_is_cancelled). */
int cs_rpc_call_on_cancel(cs_rpc_call *c, cs_rpc_call_cb cb, void *data);
bool cs_rpc_call_is_cancelled(const cs_rpc_call *c);

/* Queues one response message (copied / packed now) for a streaming call;
 * never blocks. Messages go out in order, one write in flight at a time.
 * CS_ECANCELED when the call is dead (drop the work), CS_EINVAL after
 * finish or for a second message on a unary call, CS_ENOMEM. */
int cs_rpc_call_send(cs_rpc_call *c, const uint8_t *buf, size_t len);
int cs_rpc_call_send_msg(cs_rpc_call *c, const struct ProtobufCMessage *m);
/* Bytes queued and not yet handed to the transport (for back-pressure). */
size_t cs_rpc_call_pending_bytes(const cs_rpc_call *c);
/* cb runs once, the next time the send queue becomes empty (all queued
 * messages written), unless the call dies or is finished first. Replaces an
 * earlier cb. CS_ECANCELED when dead. */
int cs_rpc_call_on_drain(cs_rpc_call *c, cs_rpc_call_cb cb, void *data);

/* Ends the call: the status (code, message may be NULL) goes out after every
 * queued message. Must be called exactly once per call, also after
 * on_cancel; the handle is invalid afterwards and no callback of the call
 * runs any more. A unary call finished OK without its message goes out as
 * INTERNAL. Returns 0, or CS_ECANCELED when the call was already dead (the
 * status is dropped; the handle is still released). */
int cs_rpc_call_finish(cs_rpc_call *c, int code, const char *message);
/* Unary answer: the message and status OK in one write, then as finish. */
int cs_rpc_call_reply_msg(cs_rpc_call *c, const struct ProtobufCMessage *m);

/* ------------------------------------------------------------- client -- */

typedef struct cs_rpc_channel cs_rpc_channel;
typedef struct cs_rpc_client_call cs_rpc_client_call;

typedef struct {
    int32_t max_recv_bytes;          /* largest response accepted; 0 = 4 MiB */
    int32_t max_send_bytes;          /* largest request sent; 0 = no limit */
    const cs_rpc_metadata *metadata; /* sent with every call on the channel (before
                                        the call's own), copied; e.g. the cluster token */
    size_t n_metadata;
    cs_rpc_tls tls; /* ca_file (+ optional cert_file/key_file, server_name): TLS */
} cs_rpc_channel_opts;

/* A channel to target ("host:port", "dns:///name:port", ...); connects
 * lazily and reconnects on its own. o may be NULL. CS_EINVAL (also: a TLS
 * file that cannot be read), CS_ENOMEM. */
int cs_rpc_channel_init(cs_rpc_loop *l, const char *target, const cs_rpc_channel_opts *o,
                        cs_rpc_channel **out);
/* Cancels the calls in flight (each still gets its on_done, later, on the
 * loop) and frees the channel once they have ended. NULL is a no-op. */
void cs_rpc_channel_free(cs_rpc_channel *ch);
/* Sets the value the channel's calls send for key (one of its
 * cs_rpc_channel_opts.metadata keys: CS_ENOENT otherwise), from the next
 * call on: a rotated token. CS_ENOMEM leaves the old value. */
int cs_rpc_channel_set_metadata(cs_rpc_channel *ch, const char *key, const char *value);

typedef struct {
    int64_t timeout_ms;              /* deadline from now; 0 = none */
    const cs_rpc_metadata *metadata; /* request headers, copied */
    size_t n_metadata;
    bool wait_for_ready; /* wait for the channel to connect rather than fail
                            fast with UNAVAILABLE */
} cs_rpc_call_opts;

/* One response message (not NUL-terminated; valid during the call only). */
typedef void (*cs_rpc_on_message)(cs_rpc_client_call *c, const uint8_t *buf, size_t len,
                                  void *data);
/* The call's end, exactly once, after its last on_message: the status code
 * and message ("" when none). The handle is freed when this returns. */
typedef void (*cs_rpc_on_done)(cs_rpc_client_call *c, int code, const char *message, void *data);

/* Starts a unary or server-streaming call to method ("/pkg.Service/Method")
 * with one request message; responses arrive through on_message (may be
 * NULL), the end through on_done (required). *out (may be NULL) receives the
 * handle, valid until on_done returns. Errors (then no callback runs):
 * CS_EINVAL for bad arguments or metadata, CS_ECANCELED on a channel being
 * freed, CS_ENOMEM, CS_EIO when gRPC refuses the call. */
int cs_rpc_channel_call(cs_rpc_channel *ch, const char *method, const uint8_t *req, size_t len,
                        const cs_rpc_call_opts *o, cs_rpc_on_message on_message,
                        cs_rpc_on_done on_done, void *data, cs_rpc_client_call **out);
/* Same, packing a protobuf-c message as the request. */
int cs_rpc_channel_call_msg(cs_rpc_channel *ch, const char *method,
                            const struct ProtobufCMessage *req, const cs_rpc_call_opts *o,
                            cs_rpc_on_message on_message, cs_rpc_on_done on_done, void *data,
                            cs_rpc_client_call **out);

/* Cancels the call: no on_message runs any more; on_done follows (code
 * CANCELLED unless the status had already arrived). Safe inside the call's
 * callbacks and more than once. */
void cs_rpc_client_call_cancel(cs_rpc_client_call *c);

/* A response header or trailer value by key (headers first), not
 * NUL-terminated; NULL when absent. Valid inside on_message and on_done. */
const char *cs_rpc_client_call_metadata(const cs_rpc_client_call *c, const char *key, size_t *len);

/* ------------------------------------------------------------ helpers -- */

/* Unpacks buf into a message of type desc: *out to be freed with
 * protobuf_c_message_free_unpacked(*out, NULL). CS_EBADMSG when malformed. */
int cs_rpc_unpack(const struct ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len,
                  struct ProtobufCMessage **out);

#ifdef __cplusplus
}
#endif
#endif
