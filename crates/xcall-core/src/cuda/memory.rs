//! Device memory outside a stream's order: allocation, blocking copies,
//! memory sizes, CUDA IPC and peer access. Each call makes the device's
//! primary context current for its own duration ([`on`]).

use cudarc::driver::sys;

use super::{driver_error, on, with_context};
use crate::{Device, Result};

/// `bytes` of device memory (`cuMemAlloc`), to be freed with [`mem_free`]
/// (exportable through [`ipc_handle`]).
pub fn mem_alloc(device: Device, bytes: usize) -> Result<u64> {
    let mut base = 0;
    // SAFETY: writes one device pointer through a valid reference.
    on(device, "cuMemAlloc", || unsafe {
        sys::cuMemAlloc_v2(&mut base, bytes)
    })?;
    Ok(base)
}

/// Frees memory from [`mem_alloc`] (`cuMemFree`).
///
/// # Safety
/// `base` came from [`mem_alloc`] on `device`, is freed once, and no work
/// that uses it is still to run.
pub unsafe fn mem_free(device: Device, base: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    on(device, "cuMemFree", || unsafe { sys::cuMemFree_v2(base) })
}

/// Free and total device memory in bytes (`cuMemGetInfo`).
pub fn mem_get_info(device: Device) -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two sizes through valid references.
    on(device, "cuMemGetInfo", || unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free, total))
}

/// Copies `src` (host memory) to `dst` and waits for the copy
/// (`cuMemcpyHtoD`).
///
/// # Safety
/// `dst` holds `size_of_val(src)` writable bytes of `device`.
pub unsafe fn copy_htod_sync<T: Copy>(device: Device, dst: u64, src: &[T]) -> Result<()> {
    let bytes = std::mem::size_of_val(src);
    // SAFETY: the caller's contract on `dst`; `src` is live host memory.
    on(device, "cuMemcpyHtoD", || unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), bytes)
    })
}

/// Copies from `src` into `dst` (host memory) and waits for the copy
/// (`cuMemcpyDtoH`).
///
/// # Safety
/// `src` holds `size_of_val(dst)` readable bytes of `device`.
pub unsafe fn copy_dtoh_sync<T: Copy>(device: Device, dst: &mut [T], src: u64) -> Result<()> {
    let bytes = std::mem::size_of_val(dst);
    // SAFETY: the caller's contract on `src`; `dst` is live host memory.
    on(device, "cuMemcpyDtoH", || unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, bytes)
    })
}

/// Sets `count` bytes at `dst` to `value` and waits (`cuMemsetD8`).
///
/// # Safety
/// `dst` holds `count` writable bytes of `device`.
pub unsafe fn memset_d8_sync(device: Device, dst: u64, value: u8, count: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    on(device, "cuMemsetD8", || unsafe {
        sys::cuMemsetD8_v2(dst, value, count)
    })
}

/// The CUDA IPC handle of an allocation (`cuIpcGetMemHandle`), 64 bytes
/// another process opens with [`ipc_open`].
///
/// # Safety
/// `base` is a live [`mem_alloc`] allocation of `device`.
pub unsafe fn ipc_handle(device: Device, base: u64) -> Result<[u8; 64]> {
    // SAFETY: a plain C struct of 64 chars; zero is a valid value.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's contract on `base`; writes the handle.
    on(device, "cuIpcGetMemHandle", || unsafe {
        sys::cuIpcGetMemHandle(&mut h, base)
    })?;
    let mut out = [0u8; 64];
    for (d, s) in out.iter_mut().zip(h.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(out)
}

/// Maps another process's allocation from its IPC handle
/// (`cuIpcOpenMemHandle`, peer access enabled lazily); close it with
/// [`ipc_close`].
pub fn ipc_open(device: Device, handle: &[u8; 64]) -> Result<u64> {
    // SAFETY: a plain C struct of 64 chars.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    for (d, s) in h.reserved.iter_mut().zip(handle) {
        *d = *s as _;
    }
    let mut base = 0;
    // SAFETY: opening any 64 bytes is legal (the driver refuses a handle
    // it does not know); writes one address.
    on(device, "cuIpcOpenMemHandle", || unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    Ok(base)
}

/// Unmaps an allocation opened with [`ipc_open`] (`cuIpcCloseMemHandle`).
///
/// # Safety
/// `base` came from [`ipc_open`] on `device`, is closed once, and no work
/// that uses it is still to run.
pub unsafe fn ipc_close(device: Device, base: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    on(device, "cuIpcCloseMemHandle", || unsafe {
        sys::cuIpcCloseMemHandle(base)
    })
}

/// Lets `from`'s primary context access `to`'s memory directly
/// (`cuCtxEnablePeerAccess`); already enabled is fine. The caller checks
/// [`can_access_peer`](super::can_access_peer) first for a better message.
pub fn enable_peer_access(from: Device, to: Device) -> Result<()> {
    let peer_ctx = with_context(to, |ctx| Ok(ctx.cu_ctx()))?;
    with_context(from, |_| {
        // SAFETY: `peer_ctx` is `to`'s primary context, retained for the
        // life of the process by with_context.
        match unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(driver_error(
                "cuCtxEnablePeerAccess",
                from,
                cudarc::driver::DriverError(e),
            )),
        }
    })
}

