/* kvx-impl.h: helpers shared by the KV transport's sender and receiver
 * (internal): clock, sockets, the output queue of frames written with writev. */
#ifndef CS_KVX_IMPL_H
#define CS_KVX_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvx_wire.h"

int64_t cs__kvx_now_ms(void);
int cs__kvx_set_socket_opts(int fd); /* non-blocking, TCP_NODELAY, keepalive */
int cs__kvx_wake_init(int fds[2]);
void cs__kvx_wake(int fd);
void cs__kvx_drain(int fd);

/* One frame waiting to be written. Pages come from page memory (pagev) or a
 * contiguous buffer (data); the header is sealed (checksummed) when the frame
 * reaches the head of the queue, so hashing happens on the I/O thread. */
typedef struct kvx_out {
    struct kvx_out *next;
    int type;
    uint64_t xfer_id;
    cs_kvx_hdr h;
    uint8_t hdr[CS_KVX_HDR_BYTES];
    uint8_t ctl[CS_KVX_ACK_BYTES];
    const void *const *pages; /* n_pages pointers, or NULL */
    const uint8_t *data;      /* contiguous n_pages * page_bytes, or NULL */
    int32_t n_pages;
    size_t page_bytes;
    void *owner; /* sender: the send this frame belongs to */
    void *xfer;  /* sender: the transfer (NULL once it ended) */
    bool sealed;
    size_t total, off;
} kvx_out;

/* Writes as much of o as the socket takes. 1 when o is fully written,
 * 0 when the socket is full, negative on error. */
int cs__kvx_out_write(int fd, kvx_out *o);
/* Fills the header and control payload of a control frame (sealed). */
void cs__kvx_out_ctl(kvx_out *o, int type, uint64_t epoch, uint64_t xfer_id, uint64_t fingerprint,
                     const void *payload, size_t len);

#endif
