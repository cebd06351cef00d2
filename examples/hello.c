/*
 * hello: the library's version and the devices it finds on each platform.
 *
 *   hello
 *
 * A missing GPU is not an error: xcall opens the CUDA driver at run time
 * and reports why CUDA is unavailable.
 */
#include "example.h"

int main(void) {
  size_t host = 0, cuda = 0;
  xcall_status status;

  printf("xcall %s (header %s)\n", xcall_version(), XCALL_VERSION_STRING);
  if (strcmp(xcall_version(), XCALL_VERSION_STRING) != 0) {
    fprintf(stderr, "the library is not the one this header belongs to\n");
    return 1;
  }
  TRY(xcall_device_count(XCALL_PLATFORM_HOST, &host));
  printf("host  %zu device(s)\n", host);
  status = xcall_device_count(XCALL_PLATFORM_CUDA, &cuda);
  if (status == XCALL_STATUS_OK)
    printf("cuda  %zu device(s)\n", cuda);
  else
    printf("cuda  unavailable: %s (%s)\n", xcall_status_name(status), xcall_last_error_message());
  return 0;
}
