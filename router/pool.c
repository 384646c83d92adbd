/* pool.c: the workers discovery.c finds, their status polling
 * (Worker/GetStatus on every worker each status interval, deadline 1 s),
 * usability, the per-pair KV breakers, and placement (the snapshots the
 * pure policy of place.c chooses from).
 *
 * Lifetime. A worker is referenced by its pool list, by its status call in
 * flight and by every call of the router on it (a leg, a Cancel;
 * cs_pool_worker_ref); it is freed at the last reference. Requests name
 * workers by handle (cs_pool_handle), which reads NULL from then on. A worker that vanished from
 * DNS leaves the list once no call of the router is active on it. The pool itself is freed by
 * cs_pool_close once its timers are closed, its DNS lookups have called back and its last worker is
 * gone.
 *
 * Why a worker's channel is sometimes recreated: gRPC backs off reconnects
 * exponentially (up to minutes), so a worker that restarts after a long
 * outage would stay unreachable for a while; while a worker fails its polls
 * and has no call of ours on it, its channel is replaced every few seconds. */
#include "pool-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "chunkserve/v1/cluster.pb-c.h"
#include "chunkserve/assert.h"
#include "chunkserve/secret.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

#define STATUS_DEADLINE_MS 1000
#define RECONNECT_EVERY_S 2.0
/* A worker with calls of ours that has not answered a status poll for this
 * long is declared down (on_down): a hung or stopped process keeps its TCP
 * connections open, so its streams would otherwise stall until their
 * deadlines. At least this many status intervals, too. */
#define DOWN_AFTER_S 3.0
#define DOWN_AFTER_POLLS 5
/* Per-pair KV breakers (PAIR_BREAKERS of them, pool-impl.h): the first
 * cooldown and the longest. */
#define PAIR_COOLDOWN_S 10.0
#define PAIR_COOLDOWN_MAX_S 60.0

/* ------------------------------------------------------------ pool -- */

const char *const cs__pool_role_name[2] = {"prefill", "decode"};

static double stale_after_s(const cs_pool *p) {
    return (2.0 * p->o.status_interval_ms + STATUS_DEADLINE_MS) / 1000.0;
}

static bool worker_usable(const cs_pool_worker *w, double now) {
    return w->ch && w->listed && !w->vanished && w->have_status &&
           now - w->status_at <= stale_after_s(w->pool) && w->ready && !w->draining && w->role_ok &&
           w->model_ok;
}

void cs__pool_maybe_free(cs_pool *p) {
    if (!p->closing || p->open_handles || p->dns_in_flight || p->n_worker_objs) return;
    for (int i = 0; i < p->n_dns; i++) {
        free(p->dns[i].name);
        free(p->dns[i].port);
    }
    free(p->dns);
    free(p->slots);
    free(p->slot_gen);
    free(p);
}

/* A slot for w (a free one, else one more) and the slot's next generation. */
static int slot_take(cs_pool *p, cs_pool_worker *w) {
    uint32_t i = 0;
    while (i < p->n_slots && p->slots[i])
        i++;
    if (i == p->n_slots) {
        uint32_t n = p->n_slots ? 2 * p->n_slots : 16;
        cs_pool_worker **s = realloc(p->slots, n * sizeof *s);
        if (s) p->slots = s;
        uint32_t *g = s ? realloc(p->slot_gen, n * sizeof *g) : NULL;
        if (!s || !g) return cs_fail(CS_ENOMEM, "out of memory");
        p->slot_gen = g;
        for (uint32_t k = p->n_slots; k < n; k++)
            p->slots[k] = NULL, p->slot_gen[k] = 0;
        p->n_slots = n;
    }
    p->slots[i] = w;
    w->handle = (cs_pool_handle){i, ++p->slot_gen[i]};
    if (!w->handle.gen) w->handle.gen = ++p->slot_gen[i]; /* 0 names none */
    return 0;
}

cs_pool_handle cs_pool_worker_handle(const cs_pool_worker *w) {
    return w ? w->handle : (cs_pool_handle){0, 0};
}

cs_pool_worker *cs_pool_worker_get(const cs_pool *p, cs_pool_handle h) {
    if (!p || !h.gen || h.slot >= p->n_slots || p->slot_gen[h.slot] != h.gen) return NULL;
    return p->slots[h.slot];
}

void cs_pool_worker_ref(cs_pool_worker *w) {
    w->refs++;
}

