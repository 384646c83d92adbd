/* place.c: the placement policy (place.h states it): pure functions over
 * snapshots of the workers. */
#include "place.h"

#include <math.h>
#include <string.h>

int32_t cs_place_pages(int64_t n_tokens, const cs_kv_blocks *kv) {
    cs_kv_blocks b = *kv;
    if (b.page_size <= 0) b.page_size = 16;
    if (n_tokens < 1) n_tokens = 1;
    return cs_kv_blocks_seq_pages(&b, n_tokens);
}

static bool decode_fits(const cs_place_worker *w, int64_t n_tokens) {
    return w->usable && !w->skip &&
           (int64_t)w->kv_pages_free - w->pages_placed >= cs_place_pages(n_tokens, &w->kv);
}

static int64_t decode_load(const cs_place_worker *w) {
    return (int64_t)w->num_running + w->num_waiting + w->reqs_placed;
}

static bool prefill_fits(const cs_place_worker *w, int64_t n_tokens) {
    cs_kv_blocks b = w->kv; /* the least its chunked prefill holds (cs_kv_cache_min_pages) */
    if (b.page_size <= 0) b.page_size = 16;
    return w->usable && !w->skip && w->kv_pages_total >= cs_kv_blocks_min_pages(&b, n_tokens);
}

static int64_t prefill_load(const cs_place_worker *w) {
    return w->queued_prefill_tokens + w->tokens_placed;
}

/* The prefix-aware narrowing (see cs_place_decode): the highest cached_tokens
 * among the fitting workers within balance of the least load; 0 when no
 * fitting worker holds any of the prompt (or the policy is off). */
static int64_t cached_floor(const cs_place_worker *w, size_t n, int64_t n_tokens, int64_t balance,
                            bool (*fits)(const cs_place_worker *, int64_t),
                            int64_t (*load)(const cs_place_worker *), int64_t *max_load) {
    int64_t min_load = INT64_MAX, best = 0;
    for (size_t i = 0; i < n; i++)
        if (fits(&w[i], n_tokens) && load(&w[i]) < min_load) min_load = load(&w[i]);
    if (balance < 0 || min_load == INT64_MAX) return 0;
    *max_load = min_load > INT64_MAX - balance ? INT64_MAX : min_load + balance;
    for (size_t i = 0; i < n; i++)
        if (fits(&w[i], n_tokens) && load(&w[i]) <= *max_load && w[i].cached_tokens > best)
            best = w[i].cached_tokens;
    return best;
}

int cs_place_decode(const cs_place_worker *w, size_t n, int64_t n_tokens, size_t start,
                    int64_t balance) {
    int64_t max_load = INT64_MAX;
    int64_t want = cached_floor(w, n, n_tokens, balance, decode_fits, decode_load, &max_load);
    int best = -1;
    int64_t best_room = 0, best_load = 0;
    for (size_t k = 0; k < n; k++) {
        size_t i = (start + k) % n;
        if (!decode_fits(&w[i], n_tokens)) continue;
        if (want > 0 && (w[i].cached_tokens < want || decode_load(&w[i]) > max_load)) continue;
        int64_t room = (int64_t)w[i].kv_pages_free - w[i].pages_placed;
        int64_t load = (int64_t)w[i].num_running + w[i].num_waiting;
        if (best < 0 || room > best_room || (room == best_room && load < best_load)) {
            best = (int)i;
            best_room = room;
            best_load = load;
        }
    }
    return best;
}

double cs_place_ttft(const cs_place_worker *w, int64_t n_tokens, const cs_place_class *c) {
    if (!(w->prefill_rate > 0)) return NAN;
    int64_t own = n_tokens - w->cached_tokens;
    if (own < 1) own = 1;
    const cs_ttft_load *L = w->queue;
    if (!c || !L || (L->n_groups == 0 && L->overflow_tokens == 0))
        return (double)(prefill_load(w) + own) / w->prefill_rate;
    double work = cs_ttft_work(L, c->priority, c->tenant, cs_ttft_load_weight(L, c->tenant), own);
    return (work + (double)w->tokens_placed) / w->prefill_rate;
}

/* c's group in L: its index, or CS_TTFT_GROUPS (the tokens past the
 * table, or L's sum alone). */
static int32_t queue_group(const cs_ttft_load *L, const cs_place_class *c) {
    const char *tenant = c && c->tenant ? c->tenant : "";
    int32_t priority = c ? c->priority : 0;
    for (int32_t i = 0; L && i < L->n_groups; i++)
        if (L->groups[i].priority == priority && !strcmp(L->groups[i].tenant, tenant)) return i;
    return CS_TTFT_GROUPS;
}

