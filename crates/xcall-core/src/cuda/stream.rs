//! One stream type: a device and a driver stream, with what xcall does on
//! a stream (capture status, waiting, copies, memsets, stream-ordered
//! scratch, graph capture and launch).
//!
//! A [`Stream`] borrows the stream (its owner creates and destroys it); an
//! [`OwnedStream`] creates one and destroys it on drop. The methods issue
//! the driver call as is, with no context switch: where the driver needs a
//! current context (copies, memsets, waits), the caller has one, for
//! example through [`Stream::in_context`] or [`with_context`]. Only
//! [`Stream::scratch`] and [`OwnedStream`] make the device's primary
//! context current themselves, as [`StreamAlloc`] does.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::{
    available, check, on, with_context, CudaContext, Event, Graph, GraphExec, StreamAlloc,
};
use crate::{Device, Error, Result};

/// A driver stream handle (`CUstream`), for code that receives one from a
/// framework or hands one to a library.
pub type RawStream = sys::CUstream;

/// A driver context handle (`CUcontext`).
pub type RawContext = sys::CUcontext;

/// A driver device handle (`CUdevice`), as `cuDeviceGet` and
/// `cuStreamGetDevice` answer it.
pub type RawDevice = sys::CUdevice;

/// How a capture treats other threads' calls that are unsafe during it
/// (`CUstreamCaptureMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Only this thread's unsafe calls are refused (other threads, other
    /// devices, are unaffected). What xcall's graph cache uses.
    ThreadLocal,
    /// Unsafe calls of every thread are refused.
    Global,
    /// Nothing is refused.
    Relaxed,
}

