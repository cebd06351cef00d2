//! The copy the permute benches measure their ratios against.
//!
//! The driver's `cuMemcpyDtoDAsync` is not a steady reference: in the grid
//! bench's buffers, copies of some sizes (512 MiB and 1 GiB among them) run
//! at about 2.7 TB/s on an H200 where the sizes around them run at 4 TB/s
//! and where xcall's own gathers of the same bytes run faster than the
//! copy. So each bench times two copies of the same bytes, the driver's and
//! a plain kernel's (one 16-byte vector per thread), and divides by the
//! faster: an op is never compared with a copy that ran slow.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction};

const SOURCE: &str = r#"
extern "C" __global__ void copy16(uint4* __restrict__ dst, const uint4* __restrict__ src, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"#;

/// A plain device-to-device copy kernel.
pub struct KernelCopy {
    func: CudaFunction,
}

impl KernelCopy {
    /// Compiles the kernel for `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>) -> KernelCopy {
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE).unwrap();
        let module = ctx.load_module(ptx).unwrap();
        KernelCopy {
            func: module.load_function("copy16").unwrap(),
        }
    }

    /// Enqueues a copy of `bytes` bytes from `src` to `dst` on `stream`.
    ///
    /// # Safety
    /// `src` and `dst` are live, disjoint device allocations of at least
    /// `bytes` bytes in the kernel's context, 16-byte aligned, and `stream`
    /// belongs to that context.
    pub unsafe fn enqueue(&self, dst: u64, src: u64, bytes: usize, stream: sys::CUstream) {
        assert!(bytes % 16 == 0, "the copy moves whole 16-byte vectors");
        let mut n = (bytes / 16) as u64;
        let blocks = u32::try_from(n.div_ceil(256)).expect("grid fits a u32");
        let (mut d, mut s) = (dst, src);
        let mut params: [*mut c_void; 3] = [
            (&mut d as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
        ];
        // SAFETY: the kernel's three parameters (two pointers, a u64) in
        // order, each pointing at a live local; the caller vouches for the
        // buffers and the stream.
        unsafe {
            sys::cuLaunchKernel(
                self.func.cu_function(),
                blocks.max(1),
                1,
                1,
                256,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .unwrap();
    }
}
