/* chunkserve/assert.h (base library): always-on assertions for broken
 * invariants, i.e. bugs in chunkserve, never bad input or a bad peer (those
 * get an error status). Prints file, line and expression, then aborts. */
#ifndef CHUNKSERVE_ASSERT_H
#define CHUNKSERVE_ASSERT_H

#ifdef __cplusplus
extern "C" {
#endif

#define CS_ASSERT(x)                                                                               \
    do {                                                                                           \
        if (!(x)) cs__assert_fail(__FILE__, __LINE__, #x);                                         \
    } while (0)

#if defined(__GNUC__)
__attribute__((noreturn))
#endif
void cs__assert_fail(const char *file, int line, const char *expr);

#ifdef __cplusplus
}
#endif
#endif