impl CaptureMode {
    /// The driver's value, for APIs that take it (cudarc's
    /// `CudaStream::begin_capture`).
    pub fn driver(self) -> sys::CUstreamCaptureMode {
        use sys::CUstreamCaptureMode as M;
        match self {
            CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

/// A stream of one device, borrowed: the device names it in errors, the
/// raw handle is the owner's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream {
    device: Device,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is an opaque driver handle; the driver API accepts it
// from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; the handle is only passed to driver calls.
unsafe impl Sync for Stream {}

impl Stream {
    /// The stream `raw` of `device` (null: the legacy default stream).
    ///
    /// # Safety
    /// `raw` is null or a live stream of `device` that outlives this value,
    /// its copies and every [`StreamAlloc`] made through it.
    pub unsafe fn from_raw(device: Device, raw: RawStream) -> Stream {
        Stream { device, raw }
    }

    /// [`Stream::from_raw`] for a handle passed as an integer (an FFI
    /// argument, a framework's stream pointer).
    ///
    /// # Safety
    /// As for [`Stream::from_raw`].
    pub unsafe fn from_handle(device: Device, handle: u64) -> Stream {
        Stream {
            device,
            raw: handle as usize as sys::CUstream,
        }
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw handle.
    pub fn raw(&self) -> RawStream {
        self.raw
    }

    /// Whether this is the legacy default stream (a null handle), which
    /// cannot be captured.
    pub fn is_null(&self) -> bool {
        self.raw.is_null()
    }

    /// Runs `f` with the device's primary context current, then restores
    /// the caller's ([`with_context`]).
    pub fn in_context<T>(&self, f: impl FnOnce(&Stream) -> Result<T>) -> Result<T> {
        with_context(self.device, |_| f(self))
    }

    fn call(&self, name: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
        available()?;
        check(name, self.device, f())
    }

    /// Whether the stream is capturing into a graph (`cuStreamIsCapturing`,
    /// legal on a stream under capture; needs no current context).
    pub fn is_capturing(&self) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: writes one value; the stream is live (from_raw's contract).
        self.call("cuStreamIsCapturing", || unsafe {
            sys::cuStreamIsCapturing(self.raw, &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Waits on the host for everything enqueued so far
    /// (`cuStreamSynchronize`).
    pub fn sync(&self) -> Result<()> {
        // SAFETY: a live stream (from_raw's contract).
        self.call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Whether everything enqueued so far has completed (`cuStreamQuery`:
    /// `CUDA_ERROR_NOT_READY` is `false`, not an error).
    pub fn is_idle(&self) -> Result<bool> {
        available()?;
        // SAFETY: a live stream (from_raw's contract).
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => check("cuStreamQuery", self.device, e).map(|()| false),
        }
    }

    /// The driver's device of the stream (`cuStreamGetDevice`).
    pub fn driver_device(&self) -> Result<RawDevice> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one value; the stream is only queried.
        self.call("cuStreamGetDevice", || unsafe {
            sys::cuStreamGetDevice(self.raw, &mut dev)
        })?;
        Ok(dev)
    }

    /// The context the stream was created in (`cuStreamGetCtx`).
    pub fn context(&self) -> Result<RawContext> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle; the stream is only queried.
        self.call("cuStreamGetCtx", || unsafe {
            sys::cuStreamGetCtx(self.raw, &mut ctx)
        })?;
        Ok(ctx)
    }

    /// Copies `src` (host memory) to the device address `dst` in stream
    /// order (`cuMemcpyHtoDAsync`). Nothing for an empty `src`.
    ///
    /// # Safety
    /// `dst` holds `size_of_val(src)` writable bytes; `src` stays alive and
    /// unchanged until the copy has run.
    pub unsafe fn copy_htod<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        self.call("cuMemcpyHtoDAsync", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast::<c_void>(), bytes, self.raw)
        })
    }

    /// Copies from the device address `src` into `dst` (host memory) in
    /// stream order (`cuMemcpyDtoHAsync`): `dst` holds the values once the
    /// stream has reached the copy (see [`Stream::sync`]). Nothing for an
    /// empty `dst`.
    ///
    /// # Safety
    /// `src` holds `size_of_val(dst)` readable bytes; `dst` stays alive and
    /// is not read until the copy has run.
    pub unsafe fn copy_dtoh<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        self.call("cuMemcpyDtoHAsync", || unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast::<c_void>(), src, bytes, self.raw)
        })
    }

    /// Copies `bytes` between device addresses in stream order
    /// (`cuMemcpyDtoDAsync`, issued also for 0 bytes).
    ///
    /// # Safety
    /// Both ranges are `bytes` of device memory, valid until the copy runs.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        self.call("cuMemcpyDtoDAsync", || unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.raw)
        })
    }

    /// Copies `bytes` between any two addresses (host or device: unified
    /// addressing) in stream order (`cuMemcpyAsync`, issued also for 0
    /// bytes).
    ///
    /// # Safety
    /// Both ranges are valid for the whole copy.
    pub unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        self.call("cuMemcpyAsync", || unsafe {
            sys::cuMemcpyAsync(dst, src, bytes, self.raw)
        })
    }

    /// Copies `bytes` from `src` in `src_ctx` to `dst` in `dst_ctx`
    /// (`cuMemcpyPeerAsync`).
    ///
    /// # Safety
    /// Both ranges are `bytes` of device memory of their contexts, valid
    /// until the copy runs.
    pub unsafe fn copy_peer(
        &self,
        dst: u64,
        dst_ctx: &CudaContext,
        src: u64,
        src_ctx: &CudaContext,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract; both contexts are alive (borrowed).
        self.call("cuMemcpyPeerAsync", || unsafe {
            sys::cuMemcpyPeerAsync(
                dst,
                dst_ctx.cu_ctx(),
                src,
                src_ctx.cu_ctx(),
                bytes,
                self.raw,
            )
        })
    }

    /// Sets `count` bytes at `dst` to `value` in stream order
    /// (`cuMemsetD8Async`).
    ///
    /// # Safety
    /// `dst` holds `count` writable bytes of device memory.
    pub unsafe fn memset_d8(&self, dst: u64, value: u8, count: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        self.call("cuMemsetD8Async", || unsafe {
            sys::cuMemsetD8Async(dst, value, count, self.raw)
        })
    }

    /// Sets `count` 16-bit words at `dst` to `value` (`cuMemsetD16Async`).
    ///
    /// # Safety
    /// `dst` is 2-byte aligned and holds `count` writable words.
    pub unsafe fn memset_d16(&self, dst: u64, value: u16, count: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        self.call("cuMemsetD16Async", || unsafe {
            sys::cuMemsetD16Async(dst, value, count, self.raw)
        })
    }

    /// Sets `count` 32-bit words at `dst` to `value` (`cuMemsetD32Async`).
    ///
    /// # Safety
    /// `dst` is 4-byte aligned and holds `count` writable words.
    pub unsafe fn memset_d32(&self, dst: u64, value: u32, count: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        self.call("cuMemsetD32Async", || unsafe {
            sys::cuMemsetD32Async(dst, value, count, self.raw)
        })
    }

    /// Makes the stream wait until the 64-bit word at `address` is at
    /// least `value` (`cuStreamWaitValue64`, `CU_STREAM_WAIT_VALUE_GEQ`).
    ///
    /// # Safety
    /// `address` is 8 bytes of memory the device can read, until the wait
    /// is over.
    pub unsafe fn wait_value_geq(&self, address: u64, value: u64) -> Result<()> {
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the caller's contract.
        self.call("cuStreamWaitValue64", || unsafe {
            sys::cuStreamWaitValue64_v2(self.raw, address, value, geq)
        })
    }

    /// `bytes` of device scratch allocated in this stream's order and freed
    /// in it when dropped ([`StreamAlloc`]; 0 bytes allocate nothing).
    pub fn scratch(&self, bytes: usize) -> Result<StreamAlloc> {
        // SAFETY: the stream is live and outlives the allocation
        // (from_raw's contract).
        unsafe { StreamAlloc::new(self.device, self.raw, bytes) }
    }

    /// Begins capturing the stream's work into a graph
    /// (`cuStreamBeginCapture`).
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        // SAFETY: begins capture on a live stream; the driver refuses one
        // already capturing.
        self.call("cuStreamBeginCapture", || unsafe {
            sys::cuStreamBeginCapture_v2(self.raw, mode.driver())
        })
    }

    /// Ends the capture begun by [`Stream::begin_capture`]
    /// (`cuStreamEndCapture`). The stream leaves capture mode also when
    /// this fails (an invalidated capture); a graph the driver returned
    /// anyway is destroyed.
    pub fn end_capture(&self) -> Result<Graph> {
        available()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends this stream's capture; writes one handle.
        let r = unsafe { sys::cuStreamEndCapture(self.raw, &mut graph) };
        // SAFETY: a non-null handle is the graph the capture made, owned
        // from here on.
        let owned = (!graph.is_null()).then(|| unsafe { Graph::from_raw(graph) });
        check("cuStreamEndCapture", self.device, r)?;
        owned.ok_or_else(|| Error::Unsupported("stream capture produced no graph".into()))
    }

    /// Ties `release` to the graph this stream is capturing, if it is: the
    /// driver runs it once, after it has destroyed that graph and every
    /// executable made from it (a CUDA user object the graph owns).
    /// Returns whether the stream was capturing. `release` runs exactly
    /// once: when the driver lets the graph go if it was tied to it, else
    /// (the stream was not capturing, or a call failed) before this
    /// returns. `release` must call no CUDA function. Makes the device's primary context current for the
    /// driver calls (`cuStreamGetCaptureInfo`, `cuUserObjectCreate`,
    /// `cuGraphRetainUserObject`).
    pub fn on_capture_release(&self, release: Box<dyn FnOnce() + Send>) -> Result<bool> {
        unsafe extern "C" fn run(p: *mut c_void) {
            // SAFETY: `p` is the box made below, released once by the
            // driver.
            let f = unsafe { Box::from_raw(p.cast::<Box<dyn FnOnce() + Send>>()) };
            f();
        }
        let device = self.device;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut id, mut graph) = (0 as sys::cuuint64_t, std::ptr::null_mut());
        let (mut deps, mut edges, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: a live stream (from_raw's contract); every output is a
        // valid pointer.
        let info = on(device, "cuStreamGetCaptureInfo", || unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.raw,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        });
        if let Err(e) = info {
            release();
            return Err(e);
        }
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null()
        {
            release();
            return Ok(false);
        }
        let held = Box::into_raw(Box::new(release));
        let mut object: sys::CUuserObject = std::ptr::null_mut();
        let flags = sys::CUuserObject_flags_enum::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32;
        // SAFETY: `run` frees `held` once, when the object's last reference
        // goes.
        let made = on(device, "cuUserObjectCreate", || unsafe {
            sys::cuUserObjectCreate(&mut object, held.cast(), Some(run), 1, flags)
        });
        if let Err(e) = made {
            // SAFETY: the driver did not take `held`.
            let release = unsafe { Box::from_raw(held) };
            release();
            return Err(e);
        }
        let moved = sys::CUuserObjectRetain_flags_enum::CU_GRAPH_USER_OBJECT_MOVE as u32;
        // SAFETY: the capture's graph and a live object; the graph takes
        // this thread's reference.
        let kept = on(device, "cuGraphRetainUserObject", || unsafe {
            sys::cuGraphRetainUserObject(graph, object, 1, moved)
        });
        if let Err(e) = kept {
            // SAFETY: this thread's reference; its release runs `run`,
            // which runs `release`.
            let _ = on(device, "cuUserObjectRelease", || unsafe {
                sys::cuUserObjectRelease(object, 1)
            });
            return Err(e);
        }
        Ok(true)
    }

    /// Makes the stream's later work wait for the work `event` was last
    /// recorded after (`cuStreamWaitEvent`); during a capture this forks
    /// the capture onto the stream, or joins it back. `event` must be of
    /// this stream's device.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        // SAFETY: a live event (owned by `event`) and a live stream.
        self.call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw(), 0)
        })
    }

    /// Launches `exec` on the stream (`cuGraphLaunch`).
    pub fn launch_graph(&self, exec: &GraphExec) -> Result<()> {
        // SAFETY: a live executable (owned by `exec`) and a live stream;
        // the executable's context is the caller's to match.
        self.call("cuGraphLaunch", || unsafe {
            sys::cuGraphLaunch(exec.raw(), self.raw)
        })
    }
}

