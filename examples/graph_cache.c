/*
 * graph_cache: a custom call run through xcall's graph cache.
 *
 *   graph_cache [host|cuda]
 *
 * The custom call "fill_copy" copies `in` to `out`, then sets the last
 * TAIL words of `out` to the call's attribute `fill`. Its work is enqueued
 * by one record function. On CUDA the cache captures it into a graph on
 * the first call and replays the graph after that; on Host the record
 * function runs directly each time. The same code serves both.
 *
 * The cache key is exact: (platform, device, target id, attribute digest,
 * buffers). xcall_digest makes the first two numbers from the call's name
 * and attributes.
 */
#include "cuda_driver.h"
#include "example.h"

#include <stdint.h>

enum { WORDS = 1 << 16, TAIL = 256, CALLS = 3 };

struct fill_copy {
  xcall_platform platform;
  struct cuda_driver *cuda;
  uint64_t in, out; /* host pointers or CUdeviceptr */
  uint32_t fill;
};

/* The call's work. On CUDA it only enqueues on `stream`: it may run under
 * stream capture, where nothing may synchronise or allocate. */
static uint32_t record(void *user_data, void *stream) {
  const struct fill_copy *c = user_data;
  if (c->platform == XCALL_PLATFORM_HOST) {
    uint32_t *out = (uint32_t *)(uintptr_t)c->out;
    size_t i;
    memcpy(out, (const void *)(uintptr_t)c->in, WORDS * sizeof(uint32_t));
    for (i = WORDS - TAIL; i < WORDS; i++) out[i] = c->fill;
    return XCALL_STATUS_OK;
  }
  if (c->cuda->cuMemcpyDtoDAsync(c->out, c->in, WORDS * sizeof(uint32_t), stream) != 0 ||
      c->cuda->cuMemsetD32Async(c->out + (WORDS - TAIL) * sizeof(uint32_t), c->fill, TAIL, stream) != 0)
    return XCALL_STATUS_CUDA_DRIVER;
  return XCALL_STATUS_OK;
}

int main(int argc, char **argv) {
  const xcall_platform platform = example_platform(argc, argv);
  const char *name = "example.fill_copy";
  static uint32_t host_in[WORDS], host_out[WORDS], result[WORDS];
  struct cuda_driver cuda = {0};
  struct fill_copy work = {platform, &cuda, 0, 0, 7};
  xcall_target where = {platform, 0, NULL};
  xcall_graph_cache *cache = NULL;
  xcall_graph_stats stats;
  uint64_t target_id = 0, attributes = 0;
  size_t bytes = WORDS * sizeof(uint32_t), evicted = 0, i;
  int call, bad = 0;

  if (platform == XCALL_PLATFORM_CUDA) {
    CUstream stream;
    CUdeviceptr in, out;
    if (cuda_driver_open(&cuda, 0) != 0 || cuda.cuStreamCreate(&stream, 0) != 0 ||
        cuda.cuMemAlloc(&in, bytes) != 0 || cuda.cuMemAlloc(&out, bytes) != 0)
      return 1;
    where.stream = stream;
    work.in = in;
    work.out = out;
  } else {
    work.in = (uint64_t)(uintptr_t)host_in;
    work.out = (uint64_t)(uintptr_t)host_out;
  }

  /* The key's numbers: a digest of the name, and of the attributes. */
  TRY(xcall_digest(name, strlen(name), 0, &target_id));
  TRY(xcall_digest(&work.fill, sizeof work.fill, 0, &attributes));

  TRY(xcall_graph_cache_new(NULL, &cache)); /* default capacity and policy */
  for (call = 0; call < CALLS; call++) {
    /* New input every call: a replayed graph reads it like a fresh run. */
    xcall_buffer buffers[2] = {{work.in, bytes, XCALL_BUFFER_ROLE_IN},
                               {work.out, bytes, XCALL_BUFFER_ROLE_OUT}};
    xcall_call c = {where, target_id, attributes, buffers, 2, 0};
    uint32_t outcome = 0;
    for (i = 0; i < WORDS; i++) host_in[i] = (uint32_t)(i * 2654435761u) + (uint32_t)call;
    if (platform == XCALL_PLATFORM_CUDA && cuda.cuMemcpyHtoD(work.in, host_in, bytes) != 0) return 1;
    TRY(xcall_graph_cache_execute(cache, &c, record, &work, &outcome));
    if (platform == XCALL_PLATFORM_CUDA) {
      if (cuda.cuStreamSynchronize(where.stream) != 0 || cuda.cuMemcpyDtoH(result, work.out, bytes) != 0) return 1;
    } else {
      memcpy(result, host_out, bytes);
    }
    for (i = 0; i < WORDS; i++) bad += result[i] != (i < WORDS - TAIL ? host_in[i] : work.fill);
    printf("call %d: %s, output %s\n", call,
           outcome == XCALL_GRAPH_OUTCOME_CAPTURED     ? "captured"
           : outcome == XCALL_GRAPH_OUTCOME_REPLAYED   ? "replayed"
           : outcome == XCALL_GRAPH_OUTCOME_EAGER_HOST ? "run directly (Host)"
                                                       : "other",
           bad ? "WRONG" : "right");
  }

  TRY(xcall_graph_cache_stats(cache, &where, &stats));
  printf("stats: %llu capture(s), %llu replay(s), %llu run(s) on Host\n", (unsigned long long)stats.captures,
         (unsigned long long)stats.hits, (unsigned long long)stats.eager_host);
  if (platform == XCALL_PLATFORM_CUDA ? stats.captures != 1 || stats.hits != CALLS - 1 : stats.eager_host != CALLS)
    bad++;

  /* Before freeing memory a cached graph uses, evict those graphs. */
  TRY(xcall_graph_cache_invalidate_range(cache, &where, work.out, bytes, &evicted));
  printf("evicted %zu graph(s) before freeing out\n", evicted);
  xcall_graph_cache_free(cache);
  if (platform == XCALL_PLATFORM_CUDA) {
    cuda.cuMemFree(work.in);
    cuda.cuMemFree(work.out);
    cuda.cuStreamDestroy(where.stream);
  }
  return bad ? 1 : 0;
}
