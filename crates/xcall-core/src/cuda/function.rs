//! Questions about loaded kernels and addresses: occupancy, function
//! attributes, a module's globals, and which device owns an address.
//!
//! The function calls make the device's primary context current for their
//! own duration ([`on`]); the pointer queries need no context.

use std::ffi::CStr;

use cudarc::driver::sys;

use super::{available, can_access_peer, check_device, on, CudaFunction, DriverError};
use crate::{Device, Result};

/// How many blocks of `function` fit on one SM at once with `threads`
/// threads per block and `shared_bytes` of dynamic shared memory
/// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`; 0 when none fits).
pub fn max_active_blocks(
    device: Device,
    function: &CudaFunction,
    threads: u32,
    shared_bytes: usize,
) -> Result<u32> {
    let mut blocks = 0i32;
    let call = "cuOccupancyMaxActiveBlocksPerMultiprocessor";
    let f = function.cu_function();
    // SAFETY: `function` is a live function (its module is held by the
    // caller's CudaFunction); writes one int.
    on(device, call, || unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &mut blocks,
            f,
            threads as i32,
            shared_bytes,
        )
    })?;
    Ok(blocks.max(0) as u32)
}

/// The most threads a block of `function` can have
/// (`cuFuncGetAttribute`, `MAX_THREADS_PER_BLOCK`).
pub fn max_threads_per_block(device: Device, function: &CudaFunction) -> Result<u32> {
    let mut n = 0i32;
    // SAFETY: a live function; writes one int.
    on(device, "cuFuncGetAttribute", || unsafe {
        sys::cuFuncGetAttribute(
            &mut n,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            function.cu_function(),
        )
    })?;
    Ok(n.max(0) as u32)
}

/// Lets `function` use up to `bytes` of dynamic shared memory
/// (`cuFuncSetAttribute`, `MAX_DYNAMIC_SHARED_SIZE_BYTES`); the driver
/// refuses more than the device has.
pub fn set_max_dynamic_shared(device: Device, function: &CudaFunction, bytes: u32) -> Result<()> {
    // SAFETY: sets an attribute of a live function.
    on(device, "cuFuncSetAttribute", || unsafe {
        sys::cuFuncSetAttribute(
            function.cu_function(),
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    })
}

/// The device address and size of the global `name` of the module
/// `function` belongs to (`cuFuncGetModule`, then `cuModuleGetGlobal`).
pub fn module_global(device: Device, function: &CudaFunction, name: &CStr) -> Result<(u64, usize)> {
    let (mut address, mut bytes) = (0u64, 0usize);
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: a live function (its module held by the caller); writes one
    // handle.
    on(device, "cuFuncGetModule", || unsafe {
        sys::cuFuncGetModule(&mut module, function.cu_function())
    })?;
    // SAFETY: a loaded module and a NUL-terminated name; writes the
    // global's address and size.
    on(device, "cuModuleGetGlobal", || unsafe {
        sys::cuModuleGetGlobal_v2(&mut address, &mut bytes, module, name.as_ptr())
    })?;
    Ok((address, bytes))
}

/// The ordinal of the CUDA device whose memory `address` is
/// (`cuPointerGetAttribute`, `DEVICE_ORDINAL`), or the driver's error for
/// an address that is not device memory (for example
/// `CUDA_ERROR_INVALID_VALUE`). Any address value may be asked about.
pub fn pointer_device(address: u64) -> Result<std::result::Result<u32, DriverError>> {
    available()?;
    let mut dev: i32 = -1;
    // SAFETY: writes one int; any address value is legal to query.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut dev as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            address,
        )
    };
    Ok(match r {
        sys::CUresult::CUDA_SUCCESS => Ok(dev.max(0) as u32),
        e => Err(DriverError(e)),
    })
}

/// Where an address is, seen from one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Memory of the device itself.
    Own,
    /// Memory of `Device`, which the device can access as a peer.
    Peer(Device),
    /// Memory of `Device`, which the device cannot access.
    Foreign(Device),
    /// Not device memory (the driver's answer).
    NotDevice(DriverError),
}

/// Whether `from` reaches `address`: its own memory, a peer's it can
/// access ([`can_access_peer`]), or neither. A failing peer query counts
/// as not reachable.
pub fn reach(from: Device, address: u64) -> Result<Reach> {
    let ordinal = check_device(from)?;
    Ok(match pointer_device(address)? {
        Err(e) => Reach::NotDevice(e),
        Ok(dev) if dev == ordinal => Reach::Own,
        Ok(dev) => {
            let owner = Device::cuda(dev);
            if can_access_peer(from, owner).unwrap_or(false) {
                Reach::Peer(owner)
            } else {
                Reach::Foreign(owner)
            }
        }
    })
}

impl Reach {
    /// Whether the device can read and write the address.
    pub fn reachable(&self) -> bool {
        matches!(self, Reach::Own | Reach::Peer(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_own_and_peer_memory_is_reachable() {
        assert!(Reach::Own.reachable());
        assert!(Reach::Peer(Device::cuda(1)).reachable());
        assert!(!Reach::Foreign(Device::cuda(1)).reachable());
        let invalid = DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE);
        assert!(!Reach::NotDevice(invalid).reachable());
    }
}
