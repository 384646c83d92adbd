/* kvx_wire.c: encoding and validation of KV transport frames (see
 * kvx_wire.h). Pure functions over byte buffers: this is the code that reads
 * outside bytes, and the part the fuzzer drives. */
#include "kvx_wire.h"

#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "chunkserve/error.h"

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
_Static_assert(CS_KVX_CTRL_MAX_BYTES >= CS_KVX_ACK_BYTES &&
                   CS_KVX_CTRL_MAX_BYTES >= CS_KVX_LINK_ID_BYTES &&
                   CS_KVX_CTRL_MAX_BYTES >= CS_KVX_HELLO_BYTES,
               "every control payload fits CS_KVX_CTRL_MAX_BYTES");

static uint32_t f32_bits(float f) {
    uint32_t v;
    memcpy(&v, &f, sizeof v);
    return v;
}
static float bits_f32(uint32_t v) {
    float f;
    memcpy(&f, &v, sizeof f);
    return f;
}

#define FAIL(code, ...)                                                                            \
    do {                                                                                           \
        if (err && errlen) snprintf(err, errlen, __VA_ARGS__);                                     \
        return (code);                                                                             \
    } while (0)

const char *cs_kvx_frame_type_name(int type) {
    static const char *const names[] = {
        "?",    "HELLO",   "HELLO_ACK",  "PAGES",      "TRAILER",   "ABORT", "DONE",
        "PING", "LINK_ID", "LINK_READY", "LINK_PAGES", "CHALLENGE", "AUTH"};
    return type >= 1 && type <= CS_KVX_LAST_TYPE ? names[type] : "unknown";
}

static void layout_encode(const cs_kvx_layout *l, uint8_t out[32]) {
    memset(out, 0, 32);
    put32(out + 0, (uint32_t)l->n_layers);
    put32(out + 4, (uint32_t)l->n_kv_heads);
    put32(out + 8, (uint32_t)l->head_dim);
    put32(out + 12, (uint32_t)l->dtype);
    put32(out + 16, (uint32_t)l->page_size);
    put32(out + 20, (uint32_t)l->weights);
    put64(out + 24, l->page_bytes);
}

static void layout_decode(const uint8_t in[32], cs_kvx_layout *l) {
    l->n_layers = (int32_t)get32(in + 0);
    l->n_kv_heads = (int32_t)get32(in + 4);
    l->head_dim = (int32_t)get32(in + 8);
    l->dtype = (int32_t)get32(in + 12);
    l->page_size = (int32_t)get32(in + 16);
    l->weights = (int32_t)get32(in + 20);
    l->page_bytes = get64(in + 24);
}

uint64_t cs_kvx_layout_fingerprint(const cs_kvx_layout *l) {
    uint8_t b[40];
    layout_encode(l, b);
    put64(b + 32, l->model);
    return XXH64(b, sizeof b, CS_KVX_MAGIC);
}

void cs_kvx_hdr_encode(const cs_kvx_hdr *h, uint8_t out[CS_KVX_HDR_BYTES]) {
    memset(out, 0, CS_KVX_HDR_BYTES);
    put32(out + 0, CS_KVX_MAGIC);
    put16(out + 4, h->version ? h->version : CS_KVX_VERSION);
    put16(out + 6, h->type);
    put32(out + 8, h->flags);
    put64(out + 16, h->epoch);
    put64(out + 24, h->xfer_id);
    put32(out + 32, h->first_page);
    put32(out + 36, h->n_pages);
    put64(out + 40, h->fingerprint);
    put64(out + 48, h->payload_len);
    put64(out + 56, h->payload_xxh64);
    put32(out + 12, XXH32(out, CS_KVX_HDR_BYTES, 0));
}

uint64_t cs_kvx_payload_sum(const void *payload, size_t len) {
    return XXH3_64bits(payload, len);
}

