/* bench_http.c: a small HTTP/1.1 client for bench serve (see bench_http.h). */
#include "bench_http.h"

#include <http_parser.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "chunkserve/error.h"

typedef struct {
    uv_tcp_t tcp;
    uv_connect_t conn;
    uv_write_t wr;
    uv_timer_t timer;
    int open_handles;
    http_parser parser;
    http_parser_settings settings;
    char *req; /* the request bytes */
    size_t req_len;
    char *body; /* the non-SSE body, or the SSE bytes not yet cut into events */
    size_t body_len, body_cap;
    int status;
    int sse; /* -1 unknown until the headers end */
    char hdr_field[32];
    int hdr_is_ctype;
    int done;
    cs_http_client_cbs cbs;
    void *user;
} hreq;

static void on_closed(uv_handle_t *h) {
    hreq *r = h->data;
    if (--r->open_handles == 0) {
        free(r->req);
        free(r->body);
        free(r);
    }
}

static void finish(hreq *r, int status, const char *msg) {
    if (r->done) return;
    r->done = 1;
    r->cbs.on_done(r->user, status, msg);
    uv_timer_stop(&r->timer);
    uv_close((uv_handle_t *)&r->timer, on_closed);
    if (!uv_is_closing((uv_handle_t *)&r->tcp)) uv_close((uv_handle_t *)&r->tcp, on_closed);
}

static int append(hreq *r, const char *p, size_t n) {
    if (r->body_len + n + 1 > r->body_cap) {
        size_t cap = r->body_cap ? r->body_cap : 4096;
        while (cap < r->body_len + n + 1)
            cap *= 2;
        char *b = realloc(r->body, cap);
        if (!b) return -1;
        r->body = b, r->body_cap = cap;
    }
    memcpy(r->body + r->body_len, p, n);
    r->body_len += n;
    r->body[r->body_len] = 0;
    return 0;
}

/* Hands over every complete event ("...\n\n") at the front of the buffer. */
static void cut_events(hreq *r) {
    size_t start = 0;
    for (;;) {
        char *end = strstr(r->body + start, "\n\n");
        if (!end) break;
        size_t ev_end = (size_t)(end - r->body);
        for (size_t l = start; l < ev_end;) { /* each "data: " line of the event */
            char *nl = memchr(r->body + l, '\n', ev_end - l);
            size_t le = nl ? (size_t)(nl - r->body) : ev_end;
            if (le - l >= 6 && !memcmp(r->body + l, "data: ", 6)) {
                const char *d = r->body + l + 6;
                size_t dn = le - l - 6;
                if (!(dn == 6 && !memcmp(d, "[DONE]", 6)) && !r->done)
                    r->cbs.on_data(r->user, d, dn);
            }
            l = le + 1;
        }
        start = ev_end + 2;
    }
    memmove(r->body, r->body + start, r->body_len - start + 1);
    r->body_len -= start;
}

static int on_header_field(http_parser *p, const char *at, size_t n) {
    hreq *r = p->data;
    snprintf(r->hdr_field, sizeof r->hdr_field, "%.*s", (int)n, at);
    r->hdr_is_ctype = !strcasecmp(r->hdr_field, "content-type");
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t n) {
    hreq *r = p->data;
    if (r->hdr_is_ctype) r->sse = n >= 17 && !strncasecmp(at, "text/event-stream", 17);
    return 0;
}

static int on_headers_complete(http_parser *p) {
    hreq *r = p->data;
    r->status = (int)p->status_code;
    if (r->sse < 0) r->sse = 0;
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t n) {
    hreq *r = p->data;
    if (append(r, at, n)) return -1;
    if (r->sse && r->status / 100 == 2) cut_events(r);
    return 0;
}

static int on_message_complete(http_parser *p) {
    hreq *r = p->data;
    if (r->status / 100 == 2) {
        if (!r->sse && r->body_len) r->cbs.on_data(r->user, r->body, r->body_len);
        finish(r, r->status, "");
    } else {
        finish(r, r->status, r->body ? r->body : "");
    }
    return 0;
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
    (void)h, (void)hint;
    static char slab[65536]; /* one loop thread: a read is parsed before the next */
    *buf = uv_buf_init(slab, sizeof slab);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    hreq *r = s->data;
    if (n < 0) {
        if (n == UV_EOF) http_parser_execute(&r->parser, &r->settings, NULL, 0);
        finish(r, 0,
               n == UV_EOF ? "the connection closed before the answer ended" : uv_strerror((int)n));
        return;
    }
    size_t k = http_parser_execute(&r->parser, &r->settings, buf->base, (size_t)n);
    if (k != (size_t)n && !r->done) {
        char msg[160];
        snprintf(msg, sizeof msg, "malformed HTTP answer: %s",
                 http_errno_description(HTTP_PARSER_ERRNO(&r->parser)));
        finish(r, 0, msg);
    }
}

