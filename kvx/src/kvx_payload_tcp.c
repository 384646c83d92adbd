/* kvx_payload_tcp.c: the TCP payload of the KV transport (kvx-impl.h): page
 * bytes travel inline, right behind their PAGES header on the channel's TCP
 * connection. The control plane writes them with writev straight from the
 * host pool and the receiver reads them straight into the reserved pages, so
 * this link only stages each chunk's checksum: XXH3-64 of its pages in
 * order, computed on the sender's I/O thread when the chunk gets a slot,
 * just before its frame goes out (the pages are then warm in the cache for
 * the socket copy). No handshake, nothing asynchronous. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL /* XXH3 compiled here, with this build's vector unit */
#include <xxhash.h>

#include "kvx-impl.h"
#include "chunkserve/error.h"

struct cs__kvx_link {
    cs__kvx_link_cfg cfg;
    uint64_t *sums; /* (n_slots) */
    bool *summed;   /* (n_slots) */
};

static int t_open(const cs__kvx_link_cfg *cfg, const uint8_t *id, cs__kvx_link **out, char *err,
                  size_t errlen) {
    (void)id;
    cs__kvx_link *l = calloc(1, sizeof *l);
    if (l) {
        l->sums = calloc((size_t)cfg->n_slots, sizeof *l->sums);
        l->summed = calloc((size_t)cfg->n_slots, sizeof *l->summed);
    }
    if (!l || !l->sums || !l->summed) {
        if (l) free(l->sums), free(l->summed);
        free(l);
        snprintf(err, errlen, "out of memory");
        return CS_ENOMEM;
    }
    l->cfg = *cfg;
    *out = l;
    return 0;
}

static int t_state(cs__kvx_link *l, char *err, size_t errlen) {
    (void)l, (void)err, (void)errlen;
    return 0;
}

static int t_pack(cs__kvx_link *l, int slot, const int32_t *ids, int32_t n, bool sum, char *err,
                  size_t errlen) {
    (void)err, (void)errlen;
    l->summed[slot] = sum;
    if (!sum) return 0;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    const uint8_t *base = l->cfg.pool.base;
    for (int32_t i = 0; i < n; i++)
        XXH3_64bits_update(&st, base + (size_t)ids[i] * l->cfg.page_bytes, l->cfg.page_bytes);
    l->sums[slot] = XXH3_64bits_digest(&st);
    return 0;
}

static int t_send(cs__kvx_link *l, int slot, size_t bytes, char *err, size_t errlen) {
    (void)bytes, (void)err, (void)errlen;
    l->summed[slot] = false; /* the bytes went with the frame */
    return 0;
}

static int t_query(cs__kvx_link *l, int slot, uint64_t *sum, char *err, size_t errlen) {
    (void)err, (void)errlen;
    if (l->summed[slot] && sum) *sum = l->sums[slot];
    return 0;
}

static bool t_close(cs__kvx_link *l) {
    free(l->sums);
    free(l->summed);
    free(l);
    return true;
}

const cs__kvx_payload cs__kvx_payload_tcp = {
    .name = "tcp",
    .kind = CS_KVX_PAYLOAD_TCP,
    .pool_kind = CS_KVX_POOL_HOST,
    .inline_pages = true,
    .unique_id = NULL,
    .open = t_open,
    .state = t_state,
    .pack = t_pack,
    .send = t_send,
    .recv = NULL,
    .query = t_query,
    .close = t_close,
};