int cs_kvx_hdr_decode(const uint8_t in[CS_KVX_HDR_BYTES], const cs_kvx_limits *lim, cs_kvx_hdr *h,
                      char *err, size_t errlen) {
    bool linked = !lim->inline_pages;
    uint32_t magic = get32(in);
    if (magic != CS_KVX_MAGIC) FAIL(CS_EBADMSG, "kvx: bad frame magic %08x", magic);
    uint8_t tmp[CS_KVX_HDR_BYTES];
    memcpy(tmp, in, sizeof tmp);
    memset(tmp + 12, 0, 4);
    uint32_t sum = XXH32(tmp, sizeof tmp, 0);
    if (sum != get32(in + 12)) FAIL(CS_EBADMSG, "kvx: frame header checksum mismatch");
    h->version = get16(in + 4);
    h->type = get16(in + 6);
    h->flags = get32(in + 8);
    h->epoch = get64(in + 16);
    h->xfer_id = get64(in + 24);
    h->first_page = get32(in + 32);
    h->n_pages = get32(in + 36);
    h->fingerprint = get64(in + 40);
    h->payload_len = get64(in + 48);
    h->payload_xxh64 = get64(in + 56);
    if (h->version != CS_KVX_VERSION)
        FAIL(CS_EPROTO, "kvx: unsupported frame version %u", h->version);
    if (h->flags & ~CS_KVX_FLAG_CHECKSUM)
        FAIL(CS_EBADMSG, "kvx: unknown frame flags %#x", h->flags);
    uint64_t want;
    if (h->type > CS_KVX_TYPE_MAX && h->type <= CS_KVX_LINK_TYPE_MAX && !linked)
        FAIL(CS_EPROTO, "kvx: %s frame on an inline channel (the page bytes follow PAGES frames)",
             cs_kvx_frame_type_name(h->type));
    int type = h->type;
    switch (type) {
    case CS_KVX_HELLO: want = CS_KVX_HELLO_BYTES; break;
    case CS_KVX_CHALLENGE: want = CS_KVX_CHALLENGE_BYTES; break;
    case CS_KVX_AUTH: want = CS_KVX_AUTH_BYTES; break;
    case CS_KVX_HELLO_ACK: want = CS_KVX_ACK_BYTES; break;
    case CS_KVX_TRAILER: want = CS_KVX_TRAILER_BYTES; break;
    case CS_KVX_ABORT:
    case CS_KVX_DONE: want = CS_KVX_STATUS_BYTES; break;
    case CS_KVX_PING: want = 0; break;
    case CS_KVX_LINK_ID: want = CS_KVX_LINK_ID_BYTES; break;
    case CS_KVX_LINK_READY: want = CS_KVX_ACK_BYTES; break;
    case CS_KVX_LINK_PAGES:
        if (h->n_pages == 0) FAIL(CS_EBADMSG, "kvx: LINK_PAGES frame with 0 pages");
        if (lim->page_bytes == 0 || h->n_pages > lim->max_payload / lim->page_bytes)
            FAIL(CS_EBADMSG, "kvx: LINK_PAGES chunk of %u pages exceeds the %llu-byte chunk limit",
                 h->n_pages, (unsigned long long)lim->max_payload);
        want = CS_KVX_LINK_DESC_BYTES;
        break;
    case CS_KVX_PAGES:
        if (linked)
            FAIL(CS_EPROTO,
                 "kvx: PAGES frame on a link channel (the page bytes travel over its link)");
        if (h->n_pages == 0) FAIL(CS_EBADMSG, "kvx: PAGES frame with 0 pages");
        if (lim->page_bytes == 0 || h->n_pages > lim->max_payload / lim->page_bytes)
            FAIL(CS_EBADMSG, "kvx: PAGES frame of %u pages exceeds the %llu-byte frame limit",
                 h->n_pages, (unsigned long long)lim->max_payload);
        want = (uint64_t)h->n_pages * lim->page_bytes;
        break;
    default: FAIL(CS_EPROTO, "kvx: unknown frame type %u", h->type);
    }
    if (h->payload_len != want)
        FAIL(CS_EBADMSG, "kvx: %s frame payload length %llu, expected %llu",
             cs_kvx_frame_type_name(h->type), (unsigned long long)h->payload_len,
             (unsigned long long)want);
    return 0;
}

