//! The CUDA path: kernels from `kernels.cu`, compiled with NVRTC once per
//! device and module family, launched on the caller's stream.
//!
//! Autotuning: movement and arithmetic kernels have a launch config
//! (threads per block, vectors in flight per thread). The first call per
//! (device, kernel, dtype, vector width, row-size class) with autotuning on
//! and a stream that is not capturing times every candidate on scratch
//! outputs (stream-ordered allocations freed right after; nothing the
//! caller can see is written), waits for the stream once, and caches the
//! fastest config for the device. Under capture, or with autotuning off,
//! the cached config or the default is used. Every config computes the
//! same bits (the summation order never depends on the config).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaFunction};
use xcall_core::cuda::{self, driver_error};
use xcall_core::kernel_cache::LoadedModule;
use xcall_core::{DType, Device, DeviceMap, Fp8, KernelCache, KernelSource};

use crate::call::{
    Dims, MakeChunkSortMapArgs, MakeRowIdMapArgs, PermuteArgs, SortChunksArgs, Target, Tensor,
    UnpermuteArgs, UnpermuteBackwardArgs,
};
use crate::chunks::{self, Direction};
use crate::error::{shape, PermuteError};
use crate::MapFaults;

const SOURCE: &str = include_str!("kernels.cu");
/// Shared memory the kernels may use without opting in.
const SMEM_LIMIT: usize = 48 * 1024;

type Result<T> = std::result::Result<T, PermuteError>;

fn driver(call: &'static str, device: Device, r: sys::CUresult) -> Result<()> {
    r.result()
        .map_err(|e| PermuteError::Platform(driver_error(call, device, e)))
}

/// A launch config of a tunable kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// Threads per block.
    pub threads: u32,
    /// Vectors in flight per thread (movement, unpermute), or dot slots per
    /// thread (`unpermute_backward`: threads = 256 / slots).
    pub unroll: u32,
    /// Blocks per multiprocessor, each looping over rows; 0 for one block
    /// per row.
    pub waves: u32,
}

/// Which module a kernel lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Family {
    /// Row-id map, chunk map, permute, zero fill, chunk sort.
    Movement,
    /// unpermute and its backward for one float dtype.
    Arith(DType),
}

const MOVE_WIDTHS: [usize; 5] = [16, 8, 4, 2, 1];
const UNROLLS: [u32; 3] = [1, 2, 4];

fn instantiations(family: Family) -> String {
    let mut s = String::new();
    match family {
        Family::Movement => {
            for v in MOVE_WIDTHS {
                for u in UNROLLS {
                    s += &format!(
                        "extern \"C\" __global__ void permute_{v}_{u}(const unsigned char* in, const int* map, const float* probs, const float* scales, unsigned char* out, float* pprobs, float* pscales, i64 T, int E, i64 row, int S, i64 N) {{ permute_body<{v}, {u}>(in, map, probs, scales, out, pprobs, pscales, T, E, row, S, N); }}\n\
                         extern \"C\" __global__ void sort_{v}_{u}(const unsigned char* in, const i64* map, const float* probs, unsigned char* out, float* pprobs, i64 T, i64 row, int backward) {{ sort_body<{v}, {u}>(in, map, probs, out, pprobs, T, row, backward); }}\n"
                    );
                }
                s += &format!(
                    "extern \"C\" __global__ void zero_{v}(unsigned char* out, float* pprobs, float* pscales, const i64* tpe, const i64* offsets, int E, i64 N, i64 row, int S) {{ zero_body<{v}>(out, pprobs, pscales, tpe, offsets, E, N, row, S); }}\n"
                );
            }
        }
        Family::Arith(dtype) => {
            let codec = codec_name(dtype);
            for v in arith_widths(dtype) {
                for u in UNROLLS {
                    s += &format!(
                        "extern \"C\" __global__ void unpermute_{v}_{u}(const unsigned char* in, const int* map, const float* mprobs, const float* pprobs, unsigned char* out, float* uprobs, i64 T, int E, i64 H, i64 N) {{ unpermute_body<{codec}, {v}, {u}>(in, map, mprobs, pprobs, out, uprobs, T, E, H, N); }}\n"
                    );
                    if Fp8::of(dtype).is_some() {
                        continue; // fp8: unpermute without probs only
                    }
                    s += &format!(
                        "extern \"C\" __global__ void unpermute_bwd_{v}_{u}(const unsigned char* grad, const unsigned char* fwd, const int* map, const float* mprobs, unsigned char* act, float* pgrad, i64 T, int E, i64 H, i64 N) {{ unpermute_bwd_body<{codec}, {v}, {u}>(grad, fwd, map, mprobs, act, pgrad, T, E, H, N); }}\n"
                    );
                }
            }
        }
    }
    s
}

