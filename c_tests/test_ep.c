/*
 * Expert parallelism through the C ABI, on Host: PES PEs (pthreads) of a
 * symmetric-memory world, each with up to T tokens of H floats routed to
 * K of E experts (E / PES on each PE). Every PE dispatches, runs its
 * experts (y = x * scale_e) on the expert-major rows it received, and
 * combines; then the backward halves. Every output is checked against a
 * plain loop over all PEs' inputs (each PE rebuilds its peers' inputs
 * from their rank): the expert-major rows and counts, y, grad_x,
 * grad_expert_out and grad_probs; dropless with alignment, then with a
 * capacity (dropped routes counted and left out of y); dispatch and
 * combine of bf16 rows. Then the bad-input
 * cases, each refused with its status and nothing written.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "xcall_test.h"

enum { PES = 4, T = 24, H = 8, K = 3, E = 8, L = E / PES };

struct pe {
  uint32_t rank;
  int failures; /* counted per thread; checked by the main thread */
  uint64_t leaked;
  uint64_t dropped;
};

/* Deterministic inputs of PE r: token t, element j, top-k slot s. */
static int tokens_of(int r) { return T - 2 * r; }
static float x_of(int r, int t, int j) { return (float)((t * 7 + j * 5 + r * 3) % 24 - 12) * 0.25f; }
static float g_of(int r, int t, int j) { return (float)((t * 3 + j * 11 + r) % 10 - 5) * 0.125f; }
static int id_of(int r, int t, int s) {
  if (s == 2 && (t + r) % 5 == 0) return -1; /* no route */
  return ((t * 5 + r * 3) % E + s * 3) % E;  /* slots 0, 3, 6 apart: distinct */
}
static float prob_of(int r, int t, int s) { return 0.2f + 0.1f * (float)s + 0.01f * (float)((t + r) % 4); }
static float scale_of(int e) { return 0.5f + (float)e / E; }

/* Whether route (r, t, s) is kept with `capacity` (0: dropless): experts
 * take routes in (sender rank, token, slot) order. `row` gets the route's
 * rank among its expert's kept routes. */
static int kept(int r, int t, int s, uint64_t capacity, int *row) {
  int e = id_of(r, t, s), n = 0;
  if (e < 0) return 0;
  for (int q = 0; q < PES; q++)
    for (int u = 0; u < tokens_of(q); u++)
      for (int v = 0; v < K; v++) {
        if (q == r && u == t && v == s) {
          if (row != NULL) *row = n;
          return capacity == 0 || (uint64_t)n < capacity;
        }
        n += id_of(q, u, v) == e;
      }
  return 0;
}

static int near(double got, double want) { return fabs(got - want) <= 1e-5 * (fabs(want) + 1.0); }

static void *buffer(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  return aligned_alloc(64, rounded > 0 ? rounded : 64);
}

static xcall_ep_config config_of(uint64_t align, uint64_t capacity) {
  xcall_ep_config c;
  memset(&c, 0, sizeof c);
  c.tokens = T;
  c.hidden = H;
  c.topk = K;
  c.experts = E;
  c.align = align;
  c.capacity = capacity;
  c.precision = XCALL_EP_PRECISION_F32;
  return c;
}

/* The caller's buffers of one group. */
struct bufs {
  xcall_ep_sizes s;
  float *x, *probs, *rows, *expert_out, *y, *grad_x, *grad_y, *grad_rows, *grad_probs;
  int32_t *ids;
  int64_t *tpe, *padded, *offsets;
  xcall_ep_expert_major out;
};

