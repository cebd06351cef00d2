//! The CUDA side of a world: device heap, peer mappings (direct pointers
//! with peer access inside one process, IPC handles across processes),
//! copies on the copy engine, and the barrier, signal and wait kernels.
//!
//! Every driver call runs with the PE's device made current explicitly
//! (`xcall_core::cuda::with_context`), never the calling thread's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaFunction};
use xcall_core::cuda::{self, KernelRecord, Launch, Params};
use xcall_core::kernel_cache::LoadedModule;
use xcall_core::kernel_params;
use xcall_core::{Device, DeviceMap, KernelCache, KernelSource};

use crate::error::Result;

const SOURCE: &str = include_str!("kernels.cu");

kernel_params! {
    /// `xcall_shmem_barrier` (one block; thread i serves PE i).
    pub(crate) struct BarrierParams {
        /// Per PE, the address of its arrival words (this PE's internal
        /// region holds the table).
        peer_arrivals: u64 => "u64* const*",
        /// This PE's arrival words, one per PE.
        my_arrivals: u64 => "const u64*",
        /// The epoch of the last barrier (device memory, so that a captured
        /// graph replays correctly).
        epoch_word: u64 => "u64*",
        /// Set to 1 + the rank of a PE that did not arrive in time.
        error_word: u64 => "u64*",
        /// This PE's rank.
        rank: i64 => "long long",
        /// PEs in the world.
        n: i64 => "long long",
        /// How long to wait for each PE.
        timeout_ns: u64 => "u64",
    }
}

kernel_params! {
    /// `xcall_shmem_wait` (one thread).
    pub(crate) struct WaitParams {
        /// The 64-bit signal word waited on (a heap address, 8-byte
        /// aligned).
        signal: u64 => "const u64*",
        /// The value compared with.
        value: u64 => "u64",
        /// 1: wait for `== value`; 0: for `>= value`.
        eq: u64 => "u64",
        /// Added to the word once the wait holds (0: nothing; `u64::MAX`
        /// takes one back). Never added after a timeout.
        take: u64 => "u64",
        /// This PE's error word: set to `code` on a timeout, unless it
        /// already holds an earlier error.
        error_word: u64 => "u64*",
        /// What a timeout reports (see [`WaitCode`]).
        code: u64 => "u64",
        /// How long to wait.
        timeout_ns: u64 => "u64",
    }
}

kernel_params! {
    /// `xcall_shmem_signal`.
    pub(crate) struct SignalParams {
        /// The 64-bit signal word (a heap address, 8-byte aligned).
        signal: u64 => "u64*",
        /// The value set or added.
        value: u64 => "u64",
        /// 0: set; 1: add.
        op: u64 => "u64",
    }
}

/// The kernels' source: the parameter structs' C definitions, then
/// `kernels.cu`.
pub(crate) fn source() -> String {
    format!(
        "// Generated from xcall-shmem's cuda.rs.\ntypedef unsigned long long u64;\n{}{}{}{SOURCE}",
        BarrierParams::c_definition(),
        WaitParams::c_definition(),
        SignalParams::c_definition()
    )
}

/// The kernels of one device.
pub(crate) struct Kernels {
    pub barrier: CudaFunction,
    pub signal: CudaFunction,
    pub wait: CudaFunction,
    _module: Arc<LoadedModule>,
}

struct State {
    cache: KernelCache,
    kernels: DeviceMap<Arc<Kernels>>,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| State {
        cache: KernelCache::new(),
        kernels: DeviceMap::new(),
    })
}

/// The kernels of `device`, compiled once per device.
pub(crate) fn kernels(device: Device) -> Result<Arc<Kernels>> {
    let k = state().kernels.get_or_try_init(device, || {
        let module = state().cache.module(
            device,
            &KernelSource {
                name: "xcall_shmem.cu",
                code: &source(),
                options: &[],
            },
        )?;
        Ok::<_, xcall_core::Error>(Arc::new(Kernels {
            barrier: module.function("xcall_shmem_barrier")?,
            signal: module.function("xcall_shmem_signal")?,
            wait: module.function("xcall_shmem_wait")?,
            _module: module,
        }))
    })?;
    Ok(k.clone())
}

/// [`cuda::on`] with this crate's error type.
pub(crate) fn on(
    device: Device,
    call: &'static str,
    f: impl FnOnce() -> sys::CUresult,
) -> Result<()> {
    Ok(cuda::on(device, call, f)?)
}

/// Writes `bytes` (host memory) to device memory at `dst`, waiting for the
/// copy.
///
/// # Safety
/// `dst` must be `bytes.len()` writable bytes of `device`.
pub(crate) unsafe fn write_device(device: Device, dst: u64, bytes: &[u8]) -> Result<()> {
    // SAFETY: the caller's contract on `dst`; `bytes` is live host memory.
    on(device, "cuMemcpyHtoD", || unsafe {
        sys::cuMemcpyHtoD_v2(dst, bytes.as_ptr().cast(), bytes.len())
    })
}