int cs_kvx_payload_check(const cs_kvx_hdr *h, const void *payload, bool require_checksum, char *err,
                         size_t errlen) {
    if (!(h->flags & CS_KVX_FLAG_CHECKSUM)) {
        if (require_checksum && h->payload_len)
            FAIL(CS_EBADMSG, "kvx: %s frame without the required checksum",
                 cs_kvx_frame_type_name(h->type));
        return 0;
    }
    uint64_t sum = cs_kvx_payload_sum(payload, (size_t)h->payload_len);
    if (sum != h->payload_xxh64)
        FAIL(CS_EBADMSG, "kvx: %s frame payload checksum mismatch (transfer %llu, pages %u+%u)",
             cs_kvx_frame_type_name(h->type), (unsigned long long)h->xfer_id, h->first_page,
             h->n_pages);
    return 0;
}

void cs_kvx_hello_encode(const cs_kvx_hello *m, uint8_t out[CS_KVX_HELLO_BYTES]) {
    memset(out, 0, CS_KVX_HELLO_BYTES);
    layout_encode(&m->layout, out);
    size_t n = strnlen(m->name, CS_KVX_NAME_MAX - 1);
    memcpy(out + 32, m->name, n);
    memcpy(out + 32 + CS_KVX_NAME_MAX, m->nonce, CS_KVX_NONCE_BYTES);
    out[32 + CS_KVX_NAME_MAX + CS_KVX_NONCE_BYTES] = m->payload;
}

void cs_kvx_challenge_encode(const cs_kvx_challenge *m, uint8_t out[CS_KVX_CHALLENGE_BYTES]) {
    memcpy(out, m->nonce, CS_KVX_NONCE_BYTES);
    memcpy(out + CS_KVX_NONCE_BYTES, m->proof, CS_KVX_PROOF_BYTES);
}

int cs_kvx_challenge_decode(const uint8_t *in, size_t len, cs_kvx_challenge *m, char *err,
                            size_t errlen) {
    if (len != CS_KVX_CHALLENGE_BYTES) FAIL(CS_EBADMSG, "kvx: CHALLENGE payload of %zu bytes", len);
    memcpy(m->nonce, in, CS_KVX_NONCE_BYTES);
    memcpy(m->proof, in + CS_KVX_NONCE_BYTES, CS_KVX_PROOF_BYTES);
    return 0;
}

int cs_kvx_hello_decode(const uint8_t *in, size_t len, cs_kvx_hello *m, char *err, size_t errlen) {
    if (len != CS_KVX_HELLO_BYTES) FAIL(CS_EBADMSG, "kvx: HELLO payload of %zu bytes", len);
    layout_decode(in, &m->layout);
    memcpy(m->name, in + 32, CS_KVX_NAME_MAX);
    if (m->name[CS_KVX_NAME_MAX - 1] != 0) FAIL(CS_EBADMSG, "kvx: HELLO name not terminated");
    if (m->name[0] == 0) FAIL(CS_EBADMSG, "kvx: HELLO with an empty name");
    for (const char *c = m->name; *c; c++)
        if (*c < 0x21 || *c > 0x7e) FAIL(CS_EBADMSG, "kvx: HELLO name with a non-printable byte");
    memcpy(m->nonce, in + 32 + CS_KVX_NAME_MAX, CS_KVX_NONCE_BYTES);
    const uint8_t *p = in + 32 + CS_KVX_NAME_MAX + CS_KVX_NONCE_BYTES;
    m->payload = p[0];
    for (int i = 1; i < 8; i++)
        if (p[i]) FAIL(CS_EBADMSG, "kvx: HELLO with nonzero reserved bytes");
    return 0;
}

void cs_kvx_ack_encode(int32_t status, const char *msg, uint8_t out[CS_KVX_ACK_BYTES]) {
    memset(out, 0, CS_KVX_ACK_BYTES);
    put32(out, (uint32_t)status);
    if (msg) memcpy(out + 8, msg, strnlen(msg, CS_KVX_ACK_BYTES - 9));
}

