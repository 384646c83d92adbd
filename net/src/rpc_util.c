/* rpc_util.c: byte buffers, metadata and protobuf-c glue shared by the
 * server and client sides, and the status code names. */
#include <grpc/byte_buffer_reader.h>
#include <errno.h>
#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <grpc/slice.h>
#include <protobuf-c/protobuf-c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
#include "chunkserve/secret.h"
#include "rpc-impl.h"

const char *cs_rpc_code_name(int code) {
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    if (code < 0 || code >= (int)(sizeof names / sizeof names[0])) return "UNKNOWN_CODE";
    return names[code];
}

int cs_rpc_code_of_status(int status) {
    switch (status) {
    case CS_OK: return CS_RPC_OK;
    case CS_EINVAL:
    case CS_ERANGE:
    case CS_E2BIG:
    case CS_EOVERFLOW: return CS_RPC_INVALID_ARGUMENT;
    case CS_ENOSPC:
    case CS_ENOMEM:
    case CS_EAGAIN: return CS_RPC_RESOURCE_EXHAUSTED;
    case CS_ENOTSUP:
    case CS_ENOSYS: return CS_RPC_FAILED_PRECONDITION;
    case CS_EEXIST: return CS_RPC_ALREADY_EXISTS;
    case CS_EACCES: return CS_RPC_PERMISSION_DENIED;
    case CS_ETIMEDOUT: return CS_RPC_DEADLINE_EXCEEDED;
    case CS_ECANCELED: return CS_RPC_CANCELLED;
    case CS_EBADMSG: return CS_RPC_DATA_LOSS;
    case CS_ECONNRESET:
    case CS_ECONNREFUSED:
    case CS_EPROTO:
    case CS_EIO: return CS_RPC_UNAVAILABLE;
    default: return CS_RPC_INTERNAL;
    }
}

grpc_byte_buffer *cs__rpc_bb_from_bytes(const uint8_t *buf, size_t len) {
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

grpc_byte_buffer *cs__rpc_bb_from_msg(const struct ProtobufCMessage *m, size_t *len) {
    size_t n = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(n);
    size_t packed = protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    CS_ASSERT(packed == n);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    if (len) *len = n;
    return bb;
}

bool cs__rpc_bb_flatten(grpc_byte_buffer *bb, grpc_slice *out) {
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb)) return false;
    *out = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    return true;
}

int cs__rpc_md_add(cs__rpc_md_list *l, const char *key, const char *value) {
    if (!key || !value) return cs_fail(CS_EINVAL, "rpc: metadata key and value are required");
    return cs__rpc_md_add_bytes(l, key, value, strlen(value));
}

int cs__rpc_md_add_bytes(cs__rpc_md_list *l, const char *key, const void *value, size_t len) {
    if (!key || (!value && len)) return cs_fail(CS_EINVAL, "rpc: metadata key and value are required");
    grpc_slice k = grpc_slice_from_copied_string(key);
    grpc_slice v = grpc_slice_from_copied_buffer(value, len);
    bool ok = grpc_header_key_is_legal(k) && key[0] != ':' &&
              (grpc_is_binary_header(k) || grpc_header_nonbin_value_is_legal(v));
    if (!ok) {
        grpc_slice_unref(k);
        grpc_slice_unref(v);
        return cs_fail(CS_EINVAL,
                       "rpc: illegal metadata '%s' (keys: lowercase a-z 0-9 - _ .; "
                       "values: printable ASCII unless the key ends in -bin)",
                       key);
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 4;
        grpc_metadata *md = realloc(l->md, cap * sizeof *md);
        if (!md) {
            grpc_slice_unref(k);
            grpc_slice_unref(v);
            return cs_fail(CS_ENOMEM, "rpc: out of memory");
        }
        l->md = md;
        l->cap = cap;
    }
    memset(&l->md[l->n], 0, sizeof l->md[l->n]);
    l->md[l->n].key = k;
    l->md[l->n].value = v;
    l->n++;
    return 0;
}

void cs__rpc_md_free(cs__rpc_md_list *l) {
    for (size_t i = 0; i < l->n; i++) {
        grpc_slice_unref(l->md[i].key);
        grpc_slice_unref(l->md[i].value);
    }
    free(l->md);
    memset(l, 0, sizeof *l);
}

const char *cs__rpc_md_find(const grpc_metadata_array *a, const char *key, size_t *len) {
    size_t klen = strlen(key);
    for (size_t i = 0; i < a->count; i++) {
        const grpc_metadata *m = &a->metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) == klen &&
            memcmp(GRPC_SLICE_START_PTR(m->key), key, klen) == 0) {
            if (len) *len = GRPC_SLICE_LENGTH(m->value);
            return (const char *)GRPC_SLICE_START_PTR(m->value);
        }
    }
    return NULL;
}

int cs_rpc_unpack(const struct ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len,
                  struct ProtobufCMessage **out) {
    *out = protobuf_c_message_unpack(desc, NULL, len, buf);
    if (!*out) return cs_fail(CS_EBADMSG, "malformed %s message (%zu bytes)", desc->name, len);
    return 0;
}

/* ---------------------------------------------------------------- TLS -- */

/* The whole of a PEM file (at most 1 MiB), NUL-terminated, into *out. */
static int read_pem(const char *path, const char *what, char **out) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return cs_fail(CS_EINVAL, "rpc: cannot open the TLS %s %s: %s", what, path,
                       strerror(errno));
    enum { MAX = 1 << 20 };
    char *buf = malloc(MAX + 1);
    size_t n = buf ? fread(buf, 1, MAX + 1, f) : 0;
    bool err = ferror(f);
    fclose(f);
    if (!buf) return cs_fail(CS_ENOMEM, "rpc: out of memory");
    buf[n <= MAX ? n : MAX] = 0;
    if (err || n == 0 || n > MAX || !strstr(buf, "-----BEGIN")) {
        free(buf);
        return cs_fail(CS_EINVAL, "rpc: the TLS %s %s is %s", what, path,
                       err       ? "unreadable"
                       : n > MAX ? "over 1 MiB"
                                 : "not PEM");
    }
    buf[n] = 0;
    *out = buf;
    return 0;
}

