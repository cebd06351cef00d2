//! GPU fixture shared by the graph cache's GPU tests and benchmark: a
//! scale-add kernel compiled through the kernel cache, launched raw on the
//! stream the graph cache hands to the record function (a foreign kernel to
//! the cache), and the same kernel taking a parameter struct, launched
//! through xcall's launcher (whose graphs the cache can patch).

#![allow(dead_code)] // each user takes what it needs

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError};
use xcall_core::cuda::RawStream;
use xcall_core::kernel_cache::LoadedModule;
use xcall_core::{Device, KernelCache, KernelSource};
use xcall_graph::cuda::CudaStreamHandle;

pub const SCALE_ADD: KernelSource<'static> = KernelSource {
    name: "scale_add.cu",
    code: r#"
extern "C" __global__ void scale_add(float *x, float a, float b, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * a + b;
}
"#,
    options: &[],
};

/// The coefficients of kernel `i` of a call: x = x * a + b.
pub fn coefficients(i: usize) -> (f32, f32) {
    (1.0 + 0.01 * i as f32, 0.5 - 0.1 * i as f32)
}

/// What `rounds` calls of `kernels` kernels do to `x`, computed on the Host
/// in f64.
pub fn reference(x: &[f32], kernels: usize, rounds: usize) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            let mut v = v as f64;
            for _ in 0..rounds {
                for i in 0..kernels {
                    let (a, b) = coefficients(i);
                    v = v * a as f64 + b as f64;
                }
            }
            v as f32
        })
        .collect()
}

pub use xcall_core::testing::random_f32 as random;

pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

xcall_core::kernel_params! {
    /// What `scale_add_p` takes.
    pub struct ScaleAdd {
        /// The floats, scaled and shifted in place.
        x: u64 => "float*",
        /// How many.
        n: u64 => "unsigned long long",
        /// Scale.
        a: f32 => "float",
        /// Shift.
        b: f32 => "float",
    }
}

/// `scale_add` over a [`ScaleAdd`].
fn scale_add_p_source() -> String {
    use xcall_core::cuda::KernelRecord;
    format!(
        "{}\nextern \"C\" __global__ void scale_add_p(const ScaleAdd p) {{\n    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < p.n) p.x[i] = p.x[i] * p.a + p.b;\n}}\n",
        ScaleAdd::c_definition()
    )
}

pub struct Gpu {
    pub device: Device,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub func: CudaFunction,
    /// `scale_add_p`, launched through xcall's launcher.
    pub func_p: CudaFunction,
    _module: Arc<LoadedModule>,
    _module_p: Arc<LoadedModule>,
}

impl Gpu {
    pub fn new(kernels: &KernelCache, ordinal: u32) -> Gpu {
        let device = Device::cuda(ordinal);
        let ctx = CudaContext::new(ordinal as usize).expect("context");
        // SAFETY: the tests order their work on one stream themselves; no
        // event work may land inside a stream capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().expect("stream");
        let module = kernels
            .module(device, &SCALE_ADD)
            .expect("compile scale_add");
        let func = module.function("scale_add").expect("scale_add");
        let source = scale_add_p_source();
        let module_p = kernels
            .module(
                device,
                &KernelSource {
                    name: "scale_add_p.cu",
                    code: &source,
                    options: &[],
                },
            )
            .expect("compile scale_add_p");
        let func_p = module_p.function("scale_add_p").expect("scale_add_p");
        Gpu {
            device,
            ctx,
            stream,
            func,
            func_p,
            _module: module,
            _module_p: module_p,
        }
    }

    pub fn handle(&self) -> CudaStreamHandle {
        CudaStreamHandle(self.stream.cu_stream())
    }

    pub fn upload(&self, data: &[f32]) -> CudaSlice<f32> {
        self.ctx.bind_to_thread().unwrap();
        self.stream.clone_htod(data).expect("upload")
    }

    pub fn download(&self, buf: &CudaSlice<f32>) -> Vec<f32> {
        self.ctx.bind_to_thread().unwrap();
        let v = self.stream.clone_dtoh(buf).expect("download");
        self.stream.synchronize().expect("sync");
        v
    }

    pub fn ptr(&self, buf: &CudaSlice<f32>) -> u64 {
        buf.device_ptr(&self.stream).0
    }

    /// Enqueues `kernels` scale-add kernels on `stream` over `n` floats at `ptr`.
    pub fn work(
        &self,
        stream: RawStream,
        ptr: u64,
        n: u64,
        kernels: usize,
    ) -> Result<(), DriverError> {
        for i in 0..kernels {
            let (mut a, mut b) = coefficients(i);
            let (mut p, mut n) = (ptr, n);
            let mut params: [*mut c_void; 4] = [
                (&mut p as *mut u64).cast(),
                (&mut a as *mut f32).cast(),
                (&mut b as *mut f32).cast(),
                (&mut n as *mut u64).cast(),
            ];
            let blocks = n.div_ceil(256) as u32;
            let config = xcall_core::cuda::Launch::linear(blocks, 256, stream);
            // SAFETY: the parameters match scale_add's signature and point to
            // live locals; `ptr` holds `n` floats.
            unsafe { xcall_core::cuda::launch_raw(&self.func, config, &mut params)? };
        }
        Ok(())
    }

    /// `work` with `scale_add_p` launched through xcall's launcher.
    pub fn work_p(
        &self,
        stream: RawStream,
        ptr: u64,
        n: u64,
        kernels: usize,
    ) -> xcall_core::Result<()> {
        for i in 0..kernels {
            let (a, b) = coefficients(i);
            let mut params = xcall_core::cuda::Params::new().record(&ScaleAdd { x: ptr, n, a, b });
            let config = xcall_core::cuda::Launch::linear(n.div_ceil(256) as u32, 256, stream);
            // SAFETY: scale_add_p takes one ScaleAdd; `ptr` holds `n`
            // floats of this device; the stream is this device's.
            unsafe { xcall_core::cuda::launch(self.device, &self.func_p, config, &mut params) }?;
        }
        Ok(())
    }
}
