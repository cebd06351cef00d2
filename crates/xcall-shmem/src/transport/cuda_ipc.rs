//! CUDA heaps and the pairs of one host: a PE's heap from the driver
//! (exportable through IPC) or from NCCL (for its windows), a peer's heap
//! opened from its IPC handle, and peer access between the GPUs of one
//! process.

use xcall_core::cuda;
use xcall_core::Device;

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
        let base = cuda::mem_alloc(device, len)
            .map_err(|e| ShmemError::from(e).context(format!("symmetric heap of {len} bytes")))?;
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
        // SAFETY: `base` is a live cuMemAlloc allocation of this device.
        Ok(unsafe { cuda::ipc_handle(self.device, self.base) }?.to_vec())
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
        let _ = unsafe { cuda::mem_free(self.device, self.base) };
    }
}

/// A peer's heap opened from its IPC handle (closed on drop).
pub(crate) struct IpcMapping {
    pub device: Device,
    pub base: u64,
}

impl IpcMapping {
    pub fn open(device: Device, handle: &[u8]) -> Result<IpcMapping> {
        let Ok(handle) = <&[u8; 64]>::try_from(handle) else {
            return Err(ShmemError::InvalidArgument(format!(
                "an IPC handle has 64 bytes, got {}",
                handle.len()
            )));
        };
        // The mapping is closed in Drop.
        let base = cuda::ipc_open(device, handle)?;
        Ok(IpcMapping { device, base })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: `base` came from ipc_open in this process, closed once.
        let _ = unsafe { cuda::ipc_close(self.device, self.base) };
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
    cuda::enable_peer_access(from, to)?;
    Ok(())
}
