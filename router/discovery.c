/* discovery.c: which workers exist: the static lists (--prefill-workers,
 * --decode-workers) and DNS names (--prefill-dns, --decode-dns) re-resolved
 * with uv_getaddrinfo every dns_refresh_ms. A name's new addresses join the
 * pool; an address gone from its answer is marked vanished and leaves once
 * no call of the router is active on it (pool.c). A failed lookup keeps what
 * is known. */
#include "pool-impl.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/log.h"

/* ------------------------------------------------------------- DNS -- */

static void dns_resolve(dns_entry *d);

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
    dns_entry *d = req->data;
    cs_pool *p = d->pool;
    d->in_flight = false;
    p->dns_in_flight--;
    if (p->closing || status == UV_ECANCELED) {
        uv_freeaddrinfo(res);
        cs__pool_maybe_free(p);
        return;
    }
    if (status != 0 && status != UV_EAI_NONAME && status != UV_EAI_NODATA) {
        /* a transient failure: keep what we know */
        CS_LOGW("dns %s:%s: %s; keeping the %s workers known", d->name, d->port,
                uv_strerror(status), cs__pool_role_name[d->role]);
        uv_freeaddrinfo(res);
        return;
    }
    /* the answer's addresses, deduplicated */
    char(*addrs)[80] = NULL;
    size_t n = 0, cap = 0;
    for (struct addrinfo *a = status ? NULL : res; a; a = a->ai_next) {
        char host[64] = "", one[80];
        if (a->ai_family == AF_INET)
            uv_ip4_name((const struct sockaddr_in *)a->ai_addr, host, sizeof host);
        else if (a->ai_family == AF_INET6)
            uv_ip6_name((const struct sockaddr_in6 *)a->ai_addr, host, sizeof host);
        else
            continue;
        if (a->ai_family == AF_INET6)
            snprintf(one, sizeof one, "[%s]:%s", host, d->port);
        else
            snprintf(one, sizeof one, "%s:%s", host, d->port);
        bool dup = false;
        for (size_t i = 0; i < n && !dup; i++)
            dup = !strcmp(addrs[i], one);
        if (dup) continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 8;
            void *na = realloc(addrs, nc * sizeof *addrs);
            if (!na) break;
            addrs = na;
            cap = nc;
        }
        snprintf(addrs[n++], sizeof addrs[0], "%s", one);
    }
    uv_freeaddrinfo(res);
    if (!d->resolved_once || status)
        CS_LOGI("dns %s:%s: %zu %s worker address%s%s", d->name, d->port, n,
                cs__pool_role_name[d->role], n == 1 ? "" : "es", status ? " (no such name)" : "");
    d->resolved_once = true;
    for (cs_pool_worker *w = p->workers[d->role]; w; w = w->next) {
        if (w->source != d->index || w->vanished) continue;
        bool found = false;
        for (size_t i = 0; i < n && !found; i++)
            found = !strcmp(addrs[i], w->addr);
        if (!found) {
            w->vanished = true;
            CS_LOGI("%s worker %s left DNS %s; dropped once idle", cs__pool_role_name[d->role],
                    w->addr, d->name);
        }
    }
    for (size_t i = 0; i < n; i++)
        if (cs__pool_worker_add(p, d->role, addrs[i], d->index) != 0)
            CS_LOGE("dns %s: cannot add worker %s: %s", d->name, addrs[i], cs_last_error());
    free(addrs);
}

static void dns_resolve(dns_entry *d) {
    if (d->in_flight || d->pool->closing) return;
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    d->req.data = d;
    int r = uv_getaddrinfo(d->pool->uv, &d->req, on_resolved, d->name, d->port, &hints);
    if (r) {
        CS_LOGW("dns %s:%s: cannot start a lookup: %s", d->name, d->port, uv_strerror(r));
        return;
    }
    d->in_flight = true;
    d->pool->dns_in_flight++;
}

static void on_dns_tick(uv_timer_t *t) {
    cs_pool *p = t->data;
    for (int i = 0; i < p->n_dns; i++)
        dns_resolve(&p->dns[i]);
}