void cs_pool_worker_unref(cs_pool_worker *w) {
    if (!w) return;
    CS_ASSERT(w->refs > 0);
    if (--w->refs) return;
    CS_ASSERT(!w->listed && !w->poll && !w->ch);
    cs_pool *p = w->pool;
    free(w->addr);
    free(w->worker_id);
    free(w->kv_endpoint);
    free(w->kv_sender);
    free(w->queue);
    cs_prefix_set_free(w->prefix);
    cs_prefix_summary_clear(&w->summary);
    p->slots[w->handle.slot] = NULL; /* its handles read NULL from here */
    free(w);
    p->n_worker_objs--;
    cs__pool_maybe_free(p);
}

cs_rpc_channel *cs_pool_worker_channel(const cs_pool_worker *w) {
    return w->ch;
}
const char *cs_pool_worker_addr(const cs_pool_worker *w) {
    return w->addr;
}
const char *cs_pool_worker_id(const cs_pool_worker *w) {
    return w->worker_id ? w->worker_id : "";
}
/* The status's queued prompt groups into w->queue (cleared when it has
 * none: an older worker, or nothing queued). A group that cannot be right
 * (a weight out of the share bounds, a long name) counts ahead of
 * everyone; token counts are capped (2^50: far beyond any queue) so that
 * their sums cannot overflow. A group of 0 tokens names a tenant's share. */
static void take_queue(cs_pool_worker *w, const Chunkserve__V1__WorkerStatus *s) {
    if (!w->queue && (s->n_queued_prompts || s->queued_unsorted_tokens > 0))
        w->queue = calloc(1, sizeof *w->queue); /* none: the queue's sum alone */
    if (!w->queue) return;
    const int64_t most = (int64_t)1 << 50;
    cs_ttft_load *L = w->queue;
    L->n_groups = 0;
    L->overflow_tokens = s->queued_unsorted_tokens > 0 ? s->queued_unsorted_tokens : 0;
    if (L->overflow_tokens > most) L->overflow_tokens = most;
    for (size_t i = 0; i < s->n_queued_prompts; i++) {
        const Chunkserve__V1__QueuedPrompts *g = s->queued_prompts[i];
        int64_t tokens = g->tokens < 0 ? 0 : g->tokens > most ? most : g->tokens;
        if (g->weight >= CS_TENANT_SHARE_MIN && g->weight <= CS_TENANT_SHARE_MAX && g->tenant &&
            strlen(g->tenant) <= CS_TENANT_NAME_MAX)
            cs_ttft_load_add(L, g->priority, g->tenant, g->weight, tokens);
        else
            L->overflow_tokens += tokens;
    }
}

const char *cs_pool_worker_kv_sender(const cs_pool_worker *w) {
    return w->kv_sender ? w->kv_sender : "";
}

const char *cs_pool_worker_kv_endpoint(const cs_pool_worker *w) {
    return w->kv_endpoint ? w->kv_endpoint : "";
}
bool cs_pool_knows_kv_endpoint(const cs_pool *p, enum cs_pool_role role, const char *ep) {
    for (const cs_pool_worker *w = p->workers[role]; w; w = w->next)
        if (w->listed && !w->vanished && w->status_seq && w->role_ok && w->model_ok &&
            w->kv_endpoint && w->kv_endpoint[0] && !strcmp(w->kv_endpoint, ep))
            return true;
    return false;
}
int cs_pool_worker_kv_transport(const cs_pool_worker *w) {
    return w->kv_transport;
}
void cs_pool_worker_active(cs_pool_worker *w, int delta) {
    w->active += delta;
    CS_ASSERT(w->active >= 0);
}

static void log_usability(cs_pool_worker *w, double now, const char *why) {
    bool u = worker_usable(w, now);
    if (u == w->logged_usable) return;
    w->logged_usable = u;
    if (u)
        CS_LOGI("%s worker %s (%s) is usable: %d KV pages of %d tokens free",
                cs__pool_role_name[w->role], w->addr, cs_pool_worker_id(w), w->pages_free,
                w->page_size);
    else
        CS_LOGW("%s worker %s (%s) is not usable: %s", cs__pool_role_name[w->role], w->addr,
                cs_pool_worker_id(w), why);
}

void cs_pool_worker_suspect(cs_pool_worker *w, const char *why) {
    w->have_status = false;
    log_usability(w, cs_now(), why);
}

static int channel_open(cs_pool_worker *w) {
    cs_rpc_metadata md = {CS_RPC_TOKEN_KEY, w->pool->o.rpc_token};
    cs_rpc_channel_opts co = {.max_recv_bytes = 64 << 20,
                              .max_send_bytes = 0,
                              .metadata = &md,
                              .n_metadata = w->pool->o.rpc_token ? 1 : 0};
    if (w->pool->o.worker_tls) co.tls = *w->pool->o.worker_tls;
    return cs_rpc_channel_init(w->pool->rl, w->addr, &co, &w->ch);
}

