/*
 * env.h - the library's own environment variables that no handle's
 * options carry (env.c). Not installed.
 */
#ifndef FERRY_SRC_CORE_ENV_H
#define FERRY_SRC_CORE_ENV_H

/* FERRY_LOG's value v (NULL: unset): its level, FERRY_LOG_WARN when v is
 * unset, empty or no level; *bad (may be NULL) 1 for a value set and not
 * taken */
int ferry__env_log_level(const char *v, int *bad);
/* FERRY_KV_DIRECT's value v: 0 never, 1 into any aligned buffer, 2 (unset,
 * empty or anything else) only into huge pages; *bad as above */
int ferry__env_kv_direct(const char *v, int *bad);
/* FERRY_KV_READ_DEPTH's value v: 1..32, else dflt; *bad as above */
unsigned ferry__env_read_depth(const char *v, unsigned dflt, int *bad);
/* warn now of every variable above whose value is not taken, one line
 * each naming it, its value, what it accepts and what is used instead;
 * returns how many */
int ferry__env_warn(void);
/* ferry__env_warn, once per process (every open calls it) */
void ferry__env_check(void);

#endif
