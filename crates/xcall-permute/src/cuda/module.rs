//! The kernels' modules: each family's source from the catalogue,
//! compiled once per device; the map fault word of each module; the
//! launch, scratch and device-memory helpers every op uses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use xcall_core::cuda::{
    self, CudaFunction, KernelRecord, Launch, Params, Reach, Stream, StreamAlloc,
};
use xcall_core::kernel_cache::LoadedModule;
use xcall_core::{Device, KernelSource};

use super::catalogue::{module_source, program_name, Family, Kernel};
use super::params::MapCheckParams;
use super::{state, Result};
use crate::args::{NamedTensors, Segments, Target, Tensor};
use crate::check::Dims;
use crate::error::{shape, PermuteError};
use crate::MapFaults;

/// Shared memory the kernels may use without opting in.
pub(super) const SMEM_LIMIT: usize = 48 * 1024;

pub(super) struct Loaded {
    pub(super) function: CudaFunction,
    /// The most threads per block the compiled kernel launches with (its
    /// registers decide).
    max_threads: u32,
    /// Blocks that fit a multiprocessor at once, by (threads per block,
    /// dynamic shared memory bytes).
    resident: Mutex<HashMap<(u32, usize), u32>>,
    _module: Arc<LoadedModule>,
}

/// How many blocks of `kernel` with `threads` threads and `smem` bytes of
/// dynamic shared memory fit one multiprocessor at once (at least 1; the
/// driver's occupancy answer, cached per kernel).
pub(super) fn resident_blocks(
    device: Device,
    kernel: Kernel,
    threads: u32,
    smem: usize,
) -> Result<u32> {
    let f = function(device, kernel)?;
    if let Some(&n) = f
        .resident
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(threads, smem))
    {
        return Ok(n);
    }
    let n = cuda::max_active_blocks(device, &f.function, threads, smem)?.max(1);
    f.resident
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert((threads, smem), n);
    Ok(n)
}

/// `kernel` loaded on `device` (its module built and loaded on first use).
pub(super) fn function(device: Device, kernel: Kernel) -> Result<Arc<Loaded>> {
    let slot = state()
        .functions
        .get_or_init(device, || Mutex::new(HashMap::new()));
    if let Some(f) = slot.lock().unwrap_or_else(|p| p.into_inner()).get(&kernel) {
        return Ok(f.clone());
    }
    let family = kernel.family();
    let module = state().kernels.module(
        device,
        &KernelSource {
            name: &program_name(family),
            code: &module_source(family),
            options: &["-std=c++17"],
        },
    )?;
    let function = module.function(&kernel.name())?;
    let max_threads = cuda::max_threads_per_block(device, &function)?;
    let loaded = Arc::new(Loaded {
        function,
        max_threads,
        resident: Mutex::new(HashMap::new()),
        _module: module,
    });
    register_fault_word(device, family, &loaded)?;
    slot.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(kernel, loaded.clone());
    Ok(loaded)
}

/// Records the fault word of the module `loaded` belongs to, once per
/// (device, family).
fn register_fault_word(device: Device, family: Family, loaded: &Loaded) -> Result<()> {
    let words = state()
        .fault_words
        .get_or_init(device, || Mutex::new(HashMap::new()));
    if words
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(&family)
    {
        return Ok(());
    }
    let (address, bytes) = cuda::module_global(device, &loaded.function, c"xcall_map_faults")?;
    if bytes != 4 {
        return Err(shape(format!(
            "xcall_map_faults is {bytes} bytes on {device}, expected 4"
        )));
    }
    words
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(family, address);
    Ok(())
}

/// Waits for `stream`, then reads (and zeroes) the map faults of every
/// module of the device that has run.
pub(crate) fn take_faults(target: &Target) -> Result<u32> {
    let words: Vec<u64> = state()
        .fault_words
        .get(target.device)
        .map(|w| {
            w.lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .copied()
                .collect()
        })
        .unwrap_or_default();
    let mut values = vec![0u32; words.len()];
    let mut reads: Vec<(&mut [u32], u64)> =
        values.chunks_mut(1).zip(words.iter().copied()).collect();
    // The words are zeroed behind the reads, in stream order, before the
    // wait.
    read_back(target, &mut reads, |stream| {
        for &word in &words {
            // SAFETY: a 4-byte module global of this device.
            unsafe { stream.memset_d32(word, 0, 1) }?;
        }
        Ok(())
    })?;
    Ok(values.iter().fold(0, |a, v| a | v))
}

