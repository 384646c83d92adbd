/* util.h: the engine's internal helpers (engine/src only): the base
 * library's headers, checked size arithmetic, file mapping and reading. */
#ifndef CS_UTIL_H
#define CS_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/assert.h"
#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/log.h"

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
/* Drops the pages of [p, p + n) inside a read-only file mapping from this
 * process's resident set (the whole pages within it; they are read again
 * from the file if touched): a loader calls it on each tensor once it is
 * converted or packed, so a load's peak memory is the result plus one
 * tensor, not the result plus the file. */
void cs__mapped_release(const void *p, size_t n);

/* Duplicate names in a file's table (GGUF keys and tensors, safetensors
 * tensors), in O(n) with a hash set: name(ctx, i, &len) gives entry i.
 * Returns the index of the first entry equal to an earlier one, -1 when all
 * differ, or CS_ENOMEM (as -2) when the set cannot be allocated. */
#define CS_DUP_NOMEM (-2)
int64_t cs__first_duplicate(size_t n, const char *(*name)(const void *ctx, size_t i, size_t *len),
                            const void *ctx);

/* Read a whole (small) file into a NUL-terminated malloc'd buffer. */
int cs__read_file(const char *path, char **out, size_t *len);

#endif
