/*
 * One expert-parallel MoE step through the C ABI only, on Host: two PEs
 * (pthreads) of a symmetric-memory world, each with T tokens and E / 2 of
 * the E experts. This is the flow `xcall moe` runs, written out in C, with
 * its two exchanges. Copied:
 *
 *   make_row_id_map (expert capacity C: expert e owns rows [e*C, (e+1)*C))
 *   permute            tokens -> send [E*C, H], grouped by expert
 *   dispatch           send slot q -> recv on PE q (put_signal, then wait)
 *   experts            out = silu(recv) * scale_e   (xcall_ws_run)
 *   combine            out slot p -> ret on PE p (put_signal, then wait)
 *   unpermute          ret -> y [T, H], weighted by the merging probs
 *
 * Fused: permute writes each destination's rows straight into its recv
 * slot for this PE (xcall_permute_segmented over the peers' addresses from
 * xcall_shmem_ptr), dispatch and combine are signals only, and unpermute
 * reads the results from each destination's out slot
 * (xcall_unpermute_segmented): no send or ret buffer is touched.
 *
 * Then the same layer with xcall's expert-parallel calls instead of the
 * written-out step (dropless, no capacity):
 *
 *   xcall_ep_dispatch      tokens -> expert-major rows on the experts' PEs
 *   xcall_ws_run_ragged    out = silu(rows) * scale_e, each expert's rows
 *   xcall_ep_combine       weighted sum back on each token's PE
 *
 * Each step runs through the graph cache (on Host the record function runs
 * directly; on CUDA the same code would be captured once and replayed,
 * which the fixed capacity layout, and the expert-parallel group's sizes,
 * make possible). Each PE checks y against a reference computed here with
 * plain loops.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "xcall_test.h"

enum { PES = 2, T = 16, H = 8, E = 4, LOCAL = E / PES, TOPK = 2, C = 7 };

struct pe {
  uint32_t rank;
  const xcall_graph_cache *cache;
  int failures;
  int fused;
  uint32_t outcome[3];
  uint64_t leaked;
  xcall_shmem_world *w;
  /* Symmetric buffers: the same offsets on both PEs. */
  float *x, *probs, *send, *recv, *out, *ret, *y;
  uint8_t *routing;
  int32_t *map;
  int64_t *tpe, *offsets;
  uint64_t *dispatch, *combine;
  /* The expert-parallel step's: its group, routing as ids, expert-major
   * rows and their counts, the experts' outputs and scales. */
  xcall_ep_group *group;
  xcall_ep_sizes sizes;
  int32_t *ids;
  float *ep_probs, *rows, *expert_out, *scales;
  int64_t *counts;
};

/* Returns from the record function with the failing call's status. */
#define TRY(call)                                                              \
  do {                                                                         \
    xcall_status s_ = (call);                                                  \
    if (s_ != XCALL_STATUS_OK) {                                               \
      fprintf(stderr, "rank %u: %s: %s (%s)\n", p->rank, #call,                \
              xcall_status_name(s_), xcall_last_error_message());              \
      return s_;                                                               \
    }                                                                          \
  } while (0)

static xcall_tensor tensor(void *data, xcall_dtype dtype, int64_t d0, int64_t d1) {
  xcall_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.rank = d1 > 0 ? 2 : 1;
  t.dims[0] = d0;
  t.dims[1] = d1;
  return t;
}

static float scale_of(int expert) { return 0.5f + (float)expert / E; }

/* Waits until every PE set its word of `words`, then clears the words. */
static xcall_status await_all(struct pe *p, uint64_t *words) {
  for (int q = 0; q < PES; q++) {
    TRY(xcall_shmem_wait_until(p->w, &words[q], XCALL_SHMEM_CMP_EQ, 1, NULL));
    __atomic_store_n(&words[q], 0, __ATOMIC_RELEASE);
  }
  return XCALL_STATUS_OK;
}

