/* rpc_check.h: the RPC tests' non-fatal checks (each failure is printed with
 * file:line and counted in the including file's `failures`, so a test can
 * still shut its server down and report every problem) and a clock. */
#ifndef CS_RPC_CHECK_H
#define CS_RPC_CHECK_H

#include <stdio.h>
#include <time.h>

#include "chunkserve/rpc.h"

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)
#define CHECK_EQ(a, b)                                                                             \
    do {                                                                                           \
        long long va_ = (long long)(a), vb_ = (long long)(b);                                      \
        if (va_ != vb_) {                                                                          \
            fprintf(stderr, "%s:%d: CHECK_EQ(%s, %s) failed: %lld != %lld\n", __FILE__, __LINE__,  \
                    #a, #b, va_, vb_);                                                             \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)
#define CHECK_CODE(got, want)                                                                      \
    do {                                                                                           \
        int g_ = (got), w_ = (want);                                                               \
        if (g_ != w_) {                                                                            \
            fprintf(stderr, "%s:%d: status %s, want %s\n", __FILE__, __LINE__,                     \
                    cs_rpc_code_name(g_), cs_rpc_code_name(w_));                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

#endif
