/* http_tls.c: TLS under the HTTP server (http.c), OpenSSL with memory BIOs:
 * the socket stays libuv's, ciphertext goes between it and the connection's
 * SSL object, and http.c parses and writes plaintext as before. The server's
 * SSL_CTX is rebuilt when its files change (checked at an accept at most
 * every reload_s seconds), so a renewed certificate serves the next
 * handshakes while open connections keep theirs (each SSL holds a reference
 * to the context it was made from). */
#include "http-impl.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

enum { F_CERT, F_KEY, F_CA, N_FILES };

struct cs__http_tls {
    SSL_CTX *ctx;
    char *path[N_FILES]; /* NULL: not configured (the CA) */
    double reload_s, next_check;
    uint64_t id[N_FILES][5]; /* dev, inode, size, mtime, ctime as last built */
};

/* The newest error OpenSSL queued, for messages ("" when none). */
static const char *ssl_err(char *buf, size_t cap) {
    unsigned long e = ERR_peek_last_error();
    buf[0] = 0;
    if (e) ERR_error_string_n(e, buf, cap);
    ERR_clear_error();
    return buf;
}

static void file_ids(const cs__http_tls *t, uint64_t out[N_FILES][5]) {
    memset(out, 0, sizeof(uint64_t) * N_FILES * 5);
    for (int i = 0; i < N_FILES; i++) {
        struct stat st;
        if (!t->path[i] || stat(t->path[i], &st)) continue;
        out[i][0] = (uint64_t)st.st_dev, out[i][1] = (uint64_t)st.st_ino;
        out[i][2] = (uint64_t)st.st_size;
        out[i][3] = (uint64_t)st.st_mtim.tv_sec * 1000000000u + (uint64_t)st.st_mtim.tv_nsec;
        out[i][4] = (uint64_t)st.st_ctim.tv_sec * 1000000000u + (uint64_t)st.st_ctim.tv_nsec;
    }
}

/* A handshake started after the first one finished: TLS 1.2 renegotiation
 * (refused by SSL_OP_NO_RENEGOTIATION, but each attempt costs an alert the
 * client need not read). The connection is closed at the next read, as
 * nginx does. TLS 1.3's post-handshake messages (KeyUpdate) are served; the
 * write queue's cap (http.c) bounds what a client that does not read can
 * make us hold. */
static void on_info(const SSL *ssl, int where, int ret) {
    (void)ret;
    if ((where & SSL_CB_HANDSHAKE_START) && SSL_is_init_finished(ssl) &&
        SSL_version(ssl) < TLS1_3_VERSION)
        SSL_set_app_data((SSL *)ssl, (void *)1);
}

