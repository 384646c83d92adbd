/* kvx_handshake.c: the KV link's authenticated handshake, both ends, and
 * the keys it derives (kvx_wire.h version 5; docs/security.md says what it
 * protects against). The channel code (kvx_tx_chan.c, kvx_rx_chan.c) sends and
 * receives the frames; every decision about who is admitted is here.
 *
 *   sender   -> HELLO      nonce_tx, name, layout, payload; header:
 *                          incarnation, layout fingerprint
 *   receiver    admits the HELLO (payload, model, layout), then
 *            -> CHALLENGE  nonce_rx, proof_rx = derive(PROOF_RX, transcript)
 *   sender      checks proof_rx (the receiver holds the secret), then
 *            -> AUTH       proof_tx = derive(PROOF_TX, transcript)
 *   receiver    checks proof_tx; only now does the HELLO count (fencing,
 *               the channel's name: kvx_rx_chan.c), then HELLO_ACK
 *   both        session = derive(SESSION, transcript): the TRAILER's MAC key
 *
 * The transcript binds both nonces, both incarnations, the layout
 * fingerprint, the payload and the sender's name, so no proof can be replayed on another
 * channel. With no secret configured the handshake still runs (empty key)
 * and proves nothing. */
#include "kvx-impl.h"

#include <stdio.h>
#include <string.h>

#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/secret.h"

void cs__kvx_keys_set(kvx_keys *ks, const cs_secret *s) {
    memset(ks, 0, sizeof *ks);
    ks->n = 1; /* the empty key when no secret is set */
    if (!s || !s->set) return;
    ks->n = s->n;
    for (int i = 0; i < s->n; i++) {
        memcpy(ks->k[i].key, s->k[i].key, s->k[i].len);
        ks->k[i].len = s->k[i].len;
    }
}

static void le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

void cs__kvx_derive(const kvx_key *k, enum kvx_derive what, const kvx_transcript *t,
                    uint8_t out[32]) {
    static const char *const labels[] = {"chunkserve kv v5 receiver proof",
                                         "chunkserve kv v5 sender proof",
                                         "chunkserve kv v5 session"};
    uint8_t num[25], name[CS_KVX_NAME_MAX];
    le64(num, t->tx_inc), le64(num + 8, t->rx_inc), le64(num + 16, t->fingerprint);
    num[24] = t->payload;
    memset(name, 0, sizeof name);
    memcpy(name, t->name, strnlen(t->name, sizeof name - 1));
    const void *p[] = {labels[what], t->tx_nonce, t->rx_nonce, num, name};
    size_t l[] = {strlen(labels[what]) + 1, CS_KVX_NONCE_BYTES, CS_KVX_NONCE_BYTES, sizeof num,
                  sizeof name};
    cs_hmac_sha256(k->key, k->len, 5, p, l, out);
}

void cs__kvx_trailer_mac(const uint8_t session[32], uint64_t xfer_id,
                         const uint8_t trailer[CS_KVX_TRAILER_BYTES],
                         uint8_t mac[CS_KVX_MAC_BYTES]) {
    uint8_t id[8], full[32];
    le64(id, xfer_id);
    const void *p[] = {id, trailer};
    size_t l[] = {sizeof id, CS_KVX_TRAILER_MAC_AT};
    cs_hmac_sha256(session, 32, 2, p, l, full);
    memcpy(mac, full, CS_KVX_MAC_BYTES);
}

bool cs__kvx_keys_have(const kvx_keys *ks, const kvx_key *k) {
    for (int i = 0; i < ks->n; i++)
        if (ks->k[i].len == k->len && cs_ct_equal(ks->k[i].key, k->key, k->len)) return true;
    return false;
}

/* ---------------------------------------------------------- sender -- */

void cs__kvx_hs_hello(const cs_kvx_layout *layout, int payload, const char *name,
                      uint8_t nonce[CS_KVX_NONCE_BYTES], uint8_t pl[CS_KVX_HELLO_BYTES]) {
    cs_kvx_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.layout = *layout;
    hello.payload = (uint8_t)payload;
    snprintf(hello.name, sizeof hello.name, "%s", name);
    CS_ASSERT(cs_random_bytes(nonce, CS_KVX_NONCE_BYTES) == 0);
    memcpy(hello.nonce, nonce, sizeof hello.nonce);
    cs_kvx_hello_encode(&hello, pl);
}

