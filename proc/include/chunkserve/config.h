/* chunkserve/config.h: one declarative option table per process drives its
 * command-line flags, its CHUNKSERVE_* environment variables, its --help and
 * (by the same names) the Helm values (architecture.md, operations;
 * redis config.c style).
 *
 * An entry named "max-batched-tokens" is the flag --max-batched-tokens (also
 * --max-batched-tokens=V) and the variable CHUNKSERVE_MAX_BATCHED_TOKENS.
 * Precedence: default < environment < command line. Values are checked
 * (numbers fully parsed and within [min, max]); a bad one is an error naming
 * the flag or variable, the value and what is allowed. An empty variable
 * counts as unset; a bad variable is an error even when a flag overrides it.
 * A set CHUNKSERVE_* variable that no chunkserve process reads is an error
 * naming the nearest valid one (a typo must not start with the default);
 * one that is another chunkserve process's flag is left alone.
 * A boolean flag never takes the next argument (--chat=false, not --chat
 * false); "--no-x" negates a boolean x unless "no-x" is itself an entry.
 * Not here: config files, reloading at run time. */
#ifndef CHUNKSERVE_CONFIG_H
#define CHUNKSERVE_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum cs_config_type {
    CS_CONFIG_STR,    /* const char * (points into argv, environ or the default) */
    CS_CONFIG_INT,    /* int64_t, within [min, max] */
    CS_CONFIG_BOOL,   /* bool: --name, --name=true|false|1|0, --no-name; env 1/0/true/false */
    CS_CONFIG_DOUBLE, /* double, within [min, max] */
    CS_CONFIG_SECRET, /* const char *, a comma-separated list of secrets: never printed
                       * (dump: "(set)"); the flag repeats (--api-key A --api-key B is
                       * "A,B", replacing the variable's list) */
};

typedef struct {
    const char *name; /* "max-batched-tokens" */
    enum cs_config_type type;
    size_t offset;    /* of the field in the options struct */
    const char *def;  /* default as text; NULL = unset (STR: NULL) */
    const char *help; /* one line */
    double min, max;  /* INT / DOUBLE bounds, inclusive; both 0 = unbounded */
} cs_config_entry;

/* A process's table is joined from its modules' own tables (the RPC
 * server's, TLS's, the OpenAI door's, the worker shell's, the role's):
 * each module defines its entries once, relative to its own struct, and the
 * process says where that struct sits in its options and which defaults it
 * changes. */
typedef struct {
    const cs_config_entry *entries;
    size_t n;
    size_t base; /* offsetof the module's struct in the process's options */
} cs_config_part;

/* A default the process changes: the entry's name and its new default. */
typedef struct {
    const char *name, *def;
} cs_config_default;

/* The parts' entries in order, offsets moved by their part's base, the
 * defaults replaced as defs say: one array for the functions below (free()
 * it). CS_EINVAL when two entries share a name or a default names none
 * (a programming error: the message says which), CS_ENOMEM. */
int cs_config_join(const cs_config_part *parts, size_t n_parts, const cs_config_default *defs,
                   size_t n_defs, cs_config_entry **out, size_t *n_out);

/* Fills opts from the table: defaults, then CHUNKSERVE_* variables, then
 * argv[first..argc); writes every entry's field. -h/--help anywhere in argv
 * prints the help on stdout and returns 1 (the caller exits 0); so does
 * --help-json, with the table as JSON (cs_config_print_json). Returns 0 on success, CS_EINVAL
 * with cs_last_error() set (unknown flag or CHUNKSERVE_* variable, missing value, bad number, out
 * of range, stray argument).
 * prog and summary head the help text. */
int cs_config_parse(const cs_config_entry *table, size_t n, void *opts, int argc, char **argv,
                    int first, const char *prog, const char *summary);

/* The help text on f (a FILE *): "usage: PROG [options]", the summary, then
 * one line per entry: "  --name VALUE   help (default X; env CHUNKSERVE_NAME)". */
void cs_config_print_help(const cs_config_entry *table, size_t n, const char *prog,
                          const char *summary, void *f);

/* The table as a JSON array on f (a FILE *), one object per entry:
 * {"name", "env", "type" (string|int|bool|double), "default" (text or
 * null), "help", and "min"/"max" when bounded}. Tools read it: the Helm
 * chart's tests prove that its config: keys are real flags. */
void cs_config_print_json(const cs_config_entry *table, size_t n, void *f);

/* Prints "name = value" for every entry on f (a FILE *), for start-up logs. */
void cs_config_dump(const cs_config_entry *table, size_t n, const void *opts, void *f);

#ifdef __cplusplus
}
#endif
#endif
