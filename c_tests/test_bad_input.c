/*
 * Bad input through the C ABI, on Host: NULL, zero, huge, overflowing,
 * wrong-enum, wrong-dtype, aliasing, freed and foreign handles, and a
 * world whose peer left. Each case asserts the exact status, a message
 * that names what is wrong, and that no output byte changed. The process
 * must neither abort nor touch memory that is not its own: cargo test also
 * builds this file with -fsanitize=address,undefined.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "xcall_test.h"

/* The status and that the last error message contains `needle`. */
#define CHECK_ERR(call, expected, needle)                                      \
  do {                                                                         \
    CHECK_STATUS(call, expected);                                              \
    if (strstr(xcall_last_error_message(), (needle)) == NULL) {                \
      xt_failed++;                                                             \
      fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__,        \
              __LINE__, xcall_last_error_message(), (needle));                 \
    } else {                                                                   \
      xt_passed++;                                                             \
    }                                                                          \
  } while (0)

static int all_bytes(const void *p, size_t n, unsigned char v) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != v) return 0;
  return 1;
}

static void core_calls(void) {
  size_t n = 77;
  CHECK_ERR(xcall_device_count(9, &n), XCALL_STATUS_INVALID_ARGUMENT, "unknown platform code 9");
  CHECK_ERR(xcall_device_count(XCALL_PLATFORM_HOST, NULL), XCALL_STATUS_NULL_ARGUMENT, "out_count");
  CHECK_ERR(xcall_dtype_size(1000, &n), XCALL_STATUS_INVALID_ARGUMENT, "unknown dtype code 1000");
  CHECK(n == 77);
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_PEER_FAILED), "XCALL_STATUS_PEER_FAILED");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_INVALID_HANDLE), "XCALL_STATUS_INVALID_HANDLE");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_LIMIT), "XCALL_STATUS_LIMIT");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_BUSY), "XCALL_STATUS_BUSY");
  CHECK(xcall_dtype_name(1000) == NULL);
}

static uint32_t record_ok(void *user_data, void *stream) {
  (void)stream;
  ++*(int *)user_data;
  return XCALL_STATUS_OK;
}

