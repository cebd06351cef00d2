/* Device counts per platform; Host never loads CUDA. */
#include "xcall_test.h"

int main(void) {
  size_t count = 777;
  xcall_status s;

  /* Host: exactly one device, and asking does not load the CUDA driver. */
  CHECK_STATUS(xcall_device_count(XCALL_PLATFORM_HOST, &count), XCALL_STATUS_OK);
  CHECK(count == 1);
  CHECK(!xcall_cuda_load_attempted());

  /* Bad input: a specific status, a message, and the output untouched. */
  count = 777;
  CHECK_STATUS(xcall_device_count(42, &count), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(count == 777);
  CHECK_CONTAINS(xcall_last_error_message(), "unknown platform code 42");
  CHECK_STATUS(xcall_device_count(XCALL_PLATFORM_CUDA, NULL), XCALL_STATUS_NULL_ARGUMENT);
  CHECK(!xcall_cuda_load_attempted());

  /* CUDA: the driver's count, or CUDA_UNAVAILABLE saying why. */
  s = xcall_device_count(XCALL_PLATFORM_CUDA, &count);
  if (s == XCALL_STATUS_OK) {
    CHECK(count >= 1);
    printf("cuda devices: %zu\n", count);
  } else {
    CHECK(s == XCALL_STATUS_CUDA_UNAVAILABLE);
    CHECK(count == 777);
    CHECK_CONTAINS(xcall_last_error_message(), "CUDA is unavailable: ");
    CHECK(!xt_cuda_required());
    printf("SKIP cuda device count: %s\n", xcall_last_error_message());
  }
  return xt_summary("test_devices");
}