void cs_pool_rpc_token_changed(cs_pool *p) {
    if (!p || !p->o.rpc_token) return;
    for (int role = 0; role < 2; role++)
        for (cs_pool_worker *w = p->workers[role]; w; w = w->next)
            if (w->ch && cs_rpc_channel_set_metadata(w->ch, CS_RPC_TOKEN_KEY, p->o.rpc_token))
                CS_LOGE("%s worker %s: the rotated token is not used: %s", cs__pool_role_name[role],
                        w->addr, cs_last_error());
}

static cs_pool_worker *worker_find(cs_pool *p, enum cs_pool_role role, const char *addr) {
    for (cs_pool_worker *w = p->workers[role]; w; w = w->next)
        if (!strcmp(w->addr, addr)) return w;
    return NULL;
}

int cs__pool_worker_add(cs_pool *p, enum cs_pool_role role, const char *addr, int source) {
    cs_pool_worker *w = worker_find(p, role, addr);
    if (w) {
        if (w->vanished && w->source == source) {
            w->vanished = false;
            CS_LOGI("%s worker %s is back in DNS", cs__pool_role_name[role], addr);
        }
        return 0;
    }
    w = calloc(1, sizeof *w);
    if (!w || !(w->addr = strdup(addr)) || slot_take(p, w)) {
        if (w) free(w->addr);
        free(w);
        return cs_fail(CS_ENOMEM, "out of memory");
    }
    w->pool = p;
    w->role = role;
    w->source = source;
    w->refs = 1;
    w->listed = true;
    p->n_worker_objs++;
    int r = channel_open(w);
    if (r) {
        w->listed = false;
        cs_pool_worker_unref(w);
        return r;
    }
    w->next = p->workers[role];
    p->workers[role] = w;
    p->n_workers[role]++;
    CS_LOGI("%s worker %s added (%s)", cs__pool_role_name[role], addr,
            source < 0 ? "static list" : p->dns[source].name);
    return 0;
}

/* Takes w off the list and closes its channel (its calls end through their
 * callbacks); the list's reference goes. */
static void worker_remove(cs_pool_worker *w) {
    cs_pool *p = w->pool;
    cs_pool_worker **pp = &p->workers[w->role];
    while (*pp != w)
        pp = &(*pp)->next;
    *pp = w->next;
    w->next = NULL;
    w->listed = false;
    p->n_workers[w->role]--;
    cs_rpc_channel *ch = w->ch;
    w->ch = NULL;
    cs_rpc_channel_free(ch);
    cs_pool_worker_unref(w);
}

/* --------------------------------------------------------- polling -- */

