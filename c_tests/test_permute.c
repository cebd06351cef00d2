/* MoE permutation through the C ABI on Host: row-id map, permute and
 * unpermute round trip against loops written here, chunk sort, the alias
 * table, the aliasing refusal (nothing written) and bad arguments. */
#include "xcall_test.h"

enum { T = 6, E = 3, H = 5 };

int main(void) {
  const xcall_target host = {XCALL_PLATFORM_HOST, 0, NULL};
  /* Token t routes to experts (t % 3) and ((t + 1) % 3) when t is even,
   * to expert 2 only when t is odd; token 5 routes nowhere. */
  uint8_t routing[T][E] = {{1, 1, 0}, {0, 0, 1}, {0, 1, 1}, {0, 0, 1}, {1, 0, 1}, {0, 0, 0}};
  int32_t map[T][2 * E + 1];
  int64_t tpe[E], offsets[E + 1];
  float input[T][H], probs[T][E], output[16][H], pprobs[16], back[T][H];
  int64_t counts[E] = {0, 0, 0}, n = 0, start[E], rank[E] = {0, 0, 0};
  int t, e, j, k, ok;
  xcall_tensor r_t = xt_tensor(routing, XCALL_DTYPE_U8, 2, T, E);
  xcall_tensor map_t = xt_tensor(map, XCALL_DTYPE_I32, 2, T, 2 * E + 1);
  xcall_tensor tpe_t = xt_tensor(tpe, XCALL_DTYPE_I64, 1, E, 0);
  xcall_tensor off_t = xt_tensor(offsets, XCALL_DTYPE_I64, 1, E + 1, 0);
  xcall_tensor in_t = xt_tensor(input, XCALL_DTYPE_F32, 2, T, H);
  xcall_tensor probs_t = xt_tensor(probs, XCALL_DTYPE_F32, 2, T, E);
  xcall_tensor out_t, pp_t, back_t, bad;
  xcall_alias_pair pairs[4];
  size_t count = 99;

  for (t = 0; t < T; t++) {
    for (j = 0; j < H; j++) input[t][j] = (float)(t * 10 + j) + 0.25f;
    for (e = 0; e < E; e++) probs[t][e] = 0.5f + 0.125f * (float)((t + e) % 4);
  }
  /* Expected destinations: expert-major, tokens ascending within an expert. */
  for (t = 0; t < T; t++)
    for (e = 0; e < E; e++) counts[e] += routing[t][e];
  for (e = 0; e < E; e++) {
    start[e] = n;
    n += counts[e];
  }

  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_OK);
  CHECK(offsets[E] == n && n == 8);
  ok = 1;
  for (t = 0; t < T; t++) {
    k = 0;
    for (e = 0; e < E; e++) {
      if (!routing[t][e]) continue;
      ok &= map[t][k] == start[e] + rank[e] && map[t][E + k] == e;
      rank[e]++;
      k++;
    }
    ok &= map[t][2 * E] == k;
  }
  CHECK(ok);
  for (e = 0; e < E; e++) CHECK(tpe[e] == counts[e] && offsets[e] == start[e]);

  /* permute with probs. */
  memset(output, 0xa5, sizeof output);
  out_t = xt_tensor(output, XCALL_DTYPE_F32, 2, n, H);
  pp_t = xt_tensor(pprobs, XCALL_DTYPE_F32, 1, n, 0);
  CHECK_STATUS(xcall_permute(&host, &in_t, &map_t, &tpe_t, &off_t, &probs_t, NULL, &out_t, &pp_t, NULL, false),
               XCALL_STATUS_OK);
  ok = 1;
  for (t = 0; t < T; t++)
    for (k = 0; k < map[t][2 * E]; k++) {
      int d = map[t][k];
      ok &= memcmp(output[d], input[t], sizeof input[t]) == 0;
      ok &= pprobs[d] == probs[t][map[t][E + k]];
    }
  CHECK(ok);

  /* unpermute with the same probs as merging weights: sum of weighted copies. */
  back_t = xt_tensor(back, XCALL_DTYPE_F32, 2, T, H);
  CHECK_STATUS(xcall_unpermute(&host, &out_t, &map_t, &probs_t, NULL, &back_t, NULL), XCALL_STATUS_OK);
  ok = 1;
  for (t = 0; t < T; t++)
    for (j = 0; j < H; j++) {
      float want = 0.0f;
      for (e = 0; e < E; e++)
        if (routing[t][e]) want += input[t][j] * probs[t][e];
      ok &= back[t][j] == want;
    }
  CHECK(ok);

  /* Aliasing: output over input is refused, names both, writes nothing. */
  {
    float before[T][H];
    xcall_tensor over = xt_tensor(input, XCALL_DTYPE_F32, 2, n, H);
    static float big[16][H];
    memcpy(before, input, sizeof input);
    CHECK_STATUS(xcall_permute(&host, &in_t, &map_t, &tpe_t, &off_t, NULL, NULL, &over, NULL, NULL, false),
                 XCALL_STATUS_ALIASED);
    CHECK_CONTAINS(xcall_last_error_message(), "output overlaps input");
    CHECK(memcmp(before, input, sizeof input) == 0);
    /* permuted_probs inside probs. */
    pp_t = xt_tensor(probs, XCALL_DTYPE_F32, 1, n, 0);
    CHECK_STATUS(xcall_permute(&host, &in_t, &map_t, &tpe_t, &off_t, &probs_t, NULL, &out_t, &pp_t, NULL, false),
                 XCALL_STATUS_ALIASED);
    CHECK_CONTAINS(xcall_last_error_message(), "permuted_probs overlaps probs");
    /* The in-place variant gives the out-of-place result. */
    memcpy(big, input, sizeof input);
    {
      xcall_tensor src = xt_tensor(big, XCALL_DTYPE_F32, 2, T, H);
      xcall_tensor dst = xt_tensor(big, XCALL_DTYPE_F32, 2, n, H);
      CHECK_STATUS(xcall_permute(&host, &src, &map_t, &tpe_t, &off_t, NULL, NULL, &dst, NULL, NULL, true),
                   XCALL_STATUS_OK);
      CHECK(memcmp(big, output, (size_t)n * sizeof output[0]) == 0);
    }
  }

  /* Chunk sort: chunks of 2, 3, 1 rows emitted in order 2, 0, 1. */
  {
    int64_t sizes[3] = {2, 3, 1}, sorted[3] = {2, 0, 1}, cmap[T], want[T] = {1, 2, 3, 4, 5, 0};
    float rows[T][H], sorted_rows[T][H];
    xcall_tensor sz = xt_tensor(sizes, XCALL_DTYPE_I64, 1, 3, 0);
    xcall_tensor so = xt_tensor(sorted, XCALL_DTYPE_I64, 1, 3, 0);
    xcall_tensor cm = xt_tensor(cmap, XCALL_DTYPE_I64, 1, T, 0);
    xcall_tensor rt = xt_tensor(rows, XCALL_DTYPE_F32, 2, T, H);
    xcall_tensor st = xt_tensor(sorted_rows, XCALL_DTYPE_F32, 2, T, H);
    memcpy(rows, input, sizeof input);
    CHECK_STATUS(xcall_make_chunk_sort_map(&host, &sz, &so, &cm), XCALL_STATUS_OK);
    CHECK(memcmp(cmap, want, sizeof want) == 0);
    CHECK_STATUS(xcall_sort_chunks_by_map(&host, &rt, &cm, NULL, false, &st, NULL, false), XCALL_STATUS_OK);
    ok = 1;
    for (t = 0; t < T; t++) ok &= memcmp(sorted_rows[want[t]], rows[t], sizeof rows[t]) == 0;
    CHECK(ok);
    sorted[1] = 2; /* not a permutation */
    CHECK_STATUS(xcall_make_chunk_sort_map(&host, &sz, &so, &cm), XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "not a permutation");
    CHECK(memcmp(cmap, want, sizeof want) == 0);
    /* Sorting in place without asking for it is refused. */
    CHECK_STATUS(xcall_sort_chunks_by_map(&host, &rt, &cm, NULL, false, &rt, NULL, false), XCALL_STATUS_ALIASED);
  }

  /* Alias tables: every op publishes one, and none allows a pair. */
  for (k = XCALL_PERMUTE_OP_MAKE_ROW_ID_MAP; k <= XCALL_PERMUTE_OP_MAKE_CHUNK_SORT_MAP; k++) {
    count = 99;
    CHECK_STATUS(xcall_permute_alias_table((uint32_t)k, pairs, 4, &count), XCALL_STATUS_OK);
    CHECK(count == 0);
  }
  CHECK_STATUS(xcall_permute_alias_table(77, pairs, 4, &count), XCALL_STATUS_INVALID_ARGUMENT);

  /* Expert groups of one expert and 3 rows: expert e starts at row 3e, and
     expert 2's fourth route (token 4) is dropped (known answers). */
  CHECK_STATUS(xcall_make_row_id_map_grouped(&host, &r_t, 0, 1, 3, &map_t, &tpe_t, &off_t), XCALL_STATUS_OK);
  CHECK(offsets[0] == 0 && offsets[1] == 3 && offsets[2] == 6 && offsets[3] == 9);
  CHECK(tpe[0] == 2 && tpe[1] == 2 && tpe[2] == 3);
  CHECK(map[4][2 * E] == 1 && map[4][0] == 1 && map[4][E] == 0);
  CHECK(map[3][2 * E] == 1 && map[3][0] == 8 && map[3][E] == 2);
  CHECK(map[2][2 * E] == 2 && map[2][0] == 4 && map[2][1] == 7);
  {
  int32_t saved[T][2 * E + 1];
  memcpy(saved, map, sizeof map);
  CHECK_STATUS(xcall_make_row_id_map_grouped(&host, &r_t, 0, 2, 3, &map_t, &tpe_t, &off_t),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "do not split into groups of 2");
  CHECK_STATUS(xcall_make_row_id_map_grouped(&host, &r_t, 0, 1, 0, &map_t, &tpe_t, &off_t),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "at least 1");
  CHECK(memcmp(saved, map, sizeof map) == 0);
  }

  /* Bad arguments: NULL target and tensors, negative dims, E = 0, wrong dtype. */
  CHECK_STATUS(xcall_make_row_id_map(NULL, &r_t, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_make_row_id_map(&host, NULL, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_NULL_ARGUMENT);
  bad = xt_tensor(routing, XCALL_DTYPE_U8, 2, -1, E);
  CHECK_STATUS(xcall_make_row_id_map(&host, &bad, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "negative");
  bad = xt_tensor(routing, XCALL_DTYPE_U8, 2, T, 0);
  CHECK_STATUS(xcall_make_row_id_map(&host, &bad, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "at least 1 expert");
  bad = xt_tensor(routing, XCALL_DTYPE_F32, 2, T, E);
  CHECK_STATUS(xcall_make_row_id_map(&host, &bad, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_UNSUPPORTED);
  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, 4, 8, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  /* a capacity with a cap, and a negative capacity */
  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, 4, 0, 2, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, -1, 0, -2, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "capacity is negative (-2)");
  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, -1, -5, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "align is negative (-5)");
  /* Rank: up to XCALL_TENSOR_MAX_RANK is read (and then judged by the op);
     past it is refused before any dim is read. */
  bad = r_t;
  bad.rank = XCALL_TENSOR_MAX_RANK + 1;
  CHECK_STATUS(xcall_make_row_id_map(&host, &bad, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "routing: rank 5 exceeds 4");
  bad.rank = XCALL_TENSOR_MAX_RANK;
  bad.dims[2] = 1;
  bad.dims[3] = 1;
  CHECK_STATUS(xcall_make_row_id_map(&host, &bad, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(xcall_last_error_message(), "exceeds") == NULL);
  bad = xt_tensor(NULL, XCALL_DTYPE_F32, 2, T, H);
  CHECK_STATUS(xcall_unpermute(&host, &out_t, &map_t, NULL, NULL, &bad, NULL), XCALL_STATUS_NULL_ARGUMENT);

  /* Segmented: the 8 rows in two separate segments of 4; each route's row
     lands in its segment, the other rows keep their poison, and unpermute
     from the segments gives y = sum of weighted copies as above. */
  {
  float seg0[4][H], seg1[4][H], y2[T][H], saved[4][H];
  CHECK_STATUS(xcall_make_row_id_map(&host, &r_t, -1, 0, 0, &map_t, &tpe_t, &off_t), XCALL_STATUS_OK);
  memset(seg0, 0xa5, sizeof seg0);
  memset(seg1, 0xa5, sizeof seg1);
  const void *segs[2] = {seg0, seg1};
  xcall_tensor st = xt_tensor(seg0, XCALL_DTYPE_F32, 2, 8, H);
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, segs, 2, 4),
               XCALL_STATUS_OK);
  int written = 0;
  ok = 1;
  for (t = 0; t < T; t++)
    for (k = 0; k < map[t][2 * E]; k++) {
      int d = map[t][k];
      ok &= memcmp(d < 4 ? seg0[d] : seg1[d - 4], input[t], sizeof input[t]) == 0;
      written++;
    }
  CHECK(ok && written == 8);
  xcall_tensor y2_t = xt_tensor(y2, XCALL_DTYPE_F32, 2, T, H);
  CHECK_STATUS(xcall_unpermute_segmented(&host, &st, segs, 2, 4, &map_t, &probs_t, &y2_t), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_unpermute(&host, &out_t, &map_t, &probs_t, NULL, &back_t, NULL), XCALL_STATUS_OK);
  CHECK(memcmp(y2, back, sizeof y2) == 0);
  /* Refused, nothing written: no segments, too many, NULL, a negative or
     mismatched row count, output.data not the first segment. */
  memset(seg1, 0xa5, sizeof seg1);
  memcpy(saved, seg1, sizeof saved);
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, segs, 0, 4),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "num_segments is 0, expected 1 to 32");
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, segs,
                                       XCALL_PERMUTE_MAX_SEGMENTS + 1, 4),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, NULL, 2, 4),
               XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, segs, 2, -4),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "rows_per_segment is negative (-4)");
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, segs, 2, 3),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "2 segments of 3 rows do not make output's 8 rows");
  const void *swapped[2] = {seg1, seg0};
  CHECK_STATUS(xcall_permute_segmented(&host, &in_t, &map_t, &tpe_t, &off_t, &st, swapped, 2, 4),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "is not output's address");
  CHECK_STATUS(xcall_unpermute_segmented(&host, &st, segs, 2, 5, &map_t, &probs_t, &y2_t),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(memcmp(saved, seg1, sizeof saved) == 0);
  }
  return xt_summary("test_permute");
}