fn codec_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::F8E4M3 => "F8E4M3",
        DType::F8E5M2 => "F8E5M2",
        _ => "BF16",
    }
}

fn arith_widths(dtype: DType) -> [usize; 2] {
    [16, dtype.size_bytes()]
}

struct Loaded {
    function: CudaFunction,
    _module: Arc<LoadedModule>,
}

type TuneKey = (&'static str, u32, usize, u32);
type FunctionKey = (Family, String);

#[derive(Default)]
struct State {
    kernels: KernelCache,
    /// Loaded kernels by (module family, kernel name): the arithmetic
    /// families share kernel names.
    functions: DeviceMap<Mutex<HashMap<FunctionKey, Arc<Loaded>>>>,
    tuned: DeviceMap<Mutex<HashMap<TuneKey, Config>>>,
    multiprocessors: DeviceMap<u64>,
    /// The address of each loaded module's map fault word
    /// (`xcall_map_faults` in `kernels.cu`).
    fault_words: DeviceMap<Mutex<HashMap<Family, u64>>>,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(State::default)
}

fn function(device: Device, family: Family, name: &str) -> Result<Arc<Loaded>> {
    let slot = state()
        .functions
        .get_or_init(device, || Mutex::new(HashMap::new()));
    let key = (family, name.to_string());
    if let Some(f) = slot.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(f.clone());
    }
    let code = format!("{SOURCE}\n{}", instantiations(family));
    let program = match family {
        Family::Movement => "xcall_permute_movement.cu".to_string(),
        Family::Arith(d) => format!("xcall_permute_{d}.cu"),
    };
    let module = state().kernels.module(
        device,
        &KernelSource {
            name: &program,
            code: &code,
            options: &["-std=c++17"],
        },
    )?;
    let loaded = Arc::new(Loaded {
        function: module.function(name)?,
        _module: module,
    });
    register_fault_word(device, family, &loaded)?;
    slot.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, loaded.clone());
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
    let (mut address, mut bytes) = (0u64, 0usize);
    cuda::with_context(device, |_| {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a function of a module this crate keeps loaded (the
        // `Loaded` holds it); writes one handle.
        unsafe { sys::cuFuncGetModule(&mut module, loaded.function.cu_function()) }
            .result()
            .map_err(|e| driver_error("cuFuncGetModule", device, e))?;
        // SAFETY: a loaded module and a NUL-terminated name; writes the
        // global's address and size.
        unsafe {
            sys::cuModuleGetGlobal_v2(
                &mut address,
                &mut bytes,
                module,
                c"xcall_map_faults".as_ptr(),
            )
        }
        .result()
        .map_err(|e| driver_error("cuModuleGetGlobal", device, e))
    })?;
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
            unsafe { sys::cuMemsetD32Async(word, 0, 1, stream) }
                .result()
                .map_err(|e| driver_error("cuMemsetD32Async", target.device, e))?;
        }
        Ok(())
    })?;
    Ok(values.iter().fold(0, |a, v| a | v))
}

/// Copies each `(host, address)` pair (`host.len()` values from device
/// memory at `address`) in the order of the target's stream, lets `also`
/// enqueue more work behind the copies, then waits for the stream.
fn read_back<T: Copy>(
    target: &Target,
    reads: &mut [(&mut [T], u64)],
    also: impl FnOnce(sys::CUstream) -> xcall_core::Result<()>,
) -> Result<()> {
    let (device, stream) = (target.device, target.stream as sys::CUstream);
    cuda::with_context(device, |_| {
        for (host, address) in reads.iter_mut() {
            if host.is_empty() {
                continue;
            }
            // SAFETY: `host` is a live buffer of `size_of_val(host)` bytes,
            // not read before the wait below; `address` holds as many bytes
            // of this device (checked by the caller).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.as_mut_ptr().cast(),
                    *address,
                    std::mem::size_of_val(*host),
                    stream,
                )
            }
            .result()
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", device, e))?;
        }
        also(stream)?;
        // SAFETY: a live stream of the caller.
        unsafe { sys::cuStreamSynchronize(stream) }
            .result()
            .map_err(|e| driver_error("cuStreamSynchronize", device, e))
    })?;
    Ok(())
}