static void apply_status(cs_pool_worker *w, const Chunkserve__V1__WorkerStatus *s) {
    cs_pool *p = w->pool;
    if (w->instance_id && s->instance_id != w->instance_id)
        CS_LOGW("%s worker %s restarted (%s instance %016llx -> %s instance %016llx)",
                cs__pool_role_name[w->role], w->addr, cs_pool_worker_id(w),
                (unsigned long long)w->instance_id, s->worker_id,
                (unsigned long long)s->instance_id);
    if (s->instance_id != w->instance_id) { /* a new life: its prefix cache is empty */
        w->poll_failures = 0, w->n_pairs = 0;
        if (w->prefix) cs_prefix_set_clear(w->prefix);
        cs_prefix_summary_clear(&w->summary);
    }
    double complete = cs_now() - s->prefix_summary_behind_ms / 1e3;
    if (!s->prefix_summary_version)
        cs_prefix_summary_clear(&w->summary); /* it publishes none (any more) */
    else if (s->prefix_summary.len) {
        if (cs_prefix_summary_set(&w->summary, s->prefix_summary.data, s->prefix_summary.len,
                                  s->prefix_summary_bits, s->prefix_summary_version,
                                  complete) == CS_EINVAL)
            CS_LOGW("%s worker %s: malformed prefix summary (%zu bytes, %u bits): ignored",
                    cs__pool_role_name[w->role], w->addr, s->prefix_summary.len,
                    s->prefix_summary_bits);
    } else if (s->prefix_summary_version == w->summary.version) {
        w->summary.complete = complete; /* the one we hold, still true until then */
    }
    w->instance_id = s->instance_id;
    if (!w->worker_id || strcmp(w->worker_id, s->worker_id)) {
        char *id = strdup(s->worker_id);
        if (id) free(w->worker_id), w->worker_id = id;
    }
    if (!w->kv_sender || strcmp(w->kv_sender, s->kv_sender)) {
        char *e = strdup(s->kv_sender);
        if (e) free(w->kv_sender), w->kv_sender = e;
    }
    if (!w->kv_endpoint || strcmp(w->kv_endpoint, s->kv_endpoint)) {
        char *e = strdup(s->kv_endpoint);
        if (e) free(w->kv_endpoint), w->kv_endpoint = e;
    }
    int want = w->role == CS_POOL_DECODE ? CHUNKSERVE__V1__WORKER_ROLE__WORKER_ROLE_DECODE
                                         : CHUNKSERVE__V1__WORKER_ROLE__WORKER_ROLE_PREFILL;
    bool role_ok = (int)s->role == want, first = !w->status_seq;
    const Chunkserve__V1__ModelInfo *mi = s->model;
    bool model_ok =
        mi && (!p->o.expect_n_vocab || mi->vocab_size == p->o.expect_n_vocab) &&
        (!p->o.expect_arch || !strcmp(mi->architecture, p->o.expect_arch)) &&
        (!p->o.expect_ctx_len || mi->context_length == p->o.expect_ctx_len) &&
        (!p->o.expect_model_fp || mi->fingerprint == p->o.expect_model_fp) &&
        (!p->o.expect_tokenizer_fp || mi->tokenizer_fingerprint == p->o.expect_tokenizer_fp);
    if (!role_ok && (first || w->role_ok))
        CS_LOGE("%s worker %s reports role %d: not a %s worker", cs__pool_role_name[w->role],
                w->addr, (int)s->role, cs__pool_role_name[w->role]);
    if (!model_ok && (first || w->model_ok))
        CS_LOGE("%s worker %s serves another model (%s, vocabulary %d, context %d, fingerprint "
                "%016llx, tokenizer %016llx); this router's is %s, %d, %d, %016llx, %016llx: it "
                "gets no requests",
                cs__pool_role_name[w->role], w->addr, mi ? mi->architecture : "?",
                mi ? mi->vocab_size : 0, mi ? mi->context_length : 0,
                mi ? (unsigned long long)mi->fingerprint : 0ull,
                mi ? (unsigned long long)mi->tokenizer_fingerprint : 0ull,
                p->o.expect_arch ? p->o.expect_arch : "?", p->o.expect_n_vocab, p->o.expect_ctx_len,
                (unsigned long long)p->o.expect_model_fp,
                (unsigned long long)p->o.expect_tokenizer_fp);
    w->role_ok = role_ok;
    w->model_ok = model_ok;
    w->ready = s->ready;
    w->draining = s->draining;
    w->page_size = s->page_size > 0 ? s->page_size : 16;
    w->kv = (cs_kv_blocks){w->page_size, 1, 1, 0};
    if (s->kv_pages_per_block >= 1 && s->kv_global_pages_per_block >= 0 &&
        s->kv_global_pages_per_block <= s->kv_pages_per_block && s->kv_window >= 0)
        w->kv = (cs_kv_blocks){w->page_size, s->kv_pages_per_block,
                               s->kv_global_pages_per_block, s->kv_window};
    w->pages_free = s->kv_pages_free;
    w->pages_total = s->kv_pages_total;
    w->running = s->num_running;
    w->waiting = s->num_waiting;
    w->queued_prefill = s->queued_prefill_tokens;
    take_queue(w, s);
    w->prefill_rate = s->prefill_tokens_per_second > 0 && isfinite(s->prefill_tokens_per_second)
                          ? s->prefill_tokens_per_second
                          : 0;
    w->decode_rate = s->decode_tokens_per_second > 0 && isfinite(s->decode_tokens_per_second)
                         ? s->decode_tokens_per_second
                         : 0;
    w->kv_transport = s->kv_transport;
    w->kv_layout = s->kv_layout_fingerprint;
    w->pages_placed = 0;
    w->tokens_placed = 0;
    w->since = (cs_place_since){0};
    w->reqs_placed = 0;
    w->status_at = cs_now();
    w->status_seq++;
    w->have_status = true;
    w->poll_failures = 0;
    w->down_reported = false;
    log_usability(w, w->status_at,
                  !role_ok      ? "wrong role"
                  : !model_ok   ? "another model"
                  : w->draining ? "draining"
                  : !w->ready   ? "not ready"
                                : "");
}

static void on_poll_message(cs_rpc_client_call *c, const uint8_t *buf, size_t len, void *data) {
    cs_pool_worker *w = data;
    ProtobufCMessage *m = NULL;
    if (cs_rpc_unpack(&chunkserve__v1__worker_status__descriptor, buf, len, &m) == 0) {
        if (w->poll_msg) protobuf_c_message_free_unpacked(&w->poll_msg->base, NULL);
        w->poll_msg = (Chunkserve__V1__WorkerStatus *)m;
    }
}

