//! Driver objects that clean up after themselves: events and stream-ordered
//! allocations.

use cudarc::driver::sys;

use super::on;
use crate::{Device, Result};

/// A CUDA event of one device, destroyed on drop.
#[derive(Debug)]
pub struct Event {
    device: Device,
    event: sys::CUevent,
}

// SAFETY: a CUevent is an opaque driver handle; the driver API accepts it
// from any thread, and every use but the destroy makes its device's context
// current on the calling thread first (`on`).
unsafe impl Send for Event {}

impl Event {
    /// A timing event (`cuEventCreate` with default flags) on `device`.
    pub fn new(device: Device) -> Result<Event> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle through a valid pointer.
        on(device, "cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut event, 0)
        })?;
        Ok(Event { device, event })
    }

    /// An event for ordering streams only (`CU_EVENT_DISABLE_TIMING`:
    /// cheaper to record and wait on; [`Event::elapsed_ms_since`] refuses
    /// it).
    pub fn ordering(device: Device) -> Result<Event> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes one event handle through a valid pointer.
        on(device, "cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        Ok(Event { device, event })
    }

    /// The raw handle, for the stream calls of this crate.
    pub(crate) fn raw(&self) -> sys::CUevent {
        self.event
    }

    /// Records the event on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the event's device.
    pub unsafe fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the event is live; the stream is the caller's contract.
        on(self.device, "cuEventRecord", || unsafe {
            sys::cuEventRecord(self.event, stream)
        })
    }

    /// Waits on the host until the event's recorded work is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        on(self.device, "cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(self.event)
        })
    }

    /// Milliseconds from `start` to this event, both recorded; waits for
    /// this one first.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        self.synchronize()?;
        let mut ms = 0f32;
        // SAFETY: both events are live and recorded; writes one float.
        on(self.device, "cuEventElapsedTime", || unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, start.event, self.event)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuEventCreate and is destroyed once;
        // work that still records it completes first (driver semantics).
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// Device memory allocated in stream order (`cuMemAllocAsync`) and freed in
/// the same stream's order when dropped.
#[derive(Debug)]
pub struct StreamAlloc {
    device: Device,
    stream: sys::CUstream,
    address: u64,
}

impl StreamAlloc {
    /// `bytes` of device memory on `stream` (`bytes` = 0 allocates nothing
    /// and has address 0).
    ///
    /// # Safety
    /// `stream` must be a live stream of `device`, and outlive the
    /// allocation.
    pub unsafe fn new(device: Device, stream: sys::CUstream, bytes: usize) -> Result<StreamAlloc> {
        let mut address = 0;
        if bytes > 0 {
            // SAFETY: writes one device pointer; the stream is the caller's
            // contract.
            on(device, "cuMemAllocAsync", || unsafe {
                sys::cuMemAllocAsync(&mut address, bytes, stream)
            })?;
        }
        Ok(StreamAlloc {
            device,
            stream,
            address,
        })
    }

    /// The allocation's device address.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Copies `bytes` from the device address `src` into the allocation, in
    /// stream order.
    ///
    /// # Safety
    /// `src` must be `bytes` of readable memory of the device, and `bytes` at
    /// most the allocation's size.
    pub unsafe fn copy_from(&self, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract on `src` and `bytes`.
        on(self.device, "cuMemcpyDtoDAsync", || unsafe {
            sys::cuMemcpyDtoDAsync_v2(self.address, src, bytes, self.stream)
        })
    }
}

impl Drop for StreamAlloc {
    fn drop(&mut self) {
        if self.address == 0 {
            return;
        }
        // A failure leaves the allocation to the pool's release at context
        // teardown; there is no caller to report it to.
        // SAFETY: frees an allocation made on this stream, after the work
        // enqueued on it so far.
        let _ = on(self.device, "cuMemFreeAsync", || unsafe {
            sys::cuMemFreeAsync(self.address, self.stream)
        });
    }
}