/// Checked mode (see [`Target::checked`]; nothing to do without it):
/// checks the map on the device before an op follows it. Outside a
/// capture the op waits for the result and a fault is this call's error
/// (nothing written); under capture the check is part of the graph and its
/// faults are recorded for [`take_faults`].
fn check_map_on_device(
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
    let scratch = Scratch::alloc(target, bytes)?;
    let base = scratch.address();
    cuda::with_context(dev, |_| {
        // SAFETY: zeroes the scratch just allocated on this stream.
        unsafe { sys::cuMemsetD8Async(base, 0, bytes as usize, target.stream as sys::CUstream) }
            .result()
            .map_err(|e| driver_error("cuMemsetD8Async", dev, e))
    })?;
    let word = if capturing { fault_word(dev)? } else { base };
    let (counts_at, taken_at) = (base + 8, base + 8 + counts * 8);
    let (tpe, offsets) = chunks.map_or((0, 0), |(t, o)| (t.address, o.address));
    launch(
        target,
        &function(dev, Family::Movement, "rim_check")?,
        (d.tokens as u64).div_ceil(256).min(1 << 16),
        256,
        0,
        &[
            Arg::P(map.address),
            Arg::P(tpe),
            Arg::P(offsets),
            Arg::I64(d.tokens as i64),
            Arg::I32(d.experts as i32),
            Arg::I64(d.out_rows as i64),
            Arg::P(taken_at),
            Arg::P(counts_at),
            Arg::P(word),
        ],
    )?;
    if chunks.is_some() {
        launch(
            target,
            &function(dev, Family::Movement, "rim_check_counts")?,
            counts.div_ceil(256),
            256,
            0,
            &[
                Arg::P(tpe),
                Arg::P(offsets),
                Arg::P(counts_at),
                Arg::I32(d.experts as i32),
                Arg::P(word),
            ],
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
    function(device, Family::Movement, "rim_check")?;
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

/// One kernel parameter (each is passed as an 8-byte slot; 32-bit values
/// sit in its low bytes, which is where the driver reads them).
#[derive(Clone, Copy, Debug)]
enum Arg {
    P(u64),
    I64(i64),
    I32(i32),
}

fn launch(
    target: &Target,
    f: &Arc<Loaded>,
    grid: u64,
    threads: u32,
    smem: usize,
    args: &[Arg],
) -> Result<()> {
    if grid == 0 {
        return Ok(());
    }
    let grid = grid.min(i32::MAX as u64) as u32;
    let mut slots: Vec<u64> = args
        .iter()
        .map(|a| match *a {
            Arg::P(p) => p,
            Arg::I64(v) => v as u64,
            Arg::I32(v) => v as u32 as u64,
        })
        .collect();
    let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
    let device = target.device;
    cuda::with_context(device, |_| {
        // SAFETY: `params` matches the kernel's signature (one slot per
        // parameter, in order, each alive for the call); the caller checked
        // every buffer against its shape and the device.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.function.cu_function(),
                (grid, 1, 1),
                (threads, 1, 1),
                smem as u32,
                target.stream as sys::CUstream,
                &mut params,
            )
        }
        .map_err(|e| driver_error("cuLaunchKernel", device, e))
    })?;
    Ok(())
}

/// Stream-ordered device scratch, freed in stream order when dropped.
pub(crate) struct Scratch {
    device: Device,
    stream: sys::CUstream,
    address: u64,
}

impl Scratch {
    fn alloc(target: &Target, bytes: u64) -> Result<Scratch> {
        let mut address = 0;
        if bytes > 0 {
            cuda::with_context(target.device, |_| {
                // SAFETY: writes one device pointer; the stream belongs to
                // this device (the caller's contract).
                unsafe {
                    sys::cuMemAllocAsync(
                        &mut address,
                        bytes as usize,
                        target.stream as sys::CUstream,
                    )
                }
                .result()
                .map_err(|e| driver_error("cuMemAllocAsync", target.device, e))
            })?;
        }
        Ok(Scratch {
            device: target.device,
            stream: target.stream as sys::CUstream,
            address,
        })
    }

    /// Scratch holding a copy of `bytes` bytes at `src` (stream-ordered).
    pub(crate) fn copy_of(target: &Target, src: u64, bytes: u64) -> Result<Scratch> {
        let scratch = Self::alloc(target, bytes)?;
        if bytes > 0 {
            cuda::with_context(target.device, |_| {
                // SAFETY: both ranges are `bytes` long device memory of this
                // device (src checked by the caller, the scratch just made).
                unsafe {
                    sys::cuMemcpyDtoDAsync_v2(scratch.address, src, bytes as usize, scratch.stream)
                }
                .result()
                .map_err(|e| driver_error("cuMemcpyDtoDAsync", target.device, e))
            })?;
        }
        Ok(scratch)
    }

    pub(crate) fn address(&self) -> u64 {
        self.address
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.address == 0 {
            return;
        }
        let (address, stream) = (self.address, self.stream);
        // A failure here leaves the allocation to the pool's release at
        // context teardown; there is no caller to report it to.
        let _ = cuda::with_context(self.device, |_| {
            // SAFETY: frees an allocation made on this stream, after the
            // work enqueued on it so far.
            let _ = unsafe { sys::cuMemFreeAsync(address, stream) };
            Ok(())
        });
    }
}

/// Whether the target's stream is capturing.
fn capturing(target: &Target) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: queries a live stream of the caller; writes one value.
    let r = unsafe { sys::cuStreamIsCapturing(target.stream as sys::CUstream, &mut status) };
    driver("cuStreamIsCapturing", target.device, r)?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Refuses tensors that are not device memory of the target's device.
fn check_device_memory(target: &Target, tensors: &[(&str, Option<&Tensor>)]) -> Result<()> {
    let ordinal = cuda::check_device(target.device)?;
    cuda::with_context(target.device, |_| Ok(()))?;
    for (name, t) in tensors {
        let Some(t) = t else { continue };
        if t.bytes() == 0 {
            continue;
        }
        let mut dev: i32 = -1;
        // SAFETY: writes one int; any address value is legal to query.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut dev as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                t.address,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || dev != ordinal as i32 {
            return Err(shape(format!(
                "{name} at {:#x} is not device memory of {} ({})",
                t.address,
                target.device,
                if r == sys::CUresult::CUDA_SUCCESS {
                    format!("it belongs to cuda:{dev}")
                } else {
                    cuda::describe(cudarc::driver::DriverError(r))
                }
            )));
        }
    }
    Ok(())
}

