/*
 * shmem_exchange: two PEs of one symmetric-memory world, one thread each,
 * exchange a buffer with put_signal and wait for each other's signal.
 *
 *   shmem_exchange
 *
 * Every PE allocates the same objects (collective malloc), writes its
 * pattern into its peer's copy of `inbox` and adds 1 to the peer's
 * `signal`; it then waits until its own signal is 1 and checks the
 * peer's pattern. On Host the world's PEs are threads of this process
 * joined by name (the in-process bootstrap); a CUDA world is made the
 * same way with a GPU ordinal per PE.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>

#include "example.h"

enum { PES = 2, WORDS = 4096 };

struct pe {
  uint32_t rank;
  int ok;
};

static uint32_t pattern(uint32_t rank, size_t i) { return (uint32_t)(i * 40503u) ^ (rank + 1u) * 0x9e3779b9u; }

/* Stops this PE's thread with xcall's message (the world times out on its
 * peer, which then fails with PEER_FAILED or TIMEOUT instead of hanging). */
#define PE_TRY(call)                                                                                     \
  do {                                                                                                   \
    xcall_status s_ = (call);                                                                            \
    if (s_ != XCALL_STATUS_OK) {                                                                         \
      fprintf(stderr, "PE %u: %s: %s (%s)\n", p->rank, #call, xcall_status_name(s_),                    \
              xcall_last_error_message());                                                               \
      if (w != NULL) xcall_shmem_world_free(w);                                                          \
      return NULL;                                                                                       \
    }                                                                                                    \
  } while (0)

static void *run_pe(void *arg) {
  struct pe *p = arg;
  xcall_shmem_world *w = NULL;
  xcall_shmem_config config;
  uint32_t *inbox = NULL, peer = 1 - p->rank, data[WORDS];
  uint64_t *signal = NULL, seen = 0, leaked = 0;
  size_t i;

  memset(&config, 0, sizeof config);
  config.rank = p->rank;
  config.size = PES;
  config.target.platform = XCALL_PLATFORM_HOST;
  config.target.ordinal = p->rank; /* on Host: the PE's own slot */
  config.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  config.address = "example-exchange";
  config.heap_bytes = 1 << 20;
  config.timeout_ms = 10000; /* every wait on the other PE gives up after 10 s */

  PE_TRY(xcall_shmem_world_new(&w));
  PE_TRY(xcall_shmem_init(w, &config));
  PE_TRY(xcall_shmem_malloc(w, sizeof data, (void **)&inbox));
  PE_TRY(xcall_shmem_malloc(w, sizeof *signal, (void **)&signal));
  *signal = 0;
  PE_TRY(xcall_shmem_barrier_all(w)); /* every signal is 0 before anyone puts */

  for (i = 0; i < WORDS; i++) data[i] = pattern(p->rank, i);
  PE_TRY(xcall_shmem_put_signal(w, inbox, data, sizeof data, signal, 1, XCALL_SHMEM_SIGNAL_OP_ADD, peer));
  PE_TRY(xcall_shmem_wait_until(w, signal, XCALL_SHMEM_CMP_EQ, 1, &seen));

  p->ok = 1;
  for (i = 0; i < WORDS; i++) p->ok &= inbox[i] == pattern(peer, i);
  printf("PE %u: got %d words from PE %u, %s\n", p->rank, WORDS, peer, p->ok ? "right" : "WRONG");

  PE_TRY(xcall_shmem_barrier_all(w)); /* the peer is done reading before the frees */
  PE_TRY(xcall_shmem_free(w, inbox));
  PE_TRY(xcall_shmem_free(w, signal));
  PE_TRY(xcall_shmem_finalize(w, &leaked));
  xcall_shmem_world_free(w);
  p->ok &= leaked == 0;
  return NULL;
}

int main(void) {
  pthread_t threads[PES];
  struct pe pes[PES];
  uint32_t r;
  int ok = 1;
  for (r = 0; r < PES; r++) {
    pes[r].rank = r;
    pes[r].ok = 0;
    if (pthread_create(&threads[r], NULL, run_pe, &pes[r]) != 0) return 1;
  }
  for (r = 0; r < PES; r++) {
    pthread_join(threads[r], NULL);
    ok &= pes[r].ok;
  }
  return ok ? 0 : 1;
}
