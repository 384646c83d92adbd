/* kvx_nccl_loop.h: a loopback stand-in for the KV transport's NCCL payload
 * (cs__kvx_payload in kvx-impl.h), so that the CPU tests run the real
 * control plane (kvx_tx*.c, kvx_rx*.c: TCP, descriptors, ordering, failures)
 * over a linked payload without a GPU. It claims CUDA pools but the
 * "pool" is host memory; a communicator is a process-wide pair found by its
 * id; ncclSend copies into the pair's FIFO, ncclRecv takes from it in posting
 * order, exactly the matching NCCL does between two ranks. Operations report
 * "still running" on their first query so the pending paths run too.
 *
 * Knobs (set by the test, read under loop_mu) play NCCL failures: an async
 * communicator error, sends that never arrive (a hung peer), a corrupted
 * chunk, an init that never completes, an id that cannot be created. */
#ifndef CS_KVX_NCCL_LOOP_H
#define CS_KVX_NCCL_LOOP_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"

static struct {
    int fail_comm;  /* state() of every link reports an async error */
    int hang;       /* sends never arrive */
    int corrupt;    /* corrupt the next N delivered chunks */
    int init_never; /* init never completes */
    int id_fail;    /* unique_id fails */
    int opened, closed;
} loop_knobs;
static pthread_mutex_t loop_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct loop_msg {
    struct loop_msg *next;
    size_t bytes;
    uint8_t *data;
} loop_msg;

typedef struct loop_pair {
    struct loop_pair *next;
    uint8_t id[CS_KVX_LINK_ID_BYTES];
    int joined, refs;
    bool peer_gone;
    loop_msg *head, *tail;
} loop_pair;
static loop_pair *loop_pairs;

enum { LOP_NONE, LOP_PACK, LOP_SEND, LOP_RECV };

typedef struct {
    int op, polls;
    bool done, want_sum, hung;
    uint64_t sum;
    size_t bytes;
    int32_t *ids; /* recv: scatter target (copy), NULL: drop */
    int32_t n;
} loop_slot;

struct cs__kvx_link {
    cs__kvx_link_cfg cfg;
    loop_pair *pair;
    uint8_t *stage;
    loop_slot *slots;
    int *posted; /* recv slots in posting order */
    int p_head, p_n;
};

static int loop_unique_id(const cs__kvx_link_cfg *cfg, uint8_t id[CS_KVX_LINK_ID_BYTES], char *err,
                          size_t errlen) {
    static uint64_t ctr;
    pthread_mutex_lock(&loop_mu);
    int fail = loop_knobs.id_fail;
    uint64_t c = ++ctr;
    pthread_mutex_unlock(&loop_mu);
    if (fail) {
        snprintf(err, errlen, "ncclGetUniqueId: loop: no network interface");
        return CS_EIO;
    }
    (void)cfg;
    memset(id, 0, CS_KVX_LINK_ID_BYTES);
    memcpy(id, &c, sizeof c);
    return 0;
}

static int loop_open(const cs__kvx_link_cfg *cfg, const uint8_t *id, cs__kvx_link **out, char *err,
                     size_t errlen) {
    (void)err, (void)errlen;
    cs__kvx_link *l = calloc(1, sizeof *l);
    l->cfg = *cfg;
    l->stage = malloc((size_t)cfg->n_slots * (size_t)cfg->slot_pages * cfg->page_bytes);
    l->slots = calloc((size_t)cfg->n_slots, sizeof *l->slots);
    l->posted = calloc((size_t)cfg->n_slots, sizeof *l->posted);
    if (!l->stage || !l->slots || !l->posted) {
        free(l->stage), free(l->slots), free(l->posted), free(l);
        return CS_ENOMEM;
    }
    pthread_mutex_lock(&loop_mu);
    loop_pair *p = loop_pairs;
    while (p && memcmp(p->id, id, CS_KVX_LINK_ID_BYTES))
        p = p->next;
    if (!p) {
        p = calloc(1, sizeof *p);
        memcpy(p->id, id, CS_KVX_LINK_ID_BYTES);
        p->next = loop_pairs;
        loop_pairs = p;
    }
    p->joined++;
    p->refs++;
    l->pair = p;
    loop_knobs.opened++;
    pthread_mutex_unlock(&loop_mu);
    *out = l;
    return 0;
}

