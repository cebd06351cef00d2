/*
 * ep_layer: one expert-parallel MoE layer through the C ABI, on every PE
 * of a symmetric-memory world (one thread per PE).
 *
 *   ep_layer [host|cuda]
 *
 * Each PE holds T tokens of H floats routed top-K over E experts, E / P of
 * them on each PE. The layer is three calls on the PE's stream, with no
 * wait on the host between them (so a CUDA graph can capture it):
 *
 *   xcall_ep_dispatch   each token sent once to each PE hosting one of its
 *                       experts; rows land grouped by local expert, their
 *                       counts written on the device
 *   xcall_ws_run_ragged the experts: out = silu(rows) * scale_e, over each
 *                       expert's rows as counted
 *   xcall_ep_combine    each token's expert outputs, weighted by its probs,
 *                       summed back on its own PE
 *
 * Every size comes from the config (xcall_ep_layout) before anything is
 * made. Each PE checks y against a loop over the inputs. On Host the PEs
 * are threads of this process (2 of them); with `cuda`, one thread per
 * GPU of this process (up to 4), each driving its own device.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "cuda_driver.h"
#include "example.h"

enum { MAX_PES = 4, T = 64, H = 128, K = 2, E = 8 };

struct pe {
  uint32_t rank, pes;
  xcall_platform platform;
  int ok;
};

/* Inputs of PE r, the same whichever PE computes them. */
static float x_of(uint32_t r, int t, int j) { return (float)((t * 131 + j * 7 + (int)r * 29) % 97) / 16.0f - 3.0f; }
static int32_t id_of(uint32_t r, int t, int s) { return (int32_t)((t * 3 + (int)r + s * 5) % E); }
static float prob_of(uint32_t r, int t, int s) { return s == 0 ? 0.625f + 0.0625f * (float)((t + (int)r) % 4) : 0.25f; }
static float scale_of(int e) { return 0.5f + 0.25f * (float)e; }
static double silu(double v) { return v / (1.0 + exp(-v)); }

/* Where a PE's buffers live: host memory, or its GPU's memory. */
struct mem {
  struct cuda_driver cuda;
  int on_cuda;
  CUstream stream;
};

static void *mem_alloc(struct mem *m, size_t bytes) {
  CUdeviceptr d = 0;
  if (!m->on_cuda) return aligned_alloc(64, (bytes + 63) / 64 * 64);
  return m->cuda.cuMemAlloc(&d, bytes) == 0 ? (void *)(uintptr_t)d : NULL;
}

static int mem_put(struct mem *m, void *dst, const void *src, size_t bytes) {
  if (!m->on_cuda) return memcpy(dst, src, bytes), 0;
  return m->cuda.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes);
}

static int mem_get(struct mem *m, void *dst, const void *src, size_t bytes) {
  if (!m->on_cuda) return memcpy(dst, src, bytes), 0;
  return m->cuda.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes);
}

static void mem_free(struct mem *m, void *p) {
  if (p == NULL) return;
  if (m->on_cuda)
    m->cuda.cuMemFree((CUdeviceptr)(uintptr_t)p);
  else
    free(p);
}

/* Stops this PE with xcall's message (its peers' waits then time out). */
#define PE_TRY(call)                                                                           \
  do {                                                                                         \
    xcall_status s_ = (call);                                                                  \
    if (s_ != XCALL_STATUS_OK) {                                                               \
      fprintf(stderr, "PE %u: %s: %s (%s)\n", p->rank, #call, xcall_status_name(s_),          \
              xcall_last_error_message());                                                     \
      return NULL;                                                                             \
    }                                                                                          \
  } while (0)
#define PE_CHECK(cond)                                           \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "PE %u: %s failed\n", p->rank, #cond);     \
      return NULL;                                               \
    }                                                            \
  } while (0)

