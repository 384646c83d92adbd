/* tests/emu/nccl_emu.c: the NCCL calls of fake/nccl.h between two processes,
 * so that the KV transport's NCCL payload (kvx/src/kvx_payload_nccl.c: its
 * staging slots, kv_pack kernels and checksums) runs process to process on
 * the emulated CUDA backend, where no GPU and no NCCL exist (the cluster_emu
 * test). A communicator is one loopback TCP connection:
 *
 *   ncclGetUniqueId      listens on 127.0.0.1:0; the id carries the port
 *                        and a random token (the id's creator is rank 0,
 *                        as the transport's sender is)
 *   ncclCommInitRank...  rank 1 connects and sends the token; rank 0 accepts
 *                        it in ncclCommGetAsyncError (non-blocking: init is
 *                        ncclInProgress until then, as with NCCL's config.blocking = 0)
 *   ncclSend             copies the bytes and queues them for the
 *                        communicator's writer thread: like NCCL, the
 *                        buffer may be reused once the stream passed the
 *                        send (the emulated streams pass it at once)
 *   ncclRecv             reads the bytes (in posting order, like NCCL's
 *                        matching between two ranks), bounded by 10 s
 *   errors               a closed or silent peer sets the communicator's
 *                        async error (ncclRemoteError) with a last-error text
 *
 * What this cannot show: NCCL's own transport, GPU-to-GPU copies, or a send
 * that waits for its receive (here the socket buffers and the queue absorb
 * it). Not thread-safe per communicator beyond what the payload needs: one
 * caller thread plus the writer. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>

#include "nccl.h"

#define EMU_MAGIC "cs-nccl-emu"
#define EMU_IO_MS 10000 /* a receive or the token exchange */

typedef struct emu_msg {
    struct emu_msg *next;
    size_t n;
    uint8_t data[];
} emu_msg;

struct cs_emu_nccl_comm {
    int rank;
    int fd, listen_fd;
    uint64_t token;
    char name[64];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ncclResult_t async; /* ncclInProgress until connected; then success or the failure */
    char err[256];
    bool writer_started, stop;
    pthread_t writer;
    emu_msg *head, *tail;
};