static void bufs_new(struct bufs *b, const xcall_ep_sizes *s) {
  memset(b, 0, sizeof *b);
  b->s = *s;
  b->x = buffer(s->token_rows_bytes);
  b->y = buffer(s->token_rows_bytes);
  b->grad_x = buffer(s->token_rows_bytes);
  b->grad_y = buffer(s->token_rows_bytes);
  b->ids = buffer(s->routing_bytes);
  b->probs = buffer(s->routing_bytes);
  b->grad_probs = buffer(s->routing_bytes);
  b->rows = buffer(s->rows_bytes);
  b->expert_out = buffer(s->expert_out_bytes);
  b->grad_rows = buffer(s->expert_out_bytes);
  b->tpe = buffer(s->tokens_per_expert_bytes);
  b->padded = buffer(s->tokens_per_expert_bytes);
  b->offsets = buffer(s->offsets_bytes);
  b->out = (xcall_ep_expert_major){
      .rows = b->rows, .rows_bytes = s->rows_bytes,
      .tokens_per_expert = b->tpe, .tokens_per_expert_bytes = s->tokens_per_expert_bytes,
      .padded_per_expert = b->padded, .padded_per_expert_bytes = s->tokens_per_expert_bytes,
      .offsets = b->offsets, .offsets_bytes = s->offsets_bytes};
}

