//! The CUDA side of a world: device heap, peer mappings (direct pointers
//! with peer access inside one process, IPC handles across processes),
//! copies on the copy engine, and the barrier, signal and wait kernels.
//!
//! Every driver call runs with the PE's device made current explicitly
//! (`xcall_core::cuda::with_context`), never the calling thread's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use xcall_core::cuda::{self, CudaFunction, KernelRecord, Launch, Params, RawStream, Stream};
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

/// Writes `bytes` (host memory) to device memory at `dst`, waiting for the
/// copy.
///
/// # Safety
/// `dst` must be `bytes.len()` writable bytes of `device`.
pub(crate) unsafe fn write_device(device: Device, dst: u64, bytes: &[u8]) -> Result<()> {
    // SAFETY: the caller's contract on `dst`; `bytes` is live host memory.
    Ok(unsafe { cuda::copy_htod_sync(device, dst, bytes) }?)
}

/// Reads the 64-bit word at `addr` of `device`, waiting for the copy.
///
/// # Safety
/// `addr` must be 8 readable bytes of `device`.
pub(crate) unsafe fn read_word(device: Device, addr: u64) -> Result<u64> {
    let mut v = [0u64];
    // SAFETY: the caller's contract on `addr`; writes 8 bytes into `v`.
    unsafe { cuda::copy_dtoh_sync(device, &mut v, addr) }?;
    Ok(v[0])
}

/// A stream of the PE's own (non-blocking), for blocking copies and polls:
/// core's owned stream, waited for and destroyed on drop.
pub(crate) use xcall_core::cuda::OwnedStream as OwnStream;

/// Whether everything enqueued on `stream` so far has completed, asked
/// with its device's primary context current.
pub(crate) fn idle(stream: &Stream) -> Result<bool> {
    Ok(stream.in_context(|s| s.is_idle())?)
}

/// Waits on the host for everything enqueued on `stream`, with its
/// device's primary context current.
pub(crate) fn sync(stream: &Stream) -> Result<()> {
    Ok(stream.in_context(|s| s.sync())?)
}

/// `bytes` from `src` to `dst` on `stream` (any mix of host and device
/// addresses: unified addressing).
///
/// # Safety
/// Both ranges must be valid for the whole copy; `stream` is null or a
/// live stream of `device`.
pub(crate) unsafe fn copy(
    device: Device,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: RawStream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract on `stream`.
    let s = unsafe { Stream::from_raw(device, stream) };
    // SAFETY: the caller's contract on both ranges.
    Ok(s.in_context(|s| unsafe { s.copy(dst, src, bytes) })?)
}

/// Whether `stream` is capturing into a CUDA graph.
///
/// # Safety
/// `stream` is a live stream of `device` (or null: the legacy stream).
pub(crate) unsafe fn capturing(device: Device, stream: RawStream) -> Result<bool> {
    // SAFETY: the caller's contract on `stream`.
    let s = unsafe { Stream::from_raw(device, stream) };
    Ok(s.in_context(|s| s.is_capturing())?)
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
    stream: RawStream,
    count: &Arc<AtomicUsize>,
) -> Result<bool> {
    // SAFETY: the caller's contract on `stream`.
    let s = unsafe { Stream::from_raw(device, stream) };
    count.fetch_add(1, Ordering::AcqRel);
    let held = count.clone();
    // Runs once: when the driver lets the graph go, or at once when the
    // stream does not capture (or a call failed), taking the count back.
    let release = Box::new(move || {
        held.fetch_sub(1, Ordering::AcqRel);
    });
    Ok(s.on_capture_release(release)?)
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
    stream: RawStream,
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
    stream: RawStream,
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
