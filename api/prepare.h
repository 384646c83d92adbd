/* prepare.h (api/): the CPU work of a request before it is admitted, off the
 * loop thread. Validation, chat rendering and tokenization of a prompt
 * (cs_wire_generate_request for Generate, the same steps for Tokenize) run
 * on libuv's thread pool (uv_queue_work), and the answer comes back on the
 * loop thread: a burst of long prompts never stalls a process's polls,
 * timers and streams (a router that stalls for seconds would declare its
 * workers down). The router and `chunkserve serve` prepare every Generate
 * call this way; the Tokenize handler of generation.c too.
 *
 * The call's request message is read on a pool thread: it must stay valid
 * and unchanged until done runs (a cs_gen_call's does until it is finished,
 * and nobody finishes a call while it is being prepared). */
#ifndef CHUNKSERVE_API_PREPARE_H
#define CHUNKSERVE_API_PREPARE_H

#include <stdint.h>
#include <uv.h>

#include "gen_call.h"
#include "wire.h"

/* Loop thread, once per cs_prepare_generate (t_queued: its cs_now()): rc is
 * cs_wire_generate_request's
 * (0: *w is the request, owned by the callee from here: cs_wire_request_free;
 * else err says why, field what it is about ("" when nothing: see
 * cs_fail_field) and *w is empty). */
typedef void (*cs_prepare_done_fn)(void *arg, cs_gen_call *c, uint64_t id, double t_queued, int rc,
                                   const char *err, const char *field, cs_wire_request *w);

/* Queues c's request (engine request id `id`) for preparation on uv's
 * thread pool; done(arg, ...) follows on the loop thread. The request's
 * tenant is c->key_tenant when set (a request naming another is refused
 * CS_EACCES, field "tenant"), else its own field. 0, or CS_ENOMEM
 * (nothing queued: the caller answers the call). */
int cs_prepare_generate(uv_loop_t *uv, const cs_wire_model *wm, cs_gen_call *c, uint64_t id,
                        cs_prepare_done_fn done, void *arg);

#endif