static void maybe_reconnect(cs_pool_worker *w) {
    double now = cs_now();
    if (w->active || !w->ch || w->pool->closing || w->poll_failures < 2 ||
        now - w->last_reconnect < RECONNECT_EVERY_S)
        return;
    w->last_reconnect = now;
    cs_rpc_channel *old = w->ch;
    w->ch = NULL;
    cs_rpc_channel_free(old);
    if (channel_open(w) != 0)
        CS_LOGE("worker %s: cannot reopen its channel: %s", w->addr, cs_last_error());
}

static void on_poll_done(cs_rpc_client_call *c, int code, const char *msg, void *data) {
    cs_pool_worker *w = data;
    cs_pool *p = w->pool;
    w->poll = NULL;
    Chunkserve__V1__WorkerStatus *s = w->poll_msg;
    w->poll_msg = NULL;
    if (!p->closing && w->listed) {
        if (code == CS_RPC_OK && s) {
            apply_status(w, s);
            if (worker_usable(w, w->status_at) && p->o.on_change) p->o.on_change(p->o.arg);
        } else {
            w->poll_failures++;
            if (w->have_status || w->logged_usable || w->poll_failures == 1) {
                char why[300];
                snprintf(why, sizeof why, "status poll failed: %s %s", cs_rpc_code_name(code), msg);
                if (w->poll_failures == 1 && !w->logged_usable && !w->status_seq)
                    CS_LOGW("%s worker %s: %s", cs__pool_role_name[w->role], w->addr, why);
                w->have_status = false;
                log_usability(w, cs_now(), why);
            }
            maybe_reconnect(w);
        }
    }
    if (s) protobuf_c_message_free_unpacked(&s->base, NULL);
    cs_pool_worker_unref(w);
}

static void poll_worker(cs_pool_worker *w, double now) {
    cs_pool *p = w->pool;
    if (w->have_status && now - w->status_at > stale_after_s(p)) {
        w->have_status = false;
        log_usability(w, now, "status is stale");
    }
    double down_after = DOWN_AFTER_POLLS * p->o.status_interval_ms / 1000.0;
    if (down_after < DOWN_AFTER_S) down_after = DOWN_AFTER_S;
    /* silence counts from the last status, or from the end of our own stall
     * if that came later: the workers get a full window of fresh polls */
    double silent_since = w->status_at > p->resumed_at ? w->status_at : p->resumed_at;
    if (w->active && w->status_seq && !w->down_reported && now - silent_since > down_after &&
        p->o.on_down) {
        w->down_reported = true;
        CS_LOGW("%s worker %s (%s) has not answered a status poll for %.1f s: failing over its "
                "requests",
                cs__pool_role_name[w->role], w->addr, cs_pool_worker_id(w), now - w->status_at);
        p->o.on_down(p->o.arg, w);
    }
    if (w->poll || !w->ch) return;
    Chunkserve__V1__WorkerStatusRequest req = CHUNKSERVE__V1__WORKER_STATUS_REQUEST__INIT;
    req.prefix_summary_version = w->summary.version; /* the bits come only when it changed */
    cs_rpc_call_opts o = {.timeout_ms = STATUS_DEADLINE_MS};
    cs_pool_worker_ref(w);
    if (cs_rpc_channel_call_msg(w->ch, "/chunkserve.v1.Worker/GetStatus", &req.base, &o,
                                on_poll_message, on_poll_done, w, &w->poll) != 0) {
        CS_LOGE("worker %s: cannot poll its status: %s", w->addr, cs_last_error());
        w->poll = NULL;
        cs_pool_worker_unref(w);
    }
}

void cs_pool_loop_lag(const cs_pool *p, double *lag_max_s, uint64_t *stalls) {
    *lag_max_s = p->lag_max;
    *stalls = p->stalls;
}

static void on_poll_tick(uv_timer_t *t) {
    cs_pool *p = t->data;
    double now = cs_now();
    /* Our own loop lag: the tick came this much later than it was due (a
     * burst of work on the loop thread, CPU starvation, SIGSTOP, a VM pause). */
    double lag = p->last_tick > 0 ? now - p->last_tick - p->o.status_interval_ms / 1000.0 : 0;
    p->last_tick = now;
    if (lag > p->lag_max) p->lag_max = lag;
    if (lag > 1.0 && lag > p->o.status_interval_ms / 1000.0) {
        p->stalls++;
        p->resumed_at = now;
        CS_LOGW("this router's loop stalled for %.1f s: no worker is declared down before a "
                "fresh round of status polls",
                lag);
    }
    for (int role = 0; role < 2; role++) {
        cs_pool_worker *next;
        for (cs_pool_worker *w = p->workers[role]; w; w = next) {
            next = w->next;
            if (w->vanished && !w->active) {
                CS_LOGI("%s worker %s (%s) left DNS and is idle: dropped", cs__pool_role_name[role],
                        w->addr, cs_pool_worker_id(w));
                worker_remove(w);
                continue;
            }
            poll_worker(w, now);
        }
    }
}