impl Event {
    /// Records the event on `stream` (one of the event's device: the
    /// [`Stream`]'s contract).
    pub fn record_on(&self, stream: &Stream) -> Result<()> {
        // SAFETY: a Stream is a live stream (its from_raw contract).
        unsafe { self.record(stream.raw()) }
    }
}

/// A non-blocking stream created on a device's primary context and, on
/// drop, waited for and destroyed (in that context). Dereferences to its
/// [`Stream`].
#[derive(Debug)]
pub struct OwnedStream {
    stream: Stream,
}

impl OwnedStream {
    /// A new stream of `device` (`cuStreamCreate`,
    /// `CU_STREAM_NON_BLOCKING`), created with the device's primary
    /// context current.
    pub fn new(device: Device) -> Result<OwnedStream> {
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle.
        on(device, "cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(OwnedStream {
            stream: Stream { device, raw },
        })
    }

    /// A new stream of `device` like [`OwnedStream::new`], at the
    /// device's greatest priority: where its work and other streams'
    /// wait for the same SMs, the GPU starts its blocks first
    /// (`cuStreamCreateWithPriority`).
    pub fn greatest_priority(device: Device) -> Result<OwnedStream> {
        let (mut least, mut greatest) = (0i32, 0i32);
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes two integers, then one stream handle.
        on(device, "cuCtxGetStreamPriorityRange", || unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        // SAFETY: as above.
        on(device, "cuStreamCreateWithPriority", || unsafe {
            sys::cuStreamCreateWithPriority(&mut raw, flags, greatest)
        })?;
        Ok(OwnedStream {
            stream: Stream { device, raw },
        })
    }

    /// The stream, to pass on (valid while `self` lives).
    pub fn stream(&self) -> Stream {
        self.stream
    }
}

