/* util.c: the engine's file helpers (mapping, reading, duplicate names). */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

int cs__map_file(const char *path, cs_mapped_file *out) {
    out->data = NULL;
    out->size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cs_fail(-errno, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return cs_fail(-e, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return cs_fail(CS_EINVAL, "'%s' is not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return cs_fail(CS_EBADMSG, "'%s' is empty", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return cs_fail(-e, "cannot mmap '%s': %s", path, strerror(e));
    out->data = p;
    out->size = (size_t)st.st_size;
    return 0;
}

void cs__unmap_file(cs_mapped_file *f) {
    if (f->data) munmap((void *)f->data, f->size);
    f->data = NULL;
    f->size = 0;
}

void cs__mapped_release(const void *p, size_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)p + page - 1) / page * page, b = ((uintptr_t)p + n) / page * page;
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED); /* advice: a failure changes nothing */
}

int cs__read_file(const char *path, char **out, size_t *len) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return cs_fail(-errno, "cannot open '%s': %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(fp);
        return cs_fail(CS_ENOMEM, "out of memory reading '%s'", path);
    }
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                fclose(fp);
                return cs_fail(CS_ENOMEM, "out of memory reading '%s'", path);
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
        return cs_fail(CS_EIO, "read error on '%s'", path);
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return 0;
}

int64_t cs__first_duplicate(size_t n, const char *(*name)(const void *ctx, size_t i, size_t *len),
                            const void *ctx) {
    size_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    int64_t *slot = malloc(cap * sizeof *slot); /* entry index + 1, 0 = empty */
    if (!slot) return CS_DUP_NOMEM;
    memset(slot, 0, cap * sizeof *slot);
    int64_t dup = -1;
    for (size_t i = 0; i < n && dup < 0; i++) {
        size_t len;
        const char *s = name(ctx, i, &len);
        size_t h = (size_t)XXH3_64bits(s, len) & (cap - 1);
        for (;; h = (h + 1) & (cap - 1)) {
            if (!slot[h]) {
                slot[h] = (int64_t)i + 1;
                break;
            }
            size_t ol;
            const char *o = name(ctx, (size_t)slot[h] - 1, &ol);
            if (ol == len && !memcmp(o, s, len)) {
                dup = (int64_t)i;
                break;
            }
        }
    }
    free(slot);
    return dup;
}
