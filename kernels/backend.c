/* backend.c: the backend registry: the only place that knows which backends
 * exist. Until the CUDA backend lands, every machine gets the CPU one. */
#include <stdlib.h>

#include "backend.h"
#include "util.h"

int cs_backend_init(const cs_model *m, int n_threads, cs_backend **out) {
    int r = cs_backend_cpu_init(m, n_threads, out);
    if (r == 0) CS_LOGI("backend: %s", (*out)->iface->name);
    return r;
}

void cs_backend_free(cs_backend *b) {
    if (!b) return;
    b->iface->free(b->ctx);
    free(b);
}