/// Copies each `(host, address)` pair (`host.len()` values from device
/// memory at `address`) in the order of the target's stream, lets `also`
/// enqueue more work behind the copies, then waits for the stream.
pub(super) fn read_back<T: Copy>(
    target: &Target,
    reads: &mut [(&mut [T], u64)],
    also: impl FnOnce(&Stream) -> xcall_core::Result<()>,
) -> Result<()> {
    stream(target).in_context(|stream| {
        for (host, address) in reads.iter_mut() {
            // SAFETY: `host` is a live buffer, not read before the wait
            // below; `address` holds as many bytes of this device (checked
            // by the caller).
            unsafe { stream.copy_dtoh(host, *address) }?;
        }
        also(stream)?;
        stream.sync()
    })?;
    Ok(())
}

/// Checked mode (see [`Target::checked`]; nothing to do without it):
/// checks the map on the device before an op follows it. Outside a
/// capture the op waits for the result and a fault is this call's error
/// (nothing written); under capture the check is part of the graph and its
/// faults are recorded for [`take_faults`].
pub(super) fn check_map_on_device(
    target: &Target,
    map: &Tensor,
    chunks: Option<(&Tensor, &Tensor)>,
    d: Dims,
) -> Result<()> {
    if !target.checked || d.tokens == 0 && chunks.is_none() {
        return Ok(());
    }
    let dev = target.device;
    let capturing = capturing(target)?;
    // Scratch: the result word, E route counts, N bits of taken rows.
    let bitmap_words = d.out_rows.div_ceil(32) as u64;
    let counts = d.experts as u64;
    let bytes = 8 + counts * 8 + bitmap_words * 4;
    let scratch = scratch(target, bytes)?;
    let base = scratch.address();
    // SAFETY: zeroes the scratch just allocated on this stream.
    stream(target).in_context(|s| unsafe { s.memset_d8(base, 0, bytes as usize) })?;
    let word = if capturing { fault_word(dev)? } else { base };
    let (counts_at, taken_at) = (base + 8, base + 8 + counts * 8);
    let (tpe, offsets) = chunks.map_or((0, 0), |(t, o)| (t.address, o.address));
    let p = MapCheckParams {
        map: map.address,
        tpe,
        offsets,
        taken: taken_at,
        counts: counts_at,
        word,
        tokens: d.tokens as i64,
        experts: d.experts as i64,
        out_rows: d.out_rows as i64,
    };
    launch(
        target,
        Kernel::RimCheck,
        (d.tokens as u64).div_ceil(256).min(1 << 16),
        256,
        0,
        &p,
    )?;
    if chunks.is_some() {
        launch(
            target,
            Kernel::RimCheckCounts,
            counts.div_ceil(256),
            256,
            0,
            &p,
        )?;
    }
    if capturing {
        return Ok(());
    }
    let mut found = [0u32];
    read_back(target, &mut [(&mut found[..], word)], |_| Ok(()))?;
    let found = found[0];
    if found != 0 {
        return Err(shape(format!(
            "row_id_map is invalid (checked on {dev}): {}",
            MapFaults(found)
        )));
    }
    Ok(())
}

/// The Movement module's fault word of `device` (loading it if needed).
fn fault_word(device: Device) -> Result<u64> {
    function(device, Kernel::RimCheck)?;
    state()
        .fault_words
        .get(device)
        .and_then(|w| {
            w.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&Family::Movement)
                .copied()
        })
        .ok_or_else(|| shape(format!("no map fault word on {device}")))
}

/// Launches `kernel` with its parameter struct `params` on the target's
/// stream (nothing when `grid` is 0). A struct other than the kernel's, or
/// more threads than the compiled kernel takes, is refused.
pub(super) fn launch<R: KernelRecord>(
    target: &Target,
    kernel: Kernel,
    grid: u64,
    threads: u32,
    smem: usize,
    params: &R,
) -> Result<()> {
    if kernel.params() != R::NAME {
        return Err(PermuteError::Unsupported(format!(
            "kernel {} takes {}, not {}",
            kernel.name(),
            kernel.params(),
            R::NAME
        )));
    }
    if grid == 0 {
        return Ok(());
    }
    let f = function(target.device, kernel)?;
    if threads > f.max_threads {
        return Err(PermuteError::Unsupported(format!(
            "kernel {} launches with at most {} threads per block on {}, not {threads}",
            kernel.name(),
            f.max_threads,
            target.device
        )));
    }
    let grid = grid.min(i32::MAX as u64) as u32;
    let config = Launch::linear(grid, threads, stream(target).raw()).with_shared(smem as u32);
    let mut params = Params::new().record(params);
    // SAFETY: every kernel of kernels.cu takes one parameter struct whose C
    // definition is generated from `R` with its layout asserted, and each
    // caller passes the struct of the kernel it names; every buffer in it
    // was checked against its shape and the device.
    unsafe { cuda::launch(target.device, &f.function, config, &mut params) }?;
    Ok(())
}

