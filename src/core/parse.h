/*
 * parse.h - numbers and addresses as people write them (parse.c). Private.
 */
#ifndef FERRY_SRC_CORE_PARSE_H
#define FERRY_SRC_CORE_PARSE_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

/* The number in s with binary suffixes (bytes nonzero: K, M, G, T,
 * "iB"/"B", never a lowercase "b": bits to many, refused; bytes 0: K, M,
 * G), without a range: NULL and *out, or the reason it is not one (static
 * text). */
const char *ferry__parse_number(const char *s, int bytes, uint64_t *out);
/* "127.0.0.1:9400" (an IPv4 address, a port 0..65535) into *sa: 0, or -1 */
int ferry__parse_inet4(const char *addr, struct sockaddr_in *sa);
/* "4K", "1G" or "12345", for messages */
const char *ferry__size_str(uint64_t v, char *buf, size_t n);

#endif
