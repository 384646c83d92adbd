/* rpc-impl.h: what the RPC layer's files share: the completion tag, the loop
 * (completion queue thread → libuv hand-off), and small gRPC helpers for
 * byte buffers and metadata. Not public API. */
#ifndef CS_RPC_IMPL_H
#define CS_RPC_IMPL_H

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <pthread.h>
#include <uv.h>

#include "chunkserve/rpc.h"
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

/* Every tag handed to gRPC points at one of these (embedded in the object the
 * operation belongs to); the loop thread calls fn with the op's success. */
typedef struct cs__rpc_tag {
    void (*fn)(struct cs__rpc_tag *t, bool ok);
} cs__rpc_tag;

#define CS__CONTAINER_OF(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

typedef struct {
    cs__rpc_tag *tag;
    bool ok;
} cs__rpc_event;

struct cs_rpc_loop {
    uv_loop_t *uv;
    uv_async_t async;
    grpc_completion_queue *cq;
    pthread_t thread;
    bool thread_started;

    /* Shared with the CQ thread and posting threads, under mu. */
    pthread_mutex_t mu;
    cs__rpc_event *events; /* (n_events) pending, in arrival order */
    size_t n_events, cap_events;
    cs_rpc_post *posts_head, *posts_tail; /* cs_rpc_loop_post_to's, in order */
    bool closed;                          /* no more posts */

    /* Loop thread only. */
    cs__rpc_event *spare; /* the other buffer, swapped with events on drain */
    size_t cap_spare;
    int64_t outstanding; /* tags handed to gRPC and not yet delivered */
    int32_t n_objects;   /* servers and channels alive */
    bool closing;
    /* The TLS credentials of the last channel made with TLS (and what they
     * were made from): channels to many workers with one set of files share
     * them, and so one file watcher (gRPC runs a thread per watcher). */
    grpc_channel_credentials *tls_creds;
    char *tls_key;
};

/* Counts an operation about to be started with a tag on l->cq; call
 * cs__rpc_loop_end if starting it failed (no event will come). */
static inline void cs__rpc_loop_begin(cs_rpc_loop *l) {
    l->outstanding++;
}
static inline void cs__rpc_loop_end(cs_rpc_loop *l) {
    l->outstanding--;
}
/* A server or channel is created / gone; the latter may finish a close. */
void cs__rpc_loop_ref(cs_rpc_loop *l);
void cs__rpc_loop_unref(cs_rpc_loop *l);

/* Byte buffers. */
grpc_byte_buffer *cs__rpc_bb_from_bytes(const uint8_t *buf, size_t len);
grpc_byte_buffer *cs__rpc_bb_from_msg(const struct ProtobufCMessage *m, size_t *len);
/* Flattens bb into one slice (*out, caller unrefs). false when it cannot be
 * read (bad compression). */
bool cs__rpc_bb_flatten(grpc_byte_buffer *bb, grpc_slice *out);

/* Owned metadata to send: keys and values are slices we hold a ref on. */
typedef struct {
    grpc_metadata *md; /* (n) */
    size_t n, cap;
} cs__rpc_md_list;
/* Validates and appends copies of key/value. CS_EINVAL, CS_ENOMEM. */
int cs__rpc_md_add(cs__rpc_md_list *l, const char *key, const char *value);
/* The same with a value of len bytes (binary when the key ends in -bin). */
int cs__rpc_md_add_bytes(cs__rpc_md_list *l, const char *key, const void *value, size_t len);
void cs__rpc_md_free(cs__rpc_md_list *l);
/* Finds key in a received array; value not NUL-terminated. */
const char *cs__rpc_md_find(const grpc_metadata_array *a, const char *key, size_t *len);

/* The server's Health/Watch stream cap (cs_rpc_limits.max_watches, resolved). */
int64_t cs__rpc_server_max_watches(const cs_rpc_server *s);

/* TLS credentials from PEM files (rpc_util.c). Server: NULL when t has no
 * certificate (plaintext). Channel: insecure when t has no CA. 0, or
 * CS_EINVAL naming the file; the key's copy is wiped. */
int cs__rpc_server_creds(const cs_rpc_tls *t, grpc_server_credentials **out);
int cs__rpc_channel_creds(const cs_rpc_tls *t, grpc_channel_credentials **out);
/* The credentials of a channel of l with t: shared (cached in l) when TLS;
 * release them with cs__rpc_loop_creds_release. */
int cs__rpc_loop_channel_creds(cs_rpc_loop *l, const cs_rpc_tls *t, grpc_channel_credentials **out);
void cs__rpc_loop_creds_release(cs_rpc_loop *l, grpc_channel_credentials *c);

#endif