/* Listening sockets made by ncclGetUniqueId, until rank 0's init takes one. */
typedef struct emu_listener {
    struct emu_listener *next;
    uint64_t token;
    int fd;
} emu_listener;
static emu_listener *g_listeners;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void fail(ncclComm_t c, ncclResult_t r, const char *fmt, const char *what) {
    pthread_mutex_lock(&c->mu);
    if (c->async == ncclSuccess || c->async == ncclInProgress) {
        c->async = r;
        snprintf(c->err, sizeof c->err, fmt, c->name, what);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* All n bytes through fd (blocking in poll), or -1 with errno (ETIMEDOUT
 * after EMU_IO_MS without progress, EPIPE for a closed peer). */
static int io_all(int fd, void *buf, size_t n, bool out) {
    uint8_t *p = buf;
    int64_t deadline = now_ms() + EMU_IO_MS;
    while (n) {
        ssize_t k =
            out ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k, n -= (size_t)k, deadline = now_ms() + EMU_IO_MS;
            continue;
        }
        if (k == 0) {
            errno = EPIPE;
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        struct pollfd pfd = {fd, out ? POLLOUT : POLLIN, 0};
        poll(&pfd, 1, (int)left);
    }
    return 0;
}

static void *writer_main(void *arg) {
    ncclComm_t c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->head && !c->stop)
            pthread_cond_wait(&c->cv, &c->mu);
        if (c->stop) break;
        emu_msg *m = c->head;
        c->head = m->next;
        if (!c->head) c->tail = NULL;
        pthread_mutex_unlock(&c->mu);
        int r = io_all(c->fd, m->data, m->n, true);
        int e = errno;
        free(m);
        if (r) fail(c, ncclRemoteError, "%s: send to the peer failed: %s", strerror(e));
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Connected: the writer starts. */
static ncclResult_t ready(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    c->async = ncclSuccess;
    pthread_mutex_unlock(&c->mu);
    if (pthread_create(&c->writer, NULL, writer_main, c)) {
        fail(c, ncclSystemError, "%s: %s", "pthread_create failed");
        return ncclSystemError;
    }
    c->writer_started = true;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

const char *ncclGetLastError(ncclComm_t c) {
    return c ? c->err : "";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return ncclSystemError;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    uint64_t token = 0;
    emu_listener *l = malloc(sizeof *l);
    if (!l || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 1) ||
        getsockname(fd, (struct sockaddr *)&a, &len) ||
        getrandom(&token, sizeof token, 0) != (ssize_t)sizeof token) {
        free(l);
        close(fd);
        return ncclSystemError;
    }
    memset(id, 0, sizeof *id);
    memcpy(id->internal, EMU_MAGIC, sizeof EMU_MAGIC);
    memcpy(id->internal + 16, &a.sin_port, sizeof a.sin_port);
    memcpy(id->internal + 24, &token, sizeof token);
    l->token = token, l->fd = fd;
    pthread_mutex_lock(&g_mu);
    l->next = g_listeners, g_listeners = l;
    pthread_mutex_unlock(&g_mu);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
    *out = NULL;
    if (nranks != 2 || (rank != 0 && rank != 1) ||
        memcmp(id.internal, EMU_MAGIC, sizeof EMU_MAGIC) != 0)
        return ncclInvalidArgument;
    ncclComm_t c = calloc(1, sizeof *c);
    if (!c) return ncclSystemError;
    c->rank = rank, c->fd = c->listen_fd = -1;
    c->async = ncclInProgress;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    snprintf(c->name, sizeof c->name, "%s", config && config->commName ? config->commName : "comm");
    memcpy(&c->token, id.internal + 24, sizeof c->token);
    *out = c;
    if (rank == 0) { /* the id's creator: accept the peer in ncclCommGetAsyncError */
        pthread_mutex_lock(&g_mu);
        for (emu_listener **p = &g_listeners; *p; p = &(*p)->next)
            if ((*p)->token == c->token) {
                emu_listener *l = *p;
                *p = l->next;
                c->listen_fd = l->fd;
                free(l);
                break;
            }
        pthread_mutex_unlock(&g_mu);
        if (c->listen_fd < 0) {
            fail(c, ncclInvalidArgument, "%s: %s", "rank 0 must create the unique id");
            return ncclInvalidArgument;
        }
        return config && !config->blocking ? ncclInProgress : ncclSuccess;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    memcpy(&a.sin_port, id.internal + 16, sizeof a.sin_port);
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&a, sizeof a) ||
        io_all(c->fd, &c->token, sizeof c->token, true)) {
        fail(c, ncclRemoteError, "%s: connect to rank 0: %s", strerror(errno));
        return ncclRemoteError;
    }
    return ready(c);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *async) {
    if (!c) return ncclInvalidArgument;
    if (c->rank == 0 && c->fd < 0 && c->listen_fd >= 0) {
        int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) {
            uint64_t token = 0;
            c->fd = fd;
            close(c->listen_fd);
            c->listen_fd = -1;
            if (io_all(fd, &token, sizeof token, false) || token != c->token)
                fail(c, ncclRemoteError, "%s: %s", "the peer did not present this id's token");
            else
                ready(c);
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            fail(c, ncclSystemError, "%s: accept: %s", strerror(errno));
    }
    pthread_mutex_lock(&c->mu);
    *async = c->async;
    pthread_mutex_unlock(&c->mu);
    return ncclSuccess;
}

/* ncclSuccess when c is connected and healthy, else what it is. */
static ncclResult_t usable(ncclComm_t c, int peer) {
    if (!c || peer != 1 - c->rank) return ncclInvalidArgument;
    pthread_mutex_lock(&c->mu);
    ncclResult_t r = c->async == ncclInProgress ? ncclInvalidUsage : c->async;
    pthread_mutex_unlock(&c->mu);
    return r;
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t c,
                      cudaStream_t stream) {
    (void)type, (void)stream; /* bytes either way; the emulated stream runs at once */
    ncclResult_t r = usable(c, peer);
    if (r) return r;
    emu_msg *m = malloc(sizeof *m + count);
    if (!m) return ncclSystemError;
    m->next = NULL, m->n = count;
    memcpy(m->data, buf, count);
    pthread_mutex_lock(&c->mu);
    if (c->tail)
        c->tail->next = m;
    else
        c->head = m;
    c->tail = m;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return ncclSuccess;
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t c,
                      cudaStream_t stream) {
    (void)type, (void)stream;
    ncclResult_t r = usable(c, peer);
    if (r) return r;
    if (io_all(c->fd, buf, count, false)) {
        fail(c, ncclRemoteError, "%s: receive from the peer failed: %s", strerror(errno));
        return ncclRemoteError;
    }
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclSuccess;
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR); /* a writer blocked in poll wakes */
    if (c->writer_started) pthread_join(c->writer, NULL);
    if (c->fd >= 0) close(c->fd);
    if (c->listen_fd >= 0) close(c->listen_fd);
    while (c->head) {
        emu_msg *m = c->head;
        c->head = m->next;
        free(m);
    }
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    return ncclSuccess;
}
