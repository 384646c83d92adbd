/* test.h: assertion macros for the C unit tests (libuv test/task.h style):
 * each prints both values with file:line and exits non-zero. A test program
 * returns 0 when all its checks pass; 77 means "skipped" to CTest. */
#ifndef CS_TEST_H
#define CS_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/error.h"

#define TEST_SKIP 77

#define ASSERT_TRUE(x)                                                                             \
    do {                                                                                           \
        if (!(x)) {                                                                                \
            fprintf(stderr, "%s:%d: ASSERT_TRUE(%s) failed\n", __FILE__, __LINE__, #x);            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define ASSERT_EQ_INT(a, b)                                                                        \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_) {                                                                            \
            fprintf(stderr, "%s:%d: ASSERT_EQ_INT(%s, %s) failed: %lld != %lld\n", __FILE__,       \
                    __LINE__, #a, #b, a_, b_);                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define ASSERT_EQ_STR(a, b)                                                                        \
    do {                                                                                           \
        const char *a_ = (a), *b_ = (b);                                                           \
        if (!a_ || !b_ || strcmp(a_, b_) != 0) {                                                   \
            fprintf(stderr, "%s:%d: ASSERT_EQ_STR(%s, %s) failed: \"%s\" != \"%s\"\n", __FILE__,   \
                    __LINE__, #a, #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)");                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                                     \
    do {                                                                                           \
        double a_ = (double)(a), b_ = (double)(b);                                                 \
        if (!(fabs(a_ - b_) <= (tol))) {                                                           \
            fprintf(stderr, "%s:%d: ASSERT_NEAR(%s, %s, %g) failed: %.9g vs %.9g\n", __FILE__,     \
                    __LINE__, #a, #b, (double)(tol), a_, b_);                                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* The error message must mention needle (checks errors name the problem). */
#define ASSERT_MSG_HAS(msg, needle)                                                                \
    do {                                                                                           \
        const char *m_ = (msg), *n_ = (needle);                                                    \
        if (!m_ || !strstr(m_, n_)) {                                                              \
            fprintf(stderr, "%s:%d: message \"%s\" does not mention \"%s\"\n", __FILE__, __LINE__, \
                    m_ ? m_ : "(null)", n_);                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif
