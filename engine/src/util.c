/* util.c: error strings and messages, logging, file mapping, clock. */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char last_error[512];

const char *cs_strerror(int code) {
    switch (code) {
    case CS_OK: return "success";
#define CS__ERRNO_CASE(name, val, msg) \
    case CS_##name: return msg;
        CS_ERRNO_MAP(CS__ERRNO_CASE)
#undef CS__ERRNO_CASE
    default: return "unknown error";
    }
}

const char *cs_last_error(void) { return last_error; }

int cs__fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

void cs__assert_fail(const char *file, int line, const char *expr) {
    fprintf(stderr, "%s:%d: CS_ASSERT(%s) failed\n", file, line, expr);
    fflush(stderr);
    abort();
}

int cs__log_level = CS_LOG_INFO;
static _Thread_local const char *log_role = "chunkserve"; /* per thread: "engine", "serve", ... */

void cs_log_set_level(int level) { cs__log_level = level; }
void cs_log_set_role(const char *role) { log_role = role; }

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
            ts.tv_nsec / 1000000, names[level < 0 ? 0 : level > 3 ? 3 : level], log_role,
            base ? base + 1 : file, line, msg);
}

int cs__map_file(const char *path, cs_mapped_file *out) {
    out->data = NULL;
    out->size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cs__fail(-errno, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return cs__fail(-e, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return cs__fail(CS_EINVAL, "'%s' is not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return cs__fail(CS_EBADMSG, "'%s' is empty", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return cs__fail(-e, "cannot mmap '%s': %s", path, strerror(e));
    out->data = p;
    out->size = (size_t)st.st_size;
    return 0;
}

void cs__unmap_file(cs_mapped_file *f) {
    if (f->data) munmap((void *)f->data, f->size);
    f->data = NULL;
    f->size = 0;
}

int cs__read_file(const char *path, char **out, size_t *len) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return cs__fail(-errno, "cannot open '%s': %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(fp);
        return cs__fail(CS_ENOMEM, "out of memory reading '%s'", path);
    }
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                fclose(fp);
                return cs__fail(CS_ENOMEM, "out of memory reading '%s'", path);
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - 1 - n, fp);
        n += r;
        if (r == 0) break;
    }
    int err = ferror(fp);
    fclose(fp);
    if (err) {
        free(buf);
        return cs__fail(CS_EIO, "read error on '%s'", path);
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return 0;
}

double cs__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