int cs__kvx_hs_answer(const kvx_keys *keys, const cs__kvx_hs_sender *me, const cs_kvx_hdr *h,
                      const uint8_t *pl, uint8_t proof[CS_KVX_AUTH_BYTES], uint8_t session[32],
                      kvx_key *matched, char *err, size_t cap) {
    cs_kvx_challenge m;
    if (cs_kvx_challenge_decode(pl, (size_t)h->payload_len, &m, err, cap)) return CS_EPROTO;
    kvx_transcript t;
    memset(&t, 0, sizeof t);
    memcpy(t.tx_nonce, me->nonce, sizeof t.tx_nonce);
    memcpy(t.rx_nonce, m.nonce, sizeof t.rx_nonce);
    t.tx_inc = me->incarnation;
    t.rx_inc = h->epoch;
    t.fingerprint = me->fingerprint;
    t.payload = (uint8_t)me->payload;
    snprintf(t.name, sizeof t.name, "%s", me->name);
    const kvx_key *key = NULL; /* the one the receiver proved (during a rotation: either) */
    for (int i = 0; i < keys->n; i++) {
        uint8_t want[32];
        cs__kvx_derive(&keys->k[i], KVX_PROOF_RX, &t, want);
        if (cs_ct_equal(want, m.proof, sizeof want) && !key) key = &keys->k[i];
    }
    if (!key) {
        snprintf(err, cap,
                 "receiver %s failed authentication: it does not hold this cluster's secret",
                 me->peer);
        return CS_ECONNREFUSED;
    }
    cs__kvx_derive(key, KVX_PROOF_TX, &t, proof);
    cs__kvx_derive(key, KVX_SESSION, &t, session);
    *matched = *key;
    return 0;
}

/* -------------------------------------------------------- receiver -- */

int cs__kvx_hs_admit(const cs__kvx_hs_receiver *me, const cs_kvx_hdr *h, const cs_kvx_hello *m,
                     char *err, size_t cap) {
    int payload = m->payload;
    if (payload != me->payload) {
        snprintf(err, cap,
                 "payload mismatch: sender %s sends its pages over %s; this receiver takes them "
                 "over %s only",
                 m->name, cs_kvx_payload_name(payload), cs_kvx_payload_name(me->payload));
        return CS_ECONNREFUSED;
    }
    const cs_kvx_layout *a = &m->layout, *b = me->layout;
    bool fields_agree = a->n_layers == b->n_layers && a->n_kv_heads == b->n_kv_heads &&
                        a->head_dim == b->head_dim && a->dtype == b->dtype &&
                        a->page_size == b->page_size && a->page_bytes == b->page_bytes &&
                        a->weights == b->weights;
    if (fields_agree && h->fingerprint != me->fingerprint) {
        snprintf(err, cap,
                 "model mismatch: layout fingerprint %016llx, receiver's %016llx, every field "
                 "equal (sender %s)",
                 (unsigned long long)h->fingerprint, (unsigned long long)me->fingerprint, m->name);
        return CS_ECONNREFUSED;
    }
    if (h->fingerprint != me->fingerprint || !fields_agree) {
        snprintf(err, cap,
                 "layout mismatch: sender %d layers, %d kv heads, head_dim %d, dtype %d, page %d "
                 "(%llu bytes), %s weights; receiver %d, %d, %d, %d, %d (%llu bytes), %s weights",
                 a->n_layers, a->n_kv_heads, a->head_dim, a->dtype, a->page_size,
                 (unsigned long long)a->page_bytes, a->weights ? "quant" : "fp32", b->n_layers,
                 b->n_kv_heads, b->head_dim, b->dtype, b->page_size,
                 (unsigned long long)b->page_bytes, b->weights ? "quant" : "fp32");
        return CS_ECONNREFUSED;
    }
    return 0;
}

void cs__kvx_hs_challenge(const kvx_key *key, const cs__kvx_hs_receiver *me, const cs_kvx_hdr *h,
                          const cs_kvx_hello *m, kvx_transcript *t,
                          uint8_t pl[CS_KVX_CHALLENGE_BYTES]) {
    memset(t, 0, sizeof *t);
    memcpy(t->tx_nonce, m->nonce, sizeof t->tx_nonce);
    CS_ASSERT(cs_random_bytes(t->rx_nonce, sizeof t->rx_nonce) == 0);
    t->tx_inc = h->epoch;
    t->rx_inc = me->incarnation;
    t->fingerprint = me->fingerprint;
    t->payload = m->payload; /* admitted: the receiver's own */
    snprintf(t->name, sizeof t->name, "%s", m->name);
    cs_kvx_challenge ch;
    memcpy(ch.nonce, t->rx_nonce, sizeof ch.nonce);
    cs__kvx_derive(key, KVX_PROOF_RX, t, ch.proof);
    cs_kvx_challenge_encode(&ch, pl);
}

bool cs__kvx_hs_verify(const kvx_key *key, const kvx_transcript *t, const cs_kvx_hdr *h,
                       const uint8_t *pl, uint8_t session[32]) {
    uint8_t want[32];
    cs__kvx_derive(key, KVX_PROOF_TX, t, want);
    if (h->payload_len != CS_KVX_AUTH_BYTES || h->epoch != t->tx_inc ||
        !cs_ct_equal(want, pl, sizeof want))
        return false;
    cs__kvx_derive(key, KVX_SESSION, t, session);
    return true;
}