/// Reads the 64-bit word at `addr` of `device`, waiting for the copy.
///
/// # Safety
/// `addr` must be 8 readable bytes of `device`.
pub(crate) unsafe fn read_word(device: Device, addr: u64) -> Result<u64> {
    let mut v = 0u64;
    // SAFETY: the caller's contract on `addr`; writes 8 bytes into `v`.
    on(device, "cuMemcpyDtoH", || unsafe {
        sys::cuMemcpyDtoH_v2((&mut v as *mut u64).cast(), addr, 8)
    })?;
    Ok(v)
}

/// A stream of the PE's own (non-blocking), for blocking copies and polls.
pub(crate) struct Stream {
    pub device: Device,
    pub raw: sys::CUstream,
}

// SAFETY: a CUstream handle may be used from any thread; the world that
// owns it serialises its use (&mut self).
unsafe impl Send for Stream {}

impl Stream {
    pub fn new(device: Device) -> Result<Stream> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one stream handle.
        on(device, "cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream { device, raw })
    }

    /// Whether everything enqueued so far has completed (`cuStreamQuery`).
    pub fn idle(&self) -> Result<bool> {
        let _ctx = xcall_core::cuda::ContextGuard::primary(self.device)?;
        // SAFETY: a live stream of this device.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(xcall_core::cuda::check("cuStreamQuery", self.device, e)
                .unwrap_err()
                .into()),
        }
    }

    pub fn sync(&self) -> Result<()> {
        // SAFETY: a live stream of this device.
        on(self.device, "cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.sync();
        // SAFETY: destroys the stream made in `new`, idle now.
        let _ = on(self.device, "cuStreamDestroy", || unsafe {
            sys::cuStreamDestroy_v2(self.raw)
        });
    }
}

/// `bytes` from `src` to `dst` on `stream` (any mix of host and device
/// addresses: unified addressing).
///
/// # Safety
/// Both ranges must be valid for the whole copy.
pub(crate) unsafe fn copy(
    device: Device,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    on(device, "cuMemcpyAsync", || unsafe {
        sys::cuMemcpyAsync(dst, src, bytes, stream)
    })
}

