//! One way to launch a kernel: its parameters as [`KernelRecord`]s in 8-byte
//! slots (no positional lists that can drift from the kernel's signature),
//! the grid and block in a [`Launch`], the driver call checked.
//!
//! Launches into a stream under capture can be recorded
//! ([`recording_launches`]): each one's graph node, function, shape and
//! parameters, with the slots that hold device pointers (the fields of
//! pointer type in its records). A graph made only of recorded launches
//! can then be pointed at new buffers by rewriting those slots in the
//! executable ([`RecordedLaunch::set_in_exec`]), with no new capture.

use std::cell::RefCell;
use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction};

use super::{check, ContextGuard, GraphExec, KernelRecord};
use crate::{Device, Result};

/// A kernel's parameters in order, each a [`KernelRecord`] starting at its
/// own 8-byte slot and spanning as many slots as it needs (the driver reads
/// a parameter's size from the kernel's signature at the slot's start).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Params {
    slots: Vec<u64>,
    /// The slot each parameter starts at.
    starts: Vec<usize>,
    /// The slots holding a device pointer (a record field of pointer type).
    pointers: Vec<usize>,
}

impl Params {
    /// No parameters yet.
    pub fn new() -> Params {
        Params::default()
    }

    /// A kernel parameter struct, passed by value (its bytes copied).
    pub fn record<R: KernelRecord>(mut self, value: &R) -> Params {
        let size = std::mem::size_of::<R>();
        // SAFETY: `KernelRecord` types have no padding, so all `size` bytes
        // of `value` are initialised; the slice lives as long as `value`.
        let bytes = unsafe { std::slice::from_raw_parts((value as *const R).cast::<u8>(), size) };
        let start = self.slots.len();
        self.starts.push(start);
        self.pointers
            .extend(R::pointer_offsets().iter().map(|offset| start + offset / 8));
        self.slots.extend(bytes.chunks(8).map(|chunk| {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            u64::from_le_bytes(word)
        }));
        self
    }

    /// How many parameters there are.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// The same parameters with every device pointer `p` replaced by
    /// `relocate(p)`; every other byte unchanged.
    pub fn relocated(&self, relocate: impl Fn(u64) -> u64) -> Params {
        let mut out = self.clone();
        for &slot in &self.pointers {
            out.slots[slot] = relocate(self.slots[slot]);
        }
        out
    }

    /// The driver's array of parameter addresses (into `slots`).
    fn addresses(&mut self) -> Vec<*mut c_void> {
        let base = self.slots.as_mut_ptr();
        self.starts
            .iter()
            // SAFETY: every start is an index into `slots` (pushed with it).
            .map(|&at| unsafe { base.add(at) }.cast())
            .collect()
    }
}

/// A kernel launched through [`launch`] into a stream under capture.
#[derive(Clone, Debug)]
pub struct RecordedLaunch {
    /// The kernel node the launch added to the capture's graph.
    node: sys::CUgraphNode,
    function: sys::CUfunction,
    config: Launch,
    /// The parameters the node holds now.
    pub params: Params,
}

// SAFETY: the node and function are opaque driver handles, valid from any
// thread; whoever holds a RecordedLaunch uses it from one thread at a time.
unsafe impl Send for RecordedLaunch {}

impl RecordedLaunch {
    /// The graph node of the launch.
    pub fn node(&self) -> sys::CUgraphNode {
        self.node
    }

    /// Sets this launch's node in `exec` (instantiated from the graph the
    /// launch was captured into) to the same kernel and shape with
    /// `params`, which then become [`Self::params`]. The change applies to
    /// the next launches of `exec`, not to those in flight.
    ///
    /// # Safety
    /// `exec` is a live executable of that graph, used by no other thread
    /// meanwhile, and every pointer in `params` is valid for what the
    /// kernel does with it when `exec` next runs.
    pub unsafe fn set_in_exec(
        &mut self,
        device: Device,
        exec: sys::CUgraphExec,
        mut params: Params,
    ) -> Result<()> {
        let mut addresses = params.addresses();
        let node = sys::CUDA_KERNEL_NODE_PARAMS {
            func: self.function,
            gridDimX: self.config.grid.0,
            gridDimY: self.config.grid.1,
            gridDimZ: self.config.grid.2,
            blockDimX: self.config.block.0,
            blockDimY: self.config.block.1,
            blockDimZ: self.config.block.2,
            sharedMemBytes: self.config.shared_bytes,
            kernelParams: addresses.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        };
        // SAFETY: the caller's contract on `exec` and the pointers; the
        // node is a kernel node of the graph `exec` was instantiated from
        // (recorded at its launch); the driver copies the parameters
        // before returning.
        check("cuGraphExecKernelNodeSetParams", device, unsafe {
            sys::cuGraphExecKernelNodeSetParams_v2(exec, self.node, &node)
        })?;
        self.params = params;
        Ok(())
    }

