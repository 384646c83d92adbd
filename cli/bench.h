/* bench.h: the CLI's benchmark commands. */
#ifndef CS_CLI_BENCH_H
#define CS_CLI_BENCH_H

#include "chunkserve/model.h"

/* chunkserve bench-engine: prints ratios against limits measured in the same run. */
int cs_cli_bench_engine(const cs_model *m, int threads, int prompt_tokens);

#endif
