/*
 * Symmetric memory through the C ABI: an SPMT world of 4 Host PEs made of
 * pthreads (put / get / put_signal / barrier round trip, collective malloc
 * with the same offsets, an all-to-all exchange, the transport of each
 * pair and an allgather into slots), meeting in process and again at a TCP address, and the error
 * paths.
 */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

#include "xcall_test.h"

#define PES 4
#define BYTES 4096

struct pe {
  uint32_t rank;
  xcall_shmem_bootstrap bootstrap;
  const char *address;
  int failures; /* counted per thread; checked by the main thread */
  uint64_t leaked;
};

static unsigned char pattern(uint32_t rank, size_t i) {
  return (unsigned char)((i * 131u + rank * 17u + 1u) & 0xffu);
}

/* The config of PE `p` of a Host world of PES, its registry slot
 * `slots + rank`. */
static xcall_shmem_config pe_config(const struct pe *p, uint32_t slots) {
  xcall_shmem_config c = {0};
  c.rank = p->rank;
  c.size = PES;
  c.target.platform = XCALL_PLATFORM_HOST;
  c.target.ordinal = slots + p->rank;
  c.bootstrap = p->bootstrap;
  c.address = p->address;
  c.heap_bytes = 1 << 20;
  c.timeout_ms = 20000;
  return c;
}

