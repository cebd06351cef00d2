/* Logging through the C ABI: XCALL_LOG read on the first call, lines on
 * stderr; xcall_log_configure with a callback, filters and bad input. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <unistd.h>

#include "xcall_test.h"

struct lines {
  int count;
  xcall_log_level level;
  char target[128];
  char message[512];
};

static void collect(void *user_data, xcall_log_level level, const char *target, const char *message) {
  struct lines *l = (struct lines *)user_data;
  l->count++;
  l->level = level;
  snprintf(l->target, sizeof l->target, "%s", target);
  snprintf(l->message, sizeof l->message, "%s", message);
}

static uint32_t no_work(void *user_data, void *stream) {
  (void)user_data;
  (void)stream;
  return 0;
}

static void host_call(xcall_graph_cache *cache) {
  xcall_buffer buffer = {0x1000, 64, XCALL_BUFFER_ROLE_IN_OUT};
  xcall_call call = {{XCALL_PLATFORM_HOST, 0, NULL}, 0x42, 7, &buffer, 1, 0};
  uint32_t outcome = 99;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, no_work, NULL, &outcome), XCALL_STATUS_OK);
  CHECK(outcome == XCALL_GRAPH_OUTCOME_EAGER_HOST);
}

int main(void) {
  xcall_graph_cache *cache = NULL;
  struct lines lines;
  char captured[4096];
  FILE *tmp = tmpfile();
  int saved_stderr = dup(2);
  size_t n;

  /* XCALL_LOG is read on the first call: the lines go to stderr, here a
   * file, one per event. */
  CHECK(setenv("XCALL_LOG", "xcall_graph=trace", 1) == 0);
  CHECK(tmp != NULL && saved_stderr >= 0);
  fflush(stderr);
  CHECK(dup2(fileno(tmp), 2) == 2);
  CHECK_STATUS(xcall_graph_cache_new(NULL, &cache), XCALL_STATUS_OK);
  host_call(cache);
  fflush(stderr);
  CHECK(dup2(saved_stderr, 2) == 2);
  rewind(tmp);
  n = fread(captured, 1, sizeof captured - 1, tmp);
  captured[n] = '\0';
  CHECK_CONTAINS(captured, "[xcall +");
  CHECK_CONTAINS(captured, " TRACE xcall_graph::cache] eager_host device=host:0 target_id=0x42 attributes=0x7 buffers=1\n");

  /* A callback receives each line; the filter decides which. */
  memset(&lines, 0, sizeof lines);
  CHECK_STATUS(xcall_log_configure("xcall_graph=trace", collect, &lines), XCALL_STATUS_OK);
  host_call(cache);
  CHECK(lines.count == 1);
  CHECK(lines.level == XCALL_LOG_LEVEL_TRACE);
  CHECK_STR_EQ(lines.target, "xcall_graph::cache");
  CHECK_STR_EQ(lines.message, "eager_host device=host:0 target_id=0x42 attributes=0x7 buffers=1");

  /* A Host run is a hot path: logged at trace only. */
  CHECK_STATUS(xcall_log_configure("xcall_graph=debug", collect, &lines), XCALL_STATUS_OK);
  host_call(cache);
  CHECK(lines.count == 1);

  /* NULL keeps the filter and "" turns logging off. */
  CHECK_STATUS(xcall_log_configure("trace", collect, &lines), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_log_configure(NULL, collect, &lines), XCALL_STATUS_OK);
  host_call(cache);
  CHECK(lines.count == 2);
  CHECK_STATUS(xcall_log_configure("", collect, &lines), XCALL_STATUS_OK);
  host_call(cache);
  CHECK(lines.count == 2);

  /* Bad input: a filter that does not parse is refused by name, and the
   * filter and callback in force stay. */
  CHECK_STATUS(xcall_log_configure("trace", collect, &lines), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_log_configure("xcall_graph=loud", NULL, NULL), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "xcall_graph=loud");
  host_call(cache);
  CHECK(lines.count == 3);

  xcall_graph_cache_free(cache);
  fclose(tmp);
  close(saved_stderr);
  return xt_summary("test_log");
}
