//! CUDA heaps and the pairs of one host: a PE's heap from the driver
//! (exportable through IPC) or from NCCL (for its windows), a peer's heap
//! opened from its IPC handle, and peer access between the GPUs of one
//! process.

use cudarc::driver::sys;
use xcall_core::cuda::{self, driver_error};
use xcall_core::Device;

use crate::cuda::on;
use crate::error::{Result, ShmemError};
use crate::transport::nccl;

/// Device memory of one PE's heap (cuMemAlloc: exportable through IPC).
pub(crate) struct DeviceHeap {
    pub device: Device,
    pub base: u64,
    /// Allocated by NCCL (`ncclMemAlloc`), to be registered as a window;
    /// else by the driver (`cuMemAlloc`).
    pub nccl: bool,
}

impl DeviceHeap {
    /// A heap from the driver (`cuMemAlloc`): what IPC can export.
    pub fn new(device: Device, len: usize) -> Result<DeviceHeap> {
        let mut base = 0;
        // SAFETY: writes one device pointer through a valid reference.
        on(device, "cuMemAlloc", || unsafe {
            sys::cuMemAlloc_v2(&mut base, len)
        })
        .map_err(|e| e.context(format!("symmetric heap of {len} bytes")))?;
        Ok(DeviceHeap {
            device,
            base,
            nccl: false,
        })
    }

    /// A heap from NCCL (`ncclMemAlloc`): what an NCCL window can hold (IPC
    /// cannot export it).
    pub fn through_nccl(device: Device, len: usize) -> Result<DeviceHeap> {
        let base = nccl::alloc(device, len)?;
        Ok(DeviceHeap {
            device,
            base,
            nccl: true,
        })
    }

    /// The IPC handle of the heap, as 64 bytes.
    pub fn ipc_handle(&self) -> Result<Vec<u8>> {
        // SAFETY: a plain C struct of 64 chars; zero is a valid value.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is a live cuMemAlloc allocation of this device.
        on(self.device, "cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut h, self.base)
        })?;
        Ok(h.reserved.iter().map(|&c| c as u8).collect())
    }
}

impl Drop for DeviceHeap {
    fn drop(&mut self) {
        if self.nccl {
            nccl::free(self.device, self.base);
            return;
        }
        // SAFETY: frees the allocation made in `new`; peers closed their
        // mappings of it before (finalize's order).
        let _ = on(self.device, "cuMemFree", || unsafe {
            sys::cuMemFree_v2(self.base)
        });
    }
}

/// A peer's heap opened from its IPC handle (closed on drop).
pub(crate) struct IpcMapping {
    pub device: Device,
    pub base: u64,
}

impl IpcMapping {
    pub fn open(device: Device, handle: &[u8]) -> Result<IpcMapping> {
        if handle.len() != 64 {
            return Err(ShmemError::InvalidArgument(format!(
                "an IPC handle has 64 bytes, got {}",
                handle.len()
            )));
        }
        // SAFETY: a plain C struct of 64 chars.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut base = 0;
        // SAFETY: `h` is a handle another process exported; the mapping is
        // closed in Drop.
        on(device, "cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(IpcMapping { device, base })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: `base` came from cuIpcOpenMemHandle in this process.
        let _ = on(self.device, "cuIpcCloseMemHandle", || unsafe {
            sys::cuIpcCloseMemHandle(self.base)
        });
    }
}

/// Lets `from` access `to`'s memory directly (same process). Already
/// enabled is fine; a pair without peer access is an error naming it.
pub(crate) fn enable_peer_access(from: Device, to: Device, ranks: (usize, usize)) -> Result<()> {
    if from == to {
        return Ok(());
    }
    if !cuda::can_access_peer(from, to)? {
        return Err(ShmemError::Unsupported(format!(
            "rank {} ({from}) cannot access rank {} ({to}) directly: no peer access between these GPUs",
            ranks.0, ranks.1
        )));
    }
    let peer_ctx = cuda::with_context(to, |ctx| Ok(ctx.cu_ctx()))?;
    cuda::with_context(from, |_| {
        // SAFETY: `peer_ctx` is `to`'s primary context, retained for the
        // life of the process by with_context.
        match unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(driver_error(
                "cuCtxEnablePeerAccess",
                from,
                e.result().unwrap_err(),
            )),
        }
    })?;
    Ok(())
}