static void graph_cache(void) {
  xcall_graph_cache_config c;
  xcall_graph_cache *cache = (xcall_graph_cache *)0x1;
  CHECK_STATUS(xcall_graph_cache_config_default(&c), XCALL_STATUS_OK);
  c.capacity = 0;
  CHECK_ERR(xcall_graph_cache_new(&c, &cache), XCALL_STATUS_INVALID_ARGUMENT, "capacity");
  CHECK(cache == (xcall_graph_cache *)0x1);
  c.capacity = 4;
  c.policy = 77;
  CHECK_ERR(xcall_graph_cache_new(&c, &cache), XCALL_STATUS_INVALID_ARGUMENT, "unknown graph policy 77");
  CHECK_STATUS(xcall_graph_cache_new(NULL, &cache), XCALL_STATUS_OK);

  /* One rule for a device in every entry point: Host has host:0 only. */
  size_t evicted = 55;
  xcall_graph_stats stats;
  memset(&stats, 0xab, sizeof stats);
  CHECK_ERR(xcall_graph_cache_clear(cache, &(xcall_target){XCALL_PLATFORM_HOST, 5, NULL}, &evicted), XCALL_STATUS_NO_SUCH_DEVICE, "host:5");
  CHECK_ERR(xcall_graph_cache_stats(cache, &(xcall_target){XCALL_PLATFORM_HOST, 9, NULL}, &stats), XCALL_STATUS_NO_SUCH_DEVICE, "host:9");
  CHECK_ERR(xcall_graph_cache_invalidate_range(cache, &(xcall_target){XCALL_PLATFORM_HOST, 1, NULL}, 4096, 64, &evicted),
            XCALL_STATUS_NO_SUCH_DEVICE, "host:1");
  CHECK(evicted == 55 && all_bytes(&stats, sizeof stats, 0xab));
  CHECK_ERR(xcall_graph_cache_invalidate_range(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, UINT64_MAX - 8, 64, &evicted),
            XCALL_STATUS_INVALID_ARGUMENT, "past the end of the address space");
  CHECK_ERR(xcall_graph_cache_clear(cache, NULL, &evicted), XCALL_STATUS_NULL_ARGUMENT, "target");
  CHECK_ERR(xcall_graph_cache_stats(cache, &(xcall_target){6, 0, NULL}, &stats), XCALL_STATUS_INVALID_ARGUMENT,
            "unknown platform code 6");
  CHECK(evicted == 55 && all_bytes(&stats, sizeof stats, 0xab));

  char data[64];
  xcall_buffer b = {(uint64_t)(uintptr_t)data, sizeof data, 0};
  xcall_call call = {{XCALL_PLATFORM_HOST, 1, NULL}, 7, 0, &b, 1, 0};
  uint32_t outcome = 1234;
  int runs = 0;
  CHECK_ERR(xcall_graph_cache_execute(cache, &call, record_ok, &runs, &outcome), XCALL_STATUS_NO_SUCH_DEVICE, "host:1");
  call.target.ordinal = 0;
  call.num_buffers = 0;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_ok, &runs, &outcome), XCALL_STATUS_INVALID_ARGUMENT);
  b.role = 9;
  call.num_buffers = 1;
  CHECK_ERR(xcall_graph_cache_execute(cache, &call, record_ok, &runs, &outcome), XCALL_STATUS_INVALID_ARGUMENT, "unknown role 9");
  CHECK_ERR(xcall_graph_cache_execute(cache, &call, NULL, &runs, &outcome), XCALL_STATUS_NULL_ARGUMENT, "record");
  b.role = XCALL_BUFFER_ROLE_IN_OUT;
  call.flags = XCALL_CALL_RELOCATABLE | 0x10;
  CHECK_ERR(xcall_graph_cache_execute(cache, &call, record_ok, &runs, &outcome), XCALL_STATUS_INVALID_ARGUMENT, "bits xcall does not define (0x10)");
  CHECK(runs == 0 && outcome == 1234);
  /* The one defined bit is accepted (Host has no graphs: the call runs). */
  call.flags = XCALL_CALL_RELOCATABLE;
  CHECK_STATUS(xcall_graph_cache_execute(cache, &call, record_ok, &runs, &outcome), XCALL_STATUS_OK);
  CHECK(runs == 1 && outcome == XCALL_GRAPH_OUTCOME_EAGER_HOST);

  /* Freed, foreign and mistyped handles. */
  xcall_graph_cache_free(cache);
  CHECK_ERR(xcall_graph_cache_stats(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, &stats), XCALL_STATUS_INVALID_HANDLE, "not a live xcall_graph_cache");
  xcall_graph_cache_free(cache); /* a second free does nothing */
  CHECK_CONTAINS(xcall_last_error_message(), "freed already");
  int local = 0;
  CHECK_ERR(xcall_graph_cache_clear_all((const xcall_graph_cache *)&local, &evicted), XCALL_STATUS_INVALID_HANDLE, "cache");
  xcall_graph_cache_free(NULL);
  CHECK_STR_EQ(xcall_last_error_message(), "");
}

