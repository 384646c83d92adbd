/* rpc_util.c: byte buffers, metadata and protobuf-c glue shared by the
 * server and client sides, and the status code names. */
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <protobuf-c/protobuf-c.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"
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
    grpc_slice k = grpc_slice_from_copied_string(key);
    grpc_slice v = grpc_slice_from_copied_string(value);
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
