/* base.c: the base library (chunkserve/{error,log,assert,clock}.h): error
 * strings and the per-thread last error, assertions, logging, the clock. */
#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static _Thread_local char last_error[512];
static _Thread_local char last_field[64];

const char *cs_strerror(int code) {
    switch (code) {
    case CS_OK: return "success";
#define CS__ERRNO_CASE(name, val, msg)                                                             \
    case CS_##name: return msg;
        CS_ERRNO_MAP(CS__ERRNO_CASE)
#undef CS__ERRNO_CASE
    default: return "unknown error";
    }
}

const char *cs_last_error(void) {
    return last_error;
}

const char *cs_last_error_field(void) {
    return last_field;
}

void cs_error_clear(void) {
    last_error[0] = 0;
    last_field[0] = 0;
}

int cs_fail_in(int code, const char *field) {
    if (!last_field[0]) snprintf(last_field, sizeof last_field, "%s", field);
    return code;
}

int cs_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    last_field[0] = 0;
    return code;
}

int cs_fail_field(int code, const char *field, const char *fmt, ...) {
    char f[sizeof last_field];
    snprintf(f, sizeof f, "%s", field ? field : ""); /* field may be cs_last_error_field() */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    memcpy(last_field, f, sizeof f);
    return code;
}

void cs__assert_fail(const char *file, int line, const char *expr) {
    fprintf(stderr, "%s:%d: CS_ASSERT(%s) failed\n", file, line, expr);
    fflush(stderr);
    abort();
}

int cs__log_level = CS_LOG_INFO;
static _Thread_local const char *log_role = "chunkserve"; /* per thread: "engine", "serve", ... */

void cs_log_set_level(int level) {
    cs__log_level = level;
}
int cs_log_level(void) {
    return cs__log_level;
}
void cs_log_set_role(const char *role) {
    log_role = role;
}

void cs__log(int level, const char *file, int line, const char *fmt, ...) {
    static const char *names[] = {"E", "W", "I", "D"};
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%02d:%02d:%02d.%03ld %s %s %s:%d %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000,
            names[level < 0   ? 0
                  : level > 3 ? 3
                              : level],
            log_role, base ? base + 1 : file, line, msg);
}

double cs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