static void warpspec(void) {
  uint32_t bytes[2] = {4096, 4096};
  xcall_ws_spec s = {2, 1, bytes, 2, 0, 0, 0};
  xcall_ws_plan *plan = (xcall_ws_plan *)0x1;
  s.compute_warpgroups = UINT32_MAX;
  CHECK_ERR(xcall_ws_plan_new(&s, &plan), XCALL_STATUS_INVALID_ARGUMENT, "threads per block exceed 1024");
  s.compute_warpgroups = 1;
  s.stages = UINT32_MAX;
  CHECK_ERR(xcall_ws_plan_new(&s, &plan), XCALL_STATUS_INVALID_ARGUMENT, "shared memory");
  CHECK(plan == (xcall_ws_plan *)0x1);
  s.stages = 2;
  CHECK_STATUS(xcall_ws_plan_new(&s, &plan), XCALL_STATUS_OK);
  xcall_ws_plan_info info;
  CHECK_STATUS(xcall_ws_plan_get_info(plan, &info), XCALL_STATUS_OK);
  CHECK(info.threads_per_block == 256);
  xcall_ws_plan_free(plan);
  CHECK_ERR(xcall_ws_plan_get_info(plan, &info), XCALL_STATUS_INVALID_HANDLE, "plan");
  xcall_ws_plan_free(plan);
  CHECK_CONTAINS(xcall_last_error_message(), "not a live xcall_ws_plan");

  float a[64], b[64], out[64];
  for (int i = 0; i < 64; i++) a[i] = b[i] = 1.5f, out[i] = -7.0f;
  const void *ins[2] = {a, b};
  CHECK_ERR(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F16, NULL, ins, 2, out, sizeof out, 1.0f),
            XCALL_STATUS_UNSUPPORTED, "f16");
  xcall_ws_op_config cfg = {UINT32_MAX, 256, 1};
  CHECK_ERR(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, &cfg, ins, 2, out, sizeof out, 1.0f),
            XCALL_STATUS_INVALID_ARGUMENT, "shared memory");
  /* A config the pipeline cannot have is refused at every size, nothing
     to do included, and nothing is written. */
  xcall_ws_op_config none = {0, 0, 0};
  CHECK_ERR(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, &none, ins, 2, out, 0, 1.0f),
            XCALL_STATUS_INVALID_ARGUMENT, "at least 1 stage");
  CHECK_ERR(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, &none, ins, 2, out, sizeof out, 1.0f),
            XCALL_STATUS_INVALID_ARGUMENT, "at least 1 stage");
  CHECK(out[0] == -7.0f && out[63] == -7.0f);
  CHECK_ERR(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, 9, XCALL_DTYPE_F32, NULL, ins, 2, out, sizeof out, 1.0f),
            XCALL_STATUS_INVALID_ARGUMENT, "unknown warp-specialized op 9");
  /* The same device rule as every entry point that takes a target. */
  CHECK_ERR(xcall_ws_run(NULL, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, ins, 2, out, sizeof out, 1.0f),
            XCALL_STATUS_NULL_ARGUMENT, "target");
  CHECK_ERR(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 2, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, ins, 2, out,
                         sizeof out, 1.0f),
            XCALL_STATUS_NO_SUCH_DEVICE, "host:2");
  CHECK(out[0] == -7.0f && out[63] == -7.0f);
}

