/* http-impl.h: knobs of the operator HTTP server (http.c) that only the
 * tests turn. Not public API. */
#ifndef CS_HTTP_INTERNAL_H
#define CS_HTTP_INTERNAL_H

#include <stdint.h>

#include "chunkserve/http.h"

#define CS_HTTP_MAX_REQUEST (16 * 1024) /* bytes of one request, request line to end of body */
#define CS_HTTP_IDLE_MS 30000           /* an idle connection is closed after this */

/* Replaces CS_HTTP_IDLE_MS for connections accepted from now on (tests). */
void cs__http_server_set_idle_ms(cs_http_server *s, uint64_t ms);

#endif
