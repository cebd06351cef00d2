/*
 * permute_round_trip: the MoE token permutation an expert-parallel layer
 * runs, through the C ABI.
 *
 *   permute_round_trip [host|cuda]
 *
 * T tokens of H floats are routed top-2 over E experts. make_row_id_map
 * builds the map, permute groups the tokens by expert (with their router
 * probs), and unpermute with the probs as merging weights restores token
 * order: out[t] = x[t] * (p[t, e1] + p[t, e2]). The program checks that
 * against a loop of its own.
 */
#include "cuda_driver.h"
#include "example.h"

#include <math.h>
#include <stdint.h>

enum { T = 64, E = 8, K = 2, H = 128, N = T * K };

/* A dense tensor of rank 1 or 2 on `device`. */
static xcall_tensor tensor(void *data, xcall_dtype dtype, uint32_t rank, int64_t d0, int64_t d1) {
  xcall_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dims[0] = d0;
  t.dims[1] = d1;
  t.rank = rank;
  t.dtype = dtype;
  return t;
}

int main(int argc, char **argv) {
  const xcall_platform platform = example_platform(argc, argv);
  static uint8_t routing[T][E];
  static float x[T][H], probs[T][E], out[T][H];
  struct cuda_driver cuda = {0};
  CUstream stream = NULL;
  CUdeviceptr d[9] = {0};
  /* Where each tensor lives: the arrays above on Host, device copies on CUDA. */
  void *routing_at = routing, *x_at = x, *probs_at = probs, *out_at = out;
  void *map_at, *tpe_at, *offsets_at, *permuted_at, *pprobs_at;
  static int32_t map[T][2 * E + 1];
  static int64_t tpe[E], offsets[E + 1];
  static float permuted[N][H], pprobs[N];
  int t, e, j, wrong = 0;
  double worst = 0.0;

  for (t = 0; t < T; t++) {
    int e1 = t % E, e2 = (3 * t + 1) % E == e1 ? (e1 + 1) % E : (3 * t + 1) % E;
    routing[t][e1] = routing[t][e2] = 1;
    for (e = 0; e < E; e++) probs[t][e] = routing[t][e] ? 0.25f + 0.0625f * (float)((t + e) % 8) : 0.0f;
    for (j = 0; j < H; j++) x[t][j] = (float)((t * 131 + j * 7) % 97) / 16.0f - 3.0f;
  }
  map_at = map;
  tpe_at = tpe;
  offsets_at = offsets;
  permuted_at = permuted;
  pprobs_at = pprobs;

  if (platform == XCALL_PLATFORM_CUDA) {
    const size_t sizes[9] = {sizeof routing, sizeof x, sizeof probs, sizeof out, sizeof map,
                             sizeof tpe,     sizeof offsets, sizeof permuted, sizeof pprobs};
    int i;
    if (cuda_driver_open(&cuda, 0) != 0 || cuda.cuStreamCreate(&stream, 0) != 0) return 1;
    for (i = 0; i < 9; i++)
      if (cuda.cuMemAlloc(&d[i], sizes[i]) != 0) return 1;
    if (cuda.cuMemcpyHtoD(d[0], routing, sizeof routing) != 0 || cuda.cuMemcpyHtoD(d[1], x, sizeof x) != 0 ||
        cuda.cuMemcpyHtoD(d[2], probs, sizeof probs) != 0)
      return 1;
    routing_at = (void *)(uintptr_t)d[0];
    x_at = (void *)(uintptr_t)d[1];
    probs_at = (void *)(uintptr_t)d[2];
    out_at = (void *)(uintptr_t)d[3];
    map_at = (void *)(uintptr_t)d[4];
    tpe_at = (void *)(uintptr_t)d[5];
    offsets_at = (void *)(uintptr_t)d[6];
    permuted_at = (void *)(uintptr_t)d[7];
    pprobs_at = (void *)(uintptr_t)d[8];
  }

  {
    const xcall_target where = {platform, 0, stream};
    xcall_tensor routing_t = tensor(routing_at, XCALL_DTYPE_U8, 2, T, E);
    xcall_tensor x_t = tensor(x_at, XCALL_DTYPE_F32, 2, T, H);
    xcall_tensor probs_t = tensor(probs_at, XCALL_DTYPE_F32, 2, T, E);
    xcall_tensor out_t = tensor(out_at, XCALL_DTYPE_F32, 2, T, H);
    xcall_tensor map_t = tensor(map_at, XCALL_DTYPE_I32, 2, T, 2 * E + 1);
    xcall_tensor tpe_t = tensor(tpe_at, XCALL_DTYPE_I64, 1, E, 0);
    xcall_tensor offsets_t = tensor(offsets_at, XCALL_DTYPE_I64, 1, E + 1, 0);
    xcall_tensor permuted_t = tensor(permuted_at, XCALL_DTYPE_F32, 2, N, H);
    xcall_tensor pprobs_t = tensor(pprobs_at, XCALL_DTYPE_F32, 1, N, 0);

    /* No cap (-1), no padding (0), no fixed capacity (0). */
    TRY(xcall_make_row_id_map(&where, &routing_t, -1, 0, 0, &map_t, &tpe_t, &offsets_t));
    TRY(xcall_permute(&where, &x_t, &map_t, &tpe_t, &offsets_t, &probs_t, NULL, &permuted_t, &pprobs_t, NULL,
                      false));
    /* ... each expert would transform its rows [offsets[e], offsets[e+1]) here ... */
    TRY(xcall_unpermute(&where, &permuted_t, &map_t, &probs_t, NULL, &out_t, NULL));
  }
  if (platform == XCALL_PLATFORM_CUDA &&
      (cuda.cuStreamSynchronize(stream) != 0 || cuda.cuMemcpyDtoH(out, (CUdeviceptr)(uintptr_t)out_at, sizeof out) != 0 ||
       cuda.cuMemcpyDtoH(offsets, (CUdeviceptr)(uintptr_t)offsets_at, sizeof offsets) != 0))
    return 1;

  if (platform == XCALL_PLATFORM_CUDA) {
    int i;
    for (i = 0; i < 9; i++) cuda.cuMemFree(d[i]);
    cuda.cuStreamDestroy(stream);
  }

  for (t = 0; t < T; t++) {
    double weight = 0.0;
    for (e = 0; e < E; e++) weight += probs[t][e];
    for (j = 0; j < H; j++) {
      double want = (double)x[t][j] * weight, err = fabs((double)out[t][j] - want);
      worst = err > worst ? err : worst;
      wrong += err > 1e-5 * (1.0 + fabs(want));
    }
  }
  printf("%s: %d tokens, %d experts, top-%d, %d rows permuted; round trip %s (max abs error %.2e)\n",
         platform == XCALL_PLATFORM_CUDA ? "cuda" : "host", T, E, K, (int)offsets[E], wrong ? "WRONG" : "right",
         worst);
  return wrong || offsets[E] != N ? 1 : 0;
}