static void permute(void) {
  const xcall_target host = {XCALL_PLATFORM_HOST, 0, NULL};
  /* Empty tensors are legal even with a huge hidden size: nothing to do,
   * and nothing is allocated for it. */
  const int64_t huge_h = (int64_t)1 << 40;
  xcall_tensor in0 = xt_tensor(NULL, XCALL_DTYPE_F32, 2, 0, huge_h);
  int32_t map0[1];
  xcall_tensor map_empty = xt_tensor(map0, XCALL_DTYPE_I32, 2, 0, 5);
  xcall_tensor out0 = xt_tensor(NULL, XCALL_DTYPE_F32, 2, 0, huge_h);
  CHECK_STATUS(xcall_unpermute(&host, &in0, &map_empty, NULL, NULL, &out0, NULL), XCALL_STATUS_OK);

  /* 2 tokens, 2 experts: t0 -> e0, t1 -> e1. */
  uint8_t routing[4] = {1, 0, 0, 1};
  int32_t map[2][5];
  int64_t tpe[2], off[3];
  xcall_tensor r_t = xt_tensor(routing, XCALL_DTYPE_U8, 2, 2, 2);
  xcall_tensor map_t = xt_tensor(map, XCALL_DTYPE_I32, 2, 2, 5);
  xcall_tensor tpe_t = xt_tensor(tpe, XCALL_DTYPE_I64, 1, 2, 0);
  xcall_tensor off_t = xt_tensor(off, XCALL_DTYPE_I64, 1, 3, 0);
  memset(map, 0x5a, sizeof map);
  memset(tpe, 0x5a, sizeof tpe);
  CHECK_ERR(xcall_make_row_id_map(&host, &r_t, -1, (int64_t)1 << 62, 0, &map_t, &tpe_t, &off_t),
            XCALL_STATUS_INVALID_ARGUMENT, "align");
  CHECK_ERR(xcall_make_row_id_map(&host, &r_t, -1, 0, (int64_t)1 << 62, &map_t, &tpe_t, &off_t),
            XCALL_STATUS_INVALID_ARGUMENT, "capacity");
  CHECK(all_bytes(map, sizeof map, 0x5a) && all_bytes(tpe, sizeof tpe, 0x5a));
  r_t.reserved = 1;
  CHECK_ERR(xcall_make_row_id_map(&host, &r_t, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT,
            "routing: reserved is 1, must be 0");
  r_t.reserved = 0;
  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_OK);

  float input[2][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}}, output[2][4];
  xcall_tensor in_t = xt_tensor(input, XCALL_DTYPE_F32, 2, 2, 4);
  xcall_tensor out_t = xt_tensor(output, XCALL_DTYPE_F32, 2, 2, 4);
  /* Two tokens sharing a destination row. */
  int32_t shared[2][5];
  memcpy(shared, map, sizeof map);
  shared[1][0] = shared[0][0];
  xcall_tensor shared_t = xt_tensor(shared, XCALL_DTYPE_I32, 2, 2, 5);
  memset(output, 0x33, sizeof output);
  CHECK_ERR(xcall_permute(&host, &in_t, &shared_t, &tpe_t, &off_t, NULL, NULL, &out_t, NULL, NULL, false),
            XCALL_STATUS_INVALID_ARGUMENT, "row_id_map token 1");
  /* A count no map can have. */
  int64_t bad_tpe[2] = {INT64_MAX, 1};
  xcall_tensor bad_tpe_t = xt_tensor(bad_tpe, XCALL_DTYPE_I64, 1, 2, 0);
  CHECK_ERR(xcall_permute(&host, &in_t, &map_t, &bad_tpe_t, &off_t, NULL, NULL, &out_t, NULL, NULL, false),
            XCALL_STATUS_INVALID_ARGUMENT, "expert 0");
  /* The output over the input. */
  CHECK_ERR(xcall_permute(&host, &in_t, &map_t, &tpe_t, &off_t, NULL, NULL, &in_t, NULL, NULL, false),
            XCALL_STATUS_ALIASED, "overlaps");
  CHECK(all_bytes(output, sizeof output, 0x33));
  CHECK(input[0][0] == 1 && input[1][3] == 8);
  /* Wrong dtype, wrong enum, NULL. */
  xcall_tensor wrong = xt_tensor(map, XCALL_DTYPE_F32, 2, 2, 5);
  CHECK_ERR(xcall_permute(&host, &in_t, &wrong, &tpe_t, &off_t, NULL, NULL, &out_t, NULL, NULL, false),
            XCALL_STATUS_UNSUPPORTED, "row_id_map");
  wrong.dtype = 99;
  CHECK_ERR(xcall_permute(&host, &in_t, &wrong, &tpe_t, &off_t, NULL, NULL, &out_t, NULL, NULL, false),
            XCALL_STATUS_INVALID_ARGUMENT, "unknown dtype code 99");
  CHECK_ERR(xcall_permute(&host, &in_t, NULL, &tpe_t, &off_t, NULL, NULL, &out_t, NULL, NULL, false),
            XCALL_STATUS_NULL_ARGUMENT, "row_id_map");
  CHECK(all_bytes(output, sizeof output, 0x33));
  CHECK_STATUS(xcall_permute(&host, &in_t, &map_t, &tpe_t, &off_t, NULL, NULL, &out_t, NULL, NULL, false), XCALL_STATUS_OK);
  CHECK(output[0][0] == 1 && output[1][0] == 5);

  /* Map faults: the Host refuses bad maps at the call, so none recorded. */
  uint32_t faults = 99;
  const xcall_target bad_platform = {7, 0, NULL};
  CHECK_ERR(xcall_permute_take_faults(NULL, &faults), XCALL_STATUS_NULL_ARGUMENT, "target");
  CHECK_ERR(xcall_permute_take_faults(&host, NULL), XCALL_STATUS_NULL_ARGUMENT, "out_faults");
  CHECK_ERR(xcall_permute_take_faults(&bad_platform, &faults), XCALL_STATUS_INVALID_ARGUMENT,
            "unknown platform code 7");
  CHECK(faults == 99);
  CHECK_STATUS(xcall_permute_take_faults(&host, &faults), XCALL_STATUS_OK);
  CHECK(faults == 0);
}

