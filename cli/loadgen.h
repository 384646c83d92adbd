/* loadgen.h: what `chunkserve bench serve` sends and when (loadgen.c), with
 * no I/O: seeded arrival processes and workloads, so the same seed gives the
 * same requests at the same offsets, whatever the target does.
 *
 * Arrivals (inter-arrival gaps at a rate of r requests/s):
 *   poisson  exponential gaps, mean 1/r;
 *   gamma    gamma gaps of shape b (--burstiness) and scale 1/(r b): mean 1/r,
 *            coefficient of variation 1/sqrt(b); b < 1 is burstier than
 *            Poisson, b > 1 more regular, b = 1 is Poisson (vLLM's meaning);
 *   fixed    gaps of exactly 1/r;
 *   closed   no schedule: a fixed number of requests in flight.
 * Rate "inf" sends every request at offset 0.
 *
 * Workloads: each request draws a class (by weight), a prompt length and an
 * output length uniformly from the class's ranges (integers, inclusive), and
 * optionally a shared-prefix group. Built in:
 *   chat       prompt 32..512,    output 64..256   (short prompt, long answer)
 *   rag        prompt 3000..8000, output 16..64    (long documents, short answers)
 *   summarize  prompt 1000..4000, output 128..384
 *   mixed      chat 70%, rag 15%, summarize 15%
 * or from a JSONL file, one request per line, drawn uniformly with
 * replacement: {"prompt": "text"} | {"token_ids": [..]} | {"prompt_tokens": N}
 * with "output_tokens": M (or "max_tokens"), optional "group": G (requests of
 * one group share the first --prefix-tokens tokens of a token-length line),
 * optional "tenant": "NAME" and "priority": P (the request's class).
 *
 * Tenants (--tenants NAME=WEIGHT[:WORKLOAD[:PRIORITY]],...): each request
 * draws a tenant by weight (a stream of its own: the lengths of a run are
 * the same with or without tenants when no tenant names a workload); a
 * tenant naming a built-in single-class workload (chat, rag, summarize)
 * draws its lengths from it, and its requests carry its priority (0 when
 * not named).
 * Not here: think times, multi-turn sessions. */
#ifndef CS_CLI_LOADGEN_H
#define CS_CLI_LOADGEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t s[4];
} cs_lg_rng;

/* xoshiro256** seeded through splitmix64: any seed (0 too) is fine. */
void cs_lg_rng_seed(cs_lg_rng *r, uint64_t seed);
uint64_t cs_lg_rng_next(cs_lg_rng *r);
/* Uniform in (0, 1): never 0 or 1. */
double cs_lg_uniform(cs_lg_rng *r);
/* Uniform integer in [lo, hi] (lo <= hi). */
int64_t cs_lg_range(cs_lg_rng *r, int64_t lo, int64_t hi);
double cs_lg_exponential(cs_lg_rng *r, double mean);
/* Gamma(shape, scale), Marsaglia-Tsang (shape < 1 through the boost
 * U^(1/shape)). shape > 0, scale > 0. */
double cs_lg_gamma(cs_lg_rng *r, double shape, double scale);

enum cs_lg_arrival { CS_LG_POISSON, CS_LG_GAMMA, CS_LG_FIXED, CS_LG_CLOSED };

/* "poisson" ... "closed"; CS_EINVAL (message names the choices). */
int cs_lg_arrival_parse(const char *s, enum cs_lg_arrival *out);
const char *cs_lg_arrival_name(enum cs_lg_arrival a);

/* Seconds from the last arrival to the next one at rate (requests/s; INFINITY
 * = 0 s). Not for CS_LG_CLOSED. */
double cs_lg_next_gap(cs_lg_rng *r, enum cs_lg_arrival a, double rate, double burstiness);

enum { CS_LG_MAX_CLASSES = 8 };

typedef struct {
    char name[16];
    double weight;
    int32_t prompt_min, prompt_max, output_min, output_max;
} cs_lg_class;