/* ------------------------------------------------------------ init -- */

static void on_timer_closed(uv_handle_t *h) {
    cs_pool *p = h->data;
    p->open_handles--;
    cs__pool_maybe_free(p);
}

int cs_pool_init(uv_loop_t *uv, cs_rpc_loop *rl, const cs_pool_opts *o, cs_pool **out) {
    *out = NULL;
    cs_pool *p = calloc(1, sizeof *p);
    if (!p) return cs_fail(CS_ENOMEM, "out of memory");
    p->uv = uv;
    p->rl = rl;
    p->o = *o;
    if (p->o.status_interval_ms <= 0) p->o.status_interval_ms = 200;
    if (p->o.dns_refresh_ms <= 0) p->o.dns_refresh_ms = 5000;
    int r = cs__pool_discovery_init(p, o);
    uv_timer_init(uv, &p->poll_timer);
    uv_timer_init(uv, &p->dns_timer);
    p->poll_timer.data = p->dns_timer.data = p;
    p->open_handles = 2;
    if (r) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", cs_last_error());
        cs_pool_close(p);
        return cs_fail(r, "%s", msg);
    }
    cs__pool_discovery_start(p);
    /* first poll at once, so a router started beside its workers is ready soon */
    uv_timer_start(&p->poll_timer, on_poll_tick, 0, (uint64_t)p->o.status_interval_ms);
    CS_LOGI("pools: %d prefill, %d decode workers listed, %d DNS names; status every %d ms",
            p->n_workers[0], p->n_workers[1], p->n_dns, p->o.status_interval_ms);
    *out = p;
    return 0;
}

void cs_pool_close(cs_pool *p) {
    if (!p || p->closing) return;
    p->closing = true;
    uv_close((uv_handle_t *)&p->poll_timer, on_timer_closed);
    uv_close((uv_handle_t *)&p->dns_timer, on_timer_closed);
    for (int i = 0; i < p->n_dns; i++)
        if (p->dns[i].in_flight) uv_cancel((uv_req_t *)&p->dns[i].req);
    for (int role = 0; role < 2; role++)
        while (p->workers[role])
            worker_remove(p->workers[role]);
    cs__pool_maybe_free(p);
}

int cs_pool_n_usable(const cs_pool *p, enum cs_pool_role role) {
    double now = cs_now();
    int n = 0;
    for (const cs_pool_worker *w = p->workers[role]; w; w = w->next)
        n += worker_usable(w, now);
    return n;
}

/* Prompt tokens w can have computed since its status, at its rate (0:
 * unknown). */
static double computable(const cs_pool_worker *w, double now) {
    return w->prefill_rate > 0 ? w->prefill_rate * (now - w->status_at) : 0;
}

/* Takes off w's reported queue what its computed prompts still owe it
 * (cs_place_queue_settle), before the queue is read. */
static void settle(cs_pool_worker *w, double now) {
    cs_place_queue_settle(w->queue, &w->queued_prefill, &w->since, computable(w, now));
}

double cs_pool_ttft(cs_pool *p, enum cs_pool_role role, int64_t n_tokens,
                    const cs_place_class *c, double *alone, double *rate) {
    double now = cs_now(), best = NAN;
    *alone = *rate = NAN;
    for (cs_pool_worker *w = p->workers[role]; w; w = w->next) {
        if (!worker_usable(w, now) || !(w->prefill_rate > 0)) continue;
        settle(w, now);
        cs_place_worker s = {.queued_prefill_tokens = w->queued_prefill,
                             .tokens_placed = w->tokens_placed,
                             .prefill_rate = w->prefill_rate,
                             .queue = w->queue};
        double t = cs_place_ttft(&s, n_tokens, c);
        if (isnan(best) || t < best)
            best = t, *alone = (double)n_tokens / w->prefill_rate, *rate = w->prefill_rate;
    }
    return best;
}

void cs_pool_capacity(const cs_pool *p, enum cs_pool_role role, double *prefill, double *decode) {
    double now = cs_now(), sp = 0, sd = 0;
    int np = 0, nd = 0;
    for (const cs_pool_worker *w = p->workers[role]; w; w = w->next) {
        if (!worker_usable(w, now)) continue;
        if (w->prefill_rate > 0) sp += w->prefill_rate, np++;
        if (w->decode_rate > 0) sd += w->decode_rate, nd++;
    }
    *prefill = np ? sp / np : 0;
    *decode = nd ? sd / nd : 0;
}

int cs_pool_n_workers(const cs_pool *p, enum cs_pool_role role) {
    return p->n_workers[role];
}