int cs_kvx_ack_decode(const uint8_t *in, size_t len, int32_t *status, char *msg, size_t msglen) {
    if (len != CS_KVX_ACK_BYTES) return CS_EBADMSG;
    *status = (int32_t)get32(in);
    if (msg && msglen) {
        size_t n = strnlen((const char *)in + 8, CS_KVX_ACK_BYTES - 8);
        if (n >= msglen) n = msglen - 1;
        memcpy(msg, in + 8, n);
        msg[n] = 0;
    }
    return *status > 0 ? CS_EBADMSG : 0;
}

void cs_kvx_trailer_encode(const cs_kvx_trailer_wire *t, uint8_t out[CS_KVX_TRAILER_BYTES]) {
    memset(out, 0, CS_KVX_TRAILER_BYTES);
    put32(out + 0, (uint32_t)t->t.first_token);
    put32(out + 4, (uint32_t)t->t.prompt_len);
    put32(out + 8, (uint32_t)t->t.total_pages);
    put32(out + 12, (uint32_t)t->t.n_top);
    put64(out + 16, t->xxh64);
    put32(out + 24, f32_bits(t->t.first_logprob));
    put32(out + 28, (uint32_t)t->t.n_cached);
    for (int32_t i = 0; i < t->t.n_top && i < CS_KVX_MAX_TOP; i++) {
        put32(out + 32 + 8 * i, (uint32_t)t->t.top_ids[i]);
        put32(out + 36 + 8 * i, f32_bits(t->t.top_logprobs[i]));
    }
    memcpy(out + CS_KVX_TRAILER_MAC_AT, t->mac, CS_KVX_MAC_BYTES);
}

int cs_kvx_trailer_decode(const uint8_t *in, size_t len, cs_kvx_trailer_wire *t, char *err,
                          size_t errlen) {
    if (len != CS_KVX_TRAILER_BYTES) FAIL(CS_EBADMSG, "kvx: TRAILER payload of %zu bytes", len);
    t->t.first_token = (int32_t)get32(in + 0);
    t->t.prompt_len = (int32_t)get32(in + 4);
    t->t.total_pages = (int32_t)get32(in + 8);
    t->t.n_top = (int32_t)get32(in + 12);
    t->xxh64 = get64(in + 16);
    t->t.first_logprob = bits_f32(get32(in + 24));
    t->t.n_cached = (int32_t)get32(in + 28);
    memcpy(t->mac, in + CS_KVX_TRAILER_MAC_AT, CS_KVX_MAC_BYTES);
    if (t->t.first_token < 0 || t->t.prompt_len < 0 || t->t.total_pages < 0)
        FAIL(CS_EBADMSG, "kvx: TRAILER with negative fields");
    if (t->t.n_cached < 0 || t->t.n_cached > t->t.prompt_len)
        FAIL(CS_EBADMSG, "kvx: TRAILER with %d cached of %d tokens", t->t.n_cached,
             t->t.prompt_len);
    if (t->t.n_top < 0 || t->t.n_top > CS_KVX_MAX_TOP)
        FAIL(CS_EBADMSG, "kvx: TRAILER with %d alternatives (at most %d)", t->t.n_top,
             CS_KVX_MAX_TOP);
    if (!(t->t.first_logprob <= 0)) FAIL(CS_EBADMSG, "kvx: TRAILER with a logprob above 0");
    for (int32_t i = 0; i < t->t.n_top; i++) {
        t->t.top_ids[i] = (int32_t)get32(in + 32 + 8 * i);
        t->t.top_logprobs[i] = bits_f32(get32(in + 36 + 8 * i));
        if (t->t.top_ids[i] < 0 || !(t->t.top_logprobs[i] <= 0))
            FAIL(CS_EBADMSG, "kvx: TRAILER alternative %d is not a token and a logprob <= 0", i);
    }
    return 0;
}

void cs_kvx_status_encode(int32_t status, uint8_t out[CS_KVX_STATUS_BYTES]) {
    memset(out, 0, CS_KVX_STATUS_BYTES);
    put32(out, (uint32_t)status);
}