/// The widest vector (bytes) that divides the row and every address.
fn width(row_bytes: u64, addresses: &[u64]) -> usize {
    MOVE_WIDTHS
        .into_iter()
        .find(|&v| row_bytes % v as u64 == 0 && addresses.iter().all(|a| a % v as u64 == 0))
        .unwrap_or(1)
}

fn arith_width(dtype: DType, row_bytes: u64, addresses: &[u64]) -> usize {
    if width(row_bytes, addresses) == 16 {
        16
    } else {
        dtype.size_bytes()
    }
}

fn row_class(row_bytes: u64) -> u32 {
    64 - row_bytes.max(1).leading_zeros()
}

fn default_config(vectors_per_row: u64) -> Config {
    let threads = (vectors_per_row.div_ceil(2))
        .next_power_of_two()
        .clamp(64, 256) as u32;
    Config {
        threads,
        unroll: 2,
        waves: 0,
    }
}

fn movement_candidates() -> Vec<Config> {
    let mut c = Vec::new();
    for threads in [128, 256, 512] {
        for unroll in UNROLLS {
            for waves in [0, 4, 8] {
                c.push(Config {
                    threads,
                    unroll,
                    waves,
                });
            }
        }
    }
    c
}

/// See [`set_after_tuning_hook`].
pub type TuningHook = Box<dyn Fn(&str)>;

thread_local! {
    static AFTER_TUNING: std::cell::RefCell<Option<TuningHook>> =
        const { std::cell::RefCell::new(None) };
}

/// Test hook: `hook(kernel)` runs on this thread after a kernel's tuning
/// trials and before its real launch (`None` removes it). Tests use it to
/// check that the trials wrote nothing the caller can see.
#[doc(hidden)]
pub fn set_after_tuning_hook(hook: Option<TuningHook>) {
    AFTER_TUNING.with(|h| *h.borrow_mut() = hook);
}

/// Times `run` for every candidate on scratch outputs of `out_bytes`; see
/// the module docs.
fn choose(
    target: &Target,
    key: TuneKey,
    default: Config,
    candidates: &[Config],
    out_bytes: &[u64],
    run: &dyn Fn(Config, &[u64]) -> Result<()>,
) -> Result<Config> {
    let slot = state()
        .tuned
        .get_or_init(target.device, || Mutex::new(HashMap::new()));
    if let Some(c) = slot.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(*c);
    }
    if !target.autotune || capturing(target)? {
        return Ok(default);
    }
    let chosen = time_candidates(target, candidates, out_bytes, run)?.unwrap_or(default);
    AFTER_TUNING.with(|h| {
        if let Some(hook) = &*h.borrow() {
            hook(key.0)
        }
    });
    slot.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, chosen);
    Ok(chosen)
}

