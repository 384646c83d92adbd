/* chunkserve/log.h (base library): one line per event on stderr, level-checked
 * before the arguments are evaluated:
 *   "HH:MM:SS.mmm L ROLE file.c:LINE message" (UTC; L = E, W, I or D).
 * The level is per process, the role per thread ("router", "engine", ...). */
#ifndef CHUNKSERVE_LOG_H
#define CHUNKSERVE_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

enum cs_log_level { CS_LOG_ERROR = 0, CS_LOG_WARN, CS_LOG_INFO, CS_LOG_DEBUG };

/* Default CS_LOG_INFO. Set it before other threads start. */
void cs_log_set_level(int level);
/* The current level (for "is debug on?" decisions that cost something). */
int cs_log_level(void);
/* The calling thread's role; role must outlive the thread's logging. */
void cs_log_set_role(const char *role);

#define CS_LOGE(...) CS_LOG(CS_LOG_ERROR, __VA_ARGS__)
#define CS_LOGW(...) CS_LOG(CS_LOG_WARN, __VA_ARGS__)
#define CS_LOGI(...) CS_LOG(CS_LOG_INFO, __VA_ARGS__)
#define CS_LOGD(...) CS_LOG(CS_LOG_DEBUG, __VA_ARGS__)

/* The macros' internals. */
extern int cs__log_level;
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
void cs__log(int level, const char *file, int line, const char *fmt, ...);
#define CS_LOG(lvl, ...)                                                                           \
    do {                                                                                           \
        if ((lvl) <= cs__log_level) cs__log((lvl), __FILE__, __LINE__, __VA_ARGS__);               \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
