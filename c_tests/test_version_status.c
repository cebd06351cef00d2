/* Version, status names and the thread's last error message. */
#include "xcall_test.h"

int main(void) {
  char expected[64];
  xcall_status s;
  size_t count = 0;

  /* The header's macros describe the library that is linked. */
  CHECK_STR_EQ(xcall_version(), XCALL_VERSION_STRING);
  snprintf(expected, sizeof expected, "%d.%d.%d", XCALL_VERSION_MAJOR,
           XCALL_VERSION_MINOR, XCALL_VERSION_PATCH);
  CHECK_STR_EQ(xcall_version(), expected);

  /* Every published code has its constant's name. */
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_OK), "XCALL_STATUS_OK");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_NULL_ARGUMENT), "XCALL_STATUS_NULL_ARGUMENT");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_INVALID_ARGUMENT), "XCALL_STATUS_INVALID_ARGUMENT");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_PANIC), "XCALL_STATUS_PANIC");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_CUDA_UNAVAILABLE), "XCALL_STATUS_CUDA_UNAVAILABLE");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_CUDA_DRIVER), "XCALL_STATUS_CUDA_DRIVER");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_COMPILE_FAILED), "XCALL_STATUS_COMPILE_FAILED");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_NO_SUCH_DEVICE), "XCALL_STATUS_NO_SUCH_DEVICE");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_UNSUPPORTED), "XCALL_STATUS_UNSUPPORTED");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_CALLBACK_FAILED), "XCALL_STATUS_CALLBACK_FAILED");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_TIMEOUT), "XCALL_STATUS_TIMEOUT");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_ALIASED), "XCALL_STATUS_ALIASED");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_SYSTEM), "XCALL_STATUS_SYSTEM");
  CHECK_STR_EQ(xcall_status_name(XCALL_STATUS_COLLECTIVE_MISMATCH), "XCALL_STATUS_COLLECTIVE_MISMATCH");
  CHECK_STR_EQ(xcall_status_name(4000000000u), "XCALL_STATUS_UNKNOWN");
  CHECK(XCALL_STATUS_OK == 0);

  /* The last error: empty at start, set by a failure, cleared by a success. */
  CHECK_STR_EQ(xcall_last_error_message(), "");
  s = xcall_device_count(XCALL_PLATFORM_HOST, NULL);
  CHECK(s == XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STR_EQ(xcall_last_error_message(), "out_count is NULL");
  CHECK_STATUS(xcall_device_count(XCALL_PLATFORM_HOST, &count), XCALL_STATUS_OK);
  CHECK_STR_EQ(xcall_last_error_message(), "");

  return xt_summary("test_version_status");
}