/// Whether `stream` is capturing into a CUDA graph.
///
/// # Safety
/// `stream` is a live stream of `device` (or null: the legacy stream).
pub(crate) unsafe fn capturing(device: Device, stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's contract on `stream`; writes one status.
    on(device, "cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(stream, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Ties `count` to the graph `stream` is capturing, if it is: one more
/// now, one less once the driver has destroyed that graph and every
/// executable graph made from it (a CUDA user object the graph owns).
/// Returns whether the stream was capturing.
///
/// # Safety
/// `stream` is a live stream of `device`.
pub(crate) unsafe fn count_while_captured(
    device: Device,
    stream: sys::CUstream,
    count: &Arc<AtomicUsize>,
) -> Result<bool> {
    unsafe extern "C" fn release(p: *mut std::ffi::c_void) {
        // SAFETY: `p` is the Box made below, released once by the driver.
        let count = unsafe { Box::from_raw(p.cast::<Arc<AtomicUsize>>()) };
        count.fetch_sub(1, Ordering::AcqRel);
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph) = (0 as sys::cuuint64_t, std::ptr::null_mut());
    let (mut deps, mut edges, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
    // SAFETY: the caller's contract on `stream`; every output is a valid
    // pointer.
    on(device, "cuStreamGetCaptureInfo", || unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut edges,
            &mut n,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
        return Ok(false);
    }
    count.fetch_add(1, Ordering::AcqRel);
    let held = Box::into_raw(Box::new(count.clone()));
    let mut object: sys::CUuserObject = std::ptr::null_mut();
    let flags = sys::CUuserObject_flags_enum::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32;
    // SAFETY: `release` frees `held` once, when the object's last
    // reference goes; it calls no CUDA function.
    let made = on(device, "cuUserObjectCreate", || unsafe {
        sys::cuUserObjectCreate(&mut object, held.cast(), Some(release), 1, flags)
    });
    if let Err(e) = made {
        // SAFETY: the driver did not take `held`.
        drop(unsafe { Box::from_raw(held) });
        count.fetch_sub(1, Ordering::AcqRel);
        return Err(e);
    }
    let moved = sys::CUuserObjectRetain_flags_enum::CU_GRAPH_USER_OBJECT_MOVE as u32;
    // SAFETY: the capture's graph and a live object; the graph takes this
    // thread's reference.
    let kept = on(device, "cuGraphRetainUserObject", || unsafe {
        sys::cuGraphRetainUserObject(graph, object, 1, moved)
    });
    if let Err(e) = kept {
        // SAFETY: this thread's reference; its release runs `release`.
        let _ = on(device, "cuUserObjectRelease", || unsafe {
            sys::cuUserObjectRelease(object, 1)
        });
        return Err(e);
    }
    Ok(true)
}

/// Launches `f` with one block of `threads`, passing `params` by value.
///
/// # Safety
/// `f` takes `R` (its source declares it so) and the addresses in `params`
/// are valid for what the kernel does with them.
pub(crate) unsafe fn launch<R: KernelRecord>(
    device: Device,
    f: &CudaFunction,
    threads: u32,
    stream: sys::CUstream,
    params: &R,
) -> Result<()> {
    let mut params = Params::new().record(params);
    // SAFETY: the caller's contract on `params`.
    unsafe { cuda::launch(device, f, Launch::linear(1, threads, stream), &mut params) }?;
    Ok(())
}

/// What a stream wait that timed out leaves in its PE's error word:
/// `kind << 32 | (1 + rank)`, kind 0 being the barrier kernel's (the rank
/// that did not arrive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaitCode {
    /// `barrier_on_stream`: this rank did not arrive.
    Barrier { rank: usize },
    /// `wait_until_on_stream` on this PE (`rank`) did not see its value.
    Signal { rank: usize },
    /// An exchange on the stream: this sender's segments did not land.
    Exchange { sender: usize },
}

impl WaitCode {
    pub(crate) fn word(self) -> u64 {
        let (kind, rank) = match self {
            WaitCode::Barrier { rank } => (0u64, rank),
            WaitCode::Signal { rank } => (1, rank),
            WaitCode::Exchange { sender } => (2, sender),
        };
        (kind << 32) | (rank as u64 + 1)
    }

    /// The code in an error word (`None`: no error, or a word no kernel
    /// of this crate writes).
    pub(crate) fn from_word(w: u64) -> Option<WaitCode> {
        let rank = usize::try_from((w & 0xffff_ffff).checked_sub(1)?).ok()?;
        match w >> 32 {
            0 => Some(WaitCode::Barrier { rank }),
            1 => Some(WaitCode::Signal { rank }),
            2 => Some(WaitCode::Exchange { sender: rank }),
            _ => None,
        }
    }
}

/// Makes `stream` wait until the 64-bit word at `p.signal` holds
/// (`WaitParams` says how), with a kernel that gives up after
/// `p.timeout_ns` and leaves `p.code` in the PE's error word: unlike a
/// driver stream wait, a peer that never signals cannot hang the stream.
///
/// # Safety
/// `p.signal` and `p.error_word` are aligned words of `device`'s heap
/// that stay mapped while the stream runs.
pub(crate) unsafe fn wait_on_stream(
    device: Device,
    stream: sys::CUstream,
    p: &WaitParams,
) -> Result<()> {
    let k = kernels(device)?;
    // SAFETY: xcall_shmem_wait takes WaitParams; the addresses are the
    // caller's contract.
    unsafe { launch(device, &k.wait, 1, stream, p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module's kernels compile with NVRTC and assemble for sm_90 and
    /// sm_80, no GPU needed.
    #[test]
    fn the_module_compiles_with_nvrtc() {
        if xcall_core::testing::nvrtc_or_skip("shmem module with NVRTC").is_none() {
            return;
        }
        for arch in ["sm_90", "sm_80"] {
            xcall_core::testing::nvrtc_compiles("xcall_shmem.cu", &source(), arch, &[]);
        }
    }

    #[test]
    fn wait_codes_are_the_words_the_kernels_write() {
        // The barrier kernel writes 1 + rank (kind 0).
        assert_eq!(WaitCode::Barrier { rank: 5 }.word(), 6);
        assert_eq!(WaitCode::Signal { rank: 0 }.word(), 0x1_0000_0001);
        assert_eq!(WaitCode::Exchange { sender: 3 }.word(), 0x2_0000_0004);
        assert_eq!(WaitCode::from_word(6), Some(WaitCode::Barrier { rank: 5 }));
        assert_eq!(
            WaitCode::from_word(0x1_0000_0001),
            Some(WaitCode::Signal { rank: 0 })
        );
        assert_eq!(
            WaitCode::from_word(0x2_0000_0004),
            Some(WaitCode::Exchange { sender: 3 })
        );
        // No error, no rank, or a kind no kernel writes.
        assert_eq!(WaitCode::from_word(0), None);
        assert_eq!(WaitCode::from_word(0x1_0000_0000), None);
        assert_eq!(WaitCode::from_word(0x3_0000_0001), None);
    }

    #[test]
    fn each_kernel_takes_its_struct_and_reads_only_its_fields() {
        assert_eq!(BarrierParams::check_reads(SOURCE), Ok(()));
        assert_eq!(SignalParams::check_reads(SOURCE), Ok(()));
        assert_eq!(WaitParams::check_reads(SOURCE), Ok(()));
        let text = source();
        assert!(text.contains("xcall_shmem_barrier(BarrierParams p)"));
        assert!(text.contains("xcall_shmem_signal(SignalParams p)"));
        assert!(text.contains("xcall_shmem_wait(WaitParams p)"));
        // The definitions (and the typedef they use) come before the kernels.
        let kernels = text.find("__global__").expect("kernels");
        for needle in [
            "typedef unsigned long long u64;",
            "struct BarrierParams {",
            "struct SignalParams {",
            "struct WaitParams {",
        ] {
            assert!(text.find(needle).is_some_and(|at| at < kernels), "{needle}");
        }
    }
}