fn time_candidates(
    target: &Target,
    candidates: &[Config],
    out_bytes: &[u64],
    run: &dyn Fn(Config, &[u64]) -> Result<()>,
) -> Result<Option<Config>> {
    let mut scratch = Vec::new();
    for &b in out_bytes {
        match Scratch::alloc(target, b) {
            Ok(s) => scratch.push(s),
            // Too little memory for trials: keep the default config.
            Err(_) => return Ok(None),
        }
    }
    let outs: Vec<u64> = scratch.iter().map(|s| s.address).collect();
    const REPS: usize = 3;
    let device = target.device;
    cuda::with_context(device, |_| Ok(()))?;
    let mut events: Vec<(sys::CUevent, sys::CUevent)> = Vec::new();
    let result = (|| -> Result<Option<Config>> {
        for &c in candidates {
            run(c, &outs)?; // warm-up
            let mut pair = (std::ptr::null_mut(), std::ptr::null_mut());
            cuda::with_context(device, |_| {
                // SAFETY: creates and records two events on the caller's
                // stream in the device's context.
                unsafe {
                    for ev in [&mut pair.0, &mut pair.1] {
                        sys::cuEventCreate(ev, 0)
                            .result()
                            .map_err(|e| driver_error("cuEventCreate", device, e))?;
                    }
                    sys::cuEventRecord(pair.0, target.stream as sys::CUstream)
                        .result()
                        .map_err(|e| driver_error("cuEventRecord", device, e))
                }
            })?;
            events.push(pair);
            for _ in 0..REPS {
                run(c, &outs)?;
            }
            cuda::with_context(device, |_| {
                // SAFETY: records an event created above.
                unsafe { sys::cuEventRecord(pair.1, target.stream as sys::CUstream) }
                    .result()
                    .map_err(|e| driver_error("cuEventRecord", device, e))
            })?;
        }
        let mut best: Option<(f32, Config)> = None;
        for (&(start, end), &c) in events.iter().zip(candidates) {
            let mut ms = 0f32;
            cuda::with_context(device, |_| {
                // SAFETY: both events were recorded on the stream above.
                unsafe {
                    sys::cuEventSynchronize(end)
                        .result()
                        .map_err(|e| driver_error("cuEventSynchronize", device, e))?;
                    sys::cuEventElapsedTime_v2(&mut ms, start, end)
                        .result()
                        .map_err(|e| driver_error("cuEventElapsedTime", device, e))
                }
            })?;
            if best.is_none_or(|(b, _)| ms < b) {
                best = Some((ms, c));
            }
        }
        Ok(best.map(|(_, c)| c))
    })();
    let _ = cuda::with_context(device, |_| {
        for (a, b) in &events {
            // SAFETY: destroys events created above (after their use).
            unsafe {
                sys::cuEventDestroy_v2(*a);
                sys::cuEventDestroy_v2(*b);
            }
        }
        Ok(())
    });
    drop(scratch);
    result
}

fn opt(t: &Option<Tensor>) -> u64 {
    t.as_ref().map_or(0, |t| t.address)
}

fn opt_bytes(t: &Option<Tensor>) -> u64 {
    t.as_ref().map_or(0, Tensor::bytes)
}

/// Blocks for `rows` rows under `config`.
fn grid_for(device: Device, rows: usize, config: Config) -> Result<u64> {
    let rows = (rows as u64).min(1 << 20);
    if config.waves == 0 {
        return Ok(rows);
    }
    let sms = *state().multiprocessors.get_or_try_init(device, || {
        cuda::device_info(device).map(|i| i.multiprocessors as u64)
    })?;
    Ok(rows.min(sms * config.waves as u64))
}

/// See [`crate::call::make_row_id_map`]. Deterministic: three passes over
/// blocks of tokens, block prefix sums, no atomics.
pub(crate) unsafe fn make_row_id_map(target: &Target, a: &MakeRowIdMapArgs, d: Dims) -> Result<()> {
    check_device_memory(
        target,
        &[
            ("routing", Some(&a.routing)),
            ("row_id_map", Some(&a.row_id_map)),
            ("tokens_per_expert", Some(&a.tokens_per_expert)),
            ("expert_offsets", Some(&a.expert_offsets)),
        ],
    )?;
    let (t, e) = (d.tokens, d.experts);
    if t > i32::MAX as usize {
        return Err(PermuteError::Unsupported(format!(
            "{t} tokens: the CUDA row-id map supports up to 2^31 - 1"
        )));
    }
    let max_experts = SMEM_LIMIT / 9;
    if e > max_experts {
        return Err(PermuteError::Unsupported(format!(
            "{e} experts: the CUDA row-id map supports up to {max_experts}"
        )));
    }
    // Small blocks of tokens for parallelism (about 512 blocks), at most
    // what shared memory holds.
    let tb = ((SMEM_LIMIT - 8 * e) / e).min(t.div_ceil(512).clamp(8, 128));
    let nblocks = t.div_ceil(tb) as u64;
    let align = a.options.align.unwrap_or(1) as i64;
    let cap = a.options.num_out_tokens.map_or(i64::MAX, |c| c as i64);
    let capacity = a.options.capacity.map_or(0, |c| c as i64);
    let (routing, map, tpe, off) = (
        a.routing.address,
        a.row_id_map.address,
        a.tokens_per_expert.address,
        a.expert_offsets.address,
    );
    let (ti, ei, tbi) = (Arg::I64(t as i64), Arg::I32(e as i32), Arg::I32(tb as i32));
    let dev = target.device;
    launch(
        target,
        &function(dev, Family::Movement, "rim_count")?,
        nblocks,
        256,
        tb * e,
        &[Arg::P(routing), Arg::P(map), ti, ei, tbi],
    )?;
    launch(
        target,
        &function(dev, Family::Movement, "rim_scan_blocks")?,
        e as u64,
        256,
        0,
        &[
            Arg::P(map),
            Arg::P(tpe),
            ti,
            ei,
            tbi,
            Arg::I64(nblocks as i64),
        ],
    )?;
    launch(
        target,
        &function(dev, Family::Movement, "rim_offsets")?,
        1,
        1024,
        0,
        &[
            Arg::P(tpe),
            Arg::P(off),
            ei,
            Arg::I64(align),
            Arg::I64(cap),
            Arg::I64(capacity),
        ],
    )?;
    launch(
        target,
        &function(dev, Family::Movement, "rim_write")?,
        nblocks,
        256,
        8 * e + tb * e,
        &[
            Arg::P(routing),
            Arg::P(map),
            Arg::P(off),
            ti,
            ei,
            tbi,
            Arg::I64(cap),
            Arg::I64(capacity),
        ],
    )
}

