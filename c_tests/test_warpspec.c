/* Warp-specialization runtime through the C ABI: plan, verify, generate,
 * and the built-in ops on the Host executor. */
#include <math.h>
#include "xcall_test.h"

static float next_value(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return ((float)(*s >> 40) / (float)(1u << 24) - 0.5f) * 8.0f;
}

int main(void) {
  const uint32_t warp_bytes[2] = {8192, 8192};
  xcall_ws_spec spec = {4, 2, warp_bytes, 2, 40, 232, 0};
  xcall_ws_plan *plan = NULL;
  xcall_ws_plan_info info;
  bool clean = false;
  size_t len = 0, len2 = 0;
  char *text;
  enum { N = 10007 };
  static float a[N], b[N], out[N];
  const void *inputs[2] = {a, b};
  xcall_ws_op_config config;
  uint64_t seed = 12345;
  int i, mismatches = 0;

  /* Plan and its facts: 1 producer + 2 compute warpgroups, 2 x 2 x 4 barriers. */
  CHECK_STATUS(xcall_ws_plan_new(&spec, &plan), XCALL_STATUS_OK);
  CHECK_STATUS(xcall_ws_plan_get_info(plan, &info), XCALL_STATUS_OK);
  CHECK(info.threads_per_block == 384 && info.barriers == 16 && info.producer_warpgroups == 1);
  CHECK(info.smem_bytes == 2 * 4 * 8192 + 16 * 8);

  /* Verification: size first, then the report. */
  CHECK_STATUS(xcall_ws_plan_verify(plan, 0, &clean, NULL, 0, &len), XCALL_STATUS_OK);
  CHECK(clean && len > 1);
  text = (char *)malloc(len);
  CHECK_STATUS(xcall_ws_plan_verify(plan, 0, &clean, text, len - 1, &len2), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "are needed");
  CHECK_STATUS(xcall_ws_plan_verify(plan, 0, &clean, text, len, &len2), XCALL_STATUS_OK);
  CHECK(len2 == len && strlen(text) + 1 == len);
  CHECK_CONTAINS(text, "clean: ");
  free(text);

  /* Generated source. */
  CHECK_STATUS(xcall_ws_generate(plan, XCALL_WS_OP_MUL, XCALL_DTYPE_BF16, NULL, 0, &len), XCALL_STATUS_OK);
  text = (char *)malloc(len);
  CHECK_STATUS(xcall_ws_generate(plan, XCALL_WS_OP_MUL, XCALL_DTYPE_BF16, text, len, &len2), XCALL_STATUS_OK);
  CHECK_CONTAINS(text, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes");
  CHECK_CONTAINS(text, "setmaxnreg.inc.sync.aligned.u32 232;");
  free(text);
  CHECK_STATUS(xcall_ws_generate(plan, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, 0, &len),
               XCALL_STATUS_INVALID_ARGUMENT); /* silu has one operand, the plan two */
  CHECK_STATUS(xcall_ws_generate(plan, XCALL_WS_OP_MUL, XCALL_DTYPE_I32, NULL, 0, &len), XCALL_STATUS_UNSUPPORTED);
  xcall_ws_plan_free(plan);
  xcall_ws_plan_free(NULL);

  /* Tiles of different sizes: the kernel's one tile size would overrun the
   * smaller warp's buffers, so no source is generated. */
  {
    const uint32_t uneven_bytes[2] = {8192, 1024};
    xcall_ws_spec uneven = {2, 1, uneven_bytes, 2, 0, 0, 0};
    len = 7;
    CHECK_STATUS(xcall_ws_plan_new(&uneven, &plan), XCALL_STATUS_OK);
    CHECK_STATUS(xcall_ws_generate(plan, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, 0, &len),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "producer w1");
    CHECK(len == 7);
    xcall_ws_plan_free(plan);
  }

  /* Bad specs: a specific message each, nothing written. */
  plan = NULL;
  spec.stages = 0;
  CHECK_STATUS(xcall_ws_plan_new(&spec, &plan), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "at least 1 stage");
  spec.stages = 4;
  spec.consumer_registers = 236;
  CHECK_STATUS(xcall_ws_plan_new(&spec, &plan), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "multiple of 8");
  spec.consumer_registers = 232;
  spec.warp_bytes = NULL;
  CHECK_STATUS(xcall_ws_plan_new(&spec, &plan), XCALL_STATUS_NULL_ARGUMENT);
  CHECK(plan == NULL);

  /* mul and silu on the Host executor, against plain loops. */
  for (i = 0; i < N; i++) {
    a[i] = next_value(&seed);
    b[i] = next_value(&seed);
    out[i] = NAN; /* poisoned */
  }
  CHECK_STATUS(xcall_ws_op_config_default(&config), XCALL_STATUS_OK);
  config.tile_bytes = 4096;
  CHECK_STATUS(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, &config, inputs, 2, out,
                            sizeof a, 0.0f),
               XCALL_STATUS_OK);
  for (i = 0; i < N; i++) mismatches += out[i] != a[i] * b[i];
  CHECK(mismatches == 0);
  CHECK_STATUS(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1,
                            out, sizeof a, 0.5f),
               XCALL_STATUS_OK);
  mismatches = 0;
  for (i = 0; i < N; i++) {
    double want = (double)a[i] / (1.0 + exp(-(double)a[i])) * 0.5;
    mismatches += fabs(out[i] - want) > 1e-5 * (fabs(want) > 1.0 ? fabs(want) : 1.0);
  }
  CHECK(mismatches == 0);

  /* silu with one scale per group of 1000 elements (the first 10000). */
  {
    static float scales[10];
    const xcall_target host = {XCALL_PLATFORM_HOST, 0, NULL};
    const size_t bytes = 10000 * sizeof(float), group = 1000 * sizeof(float);
    for (i = 0; i < 10; i++) scales[i] = 0.25f + 0.5f * (float)i;
    for (i = 0; i < N; i++) out[i] = NAN; /* poisoned */
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1, out, bytes,
                                      scales, group),
                 XCALL_STATUS_OK);
    mismatches = 0;
    for (i = 0; i < 10000; i++) {
      double want = (double)a[i] / (1.0 + exp(-(double)a[i])) * scales[i / 1000];
      mismatches += fabs(out[i] - want) > 1e-5 * (fabs(want) > 1.0 ? fabs(want) : 1.0);
    }
    CHECK(mismatches == 0);
    CHECK(isnan(out[10000])); /* past the buffer: untouched */

    /* Bad groups and scales: a specific error each, the output untouched. */
    for (i = 0; i < N; i++) out[i] = NAN;
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, inputs, 2, out, bytes, scales,
                                      group),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "takes no scales");
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1, out, bytes,
                                      NULL, group),
                 XCALL_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1, out, bytes,
                                      scales, 24),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "do not divide");
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1, out, bytes,
                                      scales, 0),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1, out, bytes,
                                      (const float *)((const char *)scales + 2), group),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "4-byte aligned");
    CHECK_STATUS(xcall_ws_run_grouped(&host, XCALL_WS_OP_SILU_SCALE, XCALL_DTYPE_F32, NULL, inputs, 1, out, bytes,
                                      out + 9995, group),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "overlaps the scales");
    mismatches = 0;
    for (i = 0; i < N; i++) mismatches += !isnan(out[i]);
    CHECK(mismatches == 0);
  }

  /* Ragged groups: 2 segments of 10 rows of 4 floats, 3 groups each with
     counts from data; rows past a segment's groups stay poisoned. */
  {
    static float scales[6] = {0.5f, 9.0f, 1.5f, 2.0f, 2.5f, 3.0f};
    static int64_t rows[6] = {2, 0, 3, 4, 4, 2}, bad_rows[6] = {2, 0, 9, 0, 0, 0};
    const xcall_target host = {XCALL_PLATFORM_HOST, 0, NULL};
    const size_t row = 4 * sizeof(float), seg = 10 * row;
    int r, seg_i, k;
    for (i = 0; i < N; i++) out[i] = NAN; /* poisoned */
    CHECK_STATUS(xcall_ws_run_ragged(&host, XCALL_DTYPE_F32, NULL, a, out, 2, 3, seg, row, rows, scales),
                 XCALL_STATUS_OK);
    mismatches = 0;
    for (seg_i = 0; seg_i < 2; seg_i++) {
      int start = 0;
      for (k = 0; k < 3; k++) {
        for (r = start; r < start + (int)rows[seg_i * 3 + k]; r++)
          for (i = 0; i < 4; i++) {
            int at = (seg_i * 10 + r) * 4 + i;
            double want = (double)a[at] / (1.0 + exp(-(double)a[at])) * scales[seg_i * 3 + k];
            mismatches += fabs(out[at] - want) > 1e-5 * (fabs(want) > 1.0 ? fabs(want) : 1.0);
          }
        start += (int)rows[seg_i * 3 + k];
      }
    }
    CHECK(mismatches == 0);
    for (i = 5 * 4; i < 10 * 4; i++) CHECK(isnan(out[i])); /* segment 0's rows 5-9 */
    CHECK(isnan(out[80]));                                   /* past the buffer */

    for (i = 0; i < N; i++) out[i] = NAN;
    CHECK_STATUS(xcall_ws_run_ragged(&host, XCALL_DTYPE_F32, NULL, a, out, 2, 3, seg, row, bad_rows, scales),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "passes the segment's 160 bytes");
    CHECK_STATUS(xcall_ws_run_ragged(&host, XCALL_DTYPE_F32, NULL, a, out, 2, 3, seg, row, NULL, scales),
                 XCALL_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(xcall_ws_run_ragged(&host, XCALL_DTYPE_F32, NULL, a, out, 2, 3, seg, 8, rows, scales),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "positive multiple of 16");
    CHECK_STATUS(xcall_ws_run_ragged(&host, XCALL_DTYPE_F32, NULL, a, out, (size_t)1 << 62, 3, 64, row, rows, scales),
                 XCALL_STATUS_INVALID_ARGUMENT);
    CHECK_CONTAINS(xcall_last_error_message(), "overflow a size");
    mismatches = 0;
    for (i = 0; i < N; i++) mismatches += !isnan(out[i]);
    CHECK(mismatches == 0);
  }

  /* Errors: overlap, operand count, NULLs, unknown op. */
  inputs[1] = out;
  CHECK_STATUS(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, inputs, 2, out,
                            sizeof a, 0.0f),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(xcall_last_error_message(), "overlaps input 1");
  inputs[1] = b;
  CHECK_STATUS(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, inputs, 1, out,
                            sizeof a, 0.0f),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, XCALL_WS_OP_MUL, XCALL_DTYPE_F32, NULL, NULL, 2, out,
                            sizeof a, 0.0f),
               XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(xcall_ws_run(&(xcall_target){XCALL_PLATFORM_HOST, 0, NULL}, 9, XCALL_DTYPE_F32, NULL, inputs, 2, out, sizeof a, 0.0f),
               XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(!xcall_cuda_load_attempted());
  return xt_summary("test_warpspec");
}
