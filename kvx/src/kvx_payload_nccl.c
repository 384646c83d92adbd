/* kvx_payload_nccl.c: the NCCL payload of the KV transport (see
 * kvx-impl.h), for device pools: one 2-rank communicator per channel, created with
 * ncclCommInitRankConfig in non-blocking mode (NCCL runs the init on its own
 * thread; the transport's I/O thread polls ncclCommGetAsyncError, so a dead
 * peer cannot hang it), two streams (net: ncclSend/ncclRecv only; pack: the
 * kv_pack.cu gather/scatter kernels), and n_slots staging slots carved from
 * one device allocation, each with pinned host room for its page ids and its
 * sum. Completion is observed with cudaEventQuery, never a synchronize.
 *
 * Every CUDA and NCCL call goes through LINK_CUDA / LINK_NCCL, which record
 * "call: name: message" in err and return a status instead of aborting: a
 * failed peer must fail the channel, not the worker. (A broken device still
 * ends the worker: the kernels' launch checks are fatal, as in the backend.)
 * Library cs_kvx_nccl (CUDA + NCCL builds); the control plane finds it
 * through cs__kvx_payload_for_pool (a weak reference in kvx_io.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "chunkserve/kv_pack_cuda.h"
#include "kvx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

#define LINK_CUDA(call)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            snprintf(err, errlen, "%s: %s: %s", #call, cudaGetErrorName(e_),                       \
                     cudaGetErrorString(e_));                                                      \
            r = e_ == cudaErrorMemoryAllocation ? CS_ENOMEM : CS_EIO;                              \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* ncclInProgress is not a failure on a non-blocking communicator: the caller
 * then waits for the communicator (wait_comm) before the next call. */
#define LINK_NCCL(comm, call)                                                                      \
    do {                                                                                           \
        ncclResult_t n_ = (call);                                                                  \
        if (n_ != ncclSuccess && n_ != ncclInProgress) {                                           \
            const char *l_ = (comm) ? ncclGetLastError(comm) : NULL;                               \
            snprintf(err, errlen, "%s: %s%s%s", #call, ncclGetErrorString(n_),                     \
                     l_ &&*l_ ? ": " : "", l_ ? l_ : "");                                          \
            r = CS_ECONNRESET;                                                                     \
            goto fail;                                                                             \
        }                                                                                          \
        in_progress = n_ == ncclInProgress;                                                        \
    } while (0)

typedef struct {
    void *stage;
    int32_t *ids_dev, *ids_host;            /* slot_pages ids; host side pinned */
    unsigned long long *sum_dev, *sum_host; /* host side pinned */
    cudaEvent_t ev_net, ev_done, last;      /* last: the slot's running operation */
    bool summed;
} link_slot;

struct cs__kvx_link {
    cs__kvx_link_cfg cfg;
    ncclComm_t comm;
    bool ready;
    cudaStream_t net, pack;
    void *stage;  /* n_slots * slot bytes */
    int32_t *ids; /* n_slots * slot_pages */
    unsigned long long *sums;
    void *host; /* pinned: ids, then sums */
    link_slot *slots;
};

static void sleep_us(long us) {
    struct timespec ts = {0, us * 1000L};
    nanosleep(&ts, NULL);
}

/* After ncclInProgress: the communicator must reach ncclSuccess before the
 * next NCCL call or any work on its stream; bounded by op_timeout_ms. */
static int wait_comm(cs__kvx_link *l, const char *what, char *err, size_t errlen) {
    int r = 0;
    bool in_progress = false;
    int64_t deadline = cs__kvx_now_ms() + l->cfg.op_timeout_ms;
    for (;;) {
        ncclResult_t a = ncclSuccess;
        LINK_NCCL(l->comm, ncclCommGetAsyncError(l->comm, &a));
        if (a == ncclSuccess) return 0;
        if (a != ncclInProgress) {
            const char *le = ncclGetLastError(l->comm);
            snprintf(err, errlen, "%s: %s%s%s", what, ncclGetErrorString(a), le && *le ? ": " : "",
                     le ? le : "");
            return CS_ECONNRESET;
        }
        if (cs__kvx_now_ms() > deadline) {
            snprintf(err, errlen, "%s still in progress after %d ms", what, l->cfg.op_timeout_ms);
            return CS_ETIMEDOUT;
        }
        sleep_us(20);
    }
fail:
    (void)in_progress;
    return r;
}

/* Frees what was created; the communicator must be gone already. */
static void link_free(cs__kvx_link *l) {
    if (l->slots)
        for (int i = 0; i < l->cfg.n_slots; i++) {
            if (l->slots[i].ev_net) cudaEventDestroy(l->slots[i].ev_net);
            if (l->slots[i].ev_done) cudaEventDestroy(l->slots[i].ev_done);
        }
    if (l->host) cudaFreeHost(l->host);
    if (l->sums) cudaFree(l->sums);
    if (l->ids) cudaFree(l->ids);
    if (l->stage) cudaFree(l->stage);
    if (l->pack) cudaStreamDestroy(l->pack);
    if (l->net) cudaStreamDestroy(l->net);
    free(l->slots);
    free(l);
}

