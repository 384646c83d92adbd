/* fault.h: allocation-failure injection (SQLite's fault-sim, for processes).
 * Built only with -DCS_FAULT_INJECTION=ON (the ASan test build): the linker
 * wraps malloc, calloc, realloc, strdup, strndup and aligned_alloc in every
 * object of ours (-Wl,--wrap; the shared libraries, gRPC's included, keep
 * the real ones), and once armed the Nth allocation after arming fails
 * (NULL, errno ENOMEM), once. The router arms it for a Generate call that
 * carries x-chunkserve-fault-alloc: N and disarms it when that request ends,
 * so a test can walk N over every allocation of a request's life
 * (tests/py/test_router.py). Without the option these are no-ops. */
#ifndef CHUNKSERVE_FAULT_H
#define CHUNKSERVE_FAULT_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Whether the build has the wrappers. */
bool cs_fault_enabled(void);
/* The nth allocation from now (n >= 1) fails; 0 disarms. */
void cs_fault_alloc_arm(long n);
/* Disarms; true when the armed failure happened since cs_fault_alloc_arm. */
bool cs_fault_alloc_disarm(void);

#ifdef __cplusplus
}
#endif
#endif