int cs_kvx_status_decode(const uint8_t *in, size_t len, int32_t *status, char *err, size_t errlen) {
    if (len != CS_KVX_STATUS_BYTES) FAIL(CS_EBADMSG, "kvx: status payload of %zu bytes", len);
    *status = (int32_t)get32(in);
    if (*status > 0 || *status < -4095) FAIL(CS_EBADMSG, "kvx: status %d out of range", *status);
    return 0;
}

void cs_kvx_link_desc_encode(const cs_kvx_link_desc *d, uint8_t out[CS_KVX_LINK_DESC_BYTES]) {
    memset(out, 0, CS_KVX_LINK_DESC_BYTES);
    put64(out + 0, d->bytes);
    put64(out + 8, d->sum);
    put32(out + 16, d->flags);
}

int cs_kvx_link_desc_decode(const uint8_t *in, size_t len, const cs_kvx_hdr *h, uint64_t page_bytes,
                            cs_kvx_link_desc *d, char *err, size_t errlen) {
    if (len != CS_KVX_LINK_DESC_BYTES)
        FAIL(CS_EBADMSG, "kvx: LINK_PAGES payload of %zu bytes", len);
    d->bytes = get64(in + 0);
    d->sum = get64(in + 8);
    d->flags = get32(in + 16);
    if (d->flags & ~CS_KVX_DESC_SUM)
        FAIL(CS_EBADMSG, "kvx: LINK_PAGES with unknown flags %#x", d->flags);
    if (get32(in + 20) != 0) FAIL(CS_EBADMSG, "kvx: LINK_PAGES with non-zero padding");
    if (d->bytes != (uint64_t)h->n_pages * page_bytes)
        FAIL(CS_EBADMSG, "kvx: LINK_PAGES of %u pages announces %llu bytes, expected %llu",
             h->n_pages, (unsigned long long)d->bytes,
             (unsigned long long)((uint64_t)h->n_pages * page_bytes));
    return 0;
}

int cs_kvx_decode_stream(const uint8_t *buf, size_t len, const cs_kvx_limits *lim, char *err,
                         size_t errlen) {
    int n = 0;
    size_t off = 0;
    while (off < len) {
        if (len - off < CS_KVX_HDR_BYTES)
            FAIL(CS_EBADMSG, "kvx: truncated frame header (%zu bytes)", len - off);
        cs_kvx_hdr h;
        int r = cs_kvx_hdr_decode(buf + off, lim, &h, err, errlen);
        if (r) return r;
        off += CS_KVX_HDR_BYTES;
        if (h.payload_len > len - off)
            FAIL(CS_EBADMSG, "kvx: truncated %s frame payload (%zu of %llu bytes)",
                 cs_kvx_frame_type_name(h.type), len - off, (unsigned long long)h.payload_len);
        const uint8_t *p = buf + off;
        size_t pl = (size_t)h.payload_len;
        r = cs_kvx_payload_check(&h, p, false, err, errlen);
        if (r) return r;
        int32_t st;
        char msg[128];
        cs_kvx_hello hello;
        cs_kvx_trailer_wire tw;
        cs_kvx_link_desc desc;
        cs_kvx_challenge ch;
        switch (h.type) {
        case CS_KVX_HELLO: r = cs_kvx_hello_decode(p, pl, &hello, err, errlen); break;
        case CS_KVX_CHALLENGE: r = cs_kvx_challenge_decode(p, pl, &ch, err, errlen); break;
        case CS_KVX_HELLO_ACK:
        case CS_KVX_LINK_READY:
            r = cs_kvx_ack_decode(p, pl, &st, msg, sizeof msg);
            if (r) FAIL(r, "kvx: %s with a positive status %d", cs_kvx_frame_type_name(h.type), st);
            break;
        case CS_KVX_LINK_PAGES:
            r = cs_kvx_link_desc_decode(p, pl, &h, lim->page_bytes, &desc, err, errlen);
            break;
        case CS_KVX_TRAILER: r = cs_kvx_trailer_decode(p, pl, &tw, err, errlen); break;
        case CS_KVX_ABORT:
        case CS_KVX_DONE: r = cs_kvx_status_decode(p, pl, &st, err, errlen); break;
        default: break;
        }
        if (r) return r;
        off += pl;
        n++;
    }
    return n;
}
