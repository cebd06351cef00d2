/*
 * What every example shares: TRY (stop with xcall's own error message when
 * a call fails) and the platform named on the command line.
 */
#ifndef XCALL_EXAMPLE_H
#define XCALL_EXAMPLE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xcall.h"

/* Runs an xcall call; on any status but OK prints the status's name and
 * the calling thread's error message, and exits with 1. */
#define TRY(call)                                                             \
  do {                                                                        \
    xcall_status try_status_ = (call);                                        \
    if (try_status_ != XCALL_STATUS_OK) {                                     \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,      \
              xcall_status_name(try_status_), xcall_last_error_message());    \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

/* "host" (the default) or "cuda" from argv[1]; exits with 2 on anything
 * else. */
static inline xcall_platform example_platform(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "host") == 0) return XCALL_PLATFORM_HOST;
  if (strcmp(argv[1], "cuda") == 0) return XCALL_PLATFORM_CUDA;
  fprintf(stderr, "usage: %s [host|cuda]\n", argv[0]);
  exit(2);
}

#endif