static void bufs_free(struct bufs *b) {
  void *all[] = {b->x, b->y, b->grad_x, b->grad_y, b->ids, b->probs, b->grad_probs, b->rows,
                 b->expert_out, b->grad_rows, b->tpe, b->padded, b->offsets};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static void fill(float *p, size_t n, float v) {
  for (size_t i = 0; i < n; i++) p[i] = v;
}

/* The experts: expert_out = rows * scale_e on every received row; padding
 * rows are NaN (combine must not read them). */
static void experts(struct pe *p, struct bufs *b) {
  fill(b->expert_out, b->s.expert_rows * H, NAN);
  for (int l = 0; l < L; l++) {
    float scale = scale_of((int)p->rank * L + l);
    for (int64_t i = b->offsets[l]; i < b->offsets[l] + b->tpe[l]; i++)
      for (int j = 0; j < H; j++) b->expert_out[i * H + j] = b->rows[i * H + j] * scale;
  }
}

/* Checks the expert-major layout this PE received against the loop. */
static void check_layout(struct pe *p, const struct bufs *b, uint64_t align, uint64_t capacity) {
  int64_t start = 0, dropped = 0;
  for (int l = 0; l < L; l++) {
    int e = (int)p->rank * L + l;
    int64_t n = 0, wrong = 0;
    for (int q = 0; q < PES; q++)
      for (int t = 0; t < tokens_of(q); t++)
        for (int s = 0; s < K; s++) {
          if (id_of(q, t, s) != e) continue;
          if (!kept(q, t, s, capacity, NULL)) {
            dropped++;
            continue;
          }
          for (int j = 0; j < H; j++) wrong += b->rows[(start + n) * H + j] != x_of(q, t, j);
          n++;
        }
    int64_t padded = (n + (int64_t)align - 1) / (int64_t)align * (int64_t)align;
    PE_EXPECT(b->tpe[l] == n);
    PE_EXPECT(b->padded[l] == padded);
    PE_EXPECT(b->offsets[l] == start);
    PE_EXPECT(wrong == 0);
    start += padded;
  }
  PE_EXPECT(b->offsets[L] == start);
  p->dropped = (uint64_t)dropped;
}

/* y, grad_x, grad_probs of this PE's tokens and grad_expert_out of its
 * experts' rows against the loop. */
static void check_results(struct pe *p, const struct bufs *b, uint64_t capacity, int backward) {
  int r = (int)p->rank, bad_y = 0, bad_gx = 0, bad_gp = 0, bad_ge = 0;
  for (int t = 0; t < tokens_of(r); t++) {
    for (int j = 0; j < H; j++) {
      double y = 0, gx = 0;
      for (int s = 0; s < K; s++) {
        if (!kept(r, t, s, capacity, NULL)) continue;
        double v = (double)x_of(r, t, j) * scale_of(id_of(r, t, s));
        y += prob_of(r, t, s) * v;
        gx += v;
      }
      bad_y += !near(b->y[t * H + j], y);
      if (backward) bad_gx += !near(b->grad_x[t * H + j], gx);
    }
    for (int s = 0; backward && s < K; s++) {
      double dot = 0;
      if (kept(r, t, s, capacity, NULL))
        for (int j = 0; j < H; j++) dot += (double)x_of(r, t, j) * scale_of(id_of(r, t, s)) * g_of(r, t, j);
      bad_gp += !near(b->grad_probs[t * K + s], dot);
    }
  }
  /* Row of route (q, t, s) on this PE: its expert's start plus its rank. */
  for (int q = 0; backward && q < PES; q++)
    for (int t = 0; t < tokens_of(q); t++)
      for (int s = 0; s < K; s++) {
        int e = id_of(q, t, s), n = 0;
        if (e < 0 || e / L != r || !kept(q, t, s, capacity, &n)) continue;
        int64_t row = b->offsets[e % L] + n;
        for (int j = 0; j < H; j++)
          bad_ge += !near(b->grad_rows[row * H + j], (double)g_of(q, t, j) * prob_of(q, t, s));
      }
  PE_EXPECT(bad_y == 0);
  PE_EXPECT(bad_gx == 0);
  PE_EXPECT(bad_gp == 0);
  PE_EXPECT(bad_ge == 0);
}

/* One round on `g`: dispatch, experts, combine (and the backward halves),
 * each output checked. `x` is where the tokens are (the caller's buffer
 * or the group's send rows). */
static void round_on(struct pe *p, xcall_ep_group *g, struct bufs *b, float *x, uint64_t align,
                     uint64_t capacity, int backward) {
  int r = (int)p->rank, n = tokens_of(r);
  for (int t = 0; t < n; t++) {
    for (int j = 0; j < H; j++) {
      x[t * H + j] = x_of(r, t, j);
      b->grad_y[t * H + j] = g_of(r, t, j);
    }
    for (int s = 0; s < K; s++) {
      b->ids[t * K + s] = id_of(r, t, s);
      b->probs[t * K + s] = prob_of(r, t, s);
    }
  }
  fill(b->rows, b->s.expert_rows * H, NAN);
  fill(b->y, (size_t)T * H, NAN);
  fill(b->grad_x, (size_t)T * H, NAN);
  fill(b->grad_rows, b->s.expert_rows * H, NAN);
  fill(b->grad_probs, (size_t)T * K, NAN);
  const uint64_t row_bytes = (uint64_t)n * H * sizeof(float), route_bytes = (uint64_t)n * K * 4;
  PE_EXPECT(xcall_ep_dispatch(g, x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, (uint64_t)n,
                              &b->out, NULL) == XCALL_STATUS_OK);
  check_layout(p, b, align, capacity);
  experts(p, b);
  PE_EXPECT(xcall_ep_combine(g, b->expert_out, b->s.expert_out_bytes, b->y, row_bytes, NULL) ==
            XCALL_STATUS_OK);
  if (backward) {
    PE_EXPECT(xcall_ep_dispatch_backward(g, b->expert_out, b->s.expert_out_bytes, b->grad_x, row_bytes,
                                         NULL) == XCALL_STATUS_OK);
    PE_EXPECT(xcall_ep_combine_backward(g, b->grad_y, row_bytes, b->expert_out, b->s.expert_out_bytes,
                                        b->grad_rows, b->s.expert_out_bytes, b->grad_probs, route_bytes,
                                        NULL) == XCALL_STATUS_OK);
  }
  check_results(p, b, capacity, backward);
  uint64_t dropped = 99;
  PE_EXPECT(xcall_ep_dropped_routes(g, &dropped) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_ep_check(g) == XCALL_STATUS_OK);
  p->dropped = dropped == p->dropped ? dropped : UINT64_MAX;
}

/* Bad input on a live group, before its first dispatch: each refused with
 * its status, nothing written (this PE takes no part, so no peer waits). */
static void bad_input(struct pe *p, xcall_ep_group *g, struct bufs *b) {
  const uint64_t row_bytes = (uint64_t)T * H * 4, route_bytes = (uint64_t)T * K * 4;
  for (int i = 0; i < L; i++) b->tpe[i] = -7;
  for (int i = 0; i < T * K; i++) {
    b->ids[i] = 0;
    b->probs[i] = 1;
  }
  fill(b->y, (size_t)T * H, -7);
  xcall_ep_expert_major small = b->out;
  small.rows_bytes -= 1;
  xcall_ep_expert_major no_rows = b->out;
  no_rows.rows = NULL;
  xcall_ep_expert_major fp8_only = b->out;
  fp8_only.scales = b->grad_probs;
  fp8_only.scales_bytes = b->s.routing_bytes;
  /* Dispatch. */
  PE_EXPECT(xcall_ep_dispatch(NULL, b->x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T, &b->out,
                              NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_dispatch(g, b->x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T, NULL,
                              NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_dispatch(g, b->x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T, &no_rows,
                              NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_dispatch(g, NULL, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T, &b->out,
                              NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(strstr(xcall_last_error_message(), "x is NULL") != NULL);
  PE_EXPECT(xcall_ep_dispatch(g, b->x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T, &small,
                              NULL) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(strstr(xcall_last_error_message(), "out.rows holds") != NULL);
  PE_EXPECT(xcall_ep_dispatch(g, b->x, row_bytes, b->ids, route_bytes - 4, b->probs, route_bytes, T,
                              &b->out, NULL) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(xcall_ep_dispatch(g, b->x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T + 1,
                              &b->out, NULL) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(strstr(xcall_last_error_message(), "more than the group's") != NULL);
  PE_EXPECT(xcall_ep_dispatch(g, b->x, row_bytes, b->ids, route_bytes, b->probs, route_bytes, T, &fp8_only,
                              NULL) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(xcall_ep_dispatch(g, (char *)b->x + 4, row_bytes, b->ids, route_bytes, b->probs, route_bytes,
                              1, &b->out, NULL) == XCALL_STATUS_INVALID_ARGUMENT);
  int untouched = 1;
  for (int i = 0; i < L; i++) untouched &= b->tpe[i] == -7;
  PE_EXPECT(untouched);
  /* Combine and the backward halves before any dispatch. */
  PE_EXPECT(xcall_ep_combine(g, b->expert_out, b->s.expert_out_bytes, b->y, row_bytes, NULL) ==
            XCALL_STATUS_INVALID_STATE);
  PE_EXPECT(xcall_ep_combine(g, NULL, b->s.expert_out_bytes, b->y, row_bytes, NULL) ==
            XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_dispatch_backward(g, b->expert_out, b->s.expert_out_bytes, b->y, row_bytes, NULL) ==
            XCALL_STATUS_INVALID_STATE);
  PE_EXPECT(xcall_ep_combine_backward(g, b->grad_y, row_bytes, b->expert_out, b->s.expert_out_bytes,
                                      b->grad_rows, b->s.expert_out_bytes, b->grad_probs, route_bytes,
                                      NULL) == XCALL_STATUS_INVALID_STATE);
  untouched = 1;
  for (int i = 0; i < T * H; i++) untouched &= b->y[i] == -7;
  PE_EXPECT(untouched);
  /* The queries. */
  uint64_t dropped = 5;
  PE_EXPECT(xcall_ep_dropped_routes(g, NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_dropped_routes(NULL, &dropped) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(dropped == 5);
  PE_EXPECT(xcall_ep_check(NULL) == XCALL_STATUS_NULL_ARGUMENT);
  void *rows = NULL;
  uint64_t bytes = 0;
  PE_EXPECT(xcall_ep_send_rows(g, NULL, &bytes) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_send_rows(g, &rows, NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(rows == NULL && bytes == 0);
}

/* Foreign handles, and frees refused with the group left live. */
static void handles(struct pe *p, xcall_ep_group *g, xcall_shmem_world *w) {
  PE_EXPECT(xcall_ep_check((xcall_ep_group *)w) == XCALL_STATUS_INVALID_HANDLE);
  PE_EXPECT(strstr(xcall_last_error_message(), "not an xcall_ep_group") != NULL);
  PE_EXPECT(xcall_ep_group_free(g, NULL) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_group_free(g, (xcall_shmem_world *)g) == XCALL_STATUS_INVALID_HANDLE);
  /* A world of this PE alone: not the group's. */
  xcall_shmem_world *solo = NULL;
  char address[32];
  snprintf(address, sizeof address, "c-test-ep-solo-%u", p->rank);
  xcall_shmem_config c = {0};
  c.size = 1;
  c.target.platform = XCALL_PLATFORM_HOST;
  c.target.ordinal = 950 + p->rank;
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  c.address = address;
  c.heap_bytes = 1 << 16;
  c.timeout_ms = 20000;
  PE_EXPECT(xcall_shmem_world_new(&solo) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_shmem_init(solo, &c) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_ep_group_free(g, solo) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(strstr(xcall_last_error_message(), "the group was made on world") != NULL);
  PE_EXPECT(xcall_shmem_finalize(solo, NULL) == XCALL_STATUS_OK);
  xcall_shmem_world_free(solo);
  PE_EXPECT(xcall_ep_check(g) == XCALL_STATUS_OK); /* still live */
}

static uint16_t bf16_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
}
static float float_of(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* A bf16 group: rows arrive exactly (the inputs are bf16 values), y is
 * the loop's within bf16 rounding. */
static void bf16_round(struct pe *p, xcall_shmem_world *w, const xcall_ep_config *c, const xcall_ep_sizes *s) {
  xcall_ep_group *g = NULL;
  PE_EXPECT(xcall_ep_group_new(w, c, &g) == XCALL_STATUS_OK);
  if (g == NULL) return;
  int r = (int)p->rank, n = tokens_of(r), wrong_rows = 0, wrong_y = 0;
  uint16_t *x = buffer(s->token_rows_bytes), *y = buffer(s->token_rows_bytes);
  uint16_t *rows = buffer(s->rows_bytes), *expert_out = buffer(s->expert_out_bytes);
  int32_t *ids = buffer(s->routing_bytes);
  float *probs = buffer(s->routing_bytes);
  int64_t *tpe = buffer(s->tokens_per_expert_bytes), *offsets = buffer(s->offsets_bytes);
  for (int t = 0; t < n; t++) {
    for (int j = 0; j < H; j++) x[t * H + j] = bf16_of(x_of(r, t, j));
    for (int k = 0; k < K; k++) {
      ids[t * K + k] = id_of(r, t, k);
      probs[t * K + k] = prob_of(r, t, k);
    }
  }
  xcall_ep_expert_major out = {.rows = rows, .rows_bytes = s->rows_bytes, .tokens_per_expert = tpe,
                               .tokens_per_expert_bytes = s->tokens_per_expert_bytes, .offsets = offsets,
                               .offsets_bytes = s->offsets_bytes};
  for (size_t i = 0; i < s->expert_out_bytes / 2; i++) expert_out[i] = 0x7fc0; /* NaN */
  for (size_t i = 0; i < (size_t)T * H; i++) y[i] = 0x7fc0;
  const uint64_t row_bytes = (uint64_t)n * H * 2, route_bytes = (uint64_t)n * K * 4;
  PE_EXPECT(xcall_ep_dispatch(g, x, row_bytes, ids, route_bytes, probs, route_bytes, (uint64_t)n, &out, NULL) ==
            XCALL_STATUS_OK);
  for (int l = 0; l < L; l++) {
    int e = r * L + l, i = 0;
    float scale = scale_of(e);
    for (int q = 0; q < PES; q++)
      for (int t = 0; t < tokens_of(q); t++)
        for (int k = 0; k < K; k++)
          if (id_of(q, t, k) == e) {
            for (int j = 0; j < H; j++) wrong_rows += float_of(rows[(offsets[l] + i) * H + j]) != x_of(q, t, j);
            i++;
          }
    PE_EXPECT(tpe[l] == i);
    for (int64_t row = offsets[l]; row < offsets[l] + tpe[l]; row++)
      for (int j = 0; j < H; j++) expert_out[row * H + j] = bf16_of(float_of(rows[row * H + j]) * scale);
  }
  PE_EXPECT(xcall_ep_combine(g, expert_out, s->expert_out_bytes, y, row_bytes, NULL) == XCALL_STATUS_OK);
  for (int t = 0; t < n; t++)
    for (int j = 0; j < H; j++) {
      double want = 0, size = 0;
      for (int k = 0; k < K; k++)
        if (id_of(r, t, k) >= 0) {
          double term = prob_of(r, t, k) * (double)x_of(r, t, j) * scale_of(id_of(r, t, k));
          want += term;
          size += fabs(term);
        }
      /* Each expert output and y are rounded to bf16 (2^-9 relative). */
      wrong_y += !(fabs(float_of(y[t * H + j]) - want) <= 6e-3 * size + 1e-6);
    }
  PE_EXPECT(wrong_rows == 0);
  PE_EXPECT(wrong_y == 0);
  PE_EXPECT(xcall_ep_group_free(g, w) == XCALL_STATUS_OK);
  void *all[] = {x, y, rows, expert_out, ids, probs, tpe, offsets};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static xcall_ep_group *group_new(struct pe *p, xcall_shmem_world *w, const xcall_ep_config *c) {
  xcall_ep_group *g = NULL;
  PE_EXPECT(xcall_ep_group_new(w, c, &g) == XCALL_STATUS_OK);
  return g;
}

static void *run_pe(void *arg) {
  struct pe *p = arg;
  const xcall_ep_config dropless = config_of(4, 0), capped = config_of(1, 5);
  xcall_ep_config bf16 = config_of(1, 0);
  bf16.precision = XCALL_EP_PRECISION_BF16;
  xcall_ep_sizes s1, s2, s3;
  PE_EXPECT(xcall_ep_layout(&dropless, PES, &s1) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_ep_layout(&capped, PES, &s2) == XCALL_STATUS_OK);
  PE_EXPECT(xcall_ep_layout(&bf16, PES, &s3) == XCALL_STATUS_OK);
  PE_EXPECT(s3.token_rows_bytes == (uint64_t)T * H * 2 && s3.rows_bytes == s3.expert_rows * H * 2);
  xcall_shmem_world *w = NULL;
  PE_EXPECT(xcall_shmem_world_new(&w) == XCALL_STATUS_OK);
  xcall_shmem_config c = {0};
  c.rank = p->rank;
  c.size = PES;
  c.target.platform = XCALL_PLATFORM_HOST;
  c.target.ordinal = 900 + p->rank;
  c.bootstrap = XCALL_SHMEM_BOOTSTRAP_IN_PROCESS;
  c.address = "c-test-ep";
  c.heap_bytes = s1.heap_bytes + s2.heap_bytes + s3.heap_bytes + (1 << 16);
  c.timeout_ms = 20000;
  PE_EXPECT(xcall_shmem_init(w, &c) == XCALL_STATUS_OK);
  if (p->failures) return NULL;

  /* A config every PE refuses before the collective: nothing made. */
  xcall_ep_config bad = dropless;
  bad.topk = E + 1;
  xcall_ep_group *none = (xcall_ep_group *)&bad;
  PE_EXPECT(xcall_ep_group_new(w, &bad, &none) == XCALL_STATUS_INVALID_ARGUMENT);
  PE_EXPECT(none == (xcall_ep_group *)&bad);
  PE_EXPECT(xcall_ep_group_new(w, NULL, &none) == XCALL_STATUS_NULL_ARGUMENT);
  PE_EXPECT(xcall_ep_group_new(w, &dropless, NULL) == XCALL_STATUS_NULL_ARGUMENT);

  /* Dropless, alignment 4, with the backward halves; then again with the
   * tokens written into the group's own send rows. */
  xcall_ep_group *g = group_new(p, w, &dropless);
  struct bufs b;
  bufs_new(&b, &s1);
  if (g != NULL) {
    bad_input(p, g, &b);
    handles(p, g, w);
    round_on(p, g, &b, b.x, 4, 0, 1);
    PE_EXPECT(p->dropped == 0);
    void *send = NULL;
    uint64_t send_bytes = 0;
    PE_EXPECT(xcall_ep_send_rows(g, &send, &send_bytes) == XCALL_STATUS_OK);
    PE_EXPECT(send != NULL && send_bytes == s1.token_rows_bytes);
    if (send != NULL) round_on(p, g, &b, send, 4, 0, 0);
    PE_EXPECT(xcall_ep_group_free(g, w) == XCALL_STATUS_OK);
    PE_EXPECT(xcall_ep_check(g) == XCALL_STATUS_INVALID_HANDLE);
  }
  bufs_free(&b);
  PE_EXPECT(xcall_ep_group_free(NULL, w) == XCALL_STATUS_OK);

  /* A capacity of 5 rows per expert: dropped routes counted, left out. */
  g = group_new(p, w, &capped);
  bufs_new(&b, &s2);
  if (g != NULL) {
    round_on(p, g, &b, b.x, 1, 5, 1);
    PE_EXPECT(p->dropped != UINT64_MAX);
    PE_EXPECT(xcall_ep_group_free(g, w) == XCALL_STATUS_OK);
  }
  bufs_free(&b);
  bf16_round(p, w, &bf16, &s3);
  PE_EXPECT(xcall_shmem_finalize(w, &p->leaked) == XCALL_STATUS_OK);
  xcall_shmem_world_free(w);
  return NULL;
}

/* The size query: sizes from the config alone; bad shapes refused with
 * nothing written. */
static void layout_cases(void) {
  xcall_ep_config c = config_of(4, 0);
  xcall_ep_sizes s;
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_OK);
  CHECK(s.local_experts == L);
  CHECK(s.expert_rows == (uint64_t)PES * T * L + L * 3); /* P*T*min(k, L), plus padding */
  CHECK(s.rows_bytes == s.expert_rows * H * 4);
  CHECK(s.expert_out_bytes == s.rows_bytes);
  CHECK(s.token_rows_bytes == (uint64_t)T * H * 4);
  CHECK(s.routing_bytes == (uint64_t)T * K * 4);
  CHECK(s.scales_bytes == 0 && s.rows_bf16_bytes == 0);
  CHECK(s.tokens_per_expert_bytes == L * 8 && s.offsets_bytes == (L + 1) * 8);
  CHECK(s.heap_bytes >= s.token_rows_bytes * (1 + 2 * PES));
  /* FP8: one-byte rows, a scale per 128 elements, bf16 everywhere else. */
  c.precision = XCALL_EP_PRECISION_FP8;
  c.hidden = 256;
  c.align = 1;
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_OK);
  CHECK(s.rows_bytes == s.expert_rows * 256);
  CHECK(s.scales_bytes == s.expert_rows * 2 * 4);
  CHECK(s.rows_bf16_bytes == s.expert_rows * 256 * 2 && s.expert_out_bytes == s.rows_bf16_bytes);
  CHECK(s.token_rows_bytes == (uint64_t)T * 256 * 2);

  const xcall_ep_sizes before = s;
  c = config_of(1, 0);
  c.topk = E + 1; /* k > E */
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "more than the 8 experts");
  c = config_of(1, 0);
  CHECK_STATUS(xcall_ep_layout(&c, 3, &s), XCALL_STATUS_INVALID_ARGUMENT); /* E % P */
  CHECK_STATUS(xcall_ep_layout(&c, 0, &s), XCALL_STATUS_INVALID_ARGUMENT);
  c.hidden = 3; /* 12-byte rows */
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_INVALID_ARGUMENT);
  c = config_of(1, 0);
  c.precision = 9;
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_INVALID_ARGUMENT);
  c = config_of(0, 0);
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_INVALID_ARGUMENT);
  c = config_of(1, 0);
  c.tokens = UINT64_MAX / 4;
  CHECK_STATUS(xcall_ep_layout(&c, PES, &s), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(xcall_ep_layout(NULL, PES, &s), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_ep_layout(&c, PES, NULL), XCALL_STATUS_NULL_ARGUMENT);
  CHECK(memcmp(&s, &before, sizeof s) == 0);
}

int main(void) {
  alarm(120); /* watchdog: a PE that never returns fails the test */
  layout_cases();
  pthread_t threads[PES];
  struct pe pes[PES];
  uint64_t dropped = 0;
  for (uint32_t r = 0; r < PES; r++) {
    memset(&pes[r], 0, sizeof pes[r]);
    pes[r].rank = r;
    CHECK(pthread_create(&threads[r], NULL, run_pe, &pes[r]) == 0);
  }
  for (uint32_t r = 0; r < PES; r++) {
    CHECK(pthread_join(threads[r], NULL) == 0);
    CHECK(pes[r].failures == 0);
    CHECK(pes[r].leaked == 0);
    dropped += pes[r].dropped;
  }
  CHECK(dropped > 0); /* the capacity took effect */
  return xt_summary("test_ep");
}