/// The target's stream.
pub(super) fn stream(target: &Target) -> Stream {
    // SAFETY: the target's stream is a live stream of its device (the
    // caller's contract on every op) and outlives the op that uses it.
    unsafe { Stream::from_raw(target.device, target.stream.cast()) }
}

/// `bytes` of stream-ordered device scratch on the target's stream.
pub(super) fn scratch(target: &Target, bytes: u64) -> Result<StreamAlloc> {
    Ok(stream(target).scratch(bytes as usize)?)
}

/// Scratch holding a copy of `bytes` bytes at `src` (stream-ordered), for
/// staging an in-place call's input.
pub(crate) fn copy_of(target: &Target, src: u64, bytes: usize) -> Result<StreamAlloc> {
    let copy = scratch(target, bytes as u64)?;
    // SAFETY: `src` is `bytes` of device memory of the target's device
    // (checked by the caller); the scratch was just made that long.
    unsafe { copy.copy_from(src, bytes) }?;
    Ok(copy)
}

/// Whether the target's stream is capturing.
pub(super) fn capturing(target: &Target) -> Result<bool> {
    Ok(stream(target).is_capturing()?)
}

/// Refuses tensors that are not device memory of the target's device.
pub(super) fn check_device_memory(target: &Target, a: &impl NamedTensors) -> Result<()> {
    let ordinal = cuda::check_device(target.device)?;
    cuda::retain_primary_context(target.device)?;
    for (name, t) in a.inputs().into_iter().chain(a.outputs()) {
        if t.bytes() == 0 {
            continue;
        }
        let owner = cuda::pointer_device(t.address)?;
        if owner != Ok(ordinal) {
            return Err(shape(format!(
                "{name} at {:#x} is not device memory of {} ({})",
                t.address,
                target.device,
                match owner {
                    Ok(dev) => format!("it belongs to cuda:{dev}"),
                    Err(e) => cuda::describe(e),
                }
            )));
        }
    }
    Ok(())
}

/// Refuses a segment of tensor `name` (`bytes` bytes each, `Some` past
/// the first, which [`check_device_memory`] checked as the tensor) that
/// is not device memory the target's device reaches: its own, or a GPU's
/// it can access as a peer (xcall-shmem's worlds enable that access).
pub(super) fn check_segments_reachable(
    target: &Target,
    name: &str,
    s: &Segments,
    bytes: u64,
) -> Result<()> {
    cuda::check_device(target.device)?;
    if bytes == 0 {
        return Ok(());
    }
    for (i, &base) in s.bases.iter().enumerate().skip(1) {
        match cuda::reach(target.device, base)? {
            Reach::Own | Reach::Peer(_) => {}
            Reach::NotDevice(e) => {
                return Err(shape(format!(
                    "{name} segment {i} at {base:#x} is not device memory ({})",
                    cuda::describe(e)
                )))
            }
            Reach::Foreign(owner) => {
                return Err(shape(format!(
                    "{name} segment {i} at {base:#x} belongs to {owner}, which {} cannot access as a peer",
                    target.device
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::catalogue::{Lanes, FAMILIES};
    use crate::cuda::params::PermuteParams;

    /// Every module this crate loads compiles with NVRTC, no GPU needed:
    /// assembled for sm_90 (the fp8 conversions' inline PTX included) and
    /// as PTX for compute_80 (the fp8 steps without those instructions).
    #[test]
    fn every_module_compiles_with_nvrtc() {
        let Some(version) = xcall_core::testing::nvrtc_or_skip("permute modules with NVRTC") else {
            return;
        };
        eprintln!("NVRTC {}.{}", version.0, version.1);
        std::thread::scope(|s| {
            for family in FAMILIES {
                for arch in ["sm_90", "compute_80"] {
                    s.spawn(move || {
                        xcall_core::testing::nvrtc_compiles(
                            &format!("{family:?}"),
                            &module_source(family),
                            arch,
                            &["-std=c++17"],
                        );
                    });
                }
            }
        });
    }

    #[test]
    fn a_struct_other_than_the_kernels_is_refused_before_anything_runs() {
        let target = Target {
            device: Device::cuda(0),
            stream: std::ptr::null_mut(),
            autotune: false,
            checked: false,
        };
        let err = launch(
            &target,
            Kernel::Sort(Lanes {
                width: 16,
                unroll: 1,
                warp: false,
            }),
            1,
            256,
            0,
            &PermuteParams::default(),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("kernel sort_16_1 takes SortParams, not PermuteParams"),
            "{err}"
        );
    }
}
