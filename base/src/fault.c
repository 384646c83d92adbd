/* fault.c: see chunkserve/fault.h. */
#include "chunkserve/fault.h"

#include <errno.h>
#include <execinfo.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <unistd.h>

#ifdef CS_FAULT_INJECTION
static _Atomic long countdown; /* > 0: allocations left before the one that fails */
static _Atomic bool fired;

bool cs_fault_enabled(void) {
    return true;
}

void cs_fault_alloc_arm(long n) {
    atomic_store(&fired, false);
    atomic_store(&countdown, n > 0 ? n : 0);
}

bool cs_fault_alloc_disarm(void) {
    atomic_store(&countdown, 0);
    return atomic_exchange(&fired, false);
}

/* true for the one allocation that is to fail */
static bool fail_now(void) {
    long c = atomic_load_explicit(&countdown, memory_order_relaxed);
    while (c > 0)
        if (atomic_compare_exchange_weak(&countdown, &c, c - 1)) {
            if (c != 1) return false;
            atomic_store(&fired, true);
            /* where, for whoever reads the walk's logs (CS_FAULT_TRACE=1); raw
             * addresses: addr2line -e <binary> turns them into lines */
            if (getenv("CS_FAULT_TRACE")) {
                void *pcs[24];
                int n = backtrace(pcs, 24);
                static const char hdr[] = "fault injection: this allocation fails:\n";
                if (write(2, hdr, sizeof hdr - 1) < 0) return true;
                backtrace_symbols_fd(pcs, n, 2);
            }
            errno = ENOMEM;
            return true;
        }
    return false;
}

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
void *__real_aligned_alloc(size_t a, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
char *__wrap_strdup(const char *s);
char *__wrap_strndup(const char *s, size_t n);
void *__wrap_aligned_alloc(size_t a, size_t n);

void *__wrap_malloc(size_t n) {
    return fail_now() ? NULL : __real_malloc(n);
}
void *__wrap_calloc(size_t k, size_t n) {
    return fail_now() ? NULL : __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n) {
    return fail_now() ? NULL : __real_realloc(p, n);
}
char *__wrap_strdup(const char *s) {
    return fail_now() ? NULL : __real_strdup(s);
}
char *__wrap_strndup(const char *s, size_t n) {
    return fail_now() ? NULL : __real_strndup(s, n);
}
void *__wrap_aligned_alloc(size_t a, size_t n) {
    return fail_now() ? NULL : __real_aligned_alloc(a, n);
}
#else
bool cs_fault_enabled(void) {
    return false;
}
void cs_fault_alloc_arm(long n) {
    (void)n;
}
bool cs_fault_alloc_disarm(void) {
    return false;
}
#endif
