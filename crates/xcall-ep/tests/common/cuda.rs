//! Device memory for the CUDA tests ([`Mem`] on one GPU).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use xcall_core::Device;
use xcall_ep::Buf;

use super::run::Mem;

/// Device memory of one GPU and a stream of its own.
pub struct CudaMem {
    pub device: Device,
    _ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    held: Vec<u64>,
}

impl CudaMem {
    pub fn new(device: Device) -> CudaMem {
        let ctx = CudaContext::new(device.ordinal as usize).unwrap();
        let stream = xcall_core::testing::new_stream(&ctx);
        CudaMem {
            device,
            _ctx: ctx,
            stream,
            held: Vec::new(),
        }
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        for a in self.held.drain(..) {
            // SAFETY: allocated by mem_alloc below; the stream is idle.
            let _ = unsafe { xcall_core::cuda::mem_free(self.device, a) };
        }
    }
}

impl Mem for CudaMem {
    fn alloc(&mut self, bytes: usize) -> Buf {
        let a = xcall_core::cuda::mem_alloc(self.device, bytes.max(16)).unwrap();
        self.held.push(a);
        Buf::new(a, bytes)
    }
    fn write(&mut self, b: Buf, data: &[u8]) {
        assert!(data.len() <= b.bytes);
        self.stream.synchronize().unwrap();
        // SAFETY: `b` is device memory of this GPU of b.bytes bytes.
        unsafe { xcall_core::cuda::copy_htod_sync(self.device, b.addr, data) }.unwrap();
    }
    fn read(&mut self, b: Buf) -> Vec<u8> {
        self.stream.synchronize().unwrap();
        let mut v = vec![0u8; b.bytes];
        // SAFETY: as for write.
        unsafe { xcall_core::cuda::copy_dtoh_sync(self.device, &mut v, b.addr) }.unwrap();
        v
    }
    fn stream(&self) -> *mut c_void {
        self.stream.cu_stream() as *mut c_void
    }
    fn sync(&mut self) {
        self.stream.synchronize().unwrap();
    }
}

/// Whether this machine has `need` GPUs (a SKIP line otherwise, a
/// failure with XCALL_REQUIRE_CUDA=1 and no CUDA).
pub fn gpus(test: &str, need: usize) -> bool {
    match xcall_core::testing::cuda_devices_or_skip(test) {
        Some(n) if n >= need => true,
        Some(n) => {
            xcall_core::testing::skip(test, &format!("needs {need} GPU(s), this machine has {n}"));
            false
        }
        None => false,
    }
}
