/* gguf.h: a validating reader for GGUF v2/v3 files (llama.cpp's model format).
 *
 * cs__gguf_open maps the file and checks every count, length, offset, shape
 * and type against the file's size before anything is used, so accessors can
 * trust what they return. It only reads: building a model from the tensors is
 * model_gguf.c's job. Not thread-safe during open; read-only afterwards. */
#ifndef CS_GGUF_H
#define CS_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "util.h"

enum cs_gguf_type {
    CS_GGUF_UINT8 = 0,
    CS_GGUF_INT8 = 1,
    CS_GGUF_UINT16 = 2,
    CS_GGUF_INT16 = 3,
    CS_GGUF_UINT32 = 4,
    CS_GGUF_INT32 = 5,
    CS_GGUF_FLOAT32 = 6,
    CS_GGUF_BOOL = 7,
    CS_GGUF_STRING = 8,
    CS_GGUF_ARRAY = 9,
    CS_GGUF_UINT64 = 10,
    CS_GGUF_INT64 = 11,
    CS_GGUF_FLOAT64 = 12,
    CS_GGUF_TYPE_COUNT
};

typedef struct {
    const char *ptr; /* not NUL-terminated; points into the mapping */
    size_t len;
} cs_gguf_str;

typedef struct {
    cs_gguf_str key;
    enum cs_gguf_type type;
    enum cs_gguf_type arr_type; /* element type when type == ARRAY */
    uint64_t arr_count;
    const uint8_t *data; /* start of the value (after the array header for arrays) */
} cs_gguf_kv;

#define CS_GGUF_MAX_DIMS 4
typedef struct {
    cs_gguf_str name;
    uint32_t n_dims;
    int64_t ne[CS_GGUF_MAX_DIMS]; /* ne[0] varies fastest (ggml order) */
    enum cs_dtype type;
    uint64_t offset; /* relative to the data section */
    size_t nbytes;
    const uint8_t *data;
} cs_gguf_tensor;

typedef struct {
    cs_mapped_file file;
    uint32_t version;
    uint32_t alignment;
    uint64_t n_kv;
    cs_gguf_kv *kv;
    uint64_t n_tensors;
    cs_gguf_tensor *tensors;
    const uint8_t *data_section;
} cs_gguf;

/* Opens and validates path. On failure nothing is left allocated and
 * cs_last_error() names the problem ("gguf: <path>: ..."). */
int cs__gguf_open(const char *path, cs_gguf *g);
void cs__gguf_close(cs_gguf *g);

const cs_gguf_kv *cs__gguf_find(const cs_gguf *g, const char *key);
const cs_gguf_tensor *cs__gguf_find_tensor(const cs_gguf *g, const char *name);

/* Typed getters. Missing key: return CS_ENOENT and leave *out alone (so a
 * default can be pre-set). Wrong type or out-of-range value: CS_EBADMSG. */
int cs__gguf_get_u32(const cs_gguf *g, const char *key, uint32_t *out);
int cs__gguf_get_f32(const cs_gguf *g, const char *key, float *out);
int cs__gguf_get_bool(const cs_gguf *g, const char *key, bool *out);
int cs__gguf_get_str(const cs_gguf *g, const char *key, cs_gguf_str *out);
/* Array of strings: *out is malloc'd (count entries pointing into the map). */
int cs__gguf_get_str_array(const cs_gguf *g, const char *key, cs_gguf_str **out, uint64_t *count);
/* Array of 32-bit integers (INT32 or UINT32) copied into a malloc'd array. */
int cs__gguf_get_i32_array(const cs_gguf *g, const char *key, int32_t **out, uint64_t *count);
/* Array of FLOAT32 copied into a malloc'd array. */
int cs__gguf_get_f32_array(const cs_gguf *g, const char *key, float **out, uint64_t *count);

#endif