static int l_unique_id(const cs__kvx_link_cfg *cfg, uint8_t id[CS_KVX_LINK_ID_BYTES], char *err,
                       size_t errlen) {
    int r = 0;
    bool in_progress = false;
    ncclUniqueId u;
    memset(&u, 0, sizeof u);
    LINK_NCCL((ncclComm_t)NULL, ncclGetUniqueId(&u));
    memcpy(id, u.internal, CS_KVX_LINK_ID_BYTES);
    (void)cfg;
    (void)in_progress;
    return 0;
fail:
    return r;
}

static int l_open(const cs__kvx_link_cfg *cfg, const uint8_t *id, cs__kvx_link **out, char *err,
                  size_t errlen) {
    _Static_assert(sizeof(ncclUniqueId) == CS_KVX_LINK_ID_BYTES, "LINK_ID frame size");
    int r = 0;
    bool in_progress = false;
    *out = NULL;
    cs__kvx_link *l = calloc(1, sizeof *l);
    if (!l || !(l->slots = calloc((size_t)cfg->n_slots, sizeof *l->slots))) {
        free(l);
        snprintf(err, errlen, "out of memory");
        return CS_ENOMEM;
    }
    l->cfg = *cfg;
    size_t n = (size_t)cfg->n_slots, sp = (size_t)cfg->slot_pages,
           slot_bytes = sp * cfg->page_bytes;
    LINK_CUDA(cudaSetDevice(cfg->pool.device));
    LINK_CUDA(cudaStreamCreateWithFlags(&l->net, cudaStreamNonBlocking));
    LINK_CUDA(cudaStreamCreateWithFlags(&l->pack, cudaStreamNonBlocking));
    LINK_CUDA(cudaMalloc(&l->stage, n * slot_bytes));
    LINK_CUDA(cudaMalloc((void **)&l->ids, n * sp * sizeof(int32_t)));
    LINK_CUDA(cudaMalloc((void **)&l->sums, n * sizeof(unsigned long long)));
    LINK_CUDA(cudaHostAlloc(&l->host, n * (sp * sizeof(int32_t) + sizeof(unsigned long long)),
                            cudaHostAllocDefault));
    unsigned long long *hsums = (unsigned long long *)l->host;
    int32_t *hids = (int32_t *)(hsums + n);
    for (size_t i = 0; i < n; i++) {
        link_slot *s = &l->slots[i];
        s->stage = (uint8_t *)l->stage + i * slot_bytes;
        s->ids_dev = l->ids + i * sp;
        s->ids_host = hids + i * sp;
        s->sum_dev = l->sums + i;
        s->sum_host = hsums + i;
        LINK_CUDA(cudaEventCreateWithFlags(&s->ev_net, cudaEventDisableTiming));
        LINK_CUDA(cudaEventCreateWithFlags(&s->ev_done, cudaEventDisableTiming));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* init and operations return ncclInProgress instead of blocking */
    config.commName = l->cfg.name;
    ncclUniqueId u;
    memcpy(u.internal, id, CS_KVX_LINK_ID_BYTES);
    LINK_NCCL(l->comm, ncclCommInitRankConfig(&l->comm, 2, u, cfg->rank, &config));
    (void)in_progress;
    *out = l;
    return 0;
fail:
    if (l->comm) ncclCommAbort(l->comm);
    l->comm = NULL;
    link_free(l);
    return r;
}

static int l_state(cs__kvx_link *l, char *err, size_t errlen) {
    int r = 0;
    bool in_progress = false;
    ncclResult_t a = ncclSuccess;
    LINK_NCCL(l->comm, ncclCommGetAsyncError(l->comm, &a));
    (void)in_progress;
    if (a == ncclSuccess) {
        l->ready = true;
        return 0;
    }
    if (a == ncclInProgress) return l->ready ? 0 : 1;
    {
        const char *le = ncclGetLastError(l->comm);
        snprintf(err, errlen, "%s%s%s", ncclGetErrorString(a), le && *le ? ": " : "", le ? le : "");
    }
    return CS_ECONNRESET;
fail:
    return r;
}

static int l_pack(cs__kvx_link *l, int slot, const int32_t *ids, int32_t n, bool sum, char *err,
                  size_t errlen) {
    int r = 0;
    link_slot *s = &l->slots[slot];
    CS_ASSERT(n >= 1 && n <= l->cfg.slot_pages);
    LINK_CUDA(cudaSetDevice(l->cfg.pool.device));
    memcpy(s->ids_host, ids, (size_t)n * sizeof *ids);
    LINK_CUDA(cudaMemcpyAsync(s->ids_dev, s->ids_host, (size_t)n * sizeof *ids,
                              cudaMemcpyHostToDevice, l->pack));
    cs_cuda_kv_gather(l->cfg.pool.base, l->cfg.page_bytes, s->ids_dev, n, s->stage,
                      sum ? s->sum_dev : NULL, l->pack);
    if (sum)
        LINK_CUDA(cudaMemcpyAsync(s->sum_host, s->sum_dev, sizeof *s->sum_dev,
                                  cudaMemcpyDeviceToHost, l->pack));
    LINK_CUDA(cudaEventRecord(s->ev_done, l->pack));
    s->last = s->ev_done;
    s->summed = sum;
    return 0;
fail:
    return r;
}

static int l_send(cs__kvx_link *l, int slot, size_t bytes, char *err, size_t errlen) {
    int r = 0;
    bool in_progress = false;
    link_slot *s = &l->slots[slot];
    LINK_CUDA(cudaSetDevice(l->cfg.pool.device));
    LINK_CUDA(cudaStreamWaitEvent(l->net, s->ev_done, 0));
    LINK_NCCL(l->comm, ncclSend(s->stage, bytes, ncclUint8, 1, l->comm, l->net));
    if (in_progress && (r = wait_comm(l, "ncclSend", err, errlen))) return r;
    LINK_CUDA(cudaEventRecord(s->ev_net, l->net));
    s->last = s->ev_net;
    s->summed = false;
    return 0;
fail:
    return r;
}

static int l_recv(cs__kvx_link *l, int slot, size_t bytes, const int32_t *ids, int32_t n, bool sum,
                  char *err, size_t errlen) {
    int r = 0;
    bool in_progress = false;
    link_slot *s = &l->slots[slot];
    CS_ASSERT(n >= 1 && n <= l->cfg.slot_pages);
    LINK_CUDA(cudaSetDevice(l->cfg.pool.device));
    LINK_NCCL(l->comm, ncclRecv(s->stage, bytes, ncclUint8, 0, l->comm, l->net));
    if (in_progress && (r = wait_comm(l, "ncclRecv", err, errlen))) return r;
    LINK_CUDA(cudaEventRecord(s->ev_net, l->net));
    s->last = s->ev_net;
    s->summed = false;
    if (!ids) return 0; /* the transfer ended here: the bytes are dropped */
    memcpy(s->ids_host, ids, (size_t)n * sizeof *ids);
    LINK_CUDA(cudaMemcpyAsync(s->ids_dev, s->ids_host, (size_t)n * sizeof *ids,
                              cudaMemcpyHostToDevice, l->pack));
    LINK_CUDA(cudaStreamWaitEvent(l->pack, s->ev_net, 0));
    cs_cuda_kv_scatter(l->cfg.pool.base, l->cfg.page_bytes, s->ids_dev, n, s->stage,
                       sum ? s->sum_dev : NULL, l->pack);
    if (sum)
        LINK_CUDA(cudaMemcpyAsync(s->sum_host, s->sum_dev, sizeof *s->sum_dev,
                                  cudaMemcpyDeviceToHost, l->pack));
    LINK_CUDA(cudaEventRecord(s->ev_done, l->pack));
    s->last = s->ev_done;
    s->summed = sum;
    return 0;
fail:
    return r;
}

static int l_query(cs__kvx_link *l, int slot, uint64_t *sum, char *err, size_t errlen) {
    int r = 0;
    link_slot *s = &l->slots[slot];
    if (!s->last) return 0;
    LINK_CUDA(cudaSetDevice(l->cfg.pool.device));
    cudaError_t e = cudaEventQuery(s->last); /* cudaErrorNotReady is the expected "not yet" */
    if (e == cudaErrorNotReady) return 1;
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaEventQuery: %s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
        return CS_EIO;
    }
    if (s->summed && sum) *sum = *s->sum_host;
    return 0;
fail:
    return r;
}