/* The step; the graph cache calls it (stream is NULL on Host). */
static uint32_t step(void *user_data, void *stream) {
  struct pe *p = user_data;
  const xcall_target target = {XCALL_PLATFORM_HOST, 0, stream};
  xcall_tensor routing = tensor(p->routing, XCALL_DTYPE_U8, T, E);
  xcall_tensor map = tensor(p->map, XCALL_DTYPE_I32, T, 2 * E + 1);
  xcall_tensor tpe = tensor(p->tpe, XCALL_DTYPE_I64, E, 0);
  xcall_tensor offsets = tensor(p->offsets, XCALL_DTYPE_I64, E + 1, 0);
  xcall_tensor x = tensor(p->x, XCALL_DTYPE_F32, T, H);
  xcall_tensor send = tensor(p->send, XCALL_DTYPE_F32, E * C, H);
  xcall_tensor ret = tensor(p->ret, XCALL_DTYPE_F32, E * C, H);
  xcall_tensor probs = tensor(p->probs, XCALL_DTYPE_F32, T, E);
  xcall_tensor y = tensor(p->y, XCALL_DTYPE_F32, T, H);
  const size_t slot = (size_t)LOCAL * C * H; /* floats per destination PE */
  const size_t block = (size_t)C * H;        /* floats per (sender, expert) */

  /* Fused: segment q is PE q's slot for this PE's rows. */
  const void *recv_at[PES], *out_at[PES];
  for (uint32_t q = 0; q < PES; q++) {
    recv_at[q] = xcall_shmem_ptr(p->w, q, p->recv + p->rank * slot);
    out_at[q] = xcall_shmem_ptr(p->w, q, p->out + p->rank * slot);
    if (recv_at[q] == NULL || out_at[q] == NULL) return XCALL_STATUS_INVALID_ARGUMENT;
  }
  const size_t bytes = slot * sizeof(float);

  TRY(xcall_make_row_id_map(&target, &routing, -1, 0, C, &map, &tpe, &offsets));
  if (p->fused) {
    xcall_tensor recv = tensor((void *)recv_at[0], XCALL_DTYPE_F32, E * C, H);
    TRY(xcall_permute_segmented(&target, &x, &map, &tpe, &offsets, &recv, recv_at, PES,
                                LOCAL * C));
  } else {
    TRY(xcall_permute(&target, &x, &map, &tpe, &offsets, NULL, NULL, &send, NULL, NULL, false));
  }
  /* Fused, the signal carries no bytes: the rows are already there. */
  for (uint32_t q = 0; q < PES; q++)
    TRY(xcall_shmem_put_signal(p->w, p->recv + p->rank * slot, p->send + q * slot,
                               p->fused ? 0 : bytes, &p->dispatch[p->rank], 1,
                               XCALL_SHMEM_SIGNAL_OP_SET, q));
  TRY(await_all(p, p->dispatch));
  for (int q = 0; q < PES; q++) {
    for (int l = 0; l < LOCAL; l++) {
      const void *in[1] = {p->recv + q * slot + l * block};
      TRY(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, stream}, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32,
                       NULL, in, 1, p->out + q * slot + l * block, block * sizeof(float),
                       scale_of((int)p->rank * LOCAL + l)));
    }
  }
  for (uint32_t q = 0; q < PES; q++)
    TRY(xcall_shmem_put_signal(p->w, p->ret + p->rank * slot, p->out + q * slot,
                               p->fused ? 0 : bytes, &p->combine[p->rank], 1,
                               XCALL_SHMEM_SIGNAL_OP_SET, q));
  TRY(await_all(p, p->combine));
  if (p->fused) {
    xcall_tensor out = tensor((void *)out_at[0], XCALL_DTYPE_F32, E * C, H);
    TRY(xcall_unpermute_segmented(&target, &out, out_at, PES, LOCAL * C, &map, &probs, &y));
  } else {
    TRY(xcall_unpermute(&target, &ret, &map, &probs, NULL, &y, NULL));
  }
  return XCALL_STATUS_OK;
}

/* The same layer through the expert-parallel group. */
static uint32_t ep_step(void *user_data, void *stream) {
  struct pe *p = user_data;
  const xcall_target target = {XCALL_PLATFORM_HOST, 0, stream};
  const xcall_ep_sizes *s = &p->sizes;
  xcall_ep_expert_major out = {0};
  out.rows = p->rows;
  out.rows_bytes = s->rows_bytes;
  out.tokens_per_expert = p->counts;
  out.tokens_per_expert_bytes = s->tokens_per_expert_bytes;
  TRY(xcall_ep_dispatch(p->group, p->x, s->token_rows_bytes, p->ids, s->routing_bytes, p->ep_probs,
                        s->routing_bytes, T, &out, stream));
  TRY(xcall_ws_run_ragged(&target, XCALL_DTYPE_F32, NULL, p->rows, p->expert_out, 1, LOCAL,
                          s->expert_out_bytes, H * sizeof(float), p->counts, p->scales));
  TRY(xcall_ep_combine(p->group, p->expert_out, s->expert_out_bytes, p->y, s->token_rows_bytes, stream));
  return XCALL_STATUS_OK;
}

static xcall_ep_config ep_config(void) {
  xcall_ep_config c = {0};
  c.tokens = T;
  c.hidden = H;
  c.topk = TOPK;
  c.experts = E;
  c.align = 1; /* packed: the ragged expert run reads the groups back to back */
  c.precision = XCALL_EP_PRECISION_F32;
  return c;
}

