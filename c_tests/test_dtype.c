/* Element types: sizes and names. */
#include "xcall_test.h"

int main(void) {
  size_t size = 99;
  CHECK_STATUS(xcall_dtype_size(XCALL_DTYPE_F32, &size), XCALL_STATUS_OK);
  CHECK(size == sizeof(float));
  CHECK_STATUS(xcall_dtype_size(XCALL_DTYPE_BF16, &size), XCALL_STATUS_OK);
  CHECK(size == 2);
  CHECK_STATUS(xcall_dtype_size(XCALL_DTYPE_F8E4M3, &size), XCALL_STATUS_OK);
  CHECK(size == 1);
  CHECK_STATUS(xcall_dtype_size(XCALL_DTYPE_I64, &size), XCALL_STATUS_OK);
  CHECK(size == sizeof(int64_t));
  CHECK_STATUS(xcall_dtype_size(0, &size), XCALL_STATUS_INVALID_ARGUMENT);
  CHECK(size == sizeof(int64_t));
  CHECK_STATUS(xcall_dtype_size(XCALL_DTYPE_F16, NULL), XCALL_STATUS_NULL_ARGUMENT);
  CHECK_STR_EQ(xcall_dtype_name(XCALL_DTYPE_F8E5M2), "f8e5m2");
  CHECK_STR_EQ(xcall_dtype_name(XCALL_DTYPE_BOOL), "bool");
  CHECK(xcall_dtype_name(1000) == NULL);
  return xt_summary("test_dtype");
}