/* One line of a JSONL dataset. */
typedef struct {
    char *tenant;       /* "tenant" (owned), or NULL */
    int32_t priority;   /* "priority", 0 when absent */
    char *text;         /* "prompt" (owned), or NULL */
    int32_t *ids;       /* "token_ids" (owned), or NULL */
    int32_t n_ids;      /* their count, or "prompt_tokens" */
    int32_t out_tokens; /* "output_tokens" / "max_tokens" */
    int32_t group;      /* "group", -1 = none */
} cs_lg_line;

enum { CS_LG_MAX_TENANTS = 16, CS_LG_TENANT_NAME = 64 };

typedef struct {
    char name[CS_LG_TENANT_NAME + 1];
    double weight;     /* its share of the requests */
    bool has_class;    /* it draws its lengths from cls, not from the workload */
    cs_lg_class cls;
    int32_t priority;
} cs_lg_tenant;

typedef struct {
    char name[64]; /* "chat", ..., or the file's base name */
    cs_lg_class classes[CS_LG_MAX_CLASSES];
    int n_classes;
    cs_lg_line *lines; /* a dataset (then no classes) */
    size_t n_lines;
    cs_lg_tenant tenants[CS_LG_MAX_TENANTS]; /* --tenants (cs_lg_tenants_parse) */
    int n_tenants;
} cs_lg_workload;

/* A built-in name or a path ending in .jsonl. CS_EINVAL with a message that
 * names the line and field for a bad dataset, CS_ENOENT for a missing file,
 * CS_ENOMEM. Free with cs_lg_workload_free (also after a failure). */
int cs_lg_workload_load(const char *spec, cs_lg_workload *w);
void cs_lg_workload_free(cs_lg_workload *w);
/* --tenants into w's tenants (NULL or "": none). CS_EINVAL naming the
 * entry: not NAME=WEIGHT[:WORKLOAD[:PRIORITY]], a name of 0 or more than
 * CS_LG_TENANT_NAME bytes or twice, a weight not in (0, 1e6], a workload not
 * chat, rag or summarize, a priority not in 0..1000000, more than
 * CS_LG_MAX_TENANTS. */
int cs_lg_tenants_parse(const char *spec, cs_lg_workload *w);

/* One request to send. Its prompt: the text, or token ids: the first
 * n_prefix of them shared by its group, the rest its own. */
typedef struct {
    double offset_s;      /* arrival, seconds after the run's start (0 when closed) */
    int cls;              /* class index, or -1 for a dataset line */
    int32_t line;         /* dataset line, or -1 */
    int32_t group;        /* shared-prefix group, or -1 */
    int32_t n_prefix;     /* tokens of the group's prefix at the start of the prompt */
    int32_t prompt_len;   /* tokens (for a text prompt: 0, the server counts) */
    int32_t output_len;   /* max_tokens */
    uint64_t prompt_seed; /* the seed of its own tokens */
    int32_t tenant;       /* index in the workload's tenants, or -1 (a line's own) */
    int32_t priority;     /* its tenant's or line's (0: none) */
} cs_lg_request;

typedef struct {
    enum cs_lg_arrival arrival;
    double rate, burstiness; /* requests/s (INFINITY allowed), gamma shape */
    int32_t prefix_groups;   /* shared-prefix groups; 0 = none */
    int32_t prefix_tokens;   /* the groups' shared prompt head */
    int32_t context_length;  /* the model's: prompt + output is cut to fit; 0 = no cut */
    uint64_t seed;
} cs_lg_params;

/* Fills out[0..n) with the schedule: the same (w, p, n) give the same
 * requests; a sweep's rate points use the same lengths (only the offsets
 * change with the rate). Lengths that do not fit context_length are cut:
 * the output to at most half of it, the prompt to the rest. */
void cs_lg_schedule(const cs_lg_workload *w, const cs_lg_params *p, cs_lg_request *out, size_t n);

/* The prompt ids of q: the group's prefix, then its own tokens, every id in
 * [id_lo, id_hi); both depend on seed too (a sweep passes each point its
 * own, so no point finds another's prompts in the target's prefix cache).
 * ids has room for q->prompt_len. */
void cs_lg_prompt_ids(const cs_lg_request *q, uint64_t seed, int32_t id_lo, int32_t id_hi,
                      int32_t *ids);

#endif