/// Zeroes the rows of `[output, permuted_probs, permuted_scales]` (0 for
/// an absent one) that no route writes: each expert chunk's padding and the
/// rows past the last chunk (`d.scales` values per row of scales).
fn zero_unwritten(
    target: &Target,
    outs: [u64; 3],
    (tokens_per_expert, expert_offsets): (&Tensor, &Tensor),
    d: Dims,
    row: u64,
) -> Result<()> {
    let v = width(row, &[outs[0]]);
    launch(
        target,
        &function(target.device, Family::Movement, &format!("zero_{v}"))?,
        d.experts as u64 + 1,
        256,
        0,
        &[
            Arg::P(outs[0]),
            Arg::P(outs[1]),
            Arg::P(outs[2]),
            Arg::P(tokens_per_expert.address),
            Arg::P(expert_offsets.address),
            Arg::I32(d.experts as i32),
            Arg::I64(d.out_rows as i64),
            Arg::I64(row as i64),
            Arg::I32(d.scales as i32),
        ],
    )
}

/// See [`crate::call::permute`].
pub(crate) unsafe fn permute(target: &Target, a: &PermuteArgs, d: Dims) -> Result<()> {
    check_device_memory(
        target,
        &[
            ("input", Some(&a.input)),
            ("row_id_map", Some(&a.row_id_map)),
            ("tokens_per_expert", Some(&a.tokens_per_expert)),
            ("expert_offsets", Some(&a.expert_offsets)),
            ("probs", a.probs.as_ref()),
            ("scales", a.scales.as_ref()),
            ("output", Some(&a.output)),
            ("permuted_probs", a.permuted_probs.as_ref()),
            ("permuted_scales", a.permuted_scales.as_ref()),
        ],
    )?;
    check_map_on_device(
        target,
        &a.row_id_map,
        Some((&a.tokens_per_expert, &a.expert_offsets)),
        d,
    )?;
    let row = (d.hidden * a.input.dtype.size_bytes()) as u64;
    let dev = target.device;
    zero_unwritten(
        target,
        [
            a.output.address,
            opt(&a.permuted_probs),
            opt(&a.permuted_scales),
        ],
        (&a.tokens_per_expert, &a.expert_offsets),
        d,
        row,
    )?;
    if d.tokens == 0 || (row == 0 && d.scales == 0 && a.probs.is_none()) {
        return Ok(());
    }
    let v = width(row, &[a.input.address, a.output.address]);
    let run = |c: Config, outs: &[u64]| -> Result<()> {
        launch(
            target,
            &function(dev, Family::Movement, &format!("permute_{v}_{}", c.unroll))?,
            grid_for(dev, d.tokens, c)?,
            c.threads,
            0,
            &[
                Arg::P(a.input.address),
                Arg::P(a.row_id_map.address),
                Arg::P(opt(&a.probs)),
                Arg::P(opt(&a.scales)),
                Arg::P(outs[0]),
                Arg::P(outs[1]),
                Arg::P(outs[2]),
                Arg::I64(d.tokens as i64),
                Arg::I32(d.experts as i32),
                Arg::I64(row as i64),
                Arg::I32(d.scales as i32),
                Arg::I64(d.out_rows as i64),
            ],
        )
    };
    let config = choose(
        target,
        ("permute", 0, v, row_class(row)),
        default_config(row / v as u64),
        &movement_candidates(),
        &[
            a.output.bytes(),
            opt_bytes(&a.permuted_probs),
            opt_bytes(&a.permuted_scales),
        ],
        &run,
    )?;
    run(
        config,
        &[
            a.output.address,
            opt(&a.permuted_probs),
            opt(&a.permuted_scales),
        ],
    )
}

