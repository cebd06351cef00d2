/*
 * The few CUDA driver functions the examples use, opened at run time with
 * dlopen (as xcall opens the driver), so the examples build on machines
 * without CUDA and run their Host half there. A program built with the
 * CUDA toolkit would include <cuda.h> and link -lcuda instead.
 */
#ifndef XCALL_EXAMPLE_CUDA_DRIVER_H
#define XCALL_EXAMPLE_CUDA_DRIVER_H

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

struct cuda_driver {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice device);
  CUresult (*cuCtxSetCurrent)(CUcontext ctx);
  CUresult (*cuStreamCreate)(CUstream *stream, unsigned flags);
  CUresult (*cuStreamDestroy)(CUstream stream);
  CUresult (*cuStreamSynchronize)(CUstream stream);
  CUresult (*cuMemAlloc)(CUdeviceptr *ptr, size_t bytes);
  CUresult (*cuMemFree)(CUdeviceptr ptr);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr dst, const void *src, size_t bytes);
  CUresult (*cuMemcpyDtoH)(void *dst, CUdeviceptr src, size_t bytes);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
  CUresult (*cuMemsetD32Async)(CUdeviceptr dst, unsigned value, size_t count, CUstream stream);
};

/* One driver function into `d->field`, or -1 from the caller. */
#define CUDA_DRIVER_LOAD(lib, d, field, symbol)                         \
  do {                                                                  \
    void *sym_ = dlsym((lib), (symbol));                                \
    if (sym_ == NULL) {                                                 \
      fprintf(stderr, "the CUDA driver lacks %s\n", (symbol));          \
      return -1;                                                        \
    }                                                                   \
    memcpy(&(d)->field, &sym_, sizeof sym_); /* POSIX: same size */     \
  } while (0)

/* Opens the driver and makes device `ordinal`'s primary context current on
 * this thread. Returns 0, or -1 with the reason printed. */
static inline int cuda_driver_open(struct cuda_driver *d, int ordinal) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  CUdevice device;
  CUcontext ctx;
  if (lib == NULL) {
    fprintf(stderr, "no CUDA driver: %s\n", dlerror());
    return -1;
  }
  CUDA_DRIVER_LOAD(lib, d, cuInit, "cuInit");
  CUDA_DRIVER_LOAD(lib, d, cuDeviceGet, "cuDeviceGet");
  CUDA_DRIVER_LOAD(lib, d, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  CUDA_DRIVER_LOAD(lib, d, cuCtxSetCurrent, "cuCtxSetCurrent");
  CUDA_DRIVER_LOAD(lib, d, cuStreamCreate, "cuStreamCreate");
  CUDA_DRIVER_LOAD(lib, d, cuStreamDestroy, "cuStreamDestroy_v2");
  CUDA_DRIVER_LOAD(lib, d, cuStreamSynchronize, "cuStreamSynchronize");
  CUDA_DRIVER_LOAD(lib, d, cuMemAlloc, "cuMemAlloc_v2");
  CUDA_DRIVER_LOAD(lib, d, cuMemFree, "cuMemFree_v2");
  CUDA_DRIVER_LOAD(lib, d, cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  CUDA_DRIVER_LOAD(lib, d, cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  CUDA_DRIVER_LOAD(lib, d, cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
  CUDA_DRIVER_LOAD(lib, d, cuMemsetD32Async, "cuMemsetD32Async");
  if (d->cuInit(0) != 0 || d->cuDeviceGet(&device, ordinal) != 0 ||
      d->cuDevicePrimaryCtxRetain(&ctx, device) != 0 || d->cuCtxSetCurrent(ctx) != 0) {
    fprintf(stderr, "CUDA device %d cannot be opened\n", ordinal);
    return -1;
  }
  return 0;
}

#endif
