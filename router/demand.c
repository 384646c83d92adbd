/* demand.c: the leading autoscaling signal (demand.h). */
#include "demand.h"

#include <math.h>

void cs_rate_add(cs_rate *r, double x, double now, double tau) {
    if (r->t0 == 0) r->t0 = r->t = now;
    if (now > r->t) r->v *= exp(-(now - r->t) / tau), r->t = now;
    r->v += x;
}

double cs_rate_get(const cs_rate *r, double now, double tau) {
    if (r->t0 == 0) return 0;
    double v = now > r->t ? r->v * exp(-(now - r->t) / tau) : r->v;
    /* the decayed sum of a steady rate x over an age a is x tau (1 - e^(-a/tau)) */
    double age = now - r->t0, least = tau < 5 ? tau : 5; /* read as at least min(tau, 5 s) old */
    return v / (tau * (1 - exp(-(age > least ? age : least) / tau)));
}

double cs_smooth_add(cs_smooth *s, double x, double now, double tau) {
    if (!(x > 0)) return s->t = 0, s->v = 0;
    if (s->t == 0) return s->t = now, s->v = x;
    if (now > s->t) s->v += (x - s->v) * (1 - exp(-(now - s->t) / tau)), s->t = now;
    return s->v;
}

static double share(double rate, double cap) {
    return cap > 0 ? rate / cap : 0;
}

double cs_demand_prefill_replicas(const cs_demand *d) {
    double u = d->utilization > 0 && d->utilization <= 1 ? d->utilization : 1;
    double drain = d->drain_s > 0 ? d->drain_s : 1;
    return share(d->prompt_rate, d->prefill_cap) / u +
           share(d->prompt_backlog / drain, d->prefill_cap);
}

double cs_demand_decode_replicas(const cs_demand *d) {
    double u = d->utilization > 0 && d->utilization <= 1 ? d->utilization : 1;
    double drain = d->drain_s > 0 ? d->drain_s : 1;
    return (share(d->output_rate, d->decode_cap) + share(d->local_rate, d->decode_prefill_cap)) /
               u +
           share(d->local_backlog / drain, d->decode_prefill_cap);
}