/// See [`crate::call::unpermute`].
pub(crate) unsafe fn unpermute(target: &Target, a: &UnpermuteArgs, d: Dims) -> Result<()> {
    check_device_memory(
        target,
        &[
            ("input", Some(&a.input)),
            ("row_id_map", Some(&a.row_id_map)),
            ("merging_probs", a.merging_probs.as_ref()),
            ("permuted_probs", a.permuted_probs.as_ref()),
            ("output", Some(&a.output)),
            ("unpermuted_probs", a.unpermuted_probs.as_ref()),
        ],
    )?;
    check_map_on_device(target, &a.row_id_map, None, d)?;
    if d.tokens == 0 {
        return Ok(());
    }
    let dtype = a.input.dtype;
    let row = (d.hidden * dtype.size_bytes()) as u64;
    let v = arith_width(dtype, row, &[a.input.address, a.output.address]);
    let dev = target.device;
    let run = |c: Config, outs: &[u64]| -> Result<()> {
        launch(
            target,
            &function(
                dev,
                Family::Arith(dtype),
                &format!("unpermute_{v}_{}", c.unroll),
            )?,
            grid_for(dev, d.tokens, c)?,
            c.threads,
            0,
            &[
                Arg::P(a.input.address),
                Arg::P(a.row_id_map.address),
                Arg::P(opt(&a.merging_probs)),
                Arg::P(opt(&a.permuted_probs)),
                Arg::P(outs[0]),
                Arg::P(outs[1]),
                Arg::I64(d.tokens as i64),
                Arg::I32(d.experts as i32),
                Arg::I64(d.hidden as i64),
                Arg::I64(d.out_rows as i64),
            ],
        )
    };
    let config = choose(
        target,
        ("unpermute", dtype as u32, v, row_class(row)),
        default_config(row / v as u64),
        &movement_candidates(),
        &[a.output.bytes(), opt_bytes(&a.unpermuted_probs)],
        &run,
    )?;
    run(config, &[a.output.address, opt(&a.unpermuted_probs)])
}

/// See [`crate::call::unpermute_backward`].
pub(crate) unsafe fn unpermute_backward(
    target: &Target,
    a: &UnpermuteBackwardArgs,
    d: Dims,
) -> Result<()> {
    check_device_memory(
        target,
        &[
            ("grad", Some(&a.grad)),
            ("fwd_input", Some(&a.fwd_input)),
            ("row_id_map", Some(&a.row_id_map)),
            ("tokens_per_expert", Some(&a.tokens_per_expert)),
            ("expert_offsets", Some(&a.expert_offsets)),
            ("merging_probs", Some(&a.merging_probs)),
            ("act_grad", Some(&a.act_grad)),
            ("probs_grad", Some(&a.probs_grad)),
        ],
    )?;
    check_map_on_device(
        target,
        &a.row_id_map,
        Some((&a.tokens_per_expert, &a.expert_offsets)),
        d,
    )?;
    let dtype = a.grad.dtype;
    let row = (d.hidden * dtype.size_bytes()) as u64;
    let dev = target.device;
    let no_scales = Dims { scales: 0, ..d };
    zero_unwritten(
        target,
        [a.act_grad.address, 0, 0],
        (&a.tokens_per_expert, &a.expert_offsets),
        no_scales,
        row,
    )?;
    if d.tokens == 0 {
        return Ok(());
    }
    let v = arith_width(
        dtype,
        row,
        &[a.grad.address, a.fwd_input.address, a.act_grad.address],
    );
    let run = |c: Config, outs: &[u64]| -> Result<()> {
        launch(
            target,
            &function(
                dev,
                Family::Arith(dtype),
                &format!("unpermute_bwd_{v}_{}", c.unroll),
            )?,
            grid_for(dev, d.tokens, c)?,
            c.threads,
            0,
            &[
                Arg::P(a.grad.address),
                Arg::P(a.fwd_input.address),
                Arg::P(a.row_id_map.address),
                Arg::P(a.merging_probs.address),
                Arg::P(outs[0]),
                Arg::P(outs[1]),
                Arg::I64(d.tokens as i64),
                Arg::I32(d.experts as i32),
                Arg::I64(d.hidden as i64),
                Arg::I64(d.out_rows as i64),
            ],
        )
    };
    let candidates: Vec<Config> = UNROLLS
        .iter()
        .flat_map(|&unroll| {
            [0, 4, 8].map(|waves| Config {
                threads: 256 / unroll,
                unroll,
                waves,
            })
        })
        .collect();
    let config = choose(
        target,
        ("unpermute_backward", dtype as u32, v, row_class(row)),
        Config {
            threads: 128,
            unroll: 2,
            waves: 0,
        },
        &candidates,
        &[a.act_grad.bytes(), a.probs_grad.bytes()],
        &run,
    )?;
    run(config, &[a.act_grad.address, a.probs_grad.address])
}