static void on_written(uv_write_t *w, int status) {
    hreq *r = w->data;
    if (status < 0) finish(r, 0, uv_strerror(status));
}

static void on_connect(uv_connect_t *c, int status) {
    hreq *r = c->data;
    if (status < 0) {
        char msg[160];
        snprintf(msg, sizeof msg, "connect: %s", uv_strerror(status));
        finish(r, 0, msg);
        return;
    }
    uv_buf_t b = uv_buf_init(r->req, (unsigned)r->req_len);
    r->wr.data = r;
    int e = uv_write(&r->wr, (uv_stream_t *)&r->tcp, &b, 1, on_written);
    if (!e) e = uv_read_start((uv_stream_t *)&r->tcp, on_alloc, on_read);
    if (e) finish(r, 0, uv_strerror(e));
}

static void on_deadline(uv_timer_t *t) {
    finish(t->data, 0, "deadline exceeded");
}

int cs_http_client_request(struct uv_loop_s *uv, const struct sockaddr *addr, const char *host,
                           const char *method, const char *path, const char *headers,
                           const char *body, size_t body_len, double timeout_s,
                           const cs_http_client_cbs *cbs, void *user) {
    hreq *r = calloc(1, sizeof *r);
    if (!r) return cs_fail(CS_ENOMEM, "http: out of memory");
    size_t cap = strlen(method) + strlen(path) + strlen(host) + (headers ? strlen(headers) : 0) +
                 body_len + 200;
    if (!(r->req = malloc(cap))) {
        free(r);
        return cs_fail(CS_ENOMEM, "http: out of memory");
    }
    int n = snprintf(r->req, cap,
                     "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nContent-Length: %zu\r\n%s"
                     "%s\r\n",
                     method, path, host, body_len, body ? "Content-Type: application/json\r\n" : "",
                     headers ? headers : "");
    if (body_len) memcpy(r->req + n, body, body_len);
    r->req_len = (size_t)n + body_len;
    r->cbs = *cbs, r->user = user, r->sse = -1;
    http_parser_init(&r->parser, HTTP_RESPONSE);
    r->parser.data = r;
    http_parser_settings_init(&r->settings);
    r->settings.on_header_field = on_header_field;
    r->settings.on_header_value = on_header_value;
    r->settings.on_headers_complete = on_headers_complete;
    r->settings.on_body = on_body;
    r->settings.on_message_complete = on_message_complete;
    uv_tcp_init(uv, &r->tcp);
    uv_timer_init(uv, &r->timer);
    r->tcp.data = r->timer.data = r->conn.data = r;
    r->open_handles = 2;
    int e = uv_tcp_connect(&r->conn, &r->tcp, addr, on_connect);
    if (!e) e = uv_timer_start(&r->timer, on_deadline, (uint64_t)(timeout_s * 1e3) + 1, 0);
    if (e) { /* no callback: close quietly */
        r->done = 1;
        uv_close((uv_handle_t *)&r->timer, on_closed);
        uv_close((uv_handle_t *)&r->tcp, on_closed);
        return cs_fail(CS_EIO, "http: %s", uv_strerror(e));
    }
    return 0;
}

int cs_http_client_resolve(const char *url, char *host, size_t cap, struct sockaddr *addr,
                           size_t addr_cap) {
    if (strncmp(url, "http://", 7))
        return cs_fail(CS_EINVAL, "--target '%s': http://HOST:PORT for the OpenAI API", url);
    const char *h = url + 7, *colon = strrchr(h, ':');
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : 0;
    if (!colon || colon == h || port < 1 || port > 65535 || (*end && strcmp(end, "/")) ||
        (size_t)(colon - h) >= cap)
        return cs_fail(CS_EINVAL, "--target '%s': http://HOST:PORT for the OpenAI API", url);
    snprintf(host, cap, "%.*s", (int)(colon - h), h);
    char name[256], serv[16];
    snprintf(name, sizeof name, "%s", host);
    size_t nl = strlen(name);
    if (nl >= 2 && name[0] == '[' && name[nl - 1] == ']')
        memmove(name, name + 1, nl - 2), name[nl - 2] = 0;
    snprintf(serv, sizeof serv, "%ld", port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    int e = getaddrinfo(name, serv, &hints, &res);
    if (e || !res || res->ai_addrlen > addr_cap) {
        if (res) freeaddrinfo(res);
        return cs_fail(CS_EINVAL, "--target '%s': cannot resolve %s: %s", url, name,
                       e ? gai_strerror(e) : "no address");
    }
    memcpy(addr, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    snprintf(host, cap, "%.*s", (int)(strlen(h) - (*end ? 1 : 0)), h); /* Host: HOST:PORT */
    return 0;
}