/* -------------------------------------------------- static lists -- */

/* "host:port" with a port in 1..65535 and a non-empty host ("[v6]:port" too).
 * Splits into host and port when the out-parameters are given. */
static int split_addr(const char *s, const char *what, char *host, size_t host_cap, char *port,
                      size_t port_cap) {
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || !colon[1])
        return cs_fail(CS_EINVAL, "%s: '%s' is not host:port", what, s);
    char *end;
    long v = strtol(colon + 1, &end, 10);
    if (*end || v < 1 || v > 65535)
        return cs_fail(CS_EINVAL, "%s: '%s' has a bad port (1..65535)", what, s);
    size_t hl = (size_t)(colon - s);
    if (host) {
        if (hl >= host_cap) return cs_fail(CS_EINVAL, "%s: host name too long in '%s'", what, s);
        memcpy(host, s, hl);
        host[hl] = 0;
        if (host[0] == '[' && hl >= 2 && host[hl - 1] == ']') {
            memmove(host, host + 1, hl - 2);
            host[hl - 2] = 0;
        }
    }
    if (port) snprintf(port, port_cap, "%s", colon + 1);
    return 0;
}

/* Calls fn for each comma-separated, trimmed, non-empty item of list. */
static int for_each_item(const char *list, int (*fn)(cs_pool *, int, const char *), cs_pool *p,
                         int role) {
    if (!list) return 0;
    const char *s = list;
    while (*s) {
        const char *e = strchr(s, ',');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        char item[512];
        while (len && (*s == ' ' || *s == '\t'))
            s++, len--;
        while (len && (s[len - 1] == ' ' || s[len - 1] == '\t'))
            len--;
        if (len >= sizeof item)
            return cs_fail(CS_EINVAL, "worker address too long: '%.*s'", (int)len, s);
        if (len) {
            memcpy(item, s, len);
            item[len] = 0;
            int r = fn(p, role, item);
            if (r) return r;
        }
        if (!e) break;
        s = e + 1;
    }
    return 0;
}

static int add_static(cs_pool *p, int role, const char *item) {
    int r = split_addr(item, role ? "--decode-workers" : "--prefill-workers", NULL, 0, NULL, 0);
    return r ? r : cs__pool_worker_add(p, (enum cs_pool_role)role, item, -1);
}

static int add_dns(cs_pool *p, int role, const char *item) {
    char host[256], port[16];
    int r = split_addr(item, role ? "--decode-dns" : "--prefill-dns", host, sizeof host, port,
                       sizeof port);
    if (r) return r;
    dns_entry *nd = realloc(p->dns, (size_t)(p->n_dns + 1) * sizeof *nd);
    if (!nd) return cs_fail(CS_ENOMEM, "out of memory");
    p->dns = nd;
    dns_entry *d = &p->dns[p->n_dns];
    memset(d, 0, sizeof *d);
    d->pool = p;
    d->role = (enum cs_pool_role)role;
    d->index = p->n_dns;
    d->name = strdup(host);
    d->port = strdup(port);
    if (!d->name || !d->port) {
        free(d->name);
        free(d->port);
        return cs_fail(CS_ENOMEM, "out of memory");
    }
    p->n_dns++;
    return 0;
}

int cs__pool_discovery_init(cs_pool *p, const cs_pool_opts *o) {
    int r = 0;
    for (int role = 0; role < 2 && !r; role++) {
        if (!r) r = for_each_item(o->static_workers[role], add_static, p, role);
        if (!r) r = for_each_item(o->dns[role], add_dns, p, role);
    }
    return r;
}

void cs__pool_discovery_start(cs_pool *p) {
    for (int i = 0; i < p->n_dns; i++)
        dns_resolve(&p->dns[i]);
    if (p->n_dns)
        uv_timer_start(&p->dns_timer, on_dns_tick, (uint64_t)p->o.dns_refresh_ms,
                       (uint64_t)p->o.dns_refresh_ms);
}
