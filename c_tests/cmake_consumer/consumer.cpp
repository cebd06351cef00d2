// Links the installed xcall package and checks header/library agreement.
#include <xcall.h>

#include <cstdio>
#include <cstring>

int main() {
  size_t count = 0;
  const bool ok = std::strcmp(xcall_version(), XCALL_VERSION_STRING) == 0 &&
                  xcall_device_count(XCALL_PLATFORM_HOST, &count) == XCALL_STATUS_OK &&
                  count == 1;
  std::printf("consumer: xcall %s, %d passed, %d failed\n", xcall_version(), ok ? 1 : 0, ok ? 0 : 1);
  return ok ? 0 : 1;
}