static int loop_state(cs__kvx_link *l, char *err, size_t errlen) {
    pthread_mutex_lock(&loop_mu);
    int r = 0;
    if (loop_knobs.fail_comm) {
        snprintf(err, errlen,
                 "loop: ncclRemoteError: remote process exited or there was a network error");
        r = CS_ECONNRESET;
    } else if (l->pair->peer_gone) {
        snprintf(err, errlen, "loop: ncclRemoteError: the peer aborted the communicator");
        r = CS_ECONNRESET;
    } else if (loop_knobs.init_never || l->pair->joined < 2) {
        r = 1;
    }
    pthread_mutex_unlock(&loop_mu);
    return r;
}

static uint8_t *loop_stage(cs__kvx_link *l, int slot) {
    return l->stage + (size_t)slot * (size_t)l->cfg.slot_pages * l->cfg.page_bytes;
}

static int loop_pack(cs__kvx_link *l, int slot, const int32_t *ids, int32_t n, bool sum, char *err,
                     size_t errlen) {
    (void)err, (void)errlen;
    loop_slot *s = &l->slots[slot];
    CS_ASSERT(n >= 1 && n <= l->cfg.slot_pages);
    uint8_t *st = loop_stage(l, slot);
    for (int32_t i = 0; i < n; i++)
        memcpy(st + (size_t)i * l->cfg.page_bytes,
               (uint8_t *)l->cfg.pool.base + (size_t)ids[i] * l->cfg.page_bytes, l->cfg.page_bytes);
    *s = (loop_slot){LOP_PACK, 0, false, sum, false, 0, (size_t)n * l->cfg.page_bytes, NULL, n};
    if (sum) s->sum = cs__kvx_sum_ref(st, s->bytes);
    return 0;
}

static int loop_send(cs__kvx_link *l, int slot, size_t bytes, char *err, size_t errlen) {
    (void)err, (void)errlen;
    loop_slot *s = &l->slots[slot];
    CS_ASSERT(s->op == LOP_PACK && s->done && bytes == s->bytes);
    pthread_mutex_lock(&loop_mu);
    s->op = LOP_SEND;
    s->polls = 0;
    s->done = false;
    s->hung = loop_knobs.hang != 0;
    if (!s->hung) {
        loop_msg *m = calloc(1, sizeof *m);
        m->bytes = bytes;
        m->data = malloc(bytes);
        memcpy(m->data, loop_stage(l, slot), bytes);
        if (l->pair->tail)
            l->pair->tail->next = m;
        else
            l->pair->head = m;
        l->pair->tail = m;
    }
    pthread_mutex_unlock(&loop_mu);
    return 0;
}

static int loop_recv(cs__kvx_link *l, int slot, size_t bytes, const int32_t *ids, int32_t n,
                     bool sum, char *err, size_t errlen) {
    (void)err, (void)errlen;
    loop_slot *s = &l->slots[slot];
    free(s->ids);
    *s = (loop_slot){LOP_RECV, 0, false, sum, false, 0, bytes, NULL, n};
    if (ids) {
        s->ids = malloc((size_t)n * sizeof *ids);
        memcpy(s->ids, ids, (size_t)n * sizeof *ids);
    }
    l->posted[(l->p_head + l->p_n) % l->cfg.n_slots] = slot;
    l->p_n++;
    return 0;
}

