/* safetensors.h: a validating reader for Hugging Face safetensors files and
 * model directories (one model.safetensors, or shards named by
 * model.safetensors.index.json). Read-only views into mappings; shapes in
 * PyTorch order (shape[0] outermost). */
#ifndef CS_SAFETENSORS_H
#define CS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "util.h"

#define CS_ST_MAX_DIMS 4

typedef struct {
    char *name;
    enum cs_dtype type;
    int n_dims;
    int64_t shape[CS_ST_MAX_DIMS];
    const uint8_t *data;
    size_t nbytes;
} cs_st_tensor;

typedef struct {
    int n_files;
    cs_mapped_file *files;
    int n_tensors;
    cs_st_tensor *tensors;
} cs_st_set;

/* Opens every safetensors file of the model directory dir. On failure
 * nothing stays allocated and cs_last_error() names file and problem. */
int cs__st_open_dir(const char *dir, cs_st_set *set);
/* Opens one file (used by tests and by cs__st_open_dir). */
int cs__st_open_file(const char *path, cs_st_set *set);
void cs__st_close(cs_st_set *set);
const cs_st_tensor *cs__st_find(const cs_st_set *set, const char *name);

#endif
