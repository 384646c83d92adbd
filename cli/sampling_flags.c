/* sampling_flags.c: the CLI's sampling flags, made from the sampling table
 * (sampling_flags.h). */
#include "sampling_flags.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "chunkserve/assert.h"
#include "chunkserve/sampling_fields.h"

static const cs_sampling_field *rows[CS_CLI_SAMPLING_MAX];
static cs_config_entry entries[CS_CLI_SAMPLING_MAX];
static char names[CS_CLI_SAMPLING_MAX][40], defs[CS_CLI_SAMPLING_MAX][32];
static char helps[CS_CLI_SAMPLING_MAX][200];
static size_t n_rows;

/* The rows that set cs_sampling_params (the others: the stop conditions and
 * logprobs have flags or commands of their own). */
static bool in_params(const cs_sampling_field *f) {
    size_t b = offsetof(cs_request, sampling);
    return f->off >= b && f->off < b + sizeof(cs_sampling_params);
}

static void bound(char *s, size_t cap, const cs_sampling_field *f) {
    if (f->type != CS_FIELD_FLOAT || !isfinite(f->hi)) return;
    snprintf(s + strlen(s), cap - strlen(s), " in %c%g,%g%c",
             (f->flags & CS_FIELD_LO_OPEN) ? '(' : '[', f->lo, f->hi,
             (f->flags & CS_FIELD_HI_OPEN) ? ')' : ']');
}

const cs_config_entry *cs_cli_sampling_table(size_t *n) {
    if (!n_rows)
        for (size_t r = 0; r < cs_n_sampling_fields; r++) {
            const cs_sampling_field *f = &cs_sampling_fields[r];
            if (!in_params(f)) continue;
            CS_ASSERT(n_rows < CS_CLI_SAMPLING_MAX);
            size_t k = n_rows++;
            rows[k] = f;
            snprintf(names[k], sizeof names[k], "%s", f->name);
            for (char *c = names[k]; *c; c++)
                if (*c == '_') *c = '-';
            snprintf(defs[k], sizeof defs[k], "%g", f->def);
            snprintf(helps[k], sizeof helps[k], "%s", f->help);
            bound(helps[k], sizeof helps[k], f);
            if (f->meaning)
                snprintf(helps[k] + strlen(helps[k]), sizeof helps[k] - strlen(helps[k]), "; %s",
                         f->meaning);
            bool real = f->type == CS_FIELD_FLOAT;
            entries[k] = (cs_config_entry){
                .name = names[k],
                .type = real ? CS_CONFIG_DOUBLE : CS_CONFIG_INT,
                .offset = real ? offsetof(cs_cli_sampling, d) + k * sizeof(double)
                               : offsetof(cs_cli_sampling, i) + k * sizeof(int64_t),
                .def = defs[k],
                .help = helps[k],
            };
            if (f->type == CS_FIELD_INT) { /* an int32_t: the parser bounds it */
                entries[k].min = f->lo;
                entries[k].max = isfinite(f->hi) && f->hi < INT32_MAX ? f->hi : INT32_MAX;
            }
        }
    *n = n_rows;
    return entries;
}

cs_sampling_params cs_cli_sampling_params(const cs_cli_sampling *flags) {
    size_t n;
    cs_cli_sampling_table(&n);
    cs_request q;
    memset(&q, 0, sizeof q);
    q.sampling = cs_sampling_params_default();
    for (size_t k = 0; k < n; k++) {
        const cs_sampling_field *f = rows[k];
        if (f->type == CS_FIELD_U64)
            cs_sampling_field_set_u64(f, &q, (uint64_t)flags->i[k]);
        else
            cs_sampling_field_set(f, &q, f->type == CS_FIELD_FLOAT ? flags->d[k]
                                                                   : (double)flags->i[k]);
    }
    return q.sampling;
}
