/* safetensors.c: safetensors reader. Format: u64 little-endian header length
 * N, N bytes of JSON {name: {dtype, shape, data_offsets:[begin,end]}, ...,
 * "__metadata__": {...}}, then the byte buffer the offsets index. */
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unicode.h"

#define ST_MAX_HEADER (100u << 20) /* the format's own limit */

static int parse_dtype(const char *s, enum cs_dtype *t) {
    if (!strcmp(s, "F32"))
        *t = CS_DTYPE_F32;
    else if (!strcmp(s, "F16"))
        *t = CS_DTYPE_F16;
    else if (!strcmp(s, "BF16"))
        *t = CS_DTYPE_BF16;
    else
        return -1;
    return 0;
}

/* Reads a JSON number that must be an exact non-negative integer. */
static int json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return -1;
    double d = j->valuedouble;
    if (d < 0 || d > 9007199254740992.0 || d != (double)(uint64_t)d) return -1;
    *out = (uint64_t)d;
    return 0;
}

static const char *st_name(const void *ctx, size_t i, size_t *len) {
    const cs_st_set *set = ctx;
    *len = strlen(set->tensors[i].name);
    return set->tensors[i].name;
}

static int add_file(const char *path, cs_st_set *set) {
    cs_mapped_file mf;
    int r = cs__map_file(path, &mf);
    if (r) return r;
    cJSON *root = NULL;
    cs_st_tensor *grown = NULL;
    int n_new = 0;
    uint64_t hlen;
    if (mf.size < 8) {
        r = cs_fail(CS_EBADMSG, "safetensors: %s: file truncated (%zu bytes)", path, mf.size);
        goto fail;
    }
    memcpy(&hlen, mf.data, 8);
    if (hlen > ST_MAX_HEADER || hlen > mf.size - 8) {
        r = cs_fail(CS_EBADMSG, "safetensors: %s: header length %llu exceeds the file (%zu bytes)",
                    path, (unsigned long long)hlen, mf.size);
        goto fail;
    }
    if (!cs__utf8_valid(mf.data + 8, (size_t)hlen)) {
        r = cs_fail(CS_EBADMSG, "safetensors: %s: header is not valid UTF-8", path);
        goto fail;
    }
    root = cJSON_ParseWithLength((const char *)mf.data + 8, (size_t)hlen);
    if (!cJSON_IsObject(root)) {
        r = cs_fail(CS_EBADMSG, "safetensors: %s: header is not a JSON object", path);
        goto fail;
    }
    const uint8_t *buf = mf.data + 8 + hlen;
    size_t buf_size = mf.size - 8 - (size_t)hlen;
    int count = cJSON_GetArraySize(root);
    grown = realloc(set->tensors, (size_t)(set->n_tensors + count + 1) * sizeof *grown);
    if (!grown) {
        r = cs_fail(CS_ENOMEM, "safetensors: out of memory");
        goto fail;
    }
    set->tensors = grown;
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (!strcmp(it->string, "__metadata__")) continue;
        cs_st_tensor *t = &set->tensors[set->n_tensors];
        memset(t, 0, sizeof *t);
        const char *nm = it->string;
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *off = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        if (!cJSON_IsObject(it) || !cJSON_IsString(dt) || !cJSON_IsArray(sh) ||
            !cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2) {
            r = cs_fail(CS_EBADMSG,
                        "safetensors: %s: tensor '%s' needs dtype, shape and data_offsets[2]", path,
                        nm);
            goto fail;
        }
        if (parse_dtype(dt->valuestring, &t->type)) {
            r = cs_fail(
                CS_ENOTSUP,
                "safetensors: %s: tensor '%s' has dtype %s (F32, F16 and BF16 are supported)", path,
                nm, dt->valuestring);
            goto fail;
        }
        int nd = cJSON_GetArraySize(sh);
        if (nd < 1 || nd > CS_ST_MAX_DIMS) {
            r = cs_fail(CS_EBADMSG,
                        "safetensors: %s: tensor '%s' has %d dimensions (1..%d allowed)", path, nm,
                        nd, CS_ST_MAX_DIMS);
            goto fail;
        }
        uint64_t n_elem = 1;
        for (int d = 0; d < nd; d++) {
            uint64_t v;
            if (json_uint(cJSON_GetArrayItem(sh, d), &v) || v == 0 || v > ((uint64_t)1 << 40) ||
                n_elem > UINT64_MAX / v) {
                r = cs_fail(CS_EBADMSG, "safetensors: %s: tensor '%s' has a bad shape entry %d",
                            path, nm, d);
                goto fail;
            }
            t->shape[d] = (int64_t)v;
            n_elem *= v;
        }
        t->n_dims = nd;
        uint64_t b, e;
        size_t want;
        if (json_uint(cJSON_GetArrayItem(off, 0), &b) ||
            json_uint(cJSON_GetArrayItem(off, 1), &e) || b > e || e > buf_size) {
            r = cs_fail(
                CS_EBADMSG,
                "safetensors: %s: tensor '%s' data_offsets lie outside the %zu-byte data buffer",
                path, nm, buf_size);
            goto fail;
        }
        if (!cs__dtype_nbytes(t->type, n_elem, &want) || want != e - b) {
            r = cs_fail(
                CS_EBADMSG,
                "safetensors: %s: tensor '%s' has %llu bytes but its shape and dtype need %zu",
                path, nm, (unsigned long long)(e - b), want);
            goto fail;
        }
        t->name = strdup(nm);
        if (!t->name) {
            r = cs_fail(CS_ENOMEM, "safetensors: out of memory");
            goto fail;
        }
        t->data = buf + b;
        t->nbytes = (size_t)(e - b);
        n_new++;
        set->n_tensors++;
    }
    /* a name twice, in this file or across the set's files: O(n) */
    int64_t dup = cs__first_duplicate((size_t)set->n_tensors, st_name, set);
    if (dup == CS_DUP_NOMEM) {
        r = cs_fail(CS_ENOMEM, "safetensors: out of memory");
        goto fail;
    }
    if (dup >= 0) {
        r = cs_fail(CS_EBADMSG, "safetensors: %s: tensor '%s' appears twice", path,
                    set->tensors[dup].name);
        goto fail;
    }
    cs_mapped_file *files = realloc(set->files, (size_t)(set->n_files + 1) * sizeof *files);
    if (!files) {
        r = cs_fail(CS_ENOMEM, "safetensors: out of memory");
        goto fail;
    }
    set->files = files;
    set->files[set->n_files++] = mf;
    cJSON_Delete(root);
    return 0;