/* The tokens group g of L holds (L NULL: the sum alone). */
static int64_t *group_tokens(cs_ttft_load *L, int64_t *queued, int32_t g) {
    if (!L) return queued;
    return g < L->n_groups ? &L->groups[g].tokens : &L->overflow_tokens;
}

static void take_group(cs_ttft_load *L, int64_t *queued, int32_t g, int64_t n) {
    if (n <= 0) return;
    *queued = *queued > n ? *queued - n : 0;
    if (!L) return;
    int64_t *t = group_tokens(L, queued, g);
    *t = *t > n ? *t - n : 0;
}

void cs_place_queue_left(cs_ttft_load *L, int64_t *queued, cs_place_since *s,
                         const cs_place_class *c, int64_t n, double most) {
    const int32_t g = queue_group(L, c);
    /* what its group holds and does not owe yet: the status counted no more of it (a
     * prompt that spanned the status had only its rest there) */
    const int64_t held = *group_tokens(L, queued, g) - s->owed[g];
    if (n > 0 && held > 0) s->owed[g] += n < held ? n : held;
    cs_place_queue_settle(L, queued, s, most);
}

void cs_place_queue_settle(cs_ttft_load *L, int64_t *queued, cs_place_since *s, double most) {
    if (!(most > (double)s->done)) return; /* also NAN: an unknown rate takes nothing */
    int32_t owing = 0; /* nothing owed (the usual case at a placement): no order to make */
    for (int32_t g = 0; g <= CS_TTFT_GROUPS && !owing; g++)
        owing = s->owed[g] > 0;
    if (!owing) return;
    double room = most - (double)s->done;
    /* in the order the worker computes them: the tokens past its table (counted ahead
     * of everyone), then the groups by priority, a lower number first */
    int32_t order[CS_TTFT_GROUPS + 1], n = 0;
    order[n++] = CS_TTFT_GROUPS;
    for (int32_t i = 0; L && i < L->n_groups; i++, n++) {
        int32_t j = n;
        for (; j > 1 && L->groups[order[j - 1]].priority > L->groups[i].priority; j--)
            order[j] = order[j - 1];
        order[j] = i;
    }
    for (int32_t k = 0; k < n && room >= 1; k++) {
        const int32_t g = order[k];
        if (s->owed[g] <= 0) continue;
        int64_t t = (double)s->owed[g] <= room ? s->owed[g] : (int64_t)room;
        take_group(L, queued, g, t);
        s->owed[g] -= t;
        s->done += t;
        room -= (double)t;
    }
}

void cs_ttft_rest_add(cs_ttft_rest *r, bool busy, double seconds, double tokens) {
    if (!(isfinite(seconds) && isfinite(tokens) && seconds >= 0 && tokens >= 0)) return;
    cs_ttft_ring *g = busy ? &r->busy : &r->idle;
    g->seconds[g->next] = seconds;
    g->tokens[g->next] = tokens;
    g->next = (g->next + 1) % CS_TTFT_REST_WINDOW;
    if (g->n < CS_TTFT_REST_WINDOW) g->n++;
}

double cs_ttft_rest_get(const cs_ttft_rest *r, bool busy, double rate) {
    const cs_ttft_ring *g = busy ? &r->busy : &r->idle;
    if (g->n < 1) g = busy ? &r->idle : &r->busy;
    if (g->n < 1 || !(rate > 0)) return NAN;
    double s[CS_TTFT_REST_WINDOW];
    int32_t n = g->n;
    for (int32_t i = 0; i < n; i++) { /* insertion sort: at most 16 */
        double x = g->seconds[i] - g->tokens[i] / rate;
        int32_t j = i;
        for (; j > 0 && s[j - 1] > x; j--)
            s[j] = s[j - 1];
        s[j] = x;
    }
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

int cs_place_prefill(const cs_place_worker *w, size_t n, int64_t n_tokens, size_t start,
                     int64_t balance, const cs_place_class *c) {
    int64_t max_load = INT64_MAX;
    int64_t want = cached_floor(w, n, n_tokens, balance, prefill_fits, prefill_load, &max_load);
    bool timed = true; /* every candidate reports its rate: compare predicted TTFTs */
    for (size_t i = 0; i < n; i++)
        if (prefill_fits(&w[i], n_tokens) && !(w[i].prefill_rate > 0)) timed = false;
    int best = -1;
    double best_q = 0;
    for (size_t k = 0; k < n; k++) {
        size_t i = (start + k) % n;
        if (!prefill_fits(&w[i], n_tokens)) continue;
        if (want > 0 && (w[i].cached_tokens < want || prefill_load(&w[i]) > max_load)) continue;
        double q = timed ? cs_place_ttft(&w[i], n_tokens, c) : (double)prefill_load(&w[i]);
        if (best < 0 || q < best_q) {
            best = (int)i;
            best_q = q;
        }
    }
    return best;
}
