/* http-impl.h: what http.c shares with ops_http.c and the tests only: the
 * defaults, and hooks that are not public API. */
#ifndef CS_HTTP_INTERNAL_H
#define CS_HTTP_INTERNAL_H

#include <stdint.h>

#include "chunkserve/http.h"
#include "chunkserve/rpc.h"

/* Default bytes of headers, and of a whole request when max_body_bytes is 0. */
#define CS_HTTP_MAX_REQUEST (16 * 1024)
#define CS_HTTP_IDLE_MS 30000    /* default idle timeout */
#define CS_HTTP_REQUEST_MS 30000 /* default deadline of one request's arrival */

/* ---- TLS under the server (http_tls.c): OpenSSL with memory BIOs ---- */

typedef struct cs__http_tls cs__http_tls; /* a server's context and its files */
typedef struct ssl_st SSL;
/* From files (cert_file unset: *out NULL, plaintext): the context now, a
 * clear error naming a bad file. */
int cs__http_tls_init(const cs_rpc_tls *files, cs__http_tls **out);
void cs__http_tls_free(cs__http_tls *t);
/* A new connection's TLS state (the context rebuilt first when its files
 * changed, at most every reload_s); NULL when out of memory. */
SSL *cs__http_tls_accept(cs__http_tls *t);
void cs__http_tls_conn_free(SSL *ssl); /* NULL: nothing */
/* Ciphertext from the socket in (0 or CS_ENOMEM); how much waits unread. */
int cs__http_tls_feed(SSL *ssl, const void *data, size_t len);
size_t cs__http_tls_buffered_in(SSL *ssl);
/* Plaintext out: bytes (> 0), 0 (more ciphertext needed), CS_ECONNRESET
 * (the peer's close_notify) or CS_EPROTO (a failed handshake or a bad
 * record; logged at debug with peer). */
int cs__http_tls_read(SSL *ssl, char *buf, size_t cap, const char *peer);
/* Plaintext in, all of it (0 or CS_EPROTO); then cs__http_tls_take. */
int cs__http_tls_write(SSL *ssl, const void *data, size_t len);
/* Queues our close_notify. */
void cs__http_tls_close_notify(SSL *ssl);
/* Ciphertext for the socket: with buf NULL, how many bytes wait; else up
 * to cap of them into buf (their number). */
size_t cs__http_tls_take(SSL *ssl, char *buf, size_t cap);

/* Replaces the idle timeout for connections accepted from now on (tests). */
void cs__http_server_set_idle_ms(cs_http_server *s, uint64_t ms);
/* fn(arg) runs when the server's memory is freed (after cs_http_server_close
 * and the handles' close callbacks): how a handler's context made by a
 * wrapper such as cs_http_ops_start lives exactly as long as its server. */
void cs__http_server_on_free(cs_http_server *s, void (*fn)(void *), void *arg);

#endif