static void *alloc(struct pe *p, size_t bytes) {
  void *ptr = NULL;
  PE_EXPECT(xcall_shmem_malloc(p->w, bytes, &ptr) == XCALL_STATUS_OK);
  return ptr;
}

static void *run_pe(void *arg) {
  struct pe *p = arg;
  PE_EXPECT(xcall_shmem_world_new(&p->w) == XCALL_STATUS_OK);
  xcall_shmem_config c = {0};
  c.rank = p->rank;
  c.size = PES;
  c.target.platform = XCALL_PLATFORM_HOST;
  c.target.ordinal = 800 + p->rank;
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  c.address = "c-moe-step";
  const xcall_ep_config ep = ep_config();
  PE_EXPECT(xcall_ep_layout(&ep, PES, &p->sizes) == XCALL_STATUS_OK);
  c.heap_bytes = (1 << 20) + p->sizes.heap_bytes;
  c.timeout_ms = 20000;
  PE_EXPECT(xcall_shmem_init(p->w, &c) == XCALL_STATUS_OK);
  p->x = alloc(p, sizeof(float) * T * H);
  p->routing = alloc(p, T * E);
  p->probs = alloc(p, sizeof(float) * T * E);
  p->map = alloc(p, sizeof(int32_t) * T * (2 * E + 1));
  p->tpe = alloc(p, sizeof(int64_t) * E);
  p->offsets = alloc(p, sizeof(int64_t) * (E + 1));
  p->send = alloc(p, sizeof(float) * E * C * H);
  p->recv = alloc(p, sizeof(float) * E * C * H);
  p->out = alloc(p, sizeof(float) * E * C * H);
  p->ret = alloc(p, sizeof(float) * E * C * H);
  p->y = alloc(p, sizeof(float) * T * H);
  p->dispatch = alloc(p, sizeof(uint64_t) * PES);
  p->combine = alloc(p, sizeof(uint64_t) * PES);
  PE_EXPECT(xcall_ep_group_new(p->w, &ep, &p->group) == XCALL_STATUS_OK);
  /* The caller's buffers of the expert-parallel step (host memory). */
  p->ids = malloc(p->sizes.routing_bytes);
  p->ep_probs = malloc(p->sizes.routing_bytes);
  p->rows = aligned_alloc(16, p->sizes.rows_bytes);
  p->expert_out = aligned_alloc(16, p->sizes.expert_out_bytes);
  p->counts = malloc(p->sizes.tokens_per_expert_bytes);
  p->scales = malloc(sizeof(float) * LOCAL);
  if (p->failures) return NULL;

  /* Inputs: values in [-3, 3); token t picks experts (t + rank) % E and
   * (3t + 1) % E (or the next one), so expert loads differ and some exceed
   * the capacity C; merging probs 0.7 / 0.3. */
  for (int t = 0; t < T; t++) {
    for (int j = 0; j < H; j++)
      p->x[t * H + j] = (float)((t * 7 + j * 5 + (int)p->rank * 3) % 24) * 0.25f - 3.0f;
    int a = (t + (int)p->rank) % E, b = (3 * t + 1) % E;
    if (b == a) b = (b + 1) % E;
    for (int e = 0; e < E; e++) {
      p->routing[t * E + e] = (uint8_t)(e == a || e == b);
      p->probs[t * E + e] = e == a ? 0.7f : e == b ? 0.3f : 0.0f;
    }
    p->ids[t * TOPK] = a;
    p->ids[t * TOPK + 1] = b;
    p->ep_probs[t * TOPK] = 0.7f;
    p->ep_probs[t * TOPK + 1] = 0.3f;
  }
  for (int l = 0; l < LOCAL; l++) p->scales[l] = scale_of((int)p->rank * LOCAL + l);
  for (int q = 0; q < PES; q++) p->dispatch[q] = p->combine[q] = 0;

  xcall_buffer bufs[] = {
      {(uint64_t)(uintptr_t)p->x, sizeof(float) * T * H, XCALL_BUFFER_ROLE_IN},
      {(uint64_t)(uintptr_t)p->routing, T * E, XCALL_BUFFER_ROLE_IN},
      {(uint64_t)(uintptr_t)p->y, sizeof(float) * T * H, XCALL_BUFFER_ROLE_OUT},
  };
  /* The copied step, then the fused one (its own cache key). */
  for (int fused = 0; fused < 2; fused++) {
    p->fused = fused;
    for (int i = 0; i < T * H; i++) p->y[i] = NAN; /* poison */
    for (size_t i = 0; i < (size_t)E * C * H; i++) p->send[i] = p->ret[i] = NAN;
    PE_EXPECT(xcall_shmem_barrier_all(p->w) == XCALL_STATUS_OK);
    xcall_call call = {{XCALL_PLATFORM_HOST, 0, NULL}, 0x6d6f65, T * 1000 + H + fused, bufs, 3, 0};
    PE_EXPECT(xcall_graph_cache_execute(p->cache, &call, step, p, &p->outcome[fused]) ==
              XCALL_STATUS_OK);

    /* Reference: expert e keeps its first C tokens; y = sum over kept
     * routes of prob * silu(x) * scale_e. */
    int taken[E] = {0}, dropped = 0;
    double worst = 0;
    for (int t = 0; t < T; t++) {
      int kept[E];
      for (int e = 0; e < E; e++) {
        kept[e] = p->routing[t * E + e] && taken[e] < C;
        taken[e] += kept[e];
        dropped += p->routing[t * E + e] && !kept[e];
      }
      for (int j = 0; j < H; j++) {
        double v = p->x[t * H + j], want = 0;
        for (int e = 0; e < E; e++)
          if (kept[e]) want += p->probs[t * E + e] * v / (1.0 + exp(-v)) * scale_of(e);
        double err = fabs(p->y[t * H + j] - want) / (fabs(want) + 1e-6);
        worst = err > worst || isnan(err) ? err : worst;
      }
    }
    PE_EXPECT(!isnan(worst) && worst < 1e-5);
    PE_EXPECT(dropped > 0); /* the capacity took effect */
    /* Fused, the send and ret buffers were never touched. */
    if (fused) {
      int untouched = 1;
      for (size_t i = 0; i < (size_t)E * C * H; i++)
        untouched &= isnan(p->send[i]) && isnan(p->ret[i]);
      PE_EXPECT(untouched);
    }
    /* No PE poisons the next run's buffers while a peer still reads. */
    PE_EXPECT(xcall_shmem_barrier_all(p->w) == XCALL_STATUS_OK);
  }

  /* The expert-parallel step: every route lands (dropless). */
  for (int i = 0; i < T * H; i++) p->y[i] = NAN;
  xcall_call call = {{XCALL_PLATFORM_HOST, 0, NULL}, 0x6d6f65, T * 1000 + H + 2, bufs, 3, 0};
  PE_EXPECT(xcall_graph_cache_execute(p->cache, &call, ep_step, p, &p->outcome[2]) == XCALL_STATUS_OK);
  double worst = 0;
  for (int t = 0; t < T; t++)
    for (int j = 0; j < H; j++) {
      double v = p->x[t * H + j], want = 0;
      for (int e = 0; e < E; e++) want += p->probs[t * E + e] * v / (1.0 + exp(-v)) * scale_of(e);
      double err = fabs(p->y[t * H + j] - want) / (fabs(want) + 1e-6);
      worst = err > worst || isnan(err) ? err : worst;
    }
  PE_EXPECT(!isnan(worst) && worst < 1e-5);
  PE_EXPECT(xcall_ep_group_free(p->group, p->w) == XCALL_STATUS_OK);
  free(p->ids);
  free(p->ep_probs);
  free(p->rows);
  free(p->expert_out);
  free(p->counts);
  free(p->scales);

  void *all[] = {p->x, p->routing, p->probs, p->map, p->tpe, p->offsets, p->send,
                 p->recv, p->out, p->ret, p->y, p->dispatch, p->combine};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    PE_EXPECT(xcall_shmem_free(p->w, all[i]) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_finalize(p->w, &p->leaked) == XCALL_STATUS_OK);
  xcall_shmem_world_free(p->w);
  return NULL;
}

