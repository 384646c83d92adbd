/* pool-impl.h: the pool's state, shared by pool.c (workers, status polls,
 * breakers, cs_pool_place) and discovery.c (static lists and DNS names:
 * which workers exist). Internal to router/. */
#ifndef CS_ROUTER_POOL_IMPL_H
#define CS_ROUTER_POOL_IMPL_H

#include <uv.h>

#include "chunkserve/kv_cache.h"
#include "chunkserve/v1/cluster.pb-c.h"
#include "pool.h"
#include "prefix.h"

/* Per-pair KV breakers: how many decode peers a prefill worker remembers. */
#define PAIR_BREAKERS 16

extern const char *const cs__pool_role_name[2];

struct cs_pool_worker {
    cs_pool *pool;
    enum cs_pool_role role;
    char *addr; /* "host:port", the channel's target */
    int source; /* -1: static list; else the index of its DNS entry */
    int refs;
    cs_pool_handle handle; /* its slot and generation (cs_pool_worker_get) */
    bool listed;           /* in the pool's list */
    bool vanished;         /* no longer in its DNS answer: leaves once idle */
    int active;            /* calls of the router on it */
    cs_rpc_channel *ch;
    cs_rpc_client_call *poll;
    Chunkserve__V1__WorkerStatus *poll_msg; /* the answer of the poll in flight */
    cs_pool_worker *next;

    /* Last status. */
    bool have_status; /* valid: arrived, not stale, not suspected since */
    double status_at;
    uint64_t status_seq; /* counts statuses received */
    bool ready, draining, role_ok, model_ok;
    char *worker_id;
    uint64_t instance_id;
    int32_t page_size, pages_free, pages_total, running, waiting;
    cs_kv_blocks kv; /* how its pages hold a block (its status; an older worker: one a block) */
    int64_t queued_prefill;
    cs_ttft_load *queue; /* queued_prefill by (priority, tenant), from its status (groups and
                            overflow only; NULL until a status brings some) */
    double prefill_rate; /* prompt tokens a second beside its decodes (0: unknown) */
    double decode_rate;  /* tokens a second its decodes alone could make (0: unknown) */
    char *kv_endpoint;
    char *kv_sender; /* prefill: the name its KV channels authenticate as */
    int kv_transport;
    uint64_t kv_layout;    /* the KV layout fingerprint it reported (0: unknown) */
    int32_t pages_placed;  /* since that status */
    int64_t tokens_placed; /* since that status (less those of them that left since) */
    cs_place_since since;  /* what left that status's queue since (cs_pool_prompt_left) */
    int32_t reqs_placed;   /* since that status */
    cs_prefix_set *prefix; /* the pages of the requests placed here (prefix.h); NULL: none yet */
    cs_prefix_summary summary; /* what it publishes it holds (prefix.h); empty: nothing */

    bool logged_usable; /* last state logged, so transitions log once */
    bool down_reported; /* on_down ran since the last good status */
    int poll_failures;
    double last_reconnect;

    /* Prefill: the breaker of each (this, decode worker) KV pair that failed
     * (cs_pool_pair_failed): open until open_until, then half-open (one
     * success closes it, a failure opens it again for twice as long). Keyed
     * by the decode worker's address and instance (a restart closes it). */
    struct pair_breaker {
        char dw_addr[96];
        uint64_t dw_instance;
        double open_until, cooldown;
    } pairs[PAIR_BREAKERS];
    int n_pairs;
};

typedef struct {
    cs_pool *pool;
    enum cs_pool_role role;
    int index;
    char *name, *port;
    uv_getaddrinfo_t req;
    bool in_flight;
    bool resolved_once;
} dns_entry;

struct cs_pool {
    uv_loop_t *uv;
    cs_rpc_loop *rl;
    cs_pool_opts o;
    cs_pool_worker *workers[2];
    int n_workers[2];
    dns_entry *dns;
    int n_dns;
    uv_timer_t poll_timer, dns_timer;
    double last_tick;  /* when on_poll_tick last ran */
    double resumed_at; /* the end of this process's last stall (loop lag): no worker is
                          declared down on the silence of a time we were not listening */
    double lag_max;    /* the longest tick lag seen (cs_pool_loop_lag) */
    uint64_t stalls;
    uint64_t pair_trips; /* cs_pool_pair_failed calls */
    int open_handles;
    int dns_in_flight;
    int n_worker_objs; /* allocated workers, listed or not */
    /* every allocated worker by slot (NULL: a free slot) and each slot's
     * last generation: what handles name */
    cs_pool_worker **slots;
    uint32_t *slot_gen;
    uint32_t n_slots;
    bool closing;
    size_t rr[2];
};

/* pool.c, for discovery.c: a worker at addr (source: -1 static, else the
 * index of its DNS entry) joins the role's list unless listed; the pool is
 * freed once closing and idle. */
int cs__pool_worker_add(cs_pool *p, enum cs_pool_role role, const char *addr, int source);
void cs__pool_maybe_free(cs_pool *p);

/* discovery.c: the options' static lists and DNS names into the pool
 * (workers added, DNS entries made), then the first lookups and the refresh
 * timer (p->dns_timer, initialized by the caller). */
int cs__pool_discovery_init(cs_pool *p, const cs_pool_opts *o);
void cs__pool_discovery_start(cs_pool *p);

#endif
