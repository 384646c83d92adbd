/* util.h: small internal helpers shared by engine modules: always-on
 * assertions, error recording, logging, checked arithmetic. Not public API. */
#ifndef CS_UTIL_H
#define CS_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/error.h"

#if defined(__GNUC__)
#define CS_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define CS_NORETURN __attribute__((noreturn))
#else
#define CS_PRINTF(a, b)
#define CS_NORETURN
#endif

/* Broken invariant (a bug in chunkserve, never bad input): print and abort. */
#define CS_ASSERT(x)                                                  \
    do {                                                              \
        if (!(x)) cs__assert_fail(__FILE__, __LINE__, #x);            \
    } while (0)
CS_NORETURN void cs__assert_fail(const char *file, int line, const char *expr);

/* Record a formatted message for cs_last_error() and return code, so that
 * failure sites read: return cs__fail(CS_EBADMSG, "gguf: bad magic %08x", m); */
int cs__fail(int code, const char *fmt, ...) CS_PRINTF(2, 3);

/* Logging: one line per event on stderr, level-checked before the arguments
 * are evaluated. The role ("cli", "prefill", ...) is set once per process. */
enum cs_log_level { CS_LOG_ERROR = 0, CS_LOG_WARN, CS_LOG_INFO, CS_LOG_DEBUG };
extern int cs__log_level;
void cs_log_set_level(int level);
/* The role is per thread (set it at the start of each thread: "serve", "engine", ...). */
void cs_log_set_role(const char *role);
void cs__log(int level, const char *file, int line, const char *fmt, ...) CS_PRINTF(4, 5);
#define CS_LOG(lvl, ...)                                                       \
    do {                                                                       \
        if ((lvl) <= cs__log_level) cs__log((lvl), __FILE__, __LINE__, __VA_ARGS__); \
    } while (0)
#define CS_LOGE(...) CS_LOG(CS_LOG_ERROR, __VA_ARGS__)
#define CS_LOGW(...) CS_LOG(CS_LOG_WARN, __VA_ARGS__)
#define CS_LOGI(...) CS_LOG(CS_LOG_INFO, __VA_ARGS__)
#define CS_LOGD(...) CS_LOG(CS_LOG_DEBUG, __VA_ARGS__)

/* Overflow-checked size arithmetic for sizes read from files. */
static inline bool cs__mul_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline bool cs__add_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_add_overflow(a, b, out);
}

/* Whole-file read-only mapping. */
typedef struct {
    const uint8_t *data;
    size_t size;
} cs_mapped_file;
int cs__map_file(const char *path, cs_mapped_file *out);
void cs__unmap_file(cs_mapped_file *f);

/* Read a whole (small) file into a NUL-terminated malloc'd buffer. */
int cs__read_file(const char *path, char **out, size_t *len);

/* Monotonic clock in seconds. */
double cs__now(void);

#endif
