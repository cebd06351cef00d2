/*
 * Tiny harness for xcall's C tests: CHECK macros, a summary line
 * ("<name>: N passed, N failed") and a non-zero exit on failure.
 */
#ifndef XCALL_TEST_H
#define XCALL_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xcall.h"

static int xt_passed;
static int xt_failed;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (cond) {                                                                \
      xt_passed++;                                                             \
    } else {                                                                   \
      xt_failed++;                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

/* Checks that `call` returns `expected`; on mismatch prints both names and
 * xcall's last error message. */
#define CHECK_STATUS(call, expected)                                           \
  do {                                                                         \
    xcall_status xt_got_ = (call);                                             \
    if (xt_got_ == (xcall_status)(expected)) {                                 \
      xt_passed++;                                                             \
    } else {                                                                   \
      xt_failed++;                                                             \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__,   \
              __LINE__, #call, xcall_status_name(xt_got_),                     \
              xcall_status_name(expected), xcall_last_error_message());        \
    }                                                                          \
  } while (0)

/* A check inside a PE thread: needs `p`, a pointer to a struct with
 * `uint32_t rank` and `int failures` (counted per thread, checked by the
 * main thread after join). */
#define PE_EXPECT(cond)                                                        \
  do {                                                                         \
    if (!(cond)) {                                                             \
      p->failures++;                                                           \
      fprintf(stderr, "rank %u: %s:%d: %s (%s)\n", p->rank, __FILE__,          \
              __LINE__, #cond, xcall_last_error_message());                    \
    }                                                                          \
  } while (0)

#define CHECK_STR_EQ(a, b) CHECK(strcmp((a), (b)) == 0)
#define CHECK_CONTAINS(haystack, needle) CHECK(strstr((haystack), (needle)) != NULL)

/* A tensor of rank 1 or 2 over `data` (dims beyond `rank` unused). */
static inline xcall_tensor xt_tensor(void *data, xcall_dtype dtype, uint32_t rank, int64_t d0, int64_t d1) {
  xcall_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.rank = rank;
  t.dims[0] = d0;
  t.dims[1] = d1;
  return t;
}

/* Whether XCALL_REQUIRE_CUDA=1: a missing GPU is then a failure, not a skip. */
static inline int xt_cuda_required(void) {
  const char *v = getenv("XCALL_REQUIRE_CUDA");
  return v != NULL && strcmp(v, "1") == 0;
}

/* Prints the summary line and returns the process exit code. */
static inline int xt_summary(const char *name) {
  printf("%s: %d passed, %d failed\n", name, xt_passed, xt_failed);
  return xt_failed == 0 ? 0 : 1;
}

#endif /* XCALL_TEST_H */