    /// [`Self::set_in_exec`] on an owned executable.
    ///
    /// # Safety
    /// `exec` was instantiated from the graph the launch was captured into,
    /// and every pointer in `params` is valid for what the kernel does with
    /// it when `exec` next runs.
    pub unsafe fn set_in(
        &mut self,
        device: Device,
        exec: &mut GraphExec,
        params: Params,
    ) -> Result<()> {
        // SAFETY: the caller's contract; `&mut` keeps other users out.
        unsafe { self.set_in_exec(device, exec.raw(), params) }
    }
}

thread_local! {
    static RECORDING: RefCell<Option<Vec<RecordedLaunch>>> = const { RefCell::new(None) };
}

/// Runs `f`, returning with its value every launch [`launch`] made on this
/// thread into a stream under capture while `f` ran (nested calls record
/// their own launches and hide them from this one). A launch whose node
/// cannot be identified is not in the list.
pub fn recording_launches<T>(f: impl FnOnce() -> T) -> (T, Vec<RecordedLaunch>) {
    let outer = RECORDING.with(|r| r.replace(Some(Vec::new())));
    let value = f();
    let recorded = RECORDING.with(|r| r.replace(outer)).unwrap_or_default();
    (value, recorded)
}

/// Appends the launch just made on `config.stream` to this thread's
/// recording, if one is open and the stream is capturing: the node is the
/// capture's single dependency right after the launch.
fn record_launch(function: &CudaFunction, config: Launch, params: &Params) {
    if RECORDING.with(|r| r.borrow().is_none()) {
        return;
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut count = 0usize;
    // SAFETY: queries the stream the launch was enqueued on; every output
    // is a valid pointer; the dependency array is read before any other
    // call on the stream.
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            config.stream,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut edges,
            &mut count,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        || count != 1
        || deps.is_null()
    {
        return;
    }
    // SAFETY: the driver reported one dependency at `deps`.
    let node = unsafe { *deps };
    RECORDING.with(|r| {
        if let Some(list) = r.borrow_mut().as_mut() {
            list.push(RecordedLaunch {
                node,
                function: function.cu_function(),
                config,
                params: params.clone(),
            });
        }
    });
}

/// Where and how wide a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
    /// The stream the launch is ordered on.
    pub stream: sys::CUstream,
}