/* ------------------------------------------------------------- shmem */

static xcall_shmem_config host_config(const char *group, uint32_t rank, uint32_t size) {
  xcall_shmem_config c;
  memset(&c, 0, sizeof c);
  c.rank = rank;
  c.size = size;
  c.target.platform = XCALL_PLATFORM_HOST;
  c.target.ordinal = 900 + rank;
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  c.address = group;
  c.heap_bytes = 1 << 20;
  c.timeout_ms = 20000;
  return c;
}

static void shmem_arguments(void) {
  xcall_shmem_world *w = NULL;
  CHECK_STATUS(xcall_shmem_world_new(&w), XCALL_STATUS_OK);
  xcall_shmem_config c = host_config("bad-args", 0, UINT32_MAX);
  CHECK_ERR(xcall_shmem_init(w, &c), XCALL_STATUS_INVALID_ARGUMENT, "larger than the limit");
  c = host_config("bad-args", 0, 1);
  c.heap_bytes = UINT64_MAX;
  CHECK_ERR(xcall_shmem_init(w, &c), XCALL_STATUS_INVALID_ARGUMENT, "larger than an address space");
  c.heap_bytes = 1 << 20;
  c.bootstrap = 7;
  CHECK_ERR(xcall_shmem_init(w, &c), XCALL_STATUS_INVALID_ARGUMENT, "unknown bootstrap kind 7");
  /* A regular file at the socket address is never removed. */
  char path[64];
  snprintf(path, sizeof path, "/tmp/xcall-bad-input-%d", (int)getpid());
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (f) {
    fputs("keep me", f);
    fclose(f);
  }
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_UNIX_SOCKET;
  c.address = path;
  c.timeout_ms = 500;
  CHECK_ERR(xcall_shmem_init(w, &c), XCALL_STATUS_INVALID_ARGUMENT, "is not a socket");
  char kept[16] = {0};
  f = fopen(path, "r");
  CHECK(f != NULL);
  if (f) {
    CHECK(fgets(kept, sizeof kept, f) != NULL);
    fclose(f);
  }
  CHECK_STR_EQ(kept, "keep me");
  unlink(path);
  uint32_t rank = 5, size = 5;
  CHECK_ERR(xcall_shmem_rank(w, &rank, &size), XCALL_STATUS_INVALID_STATE, "not initialised");
  CHECK(rank == 5 && size == 5);
  xcall_shmem_world_free(w);
  CHECK_ERR(xcall_shmem_rank(w, &rank, &size), XCALL_STATUS_INVALID_HANDLE, "not a live xcall_shmem_world");
  xcall_shmem_world_free(w);
  CHECK_CONTAINS(xcall_last_error_message(), "freed already");
}

struct waiter {
  xcall_shmem_world *w;
  uint64_t *sig;
  xcall_status status;
};

static void *wait_on_signal(void *arg) {
  struct waiter *p = arg;
  p->status = xcall_shmem_wait_until(p->w, p->sig, XCALL_SHMEM_CMP_EQ, 1, NULL);
  return NULL;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* One handle used from a second thread while the first is in a call. */
static void shmem_busy(void) {
  xcall_shmem_world *w = NULL;
  CHECK_STATUS(xcall_shmem_world_new(&w), XCALL_STATUS_OK);
  xcall_shmem_config c = host_config("bad-busy", 0, 1);
  c.timeout_ms = 10000; /* the waiter's watchdog */
  CHECK_STATUS(xcall_shmem_init(w, &c), XCALL_STATUS_OK);
  uint64_t *sig = NULL;
  CHECK_STATUS(xcall_shmem_malloc(w, 8, (void **)&sig), XCALL_STATUS_OK);
  *sig = 0;
  struct waiter wt = {w, sig, 12345};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, wait_on_signal, &wt) == 0);
  sleep_ms(100);
  CHECK_ERR(xcall_shmem_quiet(w), XCALL_STATUS_BUSY, "in use by another thread");
  __atomic_store_n(sig, 1, __ATOMIC_RELEASE);
  pthread_join(t, NULL);
  CHECK(wt.status == XCALL_STATUS_OK);
  CHECK_STATUS(xcall_shmem_free(w, sig), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_shmem_finalize(w, NULL), XCALL_STATUS_OK);
  xcall_shmem_world_free(w);
}