impl std::ops::Deref for OwnedStream {
    type Target = Stream;
    fn deref(&self) -> &Stream {
        &self.stream
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        let device = self.stream.device;
        let raw = self.stream.raw;
        // SAFETY: the stream made in `new`, live until destroyed below.
        let _ = on(device, "cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(raw)
        });
        // SAFETY: destroys the stream made in `new`, idle now, once.
        let _ = on(device, "cuStreamDestroy", || unsafe {
            sys::cuStreamDestroy_v2(raw)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_modes_map_to_the_driver_modes() {
        use sys::CUstreamCaptureMode as M;
        assert_eq!(
            CaptureMode::ThreadLocal.driver(),
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        );
        assert_eq!(
            CaptureMode::Global.driver(),
            M::CU_STREAM_CAPTURE_MODE_GLOBAL
        );
        assert_eq!(
            CaptureMode::Relaxed.driver(),
            M::CU_STREAM_CAPTURE_MODE_RELAXED
        );
    }

    #[test]
    fn a_handle_round_trips_and_null_is_the_legacy_stream() {
        // SAFETY: no driver call is made on these streams.
        let s = unsafe { Stream::from_handle(Device::cuda(1), 0x1234_5678) };
        assert_eq!(s.raw() as usize, 0x1234_5678);
        assert_eq!(s.device(), Device::cuda(1));
        assert!(!s.is_null());
        // SAFETY: as above.
        let legacy = unsafe { Stream::from_raw(Device::cuda(0), std::ptr::null_mut()) };
        assert!(legacy.is_null());
    }
}
