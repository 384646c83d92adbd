/* bench.h: the CLI's benchmark commands. */
#ifndef CS_CLI_BENCH_H
#define CS_CLI_BENCH_H

#include "chunkserve/model.h"

/* chunkserve bench-engine: prints ratios against limits measured in the same run. */
int cs_cli_bench_engine(const cs_model *m, int threads, int prompt_tokens, bool kv_bf16);

/* chunkserve bench-local: mixed chat + long-prompt workload per step budget. */
int cs_cli_bench_local(const cs_model *m, int threads, double duration, const char *budgets,
                       uint64_t seed, const char *out_dir);

#endif
