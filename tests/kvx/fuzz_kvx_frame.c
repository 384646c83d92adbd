/* fuzz_kvx_frame: fuzz driver for the KV transport's frame decoder (every
 * byte a receiver or sender reads from a peer goes through it). Built two
 * ways: with clang -fsanitize=fuzzer as a libFuzzer target (CS_LIBFUZZER),
 * and with the project's compiler as a deterministic random-mutation driver
 * that replays the corpus and its mutations (runs in every `make test`).
 * Each input is decoded twice: as an inline (TCP) channel's reader and as a
 * link (NCCL) channel's (cs_kvx_limits.inline_pages false: LINK_ID,
 * LINK_READY, LINK_PAGES).
 * Usage (fallback): fuzz_kvx_frame CORPUS_DIR [ITERATIONS]
 *                   fuzz_kvx_frame --write-corpus DIR (writes the seeds). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kvx_wire.h"

static const cs_kvx_layout L = {2, 2, 16, CS_KVX_DTYPE_F32, 16, 64, CS_KVX_WEIGHTS_FP32, 0x5eed};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cs_kvx_limits lim = {L.page_bytes, 4096, true};
    char err[256] = "";
    int r = cs_kvx_decode_stream(data, size, &lim, err, sizeof err);
    if (r < 0 && !err[0]) __builtin_trap(); /* every rejection names its cause */
    /* the same bytes as a link (NCCL) channel reads them */
    err[0] = 0;
    lim.inline_pages = false;
    r = cs_kvx_decode_stream(data, size, &lim, err, sizeof err);
    if (r < 0 && !err[0]) __builtin_trap();
    return 0;
}

#ifndef CS_LIBFUZZER
static size_t frame_f(uint8_t *out, int type, uint32_t flags, uint64_t xfer, uint32_t first,
                      uint32_t n, const void *pl, size_t len) {
    cs_kvx_hdr h = {0};
    h.type = (uint16_t)type, h.epoch = 7, h.xfer_id = xfer, h.first_page = first, h.n_pages = n,
    h.flags = flags;
    h.fingerprint = cs_kvx_layout_fingerprint(&L), h.payload_len = len;
    if (len) h.flags |= CS_KVX_FLAG_CHECKSUM, h.payload_xxh64 = cs_kvx_payload_sum(pl, len);
    cs_kvx_hdr_encode(&h, out);
    if (len) memcpy(out + CS_KVX_HDR_BYTES, pl, len);
    return CS_KVX_HDR_BYTES + len;
}

static size_t frame(uint8_t *out, int type, uint64_t xfer, uint32_t first, uint32_t n,
                    const void *pl, size_t len) {
    return frame_f(out, type, 0, xfer, first, n, pl, len);
}

/* An NCCL channel's frames, both directions: HELLO naming NCCL,
 * LINK_ID, HELLO_ACK, LINK_READY, two LINK_PAGES descriptors, TRAILER, DONE. */
static size_t nccl_seed(uint8_t *buf) {
    uint8_t pl[256];
    size_t n = 0;
    cs_kvx_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.layout = L;
    strcpy(hello.name, "prefill-0");
    hello.payload = CS_KVX_PAYLOAD_NCCL;
    cs_kvx_hello_encode(&hello, pl);
    n += frame_f(buf + n, CS_KVX_HELLO, 0, 0, 0, 0, pl, CS_KVX_HELLO_BYTES);
    for (int i = 0; i < CS_KVX_LINK_ID_BYTES; i++)
        pl[i] = (uint8_t)(i * 13 + 1);
    n += frame(buf + n, CS_KVX_LINK_ID, 0, 0, 0, pl, CS_KVX_LINK_ID_BYTES);
    cs_kvx_ack_encode(0, "ok", pl);
    n += frame(buf + n, CS_KVX_HELLO_ACK, 0, 0, 0, pl, CS_KVX_ACK_BYTES);
    n += frame(buf + n, CS_KVX_LINK_READY, 0, 0, 64, pl, CS_KVX_ACK_BYTES);
    for (uint32_t k = 0; k < 2; k++) {
        cs_kvx_link_desc d = {2 * L.page_bytes, 0x0123456789abcdefull + k, CS_KVX_DESC_SUM};
        cs_kvx_link_desc_encode(&d, pl);
        n += frame(buf + n, CS_KVX_LINK_PAGES, 1, 2 * k, 2, pl, CS_KVX_LINK_DESC_BYTES);
    }
    cs_kvx_trailer_wire tw = {.t = {.first_token = 5, .prompt_len = 60, .total_pages = 4},
                              .xxh64 = 42};
    cs_kvx_trailer_encode(&tw, pl);
    n += frame(buf + n, CS_KVX_TRAILER, 1, 0, 0, pl, CS_KVX_TRAILER_BYTES);
    cs_kvx_status_encode(0, pl);
    n += frame(buf + n, CS_KVX_DONE, 1, 0, 0, pl, CS_KVX_STATUS_BYTES);
    return n;
}

