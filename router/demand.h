/* demand.h: the leading autoscaling signal (architecture.md, operations):
 * how many replicas each pool needs for the traffic this router sends it,
 * from token rates, not queues. Queue depth lags: it grows only once a pool
 * is already short, and shrinks only after the burst is served. The demand
 * is known as requests arrive:
 *   prefill: prompt tokens/s bound for the prefill pool, over one prefill
 *            replica's prompt rate at its step-time target (its TTFT budget);
 *   decode:  output tokens/s relayed, over one decode replica's decode rate
 *            at its step-time target (its ITL target), plus prompt tokens/s
 *            prefilled on decode workers over their prompt rate;
 * each divided by the utilization a replica may run at; plus, so that a
 * burst already queued is served too, the prompt tokens of this router's
 * requests still waiting for their first token over what a replica
 * computes in --autoscale-drain-s (the router's own: a sum over routers
 * counts each once). Rates are
 * exponentially decayed counters (a window of tau seconds; until min(tau,
 * 5 s) have passed the sum is read as if they had, so a fresh router reads
 * neither a lull nor one request as a flood); prompt tokens count when a
 * request arrives (before any queue: the leading part), output tokens as
 * they are relayed;
 * capacities are the mean over usable workers that report one (a worker
 * that has computed no prompt yet reports 0 and is left out; one whose step
 * model is not fitted yet reports its measured rate), smoothed over tau
 * (cs_smooth: one poll's dip, a worker refitting its step model while its
 * cores are busy, is not a lack of replicas). The value is a count from the pool's total load: at
 * scale-down the survivors take load / (N - 1) each, which the count
 * already is, so an autoscaler targeting it (AverageValue 1, summed over
 * routers) never removes a replica the others cannot absorb. Pure: tested
 * in tests/unit/test_router_place.c. */
#ifndef CS_ROUTER_DEMAND_H
#define CS_ROUTER_DEMAND_H

#include <stdbool.h>

typedef struct {
    double v;      /* decayed sum */
    double t;      /* when v was last decayed */
    double t0;     /* the first event (0: none yet) */
} cs_rate;

/* x more at time now (seconds, monotonic). */
void cs_rate_add(cs_rate *r, double x, double now, double tau);
/* The rate (per second) at time now: 0 before any event. */
double cs_rate_get(const cs_rate *r, double now, double tau);

/* An exponentially weighted mean of a value sampled at irregular times (a
 * time constant of tau seconds; each sample held until the next). */
typedef struct {
    double v; /* the mean */
    double t; /* its last sample (0: none; a sample of 0, unknown, restarts it) */
} cs_smooth;

/* Takes sample x at time now; returns the mean (x itself first). */
double cs_smooth_add(cs_smooth *s, double x, double now, double tau);

typedef struct {
    double prompt_rate;        /* prompt tokens/s bound for the prefill pool */
    double output_rate;        /* output tokens/s relayed from the decode pool */
    double local_rate;         /* prompt tokens/s prefilled on decode workers */
    double prefill_cap;        /* a prefill replica's prompt tokens/s (0: unknown) */
    double decode_cap;         /* a decode replica's output tokens/s (0: unknown) */
    double decode_prefill_cap; /* a decode replica's prompt tokens/s (0: unknown) */
    double utilization;        /* (0, 1]: the share of its capacity a replica may use */
    double prompt_backlog;     /* prompt tokens bound for the prefill pool, no first token yet */
    double local_backlog;      /* prompt tokens to prefill on decode workers, likewise */
    double drain_s;            /* the time a backlog is to be served in (> 0) */
} cs_demand;

/* Replicas the prefill / decode pool needs (>= 0; a rate whose capacity is
 * unknown counts nothing). */
double cs_demand_prefill_replicas(const cs_demand *d);
double cs_demand_decode_replicas(const cs_demand *d);

#endif