/// Whether the peers `peers` (devices of this process, whose primary
/// contexts have peer access to `device`'s: the caller's part) may read
/// `bytes` at `address`, memory of `device`: either one allocation of
/// `device`'s primary context made by `cuMemAlloc` (what
/// `cuCtxEnablePeerAccess` opens to peers), or a virtual-memory mapping
/// (`cuMemMap`, as XLA's allocator makes, and stream-ordered pool memory
/// alike) on `device` that grants every peer other than `device` read
/// access at both ends of the range (`cuMemGetAccess`). Managed and host
/// memory are not. An address the driver does not know is `false`; any
/// address value may be asked about.
pub fn peer_readable(device: Device, peers: &[Device], address: u64, bytes: usize) -> Result<bool> {
    let ordinal = super::check_device(device)?;
    let Some(last) = address.checked_add(bytes.max(1) as u64 - 1) else {
        return Ok(false);
    };
    with_context(device, |ctx| {
        use sys::CUpointer_attribute::*;
        let mut owner: sys::CUcontext = std::ptr::null_mut();
        let (mut ipc, mut mapped, mut on): (i32, i32, i32) = (0, 0, -1);
        let (mut start, mut size): (u64, usize) = (0, 0);
        let mut what = [
            CU_POINTER_ATTRIBUTE_CONTEXT,
            CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            CU_POINTER_ATTRIBUTE_MAPPED,
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut into: [*mut std::ffi::c_void; 6] = [
            (&mut owner as *mut sys::CUcontext).cast(),
            (&mut ipc as *mut i32).cast(),
            (&mut mapped as *mut i32).cast(),
            (&mut on as *mut i32).cast(),
            (&mut start as *mut u64).cast(),
            (&mut size as *mut usize).cast(),
        ];
        // SAFETY: each pointer of `into` points to a value of its
        // attribute's type (a context handle, ints, an address, a size);
        // any address value may be asked about (an unknown one gets the
        // empty values: no range).
        let known = unsafe {
            sys::cuPointerGetAttributes(6, what.as_mut_ptr(), into.as_mut_ptr(), address)
        } == sys::CUresult::CUDA_SUCCESS;
        let inside = start <= address && last < start.saturating_add(size as u64);
        if !known || !inside || on != ordinal as i32 {
            return Ok(false);
        }
        if owner == ctx.cu_ctx() && ipc != 0 {
            return Ok(true);
        }
        if !owner.is_null() || mapped == 0 {
            return Ok(false);
        }
        // A virtual-memory mapping: every peer must be granted reads.
        let reads = |peer: Device, at: u64| {
            let location = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: peer.ordinal as i32,
            };
            let mut flags: std::ffi::c_ulonglong = 0;
            // SAFETY: writes one flags word; the location is a value on
            // the stack; any address value is legal to query.
            let r = unsafe { sys::cuMemGetAccess(&mut flags, &location, at) };
            r == sys::CUresult::CUDA_SUCCESS
                && flags & sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ as u64 != 0
        };
        Ok(peers
            .iter()
            .filter(|&&p| p != device)
            .all(|&p| reads(p, address) && reads(p, last)))
    })
}
