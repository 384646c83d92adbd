/* prepare.c: Generate requests validated and tokenized on libuv's thread
 * pool (see prepare.h). */
#include "prepare.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/error.h"

typedef struct {
    uv_work_t work;
    const cs_wire_model *wm;
    cs_gen_call *c;
    uint64_t id;
    double t_queued;
    cs_prepare_done_fn done;
    void *arg;
    int rc;
    cs_wire_request w;
    char err[512], field[64];
} job;

/* A pool thread: only the model (read-only) and the request message. */
static void prepare_work(uv_work_t *wk) {
    job *j = wk->data;
    j->rc = cs_wire_generate_request(j->wm, j->c->req, j->id, &j->w);
    const char *kt = j->c->key_tenant, *t = j->c->req->tenant;
    if (!j->rc && kt && t && t[0] && strcmp(t, kt) != 0) {
        cs_wire_request_free(&j->w);
        j->rc = cs_fail_field(CS_EACCES, "tenant",
                              "tenant '%s' is not the API key's (%s): with API keys a "
                              "request's tenant is its key's",
                              t, kt);
    } else if (!j->rc && kt) {
        j->w.r.tenant = kt;
    }
    if (j->rc) {
        snprintf(j->err, sizeof j->err, "%s", cs_last_error());
        snprintf(j->field, sizeof j->field, "%s", cs_last_error_field());
    }
}

static void prepare_after(uv_work_t *wk, int status) {
    job *j = wk->data;
    (void)status; /* never cancelled: uv_cancel is not used */
    j->done(j->arg, j->c, j->id, j->t_queued, j->rc, j->rc ? j->err : NULL, j->field, &j->w);
    free(j);
}

int cs_prepare_generate(uv_loop_t *uv, const cs_wire_model *wm, cs_gen_call *c, uint64_t id,
                        cs_prepare_done_fn done, void *arg) {
    job *j = calloc(1, sizeof *j);
    if (!j) return cs_fail(CS_ENOMEM, "out of memory");
    *j = (job){.wm = wm, .c = c, .id = id, .t_queued = cs_now(), .done = done, .arg = arg};
    j->work.data = j;
    int r = uv_queue_work(uv, &j->work, prepare_work, prepare_after);
    if (r) {
        free(j);
        return cs_fail(CS_ENOMEM, "cannot queue the request's preparation: %s", uv_strerror(r));
    }
    return 0;
}
