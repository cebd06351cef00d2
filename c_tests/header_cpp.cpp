// The header compiles as C++17 with -Wall -Wextra -Werror and links from C++.
#include "xcall.h"

#include <cstdio>
#include <cstring>

int main() {
  size_t count = 0;
  xcall_status status = xcall_device_count(XCALL_PLATFORM_HOST, &count);
  bool ok = status == XCALL_STATUS_OK && count == 1 &&
            std::strcmp(xcall_version(), XCALL_VERSION_STRING) == 0;
  std::printf("header_cpp: %d passed, %d failed\n", ok ? 1 : 0, ok ? 0 : 1);
  return ok ? 0 : 1;
}