/* Encrypted keys are refused (no prompt on a terminal). */
static int no_password(char *buf, int size, int rwflag, void *u) {
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* HTTP/1.1 is all this server speaks: ALPN picks it or nothing. */
static int select_alpn(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg) {
    (void)ssl, (void)arg;
    static const unsigned char mine[] = "\x08http/1.1";
    unsigned char *o;
    if (SSL_select_next_proto(&o, outlen, mine, sizeof mine - 1, in, inlen) !=
        OPENSSL_NPN_NEGOTIATED)
        return SSL_TLSEXT_ERR_NOACK;
    *out = o;
    return SSL_TLSEXT_ERR_OK;
}

static int build(const cs__http_tls *t, SSL_CTX **out) {
    char e[256];
    *out = NULL;
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (!ctx) return cs_fail(CS_ENOMEM, "http: TLS: %s", ssl_err(e, sizeof e));
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
    SSL_CTX_set_alpn_select_cb(ctx, select_alpn, NULL);
    SSL_CTX_set_info_callback(ctx, on_info);
    SSL_CTX_set_default_passwd_cb(ctx, no_password);
    /* sessions resume only in this context (a TLS 1.2 client offering one
     * under mutual TLS is otherwise refused); a rebuilt context has its own */
    static const unsigned char sid[] = "chunkserve http";
    SSL_CTX_set_session_id_context(ctx, sid, sizeof sid - 1);
    int r = 0;
    if (SSL_CTX_use_certificate_chain_file(ctx, t->path[F_CERT]) != 1)
        r = cs_fail(CS_EINVAL, "http: TLS: the certificate %s: %s", t->path[F_CERT],
                    ssl_err(e, sizeof e));
    else if (SSL_CTX_use_PrivateKey_file(ctx, t->path[F_KEY], SSL_FILETYPE_PEM) != 1)
        r = cs_fail(CS_EINVAL, "http: TLS: the key %s: %s", t->path[F_KEY], ssl_err(e, sizeof e));
    else if (SSL_CTX_check_private_key(ctx) != 1)
        r = cs_fail(CS_EINVAL, "http: TLS: the key %s is not the certificate %s's (%s)",
                    t->path[F_KEY], t->path[F_CERT], ssl_err(e, sizeof e));
    else if (t->path[F_CA] && SSL_CTX_load_verify_locations(ctx, t->path[F_CA], NULL) != 1)
        r = cs_fail(CS_EINVAL, "http: TLS: the client CA %s: %s", t->path[F_CA],
                    ssl_err(e, sizeof e));
    if (!r && t->path[F_CA]) { /* the CA names sent to clients, to choose their certificate */
        STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(t->path[F_CA]);
        if (names) SSL_CTX_set_client_CA_list(ctx, names); /* takes them */
    }
    ERR_clear_error();
    if (r) {
        SSL_CTX_free(ctx);
        return r;
    }
    if (t->path[F_CA]) /* mutual TLS: no request without a certificate of this CA */
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    *out = ctx;
    return 0;
}

int cs__http_tls_init(const cs_rpc_tls *files, cs__http_tls **out) {
    *out = NULL;
    if (!files || !files->cert_file || !files->cert_file[0]) return 0;
    if (!files->key_file || !files->key_file[0])
        return cs_fail(CS_EINVAL, "http: a TLS certificate (%s) needs its key file",
                       files->cert_file);
    cs__http_tls *t = calloc(1, sizeof *t);
    if (!t) return cs_fail(CS_ENOMEM, "http: out of memory");
    const char *p[N_FILES] = {files->cert_file, files->key_file,
                              files->ca_file && files->ca_file[0] ? files->ca_file : NULL};
    int r = 0;
    for (int i = 0; i < N_FILES && !r; i++)
        if (p[i] && !(t->path[i] = strdup(p[i]))) r = cs_fail(CS_ENOMEM, "http: out of memory");
    t->reload_s = files->reload_s > 0 ? (double)files->reload_s : 10;
    if (!r) {
        file_ids(t, t->id);
        r = build(t, &t->ctx);
    }
    if (r) {
        cs__http_tls_free(t);
        return r;
    }
    t->next_check = cs_now() + t->reload_s;
    *out = t;
    return 0;
}

void cs__http_tls_free(cs__http_tls *t) {
    if (!t) return;
    SSL_CTX_free(t->ctx);
    for (int i = 0; i < N_FILES; i++)
        free(t->path[i]);
    free(t);
}

/* At most every reload_s: a file changed since the context was built makes
 * a new one; a bad new file keeps the old context (logged once). */
static void maybe_reload(cs__http_tls *t) {
    double now = cs_now();
    if (now < t->next_check) return;
    t->next_check = now + t->reload_s;
    uint64_t id[N_FILES][5];
    file_ids(t, id);
    if (!memcmp(id, t->id, sizeof id)) return;
    memcpy(t->id, id, sizeof id);
    SSL_CTX *ctx;
    if (build(t, &ctx)) {
        CS_LOGE("TLS files changed but are refused (the previous certificate stays): %s",
                cs_last_error());
        return;
    }
    SSL_CTX_free(t->ctx); /* connections made from it keep it alive */
    t->ctx = ctx;
    CS_LOGI("http: TLS certificate %s reloaded", t->path[F_CERT]);
}

SSL *cs__http_tls_accept(cs__http_tls *t) {
    maybe_reload(t);
    SSL *ssl = SSL_new(t->ctx);
    BIO *in = BIO_new(BIO_s_mem()), *out = BIO_new(BIO_s_mem());
    if (!ssl || !in || !out) {
        SSL_free(ssl), BIO_free(in), BIO_free(out);
        ERR_clear_error();
        return NULL;
    }
    BIO_set_mem_eof_return(in, -1); /* an empty input BIO means "more to come" */
    SSL_set_bio(ssl, in, out);
    SSL_set_accept_state(ssl);
    return ssl;
}

void cs__http_tls_conn_free(SSL *ssl) {
    SSL_free(ssl); /* and its BIOs */
}

int cs__http_tls_feed(SSL *ssl, const void *data, size_t len) {
    if (BIO_write(SSL_get_rbio(ssl), data, (int)len) != (int)len) {
        ERR_clear_error();
        return CS_ENOMEM;
    }
    return 0;
}

size_t cs__http_tls_buffered_in(SSL *ssl) {
    return BIO_ctrl_pending(SSL_get_rbio(ssl));
}

int cs__http_tls_read(SSL *ssl, char *buf, size_t cap, const char *peer) {
    if (SSL_get_app_data(ssl)) {
        CS_LOGD("http: TLS from %s: a renegotiation attempt; closing", peer);
        return CS_EPROTO;
    }
    ERR_clear_error(); /* SSL_get_error reads the queue: nothing stale in it */
    int n = SSL_read(ssl, buf, (int)(cap < INT32_MAX ? cap : INT32_MAX));
    if (n > 0) return SSL_get_app_data(ssl) ? CS_EPROTO : n;
    int e = SSL_get_error(ssl, n);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return SSL_get_app_data(ssl) ? CS_EPROTO : 0;
    if (e == SSL_ERROR_ZERO_RETURN) { /* the peer's close_notify: its end of stream */
        ERR_clear_error();
        return CS_ECONNRESET;
    }
    char err[256];
    CS_LOGD("http: TLS from %s: %s", peer, ssl_err(err, sizeof err));
    return CS_EPROTO;
}

int cs__http_tls_write(SSL *ssl, const void *data, size_t len) {
    /* into the memory BIO: all of it or an error (a client in the middle of a
     * post-handshake message makes it WANT_READ: the connection closes) */
    ERR_clear_error();
    size_t done = 0;
    int ok = len == 0 || SSL_write_ex(ssl, data, len, &done);
    ERR_clear_error();
    return ok && done == len ? 0 : CS_EPROTO;
}

void cs__http_tls_close_notify(SSL *ssl) {
    ERR_clear_error();
    (void)SSL_shutdown(ssl);
    ERR_clear_error();
}

size_t cs__http_tls_take(SSL *ssl, char *buf, size_t cap) {
    BIO *out = SSL_get_wbio(ssl);
    size_t n = BIO_ctrl_pending(out);
    if (!buf) return n;
    int got = BIO_read(out, buf, (int)(n < cap ? n : cap));
    return got > 0 ? (size_t)got : 0;
}