fail:
    for (int i = 0; i < n_new; i++)
        free(set->tensors[set->n_tensors - n_new + i].name);
    set->n_tensors -= n_new;
    cJSON_Delete(root);
    cs__unmap_file(&mf);
    return r;
}

int cs__st_open_file(const char *path, cs_st_set *set) {
    memset(set, 0, sizeof *set);
    int r = add_file(path, set);
    if (r) cs__st_close(set);
    return r;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int cs__st_open_dir(const char *dir, cs_st_set *set) {
    memset(set, 0, sizeof *set);
    DIR *d = opendir(dir);
    if (!d) return cs_fail(CS_ENOENT, "safetensors: cannot open directory '%s'", dir);
    char **names = NULL;
    int n = 0, r = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len > 12 && !strcmp(de->d_name + len - 12, ".safetensors")) {
            char **nn = realloc(names, (size_t)(n + 1) * sizeof *nn);
            if (!nn || !(nn[n] = strdup(de->d_name))) {
                if (nn) names = nn;
                r = cs_fail(CS_ENOMEM, "safetensors: out of memory");
                break;
            }
            names = nn;
            n++;
        }
    }
    closedir(d);
    if (!r && n == 0) r = cs_fail(CS_ENOENT, "safetensors: no *.safetensors file in '%s'", dir);
    if (!r) qsort(names, (size_t)n, sizeof *names, name_cmp);
    for (int i = 0; !r && i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        r = add_file(path, set);
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (r) cs__st_close(set);
    return r;
}

void cs__st_close(cs_st_set *set) {
    for (int i = 0; i < set->n_tensors; i++)
        free(set->tensors[i].name);
    for (int i = 0; i < set->n_files; i++)
        cs__unmap_file(&set->files[i]);
    free(set->tensors);
    free(set->files);
    memset(set, 0, sizeof *set);
}

const cs_st_tensor *cs__st_find(const cs_st_set *set, const char *name) {
    for (int i = 0; i < set->n_tensors; i++)
        if (!strcmp(set->tensors[i].name, name)) return &set->tensors[i];
    return NULL;
}