impl Launch {
    /// `blocks` blocks of `threads` threads in one dimension, no dynamic
    /// shared memory.
    pub fn linear(blocks: u32, threads: u32, stream: sys::CUstream) -> Launch {
        Launch {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
            stream,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory per block.
    pub fn with_shared(self, bytes: u32) -> Launch {
        Launch {
            shared_bytes: bytes,
            ..self
        }
    }
}

/// Launches `function` with a raw array of parameter addresses
/// (`cuLaunchKernel`), as issued: no context switch (the caller has the
/// stream's context current) and no recording. For tests and benches
/// that build a kernel's arguments by hand; library code uses [`launch`].
///
/// # Safety
/// `args` holds one pointer per kernel parameter, each to a live value of
/// the parameter's type; every device address in them is valid for what
/// the kernel does; `config.stream` belongs to the current context.
pub unsafe fn launch_raw(
    function: &CudaFunction,
    config: Launch,
    args: &mut [*mut c_void],
) -> std::result::Result<(), super::DriverError> {
    // SAFETY: the caller's contract.
    unsafe {
        sys::cuLaunchKernel(
            function.cu_function(),
            config.grid.0,
            config.grid.1,
            config.grid.2,
            config.block.0,
            config.block.1,
            config.block.2,
            config.shared_bytes,
            config.stream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Launches `function` on `device` (its primary context current for the
/// call, the caller's restored after it).
///
/// # Safety
/// `params` must match the kernel's signature (count, order, and each
/// parameter's size: at most 8 bytes, or a [`KernelRecord`] of the kernel's
/// parameter struct), every pointer in it must be valid for
/// what the kernel does with it, and the stream must belong to `device`.
pub unsafe fn launch(
    device: Device,
    function: &CudaFunction,
    config: Launch,
    params: &mut Params,
) -> Result<()> {
    let mut pointers = params.addresses();
    let guard = ContextGuard::primary(device)?;
    // SAFETY: the caller's contract on the parameters and the stream; every
    // slot outlives the call.
    let launched = unsafe { launch_raw(function, config, &mut pointers) };
    let restored = guard.restore();
    launched.map_err(|e| super::driver_error("cuLaunchKernel", device, e))?;
    record_launch(function, config, params);
    restored
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::kernel_params! {
        /// Twelve bytes then eight: spans three slots.
        struct Three {
            /// First.
            a: u32 => "unsigned int",
            /// Second.
            b: i32 => "int",
            /// Third.
            c: f32 => "float",
            /// Fourth.
            d: i32 => "int",
            /// Fifth.
            e: u64 => "unsigned long long",
        }
    }

    crate::kernel_params! {
        /// One slot.
        struct One {
            /// The value.
            v: u64 => "unsigned long long",
        }
    }

    #[test]
    fn a_record_is_one_parameter_over_its_bytes() {
        let r = Three {
            a: 0x0102_0304,
            b: -1,
            c: 2.0,
            d: 7,
            e: 0xaabb_ccdd_eeff_0011,
        };
        let p = Params::new()
            .record(&One { v: 5 })
            .record(&r)
            .record(&One { v: 9 });
        assert_eq!(p.len(), 3);
        assert_eq!(p.starts, vec![0, 1, 4]);
        assert_eq!(
            p.slots,
            vec![
                5,
                0xffff_ffff_0102_0304,
                (7u64 << 32) | 2.0f32.to_bits() as u64,
                0xaabb_ccdd_eeff_0011,
                9
            ]
        );
    }

    crate::kernel_params! {
        /// Two pointers around a count, and a pointer-sized number.
        struct Pointers {
            /// A pointer.
            src: u64 => "const float*",
            /// Not a pointer.
            n: u64 => "unsigned long long",
            /// A pointer (spaces after the star are fine).
            dst: u64 => "float * ",
            /// Not a pointer.
            scale: f32 => "float",
            /// Not a pointer.
            flags: u32 => "unsigned int",
        }
    }

    #[test]
    fn pointer_fields_and_only_they_are_relocated() {
        let p = Params::new().record(&One { v: 0x1000 }).record(&Pointers {
            src: 0x1000,
            n: 0x1000,
            dst: 0x2008,
            scale: 1.5,
            flags: 3,
        });
        assert_eq!(p.pointers, vec![1, 3]);
        let moved = p.relocated(|a| a + 0x10_0000);
        assert_eq!(
            moved.slots,
            vec![
                0x1000,
                0x10_1000,
                0x1000,
                0x10_2008,
                (3u64 << 32) | 1.5f32.to_bits() as u64
            ]
        );
        assert_eq!((moved.starts, moved.pointers), (p.starts, p.pointers));
    }

    #[test]
    fn recording_collects_nothing_without_a_capture_and_nests() {
        let ((), outer) = recording_launches(|| {
            let (v, inner) = recording_launches(|| 7);
            assert_eq!((v, inner.len()), (7, 0));
        });
        assert!(outer.is_empty());
        assert!(RECORDING.with(|r| r.borrow().is_none()), "closed again");
    }

    #[test]
    fn linear_launches_fill_one_dimension() {
        let l = Launch::linear(5, 128, std::ptr::null_mut()).with_shared(1024);
        assert_eq!(l.grid, (5, 1, 1));
        assert_eq!(l.block, (128, 1, 1));
        assert_eq!(l.shared_bytes, 1024);
    }
}
