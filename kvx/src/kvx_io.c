/* kvx_io.c: clock, socket options, wake-up pipes and writev of queued frames
 * for the KV transport's I/O threads; the payload registry (which payload a
 * pool kind uses in this build). The handshake and its keys:
 * kvx_handshake.c. */
#include "kvx-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/secret.h"

/* Weak: defined only when the program links cs_kvx_nccl (CUDA + NCCL). */
extern const cs__kvx_payload cs__kvx_payload_nccl __attribute__((weak));

/* The payloads, one row each. A new payload is its file (a cs__kvx_payload
 * whose name, kind and pool kind are its row's), its value in enum
 * cs_kvx_payload (kvx.h: the HELLO's payload byte) and its row here; the
 * control plane, the HELLO and the frame checks follow from the iface
 * (inline_pages, unique_id). iface is NULL where this build lacks it. */
static const struct {
    int kind; /* enum cs_kvx_payload */
    const char *name;
    int pool_kind; /* enum cs_kvx_pool_kind: the pool whose pages it moves */
    const cs__kvx_payload *iface;
} payloads[] = {
    {CS_KVX_PAYLOAD_TCP, "tcp", CS_KVX_POOL_HOST, &cs__kvx_payload_tcp},
    {CS_KVX_PAYLOAD_NCCL, "nccl", CS_KVX_POOL_CUDA, &cs__kvx_payload_nccl},
};
#define N_PAYLOADS (sizeof payloads / sizeof payloads[0])

const cs__kvx_payload *cs__kvx_payload_for_pool(int pool_kind) {
    for (size_t i = 0; i < N_PAYLOADS; i++)
        if (payloads[i].pool_kind == pool_kind) return payloads[i].iface;
    return NULL;
}

const cs__kvx_payload *cs__kvx_payload_of_kind(int payload) {
    for (size_t i = 0; i < N_PAYLOADS; i++)
        if (payloads[i].kind == payload) return payloads[i].iface;
    return NULL;
}

const char *cs_kvx_payload_name(int payload) {
    for (size_t i = 0; i < N_PAYLOADS; i++)
        if (payloads[i].kind == payload) return payloads[i].name;
    return "?";
}

int cs_kvx_payload_of_pool(int kind) {
    for (size_t i = 0; i < N_PAYLOADS; i++)
        if (payloads[i].pool_kind == kind) return payloads[i].kind;
    return -1;
}

bool cs_kvx_payload_available(int payload) {
    return cs__kvx_payload_of_kind(payload) != NULL;
}

uint64_t cs__kvx_incarnation(void) {
    return cs_random_u64(); /* never from the clock: nothing outside predicts it */
}

void cs__kvx_fold(uint64_t *digest, uint64_t chunk_sum) {
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(chunk_sum >> (8 * i));
    *digest = XXH3_64bits_withSeed(le, sizeof le, *digest);
}

int64_t cs__kvx_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int cs__kvx_set_socket_opts(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -errno;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* At most this many unsent bytes in the kernel: the rest waits in our
     * queue, where --kv-queue-mib counts it and backpressure sees it.
     * Without it the send buffer, autotuned up to tcp_wmem's maximum (4 MB
     * on Debian), swallowed a slow peer's whole backlog unseen. */
    int lowat = 256 << 10;
    setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, sizeof lowat);
    /* Kernel keepalive as a second line behind our own pings. */
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    int idle = 5, intvl = 2, cnt = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    return 0;
}

int cs__kvx_wake_init(int fds[2]) {
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) return -errno;
    fds[0] = fds[1] = fd;
    return 0;
}

void cs__kvx_wake(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof one);
    (void)r;
}

void cs__kvx_drain(int fd) {
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof v);
    (void)r;
}

void cs__kvx_out_ctl(kvx_out *o, int type, uint64_t epoch, uint64_t xfer_id, uint64_t fingerprint,
                     const void *payload, size_t len) {
    memset(&o->h, 0, sizeof o->h);
    o->type = type;
    o->xfer_id = xfer_id;
    o->h.type = (uint16_t)type;
    o->h.epoch = epoch;
    o->h.xfer_id = xfer_id;
    o->h.fingerprint = fingerprint;
    o->h.payload_len = len;
    CS_ASSERT(len <= sizeof o->ctl);
    if (len) {
        memcpy(o->ctl, payload, len);
        o->h.flags = CS_KVX_FLAG_CHECKSUM;
        o->h.payload_xxh64 = cs_kvx_payload_sum(o->ctl, len);
    }
    cs_kvx_hdr_encode(&o->h, o->hdr);
    o->total = CS_KVX_HDR_BYTES + len;
    o->off = 0;
}

int cs__kvx_out_write(int fd, kvx_out *o) {
    enum { MAXV = 64 };
    while (o->off < o->total) {
        struct iovec iov[MAXV];
        int n = 0;
        size_t pos = 0; /* byte position of the next segment's start */
#define SEG(ptr, len)                                                                              \
    do {                                                                                           \
        size_t l_ = (len);                                                                         \
        if (n < MAXV && o->off < pos + l_) {                                                       \
            size_t skip_ = o->off > pos ? o->off - pos : 0;                                        \
            iov[n].iov_base = (void *)((const uint8_t *)(ptr) + skip_);                            \
            iov[n].iov_len = l_ - skip_;                                                           \
            n++;                                                                                   \
        }                                                                                          \
        pos += l_;                                                                                 \
    } while (0)
        SEG(o->hdr, CS_KVX_HDR_BYTES);
        if (o->ids) { /* page bytes straight from the pool */
            for (int32_t i = 0; i < o->n_pages && n < MAXV; i++)
                SEG(o->base + (size_t)o->ids[i] * o->page_bytes, o->page_bytes);
        } else if (o->total > CS_KVX_HDR_BYTES) {
            SEG(o->ctl, o->total - CS_KVX_HDR_BYTES);
        }
#undef SEG
        ssize_t w = writev(fd, iov, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return -errno;
        }
        o->off += (size_t)w;
    }
    return 1;
}
