/* http-impl.h: what http.c shares with ops_http.c and the tests only: the
 * defaults, and hooks that are not public API. */
#ifndef CS_HTTP_INTERNAL_H
#define CS_HTTP_INTERNAL_H

#include <stdint.h>

#include "chunkserve/http.h"

/* Default bytes of headers, and of a whole request when max_body_bytes is 0. */
#define CS_HTTP_MAX_REQUEST (16 * 1024)
#define CS_HTTP_IDLE_MS 30000    /* default idle timeout */
#define CS_HTTP_REQUEST_MS 30000 /* default deadline of one request's arrival */

/* Replaces the idle timeout for connections accepted from now on (tests). */
void cs__http_server_set_idle_ms(cs_http_server *s, uint64_t ms);
/* fn(arg) runs when the server's memory is freed (after cs_http_server_close
 * and the handles' close callbacks): how a handler's context made by a
 * wrapper such as cs_http_ops_start lives exactly as long as its server. */
void cs__http_server_on_free(cs_http_server *s, void (*fn)(void *), void *arg);

#endif
