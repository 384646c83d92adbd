/* chunkserve/clock.h (base library): the monotonic clock every deadline,
 * timeout and duration is measured on. Not wall time (logs and the router's
 * receipt stamps use the wall clock themselves). */
#ifndef CHUNKSERVE_CLOCK_H
#define CHUNKSERVE_CLOCK_H

#ifdef __cplusplus
extern "C" {
#endif

/* CLOCK_MONOTONIC in seconds. Thread-safe. */
double cs_now(void);

#ifdef __cplusplus
}
#endif
#endif
