/* chunkserve/sampling_fields.h: one definition per scalar sampling field.
 * Each row says a field's name (the proto's SamplingParams field, which the
 * gRPC door reads by this name through protobuf-c's descriptor), its type,
 * its bounds, its default, the OpenAI request key that sets it, and where it
 * lands in a cs_request. Every door walks this table: the engine's check
 * (cs_sampling_params_check), the gRPC door's copy and check (api/wire.c)
 * and the OpenAI door's parse (openai/request.c); an error names the field
 * (cs_fail_field). A new scalar field is one row here, one proto field and
 * the code that uses it; the lists (stop strings and ids, logit_bias) and
 * the structured output have their own shapes and their own code in the
 * doors. */
#ifndef CHUNKSERVE_SAMPLING_FIELDS_H
#define CHUNKSERVE_SAMPLING_FIELDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/sched.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CS_FIELD_FLOAT, /* float; finite */
    CS_FIELD_INT,   /* int32_t */
    CS_FIELD_U64,   /* uint64_t, any value (the seed) */
    CS_FIELD_BOOL,  /* bool in cs_request, protobuf_c_boolean in the proto */
} cs_field_type;

enum {
    CS_FIELD_LO_OPEN = 1 << 0,    /* lo itself is out of bounds */
    CS_FIELD_HI_OPEN = 1 << 1,    /* hi itself is out of bounds */
    CS_FIELD_ZERO_UNSET = 1 << 2, /* the proto's 0 means "not set": def applies */
    CS_FIELD_NEGATE = 1 << 3,     /* a bool stored negated in cs_request */
    CS_FIELD_OFF_MINUS1 = 1 << 4, /* the OpenAI door also takes -1 for "off" (vLLM's) */
};

typedef struct {
    const char *name;   /* the proto field in SamplingParams */
    const char *openai; /* the OpenAI/vLLM request key read by the table;
                           NULL: the door reads it in its own shape (max_tokens'
                           defaults and alias, logprobs' two forms, the seed) */
    cs_field_type type;
    double lo, hi;       /* bounds (INT, FLOAT); hi = INFINITY: none */
    double def;          /* the value when not set */
    unsigned flags;      /* CS_FIELD_* */
    const char *help;    /* what the field does, one line (the CLI's --help) */
    const char *meaning; /* what the default or 0 means, for messages ("1 = off"); NULL */
    const char *needs;   /* another (BOOL) field this one needs set when nonzero */
    size_t off;          /* where in cs_request (offsetof) */
} cs_sampling_field;

extern const cs_sampling_field cs_sampling_fields[];
extern const size_t cs_n_sampling_fields;

/* The row named name, or NULL. */
const cs_sampling_field *cs_sampling_field_find(const char *name);

/* 0, or CS_EINVAL naming the field (cs_fail_field with prefix + name, e.g.
 * "sampling.top_p") when v is outside f's bounds or not finite. */
int cs_sampling_field_check(const cs_sampling_field *f, double v, const char *prefix);

/* The field's value in q as a double, in the proto's sense (U64: converted;
 * BOOL: 0/1, CS_FIELD_NEGATE undone), and its setter (BOOL: v != 0). */
double cs_sampling_field_get(const cs_sampling_field *f, const cs_request *q);
void cs_sampling_field_set(const cs_sampling_field *f, cs_request *q, double v);
/* The seed's exact value (U64 rows). */
void cs_sampling_field_set_u64(const cs_sampling_field *f, cs_request *q, uint64_t v);

#ifdef __cplusplus
}
#endif
#endif