/* Matches posted receives with arrived sends, in order. */
static int loop_deliver(cs__kvx_link *l, char *err, size_t errlen) {
    pthread_mutex_lock(&loop_mu);
    while (l->p_n > 0 && l->pair->head) {
        loop_msg *m = l->pair->head;
        l->pair->head = m->next;
        if (!l->pair->head) l->pair->tail = NULL;
        int slot = l->posted[l->p_head];
        l->p_head = (l->p_head + 1) % l->cfg.n_slots;
        l->p_n--;
        loop_slot *s = &l->slots[slot];
        if (m->bytes != s->bytes) {
            snprintf(err, errlen, "loop: ncclRecv of %zu bytes matched a %zu-byte ncclSend",
                     s->bytes, m->bytes);
            free(m->data), free(m);
            pthread_mutex_unlock(&loop_mu);
            return CS_EIO;
        }
        uint8_t *st = loop_stage(l, slot);
        memcpy(st, m->data, m->bytes);
        if (loop_knobs.corrupt > 0) {
            loop_knobs.corrupt--;
            st[m->bytes / 2] ^= 0x40;
        }
        free(m->data), free(m);
        if (s->ids)
            for (int32_t i = 0; i < s->n; i++)
                memcpy((uint8_t *)l->cfg.pool.base + (size_t)s->ids[i] * l->cfg.page_bytes,
                       st + (size_t)i * l->cfg.page_bytes, l->cfg.page_bytes);
        if (s->want_sum && s->ids) s->sum = cs__kvx_sum_ref(st, s->bytes);
        s->done = true;
    }
    pthread_mutex_unlock(&loop_mu);
    return 0;
}

static int loop_query(cs__kvx_link *l, int slot, uint64_t *sum, char *err, size_t errlen) {
    loop_slot *s = &l->slots[slot];
    if (s->op == LOP_RECV) {
        int r = loop_deliver(l, err, errlen);
        if (r) return r;
    }
    if (s->op == LOP_PACK || s->op == LOP_SEND) {
        if (s->hung) return 1;
        if (s->polls++ == 0) return 1; /* first look: still running */
        s->done = true;
    }
    if (!s->done) return 1;
    if (sum && s->want_sum) *sum = s->sum;
    return 0;
}

static bool loop_close(cs__kvx_link *l) {
    pthread_mutex_lock(&loop_mu);
    loop_pair *p = l->pair;
    p->peer_gone = true; /* what the peer's ncclCommGetAsyncError will say */
    if (--p->refs == 0) {
        for (loop_pair **pp = &loop_pairs; *pp; pp = &(*pp)->next)
            if (*pp == p) {
                *pp = p->next;
                break;
            }
        while (p->head) {
            loop_msg *m = p->head;
            p->head = m->next;
            free(m->data), free(m);
        }
        free(p);
    }
    loop_knobs.closed++;
    pthread_mutex_unlock(&loop_mu);
    for (int i = 0; i < l->cfg.n_slots; i++)
        free(l->slots[i].ids);
    free(l->slots), free(l->posted), free(l->stage), free(l);
    return true;
}

static const cs__kvx_payload loop_ops = {
    .name = "nccl", /* it plays NCCL on the wire */
    .kind = CS_KVX_PAYLOAD_NCCL,
    .pool_kind = CS_KVX_POOL_CUDA,
    .inline_pages = false,
    .unique_id = loop_unique_id,
    .open = loop_open,
    .state = loop_state,
    .pack = loop_pack,
    .send = loop_send,
    .recv = loop_recv,
    .query = loop_query,
    .close = loop_close,
};

#define LOOP_SET(field, value)                                                                     \
    do {                                                                                           \
        pthread_mutex_lock(&loop_mu);                                                              \
        loop_knobs.field = (value);                                                                \
        pthread_mutex_unlock(&loop_mu);                                                            \
    } while (0)

static inline int loop_get_open_links(void) {
    pthread_mutex_lock(&loop_mu);
    int n = loop_knobs.opened - loop_knobs.closed;
    pthread_mutex_unlock(&loop_mu);
    return n;
}

#endif
