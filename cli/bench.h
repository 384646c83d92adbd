/* bench.h: the CLI's benchmark commands. */
#ifndef CS_CLI_BENCH_H
#define CS_CLI_BENCH_H

#include "chunkserve/model.h"

/* chunkserve bench-engine: prints ratios against limits measured in the same run. */
int cs_cli_bench_engine(const cs_model *m, int threads, int prompt_tokens, bool kv_bf16);

/* chunkserve bench-local: mixed chat + long-prompt workload per step budget. */
int cs_cli_bench_local(const cs_model *m, int threads, double duration, const char *budgets,
                       uint64_t seed, const char *out_dir);

/* chunkserve bench serve: argv[first..] are its options; returns the exit
 * status (2 for bad arguments, 1 when the target cannot be measured). */
int cs_cli_bench_serve(int argc, char **argv, int first);

/* chunkserve tune (tune.c): argv[1] is "tune". */
int cs_cli_tune(int argc, char **argv);

#endif