static bool l_close(cs__kvx_link *l) {
    cudaSetDevice(l->cfg.pool.device);
    if (l->comm) {
        /* Local: never waits for the peer; NCCL's kernels on our stream exit. */
        ncclResult_t a = ncclCommAbort(l->comm);
        if (a != ncclSuccess && a != ncclInProgress)
            CS_LOGW("kvx nccl: ncclCommAbort(%s): %s", l->cfg.name, ncclGetErrorString(a));
        l->comm = NULL;
    }
    int64_t deadline = cs__kvx_now_ms() + 10000;
    for (;;) {
        cudaError_t a = l->net ? cudaStreamQuery(l->net) : cudaSuccess;
        cudaError_t b = l->pack ? cudaStreamQuery(l->pack) : cudaSuccess;
        if (a != cudaErrorNotReady && b != cudaErrorNotReady) break;
        if (cs__kvx_now_ms() > deadline) {
            CS_LOGE(
                "kvx nccl: streams of %s still busy 10 s after ncclCommAbort: leaking its staging",
                l->cfg.name);
            return false;
        }
        sleep_us(1000);
    }
    link_free(l);
    return true;
}

const cs__kvx_payload cs__kvx_payload_nccl = {
    .name = "nccl",
    .kind = CS_KVX_PAYLOAD_NCCL,
    .pool_kind = CS_KVX_POOL_CUDA,
    .inline_pages = false,
    .unique_id = l_unique_id,
    .open = l_open,
    .state = l_state,
    .pack = l_pack,
    .send = l_send,
    .recv = l_recv,
    .query = l_query,
    .close = l_close,
};
