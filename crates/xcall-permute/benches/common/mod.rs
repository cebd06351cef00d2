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

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use xcall_core::cuda::{DeviceInfo, GraphExec, RawStream, Stream};
use xcall_core::testing::cuda_devices_or_skip;
use xcall_core::{cuda, Device};

/// What every permute bench starts from: cuda:0's description, its
/// context (event tracking off: a bench orders its own work on one
/// stream), that stream and the reference copy; `None` after a skip line
/// when there is no GPU.
pub fn setup(bench: &str) -> Option<(DeviceInfo, Arc<CudaContext>, Arc<CudaStream>, KernelCopy)> {
    // XCALL_LOG=xcall_permute=debug shows each autotuned launch config.
    xcall_core::log::init_from_env_once();
    cuda_devices_or_skip(&format!("bench {bench}"))?;
    let info = cuda::device_info(Device::cuda(0)).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: each bench orders its own work on the one stream made here.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let copy = KernelCopy::new(&ctx);
    Some((info, ctx, stream, copy))
}

/// Launches `func` on `grid` blocks of `block` threads on `stream`.
///
/// # Safety
/// `params` points at the kernel's parameters in order, each a live value
/// of the kernel's type, and whatever they address is live and large
/// enough for the launch; `stream` belongs to the kernel's context.
pub unsafe fn launch(
    func: &CudaFunction,
    grid: u32,
    block: u32,
    params: &mut [*mut c_void],
    stream: RawStream,
) {
    // SAFETY: the caller's contract above; no dynamic shared memory.
    unsafe { launch_smem(func, grid, block, 0, params, stream) }
}

/// [`launch`] with `smem` bytes of dynamic shared memory per block.
///
/// # Safety
/// As [`launch`]; `smem` bytes fit the kernel's allowance.
pub unsafe fn launch_smem(
    func: &CudaFunction,
    grid: u32,
    block: u32,
    smem: u32,
    params: &mut [*mut c_void],
    stream: RawStream,
) {
    let config = cuda::Launch::linear(grid, block, stream).with_shared(smem);
    // SAFETY: the caller's contract above.
    unsafe { cuda::launch_raw(func, config, params) }.unwrap();
}

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
    pub unsafe fn enqueue(&self, dst: u64, src: u64, bytes: usize, stream: RawStream) {
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
        unsafe { launch(&self.func, blocks.max(1), 256, &mut params, stream) };
    }
}

/// One call of a tunable op (a config sweep's).
pub type TunedCall<'a> = dyn Fn() -> Result<(), xcall_permute::PermuteError> + 'a;

/// The tunable `kernel`'s op (`call`) under its tuned config and under
/// each of `candidates` forced in turn (a config the compiled kernel
/// cannot launch is left out), each captured into its own graph and
/// replayed in `rounds` interleaved rounds, each replay after one of
/// `before` when given. Returns each config (`None`: the tuned one, first)
/// with its median milliseconds.
#[allow(dead_code)] // not every bench sweeps configs
pub fn time_configs(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    rounds: usize,
    kernel: &'static str,
    candidates: &[xcall_permute::cuda::LaunchConfig],
    call: &TunedCall<'_>,
    before: Option<&GraphExec>,
) -> Vec<(Option<xcall_permute::cuda::LaunchConfig>, f64)> {
    use xcall_core::testing::{capture_graph, interleaved_medians};
    use xcall_permute::cuda::with_configs;
    let device = Device::cuda(0);
    // SAFETY: the bench's live stream of cuda:0, outliving the replays.
    let cs = unsafe { Stream::from_raw(device, stream.cu_stream()) };
    let mut execs = vec![(None, capture_graph(device, stream, &mut || call().unwrap()))];
    for &c in candidates {
        if with_configs(&[(kernel, c)], || call().is_ok()) {
            let exec = with_configs(&[(kernel, c)], || {
                capture_graph(device, stream, &mut || call().unwrap())
            });
            execs.push((Some(c), exec));
        }
    }
    let mut replays: Vec<Box<dyn FnMut() + '_>> = execs
        .iter()
        .flat_map(|(_, g)| before.into_iter().chain([g]))
        .map(|g| -> Box<dyn FnMut() + '_> {
            // An executable graph of this stream's context.
            Box::new(move || cs.launch_graph(g).unwrap())
        })
        .collect();
    let per = 1 + before.is_some() as usize;
    let ms: Vec<f64> = interleaved_medians(ctx, stream, rounds, &mut replays)
        .into_iter()
        .skip(per - 1)
        .step_by(per)
        .collect();
    drop(replays);
    // The timing synchronised; no replay is in flight when the executables
    // are destroyed.
    execs.into_iter().map(|(c, _)| c).zip(ms).collect()
}