/// Largest chunk count the CUDA chunk map holds in shared memory.
pub const MAX_CUDA_CHUNKS: usize = (SMEM_LIMIT - 8) / 17;

/// See [`crate::call::make_chunk_sort_map`].
pub(crate) unsafe fn make_chunk_sort_map(
    target: &Target,
    a: &MakeChunkSortMapArgs,
    tokens: usize,
) -> Result<()> {
    check_device_memory(
        target,
        &[
            ("split_sizes", Some(&a.split_sizes)),
            ("sorted_indices", Some(&a.sorted_indices)),
            ("map", Some(&a.map)),
        ],
    )?;
    let s = a.split_sizes.dims[0] as usize;
    if s > MAX_CUDA_CHUNKS {
        return Err(PermuteError::Unsupported(format!(
            "{s} chunks: the CUDA chunk map supports up to {MAX_CUDA_CHUNKS}"
        )));
    }
    if !capturing(target)? {
        // Read the split back and check it on the Host for a clear error.
        let mut sizes = vec![0i64; s];
        let mut sorted = vec![0i64; s];
        read_back(
            target,
            &mut [
                (&mut sizes[..], a.split_sizes.address),
                (&mut sorted[..], a.sorted_indices.address),
            ],
            |_| Ok(()),
        )?;
        chunks::check_split(&sizes, &sorted, tokens)?;
    }
    launch(
        target,
        &function(target.device, Family::Movement, "chunk_map")?,
        (tokens as u64).div_ceil(256).clamp(1, 1 << 16),
        256,
        (2 * s + 1) * 8 + s,
        &[
            Arg::P(a.split_sizes.address),
            Arg::P(a.sorted_indices.address),
            Arg::P(a.map.address),
            Arg::I32(s as i32),
            Arg::I64(tokens as i64),
        ],
    )
}

/// See [`crate::call::sort_chunks_by_map`].
pub(crate) unsafe fn sort_chunks_by_map(
    target: &Target,
    a: &SortChunksArgs,
    d: Dims,
) -> Result<()> {
    check_device_memory(
        target,
        &[
            ("input", Some(&a.input)),
            ("map", Some(&a.map)),
            ("probs", a.probs.as_ref()),
            ("output", Some(&a.output)),
            ("permuted_probs", a.permuted_probs.as_ref()),
        ],
    )?;
    let row = (d.hidden * a.input.dtype.size_bytes()) as u64;
    if d.tokens == 0 {
        return Ok(());
    }
    let v = width(row, &[a.input.address, a.output.address]);
    let dev = target.device;
    let backward = matches!(a.direction, Direction::Backward) as i32;
    let run = |c: Config, outs: &[u64]| -> Result<()> {
        launch(
            target,
            &function(dev, Family::Movement, &format!("sort_{v}_{}", c.unroll))?,
            grid_for(dev, d.tokens, c)?,
            c.threads,
            0,
            &[
                Arg::P(a.input.address),
                Arg::P(a.map.address),
                Arg::P(opt(&a.probs)),
                Arg::P(outs[0]),
                Arg::P(outs[1]),
                Arg::I64(d.tokens as i64),
                Arg::I64(row as i64),
                Arg::I32(backward),
            ],
        )
    };
    let config = choose(
        target,
        ("sort_chunks", 0, v, row_class(row)),
        default_config(row / v as u64),
        &movement_candidates(),
        &[a.output.bytes(), opt_bytes(&a.permuted_probs)],
        &run,
    )?;
    run(config, &[a.output.address, opt(&a.permuted_probs)])
}

/// The config cached for a kernel on a device, if any (tests and
/// benchmarks report it).
pub fn cached_configs(device: Device) -> Vec<(String, Config)> {
    state().tuned.get(device).map_or_else(Vec::new, |slot| {
        let map = slot.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, Config)> = map
            .iter()
            .map(|(k, c)| {
                (
                    format!("{} dtype={} vec={} row~2^{}", k.0, k.1, k.2, k.3),
                    *c,
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    })
}