static void *run_pe(void *arg) {
  struct pe *p = arg;
  const int local = E / (int)p->pes;
  struct mem m;
  xcall_ep_config config;
  xcall_ep_sizes sizes;
  xcall_shmem_config wc;
  xcall_shmem_world *w = NULL;
  xcall_ep_group *g = NULL;
  static float x[MAX_PES][T * H], probs[MAX_PES][T * K], y[MAX_PES][T * H], scales[MAX_PES][E];
  static int32_t ids[MAX_PES][T * K];
  void *d_x, *d_ids, *d_probs, *d_rows, *d_tpe, *d_out, *d_y, *d_scales;
  xcall_ep_expert_major out;
  double worst = 0.0;
  int t, j, s, l;

  memset(&m, 0, sizeof m);
  memset(&config, 0, sizeof config);
  config.tokens = T;
  config.hidden = H;
  config.topk = K;
  config.experts = E;
  config.align = 1; /* packed: each expert's rows follow the previous one's */
  config.capacity = 0; /* dropless */
  config.precision = XCALL_EP_PRECISION_F32;
  PE_TRY(xcall_ep_layout(&config, p->pes, &sizes));

  if (p->platform == XCALL_PLATFORM_CUDA) {
    m.on_cuda = 1;
    PE_CHECK(cuda_driver_open(&m.cuda, (int)p->rank) == 0);
    PE_CHECK(m.cuda.cuStreamCreate(&m.stream, 0) == 0);
  }
  memset(&wc, 0, sizeof wc);
  wc.rank = p->rank;
  wc.size = p->pes;
  wc.target.platform = p->platform;
  wc.target.ordinal = p->rank; /* CUDA: GPU `rank`; Host: the PE's own slot */
  wc.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  wc.address = "example-ep-layer";
  wc.heap_bytes = sizes.heap_bytes + (1 << 20);
  wc.timeout_ms = 20000;
  PE_TRY(xcall_shmem_world_new(&w));
  PE_TRY(xcall_shmem_init(w, &wc));
  PE_TRY(xcall_ep_group_new(w, &config, &g));

  for (t = 0; t < T; t++) {
    for (j = 0; j < H; j++) x[p->rank][t * H + j] = x_of(p->rank, t, j);
    for (s = 0; s < K; s++) {
      ids[p->rank][t * K + s] = id_of(p->rank, t, s);
      probs[p->rank][t * K + s] = prob_of(p->rank, t, s);
    }
  }
  for (l = 0; l < local; l++) scales[p->rank][l] = scale_of((int)p->rank * local + l);
  d_x = mem_alloc(&m, sizes.token_rows_bytes);
  d_ids = mem_alloc(&m, sizes.routing_bytes);
  d_probs = mem_alloc(&m, sizes.routing_bytes);
  d_rows = mem_alloc(&m, sizes.rows_bytes);
  d_tpe = mem_alloc(&m, sizes.tokens_per_expert_bytes);
  d_out = mem_alloc(&m, sizes.expert_out_bytes);
  d_y = mem_alloc(&m, sizes.token_rows_bytes);
  d_scales = mem_alloc(&m, sizeof(float) * (size_t)local);
  PE_CHECK(d_x && d_ids && d_probs && d_rows && d_tpe && d_out && d_y && d_scales);
  PE_CHECK(mem_put(&m, d_x, x[p->rank], sizes.token_rows_bytes) == 0);
  PE_CHECK(mem_put(&m, d_ids, ids[p->rank], sizes.routing_bytes) == 0);
  PE_CHECK(mem_put(&m, d_probs, probs[p->rank], sizes.routing_bytes) == 0);
  PE_CHECK(mem_put(&m, d_scales, scales[p->rank], sizeof(float) * (size_t)local) == 0);

  memset(&out, 0, sizeof out);
  out.rows = d_rows;
  out.rows_bytes = sizes.rows_bytes;
  out.tokens_per_expert = d_tpe;
  out.tokens_per_expert_bytes = sizes.tokens_per_expert_bytes;
  {
    /* The layer: three calls on this PE's stream (NULL on Host). */
    const xcall_target here = {p->platform, p->platform == XCALL_PLATFORM_CUDA ? p->rank : 0, m.stream};
    PE_TRY(xcall_ep_dispatch(g, d_x, sizes.token_rows_bytes, d_ids, sizes.routing_bytes, d_probs,
                             sizes.routing_bytes, T, &out, m.stream));
    PE_TRY(xcall_ws_run_ragged(&here, XCALL_DTYPE_F32, NULL, d_rows, d_out, 1, (size_t)local,
                               sizes.expert_out_bytes, H * sizeof(float), d_tpe, d_scales));
    PE_TRY(xcall_ep_combine(g, d_out, sizes.expert_out_bytes, d_y, sizes.token_rows_bytes, m.stream));
  }
  if (m.on_cuda) PE_CHECK(m.cuda.cuStreamSynchronize(m.stream) == 0);
  PE_TRY(xcall_ep_check(g)); /* CUDA: a peer that never came, or bad routing */
  PE_CHECK(mem_get(&m, y[p->rank], d_y, sizes.token_rows_bytes) == 0);

  /* y[t] = sum over the token's routes of prob * silu(x[t]) * scale_e. */
  for (t = 0; t < T; t++)
    for (j = 0; j < H; j++) {
      double want = 0.0, err;
      for (s = 0; s < K; s++)
        want += prob_of(p->rank, t, s) * silu(x_of(p->rank, t, j)) * scale_of(id_of(p->rank, t, s));
      err = fabs(y[p->rank][t * H + j] - want) / (1.0 + fabs(want));
      worst = err > worst || err != err ? err : worst;
    }
  p->ok = worst < 1e-5;
  printf("PE %u of %u (%s): %d tokens, top-%d of %d experts (%d here); y %s (max error %.1e)\n", p->rank,
         p->pes, p->platform == XCALL_PLATFORM_CUDA ? "cuda" : "host", T, K, E, local,
         p->ok ? "right" : "WRONG", worst);

  PE_TRY(xcall_ep_group_free(g, w)); /* collective: peers are done reading */
  PE_TRY(xcall_shmem_finalize(w, NULL));
  xcall_shmem_world_free(w);
  mem_free(&m, d_x);
  mem_free(&m, d_ids);
  mem_free(&m, d_probs);
  mem_free(&m, d_rows);
  mem_free(&m, d_tpe);
  mem_free(&m, d_out);
  mem_free(&m, d_y);
  mem_free(&m, d_scales);
  if (m.on_cuda) m.cuda.cuStreamDestroy(m.stream);
  return NULL;
}

int main(int argc, char **argv) {
  const xcall_platform platform = example_platform(argc, argv);
  pthread_t threads[MAX_PES];
  struct pe pes[MAX_PES];
  uint32_t r, n = 2;
  int ok = 1;
  if (platform == XCALL_PLATFORM_CUDA) {
    size_t count = 0;
    TRY(xcall_device_count(XCALL_PLATFORM_CUDA, &count));
    n = count < MAX_PES ? (uint32_t)count : MAX_PES;
    if (n == 3) n = 2; /* E = 8 experts split evenly over 1, 2 or 4 PEs */
  }
  for (r = 0; r < n; r++) {
    pes[r].rank = r;
    pes[r].pes = n;
    pes[r].platform = platform;
    pes[r].ok = 0;
    if (pthread_create(&threads[r], NULL, run_pe, &pes[r]) != 0) return 1;
  }
  for (r = 0; r < n; r++) {
    pthread_join(threads[r], NULL);
    ok &= pes[r].ok;
  }
  return ok ? 0 : 1;
}