static void *run_pe(void *arg) {
  struct pe *p = arg;
  xcall_shmem_world *w = NULL;
  PE_EXPECT(xcall_shmem_world_new(&w) == XCALL_STATUS_OK);
  xcall_shmem_config c = pe_config(p, 700);
  PE_EXPECT(xcall_shmem_init(w, &c) == XCALL_STATUS_OK);
  uint32_t rank = 99, size = 0;
  PE_EXPECT(xcall_shmem_rank(w, &rank, &size) == XCALL_STATUS_OK);
  PE_EXPECT(rank == p->rank && size == PES);

  unsigned char *buf = NULL;
  uint64_t *sig = NULL;
  PE_EXPECT(xcall_shmem_malloc(w, BYTES, (void **)&buf) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_malloc(w, 8, (void **)&sig) == XCALL_STATUS_OK);
  *sig = 0;
  unsigned char *base = xcall_shmem_ptr(w, p->rank, buf);
  PE_EXPECT(base == buf);
  PE_EXPECT(xcall_shmem_ptr(w, PES, buf) == NULL);
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);

  unsigned char data[BYTES];
  for (size_t i = 0; i < BYTES; i++) data[i] = pattern(p->rank, i);
  uint32_t right = (p->rank + 1) % PES, left = (p->rank + PES - 1) % PES;
  /* Data to the right neighbour, then its signal word += 1. */
  PE_EXPECT(xcall_shmem_put_signal(w, buf, data, BYTES, sig, 1,
                                   XCALL_SHMEM_SIGNAL_OP_ADD,
                                   right) == XCALL_STATUS_OK);
  uint64_t seen = 0;
  PE_EXPECT(xcall_shmem_wait_until(w, sig, XCALL_SHMEM_CMP_GE, 1, &seen) ==
            XCALL_STATUS_OK);
  PE_EXPECT(seen == 1);
  int same = 1;
  for (size_t i = 0; i < BYTES; i++) same &= buf[i] == pattern(left, i);
  PE_EXPECT(same);
  /* get it back from the right neighbour: my own data. */
  unsigned char back[BYTES];
  PE_EXPECT(xcall_shmem_get(w, back, buf, BYTES, right) == XCALL_STATUS_OK);
  PE_EXPECT(memcmp(back, data, BYTES) == 0);
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);
  /* put to the left neighbour, barrier, check. */
  PE_EXPECT(xcall_shmem_put(w, buf, data, BYTES, left) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_quiet(w) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);
  same = 1;
  for (size_t i = 0; i < BYTES; i++) same &= buf[i] == pattern(right, i);
  PE_EXPECT(same);

  /* An all-to-all exchange: PE a's segment of (BYTES / PES) bytes lands in
   * slot a of every PE's buffer (the segment to itself included). */
  enum { SLOT = BYTES / PES };
  xcall_shmem_outgoing out[PES];
  xcall_shmem_incoming in[PES];
  for (uint32_t q = 0; q < PES; q++) {
    uint32_t kind = 99;
    PE_EXPECT(xcall_shmem_peer_transport(w, q, &kind) == XCALL_STATUS_OK);
    PE_EXPECT(kind == XCALL_SHMEM_TRANSPORT_SAME_PROCESS);
    out[q].pe = q;
    out[q].src = data + q * SLOT;
    out[q].dest = buf + p->rank * SLOT;
    out[q].bytes = SLOT;
    in[q].pe = q;
    in[q].dest = buf + q * SLOT;
    in[q].bytes = SLOT;
  }
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_exchange(w, out, PES, in, PES, NULL) ==
            XCALL_STATUS_OK);
  same = 1;
  for (uint32_t a = 0; a < PES; a++)
    for (size_t i = 0; i < SLOT; i++)
      same &= buf[a * SLOT + i] == pattern(a, p->rank * SLOT + i);
  PE_EXPECT(same);
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);
  /* Its errors, each before anything moves. */
  PE_EXPECT(xcall_shmem_exchange(w, NULL, 1, in, 0, NULL) ==
            XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_shmem_exchange(w, out, (uint64_t)1 << 40, in, 0, NULL) ==
            XCALL_STATUS_INVALID_ARGUMENT);
  xcall_shmem_outgoing bad = out[0];
  bad.pe = PES;
  PE_EXPECT(xcall_shmem_exchange(w, &bad, 1, NULL, 0, NULL) ==
            XCALL_STATUS_INVALID_ARGUMENT);
  bad = out[0];
  bad.dest = data;
  PE_EXPECT(xcall_shmem_exchange(w, &bad, 1, NULL, 0, NULL) ==
            XCALL_STATUS_INVALID_ARGUMENT);
  uint32_t kind = 0;
  PE_EXPECT(xcall_shmem_peer_transport(w, PES, &kind) ==
            XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(xcall_shmem_peer_transport(w, 0, NULL) == XCALL_STATUS_NULL_ARGUMENT);

  /* allgather: rank r offers 3 * (r + 1) bytes into slots of 16; each
   * slot's tail keeps its poison. */
  {
    enum { SLOT_BYTES = 16 };
    unsigned char mine[SLOT_BYTES], slots[PES * SLOT_BYTES];
    uint64_t lengths[PES];
    uint64_t offered = 3u * (p->rank + 1);
    for (size_t i = 0; i < offered; i++) mine[i] = pattern(p->rank, i);
    memset(slots, 0xee, sizeof slots);
    PE_EXPECT(xcall_shmem_allgather(w, mine, offered, slots, SLOT_BYTES,
                                    lengths) == XCALL_STATUS_OK);
    same = 1;
    for (uint32_t r = 0; r < PES; r++) {
      same &= lengths[r] == 3u * (r + 1);
      for (size_t i = 0; i < SLOT_BYTES; i++)
        same &= slots[r * SLOT_BYTES + i] ==
                (i < 3u * (r + 1) ? pattern(r, i) : 0xee);
    }
    PE_EXPECT(same);
    /* Slots of 8: rank 2 offers 9 bytes, refused on every PE with
     * nothing written. */
    memset(slots, 0xee, sizeof slots);
    lengths[0] = 77;
    PE_EXPECT(xcall_shmem_allgather(w, mine, offered, slots, 8, lengths) ==
              XCALL_STATUS_INVALID_ARGUMENT);
    same = lengths[0] == 77;
    for (size_t i = 0; i < sizeof slots; i++) same &= slots[i] == 0xee;
    PE_EXPECT(same);
    /* Rank 1 offers more than the limit: not read, refused on every PE. */
    uint64_t big = p->rank == 1 ? XCALL_SHMEM_MAX_GATHER_BYTES + 1 : 1;
    PE_EXPECT(xcall_shmem_allgather(w, mine, big, slots, SLOT_BYTES,
                                    lengths) ==
              XCALL_STATUS_INVALID_ARGUMENT);
    /* Refused before the collective (every PE, so all stay in step). */
    PE_EXPECT(xcall_shmem_allgather(w, mine, offered, slots, SLOT_BYTES,
                                    NULL) == XCALL_STATUS_NULL_ARGUMENT);
    PE_EXPECT(xcall_shmem_allgather(w, NULL, offered, slots, SLOT_BYTES,
                                    lengths) == XCALL_STATUS_NULL_ARGUMENT);
    PE_EXPECT(xcall_shmem_allgather(w, mine, offered, NULL, SLOT_BYTES,
                                    lengths) == XCALL_STATUS_NULL_ARGUMENT);
    PE_EXPECT(xcall_shmem_allgather(w, mine, offered, slots, UINT64_MAX / 2,
                                    lengths) ==
              XCALL_STATUS_INVALID_ARGUMENT);
    /* Empty offers with no slots: every length 0. */
    PE_EXPECT(xcall_shmem_allgather(w, NULL, 0, NULL, 0, lengths) ==
              XCALL_STATUS_OK);
    same = 1;
    for (uint32_t r = 0; r < PES; r++) same &= lengths[r] == 0;
    PE_EXPECT(same);
  }

  /* Errors: outside the heap, bad PE, Host has no stream barrier. */
  PE_EXPECT(xcall_shmem_put(w, data, data, 8, right) ==
            XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(xcall_shmem_put(w, buf, data, 8, PES) ==
            XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(xcall_shmem_put(w, buf, NULL, 8, right) ==
            XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_shmem_barrier_on_stream(w, NULL) ==
            XCALL_STATUS_UNSUPPORTED);
  PE_EXPECT(xcall_shmem_init(w, &c) == XCALL_STATUS_INVALID_STATE);

  PE_EXPECT((uintptr_t)buf % 256u == 0); /* heap alignment */
  PE_EXPECT(xcall_shmem_barrier_all(w) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_free(w, sig) == XCALL_STATUS_OK);
  /* `buf` is left allocated on purpose: finalize reports it. */
  PE_EXPECT(xcall_shmem_finalize(w, &p->leaked) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_malloc(w, 8, (void **)&buf) ==
            XCALL_STATUS_INVALID_STATE);
  xcall_shmem_world_free(w);
  return NULL;
}

/* A TCP port nobody listens on now (the kernel's pick), 0 on failure. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

/* A PE of a world whose pairs all take TCP connections (the path of Host
 * PEs on other hosts): no pointers to peers, puts refused, the
 * all-to-all exchange delivered. */
static void *run_tcp_pe(void *arg) {
  struct pe *p = arg;
  xcall_shmem_world *w = NULL;
  PE_EXPECT(xcall_shmem_world_new(&w) == XCALL_STATUS_OK);
  struct pe in_process = *p;
  in_process.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  xcall_shmem_config c = pe_config(&in_process, 800);
  c.pairs = XCALL_SHMEM_PAIRS_TCP;
  PE_EXPECT(xcall_shmem_init(w, &c) == XCALL_STATUS_OK);
  unsigned char *buf = NULL;
  PE_EXPECT(xcall_shmem_malloc(w, BYTES, (void **)&buf) == XCALL_STATUS_OK);
  unsigned char data[BYTES];
  for (size_t i = 0; i < BYTES; i++) data[i] = pattern(p->rank + 10, i);
  enum { SLOT = BYTES / PES };
  xcall_shmem_outgoing out[PES];
  xcall_shmem_incoming in[PES];
  for (uint32_t q = 0; q < PES; q++) {
    uint32_t kind = 99;
    PE_EXPECT(xcall_shmem_peer_transport(w, q, &kind) == XCALL_STATUS_OK);
    if (q == p->rank) {
      PE_EXPECT(kind == XCALL_SHMEM_TRANSPORT_SAME_PROCESS);
    } else {
      PE_EXPECT(kind == XCALL_SHMEM_TRANSPORT_TCP);
      PE_EXPECT(xcall_shmem_ptr(w, q, buf) == NULL);
      PE_EXPECT(xcall_shmem_put(w, buf, data, 8, q) == XCALL_STATUS_UNSUPPORTED);
    }
    out[q] = (xcall_shmem_outgoing){.pe = q, .src = data + q * SLOT,
                                    .dest = buf + p->rank * SLOT, .bytes = SLOT};
    in[q] = (xcall_shmem_incoming){.pe = q, .dest = buf + q * SLOT, .bytes = SLOT};
  }
  PE_EXPECT(xcall_shmem_exchange(w, out, PES, in, PES, NULL) == XCALL_STATUS_OK);
  int same = 1;
  for (uint32_t a = 0; a < PES; a++)
    for (size_t i = 0; i < SLOT; i++)
      same &= buf[a * SLOT + i] == pattern(a + 10, p->rank * SLOT + i);
  PE_EXPECT(same);
  PE_EXPECT(xcall_shmem_free(w, buf) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_finalize(w, &p->leaked) == XCALL_STATUS_OK);
  xcall_shmem_world_free(w);
  return NULL;
}

static void run_tcp_world(void) {
  pthread_t threads[PES];
  struct pe pes[PES];
  for (uint32_t r = 0; r < PES; r++) {
    pes[r] = (struct pe){.rank = r, .address = "c-test-tcp"};
    CHECK(pthread_create(&threads[r], NULL, run_tcp_pe, &pes[r]) == 0);
  }
  for (uint32_t r = 0; r < PES; r++) {
    CHECK(pthread_join(threads[r], NULL) == 0);
    CHECK(pes[r].failures == 0);
    CHECK(pes[r].leaked == 0);
  }
}

static void run_world(xcall_shmem_bootstrap bootstrap, const char *address) {
  pthread_t threads[PES];
  struct pe pes[PES];
  for (uint32_t r = 0; r < PES; r++) {
    pes[r] = (struct pe){.rank = r, .bootstrap = bootstrap, .address = address};
    CHECK(pthread_create(&threads[r], NULL, run_pe, &pes[r]) == 0);
  }
  for (uint32_t r = 0; r < PES; r++) {
    CHECK(pthread_join(threads[r], NULL) == 0);
    CHECK(pes[r].failures == 0);
    CHECK(pes[r].leaked == 1);
  }
}

int main(void) {
  run_world(XCALL_SHMEM_BOOTSTRAP_IN_PROCESS, "c-test-world");
  char address[32];
  int port = free_port();
  CHECK(port > 0);
  snprintf(address, sizeof address, "127.0.0.1:%d", port);
  run_world(XCALL_SHMEM_BOOTSTRAP_TCP, address);
  run_tcp_world();

  /* Use before init, NULL arguments, bad config. */
  xcall_shmem_world *w = NULL;
  CHECK_STATUS(xcall_shmem_world_new(&w), XCALL_STATUS_OK);
  void *x = NULL;
  CHECK_STATUS(xcall_shmem_malloc(w, 8, &x), XCALL_STATUS_INVALID_STATE);
  CHECK(strstr(xcall_last_error_message(), "init first") != NULL);
  CHECK_STATUS(xcall_shmem_barrier_all(NULL), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_shmem_init(w, NULL), XCALL_STATUS_NULL_ARGUMENT);
  xcall_shmem_config c = {0};
  c.size = 2;
  c.rank = 0;
  c.target.platform = XCALL_PLATFORM_HOST;
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  CHECK_STATUS(xcall_shmem_init(w, &c), XCALL_STATUS_NULL_ARGUMENT);
  c.address = "c-test-alone";
  c.bootstrap = 9;
  CHECK_STATUS(xcall_shmem_init(w, &c), XCALL_STATUS_INVALID_ARGUMENT);
  /* An unknown transport policy; NCCL for a Host world. */
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  c.pairs = 7;
  CHECK_STATUS(xcall_shmem_init(w, &c), XCALL_STATUS_INVALID_ARGUMENT);
  c.pairs = XCALL_SHMEM_PAIRS_NCCL;
  CHECK_STATUS(xcall_shmem_init(w, &c), XCALL_STATUS_UNSUPPORTED);
  CHECK(strstr(xcall_last_error_message(), "CUDA worlds only") != NULL);
  c.pairs = XCALL_SHMEM_PAIRS_DEFAULT;
  /* A world of 2 whose second PE never comes: a timeout, not a hang. */
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  c.heap_bytes = 1 << 16;
  c.timeout_ms = 200;
  CHECK_STATUS(xcall_shmem_init(w, &c), XCALL_STATUS_TIMEOUT);
  CHECK(strstr(xcall_last_error_message(), "[1]") != NULL);
  CHECK(xcall_shmem_ptr(w, 0, x) == NULL);
  CHECK_STATUS(xcall_shmem_finalize(w, NULL), XCALL_STATUS_INVALID_STATE);
  xcall_shmem_world_free(w);
  xcall_shmem_world_free(NULL);
  /* No NCCL communicator is aborting: settled at once, none left. */
  uint64_t left = 99;
  CHECK_STATUS(xcall_shmem_settle_aborts(1000, &left), XCALL_STATUS_OK);
  CHECK(left == 0);
  CHECK_STATUS(xcall_shmem_settle_aborts(0, NULL), XCALL_STATUS_OK);
  left = 99;
  CHECK_STATUS(xcall_shmem_settle_aborts(3600001, &left), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(left == 99);
  CHECK_CONTAINS(xcall_last_error_message(), "above one hour");
  return xt_summary("test_shmem");
}