int main(void) {
  xcall_graph_cache *cache = NULL;
  CHECK_STATUS(xcall_graph_cache_new(NULL, &cache), XCALL_STATUS_OK);
  pthread_t threads[PES];
  struct pe pes[PES];
  for (uint32_t r = 0; r < PES; r++) {
    memset(&pes[r], 0, sizeof pes[r]);
    pes[r].rank = r;
    pes[r].cache = cache;
    CHECK(pthread_create(&threads[r], NULL, run_pe, &pes[r]) == 0);
  }
  for (uint32_t r = 0; r < PES; r++) {
    CHECK(pthread_join(threads[r], NULL) == 0);
    CHECK(pes[r].failures == 0);
    CHECK(pes[r].outcome[0] == XCALL_GRAPH_OUTCOME_EAGER_HOST);
    CHECK(pes[r].outcome[1] == XCALL_GRAPH_OUTCOME_EAGER_HOST);
    CHECK(pes[r].outcome[2] == XCALL_GRAPH_OUTCOME_EAGER_HOST);
    CHECK(pes[r].leaked == 0);
  }
  xcall_graph_stats stats;
  CHECK_STATUS(xcall_graph_cache_stats(cache, &(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, &stats), XCALL_STATUS_OK);
  CHECK(stats.eager_host == 3 * PES);
  xcall_graph_cache_free(cache);
  return xt_summary("test_moe_step");
}