static bool same(cs_pool_handle a, cs_pool_handle b) {
    return a.slot == b.slot && a.gen == b.gen;
}

static bool excluded(const cs_pool_worker *w, const cs_pool_marks *m) {
    for (size_t i = 0; m && i < m->n_excluded; i++)
        if (same(m->excluded[i].w, w->handle) && m->excluded[i].instance_id == w->instance_id)
            return true;
    return false;
}

static bool refused(const cs_pool_worker *w, const cs_pool_marks *m) {
    for (size_t i = 0; m && i < m->n_refused; i++)
        if (same(m->refused[i].w, w->handle) && m->refused[i].status_seq == w->status_seq)
            return true;
    return false;
}

/* Can w send its KV pages to peer (same payload, same page layout)? A worker
 * that did not report a layout (an older one) is taken at its word. */
static struct pair_breaker *pair_find(cs_pool_worker *pw, const cs_pool_worker *dw) {
    for (int i = 0; i < pw->n_pairs; i++)
        if (!strcmp(pw->pairs[i].dw_addr, dw->addr) && pw->pairs[i].dw_instance == dw->instance_id)
            return &pw->pairs[i];
    return NULL;
}

void cs_pool_pair_failed(cs_pool_worker *pw, cs_pool_worker *dw) {
    double now = cs_now();
    struct pair_breaker *b = pair_find(pw, dw);
    if (!b) {
        if (pw->n_pairs < PAIR_BREAKERS) {
            b = &pw->pairs[pw->n_pairs++];
        } else { /* forget the one that reopened longest ago */
            b = &pw->pairs[0];
            for (int i = 1; i < pw->n_pairs; i++)
                if (pw->pairs[i].open_until < b->open_until) b = &pw->pairs[i];
        }
        memset(b, 0, sizeof *b);
        snprintf(b->dw_addr, sizeof b->dw_addr, "%s", dw->addr);
        b->dw_instance = dw->instance_id;
    }
    b->cooldown = b->cooldown > 0 ? 2 * b->cooldown : PAIR_COOLDOWN_S;
    if (b->cooldown > PAIR_COOLDOWN_MAX_S) b->cooldown = PAIR_COOLDOWN_MAX_S;
    b->open_until = now + b->cooldown;
    pw->pool->pair_trips++;
    CS_LOGW("KV pair prefill %s -> decode %s failed: its prefills go elsewhere for %.0f s",
            pw->addr, dw->addr, b->cooldown);
}

void cs_pool_pair_ok(cs_pool_worker *pw, const cs_pool_worker *dw) {
    struct pair_breaker *b = pair_find(pw, dw);
    if (!b) return;
    CS_LOGI("KV pair prefill %s -> decode %s works again", pw->addr, dw->addr);
    *b = pw->pairs[--pw->n_pairs];
}

uint64_t cs_pool_pair_trips(const cs_pool *p) {
    return p->pair_trips;
}

static bool pair_open(cs_pool_worker *pw, const cs_pool_worker *dw, double now) {
    struct pair_breaker *b = dw ? pair_find(pw, dw) : NULL;
    return b && now < b->open_until;
}

static bool kv_compatible(const cs_pool_worker *w, const cs_pool_worker *peer) {
    if (!peer) return true;
    if (w->kv_transport != peer->kv_transport) return false;
    return !w->kv_layout || !peer->kv_layout || w->kv_layout == peer->kv_layout;
}

/* The request's page chain for page size ps, computed once per size (a
 * pool's workers share one page size in practice). */
typedef struct {
    int32_t ps, n;
    uint64_t *h;
} chain;

static const chain *chain_for(chain *c, const cs_pool_prefix *pf, int64_t n_tokens, int32_t ps) {
    if (c->h && c->ps == ps) return c;
    int32_t k = cs_prefix_pages(n_tokens, ps);
    uint64_t *h = realloc(c->h, (size_t)(k > 0 ? k : 1) * sizeof *h);
    if (!h) return NULL; /* no prediction: placed by load */
    c->h = h;
    c->ps = ps;
    c->n = cs_prefix_chain(pf->ids, n_tokens, ps, pf->salt, h, k);
    return c;
}

