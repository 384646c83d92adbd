/* spec_gate.c: speculation's measured gate (see spec_gate.h). */
#include "spec_gate.h"

#include <math.h>

/* A batch size's slot (n >= CS__SPEC_GATE_MIN_DECODES): up to 24 their
 * own, then the ranges 25-32, 33-48, 49-64, 65-96, 97-128, 129-192,
 * 193-256 and above. */
static const int32_t upper[] = {32, 48, 64, 96, 128, 192, 256};
enum { OWN = 24 - CS__SPEC_GATE_MIN_DECODES + 1 };
_Static_assert(OWN + sizeof upper / sizeof upper[0] + 1 == CS__SPEC_GATE_SIZES,
               "a slot for each size and range");

static int32_t slot(int32_t n) {
    if (n <= 24) return n - CS__SPEC_GATE_MIN_DECODES;
    for (int32_t i = 0; i < (int32_t)(sizeof upper / sizeof upper[0]); i++)
        if (n <= upper[i]) return OWN + i;
    return CS__SPEC_GATE_SIZES - 1;
}

/* Steps between retries of the worse side: a retry costs its step's time
 * times the gap (in steps of the better side); they come so rarely that
 * together they cost CS__SPEC_GATE_COST of the time. */
static int32_t retry_after(const cs__spec_size *z, int better) {
    const double hi = z->rate[better];
    const double gap = hi > 0 ? (hi - z->rate[!better]) / hi : 0;
    const double cost = z->secs[better] > 0 ? z->secs[!better] / z->secs[better] * gap : 0;
    const double n = cost / CS__SPEC_GATE_COST;
    return n < CS__SPEC_GATE_RETRY_MIN   ? CS__SPEC_GATE_RETRY_MIN
           : n > CS__SPEC_GATE_RETRY_MAX ? CS__SPEC_GATE_RETRY_MAX
                                         : (int32_t)n;
}

bool cs__spec_gate_allows(const cs__spec_gate *g, int32_t n_decode, bool decode_only) {
    if (n_decode < CS__SPEC_GATE_MIN_DECODES) return true;
    const cs__spec_size *z = &g->size[slot(n_decode)];
    if (z->seen[1] < CS__SPEC_GATE_SEEN) return true;
    if (z->seen[0] < CS__SPEC_GATE_SEEN) return !decode_only;
    const int better = z->rate[1] > z->rate[0];
    /* the other side once its last measurement is a retry's steps old */
    return decode_only && z->since[!better] >= retry_after(z, better) ? !better : better;
}

void cs__spec_gate_observe(cs__spec_gate *g, int32_t n_decode, bool drafted, int32_t emitted,
                           double seconds) {
    if (n_decode < CS__SPEC_GATE_MIN_DECODES || emitted < 1 || !(seconds > 0)) return;
    cs__spec_size *z = &g->size[slot(n_decode)];
    const int d = drafted;
    /* the mean of the first measurements, then a moving average over about
     * the last four; one taken 16 steps or more after its side's last (a
     * retry) counts for half: the workload may have turned since, and a
     * side measured once in many steps would follow it too slowly */
    if (z->seen[d] < 1000) z->seen[d]++;
    const double a = z->seen[d] < 4                         ? 1.0 / z->seen[d]
                     : z->since[d] >= CS__SPEC_GATE_RETRY_MIN ? 1.0 / 2
                                                              : 1.0 / 4;
    z->rate[d] += a * (emitted / seconds - z->rate[d]);
    z->secs[d] += a * (seconds - z->secs[d]);
    z->since[d] = 0;
    if (z->since[!d] < INT32_MAX) z->since[!d]++;
}
