/* fuzz_check.h: checks the model-file and tokenizer drivers share. */
#ifndef CS_FUZZ_CHECK_H
#define CS_FUZZ_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "chunkserve/error.h"

/* A refusal must name its cause: a negative status with an empty
 * cs_last_error() aborts (the fuzzer reports it). CS_FUZZ_VERBOSE=1 prints
 * every status on stderr (to see how far a seed gets). */
static void fuzz_check_refusal(const char *driver, int r) {
    const char *e = cs_last_error();
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("CS_FUZZ_VERBOSE") && *getenv("CS_FUZZ_VERBOSE") == '1';
    if (verbose) fprintf(stderr, "[%d %s]\n", r, r ? e : "ok");
    if (r < 0 && (!e || !e[0])) {
        fprintf(stderr, "%s: status %d without a message\n", driver, r);
        abort();
    }
}

#endif