cs_pool_worker *cs_pool_place(cs_pool *p, enum cs_pool_role role, int64_t n_tokens,
                              const cs_pool_marks *marks, int *n_candidates,
                              const cs_pool_worker *peer, const cs_pool_prefix *pf,
                              const cs_place_class *cls, int64_t *cached) {
    if (n_candidates) *n_candidates = 0;
    if (cached) *cached = 0;
    size_t n = (size_t)p->n_workers[role];
    if (p->closing || n == 0) return NULL;
    cs_place_worker stack[64], *snap = n <= 64 ? stack : malloc(n * sizeof *snap);
    cs_pool_worker *wstack[64], **ws = n <= 64 ? wstack : malloc(n * sizeof *ws);
    cs_pool_worker *chosen = NULL;
    chain ch = {0};
    if (!snap || !ws) goto out;
    double now = cs_now();
    size_t i = 0;
    int cand = 0;
    for (cs_pool_worker *w = p->workers[role]; w; w = w->next, i++) {
        ws[i] = w;
        settle(w, now);
        snap[i] = (cs_place_worker){
            .usable = worker_usable(w, now),
            .skip = excluded(w, marks),
            .kv = w->kv,
            .kv_pages_free = w->pages_free,
            .kv_pages_total = w->pages_total,
            .pages_placed = w->pages_placed,
            .num_running = w->running,
            .num_waiting = w->waiting,
            .queued_prefill_tokens = w->queued_prefill,
            .prefill_rate = w->prefill_rate,
            .queue = w->queue,
            .tokens_placed = w->tokens_placed,
            .reqs_placed = w->reqs_placed,
        };
        const chain *c = pf && (w->prefix || w->summary.bits)
                             ? chain_for(&ch, pf, n_tokens, w->page_size)
                             : NULL;
        if (c)
            snap[i].cached_tokens =
                (int64_t)cs_prefix_match(w->prefix, &w->summary, c->h, c->n, now, pf->ttl_s) *
                c->ps;
        cand += snap[i].usable && !snap[i].skip;
        snap[i].skip = snap[i].skip || refused(w, marks) || !kv_compatible(w, peer) ||
                       (role == CS_POOL_PREFILL && pair_open(w, peer, now));
    }
    if (n_candidates) *n_candidates = cand;
    size_t start = p->rr[role]++ % n;
    int64_t balance = pf ? pf->balance[role] : -1;
    int k = role == CS_POOL_DECODE ? cs_place_decode(snap, n, n_tokens, start, balance)
                                   : cs_place_prefill(snap, n, n_tokens, start, balance, cls);
    if (k >= 0) {
        chosen = ws[k];
        if (role == CS_POOL_DECODE)
            chosen->pages_placed += cs_place_pages(n_tokens, &chosen->kv);
        else
            chosen->tokens_placed += n_tokens;
        chosen->reqs_placed++;
        cs_pool_worker_ref(chosen);
        if (cached) *cached = snap[k].cached_tokens;
        if (pf && !chosen->prefix) /* it cannot hold more pages than its pool has */
            chosen->prefix =
                cs_prefix_set_new(chosen->pages_total > 0 && chosen->pages_total < pf->index_pages
                                      ? chosen->pages_total
                                      : pf->index_pages);
        const chain *c =
            pf && chosen->prefix ? chain_for(&ch, pf, n_tokens, chosen->page_size) : NULL;
        if (c) cs_prefix_set_add(chosen->prefix, c->h, c->n, now);
    }
out:
    free(ch.h);
    if (snap != stack) free(snap);
    if (ws != wstack) free(ws);
    return chosen;
}

void cs_pool_prompt_placed(cs_pool_worker *w, int64_t n_tokens) {
    if (w) w->tokens_placed += n_tokens;
}

uint64_t cs_pool_status_seq(const cs_pool_worker *w) {
    return w ? w->status_seq : 0;
}

void cs_pool_prompt_left(cs_pool_worker *w, int64_t n_tokens, uint64_t placed_seq,
                         const cs_place_class *c, bool computed) {
    if (!w || n_tokens <= 0) return;
    if (w->status_seq == placed_seq) {
        w->tokens_placed = w->tokens_placed > n_tokens ? w->tokens_placed - n_tokens : 0;
        return;
    }
    if (computed)
        cs_place_queue_left(w->queue, &w->queued_prefill, &w->since, c, n_tokens,
                            computable(w, cs_now()));
}

int cs_pool_mark_add(cs_pool_mark **arr, size_t *n, const cs_pool_worker *w) {
    for (size_t i = 0; i < *n; i++)
        if (same((*arr)[i].w, w->handle)) {
            (*arr)[i].instance_id = w->instance_id;
            (*arr)[i].status_seq = w->status_seq;
            return 0;
        }
    cs_pool_mark *na = realloc(*arr, (*n + 1) * sizeof *na);
    if (!na) return cs_fail(CS_ENOMEM, "out of memory");
    *arr = na;
    na[(*n)++] = (cs_pool_mark){w->handle, w->instance_id, w->status_seq};
    return 0;
}

void cs_pool_marks_free(cs_pool_marks *m) {
    free(m->excluded);
    free(m->refused);
    memset(m, 0, sizeof *m);
}