struct pe {
  uint32_t rank;
  int failures;
};

static volatile int left; /* rank 1 freed its world */

/* Rank 1 frees its world without finalize; rank 0's later transfers are
 * refused and touch nothing. Before that: a put into a freed block, and a
 * collective mismatch that both ranks see. */
static void *peer_failure_pe(void *arg) {
  struct pe *p = arg;
  xcall_shmem_world *w = NULL;
  PE_EXPECT(xcall_shmem_world_new(&w) == XCALL_STATUS_OK);
  xcall_shmem_config c = host_config("bad-peer", p->rank, 2);
  PE_EXPECT(xcall_shmem_init(w, &c) == XCALL_STATUS_OK);
  unsigned char *a = NULL, *b = NULL;
  PE_EXPECT(xcall_shmem_malloc(w, 256, (void **)&a) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_malloc(w, 256, (void **)&b) == XCALL_STATUS_OK);
  memset(b, 0, 256);
  unsigned char data[256];
  memset(data, 0x7e, sizeof data);
  PE_EXPECT(xcall_shmem_free(w, a) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_put(w, a, data, 16, 1 - p->rank) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(strstr(xcall_last_error_message(), "freed already") != NULL);
  xcall_status s = p->rank == 0 ? xcall_shmem_malloc(w, 64, (void **)&a) : xcall_shmem_barrier_all(w);
  PE_EXPECT(s == XCALL_STATUS_COLLECTIVE_MISMATCH);
  PE_EXPECT(strstr(xcall_last_error_message(), "rank 1: barrier_all") != NULL);
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);
  if (p->rank == 1) {
    xcall_shmem_world_free(w);
    __atomic_store_n(&left, 1, __ATOMIC_RELEASE);
    return NULL;
  }
  for (int i = 0; i < 2000 && !__atomic_load_n(&left, __ATOMIC_ACQUIRE); i++) sleep_ms(10);
  PE_EXPECT(__atomic_load_n(&left, __ATOMIC_ACQUIRE));
  PE_EXPECT(xcall_shmem_put(w, b, data, 64, 1) == XCALL_STATUS_PEER_FAILED);
  PE_EXPECT(strstr(xcall_last_error_message(), "rank 1 left the world without finalize") != NULL);
  PE_EXPECT(xcall_shmem_get(w, data, b, 64, 1) == XCALL_STATUS_PEER_FAILED);
  PE_EXPECT(data[0] == 0x7e);
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_PEER_FAILED);
  PE_EXPECT(xcall_shmem_wait_until(w, (uint64_t *)b, XCALL_SHMEM_CMP_EQ, 9, NULL) == XCALL_STATUS_PEER_FAILED);
  PE_EXPECT(all_bytes(b, 256, 0));
  uint64_t leaked = 99;
  PE_EXPECT(xcall_shmem_finalize(w, &leaked) == XCALL_STATUS_PEER_FAILED);
  PE_EXPECT(leaked == 99);
  xcall_shmem_world_free(w);
  return NULL;
}

static void shmem_peer_failure(void) {
  struct pe pes[2] = {{0, 0}, {1, 0}};
  pthread_t t[2];
  for (int r = 0; r < 2; r++) CHECK(pthread_create(&t[r], NULL, peer_failure_pe, &pes[r]) == 0);
  for (int r = 0; r < 2; r++) {
    pthread_join(t[r], NULL);
    CHECK(pes[r].failures == 0);
  }
}

int main(void) {
  core_calls();
  graph_cache();
  warpspec();
  permute();
  shmem_arguments();
  shmem_busy();
  shmem_peer_failure();
  return xt_summary("test_bad_input");
}
