/* chunkserve/error.h (base library): the one list of status codes used by
 * every module, their messages, and the per-thread last error.
 *
 * Every fallible function returns int: 0 on success, a negative CS_E* code on
 * failure. Codes are errno-compatible (CS_EINVAL == -EINVAL on Linux) so that
 * libuv and syscall errors pass through unchanged (libuv's uv-errno.h idea).
 * A human-readable message for the most recent failure on the calling thread
 * is available from cs_last_error(); it names the thing that was wrong
 * ("gguf: tensor 'blk.0.attn_q.weight' ends past end of file", ...). */
#ifndef CHUNKSERVE_ERROR_H
#define CHUNKSERVE_ERROR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, errno value, default message) */
#define CS_ERRNO_MAP(X)                                                                            \
    X(EPERM, -1, "operation not permitted")                                                        \
    X(ENOENT, -2, "no such file or directory")                                                     \
    X(EIO, -5, "i/o error")                                                                        \
    X(E2BIG, -7, "argument list too long")                                                         \
    X(EAGAIN, -11, "resource temporarily unavailable")                                             \
    X(ENOMEM, -12, "out of memory")                                                                \
    X(EACCES, -13, "permission denied")                                                            \
    X(EBUSY, -16, "resource busy")                                                                 \
    X(EEXIST, -17, "already exists")                                                               \
    X(EINVAL, -22, "invalid argument")                                                             \
    X(ENOSPC, -28, "no space left (pool exhausted)")                                               \
    X(ERANGE, -34, "value out of range")                                                           \
    X(ENOSYS, -38, "function not implemented")                                                     \
    X(EOVERFLOW, -75, "value too large for defined data type")                                     \
    X(EBADMSG, -74, "malformed data")                                                              \
    X(EPROTO, -71, "protocol error")                                                               \
    X(ENOTSUP, -95, "operation not supported")                                                     \
    X(ECONNRESET, -104, "connection reset by peer")                                                \
    X(ETIMEDOUT, -110, "timed out")                                                                \
    X(ECONNREFUSED, -111, "connection refused")                                                    \
    X(ECANCELED, -125, "operation canceled")

enum cs_status {
    CS_OK = 0,
#define CS__ERRNO_ENUM(name, val, msg) CS_##name = (val),
    CS_ERRNO_MAP(CS__ERRNO_ENUM)
#undef CS__ERRNO_ENUM
};

/* Static description of a code; never NULL. Thread-safe. */
const char *cs_strerror(int code);

/* Message recorded by the last failing call on this thread (thread-local;
 * valid until the next failing call on the same thread). Never NULL: "" when
 * nothing has failed. */
const char *cs_last_error(void);

/* Records a formatted message for cs_last_error() and returns code, so that
 * failure sites read: return cs_fail(CS_EBADMSG, "gguf: bad magic %08x", m);
 * Messages longer than 511 bytes are cut. Thread-safe (per thread). */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
int cs_fail(int code, const char *fmt, ...);

/* As cs_fail, and names the request field the failure is about, as the
 * request's own message spells it ("sampling.top_p", "token_ids.ids",
 * "context" for a prompt that does not fit the model's context):
 * cs_last_error_field() returns it until the next failing call on this
 * thread (cs_fail clears it). The doors answer with it (gRPC: the
 * chunkserve-field trailer; OpenAI: the error's param), so nobody parses a
 * message to learn what was wrong. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
int cs_fail_field(int code, const char *field, const char *fmt, ...);
/* "" when the last failure named no field. */
const char *cs_last_error_field(void);
/* Forgets this thread's last error and field (before work whose refusals
 * cs_fail_in names: a callee that fails without cs_fail leaves none). */
void cs_error_clear(void);
/* Names field as what the failure just recorded (by a callee that knew no
 * request fields) was about, unless it named one; returns code. */
int cs_fail_in(int code, const char *field);

#ifdef __cplusplus
}
#endif
#endif