/* Each file must be a readable PEM now (a clear error at start, naming it);
 * gRPC's file watcher then re-reads them every reload_s seconds (a file
 * that turns bad later keeps the last good contents, and gRPC logs it). */
static int check_pem(const char *path, const char *what) {
    char *buf;
    int r = read_pem(path, what, &buf);
    if (!r) cs_secure_zero(buf, strlen(buf)), free(buf);
    return r;
}

/* Encrypted keys are refused (no prompt on a terminal). */
static int no_password(char *buf, int size, int rwflag, void *u) {
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* What gRPC would refuse only at the first handshake, refused now: a file
 * with no certificate, a key that is not the certificate's. */
static int check_identity(const char *cert_file, const char *key_file) {
    BIO *b = BIO_new_file(cert_file, "r");
    X509 *x = b ? PEM_read_bio_X509(b, NULL, no_password, NULL) : NULL;
    BIO_free(b);
    EVP_PKEY *k = NULL;
    int r = 0;
    if (!x) {
        r = cs_fail(CS_EINVAL, "rpc: the TLS certificate %s holds no PEM certificate", cert_file);
    } else if (key_file) {
        b = BIO_new_file(key_file, "r");
        k = b ? PEM_read_bio_PrivateKey(b, NULL, no_password, NULL) : NULL;
        BIO_free(b);
        if (!k)
            r = cs_fail(CS_EINVAL, "rpc: the TLS key %s holds no PEM private key", key_file);
        else if (X509_check_private_key(x, k) != 1)
            r = cs_fail(CS_EINVAL, "rpc: the TLS key %s is not the certificate %s's", key_file,
                        cert_file);
    }
    X509_free(x);
    EVP_PKEY_free(k);
    ERR_clear_error();
    return r;
}

static unsigned reload_s(const cs_rpc_tls *t) {
    return t->reload_s > 0 ? (unsigned)t->reload_s : 10;
}

int cs__rpc_server_creds(const cs_rpc_tls *t, grpc_server_credentials **out) {
    *out = NULL;
    if (!t->cert_file || !t->cert_file[0]) return 0;
    if (!t->key_file || !t->key_file[0])
        return cs_fail(CS_EINVAL, "rpc: a TLS certificate (%s) needs its key file", t->cert_file);
    bool ca = t->ca_file && t->ca_file[0];
    int r = check_pem(t->cert_file, "certificate");
    if (!r) r = check_pem(t->key_file, "key");
    if (!r && ca) r = check_pem(t->ca_file, "client CA");
    if (!r) r = check_identity(t->cert_file, t->key_file);
    if (!r && ca) r = check_identity(t->ca_file, NULL);
    if (r) return r;
    grpc_tls_certificate_provider *files = grpc_tls_certificate_provider_file_watcher_create(
        t->key_file, t->cert_file, ca ? t->ca_file : NULL, reload_s(t));
    grpc_tls_credentials_options *opts = grpc_tls_credentials_options_create();
    grpc_tls_credentials_options_set_certificate_provider(opts, files);
    grpc_tls_certificate_provider_release(files); /* opts holds it */
    grpc_tls_credentials_options_watch_identity_key_cert_pairs(opts);
    if (ca) grpc_tls_credentials_options_watch_root_certs(opts);
    grpc_tls_credentials_options_set_cert_request_type(
        opts, ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                 : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    *out = grpc_tls_server_credentials_create(opts); /* takes opts */
    if (!*out)
        return cs_fail(CS_EINVAL, "rpc: gRPC refused the TLS certificate %s or its key",
                       t->cert_file);
    return 0;
}

int cs__rpc_channel_creds(const cs_rpc_tls *t, grpc_channel_credentials **out) {
    *out = NULL;
    if (!t->ca_file || !t->ca_file[0]) {
        *out = grpc_insecure_credentials_create();
        return 0;
    }
    bool mutual = t->cert_file && t->cert_file[0];
    if (mutual && (!t->key_file || !t->key_file[0]))
        return cs_fail(CS_EINVAL, "rpc: a TLS client certificate (%s) needs its key file",
                       t->cert_file);
    int r = check_pem(t->ca_file, "CA");
    if (!r && mutual) r = check_pem(t->cert_file, "client certificate");
    if (!r && mutual) r = check_pem(t->key_file, "client key");
    if (!r) r = check_identity(t->ca_file, NULL);
    if (!r && mutual) r = check_identity(t->cert_file, t->key_file);
    if (r) return r;
    grpc_tls_certificate_provider *files = grpc_tls_certificate_provider_file_watcher_create(
        mutual ? t->key_file : NULL, mutual ? t->cert_file : NULL, t->ca_file, reload_s(t));
    grpc_tls_credentials_options *opts = grpc_tls_credentials_options_create();
    grpc_tls_credentials_options_set_certificate_provider(opts, files);
    grpc_tls_certificate_provider_release(files);
    grpc_tls_credentials_options_watch_root_certs(opts);
    if (mutual) grpc_tls_credentials_options_watch_identity_key_cert_pairs(opts);
    grpc_tls_credentials_options_set_verify_server_cert(opts, 1);
    *out = grpc_tls_credentials_create(opts); /* takes opts */
    if (!*out) return cs_fail(CS_EINVAL, "rpc: gRPC refused the TLS files (CA %s)", t->ca_file);
    return 0;
}
