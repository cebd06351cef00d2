/* Graph cache through the C ABI: the Host path and the error paths. */
#include "xcall_test.h"

struct counter {
  int runs;
  int saw_null_stream;
  uint32_t fail_with;
};

static uint32_t record_work(void *user_data, void *stream) {
  struct counter *c = (struct counter *)user_data;
  c->runs++;
  c->saw_null_stream += stream == NULL;
  return c->fail_with;
}

int main(void) {
  xcall_graph_cache *cache = NULL;
  xcall_graph_cache_config config;
  xcall_buffer buffers[2] = {{0x1000, 256, XCALL_BUFFER_ROLE_IN}, {0x2000, 256, XCALL_BUFFER_ROLE_OUT}};
  xcall_call call = {{XCALL_PLATFORM_HOST, 0, NULL}, 42, 7, buffers, 2, 0};
  struct counter counter = {0, 0, 0};
  uint32_t outcome = 99;
  xcall_graph_stats stats;
  size_t evicted = 99;
  int i;

  /* Configuration: defaults, and bad limits refused with the output untouched. */
  CHECK_STATUS(xcall_graph_cache_config_default(&config), XCALL_STATUS_OK);
  CHECK(config.capacity == 64 && config.max_nodes == 0);
  CHECK(config.policy == XCALL_GRAPH_POLICY_EXEC_UPDATE && config.variants_per_topology == 1);
  config.capacity = 0;
  CHECK_STATUS(xcall_graph_cache_new(&config, &cache), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(cache == NULL);
  CHECK_CONTAINS(xcall_last_error_message(), "capacity");
  config.capacity = 8;
  config.policy = 77;
  CHECK_STATUS(xcall_graph_cache_new(&config, &cache), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "unknown graph policy 77");
  CHECK_STATUS(xcall_graph_cache_new(NULL, NULL), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_graph_cache_new(NULL, &cache), XCALL_STATUS_OK);
  CHECK(cache != NULL);

  /* Host: the record function runs directly with a NULL stream, every time. */
  for (i = 0; i < 3; i++) {
    CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_OK);
    CHECK(outcome == XCALL_GRAPH_OUTCOME_EAGER_HOST);
  }
  CHECK(counter.runs == 3 && counter.saw_null_stream == 3);
  CHECK_STATUS(xcall_graph_cache_stats(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, &stats), XCALL_STATUS_OK);
  CHECK(stats.eager_host == 3 && stats.entries == 0 && stats.captures == 0);

  /* A failing record function: its code comes back in the message. */
  counter.fail_with = 1234;
  outcome = 99;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome),
               XCALL_STATUS_CALLBACK_FAILED);
  CHECK(outcome == 99);
  CHECK_CONTAINS(xcall_last_error_message(), "record_fn returned 1234");
  counter.fail_with = 0;

  /* Error paths: each refused before the record function runs. */
  counter.runs = 0;
  CHECK_STATUS(xcall_graph_cache_execute(NULL, &call, record_work, &counter, &outcome), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_graph_cache_execute(cache, NULL, record_work, &counter, &outcome), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, NULL, &counter, &outcome), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, NULL), XCALL_STATUS_NULL_ARGUMENT);
  call.buffers = NULL;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "buffers is NULL");
  call.num_buffers = 0;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "at least one buffer");
  call.buffers = buffers;
  call.num_buffers = 2;
  call.target.platform = 9;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "unknown platform code 9");
  call.target.platform = XCALL_PLATFORM_HOST;
  call.target.ordinal = 3;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_NO_SUCH_DEVICE);
  call.target.ordinal = 0;
  buffers[1].role = 5;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "buffer 1 has unknown role 5");
  buffers[1].role = XCALL_BUFFER_ROLE_OUT;
  buffers[0].address = UINT64_MAX - 10;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_work, &counter, &outcome), XCALL_STATUS_INVALID_ARGUMENT);
  buffers[0].address = 0x1000;
  CHECK(counter.runs == 0);

  /* Invalidation and clearing. */
  CHECK_STATUS(xcall_graph_cache_invalidate_range(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, 0x1000, 0, &evicted),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(evicted == 99);
  CHECK_STATUS(xcall_graph_cache_invalidate_range(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, 0x1000, 16, &evicted), XCALL_STATUS_OK);
  CHECK(evicted == 0);
  CHECK_STATUS(xcall_graph_cache_clear(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, &evicted), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_graph_cache_clear_all(cache, &evicted), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_graph_cache_clear_all(cache, NULL), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_graph_cache_stats(cache, &(xcall_target){XCALL_PLATFORM_CUDA, 5, NULL}, &stats), XCALL_STATUS_OK);
  CHECK(stats.hits == 0 && stats.entries == 0);

  /* Nothing of the above touched CUDA. */
  CHECK(!xcall_cuda_load_attempted());

  xcall_graph_cache_free(cache);
  xcall_graph_cache_free(NULL);
  return xt_summary("test_graph_cache");
}