static int fuzz_write_corpus(const char *dir) {
    uint8_t buf[4096], pl[256];
    char path[1024];
    size_t n = 0;
    cs_kvx_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.layout = L;
    strcpy(hello.name, "prefill-0");
    cs_kvx_hello_encode(&hello, pl);
    n += frame(buf + n, CS_KVX_HELLO, 0, 0, 0, pl, CS_KVX_HELLO_BYTES);
    for (int i = 0; i < 128; i++)
        pl[i] = (uint8_t)(i * 31);
    n += frame(buf + n, CS_KVX_PAGES, 1, 0, 2, pl, 128);
    cs_kvx_trailer_wire tw = {.t = {.first_token = 5,
                                    .prompt_len = 30,
                                    .total_pages = 2,
                                    .first_logprob = -0.25f,
                                    .n_top = 2,
                                    .top_ids = {5, 9},
                                    .top_logprobs = {-0.25f, -2.5f}},
                              .xxh64 = 99};
    uint8_t tb[CS_KVX_TRAILER_BYTES];
    cs_kvx_trailer_encode(&tw, tb);
    n += frame(buf + n, CS_KVX_TRAILER, 1, 0, 0, tb, sizeof tb);
    n += frame(buf + n, CS_KVX_PING, 0, 0, 0, NULL, 0);
    uint8_t sb[CS_KVX_STATUS_BYTES];
    cs_kvx_status_encode(-125, sb);
    n += frame(buf + n, CS_KVX_ABORT, 2, 0, 0, sb, sizeof sb);
    uint8_t ab[CS_KVX_ACK_BYTES];
    cs_kvx_ack_encode(0, "ok", ab);
    n += frame(buf + n, CS_KVX_HELLO_ACK, 0, 0, 0, ab, sizeof ab);
    cs_kvx_challenge chal; /* the handshake's frames (version 4 on) */
    for (int i = 0; i < CS_KVX_NONCE_BYTES; i++)
        chal.nonce[i] = (uint8_t)(i * 13);
    for (int i = 0; i < CS_KVX_PROOF_BYTES; i++)
        chal.proof[i] = (uint8_t)(i * 7 + 1);
    uint8_t cb[CS_KVX_CHALLENGE_BYTES];
    cs_kvx_challenge_encode(&chal, cb);
    n += frame(buf + n, CS_KVX_CHALLENGE, 0, 0, 0, cb, sizeof cb);
    n += frame(buf + n, CS_KVX_AUTH, 0, 0, 0, chal.proof, CS_KVX_AUTH_BYTES);
    snprintf(path, sizeof path, "%s/stream", dir);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fwrite(buf, 1, n, f);
    fclose(f);
    snprintf(path, sizeof path, "%s/pages", dir);
    f = fopen(path, "wb");
    fwrite(buf + CS_KVX_HDR_BYTES + CS_KVX_HELLO_BYTES, 1, CS_KVX_HDR_BYTES + 128, f);
    fclose(f);
    n = nccl_seed(buf);
    snprintf(path, sizeof path, "%s/nccl", dir);
    f = fopen(path, "wb");
    if (!f) return 1;
    fwrite(buf, 1, n, f);
    fclose(f);
    return 0;
}

#endif

#include "../fuzz/fuzz_main.h"
